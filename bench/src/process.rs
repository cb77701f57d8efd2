//! A real engine's server process, as the llama.cpp and vLLM launchers
//! run it: its own scratch folder with one log that keeps every start,
//! its loopback address, and its end by its own PID (its process group
//! too, for an engine that starts helpers). Dropping it stops the
//! process; during a panic its log's tail is printed, otherwise the
//! folder is removed.

use std::fs::File;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::bail;

/// Scratch folders made by this process so far (each server gets its own).
static FOLDERS: AtomicU32 = AtomicU32::new(0);

/// Where a server started on port 0 says its port: `parse` reads it from
/// the log it wrote since `since` (bytes).
#[derive(Clone, Copy)]
pub struct PortInLog {
    pub parse: fn(&str) -> Option<u16>,
    pub since: u64,
}

/// One engine server process the bench started.
pub struct ServerProcess {
    child: Option<Child>,
    /// Where it listens (kept across restarts).
    pub addr: SocketAddr,
    dir: PathBuf,
    log_name: &'static str,
    /// What the log printed during a panic is called.
    label: String,
    /// Sent as a bearer token to its `/metrics`.
    api_key: Option<String>,
    /// Its own process group (started with `process_group(0)`).
    group: bool,
    starts: u32,
}

impl ServerProcess {
    /// A process not started yet, with a new scratch folder
    /// `hearth-KIND-PID-N` in the temporary directory, logging to
    /// `log_name` there.
    pub fn new(
        kind: &str,
        log_name: &'static str,
        label: String,
        addr: SocketAddr,
        api_key: Option<String>,
        group: bool,
    ) -> anyhow::Result<ServerProcess> {
        let dir = std::env::temp_dir().join(format!(
            "hearth-{kind}-{}-{}",
            std::process::id(),
            FOLDERS.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir)?;
        Ok(ServerProcess {
            child: None,
            addr,
            dir,
            log_name,
            label,
            api_key,
            group,
            starts: 0,
        })
    }

    /// Opens the log for one more start, noting `program` and `args` in
    /// it, and returns it with its length before the child writes.
    pub fn log_for_start(
        &mut self,
        program: &Path,
        args: &[String],
    ) -> anyhow::Result<(File, u64)> {
        self.starts += 1;
        let path = self.log_path();
        let mut log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)?;
        std::io::Write::write_all(
            &mut log,
            format!(
                "--- hearth: start {} of {} {} ---\n",
                self.starts,
                program.display(),
                args.join(" ")
            )
            .as_bytes(),
        )?;
        let offset = std::fs::metadata(&path)?.len();
        Ok((log, offset))
    }

    /// Runs `cmd` as this server, its output to `log`.
    pub fn spawn(&mut self, mut cmd: Command, log: File) -> anyhow::Result<()> {
        cmd.stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        if self.group {
            std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        }
        self.child = Some(cmd.spawn()?);
        Ok(())
    }

    /// The exit status, when the process ended (or was never started).
    pub fn exited(&mut self) -> anyhow::Result<Option<std::process::ExitStatus>> {
        Ok(self
            .child
            .as_mut()
            .map(Child::try_wait)
            .transpose()?
            .flatten())
    }

    /// Waits, checking every `poll`, until `GET /health` answers 200;
    /// fails when the process exits or `deadline` passes. A server started
    /// on port 0 says its port in its log ([`PortInLog`]); health is asked
    /// once it has.
    pub async fn wait_ready(
        &mut self,
        deadline: Duration,
        poll: Duration,
        port_in_log: Option<PortInLog>,
    ) -> anyhow::Result<()> {
        let until = Instant::now() + deadline;
        let client = reqwest::Client::new();
        loop {
            if let Some(status) = self.exited()? {
                bail!("{} exited during start-up with {status}", self.label);
            }
            if Instant::now() > until {
                bail!("{} was not ready within {deadline:?}", self.label);
            }
            if let Some(p) = port_in_log.filter(|_| self.addr.port() == 0) {
                let log = std::fs::read(self.log_path())?;
                let since = log.get(p.since as usize..).unwrap_or_default();
                if let Some(port) = (p.parse)(&String::from_utf8_lossy(since)) {
                    self.addr.set_port(port);
                }
            }
            if self.addr.port() != 0 && self.healthy(&client).await {
                return Ok(());
            }
            tokio::time::sleep(poll).await;
        }
    }

    /// Whether `GET /health` answers 200 now.
    async fn healthy(&self, client: &reqwest::Client) -> bool {
        client
            .get(format!("{}/health", self.url()))
            .timeout(Duration::from_secs(2))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success())
    }

    /// Kills the process (SIGKILL, by its PID, and its group when it has
    /// one: an engine that crashed) and reaps it. The port stays free for
    /// a restart.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            if self.group {
                // The group's id is the server's PID.
                let _ = Command::new("kill")
                    .args(["-KILL", "--", &format!("-{}", child.id())])
                    .stderr(Stdio::null())
                    .status();
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Whether the process is alive.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.as_mut().map(Child::try_wait), Some(Ok(None)))
    }

    /// The process id (and group id, with a group) while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// `http://ip:port`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The log so far, every start included.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// The last `lines` lines of the log.
    pub fn log_tail(&self, lines: usize) -> String {
        let log = self.log();
        let all: Vec<&str> = log.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.join(self.log_name)
    }

    /// The folder holding the log (and the engine's scratch files).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `GET /metrics` (Prometheus text), with the key when the server has
    /// one.
    pub async fn metrics(&self) -> anyhow::Result<String> {
        let mut req = reqwest::Client::new().get(format!("{}/metrics", self.url()));
        if let Some(key) = &self.api_key {
            req = req.bearer_auth(key);
        }
        let resp = req.send().await?.error_for_status()?;
        Ok(resp.text().await?)
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        self.stop();
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        } else {
            eprintln!(
                "--- {} log ({}) ---\n{}",
                self.label,
                self.dir.display(),
                self.log_tail(200)
            );
        }
    }
}

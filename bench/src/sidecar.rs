//! The sidecar as a child process (the real `hearth-ext-proc` binary), for
//! the stacks of the benchmark's drivers ([`crate::stack`]): started with
//! its flags on given loopback ports, waited for, killed by its own PID.

use std::net::{SocketAddr, TcpListener as StdListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

/// A free loopback port (bound, read, released).
pub fn free_port() -> anyhow::Result<SocketAddr> {
    Ok(StdListener::bind("127.0.0.1:0")?.local_addr()?)
}

/// The sidecar binary next to this one (same cargo target directory; a
/// test binary lives one level down, in `deps/`).
pub fn binary() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let here = exe.with_file_name("hearth-ext-proc");
    let above = exe
        .parent()
        .and_then(|d| d.parent())
        .map(|d| d.join("hearth-ext-proc"));
    match [Some(here.clone()), above]
        .into_iter()
        .flatten()
        .find(|p| p.is_file())
    {
        Some(path) => Ok(path),
        None => bail!(
            "{} not found: build it with `cargo build --release -p hearth-ext-proc`",
            here.display()
        ),
    }
}

/// A running `hearth-ext-proc`, killed when dropped.
pub struct SidecarProcess {
    child: Child,
    pub grpc: SocketAddr,
    pub admin: SocketAddr,
}

impl SidecarProcess {
    /// Starts the sidecar with `args` (its flags: `--upstreams=..`,
    /// `--listen=..`, `--admin-listen=ADMIN`, ...) and waits until its
    /// health endpoint on `admin` answers.
    pub async fn spawn(args: &[String], admin: SocketAddr) -> anyhow::Result<SidecarProcess> {
        let grpc = args
            .iter()
            .find_map(|a| a.strip_prefix("--listen=")?.parse().ok())
            .context("the sidecar's arguments name no --listen address")?;
        let mut cmd = Command::new(binary()?);
        cmd.args(args)
            .env(
                "HEARTH_LOG",
                std::env::var("HEARTH_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdin(Stdio::null());
        let child = cmd.spawn().context("starting hearth-ext-proc")?;
        let mut sidecar = SidecarProcess { child, grpc, admin };
        sidecar.wait_ready().await?;
        Ok(sidecar)
    }

    async fn wait_ready(&mut self) -> anyhow::Result<()> {
        let until = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = self.child.try_wait()? {
                bail!("hearth-ext-proc exited with {status}");
            }
            if reqwest::get(format!("http://{}/health", self.admin))
                .await
                .is_ok()
            {
                return Ok(());
            }
            if Instant::now() > until {
                bail!("hearth-ext-proc did not come up within 20 s");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Resident memory, from `/proc/<pid>/status`.
    pub fn rss_bytes(&self) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).ok()?;
        let kib: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))?
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()?;
        Some(kib * 1024)
    }
}

impl Drop for SidecarProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

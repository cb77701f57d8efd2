//! The peer routers the benchmark runs beside Envoy's policies and
//! Hearth, as their own releases: SGLang's model gateway (PyPI `smg`,
//! `smg launch`) and vLLM's router (PyPI `vllm-router`), both installed
//! by `scripts/setup-peers` and linked at `.hearth/peers/`.
//!
//! A [`Peer`] starts one of them on a free loopback port in front of
//! given engines (`--worker-urls`), its metrics listener on another free
//! loopback port (both default to fixed ports), waits with a deadline
//! until it routes to every engine, keeps its log and stops it by its PID
//! (and process group) when dropped, as the engine launchers do
//! ([`ServerProcess`]).
//!
//! Neither needs a tokenizer: given no `--model-path` / `--tokenizer-path`,
//! both match prefixes on the request's text (smg: "StringTree, HTTP, raw
//! text"), so nothing is downloaded at start.
//!
//! Which engine served an answer: smg names it in
//! `x-smg-routed-worker-id` (the worker's URL); vllm-router names none, so
//! the engine's own answer does ([`ENGINE_ID_HEADER`] on the simulated
//! engine, which both routers pass through unchanged, as Envoy does).
//! The benchmark counts every policy's stays from the engine's header
//! and checks a router's own naming against it ([`Served`]).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::Serialize;

use crate::engine::ENGINE_ID_HEADER;
use crate::gateway::search_roots;
use crate::process::ServerProcess;
use crate::sidecar::free_port;

/// Where `scripts/setup-peers` links the routers, under the repository.
pub const INSTALL_RELATIVE: &str = ".hearth/peers";

/// smg's response header naming the worker it routed to (its URL).
pub const SMG_WORKER_HEADER: &str = "x-smg-routed-worker-id";

/// A peer router.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PeerKind {
    /// SGLang's model gateway, `smg launch` (PyPI `smg` 1.13.0).
    Smg,
    /// vLLM's router, `vllm-router` (PyPI `vllm-router` 0.1.17).
    VllmRouter,
}

impl PeerKind {
    /// The command's name (and the link under `.hearth/peers/`).
    pub fn program(self) -> &'static str {
        match self {
            PeerKind::Smg => "smg",
            PeerKind::VllmRouter => "vllm-router",
        }
    }

    /// The variable that names the binary instead.
    pub fn env(self) -> &'static str {
        match self {
            PeerKind::Smg => "HEARTH_SMG",
            PeerKind::VllmRouter => "HEARTH_VLLM_ROUTER",
        }
    }

    /// The PyPI release `scripts/setup-peers` installs.
    pub fn release(self) -> &'static str {
        match self {
            PeerKind::Smg => "smg==1.13.0",
            PeerKind::VllmRouter => "vllm-router==0.1.17",
        }
    }

    /// The router's binary: `$HEARTH_SMG` / `$HEARTH_VLLM_ROUTER`, else
    /// `.hearth/peers/<program>` in the current directory, the
    /// executable's directory or one of their ancestors.
    pub fn find(self) -> anyhow::Result<PathBuf> {
        if let Some(p) = std::env::var_os(self.env()).filter(|p| !p.is_empty()) {
            let p = PathBuf::from(p);
            if !p.is_file() {
                bail!(
                    "{}={} is not a file (unset it to use the one scripts/setup-peers links at \
                     {INSTALL_RELATIVE}/{})",
                    self.env(),
                    p.display(),
                    self.program()
                );
            }
            return Ok(p);
        }
        search_roots()
            .iter()
            .flat_map(|dir| {
                dir.ancestors()
                    .map(|base| base.join(INSTALL_RELATIVE).join(self.program()))
            })
            .find(|p| p.is_file())
            .with_context(|| self.not_installed())
    }

    /// What [`PeerKind::find`] says when the router is not installed.
    pub fn not_installed(self) -> String {
        format!(
            "{} is not installed: run scripts/setup-peers (it installs PyPI {} once per machine \
             and links it at {INSTALL_RELATIVE}/{}) or set {}",
            self.program(),
            self.release(),
            self.program(),
            self.env()
        )
    }
}

/// One peer router configuration: the router, its policy, and flags
/// beyond its defaults.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PeerConfig {
    pub kind: PeerKind,
    /// `--policy`.
    pub policy: String,
    /// More flags (a tuning), after the launcher's own.
    pub extra: Vec<String>,
    /// `--api-key`: the key the router sends to the workers (and, for
    /// smg, requires of its clients).
    #[serde(skip)]
    pub api_key: Option<String>,
}

impl PeerConfig {
    /// `kind` with `policy` at its defaults.
    pub fn new(kind: PeerKind, policy: &str) -> PeerConfig {
        PeerConfig {
            kind,
            policy: policy.to_string(),
            extra: Vec::new(),
            api_key: None,
        }
    }

    /// Adds flags after the launcher's own.
    pub fn with<I: IntoIterator<Item = S>, S: Into<String>>(mut self, flags: I) -> Self {
        self.extra.extend(flags.into_iter().map(Into::into));
        self
    }

    /// The router's command line (without the program) in front of
    /// `engines`, listening on `listen`, its metrics on `metrics`.
    pub fn args(
        &self,
        engines: &[SocketAddr],
        listen: SocketAddr,
        metrics: SocketAddr,
    ) -> Vec<String> {
        let mut args = Vec::new();
        if self.kind == PeerKind::Smg {
            args.push("launch".to_string());
        }
        args.extend([
            "--host".to_string(),
            listen.ip().to_string(),
            "--port".into(),
            listen.port().to_string(),
            "--prometheus-host".into(),
            metrics.ip().to_string(),
            "--prometheus-port".into(),
            metrics.port().to_string(),
            "--policy".into(),
            self.policy.clone(),
            // Per-request logs at info would cost the benchmark's CPU.
            "--log-level".into(),
            match self.kind {
                PeerKind::Smg => "warn",
                PeerKind::VllmRouter => "warning",
            }
            .into(),
            "--worker-urls".into(),
        ]);
        args.extend(engines.iter().map(|a| format!("http://{a}")));
        if let Some(key) = &self.api_key {
            args.extend(["--api-key".to_string(), key.clone()]);
        }
        args.extend(self.extra.iter().cloned());
        args
    }

    /// The command line as printed, the key hidden.
    pub fn shown(&self) -> String {
        let mut parts = vec![
            self.kind.program().to_string(),
            format!("--policy {}", self.policy),
        ];
        parts.extend(self.extra.iter().cloned());
        if self.api_key.is_some() {
            parts.push("--api-key ***".into());
        }
        parts.join(" ")
    }
}

/// A running peer router.
pub struct Peer {
    server: ServerProcess,
    config: PeerConfig,
    engines: Vec<SocketAddr>,
    /// Where it serves its Prometheus metrics.
    metrics: SocketAddr,
    /// Its command line, as started (the key hidden).
    pub command: String,
}

impl Peer {
    /// Where its Prometheus metrics are served (`http://HOST:PORT`).
    pub fn metrics_url(&self) -> String {
        format!("http://{}", self.metrics)
    }

    /// Starts the router in front of `engines` and waits up to `deadline`
    /// until it answers `/health` and (smg) lists every engine as a
    /// healthy worker.
    pub async fn start(
        config: &PeerConfig,
        engines: &[SocketAddr],
        deadline: Duration,
    ) -> anyhow::Result<Peer> {
        anyhow::ensure!(
            !engines.is_empty(),
            "a peer router needs at least one engine"
        );
        let program = config.kind.find()?;
        let (listen, metrics) = (free_port()?, free_port()?);
        let mut server = ServerProcess::new(
            config.kind.program(),
            "router.log",
            config.kind.program().to_string(),
            listen,
            None,
            true,
        )?;
        let args = config.args(engines, listen, metrics);
        let shown: Vec<String> = {
            let mut hide = false;
            args.iter()
                .map(|a| {
                    if std::mem::take(&mut hide) {
                        "***".to_string()
                    } else {
                        hide = a == "--api-key";
                        a.clone()
                    }
                })
                .collect()
        };
        let (log, _) = server.log_for_start(&program, &shown)?;
        let mut cmd = Command::new(&program);
        cmd.args(&args);
        server
            .spawn(cmd, log)
            .with_context(|| format!("starting {}", program.display()))?;
        let mut peer = Peer {
            server,
            config: config.clone(),
            engines: engines.to_vec(),
            metrics,
            command: format!("{} {}", program.display(), shown.join(" ")),
        };
        if let Err(e) = peer.wait_ready(deadline).await {
            bail!(
                "{e:#}\n--- {} log ({}) ---\n{}",
                config.kind.program(),
                peer.server.log_path().display(),
                peer.server.log_tail(60)
            );
        }
        Ok(peer)
    }

    async fn wait_ready(&mut self, deadline: Duration) -> anyhow::Result<()> {
        let until = Instant::now() + deadline;
        self.server
            .wait_ready(deadline, Duration::from_millis(100), None)
            .await?;
        if self.config.kind != PeerKind::Smg {
            // vllm-router serves only once every worker answered its
            // health check.
            return Ok(());
        }
        // smg answers /health at once and registers its workers in the
        // background.
        let client = reqwest::Client::new();
        loop {
            let workers: Option<serde_json::Value> = async {
                let mut req = client
                    .get(format!("{}/workers", self.url()))
                    .timeout(Duration::from_secs(2));
                if let Some(key) = &self.config.api_key {
                    req = req.bearer_auth(key);
                }
                req.send().await.ok()?.json().await.ok()
            }
            .await;
            let healthy = workers
                .as_ref()
                .and_then(|w| w["workers"].as_array())
                .map_or(0, |ws| {
                    ws.iter().filter(|w| w["is_healthy"] == true).count()
                });
            if healthy >= self.engines.len() {
                return Ok(());
            }
            if let Some(status) = self.server.exited()? {
                bail!("smg exited during start-up with {status}");
            }
            if Instant::now() > until {
                bail!(
                    "smg listed {healthy} of {} workers as healthy within {deadline:?}: {}",
                    self.engines.len(),
                    workers.map_or("no /workers answer".into(), |w| w.to_string())
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// `http://ip:port` of the router.
    pub fn url(&self) -> String {
        self.server.url()
    }

    /// The router's own metrics (Prometheus text), if it answers.
    pub async fn metrics(&self) -> Option<String> {
        let url = format!("http://{}/metrics", self.metrics);
        let answer = reqwest::Client::new()
            .get(url)
            .timeout(Duration::from_secs(5))
            .send()
            .await
            .ok()?;
        answer.text().await.ok()
    }

    /// The router's configuration.
    pub fn config(&self) -> &PeerConfig {
        &self.config
    }

    /// The router's process id (and process group id).
    pub fn pid(&self) -> Option<u32> {
        self.server.pid()
    }

    /// The router's log so far.
    pub fn log(&self) -> String {
        self.server.log()
    }

    /// Where the log is (removed when the peer is dropped, unless a
    /// panic is under way).
    pub fn log_path(&self) -> PathBuf {
        self.server.log_path()
    }

    /// Copies the log to `to`.
    pub fn keep_log(&self, to: &Path) -> anyhow::Result<()> {
        std::fs::copy(self.server.log_path(), to)?;
        Ok(())
    }
}

/// Which engine served an answer, as its headers say.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Served {
    /// From the engine's own [`ENGINE_ID_HEADER`], which every front
    /// passes through: the one measure used for every policy.
    pub engine: Option<usize>,
    /// From the router's own header, where it has one: smg's
    /// [`SMG_WORKER_HEADER`] (the worker's URL) or the sidecar's
    /// [`hearth_wire::names::UPSTREAM`] (the replica id, which the
    /// benchmark makes the engine's id). vllm-router names none.
    pub router: Option<usize>,
}

impl Served {
    /// Reads both from `headers`; `engines[i]` has address `addrs[i]` and
    /// id `ids[i]`.
    pub fn from_headers(
        headers: &reqwest::header::HeaderMap,
        addrs: &[SocketAddr],
        ids: &[String],
    ) -> Served {
        let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
        let by_id = |id: &str| ids.iter().position(|e| e == id);
        let by_url = |url: &str| {
            let addr = url
                .trim_start_matches("http://")
                .trim_start_matches("https://")
                .trim_end_matches('/');
            let addr: SocketAddr = addr.parse().ok()?;
            addrs.iter().position(|e| *e == addr)
        };
        Served {
            engine: text(ENGINE_ID_HEADER).and_then(by_id),
            router: text(SMG_WORKER_HEADER)
                .and_then(by_url)
                .or_else(|| text(hearth_wire::names::UPSTREAM).and_then(by_id)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addrs() -> Vec<SocketAddr> {
        vec![
            "127.0.0.1:8001".parse().unwrap(),
            "127.0.0.1:8002".parse().unwrap(),
        ]
    }

    #[test]
    fn command_lines_bind_loopback_and_list_every_engine() {
        let listen: SocketAddr = "127.0.0.1:9000".parse().unwrap();
        let metrics: SocketAddr = "127.0.0.1:9001".parse().unwrap();
        let smg = PeerConfig::new(PeerKind::Smg, "cache_aware").with(["--cache-threshold", "0.1"]);
        let a = smg.args(&addrs(), listen, metrics).join(" ");
        assert!(a.starts_with("launch --host 127.0.0.1 --port 9000 --prometheus-host 127.0.0.1 --prometheus-port 9001 --policy cache_aware"), "{a}");
        assert!(
            a.ends_with(
                "--worker-urls http://127.0.0.1:8001 http://127.0.0.1:8002 --cache-threshold 0.1"
            ),
            "{a}"
        );
        let vr = PeerConfig {
            api_key: Some("k".into()),
            ..PeerConfig::new(PeerKind::VllmRouter, "consistent_hash")
        };
        let a = vr.args(&addrs(), listen, metrics).join(" ");
        // No `launch` subcommand, and vllm-router's own level names.
        assert!(a.starts_with("--host 127.0.0.1 --port 9000"), "{a}");
        assert!(
            a.contains("--policy consistent_hash --log-level warning"),
            "{a}"
        );
        assert!(a.ends_with("--api-key k"), "{a}");
        assert_eq!(
            vr.shown(),
            "vllm-router --policy consistent_hash --api-key ***"
        );
    }

    #[test]
    fn the_engine_names_itself_and_the_router_names_its_choice() {
        let ids = vec!["engine-0".to_string(), "engine-1".to_string()];
        let served = |pairs: &[(&'static str, &str)]| {
            let mut h = reqwest::header::HeaderMap::new();
            for (k, v) in pairs {
                h.insert(*k, v.parse().unwrap());
            }
            Served::from_headers(&h, &addrs(), &ids)
        };
        assert_eq!(served(&[]), Served::default());
        // vllm-router: only the engine's own header.
        assert_eq!(
            served(&[("x-engine-id", "engine-1")]),
            Served {
                engine: Some(1),
                router: None
            }
        );
        // smg: its worker URL, read apart from the engine's header (a
        // disagreement stays visible).
        assert_eq!(
            served(&[
                ("x-engine-id", "engine-1"),
                (SMG_WORKER_HEADER, "http://127.0.0.1:8001"),
            ]),
            Served {
                engine: Some(1),
                router: Some(0)
            }
        );
        assert_eq!(
            served(&[(SMG_WORKER_HEADER, "http://127.0.0.1:8002/")]).router,
            Some(1)
        );
        // A worker that is not one of ours, an unknown engine id.
        assert_eq!(
            served(&[
                ("x-engine-id", "engine-9"),
                (SMG_WORKER_HEADER, "http://127.0.0.1:9999"),
            ]),
            Served::default()
        );
        // The sidecar's replica id (the engine's id in the benchmark).
        assert_eq!(served(&[("x-hearth-upstream", "engine-0")]).router, Some(0));
    }

    #[test]
    fn a_missing_router_names_the_setup_step() {
        let e = PeerKind::VllmRouter.not_installed();
        assert!(
            e.contains("run scripts/setup-peers") && e.contains("vllm-router==0.1.17"),
            "{e}"
        );
        assert!(
            e.contains(".hearth/peers/vllm-router") && e.contains("HEARTH_VLLM_ROUTER"),
            "{e}"
        );
        assert!(PeerKind::Smg.not_installed().contains("smg==1.13.0"));
    }
}

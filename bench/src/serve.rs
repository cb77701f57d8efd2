//! `hearth-bench serve`: start a fleet of simulated engines and serve until
//! Ctrl-C or SIGTERM.
//!
//! Prints one line per engine to stdout, `engine-<i> http://<addr>`, so
//! scripts can read the addresses; logs go to stderr.

use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use anyhow::Context;
use clap::Args;

use crate::engine::{self, EngineConfig, EngineHandle, Fault};

/// Settings of `hearth-bench serve`.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Number of engine replicas to start.
    #[arg(long, default_value_t = 4)]
    pub replicas: usize,
    /// Address to listen on.
    #[arg(long, default_value_t = IpAddr::V4(Ipv4Addr::LOCALHOST))]
    pub listen: IpAddr,
    /// Port of the first replica; replica i listens on base-port + i. 0 picks
    /// an ephemeral port for every replica.
    #[arg(long, default_value_t = 0)]
    pub base_port: u16,
    #[command(flatten)]
    pub engine: EngineArgs,
}

/// Per-engine settings shared by every subcommand that starts engines.
#[derive(Debug, Clone, Args)]
pub struct EngineArgs {
    /// Model name served by /v1/models.
    #[arg(long, default_value = "hearth-sim")]
    pub model: String,
    /// Tokens per KV cache block.
    #[arg(long, default_value_t = 16)]
    pub block_tokens: usize,
    /// Prompt bytes per simulated token.
    #[arg(long, default_value_t = 4)]
    pub bytes_per_token: usize,
    /// Prefix cache capacity per replica, in tokens.
    #[arg(long, default_value_t = 1_000_000)]
    pub cache_capacity_tokens: usize,
    /// Prefill cost per uncached prompt token, in engine microseconds.
    #[arg(long, default_value_t = 0.0)]
    pub prefill_us_per_token: f64,
    /// Decode cost per output token, in engine microseconds.
    #[arg(long, default_value_t = 0.0)]
    pub decode_us_per_token: f64,
    /// Engine time is divided by this (10 runs ten times faster than real time).
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Output tokens when a request sets no max_tokens.
    #[arg(long, default_value_t = 16)]
    pub output_tokens: usize,
    /// A fault for one replica from the start, `INDEX=FAULT` (repeatable):
    /// none, slow:MILLIS, error, unavailable, stall, empty, reset, close or
    /// close:TIMES. Change it at run time with
    /// `PUT /admin/fault {"fault": "..."}` on the replica.
    #[arg(long, value_parser = parse_replica_fault)]
    pub fault: Vec<(usize, Fault)>,
    /// Requests generated at once per replica; the rest queue (0 = no limit).
    #[arg(long, default_value_t = 0)]
    pub max_running: usize,
    /// Run requests through the engine scheduler the simulator uses (its
    /// default cost model: batched steps, chunked prefill, a FIFO queue)
    /// instead of the per-token costs and `--max-running`.
    #[arg(long)]
    pub scheduled: bool,
    /// Answer like a reasoning model: the first N output tokens of each
    /// chat answer go to `reasoning_content`, the rest to `content`.
    #[arg(long, default_value_t = 0)]
    pub reasoning_tokens: usize,
    /// Require this bearer key on `/v1/*` and `/metrics` (401 without it).
    #[arg(long)]
    pub api_key: Option<String>,
    /// Publish each replica's KV cache events as vLLM does (ZMQ PUB on a
    /// loopback port of its own, and a replay socket on another; list
    /// them as `;kv_events=tcp://...;kv_events_replay=tcp://...`).
    #[arg(long)]
    pub kv_events: bool,
}

impl EngineArgs {
    /// The engine settings for replica `index`.
    pub fn config(&self, index: usize) -> EngineConfig {
        EngineConfig {
            id: format!("engine-{index}"),
            model: self.model.clone(),
            block_tokens: self.block_tokens,
            bytes_per_token: self.bytes_per_token,
            cache_capacity_tokens: self.cache_capacity_tokens,
            prefill_micros_per_token: self.prefill_us_per_token,
            decode_micros_per_token: self.decode_us_per_token,
            time_scale: self.time_scale,
            default_output_tokens: self.output_tokens,
            max_running: self.max_running,
            scheduler: self.scheduled.then(crate::engine::core::CostModel::default),
            reasoning_tokens: self.reasoning_tokens,
            api_key: self.api_key.clone(),
            kv_events: self.kv_events.then(|| "tcp://127.0.0.1:0".to_owned()),
            kv_events_replay: self.kv_events.then(|| "tcp://127.0.0.1:0".to_owned()),
            fault: self
                .fault
                .iter()
                .find(|(i, _)| *i == index)
                .map_or(Fault::None, |(_, f)| *f),
        }
    }
}

/// Start `args.replicas` engines; the addresses are in the handles.
pub async fn start_fleet(args: &ServeArgs) -> anyhow::Result<Vec<EngineHandle>> {
    anyhow::ensure!(args.replicas > 0, "--replicas must be at least 1");
    // Check the settings once, before binding anything.
    args.engine.config(0).validate()?;
    let mut handles = Vec::with_capacity(args.replicas);
    for i in 0..args.replicas {
        let port = if args.base_port == 0 {
            0
        } else {
            u16::try_from(i)
                .ok()
                .and_then(|i| args.base_port.checked_add(i))
                .with_context(|| format!("--base-port {} + {i} is not a port", args.base_port))?
        };
        let addr = SocketAddr::new(args.listen, port);
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen on {addr}"))?;
        handles.push(engine::spawn(args.engine.config(i), listener).await?);
    }
    Ok(handles)
}

/// Run `hearth-bench serve` until Ctrl-C or SIGTERM.
pub async fn run(args: ServeArgs) -> anyhow::Result<()> {
    let handles = start_fleet(&args).await?;
    {
        let mut out = std::io::stdout().lock();
        for h in &handles {
            let (id, url) = (&h.engine.config().id, h.url());
            match (
                h.engine.kv_events_endpoint(),
                h.engine.kv_events_replay_endpoint(),
            ) {
                (Some(kv), Some(replay)) => {
                    writeln!(out, "{id} {url} kv_events={kv} kv_events_replay={replay}")?
                }
                (Some(kv), None) => writeln!(out, "{id} {url} kv_events={kv}")?,
                _ => writeln!(out, "{id} {url}")?,
            }
        }
        out.flush()?;
    }
    tracing::info!(replicas = handles.len(), "engines ready");
    shutdown_signal().await?;
    tracing::info!("shutting down");
    futures::future::join_all(handles.into_iter().map(EngineHandle::shutdown)).await;
    Ok(())
}

async fn shutdown_signal() -> anyhow::Result<()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate()).context("install SIGTERM handler")?;
        tokio::select! {
            r = tokio::signal::ctrl_c() => r.context("wait for Ctrl-C")?,
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    tokio::signal::ctrl_c().await.context("wait for Ctrl-C")?;
    Ok(())
}

fn parse_replica_fault(s: &str) -> Result<(usize, Fault), String> {
    let (i, f) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?} is not INDEX=FAULT"))?;
    let i = i
        .trim()
        .parse()
        .map_err(|_| format!("bad replica index in {s:?}"))?;
    Ok((i, f.parse()?))
}

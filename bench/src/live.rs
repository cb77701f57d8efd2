//! `hearth-bench live`: a scenario's workload through the real system
//! (Envoy with filter-wasm, the `hearth-ext-proc` process, HTTP engines on
//! loopback, time-scaled), then the same cell in the discrete-event
//! simulator, side by side, so the simulation is checked against the real
//! path.
//!
//! The HTTP engines run the simulator's own scheduler and cost model
//! ([`crate::engine::scheduled`]), time-scaled, so what differs between
//! the two columns is the real path itself: HTTP, Envoy and the filter,
//! the sidecar process, and timers at the scaled rate.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use futures::StreamExt;
use serde_json::Value;

use crate::engine::EngineConfig;
use crate::policies::PolicyKind;
use crate::report::{self, RequestRecord, RunResult};
use crate::scenario::Scenario;
use crate::sim::{self, RunSpec};
use crate::stack::Stack;
use crate::workload::{Client, Generator};

const MODEL: &str = "hearth-sim";

#[derive(Debug, Clone, Args)]
pub struct LiveArgs {
    /// Scenario preset (its workload, fleet, cache and sidecar knobs).
    #[arg(long, default_value = "cache-runs-out")]
    pub scenario: String,
    /// Agents (clients).
    #[arg(long, default_value_t = 16)]
    pub agents: usize,
    /// Replicas (default: the scenario's).
    #[arg(long)]
    pub replicas: Option<usize>,
    /// Wall-clock seconds of traffic; the first fifth is warm-up.
    #[arg(long, default_value_t = 60)]
    pub seconds: u64,
    /// Engine and think times are divided by this.
    #[arg(long, default_value_t = 10.0)]
    pub time_scale: f64,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Also write both rows as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Sidecar settings (`--set HEARTH_NAME=VALUE`): the same for the
    /// sidecar process and the simulator's router.
    #[command(flatten)]
    pub sidecar: crate::settings::SidecarSettings,
}

struct Shared {
    records: Vec<RequestRecord>,
}

/// One turn through the gateway; fills a record (times in engine seconds).
async fn send(
    client: &reqwest::Client,
    url: &str,
    body: &[u8],
    scale: f64,
) -> (Option<usize>, f64, f64, u32, u32, bool) {
    let mut v: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    v["stream"] = Value::Bool(true);
    let started = Instant::now();
    let resp = match client.post(url).json(&v).send().await {
        Ok(r) if r.status().is_success() => r,
        _ => return (None, 0.0, 0.0, 0, 0, true),
    };
    let replica = resp
        .headers()
        .get("x-hearth-upstream")
        .and_then(|h| h.to_str().ok())
        .and_then(|id| id.strip_prefix("engine-"))
        .and_then(|n| n.parse().ok());
    let mut ttft = None;
    let mut text = Vec::new();
    let mut chunks = resp.bytes_stream();
    while let Some(c) = chunks.next().await {
        match c {
            Ok(c) => {
                ttft.get_or_insert_with(|| started.elapsed().as_secs_f64());
                text.extend_from_slice(&c);
            }
            Err(_) => return (replica, 0.0, 0.0, 0, 0, true),
        }
    }
    let e2e = started.elapsed().as_secs_f64();
    let usage = String::from_utf8_lossy(&text)
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find(|v| v["usage"].is_object())
        .map(|v| v["usage"].clone())
        .unwrap_or(Value::Null);
    let prompt = usage["prompt_tokens"].as_u64().unwrap_or(0) as u32;
    let cached = usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0) as u32;
    (
        replica,
        ttft.unwrap_or(e2e) * scale,
        e2e * scale,
        prompt,
        cached,
        false,
    )
}

async fn agent(
    mut c: Client,
    url: String,
    scale: f64,
    start: Instant,
    warmup: Duration,
    until: Instant,
    shared: Arc<Mutex<Shared>>,
) {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap_or_default();
    let mut last: Option<(u64, usize)> = None;
    while Instant::now() < until {
        let turn = c.next_turn();
        let sent = Instant::now();
        let (replica, ttft_s, e2e_s, prompt, cached, failed) =
            send(&http, &url, &turn.body, scale).await;
        let stayed = match (turn.first_of_session, last, replica) {
            (false, Some((session, prev)), Some(r)) if session == turn.session => Some(prev == r),
            _ => None,
        };
        if let Some(r) = replica {
            last = Some((turn.session, r));
        }
        if sent.duration_since(start) >= warmup {
            let record = RequestRecord {
                replica: replica.unwrap_or(0),
                sent_s: sent.duration_since(start).as_secs_f64() * scale,
                ttft_s,
                e2e_s,
                prompt_tokens: prompt,
                cached_tokens: cached,
                // A live run cannot see what one fleet-wide cache would hold.
                ideal_cached_tokens: cached,
                output_tokens: turn.output_tokens,
                stayed,
                restart: turn.restart,
                long: false,
                failed,
                predicted_cached_tokens: None,
            };
            shared
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .records
                .push(record);
        }
        let think = Duration::from_secs_f64(c.think_seconds() / scale);
        tokio::time::sleep(think.min(until.saturating_duration_since(Instant::now()))).await;
    }
}

pub async fn run(args: LiveArgs) -> anyhow::Result<()> {
    let rows = measure(&args).await?;
    println!("{}", report::table(&rows));
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b != 0.0 => format!("{:.2}", a / b),
        _ => "-".into(),
    };
    println!(
        "live / sim: turns/min {}, cached fraction {}, stay rate {}, TTFT p50 {}",
        ratio(Some(rows[1].turns_per_min), Some(rows[0].turns_per_min)),
        ratio(Some(rows[1].cached_fraction), Some(rows[0].cached_fraction)),
        ratio(rows[1].stay_rate, rows[0].stay_rate),
        ratio(Some(rows[1].ttft_p50_s), Some(rows[0].ttft_p50_s)),
    );
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_vec_pretty(&rows)?)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// Runs the cell live, then simulated; returns the simulated row first.
pub async fn measure(args: &LiveArgs) -> anyhow::Result<Vec<report::Row>> {
    anyhow::ensure!(
        args.time_scale > 0.0 && args.time_scale.is_finite(),
        "--time-scale must be > 0"
    );
    anyhow::ensure!(args.seconds >= 10, "--seconds must be at least 10");
    let mut sc: Scenario = Scenario::preset(&args.scenario)
        .with_context(|| format!("unknown scenario {:?}", args.scenario))?;
    if let Some(r) = args.replicas {
        sc.replicas = r;
    }
    sc.hearth.set(args.sidecar.set.iter().cloned())?;
    let scale = args.time_scale;
    let wall = Duration::from_secs(args.seconds);
    let warmup = wall / 5;
    sc.warmup_s = warmup.as_secs_f64() * scale;
    sc.duration_s = (wall - warmup).as_secs_f64() * scale;
    println!(
        "hearth-bench live --scenario {} --agents {} --replicas {} --seconds {} --time-scale {} --seed {}{}",
        sc.name,
        args.agents,
        sc.replicas,
        args.seconds,
        scale,
        args.seed,
        args.sidecar
            .set
            .iter()
            .map(|kv| format!(" --set {}", crate::settings::shown_setting(kv)))
            .collect::<String>()
    );

    // Engines running the simulator's own scheduler and cost model
    // (time-scaled), and the sidecar with the settings the simulator
    // gives its Router (the scenario's and the command line's), then what
    // the simulated router lacks: probes and engine scrapes.
    let configs = (0..sc.replicas)
        .map(|i| EngineConfig {
            id: format!("engine-{i}"),
            model: MODEL.into(),
            block_tokens: sc.engine.block_tokens,
            cache_capacity_tokens: sc.engine.cache_capacity_tokens,
            time_scale: scale,
            scheduler: Some(sc.engine.cost.clone()),
            ..EngineConfig::default()
        })
        .collect();
    let stack = Stack::simulated(configs)
        .settings(sc.hearth.settings().iter().cloned())
        .settings([
            ("HEARTH_PROBE_INTERVAL_SECONDS", "0"),
            ("HEARTH_ENGINE_METRICS_SECONDS", "0"),
        ])
        .envoy_deadline(Duration::from_secs(30))
        .start()
        .await?;
    let envoy = &stack.envoy;
    let url = format!("{}/v1/chat/completions", envoy.url());

    let salt = args.seed ^ 0x11FE;
    let generator = Generator::new(sc.workload.clone(), MODEL, args.seed, salt);
    let start = Instant::now();
    let until = start + wall;
    let shared = Arc::new(Mutex::new(Shared {
        records: Vec::new(),
    }));
    let tasks: Vec<_> = (0..args.agents as u64)
        .map(|i| {
            tokio::spawn(agent(
                generator.client(i),
                url.clone(),
                scale,
                start,
                warmup,
                until,
                Arc::clone(&shared),
            ))
        })
        .collect();
    // Time-averaged in-flight per replica, from the sidecar's books.
    let mut sums = vec![0.0; sc.replicas];
    let mut samples = 0u32;
    while Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(250)).await;
        if Instant::now().duration_since(start) < warmup {
            continue;
        }
        if let Ok(state) = stack.state_json().await {
            for (i, r) in state["replicas"]
                .as_array()
                .into_iter()
                .flatten()
                .enumerate()
            {
                if let Some(s) = sums.get_mut(i) {
                    *s += r["in_flight"].as_f64().unwrap_or(0.0);
                }
            }
            samples += 1;
        }
    }
    for t in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(30), t).await;
    }
    let records = std::mem::take(&mut shared.lock().unwrap_or_else(|p| p.into_inner()).records);
    let live = RunResult {
        policy: PolicyKind::HearthRelative,
        agents: args.agents,
        replicas: sc.replicas,
        duration_s: sc.duration_s,
        records,
        mean_inflight: sums.iter().map(|s| s / f64::from(samples.max(1))).collect(),
        long_unfinished: 0,
        corrections: None,
    };
    stack.shutdown().await;

    // The same cell in the simulator.
    let spec = RunSpec {
        scenario: sc.clone(),
        policy: PolicyKind::HearthRelative,
        agents: args.agents,
        seed: args.seed,
        salt,
    };
    let simulated = tokio::task::spawn_blocking(move || sim::run(&spec)).await?;
    let mut rows = vec![simulated.row(&sc.name, "sim"), live.row(&sc.name, "live")];
    for r in &mut rows {
        r.policy = format!("{} [{}]", r.policy, r.driver);
    }
    Ok(rows)
}

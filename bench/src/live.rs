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
//!
//! With `--policies`, each policy in turn gets fresh engines of the same
//! configuration and the same seeded conversations, byte for byte: Hearth
//! (Envoy, filter, sidecar), plain Envoy (`least_request`, `ring_hash` on
//! the session), and the peer routers as released ([`crate::peers`]:
//! smg and vllm-router `cache_aware`, their default policy, at their
//! defaults; vllm-router `consistent_hash` on the session, which its
//! README gives for multi-turn chat). Which engine served a turn comes
//! from the engine's own `x-engine-id`, which every front passes through
//! (a router's own naming is checked against it), and the load from the
//! engines' own queues, so each is measured the same way. A peer that is
//! not installed is skipped, and the run says why. The order is reversed
//! on even seeds, then the simulator runs the same cell for each policy's
//! simulated counterpart (the cache-aware peers' is the labelled
//! emulation, `sglang_cache_aware_emulated`).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Args, ValueEnum};
use futures::StreamExt;
use serde::Serialize;
use serde_json::Value;

use crate::engine::{self, EngineConfig, EngineHandle};
use crate::peers::{Peer, PeerConfig, PeerKind, Served};
use crate::policies::PolicyKind;
use crate::report::{self, RequestRecord, RunResult};
use crate::scenario::Scenario;
use crate::sim::{self, RunSpec};
use crate::stack::{Front, Stack};
use crate::workload::{Client, Generator, Turn};
use hearth_ext_proc::Settings;

pub const MODEL: &str = "hearth-sim";

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

/// `hearth-bench live`'s command line: a cell ([`LiveArgs`]) and the
/// policies run through it.
#[derive(Debug, Clone, Args)]
pub struct LiveCli {
    #[command(flatten)]
    pub cell: LiveArgs,
    /// Policies run live, one after the other (reversed on even seeds),
    /// each on fresh engines; then each one's simulated counterpart.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [LivePolicy::Hearth])]
    pub policies: Vec<LivePolicy>,
    /// How long a peer router may take to start and list every engine.
    #[arg(long, default_value_t = 60)]
    pub peer_deadline_s: u64,
}

/// A routing configuration `hearth-bench live` runs for real.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, ValueEnum, Serialize)]
pub enum LivePolicy {
    /// Envoy + filter-wasm + the `hearth-ext-proc` process (the
    /// scenario's settings and `--set`).
    #[value(name = "hearth")]
    #[serde(rename = "hearth")]
    Hearth,
    /// Plain Envoy, `LEAST_REQUEST`.
    #[value(name = "least_request")]
    #[serde(rename = "least_request")]
    LeastRequest,
    /// Plain Envoy, `RING_HASH` on the session (`x-session-id`).
    #[value(name = "ring_hash")]
    #[serde(rename = "ring_hash")]
    RingHash,
    /// smg (SGLang's model gateway) `--policy cache_aware`, its default
    /// policy, at its defaults.
    #[value(name = "smg_cache_aware", alias = "smg")]
    #[serde(rename = "smg_cache_aware")]
    SmgCacheAware,
    /// smg `--policy cache_aware` tuned as its documentation advises
    /// where it piles work on one engine ("increase [the cache threshold]
    /// if you observe hot spots or uneven load distribution", 0.5-0.8
    /// for "better load balance"): `--cache-threshold 0.7`. A new
    /// conversation whose match is only a harness prompt every
    /// conversation sends (a half to two thirds of a first turn in this
    /// project's workloads) is then placed by load, while a later turn,
    /// which matches its own previous prompt (four fifths and more),
    /// keeps its engine.
    #[value(name = "smg_cache_aware_tuned")]
    #[serde(rename = "smg_cache_aware_tuned")]
    SmgCacheAwareTuned,
    /// vllm-router `--policy cache_aware`, its default policy, at its
    /// defaults.
    #[value(name = "vllm_router_cache_aware", alias = "vllm-router")]
    #[serde(rename = "vllm_router_cache_aware")]
    VllmRouterCacheAware,
    /// vllm-router `--policy consistent_hash` on the session header
    /// (`X-Session-ID`), the policy its README gives for multi-turn chat.
    #[value(name = "vllm_router_consistent_hash")]
    #[serde(rename = "vllm_router_consistent_hash")]
    VllmRouterConsistentHash,
    /// Hearth at its defaults with every engine listed `kv_events=auto`:
    /// the sidecar follows the engines' own KV cache events.
    #[value(name = "hearth_kv_events")]
    #[serde(rename = "hearth_kv_events")]
    HearthKvEvents,
    /// vllm-router `--policy kv_aware`: it tokenizes each request and
    /// routes on the engines' KV cache events (`--kv-event-source` per
    /// engine, through a loopback forwarder, [`crate::kv_forward`]). Real
    /// vLLM engines started with their events on (`hearth-bench vllm
    /// --kv-events`) only: its tokenizer must produce the engine's own
    /// token ids.
    #[value(name = "vllm_router_kv_aware")]
    #[serde(rename = "vllm_router_kv_aware")]
    VllmRouterKvAware,
    /// smg `--policy cache_aware` with its priority-aware admission
    /// scheduler on (`--priority-scheduler-enabled`, every tenant allowed
    /// up to `interactive`), its classes at their built-in defaults:
    /// clients name their class in `x-smg-priority`.
    #[value(name = "smg_priority")]
    #[serde(rename = "smg_priority")]
    SmgPriority,
}

/// smg's request header naming a request's priority class (`system`,
/// `interactive`, `default`, `bulk`), read by its priority scheduler.
pub const SMG_PRIORITY_HEADER: &str = "x-smg-priority";

impl LivePolicy {
    pub fn name(self) -> &'static str {
        match self {
            LivePolicy::Hearth => "hearth",
            LivePolicy::LeastRequest => "least_request",
            LivePolicy::RingHash => "ring_hash",
            LivePolicy::SmgCacheAware => "smg_cache_aware",
            LivePolicy::SmgCacheAwareTuned => "smg_cache_aware_tuned",
            LivePolicy::VllmRouterCacheAware => "vllm_router_cache_aware",
            LivePolicy::VllmRouterConsistentHash => "vllm_router_consistent_hash",
            LivePolicy::HearthKvEvents => "hearth_kv_events",
            LivePolicy::VllmRouterKvAware => "vllm_router_kv_aware",
            LivePolicy::SmgPriority => "smg_priority",
        }
    }

    /// A fixed key per policy (not its place in a list), so a policy run
    /// alone gets the same prompts' text as in a full run.
    pub fn key(self) -> u64 {
        match self {
            LivePolicy::RingHash => 1,
            LivePolicy::LeastRequest => 2,
            LivePolicy::Hearth => 3,
            LivePolicy::SmgCacheAware => 4,
            LivePolicy::VllmRouterCacheAware => 5,
            LivePolicy::VllmRouterConsistentHash => 6,
            LivePolicy::HearthKvEvents => 7,
            LivePolicy::VllmRouterKvAware => 8,
            LivePolicy::SmgPriority => 9,
            LivePolicy::SmgCacheAwareTuned => 10,
        }
    }

    /// The peer router behind this policy, if it is one.
    pub fn peer(self) -> Option<PeerConfig> {
        match self {
            LivePolicy::SmgCacheAware => Some(PeerConfig::new(PeerKind::Smg, "cache_aware")),
            LivePolicy::SmgCacheAwareTuned => Some(
                PeerConfig::new(PeerKind::Smg, "cache_aware").with(["--cache-threshold", "0.7"]),
            ),
            // Without the default maximum class raised, smg clamps every
            // tenant it has no policy for to `default`, whatever the
            // header asks.
            LivePolicy::SmgPriority => Some(PeerConfig::new(PeerKind::Smg, "cache_aware").with([
                "--priority-scheduler-enabled",
                "--priority-scheduler-default-max-class",
                "interactive",
            ])),
            LivePolicy::VllmRouterCacheAware => {
                Some(PeerConfig::new(PeerKind::VllmRouter, "cache_aware"))
            }
            LivePolicy::VllmRouterConsistentHash => {
                Some(PeerConfig::new(PeerKind::VllmRouter, "consistent_hash"))
            }
            // Its event sources and tokenizer are added per run.
            LivePolicy::VllmRouterKvAware => {
                Some(PeerConfig::new(PeerKind::VllmRouter, "kv_aware"))
            }
            LivePolicy::Hearth
            | LivePolicy::HearthKvEvents
            | LivePolicy::LeastRequest
            | LivePolicy::RingHash => None,
        }
    }

    /// Envoy with the Hearth sidecar.
    pub fn is_hearth(self) -> bool {
        matches!(self, LivePolicy::Hearth | LivePolicy::HearthKvEvents)
    }

    /// The simulator's policy for the same routing: the cache-aware
    /// peers' is the labelled emulation of SGLang's cache-aware router,
    /// which both descend from; a hash on the session is `ring_hash`.
    pub fn simulated(self) -> PolicyKind {
        match self {
            LivePolicy::Hearth | LivePolicy::HearthKvEvents => PolicyKind::HearthRelative,
            LivePolicy::LeastRequest => PolicyKind::LeastRequest,
            LivePolicy::RingHash | LivePolicy::VllmRouterConsistentHash => PolicyKind::RingHash,
            LivePolicy::SmgCacheAware
            | LivePolicy::SmgCacheAwareTuned
            | LivePolicy::SmgPriority
            | LivePolicy::VllmRouterCacheAware
            | LivePolicy::VllmRouterKvAware => PolicyKind::SglangCacheAwareEmulated,
        }
    }
}

/// `policies` split into those that can run and those skipped, each
/// with the reason: a peer router that `find` does not find (not
/// installed, e.g. `HEARTH_SETUP_PEERS=0`) is skipped, not fatal.
pub fn runnable(
    policies: &[LivePolicy],
    find: impl Fn(PeerKind) -> anyhow::Result<PathBuf>,
) -> (Vec<LivePolicy>, Vec<(LivePolicy, String)>) {
    let mut run = Vec::new();
    let mut skipped = Vec::new();
    for &p in policies {
        match p.peer().map(|c| find(c.kind)) {
            Some(Err(e)) => skipped.push((p, format!("{e:#}"))),
            _ => run.push(p),
        }
    }
    (run, skipped)
}

/// `policies` in the order a seed runs them: as given on odd seeds,
/// reversed on even ones, so over two seeds every policy runs as often
/// early as late (the machine's own drift falls on all of them).
pub fn order_for_seed(policies: &[LivePolicy], seed: u64) -> Vec<LivePolicy> {
    let mut order = policies.to_vec();
    if seed.is_multiple_of(2) {
        order.reverse();
    }
    order
}

struct Shared {
    /// Each measured turn's record, and the class of the agent that sent it.
    records: Vec<(usize, RequestRecord)>,
    /// Measured turns refused with 429, by class.
    rate_limited: Vec<u64>,
    /// Measured answers whose router named the engine it chose, and how
    /// many of those named the engine that says it served.
    router_named: u64,
    router_agreed: u64,
}

/// The engines a run's answers can name: addresses and ids, by index.
#[derive(Clone)]
struct Names {
    addrs: Vec<std::net::SocketAddr>,
    ids: Vec<String>,
}

/// What one turn through the gateway came back with (times in engine
/// seconds).
#[derive(Default)]
struct Answer {
    served: Served,
    ttft_s: f64,
    e2e_s: f64,
    prompt: u32,
    cached: u32,
    /// None: answered in full; the HTTP status of a refusal; 0: no answer
    /// or a broken stream.
    failure: Option<u16>,
}

impl Answer {
    fn failed(status: u16) -> Answer {
        Answer {
            failure: Some(status),
            ..Answer::default()
        }
    }
}

/// One turn through the gateway, with the agent's own headers.
async fn send(
    client: &reqwest::Client,
    url: &str,
    turn: &Turn,
    headers: &[(String, String)],
    names: &Names,
    scale: f64,
) -> Answer {
    let mut v: Value = serde_json::from_slice(&turn.body).unwrap_or(Value::Null);
    v["stream"] = Value::Bool(true);
    let started = Instant::now();
    let mut req = client
        .post(url)
        .header(crate::real::SESSION_HEADER, turn.session.to_string());
    for (name, value) in headers {
        req = req.header(name, value);
    }
    let resp = match req.json(&v).send().await {
        Ok(r) if r.status().is_success() => r,
        Ok(r) => return Answer::failed(r.status().as_u16()),
        Err(_) => return Answer::failed(0),
    };
    let served = Served::from_headers(resp.headers(), &names.addrs, &names.ids);
    let mut ttft = None;
    let mut text = Vec::new();
    let mut chunks = resp.bytes_stream();
    while let Some(c) = chunks.next().await {
        match c {
            Ok(c) => {
                ttft.get_or_insert_with(|| started.elapsed().as_secs_f64());
                text.extend_from_slice(&c);
            }
            Err(_) => {
                return Answer {
                    served,
                    ..Answer::failed(0)
                }
            }
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
    Answer {
        served,
        ttft_s: ttft.unwrap_or(e2e) * scale,
        e2e_s: e2e * scale,
        prompt: usage["prompt_tokens"].as_u64().unwrap_or(0) as u32,
        cached: usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0) as u32,
        failure: None,
    }
}

/// A run's clock: the time scale, its start, warm-up and end.
#[derive(Clone, Copy)]
struct Clock {
    scale: f64,
    start: Instant,
    warmup: Duration,
    until: Instant,
}

/// One simulated user of a live run: its conversations, the headers it
/// sends with every turn (a tenant's fairness id, an objective), and the
/// class its turns are counted under.
pub struct Agent {
    pub client: Client,
    pub headers: Vec<(String, String)>,
    pub class: usize,
}

async fn agent(a: Agent, url: String, names: Names, clock: Clock, shared: Arc<Mutex<Shared>>) {
    let Clock {
        scale,
        start,
        warmup,
        until,
    } = clock;
    let Agent {
        client: mut c,
        headers,
        class,
    } = a;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap_or_default();
    let mut last: Option<(u64, usize)> = None;
    while Instant::now() < until {
        let turn = c.next_turn();
        let sent = Instant::now();
        let answer = send(&http, &url, &turn, &headers, &names, scale).await;
        // The engine's own word, for every policy alike.
        let replica = answer.served.engine;
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
                ttft_s: answer.ttft_s,
                e2e_s: answer.e2e_s,
                prompt_tokens: answer.prompt,
                cached_tokens: answer.cached,
                // A live run cannot see what one fleet-wide cache would hold.
                ideal_cached_tokens: answer.cached,
                output_tokens: turn.output_tokens,
                stayed,
                restart: turn.restart,
                long: false,
                failed: answer.failure.is_some(),
                predicted_cached_tokens: None,
            };
            let mut shared = shared.lock().unwrap_or_else(|p| p.into_inner());
            shared.records.push((class, record));
            if answer.failure == Some(429) {
                shared.rate_limited[class] += 1;
            }
            if let Some(named) = answer.served.router {
                shared.router_named += 1;
                shared.router_agreed += u64::from(Some(named) == answer.served.engine);
            }
        }
        let think = Duration::from_secs_f64(c.think_seconds() / scale);
        tokio::time::sleep(think.min(until.saturating_duration_since(Instant::now()))).await;
    }
}

pub async fn run(cli: LiveCli) -> anyhow::Result<()> {
    if cli.policies != [LivePolicy::Hearth] {
        return run_policies(&cli).await;
    }
    let args = cli.cell;
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
        let doc = serde_json::json!({
            "build": crate::provenance::json(),
            "rows": rows,
        });
        std::fs::write(path, serde_json::to_vec_pretty(&doc)?)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// The cell `args` describes: its scenario (with the command line's
/// replicas and settings, and windows from the wall-clock seconds), the
/// whole run and its warm-up in wall-clock time.
fn cell(args: &LiveArgs) -> anyhow::Result<(Scenario, Duration, Duration)> {
    let mut sc = preset(&args.scenario)?;
    if let Some(r) = args.replicas {
        sc.replicas = r;
    }
    sc.hearth.set(args.sidecar.set.iter().cloned())?;
    let (wall, warmup) = windows(&mut sc, args.seconds, args.time_scale)?;
    Ok((sc, wall, warmup))
}

/// The scenario preset `name`.
pub fn preset(name: &str) -> anyhow::Result<Scenario> {
    Scenario::preset(name).with_context(|| format!("unknown scenario {name:?}"))
}

/// A live cell's windows: `seconds` of wall-clock traffic, the first
/// fifth warm-up, engine time `time_scale` times the wall's. Sets the
/// scenario's (engine-time) warm-up and duration; returns the whole run
/// and its warm-up in wall-clock time.
pub(crate) fn windows(
    sc: &mut Scenario,
    seconds: u64,
    time_scale: f64,
) -> anyhow::Result<(Duration, Duration)> {
    anyhow::ensure!(
        time_scale > 0.0 && time_scale.is_finite(),
        "--time-scale must be > 0"
    );
    anyhow::ensure!(seconds >= 10, "--seconds must be at least 10");
    let wall = Duration::from_secs(seconds);
    let warmup = wall / 5;
    sc.warmup_s = warmup.as_secs_f64() * time_scale;
    sc.duration_s = (wall - warmup).as_secs_f64() * time_scale;
    Ok((wall, warmup))
}

/// The sidecar's settings that are spans of the engines' and the
/// clients' time (how long a conversation stays resident, how long a
/// first turn waits for its second, how long a request may queue), with
/// their values in `s`. (`hearth-bench tenants` scales only the defaults
/// of flow control's affinity wait, time to live and prefill limit: its
/// commands give the rest in wall time.)
fn engine_time(s: &Settings) -> [(&'static str, f64); 7] {
    [
        ("HEARTH_RESIDENT_SECONDS", s.resident_seconds),
        ("HEARTH_SEQUEL_HORIZON_SECONDS", s.sequel_horizon_seconds),
        ("HEARTH_FLOW_PREFILL_SECONDS", s.flow_prefill_seconds),
        (
            "HEARTH_FLOW_AFFINITY_WAIT_SECONDS",
            s.flow_affinity_wait_seconds,
        ),
        ("HEARTH_FLOW_HEADROOM_SECONDS", s.flow_headroom_seconds),
        ("HEARTH_FLOW_FAIR_SLOTS_SECONDS", s.flow_fair_slots_seconds),
        ("HEARTH_FLOW_TTL_SECONDS", s.flow_ttl_seconds),
    ]
}

/// The live sidecar's engine-time settings on the wall clock: each one's
/// value in `settings` (given or default) divided by `time_scale`, so
/// that against engines and clients `time_scale` times faster the sidecar
/// behaves as the simulator's router does on engine time.
fn on_wall_clock(
    settings: &[(String, String)],
    time_scale: f64,
) -> anyhow::Result<Vec<(String, String)>> {
    let parsed = crate::settings::parse(settings)?;
    Ok(engine_time(&parsed)
        .into_iter()
        .map(|(name, engine_s)| (name.to_string(), format!("{}", engine_s / time_scale)))
        .collect())
}

/// What [`on_wall_clock`] gives the live sidecar, as a comment line.
fn wall_clock_line(sc: &Scenario, time_scale: f64) -> anyhow::Result<String> {
    let scaled = on_wall_clock(sc.hearth.settings(), time_scale)?;
    Ok(format!(
        "# the live sidecar's engine-time settings, divided by the time scale {time_scale}: {}",
        scaled
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(" ")
    ))
}

/// `hearth-bench live ...` as run (settings shown, credentials hidden).
fn command(args: &LiveArgs, sc: &Scenario, policies: Option<&[LivePolicy]>) -> String {
    format!(
        "hearth-bench live --scenario {} --agents {} --replicas {} --seconds {} --time-scale {} --seed {}{}{}",
        sc.name,
        args.agents,
        sc.replicas,
        args.seconds,
        args.time_scale,
        args.seed,
        args.sidecar.shown(),
        policies.map_or(String::new(), |ps| format!(
            " --policies {}",
            ps.iter().map(|p| p.name()).collect::<Vec<_>>().join(",")
        )),
    )
}

/// Engines running the simulator's own scheduler and cost model
/// (time-scaled), one per replica of the scenario.
pub fn engine_configs(sc: &Scenario, scale: f64) -> Vec<EngineConfig> {
    (0..sc.replicas)
        .map(|i| EngineConfig {
            id: format!("engine-{i}"),
            model: MODEL.into(),
            block_tokens: sc.engine.block_tokens,
            cache_capacity_tokens: sc.engine.cache_capacity_tokens,
            time_scale: scale,
            scheduler: Some(sc.engine.cost.clone()),
            ..EngineConfig::default()
        })
        .collect()
}

/// The workload's salt for a seed (every policy of a run gets the same
/// conversations; each runs on fresh engines).
pub(crate) fn salt_for(seed: u64) -> u64 {
    seed ^ 0x11FE
}

/// What [`drive_agents`] measured.
pub struct Driven {
    /// Each measured turn's record, and its agent's class.
    pub records: Vec<(usize, RequestRecord)>,
    /// Measured turns refused with 429, by class.
    pub rate_limited: Vec<u64>,
    /// Per engine, time-averaged requests in flight (running or waiting).
    pub mean_inflight: Vec<f64>,
    /// Measured answers whose router named its engine, and how many of
    /// those agreed with the engine's own header.
    pub router_named: u64,
    pub router_agreed: u64,
}

impl Driven {
    /// The records of the turns of class `class`.
    pub fn of_class(&self, class: usize) -> Vec<RequestRecord> {
        self.records
            .iter()
            .filter(|(c, _)| *c == class)
            .map(|(_, r)| r.clone())
            .collect()
    }
}

/// The scenario's agents through `url` for the wall-clock `wall` (the
/// first `warmup` not measured).
async fn drive(
    url: &str,
    engines: &[EngineHandle],
    sc: &Scenario,
    args: &LiveArgs,
    wall: Duration,
    warmup: Duration,
) -> Driven {
    let generator = Generator::new(sc.workload.clone(), MODEL, args.seed, salt_for(args.seed));
    let agents = (0..args.agents as u64)
        .map(|i| Agent {
            client: generator.client(i),
            headers: Vec::new(),
            class: 0,
        })
        .collect();
    drive_agents(url, engines, agents, args.time_scale, wall, warmup).await
}

/// `agents` through `url` for the wall-clock `wall` (the first `warmup`
/// not measured), engine times divided by `scale`, and the engines'
/// time-averaged requests in flight over the measured window, read from
/// the engines themselves.
pub async fn drive_agents(
    url: &str,
    engines: &[EngineHandle],
    agents: Vec<Agent>,
    scale: f64,
    wall: Duration,
    warmup: Duration,
) -> Driven {
    let names = Names {
        addrs: engines.iter().map(|e| e.addr).collect(),
        ids: engines
            .iter()
            .map(|e| e.engine.config().id.clone())
            .collect(),
    };
    let classes = agents.iter().map(|a| a.class + 1).max().unwrap_or(0);
    let start = Instant::now();
    let until = start + wall;
    let shared = Arc::new(Mutex::new(Shared {
        records: Vec::new(),
        rate_limited: vec![0; classes],
        router_named: 0,
        router_agreed: 0,
    }));
    let tasks: Vec<_> = agents
        .into_iter()
        .map(|a| {
            tokio::spawn(agent(
                a,
                url.to_string(),
                names.clone(),
                Clock {
                    scale,
                    start,
                    warmup,
                    until,
                },
                Arc::clone(&shared),
            ))
        })
        .collect();
    let mut sums = vec![0.0; engines.len()];
    let mut samples = 0u32;
    while Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(250)).await;
        if Instant::now().duration_since(start) < warmup {
            continue;
        }
        for (s, e) in sums.iter_mut().zip(engines) {
            *s += e.engine.in_flight() as f64;
        }
        samples += 1;
    }
    for t in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(30), t).await;
    }
    let mut shared = shared.lock().unwrap_or_else(|p| p.into_inner());
    Driven {
        records: std::mem::take(&mut shared.records),
        rate_limited: std::mem::take(&mut shared.rate_limited),
        mean_inflight: sums.iter().map(|s| s / f64::from(samples.max(1))).collect(),
        router_named: shared.router_named,
        router_agreed: shared.router_agreed,
    }
}

/// What one policy's live run left: its result and, for a peer router,
/// its command line and log.
pub struct LiveRun {
    pub policy: LivePolicy,
    pub result: RunResult,
    /// Measured answers whose router named the engine it chose (smg's
    /// header, the sidecar's), and how many agreed with the engine's.
    pub router_named: u64,
    pub router_agreed: u64,
    pub peer_command: Option<String>,
    pub peer_log: Option<String>,
}

/// What serves the agents during one policy's run.
pub enum Serving {
    /// Envoy (with or without Hearth) and its engines.
    Stack(Box<Stack>),
    /// A peer router and the engines it was started in front of.
    Peer(Vec<EngineHandle>, Box<Peer>),
}

impl Serving {
    /// `policy` in front of fresh simulated engines of `configs`: Envoy
    /// (Hearth with the sidecar `settings`, or one of Envoy's own
    /// policies), or a peer router given `peer_deadline` to list every
    /// engine.
    pub async fn start(
        policy: LivePolicy,
        configs: Vec<EngineConfig>,
        settings: Vec<(String, String)>,
        peer_deadline: Duration,
    ) -> anyhow::Result<Serving> {
        let Some(config) = policy.peer() else {
            return Ok(Serving::Stack(Box::new(
                envoy_stack(policy, configs, settings).await?,
            )));
        };
        // Found before any engine starts: a missing install fails at once.
        config.kind.find()?;
        let mut engines = Vec::new();
        for c in configs {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            engines.push(engine::spawn(c, listener).await?);
        }
        let addrs: Vec<_> = engines.iter().map(|e| e.addr).collect();
        let peer = Peer::start(&config, &addrs, peer_deadline).await?;
        Ok(Serving::Peer(engines, Box::new(peer)))
    }

    pub fn url(&self) -> String {
        match self {
            Serving::Stack(stack) => stack.url(),
            Serving::Peer(_, peer) => peer.url(),
        }
    }

    pub fn engines(&self) -> &[EngineHandle] {
        match self {
            Serving::Stack(stack) => &stack.engines,
            Serving::Peer(engines, _) => engines,
        }
    }

    /// The peer router's command line, if a peer serves.
    pub fn peer_command(&self) -> Option<String> {
        match self {
            Serving::Stack(_) => None,
            Serving::Peer(_, peer) => Some(peer.command.clone()),
        }
    }

    /// Envoy and its sidecar, if they serve.
    pub fn stack(&self) -> Option<&Stack> {
        match self {
            Serving::Stack(stack) => Some(stack),
            Serving::Peer(..) => None,
        }
    }

    /// The peer router, if one serves.
    pub fn peer(&self) -> Option<&Peer> {
        match self {
            Serving::Stack(_) => None,
            Serving::Peer(_, peer) => Some(peer),
        }
    }

    /// Stops the gateway and the engines; a peer router's log.
    pub async fn shutdown(self) -> Option<String> {
        match self {
            Serving::Stack(stack) => {
                stack.shutdown().await;
                None
            }
            Serving::Peer(handles, peer) => {
                let log = peer.log();
                drop(peer);
                for e in handles {
                    e.shutdown().await;
                }
                Some(log)
            }
        }
    }
}

/// Envoy in front of fresh simulated engines for one of the policies
/// Envoy runs itself: Hearth (the sidecar with `settings`), plain
/// `least_request`, or `ring_hash` on the session.
pub async fn envoy_stack(
    policy: LivePolicy,
    configs: Vec<EngineConfig>,
    settings: Vec<(String, String)>,
) -> anyhow::Result<Stack> {
    let builder = Stack::simulated(configs).envoy_deadline(Duration::from_secs(30));
    let builder = match policy {
        LivePolicy::Hearth | LivePolicy::HearthKvEvents => builder.settings(settings),
        LivePolicy::LeastRequest => builder.front(Front::Plain),
        LivePolicy::RingHash => builder
            .front(Front::Plain)
            .edit_envoy(|yaml| crate::real::ring_hash(&yaml)),
        _ => anyhow::bail!("{} is not Envoy's own policy", policy.name()),
    };
    builder.start().await
}

/// One policy live on fresh engines.
async fn run_one(
    policy: LivePolicy,
    sc: &Scenario,
    args: &LiveArgs,
    wall: Duration,
    warmup: Duration,
    peer_deadline: Duration,
) -> anyhow::Result<LiveRun> {
    let mut configs = engine_configs(sc, args.time_scale);
    let mut settings = Vec::new();
    if policy.is_hearth() {
        // The sidecar with the settings the simulator gives its Router
        // (the scenario's and the command line's), then what the
        // simulated router lacks: probes and engine scrapes.
        // With `hearth_kv_events`, each engine also publishes its KV
        // cache events, and the stack lists where.
        settings = sc.hearth.settings().to_vec();
        settings.extend(on_wall_clock(&settings, args.time_scale)?);
        settings.extend(
            [
                ("HEARTH_PROBE_INTERVAL_SECONDS", "0"),
                ("HEARTH_ENGINE_METRICS_SECONDS", "0"),
            ]
            .map(|(k, v)| (k.to_string(), v.to_string())),
        );
        let events = (policy == LivePolicy::HearthKvEvents).then_some("tcp://127.0.0.1:0");
        configs = configs
            .into_iter()
            .map(|c| EngineConfig {
                kv_events: events.map(str::to_owned),
                kv_events_replay: events.map(str::to_owned),
                ..c
            })
            .collect();
    }
    let front = Serving::start(policy, configs, settings, peer_deadline).await?;
    let url = front.url();
    let peer_command = front.peer_command();
    let driven = drive(
        &format!("{url}/v1/chat/completions"),
        front.engines(),
        sc,
        args,
        wall,
        warmup,
    )
    .await;
    let peer_log = front.shutdown().await;
    Ok(LiveRun {
        policy,
        result: RunResult {
            policy: policy.simulated(),
            agents: args.agents,
            replicas: sc.replicas,
            duration_s: sc.duration_s,
            records: driven.records.into_iter().map(|(_, r)| r).collect(),
            mean_inflight: driven.mean_inflight,
            long_unfinished: 0,
            corrections: None,
        },
        router_named: driven.router_named,
        router_agreed: driven.router_agreed,
        peer_command,
        peer_log,
    })
}

/// Runs the cell live, then simulated; returns the simulated row first.
pub async fn measure(args: &LiveArgs) -> anyhow::Result<Vec<report::Row>> {
    let (sc, wall, warmup) = cell(args)?;
    println!("{}", command(args, &sc, None));
    println!("{}", crate::provenance::header());
    println!("{}", wall_clock_line(&sc, args.time_scale)?);
    let live = run_one(
        LivePolicy::Hearth,
        &sc,
        args,
        wall,
        warmup,
        Duration::from_secs(60),
    )
    .await?
    .result;

    // The same cell in the simulator.
    let spec = RunSpec {
        scenario: sc.clone(),
        policy: PolicyKind::HearthRelative,
        agents: args.agents,
        seed: args.seed,
        salt: salt_for(args.seed),
    };
    let simulated = tokio::task::spawn_blocking(move || sim::run(&spec)).await?;
    let mut rows = vec![simulated.row(&sc.name, "sim"), live.row(&sc.name, "live")];
    for r in &mut rows {
        r.policy = format!("{} [{}]", r.policy, r.driver);
    }
    Ok(rows)
}

/// What [`measure_policies`] measured.
pub struct Measured {
    /// The live rows in the order given, then the simulated ones.
    pub rows: Vec<report::Row>,
    /// Each live run, in the order given.
    pub runs: Vec<LiveRun>,
    /// The order the live runs went in.
    pub order: Vec<LivePolicy>,
    /// Policies not run, and why (a peer router not installed).
    pub skipped: Vec<(LivePolicy, String)>,
}

/// Every runnable policy of `cli` live (in the seed's order), each on
/// fresh engines, then each distinct simulated counterpart.
pub async fn measure_policies(cli: &LiveCli) -> anyhow::Result<Measured> {
    let args = &cli.cell;
    let (sc, wall, warmup) = cell(args)?;
    anyhow::ensure!(!cli.policies.is_empty(), "--policies is empty");
    anyhow::ensure!(
        !cli.policies.contains(&LivePolicy::VllmRouterKvAware),
        "vllm_router_kv_aware needs real vLLM engines (its tokenizer must reproduce the \
         engine's token ids): run it with hearth-bench compare in front of `hearth-bench vllm \
         --kv-events`"
    );
    println!("{}", command(args, &sc, Some(&cli.policies)));
    println!("{}", crate::provenance::header());
    println!("{}", wall_clock_line(&sc, args.time_scale)?);
    let (policies, skipped) = runnable(&cli.policies, PeerKind::find);
    for (p, why) in &skipped {
        println!("# skipped {}: {why}", p.name());
    }
    anyhow::ensure!(!policies.is_empty(), "no policy of --policies can run");
    let order = order_for_seed(&policies, args.seed);
    println!(
        "# order (seed {}): {}",
        args.seed,
        order
            .iter()
            .map(|p| p.name())
            .collect::<Vec<_>>()
            .join(", ")
    );
    let mut runs = Vec::new();
    for &policy in &order {
        eprintln!("hearth-bench live: running {}", policy.name());
        let run = run_one(
            policy,
            &sc,
            args,
            wall,
            warmup,
            Duration::from_secs(cli.peer_deadline_s),
        )
        .await
        .with_context(|| format!("policy {}", policy.name()))?;
        if let Some(command) = &run.peer_command {
            println!("# {}: {command}", policy.name());
        }
        runs.push(run);
    }
    runs.sort_by_key(|r| policies.iter().position(|p| *p == r.policy));
    let mut rows: Vec<report::Row> = runs
        .iter()
        .map(|r| {
            let mut row = r.result.row(&sc.name, "live");
            row.policy = format!("{} [live]", r.policy.name());
            row
        })
        .collect();
    let mut simulated: Vec<PolicyKind> = Vec::new();
    for p in &policies {
        if !simulated.contains(&p.simulated()) {
            simulated.push(p.simulated());
        }
    }
    for kind in simulated {
        let spec = RunSpec {
            scenario: sc.clone(),
            policy: kind,
            agents: args.agents,
            seed: args.seed,
            salt: salt_for(args.seed),
        };
        let result = tokio::task::spawn_blocking(move || sim::run(&spec)).await?;
        let mut row = result.row(&sc.name, "sim");
        row.policy = format!("{} [sim]", row.policy);
        rows.push(row);
    }
    Ok(Measured {
        rows,
        runs,
        order,
        skipped,
    })
}

/// How a run's router named the engines it chose, checked against the
/// engines' own word (which the stays are counted from).
fn naming(run: &LiveRun) -> String {
    let measured = run.result.records.len();
    if run.router_named == 0 {
        format!(
            "{}: the router named no engine in {measured} measured answers; stays from x-engine-id",
            run.policy.name()
        )
    } else {
        format!(
            "{}: the router named its engine in {} of {measured} measured answers, the same as x-engine-id in {}",
            run.policy.name(),
            run.router_named,
            run.router_agreed
        )
    }
}

/// `rows` as the Markdown table docs/benchmarks.md quotes (TTFT with
/// its p90, which the plain table leaves out).
pub fn markdown(rows: &[report::Row]) -> String {
    let mut out = String::from(
        "| policy | turns/min | out tok/s | cached | stay | TTFT p50 / p90 / p99 (s) | in-flight max/mean | failed |\n\
         | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n",
    );
    for r in rows {
        out.push_str(&format!(
            "| {} | {:.1} | {:.0} | {:.1}% | {} | {:.2} / {:.2} / {:.2} | {:.2} | {} |\n",
            r.policy,
            r.turns_per_min,
            r.output_tok_s,
            r.cached_fraction * 100.0,
            r.stay_rate
                .map_or("-".into(), |s| format!("{:.1}%", s * 100.0)),
            r.ttft_p50_s,
            r.ttft_p90_s,
            r.ttft_p99_s,
            r.load_max_over_mean,
            r.failures
        ));
    }
    out
}

async fn run_policies(cli: &LiveCli) -> anyhow::Result<()> {
    let m = measure_policies(cli).await?;
    println!("{}", report::table(&m.rows));
    println!("{}", markdown(&m.rows));
    for r in &m.rows {
        println!(
            "{}: per-replica turns {}",
            r.policy,
            r.replica_split
                .iter()
                .map(|s| format!("{:.0}", s * r.turns as f64))
                .collect::<Vec<_>>()
                .join(" / ")
        );
    }
    for run in &m.runs {
        println!("{}", naming(run));
    }
    if let Some(path) = &cli.cell.json {
        let (sc, _, _) = cell(&cli.cell)?;
        let doc = serde_json::json!({
            "command": command(&cli.cell, &sc, Some(&cli.policies)),
            "build": crate::provenance::json(),
            "argv": std::env::args().collect::<Vec<_>>().join(" "),
            "order": m.order,
            "skipped": m
                .skipped
                .iter()
                .map(|(p, why)| (p.name(), why.clone()))
                .collect::<std::collections::BTreeMap<_, _>>(),
            "peers": m
                .runs
                .iter()
                .filter_map(|r| Some((r.policy.name(), r.peer_command.clone()?)))
                .collect::<std::collections::BTreeMap<_, _>>(),
            "router_naming": m.runs.iter().map(naming).collect::<Vec<_>>(),
            "scenario": sc,
            "rows": m.rows,
        });
        std::fs::write(path, serde_json::to_vec_pretty(&doc)?)?;
        println!("wrote {}", path.display());
        for r in &m.runs {
            if let Some(log) = &r.peer_log {
                let to = path.with_extension(format!("{}.log", r.policy.name()));
                std::fs::write(&to, log)?;
                println!("wrote {}", to.display());
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cmd {
        #[command(flatten)]
        cli: LiveCli,
    }

    fn parse(args: &[&str]) -> Result<LiveCli, clap::Error> {
        Cmd::try_parse_from(std::iter::once("live").chain(args.iter().copied())).map(|c| c.cli)
    }

    #[test]
    fn the_live_sidecar_gets_its_engine_time_settings_divided_by_the_time_scale() {
        let given = [("HEARTH_RESIDENT_SECONDS".to_string(), "60".to_string())];
        let scaled: std::collections::HashMap<_, _> =
            on_wall_clock(&given, 3.0).unwrap().into_iter().collect();
        assert_eq!(scaled.len(), 7);
        // A value given (for the simulator too) and the defaults alike.
        assert_eq!(scaled["HEARTH_RESIDENT_SECONDS"], "20");
        assert_eq!(scaled["HEARTH_SEQUEL_HORIZON_SECONDS"], "5");
        assert_eq!(scaled["HEARTH_FLOW_TTL_SECONDS"], "20");
        // What the sidecar then runs with: the later value wins.
        let mut all = given.to_vec();
        all.extend(on_wall_clock(&given, 3.0).unwrap());
        let params = crate::settings::parse(&all).unwrap().router_params();
        assert_eq!(params.sequel_horizon, Duration::from_secs(5));
        assert_eq!(params.resident_window, Duration::from_secs(20));
        assert!(on_wall_clock(&[("HEARTH_RESIDENT_SECONDS".into(), "x".into())], 3.0).is_err());
    }

    #[test]
    fn even_seeds_run_the_policies_backwards() {
        let ps = [
            LivePolicy::Hearth,
            LivePolicy::LeastRequest,
            LivePolicy::SmgCacheAware,
        ];
        assert_eq!(order_for_seed(&ps, 1), ps);
        assert_eq!(
            order_for_seed(&ps, 2),
            [
                LivePolicy::SmgCacheAware,
                LivePolicy::LeastRequest,
                LivePolicy::Hearth
            ]
        );
    }

    #[test]
    fn each_policy_has_its_simulated_counterpart() {
        assert_eq!(LivePolicy::Hearth.simulated(), PolicyKind::HearthRelative);
        assert_eq!(
            LivePolicy::LeastRequest.simulated(),
            PolicyKind::LeastRequest
        );
        for p in [
            LivePolicy::SmgCacheAware,
            LivePolicy::SmgCacheAwareTuned,
            LivePolicy::VllmRouterCacheAware,
        ] {
            assert_eq!(p.simulated(), PolicyKind::SglangCacheAwareEmulated);
            assert_eq!(p.peer().unwrap().policy, "cache_aware");
        }
        let ch = LivePolicy::VllmRouterConsistentHash;
        assert_eq!(ch.simulated(), PolicyKind::RingHash);
        assert_eq!(ch.peer().unwrap().kind, PeerKind::VllmRouter);
        assert_eq!(ch.peer().unwrap().policy, "consistent_hash");
        assert!(LivePolicy::RingHash.peer().is_none());
        // The priority scheduler on, every tenant allowed up to the class
        // the benchmark's high band asks for.
        let prio = LivePolicy::SmgPriority.peer().unwrap();
        assert_eq!(
            (prio.kind, prio.policy.as_str()),
            (PeerKind::Smg, "cache_aware")
        );
        let line = prio.args(
            &[],
            "127.0.0.1:1".parse().unwrap(),
            "127.0.0.1:2".parse().unwrap(),
        );
        let line = line.join(" ");
        assert!(line.contains("--priority-scheduler-enabled"), "{line}");
        assert!(
            line.contains("--priority-scheduler-default-max-class interactive"),
            "{line}"
        );
        // The tuned row: smg's cache-aware policy with the threshold its
        // documentation raises for hot spots, the rest at its defaults.
        let tuned = LivePolicy::SmgCacheAwareTuned.peer().unwrap();
        assert_eq!(
            (tuned.kind, tuned.policy.as_str()),
            (PeerKind::Smg, "cache_aware")
        );
        assert_eq!(tuned.extra, ["--cache-threshold", "0.7"]);
        assert!(tuned
            .shown()
            .ends_with("--policy cache_aware --cache-threshold 0.7"));
        let keys: std::collections::HashSet<u64> = LivePolicy::value_variants()
            .iter()
            .map(|p| p.key())
            .collect();
        assert_eq!(
            keys.len(),
            LivePolicy::value_variants().len(),
            "keys are distinct"
        );
    }

    #[test]
    fn the_command_line_names_the_peers_and_their_short_names() {
        let cli = parse(&[
            "--policies",
            "hearth,least_request,smg,vllm-router,vllm_router_consistent_hash",
        ])
        .unwrap();
        assert_eq!(
            cli.policies,
            [
                LivePolicy::Hearth,
                LivePolicy::LeastRequest,
                LivePolicy::SmgCacheAware,
                LivePolicy::VllmRouterCacheAware,
                LivePolicy::VllmRouterConsistentHash
            ]
        );
        assert!(parse(&["--policies", "sglang"]).is_err());
        let default = parse(&[]).unwrap();
        assert_eq!(default.policies, [LivePolicy::Hearth]);
    }

    #[test]
    fn a_peer_that_is_not_installed_is_skipped_with_the_reason() {
        let ps = [
            LivePolicy::Hearth,
            LivePolicy::SmgCacheAware,
            LivePolicy::VllmRouterCacheAware,
            LivePolicy::LeastRequest,
        ];
        let (run, skipped) = runnable(&ps, |kind| match kind {
            PeerKind::Smg => anyhow::bail!(kind.not_installed()),
            PeerKind::VllmRouter => Ok(PathBuf::from("/x/vllm-router")),
        });
        assert_eq!(
            run,
            [
                LivePolicy::Hearth,
                LivePolicy::VllmRouterCacheAware,
                LivePolicy::LeastRequest
            ]
        );
        assert_eq!(skipped.len(), 1);
        assert_eq!(skipped[0].0, LivePolicy::SmgCacheAware);
        assert!(
            skipped[0].1.contains("run scripts/setup-peers"),
            "{}",
            skipped[0].1
        );
    }

    #[test]
    fn the_markdown_row_has_the_ttft_percentiles_and_the_stay_rate() {
        let record = |replica, ttft_s, stayed| RequestRecord {
            replica,
            sent_s: 1.0,
            ttft_s,
            e2e_s: ttft_s + 1.0,
            prompt_tokens: 1000,
            cached_tokens: 900,
            ideal_cached_tokens: 900,
            output_tokens: 10,
            stayed,
            restart: false,
            long: false,
            failed: false,
            predicted_cached_tokens: None,
        };
        let run = RunResult {
            policy: PolicyKind::LeastRequest,
            agents: 2,
            replicas: 2,
            duration_s: 60.0,
            records: vec![
                record(0, 0.5, None),
                record(1, 1.5, Some(false)),
                record(1, 2.5, Some(true)),
            ],
            mean_inflight: vec![1.0, 3.0],
            long_unfinished: 0,
            corrections: None,
        };
        let mut row = run.row("cell", "live");
        row.policy = "least_request [live]".into();
        let md = markdown(&[row]);
        let lines: Vec<&str> = md.lines().collect();
        assert_eq!(lines.len(), 3, "{md}");
        assert!(lines[0].starts_with("| policy | turns/min |"), "{md}");
        // 3 turns in 60 s, 90% cached, one stay of two, max/mean 3/2.
        assert!(
            lines[2].starts_with("| least_request [live] | 3.0 | 0 | 90.0% | 50.0% | "),
            "{md}"
        );
        assert!(lines[2].ends_with(" | 1.50 | 0 |"), "{md}");
    }
}

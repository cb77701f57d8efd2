//! The discrete-event driver: simulated clients, the policy under test and
//! one [`EngineCore`] per replica, advanced event by event in engine time.
//! Deterministic for a seed (one thread per run; runs of a sweep may go in
//! parallel, each on its own state).
//!
//! Each request's body is fingerprinted by `hearth_wire` exactly as
//! the wasm filter does, the engine renders and hashes it as the HTTP
//! simulator does, and the policy decides (the Hearth policies through the
//! sidecar's `Router`). Clients are closed loops: send, wait for the whole
//! answer, think, send the next turn.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::engine::cache::block_hashes;
use crate::engine::core::{EngineCore, SeqEvent};
use crate::engine::request::{self, ApiKind};
use crate::policies::{Policy, PolicyKind, RouteInput, Routed};
use crate::report::{RequestRecord, RunResult};
use crate::scenario::Scenario;
use crate::workload::{Client, Generator, BYTES_PER_TOKEN};
use hearth_router::{EngineSignals, Router, Usage};
use hearth_wire::peer::Update;

/// One cell of a sweep.
#[derive(Clone, Debug)]
pub struct RunSpec {
    pub scenario: Scenario,
    pub policy: PolicyKind,
    pub agents: usize,
    pub seed: u64,
    pub salt: u64,
}

const MODEL: &str = "hearth-sim";

#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    /// A client sends its next turn.
    Send(usize),
    /// A replica's current step ends.
    StepEnd(usize),
    /// A replica's engine restarts (its cache is emptied).
    Restart(usize),
    /// The sidecars scrape every engine's metrics.
    Scrape,
    /// A sidecar's update reaches its peers (an index into the mailbox).
    PeerDeliver(usize),
}

struct Pending {
    client: usize,
    replica: usize,
    sent_us: u64,
    first_us: Option<u64>,
    prompt_tokens: u32,
    cached_tokens: u32,
    ideal_cached_tokens: u32,
    output_tokens: u32,
    stayed: Option<bool>,
    restart: bool,
    long: bool,
    routed: Routed,
}

/// Agent `c` of `agents` reaches the engines around Hearth: the first
/// of every `1 / share` agents, spread evenly.
fn bypasses(c: usize, share: f64) -> bool {
    ((c + 1) as f64 * share).floor() > (c as f64 * share).floor()
}

/// Sidecar `from` of `routers` sends what it learned to the others, who get
/// it `delay_us` from `now` (at once when 0).
fn share(
    routers: &[Arc<Router>],
    from: usize,
    delay_us: u64,
    (now, at): (u64, Instant),
    mailbox: &mut Mailbox,
    mut push: impl FnMut(u64, Ev),
) {
    let update = routers[from].take_update();
    if delay_us == 0 {
        deliver(routers, from, &update, at);
        return;
    }
    let m = match mailbox.free.pop() {
        Some(m) => m,
        None => {
            mailbox.slots.push(None);
            mailbox.slots.len() - 1
        }
    };
    mailbox.slots[m] = Some((from, update));
    push(now + delay_us, Ev::PeerDeliver(m));
}

/// Updates between sidecars on their way: (sender, update) by slot;
/// delivered slots are reused, so it stays as small as the updates in
/// flight.
#[derive(Default)]
struct Mailbox {
    slots: Vec<Option<(usize, Update)>>,
    free: Vec<usize>,
}

/// Sidecar `from`'s update applied by every other sidecar at `now`.
fn deliver(routers: &[Arc<Router>], from: usize, update: &Update, now: Instant) {
    for (k, router) in routers.iter().enumerate() {
        if k != from {
            router
                .apply_update_at(from as u64, router.list_digest(), update, false, now)
                .expect("the simulated sidecars share one replica list");
        }
    }
}

/// Runs one cell and returns its per-request records and load samples.
pub fn run(spec: &RunSpec) -> RunResult {
    // Engine time zero, as an instant for the router's time inputs: every
    // call into a router below passes `clock(t)`, so resident
    // conversations expire, engine figures go stale and peers fall silent
    // in engine time, as they do in the sidecar in wall time.
    let epoch = Instant::now();
    let clock = |t: u64| epoch + Duration::from_micros(t);
    let sc = &spec.scenario;
    let n = sc.replicas;
    let generator = Generator::new(sc.workload.clone(), MODEL, spec.seed, spec.salt);
    let mut clients: Vec<Client> = (0..spec.agents)
        .map(|i| generator.client(i as u64))
        .collect();
    let mut engines: Vec<EngineCore> = (0..n)
        .map(|_| {
            let core = EngineCore::new(
                sc.engine.cost.clone(),
                sc.engine.block_tokens,
                sc.engine.cache_capacity_tokens,
            );
            if sc.hearth.kv_events {
                core.with_cache_events()
            } else {
                core
            }
        })
        .collect();
    let mut step_events: Vec<Vec<SeqEvent>> = vec![Vec::new(); n];
    // Each engine's next KV event batch number (with `kv_events`).
    let mut kv_seq = vec![0u64; n];
    let mut busy = vec![false; n];
    let mut policy = Policy::new(spec.policy, n, spec.seed, &sc.hearth);
    let fp_params = hearth_wire::Params::default();
    let block_bytes = sc.engine.block_tokens * BYTES_PER_TOKEN;
    let long_prompt_bytes = sc.hearth.params().long_prompt_bytes;

    let warmup_us = (sc.warmup_s * 1e6) as u64;
    let end_us = warmup_us + (sc.duration_s * 1e6) as u64;
    let mut queue: BinaryHeap<Reverse<(u64, u64, Ev)>> = BinaryHeap::new();
    let mut seq = 0u64;
    let mut push = |queue: &mut BinaryHeap<_>, t: u64, ev: Ev| {
        seq += 1;
        queue.push(Reverse((t, seq, ev)));
    };
    // Clients start spread over the first ten seconds.
    for c in 0..spec.agents {
        let t = (c as u64 * 10_000_000) / spec.agents.max(1) as u64;
        push(&mut queue, t, Ev::Send(c));
    }
    if let Some(at) = sc.restart_at_s {
        push(&mut queue, warmup_us + (at * 1e6) as u64, Ev::Restart(0));
    }
    let scrape_us = sc.engine_metrics_s.map(|s| (s * 1e6).max(1.0) as u64);
    if let Some(every) = scrape_us {
        push(&mut queue, every, Ev::Scrape);
    }
    // What each engine's metrics would say: prompt tokens since its start,
    // and when it started (seconds).
    let mut prompt_counter = vec![0f64; n];
    let mut started_s = vec![0f64; n];
    let mut mailbox = Mailbox::default();
    let peer_delay_us = sc.hearth.peer_delay_ms.map(|ms| (ms * 1e3).max(0.0) as u64);
    // The other gateway of the agents that bypass Hearth.
    let mut bypass_ring = Policy::new(PolicyKind::RingHash, n, spec.seed, &sc.hearth);

    let mut inflight = vec![0u32; n];
    let mut load_area = vec![0f64; n];
    let mut last_t = 0u64;
    let mut pending: HashMap<u64, Pending> = HashMap::new();
    let mut next_id = 0u64;
    let mut last_replica: HashMap<u64, usize> = HashMap::new();
    let mut ideal: HashSet<u64> = HashSet::new();
    let mut records = Vec::new();

    while let Some(Reverse((t, _, ev))) = queue.pop() {
        if t > end_us {
            break;
        }
        // Time-weighted in-flight load, over the measured window only.
        let from = last_t.max(warmup_us);
        if t > from {
            for r in 0..n {
                load_area[r] += f64::from(inflight[r]) * (t - from) as f64;
            }
        }
        last_t = t;
        match ev {
            Ev::Send(c) => {
                let turn = clients[c].next_turn();
                let rendered =
                    request::parse(ApiKind::Chat, &turn.body).expect("workload bodies are valid");
                let hashes = block_hashes(&rendered.prompt, block_bytes);
                let fp = hearth_wire::fingerprint(
                    hearth_wire::Endpoint::ChatCompletions,
                    &turn.body,
                    &fp_params,
                )
                .ok();
                let prompt_tokens = rendered.prompt.len().div_ceil(BYTES_PER_TOKEN) as u32;
                let ideal_blocks = hashes.iter().take_while(|h| ideal.contains(h)).count();
                ideal.extend(hashes.iter().copied());
                let ideal_cached =
                    ((ideal_blocks * sc.engine.block_tokens) as u32).min(prompt_tokens - 1);
                let input = RouteInput {
                    prompt: &rendered.prompt,
                    engine_hashes: &hashes,
                    fingerprint: fp.as_ref(),
                    session: turn.session,
                };
                let routed = if bypasses(c, sc.bypass_share) {
                    bypass_ring.route(&input, &inflight, &engines, clock(t))
                } else {
                    policy.route(&input, &inflight, &engines, clock(t))
                };
                let r = routed.replica;
                if let (Some(k), Some(delay)) = (routed.sidecar, peer_delay_us) {
                    share(
                        &policy.routers(),
                        k,
                        delay,
                        (t, clock(t)),
                        &mut mailbox,
                        |t, ev| push(&mut queue, t, ev),
                    );
                }
                let previous = last_replica.insert(turn.session, r);
                let stayed = if turn.first_of_session {
                    None
                } else {
                    previous.map(|p| p == r)
                };
                inflight[r] += 1;
                let id = next_id;
                next_id += 1;
                engines[r].submit(id, hashes, prompt_tokens, turn.output_tokens);
                prompt_counter[r] += f64::from(prompt_tokens);
                pending.insert(
                    id,
                    Pending {
                        client: c,
                        replica: r,
                        sent_us: t,
                        first_us: None,
                        prompt_tokens,
                        cached_tokens: 0,
                        ideal_cached_tokens: ideal_cached,
                        output_tokens: turn.output_tokens,
                        stayed,
                        restart: turn.restart,
                        long: fp
                            .as_ref()
                            .is_some_and(|f| f.prompt_bytes >= long_prompt_bytes),
                        routed,
                    },
                );
                if !busy[r] {
                    start_step(
                        &mut engines[r],
                        &mut step_events[r],
                        &mut busy[r],
                        t,
                        r,
                        |t, ev| push(&mut queue, t, ev),
                    );
                    if sc.hearth.kv_events {
                        let addr = sc.hearth.replica_addr(r);
                        let routers = policy.routers();
                        publish_kv(&mut engines[r], &mut kv_seq[r], &routers, addr, clock(t));
                    }
                }
            }
            Ev::StepEnd(r) => {
                busy[r] = false;
                for event in std::mem::take(&mut step_events[r]) {
                    match event {
                        SeqEvent::FirstToken {
                            id, cached_tokens, ..
                        } => {
                            if let Some(p) = pending.get_mut(&id) {
                                p.first_us = Some(t);
                                p.cached_tokens = cached_tokens;
                                // The prompt is read: as the sidecar hears
                                // of the answer's first token.
                                if let Some(d) = &p.routed.hearth {
                                    d.prefill().done_at(clock(t));
                                }
                            }
                        }
                        SeqEvent::Finished { id, .. } => {
                            let Some(p) = pending.remove(&id) else {
                                continue;
                            };
                            inflight[p.replica] -= 1;
                            // The answer's usage goes back to the sidecar
                            // (as the outcome filter reports it), then the
                            // reservation ends.
                            let predicted = p.routed.hearth.as_ref().and_then(|d| {
                                let usage = Usage {
                                    prompt_tokens: u64::from(p.prompt_tokens),
                                    cached_tokens: u64::from(p.cached_tokens),
                                };
                                d.record_usage_at(usage, clock(t))
                                    .and_then(|s| s.predicted_tokens)
                            });
                            let sidecar = p.routed.sidecar;
                            drop(p.routed);
                            if let (Some(k), Some(delay)) = (sidecar, peer_delay_us) {
                                share(
                                    &policy.routers(),
                                    k,
                                    delay,
                                    (t, clock(t)),
                                    &mut mailbox,
                                    |t, ev| push(&mut queue, t, ev),
                                );
                            }
                            if t >= warmup_us {
                                records.push(RequestRecord {
                                    replica: p.replica,
                                    sent_s: p.sent_us as f64 / 1e6,
                                    ttft_s: (p.first_us.unwrap_or(t) - p.sent_us) as f64 / 1e6,
                                    e2e_s: (t - p.sent_us) as f64 / 1e6,
                                    prompt_tokens: p.prompt_tokens,
                                    cached_tokens: p.cached_tokens,
                                    ideal_cached_tokens: p.ideal_cached_tokens,
                                    output_tokens: p.output_tokens,
                                    stayed: p.stayed,
                                    restart: p.restart,
                                    long: p.long,
                                    failed: false,
                                    predicted_cached_tokens: predicted
                                        .map(|t| t.min(u64::from(u32::MAX)) as u32),
                                });
                            }
                            let think = clients[p.client].think_seconds();
                            push(&mut queue, t + (think * 1e6) as u64, Ev::Send(p.client));
                        }
                        SeqEvent::Token { .. } => {}
                    }
                }
                start_step(
                    &mut engines[r],
                    &mut step_events[r],
                    &mut busy[r],
                    t,
                    r,
                    |t, ev| push(&mut queue, t, ev),
                );
                if sc.hearth.kv_events {
                    let addr = sc.hearth.replica_addr(r);
                    let routers = policy.routers();
                    publish_kv(&mut engines[r], &mut kv_seq[r], &routers, addr, clock(t));
                }
            }
            Ev::PeerDeliver(m) => {
                if let Some((from, update)) = mailbox.slots.get_mut(m).and_then(Option::take) {
                    mailbox.free.push(m);
                    deliver(&policy.routers(), from, &update, clock(t));
                }
            }
            Ev::Restart(r) => {
                engines[r].flush_cache();
                // A new engine process: what the old one dropped is not
                // published, and its sequence starts at 0 again.
                engines[r].take_cache_events();
                kv_seq[r] = 0;
                prompt_counter[r] = 0.0;
                started_s[r] = t as f64 / 1e6;
            }
            Ev::Scrape => {
                for router in policy.routers() {
                    for (r, e) in engines.iter().enumerate() {
                        let signals = EngineSignals {
                            waiting: e.waiting() as f64,
                            running: e.running() as f64,
                            kv_usage: Some(e.kv_usage()),
                            at: clock(t),
                            own_in_flight: 0,
                            prompt_tokens_total: Some(prompt_counter[r]),
                            started_at: Some(started_s[r]),
                            kv_capacity_tokens: None,
                            cache_block_tokens: None,
                            progress_total: None,
                        };
                        router.set_engine_signals(sc.hearth.replica_addr(r), signals);
                    }
                }
                if let Some(every) = scrape_us {
                    push(&mut queue, t + every, Ev::Scrape);
                }
            }
        }
    }
    let corrections = {
        let routers = policy.routers();
        (!routers.is_empty()).then(|| {
            let mut sum = [0u64; 3];
            for router in routers {
                for r in router.snapshot_at(clock(end_us)).replicas {
                    sum[0] += r.usage.shrinks_total;
                    sum[1] += r.usage.growths_total;
                    // Restarts the engine's metrics showed, and those
                    // its KV events showed (with `--kv-events`).
                    sum[2] += r.usage.restarts_total
                        + r.kv_events
                            .as_ref()
                            .map_or(0, |k| k.restarts_sequence_total + k.restarts_cleared_total);
                }
            }
            sum
        })
    };
    let window = sc.duration_s * 1e6;
    RunResult {
        policy: spec.policy,
        agents: spec.agents,
        replicas: n,
        duration_s: sc.duration_s,
        records,
        mean_inflight: load_area.iter().map(|a| a / window).collect(),
        long_unfinished: pending.values().filter(|p| p.long).count(),
        corrections,
    }
}

/// Hands an engine's KV cache events since its last step to every
/// sidecar, as the batch numbered `seq`.
fn publish_kv(
    engine: &mut EngineCore,
    seq: &mut u64,
    routers: &[std::sync::Arc<hearth_router::Router>],
    addr: std::net::SocketAddr,
    now: Instant,
) {
    let events = engine.take_cache_events();
    if events.is_empty() {
        return;
    }
    let batch = hearth_wire::kv_events::Batch {
        ts: 0.0,
        events,
        data_parallel_rank: Some(0),
    };
    for router in routers {
        // The simulated feed never drops: connected from its first batch.
        router.note_kv_feed((addr, None), true);
        router.apply_kv_batch_at((addr, None), *seq, &batch, now);
    }
    *seq += 1;
}

fn start_step(
    engine: &mut EngineCore,
    events: &mut Vec<SeqEvent>,
    busy: &mut bool,
    now: u64,
    r: usize,
    mut schedule: impl FnMut(u64, Ev),
) {
    if let Some(step) = engine.step() {
        *events = step.events;
        *busy = true;
        // At least a microsecond per step, so time always advances.
        schedule(now + (step.duration_us as u64).max(1), Ev::StepEnd(r));
    }
}

/// `hearth-bench sim`: one scenario, every chosen policy at every agent
/// count, on the same seeded workload.
#[derive(Debug, Clone, clap::Args)]
pub struct SimArgs {
    /// cache-never-fills, cache-runs-out, fleet, shared-prefix, unique,
    /// long-context or long-lane.
    #[arg(long, default_value = "cache-never-fills")]
    pub scenario: String,
    /// Agent (client) counts, comma separated (default: the scenario's).
    #[arg(long, value_delimiter = ',')]
    pub agents: Vec<usize>,
    /// Policies, comma separated, or `all`.
    #[arg(long, value_delimiter = ',', default_value = "all")]
    pub policies: Vec<String>,
    /// Replicas (default: the scenario's).
    #[arg(long)]
    pub replicas: Option<usize>,
    /// KV cache per replica, in tokens (default: the scenario's).
    #[arg(long)]
    pub cache_tokens: Option<usize>,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Salt mixed into every prompt (default: the seed).
    #[arg(long)]
    pub salt: Option<u64>,
    /// Engine seconds before measuring (default: the scenario's).
    #[arg(long)]
    pub warmup_s: Option<f64>,
    /// Engine seconds measured (default: the scenario's).
    #[arg(long)]
    pub duration_s: Option<f64>,
    /// Replicas tagged `long` for the sidecar (the last ones; default:
    /// the scenario's).
    #[arg(long)]
    pub long_replicas: Option<usize>,
    /// Share of long-document requests in the long-context mix (default:
    /// the scenario's).
    #[arg(long)]
    pub long_share: Option<f64>,
    /// The Hearth policies' sidecar settings: `--set HEARTH_ALPHA=2`,
    /// any setting of docs/settings.md, parsed by the sidecar's own
    /// parser (default: the sidecar's defaults, with HEARTH_WARMTH_BLOCKS
    /// sized to the engines' KV cache). The policy picks the credit basis.
    #[command(flatten)]
    pub sidecar: crate::settings::SidecarSettings,
    /// Seconds into the measured window when the first replica's engine
    /// restarts (default: the scenario's; engine-restart: 60).
    #[arg(long)]
    pub restart_at: Option<f64>,
    /// Hearth sidecars behind a random split: each request reaches one
    /// (default 1).
    #[arg(long)]
    pub sidecars: Option<usize>,
    /// With several sidecars, the delay (ms) before one's updates (warmth,
    /// load, fencing) reach the others, as over the peer bus; unset: the
    /// sidecars share nothing.
    #[arg(long)]
    pub peer_delay_ms: Option<f64>,
    /// Seconds between the sidecar's scrapes of the engines' metrics
    /// (default: the scenario's; engine-restart: 2; 0 = none).
    #[arg(long)]
    pub engine_metrics: Option<f64>,
    /// The engines publish their KV cache events and the sidecars read
    /// them (every batch, in order: occupancy, capacity, restarts).
    #[arg(long)]
    pub kv_events: bool,
    /// Share of agents that reach the engines around Hearth, through a
    /// ring hash on their session (default: the scenario's; bypass: 0.25).
    #[arg(long)]
    pub bypass_share: Option<f64>,
    /// Runs simulated at once (each is single-threaded and deterministic).
    #[arg(long, default_value_t = 2)]
    pub jobs: usize,
    /// Write the rows (and the parameters) as JSON here.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
    /// Write the chart (turns/min against agents) here.
    #[arg(long)]
    pub svg: Option<std::path::PathBuf>,
    /// Also write every measured request of each run as CSV into this
    /// folder, `POLICY-AGENTS.csv` ([`crate::report::records_csv`]).
    #[arg(long)]
    pub records: Option<std::path::PathBuf>,
}

impl SimArgs {
    /// The scenario with every override applied.
    pub fn scenario(&self) -> anyhow::Result<Scenario> {
        let mut sc = Scenario::preset(&self.scenario).ok_or_else(|| {
            anyhow::anyhow!(
                "unknown scenario {:?}; known: {}",
                self.scenario,
                crate::scenario::NAMES.join(", ")
            )
        })?;
        if !self.agents.is_empty() {
            sc.agents = self.agents.clone();
        }
        if let Some(r) = self.replicas {
            sc.replicas = r;
        }
        if let Some(c) = self.cache_tokens {
            sc.engine.cache_capacity_tokens = c;
            sc.hearth.set([(
                "HEARTH_WARMTH_BLOCKS",
                crate::scenario::warmth_blocks_for(c).to_string(),
            )])?;
        }
        if let Some(w) = self.warmup_s {
            sc.warmup_s = w;
        }
        if let Some(d) = self.duration_s {
            sc.duration_s = d;
        }
        if let Some(n) = self.long_replicas {
            sc.hearth.long_replicas = n;
        }
        if let Some(share) = self.long_share {
            let crate::workload::Workload::LongContext(l) = &mut sc.workload else {
                anyhow::bail!("--long-share applies to the long-context mix only");
            };
            anyhow::ensure!((0.0..=1.0).contains(&share), "--long-share must be 0 to 1");
            l.long_share = share;
        }
        sc.hearth.set(self.sidecar.set.iter().cloned())?;
        if let Some(at) = self.restart_at {
            anyhow::ensure!(
                at.is_finite() && at >= 0.0,
                "--restart-at must be a number of seconds, 0 or more"
            );
            sc.restart_at_s = Some(at);
        }
        if let Some(n) = self.sidecars {
            anyhow::ensure!((1..=64).contains(&n), "--sidecars must be between 1 and 64");
            sc.hearth.sidecars = n;
        }
        if let Some(ms) = self.peer_delay_ms {
            anyhow::ensure!(
                ms.is_finite() && ms >= 0.0,
                "--peer-delay-ms must be a number of milliseconds, 0 or more"
            );
            sc.hearth.peer_delay_ms = Some(ms);
        }
        sc.hearth.kv_events |= self.kv_events;
        if let Some(every) = self.engine_metrics {
            anyhow::ensure!(
                every.is_finite() && every >= 0.0,
                "--engine-metrics must be a number of seconds, 0 or more"
            );
            sc.engine_metrics_s = (every > 0.0).then_some(every);
        }
        if let Some(b) = self.bypass_share {
            anyhow::ensure!(
                (0.0..1.0).contains(&b),
                "--bypass-share must be 0 to below 1"
            );
            sc.bypass_share = b;
        }
        anyhow::ensure!((1..=64).contains(&sc.replicas), "replicas must be 1 to 64");
        anyhow::ensure!(
            sc.hearth.long_replicas < sc.replicas,
            "long replicas must be fewer than replicas"
        );
        anyhow::ensure!(
            sc.agents.iter().all(|a| (1..=1024).contains(a)),
            "agents must be 1 to 1024"
        );
        anyhow::ensure!(
            sc.duration_s > 0.0 && sc.warmup_s >= 0.0 && sc.duration_s + sc.warmup_s <= 7200.0,
            "duration must be > 0 and warm-up + duration at most 7200 engine seconds"
        );
        sc.engine.cost.validate().map_err(anyhow::Error::msg)?;
        Ok(sc)
    }

    pub fn policies(&self) -> anyhow::Result<Vec<PolicyKind>> {
        if self.policies.iter().any(|p| p == "all") {
            return Ok(PolicyKind::ALL.to_vec());
        }
        self.policies
            .iter()
            .map(|p| {
                PolicyKind::parse(p).ok_or_else(|| {
                    anyhow::anyhow!(
                        "unknown policy {p:?}; known: all, {}",
                        PolicyKind::ALL.map(PolicyKind::name).join(", ")
                    )
                })
            })
            .collect()
    }
}

/// Runs every cell, `jobs` at a time; results come back in input order.
pub fn run_all(specs: &[RunSpec], jobs: usize) -> Vec<RunResult> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<RunResult>>> = Mutex::new(vec![None; specs.len()]);
    std::thread::scope(|s| {
        for _ in 0..jobs.clamp(1, 16) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(spec) = specs.get(i) else { break };
                let started = std::time::Instant::now();
                let result = run(spec);
                eprintln!(
                    "sim: {} {} agents: {} turns in {:.1}s",
                    spec.policy.name(),
                    spec.agents,
                    result.records.len(),
                    started.elapsed().as_secs_f64()
                );
                results.lock().unwrap_or_else(|p| p.into_inner())[i] = Some(result);
            });
        }
    });
    results
        .into_inner()
        .unwrap_or_else(|p| p.into_inner())
        .into_iter()
        .map(|r| r.expect("every cell ran"))
        .collect()
}

/// The exact command line, for the report.
pub fn command_line() -> String {
    let mut args = std::env::args();
    let first = args.next().unwrap_or_default();
    let exe = std::path::Path::new(&first)
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or(first);
    std::iter::once(exe)
        .chain(args)
        .collect::<Vec<_>>()
        .join(" ")
}

/// `hearth-bench sim`.
pub fn main(args: SimArgs) -> anyhow::Result<()> {
    let sc = args.scenario()?;
    let policies = args.policies()?;
    let salt = args.salt.unwrap_or(args.seed);
    let specs: Vec<RunSpec> = sc
        .agents
        .iter()
        .flat_map(|&agents| {
            policies.iter().map({
                let sc = sc.clone();
                move |&policy| RunSpec {
                    scenario: sc.clone(),
                    policy,
                    agents,
                    seed: args.seed,
                    salt,
                }
            })
        })
        .collect();
    let command = command_line();
    println!("# {command}");
    println!("{}", crate::provenance::header());
    println!(
        "# scenario {} ({} replicas, KV {} tokens each, {} s warm-up + {} s measured, seed {}, salt {})",
        sc.name,
        sc.replicas,
        sc.engine.cache_capacity_tokens,
        sc.warmup_s,
        sc.duration_s,
        args.seed,
        salt
    );
    println!("# parameters {}", serde_json::to_string(&sc)?);
    let started = std::time::Instant::now();
    let results = run_all(&specs, args.jobs);
    let mut rows: Vec<crate::report::Row> =
        results.iter().map(|r| r.row(&sc.name, "sim")).collect();
    crate::report::attach_oracle(&mut rows);
    print!("{}", crate::report::table(&rows));
    if sc.hearth.long_replicas > 0
        || matches!(sc.workload, crate::workload::Workload::LongContext(_))
    {
        println!(
            "# TTFT by prompt size (long: >= {} prompt bytes; {} replica(s) tagged long, lane {})",
            sc.hearth.params().long_prompt_bytes,
            sc.hearth.long_replicas,
            sc.hearth.params().long_lane.as_str()
        );
        print!("{}", crate::report::long_table(&rows));
    }
    if rows.iter().any(|r| r.prediction_bias.is_some()) {
        println!(
            "# the sidecar's predicted cached tokens against the engines' (usage feedback {}): bias = predicted / served - 1; |err|/prm = sum |predicted - served| / prompt tokens",
            if sc.hearth.params().usage_feedback {
                "on"
            } else {
                "off"
            }
        );
        print!("{}", crate::report::prediction_table(&rows));
    }
    println!(
        "# {} runs in {:.1} s wall-clock",
        rows.len(),
        started.elapsed().as_secs_f64()
    );
    if let Some(path) = &args.json {
        let doc = serde_json::json!({
            "command": command,
            "build": crate::provenance::json(),
            "driver": "sim",
            "seed": args.seed,
            "salt": salt,
            "scenario": sc,
            "rows": rows,
        });
        std::fs::write(path, serde_json::to_vec_pretty(&doc)?)?;
    }
    if let Some(dir) = &args.records {
        std::fs::create_dir_all(dir)?;
        for r in &results {
            let path = dir.join(format!("{}-{}.csv", r.policy.name(), r.agents));
            std::fs::write(&path, crate::report::records_csv(&r.records))?;
            println!("# wrote {}", path.display());
        }
    }
    if let Some(path) = &args.svg {
        let title = format!("{}: turns/min by policy (simulated)", sc.name);
        std::fs::write(path, crate::report::svg(&title, &command, &rows))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::{AgentSwarm, Workload};

    /// A small agent swarm on two replicas, quick even in a debug build.
    fn small(policy: PolicyKind) -> RunSpec {
        let mut scenario = Scenario::preset("cache-never-fills").unwrap();
        scenario.workload = Workload::AgentSwarm(AgentSwarm {
            harness_bytes: 16 * 1024,
            repo_bytes: 2048,
            tool_result_median_tokens: 600.0,
            compact_at_tokens: 24_000,
            ..AgentSwarm::default()
        });
        scenario.warmup_s = 20.0;
        scenario.duration_s = 60.0;
        RunSpec {
            scenario,
            policy,
            agents: 12,
            seed: 5,
            salt: 5,
        }
    }

    fn sim_args(args: &[&str]) -> SimArgs {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            sim: SimArgs,
        }
        <Cli as clap::Parser>::try_parse_from(std::iter::once("sim").chain(args.iter().copied()))
            .unwrap()
            .sim
    }

    /// The router parameters the simulator's Hearth policy really runs.
    fn routed_params(args: &SimArgs) -> hearth_router::RouterParams {
        let sc = args.scenario().unwrap();
        let policy = Policy::new(PolicyKind::HearthRelative, sc.replicas, 1, &sc.hearth);
        *policy.routers()[0].params()
    }

    #[test]
    fn records_writes_each_runs_requests_as_csv() {
        let dir = std::env::temp_dir().join(format!("hearth-sim-records-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let args = sim_args(&[
            "--scenario",
            "shared-prefix",
            "--agents",
            "4",
            "--warmup-s",
            "2",
            "--duration-s",
            "30",
            "--policies",
            "hearth_relative,round_robin",
            "--jobs",
            "1",
            "--records",
            dir.to_str().unwrap(),
        ]);
        main(args).unwrap();
        for name in ["hearth_relative-4.csv", "round_robin-4.csv"] {
            let csv = std::fs::read_to_string(dir.join(name)).unwrap();
            let mut lines = csv.lines();
            assert!(lines.next().unwrap().starts_with("sent_s,replica,ttft_s,"));
            let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
            assert!(!rows.is_empty(), "{name} has no requests");
            for row in &rows {
                assert_eq!(row.len(), 9, "{name}: {row:?}");
                // Four replicas; sent after the run began.
                assert!(row[1].parse::<usize>().unwrap() < 4);
                assert!(row[0].parse::<f64>().unwrap() >= 0.0);
            }
            // Only Hearth predicts what the engine will serve from cache.
            let predicted = rows.iter().filter(|r| !r[6].is_empty()).count();
            if name.starts_with("hearth") {
                assert_eq!(predicted, rows.len());
            } else {
                assert_eq!(predicted, 0);
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_sidecar_setting_given_to_the_bench_reaches_the_simulated_router() {
        let plain = routed_params(&sim_args(&["--scenario", "shared-prefix"]));
        let set = sim_args(&[
            "--scenario",
            "shared-prefix",
            "--set",
            "HEARTH_ALPHA=3.5",
            "--set=HEARTH_SHORT_OUTPUT_TOKENS=77",
            "--hearth-setting",
            "HEARTH_RESIDENT_SECONDS=30",
        ]);
        let tuned = routed_params(&set);
        assert_eq!(tuned.score.alpha, 3.5);
        // A setting the bench never heard of reaches it just the same.
        assert_eq!(tuned.short_output_tokens, 77);
        assert_eq!(tuned.resident_window, Duration::from_secs(30));
        assert_ne!(plain, tuned);
        // Nothing else moved.
        let mut back = tuned;
        back.score.alpha = plain.score.alpha;
        back.short_output_tokens = plain.short_output_tokens;
        back.resident_window = plain.resident_window;
        assert_eq!(back, plain);
        // The sidecar's parser refuses for the bench what it would refuse.
        for bad in [
            "HEARTH_ALPHA=-1",
            "HEARTH_ALFA=1",
            "HEARTH_LONG_LANE=sideways",
        ] {
            let args = sim_args(&["--set", bad]);
            assert!(args.scenario().is_err(), "{bad}");
        }
    }

    #[test]
    fn the_simulators_defaults_are_the_sidecars() {
        let sidecar = hearth_ext_proc::config::settings_from_pairs(&[])
            .unwrap()
            .router_params();
        assert_eq!(*crate::policies::HearthKnobs::default().params(), sidecar);
        assert_eq!(sidecar, hearth_router::RouterParams::default());
        // A scenario changes only the warmth index's size, to its engines'
        // KV cache; the policy picks the basis.
        let sc = Scenario::preset("cache-runs-out").unwrap();
        let mut p = routed_params(&sim_args(&["--scenario", "cache-runs-out"]));
        assert_eq!(
            p.warmth_blocks,
            crate::scenario::warmth_blocks_for(sc.engine.cache_capacity_tokens)
        );
        p.warmth_blocks = sidecar.warmth_blocks;
        p.warmth_from_engine = sidecar.warmth_from_engine;
        assert_eq!(p, sidecar);
        // The undersized-kv scenario runs the sidecar's own index size.
        let p = routed_params(&sim_args(&["--scenario", "undersized-kv"]));
        assert_eq!(p, sidecar);
    }

    #[test]
    fn a_seed_gives_the_same_run() {
        let a = run(&small(PolicyKind::HearthRelative));
        let b = run(&small(PolicyKind::HearthRelative));
        assert!(!a.records.is_empty());
        assert_eq!(a.records, b.records);
    }

    #[test]
    fn oracle_then_hearth_then_round_robin_on_cached_fraction() {
        let rows: Vec<_> = [
            PolicyKind::Oracle,
            PolicyKind::HearthRelative,
            PolicyKind::RoundRobin,
        ]
        .iter()
        .map(|&p| run(&small(p)).row("t", "sim"))
        .collect();
        let (oracle, hearth, rr) = (&rows[0], &rows[1], &rows[2]);
        assert!(
            oracle.cached_fraction >= hearth.cached_fraction
                && hearth.cached_fraction > rr.cached_fraction,
            "oracle {} hearth {} round_robin {}",
            oracle.cached_fraction,
            hearth.cached_fraction,
            rr.cached_fraction
        );
        assert!(hearth.stay_rate.unwrap() > rr.stay_rate.unwrap());
        // The workload's ideal bounds every policy.
        assert!(oracle.cached_fraction <= oracle.ideal_cached_fraction + 1e-9);
        assert!(rows.iter().all(|r| r.turns > 20 && r.failures == 0));
    }
}

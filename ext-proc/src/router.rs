//! The routing decision: fingerprint → candidates → overlap → credit → load
//! → pick → reserve, over state shared by every Envoy stream.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::config::{self, default_replica_id, LongLane, Settings, UpstreamSpec};
use crate::health::{FleetHealth, HealthParams, HealthSnapshot, Outcome, ReplicaHealth};
use crate::policy::{self, AffinityBasis, Candidate, ScoreParams};
use crate::warmth::LruBlocks;

/// Resident conversations a replica holds before the old ones are dropped
/// at the next decision rather than at the next first turn.
const RESIDENT_PRUNE_AT: usize = 4096;

/// A configured engine replica: one routing target.
#[derive(Clone, Debug, PartialEq)]
pub struct Replica {
    /// Opaque name shown to clients in `x-hearth-upstream`.
    pub id: String,
    pub addr: SocketAddr,
    /// Models it serves; empty means any.
    pub models: Vec<String>,
    /// In the long-prompt lane.
    pub long: bool,
    /// The data-parallel rank this target is, behind a shared address.
    pub dp_rank: Option<u32>,
    /// Suited to short outputs (e.g. speculative decoding): preferred for
    /// them when cache and load tie.
    pub short_output: bool,
    /// Removed from the replica list by a reload: never a candidate again;
    /// its slot is reused once the requests it still runs have ended.
    pub retired: bool,
}

/// The routing targets an upstream list names, in order: a data-parallel
/// endpoint becomes one target per rank.
pub fn targets(upstreams: &[UpstreamSpec]) -> Vec<Replica> {
    upstreams
        .iter()
        .enumerate()
        .flat_map(|(i, u)| {
            let id = u.id.clone().unwrap_or_else(|| default_replica_id(i));
            (0..u.dp_ranks).map(move |rank| Replica {
                id: if u.dp_ranks > 1 {
                    format!("{id}/rank{rank}")
                } else {
                    id.clone()
                },
                addr: u.addr,
                models: u.models.clone(),
                long: u.long,
                dp_rank: (u.dp_ranks > 1).then_some(rank),
                short_output: u.short_output,
                retired: false,
            })
        })
        .collect()
}

/// What a reload of the replica list changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReloadSummary {
    /// New targets (fresh warmth and load).
    pub added: usize,
    /// Targets no longer listed (retired; their running requests finish).
    pub removed: usize,
    /// Targets at the same address and rank whose id, models or tags
    /// changed: they keep their warmth, load and health.
    pub updated: usize,
    /// Targets listed exactly as before.
    pub unchanged: usize,
}

impl ReloadSummary {
    pub fn changed(&self) -> bool {
        self.added + self.removed + self.updated > 0
    }
}

impl std::fmt::Display for ReloadSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} added, {} removed, {} updated, {} unchanged",
            self.added, self.removed, self.updated, self.unchanged
        )
    }
}

/// What names the engine behind a routing target across reloads: its
/// address and data-parallel rank.
pub type ReplicaKey = (SocketAddr, Option<u32>);

impl Replica {
    pub fn key(&self) -> ReplicaKey {
        (self.addr, self.dp_rank)
    }

    fn serves(&self, model: Option<&str>) -> bool {
        match model {
            Some(m) if !self.models.is_empty() => self.models.iter().any(|x| x == m),
            _ => true,
        }
    }
}

/// A routing target to probe: its engine address and rank, its id (for
/// logs), and the model to ask for.
#[derive(Clone, Debug, PartialEq)]
pub struct ProbeTarget {
    pub key: ReplicaKey,
    pub id: String,
    pub model: Option<String>,
}

/// What the sidecar knows about one request before it is routed.
#[derive(Clone, Debug, Default)]
pub struct RequestInfo {
    /// Chained block hashes from the filter, if the request was hashed.
    pub hashes: Vec<u64>,
    /// Canonical prompt length in bytes (0 when unknown).
    pub prompt_bytes: u64,
    pub model: Option<String>,
    /// The request's output cap, when the client set one.
    pub max_output_tokens: Option<u64>,
}

/// Why a request could not be routed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    #[error("no replica serves model {0:?}")]
    NoReplicaForModel(String),
    #[error("no healthy replica serves model {0:?}")]
    NoHealthyReplica(String),
    #[error("every eligible replica is at its in-flight or queue limit")]
    Saturated,
}

/// A routing decision. Dropping it releases the load it reserved.
#[derive(Debug)]
pub struct Decision {
    /// Chosen replica first, then fallbacks for retries.
    pub order: Vec<usize>,
    /// Leading blocks the chosen replica already held.
    pub overlap: u32,
    /// The prompt extends an earlier one (else it was scored as a first
    /// turn, under `HEARTH_FIRST_TURN_CAP`).
    pub continues: bool,
    /// Every candidate as it was scored, in replica order (for the
    /// decision journal and metrics; built from numbers the decision
    /// computed anyway).
    pub candidates: Vec<ScoredCandidate>,
    /// The replica table the indices above refer to (a reload may reuse a
    /// retired slot later; this table is the one the decision saw).
    pub replicas: Arc<[Replica]>,
    pub reservation: Reservation,
}

/// One candidate replica as a decision saw it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScoredCandidate {
    /// Index into [`Router::replicas`].
    pub replica: usize,
    /// Leading request blocks it held.
    pub overlap: u32,
    /// Credit under the affinity basis, in blocks.
    pub credit: f64,
    /// In-flight load before this request, in load units.
    pub load: f64,
    /// `credit - alpha * load`.
    pub score: f64,
}

impl Decision {
    pub fn primary(&self) -> usize {
        self.order[0]
    }

    /// `ip:port,ip:port,...` for the first `limit` entries of the order,
    /// each address once (data-parallel ranks share one).
    pub fn destination(&self, limit: usize) -> String {
        let mut seen: Vec<SocketAddr> = Vec::with_capacity(self.order.len());
        for &i in self.order.iter().take(limit) {
            let a = self.replicas[i].addr;
            if !seen.contains(&a) {
                seen.push(a);
            }
        }
        seen.iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// Load held on a replica for a request's whole life; released on drop, so
/// every way a stream can end (completion, client abort, upstream reset,
/// timeout, gRPC error) gives the load back.
pub struct Reservation {
    router: Arc<Router>,
    replica: usize,
    weight: f64,
}

impl std::fmt::Debug for Reservation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reservation")
            .field("replica", &self.replica)
            .field("weight", &self.weight)
            .finish()
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut fleet = self.router.lock();
        let r = &mut fleet.state[self.replica];
        r.in_flight = r.in_flight.saturating_sub(1);
        r.load -= self.weight;
        // Sums of floats drift; an idle replica carries exactly no load.
        r.load = if r.in_flight == 0 {
            0.0
        } else {
            r.load.max(0.0)
        };
    }
}

struct ReplicaState {
    warmth: LruBlocks,
    in_flight: u32,
    load: f64,
    routed: u64,
    health: ReplicaHealth,
    /// The engine's own figures (for this target's share of its address).
    engine: Option<EngineSignals>,
    /// Conversations whose latest turn went here: their tip (last full
    /// block) and when that turn was routed.
    resident: std::collections::HashMap<u64, Instant>,
}

impl ReplicaState {
    fn new(warmth_blocks: usize) -> ReplicaState {
        ReplicaState {
            warmth: LruBlocks::new(warmth_blocks),
            in_flight: 0,
            load: 0.0,
            routed: 0,
            health: ReplicaHealth::default(),
            engine: None,
            resident: std::collections::HashMap::new(),
        }
    }
}

/// The replica table and each slot's state, under one lock. Slot indices
/// are stable: a removed replica's slot is retired (kept while requests it
/// runs hold reservations on it) and reused for a later new replica.
struct Fleet {
    replicas: Arc<[Replica]>,
    state: Vec<ReplicaState>,
    /// The serving slots, in the order the replica list names them.
    listed: Vec<usize>,
    /// Some serving replica is tagged `long` (else the lane is off).
    any_long: bool,
    /// Some serving replica has `profile=short-output`.
    any_short_output: bool,
}

impl Fleet {
    /// The serving replicas, in list order.
    fn serving(&self) -> impl Iterator<Item = (usize, &Replica)> {
        self.listed.iter().map(|&i| (i, &self.replicas[i]))
    }

    /// Replaces the replica list with `targets`. A target at the address
    /// and rank of a serving replica keeps that slot and its state; one
    /// no longer listed is retired; a new one takes a drained retired slot,
    /// or a new one.
    fn apply(&mut self, targets: Vec<Replica>, warmth_blocks: usize) -> ReloadSummary {
        let mut table: Vec<Replica> = self.replicas.to_vec();
        let mut listed = vec![false; table.len()];
        let mut summary = ReloadSummary::default();
        // New targets, with their place in the list.
        let mut fresh = Vec::new();
        let mut order: Vec<Option<usize>> = Vec::with_capacity(targets.len());
        for t in targets {
            let same = (0..table.len())
                .find(|&i| !table[i].retired && !listed[i] && table[i].key() == t.key());
            match same {
                Some(i) => {
                    listed[i] = true;
                    order.push(Some(i));
                    if table[i] == t {
                        summary.unchanged += 1;
                    } else {
                        summary.updated += 1;
                        table[i] = t;
                    }
                }
                None => {
                    fresh.push((order.len(), t));
                    order.push(None);
                }
            }
        }
        for (i, r) in table.iter_mut().enumerate() {
            if !r.retired && !listed[i] {
                r.retired = true;
                summary.removed += 1;
                // Its warmth and engine figures mean nothing any more; its
                // in-flight count drains as its requests end.
                let s = &mut self.state[i];
                s.warmth = LruBlocks::new(1);
                s.engine = None;
            }
        }
        for (place, t) in fresh {
            summary.added += 1;
            let reusable = (0..table.len())
                .find(|&i| table[i].retired && !listed[i] && self.state[i].in_flight == 0);
            let i = match reusable {
                Some(i) => {
                    table[i] = t;
                    self.state[i] = ReplicaState::new(warmth_blocks);
                    i
                }
                None => {
                    table.push(t);
                    listed.push(false);
                    self.state.push(ReplicaState::new(warmth_blocks));
                    table.len() - 1
                }
            };
            listed[i] = true;
            order[place] = Some(i);
        }
        self.listed = order.into_iter().flatten().collect();
        self.any_long = table.iter().any(|r| !r.retired && r.long);
        self.any_short_output = table.iter().any(|r| !r.retired && r.short_output);
        self.replicas = table.into();
        summary
    }
}

/// What an engine's Prometheus metrics said, when.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EngineSignals {
    /// Requests queued in the engine.
    pub waiting: f64,
    /// Requests the engine is running (from every gateway).
    pub running: f64,
    /// KV cache utilisation, 0..1, when reported.
    pub kv_usage: Option<f64>,
    pub at: Instant,
    /// This sidecar's own in-flight requests on the target when the
    /// figures arrived: `running` beyond it is other gateways' traffic.
    pub own_in_flight: u32,
}

/// An engine's figures on the state endpoint.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct EngineSnapshot {
    pub waiting: f64,
    pub running: f64,
    pub kv_usage: Option<f64>,
    pub age_s: f64,
}

/// Per-replica figures for the state endpoint.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ReplicaSnapshot {
    pub id: String,
    pub address: String,
    pub models: Vec<String>,
    pub in_flight: u32,
    pub load: f64,
    pub warmth_blocks: usize,
    pub warmth_capacity: usize,
    pub warmth_memory_bytes: usize,
    pub routed_total: u64,
    pub health: HealthSnapshot,
    pub long: bool,
    pub dp_rank: Option<u32>,
    /// The engine's last scraped figures, if any.
    pub engine: Option<EngineSnapshot>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Snapshot {
    pub affinity_basis: AffinityBasis,
    pub affinity_cap: u32,
    pub alpha: f64,
    pub block_size: usize,
    /// `ok` (every replica serving), `degraded` (some fenced) or
    /// `unhealthy` (none serving).
    pub health: FleetHealth,
    pub decisions_total: u64,
    pub hashed_total: u64,
    pub unhashed_total: u64,
    pub rejected_total: u64,
    /// Routed requests that ended after an engine's response headers.
    pub answered_total: u64,
    /// Routed requests that ended before any response headers (client
    /// gave up first, or the upstream failed).
    pub unanswered_total: u64,
    pub upstreams: UpstreamsSnapshot,
    /// The serving replicas (removed ones are not listed).
    pub replicas: Vec<ReplicaSnapshot>,
}

/// The replica list's history on the state endpoint.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct UpstreamsSnapshot {
    /// Bumped each time a reload changed the list.
    pub version: u64,
    /// Reloads applied (changed or not).
    pub reloads_total: u64,
    /// Reloads refused: the file did not parse or check; the list stayed.
    pub reload_errors_total: u64,
    /// Why the last reload was refused, until one is applied.
    pub reload_error: Option<String>,
    /// Requests still running on replicas a reload removed.
    pub draining_in_flight: u32,
}

/// Shared routing state: the replica registry, each replica's warmth and
/// in-flight load. One mutex guards it; a decision is a few microseconds.
pub struct Router {
    params: ScoreParams,
    block_size: usize,
    load_unit_bytes: u64,
    max_inflight: u32,
    fallbacks: usize,
    health_params: HealthParams,
    long_prompt_bytes: u64,
    long_lane: LongLane,
    warmth_blocks: usize,
    engine_stale: Duration,
    engine_load_weight: f64,
    max_queue: u64,
    short_output_tokens: u64,
    resident_window: Duration,
    resident_load: f64,
    fleet: Mutex<Fleet>,
    /// Last full block of recent prompts, fleet-wide (bounded LRU): a
    /// request whose overlap reaches one continues an earlier prompt.
    /// Locked after `state`, never before.
    tips: Mutex<LruBlocks>,
    rr: AtomicUsize,
    /// The replica list's version: bumped each time the list changes, so
    /// the endpoint-discovery stream knows to push it to Envoy.
    version: tokio::sync::watch::Sender<u64>,
    /// Reloads of the replica list: applied, refused, and the last refusal.
    reloads: AtomicU64,
    reload_errors: AtomicU64,
    reload_error: Mutex<Option<String>>,
    decisions: AtomicU64,
    hashed: AtomicU64,
    rejected: AtomicU64,
    answered: AtomicU64,
    unanswered: AtomicU64,
}

impl Router {
    pub fn new(settings: &Settings) -> Arc<Router> {
        let mut fleet = Fleet {
            replicas: Arc::new([]),
            state: Vec::new(),
            listed: Vec::new(),
            any_long: false,
            any_short_output: false,
        };
        fleet.apply(targets(&settings.upstreams), settings.warmth_blocks);
        Arc::new(Router {
            params: settings.score_params(),
            block_size: settings.block_size,
            load_unit_bytes: settings.load_unit_bytes,
            max_inflight: settings.max_inflight,
            fallbacks: settings.fallbacks,
            health_params: settings.health_params(),
            long_prompt_bytes: settings.long_prompt_bytes,
            long_lane: settings.long_lane,
            warmth_blocks: settings.warmth_blocks,
            engine_stale: config::seconds(settings.engine_metrics_stale_seconds),
            engine_load_weight: settings.engine_load_weight,
            max_queue: settings.max_queue,
            short_output_tokens: settings.short_output_tokens,
            resident_window: config::seconds(settings.resident_seconds),
            resident_load: settings.resident_load,
            fleet: Mutex::new(fleet),
            tips: Mutex::new(LruBlocks::new(settings.warmth_blocks)),
            rr: AtomicUsize::new(0),
            version: tokio::sync::watch::Sender::new(1),
            reloads: AtomicU64::new(0),
            reload_errors: AtomicU64::new(0),
            reload_error: Mutex::new(None),
            decisions: AtomicU64::new(0),
            hashed: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            answered: AtomicU64::new(0),
            unanswered: AtomicU64::new(0),
        })
    }

    /// The replica table: every slot, retired ones included (indices in
    /// decisions and snapshots point into it).
    pub fn replicas(&self) -> Arc<[Replica]> {
        Arc::clone(&self.lock().replicas)
    }

    /// Replaces the replica list (a reload). Replicas at an address and
    /// rank already listed keep their warmth, load and health; others start
    /// fresh; unlisted ones stop taking requests at once, and the requests
    /// they run finish.
    pub fn set_upstreams(&self, upstreams: &[UpstreamSpec]) -> ReloadSummary {
        let summary = self.lock().apply(targets(upstreams), self.warmth_blocks);
        self.reloads.fetch_add(1, Ordering::Relaxed);
        *self.reload_error.lock().unwrap_or_else(|p| p.into_inner()) = None;
        if summary.changed() {
            self.version.send_modify(|v| *v += 1);
        }
        summary
    }

    /// A reload that was refused (the list stays as it was).
    pub fn note_reload_error(&self, error: String) {
        self.reload_errors.fetch_add(1, Ordering::Relaxed);
        *self.reload_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(error);
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Index of the replica at `addr`, if it is one of ours (`prefer` when
    /// it is at that address: data-parallel ranks share one).
    pub fn replica_at(&self, addr: &str, prefer: Option<usize>) -> Option<usize> {
        let fleet = self.lock();
        let at = |r: &Replica| r.addr.to_string() == addr;
        if let Some(p) = prefer.filter(|&p| fleet.replicas.get(p).is_some_and(at)) {
            return Some(p);
        }
        let found = fleet.serving().find(|(_, r)| at(r)).map(|(i, _)| i);
        found
    }

    /// Engine figures scraped from `addr`'s metrics, shared by its ranks.
    pub fn set_engine_signals(&self, addr: SocketAddr, signals: EngineSignals) {
        let mut guard = self.lock();
        let fleet = &mut *guard;
        let ranks = fleet
            .serving()
            .filter(|(_, r)| r.addr == addr)
            .count()
            .max(1) as f64;
        for (r, s) in fleet.replicas.iter().zip(fleet.state.iter_mut()) {
            if r.addr == addr && !r.retired {
                s.engine = Some(EngineSignals {
                    waiting: signals.waiting / ranks,
                    running: signals.running / ranks,
                    own_in_flight: s.in_flight,
                    ..signals
                });
            }
        }
    }

    /// Engine figures that are still fresh.
    fn fresh_engine(&self, s: &ReplicaState, now: Instant) -> Option<EngineSignals> {
        s.engine
            .filter(|e| now.duration_since(e.at) <= self.engine_stale)
    }

    fn lock(&self) -> MutexGuard<'_, Fleet> {
        // A panic while holding the lock cannot leave the state torn in a
        // way that matters more than losing routing altogether.
        self.fleet.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Chooses a replica for `req` and reserves load on it.
    pub fn decide(self: &Arc<Self>, req: &RequestInfo) -> Result<Decision, RouteError> {
        self.decide_within(req, None)
    }

    /// As [`Router::decide`], but only among the replicas in `allowed`
    /// when given (the Gateway API Inference Extension's subset hint).
    pub fn decide_within(
        self: &Arc<Self>,
        req: &RequestInfo,
        allowed: Option<&[usize]>,
    ) -> Result<Decision, RouteError> {
        self.decisions.fetch_add(1, Ordering::Relaxed);
        if !req.hashes.is_empty() {
            self.hashed.fetch_add(1, Ordering::Relaxed);
        }
        let mut guard = self.lock();
        let fleet = &mut *guard;
        let replicas = Arc::clone(&fleet.replicas);
        let any_long = fleet.any_long;
        let any_short_output = fleet.any_short_output;
        let state = &mut fleet.state;

        // Candidates: healthy replicas that serve the model and have room.
        let serving: Vec<usize> = fleet
            .listed
            .iter()
            .copied()
            .filter(|&i| replicas[i].serves(req.model.as_deref()))
            .filter(|i| allowed.is_none_or(|a| a.contains(i)))
            .collect();
        if serving.is_empty() {
            self.rejected.fetch_add(1, Ordering::Relaxed);
            return Err(RouteError::NoReplicaForModel(
                req.model.clone().unwrap_or_default(),
            ));
        }
        // The long-prompt lane: long prompts only on `long` replicas; short
        // ones per HEARTH_LONG_LANE (avoid-unless-warm is settled below,
        // once overlaps are known).
        let long_request = any_long && req.prompt_bytes >= self.long_prompt_bytes;
        let in_lane: Vec<usize> = serving
            .into_iter()
            .filter(|&i| state[i].health.is_serving())
            .filter(|&i| match (long_request, any_long, self.long_lane) {
                (true, _, _) => replicas[i].long,
                (false, true, LongLane::Exclusive) => !replicas[i].long,
                _ => true,
            })
            .collect();
        let healthy: Vec<usize> = if !long_request && any_long && self.long_lane == LongLane::Avoid
        {
            let short_only: Vec<usize> = in_lane
                .iter()
                .copied()
                .filter(|&i| !replicas[i].long)
                .collect();
            if short_only.is_empty() {
                in_lane
            } else {
                short_only
            }
        } else {
            in_lane
        };
        if healthy.is_empty() {
            self.rejected.fetch_add(1, Ordering::Relaxed);
            return Err(RouteError::NoHealthyReplica(
                req.model.clone().unwrap_or_default(),
            ));
        }
        // Admission: in-flight and engine-queue limits.
        let now = Instant::now();
        let candidates: Vec<usize> = healthy
            .into_iter()
            .filter(|&i| self.max_inflight == 0 || state[i].in_flight < self.max_inflight)
            .filter(|&i| {
                self.max_queue == 0
                    || self
                        .fresh_engine(&state[i], now)
                        .is_none_or(|e| e.waiting < self.max_queue as f64)
            })
            .collect();
        if candidates.is_empty() {
            self.rejected.fetch_add(1, Ordering::Relaxed);
            return Err(RouteError::Saturated);
        }

        // Overlap and load per candidate (the overlap searches of all
        // candidates run together), then the scoring rule.
        let sets: Vec<&LruBlocks> = candidates.iter().map(|&i| &state[i].warmth).collect();
        let overlaps = LruBlocks::leading_overlaps(&sets, &req.hashes);
        let (candidates, overlaps) = if long_request || !any_long {
            (candidates, overlaps)
        } else {
            self.warm_long_only(&replicas, candidates, overlaps)
        };
        let warmest = overlaps.iter().copied().max().unwrap_or(0);
        let mut tips = self.tips.lock().unwrap_or_else(|p| p.into_inner());
        let continued = req.hashes[..warmest.min(req.hashes.len())]
            .iter()
            .rev()
            .find(|&&h| tips.contains(h))
            .copied();
        let continues = continued.is_some();
        // A new conversation: while some candidate is idle (nothing
        // resident, nothing running), conversations paused on the others
        // count against them.
        let mut residents_count = false;
        if !continues && self.resident_load > 0.0 {
            for &i in &candidates {
                self.forget_departed(&mut state[i], now);
            }
            residents_count = candidates
                .iter()
                .any(|&i| state[i].resident.is_empty() && state[i].in_flight == 0);
        }
        let scored: Vec<Candidate> = candidates
            .iter()
            .zip(overlaps)
            .map(|(&i, overlap)| Candidate {
                overlap: overlap as u32,
                load: state[i].load
                    + self.engine_load(&state[i], now)
                    + if residents_count {
                        self.resident_load(&state[i])
                    } else {
                        0.0
                    },
            })
            .collect();
        // Round-robin among exact ties: the turn advances only when the
        // top of the ranking was a tie, so regular traffic patterns cannot
        // keep landing ties on the same replica.
        let rr = self.rr.load(Ordering::Relaxed);
        let ranking = policy::rank_scored(&self.params.for_request(continues), &scored, rr);
        let ranked = &if any_short_output {
            self.prefer_profile(
                &replicas,
                ranking.order.clone(),
                &ranking.scores,
                &candidates,
                req,
            )
        } else {
            ranking.order.clone()
        };
        if let [first, second, ..] = ranked[..] {
            let tied = ranking.scores[first] == ranking.scores[second]
                && scored[first].overlap == scored[second].overlap;
            if tied {
                self.rr.fetch_add(1, Ordering::Relaxed);
            }
        }
        let order: Vec<usize> = ranked
            .iter()
            .take(1 + self.fallbacks)
            .map(|&k| candidates[k])
            .collect();
        let chosen = order[0];
        let overlap = scored[ranked[0]].overlap;
        let traced = candidates
            .iter()
            .zip(&scored)
            .zip(ranking.credits.iter().zip(&ranking.scores))
            .map(|((&replica, c), (&credit, &score))| ScoredCandidate {
                replica,
                overlap: c.overlap,
                credit,
                load: c.load,
                score,
            })
            .collect();

        // Reserve: weight by the prompt bytes the replica must still read,
        // and record the prompt as warm there now, so concurrent requests
        // with the same new prefix follow this one.
        let cached_bytes = u64::from(overlap) * self.block_size as u64;
        let uncached = req.prompt_bytes.saturating_sub(cached_bytes);
        let weight = 1.0 + uncached as f64 / self.load_unit_bytes as f64;
        let r = &mut state[chosen];
        r.in_flight += 1;
        r.load += weight;
        r.routed += 1;
        r.warmth.record_prompt(&req.hashes);
        // The prompt's last full block (a trailing partial block changes as
        // the conversation grows, so the next turn never matches it).
        let full = if req.prompt_bytes == 0 {
            req.hashes.len()
        } else {
            req.hashes
                .len()
                .min((req.prompt_bytes / self.block_size as u64) as usize)
        };
        if let Some(&tip) = full.checked_sub(1).and_then(|k| req.hashes.get(k)) {
            tips.touch(tip);
            // The conversation now lives here (and no longer where its
            // previous turn went).
            if let Some(previous) = continued {
                for s in state.iter_mut() {
                    s.resident.remove(&previous);
                }
            }
            let r = &mut state[chosen];
            r.resident.insert(tip, now);
            if r.resident.len() > RESIDENT_PRUNE_AT {
                self.forget_departed(r, now);
            }
        }
        drop(tips);
        drop(guard);

        Ok(Decision {
            order,
            overlap,
            continues,
            candidates: traced,
            replicas,
            reservation: Reservation {
                router: Arc::clone(self),
                replica: chosen,
                weight,
            },
        })
    }

    /// Among the candidates tied for the top score, those whose output
    /// profile suits the request go first (short outputs to replicas tagged
    /// `profile=short-output`, longer ones elsewhere); the rest of the order
    /// is kept.
    fn prefer_profile(
        &self,
        replicas: &[Replica],
        mut order: Vec<usize>,
        scores: &[f64],
        candidates: &[usize],
        req: &RequestInfo,
    ) -> Vec<usize> {
        let Some(tokens) = req.max_output_tokens else {
            return order;
        };
        if order.is_empty() {
            return order;
        }
        let short = tokens <= self.short_output_tokens;
        let top = scores[order[0]];
        let tied = order.iter().take_while(|&&k| scores[k] == top).count();
        order[..tied].sort_by_key(|&k| replicas[candidates[k]].short_output != short);
        order
    }

    /// Under `avoid-unless-warm`, a short prompt keeps a `long` replica
    /// only where the session is cached: more of it than on the least-warm
    /// candidate (unless no other replica is left).
    fn warm_long_only(
        &self,
        replicas: &[Replica],
        candidates: Vec<usize>,
        overlaps: Vec<usize>,
    ) -> (Vec<usize>, Vec<usize>) {
        if self.long_lane != LongLane::AvoidUnlessWarm {
            return (candidates, overlaps);
        }
        let least = overlaps.iter().copied().min().unwrap_or(0);
        let kept: (Vec<usize>, Vec<usize>) = candidates
            .iter()
            .zip(&overlaps)
            .filter(|(&i, &o)| !replicas[i].long || o > least)
            .map(|(&i, &o)| (i, o))
            .unzip();
        if kept.0.is_empty() {
            (candidates, overlaps)
        } else {
            kept
        }
    }

    /// Drops conversations whose latest turn is older than the resident
    /// window (they ended, or pause long enough to be evicted anyway).
    fn forget_departed(&self, s: &mut ReplicaState, now: Instant) {
        let window = self.resident_window;
        s.resident
            .retain(|_, at| now.saturating_duration_since(*at) < window);
    }

    /// Load that a new conversation sees on a replica for the
    /// conversations resident there and not running now (while another
    /// replica is idle): they will come back, and a slot-based engine
    /// evicts one of them for each newcomer beyond its slots.
    fn resident_load(&self, s: &ReplicaState) -> f64 {
        let idle = s.resident.len().saturating_sub(s.in_flight as usize);
        self.resident_load * idle as f64
    }

    /// Load the engine reports beyond this sidecar's own reservations:
    /// queued requests, and running ones other gateways sent.
    fn engine_load(&self, s: &ReplicaState, now: Instant) -> f64 {
        match self.fresh_engine(s, now) {
            Some(e) => {
                let foreign = (e.running - f64::from(e.own_in_flight)).max(0.0);
                (e.waiting + foreign) * self.engine_load_weight
            }
            None => 0.0,
        }
    }

    /// Counts how a routed request's stream ended: after the engine's
    /// response headers, or before.
    pub fn note_stream_end(&self, answered: bool) {
        let counter = if answered {
            &self.answered
        } else {
            &self.unanswered
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// A finished request's outcome on replica `i` (passive health). Each
    /// data-parallel rank has its own: a stuck rank is fenced alone.
    pub fn record_request(&self, i: usize, outcome: Outcome) {
        let params = self.health_params;
        let now = Instant::now();
        let mut fleet = self.lock();
        if fleet.replicas.get(i).is_some_and(|r| !r.retired) {
            fleet.state[i].health.record_request(outcome, &params, now);
        }
    }

    /// A probe's outcome on the routing target `key` (active health).
    pub fn record_probe(&self, key: ReplicaKey, outcome: Outcome) {
        let params = self.health_params;
        let now = Instant::now();
        let mut guard = self.lock();
        let fleet = &mut *guard;
        for (r, s) in fleet.replicas.iter().zip(fleet.state.iter_mut()) {
            if r.key() == key && !r.retired {
                s.health.record_probe(outcome, &params, now, s.in_flight);
            }
        }
    }

    /// A metrics scrape of the engine at `addr`: refused with this status,
    /// or not. True when the refusal is new (worth a log line).
    pub fn record_scrape(&self, addr: SocketAddr, refused: Option<u16>) -> bool {
        let mut guard = self.lock();
        let fleet = &mut *guard;
        let mut new = false;
        for (r, s) in fleet.replicas.iter().zip(fleet.state.iter_mut()) {
            if r.addr == addr && !r.retired {
                new |= refused.is_some() && s.health.credentials_error().is_none();
                s.health.record_scrape(refused);
            }
        }
        new
    }

    /// The routing targets due for an active probe now (see
    /// [`crate::health::ReplicaHealth::probe_due`]).
    pub fn probe_targets(&self) -> Vec<ProbeTarget> {
        let now = Instant::now();
        let fleet = self.lock();
        fleet
            .serving()
            .filter(|&(i, _)| {
                let s = &fleet.state[i];
                s.health
                    .probe_due(&self.health_params, now, s.in_flight)
                    .is_some()
            })
            .map(|(_, r)| ProbeTarget {
                key: r.key(),
                id: r.id.clone(),
                model: r.models.first().cloned(),
            })
            .collect()
    }

    /// Each engine address once, with the model to probe it with.
    pub fn engines(&self) -> Vec<(SocketAddr, Option<String>)> {
        let mut out: Vec<(SocketAddr, Option<String>)> = Vec::new();
        for (_, r) in self.lock().serving() {
            if !out.iter().any(|(a, _)| *a == r.addr) {
                out.push((r.addr, r.models.first().cloned()));
            }
        }
        out
    }

    /// Each serving address once, in replica order: what Envoy's `engines`
    /// cluster should hold (endpoint discovery).
    pub fn endpoints(&self) -> Vec<SocketAddr> {
        self.engines().into_iter().map(|(a, _)| a).collect()
    }

    /// The replica list's version; changes whenever [`Router::endpoints`]
    /// may have.
    pub fn watch_endpoints(&self) -> tokio::sync::watch::Receiver<u64> {
        self.version.subscribe()
    }

    pub fn fleet_health(&self) -> FleetHealth {
        let fleet = self.lock();
        FleetHealth::of(fleet.serving().map(|(i, _)| fleet.state[i].health.state()))
    }

    pub fn snapshot(&self) -> Snapshot {
        let now = Instant::now();
        let fleet = self.lock();
        let state = &fleet.state;
        let decisions = self.decisions.load(Ordering::Relaxed);
        let hashed = self.hashed.load(Ordering::Relaxed);
        Snapshot {
            affinity_basis: self.params.basis,
            affinity_cap: self.params.cap,
            alpha: self.params.alpha,
            block_size: self.block_size,
            health: FleetHealth::of(fleet.serving().map(|(i, _)| state[i].health.state())),
            decisions_total: decisions,
            hashed_total: hashed,
            unhashed_total: decisions - hashed,
            rejected_total: self.rejected.load(Ordering::Relaxed),
            answered_total: self.answered.load(Ordering::Relaxed),
            unanswered_total: self.unanswered.load(Ordering::Relaxed),
            upstreams: UpstreamsSnapshot {
                version: *self.version.borrow(),
                reloads_total: self.reloads.load(Ordering::Relaxed),
                reload_errors_total: self.reload_errors.load(Ordering::Relaxed),
                reload_error: self
                    .reload_error
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .clone(),
                draining_in_flight: fleet
                    .replicas
                    .iter()
                    .zip(state)
                    .filter(|(r, _)| r.retired)
                    .map(|(_, s)| s.in_flight)
                    .sum(),
            },
            replicas: fleet
                .serving()
                .map(|(i, r)| (r, &state[i]))
                .map(|(r, s)| ReplicaSnapshot {
                    id: r.id.clone(),
                    address: r.addr.to_string(),
                    models: r.models.clone(),
                    in_flight: s.in_flight,
                    load: s.load,
                    warmth_blocks: s.warmth.len(),
                    warmth_capacity: s.warmth.capacity(),
                    warmth_memory_bytes: s.warmth.memory_bytes(),
                    routed_total: s.routed,
                    health: s.health.snapshot(now),
                    long: r.long,
                    dp_rank: r.dp_rank,
                    engine: s.engine.map(|e| EngineSnapshot {
                        waiting: e.waiting,
                        running: e.running,
                        kv_usage: e.kv_usage,
                        age_s: now.duration_since(e.at).as_secs_f64(),
                    }),
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Cli;
    use clap::Parser;

    fn router(extra: &[&str]) -> Arc<Router> {
        let mut args = vec![
            "hearth-ext-proc",
            "--upstreams",
            "127.0.0.1:1001,127.0.0.1:1002,127.0.0.1:1003;model=special",
        ];
        args.extend_from_slice(extra);
        Router::new(&Cli::try_parse_from(args).unwrap().settings)
    }

    fn req(hashes: &[u64]) -> RequestInfo {
        RequestInfo {
            hashes: hashes.to_vec(),
            prompt_bytes: hashes.len() as u64 * 2048,
            model: Some("m".into()),
            max_output_tokens: None,
        }
    }

    #[test]
    fn a_session_returns_to_the_replica_that_read_it() {
        let router = router(&[]);
        let first = router.decide(&req(&[1, 2, 3])).unwrap();
        let home = first.primary();
        drop(first);
        for turn in 4..10u64 {
            let hashes: Vec<u64> = (1..=turn).collect();
            let d = router.decide(&req(&hashes)).unwrap();
            assert_eq!(d.primary(), home);
            assert_eq!(d.overlap, (turn - 1) as u32);
        }
    }

    #[test]
    fn first_turns_spread_by_load_and_later_turns_follow_their_history() {
        let router = router(&["--alpha", "2", "--first-turn-cap", "4"]);
        // 32 shared harness blocks, then each conversation's own.
        let harness: Vec<u64> = (1..=32).collect();
        let turn = |conv: u64, len: u64| {
            let mut h = harness.clone();
            h.extend((0..len).map(|k| 1000 * conv + k));
            req(&h)
        };
        let a = router.decide(&turn(1, 4)).unwrap();
        assert!(!a.continues);
        // A second conversation on the same harness starts elsewhere: the
        // harness is worth 4 blocks of credit, the load 2 x 3 units.
        let b = router.decide(&turn(2, 4)).unwrap();
        assert!(!b.continues);
        assert_ne!(a.primary(), b.primary());
        assert_eq!(b.overlap, 0);
        // The first conversation's next turn continues its prompt and
        // returns to its replica, busy as it is.
        let a2 = router.decide(&turn(1, 8)).unwrap();
        assert!(a2.continues);
        assert_eq!(a2.primary(), a.primary());
        assert_eq!(a2.overlap, 36);
    }

    #[test]
    fn reservations_last_until_dropped_and_push_new_work_elsewhere() {
        let router = router(&["--alpha", "100"]);
        let a = router.decide(&req(&[7])).unwrap();
        let b = router.decide(&req(&[8])).unwrap();
        assert_ne!(a.primary(), b.primary(), "load spreads cold requests");
        let snap = router.snapshot();
        assert_eq!(snap.replicas.iter().map(|r| r.in_flight).sum::<u32>(), 2);
        drop(a);
        drop(b);
        let snap = router.snapshot();
        assert!(snap
            .replicas
            .iter()
            .all(|r| r.in_flight == 0 && r.load == 0.0));
    }

    #[test]
    fn model_restrictions_and_no_eligible_replica() {
        let router = router(&[]);
        let mut special = req(&[1]);
        special.model = Some("special".into());
        // Replicas 0 and 1 serve any model, replica 2 only "special".
        let d = router.decide(&special).unwrap();
        assert_eq!(d.order.len(), 3);
        let none = RequestInfo {
            model: Some("other".into()),
            ..req(&[1])
        };
        let d = router.decide(&none).unwrap();
        assert!(!d.order.contains(&2), "replica 2 serves only 'special'");
    }

    #[test]
    fn saturation_and_unknown_models_are_errors() {
        let only = Router::new(
            &Cli::try_parse_from([
                "x",
                "--upstreams",
                "127.0.0.1:1;model=a",
                "--max-inflight",
                "1",
            ])
            .unwrap()
            .settings,
        );
        let mut r = req(&[1]);
        r.model = Some("a".into());
        let held = only.decide(&r).unwrap();
        assert_eq!(only.decide(&r).unwrap_err(), RouteError::Saturated);
        drop(held);
        assert!(only.decide(&r).is_ok());
        r.model = Some("b".into());
        assert_eq!(
            only.decide(&r).unwrap_err(),
            RouteError::NoReplicaForModel("b".into())
        );
    }

    #[test]
    fn fenced_replicas_get_no_traffic_and_none_healthy_is_an_error() {
        use crate::health::Failure;
        let router = router(&[]);
        for _ in 0..3 {
            router.record_request(0, Outcome::Failure(Failure::EmptyAnswer));
        }
        for _ in 0..20 {
            let d = router.decide(&req(&[9])).unwrap();
            assert!(!d.order.contains(&0), "fenced replica 0 was offered");
        }
        assert_eq!(router.fleet_health(), FleetHealth::Degraded);
        for i in 1..3 {
            for _ in 0..3 {
                router.record_request(i, Outcome::Failure(Failure::ServerError));
            }
        }
        assert_eq!(router.fleet_health(), FleetHealth::Unhealthy);
        assert!(matches!(
            router.decide(&req(&[9])),
            Err(RouteError::NoHealthyReplica(_))
        ));
    }

    fn lane_router(lane: &str) -> Arc<Router> {
        Router::new(
            &Cli::try_parse_from([
                "x",
                "--upstreams",
                "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3;tag=long",
                "--long-prompt-bytes",
                "100000",
                "--long-lane",
                lane,
                "--fallbacks",
                "5",
            ])
            .unwrap()
            .settings,
        )
    }

    fn sized(hashes: &[u64], bytes: u64) -> RequestInfo {
        RequestInfo {
            hashes: hashes.to_vec(),
            prompt_bytes: bytes,
            model: None,
            max_output_tokens: None,
        }
    }

    #[test]
    fn long_prompts_go_only_to_the_long_lane() {
        for lane in ["shared", "exclusive", "avoid", "avoid-unless-warm"] {
            let r = lane_router(lane);
            let d = r.decide(&sized(&[1], 200_000)).unwrap();
            assert_eq!(d.order, [2], "{lane}");
        }
    }

    #[test]
    fn short_prompts_follow_the_lane_setting() {
        let r = lane_router("shared");
        assert_eq!(r.decide(&sized(&[1], 10)).unwrap().order.len(), 3);
        for lane in ["exclusive", "avoid", "avoid-unless-warm"] {
            let r = lane_router(lane);
            let d = r.decide(&sized(&[1], 10)).unwrap();
            assert!(!d.order.contains(&2), "{lane}: {:?}", d.order);
        }
        // Avoid falls back to the long replica when nothing else is left;
        // exclusive does not.
        for (lane, expect_ok) in [("avoid", true), ("exclusive", false)] {
            let r = lane_router(lane);
            for i in 0..2 {
                for _ in 0..3 {
                    r.record_request(i, Outcome::Failure(crate::health::Failure::ServerError));
                }
            }
            assert_eq!(r.decide(&sized(&[1], 10)).is_ok(), expect_ok, "{lane}");
        }
    }

    #[test]
    fn avoid_unless_warm_keeps_a_long_replica_that_holds_the_session() {
        let r = lane_router("avoid-unless-warm");
        // The session started long, on the long replica.
        drop(r.decide(&sized(&[7, 8, 9], 200_000)).unwrap());
        // Its next (short, after compaction-like trimming) prompt shares
        // the prefix: the long replica stays eligible, and wins on warmth.
        let d = r.decide(&sized(&[7, 8, 9, 10], 50)).unwrap();
        assert_eq!(d.primary(), 2);
        // A cold short prompt does not get it.
        let d = r.decide(&sized(&[99], 50)).unwrap();
        assert!(!d.order.contains(&2));
    }

    #[test]
    fn a_replica_with_a_request_running_is_not_probed() {
        let r = Router::new(
            &Cli::try_parse_from(["x", "--upstreams", "127.0.0.1:1,127.0.0.1:2"])
                .unwrap()
                .settings,
        );
        let ids =
            |r: &Router| -> Vec<String> { r.probe_targets().into_iter().map(|t| t.id).collect() };
        assert_eq!(
            ids(&r),
            ["replica-0", "replica-1"],
            "both idle, never probed"
        );
        let running = r.decide(&req(&[1, 2])).unwrap();
        let busy = running.primary();
        let other = r.replicas()[1 - busy].id.clone();
        assert_eq!(
            ids(&r),
            [other.clone()],
            "the running request is the evidence"
        );
        // A probe that timed out behind it is no strike.
        let key = (r.replicas()[busy].addr, None);
        for _ in 0..5 {
            r.record_probe(key, Outcome::Failure(crate::health::Failure::Timeout));
        }
        assert_eq!(r.snapshot().replicas[busy].health.consecutive_failures, 0);
        // Once it ends, the probe just recorded counts for the interval.
        drop(running);
        assert_eq!(ids(&r), [other]);
        // Without a request running, the same timeouts strike.
        for _ in 0..3 {
            r.record_probe(key, Outcome::Failure(crate::health::Failure::Timeout));
        }
        assert_eq!(r.snapshot().replicas[busy].health.consecutive_failures, 3);
    }

    #[test]
    fn data_parallel_ranks_are_separate_targets_behind_one_address() {
        let r = Router::new(
            &Cli::try_parse_from(["x", "--upstreams", "127.0.0.1:1;id=e;dp=2,127.0.0.1:2"])
                .unwrap()
                .settings,
        );
        let table = r.replicas();
        let ids: Vec<_> = table.iter().map(|x| x.id.as_str()).collect();
        assert_eq!(ids, ["e/rank0", "e/rank1", "replica-1"]);
        assert_eq!(r.replicas()[1].dp_rank, Some(1));
        // The destination names each address once.
        let mut d = r.decide(&req(&[1])).unwrap();
        d.order = vec![0, 1, 2];
        assert_eq!(d.destination(3), "127.0.0.1:1,127.0.0.1:2");
        assert_eq!(d.destination(1), "127.0.0.1:1");
        drop(d);
        assert_eq!(r.replica_at("127.0.0.1:1", Some(1)), Some(1));
        // Warmth is per rank: a session returns to its rank.
        let first = r.decide(&req(&[4, 5])).unwrap();
        let rank = first.primary();
        drop(first);
        assert_eq!(r.decide(&req(&[4, 5, 6])).unwrap().primary(), rank);
        // Health is per rank: a stuck rank is fenced alone.
        for _ in 0..3 {
            r.record_request(0, Outcome::Failure(crate::health::Failure::Timeout));
        }
        let snap = r.snapshot();
        let states: Vec<_> = snap.replicas.iter().map(|x| x.health.state).collect();
        use crate::health::HealthState::{Fenced, Serving};
        assert_eq!(states, [Fenced, Serving, Serving]);
        // Probes go to the fenced rank (backoff over) with its rank, and
        // to the idle others; a probe's outcome lands on its rank only.
        r.record_probe(
            (table[1].addr, Some(1)),
            Outcome::Failure(crate::health::Failure::ServerError),
        );
        assert_eq!(r.snapshot().replicas[1].health.consecutive_failures, 1);
        assert_eq!(r.snapshot().replicas[0].health.consecutive_failures, 3);
    }

    #[test]
    fn paused_conversations_count_against_their_replica_for_new_ones() {
        // Four new conversations share a 32-block system prompt; each
        // runs its first turn and pauses (its reservation dropped).
        let four = |resident_load: &str| {
            let list = "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3,127.0.0.1:4";
            let args = ["x", "--upstreams", list, "--resident-load", resident_load];
            Router::new(&Cli::try_parse_from(args).unwrap().settings)
        };
        let place = |resident_load: &str| {
            let r = four(resident_load);
            let mut homes = Vec::new();
            for c in 0..4u64 {
                let mut h: Vec<u64> = (1..=32).collect();
                h.extend((0..4).map(|k| 1000 * (c + 1) + k));
                homes.push(r.decide(&req(&h)).unwrap().primary());
            }
            homes
        };
        // Paused conversations weigh nothing: the prompt's holder takes
        // every newcomer (its credit beats no load anywhere).
        let packed = place("0");
        assert!(packed.iter().all(|&h| h == packed[0]), "{packed:?}");
        // Resident conversations count: one per replica.
        let mut spread = place("5");
        spread.sort();
        assert_eq!(spread, [0, 1, 2, 3]);
        // A conversation's next turn still goes home, whatever resides
        // there; and it does not count against the home twice.
        let r = four("5");
        let mut turn: Vec<u64> = (1..=32).collect();
        turn.extend([7001, 7002]);
        let home = r.decide(&req(&turn)).unwrap().primary();
        for k in 0..5u64 {
            turn.extend([8000 + 2 * k, 8001 + 2 * k]);
            assert_eq!(r.decide(&req(&turn)).unwrap().primary(), home);
        }
        let snap_resident = r.lock().state[home].resident.len();
        assert_eq!(snap_resident, 1, "one conversation, one resident entry");
    }

    #[test]
    fn engine_figures_add_load_until_they_go_stale() {
        let r = Router::new(
            &Cli::try_parse_from([
                "x",
                "--upstreams",
                "127.0.0.1:1,127.0.0.1:2",
                "--engine-metrics-stale-seconds",
                "5",
                "--max-queue",
                "4",
                // Only the engine's figures weigh here.
                "--resident-load",
                "0",
            ])
            .unwrap()
            .settings,
        );
        let busy = |waiting: f64, running: f64, age: u64| EngineSignals {
            waiting,
            running,
            kv_usage: None,
            at: Instant::now() - Duration::from_secs(age),
            own_in_flight: 0,
        };
        let a: SocketAddr = "127.0.0.1:1".parse().unwrap();
        // Another gateway keeps engine 0 busy: new work goes to engine 1.
        r.set_engine_signals(a, busy(0.0, 6.0, 0));
        for k in 0..4 {
            assert_eq!(r.decide(&req(&[100 + k])).unwrap().primary(), 1);
        }
        // Stale figures are ignored.
        r.set_engine_signals(a, busy(0.0, 60.0, 30));
        let d = r.decide(&req(&[200])).unwrap();
        assert_eq!(d.order.len(), 2);
        // A full queue everywhere sheds.
        r.set_engine_signals(a, busy(4.0, 0.0, 0));
        r.set_engine_signals("127.0.0.1:2".parse().unwrap(), busy(9.0, 0.0, 0));
        assert_eq!(r.decide(&req(&[300])).unwrap_err(), RouteError::Saturated);
    }

    #[test]
    fn output_profiles_break_ties() {
        let r = Router::new(
            &Cli::try_parse_from([
                "x",
                "--upstreams",
                "127.0.0.1:1,127.0.0.1:2;profile=short-output",
            ])
            .unwrap()
            .settings,
        );
        let with_cap = |hashes: &[u64], cap: Option<u64>| RequestInfo {
            max_output_tokens: cap,
            ..req(hashes)
        };
        for k in 0..4 {
            assert_eq!(
                r.decide(&with_cap(&[10 + k], Some(16))).unwrap().primary(),
                1
            );
            assert_eq!(
                r.decide(&with_cap(&[20 + k], Some(4096)))
                    .unwrap()
                    .primary(),
                0
            );
        }
        // Warmth still beats the profile.
        drop(r.decide(&with_cap(&[30], Some(4096))).unwrap());
        assert_eq!(
            r.decide(&with_cap(&[30, 31], Some(16))).unwrap().primary(),
            0
        );
    }

    #[test]
    fn destination_lists_fallbacks_in_rank_order() {
        let router = router(&["--fallbacks", "1"]);
        let d = router.decide(&req(&[5])).unwrap();
        assert_eq!(d.order.len(), 2);
        let dest = d.destination(usize::MAX);
        assert_eq!(dest.split(',').count(), 2);
        assert_eq!(
            router.replica_at(dest.split(',').next().unwrap(), None),
            Some(d.primary())
        );
    }

    fn specs(list: &str) -> Vec<UpstreamSpec> {
        list.split(',').map(|u| u.parse().unwrap()).collect()
    }

    #[test]
    fn a_reload_keeps_listed_replicas_warm_and_loaded() {
        let r = Router::new(
            &Cli::try_parse_from([
                "x",
                "--upstreams",
                "127.0.0.1:1001;id=a,127.0.0.1:1002;id=b,127.0.0.1:1003;id=c",
                "--alpha",
                "0",
            ])
            .unwrap()
            .settings,
        );
        // A session on some replica, with a request still running there.
        drop(r.decide(&req(&[1, 2, 3])).unwrap());
        let running = r.decide(&req(&[1, 2, 3, 4])).unwrap();
        let home = running.primary();
        let home_addr = r.replicas()[home].addr;
        let before = r.snapshot();
        let version = *r.watch_endpoints().borrow();

        // The list now names the home replica (under a new id), drops one
        // other and adds a new one.
        let other = (0..3).find(|&i| i != home).unwrap();
        let kept_other = (0..3).find(|&i| i != home && i != other).unwrap();
        let addr = |i: usize| r.replicas()[i].addr;
        let list = format!(
            "{home_addr};id=home,{};id={},127.0.0.1:1009;id=new",
            addr(kept_other),
            r.replicas()[kept_other].id
        );
        let summary = r.set_upstreams(&specs(&list));
        assert_eq!(
            (
                summary.added,
                summary.removed,
                summary.updated,
                summary.unchanged
            ),
            (1, 1, 1, 1),
            "{summary}"
        );
        assert_ne!(*r.watch_endpoints().borrow(), version);
        let after = r.snapshot();
        let ids: Vec<&str> = after.replicas.iter().map(|x| x.id.as_str()).collect();
        assert_eq!(ids.len(), 3);
        assert_eq!(ids[0], "home");
        assert_eq!(ids[2], "new", "listed in the file's order");
        let home_now = after.replicas.iter().find(|x| x.id == "home").unwrap();
        let home_before = &before.replicas[home];
        assert_eq!(home_now.warmth_blocks, home_before.warmth_blocks);
        assert_eq!(home_now.in_flight, 1);
        assert_eq!(home_now.load, home_before.load);
        assert_eq!(
            r.endpoints(),
            [
                home_addr,
                addr(kept_other),
                "127.0.0.1:1009".parse().unwrap()
            ]
        );

        // The session's next turn stays home; the removed replica is never
        // offered again.
        let removed_addr = before.replicas[other].address.clone();
        let d = r.decide(&req(&[1, 2, 3, 4, 5])).unwrap();
        assert_eq!(r.replicas()[d.primary()].addr, home_addr);
        for k in 0..10 {
            let d = r.decide(&req(&[500 + k])).unwrap();
            let dest = d.destination(usize::MAX);
            assert!(!dest.contains(&removed_addr), "{dest}");
        }
        drop(d);
        drop(running);
        assert!(r.snapshot().replicas.iter().all(|x| x.in_flight == 0));
    }

    #[test]
    fn a_removed_replica_drains_before_its_slot_is_reused() {
        let r = Router::new(
            &Cli::try_parse_from(["x", "--upstreams", "127.0.0.1:1,127.0.0.1:2"])
                .unwrap()
                .settings,
        );
        let held = r.decide(&req(&[7])).unwrap();
        let slot = held.primary();
        let addr = r.replicas()[slot].addr;
        let remaining = r.replicas()[1 - slot].addr;
        r.set_upstreams(&specs(&remaining.to_string()));
        assert_eq!(r.snapshot().upstreams.draining_in_flight, 1);
        // A new replica cannot take the slot while a request runs on it.
        r.set_upstreams(&specs(&format!("{remaining},127.0.0.1:3")));
        assert_eq!(r.replicas().len(), 3);
        assert!(r.replicas()[slot].retired);
        // The running request ends: its reservation releases the old slot
        // (not the new replica), which the next new replica reuses.
        drop(held);
        assert_eq!(r.snapshot().upstreams.draining_in_flight, 0);
        assert!(r.snapshot().replicas.iter().all(|x| x.in_flight == 0));
        r.set_upstreams(&specs(&format!("{remaining},127.0.0.1:3,127.0.0.1:4")));
        assert_eq!(r.replicas().len(), 3);
        assert_eq!(r.replicas()[slot].addr.port(), 4);
        assert_ne!(r.replicas()[slot].addr, addr);
        // Re-adding a removed address starts it fresh, not from old state.
        assert_eq!(r.snapshot().replicas.len(), 3);
    }
}

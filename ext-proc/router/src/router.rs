//! [`Router`]: the fleet state behind one lock, and what flows in and out
//! of it besides decisions (reloads, engine figures, health evidence,
//! probe targets).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Instant;

use crate::fleet::{EngineBatch, EngineSignals, Fleet, ReplicaState};
use crate::health::{FleetHealth, Outcome, ProbeReason, Work};
use crate::kv_events::RestartReason;
use crate::params::RouterParams;
use crate::replica::{
    targets, EventSource, ProbeTarget, ReloadSummary, Replica, ReplicaKey, UpstreamSpec,
};
use crate::tips::Tips;
use crate::usage::{
    blocks_for_tokens, engine_blocks, Prediction, Served, Usage, DEFAULT_BYTES_PER_TOKEN,
};
use hearth_wire::kv_events::Batch;

/// Called with the replica list's new version after a reload changed it.
type ListChange = Box<dyn Fn(u64) + Send + Sync>;

/// Called after a request's reservation is released.
type Released = Box<dyn Fn() + Send + Sync>;

/// Shared routing state: the replica registry, each replica's warmth and
/// in-flight load. One mutex guards it; a decision is a few microseconds.
pub struct Router {
    pub(crate) params: RouterParams,
    pub(crate) fleet: Mutex<Fleet>,
    /// Last full block of recent prompts, fleet-wide, with the replica
    /// each went to (see [`crate::tips`]). Locked after `fleet`, never
    /// before.
    pub(crate) tips: Mutex<Tips>,
    /// The round-robin turn among exact ties.
    pub(crate) rr: AtomicUsize,
    /// The replica list's version: bumped each time the list changes.
    version: AtomicU64,
    on_list_change: Mutex<Vec<ListChange>>,
    on_release: OnceLock<Released>,
    /// Reloads of the replica list: applied, refused, and the last refusal.
    pub(crate) reloads: AtomicU64,
    pub(crate) reload_errors: AtomicU64,
    pub(crate) reload_error: Mutex<Option<String>>,
    /// Where the list comes from, and whether that source is in step.
    pub(crate) source: Mutex<SourceStatus>,
    pub(crate) decisions: AtomicU64,
    pub(crate) hashed: AtomicU64,
    pub(crate) rejected: AtomicU64,
    pub(crate) answered: AtomicU64,
    pub(crate) unanswered: AtomicU64,
}

impl Router {
    pub fn new(params: RouterParams, upstreams: &[UpstreamSpec]) -> Arc<Router> {
        Arc::new(Router {
            params,
            fleet: Mutex::new(Fleet::new(targets(upstreams), params.warmth_blocks)),
            tips: Mutex::new(Tips::new(params.warmth_blocks)),
            rr: AtomicUsize::new(0),
            version: AtomicU64::new(1),
            on_list_change: Mutex::new(Vec::new()),
            on_release: OnceLock::new(),
            reloads: AtomicU64::new(0),
            reload_errors: AtomicU64::new(0),
            reload_error: Mutex::new(None),
            source: Mutex::new(SourceStatus::default()),
            decisions: AtomicU64::new(0),
            hashed: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            answered: AtomicU64::new(0),
            unanswered: AtomicU64::new(0),
        })
    }

    pub fn params(&self) -> &RouterParams {
        &self.params
    }

    pub fn block_size(&self) -> usize {
        self.params.block_size
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
        let summary = self
            .lock()
            .apply(targets(upstreams), self.params.warmth_blocks);
        self.reloads.fetch_add(1, Ordering::Relaxed);
        *lock(&self.reload_error) = None;
        if summary.changed() {
            let version = self.version.fetch_add(1, Ordering::Relaxed) + 1;
            for f in lock(&self.on_list_change).iter() {
                f(version);
            }
        }
        summary
    }

    /// A reload that was refused (the list stays as it was).
    pub fn note_reload_error(&self, error: String) {
        self.reload_errors.fetch_add(1, Ordering::Relaxed);
        *lock(&self.reload_error) = Some(error);
    }

    /// Names the replica list's source (a list is in step from the start;
    /// a watched source is not until its first list).
    pub fn set_source(&self, name: impl Into<String>, synced: bool) {
        let mut s = lock(&self.source);
        s.name = name.into();
        s.synced = synced;
        s.connected = true;
        s.error = None;
    }

    /// A watched source's first list was applied.
    pub fn note_source_synced(&self) {
        lock(&self.source).synced = true;
    }

    /// The watched source is reachable again (`None`), or was lost (why):
    /// while lost, the last list stays.
    pub fn note_source_connection(&self, lost: Option<String>) {
        let mut s = lock(&self.source);
        match lost {
            None => {
                s.connected = true;
                s.error = None;
            }
            Some(why) => {
                if s.connected {
                    s.disconnects_total += 1;
                }
                s.connected = false;
                s.error = Some(why);
            }
        }
    }

    /// The replica list's source and its state.
    pub fn source(&self) -> SourceStatus {
        lock(&self.source).clone()
    }

    /// The replica list's version; changes whenever [`Router::endpoints`]
    /// may have.
    pub fn version(&self) -> u64 {
        self.version.load(Ordering::Relaxed)
    }

    /// Calls `f` with the new version each time a reload changes the list
    /// (from the reloading thread; keep it short).
    pub fn on_list_change(&self, f: impl Fn(u64) + Send + Sync + 'static) {
        lock(&self.on_list_change).push(Box::new(f));
    }

    /// Calls `f` after each reservation is released (outside the lock;
    /// keep it short): the flow-control queue's cue that room may have
    /// opened. One hook per router; false when one is set already.
    pub fn on_release(&self, f: impl Fn() + Send + Sync + 'static) -> bool {
        self.on_release.set(Box::new(f)).is_ok()
    }

    pub(crate) fn released(&self) {
        if let Some(f) = self.on_release.get() {
            f();
        }
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
    /// `signals.at` is their time input: a decision at a `now` more than
    /// `engine_stale` after it ignores them.
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
                // A restart the engine's own figures show: its cache is gone.
                let restarted = self.params.usage_feedback
                    && s.engine.is_some_and(|old| old.restarted_by(&signals));
                if restarted {
                    s.forget_cache();
                    s.usage.restarts += 1;
                    s.batch = EngineBatch::default();
                }
                s.batch
                    .see(signals.running / ranks, signals.waiting / ranks, signals.at);
                // Its cache block, when it states one (its answers must
                // bear it out: see `usage`).
                s.usage.engine_granule = signals.cache_block_tokens.map(|b| b as u64);
                // Its KV capacity, when it says and the operator set none:
                // the index takes that size when first told (or after a
                // restart), and never exceeds it; in between, the answers'
                // corrections move it below.
                let bpt = s.usage.bytes_per_token.unwrap_or(DEFAULT_BYTES_PER_TOKEN);
                // (Or what its KV events showed, when its metrics say none.)
                s.engine_blocks = signals
                    .kv_capacity_tokens
                    .or_else(|| s.kv.capacity_tokens())
                    .map(|kv| engine_blocks(kv, bpt, self.params.block_size, ranks));
                let told = signals
                    .kv_capacity_tokens
                    .filter(|_| self.params.warmth_from_engine);
                if let Some(kv) = told {
                    let first = s.engine.is_none_or(|e| e.kv_capacity_tokens.is_none());
                    s.warmth_limit = blocks_for_tokens(kv, bpt, self.params.block_size, ranks);
                    // First told (or after a restart): that size; beyond
                    // it, never (`bound_warmth`).
                    if (first || restarted) && !s.kv.is_exact() {
                        s.warmth.set_capacity(s.warmth_limit);
                    }
                }
                s.bound_warmth(self.params.warmth_blocks);
                // Its own evidence of work: requests it runs or queues, and
                // whether its work counters moved since the last reading.
                let moved = signals.progress_total.map(|now_total| {
                    s.engine
                        .and_then(|old| old.progress_total)
                        .is_none_or(|before| now_total != before)
                });
                let working = signals.running + signals.waiting > 0.0;
                s.health
                    .record_reading(&self.params.health, signals.at, working, moved);
                s.engine = Some(EngineSignals {
                    waiting: signals.waiting / ranks,
                    running: signals.running / ranks,
                    own_in_flight: s.in_flight.saturating_add(s.peer_in_flight),
                    ..signals
                });
            }
        }
    }

    /// The replicas whose engines publish KV cache events (each
    /// data-parallel rank apart), with where, and where they replay.
    pub fn kv_event_endpoints(&self) -> Vec<EventSource> {
        let fleet = self.lock();
        let mut out: Vec<EventSource> = Vec::new();
        for (_, r) in fleet.serving() {
            if let Some(e) = &r.kv_events {
                if !out.iter().any(|s| s.key == r.key()) {
                    out.push(EventSource {
                        key: r.key(),
                        endpoint: e.clone(),
                        replay: r.kv_events_replay.clone(),
                        engine_url: r.engine_url(),
                    });
                }
            }
        }
        out
    }

    /// Where the engine (rank) `key` said it publishes (`kv_events=auto`),
    /// or `None` while it has not: what `/state` shows as the feed's
    /// endpoint.
    pub fn note_kv_endpoint(&self, key: ReplicaKey, stated: Option<String>) {
        let mut fleet = self.lock();
        let fleet = &mut *fleet;
        for (r, s) in fleet.replicas.iter().zip(fleet.state.iter_mut()) {
            if r.key() == key && !r.retired && r.kv_events.is_some() {
                s.kv.stated_endpoint = stated.clone();
            }
        }
    }

    /// The sequence number the event feed of the engine (rank) `key`
    /// should carry next, when known.
    pub fn kv_expected_seq(&self, key: ReplicaKey) -> Option<u64> {
        let fleet = self.lock();
        fleet
            .replicas
            .iter()
            .zip(fleet.state.iter())
            .find(|(r, _)| r.key() == key && !r.retired && r.kv_events.is_some())
            .and_then(|(_, s)| s.kv.expected_seq())
    }

    /// `batches` missed batches of the engine (rank) `key` came back from
    /// its replay socket.
    pub fn note_kv_replayed(&self, key: ReplicaKey, batches: u64) {
        let mut fleet = self.lock();
        let fleet = &mut *fleet;
        for (r, s) in fleet.replicas.iter().zip(fleet.state.iter_mut()) {
            if r.key() == key && !r.retired && r.kv_events.is_some() {
                s.kv.note_replayed(batches);
            }
        }
    }

    /// The event feed of the engine (rank) `key` is connected, or not.
    pub fn note_kv_feed(&self, key: ReplicaKey, connected: bool) {
        let mut fleet = self.lock();
        let fleet = &mut *fleet;
        for (r, s) in fleet.replicas.iter().zip(fleet.state.iter_mut()) {
            if r.key() == key && !r.retired && r.kv_events.is_some() {
                s.kv.note_connection(connected);
            }
        }
    }

    /// A frame from the event feed of the engine (rank) `key` did not
    /// read.
    pub fn note_kv_refused(&self, key: ReplicaKey) {
        let mut fleet = self.lock();
        let fleet = &mut *fleet;
        for (r, s) in fleet.replicas.iter().zip(fleet.state.iter_mut()) {
            if r.key() == key && !r.retired && r.kv_events.is_some() {
                s.kv.note_refused();
            }
        }
    }

    /// Batch `seq` of the KV cache events of the engine (rank) `key`, read at
    /// `now` (see [`crate::kv_events`]). A restart it shows drops the
    /// replica's warmth; the capacity it shows sizes the warmth index when
    /// the engine's metrics state none. Returns the restarts it showed.
    pub fn apply_kv_batch_at(
        &self,
        key: ReplicaKey,
        seq: u64,
        batch: &Batch,
        now: Instant,
    ) -> Vec<RestartReason> {
        let mut guard = self.lock();
        let fleet = &mut *guard;
        let mut shown = Vec::new();
        for (r, s) in fleet.replicas.iter().zip(fleet.state.iter_mut()) {
            if r.key() != key || r.retired || r.kv_events.is_none() {
                continue;
            }
            let before = s.kv.capacity_tokens();
            let restarts = s.kv.apply(seq, batch, now);
            if !restarts.is_empty() && self.params.usage_feedback {
                s.forget_cache();
            }
            // Evictions as they happen: what Hearth last sent here before
            // the engine stored a whole cache's worth since is gone.
            s.kv.note_turnover(s.warmth.clock());
            if let Some(horizon) = s.kv.horizon() {
                let forgotten = s.warmth.forget_not_newer_than(horizon);
                s.kv.note_forgotten(forgotten);
            }
            let told = s.engine.and_then(|e| e.kv_capacity_tokens).is_some();
            let shown_capacity = s.kv.capacity_tokens();
            if let Some(kv) = shown_capacity.filter(|_| !told && shown_capacity != before) {
                let bpt = s.usage.bytes_per_token.unwrap_or(DEFAULT_BYTES_PER_TOKEN);
                s.engine_blocks = Some(engine_blocks(kv, bpt, self.params.block_size, 1.0));
                if self.params.warmth_from_engine {
                    // Never beyond the default: a feed only shrinks the
                    // index it speaks for.
                    s.warmth_limit = blocks_for_tokens(kv, bpt, self.params.block_size, 1.0)
                        .min(self.params.warmth_blocks);
                    if before.is_none() && !s.kv.is_exact() {
                        s.warmth.set_capacity(s.warmth_limit);
                    }
                }
            }
            s.bound_warmth(self.params.warmth_blocks);
            shown = restarts;
        }
        shown
    }

    /// The real work on a replica at `now`: this sidecar's requests, its
    /// peers', and what the engine's fresh figures say it runs and queues.
    fn work_on(&self, s: &ReplicaState, now: Instant) -> Work {
        let ours = s.in_flight.saturating_add(s.peer_in_flight);
        let Some(e) = self.fresh_engine(s, now) else {
            return Work {
                running: ours,
                queued: ours > 0,
            };
        };
        let engine = (e.running + e.waiting).ceil().min(f64::from(u32::MAX)) as u32;
        Work {
            running: ours.max(engine),
            queued: e.waiting > 0.0 || f64::from(ours) > e.running,
        }
    }

    /// Whether a probe of `key`, due for `reason`, may still go to the
    /// engine at `now`, as [`crate::health::ReplicaHealth::probe_due`]
    /// would have it: never behind queued work, and an idle probe only
    /// where nothing runs; a fenced replica may always be probed.
    pub fn probe_may_proceed_at(&self, key: ReplicaKey, reason: ProbeReason, now: Instant) -> bool {
        let fleet = self.lock();
        fleet
            .replicas
            .iter()
            .zip(fleet.state.iter())
            .filter(|(r, _)| r.key() == key && !r.retired)
            .all(|(_, s)| {
                let work = self.work_on(s, now);
                !s.health.is_serving()
                    || (!work.queued && (reason != ProbeReason::Idle || work.running == 0))
            })
    }

    /// Whether a real request on `key` succeeded after `since`: the proof
    /// a pending probe was sent for.
    pub fn served_since(&self, key: ReplicaKey, since: Instant) -> bool {
        let fleet = self.lock();
        fleet
            .replicas
            .iter()
            .zip(fleet.state.iter())
            .any(|(r, s)| r.key() == key && s.health.last_served().is_some_and(|t| t >= since))
    }

    /// Engine figures that are still fresh.
    pub(crate) fn fresh_engine(&self, s: &ReplicaState, now: Instant) -> Option<EngineSignals> {
        s.engine
            .filter(|e| now.duration_since(e.at) <= self.params.engine_stale)
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Fleet> {
        lock(&self.fleet)
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

    /// A finished request's outcome on replica `i` at `now` (passive
    /// health). Each data-parallel rank has its own: a stuck rank is fenced
    /// alone.
    pub fn record_request_at(&self, i: usize, outcome: Outcome, now: Instant) {
        let params = self.params.health;
        let mut fleet = self.lock();
        if fleet.replicas.get(i).is_some_and(|r| !r.retired) {
            let health = &mut fleet.state[i].health;
            let was = health.is_serving();
            health.record_request(outcome, &params, now);
            let is = health.is_serving();
            if was != is {
                fleet.peers.note_health(i, is);
            }
        }
    }

    /// The usage of an answer from replica `answered` at `now`, with the
    /// decision's prediction when there was one (see [`crate::usage`]).
    /// Counts the tokens, compares them with the prediction when the
    /// predicted replica answered, and (with `usage_feedback` on) corrects
    /// its warmth; the restart window and the shrink bound count in `now`.
    /// `None` when `answered` is no serving replica.
    pub fn record_usage_at(
        &self,
        answered: usize,
        prediction: Option<&Prediction>,
        usage: Usage,
        now: Instant,
    ) -> Option<Served> {
        let mut guard = self.lock();
        let fleet = &mut *guard;
        let replica = fleet.replicas.get(answered).filter(|r| !r.retired)?;
        let prediction = prediction.filter(|p| p.replica == answered && p.key == replica.key());
        let s = &mut fleet.state[answered];
        let (predicted_tokens, correction) = s.usage.record(
            &mut s.warmth,
            (!s.kv.is_exact()).then_some(s.warmth_limit),
            &self.params,
            prediction,
            usage,
            now,
        );
        // Which chain the engine stored for this prompt (and for others
        // it settles), where its KV events tell: only for answers the
        // prediction may be compared with (a partitioned cache stores
        // chains no one else reads).
        let matched = match prediction
            .filter(|p| p.compare)
            .zip(prediction.and_then(|p| p.tip))
        {
            Some((p, tip)) => s.kv.match_prompt(
                tip,
                p.decided_at,
                (usage.prompt_tokens, usage.cached_tokens),
                (
                    p.previous_engine_tip,
                    p.overlap == 0 && p.previous_engine_tip.is_none(),
                ),
                now,
            ),
            None => Vec::new(),
        };
        let key = replica.key();
        let mut tips = lock(&self.tips);
        // The engine's size of this prompt, for the next turn's prediction.
        if let Some(tip) = prediction.and_then(|p| p.tip) {
            tips.note_tokens(tip, key, usage.prompt_tokens);
        }
        for (tip, engine_tip) in matched {
            tips.note_engine_tip(tip, key, engine_tip);
        }
        drop(tips);
        drop(guard);
        Some(Served {
            replica: answered,
            usage,
            predicted_tokens,
            correction,
        })
    }

    /// Envoy served a routed request on replica `i`, not the one chosen (a
    /// retry on a fallback): its prompt is warm there now.
    pub fn record_served_elsewhere(&self, i: usize, hashes: &[u64]) {
        let mut fleet = self.lock();
        let fleet = &mut *fleet;
        if fleet.replicas.get(i).is_some_and(|r| !r.retired) {
            fleet.state[i].warmth.record_prompt(hashes);
        }
    }

    /// A probe's outcome on the routing target `key` at `now` (active
    /// health).
    pub fn record_probe_at(&self, key: ReplicaKey, outcome: Outcome, now: Instant) {
        let params = self.params.health;
        let mut guard = self.lock();
        let fleet = &mut *guard;
        for (i, (r, s)) in fleet
            .replicas
            .iter()
            .zip(fleet.state.iter_mut())
            .enumerate()
        {
            if r.key() == key && !r.retired {
                let was = s.health.is_serving();
                let work = self.work_on(s, now).running;
                s.health.record_probe(outcome, &params, now, work);
                let is = s.health.is_serving();
                if was != is {
                    fleet.peers.note_health(i, is);
                }
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

    /// The routing targets due for an active probe at `now` (see
    /// [`crate::health::ReplicaHealth::probe_due`]).
    pub fn probe_targets_at(&self, now: Instant) -> Vec<ProbeTarget> {
        let fleet = self.lock();
        fleet
            .serving()
            .filter_map(|(i, r)| {
                let s = &fleet.state[i];
                let reason = s
                    .health
                    .probe_due(&self.params.health, now, self.work_on(s, now))?;
                Some(ProbeTarget {
                    key: r.key(),
                    id: r.id.clone(),
                    model: r.models.first().cloned(),
                    url: r.engine_url(),
                    reason,
                })
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

    /// Each engine once, by address, with the base URL the sidecar reaches
    /// it at (probes, metrics scrapes).
    pub fn engine_urls(&self) -> Vec<(SocketAddr, String)> {
        let mut out: Vec<(SocketAddr, String)> = Vec::new();
        for (_, r) in self.lock().serving() {
            if !out.iter().any(|(a, _)| *a == r.addr) {
                out.push((r.addr, r.engine_url()));
            }
        }
        out
    }

    /// Each serving address once, in replica order: what Envoy's `engines`
    /// cluster should hold (endpoint discovery).
    pub fn endpoints(&self) -> Vec<SocketAddr> {
        self.engines().into_iter().map(|(a, _)| a).collect()
    }

    pub fn fleet_health(&self) -> FleetHealth {
        let fleet = self.lock();
        FleetHealth::of(fleet.serving().map(|(i, _)| fleet.state[i].health.state()))
    }
}

/// Where the replica list comes from (`/state`'s `upstreams.source`).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SourceStatus {
    /// `list` (`HEARTH_UPSTREAMS`), `file` (`HEARTH_UPSTREAMS_FILE`), or a
    /// Kubernetes source (`inferencepool NAMESPACE/NAME`, `pods NAMESPACE
    /// SELECTOR`).
    pub name: String,
    /// The first list has arrived: readiness waits for it.
    pub synced: bool,
    /// The source is reachable; false: the last list stays until it is.
    pub connected: bool,
    /// Why the source was lost, while it is.
    pub error: Option<String>,
    /// Times the source was lost.
    pub disconnects_total: u64,
}

impl Default for SourceStatus {
    fn default() -> Self {
        SourceStatus {
            name: "list".into(),
            synced: true,
            connected: true,
            error: None,
            disconnects_total: 0,
        }
    }
}

/// A poisoned lock still guards usable state: a panic while holding it
/// cannot leave it torn in a way that matters more than losing routing
/// altogether.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

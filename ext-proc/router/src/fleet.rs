//! The fleet state: the replica table and, per slot, what the router
//! knows of it (warmth, load, health, engine figures, resident
//! conversations), all under the router's one lock.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::health::ReplicaHealth;
use crate::kv_events::KvEvents;
use crate::peers::{canonical, Peers, PEER_MAX_IN_FLIGHT, PEER_MAX_LOAD};
use crate::replica::{ReloadSummary, Replica};
use crate::usage::UsageTally;
use crate::warmth::LruBlocks;
use hearth_wire::peer::Load;

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
    /// The engine's count of prompt tokens processed since it started:
    /// lower than the last figure, the engine restarted.
    pub prompt_tokens_total: Option<f64>,
    /// When the engine's process started (Unix seconds), when it says.
    pub started_at: Option<f64>,
    /// Tokens its KV cache holds, when it says (vLLM's cache config,
    /// SGLang's token capacity).
    pub kv_capacity_tokens: Option<f64>,
    /// Tokens per block of its prefix cache, when it says (vLLM's
    /// `block_size`): it serves cached prompts in whole blocks.
    pub cache_block_tokens: Option<f64>,
    /// The sum of the engine's work counters (steps or tokens processed,
    /// see the sidecar's scrape): it stands still only when the engine
    /// does. `None` when it exports none.
    pub progress_total: Option<f64>,
}

impl EngineSignals {
    /// A figure of the engine's queue alone: `running` and `waiting` read
    /// `at`, nothing else said (no KV use, counters or capacity).
    pub fn queue(running: f64, waiting: f64, at: Instant) -> EngineSignals {
        EngineSignals {
            waiting,
            running,
            kv_usage: None,
            at,
            own_in_flight: 0,
            prompt_tokens_total: None,
            started_at: None,
            kv_capacity_tokens: None,
            cache_block_tokens: None,
            progress_total: None,
        }
    }

    /// The engine restarted between `self` and `next`: its start time
    /// changed, or its prompt-token count went down.
    pub fn restarted_by(&self, next: &EngineSignals) -> bool {
        let moved = |a: Option<f64>, b: Option<f64>, by: f64| {
            a.zip(b).is_some_and(|(a, b)| b < a - by || b > a + by)
        };
        let fell = self
            .prompt_tokens_total
            .zip(next.prompt_tokens_total)
            .is_some_and(|(a, b)| b < a);
        fell || moved(self.started_at, next.started_at, 1.0)
    }
}

/// Conversations resident on one replica, at most: more than an engine
/// keeps (the least recent are forgotten first), so neither a flood of
/// first turns nor a peer's records grow the set without bound.
pub const MAX_RESIDENTS: usize = 65_536;

/// Conversations whose latest turn went to one replica: each by its tip
/// (the prompt's last full block), with when that turn was routed. They
/// expire in the order they came, so keeping the set to the resident
/// window costs O(1) per turn however many conversations it holds.
#[derive(Debug, Default)]
pub(crate) struct Residents {
    at: HashMap<u64, Instant>,
    /// Every insertion in time order; an entry whose time is no longer
    /// its tip's (moved away, or come back since) is skipped on expiry.
    order: VecDeque<(Instant, u64)>,
}

impl Residents {
    pub(crate) fn insert(&mut self, tip: u64, now: Instant) {
        self.at.insert(tip, now);
        self.order.push_back((now, tip));
        // At most MAX_RESIDENTS: the least recent go first.
        while self.at.len() > MAX_RESIDENTS {
            let Some((at, old)) = self.order.pop_front() else {
                break;
            };
            if self.at.get(&old) == Some(&at) {
                self.at.remove(&old);
            }
        }
        // Stale entries (conversations that moved on) beyond twice the
        // live ones: rebuild the order from the live set, so memory stays
        // proportional to the conversations held (amortized O(log n)).
        if self.order.len() > 2 * self.at.len() + 4096 {
            let mut live: Vec<(Instant, u64)> = self.at.iter().map(|(&t, &a)| (a, t)).collect();
            live.sort_unstable();
            self.order = live.into();
        }
    }

    /// The conversation left (its next turn went elsewhere).
    pub(crate) fn remove(&mut self, tip: u64) {
        self.at.remove(&tip);
    }

    /// Drops conversations whose latest turn here is `window` old or more.
    pub(crate) fn expire(&mut self, now: Instant, window: Duration) {
        while let Some(&(at, tip)) = self.order.front() {
            if now.saturating_duration_since(at) < window {
                break;
            }
            self.order.pop_front();
            if self.at.get(&tip) == Some(&at) {
                self.at.remove(&tip);
            }
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.at.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.at.is_empty()
    }

    /// The resident conversations' tips.
    pub(crate) fn tips(&self) -> impl Iterator<Item = u64> + '_ {
        self.at.keys().copied()
    }
}

/// The requests a replica's prompts drew to it lately: each request
/// routed there that was cold on every candidate (it seeds a prefix
/// there) or that it held more of than the least warm candidate did (its
/// prefix drew it there), as an exponentially decaying count with a time
/// constant of `HEARTH_RESIDENT_SECONDS`. Where prefixes are shared by
/// many requests (an app's system prompt and its users' questions), the
/// requests still to come of each prefix follow it, so this is the
/// traffic a replica will go on getting whatever load says; a prompt no
/// candidate holds weighs it ([`crate::decide::policy`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct Drawn {
    count: f64,
    at: Option<Instant>,
}

impl Drawn {
    /// The count at `now`.
    pub(crate) fn at(&self, now: Instant, window: Duration) -> f64 {
        match self.at {
            Some(at) if !window.is_zero() => {
                let age = now.saturating_duration_since(at).as_secs_f64();
                self.count * (-age / window.as_secs_f64()).exp()
            }
            _ => 0.0,
        }
    }

    /// One more request drawn at `now`.
    pub(crate) fn add(&mut self, now: Instant, window: Duration) {
        self.count = self.at(now, window) + 1.0;
        self.at = Some(now);
    }
}

/// How fast a replica's engine reads prompts, in bytes a second, learnt
/// from the time to first token of prompts it read while no other prompt
/// Hearth sent there was still unread. Such a time also counts a wait for
/// a free slot and the first decode step, so every sample is at most the
/// engine's real rate; the figure kept is the fastest seen, each new
/// sample first taking a little off it (0.5%), so a slower engine in the
/// same slot is followed within a few hundred samples. Prompts of under
/// [`PrefillRate::MIN_BYTES`] are not timed: their time is overhead.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct PrefillRate {
    bytes_per_second: Option<f64>,
    samples: u64,
}

impl PrefillRate {
    /// The smallest unread prompt whose first token times the prefill.
    pub(crate) const MIN_BYTES: u64 = 8 << 10;
    /// What each sample takes off the fastest seen before it counts.
    const DECAY: f64 = 0.995;

    pub(crate) fn observe(&mut self, bytes: u64, took: Duration) {
        let secs = took.as_secs_f64();
        if bytes < Self::MIN_BYTES || secs <= 0.0 {
            return;
        }
        let sample = bytes as f64 / secs;
        self.samples += 1;
        self.bytes_per_second = Some(match self.bytes_per_second {
            Some(fastest) => sample.max(fastest * Self::DECAY),
            None => sample,
        });
    }

    /// Bytes a second, once a prompt was timed.
    pub(crate) fn bytes_per_second(&self) -> Option<f64> {
        self.bytes_per_second
    }

    pub(crate) fn samples(&self) -> u64 {
        self.samples
    }
}

/// What the router knows of one replica slot.
pub(crate) struct ReplicaState {
    pub(crate) warmth: LruBlocks,
    pub(crate) in_flight: u32,
    pub(crate) load: f64,
    /// Uncached prompt bytes of the requests in flight here (their
    /// prefill work still to do, at most): what saturation counts.
    pub(crate) uncached_bytes: u64,
    /// How fast its engine reads a prompt, as learnt from first tokens.
    pub(crate) prefill_rate: PrefillRate,
    /// Until when the bands below a higher band about here find it
    /// saturated: the last lower band's prompt sent here paces the next
    /// ([`crate::FlowParams::lower_prefill_share`]).
    pub(crate) lower_paced_until: Option<Instant>,
    pub(crate) routed: u64,
    pub(crate) health: ReplicaHealth,
    /// The engine's own figures (for this target's share of its address).
    pub(crate) engine: Option<EngineSignals>,
    /// Conversations whose latest turn went here.
    pub(crate) resident: Residents,
    /// The requests its prompts drew here lately.
    pub(crate) drawn: Drawn,
    /// What the engine's answers said of its cache.
    pub(crate) usage: UsageTally,
    /// The largest its warmth index may grow: `HEARTH_WARMTH_BLOCKS`, or
    /// what the engine says its KV cache holds.
    pub(crate) warmth_limit: usize,
    /// What the engine says its KV cache holds, in warmth blocks (none
    /// when it does not say): an index larger than this (the floor keeps
    /// affinity beyond the engine's cache) predicts from what an LRU of
    /// this size would hold ([`crate::warmth::LruBlocks::held_within`]).
    pub(crate) engine_blocks: Option<usize>,
    /// Requests in flight here through the peer sidecars, and their load
    /// (the sum of their latest figures; see [`crate::peers`]).
    pub(crate) peer_in_flight: u32,
    pub(crate) peer_load: f64,
    /// What the engine's KV cache events said (for a replica with a feed).
    pub(crate) kv: KvEvents,
    /// How many requests the engine runs at once, as its figures showed
    /// it.
    pub(crate) batch: EngineBatch,
    /// This sidecar's requests in flight here by priority band, with each
    /// band's recent peak: the slots lower bands leave free for it.
    pub(crate) bands: BandLoads,
    /// The same by flow (band and fairness id): the slots a flow under
    /// its fair share comes back for ([`crate::Router::kept_for_flows`]).
    pub(crate) flows: FlowLoads,
    /// Each flow's place in the engine's own queue
    /// (`HEARTH_ENGINE_PRIORITY`).
    pub(crate) engine_tags: EngineTags,
}

/// The longest one engine interval is counted as, when learnt from the
/// first tokens: an idle gap is not the engine's pace.
pub const ENGINE_INTERVAL_MAX: Duration = Duration::from_secs(10);

/// The engine interval assumed before a replica's first tokens told it.
pub const ENGINE_INTERVAL_DEFAULT: Duration = Duration::from_secs(1);

/// How many engine intervals a flow's tag may run ahead of now: what a
/// burst long past still costs it is bounded.
pub const ENGINE_LEAD_MAX: u32 = 64;

/// Places in an engine's own queue, by flow: a virtual clock of the
/// requests this sidecar sends the replica. A request's tag is its flow's
/// previous tag, or now when that is past, plus one engine interval (the
/// time between two first tokens on the replica, learnt as a moving mean
/// of this sidecar's), and never more than [`ENGINE_LEAD_MAX`] intervals
/// ahead of now. An engine that lets its waiting requests out in tag order
/// (`HEARTH_ENGINE_PRIORITY` writes the tag into the body) serves each
/// flow's requests in the order they came, and a flow that sent more than
/// one request an interval after those that did not: a burst's later
/// requests carry tags further ahead, and a quiet flow's request, tagged
/// one interval from now, goes before them. At most
/// [`MAX_TRACKED_KEYS`] flows with tags ahead of now are kept; another is
/// tagged one interval from now.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct EngineTags {
    flows: Vec<((i32, u64), Instant)>,
    last_first_token: Option<Instant>,
    interval: Option<Duration>,
}

impl EngineTags {
    /// The engine interval: learnt, or the default.
    pub(crate) fn interval(&self) -> Duration {
        self.interval.unwrap_or(ENGINE_INTERVAL_DEFAULT)
    }

    /// The tag of `flow`'s next request, sent at `now`.
    pub(crate) fn next(&mut self, flow: (i32, u64), now: Instant) -> Instant {
        let step = self.interval();
        let lead = now + step * ENGINE_LEAD_MAX;
        self.flows.retain(|&(_, t)| t > now);
        match self.flows.iter_mut().find(|(f, _)| *f == flow) {
            Some((_, t)) => {
                *t = (*t).min(lead) + step;
                *t
            }
            None => {
                let t = now + step;
                if self.flows.len() < MAX_TRACKED_KEYS {
                    self.flows.push((flow, t));
                }
                t
            }
        }
    }

    /// A first token came from the replica at `now`: the engine let a
    /// request out of its queue and read it. The interval since the
    /// previous one (at most [`ENGINE_INTERVAL_MAX`]) moves the mean by an
    /// eighth.
    pub(crate) fn first_token(&mut self, now: Instant) {
        if let Some(last) = self.last_first_token {
            let gap = now.saturating_duration_since(last).min(ENGINE_INTERVAL_MAX);
            self.interval = Some(match self.interval {
                Some(mean) => (mean * 7 + gap) / 8,
                None => gap,
            });
        }
        self.last_first_token = Some(now);
    }
}

/// One key's requests in flight on one replica (a priority band's, or a
/// flow's: a band and a fairness id), and the most it had in flight
/// lately (the peak stands for the headroom window after it was last
/// reached).
#[derive(Clone, Copy, Debug, PartialEq)]
struct InFlightPeak<K> {
    key: K,
    in_flight: u32,
    peak: u32,
    peak_at: Instant,
}

impl<K> InFlightPeak<K> {
    /// Its peak at `now`, while it stands (reached within `window`).
    fn standing_peak(&self, now: Instant, window: Duration) -> Option<u32> {
        (now.saturating_duration_since(self.peak_at) <= window).then_some(self.peak)
    }

    /// Whether the key is about at `now`: requests in flight, or a
    /// standing peak.
    fn about(&self, now: Instant, window: Duration) -> bool {
        self.in_flight > 0 || self.standing_peak(now, window).is_some()
    }

    /// The slots it comes back for at `now`: its standing peak less what
    /// it has in flight.
    fn unused_peak(&self, now: Instant, window: Duration) -> u32 {
        let peak = self.standing_peak(now, window).unwrap_or(self.in_flight);
        peak.saturating_sub(self.in_flight)
    }
}

/// The most keys one replica's [`PeakLoads`] tracks. Fairness ids come
/// from clients: past this many flows about at once on one replica, a new
/// flow's requests are not tracked (it has no slots kept for it there)
/// until one goes quiet for the headroom window.
pub const MAX_TRACKED_KEYS: usize = 64;

/// Requests in flight on one replica by key, with each key's recent peak;
/// a key no longer about is dropped when a request starts.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct PeakLoads<K> {
    keys: Vec<InFlightPeak<K>>,
}

impl<K> Default for PeakLoads<K> {
    fn default() -> Self {
        PeakLoads { keys: Vec::new() }
    }
}

impl<K: Copy + PartialEq> PeakLoads<K> {
    /// A request of `key` starts here at `now` (a peak older than `window`
    /// gives way to what is in flight now; keys no longer about are
    /// forgotten). False when it is not tracked: [`MAX_TRACKED_KEYS`] other
    /// keys are about here (its end must then not be counted either).
    pub(crate) fn start(&mut self, key: K, now: Instant, window: Duration) -> bool {
        self.keys.retain(|k| k.about(now, window));
        let entry = match self.keys.iter_mut().position(|k| k.key == key) {
            Some(i) => &mut self.keys[i],
            None if self.keys.len() >= MAX_TRACKED_KEYS => return false,
            None => {
                self.keys.push(InFlightPeak {
                    key,
                    in_flight: 0,
                    peak: 0,
                    peak_at: now,
                });
                self.keys.last_mut().expect("just pushed")
            }
        };
        entry.in_flight += 1;
        let standing = entry.standing_peak(now, window).unwrap_or(0);
        if entry.in_flight >= standing {
            entry.peak = entry.in_flight;
            entry.peak_at = now;
        }
        true
    }

    /// A tracked request of `key` ended here.
    pub(crate) fn end(&mut self, key: K) {
        if let Some(k) = self.keys.iter_mut().find(|k| k.key == key) {
            k.in_flight = k.in_flight.saturating_sub(1);
        }
    }

    /// Every key about at `now`, with its requests in flight and the
    /// slots it comes back for (its standing peak less those).
    pub(crate) fn about(
        &self,
        now: Instant,
        window: Duration,
    ) -> impl Iterator<Item = (K, u32, u32)> + '_ {
        self.keys
            .iter()
            .filter(move |k| k.about(now, window))
            .map(move |k| (k.key, k.in_flight, k.unused_peak(now, window)))
    }
}

/// Requests in flight on one replica by priority band. Bands are the
/// operator's objectives (an unknown objective is band 0), so the list
/// is as short as that setting.
pub(crate) type BandLoads = PeakLoads<i32>;

/// Requests in flight on one replica by flow: a priority band and a
/// digest of a fairness id ([`crate::RequestInfo::flow`]).
pub(crate) type FlowLoads = PeakLoads<(i32, u64)>;

impl BandLoads {
    /// Each band's priority, in flight and peak within `window` at `now`
    /// (what `/state` shows), highest band first.
    pub(crate) fn view(&self, now: Instant, window: Duration) -> Vec<(i32, u32, u32)> {
        let mut v: Vec<_> = self
            .about(now, window)
            .map(|(priority, in_flight, unused)| (priority, in_flight, in_flight + unused))
            .collect();
        v.sort_by_key(|&(priority, _, _)| std::cmp::Reverse(priority));
        v
    }

    /// The slots a request of band `priority` leaves free here at `now`:
    /// for every higher band about, its standing peak less what it has in
    /// flight now, and at least one (its next request finds a slot even
    /// past its peak). Zero: no higher band is about.
    pub(crate) fn headroom_above(&self, priority: i32, now: Instant, window: Duration) -> u32 {
        self.about(now, window)
            .filter(|&(band, _, _)| band > priority)
            .map(|(_, _, unused)| unused.max(1))
            .sum()
    }
}

/// How long a learnt batch size stands without a figure that bears it
/// out: an engine's batch limit moves with its prompts' sizes (its KV
/// cache fills sooner with long ones).
pub const BATCH_MEMORY: Duration = Duration::from_secs(60);

/// How many requests an engine runs at once, learnt from its figures.
/// Requests waiting in two figures in a row show the batch full, so the
/// running count is the batch (one figure alone may have caught a request
/// that arrived between two engine steps, while slots were free); a
/// figure running more raises it at once. A lower full batch replaces a
/// higher one only once the higher has gone [`BATCH_MEMORY`] without a
/// figure that bears it out.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct EngineBatch {
    /// The batch, and when a figure last bore it out.
    learnt: Option<(f64, Instant)>,
    /// Whether requests waited at the last figure.
    waited: bool,
}

impl EngineBatch {
    /// Learns from a figure of `running` and `waiting` read `at`.
    pub(crate) fn see(&mut self, running: f64, waiting: f64, at: Instant) {
        let full = waiting > 0.0 && self.waited;
        self.waited = waiting > 0.0;
        if running <= 0.0 {
            return;
        }
        self.learnt = match self.learnt {
            Some((b, _)) if running >= b => Some((running, at)),
            Some((_, since)) if full && at.saturating_duration_since(since) > BATCH_MEMORY => {
                Some((running, at))
            }
            None if full => Some((running, at)),
            kept => kept,
        };
    }

    /// The requests the engine runs at once, when learnt.
    pub(crate) fn size(&self) -> Option<f64> {
        self.learnt.map(|(b, _)| b)
    }
}

impl ReplicaState {
    /// Keeps the warmth index within its bound. While the engine's KV
    /// events are exact they say what it evicted (the index forgets it at
    /// their horizon, see [`crate::kv_events`]), so the index is not cut
    /// to the engine's size converted into fingerprint blocks, which a
    /// bytes-per-token figure still being learnt makes too small: it may
    /// hold up to `warmth_blocks` (`HEARTH_WARMTH_BLOCKS`) or that size,
    /// whichever is larger. Otherwise at most `warmth_limit`.
    pub(crate) fn bound_warmth(&mut self, warmth_blocks: usize) {
        if self.kv.is_exact() {
            let bound = warmth_blocks.max(self.warmth_limit);
            if self.warmth.capacity() < bound {
                self.warmth.set_capacity(bound);
            }
        } else if self.warmth.capacity() > self.warmth_limit {
            self.warmth.set_capacity(self.warmth_limit);
        }
    }

    /// The engine lost its cache (it restarted): nothing is warm or
    /// resident here any more.
    pub(crate) fn forget_cache(&mut self) {
        self.warmth.clear();
        self.resident = Residents::default();
        self.drawn = Drawn::default();
    }

    pub(crate) fn new(warmth_blocks: usize) -> ReplicaState {
        ReplicaState {
            warmth: LruBlocks::new(warmth_blocks),
            in_flight: 0,
            load: 0.0,
            uncached_bytes: 0,
            prefill_rate: PrefillRate::default(),
            lower_paced_until: None,
            routed: 0,
            health: ReplicaHealth::default(),
            engine: None,
            resident: Residents::default(),
            drawn: Drawn::default(),
            usage: UsageTally::default(),
            warmth_limit: warmth_blocks,
            engine_blocks: None,
            peer_in_flight: 0,
            peer_load: 0.0,
            kv: KvEvents::default(),
            batch: EngineBatch::default(),
            bands: BandLoads::default(),
            flows: FlowLoads::default(),
            engine_tags: EngineTags::default(),
        }
    }
}

/// The replica table and each slot's state, under one lock. Slot indices
/// are stable: a removed replica's slot is retired (kept while requests it
/// runs hold reservations on it) and reused for a later new replica.
pub(crate) struct Fleet {
    pub(crate) replicas: Arc<[Replica]>,
    pub(crate) state: Vec<ReplicaState>,
    /// The serving slots, in the order the replica list names them.
    pub(crate) listed: Vec<usize>,
    /// Some serving replica is tagged `long` (else the lane is off).
    pub(crate) any_long: bool,
    /// Some serving replica has `profile=short-output`.
    pub(crate) any_short_output: bool,
    /// What is kept for, and learned from, the peer sidecars.
    pub(crate) peers: Peers,
}

impl Fleet {
    /// The serving replicas, in list order.
    pub(crate) fn serving(&self) -> impl Iterator<Item = (usize, &Replica)> {
        self.listed.iter().map(|&i| (i, &self.replicas[i]))
    }

    /// Replaces the replica list with `targets`. A target at the address
    /// and rank of a serving replica keeps that slot and its state; one
    /// no longer listed is retired; a new one takes a drained retired slot,
    /// or a new one.
    pub(crate) fn apply(&mut self, targets: Vec<Replica>, warmth_blocks: usize) -> ReloadSummary {
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
        self.reset_peers();
        summary
    }
}

impl Fleet {
    /// A fleet of `targets`.
    pub(crate) fn new(targets: Vec<Replica>, warmth_blocks: usize) -> Fleet {
        let mut fleet = Fleet {
            replicas: Arc::new([]),
            state: Vec::new(),
            listed: Vec::new(),
            any_long: false,
            any_short_output: false,
            peers: Peers::default(),
        };
        fleet.apply(targets, warmth_blocks);
        fleet
    }
}

impl Fleet {
    /// Sum of the live peers' figures into each replica's peer load.
    pub(crate) fn sum_peer_loads(&mut self, now: Instant) {
        self.peers.loads.retain(|_, l| l.is_live(now));
        for s in &mut self.state {
            s.peer_in_flight = 0;
            s.peer_load = 0.0;
        }
        for l in self.peers.loads.values() {
            for &(slot, in_flight, load) in &l.per_slot {
                if let Some(s) = self.state.get_mut(slot) {
                    // Bounded per peer (PeerLoad::bounded) and in number
                    // of peers (MAX_PEERS): the sums stay finite, and
                    // saturate whatever comes.
                    s.peer_in_flight = s.peer_in_flight.saturating_add(in_flight);
                    s.peer_load += load;
                }
            }
        }
        // All peers together claim no more than one may: a member of the
        // fleet that makes up ids gains nothing by it.
        for s in &mut self.state {
            s.peer_in_flight = s.peer_in_flight.min(PEER_MAX_IN_FLIGHT);
            s.peer_load = s.peer_load.min(PEER_MAX_LOAD);
        }
    }

    /// The list changed: peers' figures name places in the old one.
    pub(crate) fn reset_peers(&mut self) {
        let (canonical, digest) = canonical(&self.replicas, &self.listed);
        self.peers.canonical = canonical;
        self.peers.digest = digest;
        self.peers.loads.clear();
        self.peers.warmth.clear();
        self.peers.health.clear();
        for s in &mut self.state {
            s.peer_in_flight = 0;
            s.peer_load = 0.0;
        }
    }

    /// This sidecar's own load on every replica, in canonical order.
    pub(crate) fn own_load(&self) -> Vec<Load> {
        self.peers
            .canonical
            .iter()
            .enumerate()
            .filter_map(|(place, &slot)| {
                let s = &self.state[slot];
                Some(Load {
                    replica: u16::try_from(place).ok()?,
                    in_flight: s.in_flight,
                    load: s.load as f32,
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drawn_requests_fade_over_the_window() {
        let window = Duration::from_secs(100);
        let t0 = Instant::now();
        let mut d = Drawn::default();
        assert_eq!(d.at(t0, window), 0.0);
        d.add(t0, window);
        d.add(t0, window);
        assert_eq!(d.at(t0, window), 2.0);
        // One window later, e^-1 of it is left; one more adds to that.
        let later = t0 + window;
        let left = d.at(later, window);
        assert!((left - 2.0 / std::f64::consts::E).abs() < 1e-9, "{left}");
        d.add(later, window);
        assert!((d.at(later, window) - left - 1.0).abs() < 1e-9);
        // A zero window keeps nothing.
        assert_eq!(d.at(later, Duration::ZERO), 0.0);
    }

    #[test]
    fn engine_tags_keep_each_flows_order_and_put_a_burst_behind_a_quiet_flow() {
        let t0 = Instant::now();
        let ms = |n: u64| Duration::from_millis(n);
        let mut tags = EngineTags::default();
        // First tokens 500 ms apart teach the interval; an idle gap counts
        // as at most ENGINE_INTERVAL_MAX.
        assert_eq!(tags.interval(), ENGINE_INTERVAL_DEFAULT);
        tags.first_token(t0);
        tags.first_token(t0 + ms(500));
        assert_eq!(tags.interval(), ms(500));
        tags.first_token(t0 + ms(1000));
        assert_eq!(tags.interval(), ms(500));
        let mut idle = tags.clone();
        idle.first_token(t0 + Duration::from_secs(3600));
        assert_eq!(idle.interval(), (ms(500) * 7 + ENGINE_INTERVAL_MAX) / 8);

        // A burst of four from the noisy flow, one interval apart, in order.
        let now = t0 + ms(1000);
        let (noisy, quiet, other) = ((0, 1), (0, 2), (0, 3));
        let burst: Vec<Instant> = (0..4).map(|_| tags.next(noisy, now)).collect();
        assert_eq!(burst, [1, 2, 3, 4].map(|k| now + ms(500) * k));
        // The quiet flow's request, a little later, goes before all but
        // the burst's first.
        let q = tags.next(quiet, now + ms(100));
        assert!(burst[0] < q && q < burst[1], "{q:?}");
        // The noisy flow's next stays behind its burst.
        assert_eq!(tags.next(noisy, now + ms(100)), now + ms(2500));
        // Once its tags are past, a flow starts from now again.
        let later = now + Duration::from_secs(10);
        assert_eq!(tags.next(noisy, later), later + ms(500));
        // A burst's lead is bounded.
        let flood: Vec<Instant> = (0..200).map(|_| tags.next(other, later)).collect();
        let lead = later + ms(500) * (ENGINE_LEAD_MAX + 1);
        assert_eq!(*flood.last().unwrap(), lead);
        assert!(flood.windows(2).all(|w| w[0] <= w[1]));
        // At most MAX_TRACKED_KEYS flows ahead of now; another is tagged
        // one interval from now, each time.
        let mut full = EngineTags::default();
        for f in 0..MAX_TRACKED_KEYS as u64 {
            full.next((0, 100 + f), t0);
        }
        assert_eq!(full.next((0, 99), t0), t0 + ENGINE_INTERVAL_DEFAULT);
        assert_eq!(full.next((0, 99), t0), t0 + ENGINE_INTERVAL_DEFAULT);
    }

    #[test]
    fn an_engines_batch_is_learnt_from_two_full_figures_and_lowered_only_after_its_memory() {
        let t0 = Instant::now();
        let mut b = EngineBatch::default();
        b.see(8.0, 1.0, t0);
        assert_eq!(b.size(), None, "one figure with a request waiting");
        b.see(8.0, 1.0, t0);
        assert_eq!(b.size(), Some(8.0));
        // More running raises it at once, waiting or not.
        b.see(10.0, 0.0, t0);
        assert_eq!(b.size(), Some(10.0));
        // A lower full batch is taken only once the higher went unconfirmed
        // for the memory.
        let soon = t0 + BATCH_MEMORY / 2;
        b.see(6.0, 2.0, soon);
        b.see(6.0, 2.0, soon);
        assert_eq!(b.size(), Some(10.0));
        let late = t0 + BATCH_MEMORY + Duration::from_secs(1);
        b.see(6.0, 2.0, late);
        assert_eq!(b.size(), Some(6.0));
        // An idle engine's figure says nothing of its batch.
        b.see(0.0, 0.0, late);
        assert_eq!(b.size(), Some(6.0));
    }

    #[test]
    fn residents_expire_in_order_and_a_moved_or_returning_one_is_kept_right() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let w = s(120);
        let mut r = Residents::default();
        r.insert(1, t0);
        r.insert(2, t0 + s(10));
        r.insert(3, t0 + s(20));
        // 1 comes back later: its first entry is stale, not its expiry.
        r.insert(1, t0 + s(100));
        // 2 moved to another replica.
        r.remove(2);
        assert_eq!(r.len(), 2);
        r.expire(t0 + s(125), w);
        assert_eq!(r.len(), 2, "1 came back at 100 s, 3 is 105 s old");
        r.expire(t0 + s(140), w);
        assert_eq!(r.len(), 1, "3 expired");
        r.expire(t0 + s(220), w);
        assert!(r.is_empty());
        assert!(r.order.is_empty());
    }

    #[test]
    fn the_order_stays_proportional_to_the_live_conversations() {
        let t0 = Instant::now();
        let mut r = Residents::default();
        // One conversation, 10,000 turns: each turn's tip replaces the last.
        for k in 0..10_000u64 {
            if k > 0 {
                r.remove(k - 1);
            }
            r.insert(k, t0 + Duration::from_millis(k));
        }
        assert_eq!(r.len(), 1);
        assert!(r.order.len() <= 2 * r.len() + 4097, "{}", r.order.len());
        // Compaction kept the live entry expirable.
        r.expire(t0 + Duration::from_secs(200), Duration::from_secs(120));
        assert!(r.is_empty());
    }
}

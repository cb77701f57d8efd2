//! When a replica is saturated, and whether a request may leave now.
//!
//! A replica is saturated when its engine's fresh figures say so (its
//! waiting queue at `engine_waiting` or more; or its KV cache at
//! `kv_usage` or more while anything waits there) or when the uncached
//! prompt bytes in flight on it through this sidecar and its peers pass
//! `uncached_bytes` (or, when less, what the replica's engine reads in
//! `prefill_seconds` at the prefill rate learnt from its first tokens:
//! [`crate::fleet::PrefillRate`]). The engine's figures come from the metrics scrape, so
//! they lag; Hearth's own in-flight figure moves with every decision and
//! every release, and the engine's figures are carried forward by what
//! Hearth sent and saw end since they were read, against the batch the
//! engine was seen to run at once. For a request of a lower priority band
//! a replica is also saturated while its batch has no slot beyond those
//! higher bands used lately ([`Router::kept_for_higher_bands`]); with
//! `HEARTH_FLOW_FAIR_SLOTS_SECONDS`, for a request whose flow has its
//! fair share of the band's slots in flight, while it has no slot beyond
//! those its band's flows under their share came back for
//! ([`Router::kept_for_flows`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::decide::candidates;
use crate::decide::RequestInfo;
use crate::fleet::{EngineSignals, Fleet, ReplicaState};
use crate::router::Router;
use crate::warmth::LruBlocks;

/// The most affinity waits a queued request waits for its warm replica,
/// however much of its prompt a move would read again.
pub const AFFINITY_UNITS_MAX: f64 = 8.0;

/// Where a request may go now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Room {
    /// Decide among these replicas (all of them have room). `None`: no
    /// replica could take the request at all; the decision says why.
    Go(Option<Vec<usize>>),
    /// Every replica the request may use is saturated: it waits (and so
    /// does any request for the same model and replicas, until one ends).
    Full,
    /// Within the affinity wait, the replica that holds most of its
    /// prompt is saturated while others have room: it waits for that one.
    Warm,
    /// Its flow has its fair share in flight, and the replicas not
    /// saturated keep their free slots for its band's other flows: it
    /// waits (and so do its flow's later requests; other flows may go).
    Share,
}

/// A request not queued yet finds every replica it may use saturated for
/// it ([`Router::admission_at`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Saturated {
    /// Every one of them is saturated for every band alike (its engine's
    /// figures or the unread prompt in flight), whatever slots are kept
    /// for higher bands or other flows: a sheddable request is refused
    /// then, not queued.
    pub for_every_band: bool,
}

/// What the slots kept for higher bands leave a request
/// ([`Router::admission_at`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Kept {
    /// No replica it may use keeps a slot from it (or every one does, and
    /// flow control's saturation answers for it): decide as usual.
    Nothing,
    /// Some keep their slots from it and hold no more of its prompt than
    /// these, which do not: decide among these.
    Around(Vec<usize>),
    /// The replica holding most of its prompt keeps its slots from it:
    /// moving would read that prompt again elsewhere, so it waits (or, if
    /// sheddable, is refused) instead.
    Warm,
}

/// The engine's waiting queue now, from its last figure: every request
/// sent since (through this sidecar and its peers) has joined its
/// requests and every one that ended since has left them. When the
/// engine's batch is known ([`crate::fleet::EngineBatch`]), what it holds beyond
/// the batch waits. When it is not, only a figure with requests waiting
/// says the batch was full: then the requests sent since joined that
/// queue; when none waited, the engine had free slots the figure does not
/// count, so nothing is added. Without this, one look at the flow queue
/// lets every waiting request out onto a replica whose last figure was
/// under the threshold, and a replica whose last figure was over it takes
/// nothing until the next scrape, however many requests ended.
fn waiting_now(e: &EngineSignals, s: &ReplicaState) -> f64 {
    let own = s.in_flight.saturating_add(s.peer_in_flight);
    let since = f64::from(own) - f64::from(e.own_in_flight);
    match s.batch.size() {
        Some(batch) => (e.running + e.waiting + since - batch).max(0.0),
        None if e.waiting <= 0.0 => 0.0,
        None => (e.waiting + since).max(0.0),
    }
}

impl Router {
    /// Whether replica state `s` is saturated at `now`.
    pub(crate) fn saturated(&self, s: &ReplicaState, now: Instant) -> bool {
        let p = &self.params.flow;
        let engine = self.fresh_engine(s, now).is_some_and(|e| {
            let waiting = waiting_now(&e, s);
            let queue = p.engine_waiting > 0.0 && waiting >= p.engine_waiting;
            let kv =
                p.kv_usage > 0.0 && waiting > 0.0 && e.kv_usage.is_some_and(|kv| kv >= p.kv_usage);
            queue || kv
        });
        engine
            || self
                .uncached_limit(s)
                .is_some_and(|limit| self.uncached_in_flight(s) > limit)
    }

    /// Whether replica state `s` is saturated at `now` for `req`:
    /// saturated for all, or holding no slot beyond those kept for higher
    /// bands ([`Router::kept_for_higher_bands`]) or for flows under their
    /// fair share (`flows`: [`Router::kept_for_flows`]).
    fn saturated_for(
        &self,
        s: &ReplicaState,
        req: &RequestInfo,
        flows: Option<(&FlowsKept, u32)>,
        now: Instant,
    ) -> bool {
        self.saturated(s, now) || self.keeps_from(s, req, flows, now)
    }

    /// Whether replica state `s` keeps its free slots at `now` from `req`:
    /// for higher bands, or for flows of its band under their fair share
    /// (`flows`: the band's shares, and the slots kept for them here).
    fn keeps_from(
        &self,
        s: &ReplicaState,
        req: &RequestInfo,
        flows: Option<(&FlowsKept, u32)>,
        now: Instant,
    ) -> bool {
        self.kept_for_higher_bands(s, req.priority, now)
            || flows.is_some_and(|(f, kept)| self.kept_for_flows(s, req, f, kept, now))
    }

    /// The engine's slots occupied on replica state `s` at `now`: its
    /// running and waiting requests carried forward by what was sent and
    /// ended since its figure (Hearth's own in flight without a fresh
    /// figure).
    fn occupied(&self, s: &ReplicaState, now: Instant) -> f64 {
        let own = f64::from(s.in_flight.saturating_add(s.peer_in_flight));
        match self.fresh_engine(s, now) {
            Some(e) => e.running + e.waiting + own - f64::from(e.own_in_flight),
            None => own,
        }
    }

    /// Whether replica state `s` keeps its free slots at `now` for bands
    /// above `priority`: each higher band's peak of this sidecar's
    /// requests in flight there within `HEARTH_FLOW_HEADROOM_SECONDS`,
    /// less what it has in flight now, is kept free of lower bands. The
    /// slots are the engine's learnt batch, less those occupied
    /// ([`Router::occupied`]). Without a learnt batch nothing is kept: an
    /// engine never seen full has slots to spare.
    pub(crate) fn kept_for_higher_bands(
        &self,
        s: &ReplicaState,
        priority: i32,
        now: Instant,
    ) -> bool {
        let window = self.params.flow.headroom;
        if window.is_zero() {
            return false;
        }
        // Zero while no higher band is about here.
        let kept = s.bands.headroom_above(priority, now, window);
        if kept == 0 {
            return false;
        }
        // The last lower band's prompt sent here still has its pace to run
        // ([`crate::FlowParams::lower_prefill_share`]).
        if s.lower_paced_until.is_some_and(|until| now < until) {
            return true;
        }
        // A lower band's prompt is read alone: not beside another unread
        // prompt Hearth sent here (an engine reads its running prompts'
        // chunks first come, first served, so a higher band's request
        // arriving then waits behind at most one).
        if self.uncached_in_flight(s) > 0 {
            return true;
        }
        s.batch
            .size()
            .is_some_and(|batch| self.occupied(s, now) + f64::from(kept) >= batch)
    }

    /// Whether replica state `s` keeps its free slots at `now` from
    /// `req`'s flow for other flows of its band (`fair`): only when
    /// `req`'s flow has its fair share in flight already (and, as `fair`
    /// exists, another flow is under its share). Then the replica is
    /// saturated for it once its engine's learnt batch is occupied
    /// ([`Router::occupied`]) but for the `kept` slots those flows came
    /// back for here ([`FlowsKept::reckon`]): a flow past its share never
    /// joins the engine's own queue, where it would be ahead of the next
    /// request of a flow under it. A flow within its share takes any free
    /// slot, so every flow gets its share while the others use theirs,
    /// and what a quiet flow leaves unused for a whole window is anyone's.
    pub(crate) fn kept_for_flows(
        &self,
        s: &ReplicaState,
        req: &RequestInfo,
        fair: &FlowsKept,
        kept: u32,
        now: Instant,
    ) -> bool {
        fair.lacks(req.flow) <= 0.0
            && s.batch
                .size()
                .is_some_and(|batch| self.occupied(s, now) + f64::from(kept) >= batch)
    }

    /// The fair share of band `band` on `candidates` at `now`
    /// (`HEARTH_FLOW_FAIR_SLOTS_SECONDS`): the engines' learnt batches over
    /// the band's flows about there; and the slots each candidate keeps
    /// for the flows under it. `None` when off, when no batch is learnt,
    /// when fewer than two of the band's flows are about there, or when
    /// none is under its share (nothing is kept for any). A flow not about
    /// there has nothing in flight, so it is under the share whatever the
    /// share is: whichever request asks, the answer is the same.
    fn flows_kept(
        &self,
        fleet: &Fleet,
        candidates: &[usize],
        band: i32,
        now: Instant,
    ) -> Option<FlowsKept> {
        let window = self.params.flow.fair_window;
        if window.is_zero() {
            return None;
        }
        let mut slots = 0.0;
        let mut in_flight: HashMap<u64, u32> = HashMap::new();
        for &i in candidates {
            let s = &fleet.state[i];
            slots += s.batch.size().unwrap_or(0.0);
            for ((b, flow), n, _) in s.flows.about(now, window) {
                if b == band {
                    *in_flight.entry(flow).or_default() += n;
                }
            }
        }
        if slots <= 0.0 || in_flight.len() < 2 {
            return None;
        }
        let share = slots / in_flight.len() as f64;
        if !in_flight.values().any(|&n| f64::from(n) < share) {
            return None;
        }
        let mut fair = FlowsKept {
            share,
            in_flight,
            kept: Vec::new(),
        };
        fair.kept = candidates
            .iter()
            .map(|&i| fair.reckon(&fleet.state[i], band, now, window))
            .collect();
        Some(fair)
    }

    /// For a request not queued yet, at `now`: [`Saturated`] when every
    /// replica it may use (`allowed`) is saturated for it (as
    /// [`Router::saturated_for_at`] says), else what the slots kept for
    /// bands above its own leave it. One look at the fleet serves both.
    pub fn admission_at(
        self: &Arc<Self>,
        req: &RequestInfo,
        allowed: Option<&[usize]>,
        now: Instant,
    ) -> Result<Kept, Saturated> {
        let fleet = self.lock();
        // No candidate at all: the decision says why.
        let Ok(admitted) = candidates::admit(self, &fleet, req, allowed, now) else {
            return Ok(Kept::Nothing);
        };
        let candidates = &admitted.candidates;
        let fair = self.flows_kept(&fleet, candidates, req.priority, now);
        let flows = |n: usize| fair.as_ref().map(|f| (f, f.kept[n]));
        if candidates
            .iter()
            .enumerate()
            .all(|(n, &i)| self.saturated_for(&fleet.state[i], req, flows(n), now))
        {
            let for_every_band = candidates
                .iter()
                .all(|&i| self.saturated(&fleet.state[i], now));
            return Err(Saturated { for_every_band });
        }
        let (mut kept, mut open) = (Vec::new(), Vec::new());
        for (n, &i) in candidates.iter().enumerate() {
            if self.keeps_from(&fleet.state[i], req, flows(n), now) {
                kept.push(i);
            } else {
                open.push(i);
            }
        }
        if kept.is_empty() || open.is_empty() {
            return Ok(Kept::Nothing);
        }
        if !req.hashes.is_empty() && warmest(&fleet, &kept, req) > warmest(&fleet, &open, req) {
            return Ok(Kept::Warm);
        }
        Ok(Kept::Around(open))
    }

    /// The uncached prompt bytes in flight beyond which replica state `s`
    /// is saturated: `uncached_bytes`, or what its engine reads in
    /// `prefill_seconds` at its learnt rate when that is less (`None`:
    /// no limit).
    pub(crate) fn uncached_limit(&self, s: &ReplicaState) -> Option<u64> {
        let p = &self.params.flow;
        let set = (p.uncached_bytes > 0).then_some(p.uncached_bytes);
        let learnt = s
            .prefill_rate
            .bytes_per_second()
            .filter(|_| p.prefill_seconds > 0.0)
            .map(|rate| (rate * p.prefill_seconds) as u64);
        match (set, learnt) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Uncached prompt bytes in flight on a replica: this sidecar's own,
    /// and its peers' (their load beyond one unit a request).
    pub(crate) fn uncached_in_flight(&self, s: &ReplicaState) -> u64 {
        let peers = (s.peer_load - f64::from(s.peer_in_flight)).max(0.0)
            * self.params.load_unit_bytes as f64;
        s.uncached_bytes.saturating_add(peers as u64)
    }

    /// Where `req` may go at `now`, having waited `waited` for its warm
    /// replica while others had room (the queue counts it from the first
    /// look that answered [`Room::Warm`]; a request not queued yet has
    /// waited nothing): [`Room::Full`] when every replica it may use
    /// (`allowed`, the subset hint, when given) is saturated; within the
    /// affinity wait (longer for a move that reads more again:
    /// `affinity_bound`), [`Room::Warm`] when the replica
    /// holding most of its prompt is saturated and no free one holds as
    /// much.
    pub fn room_at(
        self: &Arc<Self>,
        req: &RequestInfo,
        allowed: Option<&[usize]>,
        waited: Duration,
        now: Instant,
    ) -> Room {
        self.room_in(&mut Look::default(), req, allowed, waited, now)
    }

    /// [`Router::room_at`] within one look at a queue (`look`): each band's
    /// fair share on each set of candidates is reckoned at its first
    /// question and reused by the look's later ones.
    pub fn room_in(
        self: &Arc<Self>,
        look: &mut Look,
        req: &RequestInfo,
        allowed: Option<&[usize]>,
        waited: Duration,
        now: Instant,
    ) -> Room {
        let fleet = self.lock();
        let Ok(admitted) = candidates::admit(self, &fleet, req, allowed, now) else {
            return Room::Go(None);
        };
        let candidates = admitted.candidates;
        let fair = look
            .fair
            .entry((req.priority, candidates.clone()))
            .or_insert_with(|| {
                self.flows_kept(&fleet, &candidates, req.priority, now)
                    .map(Arc::new)
            })
            .clone();
        // Saturated for every flow of its band, or kept for its band's
        // other flows only.
        let (mut full, mut kept, mut free) = (Vec::new(), false, Vec::new());
        for (n, &i) in candidates.iter().enumerate() {
            let s = &fleet.state[i];
            if self.saturated(s, now) || self.kept_for_higher_bands(s, req.priority, now) {
                full.push(i);
            } else if fair
                .as_deref()
                .is_some_and(|f| self.kept_for_flows(s, req, f, f.kept[n], now))
            {
                full.push(i);
                kept = true;
            } else {
                free.push(i);
            }
        }
        if free.is_empty() {
            return if kept { Room::Share } else { Room::Full };
        }
        if !full.is_empty() && !req.hashes.is_empty() {
            let (warm, cold) = (warmest(&fleet, &full, req), warmest(&fleet, &free, req));
            if warm > cold && waited < self.affinity_bound(warm - cold) {
                return Room::Warm;
            }
        }
        Room::Go(Some(free))
    }

    /// How long a queued request waits for its warm replica when a free
    /// one would read `blocks` more of its prompt: the affinity wait for
    /// each load unit of them (`HEARTH_LOAD_UNIT_BYTES`, the bytes the
    /// decision weighs as one request's load), at least one and at most
    /// [`AFFINITY_UNITS_MAX`].
    fn affinity_bound(&self, blocks: usize) -> Duration {
        let bytes = blocks as f64 * self.params.block_size as f64;
        let units = bytes / self.params.load_unit_bytes.max(1) as f64;
        self.params
            .flow
            .affinity_wait
            .mul_f64(units.clamp(1.0, AFFINITY_UNITS_MAX))
    }

    /// [`Router::room_at`] for a request that has not waited: whether the
    /// fleet is saturated for it.
    pub fn saturated_for_at(
        self: &Arc<Self>,
        req: &RequestInfo,
        allowed: Option<&[usize]>,
        now: Instant,
    ) -> bool {
        matches!(
            self.room_at(req, allowed, Duration::MAX, now),
            Room::Full | Room::Share
        )
    }
}

/// One band's fair share of the slots of some replicas at one moment, and
/// what each of them keeps for the band's flows under it
/// ([`Router::kept_for_flows`]).
#[derive(Debug)]
pub(crate) struct FlowsKept {
    /// Slots a flow: the engines' learnt batches over the band's flows.
    share: f64,
    /// Each of the band's flows about there, with its requests in flight.
    in_flight: HashMap<u64, u32>,
    /// Slots kept for the flows under their share, by candidate (in the
    /// order of the candidates it was reckoned for).
    kept: Vec<u32>,
}

impl FlowsKept {
    /// What `flow` lacks of its share (its share when it is not about).
    fn lacks(&self, flow: u64) -> f64 {
        self.share - f64::from(self.in_flight.get(&flow).copied().unwrap_or(0))
    }

    /// The slots replica state `s` keeps for band `band`'s flows under
    /// their share: each one's peak there within `window` less what it
    /// has in flight, at most what it lacks of its share. A flow past its
    /// share counts nothing, so the figure is the same whichever flow of
    /// the band asks.
    fn reckon(&self, s: &ReplicaState, band: i32, now: Instant, window: Duration) -> u32 {
        s.flows
            .about(now, window)
            .filter(|&((b, _), _, _)| b == band)
            .map(|((_, flow), _, unused)| {
                let lacks = self.lacks(flow);
                if lacks > 0.0 {
                    unused.min(lacks.ceil() as u32)
                } else {
                    0
                }
            })
            .sum()
    }
}

/// What one look at a queue reckoned once for all its questions
/// ([`Router::room_in`]): each band's fair share and kept slots, by set of
/// candidate replicas. A look lets requests out one at a time; after each
/// one leaves, [`Look::changed`] forgets it all (that request's flow now
/// has one more in flight).
#[derive(Debug, Default)]
pub struct Look {
    fair: HashMap<(i32, Vec<usize>), Option<Arc<FlowsKept>>>,
}

impl Look {
    /// The fleet changed (a request left the queue): reckon again.
    pub fn changed(&mut self) {
        self.fair.clear();
    }
}

/// The most leading blocks of `req`'s prompt any replica of `set` holds.
fn warmest(fleet: &Fleet, set: &[usize], req: &RequestInfo) -> usize {
    let sets: Vec<&LruBlocks> = set.iter().map(|&i| &fleet.state[i].warmth).collect();
    LruBlocks::leading_overlaps(&sets, &req.hashes)
        .into_iter()
        .max()
        .unwrap_or(0)
}

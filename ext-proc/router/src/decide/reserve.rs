//! Phase 5: reserve load on the chosen replica for the request's whole
//! life, and record the prompt as warm there (so concurrent requests with
//! the same new prefix follow it) and the conversation as resident.
//!
//! A request weighs one load unit, plus one per `load_unit_bytes` of its
//! prompt the replica must still read, until that reading is done: when
//! the answer's first token is out ([`Prefill::done`]), only the unit
//! stays, to the request's end.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::overlap::Warmth;
use super::pick::Picked;
use super::request::RequestInfo;
use crate::fleet::Fleet;
use crate::router::{lock, Router};
use crate::tips::Tips;

/// Load held on a replica for a request's whole life; released on drop, so
/// every way a stream can end (completion, client abort, upstream reset,
/// timeout, gRPC error) gives the load back.
pub struct Reservation {
    /// The router and replica the load is held on, and the part of it that
    /// weighs only while the prompt is read.
    prefill: Prefill,
    /// Prompt bytes the chosen replica does not hold: its prefill work.
    pub(crate) uncached_bytes: u64,
    /// The prompt's last full block, left as its conversation's tip.
    pub(crate) tip: Option<u64>,
    /// The request's priority band (counted in the replica's band loads).
    priority: i32,
    /// Its flow (band and fairness digest), when the replica's flow loads
    /// track it.
    flow: Option<(i32, u64)>,
    /// Its place in the engine's own queue ([`crate::fleet::EngineTags`]),
    /// while the router keeps tags.
    engine_tag: Option<Instant>,
}

/// The load of a request's unread prompt: its uncached bytes and the load
/// units they weigh, given back once, by whichever comes first of the
/// answer's first token and the request's end.
#[derive(Debug)]
struct PrefillLoad {
    units: f64,
    bytes: u64,
    released: AtomicBool,
    /// When the request was sent, and whether the replica had no other
    /// unread prompt from Hearth then: its first token then times its own
    /// prefill ([`crate::fleet::PrefillRate`]).
    sent: Instant,
    alone: bool,
}

impl PrefillLoad {
    /// Takes this load off `r` unless it was already taken (then false);
    /// under the fleet lock.
    fn release(&self, r: &mut crate::fleet::ReplicaState) -> bool {
        if self.released.swap(true, Ordering::AcqRel) {
            return false;
        }
        r.load -= self.units;
        r.uncached_bytes = r.uncached_bytes.saturating_sub(self.bytes);
        true
    }
}

/// A handle on a request's prefill load, for whatever sees its answer's
/// first token (the ext_proc stream, or the outcome filter's report by
/// ticket). Cloning it is cheap; [`Prefill::done`] acts once.
#[derive(Clone)]
pub struct Prefill {
    router: Arc<Router>,
    replica: usize,
    load: Arc<PrefillLoad>,
}

impl std::fmt::Debug for Prefill {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prefill")
            .field("replica", &self.replica)
            .field("load", &self.load)
            .finish()
    }
}

impl Prefill {
    /// The chosen replica has read the prompt (the answer's first token is
    /// out at `now`): the load its unread bytes weighed is given back, and
    /// the request weighs one unit until it ends. A prompt read alone
    /// times the replica's prefill rate. Later calls do nothing.
    pub fn done_at(&self, now: Instant) {
        if self.load.released.load(Ordering::Acquire) {
            return;
        }
        let mut fleet = self.router.lock();
        if let Some(r) = fleet.state.get_mut(self.replica) {
            if self.router.params.flow.engine_tags {
                r.engine_tags.first_token(now);
            }
            if self.load.release(r) && self.load.alone {
                let took = now.saturating_duration_since(self.load.sent);
                r.prefill_rate.observe(self.load.bytes, took);
            }
            r.load = r.load.max(0.0);
        }
        drop(fleet);
        self.router.released();
    }
}

impl std::fmt::Debug for Reservation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reservation")
            .field("prefill", &self.prefill)
            .finish()
    }
}

impl Reservation {
    pub(crate) fn router(&self) -> &Arc<Router> {
        &self.prefill.router
    }

    /// The request's place in its engine's own queue: its tag on the
    /// virtual clock of its replica's flows ([`crate::fleet::EngineTags`]);
    /// `None` unless the router keeps tags (`FlowParams::engine_tags`).
    pub fn engine_tag(&self) -> Option<Instant> {
        self.engine_tag
    }

    /// The handle that gives back the prompt's reading load (clone it to
    /// keep it past the reservation's owner).
    pub fn prefill(&self) -> &Prefill {
        &self.prefill
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let Prefill {
            router,
            replica,
            load,
        } = &self.prefill;
        let mut fleet = router.lock();
        let r = &mut fleet.state[*replica];
        r.in_flight = r.in_flight.saturating_sub(1);
        r.bands.end(self.priority);
        if let Some(flow) = self.flow {
            r.flows.end(flow);
        }
        r.load -= 1.0;
        // (A prompt never read times nothing.)
        load.release(r);
        // Sums of floats drift; an idle replica carries exactly no load.
        r.load = if r.in_flight == 0 {
            0.0
        } else {
            r.load.max(0.0)
        };
        drop(fleet);
        if let Some(tip) = self.tip {
            lock(&router.tips).answered(tip);
        }
        // Room may have opened: whoever waits for it hears of it.
        router.released();
    }
}

/// A request of band `priority` with `uncached` bytes to read sent to
/// replica state `r` at `now`, below a higher band about there: the lower
/// bands find the replica saturated for its prefill time (at the learnt
/// rate) over their share of it ([`crate::FlowParams::lower_prefill_share`]),
/// counted from now. Nothing is paced until a rate is learnt, nor while
/// no higher band is about, nor with no headroom kept for higher bands
/// (`HEARTH_FLOW_HEADROOM_SECONDS=0`: the pace would never be looked at).
fn pace_lower_bands(
    r: &mut crate::fleet::ReplicaState,
    priority: i32,
    uncached: u64,
    flow: &crate::FlowParams,
    now: Instant,
) {
    let share = flow.lower_prefill_share;
    if !(share > 0.0 && share < 1.0) || uncached == 0 || flow.headroom.is_zero() {
        return;
    }
    if r.bands.headroom_above(priority, now, flow.headroom) == 0 {
        return;
    }
    let Some(rate) = r.prefill_rate.bytes_per_second().filter(|&b| b > 0.0) else {
        return;
    };
    let paced = (uncached as f64 / rate / share).min(MAX_PACE.as_secs_f64());
    let until = now + Duration::from_secs_f64(paced);
    r.lower_paced_until = Some(r.lower_paced_until.map_or(until, |t| t.max(until)));
}

/// The longest one lower band's prompt keeps a replica from the lower
/// bands: a pace past ten minutes comes of a rate learnt wrong, not of a
/// prompt.
const MAX_PACE: Duration = Duration::from_secs(600);

/// Reserves the chosen replica: load weighted by the prompt bytes it must
/// still read, the prompt's blocks as warmth, its last full block as the
/// conversation's tip, resident there (and no longer where its previous
/// turn went).
pub(crate) fn reserve(
    router: &Arc<Router>,
    fleet: &mut Fleet,
    tips: &mut Tips,
    req: &RequestInfo,
    warm: &Warmth,
    picked: &Picked,
    now: Instant,
) -> Reservation {
    let p = &router.params;
    let chosen = picked.order[0];
    let cached_bytes = u64::from(picked.overlap) * p.block_size as u64;
    let uncached = req.prompt_bytes.saturating_sub(cached_bytes);
    let prefill_units = p.load_units(uncached);
    // Whether its first token will time this prompt's prefill alone.
    let alone = router.uncached_in_flight(&fleet.state[chosen]) == 0;
    let r = &mut fleet.state[chosen];
    pace_lower_bands(r, req.priority, uncached, &p.flow, now);
    r.in_flight += 1;
    r.bands.start(req.priority, now, p.flow.headroom);
    let flow = (req.priority, req.flow);
    let engine_tag = p.flow.engine_tags.then(|| r.engine_tags.next(flow, now));
    let flow = r.flows.start(flow, now, p.flow.fair_window).then_some(flow);
    r.load += 1.0 + prefill_units;
    r.uncached_bytes = r.uncached_bytes.saturating_add(uncached);
    r.routed += 1;
    r.warmth.record_prompt(&req.hashes);
    // The prompt's last full block (a trailing partial block changes as
    // the conversation grows, so the next turn never matches it).
    let full = if req.prompt_bytes == 0 {
        req.hashes.len()
    } else {
        req.hashes
            .len()
            .min((req.prompt_bytes / p.block_size as u64) as usize)
    };
    let tip = full.checked_sub(1).and_then(|k| req.hashes.get(k)).copied();
    fleet.peers.note_decision(chosen, &req.hashes, tip);
    let state = &mut fleet.state;
    if let Some(tip) = tip {
        tips.record(
            tip,
            fleet.replicas[chosen].key(),
            req.prompt_bytes,
            warm.continued.as_ref(),
            true,
        );
        if let Some(previous) = warm.continued {
            for s in state.iter_mut() {
                s.resident.remove(previous.tip);
            }
        }
        let r = &mut state[chosen];
        r.resident.insert(tip, now);
        // Expired conversations leave as new ones come (O(1) per turn).
        r.resident.expire(now, p.resident_window);
    }
    Reservation {
        prefill: Prefill {
            router: Arc::clone(router),
            replica: chosen,
            load: Arc::new(PrefillLoad {
                units: prefill_units,
                bytes: uncached,
                released: AtomicBool::new(false),
                sent: now,
                alone,
            }),
        },
        uncached_bytes: uncached,
        tip,
        priority: req.priority,
        flow,
        engine_tag,
    }
}

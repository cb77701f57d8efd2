//! The routing decision, as a pipeline of phases over the fleet state:
//!
//! 1. [`candidates`]: replicas that serve the model, are in the subset the
//!    caller allows, are healthy, fit the long-prompt lane, and have room;
//! 2. [`overlap`]: how much of the prompt each one holds (warmth), and
//!    whether the prompt continues an earlier one;
//! 3. [`policy`]: each candidate's credit and load, and its score;
//! 4. [`pick`]: the ranking, the output-profile tie-break and the
//!    round-robin turn among ties; the chosen replica and its fallbacks;
//! 5. [`reserve`]: load reserved on the chosen replica for the request's
//!    life (released when the [`Decision`] is dropped), and the prompt
//!    recorded as warm there.
//!
//! All phases run under the router's one lock; a decision takes a few
//! microseconds.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::replica::Replica;
use crate::router::lock;
use crate::router::Router;
use crate::tips::Continuation;
use crate::usage::{Prediction, Served, Usage};

pub mod candidates;
pub mod overlap;
pub mod pick;
pub mod policy;
pub mod request;
pub mod reserve;
#[cfg(feature = "simulation")]
mod simulation;

pub use request::{RequestInfo, RouteError};
pub use reserve::{Prefill, Reservation};

/// A routing decision. Dropping it releases the load it reserved.
#[derive(Debug)]
pub struct Decision {
    /// Chosen replica first, then fallbacks for retries.
    pub order: Vec<usize>,
    /// Leading blocks the chosen replica already held.
    pub overlap: u32,
    /// The earlier turn the prompt extends (else it was scored as a first
    /// turn, under `HEARTH_FIRST_TURN_CAP`): its tip, its conversation and
    /// the replica it went to (see [`crate::tips`]).
    pub continuation: Option<Continuation>,
    /// Every candidate as it was scored, in replica order (for the
    /// decision journal and metrics; built from numbers the decision
    /// computed anyway).
    pub candidates: Vec<ScoredCandidate>,
    /// The replica table the indices above refer to (a reload may reuse a
    /// retired slot later; this table is the one the decision saw).
    pub replicas: Arc<[Replica]>,
    /// What the chosen replica should serve from cache, for comparison
    /// with the answer's usage.
    pub prediction: Prediction,
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

    /// The prompt extends an earlier one.
    pub fn continues(&self) -> bool {
        self.continuation.is_some()
    }

    /// The prompt's last full block: the tip the next turn of its
    /// conversation will pass (None for an unhashed or sub-block prompt).
    pub fn tip(&self) -> Option<u64> {
        self.reservation.tip
    }

    /// Prompt bytes the chosen replica does not hold (its prefill work):
    /// what its load was weighted by, and what the first-byte deadline
    /// allows for.
    pub fn uncached_bytes(&self) -> u64 {
        self.reservation.uncached_bytes
    }

    /// Whether the router gains from hearing of the answer's first token:
    /// the prompt has enough left to read that its reading load, or its
    /// time (the replica's prefill rate learns from reads of at least
    /// 8 KiB), is worth giving back early, or the engine's queue order is
    /// kept (its virtual clock moves on first tokens). Below that, the load
    /// is given back when the answer ends.
    pub fn first_token_matters(&self) -> bool {
        self.reservation.uncached_bytes >= crate::fleet::PrefillRate::MIN_BYTES
            || self.reservation.engine_tag().is_some()
    }

    /// The handle that gives back the load of the prompt's unread bytes
    /// when the answer's first token is out ([`Prefill::done`]).
    pub fn prefill(&self) -> &Prefill {
        self.reservation.prefill()
    }

    /// The answer's usage at `now`, from the chosen replica (see
    /// [`Router::record_usage_at`]).
    pub fn record_usage_at(&self, usage: Usage, now: Instant) -> Option<Served> {
        self.reservation.router().record_usage_at(
            self.primary(),
            Some(&self.prediction),
            usage,
            now,
        )
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

impl Router {
    /// Chooses a replica for `req` at `now` and reserves load on it.
    /// `now` is the decision's only clock: resident conversations expire,
    /// and engine figures go stale, against it.
    pub fn decide_at(
        self: &Arc<Self>,
        req: &RequestInfo,
        now: Instant,
    ) -> Result<Decision, RouteError> {
        self.decide_within_at(req, None, now)
    }

    /// As [`Router::decide_at`], but only among the replicas in `allowed`
    /// when given (the Gateway API Inference Extension's subset hint).
    pub fn decide_within_at(
        self: &Arc<Self>,
        req: &RequestInfo,
        allowed: Option<&[usize]>,
        now: Instant,
    ) -> Result<Decision, RouteError> {
        self.decide_with(req, allowed, None, now)
    }

    /// The pipeline, with the overlaps `known` instead of the warmth
    /// index's when given (the simulator's yardstick only).
    pub(crate) fn decide_with(
        self: &Arc<Self>,
        req: &RequestInfo,
        allowed: Option<&[usize]>,
        known: Option<&[usize]>,
        now: Instant,
    ) -> Result<Decision, RouteError> {
        self.decisions.fetch_add(1, Ordering::Relaxed);
        if !req.hashes.is_empty() {
            self.hashed.fetch_add(1, Ordering::Relaxed);
        }
        let mut guard = self.lock();
        let fleet = &mut *guard;
        let admitted = candidates::admit(self, fleet, req, allowed, now).inspect_err(|_| {
            self.rejected.fetch_add(1, Ordering::Relaxed);
        })?;
        let mut tips = lock(&self.tips);
        tips.settle(now, self.params.sequel_horizon);
        let warm = overlap::measure(self, fleet, &tips, req, admitted, known);
        let scored = policy::score(self, fleet, &warm, req.hashes.len(), now);
        let picked = pick::pick(self, fleet, req, &warm, &scored);
        let chosen = picked.order[0];
        // A prompt cold everywhere seeds its prefix on the chosen replica;
        // one it held more of than another candidate was drawn there.
        let least = warm.overlaps.iter().copied().min().unwrap_or(0);
        let drawn = picked.overlap as usize > least || warm.is_cold();
        if drawn && !req.hashes.is_empty() {
            fleet.state[chosen]
                .drawn
                .add(now, self.params.resident_window);
        }
        // What the chosen replica's engine still holds of the prompt: the
        // index may outlive the engine's cache (its floor), and then an
        // LRU of the engine's size tells what is left.
        let state = &mut fleet.state[chosen];
        // (Not while its KV events are exact: the index already forgets
        // what the engine's own turnover evicted, by its own count.)
        let room = state
            .engine_blocks
            .filter(|_| !state.kv.is_exact())
            .map(|b| state.usage.engine_room(b))
            .filter(|&room| room < state.warmth.capacity());
        let held = match room {
            Some(room) => state
                .warmth
                .held_within(&req.hashes, picked.overlap as usize, room),
            None => picked.overlap as usize,
        };
        // When the chosen replica last used the deepest block it holds of
        // this prompt: how deep that block sat, should the engine not
        // have it (see `usage`).
        let stamp = held
            .checked_sub(1)
            .and_then(|k| req.hashes.get(k))
            .and_then(|&h| fleet.state[chosen].warmth.stamp(h));
        // The turn it continues on the chosen replica (the previous one,
        // or, for a conversation that comes back, its last turn there),
        // and what the engine itself still holds of that turn's chain when
        // its KV events showed which chain that was (exact where the warmth
        // index and the horizon only approximate it).
        let key = fleet.replicas[chosen].key();
        let exact = fleet.state[chosen].kv.is_exact();
        let here = warm.continued.filter(|c| c.from == key).or_else(|| {
            // (Only an engine whose events are followed has matched turns.)
            let warm_here = &req.hashes[..(picked.overlap as usize).min(req.hashes.len())];
            exact.then(|| tips.matched_on(warm_here, key)).flatten()
        });
        let previous_engine_tip = here.and_then(|c| c.engine_tip);
        let resident = previous_engine_tip.and_then(|t| fleet.state[chosen].kv.resident_tokens(t));
        // Nothing of it there: what such prompts found there lately (a
        // shared system prompt under one fingerprint block).
        let cold_root = (picked.overlap == 0 && previous_engine_tip.is_none())
            .then(|| fleet.state[chosen].kv.cold_root_tokens())
            .flatten();
        let reservation = reserve::reserve(self, fleet, &mut tips, req, &warm, &picked, now);
        drop(tips);
        let replicas = Arc::clone(&fleet.replicas);
        drop(guard);

        let candidates = warm
            .candidates
            .iter()
            .zip(&scored.candidates)
            .zip(scored.credits.iter().zip(&scored.scores))
            .map(|((&replica, c), (&credit, &score))| ScoredCandidate {
                replica,
                overlap: c.overlap,
                credit,
                load: c.load,
                score,
            })
            .collect();
        // What the chosen replica holds: its blocks, or all of the previous
        // turn's prompt when it served that turn (engines keep the partial
        // last block a fingerprint cannot name).
        let block_bytes = held as u64 * self.params.block_size as u64;
        let previous = warm.continued.filter(|c| c.from == key && c.depth <= held);
        let (held_bytes, held_tokens) = match (here, resident) {
            // The engine's own figure (the previous answer's blocks too).
            (Some(c), Some(tokens)) => {
                let bytes = match c.prompt_tokens {
                    Some(t) if t > 0 => c.prompt_bytes.saturating_mul(tokens) / t,
                    _ => block_bytes,
                };
                (bytes, Some(tokens))
            }
            _ => match previous {
                Some(c) if c.prompt_bytes > block_bytes => (c.prompt_bytes, c.prompt_tokens),
                _ => (block_bytes, cold_root),
            },
        };
        let prediction = Prediction {
            replica: chosen,
            key,
            blocks: held as u32,
            overlap: picked.overlap,
            mirrored: room.is_some(),
            held_bytes: held_bytes.min(req.prompt_bytes.max(block_bytes)),
            held_tokens,
            tip: reservation.tip,
            prompt_bytes: req.prompt_bytes,
            conversation: warm.continued.map(|c| c.conversation),
            compare: !req.hashes.is_empty() && req.cache == hearth_wire::CacheUse::Shared,
            stamp,
            decided_at: now,
            previous_engine_tip,
        };
        Ok(Decision {
            order: picked.order,
            overlap: picked.overlap,
            continuation: warm.continued,
            candidates,
            replicas,
            prediction,
            reservation,
        })
    }
}

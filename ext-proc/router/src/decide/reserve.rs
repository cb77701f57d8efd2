//! Phase 5: reserve load on the chosen replica for the request's whole
//! life, and record the prompt as warm there (so concurrent requests with
//! the same new prefix follow it) and the conversation as resident.

use std::sync::Arc;
use std::time::Instant;

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
    router: Arc<Router>,
    replica: usize,
    weight: f64,
    /// Prompt bytes the chosen replica does not hold: its prefill work.
    pub(crate) uncached_bytes: u64,
    /// The prompt's last full block, left as its conversation's tip.
    pub(crate) tip: Option<u64>,
}

impl std::fmt::Debug for Reservation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reservation")
            .field("replica", &self.replica)
            .field("weight", &self.weight)
            .finish()
    }
}

impl Reservation {
    pub(crate) fn router(&self) -> &Arc<Router> {
        &self.router
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut fleet = self.router.lock();
        let r = &mut fleet.state[self.replica];
        r.in_flight = r.in_flight.saturating_sub(1);
        r.load -= self.weight;
        r.uncached_bytes = r.uncached_bytes.saturating_sub(self.uncached_bytes);
        // Sums of floats drift; an idle replica carries exactly no load.
        r.load = if r.in_flight == 0 {
            0.0
        } else {
            r.load.max(0.0)
        };
        drop(fleet);
        if let Some(tip) = self.tip {
            lock(&self.router.tips).answered(tip);
        }
        // Room may have opened: whoever waits for it hears of it.
        self.router.released();
    }
}

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
    let weight = 1.0 + uncached as f64 / p.load_unit_bytes as f64;
    let r = &mut fleet.state[chosen];
    r.in_flight += 1;
    r.load += weight;
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
        router: Arc::clone(router),
        replica: chosen,
        weight,
        uncached_bytes: uncached,
        tip,
    }
}

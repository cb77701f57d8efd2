//! Phase 1: the replicas that may take the request: they serve its model,
//! are in the subset the caller allows, are healthy, fit the long-prompt
//! lane, and are under the in-flight and engine-queue limits.

use std::time::Instant;

use super::request::{RequestInfo, RouteError};
use crate::fleet::Fleet;
use crate::params::LongLane;
use crate::router::Router;

/// The candidates, in replica-list order.
pub(crate) struct Admitted {
    pub candidates: Vec<usize>,
    /// The prompt is long and some replica is tagged `long`: only `long`
    /// replicas are candidates.
    pub long_request: bool,
}

pub(crate) fn admit(
    router: &Router,
    fleet: &Fleet,
    req: &RequestInfo,
    allowed: Option<&[usize]>,
    now: Instant,
) -> Result<Admitted, RouteError> {
    let p = &router.params;
    let replicas = &fleet.replicas;
    let state = &fleet.state;
    let model = || req.model.clone().unwrap_or_default();
    let serving: Vec<usize> = fleet
        .listed
        .iter()
        .copied()
        .filter(|&i| replicas[i].serves(req.model.as_deref()))
        .filter(|i| allowed.is_none_or(|a| a.contains(i)))
        .collect();
    if serving.is_empty() && fleet.listed.is_empty() {
        // No replica at all (a discovered pool with no ready pod yet):
        // nothing is ready, a 503, not an unknown model.
        return Err(RouteError::NoHealthyReplica(model()));
    }
    if serving.is_empty() {
        return Err(RouteError::NoReplicaForModel(model()));
    }
    // The long-prompt lane: long prompts only on `long` replicas; short
    // ones per HEARTH_LONG_LANE (avoid-unless-warm is settled once
    // overlaps are known, in the overlap phase).
    let any_long = fleet.any_long;
    let long_request = any_long && req.prompt_bytes >= p.long_prompt_bytes;
    let in_lane: Vec<usize> = serving
        .into_iter()
        .filter(|&i| state[i].health.is_serving())
        .filter(|&i| match (long_request, any_long, p.long_lane) {
            (true, _, _) => replicas[i].long,
            (false, true, LongLane::Exclusive) => !replicas[i].long,
            _ => true,
        })
        .collect();
    let healthy: Vec<usize> = if !long_request && any_long && p.long_lane == LongLane::Avoid {
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
        return Err(RouteError::NoHealthyReplica(model()));
    }
    // Admission: in-flight and engine-queue limits.
    let candidates: Vec<usize> = healthy
        .into_iter()
        .filter(|&i| {
            p.max_inflight == 0
                || state[i].in_flight.saturating_add(state[i].peer_in_flight) < p.max_inflight
        })
        .filter(|&i| {
            p.max_queue == 0
                || router
                    .fresh_engine(&state[i], now)
                    .is_none_or(|e| e.waiting < p.max_queue as f64)
        })
        .collect();
    if candidates.is_empty() {
        return Err(RouteError::Saturated);
    }
    Ok(Admitted {
        candidates,
        long_request,
    })
}

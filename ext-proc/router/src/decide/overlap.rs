//! Phase 2: how many leading blocks of the prompt each candidate holds
//! (its warmth), and whether the prompt continues an earlier one (its
//! overlap reaches a recent prompt's tip).

use super::candidates::Admitted;
use super::request::RequestInfo;
use crate::fleet::Fleet;
use crate::params::LongLane;
use crate::replica::Replica;
use crate::router::Router;
use crate::tips::{Continuation, Tips};
use crate::warmth::LruBlocks;

/// The candidates with their overlaps (in blocks), in the same order.
pub(crate) struct Warmth {
    pub candidates: Vec<usize>,
    pub overlaps: Vec<usize>,
    /// The earlier turn this prompt continues, if any.
    pub continued: Option<Continuation>,
    /// The share of recent first turns that went on to a second turn
    /// (see [`crate::tips::Sequels`]).
    pub sequel_share: f64,
    /// The share of settled first turns that went on to nothing, without
    /// the prior the sequel share starts from: 1 until a first turn
    /// settles ([`crate::tips::Sequels::one_shot_share`]).
    pub one_shot_share: f64,
}

impl Warmth {
    /// No candidate holds any block of the prompt: it is read in full
    /// wherever it goes.
    pub fn is_cold(&self) -> bool {
        self.overlaps.iter().all(|&o| o == 0)
    }
}

/// `known`: how many leading blocks each replica holds (by replica
/// index), when something knows better than the warmth index (only the
/// simulator's entry point, `Router::decide_knowing_at`, passes it).
pub(crate) fn measure(
    router: &Router,
    fleet: &Fleet,
    tips: &Tips,
    req: &RequestInfo,
    admitted: Admitted,
    known: Option<&[usize]>,
) -> Warmth {
    let Admitted {
        candidates,
        long_request,
    } = admitted;
    // The overlap searches of all candidates run together.
    let overlaps = match known {
        Some(known) => candidates
            .iter()
            .map(|&i| known.get(i).map_or(0, |&k| k.min(req.hashes.len())))
            .collect(),
        None => {
            let sets: Vec<&LruBlocks> =
                candidates.iter().map(|&i| &fleet.state[i].warmth).collect();
            LruBlocks::leading_overlaps(&sets, &req.hashes)
        }
    };
    let (candidates, overlaps) = if long_request
        || !fleet.any_long
        || router.params.long_lane != LongLane::AvoidUnlessWarm
    {
        (candidates, overlaps)
    } else {
        warm_long_only(&fleet.replicas, candidates, overlaps)
    };
    let warmest = overlaps.iter().copied().max().unwrap_or(0);
    let reach = &req.hashes[..warmest.min(req.hashes.len())];
    let continued = tips.continued(reach);
    let mut overlaps = overlaps;
    if let Some(c) = continued {
        evicted_part(router, fleet, &c, &candidates, &mut overlaps);
    }
    let sequels = tips.sequels();
    Warmth {
        candidates,
        overlaps,
        continued,
        sequel_share: sequels.share(),
        one_shot_share: sequels.one_shot_share(),
    }
}

/// Where the engine that read the previous turn has since freed part of
/// its chain (its KV events said which chain, and which blocks left),
/// that replica is credited only what is left: the engine's resident
/// share of the previous prompt, in its own bytes (see
/// [`crate::kv_chains`]).
fn evicted_part(
    router: &Router,
    fleet: &Fleet,
    c: &Continuation,
    candidates: &[usize],
    overlaps: &mut [usize],
) {
    let (Some(tip), Some(tokens)) = (c.engine_tip, c.prompt_tokens) else {
        return;
    };
    let Some(k) = candidates
        .iter()
        .position(|&i| fleet.replicas[i].key() == c.from)
    else {
        return;
    };
    let Some(left) = fleet.state[candidates[k]].kv.evicted_from(tip, tokens) else {
        return;
    };
    let bytes = c.prompt_bytes.saturating_mul(left) / tokens.max(1);
    let blocks = (bytes / router.params.block_size.max(1) as u64) as usize;
    overlaps[k] = overlaps[k].min(blocks);
}

/// Under `avoid-unless-warm`, a short prompt keeps a `long` replica only
/// where the session is cached: more of it than on the least-warm
/// candidate (unless no other replica is left).
fn warm_long_only(
    replicas: &[Replica],
    candidates: Vec<usize>,
    overlaps: Vec<usize>,
) -> (Vec<usize>, Vec<usize>) {
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

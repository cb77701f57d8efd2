//! Phase 4: the ranking (highest score, then deeper raw overlap, then
//! the round-robin turn among exact ties), the output-profile tie-break,
//! and the chosen replica with its fallbacks.

use std::sync::atomic::Ordering;

use super::overlap::Warmth;
use super::policy::{Candidate, Scored};
use super::request::RequestInfo;
use crate::fleet::Fleet;
use crate::replica::Replica;
use crate::router::Router;

/// The chosen replica first, then fallbacks; and the chosen one's overlap.
pub(crate) struct Picked {
    pub order: Vec<usize>,
    pub overlap: u32,
}

pub(crate) fn pick(
    router: &Router,
    fleet: &Fleet,
    req: &RequestInfo,
    warm: &Warmth,
    scored: &Scored,
) -> Picked {
    let p = &router.params;
    // Round-robin among exact ties: the turn advances only when the top of
    // the ranking was a tie, so regular traffic patterns cannot keep
    // landing ties on the same replica.
    let rr = router.rr.load(Ordering::Relaxed);
    let mut ranked = rank(&scored.scores, &scored.candidates, rr);
    if fleet.any_short_output {
        ranked = prefer_profile(
            p.short_output_tokens,
            &fleet.replicas,
            ranked,
            &scored.scores,
            &warm.candidates,
            req,
        );
    }
    if let [first, second, ..] = ranked[..] {
        let tied = scored.scores[first] == scored.scores[second]
            && scored.candidates[first].overlap == scored.candidates[second].overlap;
        if tied {
            router.rr.fetch_add(1, Ordering::Relaxed);
        }
    }
    Picked {
        order: ranked
            .iter()
            .take(1 + p.fallbacks)
            .map(|&k| warm.candidates[k])
            .collect(),
        overlap: scored.candidates[ranked[0]].overlap,
    }
}

/// Candidate indices, best first: highest score, then deeper raw overlap,
/// then round-robin starting at `rr % len` so exact ties spread out.
pub fn rank(scores: &[f64], candidates: &[Candidate], rr: usize) -> Vec<usize> {
    let n = candidates.len();
    let mut order: Vec<usize> = (0..n).collect();
    let start = if n == 0 { 0 } else { rr % n };
    order.sort_by(|&a, &b| {
        scores[b]
            .total_cmp(&scores[a])
            .then(candidates[b].overlap.cmp(&candidates[a].overlap))
            .then(((a + n - start) % n).cmp(&((b + n - start) % n)))
    });
    order
}

/// Among the candidates tied for the top score, those whose output profile
/// suits the request go first (short outputs to replicas tagged
/// `profile=short-output`, longer ones elsewhere); the rest of the order
/// is kept.
fn prefer_profile(
    short_output_tokens: u64,
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
    let short = tokens <= short_output_tokens;
    let top = scores[order[0]];
    let tied = order.iter().take_while(|&&k| scores[k] == top).count();
    order[..tied].sort_by_key(|&k| replicas[candidates[k]].short_output != short);
    order
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decide::policy::{credits, scores};
    use crate::params::{AffinityBasis, ScoreParams};

    fn params(basis: AffinityBasis) -> ScoreParams {
        ScoreParams {
            basis,
            cap: 100,
            alpha: 1.0,
            first_turn_cap: 100,
        }
    }

    /// The scoring rule and the ranking together.
    fn rank(p: &ScoreParams, c: &[Candidate], rr: usize) -> Vec<usize> {
        let overlaps: Vec<u32> = c.iter().map(|c| c.overlap).collect();
        let credits = credits(p.basis, p.cap, &overlaps);
        super::rank(&scores(p.alpha, &credits, c), c, rr)
    }

    #[test]
    fn load_overrides_affinity_beyond_alpha() {
        let p = ScoreParams {
            basis: AffinityBasis::Marginal,
            cap: 100,
            alpha: 4.0,
            first_turn_cap: 100,
        };
        let warm_idle = [
            Candidate {
                overlap: 20,
                load: 0.0,
            },
            Candidate {
                overlap: 0,
                load: 0.0,
            },
        ];
        assert_eq!(rank(&p, &warm_idle, 0)[0], 0);
        // 20 blocks of credit vs 6 load units * 4 = 24: load wins.
        let warm_busy = [
            Candidate {
                overlap: 20,
                load: 6.0,
            },
            Candidate {
                overlap: 0,
                load: 0.0,
            },
        ];
        assert_eq!(rank(&p, &warm_busy, 0)[0], 1);
    }

    #[test]
    fn ties_go_to_deeper_overlap_then_round_robin() {
        let p = params(AffinityBasis::Marginal);
        // Equal scores (both 0 marginal credit is impossible with different
        // overlaps, so use load to equalise): 10 - 10 = 0 and 0 - 0 = 0.
        let c = [
            Candidate {
                overlap: 0,
                load: 0.0,
            },
            Candidate {
                overlap: 10,
                load: 10.0,
            },
        ];
        assert_eq!(rank(&p, &c, 0), [1, 0]);
        let cold = [Candidate {
            overlap: 0,
            load: 0.0,
        }; 3];
        assert_eq!(rank(&p, &cold, 0), [0, 1, 2]);
        assert_eq!(rank(&p, &cold, 1), [1, 2, 0]);
        assert_eq!(rank(&p, &cold, 5), [2, 0, 1]);
        assert!(rank(&p, &[], 3).is_empty());
    }

    #[test]
    fn a_first_turn_is_placed_by_load_not_by_a_shared_prefix() {
        let p = ScoreParams {
            basis: AffinityBasis::Relative,
            cap: 128,
            alpha: 2.0,
            first_turn_cap: 4,
        };
        // Only replica 0 has read the 32-block harness prompt, and it runs
        // three more requests than replica 1.
        let c = [
            Candidate {
                overlap: 32,
                load: 3.0,
            },
            Candidate {
                overlap: 0,
                load: 0.0,
            },
        ];
        // A later turn whose history is on replica 0 stays there...
        assert_eq!(rank(&p.for_request(true, 1.0), &c, 0)[0], 0);
        // ...a first turn starts on the idle replica: 4 blocks of credit
        // are less than 3 load units at alpha 2.
        assert_eq!(rank(&p.for_request(false, 1.0), &c, 0)[0], 1);
        assert_eq!(p.for_request(false, 1.0).cap, 4);
        // With equal load the shared prefix still breaks the tie.
        let idle = [c[0], Candidate { load: 3.0, ..c[1] }];
        assert_eq!(rank(&p.for_request(false, 1.0), &idle, 0)[0], 0);
        // The first-turn cap never raises the cap.
        let low = ScoreParams { cap: 2, ..p };
        assert_eq!(low.for_request(false, 1.0).cap, 2);
    }

    #[test]
    fn one_shot_traffic_keeps_the_shared_prefix_credit_of_its_first_turns() {
        let p = ScoreParams {
            basis: AffinityBasis::Relative,
            cap: 128,
            alpha: 1.0,
            first_turn_cap: 4,
        };
        // Every first turn went on: the cap as set.
        assert_eq!(p.for_request(false, 1.0).cap, 4);
        // Half did: each placement holds half a conversation.
        assert_eq!(p.for_request(false, 0.5).cap, 8);
        // None did (an app's prompt and a question, over and over): the
        // 12-block system prompt counts in full, and the replica holding it
        // keeps the request over one running 5 more requests.
        assert_eq!(p.for_request(false, 0.0).cap, 128);
        let c = [
            Candidate {
                overlap: 12,
                load: 5.0,
            },
            Candidate {
                overlap: 0,
                load: 0.0,
            },
        ];
        assert_eq!(rank(&p.for_request(false, 1.0), &c, 0)[0], 1);
        assert_eq!(rank(&p.for_request(false, 0.0), &c, 0)[0], 0);
        // A later turn is never affected, and a cap of 0 stays 0.
        assert_eq!(p.for_request(true, 0.0).cap, 128);
        let none = ScoreParams {
            first_turn_cap: 0,
            ..p
        };
        assert_eq!(none.for_request(false, 0.0).cap, 0);
    }
}

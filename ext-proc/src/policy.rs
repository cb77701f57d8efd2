//! The scoring rule, as pure functions over numbers.
//!
//! `score(r) = credit(r) - alpha * load(r)`; the highest score wins, ties go
//! to the deeper raw overlap, then round-robin. A request that continues no
//! earlier prompt (a first turn) has its credit capped lower
//! ([`ScoreParams::first_turn_cap`]): what it shares with a replica is a
//! prefix other conversations share, which any replica reads once, so load
//! decides where a conversation starts. The benchmark's simulator calls this
//! same code, so what it measures is what the sidecar runs.

use std::fmt;
use std::str::FromStr;

/// How prefix overlap turns into credit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AffinityBasis {
    /// `min(overlap, cap)`: every matching block counts. Shared system
    /// prompts make every replica look equally warm.
    Absolute,
    /// `min(overlap - min_overlap, cap)`: only blocks beyond what the
    /// least-warm candidate also holds count.
    Marginal,
    /// `min(W, cap) - min(W - overlap, cap)`, `W` = the warmest candidate's
    /// overlap: credit measured against the warmest replica.
    #[default]
    Relative,
}

impl AffinityBasis {
    pub const ALL: [AffinityBasis; 3] = [
        AffinityBasis::Absolute,
        AffinityBasis::Marginal,
        AffinityBasis::Relative,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            AffinityBasis::Absolute => "absolute",
            AffinityBasis::Marginal => "marginal",
            AffinityBasis::Relative => "relative",
        }
    }
}

impl fmt::Display for AffinityBasis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for AffinityBasis {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        AffinityBasis::ALL
            .into_iter()
            .find(|b| b.as_str().eq_ignore_ascii_case(s))
            .ok_or_else(|| {
                format!("unknown affinity basis {s:?}: expected absolute, marginal or relative")
            })
    }
}

/// The knobs of the scoring rule.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScoreParams {
    pub basis: AffinityBasis,
    /// Credit is capped at this many blocks.
    pub cap: u32,
    /// Blocks of credit that one unit of load outweighs.
    pub alpha: f64,
    /// Credit cap, in blocks, for a request that continues no earlier
    /// prompt (the lower of this and `cap` applies).
    pub first_turn_cap: u32,
}

impl ScoreParams {
    /// The parameters for one request: `continues` is whether its prompt
    /// extends an earlier one (a later turn of a conversation). A first
    /// turn overlaps only with prefixes other conversations sent (harness
    /// and system prompts), which a replica reads once and then keeps, while
    /// the conversation's placement holds its load for its whole life.
    pub fn for_request(&self, continues: bool) -> ScoreParams {
        if continues {
            *self
        } else {
            ScoreParams {
                cap: self.cap.min(self.first_turn_cap),
                ..*self
            }
        }
    }
}

/// One replica as the scoring rule sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Candidate {
    /// Leading blocks of the request the replica holds.
    pub overlap: u32,
    /// In-flight load, in load units.
    pub load: f64,
}

/// Credit of each candidate under `basis`, in blocks.
pub fn credits(basis: AffinityBasis, cap: u32, overlaps: &[u32]) -> Vec<f64> {
    let least = overlaps.iter().copied().min().unwrap_or(0);
    let warmest = overlaps.iter().copied().max().unwrap_or(0);
    overlaps
        .iter()
        .map(|&o| {
            let c = match basis {
                AffinityBasis::Absolute => o.min(cap),
                AffinityBasis::Marginal => (o - least).min(cap),
                AffinityBasis::Relative => warmest.min(cap) - (warmest - o).min(cap),
            };
            f64::from(c)
        })
        .collect()
}

/// Scores of each candidate: `credit - alpha * load`.
pub fn scores(params: &ScoreParams, candidates: &[Candidate]) -> Vec<f64> {
    let overlaps: Vec<u32> = candidates.iter().map(|c| c.overlap).collect();
    credits(params.basis, params.cap, &overlaps)
        .into_iter()
        .zip(candidates)
        .map(|(credit, c)| credit - params.alpha * c.load)
        .collect()
}

/// Candidate indices, best first: highest score, then deeper raw overlap,
/// then round-robin starting at `rr % len` so exact ties spread out.
pub fn rank(params: &ScoreParams, candidates: &[Candidate], rr: usize) -> Vec<usize> {
    rank_scored(params, candidates, rr).order
}

/// A ranking with the numbers it was made from (the decision journal shows
/// them).
#[derive(Clone, Debug, PartialEq)]
pub struct Ranking {
    /// Candidate indices, best first.
    pub order: Vec<usize>,
    /// Each candidate's credit, in candidate order.
    pub credits: Vec<f64>,
    /// Each candidate's score, in candidate order.
    pub scores: Vec<f64>,
}

/// [`rank`], keeping each candidate's credit and score.
pub fn rank_scored(params: &ScoreParams, candidates: &[Candidate], rr: usize) -> Ranking {
    let n = candidates.len();
    let overlaps: Vec<u32> = candidates.iter().map(|c| c.overlap).collect();
    let credits = credits(params.basis, params.cap, &overlaps);
    let scores: Vec<f64> = credits
        .iter()
        .zip(candidates)
        .map(|(credit, c)| credit - params.alpha * c.load)
        .collect();
    let mut order: Vec<usize> = (0..n).collect();
    let start = if n == 0 { 0 } else { rr % n };
    order.sort_by(|&a, &b| {
        scores[b]
            .total_cmp(&scores[a])
            .then(candidates[b].overlap.cmp(&candidates[a].overlap))
            .then(((a + n - start) % n).cmp(&((b + n - start) % n)))
    });
    Ranking {
        order,
        credits,
        scores,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(basis: AffinityBasis) -> ScoreParams {
        ScoreParams {
            basis,
            cap: 100,
            alpha: 1.0,
            first_turn_cap: 100,
        }
    }

    #[test]
    fn credit_bases_follow_their_formulas() {
        // A shared 30-block system prompt everywhere; one replica also holds
        // the session's 20 private blocks.
        let overlaps = [30, 50, 30];
        assert_eq!(
            credits(AffinityBasis::Absolute, 100, &overlaps),
            [30.0, 50.0, 30.0]
        );
        assert_eq!(
            credits(AffinityBasis::Marginal, 100, &overlaps),
            [0.0, 20.0, 0.0]
        );
        assert_eq!(
            credits(AffinityBasis::Relative, 100, &overlaps),
            [30.0, 50.0, 30.0]
        );
        // With a cap of 40 the absolute basis can no longer tell 50 from 30
        // apart beyond the cap, while relative keeps the 20-block gap... up
        // to the cap: min(50,40) - min(50-30,40) = 20.
        assert_eq!(
            credits(AffinityBasis::Absolute, 40, &overlaps),
            [30.0, 40.0, 30.0]
        );
        assert_eq!(
            credits(AffinityBasis::Relative, 40, &overlaps),
            [20.0, 40.0, 20.0]
        );
        assert_eq!(
            credits(AffinityBasis::Marginal, 10, &overlaps),
            [0.0, 10.0, 0.0]
        );
    }

    #[test]
    fn cap_makes_absolute_blind_to_deep_prefixes() {
        // Both replicas hold more than the cap: absolute ties, relative
        // still prefers the warmer one.
        let overlaps = [300, 260];
        assert_eq!(
            credits(AffinityBasis::Absolute, 256, &overlaps),
            [256.0, 256.0]
        );
        let rel = credits(AffinityBasis::Relative, 256, &overlaps);
        assert!(rel[0] > rel[1]);
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
        assert_eq!(rank(&p.for_request(true), &c, 0)[0], 0);
        // ...a first turn starts on the idle replica: 4 blocks of credit
        // are less than 3 load units at alpha 2.
        assert_eq!(rank(&p.for_request(false), &c, 0)[0], 1);
        assert_eq!(p.for_request(false).cap, 4);
        // With equal load the shared prefix still breaks the tie.
        let idle = [c[0], Candidate { load: 3.0, ..c[1] }];
        assert_eq!(rank(&p.for_request(false), &idle, 0)[0], 0);
        // The first-turn cap never raises the cap.
        let low = ScoreParams { cap: 2, ..p };
        assert_eq!(low.for_request(false).cap, 2);
    }

    #[test]
    fn basis_parses_case_insensitively_and_rejects_others() {
        assert_eq!(
            "Marginal".parse::<AffinityBasis>(),
            Ok(AffinityBasis::Marginal)
        );
        assert!("fastest".parse::<AffinityBasis>().is_err());
    }
}

//! Phase 3, the scoring rule: each candidate's credit (from its overlap)
//! and load (its reservations, its engine's queue, the conversations
//! paused on it), and `score(r) = credit(r) - alpha * load(r)`. The
//! highest score wins; ties go to the deeper raw overlap, then
//! round-robin ([`super::pick`]). A request that continues no
//! earlier prompt (a first turn) has its credit capped lower
//! ([`crate::params::ScoreParams::first_turn_cap`]): what it shares with a replica is a
//! prefix other conversations share, which any replica reads once, so load
//! decides where a conversation starts. The lower cap is divided by the
//! share of recent first turns that went on to a second turn: where
//! requests are one-shot (an app's system prompt and a question), a
//! placement holds no conversation, and the shared prefix counts in full.
//! A later turn (and a one-shot request) on replicas that each run many
//! requests, none waiting, weighs the differences of what they run in
//! proportion to it, and the prompts they are still reading as counted
//! ([`load_weight`]). A prompt no candidate holds any block of is
//! read in full wherever it goes: for it, the prompt each candidate is
//! still reading counts per block ([`cold_read_weight`]).
//! The benchmark's simulator calls this same code, so what it measures is
//! what the sidecar runs.

use std::time::Instant;

use super::overlap::Warmth;
use crate::fleet::{Fleet, ReplicaState};
use crate::params::{AffinityBasis, RouterParams};
use crate::router::Router;

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

/// The candidates as scored, in candidate order.
pub(crate) struct Scored {
    pub candidates: Vec<Candidate>,
    pub credits: Vec<f64>,
    pub scores: Vec<f64>,
}

/// Credit, load and score of each candidate, for a prompt of `req_blocks`
/// fingerprint blocks.
pub(crate) fn score(
    router: &Router,
    fleet: &mut Fleet,
    warm: &Warmth,
    req_blocks: usize,
    now: Instant,
) -> Scored {
    let p = &router.params;
    let state = &mut fleet.state;
    // A new conversation: while some candidate is idle (nothing resident,
    // nothing running), conversations resident on the others count
    // against them.
    let mut residents_count = false;
    if warm.continued.is_none() && p.resident_load > 0.0 {
        for &i in &warm.candidates {
            // Conversations whose latest turn is older than the window
            // ended, or pause long enough to be evicted anyway.
            state[i].resident.expire(now, p.resident_window);
        }
        residents_count = warm.candidates.iter().any(|&i| {
            let s = &state[i];
            s.resident.is_empty() && s.in_flight.saturating_add(s.peer_in_flight) == 0
        });
    }
    // Otherwise, for a prompt no candidate holds: what each one's prompts
    // draw to it already.
    let drawn = if residents_count {
        None
    } else {
        drawn_load(p, state, warm, req_blocks, now)
    };
    let candidates: Vec<Candidate> = warm
        .candidates
        .iter()
        .zip(&warm.overlaps)
        .enumerate()
        .map(|(n, (&i, &overlap))| Candidate {
            overlap: overlap as u32,
            load: state[i].load
                + state[i].peer_load
                + engine_load(router, &state[i], now)
                + if residents_count {
                    resident_load(p, &state[i])
                } else {
                    0.0
                }
                + drawn.as_ref().map_or(0.0, |d| d[n]),
        })
        .collect();
    let params = p
        .score
        .for_request(warm.continued.is_some(), warm.sequel_share);
    let overlaps: Vec<u32> = candidates.iter().map(|c| c.overlap).collect();
    let mut credits = credits(params.basis, params.cap, &overlaps);
    // The replica that read the previous turn holds all of its prompt, the
    // partial last block no hash names too: that share of a block is its
    // credit as well (a short conversation's affinity is mostly there).
    if let Some(c) = &warm.continued {
        for (n, &i) in warm.candidates.iter().enumerate() {
            let read_it = fleet.replicas[i].key() == c.from && overlaps[n] as usize >= c.depth;
            if read_it {
                let named = c.depth as u64 * p.block_size as u64;
                let tail = c
                    .prompt_bytes
                    .saturating_sub(named)
                    .min(p.block_size as u64);
                credits[n] += tail as f64 / p.block_size.max(1) as f64;
            }
        }
    }
    // The weight applies to requests that run; the prompts still being
    // read (their prefill, in load units) weigh as counted: an engine
    // reads them ahead of everything that waits for a first token.
    let weight = load_weight(router, fleet, warm, &candidates, now);
    let cold_read = cold_read_weight(p, warm);
    let weighed: Vec<Candidate> = candidates
        .iter()
        .zip(&warm.candidates)
        .map(|(c, &i)| {
            // For a cold prompt, its peers' reading too (their load
            // beyond a unit a request), counted per block.
            let unread = match cold_read {
                Some(_) => router.uncached_in_flight(&fleet.state[i]),
                None => fleet.state[i].uncached_bytes,
            };
            let reading = p.load_units(unread).min(c.load);
            let ahead = cold_read.map_or(reading, |per_block| {
                per_block * unread as f64 / p.block_size.max(1) as f64
            });
            Candidate {
                load: weight * (c.load - reading) + ahead,
                ..*c
            }
        })
        .collect();
    let scores = scores(params.alpha, &credits, &weighed);
    Scored {
        candidates,
        credits,
        scores,
    }
}

/// The load units a block of prompt still being read on a candidate
/// weighs, for a prompt no candidate holds any block of
/// (`HEARTH_COLD_READ_WEIGHT`); None for any other prompt, or when the
/// setting is 0. Such a prompt is read in full wherever it goes, so
/// nothing but load tells the candidates apart, and what delays its
/// first token is the prompt its replica reads before it: on a replica
/// that runs many requests, one more slows each step by a small share,
/// while another cold prompt queued ahead (a few thousand tokens) holds
/// the first token for as long as reading it takes. Counted in load
/// units per `load_unit_bytes` (64 KiB), a replica reading two such
/// prompts would look less loaded than one running a request more.
fn cold_read_weight(p: &RouterParams, warm: &Warmth) -> Option<f64> {
    (warm.is_cold() && p.cold_read_weight > 0.0).then_some(p.cold_read_weight)
}

/// Scores of each candidate: `credit - alpha * load`.
pub fn scores(alpha: f64, credits: &[f64], candidates: &[Candidate]) -> Vec<f64> {
    credits
        .iter()
        .zip(candidates)
        .map(|(credit, c)| credit - alpha * c.load)
        .collect()
}

/// What a later turn's load differences weigh (`HEARTH_RELATIVE_LOAD_ABOVE`):
/// while no candidate's engine has requests waiting and their mean load
/// is above the setting, the setting over that mean. A first turn's
/// weight lies between that and 1 by the sequel share: 1 where first
/// turns start conversations, the later turns' weight where requests are
/// one-shot. The caller applies it to running requests only, not to
/// prompts still being read. An engine that runs
/// every request it has shares its steps among them, so a few requests
/// more on a replica that runs many slow each of them by a small share,
/// in proportion to what it runs, while moving the conversation reads its
/// own blocks again. A request that waits in an engine's queue waits for
/// whole requests: then differences count as they are, and so they do
/// for first turns, whose placement spreads new conversations, and
/// beside a hotspot: once one candidate runs more than
/// `HEARTH_HOTSPOT_RATIO` times another's load, the hotspot itself raises
/// the mean, and scaled by it the difference would weigh less the larger
/// it grew.
fn load_weight(
    router: &Router,
    fleet: &Fleet,
    warm: &Warmth,
    candidates: &[Candidate],
    now: Instant,
) -> f64 {
    let above = router.params.relative_load_above;
    if above <= 0.0 || candidates.is_empty() {
        return 1.0;
    }
    // A first turn's placement holds its conversation for the
    // conversation's whole life, in so far as first turns go on at all
    // (the sequel share): agents' first turns weigh load as counted,
    // one-shot requests (an app's prompt and a question) as later turns.
    let holds = if warm.continued.is_some() {
        0.0
    } else {
        warm.sequel_share.clamp(0.0, 1.0)
    };
    if holds >= 1.0 {
        return 1.0;
    }
    let queued = warm.candidates.iter().any(|&i| {
        router
            .fresh_engine(&fleet.state[i], now)
            .is_some_and(|e| e.waiting > 0.0)
    });
    let loads = candidates.iter().map(|c| c.load);
    let mean = loads.clone().sum::<f64>() / candidates.len() as f64;
    let most = loads.clone().fold(0.0, f64::max);
    let least = loads.fold(f64::INFINITY, f64::min);
    if queued || mean <= above || most > router.params.hotspot_ratio * least {
        1.0
    } else {
        holds + (1.0 - holds) * above / mean
    }
}

/// Load that a new conversation sees on a replica for the conversations
/// resident there, running or paused (while another replica is idle):
/// the paused ones will come back, and a slot-based engine evicts one of
/// them for each newcomer beyond its slots. A running first turn counts
/// too: its reservation alone (about 2 load units for a short prompt)
/// weighs less than a shared system prompt's first-turn credit, so
/// conversations arriving together would otherwise pack onto the replica
/// that holds the prompt.
fn resident_load(p: &RouterParams, s: &ReplicaState) -> f64 {
    p.resident_load * s.resident.len() as f64
}

/// For a prompt no candidate holds any block of, the load each candidate
/// sees for the requests its prompts drew lately ([`crate::fleet::Drawn`]):
/// `HEARTH_RESIDENT_LOAD` times its count above the least candidate's,
/// over the candidates' mean count, times the share of first turns that
/// are one-shot (1 until one settles); None for any other prompt, or while
/// nothing was drawn. Such a prompt seeds its prefix where it goes, and
/// where prefixes are shared by many requests (an app's system prompt and
/// its users' questions) the rest of them follow it there: placed by the
/// load of the instant alone, a few prefixes could start on one replica
/// and keep it the busier for as long as they are used, while the load
/// differences they cause stay below what their credit is worth. Counted
/// relative to the mean, the term does not grow with the request rate: of
/// two replicas, one drawing three times the other's count weighs one
/// `HEARTH_RESIDENT_LOAD` more.
fn drawn_load(
    p: &RouterParams,
    state: &[ReplicaState],
    warm: &Warmth,
    blocks: usize,
    now: Instant,
) -> Option<Vec<f64>> {
    let cold = warm.is_cold() && blocks <= p.score.cap as usize;
    let weight = p.resident_load * warm.one_shot_share.clamp(0.0, 1.0);
    if !cold || weight <= 0.0 || warm.candidates.len() < 2 {
        return None;
    }
    // In whole requests: counts that differ only by their decay since
    // each was last drawn to stay equal, and so do the candidates' scores
    // (their exact ties go to the output profile, then in turn).
    let counts: Vec<f64> = warm
        .candidates
        .iter()
        .map(|&i| state[i].drawn.at(now, p.resident_window).round())
        .collect();
    let mean = counts.iter().sum::<f64>() / counts.len() as f64;
    let least = counts.iter().copied().fold(f64::INFINITY, f64::min);
    (mean > 0.0).then(|| counts.iter().map(|c| weight * (c - least) / mean).collect())
}

/// Load the engine reports beyond this sidecar's own reservations: queued
/// requests, and running ones other gateways sent.
fn engine_load(router: &Router, s: &ReplicaState, now: Instant) -> f64 {
    match router.fresh_engine(s, now) {
        Some(e) => {
            let foreign = (e.running - f64::from(e.own_in_flight)).max(0.0);
            (e.waiting + foreign) * router.params.engine_load_weight
        }
        None => 0.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn the_drawn_term_is_bounded_by_the_resident_load_times_the_candidates() {
        let p = RouterParams::default();
        let now = Instant::now();
        let cold = |one_shot_share: f64| Warmth {
            candidates: vec![0, 1, 2, 3],
            overlaps: vec![0; 4],
            continued: None,
            sequel_share: 0.0,
            one_shot_share,
        };
        let fleet = |counts: [u32; 4]| {
            let mut state: Vec<ReplicaState> = (0..4).map(|_| ReplicaState::new(64)).collect();
            for (s, &n) in state.iter_mut().zip(&counts) {
                for _ in 0..n {
                    s.drawn.add(now, p.resident_window);
                }
            }
            state
        };
        let bound = p.resident_load * 4.0;
        // However many requests one replica drew and the others did not,
        // it weighs at most the bound more; the least drawn, nothing.
        for counts in [[1, 0, 0, 0], [10_000, 0, 0, 0], [5, 5, 0, 0], [9, 3, 1, 0]] {
            let loads = drawn_load(&p, &fleet(counts), &cold(1.0), 1, now).unwrap();
            assert!(
                loads.iter().all(|&l| (0.0..=bound).contains(&l)),
                "{counts:?}: {loads:?}"
            );
            assert_eq!(loads[3], 0.0, "{counts:?}: {loads:?}");
        }
        let all_on_one = drawn_load(&p, &fleet([10_000, 0, 0, 0]), &cold(1.0), 1, now).unwrap();
        assert!((all_on_one[0] - bound).abs() < 1e-9, "{all_on_one:?}");
        // A one-shot share out of range is taken as 1, not as a multiplier.
        let loads = drawn_load(&p, &fleet([10_000, 0, 0, 0]), &cold(50.0), 1, now).unwrap();
        assert!((loads[0] - bound).abs() < 1e-9, "{loads:?}");
        // Nothing where the term does not apply: a prompt a candidate
        // holds part of, one past the affinity cap, requests that are
        // never one-shot, nothing drawn anywhere.
        let mut held = cold(1.0);
        held.overlaps[2] = 1;
        let skewed = fleet([10, 0, 0, 0]);
        assert_eq!(drawn_load(&p, &skewed, &held, 1, now), None);
        let past_cap = p.score.cap as usize + 1;
        assert_eq!(drawn_load(&p, &skewed, &cold(1.0), past_cap, now), None);
        assert_eq!(drawn_load(&p, &skewed, &cold(0.0), 1, now), None);
        assert_eq!(drawn_load(&p, &fleet([0; 4]), &cold(1.0), 1, now), None);
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

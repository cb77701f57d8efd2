//! A short per-second history of the fleet for the dashboard
//! (`GET /debug/series`): decisions, the cache-hit proxy (overlap blocks
//! over prompt blocks), session stays and moves, and each replica's load
//! as sampled once a second. Bounded: the last [`SERIES_SECONDS`] seconds.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// How a decision ended, as the `outcome` label says it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DecisionOutcome {
    Routed,
    NoReplica,
    NoHealthyReplica,
    Saturated,
}

impl DecisionOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            DecisionOutcome::Routed => "routed",
            DecisionOutcome::NoReplica => "no_replica",
            DecisionOutcome::NoHealthyReplica => "no_healthy_replica",
            DecisionOutcome::Saturated => "saturated",
        }
    }
}

/// Where a returning session's turn went (see `hearth_router::tips`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SessionResult {
    /// First turn seen of this conversation.
    New,
    /// Same replica as the conversation's previous turn.
    Stay,
    /// Another replica than the previous turn's.
    Move,
}

impl SessionResult {
    pub fn as_str(self) -> &'static str {
        match self {
            SessionResult::New => "new",
            SessionResult::Stay => "stay",
            SessionResult::Move => "move",
        }
    }
}

/// Seconds of history kept.
pub const SERIES_SECONDS: usize = 600;

/// One second of the fleet's life.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Second {
    /// Unix time, seconds.
    pub t: u64,
    pub decisions: u32,
    pub routed: u32,
    /// Decisions that ended in a 503 or 429.
    pub refused: u32,
    /// Fingerprint blocks of routed requests.
    pub prompt_blocks: u64,
    /// Of those, blocks the chosen replica already held.
    pub overlap_blocks: u64,
    pub new_sessions: u32,
    pub stays: u32,
    pub moves: u32,
    /// Per replica (in `/state` order), sampled during this second; empty
    /// until sampled.
    pub in_flight: Vec<u32>,
    pub load: Vec<f64>,
    /// The replica ids the two lists were sampled for (the list may change
    /// with a reload; [`Series::last_for`] aligns old seconds to new ids).
    #[serde(skip)]
    pub sampled_ids: Option<Arc<[String]>>,
}

#[derive(Debug, Default)]
pub struct Series {
    seconds: Mutex<VecDeque<Second>>,
}

pub fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

impl Series {
    fn with_second(&self, t: u64, f: impl FnOnce(&mut Second)) {
        let mut q = self.seconds.lock().unwrap_or_else(|p| p.into_inner());
        // Clocks may step back; such events land in the latest second.
        if q.back().is_none_or(|b| b.t < t) {
            // Fill gaps so every second is present.
            let from = q.back().map_or(t, |b| {
                (b.t + 1).max(t.saturating_sub(SERIES_SECONDS as u64))
            });
            for s in from..=t {
                q.push_back(Second {
                    t: s,
                    ..Second::default()
                });
            }
            while q.len() > SERIES_SECONDS {
                q.pop_front();
            }
        }
        if let Some(b) = q.back_mut() {
            f(b);
        }
    }

    /// Counts one decision at unix second `t`.
    pub fn record(
        &self,
        t: u64,
        outcome: DecisionOutcome,
        blocks: Option<(u32, usize)>,
        session: Option<SessionResult>,
    ) {
        self.with_second(t, |s| {
            s.decisions += 1;
            if outcome == DecisionOutcome::Routed {
                s.routed += 1;
            } else {
                s.refused += 1;
            }
            if let Some((overlap, total)) = blocks {
                s.overlap_blocks += u64::from(overlap);
                s.prompt_blocks += total as u64;
            }
            match session {
                Some(SessionResult::New) => s.new_sessions += 1,
                Some(SessionResult::Stay) => s.stays += 1,
                Some(SessionResult::Move) => s.moves += 1,
                None => {}
            }
        });
    }

    /// Records the in-flight count and load of each replica in `ids` at
    /// second `t`.
    pub fn sample(&self, t: u64, ids: Vec<String>, in_flight: Vec<u32>, load: Vec<f64>) {
        let last_ids = self.last(1).pop().and_then(|s| s.sampled_ids);
        // Seconds share one id list while the replica list stays the same.
        let ids = match last_ids {
            Some(known) if *known == *ids => known,
            _ => ids.into(),
        };
        self.with_second(t, |s| {
            s.in_flight = in_flight;
            s.load = load;
            s.sampled_ids = Some(ids);
        });
    }

    /// The last `n` seconds, oldest first.
    pub fn last(&self, n: usize) -> Vec<Second> {
        let q = self.seconds.lock().unwrap_or_else(|p| p.into_inner());
        q.iter().skip(q.len().saturating_sub(n)).cloned().collect()
    }

    /// The last `n` seconds with each sampled second's lists in the order
    /// of `ids`: a replica added later reads 0 before it was listed, one
    /// removed is left out.
    pub fn last_for(&self, n: usize, ids: &[String]) -> Vec<Second> {
        let mut seconds = self.last(n);
        for s in &mut seconds {
            let Some(sampled) = s.sampled_ids.take() else {
                continue;
            };
            if *sampled == *ids {
                continue;
            }
            let at = |id: &String| sampled.iter().position(|x| x == id);
            s.in_flight = ids
                .iter()
                .map(|id| {
                    at(id)
                        .and_then(|k| s.in_flight.get(k))
                        .copied()
                        .unwrap_or(0)
                })
                .collect();
            s.load = ids
                .iter()
                .map(|id| at(id).and_then(|k| s.load.get(k)).copied().unwrap_or(0.0))
                .collect();
        }
        seconds
    }

    /// Stays / (stays + moves) over the last `n` seconds; NaN when no
    /// session returned.
    pub fn stay_ratio(&self, n: usize) -> f64 {
        let (stays, moves) = self.last(n).iter().fold((0u64, 0u64), |(a, b), s| {
            (a + u64::from(s.stays), b + u64::from(s.moves))
        });
        if stays + moves == 0 {
            f64::NAN
        } else {
            stays as f64 / (stays + moves) as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_are_contiguous_bounded_and_counted() {
        let s = Series::default();
        s.record(
            100,
            DecisionOutcome::Routed,
            Some((3, 4)),
            Some(SessionResult::Stay),
        );
        s.record(100, DecisionOutcome::Saturated, None, None);
        s.record(
            103,
            DecisionOutcome::Routed,
            Some((0, 4)),
            Some(SessionResult::Move),
        );
        s.sample(103, ids(&["a", "b"]), vec![1, 0], vec![1.5, 0.0]);
        let all = s.last(10);
        assert_eq!(
            all.iter().map(|x| x.t).collect::<Vec<_>>(),
            [100, 101, 102, 103]
        );
        assert_eq!((all[0].decisions, all[0].routed, all[0].refused), (2, 1, 1));
        assert_eq!((all[0].overlap_blocks, all[0].prompt_blocks), (3, 4));
        assert_eq!(all[3].load, [1.5, 0.0]);
        assert_eq!(s.stay_ratio(10), 0.5);
        assert_eq!(s.last(1)[0].t, 103);
        // An old event (clock stepped back) lands in the latest second.
        s.record(50, DecisionOutcome::Routed, None, None);
        assert_eq!(s.last(1)[0].decisions, 2);
        // A jump far ahead keeps the history bounded.
        s.record(100_000, DecisionOutcome::Routed, None, None);
        assert!(s.last(usize::MAX).len() <= SERIES_SECONDS);
        assert!(Series::default().stay_ratio(60).is_nan());
    }

    fn ids(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn sampled_lists_follow_the_replica_ids_across_a_reload() {
        let s = Series::default();
        s.sample(10, ids(&["a", "b"]), vec![1, 2], vec![1.0, 2.0]);
        // "a" was removed and "c" added.
        s.sample(11, ids(&["b", "c"]), vec![3, 4], vec![3.0, 4.0]);
        let now = ids(&["b", "c"]);
        let view = s.last_for(10, &now);
        assert_eq!(view[0].in_flight, [2, 0]);
        assert_eq!(view[0].load, [2.0, 0.0]);
        assert_eq!(view[1].in_flight, [3, 4]);
        // Unsampled seconds stay empty.
        s.record(13, DecisionOutcome::Routed, None, None);
        assert!(s.last_for(10, &now)[3].in_flight.is_empty());
    }
}

//! The one rule for "this prompt continues an earlier one".
//!
//! A conversation's next turn extends its prompt, so its chain starts with
//! the previous turn's *full* blocks (the previous turn's trailing partial
//! block hashes differently once more bytes follow it). Each routed prompt
//! leaves its *tip*, the hash of its last full block, with the replica it
//! went to. A later prompt continues an earlier one when the warm part of
//! its chain (the leading blocks some candidate holds) passes a tip: the
//! deepest such tip is the previous turn, and each turn hands its
//! conversation's name (the first turn's tip) on to the next. Scoring (first-turn cap, resident load), the stay ratio,
//! restart evidence and the journal all read this one answer, carried by
//! the [`crate::Decision`].
//!
//! Tips are bounded (least recently used forgotten first), in two parts: a
//! quarter of the room for first turns' tips, the rest for the tips of
//! turns that continued a conversation. A flood of new prompts (a client
//! that sends a hundred thousand one-block requests) churns only the first
//! part, and never the conversations that came back. When in doubt a
//! turn counts as new: one whose previous turn was forgotten, or evicted
//! from every warmth index.
//!
//! Tips also tell how often a first turn goes on to a second one
//! ([`Sequels`]): agents' conversations almost always do, one-shot
//! requests on a shared system prompt never do, and scoring caps a first
//! turn's credit only as far as its placement will hold a conversation.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::replica::ReplicaKey;
use crate::warmth::{BlockMap, LruBlocks};

/// The earlier turn a prompt continues.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Continuation {
    /// The previous turn's tip (the deepest tip in the prompt's warm part).
    pub tip: u64,
    /// Leading blocks of this prompt up to and including that tip: a
    /// replica whose overlap reaches this far read the previous turn.
    pub depth: usize,
    /// The conversation, named by its first turn's tip.
    pub conversation: u64,
    /// The replica the previous turn went to (by this sidecar's decision
    /// or a peer's report).
    pub from: ReplicaKey,
    /// The previous turn's prompt: canonical bytes (0 when a peer reported
    /// it), and the engine's token count once its answer's usage came.
    /// An engine that read that prompt holds all of it, the partial last
    /// block too.
    pub prompt_bytes: u64,
    pub prompt_tokens: Option<u64>,
    /// The previous turn's last whole block in its engine's own hashes,
    /// when the engine's KV events showed which chain it stored (see
    /// [`crate::kv_chains`]).
    pub engine_tip: Option<u64>,
}

/// What is remembered of a turn by its tip.
#[derive(Clone, Copy, Debug)]
struct Turn {
    replica: ReplicaKey,
    prompt_bytes: u64,
    prompt_tokens: Option<u64>,
    engine_tip: Option<u64>,
    /// Its conversation: the first turn's tip, handed on turn to turn.
    conversation: u64,
    /// For a first turn, whether a second turn came.
    fate: Fate,
}

/// What became of a turn, for [`Sequels`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fate {
    /// A later turn of its conversation, or a first turn whose fate is
    /// not followed here (a peer routed it).
    Later,
    /// A first turn this sidecar routed, its answer still running.
    Pending,
    /// A first turn whose answer ended less than the sequel horizon ago,
    /// with no second turn yet.
    Answered,
    /// A first turn that had no second turn within the horizon (counted
    /// as one-shot; a second turn that comes later still counts).
    OneShot,
    /// A first turn that had its second turn.
    Continued,
}

/// Answered first turns awaiting their fate, at most (the oldest is
/// settled early beyond it).
const PENDING_MAX: usize = 4096;

/// Settled first turns over which the share is taken: past this many the
/// counts are halved, so the share follows the traffic of the last few
/// thousand first turns.
const SEQUEL_WINDOW: f64 = 2048.0;

/// The share the estimate starts from (and is pulled towards by
/// [`SEQUEL_PRIOR`] settled first turns): first turns go on to be
/// conversations, as an agent's do.
const SEQUEL_PRIOR: f64 = 16.0;

/// The share of recent first turns that went on to a second turn (a later
/// prompt extending them, not the same prompt again).
#[derive(Debug, Default)]
pub struct Sequels {
    /// First turns whose answers ended since the last decision.
    ended: Vec<u64>,
    /// Answered first turns' tips by when their answer's end was seen,
    /// oldest first.
    pending: VecDeque<(Instant, u64)>,
    continued: f64,
    one_shot: f64,
}

impl Sequels {
    /// The share, from 0 (every recent first turn was one-shot) to 1 (each
    /// went on); 1 until first turns are seen.
    pub fn share(&self) -> f64 {
        (self.continued + SEQUEL_PRIOR) / (self.continued + self.one_shot + SEQUEL_PRIOR)
    }

    /// The share of settled first turns that went on to nothing, from
    /// the counts alone (no prior): 1 until one settles. What weighs the
    /// requests a replica's prefixes draw ([`crate::fleet::Drawn`]): where
    /// first turns are one-shot, a prefix draws the requests that share
    /// it; where they go on, conversations, whose placement the resident
    /// term and load decide.
    pub fn one_shot_share(&self) -> f64 {
        let settled = self.continued + self.one_shot;
        if settled > 0.0 {
            self.one_shot / settled
        } else {
            1.0
        }
    }

    fn settled(&mut self, continued: bool) {
        if continued {
            self.continued += 1.0;
        } else {
            self.one_shot += 1.0;
        }
        if self.continued + self.one_shot > SEQUEL_WINDOW {
            self.continued /= 2.0;
            self.one_shot /= 2.0;
        }
    }
}

/// Recent prompts' tips, fleet-wide, each with the replica its turn went to.
pub(crate) struct Tips {
    /// Tips of first turns (prompts that continue none).
    first: LruBlocks,
    /// Tips of turns that continued a conversation.
    later: LruBlocks,
    /// (Keyed by the warmth index's seeded hasher: tips are block hashes.)
    went: BlockMap<Turn>,
    sequels: Sequels,
}

impl Tips {
    pub(crate) fn new(capacity: usize) -> Tips {
        let first = (capacity / 4).max(1);
        Tips {
            first: LruBlocks::new(first),
            later: LruBlocks::new(capacity.saturating_sub(first).max(1)),
            went: BlockMap::default(),
            sequels: Sequels::default(),
        }
    }

    /// How often recent first turns went on to a second turn.
    pub(crate) fn sequels(&self) -> &Sequels {
        &self.sequels
    }

    #[cfg(test)]
    fn contains(&self, tip: u64) -> bool {
        self.went.contains_key(&tip)
    }

    /// The deepest turn in `warm` (the leading blocks `replica` holds of
    /// a prompt) that went to `replica` and whose chain its engine's KV
    /// events showed: a conversation that moved away and came back finds
    /// its earlier turn there.
    pub(crate) fn matched_on(&self, warm: &[u64], replica: ReplicaKey) -> Option<Continuation> {
        self.deepest(warm, |t| t.replica == replica && t.engine_tip.is_some())
    }

    /// The turn `warm` (a prompt's leading blocks that some candidate
    /// holds) continues, if any.
    pub(crate) fn continued(&self, warm: &[u64]) -> Option<Continuation> {
        self.deepest(warm, |_| true)
    }

    /// The deepest tip in `warm` whose turn is `wanted`.
    fn deepest(&self, warm: &[u64], wanted: impl Fn(&Turn) -> bool) -> Option<Continuation> {
        let (depth, tip, turn) = warm.iter().enumerate().rev().find_map(|(j, h)| {
            self.went
                .get(h)
                .filter(|t| wanted(t))
                .map(|&t| (j + 1, *h, t))
        })?;
        Some(Continuation {
            tip,
            depth,
            conversation: turn.conversation,
            from: turn.replica,
            prompt_bytes: turn.prompt_bytes,
            prompt_tokens: turn.prompt_tokens,
            engine_tip: turn.engine_tip,
        })
    }

    /// `tip` is now the latest turn of a conversation on `replica`, a
    /// prompt of `prompt_bytes`, continuing `previous` (else it starts
    /// its conversation); `own`: this sidecar routed it (a peer's report
    /// is not, and its first turns' fates are not followed here).
    pub(crate) fn record(
        &mut self,
        tip: u64,
        replica: ReplicaKey,
        prompt_bytes: u64,
        previous: Option<&Continuation>,
        own: bool,
    ) {
        // What became of the first turn: the same prompt again leaves its
        // fate open; a prompt that extends it is its second turn.
        let fate = match previous {
            None if own => Fate::Pending,
            None => Fate::Later,
            Some(p) if p.tip == tip => self.went.get(&tip).map_or(Fate::Later, |t| t.fate),
            Some(p) => {
                if let Some(first) = self.went.get_mut(&p.tip) {
                    match first.fate {
                        Fate::Pending | Fate::Answered => self.sequels.settled(true),
                        Fate::OneShot => {
                            self.sequels.one_shot = (self.sequels.one_shot - 1.0).max(0.0);
                            self.sequels.settled(true);
                        }
                        Fate::Later | Fate::Continued => {}
                    }
                    if first.fate != Fate::Later {
                        first.fate = Fate::Continued;
                    }
                }
                Fate::Later
            }
        };
        // A tip stays in the part it is in; a continuing turn's goes to
        // the conversations' part.
        let Tips { first, later, .. } = self;
        let (part, other) = if previous.is_some() || later.contains(tip) {
            (later, &*first)
        } else {
            (first, &*later)
        };
        if let Some(old) = part.touch_evicting(tip) {
            if !other.contains(old) {
                self.went.remove(&old);
            }
        }
        self.went.insert(
            tip,
            Turn {
                replica,
                prompt_bytes,
                prompt_tokens: None,
                engine_tip: None,
                conversation: previous.map_or(tip, |c| c.conversation),
                fate,
            },
        );
    }

    /// The answer to the prompt whose tip is `tip` ended (its reservation
    /// was released): a first turn's horizon starts at the next decision.
    pub(crate) fn answered(&mut self, tip: u64) {
        if self.went.get(&tip).is_some_and(|t| t.fate == Fate::Pending) {
            self.sequels.ended.push(tip);
        }
    }

    /// First turns whose answers ended `horizon` ago with no second turn
    /// are one-shot (before each decision's scoring). The horizon is how
    /// long a first turn may wait for its second (an agent's tool call
    /// comes back within seconds; a second turn after a longer pause moves
    /// it back); an answer's end is taken at the first decision after it.
    pub(crate) fn settle(&mut self, now: Instant, horizon: Duration) {
        let mut ended = std::mem::take(&mut self.sequels.ended);
        for tip in ended.drain(..) {
            match self.went.get_mut(&tip) {
                Some(t) if t.fate == Fate::Pending => t.fate = Fate::Answered,
                _ => continue,
            }
            if self.sequels.pending.len() >= PENDING_MAX {
                self.settle_oldest();
            }
            self.sequels.pending.push_back((now, tip));
        }
        self.sequels.ended = ended;
        while self
            .sequels
            .pending
            .front()
            .is_some_and(|&(at, _)| now.saturating_duration_since(at) >= horizon)
        {
            self.settle_oldest();
        }
    }

    fn settle_oldest(&mut self) {
        let Some((_, tip)) = self.sequels.pending.pop_front() else {
            return;
        };
        match self.went.get_mut(&tip) {
            Some(t) if t.fate == Fate::Answered => {
                t.fate = Fate::OneShot;
                self.sequels.settled(false);
            }
            // Went on (counted then), or recorded again as a later turn.
            Some(_) => {}
            // Forgotten before a second turn came.
            None => self.sequels.settled(false),
        }
    }

    /// The engine `replica` counted `tokens` in the prompt whose tip is
    /// `tip` (its answer's usage).
    pub(crate) fn note_tokens(&mut self, tip: u64, replica: ReplicaKey, tokens: u64) {
        if let Some(t) = self.went.get_mut(&tip).filter(|t| t.replica == replica) {
            t.prompt_tokens = Some(tokens);
        }
    }

    /// The engine `replica` stored the prompt whose tip is `tip` as the
    /// chain ending at its block `engine_tip`.
    pub(crate) fn note_engine_tip(&mut self, tip: u64, replica: ReplicaKey, engine_tip: u64) {
        if let Some(t) = self.went.get_mut(&tip).filter(|t| t.replica == replica) {
            t.engine_tip = Some(engine_tip);
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.went.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(port: u16) -> ReplicaKey {
        (([127, 0, 0, 1], port).into(), None)
    }

    /// The sidecar's default horizon.
    const HORIZON: Duration = Duration::from_secs(15);

    #[test]
    fn the_deepest_tip_is_the_previous_turn_and_the_first_names_the_conversation() {
        let mut tips = Tips::new(16);
        tips.record(3, key(1), 3 * 2048, None, true);
        let turn1 = tips.continued(&[1, 2, 3, 4]).unwrap();
        assert_eq!((turn1.tip, turn1.conversation), (3, 3));
        tips.record(6, key(2), 6 * 2048 + 100, Some(&turn1), true);
        // Its answer's usage names its size in the engine's tokens (only
        // from the replica it went to).
        tips.note_tokens(6, key(1), 99);
        tips.note_tokens(6, key(2), 3100);
        let c = tips.continued(&[1, 2, 3, 4, 5, 6, 7]).unwrap();
        assert_eq!(
            c,
            Continuation {
                tip: 6,
                depth: 6,
                conversation: 3,
                from: key(2),
                prompt_bytes: 6 * 2048 + 100,
                prompt_tokens: Some(3100),
                engine_tip: None,
            }
        );
        // The engine's chain for it, once its events showed it.
        tips.note_engine_tip(6, key(1), 77);
        assert_eq!(tips.continued(&[6]).unwrap().engine_tip, None);
        tips.note_engine_tip(6, key(2), 77);
        assert_eq!(tips.continued(&[6]).unwrap().engine_tip, Some(77));
        // The conversation moves to replica 1, then comes back to 2: its
        // last turn there (and the engine's chain for it) is found in what
        // replica 2 holds of the prompt.
        let moved = tips.continued(&[1, 2, 3, 4, 5, 6, 7, 8]).unwrap();
        tips.record(8, key(1), 8 * 2048, Some(&moved), true);
        assert_eq!(tips.continued(&[1, 2, 3, 4, 5, 6, 7, 8]).unwrap().tip, 8);
        let back = tips.matched_on(&[1, 2, 3, 4, 5, 6], key(2)).unwrap();
        assert_eq!(
            (back.tip, back.engine_tip, back.conversation),
            (6, Some(77), 3)
        );
        assert_eq!(tips.matched_on(&[1, 2, 3, 4, 5, 6, 7, 8], key(1)), None);
        assert_eq!(tips.continued(&[1, 2]), None);
        // Recorded again elsewhere: the latest replica wins.
        tips.record(6, key(1), 6 * 2048 + 100, None, true);
        assert_eq!(tips.continued(&[3, 6]).unwrap().from, key(1));
    }

    #[test]
    fn tips_are_bounded_and_the_oldest_is_forgotten_first() {
        let mut tips = Tips::new(16);
        for t in 0..10 {
            tips.record(t, key(1), 2048, None, true);
        }
        // First turns have a quarter of the room.
        assert_eq!(tips.len(), 4);
        assert!(!tips.contains(5));
        assert!(tips.contains(6) && tips.contains(9));
    }

    #[test]
    fn a_flood_of_new_prompts_never_flushes_the_conversations_that_came_back() {
        let mut tips = Tips::new(400);
        // Fifty conversations of two turns.
        for c in 0..50u64 {
            tips.record(c * 10, key(1), 2048, None, true);
            let turn1 = tips.continued(&[c * 10]).unwrap();
            tips.record(c * 10 + 1, key(1), 4096, Some(&turn1), true);
        }
        // A hundred thousand one-block prompts, none continuing.
        for t in 0..100_000u64 {
            tips.record(1_000_000 + t, key(2), 2048, None, true);
        }
        for c in 0..50u64 {
            let next = tips.continued(&[c * 10, c * 10 + 1]).unwrap();
            assert_eq!((next.tip, next.conversation), (c * 10 + 1, c * 10));
        }
        assert!(tips.len() <= 400);
    }

    #[test]
    fn one_shot_first_turns_lower_the_sequel_share_and_conversations_raise_it() {
        let t0 = Instant::now();
        let mut tips = Tips::new(100_000);
        assert_eq!(tips.sequels().share(), 1.0);
        // 200 one-shot requests: the same 20 prompts (an app's system
        // prompt, blocks 1..=12, and one of 20 questions), each sent ten
        // times and answered; the same prompt again is no second turn.
        for round in 0..10 {
            for q in 0..20u64 {
                let chain: Vec<u64> = (1..=12).chain([100 + q]).collect();
                let previous = tips.continued(&chain);
                assert_eq!(previous.is_some(), round > 0);
                tips.record(100 + q, key(1), 13 * 2048, previous.as_ref(), true);
                tips.answered(100 + q);
            }
        }
        // A peer's first turns are not followed here.
        tips.record(5_000, key(2), 2048, None, false);
        tips.answered(5_000);
        // The horizon starts when an answer's end is seen...
        tips.settle(t0, HORIZON);
        assert_eq!(tips.sequels().share(), 1.0);
        tips.settle(t0 + HORIZON / 2, HORIZON);
        assert_eq!(tips.sequels().share(), 1.0);
        // ...and once it has passed with no second turn, they are one-shot.
        let later = t0 + HORIZON;
        tips.settle(later, HORIZON);
        let one_shot = tips.sequels().share();
        assert!((one_shot - 16.0 / 36.0).abs() < 1e-9, "{one_shot}");
        // A conversation's second turn, even after the horizon, moves its
        // first turn from one-shot to continued.
        let c = tips.continued(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 100]);
        tips.record(101_000, key(1), 14 * 2048, c.as_ref(), true);
        let back = tips.sequels().share();
        assert!((back - 17.0 / 36.0).abs() < 1e-9, "{back}");
        // Its third turn counts nothing more.
        let c = tips.continued(&[100, 101_000]);
        tips.record(102_000, key(1), 15 * 2048, c.as_ref(), true);
        assert_eq!(tips.sequels().share(), back);
        // A first turn still running when the horizon would have passed
        // is not one-shot: its answer's end starts the horizon.
        tips.record(7, key(1), 2048, None, true);
        tips.settle(later + HORIZON * 4, HORIZON);
        assert_eq!(tips.sequels().share(), back);
        // Conversations that go on raise it again.
        for n in 0..200u64 {
            let first = 1_000_000 + 2 * n;
            tips.record(first, key(2), 2048, None, true);
            tips.answered(first);
            let c = tips.continued(&[first]);
            tips.record(first + 1, key(2), 4096, c.as_ref(), true);
        }
        assert!(tips.sequels().share() > 0.9, "{}", tips.sequels().share());
    }

    #[test]
    fn the_horizon_given_is_the_one_that_settles() {
        let t0 = Instant::now();
        let short = Duration::from_secs(5);
        let mut tips = Tips::new(1_000);
        for t in 1..=20u64 {
            tips.record(t, key(1), 2048, None, true);
            tips.answered(t);
        }
        tips.settle(t0, short);
        tips.settle(t0 + short - Duration::from_millis(1), short);
        assert_eq!(tips.sequels().share(), 1.0);
        // Five seconds on: one-shot under a 5 s horizon, not yet under 15 s.
        tips.settle(t0 + short, HORIZON);
        assert_eq!(tips.sequels().share(), 1.0);
        tips.settle(t0 + short, short);
        let share = tips.sequels().share();
        assert!((share - 16.0 / 36.0).abs() < 1e-9, "{share}");
    }

    #[test]
    fn answered_first_turns_awaiting_their_fate_are_bounded() {
        let t0 = Instant::now();
        let mut tips = Tips::new(100_000);
        for t in 0..(PENDING_MAX as u64 + 100) {
            tips.record(t + 1, key(1), 2048, None, true);
            tips.answered(t + 1);
        }
        tips.settle(t0, HORIZON);
        assert_eq!(tips.sequels.pending.len(), PENDING_MAX);
        assert!(tips.sequels.ended.is_empty());
        // The oldest were settled early, as one-shot.
        let share = tips.sequels().share();
        assert!((share - 16.0 / 116.0).abs() < 1e-9, "{share}");
    }
}

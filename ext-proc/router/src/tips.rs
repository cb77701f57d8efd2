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
}

/// What is remembered of a turn by its tip.
#[derive(Clone, Copy, Debug)]
struct Turn {
    replica: ReplicaKey,
    prompt_bytes: u64,
    prompt_tokens: Option<u64>,
    /// Its conversation: the first turn's tip, handed on turn to turn.
    conversation: u64,
}

/// Recent prompts' tips, fleet-wide, each with the replica its turn went to.
pub(crate) struct Tips {
    /// Tips of first turns (prompts that continue none).
    first: LruBlocks,
    /// Tips of turns that continued a conversation.
    later: LruBlocks,
    /// (Keyed by the warmth index's seeded hasher: tips are block hashes.)
    went: BlockMap<Turn>,
}

impl Tips {
    pub(crate) fn new(capacity: usize) -> Tips {
        let first = (capacity / 4).max(1);
        Tips {
            first: LruBlocks::new(first),
            later: LruBlocks::new(capacity.saturating_sub(first).max(1)),
            went: BlockMap::default(),
        }
    }

    #[cfg(test)]
    fn contains(&self, tip: u64) -> bool {
        self.went.contains_key(&tip)
    }

    /// The turn `warm` (a prompt's leading blocks that some candidate
    /// holds) continues, if any.
    pub(crate) fn continued(&self, warm: &[u64]) -> Option<Continuation> {
        let (depth, tip, turn) = warm
            .iter()
            .enumerate()
            .rev()
            .find_map(|(j, h)| self.went.get(h).map(|&t| (j + 1, *h, t)))?;
        Some(Continuation {
            tip,
            depth,
            conversation: turn.conversation,
            from: turn.replica,
            prompt_bytes: turn.prompt_bytes,
            prompt_tokens: turn.prompt_tokens,
        })
    }

    /// `tip` is now the latest turn of a conversation on `replica`, a
    /// prompt of `prompt_bytes`, continuing `previous` (else it starts
    /// its conversation).
    pub(crate) fn record(
        &mut self,
        tip: u64,
        replica: ReplicaKey,
        prompt_bytes: u64,
        previous: Option<&Continuation>,
    ) {
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
                conversation: previous.map_or(tip, |c| c.conversation),
            },
        );
    }

    /// The engine `replica` counted `tokens` in the prompt whose tip is
    /// `tip` (its answer's usage).
    pub(crate) fn note_tokens(&mut self, tip: u64, replica: ReplicaKey, tokens: u64) {
        if let Some(t) = self.went.get_mut(&tip).filter(|t| t.replica == replica) {
            t.prompt_tokens = Some(tokens);
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

    #[test]
    fn the_deepest_tip_is_the_previous_turn_and_the_first_names_the_conversation() {
        let mut tips = Tips::new(16);
        tips.record(3, key(1), 3 * 2048, None);
        let turn1 = tips.continued(&[1, 2, 3, 4]).unwrap();
        assert_eq!((turn1.tip, turn1.conversation), (3, 3));
        tips.record(6, key(2), 6 * 2048 + 100, Some(&turn1));
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
            }
        );
        assert_eq!(tips.continued(&[1, 2]), None);
        // Recorded again elsewhere: the latest replica wins.
        tips.record(6, key(1), 6 * 2048 + 100, None);
        assert_eq!(tips.continued(&[3, 6]).unwrap().from, key(1));
    }

    #[test]
    fn tips_are_bounded_and_the_oldest_is_forgotten_first() {
        let mut tips = Tips::new(16);
        for t in 0..10 {
            tips.record(t, key(1), 2048, None);
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
            tips.record(c * 10, key(1), 2048, None);
            let turn1 = tips.continued(&[c * 10]).unwrap();
            tips.record(c * 10 + 1, key(1), 4096, Some(&turn1));
        }
        // A hundred thousand one-block prompts, none continuing.
        for t in 0..100_000u64 {
            tips.record(1_000_000 + t, key(2), 2048, None);
        }
        for c in 0..50u64 {
            let next = tips.continued(&[c * 10, c * 10 + 1]).unwrap();
            assert_eq!((next.tip, next.conversation), (c * 10 + 1, c * 10));
        }
        assert!(tips.len() <= 400);
    }
}

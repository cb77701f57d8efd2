//! Which routed prompt an engine's stored blocks belong to, and how much
//! of it the engine still holds.
//!
//! An engine's `BlockStored` events name each block by the engine's own
//! hash over token ids, with its parent (the block before it in the
//! prompt). Hearth cannot compute those hashes (it has no tokenizer, and in
//! filter mode the sidecar never sees the prompt), but it does not need
//! to: it knows where and when it sent each prompt, and the answer's usage
//! says how many tokens the prompt had and how many the engine found
//! cached. A prompt of `P` whole blocks of which `C` were cached left, on
//! its replica, a chain `P` blocks deep whose blocks past `C` were stored
//! after the decision. [`Chains::match_prompt`] looks for that block among
//! the ones stored since the decision; where the conversation's previous
//! turn was matched too, the new chain must run through it up to depth
//! `C`. One block found: the prompt's *engine tip*. None, or more than
//! one (two prompts of the same length prefilled side by side, with no
//! earlier turn to tell them apart): no tip, and the prediction stays
//! approximate.
//!
//! With the tip, the next turn's prediction is exact
//! ([`Chains::resident`]): the deepest block of the chain the engine still
//! holds, found by following the chain up through the blocks it removed
//! (kept, with their links, for a while: [`GHOSTS`]). An engine that evicts
//! least recently used blocks first frees a prompt's tail before its head,
//! so what is left of it is a prefix.
//!
//! Everything here is bounded: the held blocks by the caller's
//! [`crate::kv_events::MAX_HELD_BLOCKS`], the removed ones by [`GHOSTS`],
//! the recent stores by [`RECENT`] and [`RECENT_AGE`], and every walk by
//! [`MAX_WALK`]. A feed's blocks only ever name its own replica's chains.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use crate::warmth::BlockHashState;

/// Removed blocks remembered with their links.
pub const GHOSTS: usize = 1 << 16;

/// Stored events remembered (their last blocks, with when they came).
pub const RECENT: usize = 1 << 16;

/// How long a stored block waits to be matched with a prompt.
pub const RECENT_AGE: Duration = Duration::from_secs(120);

/// The most links followed in one walk up a chain.
pub const MAX_WALK: u32 = 1 << 15;

/// A block's place in its chain.
#[derive(Clone, Copy, Debug)]
struct Link {
    parent: Option<u64>,
    /// Blocks from the chain's root, this one included (1 for a root); 0
    /// while unknown (its parent came later in the same batch, or never).
    depth: u32,
}

/// The last block of an event stored lately: a prompt's chain ends at
/// one (an engine reports each request's new blocks of a step in one
/// event), never in the middle of another prompt's event.
#[derive(Clone, Copy, Debug)]
struct Recent {
    at: Instant,
    hash: u64,
    /// Already matched with a prompt.
    claimed: bool,
}

/// What [`Chains::match_prompt`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Match {
    /// The prompt's last whole block, in the engine's hashes.
    Tip(u64),
    /// More than one chain fits.
    Ambiguous,
    /// None does (not stored, or its events not here yet).
    Unseen,
}

/// One replica's chains, as its events tell them.
#[derive(Debug, Default)]
pub(crate) struct Chains {
    held: HashMap<u64, Link, BlockHashState>,
    ghosts: HashMap<u64, Link, BlockHashState>,
    ghost_order: VecDeque<u64>,
    recent: VecDeque<Recent>,
    /// Blocks stored by the batch being applied with a depth still unknown.
    unresolved: Vec<u64>,
}

impl Chains {
    pub(crate) fn len(&self) -> usize {
        self.held.len()
    }

    pub(crate) fn contains(&self, hash: u64) -> bool {
        self.held.contains_key(&hash)
    }

    /// Forgets everything (the engine's cache is empty, or the set
    /// overflowed).
    pub(crate) fn clear(&mut self) {
        *self = Chains::default();
    }

    /// The engine stored `hash` after `parent` at `now`; `last`: the last
    /// block of its event (where a request's prefill, or a step of it,
    /// ended). False when it already held it (a reused block reported
    /// again).
    pub(crate) fn store(
        &mut self,
        hash: u64,
        parent: Option<u64>,
        last: bool,
        now: Instant,
    ) -> bool {
        if self.held.contains_key(&hash) {
            return false;
        }
        let depth = match parent {
            None => 1,
            // Unknown while the parent's is (or the parent is not held).
            Some(p) => self
                .held
                .get(&p)
                .filter(|l| l.depth > 0)
                .map_or(0, |l| l.depth.saturating_add(1)),
        };
        if depth == 0 {
            self.unresolved.push(hash);
        }
        self.held.insert(hash, Link { parent, depth });
        if !last {
            return true;
        }
        while self
            .recent
            .front()
            .is_some_and(|r| now.saturating_duration_since(r.at) > RECENT_AGE)
            || self.recent.len() >= RECENT
        {
            self.recent.pop_front();
        }
        self.recent.push_back(Recent {
            at: now,
            hash,
            claimed: false,
        });
        true
    }

    /// The engine removed `hash`. False when it did not hold it.
    pub(crate) fn remove(&mut self, hash: u64) -> bool {
        let Some(link) = self.held.remove(&hash) else {
            return false;
        };
        if self.ghost_order.len() >= GHOSTS {
            if let Some(old) = self.ghost_order.pop_front() {
                self.ghosts.remove(&old);
            }
        }
        if self.ghosts.insert(hash, link).is_none() {
            self.ghost_order.push_back(hash);
        }
        true
    }

    /// After a batch: the depths of blocks stored before their parents in
    /// it (an engine may log a prompt's blocks from its last to its first).
    pub(crate) fn settle(&mut self) {
        for hash in std::mem::take(&mut self.unresolved) {
            self.resolve(hash);
        }
    }

    /// Gives `hash` and the unknown blocks above it their depths, where a
    /// known depth or a root is reached within [`MAX_WALK`] links.
    fn resolve(&mut self, hash: u64) {
        let mut path = Vec::new();
        let mut at = hash;
        let mut base = None;
        for _ in 0..MAX_WALK {
            let Some(link) = self.held.get(&at) else {
                break;
            };
            if link.depth > 0 {
                base = Some(link.depth);
                break;
            }
            path.push(at);
            match link.parent {
                Some(p) => at = p,
                None => {
                    // `at` is a root stored with a depth of 1 already; a
                    // depth-0 root cannot be.
                    break;
                }
            }
        }
        let Some(base) = base else {
            return;
        };
        for (k, h) in path.iter().rev().enumerate() {
            if let Some(l) = self.held.get_mut(h) {
                l.depth = base.saturating_add(k as u32 + 1);
            }
        }
    }

    fn link(&self, hash: u64) -> Option<&Link> {
        self.held.get(&hash).or_else(|| self.ghosts.get(&hash))
    }

    /// The block at `depth` on `hash`'s chain (held or lately removed).
    fn ancestor(&self, hash: u64, depth: u32) -> Option<u64> {
        let mut at = hash;
        for _ in 0..MAX_WALK {
            let link = self.link(at)?;
            if link.depth == depth {
                return Some(at);
            }
            if link.depth < depth || link.depth == 0 {
                return None;
            }
            at = link.parent?;
        }
        None
    }

    /// Blocks of `tip`'s chain the engine still holds from its root: the
    /// depth of the deepest held block on it. `None` when the chain cannot
    /// be followed (removed too long ago, or never seen).
    pub(crate) fn resident(&self, tip: u64) -> Option<u32> {
        let mut at = tip;
        for _ in 0..MAX_WALK {
            if let Some(link) = self.held.get(&at) {
                return (link.depth > 0).then_some(link.depth);
            }
            let link = self.ghosts.get(&at)?;
            match link.parent {
                Some(p) => at = p,
                // The whole chain is gone.
                None => return Some(0),
            }
        }
        None
    }

    /// The chain of a prompt of `prompt` whole blocks, `cached` of them
    /// found in the cache, decided at `since`; `previous`: the engine tip of
    /// the turn it continues on this replica, when that was matched. A
    /// chain found is claimed (no other prompt is matched with it).
    pub(crate) fn match_prompt(
        &mut self,
        since: Instant,
        prompt: u32,
        cached: u32,
        previous: Option<u64>,
    ) -> Match {
        if prompt == 0 {
            return Match::Unseen;
        }
        // Through the previous turn up to the cached depth, where known.
        let through = previous
            .filter(|_| cached > 0)
            .and_then(|p| self.ancestor(p, cached));
        if cached >= prompt {
            // Nothing new was stored: the prompt ends inside the chain it
            // found.
            return previous
                .and_then(|p| self.ancestor(p, prompt))
                .map_or(Match::Unseen, Match::Tip);
        }
        let mut found: Option<usize> = None;
        let mut more = false;
        for (i, r) in self.recent.iter().enumerate().rev() {
            if r.at < since {
                break;
            }
            if r.claimed || self.held.get(&r.hash).is_none_or(|l| l.depth != prompt) {
                continue;
            }
            if through.is_some() && self.ancestor(r.hash, cached) != through {
                continue;
            }
            if found.is_some() {
                more = true;
                break;
            }
            found = Some(i);
        }
        match found {
            Some(_) if more => Match::Ambiguous,
            Some(i) => {
                self.recent[i].claimed = true;
                Match::Tip(self.recent[i].hash)
            }
            None => Match::Unseen,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One stored event.
    fn chain(c: &mut Chains, hashes: &[u64], parent: Option<u64>, now: Instant) {
        let mut p = parent;
        for (i, &h) in hashes.iter().enumerate() {
            c.store(h, p, i + 1 == hashes.len(), now);
            p = Some(h);
        }
        c.settle();
    }

    #[test]
    fn a_prompts_chain_is_found_by_its_depth_and_followed_as_its_tail_goes() {
        let t0 = Instant::now();
        let mut c = Chains::default();
        // A shared root of two blocks, stored before the decision.
        chain(&mut c, &[1, 2], None, t0);
        let t1 = t0 + Duration::from_secs(1);
        // Prompt of 5 blocks, 2 cached: blocks 3..5 stored after it.
        chain(&mut c, &[13, 14, 15], Some(2), t1);
        assert_eq!(c.match_prompt(t1, 5, 2, None), Match::Tip(15));
        // Claimed: not matched again.
        assert_eq!(c.match_prompt(t1, 5, 2, None), Match::Unseen);
        assert_eq!(c.resident(15), Some(5));
        // The engine frees the tail first.
        c.remove(15);
        c.remove(14);
        assert_eq!(c.resident(15), Some(3));
        for h in [13, 2, 1] {
            c.remove(h);
        }
        assert_eq!(c.resident(15), Some(0));
        // Never seen.
        assert_eq!(c.resident(99), None);
    }

    #[test]
    fn blocks_logged_last_first_get_their_depths_after_the_batch() {
        let now = Instant::now();
        let mut c = Chains::default();
        c.store(3, Some(2), true, now);
        c.store(2, Some(1), true, now);
        c.store(1, None, true, now);
        c.settle();
        assert_eq!(c.resident(3), Some(3));
        assert_eq!(c.match_prompt(now, 3, 0, None), Match::Tip(3));
    }

    #[test]
    fn two_prompts_of_one_length_are_ambiguous_unless_an_earlier_turn_tells() {
        let t0 = Instant::now();
        let mut c = Chains::default();
        chain(&mut c, &[1, 2], None, t0);
        chain(&mut c, &[21, 22], None, t0);
        let t1 = t0 + Duration::from_secs(1);
        // Two second turns, each 4 blocks with its first 2 cached.
        chain(&mut c, &[3, 4], Some(2), t1);
        chain(&mut c, &[23, 24], Some(22), t1);
        assert_eq!(c.match_prompt(t1, 4, 2, None), Match::Ambiguous);
        assert_eq!(c.match_prompt(t1, 4, 2, Some(22)), Match::Tip(24));
        assert_eq!(c.match_prompt(t1, 4, 2, Some(2)), Match::Tip(4));
        // Blocks stored before the decision are not its own.
        let t2 = t1 + Duration::from_secs(1);
        assert_eq!(c.match_prompt(t2, 4, 2, Some(2)), Match::Unseen);
        // A turn that stored nothing new ends inside its earlier chain.
        assert_eq!(c.match_prompt(t2, 3, 3, Some(4)), Match::Tip(3));
    }

    #[test]
    fn what_is_remembered_stays_bounded() {
        let now = Instant::now();
        let mut c = Chains::default();
        let n = (GHOSTS + RECENT) as u64;
        let mut p = None;
        for h in 1..=n {
            c.store(h, p, true, now);
            p = Some(h);
            if h > 8 {
                c.remove(h - 8);
            }
        }
        assert!(c.len() <= 8);
        assert!(c.ghosts.len() <= GHOSTS && c.ghost_order.len() <= GHOSTS);
        assert!(c.recent.len() <= RECENT);
        // A chain removed past what is remembered cannot be followed.
        assert_eq!(c.resident(n), Some(n as u32));
        c.remove(n);
        assert_eq!(c.resident(n), Some(n as u32 - 1));
        // Old stores age out.
        c.store(
            n + 1,
            Some(n - 1),
            true,
            now + RECENT_AGE + Duration::from_secs(1),
        );
        assert_eq!(c.recent.len(), 1);
    }
}

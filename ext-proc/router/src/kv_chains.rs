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
//! the last blocks of the events stored since the decision (an engine
//! reports a request's new blocks of one step in one event), whose part
//! past `C` was stored after the decision; where the conversation's
//! previous turn was matched too, the new chain must run through it up to
//! depth `C`. One block found: the prompt's chain. More than one (prompts
//! of one shape prefilled side by side, with no earlier turn to tell them
//! apart): the prompt waits, and prompts of one shape are matched in the
//! order they were decided once as many of their chains are stored, as a
//! first-come-first-served engine stores them. The prompt's *engine tip*
//! is the deepest block its request stored on that chain (its answer's
//! blocks too, which the next turn, carrying the answer, finds).
//!
//! With the tip, the next turn's prediction is exact
//! ([`Chains::resident`]): the deepest block of the chain the engine still
//! holds, found by following the chain up through the blocks it removed
//! (kept, with their links, for a while: [`GHOSTS`]). An engine that evicts
//! least recently used blocks first frees a prompt's tail before its head,
//! so what is left of it is a prefix. A prompt its replica holds nothing of
//! is predicted to find the root the last cold prompts there found
//! ([`Chains::cold_root`]).
//!
//! Everything here is bounded: the held blocks by the caller's
//! [`crate::kv_events::MAX_HELD_BLOCKS`], the removed ones by [`GHOSTS`],
//! the recent stores by [`RECENT`] and [`RECENT_AGE`], the waiting
//! prompts by [`WAITING`] and [`WAIT_AGE`], every walk by [`MAX_WALK`],
//! and all of an answer's walks together by [`MATCH_WALK`]; a batch's
//! blocks of unknown depth are each walked over once. A feed's blocks
//! only ever name its own replica's chains.

use std::cell::Cell;
use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use crate::warmth::BlockHashState;

/// Removed blocks remembered with their links.
pub const GHOSTS: usize = 1 << 14;

/// Stored events remembered (their last blocks, with when they came).
pub const RECENT: usize = 1 << 14;

/// How long a stored block waits to be matched with a prompt (an answer
/// that streams for longer is not matched).
pub const RECENT_AGE: Duration = Duration::from_secs(60);

/// The most links followed in one walk up a chain.
pub const MAX_WALK: u32 = 1 << 15;

/// The most links followed up chains in matching one answer, all walks
/// together (a hostile feed's chains cost the router's lock this much at
/// most per answer; about half a millisecond).
pub const MATCH_WALK: u32 = 1 << 17;

/// A block's place in its chain (16 bytes).
#[derive(Clone, Copy, Debug)]
struct Link {
    /// The block before it; a root names itself.
    parent: u64,
    /// Blocks from the chain's root, this one included (1 for a root); 0
    /// while unknown (its parent came later in the same batch, or never).
    depth: u32,
    /// The batch that stored it ([`Chains::batch`]).
    batch: u32,
}

impl Link {
    /// The parent of block `hash`, whose link this is.
    fn parent(&self, hash: u64) -> Option<u64> {
        (self.parent != hash).then_some(self.parent)
    }
}

/// The last block of an event stored lately: a prompt's chain ends at
/// one (an engine reports each request's new blocks of a step in one
/// event), never in the middle of another prompt's event.
#[derive(Clone, Copy, Debug)]
struct Recent {
    at: Instant,
    batch: u32,
    hash: u64,
    /// Already matched with a prompt.
    claimed: bool,
}

/// What one search for a prompt's chain found.
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
    /// Prompts waiting for their chains (see [`Chains::match_prompt`]).
    waiting: VecDeque<Waiting>,
    cold_root: Option<ColdRoot>,
    /// Batches applied (wrapping): what [`Link::batch`] counts in.
    batch: u32,
    /// Links the current match may still follow ([`MATCH_WALK`]).
    budget: Cell<u32>,
}

impl Chains {
    pub(crate) fn len(&self) -> usize {
        self.held.len()
    }

    pub(crate) fn contains(&self, hash: u64) -> bool {
        self.held.contains_key(&hash)
    }

    /// Heap bytes its tables reserve (a hash table's slot is its entry
    /// and one control byte).
    #[cfg(test)]
    fn heap_bytes(&self) -> usize {
        use std::mem::size_of;
        let table = size_of::<(u64, Link)>() + 1;
        (self.held.capacity() + self.ghosts.capacity()) * table
            + self.ghost_order.capacity() * size_of::<u64>()
            + self.recent.capacity() * size_of::<Recent>()
            + self.waiting.capacity() * size_of::<Waiting>()
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
        self.held.insert(
            hash,
            Link {
                parent: parent.unwrap_or(hash),
                depth,
                batch: self.batch,
            },
        );
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
            batch: self.batch,
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
        // Each block is walked over once per batch, however its chain
        // loops or breaks.
        let mut walked = HashSet::new();
        for hash in std::mem::take(&mut self.unresolved) {
            self.resolve(hash, &mut walked);
        }
        self.batch = self.batch.wrapping_add(1);
    }

    /// Gives `hash` and the unknown blocks above it their depths, where a
    /// known depth or a root is reached within [`MAX_WALK`] links.
    fn resolve(&mut self, hash: u64, walked: &mut HashSet<u64>) {
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
            if !walked.insert(at) {
                // Walked before in this batch, and left unknown.
                break;
            }
            path.push(at);
            match link.parent(at) {
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

    /// The block at `depth` on `hash`'s chain (held or lately removed),
    /// within what is left of the match's budget.
    fn ancestor(&self, hash: u64, depth: u32) -> Option<u64> {
        let mut at = hash;
        loop {
            let left = self.budget.get().checked_sub(1)?;
            self.budget.set(left);
            let link = self.link(at)?;
            if link.depth == depth {
                return Some(at);
            }
            if link.depth < depth || link.depth == 0 {
                return None;
            }
            at = link.parent(at)?;
        }
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
            match link.parent(at) {
                Some(p) => at = p,
                // The whole chain is gone.
                None => return Some(0),
            }
        }
        None
    }

    /// Matches prompt `p` (its answer's usage read at `now`) with the
    /// chain the engine stored for it. A chain found is claimed (no other
    /// prompt is matched with it).
    ///
    /// A prompt that more than one chain fits, with no earlier turn to
    /// tell them apart, waits: prompts of one shape (the same whole and
    /// cached blocks) decided side by side are matched in order once as
    /// many chains of that shape as prompts are stored since the first of
    /// them, the earliest decided with the earliest stored, as an engine
    /// that schedules first come, first served stores them. Their
    /// predictions can only be off where the engine later frees one chain
    /// and not the other of the same shape.
    pub(crate) fn match_prompt(&mut self, p: Prompt, now: Instant) -> Found {
        let mut found = Found::default();
        self.expire_waiting(now, &mut found);
        match self.find(p.since, p.blocks, p.cached, p.previous) {
            Match::Tip(tip) => self.matched(&p, tip, &mut found),
            Match::Unseen if p.blocks == 0 || p.previous.is_some() => found.unseen += 1,
            m => {
                if self.waiting.len() >= WAITING {
                    if let Some(old) = self.waiting.pop_front() {
                        found.gave_up(old.ambiguous);
                    }
                }
                self.waiting.push_back(Waiting {
                    prompt: p,
                    ambiguous: m == Match::Ambiguous,
                });
            }
        }
        self.settle_waiting(&mut found);
        found
    }

    /// `p`'s chain ends at `tip` (its prompt's last whole block): its
    /// engine tip is the deepest block its answer filled after it; a cold
    /// prompt tells which root such prompts find here.
    fn matched(&mut self, p: &Prompt, tip: u64, found: &mut Found) {
        if p.cold {
            let root = (p.cached > 0)
                .then(|| self.ancestor(tip, p.cached))
                .flatten();
            self.cold_root = match (self.cold_root, root) {
                (Some(c), Some(r)) if c.hash == r => Some(ColdRoot {
                    streak: c.streak.saturating_add(1),
                    ..c
                }),
                (_, Some(r)) => Some(ColdRoot {
                    hash: r,
                    depth: p.cached,
                    streak: 1,
                }),
                (_, None) => None,
            };
        }
        let tip = self.extend(tip, p.since, p.blocks);
        found.tips.push((p.id, tip));
    }

    /// Blocks a prompt with no history here finds, on what the last
    /// such prompts found: the root (a shared system prompt, a harness)
    /// the last [`COLD_STREAK`] or more of them hung off, while the
    /// engine holds it.
    pub(crate) fn cold_root(&self) -> Option<u32> {
        let c = self.cold_root.filter(|c| c.streak >= COLD_STREAK)?;
        self.held.contains_key(&c.hash).then_some(c.depth)
    }

    /// The one chain that fits, claimed. (It starts an answer's matching,
    /// and its budget of links: [`MATCH_WALK`].)
    fn find(&mut self, since: Instant, prompt: u32, cached: u32, previous: Option<u64>) -> Match {
        self.budget.set(MATCH_WALK);
        if prompt == 0 {
            return Match::Unseen;
        }
        if cached >= prompt {
            // Nothing new was stored: the prompt ends inside the chain it
            // found.
            return previous
                .and_then(|p| self.ancestor(p, prompt))
                .map_or(Match::Unseen, Match::Tip);
        }
        // Through the previous turn up to the cached depth, where known.
        let through = previous
            .filter(|_| cached > 0)
            .and_then(|p| self.ancestor(p, cached));
        let from = self.batch_at(self.recent_since(since));
        let mut found: Option<usize> = None;
        for (i, r) in self.recent.iter().enumerate().rev() {
            if r.at < since {
                break;
            }
            let Some(start) = self.fits(r, prompt, cached, from) else {
                continue;
            };
            if through.is_some() && self.link(start).and_then(|l| l.parent(start)) != through {
                continue;
            }
            if found.is_some() {
                return Match::Ambiguous;
            }
            found = Some(i);
        }
        match found {
            Some(i) => {
                self.recent[i].claimed = true;
                Match::Tip(self.recent[i].hash)
            }
            None => Match::Unseen,
        }
    }

    /// The deepest block stored since `since` on the chain through `tip`
    /// (at depth `depth`), claimed: the blocks the engine filled with the
    /// answer's tokens after the prompt's, which the next turn (carrying
    /// that answer) finds too; `tip` when there are none.
    fn extend(&mut self, tip: u64, since: Instant, depth: u32) -> u64 {
        let mut deepest = (depth, tip);
        let mut i = self.recent.len();
        while i > 0 {
            i -= 1;
            let r = self.recent[i];
            if r.at < since {
                break;
            }
            let Some(d) = self.held.get(&r.hash).map(|l| l.depth) else {
                continue;
            };
            if r.claimed || d <= depth || self.ancestor(r.hash, depth) != Some(tip) {
                continue;
            }
            self.recent[i].claimed = true;
            if d > deepest.0 {
                deepest = (d, r.hash);
            }
        }
        deepest.1
    }

    /// The first recent event stored at or after `since`.
    fn recent_since(&self, since: Instant) -> usize {
        self.recent.partition_point(|r| r.at < since)
    }

    /// The batch of recent event `i` (the next batch past the last).
    fn batch_at(&self, i: usize) -> u32 {
        self.recent.get(i).map_or(self.batch, |r| r.batch)
    }

    /// Whether recent event `r` can end the chain of a prompt of `blocks`
    /// whole blocks, `cached` of them found in the cache, decided before
    /// batch `from`: unclaimed, held at that depth, and stored past the
    /// cached depth in batch `from` or later (a chain that merely runs as
    /// deep, stored turns ago and extended now, is another
    /// conversation's). Returns the chain's first block past the cached
    /// depth.
    fn fits(&self, r: &Recent, blocks: u32, cached: u32, from: u32) -> Option<u64> {
        if r.claimed || self.held.get(&r.hash).is_none_or(|l| l.depth != blocks) {
            return None;
        }
        let start = self.ancestor(r.hash, cached.saturating_add(1))?;
        let stored = self.link(start)?.batch;
        (stored.wrapping_sub(from) < 1 << 31).then_some(start)
    }

    fn expire_waiting(&mut self, now: Instant, found: &mut Found) {
        self.waiting.retain(|w| {
            let keep = now.saturating_duration_since(w.prompt.since) <= WAIT_AGE;
            if !keep {
                found.gave_up(w.ambiguous);
            }
            keep
        });
    }

    /// Matches, in order, each shape of waiting prompts that as many
    /// unclaimed chains of that shape as prompts were stored for.
    fn settle_waiting(&mut self, found: &mut Found) {
        let mut shapes: Vec<(u32, u32)> = self
            .waiting
            .iter()
            .map(|w| (w.prompt.blocks, w.prompt.cached))
            .collect();
        shapes.sort_unstable();
        shapes.dedup();
        for (blocks, cached) in shapes {
            let mut group: Vec<Prompt> = self
                .waiting
                .iter()
                .map(|w| w.prompt)
                .filter(|p| (p.blocks, p.cached) == (blocks, cached))
                .collect();
            group.sort_by_key(|p| p.since);
            let Some(first) = group.first().map(|p| p.since) else {
                continue;
            };
            let start = self.recent_since(first);
            let from = self.batch_at(start);
            let chains: Vec<usize> = (start..self.recent.len())
                .filter(|&i| self.fits(&self.recent[i], blocks, cached, from).is_some())
                .collect();
            // Each prompt's chain stored after its own decision.
            if chains.len() != group.len()
                || group.iter().zip(&chains).any(|(p, &i)| {
                    let r = &self.recent[i];
                    r.at < p.since
                        || self
                            .fits(r, blocks, cached, self.batch_at(self.recent_since(p.since)))
                            .is_none()
                })
            {
                continue;
            }
            for &i in &chains {
                self.recent[i].claimed = true;
            }
            for (p, &i) in group.iter().zip(&chains) {
                self.matched(p, self.recent[i].hash, found);
                found.in_order += 1;
            }
            self.waiting
                .retain(|w| (w.prompt.blocks, w.prompt.cached) != (blocks, cached));
        }
    }
}

/// A prompt to match, as its answer's usage told it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Prompt {
    /// The caller's name for it.
    pub id: u64,
    /// When it was decided: its chain was stored after.
    pub since: Instant,
    /// Whole blocks of it, and of them found in the cache.
    pub blocks: u32,
    pub cached: u32,
    /// The engine tip of the turn it continues on this replica, when that
    /// was matched.
    pub previous: Option<u64>,
    /// Its decision credited this replica with nothing of it.
    pub cold: bool,
}

/// What cold prompts found here lately (see [`Chains::cold_root`]).
#[derive(Clone, Copy, Debug)]
struct ColdRoot {
    hash: u64,
    depth: u32,
    streak: u32,
}

/// Cold prompts in a row that hung off one root before it is predicted.
pub const COLD_STREAK: u32 = 2;

/// A prompt waiting for its chain: more than one fitted, or none yet.
#[derive(Clone, Copy, Debug)]
struct Waiting {
    prompt: Prompt,
    /// More than one chain fitted when its answer came (else none had).
    ambiguous: bool,
}

/// Prompts waiting for their chains, at most per replica.
pub const WAITING: usize = 1024;

/// How long after its decision a prompt waits for its chain.
pub const WAIT_AGE: Duration = Duration::from_secs(30);

/// What one answer's matching found.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Found {
    /// Prompts (by the caller's id) and their chains' engine tips: this
    /// answer's, and waiting ones it settled.
    pub tips: Vec<(u64, u64)>,
    /// Of those, matched in order among prompts of one shape.
    pub in_order: u64,
    /// Prompts given up: more than one chain fitted, or none did.
    pub ambiguous: u64,
    pub unseen: u64,
}

impl Found {
    fn gave_up(&mut self, ambiguous: bool) {
        if ambiguous {
            self.ambiguous += 1;
        } else {
            self.unseen += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Matches a prompt with no previous turn here.
    fn ask(
        c: &mut Chains,
        id: u64,
        since: Instant,
        (blocks, cached): (u32, u32),
        now: Instant,
    ) -> Found {
        let p = Prompt {
            id,
            since,
            blocks,
            cached,
            previous: None,
            cold: false,
        };
        c.match_prompt(p, now)
    }

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
        assert_eq!(c.find(t1, 5, 2, None), Match::Tip(15));
        // Claimed: not matched again.
        assert_eq!(c.find(t1, 5, 2, None), Match::Unseen);
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
        assert_eq!(c.find(now, 3, 0, None), Match::Tip(3));
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
        assert_eq!(c.find(t1, 4, 2, None), Match::Ambiguous);
        assert_eq!(c.find(t1, 4, 2, Some(22)), Match::Tip(24));
        assert_eq!(c.find(t1, 4, 2, Some(2)), Match::Tip(4));
        // Blocks stored before the decision are not its own.
        let t2 = t1 + Duration::from_secs(1);
        assert_eq!(c.find(t2, 4, 2, Some(2)), Match::Unseen);
        // A prompt that found only the shared root is not matched with a
        // longer conversation's chain that reached the same depth now: that
        // chain's block past the root was stored turns ago.
        chain(&mut c, &[5, 6, 7], Some(4), t2);
        chain(&mut c, &[30, 31, 32, 33, 34], Some(2), t2);
        assert_eq!(c.find(t2, 7, 2, None), Match::Tip(34));
        // A turn that stored nothing new ends inside its earlier chain.
        assert_eq!(c.find(t2, 3, 3, Some(4)), Match::Tip(3));
    }

    #[test]
    fn prompts_of_one_shape_side_by_side_are_matched_in_order_once_all_are_answered() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut c = Chains::default();
        chain(&mut c, &[1, 2], None, t0);
        // Three first turns of one shape, decided in this order: 5 blocks,
        // the shared 2 cached. The engine stores them in that order in one
        // step.
        let (d1, d2, d3) = (t0 + ms(1000), t0 + ms(1100), t0 + ms(1200));
        let step = t0 + ms(2000);
        chain(&mut c, &[10, 11, 12], Some(2), step);
        chain(&mut c, &[20, 21, 22], Some(2), step);
        chain(&mut c, &[30, 31, 32], Some(2), step);
        // The second's answer comes first: three chains fit, so it waits,
        // and so does the third.
        assert_eq!(ask(&mut c, 102, d2, (5, 2), step), Found::default());
        assert_eq!(ask(&mut c, 103, d3, (5, 2), step), Found::default());
        // With the first's answer all three are matched, in order.
        let f = ask(&mut c, 101, d1, (5, 2), step);
        assert_eq!(f.tips, vec![(101, 12), (102, 22), (103, 32)]);
        assert_eq!(f.in_order, 3);
        assert!(c.waiting.is_empty());
        // A chain stored before a prompt's decision is never its own: two
        // prompts and two chains of one shape, but both chains were stored
        // before the later prompt's decision, so neither is guessed.
        let late = step + ms(10);
        chain(&mut c, &[40, 41, 42], Some(2), step);
        chain(&mut c, &[50, 51, 52], Some(2), step);
        assert_eq!(ask(&mut c, 104, late, (5, 2), late).tips, vec![]);
        assert_eq!(ask(&mut c, 105, step, (5, 2), late).tips, vec![]);
        assert_eq!(c.waiting.len(), 2);
        // Nothing fits a third shape yet.
        assert_eq!(ask(&mut c, 106, late, (9, 2), late), Found::default());
        // Past WAIT_AGE the three are given up: 105 as ambiguous (two
        // chains fitted it), 104 and 106 as unseen; and a prompt under a
        // block (nothing to match) counts as unseen at once.
        let f = ask(&mut c, 107, late, (0, 0), late + WAIT_AGE + ms(1));
        assert_eq!((f.ambiguous, f.unseen), (1, 3));
        assert!(c.waiting.is_empty());
        // Bounded.
        for k in 0..(WAITING as u64 + 10) {
            ask(&mut c, k, late, (7, 2), late);
        }
        assert!(c.waiting.len() <= WAITING);
    }

    #[test]
    fn a_full_replica_s_chains_take_about_fourteen_megabytes() {
        let now = Instant::now();
        let mut c = Chains::default();
        let full = crate::kv_events::MAX_HELD_BLOCKS as u64;
        let mut p = None;
        for h in 1..=full + GHOSTS as u64 {
            c.store(h, p, true, now);
            p = Some(h);
        }
        for h in 1..=GHOSTS as u64 {
            c.remove(h);
        }
        c.waiting.reserve_exact(WAITING);
        assert_eq!(c.len() as u64, full);
        let mib = c.heap_bytes() as f64 / (1 << 20) as f64;
        println!("{full} blocks held, {GHOSTS} removed, {RECENT} recent: {mib:.1} MiB");
        assert!(mib < 14.0, "{mib:.1} MiB");
    }

    #[test]
    fn cold_prompts_that_found_one_root_predict_it_for_the_next() {
        let t0 = Instant::now();
        let mut c = Chains::default();
        chain(&mut c, &[1, 2], None, t0);
        // Prompt `id`, decided (and its chain stored) `id` ms in.
        let at = |id: u64| t0 + Duration::from_millis(id);
        let cold = |id, blocks, cached| Prompt {
            id,
            since: at(id),
            blocks,
            cached,
            previous: None,
            cold: true,
        };
        chain(&mut c, &[10, 11], Some(2), at(1));
        c.match_prompt(cold(1, 4, 2), at(1));
        assert_eq!(c.cold_root(), None, "one is not a pattern");
        chain(&mut c, &[20, 21, 22], Some(2), at(2));
        c.match_prompt(cold(2, 5, 2), at(2));
        assert_eq!(c.cold_root(), Some(2));
        // A warm prompt's match says nothing of cold ones.
        chain(&mut c, &[12], Some(11), at(3));
        let warm = Prompt {
            cold: false,
            previous: Some(11),
            ..cold(3, 5, 4)
        };
        assert_eq!(c.match_prompt(warm, at(3)).tips, vec![(3, 12)]);
        assert_eq!(c.cold_root(), Some(2));
        // One that found nothing breaks the pattern; and a root the engine
        // freed is not predicted.
        chain(&mut c, &[30, 31], None, at(4));
        assert_eq!(c.match_prompt(cold(4, 2, 0), at(4)).tips, vec![(4, 31)]);
        assert_eq!(c.cold_root(), None);
        for k in 5..7 {
            chain(&mut c, &[k * 10, k * 10 + 1], Some(2), at(k));
            c.match_prompt(cold(k, 4, 2), at(k));
        }
        assert_eq!(c.cold_root(), Some(2));
        c.remove(2);
        assert_eq!(c.cold_root(), None);
    }

    #[test]
    fn a_hostile_feeds_loops_and_broken_chains_cost_a_bounded_walk() {
        let now = Instant::now();
        let mut c = Chains::default();
        // One batch: a long chain hanging off a block never stored, logged
        // last block first (each block's depth unknown until the batch
        // ends), and a loop.
        let n = 40_000u64;
        for h in (1..=n).rev() {
            c.store(
                h,
                Some(h + 1_000_000).filter(|_| h == 1).or(Some(h - 1)),
                true,
                now,
            );
        }
        c.store(900_001, Some(900_002), true, now);
        c.store(900_002, Some(900_001), true, now);
        let started = Instant::now();
        c.settle();
        // Nothing resolves (no root, no known depth), each block walked
        // once: quadratic would be 800 million steps.
        assert_eq!(c.resident(n), None);
        // A deep chain whose blocks are known, and 64 leaves off its end
        // stored now: a prompt of that depth that found only the root
        // would walk each leaf back to its second block (64 times 40,000
        // links); the answer's budget stops it.
        let deep: Vec<u64> = (3_000_000..3_000_000 + n).collect();
        chain(&mut c, &deep, None, now);
        let later = now + Duration::from_secs(1);
        for k in 0..64 {
            chain(&mut c, &[4_000_000 + k], Some(*deep.last().unwrap()), later);
        }
        let f = ask(&mut c, 1, later, (n as u32 + 1, 1), later);
        assert_eq!(f.tips, vec![]);
        assert_eq!(c.budget.get(), 0, "the walk stopped at MATCH_WALK links");
        println!("settled and matched in {:?}", started.elapsed());
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

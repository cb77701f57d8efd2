//! What an engine's own KV cache events say of its cache
//! ([`hearth_wire::kv_events`]: vLLM's and SGLang's `BlockStored`,
//! `BlockRemoved`, `AllBlocksCleared`, in numbered batches).
//!
//! Per replica with an event feed, the router keeps the set of blocks the
//! engine holds (stored and not removed since), so it knows the engine's
//! occupancy exactly, and its capacity once the engine starts evicting
//! (the most blocks it held when it first had to remove one). Those
//! figures are *exact* only while the router has seen every batch since
//! the engine's cache was empty: since sequence 0 or an
//! `AllBlocksCleared`, with no gap in the sequence, and the feed
//! connected. A feed that joined late, skipped a batch, sent a frame that
//! does not read, or claimed more blocks than [`MAX_HELD_BLOCKS`] is
//! *inexact* until the engine's cache is empty again; the replica then
//! routes on what it did before events (the warmth index and the answers'
//! usage), which it never stopped doing.
//!
//! Evictions as they happen: while the figures are exact and the capacity
//! shown, a replica's warmth index forgets every block Hearth last sent
//! there before the batch after which the engine has stored a whole
//! cache's worth ([`KvEvents::horizon`]): an engine that evicts least
//! recently used blocks first holds none of them, whoever's traffic (or
//! whose long answers) filled it. Blocks the engine kept warm for traffic
//! Hearth did not route are forgotten too: an approximation on the side
//! of moving a conversation, never of crediting a replica that lost it.
//!
//! Restart evidence: a sequence that goes back (to 0, or below the one
//! expected: a restarted engine's first batches may be gone before the
//! feed reconnects) is a new engine process, and `AllBlocksCleared` an
//! emptied cache; either drops the replica's warmth as a restart in its
//! metrics does ([`crate::Router::set_engine_signals`]).
//!
//! What a feed can do, whatever it sends: change its own replica's event
//! figures, drop or thin its own replica's warmth (which an engine restart
//! does anyway), lift the size its own replica's warmth index is cut to
//! while its figures are exact (to `HEARTH_WARMTH_BLOCKS`, or the engine's
//! stated size if larger: [`crate::fleet::ReplicaState::bound_warmth`]),
//! and size that index when they are not and the engine's metrics state
//! no capacity. It never changes health, never reaches another replica,
//! and holds the chains of at most [`MAX_HELD_BLOCKS`] blocks (see
//! [`crate::kv_chains`] for what else it keeps, and how answers are
//! matched with the chains their prompts stored).

use std::collections::VecDeque;
use std::time::Instant;

use hearth_wire::kv_events::{Batch, Event, Medium};
use serde::{Deserialize, Serialize};

use crate::kv_chains::{Chains, Prompt};

/// Blocks a replica's event set holds at most: 4,194,304 tokens in
/// blocks of 16, more than one engine's KV cache today (with their
/// links and the matching's tables, 12.3 MiB at most).
pub const MAX_HELD_BLOCKS: usize = 1 << 18;

/// Why a replica's event figures are not exact.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Inexact {
    /// No batch yet.
    NoBatch,
    /// The first batch seen was not the engine's first (the engine ran
    /// before the feed connected).
    JoinedLate,
    /// A sequence number was skipped: batches were lost.
    Gap,
    /// A frame did not read (its batch is unknown).
    Refused,
    /// More blocks than [`MAX_HELD_BLOCKS`].
    Overflow,
}

impl Inexact {
    pub fn as_str(self) -> &'static str {
        match self {
            Inexact::NoBatch => "no_batch",
            Inexact::JoinedLate => "joined_late",
            Inexact::Gap => "gap",
            Inexact::Refused => "refused",
            Inexact::Overflow => "overflow",
        }
    }
}

/// Batches a replica's turnover log keeps (about 100 KB): a cache's worth
/// of stores within the last this-many batches is what the log can see.
pub const TURNOVER_SAMPLES: usize = 4_096;

/// One batch in the turnover log: the blocks the engine had stored in
/// all by then, and the replica's warmth clock when it was applied.
#[derive(Clone, Copy, Debug)]
struct Turnover {
    stored: u64,
    clock: u32,
}

/// Why the events showed a restart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RestartReason {
    /// The sequence went back: a new engine process.
    Sequence,
    /// `AllBlocksCleared`: the engine emptied its cache.
    Cleared,
}

/// One replica's event feed, as the router knows it.
#[derive(Debug)]
pub(crate) struct KvEvents {
    /// Where the engine said it publishes (`kv_events=auto`), once it has.
    pub(crate) stated_endpoint: Option<String>,
    /// The blocks it holds, with their chains (see [`crate::kv_chains`]).
    held: Chains,
    /// The sequence number the next batch should carry.
    next_seq: Option<u64>,
    inexact: Option<Inexact>,
    connected: bool,
    /// Tokens per block, as the last stored blocks said.
    block_tokens: Option<u64>,
    /// The most blocks held since the cache was last empty.
    peak_held: usize,
    /// The most blocks held when the engine had to remove one.
    capacity_blocks: Option<usize>,
    last_batch: Option<Instant>,
    connects: u64,
    batches: u64,
    events: u64,
    stored_blocks: u64,
    removed_blocks: u64,
    gaps: u64,
    missed_batches: u64,
    refused: u64,
    replayed: u64,
    restarts_sequence: u64,
    restarts_cleared: u64,
    /// Per batch since the cache was last empty (at most
    /// [`TURNOVER_SAMPLES`]): what [`KvEvents::horizon`] reads.
    turnover: VecDeque<Turnover>,
    /// Warmth blocks forgotten because the engine had stored a whole
    /// cache's worth since they were last used.
    forgotten_blocks: u64,
    /// Answers whose prompt was matched with a stored chain, matched
    /// with more than one, or with none.
    matched: u64,
    matched_in_order: u64,
    ambiguous: u64,
    unseen: u64,
}

impl Default for KvEvents {
    fn default() -> Self {
        KvEvents {
            stated_endpoint: None,
            held: Chains::default(),
            next_seq: None,
            inexact: Some(Inexact::NoBatch),
            connected: false,
            block_tokens: None,
            peak_held: 0,
            capacity_blocks: None,
            last_batch: None,
            connects: 0,
            batches: 0,
            events: 0,
            stored_blocks: 0,
            removed_blocks: 0,
            gaps: 0,
            missed_batches: 0,
            refused: 0,
            replayed: 0,
            restarts_sequence: 0,
            restarts_cleared: 0,
            turnover: VecDeque::new(),
            forgotten_blocks: 0,
            matched: 0,
            matched_in_order: 0,
            ambiguous: 0,
            unseen: 0,
        }
    }
}

/// A replica's event feed on `/state`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KvEventsSnapshot {
    /// The feed's endpoint (`tcp://ip:port`, `ipc://path`).
    pub endpoint: String,
    pub connected: bool,
    /// Occupancy and capacity are the engine's own (see the module docs).
    pub exact: bool,
    /// Why not, when not (`disconnected` while the feed is down).
    pub inexact_reason: Option<String>,
    /// Blocks the engine holds, as its events say.
    pub held_blocks: usize,
    pub block_tokens: Option<u64>,
    /// `held_blocks` in tokens, when exact.
    pub occupancy_tokens: Option<u64>,
    /// The most tokens it held when it first had to remove a block.
    pub capacity_tokens: Option<u64>,
    /// The last batch's sequence number.
    pub sequence: Option<u64>,
    pub last_batch_age_s: Option<f64>,
    pub connects_total: u64,
    pub batches_total: u64,
    pub events_total: u64,
    pub stored_blocks_total: u64,
    pub removed_blocks_total: u64,
    /// Sequence gaps, and the batches they skipped.
    pub gaps_total: u64,
    pub missed_batches_total: u64,
    /// Frames that did not read.
    pub refused_total: u64,
    /// Missed batches its replay socket sent again (applied in order, so
    /// no gap).
    #[serde(default)]
    pub replayed_batches_total: u64,
    /// Restarts the events showed: the sequence went back, or the cache
    /// was cleared.
    pub restarts_sequence_total: u64,
    pub restarts_cleared_total: u64,
    /// Warmth blocks forgotten because the engine had stored a whole
    /// cache's worth since Hearth last sent them there (evicted, by the
    /// engine's own count, before the next turn asks).
    #[serde(default)]
    pub forgotten_blocks_total: u64,
    /// Prompts matched with the chain the engine stored for them (so the
    /// conversation's next turn here is predicted from what the engine
    /// still holds of it), of them matched in order among prompts of one
    /// shape; prompts given up on because more than one chain fitted, or
    /// none did (see [`crate::kv_chains`]).
    #[serde(default)]
    pub matched_prompts_total: u64,
    #[serde(default)]
    pub matched_in_order_prompts_total: u64,
    #[serde(default)]
    pub ambiguous_prompts_total: u64,
    #[serde(default)]
    pub unmatched_prompts_total: u64,
}

impl KvEvents {
    pub(crate) fn note_connection(&mut self, connected: bool) {
        if connected && !self.connected {
            self.connects += 1;
        }
        self.connected = connected;
    }

    /// The sequence number the next batch should carry.
    pub(crate) fn expected_seq(&self) -> Option<u64> {
        self.next_seq
    }

    pub(crate) fn note_replayed(&mut self, batches: u64) {
        self.replayed = self.replayed.saturating_add(batches);
    }

    /// A frame that did not read: whatever it held is unknown.
    pub(crate) fn note_refused(&mut self) {
        self.refused += 1;
        self.mark(Inexact::Refused);
        // Its sequence may or may not have been used: the next one is
        // taken as it comes.
        self.next_seq = None;
    }

    fn mark(&mut self, why: Inexact) {
        if self.inexact.is_none() {
            self.inexact = Some(why);
        }
    }

    /// The cache is empty now: what follows is the whole of it.
    fn empty(&mut self) {
        self.held.clear();
        self.peak_held = 0;
        self.inexact = None;
        self.turnover.clear();
    }

    /// Notes, after a batch, the blocks stored in all and the replica's
    /// warmth clock `clock` (see [`crate::warmth::LruBlocks::clock`]).
    pub(crate) fn note_turnover(&mut self, clock: u32) {
        if self.turnover.len() >= TURNOVER_SAMPLES {
            self.turnover.pop_front();
        }
        self.turnover.push_back(Turnover {
            stored: self.stored_blocks,
            clock,
        });
    }

    /// The warmth clock as of the last batch after which the engine has
    /// stored a whole cache's worth of blocks (its capacity, as its
    /// events showed it): an engine that evicts least recently used
    /// blocks first holds nothing last used before then. Known only while
    /// the figures are exact and the capacity shown; `None` also while
    /// the log does not reach back that far.
    pub(crate) fn horizon(&self) -> Option<u32> {
        if self.inexact.is_some() || !self.connected {
            return None;
        }
        let capacity = self.capacity_blocks.filter(|&c| c > 0)? as u64;
        let since = self.stored_blocks.checked_sub(capacity)?;
        // The stored totals only grow: the last sample at or under `since`.
        let after = self.turnover.partition_point(|t| t.stored <= since);
        Some(self.turnover.get(after.checked_sub(1)?)?.clock)
    }

    /// `n` warmth blocks were forgotten by [`KvEvents::horizon`].
    pub(crate) fn note_forgotten(&mut self, n: usize) {
        self.forgotten_blocks = self.forgotten_blocks.saturating_add(n as u64);
    }

    /// Applies batch `seq` at `now`. Returns the restarts it showed, in
    /// order (a cleared cache within a new process counts both).
    pub(crate) fn apply(&mut self, seq: u64, batch: &Batch, now: Instant) -> Vec<RestartReason> {
        let mut restarts = Vec::new();
        self.batches += 1;
        self.last_batch = Some(now);
        match self.next_seq {
            Some(next) if seq < next => {
                restarts.push(RestartReason::Sequence);
                self.restarts_sequence += 1;
                self.capacity_blocks = None;
                self.empty();
                if seq > 0 {
                    // The new process's first batches were missed.
                    self.mark(Inexact::JoinedLate);
                }
            }
            Some(next) if seq > next => {
                self.gaps += 1;
                self.missed_batches = self.missed_batches.saturating_add(seq - next);
                self.mark(Inexact::Gap);
            }
            Some(_) => {}
            None if seq == 0 && self.inexact == Some(Inexact::NoBatch) => self.empty(),
            None => self.mark(Inexact::JoinedLate),
        }
        if self.inexact == Some(Inexact::NoBatch) {
            self.inexact = Some(Inexact::JoinedLate);
        }
        self.next_seq = seq.checked_add(1);
        for event in &batch.events {
            self.events += 1;
            match event {
                Event::Stored {
                    hashes,
                    parent,
                    block_size,
                    medium: Medium::Device,
                    ..
                } => {
                    if (1..=1 << 20).contains(block_size) {
                        self.block_tokens = Some(*block_size);
                    }
                    // Each block's parent is the one before it, the first's
                    // the event's.
                    let mut parent = *parent;
                    for (i, &h) in hashes.iter().enumerate() {
                        if self.inexact == Some(Inexact::Overflow) {
                            break;
                        }
                        if self.held.len() >= MAX_HELD_BLOCKS && !self.held.contains(h) {
                            // Forget the set (its memory too) until the
                            // engine's cache is empty again.
                            self.held.clear();
                            self.inexact = Some(Inexact::Overflow);
                        } else if self.held.store(h, parent, i + 1 == hashes.len(), now) {
                            self.stored_blocks += 1;
                        }
                        parent = Some(h);
                    }
                    self.peak_held = self.peak_held.max(self.held.len());
                }
                Event::Removed {
                    hashes,
                    medium: Medium::Device,
                } => {
                    let before = self.held.len();
                    for &h in hashes {
                        if self.held.remove(h) {
                            self.removed_blocks += 1;
                        }
                    }
                    // An engine removes a cached block only to reuse it:
                    // it was full.
                    if self.inexact.is_none() && self.held.len() < before {
                        self.capacity_blocks =
                            Some(self.capacity_blocks.unwrap_or(0).max(self.peak_held));
                    }
                }
                Event::AllCleared => {
                    restarts.push(RestartReason::Cleared);
                    self.restarts_cleared += 1;
                    self.empty();
                }
                // Blocks an offloading tier holds are not the engine's
                // KV cache.
                Event::Stored { .. } | Event::Removed { .. } => {}
            }
        }
        self.held.settle();
        restarts
    }

    /// The figures are the engine's own (see the module docs).
    pub(crate) fn is_exact(&self) -> bool {
        self.exact_blocks().is_some()
    }

    /// Figures that are the engine's own, in tokens a block.
    fn exact_blocks(&self) -> Option<u64> {
        self.block_tokens
            .filter(|_| self.connected && self.inexact.is_none())
    }

    /// Matches prompt `id` (its tip), decided at `since`, with the chain
    /// the engine stored for it: `usage` is its answer's prompt and cached
    /// tokens, read at `now`; `previous` the engine tip of the turn it
    /// continues here; `cold`: its decision credited this replica with
    /// nothing of it (see [`crate::kv_chains`]). Returns the prompts
    /// matched now (this one, or waiting ones it settled) with their
    /// engine tips; nothing unless the figures are exact.
    pub(crate) fn match_prompt(
        &mut self,
        id: u64,
        since: Instant,
        usage: (u64, u64),
        (previous, cold): (Option<u64>, bool),
        now: Instant,
    ) -> Vec<(u64, u64)> {
        let Some(block) = self.exact_blocks() else {
            return Vec::new();
        };
        let whole = |t: u64| u32::try_from(t / block).unwrap_or(u32::MAX);
        let prompt = Prompt {
            id,
            since,
            blocks: whole(usage.0),
            cached: whole(usage.1),
            previous,
            cold,
        };
        let found = self.held.match_prompt(prompt, now);
        self.matched += found.tips.len() as u64;
        self.matched_in_order += found.in_order;
        self.ambiguous += found.ambiguous;
        self.unseen += found.unseen;
        found.tips
    }

    /// Tokens a prompt with no history on this replica finds in its cache:
    /// the root the last such prompts hung off, while the engine holds it
    /// and the figures are exact ([`Chains::cold_root`]).
    pub(crate) fn cold_root_tokens(&self) -> Option<u64> {
        let block = self.exact_blocks()?;
        Some(u64::from(self.held.cold_root()?) * block)
    }

    /// Tokens of a prompt of `prompt_tokens` whose chain ends at engine
    /// tip `tip` that the engine still holds, when it has freed some of
    /// its whole blocks (and the figures are exact).
    pub(crate) fn evicted_from(&self, tip: u64, prompt_tokens: u64) -> Option<u64> {
        let block = self.exact_blocks()?;
        let left = self.resident_tokens(tip)?;
        (left < prompt_tokens / block * block).then_some(left)
    }

    /// Tokens of the chain ending at engine tip `tip` the engine still
    /// holds (whole blocks from its root), while the figures are exact.
    pub(crate) fn resident_tokens(&self, tip: u64) -> Option<u64> {
        let block = self.exact_blocks()?;
        Some(u64::from(self.held.resident(tip)?) * block)
    }

    /// The engine's capacity in tokens, as its events showed it.
    pub(crate) fn capacity_tokens(&self) -> Option<f64> {
        Some((self.capacity_blocks? as u64 * self.block_tokens?) as f64)
    }

    pub(crate) fn snapshot(&self, endpoint: String, now: Instant) -> KvEventsSnapshot {
        let exact = self.connected && self.inexact.is_none();
        let reason = match self.inexact {
            _ if !self.connected => Some("disconnected".to_owned()),
            Some(why) => Some(why.as_str().to_owned()),
            None => None,
        };
        KvEventsSnapshot {
            endpoint,
            connected: self.connected,
            exact,
            inexact_reason: reason,
            held_blocks: self.held.len(),
            block_tokens: self.block_tokens,
            occupancy_tokens: self
                .block_tokens
                .filter(|_| exact)
                .map(|b| b * self.held.len() as u64),
            capacity_tokens: self.capacity_tokens().map(|t| t as u64),
            sequence: self.next_seq.map(|n| n - 1),
            last_batch_age_s: self
                .last_batch
                .map(|t| now.saturating_duration_since(t).as_secs_f64()),
            connects_total: self.connects,
            batches_total: self.batches,
            events_total: self.events,
            stored_blocks_total: self.stored_blocks,
            removed_blocks_total: self.removed_blocks,
            gaps_total: self.gaps,
            missed_batches_total: self.missed_batches,
            refused_total: self.refused,
            replayed_batches_total: self.replayed,
            restarts_sequence_total: self.restarts_sequence,
            restarts_cleared_total: self.restarts_cleared,
            forgotten_blocks_total: self.forgotten_blocks,
            matched_prompts_total: self.matched,
            matched_in_order_prompts_total: self.matched_in_order,
            ambiguous_prompts_total: self.ambiguous,
            unmatched_prompts_total: self.unseen,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(hashes: &[u64]) -> Event {
        Event::Stored {
            hashes: hashes.to_vec(),
            parent: None,
            tokens: 16 * hashes.len() as u64,
            block_size: 16,
            medium: Medium::Device,
        }
    }

    fn removed(hashes: &[u64]) -> Event {
        Event::Removed {
            hashes: hashes.to_vec(),
            medium: Medium::Device,
        }
    }

    fn batch(events: Vec<Event>) -> Batch {
        Batch {
            ts: 0.0,
            events,
            data_parallel_rank: Some(0),
        }
    }

    #[test]
    fn occupancy_is_stored_minus_removed_and_capacity_shows_at_the_first_eviction() {
        let now = Instant::now();
        let mut k = KvEvents::default();
        k.note_connection(true);
        assert!(k.apply(0, &batch(vec![stored(&[1, 2, 3])]), now).is_empty());
        // vLLM reports reused blocks as stored again: counted once.
        k.apply(1, &batch(vec![stored(&[1, 2, 3, 4])]), now);
        let s = k.snapshot("tcp://x".into(), now);
        assert!(s.exact);
        assert_eq!((s.held_blocks, s.occupancy_tokens), (4, Some(64)));
        assert_eq!((s.stored_blocks_total, s.capacity_tokens), (4, None));
        // Removing a block it never stored changes nothing.
        k.apply(2, &batch(vec![removed(&[99]), removed(&[3, 4])]), now);
        let s = k.snapshot("tcp://x".into(), now);
        assert_eq!((s.held_blocks, s.removed_blocks_total), (2, 2));
        assert_eq!(s.capacity_tokens, Some(64));
        // Offloaded blocks are not the engine's cache.
        k.apply(
            3,
            &batch(vec![Event::Stored {
                hashes: vec![7],
                parent: None,
                tokens: 16,
                block_size: 16,
                medium: Medium::Offloaded,
            }]),
            now,
        );
        assert_eq!(k.snapshot("x".into(), now).held_blocks, 2);
        k.note_connection(false);
        let s = k.snapshot("x".into(), now);
        assert!(!s.exact);
        assert_eq!(s.inexact_reason.as_deref(), Some("disconnected"));
        // Reconnected with nothing missed: exact again.
        k.note_connection(true);
        k.apply(4, &batch(vec![]), now);
        assert!(k.snapshot("x".into(), now).exact);
    }

    #[test]
    fn gaps_joining_late_and_refused_frames_make_it_inexact_until_the_cache_empties() {
        let now = Instant::now();
        let mut k = KvEvents::default();
        k.note_connection(true);
        k.apply(40, &batch(vec![stored(&[1])]), now);
        let s = k.snapshot("x".into(), now);
        assert_eq!(s.inexact_reason.as_deref(), Some("joined_late"));
        assert_eq!(s.occupancy_tokens, None);
        let r = k.apply(41, &batch(vec![Event::AllCleared]), now);
        assert_eq!(r, vec![RestartReason::Cleared]);
        assert!(k.snapshot("x".into(), now).exact);
        k.apply(45, &batch(vec![stored(&[2])]), now);
        let s = k.snapshot("x".into(), now);
        assert_eq!((s.gaps_total, s.missed_batches_total), (1, 3));
        assert_eq!(s.inexact_reason.as_deref(), Some("gap"));
        k.note_refused();
        assert_eq!(k.snapshot("x".into(), now).refused_total, 1);
        // The engine restarts: its sequence goes back to 0.
        let r = k.apply(0, &batch(vec![stored(&[5])]), now);
        assert_eq!(
            r,
            Vec::<RestartReason>::new(),
            "after a refused frame, 0 is taken as it comes"
        );
        k.apply(1, &batch(vec![]), now);
        let r = k.apply(0, &batch(vec![stored(&[6])]), now);
        assert_eq!(r, vec![RestartReason::Sequence]);
        let s = k.snapshot("x".into(), now);
        assert!(s.exact);
        assert_eq!((s.held_blocks, s.restarts_sequence_total), (1, 1));
    }

    #[test]
    fn a_sequence_jumping_around_or_a_flood_of_blocks_stays_bounded() {
        let now = Instant::now();
        let mut k = KvEvents::default();
        k.note_connection(true);
        for seq in [5u64, 3, 900, 2, u64::MAX, 0, 7] {
            k.apply(seq, &batch(vec![stored(&[seq])]), now);
        }
        assert!(k.held.len() <= 7);
        let mut k = KvEvents::default();
        k.note_connection(true);
        let flood: Vec<u64> = (0..40_000).collect();
        for seq in 0..8u64 {
            let hashes: Vec<u64> = flood.iter().map(|h| h + seq * 40_000).collect();
            k.apply(seq, &batch(vec![stored(&hashes)]), now);
        }
        assert!(k.held.len() <= MAX_HELD_BLOCKS);
        let s = k.snapshot("x".into(), now);
        assert_eq!(s.inexact_reason.as_deref(), Some("overflow"));
        // Cleared: exact again, from nothing.
        k.apply(8, &batch(vec![Event::AllCleared, stored(&[1])]), now);
        let s = k.snapshot("x".into(), now);
        assert!(s.exact);
        assert_eq!(s.held_blocks, 1);
    }
}

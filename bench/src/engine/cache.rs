//! The simulated engine's prefix cache: chained block hashes over the rendered
//! prompt, kept in an LRU set bounded in blocks.
//!
//! This is the ground truth the router is judged by, so it is deliberately
//! independent of Hearth's own fingerprint format: it hashes the prompt as the
//! engine renders it, not as the filter canonicalises it.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::hash::Hasher;

use hearth_wire::kv_events::{Event, Medium};

/// Chained hashes of every *full* block of `bytes` (`block_bytes` each).
///
/// Block `i`'s hash covers the whole prefix up to and including block `i`, so
/// equal hashes mean equal prefixes and a lookup is a longest-prefix match. A
/// trailing partial block is not cacheable, as in paged-attention engines.
pub fn block_hashes(bytes: &[u8], block_bytes: usize) -> Vec<u64> {
    if block_bytes == 0 {
        return Vec::new();
    }
    let mut prev = 0u64;
    bytes
        .chunks_exact(block_bytes)
        .map(|block| {
            // DefaultHasher::new() has fixed keys: stable within a build,
            // which is all a simulator needs.
            let mut h = DefaultHasher::new();
            h.write_u64(prev);
            h.write(block);
            prev = h.finish();
            prev
        })
        .collect()
}

/// Pinned blocks skipped per insertion before giving up on caching it.
const MAX_PINNED_SKIPS: usize = 256;

/// An LRU set of block hashes with a fixed capacity in blocks.
#[derive(Debug, Clone)]
pub struct PrefixCache {
    capacity_blocks: usize,
    clock: u64,
    /// hash -> last-use tick
    by_hash: HashMap<u64, u64>,
    /// last-use tick -> hash; the first entry is the least recently used.
    by_tick: BTreeMap<u64, u64>,
    /// Blocks in use by running sequences (count of users): never evicted.
    pins: HashMap<u64, u32>,
    /// With KV events on: what entered and left since the last
    /// [`PrefixCache::take_events`], in order, and tokens per block.
    log: Option<(Vec<Event>, u64)>,
    /// While a prompt is admitted with events on: its blocks newly stored
    /// so far (logged together once it is in).
    fresh: Option<HashSet<u64>>,
}

impl PrefixCache {
    /// An empty cache holding at most `capacity_blocks` blocks (0 caches nothing).
    pub fn new(capacity_blocks: usize) -> Self {
        Self {
            capacity_blocks,
            clock: 0,
            by_hash: HashMap::new(),
            by_tick: BTreeMap::new(),
            pins: HashMap::new(),
            log: None,
            fresh: None,
        }
    }

    /// Keeps a log of the blocks that enter and leave, as an engine's KV
    /// cache events (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`)
    /// with `block_tokens` tokens a block.
    pub fn with_events(mut self, block_tokens: usize) -> Self {
        self.log = Some((Vec::new(), block_tokens as u64));
        self
    }

    /// The events since the last call (none without
    /// [`PrefixCache::with_events`]).
    pub fn take_events(&mut self) -> Vec<Event> {
        self.log
            .as_mut()
            .map(|(events, _)| std::mem::take(events))
            .unwrap_or_default()
    }

    /// Logs that `hash` left (consecutive removals share an event), or,
    /// while a prompt is admitted, that it entered.
    fn log(&mut self, hash: u64, stored: bool) {
        if let Some(fresh) = self.fresh.as_mut() {
            // Stored and gone within one prompt: never logged.
            if stored || fresh.remove(&hash) {
                if stored {
                    fresh.insert(hash);
                }
                return;
            }
        }
        let Some((events, _)) = self.log.as_mut() else {
            return;
        };
        match events.last_mut() {
            Some(Event::Removed { hashes, .. }) => hashes.push(hash),
            _ => events.push(Event::Removed {
                hashes: vec![hash],
                medium: Medium::Device,
            }),
        }
    }

    /// Logs the newly stored blocks of `prompt` (`fresh`) in its order, one
    /// event per run of them after its parent, as an engine's step reports
    /// a request's blocks (vLLM's `BlockStored`), after the removals that
    /// made room for them.
    fn log_stored(&mut self, prompt: &[u64], fresh: &HashSet<u64>) {
        let Some((events, block_tokens)) = self.log.as_mut() else {
            return;
        };
        let mut i = 0;
        while i < prompt.len() {
            if !fresh.contains(&prompt[i]) {
                i += 1;
                continue;
            }
            let start = i;
            while i < prompt.len() && fresh.contains(&prompt[i]) {
                i += 1;
            }
            let n = (i - start) as u64;
            events.push(Event::Stored {
                hashes: prompt[start..i].to_vec(),
                parent: start.checked_sub(1).map(|p| prompt[p]),
                tokens: *block_tokens * n,
                block_size: *block_tokens,
                medium: Medium::Device,
            });
        }
    }

    /// Empties the cache, as an engine's prefix-cache reset does: only
    /// when no running sequence uses a block (`false` otherwise, and
    /// nothing changes), logging `AllBlocksCleared`.
    pub fn reset(&mut self) -> bool {
        if !self.pins.is_empty() {
            return false;
        }
        self.by_hash.clear();
        self.by_tick.clear();
        if let Some((events, _)) = self.log.as_mut() {
            events.push(Event::AllCleared);
        }
        true
    }

    /// Drops every block not in use by a running sequence (an engine
    /// restarted, or its cache was reset).
    pub fn flush(&mut self) {
        let pins = &self.pins;
        let gone: Vec<u64> = self
            .by_hash
            .keys()
            .filter(|h| !pins.contains_key(h))
            .copied()
            .collect();
        for h in gone {
            self.by_hash.remove(&h);
            self.log(h, false);
        }
        let by_hash = &self.by_hash;
        self.by_tick.retain(|_, h| by_hash.contains_key(h));
    }

    /// Marks blocks as in use (by a running sequence): they are not evicted
    /// until [`PrefixCache::unpin`] is called as often.
    pub fn pin(&mut self, hashes: &[u64]) {
        for &h in hashes {
            *self.pins.entry(h).or_default() += 1;
        }
    }

    /// Releases a [`PrefixCache::pin`].
    pub fn unpin(&mut self, hashes: &[u64]) {
        for h in hashes {
            if let Some(n) = self.pins.get_mut(h) {
                *n -= 1;
                if *n == 0 {
                    self.pins.remove(h);
                }
            }
        }
    }

    /// Distinct blocks in use by running sequences.
    pub fn pinned_blocks(&self) -> usize {
        self.pins.len()
    }

    /// Maximum number of blocks held.
    pub fn capacity_blocks(&self) -> usize {
        self.capacity_blocks
    }

    /// Number of blocks held now.
    pub fn len(&self) -> usize {
        self.by_hash.len()
    }

    /// True when no block is cached.
    pub fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }

    /// True when the block is cached (does not change recency).
    pub fn contains(&self, hash: u64) -> bool {
        self.by_hash.contains_key(&hash)
    }

    /// Number of leading blocks of `hashes` present in the cache.
    pub fn matched_blocks(&self, hashes: &[u64]) -> usize {
        hashes.iter().take_while(|h| self.contains(**h)).count()
    }

    /// Serve a prompt: returns how many leading blocks were already cached,
    /// then inserts or refreshes all of them.
    ///
    /// Blocks are touched last-to-first, so a prompt's first blocks end up the
    /// most recently used and eviction trims prefixes from the tail, the way
    /// an engine frees a finished sequence's blocks.
    pub fn admit(&mut self, hashes: &[u64]) -> usize {
        let matched = self.matched_blocks(hashes);
        if self.log.is_some() {
            self.fresh = Some(HashSet::new());
        }
        for &h in hashes.iter().rev() {
            self.touch(h);
        }
        if let Some(fresh) = self.fresh.take() {
            self.log_stored(hashes, &fresh);
        }
        matched
    }

    fn touch(&mut self, hash: u64) {
        if self.capacity_blocks == 0 {
            return;
        }
        let tick = self.clock;
        self.clock += 1;
        // A new block is logged as stored once it stays, after the blocks
        // evicted for it: an engine frees a block before it reuses it, so
        // its events never show more blocks than it has.
        let new = match self.by_hash.insert(hash, tick) {
            Some(old) => {
                self.by_tick.remove(&old);
                false
            }
            None => true,
        };
        self.by_tick.insert(tick, hash);
        // Pinned blocks are skipped (moved to the recent end). After a
        // bounded number of skips (or when pins fill the cache) the block
        // just touched goes instead, unless it is pinned itself: an engine
        // whose KV is full of running sequences keeps no new prefixes.
        let mut skipped = 0;
        while self.by_hash.len() > self.capacity_blocks {
            if skipped >= MAX_PINNED_SKIPS.min(self.by_tick.len())
                || self.pins.len() >= self.capacity_blocks
            {
                if !self.pins.contains_key(&hash) {
                    if let Some(t) = self.by_hash.remove(&hash) {
                        self.by_tick.remove(&t);
                        if !new {
                            self.log(hash, false);
                        }
                    }
                }
                break;
            }
            let Some((_, evicted)) = self.by_tick.pop_first() else {
                break;
            };
            if self.pins.contains_key(&evicted) {
                skipped += 1;
                let tick = self.clock;
                self.clock += 1;
                self.by_hash.insert(evicted, tick);
                self.by_tick.insert(tick, evicted);
            } else {
                self.by_hash.remove(&evicted);
                if !(new && evicted == hash) {
                    self.log(evicted, false);
                }
            }
        }
        if new && self.by_hash.contains_key(&hash) {
            self.log(hash, true);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_chain_over_full_blocks_only() {
        let a = block_hashes(b"aaaabbbbcc", 4);
        assert_eq!(a.len(), 2);
        let b = block_hashes(b"aaaabbbbccccdd", 4);
        assert_eq!(&b[..2], &a[..]);
        // Same second block after a different first block: different hash.
        let c = block_hashes(b"xxxxbbbb", 4);
        assert_ne!(c[1], a[1]);
        assert!(block_hashes(b"abc", 0).is_empty());
    }

    #[test]
    fn admit_reports_leading_matches() {
        let mut cache = PrefixCache::new(100);
        let a = block_hashes(&[1u8; 64], 8);
        assert_eq!(cache.admit(&a), 0);
        assert_eq!(cache.admit(&a), 8);
        let mut b = a[..5].to_vec();
        b.push(42);
        assert_eq!(cache.admit(&b), 5);
        // A gap stops the match even if later blocks are present.
        assert_eq!(cache.matched_blocks(&[7, a[0]]), 0);
    }

    #[test]
    fn a_flush_keeps_only_the_running_blocks() {
        let mut cache = PrefixCache::new(100);
        cache.admit(&[1, 2, 3]);
        cache.admit(&[7, 8]);
        cache.pin(&[7, 8]);
        cache.flush();
        assert_eq!(cache.len(), 2);
        assert_eq!(cache.matched_blocks(&[1, 2, 3]), 0);
        assert_eq!(cache.matched_blocks(&[7, 8]), 2);
        cache.unpin(&[7, 8]);
        cache.admit(&[1]);
        assert_eq!(cache.len(), 3);
    }

    #[test]
    fn eviction_trims_tails_first() {
        let mut cache = PrefixCache::new(4);
        cache.admit(&[1, 2, 3, 4]);
        assert_eq!(cache.len(), 4);
        // A new two-block prompt evicts the two tail blocks of the first one.
        cache.admit(&[10, 11]);
        assert_eq!(cache.len(), 4);
        assert!(cache.contains(1) && cache.contains(2));
        assert!(!cache.contains(3) && !cache.contains(4));
        assert_eq!(cache.matched_blocks(&[1, 2, 3, 4]), 2);
        // A prompt longer than the cache keeps its first blocks.
        cache.admit(&[20, 21, 22, 23, 24, 25]);
        assert_eq!(cache.matched_blocks(&[20, 21, 22, 23, 24, 25]), 4);
    }

    #[test]
    fn pinned_blocks_are_not_evicted() {
        let mut cache = PrefixCache::new(4);
        cache.admit(&[1, 2, 3, 4]);
        cache.pin(&[1, 2, 3, 4]);
        assert_eq!(cache.pinned_blocks(), 4);
        cache.admit(&[10, 11]);
        // Only the new blocks are evictable: the pinned prompt stays whole.
        assert_eq!(cache.matched_blocks(&[1, 2, 3, 4]), 4);
        cache.unpin(&[1, 2, 3, 4]);
        assert_eq!(cache.pinned_blocks(), 0);
        cache.admit(&[20, 21, 22, 23]);
        assert_eq!(cache.len(), 4);
        assert_eq!(cache.matched_blocks(&[1]), 0);
    }

    /// Replays `events` into a set: what a subscriber would hold.
    fn held_by(events: &[Event], held: &mut std::collections::HashSet<u64>) {
        for e in events {
            match e {
                Event::Stored { hashes, .. } => held.extend(hashes),
                Event::Removed { hashes, .. } => {
                    for h in hashes {
                        held.remove(h);
                    }
                }
                Event::AllCleared => held.clear(),
            }
        }
    }

    #[test]
    fn the_event_log_tells_what_the_cache_holds() {
        let mut cache = PrefixCache::new(6).with_events(16);
        let mut held = std::collections::HashSet::new();
        cache.admit(&[1, 2, 3, 4]);
        let first = cache.take_events();
        // One event for the prompt's new blocks, in its order.
        assert!(matches!(
            &first[..],
            [Event::Stored { hashes, parent: None, tokens: 64, block_size: 16, .. }] if hashes == &[1, 2, 3, 4]
        ));
        held_by(&first, &mut held);
        cache.pin(&[1, 2]);
        for prompt in [
            &[10u64, 11, 12][..],
            &[20, 21, 22, 23, 24, 25, 26],
            &[1, 2, 30],
        ] {
            cache.admit(prompt);
            held_by(&cache.take_events(), &mut held);
            let mut now: Vec<u64> = cache.by_hash.keys().copied().collect();
            let mut told: Vec<u64> = held.iter().copied().collect();
            now.sort_unstable();
            told.sort_unstable();
            assert_eq!(now, told);
        }
        // Replayed one event at a time, the log never holds more than the
        // cache can.
        let mut c = PrefixCache::new(3).with_events(16);
        let mut held = std::collections::HashSet::new();
        for k in 0..5u64 {
            c.admit(&[10 * k, 10 * k + 1]);
            for e in c.take_events() {
                held_by(&[e], &mut held);
                assert!(held.len() <= 3, "{held:?}");
            }
        }
        assert!(!cache.reset(), "blocks in use");
        cache.flush();
        held_by(&cache.take_events(), &mut held);
        assert_eq!(held.len(), cache.len());
        cache.unpin(&[1, 2]);
        assert!(cache.reset());
        assert_eq!(cache.take_events(), vec![Event::AllCleared]);
        assert!(cache.is_empty());
        assert!(PrefixCache::new(4).take_events().is_empty());
    }

    #[test]
    fn zero_capacity_caches_nothing() {
        let mut cache = PrefixCache::new(0);
        assert_eq!(cache.admit(&[1, 2]), 0);
        assert_eq!(cache.admit(&[1, 2]), 0);
        assert!(cache.is_empty());
    }
}

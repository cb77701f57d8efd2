//! The simulated engine's prefix cache: chained block hashes over the rendered
//! prompt, kept in an LRU set bounded in blocks.
//!
//! This is the ground truth the router is judged by, so it is deliberately
//! independent of Hearth's own fingerprint format: it hashes the prompt as the
//! engine renders it, not as the filter canonicalises it.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, HashMap};
use std::hash::Hasher;

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
        }
    }

    /// Drops every block not in use by a running sequence (an engine
    /// restarted, or its cache was reset).
    pub fn flush(&mut self) {
        let pins = &self.pins;
        self.by_hash.retain(|h, _| pins.contains_key(h));
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
        for &h in hashes.iter().rev() {
            self.touch(h);
        }
        matched
    }

    fn touch(&mut self, hash: u64) {
        if self.capacity_blocks == 0 {
            return;
        }
        let tick = self.clock;
        self.clock += 1;
        if let Some(old) = self.by_hash.insert(hash, tick) {
            self.by_tick.remove(&old);
        }
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
            }
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

    #[test]
    fn zero_capacity_caches_nothing() {
        let mut cache = PrefixCache::new(0);
        assert_eq!(cache.admit(&[1, 2]), 0);
        assert_eq!(cache.admit(&[1, 2]), 0);
        assert!(cache.is_empty());
    }
}

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

/// An LRU set of block hashes with a fixed capacity in blocks.
#[derive(Debug, Clone)]
pub struct PrefixCache {
    capacity_blocks: usize,
    clock: u64,
    /// hash -> last-use tick
    by_hash: HashMap<u64, u64>,
    /// last-use tick -> hash; the first entry is the least recently used.
    by_tick: BTreeMap<u64, u64>,
}

impl PrefixCache {
    /// An empty cache holding at most `capacity_blocks` blocks (0 caches nothing).
    pub fn new(capacity_blocks: usize) -> Self {
        Self {
            capacity_blocks,
            clock: 0,
            by_hash: HashMap::new(),
            by_tick: BTreeMap::new(),
        }
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
        while self.by_hash.len() > self.capacity_blocks {
            match self.by_tick.pop_first() {
                Some((_, evicted)) => {
                    self.by_hash.remove(&evicted);
                }
                None => break,
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
    fn zero_capacity_caches_nothing() {
        let mut cache = PrefixCache::new(0);
        assert_eq!(cache.admit(&[1, 2]), 0);
        assert_eq!(cache.admit(&[1, 2]), 0);
        assert!(cache.is_empty());
    }
}

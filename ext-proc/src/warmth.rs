//! Per-replica warmth: which prompt-prefix blocks a replica has recently read.
//!
//! Each replica gets a bounded LRU set of block hashes. Because block hashes
//! are chained (block *i*'s hash names the whole prefix up to it), the number
//! of leading blocks of a request found in a replica's set is its longest
//! common prefix with what the replica has read.
//!
//! Blocks of one request are touched from last to first, so the first blocks
//! of a prefix are the most recently used and eviction removes the tails of
//! old conversations first, the way engines free their KV blocks.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Block hashes are already well-mixed FNV-1a outputs; hashing them again
/// with SipHash would only cost time.
#[derive(Default)]
pub struct BlockHasher(u64);

impl Hasher for BlockHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, v: u64) {
        // One multiply spreads the low bits the table uses.
        self.0 = v.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (v >> 29);
    }
}

type BlockMap<V> = HashMap<u64, V, BuildHasherDefault<BlockHasher>>;

const NIL: u32 = u32::MAX;

#[derive(Clone, Copy)]
struct Node {
    hash: u64,
    prev: u32,
    next: u32,
}

/// A bounded LRU set of block hashes (a hash map into an intrusive list kept
/// in one vector, so memory is allocated once, up front as it grows).
pub struct LruBlocks {
    capacity: usize,
    slots: BlockMap<u32>,
    nodes: Vec<Node>,
    /// Most recently used.
    head: u32,
    /// Least recently used: evicted first.
    tail: u32,
}

impl LruBlocks {
    /// A set holding at most `capacity` blocks (at least one).
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.clamp(1, NIL as usize - 1);
        LruBlocks {
            capacity,
            slots: BlockMap::default(),
            nodes: Vec::new(),
            head: NIL,
            tail: NIL,
        }
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn contains(&self, hash: u64) -> bool {
        self.slots.contains_key(&hash)
    }

    /// Bytes held by this set's tables (reported on the state endpoint).
    pub fn memory_bytes(&self) -> usize {
        let map_entry = std::mem::size_of::<(u64, u32)>() + 1;
        self.slots.capacity() * map_entry + self.nodes.capacity() * std::mem::size_of::<Node>()
    }

    /// Number of leading `hashes` present: the replica's prefix overlap.
    pub fn leading_overlap(&self, hashes: &[u64]) -> usize {
        hashes.iter().take_while(|h| self.contains(**h)).count()
    }

    /// Marks `hash` as most recently used, inserting it (and evicting the
    /// least recently used block when full) if absent.
    pub fn touch(&mut self, hash: u64) {
        if let Some(&slot) = self.slots.get(&hash) {
            self.unlink(slot);
            self.push_front(slot);
            return;
        }
        let slot = if self.slots.len() >= self.capacity {
            let victim = self.tail;
            self.unlink(victim);
            let old = self.nodes[victim as usize].hash;
            self.slots.remove(&old);
            self.nodes[victim as usize].hash = hash;
            victim
        } else {
            self.nodes.push(Node {
                hash,
                prev: NIL,
                next: NIL,
            });
            (self.nodes.len() - 1) as u32
        };
        self.slots.insert(hash, slot);
        self.push_front(slot);
    }

    /// Records that a replica read the prompt named by `hashes`: touched from
    /// last to first so the prefix's first blocks are the most recent.
    pub fn record_prompt(&mut self, hashes: &[u64]) {
        for &h in hashes.iter().rev() {
            self.touch(h);
        }
    }

    pub fn clear(&mut self) {
        self.slots.clear();
        self.nodes.clear();
        self.head = NIL;
        self.tail = NIL;
    }

    fn unlink(&mut self, slot: u32) {
        let Node { prev, next, .. } = self.nodes[slot as usize];
        if prev == NIL {
            self.head = next;
        } else {
            self.nodes[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.nodes[next as usize].prev = prev;
        }
    }

    fn push_front(&mut self, slot: u32) {
        let old_head = self.head;
        {
            let node = &mut self.nodes[slot as usize];
            node.prev = NIL;
            node.next = old_head;
        }
        if old_head == NIL {
            self.tail = slot;
        } else {
            self.nodes[old_head as usize].prev = slot;
        }
        self.head = slot;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlap_counts_leading_blocks_only() {
        let mut lru = LruBlocks::new(100);
        lru.record_prompt(&[1, 2, 3]);
        assert_eq!(lru.leading_overlap(&[1, 2, 3, 4]), 3);
        assert_eq!(lru.leading_overlap(&[1, 9, 3]), 1);
        assert_eq!(lru.leading_overlap(&[9, 1, 2]), 0);
        assert_eq!(lru.leading_overlap(&[]), 0);
    }

    #[test]
    fn evicts_least_recent_and_tails_first() {
        let mut lru = LruBlocks::new(4);
        lru.record_prompt(&[1, 2, 3]);
        // A second prompt of two blocks pushes out the oldest: the tail (3),
        // then the next tail (2); the prefix head (1) survives.
        lru.record_prompt(&[10, 11]);
        assert_eq!(lru.len(), 4);
        assert!(lru.contains(1) && lru.contains(2));
        assert!(!lru.contains(3));
        lru.record_prompt(&[20]);
        assert!(!lru.contains(2));
        assert!(lru.contains(1));
        assert_eq!(lru.leading_overlap(&[1, 2, 3]), 1);
    }

    #[test]
    fn touching_a_present_block_refreshes_it() {
        let mut lru = LruBlocks::new(2);
        lru.touch(1);
        lru.touch(2);
        lru.touch(1);
        lru.touch(3); // evicts 2, the least recent
        assert!(lru.contains(1) && lru.contains(3) && !lru.contains(2));
        assert_eq!(lru.len(), 2);
    }

    proptest::proptest! {
        #[test]
        fn never_exceeds_capacity_and_matches_a_model(cap in 1usize..16, ops in proptest::collection::vec(0u64..24, 0..200)) {
            let mut lru = LruBlocks::new(cap);
            let mut model: Vec<u64> = Vec::new(); // front = most recent
            for h in ops {
                lru.touch(h);
                model.retain(|x| *x != h);
                model.insert(0, h);
                model.truncate(cap);
                proptest::prop_assert!(lru.len() <= cap);
                proptest::prop_assert_eq!(lru.len(), model.len());
                for m in &model {
                    proptest::prop_assert!(lru.contains(*m));
                }
            }
        }
    }
}

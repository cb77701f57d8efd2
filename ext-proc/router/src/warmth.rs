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
//!
//! That order also makes every set *prefix-closed*: block *i* of a chain is
//! only ever recorded together with blocks *0..i*, which are touched after
//! it, so they are always more recent and outlive it. If block *i* is
//! present, so is every block before it, and the overlap is found by a
//! binary search (about 9 lookups for 256 blocks) instead of a scan.

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};

/// Block hashes name clients' prompts, so a client chooses them: with a
/// fixed table hash, prompts could be crafted whose blocks all land in a
/// few buckets, and every lookup in a replica's index would crawl. So each
/// table keys its hash with a seed and a multiplier drawn from the
/// process's random keys (std's `RandomState`), which no client sees; one
/// 64x64->128-bit multiply folded in half mixes a key with them, as fast
/// as the fixed multiply it replaced (SipHash would cost more, and block
/// hashes are already well-mixed FNV-1a outputs).
#[derive(Clone, Copy, Debug)]
pub struct BlockHashState {
    seed: u64,
    multiplier: u64,
}

impl Default for BlockHashState {
    fn default() -> Self {
        let draw = |n: u64| {
            let mut h = RandomState::new().build_hasher();
            h.write_u64(n);
            h.finish()
        };
        BlockHashState {
            seed: draw(0),
            // Odd: the multiply loses no bit of the key.
            multiplier: draw(1) | 1,
        }
    }
}

impl BuildHasher for BlockHashState {
    type Hasher = BlockHasher;
    fn build_hasher(&self) -> BlockHasher {
        BlockHasher {
            state: self.seed,
            multiplier: self.multiplier,
        }
    }
}

/// The hasher of [`BlockHashState`].
pub struct BlockHasher {
    state: u64,
    multiplier: u64,
}

impl Hasher for BlockHasher {
    fn finish(&self) -> u64 {
        // One more folded multiply, of the state turned half-way round: the
        // low bits a table indexes by then depend on every bit of the key
        // (after the first, keys that differ only in their high bits can
        // share low bits for some multipliers).
        let product = u128::from(self.state.rotate_left(32)) * u128::from(self.multiplier);
        (product as u64) ^ ((product >> 64) as u64)
    }
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word));
        }
    }
    fn write_u64(&mut self, v: u64) {
        let product = u128::from(self.state ^ v) * u128::from(self.multiplier);
        self.state = (product as u64) ^ ((product >> 64) as u64);
    }
}

pub(crate) type BlockMap<V> = HashMap<u64, V, BlockHashState>;

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
    /// Node slots freed by a shrink, reused before the vector grows.
    free: Vec<u32>,
    /// Per node, the clock when it last came to the front (wrapping):
    /// how many blocks are more recent than one is the walk from the head
    /// to the first that is not newer.
    stamps: Vec<u32>,
    clock: u32,
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
            free: Vec::new(),
            stamps: Vec::new(),
            clock: 0,
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
        self.slots.capacity() * map_entry
            + self.nodes.capacity() * std::mem::size_of::<Node>()
            + self.stamps.capacity() * std::mem::size_of::<u32>()
    }

    /// Number of leading `hashes` present: the replica's prefix overlap.
    ///
    /// Relies on the set being prefix-closed for chains (see the module
    /// docs), which holds when blocks enter only through
    /// [`LruBlocks::record_prompt`]: a binary search for the first absent
    /// block, checking the whole chain first (a returning session).
    pub fn leading_overlap(&self, hashes: &[u64]) -> usize {
        let Some((&last, _)) = hashes.split_last() else {
            return 0;
        };
        if self.contains(last) {
            return hashes.len();
        }
        // hashes[..lo] are present, hashes[hi] is absent.
        let (mut lo, mut hi) = (0, hashes.len() - 1);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if hashes.get(mid).is_some_and(|h| self.contains(*h)) {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        lo
    }

    /// [`LruBlocks::leading_overlap`] of `hashes` against many sets at once.
    ///
    /// The binary searches run in lockstep: each round probes every set
    /// once, and those probes do not depend on each other, so the CPU
    /// overlaps their cache misses (each set is megabytes; a probe is a
    /// trip to memory) instead of waiting for them one by one.
    pub fn leading_overlaps(sets: &[&LruBlocks], hashes: &[u64]) -> Vec<usize> {
        let n = hashes.len();
        let Some(&last) = hashes.last() else {
            return vec![0; sets.len()];
        };
        // Per set: (lo, hi) with hashes[..lo] present and hashes[hi] absent;
        // lo == hi is settled.
        let mut bounds: Vec<(usize, usize)> = sets
            .iter()
            .map(|s| if s.contains(last) { (n, n) } else { (0, n - 1) })
            .collect();
        loop {
            let mut open = false;
            for (set, (lo, hi)) in sets.iter().zip(bounds.iter_mut()) {
                if lo < hi {
                    let mid = *lo + (*hi - *lo) / 2;
                    if hashes.get(mid).is_some_and(|h| set.contains(*h)) {
                        *lo = mid + 1;
                    } else {
                        *hi = mid;
                    }
                    open |= lo < hi;
                }
            }
            if !open {
                break;
            }
        }
        bounds.into_iter().map(|(lo, _)| lo).collect()
    }

    /// The overlap by a plain scan, for any set: the tests' reference for
    /// the binary search.
    #[cfg(test)]
    fn leading_overlap_scan(&self, hashes: &[u64]) -> usize {
        hashes.iter().take_while(|h| self.contains(**h)).count()
    }

    /// Marks `hash` as most recently used, inserting it (and evicting the
    /// least recently used block when full) if absent.
    pub fn touch(&mut self, hash: u64) {
        self.touch_evicting(hash);
    }

    /// As [`LruBlocks::touch`], returning the block evicted to make room.
    pub fn touch_evicting(&mut self, hash: u64) -> Option<u64> {
        if let Some(&slot) = self.slots.get(&hash) {
            self.unlink(slot);
            self.push_front(slot);
            return None;
        }
        let mut evicted = None;
        let slot = if self.slots.len() >= self.capacity {
            let victim = self.tail;
            self.unlink(victim);
            let old = self.nodes[victim as usize].hash;
            self.slots.remove(&old);
            evicted = Some(old);
            self.nodes[victim as usize].hash = hash;
            victim
        } else if let Some(slot) = self.free.pop() {
            self.nodes[slot as usize].hash = hash;
            slot
        } else {
            self.nodes.push(Node {
                hash,
                prev: NIL,
                next: NIL,
            });
            self.stamps.push(0);
            (self.nodes.len() - 1) as u32
        };
        self.slots.insert(hash, slot);
        self.push_front(slot);
        evicted
    }

    /// Records that a replica read the prompt named by `hashes`: touched from
    /// last to first so the prefix's first blocks are the most recent.
    pub fn record_prompt(&mut self, hashes: &[u64]) {
        // Look every block up first: the lookups are independent, so their
        // cache misses overlap, where touching one by one would wait for
        // each. A slot found here may be recycled by an eviction below (a
        // block of this very prompt at the LRU tail), so it is re-checked.
        let found: Vec<Option<u32>> = hashes.iter().map(|h| self.slots.get(h).copied()).collect();
        for (&h, slot) in hashes.iter().zip(found).rev() {
            match slot {
                Some(slot) if self.nodes.get(slot as usize).is_some_and(|n| n.hash == h) => {
                    self.unlink(slot);
                    self.push_front(slot);
                }
                _ => self.touch(h),
            }
        }
    }

    /// The blocks held, least recently used first (replaying them with
    /// [`LruBlocks::touch`] in this order rebuilds the same recency).
    pub fn oldest_first(&self) -> impl Iterator<Item = u64> + '_ {
        let mut at = self.tail;
        std::iter::from_fn(move || {
            let node = self.nodes.get(at as usize)?;
            at = node.prev;
            Some(node.hash)
        })
    }

    pub fn clear(&mut self) {
        self.slots.clear();
        self.nodes.clear();
        self.free.clear();
        self.stamps.clear();
        self.head = NIL;
        self.tail = NIL;
    }

    /// Holds at most `capacity` blocks from now on (at least one), evicting
    /// the least recent ones beyond it.
    pub fn set_capacity(&mut self, capacity: usize) {
        self.capacity = capacity.clamp(1, NIL as usize - 1);
        while self.slots.len() > self.capacity {
            self.drop_tail();
        }
    }

    /// Drops the least recent block (there is one), its slot kept for
    /// reuse.
    fn drop_tail(&mut self) {
        let victim = self.tail;
        self.unlink(victim);
        let old = self.nodes[victim as usize].hash;
        self.slots.remove(&old);
        self.free.push(victim);
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

    /// The clock now: the stamp of the most recent use.
    pub fn clock(&self) -> u32 {
        self.clock
    }

    /// Forgets every block last used when the clock read `stamp` or
    /// earlier, least recent first (so the set stays prefix-closed);
    /// returns how many.
    pub fn forget_not_newer_than(&mut self, stamp: u32) -> usize {
        let mut n = 0;
        while self.tail != NIL {
            let age = self.stamps[self.tail as usize].wrapping_sub(stamp);
            if age != 0 && age <= u32::MAX / 2 {
                break;
            }
            self.drop_tail();
            n += 1;
        }
        n
    }

    /// The clock of `hash`'s last use, if present: compare it later with
    /// [`LruBlocks::newer_than`].
    pub fn stamp(&self, hash: u64) -> Option<u32> {
        self.slots
            .get(&hash)
            .map(|&slot| self.stamps[slot as usize])
    }

    /// Blocks used after the clock read `stamp`: how deep in this LRU a
    /// block stamped then would sit now. Walks from the head, so it costs
    /// the answer.
    pub fn newer_than(&self, stamp: u32) -> usize {
        self.newer_than_up_to(stamp, usize::MAX)
    }

    /// [`LruBlocks::newer_than`], counting (and walking) no further than
    /// `limit`.
    pub fn newer_than_up_to(&self, stamp: u32, limit: usize) -> usize {
        let mut n = 0;
        let mut at = self.head;
        while at != NIL && n < limit {
            let age = self.stamps[at as usize].wrapping_sub(stamp);
            if age == 0 || age > u32::MAX / 2 {
                break;
            }
            n += 1;
            at = self.nodes[at as usize].next;
        }
        n
    }

    /// Of the first `overlap` blocks of `hashes` (present here), the leading
    /// ones a smaller LRU of `room` blocks, fed the same uses, would still
    /// hold: those after whose last use fewer than `room` other blocks were
    /// used (an LRU holds exactly its `room` most recent blocks, and the
    /// blocks used after a present one are all still here). Prompts come
    /// through [`LruBlocks::record_prompt`], last block first, so along a
    /// chain a deeper block is never more recent than a shallower one and
    /// what the smaller LRU holds is a prefix: a binary search finds it.
    /// Costs at most `room` steps per probe, nothing when `room` is at
    /// least this LRU's capacity.
    pub fn held_within(&self, hashes: &[u64], overlap: usize, room: usize) -> usize {
        let overlap = overlap.min(hashes.len());
        if room >= self.capacity {
            return overlap;
        }
        let held = |k: usize| {
            self.stamp(hashes[k])
                .is_some_and(|s| self.newer_than_up_to(s, room) < room)
        };
        // hashes[..lo] are held, hashes[hi..overlap] are not.
        let (mut lo, mut hi) = (0, overlap);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if held(mid) {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        lo
    }

    fn push_front(&mut self, slot: u32) {
        self.clock = self.clock.wrapping_add(1);
        self.stamps[slot as usize] = self.clock;
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
    fn each_table_hashes_blocks_with_its_own_random_keys() {
        let (a, b) = (BlockHashState::default(), BlockHashState::default());
        assert_eq!(a.hash_one(7u64), a.hash_one(7u64));
        assert_ne!(a.hash_one(7u64), b.hash_one(7u64));
        // Keys that differ only in their high bits (which a multiply
        // leaves out of the low bits a table indexes by) spread, whatever
        // keys a table drew (a single folded multiply put them in as few
        // as 12 of 4,096 buckets for some draws).
        let keys: Vec<u64> = (0..256u64).map(|i| i << 48).collect();
        let worst = (0..2_000)
            .map(|_| {
                let table = BlockHashState::default();
                let buckets: std::collections::HashSet<u64> =
                    keys.iter().map(|k| table.hash_one(k) & 0xfff).collect();
                buckets.len()
            })
            .min()
            .unwrap();
        assert!(worst > 200, "{worst} buckets");
    }

    #[test]
    fn overlap_counts_leading_blocks_only() {
        let mut lru = LruBlocks::new(100);
        lru.record_prompt(&[1, 2, 3]);
        assert_eq!(lru.leading_overlap(&[1, 2, 3, 4]), 3);
        assert_eq!(lru.leading_overlap(&[1, 2, 9]), 2);
        assert_eq!(lru.leading_overlap(&[1, 9, 10]), 1);
        assert_eq!(lru.leading_overlap(&[9, 10, 11]), 0);
        assert_eq!(lru.leading_overlap(&[]), 0);
        // Not a chain (block 3 cannot follow 9): only the scan is exact.
        assert_eq!(lru.leading_overlap_scan(&[1, 9, 3]), 1);
        assert_eq!(lru.leading_overlap_scan(&[9, 1, 2]), 0);
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
    fn forgetting_by_the_clock_drops_what_was_used_before_and_keeps_the_rest() {
        let mut lru = LruBlocks::new(100);
        lru.record_prompt(&[1, 2, 3]);
        let then = lru.clock();
        lru.record_prompt(&[10, 11]);
        // Block 1 used again after the clock read `then`: it stays.
        lru.record_prompt(&[1]);
        assert_eq!(lru.forget_not_newer_than(then), 2);
        assert!(!lru.contains(2) && !lru.contains(3));
        assert!(lru.contains(1) && lru.contains(10) && lru.contains(11));
        // Nothing older is left; the slots freed are used again.
        assert_eq!(lru.forget_not_newer_than(then), 0);
        lru.record_prompt(&[20, 21]);
        assert_eq!(lru.len(), 5);
        assert_eq!(lru.forget_not_newer_than(lru.clock()), 5);
        assert!(lru.is_empty());
    }

    #[test]
    fn a_shrink_drops_the_least_recent_and_its_slots_are_reused() {
        let mut lru = LruBlocks::new(8);
        lru.record_prompt(&[1, 2, 3]);
        lru.record_prompt(&[10, 11, 12]);
        lru.set_capacity(4);
        assert_eq!((lru.len(), lru.capacity()), (4, 4));
        // The older prompt's tail went first; its head survived.
        assert!(lru.contains(1) && !lru.contains(2) && !lru.contains(3));
        assert_eq!(lru.leading_overlap(&[10, 11, 12]), 3);
        let nodes = lru.nodes.len();
        lru.set_capacity(6);
        lru.record_prompt(&[20, 21]);
        assert_eq!(lru.len(), 6);
        assert_eq!(lru.nodes.len(), nodes, "freed slots are reused");
        lru.record_prompt(&[30]);
        assert_eq!(lru.len(), 6);
        assert!(!lru.contains(1));
    }

    #[test]
    fn the_depth_of_a_block_is_what_was_used_after_it() {
        let mut lru = LruBlocks::new(100);
        lru.record_prompt(&[1, 2, 3]);
        let s3 = lru.stamp(3).unwrap();
        let s1 = lru.stamp(1).unwrap();
        // Block 3 was touched first (prompts go last to first).
        assert_eq!(lru.newer_than(s3), 2);
        assert_eq!(lru.newer_than_up_to(s3, 3), 2);
        assert_eq!(lru.newer_than_up_to(s3, 1), 1);
        assert_eq!(lru.newer_than(s1), 0);
        lru.record_prompt(&[10, 11]);
        assert_eq!(lru.newer_than(s3), 4);
        // Re-touching a block counts it once.
        lru.touch(2);
        assert_eq!(lru.newer_than(s3), 4);
        assert_eq!(lru.newer_than(s1), 3);
        assert_eq!(lru.stamp(99), None);
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

    /// Chains: conversations that share prefixes, grow, and branch.
    fn chain(prefix: &[u64], extra: &[u64]) -> Vec<u64> {
        let mut out = prefix.to_vec();
        let mut h = prefix.last().copied().unwrap_or(0x5eed);
        for e in extra {
            h = (h ^ e).wrapping_mul(0x100_0000_01b3).rotate_left(17);
            out.push(h);
        }
        out
    }

    proptest::proptest! {
        #[test]
        fn binary_search_overlap_equals_the_scan(
            cap in 1usize..64,
            ops in proptest::collection::vec((0usize..8, 0usize..12, proptest::collection::vec(0u64..4, 0..10)), 1..60),
        ) {
            let mut lru = LruBlocks::new(cap);
            let mut prompts: Vec<Vec<u64>> = vec![Vec::new()];
            for (base, cut, extra) in ops {
                let base = &prompts[base % prompts.len()];
                let p = chain(&base[..cut.min(base.len())], &extra);
                for q in &prompts {
                    proptest::prop_assert_eq!(lru.leading_overlap(q), lru.leading_overlap_scan(q));
                }
                proptest::prop_assert_eq!(lru.leading_overlap(&p), lru.leading_overlap_scan(&p));
                let other = LruBlocks::new(cap / 2 + 1);
                proptest::prop_assert_eq!(
                    LruBlocks::leading_overlaps(&[&lru, &other, &lru], &p),
                    vec![lru.leading_overlap(&p), other.leading_overlap(&p), lru.leading_overlap(&p)]
                );
                lru.record_prompt(&p);
                prompts.push(p);
            }
        }

        #[test]
        fn what_a_smaller_lru_holds_is_read_from_the_larger_one(
            room in 1usize..24,
            ops in proptest::collection::vec((0usize..8, 0usize..12, proptest::collection::vec(0u64..4, 0..10)), 1..60),
        ) {
            // The same prompts through an index of 64 blocks and through
            // an LRU of `room` blocks: what the small one holds of each
            // prompt is what `held_within` reads from the large one.
            let mut large = LruBlocks::new(64);
            let mut small = LruBlocks::new(room);
            let mut prompts: Vec<Vec<u64>> = vec![Vec::new()];
            for (base, cut, extra) in ops {
                let base = &prompts[base % prompts.len()];
                let p = chain(&base[..cut.min(base.len())], &extra);
                large.record_prompt(&p);
                small.record_prompt(&p);
                prompts.push(p);
                for q in &prompts {
                    let overlap = large.leading_overlap(q);
                    proptest::prop_assert_eq!(
                        large.held_within(q, overlap, room),
                        small.leading_overlap(q).min(overlap)
                    );
                }
            }
        }

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

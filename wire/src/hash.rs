//! FNV-1a 64 and the block hash chain.

use crate::json::Sink;
use crate::{Params, MAX_BLOCK_SIZE, MAX_HASHES, MIN_BLOCK_SIZE};

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;
const SEED_DOMAIN: &[u8] = b"hearth-fp/v2\0";

/// FNV-1a 64 of `bytes`.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    fnv_update(FNV_OFFSET, bytes)
}

#[inline]
fn fnv_update(mut h: u64, bytes: &[u8]) -> u64 {
    // FNV is inherently serial; unrolling by 8 lets the compiler skip the
    // loop bookkeeping between the multiplies.
    let mut chunks = bytes.chunks_exact(8);
    for c in &mut chunks {
        for &b in c {
            h = (h ^ u64::from(b)).wrapping_mul(FNV_PRIME);
        }
    }
    for &b in chunks.remainder() {
        h = (h ^ u64::from(b)).wrapping_mul(FNV_PRIME);
    }
    h
}

/// The block size actually used: `params.block_size` clamped to the allowed range.
pub(crate) fn effective_block_size(params: &Params) -> usize {
    params.block_size.clamp(MIN_BLOCK_SIZE, MAX_BLOCK_SIZE)
}

/// The chain seed for `model`.
pub(crate) fn seed(model: &str) -> u64 {
    Seed::new(model).finish()
}

/// The chain seed, fed in pieces: the domain and the model, then (for a
/// partitioned request) `\0cache_salt\0` and the salt.
pub(crate) struct Seed(u64);

impl Seed {
    pub(crate) fn new(model: &str) -> Seed {
        Seed(fnv_update(fnv1a64(SEED_DOMAIN), model.as_bytes()))
    }

    pub(crate) fn finish(self) -> u64 {
        self.0
    }
}

impl Sink for Seed {
    fn put(&mut self, bytes: &[u8]) {
        self.0 = fnv_update(self.0, bytes);
    }

    /// Never called: the seed takes every byte.
    fn count(&mut self, _: usize) {}
}

/// Chained block hashes of the first `max_prefix_bytes` of `canonical`.
///
/// `h_i = fnv1a(h_{i-1}.to_le_bytes() ++ block_i)`, `h_{-1} = fnv1a(b"hearth-fp/v2\0" ++ model)`.
/// A trailing partial block gets a hash; an empty input gives no hashes.
pub fn chain_hashes(model: &str, canonical: &[u8], params: &Params) -> Vec<u64> {
    let mut chain = Chain::new(seed(model), params, canonical.len());
    chain.put(canonical);
    chain.finish()
}

/// The hash chain as a [`Sink`]: canonical bytes are hashed as they come,
/// block by block, and only counted past the prefix bound, so the
/// canonical prompt is never held.
pub(crate) struct Chain {
    block: usize,
    /// Bytes still hashed before the bound.
    room: usize,
    /// Every byte given, hashed or not.
    len: u64,
    /// The running hash of the current block, and how much of it is in.
    state: u64,
    filled: usize,
    hashes: Vec<u64>,
}

impl Chain {
    /// A chain from `seed`; `expected` (the body's size) sizes the hash list.
    pub(crate) fn new(seed: u64, params: &Params, expected: usize) -> Chain {
        let block = effective_block_size(params);
        let bound = params
            .max_prefix_bytes
            .min(block.saturating_mul(MAX_HASHES));
        Chain {
            block,
            room: bound,
            len: 0,
            state: fnv_update(FNV_OFFSET, &seed.to_le_bytes()),
            filled: 0,
            hashes: Vec::with_capacity(bound.min(expected).div_ceil(block)),
        }
    }

    /// Hashes `bytes` (within the bound) into the chain, block by block.
    fn hash(&mut self, bytes: &[u8]) {
        let mut rest = bytes;
        while !rest.is_empty() {
            let k = rest.len().min(self.block - self.filled);
            let (now, later) = rest.split_at(k);
            self.state = fnv_update(self.state, now);
            self.filled += k;
            if self.filled == self.block {
                self.end_block();
            }
            rest = later;
        }
    }

    /// The current block is full: its hash is kept and chains the next.
    fn end_block(&mut self) {
        self.hashes.push(self.state);
        self.state = fnv_update(FNV_OFFSET, &self.state.to_le_bytes());
        self.filled = 0;
    }

    /// Every byte given so far.
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// The hashes, the trailing partial block's included.
    pub(crate) fn finish(mut self) -> Vec<u64> {
        if self.filled > 0 {
            self.hashes.push(self.state);
        }
        self.hashes
    }
}

impl Sink for Chain {
    #[inline]
    fn put(&mut self, bytes: &[u8]) {
        self.len += bytes.len() as u64;
        let take = bytes.len().min(self.room);
        self.room -= take;
        let bytes = bytes.get(..take).unwrap_or_default();
        if self.filled + bytes.len() < self.block {
            // Inside the current block: no block ends, nothing to push.
            if bytes.len() < 8 {
                // A tiny piece (a short item, a key): no loop set-up.
                for &b in bytes {
                    self.state = (self.state ^ u64::from(b)).wrapping_mul(FNV_PRIME);
                }
            } else {
                self.state = fnv_update(self.state, bytes);
            }
            self.filled += bytes.len();
        } else {
            self.hash(bytes);
        }
    }

    #[inline]
    fn put_byte(&mut self, byte: u8) {
        self.len += 1;
        if self.room == 0 {
            return;
        }
        self.room -= 1;
        self.state = (self.state ^ u64::from(byte)).wrapping_mul(FNV_PRIME);
        self.filled += 1;
        if self.filled == self.block {
            self.end_block();
        }
    }

    fn keeps(&self) -> bool {
        self.room > 0
    }

    fn count(&mut self, n: usize) {
        self.len += n as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv_reference_values() {
        // Published FNV-1a 64 test vectors.
        assert_eq!(fnv1a64(b""), 0xcbf29ce484222325);
        assert_eq!(fnv1a64(b"a"), 0xaf63dc4c8601ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x85944171f73967e8);
    }

    #[test]
    fn seed_is_fnv_of_domain_and_model() {
        let mut v = SEED_DOMAIN.to_vec();
        v.extend_from_slice(b"m");
        assert_eq!(seed("m"), fnv1a64(&v));
    }

    #[test]
    fn chain_matches_definition() {
        let p = Params {
            block_size: 64,
            max_prefix_bytes: 1 << 20,
        };
        let data: Vec<u8> = (0..200u32).map(|i| i as u8).collect();
        let hs = chain_hashes("m", &data, &p);
        assert_eq!(hs.len(), 4); // 64 + 64 + 64 + 8
        let mut prev = seed("m");
        for (i, chunk) in data.chunks(64).enumerate() {
            let mut buf = prev.to_le_bytes().to_vec();
            buf.extend_from_slice(chunk);
            prev = fnv1a64(&buf);
            assert_eq!(hs[i], prev);
        }
    }

    #[test]
    fn bounded_prefix() {
        let p = Params {
            block_size: 64,
            max_prefix_bytes: 100,
        };
        let data = vec![7u8; 1000];
        let hs = chain_hashes("m", &data, &p);
        assert_eq!(hs.len(), 2);
        assert_eq!(hs, chain_hashes("m", &data[..100], &p));
        assert!(chain_hashes("m", b"", &p).is_empty());
    }
}

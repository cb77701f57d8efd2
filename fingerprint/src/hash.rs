//! FNV-1a 64 and the block hash chain.

use crate::{Params, MAX_BLOCK_SIZE, MAX_HASHES, MIN_BLOCK_SIZE};

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;
const SEED_DOMAIN: &[u8] = b"hearth-fp/v1\0";

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
    fnv_update(fnv1a64(SEED_DOMAIN), model.as_bytes())
}

/// Chained block hashes of the first `max_prefix_bytes` of `canonical`.
///
/// `h_i = fnv1a(h_{i-1}.to_le_bytes() ++ block_i)`, `h_{-1} = fnv1a(b"hearth-fp/v1\0" ++ model)`.
/// A trailing partial block gets a hash; an empty input gives no hashes.
pub fn chain_hashes(model: &str, canonical: &[u8], params: &Params) -> Vec<u64> {
    let block = effective_block_size(params);
    let bound = params
        .max_prefix_bytes
        .min(block.saturating_mul(MAX_HASHES))
        .min(canonical.len());
    let prefix = canonical.get(..bound).unwrap_or(canonical);
    let mut out = Vec::with_capacity(prefix.len().div_ceil(block));
    let mut h = seed(model);
    for chunk in prefix.chunks(block) {
        h = fnv_update(fnv_update(FNV_OFFSET, &h.to_le_bytes()), chunk);
        out.push(h);
    }
    out
}

/// The block hash chain computed as canonical bytes stream in, so they are
/// never materialised: the same hashes as [`chain_hashes`] over the whole
/// stream. Bytes past the prefix bound are only counted.
pub(crate) struct ChainHasher {
    block: usize,
    /// Bytes still to hash before the prefix bound.
    budget: usize,
    /// FNV state of the open block (seeded with the previous hash).
    state: u64,
    /// Bytes in the open block.
    filled: usize,
    total: u64,
    hashes: Vec<u64>,
}

impl ChainHasher {
    pub(crate) fn new(model: &str, params: &Params) -> ChainHasher {
        let block = effective_block_size(params);
        let budget = params
            .max_prefix_bytes
            .min(block.saturating_mul(MAX_HASHES));
        ChainHasher {
            block,
            budget,
            state: block_start(seed(model)),
            filled: 0,
            total: 0,
            hashes: Vec::with_capacity(budget.div_ceil(block).min(1024)),
        }
    }

    /// The hashes, the trailing partial block included, and the total length.
    pub(crate) fn finish(mut self) -> (Vec<u64>, u64) {
        if self.filled > 0 {
            self.hashes.push(self.state);
        }
        (self.hashes, self.total)
    }
}

#[inline]
fn block_start(prev: u64) -> u64 {
    fnv_update(FNV_OFFSET, &prev.to_le_bytes())
}

impl crate::canonical::Sink for ChainHasher {
    fn put(&mut self, bytes: &[u8]) {
        self.total += bytes.len() as u64;
        let take = bytes.len().min(self.budget);
        self.budget -= take;
        let mut rest = bytes.get(..take).unwrap_or_default();
        while !rest.is_empty() {
            let room = self.block - self.filled;
            let (now, later) = rest.split_at(room.min(rest.len()));
            self.state = fnv_update(self.state, now);
            self.filled += now.len();
            if self.filled == self.block {
                self.hashes.push(self.state);
                self.state = block_start(self.state);
                self.filled = 0;
            }
            rest = later;
        }
    }

    fn written(&self) -> u64 {
        self.total
    }

    /// Decodes and hashes in one pass over the raw text: the decoding
    /// branches run beside the serial multiply chain instead of in a pass
    /// of their own.
    fn put_text(&mut self, text: &crate::canonical::Text<'_>) {
        if text.is_verbatim() {
            return self.put(text.raw.as_bytes());
        }
        self.total += text.len as u64;
        let mut left = text.len.min(self.budget);
        self.budget -= left;
        let raw = text.raw.as_bytes();
        let (mut state, mut filled) = (self.state, self.filled);
        let mut i = 0;
        macro_rules! push {
            ($b:expr) => {{
                state = (state ^ u64::from($b)).wrapping_mul(FNV_PRIME);
                filled += 1;
                if filled == self.block {
                    self.hashes.push(state);
                    state = block_start(state);
                    filled = 0;
                }
            }};
        }
        while left > 0 {
            let Some(&b) = raw.get(i) else { break };
            if b != b'\\' {
                push!(b);
                left -= 1;
                i += 1;
                continue;
            }
            let Some((buf, n, next)) = crate::canonical::Text::escape_at(raw, i) else {
                break;
            };
            for &d in buf.get(..n.min(left)).unwrap_or_default() {
                push!(d);
            }
            left = left.saturating_sub(n);
            i = next;
        }
        self.state = state;
        self.filled = filled;
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

    #[test]
    fn streaming_matches_the_whole_buffer_for_any_split() {
        use crate::canonical::Sink;
        let p = Params {
            block_size: 64,
            max_prefix_bytes: 300,
        };
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
        for len in [0, 1, 63, 64, 65, 299, 300, 301, 1000] {
            for step in [1, 5, 64, 100, 1000] {
                let mut h = ChainHasher::new("m", &p);
                for piece in data[..len].chunks(step) {
                    h.put(piece);
                }
                let (hashes, total) = h.finish();
                assert_eq!(total, len as u64);
                assert_eq!(
                    hashes,
                    chain_hashes("m", &data[..len], &p),
                    "len {len} step {step}"
                );
            }
        }
    }
}

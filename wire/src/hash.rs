//! FNV-1a 64 and the block hash chain.

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
    fnv_update(fnv1a64(SEED_DOMAIN), model.as_bytes())
}

/// Chained block hashes of the first `max_prefix_bytes` of `canonical`.
///
/// `h_i = fnv1a(h_{i-1}.to_le_bytes() ++ block_i)`, `h_{-1} = fnv1a(b"hearth-fp/v2\0" ++ model)`.
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

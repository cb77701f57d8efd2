//! The request headers the filter sets and the `x-hearth-fp` value format.
//!
//! `x-hearth-fp: v2.<block_size>.<hashes>` where `<block_size>` is decimal
//! without leading zeros and `<hashes>` is base64url without padding of the
//! hashes as little-endian `u64`s, concatenated.

use crate::{MAX_BLOCK_SIZE, MAX_HASHES, MIN_BLOCK_SIZE};
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;

/// The fingerprint (version, block size, hashes).
pub const FP: &str = "x-hearth-fp";
/// The canonical prompt length in bytes (decimal).
pub const PROMPT_BYTES: &str = "x-hearth-prompt-bytes";
/// The request's model.
pub const MODEL: &str = "x-hearth-model";
/// The request's output cap, when it has one (`max_tokens` and equivalents).
pub const MAX_TOKENS: &str = "x-hearth-max-tokens";
/// How the request uses the engine's prompt cache, when not as usual:
/// `partitioned` (it names a cache salt) or `bypassed` (it turns the
/// engine's prompt cache off, or pins an engine slot); see
/// [`crate::CacheUse`].
pub const CACHE: &str = "x-hearth-cache";
/// The sidecar's own id for a routed generation (random, never a
/// client's): the outcome filter's report names its decision by it.
pub const TICKET: &str = "x-hearth-ticket";
/// Every header starting with this prefix is Hearth's; clients may not send them.
pub const PREFIX: &str = "x-hearth-";

const VERSION_PREFIX: &str = "v2.";
/// Longest base64 text for [`MAX_HASHES`] hashes.
const MAX_B64_LEN: usize = (MAX_HASHES * 8 * 4).div_ceil(3);

/// Why a header value was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The value does not start with `v2.`.
    #[error("unsupported fingerprint version (want `v2.`)")]
    Version,
    /// The block size is missing, not canonical decimal, or out of range.
    #[error("bad block size (want {MIN_BLOCK_SIZE}..={MAX_BLOCK_SIZE} in decimal)")]
    BlockSize,
    /// More than [`MAX_HASHES`] hashes.
    #[error("too many hashes (at most {MAX_HASHES})")]
    TooManyHashes,
    /// The hash field is not base64url without padding.
    #[error("hashes are not base64url without padding")]
    Base64,
    /// The decoded hashes are not a whole number of u64s.
    #[error("decoded hash bytes ({0}) are not a multiple of 8")]
    Length(usize),
}

/// Encodes a fingerprint header value.
pub fn encode(block_size: u32, hashes: &[u64]) -> String {
    let mut raw = Vec::with_capacity(hashes.len() * 8);
    for h in hashes {
        raw.extend_from_slice(&h.to_le_bytes());
    }
    let mut out = String::with_capacity(16 + raw.len().div_ceil(3) * 4);
    out.push_str(VERSION_PREFIX);
    out.push_str(&block_size.to_string());
    out.push('.');
    URL_SAFE_NO_PAD.encode_string(&raw, &mut out);
    out
}

/// Decodes a header value into `(block_size, hashes)`. Never panics.
pub fn decode(value: &str) -> Result<(u32, Vec<u64>), DecodeError> {
    let rest = value
        .strip_prefix(VERSION_PREFIX)
        .ok_or(DecodeError::Version)?;
    let (bs, b64) = rest.split_once('.').ok_or(DecodeError::BlockSize)?;
    let canonical_decimal = !bs.is_empty()
        && bs.len() <= 7
        && bs.bytes().all(|b| b.is_ascii_digit())
        && !bs.starts_with('0');
    if !canonical_decimal {
        return Err(DecodeError::BlockSize);
    }
    let block_size: u32 = bs.parse().map_err(|_| DecodeError::BlockSize)?;
    if !(MIN_BLOCK_SIZE..=MAX_BLOCK_SIZE).contains(&(block_size as usize)) {
        return Err(DecodeError::BlockSize);
    }
    if b64.len() > MAX_B64_LEN {
        return Err(DecodeError::TooManyHashes);
    }
    let raw = URL_SAFE_NO_PAD
        .decode(b64)
        .map_err(|_| DecodeError::Base64)?;
    if raw.len() % 8 != 0 {
        return Err(DecodeError::Length(raw.len()));
    }
    let hashes = raw
        .chunks_exact(8)
        .map(|c| {
            let mut b = [0u8; 8];
            b.copy_from_slice(c);
            u64::from_le_bytes(b)
        })
        .collect();
    Ok((block_size, hashes))
}

/// True for headers a client must not send: anything `x-hearth-*` and the
/// Gateway API Inference Extension destination headers
/// (`x-gateway-destination-endpoint`, `...-subset`). Case-insensitive.
pub fn is_reserved(name: &str) -> bool {
    fn has_prefix(name: &str, prefix: &str) -> bool {
        name.as_bytes()
            .get(..prefix.len())
            .is_some_and(|p| p.eq_ignore_ascii_case(prefix.as_bytes()))
    }
    has_prefix(name, PREFIX) || has_prefix(name, crate::names::DESTINATION)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_and_shape() {
        let v = encode(2048, &[1, u64::MAX]);
        assert!(v.starts_with("v2.2048."));
        assert_eq!(decode(&v), Ok((2048, vec![1, u64::MAX])));
        assert_eq!(decode("v2.64."), Ok((64, vec![])));
    }

    #[test]
    fn rejects() {
        assert_eq!(decode(""), Err(DecodeError::Version));
        // The first format's fingerprints name other bytes: refused.
        assert_eq!(decode("v1.2048.AAAAAAAAAAA"), Err(DecodeError::Version));
        assert_eq!(decode("v2.2048"), Err(DecodeError::BlockSize));
        assert_eq!(decode("v2.02048.AAAAAAAAAAA"), Err(DecodeError::BlockSize));
        assert_eq!(decode("v2.+2048.AAAAAAAAAAA"), Err(DecodeError::BlockSize));
        assert_eq!(decode("v2.32.AAAAAAAAAAA"), Err(DecodeError::BlockSize));
        assert_eq!(decode("v2.2048.AAAA"), Err(DecodeError::Length(3)));
        assert_eq!(decode("v2.2048.AAAAAAAAAAA="), Err(DecodeError::Base64));
        assert_eq!(decode("v2.2048.AA+AAAAAAAA"), Err(DecodeError::Base64));
        let too_many = encode(64, &vec![0; MAX_HASHES + 1]);
        assert_eq!(decode(&too_many), Err(DecodeError::TooManyHashes));
        let max = encode(64, &vec![7; MAX_HASHES]);
        assert_eq!(decode(&max).map(|(_, h)| h.len()), Ok(MAX_HASHES));
    }

    #[test]
    fn reserved_names() {
        assert!(is_reserved("x-hearth-fp"));
        assert!(is_reserved("X-Hearth-Anything"));
        assert!(is_reserved("x-gateway-destination-endpoint"));
        assert!(is_reserved("x-gateway-destination-endpoint-subset"));
        assert!(!is_reserved("x-hearth"));
        assert!(!is_reserved("content-type"));
        assert!(!is_reserved("x-gateway-other"));
    }
}

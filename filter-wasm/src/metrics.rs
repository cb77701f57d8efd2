//! The filter's counters. Envoy exposes them as `wasmcustom.<name>`.

use hearth_wire::SkipReason;

/// Why a request went upstream without a fingerprint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SkipCause {
    /// The body could not be fingerprinted.
    Fingerprint(SkipReason),
    /// Not a `POST`.
    NotPost,
    /// Path not configured for fingerprinting.
    Path,
    /// `POST` without a body.
    NoBody,
    /// Body (or its `content-length`) over `max_body_bytes`.
    TooLarge,
    /// `model` is not usable as a header value (control or non-ASCII characters).
    BadModel,
    /// The host did not hand over the buffered body.
    BodyUnavailable,
}

/// One counter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Metric {
    /// Requests that got a fingerprint.
    Hashed,
    /// Canonical prompt bytes fed to the hash (bounded by `max_prefix_bytes`).
    HashedBytes,
    /// Microseconds spent reading, canonicalizing and hashing bodies.
    HashMicros,
    /// Client-supplied `x-hearth-*` / destination headers removed.
    StrippedHeaders,
    /// Requests passed on without a fingerprint, by cause.
    Skipped(SkipCause),
}

impl Metric {
    /// Every counter, in id order.
    pub const ALL: [Metric; 16] = [
        Metric::Hashed,
        Metric::HashedBytes,
        Metric::HashMicros,
        Metric::StrippedHeaders,
        Metric::Skipped(SkipCause::Fingerprint(SkipReason::NotJson)),
        Metric::Skipped(SkipCause::Fingerprint(SkipReason::NotObject)),
        Metric::Skipped(SkipCause::Fingerprint(SkipReason::NoModel)),
        Metric::Skipped(SkipCause::Fingerprint(SkipReason::NoPrompt)),
        Metric::Skipped(SkipCause::Fingerprint(SkipReason::BadField)),
        Metric::Skipped(SkipCause::Fingerprint(SkipReason::TooComplex)),
        Metric::Skipped(SkipCause::NotPost),
        Metric::Skipped(SkipCause::Path),
        Metric::Skipped(SkipCause::NoBody),
        Metric::Skipped(SkipCause::TooLarge),
        Metric::Skipped(SkipCause::BadModel),
        Metric::Skipped(SkipCause::BodyUnavailable),
    ];

    /// The name passed to `define_metric`.
    pub fn name(self) -> &'static str {
        match self {
            Metric::Hashed => "hearth_filter.hashed",
            Metric::HashedBytes => "hearth_filter.hashed_bytes",
            Metric::HashMicros => "hearth_filter.hash_micros",
            Metric::StrippedHeaders => "hearth_filter.stripped_headers",
            Metric::Skipped(c) => match c {
                SkipCause::Fingerprint(SkipReason::NotJson) => "hearth_filter.skipped.not_json",
                SkipCause::Fingerprint(SkipReason::NotObject) => "hearth_filter.skipped.not_object",
                SkipCause::Fingerprint(SkipReason::NoModel) => "hearth_filter.skipped.no_model",
                SkipCause::Fingerprint(SkipReason::NoPrompt) => "hearth_filter.skipped.no_prompt",
                SkipCause::Fingerprint(SkipReason::BadField) => "hearth_filter.skipped.bad_field",
                SkipCause::Fingerprint(SkipReason::TooComplex) => {
                    "hearth_filter.skipped.too_complex"
                }
                SkipCause::NotPost => "hearth_filter.skipped.not_post",
                SkipCause::Path => "hearth_filter.skipped.path",
                SkipCause::NoBody => "hearth_filter.skipped.no_body",
                SkipCause::TooLarge => "hearth_filter.skipped.too_large",
                SkipCause::BadModel => "hearth_filter.skipped.bad_model",
                SkipCause::BodyUnavailable => "hearth_filter.skipped.body_unavailable",
            },
        }
    }

    /// Position in [`Metric::ALL`].
    pub fn index(self) -> usize {
        Metric::ALL.iter().position(|m| *m == self).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_cover_every_skip_reason() {
        let names: Vec<&str> = Metric::ALL.iter().map(|m| m.name()).collect();
        let mut sorted = names.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), names.len());
        for r in SkipReason::ALL {
            let m = Metric::Skipped(SkipCause::Fingerprint(r));
            assert_eq!(m.name(), format!("hearth_filter.skipped.{}", r.as_str()));
            assert_eq!(Metric::ALL[m.index()], m);
        }
        for (i, m) in Metric::ALL.iter().enumerate() {
            assert_eq!(m.index(), i);
        }
    }
}

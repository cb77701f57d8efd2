//! What the filter does with a request, as pure functions over bytes. The
//! proxy-wasm glue only moves headers and bodies in and out of these.

use crate::config::FilterConfig;
use crate::metrics::SkipCause;
use hearth_wire::{fingerprint, header, CacheUse, Endpoint, Fingerprint};

/// What to do once the request headers are in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeaderDecision {
    /// Pause, buffer the body, then fingerprint it as this API.
    Buffer(Endpoint),
    /// Let the request through untouched and unhashed.
    Pass(SkipCause),
}

/// Decides from `:method`, `:path` and `content-length` whether to buffer.
pub fn on_request_headers(
    cfg: &FilterConfig,
    method: Option<&[u8]>,
    path: Option<&[u8]>,
    content_length: Option<&[u8]>,
    end_of_stream: bool,
) -> HeaderDecision {
    if method != Some(b"POST".as_slice()) {
        return HeaderDecision::Pass(SkipCause::NotPost);
    }
    let endpoint = path
        .and_then(|p| std::str::from_utf8(p).ok())
        .and_then(|p| cfg.endpoint_for(p));
    let Some(endpoint) = endpoint else {
        return HeaderDecision::Pass(SkipCause::Path);
    };
    let length = content_length
        .and_then(|v| std::str::from_utf8(v).ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if end_of_stream || length == Some(0) {
        return HeaderDecision::Pass(SkipCause::NoBody);
    }
    if length.is_some_and(|n| n > cfg.max_body_bytes as u64) {
        return HeaderDecision::Pass(SkipCause::TooLarge);
    }
    HeaderDecision::Buffer(endpoint)
}

/// Names among `names` that a client must not send (`x-hearth-*`,
/// `x-gateway-destination-endpoint*`), each once.
pub fn reserved_headers<'a>(names: impl IntoIterator<Item = &'a str>) -> Vec<&'a str> {
    let mut out: Vec<&str> = Vec::new();
    for n in names {
        if header::is_reserved(n) && !out.iter().any(|o| o.eq_ignore_ascii_case(n)) {
            out.push(n);
        }
    }
    out
}

/// The result of fingerprinting a buffered body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BodyOutcome {
    /// Set these request headers.
    Hashed {
        /// `(name, value)` pairs to set, replacing any existing value.
        headers: Vec<(&'static str, String)>,
        /// Canonical bytes fed to the hash.
        hashed_bytes: u64,
    },
    /// Leave the request as it is.
    Skipped(SkipCause),
}

/// Fingerprints a complete request body.
pub fn on_request_body(cfg: &FilterConfig, endpoint: Endpoint, body: &[u8]) -> BodyOutcome {
    if body.len() > cfg.max_body_bytes {
        return BodyOutcome::Skipped(SkipCause::TooLarge);
    }
    match fingerprint(endpoint, body, &cfg.params) {
        Ok(fp) => match fingerprint_headers(&fp) {
            Some(headers) => BodyOutcome::Hashed {
                headers,
                hashed_bytes: fp.prompt_bytes.min(cfg.params.max_prefix_bytes as u64),
            },
            None => BodyOutcome::Skipped(SkipCause::BadModel),
        },
        Err(reason) => BodyOutcome::Skipped(SkipCause::Fingerprint(reason)),
    }
}

/// Longest model name sent in `x-hearth-model`; a longer one would bloat
/// the request headers past Envoy's limits.
pub const MAX_MODEL_BYTES: usize = 256;

/// The headers for `fp`, or `None` if the model cannot travel in a header.
pub fn fingerprint_headers(fp: &Fingerprint) -> Option<Vec<(&'static str, String)>> {
    if fp.model.len() > MAX_MODEL_BYTES || !is_header_safe(&fp.model) {
        return None;
    }
    let mut headers = vec![
        (header::PROMPT_BYTES, fp.prompt_bytes.to_string()),
        (header::MODEL, fp.model.clone()),
    ];
    // A request that turns the engine's cache off is routed on load alone:
    // no fingerprint, so it adds no warmth and predicts nothing.
    if fp.cache != CacheUse::Bypassed {
        headers.insert(0, (header::FP, fp.header_value()));
    }
    if fp.cache != CacheUse::Shared {
        headers.push((header::CACHE, fp.cache.as_str().to_string()));
    }
    if let Some(n) = fp.max_output_tokens {
        headers.push((header::MAX_TOKENS, n.to_string()));
    }
    Some(headers)
}

/// Visible ASCII and inner spaces only: survives every codec unchanged.
pub fn is_header_safe(v: &str) -> bool {
    let b = v.as_bytes();
    !b.is_empty()
        && b.iter().all(|c| (0x20..0x7f).contains(c))
        && b.first() != Some(&b' ')
        && b.last() != Some(&b' ')
}

#[cfg(test)]
mod tests {
    use super::*;
    use hearth_wire::SkipReason;

    const CHAT: &[u8] = b"/v1/chat/completions";

    #[test]
    fn header_decisions() {
        let c = FilterConfig::default();
        let d = |m: &[u8], p: &[u8], cl: Option<&[u8]>, eos| {
            on_request_headers(&c, Some(m), Some(p), cl, eos)
        };
        assert_eq!(
            d(b"POST", CHAT, None, false),
            HeaderDecision::Buffer(Endpoint::ChatCompletions)
        );
        assert_eq!(
            d(b"POST", b"/v1/completions?x", Some(b"10"), false),
            HeaderDecision::Buffer(Endpoint::Completions)
        );
        assert_eq!(
            d(b"GET", CHAT, None, true),
            HeaderDecision::Pass(SkipCause::NotPost)
        );
        assert_eq!(
            d(b"post", CHAT, None, false),
            HeaderDecision::Pass(SkipCause::NotPost)
        );
        assert_eq!(
            d(b"POST", b"/v1/models", None, false),
            HeaderDecision::Pass(SkipCause::Path)
        );
        assert_eq!(
            d(b"POST", b"/v1/chat/\xff", None, false),
            HeaderDecision::Pass(SkipCause::Path)
        );
        assert_eq!(
            d(b"POST", CHAT, None, true),
            HeaderDecision::Pass(SkipCause::NoBody)
        );
        assert_eq!(
            d(b"POST", CHAT, Some(b"0"), false),
            HeaderDecision::Pass(SkipCause::NoBody)
        );
        assert_eq!(
            d(b"POST", CHAT, Some(b"999999999999"), false),
            HeaderDecision::Pass(SkipCause::TooLarge)
        );
        assert_eq!(
            d(b"POST", CHAT, Some(b"junk"), false),
            HeaderDecision::Buffer(Endpoint::ChatCompletions)
        );
        assert_eq!(
            on_request_headers(&c, None, None, None, false),
            HeaderDecision::Pass(SkipCause::NotPost)
        );
        assert_eq!(
            on_request_headers(&c, Some(b"POST"), None, None, false),
            HeaderDecision::Pass(SkipCause::Path)
        );
    }

    #[test]
    fn strips_client_routing_headers() {
        let names = [
            ":path",
            "x-hearth-fp",
            "X-Hearth-FP",
            "x-hearth-model",
            "x-gateway-destination-endpoint",
            "x-gateway-destination-endpoint-subset",
            "content-type",
            "x-hearthish",
        ];
        assert_eq!(
            reserved_headers(names),
            vec![
                "x-hearth-fp",
                "x-hearth-model",
                "x-gateway-destination-endpoint",
                "x-gateway-destination-endpoint-subset"
            ]
        );
    }

    #[test]
    fn body_outcomes() {
        let c = FilterConfig {
            max_body_bytes: 200,
            ..FilterConfig::default()
        };
        let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
        match on_request_body(&c, Endpoint::ChatCompletions, body) {
            BodyOutcome::Hashed {
                headers,
                hashed_bytes,
            } => {
                assert_eq!(headers.len(), 3);
                assert_eq!(headers[0].0, "x-hearth-fp");
                assert!(headers[0].1.starts_with("v2.2048."));
                assert_eq!(
                    headers[1],
                    ("x-hearth-prompt-bytes", hashed_bytes.to_string())
                );
                assert_eq!(headers[2], ("x-hearth-model", "m".to_owned()));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            on_request_body(&c, Endpoint::ChatCompletions, &[b' '; 201]),
            BodyOutcome::Skipped(SkipCause::TooLarge)
        );
        assert_eq!(
            on_request_body(&c, Endpoint::ChatCompletions, b"{"),
            BodyOutcome::Skipped(SkipCause::Fingerprint(SkipReason::NotJson))
        );
        assert_eq!(
            on_request_body(&c, Endpoint::ChatCompletions, b""),
            BodyOutcome::Skipped(SkipCause::Fingerprint(SkipReason::NotJson))
        );
        let bad_model = br#"{"model":"a\nb","messages":[{"role":"user","content":"hi"}]}"#;
        assert_eq!(
            on_request_body(&c, Endpoint::ChatCompletions, bad_model),
            BodyOutcome::Skipped(SkipCause::BadModel)
        );
    }

    #[test]
    fn an_overlong_model_is_not_put_in_a_header() {
        let c = FilterConfig::default();
        let body = format!(
            r#"{{"model":"{}","messages":[{{"role":"user","content":"hi"}}]}}"#,
            "m".repeat(MAX_MODEL_BYTES + 1)
        );
        assert_eq!(
            on_request_body(&c, Endpoint::ChatCompletions, body.as_bytes()),
            BodyOutcome::Skipped(SkipCause::BadModel)
        );
    }

    #[test]
    fn header_safety() {
        assert!(is_header_safe("meta-llama/Llama-3.1-8B-Instruct"));
        assert!(is_header_safe("a b"));
        for bad in ["", " a", "a ", "a\r\nx: y", "a\0", "modèle", "a\tb"] {
            assert!(!is_header_safe(bad), "{bad:?}");
        }
    }
}

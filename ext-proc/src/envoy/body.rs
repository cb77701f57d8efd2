//! Body-over-gRPC mode: the sidecar fingerprints the request body itself.
//!
//! For meshes where no wasm filter can be installed (and for the Gateway
//! API Inference Extension's endpoint-picker protocol), Envoy's ext_proc
//! filter sends the request body to the sidecar (`request_body_mode:
//! BUFFERED`). Envoy tells the sidecar which body mode it runs in the
//! first message of every stream (`protocol_config`), so no sidecar
//! setting is needed: when bodies come, a fingerprintable request waits
//! for its body, which is hashed with the same `hearth_wire` code
//! the filter runs (so the hashes, and the warmth they name, are the
//! same), and the decision is returned on the body response.
//!
//! In this mode the body is the only source of truth: an `x-hearth-fp`
//! header on the request is ignored (the shipped body-mode Envoy config
//! also strips it before ext_proc), so a client cannot steer routing.

use envoy_types::pb::envoy::service::ext_proc::v3::HttpHeaders;
use hearth_wire::{fingerprint, CacheUse, Endpoint, Params, DEFAULT_MAX_PREFIX_BYTES};

use crate::envoy::headers;

use hearth_router::RequestInfo;

/// The API whose body this request will carry, if it is one to fingerprint:
/// a `POST` to a prompt endpoint with a body still to come.
pub fn awaits_body(h: &HttpHeaders) -> Option<Endpoint> {
    if h.end_of_stream {
        return None;
    }
    let mut method = None;
    let mut path = None;
    for hv in headers::all(h) {
        match hv.key.as_str() {
            ":method" => method = Some(headers::text(hv)),
            ":path" => path = Some(headers::text(hv)),
            _ => {}
        }
    }
    if method != Some("POST") {
        return None;
    }
    Endpoint::from_path(path?)
}

/// What the router needs from a complete body: the same fingerprint the
/// filter would have put in its headers. A body that cannot be fingerprinted
/// (not JSON, not an OpenAI request) routes on load alone, as in filter mode.
pub fn request_info(endpoint: Endpoint, body: &[u8], block_size: usize) -> RequestInfo {
    let params = Params {
        block_size,
        max_prefix_bytes: DEFAULT_MAX_PREFIX_BYTES.max(block_size),
    };
    match fingerprint(endpoint, body, &params) {
        Ok(fp) => RequestInfo {
            // As in filter mode: a request that turns the engine's cache
            // off is routed on load alone.
            hashes: if fp.cache == CacheUse::Bypassed {
                Vec::new()
            } else {
                fp.hashes
            },
            prompt_bytes: fp.prompt_bytes,
            model: Some(hearth_wire::names::capped_model(&fp.model)),
            max_output_tokens: fp.max_output_tokens,
            cache: fp.cache,
            ..RequestInfo::default()
        },
        Err(reason) => {
            tracing::debug!(%reason, "body not fingerprinted; routing on load");
            RequestInfo::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};

    fn headers(method: &str, path: &str, end_of_stream: bool) -> HttpHeaders {
        let hv = |k: &str, v: &str| HeaderValue {
            key: k.into(),
            raw_value: v.as_bytes().to_vec(),
            ..Default::default()
        };
        HttpHeaders {
            headers: Some(HeaderMap {
                headers: vec![hv(":method", method), hv(":path", path)],
            }),
            end_of_stream,
            ..Default::default()
        }
    }

    #[test]
    fn waits_only_for_prompt_bodies() {
        let chat = Some(Endpoint::ChatCompletions);
        assert_eq!(
            awaits_body(&headers("POST", "/v1/chat/completions", false)),
            chat
        );
        assert_eq!(
            awaits_body(&headers("POST", "/v1/completions?x=1", false)),
            Some(Endpoint::Completions)
        );
        assert_eq!(
            awaits_body(&headers("POST", "/v1/chat/completions", true)),
            None
        );
        assert_eq!(
            awaits_body(&headers("GET", "/v1/chat/completions", false)),
            None
        );
        assert_eq!(awaits_body(&headers("POST", "/v1/models", false)), None);
    }

    #[test]
    fn body_fingerprint_is_the_filters() {
        let body = br#"{"model":"m","messages":[{"role":"user","content":"hello"}]}"#;
        let info = request_info(Endpoint::ChatCompletions, body, 2048);
        let fp = fingerprint(Endpoint::ChatCompletions, body, &Params::default()).unwrap();
        assert_eq!(info.hashes, fp.hashes);
        assert_eq!(info.prompt_bytes, fp.prompt_bytes);
        assert_eq!(info.model.as_deref(), Some("m"));
        assert!(request_info(Endpoint::ChatCompletions, b"not json", 2048)
            .hashes
            .is_empty());
    }

    #[test]
    fn a_model_past_the_cap_is_kept_cut_and_matches_no_configured_model() {
        use hearth_wire::names::MAX_MODEL_BYTES;
        let listed = "m".repeat(MAX_MODEL_BYTES);
        // The configured name, then the client's: the same 256 bytes and more.
        let sent = format!("{listed}-and-more");
        let body = serde_json::json!({"model": sent, "prompt": "hello"}).to_string();
        let info = request_info(Endpoint::Completions, body.as_bytes(), 2048);
        let kept = info.model.clone().unwrap();
        assert!(kept.len() <= MAX_MODEL_BYTES + hearth_wire::names::CUT_MARK.len());
        assert!(kept.starts_with(&listed) && kept != listed);
        // Every replica lists its model: the cut name is an unknown model.
        let spec = format!("127.0.0.1:1;model={listed}").parse().unwrap();
        let router = hearth_router::Router::new(Default::default(), &[spec]);
        assert!(matches!(
            router.decide(&info),
            Err(hearth_router::RouteError::NoReplicaForModel(_))
        ));
    }
}

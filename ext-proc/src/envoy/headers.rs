//! Envoy's header maps on the ext_proc stream: reading a value, and
//! writing the headers the sidecar sets (and its immediate error answers).

use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, HeaderValueOption};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_response, HeaderMutation, HttpHeaders, HttpTrailers, ImmediateResponse,
    ProcessingResponse,
};

/// A header's value as text. Envoy sends values in `raw_value` (bytes);
/// older senders use `value`. A value that is not UTF-8 reads as empty.
pub fn text(hv: &HeaderValue) -> &str {
    if hv.raw_value.is_empty() {
        &hv.value
    } else {
        std::str::from_utf8(&hv.raw_value).unwrap_or("")
    }
}

/// The value of the header `name` (lowercase, as Envoy sends names).
pub fn get<'a>(h: &'a HttpHeaders, name: &str) -> Option<&'a str> {
    find(h.headers.as_ref(), name)
}

/// The value of the trailer `name` (lowercase).
pub fn trailer<'a>(t: &'a HttpTrailers, name: &str) -> Option<&'a str> {
    find(t.trailers.as_ref(), name)
}

fn find<'a>(map: Option<&'a HeaderMap>, name: &str) -> Option<&'a str> {
    map.into_iter()
        .flat_map(|m| &m.headers)
        .find(|hv| hv.key == name)
        .map(text)
}

/// Every header of the map.
pub fn all(h: &HttpHeaders) -> impl Iterator<Item = &HeaderValue> {
    h.headers.iter().flat_map(|m| &m.headers)
}

/// A header to set, replacing any value the request already had.
pub fn set(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_string(),
            raw_value: value.as_bytes().to_vec(),
            ..Default::default()
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..Default::default()
    }
}

/// A header map as Envoy sends it (values in `raw_value`), from pairs: for
/// tests and tools that speak to the sidecar.
pub fn map(pairs: &[(&str, &str)]) -> HttpHeaders {
    HttpHeaders {
        headers: Some(HeaderMap {
            headers: pairs
                .iter()
                .map(|(k, v)| HeaderValue {
                    key: k.to_string(),
                    raw_value: v.as_bytes().to_vec(),
                    ..Default::default()
                })
                .collect(),
        }),
        ..Default::default()
    }
}

/// An immediate answer with an OpenAI-shaped JSON error body (`type`,
/// `code`, `message`), `status`, and `extra` headers beside its content type;
/// `details` is what Envoy logs as the response's code details.
pub fn error_response(
    status: i32,
    kind: &str,
    code: &str,
    message: &str,
    extra: &[(&str, &str)],
    details: String,
) -> ProcessingResponse {
    let body = serde_json::json!({
        "error": {"message": message, "type": kind, "code": code, "param": null}
    });
    let mut headers = vec![set("content-type", "application/json")];
    headers.extend(extra.iter().map(|(k, v)| set(k, v)));
    ProcessingResponse {
        response: Some(processing_response::Response::ImmediateResponse(
            ImmediateResponse {
                status: Some(HttpStatus { code: status }),
                headers: Some(HeaderMutation {
                    set_headers: headers,
                    remove_headers: vec![],
                }),
                body: body.to_string().into_bytes(),
                details,
                ..Default::default()
            },
        )),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_read_from_raw_value_or_value() {
        let mut h = map(&[(":path", "/v1/chat/completions"), ("x-a", "1")]);
        assert_eq!(get(&h, ":path"), Some("/v1/chat/completions"));
        assert_eq!(get(&h, "x-b"), None);
        let legacy = &mut h.headers.as_mut().unwrap().headers[1];
        legacy.raw_value.clear();
        legacy.value = "2".into();
        assert_eq!(get(&h, "x-a"), Some("2"));
        h.headers.as_mut().unwrap().headers[0].raw_value = vec![0xff, 0xfe];
        assert_eq!(get(&h, ":path"), Some(""));
        assert_eq!(
            set("x-a", "1").append_action,
            HeaderAppendAction::OverwriteIfExistsOrAdd as i32
        );
    }
}

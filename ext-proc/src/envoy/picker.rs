//! The Gateway API Inference Extension's endpoint-picker protocol, as far
//! as it differs from Hearth's own ext_proc use.
//!
//! In the protocol's reference data plane, Envoy runs ext_proc with
//! `FULL_DUPLEX_STREAMED` request and response bodies and no wasm filter,
//! and routes with an `ORIGINAL_DST` cluster that reads the destination
//! header. In full-duplex mode Envoy streams body chunks without waiting
//! for answers, forwards nothing the server has not sent back (as
//! `StreamedBodyResponse` chunks), and accepts the answer to the request
//! headers at any time before the first body answer. So the sidecar holds
//! the request body ([`HeldBody`]), fingerprints it at the end of the
//! stream with the shared code, and only then answers the headers (with the
//! destination) followed by the body, re-chunked.
//!
//! The data plane may restrict the choice to a subset of endpoints
//! ([`subset_hint`]) and reports which endpoint served the request
//! ([`served_endpoint`]).

use std::net::SocketAddr;

use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_response, BodyMutation, BodyResponse, CommonResponse, HttpHeaders,
    ProcessingRequest, ProcessingResponse,
};
use envoy_types::pb::google::protobuf::value::Kind;

use hearth_router::Router;
use hearth_wire::names::{LB_NAMESPACE, SERVED_KEY, SUBSET_KEY, SUBSET_NAMESPACE};

/// Largest request body held for fingerprinting. Beyond it the request is
/// routed on load alone and the rest of the body streams straight through,
/// so a huge upload costs the sidecar at most this much memory.
pub const MAX_HELD_BODY: usize = 16 << 20;

/// Body chunks sent back to Envoy stay below the 64 KiB Envoy recommends.
const CHUNK: usize = 60 << 10;

/// A request body held until its end, in arrival order.
#[derive(Debug, Default)]
pub struct HeldBody {
    bytes: Vec<u8>,
}

impl HeldBody {
    /// Adds a chunk; `false` once the body has grown past [`MAX_HELD_BODY`]
    /// (the chunk is kept either way: nothing is lost).
    pub fn push(&mut self, chunk: &[u8]) -> bool {
        self.bytes.extend_from_slice(chunk);
        self.bytes.len() <= MAX_HELD_BODY
    }

    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The held body as request-body answers of at most [`CHUNK`] bytes;
    /// the last one carries `end_of_stream` when the body has ended. An
    /// empty body still gets one answer when it ends.
    pub fn into_responses(self, end_of_stream: bool) -> Vec<ProcessingResponse> {
        let mut out: Vec<ProcessingResponse> = Vec::new();
        let mut pieces = self.bytes.chunks(CHUNK).peekable();
        while let Some(piece) = pieces.next() {
            let last = pieces.peek().is_none();
            out.push(streamed(
                piece.to_vec(),
                last && end_of_stream,
                Side::Request,
            ));
        }
        if out.is_empty() && end_of_stream {
            out.push(streamed(Vec::new(), true, Side::Request));
        }
        out
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Request,
    Response,
}

/// A body chunk handed back unchanged in full-duplex mode.
pub fn streamed(body: Vec<u8>, end_of_stream: bool, side: Side) -> ProcessingResponse {
    let common = CommonResponse {
        body_mutation: Some(BodyMutation {
            mutation: Some(body_mutation::Mutation::StreamedResponse(
                envoy_types::pb::envoy::service::ext_proc::v3::StreamedBodyResponse {
                    body,
                    end_of_stream,
                    ..Default::default()
                },
            )),
        }),
        ..Default::default()
    };
    let response = BodyResponse {
        response: Some(common),
    };
    ProcessingResponse {
        response: Some(match side {
            Side::Request => processing_response::Response::RequestBody(response),
            Side::Response => processing_response::Response::ResponseBody(response),
        }),
        ..Default::default()
    }
}

/// The endpoints the data plane allows for this request: the
/// `envoy.lb.subset_hint` filter metadata when present, else the
/// `x-gateway-destination-endpoint-subset` header (comma-separated).
/// `None` when neither is set (choose from the whole registry); an empty
/// list is a hint that allows nothing.
pub fn subset_hint(msg: &ProcessingRequest, headers: &HttpHeaders) -> Option<Vec<String>> {
    let from_metadata = msg
        .metadata_context
        .as_ref()
        .and_then(|m| m.filter_metadata.get(SUBSET_NAMESPACE))
        .and_then(|s| s.fields.get(SUBSET_KEY))
        .map(|v| match &v.kind {
            Some(Kind::ListValue(list)) => list
                .values
                .iter()
                .filter_map(|v| match &v.kind {
                    Some(Kind::StringValue(s)) => Some(s.trim().to_string()),
                    _ => None,
                })
                .collect(),
            Some(Kind::StringValue(s)) => split_list(s),
            _ => Vec::new(),
        });
    from_metadata.or_else(|| crate::envoy::headers::get(headers, SUBSET_KEY).map(split_list))
}

fn split_list(s: &str) -> Vec<String> {
    s.split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .map(str::to_string)
        .collect()
}

/// The registry replicas a subset names (every rank of a data-parallel
/// endpoint). Entries that are not registry endpoints are ignored: the
/// sidecar only ever routes to its own replicas.
pub fn allowed_replicas(router: &Router, subset: &[String]) -> Vec<usize> {
    let wanted: Vec<SocketAddr> = subset.iter().filter_map(|e| e.parse().ok()).collect();
    router
        .replicas()
        .iter()
        .enumerate()
        .filter(|(_, r)| !r.retired && wanted.contains(&r.addr))
        .map(|(i, _)| i)
        .collect()
}

/// The endpoint the data plane reports as having served the request
/// (`envoy.lb` / `x-gateway-destination-endpoint-served`), when present.
pub fn served_endpoint(msg: &ProcessingRequest) -> Option<String> {
    let value = msg
        .metadata_context
        .as_ref()?
        .filter_metadata
        .get(LB_NAMESPACE)?
        .fields
        .get(SERVED_KEY)?;
    match &value.kind {
        Some(Kind::StringValue(s)) if !s.trim().is_empty() => Some(s.trim().to_string()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::config::core::v3::Metadata;
    use envoy_types::pb::google::protobuf::{ListValue, Struct, Value};
    use std::collections::HashMap;

    fn string(s: &str) -> Value {
        Value {
            kind: Some(Kind::StringValue(s.into())),
        }
    }

    fn with_metadata(namespace: &str, key: &str, value: Value) -> ProcessingRequest {
        ProcessingRequest {
            metadata_context: Some(Metadata {
                filter_metadata: HashMap::from([(
                    namespace.to_string(),
                    Struct {
                        fields: HashMap::from([(key.to_string(), value)]),
                    },
                )]),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn headers(pairs: &[(&str, &str)]) -> HttpHeaders {
        crate::envoy::headers::map(pairs)
    }

    #[test]
    fn subset_comes_from_metadata_then_the_header() {
        let list = Value {
            kind: Some(Kind::ListValue(ListValue {
                values: vec![string("10.0.0.1:8000"), string(" 10.0.0.2:8000 ")],
            })),
        };
        let msg = with_metadata(SUBSET_NAMESPACE, SUBSET_KEY, list);
        let h = headers(&[(SUBSET_KEY, "10.9.9.9:1")]);
        assert_eq!(
            subset_hint(&msg, &h).unwrap(),
            ["10.0.0.1:8000", "10.0.0.2:8000"]
        );
        let plain = ProcessingRequest::default();
        assert_eq!(subset_hint(&plain, &h).unwrap(), ["10.9.9.9:1".to_string()]);
        assert_eq!(subset_hint(&plain, &headers(&[])), None);
        // An empty list is a hint that allows nothing, not "no hint".
        let empty = Value {
            kind: Some(Kind::ListValue(ListValue { values: vec![] })),
        };
        let msg = with_metadata(SUBSET_NAMESPACE, SUBSET_KEY, empty);
        assert_eq!(subset_hint(&msg, &headers(&[])), Some(vec![]));
    }

    #[test]
    fn served_endpoint_is_read_from_envoy_lb() {
        let msg = with_metadata("envoy.lb", SERVED_KEY, string("10.0.0.3:8000"));
        assert_eq!(served_endpoint(&msg).as_deref(), Some("10.0.0.3:8000"));
        let other = with_metadata("elsewhere", SERVED_KEY, string("10.0.0.3:8000"));
        assert_eq!(served_endpoint(&other), None);
        assert_eq!(served_endpoint(&ProcessingRequest::default()), None);
    }

    #[test]
    fn held_body_goes_back_whole_in_bounded_chunks() {
        let mut held = HeldBody::default();
        let body: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        for piece in body.chunks(7000) {
            assert!(held.push(piece));
        }
        let responses = held.into_responses(true);
        let mut back = Vec::new();
        for (i, r) in responses.iter().enumerate() {
            let Some(processing_response::Response::RequestBody(b)) = &r.response else {
                panic!("not a request body answer")
            };
            let mutation = b.response.as_ref().unwrap().body_mutation.as_ref().unwrap();
            let Some(body_mutation::Mutation::StreamedResponse(s)) = &mutation.mutation else {
                panic!("not a streamed response")
            };
            assert!(s.body.len() <= CHUNK);
            assert_eq!(s.end_of_stream, i + 1 == responses.len());
            back.extend_from_slice(&s.body);
        }
        assert_eq!(back, body);
        // An empty body that ended still gets its end marker.
        assert_eq!(HeldBody::default().into_responses(true).len(), 1);
        assert!(HeldBody::default().into_responses(false).is_empty());
        // Past the cap the push reports it (and keeps the bytes).
        let mut big = HeldBody::default();
        assert!(!big.push(&vec![0; MAX_HELD_BODY + 1]));
        assert_eq!(big.bytes().len(), MAX_HELD_BODY + 1);
    }
}

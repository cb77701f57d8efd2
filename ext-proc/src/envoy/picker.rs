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
//! Held bodies are bounded across all streams by a [`HeldBudget`]
//! (`HEARTH_PICKER_HELD_BODIES`, `HEARTH_PICKER_HELD_BYTES`): a prompt
//! request past it gets a 429 at once, and whatever a stream held is given
//! back when its [`HeldBody`] is dropped, however the stream ends.
//!
//! The data plane may restrict the choice to a subset of endpoints
//! ([`subset_hint`]) and reports which endpoint served the request
//! ([`served_endpoint`]).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_response, BodyMutation, BodyResponse, CommonResponse, HttpHeaders,
    ProcessingRequest, ProcessingResponse,
};
use envoy_types::pb::google::protobuf::value::Kind;

use hearth_router::Router;
use hearth_wire::names::{LB_NAMESPACE, SERVED_KEY, SUBSET_KEY, SUBSET_NAMESPACE};

use crate::observe::metrics::PickerMetrics;

/// Largest request body held for fingerprinting. Beyond it the request is
/// routed on load alone and the rest of the body streams straight through,
/// so a huge upload costs the sidecar at most this much memory.
pub const MAX_HELD_BODY: usize = 16 << 20;

/// Body chunks sent back to Envoy stay below the 64 KiB Envoy recommends.
const CHUNK: usize = 60 << 10;

/// The bound on the request bodies held at once by all streams: how
/// many, and the bytes of their buffers (capacity, not length: what the
/// memory really is).
///
/// Bytes are shared by one rule: a body may grow only while, after the
/// growth, at least as many bytes stay free as it holds. So one body takes
/// at most half the budget, the largest bodies are the first refused when
/// bodies compete, and a small request still finds room while large ones
/// flood in. Cheap to clone (one budget, shared).
#[derive(Clone, Debug)]
pub struct HeldBudget {
    inner: Arc<BudgetInner>,
}

#[derive(Debug)]
struct BudgetInner {
    max_bodies: usize,
    max_bytes: usize,
    held: Mutex<Held>,
    metrics: PickerMetrics,
}

#[derive(Debug, Default)]
struct Held {
    bodies: usize,
    bytes: usize,
    peak: usize,
}

/// Why a body cannot be held now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OverBudget {
    /// `HEARTH_PICKER_HELD_BODIES` bodies are held already.
    Bodies,
    /// The body would grow past its share of `HEARTH_PICKER_HELD_BYTES`.
    Bytes,
}

impl HeldBudget {
    /// At most `max_bodies` bodies and `max_bytes` bytes at once; the
    /// figures go to `metrics`.
    pub fn new(max_bodies: usize, max_bytes: usize, metrics: PickerMetrics) -> HeldBudget {
        HeldBudget {
            inner: Arc::new(BudgetInner {
                max_bodies,
                max_bytes,
                held: Mutex::new(Held::default()),
                metrics,
            }),
        }
    }

    /// An empty body to fill, counted against the budget until dropped.
    pub fn hold(&self) -> Result<HeldBody, OverBudget> {
        let mut held = self.lock();
        if held.bodies >= self.inner.max_bodies {
            drop(held);
            self.inner.metrics.refused("bodies");
            return Err(OverBudget::Bodies);
        }
        held.bodies += 1;
        self.publish(&held);
        Ok(HeldBody {
            bytes: Vec::new(),
            budget: Some(self.clone()),
        })
    }

    /// Bodies and bytes held now.
    pub fn held(&self) -> (usize, usize) {
        let held = self.lock();
        (held.bodies, held.bytes)
    }

    /// A body's buffer grows from `from` to `to` bytes, if the rule allows.
    fn grow(&self, from: usize, to: usize) -> Result<(), OverBudget> {
        let mut held = self.lock();
        let after = held.bytes - from + to;
        if after.saturating_add(to) > self.inner.max_bytes {
            drop(held);
            self.inner.metrics.refused("bytes");
            return Err(OverBudget::Bytes);
        }
        held.bytes = after;
        held.peak = held.peak.max(after);
        self.publish(&held);
        Ok(())
    }

    /// A body of `bytes` bytes is let go.
    fn release(&self, bytes: usize) {
        let mut held = self.lock();
        held.bodies -= 1;
        held.bytes -= bytes;
        self.publish(&held);
    }

    fn publish(&self, held: &Held) {
        let m = &self.inner.metrics;
        m.held_bodies.set(held.bodies as i64);
        m.held_bytes.set(held.bytes as i64);
        m.held_bytes_peak.set(held.peak as i64);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Held> {
        self.inner.held.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl OverBudget {
    /// The 429 a request refused for it gets: an OpenAI-shaped error with
    /// `Retry-After`, as Hearth's other refusals.
    pub fn refusal(self) -> ProcessingResponse {
        let message = match self {
            OverBudget::Bodies => {
                "the gateway is holding as many request bodies as it may; retry shortly"
            }
            OverBudget::Bytes => {
                "the gateway cannot hold this request body now (its memory for request \
                 bodies is in use); retry shortly"
            }
        };
        let code = "request_bodies_full";
        crate::envoy::headers::error_response(
            429,
            "rate_limit_exceeded",
            code,
            message,
            &[("retry-after", "1")],
            format!("hearth_{code}"),
        )
    }
}

/// A request body held until its end, in arrival order; its buffer is
/// counted against its [`HeldBudget`] until it is dropped.
#[derive(Debug, Default)]
pub struct HeldBody {
    bytes: Vec<u8>,
    /// `None`: not counted (tests, tools).
    budget: Option<HeldBudget>,
}

impl Drop for HeldBody {
    fn drop(&mut self) {
        if let Some(budget) = self.budget.take() {
            budget.release(self.bytes.capacity());
        }
    }
}

impl HeldBody {
    /// Adds a chunk: `Ok(false)` once the body has grown past
    /// [`MAX_HELD_BODY`] (the chunk is kept either way: nothing is lost),
    /// `Err` when its budget cannot take it (nothing is added).
    pub fn push(&mut self, chunk: &[u8]) -> Result<bool, OverBudget> {
        let needed = self.bytes.len() + chunk.len();
        let capacity = self.bytes.capacity();
        if needed > capacity {
            // Double, as a Vec does, but not past the per-body cap: the
            // budget counts what is allocated.
            let target = needed.max((2 * capacity).min(MAX_HELD_BODY));
            if let Some(budget) = &self.budget {
                budget.grow(capacity, target)?;
            }
            self.bytes.reserve_exact(target - self.bytes.len());
            // An allocator may round up: count what it gave.
            if let Some(budget) = &self.budget {
                let mut held = budget.lock();
                held.bytes = held.bytes - target + self.bytes.capacity();
            }
        }
        self.bytes.extend_from_slice(chunk);
        Ok(self.bytes.len() <= MAX_HELD_BODY)
    }

    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The held body as request-body answers of at most [`CHUNK`] bytes;
    /// the last one carries `end_of_stream` when the body has ended. An
    /// empty body still gets one answer when it ends. (The answers are a
    /// copy, outside the budget for the moment it takes to send them.)
    /// With `priority` (`HEARTH_ENGINE_PRIORITY`), a whole JSON object
    /// goes with that value as its only top-level `priority` (Envoy sends
    /// a full-duplex body on without its `content-length`).
    pub fn into_responses(
        self,
        end_of_stream: bool,
        priority: Option<i64>,
    ) -> Vec<ProcessingResponse> {
        let written = priority
            .filter(|_| end_of_stream)
            .and_then(|value| hearth_wire::priority::set_priority(&self.bytes, value).ok());
        let bytes = written.as_deref().unwrap_or(&self.bytes);
        let mut out: Vec<ProcessingResponse> = Vec::new();
        let mut pieces = bytes.chunks(CHUNK).peekable();
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
            assert_eq!(held.push(piece), Ok(true));
        }
        let responses = held.into_responses(true, None);
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
        assert_eq!(HeldBody::default().into_responses(true, None).len(), 1);
        assert!(HeldBody::default().into_responses(false, None).is_empty());
        // Past the cap the push reports it (and keeps the bytes).
        let mut big = HeldBody::default();
        assert_eq!(big.push(&vec![0; MAX_HELD_BODY + 1]), Ok(false));
        assert_eq!(big.bytes().len(), MAX_HELD_BODY + 1);
    }

    const KB: usize = 1 << 10;
    const MB: usize = 1 << 20;

    #[test]
    fn the_budget_bounds_how_many_bodies_are_held_and_gives_them_back() {
        let metrics = PickerMetrics::default();
        let budget = HeldBudget::new(2, 64 * MB, metrics.clone());
        let a = budget.hold().unwrap();
        let b = budget.hold().unwrap();
        assert_eq!(budget.hold().unwrap_err(), OverBudget::Bodies);
        assert_eq!(metrics.held_bodies.get(), 2);
        drop(a);
        let c = budget.hold().unwrap();
        drop((b, c));
        assert_eq!(budget.held(), (0, 0));
        assert_eq!(metrics.held_bodies.get(), 0);
    }

    #[test]
    fn a_refusal_is_a_counted_json_429_with_retry_after() {
        let mut registry = prometheus_client::registry::Registry::default();
        let metrics = PickerMetrics::register(&mut registry);
        let budget = HeldBudget::new(1, MB, metrics);
        let _held = budget.hold().unwrap();
        let over = budget.hold().unwrap_err();
        assert_eq!(over, OverBudget::Bodies);
        for over in [over, OverBudget::Bytes] {
            let Some(processing_response::Response::ImmediateResponse(ir)) =
                over.refusal().response
            else {
                panic!("{over:?}: not an immediate response")
            };
            assert_eq!(ir.status.unwrap().code, 429, "{over:?}");
            let body: serde_json::Value = serde_json::from_slice(&ir.body).unwrap();
            assert_eq!(body["error"]["code"], "request_bodies_full", "{body}");
            assert_eq!(body["error"]["type"], "rate_limit_exceeded", "{body}");
            let set: Vec<(String, Vec<u8>)> = ir
                .headers
                .unwrap()
                .set_headers
                .into_iter()
                .map(|h| {
                    let h = h.header.unwrap();
                    (h.key, h.raw_value)
                })
                .collect();
            assert!(
                set.contains(&("retry-after".into(), b"1".to_vec())),
                "{set:?}"
            );
            assert!(
                set.contains(&("content-type".into(), b"application/json".to_vec())),
                "{set:?}"
            );
        }
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(
            text.contains("hearth_picker_refused_total{reason=\"bodies\"} 1"),
            "{text}"
        );
    }

    #[test]
    fn a_body_grows_only_while_as_much_stays_free_as_it_holds() {
        let metrics = PickerMetrics::default();
        let budget = HeldBudget::new(8, 8 * MB, metrics.clone());
        let chunk = vec![7u8; 64 * KB];
        // Alone, a body gets half the budget, no more.
        let mut big = budget.hold().unwrap();
        let mut pushed = 0;
        let refused = loop {
            match big.push(&chunk) {
                Ok(_) => pushed += chunk.len(),
                Err(e) => break e,
            }
            assert!(pushed <= 8 * MB, "never refused");
        };
        assert_eq!(refused, OverBudget::Bytes);
        assert_eq!(big.bytes().len(), pushed, "a refused chunk is not kept");
        let (_, bytes) = budget.held();
        assert!(bytes <= 4 * MB, "{bytes}");
        assert!(pushed >= 2 * MB, "{pushed}");
        // A small request still finds room next to it.
        let mut small = budget.hold().unwrap();
        assert_eq!(small.push(&[1; 2000]), Ok(true));
        // The figures are published, the peak kept; dropping gives all back.
        assert_eq!(metrics.held_bytes.get() as usize, budget.held().1);
        assert!(metrics.held_bytes_peak.get() as usize >= bytes);
        drop((big, small));
        assert_eq!(budget.held(), (0, 0));
        assert_eq!(metrics.held_bytes.get(), 0);
    }

    #[test]
    fn competing_large_bodies_are_refused_before_small_ones() {
        let budget = HeldBudget::new(64, 16 * MB, PickerMetrics::default());
        let chunk = vec![0u8; 64 * KB];
        // Sixteen bodies grow in turn, as a flood would.
        let mut large: Vec<Option<HeldBody>> =
            (0..16).map(|_| Some(budget.hold().unwrap())).collect();
        for _round in 0..64 {
            for slot in large.iter_mut() {
                if let Some(body) = slot {
                    if body.push(&chunk).is_err() {
                        *slot = None; // refused: the stream ends, its memory returns
                    }
                }
            }
            assert!(budget.held().1 <= 16 * MB);
            // Between the large bodies' chunks, ordinary requests get in.
            let mut small = budget.hold().unwrap();
            assert_eq!(small.push(&[1; 4000]), Ok(true), "round {_round}");
        }
        assert!(
            large.iter().any(Option::is_none),
            "some large body was refused"
        );
    }
}

//! The `envoy.service.ext_proc.v3.ExternalProcessor` service.
//!
//! Envoy opens one gRPC stream per HTTP request and sends the request
//! headers, then the response headers. Because Hearth's processing mode
//! asks for response trailers, Envoy keeps the stream open until the HTTP
//! stream is over (the last byte of a streamed response, a client abort,
//! an upstream reset, a timeout) and then closes it, without a trailers
//! message when the engine sent no trailers (checked on Envoy 1.40 by the
//! end-to-end stream test; with trailers SKIP the stream would end right
//! after the response headers). So the
//! routing decision, with its load reservation, lives in the task that
//! serves the stream: however the stream ends, the task ends and the
//! reservation is released.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_request, processing_response, BodyMutation, BodyResponse,
    CommonResponse, HeaderMutation, HeadersResponse, HttpBody, HttpHeaders, HttpTrailers,
    ProcessingRequest, ProcessingResponse, ProtocolConfiguration, TrailersResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
use futures::Stream;
use hearth_wire::header;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use hearth_router::{Decision, DropReason, Replica, RequestInfo, Reservation, RouteError, Router};
use hearth_wire::names::{
    self, DESTINATION, DP_RANK, DROP_REASON, LB_NAMESPACE, REQUEST_ID, UPSTREAM,
};
use hearth_wire::outcome::{self, Scanner};
use hearth_wire::priority;
use hearth_wire::{CacheUse, Endpoint};

use crate::envoy::body;
use crate::envoy::ending;
use crate::envoy::headers;
use crate::envoy::picker::{self, HeldBody, HeldBudget, Side};
use crate::flow::{Admission, Class, Dispatch, FlowControl, Left, Ticket};
use crate::observe::usage::VerdictChannel;
use crate::observe::Observer;
use crate::outcomes::{Outcomes, StreamEnd};

/// The ext_proc filter's attribute namespace in `ProcessingRequest.attributes`.
const EXT_PROC_ATTRIBUTES: &str = "envoy.filters.http.ext_proc";

/// Builds the tonic service around a router (the observer's), which
/// reports every decision to the observer.
pub fn server(
    observer: Arc<Observer>,
    outcomes: Arc<Outcomes>,
    first_byte: FirstByte,
    held: HeldBudget,
    flow: Arc<FlowControl>,
) -> ExternalProcessorServer<Processor> {
    ExternalProcessorServer::new(Processor {
        router: Arc::clone(observer.router()),
        observer,
        outcomes,
        first_byte,
        held,
        flow,
    })
    // Body mode sends whole request bodies (up to the gateway's 8 MiB).
    .max_decoding_message_size(16 << 20)
}

pub struct Processor {
    router: Arc<Router>,
    observer: Arc<Observer>,
    outcomes: Arc<Outcomes>,
    first_byte: FirstByte,
    /// Endpoint-picker mode: the bound on held bodies, all streams.
    held: HeldBudget,
    /// Where requests wait while the fleet is saturated.
    flow: Arc<FlowControl>,
}

/// How long a routed request may wait for its response headers before
/// the wait counts as a timeout against its replica: a base, plus an
/// allowance for the prompt bytes the replica has to prefill.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FirstByte {
    /// Zero disables the deadline.
    pub timeout: Duration,
    /// One more second per this many uncached bytes (0: no allowance).
    pub prefill_bytes_per_second: u64,
}

impl FirstByte {
    /// The deadline for a request whose chosen replica lacks `uncached`
    /// prompt bytes; `None` when disabled.
    pub fn deadline(&self, uncached: u64) -> Option<Duration> {
        if self.timeout.is_zero() {
            return None;
        }
        let allowance = match self.prefill_bytes_per_second {
            0 => Duration::ZERO,
            rate => Duration::from_secs_f64(uncached as f64 / rate as f64),
        };
        Some(self.timeout + allowance)
    }
}

type ResponseStream = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for Processor {
    type ProcessStream = ResponseStream;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(4);
        let mut exchange = Exchange::new(
            Arc::clone(&self.router),
            Arc::clone(&self.observer),
            Arc::clone(&self.outcomes),
            self.held.clone(),
            Arc::clone(&self.flow),
        );
        let first_byte = self.first_byte;
        tokio::spawn(async move {
            loop {
                // Armed while a routed request waits for its response.
                let deadline = exchange
                    .waiting_for_response()
                    .and(exchange.routed.as_ref())
                    .and_then(|r| first_byte.deadline(r.uncached_bytes));
                let event = tokio::select! {
                    msg = inbound.message() => Event::Message(msg),
                    // Envoy reset the stream: nobody reads our answers.
                    () = tx.closed() => break,
                    // The request waited in the flow-control queue: it left.
                    out = dispatched(exchange.queued.as_mut()) => Event::Dispatched(out),
                    () = tokio::time::sleep(deadline.unwrap_or_default()), if deadline.is_some() => {
                        Event::FirstByte
                    }
                };
                let (replies, done) = match event {
                    Event::Message(Ok(Some(msg))) => exchange.handle(msg),
                    // The stream ended (a waiting request's client went
                    // away: its ticket leaves the queue with `exchange`).
                    Event::Message(_) => break,
                    Event::Dispatched(out) => exchange.on_dispatch(out),
                    Event::FirstByte => {
                        exchange.first_byte_timed_out();
                        continue;
                    }
                };
                let mut gone = false;
                for reply in replies {
                    if tx.send(Ok(reply)).await.is_err() {
                        gone = true;
                        break;
                    }
                }
                if done || gone {
                    break;
                }
            }
            // `exchange` (and its reservation) is dropped here.
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// What woke a stream's task.
enum Event {
    Message(Result<Option<ProcessingRequest>, Status>),
    /// Its request left the flow-control queue (`None`: the queue is gone,
    /// the sidecar is stopping).
    Dispatched(Option<Dispatch>),
    FirstByte,
}

/// Resolves when the queued request (if any) leaves the queue.
async fn dispatched(queued: Option<&mut Queued>) -> Option<Dispatch> {
    match queued {
        Some(q) => (&mut q.ticket.from).await.ok(),
        None => std::future::pending().await,
    }
}

/// A request waiting in the flow-control queue, and what its answer
/// needs once it leaves.
struct Queued {
    ticket: Ticket,
    answer: Answer,
    /// Full duplex: the held body, and whether it ended, handed back
    /// after the headers' answer.
    held: Option<(HeldBody, bool)>,
}

/// Which message the decision answers: the request headers (filter and
/// endpoint-picker shapes), or the buffered body (body mode).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Answer {
    Headers,
    Body,
}

impl Answer {
    fn wrap(self, common: CommonResponse) -> processing_response::Response {
        match self {
            Answer::Headers => processing_response::Response::RequestHeaders(HeadersResponse {
                response: Some(common),
            }),
            Answer::Body => processing_response::Response::RequestBody(BodyResponse {
                response: Some(common),
            }),
        }
    }
}

/// How Envoy sends this stream's request body: which of Hearth's shapes
/// the stream runs in (from the processing mode of its first message).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BodyMode {
    /// Filter mode: no body comes; the wasm filter's headers carry the
    /// fingerprint, and the request is routed on its headers.
    #[default]
    Headers,
    /// Body mode (no wasm filter): a prompt request's whole body comes in
    /// one message (`BUFFERED`) and is fingerprinted here; the request is
    /// routed on its body (see [`crate::envoy::body`]).
    Buffered,
    /// The endpoint-picker shape: bodies stream full-duplex; a prompt
    /// request's body is held, with its headers unanswered, until it is
    /// complete and decided on (see [`crate::envoy::picker`]).
    FullDuplex,
}

impl BodyMode {
    pub fn of(protocol: &ProtocolConfiguration) -> BodyMode {
        match protocol.request_body_mode() {
            BodySendMode::Buffered => BodyMode::Buffered,
            BodySendMode::FullDuplexStreamed => BodyMode::FullDuplex,
            _ => BodyMode::Headers,
        }
    }

    /// The request's own body is the prompt's only truth: client-sent
    /// fingerprint headers are ignored.
    fn bodies_come(self) -> bool {
        self != BodyMode::Headers
    }
}

/// One HTTP request's conversation with Envoy: one method per message
/// kind, in the order they come (request headers, request body, request
/// trailers, response headers, response body, response trailers).
struct Exchange {
    router: Arc<Router>,
    observer: Arc<Observer>,
    flow: Arc<FlowControl>,
    /// The request's band and flow, from its headers.
    class: Class,
    /// Waiting in the flow-control queue.
    queued: Option<Queued>,
    /// Where the request's end goes.
    outcomes: Arc<Outcomes>,
    mode: BodyMode,
    /// Response bodies come full-duplex: each chunk is answered with
    /// itself.
    response_duplex: bool,
    /// Envoy's `x-request-id`, for the decision journal.
    request_id: Option<String>,
    /// The replicas the data plane allows (the endpoint-picker protocol's
    /// subset hint), when it named any.
    subset: Option<Vec<usize>>,
    /// A prompt request whose body is awaited before it is routed
    /// (`Buffered` and `FullDuplex` modes).
    pending: Option<Endpoint>,
    /// Full duplex: the request body held until the decision.
    held: Option<HeldBody>,
    /// Body mode with `HEARTH_ENGINE_PRIORITY`: the request body, kept
    /// until the decision writes its priority into it.
    body: Option<Vec<u8>>,
    /// The engine priority the decision gave (`HEARTH_ENGINE_PRIORITY`),
    /// for the held body in full duplex.
    engine_priority: Option<i64>,
    /// Filter mode: a POST to a generation path.
    generation_path: bool,
    budget: HeldBudget,
    /// The request is a generation (a prompt request whose body Envoy
    /// sends): its answer is scanned.
    generation: bool,
    /// What the decision said, kept for the rest of the exchange.
    routed: Option<Routed>,
    /// The load the decision reserved, released when the answer ends.
    reservation: Option<Reservation>,
    /// The first-byte timeout already counted against the replica.
    timed_out: bool,
    /// What the response headers said, once they came.
    response: Option<ResponseSeen>,
    /// Where ext_proc sends response bodies (body and endpoint-picker
    /// shapes, which have no wasm outcome filter): a generation's answer,
    /// scanned as it passes; judged once its last chunk has come.
    answer: Option<Scanner>,
    answer_ended: bool,
    /// Filter shapes: the verdict and usage the outcome filter put in a
    /// streamed answer's trailer ([`outcome::TRAILER`]).
    reported: Option<(outcome::Answer, Option<outcome::Usage>)>,
    /// The ticket the decision's prediction waits under until the answer
    /// ends (see [`crate::outcomes`]).
    ticket: Option<String>,
}

/// Type alias for the answers to one message, and whether the exchange is
/// over (full-duplex mode answers the request headers and the whole body
/// at once).
type Replies = (Vec<ProcessingResponse>, bool);

/// What an exchange keeps of its decision once it is made: everything the
/// response and the outcome need, so neither asks the router again.
struct Routed {
    /// The replica chosen.
    chosen: usize,
    /// The chosen replica, then the fallbacks Envoy may retry on.
    order: Vec<usize>,
    /// The replica table the indices refer to.
    replicas: Arc<[Replica]>,
    /// Prompt bytes the chosen replica did not hold (its prefill work).
    uncached_bytes: u64,
    /// The prompt's block hashes, should Envoy serve it elsewhere (a retry
    /// on a fallback) and its warmth follow.
    hashes: Vec<u64>,
}

impl Routed {
    /// The replica of the decision's order at `addr` (the one Envoy
    /// really used), the chosen one first.
    fn at(&self, addr: &str) -> Option<usize> {
        self.order
            .iter()
            .copied()
            .find(|&i| self.replicas[i].addr.to_string() == addr)
    }
}

struct ResponseSeen {
    status: Option<u16>,
    details: String,
    /// The replica Envoy really used (after retries), when known.
    served: Option<usize>,
}

impl Drop for Exchange {
    /// The stream ended, however it ended: its end goes through the one
    /// door ([`Outcomes::stream_ended`]) in the router's words.
    fn drop(&mut self) {
        let Some(chosen) = self.routed.as_ref().map(|r| r.chosen) else {
            return;
        };
        let answer = self
            .answer
            .as_ref()
            .filter(|_| self.answer_ended)
            .map(|scan| (scan.answer(), scan.usage()))
            .or(self.reported)
            .map(|(answer, usage)| (answer, usage.map(Into::into)));
        if answer.is_some() {
            self.observer.verdict(match self.reported {
                Some(_) => VerdictChannel::Trailer,
                None => VerdictChannel::Body,
            });
        }
        let response = self.response.as_ref();
        self.outcomes.stream_ended(StreamEnd {
            chosen,
            served: response.and_then(|r| r.served),
            ending: response
                .map(|r| ending::ending(r.status.unwrap_or(0), &r.details, answer.map(|(a, _)| a))),
            answer,
            // Where the body comes through ext_proc, or the outcome filter's
            // trailer came, this stream carries the answer; elsewhere the
            // outcome filter's report closes the ticket.
            ticket: self
                .ticket
                .as_deref()
                .filter(|_| self.mode.bodies_come() || self.reported.is_some()),
            request_id: self.request_id.as_deref(),
        });
    }
}

impl Exchange {
    fn new(
        router: Arc<Router>,
        observer: Arc<Observer>,
        outcomes: Arc<Outcomes>,
        budget: HeldBudget,
        flow: Arc<FlowControl>,
    ) -> Self {
        Exchange {
            router,
            observer,
            flow,
            class: Class::default(),
            queued: None,
            outcomes,
            budget,
            mode: BodyMode::default(),
            response_duplex: false,
            request_id: None,
            subset: None,
            pending: None,
            held: None,
            body: None,
            engine_priority: None,
            generation_path: false,
            generation: false,
            routed: None,
            reservation: None,
            timed_out: false,
            response: None,
            answer: None,
            answer_ended: false,
            reported: None,
            ticket: None,
        }
    }

    /// `Some(replica)` while a routed request has no response yet and its
    /// first-byte timeout has not fired.
    fn waiting_for_response(&self) -> Option<usize> {
        match (&self.routed, &self.response, self.timed_out) {
            (Some(r), None, false) => Some(r.chosen),
            _ => None,
        }
    }

    fn first_byte_timed_out(&mut self) {
        if let Some(r) = self.waiting_for_response() {
            self.timed_out = true;
            self.outcomes.first_byte_missed(r);
        }
    }

    /// Answers one message.
    fn handle(&mut self, msg: ProcessingRequest) -> Replies {
        use processing_request::Request as R;
        if msg.observability_mode {
            return (vec![], false);
        }
        if let Some(protocol) = &msg.protocol_config {
            self.mode = BodyMode::of(protocol);
            self.response_duplex =
                protocol.response_body_mode() == BodySendMode::FullDuplexStreamed;
        }
        match msg.request {
            Some(R::RequestHeaders(ref h)) => self.on_request_headers(&msg, h),
            Some(R::RequestBody(b)) => self.on_request_body(b),
            Some(R::RequestTrailers(_)) => self.on_request_trailers(),
            Some(R::ResponseHeaders(ref h)) => self.on_response_headers(&msg, h),
            Some(R::ResponseBody(b)) => self.on_response_body(b),
            Some(R::ResponseTrailers(ref t)) => self.on_response_trailers(t),
            None => (vec![], false),
        }
    }

    fn on_request_headers(&mut self, msg: &ProcessingRequest, h: &HttpHeaders) -> Replies {
        // Bounded: a request id is an id, not a payload.
        self.request_id = headers::get(h, REQUEST_ID)
            .filter(|id| !id.is_empty())
            .map(names::capped_request_id);
        self.class = self.flow.class(h);
        if let Some(subset) = picker::subset_hint(msg, h) {
            let allowed = picker::allowed_replicas(&self.router, &subset);
            if allowed.is_empty() {
                // The protocol: an empty subset, or none of ours, is a 503.
                let e = RouteError::NoHealthyReplica(String::new());
                self.observer.refused(
                    self.request_id.as_deref(),
                    &RequestInfo::default(),
                    &e,
                    Duration::ZERO,
                );
                return (vec![refusal(&e)], true);
            }
            self.subset = Some(allowed);
        }
        if self.mode.bodies_come() {
            self.pending = body::awaits_body(h);
            self.generation = self.pending.is_some();
        } else {
            // Filter mode: a generation whose body the filter did not
            // fingerprint (past its `max_body_bytes`) still gets its
            // engine priority written.
            self.generation_path = body::awaits_body(h).is_some();
        }
        match (self.mode, self.pending.is_some()) {
            // Full duplex: a prompt request's headers are answered once its
            // body is in and decided on.
            (BodyMode::FullDuplex, true) => match self.budget.hold() {
                Ok(held) => {
                    self.held = Some(held);
                    (vec![], false)
                }
                Err(over) => (vec![over.refusal()], true),
            },
            // Body mode: a prompt request is routed once its body is in.
            (BodyMode::Buffered, true) => {
                let go_on = processing_response::Response::RequestHeaders(Default::default());
                (vec![reply(go_on, None)], false)
            }
            _ => {
                let info = if self.mode.bodies_come() {
                    // Not a prompt request; and with bodies coming, the
                    // body is the only truth: no client-sent fingerprint.
                    RequestInfo::default()
                } else {
                    request_info(h, self.router.block_size())
                };
                self.route(info, Answer::Headers)
            }
        }
    }

    fn on_request_body(&mut self, b: HttpBody) -> Replies {
        match self.mode {
            // Full duplex: hold the body until its end, then decide.
            BodyMode::FullDuplex => {
                let Some(held) = self.held.as_mut() else {
                    // Already routed: the chunk goes straight back.
                    return (
                        vec![picker::streamed(b.body, b.end_of_stream, Side::Request)],
                        false,
                    );
                };
                let within = match held.push(&b.body) {
                    Ok(within) => within,
                    Err(over) => return (vec![over.refusal()], true),
                };
                if !within && self.flow.writes_engine_priority() {
                    // Past the hold's cap the rest would stream on
                    // unwritten, with its client's own `priority`.
                    self.held = None;
                    return (vec![too_large_for_priority()], true);
                }
                if b.end_of_stream || !within {
                    self.release_held(b.end_of_stream, within)
                } else {
                    (vec![], false)
                }
            }
            // Body mode: the request waited for this body; route it now.
            BodyMode::Buffered if b.end_of_stream && self.pending.is_some() => {
                let endpoint = self.pending.take();
                let info = endpoint.map_or_else(RequestInfo::default, |e| {
                    body::request_info(e, &b.body, self.router.block_size())
                });
                if self.flow.writes_engine_priority() && info.model.is_some() {
                    self.body = Some(b.body);
                }
                self.route(info, Answer::Body)
            }
            // Other bodies are not requested by Hearth's processing modes;
            // answer them unchanged if sent.
            _ => (
                vec![ProcessingResponse {
                    response: Some(processing_response::Response::RequestBody(
                        Default::default(),
                    )),
                    ..Default::default()
                }],
                false,
            ),
        }
    }

    fn on_request_trailers(&mut self) -> Replies {
        // Full duplex: trailers mark the end of a held body.
        let (mut replies, done) = if self.held.is_some() {
            self.release_held(false, true)
        } else {
            (vec![], false)
        };
        if done {
            return (replies, true);
        }
        replies.push(ProcessingResponse {
            response: Some(processing_response::Response::RequestTrailers(
                TrailersResponse::default(),
            )),
            ..Default::default()
        });
        (replies, false)
    }

    fn on_response_headers(&mut self, msg: &ProcessingRequest, h: &HttpHeaders) -> Replies {
        // The endpoint-picker protocol's report wins over Envoy's
        // attribute (both name the endpoint really used).
        let served =
            picker::served_endpoint(msg).or_else(|| attribute(&msg.attributes, "upstream.address"));
        let routed = self.routed.as_ref();
        let seen = ResponseSeen {
            status: headers::get(h, ":status").and_then(|s| s.parse().ok()),
            details: attribute(&msg.attributes, "response.code_details").unwrap_or_default(),
            served: served.as_deref().zip(routed).and_then(|(a, r)| r.at(a)),
        };
        // Envoy retried on a fallback: the prompt is warm where it was
        // served, not (only) where it was sent first.
        if let Some(r) = routed {
            if let Some(s) = seen.served.filter(|&s| s != r.chosen) {
                self.router.record_served_elsewhere(s, &r.hashes);
            }
        }
        // A generation's 200 answer: its body tells whether the engine
        // generated (when ext_proc sends it).
        if self.generation && seen.status == Some(200) && !h.end_of_stream {
            self.answer = Some(Scanner::default());
        }
        self.response = Some(seen);
        let mut reply = self.upstream_header();
        if !self.mode.bodies_come() && self.ticket.is_some() {
            // Filter shapes: the outcome filter may now hand the verdict
            // over as a trailer (`hearth_wire::outcome::METADATA_NAMESPACE`).
            reply.dynamic_metadata = Some(trailers_taken_metadata());
        }
        (vec![reply], h.end_of_stream)
    }

    fn on_response_body(&mut self, b: HttpBody) -> Replies {
        if let Some(scan) = self.answer.as_mut() {
            if !b.body.is_empty() {
                // The answer's first chunk: the engine has read the prompt.
                if let Some(r) = &self.reservation {
                    r.prefill().done();
                }
            }
            scan.feed(&b.body);
            self.answer_ended |= b.end_of_stream;
        }
        if b.end_of_stream {
            self.reservation = None;
        }
        let reply = if self.response_duplex {
            picker::streamed(b.body, b.end_of_stream, Side::Response)
        } else {
            ProcessingResponse {
                response: Some(processing_response::Response::ResponseBody(
                    Default::default(),
                )),
                ..Default::default()
            }
        };
        (vec![reply], false)
    }

    fn on_response_trailers(&mut self, t: &HttpTrailers) -> Replies {
        let mut trailers = TrailersResponse::default();
        if let Some(value) = headers::trailer(t, outcome::TRAILER) {
            // Filter shapes: the outcome filter's verdict on a streamed
            // 200 answer to a request routed here (a malformed one counts
            // as none); never passed on to the client.
            let answered = self.response.as_ref().and_then(|r| r.status) == Some(200);
            if !self.mode.bodies_come() && self.ticket.is_some() && answered {
                self.reported = outcome::parse_trailer(value);
            }
            trailers.header_mutation = Some(HeaderMutation {
                set_headers: vec![],
                remove_headers: vec![outcome::TRAILER.to_string()],
            });
        }
        let reply = ProcessingResponse {
            response: Some(processing_response::Response::ResponseTrailers(trailers)),
            ..Default::default()
        };
        // Only when the engine sent trailers: the response is over.
        self.reservation = None;
        (vec![reply], true)
    }

    /// Full duplex: the held body is complete (or too big to hold): decide,
    /// answer the request headers with the destination, then hand the body
    /// back. A body past the cap is routed on load alone.
    fn release_held(&mut self, end_of_stream: bool, fingerprint: bool) -> Replies {
        let held = self.held.take().unwrap_or_default();
        let info = match self.pending.take() {
            Some(endpoint) if fingerprint => {
                body::request_info(endpoint, held.bytes(), self.router.block_size())
            }
            _ => RequestInfo::default(),
        };
        let (mut replies, done) = self.route(info, Answer::Headers);
        match self.queued.as_mut() {
            // The body goes back once the request leaves the queue.
            Some(q) => q.held = Some((held, end_of_stream)),
            None if !done => {
                replies.extend(held.into_responses(end_of_stream, self.engine_priority))
            }
            None => {}
        }
        (replies, done)
    }

    /// Routes `info`: decided now, refused by flow control, or queued
    /// until the fleet has room for it (Envoy's deadline for this answer
    /// is then extended to the queue's time to live). The destination
    /// goes out in the response `answer` names.
    fn route(&mut self, info: RequestInfo, answer: Answer) -> Replies {
        let held = self.body.as_ref().map_or(0, |b| b.len() as u64);
        match self
            .flow
            .admit_holding(info, self.subset.as_deref(), &self.class, held)
        {
            Admission::Decide(info, open) => {
                let started = std::time::Instant::now();
                let allowed = open.as_deref().or(self.subset.as_deref());
                let decided = self.router.decide_within(&info, allowed);
                self.decided(info, decided, started.elapsed(), None, answer)
            }
            Admission::Refuse(info, reason) => {
                self.note_drop(&info, reason, None);
                (vec![dropped(reason)], true)
            }
            Admission::Wait(ticket) => {
                self.queued = Some(Queued {
                    ticket,
                    answer,
                    held: None,
                });
                let more_time = ProcessingResponse {
                    override_message_timeout: Some(proto_duration(self.flow.answer_deadline())),
                    ..Default::default()
                };
                (vec![more_time], false)
            }
        }
    }

    /// The request left the flow-control queue: its answer goes out now.
    fn on_dispatch(&mut self, out: Option<Dispatch>) -> Replies {
        let Some(queued) = self.queued.take() else {
            return (vec![], false);
        };
        let Some(Dispatch { left, info, waited }) = out else {
            // The queue is gone: the sidecar is stopping.
            let e = RouteError::NoHealthyReplica(String::new());
            return (vec![refusal(&e)], true);
        };
        let (mut replies, done) = match left {
            Left::Decided { decided, elapsed } => {
                self.decided(info, *decided, elapsed, Some(waited), queued.answer)
            }
            Left::Dropped(reason) => {
                self.note_drop(&info, reason, Some(waited));
                (vec![dropped(reason)], true)
            }
        };
        if let (Some((held, end_of_stream)), false) = (queued.held, done) {
            replies.extend(held.into_responses(end_of_stream, self.engine_priority));
        }
        (replies, done)
    }

    /// Counts and journals a flow-control 429.
    fn note_drop(&self, info: &RequestInfo, reason: DropReason, waited: Option<Duration>) {
        self.observer
            .flow_dropped(self.request_id.as_deref(), info, reason, waited);
    }

    /// Answers with a decision made for `info` (after `waited` in the
    /// flow-control queue, when it waited).
    fn decided(
        &mut self,
        info: RequestInfo,
        decided: Result<Decision, RouteError>,
        elapsed: Duration,
        waited: Option<Duration>,
        answer: Answer,
    ) -> Replies {
        let decided = match decided {
            // Within a subset, "no replica for the model" means none of the
            // allowed endpoints is eligible: the protocol's 503.
            Err(RouteError::NoReplicaForModel(m)) if self.subset.is_some() => {
                Err(RouteError::NoHealthyReplica(m))
            }
            other => other,
        };
        let request_id = self.request_id.as_deref();
        match &decided {
            Ok(d) => self
                .observer
                .routed_after(request_id, &info, d, elapsed, waited),
            Err(e) => self.observer.refused(request_id, &info, e, elapsed),
        }
        match decided {
            Ok(decision) => {
                // The endpoint-picker protocol's Envoy data planes dial the
                // header with an ORIGINAL_DST cluster, which takes one
                // address (a list fails as "no healthy upstream", measured
                // on Envoy 1.40): in full-duplex mode, the primary only.
                let limit = if self.mode == BodyMode::FullDuplex {
                    1
                } else {
                    decision.order.len()
                };
                let dest = decision.destination(limit);
                tracing::debug!(
                    destination = %dest,
                    overlap = decision.overlap,
                    blocks = info.hashes.len(),
                    "routed"
                );
                // A data-parallel target: tell the engine which rank.
                let rank = decision.replicas[decision.primary()].dp_rank;
                // A generation's answer will be compared with the
                // prediction: the prediction waits under a ticket of the
                // sidecar's own, which the outcome filter's report names
                // (filter shapes) or this stream closes (body shapes).
                let mut set_headers = vec![headers::set(DESTINATION, &dest)];
                if info.model.is_some() {
                    let ticket = self.outcomes.issue_ticket(
                        decision.prediction,
                        decision.prefill().clone(),
                        self.request_id.as_deref(),
                        info.model.as_deref(),
                    );
                    if !self.mode.bodies_come() {
                        set_headers.push(headers::set(header::TICKET, &ticket));
                        // The outcome filter posts the first chunk only
                        // when asked (`trailer_reports`): a post per
                        // answer costs the gateway more than a small
                        // prompt's early release is worth.
                        if decision.first_token_matters() {
                            set_headers.push(headers::set(outcome::FIRST_CHUNK_HEADER, "1"));
                        }
                    }
                    self.ticket = Some(ticket);
                }
                // Its place in the engine's queue: in filter mode for the
                // outcome filter to write into the body (a generation too
                // large for the fingerprint as well: else its client's own
                // `priority` would go on); in the body shapes written here.
                let tag = decision.reservation.engine_tag();
                if let Some(tag) = tag.filter(|_| info.model.is_some() || self.generation_path) {
                    self.engine_priority = self.flow.engine_priority(&self.class, tag);
                    if let (Some(value), BodyMode::Headers) = (self.engine_priority, self.mode) {
                        set_headers.push(headers::set(priority::HEADER, &value.to_string()));
                    }
                }
                // Body mode: the body goes on with its priority written,
                // and its length (Envoy keeps a buffered body's
                // content-length and refuses one that does not match).
                let mut body_mutation = None;
                if let (Some(value), Some(body)) = (self.engine_priority, self.body.take()) {
                    if let Ok(new) = priority::set_priority(&body, value) {
                        set_headers.push(headers::set("content-length", &new.len().to_string()));
                        body_mutation = Some(BodyMutation {
                            mutation: Some(body_mutation::Mutation::Body(new)),
                        });
                    }
                }
                let uncached_bytes = decision.uncached_bytes();
                let Decision {
                    order,
                    replicas,
                    reservation,
                    ..
                } = decision;
                self.routed = Some(Routed {
                    chosen: order[0],
                    order,
                    replicas,
                    uncached_bytes,
                    // Moved, not copied.
                    hashes: info.hashes,
                });
                self.reservation = Some(reservation);
                let mut remove_headers = vec![header::FP.to_string()];
                match rank {
                    Some(rank) => set_headers.push(headers::set(DP_RANK, &rank.to_string())),
                    // Only the sidecar picks ranks.
                    None => remove_headers.push(DP_RANK.to_string()),
                }
                let mutation = HeaderMutation {
                    set_headers,
                    remove_headers,
                };
                let common = CommonResponse {
                    header_mutation: Some(mutation),
                    body_mutation,
                    // Full duplex: Envoy may already have matched a route
                    // while the headers waited for the body; match again
                    // now that the destination header is set (the GIE
                    // config's route requires it).
                    clear_route_cache: self.mode == BodyMode::FullDuplex,
                    ..Default::default()
                };
                (
                    vec![reply(answer.wrap(common), Some(lb_metadata(&dest)))],
                    false,
                )
            }
            Err(e) => (vec![refusal(&e)], true),
        }
    }

    /// The response header naming the replica that answered.
    fn upstream_header(&self) -> ProcessingResponse {
        // Name the replica that really answered (after retries, that may be
        // a fallback); the address itself stays private.
        let id = self.routed.as_ref().map(|routed| {
            let i = self.response.as_ref().and_then(|r| r.served);
            routed.replicas[i.unwrap_or(routed.chosen)].id.clone()
        });
        let header_mutation = id.map(|id| HeaderMutation {
            set_headers: vec![headers::set(UPSTREAM, &id)],
            remove_headers: vec![],
        });
        ProcessingResponse {
            response: Some(processing_response::Response::ResponseHeaders(
                HeadersResponse {
                    response: Some(CommonResponse {
                        header_mutation,
                        ..Default::default()
                    }),
                },
            )),
            ..Default::default()
        }
    }
}

fn reply(response: processing_response::Response, metadata: Option<Struct>) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(response),
        dynamic_metadata: metadata,
        ..Default::default()
    }
}

/// Reads what the filter put on the request. A missing, malformed or
/// mismatched fingerprint means "route on load alone".
pub fn request_info(h: &HttpHeaders, block_size: usize) -> RequestInfo {
    let mut info = RequestInfo::default();
    for hv in headers::all(h) {
        let value = headers::text(hv);
        match hv.key.as_str() {
            k if k == header::FP => {
                match header::decode(value) {
                    Ok((bs, hashes)) if bs as usize == block_size => info.hashes = hashes,
                    Ok((bs, _)) => {
                        tracing::warn!(filter = bs, sidecar = block_size, "fingerprint block size differs from HEARTH_BLOCK_SIZE; routing on load")
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "unreadable fingerprint; routing on load")
                    }
                }
            }
            k if k == header::PROMPT_BYTES => info.prompt_bytes = value.trim().parse().unwrap_or(0),
            k if k == header::MODEL => info.model = Some(names::capped_model(value)),
            k if k == header::MAX_TOKENS => info.max_output_tokens = value.trim().parse().ok(),
            k if k == header::CACHE => info.cache = CacheUse::parse(value).unwrap_or_default(),
            _ => {}
        }
    }
    info
}

fn string_value(s: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.to_string())),
    }
}

/// Dynamic metadata of one key in one namespace: `{namespace: {key: value}}`.
fn metadata(namespace: &str, key: &str, value: Value) -> Struct {
    let inner = Struct {
        fields: HashMap::from([(key.to_string(), value)]),
    };
    Struct {
        fields: HashMap::from([(
            namespace.to_string(),
            Value {
                kind: Some(Kind::StructValue(inner)),
            },
        )]),
    }
}

/// `{"envoy.lb": {"x-gateway-destination-endpoint": dest}}`
fn lb_metadata(dest: &str) -> Struct {
    metadata(LB_NAMESPACE, DESTINATION, string_value(dest))
}

/// `{hearth: {trailers_taken: true}}`.
fn trailers_taken_metadata() -> Struct {
    let yes = Value {
        kind: Some(Kind::BoolValue(true)),
    };
    metadata(
        outcome::METADATA_NAMESPACE,
        outcome::TRAILERS_TAKEN_KEY,
        yes,
    )
}

/// An attribute Envoy sends with a message (`response_attributes`).
fn attribute(attributes: &HashMap<String, Struct>, name: &str) -> Option<String> {
    let value = attributes.get(EXT_PROC_ATTRIBUTES)?.fields.get(name)?;
    match &value.kind {
        Some(Kind::StringValue(s)) => Some(s.clone()),
        _ => None,
    }
}

/// A protobuf duration.
fn proto_duration(d: Duration) -> envoy_types::pb::google::protobuf::Duration {
    envoy_types::pb::google::protobuf::Duration {
        seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        nanos: i32::try_from(d.subsec_nanos()).unwrap_or(0),
    }
}

/// Flow control's 429: an OpenAI-shaped error, `Retry-After`, and the
/// reason in `x-hearth-drop-reason`.
fn dropped(reason: DropReason) -> ProcessingResponse {
    let message = match reason {
        DropReason::Sheddable => "the fleet is saturated and this request's objective is sheddable",
        DropReason::QueueFull => "the fleet is saturated and the gateway's queue is full",
        DropReason::QueueBytes => {
            "the fleet is saturated and the gateway's queue holds its most prompt bytes"
        }
        DropReason::Evicted => {
            "the request was pushed out of the gateway's queue by higher-priority requests"
        }
        DropReason::Ttl => "the fleet stayed saturated for as long as the request may wait",
        DropReason::Disconnected => "the client went away",
    };
    headers::error_response(
        429,
        "rate_limit_exceeded",
        reason.as_str(),
        message,
        &[("retry-after", "1"), (DROP_REASON, reason.as_str())],
        format!("hearth_flow_{reason}"),
    )
}

/// 413 for a body past the endpoint picker's hold (`MAX_HELD_BODY`) while
/// `HEARTH_ENGINE_PRIORITY` is set: its priority could not be written.
fn too_large_for_priority() -> ProcessingResponse {
    headers::error_response(
        413,
        "invalid_request_error",
        "request_too_large",
        "the request body is larger than the gateway holds to write its engine priority",
        &[],
        "hearth_request_too_large".to_string(),
    )
}

/// An OpenAI-shaped error as an immediate response: 503 when no replica can
/// serve the request, 429 (with Retry-After) when every one is full.
fn refusal(e: &RouteError) -> ProcessingResponse {
    let (status, kind, code, retry_after) = match e {
        RouteError::NoReplicaForModel(_) => (404, "invalid_request_error", "model_not_found", None),
        RouteError::NoHealthyReplica(_) => {
            (503, "service_unavailable", "no_healthy_replica", Some("5"))
        }
        RouteError::Saturated => (429, "rate_limit_exceeded", "overloaded", Some("1")),
    };
    let retry: Vec<(&str, &str)> = retry_after
        .map(|s| ("retry-after", s))
        .into_iter()
        .collect();
    headers::error_response(
        status,
        kind,
        code,
        &e.to_string(),
        &retry,
        format!("hearth_{code}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_byte_deadline_grows_with_the_prompt_left_to_prefill() {
        let fb = FirstByte {
            timeout: Duration::from_secs(60),
            prefill_bytes_per_second: 16_384,
        };
        assert_eq!(fb.deadline(0), Some(Duration::from_secs(60)));
        // A cold 200k-token prompt (~800 KB): close to another minute.
        assert_eq!(fb.deadline(800 * 1024), Some(Duration::from_secs(110)));
        let flat = FirstByte {
            prefill_bytes_per_second: 0,
            ..fb
        };
        assert_eq!(flat.deadline(800 * 1024), Some(Duration::from_secs(60)));
        let off = FirstByte {
            timeout: Duration::ZERO,
            ..fb
        };
        assert_eq!(off.deadline(1), None);
    }

    fn headers(pairs: &[(&str, &str)]) -> HttpHeaders {
        headers::map(pairs)
    }

    #[test]
    fn request_info_reads_the_filter_headers() {
        let fp = header::encode(2048, &[1, 2, 3]);
        let h = headers(&[
            (":path", "/v1/chat/completions"),
            (header::FP, &fp),
            (header::PROMPT_BYTES, "5000"),
            (header::MODEL, "m"),
        ]);
        let info = request_info(&h, 2048);
        assert_eq!(info.hashes, [1, 2, 3]);
        assert_eq!(info.prompt_bytes, 5000);
        assert_eq!(info.model.as_deref(), Some("m"));
        // A model name past the cap is kept cut and marked.
        let long = "m".repeat(4 * names::MAX_MODEL_BYTES);
        let info = request_info(&headers(&[(header::MODEL, &long)]), 2048);
        let kept = info.model.unwrap();
        assert!(kept.ends_with(names::CUT_MARK), "{kept}");
        assert_eq!(kept.len(), names::MAX_MODEL_BYTES + names::CUT_MARK.len());
        // Another block size, or garbage, is ignored rather than trusted.
        assert!(request_info(&h, 4096).hashes.is_empty());
        let bad = headers(&[(header::FP, "v2.2048.!!!")]);
        assert!(request_info(&bad, 2048).hashes.is_empty());
        // A filter of the first format names other bytes: load alone.
        let old = headers(&[(header::FP, "v1.2048.AAAAAAAAAAA")]);
        assert!(request_info(&old, 2048).hashes.is_empty());
    }

    #[test]
    fn the_body_mode_is_the_request_body_send_mode() {
        let mode = |request: BodySendMode, response: BodySendMode| {
            BodyMode::of(&ProtocolConfiguration {
                request_body_mode: request as i32,
                response_body_mode: response as i32,
                ..Default::default()
            })
        };
        use BodySendMode as S;
        assert_eq!(mode(S::None, S::None), BodyMode::Headers);
        assert_eq!(mode(S::None, S::Streamed), BodyMode::Headers);
        assert_eq!(mode(S::Buffered, S::Streamed), BodyMode::Buffered);
        assert_eq!(
            mode(S::FullDuplexStreamed, S::FullDuplexStreamed),
            BodyMode::FullDuplex
        );
        assert_eq!(BodyMode::default(), BodyMode::Headers);
    }

    #[test]
    fn refusals_are_openai_shaped_json() {
        let r = refusal(&RouteError::Saturated);
        let Some(processing_response::Response::ImmediateResponse(ir)) = r.response else {
            panic!("not an immediate response")
        };
        assert_eq!(ir.status.unwrap().code, 429);
        let body: serde_json::Value = serde_json::from_slice(&ir.body).unwrap();
        assert_eq!(body["error"]["code"], "overloaded");
        let names: Vec<_> = ir
            .headers
            .unwrap()
            .set_headers
            .into_iter()
            .map(|h| h.header.unwrap().key)
            .collect();
        assert!(names.contains(&"retry-after".to_string()));
    }

    #[test]
    fn flow_control_drops_are_429s_that_say_why() {
        for reason in DropReason::ALL {
            let Some(processing_response::Response::ImmediateResponse(ir)) =
                dropped(reason).response
            else {
                panic!("not an immediate response")
            };
            assert_eq!(ir.status.unwrap().code, 429);
            let body: serde_json::Value = serde_json::from_slice(&ir.body).unwrap();
            assert_eq!(body["error"]["code"], reason.as_str());
            assert_eq!(body["error"]["type"], "rate_limit_exceeded");
            let set: Vec<(String, String)> = ir
                .headers
                .unwrap()
                .set_headers
                .into_iter()
                .map(|h| h.header.unwrap())
                .map(|h| (h.key, String::from_utf8(h.raw_value).unwrap()))
                .collect();
            assert!(set.contains(&(DROP_REASON.to_string(), reason.as_str().to_string())));
            assert!(set.iter().any(|(k, _)| k == "retry-after"));
        }
    }

    #[test]
    fn metadata_carries_the_destination_under_envoy_lb() {
        let md = lb_metadata("127.0.0.1:1,127.0.0.1:2");
        let Some(Kind::StructValue(inner)) = &md.fields[LB_NAMESPACE].kind else {
            panic!("envoy.lb is not a struct")
        };
        assert_eq!(
            inner.fields[DESTINATION].kind,
            Some(Kind::StringValue("127.0.0.1:1,127.0.0.1:2".into()))
        );
    }
}

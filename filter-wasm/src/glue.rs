//! proxy-wasm host glue: moves headers and bodies between Envoy and
//! [`crate::policy`]. Every host call's error is handled; nothing here
//! unwraps, so the VM never traps on input.

use crate::config::{FilterConfig, Role};
use crate::metrics::{Metric, SkipCause};
use crate::outcome::{self, Scanner};
use crate::policy::{self, BodyOutcome, HeaderDecision};
use hearth_wire::{header, Endpoint};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType, MetricType};
use std::rc::Rc;
use std::time::{Duration, UNIX_EPOCH};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root::default()) });
}}

fn log(level: LogLevel, msg: &str) {
    let _ = hostcalls::log(level, msg);
}

/// Counter ids, defined once per VM by the root context.
struct Metrics {
    ids: Vec<Option<u32>>,
}

impl Metrics {
    fn define() -> Metrics {
        let ids = Metric::ALL
            .iter()
            .map(
                |m| match hostcalls::define_metric(MetricType::Counter, m.name()) {
                    Ok(id) => Some(id),
                    Err(status) => {
                        log(
                            LogLevel::Warn,
                            &format!("hearth: define_metric {} failed: {status:?}", m.name()),
                        );
                        None
                    }
                },
            )
            .collect();
        Metrics { ids }
    }

    fn add(&self, metric: Metric, by: u64) {
        if by == 0 {
            return;
        }
        if let Some(Some(id)) = self.ids.get(metric.index()) {
            let _ = hostcalls::increment_metric(*id, i64::try_from(by).unwrap_or(i64::MAX));
        }
    }
}

#[derive(Default)]
struct Root {
    config: Rc<FilterConfig>,
    metrics: Option<Rc<Metrics>>,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let bytes = match hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX) {
            Ok(b) => b.unwrap_or_default(),
            Err(status) => {
                log(
                    LogLevel::Error,
                    &format!("hearth: cannot read plugin configuration: {status:?}"),
                );
                return false;
            }
        };
        match FilterConfig::parse(&bytes) {
            Ok(cfg) => self.config = Rc::new(cfg),
            Err(e) => {
                log(LogLevel::Error, &format!("hearth: {e}"));
                return false;
            }
        }
        if self.metrics.is_none() {
            self.metrics = Some(Rc::new(Metrics::define()));
        }
        true
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        if self.config.role == Role::Outcome {
            return Some(Box::new(OutcomeHttp {
                config: Rc::clone(&self.config),
                generation: false,
                scanner: None,
                reported: false,
                first_chunk_reported: false,
                by_trailer: false,
                first_chunk_asked: false,
                request_id: None,
                engine_priority: None,
            }));
        }
        let metrics = self
            .metrics
            .clone()
            .unwrap_or_else(|| Rc::new(Metrics { ids: Vec::new() }));
        Some(Box::new(Http {
            config: Rc::clone(&self.config),
            metrics,
            state: State::Pass,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

enum State {
    /// Nothing to do for this request.
    Pass,
    /// Headers held back; buffering the body until end of stream.
    Buffering { endpoint: Endpoint, seen: usize },
}

struct Http {
    config: Rc<FilterConfig>,
    metrics: Rc<Metrics>,
    state: State,
}

impl Context for Http {}

impl Http {
    fn request_header(&self, name: &str) -> Option<Vec<u8>> {
        hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, name)
            .ok()
            .flatten()
    }

    fn strip_reserved_headers(&self) {
        let headers = match hostcalls::get_map_bytes(MapType::HttpRequestHeaders) {
            Ok(h) => h,
            Err(status) => {
                log(
                    LogLevel::Warn,
                    &format!("hearth: cannot read request headers: {status:?}"),
                );
                return;
            }
        };
        let reserved = policy::reserved_headers(headers.iter().map(|(n, _)| n.as_str()));
        for name in &reserved {
            if let Err(status) = hostcalls::remove_map_value(MapType::HttpRequestHeaders, name) {
                log(
                    LogLevel::Warn,
                    &format!("hearth: cannot remove {name}: {status:?}"),
                );
            }
        }
        self.metrics
            .add(Metric::StrippedHeaders, reserved.len() as u64);
    }

    /// Fingerprints the buffered body and sets the headers; always lets the request go on.
    fn finish(&mut self, endpoint: Endpoint, size: usize) {
        self.state = State::Pass;
        let started = now_micros();
        let body = match hostcalls::get_buffer(BufferType::HttpRequestBody, 0, size) {
            Ok(b) => b.unwrap_or_default(),
            Err(status) => {
                log(
                    LogLevel::Warn,
                    &format!("hearth: cannot read request body: {status:?}"),
                );
                self.metrics
                    .add(Metric::Skipped(SkipCause::BodyUnavailable), 1);
                return;
            }
        };
        match policy::on_request_body(&self.config, endpoint, &body) {
            BodyOutcome::Hashed {
                headers,
                hashed_bytes,
            } => {
                for (name, value) in &headers {
                    if let Err(status) =
                        hostcalls::set_map_value(MapType::HttpRequestHeaders, name, Some(value))
                    {
                        log(
                            LogLevel::Warn,
                            &format!("hearth: cannot set {name}: {status:?}"),
                        );
                    }
                }
                self.metrics.add(Metric::Hashed, 1);
                self.metrics.add(Metric::HashedBytes, hashed_bytes);
                self.metrics
                    .add(Metric::HashMicros, now_micros().saturating_sub(started));
            }
            BodyOutcome::Skipped(cause) => self.metrics.add(Metric::Skipped(cause), 1),
        }
    }
}

fn now_micros() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        self.strip_reserved_headers();
        let method = self.request_header(":method");
        let path = self.request_header(":path");
        let length = self.request_header("content-length");
        match policy::on_request_headers(
            &self.config,
            method.as_deref(),
            path.as_deref(),
            length.as_deref(),
            end_of_stream,
        ) {
            HeaderDecision::Buffer(endpoint) => {
                self.state = State::Buffering { endpoint, seen: 0 };
                // Needs allow_on_headers_stop_iteration: true in the PluginConfig.
                Action::Pause
            }
            HeaderDecision::Pass(cause) => {
                self.metrics.add(Metric::Skipped(cause), 1);
                Action::Continue
            }
        }
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let State::Buffering { endpoint, .. } = self.state else {
            return Action::Continue;
        };
        if body_size > self.config.max_body_bytes {
            // Release what is buffered and stop looking; the body is untouched.
            self.state = State::Pass;
            self.metrics.add(Metric::Skipped(SkipCause::TooLarge), 1);
            return Action::Continue;
        }
        if !end_of_stream {
            self.state = State::Buffering {
                endpoint,
                seen: body_size,
            };
            return Action::Pause;
        }
        self.finish(endpoint, body_size);
        Action::Continue
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        // A body followed by trailers never reports end_of_stream on the body.
        if let State::Buffering { endpoint, seen } = self.state {
            self.finish(endpoint, seen);
        }
        Action::Continue
    }
}

/// The outcome role: watches a generation's 200 answer go by and, at its
/// end, hands the verdict to the sidecar. With `trailer_reports`, a
/// streamed answer (no content-length) to a request the sidecar routed
/// carries it on the request's own ext_proc stream, as the trailer
/// [`outcome::TRAILER`]; any other answer is reported with an asynchronous
/// `POST /outcome` on the `outcome_cluster` (Envoy lets no wasm filter add
/// trailers to a content-length answer). A streamed answer's first chunk
/// is posted too (`/outcome/first-token`): always without
/// `trailer_reports`, with it only where the sidecar asked
/// ([`outcome::FIRST_CHUNK_HEADER`]).
struct OutcomeHttp {
    config: Rc<FilterConfig>,
    /// A POST to a generation path (decided on the request headers: the
    /// SDK traps when request headers are read in a response callback).
    generation: bool,
    /// Set while a generation's 200 answer is being watched.
    scanner: Option<Scanner>,
    reported: bool,
    /// The first chunk of a streamed answer was reported (the engine has
    /// read the prompt: the sidecar stops weighing its unread bytes).
    first_chunk_reported: bool,
    /// The verdict goes out as a response trailer, not a `POST`.
    by_trailer: bool,
    /// The sidecar asked to hear of the first chunk.
    first_chunk_asked: bool,
    /// The sidecar's ticket (`x-hearth-ticket`): the report's usage is
    /// matched with its decision by it.
    request_id: Option<String>,
    /// The engine's scheduling priority the sidecar chose
    /// (`x-hearth-engine-priority`, `HEARTH_ENGINE_PRIORITY`): written
    /// into the body as its only top-level `priority`.
    engine_priority: Option<i64>,
}

impl Context for OutcomeHttp {
    // The sidecar's answer to a report carries nothing to act on.
    fn on_http_call_response(
        &mut self,
        _token: u32,
        _headers: usize,
        _body: usize,
        _trailers: usize,
    ) {
    }
}

impl OutcomeHttp {
    fn request_is_generation(&self) -> bool {
        let get = |name: &str| {
            hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, name)
                .ok()
                .flatten()
        };
        let post = get(":method").is_some_and(|m| m == b"POST");
        let path = get(":path").unwrap_or_default();
        post && self
            .config
            .endpoint_for(&String::from_utf8_lossy(&path))
            .is_some()
    }

    /// `POST`s `body` to the sidecar's `path`, without waiting for it.
    fn post(&self, path: &str, body: &str) {
        let mut headers = vec![
            (":method", "POST"),
            (":path", path),
            (":authority", "hearth-sidecar"),
            ("content-type", "text/plain"),
        ];
        let authorization = self
            .config
            .control_token
            .as_ref()
            .map(|t| format!("Bearer {t}"));
        if let Some(value) = &authorization {
            headers.push(("authorization", value));
        }
        if let Err(status) = hostcalls::dispatch_http_call(
            &self.config.outcome_cluster,
            headers,
            Some(body.as_bytes()),
            vec![],
            Duration::from_secs(2),
        ) {
            log(
                LogLevel::Debug,
                &format!("hearth: cannot report to {path}: {status:?}"),
            );
        }
    }

    /// Tells the sidecar, once, that a streamed answer's first chunk went
    /// by (a body that ends in its first chunk is told by its report).
    fn report_first_chunk(&mut self) {
        if self.first_chunk_reported {
            return;
        }
        self.first_chunk_reported = true;
        if let Some(body) = self
            .request_id
            .as_deref()
            .and_then(outcome::first_token_body)
        {
            self.post(outcome::FIRST_TOKEN_PATH, &body);
        }
    }

    /// Sends the verdict to the sidecar, once, without waiting for it: as
    /// the response trailer (only while the answer's last chunk or its
    /// trailers are being seen, when Envoy lets one be added) or a `POST`.
    fn report(&mut self) {
        if self.reported {
            return;
        }
        let Some(scanner) = &self.scanner else { return };
        self.reported = true;
        if self.by_trailer && trailers_taken() {
            let value = outcome::trailer_value(scanner);
            if let Err(status) = hostcalls::set_map_value(
                MapType::HttpResponseTrailers,
                outcome::TRAILER,
                Some(&value),
            ) {
                log(
                    LogLevel::Debug,
                    &format!("hearth: cannot add the outcome trailer: {status:?}"),
                );
            }
            return;
        }
        let upstream = hostcalls::get_property(vec!["upstream", "address"])
            .ok()
            .flatten()
            .unwrap_or_default();
        let body = outcome::report_body(
            &String::from_utf8_lossy(&upstream),
            self.request_id.as_deref(),
            scanner,
        );
        self.post(outcome::REPORT_PATH, &body);
    }

    /// Takes the sidecar's `x-hearth-engine-priority` off the request
    /// (it never reaches an engine). With a value to write, the body's
    /// length changes: its `content-length` goes too, and the body is sent
    /// on chunked (HTTP/1.1) or as it comes (HTTP/2).
    fn take_engine_priority(&mut self) {
        let name = hearth_wire::priority::HEADER;
        let value = hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, name)
            .ok()
            .flatten();
        let Some(value) = value else { return };
        let _ = hostcalls::remove_map_value(MapType::HttpRequestHeaders, name);
        self.engine_priority = std::str::from_utf8(&value)
            .ok()
            .and_then(hearth_wire::priority::parse_header);
        if self.engine_priority.is_some() {
            let _ = hostcalls::remove_map_value(MapType::HttpRequestHeaders, "content-length");
        }
    }

    /// Replaces the buffered body's top-level `priority` members with one of
    /// `value`. A body that is no JSON object goes on as it came (the
    /// engine refuses it as it would).
    fn write_engine_priority(&self, value: i64, body_size: usize) {
        let Ok(Some(body)) = hostcalls::get_buffer(BufferType::HttpRequestBody, 0, body_size)
        else {
            return;
        };
        match hearth_wire::priority::set_priority(&body, value) {
            Ok(new) => {
                if let Err(status) =
                    hostcalls::set_buffer(BufferType::HttpRequestBody, 0, body_size, &new)
                {
                    log(
                        LogLevel::Warn,
                        &format!("hearth: cannot write the engine priority: {status:?}"),
                    );
                }
            }
            Err(reason) => log(
                LogLevel::Debug,
                &format!("hearth: no engine priority written: {reason:?}"),
            ),
        }
    }
}

/// The sidecar has answered this stream's response headers (ext_proc now
/// hands it the response's trailers).
fn trailers_taken() -> bool {
    hostcalls::get_property(vec![
        "metadata",
        "filter_metadata",
        outcome::METADATA_NAMESPACE,
        outcome::TRAILERS_TAKEN_KEY,
    ])
    .ok()
    .flatten()
    .is_some()
}

impl HttpContext for OutcomeHttp {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        self.generation = self.request_is_generation();
        if self.generation {
            // The sidecar's ticket for this request's decision (set by
            // ext_proc, never by a client: the filter strips client
            // `x-hearth-*` headers before ext_proc runs).
            self.request_id =
                hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, header::TICKET)
                    .ok()
                    .flatten()
                    .and_then(|id| String::from_utf8(id).ok());
            self.first_chunk_asked = hostcalls::get_map_value_bytes(
                MapType::HttpRequestHeaders,
                outcome::FIRST_CHUNK_HEADER,
            )
            .ok()
            .flatten()
            .is_some();
            if self.first_chunk_asked {
                let _ = hostcalls::remove_map_value(
                    MapType::HttpRequestHeaders,
                    outcome::FIRST_CHUNK_HEADER,
                );
            }
            self.take_engine_priority();
        }
        Action::Continue
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let Some(value) = self.engine_priority else {
            return Action::Continue;
        };
        if !end_of_stream {
            // Held here until the whole body has come (the fingerprint
            // entry has usually buffered it already).
            return Action::Pause;
        }
        self.engine_priority = None;
        self.write_engine_priority(value, body_size);
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        if !self.generation {
            return Action::Continue;
        }
        let get = |name: &str| {
            hostcalls::get_map_value_bytes(MapType::HttpResponseHeaders, name)
                .ok()
                .flatten()
        };
        if get(":status").as_deref() != Some(b"200".as_slice()) || end_of_stream {
            return Action::Continue;
        }
        self.scanner = Some(Scanner::default());
        // A streamed answer to a request the sidecar routed: the verdict
        // rides its ext_proc stream.
        self.by_trailer = self.config.trailer_reports
            && self.request_id.is_some()
            && get("content-length").is_none();
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let Some(scanner) = &mut self.scanner else {
            return Action::Continue;
        };
        if let Ok(Some(chunk)) = hostcalls::get_buffer(BufferType::HttpResponseBody, 0, body_size) {
            scanner.feed(&chunk);
        }
        if end_of_stream {
            self.report();
        } else if body_size > 0 && (self.first_chunk_asked || !self.config.trailer_reports) {
            self.report_first_chunk();
        }
        Action::Continue
    }

    fn on_http_response_trailers(&mut self, _num_trailers: usize) -> Action {
        // Only this filter writes the verdict's trailer.
        let _ = hostcalls::remove_map_value(MapType::HttpResponseTrailers, outcome::TRAILER);
        self.report();
        Action::Continue
    }
}

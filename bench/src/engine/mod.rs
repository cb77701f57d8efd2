//! A simulated OpenAI-compatible LLM engine: an axum server with a real
//! prefix cache over the rendered prompt and a simple time cost model.
//!
//! Endpoints: `POST /v1/chat/completions`, `POST /v1/completions` (JSON or SSE
//! with `"stream": true`), `GET /v1/models`, `GET /health`, `GET /stats`
//! ([`EngineStats`] as JSON) and `GET /metrics` (Prometheus text with vLLM
//! metric names). Every response carries `x-engine-id`.
//!
//! Cost model: before the first token, `uncached prompt tokens ×
//! prefill_micros_per_token`; then `decode_micros_per_token` per output token;
//! both divided by `time_scale`. Or, with [`EngineConfig::scheduler`], the
//! engine scheduler the simulator runs ([`scheduled`]): batched steps,
//! chunked prefill, a FIFO queue, time-scaled the same way.

pub mod cache;
pub mod core;
pub mod faults;
pub mod kv_publisher;
pub mod request;
pub mod scheduled;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

pub use faults::Fault;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use self::cache::{block_hashes, PrefixCache};
use self::request::{ApiKind, GenerationRequest};

/// Largest request body accepted (agent turns can exceed 1 MB).
pub const MAX_BODY_BYTES: usize = 16 * 1024 * 1024;

/// Header naming the replica that served a response.
pub const ENGINE_ID_HEADER: &str = "x-engine-id";

/// How long [`EngineHandle::shutdown`] waits for in-flight requests.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Words the simulated model "generates", one per output token.
const WORDS: &[&str] = &[
    "the ", "cache ", "keeps ", "each ", "turn ", "warm ", "on ", "one ", "replica ", "and ",
    "load ", "moves ", "it ", "when ", "hot ", "so ",
];

/// Settings of one simulated engine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineConfig {
    /// Replica id, sent as `x-engine-id` (default `engine-0`).
    pub id: String,
    /// Model name served by `/v1/models` (default `hearth-sim`).
    pub model: String,
    /// Tokens per KV cache block (default 16).
    pub block_tokens: usize,
    /// Prompt bytes per simulated token (default 4).
    pub bytes_per_token: usize,
    /// Prefix cache capacity in tokens (default 1,000,000).
    pub cache_capacity_tokens: usize,
    /// Prefill cost per uncached prompt token, in engine microseconds (default 0).
    pub prefill_micros_per_token: f64,
    /// Decode cost per output token, in engine microseconds (default 0).
    pub decode_micros_per_token: f64,
    /// Engine time is divided by this: 10.0 runs ten times faster (default 1.0).
    pub time_scale: f64,
    /// Output tokens when the request sets no `max_tokens` (default 16).
    pub default_output_tokens: usize,
    /// Fault shown from the start (default none); changeable at run time.
    #[serde(default)]
    pub fault: Fault,
    /// Requests generated at once; the rest wait in FIFO order and show as
    /// `vllm:num_requests_waiting` (default 0: no limit).
    #[serde(default)]
    pub max_running: usize,
    /// Run requests through the engine scheduler with this cost model
    /// instead of the per-token costs above (which, with `max_running`, it
    /// then replaces); `time_scale` still applies (default: off).
    #[serde(default)]
    pub scheduler: Option<self::core::CostModel>,
    /// A reasoning model's answers: the first this many output tokens of
    /// a chat answer go to `reasoning_content`, the rest to `content`
    /// (default 0).
    #[serde(default)]
    pub reasoning_tokens: usize,
    /// Require `Authorization: Bearer <key>` on `/v1/*` and `/metrics`
    /// (401 without it), as engines started with an API key do; `/health`
    /// stays open (default: none).
    #[serde(default)]
    pub api_key: Option<String>,
    /// Publish KV cache events as vLLM does (a ZMQ PUB socket bound here,
    /// `tcp://ip:port`, port 0 for any; see [`kv_publisher`]) (default:
    /// none).
    #[serde(default)]
    pub kv_events: Option<String>,
    /// With `kv_events`: also answer replay requests on a ROUTER socket
    /// bound here (vLLM's `replay_endpoint`) (default: none).
    #[serde(default)]
    pub kv_events_replay: Option<String>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            id: "engine-0".to_owned(),
            model: "hearth-sim".to_owned(),
            block_tokens: 16,
            bytes_per_token: 4,
            cache_capacity_tokens: 1_000_000,
            prefill_micros_per_token: 0.0,
            decode_micros_per_token: 0.0,
            time_scale: 1.0,
            default_output_tokens: 16,
            fault: Fault::None,
            max_running: 0,
            scheduler: None,
            reasoning_tokens: 0,
            api_key: None,
            kv_events: None,
            kv_events_replay: None,
        }
    }
}

/// A setting of [`EngineConfig`] that cannot work.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum EngineConfigError {
    /// The id cannot be sent as a header value.
    #[error("engine id {0:?} is not a valid header value")]
    Id(String),
    /// A size that must be positive is zero.
    #[error("{0} must be at least 1")]
    Zero(&'static str),
    /// A cost or scale is negative, NaN or infinite.
    #[error("{field} must be a finite number >= 0 (got {value})")]
    Cost {
        /// The offending setting.
        field: &'static str,
        /// Its value.
        value: f64,
    },
    /// `time_scale` is not a finite positive number.
    #[error("time_scale must be a finite number > 0 (got {0})")]
    TimeScale(f64),
    /// The scheduler's cost model cannot work.
    #[error("scheduler: {0}")]
    Scheduler(String),
}

impl EngineConfig {
    /// Check every setting; the first bad one is reported.
    pub fn validate(&self) -> Result<(), EngineConfigError> {
        if HeaderValue::from_str(&self.id).is_err() {
            return Err(EngineConfigError::Id(self.id.clone()));
        }
        if self.block_tokens == 0 {
            return Err(EngineConfigError::Zero("block_tokens"));
        }
        if self.bytes_per_token == 0 {
            return Err(EngineConfigError::Zero("bytes_per_token"));
        }
        for (field, value) in [
            ("prefill_micros_per_token", self.prefill_micros_per_token),
            ("decode_micros_per_token", self.decode_micros_per_token),
        ] {
            if !value.is_finite() || value < 0.0 {
                return Err(EngineConfigError::Cost { field, value });
            }
        }
        if !self.time_scale.is_finite() || self.time_scale <= 0.0 {
            return Err(EngineConfigError::TimeScale(self.time_scale));
        }
        if let Some(cost) = &self.scheduler {
            cost.validate().map_err(EngineConfigError::Scheduler)?;
        }
        Ok(())
    }

    /// Wall-clock duration of `micros` engine microseconds.
    fn wall(&self, micros: f64) -> Duration {
        Duration::try_from_secs_f64(micros / 1e6 / self.time_scale).unwrap_or(Duration::MAX)
    }
}

/// Counters of one engine, served as JSON on `GET /stats`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineStats {
    /// Replica id.
    pub id: String,
    /// Generation requests admitted (valid chat/completions requests).
    pub requests_total: u64,
    /// Sum of prompt tokens over admitted requests.
    pub prompt_tokens_total: u64,
    /// Sum of prompt tokens served from the prefix cache.
    pub cached_tokens_total: u64,
    /// Requests in flight now.
    pub running: u64,
    /// Blocks in the prefix cache now.
    pub cache_blocks: u64,
    /// Capacity of the prefix cache in blocks.
    pub cache_capacity_blocks: u64,
    /// Requests whose response was delivered to the end.
    pub completed_total: u64,
    /// Requests whose client went away before the end.
    pub aborted_total: u64,
    /// The top-level `priority` of the latest valid generation request
    /// that had one (what a gateway writing the engine's priority sent).
    #[serde(default)]
    pub last_priority: Option<i64>,
}

/// Shared state of one simulated engine.
#[derive(Debug)]
pub struct Engine {
    config: EngineConfig,
    id_header: HeaderValue,
    cache: Mutex<PrefixCache>,
    next_id: AtomicU64,
    requests_total: AtomicU64,
    last_priority: Mutex<Option<i64>>,
    prompt_tokens_total: AtomicU64,
    cached_tokens_total: AtomicU64,
    running: AtomicU64,
    completed_total: AtomicU64,
    aborted_total: AtomicU64,
    fault: Mutex<Fault>,
    /// Slots for running requests (when `max_running` is set).
    slots: Option<Arc<tokio::sync::Semaphore>>,
    waiting: AtomicU64,
    /// Requests held by the `stall` fault: counted as running, never
    /// progressing.
    stalled: AtomicU64,
    /// Work steps taken: one per [`WORK_STEP`] of wall time in which a
    /// request ran and was not stalled (served as vLLM's per-step token
    /// counter, which moves whenever the engine works; the simulator's
    /// stands for it in steps, not tokens).
    work_steps: AtomicU64,
    /// The scheduler task, started by the first request (with
    /// [`EngineConfig::scheduler`]).
    scheduler: std::sync::OnceLock<Arc<scheduled::Scheduler>>,
    /// The KV event publisher (with [`EngineConfig::kv_events`], once
    /// [`spawn`] bound it).
    kv: Mutex<Option<kv_publisher::KvPublisher>>,
}

/// What admission decided for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admission {
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Leading prompt tokens found in the prefix cache.
    pub cached_tokens: usize,
}

impl Engine {
    /// A new engine with an empty cache.
    pub fn new(config: EngineConfig) -> Result<Self, EngineConfigError> {
        config.validate()?;
        let id_header = HeaderValue::from_str(&config.id)
            .map_err(|_| EngineConfigError::Id(config.id.clone()))?;
        let capacity_blocks = config.cache_capacity_tokens / config.block_tokens;
        let fault = config.fault;
        // The scheduler has its own running limit.
        let max_running = if config.scheduler.is_some() {
            0
        } else {
            config.max_running
        };
        Ok(Self {
            id_header,
            cache: Mutex::new(if config.kv_events.is_some() {
                PrefixCache::new(capacity_blocks).with_events(config.block_tokens)
            } else {
                PrefixCache::new(capacity_blocks)
            }),
            config,
            next_id: AtomicU64::new(0),
            requests_total: AtomicU64::new(0),
            last_priority: Mutex::new(None),
            prompt_tokens_total: AtomicU64::new(0),
            cached_tokens_total: AtomicU64::new(0),
            running: AtomicU64::new(0),
            completed_total: AtomicU64::new(0),
            aborted_total: AtomicU64::new(0),
            fault: Mutex::new(fault),
            slots: (max_running > 0).then(|| Arc::new(tokio::sync::Semaphore::new(max_running))),
            waiting: AtomicU64::new(0),
            stalled: AtomicU64::new(0),
            work_steps: AtomicU64::new(0),
            scheduler: std::sync::OnceLock::new(),
            kv: Mutex::new(None),
        })
    }

    /// Publishes a step's KV cache events (when the engine publishes).
    pub fn publish_kv_events(&self, events: Vec<hearth_wire::kv_events::Event>) {
        if let Some(p) = self
            .kv
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
        {
            p.publish(events);
        }
    }

    /// The bound KV event endpoint (`tcp://ip:port`), when it publishes.
    pub fn kv_events_endpoint(&self) -> Option<String> {
        let kv = self.kv.lock().unwrap_or_else(PoisonError::into_inner);
        kv.as_ref().map(|p| p.endpoint.clone())
    }

    /// The bound KV event replay endpoint, when it has one.
    pub fn kv_events_replay_endpoint(&self) -> Option<String> {
        let kv = self.kv.lock().unwrap_or_else(PoisonError::into_inner);
        kv.as_ref().and_then(|p| p.replay_endpoint.clone())
    }

    /// The next `n` KV event batches are numbered and never sent (a gap).
    pub fn drop_kv_batches(&self, n: u64) {
        if let Some(p) = self
            .kv
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
        {
            p.drop_batches(n);
        }
    }

    /// Empties the prefix cache, as vLLM's `POST /reset_prefix_cache`
    /// does: refused (`false`) while a request uses it; publishes
    /// `AllBlocksCleared`. (The scheduled engine keeps its cache.)
    pub fn reset_prefix_cache(&self) -> bool {
        let mut cache = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        if self.running.load(Ordering::Relaxed) > 0 || !cache.reset() {
            return false;
        }
        let events = cache.take_events();
        drop(cache);
        self.publish_kv_events(events);
        true
    }

    /// The fault generation requests show now.
    pub fn fault(&self) -> Fault {
        *self.fault.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The fault this generation request shows; a `close:TIMES` fault
    /// counts it (and ends after its last).
    fn take_fault(&self) -> Fault {
        let mut fault = self.fault.lock().unwrap_or_else(PoisonError::into_inner);
        let now = *fault;
        if let Fault::Close { times: Some(n) } = now {
            *fault = match n {
                0 | 1 => Fault::None,
                n => Fault::Close { times: Some(n - 1) },
            };
            if n == 0 {
                return Fault::None;
            }
        }
        now
    }

    /// Changes the fault at run time.
    pub fn set_fault(&self, fault: Fault) {
        tracing::info!(engine = %self.config.id, %fault, "fault set");
        *self.fault.lock().unwrap_or_else(PoisonError::into_inner) = fault;
    }

    /// The engine's settings.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Requests the engine holds now, running or waiting: the load every
    /// router's run is measured by, whatever the router counts itself.
    pub fn in_flight(&self) -> u64 {
        let waiting = self
            .scheduler
            .get()
            .map_or(&self.waiting, |s| &s.waiting)
            .load(Ordering::Relaxed);
        self.stats().running + waiting
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> EngineStats {
        let (running, cache_blocks, cache_capacity_blocks) = match self.scheduler.get() {
            Some(s) => (
                s.running.load(Ordering::Relaxed),
                s.cache_blocks.load(Ordering::Relaxed),
                s.cache_capacity_blocks,
            ),
            None => {
                let cache = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
                (
                    self.running.load(Ordering::Relaxed),
                    cache.len() as u64,
                    cache.capacity_blocks() as u64,
                )
            }
        };
        EngineStats {
            id: self.config.id.clone(),
            requests_total: self.requests_total.load(Ordering::Relaxed),
            prompt_tokens_total: self.prompt_tokens_total.load(Ordering::Relaxed),
            cached_tokens_total: self.cached_tokens_total.load(Ordering::Relaxed),
            running,
            cache_blocks,
            cache_capacity_blocks,
            completed_total: self.completed_total.load(Ordering::Relaxed),
            aborted_total: self.aborted_total.load(Ordering::Relaxed),
            last_priority: *self
                .last_priority
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        }
    }

    /// Run a rendered prompt through the prefix cache: count its cached
    /// leading tokens, then insert all its full blocks. Updates the counters.
    pub fn admit(&self, prompt: &[u8]) -> Admission {
        let block_bytes = self.config.block_tokens * self.config.bytes_per_token;
        let hashes = block_hashes(prompt, block_bytes);
        let mut cache = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        let matched = cache.admit(&hashes);
        let events = cache.take_events();
        drop(cache);
        self.publish_kv_events(events);
        let admission = Admission {
            prompt_tokens: prompt.len().div_ceil(self.config.bytes_per_token),
            cached_tokens: matched * self.config.block_tokens,
        };
        self.requests_total.fetch_add(1, Ordering::Relaxed);
        self.prompt_tokens_total
            .fetch_add(admission.prompt_tokens as u64, Ordering::Relaxed);
        self.cached_tokens_total
            .fetch_add(admission.cached_tokens as u64, Ordering::Relaxed);
        admission
    }

    fn metrics_text(&self) -> String {
        let s = self.stats();
        let model = &self.config.model;
        let usage = if s.cache_capacity_blocks == 0 {
            0.0
        } else {
            s.cache_blocks as f64 / s.cache_capacity_blocks as f64
        };
        let mut out = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, value: String| {
            out.push_str(&format!(
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{model_name=\"{model}\"}} {value}\n"
            ));
        };
        metric(
            "vllm:num_requests_running",
            "gauge",
            "Number of requests in model execution batches.",
            s.running.to_string(),
        );
        metric(
            "vllm:num_requests_waiting",
            "gauge",
            "Number of requests waiting to be processed.",
            self.scheduler
                .get()
                .map_or(&self.waiting, |s| &s.waiting)
                .load(Ordering::Relaxed)
                .to_string(),
        );
        metric(
            "vllm:kv_cache_usage_perc",
            "gauge",
            "KV-cache usage. 1 means 100 percent usage.",
            usage.to_string(),
        );
        metric(
            "vllm:prefix_cache_queries_total",
            "counter",
            "Prefix cache queries, in terms of number of queried tokens.",
            s.prompt_tokens_total.to_string(),
        );
        metric(
            "vllm:prefix_cache_hits_total",
            "counter",
            "Prefix cache hits, in terms of number of cached tokens.",
            s.cached_tokens_total.to_string(),
        );
        metric(
            "vllm:iteration_tokens_total_sum",
            "counter",
            "Work steps taken (the simulator's stand-in for tokens per engine step).",
            self.work_steps.load(Ordering::Relaxed).to_string(),
        );
        out
    }
}

/// Counts a request as running until dropped; then as completed or aborted.
struct InFlight {
    engine: Arc<Engine>,
    completed: bool,
    /// The running slot, when slots are limited; freed with the request.
    _slot: Option<tokio::sync::OwnedSemaphorePermit>,
}

/// Counts a request as stalled while it exists.
struct Stalled(Arc<Engine>);

impl Drop for Stalled {
    fn drop(&mut self) {
        self.0.stalled.fetch_sub(1, Ordering::Relaxed);
    }
}

/// How often the simulator's work counter looks for work.
const WORK_STEP: Duration = Duration::from_millis(50);

/// Counts work steps while the engine lives.
async fn count_work(engine: std::sync::Weak<Engine>) {
    let mut tick = tokio::time::interval(WORK_STEP);
    loop {
        tick.tick().await;
        let Some(engine) = engine.upgrade() else {
            return;
        };
        if engine.stats().running > engine.stalled.load(Ordering::Relaxed) {
            engine.work_steps.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Counts a request as waiting while it exists.
struct Waiting(Arc<Engine>);

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::Relaxed);
    }
}

impl InFlight {
    /// Waits (FIFO) for a running slot if they are limited, then counts
    /// the request as running.
    async fn start(engine: Arc<Engine>) -> Self {
        let slot = match &engine.slots {
            Some(slots) => {
                engine.waiting.fetch_add(1, Ordering::Relaxed);
                let _waiting = Waiting(engine.clone());
                Arc::clone(slots).acquire_owned().await.ok()
            }
            None => None,
        };
        engine.running.fetch_add(1, Ordering::Relaxed);
        Self {
            engine,
            completed: false,
            _slot: slot,
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let counter = if self.completed {
            &self.engine.completed_total
        } else {
            &self.engine.aborted_total
        };
        counter.fetch_add(1, Ordering::Relaxed);
        self.engine.running.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A running engine server.
///
/// Dropping the handle stops accepting connections; [`EngineHandle::shutdown`]
/// also waits (bounded) for in-flight requests.
#[derive(Debug)]
pub struct EngineHandle {
    /// The address the server listens on.
    pub addr: SocketAddr,
    /// The engine's shared state (counters, cache).
    pub engine: Arc<Engine>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl EngineHandle {
    /// Base URL, e.g. `http://127.0.0.1:8000`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stop accepting, let in-flight requests finish for up to five seconds,
    /// then stop the server task (and the KV event publisher: its port is
    /// free when this returns).
    pub async fn shutdown(mut self) {
        let kv = self
            .engine
            .kv
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(mut task) = self.task.take() {
            if tokio::time::timeout(SHUTDOWN_GRACE, &mut task)
                .await
                .is_err()
            {
                task.abort();
            }
        }
        if let Some(kv) = kv {
            kv.close().await;
        }
    }
}

impl Drop for EngineHandle {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Start an engine on `listener` (bind `127.0.0.1:0` for an ephemeral port).
pub async fn spawn(
    config: EngineConfig,
    listener: tokio::net::TcpListener,
) -> anyhow::Result<EngineHandle> {
    let engine = Arc::new(Engine::new(config)?);
    if let Some(endpoint) = &engine.config.kv_events {
        let replay = engine.config.kv_events_replay.as_deref();
        let publisher = kv_publisher::KvPublisher::start(endpoint, replay, "").await?;
        *engine.kv.lock().unwrap_or_else(PoisonError::into_inner) = Some(publisher);
    }
    let addr = listener.local_addr()?;
    let app = router(engine.clone());
    let (stop, stopped) = oneshot::channel::<()>();
    let id = engine.config.id.clone();
    tokio::spawn(count_work(Arc::downgrade(&engine)));
    let task = tokio::spawn(async move {
        let server = axum::serve(listener, app).with_graceful_shutdown(async {
            let _ = stopped.await;
        });
        if let Err(e) = server.await {
            tracing::error!(engine = %id, error = %e, "engine server failed");
        }
    });
    tracing::debug!(engine = %engine.config.id, %addr, "engine listening");
    Ok(EngineHandle {
        addr,
        engine,
        stop: Some(stop),
        task: Some(task),
    })
}

/// The engine's HTTP routes, for embedding in another server or test.
pub fn router(engine: Arc<Engine>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { "ok" }))
        .route("/stats", get(stats))
        .route("/metrics", get(metrics))
        .route("/admin/fault", get(get_fault).put(put_fault))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route("/kv_event_sources", get(kv_event_sources))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(axum::middleware::map_response_with_state(
            engine.clone(),
            tag_engine_id,
        ))
        .layer(axum::middleware::from_fn(echo_dp_rank))
        .layer(axum::middleware::from_fn_with_state(
            engine.clone(),
            require_api_key,
        ))
        .with_state(engine)
}

/// Where the KV events are published, as vLLM's `GET /kv_event_sources`
/// states its `--kv-events-config` per data-parallel rank: the bound
/// endpoints with a wildcard host, as an engine binding every interface
/// writes them (`{}` without events).
async fn kv_event_sources(State(engine): State<Arc<Engine>>) -> Json<serde_json::Value> {
    let wildcard = |e: String| match e.strip_prefix("tcp://").and_then(|a| a.rsplit_once(':')) {
        Some((_, port)) => format!("tcp://*:{port}"),
        None => e,
    };
    Json(match engine.kv_events_endpoint() {
        Some(endpoint) => serde_json::json!({"0": {
            "enable_kv_cache_events": true,
            "publisher": "zmq",
            "endpoint": wildcard(endpoint),
            "replay_endpoint": engine.kv_events_replay_endpoint().map(wildcard),
            "topic": "",
        }}),
        None => serde_json::json!({}),
    })
}

/// 401 for a request without the engine's key (when it has one), except
/// on the open paths: `/health` and the simulator's own `/stats` and
/// `/admin/*`.
async fn require_api_key(
    State(engine): State<Arc<Engine>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let Some(key) = &engine.config.api_key else {
        return next.run(req).await;
    };
    let path = req.uri().path();
    let open = path == "/health" || path == "/stats" || path.starts_with("/admin/");
    let given = req
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if open || given == Some(key.as_str()) {
        return next.run(req).await;
    }
    error_response(
        StatusCode::UNAUTHORIZED,
        "authentication_error",
        "invalid or missing API key",
    )
}

/// The data-parallel rank a request asked for (vLLM's
/// `x-data-parallel-rank`), echoed as `x-engine-dp-rank` so tests can see it.
async fn echo_dp_rank(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let rank = req.headers().get("x-data-parallel-rank").cloned();
    let mut res = next.run(req).await;
    if let Some(rank) = rank {
        res.headers_mut().insert("x-engine-dp-rank", rank);
    }
    res
}

async fn tag_engine_id(State(engine): State<Arc<Engine>>, mut res: Response) -> Response {
    res.headers_mut()
        .insert(ENGINE_ID_HEADER, engine.id_header.clone());
    res
}

/// An OpenAI-shaped error response.
fn error_response(status: StatusCode, kind: &str, message: impl Into<String>) -> Response {
    let body = json!({
        "error": { "message": message.into(), "type": kind, "code": null }
    });
    (status, Json(body)).into_response()
}

async fn get_fault(State(engine): State<Arc<Engine>>) -> Json<Value> {
    Json(json!({ "fault": engine.fault().to_string() }))
}

/// `PUT /admin/fault` with `{"fault": "stall"}` (see [`Fault`]'s syntax).
async fn put_fault(State(engine): State<Arc<Engine>>, body: Bytes) -> Response {
    let parsed = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|v| v["fault"].as_str().map(str::parse::<Fault>));
    match parsed {
        Some(Ok(fault)) => {
            engine.set_fault(fault);
            Json(json!({ "fault": fault.to_string() })).into_response()
        }
        Some(Err(e)) => error_response(StatusCode::BAD_REQUEST, "invalid_request_error", e),
        None => error_response(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "expected {\"fault\": \"none|slow:MILLIS|error|unavailable|stall|empty|reset|close|close:TIMES\"}",
        ),
    }
}

/// `POST /reset_prefix_cache` (vLLM's): 200 when the cache was emptied,
/// 409 while requests use it.
async fn reset_prefix_cache(State(engine): State<Arc<Engine>>) -> Response {
    if engine.reset_prefix_cache() {
        StatusCode::OK.into_response()
    } else {
        error_response(
            StatusCode::CONFLICT,
            "invalid_request_error",
            "the prefix cache is in use",
        )
    }
}

async fn not_found() -> Response {
    error_response(StatusCode::NOT_FOUND, "not_found_error", "no such endpoint")
}

async fn stats(State(engine): State<Arc<Engine>>) -> Json<EngineStats> {
    Json(engine.stats())
}

async fn metrics(State(engine): State<Arc<Engine>>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        engine.metrics_text(),
    )
        .into_response()
}

async fn models(State(engine): State<Arc<Engine>>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{
            "id": engine.config.model,
            "object": "model",
            "created": unix_now(),
            "owned_by": "hearth",
        }],
    }))
}

async fn chat_completions(
    State(engine): State<Arc<Engine>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate(engine, ApiKind::Chat, body).await
}

async fn completions(
    State(engine): State<Arc<Engine>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate(engine, ApiKind::Completions, body).await
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Everything needed to produce one response, shared by both modes.
struct Generation {
    kind: ApiKind,
    id: String,
    created: u64,
    model: String,
    admission: Admission,
    output_tokens: usize,
    /// `length` when the client capped the output, else `stop`.
    finish_reason: &'static str,
    /// Leading output tokens that are reasoning (chat only).
    reasoning_tokens: usize,
    prefill: Duration,
    decode: Duration,
}

impl Generation {
    fn usage(&self) -> Value {
        json!({
            "prompt_tokens": self.admission.prompt_tokens,
            "completion_tokens": self.output_tokens,
            "total_tokens": self.admission.prompt_tokens + self.output_tokens,
            "prompt_tokens_details": { "cached_tokens": self.admission.cached_tokens },
        })
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (ApiKind::Chat, false) => "chat.completion",
            (ApiKind::Chat, true) => "chat.completion.chunk",
            (ApiKind::Completions, _) => "text_completion",
        }
    }

    fn envelope(&self, chunk: bool, choices: Value) -> Value {
        json!({
            "id": self.id,
            "object": self.object(chunk),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        })
    }

    /// Output tokens that are reasoning.
    fn reasoning(&self) -> usize {
        match self.kind {
            ApiKind::Chat => self.reasoning_tokens.min(self.output_tokens),
            ApiKind::Completions => 0,
        }
    }

    /// The whole response body of a non-streaming request.
    fn full_response(&self) -> Value {
        let split = self.reasoning();
        let text: String = (split..self.output_tokens).map(word).collect();
        let choice = match self.kind {
            ApiKind::Chat => {
                let mut message = json!({ "role": "assistant", "content": text });
                if split > 0 {
                    message["reasoning_content"] = (0..split).map(word).collect::<String>().into();
                }
                json!({
                    "index": 0,
                    "message": message,
                    "logprobs": null,
                    "finish_reason": self.finish_reason,
                })
            }
            ApiKind::Completions => json!({
                "index": 0,
                "text": text,
                "logprobs": null,
                "finish_reason": self.finish_reason,
            }),
        };
        let mut body = self.envelope(false, json!([choice]));
        body["usage"] = self.usage();
        body
    }

    /// One streamed choice; `text` None with a finish reason ends the choice.
    fn chunk(&self, delta: Value, text: Option<&str>, finish: Option<&str>) -> Value {
        let choice = match self.kind {
            ApiKind::Chat => json!({
                "index": 0, "delta": delta, "logprobs": null, "finish_reason": finish,
            }),
            ApiKind::Completions => json!({
                "index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": finish,
            }),
        };
        self.envelope(true, json!([choice]))
    }

    fn usage_chunk(&self) -> Value {
        let mut body = self.envelope(true, json!([]));
        body["usage"] = self.usage();
        body
    }

    /// The role-only first delta a chat stream opens with, as OpenAI sends
    /// it (completions streams have none).
    fn role_event(&self) -> Option<Bytes> {
        (self.kind == ApiKind::Chat)
            .then(|| sse(&self.chunk(json!({ "role": "assistant", "content": "" }), None, None)))
    }

    /// Output token `i` (0-based) as a stream event.
    fn token_event(&self, i: usize) -> Bytes {
        let w = word(i);
        let field = if i < self.reasoning() {
            "reasoning_content"
        } else {
            "content"
        };
        sse(&self.chunk(json!({ field: w }), Some(w), None))
    }

    /// The event after the last token: the finish reason (then comes
    /// [`Generation::usage_event`], then [`DONE_EVENT`]).
    fn finish_event(&self) -> Bytes {
        sse(&self.chunk(json!({}), None, Some(self.finish_reason)))
    }

    fn usage_event(&self) -> Bytes {
        sse(&self.usage_chunk())
    }

    /// When output token `i` (0-based) is ready, counted from the first token's start.
    fn token_deadline(&self, decode_start: Instant, i: usize) -> Instant {
        let n = u32::try_from(i + 1).unwrap_or(u32::MAX);
        decode_start + self.decode.saturating_mul(n)
    }
}

fn word(i: usize) -> &'static str {
    WORDS[i % WORDS.len()]
}

async fn generate(
    engine: Arc<Engine>,
    kind: ApiKind,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match body {
        Ok(body) => body,
        Err(rejection) => {
            return error_response(
                rejection.status(),
                "invalid_request_error",
                rejection.body_text(),
            )
        }
    };
    let req: GenerationRequest = match request::parse(kind, &body) {
        Ok(req) => req,
        Err(e) => {
            return error_response(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                e.to_string(),
            )
        }
    };
    if let Some(p) = req.priority {
        *engine
            .last_priority
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(p);
    }
    let fault = engine.take_fault();
    match fault {
        Fault::ServerError => {
            return error_response(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                "injected fault",
            )
        }
        Fault::Unavailable => {
            return error_response(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "injected fault",
            )
        }
        // Until the client gives up and this future is dropped: running,
        // as a stuck engine shows its requests, and never progressing.
        Fault::Stall => {
            let _running = InFlight::start(engine.clone()).await;
            engine.stalled.fetch_add(1, Ordering::Relaxed);
            let _stalled = Stalled(engine.clone());
            return std::future::pending().await;
        }
        Fault::Slow { millis } => tokio::time::sleep(Duration::from_millis(millis)).await,
        Fault::Reset => {
            // A first chunk, then the body fails: hyper drops the connection.
            let chunks = futures::stream::iter([
                Ok(Bytes::from_static(b"data: {\"choices\":[")),
                Err(std::io::Error::other("injected reset")),
            ]);
            return (
                [(header::CONTENT_TYPE, "text/event-stream")],
                Body::from_stream(chunks),
            )
                .into_response();
        }
        Fault::Close { .. } => {
            // axum::serve runs each connection in a task of its own; a task
            // that unwinds drops its socket, so the connection closes with
            // not a byte written. `resume_unwind` skips the panic hook:
            // nothing is printed.
            std::panic::resume_unwind(Box::new("injected close"));
        }
        Fault::None | Fault::Empty => {}
    }
    let config = &engine.config;
    if let Some(cost) = &config.scheduler {
        let scheduler = engine.scheduler.get_or_init(|| {
            let weak = Arc::downgrade(&engine);
            let sink = config.kv_events.is_some().then(|| {
                Box::new(move |events| {
                    if let Some(e) = weak.upgrade() {
                        e.publish_kv_events(events);
                    }
                }) as scheduled::EventSink
            });
            scheduled::Scheduler::start(
                cost.clone(),
                config.block_tokens,
                config.cache_capacity_tokens,
                config.time_scale,
                sink,
            )
        });
        let scheduler = Arc::clone(scheduler);
        // The cache hit is known once the scheduler admits the request.
        let admission = Admission {
            prompt_tokens: req.prompt.len().div_ceil(config.bytes_per_token),
            cached_tokens: 0,
        };
        let (seq, gen) = generation(&engine, kind, &req, fault, admission);
        return scheduled::respond(engine.clone(), scheduler, seq, gen, &req.prompt, req.stream)
            .await;
    }
    let guard = InFlight::start(engine.clone()).await;
    let admission = engine.admit(&req.prompt);
    let uncached = admission.prompt_tokens - admission.cached_tokens;
    let (_, mut gen) = generation(&engine, kind, &req, fault, admission);
    gen.prefill = config.wall(uncached as f64 * config.prefill_micros_per_token);
    gen.decode = config.wall(config.decode_micros_per_token);
    tracing::debug!(
        engine = %config.id,
        prompt_tokens = admission.prompt_tokens,
        cached_tokens = admission.cached_tokens,
        output_tokens = gen.output_tokens,
        stream = req.stream,
        "request admitted"
    );
    if req.stream {
        stream_response(gen, guard)
    } else {
        full_response(gen, guard).await
    }
}

/// The response's shape for an admitted request (costs zero), and the
/// engine's sequence number for it.
fn generation(
    engine: &Engine,
    kind: ApiKind,
    req: &GenerationRequest,
    fault: Fault,
    admission: Admission,
) -> (u64, Generation) {
    let config = &engine.config;
    let seq = engine.next_id.fetch_add(1, Ordering::Relaxed);
    let prefix = match kind {
        ApiKind::Chat => "chatcmpl",
        ApiKind::Completions => "cmpl",
    };
    let gen = Generation {
        kind,
        id: format!("{prefix}-{}-{seq}", config.id),
        created: unix_now(),
        model: req.model.clone().unwrap_or_else(|| config.model.clone()),
        admission,
        output_tokens: if fault == Fault::Empty || req.forces_end {
            0
        } else {
            req.max_tokens.unwrap_or(config.default_output_tokens)
        },
        // An engine that generated nothing did not reach a token limit.
        finish_reason: if req.max_tokens.is_some() && fault != Fault::Empty && !req.forces_end {
            "length"
        } else {
            "stop"
        },
        reasoning_tokens: config.reasoning_tokens,
        prefill: Duration::ZERO,
        decode: Duration::ZERO,
    };
    (seq, gen)
}

async fn full_response(gen: Generation, mut guard: InFlight) -> Response {
    // If the client goes away, hyper drops this future and the guard counts
    // the request as aborted.
    let decode_start = Instant::now() + gen.prefill;
    let end = if gen.output_tokens == 0 {
        decode_start
    } else {
        gen.token_deadline(decode_start, gen.output_tokens - 1)
    };
    tokio::time::sleep_until(end).await;
    let body = gen.full_response();
    guard.completed = true;
    Json(body).into_response()
}

/// Where a stream is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Prefill,
    Token(usize),
    Finish,
    Usage,
    Done,
    End,
}

struct StreamState {
    gen: Generation,
    guard: InFlight,
    phase: Phase,
    decode_start: Instant,
}

/// A stream's last event.
const DONE_EVENT: &[u8] = b"data: [DONE]\n\n";

fn sse(value: &Value) -> Bytes {
    Bytes::from(format!("data: {value}\n\n"))
}

fn stream_response(gen: Generation, guard: InFlight) -> Response {
    let state = StreamState {
        decode_start: Instant::now() + gen.prefill,
        gen,
        guard,
        phase: Phase::Prefill,
    };
    // The state (and with it the guard) lives inside the body: when hyper
    // drops the body because the client left, the request counts as aborted.
    let events = futures::stream::unfold(state, next_event);
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(events),
    )
        .into_response()
}

/// The next SSE event of a stream, waiting for the cost model's deadline.
async fn next_event(mut s: StreamState) -> Option<(Result<Bytes, Infallible>, StreamState)> {
    loop {
        let event = match s.phase {
            Phase::Prefill => {
                tokio::time::sleep_until(s.decode_start).await;
                s.phase = if s.gen.output_tokens == 0 {
                    Phase::Finish
                } else {
                    Phase::Token(0)
                };
                match s.gen.role_event() {
                    Some(role) => role,
                    None => continue,
                }
            }
            Phase::Token(i) => {
                tokio::time::sleep_until(s.gen.token_deadline(s.decode_start, i)).await;
                s.phase = if i + 1 >= s.gen.output_tokens {
                    Phase::Finish
                } else {
                    Phase::Token(i + 1)
                };
                s.gen.token_event(i)
            }
            Phase::Finish => {
                s.phase = Phase::Usage;
                s.gen.finish_event()
            }
            Phase::Usage => {
                s.phase = Phase::Done;
                s.gen.usage_event()
            }
            Phase::Done => {
                // Everything the client needs has been produced.
                s.guard.completed = true;
                s.phase = Phase::End;
                Bytes::from_static(DONE_EVENT)
            }
            Phase::End => return None,
        };
        return Some((Ok(event), s));
    }
}

#[cfg(test)]
mod tests;

//! Settings: one typed struct, parsed from flags and `HEARTH_*` variables,
//! validated as a whole before anything starts.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use clap::{CommandFactory, Parser, Subcommand};

pub use hearth_router::{check_upstreams, default_replica_id, LongLane, UpstreamSpec};
use hearth_router::{
    AffinityBasis, FlowParams, HealthParams, QueueParams, RouterParams, ScoreParams,
};

/// `HEARTH_*` variables read by Hearth's other tools (scripts, tests, the
/// benchmark), not by the sidecar; accepted so a shared environment works.
pub const OTHER_TOOLS_VARS: &[&str] = &[
    "HEARTH_ENVOY",
    "HEARTH_DEMO_PORT",
    "HEARTH_SETUP_RELEASE",
    "HEARTH_SETUP_LLAMA",
    "HEARTH_CACHE_DIR",
    "HEARTH_LLAMA_SERVER",
    "HEARTH_LLAMA_MODEL",
    "HEARTH_SETUP_VLLM",
    "HEARTH_VLLM_HOME",
    "HEARTH_SETUP_PEERS",
    "HEARTH_SMG",
    "HEARTH_VLLM_ROUTER",
    "HEARTH_INFERENCE_PERF",
    "HEARTH_BUILD_JOBS",
];

#[derive(Parser, Debug, Clone)]
#[command(
    name = "hearth-ext-proc",
    version,
    about = "Hearth's ext_proc sidecar: routes each LLM request to the replica that holds its prompt prefix, unless load says otherwise."
)]
pub struct Cli {
    #[command(flatten)]
    pub settings: Settings,
    #[command(subcommand)]
    pub command: Option<Command>,
}

#[derive(Subcommand, Debug, Clone)]
pub enum Command {
    /// Print the Envoy bootstrap for a standalone gateway in front of the
    /// configured upstreams, pointed at this sidecar, and exit.
    EnvoyConfig(EnvoyConfigArgs),
    /// Print the public key of a peer identity file (what
    /// HEARTH_PEERS_IDENTITY_FILE holds), as HEARTH_PEERS_MEMBERS_FILE
    /// lists it, and exit.
    PeerPublicKey {
        /// The identity file: an Ed25519 seed as 64 hex characters.
        file: PathBuf,
    },
}

/// Every sidecar setting. Each flag has a `HEARTH_*` twin.
#[derive(clap::Args, Debug, Clone)]
pub struct Settings {
    /// gRPC address of the ext_proc service (Envoy connects here).
    #[arg(long, env = "HEARTH_LISTEN", default_value = "127.0.0.1:50051")]
    pub listen: SocketAddr,

    /// HTTP address of the state endpoint (`/state`, `/health`, `/metrics`,
    /// the dashboard), which also takes `POST /outcome` from Envoy's
    /// outcome filter.
    #[arg(long, env = "HEARTH_ADMIN_LISTEN", default_value = "127.0.0.1:9190")]
    pub admin_listen: SocketAddr,

    /// A file holding the shared secret Envoy sends to the control
    /// surfaces (surrounding whitespace ignored, at least 32 characters,
    /// never logged): then `POST /outcome` and every gRPC call but gRPC
    /// health need `authorization: Bearer <token>`, and
    /// `/debug/decisions` shows request ids only with it. Global: also
    /// read after `envoy-config`, which puts it in the rendered Envoy.
    #[arg(long, env = "HEARTH_CONTROL_TOKEN_FILE", global = true)]
    pub control_token_file: Option<PathBuf>,

    /// Start without HEARTH_CONTROL_TOKEN_FILE although a listener is not
    /// on loopback: for a private network the operator secures otherwise
    /// (a NetworkPolicy, a mesh's mutual TLS). Anyone who reaches the
    /// ports can then steer health and routing.
    #[arg(long, env = "HEARTH_CONTROL_INSECURE", default_value_t = false,
          action = clap::ArgAction::Set,
          value_parser = clap::builder::BoolishValueParser::new())]
    pub control_insecure: bool,

    /// PEM certificate chain the gRPC port serves TLS with (with
    /// HEARTH_GRPC_TLS_KEY_FILE); unset: plain HTTP/2.
    #[arg(
        long,
        env = "HEARTH_GRPC_TLS_CERT_FILE",
        requires = "grpc_tls_key_file"
    )]
    pub grpc_tls_cert_file: Option<PathBuf>,

    /// PEM private key of HEARTH_GRPC_TLS_CERT_FILE.
    #[arg(
        long,
        env = "HEARTH_GRPC_TLS_KEY_FILE",
        requires = "grpc_tls_cert_file"
    )]
    pub grpc_tls_key_file: Option<PathBuf>,

    /// PEM CA certificate(s): with TLS on, the gRPC port accepts only
    /// clients presenting a certificate this CA signed.
    #[arg(
        long,
        env = "HEARTH_GRPC_TLS_CLIENT_CA_FILE",
        requires = "grpc_tls_cert_file"
    )]
    pub grpc_tls_client_ca_file: Option<PathBuf>,

    /// Connections the gRPC port holds at once (each Envoy worker keeps
    /// about one per sidecar); more wait to be accepted.
    #[arg(long, env = "HEARTH_GRPC_MAX_CONNECTIONS", default_value_t = 1024)]
    pub grpc_max_connections: usize,

    /// Connections the admin HTTP port holds at once (outcome reports,
    /// scrapes, the dashboard); more wait to be accepted.
    #[arg(long, env = "HEARTH_ADMIN_MAX_CONNECTIONS", default_value_t = 256)]
    pub admin_max_connections: usize,

    /// Engine replicas, comma separated: `ip:port[;id=NAME][;model=M]...`.
    /// `id` is the opaque name shown to clients (default `replica-N`);
    /// `model` (repeatable) limits the replica to those models.
    #[arg(
        long,
        env = "HEARTH_UPSTREAMS",
        value_delimiter = ',',
        required_unless_present_any = ["upstreams_file", "discovery"],
        conflicts_with_all = ["upstreams_file", "discovery"]
    )]
    pub upstreams: Vec<UpstreamSpec>,

    /// Read the replica list from this file instead (one upstream per line,
    /// the `HEARTH_UPSTREAMS` syntax, `#` comments), and reload it when it
    /// changes or on SIGHUP, without a restart.
    #[arg(long, env = "HEARTH_UPSTREAMS_FILE", conflicts_with = "discovery")]
    pub upstreams_file: Option<std::path::PathBuf>,

    /// Learn the replicas from the Kubernetes API instead of a list:
    /// `inferencepool` (the pods an InferencePool selects, on its target
    /// ports) or `pods` (the pods HEARTH_DISCOVERY_SELECTOR selects, on
    /// HEARTH_DISCOVERY_PORT); a replica per ready pod and port.
    #[arg(long, env = "HEARTH_DISCOVERY", value_enum)]
    pub discovery: Option<Discovery>,

    /// Namespace of the InferencePool or the pods (default: the sidecar's
    /// own namespace in a cluster, else the kubeconfig context's).
    #[arg(long, env = "HEARTH_DISCOVERY_NAMESPACE")]
    pub discovery_namespace: Option<String>,

    /// Name of the InferencePool (`HEARTH_DISCOVERY=inferencepool`).
    #[arg(long, env = "HEARTH_INFERENCE_POOL")]
    pub inference_pool: Option<String>,

    /// Label selector of the engine pods (`HEARTH_DISCOVERY=pods`), as
    /// `key=value[,key=value...]`.
    #[arg(long, env = "HEARTH_DISCOVERY_SELECTOR")]
    pub discovery_selector: Option<String>,

    /// Engine port on each pod (`HEARTH_DISCOVERY=pods`).
    #[arg(long, env = "HEARTH_DISCOVERY_PORT")]
    pub discovery_port: Option<u16>,

    /// Data-parallel ranks behind each discovered pod and port (as an
    /// upstream's `dp=N`): each rank its own routing target.
    #[arg(long, env = "HEARTH_DISCOVERY_DP_RANKS", default_value_t = 1)]
    pub discovery_dp_ranks: u32,

    /// Reach the discovered engines over HTTPS (verified with
    /// `HEARTH_ENGINE_CA_FILE`, else the system roots), as `https://`
    /// entries of a list are; off: plain HTTP.
    #[arg(long, env = "HEARTH_DISCOVERY_TLS", default_value_t = false, action = clap::ArgAction::Set)]
    pub discovery_tls: bool,

    /// A kubeconfig file for reaching the API from outside a cluster
    /// (default: in-cluster service account, else `KUBECONFIG`, else
    /// `~/.kube/config`).
    #[arg(long, env = "HEARTH_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,

    /// Seconds between two checks of `HEARTH_UPSTREAMS_FILE` for changes
    /// (0 = reload on SIGHUP only).
    #[arg(long, env = "HEARTH_UPSTREAMS_POLL_SECONDS", default_value_t = 2.0)]
    pub upstreams_poll_seconds: f64,

    /// Fingerprint block size in bytes; must match the wasm filter's.
    #[arg(long, env = "HEARTH_BLOCK_SIZE", default_value_t = hearth_wire::DEFAULT_BLOCK_SIZE)]
    pub block_size: usize,

    /// Warmth index capacity per replica, in blocks (LRU beyond it).
    /// Unset: 100,000, or for an engine that reports its KV capacity in
    /// its metrics (vLLM, SGLang), what that holds.
    #[arg(long, env = "HEARTH_WARMTH_BLOCKS")]
    pub warmth_blocks: Option<usize>,

    /// Credit basis: absolute, marginal or relative.
    #[arg(long, env = "HEARTH_AFFINITY_BASIS", default_value = "relative")]
    pub affinity_basis: AffinityBasis,

    /// Credit cap, in blocks.
    #[arg(long, env = "HEARTH_AFFINITY_CAP", default_value_t = 128)]
    pub affinity_cap: u32,

    /// Blocks of credit that one unit of in-flight load outweighs.
    #[arg(long, env = "HEARTH_ALPHA", default_value_t = 1.0)]
    pub alpha: f64,

    /// Credit cap, in blocks, for a request that continues no earlier
    /// prompt (a conversation's first turn, or its first after compaction):
    /// its overlap is a prefix other conversations share, so load decides
    /// where it starts.
    #[arg(long, env = "HEARTH_FIRST_TURN_CAP", default_value_t = 4)]
    pub first_turn_cap: u32,

    /// Load units each resident conversation (its latest turn went to the
    /// replica within HEARTH_RESIDENT_SECONDS; running or paused) adds when
    /// a new conversation is placed while some replica is idle (nothing
    /// resident, nothing running). Above HEARTH_FIRST_TURN_CAP /
    /// HEARTH_ALPHA, the idle replica wins the newcomer over one holding a
    /// conversation and the newcomer's shared prefix (0 = resident
    /// conversations weigh nothing).
    #[arg(long, env = "HEARTH_RESIDENT_LOAD", default_value_t = 5.0)]
    pub resident_load: f64,

    /// Mean load (load units) of the candidate replicas above which a
    /// later turn of a conversation weighs their load differences in
    /// proportion to that mean (scaled by this over the mean), while no
    /// candidate's engine reports requests waiting and none runs more
    /// than `HEARTH_HOTSPOT_RATIO` times another's load: a few requests more
    /// on a replica that runs many slow each of them by a small share of
    /// its steps, while moving reads the conversation again (0 = load
    /// differences always count as they are). One-shot requests weigh it
    /// the same way, first turns by the share that go on (the sequel
    /// share); prompts still being read always count as they are.
    #[arg(long, env = "HEARTH_RELATIVE_LOAD_ABOVE", default_value_t = 8.0)]
    pub relative_load_above: f64,

    /// How many times another candidate's load one candidate must run to
    /// be a hotspot, beside which load differences count as they are
    /// whatever `HEARTH_RELATIVE_LOAD_ABOVE` says (scaled by the mean, a
    /// difference would weigh ever less as the hotspot, raising the mean
    /// itself, grew). At least 1.
    #[arg(long, env = "HEARTH_HOTSPOT_RATIO", default_value_t = 8.0)]
    pub hotspot_ratio: f64,

    /// For a prompt no candidate replica holds any block of (a cold
    /// prompt, read in full wherever it goes): the load units each block
    /// (HEARTH_BLOCK_SIZE bytes) of prompt still being read on a
    /// candidate weighs. At 1 a block read ahead of it weighs a request
    /// in flight, so a cold prompt goes where the least prompt is queued
    /// for reading before it. 0 = those bytes weigh their
    /// HEARTH_LOAD_UNIT_BYTES units, as for every other request.
    #[arg(long, env = "HEARTH_COLD_READ_WEIGHT", default_value_t = 1.0)]
    pub cold_read_weight: f64,

    /// Correct each replica's warmth index from its answers' usage (the
    /// cached tokens the engine reports): shrink it toward the engine's
    /// real cache when it served less than predicted, drop it when the
    /// engine restarted. Usage is read and counted either way (true/false).
    #[arg(long, env = "HEARTH_USAGE_FEEDBACK", default_value_t = true,
          action = clap::ArgAction::Set,
          value_parser = clap::builder::BoolishValueParser::new())]
    pub usage_feedback: bool,

    /// Seconds after its latest turn that a conversation still counts as
    /// resident on its replica.
    #[arg(long, env = "HEARTH_RESIDENT_SECONDS", default_value_t = 120.0)]
    pub resident_seconds: f64,

    /// Seconds after its answer ended that a first turn may wait for a
    /// second turn before it counts as one-shot, for the sequel share
    /// that sets a first turn's credit cap (HEARTH_FIRST_TURN_CAP). An
    /// agent's tool call comes back within seconds; a second turn after a
    /// longer pause still moves its first turn back from one-shot.
    #[arg(long, env = "HEARTH_SEQUEL_HORIZON_SECONDS", default_value_t = 15.0)]
    pub sequel_horizon_seconds: f64,

    /// Uncached prompt bytes that weigh one extra load unit (every request
    /// weighs at least one).
    #[arg(long, env = "HEARTH_LOAD_UNIT_BYTES", default_value_t = 65_536)]
    pub load_unit_bytes: u64,

    /// In-flight requests per replica beyond which it takes no more
    /// (0 = no limit). When every replica is full the request gets 429.
    #[arg(long, env = "HEARTH_MAX_INFLIGHT", default_value_t = 0)]
    pub max_inflight: u32,

    /// Fallback endpoints listed after the chosen one, for Envoy's retries.
    #[arg(long, env = "HEARTH_FALLBACKS", default_value_t = 2)]
    pub fallbacks: usize,

    /// A replica with no successful real request for this many seconds
    /// gets an active probe, and at most one per interval while it stays
    /// idle; real traffic that succeeds is the proof of health and sends
    /// no probe (0 disables probes).
    #[arg(long, env = "HEARTH_PROBE_INTERVAL_SECONDS", default_value_t = 30.0)]
    pub probe_interval_seconds: f64,

    /// Seconds between two probes of a replica whose probe failed (or whose
    /// connection was refused) since its last success, or that is fenced
    /// with its backoff over.
    #[arg(long, env = "HEARTH_PROBE_RETRY_SECONDS", default_value_t = 2.0)]
    pub probe_retry_seconds: f64,

    /// A replica made suspect by evidence a client could have provoked (an
    /// empty answer, a 5xx, a first-byte timeout, a retry, a peer's
    /// fencing) is probed at once, and at most once per this many seconds;
    /// only its probes can fence it.
    #[arg(long, env = "HEARTH_SUSPECT_PROBE_SECONDS", default_value_t = 10.0)]
    pub suspect_probe_seconds: f64,

    /// A replica whose engine reports requests running or queued while its
    /// own work counters (from its metrics) stand still this many seconds
    /// is stalled: a strike per probe retry while it lasts (0 disables).
    #[arg(long, env = "HEARTH_STALL_SECONDS", default_value_t = 30.0)]
    pub stall_seconds: f64,

    /// Deadline of each probe request, in seconds.
    #[arg(long, env = "HEARTH_PROBE_TIMEOUT_SECONDS", default_value_t = 5.0)]
    pub probe_timeout_seconds: f64,

    /// Replicas probed at the same time.
    #[arg(long, env = "HEARTH_PROBE_CONCURRENCY", default_value_t = 8)]
    pub probe_concurrency: usize,

    /// Consecutive failed requests or probes that fence a replica.
    #[arg(long, env = "HEARTH_EJECT_AFTER", default_value_t = 3)]
    pub eject_after: u32,

    /// First fencing's length in seconds; doubles with each fencing in a row.
    #[arg(long, env = "HEARTH_EJECT_BACKOFF_SECONDS", default_value_t = 5.0)]
    pub eject_backoff_seconds: f64,

    /// Longest fencing backoff, in seconds.
    #[arg(
        long,
        env = "HEARTH_EJECT_MAX_BACKOFF_SECONDS",
        default_value_t = 120.0
    )]
    pub eject_max_backoff_seconds: f64,

    /// A real request that succeeded this many seconds ago excuses a probe
    /// timeout (a busy replica is slow, not broken).
    #[arg(long, env = "HEARTH_BUSY_GRACE_SECONDS", default_value_t = 30.0)]
    pub busy_grace_seconds: f64,

    /// A routed request with no response headers after this many seconds,
    /// plus its prefill allowance, counts as a timeout against its replica
    /// (0 disables).
    #[arg(
        long,
        env = "HEARTH_FIRST_BYTE_TIMEOUT_SECONDS",
        default_value_t = 60.0
    )]
    pub first_byte_timeout_seconds: f64,

    /// The first-byte deadline grows by one second per this many prompt
    /// bytes the chosen replica does not hold (a cold long prompt takes
    /// long to prefill; 0 = no allowance).
    #[arg(
        long,
        env = "HEARTH_PREFILL_BYTES_PER_SECOND",
        default_value_t = 16_384
    )]
    pub prefill_bytes_per_second: u64,

    /// Bearer key the sidecar sends to engines with its probes and metrics
    /// scrapes (never logged). Prefer HEARTH_ENGINE_API_KEY_FILE.
    #[arg(
        long,
        env = "HEARTH_ENGINE_API_KEY",
        hide_env_values = true,
        conflicts_with = "engine_api_key_file"
    )]
    pub engine_api_key: Option<Secret>,

    /// A file holding the engines' bearer key (surrounding whitespace
    /// ignored); read at start-up.
    #[arg(long, env = "HEARTH_ENGINE_API_KEY_FILE")]
    pub engine_api_key_file: Option<std::path::PathBuf>,

    /// PEM file of the CA certificate(s) that `https://` engines'
    /// certificates must chain to, instead of the system's roots (for a
    /// private CA).
    #[arg(long, env = "HEARTH_ENGINE_CA_FILE")]
    pub engine_ca_file: Option<std::path::PathBuf>,

    /// Canonical prompt bytes from which a request is "long" and goes only
    /// to replicas tagged `long` (when any are).
    #[arg(long, env = "HEARTH_LONG_PROMPT_BYTES", default_value_t = 400_000)]
    pub long_prompt_bytes: u64,

    /// Short prompts on `long` replicas: shared (like any replica),
    /// exclusive (never), avoid (only when no other replica can take them),
    /// avoid-unless-warm (never, unless the session is cached there).
    #[arg(long, env = "HEARTH_LONG_LANE", default_value = "shared")]
    pub long_lane: LongLane,

    /// Requests asking for at most this many output tokens prefer replicas
    /// tagged `profile=short-output` when cache and load tie; longer ones
    /// prefer the others.
    #[arg(long, env = "HEARTH_SHORT_OUTPUT_TOKENS", default_value_t = 256)]
    pub short_output_tokens: u64,

    /// Seconds between two scrapes of each engine's Prometheus `/metrics`
    /// (vLLM or SGLang names; 0 disables).
    #[arg(long, env = "HEARTH_ENGINE_METRICS_SECONDS", default_value_t = 2.0)]
    pub engine_metrics_seconds: f64,

    /// Engine figures older than this many seconds are ignored.
    #[arg(
        long,
        env = "HEARTH_ENGINE_METRICS_STALE_SECONDS",
        default_value_t = 10.0
    )]
    pub engine_metrics_stale_seconds: f64,

    /// Load units added per request an engine reports queued, or running
    /// beyond what this sidecar sent it (other gateways' traffic).
    #[arg(long, env = "HEARTH_ENGINE_LOAD_WEIGHT", default_value_t = 1.0)]
    pub engine_load_weight: f64,

    /// A replica whose engine reports this many queued requests takes no
    /// more (0 = no limit); when every replica is past it, 429.
    #[arg(long, env = "HEARTH_MAX_QUEUE", default_value_t = 0)]
    pub max_queue: u64,

    /// Flow control: while every replica a request may use is saturated
    /// (see the HEARTH_FLOW_* thresholds), the request waits in the
    /// sidecar's queue instead of being dispatched; off: it is dispatched
    /// at once, as before (true/false).
    #[arg(long, env = "HEARTH_FLOW_CONTROL", default_value_t = true,
          action = clap::ArgAction::Set,
          value_parser = clap::builder::BoolishValueParser::new())]
    pub flow_control: bool,

    /// Requests waiting in a replica's engine (its scraped metrics) from
    /// which the replica is saturated (0 = the engine's queue is not
    /// looked at).
    #[arg(long, env = "HEARTH_FLOW_ENGINE_WAITING", default_value_t = 5.0)]
    pub flow_engine_waiting: f64,

    /// KV cache use (0 to 1, the engine's metrics) from which a replica
    /// with any request waiting in its engine is saturated (0 = not looked
    /// at). A full cache with nothing waiting is a prefix cache at work.
    #[arg(long, env = "HEARTH_FLOW_KV_USAGE", default_value_t = 0.9)]
    pub flow_kv_usage: f64,

    /// Uncached prompt bytes in flight on one replica (through this
    /// sidecar and its peers) beyond which it is saturated (0 = no limit):
    /// prefill work Hearth sent that the engine's figures may not show yet.
    #[arg(long, env = "HEARTH_FLOW_UNCACHED_BYTES", default_value_t = 8 << 20)]
    pub flow_uncached_bytes: u64,

    /// Seconds of prefill in flight on one replica beyond which it is
    /// saturated, at the prefill rate learnt from its engine's first
    /// tokens (0 = not looked at). While no rate is learnt, and where
    /// HEARTH_FLOW_UNCACHED_BYTES is less, that limit holds instead.
    #[arg(long, env = "HEARTH_FLOW_PREFILL_SECONDS", default_value_t = 0.0)]
    pub flow_prefill_seconds: f64,

    /// Seconds a queued request waits for a saturated replica that holds
    /// more of its prompt than any free one, before it takes a free one.
    #[arg(long, env = "HEARTH_FLOW_AFFINITY_WAIT_SECONDS", default_value_t = 2.0)]
    pub flow_affinity_wait_seconds: f64,

    /// Seconds a priority band's peak of requests in flight on a replica
    /// stays reserved for it: a request of a lower band finds the replica
    /// saturated while its engine's batch (as learnt from its figures) has
    /// no slot beyond those, so an interactive band finds free slots while
    /// batch or sheddable load fills the rest (0 = nothing reserved).
    #[arg(long, env = "HEARTH_FLOW_HEADROOM_SECONDS", default_value_t = 30.0)]
    pub flow_headroom_seconds: f64,

    /// Seconds a flow's peak of requests in flight on a replica stays kept
    /// for it while the flow is under its fair share: within a band, a
    /// request whose flow (its fairness id) has its share of the engines'
    /// learnt batches in flight finds a replica saturated while the
    /// replica has no slot beyond those the band's other flows under
    /// their share came back for within this window (0 = nothing kept
    /// between flows).
    #[arg(long, env = "HEARTH_FLOW_FAIR_SLOTS_SECONDS", default_value_t = 0.0)]
    pub flow_fair_slots_seconds: f64,

    /// The share (above 0, at most 1) of a replica's prefill time that
    /// bands below a higher band about there may take: after a lower
    /// band's request goes there, the lower bands find it saturated for
    /// that request's unread prompt's prefill time (at the learnt rate)
    /// divided by this share, so a higher band's request seldom arrives
    /// behind a lower band's long prompt in the engine (1 = not paced).
    #[arg(long, env = "HEARTH_FLOW_LOWER_PREFILL_SHARE", default_value_t = hearth_router::params::LOWER_PREFILL_SHARE)]
    pub flow_lower_prefill_share: f64,

    /// A sheddable request (negative priority) that finds the replicas'
    /// free slots kept for higher bands (`HEARTH_FLOW_HEADROOM_SECONDS`,
    /// `HEARTH_FLOW_LOWER_PREFILL_SHARE`), but not every replica
    /// saturated, waits in the queue behind every other band until a slot
    /// is its or its time to live runs out; false: it is refused at once
    /// (429 `sheddable`) then too. While every replica is saturated it is
    /// refused at once either way.
    #[arg(long, env = "HEARTH_FLOW_SHEDDABLE_WAITS", default_value_t = true, action = clap::ArgAction::Set)]
    pub flow_sheddable_waits: bool,

    /// Seconds a request waits in the queue at most; then 429 with
    /// `x-hearth-drop-reason: ttl` (at most 540: Envoy's rendered
    /// max_message_timeout is 600 s).
    #[arg(long, env = "HEARTH_FLOW_TTL_SECONDS", default_value_t = 60.0)]
    pub flow_ttl_seconds: f64,

    /// Requests the queue holds at most; a newcomer past it evicts the
    /// newest of a lower band, or gets 429 (`queue_full`).
    #[arg(long, env = "HEARTH_FLOW_MAX_REQUESTS", default_value_t = 10_000)]
    pub flow_max_requests: usize,

    /// Prompt bytes the queue holds at most; a newcomer past it evicts the
    /// newest of a lower band, or gets 429 (`queue_bytes`).
    #[arg(long, env = "HEARTH_FLOW_MAX_BYTES", default_value_t = 256 << 20)]
    pub flow_max_bytes: u64,

    /// Prompt bytes each fairness id earns per round of the deficit round
    /// robin inside a band (the granularity of fairness, not its ratio).
    #[arg(long, env = "HEARTH_FLOW_QUANTUM_BYTES", default_value_t = 65_536)]
    pub flow_quantum_bytes: u64,

    /// Priority per objective, `name=priority[,name=priority...]`: the
    /// band a request naming that objective in
    /// `x-gateway-inference-objective` waits in (higher first; a negative
    /// priority is sheddable: refused at once while the fleet is
    /// saturated). Unnamed and unknown objectives: priority 0.
    #[arg(long, env = "HEARTH_FLOW_OBJECTIVES", value_parser = parse_objectives)]
    pub flow_objectives: Option<Objectives>,

    /// A request header whose value is the fairness id of requests
    /// without `x-gateway-inference-fairness-id` (e.g. one an
    /// authentication filter sets from the API key). The value is kept
    /// only as a digest. Unset: such requests share one fairness id.
    #[arg(long, env = "HEARTH_FLOW_FAIRNESS_HEADER")]
    pub flow_fairness_header: Option<String>,

    /// Write each generation's place in its engine's queue into its body,
    /// as the request's only top-level `priority` (a client's own is
    /// taken out): its band first, then its tag on its replica's virtual
    /// clock (each tenant's requests in the order they came; a tenant
    /// sending more than one request an engine interval goes after those
    /// that do not). For engines that schedule by it (vLLM
    /// `--scheduling-policy priority`: `lower-first`); `off` leaves the
    /// body as the client sent it. In filter mode the outcome filter
    /// writes it; in the body shapes the sidecar does.
    #[arg(long, env = "HEARTH_ENGINE_PRIORITY", value_enum, default_value_t = EnginePriority::Off)]
    pub engine_priority: EnginePriority,

    /// Endpoint-picker mode: request bodies held at once (all streams)
    /// while they arrive, before the decision; a prompt request past it
    /// gets 429 with Retry-After. A backstop to the bytes: uploads last
    /// milliseconds, so legitimate traffic rarely holds many at once, and
    /// slow uploads that fill it lock out prompt requests, so it is not
    /// set low.
    #[arg(long, env = "HEARTH_PICKER_HELD_BODIES", default_value_t = 256)]
    pub picker_held_bodies: usize,

    /// Endpoint-picker mode: bytes of request bodies held at once (all
    /// streams). A body grows only while at least as many bytes stay free
    /// as it holds (so one body takes at most half, and large bodies are
    /// refused first); past it, 429 with Retry-After.
    #[arg(long, env = "HEARTH_PICKER_HELD_BYTES", default_value_t = 256 << 20)]
    pub picker_held_bytes: usize,

    /// Decisions kept in memory for `GET /debug/decisions` (0 = none).
    #[arg(long, env = "HEARTH_JOURNAL_SIZE", default_value_t = 10_000)]
    pub journal_size: usize,

    /// The pool's name in the `llm_d_epp_*` pool series (their `name`
    /// label). Unset: `HEARTH_INFERENCE_POOL` when discovery follows a
    /// pool, else `hearth`.
    #[arg(long, env = "HEARTH_POOL_NAME")]
    pub pool_name: Option<String>,

    /// Also append every decision as one JSON line to this file (off when
    /// unset). Hashes and numbers only, never prompt text.
    #[arg(long, env = "HEARTH_JOURNAL_FILE")]
    pub journal_file: Option<std::path::PathBuf>,

    /// The journal file's size, in bytes, at which it is renamed to
    /// `PATH.1` (replacing the previous one) and a new file is started.
    #[arg(long, env = "HEARTH_JOURNAL_FILE_MAX_BYTES", default_value_t = 100 << 20)]
    pub journal_file_max_bytes: u64,

    /// The NATS server(s) the sidecars of one fleet share what they learn
    /// through (`nats://host:4222`, `tls://...` for TLS; several separated
    /// by commas). Unset: this sidecar shares nothing.
    #[arg(long, env = "HEARTH_PEERS_URL")]
    pub peers_url: Option<String>,

    /// The fleet's name on the bus: sidecars share only with peers of the
    /// same name (letters, digits, `-` and `_`).
    #[arg(long, env = "HEARTH_FLEET", default_value = "default")]
    pub fleet: String,

    /// User name for the NATS server (with HEARTH_PEERS_PASSWORD).
    #[arg(long, env = "HEARTH_PEERS_USER", requires = "peers_password")]
    pub peers_user: Option<String>,

    /// Password for the NATS server (never logged).
    #[arg(
        long,
        env = "HEARTH_PEERS_PASSWORD",
        hide_env_values = true,
        requires = "peers_user"
    )]
    pub peers_password: Option<Secret>,

    /// Token for the NATS server, instead of a user and password (never
    /// logged).
    #[arg(
        long,
        env = "HEARTH_PEERS_TOKEN",
        hide_env_values = true,
        conflicts_with = "peers_user"
    )]
    pub peers_token: Option<Secret>,

    /// Milliseconds between two updates to the peers (decisions' warmth,
    /// load, fencing, batched); an idle sidecar still sends its load once
    /// a second.
    #[arg(long, env = "HEARTH_PEERS_FLUSH_MS", default_value_t = 10)]
    pub peers_flush_ms: u64,

    /// At start, seconds to wait for a running peer's state before taking
    /// requests (none answers, as for the first sidecar: it starts after
    /// this long, cold).
    #[arg(long, env = "HEARTH_PEERS_SYNC_SECONDS", default_value_t = 2.0)]
    pub peers_sync_seconds: f64,

    /// A file holding the fleet's key (its bytes, surrounding whitespace
    /// ignored, at least 32; never logged), the same on every sidecar of
    /// the fleet: every peer message carries an HMAC-SHA256 made with it,
    /// and one whose MAC does not check is dropped. Required with
    /// HEARTH_PEERS_URL unless HEARTH_PEERS_INSECURE.
    #[arg(long, env = "HEARTH_PEERS_KEY_FILE")]
    pub peers_key_file: Option<PathBuf>,

    /// A file holding this sidecar's own peer key: an Ed25519 seed as 64
    /// hex characters (e.g. `openssl rand -hex 32`; never logged). Its
    /// public key (`hearth-ext-proc peer-public-key FILE` prints it) names
    /// the sidecar on the bus. Without it, a new key each start.
    #[arg(long, env = "HEARTH_PEERS_IDENTITY_FILE")]
    pub peers_identity_file: Option<PathBuf>,

    /// A file listing the public keys (64 hex characters each, one a
    /// line, `#` comments) of the sidecars allowed on the bus: a message
    /// signed by any other key is dropped (`unknown_member`), even with
    /// the fleet's MAC. Needs HEARTH_PEERS_IDENTITY_FILE, whose key must
    /// be listed. Without it, any holder of the fleet's key may join.
    #[arg(
        long,
        env = "HEARTH_PEERS_MEMBERS_FILE",
        requires = "peers_identity_file"
    )]
    pub peers_members_file: Option<PathBuf>,

    /// A PEM file of CA certificates the NATS server's certificate is
    /// checked against, besides the system's (a `tls://` bus whose server
    /// has a private CA's certificate).
    #[arg(long, env = "HEARTH_PEERS_CA_FILE")]
    pub peers_ca_file: Option<PathBuf>,

    /// Run the peer bus open: no HEARTH_PEERS_KEY_FILE required (without
    /// one, messages go and are taken unauthenticated), and a NATS server
    /// that is not on loopback accepted without credentials (true/false).
    #[arg(long, env = "HEARTH_PEERS_INSECURE", default_value_t = false,
          action = clap::ArgAction::Set,
          value_parser = clap::builder::BoolishValueParser::new())]
    pub peers_insecure: bool,

    /// Seconds open streams get to finish on shutdown before they are cut.
    #[arg(long, env = "HEARTH_DRAIN_SECONDS", default_value_t = 10)]
    pub drain_seconds: u64,

    /// Log filter (tracing env-filter syntax).
    #[arg(long, env = "HEARTH_LOG", default_value = "info")]
    pub log: String,
}

/// `HEARTH_FLOW_OBJECTIVES`: each objective's priority.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Objectives(pub BTreeMap<String, i32>);

impl Objectives {
    /// The priority of a request naming `objective` (0 when unnamed or
    /// unknown).
    pub fn priority(&self, objective: Option<&str>) -> i32 {
        objective.and_then(|o| self.0.get(o)).copied().unwrap_or(0)
    }
}

/// Parses `name=priority[,name=priority...]`.
pub fn parse_objectives(text: &str) -> Result<Objectives, String> {
    let mut map = BTreeMap::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (name, priority) = part
            .split_once('=')
            .ok_or_else(|| format!("{part:?} is not name=priority"))?;
        let name = name.trim();
        if name.is_empty() || name.len() > 253 || !name.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(format!("{name:?} is not an objective name"));
        }
        let priority: i32 = priority
            .trim()
            .parse()
            .map_err(|_| format!("{part:?}: the priority is not a whole number"))?;
        if map.insert(name.to_string(), priority).is_some() {
            return Err(format!("objective {name:?} is named twice"));
        }
    }
    Ok(Objectives(map))
}

/// The longest `HEARTH_FLOW_TTL_SECONDS`: a queued request's ext_proc
/// answer must come within the rendered `max_message_timeout`
/// ([`crate::envoy::render::MAX_MESSAGE_TIMEOUT_SECONDS`]), with room to
/// spare.
pub const MAX_FLOW_TTL_SECONDS: f64 = 540.0;

/// The warmth index of a replica whose engine does not report its KV
/// capacity, when `HEARTH_WARMTH_BLOCKS` is unset.
pub const DEFAULT_WARMTH_BLOCKS: usize = 100_000;

/// The wasm module's path in the shipped config (relative to the
/// repository root, where `scripts/setup` builds it).
pub const DEFAULT_WASM: &str = "target/wasm32-wasip1/wasm-release/hearth_filter.wasm";

/// Flags of `hearth-ext-proc envoy-config` (rendered by
/// `crate::envoy::render`).
#[derive(clap::Args, Debug, Clone)]
pub struct EnvoyConfigArgs {
    /// Address the gateway listens on for clients.
    #[arg(long, default_value = "127.0.0.1:10000")]
    pub gateway_listen: SocketAddr,
    /// Envoy's admin address (keep it on loopback).
    #[arg(long, default_value = "127.0.0.1:9901")]
    pub envoy_admin: SocketAddr,
    /// Path of the wasm filter module as Envoy will see it.
    #[arg(long, default_value = DEFAULT_WASM)]
    pub wasm: PathBuf,
    /// Largest request body the filter buffers and fingerprints, in bytes;
    /// larger ones pass on unhashed. The route's request buffer is this
    /// plus 1 MiB (in body mode, a body past it gets a 413).
    #[arg(long, default_value_t = 8 << 20)]
    pub max_body_bytes: usize,
    /// Bytes of canonical prompt the filter hashes at most.
    #[arg(long, default_value_t = hearth_wire::DEFAULT_MAX_PREFIX_BYTES)]
    pub max_prefix_bytes: usize,
    /// `filter`: the wasm filter fingerprints, the sidecar gets headers only.
    /// `body`: no wasm filter; ext_proc sends each request body to the
    /// sidecar, which fingerprints it (for meshes without wasm).
    /// `gie`: the Gateway API Inference Extension's reference shape:
    /// ext_proc with FULL_DUPLEX_STREAMED bodies, an ORIGINAL_DST cluster
    /// that dials the destination header.
    #[arg(long, value_enum, default_value_t = Mode::Filter)]
    pub mode: Mode,
    /// Where the engines cluster gets its endpoints. `static`: listed in
    /// the bootstrap. `eds`: streamed by the sidecar (endpoint discovery),
    /// which pushes each change of its replica list. Default: `eds` when
    /// the list comes from `HEARTH_UPSTREAMS_FILE` (it can change while
    /// Envoy runs), else `static`. Not used by `--mode gie`, whose
    /// ORIGINAL_DST cluster has no endpoint list.
    #[arg(long, value_enum)]
    pub endpoints: Option<Endpoints>,
    /// Another sidecar of the fleet, as `GRPC_ADDR,HTTP_ADDR` (its
    /// `HEARTH_LISTEN` and `HEARTH_ADMIN_LISTEN`); repeat for each. Envoy
    /// spreads its streams over this sidecar and these, which share what
    /// they learn over `HEARTH_PEERS_URL`.
    #[arg(long = "also-sidecar", value_name = "GRPC_ADDR,HTTP_ADDR", value_parser = sidecar_pair)]
    pub more_sidecars: Vec<(SocketAddr, SocketAddr)>,
}

/// `GRPC_ADDR,HTTP_ADDR` of `--also-sidecar`.
fn sidecar_pair(s: &str) -> Result<(SocketAddr, SocketAddr), String> {
    let (grpc, http) = s
        .split_once(',')
        .ok_or_else(|| format!("{s:?}: expected GRPC_ADDR,HTTP_ADDR (two ip:port)"))?;
    let parse = |what: &str, a: &str| {
        a.trim()
            .parse::<SocketAddr>()
            .map_err(|e| format!("{what} address {a:?}: {e}"))
    };
    Ok((parse("gRPC", grpc)?, parse("HTTP", http)?))
}

/// Which way an engine orders the `priority` it schedules waiting
/// requests by (`HEARTH_ENGINE_PRIORITY`).
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EnginePriority {
    /// Not written: the body goes as the client sent it.
    #[default]
    Off,
    /// Lower values first (vLLM's `--scheduling-policy priority`).
    LowerFirst,
    /// Higher values first.
    HigherFirst,
}

/// Where the replicas are learnt from, in the Kubernetes API.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Discovery {
    /// The pods an InferencePool selects, on its target ports.
    Inferencepool,
    /// The pods a label selector picks, on one port.
    Pods,
}

/// Parses `key=value[,key=value...]` (equality only: what an
/// InferencePool's `matchLabels` can say too).
pub fn parse_selector(text: &str) -> Result<BTreeMap<String, String>, String> {
    let mut labels = BTreeMap::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (k, v) = part
            .split_once('=')
            .map(|(k, v)| (k.trim(), v.trim().trim_start_matches('=')))
            .ok_or_else(|| format!("{part:?} is not key=value"))?;
        if k.is_empty() || k.contains('!') {
            return Err(format!("{part:?} is not key=value"));
        }
        labels.insert(k.to_string(), v.to_string());
    }
    if labels.is_empty() {
        return Err("selects nothing: give at least one key=value".into());
    }
    Ok(labels)
}

/// The discovery settings' problems (`HEARTH_DISCOVERY` and the settings
/// of each mode).
fn discovery_problems(s: &Settings) -> Vec<String> {
    let mut problems = Vec::new();
    let pool_only = s.inference_pool.is_some();
    let pods_only = s.discovery_selector.is_some() || s.discovery_port.is_some();
    if !(1..=256).contains(&s.discovery_dp_ranks) {
        problems.push(format!(
            "HEARTH_DISCOVERY_DP_RANKS must be between 1 and 256, got {}",
            s.discovery_dp_ranks
        ));
    }
    match s.discovery {
        None => {
            if pool_only
                || pods_only
                || s.discovery_namespace.is_some()
                || s.kubeconfig.is_some()
                || s.discovery_dp_ranks != 1
                || s.discovery_tls
            {
                problems.push(
                    "HEARTH_INFERENCE_POOL, HEARTH_DISCOVERY_SELECTOR, HEARTH_DISCOVERY_PORT, \
                     HEARTH_DISCOVERY_NAMESPACE, HEARTH_DISCOVERY_DP_RANKS, HEARTH_DISCOVERY_TLS \
                     and HEARTH_KUBECONFIG need HEARTH_DISCOVERY"
                        .into(),
                );
            }
        }
        Some(Discovery::Inferencepool) => {
            if s.inference_pool.as_deref().is_none_or(str::is_empty) {
                problems.push("HEARTH_DISCOVERY=inferencepool needs HEARTH_INFERENCE_POOL".into());
            }
            if pods_only {
                problems.push(
                    "HEARTH_DISCOVERY_SELECTOR and HEARTH_DISCOVERY_PORT are for \
                     HEARTH_DISCOVERY=pods (the pool names its own selector and ports)"
                        .into(),
                );
            }
        }
        Some(Discovery::Pods) => {
            match s.discovery_selector.as_deref().map(parse_selector) {
                None => {
                    problems.push("HEARTH_DISCOVERY=pods needs HEARTH_DISCOVERY_SELECTOR".into())
                }
                Some(Err(e)) => problems.push(format!("HEARTH_DISCOVERY_SELECTOR {e}")),
                Some(Ok(_)) => {}
            }
            if s.discovery_port.is_none_or(|p| p == 0) {
                problems.push("HEARTH_DISCOVERY=pods needs HEARTH_DISCOVERY_PORT (1-65535)".into());
            }
            if pool_only {
                problems.push("HEARTH_INFERENCE_POOL is for HEARTH_DISCOVERY=inferencepool".into());
            }
        }
    }
    problems
}

/// Where the engines cluster's endpoints come from.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoints {
    /// A `load_assignment` in the bootstrap, from the upstreams.
    Static,
    /// The sidecar's endpoint discovery service.
    Eds,
}

/// Where the prompt is fingerprinted.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// In Envoy, by filter-wasm (the product).
    Filter,
    /// In the sidecar, from the body ext_proc sends (BUFFERED).
    Body,
    /// In the sidecar, as an Inference Extension endpoint picker
    /// (FULL_DUPLEX_STREAMED, ORIGINAL_DST).
    Gie,
}

/// A credential: printed as `<redacted>` by `Debug`, so that neither the
/// settings dump nor a log line can show it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// The value itself, for the one header that carries it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

/// Parsing never fails, so that no parser error message can quote the
/// value; [`Secret::check`] (run by [`Settings::validate`]) says what is
/// wrong with it without showing it.
impl FromStr for Secret {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Secret(s.trim().to_string()))
    }
}

impl Secret {
    /// Whether the credential can go into an HTTP header (or a NATS
    /// connect) as is: not empty, printable ASCII without spaces. The
    /// message names the first bad byte's position, never the value.
    pub fn check(&self) -> Result<(), String> {
        if self.0.is_empty() {
            return Err("is empty".into());
        }
        match self.0.bytes().position(|b| !b.is_ascii_graphic()) {
            None => Ok(()),
            Some(at) => Err(format!(
                "has a character an HTTP header cannot carry (a control character, a space \
                 or non-ASCII) at byte {at} of {}; the value is not shown",
                self.0.len()
            )),
        }
    }
}

/// The shortest control token accepted: 32 characters (from a random
/// generator, e.g. `openssl rand -hex 32`, which gives 64).
pub const MIN_CONTROL_TOKEN_CHARS: usize = 32;

/// Reads and checks a control token file. Errors say what is wrong with
/// the token, never what it holds.
pub fn read_control_token(path: &std::path::Path) -> Result<Secret, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read it: {e}"))?;
    let text = String::from_utf8(bytes).map_err(|_| "it is not UTF-8 text".to_string())?;
    let token: Secret = text.parse().unwrap_or_else(|e| match e {});
    token.check().map_err(|e| format!("the token {e}"))?;
    // It is written into Envoy's YAML and the filter's JSON as is.
    if !token
        .expose()
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"-._~+/=".contains(&b))
    {
        return Err("the token may hold only letters, digits and -._~+/=".into());
    }
    let n = token.expose().chars().count();
    if n < MIN_CONTROL_TOKEN_CHARS {
        return Err(format!(
            "the token is {n} characters long; at least {MIN_CONTROL_TOKEN_CHARS} are needed \
             (e.g. `openssl rand -hex 32`)"
        ));
    }
    Ok(token)
}

/// Checks that a TLS file can be read and holds PEM (its contents are
/// parsed when the server starts).
fn check_pem(path: &std::path::Path) -> Result<(), String> {
    let text = std::fs::read(path).map_err(|e| format!("cannot read it: {e}"))?;
    if !text.windows(11).any(|w| w == b"-----BEGIN ") {
        return Err("it holds no PEM block".into());
    }
    Ok(())
}

/// Checks a fleet name: it becomes a NATS subject token.
pub fn check_fleet(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > 64 {
        return Err(format!("must be 1 to 64 characters, got {}", name.len()));
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(format!(
            "{name:?} may hold only letters, digits, '-' and '_'"
        ));
    }
    Ok(())
}

/// Checks `HEARTH_PEERS_URL`: one or more `nats://` or `tls://` addresses.
pub fn check_url(url: &str) -> Result<(), String> {
    for one in url.split(',').map(str::trim) {
        let rest = one
            .strip_prefix("nats://")
            .or_else(|| one.strip_prefix("tls://"))
            .ok_or_else(|| format!("{one:?} must start with nats:// or tls://"))?;
        if rest.is_empty() || rest.contains('/') {
            return Err(format!("{one:?} must be scheme://host:port"));
        }
    }
    Ok(())
}

/// The fewest bytes a fleet key (`HEARTH_PEERS_KEY_FILE`) may hold.
pub const MIN_PEER_KEY_BYTES: usize = 32;

/// The fleet's key for the peer messages' MAC: the key file's bytes,
/// surrounding whitespace trimmed. Printed as `<redacted>` by `Debug`.
#[derive(Clone, PartialEq, Eq)]
pub struct PeerKey(Vec<u8>);

impl PeerKey {
    /// Reads a key file; the error names the file, never its contents.
    pub fn read(path: &std::path::Path) -> Result<PeerKey, String> {
        let bytes = std::fs::read(path)
            .map_err(|e| format!("HEARTH_PEERS_KEY_FILE: cannot read {}: {e}", path.display()))?;
        let key = bytes.trim_ascii();
        if key.len() < MIN_PEER_KEY_BYTES {
            return Err(format!(
                "HEARTH_PEERS_KEY_FILE: {} holds {} bytes (whitespace around them ignored); \
                 the fleet's key needs at least {MIN_PEER_KEY_BYTES} (e.g. `openssl rand -hex 32`)",
                path.display(),
                key.len()
            ));
        }
        Ok(PeerKey(key.to_vec()))
    }

    /// The key itself, for the MAC.
    pub fn expose(&self) -> &[u8] {
        &self.0
    }
}

impl std::fmt::Debug for PeerKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

/// A sidecar's own peer key: an Ed25519 seed. Printed as `<redacted>` by
/// `Debug`.
#[derive(Clone, PartialEq, Eq)]
pub struct PeerSeed([u8; 32]);

impl PeerSeed {
    /// Reads an identity file (64 hex characters, whitespace around them
    /// ignored); the error names the file, never its contents.
    pub fn read(path: &std::path::Path) -> Result<PeerSeed, String> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            format!(
                "HEARTH_PEERS_IDENTITY_FILE: cannot read {}: {e}",
                path.display()
            )
        })?;
        hex32(text.trim()).map(PeerSeed).ok_or_else(|| {
            format!(
                "HEARTH_PEERS_IDENTITY_FILE: {} does not hold 64 hex characters (an Ed25519 seed, e.g. `openssl rand -hex 32`)",
                path.display()
            )
        })
    }

    /// The seed itself, to make the key pair.
    pub fn expose(&self) -> &[u8; 32] {
        &self.0
    }
}

impl std::fmt::Debug for PeerSeed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

/// Most public keys a members file may list.
pub const MAX_PEER_MEMBERS: usize = 4096;

/// Reads a members file: one public key (64 hex characters) a line,
/// blank lines and `#` comments ignored.
fn read_members(path: &std::path::Path) -> Result<Vec<[u8; 32]>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        format!(
            "HEARTH_PEERS_MEMBERS_FILE: cannot read {}: {e}",
            path.display()
        )
    })?;
    let mut keys = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or_default().trim();
        if line.is_empty() {
            continue;
        }
        let key = hex32(line).ok_or_else(|| {
            format!(
                "HEARTH_PEERS_MEMBERS_FILE: {} line {}: not a public key (64 hex characters)",
                path.display(),
                n + 1
            )
        })?;
        keys.push(key);
    }
    if keys.is_empty() || keys.len() > MAX_PEER_MEMBERS {
        return Err(format!(
            "HEARTH_PEERS_MEMBERS_FILE: {} lists {} keys (1 to {MAX_PEER_MEMBERS})",
            path.display(),
            keys.len()
        ));
    }
    Ok(keys)
}

/// 64 hex characters as 32 bytes.
pub fn hex32(text: &str) -> Option<[u8; 32]> {
    let digits = text.as_bytes();
    if digits.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (byte, pair) in out.iter_mut().zip(digits.chunks_exact(2)) {
        let pair = std::str::from_utf8(pair).ok()?;
        *byte = u8::from_str_radix(pair, 16).ok()?;
    }
    Some(out)
}

/// The host each address of a `HEARTH_PEERS_URL` names, and whether the
/// address carries credentials of its own (`nats://user:pass@host:port`).
pub fn url_hosts(url: &str) -> Vec<(String, bool)> {
    url.split(',')
        .map(str::trim)
        .map(|one| {
            let rest = one.split_once("://").map_or(one, |(_, r)| r);
            let (userinfo, host_port) = match rest.rsplit_once('@') {
                Some((u, h)) => (!u.is_empty(), h),
                None => (false, rest),
            };
            let host = match host_port.strip_prefix('[') {
                Some(v6) => v6.split(']').next().unwrap_or(""),
                None => host_port.rsplit_once(':').map_or(host_port, |(h, _)| h),
            };
            (host.to_string(), userinfo)
        })
        .collect()
}

/// `localhost`, or an address of 127.0.0.0/8 or `::1`.
pub fn is_loopback_host(host: &str) -> bool {
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

impl Settings {
    /// The fleet's key, when `HEARTH_PEERS_KEY_FILE` is set.
    pub fn peers_key(&self) -> Result<Option<PeerKey>, String> {
        self.peers_key_file
            .as_deref()
            .map(PeerKey::read)
            .transpose()
    }

    /// The warning for peer credentials that may cross the network in
    /// clear: `nats://` (not `tls://`) to a server off loopback, with a
    /// user, a token or credentials in the URL. The client still upgrades
    /// when the server requires TLS (as the shipped one does); `tls://`
    /// insists on it. `None` when no such entry.
    pub fn peers_credentials_exposure(&self) -> Option<String> {
        let url = self.peers_url.as_deref()?;
        let set = self.peers_user.is_some() || self.peers_token.is_some();
        let exposed: Vec<String> = url
            .split(',')
            .map(str::trim)
            .filter(|one| one.starts_with("nats://"))
            .flat_map(url_hosts)
            .filter(|(host, own)| (set || *own) && !is_loopback_host(host))
            .map(|(host, _)| host)
            .collect();
        let first = exposed.first()?;
        Some(format!(
            "HEARTH_PEERS_URL reaches {first} with nats://: the bus credentials cross the \
             network in clear unless that server requires TLS. Write tls://{first}:PORT to \
             insist on TLS (HEARTH_PEERS_CA_FILE for a private CA)"
        ))
    }

    /// This sidecar's own peer key seed, when
    /// `HEARTH_PEERS_IDENTITY_FILE` is set.
    pub fn peers_identity(&self) -> Result<Option<PeerSeed>, String> {
        self.peers_identity_file
            .as_deref()
            .map(PeerSeed::read)
            .transpose()
    }

    /// The public keys allowed on the bus, when
    /// `HEARTH_PEERS_MEMBERS_FILE` is set.
    pub fn peers_members(&self) -> Result<Option<Vec<[u8; 32]>>, String> {
        self.peers_members_file
            .as_deref()
            .map(read_members)
            .transpose()
    }

    /// What keeps the peer bus from starting: an unreadable or short key
    /// file, identity, members or CA file, and, unless
    /// `HEARTH_PEERS_INSECURE`, a bus without a key or a server off
    /// loopback without credentials. (That the sidecar's own key is among
    /// the members is checked where the key is made,
    /// `feeds::peer_guard::Identity::of`.)
    pub fn peer_bus_problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        if let Err(e) = self.peers_key() {
            problems.push(e);
        }
        if let Err(e) = self.peers_identity() {
            problems.push(e);
        }
        if let Err(e) = self.peers_members() {
            problems.push(e);
        }
        if let Some(path) = &self.peers_ca_file {
            match std::fs::read_to_string(path) {
                Ok(pem) if pem.contains("-----BEGIN CERTIFICATE-----") => {}
                Ok(_) => problems.push(format!(
                    "HEARTH_PEERS_CA_FILE: {} holds no PEM certificate",
                    path.display()
                )),
                Err(e) => problems.push(format!(
                    "HEARTH_PEERS_CA_FILE: cannot read {}: {e}",
                    path.display()
                )),
            }
        }
        let Some(url) = &self.peers_url else {
            return problems;
        };
        if self.peers_insecure {
            return problems;
        }
        if self.peers_key_file.is_none() {
            problems.push(
                "HEARTH_PEERS_KEY_FILE is not set: without the fleet's key anyone who can \
                 publish on the bus could fence replicas and steer traffic; set it to a file \
                 holding the key (at least 32 bytes, the same on every sidecar), or set \
                 HEARTH_PEERS_INSECURE=true to run the bus unauthenticated"
                    .into(),
            );
        }
        let credentials = self.peers_user.is_some() || self.peers_token.is_some();
        for (host, own) in url_hosts(url) {
            if !(credentials || own || is_loopback_host(&host)) {
                problems.push(format!(
                    "HEARTH_PEERS_URL names {host}, not a loopback address, and no credentials \
                     are set: set HEARTH_PEERS_USER and HEARTH_PEERS_PASSWORD, or \
                     HEARTH_PEERS_TOKEN (or HEARTH_PEERS_INSECURE=true to connect without)"
                ));
            }
        }
        problems
    }
}

impl Settings {
    /// The pool's name in the `llm_d_epp_*` pool series.
    pub fn pool_name(&self) -> &str {
        self.pool_name
            .as_deref()
            .or(self.inference_pool.as_deref())
            .filter(|n| !n.is_empty())
            .unwrap_or("hearth")
    }

    /// The engines' bearer key: the setting, or the file's contents.
    pub fn engine_api_key(&self) -> Result<Option<Secret>, String> {
        if let Some(key) = &self.engine_api_key {
            key.check()
                .map_err(|e| format!("HEARTH_ENGINE_API_KEY: the key {e}"))?;
            return Ok(Some(key.clone()));
        }
        let Some(path) = &self.engine_api_key_file else {
            return Ok(None);
        };
        let text = std::fs::read_to_string(path).map_err(|e| {
            format!(
                "HEARTH_ENGINE_API_KEY_FILE: cannot read {}: {e}",
                path.display()
            )
        })?;
        let key: Secret = text.parse().unwrap_or_else(|e| match e {});
        key.check().map_err(|e| {
            format!(
                "HEARTH_ENGINE_API_KEY_FILE: the key in {} {e}",
                path.display()
            )
        })?;
        Ok(Some(key))
    }

    /// The setting that holds the engine key, for messages.
    fn engine_key_setting(&self) -> &'static str {
        if self.engine_api_key_file.is_some() {
            "HEARTH_ENGINE_API_KEY_FILE"
        } else {
            "HEARTH_ENGINE_API_KEY"
        }
    }

    /// The warning for an engine key sent in clear: with a key set, the
    /// engines the sidecar reaches over plain HTTP at an address that is
    /// not loopback (their traffic leaves the host). `None` when the key
    /// stays on TLS or loopback, or there is no key.
    pub fn engine_key_exposure(&self) -> Option<String> {
        if self.engine_api_key.is_none() && self.engine_api_key_file.is_none() {
            return None;
        }
        if self.discovery.is_some() && !self.discovery_tls {
            return Some(format!(
                "{setting} is sent in clear over plain HTTP with every probe and metrics scrape \
                 to every pod discovery finds (any pod the selector or pool matches, on the pod \
                 network): anyone on that path, or any pod given those labels, can read it. \
                 Serve the engines over TLS and set HEARTH_DISCOVERY_TLS=true \
                 (HEARTH_ENGINE_CA_FILE for a private CA)",
                setting = self.engine_key_setting(),
            ));
        }
        let exposed: Vec<String> = self
            .upstreams
            .iter()
            .filter(|u| !u.tls && !u.addr.ip().is_loopback())
            .map(|u| u.addr.to_string())
            .collect();
        let first = exposed.first()?;
        Some(format!(
            "{setting} is sent in clear over plain HTTP with every probe and metrics scrape \
             to {n} engine(s) not on loopback (first: {first}): anyone on that network path \
             can read it. Serve the engines over TLS and list them as https://IP:PORT in \
             HEARTH_UPSTREAMS (HEARTH_ENGINE_CA_FILE for a private CA)",
            setting = self.engine_key_setting(),
            n = exposed.len(),
        ))
    }

    /// The PEM text of `HEARTH_ENGINE_CA_FILE`, when set.
    pub fn engine_ca_pem(&self) -> Result<Option<Vec<u8>>, String> {
        let Some(path) = &self.engine_ca_file else {
            return Ok(None);
        };
        let pem = std::fs::read(path)
            .map_err(|e| format!("HEARTH_ENGINE_CA_FILE: cannot read {}: {e}", path.display()))?;
        if !pem.windows(27).any(|w| w == b"-----BEGIN CERTIFICATE-----") {
            return Err(format!(
                "HEARTH_ENGINE_CA_FILE: {} holds no PEM certificate",
                path.display()
            ));
        }
        Ok(Some(pem))
    }

    /// The control token: `HEARTH_CONTROL_TOKEN_FILE`'s contents, checked
    /// (never echoed in an error).
    pub fn control_token(&self) -> Result<Option<Secret>, String> {
        let Some(path) = &self.control_token_file else {
            return Ok(None);
        };
        read_control_token(path)
            .map(Some)
            .map_err(|e| format!("HEARTH_CONTROL_TOKEN_FILE: {}: {e}", path.display()))
    }

    /// Listeners reachable from off the host with nothing to authenticate
    /// their callers, each as a problem naming the settings that close it
    /// (none with `HEARTH_CONTROL_INSECURE`). The gRPC port is
    /// authenticated by the token or by client certificates; the admin
    /// port by the token.
    pub fn exposed_listeners(&self, has_token: bool) -> Vec<String> {
        if self.control_insecure || has_token {
            return Vec::new();
        }
        let mut problems = Vec::new();
        if !self.listen.ip().is_loopback() && self.grpc_tls_client_ca_file.is_none() {
            problems.push(format!(
                "HEARTH_LISTEN is {}, not a loopback address, and nothing authenticates its \
                 callers: set HEARTH_CONTROL_TOKEN_FILE (or HEARTH_GRPC_TLS_CLIENT_CA_FILE), \
                 or HEARTH_CONTROL_INSECURE=true on a private network you secure otherwise",
                self.listen
            ));
        }
        if !self.admin_listen.ip().is_loopback() {
            problems.push(format!(
                "HEARTH_ADMIN_LISTEN is {}, not a loopback address, and POST /outcome there \
                 can fence replicas: set HEARTH_CONTROL_TOKEN_FILE, or \
                 HEARTH_CONTROL_INSECURE=true on a private network you secure otherwise",
                self.admin_listen
            ));
        }
        problems
    }

    /// The router's parameters (see `hearth_router::RouterParams`).
    pub fn router_params(&self) -> RouterParams {
        RouterParams {
            score: ScoreParams {
                basis: self.affinity_basis,
                cap: self.affinity_cap,
                alpha: self.alpha,
                first_turn_cap: self.first_turn_cap,
            },
            health: HealthParams {
                eject_after: self.eject_after.max(1),
                backoff: seconds(self.eject_backoff_seconds),
                max_backoff: seconds(self.eject_max_backoff_seconds),
                busy_grace: seconds(self.busy_grace_seconds),
                probe_interval: seconds(self.probe_interval_seconds),
                probe_retry: seconds(self.probe_retry_seconds),
                suspect_probe_interval: seconds(self.suspect_probe_seconds),
                stall_after: seconds(self.stall_seconds),
            },
            block_size: self.block_size,
            warmth_blocks: self.warmth_blocks.unwrap_or(DEFAULT_WARMTH_BLOCKS),
            warmth_from_engine: self.warmth_blocks.is_none(),
            load_unit_bytes: self.load_unit_bytes,
            max_inflight: self.max_inflight,
            max_queue: self.max_queue,
            fallbacks: self.fallbacks,
            long_prompt_bytes: self.long_prompt_bytes,
            long_lane: self.long_lane,
            short_output_tokens: self.short_output_tokens,
            engine_stale: seconds(self.engine_metrics_stale_seconds),
            engine_load_weight: self.engine_load_weight,
            resident_window: seconds(self.resident_seconds),
            sequel_horizon: seconds(self.sequel_horizon_seconds),
            resident_load: self.resident_load,
            relative_load_above: self.relative_load_above,
            hotspot_ratio: self.hotspot_ratio,
            cold_read_weight: self.cold_read_weight,
            usage_feedback: self.usage_feedback,
            flow: FlowParams {
                engine_waiting: self.flow_engine_waiting,
                kv_usage: self.flow_kv_usage,
                uncached_bytes: self.flow_uncached_bytes,
                prefill_seconds: self.flow_prefill_seconds,
                affinity_wait: seconds(self.flow_affinity_wait_seconds),
                headroom: seconds(self.flow_headroom_seconds),
                fair_window: seconds(self.flow_fair_slots_seconds),
                lower_prefill_share: self.flow_lower_prefill_share,
                sheddable_waits: self.flow_sheddable_waits,
                engine_tags: self.engine_priority != EnginePriority::Off,
            },
        }
    }

    /// The flow-control queue's bounds.
    pub fn queue_params(&self) -> QueueParams {
        QueueParams {
            ttl: seconds(self.flow_ttl_seconds),
            max_requests: self.flow_max_requests,
            max_bytes: self.flow_max_bytes,
            quantum: self.flow_quantum_bytes,
        }
    }

    /// Checks the settings as a whole; every problem is reported, not just
    /// the first.
    pub fn validate(&self) -> Result<(), Vec<String>> {
        let mut problems = Vec::new();
        let fp = hearth_wire::Params {
            block_size: self.block_size,
            max_prefix_bytes: hearth_wire::DEFAULT_MAX_PREFIX_BYTES.max(self.block_size),
        };
        if let Err(e) = fp.validate() {
            problems.push(format!("HEARTH_BLOCK_SIZE: {e}"));
        }
        if self.warmth_blocks == Some(0) {
            problems.push("HEARTH_WARMTH_BLOCKS must be at least 1".into());
        }
        if !(self.hotspot_ratio.is_finite() && self.hotspot_ratio >= 1.0) {
            problems.push(format!(
                "HEARTH_HOTSPOT_RATIO must be a finite number >= 1, got {}",
                self.hotspot_ratio
            ));
        }
        for (name, v) in [
            ("HEARTH_ALPHA", self.alpha),
            ("HEARTH_RESIDENT_LOAD", self.resident_load),
            ("HEARTH_RELATIVE_LOAD_ABOVE", self.relative_load_above),
            ("HEARTH_COLD_READ_WEIGHT", self.cold_read_weight),
            ("HEARTH_ENGINE_LOAD_WEIGHT", self.engine_load_weight),
            ("HEARTH_FLOW_ENGINE_WAITING", self.flow_engine_waiting),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                problems.push(format!("{name} must be a finite number >= 0, got {v}"));
            }
        }
        for (name, v) in [
            ("HEARTH_ENGINE_METRICS_SECONDS", self.engine_metrics_seconds),
            (
                "HEARTH_ENGINE_METRICS_STALE_SECONDS",
                self.engine_metrics_stale_seconds,
            ),
            ("HEARTH_PROBE_INTERVAL_SECONDS", self.probe_interval_seconds),
            ("HEARTH_PROBE_TIMEOUT_SECONDS", self.probe_timeout_seconds),
            ("HEARTH_PROBE_RETRY_SECONDS", self.probe_retry_seconds),
            ("HEARTH_SUSPECT_PROBE_SECONDS", self.suspect_probe_seconds),
            ("HEARTH_STALL_SECONDS", self.stall_seconds),
            ("HEARTH_EJECT_BACKOFF_SECONDS", self.eject_backoff_seconds),
            (
                "HEARTH_EJECT_MAX_BACKOFF_SECONDS",
                self.eject_max_backoff_seconds,
            ),
            ("HEARTH_BUSY_GRACE_SECONDS", self.busy_grace_seconds),
            ("HEARTH_RESIDENT_SECONDS", self.resident_seconds),
            ("HEARTH_SEQUEL_HORIZON_SECONDS", self.sequel_horizon_seconds),
            ("HEARTH_UPSTREAMS_POLL_SECONDS", self.upstreams_poll_seconds),
            (
                "HEARTH_FIRST_BYTE_TIMEOUT_SECONDS",
                self.first_byte_timeout_seconds,
            ),
            ("HEARTH_PEERS_SYNC_SECONDS", self.peers_sync_seconds),
            (
                "HEARTH_FLOW_AFFINITY_WAIT_SECONDS",
                self.flow_affinity_wait_seconds,
            ),
            ("HEARTH_FLOW_HEADROOM_SECONDS", self.flow_headroom_seconds),
            (
                "HEARTH_FLOW_FAIR_SLOTS_SECONDS",
                self.flow_fair_slots_seconds,
            ),
        ] {
            if !(v.is_finite() && (0.0..=86_400.0).contains(&v)) {
                problems.push(format!(
                    "{name} must be between 0 and 86400 seconds, got {v}"
                ));
            }
        }
        if self.probe_interval_seconds > 0.0 && self.probe_timeout_seconds <= 0.0 {
            problems.push("HEARTH_PROBE_TIMEOUT_SECONDS must be above 0 when probes run".into());
        }
        if let Err(e) = self.engine_api_key() {
            problems.push(e);
        }
        if let Err(e) = self.engine_ca_pem() {
            problems.push(e);
        }
        for (name, secret) in [
            ("HEARTH_PEERS_PASSWORD", &self.peers_password),
            ("HEARTH_PEERS_TOKEN", &self.peers_token),
        ] {
            if let Some(Err(e)) = secret.as_ref().map(Secret::check) {
                problems.push(format!("{name}: the value {e}"));
            }
        }
        if !(self.flow_ttl_seconds.is_finite()
            && (0.0..=MAX_FLOW_TTL_SECONDS).contains(&self.flow_ttl_seconds))
        {
            problems.push(format!(
                "HEARTH_FLOW_TTL_SECONDS must be between 0 and {MAX_FLOW_TTL_SECONDS} (Envoy's \
                 rendered max_message_timeout is 600 s), got {}",
                self.flow_ttl_seconds
            ));
        }
        if !(self.flow_prefill_seconds.is_finite()
            && (0.0..=3_600.0).contains(&self.flow_prefill_seconds))
        {
            problems.push(format!(
                "HEARTH_FLOW_PREFILL_SECONDS must be between 0 and 3600 seconds, got {}",
                self.flow_prefill_seconds
            ));
        }
        let share = self.flow_lower_prefill_share;
        if !(share.is_finite() && share > 0.0 && share <= 1.0) {
            problems.push(format!(
                "HEARTH_FLOW_LOWER_PREFILL_SHARE must be above 0 and at most 1, got {share}"
            ));
        }
        if !(self.flow_kv_usage.is_finite() && (0.0..=1.0).contains(&self.flow_kv_usage)) {
            problems.push(format!(
                "HEARTH_FLOW_KV_USAGE must be between 0 and 1, got {}",
                self.flow_kv_usage
            ));
        }
        if self.flow_max_requests == 0 || self.flow_max_bytes == 0 || self.flow_quantum_bytes == 0 {
            problems.push(
                "HEARTH_FLOW_MAX_REQUESTS, HEARTH_FLOW_MAX_BYTES and HEARTH_FLOW_QUANTUM_BYTES \
                 must be at least 1"
                    .into(),
            );
        }
        if let Some(h) = &self.flow_fairness_header {
            let valid = !h.is_empty()
                && h.bytes().all(|b| {
                    b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_'
                });
            if !valid {
                problems.push(format!(
                    "HEARTH_FLOW_FAIRNESS_HEADER must be a lower-case header name \
                     (letters, digits, '-', '_'), got {h:?}"
                ));
            }
        }
        if self.picker_held_bodies == 0 {
            problems.push("HEARTH_PICKER_HELD_BODIES must be at least 1".into());
        }
        if self.picker_held_bytes < 1 << 20 {
            problems.push(format!(
                "HEARTH_PICKER_HELD_BYTES must be at least 1 MiB (1048576), got {}",
                self.picker_held_bytes
            ));
        }
        if self.journal_file_max_bytes < 1 << 20 {
            problems.push(format!(
                "HEARTH_JOURNAL_FILE_MAX_BYTES must be at least 1 MiB (1048576), got {}",
                self.journal_file_max_bytes
            ));
        }
        let token = self.control_token();
        problems.extend(self.exposed_listeners(matches!(token, Ok(Some(_)))));
        if let Err(e) = token {
            problems.push(e);
        }
        for (name, file) in [
            ("HEARTH_GRPC_TLS_CERT_FILE", &self.grpc_tls_cert_file),
            ("HEARTH_GRPC_TLS_KEY_FILE", &self.grpc_tls_key_file),
            (
                "HEARTH_GRPC_TLS_CLIENT_CA_FILE",
                &self.grpc_tls_client_ca_file,
            ),
        ] {
            if let Some(path) = file {
                if let Err(e) = check_pem(path) {
                    problems.push(format!("{name}: {}: {e}", path.display()));
                }
            }
        }
        for (name, v) in [
            ("HEARTH_GRPC_MAX_CONNECTIONS", self.grpc_max_connections),
            ("HEARTH_ADMIN_MAX_CONNECTIONS", self.admin_max_connections),
        ] {
            if !(1..=1_000_000).contains(&v) {
                problems.push(format!("{name} must be between 1 and 1000000, got {v}"));
            }
        }
        if let Err(e) = check_fleet(&self.fleet) {
            problems.push(format!("HEARTH_FLEET: {e}"));
        }
        if let Some(url) = &self.peers_url {
            if let Err(e) = check_url(url) {
                problems.push(format!("HEARTH_PEERS_URL: {e}"));
            }
        }
        problems.extend(self.peer_bus_problems());
        if !(1..=10_000).contains(&self.peers_flush_ms) {
            problems.push(format!(
                "HEARTH_PEERS_FLUSH_MS must be between 1 and 10000, got {}",
                self.peers_flush_ms
            ));
        }
        if self.eject_after == 0 {
            problems.push("HEARTH_EJECT_AFTER must be at least 1".into());
        }
        if self.load_unit_bytes == 0 {
            problems.push("HEARTH_LOAD_UNIT_BYTES must be at least 1".into());
        }
        problems.extend(discovery_problems(self));
        // A file-based list is read and checked when the sidecar starts;
        // a discovered one may be empty.
        if self.upstreams_file.is_none() && self.discovery.is_none() {
            problems.extend(check_upstreams(&self.upstreams, "HEARTH_UPSTREAMS"));
        }
        if self.listen == self.admin_listen && self.listen.port() != 0 {
            problems.push("HEARTH_LISTEN and HEARTH_ADMIN_LISTEN must differ".into());
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(problems)
        }
    }
}

/// Seconds as a Duration; settings are validated to be finite and >= 0.
pub fn seconds(s: f64) -> Duration {
    Duration::try_from_secs_f64(s).unwrap_or_default()
}

/// The `HEARTH_*` variables the sidecar reads.
pub fn known_env_vars() -> Vec<String> {
    Cli::command()
        .get_arguments()
        .filter_map(|a| a.get_env())
        .map(|e| e.to_string_lossy().into_owned())
        .collect()
}

/// Refuses any `HEARTH_*` variable the project does not know: a typo must
/// not silently leave a setting at its default.
pub fn check_env<I: IntoIterator<Item = String>>(names: I) -> Result<(), String> {
    let known = known_env_vars();
    let mut unknown: Vec<String> = names
        .into_iter()
        .filter(|n| n.starts_with("HEARTH_"))
        .filter(|n| !known.contains(n) && !OTHER_TOOLS_VARS.contains(&n.as_str()))
        .collect();
    if unknown.is_empty() {
        return Ok(());
    }
    unknown.sort();
    let mut valid = known;
    valid.sort();
    Err(format!(
        "unknown environment variable(s) {}; valid HEARTH_* variables: {}",
        unknown.join(", "),
        valid.join(", ")
    ))
}

/// `HEARTH_NAME=VALUE` pairs as the sidecar's flags (`--name=VALUE`), in
/// order, for its command line; an unknown name is refused, with the
/// valid ones.
pub fn setting_args(pairs: &[(String, String)]) -> Result<Vec<String>, Vec<String>> {
    let flags: Vec<(String, String)> = Cli::command()
        .get_arguments()
        .filter_map(|a| {
            Some((
                a.get_env()?.to_str()?.to_string(),
                a.get_long()?.to_string(),
            ))
        })
        .collect();
    let mut problems = Vec::new();
    let mut args = Vec::new();
    for (name, value) in pairs {
        match flags.iter().find(|(env, _)| env == name) {
            Some((_, long)) => args.push(format!("--{long}={value}")),
            None => problems.push(format!("unknown setting {name}")),
        }
    }
    if problems.is_empty() {
        return Ok(args);
    }
    let mut valid: Vec<&str> = flags.iter().map(|(env, _)| env.as_str()).collect();
    valid.sort_unstable();
    problems.push(format!("valid settings: {}", valid.join(", ")));
    Err(problems)
}

/// The sidecar's settings from `HEARTH_NAME=VALUE` pairs, every other
/// setting at its default, parsed and validated as the sidecar parses and
/// validates its own: what the benchmark and the simulator run the router
/// with, so a setting is written once, here, and can be benchmarked the
/// day it exists. The process's environment is not read (a benchmark's
/// settings are the ones its printed command shows); a later pair
/// overrides an earlier one. Without `HEARTH_UPSTREAMS` (or
/// `HEARTH_UPSTREAMS_FILE`) among the pairs, a placeholder list of one
/// loopback replica stands in: the caller brings its own replicas. Every
/// problem is reported: an unknown name (with the valid ones), a value
/// that does not parse, a setting that does not validate.
pub fn settings_from_pairs(pairs: &[(String, String)]) -> Result<Settings, Vec<String>> {
    let cmd = Cli::command()
        .mut_args(|a| a.env(None::<&'static str>))
        .args_override_self(true);
    let mut argv = vec!["hearth-ext-proc".to_string()];
    let lists_upstreams = pairs
        .iter()
        .any(|(k, _)| k == "HEARTH_UPSTREAMS" || k == "HEARTH_UPSTREAMS_FILE");
    if !lists_upstreams {
        argv.push("--upstreams=127.0.0.1:1".into());
    }
    argv.extend(setting_args(pairs)?);
    let matches = cmd.try_get_matches_from(argv).map_err(|e| {
        vec![e
            .render()
            .to_string()
            .lines()
            .next()
            .unwrap_or("a setting does not parse")
            .to_string()]
    })?;
    let settings = <Cli as clap::FromArgMatches>::from_arg_matches(&matches)
        .map_err(|e| vec![e.to_string()])?
        .settings;
    settings.validate()?;
    Ok(settings)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn identity_and_members_files_are_read_and_their_mistakes_named() {
        let dir = std::env::temp_dir().join(format!("hearth-members-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = |name: &str, text: &str| {
            let p = dir.join(name);
            std::fs::write(&p, text).unwrap();
            p
        };
        let a = "ab".repeat(32);
        let seed = PeerSeed::read(&file("seed", &format!("  {a}\n"))).unwrap();
        assert_eq!(seed.expose(), &[0xab; 32]);
        assert_eq!(format!("{seed:?}"), "<redacted>");
        for bad in ["", "abc", &"zz".repeat(32), &"ab".repeat(33)] {
            let e = PeerSeed::read(&file("bad-seed", bad)).unwrap_err();
            assert!(e.contains("does not hold 64 hex characters"), "{e}");
            // The file's contents (a secret) are never in the error.
            assert!(bad.len() < 8 || !e.contains(&bad[..8]), "{e}");
        }
        let members = file(
            "members",
            &format!("# the fleet\n{a}\n\n{}  # b\n", "cd".repeat(32)),
        );
        assert_eq!(read_members(&members).unwrap(), [[0xab; 32], [0xcd; 32]]);
        let e = read_members(&file("bad-members", &format!("{a}\nnot-a-key\n"))).unwrap_err();
        assert!(e.contains("line 2"), "{e}");
        let e = read_members(&file("no-members", "# nobody\n")).unwrap_err();
        assert!(e.contains("lists 0 keys"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn fleet_names_are_subject_tokens() {
        assert!(check_fleet("prod-eu_1").is_ok());
        for bad in ["", "a.b", "a b", "a*", "a>", &"x".repeat(65)] {
            assert!(check_fleet(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn peer_urls_name_nats_or_tls_servers() {
        assert!(check_url("nats://127.0.0.1:4222").is_ok());
        assert!(check_url("tls://nats.example:4222, nats://10.0.0.2:4222").is_ok());
        for bad in ["127.0.0.1:4222", "http://x:1", "nats://", "nats://x:1/path"] {
            assert!(check_url(bad).is_err(), "{bad:?}");
        }
    }

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("hearth-ext-proc").chain(args.iter().copied()))
    }

    #[test]
    fn upstream_specs_parse_with_options() {
        let u: UpstreamSpec = "10.0.0.1:8000;id=gpu-a;model=m1;model=m2".parse().unwrap();
        assert_eq!(u.addr, "10.0.0.1:8000".parse().unwrap());
        assert_eq!(u.id.as_deref(), Some("gpu-a"));
        assert_eq!(u.models, ["m1", "m2"]);
        assert!("engine-1:8000"
            .parse::<UpstreamSpec>()
            .unwrap_err()
            .contains("ip:port"));
        assert!("10.0.0.1:8000;colour=red"
            .parse::<UpstreamSpec>()
            .unwrap_err()
            .contains("colour"));
        assert!("10.0.0.1:8000;id=".parse::<UpstreamSpec>().is_err());
    }

    #[test]
    fn upstream_tags_and_ranks() {
        let u: UpstreamSpec = "10.0.0.1:8000;tag=long;dp=4".parse().unwrap();
        assert!(u.long);
        assert_eq!(u.dp_ranks, 4);
        assert!("10.0.0.1:8000;dp=0".parse::<UpstreamSpec>().is_err());
        assert!("10.0.0.1:8000;tag=fast".parse::<UpstreamSpec>().is_err());
        let cli = parse(&[
            "--upstreams",
            "127.0.0.1:1",
            "--long-lane",
            "avoid-unless-warm",
        ])
        .unwrap();
        assert_eq!(cli.settings.long_lane, LongLane::AvoidUnlessWarm);
    }

    /// Each of `bad` given to `flag` is refused by validation with a
    /// problem that says `message`.
    fn refused_with(flag: &str, bad: &[&str], message: &str) {
        for value in bad {
            let arg = format!("{flag}={value}");
            let s = parse(&["--upstreams", "127.0.0.1:1", &arg])
                .unwrap()
                .settings;
            let problems = s.validate().unwrap_err();
            assert!(
                problems.iter().any(|p| p.contains(message)),
                "{value}: {problems:?}"
            );
        }
    }

    #[test]
    fn fair_slots_seconds_reach_the_flow_params_and_bad_ones_are_named() {
        let s = parse(&["--upstreams", "127.0.0.1:1"]).unwrap().settings;
        assert_eq!(s.router_params().flow.fair_window, Duration::ZERO);
        let s = parse(&[
            "--upstreams",
            "127.0.0.1:1",
            "--flow-fair-slots-seconds",
            "5",
        ])
        .unwrap()
        .settings;
        assert_eq!(s.router_params().flow.fair_window, Duration::from_secs(5));
        refused_with(
            "--flow-fair-slots-seconds",
            &["-1", "NaN", "inf"],
            "HEARTH_FLOW_FAIR_SLOTS_SECONDS must be between 0 and 86400",
        );
    }

    #[test]
    fn relative_load_above_reaches_the_router_params_and_bad_ones_are_named() {
        let s = parse(&["--upstreams", "127.0.0.1:1", "--relative-load-above", "0"])
            .unwrap()
            .settings;
        assert_eq!(s.router_params().relative_load_above, 0.0);
        refused_with(
            "--relative-load-above",
            &["-1", "NaN", "inf"],
            "HEARTH_RELATIVE_LOAD_ABOVE must be a finite number >= 0",
        );
    }

    #[test]
    fn cold_read_weight_reaches_the_router_params_and_bad_ones_are_named() {
        let s = parse(&["--upstreams", "127.0.0.1:1"]).unwrap().settings;
        assert_eq!(s.router_params().cold_read_weight, 1.0);
        let s = parse(&["--upstreams", "127.0.0.1:1", "--cold-read-weight", "0"])
            .unwrap()
            .settings;
        assert_eq!(s.router_params().cold_read_weight, 0.0);
        refused_with(
            "--cold-read-weight",
            &["-1", "NaN", "inf"],
            "HEARTH_COLD_READ_WEIGHT must be a finite number >= 0",
        );
    }

    #[test]
    fn hotspot_ratio_reaches_the_router_params_and_bad_ones_are_named() {
        let s = parse(&["--upstreams", "127.0.0.1:1"]).unwrap().settings;
        assert_eq!(s.router_params().hotspot_ratio, 8.0);
        let s = parse(&["--upstreams", "127.0.0.1:1", "--hotspot-ratio", "2.5"])
            .unwrap()
            .settings;
        assert_eq!(s.router_params().hotspot_ratio, 2.5);
        refused_with(
            "--hotspot-ratio",
            &["0.5", "0", "-1", "NaN", "inf"],
            "HEARTH_HOTSPOT_RATIO must be a finite number >= 1",
        );
    }

    #[test]
    fn headroom_seconds_reach_the_flow_params_and_bad_ones_are_named() {
        let s = parse(&["--upstreams", "127.0.0.1:1"]).unwrap().settings;
        assert_eq!(s.router_params().flow.headroom, Duration::from_secs(30));
        let s = parse(&["--upstreams", "127.0.0.1:1", "--flow-headroom-seconds", "0"])
            .unwrap()
            .settings;
        assert_eq!(s.router_params().flow.headroom, Duration::ZERO);
        refused_with(
            "--flow-headroom-seconds",
            &["-1", "NaN", "inf"],
            "HEARTH_FLOW_HEADROOM_SECONDS must be between 0 and 86400",
        );
    }

    #[test]
    fn the_lower_prefill_share_and_sheddable_waits_reach_the_flow_params() {
        let s = parse(&["--upstreams", "127.0.0.1:1"]).unwrap().settings;
        let flow = s.router_params().flow;
        assert_eq!(flow.lower_prefill_share, 0.1);
        assert!(flow.sheddable_waits);
        let s = parse(&[
            "--upstreams",
            "127.0.0.1:1",
            "--flow-lower-prefill-share",
            "1",
            "--flow-sheddable-waits",
            "false",
        ])
        .unwrap()
        .settings;
        let flow = s.router_params().flow;
        assert_eq!(flow.lower_prefill_share, 1.0);
        assert!(!flow.sheddable_waits);
        refused_with(
            "--flow-lower-prefill-share",
            &["0", "-0.1", "1.5", "NaN"],
            "HEARTH_FLOW_LOWER_PREFILL_SHARE must be above 0 and at most 1",
        );
    }

    #[test]
    fn prefill_seconds_reach_the_flow_params_and_bad_ones_are_named() {
        let s = parse(&[
            "--upstreams",
            "127.0.0.1:1",
            "--flow-prefill-seconds",
            "0.5",
        ])
        .unwrap()
        .settings;
        assert_eq!(s.router_params().flow.prefill_seconds, 0.5);
        assert!(s.validate().is_ok());
        refused_with(
            "--flow-prefill-seconds",
            &["-1", "NaN", "4000"],
            "HEARTH_FLOW_PREFILL_SECONDS must be between 0 and 3600",
        );
    }

    #[test]
    fn the_router_defaults_are_the_settings_defaults() {
        let s = parse(&["--upstreams", "127.0.0.1:1"]).unwrap().settings;
        assert_eq!(s.router_params(), RouterParams::default());
    }

    #[test]
    fn the_pool_is_named_by_the_setting_else_the_followed_pool_else_hearth() {
        let mut s = settings_from_pairs(&[]).unwrap();
        assert_eq!(s.pool_name(), "hearth");
        s.inference_pool = Some("chat".into());
        assert_eq!(s.pool_name(), "chat");
        s.pool_name = Some("p".into());
        assert_eq!(s.pool_name(), "p");
    }

    #[test]
    fn settings_from_pairs_are_the_parsers_and_its_defaults() {
        let pairs = |p: &[(&str, &str)]| -> Vec<(String, String)> {
            p.iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        let none = settings_from_pairs(&[]).unwrap();
        assert_eq!(none.router_params(), RouterParams::default());
        let s = settings_from_pairs(&pairs(&[
            ("HEARTH_ALPHA", "2.5"),
            ("HEARTH_LONG_LANE", "avoid"),
            ("HEARTH_USAGE_FEEDBACK", "false"),
            ("HEARTH_ALPHA", "3"),
        ]))
        .unwrap();
        let p = s.router_params();
        assert_eq!(p.score.alpha, 3.0, "the later pair wins");
        assert_eq!(p.long_lane, LongLane::Avoid);
        assert!(!p.usage_feedback);
        assert_eq!(p.score.cap, RouterParams::default().score.cap);
        // Unknown names, bad values and invalid settings are refused.
        let e = settings_from_pairs(&pairs(&[("HEARTH_ALPA", "2")])).unwrap_err();
        assert!(e[0].contains("HEARTH_ALPA"), "{e:?}");
        assert!(e[1].contains("HEARTH_ALPHA"), "names the valid ones: {e:?}");
        let e = settings_from_pairs(&pairs(&[("HEARTH_ALPHA", "much")])).unwrap_err();
        assert!(e[0].contains("much"), "{e:?}");
        let e = settings_from_pairs(&pairs(&[("HEARTH_ALPHA", "-1")])).unwrap_err();
        assert!(e[0].contains("HEARTH_ALPHA"), "{e:?}");
    }

    #[test]
    fn defaults_and_comma_separated_upstreams() {
        let cli = parse(&["--upstreams", "127.0.0.1:1,127.0.0.1:2"]).unwrap();
        let s = cli.settings;
        assert_eq!(s.upstreams.len(), 2);
        assert_eq!(s.block_size, 2048);
        assert_eq!(s.affinity_basis, AffinityBasis::Relative);
        assert!(s.validate().is_ok());
    }

    #[test]
    fn by_default_both_listeners_are_loopback_and_capped() {
        let s = parse(&["--upstreams", "127.0.0.1:1"]).unwrap().settings;
        assert_eq!(s.listen, "127.0.0.1:50051".parse().unwrap());
        assert_eq!(s.admin_listen, "127.0.0.1:9190".parse().unwrap());
        assert!(s.exposed_listeners(false).is_empty());
        assert_eq!(s.grpc_max_connections, 1024);
        assert_eq!(s.admin_max_connections, 256);
    }

    #[test]
    fn the_engine_key_is_redacted_wherever_the_settings_are_printed() {
        let key = "team-key-0123456789";
        let s = parse(&["--upstreams", "127.0.0.1:1", "--engine-api-key", key])
            .unwrap()
            .settings;
        assert!(s.validate().is_ok());
        assert_eq!(s.engine_api_key().unwrap().unwrap().expose(), key);
        for printed in [format!("{s:?}"), format!("{s:#?}")] {
            assert!(!printed.contains(key), "{printed}");
            assert!(printed.contains("<redacted>"), "{printed}");
        }
    }

    #[test]
    fn validation_reports_every_problem() {
        let cli = parse(&[
            "--upstreams",
            "127.0.0.1:1,127.0.0.1:1",
            "--warmth-blocks",
            "0",
            "--alpha=-1",
            "--block-size",
            "3",
        ])
        .unwrap();
        let problems = cli.settings.validate().unwrap_err();
        assert_eq!(problems.len(), 4, "{problems:?}");
    }

    #[test]
    fn unknown_hearth_variables_are_refused_with_the_valid_list() {
        assert!(check_env(["HEARTH_UPSTREAMS".to_string(), "PATH".to_string()]).is_ok());
        assert!(check_env(["HEARTH_ENVOY".to_string()]).is_ok());
        // The benchmark's peer routers, named where the sidecar it starts
        // inherits the environment.
        assert!(check_env(["HEARTH_SMG".to_string(), "HEARTH_VLLM_ROUTER".to_string()]).is_ok());
        let err = check_env(["HEARTH_AFINITY_BASIS".to_string()]).unwrap_err();
        assert!(err.contains("HEARTH_AFINITY_BASIS"));
        assert!(
            err.contains("HEARTH_AFFINITY_BASIS"),
            "names the valid ones: {err}"
        );
    }

    fn token_file(name: &str, text: &str) -> PathBuf {
        let path = std::env::temp_dir().join(format!("hearth-token-{}-{name}", std::process::id()));
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn a_control_token_is_long_header_safe_and_never_echoed() {
        let good = token_file("good", "  0123456789abcdef0123456789abcdef-._~+/=\n");
        assert_eq!(
            read_control_token(&good).unwrap().expose(),
            "0123456789abcdef0123456789abcdef-._~+/="
        );
        for (name, text) in [
            ("short", "tooShortSecret42"),
            ("empty", " \n"),
            ("quote", "0123456789abcdef0123456789abcdef\"x"),
            ("space", "0123456789abcdef 0123456789abcdef0"),
        ] {
            let path = token_file(name, text);
            let err = read_control_token(&path).unwrap_err();
            let secret = text.trim();
            assert!(
                secret.is_empty() || !err.contains(secret),
                "{name}: echoed: {err}"
            );
            let _ = std::fs::remove_file(path);
        }
        assert!(read_control_token(Path::new("/nonexistent/token"))
            .unwrap_err()
            .contains("cannot read"));
        let _ = std::fs::remove_file(good);
    }

    #[test]
    fn a_listener_off_loopback_needs_the_token_or_the_insecure_setting() {
        let open = parse(&[
            "--upstreams=127.0.0.1:1",
            "--listen=0.0.0.0:50051",
            "--admin-listen=10.0.0.1:9190",
        ])
        .unwrap()
        .settings;
        let problems = open.validate().unwrap_err();
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert!(problems
            .iter()
            .all(|p| p.contains("HEARTH_CONTROL_TOKEN_FILE")
                && p.contains("HEARTH_CONTROL_INSECURE")));
        // Loopback, as by default: nothing to authenticate.
        let local = parse(&["--upstreams=127.0.0.1:1", "--listen=[::1]:0"])
            .unwrap()
            .settings;
        assert!(local.validate().is_ok());
        // The token closes both; the insecure setting silences both.
        let token = token_file("listeners", &"k".repeat(40));
        let closed = parse(&[
            "--upstreams=127.0.0.1:1",
            "--listen=0.0.0.0:50051",
            "--admin-listen=0.0.0.0:9190",
            &format!("--control-token-file={}", token.display()),
        ])
        .unwrap()
        .settings;
        assert!(closed.validate().is_ok(), "{:?}", closed.validate());
        let insecure = parse(&[
            "--upstreams=127.0.0.1:1",
            "--listen=0.0.0.0:50051",
            "--admin-listen=0.0.0.0:9190",
            "--control-insecure=true",
        ])
        .unwrap()
        .settings;
        assert!(insecure.validate().is_ok());
        // Client certificates authenticate the gRPC port, not the admin one.
        assert_eq!(
            Settings {
                grpc_tls_client_ca_file: Some(token.clone()),
                ..open.clone()
            }
            .exposed_listeners(false)
            .len(),
            1
        );
        let _ = std::fs::remove_file(token);
    }

    #[test]
    fn a_malformed_key_is_reported_without_showing_it() {
        let secret = "s3cr3t-\u{7}-value";
        let cli = parse(&["--upstreams", "127.0.0.1:1", "--engine-api-key", secret]);
        // The parser takes it (a parser error would quote it) ...
        let problems = cli.unwrap().settings.validate().unwrap_err();
        // ... and the check names the setting and the place, not the value.
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(
            problems[0].starts_with("HEARTH_ENGINE_API_KEY: "),
            "{}",
            problems[0]
        );
        assert!(problems[0].contains("byte 7"), "{}", problems[0]);
        assert!(!problems[0].contains("s3cr3t"), "{}", problems[0]);
        // The same from a file (a trailing newline is fine, one inside is not).
        let dir = std::env::temp_dir().join(format!("hearth-key-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("key");
        std::fs::write(&file, "s3cr3t\nsecond-line\n").unwrap();
        let path = file.to_str().unwrap();
        let s = parse(&["--upstreams", "127.0.0.1:1", "--engine-api-key-file", path])
            .unwrap()
            .settings;
        let e = s.engine_api_key().unwrap_err();
        assert!(e.starts_with("HEARTH_ENGINE_API_KEY_FILE: "), "{e}");
        assert!(!e.contains("s3cr3t") && !e.contains("second"), "{e}");
        std::fs::write(&file, "good-key\n").unwrap();
        assert_eq!(s.engine_api_key().unwrap().unwrap().expose(), "good-key");
        std::fs::remove_dir_all(&dir).unwrap();
        // Peer credentials get the same check.
        let s = parse(&["--upstreams", "127.0.0.1:1", "--peers-token", "a b"])
            .unwrap()
            .settings;
        let problems = s.validate().unwrap_err();
        assert!(
            problems[0].starts_with("HEARTH_PEERS_TOKEN: "),
            "{problems:?}"
        );
        assert!(format!("{:?}", s.peers_token).contains("redacted"));
    }

    #[test]
    fn peer_credentials_over_plain_nats_beyond_loopback_are_warned_about() {
        let settings = |args: &[&str]| parse(args).unwrap().settings;
        let base = ["--upstreams", "127.0.0.1:8000", "--peers-url"];
        let with = |url: &str, more: &[&'static str]| {
            let mut a: Vec<&str> = base.to_vec();
            a.push(url);
            a.extend(more);
            settings(&a).peers_credentials_exposure()
        };
        let w = with("nats://10.0.0.5:4222", &["--peers-token", "t"]).unwrap();
        assert!(w.contains("10.0.0.5") && w.contains("tls://"), "{w}");
        assert!(with("nats://u:p@10.0.0.5:4222", &[]).is_some());
        // TLS, loopback, or nothing to expose: no warning.
        assert_eq!(with("tls://10.0.0.5:4222", &["--peers-token", "t"]), None);
        assert_eq!(with("nats://127.0.0.1:4222", &["--peers-token", "t"]), None);
        assert_eq!(with("nats://10.0.0.5:4222", &[]), None);
    }

    #[test]
    fn a_key_over_plain_http_beyond_loopback_is_warned_about() {
        let settings = |args: &[&str]| parse(args).unwrap().settings;
        // No key: nothing to expose.
        let s = settings(&["--upstreams", "10.0.0.1:8000"]);
        assert_eq!(s.engine_key_exposure(), None);
        // A key to loopback or TLS engines stays off the network in clear.
        let s = settings(&[
            "--upstreams",
            "127.0.0.1:8000,https://10.0.0.1:8000,[::1]:8000",
            "--engine-api-key",
            "k",
        ]);
        assert_eq!(s.engine_key_exposure(), None);
        // Plain HTTP to another host: one warning naming the setting and
        // the fix.
        let s = settings(&[
            "--upstreams",
            "127.0.0.1:8000,10.0.0.2:8000,http://10.0.0.3:8000",
            "--engine-api-key",
            "k",
        ]);
        let w = s.engine_key_exposure().unwrap();
        assert!(
            w.starts_with("HEARTH_ENGINE_API_KEY is sent in clear"),
            "{w}"
        );
        assert!(
            w.contains("2 engine(s)") && w.contains("10.0.0.2:8000"),
            "{w}"
        );
        assert!(w.contains("https://IP:PORT"), "{w}");
        assert!(!w.contains(" k "), "{w}");
        let s = settings(&[
            "--upstreams",
            "10.0.0.2:8000",
            "--engine-api-key-file",
            "/run/secrets/key",
        ]);
        assert!(s
            .engine_key_exposure()
            .unwrap()
            .starts_with("HEARTH_ENGINE_API_KEY_FILE"));
        // Discovered engines are pod addresses: in clear unless reached
        // over TLS.
        let pods = [
            "--discovery",
            "pods",
            "--discovery-selector",
            "app=engine",
            "--discovery-port",
            "8000",
            "--engine-api-key",
            "k",
        ];
        let w = settings(&pods).engine_key_exposure().unwrap();
        assert!(w.contains("every pod discovery finds") && w.contains("HEARTH_DISCOVERY_TLS=true"));
        assert!(!w.contains("  "), "one space between words: {w}");
        let tls: Vec<&str> = pods
            .iter()
            .copied()
            .chain(["--discovery-tls", "true"])
            .collect();
        assert_eq!(settings(&tls).engine_key_exposure(), None);
    }

    #[test]
    fn upstreams_written_https_speak_tls_and_configured_models_are_capped() {
        let u: UpstreamSpec = "https://10.0.0.1:8000;id=a".parse().unwrap();
        assert!(u.tls);
        assert_eq!(u.addr, "10.0.0.1:8000".parse().unwrap());
        let plain: UpstreamSpec = "http://10.0.0.1:8000".parse().unwrap();
        assert!(!plain.tls);
        assert!(!"10.0.0.1:8000".parse::<UpstreamSpec>().unwrap().tls);
        for bad in [
            "https://engine:8000",
            "https://10.0.0.1:8000/v1",
            "ftp://10.0.0.1:1",
        ] {
            assert!(bad.parse::<UpstreamSpec>().is_err(), "{bad}");
        }
        let max = hearth_wire::names::MAX_MODEL_BYTES;
        let fits = format!("10.0.0.1:8000;model={}", "m".repeat(max));
        assert!(fits.parse::<UpstreamSpec>().is_ok());
        let long = format!("10.0.0.1:8000;model={}", "m".repeat(max + 1));
        assert!(long.parse::<UpstreamSpec>().unwrap_err().contains("longer"));
    }

    #[test]
    fn every_setting_has_an_env_twin() {
        let cmd = Cli::command();
        for arg in cmd.get_arguments() {
            let id = arg.get_id().as_str();
            if id == "help" || id == "version" {
                continue;
            }
            assert!(arg.get_env().is_some(), "--{id} has no HEARTH_* variable");
        }
    }
}

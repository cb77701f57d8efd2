//! `hearth-bench real` (also `hearth-bench compare`): routing policies side
//! by side in front of real OpenAI-compatible engines (llama.cpp's
//! `llama-server`, vLLM, SGLang, ...) given by address: an operator's own
//! fleet, or engines started on loopback.
//!
//! One run drives the same seeded workload through, in turn:
//!
//! - **ring_hash**: plain Envoy hashing a per-conversation header
//!   (`x-session-id`), the affinity a plain mesh offers;
//! - **least_request**: plain Envoy, no affinity;
//! - **hearth**: Envoy with filter-wasm, ext_proc and override_host, and the
//!   `hearth-ext-proc` process at its defaults;
//! - the peer routers as released ([`crate::peers`]): smg `cache_aware`,
//!   vllm-router `cache_aware` and `consistent_hash` (on `x-session-id`),
//!   each at its defaults, in front of the same engines.
//!
//! The workload is multi-turn conversations (agents re-sending their whole
//! history) or llm-d's shared-prefix shape (groups of users whose requests
//! are the group's long system prompt and a fresh question).
//!
//! Which engine served a turn: every Envoy configuration adds the same
//! response header naming the upstream it picked (`%UPSTREAM_HOST%`); smg
//! names its worker (`x-smg-routed-worker-id`); otherwise the answer's
//! `model`, where each engine serves a model of its own name (llama.cpp
//! answers with its alias whatever was asked), else it stays unknown
//! (vllm-router in front of engines of one model name: its stay rate and
//! per-engine split are not measured). Cache hits come from the engines'
//! own answers. Each policy's prompts carry their own salt, so one
//! policy's turns never warm another's.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use futures::StreamExt;
use hearth_ext_proc::envoy::render::{render_plain, Gateway};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::conversation::{cached_and_prompt_tokens, filler, Conversation};
use crate::kv_forward::KvForward;
use crate::peers::{Peer, PeerConfig, PeerKind, SMG_WORKER_HEADER};
use crate::report::percentile;
use crate::rng::Rng;
use crate::settings::{parse_setting, shown_setting, SidecarSettings};
use crate::stack::Stack;
use crate::vllm::metric_label;
use hearth_ext_proc::feeds::kv_events::stated_feed;

/// The response header every configuration adds: the upstream that served.
pub const UPSTREAM_HEADER: &str = "x-bench-upstream";
/// The per-conversation request header ring_hash hashes on.
pub const SESSION_HEADER: &str = "x-session-id";

/// Flags of `hearth-bench real`.
#[derive(Debug, Clone, Args)]
pub struct RealArgs {
    /// The engines, `ip:port,ip:port,...` (OpenAI-compatible HTTP).
    #[arg(long, value_delimiter = ',', required = true)]
    pub engines: Vec<SocketAddr>,
    /// Sent to the engines through the gateway as `Authorization: Bearer`
    /// (the printed command line hides it).
    #[arg(long)]
    pub api_key: Option<String>,
    /// Model name to ask for (default: the first one the first engine's
    /// `/v1/models` lists that every engine lists).
    #[arg(long)]
    pub model: Option<String>,
    /// What the clients send: multi-turn conversations, or llm-d's
    /// shared-prefix shape (each of `--conversations` users asks
    /// `--turns` fresh questions of `--user-bytes` after its group's
    /// `--shared-bytes` system prompt, with no history).
    #[arg(long, value_enum, default_value_t = Workload::Conversations)]
    pub workload: Workload,
    /// Shared-prefix: users per group (groups share a system prompt).
    #[arg(long, default_value_t = 3)]
    pub users_per_group: usize,
    /// Conversations (shared-prefix: users) running at once.
    #[arg(long, default_value_t = 4)]
    pub conversations: usize,
    /// Turns per conversation.
    #[arg(long, default_value_t = 5)]
    pub turns: usize,
    /// Bytes of the system prompt every conversation of a run shares (the
    /// agent harness), at the start of the prompt. (At the defaults, with
    /// 5 turns, prompts grow from about 680 to 1,450 tokens on
    /// SmolLM2's tokenizer, a size a CPU engine prefills in minutes.)
    #[arg(long, default_value_t = 1600)]
    pub shared_bytes: usize,
    /// Bytes of each conversation's own system prompt, after the shared part.
    #[arg(long, default_value_t = 800)]
    pub system_bytes: usize,
    /// Bytes of the new user message each turn adds (a tool result).
    #[arg(long, default_value_t = 800)]
    pub user_bytes: usize,
    /// Mean pause between a conversation's turns, in milliseconds (drawn
    /// from 0.5x-1.5x; the first turn starts within one pause of the start).
    #[arg(long, default_value_t = 500)]
    pub think_ms: u64,
    /// `max_tokens` of every request.
    #[arg(long, default_value_t = 16)]
    pub max_tokens: u32,
    /// Routing policies, run one after the other in this order (reversed
    /// on even seeds). A peer router that is not installed is skipped,
    /// with the reason.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [Policy::RingHash, Policy::LeastRequest, Policy::Hearth])]
    pub policies: Vec<Policy>,
    /// How long a peer router may take to start and list every engine.
    #[arg(long, default_value_t = 60)]
    pub peer_deadline_s: u64,
    /// Run each other policy beside a Hearth run of its own (the first
    /// Hearth policy of `--policies`), the pair's order alternating, and
    /// print each policy's figures as ratios to its Hearth run's: where
    /// the machine drifts between runs by as much as the routers differ
    /// (a saturated fleet sharing cores with the gateway), only runs side
    /// by side compare.
    #[arg(long)]
    pub paired: bool,
    /// Who sends the requests: this command's own client, or llm-d's
    /// harness `inference-perf` (its shared-prefix data: groups of
    /// `--users-per-group` users out of `--conversations`, lengths in
    /// tokens, at each of `--rates`).
    #[arg(long, value_enum, default_value_t = Driver::HearthBench)]
    pub driver: Driver,
    /// inference-perf: requests a second, one stage each.
    #[arg(long, value_delimiter = ',', default_values_t = [0.5, 1.0])]
    pub rates: Vec<f64>,
    /// inference-perf: seconds of each stage.
    #[arg(long, default_value_t = 30)]
    pub stage_seconds: u64,
    /// inference-perf: tokens of each group's system prompt and of each
    /// question (output: `--max-tokens`).
    #[arg(long, default_value_t = 1500)]
    pub system_tokens: usize,
    #[arg(long, default_value_t = 300)]
    pub question_tokens: usize,
    /// inference-perf: the tokenizer folder lengths are counted with
    /// (default: the model folder of the vLLM install, SmolLM2's).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Before each policy, empty every engine's prefix cache (`POST
    /// /reset_prefix_cache`: vLLM with `VLLM_SERVER_DEV_MODE=1`, as
    /// `hearth-bench vllm` starts it), so every policy starts on cold,
    /// empty caches, and engines that publish KV events say so
    /// (`AllBlocksCleared`): a sidecar that follows them then knows each
    /// cache exactly from the start of its run.
    #[arg(long)]
    pub reset_caches: bool,
    /// inference-perf: keep each run's config, log and report (every
    /// request's timings too) in `DIR/N-LABEL/`, and for a Hearth run the
    /// sidecar's decision journal (`decisions.json`, every decision with
    /// its wait in the queue), to look at one request at a time.
    #[arg(long, value_name = "DIR")]
    pub keep: Option<PathBuf>,
    /// Deadline of each request (the whole streamed answer), in seconds.
    #[arg(long, default_value_t = 300)]
    pub timeout: u64,
    /// Seeds the workload's shape (pauses, start times) and text.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Mixed into every prompt so a re-run on engines that still hold an
    /// earlier run's prompts starts cold (default: from the clock; printed,
    /// pass it to replay the exact bytes).
    #[arg(long)]
    pub salt: Option<u64>,
    /// Sidecar settings for the hearth run (`--set HEARTH_NAME=VALUE`,
    /// also spelled `--hearth-setting`); without any, the sidecar runs at
    /// its defaults.
    #[command(flatten)]
    pub sidecar: SidecarSettings,
    /// Also write the settings, the rows, every turn and the sidecar's
    /// decisions and final state as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// A routing configuration: plain Envoy's (`ring_hash` on the session,
/// `least_request`), Hearth's, or a peer router as released (smg,
/// vllm-router), the same set `hearth-bench live` runs.
pub use crate::live::LivePolicy as Policy;

/// Who sends the requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Driver {
    /// This command's own client (per-turn records, stays, per engine).
    HearthBench,
    /// llm-d's `inference-perf` (its report's throughput, TTFT and cached
    /// share).
    InferencePerf,
}

/// What the clients send.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Workload {
    /// Multi-turn conversations: each turn re-sends the whole history and
    /// adds a tool result (a coding agent).
    Conversations,
    /// llm-d's shared-prefix benchmark shape: groups of users sharing a
    /// long system prompt, each request that prompt and a fresh question.
    SharedPrefix,
}

// ---------------------------------------------------------------------------
// The workload: pure, seeded.

/// The workload's shape, independent of the policy.
#[derive(Clone, Debug, Serialize)]
pub struct Shape {
    pub workload: Workload,
    pub users_per_group: usize,
    pub conversations: usize,
    pub turns: usize,
    pub shared_bytes: usize,
    pub system_bytes: usize,
    pub user_bytes: usize,
    pub think_ms: u64,
    pub max_tokens: u32,
    pub seed: u64,
}

impl Shape {
    pub(crate) fn of(args: &RealArgs) -> Shape {
        Shape {
            workload: args.workload,
            users_per_group: args.users_per_group.max(1),
            conversations: args.conversations,
            turns: args.turns,
            shared_bytes: args.shared_bytes,
            system_bytes: args.system_bytes,
            user_bytes: args.user_bytes,
            think_ms: args.think_ms,
            max_tokens: args.max_tokens,
            seed: args.seed,
        }
    }
}

/// One conversation of a policy's run, ready to play.
#[derive(Clone, Debug)]
pub struct Planned {
    pub index: usize,
    /// The value of `x-session-id`.
    pub session: String,
    /// When its first turn starts, from the run's start.
    pub start: Duration,
    /// The pause after each turn but the last.
    pub thinks: Vec<Duration>,
    pub conversation: Conversation,
    /// More request headers its every turn sends (a tenant's fairness id,
    /// an objective; none in `real`'s own runs).
    pub headers: Vec<(String, String)>,
}

/// The salt of `policy`'s prompts in a run.
pub fn policy_salt(seed: u64, run_salt: u64, policy: Policy) -> u64 {
    Rng::derive(seed ^ run_salt.rotate_left(17), policy.key()).next_u64()
}

/// The conversations of one policy's run. Start times and pauses depend
/// on the seed only (every policy gets the same timing); the text also on
/// `salt`. Shared-prefix: conversation `i` is a user of group
/// `i / users_per_group`, whose system prompt is the group's alone.
pub fn plan(shape: &Shape, model: &str, salt: u64) -> Vec<Planned> {
    let shared = format!(
        "Harness {salt:016x}. You are a coding agent; follow the repository's rules.\n{}",
        filler(salt, shape.shared_bytes)
    );
    let think = shape.think_ms as f64 / 1000.0;
    (0..shape.conversations)
        .map(|i| {
            let mut timing = Rng::derive(shape.seed, 0x7157 + i as u64);
            let start = Duration::from_secs_f64(think * timing.f64());
            let thinks = (1..shape.turns)
                .map(|_| Duration::from_secs_f64(think * (0.5 + timing.f64())))
                .collect();
            // Small enough that the conversation's own seed arithmetic
            // (x 7919) cannot overflow.
            let own = Rng::derive(salt, 1 + i as u64).next_u64() >> 24;
            let system = match shape.workload {
                Workload::Conversations => format!(
                    "{shared}\n\nProject {own}: this conversation's own instructions.\n{}",
                    filler(own ^ 0x5EED, shape.system_bytes)
                ),
                Workload::SharedPrefix => {
                    let group = (i / shape.users_per_group) as u64;
                    format!(
                        "Group {group} of {salt:016x}: the application's instructions and documents.\n{}",
                        filler(Rng::derive(salt, 0x6000 + group).next_u64(), shape.shared_bytes)
                    )
                }
            };
            Planned {
                index: i,
                session: format!("conversation-{i}"),
                start,
                thinks,
                conversation: Conversation::new(model, &system, false, own),
                headers: Vec::new(),
            }
        })
        .collect()
}

/// Adds the next user message to `c` and returns the turn's request body:
/// streamed, with usage in the stream, greedy sampling.
pub fn turn_body(c: &mut Conversation, user_bytes: usize, max_tokens: u32) -> Value {
    let mut body = c.next_turn(user_bytes, true);
    body["max_tokens"] = json!(max_tokens);
    body["temperature"] = json!(0);
    body["stream_options"] = json!({"include_usage": true});
    body
}

// ---------------------------------------------------------------------------
// Envoy configurations: the project's generators, plus the header that
// names the upstream (and the hash policy for ring_hash).

/// Adds `response_headers_to_add: x-bench-upstream: %UPSTREAM_HOST%` to the
/// one route of a rendered bootstrap.
pub fn with_upstream_header(yaml: &str) -> anyhow::Result<String> {
    let mut out = String::with_capacity(yaml.len() + 256);
    let mut found = 0;
    for line in yaml.lines() {
        out.push_str(line);
        out.push('\n');
        if line.trim() == r#"- match: { prefix: "/" }"# {
            found += 1;
            let indent = " ".repeat(line.len() - line.trim_start().len() + 2);
            out.push_str(&format!(
                "{indent}response_headers_to_add:\n{indent}- header: {{ key: {UPSTREAM_HEADER}, value: \"%UPSTREAM_HOST%\" }}\n{indent}  append_action: OVERWRITE_IF_EXISTS_OR_ADD\n"
            ));
        }
    }
    if found != 1 {
        bail!("expected one catch-all route in the rendered config, found {found}");
    }
    Ok(out)
}

/// Plain Envoy ([`render_plain`]) with `RING_HASH` on `x-session-id`
/// instead of `LEAST_REQUEST`.
pub fn ring_hash(yaml: &str) -> anyhow::Result<String> {
    const LB: &str = "    lb_policy: LEAST_REQUEST\n";
    const ROUTE: &str = "route: { cluster: engines, timeout: 0s, idle_timeout: 600s }";
    if yaml.matches(LB).count() != 1 || yaml.matches(ROUTE).count() != 1 {
        bail!("the plain config no longer has the shape the ring_hash variant edits");
    }
    Ok(yaml
        .replace(LB, "    lb_policy: RING_HASH\n")
        .replace(
            ROUTE,
            &format!(
                "route: {{ cluster: engines, timeout: 0s, idle_timeout: 600s, hash_policy: [ {{ header: {{ header_name: {SESSION_HEADER} }} }} ] }}"
            ),
        ))
}

/// The bootstrap of a plain-Envoy policy in front of `engines`.
pub fn plain_config(policy: Policy, engines: &[SocketAddr]) -> anyhow::Result<String> {
    let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
    let yaml = render_plain(&Gateway::local(
        loopback,
        loopback,
        loopback,
        engines.to_vec(),
        PathBuf::new(),
    ));
    let yaml = match policy {
        Policy::RingHash => ring_hash(&yaml)?,
        Policy::LeastRequest => yaml,
        other => bail!("{} is not a plain-Envoy policy", other.name()),
    };
    with_upstream_header(&yaml)
}

// ---------------------------------------------------------------------------
// Reading a streamed answer.

/// Reads an OpenAI chat completion stream (server-sent events) as it
/// arrives: the first token, the text, and the engine's prompt and cached
/// token counts.
#[derive(Debug, Default)]
pub struct StreamReader {
    pending: Vec<u8>,
    /// The assistant's visible text so far.
    pub text: String,
    /// A content or reasoning token has arrived.
    pub generated: bool,
    /// From `usage` (`prompt_tokens_details.cached_tokens`, `prompt_tokens`).
    usage: Option<(u64, u64)>,
    /// `usage.prompt_tokens` of an answer without the cached detail.
    prompt_only: Option<u64>,
    /// From llama.cpp's `timings` (`cache_n`, `prompt_n`): cached and
    /// processed prompt tokens.
    timings: Option<(u64, u64)>,
    /// An `error` object came in the stream.
    pub error: Option<String>,
    pub done: bool,
    /// The answer's `model` (llama.cpp: its alias, whatever was asked).
    pub model: Option<String>,
    /// `usage.completion_tokens`.
    pub completion_tokens: Option<u64>,
}

impl StreamReader {
    /// Feeds received bytes; true when they carried the first token.
    pub fn feed(&mut self, bytes: &[u8]) -> bool {
        self.pending.extend_from_slice(bytes);
        let before = self.generated;
        while let Some(end) = self.pending.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = self.pending.drain(..=end).collect();
            let line = String::from_utf8_lossy(&line);
            if let Some(data) = line.trim_end().strip_prefix("data:") {
                self.event(data.trim());
            }
        }
        !before && self.generated
    }

    fn event(&mut self, data: &str) {
        if data == "[DONE]" {
            self.done = true;
            return;
        }
        let Ok(v) = serde_json::from_str::<Value>(data) else {
            return;
        };
        if v["error"].is_object() {
            self.error = Some(v["error"]["message"].as_str().unwrap_or("error").into());
        }
        if self.model.is_none() {
            self.model = v["model"].as_str().map(str::to_string);
        }
        if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
            self.completion_tokens = Some(n);
        }
        let delta = &v["choices"][0]["delta"];
        let token = |k: &str| delta[k].as_str().filter(|s| !s.is_empty());
        if let Some(t) = token("content") {
            self.text.push_str(t);
            self.generated = true;
        }
        if token("reasoning_content").is_some() || token("reasoning").is_some() {
            self.generated = true;
        }
        if v["usage"]["prompt_tokens"].is_u64() {
            if v["usage"]["prompt_tokens_details"]["cached_tokens"].is_u64() {
                self.usage = Some(cached_and_prompt_tokens(&v));
            } else {
                self.prompt_only = v["usage"]["prompt_tokens"].as_u64();
            }
        }
        let t = &v["timings"];
        if let (Some(cache), Some(prompt)) = (t["cache_n"].as_u64(), t["prompt_n"].as_u64()) {
            self.timings = Some((cache, prompt));
        }
    }

    /// `(cached, prompt)` tokens: the OpenAI usage field when the engine
    /// sent it, else llama.cpp's timings (cached + processed = prompt),
    /// else unknown.
    pub fn cached_and_prompt(&self) -> Option<(u64, u64)> {
        self.usage.or_else(|| {
            self.timings
                .map(|(cache, processed)| (cache, cache + processed))
        })
    }

    /// Prompt tokens, even when the cached count is unknown.
    pub fn prompt_tokens(&self) -> Option<u64> {
        self.cached_and_prompt()
            .map(|(_, p)| p)
            .or(self.prompt_only)
    }
}

// ---------------------------------------------------------------------------
// Records and their summary: pure.

/// One turn as the client saw it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TurnRecord {
    pub conversation: usize,
    /// 1-based.
    pub turn: usize,
    /// Index in `--engines` of the upstream that served (from the header).
    pub engine: Option<usize>,
    /// HTTP status (None: no response).
    pub status: Option<u16>,
    /// Send to the first content or reasoning token.
    pub ttft_s: Option<f64>,
    pub e2e_s: f64,
    pub prompt_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    /// Tokens generated (the answer's `usage.completion_tokens`).
    #[serde(default)]
    pub output_tokens: Option<u64>,
    /// Anything that made the turn fail (status, transport, stream error).
    pub error: Option<String>,
}

impl TurnRecord {
    pub fn ok(&self) -> bool {
        self.error.is_none()
    }
}

/// One policy's row.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Summary {
    pub policy: String,
    pub wall_s: f64,
    pub requests: usize,
    pub ok: usize,
    /// Answered turns a minute of the run's wall time.
    pub turns_per_min: f64,
    /// Tokens generated over the answered turns, and per second of wall.
    pub output_tokens: u64,
    pub output_tok_per_s: f64,
    /// Mean prompt tokens of the answered turns.
    pub mean_prompt_tokens: f64,
    /// Cached share of prompt tokens on turns after the first.
    pub cached_later: Option<f64>,
    /// The same on first turns (the shared harness prefix).
    pub cached_first: Option<f64>,
    /// Prompt tokens the engines computed (not from cache), all turns.
    pub computed_tokens: u64,
    pub ttft_p50_s: f64,
    pub ttft_p90_s: f64,
    pub ttft_p99_s: f64,
    /// The same on turns after the first: what routing can change (a first
    /// turn finds only the shared harness wherever it goes).
    pub ttft_later_p50_s: f64,
    pub ttft_later_p90_s: f64,
    /// Share of turns after the first served by the engine that served the
    /// conversation's previous answered turn.
    pub stay_rate: Option<f64>,
    pub status_5xx: usize,
    pub status_429: usize,
    /// Other failures (4xx, transport, timeouts, stream errors).
    pub other_failures: usize,
    /// Answered turns per engine, in `--engines` order.
    pub per_engine: Vec<usize>,
    /// The sidecar's active probes during the run (hearth only).
    pub probes: Option<u64>,
    /// Prompt and cached tokens the sidecar counted from the engines'
    /// answers (`/metrics`, hearth only), against the turns' own.
    pub sidecar_usage: Option<(u64, u64)>,
    /// The sidecar's `hearth_prediction_error`: answers compared, and the
    /// mean `|predicted - served cached tokens| / prompt tokens`, with the
    /// cached tokens predicted and served over those answers (hearth only).
    pub prediction_error: Option<PredictionScore>,
    /// Prompt and cached tokens of the answered turns, from their usage.
    pub answered_usage: (u64, u64),
    /// CPU seconds the router's processes spent during the run (Envoy and
    /// the sidecar, or the peer router and its children).
    pub gateway_cpu_s: Option<f64>,
}

/// Summarises one policy's records.
pub fn summarize(policy: &str, records: &[TurnRecord], engines: usize, wall_s: f64) -> Summary {
    let ok: Vec<&TurnRecord> = records.iter().filter(|r| r.ok()).collect();
    let cached_share = |first: bool| {
        let (cached, prompt) = ok
            .iter()
            .filter(|r| (r.turn == 1) == first)
            .filter_map(|r| Some((r.cached_tokens?, r.prompt_tokens?)))
            .fold((0u64, 0u64), |(c, p), (rc, rp)| (c + rc, p + rp));
        (prompt > 0).then(|| cached as f64 / prompt as f64)
    };
    let prompts: Vec<u64> = ok.iter().filter_map(|r| r.prompt_tokens).collect();
    let computed = ok
        .iter()
        .filter_map(|r| Some(r.prompt_tokens?.saturating_sub(r.cached_tokens?)))
        .sum();
    let mut ttft: Vec<f64> = ok.iter().filter_map(|r| r.ttft_s).collect();
    ttft.sort_by(f64::total_cmp);
    let mut ttft_later: Vec<f64> = ok
        .iter()
        .filter(|r| r.turn > 1)
        .filter_map(|r| r.ttft_s)
        .collect();
    ttft_later.sort_by(f64::total_cmp);

    // Stays: walk each conversation in turn order.
    let mut by_turn: Vec<&TurnRecord> = ok.to_vec();
    by_turn.sort_by_key(|r| (r.conversation, r.turn));
    let (mut stays, mut moves) = (0usize, 0usize);
    let mut last: Option<(usize, usize)> = None;
    for r in &by_turn {
        let Some(engine) = r.engine else { continue };
        if let Some((conversation, previous)) = last {
            if conversation == r.conversation && r.turn > 1 {
                if previous == engine {
                    stays += 1;
                } else {
                    moves += 1;
                }
            }
        }
        last = Some((r.conversation, engine));
    }
    let mut per_engine = vec![0; engines];
    for r in &ok {
        if let Some(e) = r.engine.and_then(|e| per_engine.get_mut(e)) {
            *e += 1;
        }
    }
    let failed =
        |f: &dyn Fn(Option<u16>) -> bool| records.iter().filter(|r| !r.ok() && f(r.status)).count();
    let output_tokens: u64 = ok.iter().filter_map(|r| r.output_tokens).sum();
    let per_s = |n: f64| if wall_s > 0.0 { n / wall_s } else { 0.0 };
    Summary {
        policy: policy.to_string(),
        wall_s,
        requests: records.len(),
        ok: ok.len(),
        turns_per_min: 60.0 * per_s(ok.len() as f64),
        output_tokens,
        output_tok_per_s: per_s(output_tokens as f64),
        mean_prompt_tokens: if prompts.is_empty() {
            0.0
        } else {
            prompts.iter().sum::<u64>() as f64 / prompts.len() as f64
        },
        cached_later: cached_share(false),
        cached_first: cached_share(true),
        computed_tokens: computed,
        ttft_p50_s: percentile(&ttft, 0.5),
        ttft_p90_s: percentile(&ttft, 0.9),
        ttft_p99_s: percentile(&ttft, 0.99),
        ttft_later_p50_s: percentile(&ttft_later, 0.5),
        ttft_later_p90_s: percentile(&ttft_later, 0.9),
        stay_rate: (stays + moves > 0).then(|| stays as f64 / (stays + moves) as f64),
        status_5xx: failed(&|s| s.is_some_and(|s| (500..600).contains(&s))),
        status_429: failed(&|s| s == Some(429)),
        other_failures: failed(&|s| s.is_none_or(|s| s != 429 && !(500..600).contains(&s))),
        per_engine,
        probes: None,
        sidecar_usage: None,
        prediction_error: None,
        answered_usage: ok
            .iter()
            .filter_map(|r| Some((r.prompt_tokens?, r.cached_tokens?)))
            .fold((0, 0), |(p, c), (rp, rc)| (p + rp, c + rc)),
        gateway_cpu_s: None,
    }
}

fn pct(v: Option<f64>) -> String {
    v.map_or("-".into(), |x| format!("{:.1}%", x * 100.0))
}

/// Seconds, or `-` when there was nothing to measure.
fn secs(v: f64) -> String {
    if v.is_finite() {
        format!("{v:.2}")
    } else {
        "-".into()
    }
}

/// The rows as a Markdown table.
pub fn table(rows: &[Summary]) -> String {
    let mut out = String::from(
        "| policy | wall s | turns ok | turns/min | out tok/s | prompt tok/turn | cached, turns 2+ | cached, turn 1 | computed tok | TTFT p50 s | TTFT p90 s | TTFT p99 s | TTFT p50 / p90 s, turns 2+ | stay | 5xx | 429 | other fail | per engine | gateway CPU s |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|\n",
    );
    for r in rows {
        out.push_str(&format!(
            "| {} | {:.1} | {}/{} | {:.1} | {:.1} | {:.0} | {} | {} | {} | {} | {} | {} | {} / {} | {} | {} | {} | {} | {} | {} |\n",
            r.policy,
            r.wall_s,
            r.ok,
            r.requests,
            r.turns_per_min,
            r.output_tok_per_s,
            r.mean_prompt_tokens,
            pct(r.cached_later),
            pct(r.cached_first),
            r.computed_tokens,
            secs(r.ttft_p50_s),
            secs(r.ttft_p90_s),
            secs(r.ttft_p99_s),
            secs(r.ttft_later_p50_s),
            secs(r.ttft_later_p90_s),
            pct(r.stay_rate),
            r.status_5xx,
            r.status_429,
            r.other_failures,
            if r.per_engine.iter().sum::<usize>() == 0 {
                "-".to_string()
            } else {
                r.per_engine
                    .iter()
                    .map(usize::to_string)
                    .collect::<Vec<_>>()
                    .join(" / ")
            },
            r.gateway_cpu_s.map_or("-".into(), |c| format!("{c:.1}")),
        ));
    }
    out
}

// ---------------------------------------------------------------------------
// Driving it.

/// What every conversation task of a run shares.
struct Client {
    http: reqwest::Client,
    url: String,
    api_key: Option<String>,
    engines: Vec<SocketAddr>,
    /// Each engine's own model name, when they all differ: the answer's
    /// `model` then names the engine that served it.
    engine_models: Option<Vec<String>>,
    shape: Shape,
}

impl Client {
    fn authorized(&self, req: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        with_key(req, self.api_key.as_deref())
    }

    /// Sends one turn; returns its record and the visible answer.
    async fn turn(&self, p: &Planned, turn: usize, body: &Value) -> (TurnRecord, String) {
        let mut record = TurnRecord {
            conversation: p.index,
            turn,
            engine: None,
            status: None,
            ttft_s: None,
            e2e_s: 0.0,
            prompt_tokens: None,
            cached_tokens: None,
            output_tokens: None,
            error: None,
        };
        let sent = Instant::now();
        let mut req = self
            .http
            .post(&self.url)
            .header(SESSION_HEADER, &p.session)
            .json(body);
        for (name, value) in &p.headers {
            req = req.header(name, value);
        }
        let resp = match self.authorized(req).send().await {
            Ok(r) => r,
            Err(e) => {
                record.e2e_s = sent.elapsed().as_secs_f64();
                record.error = Some(format!("request: {e}"));
                return (record, String::new());
            }
        };
        record.status = Some(resp.status().as_u16());
        // Envoy's upstream header, else smg's worker (a URL).
        let named = |header: &str| {
            let text = resp.headers().get(header)?.to_str().ok()?;
            let addr = text
                .trim_start_matches("http://")
                .trim_start_matches("https://")
                .trim_end_matches('/')
                .parse::<SocketAddr>()
                .ok()?;
            self.engines.iter().position(|e| *e == addr)
        };
        record.engine = named(UPSTREAM_HEADER).or_else(|| named(SMG_WORKER_HEADER));
        if !resp.status().is_success() {
            let status = resp.status();
            let text = resp.text().await.unwrap_or_default();
            record.e2e_s = sent.elapsed().as_secs_f64();
            record.error = Some(format!(
                "HTTP {status}: {}",
                text.chars().take(200).collect::<String>()
            ));
            return (record, String::new());
        }
        let mut reader = StreamReader::default();
        let mut chunks = resp.bytes_stream();
        while let Some(chunk) = chunks.next().await {
            match chunk {
                Ok(bytes) => {
                    if reader.feed(&bytes) {
                        record.ttft_s = Some(sent.elapsed().as_secs_f64());
                    }
                }
                Err(e) => {
                    record.error = Some(format!("stream: {e}"));
                    break;
                }
            }
        }
        record.e2e_s = sent.elapsed().as_secs_f64();
        if let Some(e) = &reader.error {
            record
                .error
                .get_or_insert_with(|| format!("in stream: {e}"));
        }
        record.prompt_tokens = reader.prompt_tokens();
        record.cached_tokens = reader.cached_and_prompt().map(|(c, _)| c);
        record.output_tokens = reader.completion_tokens;
        if record.engine.is_none() {
            // The engine's own name in its answer.
            record.engine = self
                .engine_models
                .as_ref()
                .zip(reader.model.as_deref())
                .and_then(|(models, m)| models.iter().position(|e| e == m));
        }
        (record, reader.text)
    }

    /// Plays one conversation from the run's `start`.
    async fn conversation(self: Arc<Self>, mut p: Planned, start: Instant) -> Vec<TurnRecord> {
        tokio::time::sleep_until((start + p.start).into()).await;
        let mut records = Vec::with_capacity(self.shape.turns);
        for turn in 1..=self.shape.turns {
            if self.shape.workload == Workload::SharedPrefix {
                // A fresh question after the group's prompt, no history.
                p.conversation.messages.truncate(1);
            }
            let body = turn_body(
                &mut p.conversation,
                self.shape.user_bytes,
                self.shape.max_tokens,
            );
            let (record, answer) = self.turn(&p, turn, &body).await;
            match (&record.error, record.status) {
                // A 429 is the gateway's answer to load (flow control
                // refusing a sheddable turn): counted in the table, not
                // worth a line each.
                (Some(e), Some(429)) => tracing::debug!(conversation = p.index, turn, "{e}"),
                (Some(e), _) => tracing::warn!(conversation = p.index, turn, "{e}"),
                (None, _) => {}
            }
            records.push(record);
            // A failed turn still leaves the agent's next message after an
            // (empty) answer, so every policy sends the same shape.
            p.conversation.push_assistant(&answer);
            if let Some(pause) = p.thinks.get(turn - 1) {
                tokio::time::sleep(*pause).await;
            }
        }
        records
    }
}

/// `req` with the engines' key, when there is one.
fn with_key(req: reqwest::RequestBuilder, api_key: Option<&str>) -> reqwest::RequestBuilder {
    match api_key {
        Some(key) => req.bearer_auth(key),
        None => req,
    }
}

/// Every model name `engine` lists at `/v1/models`, in its order.
async fn models(engine: SocketAddr, api_key: Option<&str>) -> anyhow::Result<Vec<String>> {
    let req = reqwest::Client::new()
        .get(format!("http://{engine}/v1/models"))
        .timeout(Duration::from_secs(10));
    let v: Value = with_key(req, api_key)
        .send()
        .await
        .and_then(reqwest::Response::error_for_status)
        .with_context(|| format!("GET http://{engine}/v1/models"))?
        .json()
        .await?;
    Ok(v["data"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| m["id"].as_str().map(str::to_string))
        .collect())
}

/// The model the first engine serves.
async fn first_model(engine: SocketAddr, api_key: Option<&str>) -> anyhow::Result<String> {
    models(engine, api_key)
        .await?
        .into_iter()
        .next()
        .with_context(|| format!("http://{engine}/v1/models lists no model; pass --model"))
}

/// Why smg cannot serve `model` from engines whose first listed models
/// are `firsts` (None: it can). smg registers each worker under the first
/// model its engine lists, and answers 404 for any other name.
pub fn smg_cannot_serve(firsts: &[String], model: &str) -> Option<String> {
    let other: Vec<&str> = firsts
        .iter()
        .filter(|m| *m != model)
        .map(String::as_str)
        .collect();
    (!other.is_empty()).then(|| {
        format!(
            "smg registers each engine under the first model it lists ({}), not {model}; \
             start the engines with that name first (hearth-bench vllm --shared-name-first)",
            other.join(", ")
        )
    })
}

/// [`smg_cannot_serve`] for the engines at `engines`, asked over HTTP
/// (an engine that does not answer: that reason).
pub(crate) async fn smg_cannot_serve_at(
    engines: &[SocketAddr],
    api_key: Option<&str>,
    model: &str,
) -> Option<String> {
    match first_models(engines, api_key).await {
        Ok(firsts) => smg_cannot_serve(&firsts, model),
        Err(e) => Some(format!("{e:#}")),
    }
}

/// Each engine's first model name, asked of all at once.
async fn first_models(
    engines: &[SocketAddr],
    api_key: Option<&str>,
) -> anyhow::Result<Vec<String>> {
    futures::future::join_all(engines.iter().map(|e| first_model(*e, api_key)))
        .await
        .into_iter()
        .collect()
}

/// The first name of `lists[0]` that every list holds: the model every
/// engine answers to, in the first engine's order.
pub fn common_model(lists: &[Vec<String>]) -> Option<String> {
    let (first, rest) = lists.split_first()?;
    first
        .iter()
        .find(|m| rest.iter().all(|l| l.contains(m)))
        .cloned()
}

/// The model to ask for when none is given: the first name the first
/// engine lists that every engine serves (engines that each list a name
/// of their own first and a shared one after it, as `hearth-bench vllm`
/// starts them, are asked for the shared one).
pub(crate) async fn shared_model(
    engines: &[SocketAddr],
    api_key: Option<&str>,
) -> anyhow::Result<String> {
    let lists = futures::future::try_join_all(engines.iter().map(|e| models(*e, api_key))).await?;
    common_model(&lists).with_context(|| {
        format!("the engines list no model name in common ({lists:?}); pass --model")
    })
}

/// One policy's run: its row, every turn, and (hearth) the sidecar's
/// decisions, for the JSON.
#[derive(Debug, Serialize)]
pub struct PolicyRun {
    #[serde(flatten)]
    pub summary: Summary,
    pub turns: Vec<TurnRecord>,
    /// The sidecar's decision journal (`GET /debug/decisions`), newest first.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decisions: Option<Value>,
    /// The sidecar's `GET /state` at the end (replica health, load).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sidecar_state: Option<Value>,
    /// A peer router's command line, as started (its key hidden).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peer_command: Option<String>,
    /// The sidecar's `/metrics` page at the end (hearth only; not in the
    /// JSON: its figures that matter are in the summary).
    #[serde(skip)]
    pub sidecar_metrics: Option<String>,
}

/// The sidecar's latest `limit` decisions.
async fn decisions(admin: SocketAddr, limit: usize) -> Option<Value> {
    let v: Value = reqwest::get(format!("http://{admin}/debug/decisions?limit={limit}"))
        .await
        .ok()?
        .json()
        .await
        .ok()?;
    Some(v["decisions"].clone())
}

/// The sidecar's `/metrics` page.
async fn metrics(admin: SocketAddr) -> Option<String> {
    reqwest::get(format!("http://{admin}/metrics"))
        .await
        .ok()?
        .text()
        .await
        .ok()
}

/// The sum of the samples of every series starting with `prefix`.
fn sum_of(text: &str, prefix: &str) -> u64 {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// The sums of the sidecar's per-replica prompt and cached token counters.
fn usage_counted(text: &str) -> (u64, u64) {
    (
        sum_of(text, "hearth_replica_prompt_tokens_total{"),
        sum_of(text, "hearth_replica_cached_tokens_total{"),
    )
}

/// How the sidecar's predictions of cached tokens compared with what the
/// engines served, over the answers it compared.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct PredictionScore {
    pub answers: u64,
    /// Mean `|predicted - served| / prompt tokens`.
    pub mean_error: f64,
    /// Cached tokens predicted and served, summed: which way it errs.
    pub predicted_tokens: u64,
    pub served_tokens: u64,
}

/// The sidecar's `hearth_prediction_error` histogram (its count, and its
/// sum over its count) and its predicted and compared cached-token
/// counters.
fn prediction_error(text: &str) -> Option<PredictionScore> {
    let value = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
            .and_then(|v| v.parse::<f64>().ok())
    };
    let count = value("hearth_prediction_error_count")?;
    let sum = value("hearth_prediction_error_sum")?;
    Some(PredictionScore {
        answers: count as u64,
        mean_error: sum / count.max(1.0),
        predicted_tokens: sum_of(text, "hearth_replica_predicted_cached_tokens_total{"),
        served_tokens: sum_of(text, "hearth_replica_compared_cached_tokens_total{"),
    })
}

/// The sum of the sidecar's `hearth_probes_total` counters.
fn probes_sent(text: &str) -> u64 {
    sum_of(text, "hearth_probes_total")
}

/// The command line as given, with credentials hidden.
fn command_line() -> String {
    redacted(std::env::args())
}

/// `args` joined, with the `--api-key` value and credential settings hidden.
fn redacted(args: impl IntoIterator<Item = String>) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut hide_next = false;
    for a in args {
        let shown = if std::mem::take(&mut hide_next) {
            "***".to_string()
        } else if a == "--api-key" {
            hide_next = true;
            a
        } else if a.starts_with("--api-key=") {
            "--api-key=***".into()
        } else if let Some((flag, setting)) = ["--set=", "--hearth-setting="]
            .into_iter()
            .find_map(|f| Some((f, a.strip_prefix(f)?)))
        {
            match parse_setting(setting) {
                Ok(kv) => format!("{flag}{}", shown_setting(&kv)),
                Err(_) => a,
            }
        } else {
            match parse_setting(&a) {
                Ok(kv) => shown_setting(&kv),
                Err(_) => a,
            }
        };
        out.push(shown);
    }
    out.join(" ")
}

/// Each engine's first model name, when every engine answered and no two
/// share one (else None: answers cannot name their engine).
async fn engine_models(engines: &[SocketAddr], api_key: Option<&str>) -> Option<Vec<String>> {
    let names = first_models(engines, api_key).await.ok()?;
    let mut distinct = names.clone();
    distinct.sort();
    distinct.dedup();
    (distinct.len() == names.len()).then_some(names)
}

/// What serves a policy's run: Envoy (plain or with Hearth), or a peer
/// router (with the forwarders of the engines' KV events it reads, for
/// `kv_aware`).
enum Serving {
    Envoy(Box<Stack>),
    Peer(Box<Peer>, Vec<KvForward>),
}

/// `--reset-caches`: empties every engine's prefix cache.
async fn reset_caches(args: &RealArgs) -> anyhow::Result<()> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()?;
    for engine in &args.engines {
        let req = client.post(format!("http://{engine}/reset_prefix_cache"));
        let status = with_key(req, args.api_key.as_deref())
            .send()
            .await
            .with_context(|| format!("POST http://{engine}/reset_prefix_cache"))?
            .status();
        anyhow::ensure!(
            status.is_success(),
            "engine {engine}: POST /reset_prefix_cache answered {status} (vLLM serves it with \
             VLLM_SERVER_DEV_MODE=1, as hearth-bench vllm starts it)"
        );
    }
    Ok(())
}

/// The tokenizer folder: `--tokenizer`, else the vLLM install's model
/// folder (SmolLM2's tokenizer, which `hearth-bench vllm` serves).
fn tokenizer_dir(args: &RealArgs) -> anyhow::Result<PathBuf> {
    match &args.tokenizer {
        Some(t) => Ok(t.clone()),
        None => Ok(crate::vllm::VllmInstall::find()
            .context("--tokenizer not given and no vLLM install to take one from")?
            .model),
    }
}

/// vllm-router's `kv_aware` in front of `args.engines`: each engine's KV
/// event publisher, as it states it (`GET /kv_event_sources`), forwarded
/// to a loopback TCP port (`--kv-event-source`); the engines' block size
/// from their metrics (`vllm:cache_config_info`); `model`, the name
/// requests ask for, as the workers' shared model identity
/// (`--kv-event-model`). Over HTTP, kv_aware learns a request's token ids
/// from the worker's render endpoint (`POST /v1/chat/completions/render`,
/// served by vLLM with `--enable-scale-out`): an engine without it is
/// refused here, since kv_aware would otherwise route on load alone.
pub async fn kv_aware(
    engines: &[SocketAddr],
    api_key: Option<&str>,
    mut config: PeerConfig,
    model: &str,
) -> anyhow::Result<(PeerConfig, Vec<KvForward>)> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()?;
    let get = |engine: SocketAddr, path: &str| {
        with_key(client.get(format!("http://{engine}{path}")), api_key)
    };
    let mut forwards = Vec::new();
    let mut block_size = None;
    for &engine in engines {
        let answer: Value = get(engine, "/kv_event_sources")
            .send()
            .await
            .and_then(reqwest::Response::error_for_status)
            .with_context(|| format!("GET http://{engine}/kv_event_sources"))?
            .json()
            .await?;
        // vllm-router 0.1.17 has no topic setting: it keeps only messages
        // of the empty topic and drops the rest without a word.
        let topic = answer["0"]["topic"].as_str().unwrap_or_default();
        anyhow::ensure!(
            topic.is_empty(),
            "engine {engine} publishes its KV events under topic {topic:?}; vllm-router \
             reads only the empty topic (vLLM's default)"
        );
        let feed = stated_feed(&answer, engine, 0).map_err(|e| {
            anyhow::anyhow!(
                "engine {engine}: {e} (vllm_router_kv_aware needs vLLM publishing its KV events, \
                 e.g. hearth-bench vllm --kv-events)"
            )
        })?;
        let render = client
            .post(format!("http://{engine}/v1/chat/completions/render"))
            .json(&json!({"model": model, "messages": [{"role": "user", "content": "ping"}]}));
        let status = with_key(render, api_key)
            .send()
            .await
            .with_context(|| format!("POST http://{engine}/v1/chat/completions/render"))?
            .status();
        anyhow::ensure!(
            status.is_success(),
            "engine {engine}: POST /v1/chat/completions/render answered {status}; \
             vllm_router_kv_aware needs it to tokenize (vLLM --enable-scale-out, as \
             hearth-bench vllm --kv-events starts it)"
        );
        let forward = KvForward::start(feed.endpoint).await?;
        config.extra.extend([
            "--kv-event-source".to_string(),
            format!("http://{engine}={}", forward.endpoint),
        ]);
        let metrics = get(engine, "/metrics").send().await?.text().await?;
        let block: u32 = metric_label(&metrics, "vllm:cache_config_info", "block_size")
            .and_then(|b| b.parse().ok())
            .with_context(|| format!("engine {engine}: no block_size in vllm:cache_config_info"))?;
        anyhow::ensure!(
            block_size.is_none_or(|b| b == block),
            "the engines' KV blocks differ in size ({block_size:?} and {block} tokens)"
        );
        block_size = Some(block);
        forwards.push(forward);
    }
    if let Some(block) = block_size {
        config
            .extra
            .extend(["--kv-event-block-size".to_string(), block.to_string()]);
    }
    config
        .extra
        .extend(["--kv-event-model".to_string(), model.to_string()]);
    Ok((config, forwards))
}

impl Serving {
    async fn start(args: &RealArgs, policy: Policy, model: &str) -> anyhow::Result<Serving> {
        if args.reset_caches {
            reset_caches(args).await?;
        }
        let engines: Vec<String> = args.engines.iter().map(SocketAddr::to_string).collect();
        if let Some(mut config) = policy.peer() {
            config.api_key = args.api_key.clone();
            let mut forwards = Vec::new();
            if policy == Policy::VllmRouterKvAware {
                (config, forwards) =
                    kv_aware(&args.engines, args.api_key.as_deref(), config, model).await?;
            }
            let peer = Peer::start(
                &config,
                &args.engines,
                Duration::from_secs(args.peer_deadline_s),
            )
            .await?;
            return Ok(Serving::Peer(Box::new(peer), forwards));
        }
        let stack = match policy {
            // `hearth_kv_events`: the sidecar asks each engine where it
            // publishes its KV events.
            Policy::Hearth | Policy::HearthKvEvents => Stack::running(match policy {
                Policy::HearthKvEvents => engines
                    .iter()
                    .map(|e| format!("{e};kv_events=auto"))
                    .collect(),
                _ => engines,
            })
            .settings(args.sidecar.set.iter().cloned())
            // The sidecar's probes and metric scrapes need the
            // engines' key too, as an operator would configure it.
            .settings(
                args.api_key
                    .iter()
                    .map(|key| ("HEARTH_ENGINE_API_KEY", key.clone())),
            )
            .edit_envoy(|yaml| with_upstream_header(&yaml)),
            _ => Stack::running(engines)
                .front(crate::stack::Front::Plain)
                .edit_envoy(move |yaml| match policy {
                    Policy::RingHash => with_upstream_header(&ring_hash(&yaml)?),
                    _ => with_upstream_header(&yaml),
                }),
        }
        .start()
        .await?;
        Ok(Serving::Envoy(Box::new(stack)))
    }

    fn url(&self) -> String {
        match self {
            Serving::Envoy(stack) => stack.url(),
            Serving::Peer(peer, _) => peer.url(),
        }
    }

    /// CPU seconds each of the router's processes has spent so far, with
    /// every process under it: Envoy and the sidecar, or the peer router
    /// (the KV event forwarders of `kv_aware` run inside this program and
    /// are not counted).
    fn cpu_seconds(&self, ticks: f64) -> Vec<(&'static str, f64)> {
        let processes: Vec<(&'static str, u32)> = match self {
            Serving::Envoy(stack) => stack.processes().to_vec(),
            Serving::Peer(peer, _) => vec![("router", peer.pid())],
        }
        .into_iter()
        .filter_map(|(name, pid)| Some((name, pid?)))
        .collect();
        let pids: Vec<u32> = processes.iter().map(|p| p.1).collect();
        let seconds = crate::cpu::tree_seconds(&pids, ticks);
        processes.into_iter().map(|p| p.0).zip(seconds).collect()
    }
}

/// The CPU each router process spent between two readings, printed on
/// standard error, and their sum.
fn cpu_spent(policy: Policy, before: &[(&str, f64)], after: &[(&str, f64)]) -> f64 {
    let spent: Vec<(&str, f64)> = after
        .iter()
        .map(|&(name, a)| {
            let b = before.iter().find(|(n, _)| *n == name).map_or(0.0, |p| p.1);
            (name, (a - b).max(0.0))
        })
        .collect();
    eprintln!(
        "hearth-bench real: {} CPU during the run: {}",
        policy.name(),
        spent
            .iter()
            .map(|(name, s)| format!("{name} {s:.2} s"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    spent.iter().map(|p| p.1).sum()
}

/// One policy's run: its gateway up, the workload through it, gateway down.
pub async fn run_policy(
    args: &RealArgs,
    policy: Policy,
    model: &str,
    run_salt: u64,
) -> anyhow::Result<PolicyRun> {
    let salt = policy_salt(args.seed, run_salt, policy);
    let planned = plan(&Shape::of(args), model, salt);
    run_planned(args, policy, model, planned).await
}

/// [`run_policy`] with the conversations given (`hearth-bench tenants`
/// on real engines plays a subset, each with its tenant's headers).
pub async fn run_planned(
    args: &RealArgs,
    policy: Policy,
    model: &str,
    planned: Vec<Planned>,
) -> anyhow::Result<PolicyRun> {
    let shape = Shape::of(args);
    let front = Serving::start(args, policy, model).await?;
    let admin = match (&front, policy) {
        (Serving::Envoy(stack), p) if p.is_hearth() => Some(stack.admin()),
        _ => None,
    };
    let probes_before = match admin {
        Some(admin) => metrics(admin).await.as_deref().map(probes_sent),
        None => None,
    };
    let client = Arc::new(Client {
        http: reqwest::Client::builder()
            .timeout(Duration::from_secs(args.timeout))
            .build()?,
        url: format!("{}/v1/chat/completions", front.url()),
        api_key: args.api_key.clone(),
        engines: args.engines.clone(),
        engine_models: engine_models(&args.engines, args.api_key.as_deref()).await,
        shape: shape.clone(),
    });
    let ticks = crate::cpu::clock_ticks();
    let cpu_before = front.cpu_seconds(ticks);
    let start = Instant::now();
    let tasks: Vec<_> = planned
        .into_iter()
        .map(|p| tokio::spawn(Arc::clone(&client).conversation(p, start)))
        .collect();
    let mut records = Vec::new();
    for t in tasks {
        records.extend(t.await?);
    }
    let wall = start.elapsed().as_secs_f64();
    let mut summary = summarize(policy.name(), &records, args.engines.len(), wall);
    summary.gateway_cpu_s = Some(cpu_spent(policy, &cpu_before, &front.cpu_seconds(ticks)));
    let (mut journal, mut state, mut sidecar_metrics) = (None, None, None);
    if let Some(admin) = admin {
        // One scrape for every figure read after the run.
        sidecar_metrics = metrics(admin).await;
        let after = sidecar_metrics.as_deref();
        summary.probes = match (probes_before, after.map(probes_sent)) {
            (Some(a), Some(b)) => Some(b.saturating_sub(a)),
            (None, b) => b,
            _ => None,
        };
        summary.sidecar_usage = after.map(usage_counted);
        summary.prediction_error = after.and_then(prediction_error);
        journal = decisions(admin, records.len()).await;
    }
    let mut peer_command = None;
    match front {
        Serving::Envoy(stack) => {
            if admin.is_some() {
                state = stack.state_json().await.ok();
            }
            stack.shutdown().await;
        }
        Serving::Peer(peer, forwards) => {
            peer_command = Some(peer.command.clone());
            if !forwards.is_empty() {
                // What kv_aware made of the events: its own counters.
                if let Some(text) = peer.metrics().await {
                    for line in text
                        .lines()
                        .filter(|l| l.starts_with("vllm_router_kv_") && !l.starts_with('#'))
                    {
                        eprintln!("hearth-bench real: {}: {line}", policy.name());
                    }
                }
                eprintln!(
                    "hearth-bench real: KV event batches forwarded to {}: {}",
                    policy.name(),
                    forwards
                        .iter()
                        .map(|f| f.forwarded().to_string())
                        .collect::<Vec<_>>()
                        .join(" / ")
                );
            }
        }
    }
    records.sort_by_key(|r| (r.conversation, r.turn));
    Ok(PolicyRun {
        summary,
        turns: records,
        decisions: journal,
        sidecar_state: state,
        peer_command,
        sidecar_metrics,
    })
}

/// `policies` in the order a seed runs them, and those skipped with the
/// reason (a peer router that is not installed).
pub fn runnable_in_order(
    policies: &[Policy],
    seed: u64,
    find: impl Fn(PeerKind) -> anyhow::Result<PathBuf>,
) -> (Vec<Policy>, Vec<(Policy, String)>) {
    let (run, skipped) = crate::live::runnable(policies, find);
    (crate::live::order_for_seed(&run, seed), skipped)
}

/// One run of a `real` invocation: the policy, the name its row carries,
/// and the run salt its prompts are drawn with ([`policy_salt`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Slot {
    pub policy: Policy,
    pub label: String,
    pub salt: u64,
    /// `--paired`: the index of this run's pair.
    pub pair: Option<usize>,
    /// `--paired`: the Hearth run of its pair, the one its peer is
    /// measured against.
    pub anchor: bool,
}

/// The runs of an invocation, in order. Unpaired, each policy of `order`
/// once. Paired, each policy but the first Hearth one beside a Hearth
/// run of its own, labelled `hearth beside PEER`; pair `k` runs Hearth
/// first when `seed + k` is odd, so both positions fall to each router on
/// every seed with two pairs or more, and on alternate seeds with one.
/// Each pair draws its prompts with a salt of its own, so no run finds
/// another's prompts in the engines.
pub fn slots(order: &[Policy], seed: u64, run_salt: u64, paired: bool) -> Vec<Slot> {
    let single = |policy: Policy| Slot {
        policy,
        label: policy.name().to_string(),
        salt: run_salt,
        pair: None,
        anchor: false,
    };
    let hearth = order.iter().copied().find(|p| p.is_hearth());
    let Some(hearth) = hearth.filter(|_| paired) else {
        return order.iter().copied().map(single).collect();
    };
    let mut out = Vec::new();
    for (k, peer) in order.iter().copied().filter(|&p| p != hearth).enumerate() {
        let salt = run_salt.wrapping_add(k as u64 + 1);
        let ours = Slot {
            policy: hearth,
            label: format!("{} beside {}", hearth.name(), peer.name()),
            salt,
            pair: Some(k),
            anchor: true,
        };
        let theirs = Slot {
            policy: peer,
            label: peer.name().to_string(),
            salt,
            pair: Some(k),
            anchor: false,
        };
        if (seed + k as u64) % 2 == 1 {
            out.extend([ours, theirs]);
        } else {
            out.extend([theirs, ours]);
        }
    }
    out
}

/// One pair's figures: its peer's throughput (requests a second, or turns
/// a minute) and TTFT p90 over its Hearth run's.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PairRatio {
    pub peer: String,
    pub hearth: String,
    pub throughput_hearth: f64,
    pub throughput_peer: f64,
    pub ttft_p90_hearth_s: f64,
    pub ttft_p90_peer_s: f64,
}

/// The pairs of `slots`, each with its two rows' figures (`figures` of a
/// slot's row: throughput, TTFT p90).
pub fn pair_ratios(slots: &[Slot], figures: &[(f64, f64)]) -> Vec<PairRatio> {
    let runs = || slots.iter().zip(figures);
    runs()
        .filter(|(h, _)| h.anchor)
        .filter_map(|(h, hf)| {
            let (p, pf) = runs().find(|(p, _)| p.pair == h.pair && !p.anchor)?;
            Some(PairRatio {
                peer: p.label.clone(),
                hearth: h.label.clone(),
                throughput_hearth: hf.0,
                throughput_peer: pf.0,
                ttft_p90_hearth_s: hf.1,
                ttft_p90_peer_s: pf.1,
            })
        })
        .collect()
}

/// The pairs as a Markdown table (`unit`: what the throughput counts).
pub fn pair_table(pairs: &[PairRatio], unit: &str) -> String {
    let mut out = format!(
        "| peer | {unit}: Hearth / peer | peer over Hearth | TTFT p90 s: Hearth / peer | peer over Hearth |\n\
         |---|---:|---:|---:|---:|\n"
    );
    for p in pairs {
        out.push_str(&format!(
            "| {} | {:.2} / {:.2} | {:.3} | {:.2} / {:.2} | {:.3} |\n",
            p.peer,
            p.throughput_hearth,
            p.throughput_peer,
            p.throughput_peer / p.throughput_hearth,
            p.ttft_p90_hearth_s,
            p.ttft_p90_peer_s,
            p.ttft_p90_peer_s / p.ttft_p90_hearth_s,
        ));
    }
    out
}

/// The Envoy counters that tell how requests left the gateway, summed over
/// listeners and clusters by their last name part: ext_proc's streams
/// and messages sent, `failure_mode_allowed`, `message_timeouts`, the
/// deadline overrides it took or ignored and `streams_failed`, the
/// engines' `upstream_cx_destroy_remote_with_active_rq` (an engine closed
/// a connection under a request), `upstream_cx_idle_timeout`,
/// `upstream_cx_total` and `upstream_rq_retry`. Absent counters are 0.
fn envoy_outcome_counters(stats: &[(String, String)]) -> Vec<(String, Value)> {
    const NAMES: [&str; 11] = [
        "ext_proc.streams_started",
        "ext_proc.stream_msgs_sent",
        "ext_proc.failure_mode_allowed",
        "ext_proc.message_timeouts",
        "ext_proc.override_message_timeout_received",
        "ext_proc.override_message_timeout_ignored",
        "ext_proc.streams_failed",
        "upstream_cx_destroy_remote_with_active_rq",
        "upstream_cx_idle_timeout",
        "upstream_cx_total",
        "upstream_rq_retry",
    ];
    NAMES
        .iter()
        .map(|name| {
            let sum: u64 = stats
                .iter()
                .filter(|(k, _)| k.ends_with(&format!(".{name}")) && !k.contains("sidecar"))
                .filter_map(|(_, v)| v.trim().parse::<u64>().ok())
                .sum();
            let short = name.rsplit('.').next().unwrap_or(name);
            (short.to_string(), Value::from(sum))
        })
        .collect()
}

/// Each replica's health on the sidecar's `/state`, on one line:
/// `ID state, fenced N, suspicions N, last failure F`.
fn health_line(state: &Value) -> String {
    let Some(replicas) = state["replicas"].as_array() else {
        return "no replicas in /state".into();
    };
    replicas
        .iter()
        .map(|r| {
            let h = &r["health"];
            format!(
                "{} {}, fenced {}, suspicions {}, last failure {}",
                r["id"].as_str().unwrap_or("?"),
                h["state"].as_str().unwrap_or("?"),
                h["fenced_total"],
                h["suspicions_total"],
                h["last_failure"].as_str().unwrap_or("none")
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// `--driver inference-perf`: the harness against each policy's front
/// in turn; one row each from its report.
async fn run_harness(args: &RealArgs, slots: &[Slot], model: &str) -> anyhow::Result<()> {
    let program = crate::harness::find()?;
    let tokenizer = tokenizer_dir(args)?;
    let users = args.users_per_group.max(1);
    let shape = crate::harness::HarnessShape {
        groups: args.conversations.div_ceil(users),
        users_per_group: users,
        system_tokens: args.system_tokens,
        question_tokens: args.question_tokens,
        output_tokens: args.max_tokens as usize,
        rates: args.rates.clone(),
        stage_seconds: args.stage_seconds,
        seed: args.seed,
    };
    println!(
        "# inference-perf ({}): shared_prefix, {} groups x {} users, system {} + question {} tokens, \
         output {} (ignore_eos), rates {:?}/s x {} s each, tokenizer {}",
        program.display(),
        shape.groups,
        shape.users_per_group,
        shape.system_tokens,
        shape.question_tokens,
        shape.output_tokens,
        shape.rates,
        shape.stage_seconds,
        tokenizer.display()
    );
    let scratch = std::env::temp_dir().join(format!("hearth-harness-{}", std::process::id()));
    let deadline = Duration::from_secs(shape.stage_seconds * shape.rates.len() as u64 + 600);
    let mut rows = Vec::new();
    let mut reports = Vec::new();
    let ticks = crate::cpu::clock_ticks();
    for (i, slot) in slots.iter().enumerate() {
        let policy = slot.policy;
        eprintln!("hearth-bench real: inference-perf through {}", slot.label);
        let front = Serving::start(args, policy, model).await?;
        let dir = match &args.keep {
            Some(keep) => keep.join(format!("{i}-{}", slot.label.replace(' ', "-"))),
            None => scratch.join(format!("{i}-{}", policy.name())),
        };
        // Each run's prompts its own (the harness's seed makes its text),
        // so no run finds another's prompts in the engines.
        let own = crate::harness::HarnessShape {
            seed: policy_salt(args.seed, slot.salt, policy) >> 33,
            ..shape.clone()
        };
        let yaml = crate::harness::config(
            &own,
            &front.url(),
            model,
            &tokenizer,
            &dir.join("report"),
            args.keep.is_some(),
        );
        let cpu_before = front.cpu_seconds(ticks);
        let result = crate::harness::run(&program, &yaml, &dir, deadline).await;
        let cpu = cpu_spent(policy, &cpu_before, &front.cpu_seconds(ticks));
        let mut sidecar_state = None;
        let mut envoy_counters = None;
        if let Serving::Envoy(stack) = front {
            // How Envoy's own side of the run went: requests it let past
            // the sidecar (an ext_proc answer later than its deadline),
            // engine connections closed under a request, retries.
            if let Ok(all) = stack.envoy.stats_matching("").await {
                let picked = envoy_outcome_counters(&all);
                eprintln!(
                    "hearth-bench real: {} Envoy counters at the end: {}",
                    slot.label,
                    picked
                        .iter()
                        .map(|(k, v)| format!("{k} {v}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                );
                envoy_counters = Some(picked.into_iter().collect::<serde_json::Map<_, _>>());
            }
            if policy.is_hearth() {
                // Replica health at the end: what a lost request may have
                // met (fencings, suspicions and their last cause).
                sidecar_state = stack.state_json().await.ok();
                if let Some(state) = &sidecar_state {
                    eprintln!(
                        "hearth-bench real: {} replica health at the end: {}",
                        slot.label,
                        health_line(state)
                    );
                }
            }
            if args.keep.is_some() && policy.is_hearth() {
                // As many decisions as the harness sends requests.
                let sent: f64 = shape
                    .rates
                    .iter()
                    .map(|r| r * shape.stage_seconds as f64)
                    .sum();
                let journal = decisions(stack.admin(), sent.ceil() as usize)
                    .await
                    .context("reading the sidecar's decision journal")?;
                let doc = json!({ "decisions": journal });
                std::fs::write(dir.join("decisions.json"), serde_json::to_vec(&doc)?)?;
            }
            stack.shutdown().await;
        }
        let summary = result.with_context(|| format!("policy {}", slot.label))?;
        let mut row = crate::harness::HarnessRow::read(&slot.label, &summary);
        row.gateway_cpu_s = Some(cpu);
        rows.push(row);
        let mut report = json!({"policy": slot.label, "summary": summary});
        if let Some(state) = sidecar_state {
            report["sidecar_state"] = state;
        }
        if let Some(counters) = envoy_counters {
            report["envoy_counters"] = Value::Object(counters);
        }
        reports.push(report);
    }
    println!();
    print!("{}", crate::harness::table(&rows));
    let figures: Vec<(f64, f64)> = rows
        .iter()
        .map(|r| (r.requests_per_s, r.ttft_p90_s))
        .collect();
    let pairs = pair_ratios(slots, &figures);
    if !pairs.is_empty() {
        println!();
        print!("{}", pair_table(&pairs, "req/s"));
    }
    if let Some(path) = &args.json {
        let doc = json!({
            "command": command_line(),
            "build": crate::provenance::json(),
            "driver": "inference-perf",
            "engines": args.engines,
            "model": model,
            "shape": shape,
            "rows": rows,
            "pairs": pairs,
            "reports": reports,
        });
        std::fs::write(path, serde_json::to_vec_pretty(&doc)?)?;
        println!("wrote {}", path.display());
    }
    let _ = std::fs::remove_dir_all(&scratch);
    Ok(())
}

pub async fn run(args: RealArgs) -> anyhow::Result<()> {
    anyhow::ensure!(!args.engines.is_empty(), "--engines lists no engine");
    anyhow::ensure!(
        args.conversations > 0 && args.turns > 0,
        "--conversations and --turns must be > 0"
    );
    anyhow::ensure!(!args.policies.is_empty(), "--policies is empty");
    anyhow::ensure!(
        args.keep.is_none() || args.driver == Driver::InferencePerf,
        "--keep keeps inference-perf's reports: it needs --driver inference-perf \
         (with this command's own client, --json holds every turn)"
    );
    // Refused here, before any run, as the sidecar would refuse them.
    args.sidecar.parse()?;
    let model = match &args.model {
        Some(m) => m.clone(),
        None => shared_model(&args.engines, args.api_key.as_deref()).await?,
    };
    let run_salt = args.salt.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64)
    });
    let engines = args
        .engines
        .iter()
        .map(SocketAddr::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let policies = args
        .policies
        .iter()
        .map(|p| p.name())
        .collect::<Vec<_>>()
        .join(",");
    let hearth_settings = if args.sidecar.set.is_empty() {
        "defaults".to_string()
    } else {
        args.sidecar
            .set
            .iter()
            .map(shown_setting)
            .collect::<Vec<_>>()
            .join(" ")
    };
    let (mut order, mut skipped) = runnable_in_order(&args.policies, args.seed, PeerKind::find);
    let smg = |p: &Policy| p.peer().is_some_and(|c| c.kind == PeerKind::Smg);
    if order.iter().any(smg) {
        if let Some(why) = smg_cannot_serve_at(&args.engines, args.api_key.as_deref(), &model).await
        {
            skipped.extend(order.iter().filter(|p| smg(p)).map(|&p| (p, why.clone())));
            order.retain(|p| !smg(p));
        }
    }
    let workload = match args.workload {
        Workload::Conversations => "conversations".to_string(),
        Workload::SharedPrefix => {
            format!("shared-prefix --users-per-group {}", args.users_per_group)
        }
    };
    println!("# hearth-bench real");
    println!("# command: {}", command_line());
    println!("{}", crate::provenance::header());
    let driver = match args.driver {
        Driver::HearthBench => format!(
            "--workload {workload} --conversations {} --turns {} --shared-bytes {} --system-bytes {} \
             --user-bytes {} --think-ms {} --timeout {}",
            args.conversations,
            args.turns,
            args.shared_bytes,
            args.system_bytes,
            args.user_bytes,
            args.think_ms,
            args.timeout,
        ),
        Driver::InferencePerf => format!(
            "--driver inference-perf --conversations {} --users-per-group {} --system-tokens {} \
             --question-tokens {} --rates {} --stage-seconds {}",
            args.conversations,
            args.users_per_group,
            args.system_tokens,
            args.question_tokens,
            args.rates
                .iter()
                .map(f64::to_string)
                .collect::<Vec<_>>()
                .join(","),
            args.stage_seconds,
        ),
    };
    println!(
        "# = --engines {engines} --model {model} {driver} --max-tokens {} --seed {} --salt {run_salt} --policies {policies}{}{}",
        args.max_tokens,
        args.seed,
        if args.paired { " --paired" } else { "" },
        args.sidecar.shown(),
    );
    let load = match args.driver {
        Driver::HearthBench => format!(
            "{} conversations x {} turns each (streamed, max_tokens {}, temperature 0)",
            args.conversations, args.turns, args.max_tokens
        ),
        Driver::InferencePerf => "inference-perf's shared-prefix load (below)".to_string(),
    };
    println!(
        "# {} engines, {load}, \
         API key {}; Envoy --concurrency 2; hearth: hearth-ext-proc at {hearth_settings}; {} cores",
        args.engines.len(),
        if args.api_key.is_some() {
            "sent"
        } else {
            "none"
        },
        std::thread::available_parallelism().map_or(0, |n| n.get()),
    );
    println!(
        "# order (seed {}; reversed on even seeds): {}",
        args.seed,
        order.iter().map(|p| p.name()).collect::<Vec<_>>().join(",")
    );
    for (p, why) in &skipped {
        println!("# skipped {}: {why}", p.name());
    }
    anyhow::ensure!(!order.is_empty(), "no policy of --policies can run");
    anyhow::ensure!(
        !args.paired || (order.iter().any(|p| p.is_hearth()) && order.len() >= 2),
        "--paired needs a Hearth policy and another in --policies (that can run)"
    );
    let slots = slots(&order, args.seed, run_salt, args.paired);
    if args.paired {
        let labels: Vec<&str> = slots.iter().map(|s| s.label.as_str()).collect();
        println!("# paired: {}", labels.join(", "));
    }
    if args.driver == Driver::InferencePerf {
        return run_harness(&args, &slots, &model).await;
    }
    let mut rows = Vec::new();
    for slot in &slots {
        eprintln!("hearth-bench real: running {}", slot.label);
        let mut row = run_policy(&args, slot.policy, &model, slot.salt)
            .await
            .with_context(|| format!("policy {}", slot.label))?;
        row.summary.policy.clone_from(&slot.label);
        rows.push(row);
    }
    let summaries: Vec<Summary> = rows.iter().map(|r| r.summary.clone()).collect();
    println!();
    print!("{}", table(&summaries));
    let figures: Vec<(f64, f64)> = summaries
        .iter()
        .map(|r| (r.turns_per_min, r.ttft_p90_s))
        .collect();
    let pairs = pair_ratios(&slots, &figures);
    if !pairs.is_empty() {
        println!();
        print!("{}", pair_table(&pairs, "turns/min"));
    }
    for r in &rows {
        if let Some(command) = &r.peer_command {
            println!("{}: {command}", r.summary.policy);
        }
    }
    if let Some(p) = summaries.iter().find_map(|r| r.probes) {
        println!("\nhearth: the sidecar sent {p} active probes to the engines during its run");
    }
    for r in &summaries {
        if let Some(p) = r.prediction_error {
            println!(
                "{}: hearth_prediction_error: mean |predicted - served cached tokens| / prompt tokens {:.2}% over {} answers; in all {} cached tokens predicted, {} served",
                r.policy,
                100.0 * p.mean_error,
                p.answers,
                p.predicted_tokens,
                p.served_tokens
            );
        }
        if let Some((prompt, cached)) = r.sidecar_usage {
            let share = |c: u64, p: u64| 100.0 * c as f64 / p.max(1) as f64;
            let (ap, ac) = r.answered_usage;
            println!(
                "{}: the sidecar's /metrics counted {prompt} prompt and {cached} cached tokens ({:.1}% from cache); the answers' usage says {ap} and {ac} ({:.1}%)",
                r.policy,
                share(cached, prompt),
                share(ac, ap)
            );
        }
    }
    if let Some(path) = &args.json {
        let doc = json!({
            "command": command_line(),
            "build": crate::provenance::json(),
            "engines": args.engines,
            "model": model,
            "shape": Shape::of(&args),
            "salt": run_salt,
            "timeout_s": args.timeout,
            "hearth_settings": args.sidecar.set.iter().map(shown_setting).collect::<Vec<_>>(),
            "rows": rows,
            "pairs": pairs,
        });
        std::fs::write(path, serde_json::to_vec_pretty(&doc)?)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use hearth_ext_proc::envoy::render::render;

    #[test]
    fn envoys_outcome_counters_are_summed_by_name_and_absent_ones_are_zero() {
        let stats = [
            ("http.ingress.ext_proc.failure_mode_allowed", "3"),
            ("http.other.ext_proc.failure_mode_allowed", "2"),
            (
                "cluster.engines.upstream_cx_destroy_remote_with_active_rq",
                "4",
            ),
            // The sidecar's own clusters are not the engines'.
            ("cluster.hearth_sidecar.upstream_cx_total", "9"),
            ("cluster.engines.upstream_cx_total", "40"),
            ("cluster.engines.upstream_cx_total_extra", "7"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()));
        let got: std::collections::BTreeMap<_, _> =
            envoy_outcome_counters(&stats).into_iter().collect();
        assert_eq!(got["failure_mode_allowed"], json!(5));
        assert_eq!(got["upstream_cx_destroy_remote_with_active_rq"], json!(4));
        assert_eq!(got["upstream_cx_total"], json!(40));
        assert_eq!(got["message_timeouts"], json!(0));
        assert_eq!(got.len(), 11);
    }

    #[test]
    fn the_health_line_names_each_replicas_fencings_and_last_failure() {
        use hearth_router::health::{Failure, ReplicaHealth};
        let mut struck = ReplicaHealth::default();
        let now = std::time::Instant::now();
        struck.record_request(
            hearth_router::health::Outcome::Failure(Failure::ConnectionReset),
            &Default::default(),
            now,
        );
        let state = json!({"replicas": [
            {"id": "a", "health": ReplicaHealth::default().snapshot(now)},
            {"id": "b", "health": struck.snapshot(now)},
        ]});
        assert_eq!(
            health_line(&state),
            "a serving, fenced 0, suspicions 0, last failure none; \
             b serving, fenced 0, suspicions 1, last failure connection_reset"
        );
        assert_eq!(health_line(&json!({})), "no replicas in /state");
    }

    #[test]
    fn the_model_asked_for_by_default_is_the_first_every_engine_serves() {
        let list = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<Vec<_>>();
        // `hearth-bench vllm`: each engine's own name, then the shared one.
        let both = [
            list(&["vllm-0", "llama-4x512"]),
            list(&["vllm-1", "llama-4x512"]),
        ];
        assert_eq!(common_model(&both).as_deref(), Some("llama-4x512"));
        // One engine, or engines of one name: the first engine's first.
        assert_eq!(common_model(&[list(&["a", "b"])]).as_deref(), Some("a"));
        assert_eq!(
            common_model(&[list(&["b", "a"]), list(&["a", "b"])]).as_deref(),
            Some("b")
        );
        // Nothing in common, or no engine: none to ask for.
        assert_eq!(common_model(&[list(&["a"]), list(&["b"])]), None);
        assert_eq!(common_model(&[]), None);
    }

    fn shape() -> Shape {
        Shape {
            workload: Workload::Conversations,
            users_per_group: 1,
            conversations: 3,
            turns: 4,
            shared_bytes: 600,
            system_bytes: 300,
            user_bytes: 200,
            think_ms: 500,
            max_tokens: 16,
            seed: 7,
        }
    }

    /// The bodies of every turn of `plan`, each conversation answering "ok".
    fn bodies(plan: Vec<Planned>, shape: &Shape) -> Vec<Vec<String>> {
        plan.into_iter()
            .map(|mut p| {
                (0..shape.turns)
                    .map(|_| {
                        let b = turn_body(&mut p.conversation, shape.user_bytes, shape.max_tokens);
                        p.conversation.push_assistant("ok");
                        b.to_string()
                    })
                    .collect()
            })
            .collect()
    }

    fn system(b: &str) -> String {
        let v: Value = serde_json::from_str(b).unwrap();
        v["messages"][0]["content"].as_str().unwrap().to_string()
    }

    #[test]
    fn smg_is_skipped_where_an_engine_lists_another_model_first() {
        let list = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<Vec<_>>();
        assert_eq!(smg_cannot_serve(&list(&["m", "m"]), "m"), None);
        let why = smg_cannot_serve(&list(&["m", "vllm-1"]), "m").unwrap();
        assert!(
            why.contains("vllm-1") && why.contains("--shared-name-first"),
            "{why}"
        );
        assert!(!why.contains("(m"), "{why}");
    }

    #[test]
    fn paired_runs_put_every_peer_beside_a_hearth_run_of_its_own() {
        use Policy::{Hearth, LeastRequest, RingHash, SmgCacheAware};
        let labels = |v: &[Slot]| v.iter().map(|s| s.label.clone()).collect::<Vec<_>>();
        // Unpaired: the order as given, one salt for all.
        let plain = slots(&[RingHash, Hearth], 1, 40, false);
        assert_eq!(labels(&plain), ["ring_hash", "hearth"]);
        assert!(plain.iter().all(|s| s.salt == 40 && s.pair.is_none()));
        // Paired: Hearth once per peer, wherever it was listed; the first
        // pair Hearth-first on odd seeds, the next the other way round.
        let odd = slots(&[LeastRequest, Hearth, SmgCacheAware], 1, 40, true);
        assert_eq!(
            labels(&odd),
            [
                "hearth beside least_request",
                "least_request",
                "smg_cache_aware",
                "hearth beside smg_cache_aware",
            ]
        );
        let even = slots(&[LeastRequest, Hearth, SmgCacheAware], 2, 40, true);
        assert_eq!(
            labels(&even),
            [
                "least_request",
                "hearth beside least_request",
                "hearth beside smg_cache_aware",
                "smg_cache_aware",
            ]
        );
        // Each pair its own salt (no run finds another pair's prompts),
        // the two runs of a pair the same one, none the unpaired run's.
        assert_eq!(odd[0].salt, odd[1].salt);
        assert_eq!(odd[2].salt, odd[3].salt);
        assert_ne!(odd[0].salt, odd[2].salt);
        assert!(odd.iter().all(|s| s.salt != 40));
        assert_eq!(odd.iter().filter(|s| s.policy == Hearth).count(), 2);
        let anchors: Vec<bool> = odd.iter().map(|s| s.anchor).collect();
        assert_eq!(anchors, [true, false, false, true]);
        // Without a Hearth policy there is nothing to pair with.
        assert_eq!(
            labels(&slots(&[LeastRequest, RingHash], 1, 40, true)),
            ["least_request", "ring_hash"]
        );
    }

    #[test]
    fn each_pair_is_reported_as_its_peer_over_its_own_hearth_run() {
        use Policy::{Hearth, LeastRequest, SmgCacheAware};
        let even = slots(&[Hearth, LeastRequest, SmgCacheAware], 2, 5, true);
        // Rows in run order: least_request, hearth, hearth, smg.
        let figures = [(9.0, 18.0), (10.0, 20.0), (11.0, 16.0), (11.0, 17.6)];
        let pairs = pair_ratios(&even, &figures);
        assert_eq!(pairs.len(), 2);
        assert_eq!(pairs[0].peer, "least_request");
        assert_eq!(pairs[0].hearth, "hearth beside least_request");
        assert_eq!(
            (pairs[0].throughput_hearth, pairs[0].throughput_peer),
            (10.0, 9.0)
        );
        assert_eq!(
            (pairs[0].ttft_p90_hearth_s, pairs[0].ttft_p90_peer_s),
            (20.0, 18.0)
        );
        assert_eq!(pairs[1].peer, "smg_cache_aware");
        assert_eq!(
            (pairs[1].throughput_hearth, pairs[1].throughput_peer),
            (11.0, 11.0)
        );
        let table = pair_table(&pairs, "req/s");
        assert!(
            table.contains("| least_request | 10.00 / 9.00 | 0.900 | 20.00 / 18.00 | 0.900 |"),
            "{table}"
        );
        assert!(
            table.contains("| smg_cache_aware | 11.00 / 11.00 | 1.000 | 16.00 / 17.60 | 1.100 |"),
            "{table}"
        );
        // Unpaired runs have no pairs.
        assert!(
            pair_ratios(&slots(&[Hearth, LeastRequest], 1, 5, false), &figures[..2]).is_empty()
        );
    }

    #[test]
    fn shared_prefix_users_share_their_groups_prompt_and_ask_without_history() {
        let s = Shape {
            workload: Workload::SharedPrefix,
            users_per_group: 2,
            conversations: 5,
            ..shape()
        };
        let systems: Vec<String> = plan(&s, "m", 11)
            .iter()
            .map(|p| {
                p.conversation.messages[0]["content"]
                    .as_str()
                    .unwrap()
                    .to_string()
            })
            .collect();
        // Users 0-1, 2-3 and 4 form three groups.
        assert_eq!(systems[0], systems[1]);
        assert_eq!(systems[2], systems[3]);
        assert_ne!(systems[0], systems[2]);
        assert_ne!(systems[2], systems[4]);
        assert!(systems[0].len() >= s.shared_bytes, "{}", systems[0].len());
        // Another salt, other groups' prompts.
        let other = plan(&s, "m", 12);
        assert_ne!(
            other[0].conversation.messages[0],
            json!({"role": "system", "content": systems[0]})
        );
    }

    #[test]
    fn peer_routers_not_installed_are_skipped_and_even_seeds_run_in_reverse() {
        let all = [
            Policy::RingHash,
            Policy::Hearth,
            Policy::SmgCacheAware,
            Policy::VllmRouterCacheAware,
        ];
        let missing = |k: PeerKind| -> anyhow::Result<PathBuf> {
            match k {
                PeerKind::Smg => Ok(PathBuf::from("/bin/true")),
                PeerKind::VllmRouter => anyhow::bail!("{}", k.not_installed()),
            }
        };
        let (odd, skipped) = runnable_in_order(&all, 1, missing);
        assert_eq!(
            odd,
            [Policy::RingHash, Policy::Hearth, Policy::SmgCacheAware]
        );
        assert_eq!(skipped.len(), 1);
        assert_eq!(skipped[0].0, Policy::VllmRouterCacheAware);
        assert!(
            skipped[0].1.contains("scripts/setup-peers"),
            "{}",
            skipped[0].1
        );
        let (even, _) = runnable_in_order(&all, 2, missing);
        assert_eq!(
            even,
            [Policy::SmgCacheAware, Policy::Hearth, Policy::RingHash]
        );
        // Every policy's prompts are its own.
        let salts: std::collections::HashSet<u64> =
            all.iter().map(|&p| policy_salt(1, 99, p)).collect();
        assert_eq!(salts.len(), all.len());
    }

    #[test]
    fn the_workload_is_a_function_of_seed_and_salt() {
        let s = shape();
        let a = plan(&s, "m", 11);
        let b = plan(&s, "m", 11);
        assert_eq!(bodies(a.clone(), &s), bodies(b, &s));
        // Timing is the seed's alone: another salt (another policy) keeps it.
        let c = plan(&s, "m", 12);
        for (x, y) in a.iter().zip(&c) {
            assert_eq!((x.start, &x.thinks), (y.start, &y.thinks));
            assert_eq!(x.thinks.len(), s.turns - 1);
            assert!(x.start < Duration::from_millis(500));
            assert!(x
                .thinks
                .iter()
                .all(|t| *t >= Duration::from_millis(250) && *t < Duration::from_millis(750)));
        }
        // ... and another seed changes it.
        let d = plan(
            &Shape {
                seed: 8,
                ..s.clone()
            },
            "m",
            11,
        );
        assert_ne!(a[0].start, d[0].start);
    }

    #[test]
    fn conversations_share_a_prefix_and_policies_share_nothing() {
        let s = shape();
        let run = bodies(plan(&s, "m", policy_salt(1, 99, Policy::Hearth)), &s);
        let (c0, c1) = (system(&run[0][0]), system(&run[1][0]));
        assert_ne!(c0, c1);
        let common = c0
            .bytes()
            .zip(c1.bytes())
            .take_while(|(a, b)| a == b)
            .count();
        assert!(common >= s.shared_bytes, "{common}");
        // Each turn re-sends the previous one's messages, then more.
        for turns in &run {
            for w in turns.windows(2) {
                let (a, b): (Value, Value) = (
                    serde_json::from_str(&w[0]).unwrap(),
                    serde_json::from_str(&w[1]).unwrap(),
                );
                let (a, b) = (
                    a["messages"].as_array().unwrap(),
                    b["messages"].as_array().unwrap(),
                );
                assert_eq!(&b[..a.len()], &a[..]);
                assert_eq!(b.len(), a.len() + 2);
            }
        }
        let first: Value = serde_json::from_str(&run[0][0]).unwrap();
        assert_eq!(first["stream"], true);
        assert_eq!(first["max_tokens"], 16);
        assert_eq!(first["stream_options"]["include_usage"], true);
        // Another policy's prompts differ from the first byte of content.
        let other = bodies(plan(&s, "m", policy_salt(1, 99, Policy::RingHash)), &s);
        let o = system(&other[0][0]);
        let shared = c0
            .bytes()
            .zip(o.bytes())
            .take_while(|(a, b)| a == b)
            .count();
        assert!(shared < 12, "{shared}");
        // Salts: fixed per policy, moved by seed and run salt.
        assert_eq!(
            policy_salt(1, 99, Policy::Hearth),
            policy_salt(1, 99, Policy::Hearth)
        );
        assert_ne!(
            policy_salt(1, 99, Policy::Hearth),
            policy_salt(1, 98, Policy::Hearth)
        );
        assert_ne!(
            policy_salt(1, 99, Policy::Hearth),
            policy_salt(2, 99, Policy::Hearth)
        );
    }

    #[test]
    fn reads_usage_and_falls_back_to_llama_cpp_timings() {
        // OpenAI usage, split across reads, the event cut mid-line.
        let stream = concat!(
            "data: {\"model\":\"llama-1\",\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":null}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"content\":\"Hel\"}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"content\":\"lo\"}}]}\n\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":900,\"completion_tokens\":2,\"prompt_tokens_details\":{\"cached_tokens\":600}},",
            "\"timings\":{\"cache_n\":1,\"prompt_n\":2}}\n\n",
            "data: [DONE]\n\n"
        );
        let (a, b) = stream.as_bytes().split_at(90);
        let mut r = StreamReader::default();
        assert!(!r.feed(a), "the role chunk is not a token");
        assert!(r.feed(b));
        assert_eq!(r.text, "Hello");
        assert!(r.done);
        assert_eq!(r.cached_and_prompt(), Some((600, 900)));
        // The engine's name and what it generated.
        assert_eq!(r.model.as_deref(), Some("llama-1"));
        assert_eq!(r.completion_tokens, Some(2));

        // llama.cpp without include_usage: timings only.
        let mut r = StreamReader::default();
        r.feed(b"data: {\"choices\":[{\"delta\":{\"reasoning_content\":\"hm\"}}]}\n\n");
        assert!(r.generated && r.text.is_empty());
        r.feed(b"data: {\"choices\":[{\"finish_reason\":\"length\",\"delta\":{}}],\"timings\":{\"cache_n\":300,\"prompt_n\":100}}\n\n");
        assert_eq!(r.cached_and_prompt(), Some((300, 400)));

        // Prompt tokens without a cached count: prompt known, cache unknown.
        let mut r = StreamReader::default();
        r.feed(b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":50}}\n");
        assert_eq!((r.cached_and_prompt(), r.prompt_tokens()), (None, Some(50)));

        let mut r = StreamReader::default();
        r.feed(b"data: {\"error\":{\"message\":\"boom\"}}\n");
        assert_eq!(r.error.as_deref(), Some("boom"));
    }

    fn rec(
        conversation: usize,
        turn: usize,
        engine: Option<usize>,
        cached: u64,
        status: u16,
    ) -> TurnRecord {
        TurnRecord {
            conversation,
            turn,
            engine,
            status: Some(status),
            ttft_s: (status == 200).then_some(turn as f64 / 10.0),
            e2e_s: 1.0,
            prompt_tokens: Some(100),
            cached_tokens: Some(cached),
            output_tokens: (status == 200).then_some(8),
            error: (status != 200).then(|| format!("HTTP {status}")),
        }
    }

    #[test]
    fn summary_counts_stays_caches_and_failures() {
        let records = vec![
            // Conversation 0: engine 0, 0, then moves to 1; turn 4 fails.
            rec(0, 1, Some(0), 40, 200),
            rec(0, 2, Some(0), 90, 200),
            rec(0, 3, Some(1), 0, 200),
            rec(0, 4, Some(1), 0, 503),
            // Conversation 1: turn 2 is shed; turn 3 compares with turn 1.
            rec(1, 3, Some(1), 80, 200),
            rec(1, 1, Some(1), 0, 200),
            rec(1, 2, None, 0, 429),
            TurnRecord {
                status: None,
                error: Some("request: timed out".into()),
                ..rec(1, 4, None, 0, 200)
            },
        ];
        let s = summarize("p", &records, 2, 12.5);
        assert_eq!((s.requests, s.ok), (8, 5));
        assert_eq!(s.cached_later, Some(170.0 / 300.0));
        assert_eq!(s.cached_first, Some(40.0 / 200.0));
        assert_eq!(s.computed_tokens, 500 - 210);
        // Stays: (0,2) stayed, (0,3) moved, (1,3) stayed.
        assert_eq!(s.stay_rate, Some(2.0 / 3.0));
        assert_eq!((s.status_5xx, s.status_429, s.other_failures), (1, 1, 1));
        assert_eq!(s.per_engine, [2, 3]);
        assert_eq!(s.ttft_p50_s, 0.2);
        // Turns 2+ only: 0.2, 0.3 and 0.3 (first turns took 0.1).
        assert_eq!(s.ttft_later_p50_s, 0.3);
        assert_eq!(s.mean_prompt_tokens, 100.0);
        let none = summarize("q", &records[3..4], 2, 1.0);
        // Nothing answered, no engine known: dashes.
        let t = table(&[none]);
        assert!(
            t.contains("| q | 1.0 | 0/1 | 0.0 | 0.0 | 0 | - | - | 0 | - | - | - | - / - | - | 1 | 0 | 0 | - |"),
            "{t}"
        );
        // Five answers of 8 tokens in 12.5 s: 24 a minute, 3.2 tokens a second.
        assert_eq!(
            (s.output_tokens, s.turns_per_min, s.output_tok_per_s),
            (40, 24.0, 3.2)
        );
        let t = table(&[s]);
        assert!(
            t.contains("| p | 12.5 | 5/8 | 24.0 | 3.2 | 100 | 56.7% | 20.0% | 290 |"),
            "{t}"
        );
        assert!(t.contains("| 66.7% | 1 | 1 | 1 | 2 / 3 |"), "{t}");
    }

    #[test]
    fn configs_name_the_upstream_and_hash_the_session() {
        let engines: Vec<SocketAddr> = vec![
            "127.0.0.1:8001".parse().unwrap(),
            "127.0.0.1:8002".parse().unwrap(),
        ];
        let ring = plain_config(Policy::RingHash, &engines).unwrap();
        assert!(ring.contains("lb_policy: RING_HASH") && !ring.contains("LEAST_REQUEST"));
        assert!(ring.contains("hash_policy: [ { header: { header_name: x-session-id } } ]"));
        let least = plain_config(Policy::LeastRequest, &engines).unwrap();
        assert!(least.contains("lb_policy: LEAST_REQUEST") && !least.contains("hash_policy"));
        let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
        let hearth = with_upstream_header(&render(&Gateway::local(
            loopback,
            loopback,
            loopback,
            engines.clone(),
            "/x.wasm".into(),
        )))
        .unwrap();
        for yaml in [&ring, &least, &hearth] {
            assert_eq!(yaml.matches("%UPSTREAM_HOST%").count(), 1, "{yaml}");
            assert!(yaml.contains("port_value: 8001") && yaml.contains("port_value: 8002"));
        }
        // The header is the route's, at the route's indentation.
        for yaml in [&ring, &hearth] {
            assert!(yaml.contains(
                "              - match: { prefix: \"/\" }\n                response_headers_to_add:\n"
            ));
        }
        assert!(plain_config(Policy::Hearth, &engines).is_err());
        assert!(with_upstream_header("no routes").is_err());
    }

    #[test]
    fn printed_command_lines_hide_credentials() {
        let line = |a: &str| redacted(a.split(' ').map(str::to_string));
        assert_eq!(
            line("hearth-bench real --api-key k1 --seed 1"),
            "hearth-bench real --api-key *** --seed 1"
        );
        assert_eq!(line("x --api-key=k1"), "x --api-key=***");
        assert_eq!(
            line("x --hearth-setting HEARTH_ENGINE_API_KEY=k1 --hearth-setting=HEARTH_ALPHA=2"),
            "x --hearth-setting HEARTH_ENGINE_API_KEY=*** --hearth-setting=HEARTH_ALPHA=2"
        );
        assert_eq!(
            line("x --hearth-setting=HEARTH_ENGINE_API_KEY=k1"),
            "x --hearth-setting=HEARTH_ENGINE_API_KEY=***"
        );
        assert_eq!(
            line("x --set=HEARTH_PEERS_TOKEN=t --set HEARTH_ENGINE_API_KEY=k1"),
            "x --set=HEARTH_PEERS_TOKEN=*** --set HEARTH_ENGINE_API_KEY=***"
        );
    }

    #[test]
    fn the_prediction_score_reads_the_histogram_and_both_counters() {
        let scrape = "\
hearth_prediction_error_sum 0.5
hearth_prediction_error_count 10
hearth_replica_predicted_cached_tokens_total{replica=\"replica-0\"} 1000
hearth_replica_predicted_cached_tokens_total{replica=\"replica-1\"} 500
hearth_replica_compared_cached_tokens_total{replica=\"replica-0\"} 1200
hearth_replica_compared_cached_tokens_total{replica=\"replica-1\"} 256
";
        let p = prediction_error(scrape).unwrap();
        assert_eq!(
            (p.answers, p.predicted_tokens, p.served_tokens),
            (10, 1500, 1456)
        );
        assert!((p.mean_error - 0.05).abs() < 1e-12);
        assert_eq!(prediction_error("hearth_prediction_error_sum 0\n"), None);
    }
}

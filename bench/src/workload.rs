//! Seeded, reproducible workloads: each simulated client produces OpenAI
//! chat request bodies turn after turn, with its think time between turns.
//!
//! - **agent-swarm**: developers driving coding agents. Every turn re-sends
//!   the whole conversation: one of a few large shared harness prompts
//!   (system prompt + tool definitions, skewed popularity), the
//!   repository's instructions, and a private history growing by a tool
//!   result (lognormal) and the agent's own output every turn; compaction to
//!   a short summary near the context limit; a new task now and then; tool
//!   pauses and occasional long human pauses.
//! - **shared-prefix**: `apps` system prompts of `prefix_kib` each, a fresh
//!   question per request from a pool per app (the inference-perf
//!   shared_prefix shape), no think time.
//! - **unique**: every prompt is new; routing cannot help (the control).
//! - **long-context**: shared-prefix traffic with a few prompts over 1 MB.
//!
//! A client's content and timing draws come from its own stream of the
//! seed, so every policy sees the same conversations. The salt goes into
//! every prompt's first bytes: two runs with different salts share no
//! cache.

use std::sync::Arc;

use serde::Serialize;
use serde_json::{json, Value};

use crate::conversation::filler;
use crate::rng::{zipf_weights, Rng};

/// Approximate bytes per token (as the simulated engine counts them).
pub const BYTES_PER_TOKEN: usize = 4;

/// Which workload, with its knobs.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Workload {
    AgentSwarm(AgentSwarm),
    SharedPrefix(SharedPrefix),
    Unique(Unique),
    LongContext(LongContext),
}

impl Workload {
    pub fn name(&self) -> &'static str {
        match self {
            Workload::AgentSwarm(_) => "agent-swarm",
            Workload::SharedPrefix(_) => "shared-prefix",
            Workload::Unique(_) => "unique",
            Workload::LongContext(_) => "long-context",
        }
    }
}

/// Coding agents (defaults shaped after published agent-swarm traffic:
/// prompts of 40k-120k tokens, over 90% of each turn already read before).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct AgentSwarm {
    /// Distinct harness prompts (system + tools).
    pub harnesses: usize,
    /// Size of each harness prompt, in bytes.
    pub harness_bytes: usize,
    /// Zipf exponent of harness popularity.
    pub harness_skew: f64,
    /// Distinct repositories (each with its own instructions).
    pub repos: usize,
    /// Median size of a repository's instructions, in bytes.
    pub repo_bytes: usize,
    /// Size of the user's task statement, in tokens.
    pub task_tokens: usize,
    /// Median tool result per turn, in tokens (lognormal).
    pub tool_result_median_tokens: f64,
    pub tool_result_sigma: f64,
    pub tool_result_max_tokens: usize,
    /// Output tokens of an ordinary turn.
    pub output_tokens: u32,
    /// Output tokens of a long turn, and the share of long turns.
    pub long_output_tokens: u32,
    pub long_output_share: f64,
    /// Median tool pause between turns, in seconds (lognormal).
    pub tool_pause_median_s: f64,
    pub tool_pause_sigma: f64,
    /// Share of pauses that are a human reading (median seconds).
    pub human_pause_share: f64,
    pub human_pause_median_s: f64,
    /// The conversation is compacted once its prompt passes this.
    pub compact_at_tokens: usize,
    /// Size of the summary that replaces the history.
    pub summary_tokens: usize,
    /// Per-turn chance the task is done and the next turn starts a new one.
    pub new_task_share: f64,
}

impl Default for AgentSwarm {
    fn default() -> Self {
        AgentSwarm {
            harnesses: 3,
            harness_bytes: 64 * 1024,
            harness_skew: 1.2,
            repos: 24,
            repo_bytes: 6 * 1024,
            task_tokens: 200,
            tool_result_median_tokens: 1500.0,
            tool_result_sigma: 0.8,
            tool_result_max_tokens: 16_000,
            output_tokens: 250,
            long_output_tokens: 1500,
            long_output_share: 0.1,
            tool_pause_median_s: 2.0,
            tool_pause_sigma: 0.6,
            human_pause_share: 0.03,
            human_pause_median_s: 30.0,
            compact_at_tokens: 110_000,
            summary_tokens: 2_000,
            new_task_share: 0.06,
        }
    }
}

/// Apps sharing a system prompt (inference-perf shared_prefix shape).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SharedPrefix {
    pub apps: usize,
    pub prefix_kib: usize,
    pub question_tokens: usize,
    pub output_tokens: u32,
    /// Distinct questions per app; requests draw from this pool.
    pub prompts_per_app: usize,
}

impl Default for SharedPrefix {
    fn default() -> Self {
        SharedPrefix {
            apps: 150,
            // 6,000 tokens of system prompt.
            prefix_kib: 24,
            question_tokens: 1200,
            output_tokens: 1000,
            prompts_per_app: 5,
        }
    }
}

/// Every prompt new: no routing can find a cache hit.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Unique {
    pub prompt_tokens: usize,
    pub output_tokens: u32,
}

impl Default for Unique {
    fn default() -> Self {
        Unique {
            prompt_tokens: 4000,
            output_tokens: 250,
        }
    }
}

/// Shared-prefix traffic with a few very long prompts among it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LongContext {
    pub base: SharedPrefix,
    /// Share of requests that carry a long document.
    pub long_share: f64,
    /// Size of a long document, in bytes (over 1 MB by default).
    pub long_bytes: usize,
}

impl Default for LongContext {
    fn default() -> Self {
        LongContext {
            base: SharedPrefix {
                apps: 16,
                ..SharedPrefix::default()
            },
            long_share: 0.02,
            long_bytes: 1_100_000,
        }
    }
}

/// One request a client sends.
#[derive(Clone, Debug)]
pub struct Turn {
    /// The `/v1/chat/completions` body.
    pub body: Vec<u8>,
    /// Session key (the `x-session-id` a ring-hash policy hashes; stay rate
    /// is counted per session).
    pub session: u64,
    /// First turn of its session (not counted for the stay rate).
    pub first_of_session: bool,
    /// The prompt does not extend the session's previous one (a first
    /// turn, a new task, a compaction, an independent request): staying
    /// on the session's replica saves at most its shared prefix.
    pub restart: bool,
    pub output_tokens: u32,
}

#[derive(Serialize)]
struct Body<'a> {
    model: &'a str,
    messages: &'a [Value],
    #[serde(skip_serializing_if = "Option::is_none")]
    tools: Option<&'a Value>,
    max_tokens: u32,
    temperature: f64,
    stream: bool,
}

fn body(model: &str, messages: &[Value], tools: Option<&Value>, max_tokens: u32) -> Vec<u8> {
    serde_json::to_vec(&Body {
        model,
        messages,
        tools,
        max_tokens,
        temperature: 0.2,
        stream: false,
    })
    .expect("a request body always serializes")
}

/// Text that is fresh for this run: the salt first, then seeded filler.
fn text(salt: u64, key: u64, bytes: usize) -> String {
    let head = format!("[{salt:x}/{key:x}] ");
    let rest = bytes.saturating_sub(head.len());
    head + &filler(key ^ salt.rotate_left(17), rest)
}

/// Content shared by every client of a run.
#[derive(Debug)]
struct Shared {
    model: String,
    salt: u64,
    /// Per harness: system prompt text and tool definitions.
    harnesses: Vec<(Arc<str>, Arc<Value>)>,
    harness_weights: Vec<f64>,
    repos: Vec<Arc<str>>,
    app_prompts: Vec<Arc<str>>,
}

fn tools_json(salt: u64, harness: usize, bytes: usize) -> Value {
    let per_tool = 1024;
    let n = (bytes / per_tool).max(1);
    Value::Array(
        (0..n)
            .map(|t| {
                json!({"type": "function", "function": {
                    "name": format!("tool_{t}"),
                    "description": text(salt, 0x7001_0000 + (harness as u64) * 1000 + t as u64, per_tool - 160),
                    "parameters": {"type": "object", "properties": {"arg": {"type": "string"}}}
                }})
            })
            .collect(),
    )
}

/// A run's workload: hands out one [`Client`] per simulated user.
#[derive(Clone, Debug)]
pub struct Generator {
    workload: Workload,
    seed: u64,
    shared: Arc<Shared>,
}

impl Generator {
    pub fn new(workload: Workload, model: &str, seed: u64, salt: u64) -> Self {
        let mut rng = Rng::derive(seed, 0x5EED);
        let mut shared = Shared {
            model: model.to_string(),
            salt,
            harnesses: Vec::new(),
            harness_weights: Vec::new(),
            repos: Vec::new(),
            app_prompts: Vec::new(),
        };
        match &workload {
            Workload::AgentSwarm(a) => {
                let tool_bytes = a.harness_bytes / 4;
                for h in 0..a.harnesses.max(1) {
                    let system = text(salt, 0x4A00 + h as u64, a.harness_bytes - tool_bytes);
                    shared
                        .harnesses
                        .push((system.into(), Arc::new(tools_json(salt, h, tool_bytes))));
                }
                shared.harness_weights = zipf_weights(a.harnesses.max(1), a.harness_skew);
                for r in 0..a.repos.max(1) {
                    let size = rng
                        .lognormal(a.repo_bytes as f64, 0.5)
                        .clamp(512.0, 65536.0);
                    shared
                        .repos
                        .push(text(salt, 0xE900_0000 + r as u64, size as usize).into());
                }
            }
            Workload::SharedPrefix(s) => shared.app_prompts = app_prompts(salt, s),
            Workload::LongContext(l) => shared.app_prompts = app_prompts(salt, &l.base),
            Workload::Unique(_) => {}
        }
        Generator {
            workload,
            seed,
            shared: Arc::new(shared),
        }
    }

    pub fn workload(&self) -> &Workload {
        &self.workload
    }

    /// Client number `index`; the same index always behaves the same.
    pub fn client(&self, index: u64) -> Client {
        let rng = Rng::derive(self.seed, 0xC11E_0000 + index);
        Client {
            index,
            rng,
            shared: Arc::clone(&self.shared),
            workload: self.workload.clone(),
            messages: Vec::new(),
            harness: 0,
            repo: 0,
            task: 0,
            turn: 0,
            session_turns: 0,
            prompt_tokens: 0,
            last_output: 0,
            requests: 0,
        }
    }
}

fn app_prompts(salt: u64, s: &SharedPrefix) -> Vec<Arc<str>> {
    (0..s.apps.max(1))
        .map(|a| text(salt, 0xA990_0000 + a as u64, s.prefix_kib * 1024).into())
        .collect()
}

/// One simulated user: call [`Client::next_turn`], send it, wait for the
/// answer, then wait [`Client::think_seconds`] before the next.
#[derive(Clone, Debug)]
pub struct Client {
    pub index: u64,
    rng: Rng,
    shared: Arc<Shared>,
    workload: Workload,
    messages: Vec<Value>,
    harness: usize,
    repo: usize,
    task: u64,
    turn: u64,
    session_turns: u64,
    /// Approximate prompt size of the current conversation, in tokens.
    prompt_tokens: usize,
    last_output: u32,
    requests: u64,
}

impl Client {
    /// The next request. For agents, the previous turn's output and tool
    /// result are appended first.
    pub fn next_turn(&mut self) -> Turn {
        self.requests += 1;
        match self.workload.clone() {
            Workload::AgentSwarm(a) => self.agent_turn(&a),
            Workload::SharedPrefix(s) => self.app_turn(&s, None),
            Workload::LongContext(l) => self.app_turn(&l.base, Some(&l)),
            Workload::Unique(u) => {
                let key = (self.index << 32) | self.requests;
                let messages = [json!({"role": "user",
                    "content": text(self.shared.salt, 0x0F1E_0000_0000_0000 ^ key, u.prompt_tokens * BYTES_PER_TOKEN)})];
                Turn {
                    body: body(&self.shared.model, &messages, None, u.output_tokens),
                    session: 0x0F1E_0000_0000_0000 ^ key,
                    first_of_session: true,
                    restart: true,
                    output_tokens: u.output_tokens,
                }
            }
        }
    }

    /// Seconds between receiving an answer and sending the next request.
    pub fn think_seconds(&mut self) -> f64 {
        match &self.workload {
            Workload::AgentSwarm(a) => {
                if self.rng.chance(a.human_pause_share) {
                    self.rng.lognormal(a.human_pause_median_s, 0.5).min(600.0)
                } else {
                    self.rng
                        .lognormal(a.tool_pause_median_s, a.tool_pause_sigma)
                        .min(60.0)
                }
            }
            _ => 0.0,
        }
    }

    fn start_task(&mut self, a: &AgentSwarm, summary: Option<String>) {
        let sh = Arc::clone(&self.shared);
        if summary.is_none() {
            self.task += 1;
            self.session_turns = 0;
            self.harness = self.rng.weighted(&sh.harness_weights);
            self.repo = self.rng.below(sh.repos.len());
        }
        let (system, _) = &sh.harnesses[self.harness];
        let repo = &sh.repos[self.repo];
        let task = text(
            sh.salt,
            (self.index << 40) ^ (self.task << 20) ^ 0x7A5C,
            a.task_tokens * BYTES_PER_TOKEN,
        );
        let mut user = format!("# Repository instructions\n{repo}\n# Task\n{task}");
        if let Some(s) = summary {
            user.push_str("\n# Summary of the work so far\n");
            user.push_str(&s);
        }
        self.prompt_tokens = (system.len() + a.harness_bytes / 4 + user.len()) / BYTES_PER_TOKEN;
        self.messages = vec![
            json!({"role": "system", "content": &**system}),
            json!({"role": "user", "content": user}),
        ];
    }

    fn agent_turn(&mut self, a: &AgentSwarm) -> Turn {
        let sh = Arc::clone(&self.shared);
        let key = (self.index << 40) ^ (self.task << 20) ^ self.turn;
        let mut restart = false;
        if self.messages.is_empty() || self.rng.chance(a.new_task_share) {
            self.start_task(a, None);
            restart = true;
        } else {
            // The previous turn's output (a tool call) and its result.
            let out = text(
                sh.salt,
                key ^ 0x0A,
                self.last_output as usize * BYTES_PER_TOKEN,
            );
            let id = format!("call_{}_{}_{}", self.index, self.task, self.turn);
            self.messages
                .push(json!({"role": "assistant", "content": out,
                "tool_calls": [{"id": id, "type": "function",
                    "function": {"name": "tool_0", "arguments": "{\"arg\":\"src/lib.rs\"}"}}]}));
            let result_tokens = (self
                .rng
                .lognormal(a.tool_result_median_tokens, a.tool_result_sigma)
                as usize)
                .clamp(16, a.tool_result_max_tokens);
            let result = text(sh.salt, key ^ 0x0B, result_tokens * BYTES_PER_TOKEN);
            self.messages
                .push(json!({"role": "tool", "tool_call_id": id, "content": result}));
            self.prompt_tokens += self.last_output as usize + result_tokens + 40;
            if self.prompt_tokens >= a.compact_at_tokens {
                let summary = text(sh.salt, key ^ 0x0C, a.summary_tokens * BYTES_PER_TOKEN);
                self.start_task(a, Some(summary));
                restart = true;
            }
        }
        self.turn += 1;
        self.session_turns += 1;
        let output = if self.rng.chance(a.long_output_share) {
            a.long_output_tokens
        } else {
            a.output_tokens
        };
        self.last_output = output;
        let tools = &sh.harnesses[self.harness].1;
        Turn {
            body: body(&sh.model, &self.messages, Some(tools), output),
            session: (self.index << 24) ^ self.task,
            first_of_session: self.session_turns == 1,
            restart,
            output_tokens: output,
        }
    }

    fn app_turn(&mut self, s: &SharedPrefix, long: Option<&LongContext>) -> Turn {
        let sh = Arc::clone(&self.shared);
        if let Some(l) = long.filter(|l| self.rng.chance(l.long_share)) {
            let key = 0x1086_0000_0000_0000 ^ (self.index << 32) ^ self.requests;
            let messages = [json!({"role": "user", "content": text(sh.salt, key, l.long_bytes)})];
            return Turn {
                body: body(&sh.model, &messages, None, s.output_tokens),
                session: key,
                first_of_session: true,
                restart: true,
                output_tokens: s.output_tokens,
            };
        }
        let app = self.rng.below(sh.app_prompts.len());
        let q = self.rng.below(s.prompts_per_app.max(1));
        let question = text(
            sh.salt,
            0x9E57_0000_0000 ^ ((app as u64) << 16) ^ q as u64,
            s.question_tokens * BYTES_PER_TOKEN,
        );
        let messages = [
            json!({"role": "system", "content": &*sh.app_prompts[app]}),
            json!({"role": "user", "content": question}),
        ];
        Turn {
            body: body(&sh.model, &messages, None, s.output_tokens),
            session: app as u64,
            first_of_session: false,
            restart: true,
            output_tokens: s.output_tokens,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt_bytes(t: &Turn) -> usize {
        crate::engine::request::parse(crate::engine::request::ApiKind::Chat, &t.body)
            .unwrap()
            .prompt
            .len()
    }

    #[test]
    fn same_seed_same_turns_other_salt_other_text() {
        let g = Generator::new(Workload::AgentSwarm(AgentSwarm::default()), "m", 7, 1);
        let mut a = g.client(3);
        let mut b = g.client(3);
        for _ in 0..5 {
            assert_eq!(a.next_turn().body, b.next_turn().body);
            assert_eq!(a.think_seconds(), b.think_seconds());
        }
        let other = Generator::new(Workload::AgentSwarm(AgentSwarm::default()), "m", 7, 2);
        assert_ne!(
            other.client(3).next_turn().body,
            g.client(3).next_turn().body
        );
    }

    #[test]
    fn agent_prompts_grow_by_extension_and_compact() {
        let spec = AgentSwarm {
            new_task_share: 0.0,
            compact_at_tokens: 40_000,
            ..AgentSwarm::default()
        };
        let g = Generator::new(Workload::AgentSwarm(spec), "m", 1, 1);
        let mut c = g.client(0);
        let first = c.next_turn();
        assert!(first.first_of_session);
        let first_len = prompt_bytes(&first);
        // Harness (64 KiB) + repo instructions + task.
        assert!(first_len > 64 * 1024, "{first_len}");
        let mut prev =
            crate::engine::request::parse(crate::engine::request::ApiKind::Chat, &first.body)
                .unwrap()
                .prompt;
        let mut compacted = false;
        for _ in 0..60 {
            let t = c.next_turn();
            assert_eq!(t.session, first.session, "compaction keeps the session");
            let p = crate::engine::request::parse(crate::engine::request::ApiKind::Chat, &t.body)
                .unwrap()
                .prompt;
            if p.len() < prev.len() {
                compacted = true;
                assert!(p.len() < 40_000 * BYTES_PER_TOKEN);
            } else {
                // Everything but the generation prompt is kept.
                let keep = prev.len() - b"<|assistant|>".len();
                assert_eq!(&p[..keep], &prev[..keep]);
            }
            prev = p;
        }
        assert!(compacted, "a 40k-token limit is reached within 60 turns");
    }

    #[test]
    fn agents_share_harnesses_with_skew_and_pause() {
        let g = Generator::new(Workload::AgentSwarm(AgentSwarm::default()), "m", 9, 9);
        let mut firsts = std::collections::HashMap::<Vec<u8>, usize>::new();
        for i in 0..60 {
            let t = g.client(i).next_turn();
            *firsts.entry(t.body[..2000].to_vec()).or_default() += 1;
        }
        let mut counts: Vec<usize> = firsts.values().copied().collect();
        counts.sort();
        assert_eq!(counts.len(), 3, "three harness prompts");
        assert!(counts[2] > counts[0], "skewed popularity: {counts:?}");
        let mut c = g.client(0);
        let pauses: Vec<f64> = (0..400).map(|_| c.think_seconds()).collect();
        let mut sorted = pauses.clone();
        sorted.sort_by(f64::total_cmp);
        assert!((1.5..2.7).contains(&sorted[200]), "median {}", sorted[200]);
        assert!(sorted[399] > 10.0, "some long human pauses");
    }

    #[test]
    fn shared_prefix_and_unique_shapes() {
        let g = Generator::new(Workload::SharedPrefix(SharedPrefix::default()), "m", 1, 1);
        let mut c = g.client(0);
        let t = c.next_turn();
        let len = prompt_bytes(&t);
        assert!((24 * 1024 + 4800..24 * 1024 + 5000).contains(&len), "{len}");
        assert!(t.session < 150);
        let u = Generator::new(Workload::Unique(Unique::default()), "m", 1, 1);
        let mut c = u.client(0);
        let (a, b) = (c.next_turn(), c.next_turn());
        assert_ne!(a.body[..100], b.body[..100]);
        assert_ne!(a.session, b.session);
        let l = Generator::new(
            Workload::LongContext(LongContext {
                long_share: 1.0,
                ..LongContext::default()
            }),
            "m",
            1,
            1,
        );
        assert!(prompt_bytes(&l.client(0).next_turn()) > 1_000_000);
    }
}

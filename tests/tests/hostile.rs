//! The hostile corpus (tests/hostile/corpus.json) through the real Envoy:
//! every request gets a sane answer, the wasm VM never fails, no load
//! leaks, and normal traffic still routes by cache afterwards.

use std::time::Duration;

use base64::Engine as _;
use hearth_e2e::{filler, reply_text, Conversation, Fleet, FleetOptions, MODEL};
use serde_json::{json, Value};

fn corpus() -> Vec<Value> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/hostile/corpus.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The request body of a corpus entry.
fn body_of(case: &Value) -> Vec<u8> {
    if let Some(text) = case["body"].as_str() {
        return text.as_bytes().to_vec();
    }
    if let Some(b64) = case["body_b64"].as_str() {
        return base64::engine::general_purpose::STANDARD
            .decode(b64)
            .unwrap();
    }
    let gen = &case["gen"];
    let n = |k: &str| gen[k].as_u64().unwrap() as usize;
    let open = r#"{"model":"hearth-sim","messages":[{"role":"user","content":"#;
    match gen["kind"].as_str().unwrap() {
        "nest" => format!("{open}{}{}}}]}}", "[".repeat(n("depth")), "]".repeat(n("depth"))).into_bytes(),
        "nest_tools" => format!(
            r#"{{"model":"hearth-sim","tools":{}{},"messages":[{{"role":"user","content":"hi"}}]}}"#,
            "[".repeat(n("depth")),
            "]".repeat(n("depth"))
        )
        .into_bytes(),
        "many_messages" => {
            let msgs = vec![json!({"role": "user", "content": "x"}); n("count")];
            serde_json::to_vec(&json!({"model": MODEL, "messages": msgs})).unwrap()
        }
        "long_message" => serde_json::to_vec(&json!({
            "model": MODEL,
            "messages": [{"role": "user", "content": "y".repeat(n("bytes"))}],
            "max_tokens": 1,
        }))
        .unwrap(),
        "long_model" => serde_json::to_vec(&json!({
            "model": "m".repeat(n("bytes")),
            "messages": [{"role": "user", "content": "hi"}],
        }))
        .unwrap(),
        other => panic!("unknown generator {other}"),
    }
}

#[tokio::test]
async fn every_hostile_request_gets_a_sane_answer_and_nothing_breaks() {
    let fleet = Fleet::start(FleetOptions {
        engines: 3,
        sidecar_flags: vec!["--probe-interval-seconds=0".into()],
        // Room for the multi-megabyte prompts below without evicting the
        // conversation the test resumes at the end.
        cache_capacity_tokens: 32_000_000,
        ..FleetOptions::default()
    })
    .await
    .unwrap();

    // A conversation before the storm.
    let mut conv = Conversation::new(MODEL, &filler(9, 8192), true, 4242);
    let first = fleet.chat(&conv.next_turn(4000, false)).await;
    let home = first.engine.clone().unwrap();
    conv.push_assistant(&reply_text(&first.body));

    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let cases = corpus();
    assert!(cases.len() >= 30);
    for case in &cases {
        let name = case["name"].as_str().unwrap();
        let method: reqwest::Method = case["method"].as_str().unwrap().parse().unwrap();
        let url = format!("{}{}", fleet.envoy.url(), case["path"].as_str().unwrap());
        let body = body_of(case);
        let mut req = client.request(method, &url);
        let mut has_content_type = false;
        for pair in case["headers"].as_array().into_iter().flatten() {
            let (k, v) = (pair[0].as_str().unwrap(), pair[1].as_str().unwrap());
            has_content_type |= k == "content-type";
            req = req.header(k, v);
        }
        if !has_content_type {
            req = req.header("content-type", "application/json");
        }
        req = if case["chunked"].as_bool() == Some(true) {
            let chunks: Vec<Result<Vec<u8>, std::io::Error>> =
                body.chunks(64 * 1024).map(|c| Ok(c.to_vec())).collect();
            req.body(reqwest::Body::wrap_stream(futures::stream::iter(chunks)))
        } else {
            req.body(body)
        };
        let resp = req
            .send()
            .await
            .unwrap_or_else(|e| panic!("{name}: no answer: {e}"));
        let status = resp.status().as_u16();
        let from_replica = resp.headers().contains_key("x-engine-id");
        let text = resp.text().await.unwrap_or_default();
        // Sane: a replica answered, or the gateway answered a JSON error.
        if !from_replica {
            assert!(status >= 400, "{name}: {status} without a replica");
            let v: Value = serde_json::from_str(&text).unwrap_or_else(|_| {
                panic!("{name}: gateway error {status} is not JSON: {text:.200}")
            });
            assert!(v["error"]["message"].is_string(), "{name}: {text:.200}");
        }
        assert_ne!(status, 0, "{name}");
        eprintln!(
            "{name}: {status}{}",
            if from_replica {
                " (replica)"
            } else {
                " (gateway)"
            }
        );
    }

    fleet.assert_wasm_healthy();
    let state = fleet.settle(Duration::from_secs(10)).await.unwrap();
    assert!(
        state.replicas.iter().all(|r| r.in_flight == 0),
        "load leaked: {state:?}"
    );
    // Nothing here was a replica's fault.
    assert!(
        state.replicas.iter().all(|r| r.health.fenced_total == 0),
        "{state:?}"
    );

    // The conversation resumes on its replica, from cache.
    let next = fleet.chat(&conv.next_turn(4000, false)).await;
    assert_eq!(next.engine.as_deref(), Some(home.as_str()));
    assert!(next.cached_tokens() > 0);
}

#[path = "../../wire/tests/shapes/mod.rs"]
mod shapes;

/// Bodies of the shapes that once cost the wasm filter many times their
/// size (its memory never shrinks: one 7 MiB body of tiny items kept
/// Envoy 635 MB larger), at 7 MiB each, twice each through the standard
/// gateway: Envoy ends a small multiple of one body larger, its workers
/// answer, and normal traffic still routes.
#[tokio::test]
async fn worst_shaped_bodies_cost_the_filter_a_small_multiple_of_their_size() {
    const SIZE: usize = 7 << 20;
    let fleet = Fleet::start(FleetOptions {
        // Not a model the replicas serve: the filter fingerprints each body
        // and the sidecar refuses it, so no engine (in this process) reads it.
        model_tag: true,
        ..FleetOptions::default()
    })
    .await
    .unwrap();
    let pid = fleet.envoy.pid().expect("Envoy's pid");
    let shapes: Vec<(&str, String)> = hearth_e2e::worst_shapes(SIZE, "not-served-here")
        .into_iter()
        .filter(|(name, _)| *name != "short_messages")
        .collect();
    // One ordinary request first, so both workers' VMs exist.
    let mut conv = Conversation::new(MODEL, "before the shapes", false, 78);
    let t = fleet
        .post_json("/v1/chat/completions", &conv.next_turn(2000, false))
        .await
        .unwrap();
    assert_eq!(t.status, 200, "{:?}", t.body);
    let baseline = hearth_e2e::rss_of(pid);
    let mut statuses = Vec::new();
    // The filter's own time fingerprinting each body, in Envoy's V8 (its
    // `hash_micros` counter), printed beside two plain bodies' of the same
    // size: an agent's conversation (many messages, tool calls; the
    // baseline of `scripts/shape-ratio`) and one long message (the
    // parser's fastest shape). What a worker spends, not asserted (timing
    // is noisy here).
    let hash_micros = || fleet.envoy.stat("wasmcustom.hearth_filter.hash_micros");
    let agent = String::from_utf8(shapes::agent_chat(SIZE, false))
        .unwrap()
        .replacen(r#""model":"hearth-sim""#, r#""model":"not-served-here""#, 1);
    let plain = [
        ("plain_chat", agent),
        (
            "one_long_message",
            hearth_e2e::plain_chat_body(SIZE, "not-served-here"),
        ),
    ];
    let mut times: Vec<(&str, u64)> = Vec::new();
    for round in 0..2 {
        for (name, body) in plain.iter().chain(&shapes) {
            let before = hash_micros().await.ok().flatten().unwrap_or(0);
            let t = fleet
                .post(
                    "/v1/chat/completions",
                    body.clone().into_bytes(),
                    &[("content-type", "application/json")],
                )
                .await
                .unwrap();
            let took = hash_micros().await.ok().flatten().unwrap_or(0) - before;
            match times.iter_mut().find(|(n, _)| n == name) {
                Some((_, best)) => *best = (*best).min(took),
                None => times.push((name, took)),
            }
            statuses.push((round, *name, t.status));
        }
    }
    let (agent_micros, long_micros) = (times[0].1.max(1) as f64, times[1].1.max(1) as f64);
    for (name, micros) in &times {
        eprintln!(
            "filter: {name}: {:.1} ms fingerprinting {} MiB, {:.2}x an agent's plain chat, \
             {:.2}x one long message",
            *micros as f64 / 1000.0,
            SIZE >> 20,
            *micros as f64 / agent_micros,
            *micros as f64 / long_micros
        );
    }
    let after = hearth_e2e::rss_of(pid);
    let grew = after.saturating_sub(baseline);
    eprintln!(
        "filter: {statuses:?}; Envoy RSS {:.0} MiB -> {:.0} MiB (+{:.0} MiB) after {} bodies of {} MiB",
        baseline as f64 / 1048576.0,
        after as f64 / 1048576.0,
        grew as f64 / 1048576.0,
        statuses.len(),
        SIZE >> 20
    );
    // Refused for its model by the sidecar; a body without a readable
    // prompt (messages of numbers) has no model to refuse, is routed on
    // load, and the engine refuses it (400).
    assert!(
        statuses
            .iter()
            .all(|&(_, name, s)| s == 404 || (name == "tiny_messages" && s == 400)),
        "{statuses:?}"
    );
    fleet.assert_wasm_healthy();
    let t = fleet
        .post_json("/v1/chat/completions", &conv.next_turn(2000, false))
        .await
        .unwrap();
    assert_eq!(t.status, 200, "{:?}", t.body);
    // Two workers, each holding at most the body it buffers and its
    // parse: three bodies each, at most.
    assert!(grew < 2 * 3 * SIZE as u64, "Envoy grew {} MiB", grew >> 20);
}

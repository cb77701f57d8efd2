//! Engine tests against a real listener on an ephemeral port.

use std::time::Duration;

use futures::StreamExt;
use serde_json::{json, Value};

use super::*;

async fn start(config: EngineConfig) -> EngineHandle {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind an ephemeral port");
    spawn(config, listener).await.expect("spawn engine")
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("client")
}

/// POST JSON, check the replica header, return the JSON body.
async fn post(engine: &EngineHandle, path: &str, body: &Value) -> Value {
    let res = client()
        .post(format!("{}{path}", engine.url()))
        .json(body)
        .send()
        .await
        .expect("send");
    assert!(
        res.headers().get(ENGINE_ID_HEADER).is_some(),
        "missing {ENGINE_ID_HEADER}"
    );
    res.json().await.expect("JSON body")
}

async fn post_status(engine: &EngineHandle, path: &str, body: Vec<u8>) -> (u16, String, Value) {
    let res = client()
        .post(format!("{}{path}", engine.url()))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .expect("send");
    let status = res.status().as_u16();
    let id = res
        .headers()
        .get(ENGINE_ID_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let value = res.json().await.expect("JSON body");
    (status, id, value)
}

fn cached_tokens(body: &Value) -> u64 {
    body["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("usage.prompt_tokens_details.cached_tokens")
}

/// Collect the `data:` payloads of an SSE body.
fn sse_events(text: &str) -> Vec<String> {
    text.split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .map(str::to_owned)
        .collect()
}

async fn wait_for(engine: &Engine, what: &str, ok: impl Fn(&EngineStats) -> bool) -> EngineStats {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let stats = engine.stats();
        if ok(&stats) {
            return stats;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}; stats: {stats:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// An engine run by the scheduler with `cost`.
fn scheduled(cost: core::CostModel) -> EngineConfig {
    EngineConfig {
        scheduler: Some(cost),
        ..EngineConfig::default()
    }
}

#[tokio::test]
async fn second_turn_of_a_conversation_hits_the_cache() {
    second_turn_hits_the_cache(EngineConfig::default()).await;
}

#[tokio::test]
async fn second_turn_hits_the_cache_under_the_scheduler() {
    second_turn_hits_the_cache(scheduled(core::CostModel::instant())).await;
}

async fn second_turn_hits_the_cache(config: EngineConfig) {
    let engine = start(config).await;
    let system = "You are a careful coding agent. ".repeat(40);
    let turn1 = json!({
        "model": "hearth-sim",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "Fix the failing test in src/lib.rs."}
        ],
        "max_tokens": 8,
    });
    let first = post(&engine, "/v1/chat/completions", &turn1).await;
    assert_eq!(cached_tokens(&first), 0);
    assert_eq!(first["object"], "chat.completion");
    assert_eq!(first["usage"]["completion_tokens"], 8);
    let answer = first["choices"][0]["message"]["content"]
        .as_str()
        .expect("assistant content")
        .to_owned();
    assert!(!answer.is_empty());

    let turn2 = json!({
        "model": "hearth-sim",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "Fix the failing test in src/lib.rs."},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "Now run the tests again."}
        ],
        "max_tokens": 8,
    });
    let second = post(&engine, "/v1/chat/completions", &turn2).await;
    let prompt1 = first["usage"]["prompt_tokens"].as_u64().unwrap();
    let cached = cached_tokens(&second);
    // Every full block of turn 1 is reused (the generation prompt included).
    assert_eq!(cached, prompt1 / 16 * 16);
    assert!(cached > 0);

    let stats = engine.engine.stats();
    assert_eq!(stats.requests_total, 2);
    assert_eq!(stats.completed_total, 2);
    assert_eq!(stats.running, 0);
    assert_eq!(stats.cached_tokens_total, cached);
    engine.shutdown().await;
}

#[tokio::test]
async fn streaming_chat_ends_with_usage_and_done() {
    streaming_chat(EngineConfig::default()).await;
}

#[tokio::test]
async fn streaming_chat_under_the_scheduler_ends_with_usage_and_done() {
    streaming_chat(scheduled(core::CostModel::instant())).await;
}

async fn streaming_chat(config: EngineConfig) {
    let engine = start(config).await;
    let body = json!({
        "messages": [{"role": "user", "content": "hello ".repeat(50)}],
        "stream": true,
        "max_tokens": 5,
    });
    let res = client()
        .post(format!("{}/v1/chat/completions", engine.url()))
        .json(&body)
        .send()
        .await
        .expect("send");
    assert_eq!(res.status(), 200);
    assert_eq!(res.headers()["content-type"], "text/event-stream");
    assert_eq!(res.headers()[ENGINE_ID_HEADER], "engine-0");
    let text = res.text().await.expect("body");
    let events = sse_events(&text);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).expect("chunk JSON"))
        .collect();
    assert!(chunks
        .iter()
        .all(|c| c["object"] == "chat.completion.chunk"));
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let content: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(content.split_whitespace().count(), 5);
    let finish = &chunks[chunks.len() - 2];
    assert_eq!(finish["choices"][0]["finish_reason"], "length");
    let usage = &chunks[chunks.len() - 1];
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 5);
    assert_eq!(cached_tokens(usage), 0);
    wait_for(&engine.engine, "completion", |s| s.completed_total == 1).await;
    engine.shutdown().await;
}

#[tokio::test]
async fn a_reasoning_engine_reasons_before_it_answers() {
    reasoning(EngineConfig::default()).await;
}

#[tokio::test]
async fn a_reasoning_engine_reasons_before_it_answers_under_the_scheduler() {
    reasoning(scheduled(core::CostModel::instant())).await;
}

async fn reasoning(config: EngineConfig) {
    let engine = start(EngineConfig {
        reasoning_tokens: 3,
        ..config
    })
    .await;
    let ask = |max_tokens: usize, stream: bool| {
        json!({
            "messages": [{"role": "user", "content": "why?"}],
            "max_tokens": max_tokens,
            "stream": stream,
        })
    };
    let r = post(&engine, "/v1/chat/completions", &ask(5, false)).await;
    let message = &r["choices"][0]["message"];
    assert_eq!(
        message["reasoning_content"]
            .as_str()
            .unwrap()
            .split_whitespace()
            .count(),
        3
    );
    assert_eq!(
        message["content"]
            .as_str()
            .unwrap()
            .split_whitespace()
            .count(),
        2
    );
    // One token: all reasoning, no visible text, one token generated.
    let r = post(&engine, "/v1/chat/completions", &ask(1, false)).await;
    assert_eq!(r["choices"][0]["message"]["content"], "");
    assert_eq!(r["usage"]["completion_tokens"], 1);
    assert_eq!(r["choices"][0]["finish_reason"], "length");
    // Streamed: reasoning deltas first, then content.
    let text = client()
        .post(format!("{}/v1/chat/completions", engine.url()))
        .json(&ask(5, true))
        .send()
        .await
        .expect("send")
        .text()
        .await
        .expect("body");
    let fields: Vec<String> = sse_events(&text)
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter_map(|c| {
            let delta = c["choices"][0]["delta"].as_object()?.clone();
            delta
                .into_iter()
                .find(|(k, v)| k != "role" && v.as_str().is_some_and(|s| !s.is_empty()))
                .map(|(k, _)| k)
        })
        .collect();
    let expected = [
        "reasoning_content",
        "reasoning_content",
        "reasoning_content",
        "content",
        "content",
    ];
    assert_eq!(fields, expected);
    // Completions have no reasoning.
    let r = post(
        &engine,
        "/v1/completions",
        &json!({"prompt": "x", "max_tokens": 2}),
    )
    .await;
    assert_eq!(
        r["choices"][0]["text"]
            .as_str()
            .unwrap()
            .split_whitespace()
            .count(),
        2
    );
    engine.shutdown().await;
}

#[tokio::test]
async fn an_engine_with_a_key_refuses_requests_without_it() {
    let engine = start(EngineConfig {
        api_key: Some("s3cret".into()),
        ..EngineConfig::default()
    })
    .await;
    let body = json!({"prompt": "x", "max_tokens": 1});
    let url = |p: &str| format!("{}{p}", engine.url());
    let without = client()
        .post(url("/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(without.status(), 401);
    let wrong = client()
        .get(url("/metrics"))
        .bearer_auth("nope")
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), 401);
    let with = client()
        .post(url("/v1/completions"))
        .bearer_auth("s3cret")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(with.status(), 200);
    assert_eq!(
        client().get(url("/health")).send().await.unwrap().status(),
        200
    );
    engine.shutdown().await;
}

#[tokio::test]
async fn streaming_completions_send_text_chunks() {
    streaming_completions(EngineConfig::default()).await;
}

#[tokio::test]
async fn streaming_completions_under_the_scheduler_send_text_chunks() {
    streaming_completions(scheduled(core::CostModel::instant())).await;
}

async fn streaming_completions(config: EngineConfig) {
    let engine = start(config).await;
    let body = json!({"prompt": "x".repeat(200), "stream": true});
    let res = client()
        .post(format!("{}/v1/completions", engine.url()))
        .json(&body)
        .send()
        .await
        .expect("send");
    let events = sse_events(&res.text().await.expect("body"));
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).expect("chunk JSON"))
        .collect();
    assert!(chunks.iter().all(|c| c["object"] == "text_completion"));
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"].get(0)?["text"].as_str())
        .collect();
    // No max_tokens: the default output length, finishing with "stop".
    assert_eq!(text.split_whitespace().count(), 16);
    assert_eq!(
        chunks[chunks.len() - 2]["choices"][0]["finish_reason"],
        "stop"
    );
    assert_eq!(chunks[chunks.len() - 1]["usage"]["prompt_tokens"], 50);
    engine.shutdown().await;
}

#[tokio::test]
async fn client_dropping_a_stream_counts_as_aborted() {
    dropped_stream(EngineConfig {
        decode_micros_per_token: 5_000.0,
        ..EngineConfig::default()
    })
    .await;
}

#[tokio::test]
async fn client_dropping_a_stream_cancels_it_in_the_scheduler() {
    dropped_stream(scheduled(core::CostModel {
        step_base_us: 5_000.0,
        ..core::CostModel::instant()
    }))
    .await;
}

async fn dropped_stream(config: EngineConfig) {
    let engine = start(config).await;
    let body = json!({"prompt": "abort me", "stream": true, "max_tokens": 200});
    let res = client()
        .post(format!("{}/v1/completions", engine.url()))
        .json(&body)
        .send()
        .await
        .expect("send");
    let mut stream = res.bytes_stream();
    let mut received = 0;
    while received < 3 {
        stream
            .next()
            .await
            .expect("stream ended early")
            .expect("chunk");
        received += 1;
    }
    assert_eq!(engine.engine.stats().running, 1);
    drop(stream);
    let stats = wait_for(&engine.engine, "the abort", |s| s.running == 0).await;
    assert_eq!(stats.aborted_total, 1);
    assert_eq!(stats.completed_total, 0);
    engine.shutdown().await;
}

#[tokio::test]
async fn client_leaving_a_non_streaming_request_counts_as_aborted() {
    let engine = start(EngineConfig {
        decode_micros_per_token: 10_000.0,
        ..EngineConfig::default()
    })
    .await;
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(200))
        .build()
        .expect("client");
    let body = json!({"prompt": "slow", "max_tokens": 1000});
    let res = impatient
        .post(format!("{}/v1/completions", engine.url()))
        .json(&body)
        .send()
        .await;
    assert!(res.is_err(), "a 10 s response arrived within 200 ms");
    let stats = wait_for(&engine.engine, "the abort", |s| s.running == 0).await;
    assert_eq!(stats.aborted_total, 1);
    assert_eq!(stats.completed_total, 0);
    engine.shutdown().await;
}

#[tokio::test]
async fn tiny_cache_evicts_least_recently_used_prefixes() {
    // 4 blocks of 16 tokens × 4 bytes = 256 prompt bytes.
    let engine = start(EngineConfig {
        cache_capacity_tokens: 64,
        ..EngineConfig::default()
    })
    .await;
    let a = json!({"prompt": "a".repeat(256), "max_tokens": 1});
    let b = json!({"prompt": "b".repeat(256), "max_tokens": 1});
    let r = post(&engine, "/v1/completions", &a).await;
    assert_eq!(cached_tokens(&r), 0);
    let r = post(&engine, "/v1/completions", &a).await;
    assert_eq!(cached_tokens(&r), 64);
    // B fills the cache and evicts all of A.
    let r = post(&engine, "/v1/completions", &b).await;
    assert_eq!(cached_tokens(&r), 0);
    let r = post(&engine, "/v1/completions", &a).await;
    assert_eq!(cached_tokens(&r), 0);
    // A two-block prompt evicts the two tail blocks of A; A's head stays warm.
    let c = json!({"prompt": "c".repeat(128), "max_tokens": 1});
    let r = post(&engine, "/v1/completions", &c).await;
    assert_eq!(cached_tokens(&r), 0);
    let r = post(&engine, "/v1/completions", &a).await;
    assert_eq!(cached_tokens(&r), 32);
    let stats = engine.engine.stats();
    assert_eq!(stats.cache_blocks, 4);
    assert_eq!(stats.cache_capacity_blocks, 4);
    engine.shutdown().await;
}

#[tokio::test]
async fn bad_requests_get_openai_errors() {
    let engine = start(EngineConfig::default()).await;
    let (status, id, body) = post_status(&engine, "/v1/chat/completions", b"{nope".to_vec()).await;
    assert_eq!(status, 400);
    assert_eq!(id, "engine-0");
    assert_eq!(body["error"]["type"], "invalid_request_error");
    assert!(body["error"]["message"].is_string());
    assert_eq!(body["error"]["code"], Value::Null);

    let (status, _, body) = post_status(
        &engine,
        "/v1/chat/completions",
        br#"{"messages": 3}"#.to_vec(),
    )
    .await;
    assert_eq!(status, 400);
    assert_eq!(body["error"]["type"], "invalid_request_error");

    let (status, id, body) = post_status(&engine, "/v1/nothing", b"{}".to_vec()).await;
    assert_eq!(status, 404);
    assert_eq!(id, "engine-0");
    assert!(body["error"]["message"].is_string());

    // Nothing was admitted.
    assert_eq!(engine.engine.stats().requests_total, 0);
    engine.shutdown().await;
}

#[tokio::test]
async fn large_bodies_are_accepted() {
    let engine = start(EngineConfig::default()).await;
    let body = json!({"prompt": "z".repeat(2 * 1024 * 1024), "max_tokens": 1});
    let (status, _, value) =
        post_status(&engine, "/v1/completions", body.to_string().into_bytes()).await;
    assert_eq!(status, 200);
    assert_eq!(value["usage"]["prompt_tokens"], 512 * 1024);
    engine.shutdown().await;
}

#[tokio::test]
async fn oversized_bodies_get_413() {
    let engine = start(EngineConfig::default()).await;
    let body = vec![b' '; MAX_BODY_BYTES + 1];
    let (status, id, value) = post_status(&engine, "/v1/completions", body).await;
    assert_eq!(status, 413);
    assert_eq!(id, "engine-0");
    assert_eq!(value["error"]["type"], "invalid_request_error");
    engine.shutdown().await;
}

#[tokio::test]
async fn models_health_stats_and_metrics() {
    let engine = start(EngineConfig {
        id: "engine-7".to_owned(),
        model: "m-test".to_owned(),
        ..EngineConfig::default()
    })
    .await;
    let c = client();
    let res = c
        .get(format!("{}/health", engine.url()))
        .send()
        .await
        .expect("health");
    assert_eq!(res.status(), 200);
    assert_eq!(res.headers()[ENGINE_ID_HEADER], "engine-7");
    assert_eq!(res.text().await.unwrap(), "ok");

    let models: Value = c
        .get(format!("{}/v1/models", engine.url()))
        .send()
        .await
        .expect("models")
        .json()
        .await
        .expect("models JSON");
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], "m-test");

    let stats: EngineStats = c
        .get(format!("{}/stats", engine.url()))
        .send()
        .await
        .expect("stats")
        .json()
        .await
        .expect("stats JSON");
    assert_eq!(stats, engine.engine.stats());
    assert_eq!(stats.id, "engine-7");

    let metrics = c
        .get(format!("{}/metrics", engine.url()))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .unwrap();
    assert!(metrics.contains("vllm:num_requests_running{model_name=\"m-test\"} 0"));
    assert!(metrics.contains("vllm:prefix_cache_hits_total"));
    engine.shutdown().await;
}

#[tokio::test]
async fn prefill_and_decode_delays_follow_the_cost_model() {
    // 1000 engine µs per uncached token at 10× speed: 400 tokens ≈ 40 ms.
    let engine = start(EngineConfig {
        prefill_micros_per_token: 1_000.0,
        decode_micros_per_token: 10_000.0,
        time_scale: 10.0,
        ..EngineConfig::default()
    })
    .await;
    let body = json!({"prompt": "p".repeat(1600), "max_tokens": 4});
    let t0 = std::time::Instant::now();
    let r = post(&engine, "/v1/completions", &body).await;
    let cold = t0.elapsed();
    assert_eq!(cached_tokens(&r), 0);
    assert!(cold >= Duration::from_millis(40 + 4), "cold took {cold:?}");
    let r = post(&engine, "/v1/completions", &body).await;
    assert_eq!(cached_tokens(&r), 1600 / 4);
    // Nothing else to assert on timing: numbers come from benchmarks.
    engine.shutdown().await;
}

#[test]
fn bad_config_is_refused() {
    let bad = [
        EngineConfig {
            block_tokens: 0,
            ..EngineConfig::default()
        },
        EngineConfig {
            bytes_per_token: 0,
            ..EngineConfig::default()
        },
        EngineConfig {
            time_scale: 0.0,
            ..EngineConfig::default()
        },
        EngineConfig {
            prefill_micros_per_token: f64::NAN,
            ..EngineConfig::default()
        },
        EngineConfig {
            id: "bad\nid".to_owned(),
            ..EngineConfig::default()
        },
        scheduled(core::CostModel {
            max_running: 0,
            ..core::CostModel::default()
        }),
    ];
    for config in bad {
        assert!(Engine::new(config.clone()).is_err(), "{config:?} accepted");
    }
    assert!(EngineConfig::default().validate().is_ok());
}

#[tokio::test]
async fn the_scheduler_queues_beyond_max_running_and_reports_it() {
    let engine = start(scheduled(core::CostModel {
        max_running: 1,
        step_base_us: 5_000.0,
        ..core::CostModel::instant()
    }))
    .await;
    let body = json!({"prompt": "queue me", "stream": true, "max_tokens": 400});
    let mut streams = Vec::new();
    for _ in 0..2 {
        let res = client()
            .post(format!("{}/v1/completions", engine.url()))
            .json(&body)
            .send()
            .await
            .expect("send");
        streams.push(res.bytes_stream());
    }
    let metrics = || async {
        client()
            .get(format!("{}/metrics", engine.url()))
            .send()
            .await
            .expect("metrics")
            .text()
            .await
            .expect("metrics text")
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let m = metrics().await;
        if m.contains("vllm:num_requests_waiting{model_name=\"hearth-sim\"} 1")
            && m.contains("vllm:num_requests_running{model_name=\"hearth-sim\"} 1")
        {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "never one running and one waiting:\n{m}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(streams);
    let stats = wait_for(&engine.engine, "both cancelled", |s| s.running == 0).await;
    assert_eq!(stats.aborted_total, 2);
    assert!(metrics()
        .await
        .contains("vllm:num_requests_waiting{model_name=\"hearth-sim\"} 0"));
    engine.shutdown().await;
}

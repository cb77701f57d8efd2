//! Injected faults: the simulated engine misbehaves the way real ones do,
//! while `/health` and `/v1/models` keep answering.

use std::time::Duration;

use hearth_bench::engine::{self, EngineConfig, Fault};
use serde_json::{json, Value};

async fn start(fault: Fault) -> engine::EngineHandle {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    engine::spawn(
        EngineConfig {
            fault,
            ..EngineConfig::default()
        },
        listener,
    )
    .await
    .unwrap()
}

fn chat() -> Value {
    json!({"model": "hearth-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
}

async fn post(client: &reqwest::Client, url: &str) -> reqwest::Result<reqwest::Response> {
    client
        .post(format!("{url}/v1/chat/completions"))
        .json(&chat())
        .timeout(Duration::from_millis(500))
        .send()
        .await
}

#[tokio::test]
async fn a_stalled_engine_still_looks_healthy_but_never_answers() {
    let e = start(Fault::Stall).await;
    let client = reqwest::Client::new();
    let err = post(&client, &e.url()).await.unwrap_err();
    assert!(err.is_timeout(), "{err}");
    for path in ["/health", "/v1/models"] {
        let r = client
            .get(format!("{}{path}", e.url()))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{path}");
    }
}

#[tokio::test]
async fn empty_answers_are_http_200_without_text() {
    let e = start(Fault::Empty).await;
    let client = reqwest::Client::new();
    let r = post(&client, &e.url()).await.unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "");
    assert_eq!(v["usage"]["completion_tokens"], 0);
}

#[tokio::test]
async fn errors_and_run_time_switching() {
    let e = start(Fault::ServerError).await;
    let client = reqwest::Client::new();
    let r = post(&client, &e.url()).await.unwrap();
    assert_eq!(r.status(), 500);
    let v: Value = r.json().await.unwrap();
    assert!(v["error"]["message"].is_string());

    let set = |f: &str| {
        client
            .put(format!("{}/admin/fault", e.url()))
            .json(&json!({ "fault": f }))
            .send()
    };
    assert_eq!(set("unavailable").await.unwrap().status(), 200);
    assert_eq!(post(&client, &e.url()).await.unwrap().status(), 503);
    assert_eq!(set("none").await.unwrap().status(), 200);
    let r = post(&client, &e.url()).await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(e.engine.fault(), Fault::None);
    assert_eq!(set("sometimes").await.unwrap().status(), 400);
}

//! The active probe against a stand-in engine: what it sends (key, rank
//! header, the fixed raw prompt), and how it judges what comes back.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{get, post};
use axum::{Json, Router};
use hearth_ext_proc::feeds::engines::EngineClient;
use hearth_ext_proc::feeds::probe::{probe_once, PROBE_PROMPT};
use hearth_router::health::{Failure, Outcome};
use serde_json::{json, Value};

/// What the stand-in engine does, and what it saw.
#[derive(Default)]
struct Engine {
    /// Answer `/v1/completions` with 404 (a chat-only server).
    no_completions: bool,
    /// Require this bearer key.
    key: Option<String>,
    /// The answer to a generation.
    answer: Value,
    /// (path, authorization, rank header, body) of each request.
    seen: Vec<(String, Option<String>, Option<String>, Value)>,
}

type Shared = Arc<Mutex<Engine>>;

fn header(h: &HeaderMap, name: &str) -> Option<String> {
    h.get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

fn authorized(e: &Engine, h: &HeaderMap) -> bool {
    e.key
        .as_ref()
        .is_none_or(|k| header(h, "authorization") == Some(format!("Bearer {k}")))
}

async fn generate(
    path: &'static str,
    State(engine): State<Shared>,
    h: HeaderMap,
    Json(body): Json<Value>,
) -> (StatusCode, Json<Value>) {
    let mut e = engine.lock().unwrap();
    e.seen.push((
        path.to_string(),
        header(&h, "authorization"),
        header(&h, "x-data-parallel-rank"),
        body,
    ));
    if !authorized(&e, &h) {
        return (StatusCode::UNAUTHORIZED, Json(json!({"error": "key"})));
    }
    if path == "/v1/completions" && e.no_completions {
        return (StatusCode::NOT_FOUND, Json(json!({"error": "no"})));
    }
    (StatusCode::OK, Json(e.answer.clone()))
}

async fn start(engine: Engine) -> (String, Shared) {
    let shared = Arc::new(Mutex::new(engine));
    let app = Router::new()
        .route(
            "/v1/models",
            get(|State(e): State<Shared>, h: HeaderMap| async move {
                if !authorized(&e.lock().unwrap(), &h) {
                    return (StatusCode::UNAUTHORIZED, Json(json!({})));
                }
                (StatusCode::OK, Json(json!({"data": [{"id": "m"}]})))
            }),
        )
        .route(
            "/v1/completions",
            post(|s, h, b| generate("/v1/completions", s, h, b)),
        )
        .route(
            "/v1/chat/completions",
            post(|s, h, b| generate("/v1/chat/completions", s, h, b)),
        )
        .with_state(Arc::clone(&shared));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}"), shared)
}

const T: Duration = Duration::from_secs(5);

fn key() -> Option<hearth_ext_proc::config::Secret> {
    Some("k-1".parse().unwrap())
}

#[tokio::test]
async fn the_probe_asks_for_one_token_of_its_raw_prompt_with_the_key_and_the_rank() {
    let (base, engine) = start(Engine {
        key: Some("k-1".into()),
        answer: json!({"choices": [{"text": " yes", "finish_reason": "length"}]}),
        ..Engine::default()
    })
    .await;
    let client = EngineClient::new(key());
    assert_eq!(
        probe_once(&client, &base, None, Some(3), T).await,
        Outcome::Success
    );
    let seen = &engine.lock().unwrap().seen;
    assert_eq!(seen.len(), 1);
    let (path, auth, rank, body) = &seen[0];
    assert_eq!(path, "/v1/completions");
    assert_eq!(auth.as_deref(), Some("Bearer k-1"));
    assert_eq!(rank.as_deref(), Some("3"));
    assert_eq!(body["prompt"], PROBE_PROMPT);
    assert_eq!(body["max_tokens"], 1);
    assert_eq!(body["model"], "m", "the model /v1/models lists");
}

#[tokio::test]
async fn a_refused_key_is_reported_as_such_not_as_a_failure() {
    let (base, _) = start(Engine {
        key: Some("k-1".into()),
        ..Engine::default()
    })
    .await;
    let none = EngineClient::new(None);
    assert_eq!(
        probe_once(&none, &base, None, None, T).await,
        Outcome::Unauthorized(401)
    );
    // Even when the model is known (no listing needed), the generation's
    // refusal is reported the same way.
    assert_eq!(
        probe_once(&none, &base, Some("m"), None, T).await,
        Outcome::Unauthorized(401)
    );
}

#[tokio::test]
async fn a_chat_only_engine_is_probed_with_a_chat_completion() {
    let (base, engine) = start(Engine {
        no_completions: true,
        // A reasoning model's one token: no visible content.
        answer: json!({
            "choices": [{"message": {"content": "", "reasoning_content": "Hm"}, "finish_reason": "length"}],
            "usage": {"completion_tokens": 1}
        }),
        ..Engine::default()
    })
    .await;
    let client = EngineClient::new(None);
    assert_eq!(
        probe_once(&client, &base, Some("m"), None, T).await,
        Outcome::Success
    );
    let paths: Vec<String> = engine
        .lock()
        .unwrap()
        .seen
        .iter()
        .map(|s| s.0.clone())
        .collect();
    assert_eq!(paths, ["/v1/completions", "/v1/chat/completions"]);
    assert_eq!(
        engine.lock().unwrap().seen[1].3["messages"][0]["content"],
        PROBE_PROMPT
    );
}

#[tokio::test]
async fn an_answer_with_nothing_generated_fails() {
    let (base, _) = start(Engine {
        answer: json!({
            "choices": [{"text": "", "finish_reason": "stop"}],
            "usage": {"completion_tokens": 0}
        }),
        ..Engine::default()
    })
    .await;
    let client = EngineClient::new(None);
    assert_eq!(
        probe_once(&client, &base, None, None, T).await,
        Outcome::Failure(Failure::EmptyAnswer)
    );
}

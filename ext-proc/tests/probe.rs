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
        .route(
            "/metrics",
            get(|State(e): State<Shared>, h: HeaderMap| async move {
                let mut e = e.lock().unwrap();
                e.seen.push((
                    "/metrics".into(),
                    header(&h, "authorization"),
                    None,
                    Value::Null,
                ));
                if !authorized(&e, &h) {
                    return (StatusCode::UNAUTHORIZED, String::new());
                }
                let text = "vllm:num_requests_waiting 3\nvllm:num_requests_running 1\n";
                (StatusCode::OK, text.to_string())
            }),
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
    let client = EngineClient::new(key(), None).unwrap();
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
    let none = EngineClient::new(None, None).unwrap();
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
    let client = EngineClient::new(None, None).unwrap();
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
    let client = EngineClient::new(None, None).unwrap();
    assert_eq!(
        probe_once(&client, &base, None, None, T).await,
        Outcome::Failure(Failure::EmptyAnswer)
    );
}

/// A private CA and a certificate it signed for 127.0.0.1: (CA PEM, TLS
/// acceptor presenting the certificate, and one presenting a certificate
/// the same CA signed for another address).
fn private_ca() -> (String, tokio_rustls::TlsAcceptor, tokio_rustls::TlsAcceptor) {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
    use tokio_rustls::rustls;
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(DnType::CommonName, "hearth test engines CA");
    let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate().unwrap()).unwrap();
    let acceptor = |name: &str| {
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(vec![name.to_string()])
            .unwrap()
            .signed_by(&key, &ca)
            .unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(
                vec![cert.der().clone()],
                rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
            )
            .unwrap();
        tokio_rustls::TlsAcceptor::from(Arc::new(config))
    };
    (ca.pem(), acceptor("127.0.0.1"), acceptor("10.0.0.1"))
}

/// A TLS front for the plain stand-in engine at `plain`: `https://` base.
async fn behind_tls(plain: &str, acceptor: tokio_rustls::TlsAcceptor) -> String {
    let backend: std::net::SocketAddr = plain.trim_start_matches("http://").parse().unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                // A client that does not trust the certificate ends here,
                // before any request (or key) is sent.
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let Ok(mut inner) = tokio::net::TcpStream::connect(backend).await else {
                    return;
                };
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut inner).await;
            });
        }
    });
    format!("https://{addr}")
}

#[tokio::test]
async fn probes_and_scrapes_reach_an_https_engine_with_a_private_ca() {
    let (plain, engine) = start(Engine {
        key: Some("k-1".into()),
        answer: json!({"choices": [{"text": " yes", "finish_reason": "length"}]}),
        ..Engine::default()
    })
    .await;
    let (ca_pem, acceptor, misnamed) = private_ca();
    let base = behind_tls(&plain, acceptor).await;

    // The probe, over TLS, with the key.
    let client = EngineClient::new(key(), Some(ca_pem.as_bytes())).unwrap();
    assert_eq!(
        probe_once(&client, &base, None, None, T).await,
        Outcome::Success
    );

    // The metrics scrape of a replica written https://: its figures come.
    let spec: hearth_router::UpstreamSpec = base.parse().unwrap();
    assert!(spec.tls);
    let router = hearth_router::Router::new(hearth_router::RouterParams::default(), &[spec]);
    let scrape = tokio::spawn(hearth_ext_proc::feeds::signals::run(
        Arc::clone(&router),
        client.clone(),
        Duration::from_millis(100),
    ));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let engine_figures = loop {
        let snap = router.snapshot();
        if let Some(e) = snap.replicas[0].engine.clone() {
            break e;
        }
        assert!(tokio::time::Instant::now() < deadline, "no scrape came");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    scrape.abort();
    assert_eq!(engine_figures.waiting, 3.0);
    let seen = engine.lock().unwrap().seen.clone();
    assert!(seen.iter().any(|(p, ..)| p == "/metrics"));
    for (path, auth, ..) in &seen {
        assert_eq!(auth.as_deref(), Some("Bearer k-1"), "{path}");
    }

    // Without the private CA (the system's roots), the engine is not
    // trusted: the probe fails to connect and the key is never sent.
    let before = engine.lock().unwrap().seen.len();
    let untrusting = EngineClient::new(key(), None).unwrap();
    assert_eq!(
        probe_once(&untrusting, &base, None, None, T).await,
        Outcome::Failure(Failure::ConnectFailure)
    );
    assert_eq!(engine.lock().unwrap().seen.len(), before);

    // Nor is one whose certificate, from the same CA, names another
    // address than the one the engine is listed at.
    let elsewhere = behind_tls(&plain, misnamed).await;
    assert_eq!(
        probe_once(&client, &elsewhere, None, None, T).await,
        Outcome::Failure(Failure::ConnectFailure)
    );
    assert_eq!(engine.lock().unwrap().seen.len(), before);
}

//! The control surfaces through the real Envoy, with the control token
//! every fleet of these tests runs with (`FleetOptions::control_token`):
//! forged outcome reports (and first-chunk reports) get 401 and change
//! nothing (without a token,
//! a report that names no waiting decision by its ticket gets 404 and
//! changes nothing), while the outcome
//! filter's own reports (which carry the token) still fence a replica
//! that answers with nothing; `/debug/decisions` shows request ids only
//! with the token; and a client's `Authorization` reaches the engine but
//! never the sidecar (a recording ext_proc server in its place sees every
//! header Envoy forwards).

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request::Request as In, processing_response::Response as Out, BodyResponse,
    HeadersResponse, ProcessingRequest, ProcessingResponse, TrailersResponse,
};
use hearth_bench::engine::Fault;
use hearth_e2e::{Conversation, Fleet, FleetOptions, MODEL};
use hearth_ext_proc::envoy::headers;
use hearth_ext_proc::envoy::render::{render, render_body, Gateway};
use hearth_router::HealthState;
use serde_json::Value;
use tokio_stream::wrappers::ReceiverStream;

/// POSTs an outcome report to the sidecar with `authorization`, if any.
async fn post_outcome(fleet: &Fleet, body: &str, authorization: Option<&str>) -> (u16, String) {
    post_to(fleet, "/outcome", body, authorization).await
}

/// POSTs `body` to the sidecar's admin `path` with `authorization`.
async fn post_to(
    fleet: &Fleet,
    path: &str,
    body: &str,
    authorization: Option<&str>,
) -> (u16, String) {
    let mut req = fleet
        .client
        .post(format!("http://{}{path}", fleet.settings.admin_listen))
        .header("content-type", "text/plain")
        .body(body.to_string());
    if let Some(value) = authorization {
        req = req.header("authorization", value);
    }
    let r = req.send().await.unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

/// What a forged report could change: each replica's health and usage,
/// and the usage counters in `/metrics`.
async fn observable(fleet: &Fleet) -> (Vec<Value>, Vec<String>) {
    let state = fleet.state().await.unwrap();
    let replicas = state
        .replicas
        .iter()
        .map(|r| {
            serde_json::json!({
                "id": r.id,
                "state": r.health.state,
                "consecutive_failures": r.health.consecutive_failures,
                "last_failure": r.health.last_failure,
                "fenced_total": r.health.fenced_total,
                "warmth_blocks": r.warmth_blocks,
                "usage": r.usage,
            })
        })
        .collect();
    let (_, metrics) = fleet.admin_get("/metrics").await.unwrap();
    let counters = metrics
        .lines()
        .filter(|l| {
            ["hearth_replica_", "hearth_usage_", "hearth_prediction_"]
                .iter()
                .any(|p| l.starts_with(p))
                && !l.starts_with("hearth_replica_in_flight")
                && !l.starts_with("hearth_replica_load")
        })
        .map(str::to_string)
        .collect();
    (replicas, counters)
}

#[tokio::test]
async fn forged_outcome_reports_get_401_and_change_nothing() {
    let fleet = Fleet::start(FleetOptions {
        engines: 2,
        ..FleetOptions::default()
    })
    .await
    .unwrap();
    let token = fleet
        .control_token
        .clone()
        .expect("fleets run with a token");
    // Real traffic first: usage and predictions to disturb.
    let mut c = Conversation::new(MODEL, "forged outcomes", false, 7);
    for _ in 0..2 {
        let t = fleet.chat(&c.next_turn(3000, false)).await;
        c.push_assistant(&hearth_e2e::reply_text(&t.body));
    }
    fleet.settle(Duration::from_secs(10)).await.unwrap();
    // The outcome filter's reports of those turns are in.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = observable(&fleet).await;

    let target = fleet.engines[0].addr;
    let empty = format!("upstream={target};text=0;done=1");
    let usage = format!("upstream={target};text=1;done=1;prompt=9000;cached=0;id=forged-1");
    let wrong = format!("Bearer {}", "f".repeat(token.len()));
    let bare = token.clone();
    for auth in [
        None,
        Some(wrong.as_str()),
        Some(bare.as_str()),
        Some("Bearer "),
    ] {
        // Each would make the replica suspect, or skew its usage.
        for body in [&empty, &empty, &empty, &usage] {
            let (code, text) = post_outcome(&fleet, body, auth).await;
            assert_eq!(code, 401, "{auth:?}: {text}");
            let v: Value = serde_json::from_str(&text).expect("a JSON error body");
            assert_eq!(v["error"]["code"], "control_token_required", "{text}");
        }
        // A first-chunk report (it would lighten a request's load).
        let (code, text) = post_to(&fleet, "/outcome/first-token", "id=forged-1", auth).await;
        assert_eq!(code, 401, "{auth:?}: {text}");
    }
    let after = observable(&fleet).await;
    assert_eq!(before, after, "a forged report changed the sidecar's state");
    assert_eq!(
        fleet.state().await.unwrap().replicas[0].health.state,
        HealthState::Serving
    );

    // The same reports with the token are taken: the refusal above is the
    // token's doing. A report that passes raises suspicion (only the
    // sidecar's own probe could fence the replica, and this engine is
    // healthy).
    let right = format!("Bearer {token}");
    for _ in 0..3 {
        let (code, text) = post_outcome(&fleet, &empty, Some(&right)).await;
        assert_eq!(code, 204, "{text}");
    }
    // With the token, a first-chunk report names a ticket: one no
    // decision waits under is 404, anything else 400.
    for (body, want) in [
        ("id=never-issued", 404),
        ("never-issued", 400),
        ("id=", 400),
    ] {
        let (code, text) = post_to(&fleet, "/outcome/first-token", body, Some(&right)).await;
        assert_eq!(code, want, "{body}: {text}");
    }
    let state = fleet.state().await.unwrap();
    assert_eq!(state.replicas[0].health.suspicions_total, 1, "{state:?}");
    assert_eq!(state.replicas[0].health.state, HealthState::Serving);
}

#[tokio::test]
async fn without_a_token_a_report_that_names_no_waiting_decision_changes_nothing() {
    // Where no control token is set (a loopback sidecar, or a pod the
    // NetworkPolicy admits to the admin port), a report counts only when it
    // names a decision waiting here by the sidecar's ticket, which only the
    // gateway's outcome filter carries.
    let fleet = Fleet::start(FleetOptions {
        engines: 2,
        control_token: false,
        ..FleetOptions::default()
    })
    .await
    .unwrap();
    assert!(fleet.control_token.is_none());
    let mut c = Conversation::new(MODEL, "reports without a token", false, 11);
    for _ in 0..2 {
        let t = fleet.chat(&c.next_turn(3000, false)).await;
        assert_eq!(t.status, 200);
        c.push_assistant(&hearth_e2e::reply_text(&t.body));
    }
    fleet.settle(Duration::from_secs(10)).await.unwrap();
    // The outcome filter's own reports name their tickets and are taken:
    // both answers' usage reached the sidecar, compared with predictions.
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let s = fleet.state().await.unwrap();
        let compared: u64 = s.replicas.iter().map(|r| r.usage.compared_total).sum();
        if compared >= 2 {
            break;
        }
        assert!(Instant::now() < until, "the filter's reports: {s:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let before = observable(&fleet).await;
    let target = fleet.engines[0].addr;
    for body in [
        format!("upstream={target};text=0;done=1"),
        format!("upstream={target};text=0;done=1;id=0123456789abcdef0123456789abcdef"),
        format!("upstream={target};text=1;done=1;prompt=9000;cached=0;id=made-up"),
    ] {
        for _ in 0..3 {
            let (code, text) = post_outcome(&fleet, &body, None).await;
            assert_eq!(code, 404, "{body}: {text}");
        }
    }
    assert_eq!(before, observable(&fleet).await, "a report changed state");
    let s = fleet.state().await.unwrap();
    assert!(
        s.replicas
            .iter()
            .all(|r| r.health.suspicions_total == 0 && r.health.state == HealthState::Serving),
        "{s:?}"
    );
}

#[tokio::test]
async fn the_outcome_filter_reports_with_the_token() {
    // A replica that answers 200 with nothing is fenced by the outcome
    // filter's reports: they carry the token the sidecar requires.
    let fleet = Fleet::start(FleetOptions {
        engines: 2,
        ..FleetOptions::default()
    })
    .await
    .unwrap();
    for e in &fleet.engines {
        e.engine.set_fault(Fault::Empty);
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut seed = 0;
    loop {
        let mut c = Conversation::new(MODEL, &format!("empty {seed}"), false, seed);
        let _ = fleet
            .post_json("/v1/chat/completions", &c.next_turn(500, false))
            .await;
        seed += 1;
        let state = fleet.state().await.unwrap();
        if state
            .replicas
            .iter()
            .any(|r| r.health.state == HealthState::Fenced)
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no replica fenced by the outcome filter's reports: {state:?}\n{}",
            fleet.envoy.log()
        );
    }
    // The empty answers fence through the sidecar's probes too (the fault
    // empties them as well), so what shows the token works is Envoy's own
    // count of the outcome cluster's answers: reports taken (204), none
    // refused (401).
    let taken = fleet
        .envoy
        .stat("cluster.hearth_sidecar_admin.upstream_rq_204")
        .await
        .unwrap()
        .unwrap_or(0);
    let refused = fleet
        .envoy
        .stat("cluster.hearth_sidecar_admin.upstream_rq_401")
        .await
        .unwrap()
        .unwrap_or(0);
    assert!(taken >= 1, "no outcome report was taken: {taken} x 204");
    assert_eq!(refused, 0, "outcome reports refused for their token");
    fleet.assert_wasm_healthy();
}

#[tokio::test]
async fn request_ids_in_the_journal_only_with_the_token() {
    let fleet = Fleet::start(FleetOptions::default()).await.unwrap();
    let mut c = Conversation::new(MODEL, "journal ids", false, 3);
    let turn = fleet
        .post(
            "/v1/chat/completions",
            serde_json::to_vec(&c.next_turn(1000, false)).unwrap(),
            &[
                ("content-type", "application/json"),
                ("x-request-id", "ctl-ids-1"),
            ],
        )
        .await
        .unwrap();
    assert_eq!(turn.status, 200, "{:?}", turn.body);
    let anonymous = |path: &str| {
        let url = format!("http://{}{path}", fleet.settings.admin_listen);
        let client = fleet.client.clone();
        async move {
            let r = client.get(url).send().await.unwrap();
            (r.status().as_u16(), r.text().await.unwrap())
        }
    };
    let (code, text) = anonymous("/debug/decisions?limit=5").await;
    assert_eq!(code, 200);
    let v: Value = serde_json::from_str(&text).unwrap();
    let decisions = v["decisions"].as_array().unwrap();
    assert!(!decisions.is_empty());
    assert!(
        decisions.iter().all(|d| d["request_id"].is_null()),
        "request ids shown without the token: {text}"
    );
    assert!(!text.contains("ctl-ids-1"));
    let (code, _) = anonymous("/debug/decisions?request_id=ctl-ids-1").await;
    assert_eq!(code, 401);
    // Read-only endpoints stay open.
    for path in ["/state", "/health", "/metrics", "/", "/debug/series"] {
        assert_eq!(anonymous(path).await.0, 200, "{path}");
    }
    // With the token, the ids are there.
    let (code, text) = fleet.admin_get("/debug/decisions?limit=5").await.unwrap();
    assert_eq!(code, 200);
    assert!(text.contains("ctl-ids-1"), "{text}");
    let (code, _) = fleet
        .admin_get("/debug/decisions?request_id=ctl-ids-1")
        .await
        .unwrap();
    assert_eq!(code, 200);
}

/// What a recording ext_proc server saw: per stream, the call's
/// `authorization` metadata and every header name and value Envoy sent.
#[derive(Clone, Default)]
struct Recorder {
    seen: Arc<Mutex<Vec<Seen>>>,
}

/// One headers message: the call's `authorization` metadata, and the
/// headers (name, value).
type Seen = (String, Vec<(String, String)>);

type Replies =
    Pin<Box<dyn futures::Stream<Item = Result<ProcessingResponse, tonic::Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for Recorder {
    type ProcessStream = Replies;

    /// Records, and lets everything continue unchanged.
    async fn process(
        &self,
        request: tonic::Request<tonic::Streaming<ProcessingRequest>>,
    ) -> Result<tonic::Response<Replies>, tonic::Status> {
        let auth = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string();
        let seen = Arc::clone(&self.seen);
        let mut inbound = request.into_inner();
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        tokio::spawn(async move {
            while let Ok(Some(msg)) = inbound.message().await {
                let (reply, h) = match msg.request {
                    Some(In::RequestHeaders(h)) => {
                        (Out::RequestHeaders(HeadersResponse::default()), Some(h))
                    }
                    Some(In::ResponseHeaders(h)) => {
                        (Out::ResponseHeaders(HeadersResponse::default()), Some(h))
                    }
                    Some(In::RequestBody(_)) => (Out::RequestBody(BodyResponse::default()), None),
                    Some(In::ResponseBody(_)) => (Out::ResponseBody(BodyResponse::default()), None),
                    Some(In::RequestTrailers(_)) => {
                        (Out::RequestTrailers(TrailersResponse::default()), None)
                    }
                    Some(In::ResponseTrailers(_)) => {
                        (Out::ResponseTrailers(TrailersResponse::default()), None)
                    }
                    None => continue,
                };
                if let Some(h) = h {
                    let all = headers::all(&h)
                        .map(|hv| (hv.key.clone(), headers::text(hv).to_string()))
                        .collect();
                    seen.lock().unwrap().push((auth.clone(), all));
                }
                let reply = ProcessingResponse {
                    response: Some(reply),
                    ..Default::default()
                };
                if tx.send(Ok(reply)).await.is_err() {
                    break;
                }
            }
        });
        Ok(tonic::Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

async fn start_recorder() -> (Recorder, SocketAddr) {
    let recorder = Recorder::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let service = ExternalProcessorServer::new(recorder.clone());
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );
    (recorder, addr)
}

/// `yaml` without its `forward_rules` block (the control case).
fn without_forward_rules(yaml: &str) -> String {
    let mut out = String::new();
    let mut skipping: Option<usize> = None;
    for line in yaml.lines() {
        let indent = line.len() - line.trim_start().len();
        if let Some(at) = skipping {
            if indent > at {
                continue;
            }
            skipping = None;
        }
        if line.trim_start().starts_with("forward_rules:") {
            skipping = Some(indent);
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

const ENGINE_KEY: &str = "sk-engine-key-a-client-holds";

/// Sends one chat turn with the client's credentials through an Envoy
/// rendered from `config` in front of the recorder; returns the status
/// and what the recorder saw.
async fn through_recorder(fleet: &Fleet, recorder: &Recorder, config: &str) -> (u16, Vec<Seen>) {
    recorder.seen.lock().unwrap().clear();
    let envoy = fleet.start_envoy(config).await.unwrap();
    let mut c = Conversation::new(MODEL, "client credentials", false, 11);
    let turn = fleet
        .post_via(
            &envoy,
            "/v1/chat/completions",
            serde_json::to_vec(&c.next_turn(3000, false)).unwrap(),
            &[
                ("content-type", "application/json"),
                ("authorization", &format!("Bearer {ENGINE_KEY}")),
                ("cookie", "session=cookie-secret"),
            ],
        )
        .await
        .unwrap();
    // Envoy closes the ext_proc stream when the HTTP stream ends.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let seen = recorder.seen.lock().unwrap().clone();
    (turn.status, seen)
}

#[tokio::test]
async fn a_clients_authorization_reaches_the_engine_but_never_the_sidecar() {
    let fleet = Fleet::start(FleetOptions {
        engines: 2,
        engine_api_key: Some(ENGINE_KEY.into()),
        sidecar_flags: vec![format!("--engine-api-key={ENGINE_KEY}")],
        ..FleetOptions::default()
    })
    .await
    .unwrap();
    let token = fleet.control_token.clone().unwrap();
    // The engines refuse a request without the client's key.
    let mut c = Conversation::new(MODEL, "no key", false, 1);
    let refused = fleet
        .post_json("/v1/chat/completions", &c.next_turn(100, false))
        .await
        .unwrap();
    assert_eq!(refused.status, 401, "{:?}", refused.body);

    let (recorder, addr) = start_recorder().await;
    let gateway = Gateway {
        listen: "127.0.0.1:0".parse().unwrap(),
        sidecar: addr,
        ..fleet.gateway.clone()
    };
    let allowed = |name: &str| {
        [":method", ":path", ":status", "x-request-id"].contains(&name)
            || name.starts_with("x-hearth-")
    };
    for (mode, config) in [
        ("filter", render(&gateway)),
        ("body", render_body(&gateway)),
    ] {
        let (status, seen) = through_recorder(&fleet, &recorder, &config).await;
        // The engine got the client's key (it answers 401 without it).
        assert_eq!(status, 200, "{mode}");
        assert!(
            seen.len() >= 2,
            "{mode}: request and response headers: {seen:?}"
        );
        let names: BTreeSet<&str> = seen
            .iter()
            .flat_map(|(_, h)| h.iter().map(|(k, _)| k.as_str()))
            .collect();
        assert!(
            names.iter().all(|n| allowed(n)),
            "{mode}: headers outside the allow-list reached the sidecar: {names:?}"
        );
        for (auth, h) in &seen {
            // The call carries the gateway's token, not the client's key.
            assert_eq!(auth, &format!("Bearer {token}"), "{mode}");
            for (k, v) in h {
                assert!(
                    !v.contains(ENGINE_KEY) && !v.contains("cookie-secret"),
                    "{mode}: {k} carries a client credential"
                );
            }
        }
        // What routing reads did arrive.
        for name in [":path", ":method", ":status", "x-request-id"] {
            assert!(names.contains(name), "{mode}: no {name}: {names:?}");
        }
        if mode == "filter" {
            assert!(names.contains("x-hearth-fp"), "{names:?}");
        }
    }
    // The control: the same gateway without forward_rules sends the
    // client's key to the sidecar. It is the rules that keep it in Envoy.
    let (status, seen) =
        through_recorder(&fleet, &recorder, &without_forward_rules(&render(&gateway))).await;
    assert_eq!(status, 200);
    assert!(
        seen.iter()
            .flat_map(|(_, h)| h)
            .any(|(k, v)| k == "authorization" && v.contains(ENGINE_KEY)),
        "without forward_rules the key should reach the recorder: {seen:?}"
    );
}

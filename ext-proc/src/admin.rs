//! The sidecar's HTTP endpoint: `GET /state` (JSON: per-replica health,
//! in-flight load and warmth), `GET /health` (`ok`, `degraded` or
//! `unhealthy`; HTTP 503 only when no replica is serving), and
//! `POST /outcome`, where Envoy's outcome filter reports whether a 200
//! answer carried text (`upstream=IP:PORT;text=0|1;done=0|1`). Bind it to
//! loopback or a private interface: a client that can post outcomes can
//! fence replicas.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router as HttpRouter};

use crate::health::{self, Answer, FleetHealth};
use crate::router::{Router, Snapshot};

pub fn routes(router: Arc<Router>) -> HttpRouter {
    HttpRouter::new()
        .route("/state", get(state))
        .route("/health", get(health))
        .route("/outcome", post(outcome))
        .with_state(router)
}

async fn state(State(router): State<Arc<Router>>) -> Json<Snapshot> {
    Json(router.snapshot())
}

async fn health(State(router): State<Arc<Router>>) -> (StatusCode, Json<serde_json::Value>) {
    let fleet = router.fleet_health();
    let code = match fleet {
        FleetHealth::Unhealthy => StatusCode::SERVICE_UNAVAILABLE,
        FleetHealth::Ok | FleetHealth::Degraded => StatusCode::OK,
    };
    (code, Json(serde_json::json!({ "status": fleet })))
}

async fn outcome(State(router): State<Arc<Router>>, body: String) -> StatusCode {
    let upstream = body
        .split(';')
        .find_map(|f| f.trim().strip_prefix("upstream="));
    let (Some(upstream), Some(answer)) = (upstream, Answer::parse(&body)) else {
        return StatusCode::BAD_REQUEST;
    };
    let Some(replica) = router.replica_at(upstream, None) else {
        return StatusCode::NOT_FOUND;
    };
    router.record_request(
        replica,
        health::classify(Some(200), "via_upstream", Some(answer)),
    );
    StatusCode::NO_CONTENT
}

//! The read-only HTTP endpoint: `GET /state` (JSON: per-replica health,
//! in-flight load and warmth) and `GET /health` (`ok`, `degraded` or
//! `unhealthy`; HTTP 503 only when no replica is serving).

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::{Json, Router as HttpRouter};

use crate::health::FleetHealth;
use crate::router::{Router, Snapshot};

pub fn routes(router: Arc<Router>) -> HttpRouter {
    HttpRouter::new()
        .route("/state", get(state))
        .route("/health", get(health))
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

//! The read-only HTTP endpoint: `GET /state` (JSON: per-replica in-flight
//! load and warmth) and `GET /health`.

use std::sync::Arc;

use axum::extract::State;
use axum::routing::get;
use axum::{Json, Router as HttpRouter};

use crate::router::{Router, Snapshot};

pub fn routes(router: Arc<Router>) -> HttpRouter {
    HttpRouter::new()
        .route("/state", get(state))
        .route("/health", get(|| async { "ok\n" }))
        .with_state(router)
}

async fn state(State(router): State<Arc<Router>>) -> Json<Snapshot> {
    Json(router.snapshot())
}

//! The sidecar's HTTP endpoint: `GET /state` (JSON: per-replica health,
//! in-flight load and warmth), `GET /health` (`ok`, `degraded` or
//! `unhealthy`; HTTP 503 only when no replica is serving). The routes
//! that write (the outcome filter's reports, `POST /outcome`, from
//! [`crate::envoy::report`]) are merged in by the sidecar, behind the same
//! guard: with `HEARTH_CONTROL_TOKEN_FILE`, every write needs the token
//! ([`crate::guard::admin_guard`]), and `/debug/decisions` shows request
//! ids only to a caller that has it.
//!
//! Observability: `GET /metrics` (Prometheus text), `GET /debug/decisions`
//! (`?request_id=ID` for one request's decisions, else `?limit=N` for the
//! latest, newest first), `GET /debug/series` (`?seconds=N` of per-second
//! history), `GET /debug/queue` (what waits in the flow-control queue, by
//! band and by tenant; the tenants' fairness ids only to a caller that has
//! the control token) and the dashboard at `GET /` (also `/dashboard`),
//! one self-contained page that polls `/state`, `/debug/series` and
//! `/debug/queue`.

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{Html, IntoResponse};
use axum::routing::get;
use axum::{Extension, Json, Router as HttpRouter};
use serde::{Deserialize, Serialize};

use hearth_router::health::FleetHealth;
use hearth_router::{QueueView, Router, Snapshot};

use crate::guard::{self, Caller, ControlToken};
use crate::observe::journal::DecisionRecord;
use crate::observe::series::{Second, SERIES_SECONDS};
use crate::observe::Observer;

/// The dashboard: one page, inline script and style, no external fetches.
pub const DASHBOARD: &str = include_str!("dashboard.html");

/// Every route, the read-only ones here and the sidecar's `writes`, behind
/// the guard: `token` (the control token, if set) for writes and request
/// ids, a body limit and a request deadline.
pub fn routes(
    observer: Arc<Observer>,
    writes: HttpRouter,
    token: Option<Arc<ControlToken>>,
) -> HttpRouter {
    let router = Arc::clone(observer.router());
    HttpRouter::new()
        .route("/state", get(state))
        .route("/health", get(health))
        .with_state(router)
        .merge(
            HttpRouter::new()
                .route("/metrics", get(metrics))
                .route("/debug/decisions", get(decisions))
                .route("/debug/series", get(series))
                .route("/debug/queue", get(queue))
                .route("/", get(dashboard))
                .route("/dashboard", get(dashboard))
                .with_state(observer),
        )
        .merge(writes)
        .layer(DefaultBodyLimit::max(guard::ADMIN_BODY_LIMIT))
        .layer(axum::middleware::from_fn_with_state(
            token,
            guard::admin_guard,
        ))
}

/// `/debug/queue`: fairness ids (which may be derived from API keys) are
/// the gateway's business, like request ids.
async fn queue(
    State(observer): State<Arc<Observer>>,
    Extension(caller): Extension<Caller>,
) -> Json<QueueView> {
    let mut view = observer.queue_view();
    if caller == Caller::Anyone {
        for flow in &mut view.flows {
            flow.fairness_id = None;
        }
    }
    Json(view)
}

async fn metrics(State(observer): State<Arc<Observer>>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        observer.encode_metrics(),
    )
}

#[derive(Debug, Deserialize)]
pub struct DecisionQuery {
    pub request_id: Option<String>,
    pub limit: Option<usize>,
}

/// `/debug/decisions`: newest first.
#[derive(Debug, Serialize, Deserialize)]
pub struct Decisions {
    /// Records the ring can hold (`HEARTH_JOURNAL_SIZE`).
    pub journal_size: usize,
    pub decisions: Vec<DecisionRecord>,
}

/// Request ids are the gateway's business: a caller without the control
/// token (when one is set) sees none and cannot look one up.
async fn decisions(
    State(observer): State<Arc<Observer>>,
    Extension(caller): Extension<Caller>,
    Query(q): Query<DecisionQuery>,
) -> axum::response::Response {
    if caller == Caller::Anyone && q.request_id.is_some() {
        return guard::unauthorized();
    }
    let journal = &observer.journal;
    let found = match &q.request_id {
        Some(id) => journal.find(id),
        None => journal.latest(q.limit.unwrap_or(20)),
    };
    let code = if q.request_id.is_some() && found.is_empty() {
        StatusCode::NOT_FOUND
    } else {
        StatusCode::OK
    };
    let decisions = found
        .into_iter()
        .take(q.limit.unwrap_or(usize::MAX))
        .map(|r| {
            let mut r = (*r).clone();
            if caller == Caller::Anyone {
                r.request_id = None;
            }
            r
        })
        .collect();
    (
        code,
        Json(Decisions {
            journal_size: journal.capacity(),
            decisions,
        }),
    )
        .into_response()
}

#[derive(Debug, Deserialize)]
pub struct SeriesQuery {
    pub seconds: Option<usize>,
}

/// `/debug/series`: per-second history, oldest first.
#[derive(Debug, Serialize, Deserialize)]
pub struct SeriesView {
    /// Replica ids, in the order of each second's `in_flight` and `load`.
    pub replicas: Vec<String>,
    pub seconds: Vec<Second>,
}

async fn series(
    State(observer): State<Arc<Observer>>,
    Query(q): Query<SeriesQuery>,
) -> Json<SeriesView> {
    let n = q.seconds.unwrap_or(120).min(SERIES_SECONDS);
    let replicas: Vec<String> = observer
        .router()
        .snapshot()
        .replicas
        .into_iter()
        .map(|r| r.id)
        .collect();
    Json(SeriesView {
        seconds: observer.series.last_for(n, &replicas),
        replicas,
    })
}

async fn dashboard() -> Html<&'static str> {
    Html(DASHBOARD)
}

async fn state(State(router): State<Arc<Router>>) -> Json<Snapshot> {
    Json(router.snapshot())
}

async fn health(State(router): State<Arc<Router>>) -> (StatusCode, Json<serde_json::Value>) {
    let mut fleet = router.fleet_health();
    // Peers configured and the bus down: still routing, on this sidecar's
    // own state alone.
    let bus_down = router.peers_snapshot().is_some_and(|p| !p.connected);
    // The replica list's source (the Kubernetes API) lost: routing on the
    // last list it gave.
    let source_lost = !router.source().connected;
    if (bus_down || source_lost) && fleet == FleetHealth::Ok {
        fleet = FleetHealth::Degraded;
    }
    let code = match fleet {
        FleetHealth::Unhealthy => StatusCode::SERVICE_UNAVAILABLE,
        FleetHealth::Ok | FleetHealth::Degraded => StatusCode::OK,
    };
    (code, Json(serde_json::json!({ "status": fleet })))
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::{Method, Request};
    use axum::routing::post;
    use std::time::Duration;
    use tower::ServiceExt;

    use crate::observe::journal::Journal;
    use crate::outcomes::Outcomes;

    const TOKEN: &str = "0123456789abcdef0123456789abcdef";

    /// The admin port as the sidecar serves it (the outcome route merged
    /// in), with the control token set, in front of one replica.
    fn admin(writes: Option<HttpRouter>) -> HttpRouter {
        admin_with(writes, |_| {})
    }

    /// [`admin`], with `set` given the observer first.
    fn admin_with(writes: Option<HttpRouter>, set: impl FnOnce(&Observer)) -> HttpRouter {
        let upstreams = ["127.0.0.1:1;id=a".parse().unwrap()];
        let params = hearth_router::RouterParams::default();
        let router = Router::new(params, &upstreams);
        let observer = Observer::new(
            router,
            params.score.basis,
            Journal::open(16, None).unwrap(),
            "hearth",
        );
        set(&observer);
        // The token is set: reports reach the route authenticated.
        let writes = writes.unwrap_or_else(|| {
            crate::envoy::report::routes(Outcomes::new(Arc::clone(&observer)), true)
        });
        let token = ControlToken::new(&TOKEN.parse().unwrap());
        routes(observer, writes, Some(Arc::new(token)))
    }

    async fn send(
        admin: &HttpRouter,
        method: Method,
        path: &str,
        body: impl Into<Body>,
        token: bool,
    ) -> (StatusCode, String) {
        let mut request = Request::builder().method(method).uri(path);
        if token {
            request = request.header(header::AUTHORIZATION, format!("Bearer {TOKEN}"));
        }
        let response = admin
            .clone()
            .oneshot(request.body(body.into()).unwrap())
            .await
            .unwrap();
        let status = response.status();
        let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap();
        (status, String::from_utf8_lossy(&bytes).into_owned())
    }

    #[tokio::test]
    async fn every_write_without_the_token_is_a_json_401_and_reads_stay_open() {
        let admin = admin(None);
        let report = "upstream=127.0.0.1:1;text=0;done=1";
        for (method, path) in [
            (Method::POST, "/outcome"),
            (Method::PUT, "/outcome"),
            (Method::POST, "/state"),
            (Method::DELETE, "/debug/decisions"),
            (Method::PATCH, "/metrics"),
            (Method::POST, "/no-such-route"),
        ] {
            let (status, text) = send(&admin, method.clone(), path, report, false).await;
            assert_eq!(status, StatusCode::UNAUTHORIZED, "{method} {path}: {text}");
            let v: serde_json::Value = serde_json::from_str(&text).expect("a JSON error body");
            assert_eq!(v["error"]["code"], "control_token_required", "{text}");
        }
        // The refused report changed nothing.
        let snapshot: Snapshot = serde_json::from_str(
            &send(&admin, Method::GET, "/state", Body::empty(), false)
                .await
                .1,
        )
        .unwrap();
        assert_eq!(snapshot.replicas[0].health.suspicions_total, 0);
        for path in [
            "/state",
            "/health",
            "/metrics",
            "/debug/series",
            "/debug/decisions",
            "/debug/queue",
            "/",
            "/dashboard",
        ] {
            let (status, text) = send(&admin, Method::GET, path, Body::empty(), false).await;
            assert_eq!(status, StatusCode::OK, "GET {path}: {text}");
        }
        // The same report with the token is taken.
        let (status, text) = send(&admin, Method::POST, "/outcome", report, true).await;
        assert_eq!(status, StatusCode::NO_CONTENT, "{text}");
    }

    #[tokio::test]
    async fn the_queue_shows_its_bands_to_anyone_and_its_tenants_to_the_gateway() {
        use hearth_router::{FlowQueue, QueueParams};
        let port = admin_with(None, |observer| {
            observer.set_queue_view(|| {
                let now = std::time::Instant::now();
                let mut q = FlowQueue::new(QueueParams::default());
                for (flow, priority) in [("team-a", 0), ("team-a", 0), ("team-b", 5)] {
                    q.push((), priority, flow, 1000, now).unwrap();
                }
                q.view(now)
            })
        });
        let view = |text: &str| serde_json::from_str::<QueueView>(text).unwrap();
        let (status, text) = send(&port, Method::GET, "/debug/queue", Body::empty(), false).await;
        assert_eq!(status, StatusCode::OK);
        let anyone = view(&text);
        assert_eq!(
            (anyone.requests, anyone.bytes, anyone.flows_total),
            (3, 3000, 2)
        );
        assert_eq!(
            anyone
                .bands
                .iter()
                .map(|b| (b.priority, b.requests))
                .collect::<Vec<_>>(),
            [(5, 1), (0, 2)]
        );
        assert_eq!(anyone.flows.len(), 2);
        assert!(
            anyone.flows.iter().all(|f| f.fairness_id.is_none()),
            "{text}"
        );
        let (_, text) = send(&port, Method::GET, "/debug/queue", Body::empty(), true).await;
        let gateway = view(&text);
        assert_eq!(gateway.flows[0].fairness_id.as_deref(), Some("team-a"));
        assert_eq!(gateway.flows[0].requests, 2);
        // Without flow control there is nothing to show.
        let (_, text) = send(
            &admin(None),
            Method::GET,
            "/debug/queue",
            Body::empty(),
            true,
        )
        .await;
        assert_eq!(view(&text), QueueView::default());
    }

    #[tokio::test]
    async fn a_body_past_4_kib_is_a_413_even_with_the_token() {
        let admin = admin(None);
        // Malformed, so a body the limit lets through is a 400.
        let (status, _) = send(&admin, Method::POST, "/outcome", "x".repeat(4096), true).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        let (status, _) = send(&admin, Method::POST, "/outcome", "x".repeat(4097), true).await;
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(guard::ADMIN_BODY_LIMIT, 4096);
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_unanswered_for_10_s_gets_a_408() {
        let wait = |d: Duration| {
            move || async move {
                tokio::time::sleep(d).await;
                "answered"
            }
        };
        let admin = admin(Some(
            HttpRouter::new()
                .route("/late", post(wait(Duration::from_secs(11))))
                .route("/in-time", post(wait(Duration::from_secs(9)))),
        ));
        let (status, text) = send(&admin, Method::POST, "/in-time", "", true).await;
        assert_eq!((status, text.as_str()), (StatusCode::OK, "answered"));
        let (status, text) = send(&admin, Method::POST, "/late", "", true).await;
        assert_eq!(status, StatusCode::REQUEST_TIMEOUT, "{text}");
        let v: serde_json::Value = serde_json::from_str(&text).expect("a JSON error body");
        assert_eq!(v["error"]["code"], "request_timeout");
    }
}

//! `POST /outcome` on the admin endpoint: the outcome filter's report on a
//! generation's 200 answer (`hearth_wire::outcome::Report`), handed to the
//! place where requests end ([`crate::outcomes`]).

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::Router as HttpRouter;
use hearth_wire::outcome::Report;

use crate::outcomes::{Outcomes, ReportRefused};

/// The report route. `authenticated`: a control token is set, so every
/// report that reaches the handler carried it (the admin guard refuses
/// the others first).
pub fn routes(outcomes: Arc<Outcomes>, authenticated: bool) -> HttpRouter {
    HttpRouter::new()
        .route(hearth_wire::names::REPORT_PATH, post(outcome))
        .with_state((outcomes, authenticated))
}

/// 204 when taken, 400 for a malformed report, 404 for one that names no
/// replica of ours, or (without a control token) no decision waiting for
/// its answer by its ticket.
async fn outcome(
    State((outcomes, authenticated)): State<(Arc<Outcomes>, bool)>,
    body: String,
) -> StatusCode {
    let Some(report) = Report::parse(&body) else {
        return StatusCode::BAD_REQUEST;
    };
    match outcomes.reported(&report, authenticated) {
        Ok(()) => StatusCode::NO_CONTENT,
        Err(ReportRefused::UnknownUpstream | ReportRefused::UnknownTicket) => StatusCode::NOT_FOUND,
    }
}

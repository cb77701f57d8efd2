//! `POST /outcome` on the admin endpoint: the outcome filter's report on a
//! generation's 200 answer (`hearth_wire::outcome::Report`), handed to the
//! place where requests end ([`crate::outcomes`]); and `POST
//! /outcome/first-token`, its word that a streamed answer's first chunk
//! went by.

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
        .route(hearth_wire::names::FIRST_TOKEN_PATH, post(first_token))
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

/// 204 when a decision waits under the ticket named (its prompt's reading
/// load is given back), 404 when none does, 400 for any other body.
async fn first_token(
    State((outcomes, _)): State<(Arc<Outcomes>, bool)>,
    body: String,
) -> StatusCode {
    let Some(ticket) = hearth_wire::outcome::parse_first_token(&body) else {
        return StatusCode::BAD_REQUEST;
    };
    if outcomes.first_token(ticket) {
        StatusCode::NO_CONTENT
    } else {
        StatusCode::NOT_FOUND
    }
}

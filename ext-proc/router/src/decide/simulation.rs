//! The simulator's own entry point (cargo feature `simulation`, which
//! `hearth-bench` enables and the sidecar does not): a decision told how
//! much of the prompt each replica really holds, instead of reading the
//! warmth index. The benchmark's `hearth_informed` yardstick reads the
//! simulated engines' caches and routes through it, so it measures what
//! the approximate index costs; nothing in the sidecar knows the engines'
//! caches, so it has no business calling it.

use std::sync::Arc;
use std::time::Instant;

use super::{Decision, RequestInfo, RouteError};
use crate::router::Router;

impl Router {
    /// As [`Router::decide_at`], with `overlaps[i]` the leading blocks of
    /// the prompt that replica `i` holds (a replica beyond the slice holds
    /// none; an overlap beyond the prompt counts as the whole prompt).
    /// Everything else (candidates, scoring, reservation, the prompt
    /// recorded as warm) is the sidecar's pipeline.
    pub fn decide_knowing_at(
        self: &Arc<Self>,
        req: &RequestInfo,
        overlaps: &[usize],
        now: Instant,
    ) -> Result<Decision, RouteError> {
        self.decide_with(req, None, Some(overlaps), now)
    }
}

//! What the engines served from cache, matched with what each decision
//! predicted.
//!
//! Where the wasm outcome filter reads the answers (the filter shapes),
//! its report comes to `/outcome` after the ext_proc stream may have
//! ended, so each decision's [`Prediction`] waits in [`Predictions`] under
//! the request's `x-request-id` until its report takes it (or it ages
//! out). Where ext_proc sends the response body (body and endpoint-picker
//! shapes), the exchange scans it and holds its own prediction.
//!
//! Metrics: the prediction's error per answer (a histogram of
//! `|predicted - served| / prompt tokens`), answers that carried no usage,
//! and reports whose decision was not found; the per-replica token
//! counters and corrections come from the router's snapshot
//! ([`super::metrics::FleetCollector`]).

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use hearth_router::{Prediction, Served};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Predictions kept for reports at most (a report names its request; one
/// that never comes must not hold memory for ever).
pub const MAX_PREDICTIONS: usize = 65_536;
/// How long a prediction waits for its report: longer than any answer
/// streams.
pub const PREDICTION_TTL: Duration = Duration::from_secs(30 * 60);

/// Decisions' predictions by request id, bounded in count and age.
#[derive(Debug, Default)]
pub struct Predictions {
    inner: Mutex<Ledger>,
}

#[derive(Debug, Default)]
struct Ledger {
    by_id: HashMap<String, (Prediction, Instant)>,
    /// Insertion order, for expiry; entries whose id was taken or
    /// replaced since are skipped.
    order: VecDeque<(Instant, String)>,
}

impl Predictions {
    /// Keeps `prediction` for the report of request `id` (a retried id
    /// keeps its latest decision).
    pub fn insert(&self, id: &str, prediction: Prediction, now: Instant) {
        let mut l = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        l.by_id.insert(id.to_string(), (prediction, now));
        l.order.push_back((now, id.to_string()));
        while let Some((at, _)) = l.order.front() {
            let full = l.by_id.len() > MAX_PREDICTIONS || l.order.len() > 2 * MAX_PREDICTIONS;
            if !full && now.saturating_duration_since(*at) < PREDICTION_TTL {
                break;
            }
            let (at, old) = l.order.pop_front().expect("front exists");
            if l.by_id.get(&old).is_some_and(|(_, t)| *t == at) {
                l.by_id.remove(&old);
            }
        }
    }

    /// The prediction for request `id`, removed.
    pub fn take(&self, id: &str) -> Option<Prediction> {
        let mut l = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        l.by_id.remove(id).map(|(p, _)| p)
    }

    pub fn len(&self) -> usize {
        let l = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        l.by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Event metrics of the usage loop.
#[derive(Debug)]
pub struct UsageMetrics {
    error: Histogram,
    missing: Counter,
    unmatched: Counter,
}

impl UsageMetrics {
    pub fn register(reg: &mut Registry) -> Self {
        let m = UsageMetrics {
            error: Histogram::new([0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0]),
            missing: Counter::default(),
            unmatched: Counter::default(),
        };
        reg.register(
            "hearth_prediction_error",
            "Per answer with usage from the chosen replica: |predicted - served cached tokens| / prompt tokens",
            m.error.clone(),
        );
        reg.register(
            "hearth_usage_missing",
            "Generations' answers that carried no usage with cached tokens (the engine does not report them, or the client did not ask for usage in a stream)",
            m.missing.clone(),
        );
        reg.register(
            "hearth_usage_unmatched",
            "Usage reports whose decision was not found (no request id, or it aged out): counted per replica without a prediction",
            m.unmatched.clone(),
        );
        m
    }

    pub fn served(&self, served: &Served) {
        if let Some(predicted) = served.predicted_tokens {
            let prompt = served.usage.prompt_tokens.max(1) as f64;
            let error = predicted.abs_diff(served.usage.cached_tokens) as f64 / prompt;
            self.error.observe(error);
        }
    }

    pub fn missing(&self) {
        self.missing.inc();
    }

    pub fn unmatched(&self) {
        self.unmatched.inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prediction(blocks: u32) -> Prediction {
        Prediction {
            replica: 0,
            key: ("127.0.0.1:1".parse().unwrap(), None),
            blocks,
            prompt_bytes: 4096,
            continues: true,
            stamp: None,
        }
    }

    #[test]
    fn a_prediction_is_taken_once() {
        let p = Predictions::default();
        let now = Instant::now();
        p.insert("a", prediction(3), now);
        assert_eq!(p.take("a").map(|x| x.blocks), Some(3));
        assert_eq!(p.take("a"), None);
        // A retried id keeps its latest decision.
        p.insert("b", prediction(1), now);
        p.insert("b", prediction(2), now);
        assert_eq!(p.take("b").map(|x| x.blocks), Some(2));
    }

    #[test]
    fn predictions_age_out_and_are_bounded() {
        let p = Predictions::default();
        let t0 = Instant::now();
        p.insert("old", prediction(1), t0);
        p.insert("new", prediction(2), t0 + PREDICTION_TTL);
        assert_eq!(p.take("old"), None);
        assert!(p.take("new").is_some());
        for k in 0..MAX_PREDICTIONS + 10 {
            p.insert(&k.to_string(), prediction(1), t0 + PREDICTION_TTL);
        }
        assert_eq!(p.len(), MAX_PREDICTIONS);
        assert_eq!(p.take("0"), None);
        assert!(p.take(&(MAX_PREDICTIONS + 9).to_string()).is_some());
    }
}

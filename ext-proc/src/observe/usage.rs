//! What the engines served from cache against what each decision
//! predicted, as metrics: the prediction's error per answer (a histogram
//! of `|predicted - served| / prompt tokens`), answers that carried no
//! usage, and reports whose decision was not found. The matching itself
//! happens where a request ends ([`crate::outcomes`]); the per-replica
//! token counters and corrections come from the router's snapshot
//! ([`super::metrics::FleetCollector`]).

use hearth_router::Served;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

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
            "Usage reports whose decision was not found (no ticket, or it aged out): counted per replica without a prediction",
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

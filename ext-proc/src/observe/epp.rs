//! The picker-level series the llm-d router's endpoint picker exposes
//! (`llm_d_epp_*`), under its names and labels, for the dashboards and
//! alerts operators of Gateway API Inference Extension pools already run.
//! Only what Hearth measures itself is emitted (the mapping and what is
//! left out, with why, are in `docs/metrics.md`):
//!
//! - per request, at decision time: `request_total`, `request_error_total`
//!   (refusals: no replica serves the model, none is healthy, all are
//!   saturated) and `scheduler_e2e_duration_seconds`;
//! - per answer, at its end: `request_error_total` for an engine's 5xx,
//!   and, from the engine's usage, `request_input_tokens` and
//!   `request_cached_tokens`;
//! - per pool, at scrape time ([`super::metrics::FleetCollector`]):
//!   `ready_endpoints`, `per_endpoint_queue_size`,
//!   `average_kv_cache_utilization`, `average_queue_size`,
//!   `average_running_requests`.
//!
//! Request series carry the label set `{model_name, target_model_name,
//! fairness_id, priority}`; Hearth does not rewrite models (the target is
//! the model asked for) and has no fairness or priority classes (both
//! empty). A model name comes from the client, so at most
//! [`MAX_MODEL_LABELS`] distinct names have a series at once; past them a
//! new name counts as `other`, unless a name has gone unused for
//! [`MODEL_LABEL_IDLE`]: its series are dropped and the new name takes
//! its place (names a client made up do not keep the labels for good).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use hearth_router::RouteError;

/// Distinct model names given their own series.
pub const MAX_MODEL_LABELS: usize = 1_000;

/// A model name unused this long gives up its series to a new name.
pub const MODEL_LABEL_IDLE: Duration = Duration::from_secs(600);

/// Every `error_code` a request series can carry.
const ERROR_CODES: [&str; 4] = [
    "BadRequest",
    "ServiceUnavailable",
    "InferencePoolResourceExhausted",
    "ModelServerError",
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    model_name: String,
    target_model_name: String,
    fairness_id: String,
    priority: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    model_name: String,
    target_model_name: String,
    fairness_id: String,
    priority: String,
    error_code: &'static str,
}

type Histograms = Family<RequestLabels, Histogram, fn() -> Histogram>;

fn token_histogram() -> Histogram {
    // 1 .. ~1M tokens.
    Histogram::new(exponential_buckets(1.0, 4.0, 11))
}

/// The `llm_d_epp_*` event series.
#[derive(Debug)]
pub struct EppMetrics {
    requests: Family<RequestLabels, Counter>,
    errors: Family<ErrorLabels, Counter>,
    scheduler: Histogram,
    input_tokens: Histograms,
    cached_tokens: Histograms,
    /// The names with their own series, and when each was last used.
    models: Mutex<HashMap<String, Instant>>,
}

impl EppMetrics {
    pub fn register(reg: &mut Registry) -> Self {
        let m = EppMetrics {
            requests: Family::default(),
            errors: Family::default(),
            // 1 µs .. ~0.26 s, as hearth_decision_duration.
            scheduler: Histogram::new(exponential_buckets(1e-6, 2.0, 19)),
            input_tokens: Family::new_with_constructor(token_histogram),
            cached_tokens: Family::new_with_constructor(token_histogram),
            models: Mutex::default(),
        };
        reg.register(
            "llm_d_epp_request",
            "Requests the picker decided (routed or refused)",
            m.requests.clone(),
        );
        reg.register(
            "llm_d_epp_request_error",
            "Requests refused by the picker, or answered with a 5xx by the engine, by error_code",
            m.errors.clone(),
        );
        reg.register(
            "llm_d_epp_scheduler_e2e_duration_seconds",
            "Time the picker spent choosing an endpoint",
            m.scheduler.clone(),
        );
        reg.register(
            "llm_d_epp_request_input_tokens",
            "Prompt tokens per answer, as the engine counted them (its usage)",
            m.input_tokens.clone(),
        );
        reg.register(
            "llm_d_epp_request_cached_tokens",
            "Prompt tokens per answer that the engine read from its cache (its usage)",
            m.cached_tokens.clone(),
        );
        m
    }

    /// The label set of a request for `model` (bounded, see the module).
    fn labels(&self, model: Option<&str>) -> RequestLabels {
        self.labels_at(model, Instant::now())
    }

    fn labels_at(&self, model: Option<&str>, now: Instant) -> RequestLabels {
        let name = match model {
            None => String::new(),
            Some(m) => {
                let mut seen = self.models.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(at) = seen.get_mut(m) {
                    *at = now;
                    m.to_string()
                } else if seen.len() < MAX_MODEL_LABELS || self.free_idle(&mut seen, now) {
                    seen.insert(m.to_string(), now);
                    m.to_string()
                } else {
                    "other".to_string()
                }
            }
        };
        request_labels(name)
    }

    /// Drops the series of the name unused longest, if it has been idle
    /// for [`MODEL_LABEL_IDLE`]; says whether it did.
    fn free_idle(&self, seen: &mut HashMap<String, Instant>, now: Instant) -> bool {
        let idle = seen
            .iter()
            .filter(|(_, &at)| now.saturating_duration_since(at) >= MODEL_LABEL_IDLE)
            .min_by_key(|(_, &at)| at)
            .map(|(name, _)| name.clone());
        let Some(name) = idle else {
            return false;
        };
        seen.remove(&name);
        let labels = request_labels(name);
        self.requests.remove(&labels);
        self.input_tokens.remove(&labels);
        self.cached_tokens.remove(&labels);
        for error_code in ERROR_CODES {
            self.errors.remove(&ErrorLabels {
                model_name: labels.model_name.clone(),
                target_model_name: labels.target_model_name.clone(),
                fairness_id: String::new(),
                priority: String::new(),
                error_code,
            });
        }
        true
    }

    fn error(&self, labels: RequestLabels, error_code: &'static str) {
        self.errors
            .get_or_create(&ErrorLabels {
                model_name: labels.model_name,
                target_model_name: labels.target_model_name,
                fairness_id: labels.fairness_id,
                priority: labels.priority,
                error_code,
            })
            .inc();
    }

    /// A decision for a request for `model`: routed (`Ok`) or refused.
    pub fn decided(&self, model: Option<&str>, result: Result<(), &RouteError>, elapsed: Duration) {
        let labels = self.labels(model);
        self.requests.get_or_create(&labels).inc();
        self.scheduler.observe(elapsed.as_secs_f64());
        if let Err(e) = result {
            self.error(labels, error_code(e));
        }
    }

    /// An engine answered a routed request with a 5xx.
    pub fn engine_error(&self, model: Option<&str>) {
        self.error(self.labels(model), "ModelServerError");
    }

    /// An answer's usage.
    pub fn usage(&self, model: Option<&str>, prompt_tokens: u64, cached_tokens: u64) {
        let labels = self.labels(model);
        self.input_tokens
            .get_or_create(&labels)
            .observe(prompt_tokens as f64);
        self.cached_tokens
            .get_or_create(&labels)
            .observe(cached_tokens as f64);
    }
}

/// The label set of a request for the model labelled `name`.
fn request_labels(name: String) -> RequestLabels {
    RequestLabels {
        target_model_name: name.clone(),
        model_name: name,
        fairness_id: String::new(),
        priority: String::new(),
    }
}

/// The `error_code` of a refusal.
fn error_code(e: &RouteError) -> &'static str {
    match e {
        RouteError::NoReplicaForModel(_) => "BadRequest",
        RouteError::NoHealthyReplica(_) => "ServiceUnavailable",
        RouteError::Saturated => "InferencePoolResourceExhausted",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The registry's text, and how many `llm_d_epp_request_total` series
    /// it holds.
    fn request_series(reg: &Registry) -> (String, usize) {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, reg).unwrap();
        let series = text
            .lines()
            .filter(|l| l.starts_with("llm_d_epp_request_total{"))
            .count();
        (text, series)
    }

    #[test]
    fn model_labels_are_bounded() {
        let mut reg = Registry::default();
        let m = EppMetrics::register(&mut reg);
        for i in 0..MAX_MODEL_LABELS + 50 {
            m.decided(Some(&format!("m{i}")), Ok(()), Duration::ZERO);
        }
        m.decided(Some("m0"), Ok(()), Duration::ZERO);
        let (text, series) = request_series(&reg);
        assert_eq!(series, MAX_MODEL_LABELS + 1, "each seen name and `other`");
        assert!(text.contains(r#"llm_d_epp_request_total{model_name="other",target_model_name="other",fairness_id="",priority=""} 50"#));
        assert!(text.contains(r#"llm_d_epp_request_total{model_name="m0",target_model_name="m0",fairness_id="",priority=""} 2"#));
    }

    #[test]
    fn names_left_idle_give_their_series_to_new_ones() {
        let mut reg = Registry::default();
        let m = EppMetrics::register(&mut reg);
        let t0 = Instant::now();
        // A client's made-up names fill every label; the real model is
        // one of them and stays in use.
        for i in 0..MAX_MODEL_LABELS {
            let l = m.labels_at(Some(&format!("made-up-{i}")), t0);
            m.requests.get_or_create(&l).inc();
        }
        let later = t0 + MODEL_LABEL_IDLE;
        m.labels_at(Some("made-up-7"), later - Duration::from_secs(1));
        // Within the idle time a new model counts as other; after it, it
        // takes the place of the name unused longest.
        assert_eq!(
            m.labels_at(Some("new-model"), t0 + Duration::from_secs(60))
                .model_name,
            "other"
        );
        let l = m.labels_at(Some("new-model"), later);
        assert_eq!(l.model_name, "new-model");
        m.requests.get_or_create(&l).inc();
        let (text, series) = request_series(&reg);
        assert_eq!(series, MAX_MODEL_LABELS, "{text}");
        assert!(text.contains(r#"model_name="new-model""#));
        assert!(
            text.contains(r#"model_name="made-up-7""#),
            "the name in use keeps its series"
        );
        let made_up = text
            .lines()
            .filter(|l| l.starts_with(r#"llm_d_epp_request_total{model_name="made-up-"#))
            .count();
        assert_eq!(
            made_up,
            MAX_MODEL_LABELS - 1,
            "one idle name gave its series up"
        );
    }
}

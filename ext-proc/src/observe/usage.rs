//! What the engines served from cache against what each decision
//! predicted, as metrics: the prediction's error per answer (a histogram
//! of `|predicted - served| / prompt tokens`), answers that carried no
//! usage, and reports whose decision was not found. The matching itself
//! happens where a request ends ([`crate::outcomes`]); the per-replica
//! token counters and corrections come from the router's snapshot
//! ([`super::metrics::FleetCollector`]).

use hearth_router::Served;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Event metrics of the usage loop.
#[derive(Debug)]
pub struct UsageMetrics {
    error: Histogram,
    missing: Counter,
    unmatched: Counter,
    verdicts: Family<ChannelLabel, Counter>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ChannelLabel {
    channel: &'static str,
}

/// How a generation's verdict (its text, its end, its usage) reached the
/// sidecar.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VerdictChannel {
    /// The outcome filter's response trailer, on the request's ext_proc
    /// stream (a streamed answer in the filter shapes).
    Trailer,
    /// The outcome filter's `POST /outcome` (an answer with a
    /// content-length, or one the sidecar did not route).
    Post,
    /// The answer itself, streamed through the sidecar by ext_proc (body
    /// and endpoint-picker shapes).
    Body,
}

impl VerdictChannel {
    fn as_str(self) -> &'static str {
        match self {
            VerdictChannel::Trailer => "trailer",
            VerdictChannel::Post => "post",
            VerdictChannel::Body => "ext_proc_body",
        }
    }
}

impl UsageMetrics {
    pub fn register(reg: &mut Registry) -> Self {
        let m = UsageMetrics {
            error: Histogram::new([0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0]),
            missing: Counter::default(),
            unmatched: Counter::default(),
            verdicts: Family::default(),
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
        reg.register(
            "hearth_answer_verdicts",
            "Generations' 200 answers whose verdict reached the sidecar, by channel: trailer (the outcome filter's response trailer on the request's ext_proc stream), post (its POST /outcome), ext_proc_body (the answer streamed through the sidecar)",
            m.verdicts.clone(),
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

    pub fn verdict(&self, channel: VerdictChannel) {
        self.verdicts
            .get_or_create(&ChannelLabel {
                channel: channel.as_str(),
            })
            .inc();
    }
}

//! A request's end: the one place that turns how a routed request ended
//! into what the router learns from it (its replica's health, the answer's
//! usage against the decision's prediction) and what the observer records
//! of it.
//!
//! Two things report an end, and both come through [`Outcomes::close`]:
//!
//! - the ext_proc stream's end ([`crate::envoy::service`]): the response
//!   status and how Envoy ended the stream, already translated from
//!   Envoy's words into the router's [`Ending`] (in `envoy/`), and, in the
//!   body and endpoint-picker shapes, the answer ext_proc streamed past the
//!   sidecar;
//! - the outcome filter's report (`POST /outcome`, read by
//!   [`crate::envoy::report`]) in the filter shapes, where the answer never
//!   crosses gRPC.
//!
//! **Tickets.** A decision's prediction waits here, whatever the shape,
//! under a *ticket*: a random id the sidecar makes for the routed request
//! and, in the filter shapes, sends along as `x-hearth-ticket` for the
//! outcome filter to name its report by. A client's `x-hearth-*` headers
//! are stripped before ext_proc runs, and the ticket is unguessable, so a
//! client can neither choose the id its answer is matched by nor name
//! another request's decision. Waiting predictions are bounded in count
//! ([`MAX_WAITING`]) and age ([`WAIT_LIMIT`]).
//!
//! **Trust.** Nothing here decides health: the router judges each
//! [`Ending`] ([`hearth_router::health::judge`]), and what a client could
//! have provoked (an empty answer, a 5xx, a timeout) only makes a replica
//! suspect until the sidecar's own probe has spoken.

use std::collections::hash_map::RandomState;
use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hearth_router::health::{judge, Ending, Failure, Outcome};
use hearth_router::{Prediction, Prefill, Router, Usage};
use hearth_wire::outcome::{Answer, Report};

use crate::observe::usage::VerdictChannel;
use crate::observe::Observer;

/// Predictions waiting for their answer, at most (one whose answer never
/// comes must not hold memory for ever).
pub const MAX_WAITING: usize = 65_536;
/// How long a prediction waits for its answer: longer than any answer
/// streams.
pub const WAIT_LIMIT: Duration = Duration::from_secs(30 * 60);

/// Where requests end.
pub struct Outcomes {
    router: Arc<Router>,
    observer: Arc<Observer>,
    waiting: Mutex<Waiting>,
    tickets: Tickets,
}

/// A decision whose answer is awaited.
#[derive(Clone, Debug)]
struct Pending {
    prediction: Prediction,
    /// Gives back the load of the prompt's unread bytes when the answer's
    /// first chunk is reported ([`Outcomes::first_token`]).
    prefill: Prefill,
    /// Envoy's `x-request-id`, for the journal (never for matching).
    request_id: Option<String>,
    /// The model asked for (the metrics' label).
    model: Option<String>,
}

/// How one ext_proc stream ended.
#[derive(Debug)]
pub struct StreamEnd<'a> {
    /// The replica the decision chose.
    pub chosen: usize,
    /// The replica Envoy really used, when it said (after retries, a
    /// fallback).
    pub served: Option<usize>,
    /// `None`: the stream ended before any response (the client left).
    pub ending: Option<Ending>,
    /// The answer ext_proc streamed past the sidecar, scanned to its end
    /// (body and endpoint-picker shapes), with its usage.
    pub answer: Option<(Answer, Option<Usage>)>,
    /// The ticket whose prediction this end closes: set only where the
    /// stream itself carries the answer (elsewhere the report closes it).
    pub ticket: Option<&'a str>,
    pub request_id: Option<&'a str>,
}

/// Why a report changed nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReportRefused {
    /// It names no replica of ours.
    UnknownUpstream,
    /// It names no decision waiting for its answer (no ticket, one this
    /// sidecar never issued, or one already closed or expired), and came
    /// without the control token.
    UnknownTicket,
}

/// One end, whoever reported it.
struct Close<'a> {
    chosen: usize,
    served: Option<usize>,
    ending: Ending,
    usage: Option<Usage>,
    /// The answer was read to its end (a missing usage then counts).
    answer_ended: bool,
    pending: Option<Pending>,
    request_id: Option<&'a str>,
}

impl Outcomes {
    pub fn new(observer: Arc<Observer>) -> Arc<Outcomes> {
        Arc::new(Outcomes {
            router: Arc::clone(observer.router()),
            observer,
            waiting: Mutex::default(),
            tickets: Tickets::default(),
        })
    }

    /// Keeps a routed request's prediction until its answer ends, and
    /// returns the ticket it waits under.
    pub fn issue_ticket(
        &self,
        prediction: Prediction,
        prefill: Prefill,
        request_id: Option<&str>,
        model: Option<&str>,
    ) -> String {
        let ticket = self.tickets.next();
        self.lock().insert(
            &ticket,
            Pending {
                prediction,
                prefill,
                request_id: request_id.map(str::to_string),
                model: model.map(str::to_string),
            },
            Instant::now(),
        );
        ticket
    }

    /// A routed request's first byte is late: a timeout against `replica`
    /// (a suspicion: the router excuses a busy replica, and only a probe
    /// can fence).
    pub fn first_byte_missed(&self, replica: usize) {
        self.router
            .record_request(replica, Outcome::Failure(Failure::Timeout));
    }

    /// An ext_proc stream ended.
    pub fn stream_ended(&self, end: StreamEnd<'_>) {
        self.router.note_stream_end(end.ending.is_some());
        let Some(ending) = end.ending else {
            return;
        };
        let pending = end.ticket.and_then(|t| self.lock().take(t));
        let (usage, answer_ended) = match end.answer {
            Some((_, usage)) => (usage, true),
            None => (None, false),
        };
        self.close(Close {
            chosen: end.chosen,
            served: end.served,
            ending,
            usage,
            answer_ended,
            pending,
            request_id: end.request_id,
        });
    }

    /// The outcome filter saw the first chunk of the answer to the request
    /// whose decision waits under `ticket`: the engine has read its prompt,
    /// so the load its unread bytes weighed is given back (once). `false`
    /// when no decision waits under that ticket. Only the ticket's holder,
    /// the gateway, can name it, and it changes only its own request's
    /// load.
    pub fn first_token(&self, ticket: &str) -> bool {
        // Cloned out, so the lock is not held while the router's is taken.
        let Some(prefill) = self.lock().get(ticket).map(|p| p.prefill.clone()) else {
            return false;
        };
        prefill.done();
        true
    }

    /// The outcome filter's report on a generation's 200 answer.
    /// `authenticated`: the caller showed the control token, so it is the
    /// gateway, whose report on a decision another sidecar made (or one
    /// past its wait) still counts as health evidence, its usage as
    /// unmatched. Without the token, only a report that names a decision
    /// waiting here by its ticket is taken: whoever can post to the admin
    /// port where no token is set (a scraper admitted there) changes
    /// nothing.
    pub fn reported(&self, report: &Report, authenticated: bool) -> Result<(), ReportRefused> {
        let pending = report
            .request_id
            .as_deref()
            .and_then(|t| self.lock().take(t));
        if pending.is_none() && !authenticated {
            return Err(ReportRefused::UnknownTicket);
        }
        let chosen = pending.as_ref().map(|p| p.prediction.replica);
        let served = self
            .router
            .replica_at(&report.upstream, chosen)
            .ok_or(ReportRefused::UnknownUpstream)?;
        let request_id = pending.as_ref().and_then(|p| p.request_id.clone());
        self.observer.verdict(VerdictChannel::Post);
        self.close(Close {
            chosen: served,
            served: Some(served),
            ending: Ending::Answered {
                status: 200,
                answer: Some(report.answer),
            },
            usage: report.usage.map(Into::into),
            answer_ended: report.answer.done,
            pending,
            request_id: request_id.as_deref(),
        });
        Ok(())
    }

    /// The one door: health evidence for the replica that answered (and
    /// for the chosen one, when Envoy retried away from it), then the
    /// answer's usage against the decision's prediction.
    fn close(&self, c: Close<'_>) {
        let answered = c.served.unwrap_or(c.chosen);
        let model = c.pending.as_ref().and_then(|p| p.model.as_deref());
        if matches!(c.ending, Ending::Answered { status: 500.., .. }) {
            self.observer.engine_error(model);
        }
        self.router.record_request(answered, judge(c.ending));
        if answered != c.chosen {
            // Envoy retried away from the primary (connect failure, reset
            // or 503).
            self.router
                .record_request(c.chosen, Outcome::Failure(Failure::Retried));
        }
        let Some(usage) = c.usage else {
            if c.answer_ended {
                self.observer.usage_missing();
            }
            return;
        };
        let prediction = c.pending.as_ref().map(|p| p.prediction);
        if prediction.is_none() {
            self.observer.usage_unmatched();
        }
        if let Some(served) = self
            .router
            .record_usage(answered, prediction.as_ref(), usage)
        {
            self.observer.served(c.request_id, model, &served);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Waiting> {
        self.waiting.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Random, unguessable ids: a per-process keyed hash (SipHash with two
/// random 128-bit keys from the OS) of a counter, 128 bits as hex.
struct Tickets {
    keys: (RandomState, RandomState),
    next: AtomicU64,
}

impl Default for Tickets {
    fn default() -> Self {
        Tickets {
            keys: (RandomState::new(), RandomState::new()),
            next: AtomicU64::new(0),
        }
    }
}

impl Tickets {
    fn next(&self) -> String {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let (a, b) = (self.keys.0.hash_one(n), self.keys.1.hash_one(n));
        format!("{a:016x}{b:016x}")
    }
}

/// Predictions by ticket, bounded in count and age.
#[derive(Debug, Default)]
struct Waiting {
    by_ticket: HashMap<String, (Pending, Instant)>,
    /// Issue order, for expiry (tickets already taken are skipped).
    order: VecDeque<(Instant, String)>,
}

impl Waiting {
    fn insert(&mut self, ticket: &str, pending: Pending, now: Instant) {
        self.by_ticket.insert(ticket.to_string(), (pending, now));
        self.order.push_back((now, ticket.to_string()));
        while let Some((at, _)) = self.order.front() {
            // Taken tickets stay in the order until they reach its front:
            // bound it too.
            let full = self.by_ticket.len() > MAX_WAITING || self.order.len() > 2 * MAX_WAITING;
            if !full && now.saturating_duration_since(*at) < WAIT_LIMIT {
                break;
            }
            let (_, old) = self.order.pop_front().expect("front exists");
            self.by_ticket.remove(&old);
        }
    }

    fn take(&mut self, ticket: &str) -> Option<Pending> {
        self.by_ticket.remove(ticket).map(|(p, _)| p)
    }

    fn get(&self, ticket: &str) -> Option<&Pending> {
        self.by_ticket.get(ticket).map(|(p, _)| p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A decision's prefill handle (one for every fixture: the tests here
    /// never report a first chunk).
    fn prefill() -> Prefill {
        static ONE: std::sync::OnceLock<Prefill> = std::sync::OnceLock::new();
        ONE.get_or_init(|| {
            let specs = ["127.0.0.1:1".parse().expect("an upstream")];
            let router = Router::new(Default::default(), &specs);
            let decision = router
                .decide(&Default::default())
                .expect("a replica to decide on");
            decision.prefill().clone()
        })
        .clone()
    }

    fn pending(blocks: u32) -> Pending {
        Pending {
            prediction: Prediction {
                replica: 0,
                key: ("127.0.0.1:1".parse().unwrap(), None),
                blocks,
                overlap: blocks,
                mirrored: false,
                held_bytes: u64::from(blocks) * 2048,
                held_tokens: None,
                tip: None,
                prompt_bytes: 4096,
                conversation: Some(1),
                compare: true,
                stamp: None,
                decided_at: std::time::Instant::now(),
                previous_engine_tip: None,
            },
            prefill: prefill(),
            request_id: None,
            model: None,
        }
    }

    #[test]
    fn tickets_are_unique_and_unguessable_in_form() {
        let t = Tickets::default();
        let (a, b) = (t.next(), t.next());
        assert_ne!(a, b);
        assert_eq!(a.len(), 32);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit()));
        // Another process (other keys) issues other tickets for the same
        // counter.
        assert_ne!(Tickets::default().next(), Tickets::default().next());
    }

    #[test]
    fn a_prediction_is_taken_once() {
        let mut w = Waiting::default();
        let now = Instant::now();
        w.insert("a", pending(3), now);
        assert_eq!(w.take("a").map(|p| p.prediction.blocks), Some(3));
        assert!(w.take("a").is_none());
        assert!(w.take("never-issued").is_none());
    }

    #[test]
    fn predictions_age_out_and_are_bounded() {
        assert_eq!(MAX_WAITING, 65_536);
        assert_eq!(WAIT_LIMIT, Duration::from_secs(30 * 60));
        let mut w = Waiting::default();
        let t0 = Instant::now();
        w.insert("old", pending(1), t0);
        w.insert("new", pending(2), t0 + WAIT_LIMIT);
        assert!(w.take("old").is_none());
        assert!(w.take("new").is_some());
        for k in 0..MAX_WAITING + 10 {
            w.insert(&k.to_string(), pending(1), t0 + WAIT_LIMIT);
        }
        assert_eq!(w.by_ticket.len(), MAX_WAITING);
        assert!(w.take("0").is_none());
        assert!(w.take(&(MAX_WAITING + 9).to_string()).is_some());
    }
}

//! Replica health: passive signals from real traffic and active probes.
//!
//! A replica is *serving* or *fenced*. Only the sidecar's own observation
//! can fence it: its probes, connections to the engine that cannot be made,
//! and an engine whose own work counters stand still under real requests.
//! A run of `eject_after` consecutive such failures
//! (*strikes*) fences the replica for a backoff that doubles with every
//! fencing in a row (capped). When the backoff has run out, the replica
//! stays fenced until a probe succeeds: a probe lists the models and asks
//! for a one-token completion, so an engine that answers `/health` and
//! `/v1/models` but never generates is never re-admitted.
//!
//! **Suspicion.** What a client can shape never fences: an answer with no
//! text (a stop string, a logit bias, a tiny `max_tokens` make one), a 5xx
//! (a malformed request can make one), a first-byte timeout (a flood of
//! long prompts makes one), a connection the engine closed or reset after
//! taking the request but before answering (an overloaded engine's server
//! does that, and so can a request it cannot parse), a retry away from the
//! replica, or a peer sidecar's word. Such evidence makes the replica
//! *suspect*: it keeps
//! serving, and the sidecar probes it at once, whatever it is running, at
//! most once per `suspect_probe_interval` (so no client can turn
//! suspicion into probe load, or into evictions on a slot-based engine).
//! A probe that fails is a strike, and the next probe follows after
//! `probe_retry`; a probe or a real generation that succeeds clears the
//! suspicion. A broken engine (200 with nothing, or never a first byte)
//! still fails its probes, so it is still fenced, by its probes.
//!
//! Probe timeouts are excused on a replica that completed a real request
//! within `busy_grace`, and on one running real requests none of which
//! missed its first-byte deadline (the probe waited behind them): a busy
//! replica is slow, not broken.
//!
//! **Evidence before probes.** A real generation that succeeded is the
//! proof of health, and it costs the engine nothing; a probe costs a
//! generation and, on slot-based engines, possibly a paused conversation's
//! cache. [`ReplicaHealth::probe_due`] therefore asks for a probe only
//! where no real success proves the replica within the probe interval: a
//! fenced replica whose backoff is over (to re-admit it), a suspect one (a
//! failure since its last success, to confirm or clear it quickly), and an
//! idle one (at most once per interval). A serving replica with real
//! requests running gets no probe: their outcome (or their first-byte
//! deadline) is the evidence, and a probe would queue behind them, or, on
//! an engine with few slots, take one from a paused conversation.
//!
//! **Credentials.** An engine that refuses the sidecar's own requests
//! (401/403 to a probe or a metrics scrape) has a credentials problem, not
//! a health problem: it is reported, never fenced for it. A fenced replica
//! whose probe is refused for credentials cannot prove itself by probe, so
//! after its backoff it is let back on trial: serving, one failure away
//! from being fenced again.

use std::time::{Duration, Instant};

use hearth_wire::outcome::Answer;
use serde::{Deserialize, Serialize};

/// Knobs of the health logic (all settings, see `config.rs`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HealthParams {
    /// Consecutive failures that fence a replica.
    pub eject_after: u32,
    /// First fencing lasts this long; each fencing in a row doubles it.
    pub backoff: Duration,
    pub max_backoff: Duration,
    /// A real success this recent excuses a timeout.
    pub busy_grace: Duration,
    /// A replica with no real success for this long gets a probe, and at
    /// most one per interval while it stays idle (zero: never probed).
    pub probe_interval: Duration,
    /// A replica with a strike (a failed probe, a refused connection)
    /// since its last success is probed again this soon after its last
    /// probe.
    pub probe_retry: Duration,
    /// A replica made suspect by evidence a client could have provoked is
    /// probed at most this often.
    pub suspect_probe_interval: Duration,
    /// A replica with real requests running or queued whose engine's own
    /// work counters have not moved for this long is stalled: a strike
    /// every `probe_retry` while it stays so (zero: never).
    pub stall_after: Duration,
}

impl Default for HealthParams {
    fn default() -> Self {
        HealthParams {
            eject_after: 3,
            backoff: Duration::from_secs(5),
            max_backoff: Duration::from_secs(120),
            busy_grace: Duration::from_secs(30),
            probe_interval: Duration::from_secs(30),
            probe_retry: Duration::from_secs(2),
            suspect_probe_interval: Duration::from_secs(10),
            stall_after: Duration::from_secs(30),
        }
    }
}

/// Why a request or probe failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Failure {
    /// The engine answered 5xx.
    ServerError,
    /// No connection to the engine could be made (refused, unreachable,
    /// or not established in time).
    ConnectFailure,
    /// A connection the engine had accepted was closed or reset before any
    /// byte of the answer: evidence, not proof (an engine's server under
    /// overload closes connections it has not read yet, and a request it
    /// cannot parse can end the same way).
    ConnectionReset,
    /// No answer in time.
    Timeout,
    /// HTTP 200 without any generated text (or without an end marker).
    EmptyAnswer,
    /// A probe's model listing failed.
    ProbeModels,
    /// Envoy retried the request away from it (connect failure, reset or
    /// 503 on the first attempt).
    Retried,
    /// A peer sidecar fenced it (a hint, until a probe here agrees).
    PeerFenced,
    /// Real requests ran or waited on it while the engine's own work
    /// counters stood still for `stall_after`.
    Stalled,
}

impl Failure {
    /// The sidecar saw this itself, and no client can cause it: no
    /// connection to the engine could be made, or the engine's own work
    /// counters stood still. Everything else a real request shows is
    /// suspicion only.
    pub fn is_own_observation(self) -> bool {
        matches!(self, Failure::ConnectFailure | Failure::Stalled)
    }
}

impl Failure {
    pub fn as_str(self) -> &'static str {
        match self {
            Failure::ServerError => "server_error",
            Failure::ConnectFailure => "connect_failure",
            Failure::ConnectionReset => "connection_reset",
            Failure::Timeout => "timeout",
            Failure::EmptyAnswer => "empty_answer",
            Failure::ProbeModels => "probe_models",
            Failure::Retried => "retried",
            Failure::PeerFenced => "peer_fenced",
            Failure::Stalled => "stalled",
        }
    }
}

/// The outcome of one real request or one probe.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Success,
    Failure(Failure),
    /// Nothing to learn (client gave up first, 4xx, ...).
    Neutral,
    /// The engine refused the sidecar's own credentials (401 or 403 to a
    /// probe): a configuration problem, never a reason to fence.
    Unauthorized(u16),
}

/// A replica's health as shown on `/state` and `/health`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HealthState {
    Serving,
    /// Fenced: receives no traffic until a probe succeeds after the backoff.
    Fenced,
}

#[derive(Clone, Debug)]
pub struct ReplicaHealth {
    state: HealthState,
    consecutive_failures: u32,
    /// Fencings in a row without a success in between (sets the backoff).
    fencings: u32,
    fenced_until: Option<Instant>,
    last_failure: Option<Failure>,
    /// The last real request that generated (not a probe).
    last_served: Option<Instant>,
    /// The last probe's end, whatever it found.
    last_probe: Option<Instant>,
    /// The last probe that ended while the replica was suspect: suspicion
    /// is probed at most once per `suspect_probe_interval` by this clock
    /// (an idle probe a moment ago does not delay it).
    last_suspect_probe: Option<Instant>,
    /// Evidence a client could have provoked, not yet cleared by a
    /// success or confirmed by a probe.
    suspect: Option<Failure>,
    pub suspicions_total: u64,
    /// The status with which the engine refused the sidecar's probes, and
    /// its metrics scrapes, until one is accepted.
    probe_refused: Option<u16>,
    metrics_refused: Option<u16>,
    pub fenced_total: u64,
    /// The engine exports a work counter (see [`ReplicaHealth::record_progress`]).
    progress_known: bool,
    /// The last scrape at which the engine's work counters had moved.
    last_progress: Option<Instant>,
    /// Since when real requests have run or waited on it without a pause.
    working_since: Option<Instant>,
    /// The last strike for a stall.
    last_stall_strike: Option<Instant>,
}

impl Default for ReplicaHealth {
    fn default() -> Self {
        ReplicaHealth {
            state: HealthState::Serving,
            consecutive_failures: 0,
            fencings: 0,
            fenced_until: None,
            last_failure: None,
            last_served: None,
            last_probe: None,
            last_suspect_probe: None,
            suspect: None,
            suspicions_total: 0,
            probe_refused: None,
            metrics_refused: None,
            fenced_total: 0,
            progress_known: false,
            last_progress: None,
            working_since: None,
            last_stall_strike: None,
        }
    }
}

/// Health figures for the state endpoint.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct HealthSnapshot {
    pub state: HealthState,
    pub consecutive_failures: u32,
    pub last_failure: Option<Failure>,
    /// Set while evidence a client could have provoked waits for a probe
    /// to confirm or clear it.
    pub suspect: Option<Failure>,
    pub suspicions_total: u64,
    /// Seconds until a probe may re-admit the replica (fenced only).
    pub fenced_for_s: Option<f64>,
    pub fenced_total: u64,
    /// Seconds since a real request last succeeded on it (none yet: null).
    pub last_served_s_ago: Option<f64>,
    /// Set while the engine refuses the sidecar's credentials: what it
    /// refused and with which status (see `HEARTH_ENGINE_API_KEY`).
    pub credentials_error: Option<String>,
}

/// The real work on a replica, as [`ReplicaHealth::probe_due`] weighs it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Work {
    /// Real requests running or queued there (this sidecar's, its
    /// peers', and the engine's own count).
    pub running: u32,
    /// Some wait rather than run: the engine reports a queue, or this
    /// sidecar's requests are more than the engine says it runs (on their
    /// way, or queued; without fresh engine figures, any of them).
    pub queued: bool,
}

impl Work {
    /// Nothing runs or waits.
    pub const IDLE: Work = Work {
        running: 0,
        queued: false,
    };

    /// `n` requests running, none queued.
    pub fn running(n: u32) -> Work {
        Work {
            running: n,
            queued: false,
        }
    }
}

/// Why a probe is due.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProbeReason {
    /// Fenced, backoff over: a success re-admits it.
    Readmit,
    /// A strike since its last success, or evidence a client could have
    /// provoked: confirm or clear.
    Suspect,
    /// No real success within the probe interval.
    Idle,
}

impl ReplicaHealth {
    pub fn state(&self) -> HealthState {
        self.state
    }

    pub fn is_serving(&self) -> bool {
        self.state == HealthState::Serving
    }

    /// When a real request last succeeded on it.
    pub fn last_served(&self) -> Option<Instant> {
        self.last_served
    }

    /// A real request's outcome. A success clears suspicion and strikes;
    /// a fenced replica stays fenced (only the sidecar's own probe, once
    /// the backoff has run out, re-admits one: a success is what an
    /// outcome report says, and a report can be forged where reports need
    /// no token). A connection that could not be made is a strike; any
    /// other failure makes the replica suspect (a timeout only when it
    /// served no real request within `busy_grace`).
    pub fn record_request(&mut self, outcome: Outcome, p: &HealthParams, now: Instant) {
        match outcome {
            Outcome::Success => {
                self.last_served = Some(now);
                if self.state != HealthState::Fenced {
                    self.succeed();
                }
            }
            Outcome::Failure(Failure::Timeout) if self.busy(p, now) => {}
            Outcome::Failure(f) if f.is_own_observation() => self.fail(f, p, now),
            Outcome::Failure(f) => self.suspect(f),
            Outcome::Neutral | Outcome::Unauthorized(_) => {}
        }
    }

    /// Evidence a client could have provoked: probe soon, fence only on
    /// the probe's word.
    fn suspect(&mut self, f: Failure) {
        if self.state == HealthState::Fenced {
            return;
        }
        self.last_failure = Some(f);
        if self.suspect.is_none() {
            self.suspicions_total += 1;
        }
        self.suspect = Some(f);
    }

    /// Whether the replica waits for a probe to confirm or clear evidence
    /// a client could have provoked.
    pub fn is_suspect(&self) -> bool {
        self.suspect.is_some()
    }

    /// A probe's outcome, with the number of real requests running or
    /// queued on the replica now. A probe success clears suspicion and
    /// re-admits a fenced replica once its backoff has run out; a failure
    /// is a strike; a timeout is excused on a busy replica (a real success
    /// or engine progress within `busy_grace`), or on one with requests
    /// running none of which missed its first-byte deadline.
    pub fn record_probe(&mut self, outcome: Outcome, p: &HealthParams, now: Instant, running: u32) {
        self.last_probe = Some(now);
        if self.suspect.is_some() {
            self.last_suspect_probe = Some(now);
        }
        let backoff_over = self.fenced_until.is_none_or(|t| now >= t);
        if !matches!(outcome, Outcome::Unauthorized(_)) {
            self.probe_refused = None;
        }
        match outcome {
            Outcome::Success => {
                if self.state == HealthState::Fenced && !backoff_over {
                    return;
                }
                self.succeed();
            }
            // Behind running requests, unless one of them missed its own
            // first-byte deadline (then the engine may be stuck).
            Outcome::Failure(Failure::Timeout)
                if (running > 0 && self.suspect != Some(Failure::Timeout)) || self.busy(p, now) => {
            }
            Outcome::Failure(f) => self.fail(f, p, now),
            Outcome::Neutral => {}
            Outcome::Unauthorized(status) => {
                self.probe_refused = Some(status);
                if self.state == HealthState::Fenced && backoff_over {
                    // On trial: one more failure fences it again.
                    self.state = HealthState::Serving;
                    self.fenced_until = None;
                    self.consecutive_failures = p.eject_after.saturating_sub(1);
                }
            }
        }
    }

    /// A metrics scrape's answer: refused with this status, or accepted.
    pub fn record_scrape(&mut self, refused: Option<u16>) {
        self.metrics_refused = refused;
    }

    /// One reading of the engine's own figures at `at`: whether it reports
    /// requests running or queued, and whether its work counters moved
    /// since the last reading (`None`: it exports none). Requests that
    /// run or wait while the counters stand still for `stall_after` are a
    /// stall, the engine's own evidence and no client's: a strike, and
    /// another every `probe_retry` while it lasts. A client can keep an
    /// engine busy, never keep its counters still.
    pub fn record_reading(
        &mut self,
        p: &HealthParams,
        at: Instant,
        working: bool,
        moved: Option<bool>,
    ) {
        self.progress_known = moved.is_some();
        if moved == Some(true) {
            self.last_progress = Some(at);
        }
        if !working {
            self.working_since = None;
            return;
        }
        let since = *self.working_since.get_or_insert(at);
        if !self.progress_known || p.stall_after.is_zero() || self.state == HealthState::Fenced {
            return;
        }
        let quiet_from = self.last_progress.map_or(since, |t| t.max(since));
        let stalled = at.saturating_duration_since(quiet_from) >= p.stall_after;
        let struck_recently = self
            .last_stall_strike
            .is_some_and(|t| at.saturating_duration_since(t) < p.probe_retry);
        if stalled && !struck_recently {
            self.last_stall_strike = Some(at);
            self.fail(Failure::Stalled, p, at);
        }
    }

    /// Whether a probe is due now, and why (see the module's notes), with
    /// the real work on the replica now.
    pub fn probe_due(&self, p: &HealthParams, now: Instant, work: Work) -> Option<ProbeReason> {
        if p.probe_interval.is_zero() {
            return None;
        }
        let since = |t: Option<Instant>| t.map(|t| now.saturating_duration_since(t));
        let probed_within = |d: Duration| since(self.last_probe).is_some_and(|s| s < d);
        if self.state == HealthState::Fenced {
            // No conversation is kept on a fenced replica, so its probe
            // costs nothing a client is waiting for.
            let backoff_over = self.fenced_until.is_none_or(|t| now >= t);
            return (backoff_over && !probed_within(p.probe_retry)).then_some(ProbeReason::Readmit);
        }
        // Never behind queued work: the probe would wait there, prove
        // nothing the queued requests will not, and then, on a slot
        // engine, take the slot of a conversation that just paused. A
        // stuck engine is caught by its own counters meanwhile
        // (`record_reading`).
        if work.queued {
            return None;
        }
        // Confirming or clearing goes alongside running requests (not
        // behind them: nothing is queued): their outcomes cannot fence,
        // the probe's can.
        if self.consecutive_failures > 0 {
            return (!probed_within(p.probe_retry)).then_some(ProbeReason::Suspect);
        }
        if self.suspect.is_some() {
            let recent =
                since(self.last_suspect_probe).is_some_and(|s| s < p.suspect_probe_interval);
            return (!recent && !probed_within(p.probe_retry)).then_some(ProbeReason::Suspect);
        }
        // An idle probe only where nothing at all runs: a running
        // request's outcome is the evidence.
        if work.running > 0 {
            return None;
        }
        let served_within = since(self.last_served).is_some_and(|s| s < p.probe_interval);
        (!served_within && !probed_within(p.probe_interval)).then_some(ProbeReason::Idle)
    }

    /// A peer sidecar fenced the replica: suspect here, until this
    /// sidecar's own probe agrees (a strike) or clears it.
    pub fn fence_by_peer(&mut self) {
        self.suspect(Failure::PeerFenced);
    }

    /// A peer sidecar re-admitted the replica (its probe succeeded): the
    /// backoff here is over, so the next probe may re-admit it here too.
    pub fn readmit_by_peer(&mut self, now: Instant) {
        if self.state == HealthState::Fenced {
            self.fenced_until = Some(now);
            self.last_probe = None;
        }
    }

    /// A real request succeeded within `busy_grace`: slow, not broken.
    /// (The engine's counters are no such excuse: an engine that stalled
    /// a moment ago moved them a moment before.)
    fn busy(&self, p: &HealthParams, now: Instant) -> bool {
        self.last_served
            .is_some_and(|t| now.saturating_duration_since(t) < p.busy_grace)
    }

    fn succeed(&mut self) {
        self.state = HealthState::Serving;
        self.suspect = None;
        self.consecutive_failures = 0;
        self.fencings = 0;
        self.fenced_until = None;
    }

    fn fail(&mut self, f: Failure, p: &HealthParams, now: Instant) {
        self.last_failure = Some(f);
        self.consecutive_failures = self.consecutive_failures.saturating_add(1);
        if self.state == HealthState::Fenced {
            // Still broken: a failed probe restarts the (longer) backoff.
            if self.fenced_until.is_none_or(|t| now >= t) {
                self.fence(p, now);
            }
            return;
        }
        if self.consecutive_failures >= p.eject_after {
            self.fence(p, now);
        }
    }

    fn fence(&mut self, p: &HealthParams, now: Instant) {
        let factor = 1u32 << self.fencings.min(16);
        let backoff = p.backoff.saturating_mul(factor).min(p.max_backoff);
        self.fencings = self.fencings.saturating_add(1);
        if self.state == HealthState::Serving {
            self.fenced_total += 1;
        }
        self.state = HealthState::Fenced;
        self.suspect = None;
        self.fenced_until = Some(now + backoff);
    }

    pub fn snapshot(&self, now: Instant) -> HealthSnapshot {
        HealthSnapshot {
            state: self.state,
            consecutive_failures: self.consecutive_failures,
            last_failure: self.last_failure,
            suspect: self.suspect,
            suspicions_total: self.suspicions_total,
            fenced_for_s: match (self.state, self.fenced_until) {
                (HealthState::Fenced, Some(t)) => {
                    Some(t.saturating_duration_since(now).as_secs_f64())
                }
                _ => None,
            },
            fenced_total: self.fenced_total,
            last_served_s_ago: self
                .last_served
                .map(|t| now.saturating_duration_since(t).as_secs_f64()),
            credentials_error: self.credentials_error(),
        }
    }

    /// What the engine refuses of the sidecar's own requests, if anything.
    pub fn credentials_error(&self) -> Option<String> {
        let what = [
            ("probe", self.probe_refused),
            ("metrics", self.metrics_refused),
        ];
        let refused: Vec<String> = what
            .iter()
            .filter_map(|(w, s)| s.map(|s| format!("{w}: HTTP {s}")))
            .collect();
        (!refused.is_empty()).then(|| {
            format!(
                "the engine refuses the sidecar's credentials ({}); set HEARTH_ENGINE_API_KEY",
                refused.join(", ")
            )
        })
    }
}

/// The fleet's overall health, as `GET /health` reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FleetHealth {
    /// Every replica serving.
    Ok,
    /// Some replicas fenced.
    Degraded,
    /// No replica serving.
    Unhealthy,
}

impl FleetHealth {
    pub fn of(states: impl IntoIterator<Item = HealthState>) -> FleetHealth {
        let (mut serving, mut total) = (0, 0);
        for s in states {
            total += 1;
            serving += usize::from(s == HealthState::Serving);
        }
        match serving {
            0 => FleetHealth::Unhealthy,
            n if n == total => FleetHealth::Ok,
            _ => FleetHealth::Degraded,
        }
    }
}

/// How a routed request ended, in the router's words (the sidecar
/// translates Envoy's response code details, or the outcome filter's
/// report, into one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ending {
    /// No response came: the client went away first.
    Unanswered,
    /// No connection to the engine could be made.
    ConnectionFailed,
    /// The engine closed or reset the connection after taking the request,
    /// before any byte of the answer.
    ConnectionReset,
    /// The engine (or the gateway for it) gave up waiting.
    TimedOut,
    /// The engine answered with `status`; for a generation's 200, what its
    /// body showed when something scanned it.
    Answered { status: u16, answer: Option<Answer> },
}

/// What a finished request says about its replica.
pub fn judge(ending: Ending) -> Outcome {
    match ending {
        Ending::Unanswered => Outcome::Neutral,
        Ending::ConnectionFailed => Outcome::Failure(Failure::ConnectFailure),
        Ending::ConnectionReset => Outcome::Failure(Failure::ConnectionReset),
        Ending::TimedOut | Ending::Answered { status: 504, .. } => {
            Outcome::Failure(Failure::Timeout)
        }
        Ending::Answered { status, answer } => match status {
            500..=599 => Outcome::Failure(Failure::ServerError),
            200 => match answer {
                Some(a) if a.text && a.done => Outcome::Success,
                Some(_) => Outcome::Failure(Failure::EmptyAnswer),
                // No verdict: not a generation, or judged elsewhere.
                None => Outcome::Neutral,
            },
            _ => Outcome::Neutral,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p() -> HealthParams {
        HealthParams {
            eject_after: 3,
            backoff: Duration::from_secs(10),
            max_backoff: Duration::from_secs(40),
            busy_grace: Duration::from_secs(30),
            probe_interval: Duration::from_secs(30),
            probe_retry: Duration::from_secs(2),
            suspect_probe_interval: Duration::from_secs(10),
            stall_after: Duration::from_secs(30),
        }
    }

    #[test]
    fn real_traffic_replaces_probes_and_idle_replicas_are_probed_once_per_interval() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut h = ReplicaHealth::default();
        // Never served, never probed: idle.
        assert_eq!(h.probe_due(&p(), t0, Work::IDLE), Some(ProbeReason::Idle));
        h.record_probe(Outcome::Success, &p(), t0, 0);
        assert_eq!(h.probe_due(&p(), t0 + s(29), Work::IDLE), None);
        assert_eq!(
            h.probe_due(&p(), t0 + s(30), Work::IDLE),
            Some(ProbeReason::Idle)
        );
        // Real successes keep proving it: no probe however long it runs.
        for k in 1..10 {
            h.record_request(Outcome::Success, &p(), t0 + s(20 * k));
            assert_eq!(h.probe_due(&p(), t0 + s(20 * k + 25), Work::IDLE), None);
        }
        // A failure makes it suspect: probed at once, then after the retry
        // delay while its probes fail.
        let t1 = t0 + s(200);
        h.record_request(Outcome::Failure(Failure::ServerError), &p(), t1);
        assert_eq!(
            h.probe_due(&p(), t1, Work::IDLE),
            Some(ProbeReason::Suspect)
        );
        h.record_probe(Outcome::Failure(Failure::ServerError), &p(), t1, 0);
        assert_eq!(h.probe_due(&p(), t1 + s(1), Work::IDLE), None);
        assert_eq!(
            h.probe_due(&p(), t1 + s(2), Work::IDLE),
            Some(ProbeReason::Suspect)
        );
        h.record_probe(Outcome::Failure(Failure::ServerError), &p(), t1 + s(2), 0);
        assert!(h.is_serving(), "two strikes");
        h.record_probe(Outcome::Failure(Failure::ServerError), &p(), t1 + s(4), 0);
        // Fenced: no probe until the backoff (10 s) is over.
        assert_eq!(h.state(), HealthState::Fenced);
        assert_eq!(h.probe_due(&p(), t1 + s(13), Work::IDLE), None);
        assert_eq!(
            h.probe_due(&p(), t1 + s(14), Work::IDLE),
            Some(ProbeReason::Readmit)
        );
        // Probes off.
        let off = HealthParams {
            probe_interval: Duration::ZERO,
            ..p()
        };
        assert_eq!(
            ReplicaHealth::default().probe_due(&off, t0, Work::IDLE),
            None
        );
    }

    #[test]
    fn refused_credentials_never_fence_and_let_a_fenced_replica_back_on_trial() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut h = ReplicaHealth::default();
        for k in 0..10 {
            h.record_probe(Outcome::Unauthorized(401), &p(), t0 + s(k), 0);
        }
        assert!(h.is_serving());
        let snap = h.snapshot(t0);
        assert!(snap.credentials_error.unwrap().contains("probe: HTTP 401"));
        // Real requests still prove it.
        h.record_request(Outcome::Success, &p(), t0 + s(11));
        assert_eq!(h.probe_due(&p(), t0 + s(12), Work::IDLE), None);
        // Fenced by refused connections, with the probe refused: after the
        // backoff it serves again, one failure away from another fencing.
        for _ in 0..3 {
            h.record_request(Outcome::Failure(Failure::ConnectFailure), &p(), t0 + s(12));
        }
        assert_eq!(h.state(), HealthState::Fenced);
        h.record_probe(Outcome::Unauthorized(401), &p(), t0 + s(15), 0);
        assert_eq!(h.state(), HealthState::Fenced, "backoff not over");
        h.record_probe(Outcome::Unauthorized(401), &p(), t0 + s(23), 0);
        assert!(h.is_serving());
        h.record_request(Outcome::Failure(Failure::ConnectFailure), &p(), t0 + s(24));
        assert_eq!(h.state(), HealthState::Fenced);
        // An accepted probe clears the report; a refused scrape sets it.
        h.record_probe(Outcome::Success, &p(), t0 + s(100), 0);
        assert_eq!(h.credentials_error(), None);
        h.record_scrape(Some(403));
        assert!(h.credentials_error().unwrap().contains("metrics: HTTP 403"));
        h.record_scrape(None);
        assert_eq!(h.credentials_error(), None);
    }

    #[test]
    fn a_busy_replica_is_not_struck_for_a_first_byte_timeout() {
        let t0 = Instant::now();
        let mut h = ReplicaHealth::default();
        h.record_request(Outcome::Success, &p(), t0);
        for i in 0..5 {
            let at = t0 + Duration::from_secs(i);
            h.record_request(Outcome::Failure(Failure::Timeout), &p(), at);
        }
        assert!(h.is_serving());
        assert_eq!(h.snapshot(t0).consecutive_failures, 0);
        assert!(!h.is_suspect());
        // Once the grace is over a timeout makes it suspect, however many
        // come: only its probes can fence it.
        let later = t0 + Duration::from_secs(31);
        for _ in 0..5 {
            h.record_request(Outcome::Failure(Failure::Timeout), &p(), later);
        }
        assert!(h.is_serving() && h.is_suspect());
        assert_eq!(
            h.probe_due(&p(), later, Work::running(2)),
            Some(ProbeReason::Suspect)
        );
        for k in 0..3 {
            h.record_probe(
                Outcome::Failure(Failure::Timeout),
                &p(),
                later + Duration::from_secs(2 * k),
                2,
            );
        }
        assert_eq!(h.state(), HealthState::Fenced);
    }

    #[test]
    fn consecutive_failures_fence_and_a_success_resets_the_count() {
        let t0 = Instant::now();
        let mut h = ReplicaHealth::default();
        let fail = Outcome::Failure(Failure::ConnectFailure);
        h.record_request(fail, &p(), t0);
        h.record_request(fail, &p(), t0);
        h.record_request(Outcome::Success, &p(), t0);
        h.record_request(fail, &p(), t0);
        h.record_request(fail, &p(), t0);
        assert!(h.is_serving(), "two in a row after a success");
        h.record_request(fail, &p(), t0);
        assert_eq!(h.state(), HealthState::Fenced);
        assert_eq!(h.fenced_total, 1);
    }

    #[test]
    fn connections_closed_before_an_answer_only_raise_suspicion_and_a_probe_settles_it() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let reset = Outcome::Failure(Failure::ConnectionReset);
        // An overloaded engine closes many connections it took: however
        // many, the replica keeps serving, and a probe is due at once.
        let mut h = ReplicaHealth::default();
        for _ in 0..20 {
            h.record_request(reset, &p(), t0);
        }
        assert!(h.is_serving());
        assert_eq!(h.snapshot(t0).consecutive_failures, 0);
        assert_eq!(h.snapshot(t0).suspect, Some(Failure::ConnectionReset));
        assert_eq!(h.suspicions_total, 1, "one suspicion until settled");
        assert_eq!(
            h.probe_due(&p(), t0, Work::IDLE),
            Some(ProbeReason::Suspect)
        );
        // Its probe generates: the suspicion is cleared.
        h.record_probe(Outcome::Success, &p(), t0 + s(1), 0);
        assert!(!h.is_suspect());
        // An engine that closes every connection fails its probes too, and
        // they fence it.
        let mut broken = ReplicaHealth::default();
        broken.record_request(reset, &p(), t0);
        for k in 0..p().eject_after {
            broken.record_probe(reset, &p(), t0 + s(1 + 2 * u64::from(k)), 0);
        }
        assert_eq!(broken.state(), HealthState::Fenced);
    }

    #[test]
    fn probes_readmit_only_after_the_backoff_and_failures_double_it() {
        let t0 = Instant::now();
        let mut h = ReplicaHealth::default();
        for _ in 0..3 {
            h.record_request(Outcome::Failure(Failure::ConnectFailure), &p(), t0);
        }
        h.record_probe(Outcome::Success, &p(), t0 + Duration::from_secs(5), 0);
        assert!(!h.is_serving(), "backoff (10 s) not over");
        // A failed probe after the backoff fences again, for twice as long.
        h.record_probe(
            Outcome::Failure(Failure::Timeout),
            &p(),
            t0 + Duration::from_secs(11),
            0,
        );
        assert!(!h.is_serving());
        let snap = h.snapshot(t0 + Duration::from_secs(11));
        assert_eq!(snap.fenced_for_s, Some(20.0));
        h.record_probe(Outcome::Success, &p(), t0 + Duration::from_secs(25), 0);
        assert!(!h.is_serving());
        h.record_probe(Outcome::Success, &p(), t0 + Duration::from_secs(31), 0);
        assert!(h.is_serving());
        assert_eq!(h.fenced_total, 1, "one fencing episode");
    }

    #[test]
    fn backoff_is_capped() {
        let t0 = Instant::now();
        let mut h = ReplicaHealth::default();
        let mut now = t0;
        for _ in 0..3 {
            h.record_request(Outcome::Failure(Failure::Timeout), &p(), now);
        }
        for _ in 0..6 {
            now += Duration::from_secs(100);
            h.record_probe(Outcome::Failure(Failure::ProbeModels), &p(), now, 0);
        }
        assert_eq!(h.snapshot(now).fenced_for_s, Some(40.0));
    }

    #[test]
    fn a_recent_real_success_excuses_a_probe_timeout() {
        let t0 = Instant::now();
        let mut h = ReplicaHealth::default();
        h.record_request(Outcome::Success, &p(), t0);
        for i in 0..5 {
            h.record_probe(
                Outcome::Failure(Failure::Timeout),
                &p(),
                t0 + Duration::from_secs(i),
                0,
            );
        }
        assert!(h.is_serving(), "busy, not broken");
        // Without a recent success the same timeouts fence it.
        let later = t0 + Duration::from_secs(60);
        for _ in 0..3 {
            h.record_probe(Outcome::Failure(Failure::Timeout), &p(), later, 0);
        }
        assert!(!h.is_serving());
    }

    #[test]
    fn a_replica_running_real_requests_gets_no_idle_probe_and_a_probe_timeout_there_is_excused() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut h = ReplicaHealth::default();
        // A fresh replica whose first (cold, slow) requests are running:
        // their outcome is the evidence, no probe is sent.
        assert_eq!(h.probe_due(&p(), t0, Work::running(2)), None);
        assert_eq!(h.probe_due(&p(), t0, Work::IDLE), Some(ProbeReason::Idle));
        // A probe sent just before they arrived times out behind them:
        // never a strike, however often, while they run.
        for k in 0..5 {
            h.record_probe(Outcome::Failure(Failure::Timeout), &p(), t0 + s(k), 1);
        }
        assert!(h.is_serving());
        assert_eq!(h.snapshot(t0).consecutive_failures, 0);
        // Other probe failures still count while requests run.
        for k in 0..3 {
            h.record_probe(
                Outcome::Failure(Failure::ServerError),
                &p(),
                t0 + s(10 + k),
                1,
            );
        }
        assert_eq!(h.state(), HealthState::Fenced);
        // A fenced replica is still probed to re-admit it, even with
        // requests of before its fencing still running or queued.
        let queued = Work {
            running: 3,
            queued: true,
        };
        assert_eq!(
            h.probe_due(&p(), t0 + s(30), queued),
            Some(ProbeReason::Readmit)
        );
    }

    #[test]
    fn no_probe_goes_behind_queued_work_whatever_its_reason() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let queued = Work {
            running: 4,
            queued: true,
        };
        // Idle, suspect (client-shapeable evidence), and struck (a refused
        // connection): each would be probed on an idle replica, none behind
        // queued work.
        let idle = ReplicaHealth::default();
        let mut suspect = ReplicaHealth::default();
        suspect.record_request(Outcome::Failure(Failure::EmptyAnswer), &p(), t0);
        let mut struck = ReplicaHealth::default();
        struck.record_request(Outcome::Failure(Failure::ConnectFailure), &p(), t0);
        for (name, h, due) in [
            ("idle", &idle, ProbeReason::Idle),
            ("suspect", &suspect, ProbeReason::Suspect),
            ("struck", &struck, ProbeReason::Suspect),
        ] {
            assert_eq!(
                h.probe_due(&p(), t0 + s(1), Work::IDLE),
                Some(due),
                "{name}"
            );
            assert_eq!(h.probe_due(&p(), t0 + s(1), queued), None, "{name}");
        }
        // Suspicion and strikes are confirmed alongside running requests
        // when nothing waits; an idle probe waits for nothing to run.
        assert_eq!(idle.probe_due(&p(), t0, Work::running(1)), None);
        assert_eq!(
            suspect.probe_due(&p(), t0, Work::running(1)),
            Some(ProbeReason::Suspect)
        );
        assert_eq!(
            struck.probe_due(&p(), t0, Work::running(1)),
            Some(ProbeReason::Suspect)
        );
    }

    #[test]
    fn a_busy_engine_is_never_struck_and_a_stalled_one_is_fenced_by_its_own_counters() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        // Busy: requests run and queue for ten minutes (a client keeping
        // every slot with long generations) and the counters move at every
        // reading. The queued requests' first-byte timeouts make it
        // suspect, and its probe waits behind nothing: never a strike.
        let mut busy = ReplicaHealth::default();
        let queued = Work {
            running: 8,
            queued: true,
        };
        for k in 0..300 {
            busy.record_reading(&p(), t0 + s(2 * k), true, Some(true));
            if k % 30 == 29 {
                busy.record_request(Outcome::Failure(Failure::Timeout), &p(), t0 + s(2 * k));
            }
            assert_eq!(busy.probe_due(&p(), t0 + s(2 * k), queued), None);
        }
        assert!(busy.is_serving() && busy.is_suspect());
        assert_eq!(busy.snapshot(t0).consecutive_failures, 0);
        // Stuck: the engine reports requests running and its counters
        // stand still. Nothing for `stall_after` (30 s), then a strike per
        // reading at least `probe_retry` apart: fenced at the third.
        let mut stuck = ReplicaHealth::default();
        stuck.record_reading(&p(), t0, true, Some(true));
        for k in 1..=14 {
            stuck.record_reading(&p(), t0 + s(2 * k), true, Some(false));
        }
        assert!(stuck.is_serving(), "28 s without progress");
        assert_eq!(stuck.snapshot(t0).consecutive_failures, 0);
        stuck.record_reading(&p(), t0 + s(30), true, Some(false));
        assert_eq!(stuck.snapshot(t0).last_failure, Some(Failure::Stalled));
        stuck.record_reading(&p(), t0 + s(31), true, Some(false));
        assert_eq!(stuck.snapshot(t0).consecutive_failures, 1, "one a retry");
        stuck.record_reading(&p(), t0 + s(32), true, Some(false));
        stuck.record_reading(&p(), t0 + s(34), true, Some(false));
        assert_eq!(stuck.state(), HealthState::Fenced);
        // Idle with still counters is no stall; nor is an engine without
        // counters (no reading can tell), nor one the setting turns off.
        let mut idle = ReplicaHealth::default();
        let mut unknown = ReplicaHealth::default();
        let mut off = ReplicaHealth::default();
        let no_stall = HealthParams {
            stall_after: Duration::ZERO,
            ..p()
        };
        for k in 0..100 {
            idle.record_reading(&p(), t0 + s(2 * k), false, Some(false));
            unknown.record_reading(&p(), t0 + s(2 * k), true, None);
            off.record_reading(&no_stall, t0 + s(2 * k), true, Some(false));
        }
        for h in [&idle, &unknown, &off] {
            assert!(h.is_serving());
            assert_eq!(h.snapshot(t0).consecutive_failures, 0);
        }
        // A stall is counted from when the work began, not from the last
        // progress of an earlier busy spell.
        let mut spells = ReplicaHealth::default();
        spells.record_reading(&p(), t0, true, Some(true));
        spells.record_reading(&p(), t0 + s(2), false, Some(false));
        spells.record_reading(&p(), t0 + s(100), true, Some(false));
        spells.record_reading(&p(), t0 + s(120), true, Some(false));
        assert_eq!(spells.snapshot(t0).consecutive_failures, 0);
        spells.record_reading(&p(), t0 + s(130), true, Some(false));
        assert_eq!(spells.snapshot(t0).consecutive_failures, 1);
    }

    #[test]
    fn fleet_health_levels() {
        use HealthState::*;
        assert_eq!(FleetHealth::of([Serving, Serving]), FleetHealth::Ok);
        assert_eq!(FleetHealth::of([Serving, Fenced]), FleetHealth::Degraded);
        assert_eq!(FleetHealth::of([Fenced, Fenced]), FleetHealth::Unhealthy);
        assert_eq!(FleetHealth::of([]), FleetHealth::Unhealthy);
    }

    #[test]
    fn judgement_of_finished_requests() {
        let answered = |status, answer| judge(Ending::Answered { status, answer });
        let ok = Some(Answer {
            text: true,
            done: true,
        });
        let empty = Some(Answer {
            text: false,
            done: true,
        });
        assert_eq!(answered(200, ok), Outcome::Success);
        assert_eq!(answered(200, empty), Outcome::Failure(Failure::EmptyAnswer));
        assert_eq!(answered(200, None), Outcome::Neutral);
        assert_eq!(answered(500, None), Outcome::Failure(Failure::ServerError));
        assert_eq!(answered(504, None), Outcome::Failure(Failure::Timeout));
        assert_eq!(answered(400, None), Outcome::Neutral);
        assert_eq!(
            judge(Ending::ConnectionFailed),
            Outcome::Failure(Failure::ConnectFailure)
        );
        assert_eq!(
            judge(Ending::ConnectionReset),
            Outcome::Failure(Failure::ConnectionReset)
        );
        assert_eq!(judge(Ending::TimedOut), Outcome::Failure(Failure::Timeout));
        assert_eq!(judge(Ending::Unanswered), Outcome::Neutral);
    }

    #[test]
    fn a_reported_success_never_readmits_a_fenced_replica_only_its_probe_does() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut h = ReplicaHealth::default();
        for k in 0..p().eject_after {
            h.record_probe(
                Outcome::Failure(Failure::ConnectFailure),
                &p(),
                t0 + s(u64::from(k)),
                0,
            );
        }
        assert_eq!(h.state(), HealthState::Fenced);
        // Successes as an outcome report says them, before and after the
        // backoff: still fenced.
        for at in [t0 + s(5), t0 + s(3600)] {
            h.record_request(Outcome::Success, &p(), at);
            assert_eq!(h.state(), HealthState::Fenced);
        }
        h.record_probe(Outcome::Success, &p(), t0 + s(3600), 0);
        assert!(h.is_serving());
    }

    #[test]
    fn what_a_client_can_shape_only_raises_suspicion_and_a_probe_decides() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut h = ReplicaHealth::default();
        h.record_request(Outcome::Success, &p(), t0);
        // Any number of empty answers, 5xx and retries from real traffic:
        // suspect, serving, one suspicion, whatever is running.
        let later = t0 + s(40);
        for f in [Failure::EmptyAnswer, Failure::ServerError, Failure::Retried] {
            for _ in 0..10 {
                h.record_request(Outcome::Failure(f), &p(), later);
            }
        }
        assert!(h.is_serving() && h.is_suspect());
        assert_eq!(h.snapshot(later).consecutive_failures, 0);
        assert_eq!(h.suspicions_total, 1);
        // Probed at once, even with requests running; then not again
        // within the suspicion interval, however much more comes.
        assert_eq!(
            h.probe_due(&p(), later, Work::running(3)),
            Some(ProbeReason::Suspect)
        );
        h.record_probe(Outcome::Success, &p(), later, 3);
        assert!(!h.is_suspect(), "the probe cleared it");
        h.record_request(Outcome::Failure(Failure::EmptyAnswer), &p(), later + s(1));
        assert!(h.is_suspect());
        assert_eq!(h.probe_due(&p(), later + s(9), Work::IDLE), None);
        assert_eq!(
            h.probe_due(&p(), later + s(10), Work::IDLE),
            Some(ProbeReason::Suspect)
        );
        // A real generation that succeeds clears it too.
        h.record_request(Outcome::Success, &p(), later + s(10));
        assert!(!h.is_suspect());
        // An engine that answers 200 with nothing fails its probes too: a
        // strike each, probed every retry interval, fenced at the third.
        let t1 = later + s(100);
        h.record_request(Outcome::Failure(Failure::EmptyAnswer), &p(), t1);
        for k in 0..3 {
            assert_eq!(
                h.probe_due(&p(), t1 + s(2 * k), Work::running(1)),
                Some(ProbeReason::Suspect)
            );
            h.record_probe(
                Outcome::Failure(Failure::EmptyAnswer),
                &p(),
                t1 + s(2 * k),
                1,
            );
        }
        assert_eq!(h.state(), HealthState::Fenced);
        assert_eq!(h.snapshot(t1).last_failure, Some(Failure::EmptyAnswer));
    }

    #[test]
    fn suspicion_is_probed_at_once_after_an_idle_probe_and_then_at_its_own_rate() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut h = ReplicaHealth::default();
        h.record_probe(Outcome::Success, &p(), t0, 0);
        h.record_request(Outcome::Failure(Failure::Retried), &p(), t0 + s(3));
        // An idle probe 3 s ago does not hold it back.
        assert_eq!(
            h.probe_due(&p(), t0 + s(3), Work::running(1)),
            Some(ProbeReason::Suspect)
        );
        h.record_probe(Outcome::Success, &p(), t0 + s(3), 1);
        // Suspect again at once: the next suspicion probe waits for the
        // suspicion interval (10 s) after the last one.
        h.record_request(Outcome::Failure(Failure::Retried), &p(), t0 + s(4));
        assert_eq!(h.probe_due(&p(), t0 + s(12), Work::running(1)), None);
        assert_eq!(
            h.probe_due(&p(), t0 + s(13), Work::running(1)),
            Some(ProbeReason::Suspect)
        );
    }

    #[test]
    fn a_peers_fencing_is_a_suspicion_here_and_its_readmission_ends_the_backoff() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut h = ReplicaHealth::default();
        h.fence_by_peer();
        assert!(h.is_serving() && h.is_suspect());
        assert_eq!(h.snapshot(t0).suspect, Some(Failure::PeerFenced));
        h.record_probe(Outcome::Success, &p(), t0, 0);
        assert!(!h.is_suspect(), "this sidecar's probe disagrees");
        // Fenced here on its own evidence; a peer's re-admission lets the
        // next probe re-admit it before the backoff would have run out.
        for _ in 0..3 {
            h.record_request(Outcome::Failure(Failure::ConnectFailure), &p(), t0 + s(1));
        }
        assert_eq!(h.state(), HealthState::Fenced);
        assert_eq!(h.probe_due(&p(), t0 + s(3), Work::IDLE), None);
        h.readmit_by_peer(t0 + s(3));
        assert!(!h.is_serving(), "not on a peer's word alone");
        assert_eq!(
            h.probe_due(&p(), t0 + s(3), Work::IDLE),
            Some(ProbeReason::Readmit)
        );
        h.record_probe(Outcome::Success, &p(), t0 + s(3), 0);
        assert!(h.is_serving());
    }

    #[test]
    fn outcome_trailer_parses_strictly() {
        assert_eq!(
            Answer::parse("text=1;done=0"),
            Some(Answer {
                text: true,
                done: false
            })
        );
        assert_eq!(
            Answer::parse("done=1; text=1; bytes=9"),
            Some(Answer {
                text: true,
                done: true
            })
        );
        assert_eq!(Answer::parse("text=yes;done=1"), None);
        assert_eq!(Answer::parse("text=1"), None);
        assert_eq!(Answer::parse("garbage"), None);
    }
}

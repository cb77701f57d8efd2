//! What the sidecar tells operators about its decisions: Prometheus
//! metrics ([`metrics`]), the decision journal ([`journal`]), the
//! dashboard's history ([`series`]), all served by the admin HTTP
//! endpoint ([`admin`]). The gRPC service calls
//! [`Observer::routed`] / [`Observer::refused`] after each decision, outside
//! the router's lock, with numbers the decision already computed.
//!
//! **Session stays.** A routed request that continues an earlier turn
//! (the router's one rule, [`hearth_router::tips`], carried by the
//! decision) is a *stay* when it goes where that turn went and a *move*
//! otherwise; a hashed request that continues nothing is *new*.

pub mod admin;
pub mod epp;
pub mod journal;
pub mod metrics;
pub mod series;
pub mod usage;

use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use prometheus_client::registry::Registry;

use hearth_router::{AffinityBasis, Decision, QueueView, RequestInfo, RouteError, Router, Served};

use crate::observe::epp::EppMetrics;
use crate::observe::journal::{hex, CandidateRecord, DecisionRecord, Journal, ServedRecord};
use crate::observe::metrics::{
    DecisionMetrics, FleetCollector, FlowMetrics, PeerMetrics, PickerMetrics, ProbeMetrics,
};
use crate::observe::series::{unix_now, DecisionOutcome, Series, SessionResult};
use crate::observe::usage::{UsageMetrics, VerdictChannel};

/// Metrics, journal and history, shared by the gRPC service,
/// the prober and the admin endpoint.
pub struct Observer {
    router: Arc<Router>,
    basis: AffinityBasis,
    registry: Registry,
    decisions: DecisionMetrics,
    probes: ProbeMetrics,
    usage: UsageMetrics,
    /// The llm-d router's picker series.
    epp: EppMetrics,
    /// The peer bus's counters.
    pub peers: Arc<PeerMetrics>,
    /// The endpoint-picker mode's held bodies.
    pub picker: PickerMetrics,
    /// Flow control's queue.
    pub flow: FlowMetrics,
    pub series: Arc<Series>,
    pub journal: Journal,
    /// How to look at the flow-control queue (set by flow control; the
    /// dashboard's `/debug/queue`).
    queue_view: RwLock<Option<QueueLook>>,
}

type QueueLook = Box<dyn Fn() -> QueueView + Send + Sync>;

impl Observer {
    /// `pool`: the pool's name in the `llm_d_epp_*` pool series.
    pub fn new(
        router: Arc<Router>,
        basis: AffinityBasis,
        journal: Journal,
        pool: &str,
    ) -> Arc<Observer> {
        let mut registry = Registry::default();
        let series = Arc::new(Series::default());
        let decisions = DecisionMetrics::register(&mut registry, basis);
        let probes = ProbeMetrics::register(&mut registry);
        let usage = UsageMetrics::register(&mut registry);
        let peers = Arc::new(PeerMetrics::register(&mut registry));
        let picker = PickerMetrics::register(&mut registry);
        let flow = FlowMetrics::register(&mut registry);
        let epp = EppMetrics::register(&mut registry);
        FleetCollector::register(
            &mut registry,
            Arc::clone(&router),
            Arc::clone(&series),
            journal.file_dropped(),
            pool,
        );
        Arc::new(Observer {
            router,
            basis,
            registry,
            decisions,
            probes,
            usage,
            epp,
            peers,
            picker,
            flow,
            series,
            journal,
            queue_view: RwLock::new(None),
        })
    }

    pub fn router(&self) -> &Arc<Router> {
        &self.router
    }

    /// Where [`Observer::queue_view`] looks: flow control's queue.
    pub fn set_queue_view(&self, look: impl Fn() -> QueueView + Send + Sync + 'static) {
        *self.queue_view.write().unwrap_or_else(|p| p.into_inner()) = Some(Box::new(look));
    }

    /// What waits in the flow-control queue now (nothing without flow
    /// control).
    pub fn queue_view(&self) -> QueueView {
        self.queue_view
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(|look| look())
            .unwrap_or_default()
    }

    /// A routed request. `elapsed`: the time `Router::decide` took.
    pub fn routed(
        &self,
        request_id: Option<&str>,
        info: &RequestInfo,
        decision: &Decision,
        elapsed: Duration,
    ) {
        self.routed_after(request_id, info, decision, elapsed, None);
    }

    /// A routed request that first waited `waited` in the flow-control
    /// queue (`None`: it did not wait).
    pub fn routed_after(
        &self,
        request_id: Option<&str>,
        info: &RequestInfo,
        decision: &Decision,
        elapsed: Duration,
        waited: Option<Duration>,
    ) {
        let now = unix_now();
        let chosen = decision.primary();
        let hashed = !info.hashes.is_empty();
        let previous = decision.continuation.map(|c| c.from);
        let session = hashed.then(|| match previous {
            None => SessionResult::New,
            Some(key) if key == decision.replicas[chosen].key() => SessionResult::Stay,
            Some(_) => SessionResult::Move,
        });
        let blocks = hashed.then_some((decision.overlap, info.hashes.len()));
        self.decisions
            .record(DecisionOutcome::Routed, elapsed, blocks, session);
        self.epp.decided(info.model.as_deref(), Ok(()), elapsed);
        self.series
            .record(now as u64, DecisionOutcome::Routed, blocks, session);
        let ids = &decision.replicas;
        let id = |i: usize| ids.get(i).map(|r| r.id.clone()).unwrap_or_default();
        let mut record = self.record(now, request_id, info, elapsed, DecisionOutcome::Routed);
        record.wait_ms = waited.map(|w| w.as_secs_f64() * 1e3);
        record.chosen = Some(id(chosen));
        record.fallbacks = decision.order[1..].iter().map(|&i| id(i)).collect();
        record.overlap = decision.overlap;
        record.session = session.map(|s| s.as_str().to_string());
        // The previous turn's replica, by the id it has now (it may have
        // been renamed, or removed, by a reload since).
        record.previous = previous.map(|key| {
            ids.iter()
                .find(|r| !r.retired && r.key() == key)
                .map_or_else(|| "(removed)".to_string(), |r| r.id.clone())
        });
        record.candidates = decision
            .candidates
            .iter()
            .map(|c| CandidateRecord {
                replica: id(c.replica),
                overlap: c.overlap,
                credit: c.credit,
                load: c.load,
                score: c.score,
            })
            .collect();
        self.journal.push(record);
    }

    /// A request the router refused (503 or 429).
    pub fn refused(
        &self,
        request_id: Option<&str>,
        info: &RequestInfo,
        error: &RouteError,
        elapsed: Duration,
    ) {
        let now = unix_now();
        let outcome = match error {
            RouteError::NoReplicaForModel(_) => DecisionOutcome::NoReplica,
            RouteError::NoHealthyReplica(_) => DecisionOutcome::NoHealthyReplica,
            RouteError::Saturated => DecisionOutcome::Saturated,
        };
        self.decisions.record(outcome, elapsed, None, None);
        self.epp.decided(info.model.as_deref(), Err(error), elapsed);
        self.series.record(now as u64, outcome, None, None);
        let mut record = self.record(now, request_id, info, elapsed, outcome);
        record.error = Some(error.to_string());
        self.journal.push(record);
    }

    /// A request flow control answered with 429 for `reason`, after
    /// `waited` in its queue (`None`: it never entered). Counted as a
    /// `saturated` refusal; the journal says why and how long it waited.
    /// (The queue's own series, [`FlowMetrics`], count it where it
    /// happens.)
    pub fn flow_dropped(
        &self,
        request_id: Option<&str>,
        info: &RequestInfo,
        reason: hearth_router::DropReason,
        waited: Option<Duration>,
    ) {
        let now = unix_now();
        let error = RouteError::Saturated;
        self.decisions
            .record(DecisionOutcome::Saturated, Duration::ZERO, None, None);
        self.epp
            .decided(info.model.as_deref(), Err(&error), Duration::ZERO);
        self.series
            .record(now as u64, DecisionOutcome::Saturated, None, None);
        let mut record = self.record(
            now,
            request_id,
            info,
            Duration::ZERO,
            DecisionOutcome::Saturated,
        );
        record.error = Some(format!("flow control: {reason}"));
        record.wait_ms = waited.map(|w| w.as_secs_f64() * 1e3);
        self.journal.push(record);
    }

    fn record(
        &self,
        now: f64,
        request_id: Option<&str>,
        info: &RequestInfo,
        elapsed: Duration,
        outcome: DecisionOutcome,
    ) -> DecisionRecord {
        DecisionRecord {
            time_ms: (now * 1000.0) as u64,
            request_id: request_id.map(str::to_string),
            model: info.model.clone(),
            prompt_bytes: info.prompt_bytes,
            blocks: info.hashes.len(),
            first_hash: info.hashes.first().map(|&h| hex(h)),
            last_hash: info.hashes.last().map(|&h| hex(h)),
            basis: self.basis.as_str().to_string(),
            outcome: outcome.as_str().to_string(),
            error: None,
            chosen: None,
            fallbacks: Vec::new(),
            overlap: 0,
            session: None,
            previous: None,
            candidates: Vec::new(),
            decision_us: elapsed.as_secs_f64() * 1e6,
            wait_ms: None,
            served: None,
        }
    }

    /// An answer's usage, as the router took it ([`crate::outcomes`]):
    /// the prediction's error goes to the metrics, the served figures next
    /// to the decision in the journal.
    /// `model`: the model the request asked for.
    pub fn served(&self, request_id: Option<&str>, model: Option<&str>, served: &Served) {
        self.usage.served(served);
        self.epp.usage(
            model,
            served.usage.prompt_tokens,
            served.usage.cached_tokens,
        );
        if let Some(id) = request_id {
            let replica = self
                .router
                .replicas()
                .get(served.replica)
                .map(|r| r.id.clone())
                .unwrap_or_default();
            self.journal.attach_served(
                id,
                ServedRecord {
                    replica,
                    prompt_tokens: served.usage.prompt_tokens,
                    cached_tokens: served.usage.cached_tokens,
                    predicted_cached_tokens: served.predicted_tokens,
                    correction: served.correction,
                },
                (series::unix_now() * 1000.0) as u64,
            );
        }
    }

    /// An engine answered a routed request for `model` with a 5xx.
    pub fn engine_error(&self, model: Option<&str>) {
        self.epp.engine_error(model);
    }

    /// A generation's answer ended without usage with cached tokens.
    pub fn usage_missing(&self) {
        self.usage.missing();
    }

    /// A generation's verdict reached the sidecar through `channel`.
    pub fn verdict(&self, channel: VerdictChannel) {
        self.usage.verdict(channel);
    }

    /// An answer's usage came without a decision to compare it with.
    pub fn usage_unmatched(&self) {
        self.usage.unmatched();
    }

    /// An active probe's outcome on the engine at `addr`.
    /// One probe's end, by its `result` label.
    pub fn probe(&self, addr: SocketAddr, result: &'static str) {
        self.probes.record(addr, result);
    }

    /// Samples each replica's in-flight count and load into the history.
    pub fn sample(&self) {
        let snap = self.router.snapshot();
        self.series.sample(
            unix_now() as u64,
            snap.replicas.iter().map(|r| r.id.clone()).collect(),
            snap.replicas.iter().map(|r| r.in_flight).collect(),
            snap.replicas.iter().map(|r| r.load).collect(),
        );
    }

    /// The metrics in the Prometheus / OpenMetrics text format.
    pub fn encode_metrics(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// Samples the fleet into the history once a second until dropped.
pub async fn sample_every_second(observer: Arc<Observer>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        observer.sample();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A conversation's chain: `shared` system-prompt blocks, then its own.
    fn chain(session: u64, shared: usize, own: usize) -> Vec<u64> {
        (0..shared as u64)
            .map(|i| 1000 + i)
            .chain((0..own as u64).map(|i| session * 1_000_000 + i))
            .collect()
    }

    #[test]
    fn turns_stay_or_move_as_the_decision_says_and_a_removed_replica_is_named() {
        let mut params = hearth_router::RouterParams::default();
        params.score.alpha = 100.0;
        let upstreams = ["127.0.0.1:1;id=a", "127.0.0.1:2;id=b"].map(|u| u.parse().unwrap());
        let router = Router::new(params, &upstreams);
        let observer = Observer::new(
            Arc::clone(&router),
            params.score.basis,
            Journal::open(16, None).unwrap(),
            "hearth",
        );
        let info = |hashes: Vec<u64>| RequestInfo {
            prompt_bytes: hashes.len() as u64 * 2048,
            hashes,
            ..RequestInfo::default()
        };
        // Turn 1 of a conversation: new.
        let first = info(chain(1, 2, 3));
        let d = router.decide(&first).unwrap();
        observer.routed(Some("t1"), &first, &d, Duration::ZERO);
        let x = d.primary();
        let y = 1 - x;
        drop(d);
        // Turn 2 extends it and stays on x.
        let mut turn2 = chain(1, 2, 3);
        turn2.extend([40, 41]);
        let second = info(turn2.clone());
        let d = router.decide(&second).unwrap();
        assert_eq!(d.primary(), x);
        observer.routed(Some("t2"), &second, &d, Duration::ZERO);
        drop(d);
        // Another conversation sharing only the system prompt: new.
        let other = info(chain(2, 2, 2));
        let d = router.decide(&other).unwrap();
        observer.routed(Some("o1"), &other, &d, Duration::ZERO);
        drop(d);
        // Replica y reads turn 2 too (unseen by the observer): the
        // conversation's latest turn is there now.
        drop(router.decide_within(&second, Some(&[y])).unwrap());
        // y's engine is replaced: the new one takes y's drained slot.
        let keep = router.replicas()[x].clone();
        let mut list = vec![
            format!("{};id={}", keep.addr, keep.id).parse().unwrap(),
            "127.0.0.1:3;id=c".parse().unwrap(),
        ];
        if x == 1 {
            list.reverse();
        }
        router.set_upstreams(&list);
        assert_eq!(router.replicas()[y].id, "c");
        // Turn 3 goes to x, which holds the history: a move from a replica
        // that is gone.
        let mut turn3 = turn2;
        turn3.extend([50, 51]);
        let third = info(turn3);
        let d = router.decide(&third).unwrap();
        assert_eq!(d.primary(), x);
        observer.routed(Some("t3"), &third, &d, Duration::ZERO);
        let session = |id: &str| {
            let r = &observer.journal.find(id)[0];
            (r.session.clone().unwrap(), r.previous.clone())
        };
        assert_eq!(session("t1"), ("new".to_string(), None));
        assert_eq!(session("t2"), ("stay".to_string(), Some(keep.id.clone())));
        assert_eq!(session("o1"), ("new".to_string(), None));
        assert_eq!(
            session("t3"),
            ("move".to_string(), Some("(removed)".to_string()))
        );
    }
}

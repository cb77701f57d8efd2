//! What the sidecar tells operators about its decisions: Prometheus
//! metrics ([`metrics`]), the decision journal ([`journal`]), the
//! dashboard's history ([`series`]), all served by the admin HTTP
//! endpoint ([`admin`]). The gRPC service calls
//! [`Observer::routed`] / [`Observer::refused`] after each decision, outside
//! the router's lock, with numbers the decision already computed.
//!
//! **Session stays.** A conversation's next turn extends its prompt, so
//! its fingerprint starts with the previous turn's *full* blocks (the
//! previous turn's trailing partial block hashes differently once more
//! bytes follow it). The observer remembers, per routed request, the hash
//! of its last full block (its *tip*) and the replica chosen. A later
//! request whose chain contains a remembered tip is that conversation's
//! next turn: a *stay* when it goes to the same replica, a *move*
//! otherwise; a request containing no tip is *new*. A tip is recorded
//! only for a request that brings full blocks no candidate held yet (its
//! own content) or grows a known conversation, and a tip is consumed by
//! the turn that claims it, so the end of a shared system prompt is taken
//! for a conversation at most once. The search starts at the warmest
//! candidate's overlap (a previous turn's blocks are warm where it went)
//! and looks back at most [`TIP_SCAN`] blocks. Tips are bounded
//! ([`TIP_CAPACITY`], oldest forgotten first). When in doubt a turn
//! counts as new, which leaves the stay ratio unbiased: a conversation
//! whose previous turn was evicted from every warmth index, whose
//! replica is fenced, or that follows an exact repeat of a prompt.

pub mod admin;
pub mod journal;
pub mod metrics;
pub mod series;
pub mod usage;

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::registry::Registry;

use hearth_router::health::Outcome;
use hearth_router::{AffinityBasis, Decision, ReplicaKey, RequestInfo, RouteError, Router, Served};

use crate::observe::journal::{hex, CandidateRecord, DecisionRecord, Journal, ServedRecord};
use crate::observe::metrics::{
    DecisionMetrics, FleetCollector, PeerMetrics, PickerMetrics, ProbeMetrics,
};
use crate::observe::series::{unix_now, DecisionOutcome, Series, SessionResult};
use crate::observe::usage::UsageMetrics;

/// Conversations remembered for the stay ratio.
pub const TIP_CAPACITY: usize = 65_536;
/// Blocks looked back from the warmest overlap for a previous turn's tip.
pub const TIP_SCAN: usize = 64;

/// The last full block of recent requests → the replica chosen for them
/// (the sidecar names a replica by [`hearth_router::Replica::key`], which a
/// reload keeps for an engine still listed and never gives another).
#[derive(Debug)]
pub struct SessionTips<R = usize> {
    tips: HashMap<u64, R>,
    order: VecDeque<u64>,
}

impl<R> Default for SessionTips<R> {
    fn default() -> Self {
        SessionTips {
            tips: HashMap::new(),
            order: VecDeque::new(),
        }
    }
}

impl<R: Copy + PartialEq> SessionTips<R> {
    /// Classifies a routed request and remembers its tip. `full_blocks`:
    /// blocks entirely inside the prompt; `warmest`: the deepest overlap
    /// of any candidate. Returns the result and the previous turn's
    /// replica.
    pub fn observe(
        &mut self,
        hashes: &[u64],
        full_blocks: usize,
        warmest: usize,
        chosen: R,
    ) -> (SessionResult, Option<R>) {
        let full = full_blocks.min(hashes.len());
        let top = warmest.min(full);
        // A tip is consumed by the turn that follows it: a conversation
        // has one next turn, and a tip that sat at the end of a prompt
        // many conversations share is claimed once, not by every one.
        let found = hashes[..top]
            .iter()
            .enumerate()
            .rev()
            .take(TIP_SCAN)
            .find_map(|(j, h)| self.tips.remove(h).map(|r| (j, r)));
        let previous = found.map(|(_, r)| r);
        let result = match previous {
            None => SessionResult::New,
            Some(r) if r == chosen => SessionResult::Stay,
            Some(_) => SessionResult::Move,
        };
        // Remember this request's tip when it brought blocks of its own
        // (beyond every candidate's overlap) or grew its conversation.
        let grew = found.is_some_and(|(j, _)| full > j + 1);
        if full > 0 && (full > warmest || grew) {
            let tip = hashes[full - 1];
            self.tips.insert(tip, chosen);
            self.order.push_back(tip);
            if self.order.len() > TIP_CAPACITY {
                if let Some(old) = self.order.pop_front() {
                    self.tips.remove(&old);
                }
            }
        }
        (result, previous)
    }
}

/// Metrics, journal, history and session tips, shared by the gRPC service,
/// the prober and the admin endpoint.
pub struct Observer {
    router: Arc<Router>,
    basis: AffinityBasis,
    registry: Registry,
    decisions: DecisionMetrics,
    probes: ProbeMetrics,
    tips: Mutex<SessionTips<ReplicaKey>>,
    usage: UsageMetrics,
    /// The peer bus's counters.
    pub peers: Arc<PeerMetrics>,
    /// The endpoint-picker mode's held bodies.
    pub picker: PickerMetrics,
    pub series: Arc<Series>,
    pub journal: Journal,
}

impl Observer {
    pub fn new(router: Arc<Router>, basis: AffinityBasis, journal: Journal) -> Arc<Observer> {
        let mut registry = Registry::default();
        let series = Arc::new(Series::default());
        let decisions = DecisionMetrics::register(&mut registry, basis);
        let probes = ProbeMetrics::register(&mut registry);
        let usage = UsageMetrics::register(&mut registry);
        let peers = Arc::new(PeerMetrics::register(&mut registry));
        let picker = PickerMetrics::register(&mut registry);
        FleetCollector::register(
            &mut registry,
            Arc::clone(&router),
            Arc::clone(&series),
            journal.file_dropped(),
        );
        Arc::new(Observer {
            router,
            basis,
            registry,
            decisions,
            probes,
            tips: Mutex::new(SessionTips::default()),
            usage,
            peers,
            picker,
            series,
            journal,
        })
    }

    pub fn router(&self) -> &Arc<Router> {
        &self.router
    }

    /// A routed request. `elapsed`: the time `Router::decide` took.
    pub fn routed(
        &self,
        request_id: Option<&str>,
        info: &RequestInfo,
        decision: &Decision,
        elapsed: Duration,
    ) {
        let now = unix_now();
        let chosen = decision.primary();
        let hashed = !info.hashes.is_empty();
        let (session, previous) = if hashed {
            let warmest = decision
                .candidates
                .iter()
                .map(|c| c.overlap)
                .max()
                .unwrap_or(0) as usize;
            let block = self.router.block_size().max(1) as u64;
            let full = if info.prompt_bytes == 0 {
                info.hashes.len()
            } else {
                (info.prompt_bytes / block) as usize
            };
            let mut tips = self.tips.lock().unwrap_or_else(|p| p.into_inner());
            let (s, p) = tips.observe(&info.hashes, full, warmest, decision.replicas[chosen].key());
            (Some(s), p)
        } else {
            (None, None)
        };
        let blocks = hashed.then_some((decision.overlap, info.hashes.len()));
        self.decisions
            .record(DecisionOutcome::Routed, elapsed, blocks, session);
        self.series
            .record(now as u64, DecisionOutcome::Routed, blocks, session);
        let ids = &decision.replicas;
        let id = |i: usize| ids.get(i).map(|r| r.id.clone()).unwrap_or_default();
        let mut record = self.record(now, request_id, info, elapsed, DecisionOutcome::Routed);
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
        self.series.record(now as u64, outcome, None, None);
        let mut record = self.record(now, request_id, info, elapsed, outcome);
        record.error = Some(error.to_string());
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
            served: None,
        }
    }

    /// An answer's usage, as the router took it ([`crate::outcomes`]):
    /// the prediction's error goes to the metrics, the served figures next
    /// to the decision in the journal.
    pub fn served(&self, request_id: Option<&str>, served: &Served) {
        self.usage.served(served);
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
            );
        }
    }

    /// A generation's answer ended without usage with cached tokens.
    pub fn usage_missing(&self) {
        self.usage.missing();
    }

    /// An answer's usage came without a decision to compare it with.
    pub fn usage_unmatched(&self) {
        self.usage.unmatched();
    }

    /// An active probe's outcome on the engine at `addr`.
    pub fn probe(&self, addr: SocketAddr, outcome: Outcome) {
        self.probes.record(addr, outcome);
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
    fn turns_of_a_conversation_stay_or_move_and_new_ones_are_new() {
        let mut tips = SessionTips::default();
        // Turn 1 of session A: 4 shared blocks + 2 own full blocks + a
        // partial one; nothing warm yet.
        let a1 = chain(1, 4, 3);
        assert_eq!(tips.observe(&a1, 6, 0, 0), (SessionResult::New, None));
        // Turn 2 extends it (its 7th block now differs: more bytes in it);
        // replica 0 holds the first 6 blocks.
        let mut a2 = chain(1, 4, 2);
        a2.extend([77, 78, 79]);
        assert_eq!(tips.observe(&a2, 8, 6, 0), (SessionResult::Stay, Some(0)));
        let mut a3 = a2[..8].to_vec();
        a3.extend([90, 91]);
        assert_eq!(tips.observe(&a3, 9, 8, 1), (SessionResult::Move, Some(0)));
        // Session B shares only the system prompt: new, although the
        // shared blocks are warm.
        let b1 = chain(2, 4, 2);
        assert_eq!(tips.observe(&b1, 5, 4, 1).0, SessionResult::New);
    }

    #[test]
    fn the_end_of_a_shared_prompt_is_claimed_at_most_once() {
        let mut tips = SessionTips::default();
        // The first request ever ends (in full blocks) at the end of a
        // shared prompt it is the first to bring: its tip is recorded.
        tips.observe(&chain(1, 4, 1), 4, 0, 0);
        // The next conversation with the same prompt claims it (a
        // misattribution, once) and, bringing no full block of its own,
        // leaves no tip; the ones after are new.
        tips.observe(&chain(2, 4, 1), 4, 4, 1);
        for s in 3..10 {
            assert_eq!(tips.observe(&chain(s, 4, 1), 4, 4, 2).0, SessionResult::New);
        }
        assert!(tips.tips.is_empty());
    }

    #[test]
    fn tips_are_bounded() {
        let mut tips = SessionTips::default();
        for s in 0..(TIP_CAPACITY as u64 + 10) {
            tips.observe(&[s * 7 + 1, s * 7 + 2], 2, 0, 0);
        }
        assert_eq!(tips.tips.len(), TIP_CAPACITY);
        assert!(!tips.tips.contains_key(&2), "oldest forgotten first");
        assert_eq!(tips.order.len(), TIP_CAPACITY);
    }

    #[test]
    fn a_turn_on_a_new_replica_in_a_reused_slot_is_a_move() {
        let mut params = hearth_router::RouterParams::default();
        params.score.alpha = 100.0;
        let upstreams = ["127.0.0.1:1;id=a", "127.0.0.1:2;id=b"].map(|u| u.parse().unwrap());
        let router = Router::new(params, &upstreams);
        let observer = Observer::new(
            Arc::clone(&router),
            params.score.basis,
            Journal::open(16, None).unwrap(),
        );
        let info = |hashes: Vec<u64>| RequestInfo {
            prompt_bytes: hashes.len() as u64 * 2048,
            hashes,
            model: None,
            max_output_tokens: None,
            cache: Default::default(),
        };
        // Turn 1 lands on replica x, as the observer sees it.
        let first = info(chain(1, 0, 3));
        let d = router.decide(&first).unwrap();
        observer.routed(Some("t1"), &first, &d, Duration::ZERO);
        let x = d.primary();
        let y = 1 - x;
        drop(d);
        // Replica y reads the same prompt too (unseen by the observer).
        drop(router.decide_within(&first, Some(&[y])).unwrap());
        // x's engine is replaced: the new one takes x's drained slot.
        let keep = router.replicas()[y].clone();
        router.set_upstreams(&[
            "127.0.0.1:3;id=c".parse().unwrap(),
            format!("{};id={}", keep.addr, keep.id).parse().unwrap(),
        ]);
        assert_eq!(router.replicas()[x].id, "c");
        // y is busy, so turn 2 goes to the new replica in x's slot.
        let busy: Vec<_> = (0..3)
            .map(|k| {
                router
                    .decide_within(&info(vec![900 + k]), Some(&[y]))
                    .unwrap()
            })
            .collect();
        let mut next = chain(1, 0, 3);
        next.extend([50, 51]);
        let second = info(next);
        let d = router.decide(&second).unwrap();
        assert_eq!(d.primary(), x);
        observer.routed(Some("t2"), &second, &d, Duration::ZERO);
        let record = &observer.journal.find("t2")[0];
        assert_eq!(record.session.as_deref(), Some("move"));
        assert_eq!(record.previous.as_deref(), Some("(removed)"));
        drop(busy);
    }
}

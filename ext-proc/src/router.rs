//! The routing decision: fingerprint → candidates → overlap → credit → load
//! → pick → reserve, over state shared by every Envoy stream.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::config::{default_replica_id, Settings};
use crate::health::{FleetHealth, HealthParams, HealthSnapshot, Outcome, ReplicaHealth};
use crate::policy::{self, AffinityBasis, Candidate, ScoreParams};
use crate::warmth::LruBlocks;

/// A configured engine replica.
#[derive(Clone, Debug)]
pub struct Replica {
    /// Opaque name shown to clients in `x-hearth-upstream`.
    pub id: String,
    pub addr: SocketAddr,
    /// Models it serves; empty means any.
    pub models: Vec<String>,
}

impl Replica {
    fn serves(&self, model: Option<&str>) -> bool {
        match model {
            Some(m) if !self.models.is_empty() => self.models.iter().any(|x| x == m),
            _ => true,
        }
    }
}

/// What the sidecar knows about one request before it is routed.
#[derive(Clone, Debug, Default)]
pub struct RequestInfo {
    /// Chained block hashes from the filter, if the request was hashed.
    pub hashes: Vec<u64>,
    /// Canonical prompt length in bytes (0 when unknown).
    pub prompt_bytes: u64,
    pub model: Option<String>,
}

/// Why a request could not be routed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    #[error("no replica serves model {0:?}")]
    NoReplicaForModel(String),
    #[error("no healthy replica serves model {0:?}")]
    NoHealthyReplica(String),
    #[error("every eligible replica is at its in-flight limit")]
    Saturated,
}

/// A routing decision. Dropping it releases the load it reserved.
#[derive(Debug)]
pub struct Decision {
    /// Chosen replica first, then fallbacks for retries.
    pub order: Vec<usize>,
    /// Leading blocks the chosen replica already held.
    pub overlap: u32,
    pub reservation: Reservation,
}

impl Decision {
    pub fn primary(&self) -> usize {
        self.order[0]
    }
}

/// Load held on a replica for a request's whole life; released on drop, so
/// every way a stream can end (completion, client abort, upstream reset,
/// timeout, gRPC error) gives the load back.
pub struct Reservation {
    router: Arc<Router>,
    replica: usize,
    weight: f64,
}

impl std::fmt::Debug for Reservation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reservation")
            .field("replica", &self.replica)
            .field("weight", &self.weight)
            .finish()
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut state = self.router.lock();
        let r = &mut state[self.replica];
        r.in_flight = r.in_flight.saturating_sub(1);
        r.load -= self.weight;
        // Sums of floats drift; an idle replica carries exactly no load.
        r.load = if r.in_flight == 0 {
            0.0
        } else {
            r.load.max(0.0)
        };
    }
}

struct ReplicaState {
    warmth: LruBlocks,
    in_flight: u32,
    load: f64,
    routed: u64,
    health: ReplicaHealth,
}

/// Per-replica figures for the state endpoint.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ReplicaSnapshot {
    pub id: String,
    pub address: String,
    pub models: Vec<String>,
    pub in_flight: u32,
    pub load: f64,
    pub warmth_blocks: usize,
    pub warmth_capacity: usize,
    pub warmth_memory_bytes: usize,
    pub routed_total: u64,
    pub health: HealthSnapshot,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Snapshot {
    pub affinity_basis: AffinityBasis,
    pub affinity_cap: u32,
    pub alpha: f64,
    pub block_size: usize,
    /// `ok` (every replica serving), `degraded` (some fenced) or
    /// `unhealthy` (none serving).
    pub health: FleetHealth,
    pub decisions_total: u64,
    pub hashed_total: u64,
    pub unhashed_total: u64,
    pub rejected_total: u64,
    /// Routed requests that ended after an engine's response headers.
    pub answered_total: u64,
    /// Routed requests that ended before any response headers (client
    /// gave up first, or the upstream failed).
    pub unanswered_total: u64,
    pub replicas: Vec<ReplicaSnapshot>,
}

/// Shared routing state: the replica registry, each replica's warmth and
/// in-flight load. One mutex guards it; a decision is a few microseconds.
pub struct Router {
    replicas: Vec<Replica>,
    params: ScoreParams,
    block_size: usize,
    load_unit_bytes: u64,
    max_inflight: u32,
    fallbacks: usize,
    health_params: HealthParams,
    state: Mutex<Vec<ReplicaState>>,
    rr: AtomicUsize,
    decisions: AtomicU64,
    hashed: AtomicU64,
    rejected: AtomicU64,
    answered: AtomicU64,
    unanswered: AtomicU64,
}

impl Router {
    pub fn new(settings: &Settings) -> Arc<Router> {
        let replicas: Vec<Replica> = settings
            .upstreams
            .iter()
            .enumerate()
            .map(|(i, u)| Replica {
                id: u.id.clone().unwrap_or_else(|| default_replica_id(i)),
                addr: u.addr,
                models: u.models.clone(),
            })
            .collect();
        let state = replicas
            .iter()
            .map(|_| ReplicaState {
                warmth: LruBlocks::new(settings.warmth_blocks),
                in_flight: 0,
                load: 0.0,
                routed: 0,
                health: ReplicaHealth::default(),
            })
            .collect();
        Arc::new(Router {
            replicas,
            params: settings.score_params(),
            block_size: settings.block_size,
            load_unit_bytes: settings.load_unit_bytes,
            max_inflight: settings.max_inflight,
            fallbacks: settings.fallbacks,
            health_params: settings.health_params(),
            state: Mutex::new(state),
            rr: AtomicUsize::new(0),
            decisions: AtomicU64::new(0),
            hashed: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            answered: AtomicU64::new(0),
            unanswered: AtomicU64::new(0),
        })
    }

    pub fn replicas(&self) -> &[Replica] {
        &self.replicas
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Index of the replica at `addr`, if it is one of ours.
    pub fn replica_at(&self, addr: &str) -> Option<usize> {
        self.replicas
            .iter()
            .position(|r| r.addr.to_string() == addr)
    }

    /// `ip:port,ip:port,...` for the decision's order.
    pub fn destination(&self, order: &[usize]) -> String {
        order
            .iter()
            .map(|&i| self.replicas[i].addr.to_string())
            .collect::<Vec<_>>()
            .join(",")
    }

    fn lock(&self) -> MutexGuard<'_, Vec<ReplicaState>> {
        // A panic while holding the lock cannot leave the state torn in a
        // way that matters more than losing routing altogether.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Chooses a replica for `req` and reserves load on it.
    pub fn decide(self: &Arc<Self>, req: &RequestInfo) -> Result<Decision, RouteError> {
        self.decisions.fetch_add(1, Ordering::Relaxed);
        if !req.hashes.is_empty() {
            self.hashed.fetch_add(1, Ordering::Relaxed);
        }
        let mut state = self.lock();

        // Candidates: healthy replicas that serve the model and have room.
        let serving: Vec<usize> = (0..self.replicas.len())
            .filter(|&i| self.replicas[i].serves(req.model.as_deref()))
            .collect();
        if serving.is_empty() {
            self.rejected.fetch_add(1, Ordering::Relaxed);
            return Err(RouteError::NoReplicaForModel(
                req.model.clone().unwrap_or_default(),
            ));
        }
        let healthy: Vec<usize> = serving
            .into_iter()
            .filter(|&i| state[i].health.is_serving())
            .collect();
        if healthy.is_empty() {
            self.rejected.fetch_add(1, Ordering::Relaxed);
            return Err(RouteError::NoHealthyReplica(
                req.model.clone().unwrap_or_default(),
            ));
        }
        let candidates: Vec<usize> = healthy
            .into_iter()
            .filter(|&i| self.max_inflight == 0 || state[i].in_flight < self.max_inflight)
            .collect();
        if candidates.is_empty() {
            self.rejected.fetch_add(1, Ordering::Relaxed);
            return Err(RouteError::Saturated);
        }

        // Overlap and load per candidate (the overlap searches of all
        // candidates run together), then the scoring rule.
        let sets: Vec<&LruBlocks> = candidates.iter().map(|&i| &state[i].warmth).collect();
        let overlaps = LruBlocks::leading_overlaps(&sets, &req.hashes);
        let scored: Vec<Candidate> = candidates
            .iter()
            .zip(overlaps)
            .map(|(&i, overlap)| Candidate {
                overlap: overlap as u32,
                load: state[i].load,
            })
            .collect();
        let rr = self.rr.fetch_add(1, Ordering::Relaxed);
        let ranked = policy::rank(&self.params, &scored, rr);
        let order: Vec<usize> = ranked
            .iter()
            .take(1 + self.fallbacks)
            .map(|&k| candidates[k])
            .collect();
        let chosen = order[0];
        let overlap = scored[ranked[0]].overlap;

        // Reserve: weight by the prompt bytes the replica must still read,
        // and record the prompt as warm there now, so concurrent requests
        // with the same new prefix follow this one.
        let cached_bytes = u64::from(overlap) * self.block_size as u64;
        let uncached = req.prompt_bytes.saturating_sub(cached_bytes);
        let weight = 1.0 + uncached as f64 / self.load_unit_bytes as f64;
        let r = &mut state[chosen];
        r.in_flight += 1;
        r.load += weight;
        r.routed += 1;
        r.warmth.record_prompt(&req.hashes);
        drop(state);

        Ok(Decision {
            order,
            overlap,
            reservation: Reservation {
                router: Arc::clone(self),
                replica: chosen,
                weight,
            },
        })
    }

    /// Counts how a routed request's stream ended: after the engine's
    /// response headers, or before.
    pub fn note_stream_end(&self, answered: bool) {
        let counter = if answered {
            &self.answered
        } else {
            &self.unanswered
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// A finished request's outcome on replica `i` (passive health).
    pub fn record_request(&self, i: usize, outcome: Outcome) {
        let params = self.health_params;
        if let Some(r) = self.lock().get_mut(i) {
            r.health.record_request(outcome, &params, Instant::now());
        }
    }

    /// A probe's outcome on replica `i` (active health).
    pub fn record_probe(&self, i: usize, outcome: Outcome) {
        let params = self.health_params;
        if let Some(r) = self.lock().get_mut(i) {
            r.health.record_probe(outcome, &params, Instant::now());
        }
    }

    pub fn fleet_health(&self) -> FleetHealth {
        FleetHealth::of(self.lock().iter().map(|r| r.health.state()))
    }

    pub fn snapshot(&self) -> Snapshot {
        let now = Instant::now();
        let state = self.lock();
        let decisions = self.decisions.load(Ordering::Relaxed);
        let hashed = self.hashed.load(Ordering::Relaxed);
        Snapshot {
            affinity_basis: self.params.basis,
            affinity_cap: self.params.cap,
            alpha: self.params.alpha,
            block_size: self.block_size,
            health: FleetHealth::of(state.iter().map(|r| r.health.state())),
            decisions_total: decisions,
            hashed_total: hashed,
            unhashed_total: decisions - hashed,
            rejected_total: self.rejected.load(Ordering::Relaxed),
            answered_total: self.answered.load(Ordering::Relaxed),
            unanswered_total: self.unanswered.load(Ordering::Relaxed),
            replicas: self
                .replicas
                .iter()
                .zip(state.iter())
                .map(|(r, s)| ReplicaSnapshot {
                    id: r.id.clone(),
                    address: r.addr.to_string(),
                    models: r.models.clone(),
                    in_flight: s.in_flight,
                    load: s.load,
                    warmth_blocks: s.warmth.len(),
                    warmth_capacity: s.warmth.capacity(),
                    warmth_memory_bytes: s.warmth.memory_bytes(),
                    routed_total: s.routed,
                    health: s.health.snapshot(now),
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Cli;
    use clap::Parser;

    fn router(extra: &[&str]) -> Arc<Router> {
        let mut args = vec![
            "hearth-ext-proc",
            "--upstreams",
            "127.0.0.1:1001,127.0.0.1:1002,127.0.0.1:1003;model=special",
        ];
        args.extend_from_slice(extra);
        Router::new(&Cli::try_parse_from(args).unwrap().settings)
    }

    fn req(hashes: &[u64]) -> RequestInfo {
        RequestInfo {
            hashes: hashes.to_vec(),
            prompt_bytes: hashes.len() as u64 * 2048,
            model: Some("m".into()),
        }
    }

    #[test]
    fn a_session_returns_to_the_replica_that_read_it() {
        let router = router(&[]);
        let first = router.decide(&req(&[1, 2, 3])).unwrap();
        let home = first.primary();
        drop(first);
        for turn in 4..10u64 {
            let hashes: Vec<u64> = (1..=turn).collect();
            let d = router.decide(&req(&hashes)).unwrap();
            assert_eq!(d.primary(), home);
            assert_eq!(d.overlap, (turn - 1) as u32);
        }
    }

    #[test]
    fn reservations_last_until_dropped_and_push_new_work_elsewhere() {
        let router = router(&["--alpha", "100"]);
        let a = router.decide(&req(&[7])).unwrap();
        let b = router.decide(&req(&[8])).unwrap();
        assert_ne!(a.primary(), b.primary(), "load spreads cold requests");
        let snap = router.snapshot();
        assert_eq!(snap.replicas.iter().map(|r| r.in_flight).sum::<u32>(), 2);
        drop(a);
        drop(b);
        let snap = router.snapshot();
        assert!(snap
            .replicas
            .iter()
            .all(|r| r.in_flight == 0 && r.load == 0.0));
    }

    #[test]
    fn model_restrictions_and_no_eligible_replica() {
        let router = router(&[]);
        let mut special = req(&[1]);
        special.model = Some("special".into());
        // Replicas 0 and 1 serve any model, replica 2 only "special".
        let d = router.decide(&special).unwrap();
        assert_eq!(d.order.len(), 3);
        let none = RequestInfo {
            model: Some("other".into()),
            ..req(&[1])
        };
        let d = router.decide(&none).unwrap();
        assert!(!d.order.contains(&2), "replica 2 serves only 'special'");
    }

    #[test]
    fn saturation_and_unknown_models_are_errors() {
        let only = Router::new(
            &Cli::try_parse_from([
                "x",
                "--upstreams",
                "127.0.0.1:1;model=a",
                "--max-inflight",
                "1",
            ])
            .unwrap()
            .settings,
        );
        let mut r = req(&[1]);
        r.model = Some("a".into());
        let held = only.decide(&r).unwrap();
        assert_eq!(only.decide(&r).unwrap_err(), RouteError::Saturated);
        drop(held);
        assert!(only.decide(&r).is_ok());
        r.model = Some("b".into());
        assert_eq!(
            only.decide(&r).unwrap_err(),
            RouteError::NoReplicaForModel("b".into())
        );
    }

    #[test]
    fn fenced_replicas_get_no_traffic_and_none_healthy_is_an_error() {
        use crate::health::Failure;
        let router = router(&[]);
        for _ in 0..3 {
            router.record_request(0, Outcome::Failure(Failure::EmptyAnswer));
        }
        for _ in 0..20 {
            let d = router.decide(&req(&[9])).unwrap();
            assert!(!d.order.contains(&0), "fenced replica 0 was offered");
        }
        assert_eq!(router.fleet_health(), FleetHealth::Degraded);
        for i in 1..3 {
            for _ in 0..3 {
                router.record_request(i, Outcome::Failure(Failure::ServerError));
            }
        }
        assert_eq!(router.fleet_health(), FleetHealth::Unhealthy);
        assert!(matches!(
            router.decide(&req(&[9])),
            Err(RouteError::NoHealthyReplica(_))
        ));
    }

    #[test]
    fn destination_lists_fallbacks_in_rank_order() {
        let router = router(&["--fallbacks", "1"]);
        let d = router.decide(&req(&[5])).unwrap();
        assert_eq!(d.order.len(), 2);
        let dest = router.destination(&d.order);
        assert_eq!(dest.split(',').count(), 2);
        assert_eq!(
            router.replica_at(dest.split(',').next().unwrap()),
            Some(d.primary())
        );
    }
}

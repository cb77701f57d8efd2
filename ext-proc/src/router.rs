//! The routing decision: fingerprint → candidates → overlap → credit → load
//! → pick → reserve, over state shared by every Envoy stream.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::config::{self, default_replica_id, LongLane, Settings};
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
    /// In the long-prompt lane.
    pub long: bool,
    /// The data-parallel rank this target is, behind a shared address.
    pub dp_rank: Option<u32>,
    /// Suited to short outputs (e.g. speculative decoding): preferred for
    /// them when cache and load tie.
    pub short_output: bool,
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
    /// The request's output cap, when the client set one.
    pub max_output_tokens: Option<u64>,
}

/// Why a request could not be routed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    #[error("no replica serves model {0:?}")]
    NoReplicaForModel(String),
    #[error("no healthy replica serves model {0:?}")]
    NoHealthyReplica(String),
    #[error("every eligible replica is at its in-flight or queue limit")]
    Saturated,
}

/// A routing decision. Dropping it releases the load it reserved.
#[derive(Debug)]
pub struct Decision {
    /// Chosen replica first, then fallbacks for retries.
    pub order: Vec<usize>,
    /// Leading blocks the chosen replica already held.
    pub overlap: u32,
    /// The prompt extends an earlier one (else it was scored as a first
    /// turn, under `HEARTH_FIRST_TURN_CAP`).
    pub continues: bool,
    /// Every candidate as it was scored, in replica order (for the
    /// decision journal and metrics; built from numbers the decision
    /// computed anyway).
    pub candidates: Vec<ScoredCandidate>,
    pub reservation: Reservation,
}

/// One candidate replica as a decision saw it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScoredCandidate {
    /// Index into [`Router::replicas`].
    pub replica: usize,
    /// Leading request blocks it held.
    pub overlap: u32,
    /// Credit under the affinity basis, in blocks.
    pub credit: f64,
    /// In-flight load before this request, in load units.
    pub load: f64,
    /// `credit - alpha * load`.
    pub score: f64,
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
    /// The engine's own figures (for this target's share of its address).
    engine: Option<EngineSignals>,
}

/// What an engine's Prometheus metrics said, when.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EngineSignals {
    /// Requests queued in the engine.
    pub waiting: f64,
    /// Requests the engine is running (from every gateway).
    pub running: f64,
    /// KV cache utilisation, 0..1, when reported.
    pub kv_usage: Option<f64>,
    pub at: Instant,
    /// This sidecar's own in-flight requests on the target when the
    /// figures arrived: `running` beyond it is other gateways' traffic.
    pub own_in_flight: u32,
}

/// An engine's figures on the state endpoint.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct EngineSnapshot {
    pub waiting: f64,
    pub running: f64,
    pub kv_usage: Option<f64>,
    pub age_s: f64,
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
    pub long: bool,
    pub dp_rank: Option<u32>,
    /// The engine's last scraped figures, if any.
    pub engine: Option<EngineSnapshot>,
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
    long_prompt_bytes: u64,
    long_lane: LongLane,
    /// Some replica is tagged `long` (else the lane is off).
    any_long: bool,
    engine_stale: Duration,
    engine_load_weight: f64,
    max_queue: u64,
    short_output_tokens: u64,
    state: Mutex<Vec<ReplicaState>>,
    /// Last full block of recent prompts, fleet-wide (bounded LRU): a
    /// request whose overlap reaches one continues an earlier prompt.
    /// Locked after `state`, never before.
    tips: Mutex<LruBlocks>,
    rr: AtomicUsize,
    /// The replica list's version: bumped each time the list changes, so
    /// the endpoint-discovery stream knows to push it to Envoy.
    version: tokio::sync::watch::Sender<u64>,
    decisions: AtomicU64,
    hashed: AtomicU64,
    rejected: AtomicU64,
    answered: AtomicU64,
    unanswered: AtomicU64,
}

impl Router {
    pub fn new(settings: &Settings) -> Arc<Router> {
        // A data-parallel endpoint becomes one target per rank.
        let replicas: Vec<Replica> = settings
            .upstreams
            .iter()
            .enumerate()
            .flat_map(|(i, u)| {
                let id = u.id.clone().unwrap_or_else(|| default_replica_id(i));
                (0..u.dp_ranks).map(move |rank| Replica {
                    id: if u.dp_ranks > 1 {
                        format!("{id}/rank{rank}")
                    } else {
                        id.clone()
                    },
                    addr: u.addr,
                    models: u.models.clone(),
                    long: u.long,
                    dp_rank: (u.dp_ranks > 1).then_some(rank),
                    short_output: u.short_output,
                })
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
                engine: None,
            })
            .collect();
        Arc::new(Router {
            any_long: replicas.iter().any(|r| r.long),
            replicas,
            params: settings.score_params(),
            block_size: settings.block_size,
            load_unit_bytes: settings.load_unit_bytes,
            max_inflight: settings.max_inflight,
            fallbacks: settings.fallbacks,
            health_params: settings.health_params(),
            long_prompt_bytes: settings.long_prompt_bytes,
            long_lane: settings.long_lane,
            engine_stale: config::seconds(settings.engine_metrics_stale_seconds),
            engine_load_weight: settings.engine_load_weight,
            max_queue: settings.max_queue,
            short_output_tokens: settings.short_output_tokens,
            state: Mutex::new(state),
            tips: Mutex::new(LruBlocks::new(settings.warmth_blocks)),
            rr: AtomicUsize::new(0),
            version: tokio::sync::watch::Sender::new(1),
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

    /// Index of the replica at `addr`, if it is one of ours (`prefer` when
    /// it is at that address: data-parallel ranks share one).
    pub fn replica_at(&self, addr: &str, prefer: Option<usize>) -> Option<usize> {
        if let Some(p) = prefer.filter(|&p| self.replicas[p].addr.to_string() == addr) {
            return Some(p);
        }
        self.replicas
            .iter()
            .position(|r| r.addr.to_string() == addr)
    }

    /// `ip:port,ip:port,...` for the decision's order (each address once).
    pub fn destination(&self, order: &[usize]) -> String {
        let mut seen: Vec<SocketAddr> = Vec::with_capacity(order.len());
        for &i in order {
            let a = self.replicas[i].addr;
            if !seen.contains(&a) {
                seen.push(a);
            }
        }
        seen.iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Engine figures scraped from `addr`'s metrics, shared by its ranks.
    pub fn set_engine_signals(&self, addr: SocketAddr, signals: EngineSignals) {
        let ranks = self
            .replicas
            .iter()
            .filter(|r| r.addr == addr)
            .count()
            .max(1) as f64;
        let mut state = self.lock();
        for (r, s) in self.replicas.iter().zip(state.iter_mut()) {
            if r.addr == addr {
                s.engine = Some(EngineSignals {
                    waiting: signals.waiting / ranks,
                    running: signals.running / ranks,
                    own_in_flight: s.in_flight,
                    ..signals
                });
            }
        }
    }

    /// Engine figures that are still fresh.
    fn fresh_engine(&self, s: &ReplicaState, now: Instant) -> Option<EngineSignals> {
        s.engine
            .filter(|e| now.duration_since(e.at) <= self.engine_stale)
    }

    fn lock(&self) -> MutexGuard<'_, Vec<ReplicaState>> {
        // A panic while holding the lock cannot leave the state torn in a
        // way that matters more than losing routing altogether.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Chooses a replica for `req` and reserves load on it.
    pub fn decide(self: &Arc<Self>, req: &RequestInfo) -> Result<Decision, RouteError> {
        self.decide_within(req, None)
    }

    /// As [`Router::decide`], but only among the replicas in `allowed`
    /// when given (the Gateway API Inference Extension's subset hint).
    pub fn decide_within(
        self: &Arc<Self>,
        req: &RequestInfo,
        allowed: Option<&[usize]>,
    ) -> Result<Decision, RouteError> {
        self.decisions.fetch_add(1, Ordering::Relaxed);
        if !req.hashes.is_empty() {
            self.hashed.fetch_add(1, Ordering::Relaxed);
        }
        let mut state = self.lock();

        // Candidates: healthy replicas that serve the model and have room.
        let serving: Vec<usize> = (0..self.replicas.len())
            .filter(|&i| self.replicas[i].serves(req.model.as_deref()))
            .filter(|i| allowed.is_none_or(|a| a.contains(i)))
            .collect();
        if serving.is_empty() {
            self.rejected.fetch_add(1, Ordering::Relaxed);
            return Err(RouteError::NoReplicaForModel(
                req.model.clone().unwrap_or_default(),
            ));
        }
        // The long-prompt lane: long prompts only on `long` replicas; short
        // ones per HEARTH_LONG_LANE (avoid-unless-warm is settled below,
        // once overlaps are known).
        let long_request = self.any_long && req.prompt_bytes >= self.long_prompt_bytes;
        let in_lane: Vec<usize> = serving
            .into_iter()
            .filter(|&i| state[i].health.is_serving())
            .filter(|&i| match (long_request, self.any_long, self.long_lane) {
                (true, _, _) => self.replicas[i].long,
                (false, true, LongLane::Exclusive) => !self.replicas[i].long,
                _ => true,
            })
            .collect();
        let healthy: Vec<usize> =
            if !long_request && self.any_long && self.long_lane == LongLane::Avoid {
                let short_only: Vec<usize> = in_lane
                    .iter()
                    .copied()
                    .filter(|&i| !self.replicas[i].long)
                    .collect();
                if short_only.is_empty() {
                    in_lane
                } else {
                    short_only
                }
            } else {
                in_lane
            };
        if healthy.is_empty() {
            self.rejected.fetch_add(1, Ordering::Relaxed);
            return Err(RouteError::NoHealthyReplica(
                req.model.clone().unwrap_or_default(),
            ));
        }
        // Admission: in-flight and engine-queue limits.
        let now = Instant::now();
        let candidates: Vec<usize> = healthy
            .into_iter()
            .filter(|&i| self.max_inflight == 0 || state[i].in_flight < self.max_inflight)
            .filter(|&i| {
                self.max_queue == 0
                    || self
                        .fresh_engine(&state[i], now)
                        .is_none_or(|e| e.waiting < self.max_queue as f64)
            })
            .collect();
        if candidates.is_empty() {
            self.rejected.fetch_add(1, Ordering::Relaxed);
            return Err(RouteError::Saturated);
        }

        // Overlap and load per candidate (the overlap searches of all
        // candidates run together), then the scoring rule.
        let sets: Vec<&LruBlocks> = candidates.iter().map(|&i| &state[i].warmth).collect();
        let overlaps = LruBlocks::leading_overlaps(&sets, &req.hashes);
        let (candidates, overlaps) = self.warm_long_only(candidates, overlaps, long_request);
        let warmest = overlaps.iter().copied().max().unwrap_or(0);
        let mut tips = self.tips.lock().unwrap_or_else(|p| p.into_inner());
        let continues = req.hashes[..warmest.min(req.hashes.len())]
            .iter()
            .rev()
            .any(|&h| tips.contains(h));
        let scored: Vec<Candidate> = candidates
            .iter()
            .zip(overlaps)
            .map(|(&i, overlap)| Candidate {
                overlap: overlap as u32,
                load: state[i].load + self.engine_load(&state[i], now),
            })
            .collect();
        // Round-robin among exact ties: the turn advances only when the
        // top of the ranking was a tie, so regular traffic patterns cannot
        // keep landing ties on the same replica.
        let rr = self.rr.load(Ordering::Relaxed);
        let ranking = policy::rank_scored(&self.params.for_request(continues), &scored, rr);
        let ranked = &self.prefer_profile(ranking.order.clone(), &ranking.scores, &candidates, req);
        if let [first, second, ..] = ranked[..] {
            let tied = ranking.scores[first] == ranking.scores[second]
                && scored[first].overlap == scored[second].overlap;
            if tied {
                self.rr.fetch_add(1, Ordering::Relaxed);
            }
        }
        let order: Vec<usize> = ranked
            .iter()
            .take(1 + self.fallbacks)
            .map(|&k| candidates[k])
            .collect();
        let chosen = order[0];
        let overlap = scored[ranked[0]].overlap;
        let traced = candidates
            .iter()
            .zip(&scored)
            .zip(ranking.credits.iter().zip(&ranking.scores))
            .map(|((&replica, c), (&credit, &score))| ScoredCandidate {
                replica,
                overlap: c.overlap,
                credit,
                load: c.load,
                score,
            })
            .collect();

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
        // The prompt's last full block (a trailing partial block changes as
        // the conversation grows, so the next turn never matches it).
        let full = if req.prompt_bytes == 0 {
            req.hashes.len()
        } else {
            req.hashes
                .len()
                .min((req.prompt_bytes / self.block_size as u64) as usize)
        };
        if let Some(&tip) = full.checked_sub(1).and_then(|k| req.hashes.get(k)) {
            tips.touch(tip);
        }
        drop(tips);
        drop(state);

        Ok(Decision {
            order,
            overlap,
            continues,
            candidates: traced,
            reservation: Reservation {
                router: Arc::clone(self),
                replica: chosen,
                weight,
            },
        })
    }

    /// Among the candidates tied for the top score, those whose output
    /// profile suits the request go first (short outputs to replicas tagged
    /// `profile=short-output`, longer ones elsewhere); the rest of the order
    /// is kept.
    fn prefer_profile(
        &self,
        mut order: Vec<usize>,
        scores: &[f64],
        candidates: &[usize],
        req: &RequestInfo,
    ) -> Vec<usize> {
        let Some(tokens) = req.max_output_tokens else {
            return order;
        };
        if !self.replicas.iter().any(|r| r.short_output) || order.is_empty() {
            return order;
        }
        let short = tokens <= self.short_output_tokens;
        let top = scores[order[0]];
        let tied = order.iter().take_while(|&&k| scores[k] == top).count();
        order[..tied].sort_by_key(|&k| self.replicas[candidates[k]].short_output != short);
        order
    }

    /// Under `avoid-unless-warm`, a short prompt keeps a `long` replica
    /// only where the session is cached: more of it than on the least-warm
    /// candidate (unless no other replica is left).
    fn warm_long_only(
        &self,
        candidates: Vec<usize>,
        overlaps: Vec<usize>,
        long_request: bool,
    ) -> (Vec<usize>, Vec<usize>) {
        if long_request || !self.any_long || self.long_lane != LongLane::AvoidUnlessWarm {
            return (candidates, overlaps);
        }
        let least = overlaps.iter().copied().min().unwrap_or(0);
        let kept: (Vec<usize>, Vec<usize>) = candidates
            .iter()
            .zip(&overlaps)
            .filter(|(&i, &o)| !self.replicas[i].long || o > least)
            .map(|(&i, &o)| (i, o))
            .unzip();
        if kept.0.is_empty() {
            (candidates, overlaps)
        } else {
            kept
        }
    }

    /// Load the engine reports beyond this sidecar's own reservations:
    /// queued requests, and running ones other gateways sent.
    fn engine_load(&self, s: &ReplicaState, now: Instant) -> f64 {
        match self.fresh_engine(s, now) {
            Some(e) => {
                let foreign = (e.running - f64::from(e.own_in_flight)).max(0.0);
                (e.waiting + foreign) * self.engine_load_weight
            }
            None => 0.0,
        }
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

    /// A finished request's outcome on replica `i` (passive health; the
    /// engine behind an address is one, so all its ranks share it).
    pub fn record_request(&self, i: usize, outcome: Outcome) {
        let params = self.health_params;
        let Some(addr) = self.replicas.get(i).map(|r| r.addr) else {
            return;
        };
        let now = Instant::now();
        let mut state = self.lock();
        for (r, s) in self.replicas.iter().zip(state.iter_mut()) {
            if r.addr == addr {
                s.health.record_request(outcome, &params, now);
            }
        }
    }

    /// A probe's outcome on the engine at `addr` (active health).
    pub fn record_probe(&self, addr: SocketAddr, outcome: Outcome) {
        let params = self.health_params;
        let now = Instant::now();
        let mut state = self.lock();
        for (r, s) in self.replicas.iter().zip(state.iter_mut()) {
            if r.addr == addr {
                s.health.record_probe(outcome, &params, now);
            }
        }
    }

    /// Each engine address once, with the model to probe it with.
    pub fn engines(&self) -> Vec<(SocketAddr, Option<String>)> {
        let mut out: Vec<(SocketAddr, Option<String>)> = Vec::new();
        for r in &self.replicas {
            if !out.iter().any(|(a, _)| *a == r.addr) {
                out.push((r.addr, r.models.first().cloned()));
            }
        }
        out
    }

    /// Each serving address once, in replica order: what Envoy's `engines`
    /// cluster should hold (endpoint discovery).
    pub fn endpoints(&self) -> Vec<SocketAddr> {
        self.engines().into_iter().map(|(a, _)| a).collect()
    }

    /// The replica list's version; changes whenever [`Router::endpoints`]
    /// may have.
    pub fn watch_endpoints(&self) -> tokio::sync::watch::Receiver<u64> {
        self.version.subscribe()
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
                    long: r.long,
                    dp_rank: r.dp_rank,
                    engine: s.engine.map(|e| EngineSnapshot {
                        waiting: e.waiting,
                        running: e.running,
                        kv_usage: e.kv_usage,
                        age_s: now.duration_since(e.at).as_secs_f64(),
                    }),
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
            max_output_tokens: None,
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
    fn first_turns_spread_by_load_and_later_turns_follow_their_history() {
        let router = router(&["--alpha", "2", "--first-turn-cap", "4"]);
        // 32 shared harness blocks, then each conversation's own.
        let harness: Vec<u64> = (1..=32).collect();
        let turn = |conv: u64, len: u64| {
            let mut h = harness.clone();
            h.extend((0..len).map(|k| 1000 * conv + k));
            req(&h)
        };
        let a = router.decide(&turn(1, 4)).unwrap();
        assert!(!a.continues);
        // A second conversation on the same harness starts elsewhere: the
        // harness is worth 4 blocks of credit, the load 2 x 3 units.
        let b = router.decide(&turn(2, 4)).unwrap();
        assert!(!b.continues);
        assert_ne!(a.primary(), b.primary());
        assert_eq!(b.overlap, 0);
        // The first conversation's next turn continues its prompt and
        // returns to its replica, busy as it is.
        let a2 = router.decide(&turn(1, 8)).unwrap();
        assert!(a2.continues);
        assert_eq!(a2.primary(), a.primary());
        assert_eq!(a2.overlap, 36);
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

    fn lane_router(lane: &str) -> Arc<Router> {
        Router::new(
            &Cli::try_parse_from([
                "x",
                "--upstreams",
                "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3;tag=long",
                "--long-prompt-bytes",
                "100000",
                "--long-lane",
                lane,
                "--fallbacks",
                "5",
            ])
            .unwrap()
            .settings,
        )
    }

    fn sized(hashes: &[u64], bytes: u64) -> RequestInfo {
        RequestInfo {
            hashes: hashes.to_vec(),
            prompt_bytes: bytes,
            model: None,
            max_output_tokens: None,
        }
    }

    #[test]
    fn long_prompts_go_only_to_the_long_lane() {
        for lane in ["shared", "exclusive", "avoid", "avoid-unless-warm"] {
            let r = lane_router(lane);
            let d = r.decide(&sized(&[1], 200_000)).unwrap();
            assert_eq!(d.order, [2], "{lane}");
        }
    }

    #[test]
    fn short_prompts_follow_the_lane_setting() {
        let r = lane_router("shared");
        assert_eq!(r.decide(&sized(&[1], 10)).unwrap().order.len(), 3);
        for lane in ["exclusive", "avoid", "avoid-unless-warm"] {
            let r = lane_router(lane);
            let d = r.decide(&sized(&[1], 10)).unwrap();
            assert!(!d.order.contains(&2), "{lane}: {:?}", d.order);
        }
        // Avoid falls back to the long replica when nothing else is left;
        // exclusive does not.
        for (lane, expect_ok) in [("avoid", true), ("exclusive", false)] {
            let r = lane_router(lane);
            for i in 0..2 {
                for _ in 0..3 {
                    r.record_request(i, Outcome::Failure(crate::health::Failure::ServerError));
                }
            }
            assert_eq!(r.decide(&sized(&[1], 10)).is_ok(), expect_ok, "{lane}");
        }
    }

    #[test]
    fn avoid_unless_warm_keeps_a_long_replica_that_holds_the_session() {
        let r = lane_router("avoid-unless-warm");
        // The session started long, on the long replica.
        drop(r.decide(&sized(&[7, 8, 9], 200_000)).unwrap());
        // Its next (short, after compaction-like trimming) prompt shares
        // the prefix: the long replica stays eligible, and wins on warmth.
        let d = r.decide(&sized(&[7, 8, 9, 10], 50)).unwrap();
        assert_eq!(d.primary(), 2);
        // A cold short prompt does not get it.
        let d = r.decide(&sized(&[99], 50)).unwrap();
        assert!(!d.order.contains(&2));
    }

    #[test]
    fn data_parallel_ranks_are_separate_targets_behind_one_address() {
        let r = Router::new(
            &Cli::try_parse_from(["x", "--upstreams", "127.0.0.1:1;id=e;dp=2,127.0.0.1:2"])
                .unwrap()
                .settings,
        );
        let ids: Vec<_> = r.replicas().iter().map(|x| x.id.as_str()).collect();
        assert_eq!(ids, ["e/rank0", "e/rank1", "replica-1"]);
        assert_eq!(r.replicas()[1].dp_rank, Some(1));
        // The destination names each address once.
        assert_eq!(r.destination(&[0, 1, 2]), "127.0.0.1:1,127.0.0.1:2");
        assert_eq!(r.replica_at("127.0.0.1:1", Some(1)), Some(1));
        // Warmth is per rank: a session returns to its rank.
        let first = r.decide(&req(&[4, 5])).unwrap();
        let rank = first.primary();
        drop(first);
        assert_eq!(r.decide(&req(&[4, 5, 6])).unwrap().primary(), rank);
        // Health is per engine: both ranks are fenced together.
        for _ in 0..3 {
            r.record_request(0, Outcome::Failure(crate::health::Failure::ServerError));
        }
        let snap = r.snapshot();
        assert_eq!(
            snap.replicas[1].health.state,
            crate::health::HealthState::Fenced
        );
    }

    #[test]
    fn engine_figures_add_load_until_they_go_stale() {
        let r = Router::new(
            &Cli::try_parse_from([
                "x",
                "--upstreams",
                "127.0.0.1:1,127.0.0.1:2",
                "--engine-metrics-stale-seconds",
                "5",
                "--max-queue",
                "4",
            ])
            .unwrap()
            .settings,
        );
        let busy = |waiting: f64, running: f64, age: u64| EngineSignals {
            waiting,
            running,
            kv_usage: None,
            at: Instant::now() - Duration::from_secs(age),
            own_in_flight: 0,
        };
        let a: SocketAddr = "127.0.0.1:1".parse().unwrap();
        // Another gateway keeps engine 0 busy: new work goes to engine 1.
        r.set_engine_signals(a, busy(0.0, 6.0, 0));
        for k in 0..4 {
            assert_eq!(r.decide(&req(&[100 + k])).unwrap().primary(), 1);
        }
        // Stale figures are ignored.
        r.set_engine_signals(a, busy(0.0, 60.0, 30));
        let d = r.decide(&req(&[200])).unwrap();
        assert_eq!(d.order.len(), 2);
        // A full queue everywhere sheds.
        r.set_engine_signals(a, busy(4.0, 0.0, 0));
        r.set_engine_signals("127.0.0.1:2".parse().unwrap(), busy(9.0, 0.0, 0));
        assert_eq!(r.decide(&req(&[300])).unwrap_err(), RouteError::Saturated);
    }

    #[test]
    fn output_profiles_break_ties() {
        let r = Router::new(
            &Cli::try_parse_from([
                "x",
                "--upstreams",
                "127.0.0.1:1,127.0.0.1:2;profile=short-output",
            ])
            .unwrap()
            .settings,
        );
        let with_cap = |hashes: &[u64], cap: Option<u64>| RequestInfo {
            max_output_tokens: cap,
            ..req(hashes)
        };
        for k in 0..4 {
            assert_eq!(
                r.decide(&with_cap(&[10 + k], Some(16))).unwrap().primary(),
                1
            );
            assert_eq!(
                r.decide(&with_cap(&[20 + k], Some(4096)))
                    .unwrap()
                    .primary(),
                0
            );
        }
        // Warmth still beats the profile.
        drop(r.decide(&with_cap(&[30], Some(4096))).unwrap());
        assert_eq!(
            r.decide(&with_cap(&[30, 31], Some(16))).unwrap().primary(),
            0
        );
    }

    #[test]
    fn destination_lists_fallbacks_in_rank_order() {
        let router = router(&["--fallbacks", "1"]);
        let d = router.decide(&req(&[5])).unwrap();
        assert_eq!(d.order.len(), 2);
        let dest = router.destination(&d.order);
        assert_eq!(dest.split(',').count(), 2);
        assert_eq!(
            router.replica_at(dest.split(',').next().unwrap(), None),
            Some(d.primary())
        );
    }
}

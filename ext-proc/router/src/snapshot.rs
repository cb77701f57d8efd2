//! What `/state` shows: the router's figures and each serving replica's,
//! as serde types.

use std::sync::atomic::Ordering;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::health::{FleetHealth, HealthSnapshot};
use crate::kv_events::KvEventsSnapshot;
use crate::params::AffinityBasis;
use crate::peers::PeersSnapshot;
use crate::replica::EventEndpoint;
use crate::router::{lock, Router};
use crate::usage::UsageSnapshot;

/// An engine's figures on the state endpoint.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct EngineSnapshot {
    pub waiting: f64,
    pub running: f64,
    pub kv_usage: Option<f64>,
    pub age_s: f64,
}

/// A priority band's requests in flight on a replica, and its recent
/// peak there.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct BandSnapshot {
    pub priority: i32,
    pub in_flight: u32,
    pub peak: u32,
}

/// Per-replica figures for the state endpoint.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ReplicaSnapshot {
    pub id: String,
    pub address: String,
    pub models: Vec<String>,
    pub in_flight: u32,
    pub load: f64,
    /// Requests in flight here through the peer sidecars, and their load,
    /// as they last said (0 without peers).
    #[serde(default)]
    pub peer_in_flight: u32,
    #[serde(default)]
    pub peer_load: f64,
    /// Uncached prompt bytes in flight here, this sidecar's and its
    /// peers' (what flow control's `HEARTH_FLOW_UNCACHED_BYTES` limits).
    #[serde(default)]
    pub uncached_in_flight_bytes: u64,
    /// The uncached bytes in flight from which it is saturated (absent:
    /// no limit): `HEARTH_FLOW_UNCACHED_BYTES`, or
    /// `HEARTH_FLOW_PREFILL_SECONDS` of its learnt prefill rate when less.
    #[serde(default)]
    pub uncached_limit_bytes: Option<u64>,
    /// How fast its engine reads prompts, in bytes a second, learnt from
    /// the first tokens of prompts it read alone (absent until one was
    /// timed), and how many were timed.
    #[serde(default)]
    pub prefill_bytes_per_second: Option<f64>,
    #[serde(default)]
    pub prefill_samples: u64,
    /// Saturated, for flow control: by the engine's fresh figures or the
    /// uncached prompt in flight.
    #[serde(default)]
    pub saturated: bool,
    /// The requests its engine runs at once, as learnt from its figures
    /// (none until requests waited there in two figures in a row).
    #[serde(default)]
    pub engine_batch: Option<f64>,
    /// This sidecar's requests in flight here by priority band, highest
    /// first, with each band's peak within `HEARTH_FLOW_HEADROOM_SECONDS`
    /// (the slots kept from lower bands are the peaks less the in flight).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub bands: Vec<BandSnapshot>,
    /// Seconds for which the bands below a higher band about here still
    /// find it saturated, paced by the last lower band's prompt sent here
    /// (`HEARTH_FLOW_LOWER_PREFILL_SHARE`; absent: not paced now).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lower_bands_paced_s: Option<f64>,
    /// Flows (a band and a fairness id) of this sidecar about here: with
    /// requests in flight, or a peak within
    /// `HEARTH_FLOW_FAIR_SLOTS_SECONDS` (the slots kept for tenants under
    /// their fair share are those peaks less the in flight).
    #[serde(default)]
    pub flows_about: usize,
    pub warmth_blocks: usize,
    pub warmth_capacity: usize,
    pub warmth_memory_bytes: usize,
    pub routed_total: u64,
    /// Conversations whose latest turn went here within the resident
    /// window (see `HEARTH_RESIDENT_SECONDS`).
    pub resident_conversations: usize,
    /// The requests its prompts drew here lately (a decaying count over
    /// `HEARTH_RESIDENT_SECONDS`, see `HEARTH_RESIDENT_LOAD`).
    #[serde(default)]
    pub drawn_requests: f64,
    pub health: HealthSnapshot,
    pub long: bool,
    pub dp_rank: Option<u32>,
    /// The engine's last scraped figures, if any.
    pub engine: Option<EngineSnapshot>,
    /// What its answers' usage said of its cache.
    pub usage: UsageSnapshot,
    /// Its engine's KV cache events, for a replica listed with
    /// `kv_events=` (absent otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events: Option<KvEventsSnapshot>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Snapshot {
    pub affinity_basis: AffinityBasis,
    pub affinity_cap: u32,
    pub alpha: f64,
    pub block_size: usize,
    /// The share of recent first turns that went on to a second turn
    /// (see [`crate::tips::Sequels`]), and the credit cap a first turn
    /// has now: `HEARTH_FIRST_TURN_CAP` divided by that share.
    #[serde(default)]
    pub first_turn_sequel_share: f64,
    #[serde(default)]
    pub first_turn_cap_now: u32,
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
    pub upstreams: UpstreamsSnapshot,
    /// The peer sidecars (absent without `HEARTH_PEERS_URL`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peers: Option<PeersSnapshot>,
    /// The serving replicas (removed ones are not listed).
    pub replicas: Vec<ReplicaSnapshot>,
}

/// The replica list's history on the state endpoint.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct UpstreamsSnapshot {
    /// Bumped each time a reload changed the list.
    pub version: u64,
    /// Reloads applied (changed or not).
    pub reloads_total: u64,
    /// Reloads refused: the file did not parse or check; the list stayed.
    pub reload_errors_total: u64,
    /// Why the last reload was refused, until one is applied.
    pub reload_error: Option<String>,
    /// Requests still running on replicas a reload removed.
    pub draining_in_flight: u32,
    /// Where the list comes from, and whether that source is in step.
    #[serde(default)]
    pub source: crate::router::SourceStatus,
}

impl Router {
    /// The router's figures at `now` (ages and health timers count to it).
    pub fn snapshot_at(&self, now: Instant) -> Snapshot {
        let peers = self.peers_snapshot_at(now);
        let fleet = self.lock();
        let state = &fleet.state;
        let decisions = self.decisions.load(Ordering::Relaxed);
        let hashed = self.hashed.load(Ordering::Relaxed);
        let sequel_share = lock(&self.tips).sequels().share();
        Snapshot {
            affinity_basis: self.params.score.basis,
            affinity_cap: self.params.score.cap,
            alpha: self.params.score.alpha,
            block_size: self.params.block_size,
            first_turn_sequel_share: sequel_share,
            first_turn_cap_now: self.params.score.for_request(false, sequel_share).cap,
            health: FleetHealth::of(fleet.serving().map(|(i, _)| state[i].health.state())),
            decisions_total: decisions,
            hashed_total: hashed,
            unhashed_total: decisions - hashed,
            rejected_total: self.rejected.load(Ordering::Relaxed),
            answered_total: self.answered.load(Ordering::Relaxed),
            unanswered_total: self.unanswered.load(Ordering::Relaxed),
            peers,
            upstreams: UpstreamsSnapshot {
                version: self.version(),
                reloads_total: self.reloads.load(Ordering::Relaxed),
                reload_errors_total: self.reload_errors.load(Ordering::Relaxed),
                reload_error: self
                    .reload_error
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .clone(),
                draining_in_flight: fleet
                    .replicas
                    .iter()
                    .zip(state)
                    .filter(|(r, _)| r.retired)
                    .map(|(_, s)| s.in_flight)
                    .sum(),
                source: self.source(),
            },
            replicas: fleet
                .serving()
                .map(|(i, r)| (r, &state[i]))
                .map(|(r, s)| ReplicaSnapshot {
                    id: r.id.clone(),
                    address: r.addr.to_string(),
                    models: r.models.clone(),
                    in_flight: s.in_flight,
                    load: s.load,
                    peer_in_flight: s.peer_in_flight,
                    peer_load: s.peer_load,
                    uncached_in_flight_bytes: self.uncached_in_flight(s),
                    uncached_limit_bytes: self.uncached_limit(s),
                    prefill_bytes_per_second: s.prefill_rate.bytes_per_second(),
                    prefill_samples: s.prefill_rate.samples(),
                    saturated: self.saturated(s, now),
                    engine_batch: s.batch.size(),
                    bands: s
                        .bands
                        .view(now, self.params.flow.headroom)
                        .into_iter()
                        .map(|(priority, in_flight, peak)| BandSnapshot {
                            priority,
                            in_flight,
                            peak,
                        })
                        .collect(),
                    lower_bands_paced_s: s
                        .lower_paced_until
                        .filter(|&until| until > now)
                        .map(|until| (until - now).as_secs_f64()),
                    flows_about: s.flows.about(now, self.params.flow.fair_window).count(),
                    warmth_blocks: s.warmth.len(),
                    warmth_capacity: s.warmth.capacity(),
                    warmth_memory_bytes: s.warmth.memory_bytes(),
                    routed_total: s.routed,
                    resident_conversations: s.resident.len(),
                    drawn_requests: s.drawn.at(now, self.params.resident_window),
                    health: s.health.snapshot(now),
                    long: r.long,
                    dp_rank: r.dp_rank,
                    engine: s.engine.map(|e| EngineSnapshot {
                        waiting: e.waiting,
                        running: e.running,
                        kv_usage: e.kv_usage,
                        age_s: now.duration_since(e.at).as_secs_f64(),
                    }),
                    usage: s.usage.snapshot(),
                    kv_events: r.kv_events.as_ref().map(|e| {
                        let endpoint = match (e, &s.kv.stated_endpoint) {
                            (EventEndpoint::FromEngine, Some(stated)) => {
                                format!("auto: {stated}")
                            }
                            _ => e.to_string(),
                        };
                        s.kv.snapshot(endpoint, now)
                    }),
                })
                .collect(),
        }
    }
}

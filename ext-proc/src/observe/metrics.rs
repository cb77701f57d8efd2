//! Prometheus metrics (`GET /metrics` on the admin endpoint), registered
//! explicitly per component with `prometheus-client`. Every name is
//! `hearth_*` and documented in `docs/metrics.md`.
//!
//! Event metrics (decisions, latency, overlap, sessions, probes) are
//! counted as they happen; per-replica figures (in-flight, load, warmth,
//! health, fencings, routed) are read from the router's snapshot at scrape
//! time by [`FleetCollector`], so the decision path pays nothing for them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};

use crate::observe::series::{DecisionOutcome, Series, SessionResult};
use hearth_router::health::HealthState;
use hearth_router::Router;
use hearth_router::{AffinityBasis, KvEventsSnapshot, ReplicaSnapshot, Snapshot};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DecisionLabels {
    outcome: &'static str,
    basis: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProbeLabels {
    engine: String,
    result: &'static str,
}

/// Per-decision metrics.
#[derive(Debug)]
pub struct DecisionMetrics {
    basis: &'static str,
    decisions: Family<DecisionLabels, Counter>,
    latency: Histogram,
    overlap: Histogram,
    prompt_blocks: Counter,
    overlap_blocks: Counter,
    sessions: Family<ResultLabel, Counter>,
}

impl DecisionMetrics {
    pub fn register(reg: &mut Registry, basis: AffinityBasis) -> Self {
        let m = DecisionMetrics {
            basis: basis.as_str(),
            decisions: Family::default(),
            // 1 µs .. ~0.26 s
            latency: Histogram::new(exponential_buckets(1e-6, 2.0, 19)),
            // 0, 1, 2, 4 .. 1024 blocks (a 2 MiB prefix of 2 KiB blocks)
            overlap: Histogram::new(std::iter::once(0.0).chain(exponential_buckets(1.0, 2.0, 11))),
            prompt_blocks: Counter::default(),
            overlap_blocks: Counter::default(),
            sessions: Family::default(),
        };
        reg.register(
            "hearth_decisions",
            "Routing decisions by outcome (routed, no_replica, no_healthy_replica, saturated) and affinity basis",
            m.decisions.clone(),
        );
        reg.register_with_unit(
            "hearth_decision_duration",
            "Time the sidecar spent deciding (candidates, overlap, score, reserve)",
            Unit::Seconds,
            m.latency.clone(),
        );
        reg.register(
            "hearth_decision_overlap_blocks",
            "Leading fingerprint blocks the chosen replica already held, per routed fingerprinted request",
            m.overlap.clone(),
        );
        reg.register(
            "hearth_prompt_blocks",
            "Fingerprint blocks of routed requests (with hearth_overlap_blocks_total: the cache-hit proxy)",
            m.prompt_blocks.clone(),
        );
        reg.register(
            "hearth_overlap_blocks",
            "Fingerprint blocks of routed requests that the chosen replica already held",
            m.overlap_blocks.clone(),
        );
        reg.register(
            "hearth_session_turns",
            "Routed fingerprinted requests by session result: new (no earlier turn seen), stay (same replica as the previous turn), move",
            m.sessions.clone(),
        );
        m
    }

    /// One decision: its outcome, how long it took and, when routed with a
    /// fingerprint, its overlap and session result.
    pub fn record(
        &self,
        outcome: DecisionOutcome,
        elapsed: Duration,
        blocks: Option<(u32, usize)>,
        session: Option<SessionResult>,
    ) {
        self.decisions
            .get_or_create(&DecisionLabels {
                outcome: outcome.as_str(),
                basis: self.basis,
            })
            .inc();
        self.latency.observe(elapsed.as_secs_f64());
        if let Some((overlap, total)) = blocks {
            self.overlap.observe(f64::from(overlap));
            self.overlap_blocks.inc_by(u64::from(overlap));
            self.prompt_blocks.inc_by(total as u64);
        }
        if let Some(s) = session {
            self.sessions
                .get_or_create(&ResultLabel { result: s.as_str() })
                .inc();
        }
    }
}

/// Active probe results.
#[derive(Debug)]
pub struct ProbeMetrics {
    probes: Family<ProbeLabels, Counter>,
}

impl ProbeMetrics {
    pub fn register(reg: &mut Registry) -> Self {
        let m = ProbeMetrics {
            probes: Family::default(),
        };
        reg.register(
            "hearth_probes",
            "Active probes by engine address and result (success; unauthorized, the engine refused the sidecar's credentials; the failure: timeout, connect_failure, server_error, empty_answer, probe_models; or not run: withheld_busy, real requests came first; withheld_no_free_slot, every slot of a slot engine held a conversation or ran; answered, a real request succeeded while it was pending)",
            m.probes.clone(),
        );
        m
    }

    pub fn record(&self, engine: std::net::SocketAddr, result: &'static str) {
        self.probes
            .get_or_create(&ProbeLabels {
                engine: engine.to_string(),
                result,
            })
            .inc();
    }
}

/// Per-replica and fleet figures, read from the router at scrape time.
#[derive(Debug)]
pub struct FleetCollector {
    router: Arc<RouterRef>,
    series: Arc<Series>,
    /// Decision records the journal file's writer could not keep up with.
    journal_dropped: Arc<AtomicU64>,
    /// The pool's name (the `name` label of the `llm_d_epp_*` pool series).
    pool: String,
}

/// `Router` is not `Debug`; the collector trait wants it.
pub struct RouterRef(pub Arc<Router>);

impl std::fmt::Debug for RouterRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Router")
    }
}

impl FleetCollector {
    pub fn register(
        reg: &mut Registry,
        router: Arc<Router>,
        series: Arc<Series>,
        journal_dropped: Arc<AtomicU64>,
        pool: &str,
    ) {
        reg.register_collector(Box::new(FleetCollector {
            router: Arc::new(RouterRef(router)),
            series,
            journal_dropped,
            pool: pool.to_string(),
        }));
    }
}

/// How a series reads its value from what a scrape sees.
enum Read<T> {
    Gauge(fn(&T) -> f64),
    Counter(fn(&T) -> u64),
}

/// One series read at scrape time: adding a series is one entry in
/// [`REPLICA_SERIES`] or [`FLEET_SERIES`].
struct Scraped<T: 'static> {
    name: &'static str,
    help: &'static str,
    unit: Option<Unit>,
    read: Read<T>,
}

const fn gauge<T>(name: &'static str, help: &'static str, read: fn(&T) -> f64) -> Scraped<T> {
    Scraped {
        name,
        help,
        unit: None,
        read: Read::Gauge(read),
    }
}

const fn counter<T>(name: &'static str, help: &'static str, read: fn(&T) -> u64) -> Scraped<T> {
    Scraped {
        name,
        help,
        unit: None,
        read: Read::Counter(read),
    }
}

fn flag(b: bool) -> f64 {
    f64::from(u8::from(b))
}

/// Per-replica series, labelled `replica` (the replica's id).
const REPLICA_SERIES: &[Scraped<ReplicaSnapshot>] = &[
    gauge(
        "hearth_replica_in_flight",
        "Requests in flight on the replica (reserved by this sidecar)",
        |r| f64::from(r.in_flight),
    ),
    gauge(
        "hearth_replica_load",
        "In-flight load on the replica, in load units (1 + uncached bytes / HEARTH_LOAD_UNIT_BYTES per request until its answer's first chunk, then 1)",
        |r| r.load,
    ),
    gauge(
        "hearth_replica_warmth_blocks",
        "Block hashes in the replica's warmth index",
        |r| r.warmth_blocks as f64,
    ),
    gauge(
        "hearth_replica_warmth_capacity_blocks",
        "Capacity of the replica's warmth index, in blocks",
        |r| r.warmth_capacity as f64,
    ),
    Scraped {
        name: "hearth_replica_warmth_memory",
        help: "Memory of the replica's warmth index",
        unit: Some(Unit::Bytes),
        read: Read::Gauge(|r| r.warmth_memory_bytes as f64),
    },
    gauge(
        "hearth_replica_serving",
        "Replica health: 1 serving, 0 fenced",
        |r| flag(r.health.state == HealthState::Serving),
    ),
    gauge(
        "hearth_replica_credentials_rejected",
        "1 while the replica's engine refuses the sidecar's credentials (401/403 to its probes or metrics scrapes; see HEARTH_ENGINE_API_KEY); never a reason to fence",
        |r| flag(r.health.credentials_error.is_some()),
    ),
    counter(
        "hearth_replica_fencings",
        "Times the replica was fenced (taken out of rotation)",
        |r| r.health.fenced_total,
    ),
    counter(
        "hearth_replica_requests",
        "Requests routed to the replica as first choice",
        |r| r.routed_total,
    ),
    counter(
        "hearth_replica_prompt_tokens",
        "Prompt tokens of the replica's answers that reported usage (the engine's own count)",
        |r| r.usage.prompt_tokens_total,
    ),
    counter(
        "hearth_replica_cached_tokens",
        "Of those, prompt tokens the engine read from its cache (usage.prompt_tokens_details.cached_tokens)",
        |r| r.usage.cached_tokens_total,
    ),
    counter(
        "hearth_replica_predicted_cached_tokens",
        "Cached tokens the decisions predicted, for the answers from the chosen replica",
        |r| r.usage.predicted_cached_tokens_total,
    ),
    counter(
        "hearth_replica_compared_cached_tokens",
        "Cached tokens the engine served on those same answers (compare with the predicted counter)",
        |r| r.usage.compared_cached_tokens_total,
    ),
    counter(
        "hearth_replica_warmth_shrinks",
        "Warmth corrections: the engine served less than predicted, the index shrank toward its real cache",
        |r| r.usage.shrinks_total,
    ),
    counter(
        "hearth_replica_warmth_growths",
        "Warmth corrections: a full index predicted less than the engine served, the index grew",
        |r| r.usage.growths_total,
    ),
    counter(
        "hearth_replica_restarts",
        "Engine restarts its own metrics showed (a new start time, a falling prompt-token counter); the replica's warmth was dropped",
        |r| r.usage.restarts_total,
    ),
    counter(
        "hearth_replica_recent_losses",
        "Continuing turns whose engine had lost what it read last (a restart on an engine whose metrics do not show one, or a client's spelling the fingerprint does not read); counted only",
        |r| r.usage.recent_losses_total,
    ),
];

/// The llm-d router's pool series, labelled `name` (the pool): what the
/// engines' own metrics said (`vllm:*`, `sglang:*`, `llamacpp:*`, scraped
/// every `HEARTH_ENGINE_METRICS_SECONDS`), over the replicas that said it.
const POOL_SERIES: &[Scraped<FleetView>] = &[
    gauge(
        "llm_d_epp_ready_endpoints",
        "Endpoints serving (not fenced)",
        |f| {
            let serving = f.snap.replicas.iter();
            serving
                .filter(|r| r.health.state == HealthState::Serving)
                .count() as f64
        },
    ),
    gauge(
        "llm_d_epp_average_kv_cache_utilization",
        "Mean KV-cache utilization the engines report (0-1; NaN when none reports it)",
        |f| {
            mean(
                f.snap
                    .replicas
                    .iter()
                    .filter_map(|r| r.engine.as_ref()?.kv_usage),
            )
        },
    ),
    gauge(
        "llm_d_epp_average_queue_size",
        "Mean queue depth the engines report (NaN when none reports)",
        |f| {
            mean(
                f.snap
                    .replicas
                    .iter()
                    .filter_map(|r| Some(r.engine.as_ref()?.waiting)),
            )
        },
    ),
    gauge(
        "llm_d_epp_average_running_requests",
        "Mean running requests the engines report (NaN when none reports)",
        |f| {
            mean(
                f.snap
                    .replicas
                    .iter()
                    .filter_map(|r| Some(r.engine.as_ref()?.running)),
            )
        },
    ),
];

fn mean(values: impl Iterator<Item = f64>) -> f64 {
    let (sum, n) = values.fold((0.0, 0u32), |(s, n), v| (s + v, n + 1));
    if n == 0 {
        f64::NAN
    } else {
        sum / f64::from(n)
    }
}

/// What a scrape sees of the fleet as a whole.
struct FleetView {
    snap: Snapshot,
    stay_ratio: f64,
    journal_dropped: u64,
}

/// Fleet-wide series, without labels.
const FLEET_SERIES: &[Scraped<FleetView>] = &[
    gauge(
        "hearth_first_turn_sequel_share",
        "Share of recent first turns (prompts extending no earlier one) that went on to a second turn; the first-turn credit cap is divided by it",
        |f| f.snap.first_turn_sequel_share,
    ),
    gauge(
        "hearth_first_turn_cap_blocks",
        "Credit cap, in blocks, a first turn has now (HEARTH_FIRST_TURN_CAP divided by the sequel share, at most HEARTH_AFFINITY_CAP)",
        |f| f64::from(f.snap.first_turn_cap_now),
    ),
    counter(
        "hearth_requests_unhashed",
        "Requests decided without a fingerprint (routed on load alone)",
        |f| f.snap.unhashed_total,
    ),
    counter(
        "hearth_streams_answered",
        "Routed requests whose stream ended after the engine's response headers",
        |f| f.snap.answered_total,
    ),
    counter(
        "hearth_streams_unanswered",
        "Routed requests whose stream ended before any response headers",
        |f| f.snap.unanswered_total,
    ),
    counter(
        "hearth_upstream_reloads",
        "Reloads of the replica list applied (from HEARTH_UPSTREAMS_FILE)",
        |f| f.snap.upstreams.reloads_total,
    ),
    counter(
        "hearth_upstream_reload_errors",
        "Reloads of the replica list refused (the file did not read, parse or check; the list stayed)",
        |f| f.snap.upstreams.reload_errors_total,
    ),
    gauge(
        "hearth_replica_source_connected",
        "1 while the replica list's source (HEARTH_DISCOVERY's Kubernetes API, or the list or file) is reachable; 0: the last list is kept until it is",
        |f| flag(f.snap.upstreams.source.connected),
    ),
    counter(
        "hearth_replica_source_disconnects",
        "Times the replica list's source was lost (a Kubernetes API connection, for discovery)",
        |f| f.snap.upstreams.source.disconnects_total,
    ),
    gauge(
        "hearth_draining_in_flight",
        "Requests still running on replicas a reload removed",
        |f| f64::from(f.snap.upstreams.draining_in_flight),
    ),
    gauge(
        "hearth_session_stay_ratio",
        "Stays / (stays + moves) of returning sessions over the last 60 s (NaN when none returned)",
        |f| f.stay_ratio,
    ),
    gauge(
        "hearth_cache_hit_share",
        "Share of the fleet's prompt tokens the engines read from cache, over the answers that reported usage (NaN before any)",
        |f| {
            let rs = &f.snap.replicas;
            let prompt: u64 = rs.iter().map(|r| r.usage.prompt_tokens_total).sum();
            let cached: u64 = rs.iter().map(|r| r.usage.cached_tokens_total).sum();
            if prompt > 0 {
                cached as f64 / prompt as f64
            } else {
                f64::NAN
            }
        },
    ),
    counter(
        "hearth_journal_file_dropped",
        "Journal lines (decisions, answers' served figures) not written to HEARTH_JOURNAL_FILE because its writer fell behind (the in-memory journal keeps them)",
        |f| f.journal_dropped,
    ),
];

/// Per-replica series of the engines' KV cache events, labelled
/// `replica`, for the replicas listed with `kv_events=` only.
const KV_SERIES: &[Scraped<KvEventsSnapshot>] = &[
    gauge(
        "hearth_replica_kv_events_connected",
        "1 while the sidecar is subscribed to the replica's KV cache events",
        |k| flag(k.connected),
    ),
    gauge(
        "hearth_replica_kv_events_exact",
        "1 while the replica's event figures are the engine's own (every batch seen since its cache was empty, feed connected); 0: its routing is approximate",
        |k| flag(k.exact),
    ),
    gauge(
        "hearth_replica_kv_held_blocks",
        "Blocks the engine holds, as its KV events say (stored and not removed since)",
        |k| k.held_blocks as f64,
    ),
    gauge(
        "hearth_replica_kv_occupancy_tokens",
        "Tokens the engine's KV cache holds, from its events (NaN while not exact)",
        |k| k.occupancy_tokens.map_or(f64::NAN, |t| t as f64),
    ),
    gauge(
        "hearth_replica_kv_capacity_tokens",
        "Tokens the engine's KV cache held when it first had to remove a block, from its events (NaN before)",
        |k| k.capacity_tokens.map_or(f64::NAN, |t| t as f64),
    ),
    counter(
        "hearth_replica_kv_event_batches",
        "KV event batches read from the replica's engine",
        |k| k.batches_total,
    ),
    counter(
        "hearth_replica_kv_events",
        "KV events read from the replica's engine",
        |k| k.events_total,
    ),
    counter(
        "hearth_replica_kv_event_gaps",
        "Gaps in the sequence of the replica's KV event batches (batches lost)",
        |k| k.gaps_total,
    ),
    counter(
        "hearth_replica_kv_event_replayed_batches",
        "Missed KV event batches the replica's engine sent again from its replay socket (kv_events_replay=), applied in order",
        |k| k.replayed_batches_total,
    ),
    counter(
        "hearth_replica_kv_event_forgotten_blocks",
        "Warmth blocks of the replica forgotten because its engine had stored a whole cache's worth (its capacity, as its events showed it) since Hearth last sent them there: evicted before the next turn asks",
        |k| k.forgotten_blocks_total,
    ),
    counter(
        "hearth_replica_kv_event_matched_prompts",
        "Answers whose prompt was matched with the chain the replica's engine stored for it (its next turn there is predicted from what the engine still holds of that chain)",
        |k| k.matched_prompts_total,
    ),
    counter(
        "hearth_replica_kv_event_matched_in_order_prompts",
        "Of the matched prompts, those matched in order among prompts of one shape decided side by side (more than one chain fitted each; the earliest decided took the earliest stored)",
        |k| k.matched_in_order_prompts_total,
    ),
    counter(
        "hearth_replica_kv_event_ambiguous_prompts",
        "Prompts given up on after waiting 30 s with more than one stored chain fitting them and no order to tell which (the prediction stays approximate)",
        |k| k.ambiguous_prompts_total,
    ),
    counter(
        "hearth_replica_kv_event_unmatched_prompts",
        "Prompts, on an engine whose KV event figures were exact, that no stored chain fitted (given up after 30 s)",
        |k| k.unmatched_prompts_total,
    ),
    counter(
        "hearth_replica_kv_event_refused",
        "KV event messages from the replica's engine that did not read (not three frames, a bad sequence or batch)",
        |k| k.refused_total,
    ),
];

impl<T> Scraped<T> {
    fn descriptor<'e>(
        &'e self,
        encoder: &'e mut DescriptorEncoder,
    ) -> Result<MetricEncoder<'e>, std::fmt::Error> {
        let kind = match self.read {
            Read::Gauge(_) => MetricType::Gauge,
            Read::Counter(_) => MetricType::Counter,
        };
        encoder.encode_descriptor(self.name, self.help, self.unit.as_ref(), kind)
    }

    fn value(&self, subject: &T, member: MetricEncoder) -> Result<(), std::fmt::Error> {
        match self.read {
            Read::Gauge(read) => ConstGauge::new(read(subject)).encode(member),
            Read::Counter(read) => ConstCounter::new(read(subject)).encode(member),
        }
    }
}

impl Collector for FleetCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let snap = self.router.0.snapshot();
        for series in REPLICA_SERIES {
            let mut family = series.descriptor(&mut encoder)?;
            for r in &snap.replicas {
                series.value(r, family.encode_family(&[("replica", r.id.as_str())])?)?;
            }
        }
        for series in KV_SERIES {
            let mut family = series.descriptor(&mut encoder)?;
            for r in &snap.replicas {
                if let Some(kv) = &r.kv_events {
                    series.value(kv, family.encode_family(&[("replica", r.id.as_str())])?)?;
                }
            }
        }
        let mut family = encoder.encode_descriptor(
            "hearth_replica_kv_event_restarts",
            "Restarts the replica's KV events showed, by reason: sequence (it went back: a new engine process), cleared (AllBlocksCleared); each dropped the replica's warmth",
            None,
            MetricType::Counter,
        )?;
        for r in &snap.replicas {
            let Some(kv) = &r.kv_events else { continue };
            for (reason, n) in [
                ("sequence", kv.restarts_sequence_total),
                ("cleared", kv.restarts_cleared_total),
            ] {
                let labels = [("replica", r.id.as_str()), ("reason", reason)];
                ConstCounter::new(n).encode(family.encode_family(&labels)?)?;
            }
        }
        let view = FleetView {
            snap,
            stay_ratio: self.series.stay_ratio(60),
            journal_dropped: self.journal_dropped.load(Ordering::Relaxed),
        };
        for series in FLEET_SERIES {
            series.value(&view, series.descriptor(&mut encoder)?)?;
        }
        let pool = [("name", self.pool.as_str())];
        for series in POOL_SERIES {
            let mut family = series.descriptor(&mut encoder)?;
            series.value(&view, family.encode_family(&pool)?)?;
        }
        // Per endpoint (an address: data-parallel ranks share one queue),
        // as the engine reported it.
        let mut family = encoder.encode_descriptor(
            "llm_d_epp_per_endpoint_queue_size",
            "Queue depth each engine reports, by endpoint address",
            None,
            MetricType::Gauge,
        )?;
        let mut seen = Vec::new();
        for r in &view.snap.replicas {
            let Some(engine) = &r.engine else { continue };
            if seen.contains(&&r.address) {
                continue;
            }
            seen.push(&r.address);
            let labels = [
                ("name", self.pool.as_str()),
                ("model_server_endpoint", r.address.as_str()),
            ];
            ConstGauge::new(engine.waiting).encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DirectionLabel {
    direction: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

/// The peer bus's metrics (`feeds/peers.rs`); all zero without peers.
#[derive(Debug, Default)]
pub struct PeerMetrics {
    messages: Family<DirectionLabel, Counter>,
    dropped: Family<ReasonLabel, Counter>,
    applied: Counter,
    resyncs: Counter,
    connected: Gauge,
    live: Gauge,
}

impl PeerMetrics {
    pub fn register(reg: &mut Registry) -> Self {
        let m = PeerMetrics::default();
        reg.register(
            "hearth_peer_messages",
            "Messages on the peer bus: sent, and received from peers of this fleet",
            m.messages.clone(),
        );
        reg.register(
            "hearth_peer_messages_dropped",
            "Peer messages not applied or not sent, by reason (bad_mac, unsigned, bad_signature, forged_sender, replay, stale, hello_limited, unasked_snapshot, warmth_limited, malformed, oversized, unknown_format, foreign_fleet, other_list, unknown_replica, send_failed)",
            m.dropped.clone(),
        );
        reg.register(
            "hearth_peer_updates_applied",
            "Peer updates and state parts applied to this sidecar's state",
            m.applied.clone(),
        );
        reg.register(
            "hearth_peer_resyncs",
            "Times the bus (re)connected and this sidecar exchanged its whole state with the peers",
            m.resyncs.clone(),
        );
        reg.register(
            "hearth_peer_bus_connected",
            "1 while the peer bus is reachable (0: routing on this sidecar's own state)",
            m.connected.clone(),
        );
        reg.register(
            "hearth_peers_live",
            "Peer sidecars heard from within the last 3 s",
            m.live.clone(),
        );
        m
    }

    pub fn sent(&self) {
        self.messages
            .get_or_create(&DirectionLabel { direction: "sent" })
            .inc();
    }

    pub fn received(&self) {
        self.messages
            .get_or_create(&DirectionLabel {
                direction: "received",
            })
            .inc();
    }

    pub fn dropped(&self, reason: &'static str) {
        self.dropped.get_or_create(&ReasonLabel { reason }).inc();
    }

    pub fn applied(&self) {
        self.applied.inc();
    }

    pub fn resync(&self) {
        self.resyncs.inc();
    }

    pub fn set_connected(&self, connected: bool) {
        self.connected.set(i64::from(connected));
    }

    pub fn set_live(&self, live: i64) {
        self.live.set(live);
    }
}

/// The endpoint-picker mode's held request bodies
/// ([`crate::envoy::picker::HeldBudget`]); all zero in the other modes.
#[derive(Clone, Debug, Default)]
pub struct PickerMetrics {
    pub held_bytes: Gauge,
    pub held_bodies: Gauge,
    pub held_bytes_peak: Gauge,
    refused: Family<ReasonLabel, Counter>,
}

impl PickerMetrics {
    pub fn register(reg: &mut Registry) -> Self {
        let m = PickerMetrics::default();
        reg.register(
            "hearth_picker_held_bytes",
            "Bytes of request-body buffers held now, before their decision (endpoint-picker mode; bounded by HEARTH_PICKER_HELD_BYTES)",
            m.held_bytes.clone(),
        );
        reg.register(
            "hearth_picker_held_bodies",
            "Request bodies held now, before their decision (endpoint-picker mode; bounded by HEARTH_PICKER_HELD_BODIES)",
            m.held_bodies.clone(),
        );
        reg.register(
            "hearth_picker_held_bytes_peak",
            "The most bytes of request-body buffers held at once since the start",
            m.held_bytes_peak.clone(),
        );
        reg.register(
            "hearth_picker_refused",
            "Requests refused with 429 because the held bodies were at their bound, by reason (bodies, bytes)",
            m.refused.clone(),
        );
        m
    }

    pub fn refused(&self, reason: &'static str) {
        self.refused.get_or_create(&ReasonLabel { reason }).inc();
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BandLabel {
    priority: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WaitLabels {
    priority: String,
    outcome: &'static str,
}

/// Flow control's queue (`crate::flow`): what waits, by band; how long
/// requests waited and how they left. The queue series and the wait
/// histogram carry the llm-d router's `llm_d_epp_flow_control_*` names,
/// with its `priority` and `outcome` labels (not `fairness_id`: a
/// client-chosen id would make the series unbounded).
#[derive(Debug)]
pub struct FlowMetrics {
    queue_size: Family<BandLabel, Gauge>,
    queue_bytes: Family<BandLabel, Gauge>,
    waits: Family<WaitLabels, Histogram, fn() -> Histogram>,
    dispatched: Family<BandLabel, Counter>,
    dropped: Family<ReasonLabel, Counter>,
}

impl FlowMetrics {
    pub fn register(reg: &mut Registry) -> Self {
        let m = FlowMetrics {
            queue_size: Family::default(),
            queue_bytes: Family::default(),
            // 1 ms .. ~524 s
            waits: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.001, 2.0, 20))
            }),
            dispatched: Family::default(),
            dropped: Family::default(),
        };
        reg.register(
            "llm_d_epp_flow_control_queue_size",
            "Requests waiting in the flow-control queue now, by priority band",
            m.queue_size.clone(),
        );
        reg.register(
            "llm_d_epp_flow_control_queue_bytes",
            "Prompt bytes of the requests waiting in the flow-control queue now, by priority band",
            m.queue_bytes.clone(),
        );
        reg.register(
            "llm_d_epp_flow_control_request_queue_duration_seconds",
            "Time requests spent in the flow-control queue, by priority band and outcome (Dispatched, RejectedCapacity, EvictedTTL, EvictedContextCancelled, EvictedOther)",
            m.waits.clone(),
        );
        reg.register(
            "hearth_flow_dispatched",
            "Requests that left the flow-control queue for a replica, by priority band",
            m.dispatched.clone(),
        );
        reg.register(
            "hearth_flow_dropped",
            "Requests refused or dropped by flow control with 429, by reason (sheddable, queue_full, queue_bytes, evicted, ttl), and queued requests whose client went away (disconnected)",
            m.dropped.clone(),
        );
        m
    }

    /// The queue's occupancy now: every band in `bands` (those that held
    /// requests are reset to zero when they empty).
    pub fn set_bands(&self, bands: &[hearth_router::BandLoad], emptied: &[i32]) {
        for b in bands {
            let label = BandLabel {
                priority: b.priority.to_string(),
            };
            self.queue_size.get_or_create(&label).set(b.requests as i64);
            self.queue_bytes
                .get_or_create(&label)
                .set(i64::try_from(b.bytes).unwrap_or(i64::MAX));
        }
        for p in emptied {
            let label = BandLabel {
                priority: p.to_string(),
            };
            self.queue_size.get_or_create(&label).set(0);
            self.queue_bytes.get_or_create(&label).set(0);
        }
    }

    /// A queued request left for a replica after `waited`.
    pub fn dispatched(&self, priority: i32, waited: Duration) {
        let priority = priority.to_string();
        self.dispatched
            .get_or_create(&BandLabel {
                priority: priority.clone(),
            })
            .inc();
        self.waits
            .get_or_create(&WaitLabels {
                priority,
                outcome: "Dispatched",
            })
            .observe(waited.as_secs_f64());
    }

    /// A request refused or dropped for `reason`, after `waited` in the
    /// queue (`None`: it never entered).
    pub fn dropped(
        &self,
        priority: i32,
        reason: hearth_router::DropReason,
        waited: Option<Duration>,
    ) {
        use hearth_router::DropReason as R;
        self.dropped
            .get_or_create(&ReasonLabel {
                reason: reason.as_str(),
            })
            .inc();
        let outcome = match reason {
            R::Sheddable | R::QueueFull | R::QueueBytes => "RejectedCapacity",
            R::Ttl => "EvictedTTL",
            R::Disconnected => "EvictedContextCancelled",
            R::Evicted => "EvictedOther",
        };
        self.waits
            .get_or_create(&WaitLabels {
                priority: priority.to_string(),
                outcome,
            })
            .observe(waited.unwrap_or_default().as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::observe::journal::Journal;
    use crate::observe::Observer;
    use hearth_router::RouterParams;

    /// Every scraped series is encoded (per replica, with its label) and
    /// documented in docs/metrics.md.
    #[test]
    fn every_series_in_the_tables_is_scraped_and_documented() {
        let docs = include_str!("../../../docs/metrics.md");
        let upstreams = [
            "127.0.0.1:1;id=a;kv_events=tcp://127.0.0.1:3",
            "127.0.0.1:2;id=b",
        ]
        .map(|u| u.parse().unwrap());
        let router = Router::new(RouterParams::default(), &upstreams);
        let observer = Observer::new(
            router,
            AffinityBasis::default(),
            Journal::open(4, None).unwrap(),
            "pool-a",
        );
        let text = observer.encode_metrics();
        for s in REPLICA_SERIES {
            let suffix = match s.read {
                Read::Counter(_) => "_total",
                Read::Gauge(_) => "",
            };
            let unit = if s.unit.is_some() { "_bytes" } else { "" };
            for id in ["a", "b"] {
                let line = format!("{}{unit}{suffix}{{replica=\"{id}\"}} ", s.name);
                assert!(text.contains(&line), "{line} missing from:\n{text}");
            }
            assert!(
                docs.contains(&format!("`{}", s.name)),
                "{} undocumented",
                s.name
            );
        }
        for s in KV_SERIES {
            let suffix = match s.read {
                Read::Counter(_) => "_total",
                Read::Gauge(_) => "",
            };
            let line = format!("{}{suffix}{{replica=\"a\"}} ", s.name);
            assert!(text.contains(&line), "{line} missing from:\n{text}");
            let other = format!("{}{suffix}{{replica=\"b\"}} ", s.name);
            assert!(!text.contains(&other), "{other}: b has no feed");
            assert!(
                docs.contains(&format!("`{}", s.name)),
                "{} undocumented",
                s.name
            );
        }
        assert!(text.contains(
            "hearth_replica_kv_event_restarts_total{replica=\"a\",reason=\"sequence\"} 0"
        ));
        assert!(docs.contains("`hearth_replica_kv_event_restarts"));
        for s in FLEET_SERIES {
            assert!(
                text.lines()
                    .any(|l| l.starts_with(s.name) && !l.contains('{')),
                "{} missing",
                s.name
            );
            assert!(
                docs.contains(&format!("`{}", s.name)),
                "{} undocumented",
                s.name
            );
        }
        for s in POOL_SERIES {
            let line = format!("{}{{name=\"pool-a\"}} ", s.name);
            assert!(text.contains(&line), "{line} missing from:\n{text}");
            assert!(
                docs.contains(&format!("`{}", s.name)),
                "{} undocumented",
                s.name
            );
        }
        assert!(
            text.contains("llm_d_epp_ready_endpoints{name=\"pool-a\"} 2"),
            "{text}"
        );
        assert!(docs.contains("`llm_d_epp_per_endpoint_queue_size"));
    }
}

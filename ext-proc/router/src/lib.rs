//! Hearth's routing decision and the fleet state it reads.
//!
//! No protocol and no runtime live here: the sidecar (`hearth-ext-proc`)
//! turns Envoy's messages into [`RequestInfo`] and a [`Decision`] back into
//! headers, and feeds the fleet state (replica list reloads, engine
//! figures, health evidence); the simulator in `bench/` drives the same
//! code directly.
//!
//! - [`params`]: [`RouterParams`], every knob as a plain number;
//! - [`replica`]: the replica list and its routing targets;
//! - [`fleet`]: the per-replica state under the router's one lock;
//! - [`router`]: [`Router`], and what flows in besides decisions;
//! - [`clock`]: the wall-clock wrappers of the entry points, which all
//!   take `now` (the simulator runs them on engine time);
//! - [`decide`]: the decision, one module per phase (candidates, overlap,
//!   policy, pick, reserve);
//! - [`flow`]: when replicas are saturated, and the queue that holds
//!   requests while they are;
//! - [`health`]: serving or fenced, from real traffic and probes;
//! - [`kv_events`]: what the engines' own KV cache events say of their
//!   caches (occupancy, capacity, restarts);
//! - [`warmth`]: the per-replica LRU of block hashes;
//! - [`usage`]: what the engines served from cache against the
//!   predictions, and the warmth corrections it makes;
//! - [`peers`], [`sharing`]: what the router keeps for its peer sidecars,
//!   and the updates it exchanges with them;
//! - [`snapshot`]: what `/state` shows.

pub mod clock;
pub mod decide;
pub mod fleet;
pub mod flow;
pub mod health;
pub mod kv_chains;
pub mod kv_events;
pub mod params;
pub mod peers;
pub mod replica;
pub mod router;
pub mod sharing;
pub mod snapshot;
pub mod tips;
pub mod usage;
pub mod warmth;

pub use decide::policy::Candidate;
pub use decide::{Decision, Prefill, RequestInfo, Reservation, RouteError, ScoredCandidate};
pub use fleet::EngineSignals;
pub use flow::{
    BandLoad, DropReason, Dropped, Entry, FlowLoad, FlowParams, FlowQueue, Kept, Look, QueueParams,
    QueueView, Room, Saturated, AFFINITY_UNITS_MAX, LOOK_DEPTH,
};
pub use health::{
    Failure, FleetHealth, HealthParams, HealthSnapshot, HealthState, Outcome, ProbeReason,
    ReplicaHealth,
};
pub use kv_events::{KvEventsSnapshot, RestartReason};
pub use params::{AffinityBasis, LongLane, RouterParams, ScoreParams};
pub use peers::{Applied, PeerRefusal, PeersSnapshot, PEER_SILENCE};
pub use replica::{
    check_upstreams, default_replica_id, engine_url, targets, EventEndpoint, EventSource,
    ProbeTarget, ReloadSummary, Replica, ReplicaKey, UpstreamSpec,
};
pub use router::{Router, SourceStatus};
pub use snapshot::{BandSnapshot, EngineSnapshot, ReplicaSnapshot, Snapshot, UpstreamsSnapshot};
pub use tips::Continuation;
pub use usage::{Correction, Prediction, Served, Usage, UsageSnapshot};

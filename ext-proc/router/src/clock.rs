//! The wall clock's only door into the router. Every public entry point
//! that counts time takes `now` (`decide_at`, `record_request_at`, ...):
//! the simulator passes engine time, the tests pass whatever instant they
//! need. The sidecar runs on the wall clock, so each of those entry points
//! has a wrapper here, named without `_at`, that reads
//! [`Instant::now`] and does nothing else. No other module of this crate
//! reads the clock (`ext-proc/tests/rooms.rs` checks it).

use std::sync::Arc;
use std::time::Instant;

use hearth_wire::peer::Update;

use crate::decide::{Decision, RequestInfo, RouteError};
use crate::health::Outcome;
use crate::peers::{Applied, PeerRefusal, PeersSnapshot};
use crate::replica::{ProbeTarget, ReplicaKey};
use crate::router::Router;
use crate::snapshot::Snapshot;
use crate::usage::{Prediction, Served, Usage};

impl Router {
    /// [`Router::decide_at`] now.
    pub fn decide(self: &Arc<Self>, req: &RequestInfo) -> Result<Decision, RouteError> {
        self.decide_at(req, Instant::now())
    }

    /// [`Router::decide_within_at`] now.
    pub fn decide_within(
        self: &Arc<Self>,
        req: &RequestInfo,
        allowed: Option<&[usize]>,
    ) -> Result<Decision, RouteError> {
        self.decide_within_at(req, allowed, Instant::now())
    }

    /// [`Router::apply_kv_batch_at`] now.
    pub fn apply_kv_batch(
        &self,
        key: crate::ReplicaKey,
        seq: u64,
        batch: &hearth_wire::kv_events::Batch,
    ) -> Vec<crate::kv_events::RestartReason> {
        self.apply_kv_batch_at(key, seq, batch, Instant::now())
    }

    /// [`Router::record_request_at`] now.
    pub fn record_request(&self, i: usize, outcome: Outcome) {
        self.record_request_at(i, outcome, Instant::now());
    }

    /// [`Router::record_usage_at`] now.
    pub fn record_usage(
        &self,
        answered: usize,
        prediction: Option<&Prediction>,
        usage: Usage,
    ) -> Option<Served> {
        self.record_usage_at(answered, prediction, usage, Instant::now())
    }

    /// [`Router::record_probe_at`] now.
    pub fn record_probe(&self, key: ReplicaKey, outcome: Outcome) {
        self.record_probe_at(key, outcome, Instant::now());
    }

    /// [`Router::probe_may_proceed_at`] now.
    pub fn probe_may_proceed(&self, key: ReplicaKey, reason: crate::health::ProbeReason) -> bool {
        self.probe_may_proceed_at(key, reason, Instant::now())
    }

    /// [`Router::probe_targets_at`] now.
    pub fn probe_targets(&self) -> Vec<ProbeTarget> {
        self.probe_targets_at(Instant::now())
    }

    /// [`Router::snapshot_at`] now.
    pub fn snapshot(&self) -> Snapshot {
        self.snapshot_at(Instant::now())
    }

    /// [`Router::apply_update_at`] now.
    pub fn apply_update(
        &self,
        sender: u64,
        list: u64,
        update: &Update,
        snapshot: bool,
    ) -> Result<Applied, PeerRefusal> {
        self.apply_update_at(sender, list, update, snapshot, Instant::now())
    }

    /// [`Router::expire_peers_at`] now.
    pub fn expire_peers(&self) {
        self.expire_peers_at(Instant::now());
    }

    /// [`Router::peers_snapshot_at`] now.
    pub fn peers_snapshot(&self) -> Option<PeersSnapshot> {
        self.peers_snapshot_at(Instant::now())
    }
}

impl Decision {
    /// [`Decision::record_usage_at`] now.
    pub fn record_usage(&self, usage: Usage) -> Option<Served> {
        self.record_usage_at(usage, Instant::now())
    }
}

impl crate::decide::Prefill {
    /// [`crate::decide::Prefill::done_at`] now.
    pub fn done(&self) {
        self.done_at(Instant::now());
    }
}

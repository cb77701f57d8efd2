//! The fleet state: the replica table and, per slot, what the router
//! knows of it (warmth, load, health, engine figures, resident
//! conversations), all under the router's one lock.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use crate::health::ReplicaHealth;
use crate::replica::{ReloadSummary, Replica};
use crate::warmth::LruBlocks;

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

/// What the router knows of one replica slot.
pub(crate) struct ReplicaState {
    pub(crate) warmth: LruBlocks,
    pub(crate) in_flight: u32,
    pub(crate) load: f64,
    pub(crate) routed: u64,
    pub(crate) health: ReplicaHealth,
    /// The engine's own figures (for this target's share of its address).
    pub(crate) engine: Option<EngineSignals>,
    /// Conversations whose latest turn went here: their tip (last full
    /// block) and when that turn was routed.
    pub(crate) resident: HashMap<u64, Instant>,
}

impl ReplicaState {
    pub(crate) fn new(warmth_blocks: usize) -> ReplicaState {
        ReplicaState {
            warmth: LruBlocks::new(warmth_blocks),
            in_flight: 0,
            load: 0.0,
            routed: 0,
            health: ReplicaHealth::default(),
            engine: None,
            resident: HashMap::new(),
        }
    }
}

/// The replica table and each slot's state, under one lock. Slot indices
/// are stable: a removed replica's slot is retired (kept while requests it
/// runs hold reservations on it) and reused for a later new replica.
pub(crate) struct Fleet {
    pub(crate) replicas: Arc<[Replica]>,
    pub(crate) state: Vec<ReplicaState>,
    /// The serving slots, in the order the replica list names them.
    pub(crate) listed: Vec<usize>,
    /// Some serving replica is tagged `long` (else the lane is off).
    pub(crate) any_long: bool,
    /// Some serving replica has `profile=short-output`.
    pub(crate) any_short_output: bool,
}

impl Fleet {
    /// The serving replicas, in list order.
    pub(crate) fn serving(&self) -> impl Iterator<Item = (usize, &Replica)> {
        self.listed.iter().map(|&i| (i, &self.replicas[i]))
    }

    /// Replaces the replica list with `targets`. A target at the address
    /// and rank of a serving replica keeps that slot and its state; one
    /// no longer listed is retired; a new one takes a drained retired slot,
    /// or a new one.
    pub(crate) fn apply(&mut self, targets: Vec<Replica>, warmth_blocks: usize) -> ReloadSummary {
        let mut table: Vec<Replica> = self.replicas.to_vec();
        let mut listed = vec![false; table.len()];
        let mut summary = ReloadSummary::default();
        // New targets, with their place in the list.
        let mut fresh = Vec::new();
        let mut order: Vec<Option<usize>> = Vec::with_capacity(targets.len());
        for t in targets {
            let same = (0..table.len())
                .find(|&i| !table[i].retired && !listed[i] && table[i].key() == t.key());
            match same {
                Some(i) => {
                    listed[i] = true;
                    order.push(Some(i));
                    if table[i] == t {
                        summary.unchanged += 1;
                    } else {
                        summary.updated += 1;
                        table[i] = t;
                    }
                }
                None => {
                    fresh.push((order.len(), t));
                    order.push(None);
                }
            }
        }
        for (i, r) in table.iter_mut().enumerate() {
            if !r.retired && !listed[i] {
                r.retired = true;
                summary.removed += 1;
                // Its warmth and engine figures mean nothing any more; its
                // in-flight count drains as its requests end.
                let s = &mut self.state[i];
                s.warmth = LruBlocks::new(1);
                s.engine = None;
            }
        }
        for (place, t) in fresh {
            summary.added += 1;
            let reusable = (0..table.len())
                .find(|&i| table[i].retired && !listed[i] && self.state[i].in_flight == 0);
            let i = match reusable {
                Some(i) => {
                    table[i] = t;
                    self.state[i] = ReplicaState::new(warmth_blocks);
                    i
                }
                None => {
                    table.push(t);
                    listed.push(false);
                    self.state.push(ReplicaState::new(warmth_blocks));
                    table.len() - 1
                }
            };
            listed[i] = true;
            order[place] = Some(i);
        }
        self.listed = order.into_iter().flatten().collect();
        self.any_long = table.iter().any(|r| !r.retired && r.long);
        self.any_short_output = table.iter().any(|r| !r.retired && r.short_output);
        self.replicas = table.into();
        summary
    }
}

impl Fleet {
    /// A fleet of `targets`.
    pub(crate) fn new(targets: Vec<Replica>, warmth_blocks: usize) -> Fleet {
        let mut fleet = Fleet {
            replicas: Arc::new([]),
            state: Vec::new(),
            listed: Vec::new(),
            any_long: false,
            any_short_output: false,
        };
        fleet.apply(targets, warmth_blocks);
        fleet
    }
}

//! Active-active sidecars: what one router learns, shared with its peers.
//!
//! Each sidecar decides alone, from its own memory; what its decisions
//! and its health evidence teach it goes to the other sidecars of the
//! fleet in batches ([`hearth_wire::peer::Update`]), and what they learn
//! comes back the same way. Nothing here waits for a peer: the bus (the
//! sidecar's `feeds/peers.rs`, or the simulator) takes this router's
//! update every few milliseconds and hands it the peers' ones.
//!
//! - **Warmth**: every prompt a decision records on a replica is recorded
//!   there by the peers too, with the conversation's tip (so a turn that
//!   reaches another sidecar is known as a continuing one, and the
//!   conversation counts as resident where it went).
//! - **Load**: each update carries the sender's own in-flight requests and
//!   load per replica, as they are now; a replica's load for a decision is
//!   its own plus the latest figure of every peer heard from within
//!   [`PEER_SILENCE`] (a peer gone quiet stops counting). A peer's figures
//!   are bounded before they count: a negative or non-finite load is 0,
//!   one replica's figures are capped at [`PEER_MAX_IN_FLIGHT`] and
//!   [`PEER_MAX_LOAD`], at most [`MAX_PEERS`] peers are kept, and the sums
//!   saturate, so no figure a peer sends overflows a sum or turns a score
//!   into NaN.
//! - **Health**: a replica this sidecar fences, or re-admits, on its own
//!   evidence is fenced, or re-admitted, by the peers (what a peer told is
//!   never passed on again, so nothing echoes).
//!
//! Replicas are named by their place in the replica list's canonical
//! order (sorted by address and rank), and every message carries the
//! list's digest: sidecars whose lists differ (one reloaded before the
//! other) ignore each other's figures until the lists agree again.
//!
//! This module holds the state kept for the peers (under the fleet lock);
//! the router's side of the exchange (taking an update, applying a
//! peer's) is in [`crate::sharing`].

use std::collections::HashMap;
use std::time::{Duration, Instant};

use hearth_wire::peer::list_digest;
use serde::{Deserialize, Serialize};

use crate::replica::Replica;

/// A peer's load figures stop counting this long after its latest update
/// (peers send one at least every second while they run).
pub const PEER_SILENCE: Duration = Duration::from_secs(3);

/// The most requests one peer may claim in flight on one replica: more
/// than one sidecar could plausibly hold (a larger figure counts as this).
pub const PEER_MAX_IN_FLIGHT: u32 = 4_096;

/// The most load units one peer may claim on one replica:
/// [`PEER_MAX_IN_FLIGHT`] requests of 16 units each (a 1 MiB uncached
/// prompt apiece at the default `HEARTH_LOAD_UNIT_BYTES`); a larger figure
/// counts as this.
pub const PEER_MAX_LOAD: f64 = 65_536.0;

/// Peers whose load figures are kept at most; a new one past it replaces
/// the one heard from longest ago.
pub const MAX_PEERS: usize = 256;

/// Decision records held for the next update at most: beyond it (a bus
/// that stopped taking updates), the oldest are dropped and counted.
pub const OUTBOX_LIMIT: usize = 65_536;

/// What the router keeps for its peers, under the fleet lock.
#[derive(Debug, Default)]
pub(crate) struct Peers {
    /// Peers are configured: decisions and fencings are kept for them.
    pub(crate) enabled: bool,
    /// Slots in the list's canonical order, and the list's digest.
    pub(crate) canonical: Vec<usize>,
    pub(crate) digest: u64,
    /// Decisions since the last update: slot, prompt hashes, tip.
    pub(crate) warmth: Vec<(usize, Vec<u64>, Option<u64>)>,
    /// Fencings and re-admissions on this sidecar's own evidence.
    pub(crate) health: Vec<(usize, bool)>,
    pub(crate) dropped: u64,
    /// Each peer's latest load figures, by sender id.
    pub(crate) loads: HashMap<u64, PeerLoad>,
    /// The fleet's name on the bus, and whether the bus is reachable now
    /// (set by the bus).
    pub(crate) fleet: String,
    pub(crate) connected: bool,
}

#[derive(Debug)]
pub(crate) struct PeerLoad {
    pub(crate) at: Instant,
    /// (slot, in flight, load).
    pub(crate) per_slot: Vec<(usize, u32, f64)>,
}

impl PeerLoad {
    /// A peer's figures as they count: per slot, its last figure for that
    /// slot, in flight capped at [`PEER_MAX_IN_FLIGHT`], load at
    /// [`PEER_MAX_LOAD`] (a load that is NaN, infinite or negative is 0).
    pub(crate) fn bounded(
        at: Instant,
        figures: impl IntoIterator<Item = (usize, u32, f32)>,
    ) -> PeerLoad {
        let mut per_slot: Vec<(usize, u32, f64)> = Vec::new();
        for (slot, in_flight, load) in figures {
            let load = f64::from(load);
            let load = if load.is_finite() && load > 0.0 {
                load.min(PEER_MAX_LOAD)
            } else {
                0.0
            };
            let figure = (slot, in_flight.min(PEER_MAX_IN_FLIGHT), load);
            match per_slot.iter_mut().find(|f| f.0 == slot) {
                Some(f) => *f = figure,
                None => per_slot.push(figure),
            }
        }
        PeerLoad { at, per_slot }
    }

    /// Heard from within [`PEER_SILENCE`] of `now`: its figures count.
    pub(crate) fn is_live(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.at) < PEER_SILENCE
    }
}

/// Why a peer's update was not applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerRefusal {
    /// It routes over another replica list (or another version of it).
    OtherList,
    /// It names a replica the list does not have.
    UnknownReplica,
}

/// What applying an update did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Applied {
    pub warmth_records: usize,
    pub blocks: usize,
    pub fenced: usize,
    pub readmitted: usize,
}

/// The peers as the state endpoint shows them.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PeersSnapshot {
    /// `HEARTH_FLEET`.
    pub fleet: String,
    /// The bus is reachable: false, the sidecar routes on its own state
    /// (and `/health` says `degraded`).
    pub connected: bool,
    /// Peers whose load counts now (heard from within the silence limit).
    pub live: usize,
    /// The replica list's digest peers must share (hex).
    pub list_digest: String,
    /// Decision records dropped because no update took them in time.
    pub outbox_dropped_total: u64,
}

/// The digest and canonical order of the serving replicas.
pub(crate) fn canonical(replicas: &[Replica], listed: &[usize]) -> (Vec<usize>, u64) {
    let name = |r: &Replica| match r.dp_rank {
        Some(rank) => format!("{}#{rank}", r.addr),
        None => r.addr.to_string(),
    };
    let mut order: Vec<(String, usize)> = listed.iter().map(|&i| (name(&replicas[i]), i)).collect();
    order.sort();
    order.dedup_by(|a, b| a.0 == b.0);
    let digest = list_digest(&order.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>());
    (order.into_iter().map(|(_, i)| i).collect(), digest)
}

impl Peers {
    /// A decision recorded `hashes` on `slot` (a no-op without peers).
    pub(crate) fn note_decision(&mut self, slot: usize, hashes: &[u64], tip: Option<u64>) {
        if !self.enabled {
            return;
        }
        if self.warmth.len() >= OUTBOX_LIMIT {
            self.warmth.remove(0);
            self.dropped += 1;
        }
        self.warmth.push((slot, hashes.to_vec(), tip));
    }

    /// This sidecar's own evidence fenced (`false`) or re-admitted `slot`.
    pub(crate) fn note_health(&mut self, slot: usize, serving: bool) {
        if self.enabled {
            self.health.push((slot, serving));
        }
    }

    /// Keeps `load` as `sender`'s latest figures; a new sender past
    /// [`MAX_PEERS`] replaces the one heard from longest ago.
    pub(crate) fn keep_load(&mut self, sender: u64, load: PeerLoad) {
        if self.loads.len() >= MAX_PEERS && !self.loads.contains_key(&sender) {
            let oldest = self.loads.iter().min_by_key(|(_, l)| l.at).map(|(&k, _)| k);
            if let Some(oldest) = oldest {
                self.loads.remove(&oldest);
            }
        }
        self.loads.insert(sender, load);
    }

    pub(crate) fn place(&self, slot: usize) -> Option<u16> {
        self.canonical
            .iter()
            .position(|&s| s == slot)
            .and_then(|p| u16::try_from(p).ok())
    }
}

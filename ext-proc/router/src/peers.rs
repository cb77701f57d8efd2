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
//!   [`PEER_SILENCE`] (a peer gone quiet stops counting).
//! - **Health**: a replica this sidecar fences, or re-admits, on its own
//!   evidence is fenced, or re-admitted, by the peers (what a peer told is
//!   never passed on again, so nothing echoes).
//!
//! Replicas are named by their place in the replica list's canonical
//! order (sorted by address and rank), and every message carries the
//! list's digest: sidecars whose lists differ (one reloaded before the
//! other) ignore each other's figures until the lists agree again.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use hearth_wire::peer::{list_digest, Health, Load, Update, Warmth};
use serde::{Deserialize, Serialize};

use crate::fleet::Fleet;
use crate::replica::Replica;
use crate::router::{lock, Router};

/// A peer's load figures stop counting this long after its latest update
/// (peers send one at least every second while they run).
pub const PEER_SILENCE: Duration = Duration::from_secs(3);

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
    at: Instant,
    /// (slot, in flight, load).
    per_slot: Vec<(usize, u32, f64)>,
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

    fn place(&self, slot: usize) -> Option<u16> {
        self.canonical
            .iter()
            .position(|&s| s == slot)
            .and_then(|p| u16::try_from(p).ok())
    }
}

impl Fleet {
    /// Sum of the live peers' figures into each replica's peer load.
    pub(crate) fn sum_peer_loads(&mut self, now: Instant) {
        self.peers
            .loads
            .retain(|_, l| now.saturating_duration_since(l.at) < PEER_SILENCE);
        for s in &mut self.state {
            s.peer_in_flight = 0;
            s.peer_load = 0.0;
        }
        for l in self.peers.loads.values() {
            for &(slot, in_flight, load) in &l.per_slot {
                if let Some(s) = self.state.get_mut(slot) {
                    s.peer_in_flight += in_flight;
                    s.peer_load += load;
                }
            }
        }
    }

    /// The list changed: peers' figures name places in the old one.
    pub(crate) fn reset_peers(&mut self) {
        let (canonical, digest) = canonical(&self.replicas, &self.listed);
        self.peers.canonical = canonical;
        self.peers.digest = digest;
        self.peers.loads.clear();
        self.peers.warmth.clear();
        self.peers.health.clear();
        for s in &mut self.state {
            s.peer_in_flight = 0;
            s.peer_load = 0.0;
        }
    }
}

impl Router {
    /// Keeps what this sidecar learns for its peers from now on.
    pub fn enable_peers(&self) {
        self.lock().peers.enabled = true;
    }

    /// The digest of the replica list, which every message carries.
    pub fn list_digest(&self) -> u64 {
        self.lock().peers.digest
    }

    /// What this sidecar learned since the previous call, and its own
    /// load on every replica now.
    pub fn take_update(&self) -> Update {
        let mut fleet = self.lock();
        let records = std::mem::take(&mut fleet.peers.warmth);
        let health = std::mem::take(&mut fleet.peers.health);
        let peers = &fleet.peers;
        let warmth = records
            .into_iter()
            .filter_map(|(slot, hashes, tip)| {
                Some(Warmth {
                    replica: peers.place(slot)?,
                    hashes,
                    tip,
                })
            })
            .collect();
        let health = health
            .into_iter()
            .filter_map(|(slot, serving)| {
                Some(Health {
                    replica: peers.place(slot)?,
                    rank: None,
                    serving,
                })
            })
            .collect();
        let load = own_load(&fleet);
        Update {
            warmth,
            load,
            health,
        }
    }

    /// Everything a starting peer needs: each replica's warmth (least
    /// recent block first), its resident conversations' tips, the fenced
    /// replicas, and this sidecar's load.
    pub fn state_update(&self) -> Update {
        let fleet = self.lock();
        let mut warmth = Vec::new();
        let mut health = Vec::new();
        for (place, &slot) in fleet.peers.canonical.iter().enumerate() {
            let Ok(replica) = u16::try_from(place) else {
                break;
            };
            let s = &fleet.state[slot];
            if !s.warmth.is_empty() {
                warmth.push(Warmth {
                    replica,
                    hashes: s.warmth.oldest_first().collect(),
                    tip: None,
                });
            }
            warmth.extend(s.resident.tips().map(|tip| Warmth {
                replica,
                hashes: Vec::new(),
                tip: Some(tip),
            }));
            if !s.health.is_serving() {
                health.push(Health {
                    replica,
                    rank: None,
                    serving: false,
                });
            }
        }
        Update {
            warmth,
            load: own_load(&fleet),
            health,
        }
    }

    /// Applies a peer's update: `sender` is its id, `list` the digest of
    /// its replica list; `snapshot`: its warmth records are whole indexes,
    /// least recent first (from [`Router::state_update`]), not prompts.
    /// Refused whole when the lists differ or a replica is unknown.
    pub fn apply_update(
        &self,
        sender: u64,
        list: u64,
        update: &Update,
        snapshot: bool,
    ) -> Result<Applied, PeerRefusal> {
        let now = Instant::now();
        let mut guard = self.lock();
        let fleet = &mut *guard;
        if list != fleet.peers.digest {
            return Err(PeerRefusal::OtherList);
        }
        let places = fleet.peers.canonical.len();
        let known = |r: u16| usize::from(r) < places;
        if !(update.warmth.iter().all(|w| known(w.replica))
            && update.load.iter().all(|l| known(l.replica))
            && update.health.iter().all(|h| known(h.replica)))
        {
            return Err(PeerRefusal::UnknownReplica);
        }
        let slot = |r: u16| fleet.peers.canonical[usize::from(r)];
        let mut applied = Applied::default();
        let mut tips = lock(&self.tips);
        for w in &update.warmth {
            let s = slot(w.replica);
            let state = &mut fleet.state;
            if snapshot {
                for &h in &w.hashes {
                    state[s].warmth.touch(h);
                }
            } else {
                state[s].warmth.record_prompt(&w.hashes);
            }
            applied.warmth_records += 1;
            applied.blocks += w.hashes.len();
            if let Some(tip) = w.tip {
                // The conversation's previous turn (the latest tip its
                // prompt passes) is resident where it went no more.
                if let Some(&previous) = w
                    .hashes
                    .iter()
                    .rev()
                    .find(|&&h| h != tip && tips.contains(h))
                {
                    for r in state.iter_mut() {
                        r.resident.remove(previous);
                    }
                }
                tips.touch(tip);
                state[s].resident.insert(tip, now);
            }
        }
        drop(tips);
        for h in &update.health {
            let s = slot(h.replica);
            let health = &mut fleet.state[s].health;
            if h.serving && !health.is_serving() {
                health.readmit_by_peer();
                applied.readmitted += 1;
            } else if !h.serving && health.is_serving() {
                health.fence_by_peer(&self.params.health, now);
                applied.fenced += 1;
            }
        }
        // A part of a split update may carry no load figures: the last
        // ones stand.
        if !update.load.is_empty() {
            let per_slot = update
                .load
                .iter()
                .map(|l| (slot(l.replica), l.in_flight, f64::from(l.load.max(0.0))))
                .collect();
            fleet
                .peers
                .loads
                .insert(sender, PeerLoad { at: now, per_slot });
        }
        fleet.sum_peer_loads(now);
        Ok(applied)
    }

    /// Drops the load of peers silent for [`PEER_SILENCE`] (the bus calls
    /// it as it flushes; applying an update does it too).
    pub fn expire_peers(&self) {
        self.lock().sum_peer_loads(Instant::now());
    }

    /// What the bus says of itself: the fleet's name, and whether it can
    /// reach its peers now.
    pub fn set_peer_bus(&self, fleet: &str, connected: bool) {
        let mut f = self.lock();
        f.peers.fleet = fleet.to_string();
        f.peers.connected = connected;
    }

    /// The peers' figures (None without peers).
    pub fn peers_snapshot(&self) -> Option<PeersSnapshot> {
        let now = Instant::now();
        let fleet = self.lock();
        fleet.peers.enabled.then(|| PeersSnapshot {
            fleet: fleet.peers.fleet.clone(),
            connected: fleet.peers.connected,
            live: fleet
                .peers
                .loads
                .values()
                .filter(|l| now.saturating_duration_since(l.at) < PEER_SILENCE)
                .count(),
            list_digest: format!("{:016x}", fleet.peers.digest),
            outbox_dropped_total: fleet.peers.dropped,
        })
    }
}

fn own_load(fleet: &Fleet) -> Vec<Load> {
    fleet
        .peers
        .canonical
        .iter()
        .enumerate()
        .filter_map(|(place, &slot)| {
            let s = &fleet.state[slot];
            Some(Load {
                replica: u16::try_from(place).ok()?,
                in_flight: s.in_flight,
                load: s.load as f32,
            })
        })
        .collect()
}

//! The router's side of the peer exchange (see [`crate::peers`]): the
//! update this sidecar sends, the whole state a starting peer takes, and
//! applying what a peer sends.

use std::time::Instant;

use hearth_wire::peer::{Health, Update, Warmth};

use crate::peers::{Applied, PeerLoad, PeerRefusal, PeersSnapshot};
use crate::router::{lock, Router};

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
        let load = fleet.own_load();
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
            load: fleet.own_load(),
            health,
        }
    }

    /// Applies a peer's update, received at `now`: `sender` is its id, `list` the digest of
    /// its replica list; `snapshot`: its warmth records are whole indexes,
    /// least recent first (from [`Router::state_update`]), not prompts.
    /// Refused whole when the lists differ or a replica is unknown.
    pub fn apply_update_at(
        &self,
        sender: u64,
        list: u64,
        update: &Update,
        snapshot: bool,
        now: Instant,
    ) -> Result<Applied, PeerRefusal> {
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
                // prompt passes before its own) is resident where it went
                // no more.
                let own = w.hashes.iter().position(|&h| h == tip);
                let previous = tips.continued(&w.hashes[..own.unwrap_or(w.hashes.len())]);
                if let Some(p) = &previous {
                    for r in state.iter_mut() {
                        r.resident.remove(p.tip);
                    }
                }
                // (A peer's record does not say the prompt's size.)
                tips.record(tip, fleet.replicas[s].key(), 0, previous.as_ref(), false);
                state[s].resident.insert(tip, now);
            }
        }
        drop(tips);
        for h in &update.health {
            let s = slot(h.replica);
            let health = &mut fleet.state[s].health;
            // A peer's word is a hint: a fencing makes the replica suspect
            // here (probed at once), a re-admission lets the next probe
            // re-admit it; only this sidecar's own probe changes health.
            if h.serving && !health.is_serving() {
                health.readmit_by_peer(now);
                applied.readmitted += 1;
            } else if !h.serving && health.is_serving() {
                health.fence_by_peer();
                applied.fenced += 1;
            }
        }
        // A part of a split update may carry no load figures: the last
        // ones stand.
        if !update.load.is_empty() {
            let figures = update
                .load
                .iter()
                .map(|l| (slot(l.replica), l.in_flight, l.load));
            fleet
                .peers
                .keep_load(sender, PeerLoad::bounded(now, figures));
        }
        fleet.sum_peer_loads(now);
        Ok(applied)
    }

    /// Drops the load of peers silent for [`crate::peers::PEER_SILENCE`]
    /// at `now` (the bus calls it as it flushes; applying an update does it
    /// too).
    pub fn expire_peers_at(&self, now: Instant) {
        self.lock().sum_peer_loads(now);
    }

    /// What the bus says of itself: the fleet's name, and whether it can
    /// reach its peers now.
    pub fn set_peer_bus(&self, fleet: &str, connected: bool) {
        let mut f = self.lock();
        f.peers.fleet = fleet.to_string();
        f.peers.connected = connected;
    }

    /// The peers' figures at `now` (None without peers).
    pub fn peers_snapshot_at(&self, now: Instant) -> Option<PeersSnapshot> {
        let fleet = self.lock();
        fleet.peers.enabled.then(|| PeersSnapshot {
            fleet: fleet.peers.fleet.clone(),
            connected: fleet.peers.connected,
            live: fleet
                .peers
                .loads
                .values()
                .filter(|l| l.is_live(now))
                .count(),
            list_digest: format!("{:016x}", fleet.peers.digest),
            outbox_dropped_total: fleet.peers.dropped,
        })
    }
}

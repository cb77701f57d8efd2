//! The requests waiting for room, in the order they leave: strict
//! priority between bands (a higher band always first); inside a band,
//! deficit round robin between flows (one flow per fairness id), each
//! request costing its prompt bytes, so a tenant of a few huge prompts and
//! a tenant of many small ones get the same bytes through; inside a flow,
//! first come first served.
//!
//! Bounded in requests and in prompt bytes: a newcomer that does not fit
//! evicts the newest requests of lower bands when that makes room, and is
//! refused otherwise. A request leaves after `ttl` at the latest. The
//! queue holds any item (the sidecar's is the waiting stream's channel);
//! it never reads a clock.

use std::cmp::Reverse;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// The least a request costs in the round robin, in bytes: a request of
/// unknown size (unhashed) is not free.
pub const MIN_COST: u64 = 1024;

/// A flow's requests a look asks about, oldest first, when its oldest
/// cannot go: they may want other replicas (their warm ones).
pub const LOOK_DEPTH: usize = 8;

/// The queue's bounds and round-robin quantum (`HEARTH_FLOW_*`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct QueueParams {
    /// The longest a request waits.
    pub ttl: Duration,
    /// Requests queued at most.
    pub max_requests: usize,
    /// Prompt bytes queued at most.
    pub max_bytes: u64,
    /// Bytes a flow earns per round.
    pub quantum: u64,
}

impl Default for QueueParams {
    fn default() -> Self {
        QueueParams {
            ttl: Duration::from_secs(60),
            max_requests: 10_000,
            max_bytes: 256 << 20,
            quantum: 65_536,
        }
    }
}

/// Why a request left the queue without being dispatched, or never
/// entered it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DropReason {
    /// A sheddable request (negative priority) while the fleet is
    /// saturated: refused at once.
    Sheddable,
    /// The queue holds its most requests.
    QueueFull,
    /// The queue holds its most prompt bytes.
    QueueBytes,
    /// Pushed out by a request of a higher band.
    Evicted,
    /// Waited its time to live.
    Ttl,
    /// The client went away.
    Disconnected,
}

impl DropReason {
    pub const ALL: [DropReason; 6] = [
        DropReason::Sheddable,
        DropReason::QueueFull,
        DropReason::QueueBytes,
        DropReason::Evicted,
        DropReason::Ttl,
        DropReason::Disconnected,
    ];

    /// The reason as the drop-reason header and the metrics spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            DropReason::Sheddable => "sheddable",
            DropReason::QueueFull => "queue_full",
            DropReason::QueueBytes => "queue_bytes",
            DropReason::Evicted => "evicted",
            DropReason::Ttl => "ttl",
            DropReason::Disconnected => "disconnected",
        }
    }
}

impl fmt::Display for DropReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One waiting request.
#[derive(Debug)]
pub struct Entry<T> {
    pub item: T,
    /// Its id in this queue (for [`FlowQueue::remove`]).
    pub id: u64,
    pub priority: i32,
    /// Its fairness id.
    pub flow: String,
    /// Its prompt bytes (0 when unknown).
    pub bytes: u64,
    /// When it was queued.
    pub since: Instant,
}

impl<T> Entry<T> {
    /// What it costs its flow in the round robin.
    pub fn cost(&self) -> u64 {
        self.bytes.max(MIN_COST)
    }

    pub fn waited(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.since)
    }
}

/// A request pushed out of the queue, and why.
#[derive(Debug)]
pub struct Dropped<T> {
    pub entry: Entry<T>,
    pub reason: DropReason,
}

/// One band's occupancy, for metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BandLoad {
    pub priority: i32,
    pub requests: usize,
    pub bytes: u64,
}

/// One flow's waiting requests, for the dashboard.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FlowLoad {
    pub priority: i32,
    /// Its fairness id (left out for a caller who may not see them).
    pub fairness_id: Option<String>,
    pub requests: usize,
    pub bytes: u64,
    /// How long its oldest request has waited.
    pub oldest_wait_s: f64,
}

/// What waits now: each band, and the flows with the most requests.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct QueueView {
    pub requests: usize,
    pub bytes: u64,
    /// Highest band first.
    pub bands: Vec<BandLoad>,
    /// The [`QueueView::MAX_FLOWS`] flows with the most requests, most
    /// first.
    pub flows: Vec<FlowLoad>,
    /// Flows with requests, shown or not.
    pub flows_total: usize,
}

impl QueueView {
    /// Flows a view lists at most.
    pub const MAX_FLOWS: usize = 50;
}

struct Flow<T> {
    entries: VecDeque<Entry<T>>,
    deficit: u64,
}

struct Band<T> {
    flows: HashMap<String, Flow<T>>,
    /// The round-robin order of the flows with requests.
    order: VecDeque<String>,
    len: usize,
    bytes: u64,
}

impl<T> Default for Band<T> {
    fn default() -> Self {
        Band {
            flows: HashMap::new(),
            order: VecDeque::new(),
            len: 0,
            bytes: 0,
        }
    }
}

impl<T> Band<T> {
    /// Takes the entry at the front of flow `key`, removing the flow when
    /// it empties (its deficit with it: an idle flow banks nothing).
    fn take_front(&mut self, key: &str) -> Option<Entry<T>> {
        self.take_where(key, |_| Some(0))
    }

    /// Takes entry `id` of flow `key`.
    fn take(&mut self, key: &str, id: u64) -> Option<Entry<T>> {
        self.take_where(key, |entries| entries.iter().position(|e| e.id == id))
    }

    /// Takes the entry of flow `key` at the place `at` finds, removing the
    /// flow when it empties.
    fn take_where(
        &mut self,
        key: &str,
        at: impl FnOnce(&VecDeque<Entry<T>>) -> Option<usize>,
    ) -> Option<Entry<T>> {
        let flow = self.flows.get_mut(key)?;
        let entry = flow.entries.remove(at(&flow.entries)?)?;
        if flow.entries.is_empty() {
            self.flows.remove(key);
            self.order.retain(|k| k != key);
        }
        self.len -= 1;
        self.bytes -= entry.bytes;
        Some(entry)
    }
}

/// The waiting requests (see the module documentation).
pub struct FlowQueue<T> {
    params: QueueParams,
    /// Highest priority first.
    bands: BTreeMap<Reverse<i32>, Band<T>>,
    /// Each entry's band and flow, by id.
    index: HashMap<u64, (i32, String)>,
    bytes: u64,
    next_id: u64,
}

impl<T> FlowQueue<T> {
    pub fn new(params: QueueParams) -> Self {
        FlowQueue {
            params,
            bands: BTreeMap::new(),
            index: HashMap::new(),
            bytes: 0,
            next_id: 0,
        }
    }

    pub fn params(&self) -> &QueueParams {
        &self.params
    }

    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Prompt bytes queued.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Whether a request of band `priority` or a higher one waits.
    pub fn holds_at_or_above(&self, priority: i32) -> bool {
        self.bands
            .range(..=Reverse(priority))
            .any(|(_, band)| band.len > 0)
    }

    /// Each band with requests, highest first.
    pub fn bands(&self) -> Vec<BandLoad> {
        self.bands
            .iter()
            .map(|(Reverse(p), b)| BandLoad {
                priority: *p,
                requests: b.len,
                bytes: b.bytes,
            })
            .collect()
    }

    /// What waits at `now` ([`QueueView`]).
    pub fn view(&self, now: Instant) -> QueueView {
        let mut flows: Vec<FlowLoad> = self
            .bands
            .iter()
            .flat_map(|(Reverse(priority), band)| {
                band.flows.iter().map(move |(id, flow)| FlowLoad {
                    priority: *priority,
                    fairness_id: Some(id.clone()),
                    requests: flow.entries.len(),
                    bytes: flow.entries.iter().map(|e| e.bytes).sum(),
                    oldest_wait_s: flow
                        .entries
                        .front()
                        .map_or(0.0, |e| e.waited(now).as_secs_f64()),
                })
            })
            .collect();
        let flows_total = flows.len();
        flows.sort_by(|a, b| {
            b.requests
                .cmp(&a.requests)
                .then(b.priority.cmp(&a.priority))
                .then_with(|| a.fairness_id.cmp(&b.fairness_id))
        });
        flows.truncate(QueueView::MAX_FLOWS);
        QueueView {
            requests: self.len(),
            bytes: self.bytes,
            bands: self.bands(),
            flows,
            flows_total,
        }
    }

    /// Queues `item` at `now`, in band `priority` and flow `flow`, costing
    /// `bytes`. Returns its id and the lower-band requests it evicted to
    /// fit; or, when it cannot fit, the item back and why.
    #[allow(clippy::type_complexity)]
    pub fn push(
        &mut self,
        item: T,
        priority: i32,
        flow: &str,
        bytes: u64,
        now: Instant,
    ) -> Result<(u64, Vec<Dropped<T>>), (T, DropReason)> {
        let p = self.params;
        let fits = |len: usize, queued: u64| len < p.max_requests && queued + bytes <= p.max_bytes;
        if !fits(self.len(), self.bytes) {
            // Room only from lower bands, and only if all of them together
            // make enough: nothing is evicted for a newcomer that is
            // refused anyway.
            let (lower_len, lower_bytes) = self
                .bands
                .iter()
                .filter(|(Reverse(p), _)| *p < priority)
                .fold((0, 0), |(n, b), (_, band)| (n + band.len, b + band.bytes));
            if !fits(self.len() - lower_len, self.bytes - lower_bytes) {
                let reason = if self.len() >= p.max_requests {
                    DropReason::QueueFull
                } else {
                    DropReason::QueueBytes
                };
                return Err((item, reason));
            }
        }
        let mut evicted = Vec::new();
        while !fits(self.len(), self.bytes) {
            let Some(entry) = self.evict_newest_below(priority) else {
                break;
            };
            evicted.push(Dropped {
                entry,
                reason: DropReason::Evicted,
            });
        }
        let id = self.next_id;
        self.next_id += 1;
        let band = self.bands.entry(Reverse(priority)).or_default();
        let f = band.flows.entry(flow.to_string()).or_insert_with(|| Flow {
            entries: VecDeque::new(),
            deficit: 0,
        });
        if f.entries.is_empty() {
            band.order.push_back(flow.to_string());
        }
        f.entries.push_back(Entry {
            item,
            id,
            priority,
            flow: flow.to_string(),
            bytes,
            since: now,
        });
        band.len += 1;
        band.bytes += bytes;
        self.bytes += bytes;
        self.index.insert(id, (priority, flow.to_string()));
        Ok((id, evicted))
    }

    /// The most recently queued request of the lowest band below
    /// `priority`, removed.
    fn evict_newest_below(&mut self, priority: i32) -> Option<Entry<T>> {
        let (&Reverse(lowest), band) = self.bands.iter().next_back()?;
        if lowest >= priority {
            return None;
        }
        let (key, id) = band
            .flows
            .iter()
            .filter_map(|(k, f)| f.entries.back().map(|e| (k.clone(), e.id)))
            .max_by_key(|&(_, id)| id)?;
        self.take(lowest, &key, id)
    }

    fn take(&mut self, priority: i32, key: &str, id: u64) -> Option<Entry<T>> {
        let band = self.bands.get_mut(&Reverse(priority))?;
        let entry = band.take(key, id)?;
        self.settle(priority, entry.id, entry.bytes);
        Some(entry)
    }

    /// Bookkeeping after an entry left band `priority`.
    fn settle(&mut self, priority: i32, id: u64, bytes: u64) {
        self.index.remove(&id);
        self.bytes -= bytes;
        if self
            .bands
            .get(&Reverse(priority))
            .is_some_and(|b| b.len == 0)
        {
            self.bands.remove(&Reverse(priority));
        }
    }

    /// Removes request `id` (its client went away).
    pub fn remove(&mut self, id: u64) -> Option<Entry<T>> {
        let (priority, key) = self.index.get(&id)?.clone();
        self.take(priority, &key, id)
    }

    /// Removes and returns every request that has waited `ttl` at `now`.
    pub fn expire(&mut self, now: Instant) -> Vec<Entry<T>> {
        let ttl = self.params.ttl;
        let mut out = Vec::new();
        let due: Vec<(i32, String)> = self
            .bands
            .iter()
            .flat_map(|(Reverse(p), band)| {
                band.flows
                    .iter()
                    .filter(|(_, f)| f.entries.front().is_some_and(|e| e.waited(now) >= ttl))
                    .map(|(k, _)| (*p, k.clone()))
            })
            .collect();
        for (priority, key) in due {
            // First come first served: a flow's oldest are at its front.
            while let Some(band) = self.bands.get_mut(&Reverse(priority)) {
                let front_due = band
                    .flows
                    .get(&key)
                    .and_then(|f| f.entries.front())
                    .is_some_and(|e| e.waited(now) >= ttl);
                if !front_due {
                    break;
                }
                let Some(entry) = band.take_front(&key) else {
                    break;
                };
                self.settle(priority, entry.id, entry.bytes);
                out.push(entry);
            }
        }
        out
    }

    /// When the next request's time to live runs out.
    pub fn next_expiry(&self) -> Option<Instant> {
        self.bands
            .values()
            .flat_map(|b| b.flows.values())
            .filter_map(|f| f.entries.front())
            .map(|e| e.since + self.params.ttl)
            .min()
    }

    /// The next request to leave, among those `ready` accepts (it answers
    /// with what the caller needs to dispatch the request, or `None` when
    /// the request cannot go yet): the highest band with a ready request;
    /// in it, deficit round robin between the flows, by the rounds each
    /// flow's oldest request still needs (then its place in the round);
    /// in a flow, the oldest request that may go, among its first
    /// [`LOOK_DEPTH`] (a tenant's oldest request waiting for its warm
    /// replica does not keep a later one from a replica that has room and
    /// holds that one's prompt). `ready` is asked in that order and only
    /// until one accepts, so a look costs one answer when the fleet has
    /// room, however many flows wait. A flow whose requests cannot go does
    /// not hold up the others (they may want other replicas); the round's
    /// credit reaches it too, but never more than its oldest request and
    /// one quantum, so it banks no burst while it waits.
    pub fn pop_where<R>(
        &mut self,
        mut ready: impl FnMut(&Entry<T>) -> Option<R>,
    ) -> Option<(Entry<T>, R)> {
        let quantum = self.params.quantum.max(1);
        for (&Reverse(priority), band) in self.bands.iter_mut() {
            // Each flow's rounds until its deficit covers its oldest
            // request, and its place in the round.
            let mut turns: Vec<(u64, usize)> = band
                .order
                .iter()
                .enumerate()
                .filter_map(|(place, key)| {
                    let f = band.flows.get(key)?;
                    let head = f.entries.front()?;
                    Some((
                        head.cost().saturating_sub(f.deficit).div_ceil(quantum),
                        place,
                    ))
                })
                .collect();
            let mut ask = |(rounds, place): (u64, usize)| {
                let f = band.flows.get(&band.order[place])?;
                f.entries
                    .iter()
                    .take(LOOK_DEPTH)
                    .enumerate()
                    .find_map(|(at, e)| {
                        // The rounds this one needs (the flow's oldest,
                        // usually: the order's).
                        let rounds = if at == 0 {
                            rounds
                        } else {
                            e.cost().saturating_sub(f.deficit).div_ceil(quantum)
                        };
                        ready(e).map(|answer| (rounds, place, at, answer))
                    })
            };
            // The first in turn usually may go: no sort for it.
            let first = turns.iter().copied().min();
            let mut found = first.and_then(&mut ask);
            if found.is_none() && turns.len() > 1 {
                turns.sort_unstable();
                found = turns.iter().skip(1).copied().find_map(&mut ask);
            }
            let Some((rounds, place, at, answer)) = found else {
                continue;
            };
            let key = band.order[place].clone();
            // Rounds passed: every flow earned them (none when the
            // winner's credit covered its request already).
            if rounds > 0 {
                for (k, f) in band.flows.iter_mut() {
                    let earned = f.deficit.saturating_add(rounds * quantum);
                    f.deficit = if *k == key {
                        earned
                    } else {
                        let cap = f.entries.front().map_or(0, Entry::cost) + quantum;
                        earned.min(cap.max(f.deficit))
                    };
                }
            }
            let flow = band.flows.get_mut(&key)?;
            let cost = flow.entries.get(at).map_or(0, Entry::cost);
            flow.deficit = flow.deficit.saturating_sub(cost);
            // The flow's oldest after this one leaves.
            let next_cost = flow.entries.get(usize::from(at == 0)).map(Entry::cost);
            let entry = band.take_where(&key, |_| Some(at))?;
            // Its turn is over unless its credit covers its next request.
            if next_cost.is_some_and(|c| band.flows.get(&key).is_some_and(|f| f.deficit < c)) {
                band.order.retain(|k| *k != key);
                band.order.push_back(key);
            }
            self.settle(priority, entry.id, entry.bytes);
            return Some((entry, answer));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> QueueParams {
        QueueParams {
            ttl: Duration::from_secs(60),
            max_requests: 100,
            max_bytes: 1 << 30,
            quantum: 4096,
        }
    }

    #[test]
    fn the_bookkeeping_follows_every_way_out() {
        let t = Instant::now();
        let mut q = FlowQueue::new(params());
        let (a, _) = q.push("a", 0, "x", 10, t).unwrap();
        q.push("b", 5, "y", 20, t).unwrap();
        q.push("c", 0, "x", 30, t + Duration::from_secs(30))
            .unwrap();
        assert_eq!((q.len(), q.bytes()), (3, 60));
        assert_eq!(q.remove(a).map(|e| e.item), Some("a"));
        assert!(q.remove(a).is_none());
        let expired = q.expire(t + Duration::from_secs(60));
        assert_eq!(expired.iter().map(|e| e.item).collect::<Vec<_>>(), ["b"]);
        assert_eq!((q.len(), q.bytes()), (1, 30));
        assert_eq!(q.next_expiry(), Some(t + Duration::from_secs(90)));
        assert_eq!(
            q.bands(),
            [BandLoad {
                priority: 0,
                requests: 1,
                bytes: 30
            }]
        );
        assert_eq!(q.pop_where(|_| Some(())).map(|(e, _)| e.item), Some("c"));
        assert!(q.is_empty() && q.bands().is_empty() && q.next_expiry().is_none());
    }

    #[test]
    fn the_view_lists_each_band_and_the_busiest_flows_first() {
        let t = Instant::now();
        let mut q = FlowQueue::new(params());
        q.push(0, 0, "quiet", 100, t).unwrap();
        for k in 0..3 {
            q.push(1 + k, 0, "noisy", 1000, t + Duration::from_secs(k))
                .unwrap();
        }
        q.push(9, 5, "interactive", 10, t + Duration::from_secs(4))
            .unwrap();
        let v = q.view(t + Duration::from_secs(10));
        assert_eq!((v.requests, v.bytes, v.flows_total), (5, 3110, 3));
        assert_eq!(
            v.bands
                .iter()
                .map(|b| (b.priority, b.requests))
                .collect::<Vec<_>>(),
            [(5, 1), (0, 4)]
        );
        let flows: Vec<_> = v
            .flows
            .iter()
            .map(|f| {
                (
                    f.fairness_id.as_deref().unwrap(),
                    f.priority,
                    f.requests,
                    f.bytes,
                )
            })
            .collect();
        assert_eq!(
            flows,
            [
                ("noisy", 0, 3, 3000),
                ("interactive", 5, 1, 10),
                ("quiet", 0, 1, 100)
            ]
        );
        // The oldest request of each flow: its wait.
        assert_eq!(v.flows[0].oldest_wait_s, 10.0);
        assert_eq!(v.flows[1].oldest_wait_s, 6.0);

        // Many flows: the busiest are listed, all are counted.
        for k in 0..QueueView::MAX_FLOWS {
            q.push(100 + k as u64, 0, &format!("t{k}"), 1, t).unwrap();
        }
        let v = q.view(t);
        assert_eq!(v.flows.len(), QueueView::MAX_FLOWS);
        assert_eq!(v.flows_total, 3 + QueueView::MAX_FLOWS);
        assert_eq!(v.flows[0].fairness_id.as_deref(), Some("noisy"));
    }
}

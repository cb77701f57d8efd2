//! Flow control in the sidecar: the queue beside the decision.
//!
//! A request about to be decided asks [`FlowControl::admit`] first. While
//! the fleet has room for it (and nothing of its band or a higher one
//! waits), it is decided at once, as without flow control. While every
//! replica it may use is saturated ([`hearth_router::Router::room_in`]),
//! it waits in the queue ([`hearth_router::FlowQueue`]: priority band
//! from its objective, fairness id, prompt bytes) and its ext_proc stream
//! holds Envoy's answer; a sheddable request (negative priority) is
//! refused at once while every replica is saturated, and waits behind the
//! other bands while the replicas only keep their slots for higher bands
//! (refused then too with `HEARTH_FLOW_SHEDDABLE_WAITS` off). One task,
//! [`FlowControl::run`], lets requests out: whenever a request ends (its
//! reservation is released), and at least every
//! [`RECHECK`] while anything waits (engine figures and peers' load change
//! without a release here). It decides each leaving request among the
//! replicas with room and hands the decision to the waiting stream; a
//! request past its time to live, or pushed out by a higher band, is
//! handed its 429 instead. A stream that ends while it waits (the client
//! went away) takes its request out of the queue at once ([`Ticket`]'s
//! drop).

use std::cell::Cell;
use std::collections::hash_map::DefaultHasher;
use std::collections::HashSet;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use envoy_types::pb::envoy::service::ext_proc::v3::HttpHeaders;
use hearth_router::{
    Decision, DropReason, Entry, FlowQueue, Kept, Look, QueueParams, RequestInfo, Room, RouteError,
    Router,
};
use hearth_wire::names::{FAIRNESS_ID, OBJECTIVE};
use tokio::sync::{oneshot, Notify};

use crate::config::{EnginePriority, Objectives, Settings};
use crate::envoy::headers;
use crate::observe::Observer;

/// How often the queue is looked at while requests wait, besides every
/// release: the engines' figures and the peers' load change on their own.
pub const RECHECK: Duration = Duration::from_millis(100);

/// The fairness id of a request that names none.
pub const DEFAULT_FAIRNESS_ID: &str = "default";

/// Fairness ids longer than this are kept as a digest.
const MAX_FAIRNESS_ID_BYTES: usize = 64;

/// A request's place in the queue's order: its band and its flow.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Class {
    pub priority: i32,
    pub fairness_id: String,
}

impl Default for Class {
    fn default() -> Self {
        Class {
            priority: 0,
            fairness_id: DEFAULT_FAIRNESS_ID.into(),
        }
    }
}

/// How a waiting request left the queue.
#[derive(Debug)]
pub enum Left {
    /// Decided (routed, or refused by the decision itself), after
    /// `elapsed` deciding.
    Decided {
        decided: Box<Result<Decision, RouteError>>,
        elapsed: Duration,
    },
    /// Dropped with a 429.
    Dropped(DropReason),
}

/// What a waiting request gets back: how it left, its request, and how
/// long it waited.
#[derive(Debug)]
pub struct Dispatch {
    pub left: Left,
    pub info: RequestInfo,
    pub waited: Duration,
}

/// What [`FlowControl::admit`] says of a request.
#[derive(Debug)]
pub enum Admission {
    /// Decide it now: among these replicas when some keep their free
    /// slots for higher bands (`None`: among all it may use).
    Decide(RequestInfo, Option<Vec<usize>>),
    /// 429 at once, for this reason.
    Refuse(RequestInfo, DropReason),
    /// It waits: the ticket's channel brings its [`Dispatch`].
    Wait(Ticket),
}

/// The queue's item: what the dispatcher needs to decide for a request,
/// and where the decision goes.
#[derive(Debug)]
pub struct Waiter {
    info: RequestInfo,
    subset: Option<Vec<usize>>,
    to: oneshot::Sender<Dispatch>,
    /// When a look first found the replica holding most of its prompt
    /// saturated while another had room: the affinity wait runs from
    /// then, not from its arrival (time spent with every replica full
    /// is no reason to give its cache up).
    warm_since: Cell<Option<Instant>>,
}

/// A request waiting in the queue. Dropped before its dispatch (its
/// stream ended: the client went away), it takes the request out.
#[derive(Debug)]
pub struct Ticket {
    id: u64,
    priority: i32,
    since: Instant,
    flow: Arc<FlowControl>,
    pub from: oneshot::Receiver<Dispatch>,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        // Nothing left to take out once the dispatch is sent.
        let gone = self.flow.lock().remove(self.id);
        if gone.is_some() {
            let waited = self.since.elapsed();
            self.flow
                .observer
                .flow
                .dropped(self.priority, DropReason::Disconnected, Some(waited));
            self.flow.publish();
        }
    }
}

/// The flow-control queue and its settings.
pub struct FlowControl {
    router: Arc<Router>,
    observer: Arc<Observer>,
    enabled: bool,
    queue: Mutex<FlowQueue<Waiter>>,
    /// Bands that held requests at the last look (their gauges go to zero
    /// when they empty).
    bands_seen: Mutex<Vec<i32>>,
    wake: Arc<Notify>,
    objectives: Objectives,
    fairness_header: Option<String>,
    engine_priority: EnginePriority,
}

impl std::fmt::Debug for FlowControl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FlowControl")
            .field("enabled", &self.enabled)
            .finish_non_exhaustive()
    }
}

impl FlowControl {
    /// Flow control for the observer's router, as `settings` say; the
    /// router's releases wake its dispatcher.
    pub fn new(observer: Arc<Observer>, settings: &Settings) -> Arc<FlowControl> {
        FlowControl::with(
            observer,
            settings.flow_control,
            settings.queue_params(),
            settings.flow_objectives.clone().unwrap_or_default(),
            settings.flow_fairness_header.clone(),
            settings.engine_priority,
        )
    }

    pub fn with(
        observer: Arc<Observer>,
        enabled: bool,
        params: QueueParams,
        objectives: Objectives,
        fairness_header: Option<String>,
        engine_priority: EnginePriority,
    ) -> Arc<FlowControl> {
        let router = Arc::clone(observer.router());
        let wake = Arc::new(Notify::new());
        let hook = Arc::clone(&wake);
        router.on_release(move || hook.notify_one());
        let flow = Arc::new(FlowControl {
            router,
            observer,
            enabled,
            queue: Mutex::new(FlowQueue::new(params)),
            bands_seen: Mutex::new(Vec::new()),
            wake,
            objectives,
            fairness_header,
            engine_priority,
        });
        let look = Arc::downgrade(&flow);
        flow.observer.set_queue_view(move || {
            look.upgrade()
                .map(|f| f.lock().view(Instant::now()))
                .unwrap_or_default()
        });
        flow
    }

    fn lock(&self) -> MutexGuard<'_, FlowQueue<Waiter>> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The deadline a waiting request's ext_proc answer gets: its time to
    /// live and a margin (within the rendered `max_message_timeout`).
    pub fn answer_deadline(&self) -> Duration {
        self.lock().params().ttl + Duration::from_secs(5)
    }

    /// The request's band (its objective's priority) and flow (its
    /// fairness id, else a digest of the operator's header, else the
    /// default).
    pub fn class(&self, h: &HttpHeaders) -> Class {
        let priority = self.objectives.priority(headers::get(h, OBJECTIVE));
        let named = headers::get(h, FAIRNESS_ID)
            .map(str::trim)
            .filter(|id| !id.is_empty())
            .map(|id| {
                if id.len() <= MAX_FAIRNESS_ID_BYTES {
                    id.to_string()
                } else {
                    digest(id)
                }
            });
        let fairness_id = named
            .or_else(|| {
                let name = self.fairness_header.as_deref()?;
                headers::get(h, name).filter(|v| !v.is_empty()).map(digest)
            })
            .unwrap_or_else(|| DEFAULT_FAIRNESS_ID.to_string());
        Class {
            priority,
            fairness_id,
        }
    }

    /// Whether `HEARTH_ENGINE_PRIORITY` is set.
    pub fn writes_engine_priority(&self) -> bool {
        self.engine_priority != EnginePriority::Off
    }

    /// The place in its engine's queue a request of `class` gets
    /// (`HEARTH_ENGINE_PRIORITY`), given its tag on its replica's virtual
    /// clock (`Reservation::engine_tag`); `None` when the setting is off.
    /// See [`engine_priority`].
    pub fn engine_priority(&self, class: &Class, tag: Instant) -> Option<i64> {
        let now = Instant::now();
        let wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        // The tag on the wall clock (it lies ahead of now, or at it).
        let tag_ms = (wall + tag.saturating_duration_since(now)).as_millis();
        engine_priority(
            self.engine_priority,
            class.priority,
            u64::try_from(tag_ms).unwrap_or(u64::MAX),
        )
    }

    /// Whether `info` is decided now, refused, or waits (see the module
    /// documentation). A request joins the queue while anything of its
    /// band or a higher one waits there, so that it does not pass them;
    /// the dispatcher lets it out at once if it has room.
    pub fn admit(
        self: &Arc<Self>,
        info: RequestInfo,
        subset: Option<&[usize]>,
        class: &Class,
    ) -> Admission {
        self.admit_holding(info, subset, class, 0)
    }

    /// [`FlowControl::admit`] for a request whose stream holds `held`
    /// bytes of body while it waits (body mode keeps a body for its engine
    /// priority): it counts against the queue's bytes
    /// (`HEARTH_FLOW_MAX_BYTES`) as the larger of those and its prompt.
    pub fn admit_holding(
        self: &Arc<Self>,
        mut info: RequestInfo,
        subset: Option<&[usize]>,
        class: &Class,
        held: u64,
    ) -> Admission {
        // Its band and flow, for the slots kept for higher bands and for
        // flows under their fair share.
        info.priority = class.priority;
        info.flow = flow_digest(&class.fairness_id);
        // A request that names no model and carries no prompt (a model
        // list, a health check) costs the engines nothing to speak of.
        let promptless = info.model.is_none() && info.prompt_bytes == 0;
        if !self.enabled || promptless {
            return Admission::Decide(info, None);
        }
        let now = Instant::now();
        // Slots kept for higher bands: decided among the replicas that keep
        // none, unless the one holding most of its prompt keeps them (then
        // it waits for that one, as for a saturated warm replica).
        let (kept, saturated) = match self.router.admission_at(&info, subset, now) {
            Ok(kept) => (kept, None),
            Err(saturated) => (Kept::Nothing, Some(saturated)),
        };
        let warm_kept = kept == Kept::Warm;
        let mut queue = self.lock();
        if saturated.is_none() && !warm_kept && !queue.holds_at_or_above(class.priority) {
            let open = match kept {
                Kept::Around(open) => Some(open),
                Kept::Nothing | Kept::Warm => None,
            };
            return Admission::Decide(info, open);
        }
        // A sheddable request is refused while every replica is saturated;
        // kept from the slots of higher bands only, it waits behind them
        // (`HEARTH_FLOW_SHEDDABLE_WAITS`), else it is refused then too.
        let shed = class.priority < 0
            && (saturated.is_some() || warm_kept)
            && (!self.router.params().flow.sheddable_waits
                || saturated.is_some_and(|s| s.for_every_band));
        if shed {
            drop(queue);
            self.observer
                .flow
                .dropped(class.priority, DropReason::Sheddable, None);
            return Admission::Refuse(info, DropReason::Sheddable);
        }
        let (to, from) = oneshot::channel();
        let bytes = info.prompt_bytes.max(held);
        let waiter = Waiter {
            info,
            subset: subset.map(<[usize]>::to_vec),
            to,
            warm_since: Cell::new(None),
        };
        match queue.push(waiter, class.priority, &class.fairness_id, bytes, now) {
            Ok((id, evicted)) => {
                drop(queue);
                for dropped in evicted {
                    self.hand_back(dropped.entry, Left::Dropped(dropped.reason), now);
                }
                self.publish();
                self.wake.notify_one();
                Admission::Wait(Ticket {
                    id,
                    priority: class.priority,
                    since: now,
                    flow: Arc::clone(self),
                    from,
                })
            }
            Err((waiter, reason)) => {
                drop(queue);
                self.observer.flow.dropped(class.priority, reason, None);
                Admission::Refuse(waiter.info, reason)
            }
        }
    }

    /// Sends a request that left the queue its dispatch (nothing happens
    /// when its stream is gone: a decision's reservation is released as
    /// it drops).
    fn hand_back(&self, entry: Entry<Waiter>, left: Left, now: Instant) {
        let waited = entry.waited(now);
        match &left {
            Left::Decided { .. } => self.observer.flow.dispatched(entry.priority, waited),
            Left::Dropped(reason) => {
                self.observer
                    .flow
                    .dropped(entry.priority, *reason, Some(waited))
            }
        }
        let Waiter { info, to, .. } = entry.item;
        let _ = to.send(Dispatch { left, info, waited });
    }

    /// The queue's occupancy into the metrics.
    fn publish(&self) {
        let bands = self.lock().bands();
        let mut seen = self.bands_seen.lock().unwrap_or_else(|p| p.into_inner());
        let emptied: Vec<i32> = seen
            .iter()
            .copied()
            .filter(|p| !bands.iter().any(|b| b.priority == *p))
            .collect();
        self.observer.flow.set_bands(&bands, &emptied);
        *seen = bands.iter().map(|b| b.priority).collect();
    }

    /// One look at the queue at `now`: requests past their time to live
    /// leave with a 429; then, in the queue's order, every request that
    /// has room is decided among the replicas that have it. Returns when
    /// the next request's time to live runs out.
    pub fn dispatch_at(&self, now: Instant) -> Option<Instant> {
        let mut out: Vec<(Entry<Waiter>, Left)> = Vec::new();
        let next = {
            let mut queue = self.lock();
            for entry in queue.expire(now) {
                out.push((entry, Left::Dropped(DropReason::Ttl)));
            }
            let router = &self.router;
            // Requests for a model, replicas and lane found full in this
            // look wait without asking again (dispatching only fills them
            // more); found kept for other flows, so do the flow's later
            // requests (its band and fairness id), not other flows'.
            let long = router.params().long_prompt_bytes;
            let mut full: HashSet<FullKey> = HashSet::new();
            let mut shared: HashSet<(FullKey, (i32, u64))> = HashSet::new();
            // What the look reckons once for all its questions (each band's
            // fair share), until a request leaves.
            let mut look = Look::default();
            while let Some((entry, room)) = queue.pop_where(|e| {
                let info = &e.item.info;
                let key = (
                    info.model.clone(),
                    e.item.subset.clone(),
                    info.prompt_bytes >= long,
                );
                let flow = (info.priority, info.flow);
                if full.contains(&key) || shared.contains(&(key.clone(), flow)) {
                    return None;
                }
                let since = e.item.warm_since.get();
                let held = since.map_or(Duration::ZERO, |t| now.saturating_duration_since(t));
                match router.room_in(&mut look, &e.item.info, e.item.subset.as_deref(), held, now) {
                    Room::Full => {
                        full.insert(key);
                        None
                    }
                    Room::Share => {
                        shared.insert((key, flow));
                        None
                    }
                    Room::Warm => {
                        e.item.warm_since.set(since.or(Some(now)));
                        None
                    }
                    Room::Go(free) => Some(free),
                }
            }) {
                let started = Instant::now();
                let allowed = room.as_deref().or(entry.item.subset.as_deref());
                let decided = Box::new(router.decide_within_at(&entry.item.info, allowed, now));
                let elapsed = started.elapsed();
                look.changed();
                out.push((entry, Left::Decided { decided, elapsed }));
            }
            queue.next_expiry()
        };
        let changed = !out.is_empty();
        for (entry, left) in out {
            self.hand_back(entry, left, now);
        }
        if changed {
            self.publish();
        }
        next
    }

    /// The dispatcher: looks at the queue whenever a request ends or
    /// joins, at every time to live's end, and every [`RECHECK`] while
    /// anything waits. Runs until its task is stopped.
    pub async fn run(self: Arc<Self>) {
        loop {
            let next = self.dispatch_at(Instant::now());
            let sleep = next.map(|at| at.saturating_duration_since(Instant::now()).min(RECHECK));
            match sleep {
                Some(d) => {
                    tokio::select! {
                        () = self.wake.notified() => {}
                        () = tokio::time::sleep(d) => {}
                    }
                }
                None => self.wake.notified().await,
            }
        }
    }
}

/// What a look at the queue found full: a model, a replica subset, and
/// the long lane or not.
type FullKey = (Option<String>, Option<Vec<usize>>, bool);

/// How far apart two neighbouring bands' engine priorities are: 2^44
/// milliseconds, some 557 years, so a band's requests come before every
/// request of the band below whatever their tags.
pub const ENGINE_BAND_STEP: i64 = 1 << 44;

/// The bands the engine priority tells apart: an objective's priority
/// beyond +-127 counts as +-127 there (the values stay exact in any JSON
/// reader: below 2^53).
pub const ENGINE_BANDS_MAX: i32 = 127;

/// The engine priority of a request of band `band` (an objective's
/// priority: higher first) whose tag on its replica's virtual clock is
/// `tag_ms` (milliseconds since the Unix epoch, see
/// `hearth_router::fleet::EngineTags`), written the way `order` says the
/// engine reads it. Lower-first: `-band * ENGINE_BAND_STEP + tag_ms`;
/// higher-first: the same negated. So a higher band goes first, and within
/// a band the earlier tag: each tenant's requests in the order they came,
/// and a tenant that sent more than one request an engine interval after
/// those that did not. Tags are on the wall clock, so several sidecars'
/// requests to one engine compare (within their clocks' skew).
pub fn engine_priority(order: EnginePriority, band: i32, tag_ms: u64) -> Option<i64> {
    let band = i64::from(band.clamp(-ENGINE_BANDS_MAX, ENGINE_BANDS_MAX));
    let tag = i64::try_from(tag_ms)
        .unwrap_or(i64::MAX)
        .min(ENGINE_BAND_STEP - 1);
    let lower_first = -band * ENGINE_BAND_STEP + tag;
    match order {
        EnginePriority::Off => None,
        EnginePriority::LowerFirst => Some(lower_first),
        EnginePriority::HigherFirst => Some(-lower_first),
    }
}

/// A fairness id's digest, as the router's flows know it.
fn flow_digest(fairness_id: &str) -> u64 {
    let mut h = DefaultHasher::new();
    fairness_id.hash(&mut h);
    h.finish()
}

/// A fairness id kept as a digest: never the value itself (it may be a
/// credential), and bounded in size.
fn digest(value: &str) -> String {
    format!("h-{:016x}", flow_digest(value))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse_objectives;
    use crate::observe::journal::Journal;
    use hearth_router::{AffinityBasis, QueueView, RouterParams};

    fn flow(enabled: bool) -> Arc<FlowControl> {
        flow_over(enabled, &["127.0.0.1:1"])
    }

    fn flow_over(enabled: bool, upstreams: &[&str]) -> Arc<FlowControl> {
        flow_tuned(enabled, upstreams, |p| p.flow.uncached_bytes = 1)
    }

    fn flow_tuned(
        enabled: bool,
        upstreams: &[&str],
        tune: impl FnOnce(&mut RouterParams),
    ) -> Arc<FlowControl> {
        let upstreams: Vec<_> = upstreams.iter().map(|u| u.parse().unwrap()).collect();
        let mut params = RouterParams::default();
        tune(&mut params);
        let router = Router::new(params, &upstreams);
        let observer = Observer::new(
            router,
            AffinityBasis::default(),
            Journal::open(4, None).unwrap(),
            "hearth",
        );
        FlowControl::with(
            observer,
            enabled,
            QueueParams::default(),
            parse_objectives("chat=10,batch=-1").unwrap(),
            Some("x-api-key-hash".into()),
            EnginePriority::LowerFirst,
        )
    }

    #[test]
    fn engine_priority_puts_bands_first_then_the_earlier_tag() {
        use EnginePriority::*;
        let now_ms = 1_780_000_000_000; // 2026
        assert_eq!(engine_priority(Off, 10, now_ms), None);
        // vLLM's order: lower first.
        let v = |band, tag| engine_priority(LowerFirst, band, tag).unwrap();
        assert_eq!(v(0, now_ms), 1_780_000_000_000);
        // A higher band first however late its tag.
        assert!(v(10, u64::MAX) < v(0, 0));
        assert!(v(0, now_ms + 86_400_000) < v(-1, now_ms));
        // Within a band, the earlier tag.
        assert!(v(0, now_ms) < v(0, now_ms + 1));
        // Bands past +-127 count as +-127; every value below 2^53.
        assert_eq!(v(1000, now_ms), v(127, now_ms));
        for (band, tag) in [(i32::MIN, u64::MAX), (i32::MAX, 0), (0, u64::MAX)] {
            assert!(v(band, tag).unsigned_abs() < 1 << 53, "{band} {tag}");
        }
        // Higher first: the same order.
        let h = |band, tag| engine_priority(HigherFirst, band, tag).unwrap();
        assert!(h(10, now_ms) > h(0, now_ms));
        assert!(h(0, now_ms) > h(0, now_ms + 1));
        // Through the sidecar's classes: a tag ahead of now is that far
        // ahead on the wall clock.
        let f = flow(true);
        let class = |pairs: &[(&str, &str)]| f.class(&headers::map(pairs));
        let chat = class(&[(OBJECTIVE, "chat")]);
        let soon = f.engine_priority(&chat, Instant::now()).unwrap();
        let later = f
            .engine_priority(&chat, Instant::now() + Duration::from_secs(60))
            .unwrap();
        assert!(
            (59_000..=61_000).contains(&(later - soon)),
            "{soon} {later}"
        );
        assert!(soon < -9 * ENGINE_BAND_STEP);
        let batch = f
            .engine_priority(&class(&[(OBJECTIVE, "batch")]), Instant::now())
            .unwrap();
        assert!(batch > ENGINE_BAND_STEP);
    }

    #[test]
    fn a_request_is_classed_by_its_objective_and_fairness_id() {
        let f = flow(true);
        let class = |pairs: &[(&str, &str)]| f.class(&headers::map(pairs));
        assert_eq!(class(&[]), Class::default());
        let c = class(&[(OBJECTIVE, "chat"), (FAIRNESS_ID, "team-a")]);
        assert_eq!((c.priority, c.fairness_id.as_str()), (10, "team-a"));
        assert_eq!(class(&[(OBJECTIVE, "batch")]).priority, -1);
        assert_eq!(class(&[(OBJECTIVE, "unknown")]).priority, 0);
        // The operator's header stands in, as a digest only.
        let key = class(&[("x-api-key-hash", "secret-ish")]).fairness_id;
        assert!(key.starts_with("h-") && !key.contains("secret"), "{key}");
        assert_eq!(key, class(&[("x-api-key-hash", "secret-ish")]).fairness_id);
        assert_ne!(key, class(&[("x-api-key-hash", "other")]).fairness_id);
        // The Inference Extension's header wins; a huge one is a digest.
        let named = class(&[(FAIRNESS_ID, "t"), ("x-api-key-hash", "k")]);
        assert_eq!(named.fairness_id, "t");
        let long = "x".repeat(1000);
        assert!(class(&[(FAIRNESS_ID, &long)]).fairness_id.len() < 20);
    }

    fn prompt(bytes: u64) -> RequestInfo {
        RequestInfo {
            prompt_bytes: bytes,
            model: Some("m".into()),
            ..RequestInfo::default()
        }
    }

    #[tokio::test]
    async fn a_saturated_fleet_queues_prompts_refuses_sheddable_ones_and_passes_the_rest() {
        let f = flow(true);
        // One cold prompt in flight saturates the replica (a 1-byte limit).
        let busy = f.router.decide(&prompt(5000)).unwrap();
        let class = |priority| Class {
            priority,
            fairness_id: "t".into(),
        };
        let Admission::Wait(mut ticket) = f.admit(prompt(100), None, &class(0)) else {
            panic!("a prompt did not wait")
        };
        assert_eq!(f.lock().len(), 1);
        // The dashboard's view of it.
        let view = f.observer.queue_view();
        assert_eq!((view.requests, view.bytes), (1, 100));
        assert_eq!(view.flows[0].fairness_id.as_deref(), Some("t"));
        assert!(matches!(
            f.admit(prompt(100), None, &class(-1)),
            Admission::Refuse(_, DropReason::Sheddable)
        ));
        // No model, no prompt: nothing to hold back.
        assert!(matches!(
            f.admit(RequestInfo::default(), None, &class(0)),
            Admission::Decide(..)
        ));
        // The request ends: the queued prompt leaves with a decision.
        drop(busy);
        f.dispatch_at(Instant::now());
        let Dispatch { left, waited, .. } = (&mut ticket.from).await.unwrap();
        assert!(matches!(left, Left::Decided { ref decided, .. } if decided.is_ok()));
        assert!(f.lock().is_empty() && waited >= Duration::ZERO);
        assert_eq!(f.observer.queue_view(), QueueView::default());
    }

    #[tokio::test]
    async fn the_affinity_wait_runs_from_when_another_replica_had_room_not_from_arrival() {
        let f = flow_over(true, &["127.0.0.1:1", "127.0.0.1:2"]);
        let turn = |blocks: u64| RequestInfo {
            hashes: (1..=blocks).collect(),
            ..prompt(blocks * 2048)
        };
        let home = f.router.decide(&turn(8)).unwrap().primary();
        let other = 1 - home;
        // Both replicas busy with cold prompts (a 1-byte limit): full.
        let cold = |replica: usize, base: u64| {
            let info = RequestInfo {
                hashes: (base..base + 4).collect(),
                ..prompt(4 * 2048)
            };
            f.router
                .decide_within_at(&info, Some(&[replica]), Instant::now())
        };
        let on_home = cold(home, 1_000).unwrap();
        let on_other = cold(other, 2_000).unwrap();
        let Admission::Wait(mut ticket) = f.admit(turn(10), None, &Class::default()) else {
            panic!("the next turn did not wait")
        };
        // Long after its arrival the other replica frees: the turn has
        // waited far past the affinity wait, but not for its warm replica
        // while another had room, so it keeps waiting for its cache.
        let affinity = f.router.params().flow.affinity_wait;
        let late = Instant::now() + affinity * 5;
        f.dispatch_at(late);
        drop(on_other);
        f.dispatch_at(late);
        assert_eq!(f.lock().len(), 1, "the turn left its warm replica");
        // Once it has waited the affinity wait with room elsewhere, it
        // takes the free replica.
        f.dispatch_at(late + affinity + Duration::from_millis(1));
        let Dispatch { left, .. } = (&mut ticket.from).await.unwrap();
        let Left::Decided { decided, .. } = left else {
            panic!("dropped: {left:?}")
        };
        assert_eq!(decided.unwrap().primary(), other);
        drop(on_home);
    }

    #[tokio::test]
    async fn a_sheddable_request_finds_the_slots_an_interactive_band_used_lately_kept() {
        for waits in [true, false] {
            sheddable_behind_kept_slots(waits);
        }
    }

    /// A sheddable request on two replicas whose slots an interactive
    /// band used lately, with `HEARTH_FLOW_SHEDDABLE_WAITS` as `waits`.
    fn sheddable_behind_kept_slots(waits: bool) {
        let list = ["127.0.0.1:1", "127.0.0.1:2"];
        let f = flow_tuned(true, &list, |p| {
            p.flow.uncached_bytes = 0;
            p.flow.sheddable_waits = waits;
        });
        let now = Instant::now();
        // Both engines run two at once (requests waited behind two in two
        // figures in a row), then drain.
        let figures = |last: (f64, f64)| {
            for a in list {
                for (running, waiting) in [(2.0, 1.0), (2.0, 1.0), last] {
                    f.router.set_engine_signals(
                        a.parse().unwrap(),
                        hearth_router::EngineSignals::queue(running, waiting, now),
                    );
                }
            }
        };
        figures((0.0, 0.0));
        let class = |priority| Class {
            priority,
            fairness_id: "t".into(),
        };
        let on = |replica: usize, priority: i32| {
            let info = RequestInfo {
                priority,
                ..prompt(100)
            };
            let d = f
                .router
                .decide_within_at(&info, Some(&[replica]), now)
                .unwrap();
            d.prefill().done_at(now);
            d
        };
        // Kept from it: it waits, or with the setting off is refused.
        let kept_from = |admission: Admission| match admission {
            Admission::Wait(ticket) => {
                assert!(waits, "waited with the setting off");
                Some(ticket)
            }
            Admission::Refuse(_, DropReason::Sheddable) => {
                assert!(!waits, "refused with the setting on");
                None
            }
            other => panic!("{other:?}"),
        };
        // An interactive request (band 10) ran on each replica.
        drop((on(0, 10), on(1, 10)));
        // A sheddable one runs on replica 0: its last slot is kept, so the
        // next sheddable one is decided among the others.
        let first = on(0, -1);
        match f.admit(prompt(100), None, &class(-1)) {
            Admission::Decide(_, open) => assert_eq!(open, Some(vec![1])),
            other => panic!("{other:?}"),
        }
        // With both replicas down to their kept slot, it waits behind the
        // other bands (or is refused); an interactive request passes it,
        // decided at once, anywhere.
        let second = on(1, -1);
        let waiting = kept_from(f.admit(prompt(100), None, &class(-1)));
        assert_eq!(f.lock().len(), usize::from(waits));
        assert!(matches!(
            f.admit(prompt(100), None, &class(10)),
            Admission::Decide(_, None)
        ));
        drop(waiting);
        drop(second);
        // A prompt replica 0 holds, while replica 0 keeps its last slot and
        // replica 1 has room: a sheddable one waits for replica 0 (or is
        // refused) rather than read again on replica 1; so does a
        // standard one (never refused).
        let warm = |priority: i32| RequestInfo {
            hashes: vec![7, 8],
            priority,
            ..prompt(4096)
        };
        drop(
            f.router
                .decide_within_at(&warm(10), Some(&[0]), now)
                .unwrap(),
        );
        drop(kept_from(f.admit(warm(-1), None, &class(-1))));
        assert!(matches!(
            f.admit(warm(0), None, &class(0)),
            Admission::Wait(_)
        ));
        drop(first);
        // Every engine's own queue past its threshold (five waiting):
        // saturated for every band, so refused at once either way.
        figures((2.0, 5.0));
        assert!(matches!(
            f.admit(prompt(100), None, &class(-1)),
            Admission::Refuse(_, DropReason::Sheddable)
        ));
    }

    #[tokio::test]
    async fn a_flow_past_its_fair_share_waits_while_another_flow_leaves_the_queue() {
        let f = flow_tuned(true, &["127.0.0.1:1"], |p| {
            p.flow.uncached_bytes = 0;
            p.flow.fair_window = Duration::from_secs(30);
        });
        let now = Instant::now();
        // The engine runs four at once (requests waited behind four in two
        // figures in a row), then drains.
        for (running, waiting) in [(4.0, 1.0), (4.0, 1.0), (0.0, 0.0)] {
            f.router.set_engine_signals(
                "127.0.0.1:1".parse().unwrap(),
                hearth_router::EngineSignals::queue(running, waiting, now),
            );
        }
        let class = |id: &str| Class {
            priority: 0,
            fairness_id: id.into(),
        };
        let of = |id: &str| RequestInfo {
            flow: flow_digest(id),
            ..prompt(100)
        };
        let send = |id: &str| {
            let d = f.router.decide_within_at(&of(id), None, now).unwrap();
            d.prefill().done_at(now);
            d
        };
        // Tenant "quiet" ran two at once lately; "noisy" has its share (two
        // of four slots) in flight.
        drop((send("quiet"), send("quiet")));
        let _noisy = (send("noisy"), send("noisy"));
        // The noisy tenant's next request waits; the quiet tenant's, queued
        // behind it, leaves at the next look, and the noisy one stays.
        let Admission::Wait(noisy) = f.admit(prompt(100), None, &class("noisy")) else {
            panic!("a noisy request past its share did not wait")
        };
        let Admission::Wait(mut quiet) = f.admit(prompt(100), None, &class("quiet")) else {
            panic!("a request queued behind another did not wait")
        };
        f.dispatch_at(now);
        let Dispatch { left, info, .. } = (&mut quiet.from).await.unwrap();
        assert!(matches!(left, Left::Decided { ref decided, .. } if decided.is_ok()));
        assert_eq!(info.flow, flow_digest("quiet"));
        assert_eq!(f.lock().len(), 1, "the noisy request still waits");
        drop(noisy);
        assert!(f.lock().is_empty());
    }

    #[tokio::test]
    async fn a_ticket_dropped_while_waiting_takes_its_request_out() {
        let f = flow(true);
        let _busy = f.router.decide(&prompt(5000)).unwrap();
        let Admission::Wait(ticket) = f.admit(prompt(100), None, &Class::default()) else {
            panic!("a prompt did not wait")
        };
        assert_eq!(f.lock().len(), 1);
        drop(ticket);
        assert!(f.lock().is_empty());
    }

    #[tokio::test]
    async fn an_idle_fleet_decides_at_once_and_flow_control_off_never_queues() {
        for enabled in [true, false] {
            let f = flow(enabled);
            let admitted = f.admit(RequestInfo::default(), None, &Class::default());
            assert!(matches!(admitted, Admission::Decide(..)), "{admitted:?}");
        }
    }
}

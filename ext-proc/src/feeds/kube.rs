//! The replica list from the Kubernetes API (`HEARTH_DISCOVERY`): watched
//! with kube-rs reflectors (a list, then a watch from its resourceVersion,
//! relisting when the server says 410 Gone), never polled.
//!
//! - `inferencepool`: one `InferencePool` (`inference.networking.k8s.io/v1`)
//!   names the fleet: its `spec.selector.matchLabels` picks pods of its
//!   namespace, its `spec.targetPorts` the engine ports. The pool and the
//!   namespace's pods are watched; a selector change applies at once.
//! - `pods`: the pods a label selector picks, on one port.
//!
//! A replica per ready pod (its Ready condition true, an IP, not being
//! deleted) and port, with the pod's name as its id. Each change goes
//! through [`Router::set_upstreams`], like a file reload, so a replica at
//! an address that stays keeps its warmth, load and health; an address a
//! new pod took over from a deleted one starts afresh.
//!
//! A pod may say where its engine publishes KV cache events, with the
//! annotations [`KV_EVENTS_ANNOTATION`] (`auto`, or `tcp://*:PORT`) and
//! [`KV_EVENTS_REPLAY_ANNOTATION`]: taken only where the endpoint is the
//! pod's own address (a wildcard host, or its IP), so a pod can point the
//! sidecar at nothing but itself; anything else is logged and the pod is a
//! replica without a feed.
//!
//! While the API cannot be reached, the last list stays (`/state` says so
//! under `upstreams.source`, `/health` is `degraded`) and the watch
//! resumes, with backoff, when it can. A pool that selects no ready pod is
//! an empty fleet (requests get 503), said once in the log.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::NamespaceResourceScope;
use kube::runtime::reflector::{self, Store};
use kube::runtime::utils::Backoff;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client, Resource};
use serde::{Deserialize, Serialize};

use crate::config::{parse_selector, Discovery, Settings, UpstreamSpec};
use crate::feeds::kv_events::own_endpoint;
use hearth_router::{EventEndpoint, Router};

/// The pod annotation naming where its engine publishes KV cache events:
/// `auto` (asked of the engine, as a listed `kv_events=auto`) or
/// `tcp://*:PORT` (the pod's own address; its IP may stand for `*`).
pub const KV_EVENTS_ANNOTATION: &str = "hearth/kv-events";
/// The pod annotation naming the engine's replay socket (`tcp://*:PORT`),
/// read only with [`KV_EVENTS_ANNOTATION`].
pub const KV_EVENTS_REPLAY_ANNOTATION: &str = "hearth/kv-events-replay";

/// The InferencePool API group and version this reads.
pub const POOL_GROUP: &str = "inference.networking.k8s.io";
pub const POOL_VERSION: &str = "v1";

/// An `InferencePool` (the Gateway API Inference Extension's CRD), only
/// the fields discovery reads; anything missing reads as empty, so an
/// odd object is an empty pool, never a broken watch.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct InferencePool {
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: InferencePoolSpec,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct InferencePoolSpec {
    #[serde(default)]
    pub selector: PoolSelector,
    #[serde(default)]
    pub target_ports: Vec<PoolPort>,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PoolSelector {
    #[serde(default)]
    pub match_labels: BTreeMap<String, String>,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct PoolPort {
    #[serde(default)]
    pub number: i64,
}

impl Resource for InferencePool {
    type DynamicType = ();
    type Scope = NamespaceResourceScope;
    fn kind(_: &()) -> Cow<'_, str> {
        "InferencePool".into()
    }
    fn group(_: &()) -> Cow<'_, str> {
        POOL_GROUP.into()
    }
    fn version(_: &()) -> Cow<'_, str> {
        POOL_VERSION.into()
    }
    fn plural(_: &()) -> Cow<'_, str> {
        "inferencepools".into()
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// What discovery watches, resolved from the settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    Pool {
        namespace: String,
        name: String,
    },
    Pods {
        namespace: String,
        selector: BTreeMap<String, String>,
        port: u16,
    },
}

impl Target {
    /// The source's name in `/state`.
    pub fn describe(&self) -> String {
        match self {
            Target::Pool { namespace, name } => format!("inferencepool {namespace}/{name}"),
            Target::Pods {
                namespace,
                selector,
                port,
            } => format!("pods {namespace} {} port {port}", selector_text(selector)),
        }
    }
}

fn selector_text(labels: &BTreeMap<String, String>) -> String {
    labels
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// Connects to the API (`HEARTH_KUBECONFIG`, else `KUBECONFIG` or
/// `~/.kube/config`, else the pod's service account) and resolves what to
/// watch; `None` without `HEARTH_DISCOVERY`.
pub async fn connect(settings: &Settings) -> Result<Option<Discovered>, String> {
    let Some(mode) = settings.discovery else {
        return Ok(None);
    };
    let config = match &settings.kubeconfig {
        Some(path) => from_kubeconfig(path).await?,
        None => kube::Config::infer()
            .await
            .map_err(|e| format!("no Kubernetes API configuration: {e}"))?,
    };
    // The watch's own backoff retries (and says the API is lost at
    // once); the client's retries of 429/503 would hide an outage.
    let mut config = config;
    config.default_retry = false;
    let namespace = settings
        .discovery_namespace
        .clone()
        .unwrap_or_else(|| config.default_namespace.clone());
    let client = Client::try_from(config).map_err(|e| format!("Kubernetes client: {e}"))?;
    let target = match mode {
        Discovery::Inferencepool => Target::Pool {
            namespace,
            name: settings.inference_pool.clone().unwrap_or_default(),
        },
        Discovery::Pods => Target::Pods {
            namespace,
            selector: parse_selector(settings.discovery_selector.as_deref().unwrap_or(""))?,
            port: settings.discovery_port.unwrap_or_default(),
        },
    };
    Ok(Some(Discovered {
        client,
        target,
        served: Served {
            dp_ranks: settings.discovery_dp_ranks.max(1),
            tls: settings.discovery_tls,
        },
    }))
}

/// A connected client and what it is to watch.
pub struct Discovered {
    pub client: Client,
    pub target: Target,
    pub served: Served,
}

/// How every discovered pod and port serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Served {
    /// Data-parallel ranks behind each pod and port.
    pub dp_ranks: u32,
    /// Reached over HTTPS (`HEARTH_DISCOVERY_TLS`), verified as a listed
    /// `https://` engine is.
    pub tls: bool,
}

async fn from_kubeconfig(path: &Path) -> Result<kube::Config, String> {
    let what = |e: &dyn std::fmt::Display| format!("HEARTH_KUBECONFIG {}: {e}", path.display());
    let file = kube::config::Kubeconfig::read_from(path).map_err(|e| what(&e))?;
    kube::Config::from_custom_kubeconfig(file, &kube::config::KubeConfigOptions::default())
        .await
        .map_err(|e| what(&e))
}

/// Is this pod a replica: Ready, with an IP, not being deleted?
pub fn pod_ready(pod: &Pod) -> Option<IpAddr> {
    if pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let status = pod.status.as_ref()?;
    let ready = status
        .conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    if !ready {
        return None;
    }
    status.pod_ip.as_deref()?.parse().ok()
}

fn selects(selector: &BTreeMap<String, String>, pod: &Pod) -> bool {
    let labels = pod.metadata.labels.as_ref();
    selector
        .iter()
        .all(|(k, v)| labels.and_then(|l| l.get(k)) == Some(v))
}

/// One discovered replica: its spec and the pod behind it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Found {
    pub spec: UpstreamSpec,
    /// The pod's uid: an address a new pod took over is a new replica.
    pub pod_uid: String,
    /// Why the pod's event annotations were not taken, if they were not.
    pub refused_kv_events: Option<String>,
}

/// The replicas: a ready pod per selected pod and port, sorted by pod name
/// and port (an address listed twice, by two pods claiming one IP during a
/// churn, is kept once).
pub fn replicas(
    pods: &[Arc<Pod>],
    selector: &BTreeMap<String, String>,
    ports: &[u16],
    served: Served,
) -> Vec<Found> {
    let mut found: Vec<(String, u16, Found)> = Vec::new();
    if selector.is_empty() {
        return Vec::new();
    }
    for pod in pods.iter().filter(|p| selects(selector, p)) {
        let Some(ip) = pod_ready(pod) else { continue };
        let name = pod.metadata.name.clone().unwrap_or_default();
        let (events, refused_kv_events) = match pod_kv_events(pod, ip, ports.len()) {
            Ok(events) => (events, None),
            Err(why) => ((None, None), Some(why)),
        };
        for &port in ports {
            let id = if ports.len() == 1 {
                name.clone()
            } else {
                format!("{name}:{port}")
            };
            found.push((
                name.clone(),
                port,
                Found {
                    spec: UpstreamSpec {
                        addr: SocketAddr::new(ip, port),
                        id: Some(id),
                        models: Vec::new(),
                        long: false,
                        dp_ranks: served.dp_ranks,
                        short_output: false,
                        tls: served.tls,
                        kv_events: events.0.clone(),
                        kv_events_replay: events.1.clone(),
                    },
                    pod_uid: pod.metadata.uid.clone().unwrap_or_default(),
                    refused_kv_events: refused_kv_events.clone(),
                },
            ));
        }
    }
    found.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
    let mut seen = std::collections::HashSet::new();
    found
        .into_iter()
        .map(|(_, _, f)| f)
        .filter(|f| seen.insert(f.spec.addr))
        .collect()
}

/// Where a pod at `ip` serving `ports` engine ports says its engine
/// publishes KV cache events, and replays them ([`KV_EVENTS_ANNOTATION`]):
/// nothing without the annotation; `auto`; or an endpoint that is the
/// pod's own (as an engine's `auto` answer is checked), only for a pod of
/// one engine port (the engines of several ports cannot share one
/// publisher). Otherwise why not.
type PodEvents = (Option<EventEndpoint>, Option<EventEndpoint>);

fn pod_kv_events(pod: &Pod, ip: IpAddr, ports: usize) -> Result<PodEvents, String> {
    let annotations = pod.metadata.annotations.as_ref();
    let get = |key: &str| annotations.and_then(|a| a.get(key)).map(|v| v.trim());
    let replay = get(KV_EVENTS_REPLAY_ANNOTATION);
    let Some(events) = get(KV_EVENTS_ANNOTATION) else {
        return match replay {
            None => Ok((None, None)),
            Some(_) => Err(format!(
                "{KV_EVENTS_REPLAY_ANNOTATION} needs {KV_EVENTS_ANNOTATION}"
            )),
        };
    };
    let engine = SocketAddr::new(ip, 0);
    let own = |annotation: &str, value: &str| {
        if ports > 1 {
            return Err(format!(
                "{annotation}={value:?} on a pod of {ports} engine ports: only `auto` can \
                 tell their publishers apart"
            ));
        }
        own_endpoint(value, engine).map_err(|e| format!("{annotation}: {e}"))
    };
    if events == "auto" {
        if replay.is_some() {
            return Err(format!(
                "{KV_EVENTS_REPLAY_ANNOTATION} with {KV_EVENTS_ANNOTATION}=auto: the engine \
                 names its replay socket itself"
            ));
        }
        return Ok((Some(EventEndpoint::FromEngine), None));
    }
    let published = own(KV_EVENTS_ANNOTATION, events)?;
    let replay = replay
        .map(|r| own(KV_EVENTS_REPLAY_ANNOTATION, r))
        .transpose()?;
    Ok((Some(published), replay))
}

/// The pool's selector and ports, or why it names no replica.
fn pool_shape(
    pool: Option<&InferencePool>,
) -> Result<(BTreeMap<String, String>, Vec<u16>), String> {
    let pool = pool.ok_or("not found")?;
    let ports: Vec<u16> = pool
        .spec
        .target_ports
        .iter()
        .filter_map(|p| u16::try_from(p.number).ok().filter(|&n| n > 0))
        .collect();
    if pool.spec.selector.match_labels.is_empty() {
        return Err("has no spec.selector.matchLabels".into());
    }
    if ports.is_empty() {
        return Err("has no spec.targetPorts".into());
    }
    Ok((pool.spec.selector.match_labels.clone(), ports))
}

/// Applies discovered lists to the router, once per change.
pub struct Applier {
    router: Arc<Router>,
    source: String,
    /// What was applied last (None before the first list).
    last: Option<Vec<Found>>,
    /// Why the last list was empty, as logged (said once per reason).
    empty_reason: Option<String>,
}

impl Applier {
    pub fn new(router: Arc<Router>, source: String) -> Applier {
        Applier {
            router,
            source,
            last: None,
            empty_reason: None,
        }
    }

    /// Applies `list` if it differs from the last one. An address whose
    /// pod changed (a new pod took over the IP) is first removed, so the
    /// new pod does not inherit the old one's warmth and health.
    pub fn apply(&mut self, list: Vec<Found>, why_empty: Option<String>) {
        if self.last.as_ref() == Some(&list) {
            return;
        }
        if let Some(last) = &self.last {
            let before: HashMap<SocketAddr, &str> = last
                .iter()
                .map(|f| (f.spec.addr, f.pod_uid.as_str()))
                .collect();
            let taken_over = |f: &Found| {
                before
                    .get(&f.spec.addr)
                    .is_some_and(|uid| *uid != f.pod_uid)
            };
            if list.iter().any(taken_over) {
                let kept: Vec<UpstreamSpec> = list
                    .iter()
                    .filter(|f| !taken_over(f))
                    .map(|f| f.spec.clone())
                    .collect();
                self.router.set_upstreams(&kept);
            }
        }
        for f in &list {
            if let Some(why) = &f.refused_kv_events {
                tracing::warn!(
                    source = %self.source,
                    replica = f.spec.id.as_deref().unwrap_or_default(),
                    "the pod's KV event annotation is not taken: {why}; the replica routes \
                     without the engine's events"
                );
            }
        }
        let specs: Vec<UpstreamSpec> = list.iter().map(|f| f.spec.clone()).collect();
        let summary = self.router.set_upstreams(&specs);
        if self.last.is_none() {
            self.router.note_source_synced();
        }
        tracing::info!(source = %self.source, replicas = specs.len(), %summary, "replica list discovered");
        if specs.is_empty() {
            let why = why_empty.unwrap_or_else(|| "selects no ready pod".into());
            if self.empty_reason.as_deref() != Some(&why) {
                tracing::warn!(
                    source = %self.source,
                    "{} {why}: the fleet is empty, requests get 503 until a pod is ready",
                    self.source
                );
                self.empty_reason = Some(why);
            }
        } else {
            self.empty_reason = None;
        }
        self.last = Some(list);
    }
}

/// Retries a lost watch after 250 ms, doubling up to 5 s, and from the
/// start once it works again.
#[derive(Clone, Debug)]
pub struct RetryBackoff {
    next: Duration,
}

const RETRY_FIRST: Duration = Duration::from_millis(250);
const RETRY_MAX: Duration = Duration::from_secs(5);

impl Default for RetryBackoff {
    fn default() -> Self {
        RetryBackoff { next: RETRY_FIRST }
    }
}

impl Iterator for RetryBackoff {
    type Item = Duration;
    fn next(&mut self) -> Option<Duration> {
        let now = self.next;
        self.next = (self.next * 2).min(RETRY_MAX);
        Some(now)
    }
}

impl Backoff for RetryBackoff {
    fn reset(&mut self) {
        self.next = RETRY_FIRST;
    }
}

/// One watched kind's events, reflected into its store.
fn reflected<K>(
    api: Api<K>,
    config: watcher::Config,
    trim: fn(&mut K),
) -> (
    Store<K>,
    impl Stream<Item = Result<Event<K>, watcher::Error>>,
)
where
    K: Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
{
    let (store, writer) = reflector::store();
    let stream = watcher::watcher(api, config)
        .backoff(RetryBackoff::default())
        .modify(trim)
        .reflect(writer);
    (store, stream)
}

/// Keeps of a pod what discovery reads (its name, uid, labels, its KV
/// event annotations, deletion and status), so a namespace of large pods
/// costs little memory.
fn trim_pod(pod: &mut Pod) {
    pod.metadata.managed_fields = None;
    if let Some(annotations) = pod.metadata.annotations.as_mut() {
        annotations.retain(|k, _| k == KV_EVENTS_ANNOTATION || k == KV_EVENTS_REPLAY_ANNOTATION);
    }
    pod.metadata.owner_references = None;
    pod.spec = None;
}

fn trim_pool(pool: &mut InferencePool) {
    pool.metadata.managed_fields = None;
    pool.metadata.annotations = None;
}

/// Which watch an event came from (boxed: a pod is large).
enum Change {
    Pool(Box<Result<Event<InferencePool>, watcher::Error>>),
    Pods(Box<Result<Event<Pod>, watcher::Error>>),
}

/// What one watch's event says about the connection and the store.
#[derive(Default)]
struct WatchState {
    /// A full list has been reflected at least once.
    synced: bool,
    /// Why the watch is failing, while it is.
    lost: Option<String>,
}

impl WatchState {
    /// Notes an event; true when the reflected objects may have changed.
    fn note<K>(&mut self, what: &str, event: &Result<Event<K>, watcher::Error>) -> bool {
        match event {
            Ok(Event::InitDone) => {
                self.synced = true;
                self.lost = None;
                true
            }
            Ok(Event::Apply(_) | Event::Delete(_)) => {
                self.lost = None;
                self.synced
            }
            // Said before the list is asked for: proves nothing yet.
            Ok(Event::Init) => false,
            Ok(Event::InitApply(_)) => {
                self.lost = None;
                false
            }
            // 410 Gone: the watch fell behind; the watcher relists now.
            Err(watcher::Error::WatchError(status)) if status.code == 410 => {
                tracing::debug!("{what}: watch expired (410 Gone), relisting");
                false
            }
            Err(e) => {
                if self.lost.is_none() {
                    tracing::warn!(
                        error = %e,
                        "{what}: Kubernetes API watch failed; keeping the last replica list, retrying"
                    );
                }
                self.lost = Some(format!("{what}: {e}"));
                false
            }
        }
    }
}

/// Why the source is lost, if a watch is failing.
fn lost(states: &[WatchState; 2]) -> Option<String> {
    states.iter().find_map(|s| s.lost.clone())
}

/// How often a lost API is checked for (a resumed watch says nothing
/// until something changes, so the connection is checked by a list of at
/// most one pod).
const RECHECK: Duration = Duration::from_secs(1);

/// The next event; while a watch is failing, also checks every
/// [`RECHECK`] whether the API answers again, and marks the source
/// connected when it does.
async fn next_change(
    events: &mut (impl Stream<Item = Change> + Unpin),
    states: &mut [WatchState; 2],
    recheck: &Api<Pod>,
    router: &Router,
) -> Option<Change> {
    loop {
        if lost(states).is_none() {
            return events.next().await;
        }
        tokio::select! {
            event = events.next() => return event,
            _ = tokio::time::sleep(RECHECK) => {
                let params = kube::api::ListParams::default().limit(1);
                if recheck.list(&params).await.is_ok() {
                    tracing::info!("Kubernetes API reachable again");
                    for s in states.iter_mut() {
                        s.lost = None;
                    }
                    router.note_source_connection(None);
                }
            }
        }
    }
}

/// Watches `target` and keeps the router's list in step, until dropped.
pub async fn run(router: Arc<Router>, discovered: Discovered) {
    let Discovered {
        client,
        target,
        served,
    } = discovered;
    let mut applier = Applier::new(Arc::clone(&router), target.describe());
    match target {
        Target::Pods {
            namespace,
            selector,
            port,
        } => {
            let api: Api<Pod> = Api::namespaced(client.clone(), &namespace);
            let config = watcher::Config::default().labels(&selector_text(&selector));
            let (pods, stream) = reflected(api, config, trim_pod);
            let mut stream = std::pin::pin!(stream.map(|e| Change::Pods(Box::new(e))));
            let mut states = [WatchState::default(), WatchState::default()];
            states[0].synced = true;
            let recheck = Api::<Pod>::namespaced(client, &namespace);
            while let Some(event) = next_change(&mut stream, &mut states, &recheck, &router).await {
                let Change::Pods(event) = event else { continue };
                if states[1].note("pods", &*event) {
                    applier.apply(replicas(&pods.state(), &selector, &[port], served), None);
                }
                router.note_source_connection(lost(&states));
            }
        }
        Target::Pool { namespace, name } => {
            let pools: Api<InferencePool> = Api::namespaced(client.clone(), &namespace);
            let (pool_store, pool_stream) = reflected(
                pools,
                watcher::Config::default().fields(&format!("metadata.name={name}")),
                trim_pool,
            );
            // Every pod of the namespace, filtered here by the pool's
            // selector: a selector change needs no new watch.
            let recheck = Api::<Pod>::namespaced(client.clone(), &namespace);
            let (pods, pod_stream) = reflected(
                Api::<Pod>::namespaced(client, &namespace),
                watcher::Config::default(),
                trim_pod,
            );
            let events = futures::stream::select(
                pool_stream.map(|e| Change::Pool(Box::new(e))),
                pod_stream.map(|e| Change::Pods(Box::new(e))),
            );
            let mut events = std::pin::pin!(events);
            let mut states = [WatchState::default(), WatchState::default()];
            while let Some(event) = next_change(&mut events, &mut states, &recheck, &router).await {
                let changed = match &event {
                    Change::Pool(e) => states[0].note("inferencepool", &**e),
                    Change::Pods(e) => states[1].note("pods", &**e),
                };
                router.note_source_connection(lost(&states));
                if changed && states[0].synced && states[1].synced {
                    let pool = pool_store
                        .state()
                        .into_iter()
                        .find(|p| p.metadata.name.as_deref() == Some(name.as_str()));
                    match pool_shape(pool.as_deref()) {
                        Ok((selector, ports)) => {
                            applier.apply(replicas(&pods.state(), &selector, &ports, served), None)
                        }
                        Err(why) => applier.apply(Vec::new(), Some(why)),
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{PodCondition, PodStatus};

    fn plain(dp_ranks: u32) -> Served {
        Served {
            dp_ranks,
            tls: false,
        }
    }

    fn pod(name: &str, uid: &str, ip: Option<&str>, ready: bool, app: &str) -> Arc<Pod> {
        Arc::new(Pod {
            metadata: ObjectMeta {
                name: Some(name.into()),
                uid: Some(uid.into()),
                labels: Some([("app".to_string(), app.to_string())].into()),
                ..ObjectMeta::default()
            },
            status: Some(PodStatus {
                pod_ip: ip.map(str::to_string),
                conditions: Some(vec![PodCondition {
                    type_: "Ready".into(),
                    status: if ready { "True" } else { "False" }.into(),
                    ..PodCondition::default()
                }]),
                ..PodStatus::default()
            }),
            ..Pod::default()
        })
    }

    fn settings(args: &[&str]) -> Result<Settings, String> {
        let all = ["hearth-ext-proc"].iter().chain(args);
        <crate::config::Cli as clap::Parser>::try_parse_from(all)
            .map(|c| c.settings)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn exactly_one_source_and_each_mode_its_own_settings() {
        // A list and discovery, or a file and discovery: refused by the
        // parser.
        for other in [["--upstreams", "127.0.0.1:1"], ["--upstreams-file", "/x"]] {
            let mut args = vec!["--discovery", "pods"];
            args.extend(other);
            assert!(settings(&args).is_err(), "{args:?}");
        }
        let problems = |args: &[&str]| settings(args).unwrap().validate().err().unwrap_or_default();
        assert!(problems(&["--discovery", "inferencepool", "--inference-pool", "p"]).is_empty());
        assert!(problems(&[
            "--discovery",
            "pods",
            "--discovery-selector",
            "app=x",
            "--discovery-port",
            "80"
        ])
        .is_empty());
        let p = problems(&["--discovery", "inferencepool"]);
        assert!(
            p.iter().any(|p| p.contains("HEARTH_INFERENCE_POOL")),
            "{p:?}"
        );
        let p = problems(&["--discovery", "pods", "--discovery-selector", "app"]);
        assert!(
            p.iter().any(|p| p.contains("HEARTH_DISCOVERY_SELECTOR")),
            "{p:?}"
        );
        assert!(
            p.iter().any(|p| p.contains("HEARTH_DISCOVERY_PORT")),
            "{p:?}"
        );
        let p = problems(&[
            "--discovery",
            "inferencepool",
            "--inference-pool",
            "p",
            "--discovery-port",
            "80",
        ]);
        assert!(
            p.iter()
                .any(|p| p.contains("are for HEARTH_DISCOVERY=pods")),
            "{p:?}"
        );
        let p = problems(&["--upstreams", "127.0.0.1:1", "--inference-pool", "p"]);
        assert!(
            p.iter().any(|p| p.contains("need HEARTH_DISCOVERY")),
            "{p:?}"
        );
    }

    #[test]
    fn selectors_parse_equality_only() {
        assert_eq!(
            parse_selector("app=vllm, tier = gpu").unwrap(),
            [("app".into(), "vllm".into()), ("tier".into(), "gpu".into())].into()
        );
        assert!(parse_selector("app").is_err());
        assert!(parse_selector("app!=x").is_err());
        assert!(parse_selector(" , ").is_err());
        assert_eq!(parse_selector("app==x").unwrap()["app"], "x");
    }

    #[test]
    fn ready_selected_pods_with_an_ip_are_replicas() {
        let selector = parse_selector("app=engine").unwrap();
        let mut terminating = (*pod("d", "4", Some("10.0.0.4"), true, "engine")).clone();
        terminating.metadata.deletion_timestamp = Some(
            k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(Default::default()),
        );
        let pods = vec![
            pod("b", "2", Some("10.0.0.2"), true, "engine"),
            pod("a", "1", Some("10.0.0.1"), true, "engine"),
            pod("c", "3", Some("10.0.0.3"), false, "engine"),
            Arc::new(terminating),
            pod("e", "5", None, true, "engine"),
            pod("f", "6", Some("10.0.0.6"), true, "other"),
        ];
        let found = replicas(&pods, &selector, &[8000], plain(1));
        let listed: Vec<(String, String)> = found
            .iter()
            .map(|f| (f.spec.id.clone().unwrap(), f.spec.addr.to_string()))
            .collect();
        assert_eq!(
            listed,
            [
                ("a".to_string(), "10.0.0.1:8000".to_string()),
                ("b".to_string(), "10.0.0.2:8000".to_string())
            ]
        );
        // Two ports: a replica per pod and port, ids tell them apart.
        let found = replicas(&pods, &selector, &[8000, 8001], plain(1));
        assert_eq!(found.len(), 4);
        assert_eq!(found[1].spec.id.as_deref(), Some("a:8001"));
        // Data-parallel ranks: each discovered replica carries them.
        let tls = Served {
            dp_ranks: 1,
            tls: true,
        };
        assert!(replicas(&pods, &selector, &[8000], tls)
            .iter()
            .all(|f| f.spec.tls));
        assert!(replicas(&pods, &selector, &[8000], plain(1))
            .iter()
            .all(|f| !f.spec.tls));
        let found = replicas(&pods, &selector, &[8000], plain(4));
        assert!(found.iter().all(|f| f.spec.dp_ranks == 4));
        // An empty selector selects nothing (never the whole namespace).
        assert!(replicas(&pods, &BTreeMap::new(), &[8000], plain(1)).is_empty());
    }

    #[test]
    fn a_pods_kv_event_annotations_are_taken_only_for_its_own_address() {
        let selector = parse_selector("app=engine").unwrap();
        let annotated = |name: &str, ip: &str, notes: &[(&str, &str)]| {
            let mut p = (*pod(name, name, Some(ip), true, "engine")).clone();
            p.metadata.annotations = Some(
                notes
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            );
            Arc::new(p)
        };
        let events = KV_EVENTS_ANNOTATION;
        let replay = KV_EVENTS_REPLAY_ANNOTATION;
        let pods = vec![
            annotated(
                "a",
                "10.0.0.1",
                &[(events, "tcp://*:5557"), (replay, "tcp://*:5558")],
            ),
            annotated("b", "10.0.0.2", &[(events, "auto")]),
            annotated("c", "10.0.0.3", &[(events, "tcp://10.0.0.3:5557")]),
            // Another pod's address, a Unix socket, a replay without a
            // feed, a replay with `auto`: not taken.
            annotated("d", "10.0.0.4", &[(events, "tcp://10.0.0.9:5557")]),
            annotated("e", "10.0.0.5", &[(events, "ipc:///tmp/kv.sock")]),
            annotated("f", "10.0.0.6", &[(replay, "tcp://*:5558")]),
            annotated(
                "g",
                "10.0.0.7",
                &[(events, "auto"), (replay, "tcp://*:5558")],
            ),
            annotated("h", "10.0.0.8", &[("other/kv-events", "tcp://*:5557")]),
        ];
        let found = replicas(&pods, &selector, &[8000], plain(1));
        let shown: Vec<(String, Option<String>, Option<String>, bool)> = found
            .iter()
            .map(|f| {
                (
                    f.spec.id.clone().unwrap(),
                    f.spec.kv_events.as_ref().map(|e| e.to_string()),
                    f.spec.kv_events_replay.as_ref().map(|e| e.to_string()),
                    f.refused_kv_events.is_some(),
                )
            })
            .collect();
        let some = |s: &str| Some(s.to_string());
        assert_eq!(
            shown,
            vec![
                (
                    "a".into(),
                    some("tcp://10.0.0.1:5557"),
                    some("tcp://10.0.0.1:5558"),
                    false
                ),
                ("b".into(), some("auto"), None, false),
                ("c".into(), some("tcp://10.0.0.3:5557"), None, false),
                ("d".into(), None, None, true),
                ("e".into(), None, None, true),
                ("f".into(), None, None, true),
                ("g".into(), None, None, true),
                ("h".into(), None, None, false),
            ]
        );
        assert!(found[3]
            .refused_kv_events
            .as_deref()
            .unwrap()
            .contains("not the engine's own address"));
        // Several engine ports: only `auto` tells their publishers apart.
        let two = replicas(&pods[..2], &selector, &[8000, 8001], plain(1));
        assert!(two[0]
            .refused_kv_events
            .as_deref()
            .unwrap()
            .contains("2 engine ports"));
        assert_eq!(two[2].spec.kv_events, Some(EventEndpoint::FromEngine));
        // With data-parallel ranks each rank reads the port plus its rank.
        let dp = replicas(&pods[..1], &selector, &[8000], plain(2));
        let targets = hearth_router::targets(&[dp[0].spec.clone()]);
        let per_rank: Vec<String> = targets
            .iter()
            .map(|t| t.kv_events.as_ref().unwrap().to_string())
            .collect();
        assert_eq!(per_rank, ["tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558"]);
        // Trimming a pod keeps these annotations and drops the others.
        let mut trimmed = (*annotated("t", "10.0.0.1", &[(events, "auto"), ("big", "x")])).clone();
        trim_pod(&mut trimmed);
        let kept: Vec<&String> = trimmed
            .metadata
            .annotations
            .as_ref()
            .unwrap()
            .keys()
            .collect();
        assert_eq!(kept, [KV_EVENTS_ANNOTATION]);
    }

    #[test]
    fn a_pool_without_a_selector_or_ports_names_no_replica() {
        assert!(pool_shape(None).is_err());
        let mut pool = InferencePool::default();
        assert!(pool_shape(Some(&pool)).unwrap_err().contains("selector"));
        pool.spec
            .selector
            .match_labels
            .insert("app".into(), "x".into());
        assert!(pool_shape(Some(&pool)).unwrap_err().contains("targetPorts"));
        pool.spec.target_ports.push(PoolPort { number: 70000 });
        assert!(pool_shape(Some(&pool)).is_err());
        pool.spec.target_ports.push(PoolPort { number: 8000 });
        assert_eq!(pool_shape(Some(&pool)).unwrap().1, [8000]);
    }

    #[test]
    fn an_address_taken_over_by_a_new_pod_starts_afresh() {
        let router = Router::new(hearth_router::RouterParams::default(), &[]);
        let mut applier = Applier::new(Arc::clone(&router), "test".into());
        let selector = parse_selector("app=engine").unwrap();
        applier.apply(
            replicas(
                &[pod("a", "1", Some("10.0.0.1"), true, "engine")],
                &selector,
                &[80],
                plain(1),
            ),
            None,
        );
        assert!(router.source().synced);
        let version = router.version();
        // The same list again: nothing applied.
        applier.apply(
            replicas(
                &[pod("a", "1", Some("10.0.0.1"), true, "engine")],
                &selector,
                &[80],
                plain(1),
            ),
            None,
        );
        assert_eq!(router.version(), version);
        // Pod b took over a's IP: removed, then added (two changes).
        applier.apply(
            replicas(
                &[pod("b", "2", Some("10.0.0.1"), true, "engine")],
                &selector,
                &[80],
                plain(1),
            ),
            None,
        );
        assert_eq!(router.version(), version + 2);
        let snap = router.snapshot();
        assert_eq!(snap.replicas.len(), 1);
        assert_eq!(snap.replicas[0].id, "b");
    }
}

//! A Kubernetes API server for tests, on loopback: the list and watch
//! protocol for pods and InferencePools in one namespace, as the real
//! server speaks it.
//!
//! - a list (`GET .../pods?labelSelector=...`) answers a `PodList` (or
//!   `InferencePoolList`) whose `metadata.resourceVersion` is the store's;
//! - a watch (`?watch=true&resourceVersion=N`) streams one JSON event per
//!   line (`ADDED`, `MODIFIED`, `DELETED`, and `BOOKMARK` when
//!   `allowWatchBookmarks=true`) for every change after `N`, and ends at
//!   `timeoutSeconds`;
//! - a watch from a version older than the last compaction gets an
//!   `ERROR` event with a 410 `Expired` Status, as a real server's does, so
//!   the client must relist; [`KubeApi::expire`] compacts and sends that
//!   to the open watches (410 mid-watch);
//! - [`KubeApi::set_down`] ends every open watch and closes the port
//!   until brought back on the same port (the API going away and coming
//!   back);
//! - with a token, a request without `authorization: Bearer TOKEN` gets
//!   401.
//!
//! Simplifications: selectors are equality only, and a watch filters
//! each event by the object's labels as they are after the change (a real
//! server sends a DELETED for an object that stops matching).
//! The objects are k8s-openapi's own `Pod`s; pools are plain JSON in the
//! CRD's shape.

#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use k8s_openapi::api::core::v1::{Pod, PodCondition, PodSpec, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use serde_json::{json, Value};
use tokio::sync::watch;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    Pod,
    Pool,
}

impl Kind {
    fn list_meta(self) -> (&'static str, &'static str, &'static str) {
        match self {
            Kind::Pod => ("v1", "PodList", "Pod"),
            Kind::Pool => (
                "inference.networking.k8s.io/v1",
                "InferencePoolList",
                "InferencePool",
            ),
        }
    }
}

struct Entry {
    rv: u64,
    kind: Kind,
    event: &'static str,
    object: Value,
}

#[derive(Default)]
struct Inner {
    rv: u64,
    objects: BTreeMap<(Kind, String), Value>,
    log: Vec<Entry>,
    /// Watches from a version below this get 410 Gone.
    floor: u64,
    /// Compactions so far: an open watch that sees one more gets 410.
    expirations: u64,
    down: bool,
    /// Requests seen: (path, query), for assertions on the protocol used.
    requests: Vec<(String, String)>,
}

struct Shared {
    namespace: String,
    token: Option<String>,
    inner: Mutex<Inner>,
    /// Bumped on every change, compaction and outage: open watches wake.
    tick: watch::Sender<u64>,
}

pub struct KubeApi {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    /// The server, while up: its task and what stops it.
    serving: Mutex<
        Option<(
            tokio::task::JoinHandle<()>,
            tokio::sync::oneshot::Sender<()>,
        )>,
    >,
}

impl Drop for KubeApi {
    fn drop(&mut self) {
        if let Some((task, _)) = self.serving.lock().unwrap().take() {
            task.abort();
        }
    }
}

/// Serves `shared` on `listener` until told to stop.
fn serve_on(
    listener: tokio::net::TcpListener,
    shared: &Arc<Shared>,
) -> (
    tokio::task::JoinHandle<()>,
    tokio::sync::oneshot::Sender<()>,
) {
    let app = axum::Router::new()
        .route("/api/v1/namespaces/{ns}/pods", get(pods))
        .route(
            "/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools",
            get(pools),
        )
        .with_state(Arc::clone(shared));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = stopped.await;
            })
            .await
            .unwrap();
    });
    (task, stop)
}

impl KubeApi {
    pub async fn start(namespace: &str, token: Option<&str>) -> KubeApi {
        let shared = Arc::new(Shared {
            namespace: namespace.into(),
            token: token.map(str::to_string),
            inner: Mutex::new(Inner {
                rv: 100,
                floor: 0,
                ..Inner::default()
            }),
            tick: watch::channel(0).0,
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let serving = Mutex::new(Some(serve_on(listener, &shared)));
        KubeApi {
            addr,
            shared,
            serving,
        }
    }

    /// A kubeconfig naming this server (plain http), with the token if set.
    pub fn kubeconfig(&self, dir: &std::path::Path) -> std::path::PathBuf {
        let user = match &self.shared.token {
            Some(t) => format!("    token: {t}\n"),
            None => "    {}\n".into(),
        };
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: http://{}\n\
             users:\n- name: test\n  user:\n{user}contexts:\n- name: test\n  context:\n    cluster: test\n    user: test\n    namespace: {}\n\
             current-context: test\n",
            self.addr, self.shared.namespace
        );
        let path = dir.join("kubeconfig");
        std::fs::write(&path, text).unwrap();
        path
    }

    fn change(&self, kind: Kind, name: &str, object: Option<Value>) {
        let mut inner = self.shared.inner.lock().unwrap();
        inner.rv += 1;
        let rv = inner.rv;
        let key = (kind, name.to_string());
        let (event, object) = match object {
            Some(mut o) => {
                o["metadata"]["resourceVersion"] = json!(rv.to_string());
                o["metadata"]["namespace"] = json!(self.shared.namespace);
                let event = if inner.objects.contains_key(&key) {
                    "MODIFIED"
                } else {
                    "ADDED"
                };
                inner.objects.insert(key, o.clone());
                (event, o)
            }
            None => {
                let Some(mut o) = inner.objects.remove(&key) else {
                    return;
                };
                o["metadata"]["resourceVersion"] = json!(rv.to_string());
                ("DELETED", o)
            }
        };
        inner.log.push(Entry {
            rv,
            kind,
            event,
            object,
        });
        drop(inner);
        self.shared.tick.send_modify(|t| *t += 1);
    }

    /// Creates or replaces a pod.
    pub fn put_pod(&self, pod: &Pod) {
        let name = pod.metadata.name.clone().unwrap();
        self.change(Kind::Pod, &name, Some(serde_json::to_value(pod).unwrap()));
    }

    pub fn delete_pod(&self, name: &str) {
        self.change(Kind::Pod, name, None);
    }

    /// Creates or replaces the InferencePool `name`.
    pub fn put_pool(&self, name: &str, match_labels: &[(&str, &str)], ports: &[u16]) {
        let labels: serde_json::Map<String, Value> = match_labels
            .iter()
            .map(|(k, v)| (k.to_string(), json!(v)))
            .collect();
        let pool = json!({
            "apiVersion": "inference.networking.k8s.io/v1",
            "kind": "InferencePool",
            "metadata": {"name": name, "uid": format!("pool-{name}")},
            "spec": {
                "selector": {"matchLabels": labels},
                "targetPorts": ports.iter().map(|p| json!({"number": p})).collect::<Vec<_>>(),
                "endpointPickerRef": {"name": "hearth", "port": {"number": 9002}},
            }
        });
        self.change(Kind::Pool, name, Some(pool));
    }

    pub fn delete_pool(&self, name: &str) {
        self.change(Kind::Pool, name, None);
    }

    /// Sends a BOOKMARK at the current version to the open watches that
    /// asked for bookmarks.
    pub fn bookmark(&self) {
        let mut inner = self.shared.inner.lock().unwrap();
        let rv = inner.rv;
        for kind in [Kind::Pod, Kind::Pool] {
            let (api_version, _, k) = kind.list_meta();
            inner.log.push(Entry {
                rv,
                kind,
                event: "BOOKMARK",
                object: json!({"apiVersion": api_version, "kind": k,
                               "metadata": {"resourceVersion": rv.to_string()}}),
            });
        }
        drop(inner);
        self.shared.tick.send_modify(|t| *t += 1);
    }

    /// Compacts history: every open watch gets a 410 ERROR event and ends,
    /// and a watch from an older version gets the same.
    pub fn expire(&self) {
        let mut inner = self.shared.inner.lock().unwrap();
        inner.floor = inner.rv;
        inner.expirations += 1;
        drop(inner);
        self.shared.tick.send_modify(|t| *t += 1);
    }

    /// Down: open watches end and the port is closed (connections are
    /// refused). Up: the same port is served again.
    pub async fn set_down(&self, down: bool) {
        self.shared.inner.lock().unwrap().down = down;
        self.shared.tick.send_modify(|t| *t += 1);
        if down {
            let serving = self.serving.lock().unwrap().take();
            if let Some((task, stop)) = serving {
                let _ = stop.send(());
                let _ = task.await;
            }
        } else if self.serving.lock().unwrap().is_none() {
            let listener = tokio::net::TcpListener::bind(self.addr).await.unwrap();
            *self.serving.lock().unwrap() = Some(serve_on(listener, &self.shared));
        }
    }

    /// Requests seen so far: (path, query).
    pub fn requests(&self) -> Vec<(String, String)> {
        self.shared.inner.lock().unwrap().requests.clone()
    }
}

/// A pod of the test fleet: labels `app=APP`, ready or not, with an IP.
pub fn pod(name: &str, uid: &str, ip: Option<&str>, ready: bool, app: &str) -> Pod {
    Pod {
        metadata: ObjectMeta {
            name: Some(name.into()),
            uid: Some(uid.into()),
            labels: Some([("app".to_string(), app.to_string())].into()),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec::default()),
        status: Some(PodStatus {
            phase: Some("Running".into()),
            pod_ip: ip.map(str::to_string),
            conditions: Some(vec![PodCondition {
                type_: "Ready".into(),
                status: if ready { "True" } else { "False" }.into(),
                ..PodCondition::default()
            }]),
            ..PodStatus::default()
        }),
    }
}

/// The same pod, being deleted (terminating).
pub fn terminating(mut pod: Pod) -> Pod {
    pod.metadata.deletion_timestamp = Some(Time(Default::default()));
    pod
}

fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": message, "reason": reason, "code": code})
}

fn selected(object: &Value, q: &HashMap<String, String>) -> bool {
    let labels = &object["metadata"]["labels"];
    let label_ok = q.get("labelSelector").is_none_or(|sel| {
        sel.split(',').filter(|p| !p.is_empty()).all(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            labels[k].as_str() == Some(v.trim_start_matches('='))
        })
    });
    let field_ok = q.get("fieldSelector").is_none_or(|sel| {
        sel.split(',')
            .filter(|p| !p.is_empty())
            .all(|p| match p.split_once('=') {
                Some(("metadata.name", v)) => object["metadata"]["name"].as_str() == Some(v),
                _ => false,
            })
    });
    label_ok && field_ok
}

async fn pods(
    State(s): State<Arc<Shared>>,
    Path(ns): Path<String>,
    Query(q): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Response {
    serve(s, Kind::Pod, ns, q, headers, "/pods").await
}

async fn pools(
    State(s): State<Arc<Shared>>,
    Path(ns): Path<String>,
    Query(q): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Response {
    serve(s, Kind::Pool, ns, q, headers, "/inferencepools").await
}

fn json_response(code: StatusCode, body: Value) -> Response {
    (
        code,
        [("content-type", "application/json")],
        body.to_string(),
    )
        .into_response()
}

async fn serve(
    s: Arc<Shared>,
    kind: Kind,
    ns: String,
    q: HashMap<String, String>,
    headers: HeaderMap,
    path: &str,
) -> Response {
    {
        let mut inner = s.inner.lock().unwrap();
        let mut query: Vec<String> = q.iter().map(|(k, v)| format!("{k}={v}")).collect();
        query.sort();
        inner.requests.push((path.to_string(), query.join("&")));
        if inner.down {
            return json_response(
                StatusCode::SERVICE_UNAVAILABLE,
                status(503, "ServiceUnavailable", "the server is down"),
            );
        }
    }
    if let Some(token) = &s.token {
        let sent = headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        if sent != format!("Bearer {token}") {
            return json_response(
                StatusCode::UNAUTHORIZED,
                status(401, "Unauthorized", "Unauthorized"),
            );
        }
    }
    if ns != s.namespace {
        let (api_version, list_kind, _) = kind.list_meta();
        let rv = s.inner.lock().unwrap().rv;
        return json_response(
            StatusCode::OK,
            json!({"apiVersion": api_version, "kind": list_kind,
                   "metadata": {"resourceVersion": rv.to_string()}, "items": []}),
        );
    }
    let watching = q.get("watch").is_some_and(|w| w == "true" || w == "1");
    if !watching {
        let inner = s.inner.lock().unwrap();
        let items: Vec<Value> = inner
            .objects
            .iter()
            .filter(|((k, _), o)| *k == kind && selected(o, &q))
            .map(|(_, o)| o.clone())
            .collect();
        let (api_version, list_kind, _) = kind.list_meta();
        return json_response(
            StatusCode::OK,
            json!({"apiVersion": api_version, "kind": list_kind,
                   "metadata": {"resourceVersion": inner.rv.to_string()}, "items": items}),
        );
    }
    let from: u64 = q
        .get("resourceVersion")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let bookmarks = q.get("allowWatchBookmarks").is_some_and(|b| b == "true");
    let timeout = q
        .get("timeoutSeconds")
        .and_then(|t| t.parse().ok())
        .unwrap_or(290u64);
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, Infallible>>(64);
    tokio::spawn(stream_events(s, kind, q, from, bookmarks, timeout, tx));
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/json")
        .body(Body::from_stream(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        ))
        .unwrap()
}

async fn stream_events(
    s: Arc<Shared>,
    kind: Kind,
    q: HashMap<String, String>,
    from: u64,
    bookmarks: bool,
    timeout: u64,
    tx: tokio::sync::mpsc::Sender<Result<Bytes, Infallible>>,
) {
    let mut tick = s.tick.subscribe();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(timeout);
    let gone = json!({"type": "ERROR",
        "object": status(410, "Expired", "too old resource version")});
    // Where this watch is in the log, and the compactions it has seen.
    let start = {
        let inner = s.inner.lock().unwrap();
        (from >= inner.floor).then(|| {
            let seen = inner.log.iter().take_while(|e| e.rv <= from).count();
            (seen, inner.expirations)
        })
    };
    let Some((mut seen, expirations)) = start else {
        let _ = tx.send(Ok(Bytes::from(format!("{gone}\n")))).await;
        return;
    };
    loop {
        let mut out = Vec::new();
        let mut end = false;
        {
            let inner = s.inner.lock().unwrap();
            if inner.down {
                end = true;
            } else if inner.expirations != expirations {
                out.push(gone.clone());
                end = true;
            } else {
                for e in inner.log[seen..].iter().filter(|e| e.kind == kind) {
                    if e.event == "BOOKMARK" {
                        if bookmarks {
                            out.push(json!({"type": "BOOKMARK", "object": e.object}));
                        }
                    } else if selected(&e.object, &q) {
                        out.push(json!({"type": e.event, "object": e.object}));
                    }
                }
                seen = inner.log.len();
            }
        }
        for v in out {
            if tx.send(Ok(Bytes::from(format!("{v}\n")))).await.is_err() {
                return;
            }
        }
        if end {
            return;
        }
        tokio::select! {
            changed = tick.changed() => if changed.is_err() { return },
            _ = tokio::time::sleep_until(deadline) => return,
        }
    }
}

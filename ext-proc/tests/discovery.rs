//! Discovery from the Kubernetes API (`HEARTH_DISCOVERY`), against the
//! loopback API server of `kubeapi/` (no real cluster here): the sidecar
//! reads a kubeconfig naming it, lists and watches, and its replica list,
//! `/state`, `/health` and gRPC health follow the pods; the kubeconfig's
//! token never shows in its log, at any level.
//!
//! Pod IPs are loopback addresses (127.0.0.x) on a closed port, and the
//! sidecar's probes and scrapes are off: nothing is dialled.

mod common;
mod kubeapi;

use std::path::PathBuf;
use std::time::Duration;

use hearth_ext_proc::config::Cli;
use hearth_ext_proc::Sidecar;
use kubeapi::{pod, terminating, KubeApi};
use tonic_health::pb::health_check_response::ServingStatus;

const NS: &str = "llm";

/// Discovery of the pods labelled `app=engine`, on port 8080.
const PODS_OF_APP_ENGINE: &[&str] = &[
    "--discovery",
    "pods",
    "--discovery-selector",
    "app=engine",
    "--discovery-port",
    "8080",
];

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("hearth-discovery-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

async fn sidecar(api: &KubeApi, name: &str, mode: &[&str]) -> Sidecar {
    let kubeconfig = api.kubeconfig(&scratch(name));
    let mut args = vec![
        "hearth-ext-proc",
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
        "--probe-interval-seconds",
        "0",
        "--engine-metrics-seconds",
        "0",
        "--kubeconfig",
        kubeconfig.to_str().unwrap(),
    ];
    args.extend_from_slice(mode);
    let settings = <Cli as clap::Parser>::try_parse_from(args)
        .unwrap()
        .settings;
    settings.validate().unwrap();
    Sidecar::start(&settings).await.unwrap()
}

const POOL: &[&str] = &["--discovery", "inferencepool", "--inference-pool", "pool"];

/// The replicas as (id, address), in list order.
fn listed(sidecar: &Sidecar) -> Vec<(String, String)> {
    sidecar
        .router
        .snapshot()
        .replicas
        .into_iter()
        .map(|r| (r.id, r.address))
        .collect()
}

fn pairs(expected: &[(&str, &str)]) -> Vec<(String, String)> {
    expected
        .iter()
        .map(|(i, a)| (i.to_string(), a.to_string()))
        .collect()
}

/// Waits (at most 10 s) until `check` holds; panics with what it saw.
async fn until<T: std::fmt::Debug>(
    what: &str,
    mut probe: impl FnMut() -> T,
    check: impl Fn(&T) -> bool,
) -> T {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let seen = probe();
        if check(&seen) {
            return seen;
        }
        if tokio::time::Instant::now() > deadline {
            panic!("{what}: still {seen:?} after 10 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn until_listed(sidecar: &Sidecar, what: &str, expected: &[(&str, &str)]) {
    let expected = pairs(expected);
    until(what, || listed(sidecar), |l| *l == expected).await;
}

async fn grpc_health(sidecar: &Sidecar, service: &str) -> ServingStatus {
    let channel = tonic::transport::Channel::from_shared(format!("http://{}", sidecar.grpc_addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let answer = tonic_health::pb::health_client::HealthClient::new(channel)
        .check(tonic_health::pb::HealthCheckRequest {
            service: service.into(),
        })
        .await
        .unwrap()
        .into_inner();
    ServingStatus::try_from(answer.status).unwrap()
}

async fn http_health(sidecar: &Sidecar) -> String {
    let body = reqwest::get(format!("http://{}/health", sidecar.admin_addr))
        .await
        .unwrap()
        .json::<serde_json::Value>()
        .await
        .unwrap();
    body["status"].as_str().unwrap().to_string()
}

#[tokio::test]
async fn a_pool_follows_its_pods_through_readiness_scaling_and_a_rollout() {
    let api = KubeApi::start(NS, None).await;
    api.put_pool("pool", &[("app", "engine")], &[8000]);
    api.put_pod(&pod("a", "uid-a", None, false, "engine"));
    api.put_pod(&pod("x", "uid-x", Some("127.0.0.90"), true, "other"));
    let sidecar = sidecar(&api, "rollout", POOL).await;

    // Synced with no ready pod: an empty fleet, ready to answer (503s).
    until("synced", || sidecar.router.source(), |s| s.synced).await;
    assert!(listed(&sidecar).is_empty());
    assert_eq!(sidecar.router.source().name, "inferencepool llm/pool");

    // Pod a gets its IP, then becomes ready.
    api.put_pod(&pod("a", "uid-a", Some("127.0.0.11"), false, "engine"));
    api.put_pod(&pod("a", "uid-a", Some("127.0.0.11"), true, "engine"));
    until_listed(&sidecar, "a ready", &[("a", "127.0.0.11:8000")]).await;

    // Its state: some warmth that must survive what follows.
    sidecar.router.record_served_elsewhere(0, &[1, 2, 3]);
    let warmth_of_a = |s: &Sidecar| {
        s.router
            .snapshot()
            .replicas
            .iter()
            .find(|r| r.id == "a")
            .map(|r| r.warmth_blocks)
    };
    assert_eq!(warmth_of_a(&sidecar), Some(3));

    // Scale up to three.
    api.put_pod(&pod("b", "uid-b", Some("127.0.0.12"), true, "engine"));
    api.put_pod(&pod("c", "uid-c", Some("127.0.0.13"), true, "engine"));
    until_listed(
        &sidecar,
        "scaled up",
        &[
            ("a", "127.0.0.11:8000"),
            ("b", "127.0.0.12:8000"),
            ("c", "127.0.0.13:8000"),
        ],
    )
    .await;
    assert_eq!(
        warmth_of_a(&sidecar),
        Some(3),
        "a stayed, so did its warmth"
    );

    // Scale down: c terminates (gone at once), then is deleted; b stops
    // being ready.
    api.put_pod(&terminating(pod(
        "c",
        "uid-c",
        Some("127.0.0.13"),
        true,
        "engine",
    )));
    until_listed(
        &sidecar,
        "c terminating",
        &[("a", "127.0.0.11:8000"), ("b", "127.0.0.12:8000")],
    )
    .await;
    api.delete_pod("c");
    api.put_pod(&pod("b", "uid-b", Some("127.0.0.12"), false, "engine"));
    until_listed(&sidecar, "b not ready", &[("a", "127.0.0.11:8000")]).await;
    assert_eq!(warmth_of_a(&sidecar), Some(3));

    // A rollout replaces every pod: new ones come up, the old ones go.
    for (name, ip) in [("d", "127.0.0.21"), ("e", "127.0.0.22")] {
        api.put_pod(&pod(name, &format!("uid-{name}"), Some(ip), true, "engine"));
    }
    api.put_pod(&terminating(pod(
        "a",
        "uid-a",
        Some("127.0.0.11"),
        true,
        "engine",
    )));
    api.delete_pod("a");
    api.delete_pod("b");
    until_listed(
        &sidecar,
        "rolled out",
        &[("d", "127.0.0.21:8000"), ("e", "127.0.0.22:8000")],
    )
    .await;

    // A new pod takes over a deleted pod's IP: a new replica, cold.
    sidecar.router.record_served_elsewhere(0, &[7, 8]);
    api.delete_pod("d");
    api.put_pod(&pod("f", "uid-f", Some("127.0.0.21"), true, "engine"));
    until_listed(
        &sidecar,
        "IP reused",
        &[("e", "127.0.0.22:8000"), ("f", "127.0.0.21:8000")],
    )
    .await;
    let f = sidecar
        .router
        .snapshot()
        .replicas
        .into_iter()
        .find(|r| r.id == "f")
        .unwrap();
    assert_eq!(
        f.warmth_blocks, 0,
        "the old pod's warmth is not the new pod's"
    );

    // Watched, not polled: one list per watched kind, then watches.
    let requests = api.requests();
    let lists = requests
        .iter()
        .filter(|(_, q)| !q.contains("watch=true"))
        .count();
    let watches = requests
        .iter()
        .filter(|(_, q)| q.contains("watch=true"))
        .count();
    assert_eq!(lists, 2, "{requests:?}");
    assert!(watches >= 2, "{requests:?}");
    sidecar.shutdown().await.unwrap();
}

#[tokio::test]
async fn readiness_waits_for_the_first_list_and_a_lost_api_keeps_the_last_one() {
    let api = KubeApi::start(NS, None).await;
    api.put_pool("pool", &[("app", "engine")], &[8000]);
    api.put_pod(&pod("a", "uid-a", Some("127.0.0.11"), true, "engine"));
    api.set_down(true).await;
    let sidecar = sidecar(&api, "outage", POOL).await;

    // No list yet: alive, not ready.
    assert_eq!(
        grpc_health(&sidecar, "liveness").await,
        ServingStatus::Serving
    );
    until("lost", || sidecar.router.source(), |s| !s.connected).await;
    assert_eq!(
        grpc_health(&sidecar, "readiness").await,
        ServingStatus::NotServing
    );
    assert!(!sidecar.router.source().synced);

    // The API comes up: the list arrives, readiness follows.
    api.set_down(false).await;
    until_listed(&sidecar, "first list", &[("a", "127.0.0.11:8000")]).await;
    let mut ready = ServingStatus::NotServing;
    for _ in 0..100 {
        ready = grpc_health(&sidecar, "readiness").await;
        if ready == ServingStatus::Serving {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(ready, ServingStatus::Serving);
    assert_eq!(
        grpc_health(&sidecar, "envoy.service.ext_proc.v3.ExternalProcessor").await,
        ServingStatus::Serving
    );
    until("connected", || sidecar.router.source(), |s| s.connected).await;
    assert_eq!(http_health(&sidecar).await, "ok");

    // The API goes away: the list stays, /state and /health say so.
    api.set_down(true).await;
    until("lost again", || sidecar.router.source(), |s| !s.connected).await;
    let state: serde_json::Value = reqwest::get(format!("http://{}/state", sidecar.admin_addr))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(state["upstreams"]["source"]["connected"], false);
    assert!(state["upstreams"]["source"]["error"].is_string(), "{state}");
    assert_eq!(http_health(&sidecar).await, "degraded");
    let metrics = reqwest::get(format!("http://{}/metrics", sidecar.admin_addr))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("\nhearth_replica_source_connected 0"),
        "{metrics}"
    );
    assert!(
        metrics.contains("\nhearth_replica_source_disconnects_total 2\n"),
        "{metrics}"
    );
    assert_eq!(listed(&sidecar), pairs(&[("a", "127.0.0.11:8000")]));
    assert_eq!(
        grpc_health(&sidecar, "readiness").await,
        ServingStatus::Serving
    );

    // Changes made while it was away arrive when it comes back.
    api.put_pod(&pod("b", "uid-b", Some("127.0.0.12"), true, "engine"));
    api.set_down(false).await;
    until_listed(
        &sidecar,
        "resumed",
        &[("a", "127.0.0.11:8000"), ("b", "127.0.0.12:8000")],
    )
    .await;
    until(
        "connected again",
        || sidecar.router.source(),
        |s| s.connected,
    )
    .await;
    assert!(sidecar.router.source().disconnects_total >= 2);
    assert_eq!(http_health(&sidecar).await, "ok");
    sidecar.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_410_mid_watch_relists_and_bookmarks_keep_the_watch() {
    let api = KubeApi::start(NS, None).await;
    api.put_pool("pool", &[("app", "engine")], &[8000]);
    api.put_pod(&pod("a", "uid-a", Some("127.0.0.11"), true, "engine"));
    let sidecar = sidecar(&api, "gone", POOL).await;
    until_listed(&sidecar, "start", &[("a", "127.0.0.11:8000")]).await;

    api.bookmark();
    api.put_pod(&pod("b", "uid-b", Some("127.0.0.12"), true, "engine"));
    until_listed(
        &sidecar,
        "after a bookmark",
        &[("a", "127.0.0.11:8000"), ("b", "127.0.0.12:8000")],
    )
    .await;

    // The watches asked for bookmarks (and so got the one sent).
    assert!(api
        .requests()
        .iter()
        .filter(|(_, q)| q.contains("watch=true"))
        .all(|(_, q)| q.contains("allowWatchBookmarks=true")));
    let lists_before = api
        .requests()
        .iter()
        .filter(|(_, q)| !q.contains("watch=true"))
        .count();
    // History compacted: the open watches get 410 Gone; what changed
    // meanwhile comes with the relist.
    api.expire();
    api.delete_pod("a");
    until_listed(&sidecar, "after 410", &[("b", "127.0.0.12:8000")]).await;
    let lists_after = api
        .requests()
        .iter()
        .filter(|(_, q)| !q.contains("watch=true"))
        .count();
    assert!(lists_after > lists_before, "a 410 forces a relist");
    // A 410 is not an outage.
    assert!(sidecar.router.source().connected);
    assert_eq!(sidecar.router.source().disconnects_total, 0);
    sidecar.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_pool_whose_selector_changes_moves_to_the_pods_it_selects() {
    let api = KubeApi::start(NS, None).await;
    api.put_pool("pool", &[("app", "blue")], &[8000]);
    api.put_pod(&pod("b1", "uid-b1", Some("127.0.0.11"), true, "blue"));
    api.put_pod(&pod("g1", "uid-g1", Some("127.0.0.21"), true, "green"));
    let sidecar = sidecar(&api, "selector", POOL).await;
    until_listed(&sidecar, "blue", &[("b1", "127.0.0.11:8000")]).await;

    api.put_pool("pool", &[("app", "green")], &[9000]);
    until_listed(&sidecar, "green", &[("g1", "127.0.0.21:9000")]).await;

    // A selector that matches nothing: an empty fleet, not a crash.
    api.put_pool("pool", &[("app", "nobody")], &[9000]);
    until_listed(&sidecar, "nobody", &[]).await;
    // The pool deleted: empty too; recreated: back.
    api.put_pool("pool", &[("app", "green")], &[9000]);
    until_listed(&sidecar, "green", &[("g1", "127.0.0.21:9000")]).await;
    api.delete_pool("pool");
    until_listed(&sidecar, "no pool", &[]).await;
    api.put_pool("pool", &[("app", "green")], &[9000]);
    until_listed(&sidecar, "green again", &[("g1", "127.0.0.21:9000")]).await;
    assert!(sidecar.router.source().connected);
    sidecar.shutdown().await.unwrap();
}

#[tokio::test]
async fn pods_by_label_selector_with_a_token() {
    let api = KubeApi::start(NS, Some("s3cret-token")).await;
    api.put_pod(&pod("a", "uid-a", Some("127.0.0.11"), true, "engine"));
    api.put_pod(&pod("z", "uid-z", Some("127.0.0.19"), true, "other"));
    let sidecar = sidecar(&api, "pods", PODS_OF_APP_ENGINE).await;
    until_listed(&sidecar, "selected", &[("a", "127.0.0.11:8080")]).await;
    assert_eq!(
        sidecar.router.source().name,
        "pods llm app=engine port 8080"
    );
    api.put_pod(&pod("b", "uid-b", Some("127.0.0.12"), true, "engine"));
    until_listed(
        &sidecar,
        "scaled",
        &[("a", "127.0.0.11:8080"), ("b", "127.0.0.12:8080")],
    )
    .await;
    // The selector went to the server.
    assert!(api
        .requests()
        .iter()
        .all(|(_, q)| q.contains("labelSelector=app=engine")));
    sidecar.shutdown().await.unwrap();
}

/// A pod's `hearth/kv-events` annotation names its engine's event feed,
/// and is taken only where it is the pod's own address: a pod pointing
/// at another host is a replica without a feed.
#[tokio::test]
async fn a_pods_kv_event_annotation_names_its_own_feed_only() {
    let api = KubeApi::start(NS, None).await;
    let annotated = |name: &str, ip: &str, endpoint: &str| {
        let mut p = pod(name, &format!("uid-{name}"), Some(ip), true, "engine");
        p.metadata.annotations = Some(
            [(
                hearth_ext_proc::feeds::kube::KV_EVENTS_ANNOTATION.to_string(),
                endpoint.to_string(),
            )]
            .into(),
        );
        p
    };
    api.put_pod(&annotated("a", "127.0.0.11", "tcp://*:5557"));
    api.put_pod(&annotated("b", "127.0.0.12", "tcp://127.0.0.99:5557"));
    let sidecar = sidecar(&api, "pods-kv", PODS_OF_APP_ENGINE).await;
    until_listed(
        &sidecar,
        "selected",
        &[("a", "127.0.0.11:8080"), ("b", "127.0.0.12:8080")],
    )
    .await;
    let feeds: Vec<(String, String)> = sidecar
        .router
        .kv_event_endpoints()
        .iter()
        .map(|s| (s.addr().to_string(), s.endpoint.to_string()))
        .collect();
    assert_eq!(
        feeds,
        [(
            "127.0.0.11:8080".to_string(),
            "tcp://127.0.0.11:5557".to_string()
        )]
    );
    sidecar.shutdown().await.unwrap();
}

#[test]
fn an_unreadable_kubeconfig_stops_the_sidecar_naming_the_setting() {
    let (code, stderr) = common::run(
        &[
            ("HEARTH_DISCOVERY", "pods"),
            ("HEARTH_DISCOVERY_SELECTOR", "app=engine"),
            ("HEARTH_DISCOVERY_PORT", "8000"),
            ("HEARTH_KUBECONFIG", "/nonexistent/kubeconfig"),
        ],
        &[],
    );
    assert_ne!(code, 0, "{stderr}");
    assert!(
        stderr.contains("HEARTH_KUBECONFIG /nonexistent/kubeconfig"),
        "{stderr}"
    );
    // Discovery beside a list: refused before anything starts.
    let (code, stderr) = common::run(
        &[
            ("HEARTH_DISCOVERY", "pods"),
            ("HEARTH_UPSTREAMS", "127.0.0.1:1"),
        ],
        &[],
    );
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("--discovery") || stderr.contains("HEARTH_DISCOVERY"),
        "{stderr}"
    );
}

/// Runs the sidecar binary on discovery with `kubeconfig` and `log` until
/// its standard error shows `until` and the API has seen two more requests
/// (the list and the watch, or a retry): that standard error.
async fn log_of_a_run(
    api: &KubeApi,
    kubeconfig: &std::path::Path,
    log: &str,
    until: &str,
) -> String {
    use std::io::Read;
    let seen = api.requests().len();
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_hearth-ext-proc"));
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("HEARTH_")) {
        cmd.env_remove(k);
    }
    let mut child = cmd
        .envs([
            ("HEARTH_DISCOVERY", "pods"),
            ("HEARTH_DISCOVERY_SELECTOR", "app=engine"),
            ("HEARTH_DISCOVERY_PORT", "8000"),
            ("HEARTH_KUBECONFIG", kubeconfig.to_str().unwrap()),
            ("HEARTH_LISTEN", "127.0.0.1:0"),
            ("HEARTH_ADMIN_LISTEN", "127.0.0.1:0"),
            ("HEARTH_PROBE_INTERVAL_SECONDS", "0"),
            ("HEARTH_ENGINE_METRICS_SECONDS", "0"),
            ("HEARTH_LOG", log),
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let text = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let mut stderr = child.stderr.take().unwrap();
    let reader = {
        let text = std::sync::Arc::clone(&text);
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n @ 1..) = stderr.read(&mut buf) {
                text.lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        })
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !(text.lock().unwrap().contains(until) && api.requests().len() >= seen + 2) {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{log}: no {until:?} and {} requests within 30 s: {}",
                api.requests().len() - seen,
                text.lock().unwrap()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    child.kill().unwrap();
    child.wait().unwrap();
    reader.join().unwrap();
    let text = text.lock().unwrap().clone();
    text
}

#[tokio::test]
async fn the_kubeconfigs_token_never_reaches_the_log() {
    const TOKEN: &str = "s3cret-kube-token-0123456789";
    let api = KubeApi::start(NS, Some(TOKEN)).await;
    api.put_pod(&pod("a", "uid-a", Some("127.0.0.11"), true, "engine"));
    let dir = scratch("log");
    let accepted = api.kubeconfig(&dir);
    let refused = dir.join("refused-kubeconfig");
    let wrong = "wr0ng-kube-token-0123456789";
    std::fs::write(
        &refused,
        std::fs::read_to_string(&accepted)
            .unwrap()
            .replace(TOKEN, wrong),
    )
    .unwrap();
    for log in ["info", "debug", "trace"] {
        let stderr = log_of_a_run(&api, &accepted, log, "serving").await;
        assert!(!stderr.contains(TOKEN), "{log}: {stderr}");
        // Refused by the API: the error is logged, the token is not.
        let stderr = log_of_a_run(&api, &refused, log, "401").await;
        assert!(!stderr.contains(wrong), "{log}: {stderr}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

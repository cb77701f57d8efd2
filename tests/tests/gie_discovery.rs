//! Hearth as an endpoint picker that finds its replicas itself: the real
//! Envoy in the Inference Extension's reference shape (`envoy-config
//! --mode gie`), the sidecar with `HEARTH_DISCOVERY=inferencepool`
//! reading the loopback Kubernetes API server of `ext-proc/tests/kubeapi`
//! (no real cluster here), and simulated engines as the pool's pods: each
//! on its own loopback IP, all on the pool's one target port, as pods are.
//!
//! A rollout replaces every pod while traffic flows: no request fails,
//! and conversations stay on the pods that stay; a pool left with no
//! ready pod answers 503 (the protocol's "no ready endpoints").

#[path = "../../ext-proc/tests/kubeapi/mod.rs"]
mod kubeapi;

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hearth_bench::engine::{self, EngineConfig, EngineHandle};
use hearth_bench::gateway::{find_wasm, Envoy};
use hearth_e2e::{filler, reply_text, Conversation, Home, Turn, MODEL};
use hearth_ext_proc::config::Cli;
use hearth_ext_proc::envoy::render::{render_gie, Gateway};
use hearth_ext_proc::Sidecar;
use kubeapi::{pod, terminating, KubeApi};

const PODS: usize = 4;

fn pod_ip(i: usize) -> IpAddr {
    IpAddr::from([127, 0, 0, 40 + i as u8])
}

/// `PODS` engines, engine `i` on `pod_ip(i)`, all on one port.
async fn engines_on_one_port() -> (Vec<EngineHandle>, u16) {
    for _ in 0..20 {
        let first = tokio::net::TcpListener::bind(SocketAddr::new(pod_ip(0), 0))
            .await
            .unwrap();
        let port = first.local_addr().unwrap().port();
        let mut listeners = vec![first];
        for i in 1..PODS {
            match tokio::net::TcpListener::bind(SocketAddr::new(pod_ip(i), port)).await {
                Ok(l) => listeners.push(l),
                Err(_) => break,
            }
        }
        if listeners.len() < PODS {
            continue;
        }
        let mut engines = Vec::new();
        for (i, listener) in listeners.into_iter().enumerate() {
            let config = EngineConfig {
                id: format!("pod-{i}"),
                model: MODEL.into(),
                ..EngineConfig::default()
            };
            engines.push(engine::spawn(config, listener).await.unwrap());
        }
        return (engines, port);
    }
    panic!("no port free on {PODS} loopback addresses in 20 tries");
}

fn ready(i: usize) -> k8s_openapi::api::core::v1::Pod {
    pod(
        &format!("pod-{i}"),
        &format!("uid-{i}"),
        Some(&pod_ip(i).to_string()),
        true,
        "engine",
    )
}

async fn post(client: &reqwest::Client, envoy: &Envoy, body: &serde_json::Value) -> Turn {
    let resp = client
        .post(format!("{}/v1/chat/completions", envoy.url()))
        .header("content-type", "application/json")
        .body(serde_json::to_vec(body).unwrap())
        .send()
        .await
        .expect("request through Envoy");
    let status = resp.status().as_u16();
    let header = |name: &str| {
        resp.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let (engine, upstream) = (header("x-engine-id"), header("x-hearth-upstream"));
    let text = resp.text().await.unwrap();
    let body = serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text));
    Turn {
        status,
        engine,
        upstream,
        body,
    }
}

/// Waits (at most 10 s) until the sidecar lists exactly these pods.
async fn until_listed(sidecar: &Sidecar, pods: &[usize]) {
    let want: Vec<String> = pods.iter().map(|i| format!("pod-{i}")).collect();
    for _ in 0..500 {
        let ids: Vec<String> = sidecar
            .router
            .snapshot()
            .replicas
            .into_iter()
            .map(|r| r.id)
            .collect();
        if ids == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!(
        "the sidecar does not list {want:?}: {:?}",
        sidecar.router.snapshot().replicas
    );
}

/// A conversation and where it lives.
struct Session {
    conv: Conversation,
    home: Home,
}

impl Session {
    async fn turn(&mut self, client: &reqwest::Client, envoy: &Envoy) {
        let t = post(client, envoy, &self.conv.next_turn(2000, false)).await;
        self.home.check(&t, 0);
        self.conv.push_assistant(&reply_text(&t.body));
        self.conv.push_tool_round(1000);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollout_under_traffic_fails_no_request_and_keeps_sessions_on_pods_that_stay() {
    let (engines, port) = engines_on_one_port().await;
    let api = KubeApi::start("inference", None).await;
    api.put_pool("engines", &[("app", "engine")], &[port]);
    api.put_pod(&ready(0));
    api.put_pod(&ready(1));

    let dir = std::env::temp_dir().join(format!("hearth-gie-discovery-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let kubeconfig = api.kubeconfig(&dir);
    let settings = <Cli as clap::Parser>::try_parse_from([
        "hearth-ext-proc",
        "--listen=127.0.0.1:0",
        "--admin-listen=127.0.0.1:0",
        "--drain-seconds=1",
        "--discovery=inferencepool",
        "--inference-pool=engines",
        &format!("--kubeconfig={}", kubeconfig.display()),
    ])
    .unwrap()
    .settings;
    settings.validate().unwrap();
    let sidecar = Sidecar::start(&settings).await.unwrap();
    until_listed(&sidecar, &[0, 1]).await;
    let gateway = Gateway::local(
        "127.0.0.1:0".parse().unwrap(),
        sidecar.grpc_addr,
        sidecar.admin_addr,
        Vec::new(),
        find_wasm().unwrap().canonicalize().unwrap(),
    );
    let envoy = Arc::new(
        Envoy::start(&render_gie(&gateway), Duration::from_secs(60))
            .await
            .unwrap(),
    );
    let client = reqwest::Client::new();

    // Conversations, each settled on pod-0 or pod-1.
    let mut sessions: Vec<Session> = (0..6u64)
        .map(|s| Session {
            conv: Conversation::new(
                MODEL,
                &format!("{} tenant {s}", filler(s, 20_000)),
                true,
                900 + s,
            ),
            home: Home::new(format!("session {s}")),
        })
        .collect();
    for s in sessions.iter_mut() {
        s.turn(&client, &envoy).await;
        s.turn(&client, &envoy).await;
    }

    // Traffic all along: new conversations, one after another on each of
    // four connections (bounded).
    let stop = Arc::new(AtomicBool::new(false));
    let background: Vec<_> = (0..4u64)
        .map(|lane| {
            let (stop, envoy, client) = (Arc::clone(&stop), Arc::clone(&envoy), client.clone());
            tokio::spawn(async move {
                let mut statuses = Vec::new();
                for n in 0..2_000u64 {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let seed = lane * 100_000 + n;
                    let mut conv = Conversation::new(MODEL, &filler(seed, 4_000), false, seed);
                    let t = post(&client, &envoy, &conv.next_turn(200, false)).await;
                    statuses.push((t.status, t.engine));
                }
                statuses
            })
        })
        .collect();

    // The rollout, one pod at a time (maxSurge 1, maxUnavailable 0): a new
    // pod becomes ready, then an old one terminates and is deleted; its
    // engine stops once nothing runs on it.
    let mut engines: Vec<Option<EngineHandle>> = engines.into_iter().map(Some).collect();
    let mut live = vec![0, 1];
    for (new, old, stays) in [(2, 0, 1), (3, 1, 2)] {
        api.put_pod(&ready(new));
        live.push(new);
        until_listed(&sidecar, &live).await;
        api.put_pod(&terminating(ready(old)));
        live.retain(|&i| i != old);
        until_listed(&sidecar, &live).await;
        // Conversations at home on the pod that stays keep their home;
        // those of the pod going find a new one.
        for s in sessions.iter_mut() {
            if s.home.engine() == Some(&format!("pod-{old}")) {
                s.home = Home::new("moved");
                s.conv.push_tool_round(10);
            }
            s.turn(&client, &envoy).await;
        }
        let stayed = sessions
            .iter()
            .filter(|s| s.home.engine() == Some(&format!("pod-{stays}")))
            .count();
        assert!(stayed > 0, "no conversation lived on pod-{stays}");
        api.delete_pod(&format!("pod-{old}"));
        for _ in 0..500 {
            if sidecar.router.snapshot().upstreams.draining_in_flight == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        engines[old] = None;
    }
    for s in sessions.iter_mut() {
        s.turn(&client, &envoy).await;
    }
    stop.store(true, Ordering::Relaxed);
    let mut statuses = Vec::new();
    for lane in background {
        statuses.extend(lane.await.unwrap());
    }
    let failed: Vec<_> = statuses.iter().filter(|(s, _)| *s != 200).collect();
    assert!(
        failed.is_empty(),
        "{} of {} requests failed during the rollout: {failed:?}\n{}",
        failed.len(),
        statuses.len(),
        envoy.log()
    );
    assert!(
        statuses.len() >= 10,
        "too little traffic: {}",
        statuses.len()
    );
    // The new pods served; the old ones are gone.
    let turns = post(&client, &envoy, &sessions[0].conv.next_turn(10, false)).await;
    let engine = turns.engine.unwrap_or_default();
    assert!(engine == "pod-2" || engine == "pod-3", "{engine}");
    // A pool with no ready pod: the picker answers 503 (no ready
    // endpoint), through Envoy.
    for i in [2, 3] {
        api.delete_pod(&format!("pod-{i}"));
    }
    until_listed(&sidecar, &[]).await;
    let t = post(&client, &envoy, &sessions[0].conv.next_turn(10, false)).await;
    assert_eq!(t.status, 503, "{:?}", t.body);
    assert_eq!(
        t.body["error"]["code"], "no_healthy_replica",
        "{:?}",
        t.body
    );
    println!(
        "rollout: {} requests during it, none failed",
        statuses.len()
    );
    drop(engines);
    let _ = std::fs::remove_dir_all(&dir);
}

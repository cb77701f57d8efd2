//! Health through the real Envoy: replicas that stop generating, answer
//! 200 with nothing in them, or fail with 503 stop getting traffic.

use std::time::{Duration, Instant};

use hearth_bench::engine::Fault;
use hearth_e2e::{filler, reply_text, Conversation, Fleet, FleetOptions, MODEL};
use serde_json::Value;

fn flags(extra: &[&str]) -> FleetOptions {
    FleetOptions {
        engines: 3,
        sidecar_flags: extra.iter().map(|s| s.to_string()).collect(),
        ..FleetOptions::default()
    }
}

async fn sidecar_health(fleet: &Fleet) -> (u16, String) {
    let (status, body) = fleet.admin_get("/health").await.unwrap();
    let v: Value = serde_json::from_str(&body).unwrap();
    (status, v["status"].as_str().unwrap_or_default().to_string())
}

/// Waits until `cond` holds on the sidecar's state; panics with the state
/// after `deadline`. Returns how long it took.
async fn wait_for(
    fleet: &Fleet,
    deadline: Duration,
    what: &str,
    cond: impl Fn(&hearth_router::Snapshot) -> bool,
) -> Duration {
    let start = Instant::now();
    loop {
        let s = fleet.state().await.unwrap();
        if cond(&s) {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < deadline,
            "{what} not reached within {deadline:?}: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn fenced(s: &hearth_router::Snapshot, id: &str) -> bool {
    s.replicas
        .iter()
        .any(|r| r.id == id && r.health.state == hearth_router::health::HealthState::Fenced)
}

#[tokio::test]
async fn a_replica_that_never_generates_is_fenced_by_probes_and_readmitted_when_it_recovers() {
    let fleet = Fleet::start(flags(&[
        "--probe-interval-seconds=0.2",
        "--probe-timeout-seconds=0.5",
        "--eject-backoff-seconds=1",
        "--busy-grace-seconds=0.5",
    ]))
    .await
    .unwrap();
    assert_eq!(sidecar_health(&fleet).await, (200, "ok".to_string()));
    fleet.engines[1].engine.set_fault(Fault::Stall);
    let took = wait_for(&fleet, Duration::from_secs(20), "engine-1 fenced", |s| {
        fenced(s, "engine-1")
    })
    .await;
    eprintln!("stalled replica fenced after {took:?}");
    assert_eq!(sidecar_health(&fleet).await, (200, "degraded".to_string()));

    // No request reaches the stalled replica any more; all succeed.
    for s in 0..24u64 {
        let mut conv = Conversation::new(MODEL, &filler(s, 1024), false, 900 + s);
        let t = fleet.chat(&conv.next_turn(500, false)).await;
        assert_ne!(
            t.engine.as_deref(),
            Some("engine-1"),
            "request {s} went to the fenced replica"
        );
    }

    fleet.engines[1].engine.set_fault(Fault::None);
    wait_for(
        &fleet,
        Duration::from_secs(20),
        "engine-1 readmitted",
        |s| !fenced(s, "engine-1"),
    )
    .await;
    assert_eq!(sidecar_health(&fleet).await, (200, "ok".to_string()));
    fleet.assert_wasm_healthy();
}

#[tokio::test]
async fn a_replica_that_answers_200_with_nothing_is_fenced_by_its_probes() {
    broken_engine_fenced_by_probes(FleetOptions::default()).await;
}

#[tokio::test]
async fn a_replica_that_answers_200_with_nothing_is_fenced_in_the_endpoint_picker_shape() {
    // No wasm filter: the sidecar scans the response bodies itself (as in
    // body mode, below).
    broken_engine_fenced_by_probes(FleetOptions {
        gie_mode: true,
        ..FleetOptions::default()
    })
    .await;
}

#[tokio::test]
async fn a_replica_that_answers_200_with_nothing_is_fenced_in_body_mode() {
    broken_engine_fenced_by_probes(FleetOptions {
        body_mode: true,
        ..FleetOptions::default()
    })
    .await;
}

/// Idle probes once a minute; suspicion probes and retries quickly.
const QUICK_PROBES: [&str; 5] = [
    "--probe-interval-seconds=60",
    "--probe-retry-seconds=0.2",
    "--suspect-probe-seconds=0.2",
    "--probe-timeout-seconds=2",
    "--eject-after=3",
];

/// `engines` engines of `shape` with [`QUICK_PROBES`], each past its
/// start-up probe.
async fn quick_probed_fleet(engines: usize, shape: FleetOptions) -> Fleet {
    let fleet = Fleet::start(FleetOptions {
        engines,
        sidecar_flags: QUICK_PROBES.iter().map(|f| f.to_string()).collect(),
        ..shape
    })
    .await
    .unwrap();
    probed_once(&fleet).await;
    fleet
}

/// Waits until every engine passed its start-up probe.
async fn probed_once(fleet: &Fleet) {
    let start = Instant::now();
    for e in &fleet.engines {
        while probes(fleet, e.addr, "success").await < 1.0 {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "no start-up probe"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

async fn broken_engine_fenced_by_probes(shape: FleetOptions) {
    // The ramjet lesson: an engine that answers 200 with nothing must be
    // caught. Its empty answers only make it suspect; its probes come back
    // empty too, and they fence it.
    let fleet = quick_probed_fleet(3, shape).await;
    fleet.engines[2].engine.set_fault(Fault::Empty);
    // New conversations (placed by load, in turn) until one lands on it:
    // its empty answer is all the evidence there is.
    let mut seed = 0u64;
    loop {
        assert!(
            seed < 60,
            "{seed} new conversations and none reached engine-2"
        );
        let mut conv = Conversation::new(MODEL, &filler(seed + 50, 1024), false, 1000 + seed);
        let streamed = seed % 2 == 1;
        let t = fleet.chat(&conv.next_turn(500, streamed)).await;
        seed += 1;
        if t.engine.as_deref() == Some("engine-2") {
            if !streamed {
                assert_eq!(reply_text(&t.body), "");
            }
            break;
        }
    }
    // Reports and probes travel asynchronously: wait for the fencing ...
    wait_for(&fleet, Duration::from_secs(30), "engine-2 fenced", |s| {
        fenced(s, "engine-2")
    })
    .await;
    // ... after which no request reaches it.
    for s in 0..12u64 {
        let mut conv = Conversation::new(MODEL, &filler(s + 150, 1024), false, 1100 + s);
        let t = fleet.chat(&conv.next_turn(500, s % 2 == 1)).await;
        assert_ne!(
            t.engine.as_deref(),
            Some("engine-2"),
            "request {s} went to the fenced replica"
        );
    }
    let s = fleet.state().await.unwrap();
    let e2 = s.replicas.iter().find(|r| r.id == "engine-2").unwrap();
    assert!(fenced(&s, "engine-2"), "{s:?}");
    assert_eq!(
        e2.health.last_failure,
        Some(hearth_router::health::Failure::EmptyAnswer)
    );
    assert!(e2.health.suspicions_total >= 1, "{s:?}");
    // The fencing was the probes' doing.
    let failed = probes(&fleet, fleet.engines[2].addr, "empty_answer").await;
    assert!(failed >= 3.0, "{failed} failed probes");
    // Healthy replicas' answers were judged fine, and proved them.
    for r in s.replicas.iter().filter(|r| r.id != "engine-2") {
        assert_eq!(r.health.consecutive_failures, 0, "{s:?}");
        assert_eq!(r.health.suspect, None, "{s:?}");
        assert!(r.health.last_served_s_ago.is_some(), "{s:?}");
    }
    fleet.assert_wasm_healthy();
}

#[tokio::test]
async fn empty_answers_a_client_forces_fence_nothing() {
    client_forced_empty_answers(FleetOptions::default()).await;
}

#[tokio::test]
async fn empty_answers_a_client_forces_fence_nothing_in_the_endpoint_picker_shape() {
    client_forced_empty_answers(FleetOptions {
        gie_mode: true,
        ..FleetOptions::default()
    })
    .await;
}

async fn client_forced_empty_answers(shape: FleetOptions) {
    // Healthy engines; one client forces the end-of-sequence token first
    // (`logit_bias`), streamed without usage and not: every answer it gets
    // is empty by construction. Before, seven of these fenced a whole
    // fleet; now they raise suspicion, the probes clear it, nobody else
    // notices.
    let fleet = quick_probed_fleet(2, shape).await;
    for s in 0..20u64 {
        let mut conv = Conversation::new(MODEL, &filler(s + 300, 512), false, 3000 + s);
        let mut body = conv.next_turn(200, s % 2 == 0);
        body["logit_bias"] = serde_json::json!({"2": 100});
        let t = fleet.chat(&body).await;
        assert_eq!(reply_text(&t.body), "", "the engine obeyed the bias");
    }
    // Another client, right after: served, by Hearth's choice.
    for s in 0..4u64 {
        let mut conv = Conversation::new(MODEL, &filler(s + 400, 512), false, 4000 + s);
        let t = fleet.chat(&conv.next_turn(200, false)).await;
        assert!(t.upstream.is_some(), "routed by Hearth");
        assert_ne!(reply_text(&t.body), "");
    }
    let s = fleet.settle(Duration::from_secs(10)).await.unwrap();
    for r in &s.replicas {
        assert_eq!(
            r.health.state,
            hearth_router::health::HealthState::Serving,
            "{s:?}"
        );
        assert_eq!(r.health.fenced_total, 0, "{s:?}");
        assert_eq!(r.health.consecutive_failures, 0, "{s:?}");
    }
    assert!(
        s.replicas.iter().any(|r| r.health.suspicions_total >= 1),
        "the empty answers were seen: {s:?}"
    );
    let (status, health) = sidecar_health(&fleet).await;
    assert_eq!((status, health.as_str()), (200, "ok"));
    fleet.assert_wasm_healthy();
}

#[tokio::test]
async fn a_503_is_retried_on_the_next_endpoint_never_the_same_one() {
    let fleet = Fleet::start(flags(&["--probe-interval-seconds=0", "--eject-after=100"]))
        .await
        .unwrap();
    let mut conv = Conversation::new(MODEL, &filler(77, 4096), false, 1100);
    let home = {
        let t = fleet.chat(&conv.next_turn(2000, false)).await;
        conv.push_assistant(&reply_text(&t.body));
        t.engine.unwrap()
    };
    let idx: usize = home.trim_start_matches("engine-").parse().unwrap();
    fleet.engines[idx].engine.set_fault(Fault::Unavailable);
    for _ in 0..5 {
        let t = fleet.chat(&conv.next_turn(500, false)).await;
        assert_ne!(t.engine.as_deref(), Some(home.as_str()));
        assert_eq!(
            t.upstream, t.engine,
            "x-hearth-upstream names the replica that answered"
        );
        conv.push_assistant(&reply_text(&t.body));
    }
    // The failures were seen and counted against the right replica (once
    // every stream has ended).
    let s = fleet.settle(Duration::from_secs(10)).await.unwrap();
    let h = s.replicas.iter().find(|r| r.id == home).unwrap();
    assert_eq!(
        h.health.last_failure,
        Some(hearth_router::health::Failure::Retried),
        "{s:?}"
    );
    // A 503 is what a client's request could have provoked: suspicion,
    // never a strike (probes are off here).
    assert_eq!(
        h.health.suspect,
        Some(hearth_router::health::Failure::Retried),
        "{s:?}"
    );
    assert_eq!(h.health.consecutive_failures, 0, "{s:?}");
    fleet.assert_wasm_healthy();
}

#[tokio::test]
async fn a_request_stuck_without_an_answer_counts_as_a_timeout_and_releases_nothing_early() {
    let fleet = Fleet::start(flags(&[
        "--probe-interval-seconds=60",
        "--probe-timeout-seconds=0.5",
        "--suspect-probe-seconds=0.1",
        "--first-byte-timeout-seconds=0.5",
        "--eject-after=1",
    ]))
    .await
    .unwrap();
    probed_once(&fleet).await;
    for e in &fleet.engines {
        e.engine.set_fault(Fault::Stall);
    }
    let mut conv = Conversation::new(MODEL, "sys", false, 1200);
    let body = conv.next_turn(200, false);
    let url = format!("{}/v1/chat/completions", fleet.envoy.url());
    let request = tokio::spawn(fleet.client.post(&url).json(&body).send());
    let timeout = Some(hearth_router::health::Failure::Timeout);
    wait_for(
        &fleet,
        Duration::from_secs(30),
        "the missed first byte seen",
        |s| s.replicas.iter().any(|r| r.health.last_failure == timeout),
    )
    .await;
    // Past its first-byte deadline the request still hangs, unanswered,
    // and its load is held.
    let s = fleet.state().await.unwrap();
    assert!(!request.is_finished(), "the client got an answer");
    assert_eq!(
        s.replicas.iter().map(|r| r.in_flight).sum::<u32>(),
        1,
        "{s:?}"
    );
    // The client gives up: the load goes with it.
    request.abort();
    let s = fleet.settle(Duration::from_secs(30)).await.unwrap();
    assert!(s.replicas.iter().all(|r| r.in_flight == 0), "{s:?}");
    let timed_out: Vec<_> = s
        .replicas
        .iter()
        .filter(|r| r.health.last_failure == timeout)
        .collect();
    assert_eq!(timed_out.len(), 1, "{s:?}");
    // The missed first byte made it suspect; the probe that then timed out
    // on the stalled engine fenced it.
    let id = timed_out[0].id.clone();
    wait_for(
        &fleet,
        Duration::from_secs(30),
        "the timed-out replica fenced",
        |s| fenced(s, &id),
    )
    .await;
    let addr = fleet.engines[id.trim_start_matches("engine-").parse::<usize>().unwrap()].addr;
    assert!(probes(&fleet, addr, "timeout").await >= 1.0);
    fleet.assert_wasm_healthy();
}

#[tokio::test]
async fn an_upstream_reset_mid_answer_releases_the_load() {
    let fleet = Fleet::start(flags(&["--probe-interval-seconds=0"]))
        .await
        .unwrap();
    for e in &fleet.engines {
        e.engine.set_fault(Fault::Reset);
    }
    let url = format!("{}/v1/chat/completions", fleet.envoy.url());
    for i in 0..6u64 {
        let mut conv = Conversation::new(MODEL, "sys", false, 1300 + i);
        let body = conv.next_turn(300, true);
        // The client sees a broken answer (or an error); either way the
        // gateway must not keep the load.
        if let Ok(resp) = fleet.client.post(&url).json(&body).send().await {
            let _ = resp.bytes().await;
        }
    }
    let s = fleet.settle(Duration::from_secs(10)).await.unwrap();
    assert!(hearth_e2e::idle(&s), "{s:?}");
    assert_eq!(s.decisions_total, 6);
    fleet.assert_wasm_healthy();
}

#[tokio::test]
async fn connections_an_engine_closes_before_answering_fence_it_only_when_its_probes_fail_too() {
    // An overloaded engine's server closes connections it took without a
    // byte of an answer (vLLM did, under a saturating load). Three in a
    // row used to fence the replica, and with every replica busy the
    // whole fleet: each close is evidence to check, and the probe checks.
    let fleet = quick_probed_fleet(1, FleetOptions::default()).await;
    let engine = &fleet.engines[0].engine;
    engine.set_fault(Fault::Close { times: Some(6) });
    let mut closed = 0;
    for s in 0..40u64 {
        if engine.fault() == Fault::None {
            break;
        }
        let mut conv = Conversation::new(MODEL, &filler(s + 500, 512), false, 5000 + s);
        let t = fleet
            .post_json("/v1/chat/completions", &conv.next_turn(200, s % 2 == 1))
            .await
            .unwrap();
        if t.status != 200 {
            assert_eq!(t.status, 503, "{:?}", t.body);
            closed += 1;
        }
    }
    assert_eq!(engine.fault(), Fault::None, "the six closes were used up");
    // The probe may have met one or two of them; clients met the rest,
    // as many in a row as used to fence.
    assert!(closed >= 3, "{closed} requests closed");
    // Served at once afterwards, by the same replica.
    for s in 0..4u64 {
        let mut conv = Conversation::new(MODEL, &filler(s + 600, 512), false, 6000 + s);
        let t = fleet.chat(&conv.next_turn(200, false)).await;
        assert_eq!(t.engine.as_deref(), Some("engine-0"));
    }
    let s = fleet.settle(Duration::from_secs(10)).await.unwrap();
    let e0 = &s.replicas[0];
    assert_eq!(e0.health.fenced_total, 0, "{s:?}");
    assert_eq!(e0.health.suspect, None, "cleared by a success: {s:?}");
    assert!(e0.health.suspicions_total >= 1, "{s:?}");
    assert_eq!(
        e0.health.last_failure,
        Some(hearth_router::health::Failure::ConnectionReset)
    );

    // An engine that closes every connection fails its probes too: they
    // fence it.
    engine.set_fault(Fault::Close { times: None });
    let mut conv = Conversation::new(MODEL, &filler(700, 512), false, 7000);
    let t = fleet
        .post_json("/v1/chat/completions", &conv.next_turn(200, false))
        .await
        .unwrap();
    assert_eq!(t.status, 503, "{:?}", t.body);
    wait_for(&fleet, Duration::from_secs(30), "engine-0 fenced", |s| {
        fenced(s, "engine-0")
    })
    .await;
    let failed = probes(&fleet, fleet.engines[0].addr, "connection_reset").await;
    assert!(failed >= 3.0, "{failed} probes cut");
    fleet.assert_wasm_healthy();
}

/// Probes the sidecar sent to the engine at `addr`, by result.
async fn probes(fleet: &Fleet, addr: std::net::SocketAddr, result: &str) -> f64 {
    let (_, m) = fleet.admin_get("/metrics").await.unwrap();
    let series = format!(r#"hearth_probes_total{{engine="{addr}",result="{result}"}}"#);
    hearth_e2e::metric_sample(&m, &series).unwrap_or(0.0)
}

fn probes_total(m: &str, addr: std::net::SocketAddr) -> f64 {
    m.lines()
        .filter(|l| l.starts_with(&format!(r#"hearth_probes_total{{engine="{addr}""#)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test]
async fn real_traffic_is_the_proof_of_health_and_only_idle_replicas_are_probed() {
    // engine-2 serves another model, so it gets no traffic: idle.
    let fleet = Fleet::start(FleetOptions {
        engines: 3,
        sidecar_flags: vec!["--probe-interval-seconds=3".into()],
        upstream_options: vec![(2, ";model=other".into())],
        ..FleetOptions::default()
    })
    .await
    .unwrap();
    // Rounds of one turn for each of four conversations, back to back, until
    // the idle engine has had two interval probes after its start-up one.
    // A busy engine holds a conversation, so it serves a turn every round,
    // milliseconds apart: far within the 3 s interval.
    let mut convs: Vec<Conversation> = (0..4u64)
        .map(|s| Conversation::new(MODEL, &filler(s + 70, 2048), false, 1100 + s))
        .collect();
    let start = Instant::now();
    let m = loop {
        for conv in &mut convs {
            fleet.chat(&conv.next_turn(300, false)).await;
        }
        let (_, m) = fleet.admin_get("/metrics").await.unwrap();
        if probes_total(&m, fleet.engines[2].addr) >= 3.0 {
            break m;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the idle engine was not probed every interval:\n{m}"
        );
    };
    let stats = fleet.engine_stats();
    let mut busy = 0;
    for (i, e) in fleet.engines.iter().enumerate().take(2) {
        if stats[i].completed_total > 0 {
            busy += 1;
            // The start-up round at most: its own answers prove it since.
            assert!(
                probes_total(&m, e.addr) <= 1.0,
                "engine-{i} served traffic and was probed anyway:\n{m}"
            );
        }
    }
    assert!(busy >= 1, "no engine served: {stats:?}");
    let s = fleet.state().await.unwrap();
    assert!(s
        .replicas
        .iter()
        .all(|r| r.health.state == hearth_router::health::HealthState::Serving));
    let served: Vec<_> = s
        .replicas
        .iter()
        .map(|r| r.health.last_served_s_ago)
        .collect();
    assert!(served[..2].iter().any(Option::is_some), "{served:?}");
    assert_eq!(served[2], None, "the idle engine never served");
    fleet.assert_wasm_healthy();
}

#[tokio::test]
async fn engines_that_need_a_key_keep_serving_and_the_sidecar_reports_its_missing_key() {
    let fleet = Fleet::start(FleetOptions {
        engines: 2,
        engine_api_key: Some("team-key".into()),
        sidecar_flags: vec![
            "--probe-interval-seconds=0.3".into(),
            "--probe-retry-seconds=0.2".into(),
            "--engine-metrics-seconds=0.3".into(),
        ],
        ..FleetOptions::default()
    })
    .await
    .unwrap();
    let auth = [
        ("content-type", "application/json"),
        ("authorization", "Bearer team-key"),
    ];
    let mut conv = Conversation::new(MODEL, &filler(80, 2048), false, 1200);
    // Traffic, an idle period with more refused probes on every engine than
    // the fencing needs (three strikes), then traffic again: never a 503.
    for round in 0..2 {
        for _ in 0..5 {
            let body = serde_json::to_vec(&conv.next_turn(300, false)).unwrap();
            let t = fleet
                .post("/v1/chat/completions", body, &auth)
                .await
                .unwrap();
            assert_eq!(t.status, 200, "round {round}: {:?}", t.body);
        }
        if round == 0 {
            let deadline = Instant::now() + Duration::from_secs(30);
            for e in &fleet.engines {
                while probes(&fleet, e.addr, "unauthorized").await < 4.0 {
                    assert!(
                        Instant::now() < deadline,
                        "{}: fewer than four refused probes",
                        e.addr
                    );
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }
    let s = fleet.state().await.unwrap();
    for r in &s.replicas {
        assert_eq!(
            r.health.state,
            hearth_router::health::HealthState::Serving,
            "{s:?}"
        );
        assert_eq!(r.health.fenced_total, 0, "{s:?}");
        let why = r.health.credentials_error.as_deref().unwrap_or_default();
        assert!(
            why.contains("HTTP 401") && why.contains("HEARTH_ENGINE_API_KEY"),
            "{s:?}"
        );
    }
    let (_, m) = fleet.admin_get("/metrics").await.unwrap();
    assert!(
        probes(&fleet, fleet.engines[0].addr, "unauthorized").await >= 1.0,
        "{m}"
    );
    assert_eq!(
        hearth_e2e::metric_sample(
            &m,
            r#"hearth_replica_credentials_rejected{replica="engine-0"}"#
        ),
        Some(1.0),
        "{m}"
    );
    assert!(!m.contains("team-key"));
    drop(fleet);

    // With the key (from a file), probes and scrapes are accepted.
    let dir = std::env::temp_dir().join(format!("hearth-key-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let key_file = dir.join("engine-key");
    std::fs::write(&key_file, "team-key\n").unwrap();
    let fleet = Fleet::start(FleetOptions {
        engines: 2,
        engine_api_key: Some("team-key".into()),
        sidecar_flags: vec![
            "--probe-interval-seconds=0.3".into(),
            "--engine-metrics-seconds=0.3".into(),
            format!("--engine-api-key-file={}", key_file.display()),
        ],
        ..FleetOptions::default()
    })
    .await
    .unwrap();
    let addr = fleet.engines[1].addr;
    let deadline = Instant::now() + Duration::from_secs(20);
    while probes(&fleet, addr, "success").await < 2.0 {
        assert!(Instant::now() < deadline, "no accepted probe");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let s = fleet.state().await.unwrap();
    assert!(
        s.replicas
            .iter()
            .all(|r| r.health.credentials_error.is_none()),
        "{s:?}"
    );
    // Its metrics scrapes get through too: the engine's own figures.
    assert!(s.replicas.iter().all(|r| r.engine.is_some()), "{s:?}");
    assert_eq!(probes(&fleet, addr, "unauthorized").await, 0.0);
    for path in ["/state", "/metrics"] {
        let (_, text) = fleet.admin_get(path).await.unwrap();
        assert!(!text.contains("team-key"), "{path}: {text}");
    }
    // The sidecar's key goes on its own requests only: a client without
    // one gets the engine's refusal.
    let body = serde_json::to_vec(&conv.next_turn(300, false)).unwrap();
    let t = fleet
        .post(
            "/v1/chat/completions",
            body,
            &[("content-type", "application/json")],
        )
        .await
        .unwrap();
    assert_eq!(t.status, 401, "{:?}", t.body);
    drop(fleet);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn reasoning_engines_with_no_visible_text_are_healthy() {
    // Every output token is reasoning: `content` is always empty.
    let fleet = Fleet::start(FleetOptions {
        engines: 2,
        reasoning_tokens: 1_000,
        sidecar_flags: vec![
            "--probe-interval-seconds=0.3".into(),
            "--eject-after=2".into(),
        ],
        ..FleetOptions::default()
    })
    .await
    .unwrap();
    for s in 0..12u64 {
        let mut conv = Conversation::new(MODEL, &filler(s + 90, 1024), s % 2 == 0, 1300 + s);
        let t = fleet.chat(&conv.next_turn(300, false)).await;
        assert_eq!(reply_text(&t.body), "", "a reasoning answer has no content");
    }
    // Probes ran too (the engines idle between the turns above and after).
    let addr = fleet.engines[0].addr;
    let deadline = Instant::now() + Duration::from_secs(20);
    while probes(&fleet, addr, "success").await < 2.0 {
        assert!(Instant::now() < deadline, "no successful probe");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let s = fleet.state().await.unwrap();
    for r in &s.replicas {
        assert_eq!(r.health.fenced_total, 0, "{s:?}");
        assert_eq!(r.health.consecutive_failures, 0, "{s:?}");
        assert_eq!(r.health.last_failure, None, "{s:?}");
    }
    assert_eq!(probes(&fleet, addr, "empty_answer").await, 0.0);
    fleet.assert_wasm_healthy();
}

/// An engine that closes an idle connection just as a request arrives on
/// it (its keep-alive firing at that moment) loses that request, and Envoy
/// answers 503 "connection termination", which no retry policy may safely
/// repeat. Envoy's pool closes engine connections idle for
/// `ENGINE_IDLE_SECONDS` first, so a request after a longer pause goes out
/// on a new connection. The relay in front of the engine closes every
/// connection a request reaches after 4 s idle.
async fn a_pause_longer_than_the_engines_keep_alive_loses_no_request(shape: FleetOptions) {
    use hearth_e2e::keep_alive::KeepAliveRelay;
    let keep_alive = Duration::from_secs(4);
    assert!(hearth_ext_proc::envoy::render::ENGINE_IDLE_SECONDS < keep_alive.as_secs());
    let engine = hearth_bench::engine::spawn(
        hearth_bench::engine::EngineConfig {
            id: "engine-0".into(),
            model: MODEL.into(),
            ..Default::default()
        },
        tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap(),
    )
    .await
    .unwrap();
    let relay = KeepAliveRelay::start(engine.addr, keep_alive)
        .await
        .unwrap();
    // The sidecar neither probes nor scrapes: the relay sees Envoy alone.
    let fleet = Fleet::start(FleetOptions {
        external_engines: vec![("engine-0".into(), relay.addr)],
        sidecar_flags: vec![
            "--probe-interval-seconds=0".into(),
            "--engine-metrics-seconds=0".into(),
        ],
        ..shape
    })
    .await
    .unwrap();
    let mut conv = Conversation::new(MODEL, "sys", false, 1400);
    for turn in 0..3 {
        if turn > 0 {
            tokio::time::sleep(keep_alive + Duration::from_millis(500)).await;
        }
        let t = fleet
            .post_json("/v1/chat/completions", &conv.next_turn(300, false))
            .await
            .unwrap();
        assert_eq!(t.status, 200, "turn {turn} after a pause: {:?}", t.body);
        conv.push_assistant(&reply_text(&t.body));
    }
    assert_eq!(
        relay.closed_on_arrival(),
        0,
        "a request met a closing connection"
    );
    assert!(
        relay.connections() >= 3,
        "each turn after a pause came on a new connection: {}",
        relay.connections()
    );
}

#[tokio::test]
async fn a_pause_longer_than_the_engines_keep_alive_loses_no_request_in_filter_mode() {
    a_pause_longer_than_the_engines_keep_alive_loses_no_request(FleetOptions::default()).await;
}

#[tokio::test]
async fn a_pause_longer_than_the_engines_keep_alive_loses_no_request_as_an_endpoint_picker() {
    a_pause_longer_than_the_engines_keep_alive_loses_no_request(FleetOptions {
        gie_mode: true,
        ..FleetOptions::default()
    })
    .await;
}

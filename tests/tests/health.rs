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
    cond: impl Fn(&hearth_ext_proc::router::Snapshot) -> bool,
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

fn fenced(s: &hearth_ext_proc::router::Snapshot, id: &str) -> bool {
    s.replicas
        .iter()
        .any(|r| r.id == id && r.health.state == hearth_ext_proc::health::HealthState::Fenced)
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
async fn empty_answers_fence_a_replica_through_real_traffic() {
    // Probes off: only the outcome of real requests can find it.
    let fleet = Fleet::start(flags(&["--probe-interval-seconds=0", "--eject-after=3"]))
        .await
        .unwrap();
    fleet.engines[2].engine.set_fault(Fault::Empty);
    let mut served_by_2 = Vec::new();
    for s in 0..30u64 {
        let mut conv = Conversation::new(MODEL, &filler(s + 50, 1024), false, 1000 + s);
        let t = fleet.chat(&conv.next_turn(500, false)).await;
        if t.engine.as_deref() == Some("engine-2") {
            served_by_2.push(s);
            assert_eq!(reply_text(&t.body), "");
        }
    }
    // Outcome reports travel asynchronously, so one more request may slip
    // through before the third report lands; after that, none.
    assert!(
        (3..=4).contains(&served_by_2.len()),
        "engine-2 served requests {served_by_2:?}"
    );
    assert!(served_by_2.iter().all(|&s| s < 20), "{served_by_2:?}");
    let s = fleet.state().await.unwrap();
    let e2 = s.replicas.iter().find(|r| r.id == "engine-2").unwrap();
    assert!(fenced(&s, "engine-2"), "{s:?}");
    assert_eq!(
        e2.health.last_failure,
        Some(hearth_ext_proc::health::Failure::EmptyAnswer)
    );
    // Healthy replicas' answers were judged fine.
    assert!(s
        .replicas
        .iter()
        .filter(|r| r.id != "engine-2")
        .all(|r| r.health.consecutive_failures == 0));
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
        Some(hearth_ext_proc::health::Failure::Retried),
        "{s:?}"
    );
    assert!(h.health.consecutive_failures >= 5, "{s:?}");
    fleet.assert_wasm_healthy();
}

#[tokio::test]
async fn a_request_stuck_without_an_answer_counts_as_a_timeout_and_releases_nothing_early() {
    let fleet = Fleet::start(flags(&[
        "--probe-interval-seconds=0",
        "--first-byte-timeout-seconds=0.5",
        "--eject-after=1",
    ]))
    .await
    .unwrap();
    for e in &fleet.engines {
        e.engine.set_fault(Fault::Stall);
    }
    let mut conv = Conversation::new(MODEL, "sys", false, 1200);
    let body = conv.next_turn(200, false);
    let url = format!("{}/v1/chat/completions", fleet.envoy.url());
    let pending = fleet
        .client
        .post(&url)
        .json(&body)
        .timeout(Duration::from_secs(3))
        .send();
    let (resp, ()) = tokio::join!(pending, async {
        // While the request hangs, its load is held.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let s = fleet.state().await.unwrap();
        assert_eq!(s.replicas.iter().map(|r| r.in_flight).sum::<u32>(), 1);
    });
    assert!(resp.unwrap_err().is_timeout());
    let s = fleet.settle(Duration::from_secs(10)).await.unwrap();
    assert!(s.replicas.iter().all(|r| r.in_flight == 0), "{s:?}");
    let timed_out: Vec<_> = s
        .replicas
        .iter()
        .filter(|r| r.health.last_failure == Some(hearth_ext_proc::health::Failure::Timeout))
        .collect();
    assert_eq!(timed_out.len(), 1, "{s:?}");
    assert_eq!(
        timed_out[0].health.state,
        hearth_ext_proc::health::HealthState::Fenced
    );
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
    assert!(
        s.replicas.iter().all(|r| r.in_flight == 0 && r.load == 0.0),
        "{s:?}"
    );
    assert_eq!(s.decisions_total, 6);
    fleet.assert_wasm_healthy();
}

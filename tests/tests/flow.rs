//! Flow control through the real Envoy (filter mode): while the fleet is
//! saturated a request waits in the sidecar's queue, its ext_proc answer
//! held past Envoy's 0.5 s `message_timeout` (the sidecar's
//! `override_message_timeout`, within the rendered `max_message_timeout`);
//! when room opens the higher band leaves first; a sheddable request, one
//! past the queue's bound or its time to live gets the 429 and its reason;
//! a client that goes away leaves the queue at once; while a higher band
//! is reading a prompt on the replica, a lower band does not read beside
//! it (headroom for higher bands); a tenant past its fair share waits
//! while a quiet tenant's request passes it (slots kept for tenants).
//!
//! The fleet is one simulated engine, saturated deterministically: the
//! uncached-prompt limit is one byte, so one cold request in flight fills
//! it, and the engine is told to stall so that request stays in flight
//! until the test lets it go.

use std::time::{Duration, Instant};

use hearth_bench::engine::Fault;
use hearth_e2e::{filler, metric_sample, Conversation, Fleet, FleetOptions, Turn, MODEL};
use hearth_router::Snapshot;
use serde_json::Value;

/// Waits until `series` in the sidecar's metrics reads `want`.
async fn metric_reaches(fleet: &Fleet, series: &str, want: f64) {
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        let (_, text) = fleet.admin_get("/metrics").await.unwrap();
        let now = metric_sample(&text, series).unwrap_or(0.0);
        if now == want {
            return;
        }
        assert!(
            Instant::now() < until,
            "{series} is {now}, not {want}, after 20 s:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until the replica has `n` requests in flight.
async fn in_flight_reaches(fleet: &Fleet, n: u32) {
    let s = fleet
        .state_when(Duration::from_secs(20), |s| s.replicas[0].in_flight == n)
        .await
        .unwrap();
    assert_eq!(s.replicas[0].in_flight, n, "in flight");
}

/// A first turn of its own conversation, `bytes` of prompt.
fn prompt(seed: u64, bytes: usize) -> Vec<u8> {
    let mut c = Conversation::new(MODEL, &filler(seed, bytes), false, seed);
    let mut body = c.next_turn(10, false);
    body["max_tokens"] = 2.into();
    serde_json::to_vec(&body).unwrap()
}

/// Sends a chat request with `headers` in a task of its own.
fn send(
    fleet: &Fleet,
    body: Vec<u8>,
    headers: &[(&'static str, &'static str)],
) -> tokio::task::JoinHandle<Turn> {
    let client = fleet.client.clone();
    let url = format!("{}/v1/chat/completions", fleet.envoy.url());
    let headers = headers.to_vec();
    tokio::spawn(async move {
        let mut req = client
            .post(url)
            .header("content-type", "application/json")
            .body(body);
        for (k, v) in headers {
            req = req.header(k, v);
        }
        let resp = req.send().await.expect("request through Envoy");
        let status = resp.status().as_u16();
        let header = |name: &str| {
            resp.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        let engine = header("x-engine-id");
        let upstream = header("x-hearth-upstream");
        let reason = header("x-hearth-drop-reason");
        let text = resp.text().await.unwrap();
        let mut body: Value = serde_json::from_str(&text).unwrap_or(Value::String(text));
        if let Some(r) = reason {
            body["drop_reason_header"] = r.into();
        }
        Turn {
            status,
            engine,
            upstream,
            body,
        }
    })
}

/// A 200 whose replica the sidecar chose: it answered (Envoy did not
/// fail open past its `message_timeout`) and named the replica.
fn assert_routed(t: &Turn, context: &str) {
    assert_eq!(t.status, 200, "{context}{:?}", t.body);
    assert!(
        t.upstream.is_some(),
        "{context}no x-hearth-upstream: {:?}",
        t.body
    );
}

/// A 429 from flow control, with its reason in the header and the body.
fn assert_dropped(t: &Turn, reason: &str) {
    assert_eq!(t.status, 429, "{:?}", t.body);
    assert_eq!(t.body["drop_reason_header"], reason, "{:?}", t.body);
    assert_eq!(t.body["error"]["code"], reason, "{:?}", t.body);
    assert_eq!(t.body["error"]["type"], "rate_limit_exceeded");
}

/// The shapes in which the sidecar sees the body: body mode and the
/// endpoint picker.
fn body_shapes() -> [(&'static str, FleetOptions); 2] {
    [
        (
            "body",
            FleetOptions {
                body_mode: true,
                ..FleetOptions::default()
            },
        ),
        (
            "endpoint picker",
            FleetOptions {
                gie_mode: true,
                ..FleetOptions::default()
            },
        ),
    ]
}

async fn saturated_fleet(extra: &[&str]) -> Fleet {
    saturated_fleet_in(FleetOptions::default(), extra).await
}

/// [`saturated_fleet`] in the shape `opts` names.
async fn saturated_fleet_in(opts: FleetOptions, extra: &[&str]) -> Fleet {
    let mut flags: Vec<String> = [
        "--flow-uncached-bytes=1",
        "--flow-objectives=chat=10,batch=-1",
        "--probe-interval-seconds=0",
        "--stall-seconds=0",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    flags.extend(extra.iter().map(|s| s.to_string()));
    let fleet = Fleet::start(FleetOptions {
        engines: 1,
        sidecar_flags: flags,
        ..opts
    })
    .await
    .unwrap();
    fleet.engines[0].engine.set_fault(Fault::Stall);
    fleet
}

#[tokio::test]
async fn a_saturated_fleet_queues_lets_the_higher_band_out_first_and_drops_with_a_reason() {
    let fleet = saturated_fleet(&["--flow-max-requests=2"]).await;
    // The blocker: dispatched at once (nothing in flight), it stalls in
    // the engine and its uncached prompt saturates the replica.
    let blocker = send(&fleet, prompt(1, 3000), &[]);
    in_flight_reaches(&fleet, 1).await;
    let state = fleet.state().await.unwrap();
    assert!(state.replicas[0].saturated, "{:?}", state.replicas[0]);
    assert!(state.replicas[0].uncached_in_flight_bytes > 1);

    // A standard request waits in band 0.
    let low = send(
        &fleet,
        prompt(2, 5000),
        &[("x-gateway-inference-fairness-id", "tenant-a")],
    );
    metric_reaches(
        &fleet,
        "llm_d_epp_flow_control_queue_size{priority=\"0\"}",
        1.0,
    )
    .await;

    // A client that goes away leaves the queue at once.
    let leaver = send(&fleet, prompt(3, 4000), &[]);
    metric_reaches(
        &fleet,
        "llm_d_epp_flow_control_queue_size{priority=\"0\"}",
        2.0,
    )
    .await;
    leaver.abort();
    metric_reaches(
        &fleet,
        "hearth_flow_dropped_total{reason=\"disconnected\"}",
        1.0,
    )
    .await;
    metric_reaches(
        &fleet,
        "llm_d_epp_flow_control_queue_size{priority=\"0\"}",
        1.0,
    )
    .await;

    // An interactive request waits in band 10, queued after the standard one.
    let high = send(
        &fleet,
        prompt(4, 7000),
        &[
            ("x-gateway-inference-objective", "chat"),
            ("x-gateway-inference-fairness-id", "tenant-b"),
        ],
    );
    metric_reaches(
        &fleet,
        "llm_d_epp_flow_control_queue_size{priority=\"10\"}",
        1.0,
    )
    .await;

    // Sheddable while saturated: refused at once.
    let shed = send(
        &fleet,
        prompt(5, 2000),
        &[("x-gateway-inference-objective", "batch")],
    )
    .await
    .unwrap();
    assert_dropped(&shed, "sheddable");
    // The queue holds its most (2): a standard newcomer finds no lower
    // band to push out.
    let full = send(&fleet, prompt(6, 2000), &[]).await.unwrap();
    assert_dropped(&full, "queue_full");

    // Room opens: the engine works again and the blocker's client leaves.
    fleet.engines[0].engine.set_fault(Fault::None);
    blocker.abort();
    let high = high.await.unwrap();
    let low = low.await.unwrap();
    for t in [&high, &low] {
        assert_routed(t, "");
    }
    // The higher band left first, though it came later: the journal
    // lists decisions newest first, each with its wait.
    let (_, text) = fleet.admin_get("/debug/decisions?limit=20").await.unwrap();
    let journal: Value = serde_json::from_str(&text).unwrap();
    let decisions = journal["decisions"].as_array().unwrap();
    let waited: Vec<(u64, f64)> = decisions
        .iter()
        .rev()
        .filter(|d| d["outcome"] == "routed")
        .filter_map(|d| Some((d["prompt_bytes"].as_u64()?, d["wait_ms"].as_f64()?)))
        .collect();
    assert_eq!(waited.len(), 2, "{text}");
    assert!(
        waited[0].0 > waited[1].0,
        "the 7,000-byte interactive prompt should have been decided before the 5,000-byte \
         standard one: {waited:?}"
    );
    assert!(waited.iter().all(|&(_, ms)| ms > 0.0), "{waited:?}");
    let dropped: Vec<&str> = decisions
        .iter()
        .filter_map(|d| d["error"].as_str())
        .collect();
    assert!(dropped.contains(&"flow control: sheddable"), "{dropped:?}");
    assert!(dropped.contains(&"flow control: queue_full"), "{dropped:?}");

    for (series, want) in [
        ("hearth_flow_dispatched_total{priority=\"10\"}", 1.0),
        ("hearth_flow_dispatched_total{priority=\"0\"}", 1.0),
        ("hearth_flow_dropped_total{reason=\"sheddable\"}", 1.0),
        ("hearth_flow_dropped_total{reason=\"queue_full\"}", 1.0),
        ("llm_d_epp_flow_control_queue_size{priority=\"0\"}", 0.0),
        ("llm_d_epp_flow_control_queue_size{priority=\"10\"}", 0.0),
        ("llm_d_epp_flow_control_queue_bytes{priority=\"0\"}", 0.0),
    ] {
        metric_reaches(&fleet, series, want).await;
    }
    let (_, text) = fleet.admin_get("/metrics").await.unwrap();
    let dispatched_waits = metric_sample(
        &text,
        "llm_d_epp_flow_control_request_queue_duration_seconds_count{priority=\"10\",outcome=\"Dispatched\"}",
    );
    assert_eq!(dispatched_waits, Some(1.0), "{text}");
    fleet.assert_wasm_healthy();
}

#[tokio::test]
async fn a_request_that_waits_its_time_to_live_gets_a_429_saying_so() {
    let fleet = saturated_fleet(&["--flow-ttl-seconds=1"]).await;
    let blocker = send(&fleet, prompt(1, 3000), &[]);
    in_flight_reaches(&fleet, 1).await;
    let seen = fleet.engine_stats()[0].requests_total;
    let late = send(&fleet, prompt(2, 3000), &[]).await.unwrap();
    assert_dropped(&late, "ttl");
    metric_reaches(&fleet, "hearth_flow_dropped_total{reason=\"ttl\"}", 1.0).await;
    // The engine never saw it.
    assert_eq!(fleet.engine_stats()[0].requests_total, seen);
    fleet.engines[0].engine.set_fault(Fault::None);
    blocker.abort();
    // Room again: a new request is dispatched at once.
    let t = send(&fleet, prompt(3, 3000), &[]).await.unwrap();
    assert_eq!(t.status, 200, "{:?}", t.body);
}

#[tokio::test]
async fn the_body_and_endpoint_picker_shapes_hold_the_answer_while_the_request_waits() {
    for (shape, opts) in body_shapes() {
        let fleet = saturated_fleet_in(opts, &[]).await;
        let blocker = send(&fleet, prompt(1, 3000), &[]);
        in_flight_reaches(&fleet, 1).await;
        let waiting = send(&fleet, prompt(2, 5000), &[]);
        metric_reaches(
            &fleet,
            "llm_d_epp_flow_control_queue_size{priority=\"0\"}",
            1.0,
        )
        .await;
        // Past Envoy's message_timeout for this shape's answer (2 s in
        // body mode) before room opens: answered by the sidecar all the
        // same, so the deadline was extended.
        tokio::time::sleep(Duration::from_secs(3)).await;
        fleet.engines[0].engine.set_fault(Fault::None);
        blocker.abort();
        let t = waiting.await.unwrap();
        assert_routed(&t, &format!("{shape}: "));
        metric_reaches(&fleet, "hearth_flow_dispatched_total{priority=\"0\"}", 1.0).await;
        let (_, text) = fleet.admin_get("/debug/decisions?limit=5").await.unwrap();
        let journal: Value = serde_json::from_str(&text).unwrap();
        let waited = journal["decisions"][0]["wait_ms"].as_f64();
        assert!(waited.is_some_and(|ms| ms >= 3000.0), "{shape}: {text}");
    }
}

/// Waits until the replica named `id` has `n` requests in flight; a
/// failure shows the sidecar's latest decisions (which request went where,
/// and when).
async fn replica_in_flight_reaches(fleet: &Fleet, id: &str, n: u32) {
    let in_flight = |s: &Snapshot| s.replicas.iter().find(|r| r.id == id).unwrap().in_flight;
    let s = fleet
        .state_when(Duration::from_secs(20), |s| in_flight(s) == n)
        .await
        .unwrap();
    if in_flight(&s) != n {
        let (_, journal) = fleet.admin_get("/debug/decisions?limit=10").await.unwrap();
        panic!(
            "{id} in flight: {} after 20 s, not {n}; the latest decisions: {journal}",
            in_flight(&s)
        );
    }
}

#[tokio::test]
async fn a_queued_turn_waits_for_its_warm_replica_rather_than_the_first_that_frees() {
    let fleet = Fleet::start(FleetOptions {
        engines: 2,
        sidecar_flags: [
            "--flow-uncached-bytes=1",
            "--flow-affinity-wait-seconds=600",
            "--probe-interval-seconds=0",
            "--stall-seconds=0",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect(),
        ..FleetOptions::default()
    })
    .await
    .unwrap();
    // The conversation's first turn warms its replica.
    let mut conv = Conversation::new(MODEL, &filler(7, 20_000), false, 7);
    let first = fleet.chat(&conv.next_turn(10, false)).await;
    let home = first.upstream.clone().expect("x-hearth-upstream");
    let index = |id: &str| {
        fleet
            .engines
            .iter()
            .position(|e| e.engine.config().id == id)
            .unwrap()
    };
    // Both engines stall, and a cold request fills each replica.
    for e in &fleet.engines {
        e.engine.set_fault(Fault::Stall);
    }
    let b1 = send(&fleet, prompt(100, 3000), &[]);
    let until = Instant::now() + Duration::from_secs(20);
    while fleet
        .state()
        .await
        .unwrap()
        .replicas
        .iter()
        .map(|r| r.in_flight)
        .sum::<u32>()
        < 1
    {
        assert!(Instant::now() < until, "the first blocker was not routed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let b2 = send(&fleet, prompt(101, 3000), &[]);
    for e in &fleet.engines {
        replica_in_flight_reaches(&fleet, &e.engine.config().id, 1).await;
    }
    // Which blocker holds which replica: the journal, newest first.
    let (_, text) = fleet.admin_get("/debug/decisions?limit=3").await.unwrap();
    let journal: Value = serde_json::from_str(&text).unwrap();
    let chosen = |k: usize| {
        journal["decisions"][k]["chosen"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let (on_b2, on_b1) = (chosen(0), chosen(1));
    assert_ne!(on_b1, on_b2, "{text}");
    let (home_blocker, other_blocker) = if on_b1 == home { (b1, b2) } else { (b2, b1) };
    let other = if on_b1 == home { on_b2 } else { on_b1 };

    // The conversation's next turn finds the fleet saturated: it waits.
    let mut turn2 = conv.next_turn(10, false);
    turn2["max_tokens"] = 2.into();
    let next = send(&fleet, serde_json::to_vec(&turn2).unwrap(), &[]);
    metric_reaches(
        &fleet,
        "llm_d_epp_flow_control_queue_size{priority=\"0\"}",
        1.0,
    )
    .await;

    // The other replica frees first: within the affinity wait, the turn
    // keeps waiting for the replica that holds its conversation.
    fleet.engines[index(&other)].engine.set_fault(Fault::None);
    other_blocker.abort();
    replica_in_flight_reaches(&fleet, &other, 0).await;
    // (Releases wake the queue at once; give it several looks.)
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (_, text) = fleet.admin_get("/metrics").await.unwrap();
    assert_eq!(
        metric_sample(&text, "llm_d_epp_flow_control_queue_size{priority=\"0\"}"),
        Some(1.0),
        "the turn left for a cold replica"
    );
    assert_eq!(
        fleet.state().await.unwrap().replicas[index(&other)].in_flight,
        0
    );

    // Its own replica frees: the turn goes there, warm.
    fleet.engines[index(&home)].engine.set_fault(Fault::None);
    home_blocker.abort();
    let t = next.await.unwrap();
    assert_eq!(t.status, 200, "{:?}", t.body);
    assert_eq!(t.upstream.as_deref(), Some(home.as_str()));
    assert!(t.cached_tokens() > 0, "served cold: {:?}", t.body);
}

/// Headroom for higher bands through Envoy: while an interactive request
/// is in flight on the replica with its prompt still unread, a lower
/// band's prompt is not read beside it (a standard one waits, a sheddable
/// one waits behind it, or with `--flow-sheddable-waits=false` is
/// refused) until the interactive request is gone; with the headroom set
/// to 0 both go to the engine at once.
#[tokio::test]
async fn a_lower_band_waits_while_an_interactive_prompt_is_read_unless_headroom_is_off() {
    for (headroom, sheddable_waits) in [("30", true), ("30", false), ("0", true)] {
        let fleet = Fleet::start(FleetOptions {
            engines: 1,
            sidecar_flags: vec![
                "--flow-objectives=chat=10,batch=-1".into(),
                format!("--flow-headroom-seconds={headroom}"),
                format!("--flow-sheddable-waits={sheddable_waits}"),
                "--probe-interval-seconds=0".into(),
                "--stall-seconds=0".into(),
            ],
            ..FleetOptions::default()
        })
        .await
        .unwrap();
        // The engine takes requests and never answers: the interactive
        // request, dispatched at once (nothing else in flight), stays in
        // flight with its prompt unread until its client leaves.
        fleet.engines[0].engine.set_fault(Fault::Stall);
        let chat = send(
            &fleet,
            prompt(1, 3000),
            &[("x-gateway-inference-objective", "chat")],
        );
        in_flight_reaches(&fleet, 1).await;
        let state = fleet.state().await.unwrap();
        let bands = &state.replicas[0].bands;
        assert!(
            bands.iter().any(|b| b.priority == 10 && b.in_flight == 1),
            "headroom {headroom}: {bands:?}"
        );
        let batch = send(
            &fleet,
            prompt(2, 3000),
            &[("x-gateway-inference-objective", "batch")],
        );
        if headroom == "0" {
            // No room kept: the sheddable request goes beside it.
            in_flight_reaches(&fleet, 2).await;
            chat.abort();
            batch.abort();
            continue;
        }
        let batch = if sheddable_waits {
            // It waits in its band (-1), behind every other.
            metric_reaches(
                &fleet,
                "llm_d_epp_flow_control_queue_size{priority=\"-1\"}",
                1.0,
            )
            .await;
            Some(batch)
        } else {
            assert_dropped(&batch.await.unwrap(), "sheddable");
            None
        };
        // A standard request waits in band 0 rather than share the read.
        let standard = send(&fleet, prompt(3, 5000), &[]);
        metric_reaches(
            &fleet,
            "llm_d_epp_flow_control_queue_size{priority=\"0\"}",
            1.0,
        )
        .await;
        assert_eq!(fleet.state().await.unwrap().replicas[0].in_flight, 1);
        // The engine answers again and the interactive client leaves: the
        // standard request follows, then the sheddable one if it waited.
        fleet.engines[0].engine.set_fault(Fault::None);
        chat.abort();
        assert_routed(&standard.await.unwrap(), "");
        metric_reaches(&fleet, "hearth_flow_dispatched_total{priority=\"0\"}", 1.0).await;
        if let Some(batch) = batch {
            assert_routed(&batch.await.unwrap(), "");
            metric_reaches(&fleet, "hearth_flow_dispatched_total{priority=\"-1\"}", 1.0).await;
            let (_, text) = fleet.admin_get("/debug/decisions?limit=20").await.unwrap();
            let journal: Value = serde_json::from_str(&text).unwrap();
            // The two that waited, newest first: the sheddable request
            // (the smaller prompt) left after the standard one.
            let waited: Vec<u64> = journal["decisions"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|d| d["outcome"] == "routed")
                .filter(|d| d["wait_ms"].as_f64().is_some_and(|ms| ms > 0.0))
                .filter_map(|d| d["prompt_bytes"].as_u64())
                .collect();
            assert_eq!(waited.len(), 2, "{text}");
            assert!(waited[0] < waited[1], "{waited:?}");
        } else {
            metric_reaches(
                &fleet,
                "hearth_flow_dropped_total{reason=\"sheddable\"}",
                1.0,
            )
            .await;
        }
        fleet.assert_wasm_healthy();
    }
}

/// Waits until `fleet`'s one replica shows the engine's batch learnt.
async fn batch_learnt(fleet: &Fleet, batch: f64) {
    let s = fleet
        .state_when(Duration::from_secs(20), |s| {
            s.replicas[0].engine_batch == Some(batch)
        })
        .await
        .unwrap();
    assert_eq!(
        s.replicas[0].engine_batch,
        Some(batch),
        "{:?}",
        s.replicas[0]
    );
}

/// Slots kept for tenants under their fair share, through Envoy: on an
/// engine of two slots shared by two tenants, the noisy tenant with both
/// slots in flight and the quiet tenant's last request gone, the noisy
/// tenant's next request waits in the sidecar's queue (not the engine's),
/// and the quiet tenant's request, sent after it, passes it. With the
/// setting at 0 the noisy request goes to the engine at once.
#[tokio::test]
async fn a_tenant_past_its_fair_share_waits_while_a_quiet_tenants_request_passes() {
    const QUIET: (&str, &str) = ("x-gateway-inference-fairness-id", "quiet");
    const NOISY: (&str, &str) = ("x-gateway-inference-fairness-id", "noisy");
    for window in ["30", "0"] {
        let fleet = Fleet::start(FleetOptions {
            engines: 1,
            max_running: 2,
            sidecar_flags: vec![
                format!("--flow-fair-slots-seconds={window}"),
                "--engine-metrics-seconds=0.1".into(),
                "--probe-interval-seconds=0".into(),
                "--stall-seconds=0".into(),
            ],
            ..FleetOptions::default()
        })
        .await
        .unwrap();
        // Every request stalls in the engine until its client leaves.
        fleet.engines[0].engine.set_fault(Fault::Stall);
        // The quiet tenant's request, then two of the noisy tenant's: the
        // engine runs two, one waits there, and the sidecar learns the
        // batch from its figures.
        let q1 = send(&fleet, prompt(1, 3000), &[QUIET]);
        in_flight_reaches(&fleet, 1).await;
        let n1 = send(&fleet, prompt(2, 3000), &[NOISY]);
        let n2 = send(&fleet, prompt(3, 3000), &[NOISY]);
        in_flight_reaches(&fleet, 3).await;
        batch_learnt(&fleet, 2.0).await;
        // The quiet tenant's request goes away (its agent thinks): the
        // noisy tenant holds the engine's two slots, its whole fair share
        // and more.
        q1.abort();
        in_flight_reaches(&fleet, 2).await;
        let n3 = send(&fleet, prompt(4, 3000), &[NOISY]);
        if window == "0" {
            in_flight_reaches(&fleet, 3).await;
            for t in [n1, n2, n3] {
                t.abort();
            }
            continue;
        }
        metric_reaches(
            &fleet,
            "llm_d_epp_flow_control_queue_size{priority=\"0\"}",
            1.0,
        )
        .await;
        assert_eq!(fleet.state().await.unwrap().replicas[0].flows_about, 2);
        // The engine answers new requests again; the quiet tenant's next
        // one passes the waiting noisy request to the engine's queue.
        fleet.engines[0].engine.set_fault(Fault::None);
        let q2 = send(&fleet, prompt(5, 3000), &[QUIET]);
        in_flight_reaches(&fleet, 3).await;
        let (_, text) = fleet.admin_get("/metrics").await.unwrap();
        assert_eq!(
            metric_sample(&text, "llm_d_epp_flow_control_queue_size{priority=\"0\"}"),
            Some(1.0),
            "the noisy request still waits"
        );
        // A noisy request ends: the quiet one takes its slot and is
        // answered; then the noisy one waiting follows.
        n1.abort();
        assert_routed(&q2.await.unwrap(), "quiet: ");
        n2.abort();
        assert_routed(&n3.await.unwrap(), "noisy: ");
        fleet.assert_wasm_healthy();
    }
}

/// Waits until the engine has read a body whose `priority` differs from
/// `before` (a routed request reaches the engine a moment after its
/// decision), and returns it.
async fn next_priority(engine: &hearth_bench::engine::Engine, before: Option<i64>) -> i64 {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(seen) = engine.stats().last_priority.filter(|&p| Some(p) != before) {
            return seen;
        }
        assert!(Instant::now() < until, "no new priority after {before:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Milliseconds since the Unix epoch.
fn wall_ms() -> i64 {
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    since.as_millis() as i64
}

/// The engine's priority written into the body (`HEARTH_ENGINE_PRIORITY`,
/// vLLM's order: lower first): the band first, then the request's tag on
/// its replica's virtual clock (each tenant's requests in the order they
/// came, a burst's later ones after another tenant's); a client's own
/// `priority` never reaches the engine.
#[tokio::test]
async fn the_engines_priority_is_the_gateways_by_band_then_tenant_never_the_clients() {
    const BAND: i64 = 1 << 44;
    let fleet = Fleet::start(FleetOptions {
        engines: 1,
        sidecar_flags: vec![
            "--engine-priority=lower-first".into(),
            "--flow-objectives=chat=10,batch=-1".into(),
            "--probe-interval-seconds=0".into(),
            "--stall-seconds=0".into(),
        ],
        ..FleetOptions::default()
    })
    .await
    .unwrap();
    let engine = &fleet.engines[0].engine;

    // Tenant b sends two requests and tenant c one, while the engine lets
    // none out: b's second is tagged an engine interval (1 s until first
    // tokens teach it) after its first, and c's goes before it. First,
    // while no higher band has been about (it would keep the engine's one
    // learnt slot for itself).
    engine.set_fault(Fault::Stall);
    let start_ms = wall_ms();
    let b = [("x-gateway-inference-fairness-id", "team-b")];
    let c = [("x-gateway-inference-fairness-id", "team-c")];
    let b1 = send(&fleet, prompt(5, 3000), &b);
    let v_b1 = next_priority(engine, None).await;
    // A client's escaped and repeated `priority` members go too.
    let mut body = prompt(6, 3000);
    body.truncate(body.len() - 1);
    body.extend_from_slice(br#","priorit\u0079":-7,"priority":-8}"#);
    let b2 = send(&fleet, body, &b);
    let v_b2 = next_priority(engine, Some(v_b1)).await;
    let c1 = send(&fleet, prompt(7, 3000), &c);
    let v_c1 = next_priority(engine, Some(v_b2)).await;
    let end_ms = wall_ms();
    assert!(
        (start_ms..=end_ms + 1000).contains(&(v_b1 - 1000)),
        "{start_ms} {v_b1} {end_ms}"
    );
    assert!((900..=1100).contains(&(v_b2 - v_b1)), "{v_b1} {v_b2}");
    assert!(v_c1 < v_b2, "{v_c1} {v_b2}");
    // The stalled requests' clients leave; the engine works again.
    for t in [b1, b2, c1] {
        t.abort();
    }
    in_flight_reaches(&fleet, 0).await;
    engine.set_fault(Fault::None);

    // Each band 2^44 apart; the client asks to go first every time.
    type Headers = &'static [(&'static str, &'static str)];
    let cases: [(u64, Headers, i64); 3] = [
        (1, &[], 0),
        (2, &[("x-gateway-inference-objective", "chat")], -10),
        (4, &[("x-gateway-inference-objective", "batch")], 1),
    ];
    for (seed, headers, band_steps) in cases {
        let mut body: Value = serde_json::from_slice(&prompt(seed, 3000)).unwrap();
        body["priority"] = Value::from(-1_000_000);
        let before = engine.stats().last_priority;
        let start_ms = wall_ms();
        let t = send(&fleet, serde_json::to_vec(&body).unwrap(), headers)
            .await
            .unwrap();
        assert_routed(&t, &format!("{headers:?}: "));
        let seen = next_priority(engine, before).await;
        let tag_ms = seen - band_steps * BAND;
        assert!(
            (start_ms..=wall_ms() + 65_000).contains(&tag_ms),
            "{headers:?}: {seen} ({tag_ms} ms)"
        );
    }

    // A body past the filter's max_body_bytes (8 MiB) is not fingerprinted,
    // and still gets the gateway's priority, not its client's.
    let mut body: Value = serde_json::from_slice(&prompt(8, 3000)).unwrap();
    body["metadata"] = Value::from("x".repeat(8_500_000));
    body["priority"] = Value::from(-1_000_000);
    let before = engine.stats().last_priority;
    let start_ms = wall_ms();
    let t = send(&fleet, serde_json::to_vec(&body).unwrap(), &[])
        .await
        .unwrap();
    assert_routed(&t, "8.5 MB body: ");
    let seen = next_priority(engine, before).await;
    assert!(
        (start_ms..=wall_ms() + 65_000).contains(&seen),
        "8.5 MB body: {seen}"
    );
    fleet.assert_wasm_healthy();
}

/// The body and endpoint-picker shapes write the engine's priority too
/// (the sidecar holds the body there), for a request decided at once and
/// for one that waited in the queue; a client's own is replaced.
#[tokio::test]
async fn the_body_and_endpoint_picker_shapes_write_the_engines_priority_too() {
    const BAND: i64 = 1 << 44;
    for (shape, opts) in body_shapes() {
        let fleet = saturated_fleet_in(opts, &["--engine-priority=lower-first"]).await;
        let engine = &fleet.engines[0].engine;
        let start_ms = wall_ms();
        let chat = [("x-gateway-inference-objective", "chat")];
        let blocker = send(&fleet, prompt(1, 3000), &chat);
        let v_chat = next_priority(engine, None).await;
        let tag = v_chat + 10 * BAND;
        assert!(
            (start_ms..=wall_ms() + 65_000).contains(&tag),
            "{shape}: {v_chat}"
        );
        // The fleet is saturated: the next request waits in the queue.
        let mut body: Value = serde_json::from_slice(&prompt(2, 3000)).unwrap();
        body["priority"] = Value::from(-1_000_000);
        let waiting = send(&fleet, serde_json::to_vec(&body).unwrap(), &[]);
        metric_reaches(
            &fleet,
            "llm_d_epp_flow_control_queue_size{priority=\"0\"}",
            1.0,
        )
        .await;
        engine.set_fault(Fault::None);
        blocker.abort();
        let v_waited = next_priority(engine, Some(v_chat)).await;
        assert!(
            (start_ms..=wall_ms() + 65_000).contains(&v_waited),
            "{shape}: {v_waited}"
        );
        let t = waiting.await.unwrap();
        assert_routed(&t, &format!("{shape}: "));

        // The endpoint picker holds 16 MiB of a body at most: past it the
        // priority could not be written, so the request is refused, and
        // its client's own value never reaches the engine.
        if shape == "endpoint picker" {
            let mut body: Value = serde_json::from_slice(&prompt(3, 3000)).unwrap();
            body["metadata"] = Value::from("x".repeat(17 << 20));
            body["priority"] = Value::from(-1_000_000);
            let resp = fleet
                .client
                .post(format!("{}/v1/chat/completions", fleet.envoy.url()))
                .header("content-type", "application/json")
                .body(serde_json::to_vec(&body).unwrap())
                .send()
                .await;
            // (An early refusal may reach a client still uploading as a
            // closed connection.)
            if let Ok(resp) = resp {
                assert_eq!(resp.status().as_u16(), 413, "{shape}");
                // The gateway's refusal, not the engine's own limit.
                let answer: Value = resp.json().await.unwrap();
                assert_eq!(answer["error"]["code"], "request_too_large", "{answer}");
            }
            assert_ne!(engine.stats().last_priority, Some(-1_000_000), "{shape}");
        }
    }
}

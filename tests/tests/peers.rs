//! Active-active sidecars: two or three sidecars of one fleet, each with
//! its own Envoy, sharing warmth, load and fencing over a real
//! `nats-server`. A conversation whose turns alternate between them, or
//! that enters one Envoy whose cluster names both, stays on its warm
//! engine; a fencing by one is a fencing by all; the bus going
//! away loses no request, and coming back brings the sidecars back in
//! step; a sidecar that joins late is warm before its first decision.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use hearth_bench::gateway::Envoy;
use hearth_e2e::nats::NatsServer;
use hearth_e2e::{
    filler, metric_sample, reply_text, Conversation, Fleet, FleetOptions, Home, Turn, MODEL,
};
use hearth_ext_proc::envoy::render::{render, Gateway};
use hearth_ext_proc::Sidecar;
use hearth_router::{Failure, HealthState, Outcome, Snapshot};
use hearth_wire::peer::{encode, Body, Envelope, Update};

/// Another sidecar of the fleet (same engines, same bus) with its own Envoy.
struct Peer {
    sidecar: Sidecar,
    envoy: Envoy,
}

async fn peer(fleet: &Fleet) -> Peer {
    let mut settings = fleet.settings.clone();
    settings.listen = "127.0.0.1:0".parse().unwrap();
    settings.admin_listen = "127.0.0.1:0".parse().unwrap();
    let sidecar = Sidecar::start(&settings).await.unwrap();
    let gateway = Gateway {
        listen: "127.0.0.1:0".parse().unwrap(),
        sidecar: sidecar.grpc_addr,
        sidecar_admin: sidecar.admin_addr,
        ..fleet.gateway.clone()
    };
    let envoy = fleet.start_envoy(&render(&gateway)).await.unwrap();
    Peer { sidecar, envoy }
}

fn fleet_options(nats: &NatsServer) -> FleetOptions {
    FleetOptions {
        sidecar_flags: vec![
            format!("--peers-url={}", nats.url()),
            "--fleet=e2e".into(),
            "--peers-sync-seconds=1".into(),
            // A peer's fencing is a suspicion: confirmed by a probe soon.
            "--suspect-probe-seconds=0.2".into(),
            "--probe-retry-seconds=0.2".into(),
        ],
        ..FleetOptions::default()
    }
}

async fn get(admin: SocketAddr, path: &str) -> (u16, String) {
    let r = reqwest::get(format!("http://{admin}{path}")).await.unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

async fn state(admin: SocketAddr) -> Snapshot {
    serde_json::from_str(&get(admin, "/state").await.1).unwrap()
}

/// Polls `admin`'s state until `ok` holds (at most 10 s).
async fn wait_for(admin: SocketAddr, what: &str, ok: impl Fn(&Snapshot) -> bool) -> Snapshot {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let s = state(admin).await;
        if ok(&s) {
            return s;
        }
        assert!(Instant::now() < until, "{what}: {s:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn connected(s: &Snapshot) -> bool {
    s.peers.as_ref().is_some_and(|p| p.connected)
}

/// Leading blocks the chosen replica held, in `admin`'s latest decision.
async fn last_overlap(admin: SocketAddr) -> u64 {
    let (_, body) = get(admin, "/debug/decisions?limit=1").await;
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    v["decisions"][0]["overlap"].as_u64().unwrap()
}

/// A continuing turn's prompt starts with the previous turn's (the 16 KiB
/// system prompt, 8 blocks, and at least 8 KB of its own): a sidecar that
/// decides it holds more than the shared system prompt only if it learned
/// the earlier turns.
const CONTINUED: u64 = 11;

async fn turn(fleet: &Fleet, envoy: &Envoy, conv: &mut Conversation) -> Turn {
    let body = conv.next_turn(8000, false);
    let t = fleet
        .post_via(
            envoy,
            "/v1/chat/completions",
            serde_json::to_vec(&body).unwrap(),
            &[("content-type", "application/json")],
        )
        .await
        .unwrap();
    if t.status == 200 {
        conv.push_assistant(&reply_text(&t.body));
        conv.push_tool_round(1500);
    }
    t
}

#[tokio::test]
async fn turns_alternating_between_sidecars_stay_warm_and_a_fencing_is_shared() {
    let nats = NatsServer::start().unwrap();
    let fleet = Fleet::start(fleet_options(&nats)).await.unwrap();
    let b = peer(&fleet).await;
    let a_admin = fleet.settings.admin_listen;
    wait_for(a_admin, "A on the bus", connected).await;
    wait_for(b.sidecar.admin_addr, "B on the bus", connected).await;
    let gateways = [(&fleet.envoy, a_admin), (&b.envoy, b.sidecar.admin_addr)];
    let system = filler(21, 16_384);
    for s in 0..4u64 {
        let mut conv = Conversation::new(MODEL, &format!("{system} team {s}"), true, 300 + s);
        let mut home = Home::new(format!("session {s}"));
        for k in 0..4usize {
            let (envoy, admin) = gateways[(k + s as usize) % 2];
            let t = turn(&fleet, envoy, &mut conv).await;
            home.check(&t, 16_384 / 4);
            if k > 0 {
                let overlap = last_overlap(admin).await;
                assert!(
                    overlap >= CONTINUED,
                    "session {s} turn {k}: overlap {overlap}"
                );
            }
            // The next turn may go to the other sidecar at once: give the
            // bus its flush interval.
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
    }
    // One Envoy whose sidecar clusters name both: any sidecar may decide
    // any request.
    let both = fleet
        .start_envoy(&render(&Gateway {
            listen: "127.0.0.1:0".parse().unwrap(),
            more_sidecars: vec![(b.sidecar.grpc_addr, b.sidecar.admin_addr)],
            ..fleet.gateway.clone()
        }))
        .await
        .unwrap();
    let before = [
        state(a_admin).await.decisions_total,
        state(b.sidecar.admin_addr).await.decisions_total,
    ];
    for s in 0..4u64 {
        let mut conv = Conversation::new(MODEL, &format!("{system} both {s}"), true, 400 + s);
        let mut home = Home::new(format!("shared session {s}"));
        for _ in 0..4 {
            home.check(&turn(&fleet, &both, &mut conv).await, 16_384 / 4);
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
    }
    let after = [
        state(a_admin).await.decisions_total,
        state(b.sidecar.admin_addr).await.decisions_total,
    ];
    assert_eq!(after[0] - before[0] + after[1] - before[1], 16);
    assert!(
        after[0] > before[0] && after[1] > before[1],
        "one Envoy reached both sidecars: {before:?} -> {after:?}"
    );

    // Each sidecar decided half the turns, and saw the other's.
    let (_, metrics) = get(b.sidecar.admin_addr, "/metrics").await;
    let received = metric_sample(
        &metrics,
        "hearth_peer_messages_total{direction=\"received\"}",
    );
    assert!(received.is_some_and(|n| n > 0.0), "{metrics}");

    // engine-2 breaks (200 with nothing); A fences it on its own evidence
    // (refused connections, here told directly). At B that is a suspicion:
    // B probes it at once, its probes fail too, and B stops sending it
    // traffic.
    fleet.engines[2]
        .engine
        .set_fault(hearth_bench::engine::Fault::Empty);
    let router = &fleet.sidecar.as_ref().unwrap().router;
    let fenced = router
        .replica_at(&fleet.engines[2].addr.to_string(), None)
        .unwrap();
    for _ in 0..3 {
        router.record_request(fenced, Outcome::Failure(Failure::ConnectFailure));
    }
    wait_for(b.sidecar.admin_addr, "B fences engine-2", |s| {
        s.replicas[fenced].health.state == HealthState::Fenced
    })
    .await;
    for s in 0..8u64 {
        let mut conv = Conversation::new(MODEL, &format!("new team {s}"), true, 700 + s);
        let t = turn(&fleet, &b.envoy, &mut conv).await;
        assert_eq!(t.status, 200);
        assert_ne!(
            t.engine.as_deref(),
            Some("engine-2"),
            "B sent a turn to the engine A fenced"
        );
    }

    // Bad input on the bus is dropped and counted, never applied.
    let client = async_nats::connect(nats.url()).await.unwrap();
    let foreign = Envelope {
        fleet: "another".into(),
        list: 1,
        sender: 9,
        seq: 1,
        body: Body::Update(Update::default()),
    };
    let mut other_list = foreign.clone();
    other_list.fleet = "e2e".into();
    for payload in [
        b"not a peer message".to_vec(),
        encode(&foreign),
        encode(&other_list),
    ] {
        client
            .publish("hearth.e2e.updates", payload.into())
            .await
            .unwrap();
    }
    client.flush().await.unwrap();
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, m) = get(b.sidecar.admin_addr, "/metrics").await;
        let dropped = |reason: &str| {
            metric_sample(
                &m,
                &format!("hearth_peer_messages_dropped_total{{reason=\"{reason}\"}}"),
            )
            .unwrap_or(0.0)
        };
        if dropped("malformed") >= 1.0
            && dropped("foreign_fleet") >= 1.0
            && dropped("other_list") >= 1.0
        {
            break;
        }
        assert!(Instant::now() < until, "bad messages not counted: {m}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut conv = Conversation::new(MODEL, "after the noise", true, 999);
    assert_eq!(turn(&fleet, &b.envoy, &mut conv).await.status, 200);
    fleet.assert_wasm_healthy();
}

#[tokio::test]
async fn the_bus_going_away_loses_no_request_and_a_late_sidecar_starts_warm() {
    let mut nats = NatsServer::start().unwrap();
    let fleet = Fleet::start(fleet_options(&nats)).await.unwrap();
    let b = peer(&fleet).await;
    let a_admin = fleet.settings.admin_listen;
    wait_for(a_admin, "A on the bus", connected).await;
    wait_for(b.sidecar.admin_addr, "B on the bus", connected).await;
    let system = filler(31, 16_384);
    let mut convs: Vec<(Conversation, Home)> = (0..4u64)
        .map(|s| {
            (
                Conversation::new(MODEL, &format!("{system} crew {s}"), true, 500 + s),
                Home::new(format!("session {s}")),
            )
        })
        .collect();
    let gateways = [&fleet.envoy, &b.envoy];
    for (s, (conv, home)) in convs.iter_mut().enumerate() {
        for k in 0..2 {
            let t = turn(&fleet, gateways[(k + s) % 2], conv).await;
            home.check(&t, 16_384 / 4);
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
    }

    // The bus goes away: both sidecars keep routing on their own state.
    nats.stop();
    wait_for(a_admin, "A notices the bus is gone", |s| !connected(s)).await;
    let (code, body) = get(a_admin, "/health").await;
    assert_eq!(code, 200);
    assert!(body.contains("degraded"), "{body}");
    for (s, (conv, home)) in convs.iter_mut().enumerate() {
        // Through each conversation's last gateway: every request answered.
        let t = turn(&fleet, gateways[(1 + s) % 2], conv).await;
        home.check(&t, 16_384 / 4);
    }
    // A new conversation starts through A while B cannot hear of it.
    let mut late = Conversation::new(MODEL, &format!("{system} during the outage"), true, 77);
    let mut late_home = Home::new("started during the outage");
    late_home.check(&turn(&fleet, &fleet.envoy, &mut late).await, 0);

    // The bus comes back: the sidecars exchange their whole state.
    nats.restart().unwrap();
    wait_for(a_admin, "A back on the bus", connected).await;
    wait_for(b.sidecar.admin_addr, "B back on the bus", connected).await;
    let (_, body) = get(a_admin, "/health").await;
    assert!(!body.contains("degraded"), "{body}");
    let home = late_home.engine().unwrap().to_string();
    let until = Instant::now() + Duration::from_secs(10);
    while state(b.sidecar.admin_addr)
        .await
        .replicas
        .iter()
        .all(|r| r.id != home || r.warmth_blocks == 0)
    {
        assert!(Instant::now() < until, "B never learned A's outage warmth");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    late_home.check(&turn(&fleet, &b.envoy, &mut late).await, 16_384 / 4);
    assert!(last_overlap(b.sidecar.admin_addr).await >= CONTINUED);

    // A third sidecar joins: warm before its first decision.
    let c = peer(&fleet).await;
    let joined = state(c.sidecar.admin_addr).await;
    assert_eq!(joined.decisions_total, 0);
    assert!(
        joined
            .replicas
            .iter()
            .map(|r| r.warmth_blocks)
            .sum::<usize>()
            > 0,
        "C started cold: {joined:?}"
    );
    for (conv, home) in &mut convs {
        let t = turn(&fleet, &c.envoy, conv).await;
        home.check(&t, 16_384 / 4);
        assert!(last_overlap(c.sidecar.admin_addr).await >= CONTINUED);
    }
    fleet.assert_wasm_healthy();
}

//! Active-active sidecars: two or three sidecars of one fleet, each with
//! its own Envoy, sharing warmth, load and fencing over a real
//! `nats-server`. A conversation whose turns alternate between them, or
//! that enters one Envoy whose cluster names both, stays on its warm
//! engine; a fencing by one is a fencing by all; the bus going
//! away loses no request, and coming back brings the sidecars back in
//! step; a sidecar that joins late is warm before its first decision.
//! The bus is closed: a forged (another key), replayed or unsigned message
//! changes nothing, a key holder can neither speak under a sidecar's id
//! (its sequence far ahead would have silenced it) nor send a whole state
//! nobody asked for, a starting sidecar takes only a snapshot whose MAC
//! checks; with a members file, holding the fleet's key is not enough to
//! be heard; and over NATS with TLS and a user (the shipped configuration)
//! the sidecars share as before while one without credentials is refused.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime};

use futures::StreamExt;

use hearth_bench::gateway::Envoy;
use hearth_e2e::nats::NatsServer;
use hearth_e2e::{
    filler, metric_sample, reply_text, Conversation, Fleet, FleetOptions, Home, Turn, MODEL,
};
use hearth_ext_proc::config::PeerSeed;
use hearth_ext_proc::envoy::render::{render, Gateway};
use hearth_ext_proc::feeds::peer_guard::{open, seal, FleetKey, Identity};
use hearth_ext_proc::Sidecar;
use hearth_router::{Failure, HealthState, Outcome, RequestInfo, Snapshot};
use hearth_wire::peer::{decode, encode, split_seal, Body, Envelope, Health, Load, Update, Warmth};

/// Another sidecar of the fleet (same engines, same bus) with its own Envoy.
struct Peer {
    sidecar: Sidecar,
    envoy: Envoy,
}

async fn peer(fleet: &Fleet) -> Peer {
    peer_with(fleet, |_| {}).await
}

/// [`peer`], its settings changed by `change` first.
async fn peer_with(
    fleet: &Fleet,
    change: impl FnOnce(&mut hearth_ext_proc::config::Settings),
) -> Peer {
    let mut settings = fleet.settings.clone();
    change(&mut settings);
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

/// The fleet's key in these tests.
const KEY: &[u8] = b"hearth e2e fleet key, 32 bytes or more";

/// A file holding [`KEY`] (with a newline, which is not part of it),
/// removed when dropped.
struct KeyFile(PathBuf);

impl KeyFile {
    fn new() -> KeyFile {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path =
            std::env::temp_dir().join(format!("hearth-e2e-peers-key-{}-{n}", std::process::id()));
        let mut text = KEY.to_vec();
        text.push(b'\n');
        std::fs::write(&path, text).unwrap();
        KeyFile(path)
    }
}

impl Drop for KeyFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn fleet_options(nats: &NatsServer, key: &KeyFile) -> FleetOptions {
    FleetOptions {
        sidecar_flags: vec![
            format!("--peers-url={}", nats.url()),
            "--fleet=e2e".into(),
            "--peers-sync-seconds=1".into(),
            // A peer's fencing is a suspicion: confirmed by a probe soon.
            "--suspect-probe-seconds=0.2".into(),
            "--probe-retry-seconds=0.2".into(),
            format!("--peers-key-file={}", key.0.display()),
        ],
        ..FleetOptions::default()
    }
}

/// Microseconds since the Unix epoch: a fresh sequence number.
fn now_seq() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64
}

/// `e` as `me` sends it on `subject` (its sender is `me`'s id), sealed
/// with `key` (None: no MAC).
fn sealed(key: Option<&[u8]>, me: &Identity, subject: &str, e: &Envelope) -> Vec<u8> {
    let key = key.map(FleetKey::from_bytes);
    let e = Envelope {
        sender: me.sender(),
        ..e.clone()
    };
    seal(key.as_ref(), me, subject, encode(&e))
}

/// `admin`'s count of peer messages dropped for `reason`.
async fn dropped(admin: SocketAddr, reason: &str) -> f64 {
    let (_, m) = get(admin, "/metrics").await;
    metric_sample(
        &m,
        &format!("hearth_peer_messages_dropped_total{{reason=\"{reason}\"}}"),
    )
    .unwrap_or(0.0)
}

/// Waits (at most 10 s) until `admin` counted at least `at_least` drops
/// for each reason.
async fn wait_dropped(admin: SocketAddr, at_least: &[(&str, f64)]) {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let mut missing = Vec::new();
        for &(reason, n) in at_least {
            let got = dropped(admin, reason).await;
            if got < n {
                missing.push(format!("{reason}: {got} < {n}"));
            }
        }
        if missing.is_empty() {
            return;
        }
        assert!(Instant::now() < until, "drops not counted: {missing:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// An update that would fence every replica and load replica 0 to the
/// cap, from a sender that is no sidecar.
fn hostile_update(fleet: &Fleet, list: u64) -> Envelope {
    let replicas = fleet.engines.len() as u16;
    Envelope {
        fleet: "e2e".into(),
        list,
        sender: 0xBAD,
        seq: now_seq(),
        body: Body::Update(Update {
            warmth: vec![Warmth {
                replica: 0,
                hashes: (1..=100).collect(),
                tip: Some(100),
            }],
            load: vec![Load {
                replica: 0,
                in_flight: u32::MAX,
                load: f32::MAX,
            }],
            health: (0..replicas)
                .map(|replica| Health {
                    replica,
                    rank: None,
                    serving: false,
                })
                .collect(),
        }),
    }
}

/// Waits until the sidecar at `admin` counts a peer's one request on
/// replica `busy` (`what` names the wait), drops `held` (that request, at
/// the peer) and waits until it sees it released.
async fn counted_then_released(
    admin: SocketAddr,
    held: hearth_router::Decision,
    busy: usize,
    what: &str,
) {
    wait_for(admin, what, |s| s.replicas[busy].peer_in_flight == 1).await;
    drop(held);
    wait_for(admin, "the request seen released", |s| {
        s.replicas.iter().all(|r| r.peer_in_flight == 0)
    })
    .await;
}

/// The router's replica-list digest, as `/state` shows it.
fn list_digest(s: &Snapshot) -> u64 {
    u64::from_str_radix(&s.peers.as_ref().unwrap().list_digest, 16).unwrap()
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
    let key = KeyFile::new();
    let fleet = Fleet::start(fleet_options(&nats, &key)).await.unwrap();
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

    // Bad input on the bus (signed with the fleet's key, so that it is
    // read) is dropped and counted, never applied.
    let client = async_nats::connect(nats.url()).await.unwrap();
    let subject = "hearth.e2e.updates";
    let foreign = Envelope {
        fleet: "another".into(),
        list: 1,
        sender: 9,
        seq: now_seq(),
        body: Body::Update(Update::default()),
    };
    let mut other_list = foreign.clone();
    other_list.fleet = "e2e".into();
    let fleet_key = FleetKey::from_bytes(KEY);
    let me = Identity::generate();
    for payload in [
        seal(
            Some(&fleet_key),
            &me,
            subject,
            b"not a peer message".to_vec(),
        ),
        sealed(Some(KEY), &me, subject, &foreign),
        sealed(Some(KEY), &me, subject, &other_list),
    ] {
        client.publish(subject, payload.into()).await.unwrap();
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
    let key = KeyFile::new();
    let fleet = Fleet::start(fleet_options(&nats, &key)).await.unwrap();
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

    // The bus goes away while turns run through both gateways: each of
    // them is answered (nothing in a request's path waits for the bus).
    let stop = async {
        tokio::time::sleep(Duration::from_millis(20)).await;
        nats.stop();
    };
    let during = async {
        for (s, (conv, home)) in convs.iter_mut().enumerate() {
            let t = turn(&fleet, gateways[s % 2], conv).await;
            home.check(&t, 16_384 / 4);
        }
    };
    tokio::join!(stop, during);
    // Both sidecars keep routing on their own state.
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
    // What B holds there now (the shared system prompt, maybe): the new
    // conversation's own blocks come only with A's state.
    let home = late_home.engine().unwrap().to_string();
    let warmth_on_home = |s: &Snapshot| {
        s.replicas
            .iter()
            .find(|r| r.id == home)
            .map_or(0, |r| r.warmth_blocks)
    };
    let before = warmth_on_home(&state(b.sidecar.admin_addr).await);

    // The bus comes back: the sidecars exchange their whole state.
    nats.restart().unwrap();
    wait_for(a_admin, "A back on the bus", connected).await;
    wait_for(b.sidecar.admin_addr, "B back on the bus", connected).await;
    let (_, body) = get(a_admin, "/health").await;
    assert!(!body.contains("degraded"), "{body}");
    let until = Instant::now() + Duration::from_secs(20);
    while warmth_on_home(&state(b.sidecar.admin_addr).await) <= before {
        if Instant::now() >= until {
            // What each sidecar sent, took and dropped on the bus, so a
            // failure says whether A's state was sent and where it went.
            let peer_lines = |m: String| -> String {
                m.lines()
                    .filter(|l| l.starts_with("hearth_peer"))
                    .collect::<Vec<_>>()
                    .join("\n")
            };
            let (_, a_metrics) = get(a_admin, "/metrics").await;
            let (_, b_metrics) = get(b.sidecar.admin_addr, "/metrics").await;
            panic!(
                "B never learned A's outage warmth ({before} blocks on {home} before)\n\
                 A:\n{}\nB:\n{}",
                peer_lines(a_metrics),
                peer_lines(b_metrics)
            );
        }
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

#[tokio::test]
async fn forged_replayed_and_unsigned_peer_messages_are_dropped_counted_and_change_nothing() {
    let nats = NatsServer::start().unwrap();
    let key = KeyFile::new();
    let fleet = Fleet::start(fleet_options(&nats, &key)).await.unwrap();
    let b = peer(&fleet).await;
    let a_admin = fleet.settings.admin_listen;
    let b_admin = b.sidecar.admin_addr;
    wait_for(a_admin, "A on the bus", connected).await;
    wait_for(b_admin, "B on the bus", connected).await;
    let client = async_nats::connect(nats.url()).await.unwrap();
    let subject = "hearth.e2e.updates";
    let mut updates = client.subscribe(subject).await.unwrap();
    client.flush().await.unwrap();

    // A holds one request: its next update says so, and B counts it.
    let router = &fleet.sidecar.as_ref().unwrap().router;
    let held = router.decide(&RequestInfo::default()).unwrap();
    let busy = held.primary();
    let captured = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let m = updates.next().await.unwrap();
            let Some(sealed) = split_seal(&m.payload) else {
                continue;
            };
            let Ok(e) = decode(sealed.message) else {
                continue;
            };
            if let Body::Update(u) = &e.body {
                if u.load.iter().any(|l| l.in_flight == 1) {
                    return m.payload;
                }
            }
        }
    })
    .await
    .expect("A's update with its request in flight");
    counted_then_released(b_admin, held, busy, "B counts A's request").await;
    let before = state(b_admin).await;

    // A replay of A's genuine update, a forgery signed with another key,
    // and the same forgery unsigned.
    let list = list_digest(&before);
    let forged = hostile_update(&fleet, list);
    let other_key: &[u8] = b"not the fleet's key, though 32 bytes long";
    let forger = Identity::generate();
    client.publish(subject, captured.clone()).await.unwrap();
    client
        .publish(
            subject,
            sealed(Some(other_key), &forger, subject, &forged).into(),
        )
        .await
        .unwrap();
    let mut unsigned = forged.clone();
    unsigned.seq += 1;
    client
        .publish(subject, sealed(None, &forger, subject, &unsigned).into())
        .await
        .unwrap();
    client.flush().await.unwrap();
    wait_dropped(
        b_admin,
        &[("replay", 1.0), ("bad_mac", 1.0), ("unsigned", 1.0)],
    )
    .await;
    wait_dropped(a_admin, &[("bad_mac", 1.0), ("unsigned", 1.0)]).await;

    // Nothing changed: no replica fenced, no load, no warmth from them.
    for admin in [a_admin, b_admin] {
        let s = state(admin).await;
        for (r, was) in s.replicas.iter().zip(&before.replicas) {
            assert_ne!(r.health.state, HealthState::Fenced, "{}: {s:?}", r.id);
            assert_eq!((r.peer_in_flight, r.peer_load), (0, 0.0), "{}", r.id);
            if admin == b_admin {
                assert_eq!(r.warmth_blocks, was.warmth_blocks, "{}", r.id);
            }
        }
    }
    // A key holder speaking as A: A's own id, a sequence 59 s ahead (which
    // would refuse A's own messages for a minute), the fleet's MAC and the
    // holder's own signature. Dropped: an id is its key's.
    let a_sender = decode(split_seal(&captured).unwrap().message)
        .unwrap()
        .sender;
    let as_a = Envelope {
        sender: a_sender,
        seq: now_seq() + 59_000_000,
        ..forged.clone()
    };
    client
        .publish(
            subject,
            seal(
                Some(&FleetKey::from_bytes(KEY)),
                &forger,
                subject,
                encode(&as_a),
            )
            .into(),
        )
        .await
        .unwrap();
    // And a whole state nobody asked for, from the holder as itself.
    let Body::Update(fencing) = forged.body.clone() else {
        unreachable!()
    };
    let unasked = Envelope {
        seq: now_seq(),
        body: Body::Snapshot {
            part: 0,
            parts: 1,
            update: fencing,
        },
        ..forged.clone()
    };
    client
        .publish(
            subject,
            sealed(Some(KEY), &forger, subject, &unasked).into(),
        )
        .await
        .unwrap();
    client.flush().await.unwrap();
    wait_dropped(
        b_admin,
        &[("forged_sender", 1.0), ("unasked_snapshot", 1.0)],
    )
    .await;
    // A is heard as before: its next request in flight reaches B.
    let held = router.decide(&RequestInfo::default()).unwrap();
    let busy = held.primary();
    counted_then_released(b_admin, held, busy, "B still hears A after the forgery").await;
    for r in &state(b_admin).await.replicas {
        assert_ne!(r.health.state, HealthState::Fenced, "{}", r.id);
    }

    // Signed with the fleet's key, the same update is read (it names a
    // sender that is no sidecar, but it checks): the drops above were the
    // MAC's doing.
    let mut genuine = forged.clone();
    genuine.seq = now_seq();
    genuine.body = Body::Update(Update {
        load: vec![Load {
            replica: 0,
            in_flight: 3,
            load: 3.0,
        }],
        ..Update::default()
    });
    client
        .publish(
            subject,
            sealed(Some(KEY), &forger, subject, &genuine).into(),
        )
        .await
        .unwrap();
    // (Place 0 is the first replica by address, whichever that is.)
    wait_for(b_admin, "B applies a message that checks", |s| {
        s.replicas.iter().any(|r| r.peer_in_flight == 3)
    })
    .await;
    let mut conv = Conversation::new(MODEL, "after the forgeries", true, 4242);
    assert_eq!(turn(&fleet, &b.envoy, &mut conv).await.status, 200);
    fleet.assert_wasm_healthy();
}

/// A file with `text`, removed when dropped.
struct TempFile(PathBuf);

impl TempFile {
    fn new(name: &str, text: &str) -> TempFile {
        let path = std::env::temp_dir().join(format!("hearth-e2e-{name}-{}", std::process::id()));
        std::fs::write(&path, text).unwrap();
        TempFile(path)
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[tokio::test]
async fn with_a_members_file_a_holder_of_the_fleet_key_who_is_not_listed_is_not_heard() {
    let nats = NatsServer::start().unwrap();
    let key = KeyFile::new();
    // Each sidecar's own key, and the members file listing both.
    let seed_a = TempFile::new("seed-a", &format!("{}\n", "a1".repeat(32)));
    let seed_b = TempFile::new("seed-b", &format!("{}\n", "b2".repeat(32)));
    let public = |f: &TempFile| {
        Identity::of(&PeerSeed::read(&f.0).unwrap(), None)
            .unwrap()
            .public_key_hex()
    };
    let members = TempFile::new(
        "members",
        &format!(
            "# sidecar A\n{}\n# sidecar B\n{}\n",
            public(&seed_a),
            public(&seed_b)
        ),
    );
    let mut options = fleet_options(&nats, &key);
    options.sidecar_flags.extend([
        format!("--peers-identity-file={}", seed_a.0.display()),
        format!("--peers-members-file={}", members.0.display()),
    ]);
    let fleet = Fleet::start(options).await.unwrap();
    let b = peer_with(&fleet, |s| s.peers_identity_file = Some(seed_b.0.clone())).await;
    let (a_admin, b_admin) = (fleet.settings.admin_listen, b.sidecar.admin_addr);
    wait_for(a_admin, "A on the bus", connected).await;
    wait_for(b_admin, "B on the bus", connected).await;

    // The members hear each other: A's request is counted by B.
    let router = &fleet.sidecar.as_ref().unwrap().router;
    let held = router.decide(&RequestInfo::default()).unwrap();
    let busy = held.primary();
    counted_then_released(b_admin, held, busy, "B counts A's request").await;

    // A holder of the fleet's key with a key of its own, not listed: its
    // update (it checks: the MAC is the fleet's, the signature its own)
    // is dropped and changes nothing.
    let client = async_nats::connect(nats.url()).await.unwrap();
    let subject = "hearth.e2e.updates";
    let outsider = Identity::generate();
    let list = list_digest(&state(b_admin).await);
    let mut update = hostile_update(&fleet, list);
    update.body = Body::Update(Update {
        load: vec![Load {
            replica: 0,
            in_flight: 3,
            load: 3.0,
        }],
        ..Update::default()
    });
    for _ in 0..3 {
        update.seq = now_seq();
        client
            .publish(
                subject,
                sealed(Some(KEY), &outsider, subject, &update).into(),
            )
            .await
            .unwrap();
    }
    client.flush().await.unwrap();
    wait_dropped(b_admin, &[("unknown_member", 3.0)]).await;
    wait_dropped(a_admin, &[("unknown_member", 3.0)]).await;
    let after = state(b_admin).await;
    assert!(
        after.replicas.iter().all(|r| r.peer_in_flight == 0),
        "{:?}",
        after.replicas
    );
    // Still in step: a second request of A's is counted by B.
    let held = router.decide(&RequestInfo::default()).unwrap();
    let busy = held.primary();
    counted_then_released(b_admin, held, busy, "B still counts A's requests").await;

    // A sidecar whose own key the members file does not list does not
    // start: the others would drop everything it says.
    let seed_c = TempFile::new("seed-c", &format!("{}\n", "c3".repeat(32)));
    let mut settings = fleet.settings.clone();
    settings.listen = "127.0.0.1:0".parse().unwrap();
    settings.admin_listen = "127.0.0.1:0".parse().unwrap();
    settings.peers_identity_file = Some(seed_c.0.clone());
    let refused = Sidecar::start(&settings)
        .await
        .err()
        .expect("C must not start");
    assert!(
        format!("{refused:#}").contains("does not list this sidecar's own public key"),
        "{refused:#}"
    );
}

#[tokio::test]
async fn hellos_are_rate_limited_and_a_starting_sidecar_takes_only_a_snapshot_whose_mac_checks() {
    let nats = NatsServer::start().unwrap();
    let key = KeyFile::new();
    let mut fleet = Fleet::start(fleet_options(&nats, &key)).await.unwrap();
    let a_admin = fleet.settings.admin_listen;
    wait_for(a_admin, "A on the bus", connected).await;
    // A holds warmth: three prompts of 30 blocks.
    let router = &fleet.sidecar.as_ref().unwrap().router;
    for k in 0..3u64 {
        let info = RequestInfo {
            hashes: (k * 1_000..k * 1_000 + 30).collect(),
            prompt_bytes: 30 * 2048,
            ..RequestInfo::default()
        };
        drop(router.decide(&info).unwrap());
    }
    let a = state(a_admin).await;
    let a_warmth: Vec<usize> = a.replicas.iter().map(|r| r.warmth_blocks).collect();
    assert_eq!(a_warmth.iter().sum::<usize>(), 90);

    // Ten hellos at once, signed: A answers a few (each answer is its
    // whole state), the rest are dropped and counted.
    let client = async_nats::connect(nats.url()).await.unwrap();
    let mut answers = client.subscribe("_INBOX.e2e.>").await.unwrap();
    client.flush().await.unwrap();
    let seq = now_seq();
    let tester = Identity::generate();
    for i in 0..10u64 {
        let hello = Envelope {
            fleet: "e2e".into(),
            list: list_digest(&a),
            sender: 0x7E57,
            seq: seq + i,
            body: Body::Hello {
                reply: format!("_INBOX.e2e.{i}"),
            },
        };
        let payload = sealed(Some(KEY), &tester, "hearth.e2e.hello", &hello);
        client
            .publish("hearth.e2e.hello", payload.into())
            .await
            .unwrap();
    }
    client.flush().await.unwrap();
    wait_dropped(a_admin, &[("hello_limited", 5.0)]).await;
    // A's whole state, as it answered the first hello.
    let mut parts: Vec<Update> = Vec::new();
    let mut asked = std::collections::BTreeSet::new();
    let until = Instant::now() + Duration::from_secs(2);
    while let Ok(Some(m)) = tokio::time::timeout_at(until.into(), answers.next()).await {
        asked.insert(m.subject.to_string());
        let fleet_key = FleetKey::from_bytes(KEY);
        let opened =
            open(Some(&fleet_key), None, &m.subject, &m.payload).expect("A's answer checks");
        if let Body::Snapshot { update, .. } = decode(opened.message).unwrap().body {
            if m.subject.as_str() == "_INBOX.e2e.0" {
                parts.push(update);
            }
        }
    }
    assert!(
        (1..=5).contains(&asked.len()),
        "A answered {} of 10 hellos",
        asked.len()
    );
    assert!(!parts.is_empty(), "A answered the first hello");

    // A goes away; C starts. A forger answers C's hello first with a state
    // that fences every replica, loads one and warms it (signed with
    // another key, and unsigned), then a key holder answers with A's
    // state.
    fleet.stop_sidecar().await.unwrap();
    let mut hellos = client.subscribe("hearth.e2e.hello").await.unwrap();
    client.flush().await.unwrap();
    let forged = hostile_update(&fleet, list_digest(&a));
    let forger = tokio::spawn(async move {
        let m = hellos.next().await.unwrap();
        let hello = split_seal(&m.payload).unwrap();
        let Body::Hello { reply } = decode(hello.message).unwrap().body else {
            panic!("not a hello");
        };
        let Body::Update(update) = forged.body.clone() else {
            unreachable!()
        };
        let snapshot = Envelope {
            seq: now_seq(),
            body: Body::Snapshot {
                part: 0,
                parts: 1,
                update,
            },
            ..forged.clone()
        };
        let other_key: &[u8] = b"not the fleet's key, though 32 bytes long";
        let (forger, holder) = (Identity::generate(), Identity::generate());
        let mut payloads = vec![
            sealed(Some(other_key), &forger, &reply, &snapshot),
            sealed(None, &forger, &reply, &snapshot),
        ];
        let n = parts.len() as u32;
        for (i, update) in parts.into_iter().enumerate() {
            let genuine = Envelope {
                sender: 0x600D,
                seq: now_seq() + i as u64,
                body: Body::Snapshot {
                    part: i as u32,
                    parts: n,
                    update,
                },
                ..forged.clone()
            };
            payloads.push(sealed(Some(KEY), &holder, &reply, &genuine));
        }
        for payload in payloads {
            client.publish(reply.clone(), payload.into()).await.unwrap();
        }
        client.flush().await.unwrap();
    });
    let mut settings = fleet.settings.clone();
    settings.listen = "127.0.0.1:0".parse().unwrap();
    settings.admin_listen = "127.0.0.1:0".parse().unwrap();
    let c = Sidecar::start(&settings).await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), forger)
        .await
        .expect("the forger saw C's hello")
        .unwrap();
    wait_dropped(c.admin_addr, &[("bad_mac", 1.0), ("unsigned", 1.0)]).await;
    let joined = state(c.admin_addr).await;
    assert_eq!(joined.decisions_total, 0);
    let c_warmth: Vec<usize> = joined.replicas.iter().map(|r| r.warmth_blocks).collect();
    assert_eq!(c_warmth, a_warmth, "C took A's warmth, and only A's");
    for r in &joined.replicas {
        assert_ne!(r.health.state, HealthState::Fenced, "{}", r.id);
        assert_eq!((r.peer_in_flight, r.peer_load), (0, 0.0), "{}", r.id);
    }
}

#[tokio::test]
async fn over_nats_with_tls_and_a_user_sidecars_share_and_one_without_credentials_is_refused() {
    // The shipped NATS configuration (deploy/sidecar/nats.yaml): TLS with a
    // certificate of a CA made now, and one user.
    let password = "e2e-password-for-the-sidecars";
    let nats = NatsServer::start_closed("hearth", password).unwrap();
    let ca = nats.ca_file().unwrap();
    assert!(nats.url().starts_with("tls://127.0.0.1:"));
    let key = KeyFile::new();
    let mut options = fleet_options(&nats, &key);
    options.sidecar_flags.extend([
        "--peers-user=hearth".to_string(),
        format!("--peers-password={password}"),
        format!("--peers-ca-file={}", ca.display()),
    ]);
    let fleet = Fleet::start(options).await.unwrap();
    let b = peer(&fleet).await;
    let a_admin = fleet.settings.admin_listen;
    wait_for(a_admin, "A on the TLS bus", connected).await;
    wait_for(b.sidecar.admin_addr, "B on the TLS bus", connected).await;

    // They share: a conversation alternating between them stays warm.
    let system = filler(41, 16_384);
    let mut conv = Conversation::new(MODEL, &format!("{system} over tls"), true, 808);
    let mut home = Home::new("over tls");
    let gateways = [(&fleet.envoy, a_admin), (&b.envoy, b.sidecar.admin_addr)];
    for k in 0..4usize {
        let (envoy, admin) = gateways[k % 2];
        home.check(&turn(&fleet, envoy, &mut conv).await, 16_384 / 4);
        if k > 0 {
            let overlap = last_overlap(admin).await;
            assert!(overlap >= CONTINUED, "turn {k}: overlap {overlap}");
        }
        tokio::time::sleep(Duration::from_millis(30)).await;
    }

    // The server refuses a client without the user, and one that does not
    // trust its CA.
    let no_user = async_nats::ConnectOptions::new()
        .add_root_certificates(ca.clone())
        .require_tls(true)
        .connect(nats.url())
        .await;
    assert!(no_user.is_err(), "connected without credentials");
    let untrusted =
        async_nats::ConnectOptions::with_user_and_password("hearth".into(), password.into())
            .require_tls(true)
            .connect(nats.url())
            .await;
    assert!(untrusted.is_err(), "connected without trusting the CA");
    // A sidecar without credentials (allowed to start: the server is on
    // loopback) never gets on the bus.
    let mut settings = fleet.settings.clone();
    settings.listen = "127.0.0.1:0".parse().unwrap();
    settings.admin_listen = "127.0.0.1:0".parse().unwrap();
    settings.peers_user = None;
    settings.peers_password = None;
    settings.validate().unwrap();
    let c = Sidecar::start(&settings).await.unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let s = state(c.admin_addr).await;
    assert!(!connected(&s), "C got on the bus without credentials");
    assert_eq!(s.peers.as_ref().unwrap().live, 0);
    let log = nats.log();
    assert!(log.contains("authentication error"), "{log}");
    assert!(log.contains("unknown certificate authority"), "{log}");
    fleet.assert_wasm_healthy();
}

//! Time as an input: the windows the router counts (resident
//! conversations, engine figures' freshness, a peer's silence) elapse in
//! the `now` its callers pass, not in the wall clock. Each test moves
//! `now` past a window a few microseconds of wall time after the start,
//! so a router that read the wall clock would fail it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hearth_router::{EngineSignals, RequestInfo, Router, RouterParams, UpstreamSpec, PEER_SILENCE};
use hearth_wire::peer::{Load, Update};

const LIST: &str = "127.0.0.1:1,127.0.0.1:2";
const SECOND: Duration = Duration::from_secs(1);

fn fleet(tune: impl FnOnce(&mut RouterParams)) -> Arc<Router> {
    let mut p = RouterParams::default();
    tune(&mut p);
    let specs: Vec<UpstreamSpec> = LIST.split(',').map(|s| s.parse().unwrap()).collect();
    Router::new(p, &specs)
}

fn req(hashes: &[u64]) -> RequestInfo {
    RequestInfo {
        hashes: hashes.to_vec(),
        prompt_bytes: hashes.len() as u64 * RouterParams::default().block_size as u64,
        model: Some("m".into()),
        ..RequestInfo::default()
    }
}

/// A conversation's turn: a 32-block system prompt every conversation
/// shares, then `turn_blocks` of its own.
fn conversation(id: u64, turn_blocks: u64) -> Vec<u64> {
    let mut h: Vec<u64> = (1..=32).collect();
    h.extend((0..turn_blocks).map(|k| 1_000 * id + k));
    h
}

fn addr(i: usize) -> SocketAddr {
    LIST.split(',').nth(i).unwrap().parse().unwrap()
}

#[test]
fn a_resident_conversation_stops_repelling_newcomers_after_its_window() {
    let window = RouterParams::default().resident_window;
    // A conversation's first turn lands on `home` at t0 and pauses; a
    // second conversation sharing its system prompt starts `after` later.
    let place_second = |after: Duration| {
        let r = fleet(|_| {});
        let t0 = Instant::now();
        let home = r
            .decide_at(&req(&conversation(1, 4)), t0)
            .unwrap()
            .primary();
        let second = r.decide_at(&req(&conversation(2, 4)), t0 + after).unwrap();
        (home, second.primary(), r.snapshot_at(t0 + after))
    };
    // Within the window the first is resident at home: its load outweighs
    // the shared prompt's credit, and the newcomer starts elsewhere.
    let (home, second, snap) = place_second(window - SECOND);
    assert_ne!(second, home, "a resident conversation repels a newcomer");
    assert_eq!(snap.replicas[home].resident_conversations, 1);
    // Past it, the first has ended: the shared prompt's credit brings the
    // newcomer to the replica that holds it.
    let (home, second, snap) = place_second(window + SECOND);
    assert_eq!(second, home, "the resident expired after its window");
    assert_eq!(
        snap.replicas[home].resident_conversations, 1,
        "only the new one"
    );
}

#[test]
fn a_queued_engine_stops_repelling_traffic_once_its_figures_are_stale() {
    let stale = RouterParams::default().engine_stale;
    // A conversation's first turn lands on `home`; its engine then reports
    // a long queue (stamped t0); the next turn comes `after` later.
    let next_turn = |after: Duration| {
        let r = fleet(|p| p.resident_load = 0.0);
        let t0 = Instant::now();
        let home = r
            .decide_at(&req(&conversation(1, 8)), t0)
            .unwrap()
            .primary();
        let queued = EngineSignals::queue(0.0, 500.0, t0);
        r.set_engine_signals(addr(home), queued);
        let next = r.decide_at(&req(&conversation(1, 10)), t0 + after).unwrap();
        assert!(next.continues());
        let age = r.snapshot_at(t0 + after).replicas[home]
            .engine
            .as_ref()
            .map(|e| e.age_s);
        (home, next.primary(), age)
    };
    // Fresh, the queue outweighs the conversation's warmth.
    let (home, next, age) = next_turn(stale - SECOND);
    assert_ne!(next, home, "fresh figures: the queued engine is avoided");
    assert_eq!(age, Some((stale - SECOND).as_secs_f64()));
    // Stale, they are ignored: the turn goes home.
    let (home, next, age) = next_turn(stale + SECOND);
    assert_eq!(next, home, "stale figures no longer steer");
    assert_eq!(age, Some((stale + SECOND).as_secs_f64()));
}

#[test]
fn a_silent_peers_load_stops_counting_after_peer_silence() {
    // A conversation's first turn lands on `home`; at t0 a peer says it
    // runs a heavy load there; the next turn comes `after` later, once
    // the bus has expired silent peers.
    let next_turn = |after: Duration| {
        let r = fleet(|_| {});
        r.enable_peers();
        let t0 = Instant::now();
        let home = r
            .decide_at(&req(&conversation(1, 8)), t0)
            .unwrap()
            .primary();
        let heavy = Update {
            load: vec![Load {
                replica: home as u16,
                in_flight: 50,
                load: 500.0,
            }],
            ..Update::default()
        };
        r.apply_update_at(7, r.list_digest(), &heavy, false, t0)
            .unwrap();
        assert_eq!(r.snapshot_at(t0).replicas[home].peer_in_flight, 50);
        r.expire_peers_at(t0 + after);
        let live = r.peers_snapshot_at(t0 + after).unwrap().live;
        let next = r.decide_at(&req(&conversation(1, 10)), t0 + after).unwrap();
        (home, next.primary(), live)
    };
    // Heard from within PEER_SILENCE: its load steers the turn away.
    let (home, next, live) = next_turn(PEER_SILENCE - SECOND);
    assert_eq!(live, 1);
    assert_ne!(next, home, "a live peer's load counts");
    // Silent for longer: its load is dropped and the turn goes home.
    let (home, next, live) = next_turn(PEER_SILENCE + SECOND);
    assert_eq!(live, 0);
    assert_eq!(next, home, "a silent peer's load no longer steers");
}

//! Active-active sidecars: one router's updates applied by another.

use std::sync::Arc;
use std::time::Duration;

use hearth_router::fleet::MAX_RESIDENTS;
use hearth_router::peers::{MAX_PEERS, PEER_MAX_IN_FLIGHT, PEER_MAX_LOAD};
use hearth_router::{
    Failure, HealthState, Outcome, PeerRefusal, RequestInfo, Router, RouterParams, UpstreamSpec,
};
use hearth_wire::peer::{Load, Update, Warmth};

const LIST: &str = "127.0.0.1:1,127.0.0.1:2";

fn sidecar(list: &str, tune: impl FnOnce(&mut RouterParams)) -> Arc<Router> {
    let mut p = RouterParams::default();
    tune(&mut p);
    let specs: Vec<UpstreamSpec> = list.split(',').map(|s| s.parse().unwrap()).collect();
    let r = Router::new(p, &specs);
    r.enable_peers();
    r
}

fn req(hashes: &[u64]) -> RequestInfo {
    RequestInfo {
        hashes: hashes.to_vec(),
        prompt_bytes: hashes.len() as u64 * 2048,
        model: Some("m".into()),
        max_output_tokens: None,
        cache: Default::default(),
        priority: 0,
        flow: 0,
    }
}

/// `from`'s update applied by `to`.
fn share(from: &Router, to: &Router) -> hearth_router::Applied {
    to.apply_update(1, from.list_digest(), &from.take_update(), false)
        .unwrap()
}

#[test]
fn a_turn_that_reaches_the_other_sidecar_stays_on_its_warm_replica() {
    let (a, b) = (sidecar(LIST, |_| {}), sidecar(LIST, |_| {}));
    let mut c: Vec<u64> = (1..=40).collect();
    let first = a.decide(&req(&c)).unwrap();
    let home = first.primary();
    drop(first);
    let applied = share(&a, &b);
    assert_eq!((applied.warmth_records, applied.blocks), (1, 40));
    c.extend(1_000..1_010);
    let next = b.decide(&req(&c)).unwrap();
    assert_eq!(next.primary(), home);
    assert_eq!(next.overlap, 40);
    assert!(next.continues(), "the tip came with the warmth");
    let s = b.snapshot();
    assert_eq!(s.replicas[home].resident_conversations, 1);
}

#[test]
fn a_peers_load_counts_until_it_is_released() {
    let (a, b) = (sidecar(LIST, |_| {}), sidecar(LIST, |_| {}));
    // Ten requests running through A, all on replica 0 (a subset of one:
    // unhashed, so nothing else pulls them).
    let busy = 0;
    let held: Vec<_> = (0..10)
        .map(|_| {
            a.decide_within(&RequestInfo::default(), Some(&[busy]))
                .unwrap()
        })
        .collect();
    assert!(held.iter().all(|d| d.primary() == busy));
    share(&a, &b);
    let s = b.snapshot();
    assert_eq!(s.replicas[busy].peer_in_flight, 10, "B sees A's requests");
    assert_eq!(s.replicas[1 - busy].peer_in_flight, 0);
    // B, with nothing of its own running, sends its request elsewhere.
    let d = b.decide(&RequestInfo::default()).unwrap();
    assert_ne!(d.primary(), busy, "B avoids the replica A loaded");
    drop(d);
    drop(held);
    share(&a, &b);
    let s = b.snapshot();
    assert_eq!(
        s.replicas[0].peer_in_flight + s.replicas[1].peer_in_flight,
        0
    );
    assert_eq!(s.replicas[0].peer_load + s.replicas[1].peer_load, 0.0);
}

#[test]
fn a_peers_fencing_makes_a_replica_suspect_and_only_a_local_probe_fences_or_readmits_it() {
    let no_backoff = |p: &mut RouterParams| p.health.backoff = Duration::ZERO;
    let (a, b) = (sidecar(LIST, no_backoff), sidecar(LIST, no_backoff));
    let key = "127.0.0.1:1".parse::<std::net::SocketAddr>().unwrap();
    let eject_after = RouterParams::default().health.eject_after;
    // A fences replica 0 on its own evidence (refused connections).
    for _ in 0..eject_after {
        a.record_request(0, Outcome::Failure(Failure::ConnectFailure));
    }
    assert_eq!(a.snapshot().replicas[0].health.state, HealthState::Fenced);
    let applied = share(&a, &b);
    assert_eq!(applied.fenced, 1);
    // At B the peer's word is a suspicion: still serving, probed at once.
    let at_b = &b.snapshot().replicas[0].health;
    assert_eq!(at_b.state, HealthState::Serving);
    assert_eq!(at_b.suspect, Some(Failure::PeerFenced));
    assert!(b.probe_targets().iter().any(|t| t.key == (key, None)));
    // What B was told is not passed on again.
    assert!(b.take_update().health.is_empty());
    // B's own probes agree: fenced at B too.
    for _ in 0..eject_after {
        b.record_probe((key, None), Outcome::Failure(Failure::EmptyAnswer));
    }
    assert_eq!(b.snapshot().replicas[0].health.state, HealthState::Fenced);
    for _ in 0..4 {
        assert_eq!(b.decide(&RequestInfo::default()).unwrap().primary(), 1);
    }
    // A's probe re-admits it; B only probes it again, and its own probe
    // re-admits it.
    a.record_probe((key, None), Outcome::Success);
    assert_eq!(share(&a, &b).readmitted, 1);
    assert_eq!(b.snapshot().replicas[0].health.state, HealthState::Fenced);
    assert!(b.probe_targets().iter().any(|t| t.key == (key, None)));
    b.record_probe((key, None), Outcome::Success);
    assert_eq!(b.snapshot().replicas[0].health.state, HealthState::Serving);
}

#[test]
fn updates_over_another_replica_list_are_refused() {
    let a = sidecar(LIST, |_| {});
    let b = sidecar("127.0.0.1:1,127.0.0.1:3", |_| {});
    drop(a.decide(&req(&[1, 2, 3])).unwrap());
    let update = a.take_update();
    assert_eq!(
        b.apply_update(1, a.list_digest(), &update, false),
        Err(PeerRefusal::OtherList)
    );
    // The same list in another order is the same list.
    let c = sidecar("127.0.0.1:2,127.0.0.1:1", |_| {});
    assert_eq!(c.list_digest(), a.list_digest());
    assert!(c.apply_update(1, a.list_digest(), &update, false).is_ok());
    let mut bad = update.clone();
    bad.warmth[0].replica = 9;
    assert_eq!(
        c.apply_update(1, a.list_digest(), &bad, false),
        Err(PeerRefusal::UnknownReplica)
    );
}

#[test]
fn a_starting_sidecar_takes_a_peers_whole_state() {
    let a = sidecar(LIST, |_| {});
    let convs: Vec<Vec<u64>> = (0..6u64)
        .map(|k| (k * 1_000..k * 1_000 + 30).collect())
        .collect();
    let homes: Vec<usize> = convs
        .iter()
        .map(|c| a.decide(&req(c)).unwrap().primary())
        .collect();
    let fresh = sidecar(LIST, |_| {});
    let applied = fresh
        .apply_update(1, a.list_digest(), &a.state_update(), true)
        .unwrap();
    assert_eq!(applied.blocks, 6 * 30);
    for (c, &home) in convs.iter().zip(&homes) {
        let mut next = c.clone();
        next.push(c[0] + 500_000);
        let d = fresh.decide(&req(&next)).unwrap();
        assert_eq!((d.primary(), d.overlap), (home, 30));
        assert!(d.continues());
    }
}

#[test]
fn without_peers_nothing_is_kept_for_them() {
    let specs: Vec<UpstreamSpec> = LIST.split(',').map(|s| s.parse().unwrap()).collect();
    let r = Router::new(RouterParams::default(), &specs);
    drop(r.decide(&req(&[1, 2, 3])).unwrap());
    assert!(r.take_update().warmth.is_empty());
    assert!(r.peers_snapshot().is_none());
    assert!(r.snapshot().peers.is_none());
}

/// An update carrying only load figures: (replica, in flight, load).
fn loads(figures: &[(u16, u32, f32)]) -> Update {
    Update {
        load: figures
            .iter()
            .map(|&(replica, in_flight, load)| Load {
                replica,
                in_flight,
                load,
            })
            .collect(),
        ..Update::default()
    }
}

#[test]
fn absurd_peer_figures_are_bounded_overflow_nothing_and_steer_nothing() {
    let a = sidecar(LIST, |_| {});
    let conv: Vec<u64> = (1..=40).collect();
    let home = a.decide(&req(&conv)).unwrap().primary();
    // Peers claim the largest and the broken figures on both replicas
    // alike (each sender twice, so sums of several peers are made).
    let absurd = [f32::MAX, f32::INFINITY, f32::NAN, f32::NEG_INFINITY, -1.0];
    for (sender, &load) in (10u64..).zip(absurd.iter().chain(&absurd)) {
        let update = loads(&[(0, u32::MAX, load), (1, u32::MAX, load)]);
        a.apply_update(sender, a.list_digest(), &update, false)
            .unwrap();
    }
    let s = a.snapshot();
    for r in &s.replicas {
        // Ten peers, each capped (only f32::MAX counts as a load), and
        // all together no more than one may claim: ids made up by one
        // member of the fleet multiply nothing.
        assert_eq!(r.peer_in_flight, PEER_MAX_IN_FLIGHT);
        assert_eq!(r.peer_load, PEER_MAX_LOAD);
    }
    // Equal on both replicas: the conversation's next turn stays home.
    let mut next = conv.clone();
    next.extend(500..510);
    let d = a.decide(&req(&next)).unwrap();
    assert_eq!((d.primary(), d.overlap), (home, 40));
    drop(d);

    // On one replica only, a broken load weighs nothing: the turn stays
    // home whichever replica it is claimed on.
    for (sender, &load) in (100u64..).zip(&absurd[1..]) {
        let fresh = sidecar(LIST, |_| {});
        let home = fresh.decide(&req(&conv)).unwrap().primary();
        for replica in 0..2 {
            let update = loads(&[(replica, 0, load)]);
            fresh
                .apply_update(sender, fresh.list_digest(), &update, false)
                .unwrap();
            let s = fresh.snapshot();
            assert!(s.replicas.iter().all(|r| r.peer_load == 0.0), "{load}");
            assert_eq!(fresh.decide(&req(&next)).unwrap().primary(), home);
        }
    }
}

#[test]
fn a_peers_figures_for_one_replica_are_its_last_and_peers_kept_are_bounded() {
    let a = sidecar(LIST, |_| {});
    let update = loads(&[(0, 10, 3.0), (0, 20, 5.0), (1, 1, 1.0)]);
    a.apply_update(1, a.list_digest(), &update, false).unwrap();
    let s = a.snapshot();
    assert_eq!(
        (s.replicas[0].peer_in_flight, s.replicas[0].peer_load),
        (20, 5.0)
    );
    assert_eq!(
        (s.replicas[1].peer_in_flight, s.replicas[1].peer_load),
        (1, 1.0)
    );

    let b = sidecar(LIST, |_| {});
    for sender in 0..(MAX_PEERS as u64 + 100) {
        b.apply_update(sender, b.list_digest(), &loads(&[(0, 1, 1.0)]), false)
            .unwrap();
    }
    assert_eq!(b.peers_snapshot().unwrap().live, MAX_PEERS);
    assert_eq!(b.snapshot().replicas[0].peer_in_flight, MAX_PEERS as u32);
}

#[test]
fn a_peers_resident_conversations_are_bounded_per_replica() {
    let a = sidecar(LIST, |_| {});
    // A whole state listing more resident tips than any engine holds.
    let update = Update {
        warmth: (0..(MAX_RESIDENTS as u64 + 5_000))
            .map(|tip| Warmth {
                replica: 0,
                hashes: Vec::new(),
                tip: Some(1_000_000 + tip),
            })
            .collect(),
        ..Update::default()
    };
    a.apply_update(1, a.list_digest(), &update, true).unwrap();
    let s = a.snapshot();
    assert_eq!(s.replicas[0].resident_conversations, MAX_RESIDENTS);
    assert_eq!(s.replicas[1].resident_conversations, 0);
}

//! The router as a whole: decisions over a fleet, reservations, health
//! evidence, engine figures, reloads.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hearth_router::health::{FleetHealth, Outcome};
use hearth_router::{EngineSignals, RequestInfo, RouteError, Router, RouterParams, UpstreamSpec};

/// Replicas in the `HEARTH_UPSTREAMS` syntax, with default parameters
/// changed by `tune`.
fn fleet(list: &str, tune: impl FnOnce(&mut RouterParams)) -> Arc<Router> {
    let mut p = RouterParams::default();
    tune(&mut p);
    Router::new(p, &specs(list))
}

/// Three replicas, the last serving only the model `special`.
fn router(tune: impl FnOnce(&mut RouterParams)) -> Arc<Router> {
    fleet(
        "127.0.0.1:1001,127.0.0.1:1002,127.0.0.1:1003;model=special",
        tune,
    )
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

#[test]
fn a_session_returns_to_the_replica_that_read_it() {
    let router = router(|_| {});
    let first = router.decide(&req(&[1, 2, 3])).unwrap();
    let home = first.primary();
    drop(first);
    for turn in 4..10u64 {
        let hashes: Vec<u64> = (1..=turn).collect();
        let d = router.decide(&req(&hashes)).unwrap();
        assert_eq!(d.primary(), home);
        assert_eq!(d.overlap, (turn - 1) as u32);
    }
}

#[test]
fn known_overlaps_replace_the_warmth_index() {
    let router = fleet("127.0.0.1:1001,127.0.0.1:1002", |_| {});
    let hashes = [1, 2, 3, 4];
    let home = router.decide(&req(&hashes)).unwrap().primary();
    let other = 1 - home;
    // Told that the other replica holds three blocks and home none, the
    // router goes there, with that overlap.
    // (`decide_knowing_at`, the simulator's entry point, behind the
    // crate's `simulation` feature.)
    let mut known = vec![0; 2];
    known[other] = 3;
    let d = router
        .decide_knowing_at(&req(&hashes), &known, Instant::now())
        .unwrap();
    assert_eq!(d.primary(), other);
    assert_eq!(d.overlap, 3);
    drop(d);
    // An overlap beyond the prompt counts as the whole prompt.
    let mut known = vec![0; 2];
    known[home] = 99;
    let d = router
        .decide_knowing_at(&req(&hashes), &known, Instant::now())
        .unwrap();
    assert_eq!((d.primary(), d.overlap), (home, 4));
}

#[test]
fn first_turns_spread_by_load_and_later_turns_follow_their_history() {
    let router = router(|p| {
        p.score.alpha = 2.0;
        p.score.first_turn_cap = 4;
    });
    // 32 shared harness blocks, then each conversation's own.
    let harness: Vec<u64> = (1..=32).collect();
    let turn = |conv: u64, len: u64| {
        let mut h = harness.clone();
        h.extend((0..len).map(|k| 1000 * conv + k));
        req(&h)
    };
    let a = router.decide(&turn(1, 4)).unwrap();
    assert!(!a.continues());
    // A second conversation on the same harness starts elsewhere: the
    // harness is worth 4 blocks of credit, the load 2 x 3 units.
    let b = router.decide(&turn(2, 4)).unwrap();
    assert!(!b.continues());
    assert_ne!(a.primary(), b.primary());
    assert_eq!(b.overlap, 0);
    // The first conversation's next turn continues its prompt and
    // returns to its replica, busy as it is.
    let a2 = router.decide(&turn(1, 8)).unwrap();
    assert!(a2.continues());
    assert_eq!(a2.primary(), a.primary());
    assert_eq!(a2.overlap, 36);
}

#[test]
fn a_prompt_no_replica_holds_goes_where_the_least_prompt_is_read_before_it() {
    // Replica 0 still reads one request's 16-block prompt (32 KiB: half a
    // load unit); replica 1 runs three requests whose prompts are read.
    // Then a prompt nothing holds arrives, and `follower`, the first
    // request's prompt with more after it.
    let place = |cold_read_weight: f64| {
        let r = fleet("127.0.0.1:1,127.0.0.1:2", |p| {
            p.resident_load = 0.0;
            p.cold_read_weight = cold_read_weight;
        });
        let now = Instant::now();
        let reading: Vec<u64> = (1..=16).collect();
        let mut held = vec![r.decide_within_at(&req(&reading), Some(&[0]), now).unwrap()];
        for k in 0..3 {
            let d = r
                .decide_within_at(&req(&[100 + k]), Some(&[1]), now)
                .unwrap();
            d.prefill().done_at(now);
            held.push(d);
        }
        let cold = r
            .decide_at(&req(&(500..508).collect::<Vec<_>>()), now)
            .unwrap();
        assert_eq!(cold.overlap, 0);
        let follower = r
            .decide_at(&req(&(1..=20).collect::<Vec<_>>()), now)
            .unwrap();
        (cold.primary(), follower.primary(), follower.overlap)
    };
    // By default each block read ahead weighs a load unit: the 16 blocks
    // on replica 0 weigh more than replica 1's three requests.
    assert_eq!(RouterParams::default().cold_read_weight, 1.0);
    assert_eq!(place(1.0), (1, 0, 16));
    // At 0 the unread 32 KiB weigh their half load unit, as for any other
    // request: replica 0 (1.5 units) looks less loaded than replica 1 (3).
    assert_eq!(place(0.0), (0, 0, 16));
    // A prompt some replica holds is placed as before either way: the
    // follower goes where its first 16 blocks are (being) read.
}

#[test]
fn a_later_turn_weighs_load_differences_in_proportion_on_busy_replicas() {
    // Where a conversation of `blocks` blocks goes for its next turn, with
    // `home` (the replica that read it) running `at_home` requests and the
    // other `away`, engine 0 reporting `waiting` requests queued, and
    // `HEARTH_HOTSPOT_RATIO` at `ratio`.
    let next_turn_beside =
        |ratio: f64, above: f64, blocks: u64, at_home: u64, away: u64, waiting: f64| {
            let r = fleet("127.0.0.1:1,127.0.0.1:2", |p| {
                p.resident_load = 0.0;
                p.relative_load_above = above;
                p.hotspot_ratio = ratio;
            });
            let now = Instant::now();
            let conversation: Vec<u64> = (1..=blocks).collect();
            let first = r.decide_at(&req(&conversation), now).unwrap();
            let home = first.primary();
            drop(first);
            let mut running = Vec::new();
            for (replica, n) in [(home, at_home), (1 - home, away)] {
                for k in 0..n {
                    let d = r
                        .decide_within_at(
                            &req(&[1000 * (replica as u64 + 1) + k]),
                            Some(&[replica]),
                            now,
                        )
                        .unwrap();
                    d.prefill().done_at(now);
                    running.push(d);
                }
            }
            if waiting > 0.0 {
                r.set_engine_signals(
                    "127.0.0.1:1".parse().unwrap(),
                    EngineSignals::queue(0.0, waiting, now),
                );
            }
            let next = r
                .decide_at(&req(&(1..=blocks + 2).collect::<Vec<_>>()), now)
                .unwrap();
            assert!(next.continues());
            (next.primary() == home, next.candidates.len())
        };
    let ratio = RouterParams::default().hotspot_ratio;
    assert_eq!(ratio, 8.0);
    let next_turn = |above: f64, blocks: u64, at_home: u64, away: u64, waiting: f64| {
        next_turn_beside(ratio, above, blocks, at_home, away, waiting)
    };
    // Six requests more at home than away outweigh the conversation's four
    // blocks when the replicas run few (a mean of 5: the setting's 8 is
    // not reached) ...
    assert_eq!(next_turn(8.0, 4, 8, 2, 0.0), (false, 2));
    // ... and not when they run many: at a mean of 21 the difference
    // weighs 8/21 of itself, 2.3 units against 4 blocks.
    assert_eq!(next_turn(8.0, 4, 24, 18, 0.0), (true, 2));
    // Counted as they are (0), they do.
    assert_eq!(next_turn(0.0, 4, 24, 18, 0.0), (false, 2));
    // Once an engine has requests waiting, each one more is a whole
    // request's wait: the difference counts as it is again.
    assert_eq!(next_turn(8.0, 4, 24, 18, 1.0), (false, 2));
    // A hotspot raises the mean itself: 60 requests at home and 7 away,
    // scaled by their mean of 33.5, would weigh 12.7 units against a
    // conversation of 20 blocks. Past eight times the other's load, the
    // difference counts as it is and the turn leaves the hotspot ...
    assert_eq!(next_turn(8.0, 20, 60, 7, 0.0), (false, 2));
    // ... while at six times (48 against 8: 40 more, weighing 8/28 of
    // themselves, 11.4 units) it stays with its 20 blocks ...
    assert_eq!(next_turn(8.0, 20, 48, 8, 0.0), (true, 2));
    // ... unless the operator sets the bound below six times.
    assert_eq!(next_turn_beside(4.0, 8.0, 20, 48, 8, 0.0), (false, 2));
}

#[test]
fn one_shot_requests_on_an_app_prompt_keep_to_the_replica_that_read_it() {
    let router = fleet("127.0.0.1:1001,127.0.0.1:1002", |_| {});
    // Apps' 12-block system prompts, each request one of them and a
    // one-block question: no request ever extends an earlier prompt.
    let question = |app: u64, q: u64| {
        let mut h: Vec<u64> = (1..=12).map(|k| app * 100 + k).collect();
        h.push(app * 100 + 50 + q);
        req(&h)
    };
    let t0 = Instant::now();
    let on = |i: usize, r: &RequestInfo| router.decide_within_at(r, Some(&[i]), t0).unwrap();
    // Replica 0 runs five requests and has read apps 1 and 2.
    let running: Vec<_> = (0..5).map(|k| on(0, &req(&[90_000 + k]))).collect();
    drop(on(0, &question(1, 0)));
    drop(on(0, &question(2, 0)));
    // While first turns are taken to start conversations (as agents'
    // do), a new question goes where the load is lower: 4 blocks of
    // credit against 5 load units.
    let snap = router.snapshot_at(t0);
    assert_eq!(
        (snap.first_turn_sequel_share, snap.first_turn_cap_now),
        (1.0, 4)
    );
    let early = router.decide_at(&question(1, 1), t0).unwrap();
    assert!(!early.continues());
    assert_eq!((early.primary(), early.overlap), (1, 0));
    drop(early);
    // More one-shot requests, elsewhere, each answered at once.
    for k in 0..22 {
        drop(on(1, &req(&[80_000 + k])));
    }
    // Once the horizon has passed since their answers ended (as the next
    // decision saw), with none of them extended, first turns hold no
    // conversation: app 2's prompt counts in full and its next question
    // goes where it is held, busy as that replica is.
    let later = t0 + router.params().sequel_horizon;
    let d = router.decide_at(&question(2, 1), later).unwrap();
    assert!(!d.continues());
    assert_eq!((d.primary(), d.overlap), (0, 12));
    // 24 answered first turns settled as one-shot (the last one's end
    // was seen only now) against a prior of 16 continued: the share is
    // 0.4 and the cap 4 / 0.4. The five still running count nothing.
    let snap = router.snapshot_at(later);
    assert!((snap.first_turn_sequel_share - 16.0 / 40.0).abs() < 1e-9);
    assert_eq!(snap.first_turn_cap_now, 10);
    drop(running);
}

#[test]
fn reservations_last_until_dropped_and_push_new_work_elsewhere() {
    let router = router(|p| p.score.alpha = 100.0);
    let a = router.decide(&req(&[7])).unwrap();
    let b = router.decide(&req(&[8])).unwrap();
    assert_ne!(a.primary(), b.primary(), "load spreads cold requests");
    let snap = router.snapshot();
    assert_eq!(snap.replicas.iter().map(|r| r.in_flight).sum::<u32>(), 2);
    drop(a);
    drop(b);
    let snap = router.snapshot();
    assert!(snap
        .replicas
        .iter()
        .all(|r| r.in_flight == 0 && r.load == 0.0));
}

#[test]
fn a_prompt_weighs_its_unread_bytes_until_its_first_token_then_one_unit() {
    // 64 KiB of prompt a load unit: a cold prompt of 64 blocks (128 KiB)
    // weighs 1 + 2 units until it is read.
    let router = fleet("127.0.0.1:1001,127.0.0.1:1002", |p| {
        p.load_unit_bytes = 65_536;
    });
    let hashes: Vec<u64> = (1..=64).collect();
    let load = |router: &Router, k: usize| router.snapshot().replicas[k].load;
    let a = router.decide(&req(&hashes)).unwrap();
    let home = a.primary();
    assert!(
        (load(&router, home) - 3.0).abs() < 1e-9,
        "{}",
        load(&router, home)
    );
    let prefill = a.prefill().clone();
    prefill.done();
    assert!((load(&router, home) - 1.0).abs() < 1e-9);
    // Once: a second report of the first token (the stream and the
    // outcome filter both saw it) changes nothing.
    prefill.clone().done();
    a.prefill().done();
    assert!((load(&router, home) - 1.0).abs() < 1e-9);
    // A warm turn reads only its new blocks: 8 of 72, a quarter unit.
    let longer: Vec<u64> = (1..=72).collect();
    let b = router.decide(&req(&longer)).unwrap();
    assert_eq!(b.primary(), home);
    assert!((load(&router, home) - 2.25).abs() < 1e-9);
    // The end gives back what is left, whether or not the first token
    // came; after it, a late first token is nothing.
    drop(a);
    assert!((load(&router, home) - 1.25).abs() < 1e-9);
    let late = b.prefill().clone();
    drop(b);
    late.done();
    let snap = router.snapshot();
    assert!(snap
        .replicas
        .iter()
        .all(|r| r.in_flight == 0 && r.load == 0.0));
}

#[test]
fn model_restrictions_and_no_eligible_replica() {
    let router = router(|_| {});
    let mut special = req(&[1]);
    special.model = Some("special".into());
    // Replicas 0 and 1 serve any model, replica 2 only "special".
    let d = router.decide(&special).unwrap();
    assert_eq!(d.order.len(), 3);
    let none = RequestInfo {
        model: Some("other".into()),
        ..req(&[1])
    };
    let d = router.decide(&none).unwrap();
    assert!(!d.order.contains(&2), "replica 2 serves only 'special'");
}

#[test]
fn saturation_and_unknown_models_are_errors() {
    let only = fleet("127.0.0.1:1;model=a", |p| {
        p.max_inflight = 1;
    });
    let mut r = req(&[1]);
    r.model = Some("a".into());
    let held = only.decide(&r).unwrap();
    assert_eq!(only.decide(&r).unwrap_err(), RouteError::Saturated);
    drop(held);
    assert!(only.decide(&r).is_ok());
    r.model = Some("b".into());
    assert_eq!(
        only.decide(&r).unwrap_err(),
        RouteError::NoReplicaForModel("b".into())
    );
}

#[test]
fn fenced_replicas_get_no_traffic_and_none_healthy_is_an_error() {
    use hearth_router::health::Failure;
    let router = router(|_| {});
    // Empty answers only make it suspect; refused connections fence.
    for _ in 0..3 {
        router.record_request(0, Outcome::Failure(Failure::EmptyAnswer));
    }
    assert_eq!(router.fleet_health(), FleetHealth::Ok);
    for _ in 0..3 {
        router.record_request(0, Outcome::Failure(Failure::ConnectFailure));
    }
    for _ in 0..20 {
        let d = router.decide(&req(&[9])).unwrap();
        assert!(!d.order.contains(&0), "fenced replica 0 was offered");
    }
    assert_eq!(router.fleet_health(), FleetHealth::Degraded);
    for i in 1..3 {
        for _ in 0..3 {
            router.record_request(i, Outcome::Failure(Failure::ConnectFailure));
        }
    }
    assert_eq!(router.fleet_health(), FleetHealth::Unhealthy);
    assert!(matches!(
        router.decide(&req(&[9])),
        Err(RouteError::NoHealthyReplica(_))
    ));
}

fn lane_router(lane: &str) -> Arc<Router> {
    fleet("127.0.0.1:1,127.0.0.1:2,127.0.0.1:3;tag=long", |p| {
        p.long_prompt_bytes = 100000;
        p.long_lane = lane.parse().unwrap();
        p.fallbacks = 5;
    })
}

fn sized(hashes: &[u64], bytes: u64) -> RequestInfo {
    RequestInfo {
        hashes: hashes.to_vec(),
        prompt_bytes: bytes,
        model: None,
        max_output_tokens: None,
        cache: Default::default(),
        priority: 0,
        flow: 0,
    }
}

#[test]
fn long_prompts_go_only_to_the_long_lane() {
    for lane in ["shared", "exclusive", "avoid", "avoid-unless-warm"] {
        let r = lane_router(lane);
        let d = r.decide(&sized(&[1], 200_000)).unwrap();
        assert_eq!(d.order, [2], "{lane}");
    }
}

#[test]
fn short_prompts_follow_the_lane_setting() {
    let r = lane_router("shared");
    assert_eq!(r.decide(&sized(&[1], 10)).unwrap().order.len(), 3);
    for lane in ["exclusive", "avoid", "avoid-unless-warm"] {
        let r = lane_router(lane);
        let d = r.decide(&sized(&[1], 10)).unwrap();
        assert!(!d.order.contains(&2), "{lane}: {:?}", d.order);
    }
    // Avoid falls back to the long replica when nothing else is left;
    // exclusive does not.
    for (lane, expect_ok) in [("avoid", true), ("exclusive", false)] {
        let r = lane_router(lane);
        for i in 0..2 {
            for _ in 0..3 {
                r.record_request(
                    i,
                    Outcome::Failure(hearth_router::health::Failure::ConnectFailure),
                );
            }
        }
        assert_eq!(r.decide(&sized(&[1], 10)).is_ok(), expect_ok, "{lane}");
    }
}

#[test]
fn avoid_unless_warm_keeps_a_long_replica_that_holds_the_session() {
    let r = lane_router("avoid-unless-warm");
    // The session started long, on the long replica.
    drop(r.decide(&sized(&[7, 8, 9], 200_000)).unwrap());
    // Its next (short, after compaction-like trimming) prompt shares
    // the prefix: the long replica stays eligible, and wins on warmth.
    let d = r.decide(&sized(&[7, 8, 9, 10], 50)).unwrap();
    assert_eq!(d.primary(), 2);
    // A cold short prompt does not get it.
    let d = r.decide(&sized(&[99], 50)).unwrap();
    assert!(!d.order.contains(&2));
}

#[test]
fn a_replica_with_a_request_running_is_not_probed() {
    let r = fleet("127.0.0.1:1,127.0.0.1:2", |_| {});
    let ids = |r: &Router| -> Vec<String> { r.probe_targets().into_iter().map(|t| t.id).collect() };
    assert_eq!(
        ids(&r),
        ["replica-0", "replica-1"],
        "both idle, never probed"
    );
    let running = r.decide(&req(&[1, 2])).unwrap();
    let busy = running.primary();
    let other = r.replicas()[1 - busy].id.clone();
    assert_eq!(
        ids(&r),
        std::slice::from_ref(&other),
        "the running request is the evidence"
    );
    // A probe that timed out behind it is no strike.
    let key = (r.replicas()[busy].addr, None);
    for _ in 0..5 {
        r.record_probe(
            key,
            Outcome::Failure(hearth_router::health::Failure::Timeout),
        );
    }
    assert_eq!(r.snapshot().replicas[busy].health.consecutive_failures, 0);
    // Once it ends, the probe just recorded counts for the interval.
    drop(running);
    assert_eq!(ids(&r), [other]);
    // Without a request running, the same timeouts strike.
    for _ in 0..3 {
        r.record_probe(
            key,
            Outcome::Failure(hearth_router::health::Failure::Timeout),
        );
    }
    assert_eq!(r.snapshot().replicas[busy].health.consecutive_failures, 3);
}

#[test]
fn data_parallel_ranks_are_separate_targets_behind_one_address() {
    let r = fleet("127.0.0.1:1;id=e;dp=2,127.0.0.1:2", |_| {});
    let table = r.replicas();
    let ids: Vec<_> = table.iter().map(|x| x.id.as_str()).collect();
    assert_eq!(ids, ["e/rank0", "e/rank1", "replica-1"]);
    assert_eq!(r.replicas()[1].dp_rank, Some(1));
    // The destination names each address once.
    let mut d = r.decide(&req(&[1])).unwrap();
    d.order = vec![0, 1, 2];
    assert_eq!(d.destination(3), "127.0.0.1:1,127.0.0.1:2");
    assert_eq!(d.destination(1), "127.0.0.1:1");
    drop(d);
    assert_eq!(r.replica_at("127.0.0.1:1", Some(1)), Some(1));
    // Warmth is per rank: a session returns to its rank.
    let first = r.decide(&req(&[4, 5])).unwrap();
    let rank = first.primary();
    drop(first);
    assert_eq!(r.decide(&req(&[4, 5, 6])).unwrap().primary(), rank);
    // Health is per rank: a stuck rank is fenced alone (its requests'
    // timeouts make it suspect, its own probes time out).
    r.record_request(0, Outcome::Failure(hearth_router::health::Failure::Timeout));
    assert_eq!(
        r.snapshot().replicas[0].health.state,
        hearth_router::HealthState::Serving
    );
    for _ in 0..3 {
        r.record_probe(
            (table[0].addr, Some(0)),
            Outcome::Failure(hearth_router::health::Failure::Timeout),
        );
    }
    let snap = r.snapshot();
    let states: Vec<_> = snap.replicas.iter().map(|x| x.health.state).collect();
    use hearth_router::health::HealthState::{Fenced, Serving};
    assert_eq!(states, [Fenced, Serving, Serving]);
    // Probes go to the fenced rank (backoff over) with its rank, and
    // to the idle others; a probe's outcome lands on its rank only.
    r.record_probe(
        (table[1].addr, Some(1)),
        Outcome::Failure(hearth_router::health::Failure::ServerError),
    );
    assert_eq!(r.snapshot().replicas[1].health.consecutive_failures, 1);
    assert_eq!(r.snapshot().replicas[0].health.consecutive_failures, 3);
}

#[test]
fn paused_conversations_count_against_their_replica_for_new_ones() {
    // Four new conversations share a 32-block system prompt; each
    // runs its first turn and pauses (its reservation dropped).
    let four = |resident_load: f64| {
        let list = "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3,127.0.0.1:4";
        fleet(list, |p| p.resident_load = resident_load)
    };
    let place = |resident_load: f64| {
        let r = four(resident_load);
        let mut homes = Vec::new();
        for c in 0..4u64 {
            let mut h: Vec<u64> = (1..=32).collect();
            h.extend((0..4).map(|k| 1000 * (c + 1) + k));
            homes.push(r.decide(&req(&h)).unwrap().primary());
        }
        homes
    };
    // Paused conversations weigh nothing: the prompt's holder takes
    // every newcomer (its credit beats no load anywhere).
    let packed = place(0.0);
    assert!(packed.iter().all(|&h| h == packed[0]), "{packed:?}");
    // Resident conversations count: one per replica.
    let mut spread = place(5.0);
    spread.sort();
    assert_eq!(spread, [0, 1, 2, 3]);
    // The same when the four arrive together: each first turn is still
    // running (its reservation held) when the next is placed.
    let together = |resident_load: f64| {
        let r = four(resident_load);
        let mut running = Vec::new();
        for c in 0..4u64 {
            let mut h: Vec<u64> = (1..=32).collect();
            h.extend((0..4).map(|k| 1000 * (c + 1) + k));
            running.push(r.decide(&req(&h)).unwrap());
        }
        let mut homes: Vec<usize> = running.iter().map(|d| d.primary()).collect();
        homes.sort();
        homes
    };
    assert_eq!(together(5.0), [0, 1, 2, 3]);
    // Without the term, a running first turn's reservation alone does
    // not outweigh the shared prompt's credit.
    let packed = together(0.0);
    assert!(packed.windows(2).any(|w| w[0] == w[1]), "{packed:?}");
    // A conversation's next turn still goes home, whatever resides
    // there; and it does not count against the home twice.
    let r = four(5.0);
    let mut turn: Vec<u64> = (1..=32).collect();
    turn.extend([7001, 7002]);
    let home = r.decide(&req(&turn)).unwrap().primary();
    for k in 0..5u64 {
        turn.extend([8000 + 2 * k, 8001 + 2 * k]);
        assert_eq!(r.decide(&req(&turn)).unwrap().primary(), home);
    }
    let resident = r.snapshot().replicas[home].resident_conversations;
    assert_eq!(resident, 1, "one conversation, one resident entry");
}

#[test]
fn a_prefix_no_replica_holds_starts_where_fewer_requests_are_drawn() {
    // One-shot requests of an app: groups of users share a 7-block
    // system prompt, each request its own question block.
    let request = |group: u64, user: u64| {
        let mut h: Vec<u64> = (1..=7).map(|k| 100 * group + k).collect();
        h.push(10_000 * group + user);
        req(&h)
    };
    let place_third_group = |resident_load: f64| {
        let r = fleet("127.0.0.1:1,127.0.0.1:2", |p| {
            p.resident_load = resident_load
        });
        // Two groups start, one on each replica.
        let second = r.decide(&request(2, 0)).unwrap().primary();
        let first = r.decide(&request(1, 0)).unwrap().primary();
        // Six users of the first group follow its prefix, one of the
        // second's.
        for user in 1..=6 {
            assert_eq!(r.decide(&request(1, user)).unwrap().primary(), first);
        }
        // That one still runs when the third group comes: by the load of
        // the instant, the third would start on `first`.
        let running = r.decide(&request(2, 1)).unwrap();
        assert_eq!(running.primary(), second);
        let third = r.decide(&request(3, 0)).unwrap().primary();
        // A prompt a replica holds is not weighed so: the first group's
        // next users still go to their prefix, drawn there as it is.
        for user in 7..=12 {
            assert_eq!(r.decide(&request(1, user)).unwrap().primary(), first);
        }
        (first, second, third)
    };
    let (first, second, third) = place_third_group(5.0);
    assert_ne!(first, second);
    assert_eq!(
        third, second,
        "seven requests drawn to one, two to the other"
    );
    // Without the term, the instant's load alone places it.
    let (first, _, third) = place_third_group(0.0);
    assert_eq!(third, first);
}

#[test]
fn engine_figures_add_load_until_they_go_stale() {
    let r = fleet("127.0.0.1:1,127.0.0.1:2", |p| {
        p.engine_stale = Duration::from_secs(5);
        p.max_queue = 4;
        p.resident_load = 0.0;
    });
    let busy = |waiting: f64, running: f64, age: u64| {
        EngineSignals::queue(running, waiting, Instant::now() - Duration::from_secs(age))
    };
    let a: SocketAddr = "127.0.0.1:1".parse().unwrap();
    // Another gateway keeps engine 0 busy: new work goes to engine 1.
    r.set_engine_signals(a, busy(0.0, 6.0, 0));
    for k in 0..4 {
        assert_eq!(r.decide(&req(&[100 + k])).unwrap().primary(), 1);
    }
    // Stale figures are ignored.
    r.set_engine_signals(a, busy(0.0, 60.0, 30));
    let d = r.decide(&req(&[200])).unwrap();
    assert_eq!(d.order.len(), 2);
    // A full queue everywhere sheds.
    r.set_engine_signals(a, busy(4.0, 0.0, 0));
    r.set_engine_signals("127.0.0.1:2".parse().unwrap(), busy(9.0, 0.0, 0));
    assert_eq!(r.decide(&req(&[300])).unwrap_err(), RouteError::Saturated);
}

#[test]
fn output_profiles_break_ties() {
    let r = fleet("127.0.0.1:1,127.0.0.1:2;profile=short-output", |_| {});
    let with_cap = |hashes: &[u64], cap: Option<u64>| RequestInfo {
        max_output_tokens: cap,
        ..req(hashes)
    };
    for k in 0..4 {
        assert_eq!(
            r.decide(&with_cap(&[10 + k], Some(16))).unwrap().primary(),
            1
        );
        assert_eq!(
            r.decide(&with_cap(&[20 + k], Some(4096)))
                .unwrap()
                .primary(),
            0
        );
    }
    // Warmth still beats the profile.
    drop(r.decide(&with_cap(&[30], Some(4096))).unwrap());
    assert_eq!(
        r.decide(&with_cap(&[30, 31], Some(16))).unwrap().primary(),
        0
    );
}

#[test]
fn destination_lists_fallbacks_in_rank_order() {
    let router = router(|p| p.fallbacks = 1);
    let d = router.decide(&req(&[5])).unwrap();
    assert_eq!(d.order.len(), 2);
    let dest = d.destination(usize::MAX);
    assert_eq!(dest.split(',').count(), 2);
    assert_eq!(
        router.replica_at(dest.split(',').next().unwrap(), None),
        Some(d.primary())
    );
}

fn specs(list: &str) -> Vec<UpstreamSpec> {
    list.split(',').map(|u| u.parse().unwrap()).collect()
}

#[test]
fn a_reload_keeps_listed_replicas_warm_and_loaded() {
    let r = fleet(
        "127.0.0.1:1001;id=a,127.0.0.1:1002;id=b,127.0.0.1:1003;id=c",
        |p| {
            p.score.alpha = 0.0;
        },
    );
    // A session on some replica, with a request still running there.
    drop(r.decide(&req(&[1, 2, 3])).unwrap());
    let running = r.decide(&req(&[1, 2, 3, 4])).unwrap();
    let home = running.primary();
    let home_addr = r.replicas()[home].addr;
    let before = r.snapshot();
    let version = r.version();

    // The list now names the home replica (under a new id), drops one
    // other and adds a new one.
    let other = (0..3).find(|&i| i != home).unwrap();
    let kept_other = (0..3).find(|&i| i != home && i != other).unwrap();
    let addr = |i: usize| r.replicas()[i].addr;
    let list = format!(
        "{home_addr};id=home,{};id={},127.0.0.1:1009;id=new",
        addr(kept_other),
        r.replicas()[kept_other].id
    );
    let summary = r.set_upstreams(&specs(&list));
    assert_eq!(
        (
            summary.added,
            summary.removed,
            summary.updated,
            summary.unchanged
        ),
        (1, 1, 1, 1),
        "{summary}"
    );
    assert_ne!(r.version(), version);
    let after = r.snapshot();
    let ids: Vec<&str> = after.replicas.iter().map(|x| x.id.as_str()).collect();
    assert_eq!(ids.len(), 3);
    assert_eq!(ids[0], "home");
    assert_eq!(ids[2], "new", "listed in the file's order");
    let home_now = after.replicas.iter().find(|x| x.id == "home").unwrap();
    let home_before = &before.replicas[home];
    assert_eq!(home_now.warmth_blocks, home_before.warmth_blocks);
    assert_eq!(home_now.in_flight, 1);
    assert_eq!(home_now.load, home_before.load);
    assert_eq!(
        r.endpoints(),
        [
            home_addr,
            addr(kept_other),
            "127.0.0.1:1009".parse().unwrap()
        ]
    );

    // The session's next turn stays home; the removed replica is never
    // offered again.
    let removed_addr = before.replicas[other].address.clone();
    let d = r.decide(&req(&[1, 2, 3, 4, 5])).unwrap();
    assert_eq!(r.replicas()[d.primary()].addr, home_addr);
    for k in 0..10 {
        let d = r.decide(&req(&[500 + k])).unwrap();
        let dest = d.destination(usize::MAX);
        assert!(!dest.contains(&removed_addr), "{dest}");
    }
    drop(d);
    drop(running);
    assert!(r.snapshot().replicas.iter().all(|x| x.in_flight == 0));
}

#[test]
fn a_removed_replica_drains_before_its_slot_is_reused() {
    let r = fleet("127.0.0.1:1,127.0.0.1:2", |_| {});
    let held = r.decide(&req(&[7])).unwrap();
    let slot = held.primary();
    let addr = r.replicas()[slot].addr;
    let remaining = r.replicas()[1 - slot].addr;
    r.set_upstreams(&specs(&remaining.to_string()));
    assert_eq!(r.snapshot().upstreams.draining_in_flight, 1);
    // A new replica cannot take the slot while a request runs on it.
    r.set_upstreams(&specs(&format!("{remaining},127.0.0.1:3")));
    assert_eq!(r.replicas().len(), 3);
    assert!(r.replicas()[slot].retired);
    // The running request ends: its reservation releases the old slot
    // (not the new replica), which the next new replica reuses.
    drop(held);
    assert_eq!(r.snapshot().upstreams.draining_in_flight, 0);
    assert!(r.snapshot().replicas.iter().all(|x| x.in_flight == 0));
    r.set_upstreams(&specs(&format!("{remaining},127.0.0.1:3,127.0.0.1:4")));
    assert_eq!(r.replicas().len(), 3);
    assert_eq!(r.replicas()[slot].addr.port(), 4);
    assert_ne!(r.replicas()[slot].addr, addr);
    // Re-adding a removed address starts it fresh, not from old state.
    assert_eq!(r.snapshot().replicas.len(), 3);
}

#[test]
fn a_prompt_served_on_a_fallback_is_warm_there() {
    let r = fleet("127.0.0.1:1,127.0.0.1:2", |_| {});
    let d = r.decide(&req(&[1, 2, 3])).unwrap();
    let (chosen, fallback) = (d.primary(), 1 - d.primary());
    drop(d);
    // Envoy retried it on the fallback, which now holds it.
    r.record_served_elsewhere(fallback, &[1, 2, 3]);
    let s = r.snapshot();
    assert_eq!(s.replicas[fallback].warmth_blocks, 3);
    assert_eq!(s.replicas[chosen].warmth_blocks, 3);
}

#[test]
fn a_decision_says_how_much_of_the_prompt_its_replica_must_read() {
    let r = fleet("127.0.0.1:1", |_| {});
    let first = sized(&[1, 2, 3], 3 * 2048);
    let d = r.decide(&first).unwrap();
    assert_eq!(d.uncached_bytes(), 3 * 2048);
    drop(d);
    // The next turn: three blocks held, one and a half new.
    let next = sized(&[1, 2, 3, 4, 5], 4 * 2048 + 1024);
    assert_eq!(r.decide(&next).unwrap().uncached_bytes(), 2048 + 1024);
}

#[test]
fn a_continuing_decision_names_its_previous_turn_its_conversation_and_where_it_went() {
    let router = router(|p| p.score.alpha = 0.0);
    let first = router.decide(&req(&[1, 2, 3])).unwrap();
    assert_eq!(first.continuation, None);
    assert_eq!(first.tip(), Some(3));
    let home = first.replicas[first.primary()].key();
    drop(first);
    let second = router.decide(&req(&[1, 2, 3, 4, 5])).unwrap();
    let c = second.continuation.expect("turn 2 continues turn 1");
    assert_eq!((c.tip, c.conversation, c.from), (3, 3, home));
    assert_eq!(second.tip(), Some(5));
    assert_eq!(second.prediction.conversation, Some(3));
    drop(second);
    // Turn 3: the previous turn is turn 2, the conversation still turn 1's.
    let third = router.decide(&req(&[1, 2, 3, 4, 5, 6])).unwrap();
    let c = third.continuation.unwrap();
    assert_eq!((c.tip, c.conversation), (5, 3));
    // A prompt shorter than a block leaves no tip.
    let mut short = req(&[77]);
    short.prompt_bytes = 100;
    assert_eq!(router.decide(&short).unwrap().tip(), None);
}

#[test]
fn a_short_conversation_stays_where_it_read_its_partial_last_block_beside_another_request() {
    let router = fleet("127.0.0.1:1001,127.0.0.1:1002", |_| {});
    let turn = |hashes: &[u64], bytes: u64| RequestInfo {
        prompt_bytes: bytes,
        ..req(hashes)
    };
    // Turn 1: one full block and 1,800 bytes of a second, which turn 2
    // fills with other text (its hash changes).
    let first = router.decide(&turn(&[1, 2], 2048 + 1800)).unwrap();
    let home = first.primary();
    drop(first);
    // Another request runs on the same replica (it follows the same prompt,
    // then has 16 KiB of its own: a quarter of a load unit more).
    let busy = router
        .decide(&turn(&[1, 2, 5, 6, 7, 8, 9, 10, 11, 12], 2048 * 10))
        .unwrap();
    assert_eq!(busy.primary(), home);
    // Turn 2 shares one named block with home, and home holds the 1,800
    // bytes after it too: that outweighs one running request.
    let second = router.decide(&turn(&[1, 3, 4], 2 * 2048 + 500)).unwrap();
    assert!(second.continues());
    assert_eq!(second.overlap, 1);
    assert_eq!(second.primary(), home, "{:?}", second.candidates);
}

#[test]
fn prompts_still_being_read_weigh_as_counted_beside_requests_that_run() {
    // A conversation of 4 blocks read at home; home then runs 25 requests
    // and away 18, none waiting (mean above the setting's 8: differences
    // of running requests weigh in proportion).
    let next_turn = |home_reading: bool| {
        let r = fleet("127.0.0.1:1,127.0.0.1:2", |p| {
            p.resident_load = 0.0;
            p.relative_load_above = 8.0;
        });
        let now = Instant::now();
        let first = r.decide_at(&req(&[1, 2, 3, 4]), now).unwrap();
        let home = first.primary();
        drop(first);
        let mut running = Vec::new();
        for (replica, n) in [(home, 25), (1 - home, 18)] {
            for k in 0..n {
                let hashes: Vec<u64> = if replica == home && k == 0 && home_reading {
                    // 96 blocks of 2 KiB nobody holds: 3 load units of
                    // prompt still being read (its first token not out).
                    (0..96).map(|b| 50_000 + b).collect()
                } else {
                    vec![1000 * (replica as u64 + 1) + k]
                };
                let d = r
                    .decide_within_at(&req(&hashes), Some(&[replica]), now)
                    .unwrap();
                if hashes.len() == 1 {
                    d.prefill().done_at(now);
                }
                running.push(d);
            }
        }
        let next = r.decide_at(&req(&[1, 2, 3, 4, 5, 6]), now).unwrap();
        assert!(next.continues());
        next.primary() == home
    };
    // Seven running requests more at home weigh 8/25 of themselves (2.2
    // units) against the conversation's 4 blocks: it stays.
    assert!(next_turn(false));
    // When one of home's requests is a 192 KiB prompt still being read,
    // those 3 units count in full (a first token waits for them), 5.2
    // units in all: it moves. Scaled with the rest (10 units more at a
    // mean of 23, 3.5 units) it would have stayed.
    assert!(!next_turn(true));
}

#[test]
fn one_shot_requests_weigh_running_load_in_proportion_on_busy_replicas() {
    // Where app 1's next question goes (replica, overlap), with
    // `HEARTH_RELATIVE_LOAD_ABOVE` at `above`, once first turns are
    // one-shot and replica 0, which read the app's 12-block prompt, runs
    // 16 requests more than replica 1.
    let next_question = |above: f64| {
        let router = fleet("127.0.0.1:1001,127.0.0.1:1002", |p| {
            p.resident_load = 0.0;
            p.relative_load_above = above;
        });
        let question = |app: u64, q: u64| {
            let mut h: Vec<u64> = (1..=12).map(|k| app * 100 + k).collect();
            h.push(app * 100 + 50 + q);
            req(&h)
        };
        let t0 = Instant::now();
        let on = |i: usize, r: &RequestInfo, at: Instant| {
            let d = router.decide_within_at(r, Some(&[i]), at).unwrap();
            d.prefill().done_at(at);
            d
        };
        drop(on(0, &question(1, 0), t0));
        // 144 one-shot requests, answered at once, settle once the
        // horizon has passed: 16 continued (the prior) of 160, a sequel
        // share of 0.1.
        for k in 0..144 {
            drop(on(1, &req(&[80_000 + k]), t0));
        }
        let later = t0 + router.params().sequel_horizon;
        drop(on(1, &req(&[79_999]), later));
        let snap = router.snapshot_at(later);
        assert!(
            (snap.first_turn_sequel_share - 0.1).abs() < 1e-9,
            "{}",
            snap.first_turn_sequel_share
        );
        // Replica 0 runs 30 requests, replica 1 runs 14.
        let _running: Vec<_> = (0..30)
            .map(|k| on(0, &req(&[70_000 + k]), later))
            .chain((0..14).map(|k| on(1, &req(&[60_000 + k]), later)))
            .collect();
        let d = router.decide_at(&question(1, 1), later).unwrap();
        assert!(!d.continues());
        (d.primary(), d.overlap)
    };
    // Counted as they are, the 16 outweigh the app's 12 blocks; for
    // one-shot requests they weigh 0.1 + 0.9 x 8/22 of themselves (6.8
    // units), and the question goes where its app is held.
    assert_eq!(next_question(8.0), (0, 12));
    // With the proportional rule off (as for agents' first turns, a
    // share of 1) the 16 weigh in full.
    assert_eq!(next_question(0.0), (1, 0));
}

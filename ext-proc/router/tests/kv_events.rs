//! The engines' KV cache events in the fleet: what a feed changes on its
//! own replica, and that it reaches no other.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use hearth_router::health::HealthState;
use hearth_router::{
    EventEndpoint, RequestInfo, RestartReason, Router, RouterParams, UpstreamSpec,
};
use hearth_wire::kv_events::{Batch, Event, Medium};

fn fleet(list: &str) -> Arc<Router> {
    let specs: Vec<UpstreamSpec> = list.split(',').map(|s| s.parse().unwrap()).collect();
    Router::new(RouterParams::default(), &specs)
}

fn req(hashes: &[u64]) -> RequestInfo {
    RequestInfo {
        hashes: hashes.to_vec(),
        prompt_bytes: hashes.len() as u64 * 2048,
        model: None,
        max_output_tokens: None,
        cache: Default::default(),
        priority: 0,
        flow: 0,
    }
}

fn batch(events: Vec<Event>) -> Batch {
    Batch {
        ts: 0.0,
        events,
        data_parallel_rank: Some(0),
    }
}

fn stored(from: u64, n: u64) -> Event {
    Event::Stored {
        hashes: (0..n).map(|k| from.wrapping_add(k)).collect(),
        parent: None,
        tokens: 16 * n,
        block_size: 16,
        medium: Medium::Device,
    }
}

const A: &str = "127.0.0.1:1001";
const B: &str = "127.0.0.1:1002";

#[test]
fn the_upstream_option_parses_and_refuses_what_it_cannot_read() {
    let spec: UpstreamSpec = format!("{A};kv_events=tcp://127.0.0.1:5557")
        .parse()
        .unwrap();
    assert_eq!(spec.kv_events.unwrap().to_string(), "tcp://127.0.0.1:5557");
    let spec: UpstreamSpec = format!("{A};kv_events=ipc:///tmp/kv.sock").parse().unwrap();
    assert_eq!(spec.kv_events.unwrap().to_string(), "ipc:///tmp/kv.sock");
    let spec: UpstreamSpec =
        format!("{A};kv_events=ipc:///tmp/kv.sock;kv_events_replay=ipc:///tmp/replay.sock")
            .parse()
            .unwrap();
    assert_eq!(
        spec.kv_events_replay.unwrap().to_string(),
        "ipc:///tmp/replay.sock"
    );
    // `auto`: asked of the engine, which names its replay socket too.
    let spec: UpstreamSpec = format!("{A};kv_events=auto").parse().unwrap();
    assert_eq!(spec.kv_events, Some(EventEndpoint::FromEngine));
    assert_eq!(spec.kv_events.unwrap().to_string(), "auto");
    for bad in [
        "kv_events=auto;kv_events_replay=tcp://127.0.0.1:5558",
        "kv_events=tcp://127.0.0.1:5557;kv_events_replay=auto",
        "kv_events=ipc:///tmp/kv.sock;dp=2",
        "kv_events=tcp://127.0.0.1:5557;kv_events_replay=ipc:///tmp/r.sock;dp=2",
        "kv_events=tcp://127.0.0.1:65535;dp=2",
        "kv_events_replay=tcp://127.0.0.1:5558",
        "kv_events=tcp://*:5557",
        "kv_events=tcp://engine:5557",
        "kv_events=ipc://relative",
        "kv_events=udp://127.0.0.1:1",
    ] {
        assert!(
            format!("{A};{bad}").parse::<UpstreamSpec>().is_err(),
            "{bad}"
        );
    }
}

#[test]
fn each_data_parallel_rank_follows_its_own_feed() {
    // As vLLM places them: rank r publishes (and replays) on the port
    // plus r; `auto` asks the engine for each rank's.
    let router = fleet(&format!(
        "{A};id=dp;dp=3;kv_events=tcp://127.0.0.1:5557;kv_events_replay=tcp://127.0.0.1:5600,\
         {B};id=auto;dp=2;kv_events=auto"
    ));
    let sources = router.kv_event_endpoints();
    let shown: Vec<(Option<u32>, String, Option<String>)> = sources
        .iter()
        .map(|s| {
            (
                s.key.1,
                s.endpoint.to_string(),
                s.replay.as_ref().map(|r| r.to_string()),
            )
        })
        .collect();
    let replay = |p: u16| Some(format!("tcp://127.0.0.1:{p}"));
    assert_eq!(
        shown,
        vec![
            (Some(0), "tcp://127.0.0.1:5557".into(), replay(5600)),
            (Some(1), "tcp://127.0.0.1:5558".into(), replay(5601)),
            (Some(2), "tcp://127.0.0.1:5559".into(), replay(5602)),
            (Some(0), "auto".into(), None),
            (Some(1), "auto".into(), None),
        ]
    );
    // A batch reaches its own rank only.
    let (a, t0) = (A.parse::<SocketAddr>().unwrap(), Instant::now());
    router.note_kv_feed((a, Some(1)), true);
    router.apply_kv_batch_at((a, Some(1)), 0, &batch(vec![stored(0, 10)]), t0);
    let held: Vec<(String, usize)> = router
        .snapshot_at(t0)
        .replicas
        .iter()
        .filter_map(|r| Some((r.id.clone(), r.kv_events.as_ref()?.held_blocks)))
        .collect();
    assert_eq!(
        held,
        vec![
            ("dp/rank0".into(), 0),
            ("dp/rank1".into(), 10),
            ("dp/rank2".into(), 0),
            ("auto/rank0".into(), 0),
            ("auto/rank1".into(), 0),
        ]
    );
}

#[test]
fn once_the_engine_has_stored_a_cache_s_worth_since_a_prompt_was_sent_its_credit_is_gone() {
    // One replica: every prompt goes there.
    let router = fleet(&format!("{A};kv_events=tcp://127.0.0.1:5557"));
    let a = (A.parse::<SocketAddr>().unwrap(), None);
    let t0 = Instant::now();
    let kv = || {
        router.snapshot_at(t0).replicas[0]
            .kv_events
            .clone()
            .unwrap()
    };
    let warm = || router.snapshot_at(t0).replicas[0].warmth_blocks;
    router.note_kv_feed(a, true);
    // The engine fills (10 blocks) and evicts one: 10 blocks is its
    // capacity.
    router.apply_kv_batch_at(a, 0, &batch(vec![stored(0, 10)]), t0);
    let removed = Event::Removed {
        hashes: vec![0],
        medium: Medium::Device,
    };
    router.apply_kv_batch_at(a, 1, &batch(vec![removed]), t0);
    // Conversation X is sent there; the engine stores its blocks, then
    // others' (another gateway's, or long answers): 6 blocks, not yet a
    // whole cache's worth since X's were stored.
    let x = [500, 501, 502];
    drop(router.decide_at(&req(&x), t0).unwrap());
    router.apply_kv_batch_at(a, 2, &batch(vec![stored(1000, 3)]), t0);
    router.apply_kv_batch_at(a, 3, &batch(vec![stored(2000, 6)]), t0);
    assert_eq!((warm(), kv().forgotten_blocks_total), (3, 0));
    // Y is sent, then 4 more blocks are stored: 10 since the batch that
    // stored X's, so the engine (least recently used first) holds none of
    // X; Y keeps its credit.
    let y = [700, 701];
    drop(router.decide_at(&req(&y), t0).unwrap());
    router.apply_kv_batch_at(a, 4, &batch(vec![stored(3000, 4)]), t0);
    assert_eq!((warm(), kv().forgotten_blocks_total), (2, 3));
    assert_eq!(router.decide_at(&req(&x), t0).unwrap().overlap, 0);
    assert_eq!(router.decide_at(&req(&y), t0).unwrap().overlap, 2);
    // Inexact figures (a gap) forget nothing.
    let before = warm();
    router.apply_kv_batch_at(a, 9, &batch(vec![stored(5000, 40)]), t0);
    assert!(!kv().exact);
    assert_eq!(warm(), before);
    assert_eq!(kv().forgotten_blocks_total, 3);
}

#[test]
fn a_feed_corrects_its_own_replica_and_reaches_no_other() {
    let router = fleet(&format!("{A};kv_events=tcp://127.0.0.1:5557,{B}"));
    let (a, b): (SocketAddr, SocketAddr) = (A.parse().unwrap(), B.parse().unwrap());
    let t0 = Instant::now();
    // Warmth on both replicas.
    for start in [100, 200, 300, 400] {
        drop(router.decide_at(&req(&[start, start + 1]), t0).unwrap());
    }
    let warm = |i: usize| router.snapshot_at(t0).replicas[i].warmth_blocks;
    assert!(warm(0) > 0 && warm(1) > 0);
    let warm_b = warm(1);
    router.note_kv_feed((a, None), true);
    assert!(router
        .apply_kv_batch_at((a, None), 0, &batch(vec![stored(0, 10)]), t0)
        .is_empty());
    let s = router.snapshot_at(t0);
    let kv = s.replicas[0].kv_events.clone().unwrap();
    assert!(kv.exact);
    assert_eq!(kv.occupancy_tokens, Some(160));
    assert!(s.replicas[1].kv_events.is_none());
    // The cache fills: the engine removes a block, so 10 blocks are its
    // capacity. While its figures are exact they say what it evicts, and
    // the index keeps its size; it takes the engine's (its metrics say
    // none) once they are not (below).
    let removed = Event::Removed {
        hashes: vec![0],
        medium: Medium::Device,
    };
    router.apply_kv_batch_at((a, None), 1, &batch(vec![removed]), t0);
    let s = router.snapshot_at(t0);
    assert_eq!(
        s.replicas[0].kv_events.as_ref().unwrap().capacity_tokens,
        Some(160)
    );
    let full = RouterParams::default().warmth_blocks;
    assert_eq!(s.replicas[0].warmth_capacity, full);
    assert_eq!(s.replicas[1].warmth_capacity, full);
    // A restart, then garbage, then a sequence jumping around: replica A
    // loses its warmth and exactness, never its health; B is untouched.
    let shown = router.apply_kv_batch_at((a, None), 0, &batch(vec![Event::AllCleared]), t0);
    assert_eq!(shown, vec![RestartReason::Sequence, RestartReason::Cleared]);
    for seq in [9, 3, u64::MAX, 0, 77] {
        router.apply_kv_batch_at((a, None), seq, &batch(vec![stored(seq, 3)]), t0);
        router.note_kv_refused((a, None));
    }
    // Batches for the replica without a feed change nothing.
    router.apply_kv_batch_at((b, None), 0, &batch(vec![Event::AllCleared]), t0);
    router.note_kv_refused((b, None));
    let s = router.snapshot_at(t0);
    assert_eq!(s.replicas[1].warmth_blocks, warm_b);
    assert!(s.replicas[1].kv_events.is_none());
    for r in &s.replicas {
        assert_eq!(r.health.state, HealthState::Serving, "{}", r.id);
    }
    let kv = s.replicas[0].kv_events.clone().unwrap();
    assert!(!kv.exact);
    assert_eq!(
        s.replicas[0].warmth_capacity,
        hearth_router::usage::MIN_WARMTH_BLOCKS
    );
    assert_eq!(s.replicas[1].warmth_capacity, full);
    assert_eq!(kv.refused_total, 5);
    assert!(kv.restarts_sequence_total >= 1);
    // Still routable: a decision goes anywhere.
    assert!(router.decide_at(&req(&[100, 101]), t0).is_ok());
}

#[test]
fn while_its_events_are_exact_a_replica_keeps_what_its_engine_holds_beyond_its_stated_size() {
    // The engine's metrics state 1,024 tokens of KV cache: at the default
    // 4 bytes a token, two 2,048-byte blocks, so its index holds the
    // floor, 64 blocks. A conversation of 100 blocks is sent to it; its
    // engine stored all of it and evicted nothing (its events say so).
    let long: Vec<u64> = (1_000..1_100).collect();
    let t0 = Instant::now();
    let overlap_after_one_turn = |events: bool| {
        let list = if events {
            format!("{A};kv_events=tcp://127.0.0.1:5557")
        } else {
            A.to_string()
        };
        let router = fleet(&list);
        let a: SocketAddr = A.parse().unwrap();
        let mut told = hearth_router::EngineSignals::queue(0.0, 0.0, t0);
        told.kv_capacity_tokens = Some(1024.0);
        router.set_engine_signals(a, told);
        if events {
            router.note_kv_feed((a, None), true);
            router.apply_kv_batch_at((a, None), 0, &batch(vec![stored(0, 40)]), t0);
        }
        drop(router.decide_at(&req(&long), t0).unwrap());
        // The engine's next scrape says the same.
        router.set_engine_signals(a, told);
        let overlap = router.decide_at(&req(&long), t0).unwrap().overlap;
        (router, overlap)
    };
    let (_, plain) = overlap_after_one_turn(false);
    assert_eq!(plain, hearth_router::usage::MIN_WARMTH_BLOCKS as u32);
    let (router, evented) = overlap_after_one_turn(true);
    assert_eq!(evented, 100);
    // Once its figures are not exact (a batch missed), the index is cut
    // to the stated size again.
    let a: SocketAddr = A.parse().unwrap();
    router.apply_kv_batch_at((a, None), 5, &batch(vec![stored(100, 1)]), t0);
    let s = router.snapshot_at(t0);
    assert!(!s.replicas[0].kv_events.as_ref().unwrap().exact);
    assert_eq!(
        s.replicas[0].warmth_capacity,
        hearth_router::usage::MIN_WARMTH_BLOCKS
    );
    assert_eq!(
        router.decide_at(&req(&long), t0).unwrap().overlap,
        hearth_router::usage::MIN_WARMTH_BLOCKS as u32
    );
}

fn chain(hashes: std::ops::Range<u64>, parent: Option<u64>) -> Event {
    Event::Stored {
        tokens: 16 * (hashes.end - hashes.start),
        hashes: hashes.collect(),
        parent,
        block_size: 16,
        medium: Medium::Device,
    }
}

fn removed(hashes: std::ops::Range<u64>) -> Event {
    Event::Removed {
        hashes: hashes.collect(),
        medium: Medium::Device,
    }
}

#[test]
fn a_turn_matched_with_its_stored_chain_predicts_the_next_from_what_the_engine_still_holds() {
    use hearth_router::usage::Usage;
    use std::time::Duration;
    let router = fleet(&format!("{A};kv_events=tcp://127.0.0.1:5557"));
    let a = (A.parse::<SocketAddr>().unwrap(), None);
    let kv = |t| router.snapshot_at(t).replicas[0].kv_events.clone().unwrap();
    let t0 = Instant::now();
    router.note_kv_feed(a, true);
    // The engine's cache starts empty; a shared system prompt of 2 blocks
    // (engine hashes 1, 2) is stored by someone else's request.
    router.apply_kv_batch_at(a, 0, &batch(vec![chain(1..3, None)]), t0);
    // Turn 1 of conversation X, and a prompt of another conversation
    // decided beside it: the engine stores X's 10 blocks (2 of them the
    // shared ones it found) and the other's 7, in one step.
    let t1 = t0 + Duration::from_secs(1);
    let x1 = router.decide_at(&req(&[11, 12, 13]), t1).unwrap();
    let other = router.decide_at(&req(&[21, 22]), t1).unwrap();
    router.apply_kv_batch_at(
        a,
        1,
        &batch(vec![chain(100..108, Some(2)), chain(200..205, Some(2))]),
        t1 + Duration::from_millis(50),
    );
    // X's answer fills one more block (its prompt's partial last block
    // and the first tokens it generated).
    router.apply_kv_batch_at(
        a,
        2,
        &batch(vec![chain(108..109, Some(107))]),
        t1 + Duration::from_millis(500),
    );
    let t2 = t1 + Duration::from_secs(2);
    // 10 whole blocks of 16 tokens, 2 from cache: the chain 10 deep.
    let served = x1.record_usage_at(
        Usage {
            prompt_tokens: 165,
            cached_tokens: 32,
        },
        t2,
    );
    assert_eq!(served.unwrap().predicted_tokens, Some(0));
    other.record_usage_at(
        Usage {
            prompt_tokens: 120,
            cached_tokens: 32,
        },
        t2,
    );
    assert_eq!(kv(t2).matched_prompts_total, 2);
    drop((x1, other));
    // Before the engine frees anything, X's next turn is predicted to
    // find its prompt and its answer's block: 11 blocks. (A retried turn
    // of another spelling: the real one comes below.)
    let x2 = router.decide_at(&req(&[11, 12, 13, 99]), t2).unwrap();
    assert_eq!(x2.continuation.unwrap().engine_tip, Some(108));
    assert_eq!(x2.prediction.held_tokens, Some(176));
    drop(x2);
    // Between the turns the engine frees the tail of X's chain (its 5
    // last blocks): 6 blocks, 96 tokens, are left of it.
    router.apply_kv_batch_at(a, 3, &batch(vec![removed(104..109)]), t2);
    // Turn 2 of X is predicted from what the engine holds, not from the
    // whole previous prompt (165 tokens) the warmth index still credits.
    let t3 = t2 + Duration::from_secs(1);
    let x2 = router.decide_at(&req(&[11, 12, 13, 14, 15]), t3).unwrap();
    assert_eq!(x2.continuation.unwrap().engine_tip, Some(108));
    assert_eq!(x2.prediction.held_tokens, Some(96));
    // And credited only that share of its 3 blocks: 96 of 165 tokens of
    // 6,144 bytes, one whole 2,048-byte block.
    assert_eq!(x2.overlap, 1);
    router.apply_kv_batch_at(
        a,
        4,
        &batch(vec![chain(104..112, Some(103)), chain(112..114, Some(111))]),
        t3 + Duration::from_millis(50),
    );
    let served = x2.record_usage_at(
        Usage {
            prompt_tokens: 260,
            cached_tokens: 96,
        },
        t3 + Duration::from_secs(1),
    );
    assert_eq!(served.unwrap().predicted_tokens, Some(96));
    // Matched through turn 1's chain: its tip is 16 blocks deep (the
    // chunked prefill's two events are one chain).
    assert_eq!(kv(t3).matched_prompts_total, 3);
    drop(x2);
    let x3 = router
        .decide_at(&req(&[11, 12, 13, 14, 15, 16]), t3 + Duration::from_secs(2))
        .unwrap();
    assert_eq!(x3.continuation.unwrap().engine_tip, Some(113));
    assert_eq!(x3.prediction.held_tokens, Some(256));
    // Nothing of it freed: the whole previous prompt is credited.
    assert_eq!(x3.overlap, 5);
    drop(x3);
    // Two prompts of one shape beside each other, neither continuing a
    // matched turn: the first answer waits (two chains fit it), the second
    // settles both, in the order they were decided and stored.
    let t4 = t3 + Duration::from_secs(10);
    let p = router.decide_at(&req(&[31, 32]), t4).unwrap();
    let q = router
        .decide_at(&req(&[41, 42]), t4 + Duration::from_millis(1))
        .unwrap();
    // With no history here, each is predicted to find what the last such
    // prompts (X's first turn, and the other) found: the shared 2 blocks.
    assert_eq!(p.prediction.held_tokens, Some(32));
    router.apply_kv_batch_at(
        a,
        5,
        &batch(vec![chain(300..303, Some(2)), chain(400..403, Some(2))]),
        t4 + Duration::from_millis(50),
    );
    let usage = Usage {
        prompt_tokens: 80,
        cached_tokens: 32,
    };
    q.record_usage_at(usage, t4 + Duration::from_secs(1));
    assert_eq!(kv(t4).matched_prompts_total, 3);
    p.record_usage_at(usage, t4 + Duration::from_secs(1));
    assert_eq!(
        (
            kv(t4).matched_prompts_total,
            kv(t4).matched_in_order_prompts_total
        ),
        (5, 2)
    );
    drop((p, q));
    router.apply_kv_batch_at(a, 6, &batch(vec![removed(302..303)]), t4);
    let p2 = router.decide_at(&req(&[31, 32, 33]), t4).unwrap();
    assert_eq!(p2.continuation.unwrap().engine_tip, Some(302));
    assert_eq!(p2.prediction.held_tokens, Some(64));
    let q2 = router.decide_at(&req(&[41, 42, 43]), t4).unwrap();
    assert_eq!(q2.continuation.unwrap().engine_tip, Some(402));
    assert_eq!(q2.prediction.held_tokens, Some(80));
    drop((p2, q2));
    // Inexact figures (a gap) match nothing and predict as before.
    router.apply_kv_batch_at(a, 9, &batch(vec![]), t4);
    let x4 = router
        .decide_at(&req(&[11, 12, 13, 14, 15, 16, 17]), t4)
        .unwrap();
    assert_ne!(x4.prediction.held_tokens, Some(256));
}

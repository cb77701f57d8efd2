//! Flow control's cost with 10,000 requests queued (1,000 tenants in
//! three bands): one look at the queue that lets one request out (`pop`,
//! then the request queued again so the queue stays full), and the same
//! with the sidecar's work for it (where it may go, `Router::room_at`,
//! and its decision among the replicas with room, at 8 replicas; then
//! with slots kept for tenants under their fair share). Prints
//! the queue's memory per request before measuring.
//!
//! Run: `cargo bench -p hearth-router --bench flow -- --warm-up-time 1 --measurement-time 3`

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use hearth_router::params::FlowParams;
use hearth_router::{
    EngineSignals, Entry, FlowQueue, Look, QueueParams, RequestInfo, Room, Router, RouterParams,
    UpstreamSpec,
};

const QUEUED: usize = 10_000;
const TENANTS: usize = 1_000;
const FP_BLOCKS: u64 = 64;

fn request(k: u64) -> RequestInfo {
    let hashes: Vec<u64> = (0..FP_BLOCKS).map(|i| (k << 20) | i).collect();
    RequestInfo {
        prompt_bytes: hashes.len() as u64 * 2048,
        hashes,
        model: Some("m".into()),
        flow: k % TENANTS as u64,
        ..RequestInfo::default()
    }
}

/// A queue that holds twice [`QUEUED`] requests for an hour.
fn deep_queue() -> FlowQueue<RequestInfo> {
    FlowQueue::new(QueueParams {
        ttl: Duration::from_secs(3600),
        max_requests: QUEUED * 2,
        max_bytes: u64::MAX,
        ..QueueParams::default()
    })
}

/// A router over `replicas` loopback addresses from port `base`, with
/// slots kept for tenants under their fair share when `fair`.
fn router(replicas: u16, base: u16, fair: bool) -> (std::sync::Arc<Router>, Vec<UpstreamSpec>) {
    let upstreams: Vec<UpstreamSpec> = (0..replicas)
        .map(|i| format!("127.0.0.1:{}", base + i).parse().expect("address"))
        .collect();
    let mut params = RouterParams::default();
    if fair {
        params.flow = FlowParams {
            fair_window: Duration::from_secs(30),
            ..FlowParams::default()
        };
    }
    (Router::new(params, &upstreams), upstreams)
}

fn full_queue(now: Instant) -> (FlowQueue<RequestInfo>, Vec<String>) {
    let tenants: Vec<String> = (0..TENANTS).map(|t| format!("tenant-{t}")).collect();
    let mut q = deep_queue();
    for k in 0..QUEUED as u64 {
        let info = request(k);
        let bytes = info.prompt_bytes;
        let band = [10, 0, -1][k as usize % 3];
        q.push(info, band, &tenants[k as usize % TENANTS], bytes, now)
            .expect("room");
    }
    (q, tenants)
}

/// Puts a request that left back in the queue (a new arrival).
fn requeue(q: &mut FlowQueue<RequestInfo>, e: Entry<RequestInfo>, now: Instant) {
    let bytes = e.bytes;
    q.push(e.item, e.priority, &e.flow, bytes, now)
        .expect("room");
}

fn bench_flow(c: &mut Criterion) {
    let now = Instant::now();
    let (mut q, tenants) = full_queue(now);
    let per_entry =
        std::mem::size_of::<Entry<RequestInfo>>() + FP_BLOCKS as usize * 8 + tenants[0].len() + 1;
    println!(
        "flow setup: {} requests queued, {TENANTS} tenants in 3 bands, {FP_BLOCKS}-block prompts; \
         per queued request about {per_entry} B in the queue (the entry with its request's \
         fingerprint and fairness id; the sidecar adds a oneshot channel, ~100 B, and Envoy \
         holds the request itself), {} B of it per fingerprint block",
        q.len(),
        8
    );
    let mut g = c.benchmark_group("flow");
    g.bench_function("pop_and_requeue_10k", |b| {
        b.iter(|| {
            let (e, ()) = q.pop_where(|_| Some(())).expect("queued");
            requeue(&mut q, e, now);
        })
    });
    let (plain, _) = router(8, 20000, false);
    // With slots kept for tenants (`HEARTH_FLOW_FAIR_SLOTS_SECONDS`), each
    // engine's batch learnt and every request's flow its tenant's: each
    // look reckons its band's fair share over the replicas' tracked flows
    // (up to 64 a replica, all about: the clock stands still here).
    let (fair, upstreams) = router(8, 20000, true);
    for u in &upstreams {
        for (running, waiting) in [(4.0, 2.0), (4.0, 2.0), (0.0, 0.0)] {
            fair.set_engine_signals(u.addr, EngineSignals::queue(running, waiting, now));
        }
    }
    for (name, router) in [
        ("dispatch_one_of_10k_8_replicas", &plain),
        ("dispatch_one_of_10k_8_replicas_fair_slots", &fair),
    ] {
        g.bench_function(name, |b| {
            b.iter(|| {
                let (e, free) = q
                    .pop_where(
                        |e| match router.room_at(&e.item, None, e.waited(now), now) {
                            Room::Go(free) => Some(free),
                            _ => None,
                        },
                    )
                    .expect("room");
                let decision = router
                    .decide_within_at(&e.item, free.as_deref(), now)
                    .expect("decide");
                drop(decision);
                requeue(&mut q, e, now);
            })
        });
    }
    look_with_flows_past_share(&mut g, now);
    g.finish();
}

/// Replicas in the look below, flows each replica tracks with a request
/// in flight (past their share), and flows with none (under it).
const LOOK_REPLICAS: u64 = 8;
const HELD_FLOWS: u64 = 48;
const QUIET_FLOWS: u64 = 16;

/// A whole look at a queue of 10,000 requests in which no request may
/// leave: each replica tracks the most flows it may (64: 48 with a
/// request in flight, past their fair share, and 16 that came and went,
/// under it), every queued request is of a flow past its share, and the
/// slots left are kept for the others. The look asks once per flow (384
/// flows) and skips the flow's later requests, as the sidecar's does.
fn look_with_flows_past_share(
    g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    now: Instant,
) {
    let (router, upstreams) = router(LOOK_REPLICAS as u16, 21000, true);
    let batch = HELD_FLOWS as f64;
    for u in &upstreams {
        for _ in 0..2 {
            router.set_engine_signals(u.addr, EngineSignals::queue(batch, 1.0, now));
        }
    }
    let flow_of = |r: u64, f: u64| r * 64 + f;
    let mut held = Vec::new();
    for r in 0..LOOK_REPLICAS {
        for f in 0..HELD_FLOWS + QUIET_FLOWS {
            let info = RequestInfo {
                flow: flow_of(r, f),
                ..request(flow_of(r, f))
            };
            let d = router
                .decide_within_at(&info, Some(&[r as usize]), now)
                .expect("decide");
            if f < HELD_FLOWS {
                held.push(d);
            }
        }
    }
    // The engines' figures now: their batches full of those requests,
    // nothing waiting.
    for u in &upstreams {
        router.set_engine_signals(u.addr, EngineSignals::queue(batch, 0.0, now));
    }
    let mut q = deep_queue();
    let held_flows = LOOK_REPLICAS * HELD_FLOWS;
    for k in 0..QUEUED as u64 {
        let n = k % held_flows;
        let flow = flow_of(n / HELD_FLOWS, n % HELD_FLOWS);
        let info = RequestInfo { flow, ..request(k) };
        let bytes = info.prompt_bytes;
        q.push(info, 0, &format!("tenant-{flow}"), bytes, now)
            .expect("room");
    }
    let asked = std::cell::Cell::new(0usize);
    g.bench_function("look_10k_queued_384_flows_past_share", |b| {
        b.iter(|| {
            asked.set(0);
            let mut shared = std::collections::HashSet::new();
            let mut look = Look::default();
            let left = q.pop_where(|e| {
                if shared.contains(&e.item.flow) {
                    return None;
                }
                asked.set(asked.get() + 1);
                match router.room_in(&mut look, &e.item, None, e.waited(now), now) {
                    Room::Share => {
                        shared.insert(e.item.flow);
                        None
                    }
                    Room::Go(free) => Some(free),
                    Room::Full | Room::Warm => None,
                }
            });
            assert!(left.is_none(), "no flow past its share leaves");
        })
    });
    assert_eq!(asked.get(), held_flows as usize, "one question a flow");
    drop(held);
}

criterion_group!(benches, bench_flow);
criterion_main!(benches);

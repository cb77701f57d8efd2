//! The sidecar's routing decision (overlap + score + pick + reserve, the
//! reservation released after each iteration) at 2, 8, 40 and 64 replicas,
//! each replica's warmth index full (100,000 blocks), for a 256-block
//! fingerprint. Prints the warmth memory of the fleet before measuring.
//!
//! Run: `cargo bench -p hearth-router --bench decision -- --warm-up-time 1 --measurement-time 3`

use std::sync::Arc;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use hearth_router::{RequestInfo, Router, RouterParams, UpstreamSpec};

const BLOCKS_PER_REPLICA: usize = 100_000;
const FP_BLOCKS: u64 = 256;
/// Blocks of a system prompt every session shares.
const SHARED: u64 = 32;

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Session `s`'s chained fingerprint: the shared prefix, then its own blocks.
fn session(s: u64) -> RequestInfo {
    let hashes = (0..FP_BLOCKS)
        .map(|i| {
            if i < SHARED {
                splitmix(i)
            } else {
                splitmix((s + 1) << 20 | i)
            }
        })
        .collect::<Vec<_>>();
    RequestInfo {
        prompt_bytes: hashes.len() as u64 * 2048,
        hashes,
        model: Some("m".into()),
        max_output_tokens: None,
        cache: Default::default(),
        priority: 0,
        flow: 0,
    }
}

/// A router over `n` replicas whose warmth indexes are full; returns the
/// sessions of the last fill round (warm on their replica).
fn full_router(n: usize) -> (Arc<Router>, Vec<RequestInfo>) {
    let upstreams: Vec<UpstreamSpec> = (0..n)
        .map(|i| format!("127.0.0.1:{}", 20000 + i).parse().expect("address"))
        .collect();
    let params = RouterParams {
        warmth_blocks: BLOCKS_PER_REPLICA,
        ..RouterParams::default()
    };
    let router = Router::new(params, &upstreams);
    // Sessions start in waves of `n` held at once, so load spreads them
    // over every replica (the shared prompt alone would pull them together).
    let per_replica = BLOCKS_PER_REPLICA as u64 / (FP_BLOCKS - SHARED) + 2;
    let sessions = per_replica * n as u64;
    let mut wave = Vec::with_capacity(n);
    for s in 0..sessions {
        wave.push(router.decide(&session(s)).expect("decide"));
        if wave.len() == n {
            wave.clear();
        }
    }
    let last = sessions.saturating_sub(4 * n as u64)..sessions;
    (router, last.map(session).collect())
}

fn bench_decision(c: &mut Criterion) {
    let mut g = c.benchmark_group("decision");
    for n in [2usize, 8, 40, 64] {
        let (router, warm) = full_router(n);
        let snap = router.snapshot();
        let blocks: usize = snap.replicas.iter().map(|r| r.warmth_blocks).sum();
        let bytes: usize = snap.replicas.iter().map(|r| r.warmth_memory_bytes).sum();
        println!(
            "decision setup: {n} replicas, {blocks} warm blocks in all (capacity {BLOCKS_PER_REPLICA} each), \
             warmth memory {:.1} MiB ({:.1} B/block); fingerprint {FP_BLOCKS} blocks, {SHARED} shared by every session",
            bytes as f64 / (1 << 20) as f64,
            bytes as f64 / blocks.max(1) as f64
        );
        // A returning session: its whole prefix is warm on one replica and
        // the shared prompt on all of them.
        let mut i = 0;
        g.bench_function(BenchmarkId::new("warm_session", n), |b| {
            b.iter(|| {
                i = (i + 1) % warm.len();
                router.decide(&warm[i]).expect("decide")
            })
        });
        // A new session: only the shared prompt is warm; recording it
        // inserts 224 blocks and evicts as many.
        let mut s = 1u64 << 30;
        g.bench_function(BenchmarkId::new("new_session", n), |b| {
            b.iter(|| {
                s += 1;
                router.decide(&session(s)).expect("decide")
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench_decision);
criterion_main!(benches);

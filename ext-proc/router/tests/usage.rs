//! Closing the loop: answers' usage against the decisions' predictions,
//! and the warmth corrections it makes.

use std::sync::Arc;

use hearth_router::usage::MIN_WARMTH_BLOCKS;
use hearth_router::{Correction, RequestInfo, Router, RouterParams, Snapshot, UpstreamSpec, Usage};

/// Two replicas.
fn fleet(tune: impl FnOnce(&mut RouterParams)) -> Arc<Router> {
    fleet_of("127.0.0.1:1,127.0.0.1:2", tune)
}

fn fleet_of(list: &str, tune: impl FnOnce(&mut RouterParams)) -> Arc<Router> {
    let mut p = RouterParams::default();
    tune(&mut p);
    let specs: Vec<UpstreamSpec> = list.split(',').map(|s| s.parse().unwrap()).collect();
    Router::new(p, &specs)
}

/// A prompt of `hashes`, 2 KiB per block: 512 tokens a block at four
/// bytes per token.
fn req(hashes: &[u64]) -> RequestInfo {
    RequestInfo {
        hashes: hashes.to_vec(),
        prompt_bytes: hashes.len() as u64 * 2048,
        model: Some("m".into()),
        max_output_tokens: None,
    }
}

/// A conversation of `blocks` blocks of its own, starting at `base`.
fn conversation(base: u64, blocks: u64) -> Vec<u64> {
    (base..base + blocks).collect()
}

fn usage(prompt_blocks: usize, cached_blocks: u64) -> Usage {
    Usage {
        prompt_tokens: prompt_blocks as u64 * 512,
        cached_tokens: cached_blocks * 512,
    }
}

fn replica(r: &Router, i: usize) -> hearth_router::ReplicaSnapshot {
    let s: Snapshot = r.snapshot();
    s.replicas.into_iter().nth(i).unwrap()
}

#[test]
fn a_served_prediction_is_counted_and_changes_nothing() {
    let r = fleet(|_| {});
    let mut c = conversation(1, 100);
    drop(r.decide(&req(&c)).unwrap());
    c.extend([500, 501]);
    let d = r.decide(&req(&c)).unwrap();
    assert!(d.continues);
    // The engine served the 100 blocks it read last turn, plus a little.
    let served = d.record_usage(usage(c.len(), 100)).unwrap();
    assert_eq!(served.predicted_tokens, Some(100 * 512));
    assert_eq!(served.correction, None);
    let s = replica(&r, d.primary());
    assert_eq!(s.usage.reports_total, 1);
    assert_eq!(s.usage.prompt_tokens_total, 102 * 512);
    assert_eq!(s.usage.cached_tokens_total, 100 * 512);
    assert_eq!(s.usage.bytes_per_token, Some(4.0));
    assert_eq!(s.warmth_capacity, RouterParams::default().warmth_blocks);
}

#[test]
fn a_miss_shrinks_the_index_toward_the_engine_and_drops_its_oldest_blocks() {
    let r = fleet_of("127.0.0.1:1", |p| p.warmth_blocks = 10_000);
    // Three conversations of 200 blocks on one replica.
    let convs: Vec<Vec<u64>> = (0..3).map(|k| conversation(1 + k * 10_000, 200)).collect();
    for c in &convs {
        drop(r.decide(&req(c)).unwrap());
    }
    let home = 0;
    let held = replica(&r, home).warmth_blocks;
    assert_eq!(held, 600);
    // The newest conversation comes back; the engine kept only 50 of its
    // 200 blocks: its cache is smaller than the index.
    let mut c = convs[2].clone();
    c.push(900_099);
    let d = r.decide(&req(&c)).unwrap();
    assert_eq!((d.primary(), d.overlap), (home, 200));
    let served = d.record_usage(usage(c.len(), 50)).unwrap();
    // What it holds now (this turn's 201 blocks recorded), nine tenths.
    let expected = ((held + 1) * 9 / 10).max(MIN_WARMTH_BLOCKS);
    assert_eq!(served.correction, Some(Correction::Shrunk(expected)));
    let s = replica(&r, home);
    assert_eq!((s.warmth_capacity, s.warmth_blocks), (expected, expected));
    assert_eq!(s.usage.shrinks_total, 1);
    // This conversation's chain stays whole (the engine re-read it); the
    // oldest conversation lost its tail (61 blocks, and one more for the
    // block this turn added).
    drop(d);
    c.push(900_100);
    assert_eq!(r.decide(&req(&c)).unwrap().overlap, 201);
    let mut oldest = convs[0].clone();
    oldest.push(900_005);
    assert_eq!(r.decide(&req(&oldest)).unwrap().overlap, 200 - 62);
}

#[test]
fn continuing_turns_served_nothing_three_times_in_a_row_are_a_restart() {
    let r = fleet_of("127.0.0.1:1", |_| {});
    let mut convs: Vec<Vec<u64>> = (0..4).map(|k| conversation(1 + k * 1_000, 300)).collect();
    for c in &convs {
        drop(r.decide(&req(c)).unwrap());
    }
    let mut corrections = Vec::new();
    // The engine restarted: each conversation's next turn finds nothing.
    // One turn served from cache in between breaks the streak.
    for (k, c) in convs.iter_mut().enumerate() {
        c.push(900_007);
        let d = r.decide(&req(c)).unwrap();
        assert!(d.continues);
        let cached = if k == 1 { u64::from(d.overlap) } else { 0 };
        corrections.push(d.record_usage(usage(c.len(), cached)).unwrap().correction);
    }
    // Each cold turn is also a miss: the index held 1,201 blocks at the
    // first, and stays full at its shrinking capacity.
    assert_eq!(
        corrections,
        [
            Some(Correction::Shrunk(1_080)),
            None,
            Some(Correction::Shrunk(972)),
            Some(Correction::Shrunk(874)),
        ]
    );
    // The most recent conversation, still whole in the index, finds
    // nothing either: the third in a row.
    let mut c = convs[3].clone();
    c.push(900_008);
    let d = r.decide(&req(&c)).unwrap();
    assert_eq!(
        d.record_usage(usage(c.len(), 0)).unwrap().correction,
        Some(Correction::Restart)
    );
    let s = replica(&r, 0);
    assert_eq!((s.warmth_blocks, s.resident_conversations), (0, 0));
    assert_eq!(s.usage.restarts_total, 1);
    drop(d);
    // Nothing holds any conversation now: the next turn is a new one.
    c.push(900_009);
    let next = r.decide(&req(&c)).unwrap();
    assert_eq!(next.overlap, 0);
    assert!(!next.continues);
}

#[test]
fn a_full_index_that_under_predicts_grows_back() {
    let r = fleet_of("127.0.0.1:1", |p| p.warmth_blocks = 1_000);
    let c = conversation(1, 300);
    drop(r.decide(&req(&c)).unwrap());
    let mut c2 = c.clone();
    c2.push(900_005);
    let d = r.decide(&req(&c2)).unwrap();
    // A miss shrinks it to nine tenths of its 301 blocks.
    assert_eq!(
        d.record_usage(usage(c2.len(), 10)).unwrap().correction,
        Some(Correction::Shrunk(270))
    );
    drop(d);
    // A newer conversation fills the index and pushes out the older one's
    // tail; the engine still had all of it.
    let other = conversation(50_000, 200);
    drop(r.decide(&req(&other)).unwrap());
    let mut c3 = c2.clone();
    c3.push(900_006);
    let d = r.decide(&req(&c3)).unwrap();
    assert!(d.overlap < 301, "the index lost the tail: {}", d.overlap);
    let grown = d.record_usage(usage(c3.len(), 301)).unwrap().correction;
    assert_eq!(grown, Some(Correction::Grew(270 + 27 + 1)));
    assert_eq!(replica(&r, 0).usage.growths_total, 1);
}

#[test]
fn without_feedback_usage_is_counted_but_nothing_corrected() {
    let r = fleet(|p| p.usage_feedback = false);
    let mut c = conversation(1, 100);
    drop(r.decide(&req(&c)).unwrap());
    c.push(1_000);
    let d = r.decide(&req(&c)).unwrap();
    let served = d.record_usage(usage(c.len(), 0)).unwrap();
    assert_eq!(served.correction, None);
    assert_eq!(served.predicted_tokens, Some(100 * 512));
    let s = replica(&r, d.primary());
    assert_eq!(s.usage.compared_total, 1);
    assert_eq!(s.usage.predicted_cached_tokens_total, 100 * 512);
    assert_eq!(s.usage.compared_cached_tokens_total, 0);
    assert_eq!(s.warmth_blocks, 101);
}

#[test]
fn an_answer_from_another_replica_is_counted_there_without_comparison() {
    let r = fleet(|_| {});
    let c = conversation(1, 10);
    let d = r.decide(&req(&c)).unwrap();
    let other = 1 - d.primary();
    // Envoy retried to the other replica.
    let served = r
        .record_usage(other, Some(&d.prediction), usage(10, 0))
        .unwrap();
    assert_eq!((served.replica, served.predicted_tokens), (other, None));
    assert_eq!(replica(&r, other).usage.reports_total, 1);
    assert_eq!(replica(&r, other).usage.compared_total, 0);
    assert_eq!(replica(&r, d.primary()).usage.reports_total, 0);
    // No such replica: nothing recorded.
    assert_eq!(r.record_usage(7, None, usage(10, 0)), None);
}

#[test]
fn bytes_per_token_is_learned_from_the_answers() {
    let r = fleet(|_| {});
    let mut c = conversation(1, 10);
    for k in 0..40u64 {
        c.push(100 + k);
        let d = r.decide(&req(&c)).unwrap();
        // This engine's tokens are 2 bytes of canonical prompt.
        let tokens = c.len() as u64 * 1024;
        d.record_usage(Usage {
            prompt_tokens: tokens,
            cached_tokens: tokens - 1024,
        });
    }
    let home = r.decide(&req(&c)).unwrap().primary();
    let bpt = replica(&r, home).usage.bytes_per_token.unwrap();
    assert!((bpt - 2.0).abs() < 0.01, "{bpt}");
}

//! Closing the loop: answers' usage against the decisions' predictions,
//! and the warmth corrections it makes.

use std::sync::Arc;

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
        cache: Default::default(),
        priority: 0,
        flow: 0,
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
    assert!(d.continues());
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

/// `n` conversations of `blocks` blocks each, placed in order on a
/// one-replica fleet.
fn placed(r: &Arc<Router>, n: u64, blocks: u64) -> Vec<Vec<u64>> {
    let convs: Vec<Vec<u64>> = (0..n)
        .map(|k| conversation(1 + k * 10_000, blocks))
        .collect();
    for c in &convs {
        drop(r.decide(&req(c)).unwrap());
    }
    convs
}

#[test]
fn a_miss_shrinks_the_index_toward_the_engine_and_drops_its_oldest_blocks() {
    let r = fleet_of("127.0.0.1:1", |p| p.warmth_blocks = 10_000);
    let convs = placed(&r, 4, 100);
    assert_eq!(replica(&r, 0).warmth_blocks, 400);
    // The third conversation comes back; the engine kept only 10 of its
    // 100 blocks. Since its previous turn, the index took in the fourth
    // (100 blocks): as many as a quarter of what it holds, so not a
    // recent loss but a cache smaller than the index. A tenth goes.
    let mut c = convs[2].clone();
    c.push(900_001);
    let d = r.decide(&req(&c)).unwrap();
    assert_eq!(d.overlap, 100);
    let served = d.record_usage(usage(c.len(), 10)).unwrap();
    assert_eq!(served.correction, Some(Correction::Shrunk(360)));
    let s = replica(&r, 0);
    assert_eq!((s.warmth_capacity, s.warmth_blocks), (360, 360));
    assert_eq!(s.usage.shrinks_total, 1);
    drop(d);
    // This conversation's chain stays whole (the engine re-read it); the
    // oldest lost the 41 blocks of its tail, and one more for the block
    // this turn added.
    c.push(900_002);
    assert_eq!(r.decide(&req(&c)).unwrap().overlap, 101);
    let mut oldest = convs[0].clone();
    oldest.push(900_003);
    assert_eq!(r.decide(&req(&oldest)).unwrap().overlap, 58);
}

/// The three latest of `convs` come back (latest first) and the engine
/// serves none of their prompt from cache: the corrections, in order.
fn lose_latest_three(r: &Arc<Router>, convs: &[Vec<u64>]) -> Vec<Option<Correction>> {
    convs
        .iter()
        .rev()
        .take(3)
        .enumerate()
        .map(|(k, c)| {
            let mut c = c.clone();
            c.push(900_000 + k as u64);
            let d = r.decide(&req(&c)).unwrap();
            assert!(d.continues());
            d.record_usage(usage(c.len(), 0)).unwrap().correction
        })
        .collect()
}

#[test]
fn recent_conversations_lost_by_many_are_counted_and_drop_no_warmth() {
    // Twelve conversations come back and find nothing: what an engine
    // restart would show, and what one client can make with spellings the
    // engine reads and the fingerprint does not. Misses never drop warmth;
    // only the engine's own metrics tell a restart (below).
    let r = fleet_of("127.0.0.1:1", |_| {});
    let convs = placed(&r, 12, 100);
    assert_eq!(lose_latest_three(&r, &convs), [None, None, None]);
    let s = replica(&r, 0);
    assert_eq!(s.usage.restarts_total, 0);
    assert_eq!(s.usage.recent_losses_total, 3);
    assert_eq!(s.warmth_capacity, RouterParams::default().warmth_blocks);
    assert!(s.warmth_blocks >= 1_200, "{s:?}");
    // Each conversation that missed re-read its prompt there: its next
    // turn continues.
    let mut c = convs[11].clone();
    c.extend([900_000, 900_100]);
    let next = r.decide(&req(&c)).unwrap();
    assert!(next.continues());
    assert_eq!(next.overlap, 101);
}

#[test]
fn misses_are_judged_by_the_turns_own_bytes_per_token() {
    // A client whose prompts are 1 byte a token (against the honest 4)
    // drags the replica's average down; an honest turn served in full is
    // still judged in its own units, so no miss and no shrink.
    let r = fleet_of("127.0.0.1:1", |p| p.warmth_blocks = 10_000);
    let convs = placed(&r, 4, 100);
    for k in 0..60u64 {
        let odd = conversation(500_000 + k * 1_000, 4);
        let d = r.decide(&req(&odd)).unwrap();
        d.record_usage(Usage {
            prompt_tokens: 4 * 2048,
            cached_tokens: 0,
        });
    }
    let bpt = replica(&r, 0).usage.bytes_per_token.unwrap();
    assert!(bpt < 1.5, "the average moved: {bpt}");
    let mut c = convs[0].clone();
    c.push(900_001);
    let d = r.decide(&req(&c)).unwrap();
    assert!(d.continues());
    let served = d.record_usage(usage(c.len(), 100)).unwrap();
    assert_eq!(served.correction, None);
    let s = replica(&r, 0);
    assert_eq!(
        (s.usage.shrinks_total, s.usage.recent_losses_total),
        (0, 0),
        "{s:?}"
    );
}

#[test]
fn a_recent_loss_between_ordinary_turns_is_no_restart() {
    let r = fleet_of("127.0.0.1:1", |_| {});
    let convs = placed(&r, 12, 100);
    let mut corrections = Vec::new();
    for (k, c) in convs.iter().rev().take(3).enumerate() {
        let mut c = c.clone();
        c.push(900_000 + k as u64);
        let d = r.decide(&req(&c)).unwrap();
        // The middle one was served as predicted.
        let cached = if k == 1 { 100 } else { 0 };
        corrections.push(d.record_usage(usage(c.len(), cached)).unwrap().correction);
    }
    assert_eq!(corrections, [None, None, None]);
    assert_eq!(replica(&r, 0).warmth_blocks, 1_203);
}

#[test]
fn a_full_index_that_under_predicts_grows_back() {
    let r = fleet_of("127.0.0.1:1", |p| p.warmth_blocks = 1_000);
    let convs = placed(&r, 2, 300);
    // The older comes back and misses: capped at what the index holds.
    let mut a = convs[0].clone();
    a.push(900_001);
    let d = r.decide(&req(&a)).unwrap();
    assert_eq!(
        d.record_usage(usage(a.len(), 10)).unwrap().correction,
        Some(Correction::Shrunk(601))
    );
    drop(d);
    // A third conversation pushes the second's tail out of the index; the
    // engine still had all of it.
    drop(r.decide(&req(&conversation(50_000, 200))).unwrap());
    let mut b = convs[1].clone();
    b.push(900_002);
    let d = r.decide(&req(&b)).unwrap();
    assert_eq!(d.overlap, 100, "the index lost the tail");
    let grown = d.record_usage(usage(b.len(), 300)).unwrap().correction;
    assert_eq!(grown, Some(Correction::Grew(601 + 150 + 1)));
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

/// What a vLLM-like engine's metrics said: `kv` tokens of KV cache,
/// `prompts` prompt tokens since a start at `started`.
fn engine(kv: Option<f64>, prompts: f64, started: f64) -> hearth_router::EngineSignals {
    hearth_router::EngineSignals {
        waiting: 0.0,
        running: 0.0,
        kv_usage: Some(0.1),
        at: std::time::Instant::now(),
        own_in_flight: 0,
        prompt_tokens_total: Some(prompts),
        started_at: Some(started),
        kv_capacity_tokens: kv,
        cache_block_tokens: None,
        progress_total: None,
    }
}

#[test]
fn an_engine_that_reports_its_kv_capacity_sizes_the_index() {
    let r = fleet(|_| {});
    let a = "127.0.0.1:1".parse().unwrap();
    // 256,000 tokens at four bytes a token: 500 blocks of 2 KiB.
    r.set_engine_signals(a, engine(Some(256_000.0), 10.0, 1_000.0));
    assert_eq!(replica(&r, 0).warmth_capacity, 500);
    // Replica 1 said nothing: the default stays.
    assert_eq!(
        replica(&r, 1).warmth_capacity,
        RouterParams::default().warmth_blocks
    );
    // The index never grows past it.
    let placed = conversation(1, 700);
    drop(r.decide(&req(&placed)).unwrap());
    let s = replica(&r, 0);
    assert_eq!((s.warmth_blocks, s.warmth_capacity), (500, 500));

    // An operator's HEARTH_WARMTH_BLOCKS wins over what the engine says.
    let fixed = fleet(|p| p.warmth_from_engine = false);
    fixed.set_engine_signals(a, engine(Some(256_000.0), 10.0, 1_000.0));
    assert_eq!(
        replica(&fixed, 0).warmth_capacity,
        RouterParams::default().warmth_blocks
    );
}

#[test]
fn an_engine_whose_metrics_show_a_restart_loses_its_warmth() {
    let r = fleet_of("127.0.0.1:1", |_| {});
    let a = "127.0.0.1:1".parse().unwrap();
    r.set_engine_signals(a, engine(None, 5_000.0, 1_000.0));
    let mut c = conversation(1, 50);
    drop(r.decide(&req(&c)).unwrap());
    // Still counting up, same start: nothing happened.
    r.set_engine_signals(a, engine(None, 9_000.0, 1_000.0));
    assert_eq!(replica(&r, 0).warmth_blocks, 50);
    assert_eq!(replica(&r, 0).usage.restarts_total, 0);
    // The prompt-token count fell: a new process.
    r.set_engine_signals(a, engine(None, 300.0, 1_000.0));
    let s = replica(&r, 0);
    assert_eq!((s.warmth_blocks, s.usage.restarts_total), (0, 1));
    c.push(60_000);
    assert!(
        !r.decide(&req(&c)).unwrap().continues(),
        "nothing of the conversation is left to continue"
    );
    // A new start time alone says so too.
    drop(r.decide(&req(&c)).unwrap());
    r.set_engine_signals(a, engine(None, 800.0, 2_000.0));
    let s = replica(&r, 0);
    assert_eq!((s.warmth_blocks, s.usage.restarts_total), (0, 2));
}

#[test]
fn without_feedback_an_engine_restart_is_not_acted_on() {
    let r = fleet_of("127.0.0.1:1", |p| p.usage_feedback = false);
    let a = "127.0.0.1:1".parse().unwrap();
    r.set_engine_signals(a, engine(None, 5_000.0, 1_000.0));
    drop(r.decide(&req(&conversation(1, 50))).unwrap());
    r.set_engine_signals(a, engine(None, 300.0, 2_000.0));
    let s = replica(&r, 0);
    assert_eq!((s.warmth_blocks, s.usage.restarts_total), (50, 0));
}

#[test]
fn one_conversation_missing_again_and_again_is_no_restart() {
    // A client replaying one conversation's turns (with whatever makes the
    // engine serve them cold) changes nothing but the count.
    let r = fleet_of("127.0.0.1:1", |_| {});
    let convs = placed(&r, 12, 100);
    let mut c = convs[11].clone();
    let mut corrections = Vec::new();
    let mut names = Vec::new();
    for k in 0..6 {
        c.push(900_000 + k);
        let d = r.decide(&req(&c)).unwrap();
        names.push(d.prediction.conversation);
        corrections.push(d.record_usage(usage(c.len(), 0)).unwrap().correction);
    }
    assert!(corrections.iter().all(Option::is_none), "{corrections:?}");
    assert!(
        names.iter().all(|n| n.is_some() && *n == names[0]),
        "one name for all its turns: {names:?}"
    );
    let s = replica(&r, 0);
    assert_eq!(s.usage.restarts_total, 0);
    assert!(s.warmth_blocks >= 1_200);
}

#[test]
fn answers_to_requests_that_partition_or_bypass_the_cache_are_not_compared() {
    use hearth_wire::CacheUse;
    for cache in [CacheUse::Partitioned, CacheUse::Bypassed] {
        let r = fleet_of("127.0.0.1:1", |_| {});
        let convs = placed(&r, 12, 100);
        for (k, c) in convs.iter().rev().take(6).enumerate() {
            let mut c = c.clone();
            c.push(900_000 + k as u64);
            let info = RequestInfo { cache, ..req(&c) };
            let d = r.decide(&info).unwrap();
            assert!(!d.prediction.compare);
            let served = d.record_usage(usage(c.len(), 0)).unwrap();
            assert_eq!((served.predicted_tokens, served.correction), (None, None));
        }
        let s = replica(&r, 0);
        assert_eq!(s.usage.reports_total, 6, "{cache:?}: counted");
        assert_eq!(s.usage.compared_total, 0, "{cache:?}: never compared");
        assert_eq!(s.usage.restarts_total + s.usage.shrinks_total, 0);
        assert!(s.warmth_blocks >= 1_200);
    }
}

/// A block cache (vLLM's: whole blocks of 128 tokens) and a prompt whose
/// last block is partial. The prediction counts the previous turn's whole
/// prompt, the partial block too, in the engine's own token count once its
/// usage said it, and in whole engine blocks once the replica's reports
/// showed its granularity.
#[test]
fn predictions_include_the_partial_block_in_the_engines_tokens_and_blocks() {
    let r = fleet(|_| {});
    // Turn 1: 10 full blocks and a partial one (20,980 bytes).
    let mut hashes = conversation(1, 11);
    let mut info = req(&hashes);
    info.prompt_bytes = 10 * 2048 + 500;
    let d = r.decide(&info).unwrap();
    assert_eq!(d.prediction.held_bytes, 0);
    // The engine counted 5,250 tokens and had nothing cached.
    let prompt_tokens = 5_250;
    let served = d
        .record_usage(Usage {
            prompt_tokens,
            cached_tokens: 0,
        })
        .unwrap();
    assert_eq!(served.predicted_tokens, Some(0));
    drop(d);
    // Turns 2..: each extends the last; the engine serves the previous
    // prompt in whole blocks of 128 tokens.
    let mut previous_tokens = prompt_tokens;
    let mut predicted = Vec::new();
    for turn in 0..6u64 {
        hashes.truncate(hashes.len() - 1);
        hashes.extend([100 + 10 * turn, 101 + 10 * turn, 102 + 10 * turn]);
        let mut info = req(&hashes);
        info.prompt_bytes = (hashes.len() as u64 - 1) * 2048 + 500;
        let d = r.decide(&info).unwrap();
        assert!(d.continues());
        // All of the previous prompt, not only its full blocks.
        assert!(d.prediction.held_bytes > u64::from(d.overlap) * 2048);
        assert_eq!(d.prediction.held_tokens, Some(previous_tokens));
        let tokens = previous_tokens + 1_000;
        let cached = previous_tokens / 128 * 128;
        let served = d
            .record_usage(Usage {
                prompt_tokens: tokens,
                cached_tokens: cached,
            })
            .unwrap();
        predicted.push((served.predicted_tokens.unwrap(), cached));
        previous_tokens = tokens;
    }
    // Before the granularity is known, the prediction is the previous
    // prompt's tokens: within one block of what was served.
    let (p, s) = predicted[0];
    assert_eq!(p, 5_250);
    assert!(p - s < 128);
    // From the fifth answer served from cache on (four reports taught
    // the block size), it is exact.
    for &(p, s) in &predicted[4..] {
        assert_eq!(p, s);
    }
    let snap = replica(
        &r,
        r.snapshot()
            .replicas
            .iter()
            .position(|x| x.usage.reports_total > 0)
            .unwrap(),
    );
    assert_eq!(snap.usage.cache_granularity_tokens, Some(128));
}

#[test]
fn an_engine_smaller_than_the_index_is_predicted_by_what_an_lru_its_size_holds() {
    let r = fleet_of("127.0.0.1:1", |_| {});
    // 5,120 tokens at four bytes a token: 10 blocks, where the index keeps
    // at least 64 (affinity outlives the engine's cache).
    let a = "127.0.0.1:1".parse().unwrap();
    r.set_engine_signals(a, engine(Some(5_120.0), 10.0, 1_000.0));
    assert_eq!(replica(&r, 0).warmth_capacity, 64);
    // Conversations of a shared 2-block prompt and 3 blocks of their own.
    let shared = [7, 8];
    let own = |k: u64| -> Vec<u64> {
        let mut c = shared.to_vec();
        c.extend(conversation(1_000 * k, 3));
        c
    };
    let first = own(1);
    drop(r.decide(&req(&first)).unwrap());
    // One other conversation since (5 blocks used after it): an LRU of 10
    // still holds all of it, and the prediction is the whole previous
    // prompt.
    drop(r.decide(&req(&own(2))).unwrap());
    let mut next = first.clone();
    next.push(99);
    let d = r.decide(&req(&next)).unwrap();
    assert!(d.continues());
    assert_eq!((d.overlap, d.prediction.blocks), (5, 5));
    assert_eq!(d.prediction.held_bytes, 5 * 2048);
    drop(d);
    // Three more conversations: 9 blocks of their own and the shared two
    // after this one's: the engine kept the shared prompt only. Routing
    // still sees the whole conversation; the prediction does not.
    for k in 3..6 {
        drop(r.decide(&req(&own(k))).unwrap());
    }
    next.push(100);
    let d = r.decide(&req(&next)).unwrap();
    assert!(d.continues());
    assert_eq!((d.overlap, d.prediction.blocks), (6, 2));
    assert_eq!(d.prediction.held_bytes, 2 * 2048);
    // Served as predicted: no miss, nothing corrected.
    let served = d.record_usage(usage(next.len(), 2)).unwrap();
    assert_eq!(served.predicted_tokens, Some(2 * 512));
    assert_eq!(served.correction, None);
    assert_eq!(replica(&r, 0).warmth_capacity, 64);
}

/// Rounds of turns of `convs` conversations (a shared 2-block prompt and
/// 3 blocks of their own, one block more each turn) on a one-replica
/// fleet whose engine says its KV cache is 10 blocks; `serve` says what
/// the engine served of each turn (its previous prompt's blocks, and the
/// prompt's). Returns, per turn, the predicted and served cached tokens.
fn mirrored_rounds(
    r: &Arc<Router>,
    convs: u64,
    rounds: usize,
    serve: impl Fn(usize, usize) -> u64,
) -> Vec<(u64, u64)> {
    let a = "127.0.0.1:1".parse().unwrap();
    r.set_engine_signals(a, engine(Some(5_120.0), 10.0, 1_000.0));
    let mut prompts: Vec<Vec<u64>> = (1..=convs)
        .map(|k| {
            let mut c = vec![7, 8];
            c.extend(conversation(1_000 * k, 3));
            c
        })
        .collect();
    for p in &prompts {
        let d = r.decide(&req(p)).unwrap();
        d.record_usage(usage(p.len(), 0)).unwrap();
    }
    let mut out = Vec::new();
    for round in 0..rounds {
        for (k, p) in prompts.iter_mut().enumerate() {
            let previous = p.len();
            p.push(500_000 + (round * 100 + k) as u64);
            let d = r.decide(&req(p)).unwrap();
            assert!(d.continues());
            let served = serve(previous, p.len());
            let s = d.record_usage(usage(p.len(), served)).unwrap();
            out.push((s.predicted_tokens.unwrap(), served * 512));
        }
    }
    out
}

#[test]
fn an_engine_that_holds_more_than_its_figure_says_widens_the_mirror() {
    // The engine keeps every conversation's previous prompt (it holds
    // what the shared prompt costs once, not once per conversation):
    // the 10-block mirror cuts predictions three blocks short, and each
    // such answer widens it. The conversations keep growing, so the
    // mirror trails them, by a block at most.
    let r = fleet_of("127.0.0.1:1", |_| {});
    let turns = mirrored_rounds(&r, 3, 10, |previous, _| previous as u64);
    let (p, s) = turns[0];
    assert_eq!(s - p, 3 * 512, "at first the mirror cuts");
    let last_round = &turns[turns.len() - 3..];
    assert!(
        last_round.iter().all(|(p, s)| p <= s && s - p <= 512),
        "{last_round:?} (all: {turns:?})"
    );
    let scale = replica(&r, 0).usage.engine_room_scale.unwrap();
    assert!(scale > 1.5, "{scale}");
}

#[test]
fn an_engine_that_holds_less_than_its_figure_says_narrows_the_mirror() {
    // Two conversations of 5-7 blocks fit a 10-block mirror, but the
    // engine keeps only the shared prompt: predictions fall to it.
    let r = fleet_of("127.0.0.1:1", |_| {});
    let turns = mirrored_rounds(&r, 2, 12, |_, _| 2);
    let (p, s) = turns[0];
    assert!(
        p > s,
        "at first the mirror holds it all: {p} predicted, {s} served"
    );
    let last_round = &turns[turns.len() - 2..];
    assert!(
        last_round.iter().all(|(p, s)| p == s),
        "{last_round:?} (all: {turns:?})"
    );
    let scale = replica(&r, 0).usage.engine_room_scale.unwrap();
    assert!(scale < 1.0, "{scale}");
}

/// Answers that all hit one shared two-block prompt (256 tokens where
/// blocks are 128) on replica 0, then a conversation's next turn there:
/// its prediction in the granule the replica knows by then.
fn shared_prompt_hits_then_a_next_turn(stated: Option<f64>) -> (Option<u64>, Option<u64>) {
    let r = fleet_of("127.0.0.1:1", |_| {});
    let a = "127.0.0.1:1".parse().unwrap();
    r.set_engine_signals(
        a,
        hearth_router::EngineSignals {
            cache_block_tokens: stated,
            progress_total: None,
            ..engine(None, 10.0, 1_000.0)
        },
    );
    for k in 1..=5 {
        let mut hashes = vec![7];
        hashes.extend(conversation(1_000 * k, 3));
        let d = r.decide(&req(&hashes)).unwrap();
        d.record_usage(Usage {
            prompt_tokens: 2_000,
            cached_tokens: if k == 1 { 0 } else { 256 },
        })
        .unwrap();
    }
    // Conversation 1's next turn: it holds the whole previous prompt
    // (2,000 tokens), 15 blocks and a part.
    let mut next = vec![7];
    next.extend(conversation(1_000, 3));
    next.push(99);
    let d = r.decide(&req(&next)).unwrap();
    assert!(d.continues());
    let served = d
        .record_usage(Usage {
            prompt_tokens: 2_500,
            cached_tokens: 1_920,
        })
        .unwrap();
    (
        served.predicted_tokens,
        replica(&r, 0).usage.cache_granularity_tokens,
    )
}

#[test]
fn an_engine_that_states_its_block_size_is_predicted_in_its_blocks_from_the_first_answer() {
    // Learnt from the answers alone, four hits of 256 say 256: the
    // prediction falls a block short (and this answer teaches 128).
    assert_eq!(
        shared_prompt_hits_then_a_next_turn(None),
        (Some(1_792), Some(128))
    );
    // vLLM states 128-token blocks: exact.
    assert_eq!(
        shared_prompt_hits_then_a_next_turn(Some(128.0)),
        (Some(1_920), Some(128))
    );
    // A stated size the answers contradict (256 is no multiple of 112;
    // taken, it would predict 1,904) is dropped for what they teach.
    assert_eq!(
        shared_prompt_hits_then_a_next_turn(Some(112.0)),
        (Some(1_792), Some(128))
    );
}

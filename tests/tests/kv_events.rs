//! The engines' own KV cache events, end to end: simulated engines publish
//! them as vLLM does (ZMQ PUB, msgpack batches), the sidecar subscribes to
//! each, and `/state` and `/metrics` show what they say: each engine's
//! occupancy as the engine itself counts it, its capacity once it evicts,
//! a restart from the sequence going back to 0, a lost batch as a gap, and
//! an emptied cache from `AllBlocksCleared`.

use std::time::{Duration, Instant};

use hearth_bench::engine::{self, EngineConfig};
use hearth_e2e::{filler, metric_sample, reply_text, Conversation, Fleet, FleetOptions, MODEL};
use hearth_router::{KvEventsSnapshot, Snapshot};
use serde_json::json;

/// Tokens a simulated block holds, and each engine's cache: 48 blocks.
const BLOCK_TOKENS: u64 = 16;
const CAPACITY_TOKENS: usize = 48 * 16;

fn kv(s: &Snapshot, id: &str) -> KvEventsSnapshot {
    let r = s.replicas.iter().find(|r| r.id == id).expect("replica");
    r.kv_events
        .clone()
        .expect("the replica is listed with kv_events=")
}

/// A first turn of its own: `n` distinct sentences (about 9 blocks).
fn prompt(n: u64) -> serde_json::Value {
    let text: String = (0..12)
        .map(|k| format!("conversation {n} sentence {k} about nothing much. "))
        .collect();
    json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 2,
    })
}

/// Polls `/state` until `done` holds, up to 60 s (a loaded machine
/// reconnects and replays slowly); panics with the last state otherwise.
async fn until(fleet: &Fleet, what: &str, done: impl Fn(&Snapshot) -> bool) -> Snapshot {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let s = fleet.state().await.expect("/state");
        if done(&s) {
            return s;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not within 60 s; last state: {:#?}",
            s.replicas.iter().map(|r| &r.kv_events).collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Empties an engine's prefix cache (`POST /reset_prefix_cache`), waiting
/// out a probe that uses it.
async fn reset_cache(fleet: &Fleet, url: &str) {
    for _ in 0..100 {
        let r = fleet
            .client
            .post(format!("{url}/reset_prefix_cache"))
            .send()
            .await
            .unwrap();
        if r.status() == 200 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{url} kept its prefix cache in use");
}

/// Sends first turn `from` straight to the engine `id` (the feed is the
/// engine's, whoever routed the prompt; through the gateway, which engine
/// a new prompt lands on follows load and time); returns the next turn's
/// number.
async fn serve_on(fleet: &Fleet, id: &str, from: u64) -> u64 {
    let engine = fleet
        .engines
        .iter()
        .find(|e| e.engine.config().id == id)
        .unwrap_or_else(|| panic!("no engine {id}"));
    let r = fleet
        .client
        .post(format!("{}/v1/chat/completions", engine.url()))
        .json(&prompt(from))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{id}: {:?}", r.text().await);
    from + 1
}

/// Each engine's event figures equal its own count of cached blocks.
async fn occupancy_matches(fleet: &Fleet, what: &str) -> Snapshot {
    until(fleet, what, |s| {
        fleet.engines.iter().all(|e| {
            let k = kv(s, &e.engine.config().id);
            let blocks = e.engine.stats().cache_blocks;
            k.exact
                && k.held_blocks as u64 == blocks
                && k.occupancy_tokens == Some(blocks * BLOCK_TOKENS)
        })
    })
    .await
}

/// A fleet of `engines` simulated engines publishing KV events into
/// `CAPACITY_TOKENS` caches, every feed connected and exact. The
/// sidecar's first probes may have been published before it subscribed
/// (a PUB socket sends nothing to a subscriber it does not have yet): the
/// feeds joined late, and say so; emptied caches (`AllBlocksCleared`)
/// make them exact.
async fn exact_fleet(engines: usize) -> Fleet {
    let fleet = Fleet::start(FleetOptions {
        engines,
        kv_events: true,
        cache_capacity_tokens: CAPACITY_TOKENS,
        ..FleetOptions::default()
    })
    .await
    .unwrap();
    until(&fleet, "every feed connected", |s| {
        s.replicas
            .iter()
            .all(|r| r.kv_events.as_ref().is_some_and(|k| k.connected))
    })
    .await;
    for e in &fleet.engines {
        reset_cache(&fleet, &e.url()).await;
    }
    until(&fleet, "every feed exact", |s| {
        s.replicas
            .iter()
            .all(|r| r.kv_events.as_ref().is_some_and(|k| k.exact))
    })
    .await;
    fleet
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sidecar_reads_each_engines_kv_events_and_its_restart() {
    let mut fleet = exact_fleet(2).await;

    // Enough first turns to fill both caches (48 blocks each): each
    // engine evicts, and its capacity shows.
    let mut n = 0;
    for _ in 0..16 {
        fleet.chat(&prompt(n)).await;
        n += 1;
    }
    let s = occupancy_matches(&fleet, "occupancy as the engines count it").await;
    for e in &fleet.engines {
        let k = kv(&s, &e.engine.config().id);
        let stats = e.engine.stats();
        assert_eq!(k.block_tokens, Some(BLOCK_TOKENS));
        assert!(k.batches_total > 0 && k.stored_blocks_total > 0);
        assert_eq!((k.gaps_total, k.refused_total), (0, 0));
        if k.removed_blocks_total > 0 {
            assert_eq!(
                k.capacity_tokens,
                Some(stats.cache_capacity_blocks * BLOCK_TOKENS),
                "{}: the capacity is the engine's own",
                stats.id
            );
        }
    }
    assert!(
        s.replicas
            .iter()
            .any(|r| r.kv_events.as_ref().unwrap().removed_blocks_total > 0),
        "16 prompts of about 9 blocks fill at least one 48-block cache"
    );

    // engine-0 restarts: a new process on the same ports, its sequence
    // from 0 again. The sidecar reconnects and reads the restart from the
    // sequence alone (this engine's metrics show no start time).
    let old = fleet.stack.engines.remove(0);
    let (addr, endpoint) = (old.addr, old.engine.kv_events_endpoint().unwrap());
    let config = old.engine.config().clone();
    old.shutdown().await;
    let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
    let restarted = engine::spawn(
        EngineConfig {
            kv_events: Some(endpoint),
            ..config
        },
        listener,
    )
    .await
    .unwrap();
    fleet.stack.engines.insert(0, restarted);
    until(&fleet, "engine-0's feed reconnected", |s| {
        let k = kv(s, "engine-0");
        k.connected && k.connects_total == 2
    })
    .await;
    n = serve_on(&fleet, "engine-0", n).await;
    let s = until(&fleet, "the restart read from the sequence", |s| {
        kv(s, "engine-0").restarts_sequence_total == 1
    })
    .await;
    let r0 = s.replicas.iter().find(|r| r.id == "engine-0").unwrap();
    assert!(r0.health.state == hearth_router::HealthState::Serving);
    // The warmth before the restart is gone: only what came since is held.
    assert!(
        r0.warmth_blocks <= 2,
        "warmth after the restart: {}",
        r0.warmth_blocks
    );
    occupancy_matches(&fleet, "occupancy after the restart").await;
    assert_eq!(kv(&s, "engine-1").restarts_sequence_total, 0);

    // engine-1 loses a batch (a slow subscriber's gap): its figures are
    // approximate until its cache is emptied, which AllBlocksCleared says.
    fleet.engines[1].engine.drop_kv_batches(1);
    // The dropped batch, then one that shows the gap.
    n = serve_on(&fleet, "engine-1", n).await;
    serve_on(&fleet, "engine-1", n).await;
    let s = until(&fleet, "the gap seen", |s| {
        kv(s, "engine-1").gaps_total == 1
    })
    .await;
    let k = kv(&s, "engine-1");
    assert!(!k.exact);
    assert_eq!(k.inexact_reason.as_deref(), Some("gap"));
    assert_eq!(k.occupancy_tokens, None);
    reset_cache(&fleet, &fleet.engines[1].url()).await;
    let s = until(&fleet, "the cleared cache", |s| {
        kv(s, "engine-1").restarts_cleared_total == 2
    })
    .await;
    let k = kv(&s, "engine-1");
    assert!(k.exact);
    assert_eq!((k.held_blocks, k.occupancy_tokens), (0, Some(0)));

    let (_, metrics) = fleet.admin_get("/metrics").await.unwrap();
    let sample = |series: &str| metric_sample(&metrics, series);
    assert_eq!(
        sample("hearth_replica_kv_event_restarts_total{replica=\"engine-0\",reason=\"sequence\"}"),
        Some(1.0)
    );
    assert_eq!(
        sample("hearth_replica_kv_event_restarts_total{replica=\"engine-1\",reason=\"cleared\"}"),
        Some(2.0)
    );
    assert_eq!(
        sample("hearth_replica_kv_event_gaps_total{replica=\"engine-1\"}"),
        Some(1.0)
    );
    assert_eq!(
        sample("hearth_replica_kv_events_connected{replica=\"engine-0\"}"),
        Some(1.0)
    );
    fleet.assert_wasm_healthy();
}

/// Evictions as they happen: a conversation sent through the gateway,
/// then others' prompts straight to the engine (another gateway's
/// traffic, which Hearth never routes) until the engine has stored a whole
/// cache's worth since. The sidecar forgets the conversation's warmth from
/// the events alone, before its next turn, and the engine indeed no
/// longer holds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_evicted_by_others_traffic_loses_its_credit_before_its_next_turn() {
    let fleet = exact_fleet(1).await;
    let warm = |s: &Snapshot| s.replicas[0].warmth_blocks;

    let x = prompt(1_000);
    fleet.chat(&x).await;
    let s = until(&fleet, "X's blocks stored", |s| {
        kv(s, "engine-0").stored_blocks_total > 0
    })
    .await;
    assert!(warm(&s) > 0, "X is warm where it went");
    assert_eq!(kv(&s, "engine-0").forgotten_blocks_total, 0);
    // Others' prompts, straight to the engine: about 9 blocks each, 10 of
    // them against a 48-block cache.
    let mut n = 0;
    for _ in 0..10 {
        n = serve_on(&fleet, "engine-0", n).await;
    }
    let s = until(&fleet, "X forgotten", |s| {
        kv(s, "engine-0").forgotten_blocks_total > 0
    })
    .await;
    let k = kv(&s, "engine-0");
    assert!(k.exact && k.removed_blocks_total > 0, "{k:?}");
    assert_eq!(warm(&s), 0, "nothing Hearth sent there is credited");
    // The engine agrees: X's next turn reads nothing from its cache.
    let again = fleet.chat(&x).await;
    assert_eq!(again.cached_tokens(), 0, "{:?}", again.body);
    let (_, metrics) = fleet.admin_get("/metrics").await.unwrap();
    assert!(
        metric_sample(
            &metrics,
            "hearth_replica_kv_event_forgotten_blocks_total{replica=\"engine-0\"}"
        )
        .is_some_and(|n| n >= 1.0),
        "{metrics}"
    );
}

/// What the sidecar predicted and the engine served, in all, on `id`.
fn predicted_and_served(s: &Snapshot, id: &str) -> (u64, u64) {
    let r = s.replicas.iter().find(|r| r.id == id).expect("replica");
    (
        r.usage.predicted_cached_tokens_total,
        r.usage.compared_cached_tokens_total,
    )
}

/// A conversation whose engine freed the tail of its chain between two
/// turns (others' prompts, straight to the engine, needed the room): its
/// first turn was matched with the chain the engine stored for it, so the
/// events tell how much of it is left, and its next turn is predicted as
/// exactly what the engine then serves from its cache, not the whole
/// previous prompt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partly_evicted_conversation_is_predicted_from_what_its_engine_still_holds() {
    let fleet = exact_fleet(1).await;
    // About 2.4 KB: one fingerprint block, some 38 of the engine's 48.
    let mut x = Conversation::new(MODEL, &filler(71, 2200), false, 7100);
    let first = fleet.chat(&x.next_turn(200, false)).await;
    assert_eq!(first.status, 200, "{:?}", first.body);
    let prompt_tokens = first.body["usage"]["prompt_tokens"].as_u64().unwrap();
    x.push_assistant(&reply_text(&first.body));
    until(&fleet, "X matched with its stored chain", |s| {
        kv(s, "engine-0").matched_prompts_total >= 1
    })
    .await;
    // Others' prompts until the engine frees blocks: the least recently
    // used are X's last ones.
    let mut n = 0;
    while kv(
        &occupancy_matches(&fleet, "the engine's count").await,
        "engine-0",
    )
    .removed_blocks_total
        == 0
    {
        n = serve_on(&fleet, "engine-0", n).await;
        assert!(n < 20, "the engine never evicted");
    }
    let before = fleet.state().await.unwrap();
    let second = fleet.chat(&x.next_turn(200, false)).await;
    assert_eq!(second.status, 200, "{:?}", second.body);
    let served = second.cached_tokens();
    let whole = prompt_tokens / BLOCK_TOKENS * BLOCK_TOKENS;
    assert!(
        served > 0 && served < whole,
        "the engine kept part of X's {whole} tokens, not {served}"
    );
    let after = until(&fleet, "turn 2's usage", |s| {
        predicted_and_served(s, "engine-0").1 > predicted_and_served(&before, "engine-0").1
    })
    .await;
    let (p0, s0) = predicted_and_served(&before, "engine-0");
    let (p1, s1) = predicted_and_served(&after, "engine-0");
    assert_eq!(s1 - s0, served);
    assert_eq!(p1 - p0, served, "predicted what the engine still held");
}

/// With each engine's replay socket listed (`kv_events_replay=`), what a
/// feed missed is asked for again: batches published before the sidecar
/// subscribed and a dropped batch come back in order, so the figures stay
/// exact with no gap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missed_batches_come_back_from_the_replay_socket() {
    let fleet = Fleet::start(FleetOptions {
        engines: 2,
        kv_events: true,
        kv_events_replay: true,
        cache_capacity_tokens: CAPACITY_TOKENS,
        ..FleetOptions::default()
    })
    .await
    .unwrap();
    assert!(fleet
        .specs
        .iter()
        .all(|s| s.contains(";kv_events_replay=tcp://")));
    exact_through_a_dropped_batch(&fleet, 1000).await;
    fleet.assert_wasm_healthy();
}

/// First turns from `n` on each engine (three each, sent to it directly:
/// through the gateway one engine might get them all, and the other's
/// feed would have nothing to be exact about), then a batch of engine-1's
/// dropped: the figures are exact from the first batch, with no reset,
/// and again once the replay socket gave the dropped batch back.
async fn exact_through_a_dropped_batch(fleet: &Fleet, mut n: u64) {
    for k in 0..6 {
        n = serve_on(fleet, &format!("engine-{}", k % 2), n).await;
    }
    occupancy_matches(fleet, "exact from the first batch, no reset").await;
    fleet.engines[1].engine.drop_kv_batches(1);
    n = serve_on(fleet, "engine-1", n).await;
    serve_on(fleet, "engine-1", n).await;
    let s = until(fleet, "the dropped batch replayed", |s| {
        kv(s, "engine-1").replayed_batches_total >= 1
    })
    .await;
    let k = kv(&s, "engine-1");
    assert_eq!((k.gaps_total, k.refused_total), (0, 0), "{k:?}");
    occupancy_matches(fleet, "exact after the replay").await;
}

/// Listed `kv_events=auto`, each engine is asked where it publishes and
/// replays (`GET /kv_event_sources`, as vLLM answers it: a wildcard
/// host, read as the engine's own address), and its feed works as a
/// listed one does: exact figures, a dropped batch replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_listed_auto_are_asked_where_they_publish() {
    let fleet = Fleet::start(FleetOptions {
        engines: 2,
        kv_events: true,
        kv_events_replay: true,
        kv_events_auto: true,
        cache_capacity_tokens: CAPACITY_TOKENS,
        ..FleetOptions::default()
    })
    .await
    .unwrap();
    assert!(fleet
        .specs
        .iter()
        .all(|s| s.contains(";kv_events=auto") && !s.contains("kv_events_replay")));
    let s = until(
        &fleet,
        "both engines asked and their feeds connected",
        |s| {
            s.replicas
                .iter()
                .all(|r| r.kv_events.as_ref().is_some_and(|k| k.connected))
        },
    )
    .await;
    for e in &fleet.engines {
        let id = e.engine.config().id.clone();
        let own = e.engine.kv_events_endpoint().unwrap();
        assert_eq!(kv(&s, &id).endpoint, format!("auto: {own}"), "{id}");
    }
    exact_through_a_dropped_batch(&fleet, 2000).await;
    fleet.assert_wasm_healthy();
}

/// vLLM's own publisher (`ZmqEventPublisher`: libzmq through pyzmq, its
/// msgspec batches, its ROUTER replay socket) over `ipc://`, the only
/// local endpoint vLLM binds, read by the sidecar's subscriber: byte-string
/// hashes, a cleared cache, stored and removed blocks, and the batches sent
/// before the subscription took hold asked for again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllms_own_publisher_is_read_over_ipc() {
    use std::process::Stdio;
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

    if !hearth_e2e::vllm::vllm_or_skip("vllms_own_publisher_is_read_over_ipc") {
        return;
    }
    let install = hearth_bench::vllm::VllmInstall::find().unwrap();
    let dir = std::env::temp_dir().join(format!("hearth-kv-ipc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("kv.sock");
    let endpoint = format!("ipc://{}", path.display());
    let replay = format!("ipc://{}", dir.join("replay.sock").display());
    // One batch per line read: a cleared cache, then `n` stored blocks (of
    // 16 tokens, SHA-256-sized byte hashes) and the first of them removed.
    let script = r#"
import sys
from vllm.distributed.kv_events import (
    AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher)
pub = ZmqEventPublisher(data_parallel_rank=0, endpoint=sys.argv[1], replay_endpoint=sys.argv[2],
    topic="kv@0")
print("ready", flush=True)
for line in sys.stdin:
    n = int(line)
    hashes = [bytes([k + 1]) * 32 for k in range(n)]
    events = [AllBlocksCleared()]
    for k, h in enumerate(hashes):
        events.append(BlockStored(block_hashes=[h], parent_block_hash=hashes[k - 1] if k else None,
            token_ids=list(range(16)), block_size=16, lora_id=None, medium="GPU", lora_name=None))
    events.append(BlockRemoved(block_hashes=hashes[:1], medium="GPU"))
    pub.publish(KVEventBatch(ts=1.0, events=events))
    pub._event_queue.join()
    print("sent", flush=True)
pub.shutdown()
"#;
    let mut child = tokio::process::Command::new(&install.python)
        .arg("-c")
        .arg(script)
        .arg(&endpoint)
        .arg(&replay)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let ready = tokio::time::timeout(Duration::from_secs(180), lines.next_line()).await;
    assert!(
        matches!(&ready, Ok(Ok(Some(l))) if l.contains("ready")),
        "vLLM's publisher did not start: {ready:?}"
    );

    // Three batches before anyone subscribes: a PUB socket drops them, its
    // replay socket keeps them.
    for _ in 0..3 {
        stdin.write_all(b"1\n").await.unwrap();
        let sent = tokio::time::timeout(Duration::from_secs(20), lines.next_line()).await;
        assert!(matches!(&sent, Ok(Ok(Some(l))) if l == "sent"), "{sent:?}");
    }
    let mut published = 3;
    let spec: hearth_router::UpstreamSpec =
        format!("127.0.0.1:9;id=v;kv_events={endpoint};kv_events_replay={replay}")
            .parse()
            .unwrap();
    let router = hearth_router::Router::new(hearth_router::RouterParams::default(), &[spec]);
    let feed = tokio::spawn(hearth_ext_proc::feeds::kv_events::run(
        router.clone(),
        hearth_ext_proc::feeds::engines::EngineClient::new(None, None).unwrap(),
    ));
    let snap = || router.snapshot().replicas[0].kv_events.clone().unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !snap().connected {
        assert!(Instant::now() < deadline, "no connection: {:?}", snap());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A new subscription reaches a PUB socket a moment after the
    // connection: batches until one arrives.
    while snap().batches_total == 0 {
        assert!(Instant::now() < deadline, "no batch arrived: {:?}", snap());
        stdin.write_all(b"1\n").await.unwrap();
        published += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stdin.write_all(b"5\n").await.unwrap();
    published += 1;
    while snap().batches_total < published {
        assert!(
            Instant::now() < deadline,
            "the last batch did not arrive: {:?}",
            snap()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let k = snap();
    assert!(k.exact, "{k:?}");
    assert_eq!((k.held_blocks, k.occupancy_tokens), (4, Some(64)));
    assert_eq!(k.block_tokens, Some(16));
    assert_eq!((k.refused_total, k.gaps_total), (0, 0));
    assert_eq!(k.restarts_cleared_total, k.batches_total);
    // Every batch applied once, in order: those published before the
    // subscription took hold came back from vLLM's replay socket.
    assert_eq!(
        (k.batches_total, k.sequence),
        (published, Some(published - 1))
    );
    assert!(k.replayed_batches_total >= 3, "{k:?}");
    eprintln!(
        "{published} batches, {} of them replayed",
        k.replayed_batches_total
    );
    feed.abort();
    drop(stdin);
    let _ = tokio::time::timeout(Duration::from_secs(10), child.wait()).await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// A hostile publisher on one replica's event endpoint (the sidecar's own
/// subscriber and router, no Envoy): garbage batches, a wrong frame count,
/// a sequence jumping around, then a frame announcing 2^62 bytes. The
/// feed is refused message by message, then dropped and tried again; the
/// replica keeps serving and routing, and the other replica's feed, from
/// an honest publisher, stays exact. A feed that never connects shows as
/// disconnected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_feed_reaches_only_its_own_replica_and_fences_nothing() {
    use hearth_ext_proc::feeds::kv_events::{read_message, MAX_FRAMES};
    use hearth_wire::kv_events::{encode_batch, Batch, Event, Medium};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let hostile = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hostile_addr = hostile.local_addr().unwrap();
    let honest = engine::spawn(
        EngineConfig {
            id: "honest".into(),
            kv_events: Some("tcp://127.0.0.1:0".into()),
            ..EngineConfig::default()
        },
        tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap(),
    )
    .await
    .unwrap();
    let nowhere = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let specs: Vec<hearth_router::UpstreamSpec> = [
        format!("127.0.0.1:1;id=hostile;kv_events=tcp://{hostile_addr}"),
        format!(
            "{};id=honest;kv_events={}",
            honest.addr,
            honest.engine.kv_events_endpoint().unwrap()
        ),
        format!("127.0.0.1:3;id=silent;kv_events=tcp://{nowhere}"),
    ]
    .iter()
    .map(|s| s.parse().unwrap())
    .collect();
    let router = hearth_router::Router::new(hearth_router::RouterParams::default(), &specs);
    let feed = tokio::spawn(hearth_ext_proc::feeds::kv_events::run(
        router.clone(),
        hearth_ext_proc::feeds::engines::EngineClient::new(None, None).unwrap(),
    ));

    // The hostile side: a PUB's handshake, then what it likes.
    let serve = async {
        let (mut s, _) = hostile.accept().await.unwrap();
        let mut greeting = [0u8; 64];
        s.read_exact(&mut greeting).await.unwrap();
        let mut ours = [0u8; 64];
        ours[0] = 0xff;
        ours[9] = 0x7f;
        ours[10] = 3;
        ours[12..16].copy_from_slice(b"NULL");
        s.write_all(&ours).await.unwrap();
        let mut body = vec![0x05];
        body.extend_from_slice(b"READY");
        body.push(11);
        body.extend_from_slice(b"Socket-Type");
        body.extend_from_slice(&3u32.to_be_bytes());
        body.extend_from_slice(b"PUB");
        s.write_all(&[0x04, body.len() as u8]).await.unwrap();
        s.write_all(&body).await.unwrap();
        // Their READY (a command, skipped) and their subscription.
        let subscription = read_message(&mut s, MAX_FRAMES).await.unwrap();
        assert_eq!(subscription, vec![vec![0x01]]);
        s
    };
    let message = |seq: u64, payload: &[u8]| {
        let mut m = vec![0x01, 0x00, 0x01, 0x08];
        m.extend_from_slice(&seq.to_be_bytes());
        m.push(0x02);
        m.extend_from_slice(&(payload.len() as u64).to_be_bytes());
        m.extend_from_slice(payload);
        m
    };
    let cleared = encode_batch(&Batch {
        ts: 0.0,
        events: vec![
            Event::AllCleared,
            Event::Stored {
                hashes: vec![1, 2, 3],
                parent: None,
                tokens: 48,
                block_size: 16,
                medium: Medium::Device,
            },
        ],
        data_parallel_rank: None,
    });
    let mut s = serve.await;
    let mut junk = Vec::new();
    for seq in [0u64, 7, 3, u64::MAX, 0, 12] {
        junk.extend(message(seq, &cleared));
    }
    junk.extend(message(13, b"\xc1 not msgpack"));
    junk.extend([0x00, 0x01, b'x']); // one frame, not three
    s.write_all(&junk).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let snap = |id: &str| {
        let s = router.snapshot();
        let r = s.replicas.iter().find(|r| r.id == id).unwrap().clone();
        (r.kv_events.clone().unwrap(), r)
    };
    while snap("hostile").0.refused_total < 2 {
        assert!(Instant::now() < deadline, "{:?}", snap("hostile").0);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A frame announcing 2^62 bytes: the feed is dropped, then comes back.
    s.write_all(&[0x02, 0x40, 0, 0, 0, 0, 0, 0, 0])
        .await
        .unwrap();
    let mut again = hostile.accept().await.unwrap().0;
    let mut greeting = [0u8; 64];
    again.read_exact(&mut greeting).await.unwrap();
    assert_eq!(greeting[0], 0xff, "the feed reconnects, as a subscriber");

    let (k, r) = snap("hostile");
    assert!(!k.exact);
    assert!(k.restarts_sequence_total >= 1 && k.restarts_cleared_total >= 1);
    assert_eq!(r.health.state, hearth_router::HealthState::Serving);
    assert!(k.held_blocks <= 3);
    // The honest engine's feed, meanwhile: a batch, exact.
    honest.engine.admit(&[7u8; 4 * 16 * 5]);
    while !snap("honest").0.exact {
        assert!(Instant::now() < deadline, "{:?}", snap("honest").0);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (k, r) = snap("honest");
    assert_eq!((k.held_blocks, k.refused_total, k.gaps_total), (5, 0, 0));
    assert_eq!(r.health.state, hearth_router::HealthState::Serving);
    // Nothing listens for the third: disconnected, nothing else changed.
    let (k, r) = snap("silent");
    assert!(!k.connected && !k.exact && k.batches_total == 0);
    assert_eq!(k.inexact_reason.as_deref(), Some("disconnected"));
    assert_eq!(r.health.state, hearth_router::HealthState::Serving);
    // Every replica still takes requests.
    for h in 0..30u64 {
        let req = hearth_router::RequestInfo {
            hashes: vec![h * 1000 + 1, h * 1000 + 2],
            prompt_bytes: 4096,
            model: None,
            max_output_tokens: None,
            cache: Default::default(),
            priority: 0,
            flow: 0,
        };
        drop(router.decide(&req).unwrap());
    }
    let routed: Vec<u64> = router
        .snapshot()
        .replicas
        .iter()
        .map(|r| r.routed_total)
        .collect();
    assert!(routed.iter().all(|n| *n > 0), "{routed:?}");
    feed.abort();
    honest.shutdown().await;
}

/// A data-parallel engine listed once (`dp=2;kv_events=tcp://ip:P`): each
/// rank has its own cache and publishes on the port plus its rank, as
/// vLLM does, and the sidecar follows each rank's feed into that rank's
/// figures only. Two simulated engines stand for the two ranks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_data_parallel_rank_is_read_from_its_own_port() {
    // Two free ports in a row (tried again if another process takes one
    // between the look and the bind).
    let mut ranks = None;
    for _ in 0..20 {
        let first = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = first.local_addr().unwrap().port();
        let Some(next) = port.checked_add(1) else {
            continue;
        };
        if std::net::TcpListener::bind(("127.0.0.1", next)).is_err() {
            continue;
        }
        drop(first);
        let mut spawned = Vec::new();
        for (rank, p) in [(0, port), (1, next)] {
            let config = EngineConfig {
                id: format!("rank{rank}"),
                kv_events: Some(format!("tcp://127.0.0.1:{p}")),
                ..EngineConfig::default()
            };
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            if let Ok(e) = engine::spawn(config, listener).await {
                spawned.push(e);
            }
        }
        if spawned.len() == 2 {
            ranks = Some((port, spawned));
            break;
        }
        for e in spawned {
            e.shutdown().await;
        }
    }
    let (port, ranks) = ranks.expect("two free ports in a row");
    let spec: hearth_router::UpstreamSpec = format!(
        "{};id=dp;dp=2;kv_events=tcp://127.0.0.1:{port}",
        ranks[0].addr
    )
    .parse()
    .unwrap();
    let router = hearth_router::Router::new(hearth_router::RouterParams::default(), &[spec]);
    let feed = tokio::spawn(hearth_ext_proc::feeds::kv_events::run(
        router.clone(),
        hearth_ext_proc::feeds::engines::EngineClient::new(None, None).unwrap(),
    ));
    let held = || -> Vec<(String, bool, usize)> {
        router
            .snapshot()
            .replicas
            .iter()
            .map(|r| {
                let k = r.kv_events.as_ref().expect("listed with kv_events=");
                (r.id.clone(), k.exact, k.held_blocks)
            })
            .collect()
    };
    // Both feeds connected before anything is cached, so both are exact
    // from their first batch.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !router
        .snapshot()
        .replicas
        .iter()
        .all(|r| r.kv_events.as_ref().is_some_and(|k| k.connected))
    {
        assert!(
            Instant::now() < deadline,
            "{:?}",
            router.snapshot().replicas
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    ranks[0].engine.admit(&[3u8; 4 * 16 * 5]);
    ranks[1].engine.admit(&[4u8; 4 * 16 * 8]);
    let want = vec![
        ("dp/rank0".to_string(), true, 5),
        ("dp/rank1".to_string(), true, 8),
    ];
    while held() != want {
        assert!(Instant::now() < deadline, "{:?}", held());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let s = router.snapshot();
    let endpoints: Vec<String> = s
        .replicas
        .iter()
        .map(|r| r.kv_events.as_ref().unwrap().endpoint.clone())
        .collect();
    assert_eq!(
        endpoints,
        vec![
            format!("tcp://127.0.0.1:{port}"),
            format!("tcp://127.0.0.1:{}", port + 1)
        ]
    );
    feed.abort();
    for e in ranks {
        e.shutdown().await;
    }
}

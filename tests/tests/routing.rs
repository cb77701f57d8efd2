//! Routing features through the real Envoy: the long-prompt lane,
//! data-parallel ranks, engine load signals and queue admission.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use futures::StreamExt;
use hearth_e2e::{filler, reply_text, Conversation, Fleet, FleetOptions, MODEL};

#[tokio::test]
async fn long_prompts_take_the_long_lane_and_short_ones_stay_off_it() {
    let fleet = Fleet::start(FleetOptions {
        engines: 3,
        upstream_options: vec![(2, ";tag=long".into())],
        sidecar_flags: vec![
            "--long-prompt-bytes=65536".into(),
            "--long-lane=exclusive".into(),
            "--probe-interval-seconds=0".into(),
        ],
        ..FleetOptions::default()
    })
    .await
    .unwrap();
    for s in 0..8u64 {
        let mut conv = Conversation::new(MODEL, &filler(s, 2048), false, 2000 + s);
        let t = fleet.chat(&conv.next_turn(1000, false)).await;
        assert_ne!(
            t.engine.as_deref(),
            Some("engine-2"),
            "short prompt {s} on the long lane"
        );
    }
    for s in 0..4u64 {
        let mut conv = Conversation::new(MODEL, &filler(s + 100, 100 * 1024), false, 2100 + s);
        let t = fleet.chat(&conv.next_turn(1000, false)).await;
        assert_eq!(
            t.engine.as_deref(),
            Some("engine-2"),
            "long prompt {s} off the long lane"
        );
    }
    fleet.assert_wasm_healthy();
}

#[tokio::test]
async fn data_parallel_ranks_are_routed_by_header_and_sessions_keep_their_rank() {
    let fleet = Fleet::start(FleetOptions {
        engines: 2,
        upstream_options: vec![(0, ";dp=2".into())],
        sidecar_flags: vec!["--probe-interval-seconds=0".into()],
        ..FleetOptions::default()
    })
    .await
    .unwrap();
    let mut ranks_seen = HashSet::new();
    let mut targets: HashMap<String, usize> = HashMap::new();
    for s in 0..9u64 {
        let mut conv = Conversation::new(MODEL, &filler(s + 300, 4096), false, 2200 + s);
        let mut home: Option<String> = None;
        for _ in 0..3 {
            let t = fleet.chat(&conv.next_turn(1500, false)).await;
            let target = t.upstream.clone().unwrap();
            if let Some(h) = &home {
                assert_eq!(&target, h, "session {s} changed target");
            }
            home = Some(target.clone());
            *targets.entry(target.clone()).or_default() += 1;
            // Requests for a rank carry it to the engine behind the address.
            if let Some(rank) = target.strip_prefix("engine-0/rank") {
                assert_eq!(t.engine.as_deref(), Some("engine-0"));
                let echoed = fleet
                    .client
                    .post(format!("{}/v1/chat/completions", fleet.envoy.url()))
                    .json(&conv.body(false))
                    .send()
                    .await
                    .unwrap()
                    .headers()
                    .get("x-engine-dp-rank")
                    .map(|v| v.to_str().unwrap().to_string());
                assert_eq!(echoed.as_deref(), Some(rank));
                ranks_seen.insert(rank.to_string());
            } else {
                assert_eq!(target, "engine-1");
            }
            conv.push_assistant(&reply_text(&t.body));
        }
    }
    assert_eq!(
        ranks_seen.len(),
        2,
        "both ranks served sessions: {targets:?}"
    );
    fleet.assert_wasm_healthy();
}

/// Opens `n` streams straight to an engine (as another gateway would) and
/// keeps them open until the returned tasks are dropped.
fn hold_streams(url: String, n: u64, seed: u64) -> Vec<tokio::task::JoinHandle<()>> {
    (0..n)
        .map(|i| {
            let url = url.clone();
            tokio::spawn(async move {
                let mut conv = Conversation::new(MODEL, "other gateway", false, seed + i);
                let mut body = conv.next_turn(100, true);
                body["max_tokens"] = 2000.into();
                let client = reqwest::Client::new();
                if let Ok(resp) = client.post(&url).json(&body).send().await {
                    let mut s = resp.bytes_stream();
                    while s.next().await.is_some() {}
                }
            })
        })
        .collect()
}

async fn wait_until(deadline: Duration, mut cond: impl AsyncFnMut() -> bool) {
    let until = Instant::now() + deadline;
    while !cond().await {
        assert!(
            Instant::now() < until,
            "condition not reached within {deadline:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn engine_queues_steer_new_work_and_full_queues_shed_with_429() {
    let fleet = Fleet::start(FleetOptions {
        engines: 2,
        max_running: 1,
        decode_micros_per_token: 5_000.0,
        sidecar_flags: vec![
            "--engine-metrics-seconds=0.2".into(),
            "--max-queue=2".into(),
            "--probe-interval-seconds=0".into(),
        ],
        ..FleetOptions::default()
    })
    .await
    .unwrap();
    // Another gateway fills engine-0: one running, two queued.
    let held0 = hold_streams(
        format!("{}/v1/chat/completions", fleet.engines[0].url()),
        3,
        5000,
    );
    wait_until(Duration::from_secs(10), async || {
        let s = fleet.state().await.unwrap();
        s.replicas[0]
            .engine
            .as_ref()
            .is_some_and(|e| e.waiting >= 2.0)
    })
    .await;
    for s in 0..4u64 {
        let mut conv = Conversation::new(MODEL, &filler(s + 400, 2048), false, 2300 + s);
        let mut body = conv.next_turn(500, false);
        body["max_tokens"] = 2.into();
        let t = fleet.chat(&body).await;
        assert_eq!(
            t.engine.as_deref(),
            Some("engine-1"),
            "request {s} went to the full engine"
        );
    }
    // Both full: the gateway sheds instead of piling on.
    let held1 = hold_streams(
        format!("{}/v1/chat/completions", fleet.engines[1].url()),
        3,
        6000,
    );
    wait_until(Duration::from_secs(10), async || {
        let s = fleet.state().await.unwrap();
        s.replicas[1]
            .engine
            .as_ref()
            .is_some_and(|e| e.waiting >= 2.0)
    })
    .await;
    let mut conv = Conversation::new(MODEL, "shed me", false, 2400);
    let resp = fleet
        .client
        .post(format!("{}/v1/chat/completions", fleet.envoy.url()))
        .json(&conv.next_turn(100, false))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 429);
    assert!(resp.headers().contains_key("retry-after"));
    let v: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(v["error"]["code"], "overloaded");
    for h in held0.into_iter().chain(held1) {
        h.abort();
    }
    fleet.assert_wasm_healthy();
}

#[tokio::test]
async fn short_outputs_prefer_short_output_replicas_when_cache_and_load_tie() {
    let fleet = Fleet::start(FleetOptions {
        engines: 2,
        upstream_options: vec![(1, ";profile=short-output".into())],
        sidecar_flags: vec!["--probe-interval-seconds=0".into()],
        ..FleetOptions::default()
    })
    .await
    .unwrap();
    for s in 0..4u64 {
        let mut short = Conversation::new(MODEL, &filler(s + 500, 2048), false, 2500 + s);
        let mut body = short.next_turn(500, false);
        body["max_tokens"] = 16.into();
        assert_eq!(fleet.chat(&body).await.engine.as_deref(), Some("engine-1"));
        let mut long = Conversation::new(MODEL, &filler(s + 600, 2048), false, 2600 + s);
        let mut body = long.next_turn(500, false);
        body["max_completion_tokens"] = 2000.into();
        body.as_object_mut().unwrap().remove("max_tokens");
        assert_eq!(fleet.chat(&body).await.engine.as_deref(), Some("engine-0"));
    }
    fleet.assert_wasm_healthy();
}

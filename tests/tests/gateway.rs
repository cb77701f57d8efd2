//! End to end through the real Envoy: filter-wasm fingerprints, the sidecar
//! decides, override_host routes, simulated engines report cache hits.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use futures::StreamExt;
use hearth_e2e::{filler, reply_text, Conversation, Fleet, FleetOptions, MODEL};
use serde_json::json;

/// Runs `turns` sequential turns of `conv`, returning the serving engines.
async fn run_turns(
    fleet: &Fleet,
    conv: &mut Conversation,
    turns: usize,
    user_bytes: usize,
) -> Vec<hearth_e2e::Turn> {
    let mut out = Vec::new();
    for _ in 0..turns {
        let turn = fleet.chat(&conv.next_turn(user_bytes, false)).await;
        conv.push_assistant(&reply_text(&turn.body));
        conv.push_tool_round(user_bytes);
        out.push(turn);
    }
    out
}

#[tokio::test]
async fn sessions_stay_on_one_replica_and_hit_the_cache_every_turn() {
    let fleet = Fleet::start(FleetOptions::default()).await.unwrap();
    let system = filler(1, 4096);
    for s in 0..6u64 {
        let mut conv = Conversation::new(MODEL, &format!("{system} tenant {s}"), true, 100 + s);
        let turns = run_turns(&fleet, &mut conv, 4, 3000).await;
        let home = turns[0].engine.clone().expect("x-engine-id");
        for (i, t) in turns.iter().enumerate() {
            assert_eq!(
                t.engine.as_deref(),
                Some(home.as_str()),
                "session {s} turn {} moved",
                i + 1
            );
            assert_eq!(
                t.upstream, t.engine,
                "x-hearth-upstream names the serving replica"
            );
            if i > 0 {
                assert!(
                    t.cached_tokens() > 0,
                    "session {s} turn {} read no cached tokens: {:?}",
                    i + 1,
                    t.body["usage"]
                );
            }
        }
    }
    // The filter hashed every turn and its VM never failed.
    let hashed = fleet
        .envoy
        .stat("wasmcustom.hearth_filter.hashed")
        .await
        .unwrap();
    assert_eq!(
        hashed,
        Some(24),
        "filter stats: {:?}",
        fleet.envoy.stats_matching("hearth_filter").await
    );
    let state = fleet.state().await.unwrap();
    assert_eq!(state.hashed_total, 24);
    assert!(state.replicas.iter().all(|r| r.in_flight == 0));
    assert!(
        state
            .replicas
            .iter()
            .map(|r| r.warmth_blocks)
            .sum::<usize>()
            > 0
    );
}

/// With a 64 KiB harness prompt shared by every session, sessions that
/// start together spread over the replicas (load outweighs the shared
/// prompt's credit), and each one then stays on its replica.
async fn shared_prompt_spreads_and_stays(basis: &str) {
    let fleet = Fleet::start(FleetOptions {
        sidecar_flags: vec![format!("--affinity-basis={basis}")],
        decode_micros_per_token: 30_000.0,
        ..FleetOptions::default()
    })
    .await
    .unwrap();
    let system = filler(2, 64 * 1024);
    let mut convs: Vec<Conversation> = (0..8u64)
        .map(|s| Conversation::new(MODEL, &system, true, 200 + s))
        .collect();
    // First turns all at once.
    let bodies: Vec<_> = convs.iter_mut().map(|c| c.next_turn(8192, false)).collect();
    let firsts = futures::future::join_all(bodies.iter().map(|b| fleet.chat(b))).await;
    let homes: Vec<String> = firsts.iter().map(|t| t.engine.clone().unwrap()).collect();
    let distinct: HashSet<&String> = homes.iter().collect();
    assert!(
        distinct.len() > 1,
        "{basis}: every session landed on {:?}",
        homes[0]
    );
    for (c, t) in convs.iter_mut().zip(&firsts) {
        c.push_assistant(&reply_text(&t.body));
        c.push_tool_round(16 * 1024);
    }
    // Later turns, one at a time: each session returns to its replica.
    for round in 2..=3 {
        for (s, c) in convs.iter_mut().enumerate() {
            let t = fleet.chat(&c.next_turn(8192, false)).await;
            assert_eq!(
                t.engine.as_ref(),
                Some(&homes[s]),
                "{basis}: session {s} moved in turn {round}"
            );
            assert!(
                t.cached_tokens() > 16_000,
                "{basis}: session {s} turn {round}: {:?}",
                t.body["usage"]
            );
            c.push_assistant(&reply_text(&t.body));
            c.push_tool_round(16 * 1024);
        }
    }
    let mut per_engine: HashMap<&String, usize> = HashMap::new();
    for h in &homes {
        *per_engine.entry(h).or_default() += 1;
    }
    eprintln!("{basis}: sessions per replica {per_engine:?}");
}

#[tokio::test]
async fn marginal_spreads_sessions_sharing_a_system_prompt() {
    shared_prompt_spreads_and_stays("marginal").await;
}

#[tokio::test]
async fn relative_spreads_sessions_sharing_a_system_prompt() {
    shared_prompt_spreads_and_stays("relative").await;
}

#[tokio::test]
async fn forged_routing_headers_change_nothing() {
    let fleet = Fleet::start(FleetOptions::default()).await.unwrap();
    let mut conv = Conversation::new(MODEL, &filler(3, 8192), true, 300);
    let home = run_turns(&fleet, &mut conv, 2, 4000).await[0]
        .engine
        .clone()
        .unwrap();
    let home_idx: usize = home.trim_start_matches("engine-").parse().unwrap();
    let other = fleet.engines[(home_idx + 1) % fleet.engines.len()]
        .addr
        .to_string();
    // A loopback port nothing listens on: a host outside the cluster.
    let outside = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string();
    let other_fp = hearth_wire::header::encode(2048, &[1, 2, 3, 4]);
    let forgeries: Vec<Vec<(&str, &str)>> = vec![
        vec![("x-gateway-destination-endpoint", other.as_str())],
        vec![("x-gateway-destination-endpoint", outside.as_str())],
        vec![
            ("x-hearth-fp", other_fp.as_str()),
            ("x-hearth-prompt-bytes", "1"),
            ("x-hearth-model", "x"),
        ],
        vec![
            ("x-gateway-destination-endpoint", other.as_str()),
            ("x-hearth-fp", "garbage"),
        ],
    ];
    for headers in forgeries {
        let body = conv.next_turn(1000, false);
        let mut all = vec![("content-type", "application/json")];
        all.extend(headers.iter().copied());
        let t = fleet
            .post(
                "/v1/chat/completions",
                serde_json::to_vec(&body).unwrap(),
                &all,
            )
            .await
            .unwrap();
        assert_eq!(t.status, 200, "{headers:?}: {:?}", t.body);
        assert_eq!(
            t.engine.as_deref(),
            Some(home.as_str()),
            "forged {headers:?} moved the session"
        );
        conv.push_assistant(&reply_text(&t.body));
    }
    // An unhashed request (GET) with a forged destination still lands inside the cluster.
    let resp = fleet
        .client
        .get(format!("{}/v1/models", fleet.envoy.url()))
        .header("x-gateway-destination-endpoint", outside.as_str())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.headers().get("x-engine-id").is_some());
}

/// Stripping, not overwriting: on a request the filter does not
/// fingerprint (its body is not JSON), nothing sets Hearth's headers
/// after the client, so whatever the sidecar sees of them came from the
/// client. The journal shows it saw no fingerprint and no model (a forged
/// model would have been refused as unknown), where an overwrite-only
/// defence would have let all three through.
#[tokio::test]
async fn client_sent_hearth_headers_are_stripped_before_the_sidecar_reads_them() {
    let fleet = Fleet::start(FleetOptions::default()).await.unwrap();
    let forged_fp = hearth_wire::header::encode(2048, &[1, 2, 3, 4]);
    let t = fleet
        .post(
            "/v1/chat/completions",
            b"not json, so the filter sets nothing".to_vec(),
            &[
                ("content-type", "application/json"),
                ("x-request-id", "strip-1"),
                ("x-hearth-fp", forged_fp.as_str()),
                ("x-hearth-prompt-bytes", "8192"),
                ("x-hearth-model", "no-such-model"),
            ],
        )
        .await
        .unwrap();
    assert_eq!(t.status, 400, "the engine judged the body: {:?}", t.body);
    assert!(t.engine.is_some(), "routed to a replica, not refused");
    let (code, text) = fleet
        .admin_get("/debug/decisions?request_id=strip-1")
        .await
        .unwrap();
    assert_eq!(code, 200, "{text}");
    let found: serde_json::Value = serde_json::from_str(&text).unwrap();
    let d = &found["decisions"][0];
    assert_eq!(d["outcome"], "routed", "{d}");
    assert_eq!(
        d["blocks"], 0,
        "the forged fingerprint reached the sidecar: {d}"
    );
    assert_eq!(d["prompt_bytes"], 0, "{d}");
    assert!(d["first_hash"].is_null(), "{d}");
    assert!(
        d["model"].is_null(),
        "the forged model reached the sidecar: {d}"
    );
}

#[tokio::test]
async fn non_json_bodies_and_unknown_paths_still_reach_a_replica() {
    let fleet = Fleet::start(FleetOptions::default()).await.unwrap();
    let t = fleet
        .post(
            "/v1/chat/completions",
            b"this is not json {".to_vec(),
            &[("content-type", "application/json")],
        )
        .await
        .unwrap();
    assert_eq!(
        t.status, 400,
        "the engine, not the gateway, judges the body: {:?}",
        t.body
    );
    assert!(t.engine.is_some(), "reached a replica");
    let t = fleet
        .post(
            "/v1/chat/completions",
            br#"[1,2,3]"#.to_vec(),
            &[("content-type", "application/json")],
        )
        .await
        .unwrap();
    assert!(t.engine.is_some());
    let t = fleet
        .post("/v2/unknown", b"{}".to_vec(), &[])
        .await
        .unwrap();
    assert_eq!(t.status, 404);
    assert!(t.engine.is_some());
    let skipped = fleet
        .envoy
        .stats_matching("hearth_filter.skipped")
        .await
        .unwrap();
    let total: u64 = skipped
        .iter()
        .filter_map(|(_, v)| v.parse::<u64>().ok())
        .sum();
    assert!(total >= 2, "skip counters: {skipped:?}");
    // A normal request still routes by cache afterwards.
    let mut conv = Conversation::new(MODEL, &filler(4, 4096), false, 400);
    let turns = run_turns(&fleet, &mut conv, 2, 2000).await;
    assert_eq!(turns[0].engine, turns[1].engine);
    assert!(turns[1].cached_tokens() > 0);
}

#[tokio::test]
async fn an_unknown_model_is_an_openai_shaped_404() {
    // Replicas restricted to MODEL: a request for another model has nowhere to go.
    let fleet = Fleet::start(FleetOptions {
        model_tag: true,
        ..FleetOptions::default()
    })
    .await
    .unwrap();
    let mut conv = Conversation::new("another-model", "sys", false, 500);
    let t = fleet
        .post_json("/v1/chat/completions", &conv.next_turn(100, false))
        .await
        .unwrap();
    assert_eq!(t.status, 404, "{:?}", t.body);
    assert_eq!(t.body["error"]["code"], "model_not_found");
    assert_eq!(t.body["error"]["type"], "invalid_request_error");
    assert!(t.engine.is_none());
    let mut conv = Conversation::new(MODEL, "sys", false, 501);
    assert_eq!(fleet.chat(&conv.next_turn(100, false)).await.status, 200);
}

#[tokio::test]
async fn fail_open_without_the_sidecar_and_cache_aware_again_when_it_returns() {
    let mut fleet = Fleet::start(FleetOptions::default()).await.unwrap();
    let mut conv = Conversation::new(MODEL, &filler(5, 4096), false, 600);
    let before = run_turns(&fleet, &mut conv, 2, 2000).await;
    assert!(before.iter().all(|t| t.upstream.is_some()));

    fleet.stop_sidecar().await.unwrap();
    for _ in 0..6 {
        let t = fleet.chat(&conv.next_turn(500, false)).await;
        assert!(t.upstream.is_none(), "no sidecar, no x-hearth-upstream");
        conv.push_assistant(&reply_text(&t.body));
    }

    fleet.start_sidecar().await.unwrap();
    // The new sidecar starts cold; from its first decision on, the session
    // stays on the replica it chose and reads from cache.
    let after = run_turns(&fleet, &mut conv, 4, 2000).await;
    assert!(
        after.iter().all(|t| t.upstream.is_some()),
        "sidecar back in the path"
    );
    let home = after[0].engine.clone();
    assert!(
        after.iter().all(|t| t.engine == home),
        "{:?}",
        after.iter().map(|t| &t.engine).collect::<Vec<_>>()
    );
    assert!(after[1..].iter().all(|t| t.cached_tokens() > 0));
}

fn stream_body(conv: &mut Conversation, max_tokens: u64) -> serde_json::Value {
    let mut body = conv.next_turn(2000, true);
    body["max_tokens"] = json!(max_tokens);
    body
}

#[tokio::test]
async fn streams_pass_intact_and_aborted_streams_release_their_load() {
    let fleet = Fleet::start(FleetOptions {
        decode_micros_per_token: 10_000.0,
        ..FleetOptions::default()
    })
    .await
    .unwrap();
    let url = format!("{}/v1/chat/completions", fleet.envoy.url());

    // A full stream through the gateway matches the same stream read
    // straight from the engine that served it, event for event.
    let mut conv = Conversation::new(MODEL, &filler(6, 4096), false, 700);
    let body = stream_body(&mut conv, 30);
    let via = fleet.client.post(&url).json(&body).send().await.unwrap();
    assert_eq!(via.status(), 200);
    let engine_id = via.headers()["x-engine-id"].to_str().unwrap().to_string();
    let via_text = via.text().await.unwrap();
    let engine = &fleet.engines[engine_id
        .trim_start_matches("engine-")
        .parse::<usize>()
        .unwrap()];
    let direct = fleet
        .client
        .post(format!("{}/v1/chat/completions", engine.url()))
        .json(&body)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let events = |t: &str| -> Vec<String> {
        t.lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .map(|d| {
                // ids and timestamps differ per request; compare the rest.
                match serde_json::from_str::<serde_json::Value>(d) {
                    Ok(mut v) => {
                        v.as_object_mut().map(|o| {
                            o.remove("id");
                            o.remove("created");
                            o.remove("usage")
                        });
                        v.to_string()
                    }
                    Err(_) => d.to_string(),
                }
            })
            .collect()
    };
    assert!(via_text.contains("data: [DONE]"));
    assert_eq!(events(&via_text), events(&direct));
    assert!(events(&via_text).len() >= 30);

    // While a stream is open, its load is held; it is released at the end.
    let mut conv = Conversation::new(MODEL, &filler(7, 4096), false, 701);
    let resp = fleet
        .client
        .post(&url)
        .json(&stream_body(&mut conv, 100))
        .send()
        .await
        .unwrap();
    let mut chunks = resp.bytes_stream();
    chunks.next().await.unwrap().unwrap();
    let held: u32 = fleet
        .state()
        .await
        .unwrap()
        .replicas
        .iter()
        .map(|r| r.in_flight)
        .sum();
    assert_eq!(held, 1, "the open stream holds its reservation");
    while chunks.next().await.is_some() {}
    let settled = fleet.settle(Duration::from_secs(10)).await.unwrap();
    assert!(hearth_e2e::idle(&settled), "{settled:?}");
    // Both streams ended after the engine answered, and the sidecar saw it.
    assert_eq!((settled.answered_total, settled.unanswered_total), (2, 0));

    // A batch of streams, some abandoned after their first chunk.
    let mut tasks = Vec::new();
    for i in 0..12u64 {
        let client = fleet.client.clone();
        let url = url.clone();
        let mut c = Conversation::new(MODEL, &filler(8, 2048), false, 800 + i);
        let body = stream_body(&mut c, 80);
        tasks.push(tokio::spawn(async move {
            let resp = client.post(&url).json(&body).send().await.unwrap();
            let mut s = resp.bytes_stream();
            if i % 3 == 0 {
                s.next().await; // abort after the first chunk
                return false;
            }
            let mut text = Vec::new();
            while let Some(c) = s.next().await {
                text.extend_from_slice(&c.unwrap());
            }
            String::from_utf8_lossy(&text).contains("[DONE]")
        }));
    }
    let mut completed = 0;
    for t in tasks {
        completed += usize::from(t.await.unwrap());
    }
    assert_eq!(completed, 8);
    let settled = fleet.settle(Duration::from_secs(15)).await.unwrap();
    assert!(
        hearth_e2e::idle(&settled),
        "in-flight load leaked: {settled:?}"
    );
    assert_eq!(settled.answered_total, 2 + 12, "{settled:?}");
    assert_eq!(settled.unanswered_total, 0, "{settled:?}");
    let aborted: u64 = fleet.engine_stats().iter().map(|s| s.aborted_total).sum();
    assert!(aborted >= 1, "the engines saw the aborts");
}

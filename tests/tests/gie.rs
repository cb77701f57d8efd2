//! Hearth as a Gateway API Inference Extension endpoint picker, through the
//! real Envoy in the extension's reference shape (`envoy-config --mode
//! gie`): no wasm filter, ext_proc with FULL_DUPLEX_STREAMED request and
//! response bodies, an ORIGINAL_DST cluster dialling the address the
//! sidecar puts in `x-gateway-destination-endpoint`.

use hearth_bench::engine::{self, EngineConfig};
use hearth_e2e::{filler, reply_text, Conversation, Fleet, FleetOptions, Home, MODEL};

fn gie() -> FleetOptions {
    FleetOptions {
        gie_mode: true,
        ..FleetOptions::default()
    }
}

#[tokio::test]
async fn sessions_stay_on_their_warm_replica_as_an_endpoint_picker() {
    let fleet = Fleet::start(gie()).await.unwrap();
    // An engine outside the registry: the ORIGINAL_DST cluster could dial
    // it, so a client naming it must not get there.
    let decoy = engine::spawn(
        EngineConfig {
            id: "decoy".into(),
            model: MODEL.into(),
            ..EngineConfig::default()
        },
        tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap(),
    )
    .await
    .unwrap();
    let forged = decoy.addr.to_string();
    // 200 KB of system prompt: the body crosses the gRPC stream in many
    // chunks both ways and is re-assembled in order.
    let system = filler(7, 200_000);
    for s in 0..4u64 {
        let mut conv = Conversation::new(MODEL, &format!("{system} tenant {s}"), true, 700 + s);
        let mut home = Home::new(format!("session {s}"));
        for _ in 1..=4 {
            let body = conv.next_turn(4000, false);
            let t = fleet
                .post(
                    "/v1/chat/completions",
                    serde_json::to_vec(&body).unwrap(),
                    &[
                        ("content-type", "application/json"),
                        ("x-gateway-destination-endpoint", &forged),
                        ("x-gateway-destination-endpoint-subset", &forged),
                        ("x-hearth-fp", "v2.2048.AAAAAAAAAAA"),
                    ],
                )
                .await
                .unwrap();
            assert_ne!(t.engine.as_deref(), Some("decoy"));
            home.check(&t, 50_000 / 4);
            conv.push_assistant(&reply_text(&t.body));
            conv.push_tool_round(2000);
        }
    }
    // A streamed answer comes back whole through full-duplex response
    // bodies.
    let mut conv = Conversation::new(MODEL, "stream me", false, 9);
    let body = conv.next_turn(100, true);
    let t = fleet
        .post(
            "/v1/chat/completions",
            serde_json::to_vec(&body).unwrap(),
            &[("content-type", "application/json")],
        )
        .await
        .unwrap();
    assert_eq!(t.status, 200);
    let text = t.body.as_str().expect("SSE text");
    assert!(text.contains("data: ") && text.trim_end().ends_with("data: [DONE]"));
    // A request without a prompt body is routed on load (and reaches a
    // registry engine).
    let models = fleet
        .client
        .get(format!("{}/v1/models", fleet.envoy.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(models.status(), 200);
    assert_ne!(models.headers()["x-engine-id"], "decoy");

    let state = fleet
        .settle(std::time::Duration::from_secs(10))
        .await
        .unwrap();
    // Every prompt was fingerprinted by the sidecar from the streamed body.
    assert_eq!(state.hashed_total, 17, "{state:?}");
    assert!(state.replicas.iter().all(|r| r.in_flight == 0), "{state:?}");
    assert_eq!(decoy.engine.stats().requests_total, 0);
}

/// A copy of the fleet's GIE gateway with a `set_metadata` filter before
/// ext_proc that sets the protocol's subset hint, as a controller would.
fn with_subset_hint(fleet: &Fleet, subset: &[String]) -> String {
    let config = hearth_ext_proc::envoy::render::render_gie(&fleet.gateway);
    let list = subset
        .iter()
        .map(|e| format!("\"{e}\""))
        .collect::<Vec<_>>()
        .join(", ");
    let filter = format!(
        r#"          - name: envoy.filters.http.set_metadata
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config
              metadata:
              - metadata_namespace: envoy.lb.subset_hint
                value:
                  x-gateway-destination-endpoint-subset: [{list}]
"#
    );
    let at = config
        .find("          - name: envoy.filters.http.ext_proc")
        .expect("ext_proc filter");
    format!("{}{filter}{}", &config[..at], &config[at..])
}

#[tokio::test]
async fn the_subset_hint_limits_the_choice_and_an_empty_one_is_a_503() {
    let fleet = Fleet::start(gie()).await.unwrap();
    let allowed: Vec<String> = fleet.engines[2..]
        .iter()
        .map(|e| e.addr.to_string())
        .collect();
    let allowed_ids: Vec<String> = fleet.engines[2..]
        .iter()
        .map(|e| e.engine.config().id.clone())
        .collect();
    let hinted = fleet
        .start_envoy(&with_subset_hint(&fleet, &allowed))
        .await
        .unwrap();
    for s in 0..8u64 {
        let mut conv = Conversation::new(MODEL, &format!("subset tenant {s}"), false, 40 + s);
        let body = conv.next_turn(3000, false);
        let t = fleet
            .post_via(
                &hinted,
                "/v1/chat/completions",
                serde_json::to_vec(&body).unwrap(),
                &[("content-type", "application/json")],
            )
            .await
            .unwrap();
        assert_eq!(t.status, 200, "{:?}", t.body);
        let engine = t.engine.expect("x-engine-id");
        assert!(
            allowed_ids.contains(&engine),
            "{engine} is outside the subset"
        );
    }
    // A subset naming no registry endpoint allows nothing: 503, and no
    // engine is contacted.
    let before: u64 = fleet.engine_stats().iter().map(|e| e.requests_total).sum();
    let nowhere = fleet
        .start_envoy(&with_subset_hint(&fleet, &["10.255.255.1:80".to_string()]))
        .await
        .unwrap();
    let mut conv = Conversation::new(MODEL, "nowhere", false, 1);
    let t = fleet
        .post_via(
            &nowhere,
            "/v1/chat/completions",
            serde_json::to_vec(&conv.next_turn(100, false)).unwrap(),
            &[("content-type", "application/json")],
        )
        .await
        .unwrap();
    assert_eq!(t.status, 503, "{:?}", t.body);
    assert_eq!(
        t.body["error"]["type"], "service_unavailable",
        "{:?}",
        t.body
    );
    let after: u64 = fleet.engine_stats().iter().map(|e| e.requests_total).sum();
    assert_eq!(before, after);
}

#[tokio::test]
async fn the_pool_follows_a_reloaded_replica_list() {
    // The endpoint-picker shape has no endpoint list in Envoy: the
    // ORIGINAL_DST cluster dials whatever the sidecar picks, so the
    // sidecar's reloaded list is the pool.
    let fleet = Fleet::start(FleetOptions {
        engines: 3,
        gie_mode: true,
        upstreams_file: true,
        sidecar_flags: vec!["--probe-interval-seconds=0".into()],
        ..FleetOptions::default()
    })
    .await
    .unwrap();
    fleet.list_engines(&[0, 1]).await.unwrap();
    let mut conv = Conversation::new(MODEL, &filler(5, 20_000), true, 760);
    let mut home = Home::new("the session");
    for _ in 0..2 {
        let t = fleet.chat(&conv.next_turn(2000, false)).await;
        home.check(&t, 0);
        conv.push_assistant(&reply_text(&t.body));
        conv.push_tool_round(2000);
    }
    let kept: usize = home.engine().unwrap()["engine-".len()..].parse().unwrap();
    let gone = 1 - kept;
    fleet.list_engines(&[kept, 2]).await.unwrap();
    let gone_served = fleet.engine_stats()[gone].requests_total;
    // The session stays warm; new sessions reach the added engine; none
    // reaches the removed one.
    let t = fleet.chat(&conv.next_turn(2000, false)).await;
    home.check(&t, 0);
    let served = fleet.first_turns(6, 770).await;
    assert!(
        served.iter().any(|e| e == "engine-2"),
        "no new session reached the added engine: {served:?}"
    );
    assert_eq!(fleet.engine_stats()[gone].requests_total, gone_served);
}

/// The sidecar's resident memory (it runs in this process).
fn rss_bytes() -> u64 {
    hearth_e2e::rss_of(std::process::id())
}

#[tokio::test]
async fn a_flood_of_large_bodies_stays_within_the_held_budget_and_others_are_served() {
    const BUDGET: u64 = 32 << 20;
    let fleet = Fleet::start(FleetOptions {
        sidecar_flags: vec![
            format!("--picker-held-bytes={BUDGET}"),
            // Above the flood's 24: the bytes are what this test bounds
            // (the count's 429 is unit-tested; slow uploads that fill it
            // would lock ordinary requests out too).
            "--picker-held-bodies=64".into(),
        ],
        // The replicas serve MODEL only: the flood asks for another model,
        // so its bodies are held, read and refused (404) by the sidecar and
        // never reach an engine, whose memory (in this process too) would
        // blur the sidecar's.
        model_tag: true,
        ..gie()
    })
    .await
    .unwrap();
    let url = format!("{}/v1/chat/completions", fleet.envoy.url());
    // Four large bodies (4 to 15 MiB of prompt), shared by the flood's
    // requests without copies.
    let large: Vec<bytes::Bytes> = [4usize, 8, 12, 15]
        .iter()
        .map(|mib| {
            let body = serde_json::json!({
                "model": "not-served-here",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": filler(*mib as u64, mib << 20)}],
            });
            bytes::Bytes::from(serde_json::to_vec(&body).unwrap())
        })
        .collect();
    let baseline = rss_bytes();

    // 24 large bodies at once, each uploaded in 512 KiB pieces 20 ms
    // apart (as a client on a slow link, or one that means to hold the
    // gateway's memory, sends them), with a sampler of the sidecar's
    // figures.
    let flood: Vec<_> = (0..24)
        .map(|i| {
            let (client, url, body) = (fleet.client.clone(), url.clone(), large[i % 4].clone());
            let pieces: Vec<Result<bytes::Bytes, std::io::Error>> = (0..body.len())
                .step_by(512 << 10)
                .map(|at| Ok(body.slice(at..(at + (512 << 10)).min(body.len()))))
                .collect();
            let slow = futures::StreamExt::then(futures::stream::iter(pieces), |p| async {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                p
            });
            tokio::spawn(async move {
                client
                    .post(url)
                    .header("content-type", "application/json")
                    .body(reqwest::Body::wrap_stream(slow))
                    .send()
                    .await
                    .map(|r| r.status().as_u16())
            })
        })
        .collect();
    let sampling = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let sampler = {
        let sampling = std::sync::Arc::clone(&sampling);
        let admin = fleet.settings.admin_listen;
        let client = fleet.client.clone();
        tokio::spawn(async move {
            let (mut held_max, mut rss_max) = (0.0f64, 0u64);
            for _ in 0..3000 {
                if !sampling.load(std::sync::atomic::Ordering::Relaxed) {
                    break;
                }
                if let Ok(r) = client.get(format!("http://{admin}/metrics")).send().await {
                    let text = r.text().await.unwrap_or_default();
                    if let Some(h) = hearth_e2e::metric_sample(&text, "hearth_picker_held_bytes") {
                        held_max = held_max.max(h);
                    }
                }
                rss_max = rss_max.max(rss_bytes());
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            (held_max, rss_max)
        })
    };
    // Meanwhile, ordinary requests, one after another: every one is served.
    for s in 0..12u64 {
        let mut conv = Conversation::new(MODEL, &format!("ordinary tenant {s}"), false, 900 + s);
        let body = conv.next_turn(2000, false);
        let t = fleet
            .post_json("/v1/chat/completions", &body)
            .await
            .unwrap();
        assert_eq!(t.status, 200, "ordinary request {s}: {:?}", t.body);
    }
    let mut statuses = Vec::new();
    for f in flood {
        statuses.push(f.await.unwrap());
    }
    sampling.store(false, std::sync::atomic::Ordering::Relaxed);
    let (held_max, rss_max) = sampler.await.unwrap();

    let (_, text) = fleet.admin_get("/metrics").await.unwrap();
    let held_now = hearth_e2e::metric_sample(&text, "hearth_picker_held_bytes").unwrap();
    let peak = hearth_e2e::metric_sample(&text, "hearth_picker_held_bytes_peak").unwrap();
    let refused_bytes =
        hearth_e2e::metric_sample(&text, "hearth_picker_refused_total{reason=\"bytes\"}")
            .unwrap_or(0.0);
    let grew = rss_max.saturating_sub(baseline);
    let refused = statuses.iter().filter(|s| matches!(s, Ok(429))).count();
    let cut = statuses.iter().filter(|s| s.is_err()).count();
    eprintln!(
        "flood: {statuses:?}; held peak {:.1} MiB (sampled max {:.1} MiB) of {} MiB; \
         refused for bytes {refused_bytes}; RSS {:.0} MiB -> max {:.0} MiB (+{:.0} MiB)",
        peak / 1048576.0,
        held_max / 1048576.0,
        BUDGET >> 20,
        baseline as f64 / 1048576.0,
        rss_max as f64 / 1048576.0,
        grew as f64 / 1048576.0,
    );
    // Some large bodies were refused with the JSON 429 before they were
    // whole, the others read whole and refused for their model (an early
    // refusal may reach the client as a closed connection while it still
    // uploads).
    assert!(refused + cut > 0, "{statuses:?}");
    assert!(
        statuses.iter().all(|s| matches!(s, Ok(404 | 429) | Err(_))),
        "{statuses:?}"
    );
    assert!(peak <= BUDGET as f64 && held_max <= BUDGET as f64);
    assert!(refused_bytes >= 1.0, "{text}");
    // Every stream gave its memory back.
    assert_eq!(held_now, 0.0);
    assert_eq!(
        hearth_e2e::metric_sample(&text, "hearth_picker_held_bodies"),
        Some(0.0)
    );
    // With the bound lifted (4 GiB), this flood held 70 MiB of bodies at
    // once and the process grew 99 MiB; with it, 24 MiB and 35 MiB
    // (one run each). RSS also counts the test's own client and Envoy's
    // gRPC buffers: a loose check, the gauge above is the exact one.
    assert!(grew < BUDGET + (64 << 20), "RSS grew {grew} bytes");
}

/// Bodies of the shapes that once cost the parser many times their size
/// (a tree node per tiny item), at 12 MiB each, eight at once: what the
/// picker holds is the held bytes and little more, whatever the shape.
/// (Before the parser read bodies in place, one 15 MiB body of tiny items
/// grew the picker by ~500 MiB; `wire/tests/shape_cost.rs` measures each
/// shape's parse alone.)
#[tokio::test]
async fn worst_shaped_bodies_cost_the_picker_what_their_bytes_do() {
    const BUDGET: u64 = 64 << 20;
    const SIZE: usize = 12 << 20;
    let fleet = Fleet::start(FleetOptions {
        sidecar_flags: vec![format!("--picker-held-bytes={BUDGET}")],
        // Not a model the replicas serve: the sidecar reads each body
        // whole, fingerprints it and refuses it (404) itself, so no engine
        // (in this process too) parses it.
        model_tag: true,
        ..gie()
    })
    .await
    .unwrap();
    let url = format!("{}/v1/chat/completions", fleet.envoy.url());
    // Every shape with a readable prompt (one without has no model to
    // refuse and would go to an engine, in this process).
    let shapes: Vec<(&str, String)> = hearth_e2e::worst_shapes(SIZE, "not-served-here")
        .into_iter()
        .filter(|(name, _)| *name != "tiny_messages")
        .collect();
    // Shared by the sends without copies.
    let shapes: Vec<(&str, bytes::Bytes)> = shapes
        .into_iter()
        .map(|(name, body)| (name, bytes::Bytes::from(body)))
        .collect();
    let bodies = (0..8).map(|i| shapes[i % shapes.len()].clone()).collect();
    let (statuses, baseline, rss_max) =
        hearth_e2e::post_all_sampling_rss(&fleet.client, &url, bodies).await;
    let grew = rss_max.saturating_sub(baseline);
    let (_, text) = fleet.admin_get("/metrics").await.unwrap();
    let peak = hearth_e2e::metric_sample(&text, "hearth_picker_held_bytes_peak").unwrap();
    eprintln!(
        "shapes: {statuses:?}; held peak {:.1} MiB of {} MiB; RSS {:.0} MiB -> max {:.0} MiB (+{:.0} MiB)",
        peak / 1048576.0,
        BUDGET >> 20,
        baseline as f64 / 1048576.0,
        rss_max as f64 / 1048576.0,
        grew as f64 / 1048576.0
    );
    // Every body was read and refused for its model (or, past the budget,
    // refused before it was whole), and the picker is still serving.
    assert!(
        statuses
            .iter()
            .all(|(_, s)| matches!(s, Ok(404 | 429) | Err(_))),
        "{statuses:?}"
    );
    assert!(
        statuses.iter().any(|(_, s)| matches!(s, Ok(404))),
        "{statuses:?}"
    );
    let mut conv = Conversation::new(MODEL, "after the shapes", false, 77);
    let t = fleet
        .post_json("/v1/chat/completions", &conv.next_turn(2000, false))
        .await
        .unwrap();
    assert_eq!(t.status, 200, "{:?}", t.body);
    // The target: the held budget and half as much again, plus 64 MiB (the
    // test's own client and Envoy's buffers share this process's RSS).
    assert!(
        grew < BUDGET + BUDGET / 2 + (64 << 20),
        "RSS grew {} MiB",
        grew >> 20
    );
}

//! Body-over-gRPC mode through the real Envoy: no wasm filter; ext_proc
//! sends each request body to the sidecar, which fingerprints it with the
//! shared code and routes. Sessions must stay on their warm replica, as in
//! filter mode, and a forged fingerprint must change nothing.

use hearth_e2e::{filler, reply_text, Conversation, Fleet, FleetOptions, Home, MODEL};
use hearth_ext_proc::envoy::render::{render_body, Gateway};

#[tokio::test]
async fn sessions_stay_on_their_warm_replica_in_body_mode() {
    let fleet = Fleet::start(FleetOptions {
        body_mode: true,
        ..FleetOptions::default()
    })
    .await
    .unwrap();
    let system = filler(3, 8192);
    let mut homes = Vec::new();
    for s in 0..4u64 {
        let mut conv = Conversation::new(MODEL, &format!("{system} tenant {s}"), true, 300 + s);
        let mut home = Home::new(format!("session {s}"));
        for _ in 1..=4 {
            let body = conv.next_turn(4000, false);
            // A client-sent fingerprint and destination must not steer.
            let t = fleet
                .post(
                    "/v1/chat/completions",
                    serde_json::to_vec(&body).unwrap(),
                    &[
                        ("content-type", "application/json"),
                        ("x-hearth-fp", "v2.2048.AAAAAAAAAAA"),
                        ("x-gateway-destination-endpoint", "10.255.255.1:1"),
                    ],
                )
                .await
                .unwrap();
            home.check(&t, 0);
            conv.push_assistant(&reply_text(&t.body));
            conv.push_tool_round(2000);
        }
        homes.push(home.engine().unwrap().to_string());
    }
    // Every turn was fingerprinted by the sidecar (no filter in this mode).
    // Streams close just after the last byte: wait for the load to drain.
    let state = fleet
        .settle(std::time::Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(state.hashed_total, 16, "{state:?}");
    assert!(state.replicas.iter().all(|r| r.in_flight == 0));
    // The bodies reached the engines intact: they were admitted as valid
    // chat requests (health probes may add a few more).
    let served: u64 = fleet.engine_stats().iter().map(|e| e.requests_total).sum();
    assert!(served >= 16, "{served} admitted; homes {homes:?}");
}

#[tokio::test]
async fn a_body_past_the_buffer_limit_gets_an_openai_shaped_413_in_body_mode() {
    let fleet = Fleet::start(FleetOptions {
        body_mode: true,
        engines: 2,
        ..FleetOptions::default()
    })
    .await
    .unwrap();
    // The route's request buffer: max_body_bytes plus 1 MiB.
    let limit = fleet.gateway.max_body_bytes + (1 << 20);
    let mut conv = Conversation::new(MODEL, &filler(9, limit + 4096), false, 900);
    let t = fleet
        .post_json("/v1/chat/completions", &conv.next_turn(100, false))
        .await
        .unwrap();
    assert_eq!(t.status, 413, "{:?}", t.body);
    assert_eq!(t.engine, None, "an engine answered");
    let error = &t.body["error"];
    assert_eq!(error["type"], "invalid_request_error", "{:?}", t.body);
    assert_eq!(error["code"], "request_too_large");
    let message = error["message"].as_str().unwrap();
    assert!(message.contains(&format!("({limit} bytes)")), "{message}");
}

/// Bodies of the shapes that once cost the parser many times their size
/// (a tree node per tiny item; four 4 MiB bodies of tiny items took a
/// body-mode sidecar to a 590 MB peak), four of 4 MiB at once, as then:
/// the sidecar holds each body as it came and little more, whatever its
/// shape, and still serves. Sent through an Envoy whose ext_proc waits a
/// minute for the sidecar, not the shipped 2 s: past its timeout Envoy
/// fails open and an engine, in this process, would parse the body (a
/// debug build on a loaded machine takes seconds for these shapes).
#[tokio::test]
async fn worst_shaped_bodies_cost_the_body_mode_sidecar_what_their_bytes_do() {
    const SIZE: usize = 4 << 20;
    const SENT: usize = 4;
    let fleet = Fleet::start(FleetOptions {
        body_mode: true,
        engines: 2,
        // Not a model the replicas serve: the sidecar reads each body
        // whole, fingerprints it and refuses it (404) itself, so no engine
        // (in this process too) parses it.
        model_tag: true,
        ..FleetOptions::default()
    })
    .await
    .unwrap();
    let patient: String = render_body(&Gateway {
        listen: "127.0.0.1:0".parse().unwrap(),
        ..fleet.gateway.clone()
    })
    .lines()
    .map(|line| match line.split_once("message_timeout: ") {
        Some((indent, _)) => format!("{indent}message_timeout: 60s\n"),
        None => format!("{line}\n"),
    })
    .collect();
    assert!(patient.contains("message_timeout: 60s"), "{patient}");
    let envoy = fleet.start_envoy(&patient).await.unwrap();
    let url = format!("{}/v1/chat/completions", envoy.url());
    // Every shape with a readable prompt (one without has no model to
    // refuse and would go to an engine, in this process).
    let shapes: Vec<(&str, bytes::Bytes)> = hearth_e2e::worst_shapes(SIZE, "not-served-here")
        .into_iter()
        .filter(|(name, _)| *name != "tiny_messages")
        .map(|(name, body)| (name, bytes::Bytes::from(body)))
        .collect();
    let bodies = (0..SENT)
        .map(|i| shapes[i % shapes.len()].clone())
        .collect();
    let (statuses, baseline, rss_max) =
        hearth_e2e::post_all_sampling_rss(&fleet.client, &url, bodies).await;
    let grew = rss_max.saturating_sub(baseline);
    eprintln!(
        "shapes: {statuses:?}; RSS {:.0} MiB -> max {:.0} MiB (+{:.0} MiB for {SENT} x {} MiB)",
        baseline as f64 / 1048576.0,
        rss_max as f64 / 1048576.0,
        grew as f64 / 1048576.0,
        SIZE >> 20,
    );
    // Every body was read, fingerprinted and refused for its model.
    assert!(
        statuses.iter().all(|(_, s)| matches!(s, Ok(404))),
        "{statuses:?}"
    );
    let state = fleet.state().await.unwrap();
    assert!(state.hashed_total >= SENT as u64, "{state:?}");
    // The sidecar still serves.
    let mut conv = Conversation::new(MODEL, "after the shapes", false, 78);
    let t = fleet
        .post_json("/v1/chat/completions", &conv.next_turn(2000, false))
        .await
        .unwrap();
    assert_eq!(t.status, 200, "{:?}", t.body);
    // What the bodies weigh, twice (the gRPC frame and the message it
    // decodes to), plus 64 MiB for the test's own client and buffers,
    // which share this process's RSS.
    let bound = 2 * (SENT * SIZE) as u64 + (64 << 20);
    assert!(grew < bound, "RSS grew {} MiB", grew >> 20);
}

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
                        ("x-hearth-fp", "v1.2048.AAAAAAAAAAA"),
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

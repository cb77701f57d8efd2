//! Several gateways, one fleet: two Envoys in front of the same sidecar and
//! engines. Warmth and load live in the sidecar, so a session whose turns
//! alternate between the two gateways still stays on its warm replica.

use hearth_e2e::{filler, reply_text, Conversation, Fleet, FleetOptions, Home, MODEL};

#[tokio::test]
async fn sessions_stay_put_when_turns_alternate_between_two_gateways() {
    let fleet = Fleet::start(FleetOptions::default()).await.unwrap();
    let second = fleet
        .start_envoy(&hearth_ext_proc::envoy::render::render(&fleet.gateway))
        .await
        .unwrap();
    let gateways = [&fleet.envoy, &second];
    let system = filler(11, 16_384);
    let mut served_by = [0u32; 2];
    for s in 0..6u64 {
        let mut conv = Conversation::new(MODEL, &format!("{system} team {s}"), true, 900 + s);
        let mut home = Home::new(format!("session {s}"));
        for turn in 0..4usize {
            // Sessions start on alternating gateways and switch every turn.
            let g = (turn + s as usize) % 2;
            let body = conv.next_turn(3000, false);
            let t = fleet
                .post_via(
                    gateways[g],
                    "/v1/chat/completions",
                    serde_json::to_vec(&body).unwrap(),
                    &[("content-type", "application/json")],
                )
                .await
                .unwrap();
            served_by[g] += 1;
            home.check(&t, 16_384 / 4);
            conv.push_assistant(&reply_text(&t.body));
            conv.push_tool_round(1500);
        }
    }
    assert_eq!(served_by, [12, 12]);
    // One sidecar saw every decision from both gateways, and all their
    // load came back.
    let state = fleet
        .settle(std::time::Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(state.hashed_total, 24, "{state:?}");
    assert!(state.replicas.iter().all(|r| r.in_flight == 0), "{state:?}");
    fleet.assert_wasm_healthy();
}

//! The engines cluster learns its endpoints from the sidecar over EDS
//! (`envoy-config --endpoints eds`): Envoy holds exactly the sidecar's
//! endpoints, routing works as with a static list, and Envoy keeps the
//! endpoints while the sidecar is away.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use hearth_bench::gateway::Envoy;
use hearth_e2e::{
    cluster_hosts, filler, reply_text, Conversation, Fleet, FleetOptions, Home, MODEL,
};
use hearth_ext_proc::envoy::render::ENGINES_CLUSTER;

/// Envoy's gauge of its EDS stream to the sidecar (1 = connected).
const CONNECTED: &str = "cluster.engines.control_plane.connected_state";

fn eds_fleet(body_mode: bool) -> FleetOptions {
    FleetOptions {
        eds: true,
        body_mode,
        ..FleetOptions::default()
    }
}

/// The engines cluster holds every engine's address and nothing else,
/// received over EDS (the bootstrap lists none).
async fn assert_cluster_is_the_engines(fleet: &Fleet) {
    let mut hosts = cluster_hosts(&fleet.envoy, ENGINES_CLUSTER).await.unwrap();
    let mut engines: Vec<SocketAddr> = fleet.engines.iter().map(|e| e.addr).collect();
    hosts.sort();
    engines.sort();
    assert_eq!(hosts, engines, "Envoy's engines cluster");
}

async fn assert_endpoints_came_over_eds(envoy: &Envoy) {
    let stat = |name: &'static str| async move {
        envoy
            .stat(&format!("cluster.engines.{name}"))
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("no stat cluster.engines.{name}"))
    };
    assert!(stat("update_success").await >= 1);
    assert_eq!(stat("update_rejected").await, 0);
    // The sidecar answered before Envoy's initial fetch timed out.
    assert_eq!(stat("init_fetch_timeout").await, 0);
    assert_eq!(stat("control_plane.connected_state").await, 1);
}

/// Waits until `stat` reads `want`, or panics at `deadline`.
async fn wait_for_stat(envoy: &Envoy, stat: &str, want: u64, deadline: Duration) {
    let until = Instant::now() + deadline;
    loop {
        let got = envoy.stat(stat).await.unwrap();
        if got == Some(want) {
            return;
        }
        assert!(
            Instant::now() < until,
            "{stat} was {got:?}, not {want}, after {deadline:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A four-turn conversation stays on one engine, which the gateway names,
/// and later turns read its cache.
async fn conversation_stays(fleet: &Fleet, seed: u64) {
    let system = format!("{} eds tenant {seed}", filler(1, 4096));
    let mut conv = Conversation::new(MODEL, &system, true, seed);
    let mut home = Home::new(format!("conversation {seed}"));
    for _ in 1..=4 {
        let turn = fleet.chat(&conv.next_turn(3000, false)).await;
        home.check(&turn, 0);
        conv.push_assistant(&reply_text(&turn.body));
        conv.push_tool_round(3000);
    }
}

#[tokio::test]
async fn envoy_routes_to_the_endpoints_the_sidecar_serves() {
    let fleet = Fleet::start(eds_fleet(false)).await.unwrap();
    assert_cluster_is_the_engines(&fleet).await;
    assert_endpoints_came_over_eds(&fleet.envoy).await;
    for seed in 0..3 {
        conversation_stays(&fleet, 500 + seed).await;
    }
    fleet.assert_wasm_healthy();
    // Envoy holds the router's version, and accepted one assignment: its
    // ACK got no reply, and the list never changed.
    let version = fleet.sidecar.as_ref().unwrap().router.version();
    let text = fleet
        .envoy
        .stats_matching("cluster.engines.version_text")
        .await
        .unwrap();
    assert_eq!(
        text,
        [(
            "cluster.engines.version_text".to_string(),
            format!("\"{version}\"")
        )]
    );
    let accepted = fleet.envoy.stat("cluster.engines.update_success").await;
    assert_eq!(accepted.unwrap(), Some(1));
}

#[tokio::test]
async fn body_mode_routes_to_the_endpoints_the_sidecar_serves() {
    let fleet = Fleet::start(eds_fleet(true)).await.unwrap();
    assert_cluster_is_the_engines(&fleet).await;
    assert_endpoints_came_over_eds(&fleet.envoy).await;
    conversation_stays(&fleet, 600).await;
}

#[tokio::test]
async fn envoy_keeps_the_endpoints_while_the_sidecar_is_away() {
    let mut fleet = Fleet::start(eds_fleet(false)).await.unwrap();
    assert_endpoints_came_over_eds(&fleet.envoy).await;
    fleet.stop_sidecar().await.unwrap();
    // The sidecar ended the stream as it stopped.
    wait_for_stat(&fleet.envoy, CONNECTED, 0, Duration::from_secs(30)).await;
    assert_cluster_is_the_engines(&fleet).await;
    // ext_proc fails open and least_request routes among the kept hosts.
    let mut conv = Conversation::new(MODEL, "sidecar away", true, 700);
    let turn = fleet.chat(&conv.next_turn(1000, false)).await;
    assert!(turn.engine.is_some(), "{:?}", turn.body);
    assert_eq!(turn.upstream, None, "no sidecar, no decision");

    fleet.start_sidecar().await.unwrap();
    wait_for_stat(&fleet.envoy, CONNECTED, 1, Duration::from_secs(60)).await;
    assert_cluster_is_the_engines(&fleet).await;
    conversation_stays(&fleet, 701).await;
}

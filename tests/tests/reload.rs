//! The replica list reloads while the gateway runs: the sidecar re-reads
//! `HEARTH_UPSTREAMS_FILE`, keeps what it knows about the replicas still
//! listed, and pushes the new endpoints to Envoy over EDS, with no restart
//! of either.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use hearth_e2e::{
    cluster_hosts, filler, reply_text, Conversation, Fleet, FleetOptions, Home, MODEL,
};
use hearth_ext_proc::envoy::render::ENGINES_CLUSTER;

/// Waits (up to 10 s) until Envoy's engines cluster holds exactly the
/// engines at `indices`.
async fn wait_for_envoy_hosts(fleet: &Fleet, indices: &[usize]) {
    let want: BTreeSet<SocketAddr> = indices.iter().map(|&i| fleet.engines[i].addr).collect();
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let hosts: BTreeSet<SocketAddr> = cluster_hosts(&fleet.envoy, ENGINES_CLUSTER)
            .await
            .unwrap()
            .into_iter()
            .collect();
        if hosts == want {
            return;
        }
        assert!(
            Instant::now() < until,
            "Envoy holds {hosts:?}, not {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn engine_index(fleet: &Fleet, id: &str) -> usize {
    fleet
        .engines
        .iter()
        .position(|e| e.engine.config().id == id)
        .unwrap_or_else(|| panic!("no engine {id}"))
}

#[tokio::test]
async fn a_reloaded_replica_list_reaches_envoy_and_listed_replicas_stay_warm() {
    let fleet = Fleet::start(FleetOptions {
        engines: 3,
        eds: true,
        upstreams_file: true,
        // No probes: every generation request an engine sees is a client's.
        sidecar_flags: vec!["--probe-interval-seconds=0".into()],
        ..FleetOptions::default()
    })
    .await
    .unwrap();
    fleet.list_engines(&[0, 1]).await.unwrap();
    wait_for_envoy_hosts(&fleet, &[0, 1]).await;

    // A conversation settles on one of the two.
    let system = format!("{} reload tenant", filler(3, 4096));
    let mut conv = Conversation::new(MODEL, &system, true, 900);
    let mut home = Home::new("the conversation");
    for _ in 0..3 {
        let turn = fleet.chat(&conv.next_turn(3000, false)).await;
        home.check(&turn, 0);
        conv.push_assistant(&reply_text(&turn.body));
        conv.push_tool_round(3000);
    }
    let home = engine_index(&fleet, home.engine().unwrap());
    let gone = 1 - home;
    let before = fleet.settle(Duration::from_secs(5)).await.unwrap();
    let home_before = before
        .replicas
        .iter()
        .find(|r| r.id == format!("engine-{home}"))
        .unwrap();
    assert!(home_before.warmth_blocks > 0);

    // Reload: the other engine leaves, engine 2 joins.
    let after = fleet.list_engines(&[home, 2]).await.unwrap();
    assert!(after.upstreams.version > before.upstreams.version);
    assert_eq!(after.upstreams.reload_error, None);
    let home_after = &after.replicas[0];
    assert_eq!(
        home_after.warmth_blocks, home_before.warmth_blocks,
        "warmth kept"
    );
    assert_eq!(
        home_after.routed_total, home_before.routed_total,
        "history kept"
    );
    assert_eq!(
        after.replicas[1].warmth_blocks, 0,
        "the new engine starts cold"
    );
    wait_for_envoy_hosts(&fleet, &[home, 2]).await;
    let gone_served = fleet.engine_stats()[gone].requests_total;

    // The conversation stays home and reads its cache.
    let turn = fleet.chat(&conv.next_turn(3000, false)).await;
    assert_eq!(
        turn.engine.as_deref(),
        Some(format!("engine-{home}").as_str())
    );
    assert!(turn.cached_tokens() > 0, "{:?}", turn.body["usage"]);

    // New conversations spread over the new list: some reach engine 2
    // through Envoy (which only knows it from the sidecar), each served by
    // the engine the gateway names, none by the engine that left.
    let served = fleet.first_turns(6, 910).await;
    assert!(!served.contains(&format!("engine-{gone}")), "{served:?}");
    assert!(
        served.iter().any(|e| e == "engine-2"),
        "no new conversation reached the added engine: {served:?}"
    );
    assert_eq!(fleet.engine_stats()[gone].requests_total, gone_served);

    // A broken file is refused whole: the list and Envoy's hosts stay, the
    // state says why, and routing goes on.
    fleet
        .write_upstreams(&format!("{}\n127.0.0.1:notaport\n", fleet.engines[0].addr))
        .await
        .unwrap();
    let until = Instant::now() + Duration::from_secs(10);
    let refused = loop {
        let s = fleet.state().await.unwrap();
        if s.upstreams.reload_errors_total > 0 || Instant::now() > until {
            break s;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(refused.upstreams.reload_errors_total, 1);
    let why = refused.upstreams.reload_error.clone().unwrap_or_default();
    assert!(why.contains("line 2"), "{why}");
    let ids: Vec<&str> = refused.replicas.iter().map(|r| r.id.as_str()).collect();
    assert_eq!(ids, [format!("engine-{home}"), "engine-2".to_string()]);
    wait_for_envoy_hosts(&fleet, &[home, 2]).await;
    let turn = fleet.chat(&conv.next_turn(3000, false)).await;
    assert_eq!(
        turn.engine.as_deref(),
        Some(format!("engine-{home}").as_str())
    );
    let (_, metrics) = fleet.admin_get("/metrics").await.unwrap();
    assert!(
        metrics.contains("hearth_upstream_reload_errors_total 1"),
        "{metrics}"
    );
    fleet.assert_wasm_healthy();
}

#[tokio::test]
async fn reloads_under_traffic_lose_no_request_and_no_load() {
    let fleet = Fleet::start(FleetOptions {
        engines: 3,
        eds: true,
        upstreams_file: true,
        // Streams last a while, so reloads land while requests run.
        decode_micros_per_token: 2000.0,
        sidecar_flags: vec!["--probe-interval-seconds=0".into()],
        ..FleetOptions::default()
    })
    .await
    .unwrap();

    // How long one reload takes to reach Envoy, asked for at once (as
    // SIGHUP does), not waiting for the poll.
    fleet
        .write_upstreams(&fleet_list(&fleet, &[0, 1]))
        .await
        .unwrap();
    let asked = Instant::now();
    assert!(fleet.sidecar.as_ref().unwrap().reload_upstreams());
    wait_for_envoy_hosts(&fleet, &[0, 1]).await;
    eprintln!(
        "reload asked -> Envoy holds the new endpoints: {:.1} ms",
        asked.elapsed().as_secs_f64() * 1e3
    );

    // Four clients run conversations while the list flips between
    // {0, 1} and {0, 2}: every request is answered, by the engine the
    // gateway names.
    let clients = (0..4u64).map(|c| {
        let fleet = &fleet;
        async move {
            let mut conv = Conversation::new(MODEL, &format!("flip tenant {c}"), false, 950 + c);
            for _ in 0..8 {
                let turn = fleet.chat(&conv.next_turn(1500, true)).await;
                assert!(turn.engine.is_some(), "{:?}", turn.body);
                conv.push_assistant("ok");
            }
        }
    });
    let flips = async {
        for k in 0..6 {
            let list: &[usize] = if k % 2 == 0 { &[0, 2] } else { &[0, 1] };
            fleet.list_engines(list).await.unwrap();
            tokio::time::sleep(Duration::from_millis(150)).await;
        }
    };
    tokio::join!(futures::future::join_all(clients), flips);

    let end = fleet.settle(Duration::from_secs(10)).await.unwrap();
    assert!(hearth_e2e::idle(&end), "{end:?}");
    assert_eq!(end.upstreams.draining_in_flight, 0, "{:?}", end.upstreams);
    assert_eq!(end.upstreams.reload_errors_total, 0);
    fleet.assert_wasm_healthy();
}

/// The replica-file text naming the engines at `indices`.
fn fleet_list(fleet: &Fleet, indices: &[usize]) -> String {
    indices
        .iter()
        .map(|&i| format!("{};id=engine-{i}", fleet.engines[i].addr))
        .collect::<Vec<_>>()
        .join("\n")
}

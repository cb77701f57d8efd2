//! `hearth-bench live` end to end: a short cell through the real Envoy,
//! filter and sidecar process, beside the same cell simulated.

use hearth_bench::live::{measure, LiveArgs};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_live_cell_runs_beside_its_simulation() {
    let args = LiveArgs {
        scenario: "cache-never-fills".into(),
        agents: 4,
        replicas: Some(2),
        seconds: 12,
        time_scale: 20.0,
        seed: 3,
        json: None,
        sidecar: Default::default(),
    };
    // Needs target/<profile>/hearth-ext-proc: scripts/test builds it first.
    let rows = measure(&args).await.unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(rows.len(), 2);
    assert_eq!(
        (rows[0].driver.as_str(), rows[1].driver.as_str()),
        ("sim", "live")
    );
    let live = &rows[1];
    assert!(live.turns > 0, "no turn finished: {live:?}");
    assert_eq!(live.failures, 0, "{live:?}");
    assert!(
        live.cached_fraction > 0.0,
        "engines reported no cache hits: {live:?}"
    );
}

//! `hearth-bench live` end to end: a short cell through the real Envoy,
//! filter and sidecar process, beside the same cell simulated.

use hearth_bench::live::{measure, LiveArgs};

/// The cell every test here runs: two simulated replicas, four agents,
/// twelve simulated seconds at twenty times the speed.
fn short_cell() -> LiveArgs {
    LiveArgs {
        scenario: "cache-never-fills".into(),
        agents: 4,
        replicas: Some(2),
        seconds: 12,
        time_scale: 20.0,
        seed: 3,
        json: None,
        sidecar: Default::default(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_live_cell_runs_beside_its_simulation() {
    let args = short_cell();
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

/// The peer routers as released (`scripts/setup-peers`) in one short run
/// beside plain Envoy: every policy finishes turns without a failure, the
/// stays come from the engines, and smg's own header names the engine
/// that says it served. Without the peers installed, the run skips them
/// and says why (under `CI=true` that fails instead).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_peer_routers_run_beside_envoy_on_the_same_engines() {
    use hearth_bench::live::{measure_policies, LiveCli, LivePolicy};
    let cli = LiveCli {
        cell: short_cell(),
        policies: vec![
            LivePolicy::LeastRequest,
            LivePolicy::SmgCacheAware,
            LivePolicy::VllmRouterConsistentHash,
        ],
        peer_deadline_s: 60,
    };
    let m = measure_policies(&cli)
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    for (policy, why) in &m.skipped {
        assert!(why.contains("scripts/setup-peers"), "{why}");
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "{} not installed under CI: {why}",
            policy.name()
        );
        eprintln!("skipping {}: {why}", policy.name());
    }
    // seed 3 is odd: the order given.
    assert_eq!(m.order.len() + m.skipped.len(), 3);
    for run in &m.runs {
        let row = run.result.row("cell", "live");
        assert!(row.turns > 0, "{}: no turn finished", run.policy.name());
        assert_eq!(row.failures, 0, "{}: {row:?}", run.policy.name());
        assert!(
            row.stay_rate.is_some(),
            "{}: no stay counted",
            run.policy.name()
        );
        match run.policy {
            LivePolicy::SmgCacheAware | LivePolicy::SmgCacheAwareTuned => {
                assert!(run.router_named > 0, "smg named no engine");
                assert_eq!(
                    run.router_named, run.router_agreed,
                    "smg's header disagrees"
                );
                assert!(run.peer_command.as_deref().unwrap_or("").contains("launch"));
            }
            _ => assert_eq!(run.router_named, 0, "{}", run.policy.name()),
        }
    }
}

/// `smg_priority` (the real peer in `hearth-bench tenants`) starts smg
/// with its priority scheduler on and every tenant's ceiling raised to
/// `interactive`: each request is admitted under the class its
/// `x-smg-priority` header names, as smg's own metrics count them (with
/// the ceiling at smg's default, `interactive` would be clamped to
/// `default`). Skipped without the peers installed, as above.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smg_priority_admits_each_request_under_the_class_its_header_names() {
    use hearth_bench::live::{engine_configs, preset, LivePolicy, Serving, SMG_PRIORITY_HEADER};
    use std::time::Duration;
    let mut sc = preset("cache-never-fills").unwrap();
    sc.replicas = 2;
    let serving = match Serving::start(
        LivePolicy::SmgPriority,
        engine_configs(&sc, 20.0),
        Vec::new(),
        Duration::from_secs(60),
    )
    .await
    {
        Ok(s) => s,
        Err(e) if format!("{e:#}").contains("scripts/setup-peers") => {
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "smg not installed under CI: {e:#}"
            );
            eprintln!("skipping: {e:#}");
            return;
        }
        Err(e) => panic!("{e:#}"),
    };
    let client = reqwest::Client::new();
    let url = format!("{}/v1/chat/completions", serving.url());
    for (n, class) in [(2, Some("interactive")), (3, Some("bulk")), (1, None)] {
        for i in 0..n {
            let mut req = client.post(&url).json(&serde_json::json!({
                "model": hearth_bench::live::MODEL,
                "messages": [{"role": "user", "content": format!("{class:?} {i}")}],
                "max_tokens": 4,
            }));
            if let Some(c) = class {
                req = req.header(SMG_PRIORITY_HEADER, c);
            }
            let status = req.send().await.unwrap().status();
            assert_eq!(status, 200, "{class:?} request {i}");
        }
    }
    let peer = serving.peer().expect("a peer serves smg_priority");
    let metrics = client
        .get(format!("{}/metrics", peer.metrics_url()))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let admitted = |class: &str| -> f64 {
        let series = format!("smg_scheduler_admit_total{{class=\"{class}\",outcome=\"admitted\"}}");
        metrics
            .lines()
            .find(|l| l.starts_with(&series))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or(0.0)
    };
    assert_eq!(admitted("interactive"), 2.0, "{metrics}");
    assert_eq!(admitted("bulk"), 3.0, "{metrics}");
    assert_eq!(admitted("default"), 1.0, "{metrics}");
    assert!(serving
        .peer_command()
        .unwrap()
        .contains("--priority-scheduler-enabled"));
    serving.shutdown().await;
}

//! Observability end to end: Prometheus `/metrics`, the decision journal
//! (ring and JSONL file) and the per-second history, after real traffic
//! through Envoy.

use std::time::{Duration, Instant};

use hearth_e2e::{
    filler, metric_sample as sample, reply_text, Conversation, Fleet, FleetOptions, MODEL,
};
use hearth_ext_proc::observe::admin::{Decisions, SeriesView};
use hearth_ext_proc::observe::journal::{DecisionRecord, ServedLine};

async fn get(fleet: &Fleet, path: &str) -> (u16, String) {
    fleet.admin_get(path).await.unwrap()
}

/// Polls `path` until `done` holds for its body, up to 20 s (a readiness
/// wait: background work such as the first probe round or the journal
/// writer finishing), then returns the body.
async fn wait_for(fleet: &Fleet, path: &str, done: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (_, body) = get(fleet, path).await;
        if done(&body) || Instant::now() > deadline {
            return body;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn metrics_journal_and_history_explain_every_decision() {
    let dir = std::env::temp_dir().join(format!("hearth-obs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let jsonl = dir.join("decisions.jsonl");
    let _ = std::fs::remove_file(&jsonl);
    let fleet = Fleet::start(FleetOptions {
        model_tag: true,
        sidecar_flags: vec![
            format!("--journal-file={}", jsonl.display()),
            "--journal-size=100".into(),
        ],
        ..FleetOptions::default()
    })
    .await
    .unwrap();

    // Three conversations of three turns, each turn with its own request id.
    let system = filler(21, 4096);
    let mut turns = Vec::new();
    for s in 0..3u64 {
        let mut conv = Conversation::new(MODEL, &format!("{system} tenant {s}"), true, 900 + s);
        for t in 0..3 {
            let id = format!("obs-{s}-{t}");
            let body = serde_json::to_vec(&conv.next_turn(3000, false)).unwrap();
            let turn = fleet
                .post(
                    "/v1/chat/completions",
                    body,
                    &[("content-type", "application/json"), ("x-request-id", &id)],
                )
                .await
                .unwrap();
            assert_eq!(turn.status, 200, "{:?}", turn.body);
            conv.push_assistant(&reply_text(&turn.body));
            conv.push_tool_round(3000);
            turns.push((id, turn));
        }
    }
    // A model nobody serves: refused, and journaled as such.
    let other = Conversation::new("no-such-model", "sys", false, 990).next_turn(100, false);
    let body = serde_json::to_vec(&other).unwrap();
    let refused = fleet
        .post(
            "/v1/chat/completions",
            body,
            &[
                ("content-type", "application/json"),
                ("x-request-id", "obs-refused"),
            ],
        )
        .await
        .unwrap();
    assert_eq!(refused.status, 404);

    // "Why did this turn go there": the journal has the request, with
    // every candidate's numbers, and the choice is the best score.
    let (code, text) = get(&fleet, "/debug/decisions?request_id=obs-1-2").await;
    assert_eq!(code, 200, "{text}");
    let found: Decisions = serde_json::from_str(&text).unwrap();
    assert_eq!(found.decisions.len(), 1);
    let d: &DecisionRecord = &found.decisions[0];
    let served = turns[5].1.upstream.clone().expect("x-hearth-upstream");
    assert_eq!(d.outcome, "routed");
    assert_eq!(d.chosen.as_deref(), Some(served.as_str()));
    assert_eq!(d.model.as_deref(), Some(MODEL));
    assert_eq!(d.basis, "relative");
    assert_eq!(d.candidates.len(), 4);
    assert_eq!(d.fallbacks.len(), 2, "HEARTH_FALLBACKS default");
    assert!(d.blocks > 2 && d.prompt_bytes > 0);
    for h in [&d.first_hash, &d.last_hash] {
        let h = h.as_deref().unwrap();
        assert!(
            h.len() == 16 && h.chars().all(|c| c.is_ascii_hexdigit()),
            "{h}"
        );
    }
    let best = d
        .candidates
        .iter()
        .map(|c| c.score)
        .fold(f64::MIN, f64::max);
    let chosen = d
        .candidates
        .iter()
        .find(|c| Some(&c.replica) == d.chosen.as_ref())
        .unwrap();
    assert_eq!(chosen.score, best);
    assert_eq!(chosen.overlap, d.overlap);
    for c in &d.candidates {
        assert!((c.score - (c.credit - 8.0 * c.load)).abs() < 1e-9, "{c:?}");
    }
    assert_eq!(d.session.as_deref(), Some("stay"));
    assert_eq!(d.previous, d.chosen);
    // Privacy: hashes and numbers, never the prompt.
    assert!(!text.contains(&system[..64]), "prompt text in the journal");

    let (code, text) = get(&fleet, "/debug/decisions?request_id=obs-refused").await;
    assert_eq!(code, 200, "{text}");
    let r: Decisions = serde_json::from_str(&text).unwrap();
    assert_eq!(r.decisions[0].outcome, "no_replica");
    assert!(r.decisions[0]
        .error
        .as_deref()
        .unwrap()
        .contains("no-such-model"));
    assert!(r.decisions[0].chosen.is_none());

    let (code, _) = get(&fleet, "/debug/decisions?request_id=never-sent").await;
    assert_eq!(code, 404);
    let (_, text) = get(&fleet, "/debug/decisions?limit=3").await;
    let latest: Decisions = serde_json::from_str(&text).unwrap();
    assert_eq!(latest.journal_size, 100);
    let ids: Vec<_> = latest
        .decisions
        .iter()
        .map(|d| d.request_id.clone().unwrap())
        .collect();
    assert_eq!(ids, ["obs-refused", "obs-2-2", "obs-2-1"], "newest first");

    // Metrics, with stable names.
    let (code, m) = get(&fleet, "/metrics").await;
    assert_eq!(code, 200);
    let v = |series: &str| sample(&m, series).unwrap_or_else(|| panic!("{series} missing:\n{m}"));
    assert_eq!(
        v(r#"hearth_decisions_total{outcome="routed",basis="relative"}"#),
        9.0
    );
    assert_eq!(
        v(r#"hearth_decisions_total{outcome="no_replica",basis="relative"}"#),
        1.0
    );
    assert_eq!(v("hearth_decision_duration_seconds_count"), 10.0);
    assert_eq!(v("hearth_decision_overlap_blocks_count"), 9.0);
    assert_eq!(v(r#"hearth_session_turns_total{result="new"}"#), 3.0);
    assert_eq!(v(r#"hearth_session_turns_total{result="stay"}"#), 6.0);
    assert!(sample(&m, r#"hearth_session_turns_total{result="move"}"#).is_none());
    assert_eq!(v("hearth_session_stay_ratio"), 1.0);
    let hit = v("hearth_overlap_blocks_total") / v("hearth_prompt_blocks_total");
    assert!(hit > 0.3 && hit < 1.0, "cache-hit proxy {hit}");
    // The llm-d router's picker series, under its names and labels.
    let labels = |model: &str| {
        format!(
            "model_name=\"{model}\",target_model_name=\"{model}\",fairness_id=\"\",priority=\"\""
        )
    };
    assert_eq!(
        v(&format!("llm_d_epp_request_total{{{}}}", labels(MODEL))),
        9.0
    );
    assert_eq!(
        v(&format!(
            "llm_d_epp_request_error_total{{{},error_code=\"BadRequest\"}}",
            labels("no-such-model")
        )),
        1.0
    );
    assert_eq!(v("llm_d_epp_scheduler_e2e_duration_seconds_count"), 10.0);
    let usage = |name: &str| v(&format!("{name}{{{}}}", labels(MODEL)));
    assert_eq!(usage("llm_d_epp_request_input_tokens_count"), 9.0);
    assert!(usage("llm_d_epp_request_cached_tokens_sum") > 0.0);
    assert!(
        usage("llm_d_epp_request_cached_tokens_sum") < usage("llm_d_epp_request_input_tokens_sum")
    );
    assert_eq!(v("llm_d_epp_ready_endpoints{name=\"hearth\"}"), 4.0);
    let state = fleet.state().await.unwrap();
    let mut routed = 0.0;
    for r in &state.replicas {
        let id = &r.id;
        routed += v(&format!(
            r#"hearth_replica_requests_total{{replica="{id}"}}"#
        ));
        assert_eq!(
            v(&format!(r#"hearth_replica_serving{{replica="{id}"}}"#)),
            1.0
        );
        assert_eq!(
            v(&format!(
                r#"hearth_replica_fencings_total{{replica="{id}"}}"#
            )),
            0.0
        );
        assert_eq!(
            v(&format!(
                r#"hearth_replica_warmth_blocks{{replica="{id}"}}"#
            )),
            r.warmth_blocks as f64
        );
        assert!(sample(
            &m,
            &format!(r#"hearth_replica_in_flight{{replica="{id}"}}"#)
        )
        .is_some());
        assert!(sample(&m, &format!(r#"hearth_replica_load{{replica="{id}"}}"#)).is_some());
    }
    assert_eq!(routed, 9.0);
    // The first probe round runs at start-up.
    let engine = fleet.engines[0].addr;
    let probe = format!(r#"hearth_probes_total{{engine="{engine}",result="success"}}"#);
    let m = wait_for(&fleet, "/metrics", |m| sample(m, &probe).is_some()).await;
    assert!(sample(&m, &probe).unwrap() >= 1.0, "{m}");

    // The history the dashboard draws.
    let (_, text) = get(&fleet, "/debug/series?seconds=600").await;
    let series: SeriesView = serde_json::from_str(&text).unwrap();
    assert_eq!(series.replicas.len(), 4);
    let total = |f: fn(&hearth_ext_proc::observe::series::Second) -> u64| -> u64 {
        series.seconds.iter().map(f).sum()
    };
    assert_eq!(total(|s| u64::from(s.decisions)), 10);
    assert_eq!(total(|s| u64::from(s.refused)), 1);
    assert_eq!(total(|s| u64::from(s.stays)), 6);
    assert!(total(|s| s.overlap_blocks) > 0);

    // The JSONL file: one line per decision, in order, and one per answer
    // with what its engine served, as the ring's record holds it.
    let deadline = Instant::now() + Duration::from_secs(20);
    let (decisions, answers, ring) = loop {
        let text = std::fs::read_to_string(&jsonl).unwrap_or_default();
        // A decision's line has its outcome; an answer's has none.
        let (decided, served): (Vec<serde_json::Value>, Vec<serde_json::Value>) = text
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .partition(|v| v.get("outcome").is_some());
        let decisions: Vec<DecisionRecord> = decided
            .into_iter()
            .map(|v| serde_json::from_value(v).unwrap())
            .collect();
        let answers: Vec<ServedLine> = served
            .into_iter()
            .map(|v| serde_json::from_value(v).unwrap())
            .collect();
        let (_, text) = get(&fleet, "/debug/decisions?limit=20").await;
        let ring: Decisions = serde_json::from_str(&text).unwrap();
        let done = decisions.len() >= 10 && answers.len() >= 9;
        if done || Instant::now() > deadline {
            break (decisions, answers, ring);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(decisions.len(), 10);
    assert_eq!(decisions[0].request_id.as_deref(), Some("obs-0-0"));
    assert_eq!(decisions[9].outcome, "no_replica");
    assert!(decisions.iter().all(|d| d.served.is_none()));
    let mut in_file: Vec<(String, u64, u64)> = answers
        .iter()
        .map(|a| {
            let s = &a.served;
            (a.request_id.clone(), s.prompt_tokens, s.cached_tokens)
        })
        .collect();
    let mut in_ring: Vec<(String, u64, u64)> = ring
        .decisions
        .iter()
        .filter_map(|d| {
            let s = d.served.as_ref()?;
            Some((d.request_id.clone()?, s.prompt_tokens, s.cached_tokens))
        })
        .collect();
    in_file.sort();
    in_ring.sort();
    assert_eq!(in_file.len(), 9, "every routed turn's answer: {in_file:?}");
    assert_eq!(in_file, in_ring);
    assert!(
        in_file.iter().any(|&(_, _, cached)| cached > 0),
        "{in_file:?}"
    );
    fleet.assert_wasm_healthy();
    drop(fleet);
    std::fs::remove_dir_all(&dir).unwrap();
}

//! The usage loop through the real Envoy: each generation's answer carries
//! its usage back to the sidecar (the outcome filter's report in the
//! filter shape, the ext_proc stream in body mode), where it meets its
//! decision's prediction under the sidecar's own ticket; the journal shows
//! the served figures next to the prediction. Clients that send the same
//! `x-request-id` cannot cross-wire their reports.

use std::time::{Duration, Instant};

use hearth_e2e::{
    filler, metric_sample, reply_text, verdicts, Conversation, Fleet, FleetOptions, MODEL,
};
use hearth_router::Snapshot;
use serde_json::Value;

/// Every request of the test claims this id.
const SAME_ID: &str = "one-id-for-everyone";

async fn turn(fleet: &Fleet, conv: &mut Conversation) -> u64 {
    let body = conv.next_turn(1500, false);
    let t = fleet
        .post(
            "/v1/chat/completions",
            serde_json::to_vec(&body).unwrap(),
            &[
                ("content-type", "application/json"),
                ("x-request-id", SAME_ID),
            ],
        )
        .await
        .unwrap();
    assert_eq!(t.status, 200, "{:?}", t.body);
    conv.push_assistant(&reply_text(&t.body));
    t.body["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0)
}

fn totals(s: &Snapshot) -> (u64, u64, u64, u64) {
    s.replicas.iter().fold((0, 0, 0, 0), |acc, r| {
        (
            acc.0 + r.usage.reports_total,
            acc.1 + r.usage.compared_total,
            acc.2 + r.usage.cached_tokens_total,
            acc.3 + r.usage.predicted_cached_tokens_total,
        )
    })
}

async fn usage_loop(shape: FleetOptions) {
    let fleet = Fleet::start(FleetOptions {
        engines: 2,
        ..shape
    })
    .await
    .unwrap();
    // Two conversations of three turns, each round's two turns in flight
    // at once, every request with the same client-chosen id: a ledger
    // keyed by that id would pair an answer with the other's decision.
    let mut a = Conversation::new(MODEL, &filler(61, 8192), false, 6100);
    let mut b = Conversation::new(MODEL, &filler(62, 8192), false, 6200);
    let mut served_cached = 0;
    for _ in 0..3 {
        let (x, y) = tokio::join!(turn(&fleet, &mut a), turn(&fleet, &mut b));
        served_cached += x + y;
    }
    // Reports travel after the answers: wait for all six.
    let start = Instant::now();
    let s = loop {
        let s = fleet.settle(Duration::from_secs(5)).await.unwrap();
        if totals(&s).0 >= 6 || start.elapsed() > Duration::from_secs(10) {
            break s;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let (reports, compared, cached, predicted) = totals(&s);
    assert_eq!(reports, 6, "every answer's usage came back: {s:?}");
    // Every answer met its own decision's prediction: none was unmatched
    // although all six shared one client id.
    assert_eq!(compared, 6, "{s:?}");
    assert_eq!(cached, served_cached, "the engines' own figures: {s:?}");
    // The later turns were predicted warm, and served so.
    assert!(predicted > 0 && cached > 0, "{s:?}");
    let (_, m) = fleet.admin_get("/metrics").await.unwrap();
    assert_eq!(metric_sample(&m, "hearth_usage_unmatched_total"), Some(0.0));
    assert_eq!(
        metric_sample(&m, "hearth_prediction_error_count"),
        Some(6.0)
    );
    // The journal keeps the served figures next to each prediction.
    let (_, body) = fleet
        .admin_get(&format!("/debug/decisions?request_id={SAME_ID}"))
        .await
        .unwrap();
    let j: Value = serde_json::from_str(&body).unwrap();
    let served: Vec<&Value> = j["decisions"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|d| d.get("served").filter(|v| !v.is_null()))
        .collect();
    assert!(!served.is_empty(), "{j}");
    assert!(
        served
            .iter()
            .all(|v| v["predicted_cached_tokens"].is_u64() && v["prompt_tokens"].is_u64()),
        "{j}"
    );
    fleet.assert_wasm_healthy();
}

#[tokio::test]
async fn the_usage_loop_runs_through_envoy_and_a_clients_request_id_names_nothing() {
    usage_loop(FleetOptions::default()).await;
}

#[tokio::test]
async fn the_usage_loop_runs_through_envoy_in_body_mode() {
    usage_loop(FleetOptions {
        body_mode: true,
        ..FleetOptions::default()
    })
    .await;
}

/// Sends `turns` streamed turns of `conv`, checking that none of Hearth's
/// marks reaches the client; returns the cached tokens the engines served.
async fn streamed_turns(fleet: &Fleet, conv: &mut Conversation, turns: usize) -> u64 {
    let url = format!("{}/v1/chat/completions", fleet.envoy.url());
    let mut served_cached = 0;
    for _ in 0..turns {
        let body = conv.next_turn(1500, true);
        let resp = fleet.client.post(&url).json(&body).send().await.unwrap();
        assert_eq!(resp.status(), 200);
        let headers = resp.headers().clone();
        let text = resp.text().await.unwrap();
        assert!(headers.get("x-hearth-upstream").is_some(), "{headers:?}");
        for name in [
            "x-hearth-first-chunk",
            "x-hearth-outcome",
            "x-hearth-ticket",
        ] {
            assert!(
                headers.get(name).is_none(),
                "{name} reached the client: {headers:?}"
            );
        }
        let mut reply = String::new();
        for event in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
            let Ok(v) = serde_json::from_str::<Value>(event) else {
                continue;
            };
            if let Some(t) = v["choices"][0]["delta"]["content"].as_str() {
                reply.push_str(t);
            }
            if let Some(c) = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() {
                served_cached += c;
            }
        }
        assert!(!reply.is_empty(), "{text}");
        conv.push_assistant(&reply);
    }
    served_cached
}

/// The sidecar's verdicts by channel, once `total` usage reports are in
/// (they are taken as each stream closes, just after its answer).
async fn verdicts_when(fleet: &Fleet, total: u64) -> (Snapshot, f64, f64) {
    let start = Instant::now();
    let s = loop {
        let s = fleet.settle(Duration::from_secs(5)).await.unwrap();
        if totals(&s).0 >= total || start.elapsed() > Duration::from_secs(10) {
            break s;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let (_, m) = fleet.admin_get("/metrics").await.unwrap();
    let count = |channel| verdicts(&m, channel).unwrap_or(0.0);
    (s, count("trailer"), count("post"))
}

/// The filter shape hands a streamed answer's verdict and usage to the
/// sidecar on the request's own ext_proc stream (a response trailer the
/// outcome filter adds and the sidecar removes): no report is posted for
/// it, nor for its first chunk when little of its prompt is left to read.
/// An answer with a content-length is still posted. The client sees none
/// of Hearth's marks.
#[tokio::test]
async fn a_streamed_answers_verdict_rides_its_ext_proc_stream() {
    let fleet = Fleet::start(FleetOptions {
        engines: 2,
        // 16 tokens 5 ms apart: the answer ends well after its headers.
        decode_micros_per_token: 5_000.0,
        ..FleetOptions::default()
    })
    .await
    .unwrap();
    let mut conv = Conversation::new(MODEL, &filler(63, 8192), false, 6300);
    let served_cached = streamed_turns(&fleet, &mut conv, 3).await;
    let (s, trailer, post) = verdicts_when(&fleet, 3).await;
    let (reports, compared, cached, predicted) = totals(&s);
    assert_eq!((reports, compared), (3, 3), "{s:?}");
    assert_eq!(cached, served_cached, "the engines' own figures: {s:?}");
    assert!(predicted > 0, "later turns were predicted warm: {s:?}");
    assert_eq!((trailer, post), (3.0, 0.0), "nothing was posted");

    // The same conversation's next turn, not streamed: it has a
    // content-length, so its verdict is posted.
    let t = turn(&fleet, &mut conv).await;
    assert!(t > 0, "a warm turn");
    let (_, trailer, post) = verdicts_when(&fleet, 4).await;
    assert_eq!((trailer, post), (3.0, 1.0));
    fleet.assert_wasm_healthy();
}

/// Answers that end within the sidecar's answer to their response headers
/// (engines that send a whole answer at once): a trailer added then would
/// pass ext_proc by, so the outcome filter posts those. Whichever way, no
/// verdict is lost.
#[tokio::test]
async fn no_verdict_is_lost_when_answers_end_at_once() {
    let fleet = Fleet::start(FleetOptions {
        engines: 2,
        ..FleetOptions::default()
    })
    .await
    .unwrap();
    let mut convs: Vec<Conversation> = (0..4)
        .map(|i| Conversation::new(MODEL, &filler(70 + i, 4096), false, 7000 + i))
        .collect();
    let mut served_cached = 0;
    for conv in &mut convs {
        served_cached += streamed_turns(&fleet, conv, 3).await;
    }
    let (s, trailer, post) = verdicts_when(&fleet, 12).await;
    let (reports, compared, cached, _) = totals(&s);
    assert_eq!((reports, compared), (12, 12), "{s:?}");
    assert_eq!(cached, served_cached, "{s:?}");
    assert_eq!(trailer + post, 12.0, "trailer {trailer}, post {post}");
    fleet.assert_wasm_healthy();
}

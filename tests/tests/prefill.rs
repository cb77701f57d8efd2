//! A request weighs on its replica one load unit, plus one for each
//! `HEARTH_LOAD_UNIT_BYTES` of its prompt the replica must still read, and
//! that second part only until the reading is done: once the answer's
//! first chunk has gone by, the sidecar gives it back, in every shape (the
//! ext_proc stream carries the answer in the body and endpoint-picker
//! shapes; the outcome filter reports the first chunk in the filter one).

use std::time::Duration;

use futures::StreamExt;
use hearth_bench::engine::Fault;
use hearth_e2e::{filler, idle, Conversation, Fleet, FleetOptions, MODEL};

/// How long the sidecar may take to show what a test waits for.
const WAIT: Duration = Duration::from_secs(20);
use serde_json::json;

async fn a_streamed_answer_sheds_its_prompt_load_at_its_first_chunk(options: FleetOptions) {
    let fleet = Fleet::start(FleetOptions {
        engines: 2,
        // 150 output tokens at 20 ms each: the stream stays open seconds
        // after its first chunk.
        decode_micros_per_token: 20_000.0,
        ..options
    })
    .await
    .unwrap();
    // The engines hold every answer back 1.5 s, so the request's load can
    // be read before its first chunk.
    for e in &fleet.engines {
        e.engine.set_fault(Fault::Slow { millis: 1500 });
    }
    let url = format!("{}/v1/chat/completions", fleet.envoy.url());
    // A cold prompt of 256 KiB: four load units of unread bytes (64 KiB
    // each, the default) beside the request's own.
    let mut conv = Conversation::new(MODEL, &filler(31, 256 << 10), false, 3100);
    let mut body = conv.next_turn(2000, true);
    body["max_tokens"] = json!(150);
    let client = fleet.client.clone();
    let sent = tokio::spawn(async move { client.post(&url).json(&body).send().await });

    let before = fleet
        .state_when(WAIT, |s| s.replicas.iter().any(|r| r.in_flight == 1))
        .await
        .unwrap();
    let home = before
        .replicas
        .iter()
        .position(|r| r.in_flight == 1)
        .expect("the request is in flight");
    let weight = before.replicas[home].load;
    assert!(
        weight > 4.0 && weight < 5.5,
        "before its first chunk the request weighs 1 + its unread bytes: {before:?}"
    );

    let resp = sent.await.unwrap().unwrap();
    assert_eq!(resp.status(), 200);
    let mut chunks = resp.bytes_stream();
    chunks.next().await.unwrap().unwrap();
    for e in &fleet.engines {
        e.engine.set_fault(Fault::None);
    }
    let after = fleet
        .state_when(WAIT, |s| s.replicas[home].load < weight)
        .await
        .unwrap();
    assert_eq!(after.replicas[home].in_flight, 1, "{after:?}");
    assert!(
        (after.replicas[home].load - 1.0).abs() < 1e-9,
        "after its first chunk the open stream weighs one unit: {after:?}"
    );
    assert_eq!(
        after.replicas[home].uncached_in_flight_bytes, 0,
        "{after:?}"
    );

    while chunks.next().await.is_some() {}
    let settled = fleet.settle(Duration::from_secs(10)).await.unwrap();
    assert!(idle(&settled), "{settled:?}");
}

#[tokio::test]
async fn filter_shape_a_streamed_answer_sheds_its_prompt_load_at_its_first_chunk() {
    a_streamed_answer_sheds_its_prompt_load_at_its_first_chunk(FleetOptions::default()).await;
}

#[tokio::test]
async fn body_shape_a_streamed_answer_sheds_its_prompt_load_at_its_first_chunk() {
    a_streamed_answer_sheds_its_prompt_load_at_its_first_chunk(FleetOptions {
        body_mode: true,
        ..FleetOptions::default()
    })
    .await;
}

#[tokio::test]
async fn picker_shape_a_streamed_answer_sheds_its_prompt_load_at_its_first_chunk() {
    a_streamed_answer_sheds_its_prompt_load_at_its_first_chunk(FleetOptions {
        gie_mode: true,
        ..FleetOptions::default()
    })
    .await;
}

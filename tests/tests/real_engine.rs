//! Real engines behind the gateway: two llama.cpp `llama-server`s (two
//! slots each, SmolLM2-135M-Instruct on the CPU) through the real Envoy,
//! filter and sidecar. What came from cache is the engine's own figure
//! (`usage.prompt_tokens_details.cached_tokens`), and which engine answered
//! is the engine's own word (each answers with its replica id as `model`).
//!
//! Needs `scripts/setup` (it builds llama-server and installs the model);
//! without them these tests fail and say what to run.

use std::time::{Duration, Instant};

use hearth_bench::llama::{LlamaConfig, LlamaServer};
use hearth_e2e::{
    cached_and_prompt_tokens, filler, reply_text, two_slot_llama, Conversation, Fleet, LlamaFleet,
};
use hearth_router::health::HealthState;
use hearth_router::Snapshot;
use serde_json::Value;

/// The model clients ask for (a single-model llama-server serves any name).
const MODEL: &str = "smollm2-135m-instruct";

/// Sidecar flags of every test here.
/// - These conversations are 1-3 KB of canonical prompt, less than two
///   blocks of the default 2 KiB: a turn would share no full block with
///   the one before and route on load alone. 256-byte blocks (the filter
///   gets the same size) give them a prefix to follow.
/// - A CPU engine reading a first turn while other jobs share the machine
///   can take longer than the default probe timeout; a probe that times
///   out there is slowness, not failure.
const SIDECAR_FLAGS: [&str; 2] = ["--block-size=256", "--probe-timeout-seconds=30"];

/// The engines of every test here (see [`two_slot_llama`]).
fn engine_config() -> LlamaConfig {
    two_slot_llama()
}

/// A conversation with its own system prompt of a few hundred tokens,
/// and what the engines said about its last turn.
struct Session {
    label: String,
    conv: Conversation,
    /// The engine that answered the last turn, and its prompt tokens.
    last: Option<(String, u64)>,
}

impl Session {
    fn new(seed: u64) -> Session {
        let system = format!(
            "You are the build assistant of project {seed}. Answer in one short sentence. \
             Project notes follow.\n{}",
            filler(seed, 1000)
        );
        Session::with_system(seed, &system)
    }

    /// A conversation whose system prompt starts with a harness every
    /// conversation of a test shares (about 2 KB), then its own notes.
    fn sharing_a_harness(seed: u64) -> Session {
        let system = format!(
            "You are a coding agent. Follow the team's harness rules below.\n{}\n\
             Project {seed} notes:\n{}",
            filler(7, 2000),
            filler(seed, 600)
        );
        Session::with_system(seed, &system)
    }

    fn with_system(seed: u64, system: &str) -> Session {
        Session {
            label: format!("conversation {seed}"),
            conv: Conversation::new(MODEL, system, false, seed),
            last: None,
        }
    }

    /// Sends the next turn (a short user message, eight tokens of answer)
    /// and returns the engine that answered. Checks that it is the one
    /// `x-hearth-upstream` names, and what that engine read from its own
    /// cache: after a turn it served, all of that turn's prompt (only the
    /// reply and the new message are fresh); otherwise no more than the
    /// chat template's first tokens (every prompt here starts with them).
    async fn turn(&mut self, fleet: &Fleet) -> String {
        let mut body = self.conv.next_turn(240, false);
        body["max_tokens"] = 8.into();
        let t = fleet.chat(&body).await;
        let label = &self.label;
        let engine = t
            .engine
            .clone()
            .unwrap_or_else(|| panic!("{label}: no model in the answer: {:?}", t.body));
        assert_eq!(
            t.upstream.as_deref(),
            Some(engine.as_str()),
            "{label}: x-hearth-upstream names another engine than the one that answered"
        );
        let (cached, prompt) = cached_and_prompt_tokens(&t.body);
        match &self.last {
            Some((last, last_prompt)) if *last == engine => assert!(
                cached >= *last_prompt,
                "{label}: {engine} served the last turn ({last_prompt} prompt tokens) \
                 but read only {cached} of {prompt} from cache: {:?}",
                t.body["usage"]
            ),
            _ => assert!(
                cached * 5 < prompt,
                "{label}: new to {engine}, yet {cached} of {prompt} prompt tokens came \
                 from its cache: {:?}",
                t.body["usage"]
            ),
        }
        self.last = Some((engine.clone(), prompt));
        self.conv.push_assistant(&reply_text(&t.body));
        engine
    }
}

fn health(s: &Snapshot, id: &str) -> HealthState {
    s.replicas
        .iter()
        .find(|r| r.id == id)
        .unwrap_or_else(|| panic!("no replica {id} in {s:?}"))
        .health
        .state
}

/// The sidecar's `/health`: HTTP status and `status` field.
async fn sidecar_health(fleet: &LlamaFleet) -> (u16, String) {
    let (status, body) = fleet.fleet.admin_get("/health").await.unwrap();
    let v: Value = serde_json::from_str(&body).unwrap();
    (status, v["status"].as_str().unwrap_or_default().to_string())
}

/// Polls the sidecar's `/state` until `cond` holds; panics with the last
/// state after `deadline`.
async fn wait_for(
    fleet: &LlamaFleet,
    deadline: Duration,
    what: &str,
    cond: impl Fn(&Snapshot) -> bool,
) {
    let start = Instant::now();
    loop {
        let s = fleet.fleet.state().await.unwrap();
        if cond(&s) {
            eprintln!("{what} after {:?}", start.elapsed());
            return;
        }
        assert!(
            start.elapsed() < deadline,
            "{what} not reached within {deadline:?}: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn conversations_stay_on_their_engine_and_read_their_history_from_its_cache() {
    let lf = LlamaFleet::start(2, &engine_config(), &SIDECAR_FLAGS)
        .await
        .unwrap();
    // Four conversations, one turn each in rotation: each engine serves
    // two of them alternately, one per slot.
    let mut sessions: Vec<Session> = (100..104).map(Session::new).collect();
    let mut homes = Vec::new();
    for s in sessions.iter_mut() {
        homes.push(s.turn(&lf.fleet).await);
    }
    for turn in 2..=4 {
        for (s, home) in sessions.iter_mut().zip(&homes) {
            let engine = s.turn(&lf.fleet).await;
            assert_eq!(&engine, home, "{} moved in turn {turn}", s.label);
        }
    }
    let mut used = homes.clone();
    used.sort();
    used.dedup();
    assert_eq!(
        used,
        ["llama-0", "llama-1"],
        "the conversations did not use both engines: {homes:?}"
    );
    // What the decisions predicted from cache against what the engine
    // served: the previous turn's whole prompt, in the engine's tokens,
    // within 5% of each prompt on average.
    let (_, m) = lf.fleet.admin_get("/metrics").await.unwrap();
    let sample = |name: &str| hearth_e2e::metric_sample(&m, name).unwrap_or(0.0);
    let compared = sample("hearth_prediction_error_count");
    assert!(compared >= 12.0, "{compared} answers compared:\n{m}");
    let mean = sample("hearth_prediction_error_sum") / compared;
    eprintln!("mean |predicted - served| / prompt: {mean:.4} over {compared} answers");
    assert!(mean < 0.05, "mean prediction error {mean:.3}:\n{m}");
    lf.fleet.assert_wasm_healthy();
}

#[tokio::test]
async fn a_killed_engine_is_fenced_and_readmitted_when_it_comes_back_on_its_port() {
    let mut flags = vec![
        "--probe-interval-seconds=1",
        "--eject-backoff-seconds=1",
        "--eject-max-backoff-seconds=2",
    ];
    flags.extend(SIDECAR_FLAGS);
    let mut lf = LlamaFleet::start(2, &engine_config(), &flags)
        .await
        .unwrap();
    let (victim, survivor) = ("llama-1", "llama-0");

    // New conversations until one lives on each engine.
    let mut on_survivor = None;
    let mut on_victim = None;
    for seed in 200..206 {
        let mut s = Session::new(seed);
        match s.turn(&lf.fleet).await.as_str() {
            e if e == survivor => on_survivor = on_survivor.or(Some(s)),
            _ => on_victim = on_victim.or(Some(s)),
        }
        if on_survivor.is_some() && on_victim.is_some() {
            break;
        }
    }
    let (Some(stays), Some(moves)) = (on_survivor, on_victim) else {
        panic!("six new conversations all went to one engine");
    };
    let mut sessions = [stays, moves];

    let i = lf.index(victim);
    lf.engines[i].stop();
    // Every turn still succeeds, on the survivor (a request sent to the
    // dead engine is retried there). The victim's conversation starts
    // cold there and is warm from its next turn on (checked by `turn`).
    for round in 0..3 {
        for s in sessions.iter_mut() {
            let engine = s.turn(&lf.fleet).await;
            assert_eq!(engine, survivor, "{} in round {round}", s.label);
        }
    }
    // Failed requests and failed probes fence it.
    wait_for(&lf, Duration::from_secs(30), "llama-1 fenced", |s| {
        health(s, victim) == HealthState::Fenced
    })
    .await;
    assert_eq!(sidecar_health(&lf).await, (200, "degraded".to_string()));

    // Back on the same port with an empty cache: a probe after the
    // backoff re-admits it.
    lf.engines[i].restart().await.unwrap();
    wait_for(&lf, Duration::from_secs(60), "llama-1 re-admitted", |s| {
        health(s, victim) == HealthState::Serving
    })
    .await;
    assert_eq!(sidecar_health(&lf).await, (200, "ok".to_string()));

    // Both conversations stay where their history now is; new ones reach
    // the restarted engine again.
    for s in sessions.iter_mut() {
        let engine = s.turn(&lf.fleet).await;
        assert_eq!(engine, survivor, "{} after the re-admission", s.label);
    }
    let mut served = Vec::new();
    for seed in 300..302 {
        served.push(Session::new(seed).turn(&lf.fleet).await);
    }
    assert!(
        served.iter().any(|e| e == victim),
        "no new conversation reached the re-admitted engine: {served:?}"
    );
    lf.fleet.assert_wasm_healthy();
}

#[tokio::test]
async fn an_engine_restarts_on_its_port_and_its_key_guards_all_but_health() {
    let mut engine = LlamaServer::start(LlamaConfig {
        alias: "keyed".into(),
        slots: 1,
        ctx_size: 1024,
        api_key: Some("engine-key".into()),
        ..LlamaConfig::default()
    })
    .await
    .unwrap();
    let client = reqwest::Client::new();
    let base = engine.url();
    let get = |path: &str, key: Option<&str>| {
        let mut req = client.get(format!("{base}{path}"));
        if let Some(k) = key {
            req = req.bearer_auth(k);
        }
        req.send()
    };
    assert_eq!(get("/health", None).await.unwrap().status(), 200);
    assert_eq!(get("/v1/models", None).await.unwrap().status(), 401);
    assert_eq!(get("/metrics", None).await.unwrap().status(), 401);
    let models: Value = get("/v1/models", Some("engine-key"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], "keyed", "{models}");
    // The launcher sends the key with its own scrapes.
    assert_eq!(engine.metric("requests_processing").await.unwrap(), 0.0);

    let addr = engine.addr;
    engine.stop();
    assert!(!engine.is_running());
    assert!(get("/health", None).await.is_err(), "{addr} still answers");
    engine.restart().await.unwrap();
    assert_eq!(engine.addr, addr);
    assert!(engine.is_running());
    assert_eq!(get("/health", None).await.unwrap().status(), 200);
    assert_eq!(engine.log().matches("--- hearth: start ").count(), 2);
}

#[tokio::test]
async fn new_conversations_sharing_a_harness_fill_idle_engines_first() {
    // Four engines of two slots; four conversations that share a harness
    // prompt. The first two start one after the other (the first pauses
    // before the second is placed), the last two at the same moment (the
    // third still running when the fourth is placed). The engine that read
    // the harness first must not take them all: the conversations resident
    // on an engine, paused or running, count against it while other
    // engines are idle.
    let lf = LlamaFleet::start(4, &engine_config(), &SIDECAR_FLAGS)
        .await
        .unwrap();
    let mut sessions: Vec<Session> = (400..404).map(Session::sharing_a_harness).collect();
    let mut homes = Vec::new();
    let (one_by_one, together) = sessions.split_at_mut(2);
    for s in one_by_one.iter_mut() {
        homes.push(s.turn(&lf.fleet).await);
    }
    let (third, fourth) = together.split_at_mut(1);
    let (a, b) = tokio::join!(third[0].turn(&lf.fleet), fourth[0].turn(&lf.fleet));
    homes.extend([a, b]);
    let mut used = homes.clone();
    used.sort();
    used.dedup();
    assert_eq!(used.len(), 4, "one conversation per engine: {homes:?}");
    // Their next turns stay, reading their history from the engine's cache
    // (checked by `turn`).
    for (s, home) in sessions.iter_mut().zip(&homes) {
        assert_eq!(&s.turn(&lf.fleet).await, home, "{} moved", s.label);
    }
    lf.fleet.assert_wasm_healthy();
}

#[tokio::test]
async fn engines_that_need_a_key_keep_serving_through_idle_periods() {
    let keyed = LlamaConfig {
        api_key: Some("engine-key".into()),
        ..engine_config()
    };
    let auth = [
        ("content-type", "application/json"),
        ("authorization", "Bearer engine-key"),
    ];
    // Probes every second while idle: without the sidecar's key each is
    // refused, which must never fence a replica.
    let mut flags = vec![
        "--probe-interval-seconds=1",
        "--probe-retry-seconds=0.5",
        "--engine-metrics-seconds=1",
    ];
    flags.extend(SIDECAR_FLAGS);
    let lf = LlamaFleet::start(2, &keyed, &flags).await.unwrap();
    let mut conv = Session::new(500).conv;
    for round in 0..2 {
        for _ in 0..2 {
            let mut body = conv.next_turn(240, false);
            body["max_tokens"] = 8.into();
            let body = serde_json::to_vec(&body).unwrap();
            let t = lf
                .fleet
                .post("/v1/chat/completions", body, &auth)
                .await
                .unwrap();
            assert_eq!(t.status, 200, "round {round}: {:?}", t.body);
            conv.push_assistant(&reply_text(&t.body));
        }
        if round == 0 {
            // Idle: far longer than three refused probes take.
            tokio::time::sleep(Duration::from_secs(6)).await;
        }
    }
    let s = lf.fleet.state().await.unwrap();
    for r in &s.replicas {
        assert_eq!(r.health.state, HealthState::Serving, "{s:?}");
        assert_eq!(r.health.fenced_total, 0, "{s:?}");
        let why = r.health.credentials_error.as_deref().unwrap_or_default();
        assert!(why.contains("probe: HTTP 401"), "{s:?}");
        assert!(why.contains("metrics: HTTP 401"), "{s:?}");
    }
    drop(lf);

    // With the key, the engines accept the sidecar's probes and scrapes.
    let key_flag = "--engine-api-key=engine-key".to_string();
    let mut flags = flags.clone();
    flags.push(&key_flag);
    let lf = LlamaFleet::start(2, &keyed, &flags).await.unwrap();
    wait_for(
        &lf,
        Duration::from_secs(60),
        "probes and scrapes accepted",
        |s| {
            s.replicas.iter().all(|r| {
                r.health.credentials_error.is_none()
                    && r.engine.is_some()
                    && r.health.state == HealthState::Serving
            })
        },
    )
    .await;
    // The first probe's answer (a cold CPU engine takes a while).
    let addr = lf.engines[0].addr;
    let ok = format!(r#"hearth_probes_total{{engine="{addr}",result="success"}}"#);
    let deadline = Instant::now() + Duration::from_secs(60);
    let m = loop {
        let (_, m) = lf.fleet.admin_get("/metrics").await.unwrap();
        if hearth_e2e::metric_sample(&m, &ok).unwrap_or(0.0) >= 1.0 {
            break m;
        }
        assert!(Instant::now() < deadline, "no accepted probe:\n{m}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let refused = format!(r#"hearth_probes_total{{engine="{addr}",result="unauthorized"}}"#);
    assert_eq!(hearth_e2e::metric_sample(&m, &refused), None, "{m}");
    assert!(!m.contains("engine-key"));
}

/// What one engine's `/slots` showed while it was watched: how many times
/// a slot took a probe (its task carries the probe's seed), and how many
/// of those it took from a conversation (the slot's task before was a
/// client's).
#[derive(Debug, Default)]
struct SlotWatch {
    probes: usize,
    probes_over_conversations: Vec<String>,
    samples: usize,
}

/// Polls `GET /slots` of the engine at `addr` every 25 ms until `stop`.
async fn watch_slots(
    addr: std::net::SocketAddr,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> SlotWatch {
    use hearth_ext_proc::feeds::probe::PROBE_SEED;
    let http = reqwest::Client::new();
    let mut last: std::collections::HashMap<u64, (u64, bool)> = Default::default();
    let mut w = SlotWatch::default();
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let slots: Option<Vec<Value>> = match http
            .get(format!("http://{addr}/slots"))
            .timeout(Duration::from_secs(2))
            .send()
            .await
        {
            Ok(r) => r.json().await.ok(),
            Err(_) => None,
        };
        for s in slots.unwrap_or_default() {
            let (Some(id), Some(task)) = (s["id"].as_u64(), s["id_task"].as_u64()) else {
                continue;
            };
            let probe = s["params"]["seed"].as_u64() == Some(PROBE_SEED);
            if let Some(&(before, was_probe)) = last.get(&id) {
                if before != task && probe {
                    w.probes += 1;
                    if !was_probe {
                        w.probes_over_conversations.push(format!(
                            "slot {id}: task {before} (a client's), then probe {task}"
                        ));
                    }
                }
            } else if probe {
                w.probes += 1;
            }
            last.insert(id, (task, probe));
        }
        w.samples += 1;
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    w
}

/// The case of a regression once seen at the defaults: four conversations
/// of six turns start at once on two fresh engines while the sidecar's
/// start-up probes are due. A probe that waited behind the first turns
/// took the slot of a paused conversation, whose next turn then read its
/// whole prompt again. Now no probe goes behind real work or into a slot
/// that holds a conversation (the engines' own `/slots` are watched all
/// through the run), and Hearth reads at least as much of the later turns
/// from cache as a session-key ring hash on the same engines, in the same
/// test (a ring hash never moves a conversation and sends no probes).
#[tokio::test]
async fn at_the_defaults_no_probe_takes_a_conversations_slot_and_hearth_caches_as_well_as_a_session_hash(
) {
    use hearth_bench::real::{run_policy, Policy, RealArgs};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let engines = futures::future::try_join_all((0..2).map(|i| {
        LlamaServer::start(LlamaConfig {
            alias: format!("llama-{i}"),
            ..engine_config()
        })
    }))
    .await
    .unwrap();
    let args = RealArgs {
        engines: engines.iter().map(|e| e.addr).collect(),
        api_key: None,
        model: Some(MODEL.into()),
        workload: hearth_bench::real::Workload::Conversations,
        users_per_group: 1,
        conversations: 4,
        turns: 6,
        // A shared harness of about 270 words, each conversation's own
        // notes, 100-word user turns, 8-token answers: prompts of 750 to
        // 1,600 tokens, two to four blocks of the default 2 KiB.
        shared_bytes: 1600,
        system_bytes: 800,
        user_bytes: 600,
        think_ms: 500,
        max_tokens: 8,
        policies: vec![Policy::Hearth, Policy::RingHash],
        peer_deadline_s: 60,
        paired: false,
        driver: hearth_bench::real::Driver::HearthBench,
        rates: Vec::new(),
        stage_seconds: 0,
        system_tokens: 0,
        question_tokens: 0,
        tokenizer: None,
        reset_caches: false,
        keep: None,
        timeout: 240,
        seed: 1,
        salt: Some(0x5107),
        sidecar: Default::default(),
        json: None,
    };
    // Hearth first, on engines that hold nothing: its start-up probes find
    // empty slots and are due as the first turns arrive.
    let stop = Arc::new(AtomicBool::new(false));
    let watchers: Vec<_> = engines
        .iter()
        .map(|e| tokio::spawn(watch_slots(e.addr, Arc::clone(&stop))))
        .collect();
    let hearth = run_policy(&args, Policy::Hearth, MODEL, 0x5107)
        .await
        .unwrap()
        .summary;
    stop.store(true, Ordering::Relaxed);
    let mut watched = Vec::new();
    for w in watchers {
        watched.push(w.await.unwrap());
    }
    let ring = run_policy(&args, Policy::RingHash, MODEL, 0x5107)
        .await
        .unwrap()
        .summary;
    eprintln!(
        "{}",
        hearth_bench::real::table(&[hearth.clone(), ring.clone()])
    );
    eprintln!(
        "slots watched: {watched:?}; hearth's probes during its run: {:?}; wall time hearth / ring_hash: {:.2}",
        hearth.probes,
        hearth.wall_s / ring.wall_s
    );
    for (row, name) in [(&hearth, "hearth"), (&ring, "ring_hash")] {
        assert_eq!(row.ok, 24, "{name}: not every turn answered: {row:?}");
        // Envoy proxied 24 turns: some CPU time, at a 10 ms tick.
        assert!(
            row.gateway_cpu_s.is_some_and(|c| c > 0.0),
            "{name}: the gateway's CPU time was not read: {row:?}"
        );
    }
    for (i, w) in watched.iter().enumerate() {
        assert!(w.samples > 10, "engine {i}'s /slots was hardly read: {w:?}");
        assert!(
            w.probes_over_conversations.is_empty(),
            "engine {i}: a probe took a conversation's slot: {w:?}"
        );
    }
    let (h, r) = (hearth.cached_later.unwrap(), ring.cached_later.unwrap());
    assert!(
        h >= r - 0.01,
        "later turns from cache: hearth {h:.3}, ring_hash {r:.3}"
    );
}

#[tokio::test]
async fn a_streamed_answer_weighs_one_unit_once_its_first_chunk_is_out() {
    // A load unit a KiB of unread prompt, so a 9 KB first turn weighs
    // several units while llama.cpp reads it, and one once it streams
    // tokens (it sends its headers when the slot starts, its first chunk
    // after the prompt is read); read alone, it times the prefill rate.
    // Twice the usual context, so a slot holds the prompt.
    let flags = [
        SIDECAR_FLAGS[0],
        SIDECAR_FLAGS[1],
        "--load-unit-bytes=1024",
        "--flow-prefill-seconds=1",
    ];
    let config = LlamaConfig {
        ctx_size: 8192,
        ..engine_config()
    };
    let lf = LlamaFleet::start(2, &config, &flags).await.unwrap();
    hearth_e2e::first_chunk_sheds_the_prompt_load(&lf.fleet, MODEL, 256).await;
}

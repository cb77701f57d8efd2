//! `hearth-bench soak`: minutes of agent traffic through the real Envoy,
//! filter and sidecar while things go wrong, on loopback only:
//!
//! - clients abort a share of their streams after the first chunk;
//! - at 25% of the run the sidecar is killed (SIGKILL) and restarted 2 s later;
//! - at 40% one replica stops generating (it still answers `/health` and
//!   `/v1/models`);
//! - at 60% another replica is killed (its streams are cut, it refuses
//!   connections), and at 75% it comes back, cold, on the same address.
//!
//! The report: requests sent, succeeded, failed and why; how long the
//! sidecar took to fence the replica that stopped generating and how many
//! requests it still routed there afterwards; in-flight load at the end;
//! the sidecar's resident memory at the start and the end.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use futures::StreamExt;
use serde::Serialize;
use serde_json::Value;

use crate::conversation::{filler, Conversation};
use crate::engine::{self, EngineConfig, EngineHandle, Fault};
use crate::rng::Rng;
use crate::stack::Stack;

#[derive(Debug, Clone, Args)]
pub struct SoakArgs {
    /// Length of the run, in seconds.
    #[arg(long, default_value_t = 180)]
    pub seconds: u64,
    /// Concurrent agent sessions.
    #[arg(long, default_value_t = 48)]
    pub agents: usize,
    /// Engine replicas (at least 3: one stalls, one is killed).
    #[arg(long, default_value_t = 4)]
    pub replicas: usize,
    /// Share of streams the client abandons after the first chunk.
    #[arg(long, default_value_t = 0.1)]
    pub abort_rate: f64,
    /// Client deadline for one request, in seconds.
    #[arg(long, default_value_t = 10)]
    pub request_timeout: u64,
    /// Seed of the agents' random choices.
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Also write the report here as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// How one request ended, from the client's side.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
enum Ending {
    Completed,
    /// The client gave up on purpose after the first chunk.
    Abandoned,
    /// The client's deadline passed.
    TimedOut,
    /// The answer was cut off mid-body.
    Cut,
    /// No connection or no response.
    NoResponse,
    /// A non-200 status.
    Status(u16),
}

#[derive(Default)]
struct Tally {
    sent: u64,
    endings: BTreeMap<Ending, u64>,
}

#[derive(Debug, Serialize)]
pub struct SoakReport {
    pub command: String,
    pub seconds: u64,
    pub agents: usize,
    pub replicas: usize,
    pub requests_sent: u64,
    pub succeeded: u64,
    pub abandoned_by_client: u64,
    pub failed: BTreeMap<String, u64>,
    /// Seconds from the replica's stall to the sidecar fencing it.
    pub stall_detected_after_s: Option<f64>,
    /// Requests the sidecar routed to the stalled replica after fencing it.
    pub routed_to_stalled_after_detection: Option<u64>,
    pub in_flight_at_end: Vec<u64>,
    /// The (restarted) sidecar's resident memory early in its life...
    pub sidecar_rss_start_bytes: Option<u64>,
    /// ...and at the end of the run.
    pub sidecar_rss_end_bytes: Option<u64>,
    pub events: Vec<String>,
}

fn engine_config(i: usize) -> EngineConfig {
    EngineConfig {
        id: format!("engine-{i}"),
        prefill_micros_per_token: 2.0,
        decode_micros_per_token: 4_000.0,
        ..EngineConfig::default()
    }
}

async fn spawn_engine(i: usize, addr: SocketAddr) -> anyhow::Result<EngineHandle> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match tokio::net::TcpListener::bind(addr).await {
            Ok(l) => return engine::spawn(engine_config(i), l).await,
            Err(e) if Instant::now() < deadline => {
                tracing::debug!(%addr, error = %e, "waiting to rebind");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => return Err(e).context(format!("rebinding {addr}")),
        }
    }
}

/// One agent: turns until `until`, each a streamed chat completion.
async fn agent(id: u64, url: String, args: SoakArgs, until: Instant, tally: Arc<Mutex<Tally>>) {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(args.request_timeout))
        .build()
        .unwrap_or_default();
    let mut rng = Rng::derive(args.seed, id);
    let harness = filler(rng.below(3) as u64, 16 * 1024);
    let mut conv = Conversation::new("hearth-sim", &harness, true, 10_000 + id);
    while Instant::now() < until {
        if conv.messages.len() > 40 {
            // Compaction: a fresh, short history.
            conv = Conversation::new("hearth-sim", &harness, true, rng.next_u64());
        }
        let mut body = conv.next_turn(500 + rng.below(3000), true);
        body["max_tokens"] = Value::from(8 + rng.below(40));
        let abandon = rng.chance(args.abort_rate);
        let ending = one_request(&client, &url, &body, abandon).await;
        {
            let mut t = tally.lock().unwrap_or_else(|p| p.into_inner());
            t.sent += 1;
            *t.endings.entry(ending).or_default() += 1;
        }
        conv.push_assistant("ok");
        conv.push_tool_round(200 + rng.below(2000));
        tokio::time::sleep(Duration::from_millis(20 + rng.below(200) as u64)).await;
    }
}

async fn one_request(client: &reqwest::Client, url: &str, body: &Value, abandon: bool) -> Ending {
    let resp = match client.post(url).json(body).send().await {
        Ok(r) => r,
        Err(e) if e.is_timeout() => return Ending::TimedOut,
        Err(_) => return Ending::NoResponse,
    };
    if resp.status() != 200 {
        return Ending::Status(resp.status().as_u16());
    }
    let mut chunks = resp.bytes_stream();
    let mut tail = Vec::new();
    while let Some(chunk) = chunks.next().await {
        match chunk {
            Ok(c) => {
                if abandon {
                    return Ending::Abandoned;
                }
                tail.extend_from_slice(&c);
                let keep = tail.len().saturating_sub(64);
                tail.drain(..keep);
            }
            Err(e) if e.is_timeout() => return Ending::TimedOut,
            Err(_) => return Ending::Cut,
        }
    }
    if String::from_utf8_lossy(&tail).contains("[DONE]") {
        Ending::Completed
    } else {
        Ending::Cut
    }
}

fn replica_field(state: &Value, id: &str, field: &str) -> Option<Value> {
    state["replicas"]
        .as_array()?
        .iter()
        .find(|r| r["id"] == id)
        .map(|r| r[field].clone())
}

fn is_fenced(state: &Value, id: &str) -> bool {
    replica_field(state, id, "health").is_some_and(|h| h["state"] == "fenced")
}

pub async fn run(args: SoakArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.replicas >= 3, "--replicas must be at least 3");
    anyhow::ensure!(args.seconds >= 20, "--seconds must be at least 20");
    let command = format!(
        "hearth-bench soak --seconds {} --agents {} --replicas {} --abort-rate {} --request-timeout {} --seed {}",
        args.seconds, args.agents, args.replicas, args.abort_rate, args.request_timeout, args.seed
    );
    println!("{command}");
    let mut events = Vec::new();
    let started = Instant::now();
    let note = |events: &mut Vec<String>, what: String| {
        let line = format!("{:>6.1}s {what}", started.elapsed().as_secs_f64());
        println!("{line}");
        events.push(line);
    };

    // The engines, the sidecar as its own process (so it can be killed)
    // and Envoy. A killed engine comes back on its address.
    let mut stack = Stack::simulated((0..args.replicas).map(engine_config).collect())
        .settings([
            ("HEARTH_PROBE_INTERVAL_SECONDS", "1"),
            ("HEARTH_PROBE_TIMEOUT_SECONDS", "2"),
            ("HEARTH_EJECT_BACKOFF_SECONDS", "5"),
            ("HEARTH_FIRST_BYTE_TIMEOUT_SECONDS", "5"),
            // A replica that served within the busy grace is not struck
            // for a timeout; the soak's stall comes right after real
            // successes.
            ("HEARTH_BUSY_GRACE_SECONDS", "3"),
        ])
        .envoy_deadline(Duration::from_secs(30))
        .start()
        .await?;
    let addrs = stack.addrs.clone();
    let sidecar_pid = |stack: &Stack| stack.sidecar_process.as_ref().map_or(0, |s| s.pid());
    let rss = |stack: &Stack| stack.sidecar_process.as_ref().and_then(|s| s.rss_bytes());
    let envoy_url = stack.url();
    let url = format!("{envoy_url}/v1/chat/completions");
    note(
        &mut events,
        format!(
            "{} engines, sidecar pid {}, Envoy at {envoy_url}",
            args.replicas,
            sidecar_pid(&stack),
        ),
    );

    let total = Duration::from_secs(args.seconds);
    let until = Instant::now() + total;
    let tally = Arc::new(Mutex::new(Tally::default()));
    let agents: Vec<_> = (0..args.agents as u64)
        .map(|id| {
            tokio::spawn(agent(
                id,
                url.clone(),
                args.clone(),
                until,
                Arc::clone(&tally),
            ))
        })
        .collect();

    let at = |f: f64| started + total.mul_f64(f);
    let stalled = "engine-1";
    let killed = 2usize;
    tokio::time::sleep_until(at(0.25).into()).await;
    stack.stop_sidecar().await?;
    note(&mut events, "sidecar killed".into());
    tokio::time::sleep(Duration::from_secs(2)).await;
    stack.start_sidecar().await?;
    note(
        &mut events,
        format!("sidecar restarted (pid {})", sidecar_pid(&stack)),
    );
    // The restarted sidecar's memory, once it carries traffic again.
    tokio::time::sleep_until(at(0.30).into()).await;
    let rss_start = rss(&stack);

    tokio::time::sleep_until(at(0.40).into()).await;
    let stall_at = Instant::now();
    stack.engines[1].engine.set_fault(Fault::Stall);
    note(&mut events, format!("{stalled} stops generating"));
    let mut detected: Option<(Instant, u64)> = None;

    let mut killed_done = false;
    let mut restarted = false;
    while Instant::now() < until {
        let now = Instant::now();
        if detected.is_none() {
            if let Ok(state) = stack.state_json().await {
                if is_fenced(&state, stalled) {
                    let routed = replica_field(&state, stalled, "routed_total")
                        .and_then(|v| v.as_u64())
                        .unwrap_or(0);
                    detected = Some((now, routed));
                    note(&mut events, format!("{stalled} fenced by the sidecar"));
                }
            }
        }
        if !killed_done && now >= at(0.60) {
            // Cut its streams, then stop it (its place in the list is
            // kept by the engine started there later).
            let e = stack.engines.remove(killed);
            e.engine.set_fault(Fault::Reset);
            e.shutdown().await;
            killed_done = true;
            note(&mut events, format!("engine-{killed} killed"));
        }
        if killed_done && !restarted && now >= at(0.75) {
            let e = spawn_engine(killed, addrs[killed]).await?;
            stack.engines.insert(killed, e);
            restarted = true;
            note(&mut events, format!("engine-{killed} restarted (cold)"));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    for a in agents {
        let _ = a.await;
    }
    note(&mut events, "traffic stopped".into());

    // Let the last streams end, then read the sidecar's books.
    let settle_until = Instant::now() + Duration::from_secs(15);
    let mut state = stack.state_json().await?;
    while Instant::now() < settle_until {
        let busy = state["replicas"]
            .as_array()
            .is_some_and(|rs| rs.iter().any(|r| r["in_flight"].as_u64() != Some(0)));
        if !busy {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        state = stack.state_json().await?;
    }
    let in_flight_at_end: Vec<u64> = state["replicas"]
        .as_array()
        .map(|rs| {
            rs.iter()
                .map(|r| r["in_flight"].as_u64().unwrap_or(0))
                .collect()
        })
        .unwrap_or_default();
    let routed_after = detected.map(|(_, routed_then)| {
        replica_field(&state, stalled, "routed_total")
            .and_then(|v| v.as_u64())
            .unwrap_or(0)
            .saturating_sub(routed_then)
    });

    let tally = std::mem::take(&mut *tally.lock().unwrap_or_else(|p| p.into_inner()));
    let count = |e: Ending| tally.endings.get(&e).copied().unwrap_or(0);
    let failed: BTreeMap<String, u64> = tally
        .endings
        .iter()
        .filter(|(e, _)| !matches!(e, Ending::Completed | Ending::Abandoned))
        .map(|(e, n)| {
            let name = match e {
                Ending::Status(s) => format!("status_{s}"),
                other => serde_json::to_value(other)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_string))
                    .unwrap_or_default(),
            };
            (name, *n)
        })
        .collect();
    let report = SoakReport {
        command,
        seconds: args.seconds,
        agents: args.agents,
        replicas: args.replicas,
        requests_sent: tally.sent,
        succeeded: count(Ending::Completed),
        abandoned_by_client: count(Ending::Abandoned),
        failed,
        stall_detected_after_s: detected.map(|(t, _)| t.duration_since(stall_at).as_secs_f64()),
        routed_to_stalled_after_detection: routed_after,
        in_flight_at_end,
        sidecar_rss_start_bytes: rss_start,
        sidecar_rss_end_bytes: rss(&stack),
        events,
    };
    print_report(&report);
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_vec_pretty(&report)?)?;
        println!("wrote {}", path.display());
    }
    stack.shutdown().await;
    Ok(())
}

fn print_report(r: &SoakReport) {
    let mib = |b: Option<u64>| b.map_or("?".into(), |b| format!("{:.1} MiB", b as f64 / 1048576.0));
    println!(
        "\nsoak report ({} s, {} agents, {} replicas)",
        r.seconds, r.agents, r.replicas
    );
    println!("  requests sent          {}", r.requests_sent);
    println!("  succeeded              {}", r.succeeded);
    println!("  abandoned by clients   {}", r.abandoned_by_client);
    for (why, n) in &r.failed {
        println!("  failed: {why:<15} {n}");
    }
    match r.stall_detected_after_s {
        Some(s) => println!("  stalled replica fenced {s:.1} s after it stopped generating"),
        None => println!("  stalled replica was NOT fenced"),
    }
    if let Some(n) = r.routed_to_stalled_after_detection {
        println!("  routed to it after     {n}");
    }
    println!("  in-flight at end       {:?}", r.in_flight_at_end);
    println!(
        "  sidecar RSS            {} at start, {} at end",
        mib(r.sidecar_rss_start_bytes),
        mib(r.sidecar_rss_end_bytes)
    );
}

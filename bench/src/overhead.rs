//! `hearth-bench overhead`: what Hearth costs per request inside Envoy.
//!
//! Starts one Envoy per configuration in front of the same zero-latency
//! simulated engines and drives the same requests through each, in
//! alternating rounds:
//!
//! - **plain**: Envoy with `least_request`, no Hearth filter (the floor);
//! - **hearth**: filter-wasm + ext_proc headers-only + override_host (the
//!   shipped `envoy/gateway.yaml`);
//! - **body**: no wasm filter; ext_proc sends each request body (BUFFERED)
//!   to the sidecar, which fingerprints it (`envoy/gateway-body.yaml`), the
//!   endpoint-picker style of the Gateway API Inference Extension;
//!
//! Two more, only when asked for with `--configs`, tell the costs of the
//! shipped gateway's parts apart (neither is a shape to run):
//!
//! - **hearth-no-outcome**: the shipped gateway without its outcome
//!   filter (the sidecar learns nothing from answers);
//! - **ext-proc-only**: no wasm at all, ext_proc headers-only, routing on
//!   load alone: what the ext_proc stream costs by itself;
//! - **hearth-posted-reports**: the shipped gateway with its outcome filter
//!   posting every verdict to the sidecar (`POST /outcome`, and
//!   `/outcome/first-token` for a streamed answer) instead of handing a
//!   streamed answer's to its ext_proc stream (`trailer_reports` off).
//!
//! With `--stream-tokens N` every request asks for a streamed answer of N
//! tokens, which the engines send one event at a time (`--decode-ms`
//! apart), as a real engine does: the case where the outcome filter sees
//! every chunk.
//!
//! Each sidecar is its own `hearth-ext-proc` process, so its CPU can be read
//! from `/proc/<pid>/stat` like Envoy's. The engines and the load generator
//! run in this process; their CPU is the same for every configuration and
//! is not counted.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use hearth_ext_proc::config::Mode;

use crate::cpu::{clock_ticks, process_seconds};
use crate::engine::{self, EngineConfig, EngineHandle};
use crate::stack::{Front, Stack};

/// Flags of `hearth-bench overhead`.
#[derive(Debug, Clone, clap::Args)]
pub struct OverheadArgs {
    /// Request body sizes in bytes (chat bodies of about this size).
    #[arg(long, value_delimiter = ',', default_values_t = [8_000usize, 220_000, 1_000_000])]
    pub bodies: Vec<usize>,
    /// Concurrent clients.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 20, 150])]
    pub concurrency: Vec<usize>,
    /// Requests per configuration and cell: `--requests-base` plus
    /// `--requests-per-client` per concurrent client, split over the rounds.
    #[arg(long, default_value_t = 60)]
    pub requests_base: usize,
    #[arg(long, default_value_t = 4)]
    pub requests_per_client: usize,
    /// Rounds per cell; configurations alternate within each round.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Simulated engines behind every Envoy.
    #[arg(long, default_value_t = 4)]
    pub engines: usize,
    /// Distinct sessions (prompts) the requests cycle through.
    #[arg(long, default_value_t = 16)]
    pub sessions: usize,
    /// Configurations to run (the first is the baseline of the ratios).
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [Config::Plain, Config::Hearth, Config::Body])]
    pub configs: Vec<Config>,
    /// Streamed answers of this many tokens (0: a non-streamed answer of
    /// 4 tokens).
    #[arg(long, default_value_t = 0)]
    pub stream_tokens: usize,
    /// With `--stream-tokens`, the engines' time per output token, so each
    /// token leaves as its own event.
    #[arg(long, default_value_t = 2.0)]
    pub decode_ms: f64,
    /// Also print the table as JSON lines on stdout.
    #[arg(long)]
    pub json: bool,
}

/// A configuration of the gateway in front of the engines.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Config {
    Plain,
    Hearth,
    #[value(name = "body-grpc")]
    Body,
    HearthNoOutcome,
    ExtProcOnly,
    HearthPostedReports,
}

impl Config {
    fn name(self) -> &'static str {
        match self {
            Config::Plain => "plain",
            Config::Hearth => "hearth",
            Config::Body => "body-grpc",
            Config::HearthNoOutcome => "hearth-no-outcome",
            Config::ExtProcOnly => "ext-proc-only",
            Config::HearthPostedReports => "hearth-posted-reports",
        }
    }

    /// The fingerprint filter runs (its hash counters can be read).
    fn hashes(self) -> bool {
        matches!(
            self,
            Config::Hearth | Config::HearthNoOutcome | Config::HearthPostedReports
        )
    }
}

/// One configuration's running processes (in front of the shared
/// engines).
struct Configured {
    config: Config,
    stack: Stack,
}

/// Latency and CPU of one configuration in one cell.
#[derive(Default, Clone)]
struct Sample {
    latencies: Vec<Duration>,
    failures: usize,
    wall: Duration,
    envoy_cpu: f64,
    sidecar_cpu: f64,
    /// The wasm filter's own fingerprinting time (hearth only).
    hash_micros: u64,
    hashed: u64,
}

pub async fn run(args: OverheadArgs) -> anyhow::Result<()> {
    let ticks = clock_ticks();
    let configs = &args.configs;
    anyhow::ensure!(!configs.is_empty(), "--configs names no configuration");
    let streamed = args.stream_tokens > 0;
    anyhow::ensure!(
        !streamed || (args.decode_ms.is_finite() && args.decode_ms >= 0.0),
        "--decode-ms must be a number >= 0"
    );
    println!("# hearth-bench overhead");
    println!("{}", crate::provenance::header());
    println!(
        "# command: hearth-bench overhead --bodies {} --concurrency {} --requests-base {} --requests-per-client {} --rounds {} --engines {} --sessions {} --configs {} --stream-tokens {} --decode-ms {}",
        join(&args.bodies),
        join(&args.concurrency),
        args.requests_base,
        args.requests_per_client,
        args.rounds,
        args.engines,
        args.sessions,
        configs
            .iter()
            .map(|c| c.name())
            .collect::<Vec<_>>()
            .join(","),
        args.stream_tokens,
        args.decode_ms,
    );
    let answers = if streamed {
        format!(
            "streamed answers of {} tokens, {} ms apart",
            args.stream_tokens, args.decode_ms
        )
    } else {
        "non-streamed answers of 4 tokens, no delay".to_string()
    };
    println!(
        "# machine: {} cores; each Envoy --concurrency 2; {} simulated engines (in this process, no prefill time, {answers}); \
         sidecars are separate hearth-ext-proc processes; client: this process (reqwest, one pool per config)",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        args.engines
    );

    let mut engines: Vec<EngineHandle> = Vec::new();
    for i in 0..args.engines {
        let config = EngineConfig {
            id: format!("engine-{i}"),
            // No prefill time: the engine answers as fast as it can parse,
            // streamed answers paced per token.
            default_output_tokens: 4,
            decode_micros_per_token: if streamed {
                args.decode_ms * 1000.0
            } else {
                0.0
            },
            ..EngineConfig::default()
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        engines.push(engine::spawn(config, listener).await?);
    }
    let upstreams: Vec<SocketAddr> = engines.iter().map(|e| e.addr).collect();
    let mut stacks = Vec::new();
    for &config in configs {
        stacks.push(start_stack(config, &upstreams).await?);
    }

    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(512)
        .build()?;
    let mut rows = Vec::new();
    for &size in &args.bodies {
        let bodies: Arc<Vec<Vec<u8>>> = Arc::new(
            (0..args.sessions.max(1))
                .map(|s| {
                    if streamed {
                        streamed_body(size, s as u64, args.stream_tokens)
                    } else {
                        chat_body(size, s as u64)
                    }
                })
                .collect(),
        );
        for &conc in &args.concurrency {
            let total = args.requests_base + args.requests_per_client * conc;
            let per_round = total.div_ceil(args.rounds.max(1)).max(conc);
            let mut samples = vec![Sample::default(); stacks.len()];
            // Warm each stack's connections and caches for this cell.
            for stack in &stacks {
                drive(
                    &client,
                    &stack.stack.url(),
                    &bodies,
                    conc.min(8),
                    conc.min(8),
                )
                .await;
            }
            for round in 0..args.rounds.max(1) {
                // Alternate which configuration goes first.
                for k in 0..stacks.len() {
                    let i = (k + round) % stacks.len();
                    let stack = &stacks[i];
                    let cpu0 = stack_cpu(stack, ticks);
                    let hash0 = hash_stats(stack).await;
                    let (lat, failures, wall) =
                        drive(&client, &stack.stack.url(), &bodies, per_round, conc).await;
                    let cpu1 = stack_cpu(stack, ticks);
                    let hash1 = hash_stats(stack).await;
                    let s = &mut samples[i];
                    s.latencies.extend(lat);
                    s.failures += failures;
                    s.wall += wall;
                    s.envoy_cpu += cpu1.0 - cpu0.0;
                    s.sidecar_cpu += cpu1.1 - cpu0.1;
                    s.hash_micros += hash1.0.saturating_sub(hash0.0);
                    s.hashed += hash1.1.saturating_sub(hash0.1);
                }
            }
            let plain = summarize(&samples[0]);
            for (stack, sample) in stacks.iter().zip(&samples) {
                let r = summarize(sample);
                let row = Row {
                    body: size,
                    conc,
                    config: stack.config.name(),
                    requests: sample.latencies.len(),
                    failures: sample.failures,
                    p50_ms: r.p50,
                    p99_ms: r.p99,
                    added_p50_ms: r.p50 - plain.p50,
                    added_p99_ms: r.p99 - plain.p99,
                    rps: r.rps,
                    rps_vs_plain: r.rps / plain.rps.max(f64::MIN_POSITIVE),
                    envoy_cpu_s_per_1k: 1000.0 * sample.envoy_cpu / r.n.max(1) as f64,
                    sidecar_cpu_s_per_1k: 1000.0 * sample.sidecar_cpu / r.n.max(1) as f64,
                    filter_hash_ms: (sample.hashed > 0)
                        .then(|| sample.hash_micros as f64 / sample.hashed as f64 / 1000.0),
                };
                row.print(rows.is_empty());
                rows.push(row);
            }
        }
    }
    if args.json {
        for r in &rows {
            println!("{}", r.json());
        }
    }
    for c in stacks {
        c.stack.shutdown().await;
    }
    for e in engines {
        e.shutdown().await;
    }
    Ok(())
}

fn join(v: &[usize]) -> String {
    v.iter().map(usize::to_string).collect::<Vec<_>>().join(",")
}

struct Row {
    body: usize,
    conc: usize,
    config: &'static str,
    requests: usize,
    failures: usize,
    p50_ms: f64,
    p99_ms: f64,
    added_p50_ms: f64,
    added_p99_ms: f64,
    rps: f64,
    rps_vs_plain: f64,
    envoy_cpu_s_per_1k: f64,
    sidecar_cpu_s_per_1k: f64,
    filter_hash_ms: Option<f64>,
}

impl Row {
    fn print(&self, header: bool) {
        if header {
            println!(
                "| body | conc | config | requests | fail | p50 ms | p99 ms | +p50 ms | +p99 ms | req/s | vs plain | Envoy CPU s/1k | sidecar CPU s/1k | filter hash ms |"
            );
            println!("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
        }
        println!(
            "| {} | {} | {} | {} | {} | {:.2} | {:.2} | {:+.2} | {:+.2} | {:.0} | {:.2} | {:.2} | {:.2} | {} |",
            human(self.body),
            self.conc,
            self.config,
            self.requests,
            self.failures,
            self.p50_ms,
            self.p99_ms,
            self.added_p50_ms,
            self.added_p99_ms,
            self.rps,
            self.rps_vs_plain,
            self.envoy_cpu_s_per_1k,
            self.sidecar_cpu_s_per_1k,
            self.filter_hash_ms
                .map_or("-".to_string(), |m| format!("{m:.2}"))
        );
    }

    fn json(&self) -> String {
        serde_json::json!({
            "body_bytes": self.body, "concurrency": self.conc, "config": self.config,
            "requests": self.requests, "failures": self.failures,
            "p50_ms": self.p50_ms, "p99_ms": self.p99_ms,
            "added_p50_ms": self.added_p50_ms, "added_p99_ms": self.added_p99_ms,
            "rps": self.rps, "rps_vs_plain": self.rps_vs_plain,
            "envoy_cpu_s_per_1k": self.envoy_cpu_s_per_1k,
            "sidecar_cpu_s_per_1k": self.sidecar_cpu_s_per_1k,
            "filter_hash_ms": self.filter_hash_ms,
        })
        .to_string()
    }
}

fn human(bytes: usize) -> String {
    if bytes >= 1_000_000 {
        format!("{:.1} MB", bytes as f64 / 1e6)
    } else {
        format!("{} KB", bytes / 1000)
    }
}

struct Summary {
    n: usize,
    p50: f64,
    p99: f64,
    rps: f64,
}

fn summarize(s: &Sample) -> Summary {
    let mut ms: Vec<f64> = s.latencies.iter().map(|d| d.as_secs_f64() * 1e3).collect();
    ms.sort_by(f64::total_cmp);
    let pct = |p: f64| {
        if ms.is_empty() {
            0.0
        } else {
            ms[((ms.len() as f64 * p).ceil() as usize).clamp(1, ms.len()) - 1]
        }
    };
    Summary {
        n: ms.len(),
        p50: pct(0.50),
        p99: pct(0.99),
        rps: ms.len() as f64 / s.wall.as_secs_f64().max(1e-9),
    }
}

/// Sends `n` requests with `conc` clients; returns each successful
/// request's latency (send to last body byte), failures, and wall time.
async fn drive(
    client: &reqwest::Client,
    url: &str,
    bodies: &Arc<Vec<Vec<u8>>>,
    n: usize,
    conc: usize,
) -> (Vec<Duration>, usize, Duration) {
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let started = Instant::now();
    let workers: Vec<_> = (0..conc.max(1))
        .map(|_| {
            let (client, next, bodies) = (client.clone(), next.clone(), bodies.clone());
            let url = format!("{url}/v1/chat/completions");
            tokio::spawn(async move {
                let mut lat = Vec::new();
                let mut failures = 0;
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if i >= n {
                        break;
                    }
                    let body = bodies[i % bodies.len()].clone();
                    let t0 = Instant::now();
                    let ok = match client
                        .post(&url)
                        .header("content-type", "application/json")
                        .body(body)
                        .send()
                        .await
                    {
                        Ok(r) => r.status().is_success() && r.bytes().await.is_ok(),
                        Err(_) => false,
                    };
                    if ok {
                        lat.push(t0.elapsed());
                    } else {
                        failures += 1;
                    }
                }
                (lat, failures)
            })
        })
        .collect();
    let mut all = Vec::with_capacity(n);
    let mut failures = 0;
    for w in workers {
        if let Ok((lat, f)) = w.await {
            all.extend(lat);
            failures += f;
        }
    }
    (all, failures, started.elapsed())
}

/// A chat body of about `size` bytes for session `s`: the session's own
/// system prompt, then user / assistant / tool turns (code-like text with
/// quotes and newlines to escape).
pub fn chat_body(size: usize, s: u64) -> Vec<u8> {
    let mut seed = 0x9E37_79B9_7F4A_7C15u64 ^ s.wrapping_mul(0x2545_F491_4F6C_DD1D);
    let words = [
        "fn",
        "let",
        "match",
        "self",
        "impl",
        "return",
        "request",
        "cache",
        "\"key\"",
        "=>",
        "replica",
        "prefix",
        "{",
        "}",
        "path/to/mod.rs",
        "Ok(())",
    ];
    let mut text = |n: usize| {
        let mut out = String::with_capacity(n + 16);
        while out.len() < n {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            out.push_str(words[(seed % words.len() as u64) as usize]);
            out.push(if seed.is_multiple_of(9) { '\n' } else { ' ' });
        }
        out
    };
    let system = format!("Session {s}. You are a coding agent.\n{}", text(2000));
    let mut messages = vec![serde_json::json!({"role": "system", "content": system})];
    let mut len = 2200;
    let mut i = 0;
    while len + 400 < size {
        let chunk = (size - len).min(12_000);
        messages.push(serde_json::json!({"role": "user", "content": text(chunk / 4)}));
        messages.push(
            serde_json::json!({"role": "assistant", "content": text(chunk / 8),
            "tool_calls": [{"id": format!("call_{i}"), "type": "function",
                "function": {"name": "read_file", "arguments": "{\"path\":\"src/lib.rs\"}"}}]}),
        );
        messages.push(
            serde_json::json!({"role": "tool", "tool_call_id": format!("call_{i}"),
            "content": text(chunk / 2)}),
        );
        len += chunk;
        i += 1;
    }
    serde_json::to_vec(&serde_json::json!({
        "model": "hearth-sim", "max_tokens": 4, "temperature": 0, "messages": messages,
    }))
    .unwrap_or_default()
}

async fn start_stack(config: Config, upstreams: &[SocketAddr]) -> anyhow::Result<Configured> {
    let engines = upstreams.iter().map(SocketAddr::to_string).collect();
    let front = match config {
        Config::Plain => Front::Plain,
        Config::Hearth => Front::Hearth(Mode::Filter),
        Config::Body => Front::Hearth(Mode::Body),
        Config::HearthNoOutcome | Config::ExtProcOnly | Config::HearthPostedReports => {
            Front::Hearth(Mode::Filter)
        }
    };
    let mut builder = Stack::running(engines).front(front);
    match config {
        Config::HearthNoOutcome => builder = builder.edit_envoy(without_outcome_filter),
        Config::ExtProcOnly => builder = builder.edit_envoy(without_wasm),
        Config::HearthPostedReports => builder = builder.edit_envoy(with_posted_reports),
        Config::Plain | Config::Hearth | Config::Body => {}
    }
    let stack = builder
        .start()
        .await
        .with_context(|| format!("starting the {} stack", config.name()))?;
    Ok(Configured { config, stack })
}

/// [`chat_body`] asking for a streamed answer of `tokens` tokens.
fn streamed_body(size: usize, s: u64, tokens: usize) -> Vec<u8> {
    let body = chat_body(size, s);
    let Ok(serde_json::Value::Object(mut obj)) = serde_json::from_slice(&body) else {
        return body;
    };
    obj.insert("stream".into(), true.into());
    obj.insert("max_tokens".into(), tokens.into());
    serde_json::to_vec(&obj).unwrap_or(body)
}

/// The rendered gateway without its outcome filter.
fn without_outcome_filter(yaml: String) -> anyhow::Result<String> {
    without_filter(yaml, "- name: hearth.filter_wasm_outcome\n")
}

/// The rendered gateway with its outcome filter posting every verdict.
fn with_posted_reports(yaml: String) -> anyhow::Result<String> {
    let on = r#","trailer_reports":true"#;
    anyhow::ensure!(
        yaml.contains(on),
        "the rendered gateway's outcome filter has no trailer_reports"
    );
    Ok(yaml.replacen(on, "", 1))
}

/// The rendered gateway without either wasm entry.
fn without_wasm(yaml: String) -> anyhow::Result<String> {
    without_filter(
        without_outcome_filter(yaml)?,
        "- name: hearth.filter_wasm\n",
    )
}

/// `yaml` without the HTTP filter chain's entry that starts with `entry`
/// (up to the next entry).
fn without_filter(yaml: String, entry: &str) -> anyhow::Result<String> {
    let start = yaml
        .find(entry)
        .with_context(|| format!("the rendered gateway has no {}", entry.trim()))?;
    let line_start = yaml[..start].rfind('\n').map_or(0, |i| i + 1);
    let indent = &yaml[line_start..start];
    let next = format!("\n{indent}- name: ");
    let end = yaml[start..]
        .find(&next)
        .map(|i| start + i + 1)
        .with_context(|| format!("{} is the last entry", entry.trim()))?;
    Ok(format!("{}{}", &yaml[..line_start], &yaml[end..]))
}

/// `(Envoy, sidecar)` CPU seconds so far.
fn stack_cpu(c: &Configured, ticks: f64) -> (f64, f64) {
    let [envoy, sidecar] = c
        .stack
        .processes()
        .map(|(_, pid)| pid.map_or(0.0, |p| process_seconds(p, ticks)));
    (envoy, sidecar)
}

/// The filter's `(hash_micros, hashed)` counters (zero without the filter).
async fn hash_stats(c: &Configured) -> (u64, u64) {
    if !c.config.hashes() {
        return (0, 0);
    }
    let micros = c
        .stack
        .envoy
        .stat("wasmcustom.hearth_filter.hash_micros")
        .await
        .ok()
        .flatten();
    let hashed = c
        .stack
        .envoy
        .stat("wasmcustom.hearth_filter.hashed")
        .await
        .ok()
        .flatten();
    (micros.unwrap_or(0), hashed.unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_have_about_the_asked_size_and_fingerprint() {
        for size in [8_000, 220_000, 1_000_000] {
            let b = chat_body(size, 3);
            assert!(
                b.len() > size * 9 / 10 && b.len() < size * 12 / 10,
                "{size}: {}",
                b.len()
            );
            let fp = hearth_wire::fingerprint(
                hearth_wire::Endpoint::ChatCompletions,
                &b,
                &hearth_wire::Params::default(),
            );
            assert!(fp.is_ok());
        }
        assert_ne!(chat_body(8000, 1), chat_body(8000, 2));
    }

    #[test]
    fn each_configuration_is_named_on_the_command_line_as_in_the_table() {
        use clap::ValueEnum;
        for c in Config::value_variants() {
            let flag = c.to_possible_value().unwrap();
            assert_eq!(flag.get_name(), c.name());
            assert_eq!(Config::from_str(c.name(), false), Ok(*c));
        }
        assert!(Config::from_str("hearth-no-fingerprint", false).is_err());
    }

    #[test]
    fn streamed_bodies_ask_for_a_stream_of_the_given_length() {
        let b: serde_json::Value = serde_json::from_slice(&streamed_body(8000, 3, 32)).unwrap();
        assert_eq!(b["stream"], true);
        assert_eq!(b["max_tokens"], 32);
        assert!(b["messages"].as_array().is_some_and(|m| m.len() > 1));
    }

    #[test]
    fn the_attribution_layouts_take_out_only_their_own_entries() {
        let local = std::net::SocketAddr::from(([127, 0, 0, 1], 1));
        let shipped = hearth_ext_proc::envoy::render::render(
            &hearth_ext_proc::envoy::render::Gateway::local(
                local,
                local,
                local,
                vec![local],
                "/x/filter.wasm".into(),
            ),
        );
        let entries = |y: &str| y.matches("\n          - name: ").count();
        let wasm = |y: &str| y.matches("filters.http.wasm.v3.Wasm").count();
        let n = entries(&shipped);
        assert_eq!(wasm(&shipped), 2);

        let no_outcome = without_outcome_filter(shipped.clone()).unwrap();
        assert_eq!((entries(&no_outcome), wasm(&no_outcome)), (n - 1, 1));
        assert!(!no_outcome.contains(r#""role":"outcome""#));
        assert!(no_outcome.contains("- name: hearth.filter_wasm\n"));

        let none = without_wasm(shipped.clone()).unwrap();
        assert_eq!((entries(&none), wasm(&none)), (n - 2, 0));
        for kept in [
            "- name: envoy.filters.http.ext_proc",
            "- name: envoy.filters.http.router",
        ] {
            assert!(none.contains(kept), "{kept} went too");
        }
        assert!(without_wasm(none).is_err());
        assert!(without_outcome_filter(no_outcome).is_err());
    }
}

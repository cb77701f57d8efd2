//! `hearth-bench tenants`: a shared fleet under overload, by tenant and by
//! priority, through the real path (Envoy, the filter, the sidecar
//! process, simulated HTTP engines, time-scaled, as `live` runs them).
//!
//! Two mixes of agent-style conversations ([`crate::workload`]), each
//! agent sending its tenant's `x-gateway-inference-fairness-id` and, in
//! the priority mix, an `x-gateway-inference-objective` (and the same
//! class in smg's `x-smg-priority`):
//!
//! - **tenants**: one noisy tenant with `--noisy-agents` agents beside
//!   `--quiet-tenants` quiet tenants of `--quiet-agents` each (so the noisy
//!   one offers that ratio of each quiet one's turns), on engines that run
//!   `--max-running` sequences at once: the fleet is overloaded;
//! - **priority**: `--high-agents` agents of a high-priority objective
//!   while `--sheddable-agents` agents of a sheddable one (negative
//!   priority) load the fleet.
//!
//! Each mix runs under Envoy `least_request`, Hearth without flow control,
//! Hearth with it and the real peer, smg 1.13.0 with its priority
//! scheduler (skipped when `scripts/setup-peers` did not install it),
//! each on fresh engines with the same seeded
//! conversations; then the reference cells, Hearth with flow control
//! again: the quiet tenants alone (no noisy tenant) and the high band
//! alone (no sheddable load). The table is per class of agent; the
//! ratios are issue 33's goals.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, ValueEnum};
use hearth_wire::names::{FAIRNESS_ID, OBJECTIVE};
use serde::Serialize;

use crate::live::{self, Agent, LivePolicy, Serving, SMG_PRIORITY_HEADER};
use crate::peers::PeerKind;
use crate::report::{RequestRecord, RunResult};
use crate::scenario::Scenario;
use crate::workload::Generator;

mod on_engines;

/// The objectives every Hearth cell is configured with
/// (`HEARTH_FLOW_OBJECTIVES`): the high band and the sheddable one.
const HIGH_OBJECTIVE: &str = "interactive";
const SHEDDABLE_OBJECTIVE: &str = "batch";
const OBJECTIVES: &str = "interactive=10,batch=-1";

/// How long a peer router may take to start and list every engine.
const PEER_DEADLINE: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, Args)]
pub struct TenantsArgs {
    /// Scenario preset whose workload, cache size and sidecar knobs are
    /// used.
    #[arg(long, default_value = "cache-never-fills")]
    pub scenario: String,
    #[arg(long, default_value_t = 2)]
    pub replicas: usize,
    /// Sequences each engine runs at once (the rest wait in its queue):
    /// small, so that a few dozen agents overload the fleet.
    #[arg(long, default_value_t = 4)]
    pub max_running: usize,
    #[arg(long, default_value_t = 4)]
    pub quiet_tenants: usize,
    /// Agents of each quiet tenant.
    #[arg(long, default_value_t = 2)]
    pub quiet_agents: usize,
    /// Agents of the noisy tenant.
    #[arg(long, default_value_t = 16)]
    pub noisy_agents: usize,
    /// Agents of the high-priority objective.
    #[arg(long, default_value_t = 4)]
    pub high_agents: usize,
    /// Agents of the sheddable objective.
    #[arg(long, default_value_t = 20)]
    pub sheddable_agents: usize,
    /// Wall-clock seconds of traffic per cell; the first fifth is warm-up.
    #[arg(long, default_value_t = 60)]
    pub seconds: u64,
    /// Engine and think times are divided by this.
    #[arg(long, default_value_t = 5.0)]
    pub time_scale: f64,
    /// Seconds between two scrapes of each engine's metrics by the
    /// sidecar (wall clock; the engine's waiting queue is one of the
    /// saturation signals).
    #[arg(long, default_value_t = 0.25)]
    pub scrape_seconds: f64,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Run only this mix's cells and its reference (`tenants` or
    /// `priority`; default: both).
    #[arg(long, value_parser = ["tenants", "priority"])]
    pub mix: Option<String>,
    /// Run only these setups' cells (comma-separated; default: every
    /// one); the reference cells (under Hearth with flow control) run
    /// whichever are chosen.
    #[arg(long, value_enum, value_delimiter = ',')]
    pub setups: Vec<Setup>,
    /// Also write the rows and ratios as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Sidecar settings for every Hearth cell (`--set HEARTH_NAME=VALUE`).
    #[command(flatten)]
    pub sidecar: crate::settings::SidecarSettings,
    /// Real engines (OpenAI-compatible, `ip:port,...`: vLLM, llama.cpp,
    /// ...) instead of simulated ones. Each cell then plays `--turns`
    /// turns of every agent's conversation through `hearth-bench real`'s
    /// client, in wall-clock time; `--scenario`, `--replicas`,
    /// `--max-running`, `--seconds` and `--time-scale` do not apply (the
    /// engines' own size does: vLLM's `--max-num-seqs`).
    #[arg(long, value_delimiter = ',')]
    pub engines: Vec<std::net::SocketAddr>,
    /// Real engines: the model to ask for (default: the first one the
    /// first engine lists that every engine lists).
    #[arg(long)]
    pub model: Option<String>,
    /// Real engines: turns of each agent's conversation in a cell.
    #[arg(long, default_value_t = 8)]
    pub turns: usize,
    /// Real engines: `max_tokens` of every answer.
    #[arg(long, default_value_t = 32)]
    pub max_tokens: u32,
    /// Real engines: mean pause between an agent's turns, in milliseconds.
    #[arg(long, default_value_t = 500)]
    pub think_ms: u64,
    /// Real engines: empty every engine's prefix cache before each cell
    /// (`POST /reset_prefix_cache`: vLLM as `hearth-bench vllm` starts it).
    #[arg(long)]
    pub reset_caches: bool,
}

/// Who an agent sends for; its turns are counted under its class.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Class {
    Quiet,
    Noisy,
    High,
    Sheddable,
}

impl Class {
    fn index(self) -> usize {
        self as usize
    }

    pub fn name(self) -> &'static str {
        match self {
            Class::Quiet => "quiet",
            Class::Noisy => "noisy",
            Class::High => "high",
            Class::Sheddable => "sheddable",
        }
    }
}

/// Which agents a cell runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mix {
    /// The noisy tenant beside the quiet ones.
    Tenants,
    /// The quiet tenants alone: the reference for their TTFT.
    QuietAlone,
    /// The high band while sheddable load runs.
    Priority,
    /// The high band alone: its unloaded figure.
    HighAlone,
}

impl Mix {
    pub fn name(self) -> &'static str {
        match self {
            Mix::Tenants => "tenants",
            Mix::QuietAlone => "quiet alone",
            Mix::Priority => "priority",
            Mix::HighAlone => "high alone",
        }
    }

    fn classes(self) -> &'static [Class] {
        match self {
            Mix::Tenants => &[Class::Quiet, Class::Noisy],
            Mix::QuietAlone => &[Class::Quiet],
            Mix::Priority => &[Class::High, Class::Sheddable],
            Mix::HighAlone => &[Class::High],
        }
    }
}

/// What routes a cell's requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum Setup {
    /// Plain Envoy, `LEAST_REQUEST`.
    LeastRequest,
    /// Hearth with `HEARTH_FLOW_CONTROL=false`.
    HearthNoFlowControl,
    /// Hearth with flow control (the default).
    HearthFlowControl,
    /// smg 1.13.0 with its priority scheduler
    /// ([`LivePolicy::SmgPriority`]), the real peer.
    SmgPriority,
}

impl Setup {
    const ALL: [Setup; 4] = [
        Setup::LeastRequest,
        Setup::HearthNoFlowControl,
        Setup::HearthFlowControl,
        Setup::SmgPriority,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Setup::LeastRequest => "least_request",
            Setup::HearthNoFlowControl => "hearth, no flow control",
            Setup::HearthFlowControl => "hearth, flow control",
            Setup::SmgPriority => "smg, priority scheduler",
        }
    }

    fn policy(self) -> LivePolicy {
        match self {
            Setup::LeastRequest => LivePolicy::LeastRequest,
            Setup::HearthNoFlowControl | Setup::HearthFlowControl => LivePolicy::Hearth,
            Setup::SmgPriority => LivePolicy::SmgPriority,
        }
    }

    /// The sidecar's settings in this setup, given every Hearth cell's
    /// (none for plain Envoy or a peer).
    fn settings(self, hearth: &[(String, String)]) -> Vec<(String, String)> {
        let flow = match self {
            Setup::LeastRequest | Setup::SmgPriority => return Vec::new(),
            Setup::HearthNoFlowControl => "false",
            Setup::HearthFlowControl => "true",
        };
        let mut settings = hearth.to_vec();
        settings.push(("HEARTH_FLOW_CONTROL".into(), flow.into()));
        settings
    }
}

/// The cells of a run, in order: each mix under each setup, then the
/// references under Hearth with flow control.
pub const CELLS: [(Mix, Setup); 10] = [
    (Mix::Tenants, Setup::LeastRequest),
    (Mix::Tenants, Setup::HearthNoFlowControl),
    (Mix::Tenants, Setup::HearthFlowControl),
    (Mix::Tenants, Setup::SmgPriority),
    (Mix::QuietAlone, Setup::HearthFlowControl),
    (Mix::Priority, Setup::LeastRequest),
    (Mix::Priority, Setup::HearthNoFlowControl),
    (Mix::Priority, Setup::HearthFlowControl),
    (Mix::Priority, Setup::SmgPriority),
    (Mix::HighAlone, Setup::HearthFlowControl),
];

/// One agent of a mix: its client's index in the workload (the same
/// agent has the same index, so the same conversations, in every mix),
/// its class and the headers it sends.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Planned {
    pub index: u64,
    pub class: Class,
    pub headers: Vec<(String, String)>,
}

/// smg's priority class for one of the objectives: the high band is
/// `interactive`, the sheddable one `bulk` (smg's lowest).
fn smg_class(objective: &str) -> &'static str {
    if objective == HIGH_OBJECTIVE {
        "interactive"
    } else {
        "bulk"
    }
}

/// The agents of `mix`.
pub fn plan(mix: Mix, args: &TenantsArgs) -> Vec<Planned> {
    let mut out = Vec::new();
    let mut next = 0u64;
    let mut add = |class: Class, count: usize, tenant: String, objective: Option<&str>| {
        for _ in 0..count {
            let mut headers = vec![(FAIRNESS_ID.to_string(), tenant.clone())];
            if let Some(o) = objective {
                headers.push((OBJECTIVE.to_string(), o.to_string()));
                headers.push((SMG_PRIORITY_HEADER.to_string(), smg_class(o).to_string()));
            }
            if mix.classes().contains(&class) {
                out.push(Planned {
                    index: next,
                    class,
                    headers,
                });
            }
            next += 1;
        }
    };
    // Every class is numbered in every mix, so an agent's index does not
    // depend on which others run.
    for t in 0..args.quiet_tenants {
        add(Class::Quiet, args.quiet_agents, format!("quiet-{t}"), None);
    }
    add(Class::Noisy, args.noisy_agents, "noisy".into(), None);
    add(
        Class::High,
        args.high_agents,
        HIGH_OBJECTIVE.into(),
        Some(HIGH_OBJECTIVE),
    );
    add(
        Class::Sheddable,
        args.sheddable_agents,
        SHEDDABLE_OBJECTIVE.into(),
        Some(SHEDDABLE_OBJECTIVE),
    );
    out
}

/// One class's figures in one cell (times in engine seconds).
#[derive(Clone, Debug, Serialize)]
pub struct ClassRow {
    pub mix: Mix,
    pub setup: Setup,
    /// None: every class of the cell together.
    pub class: Option<Class>,
    pub agents: usize,
    pub turns: usize,
    pub turns_per_min: f64,
    pub ttft_p50_s: f64,
    pub ttft_p90_s: f64,
    pub ttft_p99_s: f64,
    pub cached_fraction: f64,
    /// Measured turns refused with 429.
    pub rate_limited: u64,
    /// Measured turns that failed otherwise.
    pub other_failures: usize,
}

/// The figures of `records` (the measured turns of `agents` agents over
/// `duration_s` engine seconds on `replicas` replicas).
fn class_row(
    (mix, setup): (Mix, Setup),
    class: Option<Class>,
    agents: usize,
    records: Vec<RequestRecord>,
    rate_limited: u64,
    replicas: usize,
    duration_s: f64,
) -> ClassRow {
    let run = RunResult {
        policy: setup.policy().simulated(),
        agents,
        replicas,
        duration_s,
        records,
        mean_inflight: vec![0.0; replicas],
        long_unfinished: 0,
        corrections: None,
    };
    let row = run.row(mix.name(), "live");
    ClassRow {
        mix,
        setup,
        class,
        agents,
        turns: row.turns,
        turns_per_min: row.turns_per_min,
        ttft_p50_s: row.ttft_p50_s,
        ttft_p90_s: row.ttft_p90_s,
        ttft_p99_s: row.ttft_p99_s,
        cached_fraction: row.cached_fraction,
        rate_limited,
        other_failures: row.failures - rate_limited as usize,
    }
}

/// A ratio issue 33 sets a goal on, per setup where it applies.
#[derive(Clone, Debug, Serialize)]
pub struct Ratio {
    pub what: &'static str,
    /// The measured ratio under each setup (None: not measured).
    pub values: Vec<(Setup, Option<f64>)>,
    /// The goal: at most this (`at_most`) or at least this.
    pub goal: f64,
    pub at_most: bool,
    /// Whether Hearth with flow control meets it.
    pub met: Option<bool>,
}

/// Issue 33's ratios from a run's rows.
pub fn ratios(rows: &[ClassRow]) -> Vec<Ratio> {
    let find = |mix: Mix, setup: Setup, class: Option<Class>| {
        rows.iter()
            .find(|r| r.mix == mix && r.setup == setup && r.class == class)
    };
    let div = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 && a.is_finite() && b.is_finite() => Some(a / b),
        _ => None,
    };
    let p90 = |mix, setup, class| find(mix, setup, Some(class)).map(|r| r.ttft_p90_s);
    let quiet_alone = p90(Mix::QuietAlone, Setup::HearthFlowControl, Class::Quiet);
    let high_alone = p90(Mix::HighAlone, Setup::HearthFlowControl, Class::High);
    let ratio = |what, values: Vec<(Setup, Option<f64>)>, goal, at_most| {
        let flow = values
            .iter()
            .find(|(s, _)| *s == Setup::HearthFlowControl)
            .and_then(|(_, v)| *v);
        Ratio {
            what,
            values,
            goal,
            at_most,
            met: flow.map(|v| if at_most { v <= goal } else { v >= goal }),
        }
    };
    let per_setup = |f: &dyn Fn(Setup) -> Option<f64>| {
        Setup::ALL.iter().map(|&s| (s, f(s))).collect::<Vec<_>>()
    };
    let total = |setup, f: fn(&ClassRow) -> f64| find(Mix::Tenants, setup, None).map(f);
    let vs_no_flow = |f: fn(&ClassRow) -> f64| {
        [Setup::HearthFlowControl, Setup::SmgPriority]
            .map(|s| (s, div(total(s, f), total(Setup::HearthNoFlowControl, f))))
            .to_vec()
    };
    vec![
        ratio(
            "quiet tenants' TTFT p90, noisy tenant present / absent",
            per_setup(&|s| div(p90(Mix::Tenants, s, Class::Quiet), quiet_alone)),
            1.5,
            true,
        ),
        ratio(
            "high band's TTFT p90, sheddable load / none",
            per_setup(&|s| div(p90(Mix::Priority, s, Class::High), high_alone)),
            1.2,
            true,
        ),
        ratio(
            "total turns/min (tenants mix) / Hearth without flow control",
            vs_no_flow(|r| r.turns_per_min),
            0.95,
            false,
        ),
        ratio(
            "cached share (tenants mix) / Hearth without flow control",
            vs_no_flow(|r| r.cached_fraction),
            0.95,
            false,
        ),
    ]
}

/// The rows as a Markdown table.
pub fn markdown(rows: &[ClassRow]) -> String {
    let mut out = String::from(
        "| mix | setup | class | agents | turns/min | TTFT p50 / p90 / p99 (s) | cached | 429s | other failures |\n\
         | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |\n",
    );
    for r in rows {
        out.push_str(&format!(
            "| {} | {} | {} | {} | {:.1} | {:.2} / {:.2} / {:.2} | {:.1}% | {} | {} |\n",
            r.mix.name(),
            r.setup.name(),
            r.class.map_or("all", Class::name),
            r.agents,
            r.turns_per_min,
            r.ttft_p50_s,
            r.ttft_p90_s,
            r.ttft_p99_s,
            r.cached_fraction * 100.0,
            r.rate_limited,
            r.other_failures,
        ));
    }
    out
}

/// The ratios as a Markdown table: one column per setup, the goal, and
/// whether Hearth with flow control meets it.
pub fn ratios_markdown(ratios: &[Ratio]) -> String {
    let mut out = String::from("| ratio |");
    for s in Setup::ALL {
        out.push_str(&format!(" {} |", s.name()));
    }
    out.push_str(" goal | met (flow control) |\n| --- |");
    out.push_str(&" ---: |".repeat(Setup::ALL.len() + 2));
    out.push('\n');
    for r in ratios {
        out.push_str(&format!("| {} |", r.what));
        for s in Setup::ALL {
            let v = r.values.iter().find(|(x, _)| *x == s).and_then(|(_, v)| *v);
            out.push_str(&v.map_or(" - |".into(), |v| format!(" {v:.2}x |")));
        }
        out.push_str(&format!(
            " {} {:.2}x | {} |\n",
            if r.at_most { "<=" } else { ">=" },
            r.goal,
            match r.met {
                Some(true) => "yes",
                Some(false) => "no",
                None => "-",
            }
        ));
    }
    out
}

/// The scenario the cells run: the preset's workload and cache, with the
/// command line's replicas, engine size and windows.
fn scenario(args: &TenantsArgs) -> anyhow::Result<(Scenario, Duration, Duration)> {
    anyhow::ensure!(
        args.replicas > 0 && args.max_running > 0,
        "--replicas and --max-running must be at least 1"
    );
    let mut sc = live::preset(&args.scenario)?;
    sc.replicas = args.replicas;
    sc.engine.cost.max_running = args.max_running;
    let (wall, warmup) = live::windows(&mut sc, args.seconds, args.time_scale)?;
    Ok((sc, wall, warmup))
}

/// Every Hearth cell's settings: the scenario's, the objectives, the
/// scrape interval, the flow control's default waits in engine time
/// (the sidecar's clock is the wall's: its 2 s affinity wait, 60 s time
/// to live and prefill seconds divided by the time scale), then the
/// command line's (wall seconds).
fn hearth_settings(args: &TenantsArgs, sc: &Scenario) -> Vec<(String, String)> {
    let mut settings = sc.hearth.settings().to_vec();
    settings.push(("HEARTH_FLOW_OBJECTIVES".into(), OBJECTIVES.into()));
    settings.push((
        "HEARTH_ENGINE_METRICS_SECONDS".into(),
        args.scrape_seconds.to_string(),
    ));
    let defaults = crate::settings::parse(&[]).expect("the sidecar's defaults parse");
    for (name, engine_s) in [
        (
            "HEARTH_FLOW_AFFINITY_WAIT_SECONDS",
            defaults.flow_affinity_wait_seconds,
        ),
        ("HEARTH_FLOW_TTL_SECONDS", defaults.flow_ttl_seconds),
        ("HEARTH_FLOW_PREFILL_SECONDS", defaults.flow_prefill_seconds),
    ] {
        settings.push((name.into(), format!("{:.3}", engine_s / args.time_scale)));
    }
    settings.extend(args.sidecar.set.iter().cloned());
    settings
}

/// `hearth-bench tenants ...` as run (settings shown, credentials hidden).
fn command(args: &TenantsArgs) -> String {
    format!(
        "hearth-bench tenants --scenario {} --replicas {} --max-running {} --quiet-tenants {} \
         --quiet-agents {} --noisy-agents {} --high-agents {} --sheddable-agents {} --seconds {} \
         --time-scale {} --scrape-seconds {} --seed {}{}{}",
        args.scenario,
        args.replicas,
        args.max_running,
        args.quiet_tenants,
        args.quiet_agents,
        args.noisy_agents,
        args.high_agents,
        args.sheddable_agents,
        args.seconds,
        args.time_scale,
        args.scrape_seconds,
        args.seed,
        selection(args),
        args.sidecar.shown(),
    )
}

/// The command line's choice of cells (`--mix`, `--setups`), as given.
fn selection(args: &TenantsArgs) -> String {
    let mut out = args
        .mix
        .as_deref()
        .map(|m| format!(" --mix {m}"))
        .unwrap_or_default();
    if !args.setups.is_empty() {
        let names: Vec<String> = args
            .setups
            .iter()
            .filter_map(|s| s.to_possible_value().map(|v| v.get_name().to_string()))
            .collect();
        out.push_str(&format!(" --setups {}", names.join(",")));
    }
    out
}

/// One cell on fresh engines: a row per class, then one for them all.
async fn run_cell(
    cell: (Mix, Setup),
    args: &TenantsArgs,
    sc: &Scenario,
    hearth: &[(String, String)],
    (wall, warmup): (Duration, Duration),
) -> anyhow::Result<Cell> {
    let (mix, setup) = cell;
    let configs = live::engine_configs(sc, args.time_scale);
    let serving = Serving::start(
        setup.policy(),
        configs,
        setup.settings(hearth),
        PEER_DEADLINE,
    )
    .await?;
    let generator = Generator::new(
        sc.workload.clone(),
        live::MODEL,
        args.seed,
        live::salt_for(args.seed),
    );
    let planned = plan(mix, args);
    let agents = planned
        .iter()
        .map(|p| Agent {
            client: generator.client(p.index),
            headers: p.headers.clone(),
            class: p.class.index(),
        })
        .collect();
    let url = format!("{}/v1/chat/completions", serving.url());
    let driven = live::drive_agents(
        &url,
        serving.engines(),
        agents,
        args.time_scale,
        wall,
        warmup,
    )
    .await;
    let waits = match serving.stack() {
        Some(stack) if setup.policy() == LivePolicy::Hearth => {
            let (status, text) = stack.admin_get("/metrics").await?;
            anyhow::ensure!(status == 200, "the sidecar's /metrics answered {status}");
            Some(queue_waits(&text, args.time_scale))
        }
        _ => None,
    };
    let peer_command = serving.peer_command();
    serving.shutdown().await;
    let row = |class: Option<Class>, agents, records, limited| {
        class_row(
            cell,
            class,
            agents,
            records,
            limited,
            sc.replicas,
            sc.duration_s,
        )
    };
    let mut rows: Vec<ClassRow> = mix
        .classes()
        .iter()
        .map(|&c| {
            let agents = planned.iter().filter(|p| p.class == c).count();
            row(
                Some(c),
                agents,
                driven.of_class(c.index()),
                driven.rate_limited.get(c.index()).copied().unwrap_or(0),
            )
        })
        .collect();
    rows.push(row(
        None,
        planned.len(),
        driven.records.iter().map(|(_, r)| r.clone()).collect(),
        driven.rate_limited.iter().sum(),
    ));
    Ok(Cell {
        rows,
        waits,
        peer_command,
        turns: None,
    })
}

/// What one cell measured: its rows, and for Hearth the flow queue's
/// dispatches.
struct Cell {
    rows: Vec<ClassRow>,
    waits: Option<QueueWaits>,
    /// A peer router's command line, as started.
    peer_command: Option<String>,
    /// On real engines, every turn with its agent's class (for the JSON).
    turns: Option<serde_json::Value>,
}

/// The requests that left the sidecar's flow queue for a replica over a
/// whole cell (warm-up included), and their mean wait there: every band
/// together, and each band apart.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct QueueWaits {
    pub dispatched: u64,
    /// In engine seconds.
    pub mean_wait_s: f64,
    /// Each band's (its priority's) share of the figures above, highest
    /// band first.
    pub bands: Vec<BandWaits>,
}

/// One priority band's dispatches from the flow queue.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct BandWaits {
    pub priority: i32,
    pub dispatched: u64,
    /// In engine seconds.
    pub mean_wait_s: f64,
}

/// [`QueueWaits`] from the sidecar's `/metrics` text, waits scaled from
/// the sidecar's wall clock to engine time.
pub fn queue_waits(metrics: &str, scale: f64) -> QueueWaits {
    const NAME: &str = "llm_d_epp_flow_control_request_queue_duration_seconds";
    // (count, sum) by band, of the dispatched requests.
    let mut by_band: std::collections::BTreeMap<i32, (f64, f64)> = Default::default();
    for (suffix, slot) in [("_count", 0), ("_sum", 1)] {
        let prefix = format!("{NAME}{suffix}{{");
        for line in metrics.lines().filter(|l| l.starts_with(&prefix)) {
            if !line.contains("outcome=\"Dispatched\"") {
                continue;
            }
            let band = line
                .split("priority=\"")
                .nth(1)
                .and_then(|rest| rest.split('"').next())
                .and_then(|p| p.parse::<i32>().ok());
            let value = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok());
            if let (Some(band), Some(value)) = (band, value) {
                let entry = by_band.entry(band).or_default();
                if slot == 0 {
                    entry.0 += value;
                } else {
                    entry.1 += value;
                }
            }
        }
    }
    let mean = |count: f64, sum: f64| {
        if count > 0.0 {
            sum / count * scale
        } else {
            0.0
        }
    };
    let (count, sum) = by_band
        .values()
        .fold((0.0, 0.0), |(c, s), &(bc, bs)| (c + bc, s + bs));
    QueueWaits {
        dispatched: count as u64,
        mean_wait_s: mean(count, sum),
        bands: by_band
            .iter()
            .rev()
            .map(|(&priority, &(count, sum))| BandWaits {
                priority,
                dispatched: count as u64,
                mean_wait_s: mean(count, sum),
            })
            .collect(),
    }
}

/// The cells `--mix` and `--setups` choose, in [`CELLS`]' order (the
/// reference cells of a chosen mix whichever setups are).
fn chosen_cells(args: &TenantsArgs) -> Vec<(Mix, Setup)> {
    let mix_chosen = |mix: Mix| match args.mix.as_deref() {
        Some("tenants") => matches!(mix, Mix::Tenants | Mix::QuietAlone),
        Some("priority") => matches!(mix, Mix::Priority | Mix::HighAlone),
        _ => true,
    };
    let setup_chosen = |(mix, setup): (Mix, Setup)| {
        let reference = matches!(mix, Mix::QuietAlone | Mix::HighAlone);
        reference || args.setups.is_empty() || args.setups.contains(&setup)
    };
    CELLS
        .into_iter()
        .filter(|&(mix, setup)| mix_chosen(mix) && setup_chosen((mix, setup)))
        .collect()
}

/// What the cells run on.
enum Fleet {
    /// Simulated engines, started afresh for each cell.
    Simulated {
        sc: Box<Scenario>,
        windows: (Duration, Duration),
    },
    /// The engines of `--engines`.
    Engines(on_engines::Engines),
}

impl Fleet {
    /// `hearth-bench tenants ...` as this run was given (settings shown,
    /// credentials hidden; on engines, with the model asked for).
    fn command(&self, args: &TenantsArgs) -> String {
        match self {
            Fleet::Simulated { .. } => command(args),
            Fleet::Engines(engines) => engines.command(args),
        }
    }

    async fn run_cell(
        &self,
        cell: (Mix, Setup),
        args: &TenantsArgs,
        hearth: &[(String, String)],
    ) -> anyhow::Result<Cell> {
        match self {
            Fleet::Simulated { sc, windows } => run_cell(cell, args, sc, hearth, *windows).await,
            Fleet::Engines(engines) => engines.run_cell(cell, args, hearth).await,
        }
    }
}

pub async fn run(args: TenantsArgs) -> anyhow::Result<()> {
    let (fleet, hearth) = if args.engines.is_empty() {
        let (sc, wall, warmup) = scenario(&args)?;
        let hearth = hearth_settings(&args, &sc);
        (
            Fleet::Simulated {
                sc: Box::new(sc),
                windows: (wall, warmup),
            },
            hearth,
        )
    } else {
        let hearth = on_engines::hearth_settings(&args);
        (
            Fleet::Engines(on_engines::Engines::of(&args).await?),
            hearth,
        )
    };
    // A bad setting fails before anything starts.
    crate::settings::parse(&Setup::HearthFlowControl.settings(&hearth))?;
    println!("{}", fleet.command(&args));
    println!("{}", crate::provenance::header());
    match &fleet {
        Fleet::Simulated { sc, windows } => {
            println!(
                "# {} replicas of {} running sequences each, {} s per cell ({} s warm-up), time scale {}, seed {}",
                sc.replicas,
                args.max_running,
                args.seconds,
                windows.1.as_secs(),
                args.time_scale,
                args.seed
            );
        }
        Fleet::Engines(engines) => engines.describe(&args),
    }
    println!(
        "# hearth settings: {}",
        hearth
            .iter()
            .map(crate::settings::shown_setting)
            .collect::<Vec<_>>()
            .join(" ")
    );
    let mut rows = Vec::new();
    let mut queued = Vec::new();
    let mut peers = Vec::new();
    let mut turns = serde_json::Map::new();
    // A peer router that is not installed (`HEARTH_SETUP_PEERS=0`) is
    // skipped, not fatal, as in `live`.
    let (_, mut skipped) = live::runnable(&Setup::ALL.map(Setup::policy), PeerKind::find);
    // On real engines, smg answers only the model each engine lists first.
    if let Fleet::Engines(engines) = &fleet {
        let smg = Setup::SmgPriority.policy();
        if skipped.iter().all(|(p, _)| *p != smg) {
            if let Some(why) = engines.smg_cannot_serve(&args).await {
                skipped.push((smg, why));
            }
        }
    }
    for (policy, why) in &skipped {
        println!("# skipped {}: {why}", policy.name());
    }
    let runs = |setup: Setup| skipped.iter().all(|(p, _)| *p != setup.policy());
    for (mix, setup) in chosen_cells(&args).into_iter().filter(|&(_, s)| runs(s)) {
        let name = format!("{} under {}", mix.name(), setup.name());
        eprintln!("hearth-bench tenants: running {name}");
        let cell = fleet
            .run_cell((mix, setup), &args, &hearth)
            .await
            .with_context(|| name.clone())?;
        rows.extend(cell.rows);
        if let Some(t) = cell.turns {
            turns.insert(name.clone(), t);
        }
        if let Some(command) = cell.peer_command {
            peers.push((name.clone(), command));
        }
        if let Some(w) = cell.waits {
            queued.push((name, w));
        }
    }
    let ratios = ratios(&rows);
    println!("{}", markdown(&rows));
    println!("{}", ratios_markdown(&ratios));
    let unit = match fleet {
        Fleet::Simulated { .. } => "engine time",
        Fleet::Engines(_) => "wall time",
    };
    for (name, command) in &peers {
        println!("# {name}: {command}");
    }
    for (name, w) in &queued {
        let bands: Vec<String> = w
            .bands
            .iter()
            .map(|b| {
                format!(
                    "band {}: {} after {:.2} s",
                    b.priority, b.dispatched, b.mean_wait_s
                )
            })
            .collect();
        println!(
            "# {name}: {} requests left the flow queue for a replica, after {:.2} s there on average ({unit}, warm-up included){}",
            w.dispatched,
            w.mean_wait_s,
            if bands.is_empty() {
                String::new()
            } else {
                format!(" ({})", bands.join("; "))
            }
        );
    }
    if let Some(path) = &args.json {
        let described = match &fleet {
            Fleet::Simulated { sc, .. } => serde_json::json!({ "scenario": sc }),
            Fleet::Engines(engines) => engines.json(&args),
        };
        let mut doc = serde_json::json!({
            "command": fleet.command(&args),
            "build": crate::provenance::json(),
            "argv": std::env::args().collect::<Vec<_>>().join(" "),
            "seed": args.seed,
            "hearth_settings": hearth
                .iter()
                .map(crate::settings::shown_setting)
                .collect::<Vec<_>>(),
            "rows": rows,
            "ratios": ratios,
            "flow_queue": queued
                .iter()
                .map(|(name, w)| (name.clone(), w.clone()))
                .collect::<std::collections::BTreeMap<_, _>>(),
            "peer_commands": peers
                .iter()
                .cloned()
                .collect::<std::collections::BTreeMap<_, _>>(),
        });
        if !turns.is_empty() {
            doc["records"] = serde_json::Value::Object(turns);
        }
        // The scenario, or the engines and their model, beside the rest.
        if let (Some(doc), serde_json::Value::Object(described)) = (doc.as_object_mut(), described)
        {
            doc.extend(described);
        }
        std::fs::write(path, serde_json::to_vec_pretty(&doc)?)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cmd {
        #[command(flatten)]
        args: TenantsArgs,
    }

    /// `hearth-bench tenants` with `flags`, as the command line parses it.
    pub(super) fn parsed(flags: &[&str]) -> TenantsArgs {
        let argv = std::iter::once("tenants").chain(flags.iter().copied());
        Cmd::try_parse_from(argv).unwrap().args
    }

    fn args() -> TenantsArgs {
        parsed(&[])
    }

    fn header<'a>(p: &'a Planned, name: &str) -> Option<&'a str> {
        p.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    #[test]
    fn mix_and_setups_choose_the_cells_and_the_references_always_run() {
        assert_eq!(chosen_cells(&parsed(&[])), CELLS.to_vec());
        let args = parsed(&[
            "--mix",
            "priority",
            "--setups",
            "hearth_flow_control,smg_priority",
        ]);
        assert_eq!(
            chosen_cells(&args),
            [
                (Mix::Priority, Setup::HearthFlowControl),
                (Mix::Priority, Setup::SmgPriority),
                (Mix::HighAlone, Setup::HearthFlowControl),
            ]
        );
        assert!(
            command(&args).contains(" --mix priority --setups hearth_flow_control,smg_priority"),
            "{}",
            command(&args)
        );
        let only = parsed(&["--setups", "least_request"]);
        assert_eq!(
            chosen_cells(&only),
            [
                (Mix::Tenants, Setup::LeastRequest),
                (Mix::QuietAlone, Setup::HearthFlowControl),
                (Mix::Priority, Setup::LeastRequest),
                (Mix::HighAlone, Setup::HearthFlowControl),
            ]
        );
    }

    #[test]
    fn the_noisy_tenant_has_its_ratio_of_each_quiet_ones_agents() {
        let a = args();
        let mixed = plan(Mix::Tenants, &a);
        let noisy = mixed.iter().filter(|p| p.class == Class::Noisy).count();
        assert_eq!(noisy, a.noisy_agents);
        let mut tenants = std::collections::BTreeMap::<&str, usize>::new();
        for p in mixed.iter().filter(|p| p.class == Class::Quiet) {
            *tenants.entry(header(p, FAIRNESS_ID).unwrap()).or_default() += 1;
            assert_eq!(header(p, OBJECTIVE), None);
        }
        assert_eq!(tenants.len(), a.quiet_tenants);
        assert!(tenants.values().all(|&n| n * 8 == noisy), "{tenants:?}");
        assert!(mixed
            .iter()
            .filter(|p| p.class == Class::Noisy)
            .all(|p| header(p, FAIRNESS_ID) == Some("noisy")));
    }

    #[test]
    fn a_reference_mix_runs_the_same_agents_without_the_others() {
        let a = args();
        let quiet: Vec<Planned> = plan(Mix::Tenants, &a)
            .into_iter()
            .filter(|p| p.class == Class::Quiet)
            .collect();
        assert_eq!(plan(Mix::QuietAlone, &a), quiet);
        let high: Vec<Planned> = plan(Mix::Priority, &a)
            .into_iter()
            .filter(|p| p.class == Class::High)
            .collect();
        assert_eq!(high.len(), a.high_agents);
        assert_eq!(plan(Mix::HighAlone, &a), high);
        assert!(high
            .iter()
            .all(|p| header(p, OBJECTIVE) == Some(HIGH_OBJECTIVE)));
        // The same classes for the peer, in its own header.
        assert!(high
            .iter()
            .all(|p| header(p, SMG_PRIORITY_HEADER) == Some("interactive")));
        let shed = plan(Mix::Priority, &a);
        let shed: Vec<&Planned> = shed
            .iter()
            .filter(|p| p.class == Class::Sheddable)
            .collect();
        assert_eq!(shed.len(), a.sheddable_agents);
        assert!(shed
            .iter()
            .all(|p| header(p, OBJECTIVE) == Some(SHEDDABLE_OBJECTIVE)
                && header(p, SMG_PRIORITY_HEADER) == Some("bulk")));
        assert!(plan(Mix::Tenants, &a)
            .iter()
            .all(|p| header(p, SMG_PRIORITY_HEADER).is_none()));
        // No two agents of a run share conversations.
        let mut all: Vec<u64> = [Mix::Tenants, Mix::Priority]
            .iter()
            .flat_map(|&m| plan(m, &a))
            .map(|p| p.index)
            .collect();
        let n = all.len();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), n);
    }

    #[test]
    fn the_objectives_give_the_high_band_priority_and_shed_the_other() {
        let settings = Setup::HearthFlowControl
            .settings(&[("HEARTH_FLOW_OBJECTIVES".into(), OBJECTIVES.into())]);
        let parsed = crate::settings::parse(&settings).unwrap();
        let objectives = parsed.flow_objectives.unwrap();
        assert!(objectives.priority(Some(HIGH_OBJECTIVE)) > 0);
        assert!(objectives.priority(Some(SHEDDABLE_OBJECTIVE)) < 0);
        assert!(parsed.flow_control);
        let off = Setup::HearthNoFlowControl.settings(&[]);
        assert!(!crate::settings::parse(&off).unwrap().flow_control);
        assert!(Setup::LeastRequest.settings(&settings).is_empty());
        assert!(Setup::SmgPriority.settings(&settings).is_empty());
    }

    #[test]
    fn the_queue_waits_are_the_dispatched_ones_of_every_band_in_engine_time() {
        let text = "\
# HELP llm_d_epp_flow_control_request_queue_duration_seconds Time requests spent.
llm_d_epp_flow_control_request_queue_duration_seconds_sum{priority=\"0\",outcome=\"Dispatched\"} 1.5
llm_d_epp_flow_control_request_queue_duration_seconds_count{priority=\"0\",outcome=\"Dispatched\"} 3
llm_d_epp_flow_control_request_queue_duration_seconds_bucket{priority=\"0\",outcome=\"Dispatched\",le=\"1.0\"} 3
llm_d_epp_flow_control_request_queue_duration_seconds_sum{priority=\"10\",outcome=\"Dispatched\"} 0.5
llm_d_epp_flow_control_request_queue_duration_seconds_count{priority=\"10\",outcome=\"Dispatched\"} 1
llm_d_epp_flow_control_request_queue_duration_seconds_sum{priority=\"-1\",outcome=\"RejectedCapacity\"} 0
llm_d_epp_flow_control_request_queue_duration_seconds_count{priority=\"-1\",outcome=\"RejectedCapacity\"} 7
";
        let w = queue_waits(text, 5.0);
        assert_eq!(w.dispatched, 4);
        assert!((w.mean_wait_s - 2.5).abs() < 1e-9, "{w:?}");
        let bands: Vec<(i32, u64)> = w.bands.iter().map(|b| (b.priority, b.dispatched)).collect();
        assert_eq!(bands, [(10, 1), (0, 3)], "{w:?}");
        assert!((w.bands[0].mean_wait_s - 2.5).abs() < 1e-9, "{w:?}");
        assert!((w.bands[1].mean_wait_s - 2.5).abs() < 1e-9, "{w:?}");
        assert_eq!(queue_waits("", 5.0).dispatched, 0);
    }

    fn record(ttft_s: f64, cached: u32, failed: bool) -> RequestRecord {
        RequestRecord {
            replica: 0,
            sent_s: 1.0,
            ttft_s,
            e2e_s: ttft_s + 1.0,
            prompt_tokens: 100,
            cached_tokens: cached,
            ideal_cached_tokens: cached,
            output_tokens: 10,
            stayed: None,
            restart: false,
            long: false,
            failed,
            predicted_cached_tokens: None,
        }
    }

    #[test]
    fn a_class_row_counts_refusals_apart_from_answers() {
        let records = vec![
            record(1.0, 90, false),
            record(2.0, 50, false),
            record(0.0, 0, true),
            record(0.0, 0, true),
        ];
        let row = class_row(
            (Mix::Priority, Setup::HearthFlowControl),
            Some(Class::Sheddable),
            3,
            records,
            1,
            2,
            60.0,
        );
        assert_eq!(row.turns, 2);
        assert_eq!(row.turns_per_min, 2.0);
        assert_eq!(row.cached_fraction, 0.7);
        assert_eq!(row.rate_limited, 1);
        assert_eq!(row.other_failures, 1);
        assert_eq!(row.ttft_p99_s, 2.0);
    }

    fn row(mix: Mix, setup: Setup, class: Option<Class>, p90: f64, turns: f64) -> ClassRow {
        ClassRow {
            mix,
            setup,
            class,
            agents: 1,
            turns: 1,
            turns_per_min: turns,
            ttft_p50_s: 0.0,
            ttft_p90_s: p90,
            ttft_p99_s: 0.0,
            cached_fraction: 0.9,
            rate_limited: 0,
            other_failures: 0,
        }
    }

    #[test]
    fn the_ratios_compare_with_the_reference_cells_and_judge_flow_control() {
        use Class::*;
        use Mix::*;
        use Setup::*;
        let rows = vec![
            row(Tenants, LeastRequest, Some(Quiet), 4.0, 0.0),
            row(Tenants, HearthNoFlowControl, Some(Quiet), 3.0, 0.0),
            row(Tenants, HearthNoFlowControl, None, 0.0, 100.0),
            row(Tenants, HearthFlowControl, Some(Quiet), 1.4, 0.0),
            row(Tenants, HearthFlowControl, None, 0.0, 90.0),
            row(QuietAlone, HearthFlowControl, Some(Quiet), 1.0, 0.0),
            row(Priority, HearthFlowControl, Some(High), 1.5, 0.0),
            row(HighAlone, HearthFlowControl, Some(High), 1.0, 0.0),
        ];
        let r = ratios(&rows);
        assert_eq!(
            r[0].values,
            [
                (LeastRequest, Some(4.0)),
                (HearthNoFlowControl, Some(3.0)),
                (HearthFlowControl, Some(1.4)),
                (SmgPriority, None)
            ]
        );
        assert_eq!(r[0].met, Some(true));
        assert_eq!(r[1].values[0], (LeastRequest, None));
        assert_eq!(r[1].met, Some(false));
        assert_eq!(
            r[2].values,
            [(HearthFlowControl, Some(0.9)), (SmgPriority, None)]
        );
        assert_eq!(r[2].met, Some(false));
        assert_eq!(r[3].met, Some(true));
        let md = ratios_markdown(&r);
        assert!(
            md.contains("| 4.00x | 3.00x | 1.40x | - | <= 1.50x | yes |"),
            "{md}"
        );
    }
}

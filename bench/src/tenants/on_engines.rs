//! `hearth-bench tenants --engines A,B,...`: the same cells in front of
//! real engines (two CPU vLLM replicas as `hearth-bench vllm
//! --max-num-seqs 4` starts them, or an operator's own), driven by
//! `hearth-bench real`'s client.
//!
//! Each agent plays one conversation of `--turns` turns, re-sending its
//! whole history every turn, with its tenant's fairness id and objective;
//! the agent's index picks its conversation's timing, so the quiet
//! tenants start and pause alike in the tenants cell and in their
//! reference cell. Every cell's prompts carry a salt of their own, so no
//! cell finds another's in the engines' caches (`--reset-caches` also
//! empties them between cells). Wall-clock time throughout: the flow
//! control's waits are the sidecar's own defaults, and there is no
//! warm-up (every cell's first turns are cold alike).

use std::collections::HashMap;

use anyhow::Context;
use serde_json::{json, Value};

use super::{plan, queue_waits, Cell, Class, ClassRow, Mix, Setup, TenantsArgs, CELLS, OBJECTIVES};
use crate::real::{self, Driver, RealArgs, Shape, TurnRecord, Workload};
use crate::rng::Rng;
use crate::settings::SidecarSettings;

/// The engines a run's cells go to, with what every cell shares.
pub(super) struct Engines {
    model: String,
    /// Mixed into every cell's own salt (from the clock: a re-run does not
    /// find an earlier run's prompts).
    run_salt: u64,
}

/// Every Hearth cell's settings on real engines: the objectives, the
/// scrape interval, then the command line's.
pub(super) fn hearth_settings(args: &TenantsArgs) -> Vec<(String, String)> {
    let mut settings = vec![
        ("HEARTH_FLOW_OBJECTIVES".to_string(), OBJECTIVES.to_string()),
        (
            "HEARTH_ENGINE_METRICS_SECONDS".to_string(),
            args.scrape_seconds.to_string(),
        ),
    ];
    settings.extend(args.sidecar.set.iter().cloned());
    settings
}

/// `hearth-bench tenants --engines ...` as run, asking for `model`
/// (settings shown, credentials hidden).
fn command(args: &TenantsArgs, model: &str) -> String {
    format!(
        "hearth-bench tenants --engines {} --model {} --turns {} --max-tokens {} --think-ms {} \
         --quiet-tenants {} --quiet-agents {} --noisy-agents {} --high-agents {} \
         --sheddable-agents {} --scrape-seconds {} --seed {}{}{}{}",
        args.engines
            .iter()
            .map(|e| e.to_string())
            .collect::<Vec<_>>()
            .join(","),
        model,
        args.turns,
        args.max_tokens,
        args.think_ms,
        args.quiet_tenants,
        args.quiet_agents,
        args.noisy_agents,
        args.high_agents,
        args.sheddable_agents,
        args.scrape_seconds,
        args.seed,
        if args.reset_caches {
            " --reset-caches"
        } else {
            ""
        },
        super::selection(args),
        args.sidecar.shown(),
    )
}

/// Agents of every class, whichever a cell runs: conversation `i` is
/// agent `i`'s.
fn everyone(args: &TenantsArgs) -> usize {
    args.quiet_tenants * args.quiet_agents
        + args.noisy_agents
        + args.high_agents
        + args.sheddable_agents
}

impl Engines {
    pub(super) async fn of(args: &TenantsArgs) -> anyhow::Result<Engines> {
        anyhow::ensure!(
            args.turns > 0 && args.max_tokens > 0,
            "--turns and --max-tokens must be at least 1"
        );
        let model = match &args.model {
            Some(m) => m.clone(),
            None => real::shared_model(&args.engines, None).await?,
        };
        let run_salt = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64);
        Ok(Engines { model, run_salt })
    }

    /// Why smg cannot serve this run's model from these engines (None:
    /// it can; [`real::smg_cannot_serve`]).
    pub(super) async fn smg_cannot_serve(&self, args: &TenantsArgs) -> Option<String> {
        real::smg_cannot_serve_at(&args.engines, None, &self.model).await
    }

    /// This run's command line (the model it asks for shown, whether
    /// given or found).
    pub(super) fn command(&self, args: &TenantsArgs) -> String {
        command(args, &self.model)
    }

    pub(super) fn describe(&self, args: &TenantsArgs) {
        println!(
            "# {} real engines; each agent plays one conversation of {} turns (streamed, max_tokens {}, \
             temperature 0, pauses of {} ms on average), wall-clock time, no warm-up; caches {}; seed {}",
            args.engines.len(),
            args.turns,
            args.max_tokens,
            args.think_ms,
            if args.reset_caches {
                "emptied before each cell"
            } else {
                "not emptied (each cell's prompts are its own)"
            },
            args.seed
        );
        println!(
            "# turns/min: a row's answered turns over its whole cell's wall time (every agent plays \
             the same turns): compare the `all` rows across setups; between classes, only TTFT"
        );
    }

    pub(super) fn json(&self, args: &TenantsArgs) -> Value {
        json!({
            "engines": args.engines,
            "model": self.model,
            "salt": self.run_salt,
            "turns": args.turns,
            "max_tokens": args.max_tokens,
            "think_ms": args.think_ms,
            "reset_caches": args.reset_caches,
        })
    }

    /// `hearth-bench real`'s flags for one cell of `conversations` agents.
    fn real_args(
        &self,
        args: &TenantsArgs,
        settings: Vec<(String, String)>,
        conversations: usize,
    ) -> RealArgs {
        RealArgs {
            engines: args.engines.clone(),
            api_key: None,
            model: Some(self.model.clone()),
            workload: Workload::Conversations,
            users_per_group: 1,
            conversations,
            turns: args.turns,
            shared_bytes: 1600,
            system_bytes: 800,
            user_bytes: 800,
            think_ms: args.think_ms,
            max_tokens: args.max_tokens,
            policies: Vec::new(),
            peer_deadline_s: 60,
            paired: false,
            driver: Driver::HearthBench,
            rates: Vec::new(),
            stage_seconds: 0,
            system_tokens: 0,
            question_tokens: 0,
            tokenizer: None,
            reset_caches: args.reset_caches,
            timeout: 300,
            seed: args.seed,
            salt: None,
            sidecar: SidecarSettings { set: settings },
            keep: None,
            json: None,
        }
    }

    /// One cell: its agents' conversations through its setup's gateway,
    /// a row per class, then one for them all.
    pub(super) async fn run_cell(
        &self,
        cell: (Mix, Setup),
        args: &TenantsArgs,
        hearth: &[(String, String)],
    ) -> anyhow::Result<Cell> {
        let (mix, setup) = cell;
        let agents = plan(mix, args);
        let real_args = self.real_args(args, setup.settings(hearth), everyone(args));
        let position = CELLS.iter().position(|c| *c == cell).unwrap_or(0);
        let salt = Rng::derive(self.run_salt ^ args.seed, 1 + position as u64).next_u64();
        let class_of: HashMap<usize, Class> =
            agents.iter().map(|a| (a.index as usize, a.class)).collect();
        let headers: HashMap<usize, &Vec<(String, String)>> = agents
            .iter()
            .map(|a| (a.index as usize, &a.headers))
            .collect();
        let conversations = real::plan(&Shape::of(&real_args), &self.model, salt)
            .into_iter()
            .filter_map(|mut c| {
                c.headers = headers.get(&c.index)?.to_vec();
                Some(c)
            })
            .collect();
        let run = real::run_planned(&real_args, setup.policy(), &self.model, conversations)
            .await
            .with_context(|| format!("{} under {}", mix.name(), setup.name()))?;
        let waits = run.sidecar_metrics.as_deref().map(|m| queue_waits(m, 1.0));
        let wall = run.summary.wall_s;
        let engines = args.engines.len();
        let mut rows: Vec<ClassRow> = mix
            .classes()
            .iter()
            .map(|&c| {
                let records: Vec<TurnRecord> = run
                    .turns
                    .iter()
                    .filter(|t| class_of.get(&t.conversation) == Some(&c))
                    .cloned()
                    .collect();
                let count = agents.iter().filter(|a| a.class == c).count();
                class_row(cell, Some(c), count, &records, engines, wall)
            })
            .collect();
        rows.push(class_row(
            cell,
            None,
            agents.len(),
            &run.turns,
            engines,
            wall,
        ));
        let turns = run
            .turns
            .iter()
            .map(|t| json!({"class": class_of.get(&t.conversation), "record": t}))
            .collect();
        Ok(Cell {
            rows,
            waits,
            peer_command: run.peer_command.clone(),
            turns: Some(Value::Array(turns)),
        })
    }
}

/// One class's figures from its turns on real engines over `wall_s`
/// seconds: every turn counts (no warm-up).
pub(super) fn class_row(
    (mix, setup): (Mix, Setup),
    class: Option<Class>,
    agents: usize,
    records: &[TurnRecord],
    engines: usize,
    wall_s: f64,
) -> ClassRow {
    let s = real::summarize(setup.name(), records, engines, wall_s);
    let (prompt, cached) = s.answered_usage;
    ClassRow {
        mix,
        setup,
        class,
        agents,
        turns: s.ok,
        turns_per_min: s.turns_per_min,
        ttft_p50_s: s.ttft_p50_s,
        ttft_p90_s: s.ttft_p90_s,
        ttft_p99_s: s.ttft_p99_s,
        cached_fraction: if prompt > 0 {
            cached as f64 / prompt as f64
        } else {
            0.0
        },
        rate_limited: s.status_429 as u64,
        other_failures: s.status_5xx + s.other_failures,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tenants::tests::parsed;

    fn turn(conversation: usize, status: u16, ttft: f64, cached: u64) -> TurnRecord {
        let ok = status == 200;
        TurnRecord {
            conversation,
            turn: 2,
            engine: Some(0),
            status: Some(status),
            ttft_s: ok.then_some(ttft),
            e2e_s: ttft + 1.0,
            prompt_tokens: ok.then_some(1000),
            cached_tokens: ok.then_some(cached),
            output_tokens: ok.then_some(32),
            error: (!ok).then(|| format!("HTTP {status}")),
        }
    }

    #[test]
    fn a_class_row_on_real_engines_counts_answers_refusals_and_failures_apart() {
        let records = vec![
            turn(0, 200, 1.0, 900),
            turn(0, 200, 3.0, 500),
            turn(1, 429, 0.0, 0),
            turn(1, 503, 0.0, 0),
        ];
        let cell = (Mix::Priority, Setup::HearthFlowControl);
        let row = class_row(cell, Some(Class::Sheddable), 2, &records, 2, 30.0);
        assert_eq!(row.turns, 2);
        assert_eq!(row.turns_per_min, 4.0, "2 answered turns in half a minute");
        assert_eq!(row.rate_limited, 1);
        assert_eq!(row.other_failures, 1);
        assert!((row.cached_fraction - 0.7).abs() < 1e-9, "1,400 of 2,000");
        assert!(row.ttft_p90_s > 1.0 && row.ttft_p90_s <= 3.0);
    }

    #[test]
    fn real_engines_take_the_objectives_and_the_command_lines_settings_unscaled() {
        let args = parsed(&[
            "--engines",
            "127.0.0.1:8001,127.0.0.1:8002",
            "--set",
            "HEARTH_FLOW_ENGINE_WAITING=1",
        ]);
        let settings = hearth_settings(&args);
        let get = |name: &str| {
            settings
                .iter()
                .rfind(|(n, _)| n == name)
                .map(|(_, v)| v.as_str())
        };
        assert_eq!(get("HEARTH_FLOW_OBJECTIVES"), Some(OBJECTIVES));
        assert_eq!(get("HEARTH_FLOW_ENGINE_WAITING"), Some("1"));
        // Wall-clock engines: the flow control's waits stay the sidecar's.
        assert_eq!(get("HEARTH_FLOW_AFFINITY_WAIT_SECONDS"), None);
        assert_eq!(get("HEARTH_FLOW_TTL_SECONDS"), None);
        assert!(command(&args, "m")
            .contains("--engines 127.0.0.1:8001,127.0.0.1:8002 --model m --turns 8"));
        assert_eq!(everyone(&args), 4 * 2 + 16 + 4 + 20);
    }
}

//! `hearth-bench pool`: several `hearth-bench real --json` runs (seeds,
//! engine pairs) as one sample per policy. A TTFT percentile of one
//! 60-turn run moves with a handful of turns; pooled over runs it says
//! which policy's slow turns are slower.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Args;
use serde::Deserialize;

use crate::real::{summarize, table, TurnRecord};

/// Flags of `hearth-bench pool`.
#[derive(Debug, Clone, Args)]
pub struct PoolArgs {
    /// The `--json` outputs of `hearth-bench real` runs to pool.
    #[arg(required = true)]
    pub runs: Vec<PathBuf>,
}

/// What is read of one run's JSON.
#[derive(Deserialize)]
struct Run {
    engines: Vec<String>,
    rows: Vec<Row>,
}

#[derive(Deserialize)]
struct Row {
    policy: String,
    wall_s: f64,
    turns: Vec<TurnRecord>,
    ttft_later_p90_s: f64,
    prediction_error: Option<Prediction>,
}

#[derive(Deserialize)]
struct Prediction {
    answers: u64,
    mean_error: f64,
    predicted_tokens: u64,
    served_tokens: u64,
}

/// Each policy's rows of every run, as one.
fn pool(runs: Vec<Run>) -> BTreeMap<String, Pooled> {
    let mut pooled: BTreeMap<String, Pooled> = BTreeMap::new();
    for (k, run) in runs.into_iter().enumerate() {
        let best_wall = run.rows.iter().map(|r| r.wall_s).fold(f64::MAX, f64::min);
        let best_p90 = run
            .rows
            .iter()
            .map(|r| r.ttft_later_p90_s)
            .fold(f64::MAX, f64::min);
        for row in run.rows {
            let p = pooled.entry(row.policy.clone()).or_default();
            p.runs += 1;
            p.wall_s += row.wall_s;
            p.engines = p.engines.max(run.engines.len());
            p.fastest += usize::from(row.wall_s <= best_wall);
            p.lowest_p90 += usize::from(row.ttft_later_p90_s <= best_p90);
            // Conversations of different runs are different conversations.
            p.turns.extend(row.turns.into_iter().map(|mut t| {
                t.conversation += k * 1_000_000;
                t
            }));
            if let Some(e) = row.prediction_error {
                let (n, sum, predicted, served) = p.prediction.get_or_insert((0, 0.0, 0, 0));
                *n += e.answers;
                *sum += e.mean_error * e.answers as f64;
                *predicted += e.predicted_tokens;
                *served += e.served_tokens;
            }
        }
    }
    pooled
}

/// One policy over every run.
#[derive(Default)]
struct Pooled {
    runs: usize,
    wall_s: f64,
    turns: Vec<TurnRecord>,
    engines: usize,
    /// Runs where this policy had the shortest wall time, and the lowest
    /// TTFT p90 of later turns (ties count for each).
    fastest: usize,
    lowest_p90: usize,
    /// Answers compared, the sum of their errors, tokens predicted and
    /// served.
    prediction: Option<(u64, f64, u64, u64)>,
}

pub async fn run(args: PoolArgs) -> anyhow::Result<()> {
    let mut runs = Vec::new();
    for path in &args.runs {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        runs.push(serde_json::from_str::<Run>(&text).with_context(|| {
            format!("{} is no `hearth-bench real --json` output", path.display())
        })?);
    }
    let pooled = pool(runs);
    if pooled.is_empty() {
        bail!("the runs hold no policy rows");
    }
    println!(
        "# hearth-bench pool: {} runs ({}); wall s is their sum, the rest is over every turn of every run",
        args.runs.len(),
        args.runs
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(" ")
    );
    let summaries: Vec<_> = pooled
        .iter()
        .map(|(policy, p)| summarize(policy, &p.turns, p.engines, p.wall_s))
        .collect();
    print!("{}", table(&summaries));
    for (policy, p) in &pooled {
        println!(
            "{policy}: shortest wall time in {} of {} runs, lowest TTFT p90 of turns 2+ in {} of {}",
            p.fastest, p.runs, p.lowest_p90, p.runs
        );
        if let Some((n, sum, predicted, served)) = p.prediction {
            println!(
                "{policy}: hearth_prediction_error {:.2}% over {n} answers; {predicted} cached tokens predicted, {served} served",
                100.0 * sum / n.max(1) as f64
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn turn(conversation: usize, turn: usize, engine: usize, ttft_s: f64) -> TurnRecord {
        TurnRecord {
            conversation,
            turn,
            engine: Some(engine),
            status: Some(200),
            ttft_s: Some(ttft_s),
            e2e_s: ttft_s,
            prompt_tokens: Some(100),
            cached_tokens: Some(if turn > 1 { 50 } else { 0 }),
            output_tokens: Some(8),
            error: None,
        }
    }

    fn row(policy: &str, wall_s: f64, p90: f64, turns: Vec<TurnRecord>) -> Row {
        Row {
            policy: policy.into(),
            wall_s,
            turns,
            ttft_later_p90_s: p90,
            prediction_error: None,
        }
    }

    /// A policy's row: its name, wall s, TTFT p90 of later turns, and one
    /// conversation's two turns (engine, TTFT).
    type RowSpec<'a> = (&'a str, f64, f64, [(usize, f64); 2]);

    fn run(rows: &[RowSpec]) -> Run {
        Run {
            engines: vec!["a".into(), "b".into()],
            rows: rows
                .iter()
                .map(|&(policy, wall_s, p90, [(e1, t1), (e2, t2)])| {
                    row(
                        policy,
                        wall_s,
                        p90,
                        vec![turn(0, 1, e1, t1), turn(0, 2, e2, t2)],
                    )
                })
                .collect(),
        }
    }

    #[test]
    fn runs_pool_into_one_sample_per_policy() {
        // Conversation 0 of each run: hearth keeps it on one engine in
        // both; least_request moves it in the first.
        let first = run(&[
            ("hearth", 9.0, 1.0, [(0, 0.2), (0, 0.4)]),
            ("least_request", 10.0, 0.9, [(0, 0.3), (1, 0.5)]),
        ]);
        let mut second = run(&[
            ("hearth", 8.0, 0.8, [(1, 0.2), (1, 0.6)]),
            ("least_request", 7.5, 0.9, [(1, 0.3), (1, 0.7)]),
        ]);
        second.rows[0].prediction_error = Some(Prediction {
            answers: 30,
            mean_error: 0.04,
            predicted_tokens: 1_000,
            served_tokens: 900,
        });
        let pooled = pool(vec![first, second]);
        let h = &pooled["hearth"];
        let l = &pooled["least_request"];
        assert_eq!((h.runs, h.turns.len(), h.wall_s), (2, 4, 17.0));
        // Each policy led one run on wall time; hearth had the lower p90
        // once, least_request (0.9 against 1.0) once.
        assert_eq!((h.fastest, h.lowest_p90), (1, 1));
        assert_eq!((l.fastest, l.lowest_p90), (1, 1));
        let (n, sum, predicted, served) = h.prediction.unwrap();
        assert_eq!((n, predicted, served), (30, 1_000, 900));
        assert!((sum / n as f64 - 0.04).abs() < 1e-12, "{sum}");
        assert_eq!(l.prediction, None);
        // Conversation 0 of the two runs stays two conversations: hearth
        // never moved one, least_request moved one of two.
        let hs = summarize("hearth", &h.turns, 2, h.wall_s);
        let ls = summarize("least_request", &l.turns, 2, l.wall_s);
        assert_eq!(hs.stay_rate, Some(1.0));
        assert_eq!(ls.stay_rate, Some(0.5));
        assert_eq!(hs.per_engine, [2, 2]);
        assert_eq!(hs.ttft_later_p90_s, 0.6);
    }
}

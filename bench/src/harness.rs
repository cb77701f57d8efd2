//! llm-d's own benchmark harness, `inference-perf` (PyPI, installed by
//! `scripts/setup-peers` and linked at `.hearth/peers/inference-perf`), as
//! a driver of `hearth-bench real --driver inference-perf`: its
//! `shared_prefix` data (groups of users sharing a system prompt, each
//! request the group's prompt and a fresh question, lengths in tokens of a
//! local tokenizer folder), at constant request rates stage after stage,
//! against each policy's front in turn. The harness writes its own
//! report; [`HarnessRow::read`] takes the figures the table shows from
//! it (throughput, TTFT percentiles, and the cached share the servers'
//! usage reported).
//!
//! The config is written by [`config`], a pure function, so what the
//! harness was asked to do is printed and tested; the harness runs as a
//! child process with a deadline and its log kept.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context};
use serde::Serialize;
use serde_json::Value;

use crate::gateway::search_roots;

/// Where `scripts/setup-peers` links the harness, under the repository.
pub const INSTALL_RELATIVE: &str = ".hearth/peers/inference-perf";

/// The variable that names the harness's binary instead.
pub const ENV: &str = "HEARTH_INFERENCE_PERF";

/// The PyPI release `scripts/setup-peers` installs.
pub const RELEASE: &str = "inference-perf==0.7.0";

/// The harness's binary: `$HEARTH_INFERENCE_PERF`, else
/// `.hearth/peers/inference-perf` in the current directory, the
/// executable's directory or one of their ancestors.
pub fn find() -> anyhow::Result<PathBuf> {
    find_from(
        std::env::var_os(ENV)
            .filter(|p| !p.is_empty())
            .map(PathBuf::from),
        &search_roots(),
    )
}

/// [`find`] with the variable's value and the folders to search given.
fn find_from(named: Option<PathBuf>, roots: &[PathBuf]) -> anyhow::Result<PathBuf> {
    if let Some(p) = named {
        if !p.is_file() {
            bail!("{ENV}={} is not a file", p.display());
        }
        return Ok(p);
    }
    roots
        .iter()
        .flat_map(|dir| dir.ancestors().map(|base| base.join(INSTALL_RELATIVE)))
        .find(|p| p.is_file())
        .with_context(|| {
            format!(
                "inference-perf is not installed: run scripts/setup-peers (it installs PyPI \
                 {RELEASE} once per machine, with Python 3.12 or later, and links it at \
                 {INSTALL_RELATIVE}) or set {ENV}"
            )
        })
}

/// What the harness sends: its `shared_prefix` data at each rate.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct HarnessShape {
    pub groups: usize,
    pub users_per_group: usize,
    /// Lengths in tokens of the tokenizer given.
    pub system_tokens: usize,
    pub question_tokens: usize,
    pub output_tokens: usize,
    /// Requests a second, one stage each, in this order.
    pub rates: Vec<f64>,
    pub stage_seconds: u64,
    pub seed: u64,
}

/// The harness's config (YAML) for one run: streamed chat requests for
/// `model` to `base_url` (the front's `http://ip:port`), lengths counted
/// with the tokenizer folder `tokenizer`, its report written to `out`.
/// Output tokens are the engine's own count (each answer's usage): the
/// harness's default re-tokenizes each answer's text, and in 25 of 235
/// kept policy runs counted about 1,837 tokens for 32 generated in every
/// answer to one, two or four of the 24 prompts, which made its output
/// tokens a second 3.4-10.4 times the engine's
/// (`bench/results/peers/output-tokens/`).
pub fn config(
    shape: &HarnessShape,
    base_url: &str,
    model: &str,
    tokenizer: &Path,
    out: &Path,
    per_request: bool,
) -> String {
    let stages: String = shape
        .rates
        .iter()
        .map(|r| format!("  - rate: {r}\n    duration: {}\n", shape.stage_seconds))
        .collect();
    format!(
        "api:\n  type: chat\n  streaming: true\n\
         data:\n  type: shared_prefix\n  shared_prefix:\n    num_groups: {groups}\n    num_prompts_per_group: {users}\n    system_prompt_len: {system}\n    question_len: {question}\n    output_len: {output}\n    seed: {seed}\n\
         load:\n  type: constant\n  stages:\n{stages}\
         server:\n  type: vllm\n  model_name: {model}\n  base_url: {base_url}\n  ignore_eos: true\n\
         tokenizer:\n  pretrained_model_name_or_path: {tokenizer}\n\
         report:\n  request_lifecycle:\n    summary: true\n    per_stage: true\n    per_request: {per_request}\n    use_server_output_tokens: true\n\
         storage:\n  local_storage:\n    path: {out}\n",
        groups = shape.groups,
        users = shape.users_per_group,
        system = shape.system_tokens,
        question = shape.question_tokens,
        output = shape.output_tokens,
        seed = shape.seed,
        tokenizer = tokenizer.display(),
        out = out.display(),
    )
}

/// One run's figures, from the harness's report.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct HarnessRow {
    pub policy: String,
    pub wall_s: f64,
    pub ok: u64,
    pub failed: u64,
    pub requests_per_s: f64,
    pub output_tok_per_s: f64,
    pub ttft_p50_s: f64,
    pub ttft_p90_s: f64,
    pub ttft_p99_s: f64,
    /// Prompt tokens the servers reported as cached, over all prompt
    /// tokens of the answered requests.
    pub cached_share: Option<f64>,
    /// CPU seconds the router's processes spent while the harness ran.
    pub gateway_cpu_s: Option<f64>,
}

impl HarnessRow {
    /// Reads `summary_lifecycle_metrics.json` (its `successes` and
    /// `failures`); a figure the report lacks reads as NaN (printed `-`).
    pub fn read(policy: &str, summary: &Value) -> HarnessRow {
        let num = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
        let ok = &summary["successes"];
        let ttft = &ok["latency"]["time_to_first_token"];
        let prompt = &ok["prompt_tokens"];
        let total = num(&prompt["total"]);
        HarnessRow {
            policy: policy.to_string(),
            wall_s: num(&summary["benchmark_time_seconds"]),
            ok: ok["count"].as_u64().unwrap_or(0),
            failed: summary["failures"]["count"].as_u64().unwrap_or(0),
            requests_per_s: num(&ok["throughput"]["requests_per_sec"]),
            output_tok_per_s: num(&ok["throughput"]["output_tokens_per_sec"]),
            ttft_p50_s: num(&ttft["median"]),
            ttft_p90_s: num(&ttft["p90"]),
            ttft_p99_s: num(&ttft["p99"]),
            cached_share: (total > 0.0).then(|| num(&prompt["cached"]) / total),
            gateway_cpu_s: None,
        }
    }
}

/// The rows as a Markdown table.
pub fn table(rows: &[HarnessRow]) -> String {
    let f = |v: f64, digits: usize| {
        if v.is_finite() {
            format!("{v:.digits$}")
        } else {
            "-".into()
        }
    };
    let mut out = String::from(
        "| policy | wall s | ok | failed | req/s | out tok/s | TTFT p50 s | TTFT p90 s | TTFT p99 s | cached | gateway CPU s |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in rows {
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            r.policy,
            f(r.wall_s, 1),
            r.ok,
            r.failed,
            f(r.requests_per_s, 2),
            f(r.output_tok_per_s, 1),
            f(r.ttft_p50_s, 2),
            f(r.ttft_p90_s, 2),
            f(r.ttft_p99_s, 2),
            r.cached_share
                .map_or("-".into(), |c| format!("{:.1}%", c * 100.0)),
            r.gateway_cpu_s.map_or("-".into(), |c| f(c, 1)),
        ));
    }
    out
}

/// Runs the harness with `config` (written into `dir`, its report into
/// `dir/report`), killed past `deadline`; returns the report's summary.
pub async fn run(
    program: &Path,
    config_yaml: &str,
    dir: &Path,
    deadline: Duration,
) -> anyhow::Result<Value> {
    std::fs::create_dir_all(dir)?;
    let config_path = dir.join("config.yaml");
    std::fs::write(&config_path, config_yaml)?;
    let log_path = dir.join("inference-perf.log");
    let log = std::fs::File::create(&log_path)?;
    let mut child = tokio::process::Command::new(program)
        .arg("-c")
        .arg(&config_path)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {}", program.display()))?;
    let status = match tokio::time::timeout(deadline, child.wait()).await {
        Ok(status) => status?,
        Err(_) => {
            child.kill().await.ok();
            bail!(
                "inference-perf ran past {deadline:?}; its log: {}",
                log_path.display()
            );
        }
    };
    if !status.success() {
        let log = std::fs::read_to_string(&log_path).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(30).collect();
        bail!(
            "inference-perf exited with {status}; the end of its log ({}):\n{}",
            log_path.display(),
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        );
    }
    let summary = dir.join("report").join("summary_lifecycle_metrics.json");
    let text = std::fs::read_to_string(&summary)
        .with_context(|| format!("reading {}", summary.display()))?;
    Ok(serde_json::from_str(&text)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> HarnessShape {
        HarnessShape {
            groups: 3,
            users_per_group: 4,
            system_tokens: 600,
            question_tokens: 120,
            output_tokens: 8,
            rates: vec![0.5, 2.0],
            stage_seconds: 30,
            seed: 7,
        }
    }

    #[test]
    fn the_config_asks_for_shared_prefix_chat_at_each_rate() {
        let config_kept = |per_request| {
            config(
                &shape(),
                "http://127.0.0.1:10000",
                "m",
                Path::new("/t/model"),
                Path::new("/t/out"),
                per_request,
            )
        };
        let yaml = config_kept(false);
        for line in [
            "  type: chat\n  streaming: true\n",
            "  type: shared_prefix\n",
            "    num_groups: 3\n    num_prompts_per_group: 4\n",
            "    system_prompt_len: 600\n    question_len: 120\n    output_len: 8\n    seed: 7\n",
            "  - rate: 0.5\n    duration: 30\n  - rate: 2\n    duration: 30\n",
            "  model_name: m\n  base_url: http://127.0.0.1:10000\n  ignore_eos: true\n",
            "  pretrained_model_name_or_path: /t/model\n",
            "    path: /t/out\n",
        ] {
            assert!(yaml.contains(line), "{line:?} not in\n{yaml}");
        }
        // Every line is YAML of the shape the harness reads: two-space
        // indents, nothing tabbed.
        assert!(!yaml.contains('\t'));
        assert!(yaml.contains("    per_request: false\n"));
        // Output tokens as the engine counted them, not re-tokenized.
        assert!(yaml.contains("    use_server_output_tokens: true\n"));
        // Kept runs have every request's timings in their report.
        let kept = config_kept(true);
        assert!(kept.contains("    per_request: true\n"), "{kept}");
    }

    #[test]
    fn a_report_reads_into_a_row_and_missing_figures_print_as_dashes() {
        // The fields of the harness's summary report that the row reads
        // (values made up).
        let summary = serde_json::json!({
            "benchmark_time_seconds": 61.5,
            "successes": {
                "count": 118,
                "throughput": {"requests_per_sec": 1.92, "output_tokens_per_sec": 15.4},
                "latency": {"time_to_first_token": {"median": 0.41, "p90": 1.25, "p99": 2.5}},
                "prompt_tokens": {"total": 80000.0, "cached": 60000.0, "uncached": 20000.0},
            },
            "failures": {"count": 2},
        });
        let row = HarnessRow::read("hearth", &summary);
        assert_eq!((row.ok, row.failed), (118, 2));
        assert_eq!(row.cached_share, Some(0.75));
        assert_eq!(
            (row.ttft_p50_s, row.ttft_p90_s, row.ttft_p99_s),
            (0.41, 1.25, 2.5)
        );
        let t = table(&[row, HarnessRow::read("empty", &serde_json::json!({}))]);
        assert!(
            t.contains("| hearth | 61.5 | 118 | 2 | 1.92 | 15.4 | 0.41 | 1.25 | 2.50 | 75.0% |"),
            "{t}"
        );
        assert!(
            t.contains("| empty | - | 0 | 0 | - | - | - | - | - | - |"),
            "{t}"
        );
    }

    #[test]
    fn a_missing_harness_names_the_setup_step() {
        let e = format!("{:#}", find_from(None, &[]).unwrap_err());
        assert!(
            e.contains("scripts/setup-peers") && e.contains(RELEASE),
            "{e}"
        );
        let e = format!(
            "{:#}",
            find_from(Some("/no/such/file".into()), &[]).unwrap_err()
        );
        assert!(e.contains("HEARTH_INFERENCE_PERF=/no/such/file"), "{e}");
        // Found under a root's ancestor, as the setup links it.
        let root = std::env::temp_dir().join(format!("hearth-harness-{}", std::process::id()));
        let link = root.join(INSTALL_RELATIVE);
        std::fs::create_dir_all(link.parent().unwrap()).unwrap();
        std::fs::write(&link, "#!/bin/sh\n").unwrap();
        let found = find_from(None, &[root.join("target/debug")]);
        std::fs::remove_dir_all(&root).unwrap();
        assert_eq!(found.unwrap(), link);
    }
}

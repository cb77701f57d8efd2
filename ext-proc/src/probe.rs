//! Active probes: every engine address, every `interval`, at most `concurrency` at
//! a time: `GET /v1/models`, then a one-token completion. A probe passes
//! only when the engine really generates.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::sync::Semaphore;

use crate::health::{Failure, Outcome};
use crate::observe::Observer;
use crate::router::Router;

/// Probe settings.
#[derive(Clone, Copy, Debug)]
pub struct ProbeParams {
    /// Time between two probes of one replica (0 disables probing).
    pub interval: Duration,
    /// Deadline of each probe request.
    pub timeout: Duration,
    /// Replicas probed at once.
    pub concurrency: usize,
}

/// Probes one replica at `base` (`http://ip:port`). `model` is the model to
/// ask for; when `None` the first one `/v1/models` lists is used.
pub async fn probe_once(
    client: &reqwest::Client,
    base: &str,
    model: Option<&str>,
    timeout: Duration,
) -> Outcome {
    let models = match client
        .get(format!("{base}/v1/models"))
        .timeout(timeout)
        .send()
        .await
    {
        Ok(r) if r.status().is_success() => r.json::<Value>().await.ok(),
        Ok(_) => None,
        Err(e) if e.is_timeout() => return Outcome::Failure(Failure::Timeout),
        Err(_) => return Outcome::Failure(Failure::ConnectFailure),
    };
    let listed = models
        .as_ref()
        .and_then(|m| m["data"][0]["id"].as_str())
        .map(str::to_string);
    let Some(model) = model.map(str::to_string).or(listed) else {
        return Outcome::Failure(Failure::ProbeModels);
    };
    let body = json!({
        "model": model,
        "messages": [{"role": "user", "content": "ping"}],
        "max_tokens": 1,
        "stream": false,
    });
    let resp = match client
        .post(format!("{base}/v1/chat/completions"))
        .timeout(timeout)
        .json(&body)
        .send()
        .await
    {
        Ok(r) => r,
        Err(e) if e.is_timeout() => return Outcome::Failure(Failure::Timeout),
        Err(_) => return Outcome::Failure(Failure::ConnectFailure),
    };
    let status = resp.status();
    if status.is_server_error() {
        return Outcome::Failure(Failure::ServerError);
    }
    match resp.json::<Value>().await {
        Ok(v) if status.is_success() => {
            let text = v["choices"][0]["message"]["content"]
                .as_str()
                .or_else(|| v["choices"][0]["text"].as_str())
                .unwrap_or_default();
            if text.is_empty() {
                Outcome::Failure(Failure::EmptyAnswer)
            } else {
                Outcome::Success
            }
        }
        Err(e) if e.is_timeout() => Outcome::Failure(Failure::Timeout),
        _ => Outcome::Failure(Failure::EmptyAnswer),
    }
}

/// Runs probes until the task is dropped.
pub async fn run(router: Arc<Router>, observer: Arc<Observer>, params: ProbeParams) {
    if params.interval.is_zero() {
        return;
    }
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(1)
        .build()
        .unwrap_or_default();
    let limit = Arc::new(Semaphore::new(params.concurrency.max(1)));
    let mut tick = tokio::time::interval(params.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let mut round = tokio::task::JoinSet::new();
        for (addr, model) in router.engines() {
            let (client, router, limit) = (client.clone(), Arc::clone(&router), Arc::clone(&limit));
            let observer = Arc::clone(&observer);
            round.spawn(async move {
                let Ok(_permit) = limit.acquire().await else {
                    return;
                };
                let base = format!("http://{addr}");
                let outcome = probe_once(&client, &base, model.as_deref(), params.timeout).await;
                observer.probe(addr, outcome);
                router.record_probe(addr, outcome);
            });
        }
        while round.join_next().await.is_some() {}
    }
}

//! Active probes, only where real traffic proves nothing: a replica is
//! probed when [`hearth_router::ReplicaHealth::probe_due`] says so (fenced
//! with its backoff over, suspect after a failure, or idle for the probe
//! interval), at most `concurrency` at a time, never twice at once.
//!
//! A probe lists the models, then asks for one token of a fixed raw
//! completion (chat completion where the engine has no completions
//! endpoint). It passes when the engine generated a token: a completion
//! token count, a non-empty text or reasoning field, or a `length` finish
//! (reasoning models put their first tokens outside `content`).
//!
//! The prompt is chosen to cost the engine's cache as little as possible:
//! it is raw text, so it shares no chat-template prefix with the
//! conversations an engine holds, and it is the same every time and long
//! enough that a leading BOS token is a small share of it. A slot-based
//! engine (llama.cpp) that picks a slot by prompt similarity therefore
//! matches no conversation's slot with it, and re-uses the probe's own
//! slot from the previous probe when that is still there; engines with a
//! paged prefix cache (vLLM, SGLang) spend one block on it.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use tokio::sync::Semaphore;

use crate::feeds::engines::EngineClient;
use crate::observe::Observer;
use hearth_router::health::{Failure, Outcome};
use hearth_router::{ProbeTarget, ReplicaKey, Router};
use hearth_wire::names::DP_RANK;

use crate::config::{seconds, Settings};

/// Probe settings (when a replica is due is part of the health settings).
#[derive(Clone, Copy, Debug)]
pub struct ProbeParams {
    pub enabled: bool,
    /// Deadline of each probe request.
    pub timeout: Duration,
    /// Replicas probed at once.
    pub concurrency: usize,
}

impl ProbeParams {
    pub fn of(settings: &Settings) -> ProbeParams {
        ProbeParams {
            enabled: settings.probe_interval_seconds > 0.0,
            timeout: seconds(settings.probe_timeout_seconds),
            concurrency: settings.probe_concurrency.max(1),
        }
    }
}

/// The probe's prompt (see the module's notes on why it looks like this).
pub const PROBE_PROMPT: &str = "Hearth gateway health probe. This fixed text checks that the \
    engine still generates tokens; it is not part of any conversation. Answer with one word:";

/// How often the prober looks for replicas that are due.
const TICK: Duration = Duration::from_millis(250);

/// Probes the engine at `base` (`http://ip:port` or `https://ip:port`), rank `rank` when it
/// has data-parallel ranks. `model` is the model to ask for; when `None`
/// the first one `/v1/models` lists is used.
pub async fn probe_once(
    client: &EngineClient,
    base: &str,
    model: Option<&str>,
    rank: Option<u32>,
    timeout: Duration,
) -> Outcome {
    let models = match client.get(&format!("{base}/v1/models"), timeout).await {
        Ok(r) if refused(r.status()) => return Outcome::Unauthorized(r.status().as_u16()),
        Ok(r) if r.status().is_success() => r.json::<Value>().await.ok(),
        Ok(_) => None,
        Err(e) => return request_failure(&e),
    };
    let listed = models
        .as_ref()
        .and_then(|m| m["data"][0]["id"].as_str())
        .map(str::to_string);
    let Some(model) = model.map(str::to_string).or(listed) else {
        return Outcome::Failure(Failure::ProbeModels);
    };
    let rank_header = rank.map(|r| (DP_RANK, r.to_string()));
    let completion = json!({
        "model": model,
        "prompt": PROBE_PROMPT,
        "max_tokens": 1,
        "temperature": 0,
        "stream": false,
    });
    let chat = json!({
        "model": model,
        "messages": [{"role": "user", "content": PROBE_PROMPT}],
        "max_tokens": 1,
        "temperature": 0,
        "stream": false,
    });
    let mut answer = None;
    for (path, body) in [
        ("/v1/completions", &completion),
        ("/v1/chat/completions", &chat),
    ] {
        let resp = match client
            .post(
                &format!("{base}{path}"),
                body,
                rank_header.as_ref(),
                timeout,
            )
            .await
        {
            Ok(r) => r,
            Err(e) => return request_failure(&e),
        };
        let status = resp.status();
        // No completions endpoint (or not for this model): try chat.
        if path == "/v1/completions" && matches!(status.as_u16(), 400 | 404 | 405 | 501) {
            continue;
        }
        answer = Some(resp);
        break;
    }
    let Some(resp) = answer else {
        return Outcome::Failure(Failure::ServerError);
    };
    let status = resp.status();
    if refused(status) {
        return Outcome::Unauthorized(status.as_u16());
    }
    if status.is_server_error() {
        return Outcome::Failure(Failure::ServerError);
    }
    match resp.json::<Value>().await {
        Ok(v) if status.is_success() && generated(&v) => Outcome::Success,
        Err(e) if e.is_timeout() => Outcome::Failure(Failure::Timeout),
        _ => Outcome::Failure(Failure::EmptyAnswer),
    }
}

/// 401 and 403: the engine refuses the sidecar's credentials.
fn refused(status: reqwest::StatusCode) -> bool {
    matches!(status.as_u16(), 401 | 403)
}

fn request_failure(e: &reqwest::Error) -> Outcome {
    if e.is_timeout() {
        Outcome::Failure(Failure::Timeout)
    } else {
        Outcome::Failure(Failure::ConnectFailure)
    }
}

/// The engine generated at least one token: a completion token count, a
/// non-empty text (visible, reasoning, or tool call), or a finish for
/// having reached the token limit.
pub fn generated(answer: &Value) -> bool {
    if answer["usage"]["completion_tokens"]
        .as_u64()
        .is_some_and(|n| n > 0)
    {
        return true;
    }
    let choice = &answer["choices"][0];
    let message = &choice["message"];
    let nonempty = |v: &Value| v.as_str().is_some_and(|s| !s.is_empty());
    nonempty(&choice["text"])
        || nonempty(&message["content"])
        || nonempty(&message["reasoning_content"])
        || nonempty(&message["reasoning"])
        || message["tool_calls"]
            .as_array()
            .is_some_and(|calls| !calls.is_empty())
        || choice["finish_reason"].as_str() == Some("length")
}

/// Runs probes until the task is dropped.
pub async fn run(
    router: Arc<Router>,
    observer: Arc<Observer>,
    client: EngineClient,
    params: ProbeParams,
) {
    if !params.enabled {
        return;
    }
    let limit = Arc::new(Semaphore::new(params.concurrency.max(1)));
    let running: Arc<Mutex<HashSet<ReplicaKey>>> = Arc::default();
    let refused: Arc<Mutex<HashSet<ReplicaKey>>> = Arc::default();
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        for ProbeTarget {
            key,
            id,
            model,
            url: base,
        } in router.probe_targets()
        {
            if !lock(&running).insert(key) {
                continue;
            }
            let (client, router, limit) = (client.clone(), Arc::clone(&router), Arc::clone(&limit));
            let (observer, running, refused) = (
                Arc::clone(&observer),
                Arc::clone(&running),
                Arc::clone(&refused),
            );
            tokio::spawn(async move {
                if let Ok(_permit) = limit.acquire().await {
                    let (addr, rank) = key;
                    let outcome =
                        probe_once(&client, &base, model.as_deref(), rank, params.timeout).await;
                    let was_refused = lock(&refused).contains(&key);
                    match outcome {
                        Outcome::Unauthorized(status) if !was_refused => {
                            lock(&refused).insert(key);
                            tracing::warn!(
                                replica = %id,
                                status,
                                "the engine refuses the sidecar's probe credentials \
                                 (HEARTH_ENGINE_API_KEY); the replica is not fenced for it"
                            );
                        }
                        Outcome::Unauthorized(_) => {}
                        _ if was_refused => {
                            lock(&refused).remove(&key);
                            tracing::info!(replica = %id, "the engine accepts the probe's credentials again");
                        }
                        _ => {}
                    }
                    observer.probe(addr, outcome);
                    router.record_probe(key, outcome);
                }
                lock(&running).remove(&key);
            });
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_generated_token_passes_wherever_it_went() {
        let pass = [
            json!({"choices": [{"text": "ok", "finish_reason": "length"}]}),
            json!({"choices": [{"message": {"content": "ok"}}]}),
            // A reasoning model's first token, no visible text yet.
            json!({"choices": [{"message": {"content": null, "reasoning_content": "Hm"}, "finish_reason": "length"}]}),
            json!({"choices": [{"message": {"content": ""}, "finish_reason": "stop"}], "usage": {"completion_tokens": 1}}),
            json!({"choices": [{"message": {"content": ""}, "finish_reason": "length"}]}),
        ];
        for v in &pass {
            assert!(generated(v), "{v}");
        }
        let fail = [
            json!({"choices": [{"message": {"content": ""}, "finish_reason": "stop"}], "usage": {"completion_tokens": 0}}),
            json!({"choices": [{"message": {"content": ""}, "finish_reason": "stop"}]}),
            json!({"choices": []}),
            json!({"error": "x"}),
        ];
        for v in &fail {
            assert!(!generated(v), "{v}");
        }
    }
}

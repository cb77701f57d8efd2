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
//! **Never behind real work.** A probe proves nothing a real request that
//! succeeds does not prove better, and one queued behind real work takes,
//! on a slot engine, the slot a conversation just paused in. So a serving
//! replica's probe is sent only while no real request runs or waits there
//! (this sidecar's, its peers' and the engine's own count), checked again
//! just before the generation goes out; a real request that succeeds
//! while the probe is pending answers it (the probe is dropped, which
//! cancels it in the engine, and counted as `answered`). On a slot engine
//! (llama.cpp: `GET /slots` lists its slots) the generation is sent only
//! when a slot is idle and holds no conversation (empty, or holding the
//! previous probe, which carries [`PROBE_SEED`]), and it is pinned to that
//! slot (`id_slot`); with no such slot it is not sent (`withheld`). A
//! fenced replica is the exception: no conversation is kept on it, so its
//! re-admission probe goes to whichever slot the engine picks.
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
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::sync::Semaphore;

use crate::feeds::engines::EngineClient;
use crate::observe::Observer;
use hearth_router::health::{Failure, Outcome, ProbeReason};
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

/// The probe's sampling seed: it marks the slot a probe used on a slot
/// engine (`/slots` shows each slot's last task's seed), so the next probe
/// re-uses that slot and no other. Sampling is greedy, so it changes
/// nothing else.
pub const PROBE_SEED: u64 = 0x4845_4152;

/// How often the prober looks for replicas that are due.
const TICK: Duration = Duration::from_millis(250);

/// How often a pending probe looks for a real success that answers it.
const ANSWER_POLL: Duration = Duration::from_millis(100);

/// How a probe ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProbeEnd {
    /// It ran, and found this.
    Ran(Outcome),
    /// Not sent to the engine, for this reason.
    Withheld(Withheld),
    /// A real request succeeded while it was pending: that is the proof,
    /// and the probe was dropped.
    Answered,
}

/// Why a probe's generation was not sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Withheld {
    /// Real requests came to the replica while it was being prepared.
    Busy,
    /// The slot engine had no idle slot free of conversations.
    NoFreeSlot,
}

impl ProbeEnd {
    /// The `result` label of `hearth_probes_total`.
    pub fn as_str(self) -> &'static str {
        match self {
            ProbeEnd::Ran(Outcome::Success) => "success",
            ProbeEnd::Ran(Outcome::Neutral) => "neutral",
            ProbeEnd::Ran(Outcome::Unauthorized(_)) => "unauthorized",
            ProbeEnd::Ran(Outcome::Failure(f)) => f.as_str(),
            ProbeEnd::Withheld(Withheld::Busy) => "withheld_busy",
            ProbeEnd::Withheld(Withheld::NoFreeSlot) => "withheld_no_free_slot",
            ProbeEnd::Answered => "answered",
        }
    }

    /// What the replica's health learns from it: only a probe that ran
    /// says anything (a withheld or answered one is recorded as neutral,
    /// so the next one waits its interval).
    pub fn outcome(self) -> Outcome {
        match self {
            ProbeEnd::Ran(o) => o,
            ProbeEnd::Withheld(_) | ProbeEnd::Answered => Outcome::Neutral,
        }
    }
}

/// What a probe must respect on its way to the engine.
pub struct Gate<'a> {
    /// Asked just before the generation is sent: false while real
    /// requests run or wait on the replica.
    pub may_send: &'a (dyn Fn() -> bool + Send + Sync),
    /// The replica is fenced: a slot engine may use any idle slot.
    pub any_slot: bool,
}

impl Gate<'static> {
    /// No real traffic to respect (a lone engine, the tests).
    pub fn open() -> Gate<'static> {
        Gate {
            may_send: &|| true,
            any_slot: false,
        }
    }
}

/// A slot engine's slot for the probe: `Ok(Some(id))` pins it there,
/// `Ok(None)` is not a slot engine (or any slot will do), `Err` withholds
/// the probe.
async fn probe_slot(
    client: &EngineClient,
    base: &str,
    timeout: Duration,
    any_slot: bool,
) -> Result<Option<u64>, ProbeEnd> {
    let resp = match client.get(&format!("{base}/slots"), timeout).await {
        Ok(r) => r,
        Err(e) => return Err(ProbeEnd::Ran(request_failure(&e))),
    };
    let status = resp.status();
    if refused(status) {
        return Err(ProbeEnd::Ran(Outcome::Unauthorized(status.as_u16())));
    }
    // llama.cpp started with --no-slots: a slot engine that does not say
    // what its slots hold.
    if status.as_u16() == 501 {
        return if any_slot {
            Ok(None)
        } else {
            Err(ProbeEnd::Withheld(Withheld::NoFreeSlot))
        };
    }
    if !status.is_success() {
        return Ok(None);
    }
    let Ok(slots) = resp.json::<Value>().await else {
        return Ok(None);
    };
    let Some(slots) = slots.as_array() else {
        return Ok(None);
    };
    match free_slot(slots) {
        Some(id) => Ok(Some(id)),
        None if any_slot => Ok(None),
        None => Err(ProbeEnd::Withheld(Withheld::NoFreeSlot)),
    }
}

/// The idle slot that holds no conversation, from llama.cpp's `/slots`:
/// the previous probe's (its last task carried [`PROBE_SEED`]) first, then
/// an empty one (no task yet, or no cached tokens).
pub fn free_slot(slots: &[Value]) -> Option<u64> {
    let idle = || {
        slots
            .iter()
            .filter(|s| s["is_processing"] == Value::Bool(false))
            .filter_map(|s| Some((s["id"].as_u64()?, s)))
    };
    let probes = idle().find(|(_, s)| s["params"]["seed"].as_u64() == Some(PROBE_SEED));
    let empty = || {
        idle().find(|(_, s)| s.get("id_task").is_none() || s["n_prompt_tokens"].as_u64() == Some(0))
    };
    probes.or_else(empty).map(|(id, _)| id)
}

/// Probes the engine at `base` (`http://ip:port` or `https://ip:port`), rank `rank` when it
/// has data-parallel ranks, with no real traffic to respect (see
/// [`probe`]).
pub async fn probe_once(
    client: &EngineClient,
    base: &str,
    model: Option<&str>,
    rank: Option<u32>,
    timeout: Duration,
) -> Outcome {
    probe(client, base, model, rank, timeout, &Gate::open())
        .await
        .outcome()
}

/// Probes the engine at `base`, rank `rank` when it has data-parallel
/// ranks. `model` is the model to ask for; when `None` the first one
/// `/v1/models` lists is used. The generation is sent only as `gate`
/// allows (see the module's notes).
pub async fn probe(
    client: &EngineClient,
    base: &str,
    model: Option<&str>,
    rank: Option<u32>,
    timeout: Duration,
    gate: &Gate<'_>,
) -> ProbeEnd {
    use ProbeEnd::Ran;
    let models = match client.get(&format!("{base}/v1/models"), timeout).await {
        Ok(r) if refused(r.status()) => return Ran(Outcome::Unauthorized(r.status().as_u16())),
        Ok(r) if r.status().is_success() => r.json::<Value>().await.ok(),
        Ok(_) => None,
        Err(e) => return Ran(request_failure(&e)),
    };
    let listed = models
        .as_ref()
        .and_then(|m| m["data"][0]["id"].as_str())
        .map(str::to_string);
    let Some(model) = model.map(str::to_string).or(listed) else {
        return Ran(Outcome::Failure(Failure::ProbeModels));
    };
    let slot = match probe_slot(client, base, timeout, gate.any_slot).await {
        Ok(slot) => slot,
        Err(end) => return end,
    };
    if !(gate.may_send)() {
        return ProbeEnd::Withheld(Withheld::Busy);
    }
    let rank_header = rank.map(|r| (DP_RANK, r.to_string()));
    let mut completion = json!({
        "model": model,
        "prompt": PROBE_PROMPT,
        "max_tokens": 1,
        "temperature": 0,
        "seed": PROBE_SEED,
        "stream": false,
    });
    let mut chat = json!({
        "model": model,
        "messages": [{"role": "user", "content": PROBE_PROMPT}],
        "max_tokens": 1,
        "temperature": 0,
        "seed": PROBE_SEED,
        "stream": false,
    });
    if let Some(id) = slot {
        completion["id_slot"] = json!(id);
        chat["id_slot"] = json!(id);
    }
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
            Err(e) => return Ran(request_failure(&e)),
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
        return Ran(Outcome::Failure(Failure::ServerError));
    };
    let status = resp.status();
    if refused(status) {
        return Ran(Outcome::Unauthorized(status.as_u16()));
    }
    if status.is_server_error() {
        return Ran(Outcome::Failure(Failure::ServerError));
    }
    Ran(match resp.json::<Value>().await {
        Ok(v) if status.is_success() && generated(&v) => Outcome::Success,
        Err(e) if e.is_timeout() => Outcome::Failure(Failure::Timeout),
        _ => Outcome::Failure(Failure::EmptyAnswer),
    })
}

/// 401 and 403: the engine refuses the sidecar's credentials.
fn refused(status: reqwest::StatusCode) -> bool {
    matches!(status.as_u16(), 401 | 403)
}

fn request_failure(e: &reqwest::Error) -> Outcome {
    if e.is_timeout() {
        Outcome::Failure(Failure::Timeout)
    } else if e.is_connect() {
        Outcome::Failure(Failure::ConnectFailure)
    } else {
        // Connected, then cut before an answer: still a failed probe (a
        // strike), named for what happened.
        Outcome::Failure(Failure::ConnectionReset)
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
            reason,
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
                    let started = Instant::now();
                    let may_send = {
                        let router = Arc::clone(&router);
                        move || router.probe_may_proceed(key, reason)
                    };
                    let gate = Gate {
                        may_send: &may_send,
                        any_slot: reason == ProbeReason::Readmit,
                    };
                    let sent = probe(
                        &client,
                        &base,
                        model.as_deref(),
                        rank,
                        params.timeout,
                        &gate,
                    );
                    // Dropping the probe closes its connection: the engine
                    // cancels it.
                    let end = tokio::select! {
                        end = sent => end,
                        () = answered(&router, key, started) => ProbeEnd::Answered,
                    };
                    let was_refused = lock(&refused).contains(&key);
                    match end.outcome() {
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
                        _ if was_refused && matches!(end, ProbeEnd::Ran(_)) => {
                            lock(&refused).remove(&key);
                            tracing::info!(replica = %id, "the engine accepts the probe's credentials again");
                        }
                        _ => {}
                    }
                    observer.probe(addr, end.as_str());
                    router.record_probe(key, end.outcome());
                }
                lock(&running).remove(&key);
            });
        }
    }
}

/// Resolves once a real request on `key` has succeeded after `since`.
async fn answered(router: &Router, key: ReplicaKey, since: Instant) {
    loop {
        tokio::time::sleep(ANSWER_POLL).await;
        if router.served_since(key, since) {
            return;
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
    fn the_probe_takes_only_an_idle_slot_that_holds_no_conversation() {
        let slot = |id: u64, busy: bool, task: Option<(u64, u64)>| {
            let mut v = json!({"id": id, "n_ctx": 2048, "is_processing": busy});
            if let Some((seed, tokens)) = task {
                v["id_task"] = json!(7);
                v["n_prompt_tokens"] = json!(tokens);
                v["params"] = json!({"seed": seed});
            }
            v
        };
        let conversation = Some((4_294_967_295, 524));
        let probe = Some((PROBE_SEED, 31));
        // Both slots hold a paused conversation: not sent.
        assert_eq!(
            free_slot(&[slot(0, false, conversation), slot(1, false, conversation)]),
            None
        );
        // One is busy, the other holds a conversation: not sent.
        assert_eq!(
            free_slot(&[slot(0, true, None), slot(1, false, conversation)]),
            None
        );
        // An empty slot (never used, or cleared) is free.
        assert_eq!(
            free_slot(&[slot(0, false, conversation), slot(1, false, None)]),
            Some(1)
        );
        assert_eq!(
            free_slot(&[slot(0, false, Some((1, 0))), slot(1, false, conversation)]),
            Some(0)
        );
        // The previous probe's slot first, and never while it runs.
        assert_eq!(
            free_slot(&[slot(0, false, None), slot(1, false, probe)]),
            Some(1)
        );
        assert_eq!(
            free_slot(&[slot(0, true, probe), slot(1, false, conversation)]),
            None
        );
    }

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

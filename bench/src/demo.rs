//! `hearth-bench demo`: Envoy + filter-wasm + the sidecar in front of
//! simulated engines (or real ones named by `HEARTH_UPSTREAMS`), a short
//! multi-session agent conversation through it, a table of where each turn
//! went and how much of its prompt came from cache, then the gateway keeps
//! serving until Ctrl-C.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;

use crate::conversation::{cached_and_prompt_tokens, filler, reply_text, Conversation};
use crate::serve::EngineArgs;
use crate::settings::SidecarSettings;
use crate::stack::Stack;

#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// Gateway port on 127.0.0.1 (0 picks a free one).
    #[arg(long, env = "HEARTH_DEMO_PORT", default_value_t = 10000)]
    pub port: u16,
    /// Simulated engines to start when no upstreams are given.
    #[arg(long, default_value_t = 4)]
    pub engines: usize,
    /// Real engines instead of simulated ones: `ip:port,...` (same syntax
    /// as the sidecar's HEARTH_UPSTREAMS).
    #[arg(long, env = "HEARTH_UPSTREAMS")]
    pub upstreams: Option<String>,
    /// Model to request from real upstreams (default: the first upstream's
    /// /v1/models entry). Simulated engines serve `--model`.
    #[arg(long)]
    pub upstream_model: Option<String>,
    /// Conversations sent side by side.
    #[arg(long, default_value_t = 4)]
    pub sessions: u64,
    /// Turns per conversation.
    #[arg(long, default_value_t = 4)]
    pub turns: u64,
    /// Exit after the demo instead of serving until Ctrl-C.
    #[arg(long)]
    pub exit: bool,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Sidecar settings (`--set HEARTH_NAME=VALUE`; default: the
    /// sidecar's defaults).
    #[command(flatten)]
    pub sidecar: SidecarSettings,
}

/// One chat turn through the gateway: the replica named in
/// `x-hearth-upstream` and the response body.
async fn send(
    client: &reqwest::Client,
    url: &str,
    body: &serde_json::Value,
) -> anyhow::Result<(String, serde_json::Value)> {
    let resp = client.post(url).json(body).send().await?;
    let status = resp.status();
    let replica = resp
        .headers()
        .get("x-hearth-upstream")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("?")
        .to_string();
    let v: serde_json::Value = resp.json().await?;
    if !status.is_success() {
        bail!("the gateway answered {status}: {v}");
    }
    Ok((replica, v))
}

async fn first_model(client: &reqwest::Client, upstream: &str) -> anyhow::Result<String> {
    let v: serde_json::Value = client
        .get(format!("http://{upstream}/v1/models"))
        .send()
        .await?
        .json()
        .await?;
    v["data"][0]["id"]
        .as_str()
        .map(str::to_string)
        .context("the upstream's /v1/models lists no model; pass --upstream-model")
}

pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    // Engines (the given upstreams, or simulated ones on free ports), the
    // sidecar, then Envoy pointed at it.
    let builder = match &args.upstreams {
        Some(list) if !list.trim().is_empty() => {
            Stack::running(list.split(',').map(str::to_string).collect())
        }
        _ => Stack::simulated((0..args.engines).map(|i| args.engine.config(i)).collect()),
    };
    let simulated = !matches!(&args.upstreams, Some(list) if !list.trim().is_empty());
    let stack = builder
        .listen(SocketAddr::from(([127, 0, 0, 1], args.port)))
        .settings(args.sidecar.set.iter().cloned())
        .envoy_deadline(Duration::from_secs(30))
        .start()
        .await?;
    let envoy = &stack.envoy;
    let addrs = &stack.addrs;
    let client = reqwest::Client::new();
    let model = match (&args.upstream_model, simulated) {
        (Some(m), _) => m.clone(),
        (None, true) => args.engine.model.clone(),
        (None, false) => first_model(&client, &addrs[0].to_string()).await?,
    };
    println!(
        "Hearth gateway on {} -> {} replicas (sidecar state: http://{}/state)\n",
        envoy.url(),
        addrs.len(),
        stack.admin()
    );

    // 3. Sessions that share one 24 KiB harness prompt, turns interleaved.
    let system = format!("You are a coding agent.\n{}", filler(0xC0DE, 24 * 1024));
    let mut sessions: Vec<Conversation> = (1..=args.sessions)
        .map(|s| Conversation::new(&model, &system, true, s))
        .collect();
    println!(
        "{:<8} {:>4}  {:<12} {:>13} {:>13} {:>7}",
        "session", "turn", "replica", "prompt_tokens", "cached_tokens", "cached"
    );
    let mut homes: Vec<Option<String>> = vec![None; sessions.len()];
    let (mut stayed, mut later_turns, mut cached_sum, mut prompt_sum) = (0u64, 0u64, 0u64, 0u64);
    for turn in 1..=args.turns {
        // Every session sends its turn at the same moment, as a swarm of
        // agents would: load, not only warmth, shapes where new work goes.
        let url = format!("{}/v1/chat/completions", envoy.url());
        // The first turn carries the session's own context (files the
        // agent read); later turns add a question and a tool result.
        let user_bytes = if turn == 1 { 32 * 1024 } else { 2_000 };
        let bodies: Vec<_> = sessions
            .iter_mut()
            .map(|c| c.next_turn(user_bytes, false))
            .collect();
        let replies =
            futures::future::join_all(bodies.iter().map(|body| send(&client, &url, body))).await;
        for (s, (conv, reply)) in sessions.iter_mut().zip(replies).enumerate() {
            let (replica, v) =
                reply.with_context(|| format!("turn {turn} of session {}", s + 1))?;
            let (cached, prompt) = cached_and_prompt_tokens(&v);
            let pct = if prompt > 0 {
                100.0 * cached as f64 / prompt as f64
            } else {
                0.0
            };
            println!(
                "{:<8} {:>4}  {:<12} {:>13} {:>13} {:>6.1}%",
                s + 1,
                turn,
                replica,
                prompt,
                cached,
                pct
            );
            if turn > 1 {
                later_turns += 1;
                stayed += u64::from(homes[s].as_deref() == Some(replica.as_str()));
                cached_sum += cached;
                prompt_sum += prompt;
            }
            homes[s] = Some(replica);
            conv.push_assistant(&reply_text(&v));
            conv.push_tool_round(12_000);
        }
    }
    if later_turns > 0 {
        println!(
            "\nturns after the first: {later_turns}; stayed on their replica: {stayed}; prompt tokens from cache: {:.1}%",
            100.0 * cached_sum as f64 / prompt_sum.max(1) as f64
        );
    }
    if args.exit {
        stack.shutdown().await;
        return Ok(());
    }
    println!(
        "\nServing until Ctrl-C. Try:\n  curl -s {}/v1/chat/completions -H 'content-type: application/json' \\\n    -d '{{\"model\":\"{model}\",\"messages\":[{{\"role\":\"user\",\"content\":\"hello\"}}]}}'",
        envoy.url()
    );
    tokio::signal::ctrl_c().await?;
    stack.shutdown().await;
    Ok(())
}

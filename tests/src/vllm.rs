//! Real vLLM engines behind the gateway ([`VllmFleet`]), beside
//! [`crate::LlamaFleet`]'s llama.cpp ones.

use hearth_bench::vllm::{VllmConfig, VllmInstall, VllmServer};

use crate::Fleet;

/// The model name clients ask every vLLM replica for (each also answers to
/// its replica id, which it reports as the answer's `model`).
pub const VLLM_MODEL: &str = "llama-4x512";

/// Whether the vLLM tests can run here: vLLM is installed
/// (`scripts/setup`). Outside CI, a machine without it skips them and says
/// so on stderr; under `CI=true` a missing engine is a failure, never a
/// skip.
pub fn vllm_or_skip(test: &str) -> bool {
    match VllmInstall::find() {
        Ok(_) => true,
        Err(e) if std::env::var("CI").is_ok_and(|v| v == "true") => {
            panic!("{test}: {e:#} (CI=true: the real-engine tests must run)")
        }
        Err(e) => {
            eprintln!("{test}: SKIPPED, {e:#}");
            false
        }
    }
}

/// The end-to-end tests' vLLM: one CPU thread (two engines share a
/// two-core machine), eight requests at once, 4,096 tokens per request,
/// and the parsers of a reasoning model with tools: text between
/// `<think>` and `</think>` is `reasoning` (`olmo3` matches the text, so
/// SmolLM2's vocabulary serves), named tool choices answer in
/// `tool_calls`, and a request's structured output holds from its first
/// token (random weights never end their reasoning by themselves).
pub fn small_vllm() -> VllmConfig {
    VllmConfig {
        threads: 1,
        max_num_seqs: 8,
        max_model_len: 4096,
        extra_args: [
            "--reasoning-parser",
            "olmo3",
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "pythonic",
            "--structured-outputs-config.enable_in_reasoning",
            "true",
        ]
        .map(String::from)
        .to_vec(),
        ..VllmConfig::default()
    }
}

/// Real vLLM engines behind the gateway, each answering to its replica id
/// (`vllm-0`, `vllm-1`, ...) and to [`VLLM_MODEL`]: clients ask for
/// [`VLLM_MODEL`], and the answer's `model` is the first served name, the
/// replica id, so it names the engine that really produced it.
pub struct VllmFleet {
    /// Dropped first: Envoy and the sidecar go before the engines.
    pub fleet: Fleet,
    pub engines: Vec<VllmServer>,
}

impl VllmFleet {
    /// Starts `n` engines with `config` (its served name replaced by
    /// `vllm-I` and [`VLLM_MODEL`]; they start together), then the sidecar
    /// with `sidecar_flags` and Envoy in front of them.
    pub async fn start(
        n: usize,
        config: &VllmConfig,
        sidecar_flags: &[&str],
    ) -> anyhow::Result<VllmFleet> {
        let engines = futures::future::try_join_all((0..n).map(|i| {
            VllmServer::start(VllmConfig {
                served_model_name: format!("vllm-{i}"),
                aliases: vec![VLLM_MODEL.into()],
                ..config.clone()
            })
        }))
        .await?;
        let named = engines
            .iter()
            .map(|e| (e.config().served_model_name.clone(), e.addr));
        let fleet = Fleet::in_front_of(named, sidecar_flags).await?;
        Ok(VllmFleet { fleet, engines })
    }

    /// Index of the engine whose replica id is `id`.
    pub fn index(&self, id: &str) -> usize {
        self.engines
            .iter()
            .position(|e| e.config().served_model_name == id)
            .unwrap_or_else(|| panic!("no engine {id}"))
    }
}

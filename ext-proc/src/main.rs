//! `hearth-ext-proc`: parse and check the settings, start, serve until
//! SIGINT/SIGTERM, drain. SIGHUP reloads the replica list from
//! `HEARTH_UPSTREAMS_FILE`. `hearth-ext-proc envoy-config` prints an
//! Envoy configuration instead.

use clap::Parser;
use hearth_ext_proc::config::{check_env, Cli, Command, PeerSeed};
use hearth_ext_proc::Sidecar;
use tokio::signal::unix::{signal, SignalKind};

fn main() -> anyhow::Result<()> {
    // An empty HEARTH_* variable means "unset" (the setting's default), as
    // a ConfigMap listing every setting needs. Done before any thread
    // starts, while changing the environment is sound.
    let empty: Vec<String> = std::env::vars_os()
        .filter(|(k, v)| k.to_string_lossy().starts_with("HEARTH_") && v.is_empty())
        .map(|(k, _)| k.to_string_lossy().into_owned())
        .collect();
    for k in empty {
        std::env::remove_var(k);
    }
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(run())
}

async fn run() -> anyhow::Result<()> {
    // `peer-public-key FILE` needs none of the sidecar's settings.
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [command, file] = args.as_slice() {
        if command == "peer-public-key" {
            print_public_key(std::path::Path::new(file));
            return Ok(());
        }
    }
    if let Err(e) = check_env(std::env::vars().map(|(k, _)| k)) {
        exit_with("", &[e]);
    }
    let mut cli = Cli::parse();
    if let Err(problems) = cli.settings.validate() {
        exit_with("", &problems);
    }
    // The replica file, read once here (Sidecar::start keeps this list).
    let from_file = cli
        .settings
        .upstreams_file
        .as_deref()
        .map(hearth_ext_proc::feeds::upstreams::read);
    match (from_file, &cli.command) {
        (Some(Ok(list)), _) => cli.settings.upstreams = list,
        // With endpoint discovery the bootstrap lists no engines, so the
        // file need not be readable where the config is rendered.
        (Some(Err(_)), Some(Command::EnvoyConfig(args))) if args.gateway(&cli.settings).eds => {}
        (Some(Err(problems)), _) => exit_with("HEARTH_UPSTREAMS_FILE: ", &problems),
        (None, _) => {}
    }
    if let Some(Command::PeerPublicKey { file }) = &cli.command {
        print_public_key(file);
        return Ok(());
    }
    if let Some(Command::EnvoyConfig(args)) = &cli.command {
        if let Err(e) = args.check(&cli.settings) {
            exit_with("envoy-config: ", &[e]);
        }
        print!("{}", args.render(&cli.settings));
        return Ok(());
    }
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_new(&cli.settings.log)?)
        .with_writer(std::io::stderr)
        // Colour codes only on a terminal, never in a collected log.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();

    // SIGHUP never ends the sidecar: it reloads the replica list, or says
    // why it cannot. (Handled from before the listeners open.)
    let mut hangup = signal(SignalKind::hangup())?;
    let sidecar = Sidecar::start(&cli.settings).await?;
    tracing::info!(
        grpc = %sidecar.grpc_addr,
        state = %sidecar.admin_addr,
        replicas = sidecar.router.snapshot().replicas.len(),
        basis = %cli.settings.affinity_basis,
        "hearth-ext-proc serving"
    );
    let reload = sidecar.reload_trigger();
    tokio::spawn(async move {
        while hangup.recv().await.is_some() {
            match &reload {
                Some(asked) => asked.notify_one(),
                None => tracing::warn!(
                    "SIGHUP: the replica list comes from HEARTH_UPSTREAMS, which cannot change \
                     while the sidecar runs; set HEARTH_UPSTREAMS_FILE to reload it"
                ),
            }
        }
    });
    sidecar.run_until(terminated()).await
}

/// Reports problems (each after `prefix`) and exits with status 2.
fn exit_with(prefix: &str, problems: &[String]) -> ! {
    for p in problems {
        eprintln!("hearth-ext-proc: {prefix}{p}");
    }
    std::process::exit(2);
}

/// Resolves on SIGINT or SIGTERM.
async fn terminated() -> anyhow::Result<()> {
    let mut term = signal(SignalKind::terminate())?;
    tokio::select! {
        r = tokio::signal::ctrl_c() => r?,
        _ = term.recv() => {}
    }
    Ok(())
}

/// `peer-public-key FILE`: the identity file's public key, as a members
/// file lists it.
fn print_public_key(file: &std::path::Path) {
    let identity = PeerSeed::read(file)
        .and_then(|seed| hearth_ext_proc::feeds::peer_guard::Identity::of(&seed, None));
    match identity {
        Ok(identity) => println!("{}", identity.public_key_hex()),
        Err(e) => exit_with("peer-public-key: ", &[e]),
    }
}

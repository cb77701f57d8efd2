//! `hearth-ext-proc`: parse and check settings, serve until SIGINT/SIGTERM.

use clap::Parser;
use hearth_ext_proc::config::{check_env, Cli, Command};
use hearth_ext_proc::Sidecar;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    if let Err(e) = check_env(std::env::vars().map(|(k, _)| k)) {
        eprintln!("hearth-ext-proc: {e}");
        std::process::exit(2);
    }
    let cli = Cli::parse();
    if let Err(problems) = cli.settings.validate() {
        for p in problems {
            eprintln!("hearth-ext-proc: {p}");
        }
        std::process::exit(2);
    }
    if let Some(Command::EnvoyConfig(args)) = &cli.command {
        print!("{}", args.render(&cli.settings));
        return Ok(());
    }
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_new(&cli.settings.log)?)
        .with_writer(std::io::stderr)
        .init();

    let sidecar = Sidecar::start(&cli.settings).await?;
    tracing::info!(
        grpc = %sidecar.grpc_addr,
        state = %sidecar.admin_addr,
        replicas = cli.settings.upstreams.len(),
        basis = %cli.settings.affinity_basis,
        "hearth-ext-proc serving"
    );
    sidecar.run_until(wait_for_signal()).await
}

async fn wait_for_signal() -> anyhow::Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        r = tokio::signal::ctrl_c() => r?,
        _ = term.recv() => {}
    }
    Ok(())
}

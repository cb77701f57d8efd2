//! `hearth-bench`: the Hearth engine simulator and benchmark driver.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;

/// Hearth benchmark kit: simulated engines and routing benchmarks.
#[derive(Debug, Parser)]
#[command(name = "hearth-bench", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Start simulated OpenAI-compatible engines and serve until Ctrl-C/SIGTERM.
    Serve(hearth_bench::serve::ServeArgs),
    /// Router overhead: plain Envoy vs Hearth vs body-over-gRPC, same engines and requests.
    Overhead(hearth_bench::overhead::OverheadArgs),
    /// Run Envoy + filter-wasm + sidecar in front of simulated engines, show a
    /// multi-session demo, then keep the gateway serving until Ctrl-C.
    Demo(hearth_bench::demo::DemoArgs),
    /// Routing-quality benchmark, discrete-event: every policy on the same
    /// seeded workload and simulated engines, in engine time.
    Sim(hearth_bench::sim::SimArgs),
    /// Minutes of agent traffic through Envoy while a replica stalls, another
    /// is killed and restarted, and the sidecar is restarted; checks that
    /// nothing leaks.
    Soak(hearth_bench::soak::SoakArgs),
    /// A scenario's workload through the real Envoy, filter, sidecar and
    /// HTTP engines (time-scaled), beside the same cell in the simulator;
    /// with `--policies`, plain Envoy and the peer routers (smg,
    /// vllm-router) too, each on fresh engines.
    Live(hearth_bench::live::LiveCli),
    /// Tenant fairness and priority on an overloaded fleet, live: a noisy
    /// tenant beside quiet ones and a high band beside sheddable load,
    /// under Envoy least_request, Hearth without and with flow control,
    /// and smg's priority scheduler (when installed).
    Tenants(hearth_bench::tenants::TenantsArgs),
    /// Routing policies (plain Envoy, Hearth, the peer routers smg and
    /// vllm-router) in front of real OpenAI-compatible engines given by
    /// address, one after the other: the same seeded workload
    /// (conversations or shared-prefix) through each, one table, cache
    /// hits from the engines. `compare` is the same command.
    #[command(alias = "compare")]
    Real(hearth_bench::real::RealArgs),
    /// Pool several `real --json` runs into one table per policy (TTFT
    /// percentiles over every turn of every run).
    Pool(hearth_bench::pool::PoolArgs),
    /// Start real vLLM servers (the install `scripts/setup` makes) on
    /// loopback, print their addresses and serve until Ctrl-C/SIGTERM.
    Vllm(hearth_bench::vllm::VllmArgs),
}

#[tokio::main]
async fn main() -> ExitCode {
    // Logs go to stderr: stdout carries machine-read output.
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let result = match Cli::parse().command {
        Command::Serve(args) => hearth_bench::serve::run(args).await,
        Command::Overhead(args) => hearth_bench::overhead::run(args).await,
        Command::Demo(args) => hearth_bench::demo::run(args).await,
        Command::Soak(args) => hearth_bench::soak::run(args).await,
        Command::Live(args) => hearth_bench::live::run(args).await,
        Command::Tenants(args) => hearth_bench::tenants::run(args).await,
        Command::Real(args) => hearth_bench::real::run(args).await,
        Command::Vllm(args) => hearth_bench::vllm::run(args).await,
        Command::Pool(args) => hearth_bench::pool::run(args).await,
        Command::Sim(args) => tokio::task::spawn_blocking(move || hearth_bench::sim::main(args))
            .await
            .map_err(anyhow::Error::from)
            .and_then(|r| r),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One clear line, not a backtrace: most failures are bad settings.
            eprintln!("hearth-bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_subcommand_parses_its_own_flags() {
        use clap::CommandFactory;
        super::Cli::command().debug_assert();
    }
}

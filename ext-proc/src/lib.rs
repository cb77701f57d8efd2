//! Hearth's ext_proc sidecar.
//!
//! Envoy's wasm filter fingerprints each prompt inside the proxy; this
//! sidecar owns what must be shared across Envoy's worker threads (and
//! across Envoys): each replica's warmth and in-flight load. For every
//! request it scores the replicas, reserves load on the winner for the
//! request's whole life, and answers with the destination header that
//! Envoy's override_host load-balancing policy honours.
//!
//! Modules, in the order a request meets them: [`service`] (the gRPC
//! stream), [`router`] (the decision), [`policy`] (the scoring rule),
//! [`warmth`] (per-replica LRU of block hashes). [`config`] holds the
//! settings, [`upstreams`] the replica list's file and its reloads,
//! [`admin`] the state endpoint, [`eds`] the engines' endpoints for Envoy,
//! [`envoy_config`] the Envoy bootstrap generator.

pub mod admin;
pub mod body;
pub mod config;
pub mod eds;
pub mod engines;
pub mod envoy_config;
pub mod health;
pub mod journal;
pub mod metrics;
pub mod observe;
pub mod picker;
pub mod policy;
pub mod probe;
pub mod router;
pub mod series;
pub mod service;
pub mod signals;
pub mod upstreams;
pub mod warmth;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::net::TcpListener;
use tokio::sync::{oneshot, Notify};
use tokio::task::JoinHandle;

pub use config::Settings;
pub use router::Router;

/// A running sidecar: the gRPC service and the state endpoint.
pub struct Sidecar {
    pub grpc_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    pub router: Arc<Router>,
    /// Metrics, decision journal and the dashboard's history.
    pub observer: Arc<observe::Observer>,
    /// Set when the replica list comes from `HEARTH_UPSTREAMS_FILE`:
    /// notify it to reload now (SIGHUP).
    reload: Option<Arc<Notify>>,
    /// The task that reloads it.
    watcher: Option<JoinHandle<()>>,
    stop: Option<oneshot::Sender<()>>,
    drain: Duration,
    task: JoinHandle<anyhow::Result<()>>,
}

impl Sidecar {
    /// Binds both listeners (port 0 picks a free one) and starts serving.
    /// With `HEARTH_UPSTREAMS_FILE`, the replica list is read from the file
    /// now (a bad file is an error) and reloaded as it changes.
    pub async fn start(settings: &Settings) -> anyhow::Result<Sidecar> {
        let mut settings = settings.clone();
        let reload = match &settings.upstreams_file {
            Some(path) => {
                settings.upstreams = upstreams::read(path)
                    .map_err(|problems| anyhow::anyhow!(problems.join("; ")))?;
                Some(Arc::new(Notify::new()))
            }
            None => None,
        };
        let settings = &settings;
        let grpc = TcpListener::bind(settings.listen)
            .await
            .with_context(|| format!("binding the gRPC listener on {}", settings.listen))?;
        let admin = TcpListener::bind(settings.admin_listen)
            .await
            .with_context(|| format!("binding the state endpoint on {}", settings.admin_listen))?;
        let grpc_addr = grpc.local_addr()?;
        let admin_addr = admin.local_addr()?;
        let router = Router::new(settings);
        let journal =
            journal::Journal::open(settings.journal_size, settings.journal_file.as_deref())
                .context("opening HEARTH_JOURNAL_FILE")?;
        let observer =
            observe::Observer::new(Arc::clone(&router), settings.affinity_basis, journal);
        let watcher = match (&settings.upstreams_file, &reload) {
            (Some(path), Some(asked)) => Some(tokio::spawn(upstreams::watch(
                upstreams::Reloader::new(Arc::clone(&router), path.clone()),
                config::seconds(settings.upstreams_poll_seconds),
                Arc::clone(asked),
            ))),
            _ => None,
        };
        let engines =
            engines::EngineClient::new(settings.engine_api_key().map_err(|e| anyhow::anyhow!(e))?);
        let (stop, stopped) = oneshot::channel::<()>();
        let feeds = Feeds {
            engines,
            probes: settings.probe_params(),
            engine_metrics: config::seconds(settings.engine_metrics_seconds),
        };
        let task = tokio::spawn(serve(
            Arc::clone(&observer),
            feeds,
            service::FirstByte {
                timeout: config::seconds(settings.first_byte_timeout_seconds),
                prefill_bytes_per_second: settings.prefill_bytes_per_second,
            },
            grpc,
            admin,
            async {
                let _ = stopped.await;
            },
        ));
        Ok(Sidecar {
            grpc_addr,
            admin_addr,
            router,
            observer,
            reload,
            watcher,
            stop: Some(stop),
            drain: Duration::from_secs(settings.drain_seconds),
            task,
        })
    }

    /// Asks for the replica list to be reloaded from `HEARTH_UPSTREAMS_FILE`
    /// now (what SIGHUP does). False when the list does not come from a
    /// file, so there is nothing to reload.
    pub fn reload_upstreams(&self) -> bool {
        self.reload_trigger()
            .map(|asked| asked.notify_one())
            .is_some()
    }

    /// What [`Sidecar::reload_upstreams`] notifies, for a signal handler.
    pub fn reload_trigger(&self) -> Option<Arc<Notify>> {
        self.reload.clone()
    }

    /// Stops accepting and gives open streams `drain` to finish; streams
    /// still open then are cut (their reservations are released either way).
    pub async fn shutdown(mut self) -> anyhow::Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(w) = self.watcher.take() {
            w.abort();
        }
        match tokio::time::timeout(self.drain, &mut self.task).await {
            Ok(joined) => joined?,
            Err(_) => {
                self.task.abort();
                Ok(())
            }
        }
    }

    /// Serves until `signal` resolves (then shuts down) or a server fails.
    pub async fn run_until(
        mut self,
        signal: impl Future<Output = anyhow::Result<()>>,
    ) -> anyhow::Result<()> {
        tokio::select! {
            r = signal => {
                r?;
                tracing::info!("shutting down");
                self.shutdown().await
            }
            joined = &mut self.task => {
                joined??;
                anyhow::bail!("servers stopped unexpectedly")
            }
        }
    }
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        self.task.abort();
        if let Some(w) = &self.watcher {
            w.abort();
        }
    }
}

/// What the sidecar asks of the engines itself: probes and metrics
/// scrapes, with the engines' credentials.
struct Feeds {
    engines: engines::EngineClient,
    probes: probe::ProbeParams,
    engine_metrics: Duration,
}

async fn serve(
    observer: Arc<observe::Observer>,
    feeds: Feeds,
    first_byte: service::FirstByte,
    grpc: TcpListener,
    admin: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let router = Arc::clone(observer.router());
    let (tx, _) = tokio::sync::broadcast::channel::<()>(1);
    let mut grpc_stop = tx.subscribe();
    let mut admin_stop = tx.subscribe();
    // The standard gRPC health service mirrors the fleet: SERVING while at
    // least one replica serves.
    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    // Endpoint-discovery streams last as long as Envoy does: they are told
    // to end, or the graceful shutdown would wait for them.
    let (eds_stop, eds_stopping) = tokio::sync::watch::channel(false);
    let health_task = tokio::spawn(report_grpc_health(Arc::clone(&router), health_reporter));
    let grpc_server = tonic::transport::Server::builder()
        .add_service(health_service)
        .add_service(service::server(Arc::clone(&observer), first_byte))
        .add_service(eds::server(Arc::clone(&router), eds_stopping))
        // TCP_NODELAY: without it, Envoy's small ext_proc messages meet
        // Nagle and delayed ACKs and a decision waits ~40 ms (measured by
        // `hearth-bench overhead`).
        .serve_with_incoming_shutdown(
            tonic::transport::server::TcpIncoming::from(grpc).with_nodelay(Some(true)),
            async move {
                let _ = grpc_stop.recv().await;
            },
        );
    let admin_server = axum::serve(admin, admin::routes(Arc::clone(&observer)))
        .with_graceful_shutdown(async move {
            let _ = admin_stop.recv().await;
        });
    let prober = tokio::spawn(probe::run(
        Arc::clone(&router),
        Arc::clone(&observer),
        feeds.engines.clone(),
        feeds.probes,
    ));
    let sampler = tokio::spawn(observe::sample_every_second(Arc::clone(&observer)));
    let scraper = tokio::spawn(signals::run(
        Arc::clone(&router),
        feeds.engines,
        feeds.engine_metrics,
    ));
    let grpc_task = tokio::spawn(grpc_server);
    let admin_task = tokio::spawn(async move { admin_server.await });
    shutdown.await;
    let _ = tx.send(());
    let _ = eds_stop.send(true);
    grpc_task.await?.context("gRPC server")?;
    admin_task.await?.context("state endpoint")?;
    prober.abort();
    sampler.abort();
    scraper.abort();
    health_task.abort();
    Ok(())
}

async fn report_grpc_health(router: Arc<Router>, reporter: tonic_health::server::HealthReporter) {
    use tonic_health::ServingStatus;
    const SERVICE: &str = "envoy.service.ext_proc.v3.ExternalProcessor";
    let mut last = None;
    loop {
        let status = match router.fleet_health() {
            health::FleetHealth::Unhealthy => ServingStatus::NotServing,
            _ => ServingStatus::Serving,
        };
        if last != Some(status) {
            reporter.set_service_status("", status).await;
            reporter.set_service_status(SERVICE, status).await;
            last = Some(status);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

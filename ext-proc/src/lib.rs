//! Hearth's ext_proc sidecar.
//!
//! Envoy's wasm filter fingerprints each prompt inside the proxy; this
//! sidecar owns what must be shared across Envoy's worker threads (and
//! across Envoys): each replica's warmth and in-flight load. For every
//! request it scores the replicas, reserves load on the winner for the
//! request's whole life, and answers with the destination header that
//! Envoy's override_host load-balancing policy honours.
//!
//! Rooms:
//! - the decision and the fleet state it reads: the `hearth-router` crate
//!   (`ext-proc/router/`), no protocol in it;
//! - [`envoy`]: Envoy's protocols (ext_proc in its three shapes, endpoint
//!   discovery) and the Envoy configurations;
//! - [`feeds`]: what flows into the fleet state (replica list and reloads,
//!   probes, engine metrics);
//! - [`outcomes`]: a request's end, whoever reports it: health evidence
//!   and the answer's usage go to the router from here only;
//! - [`observe`]: metrics, the decision journal, the dashboard's series,
//!   the admin HTTP endpoint (it only reads);
//! - [`guard`]: who may call the two listeners (the control token, TLS)
//!   and what any caller may hold there (connections, deadlines);
//! - [`config`]: the settings; this file: starting, running and draining
//!   the whole.

pub mod config;
pub mod envoy;
pub mod feeds;
pub mod flow;
pub mod guard;
pub mod observe;
pub mod outcomes;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use config::Settings;
pub use hearth_router::Router;

/// A running sidecar: the gRPC service and the state endpoint.
pub struct Sidecar {
    pub grpc_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    pub router: Arc<Router>,
    /// Metrics, decision journal and the dashboard's history.
    pub observer: Arc<observe::Observer>,
    /// Where requests end (health evidence, usage against predictions).
    pub outcomes: Arc<outcomes::Outcomes>,
    /// Set when the replica list comes from `HEARTH_UPSTREAMS_FILE`:
    /// notify it to reload now (SIGHUP).
    reload: Option<Arc<Notify>>,
    /// The one shutdown signal: the servers stop accepting, endpoint
    /// discovery streams end, and the background tasks (file watcher,
    /// prober, scraper, sampler, gRPC health) stop.
    stop: CancellationToken,
    drain: Duration,
    task: JoinHandle<anyhow::Result<()>>,
}

impl Sidecar {
    /// Binds both listeners (port 0 picks a free one) and starts serving.
    /// With `HEARTH_UPSTREAMS_FILE`, the replica list is the file's (read
    /// now unless the settings already hold it; a bad file is an error)
    /// and is reloaded as it changes.
    pub async fn start(settings: &Settings) -> anyhow::Result<Sidecar> {
        let mut settings = settings.clone();
        let reload = match &settings.upstreams_file {
            Some(path) => {
                if settings.upstreams.is_empty() {
                    settings.upstreams = feeds::upstreams::read(path)
                        .map_err(|problems| anyhow::anyhow!(problems.join("; ")))?;
                }
                Some(Arc::new(Notify::new()))
            }
            None => None,
        };
        let settings = &settings;
        let guards = Guards {
            token: settings
                .control_token()
                .map_err(|e| anyhow::anyhow!(e))?
                .map(|t| Arc::new(guard::ControlToken::new(&t))),
            tls: guard::grpc_tls(settings)?,
            grpc_connections: settings.grpc_max_connections.max(1),
            admin_connections: settings.admin_max_connections.max(1),
        };
        tracing::info!(
            control_token = guards.token.is_some(),
            grpc_tls = guards.tls.is_some(),
            client_certificates = settings.grpc_tls_client_ca_file.is_some(),
            "control surfaces"
        );
        // HEARTH_DISCOVERY: the API is configured now; the list arrives
        // from the watch (readiness waits for it).
        let discovery = feeds::kube::connect(settings)
            .await
            .map_err(|e| anyhow::anyhow!(e))?;
        let grpc = TcpListener::bind(settings.listen)
            .await
            .with_context(|| format!("binding the gRPC listener on {}", settings.listen))?;
        let admin = TcpListener::bind(settings.admin_listen)
            .await
            .with_context(|| format!("binding the state endpoint on {}", settings.admin_listen))?;
        let grpc_addr = grpc.local_addr()?;
        let admin_addr = admin.local_addr()?;
        let router = Router::new(settings.router_params(), &settings.upstreams);
        match (&discovery, &settings.upstreams_file) {
            (Some(found), _) => router.set_source(found.target.describe(), false),
            (None, Some(_)) => router.set_source("file", true),
            (None, None) => router.set_source("list", true),
        }
        let journal = observe::journal::Journal::open(
            settings.journal_size,
            settings
                .journal_file
                .as_deref()
                .map(|path| (path, settings.journal_file_max_bytes)),
        )
        .context("opening HEARTH_JOURNAL_FILE")?;
        let observer = observe::Observer::new(
            Arc::clone(&router),
            settings.affinity_basis,
            journal,
            settings.pool_name(),
        );
        let outcomes = outcomes::Outcomes::new(Arc::clone(&observer));
        let stop = CancellationToken::new();
        if let (Some(path), Some(asked)) = (&settings.upstreams_file, &reload) {
            spawn_until(
                &stop,
                feeds::upstreams::watch(
                    feeds::upstreams::Reloader::new(Arc::clone(&router), path.clone()),
                    config::seconds(settings.upstreams_poll_seconds),
                    Arc::clone(asked),
                ),
            );
        }
        if let Some(found) = discovery {
            spawn_until(&stop, feeds::kube::run(Arc::clone(&router), found));
        }
        if let Some(peer_settings) =
            feeds::peers::PeerSettings::of(settings).map_err(|e| anyhow::anyhow!(e))?
        {
            let mut bus = feeds::peers::PeerBus::connect(
                Arc::clone(&router),
                peer_settings,
                Arc::clone(&observer.peers),
            )
            .await?;
            // A peer's state before the first decision (bounded: the
            // first sidecar of a fleet waits HEARTH_PEERS_SYNC_SECONDS).
            let warm = bus.sync().await;
            tracing::info!(warm, "peer bus: started");
            spawn_until(&stop, bus.run());
        }
        for warning in [
            settings.engine_key_exposure(),
            settings.peers_credentials_exposure(),
        ]
        .into_iter()
        .flatten()
        {
            tracing::warn!("{warning}");
        }
        let engines = feeds::engines::EngineClient::new(
            settings.engine_api_key().map_err(|e| anyhow::anyhow!(e))?,
            settings
                .engine_ca_pem()
                .map_err(|e| anyhow::anyhow!(e))?
                .as_deref(),
        )
        .map_err(|e| anyhow::anyhow!(e))?;
        let feeds = Feeds {
            engines,
            probes: feeds::probe::ProbeParams::of(settings),
            engine_metrics: config::seconds(settings.engine_metrics_seconds),
        };
        let task = tokio::spawn(serve(
            Arc::clone(&observer),
            Arc::clone(&outcomes),
            feeds,
            StreamLimits {
                first_byte: envoy::service::FirstByte {
                    timeout: config::seconds(settings.first_byte_timeout_seconds),
                    prefill_bytes_per_second: settings.prefill_bytes_per_second,
                },
                held: envoy::picker::HeldBudget::new(
                    settings.picker_held_bodies,
                    settings.picker_held_bytes,
                    observer.picker.clone(),
                ),
                flow: flow::FlowControl::new(Arc::clone(&observer), settings),
            },
            Listeners { grpc, admin },
            guards,
            stop.clone(),
        ));
        Ok(Sidecar {
            grpc_addr,
            admin_addr,
            router,
            observer,
            outcomes,
            reload,
            stop,
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
        self.stop.cancel();
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
        self.stop.cancel();
        self.task.abort();
    }
}

/// What the sidecar asks of the engines itself: probes, metrics scrapes
/// and (`kv_events=auto`) where they publish their KV events, with the
/// engines' credentials.
struct Feeds {
    engines: feeds::engines::EngineClient,
    probes: feeds::probe::ProbeParams,
    engine_metrics: Duration,
}

/// Who may call the listeners, and how many connections each holds.
struct Guards {
    token: Option<Arc<guard::ControlToken>>,
    tls: Option<tonic::transport::ServerTlsConfig>,
    grpc_connections: usize,
    admin_connections: usize,
}

/// What each ext_proc stream is held to: the first-byte deadline, and in
/// endpoint-picker mode the budget all streams' held bodies share.
struct StreamLimits {
    first_byte: envoy::service::FirstByte,
    held: envoy::picker::HeldBudget,
    /// Where requests wait while the fleet is saturated.
    flow: Arc<flow::FlowControl>,
}

/// The two bound listeners.
struct Listeners {
    grpc: TcpListener,
    admin: TcpListener,
}

async fn serve(
    observer: Arc<observe::Observer>,
    outcomes: Arc<outcomes::Outcomes>,
    feeds: Feeds,
    StreamLimits {
        first_byte,
        held,
        flow,
    }: StreamLimits,
    Listeners { grpc, admin }: Listeners,
    guards: Guards,
    stop: CancellationToken,
) -> anyhow::Result<()> {
    let router = Arc::clone(observer.router());
    // The standard gRPC health service mirrors the fleet: SERVING while at
    // least one replica serves.
    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    spawn_until(
        &stop,
        report_grpc_health(Arc::clone(&router), health_reporter),
    );
    spawn_until(
        &stop,
        feeds::probe::run(
            Arc::clone(&router),
            Arc::clone(&observer),
            feeds.engines.clone(),
            feeds.probes,
        ),
    );
    spawn_until(&stop, observe::sample_every_second(Arc::clone(&observer)));
    spawn_until(&stop, Arc::clone(&flow).run());
    spawn_until(
        &stop,
        feeds::kv_events::run(Arc::clone(&router), feeds.engines.clone()),
    );
    spawn_until(
        &stop,
        feeds::signals::run(Arc::clone(&router), feeds.engines, feeds.engine_metrics),
    );
    // Endpoint-discovery streams last as long as Envoy does: they end with
    // the token, or the graceful shutdown would wait for them.
    // No request deadline: an ext_proc stream lasts as long as the answer
    // it routes streams. Keepalive pings find a vanished Envoy, whose
    // streams (and reserved load) then end.
    let mut grpc_server = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(guard::GRPC_KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(guard::GRPC_KEEPALIVE_TIMEOUT))
        .max_concurrent_streams(guard::GRPC_MAX_STREAMS_PER_CONNECTION);
    if let Some(tls) = guards.tls {
        grpc_server = grpc_server.tls_config(tls)?;
    }
    // gRPC health stays open (probes); the rest needs the control token.
    let guarded = guard::GrpcGuard(guards.token.clone());
    let grpc_server = grpc_server
        .add_service(health_service)
        .add_service(tonic::service::interceptor::InterceptedService::new(
            envoy::service::server(
                Arc::clone(&observer),
                Arc::clone(&outcomes),
                first_byte,
                held,
                flow,
            ),
            guarded.clone(),
        ))
        .add_service(tonic::service::interceptor::InterceptedService::new(
            envoy::eds::server(Arc::clone(&router), stop.clone()),
            guarded,
        ))
        // TCP_NODELAY: without it, Envoy's small ext_proc messages meet
        // Nagle and delayed ACKs and a decision waits ~40 ms (measured by
        // `hearth-bench overhead`).
        .serve_with_incoming_shutdown(
            guard::hold_at_most(
                tonic::transport::server::TcpIncoming::from(grpc)
                    .with_nodelay(Some(true))
                    .with_keepalive(Some(guard::TCP_KEEPALIVE)),
                guards.grpc_connections,
            ),
            stop.clone().cancelled_owned(),
        );
    let admin_server = axum::serve(
        guard::AdminListener::new(admin, guards.admin_connections),
        observe::admin::routes(
            Arc::clone(&observer),
            envoy::report::routes(outcomes, guards.token.is_some()),
            guards.token,
        ),
    )
    .with_graceful_shutdown(stop.clone().cancelled_owned());
    let (grpc, admin) = tokio::join!(grpc_server, async move { admin_server.await });
    // Both servers are done (stopped, or failed): the background tasks end
    // too.
    stop.cancel();
    grpc.context("gRPC server")?;
    admin.context("state endpoint")?;
    Ok(())
}

/// Runs a background task until `stop` is cancelled.
fn spawn_until(stop: &CancellationToken, task: impl Future<Output = ()> + Send + 'static) {
    tokio::spawn(stop.clone().run_until_cancelled_owned(task));
}

/// gRPC health, with the endpoint-picker protocol's service names:
/// `liveness` SERVING while the process answers; `readiness` SERVING once
/// the replica list is in (a discovered list's first sync; a peer bus's
/// first sync happens before the servers start); the ext_proc service
/// (and `""`) as readiness, and also NOT_SERVING while no replica serves.
async fn report_grpc_health(router: Arc<Router>, reporter: tonic_health::server::HealthReporter) {
    use tonic_health::ServingStatus;
    let serving = |yes: bool| {
        if yes {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        }
    };
    reporter
        .set_service_status(envoy::HEALTH_LIVENESS, ServingStatus::Serving)
        .await;
    let mut last = None;
    loop {
        let ready = router.source().synced;
        let routing = ready && router.fleet_health() != hearth_router::FleetHealth::Unhealthy;
        let now = (serving(ready), serving(routing));
        if last != Some(now) {
            reporter
                .set_service_status(envoy::HEALTH_READINESS, now.0)
                .await;
            reporter.set_service_status("", now.1).await;
            reporter
                .set_service_status(envoy::HEALTH_EXT_PROC, now.1)
                .await;
            last = Some(now);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

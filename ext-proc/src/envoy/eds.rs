//! The `envoy.service.endpoint.v3.EndpointDiscoveryService`: Envoy's
//! `engines` cluster learns its endpoints from the sidecar, which owns the
//! replica list.
//!
//! State-of-the-world xDS over one gRPC stream per Envoy. The first request
//! is answered with the current assignment; after that the stream pushes a
//! new one each time the router's replica list changes version. Envoy
//! answers every response with an ACK (the response's nonce, no error) or a
//! NACK (the nonce and an error); neither gets a reply, so a rejected
//! assignment is not sent again until the list changes. A request with
//! another set of resource names gets a fresh response. A request carrying
//! an older nonce than the last response is stale (Envoy has a newer
//! response in hand and will say so) and is ignored.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::{address, socket_address, Address, SocketAddress};
use envoy_types::pb::envoy::config::endpoint::v3::{
    lb_endpoint, ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints,
};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::envoy::service::endpoint::v3::endpoint_discovery_service_server::{
    EndpointDiscoveryService, EndpointDiscoveryServiceServer,
};
use envoy_types::util::pack_any;
use futures::Stream;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};

use crate::envoy::render::ENGINES_CLUSTER;
use hearth_router::Router;

/// The resource type this service serves.
pub const TYPE_URL: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";

/// Builds the tonic service. Streams end (cleanly) once `stopping` is
/// cancelled: they never end on their own, and the gRPC server's graceful
/// shutdown waits for every open stream.
pub fn server(
    router: Arc<Router>,
    stopping: CancellationToken,
) -> EndpointDiscoveryServiceServer<Eds> {
    // The router calls back on each change of its list; streams wait on
    // the channel.
    let (tx, versions) = watch::channel(router.version());
    router.on_list_change(move |v| {
        tx.send_replace(v);
    });
    EndpointDiscoveryServiceServer::new(Eds {
        router,
        versions,
        stopping,
    })
}

pub struct Eds {
    router: Arc<Router>,
    /// The replica list's version, as the router last announced it.
    versions: watch::Receiver<u64>,
    stopping: CancellationToken,
}

type ResponseStream = Pin<Box<dyn Stream<Item = Result<DiscoveryResponse, Status>> + Send>>;
type DeltaStream = Pin<Box<dyn Stream<Item = Result<DeltaDiscoveryResponse, Status>> + Send>>;

#[tonic::async_trait]
impl EndpointDiscoveryService for Eds {
    type StreamEndpointsStream = ResponseStream;
    type DeltaEndpointsStream = DeltaStream;

    async fn stream_endpoints(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamEndpointsStream>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(4);
        let router = Arc::clone(&self.router);
        let mut versions = self.versions.clone();
        // What the stream sends first is the current list.
        versions.borrow_and_update();
        let stopping = self.stopping.clone();
        tokio::spawn(async move {
            let mut sub = Subscription::default();
            loop {
                let reply = tokio::select! {
                    msg = inbound.message() => match msg {
                        Ok(Some(req)) => match sub.on_request(&req) {
                            Ok(reply) => reply,
                            Err(status) => {
                                let _ = tx.send(Err(status)).await;
                                break;
                            }
                        },
                        // Envoy closed its side: the stream is over.
                        Ok(None) => break,
                        Err(e) => {
                            tracing::debug!(error = %e, "endpoint discovery stream broke");
                            break;
                        }
                    },
                    changed = versions.changed() => {
                        if changed.is_err() {
                            break;
                        }
                        sub.wants_pushes()
                    }
                    () = stopping.cancelled() => break,
                    // Envoy reset the stream: nobody reads our answers.
                    () = tx.closed() => break,
                };
                if reply {
                    // The version is read (and marked seen) before the list,
                    // so the list sent is at least as new as the version it
                    // carries; a change in between is pushed on the next turn.
                    let version = *versions.borrow_and_update();
                    let response = sub.respond(version, &router.endpoints());
                    if tx.send(Ok(response)).await.is_err() {
                        break;
                    }
                }
            }
            // Dropping `tx` ends the response stream with an OK status.
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn delta_endpoints(
        &self,
        _request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaEndpointsStream>, Status> {
        Err(Status::unimplemented(
            "Hearth serves endpoints state-of-the-world only: set api_type GRPC, not DELTA_GRPC",
        ))
    }

    async fn fetch_endpoints(
        &self,
        request: Request<DiscoveryRequest>,
    ) -> Result<Response<DiscoveryResponse>, Status> {
        let req = request.into_inner();
        check_type(&req.type_url)?;
        let version = *self.versions.borrow();
        let names = ResourceNames::of(&req.resource_names);
        Ok(Response::new(discovery_response(
            version,
            &self.router.endpoints(),
            &names,
            String::new(),
        )))
    }
}

/// One stream's subscription: what Envoy asked for and what was last sent.
#[derive(Default)]
struct Subscription {
    /// `None` until Envoy's first request.
    names: Option<ResourceNames>,
    /// The last response's nonce (empty before the first).
    nonce: String,
    sent: u64,
}

impl Subscription {
    /// Whether `req` calls for a response. A wrong type is the stream's end.
    fn on_request(&mut self, req: &DiscoveryRequest) -> Result<bool, Status> {
        check_type(&req.type_url)?;
        let first = self.names.is_none();
        if !first && !req.response_nonce.is_empty() && req.response_nonce != self.nonce {
            tracing::debug!(
                nonce = %req.response_nonce,
                latest = %self.nonce,
                "stale endpoint discovery request ignored"
            );
            return Ok(false);
        }
        let names = ResourceNames::of(&req.resource_names);
        let changed = self.names.as_ref() != Some(&names);
        if changed {
            for other in names.others() {
                tracing::debug!(resource = %other, "Envoy asked for endpoints of an unknown cluster");
            }
        }
        match &req.error_detail {
            Some(error) => tracing::warn!(
                version = %req.version_info,
                nonce = %req.response_nonce,
                error = %error.message,
                "Envoy rejected the engines endpoints; they are sent again when the replica list changes"
            ),
            None if !first => tracing::debug!(
                version = %req.version_info,
                nonce = %req.response_nonce,
                "Envoy accepted the engines endpoints"
            ),
            None => {}
        }
        self.names = Some(names);
        Ok(first || changed)
    }

    /// Whether a new replica list is pushed: only once Envoy asked for it.
    fn wants_pushes(&self) -> bool {
        self.names.as_ref().is_some_and(|n| n.engines)
    }

    fn respond(&mut self, version: u64, endpoints: &[SocketAddr]) -> DiscoveryResponse {
        self.sent += 1;
        self.nonce = self.sent.to_string();
        let names = self.names.clone().unwrap_or_default();
        discovery_response(version, endpoints, &names, self.nonce.clone())
    }
}

/// The resource names of a request: whether `engines` is among them, and
/// the others (which this service does not have).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct ResourceNames {
    engines: bool,
    others: Vec<String>,
}

impl ResourceNames {
    /// Order and repeats do not matter. An empty list names nothing: EDS
    /// has no wildcard subscription.
    fn of(names: &[String]) -> ResourceNames {
        let mut others: Vec<String> = names
            .iter()
            .filter(|n| *n != ENGINES_CLUSTER)
            .cloned()
            .collect();
        others.sort();
        others.dedup();
        ResourceNames {
            engines: names.iter().any(|n| n == ENGINES_CLUSTER),
            others,
        }
    }

    fn others(&self) -> &[String] {
        &self.others
    }
}

fn check_type(type_url: &str) -> Result<(), Status> {
    // Outside ADS the service implies the type, so an empty one is EDS.
    if type_url.is_empty() || type_url == TYPE_URL {
        Ok(())
    } else {
        Err(Status::invalid_argument(format!(
            "this endpoint discovery service serves {TYPE_URL} only, not {type_url}"
        )))
    }
}

fn discovery_response(
    version: u64,
    endpoints: &[SocketAddr],
    names: &ResourceNames,
    nonce: String,
) -> DiscoveryResponse {
    let resources = if names.engines {
        vec![pack_any(load_assignment(endpoints))]
    } else {
        Vec::new()
    };
    DiscoveryResponse {
        version_info: version.to_string(),
        resources,
        type_url: TYPE_URL.to_string(),
        nonce,
        ..DiscoveryResponse::default()
    }
}

/// The `engines` cluster: one locality, one endpoint per address.
pub fn load_assignment(endpoints: &[SocketAddr]) -> ClusterLoadAssignment {
    let lb_endpoints = endpoints
        .iter()
        .map(|addr| LbEndpoint {
            host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(Endpoint {
                address: Some(Address {
                    address: Some(address::Address::SocketAddress(SocketAddress {
                        protocol: socket_address::Protocol::Tcp.into(),
                        address: addr.ip().to_string(),
                        port_specifier: Some(socket_address::PortSpecifier::PortValue(u32::from(
                            addr.port(),
                        ))),
                        ..SocketAddress::default()
                    })),
                }),
                ..Endpoint::default()
            })),
            ..LbEndpoint::default()
        })
        .collect();
    ClusterLoadAssignment {
        cluster_name: ENGINES_CLUSTER.to_string(),
        endpoints: vec![LocalityLbEndpoints {
            lb_endpoints,
            ..LocalityLbEndpoints::default()
        }],
        ..ClusterLoadAssignment::default()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use envoy_types::pb::envoy::service::endpoint::v3::endpoint_discovery_service_client::EndpointDiscoveryServiceClient;
    use envoy_types::pb::google::rpc;
    use prost::Message;
    use tokio::net::TcpListener;
    use tonic::transport::Channel;

    use super::*;

    /// Long enough for a reply that was going to come to arrive; nothing
    /// is timed against it.
    const QUIET: Duration = Duration::from_millis(300);

    struct Server {
        client: EndpointDiscoveryServiceClient<Channel>,
        stop: CancellationToken,
        task: tokio::task::JoinHandle<()>,
    }

    impl Drop for Server {
        fn drop(&mut self) {
            self.task.abort();
        }
    }

    /// The service over a real loopback server, for a router over
    /// `upstreams`.
    async fn start(upstreams: &str) -> Server {
        let list: Vec<hearth_router::UpstreamSpec> =
            upstreams.split(',').map(|u| u.parse().unwrap()).collect();
        let router = Router::new(hearth_router::RouterParams::default(), &list);
        let stop = CancellationToken::new();
        let stopping = stop.clone();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(server(router, stopping))
                .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener))
                .await
                .unwrap();
        });
        let client = EndpointDiscoveryServiceClient::connect(format!("http://{addr}"))
            .await
            .unwrap();
        Server { client, stop, task }
    }

    /// An open stream: requests go in through `requests`.
    struct Xds {
        requests: mpsc::Sender<DiscoveryRequest>,
        responses: Streaming<DiscoveryResponse>,
    }

    impl Xds {
        async fn open(server: &mut Server) -> Xds {
            let (requests, rx) = mpsc::channel(4);
            let responses = server
                .client
                .stream_endpoints(ReceiverStream::new(rx))
                .await
                .unwrap()
                .into_inner();
            Xds {
                requests,
                responses,
            }
        }

        async fn send(&self, req: DiscoveryRequest) {
            self.requests.send(req).await.unwrap();
        }

        async fn next(&mut self) -> DiscoveryResponse {
            tokio::time::timeout(Duration::from_secs(10), self.responses.message())
                .await
                .expect("a response")
                .expect("an OK stream")
                .expect("an open stream")
        }

        /// Panics if anything arrives within [`QUIET`].
        async fn assert_quiet(&mut self, after: &str) {
            if let Ok(got) = tokio::time::timeout(QUIET, self.responses.message()).await {
                panic!("{after}: expected no reply, got {got:?}");
            }
        }
    }

    fn request(names: &[&str]) -> DiscoveryRequest {
        DiscoveryRequest {
            type_url: TYPE_URL.into(),
            resource_names: names.iter().map(|n| n.to_string()).collect(),
            ..DiscoveryRequest::default()
        }
    }

    fn addrs(list: &[&str]) -> Vec<SocketAddr> {
        list.iter().map(|a| a.parse().unwrap()).collect()
    }

    fn ack(to: &DiscoveryResponse) -> DiscoveryRequest {
        DiscoveryRequest {
            version_info: to.version_info.clone(),
            response_nonce: to.nonce.clone(),
            ..request(&[ENGINES_CLUSTER])
        }
    }

    fn endpoints_of(resp: &DiscoveryResponse) -> Vec<SocketAddr> {
        assert_eq!(resp.type_url, TYPE_URL);
        assert_eq!(resp.resources.len(), 1, "{resp:?}");
        assert_eq!(resp.resources[0].type_url, TYPE_URL);
        let cla = ClusterLoadAssignment::decode(resp.resources[0].value.as_slice()).unwrap();
        assert_eq!(cla.cluster_name, ENGINES_CLUSTER);
        cla.endpoints
            .iter()
            .flat_map(|l| &l.lb_endpoints)
            .map(|e| match &e.host_identifier {
                Some(lb_endpoint::HostIdentifier::Endpoint(Endpoint {
                    address:
                        Some(Address {
                            address: Some(address::Address::SocketAddress(sa)),
                        }),
                    ..
                })) => match sa.port_specifier {
                    Some(socket_address::PortSpecifier::PortValue(p)) => {
                        SocketAddr::new(sa.address.parse().unwrap(), p as u16)
                    }
                    _ => panic!("no port: {sa:?}"),
                },
                other => panic!("not a socket address: {other:?}"),
            })
            .collect()
    }

    #[tokio::test]
    async fn the_first_response_carries_every_endpoint_and_the_version() {
        // A data-parallel address is one endpoint, however many ranks.
        let mut server = start("127.0.0.1:1001;dp=2,127.0.0.1:1002,[::1]:1003").await;
        let mut stream = Xds::open(&mut server).await;
        stream.send(request(&[ENGINES_CLUSTER])).await;
        let first = stream.next().await;
        assert_eq!(
            endpoints_of(&first),
            addrs(&["127.0.0.1:1001", "127.0.0.1:1002", "[::1]:1003"])
        );
        assert_eq!(first.version_info, "1");
        assert!(!first.nonce.is_empty());
        // The unary fetch says the same.
        let fetched = server
            .client
            .fetch_endpoints(request(&[ENGINES_CLUSTER]))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(endpoints_of(&fetched), endpoints_of(&first));
        assert_eq!(fetched.version_info, first.version_info);
    }

    #[tokio::test]
    async fn an_ack_gets_no_reply() {
        let mut server = start("127.0.0.1:1001,127.0.0.1:1002").await;
        let mut stream = Xds::open(&mut server).await;
        stream.send(request(&[ENGINES_CLUSTER])).await;
        let first = stream.next().await;
        stream.send(ack(&first)).await;
        stream.assert_quiet("after an ACK").await;
    }

    #[tokio::test]
    async fn a_nack_is_not_answered_and_the_stream_goes_on() {
        let mut server = start("127.0.0.1:1001,127.0.0.1:1002").await;
        let mut stream = Xds::open(&mut server).await;
        stream.send(request(&[ENGINES_CLUSTER])).await;
        let first = stream.next().await;
        stream
            .send(DiscoveryRequest {
                // A NACK names the version Envoy still holds (none yet).
                version_info: String::new(),
                response_nonce: first.nonce.clone(),
                error_detail: Some(rpc::Status {
                    code: 3,
                    message: "endpoints rejected for the test".into(),
                    ..rpc::Status::default()
                }),
                ..request(&[ENGINES_CLUSTER])
            })
            .await;
        stream.assert_quiet("after a NACK").await;
        // Still serving: a new set of names gets a fresh response, without
        // the cluster it does not know.
        stream
            .send(DiscoveryRequest {
                response_nonce: first.nonce.clone(),
                ..request(&[ENGINES_CLUSTER, "elsewhere"])
            })
            .await;
        let again = stream.next().await;
        assert_ne!(again.nonce, first.nonce);
        assert_eq!(again.version_info, first.version_info);
        assert_eq!(endpoints_of(&again), endpoints_of(&first));
    }

    #[tokio::test]
    async fn other_clusters_are_left_out() {
        let mut server = start("127.0.0.1:1001").await;
        let mut stream = Xds::open(&mut server).await;
        stream.send(request(&["elsewhere"])).await;
        let first = stream.next().await;
        assert!(first.resources.is_empty(), "{first:?}");
        stream.send(ack(&first)).await;
        // Asking for engines too changes the names: a fresh response.
        stream
            .send(DiscoveryRequest {
                response_nonce: first.nonce.clone(),
                ..request(&["elsewhere", ENGINES_CLUSTER])
            })
            .await;
        assert_eq!(
            endpoints_of(&stream.next().await),
            addrs(&["127.0.0.1:1001"])
        );
    }

    #[tokio::test]
    async fn a_stale_nonce_is_ignored() {
        let mut server = start("127.0.0.1:1001").await;
        let mut stream = Xds::open(&mut server).await;
        stream.send(request(&[ENGINES_CLUSTER])).await;
        let first = stream.next().await;
        stream
            .send(DiscoveryRequest {
                response_nonce: format!("not-{}", first.nonce),
                ..request(&["elsewhere"])
            })
            .await;
        stream.assert_quiet("after a stale request").await;
    }

    #[tokio::test]
    async fn a_wrong_type_is_invalid_argument() {
        let mut server = start("127.0.0.1:1001").await;
        let mut stream = Xds::open(&mut server).await;
        stream
            .send(DiscoveryRequest {
                type_url: "type.googleapis.com/envoy.config.cluster.v3.Cluster".into(),
                ..request(&[ENGINES_CLUSTER])
            })
            .await;
        let err = stream.responses.message().await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
        let err = server
            .client
            .fetch_endpoints(DiscoveryRequest {
                type_url: "type.googleapis.com/envoy.config.listener.v3.Listener".into(),
                ..request(&[ENGINES_CLUSTER])
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    }

    #[tokio::test]
    async fn delta_is_unimplemented() {
        let mut server = start("127.0.0.1:1001").await;
        let err = server
            .client
            .delta_endpoints(futures::stream::empty::<DeltaDiscoveryRequest>())
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unimplemented, "{err:?}");
    }

    #[tokio::test]
    async fn streams_end_cleanly_when_the_sidecar_stops() {
        let mut server = start("127.0.0.1:1001").await;
        let mut stream = Xds::open(&mut server).await;
        stream.send(request(&[ENGINES_CLUSTER])).await;
        stream.next().await;
        server.stop.cancel();
        let end = tokio::time::timeout(Duration::from_secs(10), stream.responses.message())
            .await
            .expect("the stream ends");
        assert!(matches!(end, Ok(None)), "{end:?}");
    }

    #[test]
    fn the_type_url_is_the_assignment_s() {
        assert_eq!(pack_any(load_assignment(&[])).type_url, TYPE_URL);
    }
}

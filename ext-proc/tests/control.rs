//! The gRPC port takes calls only from its gateway: with
//! `HEARTH_CONTROL_TOKEN_FILE`, ext_proc and endpoint discovery calls
//! without `authorization: Bearer <token>` get UNAUTHENTICATED and make no
//! decision, gRPC health stays open; with `HEARTH_GRPC_TLS_*`, only a
//! client with a certificate from the client CA gets a connection; an
//! ext_proc stream has no deadline, but a client gone silent is pinged,
//! then dropped.
//! (Certificates are made with the `openssl` command.)

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use clap::Parser;
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;
use envoy_types::pb::envoy::service::endpoint::v3::endpoint_discovery_service_client::EndpointDiscoveryServiceClient;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request, HttpHeaders, ProcessingRequest,
};
use hearth_ext_proc::config::Cli;
use hearth_ext_proc::Sidecar;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};
use tonic::Code;

const TOKEN: &str = "c0ntrol-t0ken-for-the-grpc-tests-0123456789";

/// A scratch directory for this test process.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("hearth-control-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

async fn sidecar(extra: &[String]) -> Sidecar {
    let mut args = vec![
        "hearth-ext-proc".to_string(),
        "--upstreams=127.0.0.1:1".into(),
        "--listen=127.0.0.1:0".into(),
        "--admin-listen=127.0.0.1:0".into(),
        "--probe-interval-seconds=0".into(),
        "--engine-metrics-seconds=0".into(),
    ];
    args.extend(extra.iter().cloned());
    let settings = Cli::try_parse_from(args).unwrap().settings;
    settings.validate().unwrap();
    Sidecar::start(&settings).await.unwrap()
}

fn token_flag(dir: &Path) -> String {
    let file = dir.join("token");
    std::fs::write(&file, format!("{TOKEN}\n")).unwrap();
    format!("--control-token-file={}", file.display())
}

/// `request` carrying `authorization: <value>`, if any.
fn with_auth<T>(message: T, value: Option<&str>) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    if let Some(v) = value {
        request
            .metadata_mut()
            .insert("authorization", v.parse().unwrap());
    }
    request
}

/// The request headers of one chat completion, as Envoy sends them.
fn chat_headers() -> ProcessingRequest {
    let h = |k: &str, v: &str| HeaderValue {
        key: k.into(),
        raw_value: v.as_bytes().to_vec(),
        ..Default::default()
    };
    ProcessingRequest {
        request: Some(processing_request::Request::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: vec![
                    h(":method", "POST"),
                    h(":path", "/v1/chat/completions"),
                    h("x-request-id", "grpc-auth-1"),
                ],
            }),
            end_of_stream: false,
            ..Default::default()
        })),
        ..Default::default()
    }
}

/// Opens an ext_proc stream with `auth` and sends one request's headers:
/// the first reply, or the status the call ended with.
async fn ext_proc(channel: Channel, auth: Option<&str>) -> Result<(), tonic::Status> {
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tx.send(chat_headers()).await.unwrap();
    let mut replies = ExternalProcessorClient::new(channel)
        .process(with_auth(ReceiverStream::new(rx), auth))
        .await?
        .into_inner();
    let first = tokio::time::timeout(Duration::from_secs(5), replies.message())
        .await
        .expect("an answer within 5 s")?;
    assert!(first.is_some(), "the stream ended without an answer");
    Ok(())
}

/// Opens an endpoint discovery stream with `auth`: its first response,
/// or the status the call ended with.
async fn eds(channel: Channel, auth: Option<&str>) -> Result<(), tonic::Status> {
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tx.send(DiscoveryRequest {
        type_url: hearth_ext_proc::envoy::eds::TYPE_URL.into(),
        resource_names: vec!["engines".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    let mut responses = EndpointDiscoveryServiceClient::new(channel)
        .stream_endpoints(with_auth(ReceiverStream::new(rx), auth))
        .await?
        .into_inner();
    let first = tokio::time::timeout(Duration::from_secs(5), responses.message())
        .await
        .expect("an answer within 5 s")?;
    assert!(first.is_some());
    Ok(())
}

/// gRPC health of `service` (`""`, `liveness`, `readiness`), without the
/// token.
async fn health(channel: Channel, service: &str) -> Result<(), tonic::Status> {
    tonic_health::pb::health_client::HealthClient::new(channel)
        .check(tonic_health::pb::HealthCheckRequest {
            service: service.into(),
        })
        .await
        .map(|_| ())
}

#[tokio::test]
async fn grpc_calls_without_the_token_are_unauthenticated_and_decide_nothing() {
    let dir = scratch("grpc");
    let sidecar = sidecar(&[token_flag(&dir)]).await;
    let channel = Channel::from_shared(format!("http://{}", sidecar.grpc_addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let wrong = format!("Bearer {}", TOKEN.replace('0', "1"));
    for auth in [None, Some(wrong.as_str()), Some(TOKEN), Some("Bearer ")] {
        let status = ext_proc(channel.clone(), auth).await.unwrap_err();
        assert_eq!(
            status.code(),
            Code::Unauthenticated,
            "ext_proc with {auth:?}"
        );
        let status = eds(channel.clone(), auth).await.unwrap_err();
        assert_eq!(status.code(), Code::Unauthenticated, "EDS with {auth:?}");
    }
    assert_eq!(sidecar.router.snapshot().decisions_total, 0);
    // gRPC health stays open (Kubernetes' grpc probe sends no token).
    for service in ["", "liveness", "readiness"] {
        health(channel.clone(), service)
            .await
            .unwrap_or_else(|s| panic!("gRPC health of {service:?}: {s:?}"));
    }
    // The gateway's calls pass, and decide.
    let right = format!("Bearer {TOKEN}");
    ext_proc(channel.clone(), Some(&right)).await.unwrap();
    eds(channel, Some(&right)).await.unwrap();
    assert_eq!(sidecar.router.snapshot().decisions_total, 1);
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn without_a_token_configured_grpc_calls_pass_as_before() {
    let sidecar = sidecar(&[]).await;
    let channel = Channel::from_shared(format!("http://{}", sidecar.grpc_addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    ext_proc(channel.clone(), None).await.unwrap();
    eds(channel, None).await.unwrap();
}

/// Runs `openssl` in `dir`; panics with its output when it fails.
fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("the openssl command (it makes the test certificates)");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA (`NAME-ca.pem`, `NAME-ca.key`), and with it certificates for the
/// server (`localhost`, 127.0.0.1) and a client (`NAME-client.*`).
fn certificates(dir: &Path, name: &str) {
    let ca = format!("{name}-ca");
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            &format!("{ca}.key"),
            "-out",
            &format!("{ca}.pem"),
            "-days",
            "2",
            "-subj",
            &format!("/CN={ca}"),
        ],
    );
    for (who, ext) in [
        (
            "server",
            "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n",
        ),
        (
            "client",
            "extendedKeyUsage=clientAuth\nbasicConstraints=CA:FALSE\n",
        ),
    ] {
        let stem = format!("{name}-{who}");
        std::fs::write(dir.join(format!("{stem}.ext")), ext).unwrap();
        openssl(
            dir,
            &[
                "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                "-keyout", &format!("{stem}.key"), "-out", &format!("{stem}.csr"),
                "-subj", &format!("/CN={stem}"),
            ],
        );
        openssl(
            dir,
            &[
                "x509", "-req", "-in", &format!("{stem}.csr"), "-CA", &format!("{ca}.pem"),
                "-CAkey", &format!("{ca}.key"), "-CAcreateserial", "-days", "2",
                "-out", &format!("{stem}.pem"), "-extfile", &format!("{stem}.ext"),
            ],
        );
    }
}

fn read(dir: &Path, file: &str) -> Vec<u8> {
    std::fs::read(dir.join(file)).unwrap()
}

/// A TLS channel to `addr` trusting `trust`'s CA, presenting
/// `client`'s certificate if any.
async fn tls_channel(
    addr: std::net::SocketAddr,
    dir: &Path,
    client: Option<&str>,
) -> Result<Channel, tonic::transport::Error> {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(read(dir, "fleet-ca.pem")))
        .domain_name("localhost");
    if let Some(name) = client {
        tls = tls.identity(Identity::from_pem(
            read(dir, &format!("{name}-client.pem")),
            read(dir, &format!("{name}-client.key")),
        ));
    }
    Channel::from_shared(format!("https://{addr}"))
        .unwrap()
        .tls_config(tls)?
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
}

#[tokio::test]
async fn tls_admits_only_clients_with_a_certificate_from_the_client_ca() {
    let dir = scratch("tls");
    certificates(&dir, "fleet");
    certificates(&dir, "stranger");
    let file = |f: &str| dir.join(f).display().to_string();
    let sidecar = sidecar(&[
        format!("--grpc-tls-cert-file={}", file("fleet-server.pem")),
        format!("--grpc-tls-key-file={}", file("fleet-server.key")),
        format!("--grpc-tls-client-ca-file={}", file("fleet-ca.pem")),
        token_flag(&dir),
    ])
    .await;
    let addr = sidecar.grpc_addr;

    // The gateway's certificate: a connection, and with the token a call.
    let channel = tls_channel(addr, &dir, Some("fleet")).await.unwrap();
    health(channel.clone(), "").await.unwrap();
    ext_proc(channel.clone(), Some(&format!("Bearer {TOKEN}")))
        .await
        .unwrap();
    // The certificate alone is not the token.
    let status = ext_proc(channel, None).await.unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated);

    // No certificate, one from another CA, or no TLS at all: no call
    // gets through (the handshake, or the first call on it, fails).
    for client in [None, Some("stranger")] {
        let refused = match tls_channel(addr, &dir, client).await {
            Err(_) => true,
            Ok(channel) => health(channel, "").await.is_err(),
        };
        assert!(refused, "a client with {client:?} got through");
    }
    let plain = match Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
    {
        Err(_) => true,
        Ok(channel) => health(channel, "").await.is_err(),
    };
    assert!(plain, "a plain-text client got through");
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn unusable_tls_files_stop_the_start() {
    let dir = scratch("bad-tls");
    std::fs::write(
        dir.join("cert.pem"),
        "-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("key.pem"),
        "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
    )
    .unwrap();
    let settings = Cli::try_parse_from([
        "hearth-ext-proc",
        "--upstreams=127.0.0.1:1",
        "--listen=127.0.0.1:0",
        "--admin-listen=127.0.0.1:0",
        &format!("--grpc-tls-cert-file={}", dir.join("cert.pem").display()),
        &format!("--grpc-tls-key-file={}", dir.join("key.pem").display()),
    ])
    .unwrap()
    .settings;
    let err = Sidecar::start(&settings).await.err().expect("refused");
    assert!(format!("{err:#}").contains("HEARTH_GRPC_TLS"), "{err:#}");
    let _ = std::fs::remove_dir_all(dir);
}

/// One HTTP/2 frame's type and flags, read whole (payload skipped); `None`
/// at the end of the connection.
async fn frame(tcp: &mut tokio::net::TcpStream) -> Option<(u8, u8)> {
    use tokio::io::AsyncReadExt;
    let mut head = [0u8; 9];
    tcp.read_exact(&mut head).await.ok()?;
    let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
    let mut payload = vec![0u8; len];
    tcp.read_exact(&mut payload).await.ok()?;
    Some((head[3], head[4]))
}

/// On the paused clock: a client that goes silent (a vanished Envoy) gets
/// an HTTP/2 PING after 30 s and, not answering it, loses the connection
/// 10 s later (with it, its streams and the load they reserve).
#[tokio::test(start_paused = true)]
async fn a_silent_grpc_client_is_pinged_after_30_s_and_dropped_10_s_later() {
    use tokio::io::AsyncWriteExt;
    use tokio::time::Instant;
    const SETTINGS: u8 = 4;
    const PING: u8 = 6;
    const ACK: u8 = 1;
    let sidecar = sidecar(&[]).await;
    let mut tcp = tokio::net::TcpStream::connect(sidecar.grpc_addr)
        .await
        .unwrap();
    // The client preface and empty SETTINGS, then the ACK of the server's.
    tcp.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
        .await
        .unwrap();
    loop {
        let (kind, flags) = frame(&mut tcp).await.expect("the server's SETTINGS");
        if kind == SETTINGS && flags & ACK == 0 {
            break;
        }
    }
    tcp.write_all(b"\0\0\0\x04\x01\0\0\0\0").await.unwrap();
    let silent_since = Instant::now();
    let pinged = loop {
        match frame(&mut tcp).await {
            Some((PING, flags)) if flags & ACK == 0 => break Instant::now(),
            Some(_) => {}
            None => panic!("closed without a PING"),
        }
    };
    // Never answered: the server closes the connection.
    while frame(&mut tcp).await.is_some() {}
    let closed = Instant::now();
    let (to_ping, to_close) = (pinged - silent_since, closed - pinged);
    let second = Duration::from_secs(1);
    assert!(
        to_ping >= Duration::from_secs(30) && to_ping < Duration::from_secs(30) + second,
        "pinged after {to_ping:?} of silence"
    );
    assert!(
        to_close >= Duration::from_secs(10) && to_close < Duration::from_secs(10) + second,
        "closed {to_close:?} after the unanswered PING"
    );
}

/// On the paused clock: an ext_proc stream (an answer streaming for
/// minutes) is not cut by any deadline, and holds its load until it ends.
#[tokio::test(start_paused = true)]
async fn an_ext_proc_stream_has_no_deadline() {
    let sidecar = sidecar(&[]).await;
    let channel = Channel::from_shared(format!("http://{}", sidecar.grpc_addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tx.send(chat_headers()).await.unwrap();
    let mut replies = ExternalProcessorClient::new(channel)
        .process(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    assert!(replies.message().await.unwrap().is_some());
    let in_flight = || {
        let s = sidecar.router.snapshot();
        s.replicas.iter().map(|r| r.in_flight).sum::<u32>()
    };
    assert_eq!(in_flight(), 1);
    // Half an hour of an answer: the stream and its load are still there.
    tokio::time::sleep(Duration::from_secs(30 * 60)).await;
    assert_eq!(in_flight(), 1);
    let response_headers = ProcessingRequest {
        request: Some(processing_request::Request::ResponseHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: vec![HeaderValue {
                    key: ":status".into(),
                    raw_value: b"200".to_vec(),
                    ..Default::default()
                }],
            }),
            end_of_stream: true,
            ..Default::default()
        })),
        ..Default::default()
    };
    tx.send(response_headers).await.unwrap();
    assert!(replies.message().await.unwrap().is_some());
    // The answer ends: so does its load.
    drop(tx);
    while replies.message().await.unwrap().is_some() {}
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while in_flight() != 0 {
        assert!(tokio::time::Instant::now() < deadline, "the load stayed");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

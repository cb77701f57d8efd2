//! Who may call the sidecar's two listeners, and how much any caller may
//! hold there.
//!
//! - The control token (`HEARTH_CONTROL_TOKEN_FILE`): Envoy sends it as
//!   `authorization: Bearer <token>`, on every ext_proc and endpoint
//!   discovery call (gRPC metadata) and on the outcome filter's
//!   `POST /outcome`. Compared in constant time. gRPC health and the admin
//!   port's reads stay open; a write on the admin port without it is a
//!   401 that changes nothing.
//! - TLS on the gRPC port, with client certificates when a client CA is
//!   set (`HEARTH_GRPC_TLS_*`).
//! - Limits: a cap on the connections each listener holds (more wait in
//!   the kernel's accept queue), HTTP/2 and TCP keepalives on the gRPC
//!   port (so a vanished Envoy's streams, and the load they reserve, are
//!   released), a request deadline, an idle deadline and a body limit on
//!   the admin port. The gRPC port has no request deadline: an ext_proc
//!   stream lives as long as the answer it routes streams (minutes).

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use anyhow::Context as _;
use axum::extract::{Request, State};
use axum::http::{header, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures::{Stream, StreamExt};
use subtle::ConstantTimeEq;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};
use tonic::transport::server::Connected;
use tonic::transport::{Certificate, Identity, ServerTlsConfig};

use crate::config::{Secret, Settings};

/// Largest request body the admin port reads (outcome reports are a few
/// dozen bytes); past it, 413.
pub const ADMIN_BODY_LIMIT: usize = 4 << 10;
/// An admin request not answered within this gets a 408.
pub const ADMIN_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// An admin connection that sends nothing for this long is closed
/// (Envoy reopens its pooled connections as needed).
pub const ADMIN_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// The gRPC port pings each connection this often (HTTP/2 PING) ...
pub const GRPC_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
/// ... and closes it, with its streams, when no answer comes within this.
pub const GRPC_KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);
/// TCP keepalive on the gRPC port's sockets.
pub const TCP_KEEPALIVE: Duration = Duration::from_secs(60);
/// Concurrent streams per gRPC connection (one per request in flight
/// through that Envoy worker); Envoy opens another connection past it.
pub const GRPC_MAX_STREAMS_PER_CONNECTION: u32 = 1024;
/// A TLS handshake on the gRPC port must finish within this.
pub const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The expected `authorization` value, `Bearer <token>`.
#[derive(Clone)]
pub struct ControlToken {
    expected: Vec<u8>,
}

impl std::fmt::Debug for ControlToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ControlToken(<redacted>)")
    }
}

impl ControlToken {
    pub fn new(token: &Secret) -> ControlToken {
        ControlToken {
            expected: format!("Bearer {}", token.expose()).into_bytes(),
        }
    }

    /// Whether an `authorization` value carries the token. The time taken
    /// does not depend on how much of it matched.
    pub fn admits(&self, authorization: Option<&[u8]>) -> bool {
        authorization.is_some_and(|given| bool::from(given.ct_eq(&self.expected)))
    }
}

/// The gRPC check: every call but gRPC health (which is not wrapped)
/// carries the token, or gets `UNAUTHENTICATED`. Without a token
/// configured, every call passes (as before the setting existed).
#[derive(Clone, Debug)]
pub struct GrpcGuard(pub Option<Arc<ControlToken>>);

impl tonic::service::Interceptor for GrpcGuard {
    fn call(&mut self, request: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        let Some(token) = &self.0 else {
            return Ok(request);
        };
        let given = request
            .metadata()
            .get(header::AUTHORIZATION.as_str())
            .map(|v| v.as_bytes());
        if token.admits(given) {
            Ok(request)
        } else {
            Err(tonic::Status::unauthenticated(
                "this sidecar takes calls only from its gateway: authorization: Bearer \
                 <HEARTH_CONTROL_TOKEN_FILE's token> is missing or wrong",
            ))
        }
    }
}

/// Who made an admin request: its gateway (carries the token, or no token
/// is configured), or anyone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Caller {
    Gateway,
    Anyone,
}

/// The admin port's middleware, around every route: tells the handlers
/// who called ([`Caller`], a request extension), refuses a write (any
/// method but GET and HEAD, so `POST /outcome` and whatever follows it)
/// from anyone but the gateway with a 401 before any handler runs, and
/// answers 408 past [`ADMIN_REQUEST_TIMEOUT`].
pub async fn admin_guard(
    State(token): State<Option<Arc<ControlToken>>>,
    mut request: Request,
    next: Next,
) -> Response {
    let caller = match &token {
        None => Caller::Gateway,
        Some(token) => {
            let given = request
                .headers()
                .get(header::AUTHORIZATION)
                .map(|v| v.as_bytes());
            if token.admits(given) {
                Caller::Gateway
            } else {
                Caller::Anyone
            }
        }
    };
    let read = matches!(*request.method(), Method::GET | Method::HEAD);
    if caller == Caller::Anyone && !read {
        return unauthorized();
    }
    request.extensions_mut().insert(caller);
    match tokio::time::timeout(ADMIN_REQUEST_TIMEOUT, next.run(request)).await {
        Ok(response) => response,
        Err(_) => error(
            StatusCode::REQUEST_TIMEOUT,
            "timeout",
            "request_timeout",
            "the request took too long",
        ),
    }
}

/// 401 with the OpenAI-shaped error body the gateway's other refusals use.
pub fn unauthorized() -> Response {
    let mut response = error(
        StatusCode::UNAUTHORIZED,
        "unauthorized",
        "control_token_required",
        "authorization: Bearer <HEARTH_CONTROL_TOKEN_FILE's token> is missing or wrong",
    );
    response.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        "Bearer".parse().expect("a header"),
    );
    response
}

fn error(status: StatusCode, kind: &str, code: &str, message: &str) -> Response {
    (
        status,
        axum::Json(serde_json::json!({
            "error": {"message": message, "type": kind, "code": code, "param": null}
        })),
    )
        .into_response()
}

/// The gRPC port's TLS, from the settings (none without a certificate).
/// Files are read and parsed now, so a bad one stops the start.
pub fn grpc_tls(settings: &Settings) -> anyhow::Result<Option<ServerTlsConfig>> {
    let (Some(cert), Some(key)) = (&settings.grpc_tls_cert_file, &settings.grpc_tls_key_file)
    else {
        return Ok(None);
    };
    let read = |name: &str, path: &std::path::Path| {
        std::fs::read(path).with_context(|| format!("{name}: reading {}", path.display()))
    };
    let mut tls = ServerTlsConfig::new()
        .identity(Identity::from_pem(
            read("HEARTH_GRPC_TLS_CERT_FILE", cert)?,
            read("HEARTH_GRPC_TLS_KEY_FILE", key)?,
        ))
        .timeout(TLS_HANDSHAKE_TIMEOUT);
    if let Some(ca) = &settings.grpc_tls_client_ca_file {
        // A client CA makes a client certificate mandatory.
        tls = tls.client_ca_root(Certificate::from_pem(read(
            "HEARTH_GRPC_TLS_CLIENT_CA_FILE",
            ca,
        )?));
    }
    // The certificates and key are parsed here, not at the first call.
    tonic::transport::Server::builder()
        .tls_config(tls.clone())
        .context("HEARTH_GRPC_TLS_*: the certificate, key or client CA is not usable")?;
    Ok(Some(tls))
}

/// A connection that holds one of its listener's places until it closes,
/// and on the admin port is closed after an idle spell.
pub struct Held<T> {
    io: T,
    _place: OwnedSemaphorePermit,
    idle: Option<(Duration, Pin<Box<Sleep>>)>,
}

impl<T> Held<T> {
    fn new(io: T, place: OwnedSemaphorePermit, idle: Option<Duration>) -> Held<T> {
        Held {
            io,
            _place: place,
            idle: idle.map(|d| (d, Box::pin(tokio::time::sleep(d)))),
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Held<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let before = buf.filled().len();
        match Pin::new(&mut this.io).poll_read(cx, buf) {
            Poll::Ready(r) => {
                if let Some((d, sleep)) = &mut this.idle {
                    if buf.filled().len() > before {
                        sleep.as_mut().reset(Instant::now() + *d);
                    }
                }
                Poll::Ready(r)
            }
            Poll::Pending => {
                let idle_over = match &mut this.idle {
                    Some((_, sleep)) => sleep.as_mut().poll(cx).is_ready(),
                    None => false,
                };
                if idle_over {
                    Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "idle connection closed",
                    )))
                } else {
                    Poll::Pending
                }
            }
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Held<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

impl<T: Connected> Connected for Held<T> {
    type ConnectInfo = T::ConnectInfo;
    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

/// `incoming` with at most `places` of its connections open at once: the
/// next one is accepted only when a place is free.
pub fn hold_at_most<S, T, E>(incoming: S, places: usize) -> impl Stream<Item = Result<Held<T>, E>>
where
    S: Stream<Item = Result<T, E>> + Unpin,
{
    let places = Arc::new(Semaphore::new(places));
    futures::stream::unfold((incoming, places), |(mut incoming, places)| async move {
        let place = Arc::clone(&places).acquire_owned().await.ok()?;
        let next = incoming.next().await?;
        Some((
            next.map(|io| Held::new(io, place, None)),
            (incoming, places),
        ))
    })
}

/// The admin port's listener: at most `places` connections open at once,
/// each closed after [`ADMIN_IDLE_TIMEOUT`] without a byte from its peer.
pub struct AdminListener {
    inner: TcpListener,
    places: Arc<Semaphore>,
}

impl AdminListener {
    pub fn new(inner: TcpListener, places: usize) -> AdminListener {
        AdminListener {
            inner,
            places: Arc::new(Semaphore::new(places)),
        }
    }
}

impl axum::serve::Listener for AdminListener {
    type Io = Held<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        let place = Arc::clone(&self.places)
            .acquire_owned()
            .await
            .expect("the semaphore is never closed");
        // axum's accept retries (with a pause) on errors.
        let (io, addr) = axum::serve::Listener::accept(&mut self.inner).await;
        (Held::new(io, place, Some(ADMIN_IDLE_TIMEOUT)), addr)
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token() -> ControlToken {
        ControlToken::new(&"0123456789abcdef0123456789abcdef".parse().unwrap())
    }

    #[test]
    fn only_the_exact_bearer_value_is_admitted() {
        let t = token();
        assert!(t.admits(Some(b"Bearer 0123456789abcdef0123456789abcdef")));
        for bad in [
            &b""[..],
            b"Bearer",
            b"Bearer ",
            b"bearer 0123456789abcdef0123456789abcdef",
            b"Bearer 0123456789abcdef0123456789abcdeF",
            b"Bearer 0123456789abcdef0123456789abcdef ",
            b"Bearer 0123456789abcdef0123456789abcde",
            b"0123456789abcdef0123456789abcdef",
        ] {
            assert!(!t.admits(Some(bad)), "{}", String::from_utf8_lossy(bad));
        }
        assert!(!t.admits(None));
        assert_eq!(format!("{t:?}"), "ControlToken(<redacted>)");
    }

    #[test]
    fn the_grpc_guard_refuses_calls_without_the_token() {
        use tonic::service::Interceptor;
        let mut open = GrpcGuard(None);
        assert!(open.call(tonic::Request::new(())).is_ok());
        let mut guard = GrpcGuard(Some(Arc::new(token())));
        let status = guard.call(tonic::Request::new(())).unwrap_err();
        assert_eq!(status.code(), tonic::Code::Unauthenticated);
        let mut wrong = tonic::Request::new(());
        wrong
            .metadata_mut()
            .insert("authorization", "Bearer nope".parse().unwrap());
        assert!(guard.call(wrong).is_err());
        let mut right = tonic::Request::new(());
        right.metadata_mut().insert(
            "authorization",
            "Bearer 0123456789abcdef0123456789abcdef".parse().unwrap(),
        );
        assert!(guard.call(right).is_ok());
    }

    #[tokio::test]
    async fn connections_past_the_cap_wait_for_a_place() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let incoming = tonic::transport::server::TcpIncoming::from(listener);
        let mut held = Box::pin(hold_at_most(incoming, 1));
        let _a = TcpStream::connect(addr).await.unwrap();
        let _b = TcpStream::connect(addr).await.unwrap();
        let first = held.next().await.unwrap().unwrap();
        // The second is not accepted while the first is open ...
        let second = tokio::time::timeout(Duration::from_millis(200), held.next()).await;
        assert!(second.is_err(), "accepted past the cap");
        // ... and is once it closes.
        drop(first);
        let second = tokio::time::timeout(Duration::from_secs(5), held.next()).await;
        assert!(matches!(second, Ok(Some(Ok(_)))));
    }

    #[tokio::test]
    async fn admin_connections_past_the_cap_wait_for_a_place() {
        use axum::serve::Listener;
        let inner = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = inner.local_addr().unwrap();
        let mut listener = AdminListener::new(inner, 1);
        let _a = TcpStream::connect(addr).await.unwrap();
        let _b = TcpStream::connect(addr).await.unwrap();
        let (first, _) = listener.accept().await;
        // The second is not accepted while the first is open ...
        let second = tokio::time::timeout(Duration::from_millis(200), listener.accept()).await;
        assert!(second.is_err(), "accepted past the cap");
        // ... and is once it closes.
        drop(first);
        let second = tokio::time::timeout(Duration::from_secs(30), listener.accept()).await;
        assert!(second.is_ok());
    }

    /// On the paused clock: a connection that sends a byte every 59 s
    /// stays open; one silent for 60 s is closed, and gives its place back.
    #[tokio::test(start_paused = true)]
    async fn an_admin_connection_silent_for_a_minute_is_closed_and_a_byte_keeps_it() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let places = Arc::new(Semaphore::new(1));
        let place = Arc::clone(&places).acquire_owned().await.unwrap();
        let (mut peer, io) = tokio::io::duplex(64);
        let mut held = Held::new(io, place, Some(ADMIN_IDLE_TIMEOUT));
        let reader = tokio::spawn(async move {
            let mut buf = [0u8; 8];
            let mut got = 0;
            loop {
                match held.read(&mut buf).await {
                    Ok(0) => return (got, None),
                    Ok(n) => got += n,
                    Err(e) => return (got, Some((e.kind(), Instant::now()))),
                }
            }
        });
        for _ in 0..3 {
            tokio::time::sleep(ADMIN_IDLE_TIMEOUT - Duration::from_secs(1)).await;
            peer.write_all(b"x").await.unwrap();
        }
        let last_byte = Instant::now();
        let (got, closed) = tokio::time::timeout(10 * ADMIN_IDLE_TIMEOUT, reader)
            .await
            .expect("a silent connection left open")
            .unwrap();
        assert_eq!(got, 3, "closed before its third byte");
        let (kind, at) = closed.expect("closed for its silence, not by its peer");
        assert_eq!(kind, io::ErrorKind::TimedOut);
        let silent = at - last_byte;
        assert!(
            silent >= ADMIN_IDLE_TIMEOUT && silent < ADMIN_IDLE_TIMEOUT + Duration::from_secs(1),
            "closed after {silent:?} of silence"
        );
        assert_eq!(ADMIN_IDLE_TIMEOUT, Duration::from_secs(60));
        assert_eq!(
            places.available_permits(),
            1,
            "its place was not given back"
        );
        drop(peer);
    }
}

//! The engines' KV cache events: one ZMQ subscriber per replica listed
//! with `kv_events=` (vLLM's and SGLang's publisher: a PUB socket, each
//! message three frames: topic, sequence, msgpack batch), each batch
//! decoded by [`hearth_wire::kv_events`] and applied by
//! [`hearth_router::Router::apply_kv_batch`].
//!
//! The subscriber speaks ZMTP 3.0 itself (NULL security, the SUB socket
//! type, a subscription to every topic), over TCP or a Unix socket
//! (`ipc://`), in about two hundred lines, rather than through a ZMQ
//! library: what it reads comes from a peer it must not trust with its
//! memory, and neither crates.io's native ZMQ (`zeromq` 0.7: its read
//! buffer settings are "not a message-size or memory limit", and a frame's
//! 8-byte length is reserved as announced) nor the libzmq binding (a C++
//! build) fits. Here every frame's length is checked before anything is
//! read into memory, a message has at most [`MAX_FRAMES`] frames and
//! [`MAX_MESSAGE_BYTES`] bytes (its buffer grows only as bytes arrive),
//! and a feed that breaks these is disconnected and tried again later.
//! The simulated engine publishes with the `zeromq` crate (`bench/`), and
//! a test here reads vLLM's own publisher (libzmq), so the two sides are
//! not one implementation agreeing with itself.
//!
//! A feed that stops, never connects or sends garbage leaves its replica
//! on the approximate path (warmth from routing, corrected by usage): the
//! router marks its event figures inexact, and `/state` and `/metrics`
//! show why.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hearth_router::{EventEndpoint, EventSource, ReplicaKey, Router};
use serde_json::Value;

use super::engines::EngineClient;
use hearth_wire::kv_events::{decode_batch, decode_sequence};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::task::{AbortHandle, JoinSet};

/// The largest message a feed may send: a batch of
/// [`hearth_wire::kv_events::MAX_BATCH_HASHES`] byte-string hashes with
/// their token ids fits.
pub const MAX_MESSAGE_BYTES: usize = 8 << 20;

/// Frames in one message: topic, sequence, batch.
pub const MAX_FRAMES: usize = 3;

/// The largest command frame read (a READY's properties, a PING).
const MAX_COMMAND_BYTES: usize = 4096;

/// How long a connection and its handshake may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// The wait before reconnecting, doubled after each failure, at most
/// [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// Missed batches asked from a replay socket at once, at most; more
/// missed than this and the gap stays (the replica's figures inexact).
pub const MAX_REPLAY_BATCHES: u64 = 1024;

/// How long a replay may take before the gap is left as it is.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(2);

/// How often the replica list is looked at for feeds to start or stop.
const LIST_POLL: Duration = Duration::from_secs(1);

/// How long `kv_events=auto` waits between asking an engine that does not
/// say (yet) where it publishes, at most.
const MAX_ASK_BACKOFF: Duration = Duration::from_secs(30);

/// The largest `/kv_event_sources` answer read.
const MAX_SOURCES_BYTES: usize = 64 << 10;

/// Why a feed was dropped.
#[derive(Debug, thiserror::Error)]
pub enum FeedError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("the handshake took longer than {CONNECT_TIMEOUT:?}")]
    Timeout,
    #[error("not a ZMTP 3 publisher: {0}")]
    Handshake(&'static str),
    #[error("a frame of {0} bytes, beyond the bound")]
    TooLarge(u64),
    #[error("a message of more frames than it may have")]
    TooManyFrames,
}

/// Runs one subscriber per replica with an event endpoint, started and
/// stopped as the replica list changes, until the task is dropped.
/// `engines` asks the engines listed `kv_events=auto` where they publish.
pub async fn run(router: Arc<Router>, engines: EngineClient) {
    let mut feeds: HashMap<ReplicaKey, (EventSource, AbortHandle)> = HashMap::new();
    let mut tasks = JoinSet::new();
    let mut tick = tokio::time::interval(LIST_POLL);
    loop {
        tick.tick().await;
        while tasks.try_join_next().is_some() {}
        let wanted = router.kv_event_endpoints();
        feeds.retain(|key, (source, task)| {
            let keep = wanted.contains(source);
            if !keep {
                task.abort();
                router.note_kv_feed(*key, false);
            }
            keep
        });
        for source in wanted {
            if let std::collections::hash_map::Entry::Vacant(slot) = feeds.entry(source.key) {
                let task =
                    tasks.spawn(follow(Arc::clone(&router), engines.clone(), source.clone()));
                slot.insert((source, task));
            }
        }
    }
}

/// Where one engine publishes, and replays.
#[derive(Debug, PartialEq, Eq)]
pub struct Feed {
    pub endpoint: EventEndpoint,
    pub replay: Option<EventEndpoint>,
}

/// Asks the engine of `source` (`kv_events=auto`) where it publishes,
/// until it says so in a way [`stated_feed`] takes.
async fn ask(router: &Router, engines: &EngineClient, source: &EventSource) -> Feed {
    let mut backoff = FIRST_BACKOFF;
    let mut said = None;
    loop {
        match ask_once(engines, source).await {
            Ok(feed) => {
                router.note_kv_endpoint(source.key, Some(feed.endpoint.to_string()));
                return feed;
            }
            Err(e) => {
                router.note_kv_endpoint(source.key, None);
                // Said once per different reason, not at every retry.
                if said.as_ref() != Some(&e) {
                    tracing::warn!(engine = %source.addr(), rank = ?source.key.1, "kv_events=auto: {e}");
                    said = Some(e);
                }
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_ASK_BACKOFF);
    }
}

async fn ask_once(engines: &EngineClient, source: &EventSource) -> Result<Feed, String> {
    let url = format!("{}/kv_event_sources", source.engine_url);
    let mut resp = engines
        .get(&url, CONNECT_TIMEOUT)
        .await
        .map_err(|e| format!("GET /kv_event_sources: {e}"))?;
    if !resp.status().is_success() {
        return Err(format!(
            "GET /kv_event_sources answered {} (vLLM serves it; other engines: list the \
             endpoint)",
            resp.status()
        ));
    }
    let mut body = Vec::new();
    while let Some(chunk) = resp
        .chunk()
        .await
        .map_err(|e| format!("GET /kv_event_sources: {e}"))?
    {
        if body.len() + chunk.len() > MAX_SOURCES_BYTES {
            return Err(format!(
                "GET /kv_event_sources: an answer past {MAX_SOURCES_BYTES} bytes"
            ));
        }
        body.extend_from_slice(&chunk);
    }
    let answer: Value = serde_json::from_slice(&body)
        .map_err(|e| format!("GET /kv_event_sources: not JSON: {e}"))?;
    stated_feed(&answer, source.addr(), source.key.1.unwrap_or(0))
}

/// Where an engine at `engine` publishes and replays, from its
/// `/kv_event_sources` answer (vLLM: its `--kv-events-config` per
/// data-parallel rank, `{"0": {"enable_kv_cache_events": true,
/// "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint":
/// ...}}`), rank `rank`'s. Taken only where the endpoint is the engine's own:
/// over TCP a wildcard (`*`, `0.0.0.0`, `::`, read as the engine's
/// address) or the engine's own IP, at the port stated; `ipc://` only for
/// an engine on this host (a loopback address). Anything else is refused
/// with the reason, so an engine cannot point the sidecar elsewhere.
pub fn stated_feed(answer: &Value, engine: SocketAddr, rank: u32) -> Result<Feed, String> {
    let sources = answer
        .as_object()
        .ok_or("GET /kv_event_sources: not a JSON object")?;
    let Some(config) = sources.get(&rank.to_string()) else {
        return Err(if sources.is_empty() {
            "the engine states no KV event publisher (vLLM: --kv-events-config)".into()
        } else {
            format!("the engine states no publisher for data-parallel rank {rank}")
        });
    };
    if config.get("enable_kv_cache_events") == Some(&Value::Bool(false))
        || config
            .get("publisher")
            .and_then(Value::as_str)
            .is_some_and(|p| p != "zmq")
    {
        return Err("the engine's KV events are off, or not published over ZMQ".into());
    }
    let endpoint = |field: &str| -> Result<Option<EventEndpoint>, String> {
        match config.get(field) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) if s.is_empty() => Ok(None),
            Some(Value::String(s)) => own_endpoint(s, engine).map(Some),
            Some(_) => Err(format!("{field}: not a string")),
        }
    };
    let published = endpoint("endpoint")?.ok_or("the engine states no endpoint")?;
    Ok(Feed {
        endpoint: published,
        replay: endpoint("replay_endpoint")?,
    })
}

/// An endpoint an engine at `engine` states, when it is the engine's own.
pub(crate) fn own_endpoint(stated: &str, engine: SocketAddr) -> Result<EventEndpoint, String> {
    if let Some(rest) = stated.strip_prefix("tcp://") {
        let (host, port) = rest
            .rsplit_once(':')
            .ok_or_else(|| format!("{stated:?}: no port"))?;
        let port: u16 = port
            .parse()
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| format!("{stated:?}: not a port to connect to"))?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let ip = match host {
            "*" | "0.0.0.0" | "::" => engine.ip(),
            _ => host
                .parse::<std::net::IpAddr>()
                .ok()
                .filter(|ip| *ip == engine.ip())
                .ok_or_else(|| {
                    format!(
                        "{stated:?} is not the engine's own address ({})",
                        engine.ip()
                    )
                })?,
        };
        return Ok(EventEndpoint::Tcp(SocketAddr::new(ip, port)));
    }
    if stated.starts_with("ipc://") {
        if !engine.ip().is_loopback() {
            return Err(format!(
                "{stated:?}: a Unix socket of another host (the engine is at {engine}); \
                 have it publish on tcp://*:PORT"
            ));
        }
        return stated.parse();
    }
    Err(format!("{stated:?} is neither tcp:// nor ipc://"))
}

/// A stream to `endpoint`, within [`CONNECT_TIMEOUT`].
async fn connect(endpoint: &EventEndpoint) -> Result<Stream, FeedError> {
    let stream = match endpoint {
        EventEndpoint::Tcp(to) => {
            tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::TcpStream::connect(to))
                .await
                .map_err(|_| FeedError::Timeout)?
                .map(|s| {
                    let _ = s.set_nodelay(true);
                    Stream::Tcp(s)
                })?
        }
        EventEndpoint::Ipc(path) => {
            tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::UnixStream::connect(path))
                .await
                .map_err(|_| FeedError::Timeout)?
                .map(Stream::Unix)?
        }
        // Asked for before connecting (`follow`).
        EventEndpoint::FromEngine => return Err(FeedError::Handshake("no endpoint yet")),
    };
    Ok(stream)
}

/// A TCP or Unix stream.
enum Stream {
    Tcp(tokio::net::TcpStream),
    Unix(tokio::net::UnixStream),
}

impl AsyncRead for Stream {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => std::pin::Pin::new(s).poll_read(cx, buf),
            Stream::Unix(s) => std::pin::Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Stream::Tcp(s) => std::pin::Pin::new(s).poll_write(cx, buf),
            Stream::Unix(s) => std::pin::Pin::new(s).poll_write(cx, buf),
        }
    }
    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => std::pin::Pin::new(s).poll_flush(cx),
            Stream::Unix(s) => std::pin::Pin::new(s).poll_flush(cx),
        }
    }
    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => std::pin::Pin::new(s).poll_shutdown(cx),
            Stream::Unix(s) => std::pin::Pin::new(s).poll_shutdown(cx),
        }
    }
}

/// Follows one engine's feed: connect, read until it fails, wait, again.
async fn follow(router: Arc<Router>, engines: EngineClient, source: EventSource) {
    let key = source.key;
    let mut backoff = FIRST_BACKOFF;
    loop {
        let feed = match source.endpoint {
            EventEndpoint::FromEngine => ask(&router, &engines, &source).await,
            _ => Feed {
                endpoint: source.endpoint.clone(),
                replay: source.replay.clone(),
            },
        };
        let result = match connect(&feed.endpoint).await {
            Ok(stream) => read_feed(&router, key, &feed, stream, &mut backoff).await,
            Err(e) => Err(e),
        };
        router.note_kv_feed(key, false);
        if let Err(e) = result {
            tracing::debug!(engine = %key.0, rank = ?key.1, endpoint = %feed.endpoint, error = %e, "KV event feed lost");
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// Handshakes, subscribes, then applies every message until the stream
/// ends or breaks a bound. A batch further on than the router expects
/// (batches lost, or the feed joined a running engine) first asks the
/// replay socket, when there is one, for the ones missed.
async fn read_feed<S: AsyncRead + AsyncWrite + Unpin>(
    router: &Router,
    key: ReplicaKey,
    feed: &Feed,
    mut stream: S,
    backoff: &mut Duration,
) -> Result<(), FeedError> {
    tokio::time::timeout(CONNECT_TIMEOUT, subscribe(&mut stream))
        .await
        .map_err(|_| FeedError::Timeout)??;
    router.note_kv_feed(key, true);
    *backoff = FIRST_BACKOFF;
    tracing::debug!(engine = %key.0, rank = ?key.1, "KV event feed connected");
    loop {
        let frames = read_message(&mut stream, MAX_FRAMES).await?;
        let [_topic, seq, payload] = frames.as_slice() else {
            router.note_kv_refused(key);
            continue;
        };
        let Some(seq) = decode_sequence(seq) else {
            router.note_kv_refused(key);
            continue;
        };
        if let Some(replay) = &feed.replay {
            // From where the router stands; from 0 for a new engine
            // process (the sequence went back) or a first batch.
            let from = match router.kv_expected_seq(key) {
                Some(next) if seq >= next => next,
                _ => 0,
            };
            if seq > from && seq - from <= MAX_REPLAY_BATCHES {
                match tokio::time::timeout(REPLAY_TIMEOUT, fetch_replay(replay, from, seq)).await {
                    Ok(Ok(missed)) => {
                        router.note_kv_replayed(key, missed.len() as u64);
                        for (seq, payload) in missed {
                            apply(router, key, seq, &payload);
                        }
                    }
                    Ok(Err(e)) => {
                        tracing::debug!(engine = %key.0, rank = ?key.1, error = %e, "KV event replay failed")
                    }
                    Err(_) => {
                        tracing::debug!(engine = %key.0, rank = ?key.1, "KV event replay timed out")
                    }
                }
            }
        }
        apply(router, key, seq, payload);
    }
}

/// Decodes and applies batch `seq`.
fn apply(router: &Router, key: ReplicaKey, seq: u64, payload: &[u8]) {
    match decode_batch(payload) {
        Ok(batch) => {
            let restarts = router.apply_kv_batch(key, seq, &batch);
            if !restarts.is_empty() {
                tracing::info!(
                    engine = %key.0,
                    rank = ?key.1,
                    ?restarts,
                    "the engine's KV events show a restart: its warmth is dropped"
                );
            }
        }
        Err(_) => router.note_kv_refused(key),
    }
}

/// The batches `from..until` from a replay socket (a ROUTER: asked with
/// `["", from as 8 bytes]` from a DEALER, it answers `["", topic,
/// sequence, batch]` per batch it still has from there, then `["", "",
/// -1, ""]`), at most [`MAX_REPLAY_BATCHES`] of them, in order, each
/// bounded as a feed's message is.
pub async fn fetch_replay(
    endpoint: &EventEndpoint,
    from: u64,
    until: u64,
) -> Result<Vec<(u64, Vec<u8>)>, FeedError> {
    let mut stream = connect(endpoint).await?;
    handshake(&mut stream, b"DEALER", &[b"ROUTER"]).await?;
    let mut request = vec![0x01, 0x00, 0x00, 0x08];
    request.extend_from_slice(&from.to_be_bytes());
    stream.write_all(&request).await?;
    stream.flush().await?;
    let mut out = Vec::new();
    loop {
        let frames = read_message(&mut stream, 4).await?;
        let [_empty, _topic, seq, payload] = frames.as_slice() else {
            return Err(FeedError::Handshake("not a replay answer"));
        };
        match decode_sequence(seq) {
            Some(seq) if seq == u64::MAX => return Ok(out),
            Some(seq) if seq >= from && seq < until => {
                if out.len() as u64 >= MAX_REPLAY_BATCHES {
                    return Ok(out);
                }
                out.push((seq, payload.clone()));
            }
            Some(_) => {}
            None => return Err(FeedError::Handshake("not a replay answer")),
        }
    }
}

/// The greeting: ZMTP 3.0, the NULL mechanism, as a client.
fn greeting() -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// A READY command naming this socket's type.
fn ready(socket_type: &[u8]) -> Vec<u8> {
    let mut body = vec![5];
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
    body.extend_from_slice(socket_type);
    let mut frame = vec![0x04, body.len() as u8];
    frame.extend_from_slice(&body);
    frame
}

/// Greets the publisher, exchanges READY (checking it is a PUB or XPUB
/// socket) and subscribes to every topic (ZMTP 3.0 subscribes with a
/// message: `0x01` then the prefix).
pub async fn subscribe<S: AsyncRead + AsyncWrite + Unpin>(stream: &mut S) -> Result<(), FeedError> {
    handshake(stream, b"SUB", &[b"PUB", b"XPUB"]).await?;
    stream.write_all(&[0x00, 0x01, 0x01]).await?;
    stream.flush().await?;
    Ok(())
}

/// Greetings and READY as a `ours` socket, to a peer of one of the
/// `theirs` types.
async fn handshake<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    ours: &[u8],
    theirs_may_be: &[&[u8]],
) -> Result<(), FeedError> {
    stream.write_all(&greeting()).await?;
    let mut theirs = [0u8; 64];
    stream.read_exact(&mut theirs).await?;
    if theirs[0] != 0xff || theirs[9] != 0x7f {
        return Err(FeedError::Handshake("no ZMTP signature"));
    }
    if theirs[10] < 3 {
        return Err(FeedError::Handshake("ZMTP before 3.0"));
    }
    if &theirs[12..16] != b"NULL" || theirs[16..32].iter().any(|b| *b != 0) {
        return Err(FeedError::Handshake("a security mechanism other than NULL"));
    }
    stream.write_all(&ready(ours)).await?;
    let (command, body) = read_frame(stream, MAX_COMMAND_BYTES).await?;
    if !command || !body.starts_with(b"\x05READY") {
        return Err(FeedError::Handshake("no READY"));
    }
    match property(&body[6..], b"Socket-Type") {
        Some(t) if theirs_may_be.contains(&t) => Ok(()),
        _ => Err(FeedError::Handshake("the peer's socket type does not fit")),
    }
}

/// A metadata property's value (ZMTP: name length, name, 4-byte value
/// length, value; names compare without case).
fn property<'a>(mut props: &'a [u8], name: &[u8]) -> Option<&'a [u8]> {
    while let Some((&n, rest)) = props.split_first() {
        let key = rest.get(..usize::from(n))?;
        let rest = &rest[usize::from(n)..];
        let len = u32::from_be_bytes(rest.get(..4)?.try_into().ok()?) as usize;
        let value = rest.get(4..4 + len)?;
        if key.eq_ignore_ascii_case(name) {
            return Some(value);
        }
        props = &rest[4 + len..];
    }
    None
}

/// One frame: whether it is a command, and its body (at most `limit`
/// bytes, refused before it is read otherwise). The body's buffer grows
/// only as its bytes arrive.
async fn read_frame<S: AsyncRead + Unpin>(
    stream: &mut S,
    limit: usize,
) -> Result<(bool, Vec<u8>), FeedError> {
    let (command, _more, body) = read_flagged(stream, limit).await?;
    Ok((command, body))
}

async fn read_flagged<S: AsyncRead + Unpin>(
    stream: &mut S,
    limit: usize,
) -> Result<(bool, bool, Vec<u8>), FeedError> {
    let flags = stream.read_u8().await?;
    let len = if flags & 0x02 != 0 {
        stream.read_u64().await?
    } else {
        u64::from(stream.read_u8().await?)
    };
    if len > limit as u64 {
        return Err(FeedError::TooLarge(len));
    }
    let mut body = Vec::with_capacity((len as usize).min(64 << 10));
    let read = stream.take(len).read_to_end(&mut body).await?;
    if read as u64 != len {
        return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
    }
    Ok((flags & 0x04 != 0, flags & 0x01 != 0, body))
}

/// One message's frames (commands between messages are read and
/// dropped), at most `max_frames` and [`MAX_MESSAGE_BYTES`] in all.
pub async fn read_message<S: AsyncRead + Unpin>(
    stream: &mut S,
    max_frames: usize,
) -> Result<Vec<Vec<u8>>, FeedError> {
    let mut frames = Vec::new();
    let mut left = MAX_MESSAGE_BYTES;
    loop {
        let limit = if frames.is_empty() {
            left.max(MAX_COMMAND_BYTES)
        } else {
            left
        };
        let (command, more, body) = read_flagged(stream, limit).await?;
        if command {
            if !frames.is_empty() || body.len() > MAX_COMMAND_BYTES {
                return Err(FeedError::Handshake("a command inside a message"));
            }
            continue;
        }
        left -= body.len().min(left);
        frames.push(body);
        if !more {
            return Ok(frames);
        }
        if frames.len() >= max_frames {
            return Err(FeedError::TooManyFrames);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_takes_only_the_engines_own_endpoints() {
        let engine: SocketAddr = "10.0.0.5:8000".parse().unwrap();
        let local: SocketAddr = "127.0.0.1:8000".parse().unwrap();
        let sources = |endpoint: &str, replay: Value| {
            serde_json::json!({"0": {
                "enable_kv_cache_events": true, "publisher": "zmq", "topic": "kv",
                "endpoint": endpoint, "replay_endpoint": replay,
            }})
        };
        let tcp = |a: &str| EventEndpoint::Tcp(a.parse().unwrap());
        // vLLM's wildcard binds read as the engine's own address.
        assert_eq!(
            stated_feed(&sources("tcp://*:5557", "tcp://*:5558".into()), engine, 0),
            Ok(Feed {
                endpoint: tcp("10.0.0.5:5557"),
                replay: Some(tcp("10.0.0.5:5558")),
            })
        );
        for own in [
            "tcp://0.0.0.0:5557",
            "tcp://10.0.0.5:5557",
            "tcp://[::]:5557",
        ] {
            let feed = stated_feed(&sources(own, Value::Null), engine, 0).unwrap();
            assert_eq!(
                (feed.endpoint, feed.replay),
                (tcp("10.0.0.5:5557"), None),
                "{own}"
            );
        }
        // A Unix socket only for an engine on this host.
        let ipc = sources("ipc:///tmp/kv.sock", Value::Null);
        assert_eq!(
            stated_feed(&ipc, local, 0).map(|f| f.endpoint),
            Ok(EventEndpoint::Ipc("/tmp/kv.sock".into()))
        );
        assert!(stated_feed(&ipc, engine, 0)
            .unwrap_err()
            .contains("another host"));
        // Another host, a port of 0, another transport: refused, saying why.
        for (stated, why) in [
            ("tcp://10.0.0.6:5557", "not the engine's own address"),
            ("tcp://127.0.0.1:5557", "not the engine's own address"),
            ("tcp://*:0", "not a port"),
            ("inproc://cache", "neither tcp:// nor ipc://"),
        ] {
            let e = stated_feed(&sources(stated, Value::Null), engine, 0).unwrap_err();
            assert!(e.contains(why), "{stated}: {e}");
        }
        let e = stated_feed(
            &sources("tcp://*:5557", "tcp://10.9.9.9:1".into()),
            engine,
            0,
        );
        assert!(e.is_err_and(|e| e.contains("not the engine's own")));
        // A data-parallel rank takes its own entry (vLLM states each rank's
        // endpoint, its port offset by the rank), and only its own.
        let ranks = serde_json::json!({
            "0": {"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5600"},
            "1": {"publisher": "zmq", "endpoint": "tcp://*:5558", "replay_endpoint": "tcp://*:5601"},
        });
        assert_eq!(
            stated_feed(&ranks, engine, 1),
            Ok(Feed {
                endpoint: tcp("10.0.0.5:5558"),
                replay: Some(tcp("10.0.0.5:5601")),
            })
        );
        assert!(stated_feed(&ranks, engine, 2)
            .unwrap_err()
            .contains("no publisher for data-parallel rank 2"));
        // No publisher, events off, or not an answer at all.
        for (answer, why) in [
            (serde_json::json!({}), "states no KV event publisher"),
            (serde_json::json!({"1": {}}), "rank 0"),
            (
                serde_json::json!({"0": {"enable_kv_cache_events": false, "endpoint": "tcp://*:1"}}),
                "off",
            ),
            (serde_json::json!({"0": {"publisher": "null"}}), "off"),
            (
                serde_json::json!({"0": {"publisher": "zmq"}}),
                "no endpoint",
            ),
            (serde_json::json!([1]), "not a JSON object"),
        ] {
            let e = stated_feed(&answer, engine, 0).unwrap_err();
            assert!(e.contains(why), "{answer}: {e}");
        }
    }

    /// A publisher's side of the handshake, written per the ZMTP 3.0
    /// text: greeting, READY as PUB, then the subscription it must get.
    async fn publisher_handshake(peer: &mut tokio::io::DuplexStream) {
        let mut g = [0u8; 64];
        peer.read_exact(&mut g).await.unwrap();
        assert_eq!(
            (g[0], g[9], g[10], &g[12..16]),
            (0xff, 0x7f, 3, &b"NULL"[..])
        );
        peer.write_all(&greeting()).await.unwrap();
        let mut ready_in = [0u8; 2];
        peer.read_exact(&mut ready_in).await.unwrap();
        assert_eq!(ready_in[0], 0x04);
        let mut body = vec![0u8; usize::from(ready_in[1])];
        peer.read_exact(&mut body).await.unwrap();
        assert_eq!(property(&body[6..], b"socket-type"), Some(&b"SUB"[..]));
        peer.write_all(&ready(b"PUB")).await.unwrap();
        let mut sub = [0u8; 3];
        peer.read_exact(&mut sub).await.unwrap();
        assert_eq!(sub, [0x00, 0x01, 0x01]);
    }

    #[tokio::test]
    async fn reads_messages_and_skips_commands_between_them() {
        let (mut ours, mut theirs) = tokio::io::duplex(1 << 16);
        let (sub, publisher) = tokio::join!(subscribe(&mut ours), publisher_handshake(&mut theirs));
        sub.unwrap();
        let _: () = publisher;
        // A PING command, then [topic, seq, batch] with a long last frame.
        let mut bytes = vec![0x04, 0x05, 0x04, b'P', b'I', b'N', b'G'];
        bytes.extend_from_slice(&[0x01, 0x02, b'k', b'v', 0x01, 0x08, 0, 0, 0, 0, 0, 0, 0, 7]);
        bytes.extend_from_slice(&[0x02, 0, 0, 0, 0, 0, 0, 0, 3, 1, 2, 3]);
        theirs.write_all(&bytes).await.unwrap();
        let frames = read_message(&mut ours, MAX_FRAMES).await.unwrap();
        assert_eq!(
            frames,
            vec![b"kv".to_vec(), vec![0, 0, 0, 0, 0, 0, 0, 7], vec![1, 2, 3]]
        );
    }

    #[tokio::test]
    async fn a_huge_frame_or_too_many_frames_drop_the_feed_before_any_read() {
        let (mut ours, mut theirs) = tokio::io::duplex(1 << 16);
        // A frame announcing 2^62 bytes.
        theirs
            .write_all(&[0x02, 0x40, 0, 0, 0, 0, 0, 0, 0])
            .await
            .unwrap();
        assert!(matches!(
            read_message(&mut ours, MAX_FRAMES).await,
            Err(FeedError::TooLarge(_))
        ));
        let (mut ours, mut theirs) = tokio::io::duplex(1 << 16);
        theirs
            .write_all(&[0x01, 0x00, 0x01, 0x00, 0x01, 0x00, 0x00, 0x00])
            .await
            .unwrap();
        assert!(matches!(
            read_message(&mut ours, MAX_FRAMES).await,
            Err(FeedError::TooManyFrames)
        ));
        // Frames that together pass the message bound.
        let (mut ours, mut theirs) = tokio::io::duplex(1 << 20);
        let writer = tokio::spawn(async move {
            let half = (MAX_MESSAGE_BYTES / 2 + 1) as u64;
            for flags in [0x03u8, 0x02] {
                let mut head = vec![flags];
                head.extend_from_slice(&half.to_be_bytes());
                if theirs.write_all(&head).await.is_err() {
                    return;
                }
                let chunk = vec![0u8; half as usize];
                if flags == 0x03 && theirs.write_all(&chunk).await.is_err() {
                    return;
                }
            }
        });
        assert!(matches!(
            read_message(&mut ours, MAX_FRAMES).await,
            Err(FeedError::TooLarge(_))
        ));
        writer.abort();
        // Not a publisher: no signature, or a REQ socket.
        let (mut ours, mut theirs) = tokio::io::duplex(1 << 16);
        theirs.write_all(&[0u8; 64]).await.unwrap();
        assert!(subscribe(&mut ours).await.is_err());
        let (mut ours, mut theirs) = tokio::io::duplex(1 << 16);
        theirs.write_all(&greeting()).await.unwrap();
        theirs.write_all(&ready(b"REQ")).await.unwrap();
        assert!(matches!(
            subscribe(&mut ours).await,
            Err(FeedError::Handshake(_))
        ));
    }
}

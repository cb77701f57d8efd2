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

use hearth_router::{EventEndpoint, Router};
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

/// How often the replica list is looked at for feeds to start or stop.
const LIST_POLL: Duration = Duration::from_secs(1);

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
    #[error("a message of more than {MAX_FRAMES} frames")]
    TooManyFrames,
}

/// Runs one subscriber per replica with an event endpoint, started and
/// stopped as the replica list changes, until the task is dropped.
pub async fn run(router: Arc<Router>) {
    let mut feeds: HashMap<SocketAddr, (EventEndpoint, AbortHandle)> = HashMap::new();
    let mut tasks = JoinSet::new();
    let mut tick = tokio::time::interval(LIST_POLL);
    loop {
        tick.tick().await;
        while tasks.try_join_next().is_some() {}
        let wanted = router.kv_event_endpoints();
        feeds.retain(|addr, (endpoint, task)| {
            let keep = wanted.iter().any(|(a, e)| a == addr && e == endpoint);
            if !keep {
                task.abort();
                router.note_kv_feed(*addr, false);
            }
            keep
        });
        for (addr, endpoint) in wanted {
            if let std::collections::hash_map::Entry::Vacant(slot) = feeds.entry(addr) {
                let task = tasks.spawn(follow(Arc::clone(&router), addr, endpoint.clone()));
                slot.insert((endpoint, task));
            }
        }
    }
}

/// Follows one engine's feed: connect, read until it fails, wait, again.
async fn follow(router: Arc<Router>, addr: SocketAddr, endpoint: EventEndpoint) {
    let mut backoff = FIRST_BACKOFF;
    loop {
        let result = match &endpoint {
            EventEndpoint::Tcp(to) => {
                let stream =
                    tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::TcpStream::connect(to))
                        .await
                        .map_err(|_| FeedError::Timeout)
                        .and_then(|r| r.map_err(FeedError::from));
                match stream {
                    Ok(s) => {
                        let _ = s.set_nodelay(true);
                        read_feed(&router, addr, s, &mut backoff).await
                    }
                    Err(e) => Err(e),
                }
            }
            EventEndpoint::Ipc(path) => {
                let stream =
                    tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::UnixStream::connect(path))
                        .await
                        .map_err(|_| FeedError::Timeout)
                        .and_then(|r| r.map_err(FeedError::from));
                match stream {
                    Ok(s) => read_feed(&router, addr, s, &mut backoff).await,
                    Err(e) => Err(e),
                }
            }
        };
        router.note_kv_feed(addr, false);
        if let Err(e) = result {
            tracing::debug!(engine = %addr, %endpoint, error = %e, "KV event feed lost");
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// Handshakes, subscribes, then applies every message until the stream
/// ends or breaks a bound.
async fn read_feed<S: AsyncRead + AsyncWrite + Unpin>(
    router: &Router,
    addr: SocketAddr,
    mut stream: S,
    backoff: &mut Duration,
) -> Result<(), FeedError> {
    tokio::time::timeout(CONNECT_TIMEOUT, subscribe(&mut stream))
        .await
        .map_err(|_| FeedError::Timeout)??;
    router.note_kv_feed(addr, true);
    *backoff = FIRST_BACKOFF;
    tracing::debug!(engine = %addr, "KV event feed connected");
    loop {
        let frames = read_message(&mut stream).await?;
        match frames.as_slice() {
            [_topic, seq, payload] => match (decode_sequence(seq), decode_batch(payload)) {
                (Some(seq), Ok(batch)) => {
                    let restarts = router.apply_kv_batch(addr, seq, &batch);
                    if !restarts.is_empty() {
                        tracing::info!(
                            engine = %addr,
                            ?restarts,
                            "the engine's KV events show a restart: its warmth is dropped"
                        );
                    }
                }
                _ => router.note_kv_refused(addr),
            },
            _ => router.note_kv_refused(addr),
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
    stream.write_all(&ready(b"SUB")).await?;
    let (command, body) = read_frame(stream, MAX_COMMAND_BYTES).await?;
    if !command || !body.starts_with(b"\x05READY") {
        return Err(FeedError::Handshake("no READY"));
    }
    match property(&body[6..], b"Socket-Type") {
        Some(b"PUB") | Some(b"XPUB") => {}
        _ => return Err(FeedError::Handshake("the peer is not a PUB socket")),
    }
    stream.write_all(&[0x00, 0x01, 0x01]).await?;
    stream.flush().await?;
    Ok(())
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
/// dropped), at most [`MAX_FRAMES`] and [`MAX_MESSAGE_BYTES`] in all.
pub async fn read_message<S: AsyncRead + Unpin>(stream: &mut S) -> Result<Vec<Vec<u8>>, FeedError> {
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
        if frames.len() >= MAX_FRAMES {
            return Err(FeedError::TooManyFrames);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let frames = read_message(&mut ours).await.unwrap();
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
            read_message(&mut ours).await,
            Err(FeedError::TooLarge(_))
        ));
        let (mut ours, mut theirs) = tokio::io::duplex(1 << 16);
        theirs
            .write_all(&[0x01, 0x00, 0x01, 0x00, 0x01, 0x00, 0x00, 0x00])
            .await
            .unwrap();
        assert!(matches!(
            read_message(&mut ours).await,
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
            read_message(&mut ours).await,
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

//! An engine's KV cache events where a peer router can read them: vLLM
//! binds its publisher only on wildcard and `ipc://` endpoints (any other
//! address it connects out to), while vllm-router's `kv_aware` takes only
//! `tcp://HOST:PORT` and connects. [`KvForward`] subscribes to an engine's
//! publisher (its `ipc://` socket, or a TCP one) with the sidecar's own
//! subscriber ([`hearth_ext_proc::feeds::kv_events`]: frame lengths
//! checked before anything is read) and publishes every message again,
//! frames unchanged, on a loopback TCP port of its own.
//!
//! Only the live stream is forwarded; a subscriber that misses batches
//! sees the sequence gap, as it would on the engine's own socket (the
//! replay socket is not forwarded).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use hearth_ext_proc::feeds::kv_events::{read_message, subscribe, MAX_FRAMES};
use hearth_router::EventEndpoint;
use tokio::task::JoinHandle;
use zeromq::{Socket, SocketSend, ZmqMessage};

/// A running forwarder; stops when dropped.
pub struct KvForward {
    /// Where it publishes: `tcp://127.0.0.1:PORT`.
    pub endpoint: String,
    /// Messages forwarded so far.
    forwarded: Arc<AtomicU64>,
    task: JoinHandle<()>,
}

impl KvForward {
    /// Binds a PUB socket on a free loopback port and follows `from`,
    /// reconnecting (after a short pause) whenever the engine's socket
    /// closes, e.g. across an engine restart.
    pub async fn start(from: EventEndpoint) -> anyhow::Result<KvForward> {
        anyhow::ensure!(
            !matches!(from, EventEndpoint::FromEngine),
            "a forwarder needs the engine's stated endpoint"
        );
        let mut publisher = zeromq::PubSocket::new();
        let endpoint = publisher
            .bind("tcp://127.0.0.1:0")
            .await
            .context("binding the forwarder's loopback port")?
            .to_string();
        let forwarded = Arc::new(AtomicU64::new(0));
        let count = Arc::clone(&forwarded);
        let task = tokio::spawn(async move {
            loop {
                // Any failure (the engine not up yet, restarted, a frame
                // too large) ends this connection; the next one starts
                // with a fresh subscription.
                let _ = forward(&from, &mut publisher, &count).await;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        });
        Ok(KvForward {
            endpoint,
            forwarded,
            task,
        })
    }

    /// Messages forwarded so far.
    pub fn forwarded(&self) -> u64 {
        self.forwarded.load(Ordering::Relaxed)
    }

    /// The port it publishes on.
    pub fn addr(&self) -> Option<SocketAddr> {
        self.endpoint.strip_prefix("tcp://")?.parse().ok()
    }
}

impl Drop for KvForward {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One connection to the engine's publisher: subscribe, then publish
/// every message read until the stream ends or breaks a limit.
async fn forward(
    from: &EventEndpoint,
    publisher: &mut zeromq::PubSocket,
    count: &AtomicU64,
) -> anyhow::Result<()> {
    match from {
        EventEndpoint::Tcp(addr) => {
            let mut s = tokio::net::TcpStream::connect(addr).await?;
            relay(&mut s, publisher, count).await
        }
        EventEndpoint::Ipc(path) => {
            let mut s = tokio::net::UnixStream::connect(path).await?;
            relay(&mut s, publisher, count).await
        }
        EventEndpoint::FromEngine => anyhow::bail!("no endpoint"),
    }
}

async fn relay<S>(
    stream: &mut S,
    publisher: &mut zeromq::PubSocket,
    count: &AtomicU64,
) -> anyhow::Result<()>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    subscribe(stream).await?;
    loop {
        let frames = read_message(stream, MAX_FRAMES).await?;
        let mut parts = frames.into_iter().map(Bytes::from);
        let mut message = ZmqMessage::from(parts.next().unwrap_or_default());
        for part in parts {
            message.push_back(part);
        }
        publisher.send(message).await?;
        count.fetch_add(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::kv_publisher::KvPublisher;
    use hearth_wire::kv_events::{decode_batch, Event, Medium};
    use zeromq::SocketRecv;

    /// The simulated engine's publisher stands in for vLLM's (its own
    /// socket is read by the real-vLLM runs of `hearth-bench compare`).
    #[tokio::test]
    async fn every_batch_is_published_again_unchanged_on_a_loopback_port() {
        let publisher = KvPublisher::start("tcp://127.0.0.1:0", None, "kv")
            .await
            .unwrap();
        let from: EventEndpoint = publisher.endpoint.parse().unwrap();
        let forward = KvForward::start(from).await.unwrap();
        assert!(forward.addr().unwrap().ip().is_loopback());
        let mut sub = zeromq::SubSocket::new();
        sub.connect(&forward.endpoint).await.unwrap();
        sub.subscribe("").await.unwrap();
        let stored = Event::Stored {
            hashes: vec![7, 8],
            parent: Some(6),
            tokens: 32,
            block_size: 16,
            medium: Medium::Device,
        };
        // PUB drops what it sends before a subscriber is connected: send
        // until the first batch comes through (both hops connect in the
        // background), then one more that must follow it.
        let first = loop {
            publisher.publish(vec![stored.clone()]);
            match tokio::time::timeout(Duration::from_millis(100), sub.recv()).await {
                Ok(message) => break message.unwrap(),
                Err(_) => continue,
            }
        };
        let frames: Vec<_> = first.into_vec();
        assert_eq!(frames.len(), 3);
        assert_eq!(&frames[0][..], b"kv");
        let seq = u64::from_be_bytes(frames[1][..].try_into().unwrap());
        assert_eq!(decode_batch(&frames[2]).unwrap().events, vec![stored]);

        publisher.publish(vec![Event::AllCleared]);
        let next = loop {
            let message = tokio::time::timeout(Duration::from_secs(10), sub.recv())
                .await
                .expect("the next batch")
                .unwrap()
                .into_vec();
            if decode_batch(&message[2]).unwrap().events == vec![Event::AllCleared] {
                break message;
            }
        };
        assert!(u64::from_be_bytes(next[1][..].try_into().unwrap()) > seq);
        assert!(forward.forwarded() >= 2);
    }
}

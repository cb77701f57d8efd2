//! The simulated engine's KV cache events, published as vLLM does
//! (`vllm/distributed/kv_events.py`'s `ZmqEventPublisher`): a ZMQ PUB
//! socket bound to the configured endpoint, each batch a three-frame
//! message (topic, sequence as 8 bytes big-endian from 0, the msgpack
//! batch of [`hearth_wire::kv_events::encode_batch`]), one batch per
//! admission or scheduler step that changed the cache. A new engine
//! starts its sequence at 0 again, as a restarted vLLM does.
//!
//! With a replay endpoint, a ROUTER socket answers a request for the
//! batches from a sequence number (one frame, 8 bytes big-endian, after
//! the empty delimiter) with each of the last [`REPLAY_BATCHES`] batches
//! from there, `[identity, "", topic, sequence, batch]`, then an end
//! marker `[identity, "", "", -1 as 8 bytes, ""]`, as vLLM does.
//!
//! Faults for tests: [`KvPublisher::drop_batches`] numbers the next
//! batches and keeps them for replay but never sends them (a gap, as a
//! subscriber too slow for the publisher's high-water mark sees).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use hearth_wire::kv_events::{encode_batch, Batch, Event};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

/// Batches kept for replay (vLLM's `buffer_steps` default).
pub const REPLAY_BATCHES: usize = 10_000;

/// A running publisher: hand it each step's events.
#[derive(Debug)]
pub struct KvPublisher {
    batches: mpsc::UnboundedSender<Vec<Event>>,
    /// Where it is bound (a `tcp://ip:0` endpoint names its port here).
    pub endpoint: String,
    /// Where its replay socket is bound, if it has one.
    pub replay_endpoint: Option<String>,
    drop_next: Arc<AtomicU64>,
    /// Batches numbered so far.
    pub sequence: Arc<AtomicU64>,
    task: JoinHandle<()>,
}

impl KvPublisher {
    /// Binds `endpoint` (`tcp://ip:port`; port 0 for any), and `replay`
    /// when given, and starts publishing under `topic`.
    pub async fn start(
        endpoint: &str,
        replay: Option<&str>,
        topic: &str,
    ) -> anyhow::Result<KvPublisher> {
        let mut socket = zeromq::PubSocket::new();
        let bound = socket.bind(endpoint).await?.to_string();
        let mut replay_socket = None;
        let mut replay_bound = None;
        if let Some(replay) = replay {
            let mut router = zeromq::RouterSocket::new();
            replay_bound = Some(router.bind(replay).await?.to_string());
            replay_socket = Some(router);
        }
        let (batches, mut rx) = mpsc::unbounded_channel::<Vec<Event>>();
        let drop_next = Arc::new(AtomicU64::new(0));
        let sequence = Arc::new(AtomicU64::new(0));
        let topic = Bytes::copy_from_slice(topic.as_bytes());
        let (dropping, numbered) = (Arc::clone(&drop_next), Arc::clone(&sequence));
        let task = tokio::spawn(async move {
            let mut kept: VecDeque<(u64, Bytes)> = VecDeque::new();
            loop {
                let request = async {
                    match replay_socket.as_mut() {
                        Some(router) => router.recv().await.ok(),
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    events = rx.recv() => {
                        let Some(events) = events else { break };
                        let seq = numbered.fetch_add(1, Ordering::Relaxed);
                        let ts = SystemTime::now()
                            .duration_since(UNIX_EPOCH)
                            .map_or(0.0, |d| d.as_secs_f64());
                        let payload = Bytes::from(encode_batch(&Batch {
                            ts,
                            events,
                            data_parallel_rank: Some(0),
                        }));
                        kept.push_back((seq, payload.clone()));
                        if kept.len() > REPLAY_BATCHES {
                            kept.pop_front();
                        }
                        let dropped = dropping
                            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
                            .is_ok();
                        if dropped {
                            continue;
                        }
                        let message = frames(vec![topic.clone(), seq_frame(seq), payload]);
                        if let Err(e) = socket.send(message).await {
                            tracing::warn!(error = %e, "KV event batch not published");
                        }
                    }
                    Some(asked) = request => {
                        let (Some(router), Some(identity), Some(start)) = (
                            replay_socket.as_mut(),
                            asked.get(0).cloned(),
                            asked.get(2).and_then(|f| <[u8; 8]>::try_from(f.as_ref()).ok()),
                        ) else {
                            continue;
                        };
                        let start = u64::from_be_bytes(start);
                        for (seq, payload) in kept.iter().filter(|(seq, _)| *seq >= start) {
                            let reply = frames(vec![
                                identity.clone(),
                                Bytes::new(),
                                topic.clone(),
                                seq_frame(*seq),
                                payload.clone(),
                            ]);
                            let _ = router.send(reply).await;
                        }
                        let end = frames(vec![
                            identity,
                            Bytes::new(),
                            Bytes::new(),
                            Bytes::copy_from_slice(&(-1i64).to_be_bytes()),
                            Bytes::new(),
                        ]);
                        let _ = router.send(end).await;
                    }
                }
            }
            socket.close().await;
            if let Some(router) = replay_socket {
                router.close().await;
            }
        });
        Ok(KvPublisher {
            batches,
            endpoint: bound,
            replay_endpoint: replay_bound,
            drop_next,
            sequence,
            task,
        })
    }

    /// Publishes one batch (nothing for no events).
    pub fn publish(&self, events: Vec<Event>) {
        if !events.is_empty() {
            let _ = self.batches.send(events);
        }
    }

    /// The next `n` batches are numbered and never sent.
    pub fn drop_batches(&self, n: u64) {
        self.drop_next.store(n, Ordering::Relaxed);
    }

    /// Stops publishing and closes the socket (its port is free after).
    pub async fn close(self) {
        drop(self.batches);
        let _ = self.task.await;
    }
}

fn seq_frame(seq: u64) -> Bytes {
    Bytes::copy_from_slice(&seq.to_be_bytes())
}

fn frames(parts: Vec<Bytes>) -> ZmqMessage {
    let mut parts = parts.into_iter();
    let mut message = ZmqMessage::from(parts.next().unwrap_or_default());
    for part in parts {
        message.push_back(part);
    }
    message
}

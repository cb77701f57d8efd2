//! The simulated engine's KV cache events, published as vLLM does
//! (`vllm/distributed/kv_events.py`'s `ZmqEventPublisher`): a ZMQ PUB
//! socket bound to the configured endpoint, each batch a three-frame
//! message (topic, sequence as 8 bytes big-endian from 0, the msgpack
//! batch of [`hearth_wire::kv_events::encode_batch`]), one batch per
//! admission or scheduler step that changed the cache. A new engine
//! starts its sequence at 0 again, as a restarted vLLM does.
//!
//! Faults for tests: [`KvPublisher::drop_batches`] numbers the next
//! batches but never sends them (a gap, as a subscriber too slow for the
//! publisher's high-water mark sees).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use hearth_wire::kv_events::{encode_batch, Batch, Event};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use zeromq::{Socket, SocketSend, ZmqMessage};

/// A running publisher: hand it each step's events.
#[derive(Debug)]
pub struct KvPublisher {
    batches: mpsc::UnboundedSender<Vec<Event>>,
    /// Where it is bound (a `tcp://ip:0` endpoint names its port here).
    pub endpoint: String,
    drop_next: Arc<AtomicU64>,
    /// Batches numbered so far.
    pub sequence: Arc<AtomicU64>,
    task: JoinHandle<()>,
}

impl KvPublisher {
    /// Binds `endpoint` (`tcp://ip:port`; port 0 for any) and starts
    /// publishing under `topic`.
    pub async fn start(endpoint: &str, topic: &str) -> anyhow::Result<KvPublisher> {
        let mut socket = zeromq::PubSocket::new();
        let bound = socket.bind(endpoint).await?.to_string();
        let (batches, mut rx) = mpsc::unbounded_channel::<Vec<Event>>();
        let drop_next = Arc::new(AtomicU64::new(0));
        let sequence = Arc::new(AtomicU64::new(0));
        let topic = Bytes::copy_from_slice(topic.as_bytes());
        let (dropping, numbered) = (Arc::clone(&drop_next), Arc::clone(&sequence));
        let task = tokio::spawn(async move {
            while let Some(events) = rx.recv().await {
                let seq = numbered.fetch_add(1, Ordering::Relaxed);
                let dropped = dropping
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
                    .is_ok();
                if dropped {
                    continue;
                }
                let ts = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(0.0, |d| d.as_secs_f64());
                let payload = encode_batch(&Batch {
                    ts,
                    events,
                    data_parallel_rank: Some(0),
                });
                let mut message = ZmqMessage::from(topic.clone());
                message.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
                message.push_back(Bytes::from(payload));
                if let Err(e) = socket.send(message).await {
                    tracing::warn!(error = %e, "KV event batch not published");
                }
            }
            socket.close().await;
        });
        Ok(KvPublisher {
            batches,
            endpoint: bound,
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

//! An engine's keep-alive at its worst: a TCP relay in front of an engine
//! that closes a connection, without passing the request on, when the
//! request arrives after the connection has been idle (no byte either way)
//! for the keep-alive. A real server (vLLM's and SGLang's uvicorn,
//! llama.cpp's server: 5 s) closes such a connection at that moment, and a
//! request sent on it in the same instant is lost with it; the relay makes
//! that instant every request that comes late.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

pub struct KeepAliveRelay {
    /// Where clients connect (loopback, an ephemeral port).
    pub addr: SocketAddr,
    counts: Arc<Counts>,
    task: JoinHandle<()>,
}

#[derive(Default)]
struct Counts {
    connections: AtomicU64,
    closed_on_arrival: AtomicU64,
}

impl KeepAliveRelay {
    /// Relays to `engine`, closing connections idle for `keep_alive` when
    /// the next request arrives on them.
    pub async fn start(engine: SocketAddr, keep_alive: Duration) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let counts = Arc::new(Counts::default());
        let c = counts.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                c.connections.fetch_add(1, Ordering::Relaxed);
                tokio::spawn(relay(client, engine, keep_alive, c.clone()));
            }
        });
        Ok(KeepAliveRelay { addr, counts, task })
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> u64 {
        self.counts.connections.load(Ordering::Relaxed)
    }

    /// Connections closed because a request arrived on them after the
    /// keep-alive: each is a request its client lost.
    pub fn closed_on_arrival(&self) -> u64 {
        self.counts.closed_on_arrival.load(Ordering::Relaxed)
    }
}

impl Drop for KeepAliveRelay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn relay(mut client: TcpStream, engine: SocketAddr, keep_alive: Duration, c: Arc<Counts>) {
    let Ok(mut upstream) = TcpStream::connect(engine).await else {
        return;
    };
    let mut last = Instant::now();
    let (mut from_client, mut from_engine) = ([0u8; 16384], [0u8; 16384]);
    loop {
        tokio::select! {
            n = client.read(&mut from_client) => match n {
                Ok(n) if n > 0 => {
                    if last.elapsed() >= keep_alive {
                        c.closed_on_arrival.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                    last = Instant::now();
                    if upstream.write_all(&from_client[..n]).await.is_err() {
                        return;
                    }
                }
                _ => return,
            },
            n = upstream.read(&mut from_engine) => match n {
                Ok(n) if n > 0 => {
                    last = Instant::now();
                    if client.write_all(&from_engine[..n]).await.is_err() {
                        return;
                    }
                }
                _ => return,
            },
        }
    }
}

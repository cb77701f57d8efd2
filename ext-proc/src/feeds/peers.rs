//! The peer bus: several sidecars of one fleet share what they learn over
//! NATS (core publish/subscribe, no persistence), so a conversation stays
//! warm whichever sidecar decides its next turn.
//!
//! The decision never waits for the bus: the router keeps what its
//! decisions and health evidence taught it ([`hearth_router::peers`]);
//! every `HEARTH_PEERS_FLUSH_MS` this task takes it
//! ([`Router::take_update`]) and publishes it, and applies what the peers
//! publish as it arrives. Subjects, for fleet `F`:
//!
//! - `hearth.F.updates`: every sidecar's updates (warmth, load, fencing),
//!   and a reconnecting sidecar's whole state;
//! - `hearth.F.hello`: a sidecar that starts, or whose bus came back, asks
//!   for the peers' state; each peer answers on the inbox the hello names,
//!   with its whole state in parts (`Snapshot`).
//!
//! Messages are [`hearth_wire::peer`] envelopes sealed with the fleet's
//! key and signed by their sender's own key ([`peer_guard`]): a message
//! whose MAC does not check (another key, none, changed bytes), whose
//! signature does not check or whose sender id is not its key's (a member
//! speaking as another), whose sequence does not grow or is far from this
//! sidecar's clock (a replay), that does not decode, names another fleet
//! or another replica list, or is too large is dropped and counted
//! (`hearth_peer_messages_dropped_total{reason}`), never applied; so are a
//! hello beyond the answer rate, a snapshot nobody asked for
//! ([`peer_guard::Snapshots`]), and warmth records beyond what all peers
//! may add a second ([`peer_guard::PEER_WARMTH_PER_SECOND`]; the update's
//! load and health figures still count). While the bus is down
//! the sidecar routes on its own state; `/state` shows
//! `peers.connected: false`, `/health` says `degraded`, and when the bus
//! returns the sidecar sends its whole state and asks for the peers'.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use async_nats::{Client, ConnectOptions, Event};
use bytes::Bytes;
use futures::StreamExt;
use hearth_router::Router;
use hearth_wire::peer::{self, Body, Envelope, PeerError, Update, MAX_MESSAGE_BYTES, SEAL_BYTES};
use tokio::sync::mpsc;

use super::peer_guard::{
    self, FleetKey, HelloLimit, Identity, Members, Replays, SeqClock, Snapshots, WarmthBudget,
};
use crate::config::{PeerKey, PeerSeed, Secret, Settings};
use crate::observe::metrics::PeerMetrics;

/// An idle sidecar still sends its load this often (peers forget a
/// sidecar's load after `hearth_router::PEER_SILENCE` without one).
const HEARTBEAT: Duration = Duration::from_secs(1);

/// Room left in a message for the envelope around an update.
const ENVELOPE_ROOM: usize = 512;

/// What the bus needs from the settings.
#[derive(Clone, Debug)]
pub struct PeerSettings {
    pub url: String,
    pub fleet: String,
    pub user: Option<(String, Secret)>,
    pub token: Option<Secret>,
    /// The fleet's key; None only on an open bus (`HEARTH_PEERS_INSECURE`).
    pub key: Option<PeerKey>,
    /// This sidecar's own key (`HEARTH_PEERS_IDENTITY_FILE`); None: a new
    /// one each start.
    pub identity: Option<PeerSeed>,
    /// The public keys allowed on the bus (`HEARTH_PEERS_MEMBERS_FILE`);
    /// None: any holder of the fleet's key.
    pub members: Option<Vec<[u8; 32]>>,
    /// CA certificates to trust besides the system's.
    pub ca_file: Option<PathBuf>,
    pub flush: Duration,
    pub sync: Duration,
}

impl PeerSettings {
    /// None without `HEARTH_PEERS_URL`; an error when the key file
    /// cannot be read (the settings' validation says so first).
    pub fn of(s: &Settings) -> Result<Option<PeerSettings>, String> {
        let Some(url) = s.peers_url.clone() else {
            return Ok(None);
        };
        Ok(Some(PeerSettings {
            url,
            fleet: s.fleet.clone(),
            user: s.peers_user.clone().zip(s.peers_password.clone()),
            token: s.peers_token.clone(),
            key: s.peers_key()?,
            identity: s.peers_identity()?,
            members: s.peers_members()?,
            ca_file: s.peers_ca_file.clone(),
            flush: Duration::from_millis(s.peers_flush_ms.max(1)),
            sync: crate::config::seconds(s.peers_sync_seconds),
        }))
    }

    fn updates(&self) -> String {
        format!("hearth.{}.updates", self.fleet)
    }

    fn hello(&self) -> String {
        format!("hearth.{}.hello", self.fleet)
    }
}

/// A connected bus, before it runs.
pub struct PeerBus {
    router: Arc<Router>,
    settings: PeerSettings,
    metrics: Arc<PeerMetrics>,
    client: Client,
    me: Identity,
    key: Option<FleetKey>,
    members: Option<Members>,
    seq: SeqClock,
    replays: Replays,
    hellos: HelloLimit,
    snapshots: Snapshots,
    warmth_budget: WarmthBudget,
    inbox: String,
    messages: futures::stream::BoxStream<'static, async_nats::Message>,
    events: mpsc::UnboundedReceiver<Event>,
    connected: bool,
    last_load: Vec<(u16, u32, u32)>,
    last_sent: Instant,
}

impl PeerBus {
    /// Starts the client (it keeps connecting in the background: a bus
    /// that is down at start is no error) and subscribes.
    pub async fn connect(
        router: Arc<Router>,
        settings: PeerSettings,
        metrics: Arc<PeerMetrics>,
    ) -> anyhow::Result<PeerBus> {
        let (tx, events) = mpsc::unbounded_channel();
        let mut options = ConnectOptions::new()
            .name(format!("hearth-sidecar/{}", settings.fleet))
            .retry_on_initial_connect()
            .max_reconnects(None)
            .connection_timeout(Duration::from_secs(2))
            .reconnect_delay_callback(|attempts| {
                Duration::from_millis(100 * attempts.min(20) as u64)
            })
            .event_callback(move |event| {
                let tx = tx.clone();
                async move {
                    // The bus task is gone only when the sidecar stops.
                    let _ = tx.send(event);
                }
            });
        if let Some((user, password)) = &settings.user {
            options = options.user_and_password(user.clone(), password.expose().to_string());
        }
        if let Some(token) = &settings.token {
            options = options.token(token.expose().to_string());
        }
        if settings.url.contains("tls://") {
            options = options.require_tls(true);
        }
        if let Some(ca) = &settings.ca_file {
            options = options.add_root_certificates(ca.clone());
        }
        if settings.key.is_none() {
            tracing::warn!(
                fleet = %settings.fleet,
                "peer bus open (HEARTH_PEERS_INSECURE, no HEARTH_PEERS_KEY_FILE): \
                 messages are neither signed nor checked"
            );
        }
        let servers: Vec<async_nats::ServerAddr> = settings
            .url
            .split(',')
            .map(|u| u.trim().parse())
            .collect::<Result<_, _>>()
            .context("HEARTH_PEERS_URL")?;
        let client = options
            .connect(servers)
            .await
            .context("starting the NATS client")?;
        let inbox = client.new_inbox();
        let subject = format!("hearth.{}.*", settings.fleet);
        let updates = client.subscribe(subject).await.context("subscribing")?;
        let answers = client
            .subscribe(inbox.clone())
            .await
            .context("subscribing")?;
        router.enable_peers();
        router.set_peer_bus(&settings.fleet, false);
        let key = settings.key.as_ref().map(FleetKey::new);
        let members = settings.members.as_deref().map(Members::new);
        let me = match &settings.identity {
            Some(seed) => Identity::of(seed, members.as_ref()).map_err(anyhow::Error::msg)?,
            None => Identity::generate(),
        };
        tracing::info!(
            public_key = %me.public_key_hex(),
            members = members.is_some(),
            "peer bus identity"
        );
        Ok(PeerBus {
            router,
            settings,
            metrics,
            client,
            me,
            key,
            members,
            seq: SeqClock::default(),
            replays: Replays::default(),
            hellos: HelloLimit::default(),
            snapshots: Snapshots::default(),
            warmth_budget: WarmthBudget::default(),
            inbox,
            messages: futures::stream::select(updates, answers).boxed(),
            events,
            connected: false,
            last_load: Vec::new(),
            last_sent: Instant::now(),
        })
    }

    /// Waits, at most the sync time, for a peer's whole state (none
    /// answers when this is the first sidecar). True when one came.
    pub async fn sync(&mut self) -> bool {
        let deadline = tokio::time::Instant::now() + self.settings.sync;
        loop {
            tokio::select! {
                _ = tokio::time::sleep_until(deadline) => return false,
                event = self.events.recv() => match event {
                    Some(event) => self.on_event(event).await,
                    None => return false,
                },
                message = self.messages.next() => match message {
                    Some(m) => {
                        if self.on_message(m.subject.as_str(), &m.payload).await {
                            return true;
                        }
                    }
                    None => return false,
                },
            }
        }
    }

    /// Runs until the sidecar stops.
    pub async fn run(mut self) {
        let mut tick = tokio::time::interval(self.settings.flush);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => self.flush().await,
                event = self.events.recv() => match event {
                    Some(event) => self.on_event(event).await,
                    None => return,
                },
                message = self.messages.next() => match message {
                    Some(m) => { self.on_message(m.subject.as_str(), &m.payload).await; }
                    None => return,
                },
            }
        }
    }

    async fn on_event(&mut self, event: Event) {
        match event {
            Event::Connected => {
                let was = self.connected;
                self.connected = true;
                self.router.set_peer_bus(&self.settings.fleet, true);
                self.metrics.set_connected(true);
                tracing::info!(fleet = %self.settings.fleet, "peer bus connected");
                // First connection, or back after an outage: say what this
                // sidecar knows, and ask for what the others know.
                if was {
                    return;
                }
                self.metrics.resync();
                // The hello first: a peer takes a whole state on the
                // fleet's subject only from a sidecar whose hello it
                // answered.
                let hello = Body::Hello {
                    reply: self.inbox.clone(),
                };
                self.snapshots.asked(Instant::now());
                self.publish(&self.settings.hello(), hello).await;
                let whole = self.router.state_update();
                self.publish_update(&self.settings.updates(), whole, true)
                    .await;
            }
            Event::Disconnected | Event::Closed => {
                if self.connected {
                    tracing::warn!(fleet = %self.settings.fleet, "peer bus lost: routing on this sidecar's own state");
                }
                self.connected = false;
                self.router.set_peer_bus(&self.settings.fleet, false);
                self.metrics.set_connected(false);
            }
            other => tracing::debug!(event = %other, "peer bus event"),
        }
    }

    /// Sends what was learned since the last flush (while connected; the
    /// state is sent whole when the bus returns, so nothing is queued for
    /// a bus that is down).
    async fn flush(&mut self) {
        self.router.expire_peers();
        self.metrics
            .set_live(self.router.peers_snapshot().map_or(0, |p| p.live as i64));
        let update = self.router.take_update();
        if !self.connected {
            return;
        }
        let load: Vec<(u16, u32, u32)> = update
            .load
            .iter()
            .map(|l| (l.replica, l.in_flight, l.load.to_bits()))
            .collect();
        let changed =
            !update.warmth.is_empty() || !update.health.is_empty() || load != self.last_load;
        if !changed && self.last_sent.elapsed() < HEARTBEAT {
            return;
        }
        self.last_load = load;
        self.last_sent = Instant::now();
        self.publish_update(&self.settings.updates(), update, false)
            .await;
    }

    /// Publishes an update in as many messages as its size needs:
    /// `whole`, as snapshot parts.
    async fn publish_update(&mut self, subject: &str, update: Update, whole: bool) {
        let limit = self.max_payload().saturating_sub(ENVELOPE_ROOM);
        let parts = update.split(limit);
        let n = parts.len() as u32;
        for (i, part) in parts.into_iter().enumerate() {
            let body = if whole {
                Body::Snapshot {
                    part: i as u32,
                    parts: n,
                    update: part,
                }
            } else {
                Body::Update(part)
            };
            self.publish(subject, body).await;
        }
    }

    async fn publish(&mut self, subject: &str, body: Body) {
        let envelope = Envelope {
            fleet: self.settings.fleet.clone(),
            list: self.router.list_digest(),
            sender: self.me.sender(),
            seq: self.seq.next(unix_micros()),
            body,
        };
        let bytes = peer_guard::seal(
            self.key.as_ref(),
            &self.me,
            subject,
            peer::encode(&envelope),
        );
        match self
            .client
            .publish(subject.to_string(), Bytes::from(bytes))
            .await
        {
            Ok(()) => self.metrics.sent(),
            Err(e) => {
                self.metrics.dropped("send_failed");
                tracing::debug!(error = %e, "peer message not sent");
            }
        }
    }

    fn max_payload(&self) -> usize {
        let server = self.client.server_info().max_payload;
        if server == 0 {
            MAX_MESSAGE_BYTES
        } else {
            server.min(MAX_MESSAGE_BYTES)
        }
    }

    /// Applies one message from the bus, received on `subject`; true when
    /// it completed a peer's whole state. Nothing of it is read before its
    /// MAC and its signature check.
    async fn on_message(&mut self, subject: &str, payload: &[u8]) -> bool {
        if payload.len() > MAX_MESSAGE_BYTES + SEAL_BYTES {
            self.metrics.dropped("oversized");
            return false;
        }
        let opened =
            match peer_guard::open(self.key.as_ref(), self.members.as_ref(), subject, payload) {
                Ok(m) => m,
                Err(e) => {
                    self.metrics.dropped(e.reason());
                    return false;
                }
            };
        let envelope = match peer::decode(opened.message) {
            Ok(e) => e,
            Err(e) => {
                self.metrics.dropped(match e {
                    PeerError::Oversized(_) => "oversized",
                    PeerError::Format(_) => "unknown_format",
                    PeerError::Truncated | PeerError::Malformed(_) => "malformed",
                });
                return false;
            }
        };
        if envelope.fleet != self.settings.fleet {
            self.metrics.dropped("foreign_fleet");
            return false;
        }
        if envelope.sender == self.me.sender() {
            return false;
        }
        // A member of the fleet speaks only as itself: the id it names is
        // its own key's.
        if envelope.sender != opened.sender {
            self.metrics.dropped("forged_sender");
            return false;
        }
        let direct = subject == self.inbox;
        let now = Instant::now();
        if matches!(envelope.body, Body::Snapshot { .. })
            && !self.snapshots.allow(envelope.sender, direct, now)
        {
            self.metrics.dropped("unasked_snapshot");
            return false;
        }
        if let Err(e) = self
            .replays
            .check(envelope.sender, direct, envelope.seq, unix_micros())
        {
            self.metrics.dropped(e.reason());
            return false;
        }
        self.metrics.received();
        let (update, whole, last) = match envelope.body {
            Body::Update(mut u) => {
                let hashes = u.warmth.iter().map(|w| w.hashes.len()).sum();
                if !self.warmth_budget.spend(hashes, now) {
                    // Beyond what all peers may add a second: the
                    // records go, the load and health figures count.
                    self.metrics.dropped("warmth_limited");
                    u.warmth.clear();
                }
                (u, false, false)
            }
            Body::Snapshot {
                part,
                parts,
                update,
            } => (update, true, part + 1 == parts),
            Body::Hello { reply } => {
                // Each answer is the whole state: a few per second at most.
                if self.hellos.allow(&reply, now) {
                    self.snapshots.answered(envelope.sender, now);
                    let whole = self.router.state_update();
                    self.publish_update(&reply, whole, true).await;
                } else {
                    self.metrics.dropped("hello_limited");
                }
                return false;
            }
        };
        match self
            .router
            .apply_update(envelope.sender, envelope.list, &update, whole)
        {
            Ok(_) => {
                self.metrics.applied();
                whole && last
            }
            Err(refusal) => {
                self.metrics.dropped(match refusal {
                    hearth_router::PeerRefusal::OtherList => "other_list",
                    hearth_router::PeerRefusal::UnknownReplica => "unknown_replica",
                });
                false
            }
        }
    }
}

/// Microseconds since the Unix epoch: the messages' sequence numbers (see
/// [`peer_guard::SeqClock`]).
fn unix_micros() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

//! The replica list: each engine as configured ([`UpstreamSpec`], the
//! `HEARTH_UPSTREAMS` syntax) and the routing targets it names
//! ([`Replica`]: one per data-parallel rank).

use std::collections::HashSet;
use std::net::SocketAddr;
use std::str::FromStr;

use hearth_wire::names::MAX_MODEL_BYTES;
use serde::{Deserialize, Serialize};

/// One replica as configured.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UpstreamSpec {
    pub addr: SocketAddr,
    pub id: Option<String>,
    pub models: Vec<String>,
    /// Tagged `long`: part of the long-prompt lane.
    pub long: bool,
    /// Data-parallel ranks behind this address (1 = none): each rank is its
    /// own routing target, chosen with the `x-data-parallel-rank` header.
    pub dp_ranks: u32,
    /// `profile=short-output`: preferred for short outputs on ties.
    pub short_output: bool,
    /// Written `https://ip:port`: the engine speaks TLS, and the sidecar's
    /// own requests to it (probes, metrics scrapes, with the engine key)
    /// use `https://`. Envoy's endpoint is `ip:port` either way.
    pub tls: bool,
    /// Where the engine publishes its KV cache events
    /// (`kv_events=tcp://ip:port` or `ipc:///path`), if it does.
    pub kv_events: Option<EventEndpoint>,
    /// Where it answers replay requests for missed batches
    /// (`kv_events_replay=`, vLLM's `replay_endpoint`), if it does.
    pub kv_events_replay: Option<EventEndpoint>,
}

/// A ZMQ endpoint an engine publishes its KV cache events on: an IP and
/// port, or a Unix socket path (vLLM binds only wildcard and `ipc://`
/// endpoints itself), or `auto`: the one the engine states (vLLM's
/// `GET /kv_event_sources`), taken only where it is the engine's own.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum EventEndpoint {
    Tcp(SocketAddr),
    Ipc(String),
    FromEngine,
}

/// One engine's event feed, as the sidecar follows it: a replica's, or a
/// data-parallel rank's (each rank has its own cache and publisher).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventSource {
    /// The replica it speaks for: the engine's address, and the rank.
    pub key: ReplicaKey,
    pub endpoint: EventEndpoint,
    pub replay: Option<EventEndpoint>,
    /// `http(s)://addr`, where `auto` asks for the endpoint.
    pub engine_url: String,
}

impl EventSource {
    /// The engine's address.
    pub fn addr(&self) -> SocketAddr {
        self.key.0
    }
}

impl EventEndpoint {
    /// Where data-parallel rank `rank` of an engine listed with this
    /// endpoint publishes: as vLLM places it, the TCP port plus the rank
    /// (`auto` asks the engine for the rank's own). `None` where no rank
    /// but 0 can publish (vLLM refuses `ipc://` past rank 0) or the port
    /// would pass 65535.
    pub fn for_rank(&self, rank: u32) -> Option<EventEndpoint> {
        match self {
            _ if rank == 0 => Some(self.clone()),
            EventEndpoint::Tcp(addr) => {
                let port = u16::try_from(u32::from(addr.port()) + rank).ok()?;
                Some(EventEndpoint::Tcp(SocketAddr::new(addr.ip(), port)))
            }
            EventEndpoint::FromEngine => Some(EventEndpoint::FromEngine),
            EventEndpoint::Ipc(_) => None,
        }
    }
}

impl FromStr for EventEndpoint {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "auto" {
            return Ok(EventEndpoint::FromEngine);
        }
        if let Some(addr) = s.strip_prefix("tcp://") {
            return addr.parse().map(EventEndpoint::Tcp).map_err(|_| {
                format!("kv_events={s:?}: tcp:// takes ip:port (the engine's own address)")
            });
        }
        match s.strip_prefix("ipc://") {
            Some(path) if path.starts_with('/') && path.len() <= 107 => {
                Ok(EventEndpoint::Ipc(path.to_owned()))
            }
            _ => Err(format!(
                "kv_events={s:?} is not tcp://ip:port, ipc:///absolute/path (at most 107 bytes) \
                 or auto"
            )),
        }
    }
}

impl std::fmt::Display for EventEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EventEndpoint::Tcp(addr) => write!(f, "tcp://{addr}"),
            EventEndpoint::Ipc(path) => write!(f, "ipc://{path}"),
            EventEndpoint::FromEngine => f.write_str("auto"),
        }
    }
}

impl FromStr for UpstreamSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut parts = s.trim().split(';');
        let written = parts.next().unwrap_or_default().trim();
        let (addr_text, tls) = match written.strip_prefix("https://") {
            Some(rest) => (rest, true),
            None => (written.strip_prefix("http://").unwrap_or(written), false),
        };
        let addr: SocketAddr = addr_text.parse().map_err(|_| {
            format!(
                "upstream {written:?} is not [https://]ip:port (Envoy's override_host needs an IP address)"
            )
        })?;
        let mut spec = UpstreamSpec {
            addr,
            id: None,
            models: Vec::new(),
            long: false,
            dp_ranks: 1,
            short_output: false,
            tls,
            kv_events: None,
            kv_events_replay: None,
        };
        for part in parts {
            let (key, value) = part
                .split_once('=')
                .ok_or_else(|| format!("upstream option {part:?} is not key=value"))?;
            let value = value.trim();
            if value.is_empty() {
                return Err(format!("upstream option {key:?} has an empty value"));
            }
            match key.trim() {
                "id" => spec.id = Some(value.to_string()),
                // Longer names are cut where requests enter, so they
                // could never match.
                "model" if value.len() > MAX_MODEL_BYTES => {
                    return Err(format!(
                        "a model= name of {} bytes is longer than the {MAX_MODEL_BYTES} a \
                         request's model may have",
                        value.len()
                    ))
                }
                "model" => spec.models.push(value.to_string()),
                "tag" => match value {
                    "long" => spec.long = true,
                    other => return Err(format!("unknown upstream tag {other:?} (known: long)")),
                },
                "profile" => match value {
                    "short-output" => spec.short_output = true,
                    other => {
                        return Err(format!(
                            "unknown upstream profile {other:?} (known: short-output)"
                        ))
                    }
                },
                "dp" => {
                    spec.dp_ranks = value
                        .parse()
                        .ok()
                        .filter(|n| (1..=256).contains(n))
                        .ok_or_else(|| format!("dp={value:?} is not a rank count in 1..=256"))?
                }
                "kv_events" => spec.kv_events = Some(value.parse()?),
                "kv_events_replay" => spec.kv_events_replay = Some(value.parse()?),
                other => {
                    return Err(format!(
                        "unknown upstream option {other:?} (known: id, model, tag, profile, dp, \
                         kv_events, kv_events_replay)"
                    ))
                }
            }
        }
        if spec.kv_events_replay.is_some() && spec.kv_events.is_none() {
            return Err("kv_events_replay= needs kv_events=".to_owned());
        }
        if spec.kv_events_replay.is_some() && spec.kv_events == Some(EventEndpoint::FromEngine) {
            return Err(
                "kv_events=auto takes the replay endpoint from the engine too: \
                 drop kv_events_replay="
                    .to_owned(),
            );
        }
        if spec.kv_events_replay == Some(EventEndpoint::FromEngine) {
            return Err("kv_events_replay=auto: write kv_events=auto alone".to_owned());
        }
        // Each rank publishes on its own endpoint: the port plus the rank.
        let last = spec.dp_ranks - 1;
        for (name, endpoint) in [
            ("kv_events", &spec.kv_events),
            ("kv_events_replay", &spec.kv_events_replay),
        ] {
            if let Some(e) = endpoint.as_ref().filter(|e| e.for_rank(last).is_none()) {
                return Err(match e {
                    EventEndpoint::Ipc(_) => format!(
                        "{name}={e} with dp={}: an engine publishes ranks past 0 only over \
                         tcp:// (each on the port plus its rank)",
                        spec.dp_ranks
                    ),
                    _ => format!(
                        "{name}={e} with dp={}: rank {last}'s port (the port plus the rank) \
                         passes 65535",
                        spec.dp_ranks
                    ),
                });
            }
        }
        Ok(spec)
    }
}

/// Problems with a replica list (named `source` in the messages): it must
/// name at least one replica, each address and id once.
pub fn check_upstreams(upstreams: &[UpstreamSpec], source: &str) -> Vec<String> {
    let mut problems = Vec::new();
    if upstreams.is_empty() {
        problems.push(format!("{source} names no replica"));
    }
    let mut addrs = HashSet::new();
    let mut ids = HashSet::new();
    for (i, u) in upstreams.iter().enumerate() {
        if !addrs.insert(u.addr) {
            problems.push(format!("{source} lists {} twice", u.addr));
        }
        let id = u.id.clone().unwrap_or_else(|| default_replica_id(i));
        if !ids.insert(id.clone()) {
            problems.push(format!("{source} uses the id {id:?} twice"));
        }
    }
    problems
}

pub fn default_replica_id(index: usize) -> String {
    format!("replica-{index}")
}

/// A configured engine replica: one routing target.
#[derive(Clone, Debug, PartialEq)]
pub struct Replica {
    /// Opaque name shown to clients in `x-hearth-upstream`.
    pub id: String,
    pub addr: SocketAddr,
    /// Models it serves; empty means any.
    pub models: Vec<String>,
    /// In the long-prompt lane.
    pub long: bool,
    /// The data-parallel rank this target is, behind a shared address.
    pub dp_rank: Option<u32>,
    /// Suited to short outputs (e.g. speculative decoding): preferred for
    /// them when cache and load tie.
    pub short_output: bool,
    /// The engine speaks TLS (see [`UpstreamSpec::tls`]).
    pub tls: bool,
    /// Where its engine publishes KV cache events (see
    /// [`UpstreamSpec::kv_events`]).
    pub kv_events: Option<EventEndpoint>,
    /// Where it answers replay requests (see
    /// [`UpstreamSpec::kv_events_replay`]).
    pub kv_events_replay: Option<EventEndpoint>,
    /// Removed from the replica list by a reload: never a candidate again;
    /// its slot is reused once the requests it still runs have ended.
    pub retired: bool,
}

/// The routing targets an upstream list names, in order: a data-parallel
/// endpoint becomes one target per rank.
pub fn targets(upstreams: &[UpstreamSpec]) -> Vec<Replica> {
    upstreams
        .iter()
        .enumerate()
        .flat_map(|(i, u)| {
            let id = u.id.clone().unwrap_or_else(|| default_replica_id(i));
            (0..u.dp_ranks).map(move |rank| Replica {
                id: if u.dp_ranks > 1 {
                    format!("{id}/rank{rank}")
                } else {
                    id.clone()
                },
                addr: u.addr,
                models: u.models.clone(),
                long: u.long,
                dp_rank: (u.dp_ranks > 1).then_some(rank),
                short_output: u.short_output,
                tls: u.tls,
                kv_events: u.kv_events.as_ref().and_then(|e| e.for_rank(rank)),
                kv_events_replay: u.kv_events_replay.as_ref().and_then(|e| e.for_rank(rank)),
                retired: false,
            })
        })
        .collect()
}

/// What a reload of the replica list changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReloadSummary {
    /// New targets (fresh warmth and load).
    pub added: usize,
    /// Targets no longer listed (retired; their running requests finish).
    pub removed: usize,
    /// Targets at the same address and rank whose id, models or tags
    /// changed: they keep their warmth, load and health.
    pub updated: usize,
    /// Targets listed exactly as before.
    pub unchanged: usize,
}

impl ReloadSummary {
    pub fn changed(&self) -> bool {
        self.added + self.removed + self.updated > 0
    }
}

impl std::fmt::Display for ReloadSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} added, {} removed, {} updated, {} unchanged",
            self.added, self.removed, self.updated, self.unchanged
        )
    }
}

/// What names the engine behind a routing target across reloads: its
/// address and data-parallel rank.
pub type ReplicaKey = (SocketAddr, Option<u32>);

impl Replica {
    pub fn key(&self) -> ReplicaKey {
        (self.addr, self.dp_rank)
    }

    /// Where the sidecar itself reaches the engine: `http://ip:port`, or
    /// `https://ip:port` for an engine written with `https://`.
    pub fn engine_url(&self) -> String {
        engine_url(self.addr, self.tls)
    }

    pub(crate) fn serves(&self, model: Option<&str>) -> bool {
        match model {
            Some(m) if !self.models.is_empty() => self.models.iter().any(|x| x == m),
            _ => true,
        }
    }
}

/// `http://addr`, or `https://addr` when `tls`.
pub fn engine_url(addr: SocketAddr, tls: bool) -> String {
    let scheme = if tls { "https" } else { "http" };
    format!("{scheme}://{addr}")
}

/// A routing target to probe: its engine address and rank, its id (for
/// logs), the model to ask for, and the engine's base URL.
#[derive(Clone, Debug, PartialEq)]
pub struct ProbeTarget {
    pub key: ReplicaKey,
    pub id: String,
    pub model: Option<String>,
    pub url: String,
    /// Why it is due.
    pub reason: crate::health::ProbeReason,
}

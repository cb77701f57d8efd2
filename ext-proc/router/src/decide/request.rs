//! What a decision is asked for, and why it can be refused.

use std::fmt;

use hearth_wire::CacheUse;

/// What the sidecar knows about one request before it is routed.
#[derive(Clone, Debug, Default)]
pub struct RequestInfo {
    /// Chained block hashes from the filter, if the request was hashed.
    pub hashes: Vec<u64>,
    /// Canonical prompt length in bytes (0 when unknown).
    pub prompt_bytes: u64,
    pub model: Option<String>,
    /// The request's output cap, when the client set one.
    pub max_output_tokens: Option<u64>,
    /// How the request asks the engine to use its prompt cache: answers to
    /// requests that partition or bypass it are never compared with the
    /// prediction (what they were served says nothing of the shared cache).
    pub cache: CacheUse,
    /// The request's priority band (its objective's; 0 when it names
    /// none): a replica keeps the slots higher bands used lately free of
    /// lower ones (flow control's headroom).
    pub priority: i32,
    /// A digest of the request's fairness id (0 when it names none and
    /// no default applies): with its band, its flow. A replica keeps
    /// slots for flows of its band under their fair share of the fleet
    /// from flows over it (`HEARTH_FLOW_FAIR_SLOTS_SECONDS`).
    pub flow: u64,
}

/// Why a request could not be routed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RouteError {
    NoReplicaForModel(String),
    NoHealthyReplica(String),
    Saturated,
}

impl fmt::Display for RouteError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RouteError::NoReplicaForModel(m) => write!(f, "no replica serves model {m:?}"),
            RouteError::NoHealthyReplica(m) => write!(f, "no healthy replica serves model {m:?}"),
            RouteError::Saturated => {
                f.write_str("every eligible replica is at its in-flight or queue limit")
            }
        }
    }
}

impl std::error::Error for RouteError {}

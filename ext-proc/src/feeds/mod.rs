//! What flows into the fleet state besides decisions: the replica list
//! and its reloads ([`upstreams`]), active probes ([`probe`]), and the
//! engines' own metrics ([`signals`]), the last two over one HTTP client
//! ([`engines`]); the engines' KV cache events ([`kv_events`]); the peer
//! bus ([`peers`]) and what it checks ([`peer_guard`]).

pub mod engines;
pub mod kube;
pub mod kv_events;
pub mod peer_guard;
pub mod peers;
pub mod probe;
pub mod signals;
pub mod upstreams;

//! What flows into the fleet state besides decisions: the replica list
//! and its reloads ([`upstreams`]), active probes ([`probe`]), and the
//! engines' own metrics ([`signals`]), the last two over one HTTP client
//! ([`engines`]).

pub mod engines;
pub mod peers;
pub mod probe;
pub mod signals;
pub mod upstreams;

//! Flow control's pure half: when a replica is saturated (its engine's
//! figures, or the uncached prompt Hearth has in flight on it), whether a
//! request may go now or must wait ([`Router::room_at`]), and the queue
//! that orders the waiting ones ([`queue::FlowQueue`]: strict priority
//! between bands, deficit round robin on prompt bytes between fairness ids
//! inside a band, first come first served inside a flow).
//!
//! The sidecar holds the queue beside the decision, not in it: a request
//! waits there while every replica it may use is saturated, and leaves it
//! through the ordinary decision, restricted to the replicas that have
//! room. Every entry point takes `now`.

pub mod queue;
pub mod saturation;

pub use crate::params::FlowParams;
pub use queue::{
    BandLoad, DropReason, Dropped, Entry, FlowLoad, FlowQueue, QueueParams, QueueView, LOOK_DEPTH,
};
pub use saturation::{Kept, Look, Room, Saturated, AFFINITY_UNITS_MAX};

#[cfg(doc)]
use crate::router::Router;

//! Hearth's Envoy filter (proxy-wasm, built for `wasm32-wasip1`).
//!
//! For `POST`s to the configured OpenAI paths it buffers the request body
//! (bounded), fingerprints the prompt with [`hearth_wire`] and sets
//! `x-hearth-fp`, `x-hearth-prompt-bytes` and `x-hearth-model` for the
//! ext-proc sidecar. On every request it first removes client-supplied
//! `x-hearth-*` and `x-gateway-destination-endpoint*` headers, so a client
//! can never steer routing. It never modifies a body and never fails a
//! request: anything it cannot fingerprint passes on unhashed, counted.
//!
//! A second instance, configured with `"role": "outcome"` and placed after
//! the ext_proc filter, reports whether each generation's answer carried
//! text ([`outcome`]), so the sidecar can fence a replica that answers 200
//! with nothing in it.
//!
//! The logic lives in plain modules tested natively ([`config`], [`policy`],
//! [`metrics`]); the host glue is compiled only for `wasm32`.

pub mod config;
pub mod metrics;
pub mod policy;
/// The outcome scan, shared with the sidecar (which runs it on response
/// bodies in the shapes that have no wasm filter).
pub use hearth_wire::outcome;

#[cfg(target_arch = "wasm32")]
mod glue;

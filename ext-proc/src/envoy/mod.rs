//! Envoy's protocols, and nothing else: the ext_proc service
//! ([`service`]: header mode, plus the body-over-gRPC mode in [`body`] and
//! the endpoint-picker shape in [`picker`]), the outcome filter's reports
//! ([`report`]), Envoy's words for how a request ended ([`ending`]),
//! endpoint discovery for the engines' cluster ([`eds`]), and the Envoy
//! configurations Hearth ships ([`render`]).

pub mod body;
pub mod eds;
pub mod ending;
pub mod headers;
pub mod picker;
pub mod render;
pub mod report;
pub mod service;

/// gRPC health service names of the endpoint-picker protocol
/// (Gateway API Inference Extension, "Endpoint Picker Protocol", Health
/// Checking): the process answers; it is ready to pick; and the ext_proc
/// service itself.
pub const HEALTH_LIVENESS: &str = "liveness";
pub const HEALTH_READINESS: &str = "readiness";
pub const HEALTH_EXT_PROC: &str = "envoy.service.ext_proc.v3.ExternalProcessor";

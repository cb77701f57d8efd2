//! Envoy's protocols, and nothing else: the ext_proc service
//! ([`service`]: header mode, plus the body-over-gRPC mode in [`body`] and
//! the endpoint-picker shape in [`picker`]), endpoint discovery for the
//! engines' cluster ([`eds`]), and the Envoy configurations Hearth ships
//! ([`render`]).

pub mod body;
pub mod eds;
pub mod headers;
pub mod picker;
pub mod render;
pub mod service;

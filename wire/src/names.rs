//! Names Hearth's parts agree on outside the fingerprint: headers and
//! metadata between the sidecar and Envoy, headers to the engines and the
//! client, and the outcome report's path. One definition each; the
//! filter, the sidecar, the Envoy configurations' generator and the tests
//! read them from here.

/// Request header with the chosen engine and its fallbacks
/// (`ip:port,ip:port,...`), honoured by Envoy's `override_host` policy
/// (and the Gateway API Inference Extension's destination key).
pub const DESTINATION: &str = "x-gateway-destination-endpoint";

/// Dynamic metadata namespace where the endpoint-picker shape puts
/// [`DESTINATION`].
pub const LB_NAMESPACE: &str = "envoy.lb";

/// Dynamic metadata namespace of the Inference Extension's subset hint.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";

/// Key of the subset hint (the endpoints a request may go to).
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";

/// Response metadata key naming the endpoint that served (Inference
/// Extension).
pub const SERVED_KEY: &str = "x-gateway-destination-endpoint-served";

/// Request header choosing a data-parallel rank behind one address
/// (vLLM's and SGLang's data-parallel serving).
pub const DP_RANK: &str = "x-data-parallel-rank";

/// Response header naming the replica that served, by its opaque id.
pub const UPSTREAM: &str = "x-hearth-upstream";

/// Envoy's request id header.
pub const REQUEST_ID: &str = "x-request-id";

pub use crate::outcome::REPORT_PATH;

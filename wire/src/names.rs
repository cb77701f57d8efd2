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

/// Request header naming the request's tenant for flow control's fairness
/// (Inference Extension).
pub const FAIRNESS_ID: &str = "x-gateway-inference-fairness-id";

/// Request header naming the request's objective, whose priority is its
/// flow-control band (Inference Extension).
pub const OBJECTIVE: &str = "x-gateway-inference-objective";

/// Response header of a 429 from flow control: why the request was not
/// dispatched (`sheddable`, `queue_full`, `queue_bytes`, `evicted`,
/// `ttl`).
pub const DROP_REASON: &str = "x-hearth-drop-reason";

pub use crate::outcome::{FIRST_TOKEN_PATH, REPORT_PATH};

/// The longest model name the sidecar keeps, in bytes. A request's model
/// comes from the client (the body's `model`, or the filter's
/// `x-hearth-model` header) and is stored in the decision journal and
/// quoted in refusals, so it is capped where it enters. Configured models
/// (`;model=`) may not be longer, so a name past the cap matches no
/// configured model.
pub const MAX_MODEL_BYTES: usize = 256;

/// What replaces the end of a model name past [`MAX_MODEL_BYTES`].
pub const CUT_MARK: &str = "...(cut)";

/// A client's model name, fit to keep: itself when it is at most
/// [`MAX_MODEL_BYTES`]; else its first bytes (at a character boundary)
/// followed by [`CUT_MARK`]. The result of a cut is always longer than
/// [`MAX_MODEL_BYTES`], so it never equals a configured model: the request
/// is routed as for any model no replica lists (a 404 when every replica
/// lists its models; else a replica that serves any model, whose engine
/// reads the full name from the untouched body and answers for it).
pub fn capped_model(model: &str) -> String {
    capped(model, MAX_MODEL_BYTES, CUT_MARK)
}

/// A client's request id (`x-request-id`), fit to keep: at most
/// [`crate::outcome::MAX_REQUEST_ID`] bytes, cut at a character boundary.
pub fn capped_request_id(id: &str) -> String {
    capped(id, crate::outcome::MAX_REQUEST_ID, "")
}

fn capped(s: &str, max: usize, mark: &str) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    let mut out = String::with_capacity(end + mark.len());
    out.push_str(&s[..end]);
    out.push_str(mark);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn models_past_the_cap_are_cut_and_match_no_configured_model() {
        assert_eq!(capped_model("m"), "m");
        let exact = "x".repeat(MAX_MODEL_BYTES);
        assert_eq!(capped_model(&exact), exact);
        let long = "x".repeat(10 * MAX_MODEL_BYTES);
        let cut = capped_model(&long);
        assert_eq!(cut.len(), MAX_MODEL_BYTES + CUT_MARK.len());
        assert!(cut.ends_with(CUT_MARK));
        // Cut at a character boundary, and still longer than any
        // configured model may be.
        let wide = "é".repeat(MAX_MODEL_BYTES);
        let cut = capped_model(&wide);
        assert!(cut.len() > MAX_MODEL_BYTES && cut.len() <= MAX_MODEL_BYTES + CUT_MARK.len());
        assert!(cut.starts_with("éé"));
    }

    #[test]
    fn request_ids_are_cut_to_what_a_report_carries() {
        assert_eq!(capped_request_id("abc"), "abc");
        let long = "r".repeat(1000);
        assert_eq!(
            capped_request_id(&long).len(),
            crate::outcome::MAX_REQUEST_ID
        );
        let wide = "ü".repeat(100);
        let cut = capped_request_id(&wide);
        assert!(cut.len() <= crate::outcome::MAX_REQUEST_ID && cut.chars().all(|c| c == 'ü'));
    }
}

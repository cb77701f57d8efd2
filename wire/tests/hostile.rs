//! Regression inputs: every literal body of the hostile request corpus
//! (`tests/hostile/corpus.json`, also sent through the real Envoy by the
//! end-to-end tests) goes through the canonicaliser for every API, and
//! every header value in it through the header decoder, natively. Nothing
//! may panic; the well-formed ones must still fingerprint.

use base64::Engine as _;
use hearth_wire::{fingerprint, header, Endpoint, Params};

fn corpus() -> Vec<serde_json::Value> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/hostile/corpus.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn the_hostile_corpus_never_panics_the_canonicaliser_or_the_decoder() {
    let params = Params::default();
    let mut bodies = 0;
    let mut hashed = 0;
    for case in corpus() {
        let body = match (case["body"].as_str(), case["body_b64"].as_str()) {
            (Some(t), _) => t.as_bytes().to_vec(),
            (None, Some(b)) => base64::engine::general_purpose::STANDARD.decode(b).unwrap(),
            // Generated bodies are exercised by the end-to-end test.
            _ => continue,
        };
        bodies += 1;
        for e in Endpoint::ALL {
            if fingerprint(e, &body, &params).is_ok() {
                hashed += 1;
            }
        }
        for pair in case["headers"].as_array().into_iter().flatten() {
            let _ = header::decode(pair[1].as_str().unwrap());
        }
    }
    assert!(bodies >= 25, "{bodies}");
    // The corpus also holds valid requests with hostile headers.
    assert!(hashed >= 5, "{hashed}");
}

#[test]
fn deep_nesting_and_huge_inputs_are_refused_not_crashed() {
    let params = Params::default();
    let deep = format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":{}{}}}]}}"#,
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    assert!(fingerprint(Endpoint::ChatCompletions, deep.as_bytes(), &params).is_err());
    let deep_tools = format!(
        r#"{{"model":"m","tools":{}{},"messages":[{{"role":"user","content":"x"}}]}}"#,
        "{\"a\":".repeat(50_000),
        "}".repeat(50_000)
    );
    assert!(fingerprint(Endpoint::ChatCompletions, deep_tools.as_bytes(), &params).is_err());
}

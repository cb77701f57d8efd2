//! The sidecar reads the same golden vectors as the fingerprint crate and
//! the wasm filter: the header the filter sends decodes, on this side, to
//! exactly the hashes the vectors pin.

use envoy_types::pb::envoy::service::ext_proc::v3::HttpHeaders;
use hearth_ext_proc::envoy::headers;
use hearth_ext_proc::envoy::service::request_info;
use hearth_wire::header;

fn headers(pairs: &[(&str, String)]) -> HttpHeaders {
    let pairs: Vec<(&str, &str)> = pairs.iter().map(|(k, v)| (*k, v.as_str())).collect();
    headers::map(&pairs)
}

#[test]
fn filter_headers_from_the_golden_vectors_decode_to_their_hashes() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../wire/golden/vectors.json");
    let vectors: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut checked = 0;
    for v in vectors.iter().filter(|v| v.get("header").is_some()) {
        let name = v["name"].as_str().unwrap();
        let block_size = v["block_size"].as_u64().unwrap() as usize;
        let expected: Vec<u64> = v["hashes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| u64::from_str_radix(h.as_str().unwrap(), 16).unwrap())
            .collect();
        let h = headers(&[
            (header::FP, v["header"].as_str().unwrap().to_string()),
            (header::PROMPT_BYTES, v["prompt_bytes"].to_string()),
            (header::MODEL, v["model"].as_str().unwrap().to_string()),
        ]);
        let info = request_info(&h, block_size);
        assert_eq!(info.hashes, expected, "{name}");
        assert_eq!(
            info.prompt_bytes,
            v["prompt_bytes"].as_u64().unwrap(),
            "{name}"
        );
        assert_eq!(info.model.as_deref(), v["model"].as_str(), "{name}");
        checked += 1;
    }
    assert!(checked >= 10, "only {checked} hashed vectors");
}

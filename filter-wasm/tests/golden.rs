//! The headers the filter would set, checked against the shared golden
//! vectors in `wire/golden/vectors.json` (the same file the sidecar
//! tests read).

use hearth_filter::config::FilterConfig;
use hearth_filter::metrics::SkipCause;
use hearth_filter::policy::{on_request_body, on_request_headers, BodyOutcome, HeaderDecision};
use hearth_wire::{header, SkipReason};
use serde_json::Value;

#[test]
fn filter_headers_match_golden_vectors() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../wire/golden/vectors.json");
    let text = std::fs::read_to_string(path).expect("read golden vectors");
    let cases: Vec<Value> = serde_json::from_str(&text).expect("golden vectors are JSON");
    assert!(cases.len() >= 12);
    for case in &cases {
        let name = case["name"].as_str().expect("name");
        let config = format!(
            r#"{{"block_size":{},"max_prefix_bytes":{}}}"#,
            case["block_size"], case["max_prefix_bytes"]
        );
        let cfg = FilterConfig::parse(config.as_bytes()).expect("config");
        let path = case["path"].as_str().expect("path");
        let body = case["body"].as_str().expect("body").as_bytes();
        let length = body.len().to_string();
        let HeaderDecision::Buffer(endpoint) = on_request_headers(
            &cfg,
            Some(b"POST"),
            Some(path.as_bytes()),
            Some(length.as_bytes()),
            false,
        ) else {
            panic!("{name}: filter would not buffer {path}");
        };
        let outcome = on_request_body(&cfg, endpoint, body);
        if let Some(skip) = case.get("skip") {
            let reason = SkipReason::parse(skip.as_str().expect("skip")).expect("reason");
            assert_eq!(
                outcome,
                BodyOutcome::Skipped(SkipCause::Fingerprint(reason)),
                "{name}"
            );
            continue;
        }
        let BodyOutcome::Hashed { headers, .. } = outcome else {
            panic!("{name}: not hashed: {outcome:?}");
        };
        let get = |h: &str| {
            headers
                .iter()
                .find(|(n, _)| *n == h)
                .map(|(_, v)| v.as_str())
                .unwrap_or_else(|| panic!("{name}: no {h}"))
        };
        assert_eq!(
            get(header::FP),
            case["header"].as_str().expect("header"),
            "{name}"
        );
        assert_eq!(
            get(header::MODEL),
            case["model"].as_str().expect("model"),
            "{name}"
        );
        assert_eq!(
            get(header::PROMPT_BYTES),
            case["prompt_bytes"].to_string(),
            "{name}"
        );
    }
}

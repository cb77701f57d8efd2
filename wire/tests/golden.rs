//! Recomputes every case of `golden/vectors.json`; any difference is drift.

use hearth_wire::{fingerprint, header, Endpoint, Params, SkipReason};
use serde_json::Value;

fn cases() -> Vec<Value> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/golden/vectors.json");
    let text = std::fs::read_to_string(path).expect("read golden/vectors.json");
    serde_json::from_str(&text).expect("vectors.json is a JSON array")
}

fn hex_hashes(case: &Value) -> Vec<String> {
    case["hashes"]
        .as_array()
        .expect("hashes")
        .iter()
        .map(|h| h.as_str().expect("hex string").to_owned())
        .collect()
}

fn by_name<'a>(cases: &'a [Value], name: &str) -> &'a Value {
    cases
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("case {name} missing"))
}

#[test]
fn every_case_matches() {
    let cases = cases();
    assert!(cases.len() >= 12, "expected at least 12 cases");
    for case in &cases {
        let name = case["name"].as_str().expect("name");
        let endpoint = Endpoint::from_path(case["path"].as_str().expect("path")).expect("endpoint");
        let params = Params {
            block_size: case["block_size"].as_u64().expect("block_size") as usize,
            max_prefix_bytes: case["max_prefix_bytes"].as_u64().expect("max_prefix_bytes") as usize,
        };
        params.validate().expect("valid params");
        let body = case["body"].as_str().expect("body");
        let got = fingerprint(endpoint, body.as_bytes(), &params);
        if let Some(skip) = case.get("skip") {
            let want = SkipReason::parse(skip.as_str().expect("skip")).expect("known reason");
            assert_eq!(got, Err(want), "{name}");
            continue;
        }
        let fp = got.unwrap_or_else(|r| panic!("{name}: skipped with {r}"));
        assert_eq!(
            fp.model,
            case["model"].as_str().expect("model"),
            "{name}: model"
        );
        assert_eq!(
            Some(fp.prompt_bytes),
            case["prompt_bytes"].as_u64(),
            "{name}: prompt_bytes"
        );
        let got_hex: Vec<String> = fp.hashes.iter().map(|h| format!("{h:016x}")).collect();
        assert_eq!(got_hex, hex_hashes(case), "{name}: hashes");
        let want_header = case["header"].as_str().expect("header");
        assert_eq!(fp.header_value(), want_header, "{name}: header");
        assert_eq!(
            header::decode(want_header),
            Ok((fp.block_size, fp.hashes.clone())),
            "{name}: decode"
        );
    }
}

#[test]
fn related_cases_agree() {
    let cases = cases();
    let base = hex_hashes(by_name(&cases, "chat_simple"));
    assert_eq!(
        hex_hashes(by_name(&cases, "chat_key_order_whitespace")),
        base
    );
    assert_eq!(hex_hashes(by_name(&cases, "chat_per_turn_fields")), base);
    assert_ne!(hex_hashes(by_name(&cases, "chat_other_model"))[0], base[0]);

    let multi = by_name(&cases, "chat_multi_block");
    let cut = by_name(&cases, "chat_past_max_prefix");
    assert!(hex_hashes(multi).len() > 3);
    assert_eq!(multi["prompt_bytes"], cut["prompt_bytes"]);
    assert_eq!(hex_hashes(cut), hex_hashes(multi)[..4].to_vec());
}

#[test]
fn numbers_in_a_tool_are_hashed_in_their_short_scientific_form() {
    let cases = cases();
    let case = by_name(&cases, "chat_tool_numbers");
    let body = case["body"].as_str().expect("body");
    let (_, canonical) =
        hearth_wire::canonical_prompt(Endpoint::ChatCompletions, body.as_bytes()).unwrap();
    let text = String::from_utf8_lossy(&canonical);
    // Keys sorted; 0.0, 0.70 and 1e-3 as `{:e}` writes their f64s; the
    // integer 2 as given.
    assert!(
        text.contains(r#""default":7e-1,"maximum":2,"minimum":0e0,"multipleOf":1e-3"#),
        "{text}"
    );
    assert_eq!(Some(canonical.len() as u64), case["prompt_bytes"].as_u64());
}

#[test]
fn the_output_cap_is_read_but_never_hashed() {
    use hearth_wire::{fingerprint, Endpoint, Params};
    let p = Params::default();
    let with = br#"{"model":"m","max_tokens":64,"messages":[{"role":"user","content":"hi"}]}"#;
    let newer =
        br#"{"model":"m","max_completion_tokens":9,"messages":[{"role":"user","content":"hi"}]}"#;
    let without = br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
    let odd = br#"{"model":"m","max_tokens":"lots","messages":[{"role":"user","content":"hi"}]}"#;
    let a = fingerprint(Endpoint::ChatCompletions, with, &p).unwrap();
    let b = fingerprint(Endpoint::ChatCompletions, without, &p).unwrap();
    assert_eq!(a.max_output_tokens, Some(64));
    assert_eq!(b.max_output_tokens, None);
    assert_eq!(a.hashes, b.hashes);
    let c = fingerprint(Endpoint::ChatCompletions, newer, &p).unwrap();
    assert_eq!(c.max_output_tokens, Some(9));
    let d = fingerprint(Endpoint::ChatCompletions, odd, &p).unwrap();
    assert_eq!(d.max_output_tokens, None);
    let r = br#"{"model":"m","max_output_tokens":5,"input":"hi"}"#;
    assert_eq!(
        fingerprint(Endpoint::Responses, r, &p)
            .unwrap()
            .max_output_tokens,
        Some(5)
    );
}

fn reports() -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/golden/outcome-reports.json");
    let text = std::fs::read_to_string(path).expect("read golden/outcome-reports.json");
    serde_json::from_str(&text).expect("outcome-reports.json is JSON")
}

#[test]
fn every_outcome_report_case_matches() {
    use hearth_wire::outcome::{report_body, Answer, Report, Scanner, Usage};
    let golden = reports();
    let scans = golden["scans"].as_array().expect("scans");
    assert!(scans.len() >= 4);
    for case in scans {
        let name = case["name"].as_str().expect("name");
        let mut scanner = Scanner::default();
        for chunk in case["chunks"].as_array().expect("chunks") {
            scanner.feed(chunk.as_str().expect("chunk").as_bytes());
        }
        let upstream = case["upstream"].as_str().expect("upstream");
        let id = case["request_id"].as_str();
        let report = case["report"].as_str().expect("report");
        assert_eq!(report_body(upstream, id, &scanner), report, "{name}");
        // What the filter writes, the sidecar reads back.
        let read = Report::parse(report).unwrap_or_else(|| panic!("{name}: refused"));
        assert_eq!(read.upstream, upstream, "{name}");
        assert_eq!(read.answer, scanner.answer(), "{name}");
        assert_eq!(read.usage, scanner.usage(), "{name}");
    }
    assert!(scans
        .iter()
        .any(|c| c["report"].as_str().unwrap().contains(";cached=")));
    let parses = golden["parses"].as_array().expect("parses");
    assert!(parses.iter().any(|c| c["upstream"].is_null()));
    for case in parses {
        let body = case["body"].as_str().expect("body");
        let expected = case["upstream"].as_str().map(|u| Report {
            upstream: u.to_string(),
            answer: Answer {
                text: case["text"].as_bool().expect("text"),
                done: case["done"].as_bool().expect("done"),
            },
            usage: case["prompt_tokens"].as_u64().map(|p| Usage {
                prompt_tokens: p,
                cached_tokens: case["cached_tokens"].as_u64().expect("cached_tokens"),
            }),
            request_id: case["request_id"].as_str().map(str::to_string),
        });
        assert_eq!(Report::parse(body), expected, "{body:?}");
    }
}

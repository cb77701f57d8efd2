//! Regenerates `wire/golden/vectors.json`:
//! `cargo run -p hearth-wire --example golden`.
//!
//! The file is the contract between the filter and the sidecar; regenerate it
//! only for a deliberate format change (and bump `FORMAT_VERSION`).

use hearth_wire::{fingerprint, Params, DEFAULT_BLOCK_SIZE, DEFAULT_MAX_PREFIX_BYTES};
use serde_json::{json, Value};

const CHAT: &str = "/v1/chat/completions";

fn cases() -> Vec<(&'static str, &'static str, String, usize, usize)> {
    let d = (DEFAULT_BLOCK_SIZE, DEFAULT_MAX_PREFIX_BYTES);
    let long_history: Vec<Value> = (0..12)
        .map(|i| {
            json!({"role": if i % 2 == 0 { "user" } else { "assistant" },
                   "content": format!("turn {i}: please refactor module {i} of the parser and keep the tests green")})
        })
        .collect();
    let mut long_msgs = vec![json!({"role": "system", "content": "You are a coding agent."})];
    long_msgs.extend(long_history);
    let long_body = json!({"model": "qwen3-coder", "messages": long_msgs}).to_string();
    vec![
        ("chat_simple", CHAT,
         r#"{"model":"llama-3.1-8b","messages":[{"role":"system","content":"You are helpful."},{"role":"user","content":"Hello there"}]}"#.into(), d.0, d.1),
        ("chat_key_order_whitespace", CHAT,
         "{\n  \"messages\" : [ { \"content\" : \"You are helpful.\", \"role\" : \"system\" },\n    {\"content\":\"Hello there\",\"role\":\"user\"} ],\n  \"model\" : \"llama-3.1-8b\"\n}\n".into(), d.0, d.1),
        ("chat_per_turn_fields", CHAT,
         r#"{"model":"llama-3.1-8b","temperature":0.7,"max_tokens":512,"stream":true,"stream_options":{"include_usage":true},"user":"u-42","seed":7,"n":1,"top_p":0.9,"metadata":{"k":"v"},"messages":[{"role":"system","content":"You are helpful."},{"role":"user","content":"Hello there","reasoning_content":null}]}"#.into(), d.0, d.1),
        ("chat_other_model", CHAT,
         r#"{"model":"llama-3.1-70b","messages":[{"role":"system","content":"You are helpful."},{"role":"user","content":"Hello there"}]}"#.into(), d.0, d.1),
        ("chat_tools", CHAT,
         r#"{"model":"qwen3-coder","tools":[{"type":"function","function":{"name":"read_file","parameters":{"type":"object","properties":{"path":{"type":"string"}}}}}],"tool_choice":"auto","messages":[{"role":"system","content":"You are a coding agent."},{"role":"user","content":"Open main.rs"},{"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"read_file","arguments":"{\"path\":\"main.rs\"}"}}]},{"role":"tool","tool_call_id":"call_1","name":"read_file","content":"fn main() {}\n"}]}"#.into(), d.0, d.1),
        ("chat_tool_numbers", CHAT,
         r#"{"model":"qwen3-coder","tools":[{"type":"function","function":{"name":"sample","parameters":{"type":"object","properties":{"t":{"type":"number","minimum":0.0,"maximum":2,"default":0.70,"multipleOf":1e-3}}}}}],"messages":[{"role":"user","content":"Pick a temperature"}]}"#.into(), d.0, d.1),
        ("chat_developer_role", CHAT,
         r#"{"model":"gpt-oss-20b","response_format":{"type":"json_object"},"messages":[{"role":"developer","content":"Answer in JSON."},{"role":"user","content":"List three colours."}]}"#.into(), d.0, d.1),
        ("chat_content_parts_image", CHAT,
         r#"{"model":"qwen2.5-vl","messages":[{"role":"user","content":[{"type":"text","text":"What is in this image?"},{"type":"image_url","image_url":{"url":"data:image/png;base64,iVBORw0KGgo=","detail":"low"}}]}]}"#.into(), d.0, d.1),
        ("chat_multi_block", CHAT, long_body.clone(), 64, d.1),
        ("chat_past_max_prefix", CHAT, long_body, 64, 256),
        ("completions_string", "/v1/completions",
         r#"{"model":"llama-3.1-8b","prompt":"Once upon a time","max_tokens":16}"#.into(), d.0, d.1),
        ("completions_array", "/v1/completions?api-version=1",
         r#"{"model":"llama-3.1-8b","prompt":["Once upon a time","The end"]}"#.into(), d.0, d.1),
        ("completions_token_ids", "/v1/completions",
         r#"{"model":"llama-3.1-8b","prompt":[1, 15043, 3186]}"#.into(), d.0, d.1),
        ("responses_api", "/v1/responses",
         r#"{"model":"gpt-oss-120b","instructions":"Be terse.","tools":[{"type":"function","name":"ls","parameters":{}}],"input":[{"role":"user","content":[{"type":"input_text","text":"What files are here?"}]}],"store":false}"#.into(), d.0, d.1),
        ("responses_string_input", "/v1/responses",
         r#"{"model":"gpt-oss-120b","input":"Say hi"}"#.into(), d.0, d.1),
        ("skip_not_json", CHAT, "{\"model\": \"m\", \"messages\": [".into(), d.0, d.1),
        ("skip_not_object", CHAT, "[{\"model\":\"m\"}]".into(), d.0, d.1),
        ("skip_no_model", CHAT, r#"{"messages":[{"role":"user","content":"hi"}]}"#.into(), d.0, d.1),
        ("skip_no_prompt", CHAT, r#"{"model":"m","messages":[]}"#.into(), d.0, d.1),
        ("skip_bad_field", CHAT, r#"{"model":"m","messages":[{"role":"user","content":42}]}"#.into(), d.0, d.1),
    ]
}

fn main() {
    let mut out = Vec::new();
    for (name, path, body, block_size, max_prefix_bytes) in cases() {
        let endpoint = hearth_wire::Endpoint::from_path(path).expect("known path");
        let params = Params {
            block_size,
            max_prefix_bytes,
        };
        params.validate().expect("valid params");
        let case = match fingerprint(endpoint, body.as_bytes(), &params) {
            Ok(fp) => json!({
                "name": name, "path": path, "body": body,
                "block_size": block_size, "max_prefix_bytes": max_prefix_bytes,
                "model": fp.model, "prompt_bytes": fp.prompt_bytes,
                "hashes": fp.hashes.iter().map(|h| format!("{h:016x}")).collect::<Vec<_>>(),
                "header": fp.header_value(),
            }),
            Err(reason) => json!({
                "name": name, "path": path, "body": body,
                "block_size": block_size, "max_prefix_bytes": max_prefix_bytes,
                "skip": reason.as_str(),
            }),
        };
        out.push(case);
    }
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/golden/vectors.json");
    let text = serde_json::to_string_pretty(&out).expect("serialize") + "\n";
    std::fs::write(path, text).expect("write vectors.json");
    println!("wrote {} cases to {path}", out.len());
}

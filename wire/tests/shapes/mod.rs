//! Request bodies of about a given size, one per shape whose parse could
//! cost more than its bytes: many tiny items wherever the canonical form
//! reads them, deep nesting, huge numbers, long and many keys, and the
//! plain bodies (long strings) they are compared with. Shared by
//! `tests/shape_cost.rs` (memory) and `benches/fingerprint.rs` (time).
//! Deterministic.

#![allow(dead_code)]

use hearth_wire::Endpoint;
use std::fmt::Write as _;

/// One body: its name, the API it is sent to, the bytes.
pub struct Shape {
    pub name: &'static str,
    pub endpoint: Endpoint,
    pub body: Vec<u8>,
}

const CHAT: Endpoint = Endpoint::ChatCompletions;

/// `n` copies of `item`, comma-separated.
fn repeat(item: &str, n: usize) -> String {
    let mut s = String::with_capacity((item.len() + 1) * n);
    for i in 0..n {
        if i > 0 {
            s.push(',');
        }
        s.push_str(item);
    }
    s
}

/// How many `item`s (plus a comma each) fill `target` bytes.
fn count(item: &str, target: usize) -> usize {
    (target / (item.len() + 1)).max(1)
}

/// Agent-style text: words, newlines, quotes, backslashes and non-ASCII,
/// as a JSON string body (escaped, without the quotes).
fn text(seed: &mut u64, n: usize) -> String {
    let words = [
        "fn",
        "let",
        "match",
        "struct",
        "impl",
        "return",
        "the",
        "request",
        "body",
        "cache",
        "replica",
        "prefix",
        "\\\"quoted\\\"",
        "path/to/file.rs",
        "\\\\n",
        "é",
        "{",
        "}",
    ];
    let mut s = String::with_capacity(n + 16);
    while s.len() < n {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        s.push_str(words[(*seed % words.len() as u64) as usize]);
        s.push_str(if seed.is_multiple_of(11) { "\\n" } else { " " });
    }
    s
}

const TOOL: &str = r#"{"type":"function","function":{"name":"read_file","description":"Read a file","parameters":{"type":"object","properties":{"path":{"type":"string"}},"required":["path"]}}}"#;

/// An agent conversation: a system prompt, tools, then user / assistant
/// (with a tool call) / tool rounds of a few KB each, until `target`.
/// `parts`: user turns as text parts instead of strings.
pub fn agent_chat(target: usize, parts: bool) -> Vec<u8> {
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut b = String::with_capacity(target + 8192);
    let system = text(&mut seed, 4000.min(target / 2));
    write!(
        b,
        r#"{{"model":"hearth-sim","stream":true,"temperature":0.2,"tools":[{TOOL}],"messages":[{{"role":"system","content":"{system}"}}"#
    )
    .unwrap();
    let mut i = 0;
    while b.len() < target {
        let chunk = (target - b.len()).clamp(200, 6000);
        let user = text(&mut seed, chunk / 3);
        if parts {
            write!(
                b,
                r#",{{"role":"user","content":[{{"type":"text","text":"{user}"}}]}}"#
            )
            .unwrap();
        } else {
            write!(b, r#",{{"role":"user","content":"{user}"}}"#).unwrap();
        }
        let said = text(&mut seed, chunk / 6);
        let read = text(&mut seed, chunk / 2);
        write!(
            b,
            r#",{{"role":"assistant","content":"{said}","tool_calls":[{{"id":"call_{i}","type":"function","function":{{"name":"read_file","arguments":"{{\"path\":\"src/lib.rs\"}}"}}}}]}},{{"role":"tool","tool_call_id":"call_{i}","content":"{read}"}}"#
        )
        .unwrap();
        i += 1;
    }
    b.push_str("]}");
    b.into_bytes()
}

/// `depth` nested objects whose keys come unsorted at every level.
fn unsorted_chain(depth: usize) -> String {
    let mut s = String::new();
    for _ in 0..depth {
        s.push_str(r#"{"b":"#);
    }
    s.push('0');
    for _ in 0..depth {
        s.push_str(r#","a":1}"#);
    }
    s
}

fn nested_arrays(depth: usize) -> String {
    format!("{}0{}", "[".repeat(depth), "]".repeat(depth))
}

fn chat_tools(tools: &str) -> Vec<u8> {
    format!(r#"{{"model":"m","tools":{tools},"messages":[{{"role":"user","content":"hi"}}]}}"#)
        .into_bytes()
}

/// Every shape at about `target` bytes.
pub fn all(target: usize) -> Vec<Shape> {
    let shape = |name, endpoint, body: Vec<u8>| Shape {
        name,
        endpoint,
        body,
    };
    let mut out = vec![
        shape("plain_chat", CHAT, agent_chat(target, false)),
        shape("plain_chat_text_parts", CHAT, agent_chat(target, true)),
    ];
    let mut seed = 7u64;
    let big = text(&mut seed, target);
    out.push(shape(
        "one_long_message",
        CHAT,
        format!(r#"{{"model":"m","messages":[{{"role":"user","content":"{big}"}}]}}"#).into_bytes(),
    ));
    out.push(shape(
        "one_long_text_part",
        CHAT,
        format!(r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"text","text":"{big}"}}]}}]}}"#).into_bytes(),
    ));
    let image = "iVBORw0KGgo".repeat(target / 11);
    out.push(shape(
        "image_part",
        CHAT,
        format!(r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"text","text":"What is this?"}},{{"type":"image_url","image_url":{{"url":"data:image/png;base64,{image}","detail":"low"}}}}]}}]}}"#).into_bytes(),
    ));
    out.push(shape(
        "tiny_messages",
        CHAT,
        format!(
            r#"{{"model":"m","messages":[{}]}}"#,
            repeat("0", count("0", target))
        )
        .into_bytes(),
    ));
    let short = r#"{"role":"user","content":"hello there, friend"}"#;
    out.push(shape(
        "short_messages",
        CHAT,
        format!(
            r#"{{"model":"m","messages":[{}]}}"#,
            repeat(short, count(short, target).min(95_000))
        )
        .into_bytes(),
    ));
    out.push(shape(
        "tiny_parts",
        CHAT,
        format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":[{}]}}]}}"#,
            repeat("0", count("0", target))
        )
        .into_bytes(),
    ));
    out.push(shape(
        "empty_parts",
        CHAT,
        format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":[{}]}}]}}"#,
            repeat("{}", count("{}", target))
        )
        .into_bytes(),
    ));
    out.push(shape(
        "tiny_tools",
        CHAT,
        chat_tools(&format!("[{}]", repeat("0", count("0", target)))),
    ));
    out.push(shape(
        "tiny_in_tool_object",
        CHAT,
        chat_tools(&format!(
            r#"[{{"type":"function","function":{{"name":"f","parameters":{{"type":"integer","enum":[{}]}}}}}}]"#,
            repeat("0", count("0", target))
        )),
    ));
    out.push(shape(
        "tiny_tool_calls",
        CHAT,
        format!(
            r#"{{"model":"m","messages":[{{"role":"assistant","tool_calls":[{}]}}]}}"#,
            repeat("0", count("0", target))
        )
        .into_bytes(),
    ));
    let arrays = nested_arrays(60);
    out.push(shape(
        "deep_arrays",
        CHAT,
        chat_tools(&format!("[{}]", repeat(&arrays, count(&arrays, target)))),
    ));
    let chain = unsorted_chain(60);
    out.push(shape(
        "deep_unsorted_objects",
        CHAT,
        chat_tools(&format!("[{}]", repeat(&chain, count(&chain, target)))),
    ));
    let too_deep = nested_arrays(100);
    out.push(shape(
        "past_the_nesting_cap",
        CHAT,
        chat_tools(&format!(
            "[{}]",
            repeat(&too_deep, count(&too_deep, target))
        )),
    ));
    out.push(shape(
        "huge_numbers",
        CHAT,
        chat_tools(&format!("[{}]", repeat("1e300", count("1e300", target)))),
    ));
    out.push(shape(
        "huge_numbers_in_object",
        CHAT,
        chat_tools(&format!(
            r#"[{{"a":[{}]}}]"#,
            repeat("1e300", count("1e300", target))
        )),
    ));
    // Numbers the writer must rewrite: not in `{:e}`'s form, or more
    // digits than an f64 keeps.
    out.push(shape(
        "numbers_to_rewrite",
        CHAT,
        chat_tools(&format!("[{}]", repeat("1E+300", count("1E+300", target)))),
    ));
    let long = "0.1000000000000000055511151231257827";
    out.push(shape(
        "long_decimals",
        CHAT,
        chat_tools(&format!("[{}]", repeat(long, count(long, target)))),
    ));
    out.push(shape(
        "many_tools",
        CHAT,
        chat_tools(&format!("[{}]", repeat(TOOL, count(TOOL, target)))),
    ));
    let key = |c: char| c.to_string().repeat(target / 4);
    out.push(shape(
        "long_keys",
        CHAT,
        chat_tools(&format!(
            r#"[{{"{}":0,"{}":1,"{}":2,"{}":3}}]"#,
            key('d'),
            key('c'),
            key('b'),
            key('a')
        )),
    ));
    let n = target / 12;
    let mut keys = String::with_capacity(target + 64);
    for i in 0..n {
        // A fixed odd multiplier visits every residue: distinct keys, shuffled.
        let k = (i as u64).wrapping_mul(0x9E37_79B9) % n as u64;
        if i > 0 {
            keys.push(',');
        }
        write!(keys, r#""k{k}":0"#).unwrap();
    }
    out.push(shape(
        "many_keys",
        CHAT,
        chat_tools(&format!(
            r#"[{{"type":"function","function":{{"name":"f","parameters":{{"type":"object","properties":{{{keys}}}}}}}}}]"#
        )),
    ));
    // One object of small unsorted objects: every one needs sorting, all in
    // one value (the key index's worst case).
    let mut pairs = String::with_capacity(target + 64);
    let mut i = 0u64;
    while pairs.len() < target {
        if i > 0 {
            pairs.push(',');
        }
        write!(pairs, r#""{i}":{{"b":0,"a":0}}"#).unwrap();
        i += 1;
    }
    out.push(shape(
        "many_small_objects",
        CHAT,
        chat_tools(&format!("[{{{pairs}}}]")),
    ));
    let mut ids = String::with_capacity(target + 16);
    let mut i = 0u64;
    while ids.len() < target {
        if i > 0 {
            ids.push(',');
        }
        write!(ids, "{}", (i * 7919) % 151_936).unwrap();
        i += 1;
    }
    out.push(shape(
        "token_ids",
        Endpoint::Completions,
        format!(r#"{{"model":"m","prompt":[{ids}]}}"#).into_bytes(),
    ));
    out.push(shape(
        "tiny_input_items",
        Endpoint::Responses,
        format!(
            r#"{{"model":"m","input":[{}]}}"#,
            repeat("0", count("0", target))
        )
        .into_bytes(),
    ));
    let mut items = String::with_capacity(target + 8192);
    let mut i = 0;
    while items.len() < target {
        let said = text(&mut seed, 1500);
        let output = text(&mut seed, 4000);
        write!(
            items,
            r#"{{"role":"user","content":[{{"type":"input_text","text":"{said}"}}]}},{{"type":"function_call","call_id":"c{i}","name":"shell","arguments":"{{\"cmd\":\"cat x\"}}"}},{{"type":"function_call_output","call_id":"c{i}","output":"{output}"}},"#
        )
        .unwrap();
        i += 1;
    }
    items.pop();
    out.push(shape(
        "responses_agent",
        Endpoint::Responses,
        format!(r#"{{"model":"m","instructions":"Be terse.","input":[{items}]}}"#).into_bytes(),
    ));
    out
}

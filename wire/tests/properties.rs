//! Property tests for the fingerprint's promises (see the crate docs).

use hearth_wire::{canonical_prompt, chain_hashes, fingerprint, header, Endpoint, Params};
use proptest::prelude::*;
use serde_json::{json, Map, Value};

const CHAT: Endpoint = Endpoint::ChatCompletions;

fn text() -> impl Strategy<Value = String> {
    // Quotes, backslashes, control characters and non-ASCII on purpose.
    prop_oneof![
        "[a-z ]{0,40}",
        "[a-zA-Z0-9 \"\\\\\n\t\u{1}é€😀/]{0,60}",
        any::<String>(),
    ]
}

fn small_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|i| json!(i)),
        // Quarter steps: serde_json's default float parsing is not always
        // correctly rounded, so long decimals may not survive a re-print.
        (-4000i32..4000).prop_map(|i| json!(f64::from(i) / 4.0)),
        text().prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map("[a-z_]{1,8}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

/// An item of an array of many: mostly one-digit numbers, literals and
/// short strings (canonical as they stand), sometimes longer ones, and
/// now and then any small value.
fn tiny_item() -> impl Strategy<Value = Value> {
    prop_oneof![
        6 => (0u8..10).prop_map(|d| json!(d)),
        1 => (-99i64..1000).prop_map(|i| json!(i)),
        1 => prop::sample::select(vec![json!(null), json!(true), json!(false), json!({}), json!([]), json!(0.5), json!(-0.0)]),
        1 => "[a-z\"\\\\é]{0,40}".prop_map(Value::String),
        1 => small_json(),
    ]
}

fn content() -> impl Strategy<Value = Value> {
    let part = prop_oneof![
        text().prop_map(|t| json!({"type": "text", "text": t})),
        "[A-Za-z0-9+/]{0,40}".prop_map(|d| json!({"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{d}")}})),
    ];
    prop_oneof![
        text().prop_map(Value::String),
        prop::collection::vec(part, 0..3).prop_map(Value::Array),
        Just(Value::Null),
    ]
}

fn message(roles: &'static [&'static str]) -> impl Strategy<Value = Value> {
    (
        prop::sample::select(roles),
        content(),
        prop::option::of(small_json()),
        prop::option::of("[a-z0-9_]{1,12}"),
        prop::option::of("[a-z_]{1,8}"),
    )
        .prop_map(|(role, content, tool_calls, id, name)| {
            let mut m = Map::new();
            m.insert("role".into(), json!(role));
            m.insert("content".into(), content);
            if let Some(tc) = tool_calls {
                m.insert("tool_calls".into(), tc);
            }
            if let Some(id) = id {
                m.insert("tool_call_id".into(), json!(id));
            }
            if let Some(n) = name {
                m.insert("name".into(), json!(n));
            }
            Value::Object(m)
        })
}

/// A chat body: leading system messages, optional tools, then a conversation.
fn chat_body() -> impl Strategy<Value = (Value, usize)> {
    (
        "[a-z0-9.-]{1,16}",
        prop::collection::vec(message(&["system", "developer"]), 0..3),
        prop::option::of(small_json()),
        prop::collection::vec(message(&["user", "assistant", "tool"]), 1..8),
    )
        .prop_map(|(model, system, tools, rest)| {
            let lead = system.len();
            let mut messages = system;
            messages.extend(rest);
            let mut body = json!({"model": model, "messages": messages});
            if let Some(t) = tools {
                body["tools"] = t;
            }
            (body, lead)
        })
}

fn params() -> impl Strategy<Value = Params> {
    (64usize..300).prop_map(|block_size| Params {
        block_size,
        max_prefix_bytes: 1 << 20,
    })
}

/// Serializes `v` with keys in a seed-chosen order, seed-chosen whitespace,
/// and (for some seeds) every non-ASCII character as a `\u` escape.
fn reserialize(v: &Value, seed: u64, out: &mut String) {
    let ws = [" ", "", "\n", "\t ", ""][(seed % 5) as usize];
    match v {
        Value::Object(m) => {
            let mut entries: Vec<(&String, &Value)> = m.iter().collect();
            if seed & 1 == 1 {
                entries.reverse();
            }
            let len = entries.len().max(1);
            entries.rotate_left((seed as usize / 2) % len);
            out.push('{');
            out.push_str(ws);
            for (i, (k, val)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                    out.push_str(ws);
                }
                write_str(k, seed, out);
                out.push_str(ws);
                out.push(':');
                out.push_str(ws);
                reserialize(val, seed.rotate_left(7) ^ 0x9e37, out);
            }
            out.push_str(ws);
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(ws);
                reserialize(item, seed.rotate_left(3) ^ 0x51, out);
            }
            out.push(']');
        }
        Value::String(s) => write_str(s, seed, out),
        other => out.push_str(&other.to_string()),
    }
}

fn write_str(s: &str, seed: u64, out: &mut String) {
    if seed.is_multiple_of(3) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '/' => out.push_str("\\/"),
                c if c.is_ascii() && !c.is_ascii_control() => out.push(c),
                c => {
                    let mut buf = [0u16; 2];
                    for unit in c.encode_utf16(&mut buf) {
                        out.push_str(&format!("\\u{unit:04X}"));
                    }
                }
            }
        }
        out.push('"');
    } else {
        out.push_str(&serde_json::to_string(s).unwrap());
    }
}

/// Objects nested in objects and arrays, their keys in any order,
/// repeated, escaped or not, with whitespace or none.
fn object_text() -> impl Strategy<Value = String> {
    let key = prop::sample::select(vec![
        r#""a""#,
        r#""b""#,
        r#""c""#,
        r#""ab""#,
        r#""\u0061""#,
        r#""a\n""#,
        r#""é""#,
        r#""\u00e9""#,
        r#""""#,
        r#""b\"""#,
        r#""zz""#,
        r#""k10""#,
        r#""k9""#,
    ]);
    let ws = prop::sample::select(vec!["", "", " ", "\n "]);
    let leaf = prop::sample::select(vec![
        "1",
        "-7",
        "\"x\"",
        "\"\\u0041\"",
        "null",
        "true",
        "[]",
        "{}",
        "-2.50",
        "1E+3",
        "0.5",
    ])
    .prop_map(String::from);
    leaf.prop_recursive(5, 96, 8, move |inner| {
        prop_oneof![
            3 => prop::collection::vec((key.clone(), inner.clone(), ws.clone()), 0..9).prop_map(|members| {
                let members: Vec<String> = members
                    .into_iter()
                    .map(|(k, v, ws)| format!("{ws}{k}{ws}:{ws}{v}{ws}"))
                    .collect();
                format!("{{{}}}", members.join(","))
            }),
            1 => prop::collection::vec(inner, 0..4).prop_map(|items| format!("[{}]", items.join(", "))),
        ]
    })
}

/// Canonical JSON as the crate docs define it, written from serde_json's
/// tree (whose maps keep keys sorted, the last of a repeated key): the
/// reference the in-place writer is checked against.
fn reference(v: &Value, out: &mut String) {
    match v {
        Value::Object(m) => {
            out.push('{');
            for (i, (k, val)) in m.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&serde_json::to_string(k).unwrap());
                out.push(':');
                reference(val, out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                reference(item, out);
            }
            out.push(']');
        }
        Value::Number(n) if n.is_i64() || n.is_u64() => out.push_str(&n.to_string()),
        Value::Number(n) => out.push_str(&format!("{:e}", n.as_f64().unwrap())),
        other => out.push_str(&other.to_string()),
    }
}

fn canon(body: &Value) -> Vec<u8> {
    canonical_prompt(CHAT, body.to_string().as_bytes())
        .expect("fingerprintable")
        .1
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// (1) A conversation's prefix has a byte-prefix canonical form, and its
    /// full-block hashes are a prefix of the longer conversation's hashes.
    #[test]
    fn prefix_property((body, lead) in chat_body(), cut in any::<prop::sample::Index>(), p in params()) {
        let msgs = body["messages"].as_array().unwrap().clone();
        // Cut inside the conversation, never inside the leading system run
        // (tools are written after that run).
        let k = lead.max(1) + cut.index(msgs.len() - lead.max(1) + 1);
        let mut short = body.clone();
        short["messages"] = Value::Array(msgs[..k].to_vec());
        let (a, b) = (canon(&short), canon(&body));
        prop_assert!(b.starts_with(&a));
        let fa = fingerprint(CHAT, short.to_string().as_bytes(), &p).unwrap();
        let fb = fingerprint(CHAT, body.to_string().as_bytes(), &p).unwrap();
        let full = a.len() / p.block_size;
        prop_assert_eq!(&fa.hashes[..full], &fb.hashes[..full]);
    }

    /// (1b) The records read back: each is a tag, text without `0xFF`,
    /// then `0xFF`, so whatever the texts hold (quotes, controls, any
    /// Unicode) the canonical bytes name exactly one list of records.
    #[test]
    fn records_read_back_whatever_the_texts((role, texts) in ("[a-z]{1,10}", prop::collection::vec(text(), 1..5))) {
        let parts: Vec<Value> = texts.iter().map(|t| json!({"type": "text", "text": t})).collect();
        let body = json!({"model": "m", "messages": [{"role": role, "content": parts}]});
        let bytes = canon(&body);
        let mut records = Vec::new();
        let mut rest = &bytes[..];
        while let Some((&tag, after)) = rest.split_first() {
            let end = after.iter().position(|&b| b == 0xFF);
            prop_assert!(end.is_some(), "a record without its end");
            let end = end.unwrap();
            records.push((tag, String::from_utf8(after[..end].to_vec()).unwrap()));
            rest = &after[end + 1..];
        }
        let mut want = vec![(b'm', role.clone())];
        want.extend(texts.iter().map(|t| (b'c', t.clone())));
        prop_assert_eq!(records, want);
    }

    /// (1c) Two system prompts that open with the same text share canonical
    /// bytes through that text, whatever follows it: the blocks it fills
    /// are shared, as an engine shares its tokens.
    #[test]
    fn texts_that_open_alike_share_their_blocks(opening in text(), a in text(), b in text(), p in params()) {
        let body = |own: &str| json!({"model": "m", "messages": [
            {"role": "system", "content": format!("{opening}{own}")},
            {"role": "user", "content": "go"},
        ]});
        let (x, y) = (canon(&body(&a)), canon(&body(&b)));
        let shared = 1 + "system".len() + 1 + 1 + opening.len();
        prop_assert_eq!(&x[..shared], &y[..shared]);
        let fx = fingerprint(CHAT, body(&a).to_string().as_bytes(), &p).unwrap();
        let fy = fingerprint(CHAT, body(&b).to_string().as_bytes(), &p).unwrap();
        let full = shared / p.block_size;
        prop_assert_eq!(&fx.hashes[..full], &fy.hashes[..full]);
    }

    /// (2) Key order, whitespace and string escaping do not matter.
    #[test]
    fn serialization_invariance((body, _) in chat_body(), seed in any::<u64>()) {
        let mut text = String::new();
        reserialize(&body, seed, &mut text);
        let reparsed: Value = serde_json::from_str(&text).unwrap();
        prop_assert_eq!(&reparsed, &body);
        let got = canonical_prompt(CHAT, text.as_bytes()).unwrap();
        prop_assert_eq!(&got.1, &canon(&body));
        // The streaming fingerprint (strings decoded straight into the
        // hasher, bounded prefix) equals hashing the materialised bytes.
        let p = Params { block_size: 64, max_prefix_bytes: 64 * (1 + (seed % 5) as usize) };
        let fp = fingerprint(CHAT, text.as_bytes(), &p).unwrap();
        prop_assert_eq!(fp.prompt_bytes, got.1.len() as u64);
        prop_assert_eq!(fp.hashes, chain_hashes(&got.0, &got.1, &p));
    }

    /// The tools' record is the reference canonical JSON of the tools,
    /// whatever whitespace, key order and escaping the body was sent with
    /// (runs of the body written as they stand, or piece by piece).
    #[test]
    fn a_json_record_is_the_reference_canonical_json(tools in small_json(), seed in any::<u64>()) {
        prop_assume!(!tools.is_null());
        let body = json!({"model": "m", "tools": tools, "messages": [{"role": "user", "content": "hi"}]});
        let mut want = String::from("T");
        reference(&tools, &mut want);
        let mut want = want.into_bytes();
        want.push(0xFF);
        for text in [body.to_string(), { let mut t = String::new(); reserialize(&body, seed, &mut t); t }] {
            let got = canonical_prompt(CHAT, text.as_bytes()).unwrap().1;
            prop_assert!(got.starts_with(&want), "{}\n{:?}\n{:?}", text, String::from_utf8_lossy(&got), String::from_utf8_lossy(&want));
        }
    }

    /// Arrays of many small items, as the writer batches them (one-digit
    /// numbers read in a loop, tiny records gathered before they are
    /// hashed) and as it does not (longer numbers and strings, objects,
    /// whitespace): each input item's record, and the tools' record, are
    /// the reference's, and the hashes those of the canonical bytes.
    #[test]
    fn arrays_of_tiny_items_are_written_as_the_reference_writes_them(
        items in prop::collection::vec(tiny_item(), 0..300),
        seed in any::<u64>(),
        block in 1usize..80,
    ) {
        let items = Value::Array(items);
        let responses = json!({"model": "m", "input": items.clone()});
        let chat = json!({"model": "m", "tools": items.clone(), "messages": [{"role": "user", "content": "hi"}]});
        let mut want_input = Vec::new();
        for item in items.as_array().unwrap() {
            let mut r = String::from("E");
            reference(item, &mut r);
            want_input.extend_from_slice(r.as_bytes());
            want_input.push(0xFF);
        }
        let mut want_tools = String::from("T");
        reference(&items, &mut want_tools);
        let mut want_tools = want_tools.into_bytes();
        want_tools.push(0xFF);
        let p = Params { block_size: block * 8, max_prefix_bytes: 1 << 20 };
        for (endpoint, body, want) in [
            (Endpoint::Responses, &responses, want_input),
            (CHAT, &chat, want_tools),
        ] {
            for text in [body.to_string(), { let mut t = String::new(); reserialize(body, seed, &mut t); t }] {
                match canonical_prompt(endpoint, text.as_bytes()) {
                    Ok((model, got)) => {
                        prop_assert!(got.starts_with(&want), "{}", text);
                        let fp = fingerprint(endpoint, text.as_bytes(), &p).unwrap();
                        prop_assert_eq!(fp.hashes, chain_hashes(&model, &got, &p));
                    }
                    Err(e) => {
                        prop_assert!(want.is_empty(), "{}: {:?}", text, e);
                    }
                }
            }
        }
    }

    /// Content parts, many of them empty objects (gathered into batches
    /// before they are hashed) among text and image parts: the records
    /// are those of the same parts written with a space inside each `{}`
    /// (read one by one), and the hashes those of the canonical bytes.
    #[test]
    fn empty_parts_are_written_as_any_other_object_part(
        parts in prop::collection::vec(prop_oneof![
            4 => Just(json!({})),
            1 => "[a-z ]{0,20}".prop_map(|t| json!({"type": "text", "text": t})),
            1 => "[a-z]{0,12}".prop_map(|u| json!({"type": "image_url", "image_url": {"url": u}})),
        ], 1..300),
        block in 1usize..80,
    ) {
        let body = json!({"model": "m", "messages": [{"role": "user", "content": parts}]}).to_string();
        let spaced = body.replace("{}", "{ }");
        let (model, got) = canonical_prompt(CHAT, body.as_bytes()).unwrap();
        prop_assert_eq!(&got, &canonical_prompt(CHAT, spaced.as_bytes()).unwrap().1);
        let p = Params { block_size: block * 8, max_prefix_bytes: 1 << 20 };
        let fp = fingerprint(CHAT, body.as_bytes(), &p).unwrap();
        prop_assert_eq!(fp.hashes, chain_hashes(&model, &got, &p));
    }

    /// Text made of digits, commas and brackets (where arrays of one-digit
    /// numbers are read in a loop) is JSON exactly when serde_json says so.
    #[test]
    fn digit_arrays_are_json_as_for_serde_json(s in "[\\[\\]0-9,.eE+ -]{0,40}") {
        let body = format!(r#"{{"model":"m","tools":{s},"messages":[{{"role":"user","content":"hi"}}]}}"#);
        let ours = canonical_prompt(CHAT, body.as_bytes()).map(drop);
        let theirs = serde_json::from_str::<Value>(&s).is_ok();
        prop_assert_eq!(ours.is_ok(), theirs, "{}: {:?}", s, ours);
        if !theirs {
            prop_assert_eq!(ours, Err(hearth_wire::SkipReason::NotJson));
        }
    }

    /// (3) Per-turn fields (top level and per message) do not matter.
    #[test]
    fn per_turn_fields_invariance(
        (body, _) in chat_body(),
        temperature in 0.0f64..2.0,
        max_tokens in 1u32..100_000,
        stream in any::<bool>(),
        user in "[a-z0-9]{0,10}",
        seed in any::<i64>(),
        extra in small_json(),
    ) {
        let mut varied = body.clone();
        varied["temperature"] = json!(temperature);
        varied["max_tokens"] = json!(max_tokens);
        varied["stream"] = json!(stream);
        varied["stream_options"] = json!({"include_usage": stream});
        varied["user"] = json!(user);
        varied["seed"] = json!(seed);
        varied["n"] = json!(1);
        varied["top_p"] = json!(0.9);
        varied["metadata"] = extra.clone();
        for m in varied["messages"].as_array_mut().unwrap() {
            m["x_extra"] = extra.clone();
        }
        prop_assert_eq!(canon(&varied), canon(&body));
    }

    /// (4) The model seeds the chain.
    #[test]
    fn models_do_not_share_hashes(m1 in "[a-z0-9.-]{1,20}", m2 in "[a-z0-9.-]{1,20}", data in prop::collection::vec(any::<u8>(), 1..300)) {
        prop_assume!(m1 != m2);
        let p = Params::default();
        prop_assert_ne!(chain_hashes(&m1, &data, &p)[0], chain_hashes(&m2, &data, &p)[0]);
    }

    /// (5) Arbitrary input never panics.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512), e in 0usize..3) {
        let _ = canonical_prompt(Endpoint::ALL[e], &bytes);
        let _ = header::decode(&String::from_utf8_lossy(&bytes));
    }

    #[test]
    fn json_like_input_never_panics(s in "[\\[\\]{}\",:0-9a-z\\\\ ]{0,200}", e in 0usize..3) {
        let _ = canonical_prompt(Endpoint::ALL[e], s.as_bytes());
        let wrapped = format!(r#"{{"model":"m","messages":{s},"prompt":{s},"input":{s}}}"#);
        let _ = canonical_prompt(Endpoint::ALL[e], wrapped.as_bytes());
        let _ = header::decode(&format!("v2.2048.{s}"));
    }

    #[test]
    fn mistyped_fields_never_panic(v in small_json(), e in 0usize..3) {
        for key in ["messages", "tools", "prompt", "input", "instructions", "tool_choice"] {
            let body = json!({"model": "m", key: v.clone()});
            let _ = canonical_prompt(Endpoint::ALL[e], body.to_string().as_bytes());
            let msg = json!({"model": "m", "messages": [{"role": "user", "content": v.clone(), "tool_call_id": v.clone()}]});
            let _ = canonical_prompt(Endpoint::ALL[e], msg.to_string().as_bytes());
        }
    }

    /// (6) Header values round-trip.
    #[test]
    fn header_roundtrip(block_size in 64u32..=(1 << 20), hashes in prop::collection::vec(any::<u64>(), 0..200)) {
        let v = header::encode(block_size, &hashes);
        prop_assert_eq!(header::decode(&v), Ok((block_size, hashes)));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]

    /// Whatever the order of an object's keys (in order, reversed,
    /// repeated, escaped) and however deep, its members are written
    /// sorted, the last of a repeated key kept, as the reference writes
    /// them (the tools' record of a body carrying it, alone and twice).
    #[test]
    fn every_object_is_written_as_the_reference_writes_it(t in object_text()) {
        let v: Value = serde_json::from_str(&t).unwrap();
        let mut want = String::new();
        reference(&v, &mut want);
        // (Tools of `null` are no tools: that one is checked twice only.)
        let alone = (!v.is_null()).then(|| (t.clone(), want.clone()));
        for (tools, want) in alone.into_iter().chain([(format!("[{t},{t}]"), format!("[{want},{want}]"))]) {
            let body = format!(r#"{{"model":"m","tools":{tools},"messages":[{{"role":"user","content":"hi"}}]}}"#);
            let mut record = format!("T{want}").into_bytes();
            record.push(0xFF);
            let got = canonical_prompt(CHAT, body.as_bytes()).unwrap().1;
            prop_assert!(got.starts_with(&record), "{}\n{:?}", body, String::from_utf8_lossy(&got));
        }
    }
}

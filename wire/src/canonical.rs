//! Request body → canonical prompt bytes (format in the crate docs).
//!
//! The body is parsed once with serde_json into borrowed, "lenient" types:
//! a prompt-bearing field of the wrong JSON type does not fail the parse, it
//! parses as `Bad` so the caller can tell `BadField` from `NotJson`. Big
//! strings (message content) are borrowed from the body unless they contain
//! escapes. Only the small JSON-valued fields (tools, tool_calls, non-text
//! parts, input items) become `serde_json::Value`.

use crate::{json, CacheUse, Endpoint, SkipReason};
use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::Value;
use std::borrow::Cow;
use std::fmt;

const TAG_MESSAGE: u8 = b'm';
const TAG_CONTENT: u8 = b'c';
const TAG_PART: u8 = b'p';
const TAG_TOOL_CALLS: u8 = b'k';
const TAG_TOOL_CALL_ID: u8 = b'i';
const TAG_NAME: u8 = b'n';
const TAG_TOOLS: u8 = b'T';
const TAG_TOOL_CHOICE: u8 = b'C';
const TAG_RESPONSE_FORMAT: u8 = b'R';
const TAG_PROMPT: u8 = b'P';
const TAG_PROMPT_JSON: u8 = b'J';
const TAG_INSTRUCTIONS: u8 = b'I';
const TAG_INPUT: u8 = b'N';
const TAG_INPUT_ITEM: u8 = b'E';
/// Ends every record. UTF-8 never contains it, and every payload is UTF-8
/// text (a string's text, or canonical JSON), so no payload can end a
/// record early or forge one.
const RECORD_END: u8 = 0xFF;

/// Extracts the model and the canonical prompt bytes of an OpenAI-style body.
///
/// Never panics; every failure is a [`SkipReason`].
pub fn canonical_prompt(endpoint: Endpoint, body: &[u8]) -> Result<(String, Vec<u8>), SkipReason> {
    canonical_request(endpoint, body).map(|r| (r.model, r.canonical))
}

/// What [`canonical_request`] reads of a body.
pub(crate) struct CanonicalRequest {
    pub(crate) model: String,
    pub(crate) canonical: Vec<u8>,
    /// The request's output cap, when it has one.
    pub(crate) max_output_tokens: Option<u64>,
    pub(crate) cache: CacheUse,
    /// The `cache_salt` (partitioned requests only).
    pub(crate) cache_salt: Option<String>,
}

/// [`canonical_prompt`], plus the request's output cap and cache use.
pub(crate) fn canonical_request(
    endpoint: Endpoint,
    body: &[u8],
) -> Result<CanonicalRequest, SkipReason> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let top = TopSeed(endpoint)
        .deserialize(&mut de)
        .map_err(|_| SkipReason::NotJson)?;
    de.end().map_err(|_| SkipReason::NotJson)?;
    let Top::Object(mut fields) = top else {
        return Err(SkipReason::NotObject);
    };
    let model = match fields.model.take() {
        Some(Lenient::Val(m)) if !m.is_empty() => m.into_owned(),
        _ => return Err(SkipReason::NoModel),
    };
    let mut out = Vec::with_capacity(body.len());
    match endpoint {
        Endpoint::ChatCompletions => write_chat(&mut out, &fields)?,
        Endpoint::Completions => write_completions(&mut out, &fields)?,
        Endpoint::Responses => write_responses(&mut out, &fields)?,
    }
    if out.is_empty() {
        return Err(SkipReason::NoPrompt);
    }
    // A salt partitions the cache; turning the cache off or pinning a slot
    // bypasses it (the stronger of the two when both are asked).
    let cache_salt = match fields.cache_salt.take() {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s),
        Some(other) => {
            let mut v = Vec::new();
            json::write_value(&mut v, &other);
            Some(String::from_utf8_lossy(&v).into_owned())
        }
    };
    let cache = if fields.cache_prompt == Some(false) || fields.pinned_slot {
        CacheUse::Bypassed
    } else if cache_salt.is_some() {
        CacheUse::Partitioned
    } else {
        CacheUse::Shared
    };
    Ok(CanonicalRequest {
        model,
        canonical: out,
        max_output_tokens: fields.max_output_tokens,
        cache,
        cache_salt: cache_salt.filter(|_| cache == CacheUse::Partitioned),
    })
}

// ---------------------------------------------------------------------------
// Writing records

fn record(out: &mut Vec<u8>, tag: u8, payload: &[u8]) {
    out.push(tag);
    out.extend_from_slice(payload);
    out.push(RECORD_END);
}

/// A record whose payload is canonical JSON, written in place.
fn json_record(out: &mut Vec<u8>, tag: u8, write: impl FnOnce(&mut Vec<u8>)) {
    out.push(tag);
    write(out);
    out.push(RECORD_END);
}

fn value_record(out: &mut Vec<u8>, tag: u8, v: &Option<Value>) {
    if let Some(v) = v.as_ref().filter(|v| !v.is_null()) {
        json_record(out, tag, |o| json::write_value(o, v));
    }
}

fn str_record(
    out: &mut Vec<u8>,
    tag: u8,
    s: &Option<Lenient<Cow<'_, str>>>,
) -> Result<(), SkipReason> {
    match s {
        None | Some(Lenient::Null) => Ok(()),
        Some(Lenient::Val(s)) => {
            record(out, tag, s.as_bytes());
            Ok(())
        }
        Some(Lenient::Bad) => Err(SkipReason::BadField),
    }
}

fn write_chat(out: &mut Vec<u8>, f: &Fields<'_>) -> Result<(), SkipReason> {
    let messages: &[Lenient<Message<'_>>] = match &f.messages {
        None | Some(Lenient::Null) => &[],
        Some(Lenient::Val(m)) => m,
        Some(Lenient::Bad) => return Err(SkipReason::BadField),
    };
    let lead = messages
        .iter()
        .take_while(|m| match m {
            Lenient::Val(m) => m.is_system(),
            _ => false,
        })
        .count();
    let (system, rest) = messages.split_at(lead.min(messages.len()));
    for m in system {
        write_message(out, m)?;
    }
    value_record(out, TAG_TOOLS, &f.tools);
    value_record(out, TAG_TOOL_CHOICE, &f.tool_choice);
    value_record(out, TAG_RESPONSE_FORMAT, &f.response_format);
    for m in rest {
        write_message(out, m)?;
    }
    Ok(())
}

fn write_message(out: &mut Vec<u8>, m: &Lenient<Message<'_>>) -> Result<(), SkipReason> {
    let Lenient::Val(m) = m else {
        return Err(SkipReason::BadField);
    };
    match &m.role {
        Some(Lenient::Val(role)) => record(out, TAG_MESSAGE, role.as_bytes()),
        _ => return Err(SkipReason::BadField),
    }
    match &m.content {
        None | Some(Lenient::Null) => {}
        Some(Lenient::Val(StrOrArray::Str(s))) => record(out, TAG_CONTENT, s.as_bytes()),
        Some(Lenient::Val(StrOrArray::Array(parts))) => {
            for part in parts {
                write_part(out, part)?;
            }
        }
        Some(Lenient::Bad) => return Err(SkipReason::BadField),
    }
    value_record(out, TAG_TOOL_CALLS, &m.tool_calls);
    str_record(out, TAG_TOOL_CALL_ID, &m.tool_call_id)?;
    str_record(out, TAG_NAME, &m.name)?;
    Ok(())
}

fn write_part(out: &mut Vec<u8>, part: &Value) -> Result<(), SkipReason> {
    let Value::Object(map) = part else {
        return Err(SkipReason::BadField);
    };
    if let (Some(Value::String(t)), Some(Value::String(text))) = (map.get("type"), map.get("text"))
    {
        if t == "text" {
            record(out, TAG_CONTENT, text.as_bytes());
            return Ok(());
        }
    }
    json_record(out, TAG_PART, |o| json::write_value(o, part));
    Ok(())
}

fn write_completions(out: &mut Vec<u8>, f: &Fields<'_>) -> Result<(), SkipReason> {
    match &f.prompt {
        None | Some(Lenient::Null) => Ok(()),
        Some(Lenient::Val(StrOrArray::Str(s))) => {
            record(out, TAG_PROMPT, s.as_bytes());
            Ok(())
        }
        Some(Lenient::Val(StrOrArray::Array(items))) => {
            if items.iter().all(Value::is_string) {
                for item in items {
                    record(
                        out,
                        TAG_PROMPT,
                        item.as_str().unwrap_or_default().as_bytes(),
                    );
                }
                Ok(())
            } else if items.iter().all(|v| v.is_number() || v.is_array()) {
                json_record(out, TAG_PROMPT_JSON, |o| {
                    o.push(b'[');
                    for (i, item) in items.iter().enumerate() {
                        if i > 0 {
                            o.push(b',');
                        }
                        json::write_value(o, item);
                    }
                    o.push(b']');
                });
                Ok(())
            } else {
                Err(SkipReason::BadField)
            }
        }
        Some(Lenient::Bad) => Err(SkipReason::BadField),
    }
}

fn write_responses(out: &mut Vec<u8>, f: &Fields<'_>) -> Result<(), SkipReason> {
    str_record(out, TAG_INSTRUCTIONS, &f.instructions)?;
    value_record(out, TAG_TOOLS, &f.tools);
    match &f.input {
        None | Some(Lenient::Null) => Ok(()),
        Some(Lenient::Val(StrOrArray::Str(s))) => {
            record(out, TAG_INPUT, s.as_bytes());
            Ok(())
        }
        Some(Lenient::Val(StrOrArray::Array(items))) => {
            for item in items {
                json_record(out, TAG_INPUT_ITEM, |o| json::write_value(o, item));
            }
            Ok(())
        }
        Some(Lenient::Bad) => Err(SkipReason::BadField),
    }
}

// ---------------------------------------------------------------------------
// Lenient parsing

/// A field that parsed as JSON but may have the wrong type.
enum Lenient<T> {
    Null,
    Val(T),
    Bad,
}

enum StrOrArray<'a> {
    Str(Cow<'a, str>),
    Array(Vec<Value>),
}

#[derive(Default)]
struct Fields<'a> {
    model: Option<Lenient<Cow<'a, str>>>,
    messages: Option<Lenient<Vec<Lenient<Message<'a>>>>>,
    tools: Option<Value>,
    tool_choice: Option<Value>,
    response_format: Option<Value>,
    prompt: Option<Lenient<StrOrArray<'a>>>,
    instructions: Option<Lenient<Cow<'a, str>>>,
    input: Option<Lenient<StrOrArray<'a>>>,
    /// The request's output cap (`max_tokens`, `max_completion_tokens` or
    /// `max_output_tokens`), when it is a plain integer. Not part of the
    /// canonical bytes.
    max_output_tokens: Option<u64>,
    /// `cache_salt` (vLLM, SGLang).
    cache_salt: Option<Value>,
    /// `cache_prompt` (llama.cpp), when a boolean.
    cache_prompt: Option<bool>,
    /// `id_slot` or `slot_id` (llama.cpp) names a slot (a non-negative
    /// integer; -1 lets the engine choose).
    pinned_slot: bool,
}

#[derive(Default)]
struct Message<'a> {
    role: Option<Lenient<Cow<'a, str>>>,
    content: Option<Lenient<StrOrArray<'a>>>,
    tool_calls: Option<Value>,
    tool_call_id: Option<Lenient<Cow<'a, str>>>,
    name: Option<Lenient<Cow<'a, str>>>,
}

impl Message<'_> {
    fn is_system(&self) -> bool {
        matches!(&self.role, Some(Lenient::Val(r)) if r == "system" || r == "developer")
    }
}

enum Top<'a> {
    Object(Box<Fields<'a>>),
    NotObject,
}

/// Visitor methods for JSON types a lenient field does not accept: the value
/// is consumed and reported as `$bad`; `null` is reported as `$null`.
macro_rules! lenient_scalars {
    ($null:expr, $bad:expr) => {
        fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
            Ok($bad)
        }
        fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
            Ok($bad)
        }
        fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
            Ok($bad)
        }
        fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
            Ok($bad)
        }
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok($null)
        }
        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok($null)
        }
    };
}

macro_rules! lenient_str {
    ($bad:expr) => {
        fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
            Ok($bad)
        }
    };
}

macro_rules! lenient_seq {
    ($bad:expr) => {
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            while seq.next_element::<IgnoredAny>()?.is_some() {}
            Ok($bad)
        }
    };
}

macro_rules! lenient_map {
    ($bad:expr) => {
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
            Ok($bad)
        }
    };
}

/// A string borrowed from the body when it has no escapes.
struct CowStr<'a>(Cow<'a, str>);

impl<'de> Deserialize<'de> for CowStr<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = CowStr<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, s: &'de str) -> Result<Self::Value, E> {
                Ok(CowStr(Cow::Borrowed(s)))
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
                Ok(CowStr(Cow::Owned(s.to_owned())))
            }
            fn visit_string<E: de::Error>(self, s: String) -> Result<Self::Value, E> {
                Ok(CowStr(Cow::Owned(s)))
            }
        }
        d.deserialize_str(V)
    }
}

impl<'de> Deserialize<'de> for Lenient<Cow<'de, str>> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Lenient<Cow<'de, str>>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_borrowed_str<E: de::Error>(self, s: &'de str) -> Result<Self::Value, E> {
                Ok(Lenient::Val(Cow::Borrowed(s)))
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
                Ok(Lenient::Val(Cow::Owned(s.to_owned())))
            }
            fn visit_string<E: de::Error>(self, s: String) -> Result<Self::Value, E> {
                Ok(Lenient::Val(Cow::Owned(s)))
            }
            lenient_scalars!(Lenient::Null, Lenient::Bad);
            lenient_seq!(Lenient::Bad);
            lenient_map!(Lenient::Bad);
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for Lenient<StrOrArray<'de>> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Lenient<StrOrArray<'de>>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_borrowed_str<E: de::Error>(self, s: &'de str) -> Result<Self::Value, E> {
                Ok(Lenient::Val(StrOrArray::Str(Cow::Borrowed(s))))
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
                Ok(Lenient::Val(StrOrArray::Str(Cow::Owned(s.to_owned()))))
            }
            fn visit_string<E: de::Error>(self, s: String) -> Result<Self::Value, E> {
                Ok(Lenient::Val(StrOrArray::Str(Cow::Owned(s))))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(64));
                while let Some(v) = seq.next_element::<Value>()? {
                    items.push(v);
                }
                Ok(Lenient::Val(StrOrArray::Array(items)))
            }
            lenient_scalars!(Lenient::Null, Lenient::Bad);
            lenient_map!(Lenient::Bad);
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for Lenient<Vec<Lenient<Message<'de>>>> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Lenient<Vec<Lenient<Message<'de>>>>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1024));
                while let Some(m) = seq.next_element::<Lenient<Message<'de>>>()? {
                    items.push(m);
                }
                Ok(Lenient::Val(items))
            }
            lenient_scalars!(Lenient::Null, Lenient::Bad);
            lenient_str!(Lenient::Bad);
            lenient_map!(Lenient::Bad);
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for Lenient<Message<'de>> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Lenient<Message<'de>>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut m = Message::default();
                while let Some(CowStr(key)) = map.next_key::<CowStr<'de>>()? {
                    match key.as_ref() {
                        "role" => m.role = Some(map.next_value()?),
                        "content" => m.content = Some(map.next_value()?),
                        "tool_calls" => m.tool_calls = Some(map.next_value()?),
                        "tool_call_id" => m.tool_call_id = Some(map.next_value()?),
                        "name" => m.name = Some(map.next_value()?),
                        _ => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                Ok(Lenient::Val(m))
            }
            // A null message is as wrong as a number.
            lenient_scalars!(Lenient::Bad, Lenient::Bad);
            lenient_str!(Lenient::Bad);
            lenient_seq!(Lenient::Bad);
        }
        d.deserialize_any(V)
    }
}

/// Parses the top-level object, keeping only the fields `endpoint` reads.
struct TopSeed(Endpoint);

impl<'de> DeserializeSeed<'de> for TopSeed {
    type Value = Top<'de>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for TopSeed {
    type Value = Top<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        use Endpoint::*;
        let e = self.0;
        let mut f = Fields::default();
        while let Some(CowStr(key)) = map.next_key::<CowStr<'de>>()? {
            match (key.as_ref(), e) {
                ("model", _) => f.model = Some(map.next_value()?),
                ("messages", ChatCompletions) => f.messages = Some(map.next_value()?),
                ("tools", ChatCompletions | Responses) => f.tools = Some(map.next_value()?),
                ("tool_choice", ChatCompletions) => f.tool_choice = Some(map.next_value()?),
                ("response_format", ChatCompletions) => f.response_format = Some(map.next_value()?),
                ("prompt", Completions) => f.prompt = Some(map.next_value()?),
                ("instructions", Responses) => f.instructions = Some(map.next_value()?),
                ("input", Responses) => f.input = Some(map.next_value()?),
                ("max_tokens", ChatCompletions | Completions)
                | ("max_completion_tokens", ChatCompletions)
                | ("max_output_tokens", Responses) => {
                    let v: Value = map.next_value()?;
                    f.max_output_tokens = v.as_u64().or(f.max_output_tokens);
                }
                ("cache_salt", _) => f.cache_salt = Some(map.next_value()?),
                ("cache_prompt", _) => {
                    let v: Value = map.next_value()?;
                    f.cache_prompt = v.as_bool();
                }
                ("id_slot" | "slot_id", _) => {
                    let v: Value = map.next_value()?;
                    f.pinned_slot |= v.as_u64().is_some();
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(Top::Object(Box::new(f)))
    }

    lenient_scalars!(Top::NotObject, Top::NotObject);
    lenient_str!(Top::NotObject);
    lenient_seq!(Top::NotObject);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canon(e: Endpoint, body: &str) -> Result<Vec<u8>, SkipReason> {
        canonical_prompt(e, body.as_bytes()).map(|(_, c)| c)
    }

    fn rec(tag: u8, payload: &str) -> Vec<u8> {
        let mut v = vec![tag];
        v.extend_from_slice(payload.as_bytes());
        v.push(0xFF);
        v
    }

    #[test]
    fn system_prompts_that_open_alike_share_their_opening_bytes() {
        // One harness, two projects' instructions of different lengths:
        // the engine shares the harness's tokens, and the canonical bytes
        // share the harness's text.
        let harness = "You are a coding agent. ".repeat(20);
        let body = |own: &str| {
            format!(
                r#"{{"model":"m","messages":[{{"role":"system","content":"{harness}{own}"}},{{"role":"user","content":"go"}}]}}"#
            )
        };
        let a = canon(Endpoint::ChatCompletions, &body("Project 7.")).unwrap();
        let b = canon(Endpoint::ChatCompletions, &body("Project 123456, longer.")).unwrap();
        let common = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
        let opening = rec(b'm', "system").len() + 1 + harness.len();
        assert!(common >= opening + "Project ".len(), "{common} < {opening}");
    }

    #[test]
    fn text_cannot_end_a_record_or_forge_one() {
        // A user's text that spells out what a tool record would look like
        // stays inside its own record: the end byte cannot be written in
        // JSON text (the nearest is U+00FF, two other bytes in UTF-8).
        let forged = canon(
            Endpoint::ChatCompletions,
            r#"{"model":"m","messages":[{"role":"user","content":"x\u00ffT[]"}]}"#,
        )
        .unwrap();
        assert_eq!(
            forged,
            [rec(b'm', "user"), rec(b'c', "x\u{ff}T[]")].concat()
        );
        let ends = forged.iter().filter(|&&b| b == 0xFF).count();
        assert_eq!(ends, 2);
    }

    #[test]
    fn chat_record_layout() {
        let body = r#"{"model":"m","temperature":0.2,"tools":[{"b":1,"a":2}],
            "messages":[{"role":"system","content":"S"},{"role":"user","content":[{"type":"text","text":"hi"},{"type":"image_url","image_url":{"url":"data:x"}}]},
            {"role":"assistant","content":null,"tool_calls":[{"id":"c1"}]},{"role":"tool","tool_call_id":"c1","content":"r","name":"f"}]}"#;
        let want = [
            rec(b'm', "system"),
            rec(b'c', "S"),
            rec(b'T', r#"[{"a":2,"b":1}]"#),
            rec(b'm', "user"),
            rec(b'c', "hi"),
            rec(b'p', r#"{"image_url":{"url":"data:x"},"type":"image_url"}"#),
            rec(b'm', "assistant"),
            rec(b'k', r#"[{"id":"c1"}]"#),
            rec(b'm', "tool"),
            rec(b'c', "r"),
            rec(b'i', "c1"),
            rec(b'n', "f"),
        ]
        .concat();
        assert_eq!(canon(Endpoint::ChatCompletions, body).unwrap(), want);
    }

    #[test]
    fn completions_and_responses_layout() {
        let c = |b| canon(Endpoint::Completions, b);
        assert_eq!(
            c(r#"{"model":"m","prompt":"ab"}"#).unwrap(),
            rec(b'P', "ab")
        );
        assert_eq!(
            c(r#"{"model":"m","prompt":["a","b"]}"#).unwrap(),
            [rec(b'P', "a"), rec(b'P', "b")].concat()
        );
        assert_eq!(
            c(r#"{"model":"m","prompt":[1, 2]}"#).unwrap(),
            rec(b'J', "[1,2]")
        );
        assert_eq!(
            c(r#"{"model":"m","prompt":[{"x":1}]}"#),
            Err(SkipReason::BadField)
        );
        let r = canon(
            Endpoint::Responses,
            r#"{"model":"m","input":[{"role":"user","content":"x"}],"instructions":"be","tools":[]}"#,
        )
        .unwrap();
        assert_eq!(
            r,
            [
                rec(b'I', "be"),
                rec(b'T', "[]"),
                rec(b'E', r#"{"content":"x","role":"user"}"#)
            ]
            .concat()
        );
    }

    #[test]
    fn skip_reasons() {
        let chat = |b: &str| canon(Endpoint::ChatCompletions, b);
        assert_eq!(chat("nope"), Err(SkipReason::NotJson));
        assert_eq!(chat("{\"model\":\"m\"} x"), Err(SkipReason::NotJson));
        assert_eq!(chat("[1,"), Err(SkipReason::NotJson));
        assert_eq!(chat("[1,2]"), Err(SkipReason::NotObject));
        assert_eq!(chat("\"s\""), Err(SkipReason::NotObject));
        assert_eq!(chat("null"), Err(SkipReason::NotObject));
        assert_eq!(chat(r#"{"messages":[]}"#), Err(SkipReason::NoModel));
        assert_eq!(
            chat(r#"{"model":7,"messages":[]}"#),
            Err(SkipReason::NoModel)
        );
        assert_eq!(
            chat(r#"{"model":"","messages":[]}"#),
            Err(SkipReason::NoModel)
        );
        assert_eq!(
            chat(r#"{"model":"m","messages":[]}"#),
            Err(SkipReason::NoPrompt)
        );
        assert_eq!(chat(r#"{"model":"m"}"#), Err(SkipReason::NoPrompt));
        assert_eq!(
            chat(r#"{"model":"m","messages":{}}"#),
            Err(SkipReason::BadField)
        );
        assert_eq!(
            chat(r#"{"model":"m","messages":[1]}"#),
            Err(SkipReason::BadField)
        );
        assert_eq!(
            chat(r#"{"model":"m","messages":[null]}"#),
            Err(SkipReason::BadField)
        );
        assert_eq!(
            chat(r#"{"model":"m","messages":[{"content":"x"}]}"#),
            Err(SkipReason::BadField)
        );
        assert_eq!(
            chat(r#"{"model":"m","messages":[{"role":"user","content":5}]}"#),
            Err(SkipReason::BadField)
        );
        assert_eq!(
            chat(r#"{"model":"m","messages":[{"role":"user","content":["x"]}]}"#),
            Err(SkipReason::BadField)
        );
        assert_eq!(
            chat(r#"{"model":"m","messages":[{"role":"tool","tool_call_id":3}]}"#),
            Err(SkipReason::BadField)
        );
        let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
        assert_eq!(
            chat(&format!(r#"{{"model":"m","tools":{deep}}}"#)),
            Err(SkipReason::NotJson)
        );
    }

    #[test]
    fn escaped_keys_and_strings() {
        let a = canon(
            Endpoint::ChatCompletions,
            r#"{"mod\u0065l":"m","messages":[{"r\u006fle":"user","content":"a\nb\u00e9"}]}"#,
        )
        .unwrap();
        assert_eq!(a, [rec(b'm', "user"), rec(b'c', "a\nb\u{e9}")].concat());
    }

    #[test]
    fn endpoint_ignores_other_fields() {
        // `prompt` means nothing to chat; `messages` nothing to completions.
        assert_eq!(
            canon(Endpoint::ChatCompletions, r#"{"model":"m","prompt":"x"}"#),
            Err(SkipReason::NoPrompt)
        );
        assert_eq!(
            canon(
                Endpoint::Completions,
                r#"{"model":"m","messages":5,"prompt":"x"}"#
            )
            .unwrap(),
            rec(b'P', "x")
        );
    }

    #[test]
    fn cache_salts_partition_and_cache_switches_bypass() {
        use crate::{fingerprint, CacheUse, Params};
        let fp = |body: &str| {
            fingerprint(
                Endpoint::ChatCompletions,
                body.as_bytes(),
                &Params::default(),
            )
            .unwrap()
        };
        let plain = fp(r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#);
        assert_eq!(plain.cache, CacheUse::Shared);
        let salted = fp(
            r#"{"model":"m","cache_salt":"tenant-a","messages":[{"role":"user","content":"hi"}]}"#,
        );
        let other = fp(
            r#"{"model":"m","cache_salt":"tenant-b","messages":[{"role":"user","content":"hi"}]}"#,
        );
        let again = fp(
            r#"{"messages":[{"role":"user","content":"hi"}],"model":"m","cache_salt":"tenant-a"}"#,
        );
        assert_eq!(salted.cache, CacheUse::Partitioned);
        // Same prompt: other salts (or none) share no block; the same salt
        // shares all; the canonical bytes are the same.
        assert_ne!(salted.hashes, plain.hashes);
        assert_ne!(salted.hashes, other.hashes);
        assert_eq!(salted.hashes, again.hashes);
        assert_eq!(salted.prompt_bytes, plain.prompt_bytes);
        for body in [
            r#"{"model":"m","cache_prompt":false,"messages":[{"role":"user","content":"hi"}]}"#,
            r#"{"model":"m","id_slot":1,"messages":[{"role":"user","content":"hi"}]}"#,
            r#"{"model":"m","slot_id":0,"cache_salt":"x","messages":[{"role":"user","content":"hi"}]}"#,
        ] {
            let f = fp(body);
            assert_eq!(f.cache, CacheUse::Bypassed, "{body}");
            assert_eq!(f.hashes, plain.hashes, "{body}");
        }
        for body in [
            r#"{"model":"m","cache_prompt":true,"messages":[{"role":"user","content":"hi"}]}"#,
            r#"{"model":"m","id_slot":-1,"messages":[{"role":"user","content":"hi"}]}"#,
            r#"{"model":"m","cache_salt":null,"messages":[{"role":"user","content":"hi"}]}"#,
        ] {
            assert_eq!(fp(body).cache, CacheUse::Shared, "{body}");
            assert_eq!(fp(body).hashes, plain.hashes, "{body}");
        }
        for v in ["shared", "partitioned", "bypassed"] {
            assert_eq!(CacheUse::parse(v).unwrap().as_str(), v);
        }
        assert_eq!(CacheUse::parse("off"), None);
    }
}

//! Request body → canonical prompt bytes (format in the crate docs).
//!
//! Read in place ([`crate::json`]): one scan validates the body and notes
//! where the fields it reads are (a repeated key: its last value); the
//! records are then written from there, message by message and part by
//! part, straight into a [`Sink`] (the hash chain, for a fingerprint), so
//! no part of the body is copied or built into a tree and the working set
//! is the same for a million tiny items as for one long string. A
//! prompt-bearing field of the wrong JSON type is `BadField`, not
//! `NotJson`.

use crate::json::{Json, Res, Scratch, Sink};
use crate::{CacheUse, Endpoint, SkipReason};

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
    let request = Request::read(endpoint, body)?;
    let mut out = Vec::with_capacity(body.len());
    request.write(&mut Scratch::default(), &mut out)?;
    if out.is_empty() {
        return Err(SkipReason::NoPrompt);
    }
    Ok((request.model, out))
}

/// What one scan of a body finds: the fields the canonical form and the
/// fingerprint read, by where their values are.
pub(crate) struct Request<'a> {
    json: Json<'a>,
    endpoint: Endpoint,
    fields: Fields,
    pub(crate) model: String,
    /// The request's output cap, when it has one.
    pub(crate) max_output_tokens: Option<u64>,
    pub(crate) cache: CacheUse,
}

/// Where each field's (last) value starts.
#[derive(Default)]
struct Fields {
    model: Option<usize>,
    messages: Option<usize>,
    tools: Option<usize>,
    tool_choice: Option<usize>,
    response_format: Option<usize>,
    prompt: Option<usize>,
    instructions: Option<usize>,
    input: Option<usize>,
    /// `cache_salt` (vLLM, SGLang).
    cache_salt: Option<usize>,
    /// `max_tokens`, `max_completion_tokens` or `max_output_tokens` (by
    /// endpoint), the last given as a plain integer. Not part of the
    /// canonical bytes.
    max_output_tokens: Option<u64>,
    /// `cache_prompt` (llama.cpp), when its last value is a boolean.
    cache_prompt: Option<bool>,
    /// `id_slot` or `slot_id` (llama.cpp) names a slot (any number that
    /// is not -1 once cut to an integer, or a boolean, as llama.cpp reads
    /// it; -1 lets the engine choose).
    pinned_slot: bool,
    /// A field that makes the engine read the prompt without its cache, or
    /// as other tokens than the canonical bytes name.
    perturbed: bool,
}

/// Whether llama.cpp reads the value at `v` as a slot other than -1: its
/// JSON library turns numbers (cut toward zero) and booleans into the
/// integer; anything else falls back to -1.
fn names_a_slot(json: &Json<'_>, v: usize) -> bool {
    match json.at(v) {
        b't' | b'f' => true,
        b'-' | b'0'..=b'9' => json.as_f64(v).is_some_and(|x| x.trunc() != -1.0),
        _ => false,
    }
}

impl<'a> Request<'a> {
    /// Validates `body` and finds its fields; the model is required.
    pub(crate) fn read(endpoint: Endpoint, body: &'a [u8]) -> Res<Request<'a>> {
        let json = Json::new(body)?;
        let start = json.ws(0);
        if json.at(start) != b'{' {
            json.document()?;
            return Err(SkipReason::NotObject);
        }
        let mut f = Fields::default();
        let end = json.members(start, 0, |k, v| {
            use Endpoint::*;
            let key = json.short_string(k);
            match (key.as_deref(), endpoint) {
                (Some("model"), _) => f.model = Some(v),
                (Some("messages"), ChatCompletions) => f.messages = Some(v),
                (Some("tools"), ChatCompletions | Responses) => f.tools = Some(v),
                (Some("tool_choice"), ChatCompletions) => f.tool_choice = Some(v),
                (Some("response_format"), ChatCompletions) => f.response_format = Some(v),
                (Some("prompt"), Completions) => f.prompt = Some(v),
                (Some("instructions"), Responses) => f.instructions = Some(v),
                (Some("input"), Responses) => f.input = Some(v),
                (Some("max_tokens"), ChatCompletions | Completions)
                | (Some("max_completion_tokens"), ChatCompletions)
                | (Some("max_output_tokens"), Responses) => {
                    f.max_output_tokens = json.as_u64(v).or(f.max_output_tokens);
                }
                (Some("cache_salt"), _) => f.cache_salt = Some(v),
                (Some("cache_prompt"), _) => {
                    f.cache_prompt = match json.at(v) {
                        b't' => Some(true),
                        b'f' => Some(false),
                        _ => None,
                    };
                }
                (Some("id_slot" | "slot_id"), _) => f.pinned_slot |= names_a_slot(&json, v),
                // vLLM and SGLang: the prompt is read without the cache
                // (prompt log-probabilities), cut (truncation), or made
                // into other tokens than its text says (a request's own
                // template, special tokens, processor settings).
                (Some("prompt_logprobs" | "truncate_prompt_tokens" | "chat_template"), _)
                | (Some("mm_processor_kwargs"), _) => {
                    f.perturbed |= json.at(v) != b'n';
                }
                (Some("add_special_tokens"), _) => {
                    // Chat templates add their own (default false there);
                    // completions add them by default.
                    let default = if endpoint == Completions { b't' } else { b'f' };
                    f.perturbed |= !matches!(json.at(v), b'n') && json.at(v) != default;
                }
                _ => {}
            }
            json.skip(v, 1)
        })?;
        if json.ws(end) != body.len() {
            return Err(SkipReason::NotJson);
        }
        let model = match f.model {
            Some(v) if json.at(v) == b'"' => {
                let mut m = String::new();
                json.decode(v, |piece| m.push_str(piece))?;
                m
            }
            _ => String::new(),
        };
        if model.is_empty() {
            return Err(SkipReason::NoModel);
        }
        // A salt partitions the cache; turning the cache off or pinning a
        // slot bypasses it (the stronger of the two when both are asked).
        let salted = f.cache_salt.is_some_and(|v| json.at(v) != b'n');
        let cache = if f.cache_prompt == Some(false) || f.pinned_slot || f.perturbed {
            CacheUse::Bypassed
        } else if salted {
            CacheUse::Partitioned
        } else {
            CacheUse::Shared
        };
        Ok(Request {
            json,
            endpoint,
            max_output_tokens: f.max_output_tokens,
            fields: f,
            model,
            cache,
        })
    }

    /// Writes the `cache_salt` of a partitioned request: a string's text,
    /// any other value's canonical JSON.
    pub(crate) fn write_salt(&self, scratch: &mut Scratch, out: &mut impl Sink) -> Res<()> {
        match self.fields.cache_salt {
            Some(v) if self.cache == CacheUse::Partitioned => {
                if self.json.at(v) == b'"' {
                    self.json.decode(v, |piece| out.put(piece.as_bytes()))?;
                } else {
                    self.json.canonical(v, scratch, out)?;
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// Writes the canonical prompt's records.
    pub(crate) fn write(&self, scratch: &mut Scratch, out: &mut impl Sink) -> Res<()> {
        let w = Records {
            json: self.json,
            scratch,
            out,
        };
        match self.endpoint {
            Endpoint::ChatCompletions => w.chat(&self.fields),
            Endpoint::Completions => w.completions(&self.fields),
            Endpoint::Responses => w.responses(&self.fields),
        }
    }
}

/// The fields of one chat message that reach the canonical form.
#[derive(Default)]
struct Message {
    role: Option<usize>,
    content: Option<usize>,
    tool_calls: Option<usize>,
    tool_call_id: Option<usize>,
    name: Option<usize>,
    end: usize,
}

impl Message {
    fn read(json: &Json<'_>, at: usize) -> Res<Message> {
        if json.at(at) != b'{' {
            return Err(SkipReason::BadField);
        }
        let mut m = Message::default();
        m.end = json.members(at, 0, |k, v| {
            match json.short_string(k).as_deref() {
                Some("role") => m.role = Some(v),
                Some("content") => m.content = Some(v),
                Some("tool_calls") => m.tool_calls = Some(v),
                Some("tool_call_id") => m.tool_call_id = Some(v),
                Some("name") => m.name = Some(v),
                _ => {}
            }
            Ok(json.end_of(v).0)
        })?;
        Ok(m)
    }

    fn is_system(&self, json: &Json<'_>) -> bool {
        self.role.is_some_and(|r| {
            json.at(r) == b'"' && (json.string_is(r, "system") || json.string_is(r, "developer"))
        })
    }
}

/// Records of tiny items, gathered before they go to the sink.
struct Batch {
    buf: [u8; BATCH + TINY + 2],
    len: usize,
}

/// A batch's room, in bytes, before it is given to the sink.
const BATCH: usize = 256;
/// Items of this many bytes or more are not gathered.
const TINY: usize = 32;

impl Default for Batch {
    fn default() -> Batch {
        Batch {
            buf: [0; BATCH + TINY + 2],
            len: 0,
        }
    }
}

impl Batch {
    /// Adds the record of `tag` and the `n` bytes (fewer than [`TINY`])
    /// of the body from `at`, giving the batch to `out` first when it is
    /// full.
    #[inline(always)]
    fn take(&mut self, tag: u8, json: &Json<'_>, at: usize, n: usize, out: &mut impl Sink) {
        if self.len > BATCH {
            self.flush(out);
        }
        let len = self.len;
        if let Some(slot) = self.buf.get_mut(len) {
            *slot = tag;
        }
        // A whole window of the body is copied (a fixed size copies
        // fastest) and the record's end written over what follows it.
        let window = json.bytes(at, at + TINY);
        match (
            <&[u8; TINY]>::try_from(window),
            self.buf.get_mut(len + 1..len + 1 + TINY),
        ) {
            (Ok(window), Some(slot)) => slot.copy_from_slice(window),
            (_, Some(slot)) => {
                for (slot, &b) in slot.iter_mut().zip(json.bytes(at, at + n)) {
                    *slot = b;
                }
            }
            _ => {}
        }
        if let Some(slot) = self.buf.get_mut(len + 1 + n) {
            *slot = RECORD_END;
        }
        self.len = len + n + 2;
    }

    fn flush(&mut self, out: &mut impl Sink) {
        if self.len > 0 {
            out.put(self.buf.get(..self.len).unwrap_or_default());
            self.len = 0;
        }
    }
}

/// Writes records into a sink.
struct Records<'j, 's, S> {
    json: Json<'j>,
    scratch: &'s mut Scratch,
    out: &'s mut S,
}

impl<S: Sink> Records<'_, '_, S> {
    /// A record of the string at `at`'s text; returns where the string ends.
    fn text(&mut self, tag: u8, at: usize) -> Res<usize> {
        self.out.put_byte(tag);
        let out = &mut *self.out;
        let end = self.json.decode(at, |piece| out.put(piece.as_bytes()))?;
        self.out.put_byte(RECORD_END);
        Ok(end)
    }

    /// A record of the value at `at`'s canonical JSON; returns where the
    /// value ends.
    fn value(&mut self, tag: u8, at: usize) -> Res<usize> {
        self.out.put_byte(tag);
        let end = match self.json.verbatim_end(at) {
            // Canonical as it stands (a tiny item).
            Some(end) => {
                self.out.put(self.json.bytes(at, end));
                end
            }
            None => self.json.canonical(at, self.scratch, self.out)?,
        };
        self.out.put_byte(RECORD_END);
        Ok(end)
    }

    /// A record per item of the array at `list`, of its canonical JSON.
    /// Tiny items canonical as they stand (`0`, `"x"`, `{}`) are gathered,
    /// records and all, and given to the sink a batch at a time, so an
    /// array of a million of them costs a scan of its bytes and a hash of
    /// the records, not three sink calls an item.
    fn values(&mut self, tag: u8, list: usize) -> Res<()> {
        let json = self.json;
        let mut batch = Batch::default();
        json.items(list, 0, |item| {
            if let Some(end) = json.verbatim_end(item).filter(|&end| end - item < TINY) {
                batch.take(tag, &json, item, end - item, self.out);
                return Ok(end);
            }
            batch.flush(self.out);
            self.value(tag, item)
        })?;
        batch.flush(self.out);
        Ok(())
    }

    /// A JSON-valued field: a record unless absent or null.
    fn optional_value(&mut self, tag: u8, at: Option<usize>) -> Res<()> {
        match at {
            Some(v) if self.json.at(v) != b'n' => self.value(tag, v).map(drop),
            _ => Ok(()),
        }
    }

    /// A string field: a record unless absent or null; any other type is
    /// `BadField`.
    fn optional_text(&mut self, tag: u8, at: Option<usize>) -> Res<()> {
        match at.map(|v| (v, self.json.at(v))) {
            None | Some((_, b'n')) => Ok(()),
            Some((v, b'"')) => self.text(tag, v).map(drop),
            Some(_) => Err(SkipReason::BadField),
        }
    }

    fn chat(mut self, f: &Fields) -> Res<()> {
        let json = self.json;
        let messages = match f.messages.map(|v| (v, json.at(v))) {
            None | Some((_, b'n')) => None,
            Some((v, b'[')) => Some(v),
            Some(_) => return Err(SkipReason::BadField),
        };
        // The leading system messages, then tools, then the rest.
        let mut lead = true;
        if let Some(list) = messages {
            json.items(list, 0, |at| {
                let m = Message::read(&json, at)?;
                if lead && !m.is_system(&json) {
                    lead = false;
                    self.chat_tools(f)?;
                }
                self.message(&m)?;
                Ok(m.end)
            })?;
        }
        if lead {
            self.chat_tools(f)?;
        }
        Ok(())
    }

    fn chat_tools(&mut self, f: &Fields) -> Res<()> {
        self.optional_value(TAG_TOOLS, f.tools)?;
        self.optional_value(TAG_TOOL_CHOICE, f.tool_choice)?;
        self.optional_value(TAG_RESPONSE_FORMAT, f.response_format)
    }

    fn message(&mut self, m: &Message) -> Res<()> {
        let json = self.json;
        match m.role {
            Some(r) if json.at(r) == b'"' => drop(self.text(TAG_MESSAGE, r)?),
            _ => return Err(SkipReason::BadField),
        }
        match m.content.map(|c| (c, json.at(c))) {
            None | Some((_, b'n')) => {}
            Some((c, b'"')) => drop(self.text(TAG_CONTENT, c)?),
            Some((c, b'[')) => {
                // Empty parts (`{}`, their own canonical form) are
                // gathered like tiny values: many of them cost a scan.
                let mut batch = Batch::default();
                json.items(c, 0, |part| {
                    if json.at(part) == b'{' && json.at(part + 1) == b'}' {
                        batch.take(TAG_PART, &json, part, 2, self.out);
                        return Ok(part + 2);
                    }
                    batch.flush(self.out);
                    self.part(part)
                })?;
                batch.flush(self.out);
            }
            Some(_) => return Err(SkipReason::BadField),
        }
        self.optional_value(TAG_TOOL_CALLS, m.tool_calls)?;
        self.optional_text(TAG_TOOL_CALL_ID, m.tool_call_id)?;
        self.optional_text(TAG_NAME, m.name)
    }

    /// One content part: `{"type": "text", "text": <string>}` as its text,
    /// any other object as its canonical JSON. Returns where it ends.
    fn part(&mut self, at: usize) -> Res<usize> {
        let json = self.json;
        if json.at(at) != b'{' {
            return Err(SkipReason::BadField);
        }
        if json.at(at + 1) == b'}' {
            // `{}`: no text.
            return self.value(TAG_PART, at);
        }
        let (mut kind, mut text) = (None, None);
        let end = json.members(at, 0, |k, v| {
            match json.short_string(k).as_deref() {
                Some("type") => kind = Some(v),
                Some("text") => text = Some(v),
                _ => {}
            }
            Ok(json.end_of(v).0)
        })?;
        let is_text = kind.is_some_and(|t| json.at(t) == b'"' && json.string_is(t, "text"));
        match text {
            Some(t) if is_text && json.at(t) == b'"' => drop(self.text(TAG_CONTENT, t)?),
            _ => drop(self.value(TAG_PART, at)?),
        }
        Ok(end)
    }

    fn completions(mut self, f: &Fields) -> Res<()> {
        let json = self.json;
        match f.prompt.map(|p| (p, json.at(p))) {
            None | Some((_, b'n')) => Ok(()),
            Some((p, b'"')) => self.text(TAG_PROMPT, p).map(drop),
            Some((p, b'[')) => {
                // Strings: one record each; numbers and arrays (token ids):
                // one record of the whole array; anything else is wrong.
                let (mut strings, mut ids) = (true, true);
                json.items(p, 0, |item| {
                    let c = json.at(item);
                    strings &= c == b'"';
                    ids &= c == b'[' || c == b'-' || c.is_ascii_digit();
                    Ok(json.end_of(item).0)
                })?;
                if strings {
                    json.items(p, 0, |item| self.text(TAG_PROMPT, item))?;
                    Ok(())
                } else if ids {
                    self.value(TAG_PROMPT_JSON, p).map(drop)
                } else {
                    Err(SkipReason::BadField)
                }
            }
            Some(_) => Err(SkipReason::BadField),
        }
    }

    fn responses(mut self, f: &Fields) -> Res<()> {
        let json = self.json;
        self.optional_text(TAG_INSTRUCTIONS, f.instructions)?;
        self.optional_value(TAG_TOOLS, f.tools)?;
        match f.input.map(|i| (i, json.at(i))) {
            None | Some((_, b'n')) => Ok(()),
            Some((i, b'"')) => self.text(TAG_INPUT, i).map(drop),
            Some((i, b'[')) => self.values(TAG_INPUT_ITEM, i),
            Some(_) => Err(SkipReason::BadField),
        }
    }
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
    fn a_value_of_too_many_keys_is_too_complex_and_an_array_counts_its_items_apart() {
        let keys = |n: usize| {
            (0..n)
                .map(|i| format!(r#""k{i}":0"#))
                .collect::<Vec<_>>()
                .join(",")
        };
        let tool = |n: usize| format!(r#"{{"type":"function","parameters":{{{}}}}}"#, keys(n));
        let body = |tools: &str| {
            format!(
                r#"{{"model":"m","tools":[{tools}],"messages":[{{"role":"user","content":"hi"}}]}}"#
            )
        };
        let chat = |b: String| canon(Endpoint::ChatCompletions, &b);
        assert_eq!(
            chat(body(&tool(crate::json::MAX_KEYS))),
            Err(SkipReason::TooComplex)
        );
        // The same keys over two tools: each is sorted on its own.
        let half = tool(crate::json::MAX_KEYS / 2);
        let two = chat(body(&format!("{half},{half}"))).unwrap();
        assert!(two.len() > 2 * crate::json::MAX_KEYS * 4);
        // A part or an input item is its own value too.
        let part = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":[{}]}}]}}"#,
            tool(crate::json::MAX_KEYS)
        );
        assert_eq!(chat(part), Err(SkipReason::TooComplex));
    }

    #[test]
    fn numbers_are_the_nearest_f64_as_written() {
        // 6e25 is not 6 x (the f64 nearest 1e25); 0.1 is written 1e-1.
        let c = canon(
            Endpoint::ChatCompletions,
            r#"{"model":"m","tools":[6e25,0.1,1e-7,-0.0,2.50],"messages":[{"role":"user","content":"x"}]}"#,
        )
        .unwrap();
        let want = rec(b'T', "[6e25,1e-1,1e-7,-0e0,2.5e0]");
        assert!(c.starts_with(&want), "{}", String::from_utf8_lossy(&c));
        assert_eq!(
            canon(
                Endpoint::ChatCompletions,
                r#"{"model":"m","tools":[1e309],"messages":[{"role":"user","content":"x"}]}"#
            ),
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
            // Spelled as llama.cpp still reads them as a slot.
            r#"{"model":"m","id_slot":1.0,"messages":[{"role":"user","content":"hi"}]}"#,
            r#"{"model":"m","id_slot":true,"messages":[{"role":"user","content":"hi"}]}"#,
            r#"{"model":"m","id_slot":false,"messages":[{"role":"user","content":"hi"}]}"#,
            r#"{"model":"m","id_slot":-0.5,"messages":[{"role":"user","content":"hi"}]}"#,
            r#"{"model":"m","id_slot":1e1,"messages":[{"role":"user","content":"hi"}]}"#,
            // vLLM / SGLang: read without the cache, cut, or other tokens.
            r#"{"model":"m","prompt_logprobs":0,"messages":[{"role":"user","content":"hi"}]}"#,
            r#"{"model":"m","truncate_prompt_tokens":100,"messages":[{"role":"user","content":"hi"}]}"#,
            r#"{"model":"m","chat_template":"{{ messages }}","messages":[{"role":"user","content":"hi"}]}"#,
            r#"{"model":"m","add_special_tokens":true,"messages":[{"role":"user","content":"hi"}]}"#,
            r#"{"model":"m","mm_processor_kwargs":{},"messages":[{"role":"user","content":"hi"}]}"#,
        ] {
            let f = fp(body);
            assert_eq!(f.cache, CacheUse::Bypassed, "{body}");
            assert_eq!(f.hashes, plain.hashes, "{body}");
        }
        for body in [
            r#"{"model":"m","cache_prompt":true,"messages":[{"role":"user","content":"hi"}]}"#,
            r#"{"model":"m","id_slot":-1,"messages":[{"role":"user","content":"hi"}]}"#,
            r#"{"model":"m","cache_salt":null,"messages":[{"role":"user","content":"hi"}]}"#,
            // What llama.cpp and vLLM read as their defaults.
            r#"{"model":"m","id_slot":-1.5,"messages":[{"role":"user","content":"hi"}]}"#,
            r#"{"model":"m","id_slot":"1","messages":[{"role":"user","content":"hi"}]}"#,
            r#"{"model":"m","id_slot":null,"messages":[{"role":"user","content":"hi"}]}"#,
            r#"{"model":"m","cache_prompt":0,"messages":[{"role":"user","content":"hi"}]}"#,
            r#"{"model":"m","prompt_logprobs":null,"messages":[{"role":"user","content":"hi"}]}"#,
            r#"{"model":"m","add_special_tokens":false,"messages":[{"role":"user","content":"hi"}]}"#,
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

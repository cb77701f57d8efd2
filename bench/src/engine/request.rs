//! Parsing an OpenAI request into what the simulator needs, and rendering its
//! prompt the way an engine's chat template would.
//!
//! Rendering is append-only: when conversation A's messages are a prefix of
//! B's, `render(A)` is a byte prefix of `render(B)`, so the next turn of a
//! conversation finds the previous turn's blocks in the cache (including the
//! generation prompt `<|assistant|>`, which the next turn's assistant message
//! starts with).

use serde_json::Value;

/// Largest accepted `max_tokens`; a bound so hostile input cannot ask for an
/// unbounded response.
pub const MAX_OUTPUT_TOKENS: usize = 1 << 20;

/// Which OpenAI endpoint a request came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApiKind {
    /// `POST /v1/chat/completions`
    Chat,
    /// `POST /v1/completions`
    Completions,
}

/// The parts of an OpenAI request the simulator acts on.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationRequest {
    /// Endpoint the request came in on.
    pub kind: ApiKind,
    /// `model`, if given.
    pub model: Option<String>,
    /// The rendered prompt (the bytes the prefix cache sees).
    pub prompt: Vec<u8>,
    /// `max_completion_tokens` or `max_tokens`, if given.
    pub max_tokens: Option<usize>,
    /// `stream`.
    pub stream: bool,
    /// A top-level integer `priority` (the place in the queue vLLM's and
    /// SGLang's priority scheduling read), if given. Recorded, not
    /// scheduled by.
    pub priority: Option<i64>,
    /// `logit_bias` forces the simulated model's end-of-sequence token
    /// ([`EOS_TOKEN`] biased by 100 or more): it ends at once, having
    /// generated nothing, as a real model does.
    pub forces_end: bool,
}

/// The simulated model's end-of-sequence token id (SmolLM2's, so the same
/// request forces an empty answer from the simulator and a real
/// `llama-server` serving it).
pub const EOS_TOKEN: &str = "2";

/// Why a request body was refused (becomes a 400 `invalid_request_error`).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RequestError {
    /// The body is not JSON.
    #[error("request body is not valid JSON: {0}")]
    Json(String),
    /// The body is JSON but not an object.
    #[error("request body must be a JSON object")]
    NotObject,
    /// A field is missing or has the wrong type.
    #[error("invalid field `{field}`: {reason}")]
    Field {
        /// The offending field.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
}

fn field_err(field: &'static str, reason: impl Into<String>) -> RequestError {
    RequestError::Field {
        field,
        reason: reason.into(),
    }
}

/// Parse and render an OpenAI request body.
pub fn parse(kind: ApiKind, body: &[u8]) -> Result<GenerationRequest, RequestError> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| RequestError::Json(e.to_string()))?;
    let obj = value.as_object().ok_or(RequestError::NotObject)?;

    let model = match obj.get("model") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => return Err(field_err("model", "must be a string")),
    };
    let stream = match obj.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(field_err("stream", "must be a boolean")),
    };
    let max_tokens = match (obj.get("max_completion_tokens"), obj.get("max_tokens")) {
        (Some(v), _) if !v.is_null() => Some(parse_max_tokens("max_completion_tokens", v)?),
        (_, Some(v)) if !v.is_null() => Some(parse_max_tokens("max_tokens", v)?),
        _ => None,
    };
    let forces_end = obj
        .get("logit_bias")
        .and_then(|b| b.get(EOS_TOKEN))
        .and_then(Value::as_f64)
        .is_some_and(|bias| bias >= 100.0);
    let prompt = match kind {
        ApiKind::Chat => {
            let messages = obj
                .get("messages")
                .and_then(Value::as_array)
                .ok_or_else(|| field_err("messages", "must be an array of messages"))?;
            render_chat(messages, obj.get("tools"))?
        }
        ApiKind::Completions => render_completion_prompt(
            obj.get("prompt")
                .ok_or_else(|| field_err("prompt", "is required"))?,
        )?,
    };
    let priority = obj.get("priority").and_then(Value::as_i64);
    Ok(GenerationRequest {
        kind,
        model,
        prompt,
        max_tokens,
        stream,
        priority,
        forces_end,
    })
}

fn parse_max_tokens(field: &'static str, v: &Value) -> Result<usize, RequestError> {
    let n = v
        .as_u64()
        .ok_or_else(|| field_err(field, "must be a non-negative integer"))?;
    usize::try_from(n)
        .ok()
        .filter(|n| *n <= MAX_OUTPUT_TOKENS)
        .ok_or_else(|| field_err(field, format!("must be at most {MAX_OUTPUT_TOKENS}")))
}

/// Render chat messages: leading system/developer messages, then the tools,
/// then every other message; each message is `<|role|>` + content text +
/// tool calls (JSON) + tool call id + `\n`. Ends with the generation prompt.
pub fn render_chat(messages: &[Value], tools: Option<&Value>) -> Result<Vec<u8>, RequestError> {
    let mut out = Vec::new();
    let leading = messages
        .iter()
        .take_while(|m| {
            matches!(
                m.get("role").and_then(Value::as_str),
                Some("system" | "developer")
            )
        })
        .count();
    for m in &messages[..leading] {
        render_message(&mut out, m)?;
    }
    if let Some(tools @ Value::Array(list)) = tools {
        if !list.is_empty() {
            out.extend_from_slice(b"<|tools|>");
            out.extend_from_slice(tools.to_string().as_bytes());
            out.push(b'\n');
        }
    }
    for m in &messages[leading..] {
        render_message(&mut out, m)?;
    }
    out.extend_from_slice(b"<|assistant|>");
    Ok(out)
}

fn render_message(out: &mut Vec<u8>, m: &Value) -> Result<(), RequestError> {
    let role = m
        .get("role")
        .and_then(Value::as_str)
        .ok_or_else(|| field_err("messages", "every message needs a string `role`"))?;
    out.extend_from_slice(b"<|");
    out.extend_from_slice(role.as_bytes());
    out.extend_from_slice(b"|>");
    match m.get("content") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => out.extend_from_slice(s.as_bytes()),
        Some(Value::Array(parts)) => {
            for part in parts {
                match part.get("text").and_then(Value::as_str) {
                    Some(text) => out.extend_from_slice(text.as_bytes()),
                    // Images and other parts enter the prompt as given.
                    None => out.extend_from_slice(part.to_string().as_bytes()),
                }
            }
        }
        Some(_) => {
            return Err(field_err(
                "messages",
                "`content` must be a string, an array of parts or null",
            ))
        }
    }
    if let Some(calls) = m.get("tool_calls").filter(|v| !v.is_null()) {
        out.extend_from_slice(calls.to_string().as_bytes());
    }
    if let Some(id) = m.get("tool_call_id").and_then(Value::as_str) {
        out.extend_from_slice(id.as_bytes());
    }
    out.push(b'\n');
    Ok(())
}

/// Render a completions `prompt`: a string as is; an array of strings or
/// token ids concatenated (the simulator treats a batch as one prompt).
pub fn render_completion_prompt(prompt: &Value) -> Result<Vec<u8>, RequestError> {
    match prompt {
        Value::String(s) => Ok(s.as_bytes().to_vec()),
        Value::Array(items) => {
            let mut out = Vec::new();
            for item in items {
                match item {
                    Value::String(s) => out.extend_from_slice(s.as_bytes()),
                    other => out.extend_from_slice(other.to_string().as_bytes()),
                }
            }
            Ok(out)
        }
        _ => Err(field_err("prompt", "must be a string or an array")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn chat(body: Value) -> GenerationRequest {
        parse(ApiKind::Chat, body.to_string().as_bytes()).unwrap()
    }

    #[test]
    fn next_turn_renders_as_byte_extension() {
        let tools = json!([{"type": "function", "function": {"name": "ls"}}]);
        let turn1 = json!({
            "model": "m",
            "messages": [
                {"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": [{"type": "text", "text": "list files"}]}
            ],
            "tools": tools,
        });
        let turn2 = json!({
            "model": "m",
            "stream": true,
            "max_tokens": 5,
            "messages": [
                {"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": [{"type": "text", "text": "list files"}]},
                {"role": "assistant", "content": null,
                 "tool_calls": [{"id": "c1", "type": "function",
                                 "function": {"name": "ls", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "a.rs b.rs"}
            ],
            "tools": tools,
        });
        let a = chat(turn1);
        let b = chat(turn2);
        assert!(b.prompt.starts_with(&a.prompt));
        assert!(b.prompt.len() > a.prompt.len());
        assert!(b.stream);
        assert_eq!(b.max_tokens, Some(5));
        let text = String::from_utf8(a.prompt).unwrap();
        assert!(text.starts_with("<|system|>You are a coding agent.\n<|tools|>"));
        assert!(text.ends_with("<|user|>list files\n<|assistant|>"));
    }

    #[test]
    fn per_turn_fields_do_not_change_the_prompt() {
        let a = chat(json!({"messages": [{"role": "user", "content": "hi"}], "temperature": 0.1}));
        let b = chat(
            json!({"messages": [{"role": "user", "content": "hi"}], "user": "x",
                            "max_completion_tokens": 3, "max_tokens": 9}),
        );
        assert_eq!(a.prompt, b.prompt);
        assert_eq!(b.max_tokens, Some(3));
    }

    #[test]
    fn completions_prompt_is_taken_as_is() {
        let r = parse(ApiKind::Completions, br#"{"prompt":"abc","model":"m"}"#).unwrap();
        assert_eq!(r.prompt, b"abc");
        assert_eq!(r.model.as_deref(), Some("m"));
        let r = parse(ApiKind::Completions, br#"{"prompt":["ab","c"]}"#).unwrap();
        assert_eq!(r.prompt, b"abc");
    }

    #[test]
    fn bad_requests_are_refused() {
        assert!(matches!(
            parse(ApiKind::Chat, b"{nope"),
            Err(RequestError::Json(_))
        ));
        assert_eq!(parse(ApiKind::Chat, b"[1]"), Err(RequestError::NotObject));
        assert!(parse(ApiKind::Chat, br#"{"messages": "hi"}"#).is_err());
        assert!(parse(ApiKind::Chat, br#"{"messages": [{"content": "x"}]}"#).is_err());
        assert!(parse(ApiKind::Completions, br#"{"model": "m"}"#).is_err());
        assert!(parse(
            ApiKind::Completions,
            br#"{"prompt": "a", "max_tokens": -1}"#
        )
        .is_err());
        assert!(parse(
            ApiKind::Completions,
            br#"{"prompt": "a", "max_tokens": 1e30}"#
        )
        .is_err());
        assert!(parse(ApiKind::Completions, br#"{"prompt": "a", "stream": "yes"}"#).is_err());
        let huge = format!(
            r#"{{"prompt": "a", "max_tokens": {}}}"#,
            MAX_OUTPUT_TOKENS + 1
        );
        assert!(parse(ApiKind::Completions, huge.as_bytes()).is_err());
    }
}

//! Agent-style conversations as OpenAI chat request bodies: a shared
//! harness prompt (system + tools), then a history that grows every turn.
//! Used by the demo and the end-to-end tests; the benchmark's workloads
//! build on it.

use serde_json::{json, Value};

/// Deterministic filler text of `bytes` bytes, different for each `seed`.
pub fn filler(seed: u64, bytes: usize) -> String {
    const WORDS: [&str; 16] = [
        "cache", "replica", "prefix", "token", "stream", "engine", "route", "block", "warm",
        "load", "agent", "turn", "tool", "patch", "test", "build",
    ];
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = String::with_capacity(bytes + 16);
    while out.len() < bytes {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        out.push_str(WORDS[(state % 16) as usize]);
        out.push(if state.is_multiple_of(11) { '\n' } else { ' ' });
    }
    out.truncate(bytes);
    out
}

/// The tool definitions a coding agent sends with every turn.
pub fn agent_tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "read_file", "description": "Read a file from the repository",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
        {"type": "function", "function": {"name": "run_tests", "description": "Run the test suite",
            "parameters": {"type": "object", "properties": {"filter": {"type": "string"}}}}}
    ])
}

/// One conversation that is re-sent whole every turn.
#[derive(Clone, Debug)]
pub struct Conversation {
    pub model: String,
    pub messages: Vec<Value>,
    pub tools: Option<Value>,
    turn: u64,
    seed: u64,
}

impl Conversation {
    /// A conversation whose system prompt is `system` (shared between
    /// sessions when the same text is passed).
    pub fn new(model: &str, system: &str, with_tools: bool, seed: u64) -> Self {
        Conversation {
            model: model.to_string(),
            messages: vec![json!({"role": "system", "content": system})],
            tools: with_tools.then(agent_tools),
            turn: 0,
            seed,
        }
    }

    /// Adds the next user message (`user_bytes` of fresh text) and returns
    /// the request body for this turn.
    pub fn next_turn(&mut self, user_bytes: usize, stream: bool) -> Value {
        self.turn += 1;
        let text = format!(
            "session {} turn {}: {}",
            self.seed,
            self.turn,
            filler(
                self.seed.wrapping_mul(1000).wrapping_add(self.turn),
                user_bytes
            )
        );
        self.messages.push(json!({"role": "user", "content": text}));
        self.body(stream)
    }

    /// The body for the current history.
    pub fn body(&self, stream: bool) -> Value {
        let mut body = json!({
            "model": self.model,
            "messages": self.messages,
            "max_tokens": 16,
            "temperature": 0.2,
            "stream": stream,
        });
        if let Some(tools) = &self.tools {
            body["tools"] = tools.clone();
        }
        body
    }

    /// Appends the assistant's reply, as an agent would before its next turn.
    pub fn push_assistant(&mut self, text: &str) {
        self.messages
            .push(json!({"role": "assistant", "content": text}));
    }

    /// Appends a tool call and its result (agent traffic carries both).
    pub fn push_tool_round(&mut self, result_bytes: usize) {
        let id = format!("call_{}_{}", self.seed, self.turn);
        self.messages.push(json!({"role": "assistant", "content": null, "tool_calls": [
            {"id": id, "type": "function", "function": {"name": "read_file", "arguments": "{\"path\":\"src/lib.rs\"}"}}
        ]}));
        self.messages
            .push(json!({"role": "tool", "tool_call_id": id,
            "content": filler(self.seed * 7919 + self.turn, result_bytes)}));
    }
}

/// The assistant text of a non-streaming chat completion.
pub fn reply_text(response: &Value) -> String {
    response["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// `usage.prompt_tokens_details.cached_tokens` and `usage.prompt_tokens`.
pub fn cached_and_prompt_tokens(response: &Value) -> (u64, u64) {
    let usage = &response["usage"];
    (
        usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0),
        usage["prompt_tokens"].as_u64().unwrap_or(0),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filler_is_deterministic_and_sized() {
        assert_eq!(filler(3, 500), filler(3, 500));
        assert_ne!(filler(3, 500), filler(4, 500));
        assert_eq!(filler(9, 777).len(), 777);
    }

    #[test]
    fn turns_extend_the_history() {
        let mut c = Conversation::new("m", "sys", true, 1);
        let first = c.next_turn(100, false);
        c.push_assistant("ok");
        c.push_tool_round(50);
        let second = c.next_turn(100, false);
        let a = first["messages"].as_array().unwrap();
        let b = second["messages"].as_array().unwrap();
        assert_eq!(&b[..a.len()], &a[..]);
        assert_eq!(b.len(), a.len() + 4);
        assert!(second["tools"].is_array());
    }
}

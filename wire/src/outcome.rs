//! What a generation's response body says about the replica that produced
//! it, found by scanning the body as it streams past (no buffering, no JSON
//! parse). The wasm filter's outcome role runs it and reports to the
//! sidecar; the sidecar runs it itself on the response bodies ext_proc
//! sends it where no wasm filter is installed (body and endpoint-picker
//! modes).
//!
//! A 200 answer *generated* (reported as `text=1`) when some `"content"`,
//! `"text"`, `"reasoning_content"`, `"reasoning"` or `"arguments"` string
//! is non-empty, its usage counts at least one `"completion_tokens"`, or it
//! finished for reaching its token limit (`"finish_reason": "length"`): a
//! reasoning model's first tokens are not visible text. It *ended* when it
//! shows `[DONE]`, a `"finish_reason"` string or a `"usage"` object.
//! The wasm filter sends the verdict to the sidecar in an asynchronous
//! `POST /outcome` on its state endpoint: `upstream=IP:PORT;text=0|1;done=0|1`. (A response
//! trailer would be cheaper, but Envoy 1.40 does not let a wasm filter add
//! trailers to a response that has a content-length.)

use std::fmt;

/// Where the sidecar takes outcome reports.
pub const REPORT_PATH: &str = "/outcome";

/// What a 200 answer's body showed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Answer {
    /// The engine generated (see the module's notes).
    pub text: bool,
    /// The answer ended properly: `[DONE]` for a stream, `finish_reason`
    /// or `usage` for a JSON body.
    pub done: bool,
}

impl Answer {
    /// Parses `text=0|1;done=0|1` (other `key=value` fields are ignored;
    /// both of these are required).
    pub fn parse(value: &str) -> Option<Answer> {
        let mut a = Answer::default();
        let mut seen = 0;
        for part in value.split(';') {
            let (k, v) = part.trim().split_once('=')?;
            let slot = match k {
                "text" => &mut a.text,
                "done" => &mut a.done,
                // Fields added later are not this reader's business.
                _ => continue,
            };
            *slot = match v {
                "1" => true,
                "0" => false,
                _ => return None,
            };
            seen += 1;
        }
        (seen == 2).then_some(a)
    }
}

impl fmt::Display for Answer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "text={};done={}",
            u8::from(self.text),
            u8::from(self.done)
        )
    }
}

/// One outcome report: the replica that answered (`IP:PORT`, as Envoy's
/// upstream host) and what its answer showed. On the wire:
/// `upstream=IP:PORT;text=0|1;done=0|1`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Report {
    pub upstream: String,
    pub answer: Answer,
}

impl Report {
    /// Parses a report body; `None` when the upstream or either verdict
    /// field is missing or malformed.
    pub fn parse(body: &str) -> Option<Report> {
        let upstream = body
            .split(';')
            .find_map(|f| f.trim().strip_prefix("upstream="))
            .filter(|u| !u.is_empty())?;
        Some(Report {
            upstream: upstream.to_string(),
            answer: Answer::parse(body)?,
        })
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "upstream={};{}", self.upstream, self.answer)
    }
}

/// The report for the replica at `upstream`.
pub fn report_body(upstream: &str, scanner: &Scanner) -> String {
    Report {
        upstream: upstream.to_string(),
        answer: scanner.answer(),
    }
    .to_string()
}

/// Keys whose non-empty string value is generated text.
const TEXT_KEYS: [&[u8]; 5] = [
    b"\"content\"",
    b"\"text\"",
    b"\"reasoning_content\"",
    b"\"reasoning\"",
    b"\"arguments\"",
];
/// Bytes kept from one chunk to the next so a pattern split across chunks
/// is still found (longer than every pattern plus its separators).
const CARRY: usize = 64;

/// Scans a response body chunk by chunk.
#[derive(Clone, Debug, Default)]
pub struct Scanner {
    text: bool,
    done: bool,
    carry: Vec<u8>,
}

impl Scanner {
    pub fn feed(&mut self, chunk: &[u8]) {
        if self.text && self.done {
            return;
        }
        let mut window = std::mem::take(&mut self.carry);
        window.extend_from_slice(chunk);
        if !self.text {
            self.text = TEXT_KEYS.iter().any(|k| has_nonempty_string(&window, k))
                || has_positive_count(&window, b"\"completion_tokens\"")
                || has_string(&window, b"\"finish_reason\"", b"\"length\"");
        }
        if !self.done {
            self.done = find(&window, b"[DONE]").is_some()
                || has_nonempty_string(&window, b"\"finish_reason\"")
                || value_starts_with(&window, b"\"usage\"", b'{');
        }
        let keep = window.len().min(CARRY);
        self.carry = window.split_off(window.len() - keep);
    }

    pub fn text(&self) -> bool {
        self.text
    }

    pub fn done(&self) -> bool {
        self.done
    }

    /// The verdict so far.
    pub fn answer(&self) -> Answer {
        Answer {
            text: self.text,
            done: self.done,
        }
    }

    /// The verdict as the report writes it.
    pub fn verdict(&self) -> String {
        self.answer().to_string()
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Every position where `key` is followed by `:` and the value's first byte.
fn values_after<'a>(hay: &'a [u8], key: &'a [u8]) -> impl Iterator<Item = &'a [u8]> + 'a {
    let mut from = 0;
    std::iter::from_fn(move || {
        while from < hay.len() {
            let at = from + find(&hay[from..], key)?;
            from = at + key.len();
            let rest = skip_ws(&hay[from..]);
            if let Some(after_colon) = rest.strip_prefix(b":") {
                return Some(skip_ws(after_colon));
            }
        }
        None
    })
}

fn skip_ws(b: &[u8]) -> &[u8] {
    let n = b.iter().take_while(|c| c.is_ascii_whitespace()).count();
    &b[n..]
}

/// `key` has a string value with at least one character.
fn has_nonempty_string(hay: &[u8], key: &[u8]) -> bool {
    values_after(hay, key).any(|v| v.len() >= 2 && v[0] == b'"' && v[1] != b'"')
}

/// `key` has a number value above zero.
fn has_positive_count(hay: &[u8], key: &[u8]) -> bool {
    values_after(hay, key).any(|v| {
        let digits: Vec<u8> = v.iter().copied().take_while(u8::is_ascii_digit).collect();
        // A value cut at the chunk's end is judged with the next chunk.
        digits.len() < v.len() && digits.iter().any(|&d| d != b'0')
    })
}

/// `key` has exactly the string value `value` (quotes included).
fn has_string(hay: &[u8], key: &[u8], value: &[u8]) -> bool {
    values_after(hay, key).any(|v| v.starts_with(value))
}

fn value_starts_with(hay: &[u8], key: &[u8], first: u8) -> bool {
    values_after(hay, key).any(|v| v.first() == Some(&first))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan(chunks: &[&str]) -> Scanner {
        let mut s = Scanner::default();
        for c in chunks {
            s.feed(c.as_bytes());
        }
        s
    }

    #[test]
    fn a_streamed_chat_answer_has_text_and_ends() {
        let s = scan(&[
            "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"content\":\"Hel\"}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n",
        ]);
        assert!(s.text() && s.done());
        assert_eq!(s.verdict(), "text=1;done=1");
    }

    #[test]
    fn empty_content_is_no_text() {
        let s = scan(&["{\"choices\":[{\"message\":{\"content\":\"\"},\"finish_reason\":\"stop\"}],\"usage\":{\"completion_tokens\":0}}"]);
        assert!(!s.text());
        assert!(s.done());
        let s = scan(&["{\"choices\":[{\"message\":{\"content\": null}}]}"]);
        assert!(!s.text() && !s.done());
    }

    #[test]
    fn tool_calls_and_reasoning_count_as_text() {
        let s = scan(&["{\"message\":{\"content\":null,\"tool_calls\":[{\"function\":{\"name\":\"f\",\"arguments\":\"{}\"}}]}}"]);
        assert!(s.text());
        let s = scan(&["data: {\"delta\":{\"reasoning_content\":\"hmm\"}}"]);
        assert!(s.text());
        // A key that merely ends in `content` is not `content`.
        let s = scan(&["{\"x_content\":\"a\"}"]);
        assert!(!s.text());
    }

    #[test]
    fn a_reasoning_model_that_generated_only_hidden_tokens_generated() {
        // One token, spent on reasoning the engine did not show.
        let s = scan(&[
            "{\"choices\":[{\"message\":{\"content\":\"\"},\"finish_reason\":\"length\"}]}",
        ]);
        assert!(s.text() && s.done());
        let s = scan(&[
            "data: {\"choices\":[{\"delta\":{\"content\":\"\"},\"finish_reason\":\"stop\"}],",
            "\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":12}}\n\ndata: [DONE]\n\n",
        ]);
        assert!(s.text() && s.done());
        let s = scan(&["data: {\"delta\":{\"reasoning\":\"so\"}}"]);
        assert!(s.text());
        // A count cut at the chunk's end waits for its next digits.
        let s = scan(&["{\"usage\":{\"completion_tokens\":1", "2}}"]);
        assert!(s.text());
        let s = scan(&["{\"usage\":{\"completion_tokens\":0", "}}"]);
        assert!(!s.text());
    }

    #[test]
    fn patterns_split_across_chunks_are_found() {
        let s = scan(&[
            "data: {\"choices\":[{\"delta\":{\"cont",
            "ent\" :  \"x\"}}]}\n\ndata: [DO",
            "NE]\n\n",
        ]);
        assert!(s.text() && s.done());
    }

    #[test]
    fn the_report_names_the_replica_and_the_verdict() {
        let s = scan(&["{\"choices\":[{\"text\":\"x\",\"finish_reason\":\"stop\"}]}"]);
        assert_eq!(
            report_body("127.0.0.1:8000", &s),
            "upstream=127.0.0.1:8000;text=1;done=1"
        );
    }

    #[test]
    fn a_stream_that_stops_early_did_not_end() {
        let s = scan(&["data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n"]);
        assert_eq!(s.verdict(), "text=1;done=0");
    }

    proptest::proptest! {
        #[test]
        fn never_panics_and_chunking_does_not_matter(body in ".{0,300}", cut in 0usize..300) {
            let cut = cut.min(body.len());
            let cut = (0..=cut).rev().find(|c| body.is_char_boundary(*c)).unwrap_or(0);
            let whole = scan(&[&body]);
            let split = scan(&[&body[..cut], &body[cut..]]);
            proptest::prop_assert_eq!(whole.verdict(), split.verdict());
        }
    }
}

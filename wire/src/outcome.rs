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
//!
//! The scan also reads the answer's `usage`, when the engine sent one:
//! `"prompt_tokens"` and `"prompt_tokens_details": {"cached_tokens"}` (the
//! last value of each; a streamed answer carries usage in its final chunk
//! when the client asked for it). The sidecar compares the cached tokens
//! with what it predicted.
//!
//! The wasm filter hands the verdict to the sidecar one of two ways:
//!
//! - a streamed answer (no content-length), where the filter is set up for
//!   it (`trailer_reports`): as the response trailer [`TRAILER`],
//!   `text=0|1;done=0|1[;prompt=N;cached=N]`, which reaches the sidecar on
//!   the request's own ext_proc stream (the gateway asks for response
//!   trailers) and which the sidecar removes;
//! - an answer with a content-length (Envoy 1.40 does not let a wasm filter
//!   add trailers to one), or one without the sidecar's ticket: an
//!   asynchronous `POST /outcome` on the sidecar's state endpoint,
//!   `upstream=IP:PORT;text=0|1;done=0|1[;prompt=N;cached=N][;id=REQUEST-ID]`.
//!
//! A streamed answer's first chunk (the engine has read the prompt) is
//! posted to [`FIRST_TOKEN_PATH`]; with `trailer_reports`, only for the
//! requests the sidecar marks with [`FIRST_CHUNK_HEADER`] (those with
//! enough of the prompt left to read for it to matter).

use std::fmt;

/// Where the sidecar takes outcome reports.
pub const REPORT_PATH: &str = "/outcome";

/// The response trailer that carries a streamed answer's verdict to the
/// sidecar on its ext_proc stream ([`trailer_value`]); the sidecar removes
/// it, and the outcome filter removes one an engine sent.
pub const TRAILER: &str = "x-hearth-outcome";

/// The dynamic metadata namespace, and its key, that the sidecar sets with
/// its answer to a generation's response headers on the ext_proc stream
/// (the gateway's ext_proc filter must list the namespace among its
/// `receiving_namespaces`). Once it is set, ext_proc is past its
/// response-headers exchange and hands the sidecar the response's
/// trailers; a trailer added while that exchange is under way goes to the
/// client without ext_proc seeing it (Envoy 1.40), so the outcome filter
/// adds [`TRAILER`] only where it finds this key, and posts otherwise.
pub const METADATA_NAMESPACE: &str = "hearth";
/// The key of [`METADATA_NAMESPACE`] that says so (`true`).
pub const TRAILERS_TAKEN_KEY: &str = "trailers_taken";

/// The request header with which the sidecar asks the outcome filter to
/// report the answer's first chunk. The filter removes it, so it never
/// reaches the engine; a client's is stripped before the sidecar sees the
/// request, as every `x-hearth-*` header is.
pub const FIRST_CHUNK_HEADER: &str = "x-hearth-first-chunk";

/// The [`TRAILER`] value for what `scanner` saw:
/// `text=0|1;done=0|1[;prompt=N;cached=N]`.
pub fn trailer_value(scanner: &Scanner) -> String {
    let mut v = scanner.verdict();
    if let Some(u) = scanner.usage() {
        v.push_str(&format!(
            ";prompt={};cached={}",
            u.prompt_tokens, u.cached_tokens
        ));
    }
    v
}

/// Reads a [`TRAILER`] value: the verdict and, when both counts are there
/// and agree, the usage. `None` when the verdict is missing or malformed,
/// or the usage is half there or contradicts itself.
pub fn parse_trailer(value: &str) -> Option<(Answer, Option<Usage>)> {
    Some((Answer::parse(value)?, parse_usage(value)?))
}

/// The value of the `name=` field of a `;`-separated report or trailer.
fn field<'a>(body: &'a str, name: &str) -> Option<&'a str> {
    body.split(';')
        .find_map(|f| f.trim().strip_prefix(name)?.strip_prefix('='))
}

/// The `prompt` and `cached` fields of a report or trailer: `Some(None)`
/// when neither is there, `None` when only one is, either is no number, or
/// `cached` exceeds `prompt`.
fn parse_usage(body: &str) -> Option<Option<Usage>> {
    let number = |v: &str| {
        (!v.is_empty() && v.len() <= 19 && v.bytes().all(|b| b.is_ascii_digit()))
            .then(|| v.parse::<u64>().ok())
            .flatten()
    };
    match (field(body, "prompt"), field(body, "cached")) {
        (None, None) => Some(None),
        (Some(p), Some(c)) => {
            let u = Usage {
                prompt_tokens: number(p)?,
                cached_tokens: number(c)?,
            };
            (u.cached_tokens <= u.prompt_tokens).then_some(Some(u))
        }
        _ => None,
    }
}

/// Where the sidecar hears that a streamed answer's first chunk went by
/// (the engine has read the prompt): `POST` with the body `id=TICKET`.
/// Sent once per streamed generation, before its outcome report.
pub const FIRST_TOKEN_PATH: &str = "/outcome/first-token";

/// The body of a first-token report for the request named `ticket`
/// (`None` when the ticket is not fit for a report).
pub fn first_token_body(ticket: &str) -> Option<String> {
    report_id(ticket).map(|t| format!("id={t}"))
}

/// The ticket a first-token report names; `None` for any other body.
pub fn parse_first_token(body: &str) -> Option<&str> {
    report_id(body.trim().strip_prefix("id=")?)
}

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

/// What an answer's `usage` said about its prompt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Usage {
    /// `usage.prompt_tokens`.
    pub prompt_tokens: u64,
    /// `usage.prompt_tokens_details.cached_tokens`: prompt tokens the engine
    /// read from its cache.
    pub cached_tokens: u64,
}

/// The longest request id a report carries (Envoy's are 36 characters).
pub const MAX_REQUEST_ID: usize = 128;

/// A request id fit for a report: non-empty, at most [`MAX_REQUEST_ID`]
/// characters, none of them a separator, a space or a control character.
pub fn report_id(id: &str) -> Option<&str> {
    let fits = !id.is_empty()
        && id.len() <= MAX_REQUEST_ID
        && id
            .bytes()
            .all(|b| b.is_ascii_graphic() && b != b';' && b != b'=');
    fits.then_some(id)
}

/// One outcome report: the replica that answered (`IP:PORT`, as Envoy's
/// upstream host), what its answer showed, its usage when it had one, and
/// the request's id (Envoy's `x-request-id`) when known. On the wire:
/// `upstream=IP:PORT;text=0|1;done=0|1[;prompt=N;cached=N][;id=ID]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Report {
    pub upstream: String,
    pub answer: Answer,
    pub usage: Option<Usage>,
    pub request_id: Option<String>,
}

impl Report {
    /// Parses a report body; `None` when the upstream or either verdict
    /// field is missing or malformed, when only one of `prompt` and
    /// `cached` is present, when either is not a number or `cached`
    /// exceeds `prompt`, or when the id is not fit for a report.
    pub fn parse(body: &str) -> Option<Report> {
        let upstream = field(body, "upstream").filter(|u| !u.is_empty())?;
        let usage = parse_usage(body)?;
        let request_id = match field(body, "id") {
            None => None,
            Some(id) => Some(report_id(id)?.to_string()),
        };
        Some(Report {
            upstream: upstream.to_string(),
            answer: Answer::parse(body)?,
            usage,
            request_id,
        })
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "upstream={};{}", self.upstream, self.answer)?;
        if let Some(u) = self.usage {
            write!(f, ";prompt={};cached={}", u.prompt_tokens, u.cached_tokens)?;
        }
        if let Some(id) = &self.request_id {
            write!(f, ";id={id}")?;
        }
        Ok(())
    }
}

/// The report for the replica at `upstream`, for the request `request_id`
/// (dropped when not fit for a report).
pub fn report_body(upstream: &str, request_id: Option<&str>, scanner: &Scanner) -> String {
    Report {
        upstream: upstream.to_string(),
        answer: scanner.answer(),
        usage: scanner.usage(),
        request_id: request_id.and_then(report_id).map(str::to_string),
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
    prompt_tokens: Option<u64>,
    cached_tokens: Option<u64>,
    /// The last [`CARRY`] bytes fed; while a chunk is scanned, that chunk
    /// follows them (one allocation, kept from chunk to chunk).
    carry: Vec<u8>,
}

impl Scanner {
    pub fn feed(&mut self, chunk: &[u8]) {
        self.carry.extend_from_slice(chunk);
        let window = &self.carry[..];
        // Usage comes last in an answer; the last value seen wins (an
        // engine that reports usage in every chunk counts up).
        if let Some(n) = last_count(window, b"\"prompt_tokens\"") {
            self.prompt_tokens = Some(n);
        }
        if let Some(n) = last_count(window, b"\"cached_tokens\"") {
            self.cached_tokens = Some(n);
        }
        if !self.text {
            self.text = TEXT_KEYS.iter().any(|k| has_nonempty_string(window, k))
                || has_positive_count(window, b"\"completion_tokens\"")
                || has_string(window, b"\"finish_reason\"", b"\"length\"");
        }
        if !self.done {
            self.done = find(window, b"[DONE]").is_some()
                || has_nonempty_string(window, b"\"finish_reason\"")
                || value_starts_with(window, b"\"usage\"", b'{');
        }
        let cut = window.len().saturating_sub(CARRY);
        self.carry.drain(..cut);
    }

    pub fn text(&self) -> bool {
        self.text
    }

    pub fn done(&self) -> bool {
        self.done
    }

    /// The answer's usage: prompt tokens and the cached ones among them.
    /// `None` unless both were seen (an engine that does not report cached
    /// tokens says nothing about its cache) or when they contradict.
    pub fn usage(&self) -> Option<Usage> {
        let u = Usage {
            prompt_tokens: self.prompt_tokens?,
            cached_tokens: self.cached_tokens?,
        };
        (u.cached_tokens <= u.prompt_tokens).then_some(u)
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

/// Where `needle` first occurs in `hay`. Runs for every chunk of every
/// streamed answer, so it looks for the needle's first byte and compares
/// the rest only there (`benches/outcome_scan.rs`).
fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    let Some((&first, rest)) = needle.split_first() else {
        return Some(0);
    };
    let last_start = hay.len().checked_sub(needle.len())?;
    let mut at = 0;
    while at <= last_start {
        at += hay[at..=last_start].iter().position(|&b| b == first)?;
        if hay[at + 1..].starts_with(rest) {
            return Some(at);
        }
        at += 1;
    }
    None
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

/// The last complete number value of `key` (one followed by a non-digit:
/// a value cut at the chunk's end is read with the next chunk).
fn last_count(hay: &[u8], key: &[u8]) -> Option<u64> {
    values_after(hay, key)
        .filter_map(|v| {
            let n = v.iter().take_while(|d| d.is_ascii_digit()).count();
            if n == 0 || n == v.len() || n > 19 {
                return None;
            }
            std::str::from_utf8(&v[..n]).ok()?.parse().ok()
        })
        .last()
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
    fn a_first_token_report_names_its_ticket_and_nothing_else() {
        let body = first_token_body("0123abcd").unwrap();
        assert_eq!(body, "id=0123abcd");
        assert_eq!(parse_first_token(&body), Some("0123abcd"));
        assert_eq!(parse_first_token("id=0123abcd\n"), Some("0123abcd"));
        for bad in [
            "",
            "id=",
            "0123abcd",
            "id=a;b",
            "id=a b",
            "upstream=1.2.3.4:5;id=x",
        ] {
            assert_eq!(parse_first_token(bad), None, "{bad:?}");
        }
        assert_eq!(first_token_body("a;b"), None);
        assert_eq!(first_token_body(&"x".repeat(MAX_REQUEST_ID + 1)), None);
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
            report_body("127.0.0.1:8000", None, &s),
            "upstream=127.0.0.1:8000;text=1;done=1"
        );
        // With usage and a request id; an id that would break the
        // report's syntax is left out.
        let s = scan(&[
            "{\"choices\":[{\"text\":\"x\",\"finish_reason\":\"stop\"}],",
            "\"usage\":{\"prompt_tokens\":1200,\"completion_tokens\":3,",
            "\"prompt_tokens_details\":{\"cached_tokens\":1024}}}",
        ]);
        assert_eq!(
            report_body("127.0.0.1:8000", Some("req-1"), &s),
            "upstream=127.0.0.1:8000;text=1;done=1;prompt=1200;cached=1024;id=req-1"
        );
        assert_eq!(
            report_body("127.0.0.1:8000", Some("a;b"), &s),
            "upstream=127.0.0.1:8000;text=1;done=1;prompt=1200;cached=1024"
        );
    }

    #[test]
    fn usage_is_read_from_the_final_chunk_across_cuts() {
        let s = scan(&[
            "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":98",
            "76,\"completion_tokens\":5,\"prompt_tokens_details\":{\"cached_",
            "tokens\":9216}}}\n\ndata: [DONE]\n\n",
        ]);
        assert_eq!(
            s.usage(),
            Some(Usage {
                prompt_tokens: 9876,
                cached_tokens: 9216
            })
        );
        // An engine that reports prompt tokens only says nothing about
        // its cache; a prompt's text that mentions the key is escaped
        // and not read.
        let s = scan(&["{\"usage\":{\"prompt_tokens\":10,\"completion_tokens\":1}}"]);
        assert_eq!(s.usage(), None);
        let s = scan(&[
            "{\"content\":\"\\\"cached_tokens\\\": 5\",",
            "\"usage\":{\"prompt_tokens\":10}}",
        ]);
        assert_eq!(s.usage(), None);
        // The last report wins (usage in every chunk).
        let s = scan(&[
            "data: {\"usage\":{\"prompt_tokens\":10,\"prompt_tokens_details\":{\"cached_tokens\":0}}}\n\n",
            "data: {\"usage\":{\"prompt_tokens\":10,\"prompt_tokens_details\":{\"cached_tokens\":8}}}\n\n",
        ]);
        assert_eq!(s.usage().map(|u| u.cached_tokens), Some(8));
    }

    #[test]
    fn reports_parse_their_usage_and_id_and_reject_bad_ones() {
        let r =
            Report::parse("upstream=10.0.0.1:80;text=1;done=1;prompt=50;cached=32;id=abc").unwrap();
        assert_eq!(
            r.usage,
            Some(Usage {
                prompt_tokens: 50,
                cached_tokens: 32
            })
        );
        assert_eq!(r.request_id.as_deref(), Some("abc"));
        assert_eq!(Report::parse(&r.to_string()), Some(r));
        let plain = Report::parse("upstream=10.0.0.1:80;text=1;done=0").unwrap();
        assert_eq!((plain.usage, plain.request_id), (None, None));
        for bad in [
            "upstream=10.0.0.1:80;text=1;done=1;prompt=50",
            "upstream=10.0.0.1:80;text=1;done=1;prompt=50;cached=x",
            "upstream=10.0.0.1:80;text=1;done=1;prompt=50;cached=51",
            "upstream=10.0.0.1:80;text=1;done=1;prompt=-1;cached=0",
            "upstream=10.0.0.1:80;text=1;done=1;prompt=99999999999999999999;cached=0",
            "upstream=10.0.0.1:80;text=1;done=1;id=",
        ] {
            assert_eq!(Report::parse(bad), None, "{bad}");
        }
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

        #[test]
        fn find_agrees_with_comparing_at_every_position(
            hay in proptest::collection::vec(b'a'..=b'c', 0..40),
            needle in proptest::collection::vec(b'a'..=b'c', 1..5),
        ) {
            let every = hay.windows(needle.len()).position(|w| w == needle.as_slice());
            proptest::prop_assert_eq!(find(&hay, &needle), every);
        }
    }

    #[test]
    fn find_sees_a_needle_at_either_end_and_not_past_it() {
        assert_eq!(find(b"[DONE]", b"[DONE]"), Some(0));
        assert_eq!(find(b"data: [DONE]", b"[DONE]"), Some(6));
        assert_eq!(find(b"data: [DONE", b"[DONE]"), None);
        assert_eq!(find(b"[", b"[DONE]"), None);
        assert_eq!(find(b"\"\"usage\"", b"\"usage\""), Some(1));
    }
}

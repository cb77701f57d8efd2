//! What Hearth's parts say to each other, shared by the Envoy wasm filter
//! (`wasm32-wasip1`), the ext-proc sidecar (native) and the tests, so all
//! sides agree byte for byte: the prompt fingerprint (below), the header
//! and metadata names ([`names`], [`header`]), the outcome report a
//! response's scan produces ([`outcome`]), and the messages the sidecars of
//! a fleet exchange over their peer bus ([`peer`]), and the engines' own KV
//! cache events ([`kv_events`], vLLM's msgpack batches, which the sidecar
//! reads and the simulated engine writes). `golden/` pins the fingerprint
//! (`vectors.json`), the report (`outcome-reports.json`) and the KV event
//! batches as vLLM encodes them (`kv-events.json`).
//!
//! A fingerprint names the prompt of an OpenAI-style request as a chain of
//! block hashes: block *i*'s hash covers the whole canonical prompt up to the
//! end of block *i*, so "how many leading hashes does a replica know" is a
//! longest-prefix match. The crate has no I/O, no threads and no `unsafe`.
//!
//! The pipeline is [`canonical_prompt`] (request body → canonical bytes),
//! [`chain_hashes`] (bytes → hashes) and [`header`] (hashes ↔ the
//! `x-hearth-fp` header value); [`fingerprint`] runs the first two.
//! `golden/vectors.json` pins all of it; any change to the bytes below is a
//! new [`FORMAT_VERSION`].
//!
//! # Canonical prompt bytes (format version 2)
//!
//! The canonical prompt is a sequence of *records*, each self-delimiting:
//!
//! ```text
//! record = tag:u8  payload  0xFF
//! ```
//!
//! Every payload is UTF-8 text, which never contains the byte `0xFF`, so a
//! record ends at its first `0xFF` and no text inside one can end it early
//! or forge another. There is no header, count or trailer, so when chat
//! conversation A's messages are a prefix of B's (same model, same leading
//! system messages, same tools), canonical(A) is a byte prefix of
//! canonical(B). (One edge: tools are written after the *whole* leading
//! system run, so a conversation that ends inside that run is not a prefix
//! of one that extends the run.) Nothing about a record is written before
//! its text, so two messages whose texts begin alike have canonical bytes
//! that begin alike, up to where the texts part: conversations whose system
//! prompts open with the same harness text share those blocks, as the
//! engine shares their tokens. (Format version 1 wrote each payload's
//! length before it, so two system prompts of different lengths shared
//! nothing.)
//!
//! String payloads are the JSON string's decoded UTF-8 text. "JSON" payloads are the value's
//! canonical JSON (below). A field that is absent or `null` writes no record.
//!
//! **Chat completions** (`messages`):
//! 1. every *leading* message whose role is `system` or `developer`, as
//!    message records (below);
//! 2. `T` tools (JSON), `C` tool_choice (JSON), `R` response_format (JSON);
//! 3. every remaining message, as message records.
//!
//! A message's records, in this order: `m` role (string, required);
//! content: a string gives one `c` record; an array of parts gives, per part,
//! `c` with the part's `text` if the part is `{"type": "text", "text": <string>}`
//! and otherwise `p` with the part's canonical JSON (images and other
//! non-text parts are hashed as given); then `k` tool_calls (JSON),
//! `i` tool_call_id (string), `n` name (string).
//!
//! **Completions** (`prompt`): a string gives one `P` record; an array of
//! strings gives one `P` record per string; any other array (token ids,
//! arrays of token ids) gives one `J` record with the whole array's JSON.
//!
//! **Responses** (`instructions`, `tools`, `input`): `I` instructions
//! (string), `T` tools (JSON), then `input`: a string gives one `N` record,
//! an array gives one `E` record per item (the item's JSON).
//!
//! Every other field (`temperature`, `max_tokens`, `stream`, `user`, `seed`,
//! `metadata`, message fields other than the five above, ...) is ignored.
//!
//! **Cache use** (not part of the canonical bytes): a body may ask the
//! engine to keep its prompt apart from others' or not to use its prompt
//! cache at all. `cache_salt` (vLLM, SGLang: only requests with the same
//! salt share cached blocks) makes the request *partitioned*;
//! `"cache_prompt": false` (llama.cpp: the prompt is read afresh) or
//! `id_slot` / `slot_id` naming a slot (llama.cpp: the request takes
//! that slot, whatever it holds; any number that is not -1 once cut to an
//! integer, or a boolean, as llama.cpp's JSON library reads it) make it
//! *bypassed* ([`CacheUse`]), and so do the fields with which vLLM or
//! SGLang read the prompt without the cache or as other tokens than its
//! text: `prompt_logprobs`, `truncate_prompt_tokens`, `chat_template`,
//! `mm_processor_kwargs` (any value but null) and `add_special_tokens`
//! other than the endpoint's default (false for chat, true for
//! completions). `"cache_prompt": 0` is not a boolean, and llama.cpp then
//! keeps its default (cache on).
//! The model comes from the `model` field (a non-empty string).
//!
//! **Canonical JSON**: compact (no whitespace); object keys sorted by their
//! UTF-8 bytes, a repeated key keeps its last value; strings escape `"` as
//! `\"`, `\` as `\\`, U+0008/0009/000A/000C/000D as `\b \t \n \f \r`, other
//! control characters below U+0020 as `\u00xx` (lowercase hex), and write
//! everything else as raw UTF-8; numbers that are integers in the i64/u64
//! range are written in decimal as given, every other number is parsed to
//! the nearest f64 and written as Rust's `format!("{:e}", f64)` does
//! (shortest round-trip digits, always with an exponent: `1.0` → `1e0`,
//! `0.25` → `2.5e-1`, `1e300` → `1e300`), so no number's canonical form is
//! more than two bytes longer than its text, however large or small it is.
//!
//! # Hashes
//!
//! FNV-1a 64 (offset basis `0xcbf29ce484222325`, prime `0x100000001b3`).
//! `seed = fnv1a(b"hearth-fp/v2\0" ++ model)`, or for a partitioned
//! request `fnv1a(b"hearth-fp/v2\0" ++ model ++ b"\0cache_salt\0" ++ salt)`
//! (the salt as its JSON string's text, other JSON values as their
//! canonical JSON), so salted prompts share warmth only with the same
//! salt, as in the engine; the first
//! `min(len, max_prefix_bytes)` canonical bytes are cut into `block_size`
//! blocks (a trailing partial block counts) and
//! `h_i = fnv1a(h_{i-1}.to_le_bytes() ++ block_i)` with `h_{-1} = seed`.
//!
//! # Header
//!
//! `x-hearth-fp: v2.<block_size>.<base64url, no padding, of the hashes as
//! little-endian u64s>`, see [`header`].

#![forbid(unsafe_code)]

mod canonical;
mod hash;
pub mod header;
mod json;
pub mod kv_events;
pub mod names;
pub mod outcome;
pub mod peer;
pub mod priority;

pub use canonical::canonical_prompt;

pub use hash::{chain_hashes, fnv1a64};

/// Version of the canonical format, the hash chain and the header.
pub const FORMAT_VERSION: u8 = 2;
/// Bytes per hashed block by default.
pub const DEFAULT_BLOCK_SIZE: usize = 2048;
/// At most this many canonical bytes are hashed by default (2 MiB).
pub const DEFAULT_MAX_PREFIX_BYTES: usize = 2 << 20;
/// Smallest allowed block size.
pub const MIN_BLOCK_SIZE: usize = 64;
/// Largest allowed block size (1 MiB).
pub const MAX_BLOCK_SIZE: usize = 1 << 20;
/// Most hashes a fingerprint may carry (bounds the header size).
pub const MAX_HASHES: usize = 65536;

/// The OpenAI-compatible API a request body belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Endpoint {
    /// `POST /v1/chat/completions`: `messages`.
    ChatCompletions,
    /// `POST /v1/completions`: `prompt`.
    Completions,
    /// `POST /v1/responses`: `instructions` and `input`.
    Responses,
}

impl Endpoint {
    /// All endpoints, in a fixed order.
    pub const ALL: [Endpoint; 3] = [
        Endpoint::ChatCompletions,
        Endpoint::Completions,
        Endpoint::Responses,
    ];

    /// The endpoint served at one of the default paths; a `?query` or
    /// `#fragment` is ignored.
    pub fn from_path(path: &str) -> Option<Endpoint> {
        let path = strip_query(path);
        Endpoint::ALL.into_iter().find(|e| e.default_path() == path)
    }

    /// The default path, e.g. `/v1/chat/completions`.
    pub fn default_path(self) -> &'static str {
        match self {
            Endpoint::ChatCompletions => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
            Endpoint::Responses => "/v1/responses",
        }
    }

    /// A stable snake_case name (`chat_completions`, `completions`, `responses`).
    pub fn as_str(self) -> &'static str {
        match self {
            Endpoint::ChatCompletions => "chat_completions",
            Endpoint::Completions => "completions",
            Endpoint::Responses => "responses",
        }
    }
}

/// `path` without its `?query` and `#fragment`.
pub fn strip_query(path: &str) -> &str {
    let end = path.find(['?', '#']).unwrap_or(path.len());
    path.get(..end).unwrap_or(path)
}

/// How the canonical prompt is cut and bounded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Params {
    /// Bytes per block (`MIN_BLOCK_SIZE..=MAX_BLOCK_SIZE`).
    pub block_size: usize,
    /// Only this many leading canonical bytes are hashed (`>= block_size`).
    pub max_prefix_bytes: usize,
}

impl Default for Params {
    fn default() -> Self {
        Params {
            block_size: DEFAULT_BLOCK_SIZE,
            max_prefix_bytes: DEFAULT_MAX_PREFIX_BYTES,
        }
    }
}

impl Params {
    /// Checks the bounds; the message names the offending field.
    pub fn validate(&self) -> Result<(), String> {
        if !(MIN_BLOCK_SIZE..=MAX_BLOCK_SIZE).contains(&self.block_size) {
            return Err(format!(
                "block_size must be in {MIN_BLOCK_SIZE}..={MAX_BLOCK_SIZE}, got {}",
                self.block_size
            ));
        }
        if self.max_prefix_bytes < self.block_size {
            return Err(format!(
                "max_prefix_bytes ({}) must be >= block_size ({})",
                self.max_prefix_bytes, self.block_size
            ));
        }
        if self.max_hashes() > MAX_HASHES {
            return Err(format!(
                "max_prefix_bytes / block_size allows {} hashes, more than {MAX_HASHES}",
                self.max_hashes()
            ));
        }
        Ok(())
    }

    /// Upper bound on the number of hashes of one fingerprint.
    pub fn max_hashes(&self) -> usize {
        self.max_prefix_bytes.div_ceil(self.block_size.max(1))
    }
}

/// The fingerprint of one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fingerprint {
    /// The request's `model`.
    pub model: String,
    /// Full canonical prompt length, even past `max_prefix_bytes`.
    pub prompt_bytes: u64,
    /// Block size the hashes were cut with.
    pub block_size: u32,
    /// Chained block hashes of the bounded prefix, never empty.
    pub hashes: Vec<u64>,
    /// The request's output cap (`max_tokens` and its API's equivalents),
    /// when given as an integer: routing may prefer replicas suited to it.
    /// It never changes the hashes.
    pub max_output_tokens: Option<u64>,
    /// How the request uses the engine's prompt cache.
    pub cache: CacheUse,
}

/// How a request uses the engine's prompt cache, as its body asks (see the
/// crate's notes). What an engine serves a partitioned or bypassed request
/// from its cache says nothing about what it holds for everyone else, so
/// the sidecar never corrects its warmth index by such answers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum CacheUse {
    /// The engine's shared prompt cache, as usual.
    #[default]
    Shared,
    /// Only requests with the same `cache_salt` share cached prompts.
    Partitioned,
    /// The engine is told not to use its prompt cache (or to use one slot).
    Bypassed,
}

impl CacheUse {
    /// The `x-hearth-cache` header value (`shared` is never sent).
    pub fn as_str(self) -> &'static str {
        match self {
            CacheUse::Shared => "shared",
            CacheUse::Partitioned => "partitioned",
            CacheUse::Bypassed => "bypassed",
        }
    }

    /// Inverse of [`CacheUse::as_str`].
    pub fn parse(s: &str) -> Option<CacheUse> {
        [CacheUse::Shared, CacheUse::Partitioned, CacheUse::Bypassed]
            .into_iter()
            .find(|c| c.as_str() == s.trim())
    }
}

impl Fingerprint {
    /// The `x-hearth-fp` header value.
    pub fn header_value(&self) -> String {
        header::encode(self.block_size, &self.hashes)
    }
}

/// Why a body has no fingerprint. The request is then routed on load alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SkipReason {
    /// Not valid JSON: RFC 8259, UTF-8 throughout, at most 127 nested
    /// arrays and objects (serde_json's limit), numbers inside the
    /// canonical form within f64's range.
    NotJson,
    /// Valid JSON, but not an object.
    NotObject,
    /// `model` missing, not a string, or empty.
    NoModel,
    /// The canonical prompt is empty.
    NoPrompt,
    /// A prompt-bearing field has the wrong JSON type.
    BadField,
    /// Valid, but past a bound of the parser's: more than 65,536 object
    /// keys in one value hashed as JSON (one tool, content part or input
    /// item; an array's items count apart), or a body of 4 GiB or more.
    TooComplex,
}

impl SkipReason {
    /// All reasons, in a fixed order.
    pub const ALL: [SkipReason; 6] = [
        SkipReason::NotJson,
        SkipReason::NotObject,
        SkipReason::NoModel,
        SkipReason::NoPrompt,
        SkipReason::BadField,
        SkipReason::TooComplex,
    ];

    /// snake_case name, used as a metric suffix and in the golden vectors.
    pub fn as_str(self) -> &'static str {
        match self {
            SkipReason::NotJson => "not_json",
            SkipReason::NotObject => "not_object",
            SkipReason::NoModel => "no_model",
            SkipReason::NoPrompt => "no_prompt",
            SkipReason::BadField => "bad_field",
            SkipReason::TooComplex => "too_complex",
        }
    }

    /// Inverse of [`SkipReason::as_str`].
    pub fn parse(s: &str) -> Option<SkipReason> {
        SkipReason::ALL.into_iter().find(|r| r.as_str() == s)
    }
}

impl std::fmt::Display for SkipReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Canonicalizes `body` and hashes its bounded prefix.
///
/// `params` should have passed [`Params::validate`]; out-of-range values are
/// clamped rather than trusted.
pub fn fingerprint(
    endpoint: Endpoint,
    body: &[u8],
    params: &Params,
) -> Result<Fingerprint, SkipReason> {
    let request = canonical::Request::read(endpoint, body)?;
    let mut scratch = json::Scratch::default();
    let mut seed = hash::Seed::new(&request.model);
    if request.cache == CacheUse::Partitioned {
        json::Sink::put(&mut seed, b"\0cache_salt\0");
        request.write_salt(&mut scratch, &mut seed)?;
    }
    let mut chain = hash::Chain::new(seed.finish(), params, body.len());
    request.write(&mut scratch, &mut chain)?;
    if chain.len() == 0 {
        return Err(SkipReason::NoPrompt);
    }
    Ok(Fingerprint {
        prompt_bytes: chain.len(),
        block_size: hash::effective_block_size(params) as u32,
        hashes: chain.finish(),
        max_output_tokens: request.max_output_tokens,
        cache: request.cache,
        model: request.model,
    })
}

//! The messages the sidecars of one fleet exchange over their peer bus
//! (NATS core pub/sub): what each one's routing decisions taught it about
//! the replicas' caches (warmth), its own in-flight load, the replicas it
//! fenced or re-admitted, and, for a sidecar that starts, its whole state.
//!
//! The format is compact binary, little-endian, versioned by
//! [`PEER_FORMAT`]. [`decode`] refuses a message whole when anything in it is
//! off (too long, cut short, another format, bad magic or kind, bad UTF-8,
//! a flag that is neither 0 nor 1, a load that is not a finite number,
//! an update's warmth record of more than [`MAX_RECORD_HASHES`] hashes or
//! of a tip without hashes, bytes after the end): a receiver counts it and
//! drops it. It never panics
//! and checks every declared count against the bytes left *before*
//! allocating, so no input makes it allocate more than a small multiple of
//! the input's own size.
//!
//! # Layout (format 2)
//!
//! The envelope (`F` is the fleet name's length; the body starts at byte
//! `31 + F`):
//!
//! ```text
//! offset  bytes  field
//! 0       4      magic "HRTP" (48 52 54 50)
//! 4       1      format: 2
//! 5       1      F
//! 6       F      fleet, UTF-8
//! 6+F     8      list    u64, list_digest of the sender's replica list
//! 14+F    8      sender  u64
//! 22+F    8      seq     u64
//! 30+F    1      kind: 1 update, 2 hello, 3 snapshot
//! 31+F    ...    body, by kind (below); nothing may follow it
//! ```
//!
//! The bodies, field after field (`u16`, `u32`, `u64`, `f32` little-endian;
//! `[x; n]` is `n` times `x`):
//!
//! ```text
//! update   = u32 n, [warmth; n]   u32 n, [load; n]   u32 n, [health; n]
//! hello    = u8 len, reply [u8; len] (UTF-8, a NATS subject)
//! snapshot = u32 part, u32 parts (part < parts), update
//!
//! warmth   = u16 replica, u32 n, [u64 hash; n], tip
//! tip      = u8 0                 (none)
//!          | u8 1, u64 hash
//! load     = u16 replica, u32 in_flight, f32 load (finite)
//! health   = u16 replica, rank, u8 serving (0 fenced, 1 serving)
//! rank     = u8 0                 (none)
//!          | u8 1, u16 rank
//! ```
//!
//! A replica is named by its position in the canonical (sorted,
//! deduplicated) order of the sender's replica list, and `list` is that
//! list's [`list_digest`]: a receiver applies only figures from senders
//! whose list is its own.
//!
//! `seq` grows with every message a sender sends: it is the sender's wall
//! clock in microseconds since the Unix epoch, or its previous `seq` plus
//! one when the clock has not moved past it. A receiver accepts from a
//! sender only a `seq` above the last it accepted from that sender (on the
//! same subject kind: the fleet's subjects, or its own inbox), and only
//! one within a minute of its own clock, so a message replayed later, or
//! after the sender restarted under a new random id, is refused.
//!
//! For example, a hello from fleet `f` (list 1, sender 2, seq 3) asking for
//! answers on subject `r` is these 34 bytes:
//!
//! ```text
//! 48 52 54 50 02 01 66                              "HRTP", format 2, "f"
//! 01 00 00 00 00 00 00 00                           list 1
//! 02 00 00 00 00 00 00 00                           sender 2
//! 03 00 00 00 00 00 00 00                           seq 3
//! 02 01 72                                          hello, "r"
//! ```
//!
//! # On the bus: the seal
//!
//! On NATS every message is followed by its seal, [`SEAL_BYTES`] bytes:
//! the sender's public key, its signature and the fleet's MAC.
//!
//! ```text
//! sealed    = message, key [u8; 32], signature [u8; 64], mac [u8; 32]
//! signature = Ed25519(sender's private key, u32 len(subject), subject, message)
//! mac       = HMAC-SHA256(fleet key, u32 len(subject), subject, message,
//!                         key, signature)
//! ```
//!
//! - **The MAC** (keyed with the fleet's key, `HEARTH_PEERS_KEY_FILE`)
//!   admits the fleet's members: it covers every byte before it and binds
//!   the message to the subject it is published on, so a snapshot part
//!   sent to one sidecar's inbox cannot be replayed to another's. A
//!   sender without a fleet key (`HEARTH_PEERS_INSECURE=true`) writes 32
//!   zero bytes; a receiver with a key verifies the MAC (in constant
//!   time) before anything else and drops a message whose MAC does not
//!   check.
//! - **The signature** binds the message to its sender: each sidecar
//!   makes an Ed25519 key pair when it starts, and its `sender` id is
//!   [`sender_id`] of its public key (the first 8 bytes of the key's
//!   SHA-256, little-endian). A receiver accepts a message only when its
//!   `sender` is the id of the key in the seal and the signature checks,
//!   so a member of the fleet can speak only as itself: it cannot send
//!   under another sidecar's id (to spend its sequence numbers, say).
//!
//! [`decode`] reads the message without its seal: the sidecar computes
//! and checks the seal (`ext-proc/src/feeds/peer_guard.rs`), so this
//! crate carries no cryptography and builds for wasm32-wasip1.

use thiserror::Error;

/// Format of the peer messages; a message of another format is refused.
pub const PEER_FORMAT: u8 = 2;

/// The largest message a sidecar sends or accepts (NATS' default maximum
/// payload is 1 MiB), without its MAC.
pub const MAX_MESSAGE_BYTES: usize = 1 << 20;

/// Bytes of the sender's public key in the seal (Ed25519).
pub const KEY_BYTES: usize = 32;

/// Bytes of the sender's signature in the seal (Ed25519).
pub const SIGNATURE_BYTES: usize = 64;

/// Bytes of the fleet's MAC at the end of the seal (HMAC-SHA256).
pub const MAC_BYTES: usize = 32;

/// Bytes of the seal that follows every message on the bus: key,
/// signature, MAC (see the module doc's "On the bus: the seal").
pub const SEAL_BYTES: usize = KEY_BYTES + SIGNATURE_BYTES + MAC_BYTES;

/// A sealed message, as it travels on the bus, in its four pieces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sealed<'a> {
    pub message: &'a [u8],
    pub key: &'a [u8; KEY_BYTES],
    pub signature: &'a [u8; SIGNATURE_BYTES],
    pub mac: &'a [u8; MAC_BYTES],
    /// What the MAC covers after the subject: the message, the key and
    /// the signature.
    pub maced: &'a [u8],
}

/// A sealed message split into its pieces; None when it is shorter than
/// a seal.
pub fn split_seal(sealed: &[u8]) -> Option<Sealed<'_>> {
    let at = sealed.len().checked_sub(SEAL_BYTES)?;
    let (message, seal) = sealed.split_at(at);
    let (key, rest) = seal.split_at(KEY_BYTES);
    let (signature, mac) = rest.split_at(SIGNATURE_BYTES);
    Some(Sealed {
        message,
        key: key.try_into().ok()?,
        signature: signature.try_into().ok()?,
        mac: mac.try_into().ok()?,
        maced: &sealed[..sealed.len() - MAC_BYTES],
    })
}

/// A sender's id on the bus: the first 8 bytes (little-endian) of the
/// SHA-256 of its public key, computed by the caller (`sha256`), which
/// keeps this crate free of cryptography.
pub fn sender_id(sha256_of_key: &[u8; 32]) -> u64 {
    let mut first = [0u8; 8];
    first.copy_from_slice(&sha256_of_key[..8]);
    u64::from_le_bytes(first)
}

/// The most hashes one warmth record of an update carries: the most a
/// fingerprint has ([`crate::MAX_HASHES`]). A record of more is refused
/// (snapshot records, whole indexes, are not bounded so).
pub const MAX_RECORD_HASHES: usize = crate::MAX_HASHES;

/// The smallest `max_bytes` that [`Update::split`] honours: an update that
/// holds one warmth record of one hash with its tip (every load or health
/// entry is smaller). A smaller limit is taken as this one.
pub const MIN_SPLIT_BYTES: usize = UPDATE_COUNTS + WARMTH_FIXED + HASH + HASH;

const MAGIC: &[u8; 4] = b"HRTP";
const KIND_UPDATE: u8 = 1;
const KIND_HELLO: u8 = 2;
const KIND_SNAPSHOT: u8 = 3;

/// Bytes of an empty update: its three counts.
const UPDATE_COUNTS: usize = 3 * 4;
/// Bytes of a warmth record without hashes or tip: replica, count, tip flag.
const WARMTH_FIXED: usize = 2 + 4 + 1;
/// Bytes of one hash (and of a tip's value).
const HASH: usize = 8;
/// Bytes of a load entry: replica, in-flight, load.
const LOAD_BYTES: usize = 2 + 4 + 4;
/// Bytes of a health entry without a rank: replica, rank flag, serving.
const HEALTH_FIXED: usize = 2 + 1 + 1;
/// Longest string a one-byte length can announce.
const MAX_STR8: usize = u8::MAX as usize;

/// One message on the bus.
#[derive(Clone, Debug, PartialEq)]
pub struct Envelope {
    /// The fleet's name (`HEARTH_FLEET`); at most 255 bytes UTF-8 (a longer
    /// one is cut at a character boundary when encoded).
    pub fleet: String,
    /// Digest of the replica list the sender routes over (see
    /// [`list_digest`]); replica indices in the body are positions in that
    /// list's canonical order.
    pub list: u64,
    /// The sending sidecar's id: [`sender_id`] of the public key it made
    /// at start (the seal proves the message is that key's).
    pub sender: u64,
    /// Grows with every message of the sender: its clock in microseconds
    /// since the Unix epoch, or the previous `seq` plus one (see the
    /// module doc).
    pub seq: u64,
    /// What the message says.
    pub body: Body,
}

/// The three kinds of message.
#[derive(Clone, Debug, PartialEq)]
pub enum Body {
    /// What the sender learned since its previous update.
    Update(Update),
    /// A sidecar that starts asks its peers for their state; they answer on
    /// `reply` (a NATS subject, at most 255 bytes) with
    /// [`Body::Snapshot`] parts.
    Hello { reply: String },
    /// One part of a peer's whole state, answering a [`Body::Hello`].
    Snapshot {
        /// This part's place, from 0; always below `parts`.
        part: u32,
        /// How many parts the whole state takes.
        parts: u32,
        /// The part's figures.
        update: Update,
    },
}

/// Warmth, load and health figures: the payload of an update or of a
/// snapshot part.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Update {
    pub warmth: Vec<Warmth>,
    pub load: Vec<Load>,
    pub health: Vec<Health>,
}

/// A prompt the sender routed to a replica (or, in a snapshot, blocks the
/// replica holds, least recent first).
#[derive(Clone, Debug, PartialEq)]
pub struct Warmth {
    pub replica: u16,
    /// The prompt's chained block hashes, in order.
    pub hashes: Vec<u64>,
    /// The conversation's tip (its prompt's last full block), when it has
    /// one: the receiver counts the conversation resident there.
    pub tip: Option<u64>,
}

/// The sender's own in-flight requests on a replica, now.
#[derive(Clone, Debug, PartialEq)]
pub struct Load {
    pub replica: u16,
    pub in_flight: u32,
    /// Load units (finite; a message with a NaN or infinite load is
    /// refused).
    pub load: f32,
}

/// The sender fenced (`serving: false`) or re-admitted (`serving: true`) a
/// replica.
#[derive(Clone, Debug, PartialEq)]
pub struct Health {
    pub replica: u16,
    /// Data-parallel rank, when the replica is one rank of an endpoint.
    pub rank: Option<u16>,
    pub serving: bool,
}

/// Why [`decode`] refused a message.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum PeerError {
    /// The input is longer than [`MAX_MESSAGE_BYTES`].
    #[error("peer message of {0} bytes, more than {MAX_MESSAGE_BYTES}")]
    Oversized(usize),
    /// The bytes end before a declared field (or a declared count needs
    /// more bytes than are left).
    #[error("peer message ends before a declared field")]
    Truncated,
    /// The format byte is not [`PEER_FORMAT`].
    #[error("peer message of format {0}, not {PEER_FORMAT}")]
    Format(u8),
    /// Anything else: bad magic, unknown kind, bad UTF-8, a flag that is
    /// neither 0 nor 1, a load that is not finite, a snapshot part not below
    /// its parts, an update's record of more than [`MAX_RECORD_HASHES`]
    /// hashes or of a tip alone, bytes after the body.
    #[error("malformed peer message: {0}")]
    Malformed(&'static str),
}

/// Digest of a replica list, so that sidecars can tell whether they number
/// the replicas alike.
///
/// Each entry names one replica as `ip:port`, or `ip:port#rank` for one
/// rank of a data-parallel endpoint, and is taken as given (no trimming).
/// The function sorts a copy of the entries by their bytes and removes
/// duplicates (the canonical order, in which replica indices count), then
/// runs FNV-1a 64 over each entry's length (u64 little-endian) followed by
/// its bytes. Sidecars that read the same list in any order agree; the
/// length prefix keeps `["ab", "c"]` apart from `["a", "bc"]`.
pub fn list_digest<S: AsRef<str>>(entries: &[S]) -> u64 {
    let mut sorted: Vec<&str> = entries.iter().map(AsRef::as_ref).collect();
    sorted.sort_unstable();
    sorted.dedup();
    let mut bytes = Vec::new();
    for entry in sorted {
        bytes.extend_from_slice(&(entry.len() as u64).to_le_bytes());
        bytes.extend_from_slice(entry.as_bytes());
    }
    crate::fnv1a64(&bytes)
}

impl Warmth {
    /// Bytes this record takes encoded.
    fn encoded_len(&self) -> usize {
        warmth_len(self.hashes.len(), self.tip.is_some())
    }
}

/// Bytes of a warmth record of `hashes` hashes, with or without a tip.
fn warmth_len(hashes: usize, tip: bool) -> usize {
    WARMTH_FIXED + HASH * hashes + if tip { HASH } else { 0 }
}

impl Health {
    /// Bytes this entry takes encoded.
    fn encoded_len(&self) -> usize {
        HEALTH_FIXED + if self.rank.is_some() { 2 } else { 0 }
    }
}

impl Update {
    /// True when the update carries no figure at all.
    pub fn is_empty(&self) -> bool {
        self.warmth.is_empty() && self.load.is_empty() && self.health.is_empty()
    }

    /// Bytes this update takes encoded (exact): the body of a
    /// [`Body::Update`] message. A [`Body::Snapshot`]'s body is 8 bytes more
    /// (part and parts), and the envelope before any body is 31 bytes plus
    /// the fleet name's length (at most 286), so a message is at most
    /// `encoded_len() + 294` bytes.
    pub fn encoded_len(&self) -> usize {
        UPDATE_COUNTS
            + self.warmth.iter().map(Warmth::encoded_len).sum::<usize>()
            + LOAD_BYTES * self.load.len()
            + self.health.iter().map(Health::encoded_len).sum::<usize>()
    }

    /// Splits into updates each encoding to at most `max_bytes` (see
    /// [`Update::encoded_len`]; a limit below [`MIN_SPLIT_BYTES`] is taken
    /// as that), for snapshots and big batches.
    ///
    /// The parts hold the figures in their order: load entries first (so a
    /// receiver that keeps each sender's latest load figures finds them
    /// together, in the first part, unless there are more than one part
    /// holds), then health entries, then warmth records. A warmth record too
    /// large for the room left is cut into pieces of consecutive hashes, the
    /// first filling that room; only the last piece carries the tip, and it
    /// keeps at least one hash. A part is closed only when the next figure
    /// does not fit it. An empty update gives one empty part, so a snapshot
    /// of no state still has a part to send.
    pub fn split(self, max_bytes: usize) -> Vec<Update> {
        let mut parts = Parts::new(max_bytes.max(MIN_SPLIT_BYTES));
        for load in self.load {
            parts.add(LOAD_BYTES, |u| u.load.push(load));
        }
        for health in self.health {
            parts.add(health.encoded_len(), |u| u.health.push(health));
        }
        for warmth in self.warmth {
            parts.add_warmth(warmth);
        }
        parts.finish()
    }
}

/// The parts [`Update::split`] fills, one after the other.
struct Parts {
    limit: usize,
    done: Vec<Update>,
    current: Update,
    /// `current.encoded_len()`, kept as figures are added.
    used: usize,
}

impl Parts {
    fn new(limit: usize) -> Parts {
        Parts {
            limit,
            done: Vec::new(),
            current: Update::default(),
            used: UPDATE_COUNTS,
        }
    }

    /// Bytes the current part can still take.
    fn room(&self) -> usize {
        self.limit.saturating_sub(self.used)
    }

    /// Closes the current part and starts an empty one.
    fn close(&mut self) {
        self.done.push(std::mem::take(&mut self.current));
        self.used = UPDATE_COUNTS;
    }

    /// Adds a figure of `bytes` bytes, in a new part when it does not fit
    /// the current one.
    fn add(&mut self, bytes: usize, put: impl FnOnce(&mut Update)) {
        if bytes > self.room() && !self.current.is_empty() {
            self.close();
        }
        put(&mut self.current);
        self.used += bytes;
    }

    /// Adds a warmth record, cut into pieces when it does not fit.
    fn add_warmth(&mut self, warmth: Warmth) {
        let Warmth {
            replica,
            hashes,
            tip,
        } = warmth;
        let mut rest = hashes.into_iter();
        loop {
            let left = rest.len();
            let whole = warmth_len(left, tip.is_some());
            // Hashes of a tipless piece that fit the room, keeping at least
            // one for the last piece.
            let fitting =
                (self.room().saturating_sub(WARMTH_FIXED) / HASH).min(left.saturating_sub(1));
            if whole <= self.room() || (fitting == 0 && self.current.is_empty()) {
                // The rest fits (or cannot be cut further: only with a
                // limit below MIN_SPLIT_BYTES, which `split` prevents).
                let hashes = rest.collect();
                self.add(whole, |u| {
                    u.warmth.push(Warmth {
                        replica,
                        hashes,
                        tip,
                    })
                });
                return;
            }
            if fitting == 0 {
                self.close();
                continue;
            }
            let hashes: Vec<u64> = rest.by_ref().take(fitting).collect();
            self.add(warmth_len(fitting, false), |u| {
                u.warmth.push(Warmth {
                    replica,
                    hashes,
                    tip: None,
                })
            });
        }
    }

    /// The parts; one empty part when nothing was added.
    fn finish(mut self) -> Vec<Update> {
        if !self.current.is_empty() || self.done.is_empty() {
            self.close();
        }
        self.done
    }
}

/// The message's bytes (layout in the module doc).
///
/// Encoding never fails: a fleet name or reply subject longer than 255
/// bytes is cut at a character boundary, and a list of more than
/// `u32::MAX` entries is cut to that many. Callers keep messages within
/// [`MAX_MESSAGE_BYTES`] (see [`Update::split`]); a receiver refuses larger
/// ones.
pub fn encode(e: &Envelope) -> Vec<u8> {
    let body_len = match &e.body {
        Body::Update(u) => u.encoded_len(),
        Body::Hello { reply } => 1 + reply.len().min(MAX_STR8),
        Body::Snapshot { update, .. } => 8 + update.encoded_len(),
    };
    let mut out = Vec::with_capacity(31 + e.fleet.len().min(MAX_STR8) + body_len);
    out.extend_from_slice(MAGIC);
    out.push(PEER_FORMAT);
    put_str8(&mut out, &e.fleet);
    out.extend_from_slice(&e.list.to_le_bytes());
    out.extend_from_slice(&e.sender.to_le_bytes());
    out.extend_from_slice(&e.seq.to_le_bytes());
    match &e.body {
        Body::Update(update) => {
            out.push(KIND_UPDATE);
            put_update(&mut out, update);
        }
        Body::Hello { reply } => {
            out.push(KIND_HELLO);
            put_str8(&mut out, reply);
        }
        Body::Snapshot {
            part,
            parts,
            update,
        } => {
            out.push(KIND_SNAPSHOT);
            out.extend_from_slice(&part.to_le_bytes());
            out.extend_from_slice(&parts.to_le_bytes());
            put_update(&mut out, update);
        }
    }
    out
}

/// Writes a one-byte length and the string, cut to 255 bytes at a
/// character boundary.
fn put_str8(out: &mut Vec<u8>, s: &str) {
    let mut end = s.len().min(MAX_STR8);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    out.push(end as u8);
    out.extend_from_slice(&s.as_bytes()[..end]);
}

/// Writes the count of `items` (at most `u32::MAX`) and returns the items
/// it covers, so that the count always matches what follows.
fn put_count<'a, T>(out: &mut Vec<u8>, items: &'a [T]) -> &'a [T] {
    let n = u32::try_from(items.len()).unwrap_or(u32::MAX);
    out.extend_from_slice(&n.to_le_bytes());
    &items[..n as usize]
}

/// Writes an optional value as a presence byte and, when present, its bytes.
fn put_option<const N: usize>(out: &mut Vec<u8>, value: Option<[u8; N]>) {
    match value {
        Some(bytes) => {
            out.push(1);
            out.extend_from_slice(&bytes);
        }
        None => out.push(0),
    }
}

fn put_update(out: &mut Vec<u8>, u: &Update) {
    for w in put_count(out, &u.warmth) {
        out.extend_from_slice(&w.replica.to_le_bytes());
        for h in put_count(out, &w.hashes) {
            out.extend_from_slice(&h.to_le_bytes());
        }
        put_option(out, w.tip.map(u64::to_le_bytes));
    }
    for l in put_count(out, &u.load) {
        out.extend_from_slice(&l.replica.to_le_bytes());
        out.extend_from_slice(&l.in_flight.to_le_bytes());
        out.extend_from_slice(&l.load.to_le_bytes());
    }
    for h in put_count(out, &u.health) {
        out.extend_from_slice(&h.replica.to_le_bytes());
        put_option(out, h.rank.map(u16::to_le_bytes));
        out.push(u8::from(h.serving));
    }
}

/// Reads a message, refusing it whole when anything in it is off (see
/// [`PeerError`]). A cut-short message is always [`PeerError::Truncated`].
pub fn decode(bytes: &[u8]) -> Result<Envelope, PeerError> {
    if bytes.len() > MAX_MESSAGE_BYTES {
        return Err(PeerError::Oversized(bytes.len()));
    }
    let mut r = Reader { rest: bytes };
    if r.take(MAGIC.len())? != MAGIC {
        return Err(PeerError::Malformed("bad magic: not a peer message"));
    }
    let format = r.u8()?;
    if format != PEER_FORMAT {
        return Err(PeerError::Format(format));
    }
    let fleet = r.str8()?;
    let list = r.u64()?;
    let sender = r.u64()?;
    let seq = r.u64()?;
    let body = r.body()?;
    if !r.rest.is_empty() {
        return Err(PeerError::Malformed("bytes after the body"));
    }
    Ok(Envelope {
        fleet,
        list,
        sender,
        seq,
        body,
    })
}

/// The bytes of a message not read yet.
struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], PeerError> {
        if self.rest.len() < n {
            return Err(PeerError::Truncated);
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], PeerError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn u8(&mut self) -> Result<u8, PeerError> {
        self.array().map(u8::from_le_bytes)
    }

    fn u16(&mut self) -> Result<u16, PeerError> {
        self.array().map(u16::from_le_bytes)
    }

    fn u32(&mut self) -> Result<u32, PeerError> {
        self.array().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Result<u64, PeerError> {
        self.array().map(u64::from_le_bytes)
    }

    /// A presence or serving byte: 0 or 1, nothing else.
    fn flag(&mut self) -> Result<bool, PeerError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(PeerError::Malformed("a flag byte is neither 0 nor 1")),
        }
    }

    /// A one-byte length and that many bytes of UTF-8.
    fn str8(&mut self) -> Result<String, PeerError> {
        let len = usize::from(self.u8()?);
        let bytes = self.take(len)?;
        std::str::from_utf8(bytes)
            .map(str::to_owned)
            .map_err(|_| PeerError::Malformed("a string is not UTF-8"))
    }

    /// A count of items that take at least `min_bytes` each, refused before
    /// anything is allocated for them when the bytes left cannot hold that
    /// many.
    fn count(&mut self, min_bytes: usize) -> Result<usize, PeerError> {
        let n = usize::try_from(self.u32()?).map_err(|_| PeerError::Truncated)?;
        if n.saturating_mul(min_bytes) > self.rest.len() {
            return Err(PeerError::Truncated);
        }
        Ok(n)
    }

    /// `count` items read by `item`.
    fn list<T>(
        &mut self,
        min_bytes: usize,
        mut item: impl FnMut(&mut Self) -> Result<T, PeerError>,
    ) -> Result<Vec<T>, PeerError> {
        let n = self.count(min_bytes)?;
        let mut items = Vec::with_capacity(n);
        for _ in 0..n {
            items.push(item(self)?);
        }
        Ok(items)
    }

    fn body(&mut self) -> Result<Body, PeerError> {
        match self.u8()? {
            KIND_UPDATE => {
                let update = self.update()?;
                // An update's records are prompts some decision routed:
                // no more hashes than a fingerprint has, and a tip only
                // beside hashes (a tip alone names a resident
                // conversation, which only a snapshot lists).
                for w in &update.warmth {
                    if w.hashes.len() > MAX_RECORD_HASHES {
                        return Err(PeerError::Malformed(
                            "an update's warmth record holds more hashes than a fingerprint",
                        ));
                    }
                    if w.hashes.is_empty() && w.tip.is_some() {
                        return Err(PeerError::Malformed(
                            "an update's warmth record has a tip and no hashes",
                        ));
                    }
                }
                Ok(Body::Update(update))
            }
            KIND_HELLO => Ok(Body::Hello {
                reply: self.str8()?,
            }),
            KIND_SNAPSHOT => {
                let part = self.u32()?;
                let parts = self.u32()?;
                if part >= parts {
                    return Err(PeerError::Malformed("snapshot part not below its parts"));
                }
                Ok(Body::Snapshot {
                    part,
                    parts,
                    update: self.update()?,
                })
            }
            _ => Err(PeerError::Malformed("unknown message kind")),
        }
    }

    fn update(&mut self) -> Result<Update, PeerError> {
        Ok(Update {
            warmth: self.list(WARMTH_FIXED, Self::warmth)?,
            load: self.list(LOAD_BYTES, Self::load)?,
            health: self.list(HEALTH_FIXED, Self::health)?,
        })
    }

    fn warmth(&mut self) -> Result<Warmth, PeerError> {
        Ok(Warmth {
            replica: self.u16()?,
            hashes: self.list(HASH, Self::u64)?,
            tip: if self.flag()? {
                Some(self.u64()?)
            } else {
                None
            },
        })
    }

    fn load(&mut self) -> Result<Load, PeerError> {
        let replica = self.u16()?;
        let in_flight = self.u32()?;
        let load = f32::from_le_bytes(self.array()?);
        if !load.is_finite() {
            return Err(PeerError::Malformed("a load is not a finite number"));
        }
        Ok(Load {
            replica,
            in_flight,
            load,
        })
    }

    fn health(&mut self) -> Result<Health, PeerError> {
        Ok(Health {
            replica: self.u16()?,
            rank: if self.flag()? {
                Some(self.u16()?)
            } else {
                None
            },
            serving: self.flag()?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_documented_example_is_what_encode_writes() {
        let hello = Envelope {
            fleet: "f".into(),
            list: 1,
            sender: 2,
            seq: 3,
            body: Body::Hello { reply: "r".into() },
        };
        let mut expected = b"HRTP\x02\x01f".to_vec();
        for v in [1u64, 2, 3] {
            expected.extend_from_slice(&v.to_le_bytes());
        }
        expected.extend_from_slice(b"\x02\x01r");
        assert_eq!(expected.len(), 34);
        assert_eq!(encode(&hello), expected);
        assert_eq!(decode(&expected), Ok(hello));
    }

    #[test]
    fn a_count_beyond_the_bytes_left_is_refused_before_allocating() {
        let mut bytes = u32::MAX.to_le_bytes().to_vec();
        bytes.extend_from_slice(&[0; 20]);
        let mut r = Reader { rest: &bytes };
        assert_eq!(r.count(HASH), Err(PeerError::Truncated));
        // A count the bytes can hold is accepted: 20 bytes, 2 hashes.
        let mut bytes = 2u32.to_le_bytes().to_vec();
        bytes.extend_from_slice(&[0; 20]);
        let mut r = Reader { rest: &bytes };
        assert_eq!(r.count(HASH), Ok(2));
        let mut bytes = 3u32.to_le_bytes().to_vec();
        bytes.extend_from_slice(&[0; 20]);
        let mut r = Reader { rest: &bytes };
        assert_eq!(r.count(HASH), Err(PeerError::Truncated));
    }

    #[test]
    fn the_smallest_split_limit_holds_every_kind_of_figure() {
        assert_eq!(MIN_SPLIT_BYTES, 35);
        let biggest_health = Health {
            replica: 0,
            rank: Some(0),
            serving: true,
        };
        const { assert!(UPDATE_COUNTS + LOAD_BYTES <= MIN_SPLIT_BYTES) };
        assert!(UPDATE_COUNTS + biggest_health.encoded_len() <= MIN_SPLIT_BYTES);
        assert_eq!(UPDATE_COUNTS + warmth_len(1, true), MIN_SPLIT_BYTES);
    }

    #[test]
    fn a_long_fleet_name_is_cut_at_a_character_boundary() {
        // 128 two-byte characters: 256 bytes, one too many.
        let fleet = "é".repeat(128);
        let e = Envelope {
            fleet,
            list: 0,
            sender: 0,
            seq: 0,
            body: Body::Update(Update::default()),
        };
        let back = decode(&encode(&e)).map(|d| d.fleet);
        assert_eq!(back, Ok("é".repeat(127)));
    }
}

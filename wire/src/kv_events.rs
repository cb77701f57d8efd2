//! The engines' KV cache events: what vLLM (and SGLang, which speaks the
//! same protocol) publishes about its prefix cache, over ZMQ PUB, as
//! three frames per message: the topic, the batch's sequence number (8
//! bytes, big-endian, restarting at 0 when the engine does) and the batch,
//! msgpack-encoded.
//!
//! A batch is an array `[ts, events, data_parallel_rank]` (the rank may be
//! left out). Each event is a map tagged by its `type` (vLLM since 0.10:
//! `{"type": "BlockStored", "block_hashes": [..], ...}`) or, in older
//! versions, an array whose first item is the tag (`["BlockStored",
//! [..], parent, [token ids], block_size, lora_id, medium]`):
//!
//! - `BlockStored`: blocks entered the cache (`block_hashes`, the
//!   `parent_block_hash` they chain from, their `token_ids`,
//!   `block_size` tokens each, the `medium` holding them);
//! - `BlockRemoved`: blocks left it (`block_hashes`, `medium`);
//! - `AllBlocksCleared`: the whole cache was reset.
//!
//! A block hash is an integer (vLLM with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`,
//! signed or unsigned: both read as the same 64 bits) or bytes (vLLM's
//! default, a SHA-256 digest), which are folded into 64 bits (FNV-1a): a
//! block is named the same way in the event that stores it and the one that
//! removes it, which is all a reader of these events compares.
//!
//! [`decode_batch`] reads whatever a publisher sends without trusting it:
//! every length is checked against the bytes that remain before anything
//! is kept, values the reader does not need (token ids, LoRA names, extra
//! keys) are skipped without being held, nesting is bounded, and a batch
//! holds at most [`MAX_BATCH_EVENTS`] events and [`MAX_BATCH_HASHES`]
//! hashes. [`encode_batch`] writes the map form, for the simulated engine.
//! `golden/kv-events.json` holds batches encoded by vLLM's own classes.

/// Events one batch may hold (vLLM publishes one batch per engine step).
pub const MAX_BATCH_EVENTS: usize = 65_536;

/// Block hashes one batch may hold, over all its events: a step that
/// prefills 1,048,576 tokens in blocks of 16.
pub const MAX_BATCH_HASHES: usize = 65_536;

/// How deep the values a reader skips may nest.
const MAX_DEPTH: u32 = 16;

/// One decoded batch.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Batch {
    /// The publisher's clock when it made the batch (Unix seconds).
    pub ts: f64,
    pub events: Vec<Event>,
    /// The engine's data-parallel rank, when it says.
    pub data_parallel_rank: Option<i64>,
}

/// Where a block is held: the engine's own KV cache (vLLM's `GPU`, also
/// when no medium is named) or an offloading tier behind it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Medium {
    Device,
    Offloaded,
}

/// One event of a batch.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    Stored {
        hashes: Vec<u64>,
        parent: Option<u64>,
        /// How many token ids the event carried (the ids are not kept).
        tokens: u64,
        block_size: u64,
        medium: Medium,
    },
    Removed {
        hashes: Vec<u64>,
        medium: Medium,
    },
    AllCleared,
}

/// Why a batch could not be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("the batch ends inside a value")]
    Truncated,
    #[error("bytes after the batch")]
    Trailing,
    #[error("unexpected msgpack value: {0}")]
    Unexpected(&'static str),
    #[error("values nest deeper than {MAX_DEPTH}")]
    TooDeep,
    #[error("more than {MAX_BATCH_EVENTS} events or {MAX_BATCH_HASHES} hashes in one batch")]
    TooLarge,
    #[error("unknown event type")]
    UnknownEvent,
}

/// Reads one batch (the third frame of a message).
pub fn decode_batch(bytes: &[u8]) -> Result<Batch, DecodeError> {
    let mut r = Reader {
        buf: bytes,
        hashes: 0,
    };
    let batch = r.batch()?;
    if !r.buf.is_empty() {
        return Err(DecodeError::Trailing);
    }
    Ok(batch)
}

/// The batch's sequence number from its frame: 8 bytes, big-endian.
pub fn decode_sequence(frame: &[u8]) -> Option<u64> {
    Some(u64::from_be_bytes(frame.try_into().ok()?))
}

/// A byte-string block hash in 64 bits (FNV-1a).
pub fn fold_hash(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// A msgpack value's first byte, classified.
enum Head {
    Nil,
    Bool,
    Uint(u64),
    Int(i64),
    Float(f64),
    Str(usize),
    Bin(usize),
    Array(usize),
    Map(usize),
    /// An extension: its payload's length.
    Ext(usize),
}

struct Reader<'a> {
    buf: &'a [u8],
    /// Hashes kept so far in this batch.
    hashes: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if self.buf.len() < n {
            return Err(DecodeError::Truncated);
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }

    fn be(&mut self, n: usize) -> Result<u64, DecodeError> {
        Ok(self
            .take(n)?
            .iter()
            .fold(0u64, |v, b| (v << 8) | u64::from(*b)))
    }

    fn len(&mut self, n: usize) -> Result<usize, DecodeError> {
        usize::try_from(self.be(n)?).map_err(|_| DecodeError::Truncated)
    }

    fn head(&mut self) -> Result<Head, DecodeError> {
        let m = self.take(1)?[0];
        Ok(match m {
            0x00..=0x7f => Head::Uint(u64::from(m)),
            0x80..=0x8f => Head::Map(usize::from(m & 0x0f)),
            0x90..=0x9f => Head::Array(usize::from(m & 0x0f)),
            0xa0..=0xbf => Head::Str(usize::from(m & 0x1f)),
            0xc0 => Head::Nil,
            0xc2 | 0xc3 => Head::Bool,
            0xc4 => Head::Bin(self.len(1)?),
            0xc5 => Head::Bin(self.len(2)?),
            0xc6 => Head::Bin(self.len(4)?),
            0xc7 => Head::Ext(self.len(1)? + 1),
            0xc8 => Head::Ext(self.len(2)? + 1),
            0xc9 => Head::Ext(self.len(4)?.saturating_add(1)),
            0xca => Head::Float(f64::from(f32::from_bits(self.be(4)? as u32))),
            0xcb => Head::Float(f64::from_bits(self.be(8)?)),
            0xcc => Head::Uint(self.be(1)?),
            0xcd => Head::Uint(self.be(2)?),
            0xce => Head::Uint(self.be(4)?),
            0xcf => Head::Uint(self.be(8)?),
            0xd0 => Head::Int(i64::from(self.be(1)? as u8 as i8)),
            0xd1 => Head::Int(i64::from(self.be(2)? as u16 as i16)),
            0xd2 => Head::Int(i64::from(self.be(4)? as u32 as i32)),
            0xd3 => Head::Int(self.be(8)? as i64),
            0xd4 => Head::Ext(2),
            0xd5 => Head::Ext(3),
            0xd6 => Head::Ext(5),
            0xd7 => Head::Ext(9),
            0xd8 => Head::Ext(17),
            0xd9 => Head::Str(self.len(1)?),
            0xda => Head::Str(self.len(2)?),
            0xdb => Head::Str(self.len(4)?),
            0xdc => Head::Array(self.len(2)?),
            0xdd => Head::Array(self.len(4)?),
            0xde => Head::Map(self.len(2)?),
            0xdf => Head::Map(self.len(4)?),
            0xe0..=0xff => Head::Int(i64::from(m as i8)),
            0xc1 => return Err(DecodeError::Unexpected("reserved byte 0xc1")),
        })
    }

    /// An array or map of `n` items, each at least `per` bytes: a length
    /// the remaining bytes cannot hold is refused before anything is
    /// allocated for it.
    fn count(&self, n: usize, per: usize) -> Result<usize, DecodeError> {
        if n.saturating_mul(per) > self.buf.len() {
            return Err(DecodeError::Truncated);
        }
        Ok(n)
    }

    fn skip(&mut self, depth: u32) -> Result<(), DecodeError> {
        let head = self.head()?;
        self.skip_rest(head, depth)
    }

    fn skip_rest(&mut self, head: Head, depth: u32) -> Result<(), DecodeError> {
        if depth > MAX_DEPTH {
            return Err(DecodeError::TooDeep);
        }
        match head {
            Head::Str(n) | Head::Bin(n) | Head::Ext(n) => {
                self.take(n)?;
            }
            Head::Array(n) => {
                for _ in 0..self.count(n, 1)? {
                    self.skip(depth + 1)?;
                }
            }
            Head::Map(n) => {
                for _ in 0..self.count(n, 2)? {
                    self.skip(depth + 1)?;
                    self.skip(depth + 1)?;
                }
            }
            Head::Nil | Head::Bool | Head::Uint(_) | Head::Int(_) | Head::Float(_) => {}
        }
        Ok(())
    }

    fn str_of(&mut self, head: Head) -> Result<&'a [u8], DecodeError> {
        match head {
            Head::Str(n) => self.take(n),
            _ => Err(DecodeError::Unexpected("expected a string")),
        }
    }

    fn batch(&mut self) -> Result<Batch, DecodeError> {
        let mut batch = Batch::default();
        match self.head()? {
            Head::Array(n) => {
                let n = self.count(n, 1)?;
                if n < 2 {
                    return Err(DecodeError::Unexpected("a batch of fewer than 2 items"));
                }
                batch.ts = self.float()?;
                batch.events = self.events()?;
                if n > 2 {
                    batch.data_parallel_rank = self.opt_int()?;
                }
                for _ in 3..n {
                    self.skip(1)?;
                }
            }
            Head::Map(n) => {
                for _ in 0..self.count(n, 2)? {
                    let key = self.head()?;
                    match self.str_of(key)? {
                        b"ts" => batch.ts = self.float()?,
                        b"events" => batch.events = self.events()?,
                        b"data_parallel_rank" => batch.data_parallel_rank = self.opt_int()?,
                        _ => self.skip(1)?,
                    }
                }
            }
            _ => return Err(DecodeError::Unexpected("a batch is an array or a map")),
        }
        Ok(batch)
    }

    fn float(&mut self) -> Result<f64, DecodeError> {
        match self.head()? {
            Head::Float(f) => Ok(f),
            Head::Uint(u) => Ok(u as f64),
            Head::Int(i) => Ok(i as f64),
            _ => Err(DecodeError::Unexpected("expected a number")),
        }
    }

    fn opt_int(&mut self) -> Result<Option<i64>, DecodeError> {
        match self.head()? {
            Head::Nil => Ok(None),
            Head::Uint(u) => Ok(Some(u as i64)),
            Head::Int(i) => Ok(Some(i)),
            _ => Err(DecodeError::Unexpected("expected an integer")),
        }
    }

    fn opt_uint(&mut self) -> Result<u64, DecodeError> {
        match self.head()? {
            Head::Nil => Ok(0),
            Head::Uint(u) => Ok(u),
            Head::Int(i) => Ok(i.max(0) as u64),
            _ => Err(DecodeError::Unexpected("expected an integer")),
        }
    }

    fn events(&mut self) -> Result<Vec<Event>, DecodeError> {
        let n = match self.head()? {
            Head::Array(n) => self.count(n, 1)?,
            _ => return Err(DecodeError::Unexpected("events are an array")),
        };
        if n > MAX_BATCH_EVENTS {
            return Err(DecodeError::TooLarge);
        }
        let mut events = Vec::with_capacity(n);
        for _ in 0..n {
            events.push(self.event()?);
        }
        Ok(events)
    }

    fn hash_of(&mut self, head: Head) -> Result<u64, DecodeError> {
        match head {
            Head::Uint(u) => Ok(u),
            Head::Int(i) => Ok(i as u64),
            Head::Bin(n) => Ok(fold_hash(self.take(n)?)),
            _ => Err(DecodeError::Unexpected(
                "a block hash is an integer or bytes",
            )),
        }
    }

    fn opt_hash(&mut self) -> Result<Option<u64>, DecodeError> {
        match self.head()? {
            Head::Nil => Ok(None),
            head => self.hash_of(head).map(Some),
        }
    }

    fn hashes(&mut self) -> Result<Vec<u64>, DecodeError> {
        let n = match self.head()? {
            Head::Array(n) => self.count(n, 1)?,
            _ => return Err(DecodeError::Unexpected("block hashes are an array")),
        };
        self.hashes = self.hashes.saturating_add(n);
        if self.hashes > MAX_BATCH_HASHES {
            return Err(DecodeError::TooLarge);
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let head = self.head()?;
            out.push(self.hash_of(head)?);
        }
        Ok(out)
    }

    /// Token ids, counted and skipped.
    fn token_count(&mut self) -> Result<u64, DecodeError> {
        match self.head()? {
            Head::Nil => Ok(0),
            Head::Array(n) => {
                let n = self.count(n, 1)?;
                for _ in 0..n {
                    self.skip(1)?;
                }
                Ok(n as u64)
            }
            _ => Err(DecodeError::Unexpected("token ids are an array")),
        }
    }

    fn medium(&mut self) -> Result<Medium, DecodeError> {
        match self.head()? {
            Head::Nil => Ok(Medium::Device),
            head => Ok(match self.str_of(head)? {
                b"GPU" => Medium::Device,
                _ => Medium::Offloaded,
            }),
        }
    }

    fn event(&mut self) -> Result<Event, DecodeError> {
        match self.head()? {
            Head::Map(n) => self.event_map(self.count(n, 2)?),
            Head::Array(n) => self.event_array(self.count(n, 1)?),
            _ => Err(DecodeError::Unexpected("an event is a map or an array")),
        }
    }

    /// `{"type": ..., field: value, ...}`, keys in any order.
    fn event_map(&mut self, n: usize) -> Result<Event, DecodeError> {
        let mut kind: Option<&[u8]> = None;
        let (mut hashes, mut parent, mut tokens, mut block_size) = (Vec::new(), None, 0, 0);
        let mut medium = Medium::Device;
        for _ in 0..n {
            let key = self.head()?;
            match self.str_of(key)? {
                b"type" => {
                    let head = self.head()?;
                    kind = Some(self.str_of(head)?);
                }
                b"block_hashes" => {
                    self.hashes = self.hashes.saturating_sub(hashes.len());
                    hashes = self.hashes()?;
                }
                b"parent_block_hash" => parent = self.opt_hash()?,
                b"token_ids" => tokens = self.token_count()?,
                b"block_size" => block_size = self.opt_uint()?,
                b"medium" => medium = self.medium()?,
                _ => self.skip(1)?,
            }
        }
        match kind {
            Some(b"BlockStored") => Ok(Event::Stored {
                hashes,
                parent,
                tokens,
                block_size,
                medium,
            }),
            Some(b"BlockRemoved") => Ok(Event::Removed { hashes, medium }),
            Some(b"AllBlocksCleared") => Ok(Event::AllCleared),
            _ => Err(DecodeError::UnknownEvent),
        }
    }

    /// `[tag, fields in declaration order...]` (vLLM before 0.10).
    fn event_array(&mut self, n: usize) -> Result<Event, DecodeError> {
        if n == 0 {
            return Err(DecodeError::UnknownEvent);
        }
        let head = self.head()?;
        let tag = self.str_of(head)?;
        let mut left = n - 1;
        // Reads the next field when the array has one.
        macro_rules! field {
            ($read:expr, $default:expr) => {
                if left > 0 {
                    left -= 1;
                    $read
                } else {
                    $default
                }
            };
        }
        let event = match tag {
            b"BlockStored" => {
                let hashes = field!(self.hashes()?, Vec::new());
                let parent = field!(self.opt_hash()?, None);
                let tokens = field!(self.token_count()?, 0);
                let block_size = field!(self.opt_uint()?, 0);
                field!(self.skip(1)?, ()); // lora_id
                let medium = field!(self.medium()?, Medium::Device);
                Event::Stored {
                    hashes,
                    parent,
                    tokens,
                    block_size,
                    medium,
                }
            }
            b"BlockRemoved" => {
                let hashes = field!(self.hashes()?, Vec::new());
                let medium = field!(self.medium()?, Medium::Device);
                Event::Removed { hashes, medium }
            }
            b"AllBlocksCleared" => Event::AllCleared,
            _ => return Err(DecodeError::UnknownEvent),
        };
        for _ in 0..left {
            self.skip(1)?;
        }
        Ok(event)
    }
}

/// Writes `batch` as vLLM does today: `[ts, events, rank]`, each event a
/// map tagged by `type`, hashes as unsigned integers, `token_ids` as
/// given (the simulated engine has no token ids of its own and sends
/// `tokens` zeros).
pub fn encode_batch(batch: &Batch) -> Vec<u8> {
    let mut w = Writer(Vec::new());
    let rank = batch.data_parallel_rank;
    w.array(if rank.is_some() { 3 } else { 2 });
    w.float(batch.ts);
    w.array(batch.events.len());
    for event in &batch.events {
        match event {
            Event::Stored {
                hashes,
                parent,
                tokens,
                block_size,
                medium,
            } => {
                w.map(8);
                w.str("type");
                w.str("BlockStored");
                w.str("block_hashes");
                w.hashes(hashes);
                w.str("parent_block_hash");
                match parent {
                    Some(p) => w.uint(*p),
                    None => w.nil(),
                }
                w.str("token_ids");
                w.array(*tokens as usize);
                for _ in 0..*tokens {
                    w.uint(0);
                }
                w.str("block_size");
                w.uint(*block_size);
                w.str("lora_id");
                w.nil();
                w.str("medium");
                w.medium(*medium);
                w.str("lora_name");
                w.nil();
            }
            Event::Removed { hashes, medium } => {
                w.map(3);
                w.str("type");
                w.str("BlockRemoved");
                w.str("block_hashes");
                w.hashes(hashes);
                w.str("medium");
                w.medium(*medium);
            }
            Event::AllCleared => {
                w.map(1);
                w.str("type");
                w.str("AllBlocksCleared");
            }
        }
    }
    if let Some(rank) = rank {
        if rank >= 0 {
            w.uint(rank as u64);
        } else {
            w.0.push(0xd3);
            w.0.extend_from_slice(&rank.to_be_bytes());
        }
    }
    w.0
}

struct Writer(Vec<u8>);

impl Writer {
    fn sized(&mut self, n: usize, fix: u8, fix_max: usize, m16: u8, m32: u8) {
        if n <= fix_max {
            self.0.push(fix | n as u8);
        } else if let Ok(n) = u16::try_from(n) {
            self.0.push(m16);
            self.0.extend_from_slice(&n.to_be_bytes());
        } else {
            self.0.push(m32);
            self.0.extend_from_slice(&(n as u32).to_be_bytes());
        }
    }
    fn array(&mut self, n: usize) {
        self.sized(n, 0x90, 15, 0xdc, 0xdd);
    }
    fn map(&mut self, n: usize) {
        self.sized(n, 0x80, 15, 0xde, 0xdf);
    }
    fn str(&mut self, s: &str) {
        if s.len() < 32 {
            self.0.push(0xa0 | s.len() as u8);
        } else {
            self.0.push(0xd9);
            self.0.push(s.len() as u8);
        }
        self.0.extend_from_slice(s.as_bytes());
    }
    fn nil(&mut self) {
        self.0.push(0xc0);
    }
    fn float(&mut self, f: f64) {
        self.0.push(0xcb);
        self.0.extend_from_slice(&f.to_bits().to_be_bytes());
    }
    fn uint(&mut self, v: u64) {
        if v < 0x80 {
            self.0.push(v as u8);
        } else if let Ok(v) = u32::try_from(v) {
            self.0.push(0xce);
            self.0.extend_from_slice(&v.to_be_bytes());
        } else {
            self.0.push(0xcf);
            self.0.extend_from_slice(&v.to_be_bytes());
        }
    }
    fn hashes(&mut self, hashes: &[u64]) {
        self.array(hashes.len());
        for h in hashes {
            self.uint(*h);
        }
    }
    fn medium(&mut self, m: Medium) {
        self.str(match m {
            Medium::Device => "GPU",
            Medium::Offloaded => "CPU",
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(hashes: Vec<u64>, parent: Option<u64>) -> Event {
        Event::Stored {
            tokens: 16 * hashes.len() as u64,
            hashes,
            parent,
            block_size: 16,
            medium: Medium::Device,
        }
    }

    #[test]
    fn what_the_encoder_writes_reads_back() {
        let batch = Batch {
            ts: 1.5,
            events: vec![
                stored(vec![1, u64::MAX, 1 << 40], Some(7)),
                stored(vec![2], None),
                Event::Removed {
                    hashes: vec![1, 300],
                    medium: Medium::Device,
                },
                Event::AllCleared,
            ],
            data_parallel_rank: Some(0),
        };
        assert_eq!(decode_batch(&encode_batch(&batch)), Ok(batch));
        let unranked = Batch {
            data_parallel_rank: None,
            ..Batch::default()
        };
        assert_eq!(decode_batch(&encode_batch(&unranked)), Ok(unranked));
    }

    #[test]
    fn sequences_are_eight_bytes_big_endian() {
        assert_eq!(decode_sequence(&[0, 0, 0, 0, 0, 0, 1, 2]), Some(258));
        assert_eq!(decode_sequence(&[1, 2]), None);
        assert_eq!(decode_sequence(&[0; 9]), None);
    }

    /// Hand-written per the msgpack spec: an array-encoded batch with an
    /// old-style array event, a signed hash, and a float32 timestamp.
    #[test]
    fn reads_the_array_form_and_signed_hashes() {
        let bytes = [
            0x93, // [ts, events, rank]
            0xca, 0x3f, 0xc0, 0x00, 0x00, // float32 1.5
            0x92, // two events
            0x96, // ["BlockStored", [-2], nil, [5, 6], 2, nil]
            0xab, b'B', b'l', b'o', b'c', b'k', b'S', b't', b'o', b'r', b'e', b'd', 0x91, 0xfe,
            0xc0, 0x92, 0x05, 0x06, 0x02, 0xc0, //
            0x92, // ["BlockRemoved", [0xd3 -2]]
            0xac, b'B', b'l', b'o', b'c', b'k', b'R', b'e', b'm', b'o', b'v', b'e', b'd', 0x91,
            0xd3, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xfe, //
            0xc0, // rank nil
        ];
        let b = decode_batch(&bytes).unwrap();
        assert_eq!(b.ts, 1.5);
        assert_eq!(b.data_parallel_rank, None);
        assert_eq!(
            b.events,
            vec![
                Event::Stored {
                    hashes: vec![u64::MAX - 1],
                    parent: None,
                    tokens: 2,
                    block_size: 2,
                    medium: Medium::Device
                },
                Event::Removed {
                    hashes: vec![u64::MAX - 1],
                    medium: Medium::Device
                }
            ]
        );
    }

    #[test]
    fn hostile_batches_are_refused_without_allocating_their_claims() {
        // An array claiming 2^32-1 events in five bytes.
        assert_eq!(
            decode_batch(&[0x92, 0x00, 0xdd, 0xff, 0xff, 0xff, 0xff]),
            Err(DecodeError::Truncated)
        );
        // A string claiming 4 GiB.
        assert_eq!(
            decode_batch(&[0x92, 0x00, 0x91, 0xdb, 0xff, 0xff, 0xff, 0xff]),
            Err(DecodeError::Unexpected("an event is a map or an array"))
        );
        // Nesting without end inside a skipped value.
        let mut deep = vec![0x92, 0x00, 0x91, 0x82, 0xa4];
        deep.extend_from_slice(b"type");
        deep.extend_from_slice(&[0xb0]);
        deep.extend_from_slice(b"AllBlocksCleared");
        deep.extend_from_slice(&[0xa1, b'x']);
        deep.extend(std::iter::repeat_n(0x91, 10_000));
        deep.push(0xc0);
        assert_eq!(decode_batch(&deep), Err(DecodeError::TooDeep));
        // More hashes than a batch may hold, spread over events.
        let many = Batch {
            ts: 0.0,
            events: (0..3)
                .map(|_| Event::Removed {
                    hashes: vec![1; MAX_BATCH_HASHES / 2],
                    medium: Medium::Device,
                })
                .collect(),
            data_parallel_rank: None,
        };
        assert_eq!(
            decode_batch(&encode_batch(&many)),
            Err(DecodeError::TooLarge)
        );
        // Garbage, an empty frame, trailing bytes, an unknown event, the
        // reserved marker, a bad type for every field.
        let ok = encode_batch(&Batch::default());
        let mut trailing = ok.clone();
        trailing.push(0);
        assert_eq!(decode_batch(&trailing), Err(DecodeError::Trailing));
        assert_eq!(decode_batch(&[]), Err(DecodeError::Truncated));
        assert!(decode_batch(&[0xc1]).is_err());
        assert_eq!(
            decode_batch(&[0x92, 0x00, 0x91, 0x81, 0xa4, b't', b'y', b'p', b'e', 0xa1, b'X']),
            Err(DecodeError::UnknownEvent)
        );
        assert_eq!(
            decode_batch(&[0x92, 0x00, 0x91, 0x90]),
            Err(DecodeError::UnknownEvent)
        );
        // Every prefix of a good batch is refused, never a panic.
        let good = encode_batch(&Batch {
            ts: 2.0,
            events: vec![stored(vec![1, 2, 3], Some(9)), Event::AllCleared],
            data_parallel_rank: Some(3),
        });
        for cut in 0..good.len() {
            assert!(decode_batch(&good[..cut]).is_err(), "{cut}");
        }
    }

    #[test]
    fn byte_hashes_fold_into_64_bits() {
        assert_eq!(fold_hash(b""), 0xcbf2_9ce4_8422_2325);
        assert_ne!(fold_hash(&[1; 32]), fold_hash(&[2; 32]));
        let bytes = [0x92, 0x00, 0x91, 0x92, 0xac];
        let mut b = bytes.to_vec();
        b.extend_from_slice(b"BlockRemoved");
        b.extend_from_slice(&[0x91, 0xc4, 0x02, 0xaa, 0xbb]);
        assert_eq!(
            decode_batch(&b).unwrap().events,
            vec![Event::Removed {
                hashes: vec![fold_hash(&[0xaa, 0xbb])],
                medium: Medium::Device
            }]
        );
    }
}

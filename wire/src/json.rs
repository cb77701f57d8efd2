//! JSON read in place: validation, string decoding and canonical JSON,
//! straight from the body's bytes.
//!
//! Nothing here builds a tree, so what a body costs follows its bytes, not
//! its shape: a scan validates a value with no memory but its nesting, and
//! canonical JSON is written from the body itself. The one thing a scan
//! cannot do is sort an object's keys; for that, [`Scratch`] holds the key
//! and value offsets of the value being written (8 bytes a member, 8 more
//! per object of several members), at most [`MAX_KEYS`] members.
//!
//! Canonical JSON is written as `json.rs` always has (the crate docs): no
//! whitespace, keys sorted by their bytes with the last of a repeated key
//! kept, one escaping of strings, integers as given and every other number
//! as the nearest f64 written by Rust's `{:e}` (shortest digits, always
//! with an exponent, so no number's canonical form is much longer than its
//! text). It is hand-written so the bytes do not depend on serde_json's
//! features.

use crate::SkipReason;
use std::cell::Cell;
use std::cmp::Ordering;
use std::fmt::Write as _;

/// Deepest nesting of arrays and objects (serde_json's limit: the same
/// bodies parse).
pub(crate) const MAX_DEPTH: usize = 127;

/// Most object keys one value written as canonical JSON may hold (a tool,
/// a content part, an input item: the items of an array count apart).
/// Past it the body is skipped as [`SkipReason::TooComplex`]: routed on
/// load.
pub(crate) const MAX_KEYS: usize = 1 << 15;

pub(crate) type Res<T> = Result<T, SkipReason>;
const BAD: SkipReason = SkipReason::NotJson;

/// Where canonical bytes go.
pub(crate) trait Sink {
    /// Whether the sink drops everything it is given ([`Nowhere`]): a
    /// number is then only read, not written again.
    const DROPS: bool = false;
    /// The next canonical bytes.
    fn put(&mut self, bytes: &[u8]);
    /// The next canonical byte (a bracket, a record's tag): a sink may
    /// take it faster than a slice.
    #[inline]
    fn put_byte(&mut self, byte: u8) {
        self.put(&[byte]);
    }
    /// Whether the sink still keeps what it is given. Once it only counts,
    /// [`Sink::count`] may stand for bytes that were never written out.
    fn keeps(&self) -> bool {
        true
    }
    /// `n` next canonical bytes, not written out (only once `keeps()` is
    /// false).
    fn count(&mut self, n: usize);
}

impl Sink for Vec<u8> {
    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }

    /// Never called: a `Vec` keeps everything.
    fn count(&mut self, _: usize) {}
}

/// A sink that drops what it is given: [`Json::array`] only validating.
pub(crate) struct Nowhere;

impl Sink for Nowhere {
    const DROPS: bool = true;

    #[inline]
    fn put(&mut self, _: &[u8]) {}

    fn count(&mut self, _: usize) {}
}

/// A body known to be UTF-8, read by byte offsets. Offsets past the end
/// read as NUL, which JSON never allows where a value or a token is
/// expected, so running off the end is always an error, never a panic.
#[derive(Clone, Copy)]
pub(crate) struct Json<'a> {
    s: &'a str,
}

impl<'a> Json<'a> {
    /// `body` as JSON text: UTF-8 throughout (RFC 8259), and small enough
    /// for 32-bit offsets.
    pub(crate) fn new(body: &'a [u8]) -> Res<Self> {
        if u32::try_from(body.len()).is_err() {
            return Err(SkipReason::TooComplex);
        }
        let s = std::str::from_utf8(body).map_err(|_| BAD)?;
        Ok(Json { s })
    }

    #[inline]
    pub(crate) fn at(&self, i: usize) -> u8 {
        self.s.as_bytes().get(i).copied().unwrap_or(0)
    }

    fn text(&self, from: usize, to: usize) -> &'a str {
        self.s.get(from..to).unwrap_or_default()
    }

    pub(crate) fn bytes(&self, from: usize, to: usize) -> &'a [u8] {
        self.s.as_bytes().get(from..to).unwrap_or_default()
    }

    #[inline]
    pub(crate) fn ws(&self, mut i: usize) -> usize {
        while matches!(self.at(i), b' ' | b'\t' | b'\n' | b'\r') {
            i += 1;
        }
        i
    }

    /// Validates the whole body (one value, whitespace around it) and
    /// returns where the value starts.
    pub(crate) fn document(&self) -> Res<usize> {
        let start = self.ws(0);
        let end = self.skip(start, 0)?;
        if self.ws(end) != self.s.len() {
            return Err(BAD);
        }
        Ok(start)
    }

    /// Validates the value at `i` (at its first byte) inside `depth`
    /// arrays and objects; returns where it ends.
    pub(crate) fn skip(&self, i: usize, depth: usize) -> Res<usize> {
        match self.at(i) {
            b'"' => self.string_end(i),
            b'{' => self.members(i, depth, |_, v| self.skip(v, depth + 1)),
            b'[' => self.array(i, depth, &mut Nowhere, |v, d, _| self.skip(v, d)),
            b't' => self.literal(i, "true"),
            b'f' => self.literal(i, "false"),
            b'n' => self.literal(i, "null"),
            _ if self.one_digit(i) => Ok(i + 1),
            b'-' | b'0'..=b'9' => self.number_end(i),
            _ => Err(BAD),
        }
    }

    fn literal(&self, i: usize, lit: &str) -> Res<usize> {
        if self.s.as_bytes().get(i..i + lit.len()) == Some(lit.as_bytes()) {
            Ok(i + lit.len())
        } else {
            Err(BAD)
        }
    }

    /// Where the value at `i` ends, for a body already validated (by
    /// [`Json::document`] or a scan of the whole body): brackets counted
    /// and strings stepped over, nothing checked again. The second item
    /// says whether an object opens inside (or is the value). On a body
    /// not validated it still ends, at the end of the body at the latest.
    pub(crate) fn end_of(&self, i: usize) -> (usize, bool) {
        let bytes = self.s.as_bytes();
        match self.at(i) {
            b'"' => (self.string_end(i).unwrap_or(bytes.len()), false),
            b'[' | b'{' => {
                let (mut open, mut objects) = (0usize, false);
                let mut j = i;
                loop {
                    // Everything but quotes and brackets is passed over.
                    while bytes.get(j).is_some_and(|&c| !STRUCTURE[usize::from(c)]) {
                        j += 1;
                    }
                    match bytes.get(j) {
                        None => return (bytes.len(), objects),
                        Some(b'"') => {
                            j = self.string_end(j).unwrap_or(bytes.len());
                            continue;
                        }
                        Some(b'{') => {
                            objects = true;
                            open += 1;
                        }
                        Some(b'[') => open += 1,
                        Some(_) => {
                            open = open.saturating_sub(1);
                            if open == 0 {
                                return (j + 1, objects);
                            }
                        }
                    }
                    j += 1;
                }
            }
            _ => {
                // A number or a literal.
                let mut j = i;
                while self.at(j).is_ascii_alphanumeric() || matches!(self.at(j), b'-' | b'+' | b'.')
                {
                    j += 1;
                }
                (j, false)
            }
        }
    }

    /// Calls `f(key, value)` for each member of the object at `i`: the key
    /// at its opening quote, the value at its first byte; `f` returns where
    /// the value ends. Returns where the object ends.
    pub(crate) fn members(
        &self,
        i: usize,
        depth: usize,
        mut f: impl FnMut(usize, usize) -> Res<usize>,
    ) -> Res<usize> {
        if depth >= MAX_DEPTH || self.at(i) != b'{' {
            return Err(BAD);
        }
        let mut j = self.ws(i + 1);
        if self.at(j) == b'}' {
            return Ok(j + 1);
        }
        loop {
            if self.at(j) != b'"' {
                return Err(BAD);
            }
            let key = j;
            j = self.ws(self.key_end(j)?);
            if self.at(j) != b':' {
                return Err(BAD);
            }
            j = self.ws(f(key, self.ws(j + 1))?);
            match self.at(j) {
                b',' => j = self.ws(j + 1),
                b'}' => return Ok(j + 1),
                _ => return Err(BAD),
            }
        }
    }

    /// Calls `f(value)` for each item of the array at `i`; `f` returns where
    /// the item ends. Returns where the array ends.
    pub(crate) fn items(
        &self,
        i: usize,
        depth: usize,
        mut f: impl FnMut(usize) -> Res<usize>,
    ) -> Res<usize> {
        if depth >= MAX_DEPTH || self.at(i) != b'[' {
            return Err(BAD);
        }
        let mut j = self.ws(i + 1);
        if self.at(j) == b']' {
            return Ok(j + 1);
        }
        loop {
            j = self.ws(f(j)?);
            match self.at(j) {
                b',' => j = self.ws(j + 1),
                b']' => return Ok(j + 1),
                _ => return Err(BAD),
            }
        }
    }

    /// Reads the array at `i` (inside `depth` arrays and objects) and the
    /// arrays nested in it, in one loop rather than a call per item and
    /// level, writing them to `out` as canonical JSON where they are
    /// canonical as they stand: brackets, commas and the items of
    /// [`Json::verbatim_end`], whitespace dropped, in runs of the body as
    /// long as nothing else comes between. A number is read (validated)
    /// here and, when not canonical as it stands, written again here
    /// (unless `out` drops everything). Any other item (an object, a
    /// string to rewrite) goes to `item(value, its depth, out)`, which
    /// returns where it ends. Returns where the array ends.
    ///
    /// So an array of many tiny items or many levels costs a scan of its
    /// bytes, not a call and a write per item.
    pub(crate) fn array<S: Sink>(
        &self,
        i: usize,
        depth: usize,
        out: &mut S,
        mut item: impl FnMut(usize, usize, &mut S) -> Res<usize>,
    ) -> Res<usize> {
        if depth >= MAX_DEPTH || self.at(i) != b'[' {
            return Err(BAD);
        }
        // The body's bytes from `run` to `j` are still to be written as
        // they stand; whitespace ends a run, and what `item` writes.
        let mut run = i;
        let mut open = 1;
        let mut j = i + 1;
        // Just after a `[`: an item or `]`.
        let mut opened = true;
        loop {
            j = self.gap(&mut run, j, out);
            match self.at(j) {
                b']' if opened => {
                    j += 1;
                    open -= 1;
                }
                b'[' => {
                    if depth + open >= MAX_DEPTH {
                        return Err(BAD);
                    }
                    open += 1;
                    j += 1;
                    opened = true;
                    continue;
                }
                b'-' | b'0'..=b'9' => {
                    let (end, form) = self.number(j).ok_or(BAD)?;
                    match form {
                        NumberForm::Canonical => {}
                        _ if S::DROPS => {}
                        NumberForm::Power {
                            e,
                            negative,
                            digits,
                        } => {
                            // The power's digits start the next run.
                            out.put(self.bytes(run, e));
                            out.put(if negative { b"e-" } else { b"e" });
                            run = digits;
                        }
                        _ => {
                            out.put(self.bytes(run, j));
                            self.rewrite_number(j, end, form, out)?;
                            run = end;
                        }
                    }
                    j = if end == j + 1 {
                        // One digit: so may the next items be.
                        self.digit_items(end)
                    } else {
                        end
                    };
                }
                _ => match self.verbatim_end(j) {
                    Some(end) if self.at(j) != b'{' || depth + open < MAX_DEPTH => j = end,
                    _ => {
                        out.put(self.bytes(run, j));
                        j = item(j, depth + open, out)?;
                        run = j;
                    }
                },
            }
            opened = false;
            // After an item: `,` and the next, or `]` (and maybe more).
            loop {
                if open == 0 {
                    out.put(self.bytes(run, j));
                    return Ok(j);
                }
                j = self.gap(&mut run, j, out);
                match self.at(j) {
                    b',' => {
                        j += 1;
                        break;
                    }
                    b']' => {
                        j += 1;
                        open -= 1;
                    }
                    _ => return Err(BAD),
                }
            }
        }
    }

    /// Skips the whitespace at `j`, which canonical JSON drops: the run
    /// of body bytes before it (from `run`) is written out, and the next
    /// run starts after it.
    #[inline(always)]
    fn gap<S: Sink>(&self, run: &mut usize, j: usize, out: &mut S) -> usize {
        if !matches!(self.at(j), b' ' | b'\t' | b'\n' | b'\r') {
            return j;
        }
        out.put(self.bytes(*run, j));
        *run = self.ws(j);
        *run
    }

    // -- strings --------------------------------------------------------

    /// [`Json::string_end`] for a key: most are short and plain, so the
    /// first bytes are read one at a time before the long way.
    #[inline]
    fn key_end(&self, i: usize) -> Res<usize> {
        if let Some(end) = self.short_plain_end(i) {
            return Ok(end);
        }
        self.string_end(i)
    }

    /// Where the string opening at `i` ends when it is plain (no escape,
    /// no control character) and its closing quote is among its first
    /// bytes; `None` says nothing else.
    #[inline(always)]
    fn short_plain_end(&self, i: usize) -> Option<usize> {
        if self.at(i) != b'"' {
            return None;
        }
        for j in i + 1..i + 10 {
            match self.at(j) {
                b'"' => return Some(j + 1),
                b'\\' | 0..=0x1f => return None,
                _ => {}
            }
        }
        None
    }

    /// The end of the string opening at `i`, validated as [`Json::decode`]
    /// validates it, without decoding.
    pub(crate) fn string_end(&self, i: usize) -> Res<usize> {
        if self.at(i) != b'"' {
            return Err(BAD);
        }
        let bytes = self.s.as_bytes();
        let mut j = i + 1;
        loop {
            j += plain_run(bytes.get(j..).unwrap_or_default()).ok_or(BAD)?;
            match (self.at(j), self.at(j + 1)) {
                (b'"', _) => return Ok(j + 1),
                (b'\\', b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => j += 2,
                (b'\\', b'u') => j = self.escape(j)?.1,
                _ => return Err(BAD),
            }
        }
    }

    /// Decodes the string opening at `i`, giving its text to `f` in pieces;
    /// returns where the string ends.
    pub(crate) fn decode(&self, i: usize, mut f: impl FnMut(&str)) -> Res<usize> {
        if self.at(i) != b'"' {
            return Err(BAD);
        }
        let bytes = self.s.as_bytes();
        let mut j = i + 1;
        loop {
            let run = plain_run(bytes.get(j..).unwrap_or_default()).ok_or(BAD)?;
            if run > 0 {
                f(self.text(j, j + run));
            }
            j += run;
            match self.at(j) {
                b'"' => return Ok(j + 1),
                b'\\' => {
                    let (c, end) = self.escape(j)?;
                    f(c.encode_utf8(&mut [0; 4]));
                    j = end;
                }
                _ => return Err(BAD),
            }
        }
    }

    /// The escape at `j` (its backslash): the character and where it ends.
    /// A `\u` surrogate must come in a pair.
    fn escape(&self, j: usize) -> Res<(char, usize)> {
        let c = match self.at(j + 1) {
            b'"' => '"',
            b'\\' => '\\',
            b'/' => '/',
            b'b' => '\u{8}',
            b'f' => '\u{c}',
            b'n' => '\n',
            b'r' => '\r',
            b't' => '\t',
            b'u' => {
                let hi = self.hex4(j + 2)?;
                return match hi {
                    0xD800..=0xDBFF => {
                        if self.at(j + 6) != b'\\' || self.at(j + 7) != b'u' {
                            return Err(BAD);
                        }
                        let lo = self.hex4(j + 8)?;
                        if !(0xDC00..=0xDFFF).contains(&lo) {
                            return Err(BAD);
                        }
                        let c = 0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00);
                        Ok((char::from_u32(c).ok_or(BAD)?, j + 12))
                    }
                    _ => Ok((char::from_u32(hi).ok_or(BAD)?, j + 6)),
                };
            }
            _ => return Err(BAD),
        };
        Ok((c, j + 2))
    }

    fn hex4(&self, i: usize) -> Res<u32> {
        let mut v = 0;
        for k in i..i + 4 {
            let d = char::from(self.at(k)).to_digit(16).ok_or(BAD)?;
            v = v * 16 + d;
        }
        Ok(v)
    }

    /// The decoded bytes of the (valid) string opening at `i`.
    fn decoded(&self, i: usize) -> Decoded<'a> {
        Decoded {
            json: *self,
            i: i + 1,
            buf: [0; 4],
            at: 0,
            len: 0,
        }
    }

    /// The (valid) string opening at `i`, decoded, when it is short enough
    /// to be one of the field names the canonical form reads.
    pub(crate) fn short_string(&self, i: usize) -> Option<Short> {
        let mut s = Short {
            buf: [0; SHORT],
            len: 0,
        };
        for b in self.decoded(i) {
            *s.buf.get_mut(s.len)? = b;
            s.len += 1;
        }
        Some(s)
    }

    /// Whether the (valid) string opening at `i` decodes to `lit`.
    pub(crate) fn string_is(&self, i: usize, lit: &str) -> bool {
        self.decoded(i).eq(lit.bytes())
    }

    /// Orders the (valid) strings opening at `a` and `b` by their decoded
    /// bytes: the body's own bytes while neither has an escape.
    #[inline]
    fn cmp_strings(&self, a: usize, b: usize) -> Ordering {
        // Most keys differ in their first byte: told apart here, with no
        // call.
        let (p, q) = (self.at(a + 1), self.at(b + 1));
        let ends = |c| matches!(c, b'"' | b'\\' | 0);
        if p != q && !ends(p) && !ends(q) {
            return p.cmp(&q);
        }
        self.cmp_strings_from(a, b)
    }

    /// [`Json::cmp_strings`] byte by byte, decoding from the first escape.
    fn cmp_strings_from(&self, a: usize, b: usize) -> Ordering {
        let (mut x, mut y) = (a + 1, b + 1);
        loop {
            let (p, q) = (self.at(x), self.at(y));
            if p == b'\\' || q == b'\\' {
                // From here on, decoded (what came before is equal).
                return self.decoded(x - 1).cmp(self.decoded(y - 1));
            }
            // (A string ends at its quote; the body's end stops a scan
            // of one not validated.)
            match (matches!(p, b'"' | 0), matches!(q, b'"' | 0)) {
                (true, true) => return Ordering::Equal,
                (true, false) => return Ordering::Less,
                (false, true) => return Ordering::Greater,
                _ if p != q => return p.cmp(&q),
                _ => {}
            }
            x += 1;
            y += 1;
        }
    }

    // -- numbers --------------------------------------------------------

    /// The end of the number starting at `i` (JSON's grammar; any size).
    fn number_end(&self, i: usize) -> Res<usize> {
        let mut j = i;
        if self.at(j) == b'-' {
            j += 1;
        }
        match self.at(j) {
            b'0' => j += 1,
            b'1'..=b'9' => j = self.digits(j),
            _ => return Err(BAD),
        }
        if self.at(j) == b'.' {
            let k = self.digits(j + 1);
            if k == j + 1 {
                return Err(BAD);
            }
            j = k;
        }
        if matches!(self.at(j), b'e' | b'E') {
            j += 1;
            if matches!(self.at(j), b'+' | b'-') {
                j += 1;
            }
            let k = self.digits(j);
            if k == j {
                return Err(BAD);
            }
            j = k;
        }
        Ok(j)
    }

    fn digits(&self, mut j: usize) -> usize {
        while self.at(j).is_ascii_digit() {
            j += 1;
        }
        j
    }

    /// The number at `i` as an unsigned integer, when it is written as one
    /// (as serde_json's `as_u64` reads it).
    pub(crate) fn as_u64(&self, i: usize) -> Option<u64> {
        let end = self.number_end(i).ok()?;
        self.text(i, end).parse().ok()
    }

    /// The number at `i` as the nearest f64 (None past f64's range).
    pub(crate) fn as_f64(&self, i: usize) -> Option<f64> {
        let end = self.number_end(i).ok()?;
        self.text(i, end)
            .parse()
            .ok()
            .filter(|x: &f64| x.is_finite())
    }

    // -- canonical JSON -------------------------------------------------

    /// Writes the canonical JSON of the value at `i` (validated) to `out`;
    /// returns where the value ends. `scratch` is reused between values.
    pub(crate) fn canonical(
        &self,
        i: usize,
        scratch: &mut Scratch,
        out: &mut impl Sink,
    ) -> Res<usize> {
        if !matches!(self.at(i), b'{' | b'[') {
            // Nothing to sort.
            return self.write(i, scratch, out);
        }
        if self.at(i) == b'[' {
            // An array's items are sorted apart, so each is indexed on its
            // own: a tool list costs what its largest tool does.
            return self.array(i, 0, out, |v, _, out| self.canonical(v, scratch, out));
        }
        scratch.index(self, i)?;
        self.write(i, scratch, out)
    }

    /// Where the value at `i` ends when it is its own canonical form and
    /// simple to tell so: an integer of at most 18 digits, a number in the
    /// form `{:e}` writes (see [`Json::number`]), a literal, a string with
    /// no escape, `{}` or `[]` (no whitespace inside). What it accepts is
    /// valid JSON. `None` says nothing about the value, valid or not.
    #[inline(always)]
    pub(crate) fn verbatim_end(&self, i: usize) -> Option<usize> {
        let c = self.at(i);
        if self.one_digit(i) {
            return Some(i + 1);
        }
        if c.is_ascii_digit() || c == b'-' {
            return match self.number(i) {
                Some((end, NumberForm::Canonical)) => Some(end),
                _ => None,
            };
        }
        match c {
            b'"' => {
                let end = i + 1 + plain_run(self.s.as_bytes().get(i + 1..)?)?;
                (self.at(end) == b'"').then_some(end + 1)
            }
            b't' => self.literal(i, "true").ok(),
            b'f' => self.literal(i, "false").ok(),
            b'n' => self.literal(i, "null").ok(),
            b'{' => (self.at(i + 1) == b'}').then_some(i + 2),
            b'[' => (self.at(i + 1) == b']').then_some(i + 2),
            _ => None,
        }
    }

    /// Where the numbers of one digit after `j`, each after its comma,
    /// end (`,1,2,3`): items of an array read in one loop.
    #[inline(never)]
    fn digit_items(&self, mut j: usize) -> usize {
        while self.at(j) == b',' && self.one_digit(j + 1) {
            j += 2;
        }
        j
    }

    /// Whether the value at `i` is a number of one digit: its own
    /// canonical form, and what [`Json::number`] reads there.
    #[inline(always)]
    fn one_digit(&self, i: usize) -> bool {
        self.at(i).is_ascii_digit() && !matches!(self.at(i + 1), b'0'..=b'9' | b'.' | b'e' | b'E')
    }

    /// Reads the number at `i` in one pass, as [`Json::number_end`]
    /// validates it (`None`: not a number): where it ends, and whether it
    /// is its own canonical form. It is when it is an integer of at most
    /// 18 digits, or written as canonical JSON writes a non-integer: one
    /// digit from 1 to 9, maybe a point and digits not ending in 0, `e`,
    /// maybe `-`, and a power of ten without leading zeros; at most 15
    /// significant digits and a power from -307 to 307, so the nearest
    /// f64's shortest digits are these ([`short_scientific`]). `1e300`,
    /// `2.5e-7`, `1e0`. One canonical up to its power but for how the power
    /// is written (`1E+300`) is [`NumberForm::Power`].
    #[inline]
    fn number(&self, i: usize) -> Option<(usize, NumberForm)> {
        let d = i + usize::from(self.at(i) == b'-');
        let first = self.at(d);
        let whole_end = match first {
            b'0' => d + 1,
            b'1'..=b'9' => self.digits(d + 1),
            _ => return None,
        };
        // One digit from 1 to 9 before the point.
        let mut canonical = whole_end == d + 1 && first != b'0';
        let mut e = whole_end;
        if self.at(e) == b'.' {
            e = self.digits(whole_end + 1);
            let fraction = e - whole_end - 1;
            if fraction == 0 {
                return None;
            }
            canonical &= fraction <= 14 && self.at(e - 1) != b'0';
        } else if !matches!(self.at(e), b'e' | b'E') {
            // An integer.
            let form = if whole_end - d <= 18 {
                NumberForm::Canonical
            } else {
                NumberForm::Integer
            };
            return Some((whole_end, form));
        }
        let rewrite = |end| Some((end, NumberForm::Other));
        if !matches!(self.at(e), b'e' | b'E') {
            return rewrite(e);
        }
        let sign = self.at(e + 1);
        let from = e + 1 + usize::from(matches!(sign, b'+' | b'-'));
        let to = self.digits(from);
        if to == from {
            return None;
        }
        if !canonical {
            return rewrite(to);
        }
        // The digits before the exponent are canonical. So is the number
        // when its power is written as `{:e}` writes it (`e`, at most
        // three digits, no leading zero, no `+`, no `-0`) and is at most
        // 307.
        let leading_zero = self.at(from) == b'0' && (to > from + 1 || sign == b'-');
        if self.at(e) == b'e' && sign != b'+' && to <= from + 3 && !leading_zero {
            // (Past two digits, three: compared as 307 is.)
            return if to < from + 3 || self.power_of_three_digits(from) <= 307 {
                Some((to, NumberForm::Canonical))
            } else {
                rewrite(to)
            };
        }
        Some((to, self.respelled_power(e, sign, from, to)))
    }

    /// The three digits from `i` as a number.
    #[inline(always)]
    fn power_of_three_digits(&self, i: usize) -> u32 {
        let digit = |k| u32::from(self.at(k).wrapping_sub(b'0'));
        digit(i) * 100 + digit(i + 1) * 10 + digit(i + 2)
    }

    /// The form of a number canonical up to its `e` (at `e`), whose power
    /// (its sign, then its digits from `from` to `to`) is not written as
    /// `{:e}` writes it: [`NumberForm::Power`] when it is at most 307
    /// (`1E+300`, JavaScript's `1e+300`, `2.5e-07`), so only the power
    /// is written again.
    #[inline]
    fn respelled_power(&self, e: usize, sign: u8, from: usize, to: usize) -> NumberForm {
        let mut first = from;
        while first + 1 < to && self.at(first) == b'0' {
            first += 1;
        }
        if to - first > 3 || (to - first == 3 && self.power_of_three_digits(first) > 307) {
            return NumberForm::Other;
        }
        NumberForm::Power {
            e,
            negative: sign == b'-' && self.at(first) != b'0',
            digits: first,
        }
    }

    fn write(&self, i: usize, ix: &Scratch, out: &mut impl Sink) -> Res<usize> {
        match self.at(i) {
            b'"' => self.write_string(i, out),
            b'{' => {
                let Some((members, end)) = ix.keys_of(i) else {
                    // Keys in order (or no member or one): as it comes.
                    out.put_byte(b'{');
                    let mut first = true;
                    let end = self.members(i, 0, |k, v| {
                        if !first {
                            out.put_byte(b',');
                        }
                        first = false;
                        self.write_key(k, out)?;
                        out.put_byte(b':');
                        self.write(v, ix, out)
                    })?;
                    out.put_byte(b'}');
                    return Ok(end);
                };
                out.put_byte(b'{');
                for (n, &(k, v)) in members.iter().enumerate() {
                    if n > 0 {
                        out.put_byte(b',');
                    }
                    self.write_key(k as usize, out)?;
                    out.put_byte(b':');
                    self.write(v as usize, ix, out)?;
                }
                out.put_byte(b'}');
                Ok(end)
            }
            b'[' => self.array(i, 0, out, |v, _, out| self.write(v, ix, out)),
            b't' => {
                out.put(b"true");
                self.literal(i, "true")
            }
            b'f' => {
                out.put(b"false");
                self.literal(i, "false")
            }
            b'n' => {
                out.put(b"null");
                self.literal(i, "null")
            }
            _ if self.one_digit(i) => {
                out.put_byte(self.at(i));
                Ok(i + 1)
            }
            _ => self.write_number(i, out),
        }
    }

    /// Writes the key at `i` (a string): most are short and plain, written
    /// as they stand.
    #[inline]
    fn write_key(&self, i: usize, out: &mut impl Sink) -> Res<usize> {
        if let Some(end) = self.short_plain_end(i) {
            out.put(self.bytes(i, end));
            return Ok(end);
        }
        self.write_string(i, out)
    }

    fn write_string(&self, i: usize, out: &mut impl Sink) -> Res<usize> {
        if let Some(end) = self.verbatim_end(i) {
            // No escape: canonical as it stands.
            out.put(self.bytes(i, end));
            return Ok(end);
        }
        out.put_byte(b'"');
        let end = self.decode(i, |piece| escape_into(out, piece))?;
        out.put_byte(b'"');
        Ok(end)
    }

    fn write_number(&self, i: usize, out: &mut impl Sink) -> Res<usize> {
        let (end, form) = self.number(i).ok_or(BAD)?;
        if form == NumberForm::Canonical {
            out.put(self.bytes(i, end));
        } else {
            self.rewrite_number(i, end, form, out)?;
        }
        Ok(end)
    }

    /// Writes the canonical form of the number from `i` to `end`, of the
    /// `form` [`Json::number`] found (not canonical as it stands).
    fn rewrite_number(
        &self,
        i: usize,
        end: usize,
        form: NumberForm,
        out: &mut impl Sink,
    ) -> Res<()> {
        if let NumberForm::Power {
            e,
            negative,
            digits,
        } = form
        {
            out.put(self.bytes(i, e));
            out.put(if negative { b"e-" } else { b"e" });
            out.put(self.bytes(digits, end));
            return Ok(());
        }
        if form == NumberForm::Integer {
            // An integer in range is its own canonical form (JSON has no
            // leading zeros; "-0" stays "-0"): 19 digits always fit a u64,
            // a minus and 18 an i64.
            let tok = self.text(i, end);
            if tok.len() <= 19 || tok.parse::<u64>().is_ok() || tok.parse::<i64>().is_ok() {
                out.put(tok.as_bytes());
                return Ok(());
            }
        }
        let mut shortest = Scientific::default();
        if !short_scientific(self.bytes(i, end), &mut shortest) {
            shortest = slow_scientific(self.text(i, end))?;
        }
        if out.keeps() {
            out.put(shortest.bytes());
        } else {
            out.count(shortest.len);
        }
        Ok(())
    }
}

/// What [`Json::number`] finds a number to be.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum NumberForm {
    /// Its own canonical form.
    Canonical,
    /// An integer of more than 18 digits (canonical as it stands while it
    /// fits a u64 or an i64).
    Integer,
    /// A number canonical but for how its power of ten is written: the
    /// digits before the `e` at `e` stand, then `e`, a `-` when
    /// `negative`, and the power's digits from `digits` (leading zeros
    /// dropped) to the number's end.
    Power {
        e: usize,
        negative: bool,
        digits: usize,
    },
    /// Any other number: written as its nearest f64 in `{:e}`'s form.
    Other,
}

/// Writes the canonical form of the number `tok` (valid JSON, not an
/// integer) to `out` straight from its digits, when they are the nearest
/// f64's shortest: at most 15 significant digits (any such decimal
/// survives the trip through f64) and the first one's power of ten inside
/// f64's normal range (from -307 to 307). Then the digits, zeros around
/// them dropped, are written as Rust's `{:e}` writes that f64: the first
/// digit, the others after a point if any, `e` and the power of ten
/// (`1e300`, `1.25e1`, `-5e-1`, `0e0`). Otherwise it returns false, and
/// [`slow_scientific`] parses the f64.
fn short_scientific(tok: &[u8], out: &mut Scientific) -> bool {
    let negative = tok.first() == Some(&b'-');
    let exp_at = tok
        .iter()
        .position(|&c| c | 0x20 == b'e')
        .unwrap_or(tok.len());
    let mantissa = tok.get(usize::from(negative)..exp_at).unwrap_or_default();
    let mut exp = 0i64;
    if let Some(power) = tok.get(exp_at + 1..) {
        let (sign, digits) = match power.split_first() {
            Some((&s @ (b'-' | b'+'), rest)) => (s, rest),
            _ => (b'+', power),
        };
        if digits.is_empty() {
            return false;
        }
        for &c in digits {
            if !c.is_ascii_digit() {
                return false;
            }
            // A huge power saturates (out of range, then).
            exp = (exp * 10 + i64::from(c - b'0')).min(1 << 40);
        }
        if sign == b'-' {
            exp = -exp;
        }
    }
    if negative {
        out.push(b'-');
    }
    let significant = |c: &u8| matches!(c, b'1'..=b'9');
    let Some(first) = mantissa.iter().position(significant) else {
        // Zero, whatever its power.
        out.extend(b"0e0");
        return true;
    };
    let last = mantissa.iter().rposition(significant).unwrap_or(first);
    let point = mantissa.iter().position(|&c| c == b'.');
    let digits = mantissa.get(first..=last).unwrap_or_default();
    let inner_point = point.is_some_and(|p| p > first && p < last);
    if digits.len() - usize::from(inner_point) > 15 {
        return false;
    }
    // The first significant digit's power of ten: the digits before the
    // point, less one, less the zeros before it, plus the exponent.
    let whole = point.unwrap_or(mantissa.len()) as i64;
    let lead = first as i64 - i64::from(point.is_some_and(|p| p < first));
    let power = exp + whole - 1 - lead;
    if !(-307..=307).contains(&power) {
        return false;
    }
    if let Some((&d, rest)) = digits.split_first() {
        out.push(d);
        if !rest.is_empty() {
            out.push(b'.');
            for &c in rest {
                if c != b'.' {
                    out.push(c);
                }
            }
        }
    }
    out.push(b'e');
    if power < 0 {
        out.push(b'-');
    }
    // The power's digits (at most three), most significant first.
    let power = power.unsigned_abs();
    if power >= 100 {
        out.push(b'0' + (power / 100 % 10) as u8);
    }
    if power >= 10 {
        out.push(b'0' + (power / 10 % 10) as u8);
    }
    out.push(b'0' + (power % 10) as u8);
    true
}

/// The canonical form of the number `tok` (valid JSON, not an integer)
/// the long way: its nearest f64 written by `{:e}` (an error past f64's
/// range).
fn slow_scientific(tok: &str) -> Res<Scientific> {
    let f: f64 = tok.parse().map_err(|_| BAD)?;
    if !f.is_finite() {
        return Err(BAD);
    }
    // At most 24 bytes ("-", 17 digits, ".", "e-", 3 digits).
    let mut out = Scientific::default();
    write!(out, "{f:e}").map_err(|_| BAD)?;
    Ok(out)
}

/// A number's canonical form, written without allocating: by
/// [`short_scientific`], or by `{:e}` (past 32 bytes, an error; an f64's
/// form is at most 24).
#[derive(Default)]
struct Scientific {
    buf: [u8; 32],
    len: usize,
}

impl Scientific {
    fn bytes(&self) -> &[u8] {
        self.buf.get(..self.len).unwrap_or_default()
    }

    /// Appends a byte (dropped past the buffer, which an f64 never fills).
    fn push(&mut self, byte: u8) {
        if let Some(slot) = self.buf.get_mut(self.len) {
            *slot = byte;
            self.len += 1;
        }
    }

    fn extend(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.push(b);
        }
    }
}

impl std::fmt::Write for Scientific {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        let slot = self
            .buf
            .get_mut(self.len..self.len + s.len())
            .ok_or(std::fmt::Error)?;
        slot.copy_from_slice(s.as_bytes());
        self.len += s.len();
        Ok(())
    }
}

/// The bytes [`Json::end_of`] stops at: quotes and brackets.
static STRUCTURE: [bool; 256] = {
    let mut t = [false; 256];
    t[b'"' as usize] = true;
    t[b'[' as usize] = true;
    t[b']' as usize] = true;
    t[b'{' as usize] = true;
    t[b'}' as usize] = true;
    t
};

/// Where the first byte that ends a string's plain run is in `bytes` (a
/// quote, a backslash or a control character), eight bytes at a time.
#[inline]
fn plain_run(bytes: &[u8]) -> Option<usize> {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    // The high bit of each byte of `v` below `n` (n <= 128), and of each
    // zero byte: exact for the lowest such byte, which is all we read.
    let below = |v: u64, n: u8| v.wrapping_sub(ONES * u64::from(n)) & !v & HIGH;
    let plain = |c: u8| c != b'"' && c != b'\\' && c >= 0x20;
    let mut chunks = bytes.chunks_exact(8);
    let mut at = 0;
    for c in &mut chunks {
        let mut w = [0u8; 8];
        w.copy_from_slice(c);
        let v = u64::from_le_bytes(w);
        let hit = below(v ^ (ONES * u64::from(b'"')), 1)
            | below(v ^ (ONES * u64::from(b'\\')), 1)
            | below(v, 0x20);
        if hit != 0 {
            return Some(at + (hit.trailing_zeros() / 8) as usize);
        }
        at += 8;
    }
    chunks
        .remainder()
        .iter()
        .position(|&c| !plain(c))
        .map(|k| at + k)
}

/// Writes `text` as the inside of a canonical JSON string.
fn escape_into(out: &mut impl Sink, text: &str) {
    let bytes = text.as_bytes();
    let mut start = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let esc: &[u8] = match b {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            0x08 => b"\\b",
            0x09 => b"\\t",
            0x0a => b"\\n",
            0x0c => b"\\f",
            0x0d => b"\\r",
            0x00..=0x1f => b"",
            _ => continue,
        };
        out.put(bytes.get(start..i).unwrap_or_default());
        if esc.is_empty() {
            const HEX: &[u8; 16] = b"0123456789abcdef";
            out.put(b"\\u00");
            out.put(&[HEX[usize::from(b >> 4)], HEX[usize::from(b & 0xf)]]);
        } else {
            out.put(esc);
        }
        start = i + 1;
    }
    out.put(bytes.get(start..).unwrap_or_default());
}

const SHORT: usize = 24;

/// A short decoded string, on the stack.
pub(crate) struct Short {
    buf: [u8; SHORT],
    len: usize,
}

impl std::ops::Deref for Short {
    type Target = str;

    fn deref(&self) -> &str {
        // Whole characters only: a longer string gives no `Short`.
        std::str::from_utf8(self.buf.get(..self.len).unwrap_or_default()).unwrap_or_default()
    }
}

/// The bytes of a valid string, decoded, one at a time.
struct Decoded<'a> {
    json: Json<'a>,
    i: usize,
    buf: [u8; 4],
    at: usize,
    len: usize,
}

impl Iterator for Decoded<'_> {
    type Item = u8;

    fn next(&mut self) -> Option<u8> {
        if self.at < self.len {
            self.at += 1;
            return self.buf.get(self.at - 1).copied();
        }
        match self.json.at(self.i) {
            b'"' | 0 => None,
            b'\\' => {
                let (c, end) = self.json.escape(self.i).ok()?;
                self.len = c.encode_utf8(&mut self.buf).len();
                self.at = 1;
                self.i = end;
                self.buf.first().copied()
            }
            c => {
                self.i += 1;
                Some(c)
            }
        }
    }
}

/// The sorted members of the objects of one value whose keys are not in
/// order as they come (an object of at most one member, or whose keys
/// already increase, is written as it comes and takes no room here).
#[derive(Default)]
pub(crate) struct Scratch {
    /// Members (key and value offsets) of the objects still open while
    /// indexing.
    open: Vec<(u32, u32)>,
    /// Per object to sort, in order of where it starts: its offset, where
    /// its members begin in `groups` and how many, and where it ends.
    objects: Vec<(u32, u32, u32, u32)>,
    /// Per such object, its members, sorted by key, a repeated key's last
    /// member only.
    groups: Vec<(u32, u32)>,
    /// Keys seen in the value being indexed.
    seen: usize,
    /// Where in `objects` the next lookup looks first.
    next: Cell<usize>,
}

/// Up to this many members, an object's keys are sorted by insertion.
const FEW_KEYS: usize = 12;

impl Scratch {
    fn index(&mut self, json: &Json<'_>, i: usize) -> Res<()> {
        self.open.clear();
        self.objects.clear();
        self.groups.clear();
        self.seen = 0;
        self.next.set(0);
        self.walk(json, i)?;
        // Objects close innermost first; lookups go by where they start.
        self.objects.sort_unstable_by_key(|o| o.0);
        Ok(())
    }

    fn walk(&mut self, json: &Json<'_>, i: usize) -> Res<usize> {
        match json.at(i) {
            b'{' => {
                let mark = self.open.len();
                let end = json.members(i, 0, |k, v| {
                    self.seen += 1;
                    if self.seen > MAX_KEYS {
                        return Err(SkipReason::TooComplex);
                    }
                    self.open.push((k as u32, v as u32));
                    self.walk(json, v)
                })?;
                let members = self.open.get_mut(mark..).unwrap_or_default();
                let by_key =
                    |a: &(u32, u32), b: &(u32, u32)| json.cmp_strings(a.0 as usize, b.0 as usize);
                let start = self.groups.len();
                match members {
                    [] | [_] => {}
                    [a, b] => match by_key(a, b) {
                        Ordering::Less => {}
                        // The last of a repeated key wins.
                        Ordering::Equal => self.groups.push(*b),
                        Ordering::Greater => {
                            self.groups.push(*b);
                            self.groups.push(*a);
                        }
                    },
                    _ if members.windows(2).all(|w| match w {
                        [a, b] => by_key(a, b) == Ordering::Less,
                        _ => true,
                    }) => {}
                    _ => {
                        // By key, then by position: the last of equal keys
                        // is the last of its run.
                        let order =
                            |a: &(u32, u32), b: &(u32, u32)| by_key(a, b).then(a.0.cmp(&b.0));
                        if members.len() <= FEW_KEYS {
                            insertion_sort(members, order);
                        } else {
                            members.sort_unstable_by(order);
                        }
                        for n in 0..members.len() {
                            let m = members.get(n).copied().unwrap_or_default();
                            let repeated = members
                                .get(n + 1)
                                .is_some_and(|next| by_key(&m, next) == Ordering::Equal);
                            if !repeated {
                                self.groups.push(m);
                            }
                        }
                    }
                }
                if self.groups.len() > start {
                    let count = self.groups.len() - start;
                    self.objects
                        .push((i as u32, start as u32, count as u32, end as u32));
                }
                self.open.truncate(mark);
                Ok(end)
            }
            b'[' => match json.end_of(i) {
                // No object inside: no keys to index.
                (end, false) => Ok(end),
                _ => json.array(i, 0, &mut Nowhere, |v, _, _| self.walk(json, v)),
            },
            _ if json.one_digit(i) => Ok(i + 1),
            _ => Ok(json.end_of(i).0),
        }
    }

    /// The members of the object at `i` (key and value offsets), sorted
    /// by key, and where it ends, when its keys must be sorted.
    fn keys_of(&self, i: usize) -> Option<(&[(u32, u32)], usize)> {
        // Values are mostly written in the order they were indexed (the
        // next object to sort is the one after the last found), so that
        // one is tried before a search.
        let next = self.next.get();
        let at = match self.objects.get(next) {
            Some(o) if o.0 == i as u32 => next,
            _ => self
                .objects
                .binary_search_by_key(&(i as u32), |o| o.0)
                .ok()?,
        };
        self.next.set(at + 1);
        let &(_, start, count, end) = self.objects.get(at)?;
        let members = self
            .groups
            .get(start as usize..start as usize + count as usize)?;
        Some((members, end as usize))
    }
}

/// Sorts a few members by `order` (no set-up, no call per comparison
/// beyond `order`'s own).
fn insertion_sort(
    members: &mut [(u32, u32)],
    order: impl Fn(&(u32, u32), &(u32, u32)) -> Ordering,
) {
    for n in 1..members.len() {
        let mut k = n;
        while k > 0 {
            let (Some(&a), Some(&b)) = (members.get(k - 1), members.get(k)) else {
                break;
            };
            if order(&a, &b) != Ordering::Greater {
                break;
            }
            members.swap(k - 1, k);
            k -= 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn canon(s: &str) -> Result<String, SkipReason> {
        let json = Json::new(s.as_bytes())?;
        let start = json.document()?;
        let mut out = Vec::new();
        json.canonical(start, &mut Scratch::default(), &mut out)?;
        Ok(String::from_utf8(out).unwrap())
    }

    #[test]
    fn a_plain_run_ends_at_the_first_quote_backslash_or_control_byte() {
        let text: Vec<u8> = (0..=255u8)
            .chain(b"abcdefghijklmnop".iter().copied())
            .collect();
        for start in 0..text.len() {
            for len in 0..40.min(text.len() - start) {
                let s = &text[start..start + len];
                let want = s.iter().position(|&c| c == b'"' || c == b'\\' || c < 0x20);
                assert_eq!(plain_run(s), want, "{s:?}");
            }
        }
        let long = [b"x".repeat(1000), b"\\".to_vec()].concat();
        assert_eq!(plain_run(&long), Some(1000));
        assert_eq!(plain_run(&"éx".as_bytes().repeat(100)), None);
    }

    #[test]
    fn sorts_keys_and_compacts() {
        assert_eq!(
            canon(r#" { "b" : [1, 2.5, true, null], "a": {"d": "x", "c": -3} } "#).unwrap(),
            r#"{"a":{"c":-3,"d":"x"},"b":[1,2.5e0,true,null]}"#
        );
    }

    #[test]
    fn escapes() {
        assert_eq!(
            canon(r#""q\"b\\s\/\n\t\r\b\f\u0001\u00e9\u001F""#).unwrap(),
            "\"q\\\"b\\\\s/\\n\\t\\r\\b\\f\\u0001\u{e9}\\u001f\""
        );
    }

    #[test]
    fn numbers() {
        assert_eq!(
            canon("[1.0, 1e2, -0.5, 18446744073709551615, -9223372036854775808, -0, 0.0, -0.0, 1.5e-7, 12.50, 1e21, 18446744073709551616, 0.1e1, 1e300, 100]").unwrap(),
            "[1e0,1e2,-5e-1,18446744073709551615,-9223372036854775808,-0,0e0,-0e0,1.5e-7,1.25e1,1e21,1.8446744073709552e19,1e0,1e300,100]"
        );
        // Past 15 digits or the range, the nearest f64 decides.
        assert_eq!(
            canon("[0.1000000000000000055511151231257827, 1.7976931348623157e308, 5e-324, -2.2250738585072014e-308]")
                .unwrap(),
            "[1e-1,1.7976931348623157e308,5e-324,-2.2250738585072014e-308]"
        );
        assert_eq!(canon("1e400"), Err(SkipReason::NotJson));
        // Canonical but for the power's spelling (JavaScript writes
        // `1e+300`): only the power is written again, in and out of runs.
        assert_eq!(
            canon("[1E+300,1e+0,1e-0,-2.5e-07,1e0005,1E-307,1e+308,0e+5] ").unwrap(),
            "[1e300,1e0,1e0,-2.5e-7,1e5,1e-307,1e308,0e0]"
        );
        assert_eq!(
            canon(r#"{"b":1e+2,"a":1E2}"#).unwrap(),
            r#"{"a":1e2,"b":1e2}"#
        );
    }

    #[test]
    fn a_number_taken_as_it_stands_is_its_canonical_form() {
        // Every number `verbatim_end` passes as canonical is what the
        // writer would write.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut taken = 0;
        for _ in 0..200_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let digit = |k: u64| char::from(b'0' + ((x >> k) % 10) as u8);
            let mut t = String::new();
            if x.is_multiple_of(5) {
                t.push('-');
            }
            t.push(digit(3));
            let frac = (x >> 8) % 18;
            if frac > 0 {
                t.push('.');
                for k in 0..frac {
                    t.push(digit(12 + 2 * k));
                }
            }
            t.push(if x.is_multiple_of(7) { 'E' } else { 'e' });
            match (x >> 50) % 4 {
                0 => t.push('-'),
                1 => t.push('+'),
                _ => {}
            }
            t.push_str(&((x >> 52) % 340).to_string());
            if x.is_multiple_of(11) {
                // A leading zero in the power.
                let at = t.rfind(|c: char| !c.is_ascii_digit()).unwrap_or(0) + 1;
                t.insert(at, '0');
            }
            let json = Json::new(t.as_bytes()).unwrap();
            let Ok(written) = canon(&t) else {
                assert_ne!(json.verbatim_end(0), Some(t.len()), "{t}");
                continue;
            };
            // (A refused number may still be canonical, e.g. with 16
            // digits: the writer then writes it again.)
            if json.verbatim_end(0) == Some(t.len()) {
                assert_eq!(written, t);
                taken += 1;
            }
        }
        assert!(taken > 10_000, "{taken}");
    }

    #[test]
    fn no_numbers_canonical_form_is_much_longer_than_its_text() {
        // The shortest non-integers ("0.1", "1.5") grow by a byte or two;
        // a huge or tiny magnitude never grows.
        for (text, want) in [
            ("0.1", "1e-1"),
            ("1.5", "1.5e0"),
            ("1e300", "1e300"),
            ("1e-300", "1e-300"),
            ("9.999e99", "9.999e99"),
            ("123456789012345678901234567890", "1.2345678901234568e29"),
        ] {
            let got = canon(text).unwrap();
            assert_eq!(got, want);
            assert!(got.len() <= text.len() + 2, "{text} -> {got}");
        }
    }

    #[test]
    fn duplicate_key_last_wins() {
        assert_eq!(canon(r#"{"a":1,"a":2}"#).unwrap(), r#"{"a":2}"#);
        assert_eq!(
            canon(r#"{"b":[{"x":1,"x":{"y":2,"y":3}}],"a":0,"b":4}"#).unwrap(),
            r#"{"a":0,"b":4}"#
        );
        assert_eq!(
            canon(r#"{"a":{"z":1,"y":2},"\u0061":{"q":1,"p":2}}"#).unwrap(),
            r#"{"a":{"p":2,"q":1}}"#
        );
    }

    #[test]
    fn the_same_documents_are_json_as_for_serde_json() {
        let deep = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
        for s in [
            deep(126),
            deep(127),
            deep(128),
            r#"{"a":1,}"#.into(),
            "[1,]".into(),
            "01".into(),
            "1.".into(),
            "-".into(),
            "1e".into(),
            r#""\ud800""#.into(),
            r#""\ud83d\ude00""#.into(),
            r#""\x""#.into(),
            "\"tab\there\"".into(),
            " {} ".into(),
            "{} {}".into(),
            "nul".into(),
            "".into(),
            r#"{"a" 1}"#.into(),
        ] {
            let ours = Json::new(s.as_bytes()).and_then(|j| j.document()).is_ok();
            let theirs = serde_json::from_str::<serde_json::Value>(&s).is_ok();
            assert_eq!(ours, theirs, "{s:.60}");
        }
    }

    #[test]
    fn a_short_decimal_is_written_as_its_nearest_f64_is() {
        // The fast path's premise: up to 15 significant digits in the
        // normal range, the digits are the nearest f64's shortest form.
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..200_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let digits = 1 + (x % 15) as u32;
            let mantissa = (x >> 8) % 10u64.pow(digits);
            let exp = ((x >> 40) % 620) as i64 - 320;
            let text = format!("{mantissa}e{exp}");
            let mut out = Scientific::default();
            if !short_scientific(text.as_bytes(), &mut out) {
                continue;
            }
            let f: f64 = text.parse().unwrap();
            assert_eq!(out.bytes(), format!("{f:e}").as_bytes(), "{text}");
        }
    }

    #[test]
    fn a_decimal_is_written_as_its_f64_is() {
        for x in [
            1.5e-7,
            123.456,
            1e300,
            4.9e-300,
            0.1,
            1e15,
            123456789012345.0,
            -2.5,
            0.0,
            -0.0,
            1e-7,
            12.5,
        ] {
            let mut out = Scientific::default();
            assert!(short_scientific(format!("{x:e}").as_bytes(), &mut out));
            assert_eq!(out.bytes(), format!("{x:e}").as_bytes(), "{x}");
        }
    }

    /// A number's canonical form the long way, as the crate docs define
    /// it: an integer that fits a u64 or an i64 as it stands, any other
    /// number as its nearest f64 written by `{:e}` (None past f64's range).
    fn reference_number(t: &str) -> Option<String> {
        let integer = !t.contains(['.', 'e', 'E']);
        if integer && (t.parse::<u64>().is_ok() || t.parse::<i64>().is_ok()) {
            return Some(t.into());
        }
        let f: f64 = t.parse().ok()?;
        f.is_finite().then(|| format!("{f:e}"))
    }

    /// JSON number texts of every kind the writer tells apart: short and
    /// long digit strings, zeros around the point, `E`, `+`, leading zeros
    /// in the power, powers near f64's ends (1e308, 5e-324, subnormals)
    /// and far past them.
    fn number_text() -> impl Strategy<Value = String> {
        let whole = prop_oneof![
            Just("0".to_string()),
            "[1-9][0-9]{0,3}",
            "[1-9][0-9]{12,24}",
            "[1-9]0{0,25}",
            prop::sample::select(vec![
                "17976931348623157",
                "22250738585072014",
                "49406564584124654",
                "5",
                "9"
            ])
            .prop_map(String::from),
        ];
        let fraction = prop::option::of(prop_oneof![
            "[0-9]{1,4}",
            "[0-9]{10,30}",
            "0{1,12}[1-9]{0,3}0{0,5}",
        ]);
        let power = prop_oneof![
            0u32..30,
            280u32..345,
            Just(0),
            Just(307),
            Just(308),
            Just(309),
            Just(323),
            Just(324),
            0u32..100_000
        ];
        let exponent = prop::option::of((
            prop::sample::select(vec!["e", "E"]),
            prop::sample::select(vec!["", "+", "-"]),
            "0{0,3}",
            power,
        ));
        (any::<bool>(), whole, fraction, exponent).prop_map(|(minus, whole, fraction, exponent)| {
            let mut t = String::new();
            if minus {
                t.push('-');
            }
            t.push_str(&whole);
            if let Some(f) = fraction {
                t.push('.');
                t.push_str(&f);
            }
            if let Some((e, sign, zeros, power)) = exponent {
                t.push_str(e);
                t.push_str(sign);
                t.push_str(&zeros);
                t.push_str(&power.to_string());
            }
            t
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4096))]

        /// Whatever path writes a number (taken as it stands, written from
        /// its digits, or parsed as an f64), alone, in an array or in an
        /// object, the bytes are the reference's.
        #[test]
        fn every_number_is_written_as_the_reference_writes_it(t in number_text()) {
            let want = reference_number(&t);
            prop_assert_eq!(canon(&t).ok(), want.clone(), "{}", t);
            let Some(want) = want else {
                return Ok(());
            };
            prop_assert_eq!(canon(&format!("[{t}, 0,{t} ,[{t}]]")).unwrap(), format!("[{want},0,{want},[{want}]]"));
            prop_assert_eq!(canon(&format!(r#"{{"b":{t},"a":[{t}]}}"#)).unwrap(), format!(r#"{{"a":[{want}],"b":{want}}}"#));
            // The fast path writes what the slow one does, or leaves it.
            if !(t.contains(['.', 'e', 'E'])) {
                return Ok(());
            }
            let mut fast = Scientific::default();
            if short_scientific(t.as_bytes(), &mut fast) {
                let slow = slow_scientific(&t).unwrap();
                prop_assert_eq!(fast.bytes(), slow.bytes(), "{}", t);
            }
            let json = Json::new(t.as_bytes()).unwrap();
            if json.verbatim_end(0) == Some(t.len()) {
                prop_assert_eq!(&want, &t);
            }
        }
    }
}

//! What the peer bus checks before it believes a message, and what it
//! adds to the messages it sends ([`hearth_wire::peer`], "On the bus: the
//! seal"):
//!
//! - [`FleetKey`]: the MAC, HMAC-SHA256 with the fleet's key over the
//!   subject and the whole message, verified in constant time before
//!   anything is decoded;
//! - [`SeqClock`] and [`Replays`]: a sender's sequence numbers follow its
//!   clock and must grow, so a replayed message is refused, and one older
//!   than [`MAX_SKEW`] is refused even from a sender no longer remembered;
//! - [`HelloLimit`]: hellos (each answered with this sidecar's whole
//!   state) are answered a few times per second at most.
//!
//! Everything here is plain code over bytes and times given as arguments;
//! the bus (`feeds/peers.rs`) reads the clocks.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use hearth_wire::peer::{split_seal, MAC_BYTES};
use ring::hmac;

use crate::config::PeerKey;

/// HMAC-SHA256 with the fleet's key. Printed as `<redacted>` by `Debug`.
pub struct FleetKey(hmac::Key);

impl std::fmt::Debug for FleetKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

/// Why a sealed message was refused before it was decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SealError {
    /// Shorter than a MAC.
    Short,
    /// Its MAC is all zeros: sent by a sidecar without a key.
    Unsigned,
    /// Its MAC does not check: another key, or changed bytes.
    BadMac,
}

impl SealError {
    /// The `reason` label of `hearth_peer_messages_dropped_total`.
    pub fn reason(self) -> &'static str {
        match self {
            SealError::Short => "malformed",
            SealError::Unsigned => "unsigned",
            SealError::BadMac => "bad_mac",
        }
    }
}

impl FleetKey {
    pub fn new(key: &PeerKey) -> FleetKey {
        FleetKey::from_bytes(key.expose())
    }

    pub fn from_bytes(key: &[u8]) -> FleetKey {
        FleetKey(hmac::Key::new(hmac::HMAC_SHA256, key))
    }

    /// The MAC of `message` published on `subject`.
    pub fn mac(&self, subject: &str, message: &[u8]) -> [u8; MAC_BYTES] {
        let mut ctx = hmac::Context::with_key(&self.0);
        ctx.update(&(subject.len() as u32).to_le_bytes());
        ctx.update(subject.as_bytes());
        ctx.update(message);
        let mut out = [0u8; MAC_BYTES];
        out.copy_from_slice(ctx.sign().as_ref());
        out
    }

    fn verify(&self, subject: &str, message: &[u8], mac: &[u8; MAC_BYTES]) -> bool {
        let mut input = Vec::with_capacity(4 + subject.len() + message.len());
        input.extend_from_slice(&(subject.len() as u32).to_le_bytes());
        input.extend_from_slice(subject.as_bytes());
        input.extend_from_slice(message);
        // Constant time (ring compares the tags so).
        hmac::verify(&self.0, &input, mac).is_ok()
    }
}

/// `message` as it goes on `subject`: followed by its MAC, or by zeros
/// without a key.
pub fn seal(key: Option<&FleetKey>, subject: &str, mut message: Vec<u8>) -> Vec<u8> {
    let mac = key.map_or([0; MAC_BYTES], |k| k.mac(subject, &message));
    message.extend_from_slice(&mac);
    message
}

/// The message inside a sealed one received on `subject`, when its MAC
/// checks. Without a key, the MAC is not read (an open bus,
/// `HEARTH_PEERS_INSECURE`).
pub fn open<'a>(
    key: Option<&FleetKey>,
    subject: &str,
    sealed: &'a [u8],
) -> Result<&'a [u8], SealError> {
    let (message, mac) = split_seal(sealed).ok_or(SealError::Short)?;
    let Some(key) = key else {
        return Ok(message);
    };
    if mac == &[0; MAC_BYTES] {
        return Err(SealError::Unsigned);
    }
    if key.verify(subject, message, mac) {
        Ok(message)
    } else {
        Err(SealError::BadMac)
    }
}

/// How far a message's sequence (its sender's clock) may be from the
/// receiver's clock: beyond it the message is refused as stale (a replay
/// from long ago, or a sender whose clock is off).
pub const MAX_SKEW: Duration = Duration::from_secs(60);

/// Senders whose last sequence numbers are remembered at most; past it
/// the ones outside [`MAX_SKEW`] are forgotten first (their old messages
/// are stale anyway), then the oldest.
pub const MAX_SENDERS: usize = 1_024;

/// This sidecar's sequence numbers: its clock in microseconds since the
/// Unix epoch, always above the previous one.
#[derive(Debug, Default)]
pub struct SeqClock {
    last: u64,
}

impl SeqClock {
    pub fn next(&mut self, now_micros: u64) -> u64 {
        self.last = now_micros.max(self.last.saturating_add(1));
        self.last
    }
}

/// Why a message's sequence was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeqError {
    /// Not above the last one accepted from its sender.
    Replay,
    /// More than [`MAX_SKEW`] from this sidecar's clock.
    Stale,
}

impl SeqError {
    /// The `reason` label of `hearth_peer_messages_dropped_total`.
    pub fn reason(self) -> &'static str {
        match self {
            SeqError::Replay => "replay",
            SeqError::Stale => "stale",
        }
    }
}

/// The last sequence accepted from each sender, per kind of subject (the
/// fleet's subjects, and this sidecar's inbox: NATS keeps a sender's order
/// within each, not between them).
#[derive(Debug, Default)]
pub struct Replays {
    last: HashMap<(u64, bool), u64>,
}

impl Replays {
    /// Accepts `seq` from `sender` (received on the inbox: `direct`) and
    /// remembers it, or says why not.
    pub fn check(
        &mut self,
        sender: u64,
        direct: bool,
        seq: u64,
        now_micros: u64,
    ) -> Result<(), SeqError> {
        let skew = MAX_SKEW.as_micros() as u64;
        if seq.saturating_add(skew) < now_micros || seq > now_micros.saturating_add(skew) {
            return Err(SeqError::Stale);
        }
        let key = (sender, direct);
        if self.last.get(&key).is_some_and(|&last| seq <= last) {
            return Err(SeqError::Replay);
        }
        if self.last.len() >= MAX_SENDERS && !self.last.contains_key(&key) {
            self.last
                .retain(|_, &mut last| last.saturating_add(skew) >= now_micros);
            if self.last.len() >= MAX_SENDERS {
                let oldest = self.last.iter().min_by_key(|(_, &l)| l).map(|(&k, _)| k);
                if let Some(oldest) = oldest {
                    self.last.remove(&oldest);
                }
            }
        }
        self.last.insert(key, seq);
        Ok(())
    }

    /// Senders remembered now.
    pub fn len(&self) -> usize {
        self.last.len()
    }

    pub fn is_empty(&self) -> bool {
        self.last.is_empty()
    }
}

/// Hellos answered at most: [`HELLO_BURST`] at once, then one per
/// [`HELLO_INTERVAL`], and one per asking inbox per interval.
pub const HELLO_INTERVAL: Duration = Duration::from_secs(1);

/// Hellos answered at once after a quiet spell (several sidecars that
/// start together each get an answer).
pub const HELLO_BURST: f64 = 4.0;

/// Inboxes remembered at most (each for [`HELLO_INTERVAL`]).
const MAX_ASKERS: usize = 256;

/// The hellos this sidecar answers: each answer is its whole state, so a
/// flood of small hellos must not become a flood of snapshots.
#[derive(Debug)]
pub struct HelloLimit {
    tokens: f64,
    at: Option<Instant>,
    asked: HashMap<String, Instant>,
}

impl Default for HelloLimit {
    fn default() -> Self {
        HelloLimit {
            tokens: HELLO_BURST,
            at: None,
            asked: HashMap::new(),
        }
    }
}

impl HelloLimit {
    /// True when a hello asking for an answer on `reply` is answered now.
    pub fn allow(&mut self, reply: &str, now: Instant) -> bool {
        if let Some(at) = self.at {
            let refill =
                now.saturating_duration_since(at).as_secs_f64() / HELLO_INTERVAL.as_secs_f64();
            self.tokens = (self.tokens + refill).min(HELLO_BURST);
        }
        self.at = Some(now);
        self.asked
            .retain(|_, &mut at| now.saturating_duration_since(at) < HELLO_INTERVAL);
        if self.asked.contains_key(reply) || self.tokens < 1.0 || self.asked.len() >= MAX_ASKERS {
            return false;
        }
        self.tokens -= 1.0;
        self.asked.insert(reply.to_string(), now);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn the_mac_is_hmac_sha256_over_the_subject_and_the_message() {
        // Made independently of this code:
        //   printf '\x0a\x00\x00\x00hearth.f.uHRTP' \
        //     | openssl dgst -sha256 -mac HMAC -macopt key:0123456789abcdef0123456789abcdef
        let key = FleetKey::from_bytes(b"0123456789abcdef0123456789abcdef");
        assert_eq!(
            hex(&key.mac("hearth.f.u", b"HRTP")),
            "47c138f5aa1ea5da83184e3aa44e63712a31da88da3cd7fb1c3a180e70b56664"
        );
    }

    #[test]
    fn a_message_opens_only_with_its_key_its_bytes_and_its_subject() {
        let key = FleetKey::from_bytes(&[1; 32]);
        let other = FleetKey::from_bytes(&[2; 32]);
        let sealed = seal(Some(&key), "hearth.f.updates", b"message".to_vec());
        assert_eq!(sealed.len(), 7 + MAC_BYTES);
        assert_eq!(
            open(Some(&key), "hearth.f.updates", &sealed),
            Ok(&b"message"[..])
        );
        assert_eq!(
            open(Some(&other), "hearth.f.updates", &sealed),
            Err(SealError::BadMac)
        );
        assert_eq!(
            open(Some(&key), "_INBOX.x", &sealed),
            Err(SealError::BadMac),
            "bound to its subject"
        );
        for i in 0..sealed.len() {
            let mut changed = sealed.clone();
            changed[i] ^= 1;
            assert_eq!(
                open(Some(&key), "hearth.f.updates", &changed),
                Err(SealError::BadMac),
                "byte {i}"
            );
        }
        let unsigned = seal(None, "hearth.f.updates", b"message".to_vec());
        assert_eq!(
            open(Some(&key), "hearth.f.updates", &unsigned),
            Err(SealError::Unsigned)
        );
        assert_eq!(open(Some(&key), "s", &[0; 31]), Err(SealError::Short));
        // Without a key (an open bus), the MAC is not read.
        assert_eq!(open(None, "s", &sealed), Ok(&b"message"[..]));
        assert_eq!(format!("{key:?}"), "<redacted>");
    }

    const SECOND: u64 = 1_000_000;

    #[test]
    fn sequences_follow_the_clock_and_always_grow() {
        let mut seq = SeqClock::default();
        assert_eq!(seq.next(100 * SECOND), 100 * SECOND);
        assert_eq!(seq.next(100 * SECOND), 100 * SECOND + 1);
        // The clock stepped back: still growing.
        assert_eq!(seq.next(50 * SECOND), 100 * SECOND + 2);
        assert_eq!(seq.next(200 * SECOND), 200 * SECOND);
    }

    #[test]
    fn a_replayed_or_stale_sequence_is_refused() {
        let now = 1_000 * SECOND;
        let mut r = Replays::default();
        assert_eq!(r.check(7, false, now, now), Ok(()));
        assert_eq!(r.check(7, false, now, now), Err(SeqError::Replay));
        assert_eq!(r.check(7, false, now - 1, now), Err(SeqError::Replay));
        assert_eq!(r.check(7, false, now + 1, now), Ok(()));
        // The inbox is its own order; another sender its own.
        assert_eq!(r.check(7, true, now, now), Ok(()));
        assert_eq!(r.check(8, false, now, now), Ok(()));
        // Outside the clock window, from anyone.
        let skew = MAX_SKEW.as_micros() as u64;
        assert_eq!(r.check(9, false, now - skew - 1, now), Err(SeqError::Stale));
        assert_eq!(r.check(9, false, now + skew + 1, now), Err(SeqError::Stale));
        assert_eq!(r.check(9, false, now - skew, now), Ok(()));
        assert_eq!(r.check(9, false, 0, u64::MAX), Err(SeqError::Stale));
        assert_eq!(r.check(9, false, u64::MAX, 0), Err(SeqError::Stale));
    }

    #[test]
    fn senders_remembered_are_bounded_and_the_forgotten_ones_replays_are_stale() {
        let now = 1_000 * SECOND;
        let skew = MAX_SKEW.as_micros() as u64;
        let mut r = Replays::default();
        // A sender heard long ago, then many new ones.
        let early = now - skew / 2;
        assert_eq!(r.check(1, false, early, early), Ok(()));
        let later = now + skew;
        for sender in 2..(MAX_SENDERS as u64 + 500) {
            assert_eq!(r.check(sender, false, later, later), Ok(()));
        }
        assert!(r.len() <= MAX_SENDERS);
        // Sender 1 was forgotten, but its message is stale by now.
        assert_eq!(r.check(1, false, early, later), Err(SeqError::Stale));
    }

    #[test]
    fn hellos_are_answered_a_few_at_once_then_once_a_second_and_once_per_inbox() {
        let t0 = Instant::now();
        let mut h = HelloLimit::default();
        assert!(h.allow("a", t0));
        assert!(!h.allow("a", t0), "the same inbox within the interval");
        assert!(h.allow("b", t0));
        assert!(h.allow("c", t0));
        assert!(h.allow("d", t0));
        assert!(!h.allow("e", t0), "the burst is spent");
        let flood = (0..1_000).filter(|i| h.allow(&format!("x{i}"), t0)).count();
        assert_eq!(flood, 0);
        let t1 = t0 + HELLO_INTERVAL;
        assert!(h.allow("a", t1));
        assert!(!h.allow("e", t1), "one per interval");
        // Over ten seconds of flooding, about ten answers.
        let mut answered = 0;
        for ms in (0..10_000).step_by(10) {
            let now = t1 + Duration::from_millis(ms);
            answered += usize::from(h.allow(&format!("y{ms}"), now));
        }
        assert!((9..=11).contains(&answered), "{answered}");
    }
}

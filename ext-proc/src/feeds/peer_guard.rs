//! What the peer bus checks before it believes a message, and what it
//! adds to the messages it sends ([`hearth_wire::peer`], "On the bus: the
//! seal"):
//!
//! - [`FleetKey`]: the MAC, HMAC-SHA256 with the fleet's key over the
//!   subject, the message and its signature, verified in constant time
//!   before anything else;
//! - [`Identity`]: each sidecar's own Ed25519 key pair, made at start or
//!   read from its identity file; its public key names it on the bus (its
//!   sender id is the key's digest) and signs every message, so a member
//!   of the fleet cannot speak under another's id;
//! - [`Members`]: with a members file, the only keys that may speak at
//!   all, so holding the fleet's key is not enough to join;
//! - [`SeqClock`] and [`Replays`]: a sender's sequence numbers follow its
//!   clock and must grow, so a replayed message is refused, and one older
//!   than [`MAX_SKEW`] is refused even from a sender no longer remembered;
//! - [`HelloLimit`]: hellos (each answered with this sidecar's whole
//!   state) are answered a few times per second at most.
//!
//! Everything here is plain code over bytes and times given as arguments;
//! the bus (`feeds/peers.rs`) reads the clocks.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use hearth_wire::peer::{sender_id, split_seal, KEY_BYTES, MAC_BYTES, SIGNATURE_BYTES};
use ring::rand::SystemRandom;
use ring::signature::{self, Ed25519KeyPair, KeyPair};
use ring::{digest, hmac};

use crate::config::{PeerKey, PeerSeed};

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
    /// Its signature does not check with the key in its seal.
    BadSignature,
    /// Signed by a key the members file does not list.
    UnknownMember,
}

impl SealError {
    /// The `reason` label of `hearth_peer_messages_dropped_total`.
    pub fn reason(self) -> &'static str {
        match self {
            SealError::Short => "malformed",
            SealError::Unsigned => "unsigned",
            SealError::BadMac => "bad_mac",
            SealError::BadSignature => "bad_signature",
            SealError::UnknownMember => "unknown_member",
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

    /// The MAC of the bytes before it (`maced`: message, key, signature)
    /// published on `subject`.
    pub fn mac(&self, subject: &str, maced: &[u8]) -> [u8; MAC_BYTES] {
        let mut ctx = hmac::Context::with_key(&self.0);
        ctx.update(&(subject.len() as u32).to_le_bytes());
        ctx.update(subject.as_bytes());
        ctx.update(maced);
        let mut out = [0u8; MAC_BYTES];
        out.copy_from_slice(ctx.sign().as_ref());
        out
    }

    fn verify(&self, subject: &str, maced: &[u8], mac: &[u8; MAC_BYTES]) -> bool {
        let mut input = Vec::with_capacity(4 + subject.len() + maced.len());
        input.extend_from_slice(&(subject.len() as u32).to_le_bytes());
        input.extend_from_slice(subject.as_bytes());
        input.extend_from_slice(maced);
        // Constant time (ring compares the tags so).
        hmac::verify(&self.0, &input, mac).is_ok()
    }
}

/// This sidecar on the bus: an Ed25519 key pair made when it starts (so
/// a restarted sidecar is a new peer), and the sender id its public key
/// gives ([`hearth_wire::peer::sender_id`]).
pub struct Identity {
    pair: Ed25519KeyPair,
    id: u64,
}

impl std::fmt::Debug for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Identity({:016x})", self.id)
    }
}

impl Identity {
    /// A new key pair from the system's random source.
    pub fn generate() -> Identity {
        let rng = SystemRandom::new();
        let pkcs8 = Ed25519KeyPair::generate_pkcs8(&rng).expect("the system's random source");
        let pair = Ed25519KeyPair::from_pkcs8(pkcs8.as_ref()).expect("a key ring just made");
        let id = id_of(pair.public_key().as_ref());
        Identity { pair, id }
    }

    /// The key pair of an identity file's seed, after checking that the
    /// members file (when there is one) lists its public key.
    pub fn of(seed: &PeerSeed, members: Option<&Members>) -> Result<Identity, String> {
        let pair = Ed25519KeyPair::from_seed_unchecked(seed.expose())
            .map_err(|_| "HEARTH_PEERS_IDENTITY_FILE: not an Ed25519 seed".to_string())?;
        let identity = Identity {
            id: id_of(pair.public_key().as_ref()),
            pair,
        };
        if members.is_some_and(|m| !m.admits(&identity.public_key())) {
            return Err(format!(
                "HEARTH_PEERS_MEMBERS_FILE does not list this sidecar's own public key {}: \
                 the other sidecars would drop its messages",
                identity.public_key_hex()
            ));
        }
        Ok(identity)
    }

    /// The id this sidecar's messages carry as their sender.
    pub fn sender(&self) -> u64 {
        self.id
    }

    pub fn public_key(&self) -> [u8; KEY_BYTES] {
        let mut key = [0; KEY_BYTES];
        key.copy_from_slice(self.pair.public_key().as_ref());
        key
    }

    /// The public key as a members file lists it.
    pub fn public_key_hex(&self) -> String {
        self.public_key()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }
}

/// The public keys allowed on the bus (`HEARTH_PEERS_MEMBERS_FILE`).
#[derive(Debug, Default)]
pub struct Members(HashSet<[u8; KEY_BYTES]>);

impl Members {
    pub fn new(keys: &[[u8; KEY_BYTES]]) -> Members {
        Members(keys.iter().copied().collect())
    }

    pub fn admits(&self, key: &[u8]) -> bool {
        <[u8; KEY_BYTES]>::try_from(key).is_ok_and(|k| self.0.contains(&k))
    }
}

/// The sender id of a public key.
fn id_of(public_key: &[u8]) -> u64 {
    let d = digest::digest(&digest::SHA256, public_key);
    let mut bytes = [0u8; 32];
    bytes.copy_from_slice(d.as_ref());
    sender_id(&bytes)
}

/// What the sender signs: the subject (length first) and the message.
fn signed(subject: &str, message: &[u8]) -> Vec<u8> {
    let mut input = Vec::with_capacity(4 + subject.len() + message.len());
    input.extend_from_slice(&(subject.len() as u32).to_le_bytes());
    input.extend_from_slice(subject.as_bytes());
    input.extend_from_slice(message);
    input
}

/// `message` as `me` publishes it on `subject`: followed by its public
/// key, its signature and the fleet's MAC (zeros without a fleet key).
pub fn seal(key: Option<&FleetKey>, me: &Identity, subject: &str, mut message: Vec<u8>) -> Vec<u8> {
    let signature = me.pair.sign(&signed(subject, &message));
    message.extend_from_slice(me.pair.public_key().as_ref());
    message.extend_from_slice(signature.as_ref());
    let mac = key.map_or([0; MAC_BYTES], |k| k.mac(subject, &message));
    message.extend_from_slice(&mac);
    message
}

/// A message whose seal checked, and the sender its key names: the
/// caller refuses it unless its envelope names the same sender.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Opened<'a> {
    pub message: &'a [u8],
    pub sender: u64,
}

/// The message inside a sealed one received on `subject`, when its MAC
/// checks (the MAC is not read without a fleet key: an open bus,
/// `HEARTH_PEERS_INSECURE`), then (with a members file) that its key is a
/// member's, then its signature.
pub fn open<'a>(
    key: Option<&FleetKey>,
    members: Option<&Members>,
    subject: &str,
    sealed: &'a [u8],
) -> Result<Opened<'a>, SealError> {
    let s = split_seal(sealed).ok_or(SealError::Short)?;
    if let Some(key) = key {
        if s.mac == &[0; MAC_BYTES] {
            return Err(SealError::Unsigned);
        }
        if !key.verify(subject, s.maced, s.mac) {
            return Err(SealError::BadMac);
        }
    }
    debug_assert_eq!(
        (s.key.len(), s.signature.len()),
        (KEY_BYTES, SIGNATURE_BYTES)
    );
    if members.is_some_and(|m| !m.admits(s.key)) {
        return Err(SealError::UnknownMember);
    }
    signature::UnparsedPublicKey::new(&signature::ED25519, s.key)
        .verify(&signed(subject, s.message), s.signature)
        .map_err(|_| SealError::BadSignature)?;
    Ok(Opened {
        message: s.message,
        sender: id_of(s.key),
    })
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

/// How long snapshot parts are taken after the hello they follow (this
/// sidecar's own, or a peer's it answered).
pub const SNAPSHOT_WINDOW: Duration = Duration::from_secs(30);

/// Senders whose answered hellos are remembered at most.
const MAX_ANSWERED: usize = 256;

/// Which snapshots (whole states, applied without the bounds an update
/// has) this sidecar takes: parts on its own inbox within
/// [`SNAPSHOT_WINDOW`] of its own hello (its peers' answers), and parts on
/// the fleet's subject from a peer within [`SNAPSHOT_WINDOW`] of that
/// peer's hello this sidecar answered (a peer back on the bus says hello,
/// then sends what it learned while away). Any other snapshot is dropped
/// and counted, so a member of the fleet can send whole states only at
/// the rate hellos are answered ([`HelloLimit`]).
#[derive(Debug, Default)]
pub struct Snapshots {
    asked: Option<Instant>,
    answered: HashMap<u64, Instant>,
}

impl Snapshots {
    /// This sidecar sent its hello at `now`.
    pub fn asked(&mut self, now: Instant) {
        self.asked = Some(now);
    }

    /// This sidecar answered `sender`'s hello at `now`.
    pub fn answered(&mut self, sender: u64, now: Instant) {
        self.answered
            .retain(|_, &mut at| now.saturating_duration_since(at) < SNAPSHOT_WINDOW);
        if self.answered.len() < MAX_ANSWERED || self.answered.contains_key(&sender) {
            self.answered.insert(sender, now);
        }
    }

    /// True when a snapshot part from `sender`, received on this
    /// sidecar's inbox (`direct`) or on the fleet's subject, is taken now.
    pub fn allow(&self, sender: u64, direct: bool, now: Instant) -> bool {
        let within = |at: Instant| now.saturating_duration_since(at) < SNAPSHOT_WINDOW;
        if direct {
            self.asked.is_some_and(within)
        } else {
            self.answered.get(&sender).copied().is_some_and(within)
        }
    }
}

/// Warmth hashes all peers' updates may add, per second (a token bucket
/// of one second's worth): 16 MiB of hashes a second, far more than a
/// fleet's decisions record, so it binds only a flood. Records beyond it
/// are dropped and counted (`warmth_limited`).
pub const PEER_WARMTH_PER_SECOND: f64 = 2_097_152.0;

/// The bucket [`PEER_WARMTH_PER_SECOND`] fills.
#[derive(Debug)]
pub struct WarmthBudget {
    tokens: f64,
    at: Option<Instant>,
}

impl Default for WarmthBudget {
    fn default() -> Self {
        WarmthBudget {
            tokens: PEER_WARMTH_PER_SECOND,
            at: None,
        }
    }
}

impl WarmthBudget {
    /// True (and spent) when `hashes` more fit the budget at `now`.
    pub fn spend(&mut self, hashes: usize, now: Instant) -> bool {
        if let Some(at) = self.at {
            let refill = now.saturating_duration_since(at).as_secs_f64() * PEER_WARMTH_PER_SECOND;
            self.tokens = (self.tokens + refill).min(PEER_WARMTH_PER_SECOND);
        }
        self.at = Some(now);
        let n = hashes as f64;
        if n > self.tokens {
            return false;
        }
        self.tokens -= n;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hearth_wire::peer::SEAL_BYTES;

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
    fn with_a_members_file_only_the_listed_keys_speak_even_with_the_fleets_key() {
        let key = FleetKey::from_bytes(&[1; 32]);
        let seed = |b: u8| {
            let dir = std::env::temp_dir().join(format!("hearth-seed-{}-{b}", std::process::id()));
            std::fs::write(&dir, format!("{}\n", hex(&[b; 32]))).unwrap();
            let s = PeerSeed::read(&dir).unwrap();
            std::fs::remove_file(&dir).unwrap();
            s
        };
        let a = Identity::of(&seed(7), None).unwrap();
        // The same seed is the same key (and id) at every start.
        assert_eq!(
            a.public_key(),
            Identity::of(&seed(7), None).unwrap().public_key()
        );
        assert_eq!(a.public_key_hex(), hex(&a.public_key()));
        let members = Members::new(&[a.public_key()]);
        let b = Identity::of(&seed(8), Some(&members));
        assert!(
            b.as_ref().is_err_and(|e| e.contains("does not list")),
            "{b:?}"
        );
        let outsider = Identity::generate();
        let subject = "hearth.f.updates";
        let from_a = seal(Some(&key), &a, subject, b"a".to_vec());
        let from_outsider = seal(Some(&key), &outsider, subject, b"o".to_vec());
        assert_eq!(
            open(Some(&key), Some(&members), subject, &from_a).map(|o| o.sender),
            Ok(a.sender())
        );
        assert_eq!(
            open(Some(&key), Some(&members), subject, &from_outsider),
            Err(SealError::UnknownMember)
        );
        // Without the members file, the fleet's key is enough.
        assert!(open(Some(&key), None, subject, &from_outsider).is_ok());
        assert_eq!(SealError::UnknownMember.reason(), "unknown_member");
    }

    #[test]
    fn a_message_opens_only_with_its_key_its_bytes_and_its_subject() {
        let key = FleetKey::from_bytes(&[1; 32]);
        let other = FleetKey::from_bytes(&[2; 32]);
        let me = Identity::generate();
        let sealed = seal(Some(&key), &me, "hearth.f.updates", b"message".to_vec());
        assert_eq!(sealed.len(), 7 + SEAL_BYTES);
        let opened = Opened {
            message: &b"message"[..],
            sender: me.sender(),
        };
        assert_eq!(
            open(Some(&key), None, "hearth.f.updates", &sealed),
            Ok(opened)
        );
        assert_eq!(
            open(Some(&other), None, "hearth.f.updates", &sealed),
            Err(SealError::BadMac)
        );
        assert_eq!(
            open(Some(&key), None, "_INBOX.x", &sealed),
            Err(SealError::BadMac),
            "bound to its subject"
        );
        for i in 0..sealed.len() {
            let mut changed = sealed.clone();
            changed[i] ^= 1;
            assert_eq!(
                open(Some(&key), None, "hearth.f.updates", &changed),
                Err(SealError::BadMac),
                "byte {i}"
            );
        }
        let unsigned = seal(None, &me, "hearth.f.updates", b"message".to_vec());
        assert_eq!(
            open(Some(&key), None, "hearth.f.updates", &unsigned),
            Err(SealError::Unsigned)
        );
        assert_eq!(
            open(Some(&key), None, "s", &[0; SEAL_BYTES - 1]),
            Err(SealError::Short)
        );
        // Without a fleet key (an open bus), the MAC is not read, the
        // signature still is.
        assert_eq!(open(None, None, "hearth.f.updates", &sealed), Ok(opened));
        assert_eq!(
            open(None, None, "_INBOX.x", &sealed),
            Err(SealError::BadSignature)
        );
        assert_eq!(format!("{key:?}"), "<redacted>");
    }

    #[test]
    fn a_fleet_member_cannot_speak_under_another_members_id() {
        let key = FleetKey::from_bytes(&[1; 32]);
        let (real, forger) = (Identity::generate(), Identity::generate());
        assert_ne!(real.sender(), forger.sender());
        // The forger holds the fleet key: its message opens, as its own.
        let forged = seal(Some(&key), &forger, "s", b"as the real one".to_vec());
        assert_eq!(
            open(Some(&key), None, "s", &forged).unwrap().sender,
            forger.sender()
        );
        // Another's key and the forger's signature: refused.
        let mut swapped = forged.clone();
        let at = forged.len() - SEAL_BYTES;
        let real_sealed = seal(Some(&key), &real, "s", b"as the real one".to_vec());
        swapped[at..at + KEY_BYTES].copy_from_slice(&real_sealed[at..at + KEY_BYTES]);
        let body = swapped.len() - MAC_BYTES;
        let mac = key.mac("s", &swapped[..body]);
        swapped[body..].copy_from_slice(&mac);
        assert_eq!(
            open(Some(&key), None, "s", &swapped),
            Err(SealError::BadSignature)
        );
        // The id is the key's digest: the same key, the same id.
        assert_eq!(id_of(&real_sealed[at..at + KEY_BYTES]), real.sender());
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
    fn snapshots_are_taken_only_after_a_hello_and_only_for_a_while() {
        let t0 = Instant::now();
        let mut s = Snapshots::default();
        // Nothing asked, nothing answered: no snapshot, on either subject.
        assert!(!s.allow(7, true, t0));
        assert!(!s.allow(7, false, t0));
        // After this sidecar's hello: its inbox takes parts, from anyone.
        s.asked(t0);
        assert!(s.allow(7, true, t0 + Duration::from_secs(1)));
        assert!(!s.allow(7, false, t0 + Duration::from_secs(1)));
        assert!(!s.allow(7, true, t0 + SNAPSHOT_WINDOW));
        // After answering 7's hello: 7's parts on the fleet's subject.
        let t1 = t0 + Duration::from_secs(100);
        s.answered(7, t1);
        assert!(s.allow(7, false, t1 + Duration::from_secs(2)));
        assert!(!s.allow(8, false, t1 + Duration::from_secs(2)));
        assert!(!s.allow(7, false, t1 + SNAPSHOT_WINDOW));
        // Remembered senders are bounded.
        for sender in 0..10_000 {
            s.answered(1_000 + sender, t1);
        }
        assert!(s.answered.len() <= MAX_ANSWERED);
    }

    #[test]
    fn peers_warmth_is_bounded_per_second_and_refills() {
        let t0 = Instant::now();
        let mut b = WarmthBudget::default();
        let second = PEER_WARMTH_PER_SECOND as usize;
        assert!(b.spend(second - 10, t0));
        assert!(b.spend(10, t0));
        assert!(!b.spend(1, t0), "spent");
        assert!(!b.spend(second, t0 + Duration::from_millis(500)));
        assert!(b.spend(second / 2, t0 + Duration::from_millis(500)));
        // A whole second refills it, no more.
        assert!(!b.spend(second + 1, t0 + Duration::from_secs(10)));
        assert!(b.spend(second, t0 + Duration::from_secs(10)));
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

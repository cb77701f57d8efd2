//! The peer bus's message format: every kind round trips, hostile bytes are
//! refused without a panic or an outsized allocation, the replica-list
//! digest ignores order, and `Update::split` keeps every figure within the
//! size limit.

use hearth_wire::peer::{
    decode, encode, list_digest, sender_id, split_seal, Body, Envelope, Health, Load, PeerError,
    Update, Warmth, KEY_BYTES, MAC_BYTES, MAX_MESSAGE_BYTES, MAX_RECORD_HASHES, MIN_SPLIT_BYTES,
    PEER_FORMAT, SEAL_BYTES, SIGNATURE_BYTES,
};
use proptest::prelude::*;

const FLEET: &str = "prod-eu";

fn envelope(body: Body) -> Envelope {
    Envelope {
        fleet: FLEET.into(),
        list: 0xDEAD_BEEF,
        sender: 42,
        seq: 7,
        body,
    }
}

/// Bytes of the envelope before the body: magic, format, fleet, list,
/// sender, seq, kind.
fn header_len(fleet: &str) -> usize {
    4 + 1 + 1 + fleet.len() + 8 + 8 + 8 + 1
}

fn sample_update() -> Update {
    Update {
        warmth: vec![
            Warmth {
                replica: 3,
                hashes: vec![1, 2, 3],
                tip: Some(3),
            },
            Warmth {
                replica: 0,
                hashes: vec![],
                tip: None,
            },
        ],
        load: vec![Load {
            replica: 1,
            in_flight: 4,
            load: 6.5,
        }],
        health: vec![
            Health {
                replica: 2,
                rank: Some(1),
                serving: false,
            },
            Health {
                replica: 0,
                rank: None,
                serving: true,
            },
        ],
    }
}

fn sample_messages() -> Vec<Envelope> {
    vec![
        envelope(Body::Update(sample_update())),
        envelope(Body::Update(Update::default())),
        envelope(Body::Hello {
            reply: "_INBOX.abc".into(),
        }),
        envelope(Body::Snapshot {
            part: 1,
            parts: 3,
            update: sample_update(),
        }),
    ]
}

/// A message declaring one warmth record of `hashes` hashes, followed by
/// `then` bytes.
fn declaring_hashes(hashes: u32, then: usize) -> Vec<u8> {
    let mut bytes = encode(&envelope(Body::Update(Update::default())));
    bytes.truncate(header_len(FLEET));
    bytes.extend_from_slice(&1u32.to_le_bytes()); // one warmth record
    bytes.extend_from_slice(&0u16.to_le_bytes()); // replica 0
    bytes.extend_from_slice(&hashes.to_le_bytes());
    bytes.extend(std::iter::repeat_n(0xAB, then));
    bytes
}

/// Where the body of `e`'s encoding starts.
fn body_at(e: &Envelope) -> usize {
    header_len(&e.fleet)
}

#[test]
fn every_kind_round_trips() {
    for e in sample_messages() {
        assert_eq!(decode(&encode(&e)), Ok(e));
    }
    // The longest fleet name and reply subject, in multi-byte characters.
    let e = Envelope {
        fleet: "ü".repeat(127) + "x",
        list: u64::MAX,
        sender: 0,
        seq: u64::MAX,
        body: Body::Hello {
            reply: "ß".repeat(127) + "y",
        },
    };
    assert_eq!(decode(&encode(&e)), Ok(e));
}

#[test]
fn the_header_is_the_documented_layout() {
    let e = envelope(Body::Update(Update::default()));
    let bytes = encode(&e);
    assert_eq!(&bytes[..4], b"HRTP");
    assert_eq!(bytes[4], PEER_FORMAT);
    assert_eq!(usize::from(bytes[5]), FLEET.len());
    assert_eq!(&bytes[6..6 + FLEET.len()], FLEET.as_bytes());
    let at = 6 + FLEET.len();
    assert_eq!(bytes[at..at + 8], 0xDEAD_BEEFu64.to_le_bytes());
    assert_eq!(bytes[at + 8..at + 16], 42u64.to_le_bytes());
    assert_eq!(bytes[at + 16..at + 24], 7u64.to_le_bytes());
    assert_eq!(bytes[at + 24], 1, "kind: update");
    // An empty update is its three zero counts.
    assert_eq!(bytes[body_at(&e)..], [0u8; 12]);
}

#[test]
fn encoded_len_is_the_body_of_an_update_and_8_less_than_a_snapshots() {
    let u = sample_update();
    let update = envelope(Body::Update(u.clone()));
    assert_eq!(encode(&update).len(), header_len(FLEET) + u.encoded_len());
    let snapshot = envelope(Body::Snapshot {
        part: 0,
        parts: 1,
        update: u.clone(),
    });
    assert_eq!(
        encode(&snapshot).len(),
        header_len(FLEET) + 8 + u.encoded_len()
    );
    assert_eq!(Update::default().encoded_len(), 12);
}

#[test]
fn is_empty_means_no_figure_at_all() {
    assert!(Update::default().is_empty());
    assert!(!sample_update().is_empty());
    let only_health = Update {
        health: sample_update().health,
        ..Update::default()
    };
    assert!(!only_health.is_empty());
}

#[test]
fn every_truncation_of_every_kind_is_refused_as_truncated() {
    for e in sample_messages() {
        let bytes = encode(&e);
        for n in 0..bytes.len() {
            assert_eq!(
                decode(&bytes[..n]),
                Err(PeerError::Truncated),
                "{n} bytes of {e:?}"
            );
        }
    }
}

#[test]
fn four_billion_hashes_declared_in_20_bytes_are_refused_without_allocating_them() {
    let before = peak_virtual_bytes();
    let bytes = declaring_hashes(4_000_000_000, 20);
    assert_eq!(decode(&bytes), Err(PeerError::Truncated));
    // The most a count can declare, for every list in an update.
    assert_eq!(
        decode(&declaring_hashes(u32::MAX, 20)),
        Err(PeerError::Truncated)
    );
    let mut bytes = encode(&envelope(Body::Update(Update::default())));
    let body = header_len(FLEET);
    for at in [body, body + 4, body + 8] {
        let mut b = bytes.clone();
        b[at..at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(decode(&b), Err(PeerError::Truncated), "count at {at}");
    }
    // Honest counts over the same bytes are read.
    bytes = declaring_hashes(2, 16 + 1 + 8);
    let n = bytes.len();
    bytes[n - 9] = 0; // no tip
    bytes[n - 8..].fill(0); // no load, no health
    assert!(decode(&bytes).is_ok());
    // Had the decoder reserved room for the declared hashes (32 GB), the
    // allocation would have failed (aborting the tests) or shown here. The
    // margin allows for the other tests' threads starting meanwhile.
    if let (Some(before), Some(after)) = (before, peak_virtual_bytes()) {
        assert!(
            after - before < 4 << 30,
            "peak grew by {} bytes",
            after - before
        );
    }
}

/// The process's peak virtual memory size (Linux' `VmPeak`), when known.
fn peak_virtual_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmPeak:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[test]
fn oversized_input_is_refused_before_reading_it() {
    let big = vec![0u8; MAX_MESSAGE_BYTES + 1];
    assert_eq!(
        decode(&big),
        Err(PeerError::Oversized(MAX_MESSAGE_BYTES + 1))
    );
    // A valid message of exactly the limit is read; one byte more is not.
    // A snapshot part (an update's record holds at most a fingerprint's
    // hashes) of fleet "prod-e" (6 bytes): header 37, part and parts 8,
    // counts 12, record 7, so the hashes take the remaining multiple of 8.
    let fleet = "prod-e";
    let fixed = header_len(fleet) + 8 + 12 + 7;
    assert_eq!((MAX_MESSAGE_BYTES - fixed) % 8, 0);
    let mut e = envelope(Body::Snapshot {
        part: 0,
        parts: 1,
        update: Update {
            warmth: vec![Warmth {
                replica: 9,
                hashes: (0..(MAX_MESSAGE_BYTES - fixed) as u64 / 8).collect(),
                tip: None,
            }],
            ..Update::default()
        },
    });
    e.fleet = fleet.into();
    let mut bytes = encode(&e);
    assert_eq!(bytes.len(), MAX_MESSAGE_BYTES);
    assert_eq!(decode(&bytes), Ok(e));
    bytes.push(0);
    assert_eq!(
        decode(&bytes),
        Err(PeerError::Oversized(MAX_MESSAGE_BYTES + 1))
    );
}

#[test]
fn another_format_is_refused() {
    for format in [0, PEER_FORMAT + 1, u8::MAX] {
        let mut bytes = encode(&envelope(Body::Hello { reply: "r".into() }));
        bytes[4] = format;
        assert_eq!(decode(&bytes), Err(PeerError::Format(format)));
    }
}

#[test]
fn a_sealed_message_splits_into_the_message_its_key_its_signature_and_its_mac() {
    let message = encode(&envelope(Body::Hello { reply: "r".into() }));
    let mut sealed = message.clone();
    sealed.extend_from_slice(&[5; KEY_BYTES]);
    sealed.extend_from_slice(&[6; SIGNATURE_BYTES]);
    sealed.extend_from_slice(&[7; MAC_BYTES]);
    assert_eq!(SEAL_BYTES, 128);
    let s = split_seal(&sealed).unwrap();
    assert_eq!(s.message, &message[..]);
    assert_eq!(s.key, &[5; KEY_BYTES]);
    assert_eq!(s.signature, &[6; SIGNATURE_BYTES]);
    assert_eq!(s.mac, &[7; MAC_BYTES]);
    assert_eq!(s.maced, &sealed[..sealed.len() - MAC_BYTES]);
    assert!(decode(s.message).is_ok());
    // Without the split, the seal is bytes after the body.
    assert!(decode(&sealed).is_err());
    let empty = split_seal(&[0; SEAL_BYTES]).unwrap();
    assert_eq!(empty.message, &[] as &[u8]);
    assert_eq!(split_seal(&[0; SEAL_BYTES - 1]), None);
}

#[test]
fn a_senders_id_is_the_first_eight_bytes_of_its_keys_digest() {
    let mut digest = [0u8; 32];
    digest[..8].copy_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8]);
    digest[8..].fill(0xff);
    assert_eq!(sender_id(&digest), 0x0807_0605_0403_0201);
}

#[test]
fn an_updates_records_hold_no_more_than_a_fingerprint_and_no_tip_alone() {
    let record = |hashes: usize, tip: Option<u64>| Warmth {
        replica: 0,
        hashes: (0..hashes as u64).collect(),
        tip,
    };
    let update = |w: Warmth| {
        encode(&envelope(Body::Update(Update {
            warmth: vec![w],
            ..Update::default()
        })))
    };
    assert!(decode(&update(record(MAX_RECORD_HASHES, Some(1)))).is_ok());
    assert!(matches!(
        decode(&update(record(MAX_RECORD_HASHES + 1, None))),
        Err(PeerError::Malformed(_))
    ));
    assert!(matches!(
        decode(&update(record(0, Some(9)))),
        Err(PeerError::Malformed(_))
    ));
    assert!(decode(&update(record(0, None))).is_ok());
    // A snapshot's records are whole indexes and resident tips.
    let snapshot = |w: Warmth| {
        encode(&envelope(Body::Snapshot {
            part: 0,
            parts: 1,
            update: Update {
                warmth: vec![w],
                ..Update::default()
            },
        }))
    };
    assert!(decode(&snapshot(record(MAX_RECORD_HASHES + 1, None))).is_ok());
    assert!(decode(&snapshot(record(0, Some(9)))).is_ok());
}

#[test]
fn trailing_bytes_are_refused() {
    for e in sample_messages() {
        let mut bytes = encode(&e);
        bytes.push(0);
        assert!(
            matches!(decode(&bytes), Err(PeerError::Malformed(_))),
            "{e:?}"
        );
    }
}

#[test]
fn malformed_fields_are_refused() {
    let malformed = |bytes: &[u8]| matches!(decode(bytes), Err(PeerError::Malformed(_)));
    // Not a peer message at all.
    assert!(malformed(b"GET / HTTP/1.1\r\n"));
    assert!(malformed(b"HRTQ\x01"));
    let hello = encode(&envelope(Body::Hello { reply: "r".into() }));
    let kind = header_len(FLEET) - 1;
    // Unknown kinds.
    for k in [0, 4, u8::MAX] {
        let mut b = hello.clone();
        b[kind] = k;
        assert!(malformed(&b), "kind {k}");
    }
    // A fleet or reply that is not UTF-8.
    let mut b = hello.clone();
    b[6] = 0xFF;
    assert!(malformed(&b));
    let mut b = hello.clone();
    *b.last_mut().unwrap() = 0xC3; // a lone lead byte
    assert!(malformed(&b));
    // Snapshot parts: part must be below parts.
    for (part, parts) in [(3, 3), (0, 0), (u32::MAX, 1)] {
        let b = encode(&envelope(Body::Snapshot {
            part,
            parts,
            update: Update::default(),
        }));
        assert!(malformed(&b), "part {part} of {parts}");
    }
}

#[test]
fn flag_bytes_other_than_0_and_1_and_loads_that_are_not_finite_are_refused() {
    let one = |update: Update| encode(&envelope(Body::Update(update)));
    let body = header_len(FLEET);
    // Tip flag: counts 4, replica 2, hash count 4, no hashes.
    let warmth = one(Update {
        warmth: vec![Warmth {
            replica: 0,
            hashes: vec![],
            tip: None,
        }],
        ..Update::default()
    });
    let mut b = warmth.clone();
    b[body + 10] = 2;
    assert!(matches!(decode(&b), Err(PeerError::Malformed(_))));
    // Rank flag and serving byte: counts 12, replica 2.
    let health = one(Update {
        health: vec![Health {
            replica: 0,
            rank: None,
            serving: true,
        }],
        ..Update::default()
    });
    for at in [body + 14, body + 15] {
        let mut b = health.clone();
        b[at] = 7;
        assert!(
            matches!(decode(&b), Err(PeerError::Malformed(_))),
            "byte {at}"
        );
    }
    // Load value: counts 8, replica 2, in-flight 4.
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let b = one(Update {
            load: vec![Load {
                replica: 0,
                in_flight: 1,
                load: bad,
            }],
            ..Update::default()
        });
        assert!(matches!(decode(&b), Err(PeerError::Malformed(_))), "{bad}");
    }
}

#[test]
fn the_list_digest_ignores_order_and_duplicates_and_tells_lists_apart() {
    let a = list_digest(&["10.0.0.1:8000", "10.0.0.2:8000"]);
    assert_eq!(
        a,
        list_digest(&["10.0.0.2:8000", "10.0.0.1:8000", "10.0.0.1:8000"])
    );
    assert_eq!(
        a,
        list_digest(&[String::from("10.0.0.2:8000"), String::from("10.0.0.1:8000")])
    );
    assert_ne!(a, list_digest(&["10.0.0.1:8000"]));
    assert_ne!(a, list_digest(&["10.0.0.1:8000", "10.0.0.2:8000#1"]));
    assert_ne!(a, list_digest(&["10.0.0.1:8000", "10.0.0.2:8001"]));
    // Entries are delimited: "ab" + "c" is not "a" + "bc".
    assert_ne!(list_digest(&["ab", "c"]), list_digest(&["a", "bc"]));
    assert_ne!(list_digest::<&str>(&[]), list_digest(&[""]));
}

#[test]
fn the_list_digest_is_stable() {
    // FNV-1a 64 of nothing is its offset basis; the others pin the
    // definition (length as u64 LE, then the bytes, in sorted order), so a
    // change shows here before sidecars of two builds stop agreeing.
    assert_eq!(list_digest::<&str>(&[]), 0xcbf2_9ce4_8422_2325);
    let mut bytes = Vec::new();
    for e in ["10.0.0.1:8000", "10.0.0.1:8000#1"] {
        bytes.extend_from_slice(&(e.len() as u64).to_le_bytes());
        bytes.extend_from_slice(e.as_bytes());
    }
    assert_eq!(
        list_digest(&["10.0.0.1:8000#1", "10.0.0.1:8000"]),
        hearth_wire::fnv1a64(&bytes)
    );
}

#[test]
fn a_record_larger_than_the_limit_is_cut_with_the_tip_on_the_last_piece() {
    let u = Update {
        warmth: vec![Warmth {
            replica: 5,
            hashes: (0..1000).collect(),
            tip: Some(7777),
        }],
        ..Update::default()
    };
    // A part holds 12 + 7 + 8 * 100 bytes: 100 hashes without a tip, 99
    // with one. Nine pieces of 100; the last 100 hashes and the tip do not
    // fit one part, so 99 go without the tip and the last hash carries it.
    let parts = u.split(819);
    let pieces: Vec<(usize, Option<u64>)> = parts
        .iter()
        .map(|p| (p.warmth[0].hashes.len(), p.warmth[0].tip))
        .collect();
    let mut expected = vec![(100, None); 9];
    expected.extend([(99, None), (1, Some(7777))]);
    assert_eq!(pieces, expected);
    let mut next = 0;
    for p in &parts {
        assert!(p.encoded_len() <= 819);
        assert_eq!(p.warmth.len(), 1);
        assert_eq!(p.warmth[0].replica, 5);
        for &h in &p.warmth[0].hashes {
            assert_eq!(h, next);
            next += 1;
        }
    }
    assert_eq!(next, 1000);
}

#[test]
fn split_fills_the_room_left_before_starting_a_part() {
    let record = |replica, n: u64| Warmth {
        replica,
        hashes: (0..n).collect(),
        tip: Some(n),
    };
    // A first record of 12 + 7 + 80 + 8 = 107 bytes leaves 93 of 200: ten
    // hashes of the second record fill it (7 + 80), the rest goes on.
    let u = Update {
        warmth: vec![record(1, 10), record(2, 30)],
        ..Update::default()
    };
    let parts = u.split(200);
    assert_eq!(parts.len(), 2);
    assert_eq!(parts[0].warmth[1].hashes.len(), 10);
    assert_eq!(parts[0].warmth[1].tip, None);
    assert_eq!(parts[1].warmth[0].hashes.len(), 20);
    assert_eq!(parts[1].warmth[0].tip, Some(30));
}

#[test]
fn an_empty_update_splits_into_one_empty_part_and_a_tiny_limit_is_raised() {
    assert_eq!(Update::default().split(1000), vec![Update::default()]);
    let parts = sample_update().split(0);
    assert!(parts.iter().all(|p| p.encoded_len() <= MIN_SPLIT_BYTES));
    assert!(parts.iter().all(|p| !p.is_empty()));
}

fn arb_warmth(max_hashes: usize) -> impl Strategy<Value = Warmth> {
    (
        any::<u16>(),
        prop::collection::vec(any::<u64>(), 0..max_hashes),
        any::<Option<u64>>(),
    )
        .prop_map(|(replica, hashes, tip)| Warmth {
            replica,
            // A tip alone is a snapshot's (an update refuses it).
            tip: tip.filter(|_| !hashes.is_empty()),
            hashes,
        })
}

fn arb_update(records: usize, max_hashes: usize, entries: usize) -> impl Strategy<Value = Update> {
    let load =
        (any::<u16>(), any::<u32>(), -1e9f32..1e9).prop_map(|(replica, in_flight, load)| Load {
            replica,
            in_flight,
            load,
        });
    let health =
        (any::<u16>(), any::<Option<u16>>(), any::<bool>()).prop_map(|(replica, rank, serving)| {
            Health {
                replica,
                rank,
                serving,
            }
        });
    (
        prop::collection::vec(arb_warmth(max_hashes), 0..records),
        prop::collection::vec(load, 0..entries),
        prop::collection::vec(health, 0..entries),
    )
        .prop_map(|(warmth, load, health)| Update {
            warmth,
            load,
            health,
        })
}

fn arb_envelope(records: usize, max_hashes: usize) -> impl Strategy<Value = Envelope> {
    let body = prop_oneof![
        arb_update(records, max_hashes, 8).prop_map(Body::Update),
        "[a-zA-Z0-9_.]{0,40}".prop_map(|reply| Body::Hello { reply }),
        (1u32..100, arb_update(records, max_hashes, 8)).prop_flat_map(|(parts, update)| {
            (0..parts).prop_map(move |part| Body::Snapshot {
                part,
                parts,
                update: update.clone(),
            })
        }),
    ];
    ("\\PC{0,20}", any::<u64>(), any::<u64>(), any::<u64>(), body).prop_map(
        |(fleet, list, sender, seq, body)| Envelope {
            fleet,
            list,
            sender,
            seq,
            body,
        },
    )
}

/// Checks that `parts` hold `u`'s figures: the load and health entries in
/// order, and each warmth record as consecutive pieces of its replica whose
/// hashes concatenate to the record's, the tip on the last piece only.
fn assert_same_figures(u: &Update, parts: &[Update]) -> Result<(), TestCaseError> {
    let loads: Vec<&Load> = parts.iter().flat_map(|p| &p.load).collect();
    prop_assert_eq!(loads, u.load.iter().collect::<Vec<_>>());
    let healths: Vec<&Health> = parts.iter().flat_map(|p| &p.health).collect();
    prop_assert_eq!(healths, u.health.iter().collect::<Vec<_>>());
    let mut pieces = parts.iter().flat_map(|p| &p.warmth);
    for w in &u.warmth {
        let mut hashes = Vec::new();
        loop {
            let piece = pieces.next();
            prop_assert!(piece.is_some(), "record {:?} is missing", w);
            let Some(piece) = piece else { break };
            prop_assert_eq!(piece.replica, w.replica);
            hashes.extend_from_slice(&piece.hashes);
            if hashes.len() >= w.hashes.len() {
                prop_assert_eq!(piece.tip, w.tip);
                break;
            }
            prop_assert_eq!(piece.tip, None);
            prop_assert!(!piece.hashes.is_empty());
        }
        prop_assert_eq!(&hashes, &w.hashes);
    }
    prop_assert!(pieces.next().is_none(), "pieces left over");
    Ok(())
}

proptest! {
    #[test]
    fn updates_round_trip(u in arb_update(8, 300, 40), seq in any::<u64>()) {
        let mut e = envelope(Body::Update(u.clone()));
        e.seq = seq;
        let bytes = encode(&e);
        prop_assert_eq!(bytes.len(), header_len(FLEET) + u.encoded_len());
        prop_assert_eq!(decode(&bytes), Ok(e));
    }

    #[test]
    fn envelopes_round_trip(e in arb_envelope(6, 50)) {
        prop_assert_eq!(decode(&encode(&e)), Ok(e));
    }

    #[test]
    fn arbitrary_bytes_are_refused_or_read_back_exactly(
        bytes in prop::collection::vec(any::<u8>(), 0..512),
    ) {
        // Without the magic, always refused.
        if !bytes.starts_with(b"HRTP") {
            prop_assert!(decode(&bytes).is_err());
        }
        // Behind a valid start, whatever follows: refused, or (rarely) a
        // message that encodes back to the very same bytes.
        let mut framed = b"HRTP\x02".to_vec();
        framed.extend_from_slice(&bytes);
        if let Ok(e) = decode(&framed) {
            prop_assert_eq!(encode(&e), framed);
        }
    }

    #[test]
    fn a_changed_byte_is_refused_or_read_back_exactly(
        e in arb_envelope(4, 20),
        at in any::<prop::sample::Index>(),
        value in any::<u8>(),
    ) {
        let mut bytes = encode(&e);
        let i = at.index(bytes.len());
        bytes[i] = value;
        if let Ok(d) = decode(&bytes) {
            prop_assert_eq!(encode(&d), bytes);
        }
    }

    #[test]
    fn every_truncation_of_a_valid_message_is_truncated(e in arb_envelope(4, 20)) {
        let bytes = encode(&e);
        for n in 0..bytes.len() {
            prop_assert_eq!(decode(&bytes[..n]), Err(PeerError::Truncated), "{} of {} bytes", n, bytes.len());
        }
    }

    #[test]
    fn the_list_digest_ignores_order(
        entries in prop::collection::vec("[0-9.:#]{1,20}", 0..12),
        shuffle in any::<prop::sample::Index>(),
    ) {
        let mut other = entries.clone();
        if !other.is_empty() {
            let k = shuffle.index(other.len());
            other.rotate_left(k);
            other.reverse();
            other.push(other[0].clone());
        }
        prop_assert_eq!(list_digest(&entries), list_digest(&other));
    }

    #[test]
    fn split_parts_fit_and_keep_every_figure_in_order(
        u in arb_update(8, 300, 40),
        max in 0usize..4096,
    ) {
        let limit = max.max(MIN_SPLIT_BYTES);
        let parts = u.clone().split(max);
        prop_assert!(!parts.is_empty());
        for p in &parts {
            prop_assert!(p.encoded_len() <= limit, "{} > {}", p.encoded_len(), limit);
            let bytes = encode(&envelope(Body::Update(p.clone())));
            prop_assert!(bytes.len() <= header_len(FLEET) + limit);
        }
        // No part is empty unless the update was, and no two neighbours
        // would have fitted one part.
        if u.is_empty() {
            prop_assert_eq!(parts.len(), 1);
        }
        for p in &parts {
            prop_assert!(u.is_empty() || !p.is_empty());
        }
        for pair in parts.windows(2) {
            prop_assert!(pair[0].encoded_len() + pair[1].encoded_len() - 12 > limit);
        }
        assert_same_figures(&u, &parts)?;
    }
}

//! The peer bus's message format: round trips, and hostile bytes refused
//! without a panic or an outsized allocation.

use hearth_wire::peer::{
    decode, encode, list_digest, Body, Envelope, Health, Load, PeerError, Update, Warmth,
    MAX_MESSAGE_BYTES, PEER_FORMAT,
};
use proptest::prelude::*;

fn envelope(body: Body) -> Envelope {
    Envelope {
        fleet: "prod-eu".into(),
        list: 0xDEAD_BEEF,
        sender: 42,
        seq: 7,
        body,
    }
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

#[test]
fn every_kind_round_trips() {
    for body in [
        Body::Update(sample_update()),
        Body::Hello {
            reply: "_INBOX.abc".into(),
        },
        Body::Snapshot {
            part: 1,
            parts: 3,
            update: sample_update(),
        },
        Body::Update(Update::default()),
    ] {
        let e = envelope(body);
        assert_eq!(decode(&encode(&e)), Ok(e));
    }
}

#[test]
fn every_truncation_is_refused_as_truncated() {
    let bytes = encode(&envelope(Body::Update(sample_update())));
    for n in 4..bytes.len() {
        assert_eq!(decode(&bytes[..n]), Err(PeerError::Truncated), "{n} bytes");
    }
    assert!(decode(&bytes[..2]).is_err());
}

#[test]
fn a_huge_declared_count_is_refused_without_allocating_it() {
    let mut bytes = encode(&envelope(Body::Update(Update::default())));
    // The warmth count is the first field of the body, after the kind.
    let at = bytes.len() - 12;
    bytes[at..at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
    assert_eq!(decode(&bytes), Err(PeerError::Truncated));
}

#[test]
fn oversized_foreign_format_and_trailing_bytes_are_refused() {
    let big = vec![0u8; MAX_MESSAGE_BYTES + 1];
    assert_eq!(
        decode(&big),
        Err(PeerError::Oversized(MAX_MESSAGE_BYTES + 1))
    );
    let mut bytes = encode(&envelope(Body::Hello { reply: "r".into() }));
    bytes[4] = PEER_FORMAT + 1;
    assert_eq!(decode(&bytes), Err(PeerError::Format(PEER_FORMAT + 1)));
    let mut bytes = encode(&envelope(Body::Hello { reply: "r".into() }));
    bytes.push(0);
    assert!(matches!(decode(&bytes), Err(PeerError::Malformed(_))));
    assert!(matches!(
        decode(b"GET / HTTP/1.1\r\n"),
        Err(PeerError::Malformed(_))
    ));
}

#[test]
fn a_snapshot_part_beyond_its_parts_is_refused() {
    let bytes = encode(&envelope(Body::Snapshot {
        part: 3,
        parts: 3,
        update: Update::default(),
    }));
    assert!(matches!(decode(&bytes), Err(PeerError::Malformed(_))));
}

#[test]
fn the_list_digest_ignores_order_and_duplicates_and_tells_lists_apart() {
    let a = list_digest(&["10.0.0.1:8000", "10.0.0.2:8000"]);
    assert_eq!(
        a,
        list_digest(&["10.0.0.2:8000", "10.0.0.1:8000", "10.0.0.1:8000"])
    );
    assert_ne!(a, list_digest(&["10.0.0.1:8000"]));
    assert_ne!(a, list_digest(&["10.0.0.1:8000", "10.0.0.2:8000#1"]));
    // Entries are delimited: "ab" + "c" is not "a" + "bc".
    assert_ne!(list_digest(&["ab", "c"]), list_digest(&["a", "bc"]));
}

fn arb_update() -> impl Strategy<Value = Update> {
    let warmth = (
        any::<u16>(),
        prop::collection::vec(any::<u64>(), 0..300),
        any::<Option<u64>>(),
    )
        .prop_map(|(replica, hashes, tip)| Warmth {
            replica,
            hashes,
            tip,
        });
    let load =
        (any::<u16>(), any::<u32>(), 0f32..1e6).prop_map(|(replica, in_flight, load)| Load {
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
        prop::collection::vec(warmth, 0..8),
        prop::collection::vec(load, 0..40),
        prop::collection::vec(health, 0..8),
    )
        .prop_map(|(warmth, load, health)| Update {
            warmth,
            load,
            health,
        })
}

proptest! {
    #[test]
    fn updates_round_trip(u in arb_update(), seq in any::<u64>()) {
        let mut e = envelope(Body::Update(u.clone()));
        e.seq = seq;
        let bytes = encode(&e);
        prop_assert_eq!(bytes.len(), 4 + 1 + 1 + e.fleet.len() + 24 + 1 + u.encoded_len());
        prop_assert_eq!(decode(&bytes), Ok(e));
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode(&bytes);
        let mut framed = b"HRTP\x01".to_vec();
        framed.extend_from_slice(&bytes);
        let _ = decode(&framed);
    }

    #[test]
    fn split_parts_fit_and_keep_every_hash_in_order(u in arb_update(), max in 64usize..4096) {
        let parts = u.clone().split(max);
        prop_assert!(!parts.is_empty());
        for p in &parts {
            prop_assert!(p.encoded_len() <= max.max(12 + 7 + 16 + 8), "{} > {}", p.encoded_len(), max);
        }
        // Per replica, the hashes come out in the order they went in.
        let flat = |ws: Vec<&Warmth>| ws.iter().flat_map(|w| w.hashes.iter().map(|&h| (w.replica, h))).collect::<Vec<_>>();
        let before = flat(u.warmth.iter().collect());
        let after = flat(parts.iter().flat_map(|p| p.warmth.iter()).collect());
        prop_assert_eq!(before, after);
        let tips = |ws: Vec<&Warmth>| ws.iter().filter_map(|w| w.tip).collect::<Vec<_>>();
        prop_assert_eq!(tips(u.warmth.iter().collect()), tips(parts.iter().flat_map(|p| p.warmth.iter()).collect()));
        let loads: usize = parts.iter().map(|p| p.load.len()).sum();
        let healths: usize = parts.iter().map(|p| p.health.len()).sum();
        prop_assert_eq!((loads, healths), (u.load.len(), u.health.len()));
    }
}

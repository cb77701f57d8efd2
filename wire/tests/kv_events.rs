//! The KV event reader against batches vLLM's own classes encoded
//! (`golden/kv-events.json`, made by `golden/kv-events.py`), and against
//! mangled copies of them.

use hearth_wire::kv_events::{decode_batch, encode_batch, Event, Medium};
use serde_json::Value;

fn cases() -> Vec<Value> {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/golden/kv-events.json"
    ))
    .expect("golden/kv-events.json");
    serde_json::from_str(&text).expect("golden JSON")
}

fn bytes_of(case: &Value) -> Vec<u8> {
    let hex = case["msgpack"].as_str().unwrap();
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect()
}

fn hashes(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|h| h.as_str().unwrap().parse().unwrap())
        .collect()
}

#[test]
fn reads_what_vllm_encodes() {
    let cases = cases();
    assert_eq!(cases.len(), 5);
    for case in &cases {
        let name = case["name"].as_str().unwrap();
        let batch = decode_batch(&bytes_of(case)).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(batch.ts, case["ts"].as_f64().unwrap(), "{name}");
        assert_eq!(batch.data_parallel_rank, case["rank"].as_i64(), "{name}");
        let want = case["events"].as_array().unwrap();
        assert_eq!(batch.events.len(), want.len(), "{name}");
        for (got, want) in batch.events.iter().zip(want) {
            let medium = if want["offloaded"].as_bool().unwrap() {
                Medium::Offloaded
            } else {
                Medium::Device
            };
            let expected = match want["type"].as_str().unwrap() {
                "BlockStored" => Event::Stored {
                    hashes: hashes(&want["hashes"]),
                    parent: want["parent"].as_str().map(|p| p.parse().unwrap()),
                    tokens: want["tokens"].as_u64().unwrap(),
                    block_size: want["block_size"].as_u64().unwrap(),
                    medium,
                },
                "BlockRemoved" => Event::Removed {
                    hashes: hashes(&want["hashes"]),
                    medium,
                },
                _ => Event::AllCleared,
            };
            assert_eq!(got, &expected, "{name}");
        }
        // What the simulated engine writes of the same batch reads the same.
        assert_eq!(decode_batch(&encode_batch(&batch)), Ok(batch), "{name}");
    }
}

#[test]
fn mangled_vllm_batches_never_panic() {
    for case in cases() {
        let good = bytes_of(&case);
        for cut in 0..good.len() {
            assert!(decode_batch(&good[..cut]).is_err());
        }
        // Every byte flipped to every value that makes it a marker of
        // another kind: read or refused, never a panic or a hang.
        for i in 0..good.len() {
            for b in [
                0x00, 0x7f, 0x80, 0x9f, 0xc0, 0xc1, 0xc4, 0xcf, 0xd3, 0xdb, 0xdd, 0xdf, 0xff,
            ] {
                let mut bad = good.clone();
                bad[i] = b;
                let _ = decode_batch(&bad);
            }
        }
    }
}

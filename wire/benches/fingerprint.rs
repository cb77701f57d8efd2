//! Canonicalise + hash of chat bodies (8 KB, 220 KB, 1.1 MiB), natively: the
//! same code the wasm filter and the body-mode sidecar run. Also the
//! `x-hearth-fp` header codec for a full fingerprint, and (group `shapes`)
//! the fingerprint of every body shape of `tests/shapes` at 1 MiB, whose
//! bytes per second compare with `shapes/plain_chat`'s.
//!
//! Run: `cargo bench -p hearth-wire --bench fingerprint -- --warm-up-time 1 --measurement-time 3`
//! (`-- shapes/` for the shapes alone).

#[path = "../tests/shapes/mod.rs"]
mod shapes;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use hearth_wire::{canonical_prompt, chain_hashes, fingerprint, header, Endpoint, Params};
use serde_json::json;
use std::hint::black_box;

/// An agent-style chat body of about `target` bytes: a system prompt, tools,
/// then user / assistant (with tool calls) / tool rounds until it is big
/// enough. Deterministic.
fn chat_body(target: usize) -> Vec<u8> {
    let words = [
        "fn",
        "let",
        "match",
        "struct",
        "impl",
        "return",
        "the",
        "request",
        "body",
        "cache",
        "replica",
        "prefix",
        "\"quoted\"",
        "path/to/file.rs",
        "\\n",
        "é",
        "{",
        "}",
    ];
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut text = |n: usize| {
        let mut s = String::with_capacity(n + 16);
        while s.len() < n {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            s.push_str(words[(seed % words.len() as u64) as usize]);
            s.push(if seed.is_multiple_of(11) { '\n' } else { ' ' });
        }
        s
    };
    let mut messages = vec![json!({"role": "system", "content": text(4000.min(target / 2))})];
    let tools = json!([{"type": "function", "function": {"name": "read_file", "description": "Read a file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]);
    let mut size = 4200;
    let mut i = 0;
    while size < target {
        let chunk = (target - size).clamp(200, 6000);
        messages.push(json!({"role": "user", "content": text(chunk / 3)}));
        messages.push(json!({"role": "assistant", "content": text(chunk / 6),
            "tool_calls": [{"id": format!("call_{i}"), "type": "function",
                "function": {"name": "read_file", "arguments": "{\"path\":\"src/lib.rs\"}"}}]}));
        messages.push(json!({"role": "tool", "tool_call_id": format!("call_{i}"), "content": text(chunk / 2)}));
        size += chunk + 200;
        i += 1;
    }
    serde_json::to_vec(&json!({
        "model": "hearth-sim", "stream": true, "temperature": 0.2,
        "tools": tools, "messages": messages,
    }))
    .expect("serialise")
}

const SIZES: [(&str, usize); 3] = [
    ("8KB", 8 * 1000),
    ("220KB", 220 * 1000),
    ("1.1MiB", 1_153_434),
];

fn bench_fingerprint(c: &mut Criterion) {
    let params = Params::default();
    let mut g = c.benchmark_group("fingerprint");
    for (name, size) in SIZES {
        let body = chat_body(size);
        g.throughput(Throughput::Bytes(body.len() as u64));
        g.bench_with_input(
            BenchmarkId::new("canonicalise+hash", name),
            &body,
            |b, body| b.iter(|| fingerprint(Endpoint::ChatCompletions, black_box(body), &params)),
        );
        g.bench_with_input(
            BenchmarkId::new("canonical_bytes_only", name),
            &body,
            |b, body| b.iter(|| canonical_prompt(Endpoint::ChatCompletions, black_box(body))),
        );
        let (model, canonical) =
            canonical_prompt(Endpoint::ChatCompletions, &body).expect("canonical");
        g.bench_with_input(BenchmarkId::new("hash_only", name), &canonical, |b, c| {
            b.iter(|| chain_hashes(&model, black_box(c), &params))
        });
        g.bench_with_input(BenchmarkId::new("parse_only", name), &body, |b, body| {
            b.iter(|| serde_json::from_slice::<serde::de::IgnoredAny>(black_box(body)))
        });
    }
    g.finish();
}

fn bench_header(c: &mut Criterion) {
    // A full default fingerprint of a 1.1 MiB prompt: 564 blocks of 2 KiB.
    let hashes: Vec<u64> = (0..564u64)
        .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .collect();
    let value = header::encode(2048, &hashes);
    let mut g = c.benchmark_group("header");
    g.throughput(Throughput::Elements(hashes.len() as u64));
    g.bench_function("encode/564", |b| {
        b.iter(|| header::encode(2048, black_box(&hashes)))
    });
    g.bench_function("decode/564", |b| {
        b.iter(|| header::decode(black_box(&value)))
    });
    g.finish();
}

fn bench_shapes(c: &mut Criterion) {
    let params = Params::default();
    let mut g = c.benchmark_group("shapes");
    // The slowest shapes take milliseconds a run; ten samples keep the
    // whole group within a few minutes.
    g.sample_size(10);
    for s in shapes::all(1 << 20) {
        g.throughput(Throughput::Bytes(s.body.len() as u64));
        g.bench_with_input(BenchmarkId::from_parameter(s.name), &s, |b, s| {
            b.iter(|| fingerprint(s.endpoint, black_box(&s.body), &params))
        });
    }
    g.finish();
}

criterion_group!(benches, bench_fingerprint, bench_header, bench_shapes);
criterion_main!(benches);

//! What the outcome filter's scanner costs per streamed chunk, natively
//! (the filter runs the same code in its wasm VM for every chunk of every
//! generation's answer): a vLLM-style chat stream of 1,000 one-token
//! chunks, then the usage chunk and `[DONE]`, fed chunk by chunk.
//!
//! Run: `cargo bench -p hearth-wire --bench outcome_scan -- --warm-up-time 1 --measurement-time 3`

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use hearth_wire::outcome::Scanner;
use std::hint::black_box;

/// The chunks of one streamed answer of `tokens` tokens, as vLLM's
/// OpenAI server writes them.
fn chat_stream(tokens: usize) -> Vec<Vec<u8>> {
    let head = r#"data: {"id":"chatcmpl-4f1c2a9e8b7d4c3a","object":"chat.completion.chunk","created":1796508303,"model":"llama-4x512","choices":[{"index":0,"delta":"#;
    let mut chunks = vec![format!("{head}{{\"role\":\"assistant\",\"content\":\"\"}},\"logprobs\":null,\"finish_reason\":null}}]}}\n\n")];
    let words = [
        "the", " cache", " of", " each", " replica", " holds", " a", " prefix",
    ];
    for i in 0..tokens {
        let w = words[i % words.len()];
        chunks.push(format!(
            "{head}{{\"content\":\"{w}\"}},\"logprobs\":null,\"finish_reason\":null}}]}}\n\n"
        ));
    }
    chunks.push(format!(
        "{head}{{}},\"logprobs\":null,\"finish_reason\":\"length\",\"stop_reason\":null}}]}}\n\n"
    ));
    chunks.push(format!(
        "data: {{\"id\":\"chatcmpl-4f1c2a9e8b7d4c3a\",\"object\":\"chat.completion.chunk\",\"created\":1796508303,\"model\":\"llama-4x512\",\"choices\":[],\"usage\":{{\"prompt_tokens\":7353,\"total_tokens\":{},\"completion_tokens\":{tokens},\"prompt_tokens_details\":{{\"cached_tokens\":7168}}}}}}\n\n",
        7353 + tokens
    ));
    chunks.push("data: [DONE]\n\n".to_string());
    chunks.into_iter().map(String::into_bytes).collect()
}

fn scan(c: &mut Criterion) {
    let chunks = chat_stream(1000);
    let mut g = c.benchmark_group("outcome_scan");
    g.throughput(Throughput::Elements(chunks.len() as u64));
    g.bench_function("chat_stream_1000_tokens", |b| {
        b.iter(|| {
            let mut s = Scanner::default();
            for chunk in &chunks {
                s.feed(black_box(chunk));
            }
            assert!(s.text() && s.done() && s.usage().is_some());
            black_box(s.answer())
        })
    });
    g.finish();
}

criterion_group!(benches, scan);
criterion_main!(benches);

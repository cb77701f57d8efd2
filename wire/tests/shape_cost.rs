//! What a fingerprint costs in memory, by the shape of the body: the peak of
//! live heap bytes while `fingerprint()` runs, over the body's size, for
//! every shape of `tests/shapes` at about 4 MiB, and of random fragments
//! repeated wherever the canonical form reads them. A counting allocator
//! wraps the system one; the tests take turns, so no other test's
//! allocations are counted.
//!
//! The bound: nothing of the body is copied or built into a tree, so what
//! a parse holds is the hash list, the key index of the one JSON value
//! being written (at most 32,768 keys) and nothing else: under a quarter
//! of a 4 MiB body whatever its shape, and far less for most (the table
//! it prints says how much).

#![allow(unsafe_code)]

mod shapes;

use hearth_wire::{fingerprint, Endpoint, Params};
use proptest::prelude::*;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(by: usize) {
    let now = LIVE.fetch_add(by, Relaxed) + by;
    PEAK.fetch_max(now, Relaxed);
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            // A moving realloc holds both blocks for a moment; count that.
            grew(new_size);
            LIVE.fetch_sub(layout.size(), Relaxed);
        }
        p
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

const TARGET: usize = 4 << 20;
const MAX_RATIO: f64 = 0.25;

#[test]
fn a_fingerprint_costs_a_small_multiple_of_the_body_whatever_its_shape() {
    let _one = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let params = Params::default();
    let mut over = Vec::new();
    eprintln!(
        "{:<24} {:>9} {:>10} {:>6}  outcome",
        "shape", "body", "peak", "ratio"
    );
    for s in shapes::all(TARGET) {
        let base = LIVE.load(Relaxed);
        PEAK.store(base, Relaxed);
        let got = fingerprint(s.endpoint, &s.body, &params);
        let peak = PEAK.load(Relaxed) - base;
        let outcome = match &got {
            Ok(fp) => format!("{} canonical bytes, {:?}", fp.prompt_bytes, fp.cache),
            Err(r) => format!("skipped: {r}"),
        };
        drop(got);
        let ratio = report(s.name, s.body.len(), peak, &outcome);
        if ratio > MAX_RATIO {
            over.push(format!("{}: {ratio:.2}", s.name));
        }
    }
    assert!(over.is_empty(), "over {MAX_RATIO}x the body: {over:?}");
}

/// Writing the engine's priority (`HEARTH_ENGINE_PRIORITY`) builds the new
/// body and nothing else: its peak is the new body (the old one's size
/// and a member more, with the room a growing buffer may take), whatever
/// the shape.
#[test]
fn writing_the_engine_priority_costs_the_new_body_whatever_the_shape() {
    let _one = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let mut over = Vec::new();
    for s in shapes::all(TARGET) {
        let base = LIVE.load(Relaxed);
        PEAK.store(base, Relaxed);
        let got = hearth_wire::priority::set_priority(&s.body, -42);
        let peak = PEAK.load(Relaxed) - base;
        let written = got.as_ref().map_or(0, Vec::len);
        drop(got);
        let ratio = report(
            s.name,
            s.body.len(),
            peak,
            &format!("{written} bytes written"),
        );
        if ratio > 1.0 + MAX_RATIO {
            over.push(format!("{}: {ratio:.2}", s.name));
        }
    }
    assert!(
        over.is_empty(),
        "over {}x the body: {over:?}",
        1.0 + MAX_RATIO
    );
}

/// Prints one shape's line of the table and returns its peak over its
/// body's size.
fn report(name: &str, body: usize, peak: usize, outcome: &str) -> f64 {
    let ratio = peak as f64 / body as f64;
    eprintln!("{name:<24} {body:>9} {peak:>10} {ratio:>6.3}  {outcome}");
    ratio
}

/// One test at a time: the counting allocator counts every thread.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A random small JSON value: what a hostile body repeats.
fn fragment() -> impl Strategy<Value = String> {
    let leaf = prop_oneof![
        Just("0".to_string()),
        Just("null".to_string()),
        Just("true".to_string()),
        (0u32..1000, -320i32..320).prop_map(|(m, e)| format!("{m}e{e}")),
        (0u64..u64::MAX).prop_map(|n| n.to_string()),
        "[a-z\\\\\"]{0,6}"
            .prop_map(|s| format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))),
    ];
    leaf.prop_recursive(6, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(|v| format!("[{}]", v.join(","))),
            prop::collection::vec(("[a-c]{0,2}", inner), 0..4).prop_map(|v| {
                let members: Vec<String> =
                    v.into_iter().map(|(k, x)| format!("\"{k}\":{x}")).collect();
                format!("{{{}}}", members.join(","))
            }),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Whatever is repeated wherever the canonical form reads it, the
    /// parse holds a small part of the body.
    #[test]
    fn any_repeated_fragment_costs_a_small_part_of_the_body(item in fragment(), place in 0usize..6) {
        let _one = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        let n = (256 << 10) / (item.len() + 1);
        let items = vec![item.as_str(); n].join(",");
        let (endpoint, body) = match place {
            0 => (Endpoint::ChatCompletions, format!(r#"{{"model":"m","messages":[{items}]}}"#)),
            1 => (Endpoint::ChatCompletions, format!(r#"{{"model":"m","messages":[{{"role":"user","content":[{items}]}}]}}"#)),
            2 => (Endpoint::ChatCompletions, format!(r#"{{"model":"m","tools":[{items}],"messages":[{{"role":"user","content":"x"}}]}}"#)),
            3 => (Endpoint::ChatCompletions, format!(r#"{{"model":"m","messages":[{{"role":"assistant","tool_calls":[{items}]}}]}}"#)),
            4 => (Endpoint::Responses, format!(r#"{{"model":"m","input":[{items}]}}"#)),
            _ => (Endpoint::Completions, format!(r#"{{"model":"m","prompt":[{items}]}}"#)),
        };
        let base = LIVE.load(Relaxed);
        PEAK.store(base, Relaxed);
        let got = fingerprint(endpoint, body.as_bytes(), &Params::default());
        let peak = PEAK.load(Relaxed) - base;
        drop(got);
        prop_assert!(peak < (64 << 10) + body.len() / 4, "{peak} bytes for a {} byte body of {item:.80}", body.len());
    }
}

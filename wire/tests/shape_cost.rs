//! What a fingerprint costs in memory, by the shape of the body: the peak of
//! live heap bytes while `fingerprint()` runs, over the body's size, for
//! every shape of `tests/shapes` at about 4 MiB. A counting allocator wraps
//! the system one; the single test runs the shapes one after another, so no
//! other test's allocations are counted.
//!
//! The bound: nothing of the body is copied or built into a tree, so what
//! a parse holds is the hash list, the key index of the one JSON value
//! being written (at most 65,536 keys) and nothing else: under a quarter
//! of a 4 MiB body whatever its shape, and far less for most (the table
//! it prints says how much).

#![allow(unsafe_code)]

mod shapes;

use hearth_wire::{fingerprint, Params};
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
        let ratio = peak as f64 / s.body.len() as f64;
        eprintln!(
            "{:<24} {:>9} {:>10} {:>6.3}  {outcome}",
            s.name,
            s.body.len(),
            peak,
            ratio
        );
        if ratio > MAX_RATIO {
            over.push(format!("{}: {ratio:.2}", s.name));
        }
    }
    assert!(over.is_empty(), "over {MAX_RATIO}x the body: {over:?}");
}

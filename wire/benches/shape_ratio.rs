//! Time per byte of a fingerprint for every body shape of `tests/shapes`,
//! as a ratio to plain chat's: each shape is timed interleaved with the
//! plain chat body (the best of 15 runs each), so a busy machine slows
//! both alike. The ratio, not the speed, is the figure to compare.
//!
//! Run: `cargo bench -p hearth-wire --bench shape_ratio` (bodies of 1 MiB),
//! or `-- 4194304` for another size in bytes; other arguments name the
//! shapes to time (all by default). `scripts/shape-ratio` runs
//! it natively and, built for the filter's target, under V8 (Node's WASI:
//! `benches/wasi.mjs`), as the filter runs inside Envoy.

#[path = "../tests/shapes/mod.rs"]
mod shapes;

use hearth_wire::{fingerprint, Params};
use std::hint::black_box;
use std::time::Instant;

const RUNS: usize = 15;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let size = args.iter().find_map(|a| a.parse().ok()).unwrap_or(1 << 20);
    // Names of shapes to time; `cargo bench` adds `--bench`.
    let names: Vec<&str> = args
        .iter()
        .filter(|a| a.parse::<usize>().is_err() && !a.starts_with('-'))
        .map(String::as_str)
        .collect();
    let params = Params::default();
    let all = shapes::all(size);
    let plain = &all[0];
    let per_byte = |s: &shapes::Shape| {
        let t = Instant::now();
        black_box(fingerprint(s.endpoint, black_box(&s.body), &params)).ok();
        t.elapsed().as_secs_f64() / s.body.len() as f64
    };
    println!(
        "fingerprint time per byte by body shape: bodies of about {size} bytes, \
         the best of {RUNS} runs each, interleaved with {}",
        plain.name
    );
    println!("{:<26} {:>10} {:>8}  outcome", "shape", "MiB/s", "ratio");
    for shape in all
        .iter()
        .filter(|s| names.is_empty() || names.contains(&s.name))
    {
        let (mut base, mut this) = (f64::MAX, f64::MAX);
        for _ in 0..RUNS {
            base = base.min(per_byte(plain));
            this = this.min(per_byte(shape));
        }
        let outcome = match fingerprint(shape.endpoint, &shape.body, &params) {
            Ok(f) => format!("{} hashes", f.hashes.len()),
            Err(e) => format!("skipped: {}", e.as_str()),
        };
        println!(
            "{:<26} {:>10.1} {:>7.2}x  {outcome}",
            shape.name,
            1.0 / this / f64::from(1 << 20),
            this / base
        );
    }
}

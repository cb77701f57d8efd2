//! Fingerprints one body shape of `tests/shapes` once, for an instruction
//! count under callgrind (exact, where `benches/shape_ratio.rs`'s times
//! move between runs):
//!
//! ```text
//! cargo build --release -p hearth-wire --example shape_cost
//! valgrind --tool=callgrind --toggle-collect='hearth_wire::fingerprint*' \
//!     target/release/examples/shape_cost deep_unsorted_objects
//! ```
//!
//! It prints the body's size; the instructions a byte are callgrind's
//! total over it. A second argument sets the size (1 MiB by default).

#[path = "../tests/shapes/mod.rs"]
mod shapes;

use hearth_wire::{fingerprint, Params};
use std::hint::black_box;

fn main() {
    let mut args = std::env::args().skip(1);
    let name = args.next().unwrap_or_else(|| "plain_chat".into());
    let size = args.next().and_then(|a| a.parse().ok()).unwrap_or(1 << 20);
    let Some(shape) = shapes::all(size).into_iter().find(|s| s.name == name) else {
        eprintln!("no shape {name}");
        std::process::exit(2);
    };
    let f = fingerprint(shape.endpoint, black_box(&shape.body), &Params::default());
    println!(
        "{name}: {} bytes, {}",
        shape.body.len(),
        match f {
            Ok(f) => format!("{} hashes", f.hashes.len()),
            Err(e) => format!("skipped: {}", e.as_str()),
        }
    );
}

//! Names the build in every benchmark report: the commit the binary was
//! built from, and whether the code that goes into it (the sidecar, the
//! router, the wire format, the filter, the benchmark itself, the Envoy
//! configurations) had uncommitted changes. Reports compared across
//! commits need to say which code produced each figure.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Folders, relative to the repository root, whose contents make a build.
const CODE: [&str; 6] = [
    "ext-proc",
    "wire",
    "filter-wasm",
    "bench/src",
    "envoy",
    "Cargo.lock",
];

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let root = manifest
        .parent()
        .expect("bench/ sits in the repository root");
    let build = describe(root).unwrap_or_else(|| "unknown (not a git checkout)".to_string());
    println!("cargo:rustc-env=HEARTH_BENCH_BUILD={build}");
    // A new commit moves HEAD or a branch; an edit touches the code. Not
    // the index: `git status` rewrites it, and every run would rebuild.
    if let Some(git_dir) = git(root, &["rev-parse", "--absolute-git-dir"]) {
        let git_dir = Path::new(&git_dir);
        for f in ["HEAD", "refs/heads", "packed-refs"] {
            println!("cargo:rerun-if-changed={}", git_dir.join(f).display());
        }
    }
    for c in CODE {
        println!("cargo:rerun-if-changed={}", root.join(c).display());
    }
}

/// `abc1234`, or `abc1234 with uncommitted changes`.
fn describe(root: &Path) -> Option<String> {
    let commit = git(root, &["rev-parse", "--short=7", "HEAD"])?;
    let mut status = vec!["status", "--porcelain", "--untracked-files=no", "--"];
    status.extend(CODE);
    let changed = git(root, &status).is_some_and(|s| !s.is_empty());
    Some(if changed {
        format!("{commit} with uncommitted changes")
    } else {
        commit
    })
}

/// `git ARGS` in `root`, its trimmed output; `None` when git is missing or fails.
fn git(root: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .arg("-C")
        .arg(root)
        .args(args)
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

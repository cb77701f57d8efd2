//! `hearth-bench compare` refuses options that cannot work together
//! before it starts anything, saying what to pass instead.

use std::process::Command;

/// Runs `hearth-bench compare` on an engine address nothing listens on
/// with `extra` options; returns whether it succeeded and its stderr.
fn compare(extra: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_hearth-bench"))
        .args(["compare", "--engines", "127.0.0.1:9", "--model", "m"])
        .args(extra)
        .output()
        .expect("run hearth-bench compare");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn keep_without_the_harness_is_refused_before_anything_runs() {
    let dir = std::env::temp_dir().join(format!("hearth-keep-refused-{}", std::process::id()));
    let (ok, stderr) = compare(&[
        "--policies",
        "least_request",
        "--keep",
        dir.to_str().unwrap(),
    ]);
    assert!(!ok, "compare --keep without the harness succeeded");
    assert!(
        stderr.contains("--keep") && stderr.contains("--driver inference-perf"),
        "{stderr}"
    );
    assert!(!dir.exists(), "{} was made", dir.display());
}

#[test]
fn paired_without_hearth_is_refused_before_anything_runs() {
    let (ok, stderr) = compare(&["--policies", "least_request,ring_hash", "--paired"]);
    assert!(!ok, "compare --paired without Hearth succeeded");
    assert!(
        stderr.contains("--paired needs a Hearth policy"),
        "{stderr}"
    );
}

//! What the binary's start-up tests share.

use std::process::Command;

/// Runs the sidecar binary with `args` and only these `HEARTH_*`
/// variables: its exit code and standard error.
pub fn run(env: &[(&str, &str)], args: &[&str]) -> (i32, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_hearth-ext-proc"));
    cmd.args(args);
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("HEARTH_")) {
        cmd.env_remove(k);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

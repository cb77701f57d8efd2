//! The binary refuses bad settings at start-up with a clear message.

use std::process::Command;

fn run(env: &[(&str, &str)], args: &[&str]) -> (i32, String) {
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

#[test]
fn unknown_hearth_variable_is_refused_naming_the_valid_ones() {
    let (code, err) = run(
        &[("HEARTH_UPSTREAMS", "127.0.0.1:1"), ("HEARTH_ALPAH", "3")],
        &[],
    );
    assert_eq!(code, 2);
    assert!(err.contains("HEARTH_ALPAH"), "{err}");
    assert!(
        err.contains("HEARTH_ALPHA") && err.contains("HEARTH_AFFINITY_BASIS"),
        "{err}"
    );
}

#[test]
fn invalid_settings_are_all_reported() {
    let (code, err) = run(
        &[
            ("HEARTH_UPSTREAMS", "127.0.0.1:1,127.0.0.1:1"),
            ("HEARTH_WARMTH_BLOCKS", "0"),
        ],
        &[],
    );
    assert_eq!(code, 2);
    assert!(
        err.contains("twice") && err.contains("HEARTH_WARMTH_BLOCKS"),
        "{err}"
    );
    let (code, err) = run(&[("HEARTH_UPSTREAMS", "backend:8000")], &[]);
    assert_ne!(code, 0);
    assert!(err.contains("ip:port"), "{err}");
}

#[test]
fn envoy_config_subcommand_prints_a_bootstrap_for_the_upstreams() {
    let out = Command::new(env!("CARGO_BIN_EXE_hearth-ext-proc"))
        .args([
            "--upstreams",
            "127.0.0.1:7001,127.0.0.1:7002",
            "envoy-config",
        ])
        .output()
        .unwrap();
    assert!(out.status.success());
    let yaml = String::from_utf8(out.stdout).unwrap();
    assert!(yaml.contains("port_value: 7001") && yaml.contains("port_value: 7002"));
    assert!(yaml.contains("envoy.load_balancing_policies.override_host"));
}

//! Every Envoy configuration the project ships passes `envoy --mode
//! validate`, and the shipped gateway bootstrap is what the generator makes.

use std::path::{Path, PathBuf};

use clap::Parser;
use hearth_bench::gateway::validate;
use hearth_ext_proc::config::Cli;
use hearth_ext_proc::envoy_config::render;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

#[test]
fn shipped_gateway_yaml_is_the_generated_default() {
    let cli = Cli::try_parse_from([
        "hearth-ext-proc",
        "--upstreams=127.0.0.1:8001,127.0.0.1:8002,127.0.0.1:8003,127.0.0.1:8004",
        "envoy-config",
    ])
    .unwrap();
    let Some(hearth_ext_proc::config::Command::EnvoyConfig(args)) = &cli.command else {
        panic!("envoy-config did not parse")
    };
    let expected = render(&args.gateway(&cli.settings));
    let shipped = std::fs::read_to_string(root().join("envoy/gateway.yaml")).unwrap();
    assert!(
        shipped == expected,
        "envoy/gateway.yaml is stale: regenerate it with scripts/gen-envoy-config"
    );
}

#[test]
fn shipped_body_mode_yaml_is_the_generated_default() {
    let cli = Cli::try_parse_from([
        "hearth-ext-proc",
        "--upstreams=127.0.0.1:8001,127.0.0.1:8002,127.0.0.1:8003,127.0.0.1:8004",
        "envoy-config",
        "--mode=body",
    ])
    .unwrap();
    let Some(hearth_ext_proc::config::Command::EnvoyConfig(args)) = &cli.command else {
        panic!("envoy-config did not parse")
    };
    let expected = args.render(&cli.settings);
    let shipped = std::fs::read_to_string(root().join("envoy/gateway-body.yaml")).unwrap();
    assert!(
        shipped == expected,
        "envoy/gateway-body.yaml is stale: regenerate it with scripts/gen-envoy-config"
    );
}

#[test]
fn shipped_gie_yaml_is_the_generated_default() {
    let cli = Cli::try_parse_from([
        "hearth-ext-proc",
        "--upstreams=127.0.0.1:8001,127.0.0.1:8002,127.0.0.1:8003,127.0.0.1:8004",
        "envoy-config",
        "--mode=gie",
    ])
    .unwrap();
    let Some(hearth_ext_proc::config::Command::EnvoyConfig(args)) = &cli.command else {
        panic!("envoy-config did not parse")
    };
    let expected = args.render(&cli.settings);
    let shipped = std::fs::read_to_string(root().join("envoy/gateway-gie.yaml")).unwrap();
    assert!(
        shipped == expected,
        "envoy/gateway-gie.yaml is stale: regenerate it with scripts/gen-envoy-config"
    );
}

/// `envoy --mode validate` on a bootstrap's text (through a scratch file
/// named after `name`).
fn validate_text(name: &str, yaml: &str) -> anyhow::Result<()> {
    let tmp = std::env::temp_dir().join(format!(
        "hearth-validate-{}-{name}.yaml",
        std::process::id()
    ));
    std::fs::write(&tmp, yaml)?;
    let result = validate(&tmp);
    let _ = std::fs::remove_file(&tmp);
    result
}

#[test]
fn every_shipped_envoy_config_validates() {
    // Configs name the wasm module relative to the repository root.
    let wasm = hearth_bench::gateway::find_wasm().expect("wasm built");
    let mut checked = 0;
    for entry in std::fs::read_dir(root().join("envoy")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "yaml") {
            let text = std::fs::read_to_string(&path).unwrap();
            let text = text.replace(
                hearth_ext_proc::envoy_config::DEFAULT_WASM,
                &wasm.canonicalize().unwrap().display().to_string(),
            );
            validate_text(&format!("shipped-{checked}"), &text)
                .unwrap_or_else(|e| panic!("{}: {e:#}", path.display()));
            checked += 1;
        }
    }
    assert!(
        checked >= 3,
        "expected the three gateway configs under envoy/"
    );
}

/// The bootstraps whose engines come from the sidecar over EDS (not
/// shipped as files: `envoy-config --endpoints eds` makes them).
#[test]
fn eds_bootstraps_validate() {
    let wasm = hearth_bench::gateway::find_wasm().expect("wasm built");
    let wasm = wasm.canonicalize().unwrap().display().to_string();
    for mode in ["filter", "body"] {
        let cli = Cli::try_parse_from([
            "hearth-ext-proc",
            "--upstreams=127.0.0.1:8001,127.0.0.1:8002,127.0.0.1:8003,127.0.0.1:8004",
            "envoy-config",
            &format!("--mode={mode}"),
            "--endpoints=eds",
            &format!("--wasm={wasm}"),
        ])
        .unwrap();
        let Some(hearth_ext_proc::config::Command::EnvoyConfig(args)) = &cli.command else {
            panic!("envoy-config did not parse")
        };
        let yaml = args.render(&cli.settings);
        assert!(yaml.contains("type: EDS"), "{mode}: {yaml}");
        validate_text(&format!("eds-{mode}"), &yaml)
            .unwrap_or_else(|e| panic!("{mode} with --endpoints eds: {e:#}"));
    }
}

#[test]
fn the_plain_baseline_validates() {
    // What `hearth-bench overhead` compares the gateway with.
    let g = hearth_ext_proc::envoy_config::Gateway::local(
        "127.0.0.1:0".parse().unwrap(),
        "127.0.0.1:50051".parse().unwrap(),
        "127.0.0.1:9190".parse().unwrap(),
        vec![
            "127.0.0.1:8001".parse().unwrap(),
            "127.0.0.1:8002".parse().unwrap(),
        ],
        std::path::PathBuf::new(),
    );
    let yaml = hearth_ext_proc::envoy_config::render_plain(&g);
    assert!(yaml.contains("port_value: 8002") && !yaml.contains("ext_proc"));
    validate_text("plain", &yaml).unwrap_or_else(|e| panic!("plain baseline: {e:#}"));
}

#[test]
fn every_sidecar_setting_is_documented_in_the_readme() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let missing: Vec<String> = hearth_ext_proc::config::known_env_vars()
        .into_iter()
        .filter(|v| !readme.contains(&format!("`{v}`")))
        .collect();
    assert!(
        missing.is_empty(),
        "README settings table lacks {missing:?}"
    );
}

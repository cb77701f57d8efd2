//! Every Envoy configuration the project ships passes `envoy --mode
//! validate`, and the shipped gateway bootstrap is what the generator makes
//! and what the snippets make of the plain gateway.

use std::path::{Path, PathBuf};

use clap::Parser;
use hearth_e2e::validate_config;
use hearth_ext_proc::config::{Cli, Command};
use hearth_ext_proc::envoy_config::{render, render_plain, EnvoyConfigArgs};
use hearth_ext_proc::Settings;
use serde_yaml::Value;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// `envoy-config` as `scripts/gen-envoy-config` runs it for the shipped
/// files, with `extra` flags.
fn shipped(extra: &[&str]) -> (EnvoyConfigArgs, Settings) {
    let mut args = vec![
        "hearth-ext-proc",
        "--upstreams=127.0.0.1:8001,127.0.0.1:8002,127.0.0.1:8003,127.0.0.1:8004",
        "envoy-config",
    ];
    args.extend_from_slice(extra);
    let cli = Cli::try_parse_from(args).unwrap();
    let Some(Command::EnvoyConfig(args)) = cli.command else {
        panic!("envoy-config did not parse")
    };
    (args, cli.settings)
}

#[test]
fn shipped_gateway_yaml_is_the_generated_default() {
    let (args, settings) = shipped(&[]);
    let expected = render(&args.gateway(&settings));
    let shipped = read("envoy/gateway.yaml");
    assert!(
        shipped == expected,
        "envoy/gateway.yaml is stale: regenerate it with scripts/gen-envoy-config"
    );
}

#[test]
fn shipped_body_mode_yaml_is_the_generated_default() {
    let (args, settings) = shipped(&["--mode=body"]);
    let expected = args.render(&settings);
    let shipped = std::fs::read_to_string(root().join("envoy/gateway-body.yaml")).unwrap();
    assert!(
        shipped == expected,
        "envoy/gateway-body.yaml is stale: regenerate it with scripts/gen-envoy-config"
    );
}

#[test]
fn shipped_gie_yaml_is_the_generated_default() {
    let (args, settings) = shipped(&["--mode=gie"]);
    let expected = args.render(&settings);
    let shipped = std::fs::read_to_string(root().join("envoy/gateway-gie.yaml")).unwrap();
    assert!(
        shipped == expected,
        "envoy/gateway-gie.yaml is stale: regenerate it with scripts/gen-envoy-config"
    );
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
            validate_config(&format!("shipped-{checked}"), &text)
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
        let (args, settings) = shipped(&[
            &format!("--mode={mode}"),
            "--endpoints=eds",
            &format!("--wasm={wasm}"),
        ]);
        let yaml = args.render(&settings);
        assert!(yaml.contains("type: EDS"), "{mode}: {yaml}");
        validate_config(&format!("eds-{mode}"), &yaml)
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
    validate_config("plain", &yaml).unwrap_or_else(|e| panic!("plain baseline: {e:#}"));
}

fn read(path: &str) -> String {
    std::fs::read_to_string(root().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

#[test]
fn shipped_gateway_yaml_is_the_snippets_applied_to_the_plain_gateway() {
    let (args, settings) = shipped(&[]);
    let g = args.gateway(&settings);
    let mut applied: Value = serde_yaml::from_str(&render_plain(&g)).unwrap();
    hearth_e2e::snippets::apply_all(&mut applied, &g.snippet_values());
    let shipped: Value = serde_yaml::from_str(&read("envoy/gateway.yaml")).unwrap();
    assert!(
        shipped == applied,
        "envoy/gateway.yaml is not the plain gateway with envoy/snippets/ applied\n\
         --- applied ---\n{}\n--- shipped ---\n{}",
        serde_yaml::to_string(&applied).unwrap(),
        serde_yaml::to_string(&shipped).unwrap()
    );
}

#[test]
fn envoy_snippets_holds_the_snippets_and_its_readme_explains_each() {
    use hearth_ext_proc::envoy_config::snippets::{ALL, PLACEHOLDERS};
    let mut files: Vec<String> = std::fs::read_dir(root().join("envoy/snippets"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|f| f.ends_with(".yaml"))
        .collect();
    files.sort();
    let mut known: Vec<String> = ALL.iter().map(|s| s.file.to_string()).collect();
    known.sort();
    assert_eq!(files, known, "envoy/snippets/*.yaml against snippets::ALL");
    let readme = read("envoy/snippets/README.md");
    for s in ALL {
        assert!(readme.contains(&format!("`{}`", s.file)), "README lacks {}", s.file);
        // The file on disk is the text the generator compiled in.
        assert_eq!(read(&format!("envoy/snippets/{}", s.file)), s.text);
    }
    for (name, _) in PLACEHOLDERS {
        assert!(readme.contains(&format!("`{name}`")), "README lacks {name}");
    }
}

#[test]
fn every_sidecar_setting_is_documented_in_the_readme() {
    let readme = read("README.md");
    let missing: Vec<String> = hearth_ext_proc::config::known_env_vars()
        .into_iter()
        .filter(|v| !readme.contains(&format!("`{v}`")))
        .collect();
    assert!(
        missing.is_empty(),
        "README settings table lacks {missing:?}"
    );
}

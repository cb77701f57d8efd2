//! Every Envoy configuration the project ships passes `envoy --mode
//! validate`, the shipped gateway bootstrap is what the generator makes and
//! what the snippets make of the plain gateway, and every documented
//! default is the code's.

use std::path::{Path, PathBuf};

use clap::{CommandFactory, Parser};
use hearth_e2e::validate_config;
use hearth_ext_proc::config::{Cli, Command};
use hearth_ext_proc::envoy::render::{render, render_plain, EnvoyConfigArgs};
use hearth_ext_proc::Settings;
use serde_norway::Value;

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
                hearth_ext_proc::envoy::render::DEFAULT_WASM,
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

/// Engines written `https://` get a TLS transport socket on the engines
/// cluster that Envoy accepts, in every shape.
#[test]
fn tls_engine_bootstraps_validate() {
    let wasm = hearth_bench::gateway::find_wasm().expect("wasm built");
    let wasm = wasm.canonicalize().unwrap().display().to_string();
    let ca = hearth_ext_proc::envoy::render::SYSTEM_CA_FILE;
    for mode in ["filter", "body", "gie"] {
        let cli = Cli::try_parse_from([
            "hearth-ext-proc",
            "--upstreams=https://127.0.0.1:8001,https://127.0.0.1:8002",
            &format!("--engine-ca-file={ca}"),
            "envoy-config",
            &format!("--mode={mode}"),
            &format!("--wasm={wasm}"),
        ])
        .unwrap();
        let Some(Command::EnvoyConfig(args)) = cli.command else {
            panic!("envoy-config did not parse")
        };
        let yaml = args.render(&cli.settings);
        assert!(yaml.contains("UpstreamTlsContext"), "{mode}");
        validate_config(&format!("tls-{mode}"), &yaml)
            .unwrap_or_else(|e| panic!("{mode} with https:// engines: {e:#}"));
    }
}

#[test]
fn the_plain_baseline_validates() {
    // What `hearth-bench overhead` compares the gateway with.
    let g = hearth_ext_proc::envoy::render::Gateway::local(
        "127.0.0.1:0".parse().unwrap(),
        "127.0.0.1:50051".parse().unwrap(),
        "127.0.0.1:9190".parse().unwrap(),
        vec![
            "127.0.0.1:8001".parse().unwrap(),
            "127.0.0.1:8002".parse().unwrap(),
        ],
        std::path::PathBuf::new(),
    );
    let yaml = hearth_ext_proc::envoy::render::render_plain(&g);
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
    let mut applied: Value = serde_norway::from_str(&render_plain(&g)).unwrap();
    hearth_e2e::snippets::apply_all(&mut applied, &g.snippet_values());
    let shipped: Value = serde_norway::from_str(&read("envoy/gateway.yaml")).unwrap();
    assert!(
        shipped == applied,
        "envoy/gateway.yaml is not the plain gateway with envoy/snippets/ applied\n\
         --- applied ---\n{}\n--- shipped ---\n{}",
        serde_norway::to_string(&applied).unwrap(),
        serde_norway::to_string(&shipped).unwrap()
    );
}

#[test]
fn envoy_snippets_holds_the_snippets_and_its_readme_explains_each() {
    use hearth_ext_proc::envoy::render::snippets::{ALL, PLACEHOLDERS};
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
        assert!(
            readme.contains(&format!("`{}`", s.file)),
            "README lacks {}",
            s.file
        );
        // The file on disk is the text the generator compiled in.
        assert_eq!(read(&format!("envoy/snippets/{}", s.file)), s.text);
    }
    for (name, _) in PLACEHOLDERS {
        assert!(readme.contains(&format!("`{name}`")), "README lacks {name}");
    }
}

/// Every setting's flag, variable and default (`None`: it has none), as
/// the code declares them.
fn code_settings() -> Vec<(String, String, Option<String>)> {
    Cli::command()
        .get_arguments()
        .filter_map(|a| {
            let var = a.get_env()?.to_string_lossy().into_owned();
            let flag = format!("--{}", a.get_long()?);
            let default = a
                .get_default_values()
                .first()
                .map(|v| v.to_string_lossy().into_owned());
            Some((flag, var, default))
        })
        .collect()
}

/// Two spellings of one value: equal text, or equal numbers (`2`, `2.0`).
fn same_value(a: &str, b: &str) -> bool {
    a == b || matches!((a.parse::<f64>(), b.parse::<f64>()), (Ok(x), Ok(y)) if x == y)
}

/// The settings table lives in `docs/settings.md`, the page the README
/// links for every setting.
#[test]
fn the_settings_page_table_has_every_setting_with_the_codes_default() {
    let page = read("docs/settings.md");
    // | `--flag` | `HEARTH_VAR` | default | meaning |
    let rows: Vec<Vec<String>> = page
        .lines()
        .filter(|l| l.starts_with("| `--"))
        .map(|l| l.split('|').map(|c| c.trim().to_string()).collect())
        .collect();
    let settings = code_settings();
    let mut problems = Vec::new();
    for (flag, var, default) in &settings {
        let Some(row) = rows.iter().find(|r| r[2] == format!("`{var}`")) else {
            problems.push(format!("{var}: no row in the settings table"));
            continue;
        };
        if row[1] != format!("`{flag}`") {
            problems.push(format!("{var}: the table says {}, the code {flag}", row[1]));
        }
        // A value in backticks, or a parenthesised note for no default.
        let cell = &row[3];
        let documented = cell.strip_prefix('`').and_then(|c| c.strip_suffix('`'));
        let agrees = match (default, documented) {
            (Some(code), Some(doc)) => same_value(code, doc),
            (None, None) => cell.starts_with('('),
            _ => false,
        };
        if !agrees {
            problems.push(format!(
                "{var}: the table's default is {cell}, the code's {default:?}"
            ));
        }
    }
    for row in &rows {
        if !settings
            .iter()
            .any(|(_, var, _)| row[2] == format!("`{var}`"))
        {
            problems.push(format!("{}: in the table, not a setting", row[2]));
        }
    }
    assert!(
        problems.is_empty(),
        "docs/settings.md settings table: {problems:#?}"
    );
}

#[test]
fn the_sidecar_configmap_holds_each_default_or_says_why_not() {
    let text = read("deploy/sidecar/configmap.yaml");
    // Each entry of `data`, with the comment just above it.
    let mut entries = Vec::new();
    let mut comment = String::new();
    for line in text.lines().skip_while(|l| *l != "data:").skip(1) {
        let line = line.trim();
        if let Some(c) = line.strip_prefix('#') {
            comment.push_str(c.trim());
            comment.push(' ');
        } else if let Some((key, value)) = line.split_once(": ") {
            let value: String = serde_norway::from_str(value).unwrap();
            entries.push((key.to_string(), value, std::mem::take(&mut comment)));
        }
    }
    // The reading above is the YAML's.
    let doc: Value = serde_norway::from_str(&text).unwrap();
    let data = doc["data"].as_mapping().unwrap();
    assert_eq!(entries.len(), data.len());
    for (key, value, _) in &entries {
        assert_eq!(data[key.as_str()].as_str(), Some(value.as_str()), "{key}");
    }
    let mut problems = Vec::new();
    for (_, var, default) in code_settings() {
        let Some((_, value, comment)) = entries.iter().find(|(k, _, _)| *k == var) else {
            problems.push(format!("{var}: not in the ConfigMap"));
            continue;
        };
        // Empty means unset, which is the default of a setting without one.
        let code = default.clone().unwrap_or_default();
        let why = format!(
            "Not the default ({}):",
            default.as_deref().unwrap_or("unset")
        );
        if !same_value(value, &code) && !comment.contains(&why) {
            problems.push(format!(
                "{var}: {value:?} is not the default {code:?}, and its comment lacks \"{why}\""
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "deploy/sidecar/configmap.yaml: {problems:#?}"
    );
}

//! Sidecar settings on the benchmark's command lines: `--set
//! HEARTH_NAME=VALUE` (repeatable), the sidecar's own names, parsed and
//! checked by the sidecar's own parser
//! ([`hearth_ext_proc::config::settings_from_pairs`]). The simulator's
//! router and every real sidecar a driver starts take them from here, so a
//! new sidecar setting needs nothing in the benchmark to be benchmarked.

use clap::Args;
use hearth_ext_proc::Settings;

/// `--set HEARTH_NAME=VALUE`, repeatable.
#[derive(Debug, Clone, Default, Args)]
pub struct SidecarSettings {
    /// A sidecar setting, `HEARTH_NAME=VALUE` (repeatable; the names and
    /// defaults of docs/settings.md). Unset ones keep the sidecar's
    /// default (or the scenario's, for the few a scenario sets).
    #[arg(
        long = "set",
        alias = "hearth-setting",
        value_name = "HEARTH_NAME=VALUE",
        value_parser = parse_setting
    )]
    pub set: Vec<(String, String)>,
}

impl SidecarSettings {
    /// The settings as the sidecar parses them (defaults for the rest).
    pub fn parse(&self) -> anyhow::Result<Settings> {
        parse(&self.set)
    }

    /// ` --set NAME=VALUE` for each, as a command line shows them
    /// (credentials hidden).
    pub fn shown(&self) -> String {
        self.set
            .iter()
            .map(|kv| format!(" --set {}", shown_setting(kv)))
            .collect()
    }
}

/// `pairs` through the sidecar's parser: every problem in one error.
pub fn parse(pairs: &[(String, String)]) -> anyhow::Result<Settings> {
    hearth_ext_proc::config::settings_from_pairs(pairs)
        .map_err(|problems| anyhow::anyhow!("sidecar settings: {}", problems.join("; ")))
}

/// `HEARTH_NAME=VALUE` of `--set`.
pub fn parse_setting(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if k.starts_with("HEARTH_") => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("expected HEARTH_NAME=VALUE, got {s:?}")),
    }
}

/// `NAME=VALUE` for printing, with the value of a credential hidden.
pub fn shown_setting((k, v): &(String, String)) -> String {
    if k.contains("KEY") || k.contains("TOKEN") || k.contains("SECRET") || k.contains("PASSWORD") {
        format!("{k}=***")
    } else {
        format!("{k}={v}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_must_be_hearth_variables() {
        assert_eq!(
            parse_setting("HEARTH_PROBE_INTERVAL_SECONDS=0"),
            Ok(("HEARTH_PROBE_INTERVAL_SECONDS".into(), "0".into()))
        );
        assert!(parse_setting("PATH=/").is_err());
        assert!(parse_setting("HEARTH_X").is_err());
        assert_eq!(
            shown_setting(&("HEARTH_PEERS_PASSWORD".into(), "p".into())),
            "HEARTH_PEERS_PASSWORD=***"
        );
    }

    #[test]
    fn the_sidecars_parser_checks_them() {
        let set = |k: &str, v: &str| SidecarSettings {
            set: vec![(k.into(), v.into())],
        };
        assert_eq!(
            set("HEARTH_FIRST_TURN_CAP", "9")
                .parse()
                .unwrap()
                .router_params()
                .score
                .first_turn_cap,
            9
        );
        let e = set("HEARTH_FIRST_TURN_KAP", "9").parse().unwrap_err();
        assert!(e.to_string().contains("HEARTH_FIRST_TURN_KAP"), "{e}");
    }
}

//! Plugin configuration: one typed struct, parsed and validated by a pure function.

use hearth_wire::{Endpoint, Params};
use serde::Deserialize;
use std::fmt;

/// The Envoy cluster the outcome role reports to, unless configured.
pub const DEFAULT_OUTCOME_CLUSTER: &str = "hearth_sidecar_admin";

/// The shortest control token (the sidecar's `HEARTH_CONTROL_TOKEN_FILE`
/// refuses shorter ones too).
pub const MIN_CONTROL_TOKEN_CHARS: usize = 32;

/// Default cap on a buffered request body (8 MiB).
pub const DEFAULT_MAX_BODY_BYTES: usize = 8 << 20;
/// Largest accepted `max_body_bytes` (256 MiB).
pub const MAX_MAX_BODY_BYTES: usize = 256 << 20;

/// What one instance of the filter does. The gateway runs two: the
/// fingerprint role before the ext_proc filter, the outcome role after it
/// (so it sees responses first, on their way back).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Role {
    /// Strip client routing headers, fingerprint requests.
    #[default]
    Fingerprint,
    /// Report whether each generation's 200 answer carried text and ended,
    /// to the sidecar (`POST /outcome` through `outcome_cluster`).
    Outcome,
}

/// The validated plugin configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FilterConfig {
    pub role: Role,
    /// Envoy cluster of the sidecar's HTTP endpoint (outcome role).
    pub outcome_cluster: String,
    /// The sidecar's control token (outcome role): sent as
    /// `authorization: Bearer <token>` with each report. None: no header.
    pub control_token: Option<String>,
    /// Exact request paths (query ignored) to fingerprint, with their API.
    pub routes: Vec<(String, Endpoint)>,
    /// Block size and hashed-prefix bound.
    pub params: Params,
    /// Bodies larger than this pass through unhashed.
    pub max_body_bytes: usize,
    /// Outcome role: a streamed answer's verdict goes to the sidecar as a
    /// response trailer on its ext_proc stream instead of a `POST`, and its
    /// first chunk is posted only where the sidecar asks. Needs the
    /// ext_proc filter's `response_trailer_mode: SEND` and the `hearth`
    /// namespace among its `receiving_namespaces`; off, every verdict and
    /// every first chunk is posted.
    pub trailer_reports: bool,
}

impl Default for FilterConfig {
    fn default() -> Self {
        FilterConfig {
            role: Role::Fingerprint,
            outcome_cluster: DEFAULT_OUTCOME_CLUSTER.to_owned(),
            control_token: None,
            routes: Endpoint::ALL
                .iter()
                .map(|e| (e.default_path().to_owned(), *e))
                .collect(),
            params: Params::default(),
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            trailer_reports: false,
        }
    }
}

/// Why the plugin configuration was refused; lists every problem found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError(pub Vec<String>);

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalid hearth filter configuration: {}",
            self.0.join("; ")
        )
    }
}

impl std::error::Error for ConfigError {}

/// The JSON shape: every field optional, unknown fields refused (typos).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    role: Option<String>,
    outcome_cluster: Option<String>,
    control_token: Option<String>,
    paths: Option<Vec<String>>,
    block_size: Option<usize>,
    max_prefix_bytes: Option<usize>,
    max_body_bytes: Option<usize>,
    trailer_reports: Option<bool>,
}

impl FilterConfig {
    /// Parses the plugin configuration. Empty (or whitespace-only)
    /// configuration means all defaults.
    ///
    /// A path's API is inferred from its suffix: `.../chat/completions`,
    /// `.../completions` or `.../responses`.
    pub fn parse(bytes: &[u8]) -> Result<FilterConfig, ConfigError> {
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(FilterConfig::default());
        }
        let raw: RawConfig =
            serde_json::from_slice(bytes).map_err(|e| ConfigError(vec![e.to_string()]))?;
        let mut errors = Vec::new();
        let mut cfg = FilterConfig::default();
        if let Some(paths) = raw.paths {
            cfg.routes.clear();
            if paths.is_empty() {
                errors.push("paths must not be empty".to_owned());
            }
            for p in paths {
                match endpoint_for_suffix(&p) {
                    Some(e) if p.starts_with('/') && !p.contains(['?', '#']) => {
                        cfg.routes.push((p, e))
                    }
                    _ => errors.push(format!(
                        "path {p:?} must start with '/', have no query, and end in \
                         /chat/completions, /completions or /responses"
                    )),
                }
            }
        }
        match raw.role.as_deref() {
            None | Some("fingerprint") => {}
            Some("outcome") => cfg.role = Role::Outcome,
            Some(other) => errors.push(format!(
                "role {other:?} is not \"fingerprint\" or \"outcome\""
            )),
        }
        if let Some(c) = raw.outcome_cluster {
            if c.is_empty() {
                errors.push("outcome_cluster must not be empty".to_owned());
            }
            cfg.outcome_cluster = c;
        }
        if let Some(t) = raw.control_token {
            // Checked as the sidecar checks its file, without echoing it:
            // it goes into a header as is.
            let safe = t
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-._~+/=".contains(&b));
            if t.len() < MIN_CONTROL_TOKEN_CHARS || !safe {
                errors.push(format!(
                    "control_token must be at least {MIN_CONTROL_TOKEN_CHARS} characters of \
                     letters, digits and -._~+/="
                ));
            }
            cfg.control_token = Some(t);
        }
        if let Some(b) = raw.block_size {
            cfg.params.block_size = b;
        }
        if let Some(m) = raw.max_prefix_bytes {
            cfg.params.max_prefix_bytes = m;
        }
        if let Err(e) = cfg.params.validate() {
            errors.push(e);
        }
        if let Some(m) = raw.max_body_bytes {
            if m == 0 || m > MAX_MAX_BODY_BYTES {
                errors.push(format!(
                    "max_body_bytes must be in 1..={MAX_MAX_BODY_BYTES}, got {m}"
                ));
            }
            cfg.max_body_bytes = m;
        }
        if let Some(t) = raw.trailer_reports {
            if cfg.role != Role::Outcome {
                errors.push("trailer_reports is a setting of the outcome role".to_owned());
            }
            cfg.trailer_reports = t;
        }
        if errors.is_empty() {
            Ok(cfg)
        } else {
            Err(ConfigError(errors))
        }
    }

    /// The API served at `path` (query and fragment ignored), if configured.
    pub fn endpoint_for(&self, path: &str) -> Option<Endpoint> {
        let path = hearth_wire::strip_query(path);
        self.routes.iter().find(|(p, _)| p == path).map(|(_, e)| *e)
    }
}

fn endpoint_for_suffix(path: &str) -> Option<Endpoint> {
    if path.ends_with("/chat/completions") {
        Some(Endpoint::ChatCompletions)
    } else if path.ends_with("/completions") {
        Some(Endpoint::Completions)
    } else if path.ends_with("/responses") {
        Some(Endpoint::Responses)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_means_defaults() {
        assert_eq!(FilterConfig::parse(b""), Ok(FilterConfig::default()));
        assert_eq!(FilterConfig::parse(b" \n"), Ok(FilterConfig::default()));
        assert_eq!(FilterConfig::parse(b"{}"), Ok(FilterConfig::default()));
        let d = FilterConfig::default();
        assert_eq!(
            d.endpoint_for("/v1/chat/completions?x=1"),
            Some(Endpoint::ChatCompletions)
        );
        assert_eq!(
            d.endpoint_for("/v1/completions"),
            Some(Endpoint::Completions)
        );
        assert_eq!(d.endpoint_for("/v1/responses"), Some(Endpoint::Responses));
        assert_eq!(d.endpoint_for("/v1/models"), None);
        assert_eq!(d.endpoint_for("/v1/chat/completions/"), None);
    }

    #[test]
    fn full_config() {
        let c = FilterConfig::parse(
            br#"{"paths":["/openai/v1/chat/completions","/v2/responses"],"block_size":1024,
                "max_prefix_bytes":65536,"max_body_bytes":1000000}"#,
        )
        .unwrap();
        assert_eq!(
            c.endpoint_for("/openai/v1/chat/completions"),
            Some(Endpoint::ChatCompletions)
        );
        assert_eq!(c.endpoint_for("/v2/responses"), Some(Endpoint::Responses));
        assert_eq!(c.endpoint_for("/v1/chat/completions"), None);
        assert_eq!(c.params.block_size, 1024);
        assert_eq!(c.params.max_prefix_bytes, 65536);
        assert_eq!(c.max_body_bytes, 1_000_000);
    }

    #[test]
    fn bad_configs_list_every_problem() {
        for bad in [
            &b"not json"[..],
            br#"[]"#,
            br#"{"paths":"x"}"#,
            br#"{"block_sise":64}"#,
            br#"{"paths":[]}"#,
            br#"{"paths":["/v1/models"]}"#,
            br#"{"paths":["v1/completions"]}"#,
            br#"{"block_size":10}"#,
            br#"{"block_size":4096,"max_prefix_bytes":1024}"#,
            br#"{"block_size":64,"max_prefix_bytes":1073741824}"#,
            br#"{"max_body_bytes":0}"#,
            br#"{"block_size":-1}"#,
        ] {
            assert!(
                FilterConfig::parse(bad).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        let e = FilterConfig::parse(br#"{"paths":["/x"],"block_size":1}"#).unwrap_err();
        assert_eq!(e.0.len(), 2, "{e}");
    }

    #[test]
    fn the_control_token_is_optional_and_checked_without_being_echoed() {
        let none = FilterConfig::parse(br#"{"role":"outcome"}"#).unwrap();
        assert_eq!(none.control_token, None);
        let token = "a".repeat(32) + "-._~+/=";
        let with = FilterConfig::parse(
            format!(r#"{{"role":"outcome","control_token":"{token}"}}"#).as_bytes(),
        )
        .unwrap();
        assert_eq!(with.control_token.as_deref(), Some(token.as_str()));
        for bad in [
            "short-secret",
            "",
            &("b".repeat(40) + "\"x"),
            &("c".repeat(40) + " "),
        ] {
            let json = serde_json::json!({ "role": "outcome", "control_token": bad });
            let err = FilterConfig::parse(json.to_string().as_bytes()).unwrap_err();
            let text = err.to_string();
            assert!(text.contains("control_token"), "{text}");
            if !bad.is_empty() {
                assert!(!text.contains(bad), "the token is echoed: {text}");
            }
        }
    }

    #[test]
    fn role_defaults_to_fingerprint_and_rejects_unknown_roles() {
        assert_eq!(FilterConfig::parse(b"{}").unwrap().role, Role::Fingerprint);
        assert_eq!(
            FilterConfig::parse(br#"{"role":"outcome"}"#).unwrap().role,
            Role::Outcome
        );
        let err = FilterConfig::parse(br#"{"role":"judge"}"#).unwrap_err();
        assert!(err.to_string().contains("judge"));
    }

    #[test]
    fn trailer_reports_are_off_unless_the_outcome_role_asks() {
        let off = FilterConfig::parse(br#"{"role":"outcome"}"#).unwrap();
        assert!(!off.trailer_reports);
        let on = FilterConfig::parse(br#"{"role":"outcome","trailer_reports":true}"#).unwrap();
        assert!(on.trailer_reports);
        let err = FilterConfig::parse(br#"{"trailer_reports":true}"#).unwrap_err();
        assert!(err.to_string().contains("outcome role"), "{err}");
        assert!(FilterConfig::parse(br#"{"role":"outcome","trailer_reports":"yes"}"#).is_err());
    }
}

//! The pieces of Envoy configuration an operator adds to their own Envoy
//! (`envoy/snippets/`), and the values that fill their marked places.
//!
//! The snippet files are the single source of these pieces: the
//! generator builds the shipped gateway from them ([`super::render`]), and
//! the end-to-end tests apply them to another Envoy configuration the way
//! `envoy/snippets/README.md` tells an operator to.

use std::net::SocketAddr;

/// Where a snippet goes in an operator's configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    /// Entries of the connection manager's `http_filters`, just before the
    /// router.
    HttpFilters,
    /// Fields merged into the connection manager's `typed_config`.
    ConnectionManager,
    /// Fields merged into each route whose `route.cluster` is the one the
    /// snippet names.
    Route,
    /// Fields merged into the cluster the snippet names, replacing its
    /// `lb_policy`.
    EnginesCluster,
    /// Entries added to `static_resources.clusters`.
    Clusters,
}

/// One file of `envoy/snippets/`.
#[derive(Clone, Copy, Debug)]
pub struct Snippet {
    /// Its file name under `envoy/snippets/`.
    pub file: &'static str,
    /// Its text, with `${NAME}` placeholders.
    pub text: &'static str,
    pub place: Place,
    /// Left out by an operator who does not want it (the generator and the
    /// tests apply it).
    pub optional: bool,
}

pub const HTTP_FILTERS: Snippet = Snippet {
    file: "http-filters.yaml",
    text: include_str!("../../../../envoy/snippets/http-filters.yaml"),
    place: Place::HttpFilters,
    optional: false,
};

pub const CONNECTION_MANAGER: Snippet = Snippet {
    file: "http-connection-manager.yaml",
    text: include_str!("../../../../envoy/snippets/http-connection-manager.yaml"),
    place: Place::ConnectionManager,
    optional: true,
};

pub const ROUTE: Snippet = Snippet {
    file: "route.yaml",
    text: include_str!("../../../../envoy/snippets/route.yaml"),
    place: Place::Route,
    optional: false,
};

pub const ENGINES_CLUSTER: Snippet = Snippet {
    file: "engines-cluster.yaml",
    text: include_str!("../../../../envoy/snippets/engines-cluster.yaml"),
    place: Place::EnginesCluster,
    optional: false,
};

pub const SIDECAR_CLUSTER: Snippet = Snippet {
    file: "sidecar-cluster.yaml",
    text: include_str!("../../../../envoy/snippets/sidecar-cluster.yaml"),
    place: Place::Clusters,
    optional: false,
};

pub const OUTCOME_CLUSTER: Snippet = Snippet {
    file: "outcome-cluster.yaml",
    text: include_str!("../../../../envoy/snippets/outcome-cluster.yaml"),
    place: Place::Clusters,
    optional: false,
};

/// Every snippet, in the order `envoy/snippets/README.md` lists them.
pub const ALL: [Snippet; 6] = [
    HTTP_FILTERS,
    ROUTE,
    ENGINES_CLUSTER,
    SIDECAR_CLUSTER,
    OUTCOME_CLUSTER,
    CONNECTION_MANAGER,
];

/// The marked places, with what goes there.
pub const PLACEHOLDERS: [(&str, &str); 11] = [
    (
        "ENGINES_CLUSTER",
        "the name of your cluster of engine replicas",
    ),
    ("WASM_FILE", "path of hearth_filter.wasm as Envoy sees it"),
    (
        "BLOCK_SIZE",
        "fingerprint block size in bytes: the sidecar's HEARTH_BLOCK_SIZE",
    ),
    ("MAX_PREFIX_BYTES", "canonical prompt bytes hashed at most"),
    (
        "MAX_BODY_BYTES",
        "largest request body the filter buffers and hashes",
    ),
    (
        "BUFFER_LIMIT_BYTES",
        "the route's request buffer: MAX_BODY_BYTES plus 1 MiB",
    ),
    (
        "SIDECAR_GRPC_ADDRESS",
        "IP of the sidecar's gRPC service (HEARTH_LISTEN)",
    ),
    ("SIDECAR_GRPC_PORT", "its port"),
    (
        "SIDECAR_ADMIN_ADDRESS",
        "IP of the sidecar's HTTP endpoint (HEARTH_ADMIN_LISTEN)",
    ),
    ("SIDECAR_ADMIN_PORT", "its port"),
    (
        "CONTROL_TOKEN",
        "the token in the sidecar's HEARTH_CONTROL_TOKEN_FILE",
    ),
];

/// Placeholders that may be filled with nothing (the sidecar has no
/// control token): a line holding one is then left out, with the comment
/// lines just above it, except a JSON member `,"key":"${NAME}"` inside
/// a line, which alone is removed.
pub const OPTIONAL: [&str; 1] = ["CONTROL_TOKEN"];

/// Values for the placeholders, by name.
pub type Values = Vec<(&'static str, String)>;

/// The sidecar's two addresses as placeholder values.
pub fn sidecar_values(grpc: SocketAddr, admin: SocketAddr) -> Values {
    vec![
        ("SIDECAR_GRPC_ADDRESS", grpc.ip().to_string()),
        ("SIDECAR_GRPC_PORT", grpc.port().to_string()),
        ("SIDECAR_ADMIN_ADDRESS", admin.ip().to_string()),
        ("SIDECAR_ADMIN_PORT", admin.port().to_string()),
    ]
}

impl Snippet {
    /// The text with every `${NAME}` of `values` filled in (names without
    /// a value stay as they are).
    /// An empty value of an [`OPTIONAL`] placeholder leaves out what
    /// needs it.
    pub fn fill(&self, values: &[(&str, String)]) -> String {
        let mut text = self.text.to_string();
        for (name, value) in values {
            let mark = format!("${{{name}}}");
            text = if value.is_empty() && OPTIONAL.contains(name) {
                leave_out(&text, &mark)
            } else {
                text.replace(&mark, value)
            };
        }
        text
    }

    /// The placeholders the text uses, in order of first use.
    pub fn placeholders(&self) -> Vec<&'static str> {
        let mut names = Vec::new();
        let mut rest = self.text;
        while let Some(start) = rest.find("${") {
            rest = &rest[start + 2..];
            let Some(end) = rest.find('}') else { break };
            let name = &rest[..end];
            if !names.contains(&name) {
                names.push(name);
            }
            rest = &rest[end..];
        }
        names
    }

    /// The filled text without its placement note (the comment before the
    /// first empty line, which tells an operator where the snippet goes),
    /// each line indented by `indent` spaces: ready to sit in a generated
    /// bootstrap.
    pub fn body(&self, values: &[(&str, String)], indent: usize) -> String {
        let pad = " ".repeat(indent);
        let filled = self.fill(values);
        let (_, body) = filled
            .split_once("\n\n")
            .expect("a placement note, then an empty line");
        body.lines().map(|l| format!("{pad}{l}\n")).collect()
    }

    /// [`Snippet::body`] of a mapping as one item of a sequence at
    /// `indent`: its first key after `- `, the rest lined up with it.
    pub fn body_as_item(&self, values: &[(&str, String)], indent: usize) -> String {
        let body = self.body(values, indent + 2);
        let at = body
            .lines()
            .position(|l| !l.trim_start().starts_with('#'))
            .unwrap_or(0);
        body.lines()
            .enumerate()
            .map(|(i, l)| {
                if i == at {
                    format!("{}- {}\n", " ".repeat(indent), &l[indent + 2..])
                } else {
                    format!("{l}\n")
                }
            })
            .collect()
    }
}

/// `text` without what needs `mark` (see [`OPTIONAL`]).
fn leave_out(text: &str, mark: &str) -> String {
    let quoted = format!("\"{mark}\"");
    let mut out: Vec<String> = Vec::new();
    for line in text.split_inclusive('\n') {
        if !line.contains(mark) {
            out.push(line.to_string());
            continue;
        }
        // `,"key":"${NAME}"` inside a JSON object.
        if let Some(at) = line.find(&quoted) {
            if let Some(start) = line[..at]
                .rfind(",\"")
                .filter(|&s| line[s..at].ends_with("\":"))
            {
                out.push(format!("{}{}", &line[..start], &line[at + quoted.len()..]));
                continue;
            }
        }
        while out.last().is_some_and(|l| l.trim_start().starts_with('#')) {
            out.pop();
        }
    }
    out.concat()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_token_leaves_out_what_carries_it() {
        let with = HTTP_FILTERS.fill(&[("CONTROL_TOKEN", "t".repeat(32))]);
        assert!(with.contains(&format!("value: \"Bearer {}\"", "t".repeat(32))));
        assert!(with.contains(&format!(",\"control_token\":\"{}\"}}'", "t".repeat(32))));
        let without = HTTP_FILTERS.fill(&[("CONTROL_TOKEN", String::new())]);
        let yaml: Vec<&str> = without
            .lines()
            .filter(|l| !l.trim_start().starts_with('#'))
            .collect();
        assert!(
            !yaml.iter().any(|l| l.contains("${CONTROL_TOKEN}")
                || l.contains("authorization")
                || l.contains("control_token")),
            "{without}"
        );
        assert!(without
            .contains(r#"value: '{"role":"outcome","outcome_cluster":"hearth_sidecar_admin","trailer_reports":true}'"#));
        // Only the lines that needed it are gone.
        assert_eq!(
            with.lines().count(),
            without.lines().count() + 2,
            "{without}"
        );
    }

    #[test]
    fn every_placeholder_is_listed_and_every_listed_one_is_used() {
        let known: Vec<&str> = PLACEHOLDERS.iter().map(|(n, _)| *n).collect();
        let mut used = Vec::new();
        for s in ALL {
            for name in s.placeholders() {
                assert!(known.contains(&name), "{}: unknown ${{{name}}}", s.file);
                used.push(name);
            }
        }
        for name in known {
            assert!(used.contains(&name), "${{{name}}} is used by no snippet");
        }
    }

    #[test]
    fn each_snippet_is_a_placement_note_then_yaml_without_empty_lines() {
        for s in ALL {
            let (note, body) = s.text.split_once("\n\n").unwrap();
            assert!(note.lines().all(|l| l.starts_with('#')), "{}", s.file);
            assert!(
                note.contains("Where:"),
                "{}: the note says where it goes",
                s.file
            );
            // An empty line would end a filter entry for render_body.
            assert!(!body.contains("\n\n"), "{}", s.file);
        }
    }

    #[test]
    fn fill_replaces_only_named_placeholders() {
        let values = vec![("ENGINES_CLUSTER", "llm_pool".to_string())];
        let route = ROUTE.fill(&values);
        assert!(route.contains("cluster: llm_pool\n"));
        assert!(route.contains("${BUFFER_LIMIT_BYTES}"));
        assert_eq!(
            ROUTE.placeholders(),
            ["BUFFER_LIMIT_BYTES", "ENGINES_CLUSTER"]
        );
    }

    #[test]
    fn bodies_drop_the_placement_comment_and_indent() {
        let body = SIDECAR_CLUSTER.body(
            &sidecar_values(
                "10.0.0.1:50051".parse().unwrap(),
                "10.0.0.1:9190".parse().unwrap(),
            ),
            2,
        );
        assert!(body.starts_with("  - name: hearth_sidecar\n"), "{body}");
        assert!(body.contains("address: \"10.0.0.1\", port_value: 50051"));
        let item = ENGINES_CLUSTER.body_as_item(&[("ENGINES_CLUSTER", "pool".into())], 2);
        assert!(
            item.starts_with("  - name: pool\n    load_balancing_policy:\n"),
            "{item}"
        );
    }
}

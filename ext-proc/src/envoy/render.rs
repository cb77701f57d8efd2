//! The standalone gateway's Envoy bootstrap, rendered from settings.
//!
//! One template serves the shipped `envoy/gateway.yaml` (rendered with the
//! defaults), the demo, and the end-to-end tests (rendered with ephemeral
//! ports), so what is tested is what ships.

use std::net::SocketAddr;
use std::path::PathBuf;

use hearth_wire::header;

pub use crate::config::{Endpoints, EnvoyConfigArgs, Mode, DEFAULT_WASM};
use crate::config::{Secret, Settings};

pub mod snippets;

/// The Envoy cluster of the engines: the one override_host picks in, and
/// the resource the sidecar serves over endpoint discovery.
pub const ENGINES_CLUSTER: &str = "engines";

impl EnvoyConfigArgs {
    /// The bootstrap for these flags in their mode.
    pub fn render(&self, settings: &Settings) -> String {
        let g = self.gateway(settings);
        match self.mode {
            Mode::Filter => render(&g),
            Mode::Body => render_body(&g),
            Mode::Gie => render_gie(&g),
        }
    }

    /// What keeps these flags and settings from rendering: engines of one
    /// cluster that mix TLS and plain HTTP.
    pub fn check(&self, settings: &Settings) -> Result<(), String> {
        let tls = settings.upstreams.iter().filter(|u| u.tls).count();
        if tls > 0 && tls < settings.upstreams.len() {
            return Err(format!(
                "{tls} of the {} upstreams are https:// and the others plain: Envoy's \
                 engines cluster has one transport socket, so its engines must all speak \
                 TLS or none (or write the cluster with transport_socket_matches by hand)",
                settings.upstreams.len()
            ));
        }
        Ok(())
    }

    pub fn gateway(&self, settings: &Settings) -> Gateway {
        let all_tls = !settings.upstreams.is_empty() && settings.upstreams.iter().all(|u| u.tls);
        Gateway {
            listen: self.gateway_listen,
            admin: self.envoy_admin,
            sidecar: settings.listen,
            sidecar_admin: settings.admin_listen,
            more_sidecars: self.more_sidecars.clone(),
            upstreams: settings.upstreams.iter().map(|u| u.addr).collect(),
            wasm: self.wasm.clone(),
            block_size: settings.block_size,
            max_prefix_bytes: self.max_prefix_bytes,
            max_body_bytes: self.max_body_bytes,
            eds: self.endpoints.unwrap_or(
                if settings.upstreams_file.is_some() || settings.discovery.is_some() {
                    Endpoints::Eds
                } else {
                    Endpoints::Static
                },
            ) == Endpoints::Eds,
            engines_tls: all_tls.then(|| {
                settings
                    .engine_ca_file
                    .clone()
                    .unwrap_or_else(|| SYSTEM_CA_FILE.into())
            }),
            // A bad file was reported when the settings were validated.
            control_token: settings.control_token().ok().flatten(),
            fairness_header: settings.flow_fairness_header.clone(),
        }
    }
}

/// The CA bundle Envoy checks TLS engines against when
/// `HEARTH_ENGINE_CA_FILE` is unset (Debian's and Envoy's images' path).
pub const SYSTEM_CA_FILE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// Everything the bootstrap depends on.
#[derive(Clone, Debug)]
pub struct Gateway {
    pub listen: SocketAddr,
    pub admin: SocketAddr,
    pub sidecar: SocketAddr,
    /// The sidecar's HTTP endpoint (outcome reports).
    pub sidecar_admin: SocketAddr,
    /// The fleet's other sidecars (gRPC, HTTP), listed after the first in
    /// the same two clusters: Envoy spreads streams and reports over all
    /// of them, and any may decide any request (they share what they
    /// learn over `HEARTH_PEERS_URL`).
    pub more_sidecars: Vec<(SocketAddr, SocketAddr)>,
    pub upstreams: Vec<SocketAddr>,
    pub wasm: PathBuf,
    pub block_size: usize,
    pub max_prefix_bytes: usize,
    pub max_body_bytes: usize,
    /// The engines cluster learns its endpoints from the sidecar over EDS
    /// (the sidecar's replica list, pushed on every change) instead of a
    /// `load_assignment` of `upstreams`, and the bootstrap names its node
    /// (xDS requires it). The GIE template has no endpoint list and
    /// ignores it.
    pub eds: bool,
    /// The engines speak TLS (written `https://` in the replica list):
    /// the engines cluster gets a TLS transport socket that checks their
    /// certificates against this CA file. `None`: plain HTTP.
    pub engines_tls: Option<PathBuf>,
    /// The sidecar's control token: Envoy sends it on its gRPC calls to
    /// the sidecar and the outcome filter on its reports. None: nothing
    /// is sent (a sidecar without `HEARTH_CONTROL_TOKEN_FILE`).
    pub control_token: Option<Secret>,
    /// `HEARTH_FLOW_FAIRNESS_HEADER`: forwarded to the sidecar too.
    pub fairness_header: Option<String>,
}

/// The longest a queued request's ext_proc answer may take
/// (`max_message_timeout` in every rendered configuration): the sidecar
/// extends a queued request's deadline to its time to live plus a margin,
/// within this.
pub const MAX_MESSAGE_TIMEOUT_SECONDS: u64 = 600;

impl Gateway {
    /// A gateway on loopback with an ephemeral admin port and the default
    /// block size, prefix bound and body limit (the demo, the soak and the
    /// end-to-end tests).
    pub fn local(
        listen: SocketAddr,
        sidecar: SocketAddr,
        sidecar_admin: SocketAddr,
        upstreams: Vec<SocketAddr>,
        wasm: PathBuf,
    ) -> Gateway {
        Gateway {
            listen,
            admin: SocketAddr::from(([127, 0, 0, 1], 0)),
            sidecar,
            sidecar_admin,
            more_sidecars: Vec::new(),
            upstreams,
            wasm,
            block_size: hearth_wire::DEFAULT_BLOCK_SIZE,
            max_prefix_bytes: hearth_wire::DEFAULT_MAX_PREFIX_BYTES,
            max_body_bytes: 8 << 20,
            eds: false,
            engines_tls: None,
            control_token: None,
            fairness_header: None,
        }
    }
}

impl Gateway {
    /// The request buffer: Envoy buffers a whole body (for the wasm
    /// filter, or for ext_proc in the body modes), so it must hold the
    /// largest body hashed plus the read that carries a body past it. The
    /// route's `request_body_buffer_limit` (envoy/snippets/route.yaml); the
    /// listener and the engines cluster take the same value as connection
    /// buffers.
    fn buffer_limit(&self) -> usize {
        self.max_body_bytes + (1 << 20)
    }

    /// The values of the snippets' marked places for this gateway.
    pub fn snippet_values(&self) -> snippets::Values {
        let mut values = vec![
            ("ENGINES_CLUSTER", ENGINES_CLUSTER.to_string()),
            ("WASM_FILE", self.wasm.display().to_string()),
            ("BLOCK_SIZE", self.block_size.to_string()),
            ("MAX_PREFIX_BYTES", self.max_prefix_bytes.to_string()),
            ("MAX_BODY_BYTES", self.max_body_bytes.to_string()),
            ("BUFFER_LIMIT_BYTES", self.buffer_limit().to_string()),
            (
                "CONTROL_TOKEN",
                self.control_token
                    .as_ref()
                    .map(|t| t.expose().to_string())
                    .unwrap_or_default(),
            ),
        ];
        values.extend(snippets::sidecar_values(self.sidecar, self.sidecar_admin));
        values
    }
}

/// The bootstrap from its top to the connection manager's timeouts, which
/// every rendering shares (`node`: the node section, when xDS needs
/// one).
fn listener_head(g: &Gateway, node: &str) -> String {
    format!(
        r#"admin:
  address: {admin}
{node}static_resources:
  listeners:
  - name: hearth_gateway
    address: {listen}
    per_connection_buffer_limit_bytes: {buffer}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: hearth
          # Agent turns stream for minutes: no overall request deadline,
          # only an idle one.
          request_timeout: 0s
          stream_idle_timeout: 600s
"#,
        admin = socket(&g.admin),
        listen = socket(&g.listen),
        buffer = g.buffer_limit(),
    )
}

/// The engines cluster's transport socket, when the engines speak TLS:
/// one per cluster, so all its engines do, or none. Envoy checks each
/// engine's certificate chain against the CA file; it does not match the
/// certificate's names against the engine's IP (override_host picks the
/// host per request), so the CA should sign only the engines.
fn engines_tls(g: &Gateway) -> String {
    let Some(ca) = &g.engines_tls else {
        return String::new();
    };
    format!(
        r#"    # The engines speak TLS (https:// in the sidecar's replica list).
    transport_socket:
      name: envoy.transport_sockets.tls
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
        common_tls_context:
          validation_context:
            trusted_ca: {{ filename: "{ca}" }}
"#,
        ca = ca.display()
    )
}

/// The engines cluster's `load_assignment`: the upstreams, in order.
fn static_endpoints(g: &Gateway) -> String {
    let endpoints: String = g
        .upstreams
        .iter()
        .map(|u| format!("        - endpoint: {{ address: {} }}\n", socket(u)))
        .collect();
    format!(
        "    load_assignment:\n      cluster_name: {ENGINES_CLUSTER}\n      endpoints:\n      - lb_endpoints:\n{endpoints}"
    )
}

/// Seconds an engine connection may stay idle in Envoy's pool: the
/// `idle_timeout` of the engines cluster in every rendering (and in
/// `envoy/snippets/engines-cluster.yaml`). Envoy closes the connection
/// before the engine's own keep-alive (5 s in vLLM, SGLang and llama.cpp)
/// can close it just as a request goes out on it, which fails that request
/// with a 503 no retry may safely repeat.
pub const ENGINE_IDLE_SECONDS: u64 = 3;

/// The engines cluster's connection pool in the renderings that do not
/// take `envoy/snippets/engines-cluster.yaml` (the plain baseline, the
/// endpoint-picker shape), as that snippet sets it.
fn engine_connections() -> String {
    format!(
        r#"    # Closed by Envoy after {ENGINE_IDLE_SECONDS} s idle, before the engine's keep-alive (5 s in
    # vLLM, SGLang and llama.cpp) can close one under a request going out.
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        common_http_protocol_options: {{ idle_timeout: {ENGINE_IDLE_SECONDS}s }}
        explicit_http_config: {{ http_protocol_options: {{}} }}
"#
    )
}

/// Envoy alone in front of the upstreams: the same listener, buffer limits
/// and timeouts as the gateway, no Hearth, `least_request`. The floor that
/// `hearth-bench overhead` measures the gateway against.
pub fn render_plain(g: &Gateway) -> String {
    format!(
        r#"# Plain Envoy (no Hearth), for comparison.
{head}          route_config:
            name: engines
            virtual_hosts:
            - name: engines
              domains: ["*"]
              routes:
              - match: {{ prefix: "/" }}
                route: {{ cluster: engines, timeout: 0s, idle_timeout: 600s }}
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: engines
    connect_timeout: 2s
    per_connection_buffer_limit_bytes: {buffer}
    lb_policy: LEAST_REQUEST
{connections}{tls}{endpoints}"#,
        head = listener_head(g, ""),
        buffer = g.buffer_limit(),
        connections = engine_connections(),
        tls = engines_tls(g),
        endpoints = static_endpoints(g),
    )
}

/// The cluster of the sidecar's gRPC service (ext_proc, and endpoint
/// discovery in EDS mode).
fn sidecar_cluster(g: &Gateway) -> String {
    every_sidecar(g, &snippets::SIDECAR_CLUSTER, |(grpc, _)| grpc)
}

/// The cluster of the sidecar's HTTP endpoint (the outcome filter's
/// reports).
fn outcome_cluster(g: &Gateway) -> String {
    every_sidecar(g, &snippets::OUTCOME_CLUSTER, |(_, http)| http)
}

/// `cluster` filled in for the sidecar, with an endpoint after its own for
/// each of [`Gateway::more_sidecars`]; `pick` takes the address this
/// cluster dials from a sidecar's (gRPC, HTTP) pair.
fn every_sidecar(
    g: &Gateway,
    cluster: &snippets::Snippet,
    pick: fn((SocketAddr, SocketAddr)) -> SocketAddr,
) -> String {
    let body = cluster.body(&g.snippet_values(), 2);
    if g.more_sidecars.is_empty() {
        return body;
    }
    let first = socket(&pick((g.sidecar, g.sidecar_admin)));
    let mut out = String::with_capacity(body.len() + 100 * g.more_sidecars.len());
    for line in body.split_inclusive('\n') {
        out.push_str(line);
        if line.contains("- endpoint:") && line.contains(&first) {
            for &pair in &g.more_sidecars {
                out.push_str(&line.replace(&first, &socket(&pick(pair))));
            }
        }
    }
    out
}

fn socket(addr: &SocketAddr) -> String {
    format!(
        "{{ socket_address: {{ address: \"{}\", port_value: {} }} }}",
        addr.ip(),
        addr.port()
    )
}

/// Renders the standalone gateway: the plain gateway ([`render_plain`])
/// with the pieces of `envoy/snippets/` applied, each where its own
/// comment says an operator puts it (the end-to-end tests check that the
/// result is exactly that).
pub fn render(g: &Gateway) -> String {
    let (node, engines_endpoints) = if g.eds {
        (EDS_NODE.to_string(), eds_endpoints(g))
    } else {
        (String::new(), static_endpoints(g))
    };
    let v = g.snippet_values();
    let yaml = format!(
        r#"# Hearth standalone gateway: filter-wasm fingerprints the prompt, the
# ext_proc sidecar picks the replica, override_host routes to it (falling
# back to least_request when no decision was made).
# Generated by `hearth-ext-proc envoy-config`: the plain gateway with the
# pieces of envoy/snippets/ applied; edit those or the generator, not this.
{head}{connection_manager}          route_config:
            name: engines
            virtual_hosts:
            - name: engines
              domains: ["*"]
              routes:
              - match: {{ prefix: "/" }}
{route}          http_filters:
{filters}          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
{engines}    connect_timeout: 2s
    per_connection_buffer_limit_bytes: {buffer}
{tls}{engines_endpoints}{sidecar}{outcome}"#,
        head = listener_head(g, &node),
        connection_manager = snippets::CONNECTION_MANAGER.body(&v, 10),
        route = snippets::ROUTE.body(&v, 16),
        filters = snippets::HTTP_FILTERS.body(&v, 10),
        engines = snippets::ENGINES_CLUSTER.body_as_item(&v, 2),
        buffer = g.buffer_limit(),
        tls = engines_tls(g),
        sidecar = sidecar_cluster(g),
        outcome = outcome_cluster(g),
    );
    with_fairness_header(yaml, g)
}

/// `yaml` with the operator's fairness header forwarded to the sidecar
/// next to the Inference Extension's own (when one is set).
fn with_fairness_header(yaml: String, g: &Gateway) -> String {
    let Some(h) = &g.fairness_header else {
        return yaml;
    };
    let mut out = String::with_capacity(yaml.len() + 64);
    for line in yaml.lines() {
        out.push_str(line);
        out.push('\n');
        if line.trim_start() == "- exact: \"x-gateway-inference-objective\"" {
            let indent = &line[..line.len() - line.trim_start().len()];
            out.push_str(&format!("{indent}- exact: \"{h}\"\n"));
        }
    }
    out
}

/// The bootstrap's node: xDS needs Envoy to name itself.
const EDS_NODE: &str = "\
# The engines' endpoints come over xDS, which needs Envoy to name itself
# (the sidecar answers every node alike).
node:
  id: hearth-gateway
  cluster: hearth
";

/// The engines cluster's endpoints in EDS mode, in place of a
/// `load_assignment`.
fn eds_endpoints(g: &Gateway) -> String {
    let token = control_metadata(g, "            ");
    format!(
        r#"    # The sidecar is the source of truth of the replica list: it streams
    # the endpoints over EDS and pushes every change. If the sidecar goes
    # away, Envoy keeps the last endpoints it received (and reconnects). At
    # start-up Envoy waits for the sidecar's first answer before it serves,
    # up to initial_fetch_timeout; past it, the cluster has no endpoints
    # until the sidecar answers.
    type: EDS
    eds_cluster_config:
      service_name: {ENGINES_CLUSTER}
      eds_config:
        resource_api_version: V3
        initial_fetch_timeout: 15s
        api_config_source:
          api_type: GRPC
          transport_api_version: V3
          grpc_services:
          - envoy_grpc: {{ cluster_name: hearth_sidecar }}
{token}          set_node_on_first_message_only: true
"#
    )
}

/// A `grpc_service`'s `initial_metadata` with the control token, at
/// `indent` (nothing without a token).
fn control_metadata(g: &Gateway, indent: &str) -> String {
    match &g.control_token {
        Some(t) => format!(
            "{indent}# The sidecar's HEARTH_CONTROL_TOKEN_FILE: it refuses calls without it.\n\
             {indent}initial_metadata: [{{ key: authorization, value: \"Bearer {}\" }}]\n",
            t.expose()
        ),
        None => String::new(),
    }
}

/// The headers ext_proc forwards to the sidecar: what routing reads
/// (the allow-list of `envoy/snippets/http-filters.yaml`), at `indent`.
fn forward_rules(indent: &str) -> String {
    let snippet = snippets::HTTP_FILTERS.text;
    let start = snippet
        .find("    # Only what routing reads")
        .expect("the snippet's forward_rules");
    // Its comment, the key, and the lines indented under it.
    let mut key_seen = false;
    snippet[start..]
        .lines()
        .take_while(|l| {
            let inside = !key_seen || l.starts_with("     ");
            key_seen |= l.starts_with("    forward_rules:");
            inside
        })
        .map(|l| format!("{indent}{}\n", &l[4..]))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_every_upstream_and_the_filter_config() {
        let g = Gateway {
            listen: "127.0.0.1:10000".parse().unwrap(),
            admin: "127.0.0.1:9901".parse().unwrap(),
            sidecar: "127.0.0.1:50051".parse().unwrap(),
            sidecar_admin: "127.0.0.1:9190".parse().unwrap(),
            more_sidecars: Vec::new(),
            upstreams: vec![
                "127.0.0.1:8001".parse().unwrap(),
                "127.0.0.1:8002".parse().unwrap(),
            ],
            wasm: "/x/hearth_filter.wasm".into(),
            block_size: 2048,
            max_prefix_bytes: 1 << 21,
            max_body_bytes: 1 << 23,
            eds: false,
            engines_tls: None,
            control_token: None,
            fairness_header: None,
        };
        let yaml = render(&g);
        assert!(yaml.contains("port_value: 8001") && yaml.contains("port_value: 8002"));
        assert!(yaml.contains(r#""block_size":2048"#));
        assert!(yaml.contains("filename: \"/x/hearth_filter.wasm\""));
        assert!(!yaml.contains('\t'));
    }

    /// The `engines` cluster's entry: from its name to the next cluster.
    fn engines_cluster(yaml: &str) -> &str {
        let start = yaml
            .find(&format!("\n  - name: {ENGINES_CLUSTER}\n"))
            .expect("an engines cluster")
            + 1;
        let len = yaml[start + 1..].find("\n  - name: ").unwrap() + 1;
        &yaml[start..start + len]
    }

    #[test]
    fn eds_mode_streams_the_engines_from_the_sidecar() {
        use clap::Parser;
        // `envoy-config` with the replica list from `source`.
        let parse = |source: &str, extra: &[&str]| {
            let mut args = vec!["hearth-ext-proc", source, "envoy-config"];
            args.extend_from_slice(extra);
            let cli = crate::config::Cli::try_parse_from(args).unwrap();
            let Some(crate::config::Command::EnvoyConfig(args)) = cli.command else {
                panic!("envoy-config did not parse")
            };
            (args, cli.settings)
        };
        let listed = "--upstreams=127.0.0.1:8001";
        let (args, settings) = parse(listed, &[]);
        assert_eq!(args.endpoints, None);
        assert!(!args.gateway(&settings).eds);
        // A replica list from a file can change: EDS unless told otherwise.
        let file = "--upstreams-file=/etc/hearth/upstreams";
        let file_eds = |extra: &[&str]| {
            let (args, settings) = parse(file, extra);
            args.gateway(&settings).eds
        };
        assert!(file_eds(&[]));
        assert!(!file_eds(&["--endpoints=static"]));
        let (args, settings) = parse(listed, &["--endpoints=eds"]);
        let g = args.gateway(&settings);
        assert!(g.eds);

        for yaml in [render(&g), render_body(&g)] {
            let engines = engines_cluster(&yaml);
            assert!(!engines.contains("load_assignment"), "{engines}");
            assert!(!engines.contains("port_value: 8001"), "{engines}");
            assert!(engines.contains("    type: EDS\n"), "{engines}");
            assert!(engines.contains("service_name: engines"));
            assert!(engines.contains("envoy_grpc: { cluster_name: hearth_sidecar }"));
            assert!(engines.contains("transport_api_version: V3"));
            assert!(engines.contains("override_host"));
            assert!(yaml.contains("\nnode:\n  id: hearth-gateway\n  cluster: hearth\n"));
            // The sidecar cluster still has its own static address.
            assert!(yaml.contains("cluster_name: hearth_sidecar\n"));
            assert!(!yaml.contains('\t'));
        }
        assert_eq!(args.render(&settings), render(&g));
        let body = render_body(&g);
        assert!(body.contains("request_body_mode: BUFFERED"));
        assert!(!body.contains("filters.http.wasm"));

        // Static endpoints: no node, the upstream listed in place.
        let static_yaml = render(&Gateway { eds: false, ..g });
        assert!(!static_yaml.contains("node:"));
        let engines = engines_cluster(&static_yaml);
        assert!(engines.contains("load_assignment:\n      cluster_name: engines\n"));
        assert!(engines.contains("port_value: 8001"));
        assert!(!engines.contains("EDS"));
    }
}

/// Renders the body-over-gRPC gateway: the filter-mode bootstrap without
/// the wasm filters, with ext_proc sending each request body (BUFFERED) to
/// the sidecar and a header_mutation filter that drops client-sent
/// `x-hearth-*` and destination headers first (the wasm filter's job in
/// filter mode). Derived from [`render`] so the two never drift apart.
pub fn render_body(g: &Gateway) -> String {
    let filter_mode = render(g);
    let mut out = String::with_capacity(filter_mode.len());
    let mut lines = filter_mode.lines().peekable();
    // Comment lines are held until the item they introduce is known.
    let mut held: Vec<&str> = Vec::new();
    let mut skipping = false;
    while let Some(line) = lines.next() {
        if line.starts_with("# Hearth standalone gateway") {
            out.push_str(BODY_HEADER);
            // Skip the filter-mode header comment.
            while lines.peek().is_some_and(|l| l.starts_with('#')) {
                lines.next();
            }
            continue;
        }
        if line.starts_with("          #") {
            held.push(line);
            continue;
        }
        if line.starts_with("          - name: ") {
            // The wasm filters and their backstop go; body mode drops
            // client-sent routing headers itself, before ext_proc.
            skipping =
                line.contains("hearth.filter_wasm") || line.contains("hearth.drop_client_headers");
            if line.ends_with("envoy.filters.http.ext_proc") {
                out.push_str(&strip_reserved(
                    "          # Body mode has no wasm filter to drop client-sent routing headers:
          # remove them before ext_proc, so a client cannot steer routing.
",
                    &[],
                ));
            }
        } else if !line.starts_with("           ") {
            skipping = false;
        }
        if !skipping {
            for h in held.drain(..) {
                out.push_str(h);
                out.push('\n');
            }
            let line = match line.trim_start() {
                "request_body_mode: NONE" => line.replace("NONE", "BUFFERED"),
                // No outcome filter either: the sidecar scans each
                // answer itself as its chunks pass (passive health).
                "response_body_mode: NONE" => line.replace("NONE", "STREAMED"),
                // The whole body crosses to the sidecar and is hashed there.
                "message_timeout: 0.5s" => line.replace("0.5s", "2s"),
                "# Headers only. Asking for response trailers keeps the gRPC" => line.replace(
                    "Headers only.",
                    "Request bodies BUFFERED, response bodies STREAMED past the sidecar's outcome scan (body mode).",
                ),
                _ => line.to_string(),
            };
            out.push_str(&line);
            out.push('\n');
        }
        held.clear();
    }
    out
}

const BODY_HEADER: &str = "\
# Hearth gateway, body-over-gRPC mode (no wasm filter): ext_proc sends each
# request body to the sidecar, which fingerprints it with the same code the
# filter runs and picks the replica; override_host routes to it (falling
# back to least_request when no decision was made).
# Generated by `hearth-ext-proc envoy-config --mode body`; edit the
# generator, not this.
";

/// The headers the filter sets for the sidecar, and the sidecar's ticket
/// for the outcome filter: never from a client, never to an engine.
pub const HEARTH_HEADERS: [&str; 6] = [
    header::FP,
    header::PROMPT_BYTES,
    header::MODEL,
    header::MAX_TOKENS,
    header::CACHE,
    header::TICKET,
];

/// `["x-hearth-fp", ...]`: [`HEARTH_HEADERS`] as a YAML flow list.
fn hearth_headers() -> String {
    let quoted: Vec<String> = HEARTH_HEADERS.iter().map(|h| format!("\"{h}\"")).collect();
    format!("[{}]", quoted.join(", "))
}

/// Where no wasm filter drops client-sent routing headers, a header_mutation
/// filter removes them before ext_proc: Hearth's own headers, the
/// destination and subset, and `extra` ones. `comment`: the lines that say
/// why, indented as filters are.
fn strip_reserved(comment: &str, extra: &[&str]) -> String {
    let removals: String = HEARTH_HEADERS
        .iter()
        .chain(&[
            hearth_wire::names::DESTINATION,
            hearth_wire::names::SUBSET_KEY,
        ])
        .chain(extra)
        .map(|h| format!("                - remove: {h}\n"))
        .collect();
    format!(
        r#"{comment}          - name: envoy.filters.http.header_mutation
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation
              mutations:
                request_mutations:
{removals}"#
    )
}

#[cfg(test)]
mod body_mode_tests {
    use super::*;

    #[test]
    fn body_mode_has_no_wasm_and_buffers_request_bodies() {
        use clap::Parser;
        let cli = crate::config::Cli::try_parse_from([
            "hearth-ext-proc",
            "--upstreams=127.0.0.1:8001",
            "envoy-config",
            "--mode=body",
        ])
        .unwrap();
        let Some(crate::config::Command::EnvoyConfig(args)) = &cli.command else {
            panic!("envoy-config did not parse")
        };
        assert_eq!(args.mode, Mode::Body);
        let yaml = args.render(&cli.settings);
        assert_eq!(yaml, render_body(&args.gateway(&cli.settings)));
        assert!(!yaml.contains("filters.http.wasm"), "{yaml}");
        assert!(!yaml.contains("envoy.wasm.runtime"));
        assert!(yaml.contains("request_body_mode: BUFFERED"));
        assert!(!yaml.contains("request_body_mode: NONE"));
        assert!(yaml.contains("response_body_mode: STREAMED"));
        assert!(yaml.contains("response_trailer_mode: SEND"));
        assert!(yaml.contains("- remove: x-hearth-fp"));
        assert!(yaml.contains("envoy.filters.http.router"));
        let strip = yaml.find("header_mutation.v3").unwrap();
        assert!(strip < yaml.find("ext_proc.v3.ExternalProcessor").unwrap());
        assert_eq!(yaml.matches("header_mutation.v3").count(), 1, "{yaml}");
    }

    /// The gateway `envoy-config` renders for one upstream at defaults.
    fn default_gateway() -> Gateway {
        use clap::Parser;
        let cli = crate::config::Cli::try_parse_from([
            "hearth-ext-proc",
            "--upstreams=127.0.0.1:8001",
            "envoy-config",
        ])
        .unwrap();
        let Some(crate::config::Command::EnvoyConfig(args)) = &cli.command else {
            panic!("envoy-config did not parse")
        };
        args.gateway(&cli.settings)
    }

    /// The removals of a header_mutation filter, in order.
    fn removals(yaml: &str) -> Vec<&str> {
        yaml.lines()
            .filter_map(|l| l.trim().strip_prefix("- remove: "))
            .collect()
    }

    #[test]
    fn every_shape_forwards_the_flow_control_headers_and_the_operators_fairness_header() {
        use clap::Parser;
        let cli = crate::config::Cli::try_parse_from([
            "hearth-ext-proc",
            "--upstreams=127.0.0.1:8001",
            "--flow-fairness-header=x-api-key-hash",
            "envoy-config",
        ])
        .unwrap();
        let Some(crate::config::Command::EnvoyConfig(args)) = &cli.command else {
            panic!("envoy-config did not parse")
        };
        let g = args.gateway(&cli.settings);
        let plain = Gateway {
            fairness_header: None,
            ..g.clone()
        };
        for (shape, with, without) in [
            ("filter", render(&g), render(&plain)),
            ("body", render_body(&g), render_body(&plain)),
            ("gie", render_gie(&g), render_gie(&plain)),
        ] {
            let gie_headers = [
                hearth_wire::names::FAIRNESS_ID,
                hearth_wire::names::OBJECTIVE,
            ];
            for h in gie_headers.into_iter().chain(["x-api-key-hash"]) {
                assert!(with.contains(&format!("- exact: \"{h}\"")), "{shape}: {h}");
            }
            assert!(!without.contains("x-api-key-hash"), "{shape}");
            let bound = format!("max_message_timeout: {MAX_MESSAGE_TIMEOUT_SECONDS}s");
            assert!(with.contains(&bound), "{shape}");
        }
    }

    #[test]
    fn every_shape_closes_idle_engine_connections_before_the_engines_do() {
        let g = default_gateway();
        let idle =
            format!("common_http_protocol_options: {{ idle_timeout: {ENGINE_IDLE_SECONDS}s }}");
        for (shape, yaml) in [
            ("plain", render_plain(&g)),
            ("filter", render(&g)),
            ("body", render_body(&g)),
            ("gie", render_gie(&g)),
        ] {
            // Once, in the engines cluster (the sidecar's clusters come after it).
            assert_eq!(yaml.matches(&idle).count(), 1, "{shape}");
            let engines = yaml.find("\n  - name: engines\n").unwrap();
            let next = yaml[engines + 1..]
                .find("\n  - name: ")
                .map_or(yaml.len(), |i| engines + 1 + i);
            assert!(yaml[engines..next].contains(&idle), "{shape}");
        }
        // Below the 5 s keep-alive of vLLM's and SGLang's uvicorn and
        // llama.cpp's server.
        const _: () = assert!(ENGINE_IDLE_SECONDS < 5);
    }

    #[test]
    fn filter_mode_backs_the_wasm_filter_up_with_the_same_removals_as_body_mode() {
        let g = default_gateway();
        let filter = render(&g);
        let backstop = filter.find("hearth.drop_client_headers").unwrap();
        // Before the wasm filter, so a failed VM lets nothing through.
        assert!(backstop < filter.find("name: hearth.filter_wasm").unwrap());
        let body = render_body(&g);
        assert!(!body.contains("hearth.drop_client_headers"));
        assert_eq!(removals(&filter), removals(&body));
        assert_eq!(removals(&body), removals(&strip_reserved("", &[])));
    }
}

/// Renders the Gateway API Inference Extension's reference data plane with
/// Hearth as its endpoint picker: no wasm filter; ext_proc streams request
/// and response bodies FULL_DUPLEX_STREAMED (the sidecar holds the request
/// body, fingerprints it, answers the headers with the destination, then
/// streams the body back); an ORIGINAL_DST cluster dials the address in
/// `x-gateway-destination-endpoint`. Such a cluster reaches any address,
/// so a header_mutation filter drops client-sent routing headers before
/// ext_proc, the sidecar names only registry hosts, and a request that
/// reaches the router without a destination gets a 503 instead of being
/// sent to the listener's own address.
pub fn render_gie(g: &Gateway) -> String {
    let buffer = g.buffer_limit();
    let yaml = format!(
        r#"# Hearth as a Gateway API Inference Extension endpoint picker, in the
# extension's reference data-plane shape: ext_proc with FULL_DUPLEX_STREAMED
# request and response bodies (no wasm filter), an ORIGINAL_DST cluster that
# dials the address the sidecar puts in x-gateway-destination-endpoint.
# Generated by `hearth-ext-proc envoy-config --mode gie`; edit the generator,
# not this.
{head}          route_config:
            name: engines
            virtual_hosts:
            - name: engines
              domains: ["*"]
              routes:
              # Only a request the sidecar gave a destination reaches the
              # ORIGINAL_DST cluster (without the header it would dial the
              # listener's own address).
              - match:
                  prefix: "/"
                  headers:
                  - name: x-gateway-destination-endpoint
                    present_match: true
                request_headers_to_remove: {hearth_headers}
                route:
                  cluster: engines
                  timeout: 0s
                  idle_timeout: 600s
              - match: {{ prefix: "/" }}
                direct_response:
                  status: 503
                  body: {{ inline_string: '{{"error":{{"message":"no endpoint was picked","type":"service_unavailable","code":"no_endpoint"}}}}' }}
          http_filters:
{strip_reserved}          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service:
                envoy_grpc: {{ cluster_name: hearth_sidecar }}
                timeout: 10s
{token}              # Fail closed, as the extension's reference does: without a
              # picked endpoint an ORIGINAL_DST cluster has nowhere safe to
              # go (requests get an error while the sidecar is down).
              failure_mode_allow: false
              # The headers are answered once the whole body has arrived.
              message_timeout: 30s
              # Or, for a request that waits in the sidecar's flow-control
              # queue, when it leaves it: the sidecar extends that answer's
              # deadline (override_message_timeout) up to this bound.
              max_message_timeout: 600s
              # FULL_DUPLEX_STREAMED needs the trailer modes at SEND. The
              # stream stays open until the HTTP stream ends, so the sidecar
              # holds the request's load exactly that long.
              processing_mode:
                request_header_mode: SEND
                response_header_mode: SEND
                request_body_mode: FULL_DUPLEX_STREAMED
                response_body_mode: FULL_DUPLEX_STREAMED
                request_trailer_mode: SEND
                response_trailer_mode: SEND
              response_attributes: ["upstream.address", "response.code_details"]
{forward_rules}              metadata_options:
                # The subset hint (a controller may set it) and envoy.lb
                # (a served-endpoint report) reach the sidecar; the
                # destination comes back under envoy.lb.
                forwarding_namespaces:
                  untyped: ["envoy.lb.subset_hint", "envoy.lb"]
                receiving_namespaces:
                  untyped: ["envoy.lb"]
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: engines
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    connect_timeout: 2s
    per_connection_buffer_limit_bytes: {buffer}
    original_dst_lb_config:
      use_http_header: true
      http_header_name: x-gateway-destination-endpoint
{connections}{tls}{sidecar}"#,
        head = listener_head(g, ""),
        hearth_headers = hearth_headers(),
        connections = engine_connections(),
        strip_reserved = strip_reserved(
            "          # No wasm filter here to drop client-sent routing headers: remove
          # them before ext_proc, so a client can neither steer routing nor
          # name an arbitrary host for the ORIGINAL_DST cluster.
",
            &["x-gateway-destination-endpoint-served"],
        ),
        sidecar = sidecar_cluster(g),
        tls = engines_tls(g),
        token = control_metadata(g, "                "),
        forward_rules = forward_rules("              "),
    );
    with_fairness_header(yaml, g)
}

#[cfg(test)]
mod more_sidecar_tests {
    use clap::Parser;

    fn cli(extra: &[&str]) -> Result<crate::config::Cli, clap::Error> {
        let mut args = vec![
            "hearth-ext-proc",
            "--upstreams",
            "127.0.0.1:8001",
            "envoy-config",
        ];
        args.extend_from_slice(extra);
        crate::config::Cli::try_parse_from(args)
    }

    fn config(extra: &[&str], mode: &str) -> String {
        let mut all = extra.to_vec();
        all.extend_from_slice(&["--mode", mode]);
        let cli = cli(&all).unwrap();
        let Some(crate::config::Command::EnvoyConfig(args)) = &cli.command else {
            panic!("envoy-config did not parse")
        };
        args.render(&cli.settings)
    }

    #[test]
    fn tls_engines_get_a_tls_transport_socket_in_every_shape() {
        let tls = ["--upstreams", "https://10.0.0.1:8000,https://10.0.0.2:8000"];
        for mode in ["filter", "body", "gie"] {
            let mut args = vec!["hearth-ext-proc"];
            args.extend_from_slice(&tls);
            args.extend_from_slice(&["--engine-ca-file", "/etc/hearth/engines-ca.pem"]);
            args.extend_from_slice(&["envoy-config", "--mode", mode]);
            let cli = crate::config::Cli::try_parse_from(args).unwrap();
            let Some(crate::config::Command::EnvoyConfig(a)) = &cli.command else {
                panic!("envoy-config did not parse")
            };
            assert_eq!(a.check(&cli.settings), Ok(()));
            let yaml = a.render(&cli.settings);
            let engines = &yaml[yaml.find("- name: engines\n").unwrap()..];
            let engines = &engines[..engines.find("- name: hearth_sidecar").unwrap()];
            assert!(engines.contains("UpstreamTlsContext"), "{mode}: {engines}");
            assert!(
                engines.contains(r#"trusted_ca: { filename: "/etc/hearth/engines-ca.pem" }"#),
                "{mode}"
            );
            // Envoy's endpoints stay ip:port.
            if mode != "gie" {
                assert!(engines.contains("address: \"10.0.0.1\", port_value: 8000"));
            }
            // Only the engines' cluster.
            assert_eq!(yaml.matches("UpstreamTlsContext").count(), 1, "{mode}");
        }
        // Without a CA file, the system's bundle; plain engines, no socket.
        let plain = config(&[], "filter");
        assert!(!plain.contains("transport_socket"));
        let cli = crate::config::Cli::try_parse_from([
            "hearth-ext-proc",
            "--upstreams",
            "https://10.0.0.1:8000",
            "envoy-config",
        ])
        .unwrap();
        let Some(crate::config::Command::EnvoyConfig(a)) = &cli.command else {
            panic!()
        };
        assert!(a.render(&cli.settings).contains(super::SYSTEM_CA_FILE));
        // Mixed engines cannot share the cluster's one transport socket.
        let mixed = crate::config::Cli::try_parse_from([
            "hearth-ext-proc",
            "--upstreams",
            "https://10.0.0.1:8000,10.0.0.2:8000",
            "envoy-config",
        ])
        .unwrap();
        let Some(crate::config::Command::EnvoyConfig(a)) = &mixed.command else {
            panic!()
        };
        assert!(a.check(&mixed.settings).unwrap_err().contains("1 of the 2"));
    }

    /// The endpoints of cluster `name` in `yaml`, in order.
    fn endpoints(yaml: &str, name: &str) -> Vec<String> {
        let start = yaml
            .find(&format!("- name: {name}\n"))
            .unwrap_or_else(|| panic!("no cluster {name}"));
        let rest = &yaml[start + 1..];
        let end = rest.find("\n  - name: ").unwrap_or(rest.len());
        rest[..end]
            .lines()
            .filter(|l| l.contains("- endpoint:"))
            .map(|l| l.trim().to_string())
            .collect()
    }

    #[test]
    fn every_sidecar_is_an_endpoint_of_both_sidecar_clusters() {
        let extra = [
            "--also-sidecar",
            "10.0.0.7:50051,10.0.0.7:9190",
            "--also-sidecar",
            "10.0.0.8:50051, 10.0.0.8:9191",
        ];
        for mode in ["filter", "body", "gie"] {
            let yaml = config(&extra, mode);
            let grpc = endpoints(&yaml, "hearth_sidecar");
            assert_eq!(grpc.len(), 3, "{mode}: {grpc:?}");
            assert!(
                grpc[0].contains("\"127.0.0.1\", port_value: 50051 "),
                "{grpc:?}"
            );
            assert!(
                grpc[1].contains("\"10.0.0.7\", port_value: 50051 "),
                "{grpc:?}"
            );
            assert!(
                grpc[2].contains("\"10.0.0.8\", port_value: 50051 "),
                "{grpc:?}"
            );
            if mode == "filter" {
                let http = endpoints(&yaml, "hearth_sidecar_admin");
                assert_eq!(http.len(), 3, "{http:?}");
                assert!(
                    http[2].contains("\"10.0.0.8\", port_value: 9191 "),
                    "{http:?}"
                );
            }
        }
        // Without the flag, one sidecar, as before.
        assert_eq!(endpoints(&config(&[], "filter"), "hearth_sidecar").len(), 1);
    }

    #[test]
    fn a_bad_sidecar_pair_is_refused_with_its_reason() {
        for bad in [
            "10.0.0.7:50051",
            "10.0.0.7:50051,nowhere",
            "x,10.0.0.7:9190",
        ] {
            let err = cli(&["--also-sidecar", bad]).unwrap_err().to_string();
            assert!(err.contains("--also-sidecar"), "{bad}: {err}");
        }
    }
}

#[cfg(test)]
mod gie_mode_tests {
    use super::*;

    #[test]
    fn gie_mode_streams_bodies_full_duplex_to_an_original_dst_cluster() {
        use clap::Parser;
        let cli = crate::config::Cli::try_parse_from([
            "hearth-ext-proc",
            "--upstreams=127.0.0.1:8001",
            "envoy-config",
            "--mode=gie",
        ])
        .unwrap();
        let Some(crate::config::Command::EnvoyConfig(args)) = &cli.command else {
            panic!("envoy-config did not parse")
        };
        assert_eq!(args.mode, Mode::Gie);
        let yaml = args.render(&cli.settings);
        assert!(!yaml.contains("filters.http.wasm"));
        assert!(yaml.contains("request_body_mode: FULL_DUPLEX_STREAMED"));
        assert!(yaml.contains("response_body_mode: FULL_DUPLEX_STREAMED"));
        assert!(yaml.contains("request_trailer_mode: SEND"));
        assert!(yaml.contains("type: ORIGINAL_DST"));
        assert!(yaml.contains("http_header_name: x-gateway-destination-endpoint"));
        assert!(yaml.contains("failure_mode_allow: false"));
        // Client-sent destinations are gone before ext_proc runs.
        let strip = yaml
            .find("- remove: x-gateway-destination-endpoint")
            .unwrap();
        assert!(strip < yaml.find("ext_proc.v3.ExternalProcessor").unwrap());
        assert!(!yaml.contains('\t'));
    }
}

#[cfg(test)]
mod control_token_tests {
    use clap::Parser;

    /// `envoy-config` in `mode` with EDS endpoints, with the token in a
    /// file given after the subcommand when `token` is set.
    fn config(mode: &str, token: Option<&str>) -> String {
        let path = std::env::temp_dir().join(format!(
            "hearth-render-token-{}-{mode}-{}",
            std::process::id(),
            token.is_some()
        ));
        let mut args = vec![
            "hearth-ext-proc".to_string(),
            "--upstreams=127.0.0.1:8001".into(),
            "envoy-config".into(),
            format!("--mode={mode}"),
            "--endpoints=eds".into(),
        ];
        if let Some(t) = token {
            std::fs::write(&path, t).unwrap();
            args.push(format!("--control-token-file={}", path.display()));
        }
        let cli = crate::config::Cli::try_parse_from(args).unwrap();
        let Some(crate::config::Command::EnvoyConfig(a)) = &cli.command else {
            panic!("envoy-config did not parse")
        };
        let yaml = a.render(&cli.settings);
        let _ = std::fs::remove_file(path);
        yaml
    }

    #[test]
    fn every_call_to_the_sidecar_carries_the_token_and_only_routing_headers_go() {
        let token = "0123456789abcdef0123456789abcdef-token";
        let bearer =
            format!("initial_metadata: [{{ key: authorization, value: \"Bearer {token}\" }}]");
        for mode in ["filter", "body", "gie"] {
            let yaml = config(mode, Some(token));
            // ext_proc, and endpoint discovery where it is used.
            let want = if mode == "gie" { 1 } else { 2 };
            assert_eq!(yaml.matches(&bearer).count(), want, "{mode}: {yaml}");
            assert!(yaml.contains("forward_rules:"), "{mode}");
            assert!(yaml.contains("- prefix: \"x-hearth-\""), "{mode}");
            assert!(!yaml.contains("exact: \"authorization\""), "{mode}");
            let outcome = format!(r#""control_token":"{token}"}}'"#);
            assert_eq!(yaml.contains(&outcome), mode == "filter", "{mode}");
        }
        // Without a token, nothing of it, and the same forward rules.
        for mode in ["filter", "body", "gie"] {
            let yaml = config(mode, None);
            let settings = yaml.lines().filter(|l| !l.trim_start().starts_with('#'));
            for line in settings {
                assert!(
                    !line.contains("initial_metadata") && !line.contains("control_token"),
                    "{mode}: {line}"
                );
            }
            assert!(yaml.contains("forward_rules:"), "{mode}");
        }
    }
}

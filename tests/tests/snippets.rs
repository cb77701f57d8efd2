//! Hearth added to an operator's own Envoy with `envoy/snippets/` alone:
//! a gateway with its own listener, route and cluster names, a filter of
//! its own and routes that are not for the engines. With the snippets
//! merged in as their README says, it passes `envoy --mode validate`,
//! keeps its own behaviour, and routes conversations to their warm
//! replicas, with retries and outcome reports working.

use std::time::{Duration, Instant};

use hearth_bench::engine::Fault;
use hearth_bench::gateway::{find_wasm, Envoy};
use hearth_e2e::snippets::{apply_all, clusters, connection_managers};
use hearth_e2e::{
    filler, reply_text, validate_config, Conversation, Fleet, FleetOptions, Home, Turn, MODEL,
};
use hearth_ext_proc::envoy::render::snippets::Values;
use hearth_router::health::{Failure, HealthState};
use serde_norway::Value;

/// The operator's gateway before Hearth.
const FOREIGN: &str = r#"
admin:
  address: { socket_address: { address: 127.0.0.1, port_value: 0 } }
static_resources:
  listeners:
  - name: edge_http
    address: { socket_address: { address: 127.0.0.1, port_value: 0 } }
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: edge
          local_reply_config:
            mappers:
            - filter:
                status_code_filter:
                  comparison: { op: EQ, value: { default_value: 404, runtime_key: edge.local_reply.404 } }
              body_format_override:
                text_format: "edge: no such route\n"
          route_config:
            name: edge_routes
            virtual_hosts:
            - name: public_api
              domains: ["*"]
              routes:
              - match: { path: "/healthz" }
                direct_response: { status: 200, body: { inline_string: "edge ok" } }
              - match: { prefix: "/v1/" }
                route: { cluster: llm_backends }
          http_filters:
          - name: envoy.filters.http.header_mutation
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation
              mutations:
                response_mutations:
                - append: { header: { key: x-edge, value: "seen" } }
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: llm_backends
    connect_timeout: 1s
    lb_policy: ROUND_ROBIN
    load_assignment:
      cluster_name: llm_backends
      endpoints:
      - lb_endpoints: []
"#;

/// The foreign gateway in front of `engines`, with the snippets applied
/// (`values` fills them; its ENGINES_CLUSTER is replaced by the foreign
/// cluster's name).
fn foreign_with_hearth(engines: &[std::net::SocketAddr], mut values: Values) -> Value {
    let mut config: Value = serde_norway::from_str(FOREIGN).unwrap();
    let endpoints: Vec<Value> = engines
        .iter()
        .map(|a| {
            serde_norway::from_str(&format!(
                "endpoint: {{ address: {{ socket_address: {{ address: \"{}\", port_value: {} }} }} }}",
                a.ip(),
                a.port()
            ))
            .unwrap()
        })
        .collect();
    clusters(&mut config)[0]["load_assignment"]["endpoints"][0]["lb_endpoints"] =
        Value::Sequence(endpoints);
    values.retain(|(name, _)| *name != "ENGINES_CLUSTER");
    values.push(("ENGINES_CLUSTER", "llm_backends".into()));
    apply_all(&mut config, &values);
    config
}

fn to_yaml(config: &Value) -> String {
    serde_norway::to_string(config).unwrap()
}

/// A GET through `envoy`: status, `x-edge`, body.
async fn get(envoy: &Envoy, path: &str) -> (u16, Option<String>, String) {
    let r = reqwest::get(format!("{}{path}", envoy.url()))
        .await
        .unwrap();
    let edge = r
        .headers()
        .get("x-edge")
        .map(|v| v.to_str().unwrap().to_string());
    (r.status().as_u16(), edge, r.text().await.unwrap())
}

async fn chat_via(fleet: &Fleet, envoy: &Envoy, body: &serde_json::Value) -> Turn {
    fleet
        .post_via(
            envoy,
            "/v1/chat/completions",
            serde_json::to_vec(body).unwrap(),
            &[("content-type", "application/json")],
        )
        .await
        .unwrap()
}

#[tokio::test]
async fn a_foreign_gateway_with_the_snippets_keeps_conversations_on_their_replicas() {
    // Idle probes once a minute (the start-up round only): real traffic,
    // and the outcome filter's reports, raise suspicion, which the
    // sidecar's probes then confirm quickly.
    let fleet = Fleet::start(FleetOptions {
        sidecar_flags: vec![
            "--probe-interval-seconds=60".into(),
            "--suspect-probe-seconds=0.2".into(),
            "--probe-retry-seconds=0.2".into(),
            "--eject-after=3".into(),
        ],
        ..FleetOptions::default()
    })
    .await
    .unwrap();
    let addrs: Vec<_> = fleet.engines.iter().map(|e| e.addr).collect();
    let config = foreign_with_hearth(&addrs, fleet.gateway.snippet_values());
    // The operator's pieces are still there, Hearth's around them.
    let mut check = config.clone();
    let hcm = connection_managers(&mut check).remove(0);
    let filters: Vec<&str> = hcm["http_filters"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|f| f["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        filters,
        [
            "envoy.filters.http.header_mutation",
            "hearth.drop_client_headers",
            "hearth.filter_wasm",
            "envoy.filters.http.ext_proc",
            "hearth.filter_wasm_outcome",
            "envoy.filters.http.router"
        ]
    );
    assert_eq!(
        hcm["local_reply_config"]["mappers"]
            .as_sequence()
            .unwrap()
            .len(),
        2
    );
    // The listener keeps Envoy's default buffer (1 MiB): the route's limit
    // is what lets a larger prompt be hashed.
    assert!(config["static_resources"]["listeners"][0]
        .get("per_connection_buffer_limit_bytes")
        .is_none());
    let yaml = to_yaml(&config);
    validate_config("foreign", &yaml).unwrap_or_else(|e| panic!("{e:#}\n{yaml}"));
    let edge = fleet.start_envoy(&yaml).await.unwrap();

    // The operator's own routes and filter behave as before.
    assert_eq!(
        get(&edge, "/healthz").await,
        (200, Some("seen".into()), "edge ok".into())
    );
    let (status, _, body) = get(&edge, "/nowhere").await;
    assert_eq!((status, body.as_str()), (404, "edge: no such route\n"));

    // Sessions sharing a 16 KiB system prompt each stay on one replica and
    // read their history from its cache.
    let system = filler(41, 16_384);
    let mut homes = Vec::new();
    let mut convs = Vec::new();
    for s in 0..6u64 {
        let mut conv = Conversation::new(MODEL, &format!("{system} team {s}"), true, 4100 + s);
        let mut home = Home::new(format!("session {s}"));
        for _ in 0..4 {
            let t = chat_via(&fleet, &edge, &conv.next_turn(3000, false)).await;
            home.check(&t, 16_384 / 4);
            conv.push_assistant(&reply_text(&t.body));
            conv.push_tool_round(1500);
        }
        homes.push(home);
        convs.push(conv);
    }
    // The sidecar decided every turn on a fingerprint.
    assert_eq!(fleet.state().await.unwrap().hashed_total, 24);

    // A 1.5 MiB prompt, more than the listener buffers by default, is
    // hashed (its second turn finds its replica warm).
    let mut long = Conversation::new(MODEL, &filler(42, 1_500_000), false, 4200);
    let mut long_home = Home::new("1.5 MiB session");
    for _ in 0..2 {
        let t = chat_via(&fleet, &edge, &long.next_turn(2000, false)).await;
        long_home.check(&t, 1_500_000 / 4 * 9 / 10);
        long.push_assistant(&reply_text(&t.body));
    }
    assert_eq!(fleet.state().await.unwrap().hashed_total, 26);
    assert_eq!(
        edge.stat("wasmcustom.hearth_filter.hashed").await.unwrap(),
        Some(26)
    );

    // A replica answering 503 has the turn retried on another one.
    let home = homes[0].engine().unwrap().to_string();
    let idx = fleet
        .engines
        .iter()
        .position(|e| e.engine.config().id == home)
        .unwrap();
    fleet.engines[idx].engine.set_fault(Fault::Unavailable);
    let t = chat_via(&fleet, &edge, &convs[0].next_turn(1000, false)).await;
    assert_eq!(t.status, 200, "{:?}", t.body);
    assert_ne!(t.engine.as_deref(), Some(home.as_str()));
    fleet.engines[idx].engine.set_fault(Fault::None);

    // A replica answering 200 with nothing in it is fenced: the outcome
    // filter's reports reach the sidecar through the outcome cluster and
    // make it suspect (nothing else would: its idle probe is a minute
    // away), and its probes, empty too, fence it.
    let empty = (idx + 1) % fleet.engines.len();
    let empty_id = fleet.engines[empty].engine.config().id.clone();
    fleet.engines[empty].engine.set_fault(Fault::Empty);
    let fenced = |s: &hearth_router::Snapshot| {
        s.replicas
            .iter()
            .any(|r| r.id == empty_id && r.health.state == HealthState::Fenced)
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut sent = 0;
    while !fenced(&fleet.state().await.unwrap()) {
        assert!(
            Instant::now() < deadline,
            "{empty_id} not fenced after {sent} new conversations: {:?}",
            fleet.state().await.unwrap()
        );
        let mut c = Conversation::new(MODEL, &filler(500 + sent, 1024), false, 5000 + sent);
        let t = chat_via(&fleet, &edge, &c.next_turn(500, false)).await;
        assert_eq!(t.status, 200, "{:?}", t.body);
        sent += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let state = fleet.state().await.unwrap();
    let replica = state.replicas.iter().find(|r| r.id == empty_id).unwrap();
    assert_eq!(replica.health.last_failure, Some(Failure::EmptyAnswer));
    assert!(replica.health.suspicions_total >= 1, "{state:?}");
    fleet.engines[empty].engine.set_fault(Fault::None);

    // Every request's load came back, and no wasm VM failed.
    let state = fleet.settle(Duration::from_secs(10)).await.unwrap();
    assert!(state.replicas.iter().all(|r| r.in_flight == 0), "{state:?}");
    let log = edge.log();
    assert!(
        !log.contains("RuntimeError") && !log.contains("panicked"),
        "wasm failures in the foreign gateway:\n{log}"
    );
}

#[tokio::test]
async fn the_two_wasm_entries_share_one_vm_per_worker() {
    // Nothing needs to listen at these addresses for Envoy to start.
    let values = hearth_ext_proc::envoy::render::Gateway::local(
        "127.0.0.1:0".parse().unwrap(),
        "127.0.0.1:9".parse().unwrap(),
        "127.0.0.1:9".parse().unwrap(),
        vec![],
        find_wasm().unwrap().canonicalize().unwrap(),
    )
    .snippet_values();
    let shared = foreign_with_hearth(&["127.0.0.1:9".parse().unwrap()], values);
    // The same configuration with the outcome entry in a VM of its own.
    let mut separate = shared.clone();
    let hcm = connection_managers(&mut separate).remove(0);
    let outcome = hcm["http_filters"]
        .as_sequence_mut()
        .unwrap()
        .iter_mut()
        .find(|f| f["name"] == "hearth.filter_wasm_outcome")
        .unwrap();
    outcome["typed_config"]["config"]["vm_config"]["vm_id"] = "hearth_outcome".into();
    let mut active = Vec::new();
    for config in [&shared, &separate] {
        let envoy = Envoy::start(&to_yaml(config), Duration::from_secs(60))
            .await
            .unwrap();
        active.push(
            envoy
                .stat("wasm.envoy.wasm.runtime.v8.active")
                .await
                .unwrap()
                .expect("the V8 VM gauge"),
        );
    }
    // Envoy starts the separate VM on every worker thread (and the main one).
    assert!(
        active[0] > 0 && active[0] < active[1],
        "active VMs, shared then separate: {active:?}"
    );
}

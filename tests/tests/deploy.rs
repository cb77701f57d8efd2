//! The manifests under `deploy/`: every document parses as YAML and names
//! only fields of the API version it declares, every Envoy configuration
//! embedded in one passes `envoy --mode validate` (patch fragments wrapped
//! into a minimal bootstrap), and the sidecar's ConfigMap carries every
//! setting with a value the sidecar accepts in its pod (with the
//! Deployment's Secrets: NATS over TLS, with credentials, and the fleet's
//! key).
//!
//! No registry package carries the CRD schemas of these kinds (Istio,
//! Envoy Gateway, the Inference Extension, kustomize), so the field check
//! is a schema of our own: for each kind shipped, the field paths its
//! published API reference defines, limited to the parts the manifests use
//! (free-form subtrees, such as Envoy configuration or ConfigMap data, end
//! in `*`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use hearth_bench::gateway::validate;
use serde_json::{json, Value};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Every YAML document under `deploy/`, with the file it came from.
fn documents() -> Vec<(PathBuf, Value)> {
    let mut files = Vec::new();
    let mut dirs = vec![root().join("deploy")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "yaml") {
                files.push(path);
            }
        }
    }
    files.sort();
    let mut docs = Vec::new();
    for path in files {
        let text = std::fs::read_to_string(&path).unwrap();
        // Documents are separated by `---` lines.
        let mut parts = vec![String::new()];
        for line in text.lines() {
            if line.trim_end() == "---" {
                parts.push(String::new());
            } else {
                let last = parts.last_mut().unwrap();
                last.push_str(line);
                last.push('\n');
            }
        }
        for part in parts {
            let value: Value = serde_norway::from_str(&part)
                .unwrap_or_else(|e| panic!("{}: not YAML: {e}", path.display()));
            if !value.is_null() {
                docs.push((path.clone(), value));
            }
        }
    }
    docs
}

const OBJECT_META: &[&str] = &[
    "metadata",
    "metadata.name",
    "metadata.namespace",
    "metadata.labels.*",
    "metadata.annotations.*",
];

/// Field paths per (apiVersion, kind); `[]` stands for any array element.
fn schema(api_version: &str, kind: &str) -> Option<Vec<&'static str>> {
    let own: &[&str] = match (api_version, kind) {
        ("v1", "ConfigMap") => &["data.*", "binaryData.*", "immutable"],
        ("v1", "Secret") => &["type", "data.*", "stringData.*", "immutable"],
        ("v1", "Service") => &[
            "spec",
            "spec.selector.*",
            "spec.type",
            "spec.ports",
            "spec.ports[]",
            "spec.ports[].name",
            "spec.ports[].port",
            "spec.ports[].targetPort",
            "spec.ports[].protocol",
            "spec.ports[].appProtocol",
        ],
        ("apps/v1", "Deployment") => &[
            "spec",
            "spec.replicas",
            "spec.strategy",
            "spec.strategy.type",
            "spec.strategy.rollingUpdate",
            "spec.strategy.rollingUpdate.maxSurge",
            "spec.strategy.rollingUpdate.maxUnavailable",
            "spec.selector",
            "spec.selector.matchLabels.*",
            "spec.template",
            "spec.template.metadata",
            "spec.template.metadata.labels.*",
            "spec.template.metadata.annotations.*",
            "spec.template.spec",
            "spec.template.spec.serviceAccountName",
            "spec.template.spec.terminationGracePeriodSeconds",
            "spec.template.spec.containers",
            "spec.template.spec.containers[]",
            "spec.template.spec.containers[].name",
            "spec.template.spec.containers[].image",
            "spec.template.spec.containers[].args",
            "spec.template.spec.containers[].args[]",
            "spec.template.spec.containers[].envFrom",
            "spec.template.spec.containers[].envFrom[]",
            "spec.template.spec.containers[].envFrom[].configMapRef",
            "spec.template.spec.containers[].envFrom[].configMapRef.name",
            "spec.template.spec.containers[].env",
            "spec.template.spec.containers[].env[]",
            "spec.template.spec.containers[].env[].name",
            "spec.template.spec.containers[].env[].value",
            "spec.template.spec.containers[].env[].valueFrom",
            "spec.template.spec.containers[].env[].valueFrom.secretKeyRef",
            "spec.template.spec.containers[].env[].valueFrom.secretKeyRef.name",
            "spec.template.spec.containers[].env[].valueFrom.secretKeyRef.key",
            "spec.template.spec.containers[].ports",
            "spec.template.spec.containers[].ports[]",
            "spec.template.spec.containers[].ports[].name",
            "spec.template.spec.containers[].ports[].containerPort",
            "spec.template.spec.containers[].ports[].protocol",
            "spec.template.spec.containers[].readinessProbe",
            "spec.template.spec.containers[].readinessProbe.grpc",
            "spec.template.spec.containers[].readinessProbe.grpc.port",
            "spec.template.spec.containers[].readinessProbe.grpc.service",
            "spec.template.spec.containers[].readinessProbe.periodSeconds",
            "spec.template.spec.containers[].livenessProbe",
            "spec.template.spec.containers[].livenessProbe.grpc",
            "spec.template.spec.containers[].livenessProbe.grpc.port",
            "spec.template.spec.containers[].livenessProbe.grpc.service",
            "spec.template.spec.containers[].livenessProbe.httpGet",
            "spec.template.spec.containers[].livenessProbe.httpGet.path",
            "spec.template.spec.containers[].livenessProbe.httpGet.port",
            "spec.template.spec.containers[].livenessProbe.periodSeconds",
            "spec.template.spec.containers[].resources",
            "spec.template.spec.containers[].resources.requests.*",
            "spec.template.spec.containers[].resources.limits.*",
            "spec.template.spec.containers[].securityContext",
            "spec.template.spec.containers[].securityContext.allowPrivilegeEscalation",
            "spec.template.spec.containers[].securityContext.readOnlyRootFilesystem",
            "spec.template.spec.containers[].securityContext.runAsNonRoot",
            "spec.template.spec.containers[].securityContext.capabilities",
            "spec.template.spec.containers[].securityContext.capabilities.drop",
            "spec.template.spec.containers[].securityContext.capabilities.drop[]",
            "spec.template.spec.containers[].volumeMounts",
            "spec.template.spec.containers[].volumeMounts[]",
            "spec.template.spec.containers[].volumeMounts[].name",
            "spec.template.spec.containers[].volumeMounts[].mountPath",
            "spec.template.spec.containers[].volumeMounts[].readOnly",
            "spec.template.spec.volumes",
            "spec.template.spec.volumes[]",
            "spec.template.spec.volumes[].name",
            "spec.template.spec.volumes[].configMap",
            "spec.template.spec.volumes[].configMap.name",
            "spec.template.spec.volumes[].secret",
            "spec.template.spec.volumes[].secret.secretName",
            "spec.template.spec.volumes[].secret.defaultMode",
            "spec.template.spec.volumes[].secret.items",
            "spec.template.spec.volumes[].secret.items[]",
            "spec.template.spec.volumes[].secret.items[].key",
            "spec.template.spec.volumes[].secret.items[].path",
        ],
        ("v1", "ServiceAccount") => &[],
        ("rbac.authorization.k8s.io/v1", "Role") => &[
            "rules",
            "rules[]",
            "rules[].apiGroups",
            "rules[].apiGroups[]",
            "rules[].resources",
            "rules[].resources[]",
            "rules[].verbs",
            "rules[].verbs[]",
        ],
        ("rbac.authorization.k8s.io/v1", "RoleBinding") => &[
            "roleRef",
            "roleRef.apiGroup",
            "roleRef.kind",
            "roleRef.name",
            "subjects",
            "subjects[]",
            "subjects[].kind",
            "subjects[].name",
            "subjects[].namespace",
        ],
        ("networking.k8s.io/v1", "NetworkPolicy") => &[
            "spec",
            "spec.podSelector",
            "spec.podSelector.matchLabels.*",
            "spec.policyTypes",
            "spec.policyTypes[]",
            "spec.ingress",
            "spec.ingress[]",
            "spec.ingress[].from",
            "spec.ingress[].from[]",
            "spec.ingress[].from[].namespaceSelector",
            "spec.ingress[].from[].namespaceSelector.matchLabels.*",
            "spec.ingress[].from[].podSelector",
            "spec.ingress[].from[].podSelector.matchLabels.*",
            "spec.ingress[].ports",
            "spec.ingress[].ports[]",
            "spec.ingress[].ports[].port",
            "spec.ingress[].ports[].protocol",
            "spec.egress",
            "spec.egress[]",
            "spec.egress[].to",
            "spec.egress[].to[]",
            "spec.egress[].to[].podSelector",
            "spec.egress[].to[].podSelector.matchLabels.*",
            "spec.egress[].ports",
            "spec.egress[].ports[]",
            "spec.egress[].ports[].port",
            "spec.egress[].ports[].protocol",
        ],
        ("kustomize.config.k8s.io/v1beta1", "Kustomization") => &[
            "namespace",
            "labels",
            "labels[]",
            "labels[].pairs.*",
            "labels[].includeSelectors",
            "resources",
            "resources[]",
            "images",
            "images[]",
            "images[].name",
            "images[].newName",
            "images[].newTag",
        ],
        ("networking.istio.io/v1alpha3", "EnvoyFilter") => &[
            "spec",
            "spec.workloadSelector",
            "spec.workloadSelector.labels.*",
            "spec.configPatches",
            "spec.configPatches[]",
            "spec.configPatches[].applyTo",
            "spec.configPatches[].match",
            "spec.configPatches[].match.context",
            "spec.configPatches[].match.listener",
            "spec.configPatches[].match.listener.filterChain",
            "spec.configPatches[].match.listener.filterChain.filter",
            "spec.configPatches[].match.listener.filterChain.filter.name",
            "spec.configPatches[].match.listener.filterChain.filter.subFilter",
            "spec.configPatches[].match.listener.filterChain.filter.subFilter.name",
            "spec.configPatches[].match.cluster",
            "spec.configPatches[].match.cluster.service",
            "spec.configPatches[].match.cluster.portNumber",
            "spec.configPatches[].patch",
            "spec.configPatches[].patch.operation",
            "spec.configPatches[].patch.value.*",
        ],
        ("gateway.envoyproxy.io/v1alpha1", "EnvoyExtensionPolicy") => &[
            "spec",
            "spec.targetRefs",
            "spec.targetRefs[]",
            "spec.targetRefs[].group",
            "spec.targetRefs[].kind",
            "spec.targetRefs[].name",
            "spec.extProc",
            "spec.extProc[]",
            "spec.extProc[].backendRefs",
            "spec.extProc[].backendRefs[]",
            "spec.extProc[].backendRefs[].name",
            "spec.extProc[].backendRefs[].namespace",
            "spec.extProc[].backendRefs[].port",
            "spec.extProc[].messageTimeout",
            "spec.extProc[].failOpen",
            "spec.extProc[].processingMode",
            "spec.extProc[].processingMode.request",
            "spec.extProc[].processingMode.request.body",
            "spec.extProc[].processingMode.request.attributes",
            "spec.extProc[].processingMode.request.attributes[]",
            "spec.extProc[].processingMode.response",
            "spec.extProc[].processingMode.response.body",
            "spec.extProc[].processingMode.response.attributes",
            "spec.extProc[].processingMode.response.attributes[]",
            "spec.extProc[].metadata",
            "spec.extProc[].metadata.accessibleNamespaces",
            "spec.extProc[].metadata.accessibleNamespaces[]",
            "spec.extProc[].metadata.writableNamespaces",
            "spec.extProc[].metadata.writableNamespaces[]",
        ],
        ("gateway.envoyproxy.io/v1alpha1", "EnvoyPatchPolicy") => &[
            "spec",
            "spec.targetRef",
            "spec.targetRef.group",
            "spec.targetRef.kind",
            "spec.targetRef.name",
            "spec.type",
            "spec.priority",
            "spec.jsonPatches",
            "spec.jsonPatches[]",
            "spec.jsonPatches[].type",
            "spec.jsonPatches[].name",
            "spec.jsonPatches[].operation",
            "spec.jsonPatches[].operation.op",
            "spec.jsonPatches[].operation.path",
            "spec.jsonPatches[].operation.from",
            "spec.jsonPatches[].operation.value.*",
        ],
        ("inference.networking.k8s.io/v1", "InferencePool") => &[
            "spec",
            "spec.selector",
            "spec.selector.matchLabels.*",
            "spec.targetPorts",
            "spec.targetPorts[]",
            "spec.targetPorts[].number",
            "spec.endpointPickerRef",
            "spec.endpointPickerRef.group",
            "spec.endpointPickerRef.kind",
            "spec.endpointPickerRef.name",
            "spec.endpointPickerRef.port",
            "spec.endpointPickerRef.port.number",
            "spec.endpointPickerRef.failureMode",
        ],
        ("gateway.networking.k8s.io/v1", "HTTPRoute") => &[
            "spec",
            "spec.parentRefs",
            "spec.parentRefs[]",
            "spec.parentRefs[].name",
            "spec.parentRefs[].namespace",
            "spec.rules",
            "spec.rules[]",
            "spec.rules[].matches",
            "spec.rules[].matches[]",
            "spec.rules[].matches[].path",
            "spec.rules[].matches[].path.type",
            "spec.rules[].matches[].path.value",
            "spec.rules[].backendRefs",
            "spec.rules[].backendRefs[]",
            "spec.rules[].backendRefs[].group",
            "spec.rules[].backendRefs[].kind",
            "spec.rules[].backendRefs[].name",
        ],
        _ => return None,
    };
    let mut all = vec!["apiVersion", "kind"];
    // Kustomization has no object metadata.
    if kind != "Kustomization" {
        all.extend_from_slice(OBJECT_META);
    }
    all.extend_from_slice(own);
    Some(all)
}

/// Field paths of `v` that `allowed` does not define.
fn unknown_fields(v: &Value, allowed: &[&str]) -> Vec<String> {
    fn walk(v: &Value, path: &str, allowed: &[&str], out: &mut Vec<String>) {
        let free = |p: &str| {
            allowed.iter().any(|a| {
                a.strip_suffix(".*")
                    .is_some_and(|base| p.starts_with(&format!("{base}.")) || p == base)
            })
        };
        if !path.is_empty() && free(path) {
            return;
        }
        if !path.is_empty() && !allowed.contains(&path) {
            out.push(path.to_string());
            return;
        }
        match v {
            Value::Object(map) => {
                for (k, child) in map {
                    let p = if path.is_empty() {
                        k.clone()
                    } else {
                        format!("{path}.{k}")
                    };
                    walk(child, &p, allowed, out);
                }
            }
            Value::Array(items) => {
                for child in items {
                    walk(child, &format!("{path}[]"), allowed, out);
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(v, "", allowed, &mut out);
    out
}

#[test]
fn every_manifest_names_only_fields_of_its_api_version() {
    let docs = documents();
    let mut kinds = Vec::new();
    for (path, doc) in &docs {
        let api = doc["apiVersion"].as_str().unwrap_or("");
        let kind = doc["kind"].as_str().unwrap_or("");
        let allowed = schema(api, kind)
            .unwrap_or_else(|| panic!("{}: no schema for {api} {kind}", path.display()));
        let unknown = unknown_fields(doc, &allowed);
        assert!(
            unknown.is_empty(),
            "{}: {api} {kind} has no field(s) {unknown:?}",
            path.display()
        );
        kinds.push(kind.to_string());
    }
    for kind in [
        "EnvoyFilter",
        "EnvoyPatchPolicy",
        "NetworkPolicy",
        "Secret",
        "InferencePool",
        "Deployment",
        "Service",
        "ConfigMap",
        "Secret",
        "Kustomization",
    ] {
        assert!(kinds.iter().any(|k| k == kind), "no {kind} under deploy/");
    }
    // The checker catches a misspelt field and a field of another version.
    let bad = json!({"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
        "metadata": {"name": "x"}, "spec": {"targetPortNumber": 8000, "selector": {"app": "x"}}});
    let allowed = schema("inference.networking.k8s.io/v1", "InferencePool").unwrap();
    assert_eq!(
        unknown_fields(&bad, &allowed),
        ["spec.selector.app", "spec.targetPortNumber"]
    );
}

#[test]
fn the_inference_pool_states_its_failure_mode_and_picks_with_hearth() {
    let docs = documents();
    let pool = docs
        .iter()
        .map(|(_, d)| d)
        .find(|d| d["kind"] == "InferencePool")
        .unwrap();
    let picker = &pool["spec"]["endpointPickerRef"];
    assert_eq!(picker["failureMode"], "FailClose");
    assert_eq!(picker["kind"], "Service");
    let service = docs
        .iter()
        .map(|(_, d)| d)
        .find(|d| d["kind"] == "Service" && d["metadata"]["name"] == picker["name"])
        .expect("the picker's Service is shipped");
    let ports: Vec<&Value> = service["spec"]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| &p["port"])
        .collect();
    assert!(ports.contains(&&picker["port"]["number"]));
}

/// The document of `kind` named `name`.
fn find<'a>(docs: &'a [(PathBuf, Value)], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .map(|(_, d)| d)
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

/// The first container of Deployment `name`, and its pod spec.
fn container<'a>(docs: &'a [(PathBuf, Value)], name: &str) -> (&'a Value, &'a Value) {
    let pod = &find(docs, "Deployment", name)["spec"]["template"]["spec"];
    (&pod["containers"][0], pod)
}

/// The value a Secret (from `secrets.example.yaml`) holds under `key`.
fn secret_value(docs: &[(PathBuf, Value)], name: &str, key: &str) -> String {
    find(docs, "Secret", name)["stringData"][key]
        .as_str()
        .unwrap_or_else(|| panic!("Secret {name} has no {key}"))
        .to_string()
}

/// Where a container's environment variable gets its value.
#[derive(Clone, Debug, PartialEq)]
enum EnvValue {
    Literal(String),
    /// A Secret's name and key.
    FromSecret(String, String),
}

/// A container's `env`: name and value.
fn env_of(c: &Value) -> Vec<(String, EnvValue)> {
    c["env"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .map(|e| {
            let name = e["name"].as_str().unwrap().to_string();
            let value = match e["valueFrom"]["secretKeyRef"].as_object() {
                Some(r) => EnvValue::FromSecret(
                    r["name"].as_str().unwrap().to_string(),
                    r["key"].as_str().unwrap().to_string(),
                ),
                None => EnvValue::Literal(e["value"].as_str().unwrap_or("").to_string()),
            };
            (name, value)
        })
        .collect()
}

/// The file a pod sees at `path`, from the volume mounted over it: the
/// ConfigMap's or Secret's value (a Secret's items map keys to paths).
fn mounted_file(docs: &[(PathBuf, Value)], c: &Value, pod: &Value, path: &str) -> Option<String> {
    let mount = c["volumeMounts"].as_array()?.iter().find(|m| {
        let at = m["mountPath"].as_str().unwrap_or("");
        path.strip_prefix(at)
            .is_some_and(|rest| rest.starts_with('/'))
    })?;
    let file = &path[mount["mountPath"].as_str()?.len() + 1..];
    let volume = pod["volumes"]
        .as_array()?
        .iter()
        .find(|v| v["name"] == mount["name"])?;
    if let Some(cm) = volume["configMap"]["name"].as_str() {
        return find(docs, "ConfigMap", cm)["data"][file]
            .as_str()
            .map(str::to_string);
    }
    let secret = &volume["secret"];
    let name = secret["secretName"].as_str()?;
    let key = match secret["items"].as_array() {
        Some(items) => items.iter().find(|i| i["path"] == file)?["key"]
            .as_str()?
            .to_string(),
        None => file.to_string(),
    };
    Some(secret_value(docs, name, &key))
}

/// The sidecar's settings as its pod gets them: the ConfigMap, then the
/// Deployment's `env` (Secrets' values from `secrets.example.yaml`), and
/// each file a setting names read from the volume mounted there (written
/// under `scratch`, the setting pointed at it).
fn sidecar_pod_env(docs: &[(PathBuf, Value)], scratch: &Path) -> BTreeMap<String, String> {
    let mut env: BTreeMap<String, String> = find(docs, "ConfigMap", "hearth-settings")["data"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_str().expect("strings").to_string()))
        .collect();
    let (c, pod) = container(docs, "hearth-ext-proc");
    for (name, value) in env_of(c) {
        let value = match value {
            EnvValue::Literal(v) => v,
            EnvValue::FromSecret(secret, key) => secret_value(docs, &secret, &key),
        };
        env.insert(name, value);
    }
    for (k, v) in env.iter_mut() {
        if !k.ends_with("_FILE") || v.is_empty() {
            continue;
        }
        let contents = mounted_file(docs, c, pod, v)
            .unwrap_or_else(|| panic!("{k}={v}: no volume of the Deployment holds it"));
        let local = scratch.join(v.trim_start_matches('/'));
        std::fs::create_dir_all(local.parent().unwrap()).unwrap();
        std::fs::write(&local, contents).unwrap();
        *v = local.display().to_string();
    }
    env
}

/// Settings from `HEARTH_*` variables, as the sidecar reads them (an empty
/// value is unset).
fn parse_settings(env: &BTreeMap<String, String>) -> hearth_ext_proc::config::Settings {
    let mut args = vec!["hearth-ext-proc".to_string()];
    for (k, v) in env {
        if !v.is_empty() {
            let flag = k
                .trim_start_matches("HEARTH_")
                .to_lowercase()
                .replace('_', "-");
            args.push(format!("--{flag}={v}"));
        }
    }
    <hearth_ext_proc::config::Cli as clap::Parser>::try_parse_from(&args)
        .unwrap_or_else(|e| panic!("{args:?}: {e}"))
        .settings
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("hearth-deploy-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn the_sidecar_configmap_sets_every_setting_to_a_value_it_accepts() {
    let docs = documents();
    let data = find(&docs, "ConfigMap", "hearth-settings")["data"]
        .as_object()
        .unwrap();
    let mut known = hearth_ext_proc::config::known_env_vars();
    known.sort();
    let mut shipped: Vec<String> = data.keys().cloned().collect();
    shipped.sort();
    assert_eq!(
        shipped, known,
        "deploy/sidecar/configmap.yaml vs the sidecar's settings"
    );
    // The values parse and validate as the sidecar's own settings, in the
    // pod (with the Deployment's Secrets and mounted files).
    let dir = scratch("settings");
    let mut env = sidecar_pod_env(&docs, &dir);
    // The control token's Secret ships a placeholder the sidecar refuses
    // on purpose (another test checks that); here a stand-in it accepts.
    let token = dir.join("control-token");
    std::fs::write(&token, "x".repeat(64)).unwrap();
    env.insert(
        "HEARTH_CONTROL_TOKEN_FILE".into(),
        token.display().to_string(),
    );
    let settings = parse_settings(&env);
    settings
        .validate()
        .unwrap_or_else(|p| panic!("the pod's settings refused: {p:?}"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_sidecars_reach_nats_over_tls_with_its_user_and_sign_with_the_fleet_key() {
    let docs = documents();
    let dir = scratch("bus");
    let env = sidecar_pod_env(&docs, &dir);
    let settings = parse_settings(&env);
    // TLS to the NATS Service, at its port.
    let url = settings.peers_url.clone().expect("HEARTH_PEERS_URL");
    assert!(url.starts_with("tls://"), "{url}");
    let service = find(&docs, "Service", "hearth-nats");
    let port = service["spec"]["ports"][0]["port"].as_u64().unwrap();
    assert_eq!(url, format!("tls://hearth-nats:{port}"));
    assert!(!settings.peers_insecure);
    // The server's CA (and only it, not the server's key) is trusted.
    let ca = std::fs::read_to_string(settings.peers_ca_file.as_ref().unwrap()).unwrap();
    assert!(ca.contains("BEGIN CERTIFICATE"));
    let (sidecar, sidecar_pod) = container(&docs, "hearth-ext-proc");
    let secret_volumes: Vec<&Value> = sidecar_pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|v| v["secret"].is_object())
        .collect();
    for v in &secret_volumes {
        match v["secret"]["items"].as_array() {
            Some(items) => {
                for item in items {
                    assert_ne!(item["key"], "tls.key", "the sidecars mount no server key");
                }
            }
            // A whole Secret mounted: never the server's.
            None => assert_ne!(v["secret"]["secretName"], "hearth-nats-tls", "{v}"),
        }
    }
    // The key and the credentials come from Secrets, not the ConfigMap.
    assert!(settings.peers_key().unwrap().is_some());
    let sidecar_env = env_of(sidecar);
    let from_secret = |env: &[(String, EnvValue)], name: &str| {
        let value = env.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone());
        assert!(
            matches!(value, Some(EnvValue::FromSecret(..))),
            "{name} is not set from a Secret: {value:?}"
        );
        value.unwrap()
    };
    let user = from_secret(&sidecar_env, "HEARTH_PEERS_USER");
    let password = from_secret(&sidecar_env, "HEARTH_PEERS_PASSWORD");
    // Without those Secrets, the ConfigMap alone is refused, naming them.
    let mut bare = env.clone();
    bare.remove("HEARTH_PEERS_USER");
    bare.remove("HEARTH_PEERS_PASSWORD");
    let problems = parse_settings(&bare).validate().unwrap_err();
    assert!(
        problems.iter().any(|p| p.contains("HEARTH_PEERS_USER")),
        "{problems:?}"
    );
    let mut keyless = env.clone();
    keyless.remove("HEARTH_PEERS_KEY_FILE");
    let problems = parse_settings(&keyless).validate().unwrap_err();
    assert!(
        problems.iter().any(|p| p.contains("HEARTH_PEERS_KEY_FILE")),
        "{problems:?}"
    );

    // The NATS server: its configuration, where its arguments say.
    let (nats, nats_pod) = container(&docs, "hearth-nats");
    let args: Vec<&str> = nats["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    let conf_path = args[args.iter().position(|a| *a == "-c").unwrap() + 1];
    let conf = mounted_file(&docs, nats, nats_pod, conf_path).expect("nats.conf mounted");
    assert_eq!(conf, hearth_e2e::nats::shipped_config());
    // TLS with the certificate and key of the mounted Secret.
    for field in ["cert_file", "key_file"] {
        let line = conf
            .lines()
            .find(|l| l.trim_start().starts_with(field))
            .unwrap_or_else(|| panic!("nats.conf has no {field}"));
        let path = line.split('"').nth(1).unwrap();
        let pem = mounted_file(&docs, nats, nats_pod, path)
            .unwrap_or_else(|| panic!("{field} {path} is in no mounted volume"));
        assert!(pem.contains("-----BEGIN"), "{field}: {pem}");
    }
    // One user, whose name and password are the sidecars' (same Secret
    // keys), allowed only the fleet's subjects and inboxes.
    let nats_env = env_of(nats);
    assert!(conf.contains("user: $HEARTH_NATS_USER"), "{conf}");
    assert!(conf.contains("password: $HEARTH_NATS_PASSWORD"), "{conf}");
    assert_eq!(from_secret(&nats_env, "HEARTH_NATS_USER"), user);
    assert_eq!(from_secret(&nats_env, "HEARTH_NATS_PASSWORD"), password);
    assert!(
        conf.contains(r#"publish: ["hearth.>", "_INBOX.>"]"#),
        "{conf}"
    );
    // The placeholders say so, and kustomize never ships them.
    let kustomization = docs
        .iter()
        .map(|(_, d)| d)
        .find(|d| d["kind"] == "Kustomization")
        .unwrap();
    let resources = kustomization["resources"].as_array().unwrap();
    assert!(!resources.iter().any(|r| r == "secrets.example.yaml"));
    assert!(secret_value(&docs, "hearth-peers", "password").contains("REPLACE-ME"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn discovery_reads_pods_and_pools_only_and_either_shape_validates() {
    let docs = documents();
    let role = find(&docs, "Role", "hearth-discovery");
    let mut granted = Vec::new();
    for rule in role["rules"].as_array().unwrap() {
        assert_eq!(rule["verbs"], json!(["get", "list", "watch"]), "{rule}");
        for group in rule["apiGroups"].as_array().unwrap() {
            for resource in rule["resources"].as_array().unwrap() {
                granted.push(format!(
                    "{}/{}",
                    group.as_str().unwrap(),
                    resource.as_str().unwrap()
                ));
            }
        }
    }
    assert_eq!(
        granted,
        ["/pods", "inference.networking.k8s.io/inferencepools"]
    );
    // The Role is where discovery reads, bound to the base's
    // ServiceAccount in the base's namespace, which the Deployment runs
    // as; the base does not carry the Role (its namespace would move it).
    let settings = &find(&docs, "ConfigMap", "hearth-settings")["data"];
    let kustomization = docs
        .iter()
        .map(|(_, d)| d)
        .find(|d| d["kind"] == "Kustomization")
        .unwrap();
    assert_eq!(
        role["metadata"]["namespace"],
        settings["HEARTH_DISCOVERY_NAMESPACE"]
    );
    let binding = find(&docs, "RoleBinding", "hearth-discovery");
    assert_eq!(
        binding["metadata"]["namespace"],
        role["metadata"]["namespace"]
    );
    assert_eq!(binding["roleRef"]["name"], "hearth-discovery");
    assert_eq!(
        binding["subjects"],
        json!([{"kind": "ServiceAccount", "name": "hearth-ext-proc",
                "namespace": kustomization["namespace"]}])
    );
    let pod = &find(&docs, "Deployment", "hearth-ext-proc")["spec"]["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], "hearth-ext-proc");
    find(&docs, "ServiceAccount", "hearth-ext-proc");
    let resources = kustomization["resources"].as_array().unwrap();
    assert!(resources.iter().any(|r| r == "serviceaccount.yaml"));
    assert!(!resources.iter().any(|r| r == "discovery-rbac.yaml"));

    // The shipped selector and port are the shipped pool's, in the
    // namespace discovery reads.
    let pool = find(&docs, "InferencePool", "engines");
    assert_eq!(
        pool["metadata"]["namespace"],
        settings["HEARTH_DISCOVERY_NAMESPACE"]
    );
    let labels = pool["spec"]["selector"]["matchLabels"].as_object().unwrap();
    let selector: Vec<String> = labels
        .iter()
        .map(|(k, v)| format!("{k}={}", v.as_str().unwrap()))
        .collect();
    assert_eq!(settings["HEARTH_DISCOVERY_SELECTOR"], selector.join(","));
    assert_eq!(
        settings["HEARTH_DISCOVERY_PORT"],
        pool["spec"]["targetPorts"][0]["number"].to_string()
    );
    // The InferencePool shape, as the comments say to set it, validates.
    let dir = scratch("pool-shape");
    let mut env = sidecar_pod_env(&docs, &dir);
    let token = dir.join("control-token");
    std::fs::write(&token, "x".repeat(64)).unwrap();
    for (k, v) in [
        ("HEARTH_CONTROL_TOKEN_FILE", token.display().to_string()),
        ("HEARTH_DISCOVERY", "inferencepool".into()),
        ("HEARTH_INFERENCE_POOL", "engines".into()),
        ("HEARTH_DISCOVERY_SELECTOR", String::new()),
        ("HEARTH_DISCOVERY_PORT", String::new()),
    ] {
        env.insert(k.into(), v);
    }
    parse_settings(&env)
        .validate()
        .unwrap_or_else(|p| panic!("the InferencePool shape's settings refused: {p:?}"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_mounted_replica_list_parses_where_the_settings_point() {
    let docs = documents();
    let list = find(&docs, "ConfigMap", "hearth-upstreams");
    let text = list["data"]["upstreams"].as_str().expect("data.upstreams");
    let specs = hearth_ext_proc::feeds::upstreams::parse(text, "hearth-upstreams")
        .unwrap_or_else(|p| panic!("the shipped replica list is refused: {p:?}"));
    assert!(!specs.is_empty());
    // The Deployment mounts it where the settings' comment says.
    let pod = &find(&docs, "Deployment", "hearth-ext-proc")["spec"]["template"]["spec"];
    assert_eq!(pod["volumes"][0]["configMap"]["name"], "hearth-upstreams");
    let mount = &pod["containers"][0]["volumeMounts"][0];
    assert_eq!(mount["name"], pod["volumes"][0]["name"]);
    let path = format!("{}/upstreams", mount["mountPath"].as_str().unwrap());
    let settings = std::fs::read_to_string(root().join("deploy/sidecar/configmap.yaml")).unwrap();
    assert!(
        settings.contains(&path),
        "configmap.yaml does not name {path}"
    );
}

/// A minimal bootstrap around HTTP filters and clusters: one listener whose
/// connection manager runs `filters` then the router to `engines`.
fn bootstrap(filters: Vec<Value>, mut clusters: Vec<Value>, engines: Value) -> Value {
    let mut chain = filters;
    chain.push(
        json!({"name": "envoy.filters.http.router", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}),
    );
    clusters.push(engines);
    json!({
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
        "static_resources": {
            "listeners": [{
                "name": "http",
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}},
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                        "stat_prefix": "manifest",
                        "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"],
                            "routes": [{"match": {"prefix": "/"}, "route": {"cluster": "engines"}}]}]},
                        "http_filters": chain
                    }
                }]}]
            }],
            "clusters": clusters
        }
    })
}

/// A stand-in for the cluster a mesh generates for the engines, with a
/// manifest's patch merged in.
fn engines_cluster(patch: &serde_json::Map<String, Value>) -> Value {
    let mut c = json!({
        "name": "engines",
        "connect_timeout": "1s",
        "load_assignment": {"cluster_name": "engines", "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 8000}}}}]}]}
    });
    for (k, v) in patch {
        c[k] = v.clone();
    }
    c
}

fn validate_bootstrap(name: &str, config: &Value) {
    let wasm = hearth_bench::gateway::find_wasm()
        .expect("wasm built")
        .canonicalize()
        .unwrap();
    let mut text = serde_json::to_string_pretty(config).unwrap();
    // Manifests name the module where the pod mounts it.
    text = text.replace("/var/lib/hearth/plugin.wasm", &wasm.display().to_string());
    let path =
        std::env::temp_dir().join(format!("hearth-deploy-{}-{name}.json", std::process::id()));
    std::fs::write(&path, &text).unwrap();
    let result = validate(&path);
    let _ = std::fs::remove_file(&path);
    result.unwrap_or_else(|e| panic!("{name}: {e:#}\n{text}"));
}

#[test]
fn every_envoy_configuration_in_a_manifest_validates() {
    let mut checked = 0;
    for (path, doc) in documents() {
        let name = path.file_stem().unwrap().to_string_lossy().to_string();
        match doc["kind"].as_str() {
            Some("EnvoyFilter") => {
                let mut filters = Vec::new();
                let mut clusters = Vec::new();
                let mut engines = serde_json::Map::new();
                for p in doc["spec"]["configPatches"].as_array().unwrap() {
                    let value = p["patch"]["value"].clone();
                    match (p["applyTo"].as_str(), p["patch"]["operation"].as_str()) {
                        (Some("HTTP_FILTER"), Some("INSERT_BEFORE")) => filters.push(value),
                        (Some("CLUSTER"), Some("ADD")) => clusters.push(value),
                        (Some("CLUSTER"), Some("MERGE")) => {
                            engines.extend(value.as_object().unwrap().clone())
                        }
                        other => panic!("{}: unexpected patch {other:?}", path.display()),
                    }
                }
                assert!(!filters.is_empty() && !clusters.is_empty());
                let config = bootstrap(filters, clusters, engines_cluster(&engines));
                validate_bootstrap(&name, &config);
                checked += 1;
            }
            Some("EnvoyPatchPolicy") => {
                let mut filters = Vec::new();
                let mut clusters = Vec::new();
                let mut engines = serde_json::Map::new();
                for p in doc["spec"]["jsonPatches"].as_array().unwrap() {
                    let op = &p["operation"];
                    let value = op["value"].clone();
                    let kind = p["type"].as_str().unwrap();
                    let target = op["path"].as_str().unwrap();
                    if kind.ends_with("Listener") && target.contains("/http_filters/") {
                        filters.push(value);
                    } else if kind.ends_with("Cluster") && target.is_empty() {
                        clusters.push(value);
                    } else if kind.ends_with("Cluster") {
                        let field = target.trim_start_matches('/');
                        assert!(
                            !field.contains('/'),
                            "{target}: only top-level cluster fields"
                        );
                        engines.insert(field.to_string(), value);
                    } else {
                        panic!("{}: unexpected patch {p}", path.display());
                    }
                }
                let config = bootstrap(filters, clusters, engines_cluster(&engines));
                validate_bootstrap(&name, &config);
                checked += 1;
            }
            _ => {}
        }
    }
    assert_eq!(checked, 2, "the Istio and Envoy Gateway patches");
}

/// The sidecar's ports, from the ConfigMap's listen addresses.
const CONTROL_PORTS: [u16; 2] = [50051, 9190];

#[test]
fn no_shipped_config_opens_a_control_port_without_the_token() {
    // The sidecar's settings: a listener off loopback comes with the
    // token file, mounted from the Secret, and the sidecar itself refuses
    // the other way round (HEARTH_CONTROL_INSECURE stays false).
    let docs = documents();
    let data = find(&docs, "ConfigMap", "hearth-settings")["data"].clone();
    let open = |key: &str| {
        let addr: std::net::SocketAddr = data[key].as_str().unwrap().parse().unwrap();
        !addr.ip().is_loopback()
    };
    assert!(open("HEARTH_LISTEN") && open("HEARTH_ADMIN_LISTEN"));
    assert_eq!(data["HEARTH_CONTROL_INSECURE"], "false");
    let token_file = data["HEARTH_CONTROL_TOKEN_FILE"].as_str().unwrap();
    assert!(
        !token_file.is_empty(),
        "listeners off loopback without the token"
    );
    let pod = &find(&docs, "Deployment", "hearth-ext-proc")["spec"]["template"]["spec"];
    let mounts = pod["containers"][0]["volumeMounts"].as_array().unwrap();
    let mount = mounts
        .iter()
        .find(|m| token_file.starts_with(&format!("{}/", m["mountPath"].as_str().unwrap())))
        .expect("the token file's directory is mounted");
    let volume = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .unwrap();
    let secret = volume["secret"]["secretName"]
        .as_str()
        .expect("from a Secret");
    let key = token_file.rsplit('/').next().unwrap();
    let placeholder = find(&docs, "Secret", secret)["stringData"][key]
        .as_str()
        .expect("the Secret holds the token's key")
        .to_string();
    // The shipped placeholder can never be the fleet's token.
    let file = std::env::temp_dir().join(format!("hearth-placeholder-{}", std::process::id()));
    std::fs::write(&file, &placeholder).unwrap();
    assert!(hearth_ext_proc::config::read_control_token(&file).is_err());
    let _ = std::fs::remove_file(file);

    // A NetworkPolicy admits only named peers to both ports.
    let policy = find(&docs, "NetworkPolicy", "hearth-ext-proc");
    assert_eq!(
        policy["spec"]["podSelector"]["matchLabels"],
        find(&docs, "Deployment", "hearth-ext-proc")["spec"]["selector"]["matchLabels"]
    );
    for rule in policy["spec"]["ingress"].as_array().unwrap() {
        let peers = rule["from"].as_array().expect("every rule names its peers");
        for peer in peers {
            assert!(
                peer["podSelector"]["matchLabels"].is_object(),
                "a rule admits whole namespaces: {peer}"
            );
        }
        // The gRPC port is the gateways' alone; anyone else (the metrics
        // scraper) reaches the admin port only.
        let gateways = peers.iter().all(|peer| {
            let labels = &peer["podSelector"]["matchLabels"];
            labels["istio"] == "ingressgateway"
                || labels["gateway.envoyproxy.io/owning-gateway-name"].is_string()
        });
        if !gateways {
            let ports: Vec<&str> = rule["ports"]
                .as_array()
                .expect("every rule names its ports")
                .iter()
                .filter_map(|p| p["port"].as_str())
                .collect();
            assert_eq!(ports, ["admin"], "{rule}");
        }
    }

    // Another admits only the sidecars to NATS's client port.
    let bus = find(&docs, "NetworkPolicy", "hearth-nats");
    assert_eq!(
        bus["spec"]["podSelector"]["matchLabels"],
        find(&docs, "Deployment", "hearth-nats")["spec"]["selector"]["matchLabels"]
    );
    let rules = bus["spec"]["ingress"].as_array().unwrap();
    assert_eq!(rules.len(), 1, "{bus}");
    assert_eq!(
        rules[0]["from"],
        serde_json::json!([{"podSelector": {"matchLabels":
            find(&docs, "Deployment", "hearth-ext-proc")["spec"]["selector"]["matchLabels"]}}])
    );
    assert_eq!(rules[0]["ports"][0]["port"], "client");

    // Every Envoy configuration that calls the sidecar sends the token
    // and forwards only routing headers: the manifests (with a placeholder
    // to replace) and the shipped gateways, which reach it on loopback.
    for (path, doc) in &docs {
        let text = serde_json::to_string(doc).unwrap();
        if !text.contains("envoy.filters.http.ext_proc") {
            continue;
        }
        assert!(
            text.contains(r#""key":"authorization""#) && text.contains("Bearer "),
            "{}: ext_proc without the control token",
            path.display()
        );
        assert!(
            text.contains("forward_rules") && text.contains("control_token"),
            "{}: no forward_rules or no token in the outcome filter",
            path.display()
        );
    }
    // Every mesh manifest that carries the wasm filter backs it up: client
    // routing headers dropped before it (it fails open), Hearth's own
    // request headers dropped after the outcome filter, before the
    // engines; and ext_proc's allow-list is exactly the routing headers.
    let mut meshes = 0;
    for (path, doc) in &docs {
        let mut filters = Vec::new();
        http_filters_in(doc, &mut filters);
        let names: Vec<&str> = filters.iter().map(|(n, _)| n.as_str()).collect();
        if !names.contains(&"hearth.filter_wasm") {
            continue;
        }
        meshes += 1;
        let removals = |name: &str| {
            filters
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, r)| r.clone())
                .unwrap_or_else(|| panic!("{}: no {name} in {names:?}", path.display()))
        };
        let at = |name: &str| names.iter().position(|n| *n == name).unwrap();
        assert_eq!(
            names,
            [
                "hearth.drop_client_headers",
                "hearth.filter_wasm",
                "envoy.filters.http.ext_proc",
                "hearth.filter_wasm_outcome",
                "hearth.drop_hearth_headers"
            ],
            "{}",
            path.display()
        );
        assert!(at("hearth.drop_client_headers") < at("hearth.filter_wasm"));
        let mut client: Vec<String> = hearth_ext_proc::envoy::render::HEARTH_HEADERS
            .iter()
            .map(|h| h.to_string())
            .collect();
        client.extend([
            hearth_wire::names::DESTINATION.to_string(),
            hearth_wire::names::SUBSET_KEY.to_string(),
        ]);
        assert_eq!(
            removals("hearth.drop_client_headers"),
            client,
            "{}",
            path.display()
        );
        // The sidecar removes x-hearth-fp itself; the rest go here.
        let own: Vec<String> = hearth_ext_proc::envoy::render::HEARTH_HEADERS
            .iter()
            .filter(|h| **h != hearth_wire::header::FP)
            .map(|h| h.to_string())
            .collect();
        assert_eq!(
            removals("hearth.drop_hearth_headers"),
            own,
            "{}",
            path.display()
        );
        let text = serde_json::to_string(doc).unwrap();
        for allowed in [
            r#"{"exact":":method"}"#,
            r#"{"exact":":path"}"#,
            r#"{"prefix":"x-hearth-"}"#,
            r#"{"exact":"x-gateway-destination-endpoint-subset"}"#,
        ] {
            assert!(
                text.contains(allowed),
                "{}: allow-list lacks {allowed}",
                path.display()
            );
        }
        assert!(
            !text.contains(r#"{"exact":"authorization"}"#),
            "{}",
            path.display()
        );
    }
    assert_eq!(meshes, 2, "the Istio and Envoy Gateway manifests");
    for name in ["gateway.yaml", "gateway-body.yaml", "gateway-gie.yaml"] {
        let yaml = std::fs::read_to_string(root().join("envoy").join(name)).unwrap();
        let v: Value = serde_norway::from_str(&yaml).unwrap();
        assert!(yaml.contains("forward_rules:"), "{name}");
        for cluster in v["static_resources"]["clusters"].as_array().unwrap() {
            let name_of = cluster["name"].as_str().unwrap();
            if !name_of.starts_with("hearth_sidecar") {
                continue;
            }
            for ep in cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
                .as_array()
                .unwrap()
            {
                let sa = &ep["endpoint"]["address"]["socket_address"];
                let ip: std::net::IpAddr = sa["address"].as_str().unwrap().parse().unwrap();
                assert!(
                    ip.is_loopback() || yaml.contains("initial_metadata"),
                    "{name}: {name_of} reaches {ip} without the token"
                );
                assert!(CONTROL_PORTS.contains(&(sa["port_value"].as_u64().unwrap() as u16)));
            }
        }
    }
}

/// Every HTTP filter a manifest adds (a mapping with a `name` and a
/// `typed_config`), in document order, with its header_mutation removals.
fn http_filters_in(v: &Value, out: &mut Vec<(String, Vec<String>)>) {
    match v {
        Value::Object(map) => {
            if let (Some(Value::String(name)), Some(config)) =
                (map.get("name"), map.get("typed_config"))
            {
                if config["@type"]
                    .as_str()
                    .is_some_and(|t| t.contains("envoy.extensions.filters.http."))
                {
                    let removals = config["mutations"]["request_mutations"]
                        .as_array()
                        .map(|m| {
                            m.iter()
                                .filter_map(|r| r["remove"].as_str().map(String::from))
                                .collect()
                        })
                        .unwrap_or_default();
                    out.push((name.clone(), removals));
                }
            }
            for x in map.values() {
                http_filters_in(x, out);
            }
        }
        Value::Array(items) => {
            for x in items {
                http_filters_in(x, out);
            }
        }
        _ => {}
    }
}

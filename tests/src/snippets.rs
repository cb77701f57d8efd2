//! `envoy/snippets/` applied to an Envoy configuration the way
//! `envoy/snippets/README.md` tells an operator to, on parsed YAML: the
//! tests check the shipped gateway and a configuration of another shape
//! with it.

use hearth_ext_proc::envoy::render::snippets::{self, Place, Snippet};
use serde_norway::Value;

/// The connection manager's filter name.
pub const HCM: &str = "envoy.filters.network.http_connection_manager";

/// Applies every snippet (the optional one included) to `config`, filled
/// with `values`.
pub fn apply_all(config: &mut Value, values: &[(&str, String)]) {
    for s in snippets::ALL {
        apply(config, &s, values);
    }
}

/// Applies one snippet where its [`Place`] says: filters before the
/// router of every connection manager, fields merged into every
/// connection manager, into each route to the cluster the snippet names
/// and into that cluster (dropping its `lb_policy`), clusters added.
/// Panics when the place is not in `config`.
pub fn apply(config: &mut Value, snippet: &Snippet, values: &[(&str, String)]) {
    let piece: Value = serde_norway::from_str(&snippet.fill(values))
        .unwrap_or_else(|e| panic!("{}: not YAML once filled: {e}", snippet.file));
    match snippet.place {
        Place::HttpFilters => {
            let entries = piece.as_sequence().expect("a list of filters");
            for hcm in connection_managers(config) {
                let chain = hcm["http_filters"].as_sequence_mut().expect("http_filters");
                let router = chain
                    .iter()
                    .position(|f| f["name"] == "envoy.filters.http.router")
                    .expect("a router in the filter chain");
                for (i, entry) in entries.iter().enumerate() {
                    chain.insert(router + i, entry.clone());
                }
            }
        }
        Place::ConnectionManager => {
            for hcm in connection_managers(config) {
                merge(hcm, &piece);
            }
        }
        Place::Route => {
            let cluster = piece["route"]["cluster"].clone();
            let mut merged = 0;
            for hcm in connection_managers(config) {
                for host in hcm["route_config"]["virtual_hosts"]
                    .as_sequence_mut()
                    .expect("virtual_hosts")
                {
                    for route in host["routes"].as_sequence_mut().expect("routes") {
                        if route["route"]["cluster"] == cluster {
                            merge(route, &piece);
                            merged += 1;
                        }
                    }
                }
            }
            assert!(merged > 0, "no route sends to {cluster:?}");
        }
        Place::EnginesCluster => {
            let cluster = clusters(config)
                .iter_mut()
                .find(|c| c["name"] == piece["name"])
                .unwrap_or_else(|| panic!("no cluster {:?}", piece["name"]));
            cluster
                .as_mapping_mut()
                .expect("a cluster")
                .remove("lb_policy");
            merge(cluster, &piece);
        }
        Place::Clusters => {
            let entries = piece.as_sequence().expect("a list of clusters");
            clusters(config).extend(entries.iter().cloned());
        }
    }
}

/// Every HTTP connection manager's `typed_config`.
pub fn connection_managers(config: &mut Value) -> Vec<&mut Value> {
    config["static_resources"]["listeners"]
        .as_sequence_mut()
        .expect("listeners")
        .iter_mut()
        .flat_map(|l| {
            l["filter_chains"]
                .as_sequence_mut()
                .expect("filter_chains")
                .iter_mut()
        })
        .flat_map(|c| c["filters"].as_sequence_mut().expect("filters").iter_mut())
        .filter(|f| f["name"] == HCM)
        .map(|f| &mut f["typed_config"])
        .collect()
}

/// `static_resources.clusters`.
pub fn clusters(config: &mut Value) -> &mut Vec<Value> {
    config["static_resources"]["clusters"]
        .as_sequence_mut()
        .expect("clusters")
}

/// Merges `from` into `into`: mappings key by key, lists appended, any
/// other value replaced.
pub fn merge(into: &mut Value, from: &Value) {
    match (into, from) {
        (Value::Mapping(into), Value::Mapping(from)) => {
            for (key, value) in from {
                match into.get_mut(key) {
                    Some(existing) => merge(existing, value),
                    None => {
                        into.insert(key.clone(), value.clone());
                    }
                }
            }
        }
        (Value::Sequence(into), Value::Sequence(from)) => into.extend(from.iter().cloned()),
        (into, from) => *into = from.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_recurses_into_mappings_appends_lists_and_replaces_the_rest() {
        let mut into: Value =
            serde_norway::from_str("{a: {b: 1, c: [x]}, d: old, keep: 1}").unwrap();
        let from: Value = serde_norway::from_str("{a: {b: 2, c: [y]}, d: new, e: 3}").unwrap();
        merge(&mut into, &from);
        let want: Value =
            serde_norway::from_str("{a: {b: 2, c: [x, y]}, d: new, keep: 1, e: 3}").unwrap();
        assert_eq!(into, want);
    }
}

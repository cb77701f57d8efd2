//! The sidecar's layout holds: no import circle between the modules of
//! `ext-proc/src` or of `ext-proc/router/src`, and the router crate
//! depends on no runtime or protocol crate. (`scripts/test` also checks
//! the router's whole dependency tree with `cargo tree`.) The router
//! reads the wall clock only in `clock.rs`, its thin wrappers for the
//! sidecar: everything else takes `now`.
//!
//! A module's imports are the `crate::` and `super::` paths in its file
//! outside comments and its `#[cfg(test)]` part; a path names the deepest
//! module it reaches (a path to the crate root's re-exports names the
//! root, so a module that imports through them depends on every module
//! the root re-exports from).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Module path (`["envoy", "service"]`) → its file's code.
fn modules(src: &Path) -> BTreeMap<Vec<String>, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("read src") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path.strip_prefix(src).expect("under src");
            let mut parts: Vec<String> = rel
                .with_extension("")
                .iter()
                .map(|p| p.to_string_lossy().into_owned())
                .collect();
            if matches!(
                parts.last().map(String::as_str),
                Some("mod" | "lib" | "main")
            ) {
                parts.pop();
            }
            let text = std::fs::read_to_string(&path).expect("read module");
            // Tests may reach anywhere; the layout is about the code.
            let code = text.split("#[cfg(test)]").next().unwrap_or("");
            let code: String = code
                .lines()
                .filter(|l| !l.trim_start().starts_with("//"))
                .collect::<Vec<_>>()
                .join("\n");
            out.insert(parts, code);
        }
    }
    out
}

/// Every `crate::a::b` / `super::a` path in `code`, as the module path it
/// starts from and its segments.
fn paths(module: &[String], is_dir_module: bool, code: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    // `use x::{a, b::c}` groups: expand one level, enough for this code.
    let ident = |c: char| c.is_alphanumeric() || c == '_' || c == ':';
    let mut rest = code;
    while let Some(at) = rest.find(['c', 's']) {
        let tail = &rest[at..];
        let boundary = rest[..at]
            .chars()
            .next_back()
            .is_none_or(|c| !(c.is_alphanumeric() || c == '_'));
        let (prefix, base): (&str, Vec<String>) = if boundary && tail.starts_with("crate::") {
            ("crate::", Vec::new())
        } else if boundary && tail.starts_with("super::") {
            // A file `a/b.rs` is module a::b, whose `super` is a; a
            // `a/mod.rs` is module a, whose `super` is a's parent.
            let mut parent = module.to_vec();
            if !is_dir_module || !parent.is_empty() {
                parent.pop();
            }
            ("super::", parent)
        } else {
            rest = &rest[at + 1..];
            continue;
        };
        let body = &tail[prefix.len()..];
        let end = body.find(|c: char| !ident(c)).unwrap_or(body.len());
        let head: Vec<String> = body[..end]
            .split("::")
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect();
        let mut full = base.clone();
        full.extend(head.iter().cloned());
        if body[end..].starts_with('{') {
            let close = body[end..].find('}').map_or(body.len(), |c| end + c);
            for item in body[end + 1..close].split(',') {
                let item = item.trim();
                let item_end = item.find(|c: char| !ident(c)).unwrap_or(item.len());
                let mut p = full.clone();
                p.extend(
                    item[..item_end]
                        .split("::")
                        .filter(|s| !s.is_empty() && *s != "self")
                        .map(str::to_string),
                );
                out.push(p);
            }
        } else {
            out.push(full);
        }
        rest = &body[end..];
    }
    out
}

/// Module → modules it imports from (itself excluded).
fn graph(src: &Path) -> BTreeMap<Vec<String>, BTreeSet<Vec<String>>> {
    let files = modules(src);
    let dir_modules: BTreeSet<Vec<String>> = files
        .keys()
        .filter(|m| {
            let mut p: PathBuf = src.to_path_buf();
            p.extend(m.iter());
            m.is_empty() || p.join("mod.rs").exists()
        })
        .cloned()
        .collect();
    let mut g = BTreeMap::new();
    for (module, code) in &files {
        let mut deps = BTreeSet::new();
        for path in paths(module, dir_modules.contains(module), code) {
            // The deepest module the path reaches.
            let mut target = path.clone();
            while !files.contains_key(&target) {
                target.pop();
            }
            if &target != module {
                deps.insert(target);
            }
        }
        g.insert(module.clone(), deps);
    }
    g
}

/// A cycle through the graph, if there is one.
fn cycle(g: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>) -> Option<Vec<String>> {
    fn visit(
        g: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
        node: &Vec<String>,
        stack: &mut Vec<Vec<String>>,
        done: &mut BTreeSet<Vec<String>>,
    ) -> Option<Vec<String>> {
        if let Some(at) = stack.iter().position(|n| n == node) {
            let mut c: Vec<String> = stack[at..].iter().map(|m| name(m)).collect();
            c.push(name(node));
            return Some(c);
        }
        if done.contains(node) {
            return None;
        }
        stack.push(node.clone());
        for dep in g.get(node).into_iter().flatten() {
            if let Some(c) = visit(g, dep, stack, done) {
                return Some(c);
            }
        }
        stack.pop();
        done.insert(node.clone());
        None
    }
    let mut done = BTreeSet::new();
    for node in g.keys() {
        if let Some(c) = visit(g, node, &mut Vec::new(), &mut done) {
            return Some(c);
        }
    }
    None
}

fn name(m: &[String]) -> String {
    if m.is_empty() {
        "crate".into()
    } else {
        m.join("::")
    }
}

fn dir(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

#[test]
fn the_checker_finds_a_circle_and_resolves_paths() {
    let g: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = [
        (vec!["a".to_string()], [vec!["b".to_string()]].into()),
        (vec!["b".to_string()], [vec!["a".to_string()]].into()),
    ]
    .into();
    assert_eq!(cycle(&g), Some(vec!["a".into(), "b".into(), "a".into()]));
    let m = vec!["envoy".to_string(), "service".to_string()];
    let found = paths(
        &m,
        false,
        "use crate::observe::{self, Observer};\nuse super::headers;\nlet x = crate::config::seconds(1.0);",
    );
    assert!(found.contains(&vec!["observe".to_string()]));
    assert!(found.contains(&vec!["observe".to_string(), "Observer".to_string()]));
    assert!(found.contains(&vec!["envoy".to_string(), "headers".to_string()]));
    assert!(found.contains(&vec!["config".to_string(), "seconds".to_string()]));
}

#[test]
fn no_import_circle_in_the_sidecar_or_the_router() {
    for src in ["src", "router/src"] {
        let g = graph(&dir(src));
        assert!(g.len() > 8, "{src}: found only {} modules", g.len());
        if let Some(c) = cycle(&g) {
            panic!("{src}: import circle {}", c.join(" -> "));
        }
    }
    // The rooms are where the layout says.
    let g = graph(&dir("src"));
    for room in ["config", "envoy", "feeds", "observe"] {
        assert!(g.contains_key(&vec![room.to_string()]), "{room}");
    }
}

#[test]
fn the_router_depends_on_no_runtime_or_protocol() {
    let manifest = std::fs::read_to_string(dir("router/Cargo.toml")).expect("router manifest");
    let deps: Vec<&str> = manifest
        .split("[dependencies]")
        .nth(1)
        .expect("[dependencies]")
        .split("\n[")
        .next()
        .unwrap_or("")
        .lines()
        .filter_map(|l| l.split(['.', ' ', '=']).next())
        .filter(|n| !n.is_empty() && !n.starts_with('#'))
        .collect();
    assert!(!deps.is_empty());
    for d in &deps {
        assert!(
            ["hearth-wire", "serde"].contains(d),
            "the router crate depends on {d}: it holds the decision only"
        );
    }
}

/// The ways Rust code reads the wall clock.
const CLOCK_READS: [&str; 4] = ["Instant::now", "SystemTime::now", "UNIX_EPOCH", ".elapsed("];

#[test]
fn the_router_reads_the_clock_only_in_its_wrappers() {
    let modules = modules(&dir("router/src"));
    assert!(modules.len() > 8, "found only {} modules", modules.len());
    let clock = vec!["clock".to_string()];
    assert!(
        modules
            .get(&clock)
            .is_some_and(|c| c.contains("Instant::now()")),
        "router/src/clock.rs holds the wall-clock wrappers"
    );
    for (module, code) in &modules {
        if *module == clock {
            continue;
        }
        for read in CLOCK_READS {
            assert!(
                !code.contains(read),
                "router module {} reads the wall clock ({read}): take `now` as an argument, \
                 and give the sidecar a wrapper in clock.rs",
                name(module)
            );
        }
    }
}

#[test]
fn the_sidecar_leaves_the_simulators_entry_point_alone() {
    // `Router::decide_knowing_at` exists only with the router's
    // `simulation` feature, which the benchmark enables: the sidecar's
    // manifest never does, so a sidecar built on its own (its release
    // build, its image) cannot call it, and its code never names it.
    let manifest = std::fs::read_to_string(dir("Cargo.toml")).expect("sidecar manifest");
    assert!(
        !manifest.contains("simulation"),
        "ext-proc/Cargo.toml enables the router's simulation feature"
    );
    for (module, code) in modules(&dir("src")) {
        assert!(
            !code.contains("decide_knowing"),
            "sidecar module {} calls the simulator's entry point",
            name(&module)
        );
    }
    let router = std::fs::read_to_string(dir("router/src/decide/mod.rs")).expect("decide");
    assert!(router.contains("#[cfg(feature = \"simulation\")]\nmod simulation;"));
}

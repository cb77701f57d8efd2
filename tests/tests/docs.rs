//! The documentation holds together: the README is a front door of at most
//! 250 lines that links every page under `docs/`, ARCHITECTURE.md and
//! SECURITY.md, and every relative link in the repository's Markdown names
//! a file that exists (and, into a Markdown file, one of its headings).

use std::collections::BTreeSet;
use std::path::{Component, Path, PathBuf};

const README_MAX_LINES: usize = 250;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every Markdown file of the repository, as a path from its root; build
/// output (`target/`) and tool folders (`.git/`, `.venv/`, `.hearth/`) are
/// not documentation.
fn markdown_files() -> Vec<PathBuf> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(root.join(dir)).unwrap() {
            let entry = entry.unwrap();
            let name = entry.file_name().to_string_lossy().into_owned();
            let path = dir.join(&name);
            let kind = entry.file_type().unwrap();
            if kind.is_dir() {
                if !name.starts_with('.') && name != "target" {
                    walk(root, &path, out);
                }
            } else if kind.is_file() && name.ends_with(".md") {
                out.push(path);
            }
        }
    }
    let mut out = Vec::new();
    walk(&root(), Path::new(""), &mut out);
    out.sort();
    out
}

/// The text outside fenced code blocks, each of them blanked out (newlines
/// kept, so line numbers still hold).
fn outside_fences(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut fenced = false;
    for line in text.split_inclusive('\n') {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            out.push('\n');
        } else if fenced {
            out.push('\n');
        } else {
            out.push_str(line);
        }
    }
    out
}

/// The text outside fenced code blocks and inline code spans, both blanked
/// out as in [`outside_fences`].
fn prose(text: &str) -> String {
    let out = outside_fences(text);
    // Inline code: a run of n backticks opens a span that the next run of
    // n closes; a blank line ends the paragraph and any span left open.
    let chars: Vec<char> = out.chars().collect();
    let mut result = String::with_capacity(out.len());
    let mut open: Option<usize> = None;
    let mut i = 0;
    while i < chars.len() {
        if chars[i] == '`' {
            let run = chars[i..].iter().take_while(|c| **c == '`').count();
            match open {
                None => open = Some(run),
                Some(n) if n == run => open = None,
                Some(_) => {}
            }
            result.extend(std::iter::repeat_n(' ', run));
            i += run;
            continue;
        }
        if chars[i] == '\n' && chars.get(i + 1) == Some(&'\n') {
            open = None;
        }
        result.push(if open.is_some() && chars[i] != '\n' {
            ' '
        } else {
            chars[i]
        });
        i += 1;
    }
    result
}

/// The targets of inline links and images, `[text](target)`, with their
/// line numbers.
fn links(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (n, line) in prose(text).lines().enumerate() {
        let mut rest = line;
        while let Some(at) = rest.find("](") {
            rest = &rest[at + 2..];
            let end = rest.find(')').unwrap_or(rest.len());
            let target = rest[..end].split_whitespace().next().unwrap_or("");
            let target = target.trim_start_matches('<').trim_end_matches('>');
            out.push((n + 1, target.to_string()));
            rest = &rest[end..];
        }
    }
    out
}

/// The anchors GitHub gives a file's headings: lower case, characters
/// other than letters, digits, `-`, `_` and spaces dropped, spaces turned
/// into `-`; a repeated anchor gets `-1`, `-2`, ...
fn anchors(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in outside_fences(text).lines() {
        let hashes = line.chars().take_while(|c| *c == '#').count();
        if !(1..=6).contains(&hashes) || !line[hashes..].starts_with(' ') {
            continue;
        }
        let slug: String = line[hashes..]
            .trim()
            .to_lowercase()
            .chars()
            .filter(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | ' '))
            .map(|c| if c == ' ' { '-' } else { c })
            .collect();
        let mut candidate = slug.clone();
        let mut k = 0;
        while out.contains(&candidate) {
            k += 1;
            candidate = format!("{slug}-{k}");
        }
        out.insert(candidate);
    }
    out
}

/// `base/../x` and `./x` spelled as a plain relative path.
fn normalise(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            Component::CurDir => {}
            Component::ParentDir => {
                if !out.pop() {
                    out.push("..");
                }
            }
            other => out.push(other),
        }
    }
    out
}

/// The repository paths (and anchors) that `file`'s relative links name.
fn relative_links(file: &Path) -> Vec<(usize, PathBuf, Option<String>)> {
    let text = read(&root().join(file));
    let dir = file.parent().unwrap_or(Path::new(""));
    links(&text)
        .into_iter()
        .filter(|(_, t)| !t.contains("://") && !t.starts_with("mailto:"))
        .map(|(line, target)| {
            let (path, anchor) = match target.split_once('#') {
                Some((p, a)) => (p.to_string(), Some(a.to_string())),
                None => (target, None),
            };
            let path = if path.is_empty() {
                file.to_path_buf()
            } else {
                normalise(&dir.join(path))
            };
            (line, path, anchor)
        })
        .collect()
}

#[test]
fn the_link_reader_skips_code_and_spells_anchors_as_github_does() {
    let text = "# Closing the loop: the engines' usage\n\
                See [a](docs/a.md) and ![b](img/b.svg \"title\"), not `[c](d)`\n\
                nor a span `over\ntwo lines [e](f)` either.\n\n\
                ```sh\n[g](h)\n# not a heading\n```\n\
                ## `--flag` and more\n## `--flag` and more\n";
    let found: Vec<String> = links(text).into_iter().map(|(_, t)| t).collect();
    assert_eq!(found, ["docs/a.md", "img/b.svg"]);
    let expected: BTreeSet<String> = [
        "closing-the-loop-the-engines-usage",
        "--flag-and-more",
        "--flag-and-more-1",
    ]
    .into_iter()
    .map(String::from)
    .collect();
    assert_eq!(anchors(text), expected);
    assert_eq!(
        normalise(Path::new("docs/../envoy/./snippets/README.md")),
        Path::new("envoy/snippets/README.md")
    );
}

#[test]
fn the_readme_is_a_front_door_of_at_most_250_lines() {
    let lines = read(&root().join("README.md")).lines().count();
    assert!(
        lines <= README_MAX_LINES,
        "README.md has {lines} lines; at most {README_MAX_LINES}: move the detail to a page under docs/ and link it"
    );
}

#[test]
fn the_readme_links_every_docs_page_architecture_and_security() {
    let linked: BTreeSet<PathBuf> = relative_links(Path::new("README.md"))
        .into_iter()
        .map(|(_, path, _)| path)
        .collect();
    let mut pages: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .unwrap()
        .map(|e| Path::new("docs").join(e.unwrap().file_name()))
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    assert!(!pages.is_empty(), "docs/ holds no page");
    pages.push("ARCHITECTURE.md".into());
    pages.push("SECURITY.md".into());
    let unlinked: Vec<&PathBuf> = pages.iter().filter(|p| !linked.contains(*p)).collect();
    assert!(unlinked.is_empty(), "README.md does not link {unlinked:?}");
}

#[test]
fn every_relative_link_in_the_markdown_names_a_file_and_heading_that_exist() {
    let files = markdown_files();
    assert!(files.iter().any(|f| f == Path::new("README.md")));
    let mut problems = Vec::new();
    let mut checked = 0;
    for file in &files {
        for (line, path, anchor) in relative_links(file) {
            checked += 1;
            let at = format!("{}:{line}", file.display());
            let full = root().join(&path);
            if !full.exists() {
                problems.push(format!("{at}: {} does not exist", path.display()));
                continue;
            }
            let Some(anchor) = anchor else { continue };
            if path.extension().is_none_or(|e| e != "md") {
                continue;
            }
            if !anchors(&read(&full)).contains(&anchor) {
                problems.push(format!("{at}: {} has no heading #{anchor}", path.display()));
            }
        }
    }
    assert!(checked > 0, "no relative link found in {files:?}");
    assert!(problems.is_empty(), "broken links: {problems:#?}");
}

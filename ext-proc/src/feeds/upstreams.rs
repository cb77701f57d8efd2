//! The replica list from `HEARTH_UPSTREAMS_FILE`: read when the sidecar
//! starts, and reloaded while it runs, when the file's contents change
//! (checked every `HEARTH_UPSTREAMS_POLL_SECONDS`) or on SIGHUP.
//!
//! A reload keeps what the fleet learned: a replica at an address (and
//! rank) already listed keeps its warmth, load and health (see
//! [`Router::set_upstreams`]). A file that does not read, parse or check
//! is refused as a whole: the list stays as it was, and the log, the state
//! endpoint and the metrics say why.
//!
//! The file holds one upstream per line in the `HEARTH_UPSTREAMS` syntax
//! (`ip:port[;id=NAME][;model=M][;tag=long][;dp=N][;profile=short-output]`);
//! `#` starts a comment; a line may also hold several comma-separated
//! upstreams, so a `HEARTH_UPSTREAMS` value pasted in works as it is.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;

use crate::config::{check_upstreams, UpstreamSpec};
use hearth_router::{ReloadSummary, Router};

/// Parses a replica-list file's text; every problem is reported, with its
/// line number.
pub fn parse(text: &str, source: &str) -> Result<Vec<UpstreamSpec>, Vec<String>> {
    let mut list = Vec::new();
    let mut problems = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or_default();
        for entry in line.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            match entry.parse::<UpstreamSpec>() {
                Ok(spec) => list.push(spec),
                Err(e) => problems.push(format!("{source} line {}: {e}", n + 1)),
            }
        }
    }
    if problems.is_empty() {
        problems = check_upstreams(&list, source);
    }
    if problems.is_empty() {
        Ok(list)
    } else {
        Err(problems)
    }
}

/// The file's bytes, or why it could not be read.
fn read_bytes(path: &Path) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("reading {}: {e}", path.display()))
}

fn parse_bytes(bytes: &[u8], path: &Path) -> Result<Vec<UpstreamSpec>, Vec<String>> {
    let source = path.display().to_string();
    let text = std::str::from_utf8(bytes).map_err(|_| vec![format!("{source} is not UTF-8")])?;
    parse(text, &source)
}

/// Reads and checks the file, for the sidecar's start.
pub fn read(path: &Path) -> Result<Vec<UpstreamSpec>, Vec<String>> {
    parse_bytes(&read_bytes(path).map_err(|e| vec![e])?, path)
}

/// What one reload attempt did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reload {
    /// The file reads as it did last time (and no reload was asked for).
    Unchanged,
    /// The list was replaced.
    Applied(ReloadSummary),
    /// The file was refused; the list stays. Why, in one line.
    Refused(String),
}

/// Reloads the router's replica list from a file, once per change.
pub struct Reloader {
    router: Arc<Router>,
    path: PathBuf,
    /// What the file held (or why it could not be read) at the last
    /// attempt, applied or refused: the same contents are not retried (nor
    /// logged again) until they change or a reload is asked for.
    last: Result<Vec<u8>, String>,
}

impl Reloader {
    /// A reloader whose router was built from the file's current contents.
    pub fn new(router: Arc<Router>, path: PathBuf) -> Reloader {
        let last = read_bytes(&path);
        Reloader { router, path, last }
    }

    /// Reads the file and, if it changed since the last attempt (or
    /// `forced`, as on SIGHUP), applies it or refuses it.
    pub fn reload(&mut self, forced: bool) -> Reload {
        let now = read_bytes(&self.path);
        if now == self.last && !forced {
            return Reload::Unchanged;
        }
        self.last = now.clone();
        let parsed = now
            .map_err(|e| vec![e])
            .and_then(|bytes| parse_bytes(&bytes, &self.path));
        match parsed {
            Ok(list) => {
                let summary = self.router.set_upstreams(&list);
                tracing::info!(
                    file = %self.path.display(),
                    %summary,
                    "replica list reloaded"
                );
                Reload::Applied(summary)
            }
            Err(problems) => {
                let why = problems.join("; ");
                tracing::warn!(
                    file = %self.path.display(),
                    error = %why,
                    "replica list not reloaded; keeping the current one"
                );
                self.router.note_reload_error(why.clone());
                Reload::Refused(why)
            }
        }
    }
}

/// Reloads every `poll` (when above zero) and whenever `asked` is
/// notified (SIGHUP), until the task is dropped.
pub async fn watch(mut reloader: Reloader, poll: Duration, asked: Arc<Notify>) {
    loop {
        let forced = if poll.is_zero() {
            asked.notified().await;
            true
        } else {
            tokio::select! {
                _ = asked.notified() => true,
                _ = tokio::time::sleep(poll) => false,
            }
        };
        reloader.reload(forced);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_comments_and_commas_parse() {
        let text = "\
# the fleet
10.0.0.1:8000;id=a;model=m   # first
10.0.0.2:8000;id=b,10.0.0.3:8000;tag=long

";
        let list = parse(text, "f").unwrap();
        assert_eq!(list.len(), 3);
        assert_eq!(list[0].id.as_deref(), Some("a"));
        assert_eq!(list[0].models, ["m"]);
        assert!(list[2].long);
    }

    #[test]
    fn every_problem_is_reported_with_its_line() {
        let err = parse(
            "10.0.0.1:8000\nengine:8000\n10.0.0.1:8001;colour=red\n",
            "f",
        )
        .unwrap_err();
        assert_eq!(err.len(), 2, "{err:?}");
        assert!(err[0].starts_with("f line 2: "), "{err:?}");
        assert!(err[1].starts_with("f line 3: "), "{err:?}");
        let err = parse("# nothing\n", "f").unwrap_err();
        assert_eq!(err, ["f names no replica"]);
        let err = parse("10.0.0.1:1\n10.0.0.1:1\n", "f").unwrap_err();
        assert_eq!(err, ["f lists 10.0.0.1:1 twice"]);
    }

    fn temp_file(name: &str, text: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("hearth-upstreams-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn a_reload_applies_changes_once_and_refuses_bad_files() {
        let path = temp_file("reload", "127.0.0.1:1;id=a\n127.0.0.1:2;id=b\n");
        let router = Router::new(
            hearth_router::RouterParams::default(),
            &read(&path).unwrap(),
        );
        let mut reloader = Reloader::new(Arc::clone(&router), path.clone());
        assert_eq!(reloader.reload(false), Reload::Unchanged);

        std::fs::write(&path, "127.0.0.1:2;id=b\n127.0.0.1:3;id=c\n").unwrap();
        let Reload::Applied(summary) = reloader.reload(false) else {
            panic!("not applied");
        };
        assert_eq!(
            (summary.added, summary.removed, summary.unchanged),
            (1, 1, 1)
        );
        assert_eq!(reloader.reload(false), Reload::Unchanged);
        let ids: Vec<String> = router
            .snapshot()
            .replicas
            .into_iter()
            .map(|r| r.id)
            .collect();
        assert_eq!(ids, ["b", "c"]);

        // A bad file is refused once (not again until it changes), and the
        // list stays.
        std::fs::write(&path, "127.0.0.1:4\nnot-an-address\n").unwrap();
        assert!(matches!(reloader.reload(false), Reload::Refused(e) if e.contains("line 2")));
        assert_eq!(reloader.reload(false), Reload::Unchanged);
        let snap = router.snapshot();
        assert_eq!(snap.replicas.len(), 2);
        assert_eq!(snap.upstreams.reload_errors_total, 1);
        assert!(snap.upstreams.reload_error.is_some());
        // A missing file is refused too.
        std::fs::remove_file(&path).unwrap();
        assert!(matches!(reloader.reload(false), Reload::Refused(e) if e.contains("reading")));
        assert_eq!(router.snapshot().replicas.len(), 2);
        // Fixed: applied, and the error clears.
        std::fs::write(&path, "127.0.0.1:2;id=b\n").unwrap();
        assert!(matches!(reloader.reload(false), Reload::Applied(_)));
        let snap = router.snapshot();
        assert_eq!(snap.replicas.len(), 1);
        assert_eq!(snap.upstreams.reload_error, None);
        // Asked for (SIGHUP) with the same contents: applied, no change.
        let Reload::Applied(summary) = reloader.reload(true) else {
            panic!("not applied");
        };
        assert!(!summary.changed());
    }
}

//! The decision journal: every decision with the numbers behind it, so
//! "why did this turn go there" has an answer (`GET /debug/decisions`).
//!
//! A bounded in-memory ring (`HEARTH_JOURNAL_SIZE` records) and, when
//! `HEARTH_JOURNAL_FILE` is set, one JSON line per decision appended to
//! that file by a writer thread, and one more per answer whose usage came
//! ([`ServedLine`]: the decision's line was written before the answer
//! existed; the two share the request id). The request path only hands
//! the line over; when the writer falls behind by [`FILE_QUEUE`] lines,
//! lines are dropped from the file and counted, never from the ring. The file
//! rotates: a line that would take it past `HEARTH_JOURNAL_FILE_MAX_BYTES`
//! goes to a new file, the full one becoming `PATH.1` (replacing the
//! previous `PATH.1`), so the journal takes at most twice that on disk.
//!
//! Privacy: a record holds hashes (hex), sizes, replica ids and scores;
//! never prompt text, never an engine's address.

use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};

use hearth_router::Correction;
use serde::{Deserialize, Serialize};

/// Lines waiting for the file writer before new ones are dropped.
pub const FILE_QUEUE: usize = 4096;

/// One candidate replica in a decision.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CandidateRecord {
    /// Opaque replica id.
    pub replica: String,
    /// Leading request blocks the replica held.
    pub overlap: u32,
    /// Credit under the affinity basis, in blocks.
    pub credit: f64,
    /// In-flight load before this request, in load units.
    pub load: f64,
    /// `credit - alpha * load`; the highest wins.
    pub score: f64,
}

/// One decision.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DecisionRecord {
    /// Unix time of the decision, milliseconds.
    pub time_ms: u64,
    /// Envoy's `x-request-id`.
    pub request_id: Option<String>,
    pub model: Option<String>,
    /// Canonical prompt bytes (0 when unknown).
    pub prompt_bytes: u64,
    /// Fingerprint length, in blocks (0: routed on load alone).
    pub blocks: usize,
    /// First and last block hash, 16 hex digits.
    pub first_hash: Option<String>,
    pub last_hash: Option<String>,
    pub basis: String,
    /// `routed`, `no_replica`, `no_healthy_replica` or `saturated`.
    pub outcome: String,
    /// Why it was refused, for the other outcomes.
    pub error: Option<String>,
    /// The chosen replica's id.
    pub chosen: Option<String>,
    /// Fallback replica ids, in order (Envoy retries them).
    pub fallbacks: Vec<String>,
    /// Blocks the chosen replica held.
    pub overlap: u32,
    /// `new`, `stay` or `move` (fingerprinted routed requests).
    pub session: Option<String>,
    /// The replica of the conversation's previous turn, when known.
    pub previous: Option<String>,
    /// Every candidate, as scored.
    pub candidates: Vec<CandidateRecord>,
    /// Time spent deciding, microseconds.
    pub decision_us: f64,
    /// Time the request waited in the flow-control queue before this
    /// decision (or before it was dropped), milliseconds; absent when it
    /// did not wait.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait_ms: Option<f64>,
    /// What the engine said it served, once the answer's usage came (in
    /// the ring; the file, which got the decision's line at decision time,
    /// gets a [`ServedLine`]).
    #[serde(default)]
    pub served: Option<ServedRecord>,
}

/// What an answer's usage said, next to the decision's prediction.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ServedRecord {
    /// The replica that answered (Envoy may have retried elsewhere).
    pub replica: String,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// Cached tokens the decision predicted, when the chosen replica
    /// answered.
    pub predicted_cached_tokens: Option<u64>,
    /// What the answer changed in the replica's warmth.
    pub correction: Option<Correction>,
}

/// An answer's usage as a line of the journal file, after its decision's
/// line (matched by `request_id`; a retried id names its newest decision).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ServedLine {
    /// When the usage came, Unix milliseconds.
    pub time_ms: u64,
    pub request_id: String,
    pub served: ServedRecord,
}

/// What the file writer is handed.
#[derive(Debug)]
enum FileLine {
    Decision(Arc<DecisionRecord>),
    Served(ServedLine),
}

impl FileLine {
    fn json(&self) -> serde_json::Result<Vec<u8>> {
        match self {
            FileLine::Decision(r) => serde_json::to_vec(&**r),
            FileLine::Served(s) => serde_json::to_vec(s),
        }
    }
}

pub fn hex(h: u64) -> String {
    format!("{h:016x}")
}

/// The ring and the optional file.
#[derive(Debug)]
pub struct Journal {
    size: usize,
    ring: Mutex<VecDeque<Arc<DecisionRecord>>>,
    file: Option<SyncSender<FileLine>>,
    dropped: Arc<AtomicU64>,
}

impl Journal {
    /// A journal of `size` records (0: no ring), appending to the file
    /// `(path, max_bytes)` when given, rotated at `max_bytes`. Fails when
    /// the file cannot be opened for appending.
    pub fn open(size: usize, file: Option<(&Path, u64)>) -> std::io::Result<Journal> {
        let dropped = Arc::new(AtomicU64::new(0));
        let file = match file {
            None => None,
            Some((path, max_bytes)) => {
                let out = RotatingFile::open(path, max_bytes)?;
                let (tx, rx) = sync_channel(FILE_QUEUE);
                let dropped = Arc::clone(&dropped);
                std::thread::Builder::new()
                    .name("hearth-journal".into())
                    .spawn(move || write_lines(rx, out, &dropped))?;
                Some(tx)
            }
        };
        Ok(Journal {
            size,
            ring: Mutex::new(VecDeque::with_capacity(size.min(1 << 16))),
            file,
            dropped,
        })
    }

    pub fn push(&self, record: DecisionRecord) {
        let record = Arc::new(record);
        self.to_file(|| FileLine::Decision(Arc::clone(&record)));
        if self.size == 0 {
            return;
        }
        let mut ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        if ring.len() == self.size {
            ring.pop_front();
        }
        ring.push_back(record);
    }

    /// Hands a line to the file writer, if there is a file (counted as
    /// dropped when the writer is [`FILE_QUEUE`] lines behind).
    fn to_file(&self, line: impl FnOnce() -> FileLine) {
        if let Some(tx) = &self.file {
            if let Err(TrySendError::Full(_)) = tx.try_send(line()) {
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Puts `served` next to the newest decision for `request_id` still
    /// in the ring without one, and writes it to the file at `time_ms`.
    pub fn attach_served(&self, request_id: &str, served: ServedRecord, time_ms: u64) {
        self.to_file(|| {
            FileLine::Served(ServedLine {
                time_ms,
                request_id: request_id.to_string(),
                served: served.clone(),
            })
        });
        let mut ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        let found = ring
            .iter_mut()
            .rev()
            .find(|r| r.request_id.as_deref() == Some(request_id) && r.served.is_none());
        if let Some(slot) = found {
            let mut record = (**slot).clone();
            record.served = Some(served);
            *slot = Arc::new(record);
        }
    }

    /// Records for `request_id`, newest first (a retried request id can
    /// have several).
    pub fn find(&self, request_id: &str) -> Vec<Arc<DecisionRecord>> {
        let ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        ring.iter()
            .rev()
            .filter(|r| r.request_id.as_deref() == Some(request_id))
            .cloned()
            .collect()
    }

    /// The latest `n` records, newest first.
    pub fn latest(&self, n: usize) -> Vec<Arc<DecisionRecord>> {
        let ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        ring.iter().rev().take(n).cloned().collect()
    }

    pub fn capacity(&self) -> usize {
        self.size
    }

    /// The count of records the file writer could not keep up with (for
    /// `/metrics`).
    pub fn file_dropped(&self) -> Arc<AtomicU64> {
        Arc::clone(&self.dropped)
    }
}

/// Where the writer thread puts whole lines.
trait Lines {
    /// Writes one line (`line` ends with its newline).
    fn line(&mut self, line: &[u8]) -> std::io::Result<()>;
    fn flush(&mut self) -> std::io::Result<()>;
}

impl<W: Write> Lines for W {
    fn line(&mut self, line: &[u8]) -> std::io::Result<()> {
        self.write_all(line)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Write::flush(self)
    }
}

/// The journal file, rotated by size: a line that would take it past
/// `max_bytes` is written to a fresh file after the full one is renamed
/// `PATH.1`.
struct RotatingFile {
    path: PathBuf,
    max_bytes: u64,
    /// Bytes in the current file (what it held when opened, plus ours).
    size: u64,
    /// `None` after a failed rotation: lines are refused (and counted as
    /// dropped) until a later rotation succeeds, so the bound holds.
    out: Option<BufWriter<File>>,
}

/// The journal file for appending, created readable by its owner only
/// (its lines name requests, models and replicas). An existing file keeps
/// its mode: the operator chose it.
fn append_to(path: &Path) -> std::io::Result<File> {
    let mut o = OpenOptions::new();
    o.create(true).append(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut o, 0o600);
    o.open(path)
}

impl RotatingFile {
    fn open(path: &Path, max_bytes: u64) -> std::io::Result<RotatingFile> {
        let f = append_to(path)?;
        let size = f.metadata()?.len();
        Ok(RotatingFile {
            path: path.to_path_buf(),
            max_bytes,
            size,
            out: Some(BufWriter::new(f)),
        })
    }

    /// `PATH.1`.
    fn previous(&self) -> PathBuf {
        let mut name = self.path.clone().into_os_string();
        name.push(".1");
        PathBuf::from(name)
    }

    fn rotate(&mut self) -> std::io::Result<()> {
        if let Some(mut out) = self.out.take() {
            Write::flush(&mut out)?;
        }
        std::fs::rename(&self.path, self.previous())?;
        let f = append_to(&self.path)?;
        self.size = 0;
        self.out = Some(BufWriter::new(f));
        Ok(())
    }
}

impl Lines for RotatingFile {
    fn line(&mut self, line: &[u8]) -> std::io::Result<()> {
        let len = line.len() as u64;
        if self.out.is_none() || (self.size > 0 && self.size + len > self.max_bytes) {
            if let Err(e) = self.rotate() {
                tracing::warn!(error = %e, "decision journal: rotating the file failed; lines are dropped until it succeeds");
                return Err(e);
            }
        }
        let out = self.out.as_mut().ok_or(std::io::ErrorKind::NotFound)?;
        out.write_all(line)?;
        self.size += len;
        Ok(())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        match self.out.as_mut() {
            Some(out) => Write::flush(out),
            None => Ok(()),
        }
    }
}

fn write_lines(rx: Receiver<FileLine>, mut out: impl Lines, dropped: &AtomicU64) {
    let write = |r: &FileLine, out: &mut dyn Lines| {
        let ok = r.json().is_ok_and(|mut line| {
            line.push(b'\n');
            out.line(&line).is_ok()
        });
        if !ok {
            dropped.fetch_add(1, Ordering::Relaxed);
        }
    };
    while let Ok(first) = rx.recv() {
        write(&first, &mut out);
        // Drain what is queued, then flush once.
        while let Ok(r) = rx.try_recv() {
            write(&r, &mut out);
        }
        if out.flush().is_err() {
            tracing::warn!("decision journal: flushing the file failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: &str) -> DecisionRecord {
        DecisionRecord {
            time_ms: 1,
            request_id: Some(id.into()),
            model: None,
            prompt_bytes: 0,
            blocks: 0,
            first_hash: None,
            last_hash: None,
            basis: "relative".into(),
            outcome: "routed".into(),
            error: None,
            chosen: Some("a".into()),
            fallbacks: vec![],
            overlap: 0,
            session: None,
            previous: None,
            candidates: vec![],
            decision_us: 1.0,
            wait_ms: None,
            served: None,
        }
    }

    #[test]
    fn the_ring_is_bounded_and_searchable() {
        let j = Journal::open(3, None).unwrap();
        for i in 0..5 {
            j.push(record(&format!("r{i}")));
        }
        let ids: Vec<_> = j
            .latest(10)
            .iter()
            .map(|r| r.request_id.clone().unwrap())
            .collect();
        assert_eq!(ids, ["r4", "r3", "r2"]);
        assert_eq!(j.find("r3").len(), 1);
        assert!(j.find("r0").is_empty(), "evicted");
        let off = Journal::open(0, None).unwrap();
        off.push(record("x"));
        assert!(off.latest(1).is_empty());
    }

    #[test]
    fn served_figures_go_next_to_the_newest_decision_of_their_request() {
        let j = Journal::open(8, None).unwrap();
        j.push(record("r1"));
        j.push(record("r1"));
        j.push(record("r2"));
        let served = |cached| ServedRecord {
            replica: "a".into(),
            prompt_tokens: 100,
            cached_tokens: cached,
            predicted_cached_tokens: Some(90),
            correction: None,
        };
        j.attach_served("r1", served(80), 5);
        let r1 = j.find("r1");
        assert_eq!(r1[0].served.as_ref().map(|s| s.cached_tokens), Some(80));
        assert_eq!(r1[1].served, None);
        // A second answer for the id goes to the older decision; an
        // unknown id changes nothing.
        j.attach_served("r1", served(70), 6);
        j.attach_served("nope", served(1), 7);
        let r1 = j.find("r1");
        assert_eq!(r1[1].served.as_ref().map(|s| s.cached_tokens), Some(70));
        assert_eq!(j.find("r2")[0].served, None);
    }

    #[test]
    fn the_file_gets_a_line_per_decision_and_one_per_answer() {
        let dir = std::env::temp_dir().join(format!("hearth-journal-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("decisions.jsonl");
        let _ = std::fs::remove_file(&path);
        // No ring: the file alone keeps what the answers served.
        let j = Journal::open(0, Some((&path, 1 << 20))).unwrap();
        for i in 0..3 {
            j.push(record(&format!("f{i}")));
        }
        let served = ServedRecord {
            replica: "a".into(),
            prompt_tokens: 100,
            cached_tokens: 64,
            predicted_cached_tokens: Some(60),
            correction: None,
        };
        j.attach_served("f1", served.clone(), 1_234);
        drop(j); // closes the channel; the writer drains and exits
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let text = loop {
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            if text.lines().count() == 4 || std::time::Instant::now() > deadline {
                break text;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 4, "{text}");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600, "the journal is its owner's alone");
        }
        let decisions: Vec<DecisionRecord> = lines[..3]
            .iter()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(decisions[2].request_id.as_deref(), Some("f2"));
        assert!(decisions.iter().all(|d| d.served.is_none()));
        let answer: ServedLine = serde_json::from_str(lines[3]).unwrap();
        assert_eq!(
            answer,
            ServedLine {
                time_ms: 1_234,
                request_id: "f1".into(),
                served,
            }
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_file_rotates_at_its_size_and_keeps_one_previous_file() {
        let dir = std::env::temp_dir().join(format!("hearth-rotate-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("decisions.jsonl");
        let previous = dir.join("decisions.jsonl.1");
        let _ = std::fs::remove_file(&path);
        let _ = std::fs::remove_file(&previous);
        let line = serde_json::to_vec(&record("r000")).unwrap().len() as u64 + 1;
        // Room for three lines per file; eleven lines go through it.
        let max = 3 * line + line / 2;
        let rx = {
            let (tx, rx) = sync_channel(16);
            for i in 0..11 {
                tx.send(FileLine::Decision(Arc::new(record(&format!("r{i:03}")))))
                    .unwrap();
            }
            rx
        };
        let dropped = AtomicU64::new(0);
        write_lines(rx, RotatingFile::open(&path, max).unwrap(), &dropped);
        assert_eq!(dropped.load(Ordering::Relaxed), 0);
        let ids = |p: &Path| -> Vec<String> {
            std::fs::read_to_string(p)
                .unwrap()
                .lines()
                .map(|l| serde_json::from_str::<DecisionRecord>(l).unwrap())
                .map(|r| r.request_id.unwrap())
                .collect()
        };
        // Whole lines only, each file within its bound, the newest last.
        assert_eq!(ids(&path), ["r009", "r010"]);
        assert_eq!(ids(&previous), ["r006", "r007", "r008"]);
        assert!(std::fs::metadata(&path).unwrap().len() <= max);
        assert!(std::fs::metadata(&previous).unwrap().len() <= max);
        // A restart appends to the current file and counts what it holds.
        let mut again = RotatingFile::open(&path, max).unwrap();
        assert_eq!(again.size, 2 * line);
        again.line(&[b'x'; 10]).unwrap();
        again.line(&vec![b'y'; 2 * line as usize]).unwrap();
        Lines::flush(&mut again).unwrap();
        assert_eq!(
            std::fs::read(&previous).unwrap().len() as u64,
            2 * line + 10
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn records_the_file_cannot_take_are_counted() {
        struct Full;
        impl Write for Full {
            fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
                Err(std::io::Error::other("disk full"))
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let (tx, rx) = std::sync::mpsc::sync_channel(4);
        for i in 0..3 {
            tx.send(FileLine::Decision(Arc::new(record(&format!("d{i}")))))
                .unwrap();
        }
        drop(tx);
        let dropped = AtomicU64::new(0);
        write_lines(rx, Full, &dropped);
        assert_eq!(dropped.load(Ordering::Relaxed), 3);
    }
}

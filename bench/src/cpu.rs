//! CPU time of the processes a benchmark started, from `/proc`: a
//! gateway on the same machine as its engines takes its CPU from theirs,
//! so the comparisons print what each router spent.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::process::Command;

/// Clock ticks per second (`getconf CLK_TCK`; 100 where that fails).
pub fn clock_ticks() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100.0)
}

/// The fields of `/proc/<pid>/stat` after the parenthesised command name
/// (which may hold spaces): index 0 is the state, 1 the parent's pid,
/// 11 and 12 utime and stime, 13 and 14 the waited-for children's.
fn stat_fields(pid: u32) -> Option<Vec<u64>> {
    let stat =
        std::fs::read_to_string(Path::new("/proc").join(pid.to_string()).join("stat")).ok()?;
    let rest = stat.rsplit_once(')')?.1;
    Some(
        rest.split_whitespace()
            .map(|v| v.parse::<u64>().unwrap_or(0))
            .collect(),
    )
}

/// utime + stime of one process, in seconds (0 once it is gone).
pub fn process_seconds(pid: u32, ticks: f64) -> f64 {
    stat_fields(pid).map_or(0.0, |f| {
        (f.get(11).copied().unwrap_or(0) + f.get(12).copied().unwrap_or(0)) as f64 / ticks
    })
}

/// CPU seconds of each root and every process below it now alive, from
/// one reading of `/proc`: each process's own time and its waited-for
/// children's, so a helper process that ended and was reaped still
/// counts (through its parent). 0 for a root that is gone.
pub fn tree_seconds(roots: &[u32], ticks: f64) -> Vec<f64> {
    let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
    let mut times: HashMap<u32, u64> = HashMap::new();
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for entry in dir.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            let Some(f) = stat_fields(pid) else { continue };
            let field = |i: usize| f.get(i).copied().unwrap_or(0);
            children.entry(field(1) as u32).or_default().push(pid);
            times.insert(pid, field(11) + field(12) + field(13) + field(14));
        }
    }
    roots
        .iter()
        .map(|&root| {
            let mut total = 0u64;
            let mut seen = HashSet::new();
            let mut stack = vec![root];
            while let Some(pid) = stack.pop() {
                if !seen.insert(pid) {
                    continue;
                }
                total += times.get(&pid).copied().unwrap_or(0);
                stack.extend(children.get(&pid).into_iter().flatten());
            }
            total as f64 / ticks
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_busy_child_is_counted_under_its_parent() {
        let ticks = clock_ticks();
        // A shell whose child spins, ends and is reaped; the shell then
        // becomes a sleep (its children's time stays with it).
        let mut shell = Command::new("sh")
            .args([
                "-c",
                "sh -c 'i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done'; exec sleep 30",
            ])
            .spawn()
            .expect("sh");
        let root = shell.id();
        let mut spun = 0.0;
        for _ in 0..200 {
            std::thread::sleep(std::time::Duration::from_millis(50));
            spun = tree_seconds(&[root], ticks)[0];
            if spun >= 0.05 {
                break;
            }
        }
        let own = process_seconds(root, ticks);
        let _ = shell.kill();
        let _ = shell.wait();
        assert!(
            spun >= 0.05,
            "the spinning grandchild's time counts: {spun} s"
        );
        assert!(
            own < spun,
            "the parent alone did little: {own} s of {spun} s"
        );
        assert_eq!(
            tree_seconds(&[u32::MAX], ticks),
            vec![0.0],
            "no such process"
        );
    }
}

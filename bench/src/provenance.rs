//! Which build ran a benchmark, and when: every report's header says
//! `# build abc1234, started 2026-12-05T19:01:35Z`, and its JSON carries
//! the same two fields, so a figure can be traced to the code that
//! produced it. The commit comes from `build.rs`.

use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

/// The commit this binary was built from (`abc1234`, or `abc1234 with
/// uncommitted changes`).
pub const BUILD: &str = env!("HEARTH_BENCH_BUILD");

static STARTED: OnceLock<String> = OnceLock::new();

/// When this run started, in UTC (fixed at the first call).
pub fn started_utc() -> &'static str {
    STARTED.get_or_init(|| {
        let secs = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        utc(secs)
    })
}

/// The report header line.
pub fn header() -> String {
    format!("# build {BUILD}, started {}", started_utc())
}

/// The same, for a JSON report.
pub fn json() -> serde_json::Value {
    serde_json::json!({ "build": BUILD, "started_utc": started_utc() })
}

/// Seconds since the Unix epoch as `YYYY-MM-DDTHH:MM:SSZ`.
fn utc(secs: u64) -> String {
    let (days, rest) = (secs / 86_400, secs % 86_400);
    let (year, month, day) = civil(days);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60
    )
}

/// The proleptic Gregorian date `days` after 1970-01-01. Counts in eras
/// of 400 years (146,097 days, the calendar's full cycle) from 0000-03-01,
/// so that the leap day falls at the end of each counted year.
fn civil(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468; // days from 0000-03-01 to 1970-01-01
    let era = z / 146_097;
    let doe = z % 146_097; // day of the era
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365; // year of the era
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100); // day of the year, from March 1
    let mp = (5 * doy + 2) / 153; // month, from March = 0
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_formats_epochs_leap_days_and_year_ends() {
        assert_eq!(utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(utc(1_796_494_073), "2026-12-05T18:07:53Z");
        assert_eq!(utc(4_102_444_799), "2099-12-31T23:59:59Z");
    }

    #[test]
    fn every_day_follows_the_one_before() {
        // Walks 1970-2100 day by day: the date only ever moves to the next
        // day of the month, or to the 1st of the next month or year, and
        // February has 29 days exactly in leap years.
        let mut prev = civil(0);
        for d in 1..47_482 {
            let (y, m, day) = civil(d);
            let (py, pm, pday) = prev;
            let next_day = (y, m, day) == (py, pm, pday + 1);
            let next_month = day == 1 && ((y, m) == (py, pm + 1) || (y, m, pm) == (py + 1, 1, 12));
            assert!(next_day || next_month, "{prev:?} -> {:?}", (y, m, day));
            if next_month && pm == 2 {
                let leap = py % 4 == 0 && (py % 100 != 0 || py % 400 == 0);
                assert_eq!(pday, if leap { 29 } else { 28 }, "February {py}");
            }
            prev = (y, m, day);
        }
    }

    #[test]
    fn the_header_names_the_build_and_a_start_time() {
        let h = header();
        assert!(h.starts_with(&format!("# build {BUILD}, started ")), "{h}");
        assert!(!BUILD.is_empty());
        assert_eq!(json()["started_utc"], started_utc());
    }
}

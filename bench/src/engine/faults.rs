//! Faults a simulated engine can be told to show, at start
//! ([`super::EngineConfig::fault`]) or at run time (`PUT /admin/fault`,
//! [`super::Engine::set_fault`]): the ways real engines fail that a plain
//! HTTP health check misses.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// How generation requests misbehave. `/health` and `/v1/models` always
/// answer normally: that is the point.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Fault {
    /// Behave.
    #[default]
    None,
    /// Wait this many extra milliseconds before answering.
    Slow { millis: u64 },
    /// Answer 500 with an OpenAI-shaped error.
    ServerError,
    /// Answer 503 with an OpenAI-shaped error.
    Unavailable,
    /// Never answer a generation request (the connection stays open until
    /// the client gives up): a scheduler that stopped running.
    Stall,
    /// Answer HTTP 200 with no generated text.
    Empty,
    /// Start a 200 answer, then reset the connection mid-body.
    Reset,
    /// Take the request, then close the connection without a byte of an
    /// answer: every generation request (`times: None`), or the next
    /// `times` of them, probes included, then behave.
    Close { times: Option<u64> },
}

impl FromStr for Fault {
    type Err = String;
    /// `none`, `slow:MILLIS`, `error`, `unavailable`, `stall`, `empty`,
    /// `reset`, `close`, `close:TIMES`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        Ok(match s {
            "none" => Fault::None,
            "error" => Fault::ServerError,
            "unavailable" => Fault::Unavailable,
            "stall" => Fault::Stall,
            "empty" => Fault::Empty,
            "reset" => Fault::Reset,
            "close" => Fault::Close { times: None },
            _ => {
                if let Some(ms) = s.strip_prefix("slow:") {
                    Fault::Slow {
                        millis: ms
                            .parse()
                            .map_err(|_| format!("bad milliseconds in {s:?}"))?,
                    }
                } else if let Some(n) = s.strip_prefix("close:") {
                    Fault::Close {
                        times: Some(n.parse().map_err(|_| format!("bad count in {s:?}"))?),
                    }
                } else {
                    return Err(format!(
                        "unknown fault {s:?}: expected none, slow:MILLIS, error, unavailable, stall, empty, reset, close or close:TIMES"
                    ));
                }
            }
        })
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fault::None => f.write_str("none"),
            Fault::Slow { millis } => write!(f, "slow:{millis}"),
            Fault::ServerError => f.write_str("error"),
            Fault::Unavailable => f.write_str("unavailable"),
            Fault::Stall => f.write_str("stall"),
            Fault::Empty => f.write_str("empty"),
            Fault::Reset => f.write_str("reset"),
            Fault::Close { times: None } => f.write_str("close"),
            Fault::Close { times: Some(n) } => write!(f, "close:{n}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_round_trip_through_text() {
        for f in [
            Fault::None,
            Fault::Slow { millis: 250 },
            Fault::ServerError,
            Fault::Unavailable,
            Fault::Stall,
            Fault::Empty,
            Fault::Reset,
            Fault::Close { times: None },
            Fault::Close { times: Some(3) },
        ] {
            assert_eq!(f.to_string().parse::<Fault>(), Ok(f));
        }
        assert!("slow:x".parse::<Fault>().is_err());
        assert!("close:x".parse::<Fault>().is_err());
        assert!("flaky".parse::<Fault>().unwrap_err().contains("stall"));
    }
}

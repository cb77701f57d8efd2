//! Envoy's words for how a request ended, in the router's: the response
//! status and Envoy's response code details (sent with the response
//! headers on the ext_proc stream) become a [`hearth_router::health::Ending`].

use hearth_router::health::Ending;
use hearth_wire::outcome::Answer;

/// How the request ended: `status` is the response's `:status` (0 when
/// unreadable), `details` Envoy's `response.code_details`, `answer` what a
/// scan of a 200 answer's body showed.
pub fn ending(status: u16, details: &str, answer: Option<Answer>) -> Ending {
    // Envoy could not connect, or the connection was reset before any
    // response byte: the engine's connection, not anything a request
    // asked for.
    let d = details;
    if d.contains("connection_failure")
        || d.contains("connection_termination")
        || d.contains("remote_reset")
        || d.contains("upstream_reset_before_response_started")
    {
        return Ending::ConnectionFailed;
    }
    if d.contains("timeout") {
        return Ending::TimedOut;
    }
    Ending::Answered { status, answer }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envoy_details_become_endings() {
        let ok = Some(Answer {
            text: true,
            done: true,
        });
        assert_eq!(
            ending(200, "via_upstream", ok),
            Ending::Answered {
                status: 200,
                answer: ok
            }
        );
        assert_eq!(
            ending(
                503,
                "upstream_reset_before_response_started{connection_failure}",
                None
            ),
            Ending::ConnectionFailed
        );
        assert_eq!(
            ending(
                503,
                "upstream_reset_before_response_started{remote_reset}",
                None
            ),
            Ending::ConnectionFailed
        );
        assert_eq!(ending(504, "response_timeout", None), Ending::TimedOut);
        assert_eq!(
            ending(500, "via_upstream", None),
            Ending::Answered {
                status: 500,
                answer: None
            }
        );
    }
}

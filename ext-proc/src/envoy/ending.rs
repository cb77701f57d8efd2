//! Envoy's words for how a request ended, in the router's: the response
//! status and Envoy's response code details (sent with the response
//! headers on the ext_proc stream) become a [`hearth_router::health::Ending`].

use hearth_router::health::Ending;
use hearth_wire::outcome::Answer;

/// How the request ended: `status` is the response's `:status` (0 when
/// unreadable), `details` Envoy's `response.code_details`, `answer` what a
/// scan of a 200 answer's body showed.
pub fn ending(status: u16, details: &str, answer: Option<Answer>) -> Ending {
    // Envoy could not connect: the engine's connection, nothing a request
    // asked for. The engine's side closed or reset a connection after
    // taking the request, before any response byte: the engine's too, but
    // an overloaded engine's server does that with requests it has not read
    // yet, and a request it cannot parse can end the same way, so it is
    // evidence to check, not proof. Resets of Envoy's own making (its
    // circuit breakers' `overflow`, a `local_reset`) say nothing about the
    // engine; a stream cut after the response started was reachable (its
    // answer is judged as it came).
    let d = details;
    if let Some(reason) = d.strip_prefix("upstream_reset_before_response_started") {
        return if reason.contains("connection_failure") {
            Ending::ConnectionFailed
        } else if reason.contains("connection_termination") || reason.contains("remote_reset") {
            Ending::ConnectionReset
        } else if reason.contains("protocol_error") {
            Ending::Answered { status, answer }
        } else {
            Ending::Unanswered
        };
    }
    if d.contains("upstream_reset_after_response_started") {
        return Ending::Answered { status, answer };
    }
    if d.contains("connection_failure") {
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
            Ending::ConnectionReset
        );
        assert_eq!(
            ending(
                503,
                "upstream_reset_before_response_started{connection_termination}",
                None
            ),
            Ending::ConnectionReset
        );
        // Envoy's own circuit breaker, Envoy's own reset: not the engine.
        for own in [
            "upstream_reset_before_response_started{overflow}",
            "upstream_reset_before_response_started{local_reset}",
        ] {
            assert_eq!(ending(503, own, None), Ending::Unanswered, "{own}");
        }
        // Cut after the response started: the engine was reachable; the
        // incomplete answer is judged as such.
        assert_eq!(
            ending(
                200,
                "upstream_reset_after_response_started{remote_reset}",
                None
            ),
            Ending::Answered {
                status: 200,
                answer: None
            }
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

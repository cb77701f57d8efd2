//! The engine's own scheduling priority, written into a request body by
//! the gateway (`HEARTH_ENGINE_PRIORITY`).
//!
//! vLLM (`--scheduling-policy priority`) and SGLang
//! (`--enable-priority-scheduling`) order the requests waiting for a
//! slot by a top-level integer `priority` member of the request. An
//! engine that schedules by it lets whoever writes that member choose
//! their place in its queue, so the gateway writes it itself: every
//! top-level member whose key decodes to `priority` is taken out (however
//! its key is escaped, and however many times it is repeated: JSON
//! parsers disagree on which of a repeated key wins) and one member with
//! the gateway's value is written first in the object.
//!
//! The body is read once, in place (the [`crate::json`] scan): what a
//! rewrite costs follows the body's bytes, and the new body is the old one
//! with members left out and one added, each kept member's bytes as sent.

use crate::json::Json;
use crate::SkipReason;

/// The member the engines schedule by.
pub const MEMBER: &str = "priority";

/// The request header that carries the value from the sidecar to the
/// filter that writes it into the body (never a client's: the filter
/// strips client `x-hearth-*` headers before the sidecar sees the
/// request).
pub const HEADER: &str = "x-hearth-engine-priority";

/// `body` (a JSON object) with its top-level `priority` members replaced
/// by one of `value`, written first. Anything but a valid JSON object is
/// refused (left to the engine to refuse as it would).
pub fn set_priority(body: &[u8], value: i64) -> Result<Vec<u8>, SkipReason> {
    let json = Json::new(body)?;
    let start = json.document()?;
    if json.at(start) != b'{' {
        return Err(SkipReason::NotJson);
    }
    let member = format!("\"{MEMBER}\":{value}");
    let mut out = Vec::with_capacity(body.len() + member.len() + 1);
    out.extend_from_slice(json.bytes(0, start + 1));
    out.extend_from_slice(member.as_bytes());
    // Each kept member as sent, from its key to the end of its value.
    let end = json.members(start, 0, |key, value| {
        let (value_end, _) = json.end_of(value);
        if !json.string_is(key, MEMBER) {
            out.push(b',');
            out.extend_from_slice(json.bytes(key, value_end));
        }
        Ok(value_end)
    })?;
    out.push(b'}');
    out.extend_from_slice(json.bytes(end, body.len()));
    Ok(out)
}

/// The value a sidecar's header carries: a decimal integer, nothing
/// else.
pub fn parse_header(value: &str) -> Option<i64> {
    let digits = value.strip_prefix('-').unwrap_or(value);
    if digits.is_empty() || digits.len() > 18 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    value.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn rewritten(body: &str, value: i64) -> Value {
        let out = set_priority(body.as_bytes(), value).expect("rewritten");
        serde_json::from_slice(&out).expect("still JSON")
    }

    #[test]
    fn the_gateways_value_is_the_only_priority_the_engine_reads() {
        let v = rewritten(
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
            3,
        );
        assert_eq!(v["priority"], 3);
        assert_eq!(v["model"], "m");
        assert_eq!(v["messages"][0]["content"], "hi");

        // A client's own, repeated or escaped, is gone; nested ones stay.
        let body = r#" { "priority": -100, "model":"m", "priorit\u0079" : -5,
            "metadata": {"priority": 1}, "priority":-7 } "#;
        let out = set_priority(body.as_bytes(), 2).unwrap();
        let text = String::from_utf8(out.clone()).unwrap();
        assert_eq!(text.matches("\"priority\"").count(), 2, "{text}");
        assert!(!text.contains("\\u0079"), "{text}");
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["priority"], 2);
        assert_eq!(v["metadata"]["priority"], 1);
        assert_eq!(v.as_object().unwrap().len(), 3);
    }

    #[test]
    fn an_empty_object_and_the_bodys_own_bytes() {
        assert_eq!(set_priority(b"{}", -4).unwrap(), b"{\"priority\":-4}");
        assert_eq!(
            set_priority(b"{\"priority\":1}\n", 0).unwrap(),
            b"{\"priority\":0}\n"
        );
        // Members' bytes as sent (spacing, number forms, escapes).
        let body = br#"{"a" : 1.50, "b":"\u00e9"}"#;
        assert_eq!(
            set_priority(body, 9).unwrap(),
            br#"{"priority":9,"a" : 1.50,"b":"\u00e9"}"#
        );
    }

    #[test]
    fn anything_but_a_json_object_is_refused() {
        for body in [
            "",
            "[1]",
            "\"priority\"",
            "{\"a\":1",
            "{\"a\":1}x",
            "{\"a\" 1}",
        ] {
            assert!(set_priority(body.as_bytes(), 1).is_err(), "{body:?}");
        }
    }

    #[test]
    fn the_header_is_a_decimal_integer() {
        assert_eq!(parse_header("0"), Some(0));
        assert_eq!(parse_header("-10007"), Some(-10007));
        for bad in ["", "-", "+1", "1.0", " 1", "1e3", "99999999999999999999"] {
            assert_eq!(parse_header(bad), None, "{bad:?}");
        }
    }
}

//! Canonical JSON: compact, keys sorted by bytes, one escaping of strings.
//!
//! Written by hand instead of `serde_json::to_writer` so the bytes do not
//! depend on serde_json features another crate may switch on (e.g.
//! `preserve_order` or `arbitrary_precision`).

use serde_json::{Number, Value};
use std::io::Write as _;

pub(crate) fn write_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::Null => out.extend_from_slice(b"null"),
        Value::Bool(true) => out.extend_from_slice(b"true"),
        Value::Bool(false) => out.extend_from_slice(b"false"),
        Value::Number(n) => write_number(out, n),
        Value::String(s) => write_string(out, s),
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_value(out, item);
            }
            out.push(b']');
        }
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
            out.push(b'{');
            for (i, (k, val)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_string(out, k);
                out.push(b':');
                write_value(out, val);
            }
            out.push(b'}');
        }
    }
}

fn write_number(out: &mut Vec<u8>, n: &Number) {
    // Writing into a Vec cannot fail.
    let _ = if let Some(i) = n.as_i64() {
        write!(out, "{i}")
    } else if let Some(u) = n.as_u64() {
        write!(out, "{u}")
    } else {
        // JSON has no NaN or infinity; a number too large for f64 parses as
        // infinity only under arbitrary_precision, written here as Rust does.
        write!(out, "{}", n.as_f64().unwrap_or(0.0))
    };
}

pub(crate) fn write_string(out: &mut Vec<u8>, s: &str) {
    out.push(b'"');
    let bytes = s.as_bytes();
    let mut start = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let esc: &[u8] = match b {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            0x08 => b"\\b",
            0x09 => b"\\t",
            0x0a => b"\\n",
            0x0c => b"\\f",
            0x0d => b"\\r",
            0x00..=0x1f => b"",
            _ => continue,
        };
        out.extend_from_slice(bytes.get(start..i).unwrap_or_default());
        if esc.is_empty() {
            const HEX: &[u8; 16] = b"0123456789abcdef";
            out.extend_from_slice(b"\\u00");
            out.push(HEX[usize::from(b >> 4)]);
            out.push(HEX[usize::from(b & 0xf)]);
        } else {
            out.extend_from_slice(esc);
        }
        start = i + 1;
    }
    out.extend_from_slice(bytes.get(start..).unwrap_or_default());
    out.push(b'"');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canon(s: &str) -> String {
        let v: Value = serde_json::from_str(s).unwrap();
        let mut out = Vec::new();
        write_value(&mut out, &v);
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn sorts_keys_and_compacts() {
        assert_eq!(
            canon(r#" { "b" : [1, 2.5, true, null], "a": {"d": "x", "c": -3} } "#),
            r#"{"a":{"c":-3,"d":"x"},"b":[1,2.5,true,null]}"#
        );
    }

    #[test]
    fn escapes() {
        assert_eq!(
            canon(r#""q\"b\\s\/\n\t\r\b\f\u0001\u00e9\u001F""#),
            "\"q\\\"b\\\\s/\\n\\t\\r\\b\\f\\u0001\u{e9}\\u001f\""
        );
    }

    #[test]
    fn numbers() {
        assert_eq!(
            canon("[1.0, 1e2, -0.5, 18446744073709551615, -9223372036854775808]"),
            "[1,100,-0.5,18446744073709551615,-9223372036854775808]"
        );
    }

    #[test]
    fn duplicate_key_last_wins() {
        assert_eq!(canon(r#"{"a":1,"a":2}"#), r#"{"a":2}"#);
    }
}

//! The peer bus's settings close it by default: a bus without the fleet's
//! key, or a NATS server off loopback without credentials, stops the
//! sidecar at start-up with the setting to set, unless
//! `HEARTH_PEERS_INSECURE`; a bad key file is refused without echoing it.

mod common;

use std::path::PathBuf;

use hearth_ext_proc::config::{is_loopback_host, url_hosts, Cli, Settings};

/// A scratch directory of this process for one test (the test removes
/// it when it passes).
fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("hearth-peer-bus-{}-{test}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A key file `name` in `dir` holding `contents`.
fn key_file(dir: &std::path::Path, name: &str, contents: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, contents).unwrap();
    path
}

fn settings(args: &[&str]) -> Settings {
    let all = ["hearth-ext-proc", "--upstreams", "127.0.0.1:1"];
    <Cli as clap::Parser>::try_parse_from(all.iter().chain(args))
        .unwrap()
        .settings
}

/// Runs the binary with one upstream and only these other `HEARTH_*`
/// variables: exit code and standard error.
fn run(env: &[(&str, &str)]) -> (i32, String) {
    let mut all = vec![("HEARTH_UPSTREAMS", "127.0.0.1:1")];
    all.extend_from_slice(env);
    common::run(&all, &[])
}

#[test]
fn an_open_bus_off_loopback_stops_the_sidecar_naming_the_settings_to_set() {
    let (code, err) = run(&[("HEARTH_PEERS_URL", "tls://nats.example:4222")]);
    assert_eq!(code, 2, "{err}");
    for setting in [
        "HEARTH_PEERS_KEY_FILE",
        "HEARTH_PEERS_USER",
        "HEARTH_PEERS_PASSWORD",
        "HEARTH_PEERS_TOKEN",
        "HEARTH_PEERS_INSECURE",
    ] {
        assert!(err.contains(setting), "{setting} not named: {err}");
    }
    assert!(err.contains("nats.example"), "{err}");
}

#[test]
fn a_short_or_unreadable_key_file_stops_the_sidecar_without_echoing_it() {
    let dir = scratch("bad-key");
    let short = key_file(&dir, "short", b"  secret-but-too-short-key \n");
    let (code, err) = run(&[
        ("HEARTH_PEERS_URL", "nats://127.0.0.1:4222"),
        ("HEARTH_PEERS_KEY_FILE", short.to_str().unwrap()),
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("HEARTH_PEERS_KEY_FILE"), "{err}");
    assert!(err.contains("holds 24 bytes"), "{err}");
    assert!(!err.contains("secret-but"), "the key is echoed: {err}");

    let missing = dir.join("no-such-key");
    let (code, err) = run(&[
        ("HEARTH_PEERS_URL", "nats://127.0.0.1:4222"),
        ("HEARTH_PEERS_KEY_FILE", missing.to_str().unwrap()),
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("HEARTH_PEERS_KEY_FILE: cannot read"), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn the_key_is_the_files_bytes_trimmed_and_never_printed() {
    let dir = scratch("trimmed");
    let path = key_file(&dir, "good", b"\n  0123456789abcdef0123456789abcdef  \r\n");
    let s = settings(&[
        "--peers-url=nats://127.0.0.1:4222",
        &format!("--peers-key-file={}", path.display()),
    ]);
    assert!(s.validate().is_ok());
    let key = s.peers_key().unwrap().unwrap();
    assert_eq!(key.expose(), b"0123456789abcdef0123456789abcdef");
    assert_eq!(format!("{key:?}"), "<redacted>");
    // 31 bytes is one too few, whatever whitespace surrounds them.
    let path = key_file(&dir, "31", b"0123456789abcdef0123456789abcde\n\n");
    let s = settings(&[&format!("--peers-key-file={}", path.display())]);
    assert!(s.validate().is_err());
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn credentials_are_required_off_loopback_and_the_key_everywhere_unless_insecure() {
    let dir = scratch("rules");
    let key = key_file(&dir, "key", &[b'k'; 32]);
    let key = format!("--peers-key-file={}", key.display());
    let problems = |args: &[&str]| settings(args).peer_bus_problems();
    // On loopback, the key suffices.
    for url in [
        "nats://127.0.0.1:4222",
        "nats://127.9.9.9:4222",
        "tls://localhost:4222",
        "nats://[::1]:4222",
    ] {
        assert_eq!(
            problems(&[&format!("--peers-url={url}"), &key]),
            Vec::<String>::new(),
            "{url}"
        );
    }
    // Off loopback: credentials too (a user and password, a token, or
    // credentials in the URL).
    let off = "--peers-url=tls://10.0.0.5:4222";
    assert_eq!(problems(&[off, &key]).len(), 1);
    assert!(problems(&[off, &key, "--peers-user=u", "--peers-password=p"]).is_empty());
    assert!(problems(&[off, &key, "--peers-token=t"]).is_empty());
    assert!(problems(&["--peers-url=nats://u:p@10.0.0.5:4222", &key]).is_empty());
    // One server of several off loopback is enough to need them.
    let several = "--peers-url=nats://127.0.0.1:4222,nats://nats.example:4222";
    assert_eq!(problems(&[several, &key]).len(), 1);
    // Without the key: refused, on loopback too.
    assert_eq!(problems(&["--peers-url=nats://127.0.0.1:4222"]).len(), 1);
    assert_eq!(problems(&[off]).len(), 2);
    // Insecure: both accepted; a key given is still read (and checked).
    assert!(problems(&[off, "--peers-insecure=true"]).is_empty());
    let short = key_file(&dir, "short", b"short");
    let short = format!("--peers-key-file={}", short.display());
    assert_eq!(problems(&[off, "--peers-insecure=true", &short]).len(), 1);
    // Without a bus, nothing is required.
    assert!(problems(&[]).is_empty());
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_ca_file_must_hold_a_certificate() {
    let dir = scratch("ca");
    let not_pem = dir.join("not.pem");
    std::fs::write(&not_pem, "hello").unwrap();
    let s = settings(&[&format!("--peers-ca-file={}", not_pem.display())]);
    let problems = s.peer_bus_problems();
    assert_eq!(problems.len(), 1);
    assert!(problems[0].contains("HEARTH_PEERS_CA_FILE"), "{problems:?}");
    let missing = dir.join("missing.pem");
    let s = settings(&[&format!("--peers-ca-file={}", missing.display())]);
    assert!(s.peer_bus_problems()[0].contains("cannot read"));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn url_hosts_and_loopback() {
    assert_eq!(
        url_hosts("nats://a:1, tls://u:p@b:2,nats://[::1]:3,nats://c"),
        [
            ("a".to_string(), false),
            ("b".to_string(), true),
            ("::1".to_string(), false),
            ("c".to_string(), false),
        ]
    );
    for host in ["localhost", "LOCALHOST", "127.0.0.1", "127.200.0.1", "::1"] {
        assert!(is_loopback_host(host), "{host}");
    }
    for host in [
        "10.0.0.1",
        "0.0.0.0",
        "::",
        "nats",
        "localhost.example",
        "128.0.0.1",
    ] {
        assert!(!is_loopback_host(host), "{host}");
    }
}

//! The binary refuses bad settings at start-up with a clear message.

mod common;

use std::process::Command;

use common::run;

#[test]
fn unknown_hearth_variable_is_refused_naming_the_valid_ones() {
    let (code, err) = run(
        &[("HEARTH_UPSTREAMS", "127.0.0.1:1"), ("HEARTH_ALPAH", "3")],
        &[],
    );
    assert_eq!(code, 2);
    assert!(err.contains("HEARTH_ALPAH"), "{err}");
    assert!(
        err.contains("HEARTH_ALPHA") && err.contains("HEARTH_AFFINITY_BASIS"),
        "{err}"
    );
}

#[test]
fn invalid_settings_are_all_reported() {
    let (code, err) = run(
        &[
            ("HEARTH_UPSTREAMS", "127.0.0.1:1,127.0.0.1:1"),
            ("HEARTH_WARMTH_BLOCKS", "0"),
        ],
        &[],
    );
    assert_eq!(code, 2);
    assert!(
        err.contains("twice") && err.contains("HEARTH_WARMTH_BLOCKS"),
        "{err}"
    );
    let (code, err) = run(&[("HEARTH_UPSTREAMS", "backend:8000")], &[]);
    assert_ne!(code, 0);
    assert!(err.contains("ip:port"), "{err}");
}

#[test]
fn envoy_config_subcommand_prints_a_bootstrap_for_the_upstreams() {
    let out = Command::new(env!("CARGO_BIN_EXE_hearth-ext-proc"))
        .args([
            "--upstreams",
            "127.0.0.1:7001,127.0.0.1:7002",
            "envoy-config",
        ])
        .output()
        .unwrap();
    assert!(out.status.success());
    let yaml = String::from_utf8(out.stdout).unwrap();
    assert!(yaml.contains("port_value: 7001") && yaml.contains("port_value: 7002"));
    assert!(yaml.contains("envoy.load_balancing_policies.override_host"));
}

#[test]
fn a_list_and_a_file_conflict_and_a_bad_file_is_refused_with_its_line() {
    let (code, err) = run(
        &[
            ("HEARTH_UPSTREAMS", "127.0.0.1:1"),
            ("HEARTH_UPSTREAMS_FILE", "/nonexistent"),
        ],
        &[],
    );
    assert_eq!(code, 2);
    assert!(err.contains("cannot be used with"), "{err}");
    let dir = scratch_dir("bad-file");
    let file = dir.join("upstreams");
    std::fs::write(&file, "127.0.0.1:1\n\n127.0.0.1:2;weight=3\n").unwrap();
    let (code, err) = run(&[("HEARTH_UPSTREAMS_FILE", file.to_str().unwrap())], &[]);
    assert_eq!(code, 2);
    assert!(err.contains("line 3") && err.contains("weight"), "{err}");
    let (code, err) = run(&[("HEARTH_UPSTREAMS_FILE", "/nonexistent/upstreams")], &[]);
    assert_eq!(code, 2);
    assert!(err.contains("reading /nonexistent/upstreams"), "{err}");
}

fn scratch_dir(name: &str) -> std::path::PathBuf {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("startup-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A running sidecar process, ended (by its PID) when dropped.
struct Running {
    child: std::process::Child,
    admin: String,
}

impl Running {
    fn start(env: &[(&str, &str)]) -> Running {
        let free = || {
            std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .to_string()
        };
        let admin = free();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_hearth-ext-proc"));
        for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("HEARTH_")) {
            cmd.env_remove(k);
        }
        cmd.args([
            format!("--listen={}", free()),
            format!("--admin-listen={admin}"),
            "--probe-interval-seconds=0".into(),
            "--engine-metrics-seconds=0".into(),
        ])
        .envs(env.iter().copied())
        .stderr(std::process::Stdio::null());
        let running = Running {
            child: cmd.spawn().unwrap(),
            admin,
        };
        for _ in 0..200 {
            if std::net::TcpStream::connect(&running.admin).is_ok() {
                return running;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        panic!("the sidecar never served its state endpoint");
    }

    fn state(&self) -> serde_json::Value {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(&self.admin).unwrap();
        write!(s, "GET /state HTTP/1.0\r\nHost: x\r\n\r\n").unwrap();
        let mut text = String::new();
        s.read_to_string(&mut text).unwrap();
        let body = text.split("\r\n\r\n").nth(1).unwrap();
        serde_json::from_str(body).unwrap()
    }

    fn ids(&self) -> Vec<String> {
        self.state()["replicas"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["id"].as_str().unwrap().to_string())
            .collect()
    }

    fn hangup(&self) {
        let status = Command::new("kill")
            .args(["-HUP", &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// Waits (bounded) until `/state` lists `ids`.
    fn wait_for_ids(&self, ids: &[&str]) -> bool {
        for _ in 0..100 {
            if self.ids() == ids {
                return true;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        false
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn sighup_reloads_the_replica_file_and_never_ends_the_sidecar() {
    let dir = scratch_dir("sighup");
    let file = dir.join("upstreams");
    std::fs::write(&file, "127.0.0.1:7101;id=a\n127.0.0.1:7102;id=b\n").unwrap();
    let sidecar = Running::start(&[
        ("HEARTH_UPSTREAMS_FILE", file.to_str().unwrap()),
        // No polling: only SIGHUP reloads.
        ("HEARTH_UPSTREAMS_POLL_SECONDS", "0"),
    ]);
    assert_eq!(sidecar.ids(), ["a", "b"]);
    std::fs::write(&file, "127.0.0.1:7102;id=b\n127.0.0.1:7103;id=c\n").unwrap();
    sidecar.hangup();
    assert!(sidecar.wait_for_ids(&["b", "c"]), "{:?}", sidecar.ids());
    assert_eq!(sidecar.state()["upstreams"]["reloads_total"], 1);
    // A bad file: refused, the list stays, the state says why.
    std::fs::write(&file, "127.0.0.1:7104;id=d;tag=huge\n").unwrap();
    sidecar.hangup();
    let mut error = serde_json::Value::Null;
    for _ in 0..100 {
        error = sidecar.state()["upstreams"]["reload_error"].clone();
        if !error.is_null() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(error.as_str().unwrap().contains("huge"), "{error}");
    assert_eq!(sidecar.ids(), ["b", "c"]);

    // Without a file, SIGHUP only logs: the sidecar keeps serving.
    let fixed = Running::start(&[("HEARTH_UPSTREAMS", "127.0.0.1:7105;id=e")]);
    fixed.hangup();
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert_eq!(fixed.ids(), ["e"]);
}

#[test]
fn an_empty_setting_means_its_default() {
    // As a ConfigMap listing every setting sets them.
    let sidecar = Running::start(&[
        ("HEARTH_UPSTREAMS", "127.0.0.1:7201;id=a"),
        ("HEARTH_UPSTREAMS_FILE", ""),
        ("HEARTH_JOURNAL_FILE", ""),
        ("HEARTH_ALPHA", ""),
    ]);
    assert_eq!(sidecar.ids(), ["a"]);
    assert_eq!(sidecar.state()["alpha"], 1.0);
}

#[test]
fn a_listener_off_loopback_without_the_token_is_refused() {
    let (code, err) = run(
        &[
            ("HEARTH_UPSTREAMS", "127.0.0.1:1"),
            ("HEARTH_LISTEN", "0.0.0.0:0"),
        ],
        &[],
    );
    assert_eq!(code, 2);
    assert!(
        err.contains("HEARTH_LISTEN")
            && err.contains("HEARTH_CONTROL_TOKEN_FILE")
            && err.contains("HEARTH_CONTROL_INSECURE"),
        "{err}"
    );
}

#[test]
fn a_bad_control_token_file_is_refused_without_echoing_it() {
    let path = std::env::temp_dir().join(format!("hearth-startup-token-{}", std::process::id()));
    std::fs::write(&path, "hunter2-is-not-enough\n").unwrap();
    let (code, err) = run(
        &[
            ("HEARTH_UPSTREAMS", "127.0.0.1:1"),
            ("HEARTH_CONTROL_TOKEN_FILE", path.to_str().unwrap()),
        ],
        &[],
    );
    let _ = std::fs::remove_file(&path);
    assert_eq!(code, 2);
    assert!(
        err.contains("HEARTH_CONTROL_TOKEN_FILE") && err.contains("at least 32"),
        "{err}"
    );
    assert!(!err.contains("hunter2"), "the token is echoed: {err}");
}

//! `hearth-bench serve` as a process: prints one address per engine, serves
//! them, and exits cleanly on SIGTERM.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Kills the child if the test fails before it exits.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn serve_prints_addresses_and_stops_on_sigterm() {
    let child = Command::new(env!("CARGO_BIN_EXE_hearth-bench"))
        .args([
            "serve",
            "--replicas",
            "2",
            "--listen",
            "127.0.0.1",
            "--base-port",
            "0",
        ])
        .args(["--model", "m-serve", "--output-tokens", "3"])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start hearth-bench serve");
    let mut proc = Proc(child);
    let stdout = proc.0.stdout.take().expect("stdout");
    // Reading blocks; a reader thread keeps the deadline honest.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut urls = Vec::new();
    for i in 0..2 {
        let line = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("engine line on stdout within 30 s");
        let (id, url) = line.split_once(' ').expect("`<id> <url>`");
        assert_eq!(id, format!("engine-{i}"));
        assert!(url.starts_with("http://127.0.0.1:"), "{url}");
        urls.push(url.to_owned());
    }
    assert_ne!(urls[0], urls[1]);

    let client = reqwest::Client::new();
    for (i, url) in urls.iter().enumerate() {
        let res = client
            .post(format!("{url}/v1/chat/completions"))
            .json(&serde_json::json!({"messages": [{"role": "user", "content": "hi"}]}))
            .send()
            .await
            .expect("request");
        assert_eq!(res.status(), 200);
        assert_eq!(res.headers()["x-engine-id"], format!("engine-{i}").as_str());
        let body: serde_json::Value = res.json().await.expect("JSON");
        assert_eq!(body["model"], "m-serve");
        assert_eq!(body["usage"]["completion_tokens"], 3);
    }

    let pid = proc.0.id().to_string();
    let killed = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("run kill");
    assert!(killed.success());
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(status) = proc.0.try_wait().expect("wait") {
            assert!(status.success(), "serve exited with {status}");
            break;
        }
        assert!(Instant::now() < deadline, "serve did not exit on SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    }
}

//! The sidecar's dashboard in a real headless browser (Debian's chromium,
//! installed by `scripts/setup`): after traffic through Envoy the page
//! renders the fleet from `/state` and `/debug/series` (and the
//! flow-control queue from `/debug/queue`) with no console error, and a
//! screenshot is kept for a human to look at.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use hearth_e2e::{filler, reply_text, Conversation, Fleet, FleetOptions, MODEL};

fn chromium() -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let dirs: Vec<PathBuf> = std::env::split_paths(&path).collect();
    ["chromium", "chromium-browser"]
        .iter()
        .flat_map(|name| dirs.iter().map(move |dir| dir.join(name)))
        .find(|p| p.is_file())
        .expect("chromium is not installed: run scripts/setup (it installs Debian's chromium)")
}

/// Runs headless chromium on `url` with `mode` (`--dump-dom` or
/// `--screenshot=PATH`); returns (stdout, stderr). Bounded: killed after
/// 90 s.
async fn browse(url: &str, mode: &str, profile: &Path) -> (String, String) {
    let mut cmd = tokio::process::Command::new(chromium());
    cmd.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--enable-logging=stderr",
        "--v=0",
        "--window-size=1280,900",
        "--virtual-time-budget=5000",
    ])
    .arg(format!("--user-data-dir={}", profile.display()))
    .arg(mode)
    .arg(url)
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .kill_on_drop(true);
    let child = cmd.spawn().expect("starting chromium");
    let out = tokio::time::timeout(Duration::from_secs(90), child.wait_with_output())
        .await
        .expect("chromium did not finish within 90 s")
        .expect("chromium output");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "chromium failed ({}):\n{stderr}",
        out.status
    );
    (stdout, stderr)
}

/// Console messages chromium logged for the page (errors, uncaught
/// exceptions, failed loads): the page itself logs nothing when healthy.
fn console_lines(stderr: &str) -> Vec<&str> {
    stderr
        .lines()
        .filter(|l| l.contains("CONSOLE") || l.contains("Uncaught"))
        .collect()
}

#[tokio::test]
async fn the_dashboard_renders_the_fleet_in_a_headless_browser() {
    let fleet = Fleet::start(FleetOptions::default()).await.unwrap();
    let system = filler(31, 4096);
    // Four conversations at once (so load spreads them), three turns each.
    let conversations = (0..4u64).map(|s| {
        let (fleet, system) = (&fleet, &system);
        async move {
            let mut conv = Conversation::new(MODEL, &format!("{system} team {s}"), true, 950 + s);
            for _ in 0..3 {
                let turn = fleet.chat(&conv.next_turn(3000, false)).await;
                conv.push_assistant(&reply_text(&turn.body));
                conv.push_tool_round(3000);
            }
        }
    });
    futures::future::join_all(conversations).await;
    let url = format!("http://{}/", fleet.settings.admin_listen);
    let work = std::env::temp_dir().join(format!("hearth-dashboard-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).unwrap();

    // 1. The rendered DOM: the page's script marks itself ready after a
    //    successful poll and fills the fleet table.
    let (dom, stderr) = browse(&url, "--dump-dom", &work.join("profile-dom")).await;
    assert!(
        dom.contains(r#"data-hearth="ready""#),
        "the page never rendered a poll (stderr:\n{stderr})\n{dom}"
    );
    assert!(dom.contains(r#"data-replicas="4""#), "{dom}");
    // What the script rendered (the script's own text is left out).
    let rendered = dom.split("<script>").next().unwrap();
    assert!(rendered.contains("replica list v1<"), "{rendered}");
    assert!(
        rendered.contains(r#"<div class="warnbar" id="reload" hidden="">"#),
        "no reload was refused, yet the warning shows:\n{rendered}"
    );
    for e in &fleet.engines {
        let id = e.engine.config().id.clone();
        assert!(
            rendered.contains(&format!(r#"<td class="mono">{id}</td>"#)),
            "replica {id} not in the fleet table:\n{rendered}"
        );
    }
    assert_eq!(
        rendered
            .matches(r#"<span class="badge serving">serving</span>"#)
            .count(),
        4,
        "health column:\n{rendered}"
    );
    assert!(
        !rendered.contains(r#"<tbody id="decisions"><tr><td colspan="5" class="empty">"#),
        "latest decisions not shown:\n{rendered}"
    );
    // Nothing saturated the fleet: the flow-control queue is empty, and
    // says so.
    assert!(
        rendered.contains(
            r#"<tbody id="queue"><tr><td colspan="5" class="empty">nothing waits</td></tr></tbody>"#
        ),
        "queue panel:\n{rendered}"
    );
    // Every figure has a value (returning turns happened, blocks were
    // routed), none is a placeholder.
    for kpi in [
        "k-served",
        "k-predicted",
        "k-rate",
        "k-hit",
        "k-stay",
        "k-total",
    ] {
        let at = rendered.find(&format!(r#"id="{kpi}">"#)).unwrap();
        let value = &rendered[at..].split('>').nth(1).unwrap();
        assert!(
            value.starts_with(|c: char| c.is_ascii_digit()),
            "{kpi} shows {value:?}"
        );
    }
    let console = console_lines(&stderr);
    assert!(
        console.is_empty(),
        "console messages:\n{}",
        console.join("\n")
    );

    // 2. A screenshot, kept for a human (the path is printed).
    let shot = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("hearth-dashboard.png");
    let _ = std::fs::remove_file(&shot);
    let (_, stderr) = browse(
        &url,
        &format!("--screenshot={}", shot.display()),
        &work.join("profile-shot"),
    )
    .await;
    let png = std::fs::read(&shot).unwrap_or_else(|e| panic!("no screenshot ({e}):\n{stderr}"));
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "not a PNG");
    let width = u32::from_be_bytes(png[16..20].try_into().unwrap());
    let height = u32::from_be_bytes(png[20..24].try_into().unwrap());
    assert_eq!((width, height), (1280, 900));
    // A blank page compresses to a few KB; the dashboard's tables, charts
    // and text do not.
    assert!(png.len() > 30_000, "screenshot is only {} bytes", png.len());
    let console = console_lines(&stderr);
    assert!(
        console.is_empty(),
        "console messages:\n{}",
        console.join("\n")
    );
    println!("dashboard screenshot: {}", shot.display());
    std::fs::remove_dir_all(&work).unwrap();
}

#[tokio::test]
async fn a_refused_reload_shows_on_the_dashboard() {
    let fleet = Fleet::start(FleetOptions {
        engines: 2,
        upstreams_file: true,
        eds: true,
        ..FleetOptions::default()
    })
    .await
    .unwrap();
    fleet
        .write_upstreams("127.0.0.1:9;id=a\n127.0.0.1:9;id=b\n")
        .await
        .unwrap();
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while fleet
        .state()
        .await
        .unwrap()
        .upstreams
        .reload_error
        .is_none()
    {
        assert!(
            std::time::Instant::now() < until,
            "the bad file was not refused"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let url = format!("http://{}/", fleet.settings.admin_listen);
    let work = std::env::temp_dir().join(format!("hearth-dashboard-reload-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).unwrap();
    let (dom, stderr) = browse(&url, "--dump-dom", &work.join("profile")).await;
    let rendered = dom.split("<script>").next().unwrap();
    assert!(
        rendered.contains(r#"<div class="warnbar" id="reload">Replica list not reloaded"#),
        "stderr:\n{stderr}\n{rendered}"
    );
    assert!(rendered.contains("lists 127.0.0.1:9 twice"), "{rendered}");
    // The fleet is still the one listed before.
    assert!(dom.contains(r#"data-replicas="2""#), "{dom}");
    assert!(console_lines(&stderr).is_empty(), "{stderr}");
    let _ = std::fs::remove_dir_all(&work);
}

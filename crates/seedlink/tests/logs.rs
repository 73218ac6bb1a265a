//! Logs: `--log-format json` writes one JSON object per line; every refused
//! or failed connection is one structured line with its reason, a flood of
//! them is rate-limited, and every line not written is counted — lines
//! written plus lines dropped equal the refused connections.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use seedlink_testkit as common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;
use tokio::io::AsyncWriteExt;
use tokio_util::sync::CancellationToken;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_are_json_lines_rate_limited_and_what_is_dropped_is_counted() {
    let stop = CancellationToken::new();
    let pki =
        std::sync::Arc::new(seedlink::demo::Pki::generate(&["api.denied.logs.test"]).unwrap());
    let backend = demo_backend(&pki, 0, "denied", &stop).await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("gateway.yaml");
    std::fs::write(
        &config,
        format!(
            "admin: {{listen: '127.0.0.1:0'}}
listeners: [{{name: tls, address: '127.0.0.1:0'}}]
control_planes:
  - {{name: denied, hostnames: [api.denied.logs.test], endpoints: ['{backend}'], acl: {{allow: [192.0.2.0/24]}}}}
"
        ),
    )
    .unwrap();
    let mut child = Command::new(seedlink_bin())
        .args(["--log-format", "json", "gateway", "--config"])
        .arg(&config)
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let lines = std::thread::spawn(move || {
        BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
            .collect::<Vec<String>>()
    });
    let ready = common::tunnel_env::ready_line(&mut child);
    let mut proc = Proc(child);
    let tls: std::net::SocketAddr = ready["listeners"]["tls"].as_str().unwrap().parse().unwrap();
    let admin: std::net::SocketAddr = ready["admin"].as_str().unwrap().parse().unwrap();

    // One ACL denial, then a flood of 400 connections that are not TLS.
    let cfg = pki.client_config(true, &[]).unwrap();
    assert!(seedlink::demo::https_get(tls, "api.denied.logs.test", cfg)
        .await
        .is_err());
    const FLOOD: usize = 400;
    for _ in 0..FLOOD {
        let mut s = tokio::net::TcpStream::connect(tls).await.unwrap();
        s.write_all(b"GET / HTTP/1.0\r\n\r\n").await.unwrap();
        let _ = read_until_closed(&mut s, Duration::from_secs(10)).await;
    }
    let metrics = eventually(
        "the connections counted",
        Duration::from_secs(20),
        async || {
            let m = http_get(admin, "/metrics").await.1;
            if sum_metric(&m, "seedlink_gateway_connections_total") >= (FLOOD + 1) as f64 {
                Ok(m)
            } else {
                Err(m)
            }
        },
    )
    .await;
    let dropped = sum_metric(&metrics, "seedlink_gateway_log_lines_dropped_total") as usize;
    // SIGTERM: drain and exit, so that stderr is complete.
    let pid = proc.0.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let _ = proc.0.wait();
    let lines = lines.join().unwrap();

    let mut refused = Vec::new();
    for l in &lines {
        let v: serde_json::Value =
            serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"));
        assert!(v["timestamp"].is_string() && v["level"].is_string(), "{l}");
        if v["target"] == "seedlink::refused" {
            refused.push(v);
        }
    }
    let acl: Vec<_> = refused
        .iter()
        .filter(|v| v["fields"]["reason"] == "acl_denied")
        .collect();
    assert_eq!(acl.len(), 1, "{refused:?}");
    assert_eq!(acl[0]["fields"]["control_plane"], "denied");
    assert_eq!(acl[0]["level"], "WARN");
    assert!(acl[0]["fields"]["client"]
        .as_str()
        .unwrap()
        .starts_with("127.0.0.1:"));
    // The flood was cut short, and nothing was lost unaccounted.
    assert!(dropped > 0, "no line was dropped in a flood of {FLOOD}");
    assert!(
        refused.len() < FLOOD,
        "{} lines for {FLOOD} refusals",
        refused.len()
    );
    assert_eq!(
        refused.len() + dropped,
        FLOOD + 1,
        "{} written + {dropped} dropped",
        refused.len()
    );
    // No per-connection INFO lines.
    assert!(
        !lines
            .iter()
            .any(|l| l.contains("\"level\":\"INFO\"") && l.contains("\"client\"")),
        "per-connection INFO lines remain"
    );
    stop.cancel();
}

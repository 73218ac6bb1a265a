//! `seedlink node-proxy` in front of `seedlink gateway`: curl reaches a TLS
//! server that requires a client certificate through the node-proxy's
//! address, in CONNECT mode and in legacy PROXY v2 mode.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use seedlink_testkit as common;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;
use tokio_util::sync::CancellationToken;

const ALPHA: &str = "api.alpha.node.test";
const DEST: &str = "outbound|443||kube-apiserver.shoot--dev--alpha.svc.cluster.local";

type NodeProxy = NodeProxyProc;

fn curl(files: &seedlink::demo::ClientFiles, at: SocketAddr) -> String {
    curl_mtls(files, ALPHA, at.ip(), at.port())
}

async fn wait_ready(admin: SocketAddr) {
    eventually("node-proxy ready", Duration::from_secs(15), async || {
        let (code, body) = http_get(admin, "/readyz").await;
        ok_if(code == 200, || format!("{code} {body}"))
    })
    .await;
}

/// Waits until `want` tunnels finished cleanly. A tunnel is counted once both
/// directions ended, which may be just after curl exits. A TLS exchange can
/// legitimately end in a reset: the backend closes after its answer and
/// curl's close_notify then meets a closed socket. Any other outcome (error,
/// timeout, refusal) fails the test.
async fn wait_clean_tunnels(admin: SocketAddr, want: f64) {
    eventually("the tunnels counted", Duration::from_secs(10), async || {
        let m = http_get(admin, "/metrics").await.1;
        let clean = sum_metric(&m, "seedlink_node_proxy_tunnels_total{outcome=\"ok\"}")
            + sum_metric(&m, "seedlink_node_proxy_tunnels_total{outcome=\"reset\"}");
        let all = sum_metric(&m, "seedlink_node_proxy_tunnels_total{");
        assert_eq!(clean, all, "a tunnel ended badly:\n{m}");
        if clean >= want {
            assert_eq!(clean, want, "more tunnels than clients:\n{m}");
        }
        ok_if(clean >= want, || m.clone())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_proxy_connect_and_legacy_modes_through_the_gateway() {
    let stop = CancellationToken::new();
    let pki = seedlink::demo::Pki::generate(&[ALPHA]).unwrap();
    let a = demo_backend(&pki, 0, "alpha", &stop).await;
    // The legacy path routes by the node-proxy's listen address, which is
    // only known after it started: a fixed port on a dedicated loopback IP.
    let legacy_port = free_port();
    let gw = Gw::start(&format!(
        "admin: {{listen: '127.0.0.1:0'}}
listeners:
  - {{name: connect, address: '127.0.0.1:0', protocol: http-connect}}
  - {{name: legacy, address: '127.0.0.1:0', protocol: proxy}}
control_planes:
  - name: alpha
    endpoints: ['{a}']
    destinations: [{{name: '{DEST}'}}]
    service_addresses: ['127.0.0.67:{legacy_port}']
"
    ));
    let files = write_pki(&pki, gw.dir.path());

    // GEP-30: HTTP/1.1 CONNECT with X-Gardener-Destination; the gateway is
    // named with a trailing-dot FQDN.
    let gw_connect = format!("localhost.:{}", gw.listener("connect").port());
    let np = node_proxy(&[
        "--link-kind",
        "none",
        "--address",
        "127.0.0.66",
        "--gateway",
        &gw_connect,
        "--destination",
        DEST,
    ]);
    wait_ready(np.admin).await;
    let body = curl(&files, np.listen);
    assert!(
        body.contains("hello from alpha") && !body.contains("client_certs=0"),
        "{body}"
    );
    wait_clean_tunnels(np.admin, 1.0).await;
    gw.wait_metric(
        "seedlink_gateway_routed_total{listener=\"connect\",protocol=\"http-connect:x-gardener-destination\",control_plane=\"alpha\"}",
        1.0,
    )
    .await;

    // GEP-08 legacy: PROXY v2 to the legacy port, routed by destination.
    // This node-proxy reads a configuration file (`--config`), which
    // `check-config` accepts as a node-proxy's.
    let file = gw.dir.path().join("node-proxy.yaml");
    std::fs::write(
        &file,
        format!(
            "link_kind: none\naddress: 127.0.0.67\nport: {legacy_port}\nadmin: '127.0.0.1:0'\n\
             mode: proxy-v2\ngateway: '{}'\n",
            gw.listener("legacy")
        ),
    )
    .unwrap();
    common::assert_valid_config(&file, "node-proxy");
    let legacy = Command::new(env!("CARGO_BIN_EXE_seedlink"))
        .args(["node-proxy", "--config"])
        .arg(&file)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut legacy = NodeProxy {
        child: legacy,
        listen: format!("127.0.0.67:{legacy_port}").parse().unwrap(),
        admin: np.admin,
        metrics: None,
    };
    let out = legacy.child.stdout.take().unwrap();
    let mut line = String::new();
    BufReader::new(out).read_line(&mut line).unwrap();
    assert!(line.contains("ready"), "{line}");
    let body = curl(&files, legacy.listen);
    assert!(body.contains("hello from alpha"), "{body}");
    gw.wait_metric(
        "seedlink_gateway_routed_total{listener=\"legacy\",protocol=\"proxy-protocol\",control_plane=\"alpha\"}",
        1.0,
    )
    .await;
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_proxy_not_ready_without_gateway_and_refuses_bad_destination() {
    let dead = free_port();
    let np = node_proxy(&[
        "--link-kind",
        "none",
        "--address",
        "127.0.0.68",
        "--gateway",
        &format!("127.0.0.1:{dead}"),
        "--destination",
        DEST,
    ]);
    let (code, body) = http_get(np.admin, "/readyz").await;
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("gateway_ok=false"), "{body}");
    // `/config` shows what it runs with.
    let (code, body) = http_get(np.admin, "/config").await;
    assert_eq!(code, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["config"]["address"], "127.0.0.68", "{body}");
    // A client is closed, counted, and nothing hangs.
    let mut s = tokio::net::TcpStream::connect(np.listen).await.unwrap();
    let (_, r) = read_until_closed(&mut s, Duration::from_secs(15)).await;
    let _ = r;
    let m = http_get(np.admin, "/metrics").await.1;
    assert!(
        sum_metric(
            &m,
            "seedlink_node_proxy_tunnels_total{outcome=\"gateway_unreachable\"}"
        ) >= 1.0,
        "{m}"
    );
    // A malformed destination is refused at start with a clear error.
    let out = Command::new(env!("CARGO_BIN_EXE_seedlink"))
        .args([
            "node-proxy",
            "--link-kind",
            "none",
            "--address",
            "127.0.0.69",
            "--gateway",
            "127.0.0.1:1",
            "--destination",
            "outbound|443||",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--destination"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_proxy_http2_mode_multiplexes_tunnels_on_one_connection() {
    let stop = CancellationToken::new();
    let pki = seedlink::demo::Pki::generate(&[ALPHA]).unwrap();
    let a = demo_backend(&pki, 0, "alpha", &stop).await;
    let gw = Gw::start(&format!(
        "admin: {{listen: '127.0.0.1:0'}}
listeners:
  - {{name: connect, address: '127.0.0.1:0', protocol: http-connect}}
control_planes:
  - name: alpha
    endpoints: ['{a}']
    destinations: [{{name: '{DEST}'}}]
"
    ));
    let files = write_pki(&pki, gw.dir.path());
    let np = node_proxy(&[
        "--link-kind",
        "none",
        "--address",
        "127.0.0.70",
        "--mode",
        "http2-connect",
        "--gateway",
        &gw.listener("connect").to_string(),
        "--destination",
        DEST,
    ]);
    wait_ready(np.admin).await;
    // Eight curls at once, each a stream on the node-proxy's one connection.
    let listen = np.listen;
    let handles: Vec<_> = (0..8)
        .map(|_| {
            let files = files.clone();
            std::thread::spawn(move || curl(&files, listen))
        })
        .collect();
    for h in handles {
        let body = h.join().unwrap();
        assert!(
            body.contains("hello from alpha") && !body.contains("client_certs=0"),
            "{body}"
        );
    }
    gw.wait_metric(
        "seedlink_gateway_routed_total{listener=\"connect\",protocol=\"http2-connect\",control_plane=\"alpha\"}",
        8.0,
    )
    .await;
    // One TCP connection carried them all and stays open for the next.
    let m = gw.metrics().await;
    assert_eq!(
        sum_metric(
            &m,
            "seedlink_gateway_active_connections{listener=\"connect\"}"
        ),
        1.0,
        "{m}"
    );
    assert_eq!(
        sum_metric(&m, "seedlink_gateway_connections_total{"),
        0.0,
        "no gateway connection may have ended: {m}"
    );
    wait_clean_tunnels(np.admin, 8.0).await;
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_proxy_admin_token_guards_all_but_the_probes_and_the_metrics_endpoint() {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "np-token\n").unwrap();
    let dead = free_port();
    let np = node_proxy(&[
        "--link-kind",
        "none",
        "--address",
        "127.0.0.69",
        "--gateway",
        &format!("127.0.0.1:{dead}"),
        "--destination",
        DEST,
        "--admin-token-file",
        token.to_str().unwrap(),
        "--metrics",
        "127.0.0.1:0",
    ]);
    assert_eq!(http_get(np.admin, "/metrics").await.0, 401);
    // The metrics-only endpoint (for the shoot's Prometheus on the node's
    // address) needs no token and serves nothing else.
    let m = np.metrics.unwrap();
    let (code, body) = http_get(m, "/metrics").await;
    assert_eq!(code, 200);
    assert!(body.contains("seedlink_node_proxy_"), "{body}");
    assert_eq!(http_get(m, "/healthz").await.0, 200);
    for path in ["/config", "/readyz", "/"] {
        assert_eq!(http_get(m, path).await.0, 404, "{path}");
    }
    assert_eq!(http_get(np.admin, "/config").await.0, 401);
    // The probes need nothing.
    assert_eq!(http_get(np.admin, "/healthz").await.0, 200);
    let out = std::process::Command::new(require("curl"))
        .args(["-s", "-H", "Authorization: Bearer np-token"])
        .arg(format!("http://{}/config", np.admin))
        .output()
        .unwrap();
    let body = String::from_utf8_lossy(&out.stdout);
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    // The configuration names the token file, never the token.
    assert_eq!(v["config"]["admin_token_file"], token.to_str().unwrap());
    assert!(!body.contains("np-token\""), "{body}");
}

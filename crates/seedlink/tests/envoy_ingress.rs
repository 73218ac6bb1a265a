//! Envoy configured as Gardener's istio ingress `http-proxy` port
//! (`connect_matcher` + header `safe_regex`, `cluster_header`, CONNECT
//! upgrade, redirects): seedlink's node-proxy works against it, and
//! seedlink's destination guard decides exactly like Envoy's RE2 full match.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use seedlink_testkit as common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

/// Gardener's regex, verbatim from the reference (`gardener-istio-kkp.md` §1.5).
const GARDENER_REGEX: &str = r"^(outbound\|(1194\|\|vpn-seed-server(-[0-4])?|443\|\|kube-apiserver)\..*\.svc\.cluster\.local|(shoot-[a-z0-9]+(-[a-z0-9]+)*|shoot--[a-z0-9]+(-[a-z0-9]+)*--[a-z0-9]+(-[a-z0-9]+)*)--kube-apiserver-socket)$";
const ALPHA: &str = "api.alpha.ingress.test";
const DEST: &str = "outbound|443||kube-apiserver.shoot--dev--alpha.svc.cluster.local";

fn envoy_ingress(dir: &std::path::Path, port: u16, backend: std::net::SocketAddr) -> Proc {
    let regex = GARDENER_REGEX.replace('\\', "\\\\");
    let cfg = dir.join("envoy-ingress.yaml");
    std::fs::write(
        &cfg,
        format!(
            "layered_runtime:
  layers:
  - name: static
    static_layer: {{re2.max_program_size.error_level: 1000}}
static_resources:
  listeners:
  - name: http_proxy
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          '@type': type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: http_proxy
          http_protocol_options: {{accept_http_10: true}}
          upgrade_configs: [{{upgrade_type: CONNECT}}]
          http_filters:
          - name: envoy.filters.http.router
            typed_config: {{'@type': type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}}
          route_config:
            virtual_hosts:
            - name: http-proxy
              domains: ['*']
              routes:
              - match:
                  connect_matcher: {{}}
                  headers: [{{name: X-Gardener-Destination, string_match: {{safe_regex: {{regex: \"{regex}\"}}}}}}]
                route:
                  cluster_header: X-Gardener-Destination
                  upgrade_configs: [{{upgrade_type: CONNECT, connect_config: {{}}}}]
              - match: {{connect_matcher: {{}}}}
                redirect: {{https_redirect: true, port_redirect: 443}}
              - match: {{prefix: /}}
                redirect: {{https_redirect: true, port_redirect: 443}}
  clusters:
  - name: '{DEST}'
    type: STATIC
    connect_timeout: 5s
    load_assignment:
      cluster_name: '{DEST}'
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: {ip}, port_value: {bport}}}}}}}
",
            ip = backend.ip(),
            bport = backend.port()
        ),
    )
    .unwrap();
    common::envoy(dir, &cfg)
}

/// Strings on both sides of Gardener's regex.
fn corpus() -> Vec<String> {
    let mut v: Vec<String> = [
        "outbound|443||kube-apiserver.shoot--p--n.svc.cluster.local",
        "outbound|443||kube-apiserver.shoot-legacy.svc.cluster.local",
        "outbound|443||kube-apiserver..svc.cluster.local",
        "outbound|443||kube-apiserver.a.b.c.svc.cluster.local",
        "outbound|1194||vpn-seed-server.shoot--p--n.svc.cluster.local",
        "outbound|1194||vpn-seed-server-0.shoot--p--n.svc.cluster.local",
        "outbound|1194||vpn-seed-server-4.shoot--p--n.svc.cluster.local",
        "outbound|1194||vpn-seed-server-5.shoot--p--n.svc.cluster.local",
        "outbound|1194||vpn-seed-server-10.shoot--p--n.svc.cluster.local",
        "outbound|443||vpn-seed-server.shoot--p--n.svc.cluster.local",
        "outbound|1194||kube-apiserver.shoot--p--n.svc.cluster.local",
        "outbound|8443||kube-apiserver.shoot--p--n.svc.cluster.local",
        "outbound|443||kube-apiserver.shoot--p--n.svc.cluster.local.",
        "outbound|443||kube-apiserver.shoot--p--n.svc.cluster.localx",
        "outbound|443||kube-apiserver.shoot--p--n.svc.cluster",
        "outbound|443||kube-apiserverx.shoot--p--n.svc.cluster.local",
        "outbound|443|x|kube-apiserver.shoot--p--n.svc.cluster.local",
        "inbound|443||kube-apiserver.shoot--p--n.svc.cluster.local",
        "OUTBOUND|443||kube-apiserver.shoot--p--n.svc.cluster.local",
        "outbound|443||KUBE-APISERVER.shoot--p--n.svc.cluster.local",
        "xoutbound|443||kube-apiserver.shoot--p--n.svc.cluster.local",
        "outbound|443||kube-apiserver.shoot--p--n.svc.cluster.local|",
        "outbound|443||kube-apiserver.x y.svc.cluster.local",
        "outbound|443||kube-apiserver.x|y.svc.cluster.local",
        "shoot--p--n--kube-apiserver-socket",
        "shoot--proj--name--kube-apiserver-socket",
        "shoot--a-b--c-d--kube-apiserver-socket",
        "shoot--p--n-x--kube-apiserver-socket",
        "shoot-legacy--kube-apiserver-socket",
        "shoot-legacy-name--kube-apiserver-socket",
        "shoot-a-b-c--kube-apiserver-socket",
        "shoot--p--kube-apiserver-socket",
        "shoot----kube-apiserver-socket",
        "shoot--P--n--kube-apiserver-socket",
        "shoot--p--n--kube-apiserver-socketx",
        "xshoot--p--n--kube-apiserver-socket",
        "shoot--p--n--kube-apiserver",
        "garden--kube-apiserver-socket",
        "shoot--p_x--n--kube-apiserver-socket",
        "shoot--p--n---kube-apiserver-socket",
        "shoot-x---kube-apiserver-socket",
        "shoot--p--n--x--kube-apiserver-socket",
        "shoot-1--kube-apiserver-socket",
        "shoot--1--2--kube-apiserver-socket",
        "kube-apiserver.shoot--p--n.svc.cluster.local:443",
        "outbound|443||",
        "outbound",
        "-",
        "a",
        "outbound|443||kube-apiserver.\u{e9}.svc.cluster.local",
        "outbound|1194||vpn-seed-server-0x.ns.svc.cluster.local",
        "outbound|1194||vpn-seed-server-.ns.svc.cluster.local",
        "outbound|443||kube-apiserver.ns.svc.cluster.local outbound|443||kube-apiserver.ns.svc.cluster.local",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.push(format!(
        "outbound|443||kube-apiserver.{}.svc.cluster.local",
        "a".repeat(200)
    ));
    v.push(format!(
        "shoot--{}--n--kube-apiserver-socket",
        "p".repeat(100)
    ));
    v
}

/// Envoy's decision for one header value: `true` when its regex route
/// matched (the request went on to the cluster: 200 or 503), `false` when it
/// fell through to the redirect.
async fn envoy_accepts(addr: std::net::SocketAddr, value: &str) -> bool {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let head = format!("CONNECT x.example:443 HTTP/1.1\r\nHost: x.example:443\r\nX-Gardener-Destination: {value}\r\n\r\n");
    s.write_all(head.as_bytes()).await.unwrap();
    let mut buf = vec![0u8; 12];
    tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut buf))
        .await
        .unwrap()
        .unwrap();
    let status = String::from_utf8_lossy(&buf[9..12]).to_string();
    match status.as_str() {
        "301" => false,
        "200" | "503" => true,
        other => panic!("unexpected Envoy status {other} for {value:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn destination_guard_matches_envoy_re2_and_node_proxy_works_against_envoy() {
    let stop = CancellationToken::new();
    let pki = seedlink::demo::Pki::generate(&[ALPHA]).unwrap();
    let a = demo_backend(&pki, 0, "alpha", &stop).await;
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let _envoy = envoy_ingress(dir.path(), port, a);
    let envoy: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    if tokio::time::timeout(Duration::from_secs(15), async {
        while TcpStream::connect(envoy).await.is_err() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .is_err()
    {
        panic!(
            "Envoy did not start: {}",
            std::fs::read_to_string(dir.path().join("envoy.log")).unwrap_or_default()
        );
    }

    // Parity: seedlink's compiled guard vs Envoy's safe_regex, string by string.
    let guard = seedlink_config::compile::destination_regex(GARDENER_REGEX).unwrap();
    let corpus = corpus();
    let (mut yes, mut no) = (0, 0);
    for value in &corpus {
        let envoy_says = envoy_accepts(envoy, value).await;
        assert_eq!(
            guard.is_match(value),
            envoy_says,
            "disagreement on {value:?}"
        );
        if envoy_says {
            yes += 1
        } else {
            no += 1
        }
    }
    assert!(
        corpus.len() >= 50 && yes >= 15 && no >= 15,
        "corpus too lopsided: {yes} accepted, {no} rejected"
    );

    // seedlink node-proxy → Envoy as Gardener's ingress → TLS server.
    let mut np = Command::new(env!("CARGO_BIN_EXE_seedlink"))
        .args([
            "node-proxy",
            "--link-kind",
            "none",
            "--address",
            "127.0.0.70",
            "--port",
            "0",
            "--admin",
            "127.0.0.1:0",
        ])
        .args(["--gateway", &envoy.to_string(), "--destination", DEST])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let out = np.stdout.take().unwrap();
    let _np = Proc(np);
    let mut line = String::new();
    BufReader::new(out).read_line(&mut line).unwrap();
    let v: serde_json::Value = serde_json::from_str(&line).unwrap();
    let listen: std::net::SocketAddr = v["listen"].as_str().unwrap().parse().unwrap();
    let files = pki.write_client_files(dir.path()).unwrap();
    let body = curl_mtls(&files, ALPHA, listen.ip(), listen.port());
    assert!(body.contains("hello from alpha"), "{body}");
    stop.cancel();
}

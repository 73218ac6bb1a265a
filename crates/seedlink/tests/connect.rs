//! The `http-connect` listener with curl as the client, and raw sockets for
//! the adversarial shapes.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use seedlink_testkit as common;

use std::process::Command;
use std::time::Duration;

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

const ALPHA: &str = "api.alpha.connect.test";
const DEST_ALPHA: &str = "outbound|443||kube-apiserver.shoot--dev--alpha.svc.cluster.local";
const DEST_ECHO: &str = "shoot--dev--echo--kube-apiserver-socket";
const DEST_DENIED: &str = "outbound|443||kube-apiserver.shoot--dev--denied.svc.cluster.local";

async fn setup(stop: &CancellationToken, extra_listener: &str) -> (Gw, seedlink::demo::Pki) {
    let pki = seedlink::demo::Pki::generate(&[ALPHA]).unwrap();
    let a = demo_backend(&pki, 0, "alpha", stop).await;
    let echo = echo_backend(stop).await;
    let gw = Gw::start(&format!(
        "admin: {{listen: '127.0.0.1:0'}}
listeners:
  - {{name: connect, address: '127.0.0.1:0', protocol: http-connect}}
{extra_listener}
control_planes:
  - name: alpha
    hostnames: [{ALPHA}]
    endpoints: ['{a}']
    destinations: [{{name: '{DEST_ALPHA}'}}]
  - name: echo
    endpoints: ['127.0.0.1:9']
    destinations: [{{name: '{DEST_ECHO}', endpoints: ['{echo}']}}]
  - name: denied
    endpoints: ['{echo}']
    destinations: [{{name: '{DEST_DENIED}'}}]
    acl: {{allow: [192.0.2.0/24]}}
"
    ));
    (gw, pki)
}

/// curl through the CONNECT listener; `http10` uses `--proxy1.0`.
fn curl_connect(
    gw: &Gw,
    files: &seedlink::demo::ClientFiles,
    header: &str,
    http10: bool,
) -> std::process::Output {
    let proxy = format!("http://{}", gw.listener("connect"));
    Command::new(require("curl"))
        .args([
            "-sS",
            "--max-time",
            "10",
            "-p",
            if http10 { "--proxy1.0" } else { "-x" },
        ])
        .arg(proxy)
        .arg("--proxy-header")
        .arg(header)
        .arg("--cacert")
        .arg(&files.ca)
        .arg("--cert")
        .arg(&files.cert)
        .arg("--key")
        .arg(&files.key)
        .arg(format!("https://{ALPHA}/"))
        .output()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curl_proxytunnel_http11_and_http10() {
    let stop = CancellationToken::new();
    let (gw, pki) = setup(&stop, "").await;
    let files = write_pki(&pki, gw.dir.path());
    let header = format!("X-Gardener-Destination: {DEST_ALPHA}");
    for http10 in [false, true] {
        let out = curl_connect(&gw, &files, &header, http10);
        let body = String::from_utf8_lossy(&out.stdout);
        assert!(
            body.contains("hello from alpha") && !body.contains("client_certs=0"),
            "curl (HTTP/1.0: {http10}): {body} {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // An unknown (well-formed) destination: 503, never a fallback.
    let out = curl_connect(
        &gw,
        &files,
        "X-Gardener-Destination: outbound|443||kube-apiserver.other.svc.cluster.local",
        false,
    );
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("503"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // No header: Gardener's redirect.
    let out = curl_connect(&gw, &files, "X-Other: 1", false);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("301"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A destination whose ACL denies this client: 503, as an unknown one
    // (nobody learns which destinations exist; metrics say acl_denied).
    let out = curl_connect(
        &gw,
        &files,
        &format!("X-Gardener-Destination: {DEST_DENIED}"),
        false,
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("503"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    gw.wait_metric(
        "seedlink_gateway_routed_total{listener=\"connect\",protocol=\"http-connect:x-gardener-destination\",control_plane=\"alpha\"}",
        2.0,
    )
    .await;
    gw.wait_metric(
        "seedlink_gateway_acl_denied_total{control_plane=\"denied\"}",
        1.0,
    )
    .await;
    stop.cancel();
}

/// Sends `msg`, returns everything the gateway sends until it closes.
async fn exchange(gw: &Gw, msg: &[u8]) -> String {
    let mut s = TcpStream::connect(gw.listener("connect")).await.unwrap();
    s.write_all(msg).await.unwrap();
    let (data, r) = read_until_closed(&mut s, Duration::from_secs(10)).await;
    r.unwrap();
    String::from_utf8_lossy(&data).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_connect_shapes() {
    let stop = CancellationToken::new();
    let (gw, _pki) = setup(&stop, "").await;
    let addr = gw.listener("connect");

    // Pipelined bytes after the head reach the upstream once, after the 200.
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(
        format!("CONNECT x:443 HTTP/1.1\r\nX-Gardener-Destination: {DEST_ECHO}\r\n\r\npipelined")
            .as_bytes(),
    )
    .await
    .unwrap();
    let want = "HTTP/1.1 200 Connection established\r\n\r\npipelined";
    let mut got = vec![0u8; want.len()];
    tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut got))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&got), want);
    echo_roundtrip(&mut s, b"and more").await.unwrap();

    // A head trickled one byte at a time.
    let mut s = TcpStream::connect(addr).await.unwrap();
    for b in
        format!("CONNECT x:443 HTTP/1.0\r\nX-Gardener-Destination: {DEST_ECHO}\r\n\r\n").bytes()
    {
        s.write_all(&[b]).await.unwrap();
    }
    let want = "HTTP/1.0 200 Connection established\r\n\r\n";
    let mut got = vec![0u8; want.len()];
    tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut got))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&got), want);

    // A rejected CONNECT followed by a pipelined GET: one answer, then close;
    // the GET is never parsed (it would have produced a second response).
    let r = exchange(&gw, format!("CONNECT x:443 HTTP/1.1\r\nHost: {ALPHA}\r\n\r\nGET /secret HTTP/1.1\r\nHost: y\r\n\r\n").as_bytes()).await;
    assert_eq!(r.matches("HTTP/1.1").count(), 1, "{r}");
    assert!(
        r.starts_with("HTTP/1.1 301") && r.contains(&format!("location: https://{ALPHA}:443/\r\n")),
        "{r}"
    );
    // Non-CONNECT: redirect keeps the path.
    let r = exchange(
        &gw,
        format!("GET /healthz HTTP/1.1\r\nHost: {ALPHA}:8443\r\n\r\n").as_bytes(),
    )
    .await;
    assert!(
        r.contains(&format!("location: https://{ALPHA}:443/healthz")),
        "{r}"
    );
    // A host the gateway does not serve is never echoed (no open redirect).
    let r = exchange(&gw, b"GET / HTTP/1.1\r\nHost: evil.example\r\n\r\n").await;
    assert!(r.starts_with("HTTP/1.1 400"), "{r}");
    // Duplicate destination headers, and a malformed one.
    let r = exchange(&gw, format!("CONNECT x:443 HTTP/1.1\r\nHost: {ALPHA}\r\nX-Gardener-Destination: {DEST_ECHO}\r\nx-gardener-destination: {DEST_ECHO}\r\n\r\n").as_bytes()).await;
    assert!(r.starts_with("HTTP/1.1 301"), "{r}");
    let r = exchange(
        &gw,
        format!("CONNECT x:443 HTTP/1.1\r\nHost: {ALPHA}\r\nX-Gardener-Destination: outbound|443||a..b\r\n\r\n").as_bytes(),
    )
    .await;
    assert!(r.starts_with("HTTP/1.1 301"), "{r}");
    // Smuggling shapes: framing headers, bare LF, obs-fold, control bytes: 400.
    for bad in [
        format!("CONNECT x:443 HTTP/1.1\r\nContent-Length: 5\r\nX-Gardener-Destination: {DEST_ECHO}\r\n\r\nhello"),
        format!("CONNECT x:443 HTTP/1.1\r\nTransfer-Encoding: chunked\r\nX-Gardener-Destination: {DEST_ECHO}\r\n\r\n"),
        format!("CONNECT x:443 HTTP/1.1\nX-Gardener-Destination: {DEST_ECHO}\r\n\r\n"),
        format!("CONNECT x:443 HTTP/1.1\r\nX-Gardener-Destination: {DEST_ECHO}\r\n folded\r\n\r\n"),
        format!("CONNECT x:443 HTTP/1.1\r\nX-Gardener-Destination: {DEST_ECHO}\x01\r\n\r\n"),
        format!("CONNECT x:443 HTTP/1.1\r\nX: {}\r\n\r\n", "a".repeat(9000)),
        // Request-targets that are not authority-form `host:port` (RFC 9110
        // §9.3.6), even with a good destination header.
        format!("CONNECT x HTTP/1.1\r\nX-Gardener-Destination: {DEST_ECHO}\r\n\r\n"),
        format!("CONNECT :443 HTTP/1.1\r\nX-Gardener-Destination: {DEST_ECHO}\r\n\r\n"),
        format!("CONNECT x:0 HTTP/1.1\r\nX-Gardener-Destination: {DEST_ECHO}\r\n\r\n"),
        format!("CONNECT x:65536 HTTP/1.1\r\nX-Gardener-Destination: {DEST_ECHO}\r\n\r\n"),
        format!("CONNECT x:+443 HTTP/1.1\r\nX-Gardener-Destination: {DEST_ECHO}\r\n\r\n"),
        format!("CONNECT u@x:443 HTTP/1.1\r\nX-Gardener-Destination: {DEST_ECHO}\r\n\r\n"),
        format!("CONNECT http://x:443/ HTTP/1.1\r\nX-Gardener-Destination: {DEST_ECHO}\r\n\r\n"),
        format!("CONNECT * HTTP/1.1\r\nX-Gardener-Destination: {DEST_ECHO}\r\n\r\n"),
    ] {
        let r = exchange(&gw, bad.as_bytes()).await;
        assert!(r.starts_with("HTTP/1.1 400"), "{bad:?} → {r}");
        assert_eq!(r.matches("HTTP/1.1").count(), 1);
    }
    for reason in [
        "not_connect",
        "destination_missing",
        "destination_duplicated",
        "destination_malformed",
        "framing_header_on_connect",
        "connect_target_malformed",
        "bare_cr_lf",
        "obs_fold",
        "control_byte",
        "line_too_long",
    ] {
        gw.wait_metric(&format!("seedlink_gateway_detect_failures_total{{listener=\"connect\",reason=\"{reason}\"}}"), 1.0)
            .await;
    }
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_mode_and_legacy_header_listener() {
    let stop = CancellationToken::new();
    let (gw, _pki) = setup(
        &stop,
        "  - {name: legacy, address: '127.0.0.1:0', protocol: http-connect, destination_header: Reversed-VPN, on_invalid_request: status}",
    )
    .await;
    let legacy = gw.listener("legacy");
    let ask = |msg: String| async move {
        let mut s = TcpStream::connect(legacy).await.unwrap();
        s.write_all(msg.as_bytes()).await.unwrap();
        let (data, r) = read_until_closed(&mut s, Duration::from_secs(10)).await;
        r.unwrap();
        String::from_utf8_lossy(&data).into_owned()
    };
    // The legacy listener only honours its own header.
    let r = ask(format!(
        "CONNECT x:443 HTTP/1.1\r\nX-Gardener-Destination: {DEST_ECHO}\r\n\r\n"
    ))
    .await;
    assert!(r.starts_with("HTTP/1.1 400"), "{r}");
    let r = ask("GET / HTTP/1.1\r\nHost: h\r\n\r\n".into()).await;
    assert!(r.starts_with("HTTP/1.1 405"), "{r}");
    let mut s = TcpStream::connect(legacy).await.unwrap();
    s.write_all(format!("CONNECT x:443 HTTP/1.0\r\nReversed-VPN: {DEST_ECHO}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let want = "HTTP/1.0 200 Connection established\r\n\r\n";
    let mut got = vec![0u8; want.len()];
    tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut got))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&got), want);
    echo_roundtrip(&mut s, b"vpn bytes").await.unwrap();
    gw.wait_metric(
        "seedlink_gateway_routed_total{listener=\"legacy\",protocol=\"http-connect:reversed-vpn\",control_plane=\"echo\"}",
        1.0,
    )
    .await;
    stop.cancel();
}

/// Envoy as Gardener's shoot-side apiserver-proxy (`tcp_proxy` +
/// `tunneling_config` with `hostname` and `headers_to_add`, HTTP/1.1 CONNECT)
/// in front of the gateway; curl reaches a TLS server that requires a client
/// certificate through Envoy's listener.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_apiserver_proxy_shape_through_the_gateway() {
    let envoy = require("envoy");
    let stop = CancellationToken::new();
    let (gw, pki) = setup(&stop, "").await;
    let files = write_pki(&pki, gw.dir.path());
    let port = free_port();
    let gw_connect = gw.listener("connect");
    let cfg = gw.dir.path().join("envoy.yaml");
    std::fs::write(
        &cfg,
        format!(
            "static_resources:
  listeners:
  - name: kube_apiserver
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    per_connection_buffer_limit_bytes: 32768
    filter_chains:
    - filters:
      - name: envoy.filters.network.tcp_proxy
        typed_config:
          '@type': type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy
          stat_prefix: kube_apiserver
          cluster: kube_apiserver
          tunneling_config:
            hostname: 'api.internal.example.com.:443'
            headers_to_add:
            - header: {{key: X-Gardener-Destination, value: '{DEST_ALPHA}'}}
  clusters:
  - name: kube_apiserver
    type: STATIC
    connect_timeout: 5s
    per_connection_buffer_limit_bytes: 32768
    load_assignment:
      cluster_name: kube_apiserver
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: {ip}, port_value: {gport}}}}}}}
",
            ip = gw_connect.ip(),
            gport = gw_connect.port()
        ),
    )
    .unwrap();
    let mut child = Command::new(envoy)
        .arg("-c")
        .arg(&cfg)
        .args(["--concurrency", "1", "-l", "error", "--use-dynamic-base-id"])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    wait_child_listening(&mut child, format!("127.0.0.1:{port}").parse().unwrap()).await;
    let body = curl_mtls(&files, ALPHA, std::net::Ipv4Addr::LOCALHOST.into(), port);
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        body.contains("hello from alpha") && !body.contains("client_certs=0"),
        "through Envoy: {body}"
    );
    gw.wait_metric(
        "seedlink_gateway_routed_total{listener=\"connect\",protocol=\"http-connect:x-gardener-destination\",control_plane=\"alpha\"}",
        1.0,
    )
    .await;
    stop.cancel();
}

/// Envoy as Kubermatic's envoy-agent: `tcp_proxy` tunnelling over explicit
/// HTTP/2 (HTTP/2 CONNECT, routed by `:authority`), many tunnels multiplexed
/// on one connection to the gateway.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_agent_http2_connect_many_streams() {
    let envoy = require("envoy");
    let stop = CancellationToken::new();
    let pki = seedlink::demo::Pki::generate(&[ALPHA]).unwrap();
    let a = demo_backend(&pki, 0, "alpha", &stop).await;
    let gw = Gw::start(&format!(
        "admin: {{listen: '127.0.0.1:0'}}
listeners: [{{name: tunneling, address: '127.0.0.1:0', protocol: http-connect}}]
control_planes:
  - name: alpha
    endpoints: ['{a}']
    destinations: [{{name: 'outbound|443||apiserver-external.cluster-abc.svc.cluster.local'}}]
"
    ));
    let files = write_pki(&pki, gw.dir.path());
    let port = free_port();
    let gwa = gw.listener("tunneling");
    let cfg = gw.dir.path().join("envoy-agent.yaml");
    std::fs::write(
        &cfg,
        format!(
            "static_resources:
  listeners:
  - name: apiserver
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.tcp_proxy
        typed_config:
          '@type': type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy
          stat_prefix: apiserver
          cluster: proxy_cluster
          tunneling_config: {{hostname: 'apiserver-external.cluster-abc.svc.cluster.local:443'}}
  clusters:
  - name: proxy_cluster
    type: STATIC
    connect_timeout: 5s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        '@type': type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config:
          http2_protocol_options:
            connection_keepalive: {{interval: 30s, timeout: 5s}}
    load_assignment:
      cluster_name: proxy_cluster
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: {ip}, port_value: {gport}}}}}}}
",
            ip = gwa.ip(),
            gport = gwa.port()
        ),
    )
    .unwrap();
    let mut child = Command::new(envoy)
        .arg("-c")
        .arg(&cfg)
        .args(["--concurrency", "1", "-l", "error", "--use-dynamic-base-id"])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    wait_child_listening(&mut child, format!("127.0.0.1:{port}").parse().unwrap()).await;
    // 16 clients at once: one HTTP/2 connection, 16 streams.
    let mut handles = Vec::new();
    for _ in 0..16 {
        let files = files.clone();
        handles.push(std::thread::spawn(move || {
            curl_mtls(&files, ALPHA, std::net::Ipv4Addr::LOCALHOST.into(), port)
        }));
    }
    let mut ok = 0;
    for h in handles {
        let out = h.join().unwrap();
        if out.contains("hello from alpha") {
            ok += 1;
        } else {
            eprintln!("curl via envoy-agent: {out}");
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(ok, 16);
    gw.wait_metric(
        "seedlink_gateway_routed_total{listener=\"tunneling\",protocol=\"http2-connect\",control_plane=\"alpha\"}",
        16.0,
    )
    .await;
    // Envoy multiplexed the tunnels: far fewer TCP connections than streams.
    let conns = gw
        .metric("seedlink_gateway_connections_total{listener=\"tunneling\"")
        .await
        + gw.metric("seedlink_gateway_active_connections{listener=\"tunneling\"}")
            .await;
    assert!(
        conns <= 4.0,
        "expected multiplexing, saw {conns} connections"
    );
    stop.cancel();
}

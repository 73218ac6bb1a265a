//! The legacy GEP-08 path: nginx stream with `proxy_protocol on` as the node
//! proxy, routed by the destination of its PROXY header; and HAProxy as the
//! LoadBalancer prepending its own header: routing uses the inner header,
//! the ACL the outer one. (Envoy cannot read both; this is why GEP-30 exists.)
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use seedlink_testkit as common;

use std::process::{Command, Stdio};

use common::*;
use tokio_util::sync::CancellationToken;

const ALPHA: &str = "api.alpha.legacy.test";

/// nginx in the foreground, single process, with a stream block.
fn nginx(dir: &std::path::Path, stream: &str) -> Proc {
    common::nginx(dir, &format!("stream {{\n{stream}\n}}"))
}

fn curl(files: &seedlink::demo::ClientFiles, ip: &str, port: u16) -> String {
    curl_mtls(files, ALPHA, ip.parse().unwrap(), port)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nginx_node_proxy_and_nested_haproxy_header() {
    let haproxy = require("haproxy");
    let stop = CancellationToken::new();
    let pki = seedlink::demo::Pki::generate(&[ALPHA]).unwrap();
    let a = demo_backend(&pki, 0, "alpha", &stop).await;
    // The node proxies listen on "service IPs" 127.0.0.77 and 127.0.0.78.
    let (svc_direct, svc_allowed, svc_denied) = (free_port(), free_port(), free_port());
    let gw = Gw::start(&format!(
        "admin: {{listen: '127.0.0.1:0'}}
listeners:
  - {{name: legacy, address: '127.0.0.1:0', protocol: proxy}}
  - {{name: legacy-lb, address: '127.0.0.1:0', protocol: proxy, proxy_protocol: required}}
trusted_load_balancers: [127.0.0.9/32]
control_planes:
  - name: alpha
    endpoints: ['{a}']
    service_addresses: ['127.0.0.77:{svc_direct}', '127.0.0.77:{svc_allowed}', '127.0.0.78:{svc_denied}']
    acl: {{allow: [127.0.0.1/32, 127.0.0.5/32]}}
"
    ));
    let files = write_pki(&pki, gw.dir.path());
    let hap_port = free_port();
    let hap_cfg = gw.dir.path().join("haproxy.cfg");
    std::fs::write(
        &hap_cfg,
        format!(
            "defaults
  mode tcp
  timeout connect 5s
  timeout client 30s
  timeout server 30s
frontend lb
  bind 127.0.0.1:{hap_port}
  default_backend gw
backend gw
  server gw {lb} send-proxy-v2 source 127.0.0.9
",
            lb = gw.listener("legacy-lb")
        ),
    )
    .unwrap();
    let _hap = Proc(
        Command::new(haproxy)
            .arg("-db")
            .arg("-f")
            .arg(&hap_cfg)
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    // GEP-08's node proxy: nginx stream, `proxy_protocol on`. Two of them go
    // through the LB from different node addresses (proxy_bind).
    let _ng = nginx(
        gw.dir.path(),
        &format!(
            "  server {{ listen 127.0.0.77:{svc_direct}; proxy_pass {direct}; proxy_protocol on; }}
  server {{ listen 127.0.0.77:{svc_allowed}; proxy_pass 127.0.0.1:{hap_port}; proxy_protocol on; proxy_bind 127.0.0.5; }}
  server {{ listen 127.0.0.78:{svc_denied}; proxy_pass 127.0.0.1:{hap_port}; proxy_protocol on; proxy_bind 127.0.0.6; }}",
            direct = gw.listener("legacy")
        ),
    );
    for (ip, p) in [
        ("127.0.0.77", svc_direct),
        ("127.0.0.77", svc_allowed),
        ("127.0.0.78", svc_denied),
    ] {
        wait_listening(format!("{ip}:{p}").parse().unwrap()).await;
    }
    wait_listening(format!("127.0.0.1:{hap_port}").parse().unwrap()).await;

    // Direct: nginx → gateway; the destination 127.0.0.77:svc_direct routes
    // to alpha; the ACL sees the TCP peer (127.0.0.1).
    let out = curl(&files, "127.0.0.77", svc_direct);
    assert!(
        out.contains("hello from alpha"),
        "direct legacy path: {out}"
    );
    // Nested: nginx (inner header) → HAProxy (outer header) → gateway.
    // Allowed: the outer header carries 127.0.0.5.
    let out = curl(&files, "127.0.0.77", svc_allowed);
    assert!(out.contains("hello from alpha"), "nested headers: {out}");
    // Denied: the outer header carries 127.0.0.6; the inner one names a
    // valid service address, but the ACL uses the outer client.
    let out = curl(&files, "127.0.0.78", svc_denied);
    assert!(
        !out.contains("hello from") && out.contains("curl: ("),
        "denied node got through: {out}"
    );
    gw.wait_metric(
        "seedlink_gateway_acl_denied_total{control_plane=\"alpha\"}",
        1.0,
    )
    .await;
    gw.wait_metric(
        "seedlink_gateway_routed_total{listener=\"legacy-lb\",protocol=\"proxy-protocol\",control_plane=\"alpha\"}",
        1.0,
    )
    .await;
    gw.wait_metric(
        "seedlink_gateway_routed_total{listener=\"legacy\",protocol=\"proxy-protocol\",control_plane=\"alpha\"}",
        1.0,
    )
    .await;
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_service_address_and_missing_header() {
    let stop = CancellationToken::new();
    let echo = echo_backend(&stop).await;
    let gw = Gw::start(&format!(
        "admin: {{listen: '127.0.0.1:0'}}
listeners: [{{name: legacy, address: '127.0.0.1:0', protocol: proxy}}]
control_planes:
  - {{name: e, endpoints: ['{echo}'], service_addresses: ['240.0.0.10:443']}}
"
    ));
    use tokio::io::AsyncWriteExt;
    let addr = gw.listener("legacy");
    // A known service address: the rest of the stream is proxied verbatim,
    // without the header.
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(b"PROXY TCP4 10.1.2.3 240.0.0.10 5555 443\r\n")
        .await
        .unwrap();
    echo_roundtrip(&mut s, b"payload after the header")
        .await
        .unwrap();
    for bad in [
        &b"PROXY TCP4 10.1.2.3 240.0.0.11 5555 443\r\n"[..],
        &b"\x16\x03\x01\x00\x05hello"[..],
        &b"\r\n\r\n\x00\r\nQUIT\n\x20\x00\x00\x00"[..],
    ] {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(bad).await.unwrap();
        let (data, r) = read_until_closed(&mut s, std::time::Duration::from_secs(10)).await;
        r.unwrap();
        assert!(data.is_empty());
    }
    for reason in [
        "unknown_service_address",
        "proxy_missing",
        "proxy_no_destination",
    ] {
        gw.wait_metric(
            &format!(
                "seedlink_gateway_detect_failures_total{{listener=\"legacy\",reason=\"{reason}\"}}"
            ),
            1.0,
        )
        .await;
    }
    stop.cancel();
}

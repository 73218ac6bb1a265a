//! End to end with peers nobody here wrote: curl, openssl s_client and
//! HAProxy in front as the opaque LoadBalancer.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use seedlink_testkit as common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;
use tokio_util::sync::CancellationToken;

const ALPHA: &str = "api.alpha.test.seedlink";
const BETA: &str = "api.beta.test.seedlink";

fn curl(
    files: &seedlink::demo::ClientFiles,
    host: &str,
    port: u16,
    extra: &[&str],
) -> std::process::Output {
    let mut c = Command::new(require("curl"));
    c.args(["-sS", "--max-time", "10", "--cacert"])
        .arg(&files.ca)
        .arg("--cert")
        .arg(&files.cert)
        .arg("--key")
        .arg(&files.key)
        .arg("--resolve")
        .arg(format!("{host}:{port}:127.0.0.1"))
        .args(extra)
        .arg(format!("https://{host}:{port}/"));
    c.output().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curl_and_openssl_with_client_certificates_end_to_end() {
    let stop = CancellationToken::new();
    let pki = seedlink::demo::Pki::generate(&[ALPHA, BETA]).unwrap();
    let a = demo_backend(&pki, 0, "alpha", &stop).await;
    let b = demo_backend(&pki, 1, "beta", &stop).await;
    let gw = Gw::start(&format!(
        "admin: {{listen: '127.0.0.1:0'}}
listeners: [{{name: tls, address: '127.0.0.1:0'}}]
control_planes:
  - {{name: alpha, hostnames: [{ALPHA}], endpoints: ['{a}']}}
  - {{name: beta, hostnames: ['*.beta.test.seedlink'], endpoints: ['{b}']}}
"
    ));
    let files = write_pki(&pki, gw.dir.path());
    let port = gw.tls.port();

    // curl with a client certificate: TLS ends at the demo kube-apiserver,
    // which requires and verifies the certificate.
    let out = curl(&files, ALPHA, port, &["--http1.1"]);
    let body = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "curl failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(body.contains("hello from alpha"), "{body}");
    assert!(!body.contains("client_certs=0"), "{body}");
    assert!(
        body.contains("alpn=http/1.1"),
        "ALPN must pass untouched: {body}"
    );
    // A wildcard route.
    let out = curl(&files, BETA, port, &[]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("hello from beta"));

    // Wrong SNI: the gateway closes without an upstream; curl fails.
    let out = curl(&files, "api.nope.other", port, &[]);
    assert!(!out.status.success());
    // Without a client certificate the kube-apiserver refuses: mTLS is end to end.
    let out = Command::new("curl")
        .args(["-sS", "--max-time", "10", "--cacert"])
        .arg(&files.ca)
        .arg("--resolve")
        .arg(format!("{ALPHA}:{port}:127.0.0.1"))
        .arg(format!("https://{ALPHA}:{port}/"))
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "a client without certificate must be refused by the upstream"
    );

    // openssl s_client, with a custom ALPN.
    let s_client = |servername: &str| {
        let mut child = Command::new(require("openssl"))
            .args([
                "s_client",
                "-connect",
                &gw.tls.to_string(),
                "-servername",
                servername,
                "-alpn",
                "seedlink-demo",
                "-quiet",
                "-CAfile",
            ])
            .arg(&files.ca)
            .arg("-cert")
            .arg(&files.cert)
            .arg("-key")
            .arg(&files.key)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        let mut stdin = child.stdin.take().unwrap();
        let _ = stdin.write_all(
            format!("GET / HTTP/1.1\r\nhost: {servername}\r\nconnection: close\r\n\r\n").as_bytes(),
        );
        // Keep stdin open until the server closes so s_client does not
        // send close_notify before the response.
        let out = wait_output(child, Duration::from_secs(15));
        drop(stdin);
        out
    };
    let out = s_client(ALPHA);
    assert!(
        out.contains("hello from alpha") && out.contains("alpn=seedlink-demo"),
        "openssl output: {out}"
    );
    // Case and one trailing dot do not matter for routing.
    let out = s_client("API.Beta.TEST.seedlink.");
    assert!(out.contains("hello from beta"), "openssl output: {out}");
    let out = s_client("api.wrong.example");
    assert!(
        !out.contains("hello from"),
        "wrong SNI must not reach any upstream: {out}"
    );

    assert!(
        gw.metric(
            "seedlink_gateway_detect_failures_total{listener=\"tls\",reason=\"unknown_sni\"}"
        )
        .await
            >= 2.0
    );
    stop.cancel();
}

fn wait_output(mut child: std::process::Child, limit: Duration) -> String {
    use std::io::Read;
    let end = std::time::Instant::now() + limit;
    loop {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        if std::time::Instant::now() > end {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut s = String::new();
    if let Some(mut o) = child.stdout.take() {
        let _ = o.read_to_string(&mut s);
    }
    s
}

/// HAProxy runs as the LoadBalancer: `send-proxy-v2` and `send-proxy` to the
/// gateway from 127.0.0.9 (trusted) and from 127.0.0.10 (not trusted).
/// Clients connect from 127.0.0.5 (allowed by alpha's ACL) and 127.0.0.6
/// (denied); the ACL must see those addresses, not HAProxy's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn haproxy_proxy_protocol_carries_the_client_ip_to_the_acl() {
    let haproxy = require("haproxy");
    let stop = CancellationToken::new();
    let pki = seedlink::demo::Pki::generate(&[ALPHA]).unwrap();
    let a = demo_backend(&pki, 0, "alpha", &stop).await;
    let gw = Gw::start(&format!(
        "admin: {{listen: '127.0.0.1:0'}}
listeners:
  - {{name: lb, address: '127.0.0.1:0', proxy_protocol: required}}
trusted_load_balancers: [127.0.0.9/32]
control_planes:
  - {{name: alpha, hostnames: [{ALPHA}], endpoints: ['{a}'], acl: {{allow: [127.0.0.5/32]}}}}
"
    ));
    let files = write_pki(&pki, gw.dir.path());
    let [v2, v1, untrusted] = [free_port(), free_port(), free_port()];
    let cfg = format!(
        "global
  maxconn 100
defaults
  mode tcp
  timeout connect 5s
  timeout client 30s
  timeout server 30s
frontend v2
  bind 127.0.0.1:{v2}
  default_backend gw_v2
frontend v1
  bind 127.0.0.1:{v1}
  default_backend gw_v1
frontend untrusted
  bind 127.0.0.1:{untrusted}
  default_backend gw_untrusted
backend gw_v2
  server gw {gwaddr} send-proxy-v2 source 127.0.0.9
backend gw_v1
  server gw {gwaddr} send-proxy source 127.0.0.9
backend gw_untrusted
  server gw {gwaddr} send-proxy-v2 source 127.0.0.10
",
        gwaddr = gw.tls
    );
    let cfg_path = gw.dir.path().join("haproxy.cfg");
    std::fs::write(&cfg_path, cfg).unwrap();
    let mut hap = Command::new(haproxy)
        .arg("-db")
        .arg("-f")
        .arg(&cfg_path)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    for p in [v2, v1, untrusted] {
        wait_listening(format!("127.0.0.1:{p}").parse().unwrap()).await;
    }

    for (port, kind) in [(v2, "v2"), (v1, "v1")] {
        let out = curl(&files, ALPHA, port, &["--interface", "127.0.0.5"]);
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("hello from alpha"),
            "PROXY {kind}: allowed client refused: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let out = curl(&files, ALPHA, port, &["--interface", "127.0.0.6"]);
        assert!(
            !out.status.success(),
            "PROXY {kind}: denied client got through"
        );
    }
    gw.wait_metric(
        "seedlink_gateway_acl_denied_total{control_plane=\"alpha\"}",
        2.0,
    )
    .await;

    // The same header from a peer that is not a trusted LB is rejected.
    let out = curl(&files, ALPHA, untrusted, &["--interface", "127.0.0.5"]);
    assert!(!out.status.success());
    gw.wait_metric(
        "seedlink_gateway_detect_failures_total{listener=\"lb\",reason=\"proxy_untrusted_peer\"}",
        1.0,
    )
    .await;
    // And a direct connection without PROXY header on a `required` listener.
    let out = curl(&files, ALPHA, gw.tls.port(), &["--interface", "127.0.0.5"]);
    assert!(!out.status.success());
    gw.wait_metric(
        "seedlink_gateway_detect_failures_total{listener=\"lb\",reason=\"proxy_untrusted_peer\"}",
        2.0,
    )
    .await;
    let _ = hap.kill();
    let _ = hap.wait();
    stop.cancel();
}

/// The destination the GEP-30 test's clients name.
const DEST: &str = "outbound|443||kube-apiserver.shoot--dev--alpha.svc.cluster.local";

/// Envoy as an HTTP/2 CONNECT client in front of the LB on port `lb`: one
/// listener per source address (`allowed` from 127.0.0.5 on `p_ok`,
/// `refused` from 127.0.0.6 on `p_no`), each tunnelling to the destination
/// with the `X-Gardener-Destination` header.
fn envoy_h2_tunnels(lb: u16, p_ok: u16, p_no: u16) -> String {
    let listener = |name: &str, port: u16| {
        format!(
            "  - name: {name}
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.tcp_proxy
        typed_config:
          '@type': type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy
          stat_prefix: {name}
          cluster: {name}
          tunneling_config:
            hostname: 'kube-apiserver.shoot--dev--alpha.svc.cluster.local:443'
            headers_to_add:
            - header: {{key: X-Gardener-Destination, value: '{DEST}'}}
"
        )
    };
    let cluster = |name: &str, source: &str| {
        format!(
            "  - name: {name}
    type: STATIC
    connect_timeout: 5s
    upstream_bind_config: {{source_address: {{address: {source}, port_value: 0}}}}
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        '@type': type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{http2_protocol_options: {{}}}}
    load_assignment:
      cluster_name: {name}
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {lb}}}}}}}
"
        )
    };
    format!(
        "static_resources:\n  listeners:\n{}{}  clusters:\n{}{}",
        listener("allowed", p_ok),
        listener("refused", p_no),
        cluster("allowed", "127.0.0.5"),
        cluster("refused", "127.0.0.6"),
    )
}

/// GEP-30 as written: the load balancer (HAProxy) sends PROXY v2 in front
/// of the `http-connect` listener, and the control plane's ACL decides on
/// the client address in that header, on the CONNECT path: HTTP/1.1 CONNECT
/// (curl, as Gardener's apiserver-proxy and VPN client send it) and HTTP/2
/// CONNECT (Envoy as Kubermatic's envoy-agent), each from an allowed and a
/// refused source address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gep30_the_lbs_proxy_header_decides_the_acl_on_connect() {
    let haproxy = require("haproxy");
    let envoy = require("envoy");
    let stop = CancellationToken::new();
    let pki = seedlink::demo::Pki::generate(&[ALPHA]).unwrap();
    let a = demo_backend(&pki, 0, "alpha", &stop).await;
    let gw = Gw::start(&format!(
        "admin: {{listen: '127.0.0.1:0'}}
listeners:
  - {{name: http-proxy, address: '127.0.0.1:0', protocol: http-connect, proxy_protocol: required}}
trusted_load_balancers: [127.0.0.9/32]
control_planes:
  - name: alpha
    endpoints: ['{a}']
    destinations: [{{name: '{DEST}'}}]
    acl: {{allow: [127.0.0.5/32]}}
"
    ));
    let files = write_pki(&pki, gw.dir.path());
    let lb = free_port();
    let cfg = format!(
        "global
  maxconn 100
defaults
  mode tcp
  timeout connect 5s
  timeout client 30s
  timeout server 30s
frontend lb
  bind 127.0.0.1:{lb}
  default_backend gw
backend gw
  server gw {gwaddr} send-proxy-v2 source 127.0.0.9
",
        gwaddr = gw.listener("http-proxy")
    );
    let cfg_path = gw.dir.path().join("haproxy.cfg");
    std::fs::write(&cfg_path, cfg).unwrap();
    let _hap = Proc(
        Command::new(haproxy)
            .arg("-db")
            .arg("-f")
            .arg(&cfg_path)
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_listening(format!("127.0.0.1:{lb}").parse().unwrap()).await;

    // HTTP/1.1 CONNECT with the destination header, from two sources.
    let connect = |source: &str| {
        curl_through_connect(
            &format!("127.0.0.1:{lb}"),
            &format!("X-Gardener-Destination: {DEST}"),
            &files,
            ALPHA,
            &["--interface", source],
        )
    };
    let allowed = connect("127.0.0.5");
    assert!(allowed.contains("hello from alpha"), "{allowed}");
    let refused = connect("127.0.0.6");
    assert!(
        !refused.contains("hello from alpha") && refused.contains("503"),
        "{refused}"
    );
    gw.wait_metric(
        "seedlink_gateway_acl_denied_total{control_plane=\"alpha\"}",
        1.0,
    )
    .await;

    // HTTP/2 CONNECT: Envoy tunnels over HTTP/2 to the LB, one listener per
    // source address. (The next refusal is the HTTP/2 stream's: one so far.)
    assert_eq!(
        gw.metric("seedlink_gateway_acl_denied_total{control_plane=\"alpha\"}")
            .await,
        1.0
    );
    let (p_ok, p_no) = (free_port(), free_port());
    let envoy_cfg = gw.dir.path().join("envoy.yaml");
    std::fs::write(&envoy_cfg, envoy_h2_tunnels(lb, p_ok, p_no)).unwrap();
    let _envoy = Proc(
        Command::new(envoy)
            .arg("-c")
            .arg(&envoy_cfg)
            .args(["--concurrency", "1", "-l", "error", "--use-dynamic-base-id"])
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    for p in [p_ok, p_no] {
        wait_listening(format!("127.0.0.1:{p}").parse().unwrap()).await;
    }
    let body = curl_mtls(&files, ALPHA, std::net::Ipv4Addr::LOCALHOST.into(), p_ok);
    assert!(body.contains("hello from alpha"), "HTTP/2, allowed: {body}");
    let body = curl_mtls(&files, ALPHA, std::net::Ipv4Addr::LOCALHOST.into(), p_no);
    assert!(
        !body.contains("hello from alpha"),
        "HTTP/2, refused: {body}"
    );
    gw.wait_metric(
        "seedlink_gateway_routed_total{listener=\"http-proxy\",protocol=\"http2-connect\",control_plane=\"alpha\"}",
        1.0,
    )
    .await;
    gw.wait_metric(
        "seedlink_gateway_acl_denied_total{control_plane=\"alpha\"}",
        2.0,
    )
    .await;
    stop.cancel();
}

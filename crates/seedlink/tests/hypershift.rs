//! HyperShift's node path: a node-side proxy prepends a PROXY v2 header
//! carrying the hosted cluster's ID in TLV 0x20 and passes TLS through; the
//! shared ingress routes by that ID and applies the control plane's client
//! ACL. The senders are Envoy 1.40 (`upstream_proxy_protocol` transport
//! socket with `added_tlvs`) and HAProxy 3.0 from Debian trixie
//! (`set-proxy-v2-tlv-fmt(0x20)`, as HyperShift's node proxy; bookworm's
//! 2.6 cannot send custom TLVs).
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use seedlink_testkit as common;

use common::*;
use tokio_util::sync::CancellationToken;

const ALPHA: &str = "api.alpha.hypershift.test";
const BETA: &str = "api.beta.hypershift.test";

/// One Envoy listener per entry, each forwarding to `gateway` with a PROXY
/// v2 header; `tlv` is the base64 value of TLV 0x20 (none: no TLV at all).
fn envoy(
    dir: &std::path::Path,
    gateway: std::net::SocketAddr,
    senders: &[(u16, Option<&str>)],
) -> Proc {
    let mut listeners = String::new();
    let mut clusters = String::new();
    for (i, (port, tlv)) in senders.iter().enumerate() {
        let added = tlv.map_or(String::new(), |v| {
            format!(", added_tlvs: [{{type: 32, value: '{v}'}}]")
        });
        listeners.push_str(&format!(
            "  - name: l{i}
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.tcp_proxy
        typed_config:
          '@type': type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy
          stat_prefix: l{i}
          cluster: c{i}
"
        ));
        clusters.push_str(&format!(
            "  - name: c{i}
    type: STATIC
    connect_timeout: 5s
    load_assignment:
      cluster_name: c{i}
      endpoints: [{{lb_endpoints: [{{endpoint: {{address: {{socket_address: {{address: {ip}, port_value: {gp}}}}}}}}}]}}]
    transport_socket:
      name: envoy.transport_sockets.upstream_proxy_protocol
      typed_config:
        '@type': type.googleapis.com/envoy.extensions.transport_sockets.proxy_protocol.v3.ProxyProtocolUpstreamTransport
        config: {{version: V2{added}}}
        transport_socket:
          name: envoy.transport_sockets.raw_buffer
          typed_config: {{'@type': type.googleapis.com/envoy.extensions.transport_sockets.raw_buffer.v3.RawBuffer}}
",
            ip = gateway.ip(),
            gp = gateway.port()
        ));
    }
    let cfg = dir.join("envoy.yaml");
    std::fs::write(
        &cfg,
        format!("static_resources:\n  listeners:\n{listeners}  clusters:\n{clusters}"),
    )
    .unwrap();
    common::envoy(dir, &cfg)
}

/// [`envoy`] on four free ports, listening on all of them: started again
/// on other ports (at most 3 times) if it exits first, as when another
/// test's listener took a port between `free_port` and Envoy's bind.
async fn envoy_listening(
    dir: &std::path::Path,
    gateway: std::net::SocketAddr,
    tlvs: [Option<&str>; 4],
) -> (Proc, [u16; 4]) {
    for _ in 0..3 {
        let ports = [free_port(), free_port(), free_port(), free_port()];
        let senders: Vec<(u16, Option<&str>)> = ports.iter().copied().zip(tlvs).collect();
        let mut e = envoy(dir, gateway, &senders);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while std::time::Instant::now() < deadline && e.0.try_wait().ok().flatten().is_none() {
            let mut up = true;
            for p in ports {
                up &= tokio::net::TcpStream::connect(("127.0.0.1", p))
                    .await
                    .is_ok();
            }
            if up {
                return (e, ports);
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }
    let log = std::fs::read_to_string(dir.join("envoy.log")).unwrap_or_default();
    panic!("Envoy did not listen on its ports in 3 starts; its log:\n{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_cluster_id_tlv_routes_and_acl_applies() {
    let stop = CancellationToken::new();
    let pki = seedlink::demo::Pki::generate(&[ALPHA, BETA]).unwrap();
    let a = demo_backend(&pki, 0, "alpha", &stop).await;
    let b = demo_backend(&pki, 1, "beta", &stop).await;
    // The cluster IDs: c-0a1b (alpha, no ACL), c-2c3d (beta, whose ACL does
    // not allow the node's address 127.0.0.1).
    let gw = Gw::start(&format!(
        "admin: {{listen: '127.0.0.1:0'}}
listeners:
  - {{name: nodes, address: '127.0.0.1:0', protocol: proxy, route_by_tlv: 0x20}}
control_planes:
  - {{name: alpha, endpoints: ['{a}'], cluster_id: c-0a1b}}
  - {{name: beta, endpoints: ['{b}'], cluster_id: c-2c3d, acl: {{allow: [10.0.0.0/8]}}}}
"
    ));
    let files = write_pki(&pki, gw.dir.path());
    let tlvs = [
        Some("Yy0wYTFi"), // c-0a1b
        Some("Yy0yYzNk"), // c-2c3d
        Some("Yy1mZmZm"), // c-ffff: no such cluster
        None,
    ];
    let (_envoy, ports) = envoy_listening(gw.dir.path(), gw.listener("nodes"), tlvs).await;
    let lo = "127.0.0.1".parse().unwrap();
    // Routed by the TLV, TLS end to end with the client certificate.
    let out = curl_mtls(&files, ALPHA, lo, ports[0]);
    assert!(out.contains("hello from alpha"), "cluster ID c-0a1b: {out}");
    // The SNI does not route on this listener: beta's name with alpha's ID
    // still reaches alpha's endpoint (which then refuses the unknown name
    // or answers; either way not beta).
    let out = curl_mtls(&files, BETA, lo, ports[0]);
    assert!(
        !out.contains("hello from beta"),
        "SNI routed instead of the TLV: {out}"
    );
    // Beta's ACL is ANDed with the TLV route.
    let out = curl_mtls(&files, BETA, lo, ports[1]);
    assert!(
        !out.contains("hello from") && out.contains("curl: ("),
        "beta's ACL let the node through: {out}"
    );
    // An unknown ID and a header without the TLV are refused.
    for p in [ports[2], ports[3]] {
        let out = curl_mtls(&files, ALPHA, lo, p);
        assert!(
            !out.contains("hello from") && out.contains("curl: ("),
            "port {p}: {out}"
        );
    }
    gw.wait_metric(
        "seedlink_gateway_routed_total{listener=\"nodes\",protocol=\"proxy-tlv\",control_plane=\"alpha\"}",
        2.0,
    )
    .await;
    gw.wait_metric(
        "seedlink_gateway_acl_denied_total{control_plane=\"beta\"}",
        1.0,
    )
    .await;
    for reason in ["unknown_cluster_id", "cluster_id_missing"] {
        gw.wait_metric(
            &format!(
                "seedlink_gateway_detect_failures_total{{listener=\"nodes\",reason=\"{reason}\"}}"
            ),
            1.0,
        )
        .await;
    }

    // HyperShift's own node proxy is HAProxy (`send-proxy-v2` with
    // `set-proxy-v2-tlv-fmt(0x20)`, 2.9+): Debian trixie's 3.0 as a second
    // sender, the same routing.
    let hp = free_port();
    let _hap = haproxy3_run(
        gw.dir.path(),
        "node-haproxy",
        &format!(
            "defaults
  mode tcp
  timeout connect 10s
  timeout client 60s
  timeout server 60s
frontend local
  bind 127.0.0.1:{hp}
  default_backend apiserver
backend apiserver
  server api {} send-proxy-v2 set-proxy-v2-tlv-fmt(0x20) c-0a1b
",
            gw.listener("nodes")
        ),
    );
    wait_listening(format!("127.0.0.1:{hp}").parse().unwrap()).await;
    let out = curl_mtls(&files, ALPHA, lo, hp);
    assert!(out.contains("hello from alpha"), "HAProxy 3 sender: {out}");
    gw.wait_metric(
        "seedlink_gateway_routed_total{listener=\"nodes\",protocol=\"proxy-tlv\",control_plane=\"alpha\"}",
        3.0,
    )
    .await;
    stop.cancel();
}

#[test]
fn route_by_tlv_needs_a_proxy_listener_and_unique_cluster_ids() {
    let bad = "listeners:
  - {name: tls, address: '127.0.0.1:0', route_by_tlv: 0x20}
control_planes:
  - {name: a, endpoints: ['127.0.0.1:1'], cluster_id: same}
  - {name: b, endpoints: ['127.0.0.1:2'], cluster_id: same}
  - {name: c, endpoints: ['127.0.0.1:3'], cluster_id: 'has space'}
";
    let file = seedlink_config::compile::parse(bad).unwrap();
    let err = seedlink_config::compile(file, None)
        .unwrap_err()
        .to_string();
    for want in [
        "listeners[0].route_by_tlv",
        "control_planes[1].cluster_id",
        "control_planes[2].cluster_id",
    ] {
        assert!(err.contains(want), "missing {want} in:\n{err}");
    }
}

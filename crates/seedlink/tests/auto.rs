//! The `auto` listener: TLS, HTTP/1 CONNECT and legacy PROXY on one port,
//! told apart from the first bytes.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use seedlink_testkit as common;

use std::time::Duration;

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

const DEST: &str = "shoot--dev--e--kube-apiserver-socket";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_port_for_tls_connect_and_legacy_proxy() {
    let stop = CancellationToken::new();
    let echo = echo_backend(&stop).await;
    let gw = Gw::start(&format!(
        "admin: {{listen: '127.0.0.1:0'}}
listeners: [{{name: any, address: '127.0.0.1:0', protocol: auto}}]
control_planes:
  - name: e
    hostnames: [api.alpha.example.com]
    endpoints: ['{echo}']
    destinations: [{{name: '{DEST}'}}]
    service_addresses: ['240.0.0.10:443']
"
    ));
    let addr = gw.listener("any");

    // TLS: routed by SNI, the hello replayed byte-exact.
    let mut s = TcpStream::connect(addr).await.unwrap();
    echo_roundtrip(&mut s, HELLO_ALPHA).await.unwrap();

    // HTTP/1 CONNECT (sent in small pieces: "P", "OST"-like prefixes wait).
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(b"CON").await.unwrap();
    s.flush().await.unwrap();
    s.write_all(
        format!("NECT x:443 HTTP/1.1\r\nX-Gardener-Destination: {DEST}\r\n\r\nping").as_bytes(),
    )
    .await
    .unwrap();
    let want = "HTTP/1.1 200 Connection established\r\n\r\nping";
    let mut got = vec![0u8; want.len()];
    tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut got))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&got), want);

    // Legacy PROXY v1 from a node proxy, split inside the signature.
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(b"PRO").await.unwrap();
    s.flush().await.unwrap();
    s.write_all(b"XY TCP4 10.0.0.1 240.0.0.10 5555 443\r\n")
        .await
        .unwrap();
    echo_roundtrip(&mut s, b"legacy payload").await.unwrap();

    // Garbage is refused (HTTP/2 prior knowledge goes to the h2 path, tested
    // with Envoy in connect.rs).
    for (bytes, reason) in [(&b"\x00\x01\x02"[..], "unrecognized_protocol")] {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(bytes).await.unwrap();
        let (data, r) = read_until_closed(&mut s, Duration::from_secs(10)).await;
        r.unwrap();
        assert!(data.is_empty());
        gw.wait_metric(
            &format!(
                "seedlink_gateway_detect_failures_total{{listener=\"any\",reason=\"{reason}\"}}"
            ),
            1.0,
        )
        .await;
    }
    for protocol in [
        "tls-sni",
        "http-connect:x-gardener-destination",
        "proxy-protocol",
    ] {
        gw.wait_metric(
            &format!("seedlink_gateway_routed_total{{listener=\"any\",protocol=\"{protocol}\",control_plane=\"e\"}}"),
            1.0,
        )
        .await;
    }
    stop.cancel();
}

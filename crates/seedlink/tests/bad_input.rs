//! Bad input on the TLS and PROXY paths: each case is closed cleanly, counted
//! by reason, and the gateway keeps serving others meanwhile.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use seedlink_testkit as common;

use std::time::Duration;

use common::*;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

fn v2_header(fam: u8, body: &[u8]) -> Vec<u8> {
    let mut m = b"\r\n\r\n\0\r\nQUIT\n".to_vec();
    // Family 0 is only used here with the LOCAL command.
    m.push(if fam == 0 { 0x20 } else { 0x21 });
    m.push(fam);
    m.extend_from_slice(&u16::try_from(body.len()).unwrap().to_be_bytes());
    m.extend_from_slice(body);
    m
}

/// Sends `bytes` (optionally half-closing), expects the gateway to close
/// with a clean FIN and no data.
async fn expect_closed(addr: std::net::SocketAddr, bytes: &[u8], half_close: bool) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(bytes).await.unwrap();
    if half_close {
        s.shutdown().await.unwrap();
    }
    let (data, r) = read_until_closed(&mut s, Duration::from_secs(10)).await;
    r.unwrap_or_else(|e| {
        panic!(
            "expected a clean close for {:?}: {e}",
            &bytes[..bytes.len().min(16)]
        )
    });
    assert!(data.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_closed_and_counted_by_reason() {
    let stop = CancellationToken::new();
    let echo = echo_backend(&stop).await;
    let gw = Gw::start(&format!(
        "admin: {{listen: '127.0.0.1:0'}}
listeners:
  - {{name: tls, address: '127.0.0.1:0'}}
  - {{name: lb, address: '127.0.0.1:0', proxy_protocol: required}}
trusted_load_balancers: [127.0.0.1/32]
timeouts: {{client_hello: 700ms}}
control_planes:
  - {{name: alpha, hostnames: [api.alpha.example.com], endpoints: ['{echo}']}}
"
    ));
    let tls = gw.listener("tls");
    let lb = gw.listener("lb");
    let reason = |l: &str, r: &str| {
        format!("seedlink_gateway_detect_failures_total{{listener=\"{l}\",reason=\"{r}\"}}")
    };

    // A silent connection is held while the rest runs: the gateway must keep
    // serving others, then close it at the deadline.
    let mut silent = TcpStream::connect(tls).await.unwrap();

    expect_closed(tls, b"GET / HTTP/1.1\r\nhost: x\r\n\r\n", false).await;
    expect_closed(tls, &HELLO_ALPHA[..100], true).await;
    let mut oversized = vec![22, 3, 1, 0x40, 0x00, 1, 0, 0x3f, 0xfc];
    oversized.extend_from_slice(&[0u8; 64]);
    let gw_big = oversized.clone();
    expect_closed(tls, &gw_big, false).await;
    expect_closed(tls, b"\x80\x2e\x01\x00\x02\x00\x15\x00\x00\x00\x10", false).await;
    // A valid hello without SNI.
    let mut body = vec![3, 3];
    body.extend_from_slice(&[0; 32]);
    body.extend_from_slice(&[0, 0, 2, 0x13, 0x01, 1, 0]);
    let mut no_sni = vec![
        22,
        3,
        1,
        0,
        u8::try_from(body.len() + 4).unwrap(),
        1,
        0,
        0,
        u8::try_from(body.len()).unwrap(),
    ];
    no_sni.extend_from_slice(&body);
    expect_closed(tls, &no_sni, false).await;
    // A hello with a session id longer than 32 bytes.
    let mut bad = HELLO_ALPHA.to_vec();
    bad[43] = 33;
    expect_closed(tls, &bad, false).await;
    // A PROXY header on a listener that does not expect one.
    expect_closed(tls, b"PROXY TCP4 1.2.3.4 5.6.7.8 1 2\r\n", false).await;

    // Meanwhile a good client, sending its hello one byte at a time.
    let mut good = TcpStream::connect(tls).await.unwrap();
    for b in HELLO_ALPHA {
        good.write_all(&[*b]).await.unwrap();
        good.flush().await.unwrap();
    }
    let mut back = vec![0u8; HELLO_ALPHA.len()];
    tokio::time::timeout(
        Duration::from_secs(10),
        tokio::io::AsyncReadExt::read_exact(&mut good, &mut back),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(
        back, HELLO_ALPHA,
        "the upstream received the hello byte-exact, once"
    );
    echo_roundtrip(&mut good, b"after the hello").await.unwrap();

    // PROXY listener: garbage, v1 without CRLF, v2 with a short address block,
    // a non-unicast address.
    expect_closed(lb, b"PROXY garbage garbage\r\n", false).await;
    let mut no_crlf = b"PROXY TCP4 10.0.0.1 10.0.0.2 1111 443 ".to_vec();
    no_crlf.resize(110, b'x');
    expect_closed(lb, &no_crlf, false).await;
    expect_closed(lb, &v2_header(0x11, &[10, 0, 0, 1, 10, 0, 0, 2]), false).await;
    expect_closed(
        lb,
        &v2_header(0x11, &[224, 0, 0, 1, 10, 0, 0, 2, 0, 1, 1, 187]),
        false,
    )
    .await;
    expect_closed(lb, b"\x16\x03\x01\x00\x05hello", false).await;
    // LOCAL (an LB health check) is accepted, then the LB closes.
    expect_closed(lb, &v2_header(0x00, &[]), true).await;
    // A valid v2 header followed by the hello routes normally.
    let mut ok = TcpStream::connect(lb).await.unwrap();
    let mut msg = v2_header(0x11, &[192, 0, 2, 1, 127, 0, 0, 1, 0x12, 0x34, 1, 187]);
    msg.extend_from_slice(HELLO_ALPHA);
    ok.write_all(&msg).await.unwrap();
    let mut back = vec![0u8; HELLO_ALPHA.len()];
    tokio::time::timeout(
        Duration::from_secs(10),
        tokio::io::AsyncReadExt::read_exact(&mut ok, &mut back),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(
        back, HELLO_ALPHA,
        "the PROXY header is not forwarded upstream"
    );

    // The silent connection is closed at the deadline.
    let (_, r) = read_until_closed(&mut silent, Duration::from_secs(10)).await;
    r.unwrap();

    for (l, r, n) in [
        ("tls", "not_tls", 1.0),
        ("tls", "eof", 1.0),
        ("tls", "hello_too_large", 1.0),
        ("tls", "sslv2", 1.0),
        ("tls", "no_sni", 1.0),
        ("tls", "malformed_hello", 1.0),
        ("tls", "proxy_untrusted_peer", 1.0),
        ("tls", "timeout", 1.0),
        ("lb", "proxy_malformed", 3.0),
        ("lb", "proxy_bad_address", 1.0),
        ("lb", "proxy_missing", 1.0),
    ] {
        gw.wait_metric(&reason(l, r), n).await;
    }
    gw.wait_metric("seedlink_gateway_connections_total{listener=\"lb\",control_plane=\"\",outcome=\"lb_health_check\"}", 1.0)
        .await;
    // A TCP probe (kubelet, a LoadBalancer, a node proxy's readiness check)
    // connects and closes without a byte: counted as such, not as a
    // detection failure.
    let eof_before = gw.metric(&reason("tls", "eof")).await;
    drop(TcpStream::connect(tls).await.unwrap());
    gw.wait_metric("seedlink_gateway_connections_total{listener=\"tls\",control_plane=\"\",outcome=\"tcp_probe\"}", 1.0)
        .await;
    assert_eq!(gw.metric(&reason("tls", "tcp_probe")).await, 0.0);
    assert_eq!(gw.metric(&reason("tls", "eof")).await, eof_before);
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_close_at_once_and_are_counted() {
    let stop = CancellationToken::new();
    let echo = echo_backend(&stop).await;
    let gw = Gw::start(&format!(
        "admin: {{listen: '127.0.0.1:0'}}
listeners: [{{name: tls, address: '127.0.0.1:0'}}]
limits: {{max_connections: 4, max_unrouted_per_source: 2}}
timeouts: {{client_hello: 60s}}
control_planes:
  - {{name: alpha, hostnames: [api.alpha.example.com], endpoints: ['{echo}']}}
"
    ));
    // Two unrouted connections from 127.0.0.1 fill its per-source quota...
    let _a = TcpStream::connect(gw.tls).await.unwrap();
    let _b = TcpStream::connect(gw.tls).await.unwrap();
    gw.wait_metric("seedlink_gateway_active_connections{listener=\"tls\"}", 2.0)
        .await;
    let mut c = TcpStream::connect(gw.tls).await.unwrap();
    let (_, r) = read_until_closed(&mut c, Duration::from_secs(5)).await;
    r.unwrap();
    gw.wait_metric(
        "seedlink_gateway_detect_failures_total{listener=\"tls\",reason=\"per_source_limit\"}",
        1.0,
    )
    .await;
    // ...while another source address is still served.
    let from = |ip: &str| {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.bind(format!("{ip}:0").parse().unwrap()).unwrap();
        sock.connect(gw.tls)
    };
    let mut d = from("127.0.0.2").await.unwrap();
    echo_roundtrip(&mut d, HELLO_ALPHA).await.unwrap();
    let mut e = from("127.0.0.3").await.unwrap();
    echo_roundtrip(&mut e, HELLO_ALPHA).await.unwrap();
    // All count against max_connections (4): a, b, d, e are open.
    gw.wait_metric("seedlink_gateway_active_connections{listener=\"tls\"}", 4.0)
        .await;
    let mut f = from("127.0.0.4").await.unwrap();
    let (_, r) = read_until_closed(&mut f, Duration::from_secs(5)).await;
    let _ = r;
    gw.wait_metric(
        "seedlink_gateway_refused_total{listener=\"tls\",reason=\"max_connections\"}",
        1.0,
    )
    .await;
    // The open ones are unaffected.
    echo_roundtrip(&mut e, b"still here").await.unwrap();
    stop.cancel();
}

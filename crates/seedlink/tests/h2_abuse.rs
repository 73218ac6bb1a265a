//! HTTP/2 abuse on the CONNECT listener: a rapid-reset flood and a stream
//! flood end the abusive connection with a counted reason, while another
//! client's tunnel keeps working.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use seedlink_testkit as common;

use std::time::Duration;

use common::*;
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

const DEST: &str = "outbound|443||echo.shoot--dev--e.svc.cluster.local";

async fn h2_client(
    addr: std::net::SocketAddr,
) -> (
    h2::client::SendRequest<bytes::Bytes>,
    tokio::task::JoinHandle<Result<(), h2::Error>>,
) {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (client, conn) = h2::client::handshake(tcp).await.unwrap();
    (client, tokio::spawn(conn))
}

fn connect_req() -> http::Request<()> {
    http::Request::builder()
        .method(http::Method::CONNECT)
        .uri("echo.shoot--dev--e.svc.cluster.local:443")
        .body(())
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rapid_reset_is_cut_off_and_others_keep_working() {
    let stop = CancellationToken::new();
    let echo = echo_backend(&stop).await;
    let gw = Gw::start(&format!(
        "admin: {{listen: '127.0.0.1:0'}}
listeners: [{{name: t, address: '127.0.0.1:0', protocol: http-connect}}]
control_planes:
  - {{name: e, endpoints: ['{echo}'], destinations: [{{name: '{DEST}'}}]}}
"
    ));
    let addr = gw.listener("t");

    // A well-behaved tunnel, open for the whole test.
    let (client, _conn) = h2_client(addr).await;
    let mut good = client.ready().await.unwrap();
    let (resp, mut send) = good.send_request(connect_req(), false).unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(10), resp)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    send.send_data(bytes::Bytes::from_static(b"before"), false)
        .unwrap();
    let got = tokio::time::timeout(Duration::from_secs(10), body.data())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(&got[..], b"before");
    let _ = body.flow_control().release_capacity(got.len());

    // The attacker: open and immediately reset streams, thousands of times.
    let (attacker, attacker_conn) = h2_client(addr).await;
    let mut attacker = attacker;
    let flood = async {
        for _ in 0..5000 {
            let Ok(mut a) = attacker.clone().ready().await else {
                return;
            };
            let Ok((_r, mut s)) = a.send_request(connect_req(), false) else {
                return;
            };
            s.send_reset(h2::Reason::CANCEL);
            attacker = a;
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(30), flood).await;
    // The gateway ends the attacker's connection.
    let ended = tokio::time::timeout(Duration::from_secs(10), attacker_conn).await;
    assert!(ended.is_ok(), "the attacking connection was not closed");
    // Ended by h2's accept-queue limit or by the gateway's own count of
    // streams reset while their dial was under way, whichever came first.
    eventually("the cut to be counted", Duration::from_secs(10), async || {
        let m = gw.metrics().await;
        let cut = ["h2_protocol_error", "h2_reset_flood"].iter().map(|o| {
            sum_metric(&m, &format!("seedlink_gateway_connections_total{{listener=\"t\",control_plane=\"\",outcome=\"{o}\"}}"))
        }).sum::<f64>();
        ok_if(cut >= 1.0, || m.clone())
    })
    .await;

    // The good tunnel still works.
    send.send_data(bytes::Bytes::from_static(b"after"), false)
        .unwrap();
    let got = tokio::time::timeout(Duration::from_secs(10), body.data())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(&got[..], b"after");
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_authority_and_non_connect_are_refused_per_stream() {
    let stop = CancellationToken::new();
    let echo = echo_backend(&stop).await;
    let gw = Gw::start(&format!(
        "admin: {{listen: '127.0.0.1:0'}}
listeners: [{{name: t, address: '127.0.0.1:0', protocol: http-connect}}]
control_planes:
  - {{name: e, endpoints: ['{echo}'], destinations: [{{name: '{DEST}'}}], acl: {{allow: [127.0.0.0/8]}}}}
"
    ));
    let (client, _conn) = h2_client(gw.listener("t")).await;
    let mut c = client.ready().await.unwrap();
    let status = |req: http::Request<()>, c: &mut h2::client::SendRequest<bytes::Bytes>| {
        let (resp, _s) = c.send_request(req, true).unwrap();
        async move {
            tokio::time::timeout(Duration::from_secs(10), resp)
                .await
                .unwrap()
                .unwrap()
                .status()
        }
    };
    let unknown = http::Request::builder()
        .method(http::Method::CONNECT)
        .uri("other.shoot--x.svc.cluster.local:443")
        .body(())
        .unwrap();
    assert_eq!(status(unknown, &mut c).await, 503);
    let mut c = c.ready().await.unwrap();
    let get = http::Request::builder()
        .method(http::Method::GET)
        .uri("http://x/")
        .body(())
        .unwrap();
    assert_eq!(status(get, &mut c).await, 405);
    let mut c = c.ready().await.unwrap();
    assert_eq!(status(connect_req(), &mut c).await, 200);
    stop.cancel();
}

/// HTTP/2 connections that send the preface and SETTINGS and answer PINGs
/// but open no stream are unrouted: they count against the per-source cap
/// (the ones past it are refused at once) and are closed at the detection
/// deadline. Before, 100 of them stayed open forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_connections_without_streams_are_capped_and_closed() {
    let stop = CancellationToken::new();
    let echo = echo_backend(&stop).await;
    let gw = Gw::start(&format!(
        "admin: {{listen: '127.0.0.1:0'}}
timeouts: {{client_hello: 1s}}
limits: {{max_unrouted_per_source: 4}}
listeners: [{{name: t, address: '127.0.0.1:0', protocol: http-connect}}]
control_planes:
  - {{name: e, endpoints: ['{echo}'], destinations: [{{name: '{DEST}'}}]}}
"
    ));
    let addr = gw.listener("t");
    let mut conns = Vec::new();
    for _ in 0..8 {
        let tcp = TcpStream::connect(addr).await.unwrap();
        // The handshake itself may fail for the refused ones.
        if let Ok((client, conn)) = h2::client::handshake(tcp).await {
            conns.push((client, tokio::spawn(conn)));
        }
    }
    gw.wait_metric(
        "seedlink_gateway_detect_failures_total{listener=\"t\",reason=\"per_source_limit\"}",
        4.0,
    )
    .await;
    // Every connection ends (the driver task completes) well within the
    // 1 s idle deadline plus generous slack.
    for (_client, task) in conns {
        let ended = tokio::time::timeout(Duration::from_secs(15), task).await;
        assert!(ended.is_ok(), "an idle HTTP/2 connection stayed open");
    }
    stop.cancel();
}

//! The splice pipe pool is visible: after bulk transfers end, the pipes the
//! pool created stay open and idle (expected, not a leak), and the gauge
//! says how many, so a descriptor-based leak alarm can subtract them.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use seedlink_testkit as common;

use common::*;
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pipe_pool_is_a_gauge_and_keeps_its_pipes_idle() {
    let stop = CancellationToken::new();
    let echo = echo_backend(&stop).await;
    let gw = Gw::start(&format!(
        "admin: {{listen: '127.0.0.1:0'}}
listeners: [{{name: tls, address: '127.0.0.1:0', protocol: tls}}]
limits: {{copy: splice, splice_pipes: 64}}
control_planes:
  - {{name: e, hostnames: [api.alpha.example.com], endpoints: ['{echo}']}}
"
    ));
    let m = gw.metrics().await;
    assert_eq!(
        sum_metric(&m, "seedlink_gateway_splice_pipes{state=\"open\"}"),
        0.0,
        "{m}"
    );
    // Four bulk echoes at once: each direction switches to splice after
    // its first full read and leases a pipe.
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let addr = gw.listener("tls");
        tasks.push(tokio::spawn(async move {
            let mut s = TcpStream::connect(addr).await.unwrap();
            let mut data = HELLO_ALPHA.to_vec();
            data.extend(std::iter::repeat_n(0x5a, 4 << 20));
            echo_roundtrip(&mut s, &data).await.unwrap();
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    // The connections end just after the clients saw their bytes.
    let (open, idle, m) = eventually(
        "every pipe idle",
        std::time::Duration::from_secs(10),
        async || {
            let m = gw.metrics().await;
            let open = sum_metric(&m, "seedlink_gateway_splice_pipes{state=\"open\"}");
            let idle = sum_metric(&m, "seedlink_gateway_splice_pipes{state=\"idle\"}");
            let active = sum_metric(&m, "seedlink_gateway_active_connections");
            if active == 0.0 && open == idle {
                Ok((open, idle, m))
            } else {
                Err(m)
            }
        },
    )
    .await;
    assert!((1.0..=64.0).contains(&open), "open pipes: {m}");
    assert_eq!(open, idle);
    stop.cancel();
}

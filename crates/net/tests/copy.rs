//! Byte-exactness, half-close and reset propagation on both copy paths,
//! over real loopback sockets.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use rand::RngCore;
use seedlink_net::copy::{Copier, CopyMode, Transfer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Returns (client end, proxy's client-side socket, proxy's upstream socket, upstream end).
async fn wire() -> (TcpStream, TcpStream, TcpStream, TcpStream) {
    let l1 = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let l2 = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (client, accepted) =
        tokio::join!(TcpStream::connect(l1.local_addr().unwrap()), l1.accept());
    let (proxy_up, accepted_up) =
        tokio::join!(TcpStream::connect(l2.local_addr().unwrap()), l2.accept());
    (
        client.unwrap(),
        accepted.unwrap().0,
        proxy_up.unwrap(),
        accepted_up.unwrap().0,
    )
}

fn spawn_proxy(
    mode: CopyMode,
    a: TcpStream,
    b: TcpStream,
) -> tokio::task::JoinHandle<(std::io::Result<()>, Arc<Transfer>)> {
    let copier = Arc::new(Copier::new(mode, 4));
    let t = Arc::new(Transfer::default());
    tokio::spawn(async move {
        let r = copier.run(&a, &b, &t.to_upstream, &t.to_client).await;
        (r, t)
    })
}

async fn half_close_and_exact(mode: CopyMode) {
    let (mut client, pa, pb, mut upstream) = wire().await;
    let proxy = spawn_proxy(mode, pa, pb);
    let mut up_data = vec![0u8; 3 * 1024 * 1024 + 17];
    rand::rng().fill_bytes(&mut up_data);
    let mut down_data = vec![0u8; 2 * 1024 * 1024 + 5];
    rand::rng().fill_bytes(&mut down_data);

    // Client sends everything then half-closes; the upstream must see EOF
    // after exactly those bytes, and can still answer afterwards.
    let up_copy = up_data.clone();
    let writer = tokio::spawn(async move {
        client.write_all(&up_copy).await.unwrap();
        client.shutdown().await.unwrap();
        let mut got = Vec::new();
        client.read_to_end(&mut got).await.unwrap();
        got
    });
    let mut got = Vec::new();
    upstream.read_to_end(&mut got).await.unwrap();
    assert!(got == up_data, "upstream received different bytes");
    upstream.write_all(&down_data).await.unwrap();
    upstream.shutdown().await.unwrap();
    let back = tokio::time::timeout(Duration::from_secs(20), writer)
        .await
        .unwrap()
        .unwrap();
    assert!(back == down_data, "client received different bytes");
    let (r, t) = tokio::time::timeout(Duration::from_secs(5), proxy)
        .await
        .unwrap()
        .unwrap();
    r.unwrap();
    assert_eq!(
        t.to_upstream.load(std::sync::atomic::Ordering::Relaxed),
        up_data.len() as u64
    );
    assert_eq!(
        t.to_client.load(std::sync::atomic::Ordering::Relaxed),
        down_data.len() as u64
    );
}

async fn reset_propagates(mode: CopyMode) {
    let (mut client, pa, pb, upstream) = wire().await;
    let proxy = spawn_proxy(mode, pa, pb);
    client.write_all(b"hello").await.unwrap();
    let mut upstream = upstream;
    let mut buf = [0u8; 5];
    upstream.read_exact(&mut buf).await.unwrap();
    // The upstream resets.
    socket2::SockRef::from(&upstream)
        .set_linger(Some(Duration::ZERO))
        .unwrap();
    drop(upstream);
    let mut rest = Vec::new();
    let err = tokio::time::timeout(Duration::from_secs(5), client.read_to_end(&mut rest))
        .await
        .unwrap()
        .expect_err("client must see a reset, not a clean end");
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionReset);
    let (r, _) = proxy.await.unwrap();
    assert!(r.is_err());
}

#[tokio::test]
async fn splice_half_close_and_byte_exact() {
    half_close_and_exact(CopyMode::Splice).await;
}

#[tokio::test]
async fn buffered_half_close_and_byte_exact() {
    half_close_and_exact(CopyMode::Buffered).await;
}

/// Writes `data` on `from` while reading it on `to`; asserts it arrives whole.
async fn bulk_through(from: &mut TcpStream, to: &mut TcpStream, data: &[u8]) {
    let (w, r) = tokio::join!(from.write_all(data), async {
        let mut got = vec![0u8; data.len()];
        tokio::time::timeout(Duration::from_secs(20), to.read_exact(&mut got))
            .await
            .map(|r| r.map(|_| got))
    });
    w.unwrap();
    assert!(r.unwrap().unwrap() == data, "bulk arrived different");
}

/// Splice mode starts each direction with small user-space reads and
/// switches to splice after a full one: request/response exchanges, then
/// bulk in both directions, then small messages again on the same
/// connection must all arrive byte-exact and in order.
#[tokio::test]
async fn splice_mode_small_exchanges_then_bulk_then_small() {
    let (mut client, pa, pb, mut upstream) = wire().await;
    let proxy = spawn_proxy(CopyMode::Splice, pa, pb);
    let deadline = Duration::from_secs(20);
    for i in 0..20u8 {
        let req = vec![i; 1 + usize::from(i) * 50];
        client.write_all(&req).await.unwrap();
        let mut got = vec![0u8; req.len()];
        tokio::time::timeout(deadline, upstream.read_exact(&mut got))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(got, req, "request {i}");
        upstream.write_all(&req[..req.len() / 2 + 1]).await.unwrap();
        let mut back = vec![0u8; req.len() / 2 + 1];
        tokio::time::timeout(deadline, client.read_exact(&mut back))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(back, req[..req.len() / 2 + 1], "response {i}");
    }
    let mut bulk = vec![0u8; 1024 * 1024 + 3];
    rand::rng().fill_bytes(&mut bulk);
    bulk_through(&mut client, &mut upstream, &bulk).await;
    bulk_through(&mut upstream, &mut client, &bulk).await;
    client.write_all(b"after").await.unwrap();
    let mut got = [0u8; 5];
    tokio::time::timeout(deadline, upstream.read_exact(&mut got))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&got, b"after");
    drop(client);
    drop(upstream);
    let (r, t) = tokio::time::timeout(Duration::from_secs(5), proxy)
        .await
        .unwrap()
        .unwrap();
    r.unwrap();
    let small: u64 = (0..20u64).map(|i| 1 + i * 50).sum();
    assert_eq!(
        t.to_upstream.load(std::sync::atomic::Ordering::Relaxed),
        small + bulk.len() as u64 + 5
    );
}

#[tokio::test]
async fn splice_reset_reaches_client_as_reset() {
    reset_propagates(CopyMode::Splice).await;
}

#[tokio::test]
async fn buffered_reset_reaches_client_as_reset() {
    reset_propagates(CopyMode::Buffered).await;
}

/// With a pool of one pipe, several concurrent transfers must still all be
/// byte-exact (the others fall back to the buffered path chunk by chunk).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipe_pool_exhaustion_falls_back() {
    let copier = Arc::new(Copier::new(CopyMode::Splice, 1));
    let mut tasks = Vec::new();
    for _ in 0..6 {
        let copier = copier.clone();
        tasks.push(tokio::spawn(async move {
            let (mut client, pa, pb, mut upstream) = wire().await;
            let t = Arc::new(Transfer::default());
            let p =
                tokio::spawn(
                    async move { copier.run(&pa, &pb, &t.to_upstream, &t.to_client).await },
                );
            let mut data = vec![0u8; 512 * 1024];
            rand::rng().fill_bytes(&mut data);
            let d2 = data.clone();
            let w = tokio::spawn(async move {
                client.write_all(&d2).await.unwrap();
                client.shutdown().await.unwrap();
                client
            });
            let mut got = Vec::new();
            upstream.read_to_end(&mut got).await.unwrap();
            assert!(got == data);
            drop(upstream);
            drop(w.await.unwrap());
            p.await.unwrap().unwrap();
        }));
    }
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(30), t)
            .await
            .unwrap()
            .unwrap();
    }
}

/// A client that half-closed and an upstream that never answers: after the
/// half-closed limit both sides are reset; an answer that keeps trickling
/// (each byte within the limit) keeps the connection alive.
#[tokio::test]
async fn a_silent_half_closed_copy_is_reset_after_its_limit() {
    for mode in [CopyMode::Splice, CopyMode::Buffered] {
        let (mut client, pa, pb, mut upstream) = wire().await;
        let copier = Arc::new(Copier::new(mode, 4));
        copier.set_half_closed(Duration::from_millis(1500));
        let t = Arc::new(Transfer::default());
        let proxy = {
            let (copier, t) = (copier.clone(), t.clone());
            tokio::spawn(async move { copier.run(&pa, &pb, &t.to_upstream, &t.to_client).await })
        };
        client.write_all(b"request").await.unwrap();
        client.shutdown().await.unwrap();
        let mut req = [0u8; 7];
        upstream.read_exact(&mut req).await.unwrap();
        // Trickle 10 bytes, 250 ms apart (the gaps are the behaviour under
        // test): 2.5 s in all, beyond the limit, each gap well within it.
        for b in b"answer-0123"[..10].iter() {
            upstream.write_all(&[*b]).await.unwrap();
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        let mut got = [0u8; 10];
        client.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"answer-012");
        // Then silence: the copy ends with an error within a few seconds.
        let r = tokio::time::timeout(Duration::from_secs(10), proxy)
            .await
            .expect("the half-closed copy was not ended")
            .unwrap();
        assert_eq!(
            r.unwrap_err().kind(),
            std::io::ErrorKind::TimedOut,
            "{mode:?}"
        );
        let mut rest = Vec::new();
        let e = tokio::time::timeout(Duration::from_secs(5), client.read_to_end(&mut rest))
            .await
            .unwrap();
        assert_eq!(
            e.unwrap_err().kind(),
            std::io::ErrorKind::ConnectionReset,
            "{mode:?}"
        );
    }
}

/// The upstream sends its whole answer and FIN; the client reads it slowly,
/// long past the half-closed limit: every byte arrives, then a clean end
/// (the limit never cuts an answer that was complete).
#[tokio::test]
async fn a_complete_answer_read_late_is_not_cut() {
    for mode in [CopyMode::Splice, CopyMode::Buffered] {
        let (mut client, pa, pb, mut upstream) = wire().await;
        let copier = Arc::new(Copier::new(mode, 4));
        copier.set_half_closed(Duration::from_millis(500));
        let t = Arc::new(Transfer::default());
        let proxy = {
            let (copier, t) = (copier.clone(), t.clone());
            tokio::spawn(async move { copier.run(&pa, &pb, &t.to_upstream, &t.to_client).await })
        };
        let mut answer = vec![0u8; 4 * 1024 * 1024];
        rand::rng().fill_bytes(&mut answer);
        let sent = answer.clone();
        let writer = tokio::spawn(async move {
            upstream.write_all(&sent).await.unwrap();
            upstream.shutdown().await.unwrap();
            upstream
        });
        // A slow reader (the pauses are the behaviour under test): 32 KiB
        // every 20 ms, 2.6 s for the answer, five times the limit, while
        // the end of it waits in the proxy's socket buffers.
        let mut got = Vec::new();
        let mut chunk = vec![0u8; 32 * 1024];
        loop {
            let n = tokio::time::timeout(Duration::from_secs(20), client.read(&mut chunk))
                .await
                .unwrap()
                .unwrap_or_else(|e| panic!("{mode:?}: {e} after {} bytes", got.len()));
            if n == 0 {
                break;
            }
            got.extend_from_slice(&chunk[..n]);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(
            got == answer,
            "{mode:?}: {} of {} bytes",
            got.len(),
            answer.len()
        );
        drop(client);
        let _upstream = writer.await.unwrap();
        let r = tokio::time::timeout(Duration::from_secs(10), proxy)
            .await
            .unwrap()
            .unwrap();
        assert!(r.is_ok(), "{mode:?}: {r:?}");
    }
}

/// Short messages in turn, each sent only after the previous one came
/// through, then a FIN each way: every short read clears the readiness
/// (`read_drained`), so each later message and the FIN must still wake
/// the copy. The last FIN goes out with the close, not a `shutdown`.
async fn short_messages_then_fins(mode: CopyMode) {
    let (mut client, pa, pb, mut upstream) = wire().await;
    let proxy = spawn_proxy(mode, pa, pb);
    let mut buf = [0u8; 64];
    for i in 0..50u8 {
        let msg = [b'q', i];
        client.write_all(&msg).await.unwrap();
        let n = tokio::time::timeout(Duration::from_secs(10), upstream.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(&buf[..n], &msg, "request {i}");
        let answer = [b'a', i, i];
        upstream.write_all(&answer).await.unwrap();
        let n = tokio::time::timeout(Duration::from_secs(10), client.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(&buf[..n], &answer, "answer {i}");
    }
    upstream.shutdown().await.unwrap();
    let n = tokio::time::timeout(Duration::from_secs(10), client.read(&mut buf))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(n, 0, "the upstream's FIN reaches the client");
    client.shutdown().await.unwrap();
    let n = tokio::time::timeout(Duration::from_secs(10), upstream.read(&mut buf))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(n, 0, "the client's FIN reaches the upstream");
    let (r, _) = tokio::time::timeout(Duration::from_secs(10), proxy)
        .await
        .unwrap()
        .unwrap();
    r.unwrap();
}

#[tokio::test]
async fn short_messages_in_turn_on_a_current_thread_runtime() {
    short_messages_then_fins(CopyMode::Splice).await;
    short_messages_then_fins(CopyMode::Buffered).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_messages_in_turn_on_a_multi_thread_runtime() {
    short_messages_then_fins(CopyMode::Splice).await;
    short_messages_then_fins(CopyMode::Buffered).await;
}

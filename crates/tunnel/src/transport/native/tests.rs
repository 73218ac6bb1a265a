#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Instant as StdInstant;

use futures_util::StreamExt;

use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::frame::*;
use super::handshake::*;
use super::reader::*;
use super::writer::*;
use crate::stream::flow::FairQueue;
use crate::wire::proto::{Packet, Payload};

fn samples() -> Vec<Packet> {
    let mut with_error = Packet::data(9, Bytes::from_static(b"x"));
    if let Some(Payload::Data(d)) = &mut with_error.payload {
        d.error = "oops".into();
    }
    vec![
        Packet::data(1, Bytes::from_static(b"hello")),
        Packet::data(0, Bytes::from(vec![7u8; 300])),
        Packet::data(-5, Bytes::from(vec![1u8; 70_000])),
        Packet::data(i64::MAX, Bytes::from_static(b"z")),
        Packet::data(3, Bytes::new()),
        with_error,
        Packet::dial_req("10.0.0.1:443", 42),
        Packet::dial_rsp(42, 7, String::new()),
        Packet::close_req(7),
        Packet::drain(),
        Packet::window_update(3, 65536),
    ]
}

#[test]
fn heads_encode_like_prost() {
    for p in samples() {
        let mut heads = BytesMut::new();
        let data = encode_head(p.clone(), &mut heads);
        let mut frame = heads.to_vec();
        if let Some(d) = data {
            frame.extend_from_slice(&d);
        }
        let body = p.encode_to_vec();
        assert_eq!(frame[0], PACKET);
        assert_eq!(&frame[1..5], &(body.len() as u32).to_be_bytes());
        assert_eq!(&frame[5..], &body[..], "{p:?}");
    }
}

#[test]
fn frame_heads_are_checked_before_anything_is_allocated() {
    let head = |kind: u8, len: u32| {
        let mut h = [kind, 0, 0, 0, 0];
        h[1..].copy_from_slice(&len.to_be_bytes());
        h
    };
    assert!(matches!(
        check_head(head(9, 0)),
        Err(WireError::UnknownFrame(9))
    ));
    assert!(matches!(
        check_head(head(PACKET, u32::MAX)),
        Err(WireError::TooLarge { .. })
    ));
    assert!(matches!(
        check_head(head(PING, 1)),
        Err(WireError::TooLarge { .. })
    ));
    assert!(matches!(
        check_head(head(OPEN, MAX_META as u32 + 1)),
        Err(WireError::TooLarge { .. })
    ));
    assert_eq!(check_head(head(PACKET, 10)).unwrap(), (PACKET, 10));
}

/// Before the OPEN (the peer may be anonymous: client certificates are
/// optional when a cluster takes tokens) only an OPEN of at most
/// [`MAX_META`] is read: a 4 MiB PACKET announced first is refused from
/// its head, the body is never read or allocated (the rest stays unread).
#[tokio::test]
async fn before_the_open_only_a_small_open_is_read() {
    let mut frame = vec![PACKET];
    frame.extend_from_slice(&(MAX_PACKET as u32).to_be_bytes());
    frame.extend_from_slice(&[0u8; 64]);
    let mut rd = &frame[..];
    assert!(matches!(
        accept(&mut rd).await,
        Err(WireError::Unexpected(PACKET))
    ));
    assert_eq!(rd.len(), 64, "nothing past the head was read");
    let mut big_open = vec![OPEN];
    big_open.extend_from_slice(&(MAX_META as u32 + 1).to_be_bytes());
    let mut rd = &big_open[..];
    assert!(matches!(
        accept(&mut rd).await,
        Err(WireError::TooLarge { .. })
    ));
    // The agent likewise reads only an ANSWER or REFUSED from the server.
    let (mut a, mut b) = tokio::io::duplex(1 << 16);
    let server = tokio::spawn(async move {
        let _ = accept(&mut b).await;
        let mut head = vec![PACKET];
        head.extend_from_slice(&(MAX_PACKET as u32).to_be_bytes());
        tokio::io::AsyncWriteExt::write_all(&mut b, &head)
            .await
            .unwrap();
        b
    });
    let r = open(&mut a, &[("agentid", "a".to_string())]).await;
    assert!(matches!(r, Err(WireError::Unexpected(PACKET))), "{r:?}");
    drop(server.await.unwrap());
}

#[test]
fn metadata_must_be_header_lines() {
    let m = decode_meta(b"agentid:a\nagentidentifiers:host=x&ipv4=1.2.3.4\n").unwrap();
    assert_eq!(m.get("agentid").unwrap(), "a");
    assert!(decode_meta(b"no colon\n").is_err());
    assert!(decode_meta(b"bad key:v\n").is_err());
    assert!(decode_meta(b"k:\x01\n").is_err());
    assert!(decode_meta(&[0xff, b':', b'v']).is_err());
    assert!(encode_meta(&[("agentid", "a\nb")]).is_err());
    assert!(encode_meta(&[("Bad Key", "v")]).is_err());
}

#[test]
fn a_refusal_carries_code_and_message() {
    let s = status_of(b"16 token refused");
    assert_eq!(s.code(), tonic::Code::Unauthenticated);
    assert_eq!(s.message(), "token refused");
    assert_eq!(status_of(b"junk").code(), tonic::Code::Unknown);
}

#[test]
fn keepalive_pings_after_the_interval_and_gives_up_after_the_timeout() {
    let t0 = StdInstant::now();
    let s = Duration::from_secs;
    let (every, timeout) = (s(30), s(10));
    assert_eq!(
        keepalive(t0, t0, None, every, timeout),
        Keep::Wait(t0 + s(30))
    );
    assert_eq!(
        keepalive(t0 + s(30), t0, None, every, timeout),
        Keep::Ping(t0 + s(40))
    );
    // A late look still gives the peer the whole timeout after the PING.
    assert_eq!(
        keepalive(t0 + s(100), t0, None, every, timeout),
        Keep::Ping(t0 + s(110))
    );
    let pinged = Some(t0 + s(30));
    assert_eq!(
        keepalive(t0 + s(39), t0, pinged, every, timeout),
        Keep::Wait(t0 + s(40))
    );
    assert_eq!(
        keepalive(t0 + s(40), t0, pinged, every, timeout),
        Keep::Dead
    );
}

/// A writer over one end of a pipe, an [`Inbound`] over the other.
fn pair() -> (Arc<FairQueue>, Inbound<tokio::io::DuplexStream>) {
    let (a, b) = tokio::io::duplex(1 << 16);
    let q = FairQueue::new();
    tokio::spawn(write_loop(
        a,
        q.clone(),
        Control::new(),
        Duration::from_secs(60),
    ));
    let inbound = Inbound::new(
        b,
        Control::new(),
        Duration::from_secs(3600),
        Duration::from_secs(60),
    );
    (q, inbound)
}

/// One side over a pipe, as the roles run it (one lock, a writer task, a
/// reader): its queue, its reader, and the peer's end of the pipe.
struct Side {
    queue: Arc<FairQueue>,
    inbound: Inbound<Shared<tokio::io::DuplexStream>>,
    peer: tokio::io::DuplexStream,
}

fn side(pipe: usize, keepalive: (Duration, Duration), stall: Duration) -> Side {
    let (mine, peer) = tokio::io::duplex(pipe);
    let (rd, wr) = split(mine);
    let ctl = Control::new();
    let queue = FairQueue::new();
    tokio::spawn(write_loop(wr, queue.clone(), ctl.clone(), stall));
    let inbound = Inbound::new(rd, ctl, keepalive.0, keepalive.1);
    Side {
        queue,
        inbound,
        peer,
    }
}

const QUIET: (Duration, Duration) = (Duration::from_secs(3600), Duration::from_secs(60));
const PATIENT: Duration = Duration::from_secs(60);

#[tokio::test]
async fn packets_arrive_whole_and_in_order() {
    let (q, mut inbound) = pair();
    let sent = samples();
    for p in &sent {
        q.control(p.clone()).unwrap();
    }
    for p in &sent {
        let got = inbound.next().await.unwrap().unwrap();
        assert_eq!(&got, p);
    }
    q.close();
    assert!(inbound.next().await.is_none(), "a clean end");
}

#[tokio::test]
async fn a_silent_peer_is_pinged_and_then_given_up() {
    let ms = Duration::from_millis;
    let Side {
        mut inbound, peer, ..
    } = side(1 << 16, (ms(20), ms(20)), PATIENT);
    let (mut their_rd, _their_wr) = tokio::io::split(peer);
    let reader = tokio::spawn(async move {
        let mut head = [0u8; HEAD];
        their_rd.read_exact(&mut head).await.unwrap();
        head
    });
    let end = tokio::time::timeout(Duration::from_secs(30), inbound.next())
        .await
        .expect("the keepalive gives up");
    assert!(matches!(end, Some(Err(WireError::Silent(_)))), "{end:?}");
    assert_eq!(reader.await.unwrap(), [PING, 0, 0, 0, 0]);
    assert!(inbound.next().await.is_none());
}

#[tokio::test]
async fn a_ping_is_answered_with_one_pong() {
    let Side {
        mut inbound, peer, ..
    } = side(1 << 16, QUIET, PATIENT);
    let (mut their_rd, mut their_wr) = tokio::io::split(peer);
    their_wr.write_all(&[PING, 0, 0, 0, 0]).await.unwrap();
    their_wr.write_all(&[PACKET, 0, 0, 0, 0]).await.unwrap();
    // The empty packet decodes (to a packet the link machines refuse).
    assert!(inbound.next().await.unwrap().is_ok());
    let mut head = [0u8; HEAD];
    their_rd.read_exact(&mut head).await.unwrap();
    assert_eq!(head, [PONG, 0, 0, 0, 0]);
}

#[tokio::test]
async fn hostile_frames_end_the_stream_with_a_reason() {
    for (bytes, want) in [
        (vec![9u8, 0, 0, 0, 0], "unknown frame type 9"),
        (vec![PACKET, 0xff, 0xff, 0xff, 0xff], "over the limit"),
        (vec![OPEN, 0, 0, 0, 0], "unexpected frame type 3"),
        (vec![PACKET, 0, 0, 0, 9, 1, 2], "ended inside a frame"),
        (vec![PACKET, 0, 0], "ended inside a frame"),
        (vec![PACKET, 0, 0, 0, 2, 0xff, 0xff], "does not decode"),
    ] {
        let (mine, mut theirs) = tokio::io::duplex(1 << 16);
        theirs.write_all(&bytes).await.unwrap();
        drop(theirs);
        let mut inbound = Inbound::new(
            mine,
            Control::new(),
            Duration::from_secs(3600),
            Duration::from_secs(60),
        );
        let got = inbound.next().await.unwrap();
        let text = got.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(text.contains(want), "{bytes:?}: {text}");
        assert!(inbound.next().await.is_none());
    }
}

#[tokio::test]
async fn the_handshake_carries_metadata_and_refusals() {
    let (mut agent, mut server) = tokio::io::duplex(1 << 16);
    let srv = tokio::spawn(async move {
        let meta = accept(&mut server).await.unwrap();
        assert_eq!(meta.get("agentid").unwrap(), "a1");
        let mut answer_meta = tonic::metadata::MetadataMap::new();
        answer_meta.insert("serverid", "s1".parse().unwrap());
        answer(&mut server, &answer_meta).await.unwrap();
        server
    });
    let got = open(&mut agent, &[("agentid", "a1".to_string())])
        .await
        .unwrap();
    let Opened::Answer(m) = got else {
        panic!("{got:?}")
    };
    assert_eq!(m.get("serverid").unwrap(), "s1");
    drop(srv.await.unwrap());

    let (mut agent, mut server) = tokio::io::duplex(1 << 16);
    tokio::spawn(async move {
        let _ = accept(&mut server).await;
        refuse(
            &mut server,
            &tonic::Status::unauthenticated("token refused"),
        )
        .await
    });
    let got = open(&mut agent, &[("agentid", "a1".to_string())])
        .await
        .unwrap();
    let Opened::Refused(s) = got else {
        panic!("{got:?}")
    };
    assert_eq!(s.code(), tonic::Code::Unauthenticated);
}

#[tokio::test]
async fn a_peer_that_reads_nothing_fails_the_writer_and_ends_the_stream() {
    let Side {
        queue: q,
        mut inbound,
        peer: _peer,
    } = side(1024, QUIET, Duration::from_millis(50));
    q.control(Packet::data(1, Bytes::from(vec![0u8; 100_000])))
        .unwrap();
    let end = tokio::time::timeout(Duration::from_secs(30), inbound.next())
        .await
        .expect("the stalled writer ends the stream");
    assert!(matches!(end, Some(Err(WireError::Writer(_)))), "{end:?}");
    assert!(q.next().await.is_none(), "the queue is closed");
}

/// PINGs past the stream's budget of idle frames end the stream: a peer
/// cannot keep a reader busy with frames that move nothing.
#[tokio::test]
async fn pings_past_the_budget_end_the_stream() {
    let Side {
        mut inbound, peer, ..
    } = side(1 << 20, QUIET, PATIENT);
    let (_their_rd, mut their_wr) = tokio::io::split(peer);
    let flood = [PING, 0, 0, 0, 0].repeat(crate::stream::flood::BURST as usize * 3);
    tokio::spawn(async move {
        let _ = their_wr.write_all(&flood).await;
        their_wr
    });
    let end = tokio::time::timeout(Duration::from_secs(30), inbound.next())
        .await
        .expect("the flood ends the stream");
    assert!(matches!(end, Some(Err(WireError::Flood))), "{end:?}");
}

#[tokio::test]
async fn a_flood_of_pings_is_read_in_slices_and_answered() {
    let Side {
        mut inbound, peer, ..
    } = side(1 << 20, QUIET, PATIENT);
    let (mut their_rd, mut their_wr) = tokio::io::split(peer);
    // Within the stream's budget of idle frames (flood.rs), more than a
    // poll's slice.
    let mut flood = [PING, 0, 0, 0, 0].repeat(crate::stream::flood::BURST as usize - 1);
    let mut heads = BytesMut::new();
    let data = encode_head(Packet::data(5, Bytes::from_static(b"after")), &mut heads);
    flood.extend_from_slice(&heads);
    flood.extend_from_slice(&data.unwrap());
    their_wr.write_all(&flood).await.unwrap();
    let got = inbound.next().await.unwrap().unwrap();
    assert_eq!(got, Packet::data(5, Bytes::from_static(b"after")));
    // Answered (PONGs owed are coalesced: one flag, not a counter).
    let mut head = [0u8; HEAD];
    tokio::time::timeout(Duration::from_secs(30), their_rd.read_exact(&mut head))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(head, [PONG, 0, 0, 0, 0]);
}

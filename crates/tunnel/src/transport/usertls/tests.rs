//! The in-process TLS 1.3 record layer against rustls's own buffered
//! implementation (tokio-rustls) as the other side, and against bytes a
//! hostile peer writes after the handshake.

use std::io;
use std::sync::Arc;

use futures_util::FutureExt;
use rustls::crypto::cipher::OutboundChunks;
use rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use rustls::ContentType;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::handshake::*;
use super::state::*;

struct Pki {
    server: Arc<rustls::ServerConfig>,
    client: Arc<rustls::ClientConfig>,
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn pki() -> Pki {
    let ck = rcgen::generate_simple_self_signed(vec!["tunnel".to_string()]).unwrap();
    let cert = ck.cert.der().clone();
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(ck.signing_key.serialize_der()));
    let mut server = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![cert.clone()], key)
        .unwrap();
    server.alpn_protocols = vec![b"test/1".to_vec()];
    prepare_server(&mut server);
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert).unwrap();
    let mut client = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    client.alpn_protocols = vec![b"test/1".to_vec()];
    prepare_client(&mut client);
    Pki {
        server: Arc::new(server),
        client: Arc::new(client),
    }
}

fn name() -> ServerName<'static> {
    ServerName::try_from("tunnel").unwrap()
}

async fn pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let (c, s) = tokio::join!(TcpStream::connect(addr), l.accept());
    (c.unwrap(), s.unwrap().0)
}

/// Ours as the client, rustls's buffered server as the peer.
async fn ours_to_rustls(
    pki: &Pki,
) -> (
    UserTls<TcpStream>,
    tokio_rustls::server::TlsStream<TcpStream>,
) {
    let (c, s) = pair().await;
    let acc = tokio_rustls::TlsAcceptor::from(pki.server.clone());
    let (ours, theirs) = tokio::join!(connect(pki.client.clone(), name(), c), acc.accept(s));
    (ours.unwrap(), theirs.unwrap())
}

/// Ours as the server, rustls's buffered client as the peer.
async fn rustls_to_ours(
    pki: &Pki,
) -> (
    UserTls<TcpStream>,
    tokio_rustls::client::TlsStream<TcpStream>,
) {
    let (c, s) = pair().await;
    let con = tokio_rustls::TlsConnector::from(pki.client.clone());
    let (theirs, ours) = tokio::join!(con.connect(name(), c), accept(pki.server.clone(), s));
    (ours.unwrap(), theirs.unwrap())
}

/// Ours on both sides: (client, server).
async fn ours_to_ours(pki: &Pki) -> (UserTls<TcpStream>, UserTls<TcpStream>) {
    let (c, s) = pair().await;
    let (client, server) = tokio::join!(
        connect(pki.client.clone(), name(), c),
        accept(pki.server.clone(), s)
    );
    (client.unwrap(), server.unwrap())
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Writes `data` on `w` while reading as much from `r`; both must match.
async fn exchange<A, B>(a: &mut A, b: &mut B, len: usize)
where
    A: AsyncRead + AsyncWrite + Unpin,
    B: AsyncRead + AsyncWrite + Unpin,
{
    let sent = pattern(len, 7);
    let mut got = vec![0u8; len];
    let (w, r) = tokio::join!(
        async {
            a.write_all(&sent).await?;
            a.flush().await
        },
        b.read_exact(&mut got)
    );
    w.unwrap();
    r.unwrap();
    assert!(got == sent, "bytes differ after {len}");
}

#[tokio::test]
async fn bytes_cross_both_ways_with_rustls_on_either_side() {
    let pki = pki();
    let (mut ours, mut theirs) = ours_to_rustls(&pki).await;
    assert_eq!(ours.session().alpn.as_deref(), Some(&b"test/1"[..]));
    assert!(!ours.session().peer_certificates.is_empty());
    exchange(&mut ours, &mut theirs, 3 << 20).await;
    exchange(&mut theirs, &mut ours, 3 << 20).await;
    exchange(&mut ours, &mut theirs, 1).await;

    let (mut ours, mut theirs) = rustls_to_ours(&pki).await;
    assert_eq!(ours.session().alpn.as_deref(), Some(&b"test/1"[..]));
    assert!(ours.session().peer_certificates.is_empty());
    exchange(&mut theirs, &mut ours, 3 << 20).await;
    exchange(&mut ours, &mut theirs, 3 << 20).await;
}

#[tokio::test]
async fn vectored_writes_are_sealed_whole_and_in_order() {
    let pki = pki();
    let (mut ours, mut theirs) = ours_to_rustls(&pki).await;
    let parts: Vec<Vec<u8>> = (0..40).map(|i| pattern(1000 + i * 97, i as u8)).collect();
    let slices: Vec<io::IoSlice<'_>> = parts.iter().map(|p| io::IoSlice::new(p)).collect();
    let n = ours.write_vectored(&slices).await.unwrap();
    let all: Vec<u8> = parts.concat();
    assert_eq!(n, all.len(), "under the queue bound, all is taken at once");
    ours.flush().await.unwrap();
    let mut got = vec![0u8; n];
    theirs.read_exact(&mut got).await.unwrap();
    assert!(got == all);
}

#[tokio::test]
async fn key_updates_asked_by_the_peer_are_followed_and_answered() {
    let pki = pki();
    let (mut ours, mut theirs) = ours_to_rustls(&pki).await;
    for _ in 0..3 {
        // rustls's refresh asks for ours back: both directions change keys.
        theirs.get_mut().1.refresh_traffic_keys().unwrap();
        exchange(&mut theirs, &mut ours, 100_000).await;
        exchange(&mut ours, &mut theirs, 100_000).await;
    }
    let (mut ours, mut theirs) = rustls_to_ours(&pki).await;
    theirs.get_mut().1.refresh_traffic_keys().unwrap();
    exchange(&mut theirs, &mut ours, 100_000).await;
    exchange(&mut ours, &mut theirs, 100_000).await;
}

#[tokio::test]
async fn the_sending_key_is_updated_before_its_limit() {
    let pki = pki();
    let (mut ours, mut theirs) = rustls_to_ours(&pki).await;
    ours.tx_limit = 3;
    // 40 records: a dozen key updates the peer must follow.
    exchange(&mut ours, &mut theirs, 40 * MAX_PLAINTEXT).await;
    exchange(&mut theirs, &mut ours, 1000).await;
}

#[tokio::test]
async fn close_notify_is_an_end_and_a_cut_connection_an_error() {
    let pki = pki();
    let (mut ours, mut theirs) = ours_to_rustls(&pki).await;
    theirs.write_all(b"last").await.unwrap();
    theirs.shutdown().await.unwrap();
    let mut got = Vec::new();
    ours.read_to_end(&mut got).await.unwrap();
    assert_eq!(got, b"last");
    ours.shutdown().await.unwrap();
    let mut rest = Vec::new();
    theirs.read_to_end(&mut rest).await.unwrap();
    assert!(rest.is_empty());

    let (mut ours, theirs) = ours_to_rustls(&pki).await;
    drop(theirs);
    let e = ours.read(&mut [0u8; 10]).await.unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
}

#[tokio::test]
async fn an_idle_stream_holds_no_read_buffer() {
    let pki = pki();
    let (mut ours, mut theirs) = ours_to_rustls(&pki).await;
    exchange(&mut theirs, &mut ours, 200_000).await;
    let mut one = [0u8; 1];
    assert!(
        ours.read(&mut one).now_or_never().is_none(),
        "nothing to read"
    );
    assert_eq!(ours.rbuf.capacity(), 0);
    assert_eq!(ours.wq.capacity(), 0);
    exchange(&mut theirs, &mut ours, 10).await;
}

#[tokio::test]
async fn a_flood_of_empty_records_yields_and_then_delivers() {
    let pki = pki();
    let (mut ours, mut peer) = ours_to_rustls(&pki).await;
    // Ours on both sides would be simpler, but the peer here must be the
    // sender of the empty records: use a second pair, ours to ours.
    drop(peer.shutdown().await);
    let (mut sender, mut receiver) = ours_to_ours(&pki).await;
    for _ in 0..(RECORDS_PER_POLL * 3) {
        sender
            .seal(ContentType::ApplicationData, OutboundChunks::new_empty())
            .unwrap();
    }
    exchange(&mut sender, &mut receiver, 5).await;
    drop(ours.shutdown().await);
}

/// After a good handshake, the peer writes `raw` under the TLS layer.
async fn hostile_bytes(raw: &[u8]) -> io::Error {
    let pki = pki();
    let (mut ours, mut theirs) = ours_to_rustls(&pki).await;
    theirs.get_mut().0.write_all(raw).await.unwrap();
    theirs.get_mut().0.shutdown().await.unwrap();
    let mut sink = Vec::new();
    let e = ours.read_to_end(&mut sink).await.unwrap_err();
    let again = ours.read(&mut [0u8; 4]).await.unwrap_err();
    assert_eq!(again.kind(), e.kind());
    // A protocol error is kept for writes too; a cut connection is only
    // the reading side's end.
    if e.kind() == io::ErrorKind::InvalidData {
        assert!(ours.write_all(b"x").await.is_err());
    }
    e
}

#[tokio::test]
async fn hostile_records_fail_the_stream_with_a_reason() {
    // A plaintext handshake record after the handshake.
    let e = hostile_bytes(&[22, 3, 3, 0, 4, 1, 0, 0, 0]).await;
    assert!(e.to_string().contains("record type 22"), "{e}");
    // A length past the largest ciphertext.
    let e = hostile_bytes(&[23, 3, 3, 0xff, 0xff]).await;
    assert!(e.to_string().contains("oversized"), "{e}");
    // A wrong legacy version.
    let e = hostile_bytes(&[23, 3, 1, 0, 20]).await;
    assert!(e.to_string().contains("version"), "{e}");
    // Forged ciphertext.
    let mut forged = vec![23, 3, 3, 0, 40];
    forged.extend(pattern(40, 3));
    let e = hostile_bytes(&forged).await;
    assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
    // Too short to hold a tag.
    let e = hostile_bytes(&[23, 3, 3, 0, 3, 1, 2, 3]).await;
    assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
    // A record cut short by the end of the connection.
    let e = hostile_bytes(&[23, 3, 3, 1, 0, 1, 2]).await;
    assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof, "{e}");
}

#[tokio::test]
async fn a_client_sending_a_session_ticket_or_a_bad_key_update_is_refused() {
    let pki = pki();
    for (msg, want) in [
        (&[NEW_SESSION_TICKET, 0, 0, 0][..], "session ticket"),
        (&[KEY_UPDATE, 0, 0, 1, 7][..], "malformed key update"),
        (&[KEY_UPDATE, 0, 0, 1, 0, 4, 0, 0, 0][..], "record boundary"),
        (&[2, 0, 0, 0][..], "unexpected handshake message 2"),
    ] {
        let (mut client, mut server) = ours_to_ours(&pki).await;
        client
            .seal(ContentType::Handshake, OutboundChunks::Single(msg))
            .unwrap();
        client.flush().await.unwrap();
        let e = server.read(&mut [0u8; 8]).await.unwrap_err();
        assert!(e.to_string().contains(want), "{want}: {e}");
    }
}

#[tokio::test]
async fn a_handshake_with_garbage_or_a_hang_up_fails_cleanly() {
    let pki = pki();
    let (mut c, s) = pair().await;
    c.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
    let e = accept(pki.server.clone(), s).await.unwrap_err();
    assert!(e.to_string().contains("not a TLS record"), "{e}");
    let (c, s) = pair().await;
    drop(c);
    let e = accept(pki.server.clone(), s).await.unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
}

#[tokio::test]
async fn a_handshake_message_claiming_16_mib_fails_without_a_panic() {
    let pki = pki();
    // A ClientHello header announcing 2^24 bytes, to the server.
    let (mut c, s) = pair().await;
    c.write_all(&[0x16, 3, 1, 0, 4, 1, 0xff, 0xff, 0xff])
        .await
        .unwrap();
    assert!(accept(pki.server.clone(), s).await.is_err());
    // A ServerHello header announcing as much, to the client.
    let (c, mut s) = pair().await;
    s.write_all(&[0x16, 3, 3, 0, 4, 2, 0xff, 0xff, 0xff])
        .await
        .unwrap();
    assert!(connect(pki.client.clone(), name(), c).await.is_err());
    // A record length no TLS record has, during the handshake.
    let (mut c, s) = pair().await;
    c.write_all(&[0x16, 3, 1, 0xff, 0xff]).await.unwrap();
    let e = accept(pki.server.clone(), s).await.unwrap_err();
    assert!(e.to_string().contains("oversized"), "{e}");
}

/// On one thread over an in-memory pipe, the rustls client's Finished,
/// a key update it asks for, its data and its close_notify are all in the
/// server's first read after the handshake: none may reach rustls's
/// handshake, and none may be lost.
#[tokio::test(flavor = "current_thread")]
async fn records_right_behind_the_finished_are_this_layers() {
    let pki = pki();
    let (a, b) = tokio::io::duplex(1 << 20);
    let con = tokio_rustls::TlsConnector::from(pki.client.clone());
    let client = async {
        let mut c = con.connect(name(), a).await.unwrap();
        c.get_mut().1.refresh_traffic_keys().unwrap();
        c.write_all(b"right behind").await.unwrap();
        c.shutdown().await.unwrap();
        let mut back = Vec::new();
        c.read_to_end(&mut back).await.unwrap();
        back
    };
    let server = async {
        let mut s = accept(pki.server.clone(), b).await.unwrap();
        let mut got = Vec::new();
        s.read_to_end(&mut got).await.unwrap();
        s.write_all(&got).await.unwrap();
        s.shutdown().await.unwrap();
        got
    };
    let (back, got) = tokio::join!(client, server);
    assert_eq!(got, b"right behind");
    assert_eq!(back, b"right behind", "answered under the updated key");
}

#[tokio::test]
async fn a_stream_of_key_updates_without_data_is_cut_off() {
    let pki = pki();
    let (mut client, mut server) = ours_to_ours(&pki).await;
    // Data between updates resets the count.
    for _ in 0..3 {
        for _ in 0..MAX_KEY_UPDATES_IN_A_ROW {
            client.update_tx_key().unwrap();
        }
        exchange(&mut client, &mut server, 10).await;
    }
    for _ in 0..=MAX_KEY_UPDATES_IN_A_ROW {
        client.update_tx_key().unwrap();
    }
    client.flush().await.unwrap();
    let e = server.read(&mut [0u8; 8]).await.unwrap_err();
    assert!(e.to_string().contains("too many key updates"), "{e}");
}

#[tokio::test]
async fn many_key_update_requests_owe_one_update_and_queue_nothing() {
    let pki = pki();
    let (mut client, mut server) = ours_to_ours(&pki).await;
    for _ in 0..10 {
        // KeyUpdate(update_requested) under the current key, then ours.
        client
            .seal(
                ContentType::Handshake,
                OutboundChunks::Single(&[KEY_UPDATE, 0, 0, 1, 1]),
            )
            .unwrap();
        let (key, iv) = key_iv(client.kernel.next_tx().unwrap()).unwrap();
        client.enc = client.aead.encrypter(key, iv);
        client.tx_seq = 0;
    }
    exchange(&mut client, &mut server, 10).await;
    assert!(server.key_update_owed, "owed, not sent while reading");
    assert_eq!(server.wq_len, 0);
    // Paid once, before the server's next record; the client follows it.
    exchange(&mut server, &mut client, 10).await;
    assert!(!server.key_update_owed);
}

#[tokio::test]
async fn an_empty_handshake_record_is_refused() {
    let pki = pki();
    let (mut client, mut server) = ours_to_ours(&pki).await;
    client
        .seal(ContentType::Handshake, OutboundChunks::new_empty())
        .unwrap();
    client.flush().await.unwrap();
    let e = server.read(&mut [0u8; 8]).await.unwrap_err();
    assert!(e.to_string().contains("Handshake (0 bytes)"), "{e}");
}

#[tokio::test]
async fn a_write_takes_at_most_the_queue_bound() {
    let pki = pki();
    let (mut ours, _theirs) = ours_to_rustls(&pki).await;
    let big = vec![7u8; 4 << 20];
    let n = ours.write(&big).await.unwrap();
    assert!(n <= WRITE_QUEUE, "{n}");
    assert!(ours.wq_len <= WRITE_QUEUE + 64 * 1024, "{}", ours.wq_len);
}

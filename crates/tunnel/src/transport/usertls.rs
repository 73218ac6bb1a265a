//! TLS 1.3 between a seedlink agent and a seedlink server, with every
//! record decrypted in place in the buffer it was read into and handed on
//! with one copy (docs/PERFORMANCE.md, issue 28; docs/TUNNEL.md).
//!
//! Hand-written because no crate does it: rustls 0.23 copies each
//! decrypted record into a fresh `Vec` (`take_received_plaintext`), which
//! its reader then copies again — in its buffered and its unbuffered API
//! alike (the latter's in-place path is a TODO upstream) — and the profile
//! put those copies at a fifth of the tunnel server's CPU. This is what
//! the kernel does for kTLS, which this host lacks; rustls still does
//! everything cryptographic:
//! - the handshake, through its unbuffered API, so no byte read past the
//!   handshake is lost when it ends;
//! - the key schedule after it ([`KernelConnection`]: key updates, session
//!   tickets);
//! - the record protection (its `MessageEncrypter` / `MessageDecrypter`:
//!   nonces, additional data, the inner content type and padding).
//!
//! This module frames records (RFC 8446 §5), counts sequence numbers,
//! answers and initiates key updates, and bounds its buffers: at most one
//! read chunk plus one record in, [`WRITE_QUEUE`] out, nothing while idle.

use std::collections::VecDeque;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Buf, BytesMut};
use rustls::client::{ClientConnectionData, UnbufferedClientConnection};
use rustls::crypto::cipher::{
    InboundOpaqueMessage, MessageDecrypter, MessageEncrypter, OutboundChunks, OutboundPlainMessage,
    Tls13AeadAlgorithm,
};
use rustls::kernel::KernelConnection;
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::server::{ServerConnectionData, UnbufferedServerConnection};
use rustls::unbuffered::{
    ConnectionState, EncodeError, UnbufferedConnectionCommon, UnbufferedStatus,
};
use rustls::{ConnectionTrafficSecrets, ContentType, ProtocolVersion, SupportedCipherSuite};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};

/// A record's header: type, legacy version, length.
const HEADER: usize = 5;
/// The largest TLS 1.3 ciphertext (RFC 8446 §5.2).
const MAX_CIPHERTEXT: usize = (1 << 14) + 256;
/// The largest plaintext per record.
const MAX_PLAINTEXT: usize = 1 << 14;
/// Read at once from the socket (plus room for one whole record).
pub const READ_CHUNK: usize = 64 * 1024;
/// Encrypted bytes queued for the socket before a write waits.
pub const WRITE_QUEUE: usize = 256 * 1024;
/// Records handled per poll before yielding, so a peer streaming empty or
/// tiny records cannot hold a worker thread.
const RECORDS_PER_POLL: usize = 64;
/// Records written out per system call.
const WRITE_BATCH: usize = 64;
/// The largest post-handshake handshake message held (a session ticket is
/// at most 2^16 bytes of ticket plus its fields).
const MAX_HANDSHAKE_MESSAGE: usize = (1 << 16) + 1024;
/// The most the handshake buffer holds: what rustls keeps of a handshake
/// message split across records, plus the record being read.
const MAX_HANDSHAKE_BUFFER: usize = (1 << 17) + HEADER + MAX_CIPHERTEXT;
/// Key updates in a row (no application data between) before the peer is
/// cut off: each costs key derivations (rustls allows 32 too).
const MAX_KEY_UPDATES_IN_A_ROW: u32 = 32;
/// Handshake message types after the handshake (RFC 8446 §4).
const NEW_SESSION_TICKET: u8 = 4;
const KEY_UPDATE: u8 = 24;
/// Alerts (RFC 8446 §6).
const CLOSE_NOTIFY: u8 = 0;
const USER_CANCELED: u8 = 90;

/// What the handshake agreed, kept after it.
#[derive(Debug, Clone, Default)]
pub struct Session {
    /// The ALPN protocol agreed, if any.
    pub alpn: Option<Vec<u8>>,
    /// The peer's certificate chain (empty: none presented).
    pub peer_certificates: Vec<CertificateDer<'static>>,
}

/// The key schedule of either side.
enum Kernel {
    Client(KernelConnection<ClientConnectionData>),
    Server(KernelConnection<ServerConnectionData>),
}

impl Kernel {
    fn suite(&self) -> SupportedCipherSuite {
        match self {
            Kernel::Client(k) => k.negotiated_cipher_suite(),
            Kernel::Server(k) => k.negotiated_cipher_suite(),
        }
    }

    fn next_tx(&mut self) -> Result<ConnectionTrafficSecrets, rustls::Error> {
        match self {
            Kernel::Client(k) => k.update_tx_secret().map(|s| s.1),
            Kernel::Server(k) => k.update_tx_secret().map(|s| s.1),
        }
    }

    fn next_rx(&mut self) -> Result<ConnectionTrafficSecrets, rustls::Error> {
        match self {
            Kernel::Client(k) => k.update_rx_secret().map(|s| s.1),
            Kernel::Server(k) => k.update_rx_secret().map(|s| s.1),
        }
    }

    /// A NewSessionTicket: kept for resumption by a client; a protocol
    /// violation sent to a server.
    fn ticket(&mut self, body: &[u8]) -> io::Result<()> {
        match self {
            Kernel::Client(k) => k.handle_new_session_ticket(body).map_err(tls_error),
            Kernel::Server(_) => Err(bad("the client sent a session ticket")),
        }
    }
}

/// A TLS 1.3 stream after a rustls handshake; see the module's comment.
pub struct UserTls<IO> {
    io: IO,
    kernel: Kernel,
    aead: &'static dyn Tls13AeadAlgorithm,
    /// Records sealed under one key before it is updated.
    tx_limit: u64,
    enc: Box<dyn MessageEncrypter>,
    tx_seq: u64,
    dec: Box<dyn MessageDecrypter>,
    rx_seq: u64,
    session: Session,
    /// Bytes read: `plain` bytes of decrypted plaintext at the front, then
    /// the rest of their record, then records not yet decrypted from
    /// `raw`. Read into without zeroing; no allocation while idle.
    rbuf: BytesMut,
    plain: usize,
    raw: usize,
    /// A post-handshake handshake message split across records.
    hs: Vec<u8>,
    /// close_notify received.
    read_closed: bool,
    /// The peer asked for our key update; sent before our next record.
    key_update_owed: bool,
    /// Key updates received since the last application data.
    key_updates_in_a_row: u32,
    /// The first protocol error; every later call returns it.
    failed: Option<(io::ErrorKind, String)>,
    /// Sealed records not yet written, the first from `wq_off`.
    wq: VecDeque<Vec<u8>>,
    wq_off: usize,
    wq_len: usize,
    close_sent: bool,
}

impl<IO> std::fmt::Debug for UserTls<IO> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UserTls")
            .field("tx_seq", &self.tx_seq)
            .field("rx_seq", &self.rx_seq)
            .field("buffered", &self.rbuf.len())
            .field("queued", &self.wq_len)
            .finish_non_exhaustive()
    }
}

fn bad(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

fn tls_error(e: rustls::Error) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

/// Either side's unbuffered connection, for one handshake driver.
trait Handshaking: Send {
    type Data;
    fn common(&mut self) -> &mut UnbufferedConnectionCommon<Self::Data>;
    fn process<'c, 'i>(&'c mut self, buf: &'i mut [u8]) -> UnbufferedStatus<'c, 'i, Self::Data>;
    fn finish(self) -> Result<(rustls::ExtractedSecrets, Kernel), rustls::Error>;
}

impl Handshaking for UnbufferedClientConnection {
    type Data = ClientConnectionData;
    fn common(&mut self) -> &mut UnbufferedConnectionCommon<ClientConnectionData> {
        self
    }
    fn process<'c, 'i>(&'c mut self, buf: &'i mut [u8]) -> UnbufferedStatus<'c, 'i, Self::Data> {
        self.process_tls_records(buf)
    }
    fn finish(self) -> Result<(rustls::ExtractedSecrets, Kernel), rustls::Error> {
        let (s, k) = self.dangerous_into_kernel_connection()?;
        Ok((s, Kernel::Client(k)))
    }
}

impl Handshaking for UnbufferedServerConnection {
    type Data = ServerConnectionData;
    fn common(&mut self) -> &mut UnbufferedConnectionCommon<ServerConnectionData> {
        self
    }
    fn process<'c, 'i>(&'c mut self, buf: &'i mut [u8]) -> UnbufferedStatus<'c, 'i, Self::Data> {
        self.process_tls_records(buf)
    }
    fn finish(self) -> Result<(rustls::ExtractedSecrets, Kernel), rustls::Error> {
        let (s, k) = self.dangerous_into_kernel_connection()?;
        Ok((s, Kernel::Server(k)))
    }
}

/// The client's handshake on `io`. `config` must allow TLS 1.3 only and
/// secret extraction ([`prepare_client`]).
pub async fn connect<IO>(
    config: Arc<rustls::ClientConfig>,
    name: ServerName<'static>,
    io: IO,
) -> io::Result<UserTls<IO>>
where
    IO: AsyncRead + AsyncWrite + Unpin + Send,
{
    let conn = UnbufferedClientConnection::new(config, name).map_err(tls_error)?;
    handshake(conn, io).await
}

/// The server's handshake on `io`. `config` must allow TLS 1.3 only and
/// secret extraction ([`prepare_server`]).
pub async fn accept<IO>(config: Arc<rustls::ServerConfig>, io: IO) -> io::Result<UserTls<IO>>
where
    IO: AsyncRead + AsyncWrite + Unpin + Send,
{
    let conn = UnbufferedServerConnection::new(config).map_err(tls_error)?;
    handshake(conn, io).await
}

/// Makes a client configuration fit for [`connect`].
pub fn prepare_client(cfg: &mut rustls::ClientConfig) {
    cfg.enable_secret_extraction = true;
}

/// Makes a server configuration fit for [`accept`].
pub fn prepare_server(cfg: &mut rustls::ServerConfig) {
    cfg.enable_secret_extraction = true;
}

/// What the handshake driver does after one status.
enum Step {
    Go,
    Read,
    Transmit,
    Traffic,
    Fail(io::Error),
}

/// Drives rustls's unbuffered handshake on `io`, then takes the keys.
///
/// rustls is given one record at a time, and nothing once the handshake
/// is done: every record after it (a session ticket, a key update, data,
/// close_notify, even in the same read as the peer's Finished) is this
/// layer's, so no state is lost at the switch.
async fn handshake<C, IO>(mut conn: C, mut io: IO) -> io::Result<UserTls<IO>>
where
    C: Handshaking,
    IO: AsyncRead + AsyncWrite + Unpin + Send,
{
    let mut inb = BytesMut::with_capacity(4096);
    // The bytes given to rustls, from the front of `inb`.
    let mut fed = 0usize;
    let mut out: Vec<u8> = Vec::new();
    loop {
        let status = conn.process(&mut inb[..fed]);
        let discard = status.discard;
        let step = match status.state {
            Err(e) => Step::Fail(tls_error(e)),
            Ok(ConnectionState::EncodeTlsData(mut e)) => encode(&mut e, &mut out),
            Ok(ConnectionState::TransmitTlsData(t)) => {
                t.done();
                Step::Transmit
            }
            Ok(ConnectionState::BlockedHandshake) => Step::Read,
            Ok(ConnectionState::WriteTraffic(_)) => Step::Traffic,
            Ok(ConnectionState::PeerClosed | ConnectionState::Closed) => {
                Step::Fail(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "peer closed during the handshake",
                ))
            }
            // Application data included: rustls sees no record past the
            // handshake, and early data is not enabled.
            Ok(_) => Step::Fail(bad("unexpected TLS state during the handshake")),
        };
        inb.advance(discard);
        fed -= discard;
        match step {
            Step::Go => {}
            Step::Transmit => {
                io.write_all(&out).await?;
                out.clear();
            }
            Step::Traffic if !conn.common().is_handshaking() => break,
            Step::Read | Step::Traffic => {
                if !out.is_empty() {
                    io.write_all(&out).await?;
                    out.clear();
                }
                match next_record_end(&inb, fed) {
                    Ok(Some(end)) => fed = end,
                    Ok(None) => read_more(&mut io, &mut inb).await?,
                    Err(e) => return Err(e),
                }
            }
            Step::Fail(e) => {
                send_alert(&mut conn, &mut inb[..fed], &mut io).await;
                return Err(e);
            }
        }
    }
    if !out.is_empty() {
        io.write_all(&out).await?;
    }
    io.flush().await?;
    if fed != 0 {
        return Err(bad("handshake records left over"));
    }
    established(conn, io, inb)
}

/// The layer over `io` once `conn` has finished its handshake: TLS 1.3's
/// keys taken from rustls; `inb`, what was read past the handshake, is
/// records for this layer.
fn established<C, IO>(mut conn: C, io: IO, inb: BytesMut) -> io::Result<UserTls<IO>>
where
    C: Handshaking,
    IO: AsyncRead + AsyncWrite + Unpin + Send,
{
    let common = conn.common();
    if common.protocol_version() != Some(ProtocolVersion::TLSv1_3) {
        return Err(bad("TLS 1.3 is required"));
    }
    let session = Session {
        alpn: common.alpn_protocol().map(<[u8]>::to_vec),
        peer_certificates: common
            .peer_certificates()
            .map(|c| c.iter().map(|c| c.clone().into_owned()).collect())
            .unwrap_or_default(),
    };
    let (secrets, kernel) = conn.finish().map_err(tls_error)?;
    let SupportedCipherSuite::Tls13(suite) = kernel.suite() else {
        return Err(bad("TLS 1.3 is required"));
    };
    let aead = suite.aead_alg;
    let (tx_seq, tx) = secrets.tx;
    let (rx_seq, rx) = secrets.rx;
    let (tx_key, tx_iv) = key_iv(tx)?;
    let (rx_key, rx_iv) = key_iv(rx)?;
    Ok(UserTls {
        io,
        kernel,
        aead,
        // Update well before the suite's limit (rustls does the same).
        tx_limit: suite.common.confidentiality_limit.saturating_sub(16).max(1),
        enc: aead.encrypter(tx_key, tx_iv),
        tx_seq,
        dec: aead.decrypter(rx_key, rx_iv),
        rx_seq,
        session,
        // What was read past the handshake: records for this layer.
        rbuf: inb,
        plain: 0,
        raw: 0,
        hs: Vec::new(),
        read_closed: false,
        key_update_owed: false,
        key_updates_in_a_row: 0,
        failed: None,
        wq: VecDeque::new(),
        wq_off: 0,
        wq_len: 0,
        close_sent: false,
    })
}

/// The end of the whole record starting at `from` in `buf`, if it is all
/// there; an error for a length no TLS record has.
fn next_record_end(buf: &[u8], from: usize) -> io::Result<Option<usize>> {
    let Some(head) = buf.get(from..from + HEADER) else {
        return Ok(None);
    };
    // What rustls checks first, checked here as the record is not given
    // to it until it is whole.
    if !(20..=23).contains(&head[0]) || head[1] != 3 {
        return Err(bad("not a TLS record"));
    }
    let len = usize::from(u16::from_be_bytes([head[3], head[4]]));
    if len > MAX_CIPHERTEXT {
        return Err(bad(format!("record of {len} bytes is oversized")));
    }
    let end = from + HEADER + len;
    Ok((buf.len() >= end).then_some(end))
}

/// Encodes one handshake record into `out`, growing it as asked.
fn encode<D>(e: &mut rustls::unbuffered::EncodeTlsData<'_, D>, out: &mut Vec<u8>) -> Step {
    let at = out.len();
    let mut need = 0;
    loop {
        out.resize(at + need, 0);
        match e.encode(&mut out[at..]) {
            Ok(n) => {
                out.truncate(at + n);
                return Step::Go;
            }
            Err(EncodeError::InsufficientSize(s)) if s.required_size > need => {
                need = s.required_size;
            }
            Err(e) => {
                out.truncate(at);
                return Step::Fail(bad(e.to_string()));
            }
        }
    }
}

/// After a failed handshake, sends the alert rustls queued (best effort).
/// `fed` is what rustls was given and has not discarded, as it requires.
async fn send_alert<C: Handshaking, IO: AsyncWrite + Unpin>(
    conn: &mut C,
    fed: &mut [u8],
    io: &mut IO,
) {
    let mut out = Vec::new();
    if let Ok(ConnectionState::EncodeTlsData(mut e)) = conn.process(fed).state {
        if let Step::Go = encode(&mut e, &mut out) {
            let _ = io.write_all(&out).await;
            let _ = io.flush().await;
        }
    }
}

/// Reads more of the handshake: at least a record's room, at most
/// [`MAX_HANDSHAKE_BUFFER`] held.
async fn read_more<IO: AsyncRead + Unpin>(io: &mut IO, inb: &mut BytesMut) -> io::Result<()> {
    if inb.len() >= MAX_HANDSHAKE_BUFFER {
        return Err(bad("handshake larger than its buffer"));
    }
    if inb.capacity() - inb.len() < 1024 {
        inb.reserve(HEADER + MAX_CIPHERTEXT);
    }
    let n = io.read_buf(inb).await?;
    if n == 0 {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "peer closed during the handshake",
        ));
    }
    Ok(())
}

fn key_iv(
    s: ConnectionTrafficSecrets,
) -> io::Result<(rustls::crypto::cipher::AeadKey, rustls::crypto::cipher::Iv)> {
    match s {
        ConnectionTrafficSecrets::Aes128Gcm { key, iv }
        | ConnectionTrafficSecrets::Aes256Gcm { key, iv }
        | ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv } => Ok((key, iv)),
        _ => Err(bad("unsupported cipher suite")),
    }
}

impl<IO> UserTls<IO> {
    /// What the handshake agreed.
    pub fn session(&self) -> &Session {
        &self.session
    }

    /// The peer's certificate chain, moved out (not kept twice).
    pub fn take_peer_certificates(&mut self) -> Vec<CertificateDer<'static>> {
        std::mem::take(&mut self.session.peer_certificates)
    }

    /// Records the first fatal error and returns it.
    fn fail(&mut self, e: io::Error) -> io::Error {
        if self.failed.is_none() {
            self.failed = Some((e.kind(), e.to_string()));
        }
        e
    }

    fn failed(&self) -> Option<io::Error> {
        self.failed
            .as_ref()
            .map(|(k, m)| io::Error::new(*k, m.clone()))
    }

    /// Decrypts the next whole record in the buffer, if there is one:
    /// `Ok(true)` when one was handled. Its plaintext, if application
    /// data, is left at the front of the buffer (`plain`).
    fn open_record(&mut self) -> io::Result<bool> {
        self.rbuf.advance(self.raw);
        self.raw = 0;
        let avail = &self.rbuf[..];
        if avail.len() < HEADER {
            return Ok(false);
        }
        let len = usize::from(u16::from_be_bytes([avail[3], avail[4]]));
        if avail[0] != u8::from(ContentType::ApplicationData) {
            return Err(bad(format!("unexpected record type {}", avail[0])));
        }
        if avail[1..3] != [3, 3] {
            return Err(bad("unexpected record version"));
        }
        if len > MAX_CIPHERTEXT {
            return Err(bad(format!("record of {len} bytes is oversized")));
        }
        if avail.len() < HEADER + len {
            return Ok(false);
        }
        let end = HEADER + len;
        let base = self.rbuf.as_ptr() as usize;
        let msg = InboundOpaqueMessage::new(
            ContentType::ApplicationData,
            ProtocolVersion::TLSv1_2,
            &mut self.rbuf[HEADER..end],
        );
        let msg = self.dec.decrypt(msg, self.rx_seq).map_err(tls_error)?;
        self.rx_seq += 1;
        let typ = msg.typ;
        let n = msg.payload.len();
        let at = (msg.payload.as_ptr() as usize)
            .checked_sub(base)
            .unwrap_or(usize::MAX);
        if at < HEADER || at.saturating_add(n) > end {
            return Err(bad("decrypted record out of place"));
        }
        match typ {
            ContentType::ApplicationData if self.hs.is_empty() => {
                if n > 0 {
                    self.key_updates_in_a_row = 0;
                }
                // Handed on in place, from the front.
                self.rbuf.advance(at);
                self.plain = n;
                self.raw = end - at;
                Ok(true)
            }
            ContentType::Handshake if n > 0 => {
                if self.hs.len() + n > MAX_HANDSHAKE_MESSAGE {
                    return Err(bad("post-handshake message too large"));
                }
                self.hs.extend_from_slice(&self.rbuf[at..at + n]);
                self.raw = end;
                self.handshake_messages()?;
                Ok(true)
            }
            ContentType::Alert if self.hs.is_empty() => {
                match &self.rbuf[at..at + n] {
                    [_, CLOSE_NOTIFY] => self.read_closed = true,
                    [1, USER_CANCELED] => {}
                    [_, d] => return Err(bad(format!("peer sent alert {d}"))),
                    _ => return Err(bad("malformed alert")),
                }
                self.raw = end;
                Ok(true)
            }
            _ => Err(bad(format!("unexpected content type {typ:?} ({n} bytes)"))),
        }
    }

    /// Handles the complete handshake messages held in `hs`.
    fn handshake_messages(&mut self) -> io::Result<()> {
        while self.hs.len() >= 4 {
            let len = usize::from(self.hs[1]) << 16
                | usize::from(self.hs[2]) << 8
                | usize::from(self.hs[3]);
            if 4 + len > MAX_HANDSHAKE_MESSAGE {
                return Err(bad("post-handshake message too large"));
            }
            if self.hs.len() < 4 + len {
                break;
            }
            let rest = self.hs.len() - 4 - len;
            match self.hs[0] {
                NEW_SESSION_TICKET => {
                    let body = self.hs[4..4 + len].to_vec();
                    self.kernel.ticket(&body)?;
                }
                KEY_UPDATE => {
                    // RFC 8446 §5.1: a key change ends its record.
                    let request = match (&self.hs[4..4 + len], rest) {
                        ([r @ (0 | 1)], 0) => *r == 1,
                        (_, 0) => return Err(bad("malformed key update")),
                        _ => return Err(bad("key update not at a record boundary")),
                    };
                    self.key_updates_in_a_row += 1;
                    if self.key_updates_in_a_row > MAX_KEY_UPDATES_IN_A_ROW {
                        return Err(bad("too many key updates in a row"));
                    }
                    let (key, iv) = key_iv(self.kernel.next_rx().map_err(tls_error)?)?;
                    self.dec = self.aead.decrypter(key, iv);
                    self.rx_seq = 0;
                    // Owed before our next record (RFC 8446 §4.6.3); many
                    // requests owe one update.
                    self.key_update_owed |= request && !self.close_sent;
                }
                t => return Err(bad(format!("unexpected handshake message {t}"))),
            }
            self.hs.drain(..4 + len);
        }
        if self.hs.is_empty() {
            self.hs = Vec::new();
        }
        Ok(())
    }

    /// Seals `data` into records of type `typ` on the write queue.
    fn seal(&mut self, typ: ContentType, data: OutboundChunks<'_>) -> io::Result<()> {
        self.pay_key_update()?;
        let mut rest = data;
        loop {
            if self.tx_seq >= self.tx_limit {
                self.update_tx_key()?;
            }
            let (head, tail) = rest.split_at(MAX_PLAINTEXT);
            let msg = OutboundPlainMessage {
                typ,
                version: ProtocolVersion::TLSv1_2,
                payload: head,
            };
            let rec = self.enc.encrypt(msg, self.tx_seq).map_err(tls_error)?;
            self.tx_seq += 1;
            let rec = rec.encode();
            self.wq_len += rec.len();
            self.wq.push_back(rec);
            if tail.is_empty() {
                return Ok(());
            }
            rest = tail;
        }
    }

    /// Sends the key update the peer asked for, if one is owed.
    fn pay_key_update(&mut self) -> io::Result<()> {
        if std::mem::take(&mut self.key_update_owed) {
            self.update_tx_key()?;
        }
        Ok(())
    }

    /// Sends a KeyUpdate (not asking for one back) under the current key,
    /// then switches to the next.
    fn update_tx_key(&mut self) -> io::Result<()> {
        let msg = OutboundPlainMessage {
            typ: ContentType::Handshake,
            version: ProtocolVersion::TLSv1_2,
            payload: OutboundChunks::Single(&[KEY_UPDATE, 0, 0, 1, 0]),
        };
        let rec = self.enc.encrypt(msg, self.tx_seq).map_err(tls_error)?;
        let rec = rec.encode();
        self.wq_len += rec.len();
        self.wq.push_back(rec);
        let (key, iv) = key_iv(self.kernel.next_tx().map_err(tls_error)?)?;
        self.enc = self.aead.encrypter(key, iv);
        self.tx_seq = 0;
        Ok(())
    }
}

impl<IO: AsyncWrite + Unpin> UserTls<IO> {
    /// Writes the queue out until it is empty.
    fn poll_write_queue(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while !self.wq.is_empty() {
            let mut slices = [io::IoSlice::new(&[]); WRITE_BATCH];
            let mut k = 0;
            for (i, rec) in self.wq.iter().take(WRITE_BATCH).enumerate() {
                let from = if i == 0 { self.wq_off } else { 0 };
                slices[i] = io::IoSlice::new(&rec[from..]);
                k = i + 1;
            }
            let n = match Pin::new(&mut self.io).poll_write_vectored(cx, &slices[..k]) {
                Poll::Ready(Ok(0)) => {
                    return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
                }
                Poll::Ready(Ok(n)) => n,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            };
            self.wq_len -= n;
            let mut n = n + self.wq_off;
            self.wq_off = 0;
            while let Some(front) = self.wq.front() {
                if n < front.len() {
                    self.wq_off = n;
                    break;
                }
                n -= front.len();
                self.wq.pop_front();
            }
        }
        self.wq = VecDeque::new();
        Poll::Ready(Ok(()))
    }
}

impl<IO: AsyncRead + AsyncWrite + Unpin> AsyncRead for UserTls<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if let Some(e) = this.failed() {
            return Poll::Ready(Err(e));
        }
        let mut budget = RECORDS_PER_POLL;
        loop {
            if this.plain > 0 {
                let n = out.remaining().min(this.plain);
                out.put_slice(&this.rbuf[..n]);
                this.rbuf.advance(n);
                this.plain -= n;
                this.raw -= n;
                return Poll::Ready(Ok(()));
            }
            if this.read_closed {
                return Poll::Ready(Ok(()));
            }
            match this.open_record() {
                Ok(true) => {
                    budget -= 1;
                    if budget == 0 && this.plain == 0 {
                        cx.waker().wake_by_ref();
                        return Poll::Pending;
                    }
                    continue;
                }
                Ok(false) => {}
                Err(e) => return Poll::Ready(Err(this.fail(e))),
            }
            // Need more: room for a whole record after the partial one
            // (`reserve` moves it to the front when that is enough).
            if this.rbuf.capacity() == 0 {
                this.rbuf = BytesMut::with_capacity(READ_CHUNK + HEADER + MAX_CIPHERTEXT);
            } else if this.rbuf.capacity() - this.rbuf.len() < HEADER + MAX_CIPHERTEXT {
                this.rbuf.reserve(HEADER + MAX_CIPHERTEXT);
            }
            match tokio_util::io::poll_read_buf(Pin::new(&mut this.io), cx, &mut this.rbuf) {
                // An end without close_notify: an error, as from rustls's
                // reader, but not a protocol error (not kept).
                Poll::Ready(Ok(0)) => {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "peer closed the connection without close_notify",
                    )));
                }
                Poll::Ready(Ok(_)) => {}
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => {
                    if this.rbuf.is_empty() {
                        // Idle: keep no buffer.
                        this.rbuf = BytesMut::new();
                    }
                    return Poll::Pending;
                }
            }
        }
    }
}

impl<IO: AsyncRead + AsyncWrite + Unpin> AsyncWrite for UserTls<IO> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.poll_write_vectored(cx, &[io::IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        if let Some(e) = this.failed() {
            return Poll::Ready(Err(e));
        }
        if this.close_sent {
            return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
        }
        if this.wq_len >= WRITE_QUEUE {
            match this.poll_write_queue(cx) {
                Poll::Ready(Ok(())) => {}
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending if this.wq_len >= WRITE_QUEUE => return Poll::Pending,
                Poll::Pending => {}
            }
        }
        let mut room = WRITE_QUEUE - this.wq_len;
        let mut chunks: Vec<&[u8]> = Vec::with_capacity(bufs.len());
        for b in bufs {
            if room == 0 {
                break;
            }
            let take = b.len().min(room);
            if take > 0 {
                chunks.push(&b[..take]);
                room -= take;
            }
        }
        let total: usize = chunks.iter().map(|c| c.len()).sum();
        if total == 0 {
            return Poll::Ready(Ok(0));
        }
        if let Err(e) = this.seal(ContentType::ApplicationData, OutboundChunks::new(&chunks)) {
            return Poll::Ready(Err(this.fail(e)));
        }
        // Out now if the socket takes it; an error shows on the next call
        // (these bytes are taken: the socket's error repeats).
        let _ = this.poll_write_queue(cx);
        Poll::Ready(Ok(total))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.failed.is_none() && !this.close_sent {
            if let Err(e) = this.pay_key_update() {
                return Poll::Ready(Err(this.fail(e)));
            }
        }
        match this.poll_write_queue(cx) {
            Poll::Ready(Ok(())) => Pin::new(&mut this.io).poll_flush(cx),
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => Poll::Pending,
        }
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if !this.close_sent && this.failed.is_none() {
            this.close_sent = true;
            let alert = [1u8, CLOSE_NOTIFY];
            if let Err(e) = this.seal(ContentType::Alert, OutboundChunks::Single(&alert)) {
                return Poll::Ready(Err(this.fail(e)));
            }
        }
        match this.poll_write_queue(cx) {
            Poll::Ready(Ok(())) => Pin::new(&mut this.io).poll_shutdown(cx),
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => Poll::Pending,
        }
    }
}

#[cfg(test)]
mod tests;

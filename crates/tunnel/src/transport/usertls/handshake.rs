//! The handshake: rustls's unbuffered API driven over `IO` within bounds on
//! every message and buffer, then the traffic secrets taken out into a
//! [`UserTls`].

use std::collections::VecDeque;
use std::io;
use std::sync::Arc;

use bytes::{Buf, BytesMut};
use rustls::client::{ClientConnectionData, UnbufferedClientConnection};
use rustls::pki_types::ServerName;
use rustls::server::{ServerConnectionData, UnbufferedServerConnection};
use rustls::unbuffered::{
    ConnectionState, EncodeError, UnbufferedConnectionCommon, UnbufferedStatus,
};
use rustls::{ProtocolVersion, SupportedCipherSuite};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::state::*;

/// Either side's unbuffered connection, for one handshake driver.
pub(super) trait Handshaking: Send {
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
pub(super) enum Step {
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
pub(super) async fn handshake<C, IO>(mut conn: C, mut io: IO) -> io::Result<UserTls<IO>>
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
pub(super) fn established<C, IO>(mut conn: C, io: IO, inb: BytesMut) -> io::Result<UserTls<IO>>
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

/// Encodes one handshake record into `out`, growing it as asked.
pub(super) fn encode<D>(
    e: &mut rustls::unbuffered::EncodeTlsData<'_, D>,
    out: &mut Vec<u8>,
) -> Step {
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
pub(super) async fn send_alert<C: Handshaking, IO: AsyncWrite + Unpin>(
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
pub(super) async fn read_more<IO: AsyncRead + Unpin>(
    io: &mut IO,
    inb: &mut BytesMut,
) -> io::Result<()> {
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

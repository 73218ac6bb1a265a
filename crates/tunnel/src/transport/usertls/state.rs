//! The stream's state and limits: [`UserTls`] (the keys, the buffers, the
//! reason it failed), what the handshake agreed ([`Session`]), the record
//! sizes and counts everything here is bounded by.

use std::collections::VecDeque;
use std::io;

use bytes::BytesMut;
use rustls::client::ClientConnectionData;
use rustls::crypto::cipher::{MessageDecrypter, MessageEncrypter, Tls13AeadAlgorithm};
use rustls::kernel::KernelConnection;
use rustls::pki_types::CertificateDer;
use rustls::server::ServerConnectionData;
use rustls::{ConnectionTrafficSecrets, SupportedCipherSuite};

/// A record's header: type, legacy version, length.
pub(super) const HEADER: usize = 5;

/// The largest TLS 1.3 ciphertext (RFC 8446 §5.2).
pub(super) const MAX_CIPHERTEXT: usize = (1 << 14) + 256;

/// The largest plaintext per record.
pub(super) const MAX_PLAINTEXT: usize = 1 << 14;

/// Read at once from the socket (plus room for one whole record).
pub const READ_CHUNK: usize = 64 * 1024;

/// Encrypted bytes queued for the socket before a write waits.
pub const WRITE_QUEUE: usize = 256 * 1024;

/// Records handled per poll before yielding, so a peer streaming empty or
/// tiny records cannot hold a worker thread.
pub(super) const RECORDS_PER_POLL: usize = 64;

/// Records written out per system call.
pub(super) const WRITE_BATCH: usize = 64;

/// The largest post-handshake handshake message held (a session ticket is
/// at most 2^16 bytes of ticket plus its fields).
pub(super) const MAX_HANDSHAKE_MESSAGE: usize = (1 << 16) + 1024;

/// The most the handshake buffer holds: what rustls keeps of a handshake
/// message split across records, plus the record being read.
pub(super) const MAX_HANDSHAKE_BUFFER: usize = (1 << 17) + HEADER + MAX_CIPHERTEXT;

/// Key updates in a row (no application data between) before the peer is
/// cut off: each costs key derivations (rustls allows 32 too).
pub(super) const MAX_KEY_UPDATES_IN_A_ROW: u32 = 32;

/// Handshake message types after the handshake (RFC 8446 §4).
pub(super) const NEW_SESSION_TICKET: u8 = 4;

pub(super) const KEY_UPDATE: u8 = 24;

/// Alerts (RFC 8446 §6).
pub(super) const CLOSE_NOTIFY: u8 = 0;

pub(super) const USER_CANCELED: u8 = 90;

/// What the handshake agreed, kept after it.
#[derive(Debug, Clone, Default)]
pub struct Session {
    /// The ALPN protocol agreed, if any.
    pub alpn: Option<Vec<u8>>,
    /// The peer's certificate chain (empty: none presented).
    pub peer_certificates: Vec<CertificateDer<'static>>,
}

/// The key schedule of either side.
pub(super) enum Kernel {
    Client(KernelConnection<ClientConnectionData>),
    Server(KernelConnection<ServerConnectionData>),
}

impl Kernel {
    pub(super) fn suite(&self) -> SupportedCipherSuite {
        match self {
            Kernel::Client(k) => k.negotiated_cipher_suite(),
            Kernel::Server(k) => k.negotiated_cipher_suite(),
        }
    }

    pub(super) fn next_tx(&mut self) -> Result<ConnectionTrafficSecrets, rustls::Error> {
        match self {
            Kernel::Client(k) => k.update_tx_secret().map(|s| s.1),
            Kernel::Server(k) => k.update_tx_secret().map(|s| s.1),
        }
    }

    pub(super) fn next_rx(&mut self) -> Result<ConnectionTrafficSecrets, rustls::Error> {
        match self {
            Kernel::Client(k) => k.update_rx_secret().map(|s| s.1),
            Kernel::Server(k) => k.update_rx_secret().map(|s| s.1),
        }
    }

    /// A NewSessionTicket: kept for resumption by a client; a protocol
    /// violation sent to a server.
    pub(super) fn ticket(&mut self, body: &[u8]) -> io::Result<()> {
        match self {
            Kernel::Client(k) => k.handle_new_session_ticket(body).map_err(tls_error),
            Kernel::Server(_) => Err(bad("the client sent a session ticket")),
        }
    }
}

/// A TLS 1.3 stream after a rustls handshake; see the module's comment.
pub struct UserTls<IO> {
    pub(super) io: IO,
    pub(super) kernel: Kernel,
    pub(super) aead: &'static dyn Tls13AeadAlgorithm,
    /// Records sealed under one key before it is updated.
    pub(super) tx_limit: u64,
    pub(super) enc: Box<dyn MessageEncrypter>,
    pub(super) tx_seq: u64,
    pub(super) dec: Box<dyn MessageDecrypter>,
    pub(super) rx_seq: u64,
    pub(super) session: Session,
    /// Bytes read: `plain` bytes of decrypted plaintext at the front, then
    /// the rest of their record, then records not yet decrypted from
    /// `raw`. Read into without zeroing; no allocation while idle.
    pub(super) rbuf: BytesMut,
    pub(super) plain: usize,
    pub(super) raw: usize,
    /// A post-handshake handshake message split across records.
    pub(super) hs: Vec<u8>,
    /// close_notify received.
    pub(super) read_closed: bool,
    /// The peer asked for our key update; sent before our next record.
    pub(super) key_update_owed: bool,
    /// Key updates received since the last application data.
    pub(super) key_updates_in_a_row: u32,
    /// The first protocol error; every later call returns it.
    pub(super) failed: Option<(io::ErrorKind, String)>,
    /// Sealed records not yet written, the first from `wq_off`.
    pub(super) wq: VecDeque<Vec<u8>>,
    pub(super) wq_off: usize,
    pub(super) wq_len: usize,
    pub(super) close_sent: bool,
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

pub(super) fn bad(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

pub(super) fn tls_error(e: rustls::Error) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

/// The end of the whole record starting at `from` in `buf`, if it is all
/// there; an error for a length no TLS record has.
pub(super) fn next_record_end(buf: &[u8], from: usize) -> io::Result<Option<usize>> {
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

pub(super) fn key_iv(
    s: ConnectionTrafficSecrets,
) -> io::Result<(rustls::crypto::cipher::AeadKey, rustls::crypto::cipher::Iv)> {
    match s {
        ConnectionTrafficSecrets::Aes128Gcm { key, iv }
        | ConnectionTrafficSecrets::Aes256Gcm { key, iv }
        | ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv } => Ok((key, iv)),
        _ => Err(bad("unsupported cipher suite")),
    }
}

//! How a frontend connection is answered and how it ended: the success
//! answer of each protocol, a refusal with its status, the outcome labels,
//! and what a transport can do when a connection is cut short. Shared by
//! the frontends (frontend.rs, socks.rs) and the seed path (seed.rs).

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};

use super::DialError;

/// The exact success answer kube-apiserver expects (nothing more).
const ESTABLISHED: &[u8] = b"HTTP/1.1 200 Connection Established\r\n\r\n";

fn status_line(code: u16) -> &'static str {
    match code {
        400 => "400 Bad Request",
        405 => "405 Method Not Allowed",
        500 => "500 Internal Server Error",
        503 => "503 Service Unavailable",
        504 => "504 Gateway Timeout",
        _ => "502 Bad Gateway",
    }
}

pub(crate) async fn answer<S: AsyncWrite + Unpin>(io: &mut S, code: u16, body: &str) {
    let msg = format!(
        "HTTP/1.1 {}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        status_line(code),
        body.len()
    );
    let _ = tokio::time::timeout(std::time::Duration::from_secs(5), async {
        let _ = io.write_all(msg.as_bytes()).await;
        let _ = io.shutdown().await;
    })
    .await;
}

/// How a frontend connection ended; [`FrontendEnd::reason`] is the
/// `outcome` label of `frontend_connections_total`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FrontendEnd {
    /// The request head exceeded its limit.
    HeadTooLarge,
    /// The frontend closed before its request was complete.
    Closed,
    /// The request head (or first packet) did not arrive in time.
    HeadTimeout,
    /// Not a CONNECT on a CONNECT frontend.
    NotConnect,
    /// The target is not `host:port` (or not an origin the proxy serves).
    BadTarget,
    /// The frontend went away (during the dial or the copy).
    FrontendGone,
    /// Writing to the frontend failed.
    WriteError,
    /// A shared proxy request named no cluster it may use.
    ProxyAuthRequired,
    /// The agent's stream or connection ended first.
    AgentGone,
    /// Carried to its end.
    Ok,
    /// Reading from the frontend failed.
    ReadError,
    /// The agent side reset the connection.
    Aborted,
    /// The frontend took nothing for the stall deadline.
    Stalled,
    /// A gRPC frontend's first packet was not DIAL_REQ.
    BadFirstPacket,
    /// A gRPC dial for a protocol other than tcp.
    BadProtocol,
    /// A gRPC frontend sent DATA for another connection.
    WrongConnectId,
    /// The TLS handshake failed or timed out.
    TlsFailed,
    /// The server is draining (answered 503).
    Draining,
    /// No cluster could be chosen for it (answered 503).
    UnknownCluster,
    /// Not SOCKS version 5 (or a bad RFC 1929 sub-negotiation version).
    NotSocks5,
    /// The SOCKS client offered no method this frontend takes (no-auth on
    /// a cluster's own frontend, username/password on a shared one).
    SocksNoMethod,
    /// A SOCKS command other than CONNECT (answered "command not
    /// supported").
    SocksCommand,
    /// The request head was malformed (answered 400).
    Malformed(seedlink_proto::connect_head::Reject),
    /// The dial failed.
    Dial(DialError),
}

impl FrontendEnd {
    /// The metric label.
    pub fn reason(&self) -> &'static str {
        match self {
            FrontendEnd::HeadTooLarge => "head_too_large",
            FrontendEnd::Closed => "closed",
            FrontendEnd::HeadTimeout => "head_timeout",
            FrontendEnd::NotConnect => "not_connect",
            FrontendEnd::BadTarget => "bad_target",
            FrontendEnd::FrontendGone => "frontend_gone",
            FrontendEnd::WriteError => "write_error",
            FrontendEnd::ProxyAuthRequired => "proxy_auth_required",
            FrontendEnd::AgentGone => "agent_gone",
            FrontendEnd::Ok => "ok",
            FrontendEnd::ReadError => "read_error",
            FrontendEnd::Aborted => "aborted",
            FrontendEnd::Stalled => "stalled",
            FrontendEnd::BadFirstPacket => "bad_first_packet",
            FrontendEnd::BadProtocol => "bad_protocol",
            FrontendEnd::WrongConnectId => "wrong_connect_id",
            FrontendEnd::TlsFailed => "tls_failed",
            FrontendEnd::Draining => "draining",
            FrontendEnd::UnknownCluster => "unknown_cluster",
            FrontendEnd::NotSocks5 => "not_socks5",
            FrontendEnd::SocksNoMethod => "socks_no_method",
            FrontendEnd::SocksCommand => "socks_command_not_supported",
            FrontendEnd::Malformed(r) => r.reason(),
            FrontendEnd::Dial(e) => e.reason(),
        }
    }
}

/// A frontend connection's transport, as far as ending it goes.
pub trait FrontendIo: AsyncRead + AsyncWrite + Unpin {
    /// Makes the coming close a reset, so that a connection cut short (agent
    /// gone, connection aborted, frontend stalled) is seen by the client as
    /// an abort, never as a clean end of stream (a cut `kubectl cp` must not
    /// look finished). TCP: SO_LINGER 0, then close sends RST. Returns false
    /// where the transport has no reset (a Unix socket: the client sees an
    /// ordinary end, which is counted apart).
    fn reset_on_close(&self) -> bool {
        false
    }
}

impl FrontendIo for tokio::net::TcpStream {
    fn reset_on_close(&self) -> bool {
        socket2::SockRef::from(self)
            .set_linger(Some(std::time::Duration::ZERO))
            .is_ok()
    }
}

impl FrontendIo for tokio_rustls::server::TlsStream<tokio::net::TcpStream> {
    fn reset_on_close(&self) -> bool {
        self.get_ref().0.reset_on_close()
    }
}

impl FrontendIo for tokio::net::UnixStream {}

/// How the frontend is answered once the dial is decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reply {
    /// `200 Connection Established` (CONNECT), or the dial error's status.
    Established,
    /// Nothing on success: the destination's own answer to the forwarded
    /// request comes first; the dial error's status otherwise.
    Forwarded,
    /// A SOCKS5 reply: success, or the code the dial error maps to.
    Socks5,
}

/// Answers a dial that succeeded as the frontend's protocol does.
pub(crate) async fn answer_success<S: FrontendIo>(io: &mut S, reply: Reply) -> std::io::Result<()> {
    match reply {
        Reply::Established => io.write_all(ESTABLISHED).await,
        Reply::Socks5 => crate::wire::socks5::reply(io, crate::wire::socks5::rep::OK).await,
        Reply::Forwarded => Ok(()),
    }
}

/// Answers a failed dial as the frontend's protocol does: a SOCKS5 reply
/// (within 5 s), or an HTTP status with upstream's text.
pub(crate) async fn refuse<S: FrontendIo>(io: &mut S, e: &DialError, reply: Reply) {
    if reply == Reply::Socks5 {
        let _ = tokio::time::timeout(std::time::Duration::from_secs(5), async {
            let _ = crate::wire::socks5::reply(io, e.socks5_reply()).await;
            let _ = io.shutdown().await;
        })
        .await;
        return;
    }
    let body = match e {
        DialError::NoAgent => "currently no tunnels available: No agent available".to_string(),
        e => e.to_string(),
    };
    answer(io, e.http_status(), &body).await;
}

//! Frames: a type byte, a 4-byte big-endian length, the payload, with a
//! limit per type checked before the payload is read; the stream's
//! metadata as `key:value` lines; and why a stream failed ([`WireError`]).

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

pub(super) const PACKET: u8 = 0;

pub(super) const PING: u8 = 1;

pub(super) const PONG: u8 = 2;

pub(super) const OPEN: u8 = 3;

pub(super) const ANSWER: u8 = 4;

pub(super) const REFUSED: u8 = 5;

/// Frame header: type and length.
pub(super) const HEAD: usize = 5;

/// Largest packet (gRPC's customary 4 MiB, as on the gRPC transport).
pub const MAX_PACKET: usize = crate::transport::grpc::MAX_MESSAGE;

/// Largest OPEN, ANSWER or REFUSED (a ServiceAccount token is ≈ 1 KiB).
pub const MAX_META: usize = 16 * 1024;

/// The `Data` payload's tag in `Packet`, and `data`'s in `Data`
/// (proto.rs; checked by `heads_encode_like_prost`).
pub(super) const DATA_TAG: u32 = 4;

pub(super) const DATA_BYTES_TAG: u32 = 3;

/// What went wrong on the native transport.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// The connection failed.
    #[error("connection: {0}")]
    Io(#[from] std::io::Error),
    /// A frame type this side does not know.
    #[error("unknown frame type {0}")]
    UnknownFrame(u8),
    /// A frame type that has no place here.
    #[error("unexpected frame type {0}")]
    Unexpected(u8),
    /// A frame over its limit.
    #[error("a frame of type {kind} with {len} bytes is over the limit of {max}")]
    TooLarge {
        /// Its type.
        kind: u8,
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The connection ended inside a frame.
    #[error("the connection ended inside a frame")]
    Truncated,
    /// A packet that does not decode.
    #[error("a packet does not decode: {0}")]
    Decode(#[from] prost::DecodeError),
    /// Metadata that is not `key:value` lines of header names and values.
    #[error("bad metadata: {0}")]
    BadMeta(String),
    /// Nothing heard for the keepalive interval and the timeout after the PING.
    #[error("nothing heard for {0:?} (keepalive)")]
    Silent(Duration),
    /// This side's writer failed.
    #[error("sending failed: {0}")]
    Writer(String),
    /// More PINGs and PONGs than a stream's budget (flood.rs).
    #[error("more PINGs and PONGs than the stream's budget")]
    Flood,
}

/// `key:value` lines; keys and values must be header names and values.
pub(super) fn encode_meta(meta: &[(&str, &str)]) -> Result<Vec<u8>, WireError> {
    let mut out = Vec::new();
    for (k, v) in meta {
        http::header::HeaderName::from_bytes(k.as_bytes())
            .map_err(|_| WireError::BadMeta(format!("{k:?} is not a header name")))?;
        if http::header::HeaderValue::from_str(v).is_err() {
            return Err(WireError::BadMeta(format!(
                "the value of {k} is not a header value"
            )));
        }
        out.extend_from_slice(k.as_bytes());
        out.push(b':');
        out.extend_from_slice(v.as_bytes());
        out.push(b'\n');
    }
    Ok(out)
}

/// The lines of an OPEN or ANSWER as a metadata map.
pub fn decode_meta(b: &[u8]) -> Result<tonic::metadata::MetadataMap, WireError> {
    let mut headers = http::HeaderMap::new();
    let text = std::str::from_utf8(b).map_err(|_| WireError::BadMeta("not UTF-8".into()))?;
    for line in text.split_terminator('\n') {
        let Some((k, v)) = line.split_once(':') else {
            return Err(WireError::BadMeta("a line without ':'".into()));
        };
        let name = http::header::HeaderName::from_bytes(k.as_bytes())
            .map_err(|_| WireError::BadMeta(format!("{k:?} is not a header name")))?;
        let value = http::header::HeaderValue::from_str(v)
            .map_err(|_| WireError::BadMeta(format!("the value of {k} is not a header value")))?;
        headers.append(name, value);
    }
    Ok(tonic::metadata::MetadataMap::from_headers(headers))
}

/// The largest frame of type `kind`; `None` for an unknown type.
pub(super) fn limit(kind: u8) -> Option<usize> {
    match kind {
        PACKET => Some(MAX_PACKET),
        PING | PONG => Some(0),
        OPEN | ANSWER | REFUSED => Some(MAX_META),
        _ => None,
    }
}

/// Checks a frame header; the frame's type and length.
pub(super) fn check_head(head: [u8; HEAD]) -> Result<(u8, usize), WireError> {
    let kind = head[0];
    let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
    let max = limit(kind).ok_or(WireError::UnknownFrame(kind))?;
    if len > max {
        return Err(WireError::TooLarge { kind, len, max });
    }
    Ok((kind, len))
}

/// Reads one whole frame of the handshake (packets go through
/// [`Inbound`]): only a frame of a type in `kinds` is read, so before the
/// handshake (before the peer is authenticated) nothing larger than
/// [`MAX_META`] is ever allocated, whatever the peer announces.
pub(super) async fn read_frame<R: AsyncRead + Unpin>(
    rd: &mut R,
    kinds: &[u8],
) -> Result<(u8, Vec<u8>), WireError> {
    let mut head = [0u8; HEAD];
    rd.read_exact(&mut head).await.map_err(truncated)?;
    if !kinds.contains(&head[0]) {
        return Err(WireError::Unexpected(head[0]));
    }
    let (kind, len) = check_head(head)?;
    let mut body = vec![0u8; len];
    rd.read_exact(&mut body).await.map_err(truncated)?;
    Ok((kind, body))
}

pub(super) fn truncated(e: std::io::Error) -> WireError {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        WireError::Truncated
    } else {
        WireError::Io(e)
    }
}

pub(super) async fn write_frame<W: AsyncWrite + Unpin>(
    wr: &mut W,
    kind: u8,
    body: &[u8],
) -> Result<(), WireError> {
    let len = u32::try_from(body.len()).map_err(|_| WireError::BadMeta("over 4 GiB".into()))?;
    let mut f = Vec::with_capacity(HEAD + body.len());
    f.push(kind);
    f.extend_from_slice(&len.to_be_bytes());
    f.extend_from_slice(body);
    wr.write_all(&f).await?;
    wr.flush().await?;
    Ok(())
}

/// The ALPN protocol name.
pub const ALPN: &str = "seedlink-tunnel/1";

/// The stream's metadata: request or answer headers, as gRPC has them.
pub type Meta = Vec<(String, String)>;

/// A frame's body is read (and its buffer grown) this much at a time.
pub(super) const STEP: usize = 64 * 1024;

/// Frames handled in one poll before the reader yields.
pub(super) const CONTROL_BUDGET: usize = 64;

//! The stream's opening: OPEN from the agent, ANSWER or REFUSED from the
//! server, each one frame.

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};

use super::frame::*;

/// How the server answered an OPEN.
#[derive(Debug)]
pub enum Opened {
    /// It took the stream; its answer's metadata.
    Answer(tonic::metadata::MetadataMap),
    /// It refused it.
    Refused(tonic::Status),
}

/// The agent's side of the handshake: sends OPEN with `meta`, reads the
/// answer.
pub async fn open<IO: AsyncRead + AsyncWrite + Unpin>(
    io: &mut IO,
    meta: &[(&'static str, String)],
) -> Result<Opened, WireError> {
    let pairs: Vec<(&str, &str)> = meta.iter().map(|(k, v)| (*k, v.as_str())).collect();
    write_frame(io, OPEN, &encode_meta(&pairs)?).await?;
    match read_frame(io, &[ANSWER, REFUSED]).await? {
        (ANSWER, body) => Ok(Opened::Answer(decode_meta(&body)?)),
        (REFUSED, body) => Ok(Opened::Refused(status_of(&body))),
        (kind, _) => Err(WireError::Unexpected(kind)),
    }
}

/// A REFUSED frame's status: `code message`.
pub(super) fn status_of(body: &[u8]) -> tonic::Status {
    let text = String::from_utf8_lossy(body);
    let (code, message) = text.split_once(' ').unwrap_or((&text, ""));
    let code = code
        .parse::<i32>()
        .map_or(tonic::Code::Unknown, tonic::Code::from_i32);
    tonic::Status::new(code, message.to_string())
}

/// The server's side of the handshake: the OPEN's metadata.
pub async fn accept<R: AsyncRead + Unpin>(
    rd: &mut R,
) -> Result<tonic::metadata::MetadataMap, WireError> {
    match read_frame(rd, &[OPEN]).await? {
        (OPEN, body) => decode_meta(&body),
        (kind, _) => Err(WireError::Unexpected(kind)),
    }
}

/// Answers an OPEN with the answer's metadata.
pub async fn answer<W: AsyncWrite + Unpin>(
    wr: &mut W,
    meta: &tonic::metadata::MetadataMap,
) -> Result<(), WireError> {
    let headers = meta.clone().into_headers();
    let mut pairs = Vec::new();
    for (k, v) in &headers {
        let v = v
            .to_str()
            .map_err(|_| WireError::BadMeta(format!("the value of {k} is not ASCII")))?;
        pairs.push((k.as_str(), v));
    }
    write_frame(wr, ANSWER, &encode_meta(&pairs)?).await
}

/// Refuses an OPEN with `status`; the caller closes the connection.
pub async fn refuse<W: AsyncWrite + Unpin>(
    wr: &mut W,
    status: &tonic::Status,
) -> Result<(), WireError> {
    let mut text = format!("{} {}", status.code() as i32, status.message());
    // The message is ours, but a limit is a limit.
    let mut cut = text.len().min(MAX_META);
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    text.truncate(cut);
    write_frame(wr, REFUSED, text.as_bytes()).await?;
    wr.shutdown().await?;
    Ok(())
}

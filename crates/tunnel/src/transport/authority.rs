//! Makes kube-apiserver's gRPC-over-Unix-socket requests acceptable to the
//! HTTP/2 server: grpc-go (and grpcio ≥ 1.57) put the socket *path* in
//! `:authority` when dialling a Unix socket by path, which is not a valid
//! authority, and the h2 crate refuses such requests (hyperium/h2#487). Go's
//! HTTP/2 server, which upstream Konnectivity uses, does not check.
//!
//! No crate rewrites headers between a client and an h2 server, so this is
//! hand-written: the client's bytes pass through a task that parses HTTP/2
//! frames, decodes each header block (HPACK via `loona-hpack`, keeping the
//! client's dynamic table), replaces an invalid `:authority` by `localhost`,
//! re-encodes the block for the server (a second HPACK context, mirrored by
//! the server's decoder) and forwards everything else untouched.

use std::io;

use loona_hpack::{Decoder, Encoder};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// Frames emitted here stay within HTTP/2's default maximum frame size.
const OUT_FRAME: usize = 16 * 1024;
/// Largest frame accepted from the client (the server advertises 256 KiB).
const MAX_IN_FRAME: usize = 256 * 1024;
/// Largest header block accepted (the server's header list limit is 16 KiB).
const MAX_BLOCK: usize = 64 * 1024;
/// Largest decoded header list (RFC 7541 §4.1 sizes: name + value + 32
/// per field). A small block can reference a table entry thousands of
/// times (an "HPACK bomb"); decoding stops collecting past this.
const MAX_DECODED: usize = 64 * 1024;
/// Frames one header block may span (HEADERS and its CONTINUATIONs): a
/// client sending empty CONTINUATION frames without end would otherwise
/// keep this task busy for nothing (the CONTINUATION flood, CVE-2024-27316
/// and its kin); legitimate blocks here fit one or two frames.
const MAX_BLOCK_FRAMES: usize = 64;
/// The dynamic table size the client may ask for: HTTP/2's default
/// `SETTINGS_HEADER_TABLE_SIZE`, which the server behind never raises.
const MAX_TABLE: usize = 4096;

fn bad(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_string())
}

struct Block {
    flags: u8,
    stream: [u8; 4],
    priority: Option<[u8; 5]>,
    fragment: Vec<u8>,
    /// Frames so far.
    frames: usize,
}

impl Block {
    /// A header block opened by a HEADERS frame (head `h`): its fragment
    /// without padding, and its priority fields.
    fn open(h: &[u8; 9], payload: &[u8]) -> io::Result<Block> {
        let flags = h[4];
        let mut p = payload;
        let mut pad = 0usize;
        if flags & PADDED != 0 {
            let (&n, rest) = p.split_first().ok_or_else(|| bad("padding"))?;
            pad = usize::from(n);
            p = rest;
        }
        let priority = if flags & PRIORITY != 0 {
            let (pr, rest) = p.split_first_chunk::<5>().ok_or_else(|| bad("priority"))?;
            p = rest;
            Some(*pr)
        } else {
            None
        };
        let frag = p
            .get(..p.len().checked_sub(pad).ok_or_else(|| bad("padding"))?)
            .ok_or_else(|| bad("padding"))?;
        let stream = [h[5], h[6], h[7], h[8]];
        Ok(Block {
            flags,
            stream,
            priority,
            fragment: frag.to_vec(),
            frames: 1,
        })
    }

    /// A CONTINUATION frame (head `h`) of this block.
    fn extend(&mut self, h: &[u8; 9], payload: &[u8]) -> io::Result<()> {
        if h[5..9] != self.stream {
            return Err(bad("CONTINUATION on another stream"));
        }
        self.fragment.extend_from_slice(payload);
        self.frames += 1;
        if self.fragment.len() > MAX_BLOCK {
            return Err(bad("header block too large"));
        }
        if self.frames > MAX_BLOCK_FRAMES {
            return Err(bad("header block in too many frames"));
        }
        Ok(())
    }
}

/// Copies `r` to `w`, rewriting header blocks as described above, until
/// `r` ends or a frame is malformed (then the connection is ended).
pub async fn rewrite<R, W>(mut r: R, mut w: W) -> io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut preface = [0u8; 24];
    r.read_exact(&mut preface).await?;
    if &preface != PREFACE {
        return Err(bad("not an HTTP/2 connection"));
    }
    w.write_all(&preface).await?;
    let mut dec = Decoder::new();
    dec.set_max_allowed_table_size(MAX_TABLE);
    let mut enc = Encoder::new();
    let mut open: Option<Block> = None;
    while let Some((h, payload)) = read_frame(&mut r).await? {
        let (typ, flags) = (h[3], h[4]);
        match (typ, open.as_mut()) {
            (HEADERS, None) => open = Some(Block::open(&h, &payload)?),
            (CONTINUATION, Some(b)) => b.extend(&h, &payload)?,
            (_, Some(_)) | (CONTINUATION, None) => return Err(bad("frame inside a header block")),
            _ => {
                w.write_all(&h).await?;
                w.write_all(&payload).await?;
                continue;
            }
        }
        if flags & END_HEADERS != 0 {
            if let Some(b) = open.take() {
                emit(&mut w, &mut dec, &mut enc, b).await?;
            }
        }
    }
    w.shutdown().await
}

/// The next frame's head and payload; `None` when `r` ends between frames.
async fn read_frame<R: AsyncRead + Unpin>(r: &mut R) -> io::Result<Option<([u8; 9], Vec<u8>)>> {
    let mut h = [0u8; 9];
    match r.read_exact(&mut h).await {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = usize::from(h[0]) << 16 | usize::from(h[1]) << 8 | usize::from(h[2]);
    if len > MAX_IN_FRAME {
        return Err(bad("frame too large"));
    }
    let mut payload = vec![0u8; len];
    r.read_exact(&mut payload).await?;
    Ok(Some((h, payload)))
}

/// Writes block `b` again for the server, its `:authority` made valid.
async fn emit<W: AsyncWrite + Unpin>(
    w: &mut W,
    dec: &mut Decoder<'_>,
    enc: &mut Encoder<'_>,
    b: Block,
) -> io::Result<()> {
    let mut headers = decode(dec, &b.fragment)?;
    for (name, value) in &mut headers {
        if name.as_slice() == b":authority"
            && std::str::from_utf8(value)
                .map_or(true, |v| v.parse::<http::uri::Authority>().is_err())
        {
            *value = b"localhost".to_vec();
        }
    }
    let mut out: Vec<u8> = b.priority.map(|p| p.to_vec()).unwrap_or_default();
    enc.encode_into(
        headers.iter().map(|(n, v)| (n.as_slice(), v.as_slice())),
        &mut out,
    )?;
    write_block(w, &b, &out).await
}

/// The header list of a block, within [`MAX_DECODED`].
fn decode(dec: &mut Decoder<'_>, fragment: &[u8]) -> io::Result<Vec<(Vec<u8>, Vec<u8>)>> {
    let mut headers = Vec::new();
    let mut size = 0usize;
    // Past the limit nothing more is copied (indexed fields are borrowed
    // from the table), so a bomb costs only its own bytes of work.
    dec.decode_with_cb(fragment, |n, v| {
        size = size.saturating_add(n.len() + v.len() + 32);
        if size <= MAX_DECODED {
            headers.push((n.into_owned(), v.into_owned()));
        }
    })
    .map_err(|e| bad(&format!("HPACK: {e:?}")))?;
    if size > MAX_DECODED {
        return Err(bad("header list too large"));
    }
    Ok(headers)
}

/// Writes an encoded block `out` (for the stream and flags of `b`) as a
/// HEADERS frame and CONTINUATION frames of at most [`OUT_FRAME`] bytes.
async fn write_block<W: AsyncWrite + Unpin>(w: &mut W, b: &Block, out: &[u8]) -> io::Result<()> {
    let parts: Vec<&[u8]> = if out.is_empty() {
        vec![&[]]
    } else {
        out.chunks(OUT_FRAME).collect()
    };
    let count = parts.len();
    for (i, chunk) in parts.into_iter().enumerate() {
        let (typ, mut flags) = if i == 0 {
            (HEADERS, b.flags & (END_STREAM | PRIORITY))
        } else {
            (CONTINUATION, 0)
        };
        if i + 1 == count {
            flags |= END_HEADERS;
        }
        let n = chunk.len();
        let head = [
            ((n >> 16) & 0xff) as u8,
            ((n >> 8) & 0xff) as u8,
            (n & 0xff) as u8,
            typ,
            flags,
            b.stream[0],
            b.stream[1],
            b.stream[2],
            b.stream[3],
        ];
        w.write_all(&head).await?;
        w.write_all(chunk).await?;
    }
    w.flush().await
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn frame(typ: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let n = payload.len();
        let mut f = vec![(n >> 16) as u8, (n >> 8) as u8, n as u8, typ, flags];
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    /// Splits `bytes` (after the preface) into (type, flags, payload).
    fn frames(mut bytes: &[u8]) -> Vec<(u8, u8, Vec<u8>)> {
        let mut out = Vec::new();
        while bytes.len() >= 9 {
            let n =
                usize::from(bytes[0]) << 16 | usize::from(bytes[1]) << 8 | usize::from(bytes[2]);
            out.push((bytes[3], bytes[4], bytes[9..9 + n].to_vec()));
            bytes = &bytes[9 + n..];
        }
        out
    }

    #[tokio::test]
    async fn a_socket_path_authority_becomes_localhost_and_the_rest_passes() {
        let mut enc = Encoder::new();
        let headers: Vec<(&[u8], &[u8])> = vec![
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", b"/ProxyService/Proxy"),
            (
                b":authority",
                b"/etc/kubernetes/konnectivity-server/konnectivity-server.socket",
            ),
            (b"content-type", b"application/grpc"),
        ];
        let block = enc.encode(headers.clone());
        let (a, b) = block.split_at(10);
        let mut input = PREFACE.to_vec();
        input.extend(frame(0x4, 0, 0, &[])); // SETTINGS
        input.extend(frame(HEADERS, 0, 1, a)); // split over a CONTINUATION
        input.extend(frame(CONTINUATION, END_HEADERS, 1, b));
        input.extend(frame(0x0, END_STREAM, 1, b"grpc-bytes")); // DATA
                                                                // A second request whose valid authority must stay (and whose block
                                                                // uses the client's dynamic table).
        let block2 = enc.encode(vec![
            (b":method".as_slice(), b"POST".as_slice()),
            (b":authority", b"localhost:8090"),
            (b"content-type", b"application/grpc"),
        ]);
        input.extend(frame(
            HEADERS,
            END_HEADERS | PADDED,
            3,
            &[&[2u8][..], &block2, &[0, 0]].concat(),
        ));
        let mut out = Vec::new();
        rewrite(input.as_slice(), &mut out).await.unwrap();
        assert_eq!(&out[..24], PREFACE);
        let fs = frames(&out[24..]);
        assert_eq!(fs.len(), 4, "{fs:?}");
        assert_eq!((fs[0].0, fs[0].1), (0x4, 0));
        assert_eq!((fs[1].0, fs[1].1), (HEADERS, END_HEADERS));
        assert_eq!(
            (fs[2].0, fs[2].1, fs[2].2.as_slice()),
            (0x0, END_STREAM, b"grpc-bytes".as_slice())
        );
        assert_eq!((fs[3].0, fs[3].1), (HEADERS, END_HEADERS));
        let mut dec = Decoder::new();
        let got = dec.decode(&fs[1].2).unwrap();
        let want: Vec<(Vec<u8>, Vec<u8>)> = headers
            .iter()
            .map(|(n, v)| {
                let v: &[u8] = if *n == b":authority" { b"localhost" } else { v };
                (n.to_vec(), v.to_vec())
            })
            .collect();
        assert_eq!(got, want);
        let got2 = dec.decode(&fs[3].2).unwrap();
        assert!(
            got2.contains(&(b":authority".to_vec(), b"localhost:8090".to_vec())),
            "{got2:?}"
        );
    }

    #[tokio::test]
    async fn malformed_input_ends_the_connection() {
        let mut input = PREFACE.to_vec();
        input.extend(frame(CONTINUATION, END_HEADERS, 1, b"x"));
        let mut out = Vec::new();
        assert!(rewrite(input.as_slice(), &mut out).await.is_err());
        assert!(
            rewrite(&b"GET / HTTP/1.1\r\n\r\n-----"[..], &mut Vec::new())
                .await
                .is_err()
        );
        let mut input = PREFACE.to_vec();
        input.extend(frame(HEADERS, END_HEADERS | PADDED, 1, &[200, 1, 2]));
        assert!(rewrite(input.as_slice(), &mut Vec::new()).await.is_err());
    }

    /// One 4 KiB table entry referenced by every byte of a 64 KiB block
    /// would decode to 256 MiB: refused instead, as is a table larger than
    /// HTTP/2's default.
    #[tokio::test]
    async fn hpack_bombs_are_refused() {
        // Literal with incremental indexing, new name (RFC 7541 §6.2.1):
        // one 4,037-byte table entry (value length 4000 = 127 + 0x21 +
        // 0x1e * 128, a 7-bit prefix integer).
        let mut bomb = vec![0x40, 5];
        bomb.extend_from_slice(b"x-big");
        bomb.extend_from_slice(&[0x7f, 0xa1, 0x1e]);
        bomb.extend(std::iter::repeat_n(b'a', 4000));
        // 0xbe: indexed field 62, the first dynamic entry, over and over.
        bomb.extend(std::iter::repeat_n(0xbe, 50_000));
        let mut input = PREFACE.to_vec();
        let mut at = 0;
        let chunks: Vec<&[u8]> = bomb.chunks(16 * 1024).collect();
        for (i, c) in chunks.iter().enumerate() {
            let last = i + 1 == chunks.len();
            let typ = if i == 0 { HEADERS } else { CONTINUATION };
            input.extend(frame(typ, if last { END_HEADERS } else { 0 }, 1, c));
            at += c.len();
        }
        assert_eq!(at, bomb.len());
        let mut out = Vec::new();
        let e = rewrite(&input[..], &mut out).await.unwrap_err();
        assert!(e.to_string().contains("too large"), "{e}");
        assert!(out.len() < 1024, "{} bytes forwarded", out.len());

        // A dynamic table size update past 4096.
        let mut input = PREFACE.to_vec();
        input.extend(frame(
            HEADERS,
            END_HEADERS,
            1,
            &[0x3f, 0xe1, 0xff, 0x03, 0x82],
        ));
        let e = rewrite(&input[..], &mut Vec::new()).await.unwrap_err();
        assert!(e.to_string().contains("HPACK"), "{e}");
    }

    /// A header block spread over empty CONTINUATION frames without end
    /// (the CONTINUATION flood) is refused after a bounded number of
    /// frames, not read for as long as the client sends.
    #[tokio::test]
    async fn empty_continuations_without_end_are_refused() {
        let mut input = PREFACE.to_vec();
        input.extend(frame(HEADERS, 0, 1, &[0x82]));
        for _ in 0..100_000 {
            input.extend(frame(CONTINUATION, 0, 1, &[]));
        }
        let mut rd = &input[..];
        let e = rewrite(&mut rd, &mut Vec::new()).await.unwrap_err();
        assert!(e.to_string().contains("too many frames"), "{e}");
        assert!(rd.len() > 99_000 * 9, "it stopped reading early");
    }
}

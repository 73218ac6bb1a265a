//! TLS ClientHello parsing: just enough to route by SNI without terminating TLS.
//!
//! Handles a ClientHello split across several TLS records and, because the
//! caller feeds every byte received so far, across any TCP segmentation.
//! The parser never copies when the hello fits in one record (the common
//! case) and stops at a hard size cap.

use std::borrow::Cow;

use crate::Parse;

/// Largest TLS record payload allowed by RFC 8446 §5.1 for plaintext records.
const MAX_RECORD_PAYLOAD: usize = 16_384;
const RECORD_HEADER: usize = 5;
const CONTENT_HANDSHAKE: u8 = 22;
const HANDSHAKE_CLIENT_HELLO: u8 = 1;
const EXT_SERVER_NAME: u16 = 0;
const EXT_ALPN: u16 = 16;

/// What the gateway needs to know about a ClientHello.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientHello {
    /// The `host_name` from the server_name extension, lower-cased, if any.
    pub sni: Option<String>,
    /// ALPN protocol names offered by the client, in order (for logs only).
    pub alpn: Vec<String>,
    /// Number of bytes (whole records) that made up the ClientHello.
    pub len: usize,
}

/// Why bytes were rejected as a ClientHello.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reject {
    /// The first byte is not a TLS handshake record.
    NotTls,
    /// An SSLv2-style (high bit set) hello, which carries no SNI.
    Sslv2,
    /// A TLS record or ClientHello that violates the specification.
    Malformed(&'static str),
    /// The hello does not fit in the configured size cap.
    TooLarge,
}

impl Reject {
    /// Stable, low-cardinality label for metrics and logs.
    pub fn reason(&self) -> &'static str {
        match self {
            Reject::NotTls => "not_tls",
            Reject::Sslv2 => "sslv2",
            Reject::Malformed(_) => "malformed_hello",
            Reject::TooLarge => "hello_too_large",
        }
    }

    /// Human-readable detail for logs.
    pub fn detail(&self) -> &'static str {
        match self {
            Reject::NotTls => "first byte is not a TLS handshake record",
            Reject::Sslv2 => "SSLv2-style ClientHello",
            Reject::Malformed(why) => why,
            Reject::TooLarge => "ClientHello larger than the configured cap",
        }
    }
}

/// Parses the ClientHello at the start of `buf`, reading at most `max_len` bytes.
///
/// Returns `Incomplete` while `buf` is a strict prefix of a valid hello that
/// still fits within `max_len`; once complete, the answer never changes when
/// more bytes are appended.
pub fn parse(buf: &[u8], max_len: usize) -> Parse<ClientHello, Reject> {
    let Some(&first) = buf.first() else {
        return Parse::Incomplete;
    };
    if first != CONTENT_HANDSHAKE {
        return Parse::Invalid(if first & 0x80 != 0 {
            Reject::Sslv2
        } else {
            Reject::NotTls
        });
    }
    match reassemble(buf, max_len) {
        Parse::Done((body, len)) => match parse_body(&body) {
            Ok((sni, alpn)) => Parse::Done(ClientHello { sni, alpn, len }),
            Err(why) => Parse::Invalid(Reject::Malformed(why)),
        },
        Parse::Incomplete => Parse::Incomplete,
        Parse::Invalid(r) => Parse::Invalid(r),
    }
}

/// Collects the ClientHello handshake message from one or more records.
/// Returns the message body (after the 4-byte handshake header) and the
/// number of record bytes consumed.
fn reassemble(buf: &[u8], max_len: usize) -> Parse<(Cow<'_, [u8]>, usize), Reject> {
    let mut pos = 0;
    let mut frags: Vec<&[u8]> = Vec::new();
    loop {
        if buf.len() < pos + RECORD_HEADER {
            return needs_more(pos + RECORD_HEADER, max_len);
        }
        let rec_len = match record_len(&buf[pos..pos + RECORD_HEADER]) {
            Ok(n) => n,
            Err(why) => return Parse::Invalid(Reject::Malformed(why)),
        };
        let frag_start = pos + RECORD_HEADER;
        // Check the handshake header as soon as it is visible, before the whole
        // record arrives, so a wrong or oversized message is not waited for.
        let visible = &buf[frag_start..buf.len().min(frag_start + rec_len)];
        let msg_len = match message_len(&frags, visible, max_len) {
            Ok(n) => n,
            Err(r) => return Parse::Invalid(r),
        };
        if frag_start + rec_len > max_len {
            return Parse::Invalid(Reject::TooLarge);
        }
        if buf.len() < frag_start + rec_len {
            return Parse::Incomplete;
        }
        frags.push(&buf[frag_start..frag_start + rec_len]);
        pos = frag_start + rec_len;
        let total: usize = frags.iter().map(|f| f.len()).sum();
        let Some(msg_len) = msg_len else {
            continue;
        };
        if total < 4 + msg_len {
            continue;
        }
        if total > 4 + msg_len {
            return Parse::Invalid(Reject::Malformed(
                "trailing handshake data after ClientHello",
            ));
        }
        return Parse::Done((body_of(&frags), pos));
    }
}

/// A handshake record's payload length, from its header.
fn record_len(hdr: &[u8]) -> Result<usize, &'static str> {
    if hdr[0] != CONTENT_HANDSHAKE {
        return Err("non-handshake record inside ClientHello");
    }
    if hdr[1] != 3 || hdr[2] > 4 {
        return Err("unsupported record version");
    }
    let rec_len = usize::from(u16::from_be_bytes([hdr[3], hdr[4]]));
    if rec_len == 0 {
        return Err("empty handshake record");
    }
    if rec_len > MAX_RECORD_PAYLOAD {
        return Err("record longer than 2^14 bytes");
    }
    Ok(rec_len)
}

/// The handshake message's length once its 4-byte header is visible in the
/// fragments so far and the one arriving; a message that is no ClientHello,
/// or whose records could not fit in `max_len`, is refused.
fn message_len(frags: &[&[u8]], visible: &[u8], max_len: usize) -> Result<Option<usize>, Reject> {
    let mut head = [0u8; 4];
    let mut seen = 0;
    for &b in frags
        .iter()
        .chain(std::iter::once(&visible))
        .flat_map(|f| f.iter())
        .take(4)
    {
        head[seen] = b;
        seen += 1;
    }
    if seen >= 1 && head[0] != HANDSHAKE_CLIENT_HELLO {
        return Err(Reject::Malformed(
            "first handshake message is not a ClientHello",
        ));
    }
    let msg_len = (seen == 4).then(|| u24(&head[1..4]));
    if let Some(msg_len) = msg_len {
        let records_min = msg_len.div_ceil(MAX_RECORD_PAYLOAD).max(1) * RECORD_HEADER;
        if 4 + msg_len + records_min > max_len {
            return Err(Reject::TooLarge);
        }
    }
    Ok(msg_len)
}

/// The message body after its 4-byte header: borrowed from a single
/// record, joined from several.
fn body_of<'a>(frags: &[&'a [u8]]) -> Cow<'a, [u8]> {
    if let [only] = frags {
        Cow::Borrowed(&only[4..])
    } else {
        let mut all = frags.concat();
        all.drain(..4);
        Cow::Owned(all)
    }
}

fn needs_more<T>(at_least: usize, max_len: usize) -> Parse<T, Reject> {
    if at_least > max_len {
        Parse::Invalid(Reject::TooLarge)
    } else {
        Parse::Incomplete
    }
}

fn u24(b: &[u8]) -> usize {
    (usize::from(b[0]) << 16) | (usize::from(b[1]) << 8) | usize::from(b[2])
}

/// A bounds-checked big-endian reader over a byte slice.
struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], &'static str> {
        if self.buf.len() < n {
            return Err(what);
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }
    fn u8(&mut self, what: &'static str) -> Result<u8, &'static str> {
        Ok(self.take(1, what)?[0])
    }
    fn u16(&mut self, what: &'static str) -> Result<u16, &'static str> {
        let b = self.take(2, what)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }
    fn vec8(&mut self, what: &'static str) -> Result<&'a [u8], &'static str> {
        let n = self.u8(what)?;
        self.take(usize::from(n), what)
    }
    fn vec16(&mut self, what: &'static str) -> Result<&'a [u8], &'static str> {
        let n = self.u16(what)?;
        self.take(usize::from(n), what)
    }
    fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }
}

type Body = (Option<String>, Vec<String>);

/// A TLS `client_version`: 0x0301 (TLS 1.0) or later. 0x0300 is SSL 3.0
/// (no TLS 1.3 client sends it either: its legacy_version is 0x0303).
fn check_version(version: u16) -> Result<(), &'static str> {
    if version >> 8 != 3 {
        return Err("client_version is not TLS");
    }
    if version < 0x0301 {
        return Err("client_version is SSL 3.0");
    }
    Ok(())
}

fn parse_body(body: &[u8]) -> Result<Body, &'static str> {
    let mut r = Reader { buf: body };
    check_version(r.u16("truncated client_version")?)?;
    r.take(32, "truncated random")?;
    if r.vec8("truncated session_id")?.len() > 32 {
        return Err("session_id longer than 32 bytes");
    }
    let suites = r.vec16("truncated cipher_suites")?;
    if suites.is_empty() || suites.len() % 2 != 0 {
        return Err("invalid cipher_suites length");
    }
    if r.vec8("truncated compression_methods")?.is_empty() {
        return Err("no compression methods");
    }
    if r.is_empty() {
        return Ok((None, Vec::new()));
    }
    let exts = Reader {
        buf: r.vec16("truncated extensions")?,
    };
    if !r.is_empty() {
        return Err("trailing bytes after extensions");
    }
    parse_extensions(exts)
}

/// The server name and ALPN protocols among the extensions (each at most
/// once).
fn parse_extensions(mut exts: Reader<'_>) -> Result<Body, &'static str> {
    let mut seen: Vec<u16> = Vec::new();
    let mut sni = None;
    let mut alpn = Vec::new();
    while !exts.is_empty() {
        let ty = exts.u16("truncated extension type")?;
        let data = exts.vec16("truncated extension")?;
        if seen.contains(&ty) {
            return Err("duplicate extension");
        }
        seen.push(ty);
        match ty {
            EXT_SERVER_NAME => sni = parse_server_name(data)?,
            EXT_ALPN => alpn = parse_alpn(data)?,
            _ => {}
        }
    }
    Ok((sni, alpn))
}

fn parse_server_name(data: &[u8]) -> Result<Option<String>, &'static str> {
    let mut r = Reader { buf: data };
    let mut list = Reader {
        buf: r.vec16("truncated server_name list")?,
    };
    if !r.is_empty() || list.is_empty() {
        return Err("invalid server_name extension length");
    }
    let mut host = None;
    while !list.is_empty() {
        let name_type = list.u8("truncated server_name entry")?;
        let name = list.vec16("truncated server_name entry")?;
        if name_type != 0 {
            continue;
        }
        if host.is_some() {
            return Err("more than one host_name in server_name");
        }
        host = Some(validate_host(name)?);
    }
    Ok(host)
}

/// Accepts DNS host names (letters, digits, `-`, `_`, `.`), 1–253 bytes
/// plus an optional trailing dot; anything else is malformed.
fn validate_host(name: &[u8]) -> Result<String, &'static str> {
    if name.is_empty() || name.len() > 254 {
        return Err("server name empty or too long");
    }
    if !name
        .iter()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
    {
        return Err("server name has invalid characters");
    }
    let s: String = name
        .iter()
        .map(|b| char::from(b.to_ascii_lowercase()))
        .collect();
    Ok(s)
}

fn parse_alpn(data: &[u8]) -> Result<Vec<String>, &'static str> {
    let mut r = Reader { buf: data };
    let mut list = Reader {
        buf: r.vec16("truncated ALPN list")?,
    };
    if !r.is_empty() || list.is_empty() {
        return Err("invalid ALPN extension length");
    }
    let mut out = Vec::new();
    while !list.is_empty() {
        let p = list.vec8("truncated ALPN protocol")?;
        if p.is_empty() {
            return Err("empty ALPN protocol name");
        }
        out.push(String::from_utf8_lossy(p).into_owned());
    }
    Ok(out)
}

#[cfg(test)]
mod tests;

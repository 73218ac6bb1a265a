//! The head of an HTTP/1.x request on a CONNECT listener.
//!
//! Two layers: a strict byte scan written here (CRLF only, no bare CR or LF,
//! no control bytes, no obs-fold, per-line and header-count caps, a total
//! cap) that finds where the head ends, then `httparse` for the tokens. The
//! scan stops at the blank line: bytes after the head are never looked at.

use crate::Parse;

/// Size caps for a request head.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// The whole head, request line to blank line inclusive.
    pub max_head_bytes: usize,
    /// One line (request line or header line), without CRLF.
    pub max_line_bytes: usize,
    /// Header lines.
    pub max_headers: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_head_bytes: 8192,
            max_line_bytes: 4096,
            max_headers: 32,
        }
    }
}

/// A parsed request head.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Head {
    /// The method, as sent (case-sensitive per RFC 9110).
    pub method: String,
    /// The request target, as sent (logged, never used for routing).
    pub target: String,
    /// Minor version: 0 for HTTP/1.0, 1 for HTTP/1.1.
    pub minor_version: u8,
    /// Header fields in order; names lower-cased, values as sent (trimmed).
    pub headers: Vec<(String, String)>,
    /// Length of the head in bytes, blank line included.
    pub len: usize,
}

impl Head {
    /// Every value of header `name` (any case), in order.
    pub fn values<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.headers
            .iter()
            .filter(move |(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Why bytes were rejected as a request head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reject {
    /// No blank line within the head cap.
    TooLarge,
    /// A line longer than the line cap.
    LineTooLong,
    /// More header lines than allowed.
    TooManyHeaders,
    /// A CR not followed by LF, or an LF not preceded by CR.
    BareLineEnding,
    /// A control byte (other than HT inside a line) or DEL.
    ControlByte,
    /// A header line starting with whitespace (obsolete line folding).
    ObsFold,
    /// Not an HTTP/1.0 or HTTP/1.1 request head.
    Malformed(&'static str),
}

impl Reject {
    /// Stable, low-cardinality label for metrics and logs.
    pub fn reason(&self) -> &'static str {
        match self {
            Reject::TooLarge => "head_too_large",
            Reject::LineTooLong => "line_too_long",
            Reject::TooManyHeaders => "too_many_headers",
            Reject::BareLineEnding => "bare_cr_lf",
            Reject::ControlByte => "control_byte",
            Reject::ObsFold => "obs_fold",
            Reject::Malformed(_) => "malformed_head",
        }
    }
}

/// The headers as (lowercase name, trimmed value); `None` when a value is
/// not UTF-8.
fn header_pairs(headers: &[httparse::Header<'_>]) -> Option<Vec<(String, String)>> {
    headers
        .iter()
        .map(|h| {
            let value = std::str::from_utf8(h.value).ok()?;
            Some((
                h.name.to_ascii_lowercase(),
                value.trim_matches([' ', '\t']).to_string(),
            ))
        })
        .collect()
}

/// Parses the request head at the start of `buf`.
pub fn parse(buf: &[u8], limits: &Limits) -> Parse<Head, Reject> {
    let end = match scan(buf, limits) {
        Parse::Done(end) => end,
        Parse::Incomplete => return Parse::Incomplete,
        Parse::Invalid(r) => return Parse::Invalid(r),
    };
    let mut headers = vec![httparse::EMPTY_HEADER; limits.max_headers.max(1)];
    let mut req = httparse::Request::new(&mut headers);
    if let Err(r) = parse_whole(&mut req, &buf[..end]) {
        return Parse::Invalid(r);
    }
    let (Some(method), Some(target), Some(minor)) = (req.method, req.path, req.version) else {
        return Parse::Invalid(Reject::Malformed("incomplete request line"));
    };
    let Some(out) = header_pairs(req.headers) else {
        return Parse::Invalid(Reject::Malformed("header value is not UTF-8"));
    };
    Parse::Done(Head {
        method: method.to_string(),
        target: target.to_string(),
        minor_version: minor,
        headers: out,
        len: end,
    })
}

/// Parses a head that `scan` delimited: it must end exactly there.
fn parse_whole<'h, 'b>(req: &mut httparse::Request<'h, 'b>, head: &'b [u8]) -> Result<(), Reject> {
    match req.parse(head) {
        Ok(httparse::Status::Complete(n)) if n == head.len() => Ok(()),
        Ok(_) => Err(Reject::Malformed(
            "request head did not end at the blank line",
        )),
        Err(httparse::Error::Version) => Err(Reject::Malformed("not HTTP/1.0 or HTTP/1.1")),
        Err(httparse::Error::TooManyHeaders) => Err(Reject::TooManyHeaders),
        Err(_) => Err(Reject::Malformed("invalid request line or header")),
    }
}

/// Finds the end of the head (index after the blank line's LF) while
/// enforcing the byte-level rules and caps.
fn scan(buf: &[u8], limits: &Limits) -> Parse<usize, Reject> {
    let window = &buf[..buf.len().min(limits.max_head_bytes)];
    let mut line_start = 0;
    let mut lines = 0usize;
    let mut i = 0;
    while i < window.len() {
        let b = window[i];
        match b {
            b'\r' => {
                let Some(&next) = window.get(i + 1) else {
                    return more(buf, limits);
                };
                if next != b'\n' {
                    return Parse::Invalid(Reject::BareLineEnding);
                }
                if i == line_start {
                    return end_of_head(lines, i + 2);
                }
                lines += 1;
                i += 2;
                line_start = i;
                if let Err(r) = next_line(window, i, lines, limits) {
                    return Parse::Invalid(r);
                }
                continue;
            }
            b'\n' => return Parse::Invalid(Reject::BareLineEnding),
            b'\t' => {}
            0..=0x1f | 0x7f => return Parse::Invalid(Reject::ControlByte),
            _ => {}
        }
        if i - line_start >= limits.max_line_bytes {
            return Parse::Invalid(Reject::LineTooLong);
        }
        i += 1;
    }
    more(buf, limits)
}

/// The blank line at `end`: the head's end, unless no line came before it.
fn end_of_head(lines: usize, end: usize) -> Parse<usize, Reject> {
    if lines == 0 {
        return Parse::Invalid(Reject::Malformed("empty line before the request line"));
    }
    Parse::Done(end)
}

/// Checks made when a line ended and the next starts at `at`: no more
/// lines than the cap, and no obsolete line folding.
fn next_line(window: &[u8], at: usize, lines: usize, limits: &Limits) -> Result<(), Reject> {
    if lines > limits.max_headers + 1 {
        return Err(Reject::TooManyHeaders);
    }
    if let Some(&first) = window.get(at) {
        if first == b' ' || first == b'\t' {
            return Err(Reject::ObsFold);
        }
    }
    Ok(())
}

fn more<T>(buf: &[u8], limits: &Limits) -> Parse<T, Reject> {
    if buf.len() >= limits.max_head_bytes {
        Parse::Invalid(Reject::TooLarge)
    } else {
        Parse::Incomplete
    }
}

/// Whether a CONNECT request-target is in authority form, `host:port`
/// (RFC 9110 §9.3.6): a registered name (letters, digits, `-`, `.`, `_`,
/// `~`), an IPv4 address or a bracketed IPv6 address, then a port of 1–5
/// digits between 1 and 65535. No userinfo, no path, no scheme, no `*`, no
/// sign, no empty host.
pub fn authority_form(target: &str) -> bool {
    let Some((host, port)) = target.rsplit_once(':') else {
        return false;
    };
    let port_ok = (1..=5).contains(&port.len())
        && port.bytes().all(|b| b.is_ascii_digit())
        && port.parse::<u16>().is_ok_and(|p| p != 0);
    let host_ok = if let Some(v6) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        v6.parse::<std::net::Ipv6Addr>().is_ok()
    } else {
        !host.is_empty()
            && host.len() <= 253
            && host
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~'))
    };
    port_ok && host_ok
}

#[cfg(test)]
mod tests;

//! PROXY protocol v1 and v2 headers, as sent by load balancers.
//!
//! Framing (how many bytes belong to the header, size caps, the v1 CRLF rule)
//! is done here so that "need more bytes" is answered exactly; the fields are
//! decoded by the `ppp` crate. On top of `ppp` this module enforces what a
//! gateway that bases ACLs on the carried address must insist on: TCP only,
//! matching address families, unicast addresses.

use std::net::{IpAddr, SocketAddr};

use crate::Parse;

/// The 12-byte signature that starts every v2 header.
pub const V2_SIGNATURE: [u8; 12] = *b"\r\n\r\n\0\r\nQUIT\n";
const V1_PREFIX: &[u8] = b"PROXY ";
/// Maximum v1 header length including CRLF (spec §2.1).
pub const V1_MAX_LEN: usize = 107;
const V2_FIXED: usize = 16;

/// What a PROXY header says about the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Addresses {
    /// v2 LOCAL (e.g. a load balancer health check) or v1 `UNKNOWN`:
    /// the socket's own addresses apply.
    Local,
    /// The original client (`source`) and the address it connected to.
    Proxied {
        /// The original client.
        source: SocketAddr,
        /// The address the client connected to.
        destination: SocketAddr,
    },
}

/// A parsed header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProxyHeader {
    /// 1 or 2.
    pub version: u8,
    /// The carried addresses.
    pub addresses: Addresses,
    /// Header length in bytes; the payload starts right after.
    pub len: usize,
    /// Where the v2 TLV block starts (it ends at `len`); `len` when there is
    /// none (v1, or a v2 header without TLVs). Every TLV in it was checked
    /// to fit; [`tlv`] finds one by type.
    pub tlv_start: usize,
}

/// The value of the first TLV of type `ty` in `header`, which was parsed
/// from the start of `buf`. Types are raw bytes: 0x20 is `PP2_TYPE_SSL` in
/// the specification, but HyperShift's node proxies put a cluster ID there,
/// so no type is interpreted here.
pub fn tlv<'a>(buf: &'a [u8], header: &ProxyHeader, ty: u8) -> Option<&'a [u8]> {
    let mut block = buf.get(header.tlv_start..header.len)?;
    while let [t, hi, lo, rest @ ..] = block {
        let n = usize::from(u16::from_be_bytes([*hi, *lo]));
        let value = rest.get(..n)?;
        if *t == ty {
            return Some(value);
        }
        block = &rest[n..];
    }
    None
}

/// TLVs a v2 header may carry. Real senders put a handful (ALPN,
/// authority, CRC, unique ID, SSL, a vendor's); a header of a thousand
/// NOOPs is an attack on whoever walks the list.
const MAX_TLVS: usize = 32;
/// `PP2_TYPE_AUTHORITY`: the host name the client sent (SNI), at most a
/// DNS name's 255 bytes.
const TLV_AUTHORITY: u8 = 0x02;
const MAX_AUTHORITY: usize = 255;
/// `PP2_TYPE_CRC32C`: a CRC32c of the whole header with this field zeroed.
const TLV_CRC32C: u8 = 0x03;

/// One TLV of type `ty` whose `n`-byte value starts at `value`: an
/// authority no longer than a host name, at most one CRC32C, and that one
/// right.
fn check_tlv(
    header: &[u8],
    ty: u8,
    value: usize,
    n: usize,
    crc_seen: &mut bool,
) -> Result<(), &'static str> {
    match ty {
        TLV_AUTHORITY if n > MAX_AUTHORITY => Err("v2 AUTHORITY TLV longer than a host name"),
        TLV_CRC32C if std::mem::replace(crc_seen, true) => Err("v2 header with two CRC32C TLVs"),
        TLV_CRC32C => check_crc32c(header, value, n),
        _ => Ok(()),
    }
}

/// Checks the v2 TLV block of `header` (from `tlv_start` to its end): a
/// whole number of TLVs, no truncated TLV header, no value running past the
/// end, at most [`MAX_TLVS`], an AUTHORITY no longer than a host name, and
/// a CRC32c (if any) of exactly 4 bytes that matches, as HAProxy checks it.
fn check_tlvs(header: &[u8], tlv_start: usize) -> Result<(), &'static str> {
    let mut at = tlv_start;
    let mut count = 0;
    let mut crc_seen = false;
    while at < header.len() {
        let Some([ty, hi, lo]) = header.get(at..at + 3) else {
            return Err("v2 header ends inside a TLV header");
        };
        let n = usize::from(u16::from_be_bytes([*hi, *lo]));
        let value = at + 3;
        if header.len() - value < n {
            return Err("v2 TLV runs past the end of the header");
        }
        count += 1;
        if count > MAX_TLVS {
            return Err("v2 header with more TLVs than any sender puts");
        }
        check_tlv(header, *ty, value, n, &mut crc_seen)?;
        at = value + n;
    }
    Ok(())
}

/// A CRC32C TLV whose value (`n` bytes at `value`) must be 4 bytes: the
/// CRC32c of the whole header with this field zeroed.
fn check_crc32c(header: &[u8], value: usize, n: usize) -> Result<(), &'static str> {
    if n != 4 {
        return Err("v2 CRC32C TLV not 4 bytes long");
    }
    let want = u32::from_be_bytes([
        header[value],
        header[value + 1],
        header[value + 2],
        header[value + 3],
    ]);
    let mut zeroed = header.to_vec();
    zeroed[value..value + 4].fill(0);
    if crc32c::crc32c(&zeroed) != want {
        return Err("v2 CRC32C TLV does not match the header");
    }
    Ok(())
}

/// Why bytes were rejected as a PROXY header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reject {
    /// Does not start with a PROXY signature.
    NotProxy,
    /// Violates the specification.
    Malformed(&'static str),
    /// A v2 header longer than the configured cap.
    TooLarge,
    /// Well-formed but carries an address a gateway must not trust.
    BadAddress(&'static str),
}

impl Reject {
    /// Stable, low-cardinality label for metrics and logs.
    pub fn reason(&self) -> &'static str {
        match self {
            Reject::NotProxy => "proxy_missing",
            Reject::Malformed(_) => "proxy_malformed",
            Reject::TooLarge => "proxy_too_large",
            Reject::BadAddress(_) => "proxy_bad_address",
        }
    }

    /// Human-readable detail for logs.
    pub fn detail(&self) -> &'static str {
        match self {
            Reject::NotProxy => "no PROXY protocol signature",
            Reject::Malformed(why) | Reject::BadAddress(why) => why,
            Reject::TooLarge => "PROXY v2 header larger than the configured cap",
        }
    }
}

/// Says whether `buf` starts with a PROXY signature (v1 or v2): `Done(())`
/// if it does, `Invalid` if it cannot, `Incomplete` if too few bytes are
/// known to tell.
pub fn detect(buf: &[u8]) -> Parse<(), ()> {
    for sig in [&V2_SIGNATURE[..], V1_PREFIX] {
        let n = buf.len().min(sig.len());
        if buf[..n] == sig[..n] {
            return if n == sig.len() {
                Parse::Done(())
            } else {
                Parse::Incomplete
            };
        }
    }
    Parse::Invalid(())
}

/// Parses a PROXY header at the start of `buf`; `max_v2_len` caps v2 headers
/// (fixed part, addresses and TLVs).
pub fn parse(buf: &[u8], max_v2_len: usize) -> Parse<ProxyHeader, Reject> {
    match detect(buf) {
        Parse::Incomplete => return Parse::Incomplete,
        Parse::Invalid(()) => return Parse::Invalid(Reject::NotProxy),
        Parse::Done(()) => {}
    }
    if buf.starts_with(&V2_SIGNATURE) {
        parse_v2(buf, max_v2_len)
    } else {
        parse_v1(buf)
    }
}

/// A v1 line's ports (when it has six fields) are plain decimal digits.
fn v1_ports_plain(text: &str) -> bool {
    let fields: Vec<&str> = text.trim_end_matches("\r\n").split(' ').collect();
    fields.len() != 6
        || fields[4..]
            .iter()
            .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
}

fn parse_v1(buf: &[u8]) -> Parse<ProxyHeader, Reject> {
    let window = &buf[..buf.len().min(V1_MAX_LEN)];
    let Some(lf) = window.iter().position(|&b| b == b'\n') else {
        return if buf.len() >= V1_MAX_LEN {
            Parse::Invalid(Reject::Malformed("v1 header has no CRLF within 107 bytes"))
        } else {
            Parse::Incomplete
        };
    };
    if lf == 0 || window[lf - 1] != b'\r' {
        return Parse::Invalid(Reject::Malformed("v1 header line ends without CR"));
    }
    let len = lf + 1;
    let Ok(text) = std::str::from_utf8(&buf[..len]) else {
        return Parse::Invalid(Reject::Malformed("v1 header is not ASCII"));
    };
    // Ports are plain decimal digits: Rust's integer parser (under `ppp`)
    // would also take a leading `+`.
    if !v1_ports_plain(text) {
        return Parse::Invalid(Reject::Malformed("v1 port is not plain decimal digits"));
    }
    match v1_addresses(text) {
        Some(addresses) => finish(1, addresses, len, len),
        None => Parse::Invalid(Reject::Malformed("v1 header fields invalid")),
    }
}

/// The addresses of a v1 header line.
fn v1_addresses(text: &str) -> Option<Addresses> {
    let header = ppp::v1::Header::try_from(text).ok()?;
    Some(match header.addresses {
        ppp::v1::Addresses::Unknown => Addresses::Local,
        ppp::v1::Addresses::Tcp4(a) => Addresses::Proxied {
            source: SocketAddr::new(a.source_address.into(), a.source_port),
            destination: SocketAddr::new(a.destination_address.into(), a.destination_port),
        },
        ppp::v1::Addresses::Tcp6(a) => Addresses::Proxied {
            source: SocketAddr::new(a.source_address.into(), a.source_port),
            destination: SocketAddr::new(a.destination_address.into(), a.destination_port),
        },
    })
}

fn parse_v2(buf: &[u8], max_len: usize) -> Parse<ProxyHeader, Reject> {
    if buf.len() < V2_FIXED {
        return Parse::Incomplete;
    }
    let version = buf[12] >> 4;
    let command = buf[12] & 0x0f;
    if version != 2 {
        return Parse::Invalid(Reject::Malformed("v2 header with a version other than 2"));
    }
    if command > 1 {
        return Parse::Invalid(Reject::Malformed("v2 header with an unknown command"));
    }
    let len = V2_FIXED + usize::from(u16::from_be_bytes([buf[14], buf[15]]));
    if len > max_len {
        return Parse::Invalid(Reject::TooLarge);
    }
    if buf.len() < len {
        return Parse::Incomplete;
    }
    let family = buf[13] >> 4;
    let transport = buf[13] & 0x0f;
    let tlv_start = match address_block(family, len) {
        Ok(n) => V2_FIXED + n,
        Err(why) => return Parse::Invalid(Reject::Malformed(why)),
    };
    if let Err(why) = check_tlvs(&buf[..len], tlv_start) {
        return Parse::Invalid(Reject::Malformed(why));
    }
    if command == 0 {
        return finish(2, Addresses::Local, len, tlv_start);
    }
    if transport != 1 || !(family == 1 || family == 2) {
        return Parse::Invalid(Reject::Malformed(
            "v2 PROXY command for a transport other than TCP over IPv4/IPv6",
        ));
    }
    match v2_addresses(&buf[..len]) {
        Ok(addresses) => finish(2, addresses, len, tlv_start),
        Err(why) => Parse::Invalid(Reject::Malformed(why)),
    }
}

/// The address block's length for `family` in a header of `len` bytes:
/// the minimum per family (spec §2.2), and a shorter block is an error
/// even for LOCAL, where the addresses are otherwise ignored.
fn address_block(family: u8, len: usize) -> Result<usize, &'static str> {
    let need = match family {
        0 => 0,
        1 => 12,
        2 => 36,
        3 => 216,
        _ => return Err("v2 header with an unknown address family"),
    };
    if len - V2_FIXED < need {
        return Err("v2 address block shorter than its family needs");
    }
    Ok(need)
}

/// The TCP addresses of a whole v2 PROXY header.
fn v2_addresses(header: &[u8]) -> Result<Addresses, &'static str> {
    let header = ppp::v2::Header::try_from(header).map_err(|_| "v2 header fields invalid")?;
    match header.addresses {
        ppp::v2::Addresses::IPv4(a) => Ok(Addresses::Proxied {
            source: SocketAddr::new(a.source_address.into(), a.source_port),
            destination: SocketAddr::new(a.destination_address.into(), a.destination_port),
        }),
        ppp::v2::Addresses::IPv6(a) => Ok(Addresses::Proxied {
            source: SocketAddr::new(a.source_address.into(), a.source_port),
            destination: SocketAddr::new(a.destination_address.into(), a.destination_port),
        }),
        _ => Err("v2 header address family mismatch"),
    }
}

fn finish(
    version: u8,
    addresses: Addresses,
    len: usize,
    tlv_start: usize,
) -> Parse<ProxyHeader, Reject> {
    if let Addresses::Proxied {
        source,
        destination,
    } = addresses
    {
        if let Err(why) = check_unicast(source.ip()).and(check_unicast(destination.ip())) {
            return Parse::Invalid(Reject::BadAddress(why));
        }
    }
    Parse::Done(ProxyHeader {
        version,
        addresses,
        len,
        tlv_start,
    })
}

fn check_unicast(ip: IpAddr) -> Result<(), &'static str> {
    // A v4-mapped IPv6 address is checked as the IPv4 address it maps.
    let ip = match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    };
    if ip.is_unspecified() {
        return Err("unspecified address in PROXY header");
    }
    if ip.is_multicast() {
        return Err("multicast address in PROXY header");
    }
    if let IpAddr::V4(v4) = ip {
        if v4.is_broadcast() {
            return Err("broadcast address in PROXY header");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;

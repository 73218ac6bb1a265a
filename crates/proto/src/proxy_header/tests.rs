use std::net::{Ipv4Addr, Ipv6Addr};

use super::*;

const CAP: usize = 512;

fn v2(cmd: u8, fam: u8, body: &[u8]) -> Vec<u8> {
    let mut m = V2_SIGNATURE.to_vec();
    m.push(0x20 | cmd);
    m.push(fam);
    m.extend_from_slice(&u16::try_from(body.len()).unwrap().to_be_bytes());
    m.extend_from_slice(body);
    m
}

fn v2_tcp4(src: [u8; 4], dst: [u8; 4], sp: u16, dp: u16) -> Vec<u8> {
    let mut b = src.to_vec();
    b.extend_from_slice(&dst);
    b.extend_from_slice(&sp.to_be_bytes());
    b.extend_from_slice(&dp.to_be_bytes());
    v2(1, 0x11, &b)
}

fn check_all_prefixes(msg: &[u8]) -> ProxyHeader {
    for n in 0..msg.len() {
        assert_eq!(parse(&msg[..n], CAP), Parse::Incomplete, "prefix {n}");
    }
    let Parse::Done(h) = parse(msg, CAP) else {
        panic!("not done: {:?}", parse(msg, CAP));
    };
    let mut more = msg.to_vec();
    more.extend_from_slice(b"\x16\x03\x01 payload");
    assert_eq!(parse(&more, CAP), Parse::Done(h));
    assert_eq!(h.len, msg.len());
    h
}

#[test]
fn v1_tcp4_and_tcp6_every_prefix() {
    let h = check_all_prefixes(b"PROXY TCP4 192.0.2.1 198.51.100.7 51234 443\r\n");
    assert_eq!(h.version, 1);
    assert_eq!(
        h.addresses,
        Addresses::Proxied {
            source: SocketAddr::new(Ipv4Addr::new(192, 0, 2, 1).into(), 51234),
            destination: SocketAddr::new(Ipv4Addr::new(198, 51, 100, 7).into(), 443),
        }
    );
    let h = check_all_prefixes(b"PROXY TCP6 2001:db8::1 2001:db8::2 1 443\r\n");
    assert!(matches!(h.addresses, Addresses::Proxied { source, .. }
        if source.ip() == "2001:db8::1".parse::<Ipv6Addr>().unwrap()));
    let h = check_all_prefixes(b"PROXY UNKNOWN\r\n");
    assert_eq!(h.addresses, Addresses::Local);
}

#[test]
fn v2_tcp4_tcp6_local_every_prefix() {
    let h = check_all_prefixes(&v2_tcp4([10, 1, 2, 3], [10, 9, 9, 9], 4000, 443));
    assert_eq!(h.version, 2);
    assert!(matches!(h.addresses, Addresses::Proxied { source, .. }
        if source == SocketAddr::new(Ipv4Addr::new(10, 1, 2, 3).into(), 4000)));
    let mut b = [0u8; 36];
    b[15] = 1;
    b[31] = 2;
    b[33] = 7;
    b[35] = 1;
    let h = check_all_prefixes(&v2(1, 0x21, &b));
    assert!(matches!(h.addresses, Addresses::Proxied { source, .. }
        if source.ip() == IpAddr::V6(Ipv6Addr::LOCALHOST)));
    let h = check_all_prefixes(&v2(0, 0x00, &[]));
    assert_eq!(h.addresses, Addresses::Local);
    // TLVs after the addresses are skipped.
    let mut body = v2_tcp4([10, 1, 2, 3], [10, 9, 9, 9], 1, 2)[16..].to_vec();
    body.extend_from_slice(&[0x04, 0, 3, b'a', b'b', b'c']);
    check_all_prefixes(&v2(1, 0x11, &body));
}

#[test]
fn garbage_and_not_proxy() {
    assert_eq!(
        parse(b"GET / HTTP/1.1\r\n", CAP),
        Parse::Invalid(Reject::NotProxy)
    );
    assert_eq!(
        parse(b"\x16\x03\x01", CAP),
        Parse::Invalid(Reject::NotProxy)
    );
    assert!(matches!(
        parse(b"PROXY TCP4 garbage here 1 2\r\n", CAP),
        Parse::Invalid(Reject::Malformed(_))
    ));
    assert!(matches!(
        parse(b"PROXY TCP4 1.2.3.4 5.6.7.8 1 2\n", CAP),
        Parse::Invalid(Reject::Malformed(_))
    ));
}

#[test]
fn v1_without_crlf_is_rejected_at_107_bytes() {
    let mut m = b"PROXY TCP4 ".to_vec();
    m.resize(106, b'1');
    assert_eq!(parse(&m, CAP), Parse::Incomplete);
    m.push(b'1');
    assert!(matches!(
        parse(&m, CAP),
        Parse::Invalid(Reject::Malformed(_))
    ));
}

#[test]
fn v2_family_mismatch_and_short_block() {
    // IPv6 family with an IPv4-sized block.
    let short = v2(1, 0x21, &[0; 12]);
    assert!(matches!(
        parse(&short, CAP),
        Parse::Invalid(Reject::Malformed(_))
    ));
    // IPv4 family with a truncated block.
    let short = v2(1, 0x11, &[0; 8]);
    assert!(matches!(
        parse(&short, CAP),
        Parse::Invalid(Reject::Malformed(_))
    ));
    // UDP is not acceptable for a TCP gateway.
    let mut udp = v2_tcp4([10, 0, 0, 1], [10, 0, 0, 2], 1, 2);
    udp[13] = 0x12;
    assert!(matches!(
        parse(&udp, CAP),
        Parse::Invalid(Reject::Malformed(_))
    ));
    // Unknown command and version.
    let mut bad = v2_tcp4([10, 0, 0, 1], [10, 0, 0, 2], 1, 2);
    bad[12] = 0x2f;
    assert!(matches!(
        parse(&bad, CAP),
        Parse::Invalid(Reject::Malformed(_))
    ));
    bad[12] = 0x31;
    assert!(matches!(
        parse(&bad, CAP),
        Parse::Invalid(Reject::Malformed(_))
    ));
}

#[test]
fn v2_size_cap() {
    let mut body = vec![0u8; 600];
    body[..12].copy_from_slice(&[10, 0, 0, 1, 10, 0, 0, 2, 0, 1, 0, 2]);
    let big = v2(1, 0x11, &body);
    assert_eq!(parse(&big[..16], CAP), Parse::Invalid(Reject::TooLarge));
}

#[test]
fn non_unicast_addresses_rejected() {
    for src in [[0, 0, 0, 0], [224, 0, 0, 1], [255, 255, 255, 255]] {
        let m = v2_tcp4(src, [10, 0, 0, 2], 1, 2);
        assert!(
            matches!(parse(&m, CAP), Parse::Invalid(Reject::BadAddress(_))),
            "{src:?}"
        );
    }
    assert!(matches!(
        parse(b"PROXY TCP4 224.0.0.1 10.0.0.1 1 2\r\n", CAP),
        Parse::Invalid(Reject::BadAddress(_))
    ));
}

#[test]
fn every_single_byte_corruption_never_panics() {
    let m = v2_tcp4([10, 1, 2, 3], [10, 9, 9, 9], 4000, 443);
    for i in 0..m.len() {
        for v in [0u8, 1, 0x21, 0xff] {
            let mut c = m.clone();
            c[i] = v;
            let _ = parse(&c, CAP);
        }
    }
}

#[test]
fn v1_signed_ports_and_mapped_multicast_are_refused() {
    for bad in [
        "PROXY TCP4 10.0.0.1 10.0.0.2 +443 443\r\n",
        "PROXY TCP4 10.0.0.1 10.0.0.2 443 +443\r\n",
        "PROXY TCP6 ::ffff:224.0.0.1 ::1 1000 443\r\n",
        "PROXY TCP6 ::1 ::ffff:255.255.255.255 1000 443\r\n",
        "PROXY TCP6 ::ffff:0.0.0.0 ::1 1000 443\r\n",
    ] {
        assert!(
            matches!(parse(bad.as_bytes(), 512), Parse::Invalid(_)),
            "{bad:?}"
        );
    }
    let v2 = v2(
        0x1,
        0x21,
        &[
            &[0u8; 10][..],
            &[0xff, 0xff, 224, 0, 0, 1],
            &[0u8; 15],
            &[1],
            &[0x03, 0xe8, 0x01, 0xbb],
        ]
        .concat(),
    );
    assert!(matches!(parse(&v2, 512), Parse::Invalid(_)));
    assert!(matches!(
        parse(b"PROXY TCP4 10.0.0.1 10.0.0.2 1000 443\r\n", 512),
        Parse::Done(_)
    ));
}

#[test]
fn v2_tlvs_found_by_raw_type() {
    // HyperShift's node proxies: type 0x20 carrying the cluster ID as text.
    let mut body = v2_tcp4([10, 1, 2, 3], [10, 9, 9, 9], 1, 2)[16..].to_vec();
    body.extend_from_slice(&[0x04, 0, 2, 0, 0]);
    body.extend_from_slice(&[0x20, 0, 4]);
    body.extend_from_slice(b"c-42");
    body.extend_from_slice(&[0xe0, 0, 0]);
    let msg = v2(1, 0x11, &body);
    let h = check_all_prefixes(&msg);
    assert_eq!(h.tlv_start, 16 + 12);
    assert_eq!(tlv(&msg, &h, 0x20), Some(&b"c-42"[..]));
    assert_eq!(tlv(&msg, &h, 0xe0), Some(&b""[..]));
    assert_eq!(tlv(&msg, &h, 0x04), Some(&[0u8, 0][..]));
    assert_eq!(tlv(&msg, &h, 0x21), None);
    // LOCAL headers may carry TLVs too.
    let local = v2(0, 0x00, &[0x20, 0, 1, b'x']);
    let Parse::Done(h) = parse(&local, CAP) else {
        panic!("LOCAL with a TLV refused");
    };
    assert_eq!(tlv(&local, &h, 0x20), Some(&b"x"[..]));
    // No TLVs, and v1: nothing to find.
    let plain = v2_tcp4([10, 1, 2, 3], [10, 9, 9, 9], 1, 2);
    let Parse::Done(h) = parse(&plain, CAP) else {
        panic!("plain v2 refused");
    };
    assert_eq!(tlv(&plain, &h, 0x20), None);
    let v1 = b"PROXY TCP4 192.0.2.1 198.51.100.7 51234 443\r\n";
    let Parse::Done(h) = parse(v1, CAP) else {
        panic!("v1 refused");
    };
    assert_eq!(tlv(v1, &h, 0x20), None);
}

#[test]
fn v2_malformed_tlv_blocks_are_refused() {
    let addrs = v2_tcp4([10, 1, 2, 3], [10, 9, 9, 9], 1, 2)[16..].to_vec();
    let cases: [(&[u8], &str); 4] = [
        (&[0x20], "ends inside a TLV header"),
        (&[0x20, 0], "ends inside a TLV header"),
        (&[0x20, 0, 5, b'a', b'b'], "runs past the end"),
        (&[0x04, 0, 0, 0xe0, 0xff, 0xff], "runs past the end"),
    ];
    for (tlvs, why) in cases {
        let mut body = addrs.clone();
        body.extend_from_slice(tlvs);
        let msg = v2(1, 0x11, &body);
        match parse(&msg, CAP) {
            Parse::Invalid(Reject::Malformed(w)) => assert!(w.contains(why), "{tlvs:?}: {w}"),
            other => panic!("{tlvs:?} gave {other:?}"),
        }
        // The same block behind a LOCAL command.
        let local = v2(0, 0x00, tlvs);
        assert!(
            matches!(parse(&local, CAP), Parse::Invalid(Reject::Malformed(_))),
            "LOCAL {tlvs:?}"
        );
    }
}

/// A header with a CRC32C TLV: the checksum of the whole header with the
/// field zeroed (HAProxy's `crc32c` check), filled in by `fix`.
fn with_crc(fix: bool) -> Vec<u8> {
    let mut body = v2_tcp4([10, 1, 2, 3], [10, 9, 9, 9], 1, 2)[16..].to_vec();
    body.extend_from_slice(&[0x03, 0, 4, 0, 0, 0, 0]);
    let mut msg = v2(1, 0x11, &body);
    if fix {
        let sum = crc32c::crc32c(&msg).to_be_bytes();
        let at = msg.len() - 4;
        msg[at..].copy_from_slice(&sum);
    }
    msg
}

#[test]
fn v2_tlvs_are_checked_like_haproxy_checks_them() {
    // A matching CRC32C is accepted; a wrong one, or one not 4 bytes long,
    // is refused.
    assert!(matches!(parse(&with_crc(true), CAP), Parse::Done(_)));
    let refused = |msg: &[u8], why: &str| match parse(msg, 8192) {
        Parse::Invalid(Reject::Malformed(w)) => assert!(w.contains(why), "{w}"),
        other => panic!("{why}: {other:?}"),
    };
    refused(&with_crc(false), "CRC32C TLV does not match");
    let mut flipped = with_crc(true);
    flipped[16] ^= 1; // the source address changed after the sum
    refused(&flipped, "CRC32C TLV does not match");
    let addrs = v2_tcp4([10, 1, 2, 3], [10, 9, 9, 9], 1, 2)[16..].to_vec();
    let mut body = addrs.clone();
    body.extend_from_slice(&[0x03, 0, 3, 1, 2, 3]);
    refused(&v2(1, 0x11, &body), "not 4 bytes");
    // A thousand zero-length NOOPs, and a 300-byte AUTHORITY.
    let mut body = addrs.clone();
    for _ in 0..1000 {
        body.extend_from_slice(&[0x04, 0, 0]);
    }
    refused(&v2(1, 0x11, &body), "more TLVs");
    let mut body = addrs.clone();
    body.extend_from_slice(&[0x02, 0x01, 0x2c]);
    body.extend_from_slice(&[b'a'; 300]);
    refused(&v2(1, 0x11, &body), "AUTHORITY");
    // 32 TLVs and a 255-byte AUTHORITY are fine.
    let mut body = addrs;
    body.extend_from_slice(&[0x02, 0, 255]);
    body.extend_from_slice(&[b'a'; 255]);
    for _ in 0..31 {
        body.extend_from_slice(&[0x04, 0, 0]);
    }
    assert!(matches!(parse(&v2(1, 0x11, &body), CAP), Parse::Done(_)));
}

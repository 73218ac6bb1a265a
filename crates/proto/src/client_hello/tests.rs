use super::*;

const OPENSSL: &[u8] = include_bytes!("../../testdata/openssl_client_hello.bin");
const CURL: &[u8] = include_bytes!("../../testdata/curl_client_hello.bin");
const CAP: usize = 16 * 1024;

fn done(buf: &[u8]) -> ClientHello {
    match parse(buf, CAP) {
        Parse::Done(h) => h,
        other => panic!("expected a ClientHello, got {other:?}"),
    }
}

/// Every strict prefix is Incomplete, the full message is Done, and appending
/// more bytes never changes the answer.
fn check_all_prefixes(msg: &[u8]) -> ClientHello {
    for n in 0..msg.len() {
        assert_eq!(
            parse(&msg[..n], CAP),
            Parse::Incomplete,
            "prefix of {n} bytes"
        );
    }
    let full = done(msg);
    let mut more = msg.to_vec();
    more.extend_from_slice(b"\x17\x03\x03\x00\x05hello");
    assert_eq!(done(&more), full);
    full
}

#[test]
fn openssl_hello_every_prefix() {
    let h = check_all_prefixes(OPENSSL);
    assert_eq!(h.sni.as_deref(), Some("api.alpha.example.com"));
    assert_eq!(h.alpn, vec!["h2".to_string(), "http/1.1".to_string()]);
    assert_eq!(h.len, OPENSSL.len());
}

#[test]
fn curl_hello_every_prefix() {
    let h = check_all_prefixes(CURL);
    assert_eq!(h.sni.as_deref(), Some("api.beta.example.com"));
    assert_eq!(h.len, CURL.len());
}

/// Re-frames one handshake message into records of `chunk` bytes each.
fn split_records(msg: &[u8], chunk: usize) -> Vec<u8> {
    let hs = &msg[5..];
    let mut out = Vec::new();
    for part in hs.chunks(chunk) {
        out.extend_from_slice(&[22, 3, 1]);
        out.extend_from_slice(&u16::try_from(part.len()).unwrap().to_be_bytes());
        out.extend_from_slice(part);
    }
    out
}

#[test]
fn hello_split_across_records_anywhere() {
    for chunk in [1, 2, 3, 4, 5, 7, 100, 339] {
        let msg = split_records(OPENSSL, chunk);
        let h = check_all_prefixes(&msg);
        assert_eq!(
            h.sni.as_deref(),
            Some("api.alpha.example.com"),
            "chunk {chunk}"
        );
        assert_eq!(h.len, msg.len());
    }
}

#[test]
fn not_tls_and_sslv2() {
    assert_eq!(
        parse(b"GET / HTTP/1.1\r\n", CAP),
        Parse::Invalid(Reject::NotTls)
    );
    assert_eq!(
        parse(b"\x80\x2e\x01\x00\x02", CAP),
        Parse::Invalid(Reject::Sslv2)
    );
    assert_eq!(parse(b"PROXY TCP4 ", CAP), Parse::Invalid(Reject::NotTls));
}

#[test]
fn size_cap_is_enforced_early() {
    // A record that announces a 16 KiB handshake is rejected from its header
    // when the cap is smaller, without waiting for the body.
    let hdr = [22, 3, 1, 0x40, 0x00, 1, 0, 0x3f, 0xfc];
    assert_eq!(parse(&hdr, 1024), Parse::Invalid(Reject::TooLarge));
    assert_eq!(
        parse(OPENSSL, OPENSSL.len() - 1),
        Parse::Invalid(Reject::TooLarge)
    );
}

#[test]
fn malformed_records() {
    let mut m = OPENSSL.to_vec();
    m[5] = 2; // ServerHello
    assert!(matches!(
        parse(&m, CAP),
        Parse::Invalid(Reject::Malformed(_))
    ));
    let mut m = OPENSSL.to_vec();
    m[1] = 2;
    assert!(matches!(
        parse(&m, CAP),
        Parse::Invalid(Reject::Malformed(_))
    ));
    assert!(matches!(
        parse(&[22, 3, 1, 0, 0], CAP),
        Parse::Invalid(Reject::Malformed(_))
    ));
    // A handshake length that disagrees with the extension lengths.
    let mut m = OPENSSL.to_vec();
    let last = m.len() - 1;
    m.truncate(last);
    m[4] -= 1;
    m[8] -= 1;
    assert!(matches!(
        parse(&m, CAP),
        Parse::Invalid(Reject::Malformed(_))
    ));
}

#[test]
fn hello_without_extensions_has_no_sni() {
    let mut body = vec![3, 3];
    body.extend_from_slice(&[0; 32]);
    body.push(0); // session id
    body.extend_from_slice(&[0, 2, 0x13, 0x01]);
    body.extend_from_slice(&[1, 0]);
    let mut hs = vec![1, 0, 0, u8::try_from(body.len()).unwrap()];
    hs.extend_from_slice(&body);
    let mut rec = vec![22, 3, 1, 0, u8::try_from(hs.len()).unwrap()];
    rec.extend_from_slice(&hs);
    let h = check_all_prefixes(&rec);
    assert_eq!(h.sni, None);
}

#[test]
fn every_single_byte_corruption_never_panics() {
    for i in 0..OPENSSL.len() {
        for v in [0u8, 1, 0x7f, 0xff] {
            let mut m = OPENSSL.to_vec();
            m[i] = v;
            let _ = parse(&m, CAP);
        }
    }
}

#[test]
fn an_ssl3_client_hello_is_refused() {
    let mut body = vec![3, 0];
    body.extend_from_slice(&[0; 32]);
    body.push(0);
    body.extend_from_slice(&[0, 2, 0x00, 0x2f]);
    body.extend_from_slice(&[1, 0]);
    let mut hs = vec![1, 0, 0, u8::try_from(body.len()).unwrap()];
    hs.extend_from_slice(&body);
    let mut rec = vec![22, 3, 0, 0, u8::try_from(hs.len()).unwrap()];
    rec.extend_from_slice(&hs);
    assert!(matches!(parse(&rec, 16 * 1024), Parse::Invalid(_)));
}

use super::*;

const CURL: &[u8] = include_bytes!("../../testdata/curl_connect_head.bin");
/// What stock OpenVPN sends (`http-proxy` with a custom header).
const OPENVPN: &[u8] = b"CONNECT api.example.com:1194 HTTP/1.0\r\nHost: api.example.com\r\nX-Gardener-Destination: outbound|1194||vpn-seed-server.shoot--p--n.svc.cluster.local\r\n\r\n";

fn lim() -> Limits {
    Limits::default()
}

fn check_all_prefixes(msg: &[u8]) -> Head {
    for n in 0..msg.len() {
        assert_eq!(parse(&msg[..n], &lim()), Parse::Incomplete, "prefix {n}");
    }
    let Parse::Done(h) = parse(msg, &lim()) else {
        panic!("not parsed: {:?}", parse(msg, &lim()));
    };
    // Pipelined bytes after the head are never looked at, even garbage.
    let mut more = msg.to_vec();
    more.extend_from_slice(b"\x00\x01GET / HTTP/1.1\n\n\x16\x03\x01");
    assert_eq!(parse(&more, &lim()), Parse::Done(h.clone()));
    assert_eq!(h.len, msg.len());
    h
}

#[test]
fn curl_connect_every_prefix() {
    let h = check_all_prefixes(CURL);
    assert_eq!(h.method, "CONNECT");
    assert_eq!(h.target, "api.alpha.example.com:443");
    assert_eq!(h.minor_version, 1);
    assert_eq!(
        h.values("x-gardener-destination").collect::<Vec<_>>(),
        vec!["outbound|443||kube-apiserver.shoot--dev--alpha.svc.cluster.local"]
    );
}

#[test]
fn openvpn_http10_every_prefix() {
    let h = check_all_prefixes(OPENVPN);
    assert_eq!(h.minor_version, 0);
    assert_eq!(h.values("X-GARDENER-DESTINATION").count(), 1);
}

#[test]
fn byte_level_rules() {
    let cases: &[(&[u8], Reject)] = &[
        (
            b"CONNECT a:443 HTTP/1.1\nHost: a\r\n\r\n",
            Reject::BareLineEnding,
        ),
        (
            b"CONNECT a:443 HTTP/1.1\r\nHost: a\rX\r\n\r\n",
            Reject::BareLineEnding,
        ),
        (
            b"CONNECT a:443 HTTP/1.1\r\nHost: a\x01\r\n\r\n",
            Reject::ControlByte,
        ),
        (
            b"CONNECT a:443 HTTP/1.1\r\nHost: a\x7f\r\n\r\n",
            Reject::ControlByte,
        ),
        (
            b"CONNECT a:443 HTTP/1.1\r\nHost: a\r\n folded\r\n\r\n",
            Reject::ObsFold,
        ),
        (
            b"CONNECT a:443 HTTP/1.1\r\nHost: a\r\n\tfolded\r\n\r\n",
            Reject::ObsFold,
        ),
    ];
    for (msg, want) in cases {
        assert_eq!(
            parse(msg, &lim()),
            Parse::Invalid(*want),
            "{:?}",
            String::from_utf8_lossy(msg)
        );
    }
    assert!(matches!(
        parse(b"\r\nCONNECT a:443 HTTP/1.1\r\n\r\n", &lim()),
        Parse::Invalid(Reject::Malformed(_))
    ));
    assert!(matches!(
        parse(b"CONNECT a:443 HTTP/2.0\r\n\r\n", &lim()),
        Parse::Invalid(Reject::Malformed(_))
    ));
    assert!(matches!(
        parse(b"CONNECT  a:443 HTTP/1.1\r\n\r\n", &lim()),
        Parse::Invalid(Reject::Malformed(_))
    ));
    assert!(matches!(
        parse(b"CONNECT a:443 HTTP/1.1\r\nBad Name: x\r\n\r\n", &lim()),
        Parse::Invalid(Reject::Malformed(_))
    ));
}

#[test]
fn caps() {
    let small = Limits {
        max_head_bytes: 64,
        max_line_bytes: 32,
        max_headers: 2,
    };
    let mut long_line = b"CONNECT ".to_vec();
    long_line.resize(40, b'a');
    assert_eq!(
        parse(&long_line, &small),
        Parse::Invalid(Reject::LineTooLong)
    );
    let many = b"CONNECT a:1 HTTP/1.1\r\na: 1\r\nb: 2\r\nc: 3\r\n\r\n";
    assert_eq!(parse(many, &small), Parse::Invalid(Reject::TooManyHeaders));
    let mut endless = b"CONNECT a:1 HTTP/1.1\r\n".to_vec();
    while endless.len() < 64 {
        endless.extend_from_slice(b"x: 1\r\n");
    }
    let big = Limits {
        max_head_bytes: 64,
        max_line_bytes: 32,
        max_headers: 100,
    };
    assert_eq!(parse(&endless, &big), Parse::Invalid(Reject::TooLarge));
}

#[test]
fn every_single_byte_corruption_never_panics() {
    for i in 0..CURL.len() {
        for v in [0u8, b'\r', b'\n', b' ', 0x80, 0xff] {
            let mut m = CURL.to_vec();
            m[i] = v;
            let _ = parse(&m, &lim());
        }
    }
}

#[test]
fn connect_targets_must_be_authority_form() {
    for ok in [
        "10.0.0.1:443",
        "kubernetes.default.svc:443",
        "[fd00::1]:6443",
        "a:1",
        "host_x.local:65535",
    ] {
        assert!(authority_form(ok), "{ok}");
    }
    for bad in [
        "10.0.0.1",
        ":443",
        "host:0",
        "host:65536",
        "host:+443",
        "host:-1",
        "host:",
        "user@host:443",
        "http://host:443",
        "host:443/path",
        "*",
        "[fd00::1]",
        "fd00::1:443",
        "[nothex]:443",
        "host:0443x",
        "host:000443",
        "ho st:443",
    ] {
        assert!(!authority_form(bad), "{bad}");
    }
}

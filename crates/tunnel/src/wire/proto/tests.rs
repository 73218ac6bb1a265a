use std::collections::BTreeMap;

use bytes::Bytes;
use prost::Message;

use super::*;

/// `(message, field) → number` as written in `proto/konnectivity.proto`.
fn proto_fields() -> BTreeMap<(String, String), u32> {
    let text = include_str!("../../../proto/konnectivity.proto");
    let mut out = BTreeMap::new();
    let mut message = String::new();
    for line in text.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("message ") {
            message = rest
                .trim_end_matches(" {}")
                .trim_end_matches(" {")
                .to_string();
            continue;
        }
        if line.starts_with("enum ") || line.starts_with("service ") {
            message.clear();
            continue;
        }
        let Some((decl, num)) = line.trim_end_matches(';').split_once(" = ") else {
            continue;
        };
        let mut words = decl.split_whitespace().skip_while(|w| *w == "repeated");
        let (Some(_ty), Some(name)) = (words.next(), words.next()) else {
            continue;
        };
        if let (false, Ok(n)) = (message.is_empty(), num.parse()) {
            out.insert((message.clone(), name.to_string()), n);
        }
    }
    out
}

/// The field number of the first tag of an encoding (a varint).
fn first_field(bytes: &[u8]) -> u32 {
    let (mut v, mut shift) = (0u32, 0);
    for b in bytes {
        v |= u32::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            break;
        }
        shift += 7;
    }
    v >> 3
}

fn tag_of<M: Message>(m: M) -> u32 {
    first_field(&m.encode_to_vec())
}

fn pk(p: Payload) -> Packet {
    Packet {
        r#type: 0,
        payload: Some(p),
    }
}

#[test]
fn field_numbers_match_the_proto_file() {
    let f = proto_fields();
    let n = |m: &str, k: &str| f[&(m.to_string(), k.to_string())];
    // Each value sets exactly one non-default field, so its first tag is
    // that field's number.
    let cases: Vec<(u32, &str, &str)> = vec![
        (
            tag_of(Packet {
                r#type: 4,
                payload: None,
            }),
            "Packet",
            "type",
        ),
        (
            tag_of(pk(Payload::DialRequest(DialRequest::default()))),
            "Packet",
            "dialRequest",
        ),
        (
            tag_of(pk(Payload::DialResponse(DialResponse::default()))),
            "Packet",
            "dialResponse",
        ),
        (tag_of(pk(Payload::Data(Data::default()))), "Packet", "data"),
        (
            tag_of(pk(Payload::CloseRequest(CloseRequest::default()))),
            "Packet",
            "closeRequest",
        ),
        (
            tag_of(pk(Payload::CloseResponse(CloseResponse::default()))),
            "Packet",
            "closeResponse",
        ),
        (
            tag_of(pk(Payload::CloseDial(CloseDial::default()))),
            "Packet",
            "closeDial",
        ),
        (
            tag_of(pk(Payload::WindowUpdate(WindowUpdate::default()))),
            "Packet",
            "windowUpdate",
        ),
        (
            tag_of(pk(Payload::Replicas(Replicas::default()))),
            "Packet",
            "replicas",
        ),
        (
            tag_of(Replicas {
                count: 1,
                ..Default::default()
            }),
            "Replicas",
            "count",
        ),
        (
            tag_of(Replicas {
                replicas: vec![Replica::default()],
                ..Default::default()
            }),
            "Replicas",
            "replicas",
        ),
        (
            tag_of(Replica {
                pod: "a".into(),
                ..Default::default()
            }),
            "Replica",
            "pod",
        ),
        (
            tag_of(Replica {
                address: "a".into(),
                ..Default::default()
            }),
            "Replica",
            "address",
        ),
        (
            tag_of(Replica {
                server_name: "a".into(),
                ..Default::default()
            }),
            "Replica",
            "serverName",
        ),
        (
            tag_of(WindowUpdate {
                connect_id: 1,
                bytes: 0,
            }),
            "WindowUpdate",
            "connectID",
        ),
        (
            tag_of(WindowUpdate {
                connect_id: 0,
                bytes: 1,
            }),
            "WindowUpdate",
            "bytes",
        ),
        (
            tag_of(pk(Payload::Drain(Drain::default()))),
            "Packet",
            "drain",
        ),
        (
            tag_of(DialRequest {
                protocol: "t".into(),
                ..Default::default()
            }),
            "DialRequest",
            "protocol",
        ),
        (
            tag_of(DialRequest {
                address: "a".into(),
                ..Default::default()
            }),
            "DialRequest",
            "address",
        ),
        (
            tag_of(DialRequest {
                random: 1,
                ..Default::default()
            }),
            "DialRequest",
            "random",
        ),
        (
            tag_of(DialResponse {
                error: "e".into(),
                ..Default::default()
            }),
            "DialResponse",
            "error",
        ),
        (
            tag_of(DialResponse {
                connect_id: 1,
                ..Default::default()
            }),
            "DialResponse",
            "connectID",
        ),
        (
            tag_of(DialResponse {
                random: 1,
                ..Default::default()
            }),
            "DialResponse",
            "random",
        ),
        (
            tag_of(CloseRequest { connect_id: 1 }),
            "CloseRequest",
            "connectID",
        ),
        (
            tag_of(CloseResponse {
                error: "e".into(),
                connect_id: 0,
            }),
            "CloseResponse",
            "error",
        ),
        (
            tag_of(CloseResponse {
                error: String::new(),
                connect_id: 1,
            }),
            "CloseResponse",
            "connectID",
        ),
        (tag_of(CloseDial { random: 1 }), "CloseDial", "random"),
        (
            tag_of(Data {
                connect_id: 1,
                ..Default::default()
            }),
            "Data",
            "connectID",
        ),
        (
            tag_of(Data {
                error: "e".into(),
                ..Default::default()
            }),
            "Data",
            "error",
        ),
        (
            tag_of(Data {
                data: Bytes::from_static(b"x"),
                ..Default::default()
            }),
            "Data",
            "data",
        ),
    ];
    for (got, m, k) in &cases {
        assert_eq!(*got, n(m, k), "{m}.{k}");
    }
    // Every field of the .proto file is covered.
    assert_eq!(f.len(), cases.len(), "{f:?}");
}

#[test]
fn enum_values_match_the_proto_file() {
    let text = include_str!("../../../proto/konnectivity.proto");
    for (name, t) in [
        ("DIAL_REQ", PacketType::DialReq),
        ("DIAL_RSP", PacketType::DialRsp),
        ("CLOSE_REQ", PacketType::CloseReq),
        ("CLOSE_RSP", PacketType::CloseRsp),
        ("DATA", PacketType::Data),
        ("DIAL_CLS", PacketType::DialCls),
        ("DRAIN", PacketType::Drain),
        ("WINDOW_UPDATE", PacketType::WindowUpdate),
        ("REPLICAS", PacketType::Replicas),
    ] {
        assert!(
            text.contains(&format!("  {name} = {};", t as i32)),
            "{name}"
        );
    }
}

#[test]
fn a_dial_request_encodes_byte_for_byte() {
    // type DIAL_REQ (0) is the proto3 default and is not sent.
    let p = Packet::dial_req("a:1", 5);
    let want: &[u8] = &[
        0x12, 12, // field 2 (dialRequest), 12 bytes
        0x0a, 3, b't', b'c', b'p', // protocol
        0x12, 3, b'a', b':', b'1', // address
        0x18, 5, // random
    ];
    assert_eq!(p.encode_to_vec(), want);
    assert_eq!(Packet::decode(want).unwrap(), p);
    assert_eq!(p.kind(), Some(PacketType::DialReq));
}

#[test]
fn unknown_packet_types_decode_and_are_recognised_as_unknown() {
    let p = Packet {
        r#type: 42,
        payload: None,
    };
    let back = Packet::decode(p.encode_to_vec().as_slice()).unwrap();
    assert_eq!(back.kind(), None);
}

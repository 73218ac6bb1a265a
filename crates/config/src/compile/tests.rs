use super::*;
use crate::routes::EndpointState;

const EXAMPLE: &str = include_str!("../../../../examples/gateway.yaml");

fn ok(text: &str) -> Snapshot {
    match parse(text).and_then(|f| compile(f, None)) {
        Ok(s) => s,
        Err(e) => panic!("config rejected:\n{e}"),
    }
}

fn errors(text: &str) -> Vec<ConfigError> {
    match parse(text).and_then(|f| compile(f, None)) {
        Ok(_) => panic!("config accepted"),
        Err(e) => e.0,
    }
}

const MINIMAL: &str = "
listeners: [{name: tls, address: '127.0.0.1:0'}]
control_planes:
  - name: a
    hostnames: [api.a.example.com, '*.wild.example.com']
    endpoints: ['127.0.0.1:1']
";

#[test]
fn example_file_is_valid() {
    let s = ok(EXAMPLE);
    assert_eq!(s.control_planes.len(), 2);
    assert!(s.routes.lookup("x.beta.example.com").is_some());
}

#[test]
fn lookup_case_trailing_dot_and_wildcard_depth() {
    let s = ok(MINIMAL);
    for yes in [
        "api.a.example.com",
        "API.A.Example.COM",
        "api.a.example.com.",
        "x.wild.example.com",
        // Gateway API's wildcard: any number of labels in front.
        "a.b.wild.example.com",
    ] {
        assert!(s.routes.lookup(yes).is_some(), "{yes}");
    }
    for no in [
        "api.a.example.com..",
        "wild.example.com",
        "example.com",
        "",
        ".",
    ] {
        assert!(s.routes.lookup(no).is_none(), "{no}");
    }
}

#[test]
fn exact_beats_wildcard() {
    let s = ok("
listeners: [{name: tls, address: '127.0.0.1:0'}]
control_planes:
  - {name: w, hostnames: ['*.example.com'], endpoints: ['127.0.0.1:1']}
  - {name: e, hostnames: [x.example.com], endpoints: ['127.0.0.1:2']}
");
    assert_eq!(s.routes.lookup("x.example.com").unwrap().name, "e");
    assert_eq!(s.routes.lookup("y.example.com").unwrap().name, "w");
}

#[test]
fn every_problem_is_listed_with_its_path() {
    let errs = errors(
        "
listeners:
  - {name: tls, address: 'nope', proxy_protocol: required}
  - {name: tls, address: '127.0.0.1:1'}
trusted_load_balancers: []
always_allowed: ['10.0.0.1/8', 'banana']
control_planes:
  - name: a
    hostnames: [API.x.example.com, '*.-bad-', 'a.*.example.com']
    endpoints: ['127.0.0.1:0', 'host-only']
    acl: {allow: ['300.1.1.1/32']}
  - name: a
    hostnames: [api.x.example.com.]
    endpoints: []
",
    );
    let text: Vec<String> = errs
        .iter()
        .map(|e| format!("{}: {}", e.path, e.message))
        .collect();
    let want = [
        "listeners[0].address",
        "listeners[1].name",
        "always_allowed[0]",
        "always_allowed[1]",
        "control_planes[0].hostnames[1]",
        "control_planes[0].hostnames[2]",
        "control_planes[0].endpoints[0]",
        "control_planes[0].endpoints[1]",
        "control_planes[0].acl.allow[0]",
        "control_planes[1].name",
        "control_planes[1].endpoints",
        "control_planes[1].hostnames[0]",
    ];
    for w in want {
        assert!(
            text.iter().any(|t| t.starts_with(w)),
            "missing {w} in {text:#?}"
        );
    }
    assert!(
        text.iter().any(|t| t.contains("did you mean 10.0.0.0/8")),
        "{text:#?}"
    );
    assert!(
        text.iter()
            .any(|t| t.contains("already used by control plane \"a\"")),
        "{text:#?}"
    );
}

#[test]
fn required_proxy_without_trusted_lbs_fails_closed() {
    let errs = errors("listeners: [{name: tls, address: '127.0.0.1:0', proxy_protocol: required}]");
    assert!(errs[0].message.contains("fail closed"), "{errs:?}");
}

#[test]
fn unknown_keys_and_duplicate_keys_rejected() {
    let e = errors("listeners: []\nbogus: 1\n");
    assert!(e[0].message.contains("unknown field"), "{e:?}");
    let e = errors("listeners: [{name: tls, address: '127.0.0.1:0', colour: red}]");
    assert!(e[0].message.contains("unknown field"), "{e:?}");
    let e = errors("listeners: []\nlisteners: []\n");
    assert!(e[0].message.contains("duplicate"), "{e:?}");
}

#[test]
fn acl_ipv4_mapped_and_ipv6() {
    let s = ok("
listeners: [{name: tls, address: '127.0.0.1:0'}]
control_planes:
  - {name: a, hostnames: [a.example.com], endpoints: ['127.0.0.1:1'], acl: {allow: [192.0.2.0/24, '2001:db8::/32']}}
");
    let acl = s.control_planes["a"].acl.as_ref().unwrap();
    assert!(acl.contains("192.0.2.7".parse().unwrap()));
    assert!(acl.contains("::ffff:192.0.2.7".parse().unwrap()));
    assert!(acl.contains("2001:db8::5".parse().unwrap()));
    assert!(!acl.contains("198.51.100.1".parse().unwrap()));
}

#[test]
fn endpoint_state_survives_reload_when_unchanged() {
    let first = ok(MINIMAL);
    first.control_planes["a"].endpoints[0]
        .state
        .active
        .store(7, std::sync::atomic::Ordering::Relaxed);
    let second = compile(parse(MINIMAL).unwrap(), Some(&first)).unwrap();
    let st: &EndpointState = &second.control_planes["a"].endpoints[0].state;
    assert_eq!(st.active.load(std::sync::atomic::Ordering::Relaxed), 7);
}

#[test]
fn diff_names_added_removed_changed() {
    let a = parse(MINIMAL).unwrap();
    let mut b = a.clone();
    b.control_planes[0].endpoints.push("127.0.0.1:2".into());
    b.control_planes.push(crate::model::ControlPlane {
        served_on: Vec::new(),
        name: "new".into(),
        hostnames: vec!["n.example.com".into()],
        endpoints: vec!["127.0.0.1:3".into()],
        acl: None,
        destinations: Vec::new(),
        service_addresses: Vec::new(),
        cluster_id: None,
    });
    let d = diff(&a, &b);
    assert_eq!(d.added, vec!["new".to_string()]);
    assert_eq!(d.changed, vec!["a".to_string()]);
    let d = diff(&b, &a);
    assert_eq!(d.removed, vec!["new".to_string()]);
}

#[test]
fn restart_only_settings_detected() {
    let a = parse(MINIMAL).unwrap();
    let mut b = a.clone();
    b.listeners[0].address = "127.0.0.1:9".into();
    assert_eq!(restart_only_changes(&a, &b), vec!["listeners"]);
    assert!(restart_only_changes(&a, &a).is_empty());
}

#[test]
fn destinations_are_validated_and_unique() {
    let s = ok("
listeners: [{name: c, address: '127.0.0.1:0', protocol: http-connect}]
control_planes:
  - name: a
    endpoints: ['127.0.0.1:1']
    destinations:
      - {name: 'OUTBOUND|443||kube-apiserver.shoot--a.svc.cluster.local'}
      - {name: 'outbound|1194||vpn-seed-server.shoot--a.svc.cluster.local', endpoints: ['127.0.0.1:2']}
");
    let r = s
        .routes
        .destination("outbound|443||kube-apiserver.shoot--a.svc.cluster.local")
        .unwrap();
    assert_eq!(r.control_plane.name, "a");
    assert_eq!(r.endpoints[0].address, "127.0.0.1:1");
    let r = s
        .routes
        .destination("outbound|1194||vpn-seed-server.shoot--a.svc.cluster.local")
        .unwrap();
    assert_eq!(r.endpoints[0].address, "127.0.0.1:2");
    assert_eq!(s.listeners[0].destination_header, "x-gardener-destination");

    let errs = errors("
listeners: [{name: c, address: '127.0.0.1:0', protocol: http-connect, destination_header: 'bad header'}]
control_planes:
  - name: a
    endpoints: ['127.0.0.1:1']
    destinations: [{name: 'shoot--a--kube-apiserver-socket'}, {name: 'outbound|443|v1|x.y'}]
  - name: b
    endpoints: ['127.0.0.1:1']
    destinations: [{name: 'SHOOT--A--kube-apiserver-socket', endpoints: []}]
");
    let text: Vec<String> = errs
        .iter()
        .map(|e| format!("{}: {}", e.path, e.message))
        .collect();
    for w in [
        "listeners[0].destination_header",
        "control_planes[0].destinations[1].name",
        "control_planes[1].destinations[0].name: destination \"shoot--a--kube-apiserver-socket\" is already used by control plane \"a\"",
    ] {
        assert!(text.iter().any(|t| t.starts_with(w)), "missing {w} in {text:#?}");
    }
}

#[test]
fn destination_regex_is_compiled_or_reported() {
    let s = ok("listeners: [{name: c, address: '127.0.0.1:0', protocol: http-connect, destination_regex: 'outbound\\|.*'}]");
    let re = s.listeners[0].destination_regex.as_ref().unwrap();
    assert!(re.is_match("outbound|443||a.b"));
    assert!(
        !re.is_match("xoutbound|443||a.b"),
        "full match, like Envoy's safe_regex"
    );
    let e = errors("listeners: [{name: c, address: '127.0.0.1:0', protocol: http-connect, destination_regex: '(unclosed'}]");
    assert!(
        e[0].path == "listeners[0].destination_regex"
            && e[0].message.contains("invalid regular expression"),
        "{e:?}"
    );
}

#[test]
fn local_endpoints_stand_alone() {
    let s = ok(&MINIMAL.replace("'127.0.0.1:1'", "'local:tunnel-server'"));
    assert_eq!(
        s.routes.lookup("api.a.example.com").unwrap().endpoints[0].address,
        "local:tunnel-server"
    );
    let e = errors(&MINIMAL.replace("'127.0.0.1:1'", "'local:tunnel-server', '127.0.0.1:1'"));
    assert!(
        e.iter().any(|e| e.message.contains("only endpoint")),
        "{e:?}"
    );
    let e = errors(&MINIMAL.replace("'127.0.0.1:1'", "'local:'"));
    assert!(
        e.iter().any(|e| e.message.contains("local:<name>")),
        "{e:?}"
    );
}

#[test]
fn a_tunnel_target_is_fixed_host_port_and_only_for_local_endpoints() {
    let tunnel = "
listeners: [{name: c, address: '127.0.0.1:0', protocol: http-connect, tunnel_frontend: true}]
control_planes:
  - name: a
    destinations: [{name: 'outbound|10250||kubelet.a.svc.cluster.local', tunnel_target: 'TARGET'}]
    endpoints: ['ENDPOINT']
    acl: {allow: [10.0.0.0/8]}
";
    let s = ok(&tunnel
        .replace("TARGET", "10.250.0.10:10250")
        .replace("ENDPOINT", "local:tunnel-server"));
    assert!(s.listeners[0].tunnel_frontend);
    let r = s
        .routes
        .destination("outbound|10250||kubelet.a.svc.cluster.local")
        .unwrap();
    assert_eq!(r.tunnel_target.as_deref(), Some("10.250.0.10:10250"));
    // Without a local: endpoint nothing would ever dial it.
    let e = errors(
        &tunnel
            .replace("TARGET", "10.250.0.10:10250")
            .replace("ENDPOINT", "127.0.0.1:1"),
    );
    assert!(e[0].path.ends_with("tunnel_target"), "{e:?}");
    for bad in ["10.250.0.10", "a b:1", ":80", "x:0"] {
        let e = errors(
            &tunnel
                .replace("TARGET", bad)
                .replace("ENDPOINT", "local:tunnel-server"),
        );
        assert!(e[0].message.contains("host:port"), "{bad}: {e:?}");
    }
    // Who may reach into the shoot must be said.
    let e = errors(
        &tunnel
            .replace("TARGET", "10.250.0.10:10250")
            .replace("ENDPOINT", "local:tunnel-server")
            .replace("    acl: {allow: [10.0.0.0/8]}\n", ""),
    );
    assert!(e[0].message.contains("needs an `acl`"), "{e:?}");
    // Only a CONNECT listener can be a tunnel frontend.
    let e = errors(&MINIMAL.replace(
        "address: '127.0.0.1:0'}",
        "address: '127.0.0.1:0', tunnel_frontend: true}",
    ));
    assert!(e[0].path.ends_with("tunnel_frontend"), "{e:?}");
}

#[test]
fn the_most_specific_wildcard_wins() {
    let s = ok("
listeners: [{name: tls, address: '127.0.0.1:0'}]
control_planes:
  - {name: wide, hostnames: ['*.example.com'], endpoints: ['127.0.0.1:1']}
  - {name: narrow, hostnames: ['*.b.example.com'], endpoints: ['127.0.0.1:2']}
");
    let at = |h: &str| s.routes.lookup(h).map(|c| c.name.clone());
    assert_eq!(at("a.b.example.com").as_deref(), Some("narrow"));
    assert_eq!(at("x.a.b.example.com").as_deref(), Some("narrow"));
    assert_eq!(at("a.c.example.com").as_deref(), Some("wide"));
    assert_eq!(at("b.example.com").as_deref(), Some("wide"));
    assert_eq!(at("example.com"), None);
}

/// Names served at one address (a Gateway with its own address) neither
/// leak to another address nor conflict with the same name there; such an
/// address serves nothing else (not the names served everywhere), and the
/// names served everywhere are not served there.
#[test]
fn served_on_scopes_names_to_listening_addresses() {
    let s = ok("
listeners: [{name: tls, address: '0.0.0.0:443'}]
control_planes:
  - name: one
    served_on: [{address: '10.0.0.1:443', hostnames: [api.example.com, '*.example.com']}]
    endpoints: ['127.0.0.1:1']
  - name: two
    served_on: [{address: '10.0.0.2:443', hostnames: [api.example.com]}]
    endpoints: ['127.0.0.1:2']
  - {name: all, hostnames: [file.example.org, api.example.com], endpoints: ['127.0.0.1:3']}
");
    let at = |h: &str, a: &str| {
        s.routes
            .lookup_at(h, a.parse().unwrap())
            .map(|c| c.name.clone())
    };
    assert!(s.routes.scoped());
    assert_eq!(
        at("api.example.com", "10.0.0.1:443").as_deref(),
        Some("one")
    );
    assert_eq!(
        at("api.example.com", "10.0.0.2:443").as_deref(),
        Some("two")
    );
    assert_eq!(at("x.example.com", "10.0.0.1:443").as_deref(), Some("one"));
    assert_eq!(at("x.example.com", "10.0.0.2:443"), None);
    assert_eq!(at("api.example.com", "10.0.0.1:8443"), None);
    // IPv4-mapped is the same address.
    assert_eq!(
        at("api.example.com", "[::ffff:10.0.0.2]:443").as_deref(),
        Some("two")
    );
    // Elsewhere, the names served everywhere; never at a scoped address.
    assert_eq!(
        at("api.example.com", "10.0.0.9:443").as_deref(),
        Some("all")
    );
    assert_eq!(
        at("file.example.org", "10.0.0.9:443").as_deref(),
        Some("all")
    );
    assert_eq!(at("file.example.org", "10.0.0.1:443"), None);

    let e = errors("
listeners: [{name: tls, address: '0.0.0.0:443'}, {name: c, address: '127.0.0.1:0', protocol: http-connect}]
control_planes:
  - name: one
    served_on: [{address: '10.0.0.1:443', hostnames: [api.example.com]}]
    endpoints: ['127.0.0.1:1']
  - name: same-address
    served_on: [{address: '10.0.0.1:443', hostnames: [api.example.com]}]
    endpoints: ['127.0.0.1:1']
  - name: bad
    served_on:
      - {address: '10.0.0.1:8443', hostnames: [b.example.com]}
      - {address: '0.0.0.0:443', hostnames: [b.example.com]}
      - {address: x, hostnames: [b.example.com]}
      - {address: '10.0.0.1:0', hostnames: [b.example.com]}
      - {address: '10.0.0.3:443', hostnames: ['a.*.example.com']}
    endpoints: ['127.0.0.1:1']
");
    let text: Vec<String> = e
        .iter()
        .map(|e| format!("{}: {}", e.path, e.message))
        .collect();
    assert!(
        text.iter().any(
            |t| t.starts_with("control_planes[1].served_on[0].hostnames[0]")
                && t.contains("already used by control plane \"one\"")
        ),
        "{text:?}"
    );
    for (path, why) in [
        ("served_on[0].address", "no tls or auto listener"),
        ("served_on[1].address", "not a specific"),
        ("served_on[2].address", "not ip:port"),
        ("served_on[3].address", "not a specific"),
        (
            "served_on[4].hostnames[0]",
            "only allowed as the whole leftmost label",
        ),
    ] {
        assert!(
            text.iter()
                .any(|t| t.starts_with(&format!("control_planes[2].{path}")) && t.contains(why)),
            "{path}: {text:?}"
        );
    }
}

/// A class Gateway's address serves nothing but its own routes, even
/// before it has any.
#[test]
fn class_addresses_serve_no_names_from_elsewhere() {
    let s = ok("
listeners: [{name: tls, address: '0.0.0.0:443'}]
control_planes:
  - {name: all, hostnames: [api.example.com], endpoints: ['127.0.0.1:3']}
kubernetes: {gateway_class: {name: seedlink, addresses: ['10.0.0.1']}, lease: ns/l}
");
    assert!(s
        .routes
        .lookup_at("api.example.com", "10.0.0.1:443".parse().unwrap())
        .is_none());
    assert!(s
        .routes
        .lookup_at("api.example.com", "10.0.0.2:443".parse().unwrap())
        .is_some());
}

#[test]
fn the_kubernetes_section_names_a_gateway_or_a_class_with_receivable_addresses() {
    let base = "listeners: [{name: tls, address: '0.0.0.0:443'}, {name: c, address: '127.0.0.1:0', protocol: http-connect}]\n";
    ok(&format!("{base}kubernetes: {{gateway: ns/gw}}\n"));
    ok(&format!(
        "{base}kubernetes: {{gateway_class: {{name: seedlink, addresses: ['10.0.0.1', '::1']}}, lease: ns/l}}\n"
    ));
    let text = |e: Vec<ConfigError>| -> Vec<String> {
        e.iter()
            .map(|e| format!("{}: {}", e.path, e.message))
            .collect()
    };
    let e = text(errors(&format!("{base}kubernetes: {{lease: ns/l}}\n")));
    assert!(
        e.iter()
            .any(|t| t.starts_with("kubernetes: names no Gateway")),
        "{e:?}"
    );
    let e = text(errors(&format!(
        "{base}kubernetes: {{gateway_class: {{name: seedlink, addresses: ['10.0.0.1']}}}}\n"
    )));
    assert!(
        e.iter()
            .any(|t| t.starts_with("kubernetes.lease: is required")),
        "{e:?}"
    );
    let e = text(errors(
        "listeners: [{name: tls, address: '10.0.0.1:443'}]\nkubernetes: {lease: ns/l, gateway_class: {name: 'Bad Name', addresses: ['10.0.0.1', '10.0.0.1', '10.0.0.2', x, '0.0.0.0']}}\n",
    ));
    for (path, why) in [
        ("kubernetes.gateway_class.name", "not a GatewayClass name"),
        ("kubernetes.gateway_class.addresses[1]", "listed twice"),
        (
            "kubernetes.gateway_class.addresses[2]",
            "no tls or auto listener",
        ),
        ("kubernetes.gateway_class.addresses[3]", "not an IP address"),
        (
            "kubernetes.gateway_class.addresses[4]",
            "not a specific address",
        ),
    ] {
        assert!(
            e.iter().any(|t| t.starts_with(path) && t.contains(why)),
            "{path}: {e:?}"
        );
    }
}

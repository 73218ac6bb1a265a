//! The configuration's unit tests: parsing, validation, trust claims.
#![allow(clippy::unwrap_used)]

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::model::*;
use super::trust::*;
use super::*;

/// A self-signed CA certificate (an agent CA must be one).
fn root(cn: &str) -> rcgen::CertifiedKey<rcgen::KeyPair> {
    let key = rcgen::KeyPair::generate().unwrap();
    let mut p = rcgen::CertificateParams::new(vec![cn.to_string()]).unwrap();
    p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    rcgen::CertifiedKey {
        cert: p.self_signed(&key).unwrap(),
        signing_key: key,
    }
}

fn cfg(token: &str) -> String {
    format!(
        "agents: {{listen: '0.0.0.0:8132', cert: c.pem, key: k.pem}}
clusters:
  - name: a
    agent_token: {token}
    frontends: [{{name: f, protocol: http-connect, unix: /tmp/a.sock}}]
"
    )
}

fn err(token: &str) -> String {
    format!("{:#}", ServerConfig::parse(&cfg(token)).unwrap_err())
}

/// A timeout of 0 would fire at once, and one of "300000000000y" is a
/// typo that would overflow every deadline computed from it: both are
/// refused, with the key named.
#[test]
fn timeouts_are_bounded() {
    let with = |extra: &str| {
        ServerConfig::parse(&format!("{extra}\n{}", cfg("{issuer: i, keys: sa.pub}")))
            .map_err(|e| format!("{e:#}"))
    };
    with("dial_timeout: 30s\nstall_timeout: 1h").unwrap();
    for (key, bad) in [
        ("dial_timeout", "0s"),
        ("stall_timeout", "300000000000y"),
        ("dial_timeout", "25h"),
    ] {
        let e = with(&format!("{key}: {bad}")).unwrap_err();
        assert!(
            e.contains(key) && e.contains("at most 24h"),
            "{key}: {bad}: {e}"
        );
    }
}

/// Seed destinations: DNS names with ports; addresses or a Service, not
/// both; each problem named by its key.
#[test]
fn seed_destinations_are_checked() {
    let with = |dests: &str| {
        let text = cfg("{issuer: i, keys: sa.pub}") + &format!("    seed_destinations: {dests}\n");
        ServerConfig::parse(&text).map_err(|e| format!("{e:#}"))
    };
    with("[{host: hooks.shoot--a.svc, ports: [443], addresses: ['127.0.0.1']}]").unwrap();
    with("[{host: hooks.seed.example, ports: [443, 8443]}]").unwrap();
    for (bad, key) in [
        (
            "[{host: '10.0.0.1', ports: [443]}]",
            "seed_destinations[0].host",
        ),
        ("[{host: hooks, ports: [443]}]", "seed_destinations[0].host"),
        (
            "[{host: 'a/b.svc', ports: [443]}]",
            "seed_destinations[0].host",
        ),
        (
            "[{host: hooks.a.svc, ports: []}]",
            "seed_destinations[0].ports",
        ),
        (
            "[{host: hooks.a.svc, ports: [0]}]",
            "seed_destinations[0].ports",
        ),
        (
            "[{host: hooks.a.svc, ports: [443], addresses: ['10.0.0.1'], service: a/hooks}]",
            "seed_destinations[0]",
        ),
        (
            "[{host: hooks.a.svc, ports: [443], service: hooks}]",
            "seed_destinations[0].service",
        ),
        (
            "[{host: hooks.a.svc, ports: [443], service: a/hooks}]",
            "kubernetes section",
        ),
    ] {
        let e = with(bad).unwrap_err();
        assert!(e.contains(key), "{bad}: {e}");
    }
}

#[test]
fn token_checks_are_validated() {
    let ok = ServerConfig::parse(&cfg(
        "{issuer: i, review: {url: 'https://10.0.0.1:443', ca: ca.pem, token_file: t}}",
    ))
    .unwrap();
    let r = ok.clusters[0]
        .agent_token
        .as_ref()
        .unwrap()
        .review
        .as_ref()
        .unwrap();
    assert_eq!(r.timeout, Duration::from_secs(5));
    assert_eq!(r.cache_ttl, Duration::from_secs(60));
    ServerConfig::parse(&cfg("{issuer: i, keys: sa.pub}")).unwrap();
    assert!(err("{issuer: i}").contains("exactly one of keys"));
    assert!(
        err("{issuer: i, keys: k, review: {url: 'https://a', ca: c, token_file: t}}")
            .contains("exactly one of keys")
    );
    assert!(
        err("{issuer: i, review: {url: 'http://a', ca: c, token_file: t}}")
            .contains("must be https://")
    );
    assert!(
        err("{issuer: i, review: {url: 'https://a', ca: c}}").contains("token_file or cert/key")
    );
    assert!(
        err("{issuer: i, review: {url: 'https://a', ca: c, cert: x}}")
            .contains("cert and key go together")
    );
    assert!(
        err("{issuer: i, review: {url: 'https://a', ca: c, token_file: t, timeout: 0s}}")
            .contains("timeout")
    );
    let two = "agents: {listen: '0.0.0.0:8132', cert: c.pem, key: k.pem}
clusters:
  - {name: a, agent_token: {issuer: i, keys: k}, frontends: [{name: f, protocol: grpc, unix: /a}]}
  - {name: b, agent_token: {issuer: i, keys: k}, frontends: [{name: f, protocol: grpc, unix: /b}]}
";
    assert!(
        format!("{:#}", ServerConfig::parse(two).unwrap_err()).contains("used by another cluster")
    );
}

#[test]
fn templates_give_every_cluster_a_socket() {
    let yaml = "agents: {listen: '0.0.0.0:8132', cert: c.pem, key: k.pem}
frontend_templates: [{name: kas, protocol: http-connect, unix: '/run/seedlink/{cluster}.sock'}]
clusters:
  - {name: shoot--a, agent_ca: a.pem, frontends: []}
  - {name: shoot--b, agent_ca: b.pem, frontends: [{name: grpc, protocol: grpc, unix: /run/b-grpc.sock}]}
";
    let cfg = ServerConfig::parse(yaml).unwrap();
    let paths: Vec<_> = cfg
        .clusters
        .iter()
        .flat_map(|c| c.frontends.iter().map(|f| f.unix.clone().unwrap()))
        .collect();
    assert_eq!(
        paths,
        [
            PathBuf::from("/run/seedlink/shoot--a.sock"),
            PathBuf::from("/run/b-grpc.sock"),
            PathBuf::from("/run/seedlink/shoot--b.sock")
        ]
    );
    let bad = yaml.replace("name: shoot--a,", "name: 'a/../../etc',");
    assert!(format!("{:#}", ServerConfig::parse(&bad).unwrap_err()).contains("socket path"));
    let no_placeholder = yaml.replace("{cluster}.sock", "x.sock");
    assert!(
        format!("{:#}", ServerConfig::parse(&no_placeholder).unwrap_err())
            .contains("containing {cluster}")
    );
}

#[test]
fn shared_proxy_frontends_need_passwords_and_may_be_plain() {
    let base = "agents: {listen: '0.0.0.0:8132', cert: c.pem, key: k.pem}
clusters:
  - name: a
    agent_ca: ca.pem
    frontends: [{name: p, protocol: http-proxy, tcp: '10.0.0.1:3129'}]
";
    // A per-cluster proxy listener off loopback needs mTLS.
    assert!(format!("{:#}", ServerConfig::parse(base).unwrap_err()).contains("mTLS"));
    let base = base.replace("10.0.0.1:3129", "127.0.0.1:3129");
    let shared = format!(
        "{base}shared_frontends: [{{name: s, protocol: http-proxy, tcp: '0.0.0.0:3128'}}]\n"
    );
    assert!(format!("{:#}", ServerConfig::parse(&shared).unwrap_err())
        .contains("no cluster has a proxy_password_file"));
    let with_pw = shared.replace(
        "    agent_ca: ca.pem\n",
        "    agent_ca: ca.pem\n    proxy_password_file: pw\n",
    );
    let cfg = ServerConfig::parse(&with_pw).unwrap();
    assert_eq!(cfg.shared_frontends.len(), 1);
    let grpc = with_pw.replace("{name: s, protocol: http-proxy", "{name: s, protocol: grpc");
    assert!(format!("{:#}", ServerConfig::parse(&grpc).unwrap_err())
        .contains("the client certificate names the cluster"));
}

#[test]
fn clusters_from_kubernetes_are_admitted_one_by_one() {
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca.pem");
    let pki = root("x");
    std::fs::write(&ca, pki.cert.pem()).unwrap();
    let text = "agents: {listen: '0.0.0.0:8132', cert: c.pem, key: k.pem}
clusters: []
frontend_templates: [{name: uds, protocol: http-connect, unix: '/run/{cluster}.sock'}]
kubernetes: {lease: seedlink-system/tunnel}
";
    let cluster = |name: &str, ca: &Path| Cluster {
        name: name.into(),
        agent_ca: Some(ca.to_path_buf()),
        agent_token: None,
        strategies: vec!["default".into()],
        frontends: Vec::new(),
        proxy_password_file: None,
        frontend_client_uri: None,
        seed_destinations: Vec::new(),
        limits: ClusterLimits::default(),
    };
    let ca_c = dir.path().join("ca-c.pem");
    let pki_c = root("c");
    std::fs::write(&ca_c, pki_c.cert.pem()).unwrap();
    let extra = vec![
        cluster("ns-a.t", &ca),
        // The same name again, and a CA that does not read.
        cluster("ns-a.t", &ca),
        cluster("ns-b.t", &dir.path().join("missing.pem")),
        cluster("ns-c.t", &ca_c),
    ];
    let (cfg, refused) = ServerConfig::parse_with(text, extra);
    let cfg = cfg.unwrap();
    let kept: Vec<&str> = cfg.clusters.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(kept, ["ns-a.t", "ns-c.t"]);
    // Templates apply to them like to the file's clusters.
    assert_eq!(
        cfg.clusters[1].frontends[0].unix.as_deref(),
        Some(Path::new("/run/ns-c.t.sock"))
    );
    let names: Vec<&str> = refused.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["ns-a.t", "ns-b.t"]);
    assert!(
        refused[1].1[0].message.contains("missing.pem"),
        "{refused:?}"
    );
    // Without a kubernetes section an empty cluster list is an error;
    // a problem of the file fails the whole parse.
    assert!(ServerConfig::parse(
        &text.replace("kubernetes: {lease: seedlink-system/tunnel}\n", "")
    )
    .is_err());
    let (bad, refused) = ServerConfig::parse_with(
        &text.replace("seedlink-system/tunnel", "nolease"),
        vec![cluster("ns-a.t", &ca)],
    );
    assert!(format!("{:#}", bad.unwrap_err()).contains("kubernetes.lease"));
    assert!(refused.is_empty());
}

/// Replica addresses are checked at parse: they need the replicas'
/// Service, an address template that gives `host:port` and a server name
/// template that gives a TLS name.
#[test]
fn replica_addresses_are_checked() {
    let text = |k: &str| {
        format!(
            "agents: {{listen: '0.0.0.0:8132', cert: c.pem, key: k.pem}}
clusters: []
kubernetes: {{lease: s/l, {k}}}
"
        )
    };
    let ok = text("replicas: s/seedlink-internal, replica_addresses: {address: '{ip}:8091', server_name: '{pod}.t.example.com'}");
    let cfg = ServerConfig::parse(&ok).unwrap();
    let a = cfg.kubernetes.unwrap().replica_addresses.unwrap();
    assert_eq!(
        a.of("fd00::1".parse().unwrap(), "p-0"),
        (
            "[fd00::1]:8091".to_string(),
            "p-0.t.example.com".to_string()
        )
    );
    // A name that is the address: bare, as a TLS name is.
    let ip_name = seedlink_config::tunnel::ReplicaAddresses {
        server_name: Some("{ip}".into()),
        ..a
    };
    assert_eq!(ip_name.of("fd00::1".parse().unwrap(), "p-0").1, "fd00::1");
    let bare = text("replicas: s/r, replica_addresses: {address: '{ip}:1', server_name: '{ip}'}");
    assert!(ServerConfig::parse(&bare).is_ok());
    for (k, why) in [
        (
            "replica_addresses: {address: '{ip}:8091'}",
            "needs kubernetes.replicas",
        ),
        (
            "replicas: s/r, replica_addresses: {address: '{ip}'}",
            "not host:port",
        ),
        (
            "replicas: s/r, replica_addresses: {address: 'x:{pod}'}",
            "not host:port",
        ),
        (
            "replicas: s/r, replica_addresses: {address: '{ip}:1', server_name: '{ip} x'}",
            "not a TLS server name",
        ),
        (
            "replicas: s/r, replica_addresses: {address: '{ip}:1', server_name: 'x.{ip}'}",
            "not a TLS server name",
        ),
    ] {
        let e = format!("{:#}", ServerConfig::parse(&text(k)).unwrap_err());
        assert!(e.contains(why), "{k}: {e}");
    }
}

/// Two clusters that trust the same agent CA (the same file, a copy, or
/// another certificate for the same key) or the same token keys: an
/// agent would be taken for whichever came first. The file's own
/// overlap fails the parse; a newer object's is refused, the older kept.
#[test]
fn clusters_never_share_agent_trust() {
    let dir = tempfile::tempdir().unwrap();
    let w = |name: &str, pem: String| {
        let p = dir.path().join(name);
        std::fs::write(&p, pem).unwrap();
        p.display().to_string()
    };
    let key = rcgen::KeyPair::generate().unwrap();
    let ca = |cn: &str| {
        let mut params = rcgen::CertificateParams::new(vec![cn.to_string()]).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.self_signed(&key).unwrap().pem()
    };
    let a = w("a.pem", ca("a"));
    let copy = w("copy.pem", std::fs::read_to_string(&a).unwrap());
    // Another certificate, the same key: verifies the same agents.
    let same_key = w("same-key.pem", ca("other"));
    let other = root("o");
    let own = w("own.pem", other.cert.pem());
    let jwt_keys = w("sa.pub", key.public_key_pem());
    let file = |b: &str| {
        format!(
            "agents: {{listen: '0.0.0.0:8132', cert: c.pem, key: k.pem}}
clusters:
  - {{name: a, agent_ca: '{a}'}}
  - {{name: b, {b}}}
"
        )
    };
    for b in [
        format!("agent_ca: '{a}'"),
        format!("agent_ca: '{copy}'"),
        format!("agent_ca: '{same_key}'"),
        format!("agent_token: {{issuer: b, keys: '{jwt_keys}'}}"),
    ] {
        let e = format!("{:#}", ServerConfig::parse(&file(&b)).unwrap_err());
        assert!(e.contains("cluster \"a\" trusts already"), "{b}: {e}");
    }
    ServerConfig::parse(&file(&format!("agent_ca: '{own}'"))).unwrap();

    // From Kubernetes: the newer claim is refused, the older kept.
    let text = file(&format!("agent_ca: '{own}'"));
    let cluster = |name: &str, ca: &str| Cluster {
        name: name.into(),
        agent_ca: Some(ca.into()),
        agent_token: None,
        strategies: vec!["default".into()],
        frontends: Vec::new(),
        proxy_password_file: None,
        frontend_client_uri: None,
        seed_destinations: Vec::new(),
        limits: ClusterLimits::default(),
    };
    let fresh = root("f");
    let fresh = w("fresh.pem", fresh.cert.pem());
    let (cfg, refused) = ServerConfig::parse_with(
        &text,
        vec![
            cluster("ns-x.t", &fresh),
            cluster("ns-evil.t", &copy),
            cluster("ns-late.t", &fresh),
        ],
    );
    let kept: Vec<String> = cfg.unwrap().clusters.into_iter().map(|c| c.name).collect();
    assert_eq!(kept, ["a", "b", "ns-x.t"]);
    let names: Vec<&str> = refused.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["ns-evil.t", "ns-late.t"]);
}

/// An older TunnelCluster edited to claim a newer one's CA does not
/// take its trust: the cluster that held the key keeps it, the editor
/// is refused; once the holder lets go, the key may move.
#[test]
fn trust_stays_with_the_cluster_that_held_it() {
    let dir = tempfile::tempdir().unwrap();
    let w = |name: &str, pem: String| {
        let p = dir.path().join(name);
        std::fs::write(&p, pem).unwrap();
        p.display().to_string()
    };
    let ca = |n: &str| {
        let c = root(n);
        w(&format!("{n}.pem"), c.cert.pem())
    };
    let (own, victims) = (ca("own"), ca("victims"));
    let cluster = |name: &str, ca: &str| Cluster {
        name: name.into(),
        agent_ca: Some(ca.into()),
        agent_token: None,
        strategies: vec!["default".into()],
        frontends: Vec::new(),
        proxy_password_file: None,
        frontend_client_uri: None,
        seed_destinations: Vec::new(),
        limits: ClusterLimits::default(),
    };
    let text = "agents: {listen: '0.0.0.0:8132', cert: c.pem, key: k.pem}\nclusters: []\n";
    let admit = |mut extra: Vec<Cluster>, held: &HashMap<String, String>| {
        let _ = keep_first_trust(&mut extra, held, &HashSet::new());
        let (cfg, refused) = ServerConfig::parse_with(text, extra);
        let cfg = cfg.unwrap();
        let names: Vec<String> = refused.into_iter().map(|(n, _)| n).collect();
        (trust_holders(&cfg), names)
    };
    // The attacker's object is older (first), each with its own CA.
    let (held, refused) = admit(
        vec![cluster("ns-x.t", &own), cluster("ns-v.t", &victims)],
        &HashMap::new(),
    );
    assert!(refused.is_empty());
    // The attacker edits its (older) object to the victim's CA.
    let (held, refused) = admit(
        vec![cluster("ns-x.t", &victims), cluster("ns-v.t", &victims)],
        &held,
    );
    assert_eq!(refused, ["ns-x.t"]);
    // And stays refused on the next change.
    let (held, refused) = admit(
        vec![cluster("ns-x.t", &victims), cluster("ns-v.t", &victims)],
        &held,
    );
    assert_eq!(refused, ["ns-x.t"]);
    assert!(held.values().any(|n| n == "ns-v.t"));
    // The victim's object goes: the key is free.
    let (held, refused) = admit(vec![cluster("ns-x.t", &victims)], &held);
    assert!(refused.is_empty());
    assert!(held.values().all(|n| n == "ns-x.t"));
    // A holder whose object exists but could not be read (its Secret
    // is missing: not among the clusters to apply) keeps its key.
    let (held, _) = admit(vec![cluster("ns-v.t", &victims)], &HashMap::new());
    let mut extra = vec![cluster("ns-x.t", &victims)];
    let out = keep_first_trust(&mut extra, &held, &HashSet::from(["ns-v.t".to_string()]));
    assert!(extra.is_empty(), "the claimant is not applied");
    assert_eq!(out[0].0, "ns-x.t");
    assert!(out[0].1[0].message.contains("ns-v.t"), "{:?}", out[0].1);
    // A holder that stops trusting its CA (a revocation) keeps it
    // reserved while its object exists: a claimant is refused outright.
    let (held, _) = admit(vec![cluster("ns-v.t", &victims)], &HashMap::new());
    let mut extra = vec![cluster("ns-x.t", &victims), cluster("ns-v.t", &own)];
    let out = keep_first_trust(&mut extra, &held, &HashSet::new());
    assert_eq!(out.len(), 1, "{out:?}");
    assert!(out[0].1[0].message.contains("reserved"), "{:?}", out[0].1);
    assert_eq!(extra.len(), 1);
    assert_eq!(extra[0].name, "ns-v.t");
    // Another TunnelCluster of the holder's own namespace may take it.
    let mut extra = vec![cluster("ns-v.u", &victims), cluster("ns-v.t", &own)];
    let out = keep_first_trust(&mut extra, &held, &HashSet::new());
    assert!(out.is_empty(), "{out:?}");
    assert_eq!(extra.len(), 2);
}

/// An older TunnelCluster that adds a newer one's TCP frontend address
/// goes last and is refused on the collision; the holder keeps it.
#[test]
fn a_frontend_address_stays_with_its_holder() {
    let dir = tempfile::tempdir().unwrap();
    let ca = |n: &str| {
        let p = dir.path().join(format!("{n}.pem"));
        std::fs::write(&p, root(n).cert.pem()).unwrap();
        p
    };
    let cluster = |name: &str, ca: PathBuf, tcp: &str| Cluster {
        name: name.into(),
        agent_ca: Some(ca),
        agent_token: None,
        strategies: vec!["default".into()],
        frontends: vec![Frontend {
            name: "kas".into(),
            protocol: FrontendProtocol::HttpConnect,
            unix: None,
            tcp: Some(tcp.parse().unwrap()),
            cert: None,
            key: None,
            client_ca: None,
        }],
        proxy_password_file: None,
        frontend_client_uri: None,
        seed_destinations: Vec::new(),
        limits: ClusterLimits::default(),
    };
    let (x, v) = (ca("x"), ca("v"));
    let text = "agents: {listen: '0.0.0.0:8132', cert: c.pem, key: k.pem}\nclusters: []\n";
    let victim = cluster("ns-v.t", v, "127.0.0.1:9001");
    let (cfg, _) = ServerConfig::parse_with(text, vec![victim.clone()]);
    let held = trust_holders(&cfg.unwrap());
    // The attacker's object is older (first) and names the victim's
    // address, as an IPv4-mapped IPv6 address.
    let mut extra = vec![cluster("ns-x.t", x, "[::ffff:127.0.0.1]:9001"), victim];
    let _ = keep_first_trust(&mut extra, &held, &HashSet::new());
    let (cfg, refused) = ServerConfig::parse_with(text, extra);
    let names: Vec<String> = refused.into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["ns-x.t"]);
    let kept: Vec<String> = cfg.unwrap().clusters.into_iter().map(|c| c.name).collect();
    assert_eq!(kept, ["ns-v.t"]);
}

//! node-proxy → gateway across network namespaces: the node-proxy's
//! interface (a port-less bridge with 240.0.0.10/32) lives in a "node"
//! namespace, the gateway and an `openssl s_server` kube-apiserver stand-in
//! (requiring a client certificate) in a "seed" namespace; curl on the node,
//! and in pods' own namespaces, reaches the server through the advertised
//! address. And an IPv6-only seed: HAProxy's PROXY v2 TCP6 header into the
//! gateway's ACL, SNI routing to an IPv6 endpoint.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use seedlink_testkit as common;

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::time::Duration;

use common::{eventually_blocking, netns_pair, require, Proc};

const DEST: &str = "outbound|443||kube-apiserver.shoot--dev--n.svc.cluster.local";
const HOST: &str = "api.n.netns.test";

fn ready_line(child: &mut std::process::Child) -> String {
    let out = child.stdout.take().unwrap();
    let mut line = String::new();
    BufReader::new(out).read_line(&mut line).unwrap();
    line
}

/// The client's files for the test's PKI in `dir`, and the server's
/// certificate and key (`server.pem`, `server-key.pem`) beside them.
fn server_files(pki: &seedlink::demo::Pki, dir: &std::path::Path) -> seedlink::demo::ClientFiles {
    let files = pki.write_client_files(dir).unwrap();
    std::fs::write(dir.join("server.pem"), &pki.servers[0].1.cert_pem).unwrap();
    std::fs::write(dir.join("server-key.pem"), &pki.servers[0].1.key_pem).unwrap();
    files
}

/// `openssl s_server` in `ns` on `accept` (`host:port`, `[v6]:port`), the
/// kube-apiserver stand-in: TLS with the certificate in `dir`, a client
/// certificate of the test's CA required; once it listens.
fn s_server(
    ns: &common::Netns,
    accept: &str,
    dir: &std::path::Path,
    files: &seedlink::demo::ClientFiles,
) -> Proc {
    let openssl = require("openssl");
    let (cert, key) = (dir.join("server.pem"), dir.join("server-key.pem"));
    let server = ns
        .cmd(&[
            openssl.to_str().unwrap(),
            "s_server",
            "-quiet",
            "-accept",
            accept,
            "-cert",
            cert.to_str().unwrap(),
            "-key",
            key.to_str().unwrap(),
            "-CAfile",
            files.ca.to_str().unwrap(),
            "-Verify",
            "1",
            "-www",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let server = Proc(server);
    eventually_blocking("s_server to listen", Duration::from_secs(10), || {
        ns.run(&["ss", "-ltn"]).contains(accept)
    });
    server
}

/// The seed (gateway and an `openssl s_server` kube-apiserver stand-in
/// requiring a client certificate) and a node running the node-proxy on
/// `link_kind` with 240.0.0.10, in namespaces `198.18.<net>.0/24` apart.
struct Bed {
    node: common::Netns,
    _seed: common::Netns,
    dir: tempfile::TempDir,
    files: seedlink::demo::ClientFiles,
    _procs: Vec<Proc>,
}

impl Bed {
    fn start(tag: &str, net: u8, link_kind: &str) -> Bed {
        let (node, seed) = netns_pair(&format!("{tag}n"), &format!("{tag}d"), net);
        let gw_at = format!("198.18.{net}.2:8443");

        let dir = tempfile::tempdir().unwrap();
        let pki = seedlink::demo::Pki::generate(&[HOST]).unwrap();
        let files = server_files(&pki, dir.path());

        // The kube-apiserver stand-in: TLS, client certificate required.
        let server = s_server(&seed, "127.0.0.1:6443", dir.path(), &files);

        // The gateway in the seed namespace.
        let cfg = dir.path().join("gateway.yaml");
        std::fs::write(
            &cfg,
            format!(
                "admin: {{listen: '127.0.0.1:9901'}}
listeners: [{{name: http-proxy, address: '{gw_at}', protocol: http-connect}}]
control_planes:
  - {{name: shoot--dev--n, endpoints: ['127.0.0.1:6443'], destinations: [{{name: '{DEST}'}}]}}
"
            ),
        )
        .unwrap();
        let gw = common::gateway_in_netns(&seed, &cfg);

        // The node-proxy in the node namespace, on its own link.
        let mut np = node
            .cmd(&[
                env!("CARGO_BIN_EXE_seedlink"),
                "node-proxy",
                "--address",
                "240.0.0.10",
                "--link-kind",
                link_kind,
                "--gateway",
                &gw_at,
                "--destination",
                DEST,
                "--admin",
                "127.0.0.1:16910",
            ])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let line = ready_line(&mut np);
        let np = Proc(np);
        assert!(line.contains("240.0.0.10:443"), "{line}");
        assert!(node
            .run(&["ip", "-o", "addr", "show", "dev", "apiserver-proxy"])
            .contains("240.0.0.10/32"));
        Bed {
            node,
            _seed: seed,
            dir,
            files,
            _procs: vec![server, gw, np],
        }
    }

    /// curl in `ns` to the API server at `ip` (by its name): what
    /// s_server answered, or why not.
    fn curl_from(&self, ns: &common::Netns, ip: &str) -> String {
        let out = ns
            .cmd(&[
                "curl",
                "-sS",
                "--max-time",
                "10",
                "--cacert",
                self.files.ca.to_str().unwrap(),
                "--cert",
                self.files.cert.to_str().unwrap(),
                "--key",
                self.files.key.to_str().unwrap(),
                "--resolve",
                &format!("{HOST}:443:{ip}"),
                &format!("https://{HOST}/"),
            ])
            .output()
            .unwrap();
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    }
}

#[test]
fn node_proxy_in_a_node_namespace_reaches_the_seed() {
    let bed = Bed::start("", 2, "bridge");
    let node = &bed.node;
    // curl on the node → 240.0.0.10:443 → CONNECT → gateway → s_server.
    let body = bed.curl_from(node, "240.0.0.10");
    assert!(body.contains("s_server"), "through the node-proxy: {body}");
    // Readiness on the node: address present, gateway answering.
    eventually_blocking("node-proxy ready", Duration::from_secs(15), || {
        let r = node
            .cmd(&[
                "curl",
                "-s",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                "http://127.0.0.1:16910/readyz",
            ])
            .output()
            .unwrap();
        String::from_utf8_lossy(&r.stdout) == "200"
    });
    drop(bed.dir);
}

/// The `kubernetes` Service's ClusterIP in the pods' view.
const CLUSTER_IP: &str = "10.96.0.1";

/// A pod: a namespace of its own behind a veth pair to the node
/// (`198.18.<net>.2`, its default route through the node's end).
fn pod_of(node: &common::Netns, tag: &str, net: u8) -> common::Netns {
    let pod = common::Netns::new(tag);
    common::netns_link(node, &pod, net);
    pod.run(&[
        "ip",
        "route",
        "add",
        "default",
        "via",
        &format!("198.18.{net}.1"),
    ]);
    pod
}

/// Clients in pods' own network namespaces (not the node's, whose
/// traffic kube-proxy's DNAT catches in OUTPUT) reach their API server
/// through the node-proxy:
/// - with kube-proxy's shape: the `kubernetes` ClusterIP translated in
///   the node's PREROUTING (iptables, as kube-proxy installs it) to the
///   address the node-proxy serves;
/// - without iptables: Cilium's socket load balancing translates the
///   ClusterIP at `connect()` inside the pod, so the packet leaves the pod
///   already addressed to the backend and the node has no rule at all;
///   the pod dialling the advertised address itself stands in for it
///   (the eBPF program is not run here: what the node-proxy sees is the
///   same).
///
/// On the node-proxy's `bridge` link (the kernel here has no `dummy`
/// link type; where it has, the same runs on `dummy`, Gardener's).
#[test]
fn clients_in_pods_own_namespaces_reach_their_api_server() {
    require("iptables");
    let mut kinds = vec!["bridge"];
    let probe = common::Netns::new("dummy");
    match probe
        .cmd(&["ip", "link", "add", "probe0", "type", "dummy"])
        .output()
    {
        Ok(o) if o.status.success() => kinds.push("dummy"),
        Ok(o) => eprintln!(
            "skipping the dummy link: the kernel has no 'dummy' link type ({})",
            String::from_utf8_lossy(&o.stderr).trim()
        ),
        Err(e) => eprintln!("skipping the dummy link: {e}"),
    }
    drop(probe);
    for (i, kind) in kinds.into_iter().enumerate() {
        let net = 12 + 2 * u8::try_from(i).unwrap();
        let bed = Bed::start(&format!("p{i}"), net, kind);
        let pod = pod_of(&bed.node, &format!("p{i}pod"), net + 1);
        // Without a rule, the ClusterIP goes nowhere.
        let before = bed.curl_from(&pod, CLUSTER_IP);
        assert!(!before.contains("s_server"), "{kind}: {before}");
        // Cilium's shape: the pod dials the backend itself.
        let direct = bed.curl_from(&pod, "240.0.0.10");
        assert!(
            direct.contains("s_server"),
            "{kind}, from the pod: {direct}"
        );
        // kube-proxy's shape: DNAT in the node's PREROUTING.
        bed.node.run(&[
            "iptables",
            "-t",
            "nat",
            "-A",
            "PREROUTING",
            "-d",
            CLUSTER_IP,
            "-p",
            "tcp",
            "--dport",
            "443",
            "-j",
            "DNAT",
            "--to-destination",
            "240.0.0.10:443",
        ]);
        let natted = bed.curl_from(&pod, CLUSTER_IP);
        assert!(
            natted.contains("s_server"),
            "{kind}, by the ClusterIP: {natted}"
        );
    }
}

/// An IPv6-only seed (a namespace whose only addresses besides loopback
/// are IPv6 ones, on `lo`): the load balancer (HAProxy) connects to the
/// gateway over IPv6 and sends PROXY v2 with a TCP6 client address, the
/// control plane's ACL decides on that address, and SNI routes to an IPv6
/// endpoint (`openssl s_server` requiring a client certificate).
#[test]
fn an_ipv6_seed_takes_the_lbs_tcp6_header_and_routes_to_ipv6_endpoints() {
    require("haproxy");
    let seed = common::Netns::new("v6");
    on_lo(
        &seed,
        &[
            "fd00:6::1",
            "fd00:6::5",
            "fd00:6::6",
            "fd00:6::9",
            "fd00:6::20",
        ],
    );
    let dir = tempfile::tempdir().unwrap();
    let pki = seedlink::demo::Pki::generate(&[HOST]).unwrap();
    let files = server_files(&pki, dir.path());
    let _server = s_server(&seed, "[fd00:6::20]:6443", dir.path(), &files);
    let cfg = dir.path().join("gateway.yaml");
    std::fs::write(
        &cfg,
        format!(
            "admin: {{listen: '[fd00:6::1]:9901'}}
listeners: [{{name: lb, address: '[fd00:6::1]:8443', proxy_protocol: required}}]
trusted_load_balancers: ['fd00:6::9/128']
control_planes:
  - {{name: v6, hostnames: [{HOST}], endpoints: ['[fd00:6::20]:6443'], acl: {{allow: ['fd00:6::5/128']}}}}
"
        ),
    )
    .unwrap();
    let _gw = common::gateway_in_netns(&seed, &cfg);
    let proxies = "frontend lb
  bind ipv6@fd00:6::1:443
  default_backend gw
backend gw
  server gw ipv6@fd00:6::1:8443 send-proxy-v2 source [fd00:6::9]:0
";
    let _hap = haproxy_lb(&seed, dir.path(), proxies, &["[fd00:6::1]:443"]);
    let curl_from = |source: &str| {
        let out = seed
            .cmd(&[
                "curl",
                "-sS",
                "--max-time",
                "10",
                "--interface",
                source,
                "--cacert",
                files.ca.to_str().unwrap(),
                "--cert",
                files.cert.to_str().unwrap(),
                "--key",
                files.key.to_str().unwrap(),
                "--resolve",
                &format!("{HOST}:443:[fd00:6::1]"),
                &format!("https://{HOST}/"),
            ])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    assert!(
        curl_from("fd00:6::5").contains("s_server"),
        "the allowed IPv6 client"
    );
    assert!(
        !curl_from("fd00:6::6").contains("s_server"),
        "the refused IPv6 client got through"
    );
    // The refusal was the ACL's, on the header's TCP6 address.
    let metrics = seed.run(&["curl", "-sS", "http://[fd00:6::1]:9901/metrics"]);
    assert!(
        metrics.contains("seedlink_gateway_acl_denied_total{control_plane=\"v6\"} 1"),
        "{metrics}"
    );
}

/// Puts `addresses` (IPv4 as /32, IPv6 as /128 without duplicate address
/// detection) on `ns`'s loopback.
fn on_lo(ns: &common::Netns, addresses: &[&str]) {
    for a in addresses {
        match a.contains(':') {
            true => ns.run(&[
                "ip",
                "-6",
                "addr",
                "add",
                &format!("{a}/128"),
                "dev",
                "lo",
                "nodad",
            ]),
            false => ns.run(&["ip", "addr", "add", &format!("{a}/32"), "dev", "lo"]),
        };
    }
}

/// The second host name of the dual-stack seed, served at an IPv6 endpoint.
const HOST6: &str = "api.n6.netns.test";

/// HAProxy in `ns` as the seed's load balancer in TCP mode, its
/// frontends and backends `proxies`; once every address of `listening`
/// (as `ss` shows it) listens.
fn haproxy_lb(
    ns: &common::Netns,
    dir: &std::path::Path,
    proxies: &str,
    listening: &[&str],
) -> Proc {
    let cfg = dir.join("haproxy.cfg");
    std::fs::write(
        &cfg,
        format!(
            "global
  maxconn 100
defaults
  mode tcp
  timeout connect 5s
  timeout client 30s
  timeout server 30s
{proxies}"
        ),
    )
    .unwrap();
    let hap = ns
        .cmd(&[
            require("haproxy").to_str().unwrap(),
            "-db",
            "-f",
            cfg.to_str().unwrap(),
        ])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    eventually_blocking("HAProxy to listen", Duration::from_secs(10), || {
        let ss = ns.run(&["ss", "-ltn"]);
        listening.iter().all(|a| ss.contains(a))
    });
    Proc(hap)
}

/// HAProxy as a dual-stack load balancer in `ns`: an IPv4 frontend on
/// 10.66.0.1:443 and an IPv6 one on [fd00:66::1]:443, each sending PROXY
/// v2 to the gateway's port 8443 over its own family, from 10.66.0.9 and
/// fd00:66::9; once both listen.
fn dual_stack_lb(ns: &common::Netns, dir: &std::path::Path) -> Proc {
    let proxies = "frontend lb4
  bind 10.66.0.1:443
  default_backend gw4
frontend lb6
  bind ipv6@fd00:66::1:443
  default_backend gw6
backend gw4
  server gw 10.66.0.1:8443 send-proxy-v2 source 10.66.0.9:0
backend gw6
  server gw ipv6@fd00:66::1:8443 send-proxy-v2 source [fd00:66::9]:0
";
    haproxy_lb(ns, dir, proxies, &["10.66.0.1:443", "[fd00:66::1]:443"])
}

/// A dual-stack seed in one namespace (IPv4 and IPv6 addresses on `lo`):
/// the gateway on one listener for both families (`[::]`), behind HAProxy
/// with a frontend per family sending PROXY v2 (TCP4 and TCP6 client
/// addresses); control plane `v4` at an IPv4 endpoint and `v6` at an IPv6
/// one. An allowed client of each family reaches both control planes
/// through its family's load balancer; a refused one of each family is
/// refused by the ACL, which reads the header's address of its family.
#[test]
fn a_dual_stack_seed_serves_both_families_on_one_listener() {
    let seed = common::Netns::new("ds");
    on_lo(
        &seed,
        &[
            "10.66.0.1",
            "10.66.0.5",
            "10.66.0.6",
            "10.66.0.9",
            "10.66.0.20",
        ],
    );
    on_lo(
        &seed,
        &[
            "fd00:66::1",
            "fd00:66::5",
            "fd00:66::6",
            "fd00:66::9",
            "fd00:66::20",
        ],
    );
    let (dir, dir6) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let pki = seedlink::demo::Pki::generate(&[HOST, HOST6]).unwrap();
    let files = server_files(&pki, dir.path());
    pki.write_client_files(dir6.path()).unwrap();
    std::fs::write(dir6.path().join("server.pem"), &pki.servers[1].1.cert_pem).unwrap();
    std::fs::write(
        dir6.path().join("server-key.pem"),
        &pki.servers[1].1.key_pem,
    )
    .unwrap();
    let _v4 = s_server(&seed, "10.66.0.20:6443", dir.path(), &files);
    let _v6 = s_server(&seed, "[fd00:66::20]:6443", dir6.path(), &files);
    let cfg = dir.path().join("gateway.yaml");
    let acl = "acl: {allow: ['10.66.0.5/32', 'fd00:66::5/128']}";
    std::fs::write(
        &cfg,
        format!(
            "admin: {{listen: '127.0.0.1:9901'}}
listeners: [{{name: lb, address: '[::]:8443', proxy_protocol: required}}]
trusted_load_balancers: ['10.66.0.9/32', 'fd00:66::9/128']
control_planes:
  - {{name: v4, hostnames: [{HOST}], endpoints: ['10.66.0.20:6443'], {acl}}}
  - {{name: v6, hostnames: [{HOST6}], endpoints: ['[fd00:66::20]:6443'], {acl}}}
"
        ),
    )
    .unwrap();
    let _gw = common::gateway_in_netns(&seed, &cfg);
    let _lb = dual_stack_lb(&seed, dir.path());
    let curl = |source: &str, host: &str, lb: &str| {
        let out = seed
            .cmd(&["curl", "-sS", "--max-time", "10", "--interface", source])
            .args(["--cacert", files.ca.to_str().unwrap()])
            .args(["--cert", files.cert.to_str().unwrap()])
            .args(["--key", files.key.to_str().unwrap()])
            .args([
                "--resolve",
                &format!("{host}:443:{lb}"),
                &format!("https://{host}/"),
            ])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).contains("s_server")
    };
    for (allowed, refused, lb) in [
        ("10.66.0.5", "10.66.0.6", "10.66.0.1"),
        ("fd00:66::5", "fd00:66::6", "[fd00:66::1]"),
    ] {
        for host in [HOST, HOST6] {
            assert!(curl(allowed, host, lb), "{allowed} to {host}");
            assert!(!curl(refused, host, lb), "{refused} to {host} got through");
        }
    }
    let metrics = seed.run(&["curl", "-sS", "http://127.0.0.1:9901/metrics"]);
    for cp in ["v4", "v6"] {
        let denied = format!("seedlink_gateway_acl_denied_total{{control_plane=\"{cp}\"}} 2");
        assert!(metrics.contains(&denied), "{denied}\n{metrics}");
    }
}

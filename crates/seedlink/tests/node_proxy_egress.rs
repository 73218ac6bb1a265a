//! The node-proxy as HyperShift runs it: PROXY v2 with the cluster-ID TLV
//! and TLS passed through, every mode leaving through a corporate HTTP
//! CONNECT proxy (tinyproxy, Basic auth), and readiness following active
//! upstream health checks. The "API server" is nginx serving TLS with an
//! optional client certificate and `/version`, as kube-apiserver does.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use seedlink_testkit as common;

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;

const ALPHA: &str = "api.alpha.egress.test";
const DEST: &str = "outbound|443||kube-apiserver.shoot--dev--alpha.svc.cluster.local";

fn node_proxy(args: &[&str]) -> NodeProxyProc {
    let mut all = vec!["--link-kind", "none"];
    all.extend_from_slice(args);
    common::node_proxy(&all)
}

/// nginx serving HTTPS on `port` as a stand-in kube-apiserver: `/version`
/// answers 200, `/broken` 503, anything else says who is speaking and
/// whether the client certificate verified.
fn nginx_apiserver(
    dir: &std::path::Path,
    port: u16,
    cert: &std::path::Path,
    key: &std::path::Path,
    ca: &std::path::Path,
) -> Proc {
    nginx(
        dir,
        &format!(
            "http {{
  access_log {p}/logs/access.log;
  client_body_temp_path {p}/body;
  proxy_temp_path {p}/proxy;
  fastcgi_temp_path {p}/fastcgi;
  uwsgi_temp_path {p}/uwsgi;
  scgi_temp_path {p}/scgi;
  server {{
    listen 127.0.0.1:{port} ssl;
    ssl_certificate {cert};
    ssl_certificate_key {key};
    ssl_client_certificate {ca};
    ssl_verify_client optional;
    location = /version {{ return 200 '{{\"major\":\"1\",\"minor\":\"31\"}}'; }}
    location = /broken {{ return 503; }}
    location / {{ return 200 'hello from nginx sni=$ssl_server_name client_verify=$ssl_client_verify\\n'; }}
  }}
}}",
            p = dir.join("nginx").display(),
            cert = cert.display(),
            key = key.display(),
            ca = ca.display(),
        ),
    )
}

/// tinyproxy on `port` that requires Basic `user:s3cret-pw` and allows
/// CONNECT to `ports` only.
fn tinyproxy(dir: &std::path::Path, port: u16, ports: &[u16]) -> Proc {
    let conf = dir.join("tinyproxy.conf");
    let mut text = format!(
        "Port {port}\nListen 127.0.0.1\nTimeout 60\nLogFile \"{}\"\nLogLevel Connect\n\
         MaxClients 200\nAllow 127.0.0.1\nBasicAuth user s3cret-pw\n",
        dir.join("tinyproxy.log").display()
    );
    for p in ports {
        text.push_str(&format!("ConnectPort {p}\n"));
    }
    std::fs::write(&conf, text).unwrap();
    Proc(
        Command::new(require("tinyproxy"))
            .arg("-d")
            .arg("-c")
            .arg(&conf)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

/// Waits until `/readyz` answers `want` (200 or 503) with `text` in it.
async fn wait_readyz(admin: SocketAddr, want: u16, text: &str) {
    let what = format!("/readyz to answer {want} with {text:?}");
    eventually(&what, Duration::from_secs(20), async || {
        let (code, body) = http_get(admin, "/readyz").await;
        ok_if(code == want && body.contains(text), || {
            format!("{code} {body}")
        })
    })
    .await;
}

/// A fresh PKI, its client files, and nginx serving as the API server for
/// `ALPHA` (see `nginx_apiserver`), listening.
async fn apiserver() -> (
    tempfile::TempDir,
    seedlink::demo::ClientFiles,
    Proc,
    SocketAddr,
) {
    let pki = seedlink::demo::Pki::generate(&[ALPHA]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let files = write_pki(&pki, dir.path());
    let (cert, key) = pki.write_server_files(0, dir.path()).unwrap();
    let api: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let nginx = nginx_apiserver(dir.path(), api.port(), &cert, &key, &files.ca);
    wait_listening(api).await;
    (dir, files, nginx, api)
}

/// The gateway the egress tests' node-proxies reach: a CONNECT listener
/// and a PROXY listener routing by TLV 0x20, and control plane `alpha`
/// served by `api`; `more` adds control planes.
fn egress_gateway(api: SocketAddr, more: &str) -> Gw {
    Gw::start(&format!(
        "admin: {{listen: '127.0.0.1:0'}}
listeners:
  - {{name: connect, address: '127.0.0.1:0', protocol: http-connect}}
  - {{name: nodes, address: '127.0.0.1:0', protocol: proxy, route_by_tlv: 0x20}}
control_planes:
  - name: alpha
    endpoints: ['{api}']
    destinations: [{{name: '{DEST}'}}]
    cluster_id: 3f1b2c4d-5e6f-4a1b-8c9d-0e1f2a3b4c5d
{more}"
    ))
}

async fn metric(admin: SocketAddr, prefix: &str) -> f64 {
    sum_metric(&http_get(admin, "/metrics").await.1, prefix)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_mode_through_tinyproxy_with_health_checks_and_the_cluster_id_tlv() {
    let (dir, files, _nginx, api) = apiserver().await;
    // A control plane whose API server is down: its endpoint refuses.
    let dead = format!("127.0.0.1:{}", free_port());
    let gw = egress_gateway(
        api,
        &format!("  - {{name: down, endpoints: ['{dead}'], cluster_id: c-down}}\n"),
    );
    let (connect, nodes) = (gw.listener("connect"), gw.listener("nodes"));
    let tp_port = free_port();
    let tp = tinyproxy(dir.path(), tp_port, &[connect.port(), nodes.port()]);
    wait_listening(format!("127.0.0.1:{tp_port}").parse().unwrap()).await;
    let creds = dir.path().join("proxy-credentials");
    std::fs::write(&creds, "user:s3cret-pw\n").unwrap();
    let bad_creds = dir.path().join("bad-credentials");
    std::fs::write(&bad_creds, "user:wrong\n").unwrap();
    let via = Via {
        net: "127.0.0",
        egress: format!("http://127.0.0.1:{tp_port}"),
        proxy_ca: None,
        creds: creds.display().to_string(),
        bad_creds: bad_creds.display().to_string(),
        ca: files.ca.display().to_string(),
        connect: connect.to_string(),
        nodes: nodes.to_string(),
    };
    let tlv = every_mode_serves_through_the_proxy(&via, &files, &gw).await;
    // Every gateway connection went through the proxy.
    let log = std::fs::read_to_string(dir.path().join("tinyproxy.log")).unwrap();
    for port in [connect.port(), nodes.port()] {
        assert!(
            log.contains(&format!("CONNECT 127.0.0.1:{port}")),
            "tinyproxy saw no CONNECT to {port}:\n{log}"
        );
    }
    a_down_api_server_or_a_failing_path_is_not_ready(&via).await;
    wrong_proxy_credentials_are_counted_and_shown(&via, &files).await;
    rotated_proxy_credentials_are_taken_without_a_restart(&via, &files).await;
    // The egress proxy goes away: the TLV node falls unready within its
    // fall count, and says why.
    drop(tp);
    wait_readyz(tlv.admin, 503, "last_check=egress_proxy_unreachable").await;
}

/// The corporate proxy on an https:// address (Squid's `https_port`,
/// Basic credentials checked by its own helper): TLS to the proxy,
/// verified against its CA and its IP address; CONNECT inside it; the
/// node-proxy's tunnel to the gateway inside that. Every mode serves;
/// wrong and rotated credentials behave as through a cleartext proxy; a
/// node-proxy that trusts another CA refuses the proxy
/// (`egress_proxy_tls_failed`) and says so on `/readyz`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_mode_through_an_https_proxy() {
    let (dir, files, _nginx, api) = apiserver().await;
    let gw = egress_gateway(api, "");
    let (connect, nodes) = (gw.listener("connect"), gw.listener("nodes"));
    let listen: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let squid = common::squid::Squid::files(dir.path(), listen, &[connect.port(), nodes.port()]);
    let _squid = squid.spawn();
    wait_listening(listen).await;
    let creds = dir.path().join("proxy-credentials");
    std::fs::write(&creds, format!("user:{}\n", common::squid::PASSWORD)).unwrap();
    let bad_creds = dir.path().join("bad-credentials");
    std::fs::write(&bad_creds, "user:wrong\n").unwrap();
    let via = Via {
        net: "127.0.1",
        egress: format!("https://{listen}"),
        proxy_ca: Some(squid.ca.display().to_string()),
        creds: creds.display().to_string(),
        bad_creds: bad_creds.display().to_string(),
        ca: files.ca.display().to_string(),
        connect: connect.to_string(),
        nodes: nodes.to_string(),
    };
    every_mode_serves_through_the_proxy(&via, &files, &gw).await;
    let seen = squid.seen();
    for port in [connect.port(), nodes.port()] {
        assert!(
            seen.contains(&format!("CONNECT 127.0.0.1:{port}")),
            "Squid saw no CONNECT to {port}:\n{seen}"
        );
    }
    wrong_proxy_credentials_are_counted_and_shown(&via, &files).await;
    rotated_proxy_credentials_are_taken_without_a_restart(&via, &files).await;
    // The proxy's certificate checked against another CA: refused.
    let distrusting = Via {
        proxy_ca: Some(files.ca.display().to_string()),
        ..via
    };
    let np = distrusting.start(
        &distrusting.addr(89),
        &["--gateway", &distrusting.connect, "--destination", DEST],
    );
    wait_readyz(np.admin, 503, "last_check=egress_proxy_tls_failed").await;
    let out = curl_mtls(&files, ALPHA, np.listen.ip(), np.listen.port());
    assert!(!out.contains("hello from"), "{out}");
}

/// What the node-proxies of the tinyproxy test share: the egress proxy and
/// its credentials (good and bad), the CA the checks verify against, and
/// the gateway's two listeners.
struct Via {
    /// The first three octets of the node-proxies' loopback addresses
    /// (each test its own).
    net: &'static str,
    egress: String,
    /// `--egress-proxy-ca-file`, for an https:// proxy.
    proxy_ca: Option<String>,
    creds: String,
    bad_creds: String,
    ca: String,
    connect: String,
    nodes: String,
}

impl Via {
    /// The node-proxy address `<net>.<host>`.
    fn addr(&self, host: u8) -> String {
        format!("{}.{host}", self.net)
    }

    /// `--egress-proxy` and, for an https:// proxy, its CA file.
    fn proxy_args(&self) -> Vec<&str> {
        let mut args = vec!["--egress-proxy", self.egress.as_str()];
        if let Some(ca) = &self.proxy_ca {
            args.extend_from_slice(&["--egress-proxy-ca-file", ca.as_str()]);
        }
        args
    }

    /// A node-proxy on `addr` in `connect` mode through the egress proxy
    /// with the credentials in `creds`, and `extra`.
    fn connect_with(&self, addr: &str, creds: &str, extra: &[&str]) -> NodeProxyProc {
        let mut args = vec![
            "--address",
            addr,
            "--mode",
            "connect",
            "--gateway",
            &self.connect,
            "--destination",
            DEST,
            "--egress-proxy-credentials-file",
            creds,
        ];
        args.extend(self.proxy_args());
        args.extend_from_slice(extra);
        node_proxy(&args)
    }

    /// A node-proxy on `addr` through the egress proxy with the good
    /// credentials and fast health checks (rise 1, fall 2, every 0.2 s).
    fn start(&self, addr: &str, extra: &[&str]) -> NodeProxyProc {
        let mut args = self.proxy_args();
        args.extend_from_slice(&[
            "--egress-proxy-credentials-file",
            &self.creds,
            "--health-check-interval",
            "0.2",
            "--health-check-rise",
            "1",
            "--health-check-fall",
            "2",
        ]);
        args.extend_from_slice(extra);
        args.extend_from_slice(&["--address", addr]);
        node_proxy(&args)
    }
}

/// HyperShift's node path (PROXY v2 + TLV 0x20, TLS untouched, readiness
/// following `GET /version` verified against the CA), GEP-30's CONNECT and
/// Kubermatic's HTTP/2 CONNECT (readiness following the gateway's 200), all
/// through the egress proxy. The TLV node, kept for the last step.
async fn every_mode_serves_through_the_proxy(
    via: &Via,
    files: &seedlink::demo::ClientFiles,
    gw: &Gw,
) -> NodeProxyProc {
    let tlv = via.start(
        &via.addr(81),
        &[
            "--mode",
            "proxy-v2",
            "--gateway",
            &via.nodes,
            "--cluster-id",
            "3f1b2c4d-5e6f-4a1b-8c9d-0e1f2a3b4c5d",
            "--health-check",
            "http",
            "--health-check-ca",
            &via.ca,
            "--health-check-server-name",
            ALPHA,
        ],
    );
    let tunnel = |addr: &str, mode: &str| {
        via.start(
            addr,
            &[
                "--mode",
                mode,
                "--gateway",
                &via.connect,
                "--destination",
                DEST,
                "--health-check",
                "tunnel",
            ],
        )
    };
    let (h1, h2) = (
        tunnel(&via.addr(82), "connect"),
        tunnel(&via.addr(83), "http2-connect"),
    );
    for np in [&tlv, &h1, &h2] {
        wait_readyz(np.admin, 200, "ready").await;
        let out = curl_mtls(files, ALPHA, np.listen.ip(), np.listen.port());
        assert!(
            out.contains("hello from nginx") && out.contains("client_verify=SUCCESS"),
            "through {}: {out}",
            np.listen
        );
    }
    assert!(
        metric(
            tlv.admin,
            "seedlink_node_proxy_health_checks_total{result=\"ok\"}"
        )
        .await
            >= 1.0
    );
    gw.wait_metric(
        "seedlink_gateway_routed_total{listener=\"nodes\",protocol=\"proxy-tlv\",control_plane=\"alpha\"}",
        1.0,
    )
    .await;
    tlv
}

/// A down API server: the TLV routes, the gateway accepts, the TLS check
/// fails and the node is not ready; an `http` check of a path answered 503
/// fails too, while the same node with a TLS check is ready.
async fn a_down_api_server_or_a_failing_path_is_not_ready(via: &Via) {
    let tlv = |addr: &str, cluster: &str, check: &[&str]| {
        let mut args = vec![
            "--mode",
            "proxy-v2",
            "--gateway",
            &via.nodes,
            "--cluster-id",
            cluster,
        ];
        args.extend_from_slice(check);
        via.start(addr, &args)
    };
    let down = tlv(&via.addr(84), "c-down", &["--health-check", "tls"]);
    wait_readyz(down.admin, 503, "last_check=tls_handshake").await;
    let alpha = "3f1b2c4d-5e6f-4a1b-8c9d-0e1f2a3b4c5d";
    let http_broken = ["--health-check", "http", "--health-check-path", "/broken"];
    let broken = tlv(&via.addr(85), alpha, &http_broken);
    wait_readyz(broken.admin, 503, "last_check=http_status_503").await;
    let tls_only = tlv(&via.addr(86), alpha, &["--health-check", "tls"]);
    wait_readyz(tls_only.admin, 200, "ready").await;
}

/// Wrong proxy credentials: 407, counted and shown, the client closed.
async fn wrong_proxy_credentials_are_counted_and_shown(
    via: &Via,
    files: &seedlink::demo::ClientFiles,
) {
    let bad = via.connect_with(&via.addr(87), &via.bad_creds, &[]);
    wait_readyz(bad.admin, 503, "last_check=egress_proxy_auth_failed").await;
    let out = curl_mtls(files, ALPHA, bad.listen.ip(), bad.listen.port());
    assert!(!out.contains("hello from"), "{out}");
    assert_eq!(
        metric(
            bad.admin,
            "seedlink_node_proxy_tunnels_total{outcome=\"egress_proxy_auth_failed\"}"
        )
        .await,
        1.0
    );
}

/// The proxy's credentials rotated in their file are taken without a
/// restart: a node-proxy whose file holds a wrong password is refused
/// (tinyproxy answers 401); once the file holds the right one, its next connections
/// through the proxy (health checks, clients) pass.
async fn rotated_proxy_credentials_are_taken_without_a_restart(
    via: &Via,
    files: &seedlink::demo::ClientFiles,
) {
    let rotating = std::path::Path::new(&via.creds).with_file_name("rotating-credentials");
    std::fs::write(&rotating, "user:wrong\n").unwrap();
    let fast = ["--health-check-interval", "0.2", "--health-check-rise", "1"];
    let np = via.connect_with(&via.addr(88), rotating.to_str().unwrap(), &fast);
    wait_readyz(np.admin, 503, "last_check=egress_proxy_auth_failed").await;
    std::fs::write(&rotating, "user:s3cret-pw\n").unwrap();
    wait_readyz(np.admin, 200, "ready").await;
    let out = curl_mtls(files, ALPHA, np.listen.ip(), np.listen.port());
    assert!(out.contains("hello from"), "{out}");
}

/// HyperShift's shared ingress as HyperShift configures it: HAProxy 3.0
/// (trixie) with `accept-proxy`, one `fc_pp_tlv(0x20)` ACL per hosted
/// cluster ANDed with its source CIDRs, unmatched connections rejected. The
/// seedlink node-proxy in `proxy-v2` mode with the cluster ID reaches the
/// right API server with TLS and the client certificate end to end; a node
/// with an unknown ID is rejected, and its `tls` check says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_proxy_through_haproxy3_as_hypershift_shared_ingress() {
    let (dir, files, _nginx, api) = apiserver().await;
    let api_port = api.port();
    let ingress = free_port();
    let id = "3f1b2c4d-5e6f-4a1b-8c9d-0e1f2a3b4c5d";
    let _hap = haproxy3_run(
        dir.path(),
        "shared-ingress",
        &format!(
            "defaults
  mode tcp
  timeout connect 10s
  timeout client 86400s
  timeout server 86400s
frontend nodes
  bind 127.0.0.1:{ingress} accept-proxy
  tcp-request content reject if !{{ fc_pp_tlv(0x20) -m found }}
  acl guest1 fc_pp_tlv(0x20) -m str {id}
  acl guest1_src src 127.0.0.0/8
  use_backend guest1 if guest1 guest1_src
  default_backend no_match
backend no_match
  tcp-request content reject
backend guest1
  server kas 127.0.0.1:{api_port}
"
        ),
    );
    let gw = format!("127.0.0.1:{ingress}");
    wait_listening(gw.parse().unwrap()).await;
    let node = node_proxy(&[
        "--address",
        "127.0.0.91",
        "--mode",
        "proxy-v2",
        "--gateway",
        &gw,
        "--cluster-id",
        id,
        "--health-check",
        "http",
        "--health-check-ca",
        files.ca.to_str().unwrap(),
        "--health-check-server-name",
        ALPHA,
    ]);
    wait_readyz(node.admin, 200, "ready").await;
    let out = curl_mtls(&files, ALPHA, node.listen.ip(), node.listen.port());
    assert!(
        out.contains("hello from nginx") && out.contains("client_verify=SUCCESS"),
        "{out}"
    );
    let stranger = node_proxy(&[
        "--address",
        "127.0.0.92",
        "--mode",
        "proxy-v2",
        "--gateway",
        &gw,
        "--cluster-id",
        "c-unknown",
        "--health-check",
        "tls",
        "--health-check-interval",
        "0.2",
    ]);
    wait_readyz(stranger.admin, 503, "last_check=tls_handshake").await;
    let out = curl_mtls(&files, ALPHA, stranger.listen.ip(), stranger.listen.port());
    assert!(!out.contains("hello from"), "{out}");
}

#[test]
fn egress_and_health_check_settings_are_checked() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("np.yaml");
    let check = |yaml: &str| {
        std::fs::write(&file, yaml).unwrap();
        let out = check_config(&file);
        (
            out.status.success(),
            format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        )
    };
    let base = "address: 10.0.0.1\ngateway: 'seed.example:8443'\n";
    for (extra, key) in [
        ("mode: connect\ndestination: 'outbound|443||kube-apiserver.a.svc.cluster.local'\ncluster_id: x\n", "cluster_id"),
        ("mode: proxy-v2\ncluster_id: 'has space'\n", "cluster_id"),
        ("mode: proxy-v2\ncluster_id_tlv: 3\n", "cluster_id_tlv"),
        ("mode: proxy-v2\negress_proxy: 'http://u:p@proxy:3128'\n", "egress_proxy"),
        ("mode: proxy-v2\negress_proxy: 'socks5://proxy:1080'\n", "egress_proxy"),
        ("mode: proxy-v2\negress_proxy: 'http://proxy:3128'\negress_proxy_ca_file: /x.pem\n", "egress_proxy_ca_file"),
        ("mode: proxy-v2\negress_proxy: 'https://proxy:3129'\negress_proxy_ca_file: /nonexistent.pem\n", "egress_proxy_ca_file"),
        ("mode: proxy-v2\negress_proxy_ca_file: /x.pem\n", "egress_proxy_ca_file"),
        ("mode: proxy-v2\negress_proxy_credentials_file: /nonexistent\n", "egress_proxy_credentials_file"),
        ("mode: proxy-v2\negress_proxy: 'proxy:3128'\negress_proxy_credentials_file: /nonexistent\n", "egress_proxy_credentials_file"),
        ("mode: proxy-v2\nhealth_check: tunnel\n", "health_check"),
        ("mode: http2-connect\ndestination: 'outbound|443||kube-apiserver.a.svc.cluster.local'\nhealth_check: http\n", "health_check"),
        ("mode: proxy-v2\nhealth_check: tcp\nhealth_check_ca: /x.pem\n", "health_check_ca"),
        ("mode: proxy-v2\nhealth_check: tls\nhealth_check_ca: /nonexistent.pem\n", "health_check_ca"),
        ("mode: proxy-v2\nhealth_check: http\nhealth_check_path: 'version'\n", "health_check_path"),
        ("mode: proxy-v2\nhealth_check_fall: 0\n", "health_check_fall"),
        ("mode: proxy-v2\nhealth_check: ping\n", "health_check"),
    ] {
        let (ok, out) = check(&format!("{base}{extra}"));
        assert!(!ok && out.contains(key), "{extra}: {out}");
    }
    let creds = dir.path().join("creds");
    std::fs::write(&creds, "user:pass:with:colons\n").unwrap();
    let (ok, out) = check(&format!(
        "{base}mode: proxy-v2\ncluster_id: 3f1b2c4d-5e6f-4a1b-8c9d-0e1f2a3b4c5d\ncluster_id_tlv: 0xE0\n\
         egress_proxy: 'http://proxy.corp.example:3128'\negress_proxy_credentials_file: '{}'\n\
         health_check: http\nhealth_check_interval: 10s\nhealth_check_rise: 3\nhealth_check_fall: 3\n",
        creds.display()
    ));
    assert!(ok, "{out}");
}

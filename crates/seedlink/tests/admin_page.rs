//! The operator's live page, in a real browser: headless Chromium loads
//! the admin page of a running tunnel-server (three clusters: two agents,
//! one agent, none) and of a gateway (a served control plane, one that
//! denies us by ACL, one whose only endpoint is down), and the rendered
//! DOM must show each one's state. Screenshots are kept in
//! `target/test-artifacts/` for people to look at.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use seedlink_testkit as common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::tunnel_env::{kas_connect, kas_connect_eventually, ready_line};
use common::*;
use tokio_util::sync::CancellationToken;

fn artifacts() -> PathBuf {
    let d = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/test-artifacts");
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Chromium, headless, on `url`: the DOM after the page's scripts ran, and
/// a screenshot written to `png`.
fn chromium(url: &str, png: &Path) -> String {
    let bin = require("chromium");
    let profile = tempfile::tempdir().unwrap();
    let run = |extra: &[&str]| {
        let out = Command::new(&bin)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
            ])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .args([
                "--window-size=1500,1100",
                "--virtual-time-budget=4000",
                "--timeout=20000",
            ])
            .args(extra)
            .arg(url)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "chromium {extra:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let dom = run(&["--dump-dom"]);
    run(&[&format!("--screenshot={}", png.display())]);
    let size = std::fs::metadata(png).map(|m| m.len()).unwrap_or(0);
    assert!(
        size > 10_000,
        "screenshot {} is {size} bytes",
        png.display()
    );
    dom
}

/// The opening tag of the element carrying `attr="value"`.
fn tag<'a>(dom: &'a str, attr: &str, value: &str) -> &'a str {
    let needle = format!("{attr}=\"{value}\"");
    let at = dom
        .find(&needle)
        .unwrap_or_else(|| panic!("no element with {needle} in the DOM:\n{dom}"));
    let start = dom[..at].rfind('<').unwrap();
    let end = at + dom[at..].find('>').unwrap();
    &dom[start..=end]
}

/// The text of the table row carrying `attr="value"` (up to `</tr>`).
fn row<'a>(dom: &'a str, attr: &str, value: &str) -> &'a str {
    let t = tag(dom, attr, value);
    let start = dom.find(t).unwrap();
    let end = start + dom[start..].find("</tr>").unwrap();
    &dom[start..end]
}

fn agent(
    server: &str,
    seed_ca: &str,
    cert: &str,
    key: &str,
    id: &str,
    ids: &str,
) -> (Proc, std::net::SocketAddr) {
    let mut child = seedlink_testkit::agent_cmd::AgentCmd::new(server)
        .mtls(seed_ca, cert, key)
        .args(["--agent-id", id, "--agent-identifiers", ids])
        .fast_sync()
        .command()
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let ready = ready_line(&mut child);
    assert_eq!(ready["event"], "ready", "{ready}");
    (
        Proc(child),
        ready["admin"].as_str().unwrap().parse().unwrap(),
    )
}

/// The tunnel-server's file for three clusters (a and b HTTP CONNECT, c
/// gRPC, each on a Unix socket in `d`), each with its own agent CA: the
/// file, the seed CA the agents trust, and each shoot's (CA, certificate,
/// key) files.
fn three_clusters(
    d: &std::path::Path,
) -> (std::path::PathBuf, String, Vec<(String, String, String)>) {
    let w = |name: &str, text: &str| {
        std::fs::write(d.join(name), text).unwrap();
        d.join(name).display().to_string()
    };
    let seed = seedlink::demo::Pki::generate(&["tunnel.seedlink.test"]).unwrap();
    let seed_ca = w("seed-ca.pem", &seed.ca_pem);
    let (tun_crt, tun_key) = (
        w("tun.pem", &seed.servers[0].1.cert_pem),
        w("tun-key.pem", &seed.servers[0].1.key_pem),
    );
    let mut shoots = Vec::new();
    for s in ["a", "b", "c"] {
        let pki = seedlink::demo::Pki::generate(&[]).unwrap();
        let ca = w(&format!("{s}-ca.pem"), &pki.ca_pem);
        let crt = w(&format!("{s}.pem"), &pki.client.cert_pem);
        let key = w(&format!("{s}-key.pem"), &pki.client.key_pem);
        shoots.push((ca, crt, key));
    }
    let config = d.join("tunnel.yaml");
    std::fs::write(
        &config,
        format!(
            "agents: {{listen: '127.0.0.1:0', cert: '{tun_crt}', key: '{tun_key}'}}
admin: {{listen: '127.0.0.1:0'}}
dial_timeout: 5s
clusters:
  - {{name: shoot--dev--a, agent_ca: '{}', frontends: [{{name: kas, protocol: http-connect, unix: '{}/a.sock'}}]}}
  - {{name: shoot--dev--b, agent_ca: '{}', frontends: [{{name: kas, protocol: http-connect, unix: '{}/b.sock'}}]}}
  - {{name: shoot--dev--c, agent_ca: '{}', frontends: [{{name: kas, protocol: grpc, unix: '{}/c.sock'}}]}}
",
            shoots[0].0,
            d.display(),
            shoots[1].0,
            d.display(),
            shoots[2].0,
            d.display()
        ),
    )
    .unwrap();
    (config, seed_ca, shoots)
}

/// The tunnel-server's page: c without an agent, a's two agents with their
/// identifiers and open tunnel, b's agent and its failed dial.
fn the_tunnel_page_shows_each_cluster(dom: &str) {
    let c = tag(dom, "data-cluster", "shoot--dev--c");
    assert!(
        c.contains("data-state=\"no-agents\"") && c.contains("data-agents=\"0\""),
        "{c}"
    );
    assert!(row(dom, "data-cluster", "shoot--dev--c").contains("NO AGENT"));
    let a_row = row(dom, "data-cluster", "shoot--dev--a");
    assert!(
        tag(dom, "data-cluster", "shoot--dev--a").contains("data-agents=\"2\""),
        "{a_row}"
    );
    assert!(
        a_row.contains("a-node-1")
            && a_row.contains("a-node-2")
            && a_row.contains("host=node-1.shoot-a"),
        "{a_row}"
    );
    let b_row = row(dom, "data-cluster", "shoot--dev--b");
    assert!(
        b_row.contains("b-node-1") && b_row.contains("default-route=true"),
        "{b_row}"
    );
    assert!(
        b_row.contains("error_response") || b_row.contains("dial"),
        "b's failed dial is not shown: {b_row}"
    );
    assert!(a_row.contains("kas (HttpConnect"), "{a_row}");
}

/// The gateway's page: alpha serving with its open connection, beta's ACL
/// refusal, gamma's ejected endpoint.
fn the_gateway_page_shows_each_control_plane(dom: &str) {
    let alpha_row = row(dom, "data-control-plane", "shoot--dev--alpha");
    assert!(
        tag(dom, "data-control-plane", "shoot--dev--alpha").contains("data-state=\"ok\""),
        "{alpha_row}"
    );
    assert!(
        alpha_row.contains("api.alpha.page.test") && alpha_row.contains("ok 1"),
        "{alpha_row}"
    );
    assert!(
        alpha_row.contains("tls / tls-sni: 1"),
        "the open connection: {alpha_row}"
    );
    let beta_row = row(dom, "data-control-plane", "shoot--dev--beta");
    assert!(
        beta_row.contains("192.0.2.0/24") && beta_row.contains("acl_denied 1"),
        "{beta_row}"
    );
    let gamma_row = row(dom, "data-control-plane", "shoot--dev--gamma");
    assert!(gamma_row.contains("ejected"), "{gamma_row}");
    assert!(
        tag(dom, "data-control-plane", "shoot--dev--gamma").contains("data-state=\"no-agents\""),
        "{gamma_row}"
    );
}

/// The gateway's metrics after the three requests: every control plane
/// has its gauges, the ejected endpoint is counted, connect and connection
/// times too.
fn the_gateway_metrics_show_each_control_plane(m: &str) {
    for cp in ["alpha", "beta", "gamma"] {
        assert!(m.contains(&format!("seedlink_gateway_control_plane_active_connections{{control_plane=\"shoot--dev--{cp}\"}} 0")), "{cp}:\n{m}");
    }
    assert_eq!(sum_metric(m, "seedlink_gateway_upstream_endpoints{control_plane=\"shoot--dev--gamma\",state=\"ejected\"}"), 1.0, "{m}");
    assert_eq!(
        sum_metric(
            m,
            "seedlink_gateway_upstream_endpoints{control_plane=\"shoot--dev--alpha\",state=\"up\"}"
        ),
        1.0,
        "{m}"
    );
    assert!(
        sum_metric(
            m,
            "seedlink_gateway_upstream_connect_duration_seconds_count"
        ) >= 1.0,
        "{m}"
    );
    assert!(
        sum_metric(
            m,
            "seedlink_gateway_connection_duration_seconds_count{listener=\"tls\"}"
        ) >= 3.0,
        "{m}"
    );
    assert!(m.contains("seedlink_build_info{"), "{m}");
}

/// alpha served, beta denied by its ACL, gamma's endpoint down; the
/// gateway has counted each connection.
async fn served_denied_and_down(gw: &Gw, cfg: &impl Fn() -> rustls::ClientConfig) {
    assert!(
        seedlink::demo::https_get(gw.tls, "api.alpha.page.test", cfg())
            .await
            .unwrap()
            .contains("hello from alpha")
    );
    assert!(
        seedlink::demo::https_get(gw.tls, "api.beta.page.test", cfg())
            .await
            .is_err()
    );
    assert!(
        seedlink::demo::https_get(gw.tls, "api.gamma.page.test", cfg())
            .await
            .is_err()
    );
    gw.wait_metric(
        "seedlink_gateway_connections_total{listener=\"tls\",control_plane=\"shoot--dev--gamma\"",
        1.0,
    )
    .await;
    // alpha's connection ended at the client; the gateway counts it once
    // it has seen the close, which may come after gamma's refusal.
    gw.wait_metric(
        "seedlink_gateway_connections_total{listener=\"tls\",control_plane=\"shoot--dev--alpha\"",
        1.0,
    )
    .await;
}

/// Two agents of cluster a and one of b, with their identifiers.
fn three_agents(
    server: &str,
    seed_ca: &str,
    a: &(String, String, String),
    b: &(String, String, String),
) -> [(Proc, std::net::SocketAddr); 3] {
    [
        agent(
            server,
            seed_ca,
            &a.1,
            &a.2,
            "a-node-1",
            "host=node-1.shoot-a",
        ),
        agent(
            server,
            seed_ca,
            &a.1,
            &a.2,
            "a-node-2",
            "host=node-2.shoot-a",
        ),
        agent(
            server,
            seed_ca,
            &b.1,
            &b.2,
            "b-node-1",
            "default-route=true",
        ),
    ]
}

/// The gateway's file: alpha served by `alpha`, beta too but behind an ACL
/// that admits nobody here, gamma's one endpoint `down`.
fn three_control_planes(alpha: std::net::SocketAddr, down: std::net::SocketAddr) -> String {
    format!(
        "admin: {{listen: '127.0.0.1:0'}}
listeners: [{{name: tls, address: '127.0.0.1:0'}}]
upstream: {{eject_base: 60s, eject_max: 120s}}
control_planes:
  - {{name: shoot--dev--alpha, hostnames: [api.alpha.page.test], endpoints: ['{alpha}']}}
  - {{name: shoot--dev--beta, hostnames: [api.beta.page.test], endpoints: ['{alpha}'], acl: {{allow: [192.0.2.0/24]}}}}
  - {{name: shoot--dev--gamma, hostnames: [api.gamma.page.test], endpoints: ['{down}']}}
"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_live_page_shows_every_cluster_and_control_plane_in_chromium() {
    let stop = CancellationToken::new();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();

    // --- tunnel-server: three clusters, agents for two of them.
    let (config, seed_ca, shoots) = three_clusters(d);
    let mut server = Command::new(seedlink_bin())
        .args(["tunnel-server", "--config"])
        .arg(&config)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let ready = ready_line(&mut server);
    let _server = Proc(server);
    let agents_at = ready["agents"].as_str().unwrap().to_string();
    let tunnel_admin = ready["admin"].as_str().unwrap().to_string();
    let (a, b) = (&shoots[0], &shoots[1]);
    // Every role's `/config`: the tunnel-server's, and an agent's below.
    let admin_addr: std::net::SocketAddr = tunnel_admin.parse().unwrap();
    let (code, body) = http_get(admin_addr, "/config").await;
    assert_eq!(code, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        v["config"]["clusters"][2]["name"], "shoot--dev--c",
        "{body}"
    );
    assert_eq!(v["generation"], 1);
    let agents = three_agents(&agents_at, &seed_ca, a, b);
    let (code, body) = http_get(agents[0].1, "/config").await;
    assert_eq!(code, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        v["config"]["agent_identifiers"], "host=node-1.shoot-a",
        "{body}"
    );
    // An open tunnel through a, and a failed dial (a closed port) through b.
    // Agents print their ready line before they reach the server: wait
    // (bounded) until the server holds all three streams.
    eventually(
        "the agents to connect",
        Duration::from_secs(20),
        async || {
            let m = http_get(admin_addr, "/metrics").await.1;
            let agents = |c: &str| {
                sum_metric(
                    &m,
                    &format!("seedlink_tunnel_server_agents{{cluster=\"{c}\"}}"),
                )
            };
            ok_if(
                agents("shoot--dev--a") == 2.0 && agents("shoot--dev--b") == 1.0,
                || m.clone(),
            )
        },
    )
    .await;
    let echo = echo_backend(&stop).await;
    let sock_a = d.join("a.sock").display().to_string();
    let mut open =
        kas_connect_eventually(&sock_a, &echo.to_string(), Duration::from_secs(20)).await;
    common::tunnel_env::echo_rtt(&mut open, 100).await;
    let sock_b = d.join("b.sock").display().to_string();
    let _ = kas_connect_eventually(&sock_b, &echo.to_string(), Duration::from_secs(20)).await;
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    assert!(kas_connect(&sock_b, &closed.to_string()).await.is_err());

    // --- gateway: served, denied by ACL, endpoint down.
    let pki = std::sync::Arc::new(
        seedlink::demo::Pki::generate(&[
            "api.alpha.page.test",
            "api.beta.page.test",
            "api.gamma.page.test",
        ])
        .unwrap(),
    );
    let alpha = demo_backend(&pki, 0, "alpha", &stop).await;
    let down = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let gw = Gw::start(&three_control_planes(alpha, down));
    let cfg = || pki.client_config(true, &[]).unwrap();
    served_denied_and_down(&gw, &cfg).await;
    the_gateway_metrics_show_each_control_plane(&gw.metrics().await);

    // A connection held open through alpha (TLS done end to end, no
    // request yet): the page shows it by listener and protocol.
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(cfg()));
    let held = connector
        .connect(
            rustls::pki_types::ServerName::try_from("api.alpha.page.test").unwrap(),
            tokio::net::TcpStream::connect(gw.tls).await.unwrap(),
        )
        .await
        .unwrap();
    gw.wait_metric(
        "seedlink_gateway_routed_active_connections{listener=\"tls\",protocol=\"tls-sni\",control_plane=\"shoot--dev--alpha\"}",
        1.0,
    )
    .await;

    // --- the pages, in Chromium.
    let art = artifacts();
    let dom = tokio::task::spawn_blocking({
        let (url, png) = (
            format!("http://{tunnel_admin}/"),
            art.join("admin-page-tunnel-server.png"),
        );
        move || chromium(&url, &png)
    })
    .await
    .unwrap();
    assert!(
        dom.contains("data-loaded=\"true\""),
        "the page did not render:\n{dom}"
    );
    the_tunnel_page_shows_each_cluster(&dom);

    let dom = tokio::task::spawn_blocking({
        let (url, png) = (
            format!("http://{}/", gw.admin),
            art.join("admin-page-gateway.png"),
        );
        move || chromium(&url, &png)
    })
    .await
    .unwrap();
    assert!(
        dom.contains("data-loaded=\"true\""),
        "the page did not render:\n{dom}"
    );
    the_gateway_page_shows_each_control_plane(&dom);
    drop(open);
    drop(held);
    stop.cancel();
}

fn curl_status(url: &str, token: Option<&str>) -> String {
    let mut cmd = Command::new(require("curl"));
    cmd.args([
        "-s",
        "-o",
        "/dev/null",
        "-w",
        "%{http_code}",
        "--max-time",
        "10",
    ]);
    if let Some(t) = token {
        cmd.args(["-H", &format!("Authorization: Bearer {t}")]);
    }
    let out = cmd.arg(url).output().unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_an_admin_token_only_the_probes_are_open() {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("admin-token");
    std::fs::write(&token, "s3cr3t-admin-token\n").unwrap();
    let gw = Gw::start(&format!(
        "admin: {{listen: '127.0.0.1:0', token_file: '{}'}}
listeners: [{{name: tls, address: '127.0.0.1:0'}}]
",
        token.display()
    ));
    // The tunnel-server too.
    let seed = seedlink::demo::Pki::generate(&["tunnel.seedlink.test"]).unwrap();
    let shoot = seedlink::demo::Pki::generate(&[]).unwrap();
    let w = |name: &str, text: &str| {
        std::fs::write(dir.path().join(name), text).unwrap();
        dir.path().join(name).display().to_string()
    };
    let config = dir.path().join("tunnel.yaml");
    std::fs::write(
        &config,
        format!(
            "agents: {{listen: '127.0.0.1:0', cert: '{}', key: '{}'}}
admin: {{listen: '127.0.0.1:0', token_file: '{}'}}
clusters: [{{name: a, agent_ca: '{}'}}]
",
            w("tun.pem", &seed.servers[0].1.cert_pem),
            w("tun-key.pem", &seed.servers[0].1.key_pem),
            token.display(),
            w("a-ca.pem", &shoot.ca_pem),
        ),
    )
    .unwrap();
    let mut server = Command::new(seedlink_bin())
        .args(["tunnel-server", "--config"])
        .arg(&config)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let ready = ready_line(&mut server);
    let _server = Proc(server);
    let tunnel_admin = ready["admin"].as_str().unwrap().to_string();
    // And an agent's.
    let mut agent = seedlink_testkit::agent_cmd::AgentCmd::new(ready["agents"].as_str().unwrap())
        .mtls(
            &w("seed-ca.pem", &seed.ca_pem),
            &w("a.pem", &shoot.client.cert_pem),
            &w("a-key.pem", &shoot.client.key_pem),
        )
        .args(["--admin-token-file", token.to_str().unwrap()])
        .command()
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let agent_ready = ready_line(&mut agent);
    let _agent = Proc(agent);
    let agent_admin = agent_ready["admin"].as_str().unwrap().to_string();
    for admin in [gw.admin.to_string(), tunnel_admin, agent_admin.clone()] {
        for path in ["/metrics", "/config", "/api/state"] {
            if admin == agent_admin && path == "/api/state" {
                continue;
            }
            let url = format!("http://{admin}{path}");
            assert_eq!(curl_status(&url, None), "401", "{url} without a token");
            assert_eq!(
                curl_status(&url, Some("wrong")),
                "401",
                "{url} with a wrong token"
            );
            assert_eq!(
                curl_status(&url, Some("s3cr3t-admin-token")),
                "200",
                "{url} with the token"
            );
        }
        // Probes and the page's static file need nothing (a kubelet and a
        // browser's first request send no token).
        for path in ["/healthz", "/"] {
            if admin == agent_admin && path == "/" {
                continue;
            }
            assert_eq!(
                curl_status(&format!("http://{admin}{path}"), None),
                "200",
                "{path}"
            );
        }
    }
    // The page sends the token from its URL fragment (which never leaves
    // the browser) and renders; without it, it says it cannot read.
    let with = tokio::task::spawn_blocking({
        let (url, png) = (
            format!("http://{}/#token=s3cr3t-admin-token", gw.admin),
            artifacts().join("admin-page-with-token.png"),
        );
        move || chromium(&url, &png)
    })
    .await
    .unwrap();
    assert!(with.contains("data-loaded=\"true\""), "{with}");
    let without = tokio::task::spawn_blocking({
        let (url, png) = (
            format!("http://{}/", gw.admin),
            artifacts().join("admin-page-without-token.png"),
        );
        move || chromium(&url, &png)
    })
    .await
    .unwrap();
    assert!(
        !without.contains("data-loaded=\"true\"") && without.contains("HTTP 401"),
        "{without}"
    );
}

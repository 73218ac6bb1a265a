//! OpenVPN through the gateway, as Gardener's reversed VPN does: the client
//! (shoot side) uses `http-proxy` with `CUSTOM-HEADER X-Gardener-Destination`
//! to reach the server (seed side) through the gateway's CONNECT listener,
//! each in its own network namespace; a ping crosses the tunnel. The same
//! with the legacy `Reversed-VPN` header on the legacy listener.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use seedlink_testkit as common;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use common::tunnel_env::TunnelEnv;
use common::{eventually_blocking, netns_pair, ok_if, require, Proc};

const DEST: &str = "outbound|1194||vpn-seed-server.shoot--dev--a.svc.cluster.local";

fn wait_log(path: &Path, needle: &str) {
    let what = format!("{needle:?} in {}", path.display());
    eventually_blocking(&what, Duration::from_secs(40), || {
        let log = std::fs::read_to_string(path).unwrap_or_default();
        ok_if(log.contains(needle), || log.clone())
    });
}

/// vpn-seed-server: OpenVPN's TCP server on 127.0.0.1:1194 in `ns`.
fn vpn_seed_server(
    ns: &common::Netns,
    openvpn: &Path,
    ca: &Path,
    (cert, key): (&Path, &Path),
    log: &Path,
) -> Proc {
    let p = |p: &Path| p.to_str().unwrap().to_string();
    let (openvpn, ca, cert, key, log) = (p(openvpn), p(ca), p(cert), p(key), p(log));
    Proc(
        ns.cmd(&[
            &openvpn,
            "--dev",
            "tun",
            "--proto",
            "tcp-server",
            "--local",
            "127.0.0.1",
            "--port",
            "1194",
            "--tls-server",
            "--dh",
            "none",
            "--ca",
            &ca,
            "--cert",
            &cert,
            "--key",
            &key,
            "--ifconfig",
            "198.18.0.1",
            "198.18.0.2",
            "--verb",
            "3",
            "--log",
            &log,
        ])
        .spawn()
        .unwrap(),
    )
}

/// vpn-shoot: OpenVPN's TCP client in `ns`, through the gateway's CONNECT
/// proxy at 198.18.1.2 on `port` with `header` naming the destination, as
/// Gardener configures it.
fn vpn_shoot(
    ns: &common::Netns,
    openvpn: &Path,
    files: &seedlink::demo::ClientFiles,
    (port, header): (&str, &str),
    log: &Path,
) -> Proc {
    vpn_shoot_via(ns, openvpn, files, ("198.18.1.2", port, header), log)
}

/// The same through the gateway at `gateway`.
fn vpn_shoot_via(
    ns: &common::Netns,
    openvpn: &Path,
    files: &seedlink::demo::ClientFiles,
    (gateway, port, header): (&str, &str, &str),
    log: &Path,
) -> Proc {
    let p = |p: &Path| p.to_str().unwrap().to_string();
    let (openvpn, ca, cert, key, log) = (
        p(openvpn),
        p(&files.ca),
        p(&files.cert),
        p(&files.key),
        p(log),
    );
    Proc(
        ns.cmd(&[
            &openvpn,
            "--dev",
            "tun",
            "--proto",
            "tcp-client",
            "--remote",
            gateway,
            "1194",
            "--http-proxy",
            gateway,
            port,
            "--http-proxy-option",
            "CUSTOM-HEADER",
            header,
            DEST,
            "--tls-client",
            "--ca",
            &ca,
            "--cert",
            &cert,
            "--key",
            &key,
            "--ifconfig",
            "198.18.0.2",
            "198.18.0.1",
            "--connect-retry",
            "1",
            "5",
            "--verb",
            "3",
            "--log",
            &log,
        ])
        .spawn()
        .unwrap(),
    )
}

/// The gateway in `ns`, its CONNECT listeners on `ip` (8443 with
/// `X-Gardener-Destination`, 8132 with the legacy `Reversed-VPN` header)
/// leading to vpn-seed-server on the namespace's 127.0.0.1:1194; admin on
/// 127.0.0.1:9901 there. Returned once ready.
fn gateway_in(ns: &common::Netns, dir: &Path, ip: &str) -> Proc {
    let cfg = dir.join("gateway.yaml");
    std::fs::write(
        &cfg,
        format!(
            "admin: {{listen: '127.0.0.1:9901'}}
listeners:
  - {{name: http-proxy, address: '{ip}:8443', protocol: http-connect}}
  - {{name: tls-tunnel, address: '{ip}:8132', protocol: http-connect, destination_header: Reversed-VPN}}
control_planes:
  - name: shoot--dev--a
    endpoints: ['127.0.0.1:1194']
    destinations: [{{name: '{DEST}'}}]
"
        ),
    )
    .unwrap();
    common::gateway_in_netns(ns, &cfg)
}

#[test]
fn openvpn_through_the_gateway_connect_and_legacy_header() {
    let openvpn = require("openvpn");
    require("ping");
    let (client, seed) = netns_pair("c", "s", 1);
    let dir = tempfile::tempdir().unwrap();
    let pki = seedlink::demo::Pki::generate(&["vpn-seed-server"]).unwrap();
    let files = pki.write_client_files(dir.path()).unwrap();
    let (srv_cert, srv_key) = (
        dir.path().join("server.pem"),
        dir.path().join("server-key.pem"),
    );
    std::fs::write(&srv_cert, &pki.servers[0].1.cert_pem).unwrap();
    std::fs::write(&srv_key, &pki.servers[0].1.key_pem).unwrap();

    // The gateway, in the seed namespace.
    let _gw = gateway_in(&seed, dir.path(), "198.18.1.2");

    for (port, header, round) in [
        ("8443", "X-Gardener-Destination", 1),
        ("8132", "Reversed-VPN", 2),
    ] {
        // vpn-seed-server: TCP server on 1194 in the seed namespace.
        let slog = dir.path().join(format!("server{round}.log"));
        let _server = vpn_seed_server(&seed, &openvpn, &files.ca, (&srv_cert, &srv_key), &slog);
        wait_log(&slog, "Listening for incoming TCP connection");
        // vpn-shoot: through the gateway's CONNECT proxy, as Gardener configures it.
        let clog = dir.path().join(format!("client{round}.log"));
        let _vpn = vpn_shoot(&client, &openvpn, &files, (port, header), &clog);
        wait_log(&clog, "Initialization Sequence Completed");
        let ping = client
            .cmd(&["ping", "-c", "3", "-W", "2", "198.18.0.1"])
            .output()
            .unwrap();
        assert!(
            ping.status.success(),
            "ping across the tunnel ({header}): {}{}{}",
            String::from_utf8_lossy(&ping.stdout),
            String::from_utf8_lossy(&ping.stderr),
            std::fs::read_to_string(&clog).unwrap_or_default()
        );
    }
    let metrics = seed.run(&[
        "curl",
        "-s",
        "--max-time",
        "5",
        "http://127.0.0.1:9901/metrics",
    ]);
    for l in [
        "http-proxy\",protocol=\"http-connect:x-gardener-destination\"",
        "tls-tunnel\",protocol=\"http-connect:reversed-vpn\"",
    ] {
        assert!(
            metrics
                .lines()
                .any(|m| m.contains(l) && m.starts_with("seedlink_gateway_routed_total")),
            "{l}\n{metrics}"
        );
    }
}

/// The VPN's PKI in `dir`: the client's files, and the server's
/// certificate and key.
fn vpn_pki(dir: &Path) -> (seedlink::demo::ClientFiles, (PathBuf, PathBuf)) {
    let pki = seedlink::demo::Pki::generate(&["vpn-seed-server"]).unwrap();
    let files = pki.write_client_files(dir).unwrap();
    let (cert, key) = (dir.join("server.pem"), dir.join("server-key.pem"));
    std::fs::write(&cert, &pki.servers[0].1.cert_pem).unwrap();
    std::fs::write(&key, &pki.servers[0].1.key_pem).unwrap();
    (files, (cert, key))
}

/// The shoot's app on its VPN address (198.18.0.2:8001), once it answers
/// there.
fn shoot_app(env: &TunnelEnv) -> Proc {
    let site = env.dir.path().join("site");
    std::fs::create_dir_all(&site).unwrap();
    std::fs::write(site.join("hello.txt"), "hello from the shoot's app\n").unwrap();
    let app = Proc(
        env.shoot
            .cmd(&[
                "python3",
                "-m",
                "http.server",
                "8001",
                "--bind",
                "198.18.0.2",
            ])
            .arg("--directory")
            .arg(&site)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    eventually_blocking("the shoot's app", Duration::from_secs(30), || {
        let out = env
            .shoot
            .cmd(&["curl", "-s", "--max-time", "2", APP])
            .output();
        let out = out.map(|o| String::from_utf8_lossy(&o.stdout).into_owned());
        let out = out.unwrap_or_default();
        ok_if(out.contains("hello from the shoot's app"), || out.clone())
    });
    app
}

/// The shoot's app as the seed reaches it.
const APP: &str = "http://198.18.0.2:8001/hello.txt";

/// curl from the seed to the shoot's app: through the VPN (its route), or
/// through the tunnel (the tunnel-server's mTLS frontend, the agent
/// dialling the same address in the shoot). Whether the app answered.
fn reaches_the_app(env: &TunnelEnv, tunnel: bool) -> bool {
    let f = &env.files;
    let mut cmd = env.seed.cmd(&["curl", "-sS", "--max-time", "10"]);
    if tunnel {
        let proxy = format!("https://frontend.seedlink.test:{}", env.fe_port);
        let resolve = format!("frontend.seedlink.test:{}:127.0.0.1", env.fe_port);
        cmd.args(["-p", "-x", &proxy, "--resolve", &resolve])
            .args(["--proxy-cacert", &f.seed_ca])
            .args(["--proxy-cert", &f.kas_crt, "--proxy-key", &f.kas_key]);
    }
    let out = cmd.arg(APP).output().unwrap();
    String::from_utf8_lossy(&out.stdout).contains("hello from the shoot's app")
}

/// OpenVPN and the tunnel serve one cluster at once: the shoot's app, on
/// its VPN address, is reached from the seed through the reversed VPN (via
/// the gateway's CONNECT listener) and through the tunnel (the agent in
/// the shoot dials the same address). A request loop moves from the VPN
/// to the tunnel and back, 40 requests in each phase: none fails, and the
/// tunnel-server dialled the tunnel phase's.
#[test]
fn openvpn_and_the_tunnel_serve_one_cluster_at_once() {
    let openvpn = require("openvpn");
    let env = TunnelEnv::new(112);
    let ep = env.agent_endpoint(8091);
    let server = env.server(&env.server_yaml(&ep, "", ""), "server");
    let agent = env.agent(&ep, &[]);
    let dir = env.dir.path();
    let (files, server_pair) = vpn_pki(dir);
    let _gw = gateway_in(&env.seed, dir, "198.18.112.1");
    let slog = dir.join("vpn-server.log");
    let _vpn_server = vpn_seed_server(
        &env.seed,
        &openvpn,
        &files.ca,
        (&server_pair.0, &server_pair.1),
        &slog,
    );
    wait_log(&slog, "Listening for incoming TCP connection");
    let clog = dir.join("vpn-client.log");
    let via = ("198.18.112.1", "8443", "X-Gardener-Destination");
    let _vpn = vpn_shoot_via(&env.shoot, &openvpn, &files, via, &clog);
    wait_log(&clog, "Initialization Sequence Completed");
    let _app = shoot_app(&env);
    eventually_blocking("the agent to join", Duration::from_secs(30), || {
        let n = env.agent_metric(
            &agent.admin(),
            "seedlink_tunnel_agent_open_server_connections",
        );
        ok_if(n >= 1.0, || format!("{n}"))
    });
    let mut failed = Vec::new();
    for (phase, tunnel) in [("vpn", false), ("tunnel", true), ("vpn again", false)] {
        for i in 0..40 {
            if !reaches_the_app(&env, tunnel) {
                failed.push(format!("{phase} #{i}"));
            }
        }
    }
    assert!(
        failed.is_empty(),
        "{} of 120 failed: {failed:?}",
        failed.len()
    );
    let dials = env.server_metric(&server.admin(), "seedlink_tunnel_server_dials_total");
    assert!(dials >= 40.0, "{dials}");
    println!("vpn → tunnel → vpn: 120 requests, 0 failed");
}

//! OpenVPN through the gateway, as Gardener's reversed VPN does: the client
//! (shoot side) uses `http-proxy` with `CUSTOM-HEADER X-Gardener-Destination`
//! to reach the server (seed side) through the gateway's CONNECT listener,
//! each in its own network namespace; a ping crosses the tunnel. The same
//! with the legacy `Reversed-VPN` header on the legacy listener.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use seedlink_testkit as common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

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
/// proxy on `port` with `header` naming the destination, as Gardener
/// configures it.
fn vpn_shoot(
    ns: &common::Netns,
    openvpn: &Path,
    files: &seedlink::demo::ClientFiles,
    (port, header): (&str, &str),
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
            "198.18.1.2",
            "1194",
            "--http-proxy",
            "198.18.1.2",
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
    let cfg = dir.path().join("gateway.yaml");
    std::fs::write(
        &cfg,
        format!(
            "admin: {{listen: '127.0.0.1:9901'}}
listeners:
  - {{name: http-proxy, address: '198.18.1.2:8443', protocol: http-connect}}
  - {{name: tls-tunnel, address: '198.18.1.2:8132', protocol: http-connect, destination_header: Reversed-VPN}}
control_planes:
  - name: shoot--dev--a
    endpoints: ['127.0.0.1:1194']
    destinations: [{{name: '{DEST}'}}]
"
        ),
    )
    .unwrap();
    let mut gw = seed
        .cmd(&[
            env!("CARGO_BIN_EXE_seedlink"),
            "gateway",
            "--config",
            cfg.to_str().unwrap(),
        ])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let out = gw.stdout.take().unwrap();
    let _gw = Proc(gw);
    let mut line = String::new();
    BufReader::new(out).read_line(&mut line).unwrap();
    assert!(line.contains("ready"), "{line}");

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

//! node-proxy → gateway across network namespaces: the node-proxy's
//! interface (a port-less bridge with 240.0.0.10/32) lives in a "node"
//! namespace, the gateway and an `openssl s_server` kube-apiserver stand-in
//! (requiring a client certificate) in a "seed" namespace; curl on the node
//! reaches the server through the advertised address.
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

#[test]
fn node_proxy_in_a_node_namespace_reaches_the_seed() {
    let openssl = require("openssl");
    let (node, seed) = netns_pair("n", "d", 2);

    let dir = tempfile::tempdir().unwrap();
    let pki = seedlink::demo::Pki::generate(&[HOST]).unwrap();
    let files = pki.write_client_files(dir.path()).unwrap();
    let (cert, key) = (
        dir.path().join("server.pem"),
        dir.path().join("server-key.pem"),
    );
    std::fs::write(&cert, &pki.servers[0].1.cert_pem).unwrap();
    std::fs::write(&key, &pki.servers[0].1.key_pem).unwrap();

    // The kube-apiserver stand-in: TLS, client certificate required.
    let server = seed
        .cmd(&[
            openssl.to_str().unwrap(),
            "s_server",
            "-quiet",
            "-accept",
            "127.0.0.1:6443",
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
    let _server = Proc(server);
    eventually_blocking("s_server to listen", Duration::from_secs(10), || {
        seed.run(&["ss", "-ltn"]).contains("127.0.0.1:6443")
    });

    // The gateway in the seed namespace.
    let cfg = dir.path().join("gateway.yaml");
    std::fs::write(
        &cfg,
        format!(
            "admin: {{listen: '127.0.0.1:9901'}}
listeners: [{{name: http-proxy, address: '198.18.2.2:8443', protocol: http-connect}}]
control_planes:
  - {{name: shoot--dev--n, endpoints: ['127.0.0.1:6443'], destinations: [{{name: '{DEST}'}}]}}
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
    let line = ready_line(&mut gw);
    let _gw = Proc(gw);
    assert!(line.contains("ready"), "{line}");

    // The node-proxy in the node namespace, on its own bridge link.
    let mut np = node
        .cmd(&[
            env!("CARGO_BIN_EXE_seedlink"),
            "node-proxy",
            "--address",
            "240.0.0.10",
            "--link-kind",
            "bridge",
            "--gateway",
            "198.18.2.2:8443",
            "--destination",
            DEST,
            "--admin",
            "127.0.0.1:16910",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let line = ready_line(&mut np);
    let _np = Proc(np);
    assert!(line.contains("240.0.0.10:443"), "{line}");
    assert!(node
        .run(&["ip", "-o", "addr", "show", "dev", "apiserver-proxy"])
        .contains("240.0.0.10/32"));

    // curl on the node → 240.0.0.10:443 → CONNECT → gateway → s_server.
    let out = node
        .cmd(&[
            "curl",
            "-sS",
            "--max-time",
            "10",
            "--cacert",
            files.ca.to_str().unwrap(),
            "--cert",
            files.cert.to_str().unwrap(),
            "--key",
            files.key.to_str().unwrap(),
            "--resolve",
            &format!("{HOST}:443:240.0.0.10"),
            &format!("https://{HOST}/"),
        ])
        .output()
        .unwrap();
    let body = String::from_utf8_lossy(&out.stdout);
    assert!(
        body.contains("s_server"),
        "through the node-proxy: {body}{}",
        String::from_utf8_lossy(&out.stderr)
    );
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
}

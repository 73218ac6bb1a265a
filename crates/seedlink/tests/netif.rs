//! node-proxy's interface management over rtnetlink, inside network
//! namespaces the test creates and removes.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use seedlink_testkit as common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{eventually_blocking, Netns, Proc};

const DEST: &str = "outbound|443||kube-apiserver.shoot--dev--alpha.svc.cluster.local";

fn node_proxy(ns: &Netns, extra: &[&str]) -> Command {
    let mut c = ns.cmd(&[
        env!("CARGO_BIN_EXE_seedlink"),
        "node-proxy",
        "--address",
        "240.0.0.10",
        "--gateway",
        "127.0.0.1:1",
        "--destination",
        DEST,
    ]);
    c.args(extra).env("RUST_LOG", "info");
    c
}

#[test]
fn bridge_link_takes_the_address_from_lo_and_keeps_it() {
    let ns = Netns::new("t");
    ns.run(&["ip", "addr", "add", "240.0.0.10/32", "dev", "lo"]);
    let mut child = node_proxy(
        &ns,
        &[
            "--link-kind",
            "bridge",
            "--resync",
            "0.2",
            "--admin",
            "127.0.0.1:16910",
        ],
    )
    .stdout(Stdio::piped())
    .spawn()
    .unwrap();
    let out = child.stdout.take().unwrap();
    let _p = Proc(child);
    let mut line = String::new();
    BufReader::new(out).read_line(&mut line).unwrap();
    assert!(
        line.contains("\"listen\":\"240.0.0.10:443\""),
        "ready line: {line}"
    );

    let addr_on = |dev: &str| {
        ns.run(&["ip", "-o", "addr", "show", "dev", dev])
            .contains("240.0.0.10/32")
    };
    assert!(addr_on("apiserver-proxy"), "address not on the new link");
    assert!(!addr_on("lo"), "address still on lo");
    let link = ns.run(&["ip", "-o", "link", "show", "apiserver-proxy"]);
    assert!(
        link.contains("bridge")
            || ns
                .run(&["ip", "-d", "-o", "link", "show", "apiserver-proxy"])
                .contains("bridge")
    );
    assert!(
        link.contains(",UP") || link.contains("<UP"),
        "link not up: {link}"
    );
    assert!(ns.run(&["ss", "-ltn"]).contains("240.0.0.10:443"));

    // Someone removes the address: it comes back, and that is counted.
    ns.run(&[
        "ip",
        "addr",
        "del",
        "240.0.0.10/32",
        "dev",
        "apiserver-proxy",
    ]);
    eventually_blocking(
        "the address to be re-asserted",
        Duration::from_secs(10),
        || addr_on("apiserver-proxy"),
    );
    let metrics = ns.run(&[
        "curl",
        "-s",
        "--max-time",
        "5",
        "http://127.0.0.1:16910/metrics",
    ]);
    let n: f64 = metrics
        .lines()
        .find(|l| l.starts_with("seedlink_node_proxy_address_reasserted_total"))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0);
    assert!(n >= 1.0, "{metrics}");
    // The address is present but the gateway (127.0.0.1:1) is not: not ready.
    let ready = ns.run(&[
        "curl",
        "-s",
        "--max-time",
        "5",
        "http://127.0.0.1:16910/readyz",
    ]);
    assert!(
        ready.contains("address_ok=true") && ready.contains("gateway_ok=false"),
        "{ready}"
    );
}

#[test]
fn dummy_link_works_or_fails_clearly_and_existing_must_exist() {
    let ns = Netns::new("t");
    // What does this kernel say about dummy links?
    let probe = ns
        .cmd(&["ip", "link", "add", "probe0", "type", "dummy"])
        .output()
        .unwrap();
    let out = node_proxy(
        &ns,
        &[
            "--link-kind",
            "dummy",
            "--port",
            "0",
            "--admin",
            "127.0.0.1:0",
        ],
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let mut p = Proc(out);
    if probe.status.success() {
        let mut line = String::new();
        BufReader::new(p.0.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert!(line.contains("ready"), "{line}");
        assert!(ns
            .run(&["ip", "-o", "addr", "show", "dev", "apiserver-proxy"])
            .contains("240.0.0.10/32"));
    } else {
        let status = wait_exit(&mut p.0);
        assert!(!status, "must fail where the kernel has no dummy links");
        let mut err = String::new();
        std::io::Read::read_to_string(p.0.stderr.as_mut().unwrap(), &mut err).unwrap();
        assert!(
            err.contains("no 'dummy' link type") && err.contains("--link-kind bridge"),
            "unclear error: {err}"
        );
    }
    // An existing link that does not exist.
    let out = node_proxy(
        &ns,
        &[
            "--link-kind",
            "existing",
            "--interface",
            "nope0",
            "--port",
            "0",
            "--admin",
            "127.0.0.1:0",
        ],
    )
    .output()
    .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("\"nope0\" does not exist"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn wait_exit(c: &mut Child) -> bool {
    eventually_blocking("the process to exit", Duration::from_secs(10), || {
        c.try_wait()
            .unwrap()
            .map(|st| st.success())
            .ok_or("running")
    })
}

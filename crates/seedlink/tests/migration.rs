//! The migration gate: a configuration that removes a path a shoot still
//! uses (a listener, or a control plane's routes of a kind) is refused by
//! reload and by `check-config`, unless `migration.retire` names it; the
//! record of what is in use survives a restart (`migration.usage_file`).
//! The shoot's traffic is curl through the legacy `Reversed-VPN` CONNECT
//! listener, as a reversed-VPN client or node proxy sends it.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use seedlink_testkit as common;

use common::*;
use tokio_util::sync::CancellationToken;

const ALPHA: &str = "api.alpha.migration.test";
const DEST: &str = "outbound|443||kube-apiserver.shoot--m--alpha.svc.cluster.local";

/// The gateway's file: an SNI listener, the legacy CONNECT listener (unless
/// `legacy` is false), control plane `alpha` (with its CONNECT destination
/// when `destination`), the usage file, and `extra` (a `retire` list).
fn config(usage: &str, a: &str, legacy: bool, destination: bool, extra: &str) -> String {
    let legacy = match legacy {
        true => "  - {name: legacy, address: '127.0.0.1:0', protocol: http-connect, destination_header: Reversed-VPN}\n",
        false => "",
    };
    let destinations = match destination {
        true => format!("    destinations: [{{name: '{DEST}'}}]\n"),
        false => String::new(),
    };
    format!(
        "admin: {{listen: '127.0.0.1:0'}}
listeners:
  - {{name: sni, address: '127.0.0.1:0'}}
{legacy}control_planes:
  - name: alpha
    hostnames: [{ALPHA}]
    endpoints: ['{a}']
{destinations}migration:
  usage_file: '{usage}'
{extra}"
    )
}

/// curl through the legacy listener naming `DEST`: whether alpha answered.
fn through_legacy(gw: &Gw, files: &seedlink::demo::ClientFiles) -> bool {
    let proxy = gw.listener("legacy").to_string();
    let header = format!("Reversed-VPN: {DEST}");
    curl_through_connect(&proxy, &header, files, ALPHA, &[]).contains("hello from alpha")
}

/// `check-config` on `yaml`: whether it passed, and what it said.
fn check(dir: &std::path::Path, yaml: &str) -> (bool, String) {
    let f = dir.join("next.yaml");
    std::fs::write(&f, yaml).unwrap();
    let out = check_config(&f);
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), said)
}

/// A shoot uses the legacy listener. Removing alpha's destination is
/// refused on reload (alpha still routes) and by `check-config`, both
/// saying what still uses it and how to retire it; retired, it goes. After
/// a restart the record says the legacy listener is in use, and a file
/// without it is refused by `check-config` until retired.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_path_still_in_use_is_removed_only_when_retired() {
    let stop = CancellationToken::new();
    let pki = seedlink::demo::Pki::generate(&[ALPHA]).unwrap();
    let a = demo_backend(&pki, 0, "alpha", &stop).await;
    let state = tempfile::tempdir().unwrap();
    let usage = state.path().join("paths-in-use.json");
    let usage = usage.to_str().unwrap();
    let gw = Gw::start(&config(usage, &a.to_string(), true, true, ""));
    let files = write_pki(&pki, gw.dir.path());
    assert!(through_legacy(&gw, &files));
    let protocol = "http-connect:reversed-vpn";
    // A path's first connection is written to the record soon after.
    eventually(
        "the record of the path in use",
        std::time::Duration::from_secs(30),
        async || std::fs::read_to_string(usage).is_ok_and(|t| t.contains(protocol)),
    )
    .await;

    // The control plane's state says which paths it still uses.
    let (_, shown) = gw.get("/api/state?control_plane=alpha").await;
    let v: serde_json::Value = serde_json::from_str(&shown).unwrap();
    let in_use = &v["control_planes"][0]["paths_in_use"];
    assert!(
        in_use.get(format!("legacy / {protocol}")).is_some(),
        "{shown}"
    );

    // Reload without the destination: refused, alpha still served there.
    let failed = "seedlink_gateway_config_reloads_total{result=\"failure\"}";
    let no_destination = config(usage, &a.to_string(), true, false, "");
    gw.write_config(&no_destination);
    gw.wait_metric(failed, 1.0).await;
    assert!(
        through_legacy(&gw, &files),
        "a refused reload changed routing"
    );
    let (ok, said) = check(state.path(), &no_destination);
    assert!(!ok, "{said}");
    assert!(
        said.contains("control_planes (alpha)")
            && said.contains(protocol)
            && said.contains("migration.retire"),
        "{said}"
    );

    // Retired: check-config and reload take it; the route is gone.
    let retire = "  retire: [{listener: legacy, control_plane: alpha}]\n";
    let retired = config(usage, &a.to_string(), true, false, retire);
    let (ok, said) = check(state.path(), &retired);
    assert!(ok, "{said}");
    gw.write_config(&retired);
    let done = "seedlink_gateway_config_reloads_total{result=\"success\"}";
    gw.wait_metric(done, 1.0).await;
    assert!(!through_legacy(&gw, &files));

    // A restart: the record was written at shutdown and is read back.
    gw.signal("TERM");
    let mut gw = gw;
    let _ = gw.child.wait();
    let kept = std::fs::read_to_string(usage).unwrap();
    assert!(
        kept.contains(protocol) && kept.contains("\"alpha\""),
        "{kept}"
    );
    let without_legacy = config(usage, &a.to_string(), false, false, "");
    let (ok, said) = check(state.path(), &without_legacy);
    assert!(
        !ok && said.contains("listeners (legacy)") && said.contains("alpha"),
        "{said}"
    );
    let retire_all = "  retire: [{listener: legacy, control_plane: '*'}]\n";
    let (ok, said) = check(
        state.path(),
        &config(usage, &a.to_string(), false, false, retire_all),
    );
    assert!(ok, "{said}");
    stop.cancel();
}

const BETA: &str = "api.beta.migration.test";

/// Envoy as Gardener's istio-ingressgateway: TLS passthrough by SNI
/// (`tls_inspector`, one filter chain per shoot's name, `tcp_proxy`) for
/// alpha and beta.
fn istio_ingress(
    dir: &std::path::Path,
    port: u16,
    shoots: &[(&str, std::net::SocketAddr)],
) -> Proc {
    let mut chains = String::new();
    let mut clusters = String::new();
    for (i, (name, backend)) in shoots.iter().enumerate() {
        chains.push_str(&format!(
            "    - filter_chain_match: {{server_names: ['{name}']}}
      filters:
      - name: envoy.filters.network.tcp_proxy
        typed_config:
          '@type': type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy
          stat_prefix: shoot{i}
          cluster: shoot{i}
"
        ));
        clusters.push_str(&format!(
            "  - name: shoot{i}
    type: STATIC
    connect_timeout: 5s
    load_assignment:
      cluster_name: shoot{i}
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: {}, port_value: {}}}}}}}
",
            backend.ip(),
            backend.port()
        ));
    }
    let cfg = dir.join("istio-ingress.yaml");
    std::fs::write(
        &cfg,
        format!(
            "static_resources:
  listeners:
  - name: tls
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    listener_filters:
    - name: envoy.filters.listener.tls_inspector
      typed_config:
        '@type': type.googleapis.com/envoy.extensions.filters.listener.tls_inspector.v3.TlsInspector
    filter_chains:
{chains}  clusters:
{clusters}"
        ),
    )
    .unwrap();
    common::envoy(dir, &cfg)
}

/// curl to `https://<host>/` at `at` (as DNS would resolve the name):
/// whether the shoot named `who` answered.
fn answers(
    files: &seedlink::demo::ClientFiles,
    host: &str,
    at: std::net::SocketAddr,
    who: &str,
) -> bool {
    curl_mtls(files, host, at.ip(), at.port()).contains(&format!("hello from {who}"))
}

/// Istio → seedlink for one shoot, under a request loop: Envoy (as the
/// istio-ingressgateway) serves alpha and beta; the seedlink gateway runs
/// beside it with alpha's route. Alpha's name moves to the gateway and
/// back (each new connection goes where the name points, as after a DNS
/// change), while beta stays on Envoy: no request of either fails, and
/// the gateway routed alpha's while its name pointed there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_shoot_moves_from_istio_and_back_with_no_failed_request() {
    require("envoy");
    let stop = CancellationToken::new();
    let pki = seedlink::demo::Pki::generate(&[ALPHA, BETA]).unwrap();
    let alpha = demo_backend(&pki, 0, "alpha", &stop).await;
    let beta = demo_backend(&pki, 1, "beta", &stop).await;
    let dir = tempfile::tempdir().unwrap();
    let files = write_pki(&pki, dir.path());
    let port = free_port();
    let _istio = istio_ingress(dir.path(), port, &[(ALPHA, alpha), (BETA, beta)]);
    let istio: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    wait_listening(istio).await;
    let gw = Gw::start(&format!(
        "admin: {{listen: '127.0.0.1:0'}}
listeners:
  - {{name: sni, address: '127.0.0.1:0'}}
control_planes:
  - {{name: alpha, hostnames: [{ALPHA}], endpoints: ['{alpha}']}}
"
    ));
    let seedlink = gw.listener("sni");
    // 3 phases of 60 requests for each shoot: alpha on Istio, on seedlink,
    // on Istio again.
    let mut failed = Vec::new();
    for i in 0..180 {
        let alpha_at = if (60..120).contains(&i) {
            seedlink
        } else {
            istio
        };
        if !answers(&files, ALPHA, alpha_at, "alpha") {
            failed.push(format!("alpha #{i} at {alpha_at}"));
        }
        if !answers(&files, BETA, istio, "beta") {
            failed.push(format!("beta #{i}"));
        }
    }
    assert!(failed.is_empty(), "{} failed: {failed:?}", failed.len());
    let routed = "seedlink_gateway_routed_total{listener=\"sni\",protocol=\"tls-sni\",control_plane=\"alpha\"}";
    assert_eq!(gw.metric(routed).await, 60.0);
    println!("istio → seedlink → istio: 360 requests, 0 failed");
    stop.cancel();
}

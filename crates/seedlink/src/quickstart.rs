//! `seedlink quickstart`: a gateway with demo control planes on loopback.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use seedlink_gateway::Gateway;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::demo::{self, Pki};

/// The demo control planes: (name, SNI host, ACL).
const PLANES: &[(&str, &str, Option<&str>)] = &[
    (
        "shoot--demo--alpha",
        "api.alpha.demo.seedlink.test",
        Some("127.0.0.0/8"),
    ),
    ("shoot--demo--beta", "api.beta.demo.seedlink.test", None),
    // Only TEST-NET-1 may reach gamma, so loopback clients are denied.
    (
        "shoot--demo--gamma",
        "api.gamma.demo.seedlink.test",
        Some("192.0.2.0/24"),
    ),
];

/// Host name of the demo tunnel-server's agent endpoint.
const TUNNEL_HOST: &str = "tunnel.demo.seedlink.test";

/// Options of the quickstart.
#[derive(Debug, Clone)]
pub struct Options {
    /// Gateway TLS port on 127.0.0.1 (0 picks a free one).
    pub port: u16,
    /// Admin port on 127.0.0.1 (0 picks a free one).
    pub admin_port: u16,
    /// Run the walkthrough unattended and exit.
    pub check: bool,
}

/// Runs the quickstart; returns the process exit code.
pub async fn run(opts: Options) -> anyhow::Result<i32> {
    let dir = tempfile::Builder::new()
        .prefix("seedlink-quickstart-")
        .tempdir()?;
    let mut hosts: Vec<&str> = PLANES.iter().map(|p| p.1).collect();
    // The reverse tunnel's server certificate (the last host).
    hosts.push(TUNNEL_HOST);
    let pki = Pki::generate(&hosts)?;
    let files = pki.write_client_files(dir.path())?;
    let stop = CancellationToken::new();

    let yaml = gateway_yaml(&opts, &pki, &stop).await?;
    let config_path = dir.path().join("gateway.yaml");
    std::fs::write(&config_path, &yaml)?;
    let snapshot = seedlink_config::load(&config_path, None).map_err(|e| anyhow::anyhow!("{e}"))?;
    let gw = Gateway::new(snapshot, Some(config_path.clone()));
    let supervisor = crate::supervisor::Supervisor::install()?;
    let bound = gw.bind(false)?;
    let tls_addr = bound.listeners[0].1[0].local_addr()?;
    let admin_addr = bound.admin.local_addr()?;
    let connect_addr = bound.listeners[1].1[0].local_addr()?;
    gw.serve(bound)?;
    // The in-cluster path: a node-proxy on a loopback address standing in
    // for the `kubernetes` service IP, tunnelling to the gateway by CONNECT.
    let node_addr = start_node_proxy(connect_addr, PLANES[0].0).await?;
    // The reverse tunnel: control plane → shoot pod, through an agent that
    // dialled out.
    let tunnel = crate::quickstart_tunnel::start(
        &pki,
        PLANES.len(),
        [PLANES[0].0, PLANES[1].0],
        dir.path(),
        &stop,
    )
    .await?;

    print_commands(
        &files,
        &config_path,
        (tls_addr, admin_addr, connect_addr),
        node_addr,
        &tunnel,
    );
    // The same walkthrough in both modes, so a newcomer sees every path
    // (including the ACL denial) work before trying the commands above.
    println!("Walkthrough:");
    let ok = walkthrough(&gw, &pki, tls_addr, node_addr, &tunnel).await;
    if opts.check {
        stop.cancel();
        return Ok(if ok { 0 } else { 1 });
    }
    println!("\nThe gateway keeps running; try the curl commands above. Press Ctrl-C to stop.");
    let role = crate::roles::gateway::GatewayRole(gw.clone());
    let code = supervisor.arm(vec![std::sync::Arc::new(role)]).run().await;
    stop.cancel();
    drop(dir);
    Ok(code)
}

/// The gateway's configuration: a demo kube-apiserver started for each
/// control plane (stopped by `stop`), one with an ACL that denies the
/// walkthrough.
async fn gateway_yaml(
    opts: &Options,
    pki: &Pki,
    stop: &CancellationToken,
) -> anyhow::Result<String> {
    let mut yaml = format!(
        "# Written by `seedlink quickstart`; edit it and the gateway reloads.\n\
         admin: {{listen: '127.0.0.1:{}'}}\n\
         listeners:\n  - {{name: tls, address: '127.0.0.1:{}', protocol: tls}}\n  - {{name: http-proxy, address: '127.0.0.1:0', protocol: http-connect}}\n\
         timeouts: {{drain: 2s}}\n\
         control_planes:\n",
        opts.admin_port, opts.port
    );
    for (i, (name, host, acl)) in PLANES.iter().enumerate() {
        let backend = TcpListener::bind("127.0.0.1:0").await?;
        let addr = backend.local_addr()?;
        tokio::spawn(demo::serve_demo_apiserver(
            backend,
            name.to_string(),
            pki.server_config(i)?,
            stop.clone(),
        ));
        yaml.push_str(&format!(
            "  - name: {name}\n    hostnames: [{host}]\n    endpoints: ['{addr}']\n    destinations: [{{name: '{}'}}]\n",
            destination(name)
        ));
        if let Some(acl) = acl {
            yaml.push_str(&format!("    acl: {{allow: ['{acl}']}}\n"));
        }
    }
    Ok(yaml)
}

/// Prints what runs where and the commands that try each path by hand.
fn print_commands(
    files: &demo::ClientFiles,
    config_path: &std::path::Path,
    (tls_addr, admin_addr, connect_addr): (SocketAddr, SocketAddr, SocketAddr),
    node_addr: SocketAddr,
    tunnel: &crate::quickstart_tunnel::TunnelDemo,
) {
    println!(
        "seedlink quickstart: a gateway on {tls_addr} routes TLS by SNI, without terminating it,"
    );
    println!("to three demo kube-apiservers that require a client certificate.");
    println!(
        "  config (edit it: the gateway reloads): {}",
        config_path.display()
    );
    println!("  admin: http://{admin_addr}/metrics  /readyz  /config\n");
    for (name, host, acl) in PLANES {
        let verdict = match acl {
            Some("127.0.0.0/8") | None => "allowed",
            Some(_) => "denied by its ACL (only 192.0.2.0/24 may connect)",
        };
        println!("# {name}: {verdict}");
        println!(
            "curl --cacert {} --cert {} --key {} --resolve {host}:{port}:127.0.0.1 https://{host}:{port}/\n",
            files.ca.display(),
            files.cert.display(),
            files.key.display(),
            port = tls_addr.port()
        );
    }
    print_path_commands(files, connect_addr, node_addr, tunnel);
}

/// The commands that try the in-cluster path and the reverse tunnel.
fn print_path_commands(
    files: &demo::ClientFiles,
    connect_addr: SocketAddr,
    node_addr: SocketAddr,
    tunnel: &crate::quickstart_tunnel::TunnelDemo,
) {
    println!(
        "# in-cluster path: node-proxy on {node_addr} (the `kubernetes` service address) → CONNECT with\n\
         # X-Gardener-Destination: {} → gateway {connect_addr} → {}",
        destination(PLANES[0].0),
        PLANES[0].0
    );
    println!(
        "curl --cacert {} --cert {} --key {} --resolve {host}:{port}:{ip} https://{host}:{port}/\n",
        files.ca.display(),
        files.cert.display(),
        files.key.display(),
        host = PLANES[0].1,
        ip = node_addr.ip(),
        port = node_addr.port()
    );

    println!(
        "# reverse tunnel: one tunnel-server for two clusters; each cluster's tunnel-agent (its own\n\
         # client CA; allowed only its pod) dialled out to it. {}'s kube-apiserver egress dialer\n\
         # uses {} (HTTP CONNECT), {}'s uses {}; with curl through {}'s mTLS frontend:",
        PLANES[0].0,
        tunnel.uds.display(),
        tunnel.second.0,
        tunnel.second.1.display(),
        PLANES[0].0
    );
    println!(
        "curl -p -x https://{TUNNEL_HOST}:{port} --resolve {TUNNEL_HOST}:{port}:127.0.0.1 --proxy-cacert {} --proxy-cert {} --proxy-key {} http://{pod}/\n",
        files.ca.display(),
        files.cert.display(),
        files.key.display(),
        port = tunnel.tcp.rsplit_once(':').map_or("", |(_, p)| p),
        pod = tunnel.pod
    );
}

/// The unattended walkthrough: every step must behave as printed.
async fn walkthrough(
    gw: &Arc<Gateway>,
    pki: &Pki,
    addr: SocketAddr,
    node: SocketAddr,
    tunnel: &crate::quickstart_tunnel::TunnelDemo,
) -> bool {
    let mut steps = Steps { all: true };
    gateway_steps(&mut steps, pki, addr, node).await;
    tunnel_steps(&mut steps, tunnel).await;
    metric_steps(&mut steps, gw);
    println!(
        "{}",
        if steps.all {
            "quickstart check: all steps passed"
        } else {
            "quickstart check: FAILED"
        }
    );
    steps.all
}

/// The walkthrough's steps, each printed PASS or FAIL as it runs.
struct Steps {
    all: bool,
}

impl Steps {
    fn step(&mut self, name: &str, ok: bool, detail: String) {
        println!("[{}] {name}: {detail}", if ok { "PASS" } else { "FAIL" });
        self.all &= ok;
    }
}

/// The gateway's paths: SNI with and without a client certificate, the
/// ACL, an unknown name, and the in-cluster path through the node-proxy.
async fn gateway_steps(steps: &mut Steps, pki: &Pki, addr: SocketAddr, node: SocketAddr) {
    let get = |host: &'static str, cert: bool| async move {
        let cfg = pki
            .client_config(cert, &[b"seedlink-demo"])
            .context("client config")?;
        tokio::time::timeout(Duration::from_secs(10), demo::https_get(addr, host, cfg))
            .await
            .context("timed out")?
    };
    for (name, host, acl) in PLANES {
        let r = get(host, true).await;
        if acl.is_none() || *acl == Some("127.0.0.0/8") {
            let ok = matches!(&r, Ok(body) if body.contains(name) && body.contains("alpn=seedlink-demo") && body.contains("client_certs=1"));
            steps.step(
                &format!("{name} reachable with a client certificate"),
                ok,
                show(&r),
            );
        } else {
            steps.step(&format!("{name} denied by ACL"), r.is_err(), show(&r));
        }
    }
    let r = get(PLANES[0].1, false).await;
    steps.step(
        "kube-apiserver rejects a client without certificate (end-to-end mTLS)",
        r.is_err(),
        show(&r),
    );
    let r = get("api.unknown.demo.seedlink.test", true).await;
    steps.step(
        "unknown SNI is closed without an upstream",
        r.is_err(),
        show(&r),
    );
    let cfg = pki.client_config(true, &[b"seedlink-demo"]);
    let r = match cfg {
        Ok(cfg) => tokio::time::timeout(
            Duration::from_secs(10),
            demo::https_get(node, PLANES[0].1, cfg),
        )
        .await
        .unwrap_or_else(|_| Err(anyhow::anyhow!("timed out"))),
        Err(e) => Err(e),
    };
    let ok =
        matches!(&r, Ok(body) if body.contains(PLANES[0].0) && body.contains("client_certs=1"));
    steps.step(
        "in-cluster path: node-proxy → CONNECT → gateway → kube-apiserver (mTLS end to end)",
        ok,
        show(&r),
    );
}

/// The reverse tunnel's paths, and what each cluster's socket refuses.
async fn tunnel_steps(steps: &mut Steps, tunnel: &crate::quickstart_tunnel::TunnelDemo) {
    let r = crate::quickstart_tunnel::get_through(&tunnel.uds, tunnel.pod).await;
    let ok = matches!(&r, Ok(body) if body.contains("reached through the reverse tunnel"));
    steps.step(
        "reverse tunnel: CONNECT on the kube-apiserver socket → tunnel-server → agent → shoot pod",
        ok,
        show(&r),
    );
    let (name2, uds2, pod2) = &tunnel.second;
    let r = crate::quickstart_tunnel::get_through(uds2, *pod2).await;
    let ok = matches!(&r, Ok(body) if body.contains(&format!("a pod of {name2},")));
    steps.step(
        "reverse tunnel, second cluster on the same server: its socket → its own agent → its pod",
        ok,
        show(&r),
    );
    let r = crate::quickstart_tunnel::get_through(&tunnel.uds, *pod2).await;
    steps.step(
        "reverse tunnel: the first cluster's socket dials only through its own agent (the other cluster's pod is refused)",
        matches!(&r, Err(e) if e.to_string().contains("502")),
        show(&r),
    );
    let outside: SocketAddr = ([127, 0, 0, 1], tunnel.pod.port()).into();
    let r = crate::quickstart_tunnel::get_through(&tunnel.uds, outside).await;
    steps.step(
        "reverse tunnel: a destination outside the agent's policy is refused",
        matches!(&r, Err(e) if e.to_string().contains("502")),
        show(&r),
    );
}

/// The refusals counted in the gateway's metrics.
fn metric_steps(steps: &mut Steps, gw: &Gateway) {
    let metrics = gw.metrics.encode();
    let denied = metrics.lines().any(|l| {
        l.starts_with("seedlink_gateway_acl_denied_total{control_plane=\"shoot--demo--gamma\"} 1")
    });
    steps.step(
        "ACL denial counted in metrics",
        denied,
        "seedlink_gateway_acl_denied_total".into(),
    );
    let unknown = metrics
        .lines()
        .any(|l| l.contains("reason=\"unknown_sni\"") && l.ends_with(" 1"));
    steps.step(
        "unknown SNI counted in metrics",
        unknown,
        "seedlink_gateway_detect_failures_total".into(),
    );
}

fn show(r: &anyhow::Result<String>) -> String {
    match r {
        Ok(body) => body.trim().to_string(),
        Err(e) => format!("refused ({e:#})"),
    }
}

/// The destination name of a demo control plane.
fn destination(name: &str) -> String {
    format!("outbound|443||kube-apiserver.{name}.svc.cluster.local")
}

/// Starts a node-proxy on 127.0.0.2 (any free port) tunnelling to the
/// gateway's CONNECT listener for control plane `name`; returns its address.
async fn start_node_proxy(gateway: SocketAddr, name: &str) -> anyhow::Result<SocketAddr> {
    use seedlink_node_proxy::{Mode, NodeProxy, Options};
    let listener = TcpListener::bind("127.0.0.2:0").await?;
    let addr = listener.local_addr()?;
    let opts = Options {
        gateway: gateway.to_string(),
        mode: Mode::Connect,
        header: ("X-Gardener-Destination".into(), destination(name)),
        authority: "api.internal.demo.seedlink.test:443".into(),
        connect_timeout: Duration::from_secs(5),
        handshake_timeout: Duration::from_secs(10),
        resolve_ttl: Duration::from_secs(30),
        max_connections: 1000,
        drain: Duration::from_secs(2),
        tlv: None,
        egress: None,
        health: seedlink_node_proxy::health::HealthCheck::tcp(),
        advertised: addr,
    };
    let np = NodeProxy::new(opts, false);
    let admin = TcpListener::bind("127.0.0.1:0").await?;
    np.serve(listener, admin, seedlink_net::admin::Access::open());
    Ok(addr)
}

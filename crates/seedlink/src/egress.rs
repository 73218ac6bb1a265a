//! `seedlink tunnel-config`: what an operator needs for one cluster of a
//! tunnel-server configuration, derived from that configuration so the
//! pieces cannot disagree: kube-apiserver's `EgressSelectorConfiguration`
//! for the chosen frontend, and the agent's command line (seedlink's
//! `tunnel-agent`, and upstream's `proxy-agent`, which works against the
//! same server).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use seedlink_tunnel::config::{Cluster, Frontend, FrontendProtocol, ServerConfig};

/// What to render.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// The cluster (its `name` in the server configuration).
    pub cluster: String,
    /// The frontend kube-apiserver uses (default: the cluster's first
    /// CONNECT or gRPC frontend).
    pub frontend: Option<String>,
    /// Where agents reach the server (or the gateway in front of it),
    /// `host:port` (default: the agent endpoint's address, if it is not a
    /// wildcard).
    pub agent_server: Option<String>,
    /// TLS server name agents ask for (default: the host of `agent_server`).
    pub server_name: Option<String>,
    /// Where kube-apiserver reaches a TCP frontend, `host:port` (default:
    /// the frontend's address, if it is not a wildcard).
    pub frontend_address: Option<String>,
    /// Paths as kube-apiserver sees them, for a TCP+mTLS frontend.
    pub kas_ca: PathBuf,
    /// kube-apiserver's client certificate for the frontend.
    pub kas_cert: PathBuf,
    /// Its key.
    pub kas_key: PathBuf,
    /// Paths as the agent sees them: the server's CA.
    pub agent_ca_cert: PathBuf,
    /// The agent's client certificate (certificate trust).
    pub agent_cert: PathBuf,
    /// Its key.
    pub agent_key: PathBuf,
    /// The agent's projected ServiceAccount token (token trust).
    pub agent_token: PathBuf,
    /// The EgressSelectorConfiguration's version: `v1beta1` (default) or
    /// `v1alpha1`, the two kube-apiserver reads.
    pub egress_api_version: String,
    /// Where kube-apiserver finds the egress selector file.
    pub egress_file: PathBuf,
    /// GEP-08: the address the node-proxy serves `kubernetes` on at every
    /// node, which kube-apiserver advertises (so `default/kubernetes`
    /// points at it).
    pub advertise_address: Option<std::net::IpAddr>,
    /// Where the shoot's node-proxies reach the gateway's `http-connect`
    /// listener, `host:port` (with `advertise_address`: the node-proxy's
    /// configuration is rendered).
    pub gateway: Option<String>,
    /// The node-proxy's destination header value (default
    /// `outbound|443||kube-apiserver.<cluster>.svc.cluster.local`,
    /// Gardener's form).
    pub destination: Option<String>,
    /// HyperShift's node path: the hosted cluster's ID. With it (and no
    /// `destination`), the node-proxy reaches `gateway` in `proxy-v2` mode
    /// and sends the ID in a PROXY v2 TLV (type 0x20), which a gateway
    /// `proxy` listener with `route_by_tlv` routes by.
    pub cluster_id: Option<String>,
    /// kube-apiserver's secure port (the `kubernetes` endpoint's port, which
    /// the node-proxy serves on the advertised address).
    pub kube_apiserver_port: u16,
    /// The node-proxy's link and ports, when not its defaults (`dummy`
    /// link `apiserver-proxy`, admin on 9911, metrics on 16910).
    pub node_proxy_host: Option<NodeProxyHost>,
    /// kube-apiserver's `--goaway-chance` ([`GOAWAY_CHANCE`] from
    /// [`Options::new`]; 0, as `Options::default()` leaves it: not
    /// rendered).
    pub goaway_chance: f64,
}

/// kube-apiserver's `--goaway-chance` as rendered by default: the share
/// of HTTP/2 requests after which it tells the client (GOAWAY) to open a
/// new connection for the next ones. Behind the gateway's SNI
/// passthrough, a connection stays with the replica it was sent to; an
/// HTTP/2 client (a controller, a kubelet) holds one connection for days,
/// so without it a new replica (a scale-out, a rollout) takes no load
/// from the clients already connected (gardener#8810, which Gardener
/// answered by terminating TLS instead). 0.001 is upstream's suggested
/// start (the flag's help): about one new connection per thousand
/// requests, a TLS handshake's cost spread over them; kube-apiserver
/// takes at most 0.02. Long-running requests (watches) are never cut.
pub const GOAWAY_CHANCE: f64 = 0.001;

/// Where on the node the node-proxy lives: its link and its ports (one
/// beside another node proxy, as during a migration from Gardener's
/// apiserver-proxy, needs others).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeProxyHost {
    /// `dummy`, `bridge`, `existing` or `none`.
    pub link_kind: String,
    /// The link's name.
    pub interface: String,
    /// Its loopback admin port.
    pub admin_port: u16,
    /// Its `/metrics` port on every address of the node.
    pub metrics_port: u16,
}

impl Default for NodeProxyHost {
    fn default() -> NodeProxyHost {
        NodeProxyHost {
            link_kind: "dummy".into(),
            interface: "apiserver-proxy".into(),
            admin_port: 9911,
            metrics_port: 16910,
        }
    }
}

impl Options {
    /// Defaults for every path (conventional mount points).
    pub fn new(cluster: &str) -> Options {
        Options {
            cluster: cluster.to_string(),
            kas_ca: "/etc/kubernetes/tunnel/ca.crt".into(),
            kas_cert: "/etc/kubernetes/tunnel/client.crt".into(),
            kas_key: "/etc/kubernetes/tunnel/client.key".into(),
            agent_ca_cert: "/etc/seedlink/tunnel-ca.crt".into(),
            agent_cert: "/etc/seedlink/agent.crt".into(),
            agent_key: "/etc/seedlink/agent.key".into(),
            agent_token: "/var/run/secrets/tokens/konnectivity-agent-token".into(),
            egress_api_version: "v1beta1".into(),
            egress_file: "/etc/kubernetes/egress/egress-selector-configuration.yaml".into(),
            kube_apiserver_port: 443,
            goaway_chance: GOAWAY_CHANCE,
            ..Options::default()
        }
    }
}

/// The rendered pieces.
#[derive(Debug, Clone)]
pub struct Rendered {
    /// kube-apiserver's `--egress-selector-config-file` content.
    pub egress_selector: String,
    /// `seedlink tunnel-agent` arguments.
    pub tunnel_agent_args: Vec<String>,
    /// Upstream `proxy-agent` arguments.
    pub proxy_agent_args: Vec<String>,
    /// The kube-apiserver flags seedlink's paths need (comments start
    /// with `#`).
    pub kube_apiserver_args: Vec<String>,
    /// `seedlink tunnel-agent --config` file for the shoot.
    pub agent_yaml: String,
    /// `seedlink node-proxy --config` file, when the gateway and the
    /// advertised address are known.
    pub node_proxy_yaml: Option<String>,
    /// The shoot-side ConfigMap (`seedlink-shoot`, what
    /// deploy/kustomize/shoot reads) holding both files.
    pub shoot_config: String,
}

/// A YAML single-quoted scalar.
fn q(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

fn path(p: &Path) -> String {
    p.display().to_string()
}

/// Renders `opts.cluster`'s pieces from `cfg`.
pub fn render(cfg: &ServerConfig, opts: &Options) -> anyhow::Result<Rendered> {
    let cluster = &match cfg.clusters.iter().find(|c| c.name == opts.cluster) {
        Some(c) => c.clone(),
        // A TunnelCluster (`<namespace>.<name>`): the file's templates
        // and shared frontends serve it; its agents are rendered with
        // certificate trust (its agentCA).
        None if cfg.kubernetes.is_some() => cfg.templated(&opts.cluster),
        None => {
            let names: Vec<_> = cfg.clusters.iter().map(|c| c.name.as_str()).collect();
            bail!(
                "no cluster {:?} in the configuration (clusters: {}; with a `kubernetes` section, a TunnelCluster's name <namespace>.<name>)",
                opts.cluster,
                names.join(", ")
            );
        }
    };
    if !(0.0..=0.02).contains(&opts.goaway_chance) {
        bail!(
            "--goaway-chance {}: kube-apiserver takes 0 (off) to 0.02",
            opts.goaway_chance
        );
    }
    let frontend = kas_frontend(cluster, &cfg.shared_frontends, opts)?;
    check_texts(cluster, frontend, opts)?;
    let shared = cfg.shared_frontends.iter().any(|f| f.name == frontend.name)
        && !cluster.frontends.iter().any(|f| f.name == frontend.name);
    let egress = egress_selector(cluster, (frontend, shared), opts)?;
    let kas = kube_apiserver_args(cluster, opts);
    let server = agent_server(cfg, opts)?;
    let (host, port) = server
        .rsplit_once(':')
        .filter(|(_, p)| p.parse::<u16>().is_ok())
        .with_context(|| format!("--agent-server {server:?} is not host:port"))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let name = opts.server_name.clone().unwrap_or_else(|| host.to_string());
    let (agent, upstream) = agent_args(cluster, opts, (&server, &name), (host, port));
    let shoot = shoot_files(cluster, opts, &server, &name)?;
    Ok(Rendered {
        egress_selector: egress,
        tunnel_agent_args: agent,
        proxy_agent_args: upstream,
        kube_apiserver_args: kas,
        agent_yaml: shoot.0,
        node_proxy_yaml: shoot.1,
        shoot_config: shoot.2,
    })
}

/// Where agents reach the server: as given, or where it listens (unless
/// that is every address).
fn agent_server(cfg: &ServerConfig, opts: &Options) -> anyhow::Result<String> {
    Ok(match &opts.agent_server {
        Some(s) => s.clone(),
        None if !cfg.agents.listen.ip().is_unspecified() => cfg.agents.listen.to_string(),
        None => bail!(
            "agents listen on {}; say where agents reach the server with --agent-server host:port",
            cfg.agents.listen
        ),
    })
}

/// The frontend kube-apiserver dials: the one named (the cluster's own,
/// else a shared one), or the cluster's first http-connect or gRPC
/// frontend, else the first shared one.
fn kas_frontend<'c>(
    cluster: &'c Cluster,
    shared: &'c [Frontend],
    opts: &Options,
) -> anyhow::Result<&'c Frontend> {
    let for_kas = |f: &&Frontend| !f.protocol.is_proxy();
    let mut all = cluster.frontends.iter().chain(shared);
    Ok(match &opts.frontend {
        Some(n) => all.find(|f| &f.name == n).with_context(|| {
            format!("cluster {}: no frontend {n:?}, its own or shared", cluster.name)
        })?,
        None => all.find(for_kas).with_context(|| {
            format!(
                "cluster {}: no http-connect or grpc frontend for kube-apiserver, its own or shared",
                cluster.name
            )
        })?,
    })
}

/// Names and paths go into YAML and comment lines: a line break or other
/// control character would end or inject lines.
fn check_texts(cluster: &Cluster, frontend: &Frontend, opts: &Options) -> anyhow::Result<()> {
    let texts = [
        ("cluster", cluster.name.clone()),
        ("frontend", frontend.name.clone()),
        ("--kas-ca", path(&opts.kas_ca)),
        ("--kas-cert", path(&opts.kas_cert)),
        ("--kas-key", path(&opts.kas_key)),
        ("--agent-ca-cert", path(&opts.agent_ca_cert)),
        ("--agent-cert", path(&opts.agent_cert)),
        ("--agent-key", path(&opts.agent_key)),
        ("--agent-token", path(&opts.agent_token)),
        ("--egress-file", path(&opts.egress_file)),
    ];
    let unix = frontend.unix.as_ref().map(|p| ("unix socket", path(p)));
    for (what, t) in texts.into_iter().chain(unix) {
        if t.chars().any(char::is_control) {
            bail!("{what} {t:?} holds a control character");
        }
    }
    Ok(())
}

/// kube-apiserver's EgressSelectorConfiguration: `cluster` through the
/// tunnel, `controlplane` and `etcd` direct.
fn egress_selector(
    cluster: &Cluster,
    (frontend, shared): (&Frontend, bool),
    opts: &Options,
) -> anyhow::Result<String> {
    let proto = egress_protocol(frontend)?;
    let transport = egress_transport(frontend, opts)?;
    if shared && frontend.client_ca.is_none() {
        bail!(
            "shared frontend {}: without client_ca nothing names the cluster",
            frontend.name
        );
    }
    if !matches!(opts.egress_api_version.as_str(), "v1beta1" | "v1alpha1") {
        bail!(
            "egress selector version {:?}: kube-apiserver reads apiserver.k8s.io/v1beta1 or v1alpha1",
            opts.egress_api_version
        );
    }
    let mut egress = String::new();
    let _ = writeln!(
        egress,
        "# kube-apiserver --egress-selector-config-file for cluster {} (frontend {}),\n\
         # generated by `seedlink tunnel-config` from the tunnel-server configuration.\n\
         # cluster: everything kube-apiserver dials in the shoot (webhooks, aggregated\n\
         # APIs, kubelets, the node/service/pod proxy) goes through the tunnel;\n\
         # controlplane and etcd stay direct (they live in the seed).",
        cluster.name, frontend.name
    );
    if shared {
        let _ = writeln!(
            egress,
            "# {} is shared by every cluster: kube-apiserver's client certificate\n\
             # ({}) must carry CN {} and be issued by the frontend's client_ca.",
            frontend.name,
            path(&opts.kas_cert),
            cluster.name
        );
    }
    let _ = writeln!(
        egress,
        "apiVersion: apiserver.k8s.io/{}\nkind: EgressSelectorConfiguration\negressSelections:\n- name: cluster\n  connection:",
        opts.egress_api_version
    );
    let _ = writeln!(egress, "    proxyProtocol: {proto}\n    transport:");
    egress.push_str(&transport);
    for direct in ["controlplane", "etcd"] {
        let _ = writeln!(
            egress,
            "- name: {direct}\n  connection:\n    proxyProtocol: Direct"
        );
    }
    Ok(egress)
}

/// The `proxyProtocol` kube-apiserver speaks to the frontend.
fn egress_protocol(frontend: &Frontend) -> anyhow::Result<&'static str> {
    Ok(match frontend.protocol {
        FrontendProtocol::HttpConnect => "HTTPConnect",
        FrontendProtocol::Grpc => "GRPC",
        FrontendProtocol::HttpProxy => bail!(
            "frontend {} is an http-proxy (for Prometheus), not for kube-apiserver",
            frontend.name
        ),
        FrontendProtocol::Socks5 => bail!(
            "frontend {} is a socks5 proxy (for other control-plane components), not for kube-apiserver",
            frontend.name
        ),
    })
}

/// The `transport` block: the frontend's Unix socket, or its TCP address
/// (with kube-apiserver's client certificate when the frontend has TLS).
fn egress_transport(frontend: &Frontend, opts: &Options) -> anyhow::Result<String> {
    Ok(match (&frontend.unix, &frontend.tcp) {
        (Some(p), _) => format!("      uds:\n        udsName: {}\n", q(&path(p))),
        (None, Some(_)) if frontend.protocol == FrontendProtocol::Grpc => bail!(
            "frontend {}: kube-apiserver speaks gRPC to an egress proxy only over a Unix socket; \
             use a unix gRPC frontend or an http-connect frontend",
            frontend.name
        ),
        (None, Some(a)) if frontend.cert.is_some() => format!(
            "      tcp:\n        url: {}\n        tlsConfig:\n          caBundle: {}\n          clientCert: {}\n          clientKey: {}\n",
            q(&format!("https://{}", frontend_address(frontend, *a, opts)?)),
            q(&path(&opts.kas_ca)),
            q(&path(&opts.kas_cert)),
            q(&path(&opts.kas_key))
        ),
        (None, Some(a)) => format!(
            "      tcp:\n        url: {}\n",
            q(&format!("http://{}", frontend_address(frontend, *a, opts)?))
        ),
        (None, None) => bail!("frontend {}: neither unix nor tcp", frontend.name),
    })
}

/// Where kube-apiserver reaches a TCP frontend listening on `listen`:
/// `--frontend-address`, or the address itself unless it is a wildcard.
fn frontend_address(
    frontend: &Frontend,
    listen: std::net::SocketAddr,
    opts: &Options,
) -> anyhow::Result<String> {
    match &opts.frontend_address {
        Some(a) if a.chars().any(|c| c.is_control() || c.is_whitespace()) => {
            bail!("--frontend-address {a:?}: not host:port")
        }
        Some(a) => Ok(a.clone()),
        None if !listen.ip().is_unspecified() => Ok(listen.to_string()),
        None => bail!(
            "frontend {} listens on {listen}; say where kube-apiserver reaches it with --frontend-address host:port",
            frontend.name
        ),
    }
}

/// kube-apiserver's flags (and the notes that go with them).
fn kube_apiserver_args(cluster: &Cluster, opts: &Options) -> Vec<String> {
    let mut kas = vec![format!(
        "--egress-selector-config-file={}",
        path(&opts.egress_file)
    )];
    if let Some(t) = &cluster.agent_token {
        // The tunnel checks `iss`: kube-apiserver must issue the agents'
        // tokens under this name (its first --service-account-issuer).
        kas.push(format!("--service-account-issuer={}", t.issuer));
        kas.push(
            "# it must be kube-apiserver's first --service-account-issuer: a kube-apiserver that \
             issued under another name keeps that one as a second --service-account-issuer (or \
             every token it issued stops working), or the TunnelCluster names the issuer it has"
                .into(),
        );
        kas.push(format!(
            "# no --api-audiences change: the agents' tokens carry audience {} only, so \
             kube-apiserver itself never accepts them",
            t.audience
        ));
    }
    if opts.goaway_chance > 0.0 {
        kas.push(format!("--goaway-chance={}", opts.goaway_chance));
        kas.push(
            "# spreads HTTP/2 clients over the kube-apiserver replicas behind the gateway's \
             passthrough: after this share of requests a client is told to reconnect, and its \
             next connection may reach another replica (0 to 0.02; watches are never cut)"
                .into(),
        );
    }
    if let Some(a) = opts.advertise_address {
        kas.push(format!("--advertise-address={a}"));
        kas.push(
            "# GEP-08: default/kubernetes points at the node-proxy's address on every node".into(),
        );
    }
    kas
}

/// The seedlink agent's and upstream proxy-agent's flags for `server`
/// (`host`, `port`) with TLS name `name`.
fn agent_args(
    cluster: &Cluster,
    opts: &Options,
    (server, name): (&str, &str),
    (host, port): (&str, &str),
) -> (Vec<String>, Vec<String>) {
    let mut agent = vec![
        format!("--server={server}"),
        format!("--server-name={name}"),
        format!("--ca-cert={}", path(&opts.agent_ca_cert)),
    ];
    let mut upstream = vec![
        format!("--proxy-server-host={host}"),
        format!("--proxy-server-port={port}"),
        format!("--ca-cert={}", path(&opts.agent_ca_cert)),
    ];
    // Certificate trust unless the cluster trusts tokens (a TunnelCluster
    // rendered from the templates: its agentCA).
    if cluster.agent_ca.is_some() || cluster.agent_token.is_none() {
        for v in [&mut agent, &mut upstream] {
            v.push(format!("--agent-cert={}", path(&opts.agent_cert)));
            v.push(format!("--agent-key={}", path(&opts.agent_key)));
        }
    } else {
        for v in [&mut agent, &mut upstream] {
            v.push(format!(
                "--service-account-token-path={}",
                path(&opts.agent_token)
            ));
        }
    }
    if let Some(t) = &cluster.agent_token {
        // The projected token must be issued for the server's audience.
        let note = format!(
            "# project the token with audience {} and ServiceAccount {}",
            t.audience, t.service_account
        );
        agent.push(note.clone());
        upstream.push(note);
    }
    (agent, upstream)
}

/// The shoot's files: the agent's configuration, the node-proxy's (when
/// the gateway and the advertised address are given), and the ConfigMap
/// that carries both into deploy/kustomize/shoot. Built as data and
/// serialized, so every value is quoted as YAML needs.
fn shoot_files(
    cluster: &seedlink_tunnel::config::Cluster,
    opts: &Options,
    server: &str,
    server_name: &str,
) -> anyhow::Result<(String, Option<String>, String)> {
    use serde_json::{json, Map};
    let agent_yaml = agent_yaml(cluster, opts, server, server_name)?;
    let node_proxy_yaml = node_proxy_yaml(cluster, opts)?;
    let mut data = Map::new();
    data.insert("agent.yaml".into(), agent_yaml.clone().into());
    if let Some(np) = &node_proxy_yaml {
        data.insert("node-proxy.yaml".into(), np.clone().into());
    }
    let cm = json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "seedlink-shoot", "namespace": "kube-system"},
        "data": data,
    });
    let shoot_config = format!(
        "# The shoot's seedlink configuration for cluster {}, generated by `seedlink tunnel-config`:\n\
         # deploy/kustomize/shoot's ConfigMap seedlink-shoot (use it as a patch of that base).\n{}",
        cluster.name,
        serde_norway::to_string(&cm)?
    );
    Ok((agent_yaml, node_proxy_yaml, shoot_config))
}

/// The shoot agent's configuration file.
fn agent_yaml(
    cluster: &seedlink_tunnel::config::Cluster,
    opts: &Options,
    server: &str,
    server_name: &str,
) -> anyhow::Result<String> {
    let mut agent = serde_json::Map::new();
    agent.insert("server".into(), server.into());
    agent.insert("server_name".into(), server_name.into());
    agent.insert("ca_cert".into(), path(&opts.agent_ca_cert).into());
    if cluster.agent_ca.is_some() || cluster.agent_token.is_none() {
        agent.insert("agent_cert".into(), path(&opts.agent_cert).into());
        agent.insert("agent_key".into(), path(&opts.agent_key).into());
    } else {
        agent.insert(
            "service_account_token_path".into(),
            path(&opts.agent_token).into(),
        );
    }
    agent.insert("admin".into(), "0.0.0.0:8093".into());
    Ok(serde_norway::to_string(&serde_json::Value::Object(agent))?)
}

/// The destination GEP-30 names for a cluster's kube-apiserver.
fn istio_destination(cluster: &seedlink_tunnel::config::Cluster) -> String {
    format!(
        "outbound|443||kube-apiserver.{}.svc.cluster.local",
        cluster.name
    )
}

/// The node-proxy's configuration file, when the gateway is given (then
/// the advertised address is needed too).
fn node_proxy_yaml(
    cluster: &seedlink_tunnel::config::Cluster,
    opts: &Options,
) -> anyhow::Result<Option<String>> {
    let (gateway, address) = match (&opts.gateway, opts.advertise_address) {
        (Some(gateway), Some(address)) => (gateway, address),
        (Some(_), None) => bail!(
            "--gateway renders the node-proxy's configuration, which also needs --advertise-address (the address it serves)"
        ),
        (None, _) => return Ok(None),
    };
    let (mode, destination, check) = node_proxy_mode(cluster, opts)?;
    let host = opts.node_proxy_host.clone().unwrap_or_default();
    let np = serde_json::json!({
        "address": address.to_string(),
        "port": opts.kube_apiserver_port,
        "gateway": gateway,
        "mode": mode,
        "destination": destination,
        "cluster_id": opts.cluster_id.as_ref().filter(|_| mode == "proxy-v2"),
        "health_check": check,
        "link_kind": host.link_kind,
        "interface": host.interface,
        "admin": format!("127.0.0.1:{}", host.admin_port),
        "metrics": format!("[::]:{}", host.metrics_port),
    });
    Ok(Some(yaml_without_nulls(np)?))
}

/// `v` as YAML, its object's null fields left out.
fn yaml_without_nulls(mut v: serde_json::Value) -> anyhow::Result<String> {
    if let Some(m) = v.as_object_mut() {
        m.retain(|_, v| !v.is_null());
    }
    Ok(serde_norway::to_string(&v)?)
}

/// The node-proxy's mode, destination and health check: `proxy-v2` with
/// the cluster ID's TLV when only a cluster ID is given, else `connect`
/// with the destination (default Gardener's for the cluster).
fn node_proxy_mode(
    cluster: &seedlink_tunnel::config::Cluster,
    opts: &Options,
) -> anyhow::Result<(&'static str, Option<String>, &'static str)> {
    Ok(match (&opts.destination, &opts.cluster_id) {
        (None, Some(id)) => {
            if id.is_empty() || id.len() > 255 {
                bail!("cluster ID {id:?}: 1 to 255 bytes (a PROXY v2 TLV)");
            }
            // No CONNECT answer to wait for: ready while the gateway
            // accepts connections.
            ("proxy-v2", None, "tcp")
        }
        (destination, _) => {
            let destination = destination
                .clone()
                .unwrap_or_else(|| istio_destination(cluster));
            if let Err(why) = seedlink_proto::destination::parse(&destination) {
                bail!("destination {destination:?}: {why}");
            }
            // Ready only while a tunnel like a client's gets through to
            // this cluster's API server.
            ("connect", Some(destination), "tunnel")
        }
    })
}

impl Rendered {
    /// Everything as one text for a terminal.
    pub fn text(&self) -> String {
        // One argument per line, continued with `\` except the last.
        let args = |v: &[String]| {
            let real: Vec<_> = v.iter().filter(|a| !a.starts_with('#')).collect();
            let mut out = String::new();
            for (i, a) in real.iter().enumerate() {
                let cont = if i + 1 < real.len() { " \\" } else { "" };
                out.push_str(&format!("#   {a}{cont}\n"));
            }
            for a in v.iter().filter(|a| a.starts_with('#')) {
                out.push_str(&format!("{a}\n"));
            }
            out
        };
        format!(
            "{}---\n# kube-apiserver (the shoot's, in the seed):\n# kube-apiserver ... \\\n{}#\n# seedlink tunnel-agent (in the shoot):\n# seedlink tunnel-agent \\\n{}#\n# or upstream Konnectivity (works against the same server):\n# proxy-agent \\\n{}",
            self.egress_selector,
            args(&self.kube_apiserver_args),
            args(&self.tunnel_agent_args),
            args(&self.proxy_agent_args),
        ) + "---\n"
            + &self.shoot_config
    }

    /// An argument list as an args file: one per line, comments left out.
    fn args_file(v: &[String]) -> String {
        v.iter()
            .filter(|a| !a.starts_with('#'))
            .map(|a| format!("{a}\n"))
            .collect()
    }

    /// The files by name: `egress-selector-configuration.yaml`,
    /// `kube-apiserver.args`, `tunnel-agent.args` and `proxy-agent.args`
    /// (one argument per line), `agent.yaml`, `shoot-config.yaml` and,
    /// when rendered, `node-proxy.yaml`. The first two are
    /// kube-apiserver's ([`Rendered::KUBE_APISERVER_FILES`]), the rest the
    /// shoot's.
    pub fn files(&self) -> Vec<(&'static str, String)> {
        let mut files = vec![
            (
                "egress-selector-configuration.yaml",
                self.egress_selector.clone(),
            ),
            (
                "kube-apiserver.args",
                Self::args_file(&self.kube_apiserver_args),
            ),
            (
                "tunnel-agent.args",
                Self::args_file(&self.tunnel_agent_args),
            ),
            ("proxy-agent.args", Self::args_file(&self.proxy_agent_args)),
            ("agent.yaml", self.agent_yaml.clone()),
            ("shoot-config.yaml", self.shoot_config.clone()),
        ];
        if let Some(np) = &self.node_proxy_yaml {
            files.push(("node-proxy.yaml", np.clone()));
        }
        files
    }

    /// The files of [`Rendered::files`] that kube-apiserver mounts.
    pub const KUBE_APISERVER_FILES: [&'static str; 2] =
        ["egress-selector-configuration.yaml", "kube-apiserver.args"];

    /// Writes [`Rendered::files`] into `dir`.
    pub fn write(&self, dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let mut out = Vec::new();
        for (name, text) in self.files() {
            let p = dir.join(name);
            std::fs::write(&p, text).with_context(|| format!("writing {}", p.display()))?;
            out.push(p);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const CFG: &str = "agents: {listen: '0.0.0.0:8132', cert: c.pem, key: k.pem}
clusters:
  - name: a
    agent_ca: ca.pem
    frontends:
      - {name: uds, protocol: http-connect, unix: /run/seedlink/a.sock}
      - {name: grpc, protocol: grpc, unix: \"/run/seedlink/it's.sock\"}
      - {name: tcp, protocol: http-connect, tcp: '10.0.0.5:8090', cert: f.pem, key: f-key.pem, client_ca: kas-ca.pem}
      - {name: local, protocol: http-connect, tcp: '127.0.0.1:8091'}
      - {name: grpc-tcp, protocol: grpc, tcp: '10.0.0.5:8092', cert: f.pem, key: f-key.pem, client_ca: kas-ca.pem}
      - {name: prom, protocol: http-proxy, tcp: '127.0.0.1:3129'}
  - name: b
    agent_token: {issuer: 'https://b', keys: sa.pub}
    frontends: [{name: uds, protocol: http-connect, unix: /run/seedlink/b.sock}]
";

    fn yaml(s: &str) -> serde_json::Value {
        serde_norway::from_str(s).unwrap()
    }

    fn opts(cluster: &str, frontend: Option<&str>) -> Options {
        Options {
            frontend: frontend.map(str::to_string),
            agent_server: Some("tunnel.seed.example.com:443".into()),
            ..Options::new(cluster)
        }
    }

    #[test]
    fn every_frontend_kind_renders_or_says_why_not() {
        let cfg = ServerConfig::parse(CFG).unwrap();
        let r = render(&cfg, &opts("a", None)).unwrap();
        let v = yaml(&r.egress_selector);
        assert_eq!(v["kind"], "EgressSelectorConfiguration");
        let c = &v["egressSelections"][0];
        assert_eq!(c["name"], "cluster");
        assert_eq!(c["connection"]["proxyProtocol"], "HTTPConnect");
        assert_eq!(
            c["connection"]["transport"]["uds"]["udsName"],
            "/run/seedlink/a.sock"
        );
        assert!(r
            .tunnel_agent_args
            .contains(&"--server=tunnel.seed.example.com:443".to_string()));
        assert!(r
            .tunnel_agent_args
            .contains(&"--server-name=tunnel.seed.example.com".to_string()));
        assert!(r
            .tunnel_agent_args
            .iter()
            .any(|a| a.starts_with("--agent-cert=")));
        assert!(r
            .proxy_agent_args
            .contains(&"--proxy-server-port=443".to_string()));

        let g = yaml(
            &render(&cfg, &opts("a", Some("grpc")))
                .unwrap()
                .egress_selector,
        );
        let c = &g["egressSelections"][0]["connection"];
        assert_eq!(c["proxyProtocol"], "GRPC");
        assert_eq!(c["transport"]["uds"]["udsName"], "/run/seedlink/it's.sock");

        let t = yaml(
            &render(&cfg, &opts("a", Some("tcp")))
                .unwrap()
                .egress_selector,
        );
        let tcp = &t["egressSelections"][0]["connection"]["transport"]["tcp"];
        assert_eq!(tcp["url"], "https://10.0.0.5:8090");
        assert_eq!(
            tcp["tlsConfig"]["clientCert"],
            "/etc/kubernetes/tunnel/client.crt"
        );

        let l = yaml(
            &render(&cfg, &opts("a", Some("local")))
                .unwrap()
                .egress_selector,
        );
        let tcp = &l["egressSelections"][0]["connection"]["transport"]["tcp"];
        assert_eq!(tcp["url"], "http://127.0.0.1:8091");
        assert!(tcp.get("tlsConfig").is_none());

        let e = |c: &str, f: Option<&str>| format!("{:#}", render(&cfg, &opts(c, f)).unwrap_err());
        assert!(e("a", Some("grpc-tcp")).contains("only over a Unix socket"));
        assert!(e("a", Some("prom")).contains("http-proxy"));
        assert!(e("a", Some("nope")).contains("no frontend"));
        assert!(e("z", None).contains("clusters: a, b"));
        let mut o = opts("a", None);
        o.agent_server = None;
        assert!(format!("{:#}", render(&cfg, &o).unwrap_err()).contains("--agent-server"));

        let b = render(&cfg, &opts("b", None)).unwrap();
        assert!(b
            .tunnel_agent_args
            .iter()
            .any(|a| a.starts_with("--service-account-token-path=")));
        assert!(b
            .tunnel_agent_args
            .iter()
            .any(|a| a.contains("audience system:konnectivity-server")));
        assert!(!b
            .tunnel_agent_args
            .iter()
            .any(|a| a.starts_with("--agent-cert")));
    }

    /// The install's topology: TunnelClusters from Kubernetes, a shared
    /// mTLS frontend on every address, a template socket.
    #[test]
    fn a_tunnel_cluster_renders_through_the_shared_frontend() {
        let cfg = ServerConfig::parse(
            "agents: {listen: '0.0.0.0:8091', cert: c.pem, key: k.pem}
clusters: []
frontend_templates: [{name: uds, protocol: http-connect, unix: '/run/seedlink/{cluster}.sock'}]
shared_frontends:
  - {name: kas, protocol: http-connect, tcp: '0.0.0.0:8090', cert: f.pem, key: f-key.pem, client_ca: kas-ca.pem}
kubernetes: {lease: garden/seedlink-tunnel-status}
",
        )
        .unwrap();
        let mut o = opts("shoot--a.tunnel", Some("kas"));
        // A wildcard: where kube-apiserver reaches it must be said.
        let e = render(&cfg, &o).unwrap_err().to_string();
        assert!(e.contains("--frontend-address"), "{e}");
        o.frontend_address = Some("seedlink-internal.garden.svc:8090".into());
        let r = render(&cfg, &o).unwrap();
        let v = yaml(&r.egress_selector);
        let c = &v["egressSelections"][0]["connection"];
        assert_eq!(c["proxyProtocol"], "HTTPConnect");
        assert_eq!(
            c["transport"]["tcp"]["url"],
            "https://seedlink-internal.garden.svc:8090"
        );
        assert!(r.egress_selector.contains("must carry CN shoot--a.tunnel"));
        // Certificate trust for its agents (its agentCA).
        assert!(r
            .tunnel_agent_args
            .iter()
            .any(|a| a.starts_with("--agent-cert=")));
        // Without --frontend: the template's socket comes first.
        let r = render(&cfg, &opts("shoot--a.tunnel", None)).unwrap();
        assert!(r
            .egress_selector
            .contains("/run/seedlink/shoot--a.tunnel.sock"));
        // A cluster neither in the file nor possible without a source.
        let file_only = ServerConfig::parse(CFG).unwrap();
        let e = render(&file_only, &opts("ns.x", None))
            .unwrap_err()
            .to_string();
        assert!(e.contains("no cluster \"ns.x\""), "{e}");
    }

    #[test]
    fn kube_apiserver_gets_every_egress_entry_and_its_flags() {
        let cfg = ServerConfig::parse(CFG).unwrap();
        let r = render(&cfg, &opts("a", None)).unwrap();
        let v = yaml(&r.egress_selector);
        assert_eq!(v["apiVersion"], "apiserver.k8s.io/v1beta1");
        let names: Vec<_> = v["egressSelections"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["name"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(names, ["cluster", "controlplane", "etcd"]);
        assert_eq!(
            v["egressSelections"][1]["connection"]["proxyProtocol"],
            "Direct"
        );
        let flags = |r: &Rendered| -> Vec<String> {
            let args = r.kube_apiserver_args.iter();
            args.filter(|a| !a.starts_with('#')).cloned().collect()
        };
        assert_eq!(
            flags(&r),
            [
                "--egress-selector-config-file=/etc/kubernetes/egress/egress-selector-configuration.yaml",
                "--goaway-chance=0.001"
            ]
        );
        // Off, or past what kube-apiserver takes.
        let mut o = opts("a", None);
        o.goaway_chance = 0.0;
        assert!(!flags(&render(&cfg, &o).unwrap())
            .iter()
            .any(|a| a.starts_with("--goaway-chance")));
        o.goaway_chance = 0.05;
        let e = format!("{:#}", render(&cfg, &o).unwrap_err());
        assert!(e.contains("0 (off) to 0.02"), "{e}");

        let mut o = opts("b", None);
        o.egress_api_version = "v1alpha1".into();
        o.advertise_address = Some("10.1.2.3".parse().unwrap());
        let b = render(&cfg, &o).unwrap();
        assert_eq!(
            yaml(&b.egress_selector)["apiVersion"],
            "apiserver.k8s.io/v1alpha1"
        );
        let flags: Vec<_> = b
            .kube_apiserver_args
            .iter()
            .filter(|a| !a.starts_with('#'))
            .collect();
        assert!(flags.contains(&&"--service-account-issuer=https://b".to_string()));
        assert!(flags.contains(&&"--advertise-address=10.1.2.3".to_string()));
        assert!(!flags.iter().any(|a| a.starts_with("--api-audiences")));

        o.egress_api_version = "v1".into();
        let e = format!("{:#}", render(&cfg, &o).unwrap_err());
        assert!(e.contains("v1beta1 or v1alpha1"), "{e}");

        let mut o = opts("a", None);
        o.agent_token = "/run/x\n- name: etcd".into();
        let e = format!("{:#}", render(&cfg, &o).unwrap_err());
        assert!(e.contains("control character"), "{e}");
    }

    #[test]
    fn the_shoot_files_are_valid_configurations() {
        let cfg = ServerConfig::parse(CFG).unwrap();
        let mut o = opts("b", None);
        let r = render(&cfg, &o).unwrap();
        let agent = seedlink_tunnel::agent::config::AgentConfig::parse(&r.agent_yaml).unwrap();
        assert_eq!(agent.server, "tunnel.seed.example.com:443");
        assert!(agent.service_account_token_path.is_some());
        assert!(r.node_proxy_yaml.is_none());
        o.gateway = Some("api.seed.example.com:8443".into());
        let e = format!("{:#}", render(&cfg, &o).unwrap_err());
        assert!(e.contains("--advertise-address"), "{e}");
        o.advertise_address = Some("10.1.2.3".parse().unwrap());
        let r = render(&cfg, &o).unwrap();
        let np = seedlink_node_proxy::config::NodeProxyConfig::parse(
            r.node_proxy_yaml.as_deref().unwrap(),
        )
        .unwrap();
        assert_eq!(
            np.destination.as_deref(),
            Some("outbound|443||kube-apiserver.b.svc.cluster.local")
        );
        assert!(np.plan().is_ok());
        let cm = yaml(r.shoot_config.as_str());
        assert_eq!(cm["metadata"]["name"], "seedlink-shoot");
        assert_eq!(cm["data"]["agent.yaml"], r.agent_yaml.as_str());
        o.destination = Some("not a destination".into());
        assert!(render(&cfg, &o).is_err());
        // HyperShift's node path: PROXY v2 with the cluster ID's TLV.
        o.destination = None;
        o.cluster_id = Some("4a5b6c7d-0000-4000-8000-000000000001".into());
        let r = render(&cfg, &o).unwrap();
        let np = seedlink_node_proxy::config::NodeProxyConfig::parse(
            r.node_proxy_yaml.as_deref().unwrap(),
        )
        .unwrap();
        assert_eq!(np.mode, "proxy-v2");
        assert_eq!(np.cluster_id, o.cluster_id);
        assert_eq!(np.destination, None);
        assert!(np.plan().is_ok());
        o.cluster_id = Some(String::new());
        assert!(render(&cfg, &o).is_err());
    }

    #[test]
    fn written_files_hold_only_arguments() {
        let cfg = ServerConfig::parse(CFG).unwrap();
        let r = render(&cfg, &opts("b", None)).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let files = r.write(dir.path()).unwrap();
        assert_eq!(files.len(), 6);
        let args = std::fs::read_to_string(dir.path().join("tunnel-agent.args")).unwrap();
        assert!(args.lines().all(|l| l.starts_with("--")), "{args}");
        yaml(&std::fs::read_to_string(&files[0]).unwrap());
        assert!(r.text().contains("# seedlink tunnel-agent"));
    }
}

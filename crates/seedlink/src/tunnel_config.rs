//! `seedlink tunnel-config`: kube-apiserver's EgressSelectorConfiguration
//! and the agents' command lines for one cluster, rendered by
//! [`crate::egress`] from a tunnel-server configuration.

use std::path::PathBuf;

/// `seedlink tunnel-config` options.
#[derive(clap::Args)]
pub struct TunnelConfigArgs {
    /// The tunnel-server configuration (YAML).
    #[arg(long, short)]
    pub config: PathBuf,
    /// The cluster.
    #[arg(long)]
    pub cluster: String,
    /// The frontend kube-apiserver uses (default: the cluster's first
    /// http-connect or grpc frontend).
    #[arg(long)]
    pub frontend: Option<String>,
    /// Where agents reach the server (or the gateway in front of it),
    /// `host:port` (default: the agent endpoint, unless it is a wildcard).
    #[arg(long)]
    pub agent_server: Option<String>,
    /// TLS server name the agents ask for (default: the host of --agent-server).
    #[arg(long)]
    pub server_name: Option<String>,
    /// Where kube-apiserver reaches a TCP frontend, `host:port` (default:
    /// the frontend's address, unless it is a wildcard; for a shared
    /// frontend on 0.0.0.0, the Service in front of the tunnel-server).
    #[arg(long)]
    pub frontend_address: Option<String>,
    /// CA bundle path as kube-apiserver sees it (TCP+mTLS frontends).
    #[arg(long, default_value = "/etc/kubernetes/tunnel/ca.crt")]
    pub kas_ca: PathBuf,
    /// kube-apiserver's client certificate path (TCP+mTLS frontends).
    #[arg(long, default_value = "/etc/kubernetes/tunnel/client.crt")]
    pub kas_cert: PathBuf,
    /// Its key path.
    #[arg(long, default_value = "/etc/kubernetes/tunnel/client.key")]
    pub kas_key: PathBuf,
    /// The server's CA path as the agent sees it.
    #[arg(long, default_value = "/etc/seedlink/tunnel-ca.crt")]
    pub agent_ca_cert: PathBuf,
    /// The agent's client certificate path (clusters trusting a CA).
    #[arg(long, default_value = "/etc/seedlink/agent.crt")]
    pub agent_cert: PathBuf,
    /// Its key path.
    #[arg(long, default_value = "/etc/seedlink/agent.key")]
    pub agent_key: PathBuf,
    /// The agent's projected token path (clusters trusting tokens).
    #[arg(
        long,
        default_value = "/var/run/secrets/tokens/konnectivity-agent-token"
    )]
    pub agent_token: PathBuf,
    /// The EgressSelectorConfiguration version (kube-apiserver reads
    /// apiserver.k8s.io/v1beta1 and v1alpha1).
    #[arg(long, default_value = "v1beta1")]
    pub egress_api_version: String,
    /// Where kube-apiserver finds the egress selector file (the path its
    /// --egress-selector-config-file names).
    #[arg(
        long,
        default_value = "/etc/kubernetes/egress/egress-selector-configuration.yaml"
    )]
    pub egress_file: PathBuf,
    /// GEP-08: the address the node-proxy serves `kubernetes` on at every
    /// node; kube-apiserver advertises it.
    #[arg(long)]
    pub advertise_address: Option<std::net::IpAddr>,
    /// Where the shoot's node-proxies reach the gateway's http-connect
    /// listener, host:port (with --advertise-address: node-proxy.yaml is
    /// rendered).
    #[arg(long)]
    pub gateway: Option<String>,
    /// The node-proxy's destination header value (default:
    /// outbound|443||kube-apiserver.<cluster>.svc.cluster.local).
    #[arg(long)]
    pub destination: Option<String>,
    /// HyperShift's node path: the hosted cluster's ID. With --gateway
    /// naming a PROXY listener that routes by it (and no --destination),
    /// the node-proxy sends PROXY v2 with the ID in TLV 0x20.
    #[arg(long, conflicts_with = "destination")]
    pub cluster_id: Option<String>,
    /// kube-apiserver's secure port: the `kubernetes` endpoint's port, which
    /// the node-proxy serves on the advertised address.
    #[arg(long, default_value_t = 443)]
    pub kube_apiserver_port: u16,
    /// kube-apiserver's --goaway-chance, rendered with its flags: the
    /// share of HTTP/2 requests after which a client is told to reconnect,
    /// so that its next connection may reach another replica behind the
    /// gateway's passthrough (0: not rendered; at most 0.02).
    #[arg(long, default_value_t = crate::egress::GOAWAY_CHANCE)]
    pub goaway_chance: f64,
    /// Write egress-selector-configuration.yaml, kube-apiserver.args,
    /// tunnel-agent.args, proxy-agent.args, agent.yaml, shoot-config.yaml
    /// (and node-proxy.yaml) into this directory instead of printing.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// Prints (or writes) the files for one cluster; returns the exit code.
pub fn tunnel_config(a: TunnelConfigArgs) -> anyhow::Result<i32> {
    use anyhow::Context;
    let text = std::fs::read_to_string(&a.config)
        .with_context(|| format!("reading {}", a.config.display()))?;
    let cfg = seedlink_tunnel::config::ServerConfig::parse(&text)
        .with_context(|| format!("{}", a.config.display()))?;
    // What it prints must work: a CA or key that does not exist is an error.
    let missing = cfg.check_files();
    if !missing.is_empty() {
        anyhow::bail!(
            "{}: {}",
            a.config.display(),
            seedlink_config::Errors(missing)
        );
    }
    let opts = crate::egress::Options {
        cluster: a.cluster,
        frontend: a.frontend,
        agent_server: a.agent_server,
        server_name: a.server_name,
        frontend_address: a.frontend_address,
        kas_ca: a.kas_ca,
        kas_cert: a.kas_cert,
        kas_key: a.kas_key,
        agent_ca_cert: a.agent_ca_cert,
        agent_cert: a.agent_cert,
        agent_key: a.agent_key,
        agent_token: a.agent_token,
        egress_api_version: a.egress_api_version,
        egress_file: a.egress_file,
        advertise_address: a.advertise_address,
        gateway: a.gateway,
        destination: a.destination,
        cluster_id: a.cluster_id,
        kube_apiserver_port: a.kube_apiserver_port,
        node_proxy_host: None,
        goaway_chance: a.goaway_chance,
    };
    let r = crate::egress::render(&cfg, &opts)?;
    match a.out {
        Some(dir) => {
            for f in r.write(&dir)? {
                println!("wrote {}", f.display());
            }
        }
        None => print!("{}", r.text()),
    }
    Ok(0)
}

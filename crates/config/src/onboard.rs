//! `seedlink onboard`'s configuration file (docs/KUBERNETES.md,
//! "Onboarding a control plane").

use serde::Deserialize;

use crate::compile::{ConfigError, Errors};

/// What the onboarding controller is told about the install.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OnboardConfig {
    /// `namespace/name` of the Lease that elects the replica that writes.
    pub lease: String,
    /// `namespace/name` of the Gateway the generated TLSRoutes attach to.
    pub gateway: String,
    /// `namespace/name` of the tunnel-server's ServiceAccount, which the
    /// generated RoleBindings let read the trust Secrets.
    pub tunnel_reader: String,
    /// The ClusterRole those RoleBindings grant (the chart's
    /// `seedlink-tunnel-trust`).
    #[serde(default = "trust_role")]
    pub trust_role: String,
    /// The ClusterRole granting ConfigMaps only (the chart's
    /// `seedlink-tunnel-trust-configmaps`), bound instead where a control
    /// plane's TunnelCluster names no Secret.
    #[serde(default = "trust_role_config_maps")]
    pub trust_role_config_maps: String,
    /// A label set to `"true"` on every namespace holding a control plane
    /// (the Gateway's `allowedRoutes` selector); absent: the operator
    /// labels namespaces.
    #[serde(default)]
    pub namespace_label: Option<String>,
    /// kube-apiserver's egress selector file and flags, and the shoot's
    /// agent files, rendered per control plane as `seedlink tunnel-config`
    /// renders them; absent: not generated.
    #[serde(default)]
    pub render: Option<RenderConfig>,
    /// How long the certificates it issues are valid.
    #[serde(default)]
    pub certificates: Certificates,
    /// Its admin endpoint (`/healthz`, `/readyz`, `/metrics`); absent:
    /// none.
    #[serde(default)]
    pub admin: Option<crate::model::Admin>,
}

/// Validity of the issued certificates (`humantime`: `3650d`, `1h`); each
/// is renewed with a third of it left.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Certificates {
    /// An agent CA (default 3650 days).
    #[serde(default = "ca_validity")]
    pub ca_validity: String,
    /// The agents' certificate (default 365 days).
    #[serde(default = "leaf_validity")]
    pub leaf_validity: String,
}

impl Default for Certificates {
    fn default() -> Certificates {
        Certificates {
            ca_validity: ca_validity(),
            leaf_validity: leaf_validity(),
        }
    }
}

fn ca_validity() -> String {
    "3650d".into()
}

fn leaf_validity() -> String {
    "365d".into()
}

impl Certificates {
    /// The two validities: (CA, agents' certificate).
    pub fn durations(
        &self,
    ) -> Result<(std::time::Duration, std::time::Duration), Vec<ConfigError>> {
        let read = |key: &str, v: &str| {
            humantime::parse_duration(v)
                .map_err(|e| ConfigError::new(format!("certificates.{key}"), format!("{v:?}: {e}")))
        };
        let ca = read("ca_validity", &self.ca_validity);
        let leaf = read("leaf_validity", &self.leaf_validity);
        const CENTURY: std::time::Duration = std::time::Duration::from_secs(100 * 365 * 86_400);
        match (ca, leaf) {
            (Ok(ca), Ok(_)) if ca > CENTURY => Err(vec![ConfigError::new(
                "certificates.ca_validity",
                "over 100 years",
            )]),
            // Rotation keeps the old CA trusted for one certificate
            // validity from a third of the CA's left: the certificates it
            // signed must end before it does.
            (Ok(ca), Ok(leaf)) if leaf > ca / 3 => Err(vec![ConfigError::new(
                "certificates.leaf_validity",
                "over a third of ca_validity: a certificate would outlive its CA's rotation",
            )]),
            (Ok(_), Ok(leaf)) if leaf < std::time::Duration::from_secs(60) => {
                Err(vec![ConfigError::new(
                    "certificates.leaf_validity",
                    "under a minute: renewed before an agent could use it",
                )])
            }
            (Ok(ca), Ok(leaf)) => Ok((ca, leaf)),
            (a, b) => Err([a.err(), b.err()].into_iter().flatten().collect()),
        }
    }
}

/// What the renderer needs besides the control plane.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RenderConfig {
    /// The tunnel-server's configuration file (its frontend templates and
    /// shared frontends are what kube-apiserver dials).
    pub tunnel_config: std::path::PathBuf,
    /// Where the shoot's agents reach the tunnel-server, `host:port`.
    pub agent_server: String,
    /// The TLS server name the agents ask for (default: the host of
    /// `agent_server`).
    #[serde(default)]
    pub server_name: Option<String>,
    /// Where kube-apiserver reaches the tunnel-server's TCP frontend,
    /// `host:port` (default: the frontend's address, or the Service in
    /// front of a shared one on a wildcard).
    #[serde(default)]
    pub frontend_address: Option<String>,
    /// The CA the agents verify the tunnel-server with (PEM), shipped in
    /// the shoot's Secret as `tunnel-ca.crt`.
    pub server_ca: std::path::PathBuf,
    /// The CA the shared TCP+mTLS frontend trusts for kube-apiserver's
    /// client certificates: set, each control plane gets one
    /// (`Secret/<name>-kube-apiserver-tunnel`); absent, the platform
    /// issues it.
    #[serde(default)]
    pub kube_apiserver_client_ca: Option<KeyPairFiles>,
    /// The image of the shoot's agent: set, each control plane also gets
    /// its shoot's side as manifests (`Secret/<name>-shoot-manifests`).
    #[serde(default)]
    pub agent_image: Option<String>,
    /// The shoot's node-proxy (GEP-08): set, with `agent_image`, a control
    /// plane that names `spec.nodes.destinations` also gets the
    /// node-proxy's DaemonSet in its shoot manifests, and kube-apiserver
    /// advertises `address`.
    #[serde(default)]
    pub node_proxy: Option<NodeProxyRender>,
}

/// The node-proxy the shoot manifests carry: what is the same for every
/// shoot of the install.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeProxyRender {
    /// Where the shoot's nodes reach the gateway's `http-connect`
    /// listener, `host:port`.
    pub gateway: String,
    /// The address it serves `kubernetes` on at every node, which
    /// kube-apiserver advertises (GEP-08's `10.250.255.254` by default).
    #[serde(default = "advertise_address")]
    pub address: std::net::IpAddr,
    /// The link that carries `address`: `dummy`, `bridge`, `existing` or
    /// `none` (default `dummy`).
    #[serde(default = "dummy")]
    pub link_kind: String,
    /// That link's name (default `apiserver-proxy`).
    #[serde(default = "link_name")]
    pub interface: String,
    /// Its loopback admin port (default 9911; probes and `/config`).
    #[serde(default = "admin_port")]
    pub admin_port: u16,
    /// Its `/metrics` port on the node's addresses (default 16910).
    #[serde(default = "metrics_port")]
    pub metrics_port: u16,
    /// Where the shoot's nodes reach a gateway `proxy` listener that
    /// routes by the cluster ID's TLV (`route_by_tlv`), `host:port`. With
    /// it, a control plane that names `spec.nodes.clusterID` and no
    /// destination gets a node-proxy in `proxy-v2` mode sending that ID
    /// (HyperShift's node path); without it, such a control plane gets no
    /// node-proxy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxy_gateway: Option<String>,
}

fn advertise_address() -> std::net::IpAddr {
    std::net::IpAddr::from([10, 250, 255, 254])
}

fn dummy() -> String {
    "dummy".into()
}

fn link_name() -> String {
    "apiserver-proxy".into()
}

fn admin_port() -> u16 {
    9911
}

fn metrics_port() -> u16 {
    16910
}

/// Whether `v` is `host:port` with a host and a port other than 0.
fn host_and_port(v: &str) -> bool {
    v.rsplit_once(':')
        .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p != 0))
}

impl NodeProxyRender {
    /// What is wrong with it, keyed under `render.node_proxy`.
    fn problems(&self) -> Vec<ConfigError> {
        let at = |k: &str| format!("render.node_proxy.{k}");
        let mut out = Vec::new();
        if !host_and_port(&self.gateway) {
            out.push(ConfigError::new(
                at("gateway"),
                format!("{:?} is not host:port", self.gateway),
            ));
        }
        if let Some(g) = self.proxy_gateway.as_ref().filter(|g| !host_and_port(g)) {
            out.push(ConfigError::new(
                at("proxy_gateway"),
                format!("{g:?} is not host:port"),
            ));
        }
        if !["dummy", "bridge", "existing", "none"].contains(&self.link_kind.as_str()) {
            out.push(ConfigError::new(
                at("link_kind"),
                format!("{:?}: one of dummy, bridge, existing, none", self.link_kind),
            ));
        }
        if self.interface.is_empty() || self.interface.len() > 15 {
            out.push(ConfigError::new(
                at("interface"),
                "a link name has 1 to 15 characters",
            ));
        }
        if self.admin_port == 0 || self.metrics_port == 0 || self.admin_port == self.metrics_port {
            out.push(ConfigError::new(
                at("admin_port"),
                "admin_port and metrics_port: two different ports, neither 0",
            ));
        }
        out
    }
}

/// A certificate and its key, as files (PEM).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyPairFiles {
    /// The certificate.
    pub cert: std::path::PathBuf,
    /// Its key (PKCS#8 or SEC1).
    pub key: std::path::PathBuf,
}

fn trust_role() -> String {
    "seedlink-tunnel-trust".into()
}

fn trust_role_config_maps() -> String {
    "seedlink-tunnel-trust-configmaps".into()
}

/// `namespace/name` split, if it is one.
pub fn namespaced(v: &str) -> Option<(&str, &str)> {
    match v.split_once('/') {
        Some((ns, name)) if !ns.is_empty() && !name.is_empty() && !name.contains('/') => {
            Some((ns, name))
        }
        _ => None,
    }
}

impl OnboardConfig {
    /// Reads the file's text: the model, or every problem with its key.
    pub fn parse(text: &str) -> Result<OnboardConfig, Errors> {
        let c: OnboardConfig = serde_norway::from_str(text)
            .map_err(|e| Errors(vec![ConfigError::new("", e.to_string())]))?;
        let mut problems: Vec<ConfigError> = [
            ("lease", &c.lease),
            ("gateway", &c.gateway),
            ("tunnel_reader", &c.tunnel_reader),
        ]
        .into_iter()
        .filter(|(_, v)| namespaced(v).is_none())
        .map(|(k, v)| ConfigError::new(k, format!("expected namespace/name, got {v:?}")))
        .collect();
        if let Err(e) = c.certificates.durations() {
            problems.extend(e);
        }
        if let Some(np) = c.render.as_ref().and_then(|r| r.node_proxy.as_ref()) {
            problems.extend(np.problems());
        }
        if problems.is_empty() {
            Ok(c)
        } else {
            Err(Errors(problems))
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_file_needs_namespace_and_name_and_knows_its_keys() {
        let c =
            OnboardConfig::parse("lease: s/l\ngateway: s/g\ntunnel_reader: s/seedlink\n").unwrap();
        assert_eq!(c.trust_role, "seedlink-tunnel-trust");
        assert_eq!(c.namespace_label, None);
        let e = OnboardConfig::parse("lease: l\ngateway: s/g/x\ntunnel_reader: s/seedlink\n")
            .unwrap_err();
        let text = e.to_string();
        assert!(text.contains("lease") && text.contains("gateway"), "{text}");
        assert!(
            OnboardConfig::parse("lease: s/l\ngateway: s/g\ntunnel_reader: s/x\nextra: 1\n")
                .is_err()
        );
    }

    #[test]
    fn the_node_proxy_has_defaults_and_its_mistakes_are_named() {
        let head = "lease: s/l\ngateway: s/g\ntunnel_reader: s/x\nrender: {tunnel_config: t, agent_server: 'a:1', server_ca: c, node_proxy: ";
        let c = OnboardConfig::parse(&format!("{head}{{gateway: 'gw.seed:8443'}}}}\n")).unwrap();
        let np = c.render.unwrap().node_proxy.unwrap();
        assert_eq!(np.address.to_string(), "10.250.255.254");
        assert_eq!(
            (np.link_kind.as_str(), np.interface.as_str()),
            ("dummy", "apiserver-proxy")
        );
        assert_eq!((np.admin_port, np.metrics_port), (9911, 16910));
        assert_eq!(np.proxy_gateway, None);
        let e = OnboardConfig::parse(&format!(
            "{head}{{gateway: 'gw.seed', proxy_gateway: 'gw', link_kind: tun, interface: '', admin_port: 1, metrics_port: 1}}}}\n"
        ))
        .unwrap_err()
        .to_string();
        for k in [
            "gateway",
            "proxy_gateway",
            "link_kind",
            "interface",
            "admin_port",
        ] {
            assert!(e.contains(&format!("render.node_proxy.{k}")), "{k}: {e}");
        }
    }
}

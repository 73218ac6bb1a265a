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
    /// A label set to `"true"` on every namespace holding a control plane
    /// (the Gateway's `allowedRoutes` selector); absent: the operator
    /// labels namespaces.
    #[serde(default)]
    pub namespace_label: Option<String>,
}

fn trust_role() -> String {
    "seedlink-tunnel-trust".into()
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
        let problems: Vec<ConfigError> = [
            ("lease", &c.lease),
            ("gateway", &c.gateway),
            ("tunnel_reader", &c.tunnel_reader),
        ]
        .into_iter()
        .filter(|(_, v)| namespaced(v).is_none())
        .map(|(k, v)| ConfigError::new(k, format!("expected namespace/name, got {v:?}")))
        .collect();
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
}

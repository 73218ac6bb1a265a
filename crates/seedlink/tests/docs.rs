//! Every YAML example in the documentation is checked: each ```yaml block
//! in README.md and docs/*.md must be preceded by a `<!-- check: KIND -->`
//! line, and is validated as that kind:
//! - `gateway`: a complete gateway configuration (what `check-config` does);
//! - `gateway-part`: top-level keys of a gateway configuration, completed
//!   with a minimal listener and control plane where the block has none;
//! - `tunnel` / `tunnel-part`: the same for a tunnel-server configuration;
//! - `tunnel-agent`, `node-proxy`: a whole `--config` file of that role,
//!   every value checked (the files it names are not read: they are paths
//!   on a node);
//! - `kubernetes`: a `SeedlinkPolicy` or `TunnelCluster`, read as the Rust
//!   type and written back: any field the type does not know (a typo the
//!   API server would prune) shows as a difference;
//! - `other`: not a seedlink configuration (other Kubernetes objects,
//!   Prometheus), parsed as YAML only.
//!
//! An untagged block fails the test, so a new example cannot skip the check.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

use serde_norway::{Mapping, Value};

const GATEWAY_BASE: &str = "listeners: [{name: base, address: '127.0.0.1:0'}]
control_planes: [{name: base, hostnames: [base.example.com], endpoints: ['127.0.0.1:1']}]
";
const TUNNEL_BASE: &str = "agents: {listen: '127.0.0.1:0', cert: /etc/seedlink/tunnel.pem, key: /etc/seedlink/tunnel-key.pem}
clusters: [{name: base, agent_ca: /etc/seedlink/base/agent-ca.pem}]
";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// (file, line, kind, text) of every YAML block.
fn blocks() -> Vec<(String, usize, String, String)> {
    let mut files = vec![root().join("README.md")];
    let mut docs: Vec<_> = std::fs::read_dir(root().join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    let mut out = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        let mut i = 0;
        while i < lines.len() {
            if lines[i].trim_start().starts_with("```yaml") {
                let kind = i
                    .checked_sub(1)
                    .and_then(|p| lines[p].trim().strip_prefix("<!-- check:"))
                    .and_then(|k| k.strip_suffix("-->"))
                    .map(|k| k.trim().to_string())
                    .unwrap_or_default();
                let start = i + 1;
                let mut end = start;
                while end < lines.len() && !lines[end].trim_start().starts_with("```") {
                    end += 1;
                }
                out.push((
                    f.strip_prefix(root()).unwrap_or(&f).display().to_string(),
                    i + 1,
                    kind,
                    lines[start..end].join("\n") + "\n",
                ));
                i = end;
            }
            i += 1;
        }
    }
    out
}

/// The block's top-level keys over `base`'s.
fn complete(base: &str, part: &str) -> String {
    let mut merged: Mapping = serde_norway::from_str(base).unwrap();
    let part: Mapping = serde_norway::from_str(part).unwrap_or_else(|e| panic!("{e}"));
    for (k, v) in part {
        merged.insert(k, v);
    }
    serde_norway::to_string(&Value::Mapping(merged)).unwrap()
}

fn check_gateway(text: &str) -> Result<(), String> {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("gateway.yaml");
    std::fs::write(&p, text).unwrap();
    seedlink_config::load(&p, None).map(|_| ()).map_err(|e| {
        e.0.iter()
            .map(|e| format!("{}: {}", e.path, e.message))
            .collect::<Vec<_>>()
            .join("; ")
    })
}

fn check_tunnel(text: &str) -> Result<(), String> {
    seedlink_tunnel::config::ServerConfig::parse(text)
        .map(|_| ())
        .map_err(|e| format!("{e:#}"))
}

fn problems(errs: Vec<seedlink_config::ConfigError>) -> Result<(), String> {
    if errs.is_empty() {
        return Ok(());
    }
    Err(errs
        .iter()
        .map(|e| format!("{}: {}", e.path, e.message))
        .collect::<Vec<_>>()
        .join("; "))
}

fn check_agent(text: &str) -> Result<(), String> {
    let cfg =
        seedlink_tunnel::agent::config::AgentConfig::parse(text).map_err(|e| e.to_string())?;
    problems(cfg.check_values())
}

fn check_node_proxy(text: &str) -> Result<(), String> {
    let cfg =
        seedlink_node_proxy::config::NodeProxyConfig::parse(text).map_err(|e| e.to_string())?;
    problems(cfg.check())
}

#[test]
fn every_yaml_example_in_the_docs_is_valid() {
    let all = blocks();
    assert!(all.len() >= 10, "found only {} YAML blocks", all.len());
    let mut problems = Vec::new();
    for (file, line, kind, text) in &all {
        let r = match kind.as_str() {
            "gateway" => check_gateway(text),
            "gateway-part" => check_gateway(&complete(GATEWAY_BASE, text)),
            "tunnel" => check_tunnel(text),
            "tunnel-part" => check_tunnel(&complete(TUNNEL_BASE, text)),
            "tunnel-agent" => check_agent(text),
            "node-proxy" => check_node_proxy(text),
            "kubernetes" => check_kubernetes(text),
            "other" => serde_norway::from_str::<Value>(text)
                .map(|_| ())
                .map_err(|e| e.to_string()),
            "" => Err("no `<!-- check: KIND -->` line before the block".into()),
            k => Err(format!("unknown check kind {k:?}")),
        };
        if let Err(e) = r {
            problems.push(format!("{file}:{line} ({kind}): {e}"));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// CONFIG.md's full example is `examples/gateway.yaml`, byte for byte.
#[test]
fn config_md_shows_the_example_file() {
    let example = std::fs::read_to_string(root().join("examples/gateway.yaml")).unwrap();
    let shown = blocks()
        .into_iter()
        .find(|(f, _, k, _)| f.ends_with("CONFIG.md") && k == "gateway")
        .map(|(_, _, _, t)| t)
        .expect("CONFIG.md has a full gateway example");
    assert_eq!(
        shown, example,
        "CONFIG.md's full example differs from examples/gateway.yaml"
    );
}

/// A seedlink resource, strictly: read as its type, written back, equal.
fn check_kubernetes(text: &str) -> Result<(), String> {
    fn roundtrip<T: serde::de::DeserializeOwned + serde::Serialize>(
        v: serde_json::Value,
    ) -> Result<(), String> {
        let typed: T = serde_json::from_value(v.clone()).map_err(|e| e.to_string())?;
        let back = serde_json::to_value(&typed).map_err(|e| e.to_string())?;
        if back == v {
            Ok(())
        } else {
            Err(format!(
                "fields the type does not know, or wrong: wrote back {back}"
            ))
        }
    }
    let v: serde_json::Value = serde_norway::from_str(text).map_err(|e| e.to_string())?;
    match v["kind"].as_str() {
        Some("SeedlinkPolicy") => roundtrip::<seedlink_kube::crd::SeedlinkPolicy>(v),
        Some("TunnelCluster") => roundtrip::<seedlink_kube::crd::TunnelCluster>(v),
        Some("SeedlinkControlPlane") => roundtrip::<seedlink_kube::crd::SeedlinkControlPlane>(v),
        k => Err(format!("not a seedlink resource: kind {k:?}")),
    }
}

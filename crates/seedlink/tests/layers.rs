//! The binary's library keeps its roles apart, enforced over the module
//! graph read by `seedlink-layering` (syn). The rules (docs/ARCHITECTURE.md,
//! "Layers"):
//! 1. a role (`roles::gateway`, `roles::tunnel`, `roles::node_proxy`)
//!    never uses another; `roles::seed` is the one module that runs two;
//! 2. the supervisor and the shared helpers (`check`, `egress`,
//!    `tunnel_config`, `demo`) use no role;
//! 3. only the quickstart (a demo of every path) uses both a role and
//!    the demo backends.
//!
//! `each_rule_catches_an_injected_violation` shows every rule failing on
//! a violation put into a copy of the real graph.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;

use seedlink_layering::Graph;

const ROLES: [&str; 3] = ["roles::gateway", "roles::tunnel", "roles::node_proxy"];

fn problems(g: &Graph) -> Vec<String> {
    let mut out = Vec::new();
    for (m, module) in &g.modules {
        let role_used: Vec<&String> = module
            .uses
            .iter()
            .filter(|u| ROLES.contains(&u.as_str()))
            .collect();
        if ROLES.contains(&m.as_str()) && !role_used.is_empty() {
            out.push(format!("roles: {m} uses {role_used:?}"));
        }
        if [
            "supervisor",
            "check",
            "egress",
            "tunnel_config",
            "demo",
            "roles",
        ]
        .contains(&m.as_str())
            && !role_used.is_empty()
        {
            out.push(format!("helpers: {m} uses {role_used:?}"));
        }
        if m != "roles::seed" && m != "quickstart" && role_used.len() > 1 {
            out.push(format!(
                "only roles::seed runs two roles: {m} uses {role_used:?}"
            ));
        }
        if m != "quickstart"
            && m != "quickstart_tunnel"
            && module.uses.contains("demo")
            && !role_used.is_empty()
        {
            out.push(format!("demo: {m} uses a role and the demo backends"));
        }
    }
    out
}

fn graph() -> Graph {
    Graph::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src")).unwrap()
}

#[test]
fn the_roles_keep_apart() {
    let g = graph();
    assert!(
        g.modules.contains_key("roles::seed"),
        "{:?}",
        g.modules.keys()
    );
    let found = problems(&g);
    assert!(found.is_empty(), "{}", found.join("\n"));
}

#[test]
fn each_rule_catches_an_injected_violation() {
    let g = graph();
    let uses = |from: &str, to: &[&str]| {
        let mut g = g.clone();
        for t in to {
            g.modules.get_mut(from).unwrap().uses.insert(t.to_string());
        }
        problems(&g)
    };
    let has = |found: Vec<String>, what: &str| {
        assert!(
            found.iter().any(|l| l.contains(what)),
            "no {what:?} in {found:?}"
        );
    };
    has(
        uses("roles::gateway", &["roles::tunnel"]),
        "roles: roles::gateway uses",
    );
    has(
        uses("supervisor", &["roles::node_proxy"]),
        "helpers: supervisor uses",
    );
    has(
        uses("check", &["roles::gateway", "roles::tunnel"]),
        "only roles::seed runs two roles: check",
    );
    has(
        uses("roles::seed", &["demo"]),
        "demo: roles::seed uses a role and the demo backends",
    );
}

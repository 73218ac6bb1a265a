//! The gateway crate's module layers, enforced over the module graph read
//! by `seedlink-layering` (syn). The rules (docs/ARCHITECTURE.md,
//! "Layers"):
//! 1. a module uses its own layer or lower: `metrics` is layer 0;
//!    `upstream`, `paths` (the record of the paths in use) and `state`
//!    (the shared `Gateway`) are layer 1; the
//!    connection paths `conn`, `h2conn` and the `admin` endpoint layer 2;
//!    the crate root, which binds, serves, reloads and drains, layer 3;
//! 2. the paths keep their direction: `conn` hands HTTP/2 to `h2conn`,
//!    never the reverse; `admin` observes and uses no connection path;
//! 3. the parsers the paths rely on (the `seedlink-proto` crate) are
//!    sans-IO: no runtime, locks, sockets, files or clock.
//!
//! `each_rule_catches_an_injected_violation` shows every rule failing on
//! a violation put into a copy of the real graph.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;

use seedlink_layering::{does_io, Graph};

fn layer(m: &str) -> Option<u8> {
    Some(match m.split("::").next().unwrap_or("") {
        "metrics" => 0,
        "upstream" | "paths" | "state" => 1,
        "conn" | "h2conn" | "admin" => 2,
        "" => 3,
        _ => return None,
    })
}

fn problems(gateway: &Graph, proto: &Graph) -> Vec<String> {
    let mut out = Vec::new();
    for (m, module) in &gateway.modules {
        let Some(own) = layer(m) else {
            out.push(format!("module {m} has no layer"));
            continue;
        };
        for u in &module.uses {
            if layer(u).is_some_and(|l| l > own) {
                out.push(format!("layers: {m} uses {u}"));
            }
        }
    }
    for (from, to) in [("h2conn", "conn"), ("admin", "conn"), ("admin", "h2conn")] {
        if gateway.reach(from).contains(to) {
            out.push(format!("direction: {from} reaches {to}"));
        }
    }
    for (m, module) in &proto.modules {
        for name in module.outside.iter().filter(|n| does_io(n)) {
            out.push(format!("sans-IO: proto::{m} uses {name}"));
        }
    }
    out
}

fn load(krate: &str) -> Graph {
    Graph::load(
        &Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(krate)
            .join("src"),
    )
    .unwrap()
}

#[test]
fn the_gateway_crate_holds_its_layers() {
    let (g, p) = (load("gateway"), load("proto"));
    assert!(g.modules.contains_key("conn") && p.modules.contains_key("client_hello"));
    let found = problems(&g, &p);
    assert!(found.is_empty(), "{}", found.join("\n"));
}

#[test]
fn each_rule_catches_an_injected_violation() {
    let (g, p) = (load("gateway"), load("proto"));
    let uses = |from: &str, to: &str| {
        let mut g = g.clone();
        g.modules.get_mut(from).unwrap().uses.insert(to.into());
        problems(&g, &p)
    };
    let has = |found: Vec<String>, what: &str| {
        assert!(
            found.iter().any(|l| l.contains(what)),
            "no {what:?} in {found:?}"
        );
    };
    has(uses("metrics", "upstream"), "layers: metrics uses upstream");
    has(uses("upstream", "conn"), "layers: upstream uses conn");
    has(uses("state", ""), "layers: state uses ");
    let mut rogue = g.clone();
    rogue.modules.insert("rogue".into(), Default::default());
    has(problems(&rogue, &p), "module rogue has no layer");
    has(uses("h2conn", "conn"), "direction: h2conn reaches conn");
    has(uses("admin", "h2conn"), "direction: admin reaches h2conn");
    let mut io_proto = p.clone();
    io_proto
        .modules
        .get_mut("proxy_header")
        .unwrap()
        .outside
        .insert("tokio::net::TcpStream".into());
    has(
        problems(&g, &io_proto),
        "sans-IO: proto::proxy_header uses tokio::net::TcpStream",
    );
}

//! The tunnel crate's module layers, enforced over the module graph read
//! by `seedlink-layering` (syn): every reference, in `use` trees and in
//! code, by `crate::`, `super::`, `self::` or a child's name. The rules
//! (docs/ARCHITECTURE.md, "Layers"):
//! 1. a top-level module uses its own layer or lower, and the top-level
//!    modules have no cycle;
//! 2. the link machines (`server::link`, `agent::link`) and everything they
//!    reach are sans-IO: no tokio, no locks, no sockets or files, no clock;
//! 3. the server's connection handlers never reach `server::run`, and the
//!    server's modules have no cycle;
//! 4. neither role reaches the other; the agent does not use the server's
//!    configuration.
//!
//! `each_rule_catches_an_injected_violation` shows that every rule fails
//! on a violation put into a copy of the real graph.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;

use seedlink_layering::{cycles, does_io, Graph};

/// Layer of a top-level module; a module may use its own layer and lower.
fn layer(module: &str) -> Option<u8> {
    Some(match module {
        // The crate root (the map and its re-exports).
        "" => 9,
        // Packets, dial failures, SOCKS5's codes: pure data.
        "wire" => 1,
        // Flow (the send window, the receive queue, the fair send queue),
        // deadlines, the clock, the flood budget.
        "stream" => 2,
        // gRPC, the native transport, TLS records, authority, GOAWAY.
        "transport" => 3,
        // TLS identities, tokens, TokenReview.
        "auth" => 4,
        // The tunnel-server's configuration model.
        "config" => 5,
        // The roles.
        "server" | "agent" => 6,
        _ => return None,
    })
}

/// A unit of rule 1: a module of a layer folder (`wire::proto`), or a
/// top-level module that is not a folder of layers (`config`, `server`).
fn top(m: &str) -> Option<String> {
    let mut parts = m.split("::");
    let first = parts.next().unwrap_or("");
    Some(match (first, parts.next()) {
        ("wire" | "stream" | "transport" | "auth", Some(second)) => format!("{first}::{second}"),
        _ => first.to_string(),
    })
}

/// The server's own modules (`server::x`, the server root as `server`).
fn server_unit(m: &str) -> Option<String> {
    let rest = m.strip_prefix("server")?;
    Some(match rest.strip_prefix("::") {
        Some(r) => format!("server::{}", r.split("::").next().unwrap_or("")),
        None if rest.is_empty() => "server".into(),
        None => return None,
    })
}

fn first_segment(m: &str) -> &str {
    m.split("::").next().unwrap_or("")
}

fn problems(g: &Graph) -> Vec<String> {
    let mut out = Vec::new();
    // 1. Layers, and no cycle among the top-level modules.
    for m in g.modules.keys() {
        let t = top(m).unwrap();
        if layer(first_segment(&t)).is_none() {
            out.push(format!("module {m} has no layer"));
        }
    }
    let tops = g.folded(top);
    for ((a, b), (ma, mb)) in &tops {
        if let (Some(la), Some(lb)) = (layer(first_segment(a)), layer(first_segment(b))) {
            if lb > la {
                out.push(format!(
                    "layers: {ma} uses {mb} (layer {la} uses layer {lb})"
                ));
            }
        }
    }
    for c in cycles(&tops) {
        out.push(format!("cycle among top-level modules: {}", c.join(" ↔ ")));
    }
    // 2. Sans-IO link machines, transitively.
    for root in ["server::link", "agent::link"] {
        for m in g.reach(root) {
            for name in &g.modules[&m].outside {
                if does_io(name) {
                    out.push(format!("sans-IO: {root} reaches {m}, which uses {name}"));
                }
            }
        }
    }
    // 3. Handlers never reach run; no cycle among the server's modules.
    for h in [
        "server::accept",
        "server::endpoint",
        "server::frontend",
        "server::plan",
        "server::admin",
        "server::core",
    ] {
        if g.reach(h).contains("server::run") {
            out.push(format!("{h} reaches server::run"));
        }
    }
    for c in cycles(&g.folded(server_unit)) {
        out.push(format!(
            "cycle among the server's modules: {}",
            c.join(" ↔ ")
        ));
    }
    // 4. The roles keep apart.
    for (m, module) in &g.modules {
        for u in &module.uses {
            let (a, b) = (first_segment(m), first_segment(u));
            if (a == "server" && b == "agent") || (a == "agent" && (b == "server" || b == "config"))
            {
                out.push(format!("roles: {m} uses {u}"));
            }
        }
    }
    out
}

fn graph() -> Graph {
    Graph::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src")).unwrap()
}

#[test]
fn the_tunnel_crate_holds_its_layers() {
    let g = graph();
    assert!(
        g.modules.contains_key("server::link"),
        "{:?}",
        g.modules.keys()
    );
    let p = problems(&g);
    assert!(p.is_empty(), "{}", p.join("\n"));
}

#[test]
fn each_rule_catches_an_injected_violation() {
    let g = graph();
    let uses = |from: &str, to: &str| {
        let mut g = g.clone();
        g.modules.get_mut(from).unwrap().uses.insert(to.into());
        problems(&g)
    };
    let names = |from: &str, name: &str| {
        let mut g = g.clone();
        g.modules.get_mut(from).unwrap().outside.insert(name.into());
        problems(&g)
    };
    let has = |p: Vec<String>, what: &str| {
        assert!(p.iter().any(|l| l.contains(what)), "no {what:?} in {p:?}");
    };
    // 1. A lower layer uses a higher one; a cycle within a layer.
    has(
        uses("wire::proto", "config"),
        "layers: wire::proto uses config",
    );
    has(
        uses("transport::grpc", "transport::native"),
        "cycle among top-level modules: transport::grpc ↔ transport::native",
    );
    let mut g2 = g.clone();
    g2.modules.insert("rogue".into(), Default::default());
    has(problems(&g2), "module rogue has no layer");
    // 2. IO in a link machine, directly or through what it reaches.
    has(
        names("server::link", "tokio::spawn"),
        "sans-IO: server::link",
    );
    has(
        names("agent::link", "std::time::Instant::now"),
        "uses std::time::Instant::now",
    );
    has(
        names("wire::proto", "std::sync::Mutex"),
        "sans-IO: server::link reaches wire::proto",
    );
    // 3. A handler reaching run; a new cycle among the server's modules.
    has(
        uses("server::frontend", "server::run"),
        "server::frontend reaches server::run",
    );
    has(
        uses("server::cluster", "server::frontend"),
        "cycle among the server's modules",
    );
    // 4. The roles reach each other.
    has(
        uses("server::core", "agent"),
        "roles: server::core uses agent",
    );
    has(
        uses("agent::config", "config"),
        "roles: agent::config uses config",
    );
}

//! The tunnel crate's module layers, enforced: every `crate::…` (and, inside
//! `server/` and `agent/`, `super::…`) reference in the sources must point
//! to a lower layer or to its own, and a few modules are held to stricter
//! rules (the sans-IO link machines; the server's connection handlers never
//! reach up into `run`). docs/ARCHITECTURE.md draws the same graph.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Layer of a top-level module; a module may use its own layer and lower.
fn layer(module: &str) -> Option<u8> {
    Some(match module {
        // Shared helpers re-exported from seedlink-net; the read tap under
        // the GOAWAY sniffer and the agents' activity stamps.
        "sync" | "tap" => 0,
        // Wire: messages, gRPC framing, authority, HTTP/2 GOAWAY sniffing,
        // dial-failure texts, SOCKS5 reply codes.
        "proto" | "grpc" | "authority" | "goaway" | "dialerr" | "socks5" => 1,
        // Transport: per-connection queues and flow control.
        "flow" | "queue" | "fair" => 2,
        // Authentication: TLS identities, tokens, TokenReview.
        "tls" | "tokenerror" | "token" | "tokenreview" => 3,
        // The tunnel-server's configuration model.
        "config" => 4,
        // The roles.
        "server" | "agent" => 5,
        _ => return None,
    })
}

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Identifiers following `prefix` in `text` (e.g. `crate::` → `proto`).
fn refs(text: &str, prefix: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find(prefix) {
        let after = &rest[i + prefix.len()..];
        let name: String = after
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if !name.is_empty() {
            out.insert(name);
        }
        rest = after;
    }
    out
}

/// `crate::{a, b::c}` groups name modules too.
fn grouped(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find("crate::{") {
        let after = &rest[i + "crate::{".len()..];
        let end = after.find('}').unwrap_or(after.len());
        for part in after[..end].split(',') {
            let name: String = part
                .trim()
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() {
                out.insert(name);
            }
        }
        rest = after;
    }
    out
}

/// Without comments (a doc comment may mention any module).
fn code(text: &str) -> String {
    text.lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn modules_only_use_their_own_layer_or_lower() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    files.sort();
    let mut problems = Vec::new();
    for f in &files {
        let rel = f.strip_prefix(&src).unwrap();
        let module = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy()
            .trim_end_matches(".rs")
            .to_string();
        if module == "lib" {
            continue;
        }
        let Some(own) = layer(&module) else {
            problems.push(format!("{}: module {module} has no layer", rel.display()));
            continue;
        };
        let text = code(&std::fs::read_to_string(f).unwrap());
        let used = refs(&text, "crate::").into_iter().chain(grouped(&text));
        for m in used {
            match layer(&m) {
                Some(l) if l < own || m == module => {}
                Some(l) if l == own && own < 5 => {}
                _ => problems.push(format!("{}: {module} uses crate::{m}", rel.display())),
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// Within the roles: the link machines use no IO module, the server's
/// handlers share `core` and never reach `run`, and neither role's
/// library reaches into the other.
#[test]
fn role_internals_keep_their_direction() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let read = |p: &str| code(&std::fs::read_to_string(src.join(p)).unwrap());
    let mut problems = Vec::new();
    for (file, allowed) in [
        ("server/link.rs", &["proto"][..]),
        ("agent/link.rs", &["proto"][..]),
    ] {
        for m in refs(&read(file), "crate::") {
            if !allowed.contains(&m.as_str()) {
                problems.push(format!("{file} (sans-IO) uses crate::{m}"));
            }
        }
        for m in refs(&read(file), "super::") {
            if !["dialerror"].contains(&m.as_str()) {
                problems.push(format!("{file} (sans-IO) uses super::{m}"));
            }
        }
    }
    for file in [
        "server/agents.rs",
        "server/frontend.rs",
        "server/admin.rs",
        "server/core.rs",
    ] {
        let t = read(file);
        for m in refs(&t, "super::")
            .into_iter()
            .chain(refs(&t, "crate::server::"))
        {
            if ["run", "agents", "frontend", "admin"].contains(&m.as_str()) {
                problems.push(format!("{file} uses {m}"));
            }
        }
    }
    let t = read("server/mod.rs");
    for m in refs(&t, "self::").into_iter().chain(refs(&t, "super::")) {
        if ["run", "agents", "frontend", "admin", "core"].contains(&m.as_str()) {
            problems.push(format!("server/mod.rs uses {m}"));
        }
    }
    let mut server = Vec::new();
    sources(&src.join("server"), &mut server);
    for f in server {
        if refs(&code(&std::fs::read_to_string(&f).unwrap()), "crate::").contains("agent") {
            problems.push(format!("{} uses crate::agent", f.display()));
        }
    }
    let mut agent = Vec::new();
    sources(&src.join("agent"), &mut agent);
    for f in agent {
        let t = code(&std::fs::read_to_string(&f).unwrap());
        if refs(&t, "crate::").contains("server") || refs(&t, "crate::").contains("config") {
            problems.push(format!(
                "{} uses the server or its configuration",
                f.display()
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

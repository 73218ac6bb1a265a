//! No crate of the workspace grows a cycle among its modules (a module and
//! the modules it uses, by any path; test-only code left out). The crate
//! root counts as a module: a child that uses what the root defines, while
//! the root uses the child, is a cycle too.
//!
//! `KNOWN` would list the cycles a crate may keep (a crate and the exact
//! cycle): none is left since issue 27 removed the last (the bench's). A
//! new cycle fails, and so would a listed one that is gone or has changed.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::path::Path;

use seedlink_layering::{cycles, Graph};

/// (crate directory, the modules of one cycle).
const KNOWN: &[(&str, &[&str])] = &[];

fn name(m: &str) -> String {
    if m.is_empty() {
        "(root)".into()
    } else {
        m.to_string()
    }
}

#[test]
fn no_crate_grows_a_module_cycle() {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut problems = Vec::new();
    let mut seen: BTreeSet<(String, Vec<String>)> = BTreeSet::new();
    let mut read = 0;
    for e in std::fs::read_dir(&crates).unwrap() {
        let dir = e.unwrap().path();
        let src = dir.join("src");
        if !src.is_dir() {
            continue;
        }
        let krate = dir.file_name().unwrap().to_string_lossy().to_string();
        let g = Graph::load(&src).unwrap();
        read += 1;
        let edges = g.folded(|m| Some(name(m)));
        for c in cycles(&edges) {
            let known = KNOWN.iter().any(|(k, members)| {
                *k == krate && members.iter().copied().eq(c.iter().map(String::as_str))
            });
            if !known {
                let why: Vec<String> = c
                    .iter()
                    .flat_map(|a| c.iter().map(move |b| (a.clone(), b.clone())))
                    .filter_map(|k| {
                        edges
                            .get(&k)
                            .map(|(x, y)| format!("{} → {}", name(x), name(y)))
                    })
                    .collect();
                problems.push(format!(
                    "{krate}: cycle {} ({})",
                    c.join(" ↔ "),
                    why.join(", ")
                ));
            }
            seen.insert((krate.clone(), c));
        }
    }
    for (k, members) in KNOWN {
        let c: Vec<String> = members.iter().map(|m| m.to_string()).collect();
        if !seen.contains(&(k.to_string(), c)) {
            problems.push(format!(
                "{k}: the known cycle {members:?} is gone or changed: update KNOWN"
            ));
        }
    }
    assert!(
        read >= 10,
        "only {read} crates found under {}",
        crates.display()
    );
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

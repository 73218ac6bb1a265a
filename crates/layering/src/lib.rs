//! A crate's module graph, read with `syn`, and the rules the workspace's
//! layering tests hold it to (docs/ARCHITECTURE.md, "Layers").
//!
//! [`Graph::load`] starts at `lib.rs` (or `main.rs`), follows `mod`
//! declarations (files and inline blocks), and skips test-only code (any
//! item under a `cfg` that names `test`, such as `#[cfg(test)]` or
//! `#[cfg(any(test, feature = "harness"))]`). Every path a module writes,
//! in `use` trees (nested groups, renames, globs) and in code (types,
//! expressions, patterns, macro names), is resolved: `crate::`, `super::`
//! (repeated), `self::` and a child module's bare name lead into the
//! crate; anything else is an outside name (`tokio::…`, `std::sync::…`,
//! `Instant::now`). Macro bodies are token streams and are not read.
//!
//! No crate checks layering rules over a module graph; this is the small
//! part written here, over syn's parser.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use syn::visit::Visit;

/// A module's path from the crate root, `::`-joined (`server::link`; the
/// root is `""`).
pub type ModPath = String;

/// What one module refers to.
#[derive(Debug, Default, Clone)]
pub struct Module {
    /// The file it is written in.
    pub file: PathBuf,
    /// Modules of this crate it uses (not itself).
    pub uses: BTreeSet<ModPath>,
    /// Outside paths it names, `::`-joined (`tokio::sync::mpsc`,
    /// `Instant::now`).
    pub outside: BTreeSet<String>,
}

/// Every module of a crate, and what each refers to.
#[derive(Debug, Default, Clone)]
pub struct Graph {
    /// By path.
    pub modules: BTreeMap<ModPath, Module>,
}

/// Why a crate could not be read.
#[derive(Debug)]
pub struct LoadError(pub String);

impl std::fmt::Display for LoadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

fn join(parent: &str, child: &str) -> ModPath {
    if parent.is_empty() {
        child.to_string()
    } else {
        format!("{parent}::{child}")
    }
}

fn parent(m: &str) -> &str {
    m.rsplit_once("::").map_or("", |(p, _)| p)
}

/// Whether `attrs` put the item under a `cfg` naming `test`.
fn test_only(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        a.path().is_ident("cfg")
            && a.meta.require_list().is_ok_and(|l| {
                l.tokens
                    .to_string()
                    .split(|c: char| !c.is_alphanumeric() && c != '_')
                    .any(|w| w == "test")
            })
    })
}

/// A module as parsed: its items, where its child files live.
struct Source {
    path: ModPath,
    file: PathBuf,
    items: Vec<syn::Item>,
}

impl Graph {
    /// Reads the crate whose sources are under `src`.
    pub fn load(src: &Path) -> Result<Graph, LoadError> {
        let root = ["lib.rs", "main.rs"]
            .iter()
            .map(|f| src.join(f))
            .find(|p| p.exists())
            .ok_or_else(|| LoadError(format!("{}: no lib.rs or main.rs", src.display())))?;
        let mut sources = Vec::new();
        collect(String::new(), &root, src.to_path_buf(), &mut sources)?;
        let declared: BTreeSet<ModPath> = sources.iter().map(|s| s.path.clone()).collect();
        let mut g = Graph::default();
        for s in &sources {
            let mut v = Refs {
                module: &s.path,
                declared: &declared,
                out: Module {
                    file: s.file.clone(),
                    ..Module::default()
                },
            };
            for item in &s.items {
                v.item(item);
            }
            g.modules.insert(s.path.clone(), v.out);
        }
        Ok(g)
    }

    /// Every module `from` reaches through its uses, itself included.
    pub fn reach(&self, from: &str) -> BTreeSet<ModPath> {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.to_string()];
        while let Some(m) = todo.pop() {
            if !seen.insert(m.clone()) {
                continue;
            }
            if let Some(module) = self.modules.get(&m) {
                todo.extend(module.uses.iter().cloned());
            }
        }
        seen
    }

    /// The module graph folded onto units: `unit` names the unit of a
    /// module (or `None` to leave it out); the edges between distinct
    /// units, each with one module edge that makes it.
    pub fn folded(
        &self,
        unit: impl Fn(&str) -> Option<String>,
    ) -> BTreeMap<(String, String), (ModPath, ModPath)> {
        let mut out = BTreeMap::new();
        for (m, module) in &self.modules {
            let Some(a) = unit(m) else { continue };
            for u in &module.uses {
                let Some(b) = unit(u) else { continue };
                if a != b {
                    out.entry((a.clone(), b)).or_insert((m.clone(), u.clone()));
                }
            }
        }
        out
    }
}

/// Whether an outside name does IO, which a sans-IO module must not
/// touch: a runtime, locks and atomics, threads, files, processes,
/// sockets, HTTP stacks, system calls, seedlink's runtime library, the
/// clock. Plain data (`std::io::Error`, `SocketAddr`) is not IO.
pub fn does_io(name: &str) -> bool {
    [
        "tokio",
        "std::sync",
        "std::thread",
        "std::fs",
        "std::process",
        "std::net::TcpStream",
        "std::net::TcpListener",
        "std::net::UdpSocket",
        "hyper",
        "h2",
        "tonic",
        "socket2",
        "libc",
        "nix",
        "seedlink_net",
    ]
    .iter()
    .any(|p| name == *p || name.starts_with(&format!("{p}::")))
        || name.ends_with("Instant::now")
        || name.ends_with("SystemTime::now")
}

/// Cycles among `edges` (strongly connected sets of more than one node),
/// each sorted.
pub fn cycles(edges: &BTreeMap<(String, String), (ModPath, ModPath)>) -> Vec<Vec<String>> {
    let nodes: BTreeSet<&String> = edges.keys().flat_map(|(a, b)| [a, b]).collect();
    let reach = |from: &String| {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.clone()];
        while let Some(n) = todo.pop() {
            for ((a, b), _) in edges.range((n.clone(), String::new())..) {
                if *a != n {
                    break;
                }
                if seen.insert(b.clone()) {
                    todo.push(b.clone());
                }
            }
        }
        seen
    };
    let reaches: BTreeMap<&String, BTreeSet<String>> =
        nodes.iter().map(|n| (*n, reach(n))).collect();
    let mut out: Vec<Vec<String>> = Vec::new();
    for n in &nodes {
        if !reaches[n].contains(*n) || out.iter().any(|c| c.contains(n)) {
            continue;
        }
        let scc: Vec<String> = nodes
            .iter()
            .filter(|m| reaches[n].contains(**m) && reaches[*m].contains(*n))
            .map(|m| (*m).clone())
            .collect();
        out.push(scc);
    }
    out
}

fn collect(
    path: ModPath,
    file: &Path,
    dir: PathBuf,
    out: &mut Vec<Source>,
) -> Result<(), LoadError> {
    let text =
        std::fs::read_to_string(file).map_err(|e| LoadError(format!("{}: {e}", file.display())))?;
    let parsed =
        syn::parse_file(&text).map_err(|e| LoadError(format!("{}: {e}", file.display())))?;
    module(path, file, dir, parsed.items, out)
}

fn module(
    path: ModPath,
    file: &Path,
    dir: PathBuf,
    items: Vec<syn::Item>,
    out: &mut Vec<Source>,
) -> Result<(), LoadError> {
    let mut kept = Vec::new();
    for item in items {
        let m = match item {
            syn::Item::Mod(m) => m,
            other => {
                kept.push(other);
                continue;
            }
        };
        if test_only(&m.attrs) {
            continue;
        }
        let name = m.ident.to_string();
        let child = join(&path, &name);
        match m.content {
            Some((_, inline)) => module(child, file, dir.join(&name), inline, out)?,
            None => {
                let flat = dir.join(format!("{name}.rs"));
                let nested = dir.join(&name).join("mod.rs");
                let f = if flat.exists() { flat } else { nested };
                collect(child, &f, dir.join(&name), out)?;
            }
        }
    }
    out.push(Source {
        path,
        file: file.to_path_buf(),
        items: kept,
    });
    Ok(())
}

/// Collects one module's references.
struct Refs<'a> {
    module: &'a str,
    declared: &'a BTreeSet<ModPath>,
    out: Module,
}

impl Refs<'_> {
    fn item(&mut self, item: &syn::Item) {
        let attrs: &[syn::Attribute] = match item {
            syn::Item::Fn(i) => &i.attrs,
            syn::Item::Impl(i) => &i.attrs,
            syn::Item::Use(i) => &i.attrs,
            syn::Item::Struct(i) => &i.attrs,
            syn::Item::Enum(i) => &i.attrs,
            syn::Item::Const(i) => &i.attrs,
            syn::Item::Static(i) => &i.attrs,
            syn::Item::Trait(i) => &i.attrs,
            syn::Item::Type(i) => &i.attrs,
            syn::Item::Macro(i) => &i.attrs,
            _ => &[],
        };
        if !test_only(attrs) {
            self.visit_item(item);
        }
    }

    /// Records the path `segments`, written in this module.
    fn record(&mut self, segments: &[String]) {
        let Some(first) = segments.first() else {
            return;
        };
        let (mut at, rest): (String, &[String]) = match first.as_str() {
            "crate" => (String::new(), &segments[1..]),
            "self" => (self.module.to_string(), &segments[1..]),
            "super" => {
                let mut at = parent(self.module).to_string();
                let mut rest = &segments[1..];
                while rest.first().is_some_and(|s| s == "super") {
                    at = parent(&at).to_string();
                    rest = &rest[1..];
                }
                (at, rest)
            }
            name if self.declared.contains(&join(self.module, name)) => {
                (self.module.to_string(), segments)
            }
            _ => {
                self.out.outside.insert(segments.join("::"));
                return;
            }
        };
        // The longest declared module the path goes through.
        for s in rest {
            let next = join(&at, s);
            if !self.declared.contains(&next) {
                break;
            }
            at = next;
        }
        if at != self.module {
            self.out.uses.insert(at);
        }
    }

    fn tree(&mut self, prefix: &mut Vec<String>, tree: &syn::UseTree) {
        match tree {
            syn::UseTree::Path(p) => {
                prefix.push(p.ident.to_string());
                self.tree(prefix, &p.tree);
                prefix.pop();
            }
            syn::UseTree::Name(n) => {
                let mut full = prefix.clone();
                if n.ident != "self" {
                    full.push(n.ident.to_string());
                }
                self.record(&full);
            }
            syn::UseTree::Rename(r) => {
                let mut full = prefix.clone();
                if r.ident != "self" {
                    full.push(r.ident.to_string());
                }
                self.record(&full);
            }
            syn::UseTree::Glob(_) => {
                let p = prefix.clone();
                self.record(&p);
            }
            syn::UseTree::Group(g) => {
                for t in &g.items {
                    self.tree(prefix, t);
                }
            }
        }
    }
}

impl<'ast> Visit<'ast> for Refs<'_> {
    fn visit_item_use(&mut self, u: &'ast syn::ItemUse) {
        self.tree(&mut Vec::new(), &u.tree);
    }

    fn visit_item_mod(&mut self, _: &'ast syn::ItemMod) {
        // Child modules are modules of their own.
    }

    fn visit_item_fn(&mut self, f: &'ast syn::ItemFn) {
        if !test_only(&f.attrs) {
            syn::visit::visit_item_fn(self, f);
        }
    }

    fn visit_impl_item_fn(&mut self, f: &'ast syn::ImplItemFn) {
        if !test_only(&f.attrs) {
            syn::visit::visit_impl_item_fn(self, f);
        }
    }

    fn visit_path(&mut self, p: &'ast syn::Path) {
        let segments: Vec<String> = p.segments.iter().map(|s| s.ident.to_string()).collect();
        // A single name is a local item, a binding or a prelude name.
        if segments.len() > 1 || p.leading_colon.is_some() {
            self.record(&segments);
        }
        syn::visit::visit_path(self, p);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// A crate written into a fresh directory: (file, text) pairs.
    fn krate(name: &str, files: &[(&str, &str)]) -> Graph {
        let dir =
            std::env::temp_dir().join(format!("seedlink-layering-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for (f, text) in files {
            let p = dir.join(f);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
        let g = Graph::load(&dir).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        g
    }

    fn uses(g: &Graph, m: &str) -> Vec<String> {
        g.modules[m].uses.iter().cloned().collect()
    }

    #[test]
    fn every_way_of_naming_a_module_is_resolved() {
        let g = krate(
            "names",
            &[
                (
                    "lib.rs",
                    "mod a; mod b; mod c; mod d; mod e { pub fn f() { super::a::x(); } }",
                ),
                ("a.rs", "pub fn x() {}"),
                // A nested group whose first inner group closes before `c`.
                (
                    "b.rs",
                    "use crate::{a::{x}, c}; mod inner; fn f() { inner::g(); }",
                ),
                (
                    "b/inner.rs",
                    "pub fn g() { super::super::d::y(); self::h(); } fn h() {}",
                ),
                // A `//` inside a string does not cut the line.
                (
                    "c.rs",
                    r#"const S: &str = "http://x"; fn f() { crate::d::y(); }"#,
                ),
                ("d.rs", "pub fn y() { let _ = std::time::Instant::now(); }"),
            ],
        );
        assert_eq!(uses(&g, "b"), ["a", "b::inner", "c"]);
        assert_eq!(uses(&g, "b::inner"), ["d"]);
        assert_eq!(uses(&g, "c"), ["d"]);
        assert_eq!(uses(&g, "e"), ["a"]);
        assert!(g.modules["d"].outside.contains("std::time::Instant::now"));
    }

    #[test]
    fn test_only_code_is_left_out() {
        let g = krate(
            "tests",
            &[
                (
                    "lib.rs",
                    "mod a; mod b; #[cfg(test)] mod tests { use crate::b::x; } \
                     #[cfg(any(test, feature = \"harness\"))] pub mod harness;",
                ),
                (
                    "a.rs",
                    "#[cfg(test)] fn t() { crate::b::x(); } pub fn y() {}",
                ),
                ("b.rs", "pub fn x() {}"),
            ],
        );
        assert!(uses(&g, "a").is_empty());
        assert!(!g.modules.contains_key("tests") && !g.modules.contains_key("harness"));
    }

    #[test]
    fn cycles_are_found_with_every_member() {
        let g = krate(
            "cycles",
            &[
                ("lib.rs", "mod a; mod b; mod c; mod d;"),
                ("a.rs", "use crate::b::X;"),
                ("b.rs", "pub struct X; fn f() { crate::c::g(); }"),
                ("c.rs", "pub fn g() { crate::a::h(); } "),
                ("d.rs", "use crate::a;"),
            ],
        );
        let c = cycles(&g.folded(|m| Some(m.to_string())));
        assert_eq!(c, vec![vec!["a".to_string(), "b".into(), "c".into()]]);
        assert!(g.reach("d").contains("c"));
    }
}

//! Checking a parsed configuration: every setting's bounds, every frontend's
//! address and authentication, templates, token review, and no two
//! listeners on one address. Problems are collected, each with its path.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use super::model::*;
use seedlink_config::tunnel::{Cluster, Frontend, TokenAuth, TokenReview, STRATEGIES};
use seedlink_config::ConfigError;

/// Checks one frontend; `authenticated` frontends (shared proxies, every
/// request carries a cluster's password) may listen in plain TCP anywhere.
/// Problems found so far, each with its path.
#[derive(Default)]
pub(super) struct Problems(pub(super) Vec<ConfigError>);

impl Problems {
    pub(super) fn add(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.0.push(ConfigError::new(path.into(), message));
    }

    pub(super) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Plain TCP only on loopback (a kube-apiserver in the same network
/// namespace) or with per-request credentials (`authenticated`); anywhere
/// else mTLS: whether `f`, listening on `a`, breaks that.
pub(super) fn lacks_mtls(f: &Frontend, a: &SocketAddr, authenticated: bool) -> bool {
    let tls = [f.cert.is_some(), f.key.is_some(), f.client_ca.is_some()];
    let plain = tls.iter().all(|x| !x);
    !tls.iter().all(|x| *x) && !(plain && (a.ip().is_loopback() || authenticated))
}

/// Addresses frontends bind, in the order they claim them.
#[derive(Default)]
pub(super) struct Binds {
    pub(super) unix: HashSet<String>,
    pub(super) tcp: Vec<SocketAddr>,
}

impl Binds {
    /// Claims `a`; false when an address already claimed would keep it
    /// from binding.
    fn tcp(&mut self, a: SocketAddr) -> bool {
        if self.tcp.iter().any(|b| overlaps(*b, a)) {
            return false;
        }
        self.tcp.push(a);
        true
    }
}

/// Whether two listening addresses keep each other from binding: the same
/// port on the same address, or on a wildcard address and any address of
/// its family (Linux refuses `10.0.0.5:443` while `0.0.0.0:443` listens,
/// and `[::]:443` also covers IPv4 unless the socket is IPv6-only).
pub(super) fn overlaps(a: SocketAddr, b: SocketAddr) -> bool {
    if a.port() != b.port() {
        return false;
    }
    // `[::ffff:10.0.0.5]:443` is `10.0.0.5:443`.
    let (a, b) = (
        SocketAddr::new(a.ip().to_canonical(), a.port()),
        SocketAddr::new(b.ip().to_canonical(), b.port()),
    );
    let wild_v6 = |x: SocketAddr| x.ip().is_unspecified() && x.is_ipv6();
    a.ip() == b.ip()
        || (a.ip().is_unspecified() && a.is_ipv4() == b.is_ipv4())
        || (b.ip().is_unspecified() && a.is_ipv4() == b.is_ipv4())
        || wild_v6(a)
        || wild_v6(b)
}

pub(super) fn check_frontend(
    f: &Frontend,
    at: &str,
    authenticated: bool,
    agents: SocketAddr,
    binds: &mut Binds,
    errs: &mut Problems,
) {
    match (&f.unix, &f.tcp) {
        (Some(p), None) => {
            if !binds.unix.insert(p.display().to_string()) {
                errs.add(format!("{at}.unix"), "path used twice");
            }
            if f.cert.is_some() || f.key.is_some() || f.client_ca.is_some() {
                errs.add(at.to_string(), "cert/key/client_ca only apply to tcp");
            }
        }
        (None, Some(a)) => {
            // Port 0 (any free port) never clashes.
            if a.port() != 0 && (!binds.tcp(*a) || overlaps(*a, agents)) {
                errs.add(
                    format!("{at}.tcp"),
                    "address used twice (or overlapping an address already bound: the same port on 0.0.0.0 or [::] and a specific address)",
                );
            }
            if lacks_mtls(f, a, authenticated) {
                errs.add(
                    at.to_string(),
                    "a tcp frontend needs cert, key and client_ca (mTLS), unless it listens on loopback without any of them",
                );
            }
        }
        _ => errs.add(at.to_string(), "exactly one of unix and tcp"),
    }
}

/// A template needs a Unix path with `{cluster}` (and no TCP address).
pub(super) fn check_templates(cfg: &ServerConfig, errs: &mut Problems) {
    for (j, t) in cfg.frontend_templates.iter().enumerate() {
        let at = format!("frontend_templates[{j}] ({})", t.name);
        let templated = t
            .unix
            .as_ref()
            .is_some_and(|p| p.to_string_lossy().contains("{cluster}"));
        if !templated || t.tcp.is_some() {
            errs.add(
                at,
                "a template needs a unix path containing {cluster} (and no tcp)",
            );
        }
    }
}

/// A name that can stand in a socket path: letters, digits, `-`, `_` and
/// `.`, and not `.` or `..`.
fn path_safe(name: &str) -> bool {
    !name.is_empty()
        && name != "."
        && name != ".."
        && name
            .chars()
            .all(|ch| ch.is_ascii_alphanumeric() || "-_.".contains(ch))
}

/// Templates become ordinary per-cluster frontends (so reloads and checks
/// treat them like any other); a cluster name in a socket path is a safe
/// file name.
pub(super) fn expand_templates(cfg: &mut ServerConfig, errs: &mut Problems) {
    for c in &mut cfg.clusters {
        let safe = path_safe(&c.name);
        for t in &cfg.frontend_templates {
            if !safe {
                errs.add(
                    format!("clusters ({})", c.name),
                    "a name used in a socket path may only hold letters, digits, '-', '_' and '.'",
                );
                break;
            }
            let mut f = t.clone();
            f.unix = t
                .unix
                .as_ref()
                .map(|p| PathBuf::from(p.to_string_lossy().replace("{cluster}", &c.name)));
            if c.frontends.iter().any(|x| x.name == f.name) {
                errs.add(
                    format!("clusters ({})", c.name),
                    format!("frontend {} is both configured and templated", f.name),
                );
            }
            c.frontends.push(f);
        }
    }
}

/// `<namespace>/<name>`.
pub(super) fn object_name(v: &str) -> bool {
    v.split_once('/')
        .is_some_and(|(ns, n)| !ns.is_empty() && !n.is_empty() && !n.contains('/'))
}

/// The server-wide settings and the `kubernetes` section.
pub(super) fn check_settings(cfg: &ServerConfig, errs: &mut Problems) {
    if cfg.server_count == 0 {
        errs.add("server_count", "must be at least 1");
    }
    if cfg.clusters.is_empty() && cfg.kubernetes.is_none() {
        errs.add(
            "clusters",
            "at least one cluster is needed (or a kubernetes section to read them from TunnelClusters)",
        );
    }
    if let Some(k) = &cfg.kubernetes {
        check_kubernetes(k, errs);
    }
    if cfg.queue_bytes < 64 * 1024 {
        errs.add("queue_bytes", "at least 65536");
    }
    if cfg.agent_wait > MAX_TIMEOUT {
        errs.add("agent_wait", "at most 24h");
    }
    for (key, d) in [
        ("dial_timeout", cfg.dial_timeout),
        ("stall_timeout", cfg.stall_timeout),
        ("agents.keepalive", cfg.agents.keepalive),
        ("agents.keepalive_timeout", cfg.agents.keepalive_timeout),
    ] {
        if d.is_zero() || d > MAX_TIMEOUT {
            errs.add(key, "must be more than 0 and at most 24h");
        }
    }
    if cfg.agents.max_connections == 0 {
        errs.add("agents.max_connections", "at least 1");
    }
    if cfg.agents.max_per_source == 0 {
        errs.add("agents.max_per_source", "at least 1");
    }
    if cfg.agents.max_unauthenticated == 0
        || cfg.agents.max_unauthenticated > cfg.agents.max_connections
    {
        errs.add(
            "agents.max_unauthenticated",
            "at least 1 and at most agents.max_connections",
        );
    }
    if cfg.agents.max_unauthenticated_per_source == 0 {
        errs.add("agents.max_unauthenticated_per_source", "at least 1");
    }
    let rate = cfg.agents.handshakes_per_source;
    if !(rate.is_finite() && rate >= 0.0) {
        errs.add("agents.handshakes_per_source", "a number ≥ 0");
    }
}

/// The `kubernetes` section's names and replica addresses.
fn check_kubernetes(k: &super::model::Kubernetes, errs: &mut Problems) {
    if !object_name(&k.lease) {
        errs.add(
            "kubernetes.lease",
            format!("{:?} is not namespace/name", k.lease),
        );
    }
    if let Some(r) = k.replicas.as_ref().filter(|r| !object_name(r)) {
        errs.add(
            "kubernetes.replicas",
            format!("{r:?} is not namespace/name"),
        );
    }
    if let Some(a) = &k.replica_addresses {
        check_replica_addresses(a, k.replicas.is_some(), errs);
    }
    if k.max_api_connections == 0 {
        errs.add(
            "kubernetes.max_api_connections",
            "at least 1 (the main connection; each one more carries watches_per_connection trust watches)",
        );
    }
}

/// `kubernetes.replica_addresses`: the replicas' Service named, and
/// templates that give what an agent can use.
fn check_replica_addresses(
    a: &seedlink_config::tunnel::ReplicaAddresses,
    replicas: bool,
    errs: &mut Problems,
) {
    if !replicas {
        errs.add(
            "kubernetes.replica_addresses",
            "needs kubernetes.replicas (the Service whose EndpointSlices name the replicas)",
        );
    }
    // Filled in for a sample replica of each family, each must be what an
    // agent can use.
    let v4 = std::net::Ipv4Addr::new(10, 0, 0, 1).into();
    let v6 = std::net::Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 1).into();
    let _ = [v4, v6].into_iter().all(|ip| sample_ok(a, ip, errs));
}

/// The templates filled in for a replica at `ip`: whether both give what
/// an agent can use (the first problem added if not).
fn sample_ok(
    a: &seedlink_config::tunnel::ReplicaAddresses,
    ip: std::net::IpAddr,
    errs: &mut Problems,
) -> bool {
    let (address, name) = a.of(ip, "seedlink-0");
    if !crate::wire::replica_address_ok(&address) {
        errs.add(
            "kubernetes.replica_addresses.address",
            format!("{:?} gives {address:?}, not host:port", a.address),
        );
        return false;
    }
    let bad_name = rustls::pki_types::ServerName::try_from(name.clone()).is_err();
    if a.server_name.is_some() && bad_name {
        errs.add(
            "kubernetes.replica_addresses.server_name",
            format!("gives {name:?}, not a TLS server name"),
        );
        return false;
    }
    true
}

/// The longest `dial_timeout`, `stall_timeout` and keepalive setting: a
/// day (longer is a typo, and a deadline that far out is no deadline).
pub(super) const MAX_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

/// A cluster's dial limits and backend strategies.
pub(super) fn check_dialing(at: &str, c: &Cluster, errs: &mut Problems) {
    let l = &c.limits;
    let sane = |v: f64| v >= 0.0 && v.is_finite();
    if !sane(l.dial_rate) || !sane(l.dial_burst) {
        errs.add(
            format!("{at}.limits"),
            "dial_rate and dial_burst must be ≥ 0",
        );
    }
    if c.strategies.is_empty() {
        errs.add(format!("{at}.strategies"), "empty");
    }
    for s in c
        .strategies
        .iter()
        .filter(|s| !STRATEGIES.contains(&s.as_str()))
    {
        errs.add(
            format!("{at}.strategies"),
            format!("{s:?} is not one of {}", STRATEGIES.join(", ")),
        );
    }
    check_seed_destinations(at, c, errs);
}

/// A cluster's seed destinations: at most
/// [`seedlink_config::tunnel::MAX_SEED_DESTINATIONS`], each a DNS name
/// with ports, and at most one of `addresses` and `service`.
fn check_seed_destinations(at: &str, c: &Cluster, errs: &mut Problems) {
    use seedlink_config::tunnel::MAX_SEED_DESTINATIONS;
    if c.seed_destinations.len() > MAX_SEED_DESTINATIONS {
        errs.add(
            format!("{at}.seed_destinations"),
            format!("at most {MAX_SEED_DESTINATIONS}"),
        );
    }
    for (i, d) in c.seed_destinations.iter().enumerate() {
        check_seed_destination(&format!("{at}.seed_destinations[{i}]"), d, errs);
    }
}

/// Whether `s` is `<namespace>/<name>`.
fn namespace_and_name(s: &str) -> bool {
    s.split_once('/')
        .is_some_and(|(ns, n)| !ns.is_empty() && !n.is_empty() && !n.contains('/'))
}

/// One seed destination: a DNS name, its ports, where it is dialled.
fn check_seed_destination(
    at: &str,
    d: &seedlink_config::tunnel::SeedDestination,
    errs: &mut Problems,
) {
    if !seedlink_proto::connect_head::authority_form(&format!("{}:1", d.host))
        || d.host.parse::<std::net::IpAddr>().is_ok()
        || !d.host.contains('.')
    {
        errs.add(
            format!("{at}.host"),
            format!("{:?} is not a DNS name with a dot", d.host),
        );
    }
    if d.ports.is_empty() || d.ports.len() > 16 || d.ports.contains(&0) {
        errs.add(format!("{at}.ports"), "1 to 16 ports, none 0");
    }
    if !d.addresses.is_empty() && d.service.is_some() {
        errs.add(at.to_string(), "addresses or service, not both");
    }
    if d.addresses.len() > 16 {
        errs.add(format!("{at}.addresses"), "at most 16");
    }
    if !d.service.as_deref().is_none_or(namespace_and_name) {
        errs.add(format!("{at}.service"), "must be <namespace>/<name>");
    }
}

/// Every cluster: a unique name, a way to authenticate its agents (an
/// issuer belongs to one cluster), sane limits and strategies, its
/// frontends.
pub(super) fn check_clusters(cfg: &ServerConfig, binds: &mut Binds, errs: &mut Problems) {
    let mut names = HashSet::new();
    let mut issuers = HashSet::new();
    for (i, c) in cfg.clusters.iter().enumerate() {
        let at = format!("clusters[{i}] ({})", c.name);
        if c.name.is_empty() || !names.insert(c.name.clone()) {
            errs.add(format!("{at}.name"), "empty or used twice");
        }
        if c.agent_ca.is_none() && c.agent_token.is_none() {
            errs.add(
                at.to_string(),
                "agent_ca or agent_token (or both) is needed",
            );
        }
        if let Some(t) = &c.agent_token {
            check_agent_token(&at, t, &mut issuers, errs);
        }
        check_dialing(&at, c, errs);
        if cfg.kubernetes.is_none() && c.seed_destinations.iter().any(|d| d.service.is_some()) {
            errs.add(
                format!("{at}.seed_destinations"),
                "a service is read from Kubernetes: this file has no kubernetes section (give addresses, or none for DNS)",
            );
        }
        for (j, f) in c.frontends.iter().enumerate() {
            let at = format!("{at}.frontends[{j}] ({})", f.name);
            check_frontend(f, &at, false, cfg.agents.listen, binds, errs);
        }
    }
}

/// A TokenReview's settings (`at`: its key).
pub(super) fn check_review(at: &str, r: &TokenReview, errs: &mut Problems) {
    if !r.url.starts_with("https://") {
        errs.add(format!("{at}.url"), "must be https://");
    }
    if r.cert.is_some() != r.key.is_some() {
        errs.add(at, "cert and key go together");
    }
    if r.token_file.is_none() && r.cert.is_none() {
        errs.add(
            at,
            "token_file or cert/key is needed to authenticate to the API server",
        );
    }
    if r.timeout.is_zero() {
        errs.add(format!("{at}.timeout"), "must be > 0");
    }
}

/// A cluster's `agent_token`: a ServiceAccount, one way to check it, an
/// issuer of its own, and a TokenReview that can authenticate.
pub(super) fn check_agent_token(
    at: &str,
    t: &TokenAuth,
    issuers: &mut HashSet<String>,
    errs: &mut Problems,
) {
    if !t.service_account.contains('/') {
        errs.add(
            format!("{at}.agent_token.service_account"),
            "<namespace>/<name>",
        );
    }
    if t.keys.is_some() == t.review.is_some() {
        errs.add(
            format!("{at}.agent_token"),
            "exactly one of keys (local check) or review (TokenReview)",
        );
    }
    if !issuers.insert(t.issuer.clone()) {
        errs.add(
            format!("{at}.agent_token.issuer"),
            "used by another cluster",
        );
    }
    if let Some(r) = &t.review {
        check_review(&format!("{at}.agent_token.review"), r, errs);
    }
}

/// Shared frontends: a proxy (the request names the cluster) or mTLS (the
/// client certificate does); a proxy needs a cluster with a password.
pub(super) fn check_shared_frontends(cfg: &ServerConfig, binds: &mut Binds, errs: &mut Problems) {
    for (j, f) in cfg.shared_frontends.iter().enumerate() {
        let at = format!("shared_frontends[{j}] ({})", f.name);
        let proxy = f.protocol.is_proxy();
        let mtls = f.tcp.is_some() && f.client_ca.is_some();
        if !(proxy || mtls) {
            errs.add(
                at.clone(),
                format!(
                    "a shared {:?} frontend needs tcp with cert, key and client_ca: the client certificate names the cluster",
                    f.protocol
                ),
            );
        }
        check_frontend(f, &at, proxy, cfg.agents.listen, binds, errs);
    }
    if cfg.shared_frontends.iter().any(|f| f.protocol.is_proxy())
        && cfg.clusters.iter().all(|c| c.proxy_password_file.is_none())
    {
        errs.add(
            "shared_frontends",
            "no cluster has a proxy_password_file, so no proxy request could name one",
        );
    }
}

//! A small admin HTTP endpoint shared by the node-proxy and the tunnel
//! roles: a route function from path to `(status, content type, body)`,
//! served over HTTP/1.1 with bounded connections and timeouts.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;

/// Admin connections one source address may hold at once. The kubelet's
/// probes, a Prometheus and a person each need one or two; a client that
/// fills every slot of the endpoint would fail the probes (the pod would be
/// restarted), so no one address can.
pub const MAX_ADMIN_PER_SOURCE: usize = 16;

/// The source an address is counted as: an IPv4 address, or an IPv6 /64
/// (one host commonly holds a whole /64, so counting single IPv6 addresses
/// would cap nobody); a v4-mapped IPv6 address counts as its IPv4 one.
pub fn source_key(ip: std::net::IpAddr) -> std::net::IpAddr {
    match ip.to_canonical() {
        std::net::IpAddr::V6(v6) => {
            let s = v6.segments();
            std::net::IpAddr::V6(std::net::Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
        }
        v4 => v4,
    }
}

/// Connection slots: at most `total` at once and a number per source
/// address ([`MAX_ADMIN_PER_SOURCE`] for an admin endpoint).
pub struct Slots {
    per: usize,
    total: Arc<tokio::sync::Semaphore>,
    per_source: Arc<std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>>,
}

/// One admin connection's slot; given back when dropped.
pub struct Slot {
    _total: tokio::sync::OwnedSemaphorePermit,
    ip: std::net::IpAddr,
    per_source: Arc<std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>>,
}

impl Slots {
    /// Slots for `total` admin connections.
    pub fn new(total: usize) -> Slots {
        Slots::with_per_source(total, MAX_ADMIN_PER_SOURCE)
    }

    /// Slots for `total` connections, `per` from one address.
    pub fn with_per_source(total: usize, per: usize) -> Slots {
        Slots {
            per,
            total: Arc::new(tokio::sync::Semaphore::new(
                total.min(tokio::sync::Semaphore::MAX_PERMITS),
            )),
            per_source: Arc::default(),
        }
    }

    /// A slot for a connection from `ip`, if one is free for it.
    pub fn enter(&self, ip: std::net::IpAddr) -> Option<Slot> {
        let ip = source_key(ip);
        // The total first: a refused source leaves no entry behind.
        let total = self.total.clone().try_acquire_owned().ok()?;
        let mut m = crate::sync::lock(&self.per_source, "admin slots");
        let n = m.entry(ip).or_insert(0);
        if *n >= self.per {
            if *n == 0 {
                m.remove(&ip);
            }
            return None;
        }
        *n += 1;
        Some(Slot {
            _total: total,
            ip,
            per_source: self.per_source.clone(),
        })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut m = crate::sync::lock(&self.per_source, "admin slots");
        if let Some(n) = m.get_mut(&self.ip) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                m.remove(&self.ip);
            }
        }
    }
}

/// An answer: status, content type, body.
pub type Answer = (u16, &'static str, String);

/// Plain-text content type.
pub const TEXT: &str = "text/plain; charset=utf-8";
/// Prometheus content type.
pub const METRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// HTML content type.
pub const HTML: &str = "text/html; charset=utf-8";
/// JSON content type.
pub const JSON: &str = "application/json";

/// The live page every role serves on `/`: one self-contained file (no
/// external assets, works offline) that renders `api/state` every 2 s.
pub const PAGE: &str = include_str!("admin_page.html");

/// The samples of metric `name` (as encoded, e.g.
/// `seedlink_gateway_connections_total`) in an OpenMetrics text: each with
/// its labels. The JSON state views read the same counters `/metrics`
/// shows this way, because the client library's families cannot be listed.
/// Hand-written: the exposition is our own encoder's output, one sample per
/// line, label values escaped only for `\`, `"` and newlines.
pub fn samples(text: &str, name: &str) -> Vec<(std::collections::BTreeMap<String, String>, f64)> {
    let mut out = Vec::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let (labels, value) = match rest.strip_prefix('{') {
            Some(r) => match r.rsplit_once("} ") {
                Some((l, v)) => (l, v),
                None => continue,
            },
            None => match rest.strip_prefix(' ') {
                Some(v) => ("", v),
                None => continue,
            },
        };
        let Ok(value) = value.trim().parse::<f64>() else {
            continue;
        };
        out.push((labels_of(labels), value));
    }
    out
}

/// A sample's labels (`k="v",...`), values unescaped.
fn labels_of(text: &str) -> std::collections::BTreeMap<String, String> {
    let mut map = std::collections::BTreeMap::new();
    let mut rest = text;
    while let Some((key, after)) = rest.split_once("=\"") {
        let mut val = String::new();
        let mut chars = after.char_indices();
        let mut end = after.len();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => {
                    if let Some((_, n)) = chars.next() {
                        val.push(if n == 'n' { '\n' } else { n });
                    }
                }
                '"' => {
                    end = i + 1;
                    break;
                }
                c => val.push(c),
            }
        }
        map.insert(key.trim_start_matches(',').to_string(), val);
        rest = &after[end..];
    }
    map
}

/// Who may read an admin endpoint. The probes (`/healthz`, `/readyz`,
/// `/ready`) and the page's static file (`/`) are always answered, so a
/// kubelet needs no credentials; with a token, everything else (metrics,
/// configuration, state) needs `Authorization: Bearer <token>`.
#[derive(Clone, Default)]
pub struct Access {
    token: Option<Arc<str>>,
}

impl std::fmt::Debug for Access {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the token itself.
        f.debug_struct("Access")
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

impl Access {
    /// No token: every path is answered (bind to loopback or a pod address).
    pub fn open() -> Access {
        Access::default()
    }

    /// The token in `path` (surrounding whitespace ignored; empty is an error).
    pub fn from_token_file(path: &std::path::Path) -> std::io::Result<Access> {
        let text = std::fs::read_to_string(path)?;
        let token = text.trim();
        if token.is_empty() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{}: empty token", path.display()),
            ));
        }
        Ok(Access {
            token: Some(token.into()),
        })
    }

    /// Whether a request for `path` with this `Authorization` header value
    /// may be answered.
    pub fn allows(&self, path: &str, authorization: Option<&str>) -> bool {
        // The page itself holds no data (it reads `api/state` with the
        // token from its URL fragment), so a browser can load it.
        if matches!(path, "/healthz" | "/readyz" | "/ready" | "/") {
            return true;
        }
        let Some(want) = &self.token else { return true };
        let Some(got) = authorization.and_then(|a| a.strip_prefix("Bearer ")) else {
            return false;
        };
        // Constant time in the token's length: no early exit on a mismatch.
        let (a, b) = (got.trim().as_bytes(), want.as_bytes());
        a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
    }
}

/// Serves `route` on `listener` until the process ends, at most `slots`
/// connections at once (more are closed at accept).
pub async fn serve(
    listener: TcpListener,
    slots: usize,
    route: Arc<dyn Fn(&str) -> Answer + Send + Sync>,
) {
    serve_with(listener, slots, Access::open(), route).await;
}

/// The same, answering only what `access` allows (401 otherwise).
pub async fn serve_with(
    listener: TcpListener,
    slots: usize,
    access: Access,
    route: Arc<dyn Fn(&str) -> Answer + Send + Sync>,
) {
    serve_limited(listener, Slots::new(slots), access, route).await;
}

/// The same with the connection limits given (for an endpoint any pod can
/// reach, where one source must hold far less than the whole).
pub async fn serve_limited(
    listener: TcpListener,
    slots: Slots,
    access: Access,
    route: Arc<dyn Fn(&str) -> Answer + Send + Sync>,
) {
    let never = tokio_util::sync::CancellationToken::new();
    crate::accept::accept_loop(&listener, &never, |stream, peer| {
        let Some(slot) = slots.enter(peer.ip()) else {
            return;
        };
        let route = route.clone();
        let access = access.clone();
        tokio::spawn(async move {
            let access = access.clone();
            let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                let r = answer(&access, &*route, &req);
                async move { Ok::<_, Infallible>(r) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(Duration::from_secs(5))
                .serve_connection(TokioIo::new(stream), svc);
            let _ = tokio::time::timeout(Duration::from_secs(30), conn).await;
            drop(slot);
        });
    })
    .await;
}

/// A request's answer: `route`'s, or 401 without the token where one is
/// needed.
fn answer(
    access: &Access,
    route: &(dyn Fn(&str) -> Answer + Send + Sync),
    req: &Request<Incoming>,
) -> Response<Full<Bytes>> {
    let path = req.uri().path();
    let authorization = req
        .headers()
        .get(hyper::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    let (code, ctype, body) = if access.allows(path, authorization) {
        route(path)
    } else {
        (
            401,
            TEXT,
            "unauthorized: send Authorization: Bearer <token>\n".to_string(),
        )
    };
    response(code, ctype, body)
}

/// An answer as an HTTP response; a 401 says which scheme to use.
fn response(code: u16, ctype: &str, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() =
        hyper::StatusCode::from_u16(code).unwrap_or(hyper::StatusCode::INTERNAL_SERVER_ERROR);
    if let Ok(v) = ctype.parse() {
        r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
    }
    if code == 401 {
        r.headers_mut().insert(
            hyper::header::WWW_AUTHENTICATE,
            hyper::header::HeaderValue::from_static("Bearer"),
        );
    }
    r
}

/// The process and build metrics every role exports: `seedlink_build_info`
/// and the standard `process_*` family (as Prometheus client libraries name
/// them), read from `/proc/self` at scrape time. Hand-written because the
/// Rust client has no process collector; the CPU time assumes Linux's fixed
/// `USER_HZ` of 100 ticks per second.
#[derive(Debug)]
struct ProcessCollector;

/// `/proc/self/stat` fields after the command name: (utime, stime,
/// num_threads, starttime) in ticks / count.
fn proc_stat() -> Option<(u64, u64, u64, u64)> {
    let text = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The command may hold spaces and parentheses: fields follow the last ')'.
    let rest = &text[text.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // Field numbers from proc(5), minus the two before `state` (pid, comm).
    let at = |n: usize| f.get(n - 3).and_then(|v| v.parse::<u64>().ok());
    Some((at(14)?, at(15)?, at(20)?, at(22)?))
}

fn proc_value(path: &str, key: &str) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.lines().find_map(|l| {
        let rest = l.strip_prefix(key)?;
        rest.split_whitespace().find_map(|v| v.parse::<u64>().ok())
    })
}

impl prometheus_client::collector::Collector for ProcessCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::counter::ConstCounter;
        use prometheus_client::metrics::gauge::ConstGauge;
        let info = prometheus_client::metrics::info::Info::new(vec![
            ("version", env!("CARGO_PKG_VERSION")),
            (
                "profile",
                if cfg!(debug_assertions) {
                    "debug"
                } else {
                    "release"
                },
            ),
        ]);
        info.encode(encoder.encode_descriptor(
            "seedlink_build",
            "The running build",
            None,
            info.metric_type(),
        )?)?;
        let (gauges, cpu) = process_readings();
        for (name, help, v) in gauges {
            let g = ConstGauge::new(v);
            g.encode(encoder.encode_descriptor(name, help, None, g.metric_type())?)?;
        }
        if let Some(seconds) = cpu {
            let c = ConstCounter::new(seconds);
            c.encode(encoder.encode_descriptor(
                "process_cpu_seconds",
                "User and system CPU time",
                None,
                c.metric_type(),
            )?)?;
        }
        Ok(())
    }
}

/// The process gauges that can be read now (name, help, value), and the
/// CPU time in seconds.
fn process_readings() -> (Vec<(&'static str, &'static str, f64)>, Option<f64>) {
    const HZ: f64 = 100.0;
    let mut out = Vec::new();
    if let Some(kb) = proc_value("/proc/self/status", "VmRSS:") {
        out.push((
            "process_resident_memory_bytes",
            "Resident memory",
            (kb * 1024) as f64,
        ));
    }
    if let Some(kb) = proc_value("/proc/self/status", "VmSize:") {
        out.push((
            "process_virtual_memory_bytes",
            "Virtual memory",
            (kb * 1024) as f64,
        ));
    }
    if let Ok(d) = std::fs::read_dir("/proc/self/fd") {
        out.push((
            "process_open_fds",
            "Open file descriptors",
            d.count() as f64,
        ));
    }
    if let Some(n) = proc_value("/proc/self/limits", "Max open files") {
        out.push(("process_max_fds", "The open-file limit", n as f64));
    }
    let stat = proc_stat();
    if let Some((_, _, threads, start)) = stat {
        out.push(("process_threads", "OS threads", threads as f64));
        if let Some(btime) = proc_value("/proc/stat", "btime") {
            let at = btime as f64 + start as f64 / HZ;
            out.push((
                "process_start_time_seconds",
                "Start time since the Unix epoch",
                at,
            ));
        }
    }
    // Tasks alive in the runtime serving this scrape (every role has one):
    // a count that keeps growing is a task leak.
    if let Ok(rt) = tokio::runtime::Handle::try_current() {
        out.push((
            "seedlink_runtime_tasks",
            "Tasks alive in the async runtime (connections, listeners, watches)",
            rt.metrics().num_alive_tasks() as f64,
        ));
    }
    let cpu = stat.map(|(utime, stime, _, _)| (utime + stime) as f64 / HZ);
    (out, cpu)
}

/// Encodes a registry in the text format, with the process, build and
/// lock metrics every role exports.
pub fn encode(registry: &prometheus_client::registry::Registry) -> String {
    encode_all(&[registry])
}

/// The same for several registries (one exposition, one `# EOF`).
pub fn encode_all(registries: &[&prometheus_client::registry::Registry]) -> String {
    use prometheus_client::metrics::counter::ConstCounter;
    // Every role's endpoint also says whether a bug poisoned a lock.
    let mut process = prometheus_client::registry::Registry::default();
    process.register(
        "seedlink_lock_poisoned",
        "Locks found poisoned (each is a bug: a thread panicked holding one)",
        ConstCounter::new(crate::sync::poisoned()),
    );
    process.register(
        "seedlink_panics",
        "Panics since start (each is a bug; a connection task that panicked ended alone)",
        ConstCounter::new(crate::sync::panics()),
    );
    process.register_collector(Box::new(ProcessCollector));
    let mut out = String::new();
    for r in registries.iter().copied().chain(std::iter::once(&process)) {
        let mut part = String::new();
        if prometheus_client::encoding::text::encode(&mut part, r).is_err() {
            return String::new();
        }
        // One exposition: only the last `# EOF` stays.
        out.push_str(part.strip_suffix("# EOF\n").unwrap_or(&part));
    }
    out.push_str("# EOF\n");
    out
}

/// RFC 3339 (UTC, seconds) of a system time.
pub fn rfc3339(t: std::time::SystemTime) -> String {
    let secs = t
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = i64::try_from(days).unwrap_or(0) + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    /// Slots count a source as an IPv4 address or an IPv6 /64 (so one
    /// host rotating through its /64 is one source): the agent port, the
    /// admin endpoints and the tunnel's token checks (two at once per
    /// source, `TOKEN_CHECKS_PER_SOURCE`) all count this way.
    #[test]
    fn slots_count_ipv6_sources_per_slash_64() {
        let slots = super::Slots::with_per_source(100, 2);
        let ip = |s: &str| s.parse::<std::net::IpAddr>().unwrap();
        let _a = slots.enter(ip("2001:db8:0:7::1")).unwrap();
        let _b = slots.enter(ip("2001:db8:0:7:ffff::2")).unwrap();
        assert!(slots.enter(ip("2001:db8:0:7::3")).is_none());
        let _c = slots.enter(ip("2001:db8:0:8::1")).unwrap();
        let _d = slots.enter(ip("192.0.2.1")).unwrap();
        let _e = slots.enter(ip("::ffff:192.0.2.1")).unwrap();
        assert!(slots.enter(ip("192.0.2.1")).is_none());
        drop(_a);
        assert!(slots.enter(ip("2001:db8:0:7::3")).is_some());
    }

    #[test]
    fn one_exposition_carries_the_roles_metrics_and_the_poisoned_lock_count() {
        use prometheus_client::metrics::counter::Counter;
        let mut r = prometheus_client::registry::Registry::with_prefix("seedlink_test");
        let c: Counter = Counter::default();
        c.inc();
        r.register("things", "Things", c);
        let text = super::encode(&r);
        assert!(text.contains("seedlink_test_things_total 1\n"), "{text}");
        assert!(
            text.contains("# TYPE seedlink_lock_poisoned counter\n"),
            "{text}"
        );
        assert!(text.contains("\nseedlink_lock_poisoned_total "), "{text}");
        assert_eq!(text.matches("# EOF").count(), 1, "{text}");
        assert!(text.ends_with("# EOF\n"));
    }
}

#[cfg(test)]
mod samples_tests {
    #[test]
    fn samples_are_read_with_their_labels() {
        let text = "# TYPE x counter\nx_total{a=\"1\",b=\"q\\\"z\"} 3\nx_total 4\nx_totally{a=\"1\"} 9\nx_created 1.5\n";
        let s = super::samples(text, "x_total");
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].0["a"], "1");
        assert_eq!(s[0].0["b"], "q\"z");
        assert_eq!(s[0].1, 3.0);
        assert!(s[1].0.is_empty());
        assert_eq!(s[1].1, 4.0);
    }
}

/// What a part started after its role (the Kubernetes source) adds to the
/// role's admin endpoints: its metrics on `/metrics`, and a summary (name
/// and value, in order) on the live page under its title.
pub trait Section: Send + Sync {
    /// The title the live page shows it under.
    fn title(&self) -> String;
    /// Its metrics, encoded with the role's own.
    fn registry(&self) -> &prometheus_client::registry::Registry;
    /// Its summary for the live page.
    fn summary(&self) -> Vec<(String, String)>;
}

/// A role's added sections; clones share them.
#[derive(Clone, Default)]
pub struct Sections(std::sync::Arc<std::sync::Mutex<Vec<std::sync::Arc<dyn Section>>>>);

impl Sections {
    /// Adds `s`.
    pub fn add(&self, s: std::sync::Arc<dyn Section>) {
        crate::sync::lock(&self.0, "admin sections").push(s);
    }

    /// The sections now.
    pub fn all(&self) -> Vec<std::sync::Arc<dyn Section>> {
        crate::sync::lock(&self.0, "admin sections").clone()
    }

    /// `registries` and every section's, encoded as one exposition.
    pub fn encode_with(&self, registries: &[&prometheus_client::registry::Registry]) -> String {
        let all = self.all();
        let mut regs: Vec<&prometheus_client::registry::Registry> = registries.to_vec();
        regs.extend(all.iter().map(|s| s.registry()));
        encode_all(&regs)
    }

    /// Each section's title and summary, for `api/state`'s `sections`:
    /// `[{"title": .., "lines": [[name, value], ..]}, ..]`.
    pub fn state(&self) -> Vec<(String, Vec<(String, String)>)> {
        self.all()
            .iter()
            .map(|s| (s.title(), s.summary()))
            .collect()
    }
}

//! What one run measures: the options, the scenario's switches (set once
//! at start), and one sample. A leaf: every other module reads it.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Parser;

/// The SNI every proxy routes to the backend.
pub const SNI: &str = "api.alpha.example.com";

/// The name of storm control plane `i`: as long as [`SNI`], so that it
/// takes its place in the captured ClientHello with every length
/// unchanged.
pub fn storm_name(i: usize) -> String {
    format!("api.c{:04}.example.com", i % 10_000)
}

/// Set in the reverse-tunnel scenario.
pub static TUNNEL_SCENARIO: std::sync::OnceLock<()> = std::sync::OnceLock::new();
/// The CONNECT request target (default `backend:443`).
pub static CONNECT_TARGET: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// The destination the CONNECT scenario asks for (and the name of Envoy's
/// cluster for it).
pub const DEST: &str = "outbound|443||kube-apiserver.shoot--bench--a.svc.cluster.local";

static TUNNEL: std::sync::OnceLock<&'static str> = std::sync::OnceLock::new();
pub static NODE_GATEWAY: std::sync::OnceLock<SocketAddr> = std::sync::OnceLock::new();
pub static NODE_H2: std::sync::OnceLock<()> = std::sync::OnceLock::new();
static PROXY_V2: std::sync::OnceLock<()> = std::sync::OnceLock::new();

/// Switches the bench to the PROXY+SNI scenario: every proxied connection
/// starts with a PROXY v2 header, as behind a load balancer that sends one.
pub fn set_proxy_v2() {
    let _ = PROXY_V2.set(());
}

/// Whether proxied connections start with a PROXY v2 header.
pub fn proxy_v2() -> bool {
    PROXY_V2.get().is_some()
}

/// Storm scenario: control planes every proxy routes besides the bench's
/// own (`api.cNNNN.example.com`, each with its own route and upstream
/// entry, all to the one backend).
pub static STORM_CPS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
/// Storm scenario's overload phase: the connections each proxy started
/// now may hold (seedlink's `max_connections`, HAProxy's `maxconn`,
/// nginx's `worker_connections`); 0: the usual configuration.
pub static STORM_CAP: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// The storm control planes' indexes and names (none outside the storm).
pub fn storm_names() -> impl Iterator<Item = (usize, String)> {
    (0..STORM_CPS.load(std::sync::atomic::Ordering::Relaxed)).map(|i| (i, storm_name(i)))
}

/// Storm scenario: the backend of the storm's control planes (the
/// bench's own control plane then goes to the probes' echo backend).
pub static STORM_BACKEND: std::sync::OnceLock<SocketAddr> = std::sync::OnceLock::new();

/// Where the storm control planes go: [`STORM_BACKEND`], else `backend`.
pub fn storm_backend(backend: SocketAddr) -> SocketAddr {
    STORM_BACKEND.get().copied().unwrap_or(backend)
}

/// The cap proxies started now get (0: none).
pub fn storm_cap() -> usize {
    STORM_CAP.load(std::sync::atomic::Ordering::Relaxed)
}

/// Switches the bench to the CONNECT scenario.
pub fn set_tunnel_destination() {
    let _ = TUNNEL.set(DEST);
}

/// Whether the node-proxy scenario is running.
pub fn node_proxy_scenario() -> bool {
    NODE_GATEWAY.get().is_some()
}

/// The destination when running the CONNECT scenario.
pub fn tunnel_destination() -> Option<&'static str> {
    TUNNEL.get().copied()
}

/// Benchmark options.
#[derive(Parser, Debug, Clone)]
#[command(about = "seedlink gateway vs HAProxy, nginx and Envoy on loopback")]
pub struct Opts {
    /// The seedlink binary (build it with `cargo build --release -p seedlink`).
    #[arg(long, default_value = "target/release/seedlink")]
    pub seedlink: PathBuf,
    /// A second seedlink binary, run as proxy `seedlink-b` (gateway
    /// scenarios): an interleaved A/B of two builds in one run.
    #[arg(long)]
    pub seedlink_b: Option<PathBuf>,
    /// Proxies to compare, comma-separated (seedlink,haproxy,nginx,envoy).
    #[arg(
        long,
        default_value = "seedlink,haproxy,nginx,envoy",
        value_delimiter = ','
    )]
    pub proxies: Vec<String>,
    /// Rounds; each round runs every target once per workload, in rotated order.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// MiB downloaded per bulk run.
    #[arg(long, default_value_t = 2048)]
    pub bulk_mib: u64,
    /// Seconds per connection-rate run.
    #[arg(long, default_value_t = 4.0)]
    pub rate_secs: f64,
    /// Concurrent clients in the connection-rate run.
    #[arg(long, default_value_t = 16)]
    pub rate_concurrency: usize,
    /// Sequential connections in the latency run.
    #[arg(long, default_value_t = 400)]
    pub latency_conns: usize,
    /// Connections held open for the idle-memory run.
    #[arg(long, default_value_t = 3000)]
    pub idle_conns: usize,
    /// Worker threads each proxy may use.
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// `sni` (TLS passthrough), `proxy-sni` (the same behind a PROXY v2
    /// sender: every proxied connection starts with the header), `storm`
    /// (a reconnect storm: waves of clients connecting at once over many
    /// control planes, then the same against capped proxies), `connect` (HTTP CONNECT tunnels with the
    /// destination header; seedlink's http-connect listener vs Envoy as
    /// Gardener's ingress) or `node-proxy` (seedlink node-proxy vs Envoy with
    /// Gardener's apiserver-proxy config, both in front of one seedlink gateway)
    /// or `node-proxy-h2` (seedlink node-proxy in HTTP/2 CONNECT mode vs Envoy
    /// as Kubermatic's envoy-agent, tunnels multiplexed on one h2 connection
    /// to the gateway), or `tunnel` (seedlink tunnel-server + tunnel-agent,
    /// HTTP CONNECT frontend, vs rathole's server + client), or
    /// `tunnel-scale` (one tunnel-server with --clusters clusters and two
    /// in-process agents each, against one cluster), or `tunnel-restart`
    /// (two replicas with --clusters clusters, two agents each holding a
    /// stream to both; one replica killed and started again), or `kube-scale` (the
    /// Kubernetes source at --tenants tenants on a real kube-apiserver).
    #[arg(long, default_value = "sni")]
    pub scenario: String,
    /// Concurrent bulk downloads in the many-streams run (each `bulk_mib /
    /// streams`); 0 skips it. Default: 16 in the node-proxy-h2 scenario, else 0.
    #[arg(long)]
    pub streams: Option<usize>,
    /// Clusters on the server in the tunnel-scale scenario (two in-process
    /// agents each), measured against a one-cluster server; on each
    /// replica in the tunnel-restart scenario.
    #[arg(long, default_value_t = 200)]
    pub clusters: usize,
    /// Where the tunnel-restart scenario's replicas read their clusters:
    /// `file` (a `clusters` list) or `kubernetes` (TunnelClusters with
    /// their trust ConfigMaps on a real kube-apiserver, each replica as the
    /// install's ServiceAccount, trust watched per namespace).
    #[arg(long, default_value = "file")]
    pub source: String,
    /// Tenant counts the kube-scale scenario measures at, growing.
    #[arg(long, value_delimiter = ',', default_values_t = [10, 100, 1000])]
    pub tenants: Vec<usize>,
    /// Tunnel scenario: pins each tunnel's two processes, the server to the
    /// first CPU and the agent (rathole's and bore's client) to the second
    /// (`0,0`: both on CPU 0; `0,1`: always apart), so that every target's
    /// hops cross the same CPUs (see docs/PERFORMANCE.md, single-connection
    /// latency). Unset: the kernel places them.
    #[arg(long, value_delimiter = ',')]
    pub tunnel_cpus: Option<Vec<u32>>,
    /// tunnel-restart scenario: the replica that is killed and its agents
    /// run on this CPU only, and everything else (the other replica, its
    /// agents, the dials, the API server) on the other CPUs, as if on
    /// nodes of their own (in a seed the agents are the shoots' and each
    /// replica has its node). Unset: everything shares every CPU.
    #[arg(long)]
    pub restarted_cpu: Option<u32>,
    /// Internal: run as a bare forwarder (the `splice-fwd` and `copy-fwd`
    /// yardsticks) listening here.
    #[arg(long, hide = true)]
    pub forward_listen: Option<std::net::SocketAddr>,
    /// Internal: where the bare forwarder connects.
    #[arg(long, hide = true)]
    pub forward_to: Option<std::net::SocketAddr>,
    /// Internal: `splice` or `buffered`.
    #[arg(long, hide = true, default_value = "splice")]
    pub forward_copy: String,
    /// Storm scenario: clients that connect at once in each wave and hold
    /// their connection until all are in (then all close, as after a
    /// load balancer's failover).
    #[arg(long, default_value_t = 8000)]
    pub storm_clients: usize,
    /// Storm scenario: waves per proxy (clients × waves connections each).
    #[arg(long, default_value_t = 7)]
    pub storm_waves: usize,
    /// Storm scenario: control planes the clients spread over.
    #[arg(long, default_value_t = 1000)]
    pub storm_cps: usize,
    /// Storm scenario's overload phase: the connection cap of the capped
    /// proxies, below `storm_clients`.
    #[arg(long, default_value_t = 2000)]
    pub storm_cap: usize,
    /// Storm scenario: established connections whose echo round trips are
    /// timed before and during each wave.
    #[arg(long, default_value_t = 32)]
    pub storm_probes: usize,
    /// Print the results as JSON too.
    #[arg(long)]
    pub json: bool,
}

/// One measurement of one target in one round.
#[derive(Debug, Default, Clone)]
pub struct Sample {
    /// Bulk throughput, Gbit/s.
    pub gbps: Option<f64>,
    /// Proxy CPU seconds per GB moved.
    pub cpu_s_per_gb: Option<f64>,
    /// Bulk upload throughput, Gbit/s (tunnel scenario).
    pub up_gbps: Option<f64>,
    /// Proxy CPU seconds per GB uploaded (tunnel scenario).
    pub up_cpu_s_per_gb: Option<f64>,
    /// Aggregate throughput of `streams` concurrent bulk downloads, Gbit/s.
    pub streams_gbps: Option<f64>,
    /// Proxy CPU seconds per GB in the many-streams run.
    pub streams_cpu_s_per_gb: Option<f64>,
    /// New connections per second.
    pub conn_rate: Option<f64>,
    /// Proxy CPU microseconds per connection in the rate run.
    pub cpu_us_per_conn: Option<f64>,
    /// p50 / p99 connect-to-first-byte under the rate load, µs.
    pub rate_p50_us: Option<f64>,
    /// p99 under load, µs.
    pub rate_p99_us: Option<f64>,
    /// Single-connection p50 connect-to-first-byte, µs.
    pub single_p50_us: Option<f64>,
    /// Single-connection p50 time to the CONNECT's answer (the dial round
    /// trip), µs.
    pub answer_p50_us: Option<f64>,
    /// Times the proxy's threads were woken per connection in the
    /// single-connection run.
    pub single_wakeups: Option<f64>,
    /// Single-connection p50 with the CONNECT pipelined (request head and
    /// first bytes in one write), µs.
    pub pipelined_p50_us: Option<f64>,
    /// Echo p99 beside a stalled reader ÷ echo p99 alone (tunnel scenario).
    pub hol_p99_ratio: Option<f64>,
    /// Proxy RSS growth per idle proxied connection, KiB.
    pub idle_kib: Option<f64>,
}

//! Starting and observing the proxies under test.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::proxy::Proxy;
use crate::scenario::{
    proxy_v2, storm_backend, storm_cap, storm_names, tunnel_destination, Opts, DEST, NODE_GATEWAY,
    NODE_H2, SNI,
};

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn which(tool: &str) -> anyhow::Result<String> {
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {tool}"))
        .output()?;
    if !out.status.success() {
        bail!("`{tool}` is not installed; run scripts/install-peers --bench");
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

impl Proxy {
    /// Starts proxy `name` routing SNI [`SNI`] to `backend`.
    pub async fn start(
        name: &str,
        opts: &Opts,
        backend: SocketAddr,
        dir: &Path,
        idx: usize,
    ) -> anyhow::Result<Proxy> {
        let port = free_port()?;
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse()?;
        let t = opts.threads;
        if crate::scenario::TUNNEL_SCENARIO.get().is_some() {
            return crate::tunnel::start(name, opts, backend, dir, idx).await;
        }
        if let Some(gw) = NODE_GATEWAY.get() {
            return Proxy::start_node_proxy(name, opts, *gw, dir, idx, addr).await;
        }
        if tunnel_destination().is_some() && matches!(name, "haproxy" | "nginx") {
            bail!("{name} has no CONNECT-by-header routing; the connect scenario compares seedlink and envoy");
        }
        let child = match name {
            // Yardsticks, not peers: this binary as a bare forwarder with
            // no parsing, moving bytes with seedlink's own copy loop
            // (splice, or a user-space buffer).
            "splice-fwd" | "copy-fwd" if tunnel_destination().is_none() && !proxy_v2() => {
                Command::new(std::env::current_exe()?)
                    .args(["--forward-listen", &addr.to_string()])
                    .args(["--forward-to", &backend.to_string()])
                    .args([
                        "--forward-copy",
                        if name == "splice-fwd" {
                            "splice"
                        } else {
                            "buffered"
                        },
                    ])
                    .arg("--threads")
                    .arg(t.to_string())
                    .stdout(Stdio::null())
                    .spawn()?
            }
            "seedlink" | "seedlink-b" => {
                let bin = if name == "seedlink" {
                    &opts.seedlink
                } else {
                    opts.seedlink_b
                        .as_ref()
                        .context("seedlink-b needs --seedlink-b <binary>")?
                };
                let cfg = dir.join(format!("seedlink-{idx}.yaml"));
                std::fs::write(
                    &cfg,
                    format!(
                        "admin: {{listen: '127.0.0.1:0'}}
listeners: [{{name: tls, address: '{addr}', protocol: {proto}, proxy_protocol: {pp}}}]
trusted_load_balancers: [127.0.0.0/8]
limits: {{max_unrouted_per_source: 100000{cap}}}
control_planes:
  - {{name: bench, hostnames: [{SNI}], endpoints: ['{backend}'], destinations: [{{name: '{DEST}'}}]}}
{storm}",
                        proto = if tunnel_destination().is_some() { "http-connect" } else { "tls" },
                        pp = if proxy_v2() { "required" } else { "off" },
                        cap = match storm_cap() {
                            0 => String::new(),
                            c => format!(", max_connections: {c}, max_connections_per_control_plane: {c}"),
                        },
                        storm = storm_names()
                            .map(|(i, n)| format!("  - {{name: c{i:04}, hostnames: [{n}], endpoints: ['{}']}}\n", storm_backend(backend)))
                            .collect::<String>(),
                    ),
                )?;
                let mut c = Command::new(bin)
                    .args(["gateway", "--config"])
                    .arg(&cfg)
                    .env("RUST_LOG", "error")
                    .env("TOKIO_WORKER_THREADS", t.to_string())
                    .stdout(Stdio::piped())
                    .spawn()
                    .with_context(|| format!("running {}", bin.display()))?;
                // The ready line on stdout.
                let out = c.stdout.take().context("stdout")?;
                let mut line = String::new();
                BufReader::new(out).read_line(&mut line)?;
                if !line.contains("ready") {
                    bail!("seedlink did not start: {line:?}");
                }
                c
            }
            "haproxy" => {
                let cfg = dir.join(format!("haproxy-{idx}.cfg"));
                std::fs::write(
                    &cfg,
                    format!(
                        "global
  maxconn {maxconn}
  nbthread {t}
defaults
  mode tcp
  timeout connect 5s
  timeout client 60s
  timeout server 60s
frontend tls
  bind {addr}{accept_proxy} backlog 4096
  tcp-request inspect-delay 5s
  tcp-request content accept if {{ req_ssl_hello_type 1 }}
  use_backend b if {{ req_ssl_sni -i {SNI} }}
{storm_use}backend b
  server s {backend}
{storm_backends}",
                        accept_proxy = if proxy_v2() { " accept-proxy" } else { "" },
                        maxconn = match storm_cap() {
                            0 => 9000,
                            c => c,
                        },
                        storm_use = if storm_names().next().is_some() {
                            let map = dir.join(format!("haproxy-{idx}.map"));
                            let lines: String = storm_names()
                                .map(|(i, n)| format!("{n} c{i:04}\n"))
                                .collect();
                            std::fs::write(&map, lines)?;
                            format!(
                                "  use_backend %[req_ssl_sni,lower,map({})]\n",
                                map.display()
                            )
                        } else {
                            String::new()
                        },
                        storm_backends = storm_names()
                            .map(|(i, _)| format!(
                                "backend c{i:04}\n  server s {}\n",
                                storm_backend(backend)
                            ))
                            .collect::<String>(),
                    ),
                )?;
                Command::new(which("haproxy")?)
                    .arg("-db")
                    .arg("-f")
                    .arg(&cfg)
                    .stdout(Stdio::null())
                    .spawn()?
            }
            // `nginx-hc`: with `proxy_half_close on`, nginx keeps a
            // half-closed connection open as seedlink does (by default it
            // closes both sides at the first FIN).
            "nginx" | "nginx-hc" => {
                let cfg = dir.join(format!("nginx-{idx}.conf"));
                let prefix = dir.join(format!("nginx-{idx}"));
                std::fs::create_dir_all(prefix.join("logs"))?;
                let module = ["/usr/lib/nginx/modules/ngx_stream_module.so"]
                    .iter()
                    .find(|p| Path::new(p).exists())
                    .map(|p| format!("load_module {p};"))
                    .unwrap_or_default();
                std::fs::write(
                    &cfg,
                    format!(
                        "{module}
daemon off;
worker_processes {t};
worker_rlimit_nofile 20000;
pid {pid};
error_log {err} error;
events {{ worker_connections {conns}; }}
stream {{
  map $ssl_preread_server_name $up {{ {SNI} b; {storm_map}default blackhole; }}
  upstream b {{ server {backend}; }}
  upstream blackhole {{ server 127.0.0.1:1; }}
{storm_up}  server {{ listen {addr}{pp} backlog=4096; ssl_preread on; proxy_pass $up;{half_close} }}
}}
",
                        pp = if proxy_v2() { " proxy_protocol" } else { "" },
                        half_close = if name == "nginx-hc" {
                            " proxy_half_close on;"
                        } else {
                            ""
                        },
                        // A worker counts a proxied connection twice (client
                        // and upstream), and the workers share the cap.
                        conns = match storm_cap() {
                            0 => 10000,
                            c => c * 2 / t.max(1),
                        },
                        storm_map = storm_names()
                            .map(|(i, n)| format!("{n} c{i:04}; "))
                            .collect::<String>(),
                        storm_up = storm_names()
                            .map(|(i, _)| format!(
                                "  upstream c{i:04} {{ server {}; }}\n",
                                storm_backend(backend)
                            ))
                            .collect::<String>(),
                        pid = prefix.join("nginx.pid").display(),
                        err = prefix.join("logs/error.log").display()
                    ),
                )?;
                Command::new(which("nginx")?)
                    .arg("-p")
                    .arg(&prefix)
                    .arg("-c")
                    .arg(&cfg)
                    .stdout(Stdio::null())
                    .spawn()?
            }
            "envoy" if tunnel_destination().is_some() => {
                let cfg = dir.join(format!("envoy-{idx}.yaml"));
                std::fs::write(&cfg, envoy_ingress(port, backend))?;
                spawn_envoy(&cfg, t, idx)?
            }
            "envoy" => {
                let cfg = dir.join(format!("envoy-{idx}.yaml"));
                std::fs::write(
                    &cfg,
                    format!(
                        "static_resources:
  listeners:
  - name: tls
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    listener_filters:{pp}
    - name: envoy.filters.listener.tls_inspector
      typed_config: {{'@type': type.googleapis.com/envoy.extensions.filters.listener.tls_inspector.v3.TlsInspector}}
    filter_chains:
    - filter_chain_match: {{server_names: [{SNI}]}}
      filters:
      - name: envoy.filters.network.tcp_proxy
        typed_config:
          '@type': type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy
          stat_prefix: tls
          cluster: b
  clusters:
  - name: b
    type: STATIC
    connect_timeout: 5s
    circuit_breakers:
      thresholds: [{{max_connections: 1000000, max_pending_requests: 1000000, max_requests: 1000000}}]
    load_assignment:
      cluster_name: b
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: {ip}, port_value: {bport}}}}}}}
",
                        ip = backend.ip(),
                        bport = backend.port(),
                        pp = if proxy_v2() {
                            "
    - name: envoy.filters.listener.proxy_protocol
      typed_config: {'@type': type.googleapis.com/envoy.extensions.filters.listener.proxy_protocol.v3.ProxyProtocol}"
                        } else {
                            ""
                        },
                    ),
                )?;
                spawn_envoy(&cfg, t, idx)?
            }
            other => bail!("unknown proxy {other:?} (in this scenario)"),
        };
        let p = Proxy {
            child,
            extra: Vec::new(),
            addr,
            connect: tunnel_destination().is_some(),
            keeps_pipelined: false,
            unix: None,
        };
        let end = Instant::now() + Duration::from_secs(20);
        while tokio::net::TcpStream::connect(addr).await.is_err() {
            if Instant::now() > end {
                bail!("{name} did not listen on {addr} within 20 s");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(p)
    }

    /// Starts the (unmeasured) gateway that node proxies tunnel to.
    pub async fn start_gateway_for_node_proxies(
        opts: &Opts,
        backend: SocketAddr,
        dir: &Path,
    ) -> anyhow::Result<Proxy> {
        let port = free_port()?;
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse()?;
        let cfg = dir.join("node-gateway.yaml");
        std::fs::write(
            &cfg,
            format!(
                "admin: {{listen: '127.0.0.1:0'}}
listeners: [{{name: http-proxy, address: '{addr}', protocol: http-connect}}]
limits: {{max_unrouted_per_source: 100000}}
control_planes:
  - {{name: bench, endpoints: ['{backend}'], destinations: [{{name: '{DEST}'}}]}}
"
            ),
        )?;
        let mut c = Command::new(&opts.seedlink)
            .args(["gateway", "--config"])
            .arg(&cfg)
            .env("RUST_LOG", "error")
            .stdout(Stdio::piped())
            .spawn()?;
        let out = c.stdout.take().context("stdout")?;
        let mut line = String::new();
        BufReader::new(out).read_line(&mut line)?;
        if !line.contains("ready") {
            bail!("gateway did not start: {line:?}");
        }
        let _ = NODE_GATEWAY.set(addr);
        if opts.scenario == "node-proxy-h2" {
            let _ = NODE_H2.set(());
        }
        Ok(Proxy {
            child: c,
            extra: Vec::new(),
            addr,
            connect: true,
            keeps_pipelined: false,
            unix: None,
        })
    }

    async fn start_node_proxy(
        name: &str,
        opts: &Opts,
        gateway: SocketAddr,
        dir: &Path,
        idx: usize,
        addr: SocketAddr,
    ) -> anyhow::Result<Proxy> {
        let child = match name {
            "seedlink" => {
                let mut c = Command::new(&opts.seedlink)
                    .args([
                        "node-proxy",
                        "--link-kind",
                        "none",
                        "--address",
                        "127.0.0.1",
                        "--admin",
                        "127.0.0.1:0",
                    ])
                    .args([
                        "--port",
                        &addr.port().to_string(),
                        "--gateway",
                        &gateway.to_string(),
                        "--destination",
                        DEST,
                        "--mode",
                        if NODE_H2.get().is_some() {
                            "http2-connect"
                        } else {
                            "connect"
                        },
                    ])
                    .env("RUST_LOG", "error")
                    .stdout(Stdio::piped())
                    .spawn()?;
                let out = c.stdout.take().context("stdout")?;
                let mut line = String::new();
                BufReader::new(out).read_line(&mut line)?;
                if !line.contains("ready") {
                    bail!("node-proxy did not start: {line:?}");
                }
                c
            }
            "envoy" => {
                // Gardener's apiserver-proxy bootstrap (tcp_proxy with
                // tunneling_config), on loopback instead of the service IP.
                let cfg = dir.join(format!("envoy-apiserver-proxy-{idx}.yaml"));
                std::fs::write(
                    &cfg,
                    format!(
                        "static_resources:
  listeners:
  - name: kube_apiserver
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    per_connection_buffer_limit_bytes: 32768
    filter_chains:
    - filters:
      - name: envoy.filters.network.tcp_proxy
        typed_config:
          '@type': type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy
          stat_prefix: kube_apiserver
          cluster: kube_apiserver
          tunneling_config:
            hostname: 'api.internal.example.com.:443'
            headers_to_add:
            - header: {{key: X-Gardener-Destination, value: '{DEST}'}}
  clusters:
  - name: kube_apiserver
    type: STATIC
    connect_timeout: 5s
    per_connection_buffer_limit_bytes: 32768
{h2}    circuit_breakers:
      thresholds: [{{max_connections: 1000000, max_pending_requests: 1000000, max_requests: 1000000}}]
    load_assignment:
      cluster_name: kube_apiserver
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: {ip}, port_value: {gport}}}}}}}
",
                        port = addr.port(),
                        ip = gateway.ip(),
                        gport = gateway.port(),
                        // Kubermatic's envoy-agent: the tunnels are HTTP/2
                        // CONNECT streams on one upstream connection.
                        h2 = if NODE_H2.get().is_some() {
                            "    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        '@type': type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config:
          http2_protocol_options:
            connection_keepalive: {interval: 30s, timeout: 5s}
"
                        } else {
                            ""
                        }
                    ),
                )?;
                spawn_envoy(&cfg, opts.threads, idx)?
            }
            other => bail!(
                "{other} is not a node proxy; the node-proxy scenario compares seedlink and envoy"
            ),
        };
        let p = Proxy {
            child,
            extra: Vec::new(),
            addr,
            connect: tunnel_destination().is_some(),
            keeps_pipelined: false,
            unix: None,
        };
        let end = Instant::now() + Duration::from_secs(20);
        while tokio::net::TcpStream::connect(addr).await.is_err() {
            if Instant::now() > end {
                bail!("{name} did not listen on {addr} within 20 s");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(p)
    }
}

/// Starts Envoy on `cfg` with `threads` workers and a base id unique per proxy.
fn spawn_envoy(cfg: &Path, threads: usize, idx: usize) -> anyhow::Result<Child> {
    Ok(Command::new(which("envoy")?)
        .arg("-c")
        .arg(cfg)
        .args([
            "--concurrency",
            &threads.to_string(),
            "-l",
            "error",
            "--base-id",
        ])
        .arg((1000 + idx).to_string())
        .stdout(Stdio::null())
        .spawn()?)
}

/// Envoy configured as Gardener's istio ingress `http-proxy` port: CONNECT
/// routed by `cluster_header: X-Gardener-Destination` (behind Gardener's
/// regex), a cluster named like the destination.
fn envoy_ingress(port: u16, backend: SocketAddr) -> String {
    format!(
        "layered_runtime:
  layers:
  - name: static
    static_layer: {{re2.max_program_size.error_level: 1000}}
static_resources:
  listeners:
  - name: http_proxy
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    per_connection_buffer_limit_bytes: 32768
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          '@type': type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: http_proxy
          http_protocol_options: {{accept_http_10: true}}
          upgrade_configs: [{{upgrade_type: CONNECT}}]
          http_filters:
          - name: envoy.filters.http.router
            typed_config: {{'@type': type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}}
          route_config:
            virtual_hosts:
            - name: http-proxy
              domains: ['*']
              routes:
              - match:
                  connect_matcher: {{}}
                  headers: [{{name: X-Gardener-Destination, string_match: {{safe_regex: {{regex: '^(outbound\\|(1194\\|\\|vpn-seed-server(-[0-4])?|443\\|\\|kube-apiserver)\\..*\\.svc\\.cluster\\.local|(shoot-[a-z0-9]+(-[a-z0-9]+)*|shoot--[a-z0-9]+(-[a-z0-9]+)*--[a-z0-9]+(-[a-z0-9]+)*)--kube-apiserver-socket)$'}}}}}}]
                route:
                  cluster_header: X-Gardener-Destination
                  upgrade_configs: [{{upgrade_type: CONNECT, connect_config: {{}}}}]
              - match: {{connect_matcher: {{}}}}
                redirect: {{https_redirect: true, port_redirect: 443}}
  clusters:
  - name: '{DEST}'
    type: STATIC
    connect_timeout: 5s
    per_connection_buffer_limit_bytes: 32768
    circuit_breakers:
      thresholds: [{{max_connections: 1000000, max_pending_requests: 1000000, max_requests: 1000000}}]
    load_assignment:
      cluster_name: '{DEST}'
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: {ip}, port_value: {bport}}}}}}}
",
        ip = backend.ip(),
        bport = backend.port()
    )
}

//! Building a tunnel-server from its configuration and running its
//! listeners: the agent endpoint, every cluster's frontends, the admin
//! endpoint.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::net::{TcpListener, UnixListener};
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::metrics::Metrics;
use super::{Cluster, DialSettings, Registry, Strategy};
use crate::config::{FrontendProtocol, ServerConfig};
use crate::grpc::H2Settings;
use crate::proto::PROXY_PATH;
use crate::tls;
use crate::token::TokenValidator;
use crate::tokenreview::TokenReviewer;

/// Timeouts and budgets.
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    /// TLS handshake, request head, first gRPC packet.
    pub handshake_timeout: Duration,
    /// Agent's answer to a dial.
    pub dial_timeout: Duration,
    /// No progress writing to a frontend.
    pub stall_timeout: Duration,
    /// Per-connection queue budget.
    pub queue_bytes: usize,
}

enum Transport {
    Unix(PathBuf),
    Tcp(SocketAddr, TlsAcceptor),
    /// Loopback only (checked by the configuration).
    TcpPlain(SocketAddr),
}

struct FrontendSpec {
    /// `None`: a shared proxy frontend (the request names the cluster).
    cluster: Option<Arc<Cluster>>,
    name: Arc<str>,
    protocol: FrontendProtocol,
    transport: Transport,
}

/// How a configured frontend listens; `authenticated` frontends (every
/// request carries a cluster's password) may use plain TCP anywhere.
fn transport(
    f: &crate::config::Frontend,
    what: &str,
    authenticated: bool,
) -> anyhow::Result<Transport> {
    Ok(match (&f.unix, &f.tcp, &f.cert, &f.key, &f.client_ca) {
        (Some(p), None, ..) => Transport::Unix(p.clone()),
        (None, Some(a), Some(cert), Some(key), Some(ca)) => {
            let v = tls::client_verifier(tls::load_roots(ca)?)?;
            let alpn: &[&[u8]] = match f.protocol {
                FrontendProtocol::Grpc => &[b"h2"],
                FrontendProtocol::HttpConnect | FrontendProtocol::HttpProxy => &[b"http/1.1"],
            };
            let sc =
                tls::server_config(cert, key, Some(v), alpn).with_context(|| what.to_string())?;
            Transport::Tcp(*a, TlsAcceptor::from(Arc::new(sc)))
        }
        (None, Some(a), None, None, None) if a.ip().is_loopback() || authenticated => {
            Transport::TcpPlain(*a)
        }
        _ => anyhow::bail!("{what}: unix, or tcp with cert, key and client_ca"),
    })
}

/// A configured tunnel-server.
pub struct TunnelServer {
    /// Clusters and their agents.
    pub registry: Registry,
    /// Metrics.
    pub metrics: Metrics,
    /// Timeouts and budgets.
    pub settings: Settings,
    /// `serverid` sent to agents.
    pub server_id: String,
    /// `servercount` sent to agents.
    pub server_count: u32,
    /// TLS for the agent endpoint.
    pub agent_tls: TlsAcceptor,
    /// HTTP/2 keepalive towards agents.
    pub agent_h2: H2Settings,
    /// Cancelled on shutdown: ends agent streams and frontend connections.
    pub shutdown: CancellationToken,
    /// Cancelled when draining starts: listeners stop accepting.
    pub accepting: CancellationToken,
    /// Agent connection tasks.
    pub tasks: TaskTracker,
    /// Frontend connection tasks (a drain waits for these).
    pub frontend_tasks: TaskTracker,
    agent_listen: SocketAddr,
    admin_listen: Option<SocketAddr>,
    frontends: Vec<FrontendSpec>,
}

/// Where a started server listens.
#[derive(Debug, Clone)]
pub struct Bound {
    /// Agent endpoint.
    pub agents: SocketAddr,
    /// Admin endpoint.
    pub admin: Option<SocketAddr>,
    /// `(cluster/frontend, address or socket path)`.
    pub frontends: Vec<(String, String)>,
}

/// A random ID in UUID form.
fn random_id() -> String {
    let b: [u8; 16] = rand::random();
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

impl TunnelServer {
    /// Builds the server (reads every certificate; nothing is bound yet).
    pub fn from_config(cfg: &ServerConfig) -> anyhow::Result<Arc<TunnelServer>> {
        let metrics = Metrics::new();
        let mut clusters = Vec::new();
        let mut frontends = Vec::new();
        for c in &cfg.clusters {
            let verifier = match &c.agent_ca {
                Some(ca) => Some(tls::client_verifier(
                    tls::load_roots(ca).with_context(|| format!("cluster {}: agent_ca", c.name))?,
                )?),
                None => None,
            };
            let token = match &c.agent_token {
                Some(t) => Some(
                    match (&t.keys, &t.review) {
                        (Some(keys), None) => {
                            TokenValidator::new(keys, &t.issuer, &t.audience, &t.service_account)
                        }
                        (None, Some(r)) => {
                            TokenReviewer::new(&c.name, r, metrics.token_reviews.clone()).and_then(
                                |r| {
                                    TokenValidator::with_review(
                                        r,
                                        &t.issuer,
                                        &t.audience,
                                        &t.service_account,
                                    )
                                },
                            )
                        }
                        _ => Err(anyhow::anyhow!("exactly one of keys or review")),
                    }
                    .with_context(|| format!("cluster {}: agent_token", c.name))?,
                ),
                None => None,
            };
            let strategies = c
                .strategies
                .iter()
                .filter_map(|s| Strategy::from_name(s))
                .collect();
            let mut cluster =
                Cluster::new(&c.name, strategies, verifier, token, c.limits.to_limits());
            if let Some(p) = &c.proxy_password_file {
                let text = std::fs::read_to_string(p).with_context(|| {
                    format!("cluster {}: proxy_password_file {}", c.name, p.display())
                })?;
                let pw = text.trim();
                if pw.is_empty() {
                    anyhow::bail!(
                        "cluster {}: proxy_password_file {} is empty",
                        c.name,
                        p.display()
                    );
                }
                cluster.proxy_password = Some(pw.to_string());
            }
            let cluster = Arc::new(cluster);
            for f in &c.frontends {
                frontends.push(FrontendSpec {
                    cluster: Some(cluster.clone()),
                    name: f.name.as_str().into(),
                    protocol: f.protocol,
                    transport: transport(
                        f,
                        &format!("cluster {} frontend {}", c.name, f.name),
                        false,
                    )?,
                });
            }
            clusters.push(cluster);
        }
        for f in &cfg.proxy_frontends {
            frontends.push(FrontendSpec {
                cluster: None,
                name: f.name.as_str().into(),
                protocol: f.protocol,
                transport: transport(f, &format!("proxy frontend {}", f.name), true)?,
            });
        }
        let any = tls::AnyOf {
            verifiers: clusters.iter().filter_map(|c| c.verifier.clone()).collect(),
            mandatory: clusters.iter().all(|c| c.token.is_none()),
        };
        let agent_tls = tls::server_config(
            &cfg.agents.cert,
            &cfg.agents.key,
            Some(Arc::new(any)),
            &[b"h2"],
        )
        .context("agents: TLS")?;
        Ok(Arc::new(TunnelServer {
            registry: Registry { clusters },
            metrics,
            settings: Settings {
                handshake_timeout: Duration::from_secs(10),
                dial_timeout: cfg.dial_timeout,
                stall_timeout: cfg.stall_timeout,
                queue_bytes: cfg.queue_bytes,
            },
            server_id: cfg.server_id.clone().unwrap_or_else(random_id),
            server_count: cfg.server_count,
            agent_tls: TlsAcceptor::from(Arc::new(agent_tls)),
            agent_h2: H2Settings {
                keepalive: cfg.agents.keepalive,
                keepalive_timeout: cfg.agents.keepalive_timeout,
            },
            shutdown: CancellationToken::new(),
            accepting: CancellationToken::new(),
            tasks: TaskTracker::new(),
            frontend_tasks: TaskTracker::new(),
            agent_listen: cfg.agents.listen,
            admin_listen: cfg.admin.as_ref().map(|a| a.listen),
            frontends,
        }))
    }

    /// Settings for one dial.
    pub fn dial_settings(&self) -> DialSettings {
        DialSettings {
            timeout: self.settings.dial_timeout,
            queue_bytes: self.settings.queue_bytes,
        }
    }

    /// Binds every listener and serves until [`TunnelServer::shutdown`].
    pub async fn start(self: &Arc<Self>) -> anyhow::Result<Bound> {
        let agents = TcpListener::bind(self.agent_listen)
            .await
            .with_context(|| format!("agents: listening on {}", self.agent_listen))?;
        let mut bound = Bound {
            agents: agents.local_addr()?,
            admin: None,
            frontends: Vec::new(),
        };
        {
            let srv = self.clone();
            tokio::spawn(async move {
                let stop = srv.accepting.clone();
                seedlink_net::accept::accept_loop(&agents, &stop, |tcp, peer| {
                    let srv2 = srv.clone();
                    srv.tasks
                        .spawn(super::agents::serve_agent_conn(srv2, tcp, peer));
                })
                .await;
            });
        }
        for f in &self.frontends {
            let label = format!(
                "{}/{}",
                f.cluster.as_ref().map_or("shared", |c| &*c.name),
                f.name
            );
            match &f.transport {
                Transport::Unix(path) => {
                    // Like upstream's --delete-existing-uds-file (default true).
                    let _ = std::fs::remove_file(path);
                    let l = UnixListener::bind(path)
                        .with_context(|| format!("{label}: listening on {}", path.display()))?;
                    use std::os::unix::fs::PermissionsExt;
                    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))
                        .with_context(|| format!("{label}: permissions of {}", path.display()))?;
                    bound.frontends.push((label, path.display().to_string()));
                    self.spawn_unix(l, f);
                }
                Transport::TcpPlain(addr) => {
                    let l = TcpListener::bind(addr)
                        .await
                        .with_context(|| format!("{label}: listening on {addr}"))?;
                    bound.frontends.push((label, l.local_addr()?.to_string()));
                    self.spawn_tcp_plain(l, f);
                }
                Transport::Tcp(addr, acceptor) => {
                    let l = TcpListener::bind(addr)
                        .await
                        .with_context(|| format!("{label}: listening on {addr}"))?;
                    bound.frontends.push((label, l.local_addr()?.to_string()));
                    self.spawn_tcp(l, acceptor.clone(), f);
                }
            }
        }
        if let Some(a) = self.admin_listen {
            let l = TcpListener::bind(a)
                .await
                .with_context(|| format!("admin: listening on {a}"))?;
            bound.admin = Some(l.local_addr()?);
            tokio::spawn(super::admin::serve(self.clone(), l));
        }
        Ok(bound)
    }

    fn spawn_unix(self: &Arc<Self>, l: UnixListener, f: &FrontendSpec) {
        let (srv, cluster, name, proto) =
            (self.clone(), f.cluster.clone(), f.name.clone(), f.protocol);
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    a = l.accept() => a,
                    () = srv.accepting.cancelled() => return,
                };
                let s = match accepted {
                    Ok((s, _)) => s,
                    Err(e) => {
                        tracing::warn!(error = %e, "frontend accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let (srv2, cluster, name) = (srv.clone(), cluster.clone(), name.clone());
                srv.frontend_tasks
                    .spawn(async move { serve_frontend(srv2, cluster, name, proto, s).await });
            }
        });
    }

    fn spawn_tcp(self: &Arc<Self>, l: TcpListener, acceptor: TlsAcceptor, f: &FrontendSpec) {
        let (srv, cluster, name, proto) =
            (self.clone(), f.cluster.clone(), f.name.clone(), f.protocol);
        tokio::spawn(async move {
            let stop = srv.accepting.clone();
            seedlink_net::accept::accept_loop(&l, &stop, |tcp, _| {
                let (srv2, cluster, name, acceptor) =
                    (srv.clone(), cluster.clone(), name.clone(), acceptor.clone());
                srv.frontend_tasks.spawn(async move {
                    let _ = tcp.set_nodelay(true);
                    let hs = srv2.settings.handshake_timeout;
                    match tokio::time::timeout(hs, acceptor.accept(tcp)).await {
                        Ok(Ok(tls)) => serve_frontend(srv2, cluster, name, proto, tls).await,
                        _ => srv2.metrics.frontend_conn(
                            cluster.as_ref().map_or("", |c| &*c.name),
                            &name,
                            "tls_failed",
                        ),
                    }
                });
            })
            .await;
        });
    }

    fn spawn_tcp_plain(self: &Arc<Self>, l: TcpListener, f: &FrontendSpec) {
        let (srv, cluster, name, proto) =
            (self.clone(), f.cluster.clone(), f.name.clone(), f.protocol);
        tokio::spawn(async move {
            let stop = srv.accepting.clone();
            seedlink_net::accept::accept_loop(&l, &stop, |tcp, _| {
                let _ = tcp.set_nodelay(true);
                let (srv2, cluster, name) = (srv.clone(), cluster.clone(), name.clone());
                srv.frontend_tasks
                    .spawn(serve_frontend(srv2, cluster, name, proto, tcp));
            })
            .await;
        });
    }

    /// Ready: not draining and at least one agent connected.
    pub fn ready(&self) -> bool {
        !self.accepting.is_cancelled() && self.registry.any_agent()
    }

    /// Drains: not ready, listeners closed (new frontends and agents are
    /// refused), open frontend connections may finish within `grace`; then
    /// every agent stream and remaining connection is ended.
    pub async fn stop(&self, grace: Duration) {
        self.accepting.cancel();
        self.frontend_tasks.close();
        let _ = tokio::time::timeout(grace, self.frontend_tasks.wait()).await;
        self.shutdown.cancel();
        self.tasks.close();
        let _ = tokio::time::timeout(Duration::from_secs(2), self.tasks.wait()).await;
    }
}

async fn serve_frontend<S>(
    srv: Arc<TunnelServer>,
    cluster: Option<Arc<Cluster>>,
    name: Arc<str>,
    proto: FrontendProtocol,
    io: S,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    use super::frontend::ProxyCluster;
    let cluster = match (proto, cluster) {
        (FrontendProtocol::HttpProxy, c) => {
            let choice = match &c {
                Some(c) => ProxyCluster::Fixed(c),
                None => ProxyCluster::ByCredentials,
            };
            let (cl, outcome) = super::frontend::serve_http_proxy(&srv, choice, io).await;
            srv.metrics.frontend_conn(&cl, &name, outcome);
            return;
        }
        (_, Some(c)) => c,
        // Only proxy frontends are shared (the configuration says so).
        (_, None) => return,
    };
    match proto {
        FrontendProtocol::HttpConnect | FrontendProtocol::HttpProxy => {
            let outcome = super::frontend::serve_http_connect(&srv, &cluster, io).await;
            srv.metrics.frontend_conn(&cluster.name, &name, outcome);
        }
        FrontendProtocol::Grpc => {
            // kube-apiserver's gRPC client names the socket path as
            // `:authority`; see `authority` for why and how it is rewritten.
            let (rd, wr) = tokio::io::split(io);
            let (to_server, from_client) = tokio::io::duplex(256 * 1024);
            let fix = tokio::spawn(async move {
                if let Err(e) = crate::authority::rewrite(rd, to_server).await {
                    tracing::debug!(error = %e, "gRPC frontend connection ended");
                }
            });
            let h = super::frontend::grpc_handler(srv.clone(), cluster, name);
            let io = tokio::io::join(from_client, wr);
            crate::grpc::serve(io, vec![(PROXY_PATH, h)], srv.agent_h2).await;
            fix.abort();
        }
    }
}

//! The accept loops and the per-connection dispatch: which protocol a
//! frontend connection speaks, the TLS handshake of a shared frontend (its
//! client certificate names the cluster), and the agent endpoint's accept
//! loop. `run` binds the sockets and hands them here; nothing here knows
//! about reloads.

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio::net::{TcpListener, UnixListener};
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

use super::core::Core;
use super::frontend::FrontendEnd;
use super::Cluster;
use crate::auth::tls;
use crate::config::FrontendProtocol;
use crate::wire::proto::PROXY_PATH;

/// Answers a handed-over CONNECT that cannot be served: 503 (within 5 s).
pub(super) async fn refuse_handoff(mut tcp: tokio::net::TcpStream) {
    use tokio::io::AsyncWriteExt;
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        let _ = tcp
            .write_all(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            .await;
        let _ = tcp.shutdown().await;
    })
    .await;
}

/// Draining: a stream that carries nothing ends, so that an upstream agent
/// (which ignores DRAIN) reconnects to a process that takes dials instead
/// of waiting for this one's deadline (a seedlink agent has moved
/// already). Only once the handshake deadline passed: a frontend connection
/// accepted just before the drain has dialed by then (or was dropped).
pub(super) async fn end_idle_agent_streams(core: Arc<Core>) {
    tokio::select! {
        () = tokio::time::sleep(core.settings.handshake_timeout) => {}
        () = core.shutdown.cancelled() => return,
    }
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = core.shutdown.cancelled() => return,
        }
        for cluster in core.registry.clusters().iter() {
            // A gRPC frontend connection may still dial (one connection,
            // many streams): keep its agents.
            let grpc = cluster
                .grpc_frontends
                .load(std::sync::atomic::Ordering::Acquire);
            if grpc > 0 {
                continue;
            }
            for link in cluster.agents() {
                if link.conn_count() == 0 {
                    link.kick.cancel();
                }
            }
        }
    }
}

/// What a frontend's listener serves.
#[derive(Clone)]
pub(super) struct Serve {
    /// `None`: a shared frontend (the request or the client certificate
    /// names the cluster).
    pub(super) cluster: Option<Arc<Cluster>>,
    pub(super) name: Arc<str>,
    pub(super) proto: FrontendProtocol,
    /// Cancelled to stop accepting.
    pub(super) stop: CancellationToken,
}

/// A frontend's serving task, where it is bound, and its swappable TLS
/// acceptor if it has one.
pub(super) type Listening = (JoinHandle<()>, String, Option<Arc<ArcSwap<TlsAcceptor>>>);

impl Serve {
    /// Serves one TCP connection after the TLS handshake (within the
    /// handshake deadline). On a shared CONNECT or gRPC frontend the client
    /// certificate's CN names the cluster.
    async fn tls(self, srv: Arc<Core>, acc: Arc<TlsAcceptor>, tcp: tokio::net::TcpStream) {
        let hs = srv.settings.handshake_timeout;
        let Serve {
            cluster,
            name,
            proto,
            ..
        } = self;
        let tls = match tokio::time::timeout(hs, acc.accept(tcp)).await {
            Ok(Ok(tls)) => tls,
            _ => {
                let c = cluster.as_ref().map_or("", |c| &*c.name);
                return srv
                    .metrics
                    .frontend_conn(c, &name, FrontendEnd::TlsFailed.reason());
            }
        };
        if cluster.is_some() || proto.is_proxy() {
            return serve_frontend(srv, cluster, name, proto, tls).await;
        }
        match named_cluster(&srv, &tls) {
            Some(c) => serve_frontend(srv, Some(c), name, proto, tls).await,
            None => srv
                .metrics
                .frontend_conn("", &name, FrontendEnd::UnknownCluster.reason()),
        }
    }
}

/// The cluster a shared frontend's client certificate names by its CN,
/// if the certificate also carries the URI that cluster requires (a
/// generated cluster's certificate names its object's UID).
fn named_cluster<IO>(
    srv: &Core,
    tls: &tokio_rustls::server::TlsStream<IO>,
) -> Option<Arc<Cluster>> {
    let cert = tls.get_ref().1.peer_certificates()?.first()?;
    let c = srv.registry.cluster(&tls::subject_cn(cert.as_ref())?)?;
    let conf = c.conf.load();
    match &conf.client_uri {
        Some(uri) if !seedlink_config::tunnel::certificate_has_uri(cert.as_ref(), uri) => None,
        _ => Some(c.clone()),
    }
}

pub(super) async fn serve_frontend<S>(
    srv: Arc<Core>,
    cluster: Option<Arc<Cluster>>,
    name: Arc<str>,
    proto: FrontendProtocol,
    io: S,
) where
    S: super::frontend::FrontendIo + Send + 'static,
{
    use super::frontend::ProxyCluster;
    let choice = match &cluster {
        Some(c) => ProxyCluster::Fixed(c),
        None => ProxyCluster::ByCredentials,
    };
    let (cl, outcome) = match proto {
        FrontendProtocol::HttpProxy => super::frontend::serve_http_proxy(&srv, choice, io).await,
        FrontendProtocol::Socks5 => super::socks::serve_socks5(&srv, choice, io).await,
        // Only proxy frontends are shared (the configuration says so).
        FrontendProtocol::HttpConnect | FrontendProtocol::Grpc => {
            let Some(c) = cluster else { return };
            if proto == FrontendProtocol::Grpc {
                return serve_grpc_frontend(srv, c, name, io).await;
            }
            let outcome = super::frontend::serve_http_connect(&srv, &c, io).await;
            (c.name.to_string(), outcome)
        }
    };
    srv.metrics.frontend_conn(&cl, &name, outcome.reason());
}

/// A gRPC frontend connection of `cluster`: HTTP/2 with `ProxyService`,
/// counted while open (it may carry further dials). kube-apiserver's gRPC
/// client names the socket path as `:authority`; see `authority` for why
/// and how it is rewritten.
pub(super) async fn serve_grpc_frontend<S>(
    srv: Arc<Core>,
    cluster: Arc<Cluster>,
    name: Arc<str>,
    io: S,
) where
    S: super::frontend::FrontendIo + Send + 'static,
{
    let (rd, wr) = tokio::io::split(io);
    let (to_server, from_client) = tokio::io::duplex(256 * 1024);
    let fix = tokio::spawn(async move {
        if let Err(e) = crate::transport::authority::rewrite(rd, to_server).await {
            tracing::debug!(error = %e, "gRPC frontend connection ended");
        }
    });
    struct Open(Arc<super::Cluster>);
    impl Drop for Open {
        fn drop(&mut self) {
            self.0
                .grpc_frontends
                .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
        }
    }
    cluster
        .grpc_frontends
        .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
    let _open = Open(cluster.clone());
    let h = super::frontend::grpc_handler(srv.clone(), cluster, name);
    let io = tokio::io::join(from_client, wr);
    crate::transport::grpc::serve(
        io,
        vec![(PROXY_PATH, h)],
        srv.agent_h2,
        crate::transport::grpc::Windows::Large,
    )
    .await;
    fix.abort();
}

/// Accepts on a Unix-socket frontend once `open` (the hand-over's "frontends
/// open") fires, until `serve.stop`; each connection is a frontend task.
pub(super) fn spawn_unix(
    srv: Arc<Core>,
    open: CancellationToken,
    l: UnixListener,
    serve: Serve,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        tokio::select! {
            () = open.cancelled() => {}
            () = serve.stop.cancelled() => return,
        }
        seedlink_net::accept::accept_loop(&l, &serve.stop, |s, _| {
            let (srv2, cluster, name) = (srv.clone(), serve.cluster.clone(), serve.name.clone());
            let proto = serve.proto;
            srv.frontend_tasks
                .spawn(async move { serve_frontend(srv2, cluster, name, proto, s).await });
        })
        .await;
    })
}

/// Accepts on a TCP frontend (with TLS when it has an acceptor) once `open`
/// fires, until `serve.stop`.
pub(super) fn spawn_tcp(
    srv: Arc<Core>,
    open: CancellationToken,
    l: TcpListener,
    acceptor: Option<Arc<ArcSwap<TlsAcceptor>>>,
    serve: Serve,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        tokio::select! {
            () = open.cancelled() => {}
            () = serve.stop.cancelled() => return,
        }
        seedlink_net::accept::accept_loop(&l, &serve.stop, |tcp, _| {
            let _ = tcp.set_nodelay(true);
            let (srv2, serve2) = (srv.clone(), serve.clone());
            match acceptor.as_ref().map(|a| a.load_full()) {
                Some(acc) => srv.frontend_tasks.spawn(serve2.tls(srv2, acc, tcp)),
                None => srv.frontend_tasks.spawn(serve_frontend(
                    srv2,
                    serve2.cluster,
                    serve2.name,
                    serve2.proto,
                    tcp,
                )),
            };
        })
        .await;
    })
}

//! The agent endpoint: TLS with a client certificate from one of the
//! clusters' CAs (the certificate decides the cluster, nothing the agent
//! says does), then gRPC `AgentService/Connect`.

use std::net::SocketAddr;
use std::sync::Arc;

use futures_util::StreamExt;
use tokio::net::TcpStream;
use tonic::{Response, Status};

use super::activity::{Activity, Watched};
use super::core::Core;
use super::{attach, detach, AgentLink, Cluster, Handled, Identifiers};
use crate::fair::FairQueue;
use crate::grpc::{self, Handler, PacketStream};
use crate::proto::{Packet, AGENT_CONNECT_PATH};

/// Serves one accepted agent connection.
pub async fn serve_agent_conn(srv: Arc<Core>, tcp: TcpStream, peer: SocketAddr) {
    let _ = tcp.set_nodelay(true);
    serve_agent_io(srv, tcp, peer).await;
}

/// Serves one agent connection on any transport: an accepted socket, or
/// one the gateway handed over in-process (with the bytes it already read
/// replayed in front). TLS → the cluster its certificate names (if it
/// has one) → gRPC `Connect` streams, each opened by [`open_stream`].
pub async fn serve_agent_io<IO>(srv: Arc<Core>, tcp: IO, peer: SocketAddr)
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let activity = Activity::new();
    let tcp = Watched::new(tcp, activity.clone());
    let tls = match tokio::time::timeout(
        srv.settings.handshake_timeout,
        srv.agent_tls.load_full().accept(tcp),
    )
    .await
    {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            tracing::info!(%peer, error = %e, "agent TLS handshake failed");
            srv.metrics.agent_stream("", "tls_failed");
            return;
        }
        Err(_) => {
            srv.metrics.agent_stream("", "tls_timeout");
            return;
        }
    };
    let certs: Certs = tls
        .get_ref()
        .1
        .peer_certificates()
        .map(|c| c.iter().map(|c| c.clone().into_owned()).collect())
        .unwrap_or_default();
    // A certificate decides the cluster at once; without one, the token
    // in the stream's metadata must.
    let cert_cluster = if certs.is_empty() {
        None
    } else {
        match srv.registry.cluster_for_cert(&certs) {
            Ok(c) => Some(c),
            Err(super::CertMatch::None) => {
                tracing::warn!(%peer, "agent certificate matches no cluster");
                srv.metrics.agent_stream("", "unknown_cluster");
                return;
            }
            Err(super::CertMatch::Ambiguous(a, b)) => {
                tracing::warn!(%peer, first = %a, second = %b, "agent certificate verifies for two clusters (their CAs are linked): refused");
                srv.metrics.agent_stream("", "ambiguous_cluster");
                return;
            }
        }
    };
    // A connection that opens no stream within the handshake deadline is
    // closed: past TLS, a client without a certificate is still nobody.
    let opened = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let handler: Handler = {
        let srv = srv.clone();
        let opened = opened.clone();
        Arc::new(move |req: tonic::Request<tonic::Streaming<Packet>>| {
            opened.store(true, std::sync::atomic::Ordering::Relaxed);
            let (srv, cert_cluster, certs) = (srv.clone(), cert_cluster.clone(), certs.clone());
            let activity = activity.clone();
            Box::pin(
                async move { open_stream(srv, cert_cluster, certs, activity, req, peer).await },
            )
        })
    };
    let first_stream = async {
        tokio::time::sleep(srv.settings.handshake_timeout).await;
        if opened.load(std::sync::atomic::Ordering::Relaxed) {
            std::future::pending::<()>().await;
        }
    };
    tokio::select! {
        () = grpc::serve(tls, vec![(AGENT_CONNECT_PATH, handler)], srv.agent_h2) => {}
        () = first_stream => srv.metrics.agent_stream("", "no_stream"),
    }
}

type Certs = Vec<rustls::pki_types::CertificateDer<'static>>;

/// One `Connect` stream: its cluster, its identity, the link, the receive
/// loop, and the answer with `serverid`/`servercount`.
async fn open_stream(
    srv: Arc<Core>,
    cert_cluster: Option<Arc<Cluster>>,
    certs: Certs,
    activity: Arc<Activity>,
    req: tonic::Request<tonic::Streaming<Packet>>,
    peer: SocketAddr,
) -> Result<Response<PacketStream>, Status> {
    let meta = req.metadata();
    let auth: Vec<_> = meta.get_all("authorization").iter().collect();
    let auth = match auth.as_slice() {
        [] => None,
        [one] => Some(one.to_str().unwrap_or_default().to_string()),
        _ => {
            srv.metrics.agent_stream("", "bad_token");
            return Err(Status::unauthenticated("expected one authorization"));
        }
    };
    let cluster = stream_cluster(&srv, cert_cluster, auth.as_deref(), peer).await?;
    let Identity {
        agent_id,
        ids,
        flow,
        replicas,
    } = stream_identity(&srv, &cluster, meta)?;
    // A second stream of an agent ID this cluster already has is usually
    // replica discovery that reached a replica it holds: it ends cleanly,
    // is counted as `duplicate`, and logs only at debug level.
    let probe = cluster.agents().iter().any(|l| l.agent_id == agent_id);
    let (link, to_agent) = attach(&cluster, agent_id.clone(), ids, flow);
    link.replica_updates
        .store(replicas, std::sync::atomic::Ordering::Release);
    let _ = link.certs.set(certs);
    let _ = link.activity.set(activity);
    if let Some(a) = auth {
        let _ = link.authorization.set(a);
    }
    cluster.metrics.agent(1);
    if probe {
        tracing::debug!(cluster = %cluster.name, agent = %agent_id, uid = link.uid, "agent stream (agent already connected)");
    } else {
        tracing::info!(cluster = %cluster.name, agent = %agent_id, uid = link.uid, flow, "agent connected");
    }
    let answer = response(&srv, to_agent, flow, replicas);
    // Registered after the drain or a hand-over began (its handshake or
    // TokenReview was under way): it gets the DRAIN the others got.
    if srv.accepting.is_cancelled() || srv.agents_moving.load(std::sync::atomic::Ordering::Acquire)
    {
        link.drain_notice();
    }
    tokio::spawn(receive(srv, cluster, link, req.into_inner(), probe));
    answer
}

/// The cluster of a stream: its certificate's, whose token (if the
/// cluster checks tokens) must be valid too; else the one whose issuer
/// accepts its token. Refused when the cluster has its agent streams.
async fn stream_cluster(
    srv: &Core,
    cert_cluster: Option<Arc<Cluster>>,
    auth: Option<&str>,
    peer: SocketAddr,
) -> Result<Arc<Cluster>, Status> {
    // Held while a token is checked (a TokenReview may take a while).
    let _token_slot = match auth {
        Some(_) => match srv.token_slots.enter(peer.ip()) {
            Some(slot) => Some(slot),
            None => {
                srv.metrics.agent_stream("", "token_check_limit");
                return Err(Status::unavailable(
                    "too many token checks from this address at once; retry",
                ));
            }
        },
        None => None,
    };
    let cluster = match (cert_cluster, auth) {
        (Some(c), Some(a)) if c.conf.load().token.is_some() => {
            let token = c.conf.load().token.clone();
            let checked = match token {
                Some(t) => t.check(a).await,
                None => Ok(()),
            };
            if let Err(e) = checked {
                tracing::warn!(%peer, cluster = %c.name, error = %e, "agent token refused");
                return Err(token_refused(srv, &c.name, &e));
            }
            c
        }
        (Some(c), _) => c,
        (None, Some(a)) => match srv.registry.cluster_for_token(a).await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(%peer, error = %e, "agent token refused");
                return Err(token_refused(srv, "", &e));
            }
        },
        (None, None) => {
            srv.metrics.agent_stream("", "no_credentials");
            return Err(Status::unauthenticated(
                "a client certificate or a ServiceAccount token is required",
            ));
        }
    };
    let max = cluster.gate.limits().max_agents;
    if max > 0 && cluster.agent_count() >= max {
        tracing::warn!(%peer, cluster = %cluster.name, max, "agent stream refused: limit");
        srv.metrics.agent_stream(&cluster.name, "limit_agents");
        return Err(Status::resource_exhausted(
            "too many agent streams for this cluster",
        ));
    }
    Ok(cluster)
}

/// The longest `agentid` accepted.
pub const MAX_AGENT_ID: usize = 256;

/// What a stream says about its agent.
struct Identity {
    /// `agentid` (exactly one).
    agent_id: String,
    /// `agentidentifiers` (at most one).
    ids: Identifiers,
    /// It asks for per-connection flow control.
    flow: bool,
    /// It asks to be told when the number of replicas changes.
    replicas: bool,
}

/// What a stream says about its agent: `agentid` (exactly one),
/// `agentidentifiers` (at most one), the seedlink extensions it asks for.
fn stream_identity(
    srv: &Core,
    cluster: &Cluster,
    meta: &tonic::metadata::MetadataMap,
) -> Result<Identity, Status> {
    let ids: Vec<_> = meta.get_all("agentid").iter().collect();
    let [agent_id] = ids.as_slice() else {
        srv.metrics.agent_stream(&cluster.name, "bad_agent_id");
        return Err(Status::invalid_argument("expected one agent ID"));
    };
    let Ok(agent_id) = agent_id.to_str() else {
        return Err(Status::invalid_argument("agent ID is not ASCII"));
    };
    // Pod and node names and UUIDs are far shorter; a longer ID only
    // inflates what the server keeps and reports (a hand-over names every
    // agent).
    if agent_id.is_empty() || agent_id.len() > MAX_AGENT_ID {
        srv.metrics.agent_stream(&cluster.name, "bad_agent_id");
        return Err(Status::invalid_argument(format!(
            "an agent ID has 1 to {MAX_AGENT_ID} characters"
        )));
    }
    let idents: Vec<_> = meta.get_all("agentidentifiers").iter().collect();
    let ids = match idents.as_slice() {
        [] => Identifiers::default(),
        [one] => {
            let (ids, ignored) = Identifiers::parse(one.to_str().unwrap_or(""));
            if !ignored.is_empty() {
                tracing::info!(agent = agent_id, ?ignored, "ignored agent identifiers");
            }
            ids
        }
        _ => {
            srv.metrics.agent_stream(&cluster.name, "bad_identifiers");
            return Err(Status::invalid_argument(
                "expected at most one agentidentifiers",
            ));
        }
    };
    let asks = |h: &str, v: &str| meta.get(h).and_then(|x| x.to_str().ok()) == Some(v);
    Ok(Identity {
        agent_id: agent_id.to_string(),
        ids,
        flow: asks(crate::flow::HEADER, crate::flow::VERSION),
        replicas: asks(
            crate::proto::REPLICAS_HEADER,
            crate::proto::REPLICAS_VERSION,
        ),
    })
}

/// The stream's answer: packets from the link's queue, with `serverid`,
/// `servercount` and (if agreed) the extensions' headers.
fn response(
    srv: &Core,
    to_agent: Arc<FairQueue>,
    flow: bool,
    replicas: bool,
) -> Result<Response<PacketStream>, Status> {
    let out: PacketStream = Box::pin(futures_util::stream::unfold(to_agent, |q| async move {
        q.next().await.map(|p| (Ok(p), q))
    }));
    let mut resp = Response::new(out);
    let id = srv
        .server_id
        .parse()
        .map_err(|_| Status::internal("server ID"))?;
    resp.metadata_mut().insert("serverid", id);
    resp.metadata_mut().insert(
        "servercount",
        srv.server_count
            .load(std::sync::atomic::Ordering::Relaxed)
            .to_string()
            .parse()
            .map_err(|_| Status::internal("server count"))?,
    );
    if flow {
        resp.metadata_mut().insert(
            crate::flow::HEADER,
            tonic::metadata::MetadataValue::from_static(crate::flow::VERSION),
        );
    }
    if replicas {
        resp.metadata_mut().insert(
            crate::proto::REPLICAS_HEADER,
            tonic::metadata::MetadataValue::from_static(crate::proto::REPLICAS_VERSION),
        );
    }
    Ok(resp)
}

/// The receive loop of one stream: each packet goes to the link; it waits
/// on a connection only when that connection's queue is full (see
/// queue.rs and docs/TUNNEL.md, "Head-of-line"). Ends with the stream, on
/// shutdown, when the cluster is removed or re-keyed away from the agent.
async fn receive(
    srv: Arc<Core>,
    cluster: Arc<Cluster>,
    link: Arc<AgentLink>,
    mut inbound: tonic::Streaming<Packet>,
    probe: bool,
) {
    let why = loop {
        tokio::select! {
            m = inbound.next() => match m {
                Some(Ok(p)) => {
                    let (h, blocked) = link.on_agent_packet(p);
                    cluster.metrics.packet(h);
                    if link.to_agent.overflowed() {
                        // It made the server queue more answers than it
                        // reads: cut off, this agent only.
                        break "control_overflow";
                    }
                    let Some(b) = blocked else { continue };
                    // Backpressure: this stream reads nothing more until
                    // that connection's reader makes room, or stops reading
                    // for the stall deadline.
                    tokio::select! {
                        h = b.resume(&link, srv.settings.stall_timeout) => {
                            if h != Handled::Ok {
                                cluster.metrics.packet(h);
                            }
                        }
                        () = srv.shutdown.cancelled() => break "server_shutdown",
                        () = cluster.removed.cancelled() => break "cluster_removed",
                        () = link.kick.cancelled() => break kicked(&srv, &link),
                    }
                }
                Some(Err(e)) => {
                    tracing::info!(agent = %link.agent_id, error = %e, "agent stream failed");
                    break "stream_error";
                }
                None => break "closed",
            },
            () = srv.shutdown.cancelled() => break "server_shutdown",
            () = cluster.removed.cancelled() => break "cluster_removed",
            () = link.kick.cancelled() => break kicked(&srv, &link),
        }
    };
    detach(&cluster, &link);
    cluster.metrics.agent(-1);
    if probe && why == "closed" {
        srv.metrics.agent_stream(&cluster.name, "duplicate");
        tracing::debug!(cluster = %cluster.name, agent = %link.agent_id, uid = link.uid, "duplicate agent stream closed");
    } else {
        srv.metrics.agent_stream(&cluster.name, why);
        tracing::info!(cluster = %cluster.name, agent = %link.agent_id, uid = link.uid, why, "agent disconnected");
    }
}

/// Why a link was kicked: its queue overflowed, it carried nothing more
/// while the server drains, or its cluster was re-keyed away from it.
fn kicked(srv: &Core, link: &AgentLink) -> &'static str {
    if link.to_agent.overflowed() {
        "control_overflow"
    } else if srv.accepting.is_cancelled() {
        "drained_idle"
    } else {
        "rekeyed"
    }
}

/// Counts a refused token and answers the agent: `UNAVAILABLE` when the
/// API server could not be asked (the agent retries with back-off), else
/// `UNAUTHENTICATED`.
fn token_refused(srv: &Core, cluster: &str, e: &crate::token::TokenError) -> Status {
    if matches!(e, crate::token::TokenError::Unavailable(_)) {
        srv.metrics
            .agent_stream(cluster, "token_review_unavailable");
        Status::unavailable("token could not be reviewed")
    } else {
        srv.metrics.agent_stream(cluster, "bad_token");
        Status::unauthenticated("token refused")
    }
}

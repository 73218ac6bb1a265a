//! The agent endpoint: TLS with a client certificate from one of the
//! clusters' CAs (the certificate decides the cluster, nothing the agent
//! says does), then gRPC `AgentService/Connect`.

use std::net::SocketAddr;
use std::sync::Arc;

use futures_util::{Stream, StreamExt};
use tokio::net::TcpStream;
use tonic::{Response, Status};

use super::activity::{Activity, Watched};
use super::core::Core;
use super::{attach, detach, Cluster, Handled, Identifiers, LinkDriver};
use crate::stream::fair::FairQueue;
use crate::transport::grpc::{self, Handler, PacketStream};
use crate::transport::native;
use crate::transport::usertls::UserTls;
use crate::wire::proto::{Packet, AGENT_CONNECT_PATH};

/// The slots an agent connection holds: one of the port's, and, until it
/// is authenticated (TLS named its cluster, or a stream was admitted), one
/// of the unauthenticated ones.
pub struct ConnSlots {
    _slot: seedlink_net::admin::Slot,
    pre_auth: std::sync::Mutex<Option<seedlink_net::admin::Slot>>,
}

impl ConnSlots {
    /// The connection is an agent's: its unauthenticated slot goes back.
    fn authenticated(&self) {
        seedlink_net::sync::lock(&self.pre_auth, "pre-auth slot").take();
    }
}

/// Lets a new agent connection from `peer` in, or says why not (counted):
/// its source started too many TLS handshakes lately (`handshake_rate`),
/// the port or its source is full (`connection_limit`), or too many
/// connections are unauthenticated, in all or from its source
/// (`unauthenticated_limit`). A source refused for its handshake rate
/// as often again is shut out at the port for a while (`shut_out`).
pub fn enter(srv: &Core, peer: SocketAddr) -> Option<ConnSlots> {
    let now = std::time::Instant::now();
    if srv.shut_out.is_blocked(peer.ip(), now) {
        // Its SYNs are dropped from now on; this one came before.
        srv.metrics.agent_stream("", "shut_out");
        return None;
    }
    if !srv.handshakes.allow(peer.ip(), now) {
        srv.metrics.agent_stream("", "handshake_rate");
        if !srv.over_rate.allow(peer.ip(), now) && srv.shut_out.block(peer.ip(), now) {
            tracing::warn!(source = %peer.ip(), seconds = super::core::SHUT_OUT.as_secs(), "agent port: a source connecting at more than twice its handshake rate is shut out");
        }
        return None;
    }
    let Some(slot) = srv.agent_slots.enter(peer.ip()) else {
        srv.metrics.agent_stream("", "connection_limit");
        return None;
    };
    let Some(pre_auth) = srv.pre_auth_slots.enter(peer.ip()) else {
        srv.metrics.agent_stream("", "unauthenticated_limit");
        return None;
    };
    Some(ConnSlots {
        _slot: slot,
        pre_auth: std::sync::Mutex::new(Some(pre_auth)),
    })
}

/// Serves one accepted agent connection.
pub async fn serve_agent_conn(srv: Arc<Core>, tcp: TcpStream, peer: SocketAddr, slots: ConnSlots) {
    let _ = tcp.set_nodelay(true);
    serve_agent_io(srv, tcp, peer, slots).await;
}

/// Serves one agent connection on any transport: an accepted socket, or
/// one the gateway handed over in-process (with the bytes it already read
/// replayed in front). TLS → the cluster its certificate names (if it
/// has one) → gRPC `Connect` streams, each opened by [`open_stream`].
pub async fn serve_agent_io<IO>(srv: Arc<Core>, tcp: IO, peer: SocketAddr, slots: ConnSlots)
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let activity = Activity::new();
    let tcp = Watched::new(tcp, activity.clone());
    // Boxed, as are the gRPC branch and the native stream's opening: the
    // task lives as long as the agent stream, and inline they would size
    // every stream's task for themselves (26.5 KB per task measured,
    // 4.4 KB boxed; docs/PERFORMANCE.md, issue 28).
    let Some(mut tls) = Box::pin(accept_tls(&srv, tcp, peer)).await else {
        return;
    };
    let certs: Certs = tls.take_peer_certificates();
    let Ok(cert_cluster) = cluster_of_cert(&srv, &certs, peer) else {
        return;
    };
    // A connection without an admitted stream for the handshake deadline
    // is closed: past TLS, a client without a certificate is still nobody.
    let conn = AgentConn {
        srv: srv.clone(),
        cert_cluster,
        certs,
        activity,
        peer,
        slots: Arc::new(slots),
    };
    if tls.session().alpn.as_deref() == Some(native::ALPN.as_bytes()) {
        serve_native(conn, tls).await;
        return;
    }
    Box::pin(serve_grpc(conn, tls)).await;
}

/// gRPC `Connect` streams on one agent connection (HTTP/2), the first
/// within the handshake deadline.
async fn serve_grpc<IO>(conn: AgentConn, tls: IO)
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let srv = conn.srv.clone();
    let live = Arc::new(Live::default());
    // Without a certificate naming its cluster, the peer is nobody until
    // a stream's token is checked: small windows until then.
    let windows = match conn.cert_cluster {
        Some(_) => grpc::Windows::Large,
        None => grpc::Windows::Small,
    };
    let handler = conn.handler(live.clone());
    let idle = without_streams_for(srv.settings.handshake_timeout, &live);
    tokio::select! {
        () = grpc::serve(tls, vec![(AGENT_CONNECT_PATH, handler)], srv.agent_h2, windows) => {}
        () = idle => srv.metrics.agent_stream("", "no_stream"),
        () = live.refused_anonymous.notified() => {}
    }
}

/// The admitted streams of one gRPC agent connection.
#[derive(Default)]
pub(crate) struct Live {
    streams: std::sync::atomic::AtomicUsize,
    changed: tokio::sync::Notify,
    /// A stream was refused on a connection without a cluster's
    /// certificate and without an admitted stream: it is nobody, and the
    /// connection ends.
    refused_anonymous: tokio::sync::Notify,
}

/// One admitted stream, counted in [`Live`] while it runs.
struct Running(Arc<Live>);

impl Running {
    fn new(live: Arc<Live>) -> Running {
        live.streams
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        live.changed.notify_waiters();
        Running(live)
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.0
            .streams
            .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
        self.0.changed.notify_waiters();
    }
}

/// Ends once the connection has had no admitted stream for `deadline`: at
/// its start, after refused streams (an anonymous client that opens one
/// and is refused holds nothing), and after its last stream ended.
pub(crate) async fn without_streams_for(deadline: std::time::Duration, live: &Live) {
    loop {
        let changed = live.changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        if live.streams.load(std::sync::atomic::Ordering::Acquire) > 0 {
            changed.await;
            continue;
        }
        tokio::select! {
            () = tokio::time::sleep(deadline) => {
                if live.streams.load(std::sync::atomic::Ordering::Acquire) == 0 {
                    return;
                }
            }
            () = &mut changed => {}
        }
    }
}

/// The TLS handshake within the handshake deadline; `None` (counted) if
/// it failed or took too long. TLS 1.3 in this process (usertls.rs).
async fn accept_tls<IO>(srv: &Core, tcp: IO, peer: SocketAddr) -> Option<UserTls<IO>>
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let accept = crate::transport::usertls::accept(srv.agent_tls.load_full(), tcp);
    let within = tokio::time::timeout(srv.settings.handshake_timeout, accept);
    let done = match &srv.handshaker {
        // The handshake's work on the low-priority thread; the stream
        // comes back to the workers.
        Some(h) => match h.spawn(within).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(%peer, error = %e, "agent TLS handshake task failed");
                srv.metrics.agent_stream("", "tls_failed");
                return None;
            }
        },
        None => within.await,
    };
    match done {
        Ok(Ok(s)) => Some(s),
        Ok(Err(e)) => {
            tracing::info!(%peer, error = %e, "agent TLS handshake failed");
            srv.metrics.agent_stream("", "tls_failed");
            None
        }
        Err(_) => {
            srv.metrics.agent_stream("", "tls_timeout");
            None
        }
    }
}

/// A certificate decides the cluster at once (`Ok(None)` without one: the
/// token in the stream's metadata must); `Err` (counted) when it matches
/// no cluster or two.
fn cluster_of_cert(
    srv: &Core,
    certs: &Certs,
    peer: SocketAddr,
) -> Result<Option<Arc<Cluster>>, ()> {
    if certs.is_empty() {
        return Ok(None);
    }
    match srv.registry.cluster_for_cert(certs) {
        Ok(c) => Ok(Some(c)),
        Err(super::CertMatch::None) => {
            tracing::warn!(%peer, "agent certificate matches no cluster");
            srv.metrics.agent_stream("", "unknown_cluster");
            Err(())
        }
        Err(super::CertMatch::Ambiguous(a, b)) => {
            tracing::warn!(%peer, first = %a, second = %b, "agent certificate verifies for two clusters (their CAs are linked): refused");
            srv.metrics.agent_stream("", "ambiguous_cluster");
            Err(())
        }
    }
}

type Certs = Vec<rustls::pki_types::CertificateDer<'static>>;

/// What the streams of one agent connection share: its certificate's
/// cluster and chain, its read stamp, its address.
#[derive(Clone)]
struct AgentConn {
    srv: Arc<Core>,
    cert_cluster: Option<Arc<Cluster>>,
    certs: Certs,
    activity: Arc<Activity>,
    peer: SocketAddr,
    slots: Arc<ConnSlots>,
}

impl AgentConn {
    /// The `Connect` handler: each stream is opened by [`open_stream`] and
    /// counted in `live` while it runs.
    fn handler(self, live: Arc<Live>) -> Handler {
        Arc::new(move |req: tonic::Request<tonic::Streaming<Packet>>| {
            Box::pin(open_stream(self.clone(), live.clone(), req))
        })
    }
}

/// One `Connect` stream: its cluster, its identity, the link, the receive
/// loop, and the answer with `serverid`/`servercount`.
async fn open_stream(
    conn: AgentConn,
    live: Arc<Live>,
    req: tonic::Request<tonic::Streaming<Packet>>,
) -> Result<Response<PacketStream>, Status> {
    let srv = conn.srv.clone();
    let anonymous = conn.cert_cluster.is_none();
    let a = match admit(conn, req.metadata()).await {
        Ok(a) => a,
        Err(status) => {
            if anonymous && live.streams.load(std::sync::atomic::Ordering::Acquire) == 0 {
                live.refused_anonymous.notify_one();
            }
            return Err(status);
        }
    };
    let running = Running::new(live);
    let answer = response(&srv, a.to_agent.clone(), a.flow, a.replicas);
    drain_notice_if_moving(&srv, &a.link);
    tokio::spawn(async move {
        receive(srv, a.cluster, a.link, req.into_inner(), a.probe).await;
        drop(running);
    });
    answer
}

/// A stream let in: attached to its cluster.
struct Admitted {
    cluster: Arc<Cluster>,
    link: Arc<LinkDriver>,
    to_agent: Arc<FairQueue>,
    probe: bool,
    flow: bool,
    replicas: bool,
}

/// Checks a stream's credentials and what it says (its metadata), and
/// attaches it to its cluster.
async fn admit(conn: AgentConn, meta: &tonic::metadata::MetadataMap) -> Result<Admitted, Status> {
    let srv = conn.srv.clone();
    let auth = one_authorization(&srv, meta)?;
    let cert_cluster = conn.cert_cluster.clone();
    let cluster = stream_cluster(&srv, cert_cluster, auth.as_deref(), conn.peer).await?;
    let identity = stream_identity(&srv, &cluster, meta)?;
    conn.slots.authenticated();
    let (flow, replicas) = (identity.flow, identity.replicas);
    let (link, to_agent, probe) = attach_stream(&cluster, identity, conn, auth);
    Ok(Admitted {
        cluster,
        link,
        to_agent,
        probe,
        flow,
        replicas,
    })
}

/// Registered after the drain or a hand-over began (its handshake or
/// TokenReview was under way): it gets the DRAIN the others got.
fn drain_notice_if_moving(srv: &Core, link: &LinkDriver) {
    let moving = srv.agents_moving.load(std::sync::atomic::Ordering::Acquire);
    if srv.accepting.is_cancelled() || moving {
        link.drain_notice();
    }
}

/// The extensions a stream's metadata asks for: flow control, replica
/// updates.
fn asked(meta: &tonic::metadata::MetadataMap) -> (bool, bool) {
    let asks = |h: &str, v: &str| meta.get(h).and_then(|x| x.to_str().ok()) == Some(v);
    (
        asks(crate::stream::flow::HEADER, crate::stream::flow::VERSION),
        asks(
            crate::wire::proto::REPLICAS_HEADER,
            crate::wire::proto::REPLICAS_VERSION,
        ),
    )
}

/// One agent stream on the native transport (`seedlink-tunnel/1`, see
/// native.rs): OPEN within the handshake deadline, the same admission as a
/// gRPC `Connect`, ANSWER or REFUSED, then packets both ways until the
/// stream ends. It requires flow control, so the receive loop never stops
/// reading for a full queue and PINGs are always answered.
async fn serve_native<IO>(conn: AgentConn, tls: IO)
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let srv = conn.srv.clone();
    // The connection's slots are held as long as the connection is.
    let _slots = conn.slots.clone();
    // Boxed: the steps before the stream runs (OPEN, admission, ANSWER)
    // would otherwise size the task that lives as long as the stream.
    let Some((a, tls)) = Box::pin(open_native(conn, tls)).await else {
        return;
    };
    drain_notice_if_moving(&srv, &a.link);
    let (inbound, writer) = native::start(tls, a.to_agent.clone(), srv.agent_h2);
    let grace = srv.settings.handshake_timeout;
    receive(srv, a.cluster, a.link, inbound, a.probe).await;
    // The queue is closed: the writer closes the connection, unless the
    // agent takes nothing (frozen), which the grace bounds.
    let abort = writer.abort_handle();
    if tokio::time::timeout(grace, writer).await.is_err() {
        abort.abort();
    }
}

/// The native stream's opening: OPEN, admission, ANSWER or REFUSED (counted);
/// the admitted stream and its connection.
async fn open_native<IO>(conn: AgentConn, mut tls: IO) -> Option<(Admitted, IO)>
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let srv = conn.srv.clone();
    let peer = conn.peer;
    let meta = match tokio::time::timeout(srv.settings.handshake_timeout, native::accept(&mut tls))
        .await
    {
        Ok(Ok(m)) => m,
        // Records nobody should send (usertls.rs refused them): said
        // and counted, before any stream.
        Ok(Err(native::WireError::Io(e))) if e.kind() == std::io::ErrorKind::InvalidData => {
            tracing::info!(%peer, error = %e, "agent connection refused before OPEN: bad TLS record");
            srv.metrics.agent_stream("", "bad_record");
            return None;
        }
        // Gone before a whole frame (a port check, a scan): no stream.
        Ok(Err(native::WireError::Io(_) | native::WireError::Truncated)) => {
            srv.metrics.agent_stream("", "no_stream");
            return None;
        }
        Ok(Err(e)) => {
            tracing::info!(%peer, error = %e, "agent stream refused: bad OPEN");
            srv.metrics.agent_stream("", "bad_open");
            return None;
        }
        Err(_) => {
            srv.metrics.agent_stream("", "no_stream");
            return None;
        }
    };
    let (flow, replicas) = asked(&meta);
    let answer = answer_meta(&srv, flow, replicas);
    let admitted = match (flow, answer) {
        (false, _) => Err(Status::failed_precondition(format!(
            "the {} transport needs per-connection flow control",
            native::ALPN
        ))),
        (true, Err(s)) => Err(s),
        (true, Ok(answer)) => admit(conn, &meta).await.map(|a| (a, answer)),
    };
    let (a, answer) = match admitted {
        Ok(x) => x,
        Err(status) => {
            if !flow {
                srv.metrics.agent_stream("", "bad_open");
            }
            let _ = tokio::time::timeout(
                srv.settings.handshake_timeout,
                native::refuse(&mut tls, &status),
            )
            .await;
            return None;
        }
    };
    // An agent gone meanwhile: its stream fails at once and is detached.
    let _ = tokio::time::timeout(
        srv.settings.handshake_timeout,
        native::answer(&mut tls, &answer),
    )
    .await;
    Some((a, tls))
}

/// The stream's `authorization` (at most one).
fn one_authorization(
    srv: &Core,
    meta: &tonic::metadata::MetadataMap,
) -> Result<Option<String>, Status> {
    let auth: Vec<_> = meta.get_all("authorization").iter().collect();
    match auth.as_slice() {
        [] => Ok(None),
        [one] => Ok(Some(one.to_str().unwrap_or_default().to_string())),
        _ => {
            srv.metrics.agent_stream("", "bad_token");
            Err(Status::unauthenticated("expected one authorization"))
        }
    }
}

/// Registers the stream in `cluster` with what it says and presented;
/// its link's timers come from the server's settings. `true` with a probe:
/// a second stream of an agent ID this cluster already has is usually
/// replica discovery that reached a replica it holds; it ends cleanly, is
/// counted as `duplicate`, and logs only at debug level.
fn attach_stream(
    cluster: &Cluster,
    identity: Identity,
    conn: AgentConn,
    auth: Option<String>,
) -> (Arc<LinkDriver>, Arc<FairQueue>, bool) {
    let timers = super::link::Timers {
        stall: conn.srv.settings.stall_timeout,
        unresponsive_after: conn.srv.dial_settings().unresponsive_after,
    };
    let Identity {
        agent_id,
        ids,
        flow,
        replicas,
    } = identity;
    let probe = cluster.agents().iter().any(|l| l.agent_id == agent_id);
    let (link, to_agent) = attach(cluster, agent_id, ids, flow, timers);
    link.replica_updates
        .store(replicas, std::sync::atomic::Ordering::Release);
    let _ = link.certs.set(conn.certs);
    let _ = link.activity.set(conn.activity);
    if let Some(a) = auth {
        let _ = link.authorization.set(a);
    }
    cluster.metrics.agent(1);
    let (name, agent, uid) = (&cluster.name, &link.agent_id, link.uid);
    if probe {
        tracing::debug!(cluster = %name, agent = %agent, uid, "agent stream (agent already connected)");
    } else {
        tracing::info!(cluster = %name, agent = %agent, uid, flow, "agent connected");
    }
    (link, to_agent, probe)
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
    let cluster = credited_cluster(srv, cert_cluster, auth, peer).await?;
    let until = cluster
        .flood_until_ms
        .load(std::sync::atomic::Ordering::Acquire);
    if seedlink_net::clock::now_ms() < until {
        srv.metrics.agent_stream(&cluster.name, "flood_cooldown");
        return Err(Status::unavailable(
            "a stream of this cluster was cut for flooding; retry later",
        ));
    }
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

/// The cluster the stream's credentials name: its certificate's (whose
/// token must be valid too if that cluster checks tokens), else the one
/// whose issuer accepts its token.
async fn credited_cluster(
    srv: &Core,
    cert_cluster: Option<Arc<Cluster>>,
    auth: Option<&str>,
    peer: SocketAddr,
) -> Result<Arc<Cluster>, Status> {
    match (cert_cluster, auth) {
        (Some(c), Some(a)) => {
            let token = c.conf.load().token.clone();
            if let Some(t) = token {
                if let Err(e) = t.check(a).await {
                    tracing::warn!(%peer, cluster = %c.name, error = %e, "agent token refused");
                    return Err(token_refused(srv, &c.name, &e));
                }
            }
            Ok(c)
        }
        (Some(c), None) => Ok(c),
        (None, Some(a)) => srv.registry.cluster_for_token(a).await.map_err(|e| {
            tracing::warn!(%peer, error = %e, "agent token refused");
            token_refused(srv, "", &e)
        }),
        (None, None) => {
            srv.metrics.agent_stream("", "no_credentials");
            Err(Status::unauthenticated(
                "a client certificate or a ServiceAccount token is required",
            ))
        }
    }
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
    let ids = stream_identifiers(srv, cluster, meta, agent_id)?;
    let (flow, replicas) = asked(meta);
    Ok(Identity {
        agent_id: agent_id.to_string(),
        ids,
        flow,
        replicas,
    })
}

/// `agentidentifiers` (at most one); what does not parse is logged and
/// ignored.
fn stream_identifiers(
    srv: &Core,
    cluster: &Cluster,
    meta: &tonic::metadata::MetadataMap,
    agent_id: &str,
) -> Result<Identifiers, Status> {
    let idents: Vec<_> = meta.get_all("agentidentifiers").iter().collect();
    match idents.as_slice() {
        [] => Ok(Identifiers::default()),
        [one] => {
            let (ids, ignored) = Identifiers::parse(one.to_str().unwrap_or(""));
            if !ignored.is_empty() {
                tracing::info!(agent = agent_id, ?ignored, "ignored agent identifiers");
            }
            Ok(ids)
        }
        _ => {
            srv.metrics.agent_stream(&cluster.name, "bad_identifiers");
            Err(Status::invalid_argument(
                "expected at most one agentidentifiers",
            ))
        }
    }
}

/// The stream's answer: packets from the link's queue, with the answer's
/// metadata.
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
    *resp.metadata_mut() = answer_meta(srv, flow, replicas)?;
    Ok(resp)
}

/// The answer's metadata: `serverid`, `servercount` and (if agreed) the
/// extensions' headers.
fn answer_meta(
    srv: &Core,
    flow: bool,
    replicas: bool,
) -> Result<tonic::metadata::MetadataMap, Status> {
    let mut meta = tonic::metadata::MetadataMap::new();
    let id = srv
        .server_id
        .parse()
        .map_err(|_| Status::internal("server ID"))?;
    meta.insert("serverid", id);
    meta.insert(
        "servercount",
        srv.server_count
            .load(std::sync::atomic::Ordering::Relaxed)
            .to_string()
            .parse()
            .map_err(|_| Status::internal("server count"))?,
    );
    let agreed = [
        (
            flow,
            crate::stream::flow::HEADER,
            crate::stream::flow::VERSION,
        ),
        (
            replicas,
            crate::wire::proto::REPLICAS_HEADER,
            crate::wire::proto::REPLICAS_VERSION,
        ),
    ];
    for (_, header, version) in agreed.into_iter().filter(|(on, ..)| *on) {
        let v = tonic::metadata::MetadataValue::from_static(version);
        meta.insert(header, v);
    }
    Ok(meta)
}

/// Why an agent stream ended; its label is the `agent_streams_total`
/// reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StreamEnd {
    /// The agent closed it.
    Closed,
    /// The transport failed (a reset, a protocol error).
    StreamError,
    /// More packets that move nothing than its budget (flood.rs).
    ControlFlood,
    /// The server queued more answers than the agent reads.
    ControlOverflow,
    /// The server is shutting down.
    ServerShutdown,
    /// Its cluster was removed.
    ClusterRemoved,
    /// It carried nothing more while the server drains.
    DrainedIdle,
    /// Its cluster was re-keyed away from the agent's credentials.
    Rekeyed,
}

impl StreamEnd {
    /// The metric label and log value.
    pub(crate) fn label(self) -> &'static str {
        match self {
            StreamEnd::Closed => "closed",
            StreamEnd::StreamError => "stream_error",
            StreamEnd::ControlFlood => "control_flood",
            StreamEnd::ControlOverflow => "control_overflow",
            StreamEnd::ServerShutdown => "server_shutdown",
            StreamEnd::ClusterRemoved => "cluster_removed",
            StreamEnd::DrainedIdle => "drained_idle",
            StreamEnd::Rekeyed => "rekeyed",
        }
    }
}

/// The receive loop of one stream: each packet goes to the link; it waits
/// on a connection only when that connection's queue is full (see
/// queue.rs and docs/TUNNEL.md, "Head-of-line"). It also drives the link's
/// timers ([`LinkDriver::next_timeout`]), waiting or not. Ends with the
/// stream, on shutdown, when the cluster is removed or re-keyed away from
/// the agent.
async fn receive<S, E>(
    srv: Arc<Core>,
    cluster: Arc<Cluster>,
    link: Arc<LinkDriver>,
    inbound: S,
    probe: bool,
) where
    S: Stream<Item = Result<Packet, E>> + Unpin,
    E: ReceiveError,
{
    let why = receive_loop(&srv, &cluster, &link, inbound).await;
    if why == StreamEnd::ControlFlood {
        let until = seedlink_net::clock::now_ms()
            + u64::try_from(crate::stream::flood::COOLDOWN.as_millis()).unwrap_or(u64::MAX);
        cluster
            .flood_until_ms
            .store(until, std::sync::atomic::Ordering::Release);
    }
    detach(&cluster, &link);
    cluster.metrics.agent(-1);
    if probe && why == StreamEnd::Closed {
        srv.metrics.agent_stream(&cluster.name, "duplicate");
        tracing::debug!(cluster = %cluster.name, agent = %link.agent_id, uid = link.uid, "duplicate agent stream closed");
    } else {
        let why = why.label();
        srv.metrics.agent_stream(&cluster.name, why);
        tracing::info!(cluster = %cluster.name, agent = %link.agent_id, uid = link.uid, why, "agent disconnected");
    }
}

/// Takes the stream's packets and drives the link's timers until the
/// stream ends; returns why (the `agent_streams_total` label).
async fn receive_loop<S, E>(
    srv: &Core,
    cluster: &Cluster,
    link: &LinkDriver,
    mut inbound: S,
) -> StreamEnd
where
    S: Stream<Item = Result<Packet, E>> + Unpin,
    E: ReceiveError,
{
    // One sleep across packets; set again when it fired, and after a wait
    // for room (which ran the timers itself).
    let timer = link.next_timeout();
    tokio::pin!(timer);
    let mut idle = crate::stream::flood::Budget::new(std::time::Instant::now());
    loop {
        // Each packet costs the task a unit of tokio's cooperative budget:
        // a stream whose packets are always ready (a flood, or a fast
        // bulk sender) gives the worker back to other tenants' tasks now
        // and then instead of keeping it for as long as the agent sends.
        tokio::task::consume_budget().await;
        let m = tokio::select! {
            m = inbound.next() => m,
            h = &mut timer => {
                if let Some(h) = h {
                    cluster.metrics.packet(h);
                }
                timer.set(link.next_timeout());
                continue;
            }
            why = stopped(srv, cluster, link) => return why,
        };
        let waited = match m {
            Some(Ok(p)) if moves_nothing(&p) && !idle.spend(std::time::Instant::now()) => {
                tracing::info!(agent = %link.agent_id, "agent stream cut: more packets that move nothing than its budget");
                Err(StreamEnd::ControlFlood)
            }
            Some(Ok(p)) => take_packet(srv, cluster, link, p, &mut idle).await,
            Some(Err(e)) if e.flood() => {
                tracing::info!(agent = %link.agent_id, error = %e, "agent stream cut: more frames that move nothing than its budget");
                Err(StreamEnd::ControlFlood)
            }
            Some(Err(e)) => {
                tracing::info!(agent = %link.agent_id, error = %e, "agent stream failed");
                Err(StreamEnd::StreamError)
            }
            None => Err(StreamEnd::Closed),
        };
        match waited {
            Ok(true) => timer.set(link.next_timeout()),
            Ok(false) => {}
            Err(why) => return why,
        }
    }
}

/// One packet from the agent. DATA for a full connection makes the stream
/// read nothing more until that connection's reader makes room, or stops
/// reading for the stall deadline (backpressure); `Ok(true)` when it
/// waited. `Err(why)` ends the stream.
async fn take_packet(
    srv: &Core,
    cluster: &Cluster,
    link: &LinkDriver,
    p: Packet,
    idle: &mut crate::stream::flood::Budget,
) -> Result<bool, StreamEnd> {
    let (h, blocked) = link.on_agent_packet(p);
    cluster.metrics.packet(h);
    if matches!(h, Handled::Unrecognized | Handled::Unexpected)
        && !idle.spend(std::time::Instant::now())
    {
        tracing::info!(agent = %link.agent_id, "agent stream cut: more packets for nothing it has than its budget");
        return Err(StreamEnd::ControlFlood);
    }
    if link.to_agent.overflowed() {
        // It made the server queue more answers than it reads: cut off,
        // this agent only.
        return Err(StreamEnd::ControlOverflow);
    }
    let Some(b) = blocked else { return Ok(false) };
    // Boxed: a wait for room is rare, and inline it would size every
    // idle stream's receive loop for it.
    Box::pin(async {
        tokio::select! {
            h = b.resume(link) => {
                if h != Handled::Ok {
                    cluster.metrics.packet(h);
                }
                Ok(true)
            }
            why = stopped(srv, cluster, link) => Err(why),
        }
    })
    .await
}

/// Why an agent stream's packets stopped coming.
pub(crate) trait ReceiveError: std::fmt::Display {
    /// The transport cut it for frames that move nothing (flood.rs).
    fn flood(&self) -> bool {
        false
    }
}

impl ReceiveError for Status {}

impl ReceiveError for native::WireError {
    fn flood(&self) -> bool {
        matches!(self, native::WireError::Flood)
    }
}

/// A packet that carries nothing by its kind alone: a DRAIN (an agent
/// sends one per stream), DATA without bytes, a packet without a payload.
/// Packets naming what the stream does not have are counted once handled.
fn moves_nothing(p: &Packet) -> bool {
    use crate::wire::proto::{PacketType as T, Payload};
    match (&p.payload, p.kind()) {
        (_, Some(T::Drain)) | (None, _) => true,
        (Some(Payload::Data(d)), _) => d.data.is_empty() && d.error.is_empty(),
        _ => false,
    }
}

/// Ends when the stream must: on shutdown, when the cluster is removed,
/// or when the link is kicked; says why.
async fn stopped(srv: &Core, cluster: &Cluster, link: &LinkDriver) -> StreamEnd {
    tokio::select! {
        () = srv.shutdown.cancelled() => StreamEnd::ServerShutdown,
        () = cluster.removed.cancelled() => StreamEnd::ClusterRemoved,
        () = link.kick.cancelled() => kicked(srv, link),
    }
}

/// Why a link was kicked: its queue overflowed, it carried nothing more
/// while the server drains, or its cluster was re-keyed away from it.
fn kicked(srv: &Core, link: &LinkDriver) -> StreamEnd {
    if link.to_agent.overflowed() {
        StreamEnd::ControlOverflow
    } else if srv.accepting.is_cancelled() {
        StreamEnd::DrainedIdle
    } else {
        StreamEnd::Rekeyed
    }
}

/// Counts a refused token and answers the agent: `UNAVAILABLE` when the
/// API server could not be asked (the agent retries with back-off), else
/// `UNAUTHENTICATED`.
fn token_refused(srv: &Core, cluster: &str, e: &crate::auth::token::TokenError) -> Status {
    if matches!(e, crate::auth::token::TokenError::Unavailable(_)) {
        srv.metrics
            .agent_stream(cluster, "token_review_unavailable");
        Status::unavailable("token could not be reviewed")
    } else {
        srv.metrics.agent_stream(cluster, "bad_token");
        Status::unauthenticated("token refused")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// DRAIN, DATA without bytes and a packet without a payload move
    /// nothing by their kind; DATA with bytes, a DIAL_RSP or a
    /// WINDOW_UPDATE may (they are counted once handled, if they named
    /// nothing the stream has).
    #[test]
    fn what_moves_nothing() {
        assert!(moves_nothing(&Packet::drain()));
        assert!(moves_nothing(&Packet::data(1, bytes::Bytes::new())));
        assert!(moves_nothing(&Packet::default()));
        assert!(!moves_nothing(&Packet::data(
            1,
            bytes::Bytes::from_static(b"x")
        )));
        assert!(!moves_nothing(&Packet::dial_cls(1)));
        assert!(!moves_nothing(&Packet::window_update(1, 10)));
    }
}

//! Who an agent stream belongs to and whether it may open: the cluster its
//! certificate or token names, its identity and identifiers, the limits of
//! its cluster, and the answer it gets. Nothing an agent says moves it to
//! another cluster.

use std::net::SocketAddr;
use std::sync::Arc;

use tonic::{Response, Status};

use super::activity::Activity;
use super::core::Core;
use super::{attach, Cluster, Identifiers, LinkDriver};
use crate::stream::flow::FairQueue;
use crate::transport::grpc::PacketStream;

/// A certificate decides the cluster at once (`Ok(None)` without one: the
/// token in the stream's metadata must); `Err` (counted) when it matches
/// no cluster or two.
pub(super) fn cluster_of_cert(
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

pub(super) type Certs = Vec<rustls::pki_types::CertificateDer<'static>>;

/// What the streams of one agent connection share: its certificate's
/// cluster and chain, its read stamp, its address.
#[derive(Clone)]
pub(super) struct AgentConn {
    pub(super) srv: Arc<Core>,
    pub(super) cert_cluster: Option<Arc<Cluster>>,
    pub(super) certs: Certs,
    pub(super) activity: Arc<Activity>,
    pub(super) peer: SocketAddr,
    pub(super) slots: Arc<ConnSlots>,
}

/// A stream let in: attached to its cluster.
pub(super) struct Admitted {
    pub(super) cluster: Arc<Cluster>,
    pub(super) link: Arc<LinkDriver>,
    pub(super) to_agent: Arc<FairQueue>,
    pub(super) probe: bool,
    pub(super) flow: bool,
    pub(super) replicas: bool,
}

/// Checks a stream's credentials and what it says (its metadata), and
/// attaches it to its cluster.
pub(super) async fn admit(
    conn: AgentConn,
    meta: &tonic::metadata::MetadataMap,
) -> Result<Admitted, Status> {
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

/// What a stream is told as it opens: where each replica is reached
/// (REPLICAS, when known and asked for: the agent dials the ones it does
/// not hold), and DRAIN if it was registered after the drain or a
/// hand-over began (its handshake or TokenReview was under way).
pub(super) fn opening_notices(srv: &Core, link: &LinkDriver) {
    if !srv.replica_addresses.load().is_empty() {
        link.replicas_notice(&srv.replicas_packet());
    }
    let moving = srv.agents_moving.load(std::sync::atomic::Ordering::Acquire);
    if srv.accepting.is_cancelled() || moving {
        link.drain_notice();
    }
}

/// The extensions a stream's metadata asks for: flow control, replica
/// updates.
pub(super) fn asked(meta: &tonic::metadata::MetadataMap) -> (bool, bool) {
    let asks = |h: &str, v: &str| meta.get(h).and_then(|x| x.to_str().ok()) == Some(v);
    (
        asks(crate::stream::flow::HEADER, crate::stream::flow::VERSION),
        asks(
            crate::wire::proto::REPLICAS_HEADER,
            crate::wire::proto::REPLICAS_VERSION,
        ),
    )
}

/// The stream's `authorization` (at most one).
pub(super) fn one_authorization(
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
pub(super) fn attach_stream(
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
    log_attached(cluster, &link, probe, flow);
    (link, to_agent, probe)
}

/// Logs a stream attached: a probe of an agent already connected at debug
/// level, a new agent at info.
fn log_attached(cluster: &Cluster, link: &LinkDriver, probe: bool, flow: bool) {
    let (name, agent, uid) = (&cluster.name, &link.agent_id, link.uid);
    if probe {
        tracing::debug!(cluster = %name, agent = %agent, uid, "agent stream (agent already connected)");
    } else {
        tracing::info!(cluster = %name, agent = %agent, uid, flow, "agent connected");
    }
}

/// The cluster of a stream: its certificate's, whose token (if the
/// cluster checks tokens) must be valid too; else the one whose issuer
/// accepts its token. Refused when the cluster has its agent streams.
pub(super) async fn stream_cluster(
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
pub(super) async fn credited_cluster(
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
pub(super) struct Identity {
    /// `agentid` (exactly one).
    pub(super) agent_id: String,
    /// `agentidentifiers` (at most one).
    pub(super) ids: Identifiers,
    /// It asks for per-connection flow control.
    pub(super) flow: bool,
    /// It asks to be told when the number of replicas changes.
    pub(super) replicas: bool,
}

/// The stream's one `agentid`: ASCII, 1 to [`MAX_AGENT_ID`] characters.
fn stream_agent_id<'m>(
    srv: &Core,
    cluster: &Cluster,
    meta: &'m tonic::metadata::MetadataMap,
) -> Result<&'m str, Status> {
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
    Ok(agent_id)
}

/// What a stream says about its agent: `agentid` (exactly one),
/// `agentidentifiers` (at most one), the seedlink extensions it asks for.
pub(super) fn stream_identity(
    srv: &Core,
    cluster: &Cluster,
    meta: &tonic::metadata::MetadataMap,
) -> Result<Identity, Status> {
    let agent_id = stream_agent_id(srv, cluster, meta)?;
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
pub(super) fn stream_identifiers(
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
pub(super) fn response(
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
pub(super) fn answer_meta(
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
    if replicas {
        seedlink_headers(srv, &mut meta);
    }
    Ok(meta)
}

/// What a seedlink agent (one that asked for REPLICAS) is told besides:
/// the PING interval towards agents, and the pod this server runs in.
fn seedlink_headers(srv: &Core, meta: &mut tonic::metadata::MetadataMap) {
    let ms = srv.agent_h2.keepalive.as_millis().to_string();
    if let Ok(v) = ms.parse() {
        meta.insert(crate::wire::proto::KEEPALIVE_HEADER, v);
    }
    if let Some(v) = srv.pod.as_deref().and_then(|p| p.parse().ok()) {
        meta.insert(crate::wire::proto::POD_HEADER, v);
    }
}

/// Counts a refused token and answers the agent: `UNAVAILABLE` when the
/// API server could not be asked (the agent retries with back-off), else
/// `UNAUTHENTICATED`.
pub(super) fn token_refused(
    srv: &Core,
    cluster: &str,
    e: &crate::auth::token::TokenError,
) -> Status {
    if matches!(e, crate::auth::token::TokenError::Unavailable(_)) {
        srv.metrics
            .agent_stream(cluster, "token_review_unavailable");
        Status::unavailable("token could not be reviewed")
    } else {
        srv.metrics.agent_stream(cluster, "bad_token");
        Status::unauthenticated("token refused")
    }
}

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
    let now = crate::stream::clock::now();
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

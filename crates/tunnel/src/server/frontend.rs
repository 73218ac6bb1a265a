//! Frontends for kube-apiserver's egress dialer, each bound to one cluster:
//! HTTP/1.1 CONNECT (over a Unix socket or TCP+mTLS) and gRPC
//! `ProxyService/Proxy` (one stream per tunneled connection).

use std::sync::Arc;

use bytes::BytesMut;
use futures_util::StreamExt;
use seedlink_proto::connect_head;
use seedlink_proto::Parse;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;
use tonic::{Response, Status};

pub(crate) use super::answer::{answer, answer_success, refuse};
pub use super::answer::{FrontendEnd, FrontendIo, Reply};
use super::core::Core;
use super::{dial, Cluster, DialError, Tunnel, TunnelTx};
use crate::stream::flow::{PumpEnd, QueueRx, Recv};
use crate::transport::grpc::{Handler, PacketStream};
use crate::wire::proto::{Packet, PacketType, Payload};

/// Bytes read from a frontend per DATA packet (upstream's size).
const CHUNK: usize = 32 * 1024;

/// Reads until `buf` holds a whole request head (within the head limits).
async fn head_of<S>(io: &mut S, buf: &mut BytesMut) -> Result<connect_head::Head, FrontendEnd>
where
    S: AsyncRead + Unpin,
{
    let limits = connect_head::Limits::default();
    loop {
        match connect_head::parse(buf, &limits) {
            Parse::Done(h) => return Ok(h),
            Parse::Invalid(r) => return Err(FrontendEnd::Malformed(r)),
            Parse::Incomplete => {}
        }
        if buf.len() >= limits.max_head_bytes {
            return Err(FrontendEnd::HeadTooLarge);
        }
        buf.reserve(1024);
        match io.read_buf(buf).await {
            Ok(0) | Err(_) => return Err(FrontendEnd::Closed),
            Ok(_) => {}
        }
    }
}

/// Reads a request head within the handshake deadline: the head and the
/// buffer it was read into (bytes after `head.len` already belong to what
/// follows), or an outcome label (a malformed head was answered 400).
async fn read_head<S>(srv: &Core, io: &mut S) -> Result<(connect_head::Head, BytesMut), FrontendEnd>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut buf = BytesMut::with_capacity(1024);
    let head = tokio::time::timeout(srv.settings.handshake_timeout, head_of(io, &mut buf)).await;
    match head {
        Ok(Ok(h)) => Ok((h, buf)),
        Ok(Err(FrontendEnd::Closed)) => Err(FrontendEnd::Closed),
        Ok(Err(why)) => {
            answer(io, 400, "malformed request\n").await;
            Err(why)
        }
        Err(_) => Err(FrontendEnd::HeadTimeout),
    }
}

/// Serves one HTTP CONNECT frontend connection; returns how it ended.
pub async fn serve_http_connect<S>(srv: &Core, cluster: &Cluster, mut io: S) -> FrontendEnd
where
    S: FrontendIo,
{
    let _open = srv.metrics.http_open();
    let (head, mut buf) = match read_head(srv, &mut io).await {
        Ok(h) => h,
        Err(why) => return why,
    };
    if !head.method.eq_ignore_ascii_case("CONNECT") {
        answer(&mut io, 405, "this proxy only supports CONNECT passthrough").await;
        return FrontendEnd::NotConnect;
    }
    connect_method(srv, cluster, io, &head.target, buf.split_off(head.len)).await
}

/// Answers a `CONNECT target` whose head was read: dial, 200, carry.
pub async fn connect_method<S>(
    srv: &Core,
    cluster: &Cluster,
    mut io: S,
    target: &str,
    leftover: BytesMut,
) -> FrontendEnd
where
    S: FrontendIo,
{
    if !seedlink_proto::connect_head::authority_form(target) {
        answer(&mut io, 400, "CONNECT target must be host:port\n").await;
        return FrontendEnd::BadTarget;
    }
    dial_and_carry(srv, cluster, io, target, leftover, Reply::Established).await
}

/// Dials `target` through the cluster's agents and carries the
/// connection; `leftover` is sent first; the frontend is answered as
/// `reply` says.
pub(crate) async fn dial_and_carry<S>(
    srv: &Core,
    cluster: &Cluster,
    mut io: S,
    target: &str,
    mut leftover: BytesMut,
    reply: Reply,
) -> FrontendEnd
where
    S: FrontendIo,
{
    let seed =
        super::seed::matching(&cluster.conf.load().seed, target).map(|(d, port)| (d.clone(), port));
    if let Some((d, port)) = seed {
        return super::seed::carry(srv, cluster, io, (&d, port), leftover, reply).await;
    }
    let Some(dialed) = dial_watching(srv, cluster, &mut io, target, &mut leftover).await else {
        return FrontendEnd::FrontendGone;
    };
    let tunnel = match dialed {
        Ok(t) => t,
        Err(e) => {
            refuse(&mut io, &e, reply).await;
            return FrontendEnd::Dial(e);
        }
    };
    // Bytes the frontend pipelined go to the agent before the answer goes
    // to the frontend: the answer's write wakes the frontend, which on a
    // busy host competes for the CPU the DATA's hop needs. An agent gone
    // by then is answered like one gone during the dial.
    if !leftover.is_empty() && tunnel.tx.send(leftover.freeze()).await.is_err() {
        let e = DialError::AgentGone;
        refuse(&mut io, &e, reply).await;
        return FrontendEnd::Dial(e);
    }
    if answer_success(&mut io, reply).await.is_err() {
        return FrontendEnd::WriteError;
    }
    cluster.metrics.established(1);
    let out = carry_stream(srv, &cluster.name, tunnel, io).await;
    cluster.metrics.established(-1);
    out
}

/// Dials `target`; while the agent dials, a frontend that hangs up
/// cancels the dial (kube-apiserver closes the connection when its context
/// ends): `None` then. Bytes it pipelines meanwhile are kept in `leftover`,
/// up to one chunk.
async fn dial_watching<S: FrontendIo>(
    srv: &Core,
    cluster: &Cluster,
    io: &mut S,
    target: &str,
    leftover: &mut BytesMut,
) -> Option<Result<Tunnel, DialError>> {
    let cancel = srv.shutdown.child_token();
    let dialing = dial(cluster, target, srv.dial_settings(), &cancel);
    tokio::pin!(dialing);
    let mut watching = true;
    let dialed = loop {
        tokio::select! {
            r = &mut dialing => break r,
            n = io.read_buf(leftover), if watching && leftover.len() < CHUNK => match n {
                Ok(0) | Err(_) => {
                    cancel.cancel();
                    watching = false;
                }
                Ok(_) => {}
            },
        }
    };
    watching.then_some(dialed)
}

/// Who chooses the cluster of a forward-proxy request.
pub enum ProxyCluster<'a> {
    /// The frontend belongs to this cluster.
    Fixed(&'a Arc<Cluster>),
    /// `Proxy-Authorization: Basic <cluster>:<password>` on every request.
    ByCredentials,
}

/// Hop-by-hop headers a forward proxy does not pass on (RFC 9110 §7.6.1),
/// and its own credentials.
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "proxy-connection",
    "keep-alive",
    "proxy-authorization",
    "proxy-authenticate",
    "te",
    "trailer",
    "upgrade",
];

/// The cluster of a forward-proxy request: the frontend's, or the one
/// its `Proxy-Authorization` names (407 if none).
async fn proxy_cluster<S: FrontendIo>(
    srv: &Core,
    choice: ProxyCluster<'_>,
    head: &connect_head::Head,
    io: &mut S,
) -> Result<Arc<Cluster>, FrontendEnd> {
    let credentials = match choice {
        ProxyCluster::Fixed(c) => return Ok(c.clone()),
        ProxyCluster::ByCredentials => head.values("proxy-authorization").next(),
    };
    if let Some(c) = srv.registry.cluster_for_proxy_credentials(credentials) {
        return Ok(c);
    }
    let msg = "HTTP/1.1 407 Proxy Authentication Required\r\nProxy-Authenticate: Basic realm=\"seedlink\"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
    let _ = tokio::time::timeout(std::time::Duration::from_secs(5), async {
        let _ = io.write_all(msg.as_bytes()).await;
        let _ = io.shutdown().await;
    })
    .await;
    Err(FrontendEnd::ProxyAuthRequired)
}

/// Serves one HTTP forward-proxy connection (Prometheus `proxy_url`):
/// `CONNECT host:port` as on the CONNECT frontend, or one absolute-form
/// request (`GET http://host:port/path HTTP/1.1`) forwarded in origin form
/// with `Connection: close`, the answer passed back as it comes. One
/// request per connection: the connection ends with the answer. Returns
/// the cluster's name ("" if none was chosen) and the outcome label.
pub async fn serve_http_proxy<S>(
    srv: &Core,
    choice: ProxyCluster<'_>,
    mut io: S,
) -> (String, FrontendEnd)
where
    S: FrontendIo,
{
    let _open = srv.metrics.http_open();
    let (head, mut buf) = match read_head(srv, &mut io).await {
        Ok(h) => h,
        Err(why) => return (String::new(), why),
    };
    let cluster = match proxy_cluster(srv, choice, &head, &mut io).await {
        Ok(c) => c,
        Err(why) => return (String::new(), why),
    };
    let leftover = buf.split_off(head.len);
    let out = if head.method.eq_ignore_ascii_case("CONNECT") {
        connect_method(srv, &cluster, io, &head.target, leftover).await
    } else {
        forward(srv, &cluster, io, &head, leftover).await
    };
    (cluster.name.to_string(), out)
}

/// A forward-proxy request in absolute form (`GET http://…`): sent on in
/// origin form, with the bytes after its head, through a new tunnel.
async fn forward<S: FrontendIo>(
    srv: &Core,
    cluster: &Cluster,
    mut io: S,
    head: &connect_head::Head,
    leftover: BytesMut,
) -> FrontendEnd {
    let Some((target, request)) = origin_form(head) else {
        answer(
            &mut io,
            400,
            "a forward proxy takes CONNECT or an absolute http:// URL\n",
        )
        .await;
        return FrontendEnd::BadTarget;
    };
    let mut first = BytesMut::from(request.as_bytes());
    first.extend_from_slice(&leftover);
    dial_and_carry(srv, cluster, io, &target, first, Reply::Forwarded).await
}

/// `host:port`, an IPv6 host in brackets.
fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// For an absolute-form request: `host:port` to dial and the request head
/// rewritten for the destination (origin form, hop-by-hop headers dropped,
/// `Host` kept or added, `Connection: close`).
fn origin_form(head: &connect_head::Head) -> Option<(String, String)> {
    let uri: http::Uri = head.target.parse().ok()?;
    if uri.scheme_str() != Some("http") {
        return None;
    }
    let auth = uri.authority()?;
    let target = host_port(auth.host(), auth.port_u16().unwrap_or(80));
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    let mut out = format!("{} {path} HTTP/1.{}\r\n", head.method, head.minor_version);
    let mut has_host = false;
    for (k, v) in &head.headers {
        let lower = k.to_ascii_lowercase();
        if HOP_BY_HOP.contains(&lower.as_str()) {
            continue;
        }
        has_host |= lower == "host";
        out.push_str(&format!("{k}: {v}\r\n"));
    }
    if !has_host {
        out.push_str(&format!("Host: {}\r\n", auth.as_str()));
    }
    out.push_str("Connection: close\r\n\r\n");
    Some((target, out))
}

/// Copies between a frontend stream and its tunnel until either ends.
/// A connection cut short (agent gone, aborted, stalled) is reset where
/// the transport can (see [`FrontendIo::reset_on_close`]) and counted in
/// `frontend_aborts_total` by how the client was told.
async fn carry_stream<S>(srv: &Core, cluster: &str, tunnel: Tunnel, io: S) -> FrontendEnd
where
    S: FrontendIo,
{
    let Tunnel { tx, mut rx } = tunnel;
    let (mut rd, mut wr) = tokio::io::split(io);
    let stall = srv.settings.stall_timeout;
    let up = upload(&mut rd, &tx);
    let down = download(&mut rx, &mut wr, &tx, stall);
    let outcome = both_ways(up, down, &tx, stall).await;
    if matches!(
        outcome,
        FrontendEnd::Aborted | FrontendEnd::AgentGone | FrontendEnd::Stalled
    ) {
        let io = rd.unsplit(wr);
        let signal = if io.reset_on_close() { "reset" } else { "eof" };
        srv.metrics.frontend_abort(cluster, signal);
    }
    outcome
}

/// Carries both directions until one ends. The frontend's EOF ends the
/// connection (Konnectivity has no half-close): CLOSE_REQ now; what the
/// agent already sent is still delivered, within the stall deadline.
async fn both_ways(
    up: impl std::future::Future<Output = FrontendEnd>,
    down: impl std::future::Future<Output = FrontendEnd>,
    tx: &TunnelTx,
    stall: std::time::Duration,
) -> FrontendEnd {
    tokio::pin!(up, down);
    tokio::select! {
        u = &mut up => {
            tx.close();
            let rest = tokio::time::timeout(stall, &mut down)
                .await
                .unwrap_or(FrontendEnd::Stalled);
            if u == FrontendEnd::Ok { rest } else { u }
        }
        d = &mut down => d,
    }
}

/// Frontend to agent: what the frontend sends, until its EOF (bytes it
/// pipelined before the answer went ahead, in `dial_and_carry`).
async fn upload<R: AsyncRead + Unpin>(rd: &mut R, tx: &TunnelTx) -> FrontendEnd {
    // Small reads until the frontend sends in bulk: an idle connection
    // then holds 2 KiB instead of a full chunk.
    let mut cap = 2048;
    loop {
        let mut b = BytesMut::with_capacity(cap);
        match rd.read_buf(&mut b).await {
            Ok(0) => return FrontendEnd::Ok,
            Ok(n) => {
                cap = if n == cap { CHUNK } else { 2048.max(n) };
                if tx.send(b.freeze()).await.is_err() {
                    return FrontendEnd::AgentGone;
                }
            }
            Err(_) => return FrontendEnd::ReadError,
        }
    }
}

/// Agent to frontend: the connection's queue, returning window to the
/// agent as it is written. With flow control a slow frontend only holds its
/// own connection back; without, it has `stall` to make progress.
async fn download<W: AsyncWrite + Unpin>(
    rx: &mut QueueRx,
    wr: &mut W,
    tx: &TunnelTx,
    stall: std::time::Duration,
) -> FrontendEnd {
    let mut unacked = crate::stream::flow::Unacked::default();
    let deadline = (!tx.link.flow).then_some(stall);
    match rx
        .pump(wr, deadline, |n| tx.consumed(&mut unacked, n))
        .await
    {
        PumpEnd::Finished => {
            let _ = wr.shutdown().await;
            FrontendEnd::Ok
        }
        PumpEnd::Aborted => FrontendEnd::Aborted,
        PumpEnd::Stalled => FrontendEnd::Stalled,
        PumpEnd::WriteError => FrontendEnd::WriteError,
    }
}

/// The gRPC `ProxyService/Proxy` handler of one cluster.
pub fn grpc_handler(srv: Arc<Core>, cluster: Arc<Cluster>, frontend: Arc<str>) -> Handler {
    Arc::new(move |req: tonic::Request<tonic::Streaming<Packet>>| {
        let (srv, cluster, frontend) = (srv.clone(), cluster.clone(), frontend.clone());
        Box::pin(async move {
            let (out_tx, out_rx) = mpsc::channel::<Result<Packet, Status>>(16);
            let inbound = req.into_inner();
            tokio::spawn(async move {
                let outcome = grpc_session(&srv, &cluster, inbound, out_tx).await;
                srv.metrics
                    .frontend_conn(&cluster.name, &frontend, outcome.reason());
            });
            let out: PacketStream =
                Box::pin(futures_util::stream::unfold(out_rx, |mut rx| async move {
                    rx.recv().await.map(|p| (p, rx))
                }));
            Ok(Response::new(out))
        })
    })
}

async fn grpc_session(
    srv: &Core,
    cluster: &Cluster,
    mut inbound: tonic::Streaming<Packet>,
    out: mpsc::Sender<Result<Packet, Status>>,
) -> FrontendEnd {
    let _open = srv.metrics.grpc_open("Proxy");
    let req = match first_dial(srv, &mut inbound, &out).await {
        Ok(req) => req,
        Err(end) => return end,
    };
    // The frontend's dial ID is echoed to it; the agent gets a fresh one.
    let dialed = grpc_dial(srv, cluster, &req.address, &mut inbound).await;
    let mut tunnel = match dialed {
        Ok(t) => t,
        Err(e) => {
            let _ = out
                .send(Ok(Packet::dial_rsp(req.random, 0, e.to_string())))
                .await;
            return FrontendEnd::Dial(e);
        }
    };
    let cid = tunnel.tx.connect_id;
    if out
        .send(Ok(Packet::dial_rsp(req.random, cid, String::new())))
        .await
        .is_err()
    {
        return FrontendEnd::Closed;
    }
    cluster.metrics.established(1);
    let outcome = grpc_carry(&mut tunnel, &mut inbound, &out, cid).await;
    cluster.metrics.established(-1);
    outcome
}

/// The gRPC frontend's first packet, a DIAL_REQ for `tcp` within the
/// handshake deadline; what ended the session if not.
async fn first_dial(
    srv: &Core,
    inbound: &mut tonic::Streaming<Packet>,
    out: &mpsc::Sender<Result<Packet, Status>>,
) -> Result<crate::wire::proto::DialRequest, FrontendEnd> {
    let first = match tokio::time::timeout(srv.settings.handshake_timeout, inbound.next()).await {
        Ok(Some(Ok(p))) => p,
        Ok(_) => return Err(FrontendEnd::Closed),
        Err(_) => return Err(FrontendEnd::HeadTimeout),
    };
    let (Some(PacketType::DialReq), Some(Payload::DialRequest(req))) =
        (first.kind(), first.payload)
    else {
        let refused = Status::invalid_argument("the first packet must be DIAL_REQ");
        let _ = out.send(Err(refused)).await;
        return Err(FrontendEnd::BadFirstPacket);
    };
    if req.protocol != "tcp" {
        let text = format!("protocol {:?} is not supported", req.protocol);
        let _ = out.send(Ok(Packet::dial_rsp(req.random, 0, text))).await;
        return Err(FrontendEnd::BadProtocol);
    }
    Ok(req)
}

/// Dials `address`; a DIAL_CLS from the frontend, or its end, cancels the
/// dial.
async fn grpc_dial(
    srv: &Core,
    cluster: &Cluster,
    address: &str,
    inbound: &mut tonic::Streaming<Packet>,
) -> Result<Tunnel, DialError> {
    if super::seed::matching(&cluster.conf.load().seed, address).is_some() {
        let e = DialError::Seed(format!(
            "{address} is in the seed: it is served on http-connect frontends, not grpc"
        ));
        cluster.metrics.dial_failure(e.reason());
        return Err(e);
    }
    let cancel = srv.shutdown.child_token();
    let dialing = dial(cluster, address, srv.dial_settings(), &cancel);
    tokio::pin!(dialing);
    loop {
        tokio::select! {
            r = &mut dialing => return r,
            m = inbound.next() => match m {
                Some(Ok(p)) if p.kind() == Some(PacketType::DialCls) => cancel.cancel(),
                Some(Ok(_)) => {}
                _ => cancel.cancel(),
            },
        }
    }
}

async fn grpc_carry(
    tunnel: &mut Tunnel,
    inbound: &mut tonic::Streaming<Packet>,
    out: &mpsc::Sender<Result<Packet, Status>>,
    cid: i64,
) -> FrontendEnd {
    let mut unacked = crate::stream::flow::Unacked::default();
    loop {
        let end = tokio::select! {
            m = inbound.next() => match m {
                Some(Ok(p)) => from_grpc_frontend(tunnel, p, out, cid).await,
                _ => Some(FrontendEnd::FrontendGone),
            },
            r = tunnel.rx.recv() => to_grpc_frontend(tunnel, r, out, cid, &mut unacked).await,
        };
        if let Some(end) = end {
            return end;
        }
    }
}

/// One packet from the gRPC frontend for connection `cid`; what ended the
/// connection, if it did.
async fn from_grpc_frontend(
    tunnel: &Tunnel,
    p: Packet,
    out: &mpsc::Sender<Result<Packet, Status>>,
    cid: i64,
) -> Option<FrontendEnd> {
    match (p.kind(), p.payload) {
        (Some(PacketType::Data), Some(Payload::Data(d))) if d.connect_id == cid => {
            // konnectivity-client sends each write unchunked: split into
            // window-sized pieces (no copy).
            let mut data = d.data;
            while !data.is_empty() {
                let part = data.split_to(data.len().min(CHUNK));
                if tunnel.tx.send(part).await.is_err() {
                    let rsp = Packet::close_rsp(cid, "backend connection closed".into());
                    let _ = out.send(Ok(rsp)).await;
                    return Some(FrontendEnd::AgentGone);
                }
            }
            None
        }
        (Some(PacketType::CloseReq), _) => {
            let _ = out.send(Ok(Packet::close_rsp(cid, String::new()))).await;
            Some(FrontendEnd::Ok)
        }
        // A DATA for another connection ends this one (as upstream).
        (Some(PacketType::Data), _) => Some(FrontendEnd::WrongConnectId),
        _ => None,
    }
}

/// What the agent sent on connection `cid`, to the gRPC frontend; what
/// ended the connection, if it did.
async fn to_grpc_frontend(
    tunnel: &Tunnel,
    r: Recv,
    out: &mpsc::Sender<Result<Packet, Status>>,
    cid: i64,
    unacked: &mut crate::stream::flow::Unacked,
) -> Option<FrontendEnd> {
    let (text, end) = match r {
        Recv::Data(b) => {
            let n = b.len();
            if out.send(Ok(Packet::data(cid, b))).await.is_err() {
                return Some(FrontendEnd::FrontendGone);
            }
            tunnel.tx.consumed(unacked, n);
            return None;
        }
        Recv::Finished => (String::new(), FrontendEnd::Ok),
        Recv::Aborted => ("connection aborted".to_string(), FrontendEnd::Aborted),
    };
    let _ = out.send(Ok(Packet::close_rsp(cid, text))).await;
    Some(end)
}

/// The carry path with scripted IO: the frontend is one end of an
/// in-memory pipe, the agent a link attached by hand whose packets the
/// test reads and answers, so what reaches the agent and in which order
/// against the frontend's answer is checked without sockets or a clock.
#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::sync::Arc;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::{serve_http_connect, FrontendEnd};
    use crate::server::run::TunnelServer;
    use crate::server::testing::TIMERS;
    use crate::server::*;
    use crate::stream::flow::FairQueue;
    use crate::wire::proto::{Packet, PacketType as T, Payload};

    /// An in-memory pipe ends like a Unix socket: no reset.
    impl super::FrontendIo for tokio::io::DuplexStream {}

    /// A server with one cluster `a` (nothing bound) and an agent link
    /// attached to it by hand.
    fn server_and_agent() -> (
        Arc<TunnelServer>,
        Arc<Cluster>,
        Arc<LinkDriver>,
        Arc<FairQueue>,
        tempfile::TempDir,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let w = |name: &str, pem: String| {
            let p = dir.path().join(name);
            std::fs::write(&p, pem).unwrap();
            p.display().to_string()
        };
        let key = rcgen::KeyPair::generate().unwrap();
        let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca = w("ca.pem", ca.self_signed(&key).unwrap().pem());
        let leaf = rcgen::generate_simple_self_signed(vec!["tunnel".to_string()]).unwrap();
        let (crt, leaf_key) = (
            w("srv.pem", leaf.cert.pem()),
            w("srv-key.pem", leaf.signing_key.serialize_pem()),
        );
        let text = format!(
            "agents: {{listen: '127.0.0.1:0', cert: '{crt}', key: '{leaf_key}'}}\nclusters:\n  - {{name: a, agent_ca: '{ca}'}}\n"
        );
        let srv =
            TunnelServer::from_config(&crate::config::ServerConfig::parse(&text).unwrap()).unwrap();
        let c = srv.registry.cluster("a").unwrap();
        let (link, to_agent) = attach(&c, "agent".into(), Identifiers::default(), false, TIMERS);
        (srv, c, link, to_agent, dir)
    }

    /// The next packet the agent gets (the frontend task runs meanwhile).
    async fn next_packet(to_agent: &FairQueue) -> Packet {
        loop {
            if let Some(p) = to_agent.try_next() {
                return p;
            }
            tokio::task::yield_now().await;
        }
    }

    /// Bytes kube-apiserver pipelines after its CONNECT head reach the
    /// agent before the `200` is written: the pipe to kube-apiserver holds
    /// 8 bytes and nobody reads it yet, so an answer written first would
    /// still be waiting for room, with the DATA not sent.
    #[tokio::test]
    async fn pipelined_bytes_go_to_the_agent_before_the_200() {
        let (srv, c, link, to_agent, _dir) = server_and_agent();
        let (mut client, io) = tokio::io::duplex(8);
        let serving = tokio::spawn({
            let (srv, c) = (srv.clone(), c.clone());
            async move { serve_http_connect(&srv, &c, io).await }
        });
        client
            .write_all(b"CONNECT 10.0.0.1:443 HTTP/1.1\r\nHost: 10.0.0.1:443\r\n\r\npipelined")
            .await
            .unwrap();
        let req = next_packet(&to_agent).await;
        let Some(Payload::DialRequest(d)) = req.payload else {
            panic!("not a dial request: {req:?}");
        };
        assert_eq!(d.address, "10.0.0.1:443");
        // While the agent dials, the frontend reads what was pipelined.
        for _ in 0..64 {
            tokio::task::yield_now().await;
        }
        link.on_agent_packet(Packet::dial_rsp(d.random, 7, String::new()));
        // The frontend runs until its answer fills the pipe.
        for _ in 0..64 {
            tokio::task::yield_now().await;
        }
        let mut answer = Vec::new();
        let data = to_agent
            .try_next()
            .expect("the DATA is queued before the answer is written");
        assert_eq!(data.kind(), Some(T::Data));
        let Some(Payload::Data(d)) = data.payload else {
            panic!("not DATA: {data:?}");
        };
        assert_eq!((d.connect_id, &d.data[..]), (7, &b"pipelined"[..]));
        while !answer.ends_with(b"\r\n\r\n") {
            let mut b = [0u8; 1];
            assert_eq!(client.read(&mut b).await.unwrap(), 1, "{answer:?}");
            answer.push(b[0]);
        }
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer:?}");
        serving.abort();
    }

    /// A frontend that hangs up while the agent dials cancels the dial:
    /// the agent gets DIAL_CLS for it, and nothing is counted open.
    #[tokio::test]
    async fn a_frontend_that_hangs_up_mid_dial_cancels_it() {
        let (srv, c, link, to_agent, _dir) = server_and_agent();
        let (mut client, io) = tokio::io::duplex(64 * 1024);
        let serving = tokio::spawn({
            let (srv, c) = (srv.clone(), c.clone());
            async move { serve_http_connect(&srv, &c, io).await }
        });
        client
            .write_all(b"CONNECT 10.0.0.1:443 HTTP/1.1\r\n\r\n")
            .await
            .unwrap();
        let req = next_packet(&to_agent).await;
        assert_eq!(req.kind(), Some(T::DialReq));
        drop(client);
        let cls = next_packet(&to_agent).await;
        assert_eq!(cls.kind(), Some(T::DialCls));
        assert_eq!(serving.await.unwrap(), FrontendEnd::FrontendGone);
        assert_eq!(link.conn_count(), 0);
    }
}

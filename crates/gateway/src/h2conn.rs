//! HTTP/2 CONNECT (h2c with prior knowledge), Kubermatic's tunnelling
//! strategy: many tunnels multiplexed on one connection, each a stream whose
//! `:authority` (`<service>.<namespace>.svc.cluster.local:<port>`) or
//! destination header names a configured destination. h2's flow control
//! backpressures each tunnel on its own.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use h2::server::SendResponse;
use h2::RecvStream;
use http::{Method, Request, Response, StatusCode};
use seedlink_config::Snapshot;
use seedlink_net::h2copy;
use seedlink_net::prefixed::Prefixed;
use seedlink_proto::destination;
use tokio::net::TcpStream;

use crate::state::{Gateway, ListenerCtx, SourceGuard};
use crate::upstream;

/// Concurrent streams per connection.
const MAX_STREAMS: u32 = 250;
/// How long a connection may stay without an open stream once it has
/// carried one (before the first, the detection deadline applies): a
/// pooled connection between tunnels, but not forever.
const IDLE_AFTER_STREAMS: Duration = Duration::from_secs(60);
/// Largest header list a stream may send (Envoy's default, 60 KiB).
const MAX_HEADER_LIST: u32 = 60 * 1024;
/// Streams a client may reset while their dial is under way (the
/// rapid-reset pattern past h2's own accept-queue limit) within
/// [`RESET_WINDOW`]; one more closes the connection (GOAWAY
/// `ENHANCE_YOUR_CALM`).
const MAX_EARLY_RESETS: u32 = 100;
const RESET_WINDOW: Duration = Duration::from_secs(10);

/// How an HTTP/2 connection ended; `reason()` is the `outcome` label of
/// `connections_total` (its streams are counted on their own).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum H2End {
    /// The client closed it.
    Ok,
    /// No valid HTTP/2 handshake.
    HandshakeError,
    /// No handshake within the detection deadline.
    Timeout,
    /// More early resets than allowed (GOAWAY `ENHANCE_YOUR_CALM`).
    ResetFlood,
    /// A GOAWAY or reset from the client's side.
    ProtocolError,
    /// Another connection error.
    Error,
    /// Idle again, and its source holds every unrouted slot.
    PerSourceLimit,
    /// No stream within the idle deadline.
    Idle,
    /// A PING went unanswered.
    PingTimeout,
    /// The drain deadline passed.
    ClosedDrain,
}

impl H2End {
    pub(crate) fn reason(self) -> &'static str {
        match self {
            H2End::Ok => "ok",
            H2End::HandshakeError => "h2_handshake_error",
            H2End::Timeout => "timeout",
            H2End::ResetFlood => "h2_reset_flood",
            H2End::ProtocolError => "h2_protocol_error",
            H2End::Error => "h2_error",
            H2End::PerSourceLimit => "per_source_limit",
            H2End::Idle => "h2_idle",
            H2End::PingTimeout => "h2_ping_timeout",
            H2End::ClosedDrain => "closed_drain",
        }
    }
}

/// Serves one HTTP/2 connection whose first `prefix` bytes were already
/// read. Without an open stream the connection is unrouted: it holds a
/// per-source slot (`guard`, given back while streams are open and taken
/// again when the last one ends; none left closes it) and is closed at an
/// idle deadline: the detection deadline before its first stream,
/// [`IDLE_AFTER_STREAMS`] after.
pub(crate) async fn serve(
    gw: Arc<Gateway>,
    lctx: Arc<ListenerCtx>,
    snap: Arc<Snapshot>,
    stream: TcpStream,
    client: SocketAddr,
    prefix: Vec<u8>,
    guard: Option<SourceGuard<'_>>,
) -> H2End {
    let mut unrouted = Unrouted {
        capped: guard.is_some(),
        guard,
        deadline: Some(tokio::time::Instant::now() + snap.timeouts.client_hello),
    };
    let mut conn = match handshake(&snap, stream, prefix).await {
        Ok(c) => c,
        Err(end) => return end,
    };
    let keepalive = h2copy::keepalive(conn.ping_pong());
    tokio::pin!(keepalive);
    let mut streams = Streams::new();
    let outcome = loop {
        tokio::select! {
            next = conn.accept() => {
                let Some(Ok((req, respond))) = next else {
                    break ended(next.and_then(Result::err), client);
                };
                if streams.opened() {
                    unrouted.routed();
                }
                if streams.flooded(tokio::time::Instant::now()) {
                    conn.abrupt_shutdown(h2::Reason::ENHANCE_YOUR_CALM);
                    break H2End::ResetFlood;
                }
                streams.spawn(&gw, &lctx, client, req, respond);
            }
            () = streams.went_idle.notified() => {
                if streams.none_open() {
                    if let Err(end) = unrouted.again(&gw, &snap, client) {
                        break end;
                    }
                }
            }
            () = unrouted.expired() => break H2End::Idle,
            () = &mut keepalive => break H2End::PingTimeout,
            () = gw.lifecycle.close_all.cancelled() => break H2End::ClosedDrain,
        }
    };
    streams.tasks.close();
    if outcome == H2End::ResetFlood {
        // Let the GOAWAY out, bounded.
        let _ = tokio::time::timeout(
            Duration::from_secs(1),
            std::future::poll_fn(|cx| conn.poll_closed(cx)),
        )
        .await;
    }
    outcome
}

/// How a connection ended that accepts no more streams: cleanly, or with
/// an error (a GOAWAY or reset from the client is a protocol error).
fn ended(error: Option<h2::Error>, client: SocketAddr) -> H2End {
    match error {
        None => H2End::Ok,
        Some(e) => {
            tracing::debug!(%client, error = %e, "h2 connection error");
            if e.is_go_away() || e.is_reset() {
                H2End::ProtocolError
            } else {
                H2End::Error
            }
        }
    }
}

type Connection = h2::server::Connection<Prefixed<TcpStream>, Bytes>;

/// The HTTP/2 handshake, within the detection deadline.
async fn handshake(
    snap: &Snapshot,
    stream: TcpStream,
    prefix: Vec<u8>,
) -> Result<Connection, H2End> {
    let io = Prefixed::new(prefix, stream);
    match tokio::time::timeout(
        snap.timeouts.client_hello,
        builder().handshake::<_, Bytes>(io),
    )
    .await
    {
        Ok(Ok(c)) => Ok(c),
        Ok(Err(_)) => Err(H2End::HandshakeError),
        Err(_) => Err(H2End::Timeout),
    }
}

/// What a connection without an open stream holds: its per-source slot
/// (when `capped`) and its idle deadline.
struct Unrouted<'g> {
    capped: bool,
    guard: Option<SourceGuard<'g>>,
    deadline: Option<tokio::time::Instant>,
}

impl<'g> Unrouted<'g> {
    /// A stream opened: the slot is given back and no deadline runs.
    fn routed(&mut self) {
        drop(self.guard.take());
        self.deadline = None;
    }

    /// The last stream ended: the slot is taken again (none left ends the
    /// connection) and [`IDLE_AFTER_STREAMS`] runs.
    fn again(&mut self, gw: &'g Gateway, snap: &Snapshot, client: SocketAddr) -> Result<(), H2End> {
        if self.capped {
            match gw
                .sources
                .enter(client.ip(), snap.limits.max_unrouted_per_source)
            {
                Some(g) => drop(self.guard.replace(g)),
                None => return Err(H2End::PerSourceLimit),
            }
        }
        self.deadline = Some(tokio::time::Instant::now() + IDLE_AFTER_STREAMS);
        Ok(())
    }

    /// Ends when the idle deadline passes; never while streams are open.
    async fn expired(&self) {
        match self.deadline {
            Some(d) => tokio::time::sleep_until(d).await,
            None => std::future::pending().await,
        }
    }
}

/// The streams of one connection: how many are open, a wake-up when the
/// last one ends, and the streams the client reset while their dial was
/// under way, counted per [`RESET_WINDOW`].
struct Streams {
    tasks: tokio_util::task::TaskTracker,
    active: Arc<std::sync::atomic::AtomicUsize>,
    went_idle: Arc<tokio::sync::Notify>,
    early_resets: Arc<std::sync::atomic::AtomicU32>,
    window_start: tokio::time::Instant,
}

impl Streams {
    fn new() -> Streams {
        Streams {
            tasks: tokio_util::task::TaskTracker::new(),
            active: Arc::default(),
            went_idle: Arc::default(),
            early_resets: Arc::default(),
            window_start: tokio::time::Instant::now(),
        }
    }

    /// Counts a new stream; true when it is the only one open (the
    /// connection stops being idle).
    fn opened(&self) -> bool {
        self.active
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel)
            == 0
    }

    fn none_open(&self) -> bool {
        self.active.load(std::sync::atomic::Ordering::Acquire) == 0
    }

    /// Whether the client reset more than [`MAX_EARLY_RESETS`] streams
    /// early in the window running at `now`. Counted per window, so a
    /// long-lived pooled connection that now and then cancels a dial is
    /// never cut.
    fn flooded(&mut self, now: tokio::time::Instant) -> bool {
        if now.saturating_duration_since(self.window_start) > RESET_WINDOW {
            self.window_start = now;
            self.early_resets
                .store(0, std::sync::atomic::Ordering::Relaxed);
        }
        self.early_resets.load(std::sync::atomic::Ordering::Relaxed) > MAX_EARLY_RESETS
    }

    /// Carries the stream in its own task.
    fn spawn(
        &self,
        gw: &Arc<Gateway>,
        lctx: &Arc<ListenerCtx>,
        client: SocketAddr,
        req: Request<RecvStream>,
        respond: SendResponse<Bytes>,
    ) {
        let (gw, lctx) = (gw.clone(), lctx.clone());
        let (active, went_idle, early_resets) = (
            self.active.clone(),
            self.went_idle.clone(),
            self.early_resets.clone(),
        );
        self.tasks.spawn(async move {
            if tunnel(&gw, &lctx, client, req, respond).await {
                early_resets.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            if active.fetch_sub(1, std::sync::atomic::Ordering::AcqRel) == 1 {
                went_idle.notify_one();
            }
        });
    }
}

/// The HTTP/2 server's settings: stream and window sizes, the rapid-reset
/// and error-flood limits, Envoy's header-list limit (h2's own is 16 MiB).
fn builder() -> h2::server::Builder {
    let mut builder = h2::server::Builder::new();
    builder
        .max_concurrent_streams(MAX_STREAMS)
        .initial_window_size(1024 * 1024)
        .initial_connection_window_size(16 * 1024 * 1024)
        .max_send_buffer_size(256 * 1024)
        .max_frame_size(h2copy::MAX_FRAME)
        .max_pending_accept_reset_streams(20)
        .max_local_error_reset_streams(Some(256))
        .max_header_list_size(MAX_HEADER_LIST);
    builder
}

/// Refuses a stream with `status`, counted under `reason` like a refused
/// connection.
fn refuse(
    gw: &Gateway,
    lctx: &ListenerCtx,
    respond: &mut SendResponse<Bytes>,
    status: StatusCode,
    reason: &'static str,
) {
    lctx.metrics.detect_failure(&gw.metrics, reason);
    let mut r = Response::new(());
    *r.status_mut() = status;
    let _ = respond.send_response(r, true);
}

/// The canonical destination a stream names, after the listener's guard:
/// the destination header if present, else `:authority` as
/// `outbound|<port>||<host>`. The guard (`destination_regex`) sees the
/// header's value, or the name built from `:authority`, exactly as HTTP/1
/// CONNECT's guard sees its header.
fn destination_of(lctx: &ListenerCtx, req: &Request<RecvStream>) -> Result<String, &'static str> {
    let header = lctx.spec.destination_header.as_str();
    if req.headers().get_all(header).iter().count() > 1 {
        return Err("connect_destination_duplicated");
    }
    let named = match req.headers().get(header) {
        Some(v) => v
            .to_str()
            .map_err(|_| "connect_destination_malformed")?
            .to_string(),
        None => {
            let a = req.uri().authority().ok_or("connect_destination_missing")?;
            named_by_authority(a)?
        }
    };
    if lctx
        .spec
        .destination_regex
        .as_ref()
        .is_some_and(|re| !re.is_match(&named))
    {
        return Err("connect_destination_malformed");
    }
    destination::parse(&named)
        .map(|d| d.canonical())
        .map_err(|_| "connect_destination_malformed")
}

/// `outbound|<port>||<host>` from a CONNECT's `:authority`, which is host
/// and port (RFC 9113 §8.5): no port, an empty one or 0 is refused, never
/// guessed.
fn named_by_authority(a: &http::uri::Authority) -> Result<String, &'static str> {
    let port = a
        .port_u16()
        .filter(|p| *p != 0)
        .ok_or("connect_destination_malformed")?;
    Ok(format!("outbound|{port}||{}", a.host()))
}

/// Waits until the client resets the stream.
async fn reset_by_client(respond: &mut SendResponse<Bytes>) {
    let _ = std::future::poll_fn(|cx| respond.poll_reset(cx)).await;
}

/// One CONNECT stream, with the same guards as an HTTP/1 CONNECT, decided
/// on the snapshot current when the stream opened: the destination guard,
/// the route, the ACL, the connection budget (a stream with an upstream
/// socket takes a `max_connections` slot of its own). A stream the client
/// resets while its dial is under way stops the dial; `true` when that
/// happened.
async fn tunnel(
    gw: &Gateway,
    lctx: &ListenerCtx,
    client: SocketAddr,
    req: Request<RecvStream>,
    mut respond: SendResponse<Bytes>,
) -> bool {
    let snap = gw.snapshot();
    let (route, _held) = match admit_stream(gw, lctx, &snap, client, &req) {
        Ok(admitted) => admitted,
        Err(Refusal(status, Some(reason))) => {
            refuse(gw, lctx, &mut respond, status, reason);
            return false;
        }
        Err(Refusal(status, None)) => {
            answer_only(&mut respond, status);
            return false;
        }
    };
    let cp = &route.control_plane;
    let (upstream, _guard) = match dial(gw, &snap, route, &mut respond).await {
        Ok(dialed) => dialed,
        Err(reset) => return reset,
    };
    let Ok(send) = respond.send_response(Response::new(()), false) else {
        return false;
    };
    let _routed = lctx.metrics.routed(&gw.metrics, &cp.name, "http2-connect");
    let recv = req.into_body();
    let closer = gw.closer_for(&cp.name);
    tokio::select! {
        _ = async { tokio::join!(h2copy::stream_to_socket(recv, &upstream), h2copy::socket_to_stream(&upstream, send)) } => {}
        () = closer.cancelled() => {}
        () = gw.lifecycle.close_all.cancelled() => {}
    }
    false
}

/// Dials the route's upstream while watching the stream: a failed dial is
/// answered 503 (`Err(false)`); a stream the client resets meanwhile stops
/// the dial (`Err(true)`).
async fn dial(
    gw: &Gateway,
    snap: &Snapshot,
    route: &seedlink_config::routes::DestinationRoute,
    respond: &mut SendResponse<Bytes>,
) -> Result<(TcpStream, upstream::ActiveGuard), bool> {
    let dial = upstream::connect(
        &route.control_plane.name,
        &route.endpoints,
        &snap.upstream,
        snap.timeouts.upstream_connect,
        crate::state::keepalive(snap),
        &gw.metrics,
    );
    tokio::select! {
        r = dial => match r {
            Ok((s, guard, _)) => Ok((s, guard)),
            Err(_) => {
                answer_only(respond, StatusCode::SERVICE_UNAVAILABLE);
                Err(false)
            }
        },
        () = reset_by_client(respond) => Err(true),
    }
}

/// Why a stream is refused before it is carried: the answer's status and
/// the reason counted (none where the ACL check counted it already).
struct Refusal(StatusCode, Option<&'static str>);

/// The slots a carried stream holds, given back when it ends.
struct Held<'g> {
    _permit: tokio::sync::OwnedSemaphorePermit,
    _control_plane: crate::state::RoutedGuard<'g>,
    _source: Option<SourceGuard<'g>>,
}

/// A CONNECT stream's route, after its method, destination, the control
/// plane's ACL and every limit.
fn admit_stream<'g, 's>(
    gw: &'g Gateway,
    lctx: &ListenerCtx,
    snap: &'s Snapshot,
    client: SocketAddr,
    req: &Request<RecvStream>,
) -> Result<(&'s seedlink_config::routes::DestinationRoute, Held<'g>), Refusal> {
    let unavailable = |reason| Refusal(StatusCode::SERVICE_UNAVAILABLE, Some(reason));
    if req.method() != Method::CONNECT {
        return Err(Refusal(
            StatusCode::METHOD_NOT_ALLOWED,
            Some("connect_not_connect"),
        ));
    }
    let canonical = destination_of(lctx, req)
        .map_err(|reason| Refusal(StatusCode::BAD_REQUEST, Some(reason)))?;
    // A stream cannot be handed to an in-process service: answered like an
    // unknown destination.
    let route = snap
        .routes
        .destination(&canonical)
        .filter(|r| !r.endpoints.iter().any(|e| e.address.starts_with("local:")))
        .ok_or(unavailable("unknown_destination"))?;
    let cp = &route.control_plane;
    if !gw.admit(snap, cp, client) {
        // As an unknown destination: nothing to enumerate.
        return Err(Refusal(StatusCode::SERVICE_UNAVAILABLE, None));
    }
    let permit = gw
        .permits
        .clone()
        .try_acquire_owned()
        .map_err(|_| unavailable("max_connections"))?;
    let control_plane = gw
        .enter_control_plane(snap, &cp.name)
        .ok_or(unavailable("control_plane_limit"))?;
    let source = gw
        .enter_routed_source(snap, client.ip())
        .map_err(|()| unavailable("source_limit"))?;
    let held = Held {
        _permit: permit,
        _control_plane: control_plane,
        _source: source,
    };
    Ok((route, held))
}

/// Answers a stream with `status` and ends it.
fn answer_only(respond: &mut SendResponse<Bytes>, status: StatusCode) {
    let mut r = Response::new(());
    *r.status_mut() = status;
    let _ = respond.send_response(r, true);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_authority_needs_its_port() {
        let named = |a: &str| named_by_authority(&a.parse().unwrap());
        assert_eq!(named("api.x:6443").unwrap(), "outbound|6443||api.x");
        for bad in ["api.x", "api.x:", "api.x:0"] {
            assert_eq!(named(bad), Err("connect_destination_malformed"), "{bad}");
        }
        assert!(
            "api.x:99999".parse::<http::uri::Authority>().is_err() || named("api.x:99999").is_err()
        );
    }

    #[tokio::test]
    async fn early_resets_are_counted_per_window() {
        let mut s = Streams::new();
        let t0 = s.window_start;
        let resets = |s: &Streams, n| {
            s.early_resets
                .store(n, std::sync::atomic::Ordering::Relaxed)
        };
        resets(&s, MAX_EARLY_RESETS);
        assert!(!s.flooded(t0), "at the limit is not over it");
        resets(&s, MAX_EARLY_RESETS + 1);
        assert!(
            s.flooded(t0 + RESET_WINDOW),
            "the window's last instant still counts"
        );
        // A new window starts the count again.
        assert!(!s.flooded(t0 + RESET_WINDOW + Duration::from_millis(1)));
        assert_eq!(s.window_start, t0 + RESET_WINDOW + Duration::from_millis(1));
    }
}

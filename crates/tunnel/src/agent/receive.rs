//! Serving one agent stream: its receive loop (the other half of its
//! driver, `link_driver`) feeds the server's packets to the link machine,
//! starts the dials it asks for, waits for room and counts how the stream
//! ended; each dial checks the destination policy ([`DEFAULT_DENY`] and the
//! allow rules), connects within its deadline and registers the
//! connection's ends with the link. The server's side of the loop is in
//! `server::endpoint`.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use futures_util::StreamExt;
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

use super::core::*;
use super::link::{self, Expired};
use super::link_driver::*;
use super::metrics::{AgentMetrics, ConnEnd, ServerConnect};
use crate::stream::flow::{self, SendCredit};
use crate::wire::dial_error;

/// The replicas a REPLICAS packet names with their addresses (none for
/// any other packet); taken only if the link machine takes the packet.
fn told_replicas(p: &crate::wire::proto::Packet) -> Vec<crate::wire::proto::Replica> {
    match &p.payload {
        Some(crate::wire::proto::Payload::Replicas(r)) => r.replicas.clone(),
        _ => Vec::new(),
    }
}

impl Agent {
    pub(super) async fn serve_link(self: &Arc<Self>, s: Arc<LinkDriver>, mut inbound: Inbound) {
        loop {
            let p = tokio::select! {
                () = s.cut.cancelled() => return,
                m = inbound.next() => match m {
                    Some(Ok(p)) => p,
                    Some(Err(e)) => {
                        tracing::info!(error = %e, "server stream failed");
                        return;
                    }
                    None => return,
                },
                () = self.shutdown.cancelled() => return,
            };
            let told = told_replicas(&p);
            let (h, applied) = s.with(|m, out| m.on_packet(p, out));
            self.handled(&s, h, applied.bad_window, told);
            self.start_dials(&s, applied.dials);
            if let Some((id, data, room)) = applied.blocked {
                // Backpressure (the standard protocol has no per-connection
                // flow control): read nothing more from this server until
                // the destination makes room, as long as it keeps taking
                // bytes.
                if !self.wait_for_room(&s, id, data, room).await {
                    return;
                }
            }
        }
    }

    /// Starts the dials the server asked for, each its own task.
    fn start_dials(self: &Arc<Self>, s: &Arc<LinkDriver>, dials: Vec<Dial>) {
        for (random, address, protocol, cancel) in dials {
            let (agent, s) = (self.clone(), s.clone());
            tokio::spawn(async move { agent.dial(s, address, protocol, random, cancel).await });
        }
    }

    /// A stream ended or drained: a flap if it had not lasted [`STABLE`],
    /// else the streak is over.
    pub(super) fn count_flap(&self, s: &LinkDriver) {
        if s.since.elapsed() < STABLE {
            self.flaps.fetch_add(1, Ordering::AcqRel);
        } else {
            self.flaps.store(0, Ordering::Release);
        }
    }

    /// What a packet from the server meant beyond its actions: DRAIN
    /// (look for a replica to replace it), REPLICAS, counters for bad
    /// packets and windows.
    pub(super) fn handled(
        &self,
        s: &LinkDriver,
        h: link::Handled,
        bad_window: bool,
        told: Vec<crate::wire::proto::Replica>,
    ) {
        if h == link::Handled::ServerDraining {
            self.start_draining(s, ServerConnect::ServerDraining);
        }
        if let link::Handled::Replicas(n) = h {
            self.replicas_changed(&s.server_id, n, told);
        }
        if let Some(label) = h.bad_label() {
            AgentMetrics::count(&self.metrics.bad_packets, label);
        }
        if bad_window {
            AgentMetrics::count(&self.metrics.bad_packets, "bad_window");
        }
    }

    /// Marks stream `s` draining (`why`: the server said DRAIN, or the
    /// certificate changed) and looks for a replacement at once; over
    /// [`MAX_DRAINING`] draining streams, it is ended. `false` if it was
    /// draining already.
    pub(super) fn start_draining(&self, s: &LinkDriver, why: ServerConnect) -> bool {
        if s.draining.swap(true, Ordering::AcqRel) {
            return false;
        }
        tracing::info!(server_id = %s.server_id, why = why.label(), "stream drains: looking for a replacement");
        self.metrics.server_connect(why);
        // A new certificate says nothing of the stream's health.
        if why != ServerConnect::CertificateChanged {
            self.count_flap(s);
        }
        let n = self.draining_streams.fetch_add(1, Ordering::AcqRel) + 1;
        if n > MAX_DRAINING {
            tracing::warn!(server_id = %s.server_id, "more draining streams than {MAX_DRAINING}: this one is ended");
            self.metrics.server_connect(ServerConnect::TooManyDraining);
            s.cut.cancel();
        }
        self.session_lost.notify_one();
        true
    }

    /// Waits until connection `id`'s bytes fit its queue, then queues them,
    /// while its destination keeps taking bytes; the session machine's
    /// stall deadline ends the wait (resetting the connection). `false` on
    /// shutdown.
    pub(super) async fn wait_for_room(
        &self,
        s: &LinkDriver,
        id: i64,
        data: bytes::Bytes,
        room: flow::Room,
    ) -> bool {
        loop {
            let due = seedlink_net::sync::lock(&s.state, "agent session")
                .machine
                .poll_timeout();
            let step = tokio::select! {
                step = room.step(data.len()) => step,
                () = sleep_until(due) => {
                    if self.stall_expired(s) {
                        return true;
                    }
                    continue;
                }
                () = self.shutdown.cancelled() => return false,
            };
            if s.room_step(id, step, &data) {
                return true;
            }
        }
    }

    /// The machine's timer fired during a wait for room: `true` when the
    /// stall deadline passed (the connection was reset and counted).
    fn stall_expired(&self, s: &LinkDriver) -> bool {
        let now = crate::stream::clock::now();
        match s.with(|m, out| m.handle_timeout(now, out)).0 {
            Expired::Nothing => false,
            Expired::Stalled { reset } => {
                if reset {
                    self.metrics.endpoint_closed(ConnEnd::Stalled);
                }
                true
            }
        }
    }
}

/// Destinations denied unless an allow rule names them exactly: the agent's
/// own host (loopback, `0.0.0.0/8` and `::`, which Linux connects to
/// loopback), link-local (cloud metadata lives there) and well-known
/// metadata addresses. A dial request comes from the seed; nothing from
/// there should reach services bound to the agent's loopback.
pub const DEFAULT_DENY: &[&str] = &[
    "127.0.0.0/8",
    "0.0.0.0/8",
    "::1/128",
    "::/128",
    "169.254.0.0/16",
    "fe80::/10",
    "100.100.100.200/32",
    "fd00:ec2::254/128",
];

/// An IPv4-mapped IPv6 address as the IPv4 address it is.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    }
}

impl Agent {
    /// Whether the policy lets the agent connect to `addr`.
    pub fn allowed(&self, addr: &SocketAddr) -> bool {
        let ip = canonical(addr.ip());
        if self.denied(ip) {
            return false;
        }
        (self.opts.allow.is_empty() || self.opts.allow.iter().any(|n| n.contains(&ip)))
            && (self.opts.allow_ports.is_empty() || self.opts.allow_ports.contains(&addr.port()))
    }

    /// Whether the deny list names `ip` (and no allow rule names exactly it).
    fn denied(&self, ip: IpAddr) -> bool {
        self.opts.deny.iter().any(|n| n.contains(&ip))
            && !self
                .opts
                .allow
                .iter()
                .any(|n| n.prefix_len() == n.max_prefix_len() && n.contains(&ip))
    }

    /// Whether `address` (`host:port`) is an IP address the deny list
    /// names: a replica there is not dialled (a name is not resolved here).
    pub(super) fn denied_host(&self, address: &str) -> bool {
        let host = address.rsplit_once(':').map_or(address, |(h, _)| h);
        let host = host.trim_start_matches('[').trim_end_matches(']');
        host.parse::<IpAddr>()
            .is_ok_and(|ip| self.denied(canonical(ip)))
    }

    pub(super) async fn dial(
        self: Arc<Self>,
        s: Arc<LinkDriver>,
        address: String,
        protocol: String,
        random: i64,
        cancel: CancellationToken,
    ) {
        let Some(stream) = self.reach(&s, &address, &protocol, random, &cancel).await else {
            return;
        };
        let (ends, qrx) = self.conn_ends(s.flow);
        let (cancel, credit) = (ends.cancel.clone(), ends.credit.clone());
        let Some(id) = s.with(|m, out| m.connected(random, ends, out)).0 else {
            // Cancelled meanwhile, or the stream ended: the socket closes.
            AgentMetrics::count(&self.metrics.dials, "cancelled");
            return;
        };
        AgentMetrics::count(&self.metrics.dials, "ok");
        self.metrics.endpoints.inc();
        let (rd, wr) = stream.into_split();
        let outcome = tokio::select! {
            o = upload(rd, &s, id, credit.as_ref()) => o,
            o = download(qrx, wr, &s, id, self.opts.stall_timeout) => o,
            () = cancel.cancelled() => if s.gone.is_cancelled() { ConnEnd::ServerGone } else { ConnEnd::CloseReq },
        };
        // Closed from this side: the server is told (unsolicited CLOSE_RSP)
        // unless its CLOSE_REQ closed it.
        s.with(|m, out| m.closed(id, out));
        if let Some(c) = credit {
            c.close();
        }
        self.metrics.endpoints.dec();
        self.metrics.endpoint_closed(outcome);
    }

    /// Connects to the destination within the dial timeout (a deadline on
    /// this task's own lookup and connect, so it stays here: the failure's
    /// text and label come from how that IO ended). A failure is counted
    /// and answered to the server; `None` then, or when the server
    /// cancelled the dial or the stream ended.
    pub(super) async fn reach(
        &self,
        s: &LinkDriver,
        address: &str,
        protocol: &str,
        random: i64,
        cancel: &CancellationToken,
    ) -> Option<TcpStream> {
        let outcome = tokio::select! {
            r = tokio::time::timeout(self.opts.dial_timeout, self.open(address, protocol)) => match r {
                Ok(r) => r,
                Err(_) => Err(dial_error::DialFailure::timeout(address)),
            },
            () = cancel.cancelled() => {
                AgentMetrics::count(&self.metrics.dials, "cancelled");
                return None;
            }
            () = s.gone.cancelled() => return None,
        };
        match outcome {
            Ok(stream) => Some(stream),
            Err(failure) => {
                AgentMetrics::count(&self.metrics.dials, failure.label());
                s.with(|m, out| m.dial_failed(random, failure.text, out));
                None
            }
        }
    }

    /// A new connection's ends and its destination's queue; with flow
    /// control (`flow`) the server never has more than a window in flight.
    pub(super) fn conn_ends(&self, flow: bool) -> (ConnEnds, flow::QueueRx) {
        let budget = if flow {
            2 * flow::WINDOW
        } else {
            self.opts.queue_bytes
        };
        let (queue, qrx) = flow::queue(budget);
        let ends = ConnEnds {
            queue,
            cancel: CancellationToken::new(),
            credit: flow.then(SendCredit::new),
        };
        (ends, qrx)
    }

    /// Resolves (within policy) and connects.
    pub(super) async fn open(
        &self,
        address: &str,
        protocol: &str,
    ) -> Result<TcpStream, dial_error::DialFailure> {
        use dial_error::DialFailure;
        if protocol != "tcp" {
            return Err(DialFailure::other(format!(
                "protocol {protocol:?} is not supported"
            )));
        }
        let allowed: Vec<SocketAddr> = tokio::net::lookup_host(address)
            .await
            .map_err(|e| DialFailure::other(format!("dial tcp {address}: lookup: {e}")))?
            .filter(|a| self.allowed(a))
            .collect();
        if allowed.is_empty() {
            return Err(DialFailure::forbidden(address));
        }
        super::eyeballs::connect_any(address, allowed).await
    }
}

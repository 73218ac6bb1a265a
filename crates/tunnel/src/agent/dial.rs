//! Dialing what the server asks for: the destination policy
//! ([`DEFAULT_DENY`] and the allow rules), the connect with its deadline, and
//! the connection's ends registered with the link.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

use super::core::Agent;
use super::link_driver::{download, upload, ConnEnds, LinkDriver};
use super::metrics::AgentMetrics;
use crate::stream::flow::{self, SendCredit};
use crate::stream::queue::{self};
use crate::wire::dial_error;

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

impl Agent {
    /// Whether the policy lets the agent connect to `addr`.
    pub fn allowed(&self, addr: &SocketAddr) -> bool {
        let ip = match addr.ip() {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
            v4 => v4,
        };
        if self.opts.deny.iter().any(|n| n.contains(&ip))
            && !self
                .opts
                .allow
                .iter()
                .any(|n| n.prefix_len() == n.max_prefix_len() && n.contains(&ip))
        {
            return false;
        }
        (self.opts.allow.is_empty() || self.opts.allow.iter().any(|n| n.contains(&ip)))
            && (self.opts.allow_ports.is_empty() || self.opts.allow_ports.contains(&addr.port()))
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
            () = cancel.cancelled() => if s.gone.is_cancelled() { "server_gone" } else { "close_req" },
        };
        // Closed from this side: the server is told (unsolicited CLOSE_RSP)
        // unless its CLOSE_REQ closed it.
        s.with(|m, out| m.closed(id, out));
        if let Some(c) = credit {
            c.close();
        }
        self.metrics.endpoints.dec();
        AgentMetrics::count(&self.metrics.endpoint_closes, outcome);
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
    pub(super) fn conn_ends(&self, flow: bool) -> (ConnEnds, queue::QueueRx) {
        let budget = if flow {
            2 * flow::WINDOW
        } else {
            self.opts.queue_bytes
        };
        let (queue, qrx) = queue::queue(budget);
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
        connect_any(address, allowed).await
    }
}

/// Connects to the first of `addrs` that answers; the last failure if none
/// does.
async fn connect_any(
    address: &str,
    addrs: Vec<SocketAddr>,
) -> Result<TcpStream, dial_error::DialFailure> {
    let mut last = dial_error::DialFailure::other(format!("dial tcp {address}: no address"));
    for a in addrs {
        match TcpStream::connect(a).await {
            Ok(s) => {
                let _ = s.set_nodelay(true);
                return Ok(s);
            }
            Err(e) => last = dial_error::DialFailure::io(address, &e),
        }
    }
    Err(last)
}

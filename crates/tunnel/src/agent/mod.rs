//! `seedlink tunnel-agent`: dials out to the tunnel-server (TLS with SNI and
//! optional ALPN, so it can pass through seedlink's SNI gateway), keeps one
//! `AgentService/Connect` stream per server replica, and opens the
//! connections the server asks for, within a destination policy.
//!
//! Its parts, named as on the server:
//! - `core`: the [`Agent`] and its options, what every part shares;
//! - `mod.rs`: the agent's lifecycle (finding and holding one stream per
//!   replica, backing off, draining);
//! - `connect`: one connection to one replica, over gRPC or the native
//!   transport, and why it failed ([`ConnectError`]);
//! - `link`: the sans-IO machine of one stream ([`link::LinkMachine`]);
//!   `link_driver`: its driver; `receive`: the stream's receive loop, the
//!   destination policy and the dials the server asks for;
//! - `config` (flags or file), `metrics`, `harness` (drives the machine for
//!   tests and the fuzzer).
//!
//! Each part uses only `core` and the parts below it; nothing uses this
//! file but the crate root.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_rustls::TlsConnector;
use tokio_util::sync::CancellationToken;

use crate::auth::tls;
use crate::stream::flow::FairQueue;
use crate::transport::grpc::H2Settings;
use crate::wire::proto::Packet;

pub mod config;
mod connect;
mod core;
mod eyeballs;
#[cfg(any(test, feature = "harness"))]
pub mod harness;
pub mod link;
mod link_driver;
mod metrics;
mod receive;

pub use self::core::{flap_delay, retry_delay, Agent, AgentOptions};
use self::core::{Target, HELD_RECHECK, IDENTITY_CHECK, IDLE_BEFORE_CLOSE, KEEPALIVE_CAP};
pub use connect::ConnectError;
use connect::{answer, drain_duplicate, Answer, CloseOnDrop};
use link_driver::LinkDriver;
pub use metrics::{AgentMetrics, ConnEnd, Outcome, ServerConnect};
pub use receive::DEFAULT_DENY;

impl Agent {
    /// Builds the agent (reads the TLS files).
    pub fn new(opts: AgentOptions) -> Result<Arc<Agent>, crate::auth::tls::TlsError> {
        let mut alpn = Vec::new();
        if opts.native && opts.flow_control {
            alpn.push(crate::transport::native::ALPN.to_string());
        }
        alpn.push("h2".to_string());
        alpn.extend(opts.alpn.iter().cloned());
        let identity = opts
            .identity
            .as_ref()
            .map(|(c, k)| tls::ReloadingIdentity::load(c, k, tls::provider()))
            .transpose()?
            .map(Arc::new);
        // Offering the native transport, TLS runs in this process
        // (usertls.rs), which speaks TLS 1.3 only.
        let versions = if opts.native && opts.flow_control {
            tls::Versions::UserTls13
        } else {
            tls::Versions::Default
        };
        let cfg = Arc::new(tls::client_config_with(
            &opts.ca,
            identity.clone(),
            &alpn,
            versions,
        )?);
        let opts_keepalive = opts.keepalive.keepalive;
        Ok(Arc::new(Agent {
            opts,
            metrics: AgentMetrics::new(),
            user_tls: (versions == tls::Versions::UserTls13).then(|| cfg.clone()),
            tls: TlsConnector::from(cfg),
            sessions: Mutex::new(HashMap::new()),
            replica_addresses: Mutex::new(Vec::new()),
            next_target: std::sync::atomic::AtomicUsize::new(0),
            known_count: AtomicI64::new(1),
            draining: AtomicBool::new(false),
            keepalive_ms: std::sync::atomic::AtomicU64::new(
                u64::try_from(opts_keepalive.as_millis()).unwrap_or(u64::MAX),
            ),
            session_lost: tokio::sync::Notify::new(),
            replicas_told: tokio::sync::Notify::new(),
            flaps: std::sync::atomic::AtomicU32::new(0),
            draining_streams: std::sync::atomic::AtomicUsize::new(0),
            identity,
            shutdown: CancellationToken::new(),
        }))
    }

    /// Streams open to server replicas.
    pub fn session_count(&self) -> usize {
        seedlink_net::sync::lock(&self.sessions, "agent sessions").len()
    }

    /// Streams to replicas that are not draining (what discovery counts).
    fn held_count(&self) -> usize {
        seedlink_net::sync::lock(&self.sessions, "agent sessions")
            .values()
            .filter(|s| !s.draining.load(Ordering::Acquire))
            .count()
    }

    /// Ready: a stream to every replica the servers say there are
    /// (`servercount`), none of them draining, and not draining itself.
    pub fn ready(&self) -> bool {
        !self.draining.load(Ordering::Acquire)
            && self.session_count() > 0
            && i64::try_from(self.held_count()).unwrap_or(i64::MAX) >= self.known_count()
    }

    /// The replicas the last answer said there are (`servercount`, at
    /// least 1).
    pub fn known_count(&self) -> i64 {
        self.known_count.load(Ordering::Acquire).max(1)
    }

    /// Streams to replicas that are not draining.
    pub fn held(&self) -> usize {
        self.held_count()
    }

    /// Keeps a stream to every server replica until shut down: connects,
    /// learns `serverid`/`servercount`, and keeps dialing (the address is
    /// usually a LoadBalancer) to find missing replicas. Failures back off
    /// exponentially (×1.5, capped) with ±10 % jitter. Once a stream to
    /// every replica is held, discovery pauses (a re-check every 5 min)
    /// until one of them ends.
    pub async fn run(self: &Arc<Self>) {
        if let Some(id) = self.identity.clone() {
            tokio::spawn(self.clone().watch_identity(id));
        }
        let mut delay = self.opts.sync_interval;
        loop {
            if self.draining.load(Ordering::Acquire) {
                self.shutdown.cancelled().await;
                return;
            }
            // Streams that did not last: wait before the next, whatever
            // woke us.
            let pause = flap_delay(
                self.flaps.load(Ordering::Acquire),
                self.opts.sync_interval,
                self.opts.sync_interval_cap,
            );
            if !pause.is_zero() && !self.pause(pause, false, false).await {
                return;
            }
            let (wait, next, ok) = self.attempt(delay).await;
            delay = next;
            if !self.pause(wait, true, ok).await {
                return;
            }
        }
    }

    /// Sleeps `d` give or take 10 %, ended early by a lost stream when
    /// `wake_on_loss`, and cut to a random part of `--sync-interval` by a
    /// server's word of more replicas (REPLICAS) when `wake_on_told` (not
    /// in a back-off after a failed attempt: a server that sends REPLICAS
    /// without end cannot make the agent dial faster than that); `false`
    /// once the agent shuts down.
    async fn pause(&self, d: Duration, wake_on_loss: bool, wake_on_told: bool) -> bool {
        let jitter = 0.9 + rand::random::<f64>() * 0.2;
        let told = async {
            if wake_on_told {
                self.replicas_told.notified().await;
                let part = 0.1 + rand::random::<f64>() * 0.9;
                tokio::time::sleep(self.opts.sync_interval.mul_f64(part).min(d)).await;
            } else {
                std::future::pending::<()>().await;
            }
        };
        let lost = async {
            if wake_on_loss {
                self.session_lost.notified().await;
            } else {
                std::future::pending::<()>().await;
            }
        };
        tokio::select! {
            () = tokio::time::sleep(d.mul_f64(jitter)) => true,
            () = lost => true,
            () = told => true,
            () = self.shutdown.cancelled() => false,
        }
    }

    /// One connection attempt, counted; the wait before the next, the
    /// back-off after that (`delay`: the back-off now), and whether it
    /// succeeded.
    async fn attempt(self: &Arc<Self>, delay: Duration) -> (Duration, Duration, bool) {
        let target = self.target();
        match self.connect_once(&target).await {
            Ok(new) => {
                let outcome = if new {
                    ServerConnect::Ok
                } else {
                    ServerConnect::Duplicate
                };
                self.metrics.server_connect(outcome);
                (self.discovery_wait(), self.opts.sync_interval, true)
            }
            Err(e) => {
                tracing::warn!(server = %target.address, reason = e.reason(), error = %e, "cannot connect to the tunnel server");
                self.metrics.server_connect(ServerConnect::Error);
                AgentMetrics::count(&self.metrics.connect_errors, e.reason());
                let (wait, next) = retry_delay(
                    delay,
                    e.timed_out(),
                    self.opts.sync_interval,
                    self.opts.sync_interval_cap,
                );
                (wait, next, false)
            }
        }
    }

    /// A server told us the number of replicas changed, and where each is
    /// reached (`told`: empty when it does not say): one we do not hold
    /// yet is looked for at once.
    fn replicas_changed(
        &self,
        server_id: &str,
        count: i64,
        told: Vec<crate::wire::proto::Replica>,
    ) {
        // A packet without addresses leaves the last ones (a server that
        // does not know them says nothing of them).
        if self.opts.replica_addresses && !told.is_empty() {
            self.take_addresses(server_id, told);
        }
        let was = self.known_count.swap(count, Ordering::AcqRel);
        if was != count {
            tracing::info!(
                server_id,
                was,
                now = count,
                "the tunnel server replicas changed"
            );
        }
        if i64::try_from(self.held_count()).unwrap_or(i64::MAX) < count {
            self.replicas_told.notify_one();
        }
    }

    /// Keeps where the servers say each replica is (what can be dialled of
    /// it; the rest counted).
    fn take_addresses(&self, server_id: &str, told: Vec<crate::wire::proto::Replica>) {
        let (mut usable, mut bad) = usable_replicas(told);
        // Never where the destination policy denies (the agent's own host,
        // link-local, cloud metadata), unless allowed by exact address.
        let before = usable.len();
        usable.retain(|r| !self.denied_host(&r.address));
        bad += u64::try_from(before - usable.len()).unwrap_or(0);
        if bad > 0 {
            tracing::warn!(
                server_id,
                bad,
                "replica addresses that cannot be dialled: ignored"
            );
            self.metrics.bad_packets_add("bad_replica_address", bad);
        }
        *seedlink_net::sync::lock(&self.replica_addresses, "replica addresses") = usable;
    }

    /// Where the next attempt goes: in turn, each replica the servers said
    /// where to reach that no stream is held to, then `--server` (so a
    /// stale address never keeps the agent from its load balancer).
    fn target(&self) -> Target {
        let fallback = Target {
            address: self.opts.server.clone(),
            server_name: self.opts.server_name.clone(),
        };
        let held: std::collections::HashSet<String> =
            seedlink_net::sync::lock(&self.sessions, "agent sessions")
                .values()
                .filter(|s| !s.draining.load(Ordering::Acquire))
                .filter_map(|s| s.pod.clone())
                .collect();
        let missing: Vec<Target> =
            seedlink_net::sync::lock(&self.replica_addresses, "replica addresses")
                .iter()
                .filter(|r| !held.contains(&r.pod))
                .map(|r| Target {
                    address: r.address.clone(),
                    server_name: match r.server_name.as_str() {
                        "" => self.opts.server_name.clone(),
                        n => n.to_string(),
                    },
                })
                .collect();
        let turn = self.next_target.fetch_add(1, Ordering::AcqRel) % (missing.len() + 1);
        missing.into_iter().nth(turn).unwrap_or(fallback)
    }

    /// How long to wait before the next discovery dial after a success.
    fn discovery_wait(&self) -> Duration {
        let have = i64::try_from(self.held_count()).unwrap_or(i64::MAX);
        if have >= self.known_count.load(Ordering::Acquire) {
            HELD_RECHECK.max(self.opts.sync_interval_cap)
        } else {
            self.opts.sync_interval
        }
    }

    /// The PING interval for the next connection.
    fn keepalive(&self) -> H2Settings {
        let ms = self.keepalive_ms.load(Ordering::Acquire);
        H2Settings {
            keepalive: Duration::from_millis(ms),
            ..self.opts.keepalive
        }
    }

    /// A server said `too_many_pings`: ping half as often from now on.
    fn slow_down_pings(&self, server_id: &str) {
        let cap = u64::try_from(KEEPALIVE_CAP.as_millis()).unwrap_or(u64::MAX);
        let old = self.keepalive_ms.load(Ordering::Acquire);
        let new = old.saturating_mul(2).min(cap);
        self.keepalive_ms.store(new, Ordering::Release);
        self.metrics.server_connect(ServerConnect::TooManyPings);
        tracing::warn!(
            server_id,
            keepalive_ms = new,
            "server refused our ping rate (GOAWAY too_many_pings): PING interval doubled"
        );
    }

    async fn connect_once(self: &Arc<Self>, target: &Target) -> Result<bool, ConnectError> {
        let t = self.opts.dial_timeout.max(Duration::from_secs(5));
        let chan = self.open_channel(t, target).await?;
        let meta = self.request_metadata()?;
        let tx = FairQueue::new();
        // Until the stream is kept, any early return must end it: a queue
        // that is never closed would keep the request stream open forever.
        let mut guard = CloseOnDrop(Some(tx.clone()));
        let (answer, inbound, goaway) = self.open_stream(chan, &tx, &meta, t).await?;
        let (session, count) = self.session(&answer, tx)?;
        if !self.keep(&session) {
            // A replica we already hold: end our side cleanly and let the
            // server end its side, so neither counts an error.
            drop(guard);
            drain_duplicate(inbound).await;
            return Ok(false);
        }
        guard.0 = None;
        self.metrics.servers.inc();
        let (server_id, flow) = (&session.server_id, session.flow);
        tracing::info!(
            server_id,
            servercount = count,
            flow,
            address = %target.address,
            "connected to tunnel server"
        );
        self.spawn_link(session, inbound, goaway);
        Ok(true)
    }

    /// Serves a kept stream in its own task until it ends.
    fn spawn_link(
        self: &Arc<Self>,
        session: Arc<LinkDriver>,
        inbound: link_driver::Inbound,
        goaway: Option<crate::transport::goaway::Seen>,
    ) {
        let agent = self.clone();
        tokio::spawn(async move {
            agent.serve_link(session.clone(), inbound).await;
            agent.link_ended(&session, goaway.and_then(|g| g.code()));
        });
    }

    /// The session a server's answer describes (`serverid`, the extensions
    /// it agreed to) over queue `tx`, and the replica count it gave (taken
    /// as the one known now).
    fn session(
        &self,
        meta: &tonic::metadata::MetadataMap,
        tx: Arc<FairQueue>,
    ) -> Result<(Arc<LinkDriver>, i64), ConnectError> {
        let Answer {
            server_id,
            count,
            flow: offered,
            replicas,
            pod,
        } = answer(meta)?;
        self.known_count.store(count.max(1), Ordering::Release);
        let flow = self.opts.flow_control && offered;
        let stall = self.opts.stall_timeout;
        let session = LinkDriver::new((server_id, pod), tx, flow, replicas, stall);
        Ok((Arc::new(session), count))
    }

    /// Lists a new stream under its server ID; `false` (not listed) when a
    /// stream to that replica is held already. A replica that drains does
    /// not count: its replacement may have kept the ID (a new process of
    /// the same pod), and the draining stream goes on serving what it
    /// carries, unlisted.
    fn keep(&self, session: &Arc<LinkDriver>) -> bool {
        let mut s = seedlink_net::sync::lock(&self.sessions, "agent sessions");
        match s.get(&session.server_id) {
            Some(held) if !held.draining.load(Ordering::Acquire) => false,
            _ => {
                s.insert(session.server_id.clone(), session.clone());
                true
            }
        }
    }

    /// A stream ended: forget it (only this stream: a replacement may hold
    /// its ID), slow pings down if the server said `too_many_pings`, resume
    /// discovery, and end what it carried.
    fn link_ended(&self, session: &Arc<LinkDriver>, goaway: Option<u32>) {
        let agent = self;
        self.count_flap(session);
        if session.draining.load(Ordering::Acquire) {
            self.draining_streams.fetch_sub(1, Ordering::AcqRel);
        }
        {
            let mut s = seedlink_net::sync::lock(&agent.sessions, "agent sessions");
            // Only this stream's entry (a replacement may hold the ID).
            if s.get(&session.server_id)
                .is_some_and(|x| Arc::ptr_eq(x, session))
            {
                s.remove(&session.server_id);
            }
        }
        // A GOAWAY too_many_pings slows our pings down for the next
        // connection.
        if goaway == Some(crate::transport::goaway::ENHANCE_YOUR_CALM) {
            agent.slow_down_pings(&session.server_id);
        }
        agent.session_lost.notify_one();
        agent.metrics.servers.dec();
        session.gone.cancel();
        session.to_server.close();
        session.with(|m, out| m.end(out));
        tracing::warn!(server_id = %session.server_id, "stream to tunnel server ended");
    }

    /// Every [`IDENTITY_CHECK`] until shutdown, whether the certificate
    /// files changed (and load): then every stream is replaced. The
    /// server's trust of the old CA outlasts the old certificate (a
    /// rotation's overlap), so the replacement is made before the old
    /// stream goes and no connection is cut by a renewal.
    async fn watch_identity(self: Arc<Self>, id: Arc<tls::ReloadingIdentity>) {
        // The pair the streams presented so far (a handshake may have read
        // a new one first: the streams before it are replaced all the same).
        let mut seen = id.current();
        loop {
            tokio::select! {
                () = tokio::time::sleep(IDENTITY_CHECK) => {}
                () = self.shutdown.cancelled() => return,
            }
            let now = id.current();
            if !Arc::ptr_eq(&now, &seen) && !self.draining.load(Ordering::Acquire) {
                seen = now;
                tracing::info!("client certificate changed: replacing every stream");
                self.restream();
            }
        }
    }

    /// Replaces every stream: DRAIN to its server (which sends new dials
    /// to the replacement from then on, while the old stream carries what
    /// it has), discovery dials again at once, and each old stream ends
    /// once idle behind its replacement.
    fn restream(self: &Arc<Self>) {
        let sessions: Vec<_> = seedlink_net::sync::lock(&self.sessions, "agent sessions")
            .values()
            .cloned()
            .collect();
        for s in sessions {
            if self.start_draining(&s, ServerConnect::CertificateChanged) {
                s.send_soon(Packet::drain());
                tokio::spawn(self.clone().close_when_idle(s));
            }
        }
    }

    /// Ends stream `s`, which this agent drains, once a replacement to the
    /// same replica is held and `s` has carried nothing for
    /// [`IDLE_BEFORE_CLOSE`] in a row, looked at every second: a dial the
    /// server chose before it read DRAIN arrives well within that. Ends
    /// with the stream or the agent.
    async fn close_when_idle(self: Arc<Self>, s: Arc<LinkDriver>) {
        let mut idle_since: Option<tokio::time::Instant> = None;
        loop {
            tokio::select! {
                () = tokio::time::sleep(Duration::from_secs(1)) => {}
                () = s.gone.cancelled() => return,
                () = self.shutdown.cancelled() => return,
            }
            let replaced = seedlink_net::sync::lock(&self.sessions, "agent sessions")
                .get(&s.server_id)
                .is_some_and(|r| !Arc::ptr_eq(r, &s) && !r.draining.load(Ordering::Acquire));
            if !(replaced && s.idle()) {
                idle_since = None;
                continue;
            }
            let since = *idle_since.get_or_insert_with(tokio::time::Instant::now);
            if since.elapsed() >= IDLE_BEFORE_CLOSE {
                tracing::info!(server_id = %s.server_id, "drained stream idle behind its replacement: closed");
                s.cut.cancel();
                return;
            }
        }
    }

    /// First SIGTERM: DRAIN to every server, no new connections to servers.
    pub fn drain(&self) {
        self.draining.store(true, Ordering::Release);
        let sessions: Vec<_> = seedlink_net::sync::lock(&self.sessions, "agent sessions")
            .values()
            .cloned()
            .collect();
        for s in sessions {
            s.send_soon(Packet::drain());
        }
    }
}

/// The replicas of a REPLICAS packet an agent can dial: a `serverid`, an
/// address that is `host:port`, a server name that is empty or a valid
/// one; at most [`crate::wire::MAX_REPLICA_ADDRESSES`]. The rest are
/// counted, not kept.
fn usable_replicas(
    told: Vec<crate::wire::proto::Replica>,
) -> (Vec<crate::wire::proto::Replica>, u64) {
    let n = told.len();
    let usable: Vec<_> = told
        .into_iter()
        .filter(|r| {
            !r.pod.is_empty()
                && r.pod.len() <= 253
                && crate::wire::replica_address_ok(&r.address)
                && (r.server_name.is_empty()
                    || rustls::pki_types::ServerName::try_from(r.server_name.clone()).is_ok())
        })
        .take(crate::wire::MAX_REPLICA_ADDRESSES)
        .collect();
    (
        usable.clone(),
        u64::try_from(n - usable.len()).unwrap_or(u64::MAX),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server that accepts every stream and drops (or drains) it at once
    /// is dialled less and less often, up to the cap; one stable stream
    /// ends the streak.
    #[test]
    fn streams_that_do_not_last_back_off() {
        let (base, cap) = (Duration::from_secs(1), Duration::from_secs(10));
        assert_eq!(flap_delay(0, base, cap), Duration::ZERO);
        assert_eq!(flap_delay(1, base, cap), base);
        assert_eq!(flap_delay(2, base, cap), Duration::from_millis(1500));
        assert_eq!(flap_delay(40, base, cap), cap);
        assert_eq!(flap_delay(u32::MAX, base, cap), cap);
        // Over 8 s of flapping, at most a handful of streams, not hundreds.
        let mut t = Duration::ZERO;
        let mut streams = 0;
        while t < Duration::from_secs(8) {
            streams += 1;
            t += flap_delay(streams, base, cap);
        }
        assert!(streams <= 6, "{streams}");
    }

    /// An agent that has not connected (its CA a throwaway one), with the
    /// default deny list.
    fn idle_agent(dir: &std::path::Path) -> Arc<Agent> {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca = params.self_signed(&key).unwrap();
        let path = dir.join("ca.pem");
        std::fs::write(&path, ca.pem()).unwrap();
        Agent::new(AgentOptions {
            server: "lb.example:8091".into(),
            server_name: "tunnel.example".into(),
            ca: path,
            identity: None,
            alpn: Vec::new(),
            agent_id: "a".into(),
            identifiers: String::new(),
            token_path: None,
            allow: Vec::new(),
            allow_ports: Vec::new(),
            deny: DEFAULT_DENY.iter().filter_map(|d| d.parse().ok()).collect(),
            dial_timeout: Duration::from_secs(5),
            sync_interval: Duration::from_secs(1),
            sync_interval_cap: Duration::from_secs(10),
            keepalive: H2Settings {
                keepalive: Duration::from_secs(60),
                keepalive_timeout: Duration::from_secs(5),
            },
            stall_timeout: Duration::from_secs(10),
            queue_bytes: 1 << 20,
            flow_control: true,
            native: true,
            replica_addresses: true,
            egress: None,
        })
        .unwrap()
    }

    fn replica(pod: &str, address: &str) -> crate::wire::proto::Replica {
        crate::wire::proto::Replica {
            pod: pod.into(),
            address: address.into(),
            server_name: String::new(),
        }
    }

    /// Replicas the agent holds no stream to are dialled in turn with
    /// `--server`; addresses the destination policy denies are never
    /// kept; a REPLICAS without addresses leaves the last ones.
    #[tokio::test]
    async fn replica_targets_take_turns_with_the_server_and_respect_the_deny_list() {
        let dir = tempfile::tempdir().unwrap();
        let a = idle_agent(dir.path());
        a.replicas_changed(
            "s",
            4,
            vec![
                replica("p-1", "10.0.0.1:8091"),
                replica("p-2", "10.0.0.2:8091"),
                replica("p-3", "127.0.0.1:8091"),
                replica("p-4", "[::ffff:169.254.169.254]:80"),
            ],
        );
        let mut seen: Vec<String> = (0..6).map(|_| a.target().address).collect();
        seen.sort();
        seen.dedup();
        assert_eq!(seen, ["10.0.0.1:8091", "10.0.0.2:8091", "lb.example:8091"]);
        a.replicas_changed("s", 4, Vec::new());
        assert_eq!(seedlink_net::sync::lock(&a.replica_addresses, "t").len(), 2);
        let text = seedlink_net::admin::encode_all(&[&a.metrics.registry]);
        assert!(
            text.contains("outcome=\"bad_replica_address\"} 2"),
            "{text}"
        );
    }

    /// A server's REPLICAS ends a long wait after a success within
    /// `--sync-interval`, but not a back-off after a failed attempt: a
    /// server that sends REPLICAS without end cannot make the agent dial
    /// faster.
    #[tokio::test(start_paused = true)]
    async fn replicas_wake_discovery_only_outside_a_back_off() {
        let dir = tempfile::tempdir().unwrap();
        let a = idle_agent(dir.path());
        for (after_success, ends_within) in [(true, 1), (false, 12)] {
            let started = tokio::time::Instant::now();
            let paused = tokio::spawn({
                let a = a.clone();
                async move { a.pause(Duration::from_secs(10), true, after_success).await }
            });
            tokio::task::yield_now().await;
            a.replicas_told.notify_one();
            assert!(paused.await.unwrap());
            let took = started.elapsed();
            assert!(took <= Duration::from_secs(ends_within), "{took:?}");
            if !after_success {
                assert!(took >= Duration::from_secs(9), "{took:?}");
            }
        }
    }

    /// What a REPLICAS packet names is kept only when an agent can dial
    /// it, and only so many: a server cannot make the agent dial or hold
    /// without bound.
    #[test]
    fn only_usable_replica_addresses_are_kept_and_at_most_32() {
        let r = |id: &str, address: &str, name: &str| crate::wire::proto::Replica {
            pod: id.into(),
            address: address.into(),
            server_name: name.into(),
        };
        let told = vec![
            r("a", "10.0.0.1:8091", ""),
            r("b", "[fd00::2]:8091", "b.tunnel.example.com"),
            r("", "10.0.0.3:8091", ""),
            r("d", "10.0.0.4", ""),
            r("e", "10.0.0.5:8091", "not a name"),
        ];
        let (kept, bad) = usable_replicas(told);
        let ids: Vec<_> = kept.iter().map(|r| r.pod.as_str()).collect();
        assert_eq!((ids, bad), (vec!["a", "b"], 3));
        let many = (0..100)
            .map(|i| r(&format!("s{i}"), "10.0.0.1:1", ""))
            .collect();
        let (kept, bad) = usable_replicas(many);
        assert_eq!((kept.len(), bad), (crate::wire::MAX_REPLICA_ADDRESSES, 68));
    }

    /// On the native transport the agent pings at the server's interval
    /// when it is shorter than its own, never below 1 s; a longer one, or
    /// none, leaves its own.
    #[test]
    fn the_ping_interval_follows_a_shorter_server_interval() {
        let ours = H2Settings {
            keepalive: Duration::from_secs(60),
            keepalive_timeout: Duration::from_secs(5),
        };
        let answer = |v: Option<&str>| {
            let mut m = tonic::metadata::MetadataMap::new();
            if let Some(v) = v {
                m.insert(crate::wire::proto::KEEPALIVE_HEADER, v.parse().unwrap());
            }
            m
        };
        let every = |v| connect::follow_server_keepalive(ours, &answer(v)).keepalive;
        assert_eq!(every(Some("10000")), Duration::from_secs(10));
        assert_eq!(every(Some("1")), Duration::from_secs(1));
        assert_eq!(every(Some("600000")), Duration::from_secs(60));
        assert_eq!(every(Some("soon")), Duration::from_secs(60));
        assert_eq!(every(None), Duration::from_secs(60));
        assert_eq!(
            connect::follow_server_keepalive(ours, &answer(Some("10000"))).keepalive_timeout,
            Duration::from_secs(5)
        );
    }

    #[test]
    fn refusals_back_off_and_timeouts_do_not() {
        let (base, cap) = (Duration::from_secs(1), Duration::from_secs(30));
        let mut delay = base;
        let mut waits = Vec::new();
        for _ in 0..12 {
            let (wait, next) = retry_delay(delay, false, base, cap);
            waits.push(wait);
            delay = next;
        }
        assert_eq!(waits[0], base);
        assert!(waits.windows(2).all(|w| w[1] >= w[0]));
        assert_eq!(delay, cap, "refusals grow to the cap");
        // A partition: however long the back-off had grown, a timed-out
        // attempt is followed by the base wait, and so is the next.
        let (wait, next) = retry_delay(delay, true, base, cap);
        assert_eq!((wait, next), (base, base));
        let connect = ConnectError::ConnectTimeout("x:1".into());
        assert!(connect.timed_out() && ConnectError::TlsTimeout.timed_out());
        assert!(!ConnectError::Refused("no".into()).timed_out());
    }
}

//! `seedlink tunnel-server`: agents of many clusters connect to one agent
//! endpoint; each cluster's frontends (kube-apiserver's egress dialer) dial
//! through that cluster's agents only.
//!
//! Every agent stream is an [`AgentLink`]. A dial picks a link of the
//! frontend's cluster, registers a pending dial under a fresh random ID *on
//! that link*, and waits (bounded) for the link's receive loop to resolve
//! it. Established connections live in the link's table too, so an agent
//! can only ever answer, feed or close what was sent to it.
//!
//! The link's timers (a dial's deadline, an agent gone silent under a
//! waiting dial, the stall deadline of a connection waiting for room, the
//! closed IDs' expiry) are the machine's ([`link::ServerLink::poll_timeout`],
//! [`link::ServerLink::handle_timeout`]); the link's receive loop
//! (`agents::receive`) sleeps until the next one with
//! [`AgentLink::next_timeout`]. Timers around IO stay with the IO: the TLS
//! handshake deadline, the first-stream deadline, a frontend write's stall.
//!
//! The modules, from the agent's side to the frontend's:
//! - `link`: the sans-IO machine of one agent stream; `agent_link`: its
//!   driver (the lock, the actions carried out, the wait for room);
//! - `identifiers` (what an agent says about itself, the strategies),
//!   `cluster` (a cluster's agents, the pick, attach and detach),
//!   `registry` (every cluster, by name, certificate or token);
//! - `dial`: one dial under one deadline, and the tunnel's ends;
//! - `agents` (the agent endpoint: TLS, the handshake, the receive loop),
//!   `frontend` and `socks` (the frontends' protocols), `core`, `limits`,
//!   `metrics`, `activity`, `admin`;
//! - `run`: the server as configured (`plan`; `diff`, pure, decides what
//!   a reload changes), `upgrade` and `handover` (binary upgrades).

pub mod activity;
pub mod admin;
pub mod agent_link;
pub mod agents;
pub mod cluster;
pub mod core;
pub mod dial;
pub mod dialerror;
pub mod diff;
pub mod frontend;
pub mod handover;
#[cfg(any(test, feature = "harness"))]
pub mod harness;
pub mod identifiers;
pub mod limits;
pub mod link;
pub mod metrics;
pub mod registry;
pub mod run;
pub mod socks;
pub mod upgrade;

pub use self::agent_link::*;
pub use self::cluster::*;
pub use self::dial::*;
pub use self::dialerror::DialError;
pub use self::identifiers::*;
pub use self::link::Handled;
pub use self::registry::*;
pub use seedlink_config::tunnel::ClusterHealth;

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::time::{Duration, Instant};

    use bytes::Bytes;
    use tokio::sync::oneshot;
    use tokio_util::sync::CancellationToken;

    use super::link::Timers;
    use super::*;
    use crate::proto::Packet;
    use crate::queue;
    fn cluster(strategies: &[Strategy]) -> Cluster {
        Cluster::with_trust(
            "c",
            strategies.to_vec(),
            None,
            None,
            limits::Limits::UNLIMITED,
        )
    }

    #[test]
    fn identifiers_parse_like_upstream_and_report_what_they_ignore() {
        let (ids, ignored) = Identifiers::parse(
            "host=Node1&ipv4=10.0.0.5&ipv6=fd00::1&cidr=10.1.0.0/16&default-route=true&uid=x&ipv4=bad",
        );
        assert_eq!(ids.hosts, vec!["node1"]);
        assert_eq!(ids.ips.len(), 2);
        assert_eq!(ids.cidrs.len(), 1);
        assert!(ids.default_route);
        assert_eq!(ignored, vec!["uid".to_string(), "ipv4=bad".to_string()]);
    }

    #[test]
    fn strategies_pick_in_order_and_prefer_non_draining_agents() {
        let c = cluster(&[Strategy::DestHost, Strategy::Cidr, Strategy::DefaultRoute]);
        let (a, _) = attach(
            &c,
            "a".into(),
            Identifiers::parse("host=node-a&ipv4=10.0.0.5").0,
            false,
            TIMERS,
        );
        let (b, _) = attach(
            &c,
            "b".into(),
            Identifiers::parse("cidr=10.1.0.0/16").0,
            false,
            TIMERS,
        );
        let (d, _) = attach(
            &c,
            "d".into(),
            Identifiers::parse("default-route=true").0,
            false,
            TIMERS,
        );
        assert_eq!(c.pick("10.0.0.5", LIVE).unwrap().agent_id, "a");
        assert_eq!(c.pick("NODE-A", LIVE).unwrap().agent_id, "a");
        assert_eq!(c.pick("10.1.2.3", LIVE).unwrap().agent_id, "b");
        assert_eq!(c.pick("192.168.1.1", LIVE).unwrap().agent_id, "d");
        assert_eq!(c.pick("[fd00::1]", LIVE).unwrap().agent_id, "d");
        // No `default` strategy: nothing matches without default-route.
        detach(&c, &d);
        assert_eq!(c.pick("192.168.1.1", LIVE).err(), Some(DialError::NoAgent));
        // A draining agent is used only when no other fits.
        let (a2, _) = attach(
            &c,
            "a2".into(),
            Identifiers::parse("ipv4=10.0.0.5").0,
            false,
            TIMERS,
        );
        a.on_agent_packet(Packet::drain());
        for _ in 0..20 {
            assert_eq!(c.pick("10.0.0.5", LIVE).unwrap().agent_id, "a2");
        }
        a2.on_agent_packet(Packet::drain());
        assert!(c.pick("10.0.0.5", LIVE).is_ok());
        let _ = b;
    }

    const LIVE: Duration = Duration::from_secs(12);
    const TIMERS: Timers = Timers {
        stall: Duration::from_secs(10),
        unresponsive_after: LIVE,
    };

    #[test]
    fn a_silent_agent_is_skipped_and_alone_fails_the_dial_at_once() {
        let c = cluster(&[Strategy::Default]);
        let (frozen, _) = attach(&c, "frozen".into(), Identifiers::default(), false, TIMERS);
        let stamp = activity::Activity::new();
        stamp.backdate(Duration::from_secs(30));
        let _ = frozen.activity.set(stamp);
        match c.pick("h", LIVE) {
            Err(DialError::Unresponsive(s)) => assert!(s >= Duration::from_secs(30)),
            other => panic!(
                "expected Unresponsive, got {:?}",
                other.map(|l| l.agent_id.clone())
            ),
        }
        assert_eq!(
            DialError::Unresponsive(Duration::from_secs(30)).http_status(),
            503
        );
        // A live agent (stamped now, or never stamped) takes every dial.
        let (live, _) = attach(&c, "live".into(), Identifiers::default(), false, TIMERS);
        let _ = live.activity.set(activity::Activity::new());
        for _ in 0..20 {
            assert_eq!(
                c.pick("h", LIVE)
                    .map(|l| l.agent_id.clone())
                    .ok()
                    .as_deref(),
                Some("live")
            );
        }
    }

    #[test]
    fn only_an_agents_first_stream_takes_dials() {
        let c = cluster(&[Strategy::Default]);
        let (first, _) = attach(&c, "x".into(), Identifiers::default(), false, TIMERS);
        let (_second, _) = attach(&c, "x".into(), Identifiers::default(), false, TIMERS);
        for _ in 0..20 {
            assert_eq!(c.pick("h", LIVE).unwrap().uid, first.uid);
        }
    }

    /// The driver half of the timers: a dial registered while the timer
    /// loop sleeps with nothing due wakes it, and the machine answers the
    /// dial with the timeout (the agent gets DIAL_REQ, then DIAL_CLS).
    #[tokio::test]
    async fn the_timer_loop_answers_a_dial_at_its_deadline() {
        let c = cluster(&[Strategy::Default]);
        let (link, to_agent) = attach(&c, "a".into(), Identifiers::default(), false, TIMERS);
        let timers = {
            let link = link.clone();
            tokio::spawn(async move {
                loop {
                    link.next_timeout().await;
                }
            })
        };
        tokio::task::yield_now().await;
        let settings = DialSettings {
            timeout: Duration::from_millis(50),
            queue_bytes: 1 << 16,
            unresponsive_after: LIVE,
            agent_wait: Duration::ZERO,
        };
        let r = dial(&c, "h:1", settings, &CancellationToken::new()).await;
        assert_eq!(r.err(), Some(DialError::Timeout));
        let kinds: Vec<_> = std::iter::from_fn(|| to_agent.try_next())
            .map(|p| p.kind())
            .collect();
        use crate::proto::PacketType as T;
        assert_eq!(kinds, [Some(T::DialReq), Some(T::DialCls)]);
        assert_eq!(link.conn_count(), 0);
        timers.abort();
    }

    fn waiting(agent_wait: Duration) -> DialSettings {
        DialSettings {
            timeout: Duration::from_secs(10),
            queue_bytes: 1 << 16,
            unresponsive_after: LIVE,
            agent_wait,
        }
    }

    /// A dial that finds no agent waits for one to join, and the agent
    /// that joins gets it: the moment a replica is replaced, before the
    /// agents have found it.
    #[tokio::test(start_paused = true)]
    async fn a_dial_with_no_agent_waits_for_one_to_join() {
        let c = std::sync::Arc::new(cluster(&[Strategy::Default]));
        let dialing = {
            let c = c.clone();
            tokio::spawn(async move {
                let cancel = CancellationToken::new();
                dial(&c, "h:1", waiting(Duration::from_secs(3)), &cancel)
                    .await
                    .map(|t| t.tx.link.agent_id.clone())
            })
        };
        // The dial is waiting (paused time does not advance while it can).
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert!(!dialing.is_finished());
        let (link, to_agent) = attach(&c, "late".into(), Identifiers::default(), false, TIMERS);
        let req = loop {
            if let Some(p) = to_agent.try_next() {
                break p;
            }
            tokio::task::yield_now().await;
        };
        use crate::proto::PacketType as T;
        assert_eq!(req.kind(), Some(T::DialReq));
        let Some(crate::proto::Payload::DialRequest(d)) = req.payload else {
            panic!("not a dial request: {req:?}");
        };
        link.on_agent_packet(Packet::dial_rsp(d.random, 7, String::new()));
        assert_eq!(
            dialing.await.ok().and_then(Result::ok).as_deref(),
            Some("late")
        );
    }

    /// No agent joins: `no_agent` once the wait is over (not a timeout),
    /// and at once with no wait; a cancelled caller ends the wait.
    #[tokio::test(start_paused = true)]
    async fn a_dial_with_no_agent_fails_after_its_wait() {
        let c = cluster(&[Strategy::Default]);
        let cancel = CancellationToken::new();
        let t0 = tokio::time::Instant::now();
        let r = dial(&c, "h:1", waiting(Duration::from_secs(3)), &cancel).await;
        assert_eq!(r.err(), Some(DialError::NoAgent));
        let waited = t0.elapsed();
        assert!(waited >= Duration::from_secs(3) && waited < Duration::from_secs(4));
        let t0 = tokio::time::Instant::now();
        let r = dial(&c, "h:1", waiting(Duration::ZERO), &cancel).await;
        assert_eq!(r.err(), Some(DialError::NoAgent));
        assert_eq!(t0.elapsed(), Duration::ZERO);
        cancel.cancel();
        let r = dial(&c, "h:1", waiting(Duration::from_secs(3)), &cancel).await;
        assert_eq!(r.err(), Some(DialError::Cancelled));
        // An agent that joins but does not fit the strategy leaves the
        // dial waiting out its time.
        let only_a = cluster(&[Strategy::DestHost]);
        let c = std::sync::Arc::new(only_a);
        let (_other, _) = attach(&c, "b".into(), Identifiers::default(), false, TIMERS);
        let r = dial(
            &c,
            "h:1",
            waiting(Duration::from_secs(3)),
            &CancellationToken::new(),
        )
        .await;
        assert_eq!(r.err(), Some(DialError::NoAgent));
    }

    /// At most `MAX_WAITING` dials of a cluster wait for an agent; one more
    /// is answered `no_agent` at once, and a waiting dial whose caller
    /// goes away gives its place back.
    #[tokio::test(start_paused = true)]
    async fn waiting_dials_are_bounded_per_cluster() {
        use std::sync::atomic::Ordering;
        let c = std::sync::Arc::new(cluster(&[Strategy::Default]));
        let mut parked = Vec::new();
        for _ in 0..cluster::MAX_WAITING {
            let c = c.clone();
            parked.push(tokio::spawn(async move {
                let cancel = CancellationToken::new();
                dial(&c, "h:1", waiting(Duration::from_secs(3)), &cancel)
                    .await
                    .err()
            }));
        }
        while c.waiting.load(Ordering::Acquire) < cluster::MAX_WAITING {
            tokio::task::yield_now().await;
        }
        let t0 = tokio::time::Instant::now();
        let r = dial(
            &c,
            "h:1",
            waiting(Duration::from_secs(3)),
            &CancellationToken::new(),
        )
        .await;
        assert_eq!(r.err(), Some(DialError::NoAgent));
        assert_eq!(t0.elapsed(), Duration::ZERO);
        let gone = parked.pop().unwrap();
        gone.abort();
        let _ = gone.await;
        assert_eq!(c.waiting.load(Ordering::Acquire), cluster::MAX_WAITING - 1);
        for p in parked {
            assert_eq!(p.await.unwrap(), Some(DialError::NoAgent));
        }
        assert_eq!(c.waiting.load(Ordering::Acquire), 0);
    }

    /// The receive loop holds two timer futures while a connection waits
    /// for room (its own, idle, and the one the wait polls): a dial whose
    /// deadline comes before the waiting one's wakes the one being polled,
    /// which answers it. (With a wake-up for the oldest sleeper only, the
    /// polled one slept on to the stall deadline, an hour here.)
    #[tokio::test]
    async fn an_earlier_timer_wakes_every_sleeper() {
        let c = cluster(&[Strategy::Default]);
        let timers = Timers {
            stall: Duration::from_secs(3600),
            ..TIMERS
        };
        let (link, _to_agent) = attach(&c, "a".into(), Identifiers::default(), false, timers);
        let now = Instant::now();
        link.with(now, |m, _| m.blocked(now, 99));
        let outer = link.next_timeout();
        tokio::pin!(outer);
        let inner = link.next_timeout();
        tokio::pin!(inner);
        for f in [&mut outer, &mut inner] {
            tokio::select! {
                biased;
                _ = f => panic!("nothing is due yet"),
                () = std::future::ready(()) => {}
            }
        }
        let (qtx, _reader) = queue::queue(4);
        let ends = ConnEnds {
            queue: qtx,
            credit: None,
        };
        let (reply, answer) = oneshot::channel();
        link.with(Instant::now(), |m, out| {
            m.dial(7, "h:1", Instant::now(), reply, ends, out);
        });
        // A bound that only stops a broken build.
        let woke = tokio::time::timeout(Duration::from_secs(30), &mut inner).await;
        assert_eq!(
            woke.ok(),
            Some(None),
            "the polled sleeper woke and handled the dial"
        );
        assert_eq!(answer.await.ok(), Some(Err(DialError::Timeout)));
    }

    /// Four bytes of DATA.
    fn four() -> Packet {
        Packet::data(1, Bytes::from_static(b"1234"))
    }

    /// A link (with or without flow control) whose connection 1 has a
    /// 4-byte queue nobody reads, already holding four bytes; and what
    /// must stay alive meanwhile (the queue's reader, the dialer).
    fn with_four_queued(
        c: &Cluster,
        flow: bool,
        timers: Timers,
    ) -> (std::sync::Arc<AgentLink>, impl Sized) {
        let (link, to_agent) = attach(c, "a".into(), Identifiers::default(), flow, timers);
        let (qtx, reader) = queue::queue(4);
        let ends = ConnEnds {
            queue: qtx,
            credit: flow.then(crate::flow::SendCredit::new),
        };
        let (reply, answer) = oneshot::channel();
        let now = Instant::now();
        link.with(now, |m, out| {
            m.dial(7, "h:1", now + LIVE, reply, ends, out);
        });
        link.on_agent_packet(Packet::dial_rsp(7, 1, String::new()));
        assert!(link.on_agent_packet(four()).1.is_none());
        (link, (to_agent, reader, answer))
    }

    /// A reader that takes nothing: the wait for room ends at the
    /// machine's stall deadline, with that connection reset.
    #[tokio::test]
    async fn a_wait_for_room_ends_at_the_stall_deadline() {
        let c = cluster(&[Strategy::Default]);
        let timers = Timers {
            stall: Duration::from_millis(50),
            ..TIMERS
        };
        let (link, _keep) = with_four_queued(&c, false, timers);
        let (h, blocked) = link.on_agent_packet(four());
        assert_eq!(h, Handled::Full);
        let Some(b) = blocked else {
            panic!("the second chunk does not fit")
        };
        assert_eq!(b.resume(&link).await, Handled::Stalled);
        assert_eq!(link.conn_count(), 0);
    }

    /// With flow control agreed, DATA beyond the connection's own limit is
    /// more than the agent had credit for: that connection is closed at
    /// once, and the stream is not held waiting for room.
    #[tokio::test]
    async fn an_overrun_window_closes_its_connection_and_holds_nothing() {
        let c = cluster(&[Strategy::Default]);
        let (link, _keep) = with_four_queued(&c, true, TIMERS);
        let (h, blocked) = link.on_agent_packet(four());
        assert_eq!(h, Handled::Unexpected);
        assert!(blocked.is_none(), "nothing to wait for");
        assert_eq!(link.conn_count(), 0);
    }

    #[test]
    fn dial_errors_map_to_upstream_statuses() {
        assert_eq!(DialError::NoAgent.http_status(), 500);
        assert_eq!(DialError::Timeout.http_status(), 504);
        assert_eq!(DialError::AgentGone.http_status(), 502);
        assert_eq!(
            DialError::Agent("dial tcp 1.2.3.4:5: i/o timeout".into()).http_status(),
            504
        );
        assert_eq!(
            DialError::Agent("socket: too many open files".into()).http_status(),
            503
        );
        assert_eq!(
            DialError::Agent("connect: connection refused".into()).http_status(),
            502
        );
    }
}

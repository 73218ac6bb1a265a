//! Dial errors cross the Konnectivity wire as text (`DialResponse.error`).
//! This is the one place that reads such text: the server turns it into a
//! kind once, and everything after (HTTP status, metrics) uses the kind.
//! seedlink's agent writes errors in the same shape as upstream's Go agent
//! (`dial tcp <addr>: <reason>`), so both are understood.
//!
//! [`DialError`] is why a dial through the tunnel failed, whichever side
//! failed it, and what each failure means to a frontend (HTTP status, SOCKS
//! reply) and to the metrics (reason label).

/// What kind of failure an agent reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// The destination did not answer in time.
    Timeout,
    /// The agent ran out of a resource (file descriptors).
    Exhausted,
    /// The destination refused the connection.
    Refused,
    /// The agent's policy forbids the destination.
    Forbidden,
    /// Anything else (unreachable, DNS, reset).
    Other,
}

/// Text the seedlink agent sends when its policy denies a destination.
pub const FORBIDDEN: &str = "destination not allowed by the agent's policy";

/// Reads an agent's error text.
pub fn classify(text: &str) -> Kind {
    let t = text.to_ascii_lowercase();
    if t.contains("timeout") || t.contains("timed out") || t.contains("deadline exceeded") {
        Kind::Timeout
    } else if t.contains("too many open files") {
        Kind::Exhausted
    } else if t.contains(FORBIDDEN) {
        Kind::Forbidden
    } else if t.contains("refused") {
        Kind::Refused
    } else {
        Kind::Other
    }
}

/// A dial that failed on this agent: its kind (for metrics) and the text
/// sent on the wire, in upstream's shape (`dial tcp <addr>: <reason>`), so
/// servers of both kinds read it. The kind is known here, never re-parsed
/// from the text in this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DialFailure {
    /// What went wrong.
    pub kind: Kind,
    /// The `DialResponse.error` text.
    pub text: String,
}

impl DialFailure {
    /// A socket error while connecting to `address`.
    pub fn io(address: &str, e: &std::io::Error) -> DialFailure {
        let (kind, reason) = match e.kind() {
            std::io::ErrorKind::TimedOut => (Kind::Timeout, "i/o timeout".to_string()),
            std::io::ErrorKind::ConnectionRefused => {
                (Kind::Refused, "connect: connection refused".to_string())
            }
            _ if e.raw_os_error() == Some(24) => {
                (Kind::Exhausted, "socket: too many open files".to_string())
            }
            _ => (Kind::Other, e.to_string()),
        };
        DialFailure {
            kind,
            text: format!("dial tcp {address}: {reason}"),
        }
    }

    /// The dial (with its name lookup) did not finish in time.
    pub fn timeout(address: &str) -> DialFailure {
        DialFailure {
            kind: Kind::Timeout,
            text: format!("dial tcp {address}: i/o timeout"),
        }
    }

    /// The agent's policy denies every address of `address`.
    pub fn forbidden(address: &str) -> DialFailure {
        DialFailure {
            kind: Kind::Forbidden,
            text: format!("dial tcp {address}: {FORBIDDEN}"),
        }
    }

    /// Anything else, with its text.
    pub fn other(text: String) -> DialFailure {
        DialFailure {
            kind: Kind::Other,
            text,
        }
    }

    /// The agent's `dials_total{outcome}` label.
    pub fn label(&self) -> &'static str {
        match self.kind {
            Kind::Forbidden => "forbidden",
            Kind::Timeout => "timeout",
            Kind::Refused => "refused",
            Kind::Exhausted | Kind::Other => "error",
        }
    }
}

/// Why a dial failed; mapped to HTTP statuses and gRPC errors in one place.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DialError {
    /// No agent of the cluster can take it.
    #[error("No agent available")]
    NoAgent,
    /// Every agent that could take it has been silent past its keepalive
    /// interval (frozen or cut off, not yet closed): the shortest silence.
    #[error("agent unresponsive: nothing received from it for {:.1}s", .0.as_secs_f64())]
    Unresponsive(std::time::Duration),
    /// The agent did not answer within the dial timeout.
    #[error("timed out waiting for backend dial")]
    Timeout,
    /// The agent's stream ended while the dial was pending.
    #[error("backend connection closed")]
    AgentGone,
    /// The agent cancelled the dial (DIAL_CLS).
    #[error("dial closed by the agent")]
    Cancelled,
    /// The agent answered with an error.
    #[error("{0}")]
    Agent(String),
    /// The agent broke the protocol (a DIAL_RSP without connection ID).
    #[error("agent protocol error: {0}")]
    Protocol(&'static str),
    /// A limit of the cluster refused the dial.
    #[error("cluster limit reached: {}", .0.reason())]
    Limited(Limited),
    /// A seed destination (dialled by the server itself) could not be
    /// resolved or reached.
    #[error("seed destination: {0}")]
    Seed(String),
}

/// Which limit refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limited {
    /// `max_connections`.
    Connections,
    /// `dial_rate`.
    DialRate,
}

impl Limited {
    /// Metric reason.
    pub fn reason(self) -> &'static str {
        match self {
            Limited::Connections => "limit_connections",
            Limited::DialRate => "limit_dial_rate",
        }
    }
}

impl DialError {
    /// The HTTP status an HTTP-CONNECT frontend answers with (as upstream
    /// documents: 500 no agent, 502 other failures, 503 resource
    /// exhaustion at the agent, 504 timeouts).
    pub fn http_status(&self) -> u16 {
        match self {
            DialError::NoAgent => 500,
            DialError::Unresponsive(_) => 503,
            DialError::Timeout => 504,
            DialError::Agent(text) => match classify(text) {
                Kind::Timeout => 504,
                Kind::Exhausted => 503,
                _ => 502,
            },
            DialError::AgentGone
            | DialError::Cancelled
            | DialError::Protocol(_)
            | DialError::Seed(_) => 502,
            DialError::Limited(_) => 503,
        }
    }

    /// The SOCKS5 reply code (RFC 1928 §6) a SOCKS frontend answers with:
    /// no agent is an unreachable network (no path into the shoot), a
    /// policy denial "not allowed by ruleset", a refusal "refused", a
    /// timeout or any other failure to reach the destination "host
    /// unreachable", the rest a general failure.
    pub fn socks5_reply(&self) -> u8 {
        use super::socks5::rep;
        match self {
            DialError::NoAgent | DialError::Unresponsive(_) => rep::NETWORK_UNREACHABLE,
            DialError::Timeout | DialError::Seed(_) => rep::HOST_UNREACHABLE,
            DialError::Agent(text) => match classify(text) {
                Kind::Forbidden => rep::NOT_ALLOWED,
                Kind::Refused => rep::REFUSED,
                Kind::Exhausted => rep::FAILURE,
                Kind::Timeout | Kind::Other => rep::HOST_UNREACHABLE,
            },
            DialError::AgentGone
            | DialError::Cancelled
            | DialError::Protocol(_)
            | DialError::Limited(_) => rep::FAILURE,
        }
    }

    /// Label for `dial_failures_total{reason}` (Konnectivity's reasons where
    /// they mean the same).
    pub fn reason(&self) -> &'static str {
        match self {
            DialError::NoAgent => "no_agent",
            DialError::Unresponsive(_) => "agent_unresponsive",
            DialError::Timeout => "backend_dial_timeout",
            DialError::AgentGone => "backend_close",
            DialError::Cancelled => "dial_closed",
            DialError::Agent(_) => "error_response",
            DialError::Protocol(_) => "protocol_error",
            DialError::Limited(l) => l.reason(),
            DialError::Seed(_) => "seed_dial_failed",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstream_and_own_texts_classify() {
        assert_eq!(
            classify("dial tcp 10.0.0.1:443: i/o timeout"),
            Kind::Timeout
        );
        assert_eq!(classify("context deadline exceeded"), Kind::Timeout);
        assert_eq!(
            classify("dial tcp 10.0.0.1:443: connect: connection refused"),
            Kind::Refused
        );
        assert_eq!(
            classify("dial tcp: socket: too many open files"),
            Kind::Exhausted
        );
        assert_eq!(classify(FORBIDDEN), Kind::Forbidden);
        assert_eq!(classify("dial tcp: lookup x: no such host"), Kind::Other);
    }

    #[test]
    fn the_kind_an_agent_knows_is_the_kind_a_server_reads() {
        let failures = [
            DialFailure::io(
                "1.2.3.4:5",
                &std::io::Error::from(std::io::ErrorKind::ConnectionRefused),
            ),
            DialFailure::io(
                "1.2.3.4:5",
                &std::io::Error::from(std::io::ErrorKind::TimedOut),
            ),
            DialFailure::io("1.2.3.4:5", &std::io::Error::from_raw_os_error(24)),
            DialFailure::io(
                "1.2.3.4:5",
                &std::io::Error::from(std::io::ErrorKind::HostUnreachable),
            ),
            DialFailure::timeout("a:1"),
            DialFailure::forbidden("169.254.169.254:80"),
        ];
        for f in failures {
            assert_eq!(classify(&f.text), f.kind, "{}", f.text);
        }
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

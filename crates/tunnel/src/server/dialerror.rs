//! Why a dial through the tunnel failed, and what each failure means to a
//! frontend (HTTP status) and to the metrics (reason label).

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
            DialError::Agent(text) => match crate::dialerr::classify(text) {
                crate::dialerr::Kind::Timeout => 504,
                crate::dialerr::Kind::Exhausted => 503,
                _ => 502,
            },
            DialError::AgentGone | DialError::Cancelled | DialError::Protocol(_) => 502,
            DialError::Limited(_) => 503,
        }
    }

    /// The SOCKS5 reply code (RFC 1928 §6) a SOCKS frontend answers with:
    /// no agent is an unreachable network (no path into the shoot), a
    /// policy denial "not allowed by ruleset", a refusal "refused", a
    /// timeout or any other failure to reach the destination "host
    /// unreachable", the rest a general failure.
    pub fn socks5_reply(&self) -> u8 {
        use crate::socks5::rep;
        match self {
            DialError::NoAgent | DialError::Unresponsive(_) => rep::NETWORK_UNREACHABLE,
            DialError::Timeout => rep::HOST_UNREACHABLE,
            DialError::Agent(text) => match crate::dialerr::classify(text) {
                crate::dialerr::Kind::Forbidden => rep::NOT_ALLOWED,
                crate::dialerr::Kind::Refused => rep::REFUSED,
                crate::dialerr::Kind::Exhausted => rep::FAILURE,
                crate::dialerr::Kind::Timeout | crate::dialerr::Kind::Other => {
                    rep::HOST_UNREACHABLE
                }
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
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use crate::server::*;

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

//! Dial errors cross the Konnectivity wire as text (`DialResponse.error`).
//! This is the one place that reads such text: the server turns it into a
//! kind once, and everything after (HTTP status, metrics) uses the kind.
//! seedlink's agent writes errors in the same shape as upstream's Go agent
//! (`dial tcp <addr>: <reason>`), so both are understood.

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
}

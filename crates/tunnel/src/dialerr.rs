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

/// The text for a failed dial, in upstream's shape.
pub fn text(address: &str, e: &std::io::Error) -> String {
    let reason = match e.kind() {
        std::io::ErrorKind::TimedOut => "i/o timeout".to_string(),
        std::io::ErrorKind::ConnectionRefused => "connect: connection refused".to_string(),
        _ if e.raw_os_error() == Some(24) => "socket: too many open files".to_string(),
        _ => e.to_string(),
    };
    format!("dial tcp {address}: {reason}")
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
        let e = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        assert_eq!(classify(&text("1.2.3.4:5", &e)), Kind::Refused);
        let e = std::io::Error::from(std::io::ErrorKind::TimedOut);
        assert_eq!(classify(&text("1.2.3.4:5", &e)), Kind::Timeout);
    }
}

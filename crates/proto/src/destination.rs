//! The destination names a CONNECT request carries in its
//! `X-Gardener-Destination` (or legacy `Reversed-VPN`) header.
//!
//! Two shapes are accepted (`../shared/reference/gardener-istio-kkp.md` §1.5):
//! - Envoy cluster names `outbound|<port>||<fqdn>` (empty subset), e.g.
//!   `outbound|443||kube-apiserver.shoot--p--n.svc.cluster.local`;
//! - `<namespace>--kube-apiserver-socket` (Gardener's L7 mode).
//!
//! Parsing only checks the shape and returns a canonical (lower-case) form;
//! whether a destination is served is an exact lookup in the configuration.

/// A well-formed destination.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Destination {
    /// `outbound|<port>||<fqdn>`.
    Cluster {
        /// The service port.
        port: u16,
        /// The fully qualified service name, lower case, no trailing dot.
        host: String,
    },
    /// `<namespace>--kube-apiserver-socket`.
    ApiserverSocket {
        /// The shoot namespace.
        namespace: String,
    },
}

const SOCKET_SUFFIX: &str = "--kube-apiserver-socket";

impl Destination {
    /// The canonical string (what configuration keys are compared with).
    pub fn canonical(&self) -> String {
        match self {
            Destination::Cluster { port, host } => format!("outbound|{port}||{host}"),
            Destination::ApiserverSocket { namespace } => format!("{namespace}{SOCKET_SUFFIX}"),
        }
    }
}

/// Parses a destination string; the error says what is wrong.
pub fn parse(s: &str) -> Result<Destination, &'static str> {
    if s.is_empty() || s.len() > 300 {
        return Err("destination empty or longer than 300 bytes");
    }
    let lower = s.to_ascii_lowercase();
    if let Some(rest) = lower.strip_prefix("outbound|") {
        return cluster(rest);
    }
    if let Some(ns) = lower.strip_suffix(SOCKET_SUFFIX) {
        return socket(ns);
    }
    Err("not outbound|<port>||<fqdn> nor <namespace>--kube-apiserver-socket")
}

/// `<port>||<fqdn>`, after `outbound|`.
fn cluster(rest: &str) -> Result<Destination, &'static str> {
    let mut parts = rest.split('|');
    let (Some(port), Some(subset), Some(host), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err("expected outbound|<port>||<fqdn>");
    };
    if !subset.is_empty() {
        return Err("a cluster subset is not supported");
    }
    if port.is_empty()
        || port.len() > 5
        || port.starts_with('0')
        || !port.bytes().all(|b| b.is_ascii_digit())
    {
        return Err("invalid port");
    }
    let port: u16 = port.parse().map_err(|_| "port out of range")?;
    if !is_dns_name(host) {
        return Err("invalid service host name");
    }
    Ok(Destination::Cluster {
        port,
        host: host.to_string(),
    })
}

/// `<namespace>`, before `--kube-apiserver-socket`.
fn socket(ns: &str) -> Result<Destination, &'static str> {
    if ns.is_empty()
        || ns.len() > 63
        || !ns
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        || ns.starts_with('-')
        || ns.ends_with('-')
    {
        return Err("invalid namespace");
    }
    Ok(Destination::ApiserverSocket {
        namespace: ns.to_string(),
    })
}

fn is_dns_name(h: &str) -> bool {
    !h.is_empty()
        && h.len() <= 253
        && h.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepted_shapes() {
        assert_eq!(
            parse("outbound|443||kube-apiserver.shoot--p--n.svc.cluster.local"),
            Ok(Destination::Cluster {
                port: 443,
                host: "kube-apiserver.shoot--p--n.svc.cluster.local".into()
            })
        );
        let d = parse("OUTBOUND|1194||VPN-Seed-Server-0.shoot--p--n.svc.cluster.local").unwrap();
        assert_eq!(
            d.canonical(),
            "outbound|1194||vpn-seed-server-0.shoot--p--n.svc.cluster.local"
        );
        assert_eq!(
            parse("shoot--p--n--kube-apiserver-socket"),
            Ok(Destination::ApiserverSocket {
                namespace: "shoot--p--n".into()
            })
        );
        assert!(parse("shoot-legacy-name--kube-apiserver-socket").is_ok());
    }

    #[test]
    fn rejected_shapes() {
        for bad in [
            "",
            "outbound|443|subset|kube-apiserver.ns.svc.cluster.local",
            "outbound|0443||a.b",
            "outbound|0||a.b",
            "outbound|65536||a.b",
            "outbound|443||",
            "outbound|443||a..b",
            "outbound|443||a.b|x",
            "outbound|443||-a.b",
            "inbound|443||a.b",
            "--kube-apiserver-socket",
            "ns_x--kube-apiserver-socket",
            "-ns--kube-apiserver-socket",
            "kube-apiserver.ns.svc.cluster.local:443",
        ] {
            assert!(parse(bad).is_err(), "{bad:?} accepted");
        }
    }
}

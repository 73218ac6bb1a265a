//! Layer 1, the wire: what crosses between the peers, as pure data. No IO,
//! no clock.

pub mod dial_error;
pub mod proto;
pub mod socks5;

/// Most replicas a REPLICAS packet may name: an agent keeps no more (a
/// server cannot make it hold or dial without bound).
pub const MAX_REPLICA_ADDRESSES: usize = 32;

/// Whether `address` is a `host:port` an agent can connect to: a host (a
/// name, an IPv4 address, or an IPv6 one in brackets) of at most 253
/// characters with no space or control character, and a port from 1.
pub fn replica_address_ok(address: &str) -> bool {
    let Some((host, port)) = address.rsplit_once(':') else {
        return false;
    };
    let host_ok = match host.strip_prefix('[') {
        Some(v6) => v6
            .strip_suffix(']')
            .is_some_and(|ip| ip.parse::<std::net::Ipv6Addr>().is_ok()),
        None => {
            !host.is_empty()
                && host.len() <= 253
                && host
                    .chars()
                    .all(|c| c.is_ascii_graphic() && !matches!(c, '/' | '@' | '[' | ']' | ':'))
        }
    };
    host_ok && port.parse::<u16>().is_ok_and(|p| p > 0)
}

#[cfg(test)]
mod tests {
    #[test]
    fn replica_addresses_are_host_and_port() {
        for ok in [
            "10.0.0.1:8091",
            "[fd00::1]:8091",
            "seedlink-0.tunnel.example.com:443",
        ] {
            assert!(super::replica_address_ok(ok), "{ok}");
        }
        for bad in [
            "",
            "10.0.0.1",
            "10.0.0.1:0",
            "10.0.0.1:99999",
            ":8091",
            "[fd00::1:8091",
            "fd00::1:8091",
            "a b:1",
            "user@host:1",
            "host/x:1",
            "[nope]:1",
        ] {
            assert!(!super::replica_address_ok(bad), "{bad}");
        }
        assert!(!super::replica_address_ok(&format!(
            "{}:1",
            "a".repeat(254)
        )));
    }
}

//! SOCKS5 frontend (RFC 1928 `CONNECT`, RFC 1929 username/password), for
//! control-plane components other than kube-apiserver that speak SOCKS
//! (HyperShift gives its components a SOCKS5 sidecar in front of
//! Konnectivity). A host name is passed to the agent as it came, so it is
//! resolved in the shoot, and the agent's destination policy is applied to
//! every address it resolves to.
//!
//! Hand-written: the SOCKS5 server crates either connect to the target
//! themselves (here the target is dialled by an agent over the tunnel) or
//! bring their own runtime glue; the CONNECT subset is a few fixed-size
//! reads, done here with a deadline and bounds on every length.

use std::net::{Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::core::Core;
use super::frontend::{dial_and_carry, FrontendEnd, FrontendIo, ProxyCluster, Reply};
use super::Cluster;

use crate::wire::socks5::{rep, reply, NO_AUTH, NO_METHOD, USER_PASS, VERSION};

/// Serves one SOCKS5 connection: the cluster is the frontend's, or named by
/// the username (its password is the cluster's `proxy_password_file`).
/// Returns the cluster's name ("" if none was chosen) and the outcome.
pub async fn serve_socks5<S>(
    srv: &Core,
    choice: ProxyCluster<'_>,
    mut io: S,
) -> (String, FrontendEnd)
where
    S: FrontendIo,
{
    let negotiated = tokio::time::timeout(
        srv.settings.handshake_timeout,
        negotiate(srv, choice, &mut io),
    )
    .await;
    let (cluster, target) = match negotiated {
        Ok(Ok(pair)) => pair,
        Ok(Err((name, why))) => {
            let _ = tokio::time::timeout(std::time::Duration::from_secs(5), io.shutdown()).await;
            return (name, why);
        }
        Err(_) => return (String::new(), FrontendEnd::HeadTimeout),
    };
    let name = cluster.name.to_string();
    let out = dial_and_carry(srv, &cluster, io, &target, BytesMut::new(), Reply::Socks5).await;
    (name, out)
}

type Negotiated = Result<(Arc<Cluster>, String), (String, FrontendEnd)>;

async fn read_n<S: AsyncRead + Unpin>(io: &mut S, n: usize) -> Result<Vec<u8>, FrontendEnd> {
    let mut b = vec![0u8; n];
    io.read_exact(&mut b)
        .await
        .map_err(|_| FrontendEnd::Closed)?;
    Ok(b)
}

async fn negotiate<S>(srv: &Core, choice: ProxyCluster<'_>, io: &mut S) -> Negotiated
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let none = |why| (String::new(), why);
    let greeting = read_n(io, 2).await.map_err(none)?;
    if greeting[0] != VERSION {
        return Err(none(FrontendEnd::NotSocks5));
    }
    let methods = read_n(io, usize::from(greeting[1])).await.map_err(none)?;
    let want = match choice {
        ProxyCluster::Fixed(_) => NO_AUTH,
        ProxyCluster::ByCredentials => USER_PASS,
    };
    if !methods.contains(&want) {
        let _ = io.write_all(&[VERSION, NO_METHOD]).await;
        return Err(none(FrontendEnd::SocksNoMethod));
    }
    io.write_all(&[VERSION, want])
        .await
        .map_err(|_| none(FrontendEnd::WriteError))?;
    let cluster = match choice {
        ProxyCluster::Fixed(c) => c.clone(),
        ProxyCluster::ByCredentials => authenticate(srv, io).await.map_err(none)?,
    };
    let name = cluster.name.to_string();
    let target = request(io).await.map_err(|why| (name, why))?;
    Ok((cluster, target))
}

/// RFC 1929 username/password (VER=1, ULEN, UNAME, PLEN, PASSWD): the
/// cluster whose proxy credentials they are.
async fn authenticate<S>(srv: &Core, io: &mut S) -> Result<Arc<Cluster>, FrontendEnd>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let head = read_n(io, 2).await?;
    if head[0] != 1 {
        return Err(FrontendEnd::NotSocks5);
    }
    let user = read_n(io, usize::from(head[1])).await?;
    let plen = read_n(io, 1).await?;
    let pass = read_n(io, usize::from(plen[0])).await?;
    let found = match (std::str::from_utf8(&user), std::str::from_utf8(&pass)) {
        (Ok(u), Ok(p)) => srv.registry.cluster_for_credentials(u, p),
        _ => None,
    };
    match found {
        Some(c) => {
            io.write_all(&[1, 0])
                .await
                .map_err(|_| FrontendEnd::WriteError)?;
            Ok(c)
        }
        None => {
            let _ = io.write_all(&[1, 1]).await;
            Err(FrontendEnd::ProxyAuthRequired)
        }
    }
}

/// The destination host of address type `atyp` (IPv4, IPv6 in
/// brackets, a host name), or why not (answered).
async fn read_host<S>(io: &mut S, atyp: u8) -> Result<String, FrontendEnd>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    match atyp {
        1 => {
            let a = read_n(io, 4).await?;
            Ok(Ipv4Addr::new(a[0], a[1], a[2], a[3]).to_string())
        }
        4 => {
            let a = read_n(io, 16).await?;
            let mut o = [0u8; 16];
            o.copy_from_slice(&a);
            Ok(format!("[{}]", Ipv6Addr::from(o)))
        }
        3 => {
            let len = read_n(io, 1).await?;
            let name = read_n(io, usize::from(len[0])).await?;
            if let Some(h) = host_name(&name) {
                return Ok(h);
            }
            let _ = reply(io, rep::HOST_UNREACHABLE).await;
            Err(FrontendEnd::BadTarget)
        }
        _ => {
            let _ = reply(io, rep::ADDRESS_TYPE).await;
            Err(FrontendEnd::BadTarget)
        }
    }
}

/// The request (VER, CMD, RSV, ATYP, DST.ADDR, DST.PORT): its target as
/// `host:port`, or the refusal (answered with its reply code).
async fn request<S>(io: &mut S) -> Result<String, FrontendEnd>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let req = read_n(io, 4).await?;
    if req[0] != VERSION {
        return Err(FrontendEnd::NotSocks5);
    }
    if req[1] != 1 {
        // BIND and UDP ASSOCIATE: a tunnel to the shoot carries outbound
        // TCP connections only.
        let _ = reply(io, rep::COMMAND).await;
        return Err(FrontendEnd::SocksCommand);
    }
    let host = read_host(io, req[3]).await?;
    let port = read_n(io, 2).await?;
    let port = u16::from_be_bytes([port[0], port[1]]);
    if port == 0 {
        let _ = reply(io, rep::HOST_UNREACHABLE).await;
        return Err(FrontendEnd::BadTarget);
    }
    Ok(format!("{host}:{port}"))
}

/// A DNS name as sent in a SOCKS request: letters, digits, `-`, `_`, `.`,
/// not empty (an absolute name's trailing dot is kept for the agent's
/// resolver).
fn host_name(raw: &[u8]) -> Option<String> {
    let ok = !raw.is_empty()
        && raw
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    ok.then(|| String::from_utf8_lossy(raw).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_names_are_plain_dns_names() {
        assert_eq!(
            host_name(b"web.default.svc.cluster.local.").as_deref(),
            Some("web.default.svc.cluster.local.")
        );
        assert_eq!(host_name(b"my_host-1"), Some("my_host-1".into()));
        for bad in [&b""[..], b"a:80", b"a b", b"a/b", b"\xff", b"[::1]"] {
            assert_eq!(host_name(bad), None, "{bad:?}");
        }
    }
}

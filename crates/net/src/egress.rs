//! A corporate egress (forward) proxy: leaving a private network by an
//! HTTP/1.1 `CONNECT host:port` through it, optionally with `Basic`
//! credentials, spoken in cleartext (`http://`) or inside TLS to the proxy
//! (`https://`, the proxy's certificate checked against a CA file or the
//! system's trust store). Used by the node-proxy (to the gateway) and the
//! tunnel-agent (to the tunnel-server).
//!
//! Hand-written on `httparse` for the answer: no maintained crate dials
//! through an HTTP CONNECT proxy on a plain tokio `TcpStream` with the
//! bounds and outcomes needed here (hyper's client proxies requests, not
//! raw tunnels).

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;

/// The largest proxy answer head read.
const MAX_ANSWER_HEAD: usize = 16 * 1024;

/// An egress proxy: where it is, and the `Proxy-Authorization` to send.
/// Its `Debug` never shows the credentials.
#[derive(Clone)]
pub struct EgressProxy {
    /// `host:port` of the proxy.
    pub address: String,
    /// The `Proxy-Authorization` value (`Basic …`), if credentials are set:
    /// as read at the start, and, with `credentials_file`, the last value
    /// the file held that parsed.
    pub authorization: Option<String>,
    /// Where the credentials are read from, again for every tunnel: a
    /// rotated password is used from the next connection on, without a
    /// restart (a read that fails or does not parse keeps the last good
    /// value, and says so).
    pub credentials_file: Option<std::path::PathBuf>,
    /// The last good value read from `credentials_file`, and the last
    /// failure logged.
    latest: Arc<std::sync::Mutex<Latest>>,
    /// For an `https://` proxy: the TLS settings and the name its
    /// certificate must hold.
    tls: Option<ProxyTls>,
}

/// TLS to the proxy itself.
#[derive(Clone)]
struct ProxyTls {
    config: Arc<rustls::ClientConfig>,
    name: rustls::pki_types::ServerName<'static>,
    /// The CA file the proxy is checked against (`None`: the system's
    /// trust store).
    ca_file: Option<std::path::PathBuf>,
}

/// What the credentials file last gave.
#[derive(Default)]
struct Latest {
    value: Option<String>,
    failure: Option<String>,
}

/// The most bytes a credentials file is read for (one `user:password`
/// line).
const MAX_CREDENTIALS: u64 = 4096;

/// The credentials file's text: a regular file (not a FIFO or a device,
/// which could stall or never end), at most [`MAX_CREDENTIALS`] bytes.
fn read_credentials(p: &std::path::Path) -> Result<String, String> {
    use std::io::Read;
    let f = std::fs::File::open(p).map_err(|e| e.to_string())?;
    let meta = f.metadata().map_err(|e| e.to_string())?;
    if !meta.is_file() {
        return Err("not a regular file".into());
    }
    if meta.len() > MAX_CREDENTIALS {
        return Err(format!("longer than {MAX_CREDENTIALS} bytes"));
    }
    let mut text = String::new();
    f.take(MAX_CREDENTIALS)
        .read_to_string(&mut text)
        .map_err(|e| e.to_string())?;
    Ok(text)
}

/// Whether `p` reads and parses as a credentials file; the error names
/// the file.
pub fn check_credentials_file(p: &std::path::Path) -> Result<(), String> {
    read_credentials(p)
        .and_then(|t| basic(&t))
        .map(drop)
        .map_err(|e| format!("{}: {e}", p.display()))
}

impl PartialEq for EgressProxy {
    /// With a credentials file, its path (what it holds changes by itself);
    /// else the credentials given.
    fn eq(&self, other: &Self) -> bool {
        let creds = |p: &EgressProxy| match &p.credentials_file {
            Some(f) => (Some(f.clone()), None),
            None => (None, p.authorization.clone()),
        };
        let tls = |p: &EgressProxy| p.tls.as_ref().map(|t| t.ca_file.clone());
        self.address == other.address && creds(self) == creds(other) && tls(self) == tls(other)
    }
}

impl Eq for EgressProxy {}

/// Why a tunnel through the proxy was not opened.
#[derive(Debug, thiserror::Error)]
pub enum EgressError {
    /// The proxy could not be reached.
    #[error("egress proxy {0} unreachable: {1}")]
    Unreachable(String, io::Error),
    /// 407 (or 401, tinyproxy's answer to wrong credentials).
    #[error("egress proxy refused our credentials ({0})")]
    Auth(u16),
    /// Any other non-200 answer.
    #[error("egress proxy refused the tunnel: {0}")]
    Refused(u16),
    /// Not an HTTP answer, too long, or bytes after a 200 (the far side
    /// never speaks first, so they are the proxy's).
    #[error("egress proxy answered something that is not an HTTP answer")]
    BadResponse,
    /// The proxy closed (or failed) before answering.
    #[error("egress proxy closed before answering")]
    Closed,
    /// TLS to an `https://` proxy failed (its certificate not trusted, or
    /// not for its name, or the handshake broke).
    #[error("TLS to egress proxy {0}: {1}")]
    Tls(String, io::Error),
}

impl EgressError {
    /// The metric label (`egress_proxy_…`).
    pub fn reason(&self) -> &'static str {
        match self {
            EgressError::Unreachable(..) => "egress_proxy_unreachable",
            EgressError::Auth(_) => "egress_proxy_auth_failed",
            EgressError::Refused(_) => "egress_proxy_refused",
            EgressError::BadResponse => "egress_proxy_bad_response",
            EgressError::Closed => "egress_proxy_closed",
            EgressError::Tls(..) => "egress_proxy_tls_failed",
        }
    }
}

impl std::fmt::Debug for EgressProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EgressProxy")
            .field("address", &self.address)
            .field("tls", &self.tls.is_some())
            .field(
                "authorization",
                &self.authorization.as_ref().map(|_| "<redacted>"),
            )
            .finish()
    }
}

impl EgressProxy {
    /// From `http://host:port`, `https://host:port` (checked against the
    /// system's trust store) or `host:port`, and, if given, the text of a
    /// credentials file (`user:password`).
    pub fn new(url: &str, credentials: Option<&str>) -> Result<EgressProxy, String> {
        Ok(EgressProxy {
            address: address_of(url)?,
            authorization: credentials.map(basic).transpose()?,
            credentials_file: None,
            latest: Default::default(),
            tls: proxy_tls(url, None)?,
        })
    }

    /// As [`EgressProxy::open`], with no CA file.
    pub fn with_file(url: &str, file: Option<&std::path::Path>) -> Result<EgressProxy, String> {
        EgressProxy::open(url, file, None)
    }

    /// From the proxy's URL, a credentials file (`user:password`) read now
    /// (an error if it cannot be read or parsed) and again for every
    /// tunnel, and, for an `https://` proxy, the CA file its certificate is
    /// checked against (the system's trust store without one).
    pub fn open(
        url: &str,
        file: Option<&std::path::Path>,
        ca_file: Option<&std::path::Path>,
    ) -> Result<EgressProxy, String> {
        let authorization = file
            .map(|p| {
                read_credentials(p)
                    .and_then(|t| basic(&t))
                    .map_err(|e| format!("{}: {e}", p.display()))
            })
            .transpose()?;
        Ok(EgressProxy {
            address: address_of(url)?,
            authorization,
            credentials_file: file.map(std::path::Path::to_path_buf),
            latest: Default::default(),
            tls: proxy_tls(url, ca_file)?,
        })
    }

    /// Whether the proxy is spoken to inside TLS.
    pub fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// The `Proxy-Authorization` to send now: the credentials file read
    /// again (a small regular file, once per tunnel, on tokio's blocking
    /// threads: a file that stalls holds up this tunnel alone), or, when
    /// that fails, the last good value; the failure is logged once until
    /// it changes or the file reads well again.
    pub async fn authorization_now(&self) -> Option<String> {
        let Some(p) = self.credentials_file.clone() else {
            return self.authorization.clone();
        };
        let read = tokio::task::spawn_blocking({
            let p = p.clone();
            move || read_credentials(&p).and_then(|t| basic(&t))
        })
        .await
        .unwrap_or_else(|e| Err(e.to_string()));
        let mut latest = crate::sync::lock(&self.latest, "egress credentials");
        match read {
            Ok(a) => {
                *latest = Latest {
                    value: Some(a.clone()),
                    failure: None,
                };
                Some(a)
            }
            Err(e) => {
                if latest.failure.as_deref() != Some(e.as_str()) {
                    tracing::warn!(file = %p.display(), error = %e, "egress proxy credentials not read; the last good ones are sent");
                    latest.failure = Some(e);
                }
                latest.value.clone().or_else(|| self.authorization.clone())
            }
        }
    }

    /// Connects to the proxy and asks it for a tunnel to `target`
    /// (`host:port`; the proxy resolves names). Unbounded in time: callers
    /// wrap it in their deadline.
    pub async fn connect(&self, target: &str) -> Result<EgressStream, EgressError> {
        let s = TcpStream::connect(&self.address)
            .await
            .map_err(|e| EgressError::Unreachable(self.address.clone(), e))?;
        self.over(s, target).await
    }

    /// On a connection to the proxy: TLS to it (for an `https://` proxy),
    /// then the CONNECT exchange. Unbounded in time, as `connect`.
    pub async fn over(&self, tcp: TcpStream, target: &str) -> Result<EgressStream, EgressError> {
        let _ = tcp.set_nodelay(true);
        let Some(tls) = &self.tls else {
            let mut s = tcp;
            self.handshake(&mut s, target).await?;
            return Ok(EgressStream::Plain(s));
        };
        let mut s = tokio_rustls::TlsConnector::from(tls.config.clone())
            .connect(tls.name.clone(), tcp)
            .await
            .map_err(|e| EgressError::Tls(self.address.clone(), e))?;
        self.handshake(&mut s, target).await?;
        Ok(EgressStream::Tls(Box::new(s)))
    }

    /// The CONNECT exchange on a connection to the proxy.
    async fn handshake<S>(&self, s: &mut S, target: &str) -> Result<(), EgressError>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        let auth = self
            .authorization_now()
            .await
            .map_or(String::new(), |a| format!("Proxy-Authorization: {a}\r\n"));
        let head = format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{auth}\r\n");
        s.write_all(head.as_bytes())
            .await
            .map_err(|_| EgressError::Closed)?;
        s.flush().await.map_err(|_| EgressError::Closed)?;
        let (code, rest) = read_answer(s).await?;
        match code {
            200 if rest == 0 => Ok(()),
            200 => Err(EgressError::BadResponse),
            401 | 407 => Err(EgressError::Auth(code)),
            c => Err(EgressError::Refused(c)),
        }
    }
}

/// The TLS settings for an `https://` proxy URL (`None` for `http://`):
/// the CA file's certificates, or the system's trust store.
fn proxy_tls(url: &str, ca_file: Option<&std::path::Path>) -> Result<Option<ProxyTls>, String> {
    if !url.starts_with("https://") {
        return match ca_file {
            Some(_) => Err("a CA file is for an https:// proxy only".into()),
            None => Ok(None),
        };
    }
    let address = address_of(url)?;
    let host = address
        .rsplit_once(':')
        .map_or(address.as_str(), |(h, _)| h)
        .trim_start_matches('[')
        .trim_end_matches(']');
    let name = rustls::pki_types::ServerName::try_from(host.to_string())
        .map_err(|_| format!("{host:?} is not a name or address a certificate can hold"))?;
    let roots = roots(ca_file)?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Some(ProxyTls {
        config: Arc::new(config),
        name,
        ca_file: ca_file.map(std::path::Path::to_path_buf),
    }))
}

/// The CAs a proxy's certificate is checked against: the CA file's, or
/// the system's trust store.
fn roots(ca_file: Option<&std::path::Path>) -> Result<rustls::RootCertStore, String> {
    let mut roots = rustls::RootCertStore::empty();
    let Some(p) = ca_file else {
        let found = rustls_native_certs::load_native_certs();
        let (added, _) = roots.add_parsable_certificates(found.certs);
        if added == 0 {
            return Err("no CA file given and the system's trust store is empty".into());
        }
        return Ok(roots);
    };
    use rustls::pki_types::pem::PemObject;
    let at = |e: &dyn std::fmt::Display| format!("{}: {e}", p.display());
    for c in rustls::pki_types::CertificateDer::pem_file_iter(p).map_err(|e| at(&e))? {
        roots.add(c.map_err(|e| at(&e))?).map_err(|e| at(&e))?;
    }
    if roots.is_empty() {
        return Err(at(&"holds no certificate"));
    }
    Ok(roots)
}

/// A tunnel through the proxy: a plain TCP connection, or one inside TLS
/// to an `https://` proxy (the tunnelled bytes are TLS of their own: TLS
/// inside TLS).
#[derive(Debug)]
pub enum EgressStream {
    /// Through an `http://` proxy.
    Plain(TcpStream),
    /// Through an `https://` proxy.
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
}

impl EgressStream {
    /// The TCP connection underneath.
    pub fn tcp(&self) -> &TcpStream {
        match self {
            EgressStream::Plain(s) => s,
            EgressStream::Tls(s) => s.get_ref().0,
        }
    }
}

impl AsyncRead for EgressStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            EgressStream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            EgressStream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for EgressStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            EgressStream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            EgressStream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            EgressStream::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            EgressStream::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            EgressStream::Plain(s) => s.is_write_vectored(),
            EgressStream::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            EgressStream::Plain(s) => Pin::new(s).poll_flush(cx),
            EgressStream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            EgressStream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            EgressStream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// Reads an answer head: its status, and how many bytes came after it (the
/// far sides here never speak first, so any such byte is the proxy's).
async fn read_answer<S: AsyncRead + Unpin>(s: &mut S) -> Result<(u16, usize), EgressError> {
    let mut buf: Vec<u8> = Vec::with_capacity(256);
    let mut chunk = [0u8; 1024];
    loop {
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut resp = httparse::Response::new(&mut headers);
        match resp.parse(&buf) {
            Ok(httparse::Status::Complete(n)) => {
                return Ok((resp.code.unwrap_or(0), buf.len() - n));
            }
            Ok(httparse::Status::Partial) => {}
            Err(_) => return Err(EgressError::BadResponse),
        }
        if buf.len() >= MAX_ANSWER_HEAD {
            return Err(EgressError::BadResponse);
        }
        match s.read(&mut chunk).await {
            Ok(0) | Err(_) => return Err(EgressError::Closed),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

/// `http://host:port`, `https://host:port` or `host:port` → `host:port`.
/// No credentials in the URL, no path.
pub fn address_of(url: &str) -> Result<String, String> {
    let rest = match url.split_once("://") {
        Some(("http" | "https", rest)) => rest,
        Some((scheme, _)) => {
            return Err(format!(
                "{scheme}:// is not supported; the proxy is spoken to over http:// or https://"
            ))
        }
        None => url,
    };
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    if rest.contains('@') {
        return Err(
            "credentials do not belong in the URL; put user:password in the credentials file"
                .into(),
        );
    }
    if rest.contains('/') || rest.contains('?') {
        return Err("must be http(s)://host:port with no path".into());
    }
    match rest.rsplit_once(':') {
        Some((h, p)) if !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p != 0) => {
            Ok(rest.to_string())
        }
        _ => Err("must be http(s)://host:port".into()),
    }
}

/// `Basic` credentials from `user:password` (one line; the password may
/// hold colons, the user may not, neither may be empty).
pub fn basic(credentials: &str) -> Result<String, String> {
    use base64::Engine;
    let line = credentials.trim_end_matches(['\n', '\r']);
    if line.contains(['\n', '\r']) {
        return Err("must be one line, user:password".into());
    }
    match line.split_once(':') {
        Some((user, pass)) if !user.is_empty() && !pass.is_empty() => Ok(format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(line)
        )),
        _ => Err("must be user:password, neither empty".into()),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn urls_and_credentials_are_checked() {
        assert_eq!(address_of("http://proxy:3128").unwrap(), "proxy:3128");
        assert_eq!(address_of("proxy:3128/").unwrap(), "proxy:3128");
        assert_eq!(address_of("https://proxy:3129").unwrap(), "proxy:3129");
        assert!(address_of("socks5://proxy:1080")
            .unwrap_err()
            .contains("socks5://"));
        let ca = Some(std::path::Path::new("/nonexistent/ca.pem"));
        assert!(EgressProxy::open("http://proxy:3128", None, ca)
            .unwrap_err()
            .contains("https:// proxy only"));
        assert!(EgressProxy::open("https://proxy:3128", None, ca).is_err());
        assert!(address_of("http://u:p@proxy:3128")
            .unwrap_err()
            .contains("credentials"));
        assert!(address_of("http://proxy:3128/x").is_err());
        assert!(address_of("http://proxy:0").is_err());
        assert!(address_of("http://proxy").is_err());
        assert_eq!(basic("user:pa:ss\n").unwrap(), "Basic dXNlcjpwYTpzcw==");
        assert!(basic(":x").is_err());
        assert!(basic("a:b\nc").is_err());
        assert!(basic("nocolon").is_err());
        let p = EgressProxy::new("proxy:3128", Some("user:s3cret")).unwrap();
        let shown = format!("{p:?}");
        assert!(
            !shown.contains("dXNlcjpzM2NyZXQ") && shown.contains("redacted"),
            "{shown}"
        );
    }

    /// A credentials file is read again for every tunnel: a rotation is
    /// sent from then on; a file that no longer reads or parses leaves the
    /// last good value.
    #[tokio::test]
    async fn rotated_credentials_are_sent_from_the_next_tunnel() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("creds");
        std::fs::write(&f, "user:one\n").unwrap();
        let p = EgressProxy::with_file("proxy:3128", Some(&f)).unwrap();
        assert_eq!(p.authorization_now().await, basic("user:one").ok());
        std::fs::write(&f, "user:two\n").unwrap();
        assert_eq!(p.authorization_now().await, basic("user:two").ok());
        std::fs::write(&f, "").unwrap();
        assert_eq!(p.authorization_now().await, basic("user:two").ok());
        std::fs::write(&f, "x".repeat(5000)).unwrap();
        assert_eq!(p.authorization_now().await, basic("user:two").ok());
        std::fs::remove_file(&f).unwrap();
        assert_eq!(p.authorization_now().await, basic("user:two").ok());
        assert!(EgressProxy::with_file("proxy:3128", Some(&f)).is_err());
        // Not a regular file: refused, never read.
        let zero = Some(std::path::Path::new("/dev/zero"));
        let e = EgressProxy::with_file("proxy:3128", zero).unwrap_err();
        assert!(e.contains("not a regular file"), "{e}");
    }

    async fn answering(answer: &'static [u8]) -> String {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut b = [0u8; 1024];
            let _ = s.read(&mut b).await;
            let _ = s.write_all(answer).await;
        });
        addr
    }

    #[tokio::test]
    async fn each_answer_is_told_apart() {
        for (answer, want) in [
            (
                &b"HTTP/1.1 407 Proxy Authentication Required\r\n\r\n"[..],
                "egress_proxy_auth_failed",
            ),
            (b"HTTP/1.1 403 Forbidden\r\n\r\n", "egress_proxy_refused"),
            (b"HTTP/1.1 200 OK\r\n\r\nextra", "egress_proxy_bad_response"),
            (b"not http at all\r\n\r\n", "egress_proxy_bad_response"),
            (b"HTTP/1.1 200 Conn", "egress_proxy_closed"),
        ] {
            let p = EgressProxy::new(&answering(answer).await, None).unwrap();
            let e = p.connect("seed.example:443").await.unwrap_err();
            assert_eq!(e.reason(), want, "{answer:?}");
        }
        let p = EgressProxy::new(&answering(b"HTTP/1.1 200 OK\r\n\r\n").await, None).unwrap();
        assert!(p.connect("seed.example:443").await.is_ok());
    }
}

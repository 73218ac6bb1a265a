//! Demo PKI, demo kube-apiserver stand-ins and a TLS client, all in-process.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, Context};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// ALPN protocols the demo servers accept, so tests can see ALPN pass
/// through the gateway untouched.
pub const DEMO_ALPN: &[&[u8]] = &[b"http/1.1", b"seedlink-demo"];

/// A certificate and its private key, in PEM and DER.
pub struct Leaf {
    /// PEM certificate.
    pub cert_pem: String,
    /// PEM PKCS#8 key.
    pub key_pem: String,
    der: CertificateDer<'static>,
    key_der: Vec<u8>,
}

/// A demo CA with one server certificate per host and one client certificate.
pub struct Pki {
    /// PEM of the CA certificate (trust anchor for both sides).
    pub ca_pem: String,
    ca_der: CertificateDer<'static>,
    /// Server certificates, one per host name, in the order given.
    pub servers: Vec<(String, Leaf)>,
    /// A client certificate (CN `seedlink-demo-user`, O `system:masters`).
    pub client: Leaf,
}

fn crypto() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

impl Pki {
    /// Generates a fresh CA, server certificates for `hosts` and a client certificate.
    pub fn generate(hosts: &[&str]) -> anyhow::Result<Pki> {
        Pki::generate_with_client(hosts, "seedlink-demo-user")
    }

    /// The same, the client certificate's CN `client_cn` (a shared
    /// tunnel frontend reads the cluster from it).
    pub fn generate_with_client(hosts: &[&str], client_cn: &str) -> anyhow::Result<Pki> {
        let ca_key = KeyPair::generate()?;
        let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "seedlink demo CA");
        let ca_cert = ca_params.self_signed(&ca_key)?;
        let issuer = Issuer::new(ca_params, ca_key);
        let leaf = |names: Vec<String>, cn: &str, client: bool| -> anyhow::Result<Leaf> {
            let key = KeyPair::generate()?;
            let mut p = CertificateParams::new(names)?;
            p.distinguished_name.push(DnType::CommonName, cn);
            if client {
                p.distinguished_name
                    .push(DnType::OrganizationName, "system:masters");
                p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
            } else {
                p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
            }
            let cert = p.signed_by(&key, &issuer)?;
            Ok(Leaf {
                cert_pem: cert.pem(),
                key_pem: key.serialize_pem(),
                der: cert.der().clone(),
                key_der: key.serialize_der(),
            })
        };
        let mut servers = Vec::new();
        for h in hosts {
            servers.push((h.to_string(), leaf(vec![h.to_string()], h, false)?));
        }
        let client = leaf(Vec::new(), client_cn, true)?;
        Ok(Pki {
            ca_pem: ca_cert.pem(),
            ca_der: ca_cert.der().clone(),
            servers,
            client,
        })
    }

    /// Writes `ca.pem`, `client.pem`, `client-key.pem` into `dir`.
    pub fn write_client_files(&self, dir: &Path) -> anyhow::Result<ClientFiles> {
        let files = ClientFiles {
            ca: dir.join("ca.pem"),
            cert: dir.join("client.pem"),
            key: dir.join("client-key.pem"),
        };
        std::fs::write(&files.ca, &self.ca_pem)?;
        std::fs::write(&files.cert, &self.client.cert_pem)?;
        std::fs::write(&files.key, &self.client.key_pem)?;
        Ok(files)
    }

    /// Writes server `i`'s certificate and key as `server-<i>.pem` and
    /// `server-<i>-key.pem` into `dir` (for a peer such as nginx to serve).
    pub fn write_server_files(&self, i: usize, dir: &Path) -> anyhow::Result<(PathBuf, PathBuf)> {
        let (_, leaf) = self
            .servers
            .get(i)
            .ok_or_else(|| anyhow!("no server {i}"))?;
        let cert = dir.join(format!("server-{i}.pem"));
        let key = dir.join(format!("server-{i}-key.pem"));
        std::fs::write(&cert, &leaf.cert_pem)?;
        std::fs::write(&key, &leaf.key_pem)?;
        Ok((cert, key))
    }

    fn roots(&self) -> anyhow::Result<rustls::RootCertStore> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.ca_der.clone())?;
        Ok(roots)
    }

    /// A rustls server config for host `i` that requires a client
    /// certificate issued by the demo CA.
    pub fn server_config(&self, i: usize) -> anyhow::Result<rustls::ServerConfig> {
        let (_, leaf) = self
            .servers
            .get(i)
            .ok_or_else(|| anyhow!("no server {i}"))?;
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            Arc::new(self.roots()?),
            crypto(),
        )
        .build()?;
        let mut cfg = rustls::ServerConfig::builder_with_provider(crypto())
            .with_safe_default_protocol_versions()?
            .with_client_cert_verifier(verifier)
            .with_single_cert(vec![leaf.der.clone()], key(leaf))?;
        cfg.alpn_protocols = DEMO_ALPN.iter().map(|p| p.to_vec()).collect();
        Ok(cfg)
    }

    /// A rustls client config trusting the demo CA, presenting the client
    /// certificate when `with_cert`, offering `alpn`.
    pub fn client_config(
        &self,
        with_cert: bool,
        alpn: &[&[u8]],
    ) -> anyhow::Result<rustls::ClientConfig> {
        let b = rustls::ClientConfig::builder_with_provider(crypto())
            .with_safe_default_protocol_versions()?
            .with_root_certificates(self.roots()?);
        let mut cfg = if with_cert {
            b.with_client_auth_cert(vec![self.client.der.clone()], key(&self.client))?
        } else {
            b.with_no_client_auth()
        };
        cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Ok(cfg)
    }
}

fn key(leaf: &Leaf) -> PrivateKeyDer<'static> {
    PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(leaf.key_der.clone()))
}

/// Paths of the client-side PEM files.
#[derive(Debug, Clone)]
pub struct ClientFiles {
    /// CA certificate.
    pub ca: PathBuf,
    /// Client certificate.
    pub cert: PathBuf,
    /// Client key.
    pub key: PathBuf,
}

/// Serves HTTPS on `listener` as a stand-in kube-apiserver called `name`:
/// TLS with a required client certificate; every request is answered with
/// one line naming the server, the SNI it saw and the negotiated ALPN, then
/// the connection is closed. Runs until `stop` fires.
pub async fn serve_demo_apiserver(
    listener: TcpListener,
    name: String,
    config: rustls::ServerConfig,
    stop: CancellationToken,
) {
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    loop {
        let (stream, _) = tokio::select! {
            () = stop.cancelled() => return,
            r = listener.accept() => match r {
                Ok(s) => s,
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let acceptor = acceptor.clone();
        let name = name.clone();
        tokio::spawn(async move {
            let _ = tokio::time::timeout(Duration::from_secs(30), answer(acceptor, stream, &name))
                .await;
        });
    }
}

/// Reads a request head (at most 16 KiB) and forgets it.
async fn read_head(tls: &mut (impl tokio::io::AsyncRead + Unpin)) -> anyhow::Result<()> {
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 16 * 1024 {
        let n = tls.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
    }
    Ok(())
}

async fn answer(
    acceptor: tokio_rustls::TlsAcceptor,
    stream: TcpStream,
    name: &str,
) -> anyhow::Result<()> {
    let mut tls = acceptor.accept(stream).await?;
    let (_, conn) = tls.get_ref();
    let sni = conn.server_name().unwrap_or("-").to_string();
    let alpn = conn
        .alpn_protocol()
        .map(|p| String::from_utf8_lossy(p).into_owned())
        .unwrap_or_else(|| "-".into());
    let client_certs = conn.peer_certificates().map_or(0, |c| c.len());
    read_head(&mut tls).await?;
    let body = format!("hello from {name}: sni={sni} alpn={alpn} client_certs={client_certs}\n");
    let resp = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    tls.write_all(resp.as_bytes()).await?;
    tls.shutdown().await?;
    Ok(())
}

/// Makes one HTTPS GET through `addr` with SNI `host`, returning the body.
pub async fn https_get(
    addr: std::net::SocketAddr,
    host: &str,
    config: rustls::ClientConfig,
) -> anyhow::Result<String> {
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let stream = TcpStream::connect(addr)
        .await
        .with_context(|| format!("connect {addr}"))?;
    let name = ServerName::try_from(host.to_string())?;
    let mut tls = connector
        .connect(name, stream)
        .await
        .context("TLS handshake")?;
    tls.write_all(
        format!("GET / HTTP/1.1\r\nhost: {host}\r\nconnection: close\r\n\r\n").as_bytes(),
    )
    .await?;
    let mut out = Vec::new();
    tls.read_to_end(&mut out)
        .await
        .context("reading the response")?;
    let text = String::from_utf8_lossy(&out).into_owned();
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .ok_or_else(|| anyhow!("no HTTP response"))?;
    Ok(body)
}

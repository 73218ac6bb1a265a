//! Connecting to one server replica: TLS with SNI and ALPN, then either
//! HTTP/2 with gRPC's `AgentService/Connect` or the native transport's OPEN,
//! and the server's answer (its ID and replica count). Why an attempt failed
//! is a [`ConnectError`].

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use seedlink_net::egress::EgressStream;
use tokio::net::TcpStream;

use super::core::Agent;
use super::link_driver::Inbound;
use crate::stream::flow::{self, FairQueue};
use crate::transport::grpc::{self};
use crate::transport::readahead::ReadAhead;
use crate::wire::proto::{Packet, AGENT_CONNECT_PATH};

/// Why one connection attempt to a server failed; [`ConnectError::reason`]
/// is the `reason` label of `server_connect_errors_total`.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// TCP connect failed.
    #[error("connecting to {server}: {error}")]
    Connect {
        /// `host:port`.
        server: String,
        /// Why.
        error: std::io::Error,
    },
    /// TCP connect took longer than the deadline.
    #[error("connecting to {0}: timed out")]
    ConnectTimeout(String),
    /// The TLS server name is not a valid name.
    #[error("server name {0:?} is not a valid TLS name")]
    ServerName(String),
    /// The TLS handshake failed.
    #[error("TLS handshake: {0}")]
    Tls(std::io::Error),
    /// The TLS handshake took longer than the deadline.
    #[error("TLS handshake timed out")]
    TlsTimeout,
    /// The HTTP/2 handshake failed.
    #[error("HTTP/2 handshake: {0}")]
    Http2(hyper::Error),
    /// The ServiceAccount token could not be read.
    #[error("reading the token {path}: {error}")]
    Token {
        /// The file.
        path: String,
        /// Why.
        error: std::io::Error,
    },
    /// The egress proxy did not open a tunnel to the server.
    #[error("{0}")]
    EgressProxy(seedlink_net::egress::EgressError),
    /// The egress proxy did not answer in time.
    #[error("egress proxy did not answer")]
    EgressProxyTimeout,
    /// The server did not answer the stream in time.
    #[error("server did not answer")]
    NoAnswer,
    /// The server refused the stream (e.g. unknown certificate or token).
    #[error("server refused the stream: {0}")]
    Refused(String),
    /// The answer lacked `serverid`/`servercount` or had them twice.
    #[error("server answer: {0}")]
    BadAnswer(String),
    /// The native transport's handshake failed.
    #[error("seedlink-tunnel/1 handshake: {0}")]
    Native(crate::transport::native::WireError),
}

impl ConnectError {
    /// The metric label.
    pub fn reason(&self) -> &'static str {
        match self {
            ConnectError::Connect { .. } => "connect_error",
            ConnectError::ConnectTimeout(_) => "connect_timeout",
            ConnectError::ServerName(_) => "bad_server_name",
            ConnectError::Tls(_) => "tls_error",
            ConnectError::TlsTimeout => "tls_timeout",
            ConnectError::Http2(_) => "http2_error",
            ConnectError::Token { .. } => "token_unreadable",
            ConnectError::EgressProxy(e) => e.reason(),
            ConnectError::EgressProxyTimeout => "egress_proxy_timeout",
            ConnectError::NoAnswer => "no_answer",
            ConnectError::Refused(_) => "refused",
            ConnectError::BadAnswer(_) => "bad_answer",
            ConnectError::Native(_) => "native_error",
        }
    }

    /// The attempt waited out a deadline (packets unanswered: a partition
    /// or a frozen server) rather than being refused.
    pub fn timed_out(&self) -> bool {
        matches!(
            self,
            ConnectError::ConnectTimeout(_)
                | ConnectError::TlsTimeout
                | ConnectError::NoAnswer
                | ConnectError::EgressProxyTimeout
        )
    }
}

/// What a server's answer says.
pub(super) struct Answer {
    /// `serverid` (exactly one).
    pub(super) server_id: String,
    /// `servercount` (exactly one).
    pub(super) count: i64,
    /// It agreed to per-connection flow control.
    pub(super) flow: bool,
    /// It will tell us when the number of replicas changes.
    pub(super) replicas: bool,
    /// The pod it runs in (`seedlink-pod`), if it says.
    pub(super) pod: Option<String>,
}

/// What a server's answer says: `serverid`, `servercount` (exactly one
/// each) and the extensions it agreed to.
pub(super) fn answer(meta: &tonic::metadata::MetadataMap) -> Result<Answer, ConnectError> {
    let one = |k: &str| -> Result<String, ConnectError> {
        let v: Vec<_> = meta.get_all(k).iter().collect();
        match v.as_slice() {
            [one] => one
                .to_str()
                .map(str::to_string)
                .map_err(|_| ConnectError::BadAnswer(format!("{k} is not ASCII"))),
            _ => Err(ConnectError::BadAnswer(format!(
                "expected one {k} header, got {}",
                v.len()
            ))),
        }
    };
    let server_id = one("serverid")?;
    let count: i64 = one("servercount")?
        .parse()
        .map_err(|_| ConnectError::BadAnswer("servercount is not a number".into()))?;
    let agreed = |h: &str, v: &str| meta.get(h).and_then(|x| x.to_str().ok()) == Some(v);
    Ok(Answer {
        server_id,
        count,
        flow: agreed(flow::HEADER, flow::VERSION),
        replicas: agreed(
            crate::wire::proto::REPLICAS_HEADER,
            crate::wire::proto::REPLICAS_VERSION,
        ),
        pod: meta
            .get(crate::wire::proto::POD_HEADER)
            .and_then(|v| v.to_str().ok())
            .filter(|p| !p.is_empty() && p.len() <= 253)
            .map(str::to_string),
    })
}

/// A connection to a server, ready for the stream.
pub(super) enum Channel {
    /// HTTP/2 (gRPC), with its GOAWAY sniffer.
    Grpc(grpc::Client, crate::transport::goaway::Seen),
    /// The native transport.
    Native(Box<crate::transport::usertls::UserTls<EgressStream>>),
}

/// Closes a stream's outbound queue when dropped, unless taken out: a
/// queue that is never closed would keep the request stream open forever.
pub(super) struct CloseOnDrop(pub(super) Option<Arc<FairQueue>>);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        if let Some(q) = self.0.take() {
            q.close();
        }
    }
}

/// Opens the `Connect` stream on `client`, its packets taken from `tx`;
/// the server must answer within `t`.
pub(super) async fn open_connect(
    client: &mut grpc::Client,
    tx: &Arc<FairQueue>,
    meta: &[(&'static str, String)],
    t: Duration,
) -> Result<tonic::Response<tonic::Streaming<Packet>>, ConnectError> {
    let outbound =
        futures_util::stream::unfold(
            tx.clone(),
            |q| async move { q.next().await.map(|p| (p, q)) },
        );
    tokio::time::timeout(
        t,
        grpc::open_stream(client, AGENT_CONNECT_PATH, outbound, meta),
    )
    .await
    .map_err(|_| ConnectError::NoAnswer)?
    .map_err(|s| ConnectError::Refused(format!("{} {}", s.code(), s.message())))
}

/// The PING interval on a native stream: the server's (its answer's
/// `seedlink-keepalive-ms`, at least [`super::core::SERVER_KEEPALIVE_FLOOR`])
/// when shorter than ours. No server on this transport refuses pings as
/// too many, and an idle agent pinging at the server's interval notices a
/// dead stream (a partition, a lost server) when the server does, not at
/// its own longer interval, which is sized for upstream's gRPC servers.
pub(super) fn follow_server_keepalive(
    mut ours: grpc::H2Settings,
    answer: &tonic::metadata::MetadataMap,
) -> grpc::H2Settings {
    let theirs = answer
        .get(crate::wire::proto::KEEPALIVE_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .map(|ms| Duration::from_millis(ms).max(super::core::SERVER_KEEPALIVE_FLOOR));
    if let Some(every) = theirs {
        ours.keepalive = ours.keepalive.min(every);
    }
    ours
}

/// Reads a duplicate stream until the server ends it (at most 5 s), after
/// our side ended it.
pub(super) async fn drain_duplicate(mut inbound: Inbound) {
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        while let Some(Ok(_)) = inbound.next().await {}
    })
    .await;
}

impl Agent {
    /// TCP, TLS (SNI, ALPN, client certificate) and, unless the server
    /// agreed to the native transport, HTTP/2 to the server, each step
    /// within `t`; the GOAWAY sniffer watches an HTTP/2 connection.
    pub(super) async fn open_channel(
        &self,
        t: Duration,
        target: &super::core::Target,
    ) -> Result<Channel, ConnectError> {
        let server = &target.address;
        let tcp = match &self.opts.egress {
            None => tokio::time::timeout(t, TcpStream::connect(server))
                .await
                .map_err(|_| ConnectError::ConnectTimeout(server.clone()))?
                .map(EgressStream::Plain)
                .map_err(|error| ConnectError::Connect {
                    server: server.clone(),
                    error,
                })?,
            Some(egress) => tokio::time::timeout(t, egress.connect(server))
                .await
                .map_err(|_| ConnectError::EgressProxyTimeout)?
                .map_err(ConnectError::EgressProxy)?,
        };
        let _ = tcp.tcp().set_nodelay(true);
        let bad_name = || ConnectError::ServerName(target.server_name.clone());
        let name = rustls::pki_types::ServerName::try_from(target.server_name.clone())
            .map_err(|_| bad_name())?;
        let origin: http::Uri = format!("https://{}", target.server_name)
            .parse()
            .map_err(|_| bad_name())?;
        let Some(cfg) = &self.user_tls else {
            let tls = tokio::time::timeout(t, self.tls.connect(name, ReadAhead::new(tcp)))
                .await
                .map_err(|_| ConnectError::TlsTimeout)?
                .map_err(ConnectError::Tls)?;
            return self.http2(tls, origin).await;
        };
        let tls = tokio::time::timeout(
            t,
            crate::transport::usertls::connect(cfg.clone(), name, tcp),
        )
        .await
        .map_err(|_| ConnectError::TlsTimeout)?
        .map_err(ConnectError::Tls)?;
        if tls.session().alpn.as_deref() == Some(crate::transport::native::ALPN.as_bytes()) {
            return Ok(Channel::Native(Box::new(tls)));
        }
        self.http2(tls, origin).await
    }

    /// HTTP/2 on `tls`, with its GOAWAY sniffer.
    pub(super) async fn http2<IO>(
        &self,
        tls: IO,
        origin: http::Uri,
    ) -> Result<Channel, ConnectError>
    where
        IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let (tls, goaway) = crate::transport::goaway::sniff(tls);
        let client = grpc::connect(tls, origin, self.keepalive())
            .await
            .map_err(ConnectError::Http2)?;
        Ok(Channel::Grpc(client, goaway))
    }

    /// Opens the stream on `chan`, its packets taken from `tx`: the
    /// answer's metadata, the server's packets, and the GOAWAY sniffer of
    /// an HTTP/2 connection.
    pub(super) async fn open_stream(
        &self,
        chan: Channel,
        tx: &Arc<FairQueue>,
        meta: &[(&'static str, String)],
        t: Duration,
    ) -> Result<
        (
            tonic::metadata::MetadataMap,
            Inbound,
            Option<crate::transport::goaway::Seen>,
        ),
        ConnectError,
    > {
        match chan {
            Channel::Grpc(mut client, goaway) => {
                let resp = open_connect(&mut client, tx, meta, t).await?;
                let (answer, inbound, _) = resp.into_parts();
                Ok((
                    answer,
                    Box::pin(inbound.map(|r| r.map_err(Into::into))),
                    Some(goaway),
                ))
            }
            Channel::Native(mut tls) => {
                let opened =
                    tokio::time::timeout(t, crate::transport::native::open(&mut tls, meta))
                        .await
                        .map_err(|_| ConnectError::NoAnswer)?
                        .map_err(ConnectError::Native)?;
                let answer = match opened {
                    crate::transport::native::Opened::Answer(m) => m,
                    crate::transport::native::Opened::Refused(s) => {
                        return Err(ConnectError::Refused(format!(
                            "{} {}",
                            s.code(),
                            s.message()
                        )))
                    }
                };
                // The writer ends when the queue is closed, or when the
                // server takes nothing for the keepalive interval and timeout.
                let keepalive = follow_server_keepalive(self.keepalive(), &answer);
                let (inbound, _writer) =
                    crate::transport::native::start(*tls, tx.clone(), keepalive);
                Ok((
                    answer,
                    Box::pin(inbound.map(|r| r.map_err(Into::into))),
                    None,
                ))
            }
        }
    }

    /// The stream's request headers: `agentid`, `agentidentifiers`, the
    /// seedlink extensions asked for, and a ServiceAccount token (read anew
    /// for every connection: kubelet rotates it).
    pub(super) fn request_metadata(&self) -> Result<Vec<(&'static str, String)>, ConnectError> {
        let mut meta = vec![("agentid", self.opts.agent_id.clone())];
        if !self.opts.identifiers.is_empty() {
            meta.push(("agentidentifiers", self.opts.identifiers.clone()));
        }
        if self.opts.flow_control {
            meta.push((flow::HEADER, flow::VERSION.to_string()));
        }
        meta.push((
            crate::wire::proto::REPLICAS_HEADER,
            crate::wire::proto::REPLICAS_VERSION.to_string(),
        ));
        if let Some(p) = &self.opts.token_path {
            let token = std::fs::read_to_string(p).map_err(|error| ConnectError::Token {
                path: p.display().to_string(),
                error,
            })?;
            meta.push(("authorization", format!("Bearer {}", token.trim())));
        }
        Ok(meta)
    }
}

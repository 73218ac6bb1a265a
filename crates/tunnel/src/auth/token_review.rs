//! A TokenReview client: asks a cluster's API server whether an agent's
//! ServiceAccount token is valid (`POST /apis/authentication.k8s.io/v1/tokenreviews`
//! with the expected audience), as Konnectivity's proxy-server does with
//! `--agent-namespace`/`--agent-service-account`/`--authentication-audience`.
//! Unlike upstream, answers are cached (accepted tokens for `cache_ttl` but
//! never beyond their `exp`, refusals for 5 s) and concurrent reviews per
//! cluster are bounded, so a reconnect storm does not become an API storm.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use serde::Deserialize;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

use crate::auth::token_error::{AuthSetupError, TokenError};
pub use seedlink_config::tunnel::TokenReview;

/// Told the outcome of every review (`accepted`, `refused`, `unavailable`,
/// `cached`): how the server counts them, without this module knowing
/// the server's metrics.
pub type Outcomes = Arc<dyn Fn(&str) + Send + Sync>;

/// How long a refusal is remembered.
const REFUSAL_TTL: Duration = Duration::from_secs(5);
/// Cached answers at most (then expired ones are dropped, and if that is
/// not enough, all).
const CACHE_MAX: usize = 4096;
/// Reviews in flight per cluster at most; more wait (within the deadline).
const CONCURRENT: usize = 8;
/// Largest answer read.
const MAX_ANSWER: usize = 1024 * 1024;

/// A remembered answer and until when it holds.
type Cached = (Instant, Result<(), TokenError>);

/// TokenReview client for one cluster.
pub struct TokenReviewer {
    host: String,
    port: u16,
    authority: String,
    path: String,
    server_name: rustls::pki_types::ServerName<'static>,
    tls: TlsConnector,
    token_file: Option<PathBuf>,
    timeout: Duration,
    cache_ttl: Duration,
    /// Accepted tokens. Only the cluster's own API server can put one
    /// here, so an outsider can never flush it.
    cache: Mutex<HashMap<String, Cached>>,
    /// Refused tokens, apart: anyone can make refusals, and their churn
    /// must not evict accepted tokens.
    refused: Mutex<HashMap<String, Cached>>,
    gate: tokio::sync::Semaphore,
    outcomes: Outcomes,
}

#[derive(Deserialize, Default)]
struct Review {
    #[serde(default)]
    status: ReviewStatus,
}

#[derive(Deserialize, Default)]
struct ReviewStatus {
    #[serde(default)]
    authenticated: bool,
    #[serde(default)]
    user: ReviewUser,
    #[serde(default)]
    audiences: Vec<String>,
    #[serde(default)]
    error: String,
}

#[derive(Deserialize, Default)]
struct ReviewUser {
    #[serde(default)]
    username: String,
}

/// The `status` of a Kubernetes error answer.
#[derive(Deserialize, Default)]
struct ApiStatus {
    #[serde(default)]
    message: String,
}

impl TokenReviewer {
    /// A reviewer for one cluster's API server as configured; `outcomes`
    /// is told every review's outcome.
    pub fn new(cfg: &TokenReview, outcomes: Outcomes) -> Result<TokenReviewer, AuthSetupError> {
        let bad = |why: String| AuthSetupError::ReviewUrl {
            url: cfg.url.clone(),
            why,
        };
        let uri: http::Uri = cfg.url.parse().map_err(|e| bad(format!("{e}")))?;
        if uri.scheme_str() != Some("https") {
            return Err(bad("must be https://".into()));
        }
        let auth = uri.authority().ok_or_else(|| bad("no host".into()))?;
        let host = auth.host().trim_start_matches('[').trim_end_matches(']');
        let server_name = rustls::pki_types::ServerName::try_from(host.to_string())
            .map_err(|e| bad(format!("host: {e}")))?;
        let identity = match (&cfg.cert, &cfg.key) {
            (Some(c), Some(k)) => Some((c.as_path(), k.as_path())),
            _ => None,
        };
        let tls = crate::auth::tls::client_config(&cfg.ca, identity, &["http/1.1".to_string()])?;
        Ok(TokenReviewer {
            host: host.to_string(),
            port: auth.port_u16().unwrap_or(443),
            authority: auth.as_str().to_string(),
            path: format!(
                "{}/apis/authentication.k8s.io/v1/tokenreviews",
                uri.path().trim_end_matches('/')
            ),
            server_name,
            tls: TlsConnector::from(Arc::new(tls)),
            token_file: cfg.token_file.clone(),
            timeout: cfg.timeout,
            cache_ttl: cfg.cache_ttl,
            cache: Mutex::new(HashMap::new()),
            refused: Mutex::new(HashMap::new()),
            gate: tokio::sync::Semaphore::new(CONCURRENT),
            outcomes,
        })
    }

    fn count(&self, outcome: &str) {
        (self.outcomes)(outcome);
    }

    /// Whether `token` is a valid token of `subject` for `audience`;
    /// `exp` (seconds since the epoch, from the token) bounds how long an
    /// acceptance is cached.
    pub async fn check(
        &self,
        token: &str,
        audience: &str,
        subject: &str,
        exp: Option<u64>,
    ) -> Result<(), TokenError> {
        let now = Instant::now();
        if let Some(answer) = self.cached(token, now) {
            self.count("cached");
            return answer;
        }
        let answer = self.review_in_time(token, audience, subject).await;
        if let Some(ttl) = self.ttl(&answer, exp).filter(|t| !t.is_zero()) {
            self.remember(token, now, ttl, &answer);
        }
        answer
    }

    /// An answer for `token` still cached at `now` (accepted or refused).
    fn cached(&self, token: &str, now: Instant) -> Option<Result<(), TokenError>> {
        [&self.cache, &self.refused].into_iter().find_map(|cache| {
            let cache = seedlink_net::sync::lock(cache, "token review cache");
            let (until, answer) = cache.get(token)?;
            (*until > now).then(|| answer.clone())
        })
    }

    /// A review within the deadline, at most [`CONCURRENT`] at once.
    async fn review_in_time(
        &self,
        token: &str,
        audience: &str,
        subject: &str,
    ) -> Result<(), TokenError> {
        let reviewed = tokio::time::timeout(self.timeout, async {
            let _permit = self
                .gate
                .acquire()
                .await
                .map_err(|_| TokenError::Unavailable("reviewer closed".into()))?;
            self.review(token, audience, subject).await
        });
        reviewed.await.unwrap_or_else(|_| {
            Err(TokenError::Unavailable(format!(
                "no TokenReview answer within {:?}",
                self.timeout
            )))
        })
    }

    /// Counts the answer's outcome; how long it may be cached (`None`: not
    /// at all). An acceptance lasts no longer than the token (`exp`).
    fn ttl(&self, answer: &Result<(), TokenError>, exp: Option<u64>) -> Option<Duration> {
        match answer {
            Ok(()) => {
                self.count("accepted");
                let left = exp.map_or(self.cache_ttl, |e| {
                    let now = SystemTime::now()
                        .duration_since(UNIX_EPOCH)
                        .map_or(0, |d| d.as_secs());
                    Duration::from_secs(e.saturating_sub(now))
                });
                Some(self.cache_ttl.min(left))
            }
            Err(TokenError::Unavailable(_)) => {
                self.count("unavailable");
                None
            }
            Err(_) => {
                self.count("refused");
                Some(REFUSAL_TTL.min(self.cache_ttl))
            }
        }
    }

    /// Caches `answer` for `token` until `now + ttl`, within [`CACHE_MAX`].
    fn remember(&self, token: &str, now: Instant, ttl: Duration, answer: &Result<(), TokenError>) {
        let accepted = answer.is_ok();
        let map = if accepted { &self.cache } else { &self.refused };
        let mut cache = seedlink_net::sync::lock(map, "token review cache");
        if cache.len() >= CACHE_MAX {
            cache.retain(|_, (until, _)| *until > now);
        }
        if cache.len() < CACHE_MAX {
            cache.insert(token.to_string(), (now + ttl, answer.clone()));
        } else if !accepted {
            // A flood of refusals: forget refusals, never acceptances.
            cache.clear();
            cache.insert(token.to_string(), (now + ttl, answer.clone()));
        }
    }

    /// The API server could not answer: `what` failed with `e`.
    fn unavailable(&self, what: &str, e: &dyn std::fmt::Display) -> TokenError {
        TokenError::Unavailable(format!("TokenReview at {}: {what}: {e}", self.authority))
    }

    /// Asks the API server about `token` (one connection per review).
    async fn review(&self, token: &str, audience: &str, subject: &str) -> Result<(), TokenError> {
        let req = self.request(token, audience).await?;
        let (mut send, driver) = self.connect().await?;
        let answer = self.ask(&mut send, req).await;
        driver.abort();
        verdict(answer?, audience, subject)
    }

    /// The TokenReview request, with this reviewer's own token if it has
    /// one (read anew each time: it is rotated).
    async fn request(
        &self,
        token: &str,
        audience: &str,
    ) -> Result<http::Request<Full<Bytes>>, TokenError> {
        let body = serde_json::json!({
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": {"token": token, "audiences": [audience]},
        })
        .to_string();
        let mut req = http::Request::post(self.path.as_str())
            .header(http::header::HOST, self.authority.as_str())
            .header(http::header::CONTENT_TYPE, "application/json")
            .header(http::header::ACCEPT, "application/json");
        if let Some(p) = &self.token_file {
            let own = tokio::fs::read_to_string(p)
                .await
                .map_err(|e| self.unavailable(&format!("reading {}", p.display()), &e))?;
            req = req.header(
                http::header::AUTHORIZATION,
                format!("Bearer {}", own.trim()),
            );
        }
        req.body(Full::new(Bytes::from(body)))
            .map_err(|e| self.unavailable("request", &e))
    }

    /// TCP, TLS and HTTP/1.1 to the API server; the connection's driver
    /// task is aborted when the review is done.
    async fn connect(
        &self,
    ) -> Result<
        (
            hyper::client::conn::http1::SendRequest<Full<Bytes>>,
            tokio::task::JoinHandle<()>,
        ),
        TokenError,
    > {
        let tcp = TcpStream::connect((self.host.as_str(), self.port))
            .await
            .map_err(|e| self.unavailable("connect", &e))?;
        let _ = tcp.set_nodelay(true);
        let tls = self
            .tls
            .connect(self.server_name.clone(), tcp)
            .await
            .map_err(|e| self.unavailable("TLS", &e))?;
        let (send, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
            .await
            .map_err(|e| self.unavailable("HTTP", &e))?;
        let driver = tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok((send, driver))
    }

    /// Sends the request; the review's status, or why there is none.
    async fn ask(
        &self,
        send: &mut hyper::client::conn::http1::SendRequest<Full<Bytes>>,
        req: http::Request<Full<Bytes>>,
    ) -> Result<ReviewStatus, TokenError> {
        let resp = send
            .send_request(req)
            .await
            .map_err(|e| self.unavailable("request", &e))?;
        let status = resp.status();
        let bytes = Limited::new(resp.into_body(), MAX_ANSWER)
            .collect()
            .await
            .map_err(|e| self.unavailable("answer", &e))?
            .to_bytes();
        if !status.is_success() {
            let msg = serde_json::from_slice::<ApiStatus>(&bytes)
                .map(|s| s.message)
                .unwrap_or_default();
            return Err(self.unavailable(&format!("HTTP {status}"), &msg));
        }
        let review: Review =
            serde_json::from_slice(&bytes).map_err(|e| self.unavailable("answer", &e))?;
        Ok(review.status)
    }
}

/// What a review's status says about a token of `subject` for `audience`.
fn verdict(s: ReviewStatus, audience: &str, subject: &str) -> Result<(), TokenError> {
    if !s.authenticated {
        return Err(TokenError::Invalid(if s.error.is_empty() {
            "not authenticated".into()
        } else {
            s.error
        }));
    }
    if !s.audiences.iter().any(|a| a == audience) {
        return Err(TokenError::Invalid(format!(
            "token is not for audience {audience} (reviewed audiences {:?})",
            s.audiences
        )));
    }
    if s.user.username != subject {
        return Err(TokenError::WrongSubject(s.user.username));
    }
    Ok(())
}

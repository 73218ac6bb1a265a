//! The API server connections: HTTP/2, so that every watch and request of
//! a replica shares a few connections instead of taking one each.
//!
//! kube-client's default client speaks HTTP/1.1 only: each open watch
//! holds a connection of its own, so a tunnel-server following 1,000
//! tenant namespaces held about 1,000 connections to the API server. Here
//! the same layers (base URI, auth with token refresh, extra headers,
//! kube's retry policy, connect/read/write timeouts) sit on a hyper client
//! that speaks HTTP/2 (as client-go does), pinging an idle connection
//! every 30 s. Long-running watches are spread over at most
//! [`WATCHES_PER_CONNECTION`] per connection: an HTTP/2 server caps the
//! streams open at once on one connection, and a watch beyond the cap
//! would wait for a free stream rather than start.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use kube::client::ConfigExt;
use tower::ServiceBuilder;

/// How many long-running watches share one connection. kube-apiserver
/// allows 100 concurrent streams per connection unless told otherwise
/// (`--http2-max-streams-per-connection`, 0 by default, which it turns
/// into 100, as client-go's initial assumption); a watch past the cap
/// waits for a free stream (measured: a quarter of 1,000 namespaces' trust
/// waited a minute for the first watches' `timeoutSeconds`). 90 leaves
/// the rest for the requests made meanwhile.
pub const WATCHES_PER_CONNECTION: usize = 90;

/// How often an idle HTTP/2 connection is pinged, and how long the answer
/// may take before the connection is given up (and every request on it
/// retried on a new one): a connection that died silently is noticed
/// within 45 s, whatever its watches carry.
const PING_EVERY: Duration = Duration::from_secs(30);
const PING_TIMEOUT: Duration = Duration::from_secs(15);

/// How long a request may wait for its answer to start (the response's
/// head; a watch's comes at once, its events follow in the body).
/// kube-apiserver ends any request that is not long-running at its
/// `--request-timeout`, 60 s by default, so an answer not started by then
/// never will. The pings only prove the connection alive: without this
/// bound, one request whose answer was lost on a live HTTP/2 connection
/// waited forever (a controller's first list never done, its replica
/// never ready); now it fails, and its caller retries it.
const ANSWER_WITHIN: Duration = Duration::from_secs(70);

/// A replica's API server clients: the main one (short requests and the
/// fixed watches) and those the per-namespace watches are spread over.
#[derive(Clone)]
pub struct ApiClients {
    main: kube::Client,
    /// `None`: every watch on `main` (a client handed in whole).
    config: Option<Arc<kube::Config>>,
    per_connection: usize,
    /// The most connections in all, the main one included (at least 1).
    most: usize,
    pool: Arc<Mutex<Vec<Slot>>>,
}

struct Slot {
    client: kube::Client,
    watches: Arc<AtomicUsize>,
}

/// A watch's place on a connection, given back when dropped.
pub(super) struct WatchSlot(Arc<AtomicUsize>);

impl Drop for WatchSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl From<kube::Client> for ApiClients {
    fn from(main: kube::Client) -> ApiClients {
        ApiClients {
            main,
            config: None,
            per_connection: WATCHES_PER_CONNECTION,
            most: 1,
            pool: Arc::default(),
        }
    }
}

impl ApiClients {
    /// Clients from `config`, at most `per_connection` (at least 1)
    /// watches on each of the per-namespace connections, and at most
    /// `most` connections in all (at least 1: the main one).
    pub fn new(
        config: kube::Config,
        per_connection: usize,
        most: usize,
    ) -> Result<ApiClients, kube::Error> {
        Ok(ApiClients {
            main: http2_client(&config)?,
            config: Some(Arc::new(config)),
            per_connection: per_connection.max(1),
            most: most.max(1),
            pool: Arc::default(),
        })
    }

    /// How many watches the per-namespace connections carry in all.
    pub fn watch_room(&self) -> usize {
        (self.most - 1).saturating_mul(self.per_connection)
    }

    /// The client for requests and the fixed watches.
    pub fn main(&self) -> &kube::Client {
        &self.main
    }

    /// How many connections' clients exist (the main one included).
    pub fn connections(&self) -> usize {
        1 + seedlink_net::sync::lock(&self.pool, "api clients").len()
    }

    /// A client for one more long-running watch: one with room, or a new
    /// one (a new connection) when every one is full, while there are
    /// fewer than `most`; past that, the least loaded (a watch stopped
    /// gives its place back only once its task has seen the stop: a
    /// namespace's watch started meanwhile waits on that connection for a
    /// free stream, rather than open one more). With `most` 1, the main
    /// one. The pool shrinks as watches end: at most one connection
    /// without a watch is kept.
    pub(super) fn for_watch(&self) -> (kube::Client, Option<WatchSlot>) {
        let Some(config) = &self.config else {
            return (self.main.clone(), None);
        };
        let mut pool = seedlink_net::sync::lock(&self.pool, "api clients");
        let_idle_go(&mut pool);
        let load = |s: &Slot| s.watches.load(Ordering::Relaxed);
        let room = pool.iter().find(|s| load(s) < self.per_connection);
        let full = 1 + pool.len() >= self.most;
        let room = match (room, full) {
            (None, true) => pool.iter().min_by_key(|s| load(s)),
            (room, _) => room,
        };
        let slot = match room {
            Some(s) => (s.client.clone(), s.watches.clone()),
            None if full => return (self.main.clone(), None),
            None => match http2_client(config) {
                Ok(client) => {
                    let watches = Arc::new(AtomicUsize::new(0));
                    pool.push(Slot {
                        client: client.clone(),
                        watches: watches.clone(),
                    });
                    (client, watches)
                }
                // It was built from the same configuration once already.
                Err(e) => {
                    tracing::warn!(error = %e, "kubernetes: no new API server client; this watch shares the main one");
                    return (self.main.clone(), None);
                }
            },
        };
        slot.1.fetch_add(1, Ordering::Relaxed);
        (slot.0, Some(WatchSlot(slot.1)))
    }
}

/// Connections whose watches all ended (their namespaces' clusters went)
/// are let go, but one, kept for the next watch.
fn let_idle_go(pool: &mut Vec<Slot>) {
    let mut spare = false;
    pool.retain(|s| s.watches.load(Ordering::Relaxed) > 0 || !std::mem::replace(&mut spare, true));
}

/// kube-client's layers on a hyper client that speaks HTTP/2 to an
/// `https` API server (HTTP/1.1 to a plain `http` one). With a proxy
/// (`proxy-url` in the kubeconfig, or `HTTPS_PROXY`) kube-client's own
/// client is asked, which in this build speaks to no proxy (kube's
/// `http-proxy` feature is off) and refuses the configuration: the role
/// then stops at start saying so, as before HTTP/2.
fn http2_client(config: &kube::Config) -> Result<kube::Client, kube::Error> {
    if config.proxy_url.is_some() {
        return kube::Client::try_from(config.clone());
    }
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_connect_timeout(config.connect_timeout);
    let mut tls = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(config.rustls_client_config()?)
        .https_or_http();
    if let Some(name) = &config.tls_server_name {
        let name = rustls::pki_types::ServerName::try_from(name.clone())
            .map_err(|e| kube::Error::Service(format!("tls-server-name {name:?}: {e}").into()))?;
        tls = tls.with_server_name_resolver(hyper_rustls::FixedServerNameResolver::new(name));
    }
    // Over TLS, HTTP/2 only: kube-apiserver (Go's net/http) has always
    // offered it by ALPN, as client-go uses it; offering HTTP/1.1 too
    // would let a burst of first requests open a connection each before
    // the first one's protocol is known.
    let h2 = config.cluster_url.scheme_str() == Some("https");
    let tls = match h2 {
        true => tls.enable_http2().wrap_connector(http),
        false => tls.enable_http1().wrap_connector(http),
    };
    let mut timed = hyper_timeout::TimeoutConnector::new(tls);
    // The connector's own bound covers the TCP connect and the TLS
    // handshake both (the HTTP connector's, the TCP connect only): a
    // handshake that stalls would otherwise hold up every request waiting
    // for this client's one connection.
    timed.set_connect_timeout(config.connect_timeout);
    timed.set_read_timeout(config.read_timeout);
    timed.set_write_timeout(config.write_timeout);
    let hyper = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .http2_only(h2)
        .timer(TokioTimer::new())
        .pool_timer(TokioTimer::new())
        .http2_keep_alive_interval(PING_EVERY)
        .http2_keep_alive_timeout(PING_TIMEOUT)
        .http2_keep_alive_while_idle(true)
        .build(timed);
    let retry = config
        .default_retry
        .then(|| tower::retry::RetryLayer::new(kube::client::retry::RetryPolicy::server_retry()));
    let service = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(retry)
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .map_future(|answer| async move {
            match tokio::time::timeout(ANSWER_WITHIN, answer).await {
                Ok(answer) => answer,
                Err(_) => Err(tower::BoxError::from(format!(
                    "the API server did not answer within {} s",
                    ANSWER_WITHIN.as_secs()
                ))),
            }
        })
        .map_err(tower::BoxError::from)
        .service(hyper);
    Ok(kube::Client::new(service, config.default_namespace.clone()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A runtime for the clients' connectors (they connect to nothing).
    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    /// Watches fill each connection up to the bound, then a new one is
    /// made; once they end, the idle connections are let go but one.
    #[test]
    fn the_pool_grows_by_the_bound_and_shrinks_when_watches_end() {
        let rt = runtime();
        let _guard = rt.enter();
        let config = kube::Config::new("https://127.0.0.1:1".parse().unwrap());
        let clients = ApiClients::new(config, 2, 10).unwrap();
        let slots: Vec<_> = (0..5).map(|_| clients.for_watch().1).collect();
        assert!(slots.iter().all(Option::is_some));
        assert_eq!(clients.connections(), 1 + 3);
        drop(slots);
        let one = clients.for_watch();
        assert_eq!(clients.connections(), 1 + 1);
        drop(one);
        let _again = clients.for_watch();
        assert_eq!(clients.connections(), 1 + 1);
    }

    /// Past the most connections, a watch goes to the least loaded one:
    /// the count never grows past the bound, whatever the watches.
    #[test]
    fn the_connections_never_pass_the_bound() {
        let rt = runtime();
        let _guard = rt.enter();
        let config = kube::Config::new("https://127.0.0.1:1".parse().unwrap());
        let clients = ApiClients::new(config.clone(), 2, 3).unwrap();
        assert_eq!(clients.watch_room(), 4);
        let slots: Vec<_> = (0..7).map(|_| clients.for_watch().1).collect();
        assert!(slots.iter().all(Option::is_some));
        assert_eq!(clients.connections(), 3);
        let loads: Vec<usize> = seedlink_net::sync::lock(&clients.pool, "test")
            .iter()
            .map(|s| s.watches.load(Ordering::Relaxed))
            .collect();
        assert_eq!(loads.iter().sum::<usize>(), 7);
        assert!(loads.iter().all(|n| *n >= 3), "{loads:?}");
        // One connection in all: every watch on the main one.
        let one = ApiClients::new(config, 2, 1).unwrap();
        assert_eq!(one.watch_room(), 0);
        assert!(one.for_watch().1.is_none());
        assert_eq!(one.connections(), 1);
    }

    /// A request the API server takes but never answers fails at the
    /// bound, on a connection that stays open (time paused: the bound
    /// passes at once).
    #[tokio::test(start_paused = true)]
    async fn a_request_never_answered_fails_at_the_bound() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let held = std::thread::spawn(move || listener.accept().map(|(conn, _)| conn));
        let config = kube::Config::new(format!("http://{addr}").parse().unwrap());
        let client = http2_client(&config).unwrap();
        let request = http::Request::get("/version").body(Vec::new()).unwrap();
        let err = client.request_text(request).await.unwrap_err();
        assert!(
            err.to_string().contains("did not answer within 70 s"),
            "{err}"
        );
        assert!(
            held.join().unwrap().is_ok(),
            "the server held the connection"
        );
    }
}

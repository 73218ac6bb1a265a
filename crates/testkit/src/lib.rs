//! Helpers for end-to-end tests, compiled once for every test binary of
//! `crates/seedlink/tests` (which name it `common`): the real `seedlink`
//! binary, demo backends, an echo backend, metrics scraping, network
//! namespaces, and the tunnel test bed ([`tunnel_env`]). Everything binds
//! port 0 and waits for readiness by polling with a bounded deadline, never
//! by sleeping blindly.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

pub mod agent_cmd;
pub mod cluster;
pub mod eventually;
pub mod faults;
pub mod generative;
pub mod kubeapi;
pub mod squid;
pub mod tunnel_env;

pub use eventually::{eventually, eventually_blocking, ok_if};

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// `tunnel-agent --deny-cidr`: the agent's default deny list without
/// loopback. The test shoots (network namespaces) serve their demo services
/// on their own loopback, which the default denies.
pub const SHOOT_LOOPBACK_DENY: &str =
    "169.254.0.0/16,fe80::/10,100.100.100.200/32,fd00:ec2::254/128";

/// A captured ClientHello (openssl s_client, SNI api.alpha.example.com).
pub const HELLO_ALPHA: &[u8] = include_bytes!("../../proto/testdata/openssl_client_hello.bin");
/// A captured ClientHello (curl, SNI api.beta.example.com).
pub const HELLO_BETA: &[u8] = include_bytes!("../../proto/testdata/curl_client_hello.bin");

/// The `seedlink` binary the tests run: next to the test binary's `deps`
/// directory (`target/<profile>/seedlink`), where cargo builds it for the
/// integration tests of the `seedlink` package.
pub fn seedlink_bin() -> &'static str {
    static BIN: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    BIN.get_or_init(|| {
        let exe = std::env::current_exe().expect("the test binary's path");
        let profile_dir = exe
            .parent()
            .and_then(|deps| deps.parent())
            .expect("a test binary lives in target/<profile>/deps");
        let bin = profile_dir.join("seedlink");
        assert!(
            bin.exists(),
            "{} is missing: run the tests through cargo test -p seedlink",
            bin.display()
        );
        bin.display().to_string()
    })
}

/// `seedlink check-config FILE`, run to completion.
pub fn check_config(file: &Path) -> std::process::Output {
    Command::new(seedlink_bin())
        .arg("check-config")
        .arg(file)
        .output()
        .unwrap()
}

/// Asserts that `check-config` accepts `file` as `role`'s configuration.
pub fn assert_valid_config(file: &Path, role: &str) {
    let out = check_config(file);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && said.contains(&format!("valid ({role}")),
        "{said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A running `seedlink gateway` process.
pub struct Gw {
    pub child: Child,
    pub tls: SocketAddr,
    pub listeners: serde_json::Value,
    pub admin: SocketAddr,
    pub config: PathBuf,
    pub dir: tempfile::TempDir,
}

impl Gw {
    /// Writes `yaml` to a fresh directory and starts the gateway on it.
    pub fn start(yaml: &str) -> Gw {
        Gw::start_with_env(yaml, &[])
    }

    /// The same with extra environment variables (`KUBECONFIG`, `POD_NAME`).
    pub fn start_with_env(yaml: &str, env: &[(&str, &str)]) -> Gw {
        Gw::start_in(None, yaml, env)
    }

    /// The same inside network namespace `netns` (its addresses are the
    /// namespace's: reach them with a [`NetnsDialer`]).
    pub fn start_in(netns: Option<&Netns>, yaml: &str, env: &[(&str, &str)]) -> Gw {
        Gw::start_full(netns, yaml, &[], env)
    }

    /// The same with more arguments after `gateway --config <file>`.
    pub fn start_args(yaml: &str, args: &[&str]) -> Gw {
        Gw::start_full(None, yaml, args, &[])
    }

    fn start_full(netns: Option<&Netns>, yaml: &str, args: &[&str], env: &[(&str, &str)]) -> Gw {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("gateway.yaml");
        std::fs::write(&config, yaml).unwrap();
        let mut cmd = match netns {
            // `ip netns exec` execs the program: the pid stays the gateway's.
            Some(ns) => ns.cmd(&[seedlink_bin()]),
            None => Command::new(seedlink_bin()),
        };
        let mut child = cmd
            .args(["gateway", "--config"])
            .arg(&config)
            .args(args)
            .env("RUST_LOG", "warn")
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn seedlink");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut r = BufReader::new(stdout);
            let mut line = String::new();
            let _ = r.read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("gateway did not report ready within 60 s");
        let v: serde_json::Value =
            serde_json::from_str(&line).unwrap_or_else(|e| panic!("bad ready line {line:?}: {e}"));
        let listeners = v["listeners"].clone();
        let tls = listeners
            .as_object()
            .and_then(|m| m.values().next())
            .and_then(|a| a.as_str())
            .unwrap()
            .parse()
            .unwrap();
        let admin = v["admin"].as_str().unwrap().parse().unwrap();
        Gw {
            child,
            tls,
            listeners,
            admin,
            config,
            dir,
        }
    }

    /// Address of the listener called `name`.
    pub fn listener(&self, name: &str) -> SocketAddr {
        self.listeners[name].as_str().unwrap().parse().unwrap()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(self.pid().to_string())
            .status()
            .unwrap();
        assert!(ok.success());
    }

    /// Replaces the configuration file atomically (write + rename), as
    /// editors and ConfigMap updates do.
    pub fn write_config(&self, yaml: &str) {
        let tmp = self.dir.path().join(".gateway.yaml.tmp");
        std::fs::write(&tmp, yaml).unwrap();
        std::fs::rename(&tmp, &self.config).unwrap();
    }

    pub async fn get(&self, path: &str) -> (u16, String) {
        http_get(self.admin, path).await
    }

    pub async fn metrics(&self) -> String {
        self.get("/metrics").await.1
    }

    /// Sum of all samples whose line starts with `prefix` (name plus any
    /// label text).
    pub async fn metric(&self, prefix: &str) -> f64 {
        sum_metric(&self.metrics().await, prefix)
    }

    /// Polls until `metric(prefix) >= want`, for at most 30 s.
    pub async fn wait_metric(&self, prefix: &str, want: f64) {
        let what = format!("metric {prefix} at {want}");
        eventually(&what, Duration::from_secs(30), async || {
            let m = self.metrics().await;
            ok_if(sum_metric(&m, prefix) >= want, || m.clone())
        })
        .await;
    }

    /// Waits for the process to exit, at most `limit`.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<i32> {
        let end = Instant::now() + limit;
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st.code();
            }
            if Instant::now() > end {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Gw {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sends signal `sig` (`-9`, `-STOP`, `-TERM`…) to process `pid`.
pub fn signal(pid: u32, sig: &str) {
    assert!(Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .unwrap()
        .success());
}

/// A blocking `/metrics` fetcher for an admin endpoint, usable from
/// synchronous code such as [`faults::Oracle`] (its own thread and runtime).
pub fn metrics_fetcher(admin: SocketAddr) -> impl Fn() -> String + Send + Sync + 'static {
    move || {
        std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(http_get(admin, "/metrics"))
                .1
        })
        .join()
        .unwrap()
    }
}

pub fn sum_metric(text: &str, prefix: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A minimal HTTP/1.1 GET for the admin endpoint.
pub async fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let fut = async {
        let mut s = TcpStream::connect(addr).await?;
        s.write_all(
            format!("GET {path} HTTP/1.1\r\nhost: admin\r\nconnection: close\r\n\r\n").as_bytes(),
        )
        .await?;
        let mut out = Vec::new();
        s.read_to_end(&mut out).await?;
        Ok::<_, std::io::Error>(String::from_utf8_lossy(&out).into_owned())
    };
    let text = tokio::time::timeout(Duration::from_secs(10), fut)
        .await
        .unwrap()
        .unwrap();
    let code = text.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (code, body)
}

/// Starts a demo kube-apiserver for host `i` of `pki`; returns its address.
pub async fn demo_backend(
    pki: &seedlink::demo::Pki,
    i: usize,
    name: &str,
    stop: &CancellationToken,
) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(seedlink::demo::serve_demo_apiserver(
        l,
        name.into(),
        pki.server_config(i).unwrap(),
        stop.clone(),
    ));
    addr
}

/// A TCP server on 127.0.0.1:0 running `each` on every accepted
/// connection (in its own task) until `stop`.
pub async fn tcp_server<F, Fut>(stop: &CancellationToken, each: F) -> SocketAddr
where
    F: Fn(TcpStream) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let stop = stop.clone();
    tokio::spawn(async move {
        loop {
            let (s, _) = tokio::select! {
                () = stop.cancelled() => return,
                r = l.accept() => match r { Ok(x) => x, Err(_) => continue },
            };
            tokio::spawn(each(s));
        }
    });
    addr
}

/// A TCP echo server: echoes every byte until EOF, then half-closes.
pub async fn echo_backend(stop: &CancellationToken) -> SocketAddr {
    tcp_server(stop, |mut s| async move {
        let (mut r, mut w) = s.split();
        let _ = tokio::io::copy(&mut r, &mut w).await;
        let _ = w.shutdown().await;
    })
    .await
}

/// Sends `hello`, then reads back exactly as many bytes (from an echo backend).
pub async fn echo_roundtrip(s: &mut TcpStream, data: &[u8]) -> std::io::Result<()> {
    s.write_all(data).await?;
    let mut back = vec![0u8; data.len()];
    tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut back))
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "echo timed out"))??;
    assert_eq!(back, data);
    Ok(())
}

/// Reads until the peer closes; returns the bytes and whether it was a clean FIN.
pub async fn read_until_closed<S: tokio::io::AsyncRead + Unpin>(
    s: &mut S,
    limit: Duration,
) -> (Vec<u8>, std::io::Result<()>) {
    let mut out = Vec::new();
    let r = tokio::time::timeout(limit, s.read_to_end(&mut out)).await;
    match r {
        Ok(Ok(_)) => (out, Ok(())),
        Ok(Err(e)) => (out, Err(e)),
        Err(_) => (
            out,
            Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "not closed in time",
            )),
        ),
    }
}

/// Finds a free loopback port for peers that cannot bind port 0 and report it.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Polls until something accepts connections on `addr` (at most 60 s: a
/// peer starting on a busy machine can take a while).
pub async fn wait_listening(addr: SocketAddr) {
    let what = format!("something listening on {addr}");
    eventually(&what, Duration::from_secs(60), async || {
        TcpStream::connect(addr).await.is_ok()
    })
    .await;
}

/// Like [`wait_listening`] for a peer process the test started: fails at
/// once, with the exit status, if `child` exits before it listens (a bad
/// config or a port taken between [`free_port`] and its bind).
pub async fn wait_child_listening(child: &mut std::process::Child, addr: SocketAddr) {
    let what = format!("peer listening on {addr}");
    eventually(&what, Duration::from_secs(60), async || {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("the peer meant to listen on {addr} exited first: {status}");
        }
        TcpStream::connect(addr).await.is_ok()
    })
    .await;
}

/// Reads the first stdout line of `c` (the ready line) as JSON, within
/// 60 s (a busy machine). Without one, `c` is killed before the panic: a
/// process left running would hold the test's output open and hang the
/// run.
pub fn ready_line(c: &mut std::process::Child) -> serde_json::Value {
    let out = c.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = std::io::BufReader::new(out).read_line(&mut line);
        let _ = tx.send(line);
    });
    let line = rx.recv_timeout(Duration::from_secs(60));
    match line
        .as_deref()
        .map(serde_json::from_str::<serde_json::Value>)
    {
        Ok(Ok(ready)) => ready,
        other => {
            let _ = c.kill();
            let _ = c.wait();
            panic!("no ready line ({other:?}; the process was killed)")
        }
    }
}

/// Moves the calling thread into network namespace `name`.
#[allow(unsafe_code)]
pub fn enter_netns(name: &str) {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(format!("/run/netns/{name}")).unwrap();
    // SAFETY: setns on a valid namespace fd for this thread only.
    let r = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
    assert_eq!(r, 0, "setns: {}", std::io::Error::last_os_error());
}

/// Fails loudly when a required external tool is missing (never skips).
pub fn require(tool: &str) -> PathBuf {
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {tool}"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "required test peer `{tool}` is not installed; run scripts/install-peers"
    );
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

pub fn write_pki(pki: &seedlink::demo::Pki, dir: &Path) -> seedlink::demo::ClientFiles {
    pki.write_client_files(dir).unwrap()
}

/// curl with the demo client certificate to `https://host:port/`, resolving
/// `host` to `ip`; returns stdout and stderr together.
pub fn curl_mtls(
    files: &seedlink::demo::ClientFiles,
    host: &str,
    ip: std::net::IpAddr,
    port: u16,
) -> String {
    let out = Command::new(require("curl"))
        .args(["-sS", "--max-time", "10", "--cacert"])
        .arg(&files.ca)
        .arg("--cert")
        .arg(&files.cert)
        .arg("--key")
        .arg(&files.key)
        .arg("--resolve")
        .arg(format!("{host}:{port}:{ip}"))
        .arg(format!("https://{host}:{port}/"))
        .output()
        .unwrap();
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// curl through an HTTP CONNECT proxy at `proxy` (`host:port`) sending
/// the proxy `header`, to `https://<host>/` with the client certificate of
/// `files`, and `extra` arguments: what curl printed (stdout, then stderr).
pub fn curl_through_connect(
    proxy: &str,
    header: &str,
    files: &seedlink::demo::ClientFiles,
    host: &str,
    extra: &[&str],
) -> String {
    let out = Command::new(require("curl"))
        .args(["-sS", "--max-time", "10", "-p", "-x"])
        .arg(format!("http://{proxy}"))
        .args(extra)
        .arg("--proxy-header")
        .arg(header)
        .arg("--cacert")
        .arg(&files.ca)
        .arg("--cert")
        .arg(&files.cert)
        .arg("--key")
        .arg(&files.key)
        .arg(format!("https://{host}/"))
        .output()
        .unwrap();
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// HAProxy 3.0 (Debian trixie's, unpacked by scripts/install-peers into
/// /opt/haproxy3; `$HAPROXY3` overrides): the first HAProxy here with
/// `fc_pp_tlv` and `set-proxy-v2-tlv-fmt` (2.9+). Missing, the test fails.
pub fn haproxy3() -> PathBuf {
    let p = std::env::var_os("HAPROXY3")
        .map_or_else(|| PathBuf::from("/opt/haproxy3/bin/haproxy"), PathBuf::from);
    assert!(
        p.exists(),
        "required test peer HAProxy 3 ({}) is not installed; run scripts/install-peers",
        p.display()
    );
    p
}

/// HAProxy 3 in the foreground with the configuration `cfg` (written to
/// `dir/<name>.cfg`).
pub fn haproxy3_run(dir: &Path, name: &str, cfg: &str) -> Proc {
    let file = dir.join(format!("{name}.cfg"));
    std::fs::write(&file, cfg).unwrap();
    Proc(
        Command::new(haproxy3())
            .arg("-db")
            .arg("-f")
            .arg(&file)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join(format!("{name}.log"))).unwrap())
            .spawn()
            .unwrap(),
    )
}

/// `seedlink gateway --config cfg` in network namespace `ns`, once its
/// ready line says so.
pub fn gateway_in_netns(ns: &Netns, cfg: &Path) -> Proc {
    let mut gw = ns
        .cmd(&[seedlink_bin(), "gateway", "--config"])
        .arg(cfg)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    if let Some(out) = gw.stdout.take() {
        let _ = BufReader::new(out).read_line(&mut line);
    }
    let gw = Proc(gw);
    assert!(line.contains("ready"), "{line}");
    gw
}

/// A child process killed when dropped.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A running `seedlink node-proxy` (killed when dropped): where it listens
/// and its admin endpoint, from its ready line.
pub struct NodeProxyProc {
    pub child: Child,
    pub listen: SocketAddr,
    pub admin: SocketAddr,
    /// The metrics-only endpoint, when `--metrics` was given.
    pub metrics: Option<SocketAddr>,
}

impl Drop for NodeProxyProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `seedlink node-proxy` on port 0 with its admin on port 0 and
/// `args`, and waits for its ready line.
pub fn node_proxy(args: &[&str]) -> NodeProxyProc {
    let mut child = Command::new(seedlink_bin())
        .arg("node-proxy")
        .args(["--port", "0", "--admin", "127.0.0.1:0"])
        .args(args)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let v = ready_line(&mut child);
    NodeProxyProc {
        child,
        listen: v["listen"].as_str().unwrap().parse().unwrap(),
        admin: v["admin"].as_str().unwrap().parse().unwrap(),
        metrics: v["metrics"].as_str().map(|m| m.parse().unwrap()),
    }
}

/// Envoy with the configuration file `cfg`, one worker, errors logged to
/// `dir/envoy.log`.
pub fn envoy(dir: &Path, cfg: &Path) -> Proc {
    Proc(
        Command::new(require("envoy"))
            .arg("-c")
            .arg(cfg)
            .args(["--concurrency", "1", "-l", "error", "--use-dynamic-base-id"])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("envoy.log")).unwrap())
            .spawn()
            .unwrap(),
    )
}

/// nginx in the foreground, one process, under `dir/nginx`, with `blocks`
/// (`stream { … }` and/or `http { … }`) as its configuration.
pub fn nginx(dir: &Path, blocks: &str) -> Proc {
    let prefix = dir.join("nginx");
    std::fs::create_dir_all(prefix.join("logs")).unwrap();
    let conf = prefix.join("nginx.conf");
    std::fs::write(
        &conf,
        format!(
            "load_module /usr/lib/nginx/modules/ngx_stream_module.so;
daemon off;
master_process off;
user root;
pid {p}/nginx.pid;
error_log {p}/logs/error.log info;
events {{ worker_connections 256; }}
{blocks}
",
            p = prefix.display()
        ),
    )
    .unwrap();
    Proc(
        Command::new(require("nginx"))
            .arg("-p")
            .arg(&prefix)
            .arg("-c")
            .arg(&conf)
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

/// A network namespace that exists for the life of the value, with `lo` up.
pub struct Netns(pub String);

impl Netns {
    pub fn new(tag: &str) -> Netns {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let name = format!(
            "sl-{tag}{}-{}",
            std::process::id(),
            N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let ok = Command::new(require("ip"))
            .args(["netns", "add", &name])
            .status()
            .unwrap();
        assert!(ok.success(), "ip netns add {name} failed");
        let ns = Netns(name);
        ns.run(&["ip", "link", "set", "lo", "up"]);
        ns
    }

    pub fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.0]).args(args);
        c
    }

    pub fn run(&self, args: &[&str]) -> String {
        let out = self.cmd(args).output().unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

/// Binds and dials TCP inside a network namespace, for a process that
/// stays outside it: a thread that joined the namespace creates the
/// sockets, which keep it (so one proxy can listen in one namespace and
/// dial in another).
#[derive(Clone)]
pub struct NetnsDialer {
    tx: std::sync::mpsc::Sender<NetnsJob>,
}

enum NetnsJob {
    Connect(
        SocketAddr,
        tokio::sync::oneshot::Sender<std::io::Result<std::net::TcpStream>>,
    ),
    Bind(
        SocketAddr,
        std::sync::mpsc::Sender<std::io::Result<std::net::TcpListener>>,
    ),
}

impl NetnsDialer {
    pub fn new(ns: &Netns) -> NetnsDialer {
        let (tx, rx) = std::sync::mpsc::channel::<NetnsJob>();
        let name = ns.0.clone();
        std::thread::spawn(move || {
            enter_netns(&name);
            while let Ok(job) = rx.recv() {
                match job {
                    NetnsJob::Connect(a, reply) => {
                        let r = std::net::TcpStream::connect_timeout(&a, Duration::from_secs(5));
                        let _ = reply.send(r);
                    }
                    NetnsJob::Bind(a, reply) => {
                        let _ = reply.send(std::net::TcpListener::bind(a));
                    }
                }
            }
        });
        NetnsDialer { tx }
    }

    /// A connection to `addr` from inside the namespace.
    pub async fn connect(&self, addr: SocketAddr) -> std::io::Result<TcpStream> {
        let (reply, rx) = tokio::sync::oneshot::channel();
        self.tx
            .send(NetnsJob::Connect(addr, reply))
            .map_err(|_| std::io::Error::other("netns dialer gone"))?;
        let s = rx
            .await
            .map_err(|_| std::io::Error::other("netns dialer gone"))??;
        s.set_nonblocking(true)?;
        TcpStream::from_std(s)
    }

    /// A listener on `addr` inside the namespace (call within a runtime).
    pub fn bind(&self, addr: SocketAddr) -> TcpListener {
        let (reply, rx) = std::sync::mpsc::channel();
        self.tx.send(NetnsJob::Bind(addr, reply)).unwrap();
        let l = rx
            .recv()
            .unwrap()
            .unwrap_or_else(|e| panic!("bind {addr} in netns: {e}"));
        l.set_nonblocking(true).unwrap();
        TcpListener::from_std(l).unwrap()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

/// Two new namespaces joined by a veth pair: `198.18.<net>.1/24` on the
/// first, `198.18.<net>.2/24` on the second (the benchmarking range, only
/// inside these namespaces).
pub fn netns_pair(a: &str, b: &str, net: u8) -> (Netns, Netns) {
    let (na, nb) = (Netns::new(a), Netns::new(b));
    netns_link(&na, &nb, net);
    (na, nb)
}

/// Joins two namespaces by a veth pair: `198.18.<net>.1/24` in `na`,
/// `.2` in `nb`.
pub fn netns_link(na: &Netns, nb: &Netns, net: u8) {
    let id = std::process::id() % 100_000;
    let (va, vb) = (format!("va{id}n{net}"), format!("vb{id}n{net}"));
    na.run(&[
        "ip", "link", "add", &va, "type", "veth", "peer", "name", &vb,
    ]);
    na.run(&["ip", "link", "set", &vb, "netns", &nb.0]);
    na.run(&[
        "ip",
        "addr",
        "add",
        &format!("198.18.{net}.1/24"),
        "dev",
        &va,
    ]);
    na.run(&["ip", "link", "set", &va, "up"]);
    nb.run(&[
        "ip",
        "addr",
        "add",
        &format!("198.18.{net}.2/24"),
        "dev",
        &vb,
    ]);
    nb.run(&["ip", "link", "set", &vb, "up"]);
}

/// Joins `ns` to this process's own namespace by a veth pair:
/// `198.18.<net>.1/24` here, `.2` in `ns`. Only that /24 becomes routable
/// between the two; whatever else `ns` holds (addresses on its loopback)
/// stays unreachable from here. The pair goes with the namespace.
pub fn netns_to_host(ns: &Netns, net: u8) {
    let id = std::process::id() % 100_000;
    let (host, inner) = (format!("vh{id}n{net}"), format!("vi{id}n{net}"));
    let run = |args: &[&str]| {
        let out = Command::new(require("ip")).args(args).output().unwrap();
        assert!(
            out.status.success(),
            "ip {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    run(&["link", "add", &host, "type", "veth", "peer", "name", &inner]);
    run(&["link", "set", &inner, "netns", &ns.0]);
    run(&["addr", "add", &format!("198.18.{net}.1/24"), "dev", &host]);
    run(&["link", "set", &host, "up"]);
    ns.run(&[
        "ip",
        "addr",
        "add",
        &format!("198.18.{net}.2/24"),
        "dev",
        &inner,
    ]);
    ns.run(&["ip", "link", "set", &inner, "up"]);
}

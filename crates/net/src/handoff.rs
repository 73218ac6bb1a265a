//! Handing listening sockets to the next process: a binary upgrade with
//! nothing refused. The running process offers duplicates of its listening
//! sockets on a Unix socket; the new process takes them (`SCM_RIGHTS`),
//! serves on the very same sockets (their accept queues included: no SYN
//! is lost, unlike a second set of `SO_REUSEPORT` sockets), says it is
//! ready, and the old process stops accepting and drains its own
//! connections. HAProxy (`-x`), Pingora and Cloudflare's ecdysis do the same.
//!
//! The exchange, on one Unix stream connection (each step bounded):
//! 1. new → old: `seedlink-take\n`;
//! 2. old → new: a JSON line naming each socket
//!    (`{"sockets":[{"name":..,"address":..},..]}`) with the first 253
//!    descriptors in that order as `SCM_RIGHTS` (Linux's limit per
//!    message), then a byte `+` with each further 253;
//! 3. (optional, at most [`MAX_PHASES`]) new → old: `phase <name>\n`; the
//!    old process does what that phase means to it and answers one line
//!    (the tunnel-server's `agents`: it stops taking agents and sends them
//!    DRAIN, and names them, so that the new one takes its frontends only
//!    once the agents moved);
//! 4. new → old: `ready\n` once it serves;
//! 5. old: stops offering, removes the socket file, answers `done\n`, and
//!    drains. Without `ready` (the new process failed) the old one undoes
//!    its phases ([`Phases::abort`]) and goes on serving as if nothing
//!    happened.
//!
//! Only a process of the same user may connect (the file is 0600 and the
//! peer's credentials are checked). Hand-written over `nix`: no crate does
//! this exchange (the `sendfd` family passes descriptors but not this
//! protocol, and none is as well kept as nix).

use std::io::{BufRead, BufReader, IoSlice, IoSliceMut, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};

/// The most descriptors one message carries (Linux's `SCM_MAX_FD`); more
/// follow in further messages of one byte (`+`) each.
const FDS_PER_MESSAGE: usize = 253;

/// The most sockets one hand-over carries.
pub const MAX_SOCKETS: usize = 4096;

/// How long the new process has, once it took the sockets, to say it is
/// ready (a Kubernetes source waits up to 10 s for its first snapshot).
pub const READY_WITHIN: Duration = Duration::from_secs(120);

/// The largest description message (and phase answer) accepted.
const MAX_MESSAGE: usize = 4 * 1024 * 1024;

/// The most phases one hand-over has.
pub const MAX_PHASES: usize = 8;

/// What the offering process does at each phase of a hand-over.
pub trait Phases: Sync {
    /// Carries out phase `name` and answers it (one line; a newline in it
    /// is replaced). An unknown phase answers `unknown`.
    fn phase(&self, name: &str) -> String {
        let _ = name;
        "unknown".into()
    }
    /// A new process asked for the sockets: what changes the set of
    /// listeners (reloads) waits until the hand-over ends.
    fn began(&self) {}
    /// The new process failed (after some phases, maybe): undo them, serve
    /// on.
    fn abort(&self) {}
    /// The new process serves: stop accepting now, before it hears `done`
    /// (what it accepts from then on must not land here).
    fn done(&self) {}
}

/// No phases (the gateway's hand-over).
impl Phases for () {}

/// One socket handed over.
#[derive(Debug)]
pub struct Socket {
    /// What it is to its owner (a listener's name, `admin`).
    pub name: String,
    /// The address it is bound to, as the owner saw it.
    pub address: String,
    /// The descriptor.
    pub fd: OwnedFd,
}

fn io(e: nix::Error) -> std::io::Error {
    std::io::Error::from(e)
}

fn invalid(msg: impl Into<String>) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, msg.into())
}

/// Only a process of our own user may take our sockets.
fn same_user(s: &UnixStream) -> std::io::Result<()> {
    let cred =
        nix::sys::socket::getsockopt(s, nix::sys::socket::sockopt::PeerCredentials).map_err(io)?;
    let me = nix::unistd::geteuid().as_raw();
    if cred.uid() != me {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!("peer uid {} is not ours ({me})", cred.uid()),
        ));
    }
    Ok(())
}

/// Held while this process's umask is changed (see [`listen`]).
pub(crate) static UMASK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Binds the offer socket at `path` (mode 0600). A file left by a process
/// that is gone is replaced; one a live process answers on is an error (it
/// is that process's to hand over: take from it instead).
pub fn listen(path: &Path) -> std::io::Result<UnixListener> {
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AddrInUse,
                format!(
                    "{}: a running process offers its sockets there (take them over instead)",
                    path.display()
                ),
            ));
        }
        std::fs::remove_file(path)?;
    }
    // Created 0600 (a umask around the bind), never chmod'ed by path
    // afterwards: a path swapped for a symlink in between would have the
    // mode of whatever it points to changed, and the socket would be open
    // to everyone meanwhile.
    let l = {
        use nix::sys::stat::{umask, Mode};
        // The umask is the process's: two binds at once (a seed's two
        // halves, parallel tests) must not restore each other's.
        let _one = crate::sync::lock(&UMASK, "umask");
        let was = umask(Mode::from_bits_truncate(0o177));
        let bound = UnixListener::bind(path);
        umask(was);
        bound?
    };
    let meta = std::fs::symlink_metadata(path)?;
    {
        use std::os::unix::fs::FileTypeExt;
        if !meta.file_type().is_socket() || meta.permissions().mode() & 0o077 != 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                format!("{}: not our private socket after bind", path.display()),
            ));
        }
    }
    Ok(l)
}

/// The sockets on offer, shared with whoever may withdraw them: a process
/// that drains for another reason must let go of its copies, or its
/// listening sockets stay open (and keep completing handshakes nobody
/// accepts).
#[derive(Clone, Default)]
pub struct Offer(std::sync::Arc<std::sync::Mutex<Option<Offered>>>);

/// What is offered now: duplicates of the sockets at the moment a new
/// process asks (a server whose listeners change with its configuration
/// offers the current ones).
pub type Source = Box<dyn Fn() -> std::io::Result<Vec<Socket>> + Send>;

/// Where the sockets are offered, and what.
type Offered = (PathBuf, Source);

fn copy(sockets: &[Socket]) -> std::io::Result<Vec<Socket>> {
    sockets
        .iter()
        .map(|k| {
            Ok(Socket {
                name: k.name.clone(),
                address: k.address.clone(),
                fd: k.fd.try_clone()?,
            })
        })
        .collect()
}

/// A source that offers copies of `sockets`.
pub fn fixed(sockets: Vec<Socket>) -> Source {
    Box::new(move || copy(&sockets))
}

impl Offer {
    /// Offers `sockets` at `path`.
    pub fn new(path: PathBuf, sockets: Vec<Socket>) -> Offer {
        Offer::live(path, fixed(sockets))
    }

    /// Offers what `source` gives when a new process asks.
    pub fn live(path: PathBuf, source: Source) -> Offer {
        Offer(std::sync::Arc::new(std::sync::Mutex::new(Some((
            path, source,
        )))))
    }

    /// Withdraws the offer: the copies are closed and the socket file is
    /// removed (nothing is handed over from now on). The lock is only held
    /// to take the list.
    pub fn withdraw(&self) {
        let taken = self.0.lock().map(|mut g| g.take()).unwrap_or(None);
        if let Some((path, _)) = taken {
            let _ = std::fs::remove_file(path);
        }
    }

    /// Duplicates of what is offered (`None` once withdrawn or handed over).
    fn copies(&self) -> Option<std::io::Result<Vec<Socket>>> {
        let g = self.0.lock().ok()?;
        let (_, source) = g.as_ref()?;
        Some(source())
    }
}

/// The old process's side: offers the sockets on `listener` until a new
/// process takes them and says it is ready (then removes the socket file,
/// answers `done` and returns `true`), or the offer is withdrawn (`false`,
/// at the next connection). `phases` answers the new process's phases, and
/// undoes them when it fails. Blocking: run it on a thread of its own.
pub fn offer(listener: UnixListener, offer: &Offer, phases: &dyn Phases) -> std::io::Result<bool> {
    for conn in listener.incoming() {
        let s = match conn {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "upgrade socket: accept failed");
                continue;
            }
        };
        let sockets = match offer.copies() {
            None => return Ok(false),
            Some(copies) => match checked(copies) {
                Some(v) => v,
                None => continue,
            },
        };
        match give(&s, &sockets, phases) {
            Ok(()) => {
                // The new process serves: from now on the socket file is
                // its to create. Removed before `done`, so it never
                // removes its own; our copies go too.
                drop(listener);
                drop(sockets);
                offer.withdraw();
                phases.done();
                let mut s = s;
                let _ = s.write_all(b"done\n");
                return Ok(true);
            }
            Err(e) => {
                phases.abort();
                tracing::warn!(error = %e, "upgrade: the new process did not take over; serving on")
            }
        }
    }
    Ok(false)
}

/// The copies of the sockets for one attempt; none (logged) if they cannot
/// be made or are more than one hand-over carries: this attempt only, the
/// process serves on and offers again (its listeners may become fewer).
fn checked(copies: std::io::Result<Vec<Socket>>) -> Option<Vec<Socket>> {
    match copies {
        Err(e) => {
            tracing::warn!(error = %e, "upgrade: cannot copy the sockets");
            None
        }
        Ok(v) if v.len() > MAX_SOCKETS => {
            tracing::error!(
                sockets = v.len(),
                "upgrade: more sockets than one hand-over carries ({MAX_SOCKETS}); refused"
            );
            None
        }
        Ok(v) => Some(v),
    }
}

/// One attempt: hand the sockets over, answer the phases, and wait for
/// `ready`.
fn give(s: &UnixStream, sockets: &[Socket], phases: &dyn Phases) -> std::io::Result<()> {
    same_user(s)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    s.set_write_timeout(Some(Duration::from_secs(10)))?;
    let mut r = BufReader::new(s.try_clone()?);
    let mut line = String::new();
    r.by_ref().take(64).read_line(&mut line)?;
    if line != "seedlink-take\n" {
        return Err(invalid(format!("unexpected request {line:?}")));
    }
    phases.began();
    send_sockets(s, sockets)?;
    s.set_read_timeout(Some(READY_WITHIN))?;
    answer_phases(&mut r, s, phases)
}

/// Sends the sockets' names and addresses (one line) with their
/// descriptors, [`FDS_PER_MESSAGE`] to a message.
fn send_sockets(s: &UnixStream, sockets: &[Socket]) -> std::io::Result<()> {
    let names: Vec<serde_like::Entry<'_>> = sockets
        .iter()
        .map(|k| serde_like::Entry {
            name: &k.name,
            address: &k.address,
        })
        .collect();
    let mut payload = serde_like::encode(&names);
    payload.push('\n');
    let fds: Vec<RawFd> = sockets.iter().map(|k| k.fd.as_raw_fd()).collect();
    let mut chunks = fds.chunks(FDS_PER_MESSAGE);
    let first = chunks.next().unwrap_or(&[]);
    let sent = sendmsg::<()>(
        s.as_raw_fd(),
        &[IoSlice::new(payload.as_bytes())],
        &[ControlMessage::ScmRights(first)],
        MsgFlags::empty(),
        None,
    )
    .map_err(io)?;
    // A blocking stream socket sends it all; the rest of a long line, if
    // the kernel stopped short, follows as plain bytes.
    let mut w = s;
    w.write_all(&payload.as_bytes()[sent..])?;
    for chunk in chunks {
        let n = sendmsg::<()>(
            s.as_raw_fd(),
            &[IoSlice::new(b"+")],
            &[ControlMessage::ScmRights(chunk)],
            MsgFlags::empty(),
            None,
        )
        .map_err(io)?;
        if n != 1 {
            return Err(invalid("a descriptor message was not sent"));
        }
    }
    Ok(())
}

/// Answers the new process's phases (at most [`MAX_PHASES`]) until it says
/// `ready`.
fn answer_phases(
    r: &mut BufReader<UnixStream>,
    mut w: &UnixStream,
    phases: &dyn Phases,
) -> std::io::Result<()> {
    for _ in 0..=MAX_PHASES {
        let mut line = String::new();
        r.by_ref().take(128).read_line(&mut line)?;
        if line == "ready\n" {
            return Ok(());
        }
        let Some(name) = line
            .strip_prefix("phase ")
            .and_then(|n| n.strip_suffix('\n'))
            .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-'))
        else {
            return Err(invalid(format!("no ready from the new process ({line:?})")));
        };
        let mut answer = phases.phase(name).replace(['\n', '\r'], " ");
        if answer.len() >= MAX_MESSAGE {
            // Never cut (it would not parse); the new process then does
            // without the answer.
            answer = "too-large".into();
        }
        answer.push('\n');
        w.write_all(answer.as_bytes())?;
    }
    Err(invalid(format!("more than {MAX_PHASES} phases")))
}

/// The new process's side, once it took the sockets.
pub struct Taken {
    stream: UnixStream,
}

impl Taken {
    /// Asks the old process to carry out phase `name` (letters, digits and
    /// `-`) and returns its answer.
    pub fn phase(&mut self, name: &str) -> std::io::Result<String> {
        self.stream
            .write_all(format!("phase {name}\n").as_bytes())?;
        self.stream.set_read_timeout(Some(READY_WITHIN))?;
        let mut line = String::new();
        BufReader::new(&self.stream)
            .take(u64::try_from(MAX_MESSAGE).unwrap_or(u64::MAX))
            .read_line(&mut line)?;
        line.strip_suffix('\n')
            .map(str::to_string)
            .ok_or_else(|| invalid("the old process did not answer the phase"))
    }

    /// Tells the old process that the new one serves, and waits (bounded)
    /// for it to give up the offer socket: then the new process may offer
    /// its own at the same path.
    pub fn ready(mut self) -> std::io::Result<()> {
        self.stream.write_all(b"ready\n")?;
        self.stream
            .set_read_timeout(Some(Duration::from_secs(10)))?;
        let mut line = String::new();
        BufReader::new(&self.stream).take(64).read_line(&mut line)?;
        if line != "done\n" {
            return Err(invalid(format!(
                "the old process did not answer done ({line:?})"
            )));
        }
        Ok(())
    }
}

/// Takes the sockets offered at `path`.
pub fn take(path: &Path) -> std::io::Result<(Vec<Socket>, Taken)> {
    let mut s = UnixStream::connect(path).map_err(|e| {
        std::io::Error::new(
            e.kind(),
            format!(
                "{}: no process offers its sockets there: {e}",
                path.display()
            ),
        )
    })?;
    same_user(&s)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    s.set_write_timeout(Some(Duration::from_secs(10)))?;
    s.write_all(b"seedlink-take\n")?;
    let (text, fds) = receive(&s)?;
    let entries = serde_like::decode(&text).map_err(invalid)?;
    if entries.len() != fds.len() {
        return Err(invalid(format!(
            "the offer names {} sockets and carries {}",
            entries.len(),
            fds.len()
        )));
    }
    let sockets = entries
        .into_iter()
        .zip(fds)
        .map(|((name, address), fd)| Socket { name, address, fd })
        .collect();
    Ok((sockets, Taken { stream: s }))
}

/// Reads the description line and the descriptors that come with it and
/// after it (as many as it names, at most [`MAX_SOCKETS`]), each
/// `recvmsg` with its own control buffer: a plain read would drop them.
fn receive(s: &UnixStream) -> std::io::Result<(String, Vec<OwnedFd>)> {
    let mut buf = Vec::new();
    let mut fds = Vec::new();
    let mut chunk = vec![0u8; 64 * 1024];
    let mut space = nix::cmsg_space!([RawFd; FDS_PER_MESSAGE]);
    let mut named: Option<usize> = None;
    loop {
        if let Some(n) = named {
            if fds.len() >= n {
                break;
            }
        }
        let got = receive_one(s, &mut chunk, &mut space, &mut fds)?;
        if got == 0 {
            return Err(invalid("the offer ended early"));
        }
        buf.extend_from_slice(&chunk[..got]);
        if buf.len() > MAX_MESSAGE || fds.len() > MAX_SOCKETS {
            return Err(invalid("the offer was larger than this process accepts"));
        }
        if named.is_none() {
            if let Some(i) = buf.iter().position(|&b| b == b'\n') {
                let line = std::str::from_utf8(&buf[..i])
                    .map_err(|_| invalid("the offer is not UTF-8"))?;
                named = Some(serde_like::decode(line).map_err(invalid)?.len());
            }
        }
    }
    let i = buf.iter().position(|&b| b == b'\n').unwrap_or(buf.len());
    if buf[i..].iter().skip(1).any(|&b| b != b'+') {
        return Err(invalid("unexpected bytes after the offer"));
    }
    let text = std::str::from_utf8(&buf[..i]).map_err(|_| invalid("the offer is not UTF-8"))?;
    Ok((text.to_string(), fds))
}

/// One message: its bytes into `chunk` (how many), its descriptors onto
/// `fds`.
#[allow(unsafe_code)]
#[allow(clippy::ptr_arg)] // nix's recvmsg takes the control buffer as a Vec
fn receive_one(
    s: &UnixStream,
    chunk: &mut [u8],
    space: &mut Vec<u8>,
    fds: &mut Vec<OwnedFd>,
) -> std::io::Result<usize> {
    let mut iov = [IoSliceMut::new(chunk)];
    let msg = recvmsg::<()>(
        s.as_raw_fd(),
        &mut iov,
        Some(space),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )
    .map_err(io)?;
    for c in msg.cmsgs().map_err(io)? {
        if let ControlMessageOwned::ScmRights(got) = c {
            // SAFETY: the kernel installed these descriptors in this
            // process for us; nothing else owns them.
            fds.extend(
                got.into_iter()
                    .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
            );
        }
    }
    if msg.flags.contains(MsgFlags::MSG_CTRUNC) {
        return Err(invalid("the offer was larger than this process accepts"));
    }
    Ok(msg.bytes)
}

/// The description line: a JSON object written and read without a JSON
/// dependency in this crate; in names and addresses (`ip:port`, a socket
/// path) every byte but `[A-Za-z0-9_.:/[]-]` is written `%XX`.
mod serde_like {
    pub struct Entry<'a> {
        pub name: &'a str,
        pub address: &'a str,
    }

    /// Bytes written as they are; every other byte is `%XX`.
    fn plain(b: u8) -> bool {
        b.is_ascii_alphanumeric() || b"-_.:[]/".contains(&b)
    }

    /// The longest name or address (escaped).
    const MAX_FIELD: usize = 16 * 1024;

    fn escape(s: &str) -> String {
        let mut out = String::with_capacity(s.len());
        for b in s.bytes() {
            if plain(b) {
                out.push(char::from(b));
            } else {
                out.push_str(&format!("%{b:02X}"));
            }
        }
        out
    }

    fn unescape(s: &str) -> Option<String> {
        if s.is_empty() || s.len() > MAX_FIELD {
            return None;
        }
        let b = s.as_bytes();
        let mut out = Vec::with_capacity(b.len());
        let mut i = 0;
        while i < b.len() {
            if b[i] == b'%' {
                let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            } else if plain(b[i]) {
                out.push(b[i]);
                i += 1;
            } else {
                return None;
            }
        }
        String::from_utf8(out).ok()
    }

    pub fn encode(entries: &[Entry<'_>]) -> String {
        let items: Vec<String> = entries
            .iter()
            .map(|e| {
                format!(
                    "{{\"name\":\"{}\",\"address\":\"{}\"}}",
                    escape(e.name),
                    escape(e.address)
                )
            })
            .collect();
        format!("{{\"sockets\":[{}]}}", items.join(","))
    }

    pub fn decode(text: &str) -> Result<Vec<(String, String)>, String> {
        let inner = text
            .strip_prefix("{\"sockets\":[")
            .and_then(|t| t.strip_suffix("]}"))
            .ok_or_else(|| format!("not an offer: {text:?}"))?;
        if inner.is_empty() {
            return Ok(Vec::new());
        }
        inner
            .split("},{")
            .map(|item| {
                let item = item.trim_start_matches('{').trim_end_matches('}');
                item.strip_prefix("\"name\":\"")
                    .and_then(|r| r.split_once("\",\"address\":\""))
                    .and_then(|(n, a)| Some((unescape(n)?, unescape(a.strip_suffix('"')?)?)))
                    .ok_or_else(|| format!("not an offer entry: {item:?}"))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The offer socket is born 0600 (no window in which another user
    /// could connect, no chmod through a path someone may have swapped),
    /// and the process's umask is left as it was.
    #[test]
    fn the_offer_socket_is_created_private() {
        use nix::sys::stat::{umask, Mode};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("upgrade.sock");
        // Every umask change in this process is made under UMASK (another
        // test's listen runs meanwhile).
        let set = |m: u32| {
            let _one = crate::sync::lock(&UMASK, "umask");
            umask(Mode::from_bits_truncate(m))
        };
        let before = set(0o022);
        let _l = listen(&path).unwrap();
        let after = set(before.bits());
        assert_eq!(after.bits(), 0o022, "the umask is restored");
        let meta = std::fs::symlink_metadata(&path).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    }

    #[test]
    fn the_description_round_trips_and_refuses_garbage() {
        let e = [
            serde_like::Entry {
                name: "tls",
                address: "0.0.0.0:443",
            },
            serde_like::Entry {
                name: "admin",
                address: "[::1]:9901",
            },
        ];
        let text = serde_like::encode(&e);
        assert_eq!(
            serde_like::decode(&text).unwrap(),
            [
                ("tls".to_string(), "0.0.0.0:443".to_string()),
                ("admin".into(), "[::1]:9901".into())
            ]
        );
        assert_eq!(serde_like::decode("{\"sockets\":[]}").unwrap(), []);
        // Any text survives: escaped on the way, unescaped on arrival.
        let odd = [serde_like::Entry {
            name: "frontend:k0-é/uds x",
            address: "/run/a b/%\"},{x.sock",
        }];
        assert_eq!(
            serde_like::decode(&serde_like::encode(&odd)).unwrap(),
            [(
                "frontend:k0-é/uds x".to_string(),
                "/run/a b/%\"},{x.sock".to_string()
            )]
        );
        for bad in [
            "",
            "{}",
            "{\"sockets\":[{\"name\":\"a\"}]}",
            "{\"sockets\":[{\"name\":\"a b\",\"address\":\"x\"}]}",
            "{\"sockets\":[{\"name\":\"a%2\",\"address\":\"x\"}]}",
            "{\"sockets\":[{\"name\":\"%FF\",\"address\":\"x\"}]}",
        ] {
            assert!(serde_like::decode(bad).is_err(), "{bad}");
        }
    }

    /// Two "processes" (threads) in one: the listening socket taken over
    /// is the same socket (a connection queued before the hand-over is
    /// accepted after it), and the offer file is gone once done.
    #[test]
    fn a_listening_socket_changes_hands_with_its_queue() {
        let dir = std::env::temp_dir().join(format!("handoff-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        let path = dir.join("upgrade.sock");
        let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = tcp.local_addr().unwrap();
        let queued = std::net::TcpStream::connect(addr).unwrap();
        let l = listen(&path).unwrap();
        assert!(listen(&path).is_err(), "a live offer is not replaced");
        let fd = OwnedFd::from(tcp.try_clone().unwrap());
        let offered = Offer::new(
            path.clone(),
            vec![Socket {
                name: "tls".into(),
                address: addr.to_string(),
                fd,
            }],
        );
        let o = offered.clone();
        let old = std::thread::spawn(move || offer(l, &o, &()));
        let (mut sockets, taken) = take(&path).unwrap();
        drop(tcp);
        assert_eq!(sockets.len(), 1);
        let s = sockets.remove(0);
        assert_eq!(
            (s.name.as_str(), s.address.clone()),
            ("tls", addr.to_string())
        );
        let taken_l = std::net::TcpListener::from(s.fd);
        assert_eq!(taken_l.local_addr().unwrap(), addr);
        taken.ready().unwrap();
        assert!(old.join().unwrap().unwrap());
        assert!(!path.exists());
        let (_, peer) = taken_l.accept().unwrap();
        assert_eq!(peer, queued.local_addr().unwrap());
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[cfg(test)]
mod many_tests {
    use super::*;

    /// More sockets than one message carries (Linux's 253) arrive, each
    /// under its own name, in order.
    #[test]
    fn more_than_one_message_of_sockets_changes_hands() {
        let dir = std::env::temp_dir().join(format!("handoff-m-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        let path = dir.join("upgrade.sock");
        let mut sockets = Vec::new();
        for i in 0..600 {
            let t = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            sockets.push(Socket {
                name: format!("frontend:c{i}/uds"),
                address: t.local_addr().unwrap().to_string(),
                fd: OwnedFd::from(t),
            });
        }
        let want: Vec<(String, String)> = sockets
            .iter()
            .map(|k| (k.name.clone(), k.address.clone()))
            .collect();
        let l = listen(&path).unwrap();
        let o = Offer::new(path.clone(), sockets);
        let old = std::thread::spawn(move || offer(l, &o, &()));
        let (got, taken) = take(&path).unwrap();
        assert_eq!(got.len(), 600);
        for (k, (name, address)) in got.into_iter().zip(want) {
            assert_eq!((&k.name, &k.address), (&name, &address));
            let l = std::net::TcpListener::from(k.fd);
            assert_eq!(l.local_addr().unwrap().to_string(), address);
        }
        taken.ready().unwrap();
        assert!(old.join().unwrap().unwrap());
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[cfg(test)]
mod phase_tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[derive(Default)]
    struct Counted {
        phases: AtomicUsize,
        aborts: AtomicUsize,
    }

    impl Phases for Counted {
        fn phase(&self, name: &str) -> String {
            self.phases.fetch_add(1, Ordering::SeqCst);
            format!("did {name}\nthen")
        }
        fn abort(&self) {
            self.aborts.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// A phase is answered in one line; a new process that goes away after
    /// it makes the old one undo it and offer again; the next one that says
    /// ready takes over.
    #[test]
    fn phases_are_answered_and_undone_when_the_new_process_fails() {
        let dir = std::env::temp_dir().join(format!("handoff-p-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        let path = dir.join("upgrade.sock");
        let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let l = listen(&path).unwrap();
        let offered = Offer::new(
            path.clone(),
            vec![Socket {
                name: "agents".into(),
                address: tcp.local_addr().unwrap().to_string(),
                fd: OwnedFd::from(tcp),
            }],
        );
        let counted = std::sync::Arc::new(Counted::default());
        let (o, c) = (offered.clone(), counted.clone());
        let old = std::thread::spawn(move || offer(l, &o, &*c));
        {
            let (_, mut taken) = take(&path).unwrap();
            assert_eq!(taken.phase("agents").unwrap(), "did agents then");
            // Gone without ready.
        }
        let (_, mut taken) = take(&path).unwrap();
        assert_eq!(counted.aborts.load(Ordering::SeqCst), 1);
        assert_eq!(taken.phase("agents").unwrap(), "did agents then");
        taken.ready().unwrap();
        assert!(old.join().unwrap().unwrap());
        assert_eq!(counted.phases.load(Ordering::SeqCst), 2);
        assert_eq!(counted.aborts.load(Ordering::SeqCst), 1);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[cfg(test)]
mod withdraw_tests {
    use super::*;

    /// A withdrawn offer closes its copies (the listening socket closes
    /// with its last descriptor: connects are refused) and removes the file.
    #[test]
    fn a_withdrawn_offer_lets_the_socket_close() {
        let dir = std::env::temp_dir().join(format!("handoff-w-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        let path = dir.join("upgrade.sock");
        let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = tcp.local_addr().unwrap();
        let l = listen(&path).unwrap();
        let offered = Offer::new(
            path.clone(),
            vec![Socket {
                name: "tls".into(),
                address: addr.to_string(),
                fd: OwnedFd::from(tcp),
            }],
        );
        let o = offered.clone();
        let old = std::thread::spawn(move || offer(l, &o, &()));
        offered.withdraw();
        assert!(!path.exists());
        assert!(
            std::net::TcpStream::connect(addr).is_err(),
            "the listening socket closed"
        );
        drop(old);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

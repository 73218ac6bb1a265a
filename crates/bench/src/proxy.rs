//! A running proxy under test: its processes, where clients reach it, and
//! stopping it.

use std::net::SocketAddr;
use std::process::{Child, Command};

use crate::procstat::stat_field;
use crate::scenario::proxy_v2;

/// A running proxy process (and, for tunnels, its second process).
pub struct Proxy {
    pub(crate) child: Child,
    pub(crate) extra: Vec<Child>,
    /// Where it listens.
    pub addr: SocketAddr,
    /// Whether clients must open an HTTP CONNECT tunnel first.
    pub connect: bool,
    /// Whether its CONNECT frontend keeps bytes a client sends before the
    /// answer (seedlink's tunnel server): the latency run is then repeated
    /// with the CONNECT pipelined.
    pub keeps_pipelined: bool,
    /// A Unix socket clients use instead of `addr` (upstream Konnectivity).
    pub unix: Option<std::path::PathBuf>,
}

impl Proxy {
    /// A proxy made of `child` and `extra` processes.
    pub fn from_children(
        child: Child,
        extra: Vec<Child>,
        addr: SocketAddr,
        connect: bool,
    ) -> Proxy {
        Proxy {
            child,
            extra,
            addr,
            connect,
            keeps_pipelined: false,
            unix: None,
        }
    }

    /// Pins the first process and its threads to `cpus[0]`, the second (a
    /// tunnel's agent) to `cpus[1]`, with util-linux's `taskset`.
    pub fn pin(&self, cpus: &[u32]) -> anyhow::Result<()> {
        anyhow::ensure!(
            cpus.len() == 2,
            "--tunnel-cpus takes two CPUs: server,agent"
        );
        let procs = std::iter::once(&self.child).chain(&self.extra);
        for (c, cpu) in procs.zip(cpus) {
            let ok = Command::new("taskset")
                .args(["-a", "-p", "-c", &cpu.to_string(), &c.id().to_string()])
                .stdout(std::process::Stdio::null())
                .status()?
                .success();
            anyhow::ensure!(ok, "taskset could not pin pid {} to CPU {cpu}", c.id());
        }
        Ok(())
    }

    /// Where clients connect.
    pub fn target(&self) -> crate::workload::Target {
        match &self.unix {
            Some(p) => crate::workload::Target::Unix(p.as_path().into()),
            None if proxy_v2() => crate::workload::Target::TcpProxyV2(self.addr),
            None => crate::workload::Target::Tcp(self.addr),
        }
    }

    /// The processes and the first one's direct children (nginx workers).
    pub fn pids(&self) -> Vec<u32> {
        let root = self.child.id();
        let mut pids = vec![root];
        pids.extend(self.extra.iter().map(Child::id));
        if let Ok(rd) = std::fs::read_dir("/proc") {
            for e in rd.flatten() {
                let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                    continue;
                };
                if let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) {
                    if stat_field(&stat, 4) == Some(u64::from(root)) {
                        pids.push(pid);
                    }
                }
            }
        }
        pids
    }
}

impl Drop for Proxy {
    /// Stops the proxy and its workers, also when the bench fails midway.
    fn drop(&mut self) {
        // The master first: nginx's master starts a new worker for one
        // killed under it, which would then outlive it. SIGKILL: a worker
        // told to stop gracefully waits for its open connections.
        let pids = self.pids();
        let _ = self.child.kill();
        let _ = self.child.wait();
        for pid in pids.into_iter().skip(1 + self.extra.len()) {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
        }
        for c in &mut self.extra {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

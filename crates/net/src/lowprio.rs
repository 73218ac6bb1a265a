//! A runtime on one thread of its own at a lower scheduling priority, for
//! work that anyone who reaches a port can ask for (TLS handshakes on the
//! tunnel-server's agent port): the kernel runs the normal-priority
//! workers, which carry established tenants' traffic, first, so a flood
//! of handshakes delays handshakes, not tunnels.

/// The nice value of that thread (0 is normal, 19 the lowest).
pub const NICE: i32 = 10;

/// Starts a current-thread runtime on its own thread named `name` at
/// [`NICE`]; its handle, or `None` if the thread or runtime could not be
/// made (then the work runs where it is, as before).
pub fn runtime(name: &str) -> Option<tokio::runtime::Handle> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            lower_this_thread(NICE);
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            let _ = tx.send(rt.handle().clone());
            // Serves what is spawned on it for as long as the process runs.
            rt.block_on(std::future::pending::<()>());
        })
        .ok()?;
    rx.recv().ok()
}

/// Sets the calling thread's nice value (Linux: per thread); whether it
/// took. Raising it needs no privilege.
#[allow(unsafe_code)]
pub fn lower_this_thread(nice: i32) -> bool {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: gettid and setpriority take no pointers and change only
        // the calling thread's scheduling priority.
        unsafe {
            let tid = libc::gettid();
            libc::setpriority(libc::PRIO_PROCESS, u32::try_from(tid).unwrap_or(0), nice) == 0
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = nice;
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Work spawned on the runtime runs on its own thread, at the lower
    /// priority, and its result comes back.
    #[tokio::test]
    async fn work_runs_on_the_low_priority_thread() {
        let Some(h) = runtime("lowprio-test") else {
            panic!("no runtime");
        };
        let (name, nice) = h
            .spawn(async {
                let name = std::thread::current().name().map(String::from);
                let nice = std::fs::read_to_string("/proc/thread-self/stat")
                    .ok()
                    .and_then(|s| {
                        let after = s.rsplit_once(')')?.1.to_string();
                        after.split_whitespace().nth(16).map(String::from)
                    });
                (name, nice)
            })
            .await
            .unwrap_or((None, None));
        assert_eq!(name.as_deref(), Some("lowprio-test"));
        if cfg!(target_os = "linux") {
            assert_eq!(nice.as_deref(), Some("10"));
        }
    }
}

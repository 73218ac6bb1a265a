//! CPU time and resident memory of processes, from /proc.

/// Field `n` (1-based, as in proc(5)) of /proc/PID/stat.
pub fn stat_field(stat: &str, n: usize) -> Option<u64> {
    // The command name (field 2) may contain spaces; skip past its ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    rest.split(' ').nth(n - 3)?.parse().ok()
}

/// CPU seconds (user + system) used so far by `pids`.
pub fn cpu_seconds(pids: &[u32]) -> f64 {
    let tick = 100.0;
    pids.iter()
        .filter_map(|p| std::fs::read_to_string(format!("/proc/{p}/stat")).ok())
        .map(|s| (stat_field(&s, 14).unwrap_or(0) + stat_field(&s, 15).unwrap_or(0)) as f64 / tick)
        .sum()
}

/// Resident memory of `pids`, KiB.
pub fn rss_kib(pids: &[u32]) -> f64 {
    pids.iter()
        .filter_map(|p| std::fs::read_to_string(format!("/proc/{p}/status")).ok())
        .filter_map(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .sum()
}

/// Threads of `pid` now (`Threads:` in /proc/PID/status).
pub fn threads(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
}

/// Voluntary context switches of every thread of `pids` so far, per
/// thread: how many times each slept until something woke it (proc(5),
/// `voluntary_ctxt_switches` in /proc/PID/task/TID/status). Keyed by TID so
/// that [`wakeups_since`] can diff thread by thread: a thread that exits
/// between two snapshots drops out of the sum instead of making it wrap.
pub fn wakeups(pids: &[u32]) -> std::collections::HashMap<u32, u64> {
    let mut n = std::collections::HashMap::new();
    for p in pids {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) else {
            continue;
        };
        for t in tasks.flatten() {
            let Some(tid) = t.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                continue;
            };
            let Ok(status) = std::fs::read_to_string(t.path().join("status")) else {
                continue;
            };
            if let Some(v) = status
                .lines()
                .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
                .and_then(|v| v.trim().parse::<u64>().ok())
            {
                n.insert(tid, v);
            }
        }
    }
    n
}

/// Wake-ups between snapshot `before` and `after` (both from [`wakeups`]):
/// each thread's own delta, summed. A thread born in between counts from
/// zero; one that exited in between is not counted (its last wake-ups are
/// lost, an undercount the bench accepts: tokio's workers live for the run).
pub fn wakeups_since(
    before: &std::collections::HashMap<u32, u64>,
    after: &std::collections::HashMap<u32, u64>,
) -> u64 {
    after
        .iter()
        .map(|(tid, n)| n.saturating_sub(before.get(tid).copied().unwrap_or(0)))
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wakeups_since_diffs_per_thread_and_survives_exits() {
        let before = [(1, 10), (2, 500), (3, 7)].into_iter().collect();
        // Thread 2 exited, thread 4 was born.
        let after = [(1, 15), (3, 9), (4, 3)].into_iter().collect();
        assert_eq!(wakeups_since(&before, &after), 5 + 2 + 3);
        // A reused TID with a lower count is not a wrap-around.
        let reused = [(1, 4)].into_iter().collect();
        assert_eq!(wakeups_since(&before, &reused), 0);
    }

    #[test]
    fn wakeups_reads_this_process() {
        let me = std::process::id();
        assert!(!wakeups(&[me]).is_empty());
    }
}

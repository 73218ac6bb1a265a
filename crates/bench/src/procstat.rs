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

/// Voluntary context switches of every thread of `pids` so far: how many
/// times one of them slept until something woke it (proc(5),
/// `voluntary_ctxt_switches` in /proc/PID/task/TID/status).
pub fn wakeups(pids: &[u32]) -> u64 {
    let mut n = 0;
    for p in pids {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) else {
            continue;
        };
        for t in tasks.flatten() {
            let Ok(status) = std::fs::read_to_string(t.path().join("status")) else {
                continue;
            };
            n += status
                .lines()
                .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
                .and_then(|v| v.trim().parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    n
}

//! Gives memory back to the system after a burst.
//!
//! glibc's allocator keeps freed memory inside its arenas: after an attack
//! of thousands of half-open connections ended, the gateway's RSS stayed
//! where the attack took it (measured: docs/PERFORMANCE.md, "Memory after
//! an attack"), because free chunks in the middle of a heap are only
//! returned by `malloc_trim`. A background thread looks every
//! [`PERIOD`] at how much the allocator holds free (`mallinfo2`) and trims
//! when that is above [`FREE_THRESHOLD`]; in steady state it finds little
//! free and does nothing. Hand-written: two libc calls on a timer.

use std::time::Duration;

/// How often the allocator's free memory is looked at.
pub const PERIOD: Duration = Duration::from_secs(10);

/// Free bytes held in the allocator above which it is trimmed.
pub const FREE_THRESHOLD: usize = 8 * 1024 * 1024;

/// How much free memory glibc keeps at the top of a heap before giving it
/// back by itself ([`tune`]).
pub const KEEP_FREE_TOP: usize = FREE_THRESHOLD;

/// Allocations from this size on get their own mapping ([`tune`]): the
/// largest tunnel packet (4 MiB) and its buffers stay on the heap.
pub const OWN_MAPPING_FROM: usize = 4 * 1024 * 1024 + 64 * 1024;

/// Sets glibc's allocator for a relay (glibc only; elsewhere nothing to
/// do); `true` when it took the settings. By default glibc gives the top
/// of a heap back as soon as 128 KiB of it are free, so a relay whose
/// buffers all come back between two bursts (a tunnel stream's frames,
/// freed once written) returned its pages and faulted them in again,
/// zeroed, at every burst: issue 28 measured a fifth of the tunnel's CPU
/// in page faults and page clearing. It now keeps up to [`KEEP_FREE_TOP`]
/// and grows its heap 1 MiB at a time; the trimming thread ([`start`])
/// still returns what a burst leaves above [`FREE_THRESHOLD`].
pub fn tune() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        set_mallopt()
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn set_mallopt() -> bool {
    let int = |v: usize| libc::c_int::try_from(v).unwrap_or(libc::c_int::MAX);
    // SAFETY: mallopt only changes the allocator's parameters; it takes
    // the arenas' locks like any allocation and touches no live memory.
    unsafe {
        libc::mallopt(libc::M_TRIM_THRESHOLD, int(KEEP_FREE_TOP)) == 1
            && libc::mallopt(libc::M_TOP_PAD, int(1024 * 1024)) == 1
            && libc::mallopt(libc::M_MMAP_THRESHOLD, int(OWN_MAPPING_FROM)) == 1
    }
}

/// Starts the trimming thread (glibc only; elsewhere nothing to do).
/// Failing to start it costs only the memory it would have returned.
pub fn start() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let spawned = std::thread::Builder::new()
            .name("memtrim".into())
            .stack_size(64 * 1024)
            .spawn(|| loop {
                std::thread::sleep(PERIOD);
                let _ = trim_if_worth_it(FREE_THRESHOLD);
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "memory trimming thread not started");
        }
    }
}

/// Trims when the allocator holds more than `threshold` bytes free;
/// returns the free bytes seen and whether it trimmed.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
pub fn trim_if_worth_it(threshold: usize) -> (usize, bool) {
    // SAFETY: mallinfo2 only reads the allocator's statistics (glibc ≥ 2.33).
    let info = unsafe { libc::mallinfo2() };
    let free = info.fordblks;
    if free <= threshold {
        return (free, false);
    }
    // SAFETY: malloc_trim(0) releases free pages of every arena; it takes
    // the arenas' locks like any allocation and touches no live memory.
    unsafe { libc::malloc_trim(0) };
    tracing::debug!(free_bytes = free, "allocator trimmed");
    (free, true)
}

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    use super::*;

    #[test]
    fn the_allocator_takes_the_relay_settings() {
        assert!(tune());
    }

    #[test]
    fn a_large_free_is_trimmed_and_a_small_one_is_not() {
        // Every other block freed: the live ones pin the heap, so free
        // cannot give the holes back itself (as after an attack).
        let mut blocks: Vec<Vec<u8>> = (0..8_000).map(|i| vec![i as u8; 4096]).collect();
        let kept: Vec<Vec<u8>> = blocks
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| i % 2 == 0)
            .map(|(_, b)| std::mem::take(b))
            .collect();
        drop(blocks);
        let (free, trimmed) = trim_if_worth_it(1024 * 1024);
        assert!(free > 1024 * 1024 && trimmed, "free {free}");
        drop(kept);
        let (_, trimmed) = trim_if_worth_it(usize::MAX);
        assert!(!trimmed);
    }
}

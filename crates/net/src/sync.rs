//! Locks whose poisoning is surfaced, not skipped. A poisoned mutex means a
//! thread panicked while holding it: a bug. Silently skipping the work the
//! lock guards (the `if let Ok(..) = m.lock()` pattern) would turn that bug
//! into lost connections nobody can explain. [`lock`] logs it at error
//! level, counts it ([`poisoned`], exported as `seedlink_lock_poisoned_total`
//! by every admin endpoint), clears the poison and carries on with the state, which
//! every guarded structure here keeps consistent between statements.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

static POISONED: AtomicU64 = AtomicU64::new(0);

/// Locks `m`; `what` names it in the error log if it was poisoned.
pub fn lock<'a, T>(m: &'a Mutex<T>, what: &'static str) -> MutexGuard<'a, T> {
    m.lock().unwrap_or_else(|e| {
        poisoned_found(what);
        m.clear_poison();
        e.into_inner()
    })
}

/// Read-locks `l`; poisoning is reported as by [`lock`].
pub fn read<'a, T>(l: &'a RwLock<T>, what: &'static str) -> RwLockReadGuard<'a, T> {
    l.read().unwrap_or_else(|e| {
        poisoned_found(what);
        l.clear_poison();
        e.into_inner()
    })
}

/// Write-locks `l`; poisoning is reported as by [`lock`].
pub fn write<'a, T>(l: &'a RwLock<T>, what: &'static str) -> RwLockWriteGuard<'a, T> {
    l.write().unwrap_or_else(|e| {
        poisoned_found(what);
        l.clear_poison();
        e.into_inner()
    })
}

fn poisoned_found(what: &'static str) {
    POISONED.fetch_add(1, Ordering::Relaxed);
    tracing::error!(
        lock = what,
        "bug: a thread panicked while holding this lock; continuing with its state"
    );
}

/// How many poisoned locks were found since the process started.
pub fn poisoned() -> u64 {
    POISONED.load(Ordering::Relaxed)
}

static PANICS: AtomicU64 = AtomicU64::new(0);

/// Counts every panic of the process (exported as `seedlink_panics_total`
/// by every admin endpoint) and logs it at error level, then runs the
/// default hook (which prints it). A panic in a connection task ends that
/// task only (tokio catches it), so without this count it would show as an
/// unexplained closed connection.
pub fn count_panics() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        PANICS.fetch_add(1, Ordering::Relaxed);
        tracing::error!(panic = %info, "panic (a bug)");
        default(info);
    }));
}

/// Panics since start.
pub fn panics() -> u64 {
    PANICS.load(Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poisoned_lock_is_counted_and_still_usable() {
        let m = std::sync::Arc::new(Mutex::new(1));
        let m2 = m.clone();
        let before = poisoned();
        let _ = std::thread::spawn(move || {
            let _g = lock(&m2, "test");
            panic!("poison it");
        })
        .join();
        assert!(m.is_poisoned());
        *lock(&m, "test") += 1;
        assert_eq!(*lock(&m, "test"), 2);
        assert!(!m.is_poisoned(), "cleared after being reported");
        assert_eq!(poisoned(), before + 1);
    }
}

//! Generative runs: how many steps and from which seed, from the
//! environment (`SEEDLINK_ISOLATION_STEPS`, `SEEDLINK_ISOLATION_SEED`) or
//! the defaults, and a small deterministic generator, so that a failure
//! can be replayed from the seed the run prints.

/// A small deterministic generator (xorshift).
pub struct Rng(u64);

impl Rng {
    /// A number in `0..n`.
    pub fn next(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n.max(1) as u64) as usize
    }
}

/// The run's steps (`default_steps` unless set) and its generator, seeded
/// from the environment or the clock; prints both under `what`.
pub fn run(what: &str, default_steps: usize) -> (usize, Rng) {
    let steps = std::env::var("SEEDLINK_ISOLATION_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default_steps);
    let seed = std::env::var("SEEDLINK_ISOLATION_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
                | 1
        });
    eprintln!("{what}: {steps} steps, SEEDLINK_ISOLATION_SEED={seed}");
    (steps, Rng(seed.max(1)))
}

//! The cipher alone (`--scenario cipher`): the AEADs TLS 1.3 offers, as
//! rustls's crypto provider (ring) runs them, sealing and opening 16 KiB
//! records (a full TLS record) on one core, beside `openssl speed -evp`'s
//! figures for the same ciphers (docs/PERFORMANCE.md, issue 28). It tells
//! how much of the tunnel's CPU per GB the cipher must cost, whatever the
//! relays around it do.

use std::time::{Duration, Instant};

use ring::aead::{
    Aad, LessSafeKey, Nonce, UnboundKey, AES_128_GCM, AES_256_GCM, CHACHA20_POLY1305,
};

/// One TLS record's worth of plaintext.
const RECORD: usize = 16 * 1024;
/// How long each cipher and direction runs.
const RUN: Duration = Duration::from_secs(2);

/// Seals (and then opens) 16 KiB records for [`RUN`] each; prints MB/s
/// and CPU-seconds per GB for each cipher.
pub fn run() -> anyhow::Result<()> {
    println!(
        "\n## seedlink-bench (cipher): ring via rustls's provider, 16 KiB records, one core\n"
    );
    println!("| cipher | seal MB/s | open MB/s | seal + open s/GB |");
    println!("|---|---|---|---|");
    for (name, alg) in [
        ("AES-128-GCM", &AES_128_GCM),
        ("AES-256-GCM", &AES_256_GCM),
        ("ChaCha20-Poly1305", &CHACHA20_POLY1305),
    ] {
        let key_bytes = vec![7u8; alg.key_len()];
        let key = LessSafeKey::new(
            UnboundKey::new(alg, &key_bytes).map_err(|_| anyhow::anyhow!("{name}: key"))?,
        );
        let (seal, sealed) = seal_rate(&key)?;
        let open = open_rate(&key, &sealed)?;
        let s_per_gb = 1e3 / seal + 1e3 / open;
        println!("| {name} | {seal:.0} | {open:.0} | {s_per_gb:.2} |");
    }
    Ok(())
}

fn nonce(i: u64) -> Nonce {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&i.to_be_bytes());
    Nonce::assume_unique_for_key(n)
}

/// MB/s sealing, and one sealed record (with its tag) to open.
fn seal_rate(key: &LessSafeKey) -> anyhow::Result<(f64, Vec<u8>)> {
    let mut buf = vec![0x5au8; RECORD];
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed() < RUN {
        buf.truncate(RECORD);
        key.seal_in_place_append_tag(nonce(n), Aad::empty(), &mut buf)
            .map_err(|_| anyhow::anyhow!("seal"))?;
        n += 1;
    }
    let rate = (n as f64 * RECORD as f64) / start.elapsed().as_secs_f64() / 1e6;
    let mut one = vec![0x5au8; RECORD];
    key.seal_in_place_append_tag(nonce(0), Aad::empty(), &mut one)
        .map_err(|_| anyhow::anyhow!("seal"))?;
    Ok((rate, one))
}

/// MB/s opening `sealed` (a record sealed under nonce 0) again and again.
fn open_rate(key: &LessSafeKey, sealed: &[u8]) -> anyhow::Result<f64> {
    let mut buf = Vec::with_capacity(sealed.len());
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed() < RUN {
        buf.clear();
        buf.extend_from_slice(sealed);
        key.open_in_place(nonce(0), Aad::empty(), &mut buf)
            .map_err(|_| anyhow::anyhow!("open"))?;
        n += 1;
    }
    Ok((n as f64 * RECORD as f64) / start.elapsed().as_secs_f64() / 1e6)
}

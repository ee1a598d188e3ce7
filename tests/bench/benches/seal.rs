//! Criterion: sealing and unsealing a plan file (AES-256-GCM through `takosumi_seal`, which
//! uses `ring`, with the envelope, associated data and allocations) at 1 MiB and at the
//! 19 MiB relay limit. The `aes-gcm-in-place` rows are RustCrypto `aes-gcm`, the cipher
//! `seal` used before, so the switch stays visible. The `seal-stream` group is the chunked
//! format plan files are sealed in, at 4 KiB and 1 MiB.
//! Runs only under `cargo bench`; figure 5 of the bench binary compares the same calls
//! with `openssl speed` from the same run.

use aes_gcm::aead::AeadInPlace;
use aes_gcm::{Aes256Gcm, KeyInit, Nonce};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use takosumi_core::Secret;
use takosumi_seal::{Purpose, Sealer};

const SUBJECT: &str = "run_0193a1b2c3d4e5f60718293a4b5c6d7e";

/// A sealer with a fixed key and a group of 20 samples over 3 s.
fn setup<'c>(
    c: &'c mut Criterion,
    name: &str,
) -> (
    Sealer,
    criterion::BenchmarkGroup<'c, criterion::measurement::WallTime>,
) {
    let sealer = Sealer::new("bench-1", &Secret::new(vec![7u8; 32])).unwrap();
    let mut group = c.benchmark_group(name);
    group.sample_size(20);
    group.warm_up_time(std::time::Duration::from_millis(500));
    group.measurement_time(std::time::Duration::from_secs(3));
    (sealer, group)
}

fn plaintext(size: usize) -> Vec<u8> {
    (0..size).map(|i| (i % 251) as u8).collect()
}

fn seal(c: &mut Criterion) {
    let (sealer, mut group) = setup(c, "seal");
    for (label, size) in [("1MiB", 1usize << 20), ("19MiB", 19usize << 20)] {
        let plain = plaintext(size);
        let sealed = sealer.seal(Purpose::Plan, SUBJECT, &plain).unwrap();
        group.throughput(Throughput::Bytes(size as u64));
        group.bench_with_input(BenchmarkId::new("seal", label), &plain, |b, p| {
            b.iter(|| sealer.seal(Purpose::Plan, SUBJECT, p).unwrap())
        });
        group.bench_with_input(BenchmarkId::new("unseal", label), &sealed, |b, s| {
            b.iter(|| sealer.unseal(Purpose::Plan, SUBJECT, s).unwrap())
        });
        // RustCrypto `aes-gcm` 0.10 alone, in place, no allocation: the implementation `seal`
        // used before it moved to `ring`, kept as the comparison row (not `seal`'s ceiling).
        let cipher = Aes256Gcm::new_from_slice(&[7u8; 32]).unwrap();
        let mut buf = plain.clone();
        group.bench_function(BenchmarkId::new("aes-gcm-in-place", label), |b| {
            b.iter(|| {
                cipher
                    .encrypt_in_place_detached(Nonce::from_slice(&[0u8; 12]), b"", &mut buf)
                    .unwrap()
            })
        });
    }
    group.finish();
}

/// The chunked format a plan file is sealed in (`seal_stream`/`unseal_stream`, one chunk of
/// 1 MiB at a time), at a plan's usual few kilobytes and at one whole chunk: what a small
/// object costs beside the cipher (the chunk buffer's wipe, session 36).
fn stream(c: &mut Criterion) {
    let (sealer, mut group) = setup(c, "seal-stream");
    for (label, size) in [("4KiB", 4usize << 10), ("1MiB", 1usize << 20)] {
        let plain = plaintext(size);
        let mut sealed = Vec::new();
        sealer
            .seal_stream(Purpose::Plan, SUBJECT, &plain[..], &mut sealed)
            .unwrap();
        let mut out = Vec::with_capacity(sealed.len() + 64);
        group.throughput(Throughput::Bytes(size as u64));
        group.bench_with_input(BenchmarkId::new("seal", label), &plain, |b, p| {
            b.iter(|| {
                out.clear();
                sealer
                    .seal_stream(Purpose::Plan, SUBJECT, &p[..], &mut out)
                    .unwrap()
            })
        });
        group.bench_with_input(BenchmarkId::new("unseal", label), &sealed, |b, s| {
            b.iter(|| {
                out.clear();
                sealer
                    .unseal_stream(Purpose::Plan, SUBJECT, &s[..], &mut out)
                    .unwrap()
            })
        });
    }
    group.finish();
}

criterion_group!(benches, seal, stream);
criterion_main!(benches);

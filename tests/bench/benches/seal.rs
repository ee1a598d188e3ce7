//! Criterion: sealing and unsealing a plan file (AES-256-GCM through `takosumi_seal`, which
//! uses `ring`, with the envelope, associated data and allocations) at 1 MiB and at the
//! 19 MiB relay limit. The `aes-gcm-in-place` rows are RustCrypto `aes-gcm`, the cipher
//! `seal` used before, so the switch stays visible.
//! Runs only under `cargo bench`; figure 5 of the bench binary compares the same calls
//! with `openssl speed` from the same run.

use aes_gcm::aead::AeadInPlace;
use aes_gcm::{Aes256Gcm, KeyInit, Nonce};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use takosumi_core::Secret;
use takosumi_seal::{Purpose, Sealer};

const SUBJECT: &str = "run_0193a1b2c3d4e5f60718293a4b5c6d7e";

fn seal(c: &mut Criterion) {
    let sealer = Sealer::new("bench-1", &Secret::new(vec![7u8; 32])).unwrap();
    let mut group = c.benchmark_group("seal");
    group.sample_size(20);
    group.warm_up_time(std::time::Duration::from_millis(500));
    group.measurement_time(std::time::Duration::from_secs(3));
    for (label, size) in [("1MiB", 1usize << 20), ("19MiB", 19usize << 20)] {
        let plain: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
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

criterion_group!(benches, seal);
criterion_main!(benches);

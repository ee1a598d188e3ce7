//! Figure 5: sealing throughput (AES-256-GCM through `takosumi_seal`, with its envelope,
//! associated data and allocation) for 1 MiB and 19 MiB plan files, against `openssl
//! speed -evp aes-256-gcm` with the same block size, run now on the same machine. The
//! Criterion bench `benches/seal.rs` measures the same calls in more detail.

use std::time::Instant;

use aes_gcm::aead::AeadInPlace;
use aes_gcm::{Aes256Gcm, KeyInit, Nonce};
use takosumi_core::Secret;
use takosumi_seal::{Purpose, Sealer};

use crate::parse;
use crate::report::Report;
use crate::stats::Summary;

const SUBJECT: &str = "run_0193a1b2c3d4e5f60718293a4b5c6d7e";

/// Bytes per second of `openssl speed -evp aes-256-gcm [-decrypt] -bytes <size>`.
fn openssl(size: usize, decrypt: bool) -> anyhow::Result<f64> {
    let mut cmd = std::process::Command::new("openssl");
    cmd.args(["speed", "-evp", "aes-256-gcm", "-seconds", "2", "-bytes"])
        .arg(size.to_string());
    if decrypt {
        cmd.arg("-decrypt");
    }
    let out = cmd.output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    parse::openssl_speed(&text)
        .ok_or_else(|| anyhow::anyhow!("could not read `openssl speed` output: {text}"))
}

/// Median seconds per call of `f` over about a second (at least 5 calls).
fn time<F: FnMut()>(mut f: F) -> f64 {
    f();
    let mut samples = Vec::new();
    let start = Instant::now();
    while samples.len() < 5 || start.elapsed().as_secs_f64() < 1.0 {
        let t = Instant::now();
        f();
        samples.push(t.elapsed().as_secs_f64());
        if samples.len() >= 2000 {
            break;
        }
    }
    Summary::of(&samples).map_or(f64::NAN, |s| s.median)
}

/// Runs figure 5.
pub fn run(report: &mut Report) -> anyhow::Result<()> {
    let sealer = Sealer::new("bench-1", &Secret::new(vec![7u8; 32]))?;
    let mut lines = vec![
        "| size | seal | unseal | seal+unseal (one round trip) | aes-gcm 0.10 in place, no allocation: encrypt / round trip | ring 0.17 in place: encrypt | openssl encrypt | openssl decrypt | seal / openssl enc | unseal / openssl dec |".to_owned(),
        "|---|---|---|---|---|---|---|---|---|---|".to_owned(),
    ];
    let mut worst = f64::INFINITY;
    let mut summary = Vec::new();
    for (label, size) in [("1 MiB", 1usize << 20), ("19 MiB", 19usize << 20)] {
        let plain: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
        let sealed = sealer.seal(Purpose::Plan, SUBJECT, &plain)?;
        let seal_s = time(|| {
            let s = sealer.seal(Purpose::Plan, SUBJECT, &plain);
            std::hint::black_box(s.map(|v| v.len()).unwrap_or(0));
        });
        let unseal_s = time(|| {
            let s = sealer.unseal(Purpose::Plan, SUBJECT, &sealed);
            std::hint::black_box(s.map(|v| v.len()).unwrap_or(0));
        });
        // RustCrypto `aes-gcm` in place, with no copy and no allocation (a fixed nonce is
        // fine for timing, never for sealing): the cipher `seal` used before it moved to
        // `ring`, kept as a comparison.
        let cipher = Aes256Gcm::new_from_slice(&[7u8; 32])?;
        let nonce = Nonce::from_slice(&[0u8; 12]);
        let mut buf = plain.clone();
        let raw_enc_s = time(|| {
            let tag = cipher.encrypt_in_place_detached(nonce, b"", &mut buf);
            std::hint::black_box(tag.is_ok());
        });
        let raw_round_s = time(|| {
            if let Ok(tag) = cipher.encrypt_in_place_detached(nonce, b"", &mut buf) {
                let ok = cipher.decrypt_in_place_detached(nonce, b"", &mut buf, &tag);
                std::hint::black_box(ok.is_ok());
            }
        });
        // What another implementation of the same cipher does here (ring is already in the
        // dependency tree, through rustls): the reference for "could a switch reach openssl".
        let ring_key = ring::aead::LessSafeKey::new(
            ring::aead::UnboundKey::new(&ring::aead::AES_256_GCM, &[7u8; 32])
                .map_err(|_| anyhow::anyhow!("ring refused the key"))?,
        );
        let ring_s = time(|| {
            let nonce = ring::aead::Nonce::assume_unique_for_key([0u8; 12]);
            let tag =
                ring_key.seal_in_place_separate_tag(nonce, ring::aead::Aad::empty(), &mut buf);
            std::hint::black_box(tag.is_ok());
        });
        let enc = openssl(size, false)?;
        let dec = openssl(size, true)?;
        let gb = |bps: f64| format!("{:.2} GB/s", bps / 1e9);
        let (seal_bps, unseal_bps) = (size as f64 / seal_s, size as f64 / unseal_s);
        let round = size as f64 / (seal_s + unseal_s);
        let (r_seal, r_unseal) = (seal_bps / enc, unseal_bps / dec);
        worst = worst.min(r_seal).min(r_unseal);
        lines.push(format!(
            "| {label} | {} ({:.2} ms) | {} ({:.2} ms) | {} | {} / {} | {} | {} | {} | {r_seal:.2} | {r_unseal:.2} |",
            gb(seal_bps),
            seal_s * 1000.0,
            gb(unseal_bps),
            unseal_s * 1000.0,
            gb(round),
            gb(size as f64 / raw_enc_s),
            gb(size as f64 / raw_round_s),
            gb(size as f64 / ring_s),
            gb(enc),
            gb(dec),
        ));
        summary.push((label, seal_bps, unseal_bps, enc, dec));
    }
    let value = summary
        .iter()
        .map(|(l, s, u, _, _)| format!("{l}: seal {:.2} / unseal {:.2} GB/s", s / 1e9, u / 1e9))
        .collect::<Vec<_>>()
        .join("; ");
    let reference = summary
        .iter()
        .map(|(l, _, _, e, d)| format!("{l}: enc {:.2} / dec {:.2} GB/s", e / 1e9, d / 1e9))
        .collect::<Vec<_>>()
        .join("; ");
    report.row(
        "5. seal / unseal throughput",
        value,
        format!("openssl speed -evp aes-256-gcm: {reference}"),
        format!("worst {worst:.2}× openssl"),
        "≥ 0.5× openssl",
        Some(worst >= 0.5),
    );
    report.detail("5. sealing", lines);
    Ok(())
}

//! The machine a benchmark ran on: cores, CPU model, memory, kernel, OS and the versions of
//! every component in the measured path. Printed with the figures, since a figure means
//! nothing without the machine.

use std::process::Command;

/// One `name: value` line per fact.
pub fn describe(extra: &[(String, String)]) -> Vec<(String, String)> {
    let mut facts: Vec<(String, String)> = Vec::new();
    let mut add = |k: &str, v: Option<String>| {
        facts.push((k.to_owned(), v.unwrap_or_else(|| "unknown".to_owned())));
    };
    add(
        "cores (nproc)",
        std::thread::available_parallelism()
            .ok()
            .map(|n| n.to_string()),
    );
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    add(
        "CPU model",
        cpuinfo
            .lines()
            .find_map(|l| l.strip_prefix("model name"))
            .and_then(|v| v.split_once(':'))
            .map(|(_, v)| v.trim().to_owned()),
    );
    let flags = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("flags"))
        .unwrap_or_default();
    let has = |f: &str| flags.split_whitespace().any(|x| x == f);
    add(
        "CPU AES features",
        Some(
            ["aes", "pclmulqdq", "vaes", "vpclmulqdq", "avx2", "avx512f"]
                .iter()
                .filter(|f| has(f))
                .copied()
                .collect::<Vec<_>>()
                .join(" "),
        ),
    );
    add(
        "memory",
        std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|m| {
                m.lines()
                    .find_map(|l| l.strip_prefix("MemTotal:"))
                    .and_then(|v| v.split_whitespace().next())
                    .and_then(|v| v.parse::<f64>().ok())
            })
            .map(|kib| format!("{:.1} GiB", kib / 1024.0 / 1024.0)),
    );
    add(
        "kernel",
        std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .ok()
            .map(|s| s.trim().to_owned()),
    );
    add(
        "OS",
        std::fs::read_to_string("/etc/os-release")
            .ok()
            .and_then(|t| {
                t.lines()
                    .find_map(|l| l.strip_prefix("PRETTY_NAME="))
                    .map(|v| v.trim_matches('"').to_owned())
            }),
    );
    add("rustc", first_line("rustc", &["--version"]));
    add("git", first_line("git", &["--version"]));
    add("openssl", first_line("openssl", &["version"]));
    add("wrk", first_line("wrk", &["--version"]));
    for (k, v) in extra {
        facts.push((k.clone(), v.clone()));
    }
    facts
}

/// The first line a command prints (stdout, else stderr), if it runs at all.
pub fn first_line(program: &str, args: &[&str]) -> Option<String> {
    let out = Command::new(program).args(args).output().ok()?;
    let text = if out.stdout.is_empty() {
        out.stderr
    } else {
        out.stdout
    };
    String::from_utf8_lossy(&text)
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .map(str::to_owned)
}

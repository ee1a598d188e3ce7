//! What `/proc` says about a process (peak and current resident memory, CPU time) and
//! about the machine (CPU busy time), read without any helper tool.

use std::path::Path;

/// Resident memory of a process, in KiB.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Memory {
    /// `VmHWM`: the peak resident set since the process started.
    pub peak_kib: u64,
    /// `VmRSS`: the resident set now.
    pub now_kib: u64,
}

/// Parses `/proc/<pid>/status`'s `VmHWM` and `VmRSS`.
pub fn parse_status(text: &str) -> Option<Memory> {
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok())
    };
    Some(Memory {
        peak_kib: field("VmHWM:")?,
        now_kib: field("VmRSS:")?,
    })
}

/// The memory of process `pid`.
pub fn memory(pid: u32) -> anyhow::Result<Memory> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    parse_status(&text).ok_or_else(|| anyhow::anyhow!("no VmHWM/VmRSS for pid {pid}"))
}

/// CPU seconds a process used: its own (user + system) and its waited-for children's
/// (git and the tool, for a handler).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CpuTime {
    /// The process itself.
    pub own: f64,
    /// Its reaped children.
    pub children: f64,
}

fn ticks_per_sec() -> f64 {
    // `getconf CLK_TCK` is 100 on every Linux this project runs on; asking libc needs
    // unsafe code, which the workspace forbids.
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100.0)
}

/// Parses `/proc/<pid>/stat` (fields after the parenthesised command name).
pub fn parse_stat(text: &str, hz: f64) -> Option<CpuTime> {
    let rest = &text[text.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After ")": state(3) ppid … utime is field 14 overall, i.e. index 11 here.
    let n = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok());
    Some(CpuTime {
        own: (n(11)? + n(12)?) / hz,
        children: (n(13)? + n(14)?) / hz,
    })
}

/// CPU time of process `pid` (`"self"` works through [`cpu_of_path`]).
pub fn cpu(pid: u32) -> anyhow::Result<CpuTime> {
    cpu_of_path(Path::new(&format!("/proc/{pid}/stat")))
}

/// CPU time from a `/proc/…/stat` path.
pub fn cpu_of_path(path: &Path) -> anyhow::Result<CpuTime> {
    let text = std::fs::read_to_string(path)?;
    parse_stat(&text, ticks_per_sec())
        .ok_or_else(|| anyhow::anyhow!("unreadable {}", path.display()))
}

/// Machine-wide CPU seconds (summed over cores): busy and total, from `/proc/stat`.
pub fn machine_cpu() -> anyhow::Result<(f64, f64)> {
    let text = std::fs::read_to_string("/proc/stat")?;
    let line = text
        .lines()
        .next()
        .ok_or_else(|| anyhow::anyhow!("empty /proc/stat"))?;
    let v: Vec<f64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    let total: f64 = v.iter().take(8).sum();
    let idle = v.get(3).copied().unwrap_or(0.0) + v.get(4).copied().unwrap_or(0.0);
    let hz = ticks_per_sec();
    Ok(((total - idle) / hz, total / hz))
}

/// CPU seconds (own + reaped children) used so far by every process whose command name
/// (`/proc/<pid>/comm`) is in each group, e.g. `[["postgres"], ["beam.smp", "epmd"]]`.
/// Processes are only read, never signalled.
pub fn cpu_by_comm(groups: &[&[&str]]) -> Vec<f64> {
    let hz = ticks_per_sec();
    let mut sums = vec![0.0; groups.len()];
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return sums;
    };
    for entry in dir.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        let Ok(comm) = std::fs::read_to_string(format!("/proc/{pid}/comm")) else {
            continue;
        };
        let comm = comm.trim();
        let Some(g) = groups.iter().position(|g| g.contains(&comm)) else {
            continue;
        };
        if let Some(cpu) = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|t| parse_stat(&t, hz))
        {
            sums[g] += cpu.own + cpu.children;
        }
    }
    sums
}

/// `/proc/loadavg`'s first three fields.
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// Waits for `child` (process `pid`) to exit, sampling its `VmHWM` every 5 ms meanwhile;
/// returns its exit status and the last peak read, in KiB (the peak only grows, so the
/// last sample before exit is at most 5 ms of growth short).
pub async fn wait_with_peak(
    mut child: tokio::process::Child,
    pid: u32,
) -> anyhow::Result<(std::process::ExitStatus, u64)> {
    let mut peak = 0;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok((status, peak));
        }
        if let Ok(m) = memory(pid) {
            peak = peak.max(m.peak_kib);
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel's status and stat lines parse into peak/current memory and CPU time.
    #[test]
    fn parses_proc_files() {
        let status = "Name:\ttakosumi-plan\nVmPeak:\t  900000 kB\nVmHWM:\t   25600 kB\nVmRSS:\t   20480 kB\n";
        assert_eq!(
            parse_status(status),
            Some(Memory {
                peak_kib: 25600,
                now_kib: 20480
            })
        );
        let stat =
            "4242 (takosumi plan) S 1 4242 4242 0 -1 4194560 100 0 0 0 150 50 30 20 20 0 3 0 1 2 3";
        let cpu = parse_stat(stat, 100.0).unwrap();
        assert_eq!((cpu.own, cpu.children), (2.0, 0.5));
        // Our own process is readable.
        assert!(cpu_of_path(Path::new("/proc/self/stat")).is_ok());
        assert!(memory(std::process::id()).unwrap().peak_kib > 0);
    }

    /// Grouping by command name finds this very process and nothing for a made-up name.
    #[test]
    fn groups_by_command_name() {
        let me = std::fs::read_to_string("/proc/self/comm").unwrap();
        let sums = cpu_by_comm(&[&[me.trim()], &["no-such-command-x"]]);
        assert!(sums[0] >= 0.0);
        assert_eq!(sums[1], 0.0);
        assert_eq!(loadavg().split(' ').count(), 3);
    }
}

//! CPU time of a step process and everything it starts, through a cgroup of its own.
//!
//! A step's sandboxes (bubblewrap, git, the launcher, the tool) are never reaped by the
//! step: bubblewrap gives its command a pid namespace whose init nobody waits for, so
//! their CPU time reaches no `/proc/<pid>/stat` field of the step (its "children" stay
//! near zero while the sandboxes use several times its own time). A cgroup counts a
//! process's time as it is used, whoever reaps it. Made where the machine allows it
//! (root, a cgroup v1 `cpuacct` hierarchy or cgroup v2); elsewhere the figures fall back
//! to the reaped children and say so.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// Which accounting file a group reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Version {
    /// `cpuacct.usage`: nanoseconds.
    V1,
    /// `cpu.stat`'s `usage_usec`.
    V2,
}

/// A cgroup this process made, removed when dropped.
#[derive(Debug)]
pub struct CpuGroup {
    dir: PathBuf,
    version: Version,
}

impl CpuGroup {
    /// Makes the group `name` in the first hierarchy that takes it; `None` where none does.
    pub fn create(name: &str) -> Option<Self> {
        let candidates = [
            (Path::new("/sys/fs/cgroup/cpuacct"), Version::V1),
            (Path::new("/sys/fs/cgroup/cpu,cpuacct"), Version::V1),
            (Path::new("/sys/fs/cgroup"), Version::V2),
            (Path::new("/sys/fs/cgroup/unified"), Version::V2),
        ];
        candidates.iter().find_map(|&(root, version)| {
            let marker = match version {
                Version::V1 => "cpuacct.usage",
                Version::V2 => "cgroup.controllers",
            };
            if !root.join(marker).is_file() {
                return None;
            }
            let dir = root.join(name);
            std::fs::create_dir(&dir).ok()?;
            let group = Self { dir, version };
            // A group whose counter cannot be read is no use (and is removed on drop).
            group.usage_secs().map(|_| group)
        })
    }

    /// Moves process `pid` (all its threads) into the group; what it starts from now on
    /// is counted with it.
    pub fn add(&self, pid: u32) -> std::io::Result<()> {
        std::fs::write(self.dir.join("cgroup.procs"), pid.to_string())
    }

    /// CPU seconds every process in the group has used since it joined (summed over cores).
    pub fn usage_secs(&self) -> Option<f64> {
        match self.version {
            Version::V1 => std::fs::read_to_string(self.dir.join("cpuacct.usage"))
                .ok()
                .and_then(|s| s.trim().parse::<f64>().ok())
                .map(|ns| ns / 1e9),
            Version::V2 => std::fs::read_to_string(self.dir.join("cpu.stat"))
                .ok()
                .as_deref()
                .and_then(parse_usage_usec)
                .map(|us| us / 1e6),
        }
    }
}

impl Drop for CpuGroup {
    fn drop(&mut self) {
        // The group's processes were stopped; a sandbox killed with its parent may take
        // a moment to go, and a group with a process in it cannot be removed.
        for _ in 0..50 {
            if std::fs::remove_dir(&self.dir).is_ok() || !self.dir.exists() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        eprintln!(
            "bench: could not remove the cgroup {} (a process is still in it)",
            self.dir.display()
        );
    }
}

/// `usage_usec` from cgroup v2's `cpu.stat`.
fn parse_usage_usec(text: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix("usage_usec "))
        .and_then(|v| v.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_usage_from_a_v2_cpu_stat() {
        let text = "usage_usec 1234567\nuser_usec 1000000\nsystem_usec 234567\n";
        assert_eq!(parse_usage_usec(text), Some(1_234_567.0));
        assert_eq!(parse_usage_usec("user_usec 5\n"), None);
    }
}

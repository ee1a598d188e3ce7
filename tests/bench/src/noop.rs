//! `noop-terraform`: an **orchestration-only** stand-in for terraform. It answers exactly the
//! calls Takosumi's runner makes (`version -json`, `init`, `get`, `plan -out=FILE
//! [-destroy]`, `show -json FILE`, `apply FILE`, `output -json`) instantly, so a benchmark
//! run through it measures Takosumi's own work (queueing, claims, checkout, sealing, object
//! storage, commits) and none of the tool's. It manages no infrastructure and talks to no
//! provider; its version string says so (`0.0.0-noop`).
//!
//! What it writes is well formed: the plan file is a real (stored, uncompressed) zip archive
//! like terraform's, `show -json` prints a plan in terraform's JSON format with one
//! `create` change, and `apply` writes a version-4 state file where the backend override
//! points (its serial goes up on every apply, so Takosumi records a new StateVersion each
//! time). The plan file's size is `TF_VAR_noop_plan_bytes` (a Capsule variable
//! `noop_plan_bytes`), default about 1 KiB, so a benchmark can move a 19 MiB plan.

use std::io::Write;
use std::path::{Path, PathBuf};

/// The version every answer reports: never mistaken for a real terraform.
pub const VERSION: &str = "0.0.0-noop";
/// Said in every answer that has room for it.
pub const NOTE: &str =
    "noop-terraform: orchestration-only no-op tool for benchmarks; not terraform, applies nothing";
/// The Capsule variable (as `TF_VAR_…`) that sets the plan file size in bytes.
pub const PLAN_BYTES_VAR: &str = "TF_VAR_noop_plan_bytes";
/// The file Takosumi's backend override is written to.
const OVERRIDE_FILE: &str = "zz_takosumi_override.tf";
/// The name of the entry that describes the plan inside the plan archive.
const PLAN_ENTRY: &str = "tfplan";

/// What one invocation printed and its exit code.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Answer {
    /// Standard output.
    pub stdout: Vec<u8>,
    /// Standard error.
    pub stderr: Vec<u8>,
    /// Exit code.
    pub code: i32,
}

impl Answer {
    fn ok(stdout: impl Into<Vec<u8>>) -> Self {
        Self {
            stdout: stdout.into(),
            ..Self::default()
        }
    }

    fn fail(message: impl std::fmt::Display) -> Self {
        Self {
            stderr: format!("Error: {message}\n({NOTE})\n").into_bytes(),
            code: 1,
            ..Self::default()
        }
    }
}

/// Runs one invocation in `cwd` with `plan_bytes` from the environment (see
/// [`PLAN_BYTES_VAR`]). Unknown commands and missing files fail with exit code 1, the way
/// terraform does, so a runner bug is not hidden by a stand-in that accepts anything.
pub fn run(args: &[String], cwd: &Path, plan_bytes: Option<&str>) -> Answer {
    let Some((command, rest)) = args.split_first() else {
        return Answer::fail("no command given");
    };
    let flag = |name: &str| rest.iter().any(|a| a == name);
    let positional: Vec<&String> = rest.iter().filter(|a| !a.starts_with('-')).collect();
    match command.as_str() {
        "version" | "-version" | "--version" => {
            if flag("-json") {
                let v = serde_json::json!({
                    "terraform_version": VERSION,
                    "platform": "linux_amd64",
                    "provider_selections": {},
                    "terraform_outdated": false,
                    "note": NOTE,
                });
                Answer::ok(format!("{v}\n"))
            } else {
                Answer::ok(format!("Terraform v{VERSION}\n{NOTE}\n"))
            }
        }
        "init" => Answer::ok(format!(
            "Terraform has been successfully initialized! ({NOTE})\n"
        )),
        "get" => Answer::ok(""),
        "plan" => {
            let destroy = flag("-destroy");
            let size = match plan_bytes.map(str::parse::<u64>) {
                None => None,
                Some(Ok(n)) => Some(n),
                Some(Err(_)) => return Answer::fail(format!("{PLAN_BYTES_VAR} is not a number")),
            };
            let summary = if destroy {
                "Plan: 0 to add, 0 to change, 1 to destroy.\n"
            } else {
                "Plan: 1 to add, 0 to change, 0 to destroy.\n"
            };
            let Some(out) = rest.iter().find_map(|a| a.strip_prefix("-out=")) else {
                return Answer::ok(summary);
            };
            let bytes = plan_file(destroy, size.unwrap_or(0));
            match write_file(&resolve(cwd, out), &bytes) {
                Ok(()) => Answer::ok(format!("{summary}Saved the plan to: {out}\n")),
                Err(e) => Answer::fail(format!("writing the plan file {out}: {e}")),
            }
        }
        "show" => {
            let Some(file) = positional.first() else {
                return Answer::fail("show needs a plan file");
            };
            if !flag("-json") {
                return Answer::fail("only `show -json FILE` is supported");
            }
            match read_plan(&resolve(cwd, file)) {
                Ok(destroy) => Answer::ok(format!("{}\n", show_json(destroy))),
                Err(e) => Answer::fail(e),
            }
        }
        "apply" => {
            let Some(file) = positional.first() else {
                return Answer::fail("only `apply FILE` (a saved plan) is supported");
            };
            if let Err(e) = read_plan(&resolve(cwd, file)) {
                return Answer::fail(e);
            }
            let state = state_path(cwd);
            let serial = std::fs::read(&state)
                .ok()
                .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
                .and_then(|v| v["serial"].as_u64())
                .unwrap_or(0);
            let body = serde_json::json!({
                "version": 4,
                "terraform_version": VERSION,
                "serial": serial + 1,
                "lineage": "noop-terraform",
                "outputs": { "noop": { "value": "ok", "type": "string" } },
                "resources": [],
            });
            match write_file(&state, format!("{body}\n").as_bytes()) {
                Ok(()) => Answer::ok(
                    "Apply complete! Resources: 1 added, 0 changed, 0 destroyed.\n\nOutputs:\n\nnoop = \"ok\"\n",
                ),
                Err(e) => Answer::fail(format!("writing the state {}: {e}", state.display())),
            }
        }
        "output" => {
            if !flag("-json") {
                return Answer::fail("only `output -json` is supported");
            }
            Answer::ok("{\"noop\":{\"sensitive\":false,\"type\":\"string\",\"value\":\"ok\"}}\n")
        }
        other => Answer::fail(format!("unsupported command {other:?}")),
    }
}

fn resolve(cwd: &Path, file: &str) -> PathBuf {
    let p = Path::new(file);
    if p.is_absolute() {
        p.to_path_buf()
    } else {
        cwd.join(p)
    }
}

fn write_file(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let mut f = std::fs::File::create(path)?;
    f.write_all(bytes)?;
    f.sync_data()
}

/// Where `apply` writes state: the `path` of the `local` backend in Takosumi's override
/// file if there is one, else `terraform.tfstate` (terraform's default).
pub fn state_path(cwd: &Path) -> PathBuf {
    let text = std::fs::read_to_string(cwd.join(OVERRIDE_FILE)).unwrap_or_default();
    let path = text.lines().find_map(|l| {
        let rest = l
            .trim()
            .strip_prefix("path")?
            .trim_start()
            .strip_prefix('=')?;
        let rest = rest.trim().strip_prefix('"')?;
        Some(rest[..rest.find('"')?].to_owned())
    });
    resolve(cwd, path.as_deref().unwrap_or("terraform.tfstate"))
}

/// The plan's JSON as `show -json` prints it: one `null_resource.noop` to create (or to
/// delete, for a destroy plan), in terraform 1.0's format.
pub fn show_json(destroy: bool) -> serde_json::Value {
    let actions = if destroy { "delete" } else { "create" };
    serde_json::json!({
        "format_version": "0.2",
        "terraform_version": VERSION,
        "planned_values": { "root_module": {} },
        "resource_changes": [{
            "address": "null_resource.noop",
            "mode": "managed",
            "type": "null_resource",
            "name": "noop",
            "provider_name": "registry.terraform.io/hashicorp/null",
            "change": { "actions": [actions], "before": null, "after": {}, "after_unknown": {} }
        }],
        "output_changes": {
            "noop": { "actions": ["create"], "before": null, "after": "ok", "after_unknown": false }
        },
        "configuration": { "root_module": {} },
        "note": NOTE,
    })
}

/// A plan file: a zip archive (stored entries) holding a small `tfplan` entry that records
/// whether it is a destroy plan and, if `size` asks for more, a `padding` entry that brings
/// the whole file to exactly `size` bytes.
pub fn plan_file(destroy: bool, size: u64) -> Vec<u8> {
    let meta = serde_json::json!({ "noop": true, "destroy": destroy, "note": NOTE }).to_string();
    let base = zip(&[(PLAN_ENTRY, meta.as_bytes())]);
    // A second entry costs two headers and its name twice.
    let entry_overhead = (30 + 46 + 2 * "padding".len()) as u64;
    let target = usize::try_from(size).unwrap_or(usize::MAX);
    if size <= base.len() as u64 + entry_overhead {
        return base;
    }
    let pad_len = target - base.len() - entry_overhead as usize;
    let padding: Vec<u8> = (0..pad_len).map(|i| (i % 251) as u8).collect();
    zip(&[(PLAN_ENTRY, meta.as_bytes()), ("padding", &padding)])
}

/// Reads a plan file written by [`plan_file`]: checks it is a zip archive whose first
/// entry is the plan and whose checksum matches; returns whether it is a destroy plan.
pub fn read_plan(path: &Path) -> Result<bool, String> {
    use std::io::Read;
    let mut f = std::fs::File::open(path)
        .map_err(|e| format!("reading the plan file {}: {e}", path.display()))?;
    let mut head = vec![0u8; 30 + PLAN_ENTRY.len()];
    f.read_exact(&mut head)
        .map_err(|_| format!("{} is not a plan file", path.display()))?;
    if &head[..4] != b"PK\x03\x04" || &head[30..] != PLAN_ENTRY.as_bytes() {
        return Err(format!(
            "{} is not a plan file (not a zip archive holding {PLAN_ENTRY})",
            path.display()
        ));
    }
    let u32_at = |i: usize| u32::from_le_bytes([head[i], head[i + 1], head[i + 2], head[i + 3]]);
    let (crc, len) = (u32_at(14), u32_at(22) as usize);
    let mut body = vec![0u8; len];
    f.read_exact(&mut body)
        .map_err(|_| format!("{} is truncated", path.display()))?;
    if crc32(&body) != crc {
        return Err(format!("{} is corrupt (checksum mismatch)", path.display()));
    }
    let meta: serde_json::Value = serde_json::from_slice(&body)
        .map_err(|_| format!("{} does not hold a no-op plan", path.display()))?;
    Ok(meta["destroy"].as_bool().unwrap_or(false))
}

/// A zip archive of stored (uncompressed) entries, dated 1980-01-01.
pub fn zip(entries: &[(&str, &[u8])]) -> Vec<u8> {
    let total: usize = entries
        .iter()
        .map(|(n, d)| 76 + 2 * n.len() + d.len())
        .sum();
    let mut out = Vec::with_capacity(total + 22);
    let mut central = Vec::new();
    for (name, data) in entries {
        let offset = out.len() as u32;
        let crc = crc32(data);
        let size = data.len() as u32;
        let name_len = name.len() as u16;
        // Local file header.
        out.extend_from_slice(&0x0403_4b50u32.to_le_bytes());
        for v in [20u16, 0, 0, 0, 0x21] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        for v in [crc, size, size] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&name_len.to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(data);
        // Central directory header.
        central.extend_from_slice(&0x0201_4b50u32.to_le_bytes());
        for v in [20u16, 20, 0, 0, 0, 0x21] {
            central.extend_from_slice(&v.to_le_bytes());
        }
        for v in [crc, size, size] {
            central.extend_from_slice(&v.to_le_bytes());
        }
        for v in [name_len, 0, 0, 0, 0] {
            central.extend_from_slice(&v.to_le_bytes());
        }
        central.extend_from_slice(&0u32.to_le_bytes());
        central.extend_from_slice(&offset.to_le_bytes());
        central.extend_from_slice(name.as_bytes());
    }
    let cd_offset = out.len() as u32;
    let cd_size = central.len() as u32;
    out.extend_from_slice(&central);
    out.extend_from_slice(&0x0605_4b50u32.to_le_bytes());
    let n = entries.len() as u16;
    for v in [0u16, 0, n, n] {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out.extend_from_slice(&cd_size.to_le_bytes());
    out.extend_from_slice(&cd_offset.to_le_bytes());
    out.extend_from_slice(&0u16.to_le_bytes());
    out
}

const fn crc_table() -> [u32; 256] {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 {
                0xEDB8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
            k += 1;
        }
        table[i] = c;
        i += 1;
    }
    table
}

static CRC_TABLE: [u32; 256] = crc_table();

/// CRC-32 (IEEE), as zip uses it.
pub fn crc32(data: &[u8]) -> u32 {
    let mut c = 0xFFFF_FFFFu32;
    for &b in data {
        c = CRC_TABLE[((c ^ u32::from(b)) & 0xFF) as usize] ^ (c >> 8);
    }
    c ^ 0xFFFF_FFFF
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| (*s).to_owned()).collect()
    }

    /// The CRC is the standard one ("123456789" → 0xCBF43926), so other zip readers agree.
    #[test]
    fn crc32_is_ieee() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
        assert_eq!(crc32(b""), 0);
    }

    /// The plan file is a zip archive Python's zipfile (an independent reader) accepts,
    /// of exactly the size asked for, and `show -json` reads back whether it destroys.
    #[test]
    fn plan_file_is_a_valid_zip_of_the_requested_size() {
        let dir = tempfile::tempdir().unwrap();
        for (destroy, size) in [(false, 0u64), (true, 4096), (false, 19 * 1024 * 1024)] {
            let bytes = plan_file(destroy, size);
            if size > 1024 {
                assert_eq!(bytes.len() as u64, size);
            }
            let path = dir.path().join(format!("p{size}"));
            std::fs::write(&path, &bytes).unwrap();
            assert_eq!(read_plan(&path).unwrap(), destroy);
            if let Ok(out) = std::process::Command::new("python3")
                .args(["-m", "zipfile", "-t"])
                .arg(&path)
                .output()
            {
                assert!(
                    out.status.success(),
                    "{}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        }
        let bad = dir.path().join("bad");
        std::fs::write(&bad, b"not a plan").unwrap();
        assert!(read_plan(&bad).is_err());
    }

    /// Every call the runner makes is answered: version JSON, init, plan writing the file,
    /// show reading it, apply writing state where the override points (serial growing),
    /// and output JSON. Anything else fails, like the real tool.
    #[test]
    fn answers_the_runner_calls() {
        let dir = tempfile::tempdir().unwrap();
        let cwd = dir.path().join("checkout/infra");
        std::fs::create_dir_all(&cwd).unwrap();
        std::fs::write(
            cwd.join(OVERRIDE_FILE),
            "terraform {\n  backend \"local\" {\n    path = \"../../state/terraform.tfstate\"\n  }\n}\n",
        )
        .unwrap();

        let v = run(&args(&["version", "-json"]), &cwd, None);
        let v: serde_json::Value = serde_json::from_slice(&v.stdout).unwrap();
        assert_eq!(v["terraform_version"], VERSION);
        assert_eq!(run(&args(&["init", "-input=false"]), &cwd, None).code, 0);
        assert_eq!(run(&args(&["get"]), &cwd, None).code, 0);

        let plan = dir.path().join("plan/tfplan");
        let out = format!("-out={}", plan.display());
        let a = run(
            &args(&["plan", "-input=false", "-no-color", &out]),
            &cwd,
            Some("2048"),
        );
        assert_eq!(a.code, 0, "{}", String::from_utf8_lossy(&a.stderr));
        assert_eq!(std::fs::metadata(&plan).unwrap().len(), 2048);
        let show = run(
            &args(&["show", "-json", plan.to_str().unwrap()]),
            &cwd,
            None,
        );
        let show: serde_json::Value = serde_json::from_slice(&show.stdout).unwrap();
        assert_eq!(
            show["resource_changes"][0]["change"]["actions"][0],
            "create"
        );

        for serial in [1, 2] {
            let a = run(
                &args(&["apply", "-input=false", "-no-color", plan.to_str().unwrap()]),
                &cwd,
                None,
            );
            assert_eq!(a.code, 0, "{}", String::from_utf8_lossy(&a.stderr));
            let state = dir.path().join("state/terraform.tfstate");
            let s: serde_json::Value =
                serde_json::from_slice(&std::fs::read(state).unwrap()).unwrap();
            assert_eq!(s["serial"], serial);
        }
        let o = run(&args(&["output", "-json"]), &cwd, None);
        let o: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(o["noop"]["value"], "ok");

        assert_eq!(run(&args(&["destroy"]), &cwd, None).code, 1);
        assert_eq!(run(&args(&["apply"]), &cwd, None).code, 1);
        assert_eq!(run(&args(&["plan", &out]), &cwd, Some("lots")).code, 1);
        let missing = run(&args(&["show", "-json", "/nonexistent/tfplan"]), &cwd, None);
        assert_eq!(missing.code, 1);
    }

    /// Without an override file, state goes to terraform's default file.
    #[test]
    fn default_state_path() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(state_path(dir.path()), dir.path().join("terraform.tfstate"));
    }
}

//! The CLI's configuration file: the API URL and token `takosumi login` saved, used when
//! neither a flag nor the environment gives them. It lives at `$TAKOSUMI_CONFIG`, else
//! `$XDG_CONFIG_HOME/takosumi/config.toml`, else `~/.config/takosumi/config.toml`, is
//! written with mode 0600 (its directory 0700), and a file others can read is refused
//! rather than used: it holds a bearer token. The token is never printed. Also here: the
//! client every other command uses, built from the flags, the environment and this file.

use std::fs;
use std::io::Write as _;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use clap::error::ErrorKind;
use takosumi_client::{Client, DEFAULT_URL, TOKEN_ENV};

use super::render::{print_json, report_error};
use super::{EXIT_FAILED, EXIT_USAGE, usage_error};

/// Names the configuration file.
pub(crate) const CONFIG_ENV: &str = "TAKOSUMI_CONFIG";

/// What the file holds.
#[derive(Default)]
pub(crate) struct Config {
    /// The API's base URL.
    pub(crate) url: Option<String>,
    /// The API token. No `Debug`: it must not be printed.
    pub(crate) token: Option<String>,
}

/// Where the configuration file is.
pub(crate) fn path() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os(CONFIG_ENV).filter(|p| !p.is_empty()) {
        return Ok(PathBuf::from(p));
    }
    let base = match std::env::var_os("XDG_CONFIG_HOME").filter(|p| !p.is_empty()) {
        Some(dir) => PathBuf::from(dir),
        None => match std::env::var_os("HOME").filter(|p| !p.is_empty()) {
            Some(home) => PathBuf::from(home).join(".config"),
            None => {
                return Err(format!(
                    "cannot tell where the configuration file goes: set {CONFIG_ENV} (or HOME)"
                ));
            }
        },
    };
    Ok(base.join("takosumi").join("config.toml"))
}

/// Reads the file; a missing file is an empty configuration.
pub(crate) fn load(path: &Path) -> Result<Config, String> {
    let text = match fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Config::default()),
        Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
    };
    let mode = fs::metadata(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?
        .permissions()
        .mode();
    if mode & 0o077 != 0 {
        return Err(format!(
            "{} holds an API token but other users can read it (mode {:o}); run `chmod 600 {}` and try again",
            path.display(),
            mode & 0o777,
            path.display()
        ));
    }
    parse(&text).map_err(|e| {
        format!(
            "{} is not a valid configuration ({e}); run `takosumi login` to write it again",
            path.display()
        )
    })
}

/// `key = "value"` lines (the TOML subset this file uses); `#` comments and blank lines.
fn parse(text: &str) -> Result<Config, String> {
    let mut config = Config::default();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (key, value) = line
            .split_once('=')
            .ok_or_else(|| format!("line {} is not `key = \"value\"`", n + 1))?;
        let value = unquote(value.trim())
            .ok_or_else(|| format!("line {}: the value is not a quoted string", n + 1))?;
        match key.trim() {
            "url" => config.url = Some(value),
            "token" => config.token = Some(value),
            other => return Err(format!("line {}: unknown key `{other}`", n + 1)),
        }
    }
    Ok(config)
}

fn unquote(v: &str) -> Option<String> {
    let inner = v.strip_prefix('"')?.strip_suffix('"')?;
    let mut out = String::new();
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next()? {
                '\\' => out.push('\\'),
                '"' => out.push('"'),
                _ => return None,
            },
            '"' => return None,
            c => out.push(c),
        }
    }
    Some(out)
}

fn quote(v: &str) -> String {
    format!("\"{}\"", v.replace('\\', "\\\\").replace('"', "\\\""))
}

/// Writes the file with mode 0600 (its directory created 0700): written beside it and
/// renamed over it, so a reader never sees half a file.
pub(crate) fn save(path: &Path, url: &str, token: &str) -> Result<(), String> {
    if url.contains('\n') || token.contains('\n') || token.contains('\r') {
        return Err("the URL and the token must be one line each".into());
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty())
        && !dir.exists()
    {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    }
    let tmp = path.with_extension("toml.tmp");
    let _ = fs::remove_file(&tmp);
    let body = format!(
        "# Written by `takosumi login`. Holds an API token: keep it private (mode 0600).\nurl = {}\ntoken = {}\n",
        quote(url),
        quote(token)
    );
    let write = || -> std::io::Result<()> {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(body.as_bytes())?;
        f.sync_all()?;
        fs::set_permissions(&tmp, fs::Permissions::from_mode(0o600))?;
        fs::rename(&tmp, path)
    };
    write().map_err(|e| {
        let _ = fs::remove_file(&tmp);
        format!("cannot write {}: {e}", path.display())
    })
}

/// `takosumi login`: reads the token (the flag or environment, else stdin), checks it
/// against the API (`GET /workspaces`), and only then saves it. Returns the exit code.
pub(crate) async fn login(url: &str, token: Option<String>, json: bool) -> u8 {
    use std::io::{BufRead as _, IsTerminal as _};
    let token = match token.filter(|t| !t.is_empty()) {
        Some(t) => t,
        None => {
            let stdin = std::io::stdin();
            if stdin.is_terminal() {
                eprint!("API token (input is shown; prefer piping it in): ");
            }
            let mut line = String::new();
            if let Err(e) = stdin.lock().read_line(&mut line) {
                eprintln!("error: cannot read the token from stdin: {e}");
                return EXIT_USAGE;
            }
            line.trim().to_owned()
        }
    };
    if token.is_empty() {
        eprintln!(
            "error: no token given\nhint: pipe it in (`printf %s \"$TOKEN\" | takosumi login --url {url}`) or set {}",
            TOKEN_ENV
        );
        return EXIT_USAGE;
    }
    let client = match Client::new(url, &token) {
        Ok(c) => c,
        Err(e) => {
            eprintln!(
                "error: {e}\nhint: pass the API's base URL, e.g. --url http://127.0.0.1:8080"
            );
            return EXIT_USAGE;
        }
    };
    let visible = match client.list_workspaces().await {
        Ok(list) => list.len(),
        Err(err) => {
            let code = report_error(&err);
            eprintln!("nothing was saved");
            return code;
        }
    };
    let path = match path() {
        Ok(p) => p,
        Err(message) => {
            eprintln!("error: {message}");
            return EXIT_USAGE;
        }
    };
    if let Err(message) = save(&path, url, &token) {
        eprintln!("error: {message}");
        return EXIT_FAILED;
    }
    if json {
        print_json(&serde_json::json!({
            "url": url, "config": path.display().to_string(), "workspaces": visible
        }));
    } else {
        println!(
            "logged in to {url} ({visible} Workspace(s) visible); saved to {} (mode 0600)",
            path.display()
        );
    }
    0
}

/// The API client for a command: the URL and token from the flags or the environment
/// first, then what `takosumi login` saved. Without a token, or with a file that cannot
/// be used, it stops with a usage error (exit 2): nothing is sent.
pub(crate) fn client(url: Option<String>, token: Option<String>) -> Client {
    let saved = if token.as_deref().is_none_or(str::is_empty) || url.is_none() {
        match path().map(|p| load(&p)) {
            Ok(Ok(saved)) => saved,
            Ok(Err(message)) => usage_error(ErrorKind::Io, message),
            Err(_) => Config::default(),
        }
    } else {
        Config::default()
    };
    let url = url.or(saved.url).unwrap_or_else(|| DEFAULT_URL.to_owned());
    let Some(token) = token.filter(|t| !t.is_empty()).or(saved.token) else {
        usage_error(
            ErrorKind::MissingRequiredArgument,
            format!("no API token: run `takosumi login`, or set {TOKEN_ENV} (or pass --token)"),
        );
    };
    Client::new(&url, &token).unwrap_or_else(|err| usage_error(ErrorKind::InvalidValue, err))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `save` writes, `load` reads back; the file is 0600 and a file others can read
    /// is refused with the command that fixes it.
    #[test]
    fn round_trip_and_permissions() {
        let dir = tempfile_dir();
        let path = dir.join("sub").join("config.toml");
        save(&path, "http://127.0.0.1:8080", "tks_a\"b\\c").unwrap();
        let mode = fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let c = load(&path).unwrap();
        assert_eq!(c.url.as_deref(), Some("http://127.0.0.1:8080"));
        assert_eq!(c.token.as_deref(), Some("tks_a\"b\\c"));
        fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).unwrap();
        let err = load(&path).err().unwrap();
        assert!(err.contains("chmod 600"), "{err}");
        assert!(!err.contains("tks_a"), "{err}");
        assert!(load(&dir.join("missing.toml")).unwrap().token.is_none());
        let _ = fs::remove_dir_all(&dir);
    }

    fn tempfile_dir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "takosumi-config-test-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        fs::create_dir_all(&dir).unwrap();
        dir
    }
}

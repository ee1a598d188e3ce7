//! One typed settings struct, loaded once in `main` from `TAKOSUMI_*` variables. Secret
//! settings are wrapped so they never print.

use std::collections::HashMap;
use std::path::PathBuf;

use takosumi_core::{Secret, read_secret};
use takosumi_runner::RunnerConfig;

/// Missing or invalid settings, all named at once.
#[derive(Debug, thiserror::Error)]
#[error("invalid settings: {}", problems.join("; "))]
pub struct SettingsError {
    /// What is wrong, one entry per variable (names only, never values).
    pub problems: Vec<String>,
}

/// Everything a Takosumi process is configured with.
#[derive(Debug, Clone)]
pub struct Settings {
    /// `TAKOSUMI_DATABASE_URL`.
    pub database_url: Secret<String>,
    /// `TAKOSUMI_AMQP_URL`.
    pub amqp_url: Secret<String>,
    /// `TAKOSUMI_S3_ENDPOINT` (unset for AWS S3 itself).
    pub s3_endpoint: Option<String>,
    /// `TAKOSUMI_S3_REGION` (default `us-east-1`).
    pub s3_region: String,
    /// `TAKOSUMI_S3_ACCESS_KEY`.
    pub s3_access_key: String,
    /// `TAKOSUMI_S3_SECRET_KEY`.
    pub s3_secret_key: Secret<String>,
    /// `TAKOSUMI_S3_BUCKET`.
    pub s3_bucket: String,
    /// `TAKOSUMI_SEAL_KEY`: 32 bytes, base64.
    pub seal_key: Secret<String>,
    /// `TAKOSUMI_SEAL_KEY_ID`.
    pub seal_key_id: String,
    /// The runner: tool binaries, CLI configuration, `TAKOSUMI_WORK_DIR` (where private
    /// run directories are made), the sandbox and the step time limits (see
    /// [`RunnerConfig::from_settings`], shared with the relay worker).
    pub runner: RunnerConfig,
    /// `TAKOSUMI_WORK_DIR`.
    pub work_dir: PathBuf,
    /// `TAKOSUMI_LISTEN` (default `127.0.0.1:8080`).
    pub listen: String,
    /// `TAKOSUMI_METRICS_LISTEN` (e.g. `0.0.0.0:9090`): where `/metrics` is served, on a
    /// port of its own. Unset: no metrics listener.
    pub metrics_listen: Option<String>,
    /// `TAKOSUMI_ADMIN_TOKEN`: a bootstrap admin token.
    pub admin_token: Option<Secret<String>>,
    /// `TAKOSUMI_LEASE_SECS` (default 60).
    pub lease_secs: i64,
    /// `TAKOSUMI_MAX_ATTEMPTS`: claims of a plan before it fails (default 3).
    pub max_attempts: i32,
    /// `TAKOSUMI_CONCURRENCY`: messages a step process handles at once (default 2).
    pub concurrency: u16,
    /// `TAKOSUMI_REAPER_INTERVAL_MS` (default 2000).
    pub reaper_interval_ms: u64,
    /// `TAKOSUMI_STUCK_QUEUED_SECS`: a queued Run untouched this long is woken again (default 60).
    pub stuck_queued_secs: i64,
    /// `TAKOSUMI_PRICING_CATALOGUE`: a price catalogue file (the format of
    /// `infra/pricing/catalogue.json`) the gate's cost check uses instead of the built-in
    /// one, for a team's own negotiated prices. Unset: the built-in catalogue.
    pub pricing_catalogue: Option<PathBuf>,
    /// `TAKOSUMI_ALLOW_FILE_REPOS=true`: Capsules may name local repositories (`file://…`
    /// or an absolute path). For local use only; off by default.
    pub allow_file_repos: bool,
    /// `TAKOSUMI_EVIDENCE_KEY` (or `_FILE`): the Ed25519 seed (32 bytes, standard base64)
    /// the API signs each Run's evidence statement with. Only the API needs it (it refuses to
    /// start without it, see [`Settings::evidence_signer`]); the steps never do.
    pub evidence_key: Option<Secret<String>>,
    /// `TAKOSUMI_EVIDENCE_KEY_ID` (default `evidence-1`): the id statements name; a new key
    /// gets a new id.
    pub evidence_key_id: String,
    /// `TAKOSUMI_EVIDENCE_PREVIOUS_KEYS`: rotated-out public keys, `id:base64,…`, still
    /// published so the statements they signed stay verifiable.
    pub evidence_previous_keys: Vec<takosumi_evidence::PublicKey>,
    /// `TAKOSUMI_PG_STATEMENT_TIMEOUT_MS` (default 30000), `TAKOSUMI_PG_LOCK_TIMEOUT_MS`
    /// (default 5000) and `TAKOSUMI_PG_ACQUIRE_TIMEOUT_MS` (default 10000): how long the
    /// database may keep a caller waiting (see [`takosumi_store::PgTimeouts`]; 0 turns the
    /// statement or lock timeout off).
    pub pg_timeouts: takosumi_store::PgTimeouts,
    /// `TAKOSUMI_PG_MAX_CONNECTIONS` (default 10, at least 2): the most connections the
    /// process's pool opens. Every process has one pool (the API two more listening
    /// connections and a 4-connection pool for the history page), so the fleet's largest
    /// size times this must stay under the server's `max_connections`.
    pub pg_max_connections: u32,
    /// `TAKOSUMI_S3_CONNECT_TIMEOUT_MS` (default 5000), `TAKOSUMI_S3_ATTEMPT_TIMEOUT_MS`
    /// (default 120000) and `TAKOSUMI_S3_OPERATION_TIMEOUT_MS` (default 150000): how long
    /// one storage request may take (see [`takosumi_objects::ObjectTimeouts`]).
    pub s3_timeouts: takosumi_objects::ObjectTimeouts,
}

impl Settings {
    /// Reads the process environment.
    pub fn from_env() -> Result<Self, SettingsError> {
        let vars: HashMap<String, String> = std::env::vars()
            // PATH: where the tools are looked up (RunnerConfig::from_settings)
            .filter(|(k, _)| k.starts_with("TAKOSUMI_") || k == "PATH")
            .collect();
        Self::from_map(&vars)
    }

    /// Reads settings from a map of `TAKOSUMI_*` names (tests build one by hand).
    pub fn from_map(vars: &HashMap<String, String>) -> Result<Self, SettingsError> {
        let mut problems = Vec::new();
        let get = |k: &str| vars.get(k).filter(|v| !v.is_empty()).cloned();
        let mut secret = |k: &str, required: bool| -> Option<Secret<String>> {
            match read_secret(vars, k) {
                Ok(Some(v)) => Some(Secret::new(v)),
                Ok(None) if required => {
                    problems.push(format!("{k} (or {k}_FILE) is not set"));
                    Some(Secret::new(String::new()))
                }
                Ok(None) => None,
                Err(e) => {
                    problems.push(e);
                    Some(Secret::new(String::new()))
                }
            }
        };
        let database_url = secret("TAKOSUMI_DATABASE_URL", true).unwrap_or_default();
        let amqp_url = secret("TAKOSUMI_AMQP_URL", true).unwrap_or_default();
        let s3_secret_key = secret("TAKOSUMI_S3_SECRET_KEY", true).unwrap_or_default();
        let seal_key = secret("TAKOSUMI_SEAL_KEY", true).unwrap_or_default();
        let admin_token = secret("TAKOSUMI_ADMIN_TOKEN", false);
        let evidence_key = secret("TAKOSUMI_EVIDENCE_KEY", false);
        let mut required = |k: &str| {
            get(k).unwrap_or_else(|| {
                problems.push(format!("{k} is not set"));
                String::new()
            })
        };
        let s3_access_key = required("TAKOSUMI_S3_ACCESS_KEY");
        let s3_bucket = required("TAKOSUMI_S3_BUCKET");
        let work_dir = PathBuf::from(required("TAKOSUMI_WORK_DIR"));
        let runner = RunnerConfig::from_settings(get).unwrap_or_else(|mut p| {
            problems.append(&mut p);
            RunnerConfig::new("terraform", &work_dir)
        });
        let mut number = |k: &str, default: i64| -> i64 {
            match get(k) {
                None => default,
                Some(v) => v.parse().unwrap_or_else(|_| {
                    problems.push(format!("{k} must be a whole number"));
                    default
                }),
            }
        };
        let lease_secs = number("TAKOSUMI_LEASE_SECS", 60).max(1);
        let max_attempts = i32::try_from(number("TAKOSUMI_MAX_ATTEMPTS", 3))
            .unwrap_or(3)
            .max(1);
        let concurrency = u16::try_from(number("TAKOSUMI_CONCURRENCY", 2))
            .unwrap_or(2)
            .max(1);
        let reaper_interval_ms = u64::try_from(number("TAKOSUMI_REAPER_INTERVAL_MS", 2000))
            .unwrap_or(2000)
            .max(50);
        let stuck_queued_secs = number("TAKOSUMI_STUCK_QUEUED_SECS", 60).max(1);
        // Fewer than two: a step holding its claim's connection could not also keep its lease.
        let pg_max_connections = u32::try_from(number("TAKOSUMI_PG_MAX_CONNECTIONS", 10))
            .unwrap_or(10)
            .clamp(2, 1000);
        let mut millis = |k: &str, default: std::time::Duration, min_ms: u64| {
            let ms = u64::try_from(number(k, i64::try_from(default.as_millis()).unwrap_or(0)))
                .unwrap_or(0);
            std::time::Duration::from_millis(if ms == 0 { 0 } else { ms.max(min_ms) })
        };
        let pg_default = takosumi_store::PgTimeouts::default();
        let pg_timeouts = takosumi_store::PgTimeouts {
            statement: millis(
                "TAKOSUMI_PG_STATEMENT_TIMEOUT_MS",
                pg_default.statement,
                100,
            ),
            lock: millis("TAKOSUMI_PG_LOCK_TIMEOUT_MS", pg_default.lock, 100),
            acquire: millis("TAKOSUMI_PG_ACQUIRE_TIMEOUT_MS", pg_default.acquire, 100)
                .max(std::time::Duration::from_millis(100)),
        };
        let s3_default = takosumi_objects::ObjectTimeouts::default();
        let s3_timeouts = takosumi_objects::ObjectTimeouts {
            connect: millis("TAKOSUMI_S3_CONNECT_TIMEOUT_MS", s3_default.connect, 100)
                .max(std::time::Duration::from_millis(100)),
            attempt: millis("TAKOSUMI_S3_ATTEMPT_TIMEOUT_MS", s3_default.attempt, 100)
                .max(std::time::Duration::from_millis(100)),
            operation: millis(
                "TAKOSUMI_S3_OPERATION_TIMEOUT_MS",
                s3_default.operation,
                100,
            )
            .max(std::time::Duration::from_millis(100)),
        };
        let allow_file_repos = match get("TAKOSUMI_ALLOW_FILE_REPOS").as_deref() {
            None | Some("false") => false,
            Some("true") => true,
            Some(_) => {
                problems.push("TAKOSUMI_ALLOW_FILE_REPOS must be true or false".into());
                false
            }
        };
        let evidence_key_id =
            get("TAKOSUMI_EVIDENCE_KEY_ID").unwrap_or_else(|| "evidence-1".to_owned());
        if let Some(key) = &evidence_key
            && let Err(e) =
                takosumi_evidence::Signer::from_seed_base64(&evidence_key_id, key.expose())
        {
            problems.push(format!(
                "TAKOSUMI_EVIDENCE_KEY / TAKOSUMI_EVIDENCE_KEY_ID: {e}"
            ));
        }
        let evidence_previous_keys = takosumi_evidence::PublicKey::parse_list(
            &get("TAKOSUMI_EVIDENCE_PREVIOUS_KEYS").unwrap_or_default(),
        )
        .unwrap_or_else(|e| {
            problems.push(format!("TAKOSUMI_EVIDENCE_PREVIOUS_KEYS: {e}"));
            Vec::new()
        });
        if !problems.is_empty() {
            return Err(SettingsError { problems });
        }
        Ok(Self {
            database_url,
            amqp_url,
            s3_endpoint: get("TAKOSUMI_S3_ENDPOINT"),
            s3_region: get("TAKOSUMI_S3_REGION").unwrap_or_else(|| "us-east-1".to_owned()),
            s3_access_key,
            s3_secret_key,
            s3_bucket,
            seal_key,
            seal_key_id: get("TAKOSUMI_SEAL_KEY_ID").unwrap_or_else(|| "k1".to_owned()),
            runner,
            work_dir,
            listen: get("TAKOSUMI_LISTEN").unwrap_or_else(|| "127.0.0.1:8080".to_owned()),
            metrics_listen: get("TAKOSUMI_METRICS_LISTEN"),
            admin_token,
            lease_secs,
            max_attempts,
            concurrency,
            reaper_interval_ms,
            stuck_queued_secs,
            pricing_catalogue: get("TAKOSUMI_PRICING_CATALOGUE").map(PathBuf::from),
            allow_file_repos,
            evidence_key,
            evidence_key_id,
            evidence_previous_keys,
            pg_timeouts,
            pg_max_connections,
            s3_timeouts,
        })
    }

    /// The evidence signing key. The API signs a statement for every Run that ends; one
    /// started without a key would leave Runs without evidence, so it refuses to start
    /// and says how to make one.
    pub fn evidence_signer(&self) -> Result<takosumi_evidence::Signer, SettingsError> {
        let Some(key) = &self.evidence_key else {
            return Err(SettingsError {
                problems: vec![
                    "TAKOSUMI_EVIDENCE_KEY (or TAKOSUMI_EVIDENCE_KEY_FILE) is not set: the API signs every Run's evidence statement with it; make one with `takosumi-api evidence-keygen --key-id <id>`".to_owned(),
                ],
            });
        };
        takosumi_evidence::Signer::from_seed_base64(&self.evidence_key_id, key.expose()).map_err(
            |e| SettingsError {
                problems: vec![format!("TAKOSUMI_EVIDENCE_KEY: {e}")],
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn full() -> HashMap<String, String> {
        [
            ("TAKOSUMI_DATABASE_URL", "postgres://u:canary-db-pass@h/db"),
            ("TAKOSUMI_AMQP_URL", "amqp://g:canary-amqp@h/%2f"),
            ("TAKOSUMI_S3_ACCESS_KEY", "k"),
            ("TAKOSUMI_S3_SECRET_KEY", "canary-s3-secret"),
            ("TAKOSUMI_S3_BUCKET", "b"),
            ("TAKOSUMI_SEAL_KEY", "canary-seal"),
            ("TAKOSUMI_WORK_DIR", "/tmp/w"),
            ("TAKOSUMI_ADMIN_TOKEN", "canary-admin"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
    }

    #[test]
    fn missing_settings_are_all_named() {
        let err = Settings::from_map(&HashMap::new()).unwrap_err();
        let text = err.to_string();
        for k in [
            "TAKOSUMI_DATABASE_URL",
            "TAKOSUMI_AMQP_URL",
            "TAKOSUMI_S3_BUCKET",
            "TAKOSUMI_SEAL_KEY",
        ] {
            assert!(text.contains(k), "{text}");
        }
    }

    #[test]
    fn secrets_never_print() {
        let s = Settings::from_map(&full()).unwrap();
        let printed = format!("{s:?}");
        assert!(!printed.contains("canary"), "{printed}");
        assert_eq!(s.lease_secs, 60);
        assert_eq!(s.listen, "127.0.0.1:8080");
    }

    #[test]
    fn the_evidence_key_is_checked_and_never_printed() {
        let mut m = full();
        assert!(Settings::from_map(&m).unwrap().evidence_signer().is_err());
        let (_, seed) = takosumi_evidence::Signer::generate("x").unwrap();
        m.insert("TAKOSUMI_EVIDENCE_KEY".into(), seed.to_string());
        m.insert("TAKOSUMI_EVIDENCE_KEY_ID".into(), "e2".into());
        let (old, _) = takosumi_evidence::Signer::generate("e1").unwrap();
        m.insert(
            "TAKOSUMI_EVIDENCE_PREVIOUS_KEYS".into(),
            old.public_key().to_entry(),
        );
        let s = Settings::from_map(&m).unwrap();
        assert_eq!(s.evidence_signer().unwrap().key_id(), "e2");
        assert_eq!(s.evidence_previous_keys, vec![old.public_key()]);
        assert!(!format!("{s:?}").contains(seed.as_str()));
        m.insert("TAKOSUMI_EVIDENCE_KEY".into(), "short".into());
        m.insert("TAKOSUMI_EVIDENCE_PREVIOUS_KEYS".into(), "e1".into());
        let text = Settings::from_map(&m).unwrap_err().to_string();
        assert!(
            text.contains("TAKOSUMI_EVIDENCE_KEY /")
                && text.contains("TAKOSUMI_EVIDENCE_PREVIOUS_KEYS"),
            "{text}"
        );
        assert!(!text.contains("short"), "{text}");
    }

    #[test]
    fn dependency_timeouts_have_defaults_and_can_be_set() {
        let s = Settings::from_map(&full()).unwrap();
        assert_eq!(s.pg_timeouts, takosumi_store::PgTimeouts::default());
        assert_eq!(s.pg_timeouts.statement, std::time::Duration::from_secs(30));
        assert_eq!(s.pg_timeouts.lock, std::time::Duration::from_secs(5));
        assert_eq!(s.s3_timeouts, takosumi_objects::ObjectTimeouts::default());
        let mut m = full();
        m.insert("TAKOSUMI_PG_STATEMENT_TIMEOUT_MS".into(), "1500".into());
        m.insert("TAKOSUMI_PG_LOCK_TIMEOUT_MS".into(), "0".into());
        m.insert("TAKOSUMI_PG_ACQUIRE_TIMEOUT_MS".into(), "2000".into());
        m.insert("TAKOSUMI_S3_ATTEMPT_TIMEOUT_MS".into(), "700".into());
        let s = Settings::from_map(&m).unwrap();
        assert_eq!(
            s.pg_timeouts.statement,
            std::time::Duration::from_millis(1500)
        );
        assert_eq!(
            s.pg_timeouts.lock,
            std::time::Duration::ZERO,
            "0 turns it off"
        );
        assert_eq!(s.pg_timeouts.acquire, std::time::Duration::from_secs(2));
        assert_eq!(s.s3_timeouts.attempt, std::time::Duration::from_millis(700));
        assert_eq!(Settings::from_map(&full()).unwrap().pg_max_connections, 10);
        for (given, used) in [("4", 4), ("1", 2), ("0", 2), ("5000", 1000)] {
            m.insert("TAKOSUMI_PG_MAX_CONNECTIONS".into(), given.into());
            assert_eq!(
                Settings::from_map(&m).unwrap().pg_max_connections,
                used,
                "{given}"
            );
        }
        m.insert("TAKOSUMI_PG_MAX_CONNECTIONS".into(), "many".into());
        assert!(
            Settings::from_map(&m)
                .unwrap_err()
                .to_string()
                .contains("TAKOSUMI_PG_MAX_CONNECTIONS")
        );
        m.remove("TAKOSUMI_PG_MAX_CONNECTIONS");
        m.insert("TAKOSUMI_PG_LOCK_TIMEOUT_MS".into(), "soon".into());
        assert!(
            Settings::from_map(&m)
                .unwrap_err()
                .to_string()
                .contains("TAKOSUMI_PG_LOCK_TIMEOUT_MS")
        );
    }

    #[test]
    fn bad_numbers_are_refused() {
        let mut m = full();
        m.insert("TAKOSUMI_LEASE_SECS".into(), "soon".into());
        assert!(
            Settings::from_map(&m)
                .unwrap_err()
                .to_string()
                .contains("TAKOSUMI_LEASE_SECS")
        );
    }
}

//! Provider lockfile continuity (an apply installs exactly the providers its plan locked)
//! and the dependency snapshot, shared by the plan step (which reads its own lockfile artifact back before the plan may succeed) and the
//! apply step (which installs the plan Run's lockfile before `init`).
//!
//! A Run's lockfile artifact is trusted only when all of these hold: the Run has a
//! reference to it (else `lockfile_missing`); the reference lies under the Run's own
//! object prefix (else `lockfile_cross_run`: it belongs to another Run); the object exists
//! (else `lockfile_missing`); it and the bytes sealed inside it are within the 1 MiB limit
//! (else `lockfile_too_large`); it opens under the Run's own id as a lockfile and its
//! bytes hash to the recorded `providerLockDigest` (else `lockfile_mismatch`). Messages
//! name neither the object key nor any lockfile byte: both are private.

use takosumi_core::{FailureCode, ProviderLockState, RunId, StepError};
use takosumi_objects::ObjectError;
use takosumi_runner::{MAX_LOCKFILE_BYTES, RunnerError, Workdir};
use takosumi_seal::{Purpose, SealError};

use crate::Ctx;
use crate::step::object_err;

/// The largest sealed lockfile read back: 1 MiB of bytes plus the envelope (header,
/// nonce, tag), with room to spare. Anything larger cannot hold a lockfile within limits.
pub const MAX_SEALED_LOCKFILE: u64 = MAX_LOCKFILE_BYTES + 4096;

/// Why a Run's lockfile artifact was not used.
#[derive(Debug)]
pub enum LockfileError {
    /// The artifact cannot be trusted: the Run fails with this code and message (which
    /// says what to do next and names no key or byte).
    Refused(FailureCode, String),
    /// Storage or an internal fault; not a verdict on the artifact.
    Step(StepError),
}

impl LockfileError {
    fn refused(code: FailureCode, message: &str) -> Self {
        Self::Refused(code, message.to_owned())
    }
}

/// The object-key prefix every artifact of `run_id` lives under.
pub fn run_prefix(run_id: RunId) -> String {
    format!("runs/{run_id}/")
}

/// The dependency snapshot: one digest over the installed module tree
/// ([`takosumi_runner::module_tree_digest`]) and the provider lock digest (`None` for a
/// provider-free run, written as `null` so it can never collide with a digest). Plan and
/// apply both compute it with this function, so a changed module or lockfile changes it.
pub use takosumi_steps::dependency_snapshot;

/// [`takosumi_runner::module_tree_digest`] of the run directory's Capsule directory, off
/// the async threads (a module tree can be large).
pub async fn installed_modules_digest(wd: &Workdir) -> Result<String, RunnerError> {
    let dir = wd.config_dir().to_path_buf();
    tokio::task::spawn_blocking(move || takosumi_runner::module_tree_digest(&dir))
        .await
        .map_err(|e| RunnerError::Io {
            context: "digesting the installed modules".into(),
            source: std::io::Error::other(e.to_string()),
        })?
}

impl Ctx {
    /// Reads the lockfile artifact recorded for `owner` (the Run it was sealed for) at
    /// `key`, and returns its bytes only if they are exactly the ones `digest` names. See
    /// the module documentation for each refusal.
    pub async fn load_lockfile(
        &self,
        owner: RunId,
        key: Option<&str>,
        digest: &str,
    ) -> Result<Vec<u8>, LockfileError> {
        let Some(key) = key else {
            return Err(LockfileError::refused(
                FailureCode::LockfileMissing,
                "the Run records a provider lockfile digest but no stored lockfile; plan again",
            ));
        };
        if !key.starts_with(&run_prefix(owner)) {
            return Err(LockfileError::refused(
                FailureCode::LockfileCrossRun,
                "the Run's lockfile reference points at another Run's artifact; nothing was run with it; plan again",
            ));
        }
        let sealed = match self.objects.get(key, MAX_SEALED_LOCKFILE).await {
            Ok(sealed) => sealed,
            Err(ObjectError::NotFound) => {
                return Err(LockfileError::refused(
                    FailureCode::LockfileMissing,
                    "the Run's stored provider lockfile is missing from object storage; plan again",
                ));
            }
            Err(ObjectError::TooLarge { .. }) => {
                return Err(LockfileError::refused(
                    FailureCode::LockfileTooLarge,
                    "the Run's stored provider lockfile is over the 1 MiB (1048576 bytes) limit; plan again",
                ));
            }
            Err(e) => return Err(LockfileError::Step(object_err(e))),
        };
        let bytes = match self
            .sealer
            .unseal(Purpose::Lockfile, &owner.to_string(), &sealed)
        {
            Ok(bytes) => bytes,
            Err(SealError::UnknownKey { .. }) => {
                return Err(LockfileError::refused(
                    FailureCode::LockfileMismatch,
                    "the Run's stored provider lockfile was sealed with a key this server does not hold; plan again",
                ));
            }
            Err(_) => {
                return Err(LockfileError::refused(
                    FailureCode::LockfileMismatch,
                    "the Run's stored provider lockfile does not open as this Run's lockfile (modified, or moved from another Run); plan again",
                ));
            }
        };
        if bytes.len() as u64 > MAX_LOCKFILE_BYTES {
            return Err(LockfileError::refused(
                FailureCode::LockfileTooLarge,
                "the Run's stored provider lockfile is over the 1 MiB (1048576 bytes) limit; plan again",
            ));
        }
        if takosumi_store::sha256_hex(&bytes) != digest {
            return Err(LockfileError::refused(
                FailureCode::LockfileMismatch,
                "the Run's stored provider lockfile does not match its providerLockDigest; plan again",
            ));
        }
        Ok(bytes)
    }

    /// The lockfile an apply of `plan_run` must install, by what the plan recorded: none
    /// for a provider-free plan; the plan Run's own artifact, checked as
    /// [`Ctx::load_lockfile`] says, when one is present; refused (`lockfile_mismatch`) for
    /// an `unknown` record, which is never regenerated. The apply handler and the relay
    /// (delivering a pool's apply) both decide here.
    pub async fn planned_lockfile(
        &self,
        plan_run: &takosumi_store::runs::Run,
    ) -> Result<Option<(Vec<u8>, String)>, LockfileError> {
        match (
            plan_run.provider_lock_state,
            plan_run.provider_lock_digest.as_deref(),
        ) {
            (ProviderLockState::None, _) => Ok(None),
            (ProviderLockState::Present, Some(digest)) => {
                let bytes = self
                    .load_lockfile(plan_run.id, plan_run.lockfile_object_key.as_deref(), digest)
                    .await?;
                Ok(Some((bytes, digest.to_owned())))
            }
            (ProviderLockState::Present, None) => Err(LockfileError::refused(
                FailureCode::LockfileMismatch,
                "the plan's lockfile record is incomplete; plan again",
            )),
            (ProviderLockState::Unknown, _) => Err(LockfileError::refused(
                FailureCode::LockfileMismatch,
                "the plan has no lockfile record (made by an older runner); plan again",
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_distinguishes_null_from_any_digest() {
        let m = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
        let none = dependency_snapshot(m, None);
        let empty = dependency_snapshot(m, Some(m));
        assert_ne!(none, empty);
        assert_eq!(none, dependency_snapshot(m, None));
        assert_ne!(none, dependency_snapshot(&"0".repeat(64), None));
        assert_eq!(none.len(), 64);
    }

    #[test]
    fn prefix_is_per_run() {
        let a = RunId::new();
        let b = RunId::new();
        assert!(crate::step::lockfile_key(a, 3).starts_with(&run_prefix(a)));
        assert!(!crate::step::lockfile_key(b, 1).starts_with(&run_prefix(a)));
    }
}

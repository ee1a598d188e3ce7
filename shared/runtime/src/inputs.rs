//! What a run's tool environment is built from, fresh for every plan and apply: the Run's
//! variables (the Capsule's defaults with the submission's overrides merged over them),
//! its sealed sensitive variables, and the credentials of every ProviderBinding attached
//! to the Capsule (env sets, a token as `TAKOSUMI_TOKEN`, command-source credentials run
//! in the run's private directory).
//!
//! Every secret value goes into the [`ToolEnv`] with `with_secret_env` /
//! `with_sensitive_variables`, which registers it with the run's masker before any tool
//! starts. Only names are recorded on the Run (`providerBindings`, `injectedEnvNames`);
//! values live in this process's memory (zeroized on drop) and in the tool's environment,
//! and vanish with the run's private directory.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};
use takosumi_core::{EventKind, FailureCode, RunId, Secret, StepError};
use takosumi_runner::{ToolEnv, Workdir, check_env_name};
use takosumi_seal::Purpose;
use takosumi_store::bindings;
use takosumi_store::capsules::Capsule;
use takosumi_store::runs::Run;
use takosumi_store::runs::source::RunSource;
use zeroize::Zeroize;

use crate::Ctx;
use takosumi_store::StoreError;

/// The variables a token credential is exposed as: `TAKOSUMI_TOKEN` and, as the seed
/// names it, `SWITCHTENDER_TOKEN` (the same value under both).
pub const TOKEN_ENVS: [&str; 2] = ["TAKOSUMI_TOKEN", "SWITCHTENDER_TOKEN"];
pub use takosumi_runner::CREDENTIAL_COMMAND_TIMEOUT;

/// The values of a ProviderBinding, as sealed at rest (JSON, purpose `credential`, subject
/// = the binding id). Zeroized when dropped; `Debug` shows no value.
#[derive(Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "camelCase")]
pub enum CredentialSet {
    /// Environment entries, name → value.
    Env {
        /// The entries.
        env: BTreeMap<String, String>,
    },
    /// One token, exposed under each of [`TOKEN_ENVS`].
    Token {
        /// The token.
        token: String,
    },
    /// A command whose trimmed stdout is the value of `env_name`, run for every run.
    Command {
        /// Program and arguments.
        command: Vec<String>,
        /// The variable its output is exposed as.
        #[serde(rename = "envName")]
        env_name: String,
    },
}

impl CredentialSet {
    /// `env`, `token` or `command`.
    pub fn kind(&self) -> takosumi_core::BindingKind {
        match self {
            Self::Env { .. } => takosumi_core::BindingKind::Env,
            Self::Token { .. } => takosumi_core::BindingKind::Token,
            Self::Command { .. } => takosumi_core::BindingKind::Command,
        }
    }

    /// The names it injects.
    pub fn env_names(&self) -> Vec<String> {
        match self {
            Self::Env { env } => env.keys().cloned().collect(),
            Self::Token { .. } => TOKEN_ENVS.iter().map(|n| (*n).to_owned()).collect(),
            Self::Command { env_name, .. } => vec![env_name.clone()],
        }
    }

    /// What an env or token set injects, as it is stored; `None` for a command set, whose
    /// value is its command's output, resolved for every run.
    pub fn static_entries(&self) -> Option<Vec<(String, String)>> {
        match self {
            Self::Env { env } => Some(env.iter().map(|(k, v)| (k.clone(), v.clone())).collect()),
            Self::Token { token } => Some(
                TOKEN_ENVS
                    .iter()
                    .map(|n| ((*n).to_owned(), token.clone()))
                    .collect(),
            ),
            Self::Command { .. } => None,
        }
    }
}

impl std::fmt::Debug for CredentialSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CredentialSet")
            .field("kind", &self.kind())
            .field("env_names", &self.env_names())
            .finish()
    }
}

impl Drop for CredentialSet {
    fn drop(&mut self) {
        match self {
            Self::Env { env } => {
                for value in env.values_mut() {
                    value.zeroize();
                }
            }
            Self::Token { token } => token.zeroize(),
            Self::Command { command, .. } => command.iter_mut().for_each(Zeroize::zeroize),
        }
    }
}

/// The sealing subject of a plan Run's sensitive variables.
pub fn sensitive_vars_subject(run_id: RunId) -> String {
    format!("{run_id}/sensitive-vars")
}

/// The sealing subject of a Run's plain variables: their values are not stored on the
/// record, they stay sealed where the pipeline reads them.
pub fn run_vars_subject(run_id: RunId) -> String {
    format!("{run_id}/vars")
}

/// Seals a Run's plain variables for its row (`runs::NewRun::vars`, `bindings::settle_run_vars`): their names (sorted) and
/// the sealed JSON object.
pub fn seal_run_vars(
    sealer: &takosumi_seal::Sealer,
    run_id: RunId,
    vars: &Map<String, Value>,
) -> Result<(Vec<String>, Vec<u8>), StepError> {
    let names: Vec<String> = vars.keys().cloned().collect();
    let mut plain = serde_json::to_vec(vars).map_err(StepError::internal)?;
    let sealed = sealer.seal(Purpose::Credential, &run_vars_subject(run_id), &plain);
    plain.zeroize();
    Ok((names, sealed.map_err(StepError::internal)?))
}

/// What a plan step checks out (the Run's source, read before its claim on both hosts):
/// a drift check with nothing applied fails `not_applied` here, before anything runs.
pub fn check_plan_source(source: &RunSource) -> Result<(), EnvError> {
    if source.no_baseline {
        return Err(EnvError::Fail(
            FailureCode::NotApplied,
            takosumi_store::runs::source::NOT_APPLIED.into(),
        ));
    }
    Ok(())
}

impl Ctx {
    /// A plan whose submission gave no variables has them settled before its tool's
    /// environment is built (by the control node's plan step and the relay's job endpoint
    /// alike): a drift check's from the Run behind the Capsule's current StateVersion
    /// (reality is compared with what was applied, at its commit and with its variables),
    /// any other's from the Capsule, sealed on the Run so its record and its apply use the
    /// same values. `source` is the Run's, checked by [`check_plan_source`].
    pub async fn settle_plan_vars(
        &self,
        run: &Run,
        capsule: &Capsule,
        source: &RunSource,
    ) -> Result<(), EnvError> {
        if run.vars.is_some()
            || bindings::sealed_run_vars(&self.pool, run.id)
                .await?
                .is_some()
        {
            return Ok(());
        }
        let vars = match source.baseline_run {
            Some(baseline) => {
                let baseline = takosumi_store::runs::get(&self.pool, baseline)
                    .await?
                    .ok_or_else(|| {
                        StepError::Poison(format!("the applied Run {baseline} is gone"))
                    })?;
                self.run_variables(&baseline, capsule).await?
            }
            None => capsule.vars.as_object().cloned().unwrap_or_default(),
        };
        let (names, sealed) = seal_run_vars(&self.sealer, run.id, &vars)?;
        drop(vars);
        bindings::settle_run_vars(&self.pool, run.id, &names, &sealed).await?;
        Ok(())
    }

    /// The plain variables a step of `inputs_of` runs with: the ones sealed at its
    /// submission, a Run recorded before sealing's plain ones, else the Capsule's own.
    pub async fn run_variables(
        &self,
        inputs_of: &Run,
        capsule: &Capsule,
    ) -> Result<Map<String, Value>, EnvError> {
        let value =
            match bindings::sealed_run_vars(&self.pool, inputs_of.id).await? {
                Some(sealed) => {
                    let mut plain = self
                    .sealer
                    .unseal(Purpose::Credential, &run_vars_subject(inputs_of.id), &sealed)
                    .map_err(|e| {
                        EnvError::Fail(
                            FailureCode::CredentialFailed,
                            format!(
                                "the variables of {} cannot be opened ({e}); submit the plan again",
                                inputs_of.id
                            ),
                        )
                    })?;
                    let parsed = serde_json::from_slice(&plain);
                    plain.zeroize();
                    parsed.map_err(|_| {
                        EnvError::Fail(
                            FailureCode::CredentialFailed,
                            format!(
                                "the variables of {} are not readable; submit the plan again",
                                inputs_of.id
                            ),
                        )
                    })?
                }
                None => inputs_of
                    .vars
                    .clone()
                    .unwrap_or_else(|| capsule.vars.clone()),
            };
        Ok(value.as_object().cloned().unwrap_or_default())
    }
}

/// Why the environment could not be built.
#[derive(Debug)]
pub enum EnvError {
    /// The Run fails with this code and message (bad configuration, a credential that
    /// cannot be resolved). The message names bindings and variables, never values.
    Fail(FailureCode, String),
    /// A storage fault.
    Step(StepError),
}

impl From<StepError> for EnvError {
    fn from(e: StepError) -> Self {
        Self::Step(e)
    }
}

impl From<StoreError> for EnvError {
    fn from(e: StoreError) -> Self {
        Self::Step(e.into())
    }
}

/// Opens a Capsule's sealed ProviderBinding: `("ProviderBinding \"name\" (pb_…)", set)`.
/// One that does not open or parse fails the Run `credential_failed` (create it again).
/// The control node's environment and a relay job's secrets are built through it.
pub fn open_binding(
    sealer: &takosumi_seal::Sealer,
    sealed: &bindings::SealedBinding,
) -> Result<(String, CredentialSet), EnvError> {
    let b = &sealed.binding;
    let what = format!("ProviderBinding {:?} ({})", b.name, b.id);
    let mut plain = sealer
        .unseal(Purpose::Credential, &b.id.to_string(), &sealed.sealed)
        .map_err(|e| {
            EnvError::Fail(
                FailureCode::CredentialFailed,
                format!("{what} cannot be opened ({e}); create it again"),
            )
        })?;
    let parsed: Result<CredentialSet, _> = serde_json::from_slice(&plain);
    plain.zeroize();
    let set = parsed.map_err(|_| {
        EnvError::Fail(
            FailureCode::CredentialFailed,
            format!("{what} is not readable; create it again"),
        )
    })?;
    Ok((what, set))
}

/// The names a Run's environment already injects, and who set each: a credential that
/// names a reserved or invalid variable, or one something else already sets, is refused
/// (`invalid_configuration`), never silently overwritten.
#[derive(Debug, Default)]
pub struct Injected {
    taken: BTreeMap<String, String>,
}

impl Injected {
    /// Starts from the Run's own variables (`TF_VAR_…` names).
    pub fn new(variables: impl IntoIterator<Item = String>) -> Self {
        Self {
            taken: variables
                .into_iter()
                .map(|n| (n, "the run's variables".to_owned()))
                .collect(),
        }
    }

    /// Takes `name` for `what`.
    pub fn claim(&mut self, name: &str, what: &str) -> Result<(), EnvError> {
        if let Err(reason) = check_env_name(name) {
            return Err(EnvError::Fail(
                FailureCode::InvalidConfiguration,
                format!("{what} sets {name:?}, which cannot be injected: {reason}"),
            ));
        }
        if let Some(other) = self.taken.get(name) {
            return Err(EnvError::Fail(
                FailureCode::InvalidConfiguration,
                format!(
                    "{what} and {other} both set {name:?}; detach one of them from the Capsule"
                ),
            ));
        }
        self.taken.insert(name.to_owned(), what.to_owned());
        Ok(())
    }
}

impl Ctx {
    /// Builds the tool environment for a step of `record_on` (the running Run) from the
    /// inputs of `inputs_of` (the same Run for a plan; the plan Run for an apply) and the
    /// Capsule's ProviderBindings, resolved now. Records the bindings' ids and names and
    /// every injected variable name on `record_on`, and an event saying the same.
    pub async fn run_env(
        &self,
        record_on: RunId,
        inputs_of: &Run,
        capsule: &Capsule,
        wd: &Workdir,
    ) -> Result<ToolEnv, EnvError> {
        let vars = self.run_variables(inputs_of, capsule).await?;
        let var_names: Vec<String> = vars.keys().cloned().collect();
        let mut env = ToolEnv::new()
            .with_variables(&vars)
            .map_err(|e| EnvError::Fail(FailureCode::InvalidConfiguration, e.to_string()))?;

        if let Some((names, sealed)) = bindings::sensitive_vars(&self.pool, inputs_of.id).await? {
            let subject = sensitive_vars_subject(inputs_of.id);
            let mut plain = self
                .sealer
                .unseal(Purpose::Credential, &subject, &sealed)
                .map_err(|e| {
                    EnvError::Fail(
                        FailureCode::CredentialFailed,
                        format!("the sensitive variables of {} cannot be opened ({e}); submit the plan again", inputs_of.id),
                    )
                })?;
            let parsed: Result<Map<String, Value>, _> = serde_json::from_slice(&plain);
            plain.zeroize();
            let sensitive = parsed.map_err(|_| {
                EnvError::Fail(
                    FailureCode::CredentialFailed,
                    format!(
                        "the sensitive variables {names:?} are not readable; submit the plan again"
                    ),
                )
            })?;
            env = env
                .with_sensitive_variables(&sensitive)
                .map_err(|e| EnvError::Fail(FailureCode::InvalidConfiguration, e.to_string()))?;
            drop(sensitive);
        }

        let mut used = Vec::new();
        let mut taken = Injected::new(env.names());
        for sealed in bindings::sealed_for_capsule(&self.pool, capsule.id).await? {
            let b = &sealed.binding;
            let (what, set) = open_binding(&self.sealer, &sealed)?;
            let entries: Vec<(String, Secret<String>)> = match &set {
                CredentialSet::Env { .. } | CredentialSet::Token { .. } => set
                    .static_entries()
                    .unwrap_or_default()
                    .into_iter()
                    .map(|(k, v)| (k, Secret::new(v)))
                    .collect(),
                CredentialSet::Command { command, env_name } => {
                    let value = self
                        .runner
                        .resolve_command(wd, command, env_name, CREDENTIAL_COMMAND_TIMEOUT)
                        .await
                        .map_err(|e| {
                            EnvError::Fail(FailureCode::CredentialFailed, format!("{what}: {e}"))
                        })?;
                    vec![(env_name.clone(), value)]
                }
            };
            drop(set);
            for (name, value) in entries {
                taken.claim(&name, &what)?;
                env = env.with_secret_env(&name, value);
            }
            used.push(json!({ "id": b.id, "name": b.name, "kind": b.kind }));
        }

        let names = env.names();
        let used = Value::Array(used);
        // A plan's Run shows the generation of the state it restores (from this Capsule
        // row) from now on, as a relayed plan's does from its job's delivery.
        let plan_generation = (inputs_of.kind.is_plan_like() && record_on == inputs_of.id)
            .then_some(capsule.state_generation);
        // An apply has no variables of its own: it shows the names of the plan's.
        bindings::record_run_env(
            &self.pool,
            record_on,
            &self.owner,
            &used,
            &names,
            &var_names,
            plan_generation,
        )
        .await?;
        self.event(
            record_on,
            EventKind::EnvironmentPrepared,
            json!({ "providerBindings": used, "injectedEnvNames": names }),
        )
        .await;
        Ok(env)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credential_sets_round_trip_and_never_print_values() {
        let sets = [
            json!({"kind": "env", "env": {"AWS_ACCESS_KEY_ID": "AKIA-canary", "AWS_SECRET_ACCESS_KEY": "s3cr3t-canary"}}),
            json!({"kind": "token", "token": "tok-canary"}),
            json!({"kind": "command", "command": ["vault", "read", "x"], "envName": "VAULT_CRED"}),
        ];
        let names = [
            vec!["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"],
            TOKEN_ENVS.to_vec(),
            vec!["VAULT_CRED"],
        ];
        for (json, want) in sets.iter().zip(names) {
            let set: CredentialSet = serde_json::from_value(json.clone()).unwrap();
            assert_eq!(set.env_names(), want);
            assert_eq!(&serde_json::to_value(&set).unwrap(), json);
            assert!(!format!("{set:?}").contains("canary"));
        }
        assert!(serde_json::from_value::<CredentialSet>(json!({"kind": "other"})).is_err());
        assert_eq!(
            sensitive_vars_subject(RunId::new()).len(),
            "run_".len() + 32 + "/sensitive-vars".len()
        );
    }
}

//! ProviderBindings and per-run variables.
//!
//! - `POST /api/v1/workspaces/{ws}/provider-bindings` creates a named credential set
//!   (`env`, `token` or `command`); `GET` lists them. Values are sealed with the server key
//!   (purpose `credential`, subject = the binding id) in the same request and never come
//!   back: responses carry names only.
//! - `POST /api/v1/capsules/{cap}/provider-bindings` `{"bindingId"}` attaches one to a
//!   Capsule; `GET` lists what is attached; `DELETE …/provider-bindings/{pb}` detaches.
//! - [`PlanInputs`]: the optional body of `POST /capsules/{cap}/plan`, `{"vars": {…},
//!   "sensitiveVars": {…}}`. `vars` are merged over the Capsule's and stored on the Run
//!   (they are not secret); `sensitiveVars` are sealed (subject `<run>/sensitive-vars`).
//!
//! Error messages here never quote a submitted value: a malformed body is reported by
//! position only, since serde's own messages can echo the offending value.

use std::collections::BTreeMap;

use crate::access::{Access, Api, Doc, Scope};
use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::Method;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value, json};
use takosumi_core::{ActivityKind, BindingKind, CapsuleId, ProviderBindingId, RunId};
use takosumi_runner::{ToolEnv, check_env_name};
use takosumi_runtime::inputs::{CredentialSet, sensitive_vars_subject};
use takosumi_seal::Purpose;
use takosumi_store::bindings::{self, Binding, NewBinding};
use takosumi_store::{Tx, activity, capsules};
use zeroize::Zeroize;

use crate::auth::{Action, Caller};
use crate::error::ErrorCode;
use crate::{ApiError, AppState, extract};

/// Most entries in one env credential set.
const MAX_ENTRIES: usize = 100;
/// Largest single credential value.
const MAX_VALUE_BYTES: usize = 64 * 1024;
/// Most arguments of a credential command.
const MAX_ARGS: usize = 64;

pub fn api() -> Api {
    Api::new()
        .route(
            Method::POST,
            "/api/v1/workspaces/{ws}/provider-bindings",
            Access::Token(Action::Operate, Scope::Workspace),
            create_binding,
        )
        .doc(
            Doc::op(
                "createProviderBinding",
                "A credential set for the Workspace's Capsules (values sealed, never answered)",
            )
            .object_body("Its name, kind and values.")
            .ok_object(201, "The binding (no values)."),
        )
        .route(
            Method::GET,
            "/api/v1/workspaces/{ws}/provider-bindings",
            Access::Token(Action::Read, Scope::Workspace),
            list_bindings,
        )
        .doc(
            Doc::op(
                "listProviderBindings",
                "The Workspace's ProviderBindings (no values)",
            )
            .ok_object(200, "The bindings."),
        )
        .route(
            Method::POST,
            "/api/v1/capsules/{cap}/provider-bindings",
            Access::Token(Action::Operate, Scope::Capsule),
            attach_binding,
        )
        .doc(
            Doc::op(
                "attachProviderBinding",
                "Attach a ProviderBinding to a Capsule",
            )
            .object_body("The binding to attach.")
            .ok_object(200, "Already attached: the Capsule's bindings.")
            .ok_object(201, "The Capsule's bindings."),
        )
        .route(
            Method::GET,
            "/api/v1/capsules/{cap}/provider-bindings",
            Access::Token(Action::Read, Scope::Capsule),
            capsule_bindings,
        )
        .doc(
            Doc::op(
                "listCapsuleProviderBindings",
                "The ProviderBindings attached to a Capsule",
            )
            .ok_object(200, "The bindings."),
        )
        .route(
            Method::DELETE,
            "/api/v1/capsules/{cap}/provider-bindings/{pb}",
            Access::Token(Action::Operate, Scope::Capsule),
            detach_binding,
        )
        .doc(
            Doc::op(
                "detachProviderBinding",
                "Detach a ProviderBinding from a Capsule",
            )
            .ok_object(200, "The Capsule's bindings."),
        )
}

/// Parses a body that may hold secrets: on failure, says where, never what.
fn parse_secret_body<T: DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    crate::extract::refuse_nul(body)?;
    serde_json::from_slice(body).map_err(|e| {
        let what = match e.classify() {
            serde_json::error::Category::Syntax | serde_json::error::Category::Eof => {
                "is not valid JSON"
            }
            _ => "does not have the expected fields and types",
        };
        ApiError::invalid_json(format!(
            "the request body {what} (line {}, column {}); see the API reference for its shape (values are not quoted back)",
            e.line(),
            e.column()
        ))
    })
}

fn invalid(message: impl Into<String>) -> ApiError {
    ApiError::invalid(ErrorCode::InvalidBinding, message)
}

fn check_value(what: &str, value: &str) -> Result<(), ApiError> {
    if value.is_empty() {
        return Err(invalid(format!("{what} is empty")));
    }
    if value.len() > MAX_VALUE_BYTES {
        return Err(invalid(format!(
            "{what} is longer than {MAX_VALUE_BYTES} bytes"
        )));
    }
    if value.contains('\0') {
        return Err(invalid(format!("{what} contains a NUL character")));
    }
    Ok(())
}

fn check_name(name: &str) -> Result<(), ApiError> {
    check_env_name(name).map_err(|reason| {
        invalid(format!(
            "{name:?} cannot be injected into the tool's environment: {reason}"
        ))
    })
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct NewBindingReq {
    name: String,
    kind: String,
    #[serde(default)]
    env: Option<BTreeMap<String, String>>,
    #[serde(default)]
    token: Option<String>,
    #[serde(default)]
    command: Option<Vec<String>>,
    #[serde(default)]
    env_name: Option<String>,
}

impl Drop for NewBindingReq {
    fn drop(&mut self) {
        if let Some(env) = &mut self.env {
            env.values_mut().for_each(Zeroize::zeroize);
        }
        if let Some(token) = &mut self.token {
            token.zeroize();
        }
        if let Some(command) = &mut self.command {
            command.iter_mut().for_each(Zeroize::zeroize);
        }
    }
}

impl NewBindingReq {
    /// The credential set this request describes, validated.
    fn credential_set(&mut self) -> Result<CredentialSet, ApiError> {
        let (env, token, command, env_name) = (
            self.env.take(),
            self.token.take(),
            self.command.take(),
            self.env_name.take(),
        );
        let extra = |fields: &[(&str, bool)]| -> Result<(), ApiError> {
            match fields.iter().find(|(_, present)| *present) {
                Some((field, _)) => Err(invalid(format!(
                    "`{field}` does not belong to a {:?} binding",
                    self.kind
                ))),
                None => Ok(()),
            }
        };
        let Ok(kind) = self.kind.parse::<BindingKind>() else {
            return Err(invalid("kind must be \"env\", \"token\" or \"command\""));
        };
        match kind {
            BindingKind::Env => {
                extra(&[
                    ("token", token.is_some()),
                    ("command", command.is_some()),
                    ("envName", env_name.is_some()),
                ])?;
                let env = env.ok_or_else(|| {
                    invalid("an env binding needs `env`: {\"NAME\": \"value\", …}")
                })?;
                if env.is_empty() || env.len() > MAX_ENTRIES {
                    return Err(invalid(format!("`env` needs 1 to {MAX_ENTRIES} entries")));
                }
                for (name, value) in &env {
                    check_name(name)?;
                    check_value(&format!("the value of {name}"), value)?;
                }
                Ok(CredentialSet::Env { env })
            }
            BindingKind::Token => {
                extra(&[
                    ("env", env.is_some()),
                    ("command", command.is_some()),
                    ("envName", env_name.is_some()),
                ])?;
                let token = token.ok_or_else(|| invalid("a token binding needs `token`"))?;
                check_value("the token", &token)?;
                Ok(CredentialSet::Token { token })
            }
            BindingKind::Command => {
                extra(&[("env", env.is_some()), ("token", token.is_some())])?;
                let command = command.ok_or_else(|| {
                    invalid("a command binding needs `command`: [\"program\", \"arg\", …]")
                })?;
                let env_name = env_name.ok_or_else(|| {
                    invalid("a command binding needs `envName`: the variable its output becomes")
                })?;
                if command.is_empty() || command.len() > MAX_ARGS {
                    return Err(invalid(format!(
                        "`command` needs a program and at most {} arguments",
                        MAX_ARGS - 1
                    )));
                }
                if command[0].trim().is_empty() {
                    return Err(invalid("the command's program is empty"));
                }
                for (i, arg) in command.iter().enumerate() {
                    if arg.contains('\0') || arg.len() > MAX_VALUE_BYTES {
                        return Err(invalid(format!(
                            "argument {i} of the command contains a NUL character or is too long"
                        )));
                    }
                }
                check_name(&env_name)?;
                Ok(CredentialSet::Command { command, env_name })
            }
        }
    }
}

fn binding_view(b: &Binding) -> Value {
    json!({
        "id": b.id,
        "workspaceId": b.workspace_id,
        "name": b.name,
        "kind": b.kind,
        "envNames": b.env_names,
        "createdBy": b.created_by,
        "createdAt": b.created_at,
    })
}

/// `POST /api/v1/workspaces/{ws}/provider-bindings` → 201 `{id, name, kind, envNames, …}`.
/// A command binding runs a program on the workers, so only an admin may create one.
async fn create_binding(
    State(st): State<AppState>,
    caller: Caller,
    Path(ws): Path<String>,
    body: Bytes,
) -> Result<impl IntoResponse, ApiError> {
    let ws = extract::workspace(&st, &caller, &ws, Action::Operate).await?;
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::invalid_json(
            "the request body is empty; send a JSON object",
        ));
    }
    let mut req: NewBindingReq = parse_secret_body(&body)?;
    if !extract::valid_name(&req.name) {
        return Err(ApiError::invalid(
            ErrorCode::InvalidName,
            "a ProviderBinding name is 1-64 letters, digits, '-', '_' or '.', starting with a letter or digit",
        ));
    }
    let set = req.credential_set()?;
    if matches!(set, CredentialSet::Command { .. }) {
        caller.require(Action::Administer, Some(ws))?;
    }
    let id = ProviderBindingId::new();
    let mut plain = serde_json::to_vec(&set).map_err(|e| ApiError::Internal {
        transient: false,
        source: Box::new(e),
    })?;
    let sealed = st.sealer.seal(Purpose::Credential, &id.to_string(), &plain);
    plain.zeroize();
    let sealed = sealed.map_err(|e| ApiError::Internal {
        transient: false,
        source: Box::new(e),
    })?;
    let env_names = set.env_names();
    let actor = caller.actor();
    let mut tx = st.pool.begin().await?;
    let created = match bindings::create(
        &mut tx,
        &NewBinding {
            id,
            workspace_id: ws,
            name: &req.name,
            kind: set.kind(),
            env_names: &env_names,
            sealed: &sealed,
            created_by: &actor,
        },
    )
    .await
    {
        Ok(b) => b,
        Err(e) if e.is_unique_violation() => {
            return Err(ApiError::conflict(
                ErrorCode::BindingExists,
                format!(
                    "a ProviderBinding named {:?} already exists in this Workspace",
                    req.name
                ),
            ));
        }
        Err(e) => return Err(e.into()),
    };
    activity::append(
        tx.db(),
        ws,
        ActivityKind::ProviderBindingCreated,
        &id.to_string(),
        &actor,
        json!({ "name": created.name, "kind": created.kind, "envNames": created.env_names }),
    )
    .await?;
    tx.commit().await?;
    Ok((StatusCode::CREATED, Json(binding_view(&created))))
}

/// `GET /api/v1/workspaces/{ws}/provider-bindings` → `{"bindings": [...]}` (names only).
async fn list_bindings(
    State(st): State<AppState>,
    caller: Caller,
    Path(ws): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let ws = extract::workspace(&st, &caller, &ws, Action::Read).await?;
    let list = bindings::list_for_workspace(&st.pool, ws).await?;
    Ok(Json(json!({
        "workspaceId": ws,
        "bindings": list.iter().map(binding_view).collect::<Vec<_>>(),
    })))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct AttachReq {
    binding_id: String,
}

fn attached_view(capsule: CapsuleId, list: &[Binding]) -> Value {
    json!({
        "capsuleId": capsule,
        "providerBindings": list.iter().map(binding_view).collect::<Vec<_>>(),
    })
}

/// `POST /api/v1/capsules/{cap}/provider-bindings` `{"bindingId"}` → 201 when attached,
/// 200 when it already was. Refused (409 `env_name_conflict`) when it would inject a
/// variable another attached binding already injects.
async fn attach_binding(
    State(st): State<AppState>,
    caller: Caller,
    Path(cap): Path<String>,
    body: Bytes,
) -> Result<impl IntoResponse, ApiError> {
    let capsule = extract::capsule(&st, &caller, &cap, Action::Operate).await?;
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::invalid_json(
            "the request body is empty; send {\"bindingId\": \"pb_…\"}",
        ));
    }
    let req: AttachReq = extract::parse_body(&body)?;
    let binding_id: ProviderBindingId = extract::parse_id(&req.binding_id)?;
    let binding = bindings::get(&st.pool, binding_id)
        .await?
        .filter(|b| b.workspace_id == capsule.workspace_id)
        .ok_or_else(|| {
            ApiError::not_found(&format!("ProviderBinding {binding_id} in this Workspace"))
        })?;
    let actor = caller.actor();
    let mut tx = st.pool.begin().await?;
    // One attach per Capsule at a time, so two conflicting bindings cannot both pass the
    // check below.
    lock_capsule(&mut tx, capsule.id).await?;
    let attached = bindings::for_capsule(tx.db(), capsule.id).await?;
    if !attached.iter().any(|b| b.id == binding.id) {
        for other in &attached {
            if let Some(name) = other
                .env_names
                .iter()
                .find(|n| binding.env_names.contains(n))
            {
                return Err(ApiError::conflict(
                    ErrorCode::EnvNameConflict,
                    format!(
                        "ProviderBinding {:?} already injects {name:?} into this Capsule's runs; detach it first",
                        other.name
                    ),
                ));
            }
        }
    }
    let new = bindings::attach(&mut tx, capsule.id, binding.id, &actor).await?;
    if new {
        activity::append(
            tx.db(),
            capsule.workspace_id,
            ActivityKind::ProviderBindingAttached,
            &capsule.id.to_string(),
            &actor,
            json!({ "bindingId": binding.id, "name": binding.name }),
        )
        .await?;
    }
    let list = bindings::for_capsule(tx.db(), capsule.id).await?;
    tx.commit().await?;
    let status = if new {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(attached_view(capsule.id, &list))))
}

async fn lock_capsule(tx: &mut Tx, id: CapsuleId) -> Result<(), ApiError> {
    sqlx::query!(
        "SELECT id FROM capsules WHERE id = $1 FOR UPDATE",
        id.as_uuid()
    )
    .fetch_optional(tx.db())
    .await?;
    Ok(())
}

/// `GET /api/v1/capsules/{cap}/provider-bindings` → what its runs get (names only).
async fn capsule_bindings(
    State(st): State<AppState>,
    caller: Caller,
    Path(cap): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let capsule = extract::capsule(&st, &caller, &cap, Action::Read).await?;
    let list = bindings::for_capsule(&st.pool, capsule.id).await?;
    Ok(Json(attached_view(capsule.id, &list)))
}

/// `DELETE /api/v1/capsules/{cap}/provider-bindings/{pb}` → 200 with what is still
/// attached; 404 when it was not attached.
async fn detach_binding(
    State(st): State<AppState>,
    caller: Caller,
    Path((cap, pb)): Path<(String, String)>,
) -> Result<impl IntoResponse, ApiError> {
    let capsule = extract::capsule(&st, &caller, &cap, Action::Operate).await?;
    let binding_id: ProviderBindingId = extract::parse_id(&pb)?;
    let mut tx = st.pool.begin().await?;
    if !bindings::detach(&mut tx, capsule.id, binding_id).await? {
        return Err(ApiError::not_found(&format!(
            "ProviderBinding {binding_id} attached to {}",
            capsule.id
        )));
    }
    activity::append(
        tx.db(),
        capsule.workspace_id,
        ActivityKind::ProviderBindingDetached,
        &capsule.id.to_string(),
        &caller.actor(),
        json!({ "bindingId": binding_id }),
    )
    .await?;
    let list = bindings::for_capsule(tx.db(), capsule.id).await?;
    tx.commit().await?;
    Ok(Json(attached_view(capsule.id, &list)))
}

/// The optional body of `POST /capsules/{cap}/plan`: per-run variables merged over the
/// Capsule's for this Run only, and sensitive variables (sealed, masked, names recorded).
/// An empty body means none. A `null` in `vars` unsets a Capsule default for this Run
/// (the configuration's own default applies).
#[derive(Deserialize, Default, utoipa::ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(crate) struct PlanInputs {
    #[serde(default)]
    #[schema(value_type = Object)]
    vars: Map<String, Value>,
    #[serde(default)]
    #[schema(value_type = Object)]
    sensitive_vars: Map<String, Value>,
    /// An install: continue from this plan to its apply if the plan finishes cleanly (the
    /// gate still stops deletions, an approval rule, the cost check and a plan gate for
    /// review). Asked for by a person, on a plan.
    #[serde(default)]
    pub(crate) auto_apply_requested: bool,
}

impl Drop for PlanInputs {
    fn drop(&mut self) {
        fn wipe(v: &mut Value) {
            match v {
                Value::String(s) => s.zeroize(),
                Value::Array(items) => items.iter_mut().for_each(wipe),
                Value::Object(map) => map.values_mut().for_each(wipe),
                _ => {}
            }
        }
        self.sensitive_vars.values_mut().for_each(wipe);
    }
}

impl PlanInputs {
    /// Parses the body (empty means no inputs); a malformed one is reported by position.
    pub(crate) fn parse(body: &Bytes) -> Result<Self, ApiError> {
        if body.iter().all(u8::is_ascii_whitespace) {
            return Ok(Self::default());
        }
        parse_secret_body(body)
    }

    /// Validates the inputs against `capsule` and returns the Run's non-secret variables:
    /// the Capsule's, with `vars` merged over them and sensitive names left out.
    pub(crate) fn effective_vars(&self, capsule: &capsules::Capsule) -> Result<Value, ApiError> {
        let bad = |m: String| ApiError::invalid(ErrorCode::InvalidVars, m);
        ToolEnv::new()
            .with_variables(&self.vars)
            .map_err(|e| bad(e.to_string()))?;
        ToolEnv::new()
            .with_sensitive_variables(&self.sensitive_vars)
            .map_err(|e| bad(e.to_string()))?;
        if let Some(name) = self
            .vars
            .keys()
            .find(|k| self.sensitive_vars.contains_key(*k))
        {
            return Err(bad(format!(
                "{name:?} is given both in `vars` and in `sensitiveVars`; give it once"
            )));
        }
        if let Some((name, _)) = self.sensitive_vars.iter().find(|(_, v)| v.is_null()) {
            return Err(bad(format!(
                "sensitive variable {name:?} is null; leave it out instead"
            )));
        }
        let mut merged = capsule.vars.as_object().cloned().unwrap_or_default();
        for (k, v) in &self.vars {
            merged.insert(k.clone(), v.clone());
        }
        for k in self.sensitive_vars.keys() {
            merged.remove(k);
        }
        Ok(Value::Object(merged))
    }

    /// The Run's variables sealed for it (their names stay readable on the record), for
    /// [`runs::NewRun::vars`]: written with its row.
    pub(crate) fn seal_vars(
        &self,
        st: &AppState,
        run_id: RunId,
        vars: &Value,
    ) -> Result<takosumi_store::runs::SealedVars, ApiError> {
        let plain = vars.as_object().cloned().unwrap_or_default();
        let (names, sealed) = takosumi_runtime::inputs::seal_run_vars(&st.sealer, run_id, &plain)
            .map_err(|e| ApiError::Internal {
            transient: false,
            source: Box::new(e),
        })?;
        drop(plain);
        Ok(takosumi_store::runs::SealedVars { names, sealed })
    }

    /// Whether the submission carries sensitive values to seal and store with its Run.
    pub(crate) fn has_sensitive_vars(&self) -> bool {
        !self.sensitive_vars.is_empty()
    }

    /// Seals and stores the Run's sensitive variables, in the submission's transaction.
    pub(crate) async fn store_sensitive(
        &self,
        st: &AppState,
        tx: &mut Tx,
        run_id: RunId,
    ) -> Result<(), ApiError> {
        if self.sensitive_vars.is_empty() {
            return Ok(());
        }
        let names: Vec<String> = self.sensitive_vars.keys().cloned().collect();
        let mut plain =
            serde_json::to_vec(&self.sensitive_vars).map_err(|e| ApiError::Internal {
                transient: false,
                source: Box::new(e),
            })?;
        let sealed = st
            .sealer
            .seal(Purpose::Credential, &sensitive_vars_subject(run_id), &plain);
        plain.zeroize();
        let sealed = sealed.map_err(|e| ApiError::Internal {
            transient: false,
            source: Box::new(e),
        })?;
        bindings::put_sensitive_vars(tx, run_id, &names, &sealed).await?;
        Ok(())
    }
}

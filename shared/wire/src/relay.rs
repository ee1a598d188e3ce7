//! The relay protocol: what a relay worker and the API's `/api/v1/relay/…` endpoints send
//! each other. The API serializes the jobs and answers and deserializes the reports with
//! these types; the worker does the reverse with the same types.
//!
//! Unlike the client types of this crate, decoding here is strict where it matters: a job
//! missing a field it needs (its Run, its claim, the source to check out, an apply's plan
//! digest) fails to decode with the field's name, so a worker never runs a job on
//! defaults. Unknown fields are ignored, so an API may add one without breaking a worker.
//! Sealed payloads (`secrets`, `state`, `plan`) are base64 delivery envelopes sealed to the
//! pool's delivery key; only the worker opens them, into a [`RelaySecrets`] for `secrets`.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Map, Value};
use takosumi_core::{EventKind, RunId, RunKind, Tool};

use crate::{Code, UsedBinding};

/// The body of `POST /api/v1/relay/claim`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClaimRequest {
    /// The delivery key ids this worker holds (current first).
    #[serde(default)]
    pub delivery_key_ids: Vec<String>,
    /// Long-poll: how long to wait for a job (the API caps it at 20 s).
    #[serde(default)]
    pub wait_secs: u64,
    /// The sandbox the worker runs Capsules in (`bubblewrap` | `none`), recorded on every
    /// Run it claims. Text, not an enum: the API answers an unknown one with its own code
    /// (`invalid_sandbox`) rather than as an unreadable body.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<String>,
}

/// The answer to a claim: the job, or `null` when none came within the wait.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClaimAnswer {
    /// The claimed job.
    pub job: Option<RelayJob>,
}

/// A claim answer read only for the name of its job: when the rest of a job does not
/// decode, the worker still knows which Run and claim to fail with the reason, rather than
/// leave the Run to its lease.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NamedClaim {
    /// The claimed job's name.
    pub job: Option<JobName>,
}

/// What names a claimed job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct JobName {
    /// The Run.
    pub run_id: RunId,
    /// The lease owner.
    pub claim: String,
}

/// A claimed job: what is common to every job, and the [`JobWork`] of its kind.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RelayJob {
    /// The Run.
    pub run_id: RunId,
    /// The lease owner (`relay:<pool>:<random>`); every later call names it in
    /// `X-Takosumi-Claim`.
    pub claim: String,
    /// The lease, renewed by every `progress` call.
    pub lease_secs: i64,
    /// The Capsule's tool (a job naming one this worker does not know does not decode, and
    /// its Run fails `invalid_configuration`).
    pub tool: Tool,
    /// The plain input variables.
    #[serde(default)]
    pub vars: Map<String, Value>,
    /// The delivery key the sealed payloads are sealed to (`null`: the pool has none, and
    /// the job carries nothing sealed).
    #[serde(default)]
    pub delivery_key_id: Option<String>,
    /// The credential sets delivered (ids and names, never values).
    #[serde(default)]
    pub provider_bindings: Vec<UsedBinding>,
    /// The [`RelaySecrets`], sealed (purpose `credential`, subject the Run id), base64.
    #[serde(default)]
    pub secrets: Option<String>,
    /// The Capsule's current state, sealed (purpose `state`), base64.
    #[serde(default)]
    pub state: Option<String>,
    /// What to do: its fields sit beside the common ones, `kind` among them.
    #[serde(flatten)]
    pub work: JobWork,
}

/// What a job does, told apart on the wire by `kind` (and `oneStep` for an apply).
#[derive(Debug, Clone, PartialEq)]
pub enum JobWork {
    /// A plan-like Run: `plan`, `destroy` or `drift_check`.
    Plan(PlanJob),
    /// The pinned apply of a reviewed, saved plan.
    Apply(Box<ApplyJob>),
    /// A one-step apply (no rule covers the Capsule): `apply -auto-approve` on the branch head.
    OneStep(OneStepJob),
}

/// A plan-like job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PlanJob {
    /// `plan`, `destroy` or `drift_check`.
    pub kind: RunKind,
    /// Which claim of the Run this is (1 for the first).
    pub attempt: i32,
    /// What to check out.
    pub source: PlanSource,
    /// The largest plan file the relay takes; a larger one is declared by its size only.
    pub max_plan_bytes: u64,
    /// A pull request's plan: refused rather than run when the dry-run scan finds a data
    /// source that acts when planned.
    #[serde(default)]
    pub speculative: bool,
}

/// The source of a plan: the branch, at a pinned commit when the Run names one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PlanSource {
    /// The Git URL.
    pub repo: String,
    /// The branch (or the ref the Run names).
    pub branch: String,
    /// The commit to plan (`null`: the branch head).
    #[serde(default)]
    pub commit: Option<String>,
    /// The configuration directory inside the repository.
    pub dir: String,
}

/// A pinned apply's job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ApplyJob {
    /// The plan-like Run whose saved plan is applied.
    pub plan_run_id: RunId,
    /// SHA-256 (hex) of the reviewed plan file: the delivered one must hash to it.
    pub plan_digest: String,
    /// The planned commit and tree.
    pub source: PinnedSource,
    /// The plan's dependency snapshot, reached again before the tool starts.
    #[serde(default)]
    pub dependency_snapshot: Option<String>,
    /// The plan Run's kind (what a stale plan's message advises).
    pub plan_kind: RunKind,
    /// The digest of the provider lockfile the plan ran with.
    #[serde(default)]
    pub provider_lock_digest: Option<String>,
    /// That lockfile (base64), installed before `init`.
    #[serde(default)]
    pub lockfile: Option<String>,
    /// The state generation the plan saw.
    #[serde(default)]
    pub state_generation: Option<i64>,
    /// The saved plan file, sealed (purpose `plan`), base64.
    pub plan: String,
}

/// The source of a pinned apply: exactly what was planned.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PinnedSource {
    /// The Git URL.
    pub repo: String,
    /// The branch.
    pub branch: String,
    /// The planned commit.
    pub commit: String,
    /// The planned tree's digest.
    pub tree_digest: String,
    /// The configuration directory inside the repository.
    pub dir: String,
}

/// A one-step apply's job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OneStepJob {
    /// The branch head is applied.
    pub source: BranchSource,
    /// The generation current when the apply was claimed.
    #[serde(default)]
    pub state_generation: Option<i64>,
}

/// The source of a one-step apply: a branch, no commit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BranchSource {
    /// The Git URL.
    pub repo: String,
    /// The branch.
    pub branch: String,
    /// The configuration directory inside the repository.
    pub dir: String,
}

impl JobWork {
    /// The Run kind the job carries out (`apply` for both applies).
    pub fn kind(&self) -> RunKind {
        match self {
            Self::Plan(p) => p.kind,
            Self::Apply(_) | Self::OneStep(_) => RunKind::Apply,
        }
    }
}

impl Serialize for JobWork {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        /// An apply's own fields with the `kind` (and `oneStep`) that mark it.
        #[derive(Serialize)]
        #[serde(rename_all = "camelCase")]
        struct Marked<'a, T> {
            kind: RunKind,
            #[serde(skip_serializing_if = "std::ops::Not::not")]
            one_step: bool,
            #[serde(flatten)]
            work: &'a T,
        }
        match self {
            Self::Plan(p) => p.serialize(s),
            Self::Apply(a) => Marked {
                kind: RunKind::Apply,
                one_step: false,
                work: a.as_ref(),
            }
            .serialize(s),
            Self::OneStep(o) => Marked {
                kind: RunKind::Apply,
                one_step: true,
                work: o,
            }
            .serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for JobWork {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error as _;
        let mut fields = Map::<String, Value>::deserialize(d)?;
        let kind: RunKind = match fields.get("kind") {
            None => return Err(D::Error::missing_field("kind")),
            Some(k) => {
                RunKind::deserialize(k).map_err(|e| D::Error::custom(format!("kind: {e}")))?
            }
        };
        let one_step = match fields.remove("oneStep") {
            None | Some(Value::Null) => false,
            Some(v) => {
                bool::deserialize(v).map_err(|e| D::Error::custom(format!("oneStep: {e}")))?
            }
        };
        let rest = Value::Object(fields);
        let what = |e: serde_json::Error, job: &str| D::Error::custom(format!("{job} job: {e}"));
        Ok(match (kind, one_step) {
            (RunKind::Apply, false) => Self::Apply(Box::new(
                ApplyJob::deserialize(rest).map_err(|e| what(e, "an apply"))?,
            )),
            (RunKind::Apply, true) => Self::OneStep(
                OneStepJob::deserialize(rest).map_err(|e| what(e, "a one-step apply"))?,
            ),
            (_, true) => {
                return Err(D::Error::custom(format!(
                    "a {} job cannot be a one-step apply",
                    kind.as_str()
                )));
            }
            (_, false) => Self::Plan(PlanJob::deserialize(rest).map_err(|e| what(e, "a plan"))?),
        })
    }
}

/// What a job's `secrets` open to (JSON): credential values, sensitive variables and the
/// command credentials to run on the worker. `Debug` shows names, never values.
#[derive(Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RelaySecrets {
    /// Environment entries of the static credential sets, name → value.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// The Run's sensitive variables, name → value (`null`: none).
    #[serde(default)]
    pub sensitive_vars: Option<Map<String, Value>>,
    /// Command credentials, run inside the worker's sandbox for every run.
    #[serde(default)]
    pub commands: Vec<CommandCredential>,
}

impl fmt::Debug for RelaySecrets {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RelaySecrets")
            .field("env", &self.env.keys().collect::<Vec<_>>())
            .field(
                "sensitive_vars",
                &self
                    .sensitive_vars
                    .as_ref()
                    .map(|m| m.keys().collect::<Vec<_>>()),
            )
            .field("commands", &self.commands)
            .finish()
    }
}

/// A command credential: run `command`, its standard output is the value of `env_name`.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CommandCredential {
    /// Which binding it is, for messages (`ProviderBinding "aws" (pb_…)`).
    pub what: String,
    /// The argv.
    pub command: Vec<String>,
    /// The variable its output is injected as.
    pub env_name: String,
}

impl fmt::Debug for CommandCredential {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CommandCredential")
            .field("what", &self.what)
            .field("env_name", &self.env_name)
            .finish_non_exhaustive()
    }
}

/// The body of `POST …/runs/{run}/progress`: events and masked log chunks, stored whole
/// or not at all. An empty one only renews the lease.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ProgressReport {
    /// The report's number within its claim (1, 2, … in the order the worker made them).
    /// The API stores a numbered report once: sent again (its answer was lost), or after a
    /// later one was stored, it is answered and not stored again. So a worker sends again
    /// every report whose answer it did not see, and nothing is recorded twice. `None`:
    /// stored as it comes (a lease renewal carries nothing to number).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq: Option<u64>,
    /// Events, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub events: Vec<WorkerEvent>,
    /// Log chunks, masked by the worker (and again by the API).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub logs: Vec<LogChunk>,
}

/// The event kinds a worker may report ([`EventKind::WORKER`]); the API refuses any other
/// (`invalid_event`), since what the control node decides or records is never taken from a
/// worker.
pub const WORKER_EVENT_KINDS: &[EventKind] = EventKind::WORKER;

/// One reported event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerEvent {
    /// One of [`WORKER_EVENT_KINDS`]; text, so the API can name a refused one (an unknown
    /// kind is `invalid_event`, not a body that does not parse).
    pub kind: String,
    /// The event's data.
    #[serde(default)]
    pub data: Value,
}

impl WorkerEvent {
    /// An event of `kind` with `data`.
    pub fn new(kind: EventKind, data: Value) -> Self {
        Self {
            kind: kind.as_str().to_owned(),
            data,
        }
    }
}

/// One masked log chunk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogChunk {
    /// The step it belongs to (`checkout`, `init`, `plan`, `apply`, …).
    pub step: String,
    /// The text.
    pub text: String,
}

/// The answer to `progress`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProgressAnswer {
    /// `false`: the claim is no longer this worker's; stop.
    pub lease_renewed: bool,
    /// Someone asked to cancel the Run: interrupt the tool.
    pub cancel_requested: bool,
}

/// The body of `POST …/runs/{run}/scanned`: a dry-run scan's report (`R` is the policy
/// crate's `ScanReport`, which this crate does not depend on), and when the worker asks
/// for the decision, the commit it checked out.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ScanResult<R> {
    /// The scan report, recorded as audit evidence.
    pub scan_report: R,
    /// Asks for the dry-run decision on this commit (absent: record only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub commit: Option<String>,
}

/// The answer to `scanned`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScanAnswer {
    /// The Run is held for a person: the worker stops.
    pub hold: bool,
}

/// The body of `POST …/runs/{run}/planned`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PlannedReport {
    /// The commit checked out.
    pub source_commit: String,
    /// The checked-out tree's digest.
    pub tree_digest: String,
    /// `version -json` of the tool.
    pub tool_version: Value,
    /// `show -json` of the saved plan.
    pub show: Value,
    /// The raw `.terraform.lock.hcl` (base64), `null` for a provider-free run.
    pub lockfile: Option<String>,
    /// The installed module tree's digest.
    pub modules_digest: String,
    /// Sent by older workers; the report is recorded by `…/scanned` now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scan_report: Option<Value>,
    /// A drift check's `-detailed-exitcode` answer.
    #[serde(default)]
    pub tool_says_drift: Option<bool>,
    /// A drift check whose saved plan is over the relay limit reports its result without
    /// it: the plan file's size in bytes (no plan file was uploaded).
    #[serde(default)]
    pub plan_not_kept: Option<u64>,
}

/// The body of `POST …/runs/{run}/applied`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AppliedReport {
    /// Whether the tool succeeded.
    pub success: bool,
    /// Its exit code.
    #[serde(default)]
    pub exit_code: Option<i32>,
    /// The state after the tool (base64), when it differs from the delivered one.
    #[serde(default)]
    pub state: Option<String>,
    /// Published, masked outputs.
    #[serde(default)]
    pub outputs: Value,
    /// The tool applied but its outputs could not be read (masked): the Run fails after
    /// the state is recorded.
    #[serde(default)]
    pub outputs_error: Option<String>,
}

/// The body of `POST …/runs/{run}/fail`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FailReport {
    /// One of the failure codes a worker may end its Run with (the API checks it:
    /// `invalid_code`).
    pub code: String,
    /// What happened, masked.
    pub message: String,
}

/// The body of an API error answer ([`crate::ErrorBody`]), as a worker reads it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// The stable code (`not_your_claim`, `plan_too_large`, …); a code this worker does not
    /// know still reads, as its text.
    pub code: Code,
    /// What to do.
    #[serde(default)]
    pub message: String,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn run_id() -> RunId {
        "run_0123456789abcdef0123456789abcdef".parse().unwrap()
    }

    fn common(kind: &str) -> Value {
        json!({
            "runId": run_id(),
            "kind": kind,
            "claim": "relay:p:abc",
            "leaseSecs": 60,
            "tool": "tofu",
            "vars": { "a": 1 },
            "deliveryKeyId": "k1",
            "providerBindings": [{ "id": "pb_0123456789abcdef0123456789abcdef", "name": "aws", "kind": "env" }],
            "secrets": "c2VhbGVk",
            "state": null,
        })
    }

    fn with(mut v: Value, extra: Value) -> Value {
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        v
    }

    /// Each kind of job reads back into its variant and writes the same JSON it was read
    /// from: the API's jobs and the worker's reading of them agree field for field.
    #[test]
    fn jobs_round_trip_in_the_wire_format() {
        let plan = with(
            common("drift_check"),
            json!({ "attempt": 2, "maxPlanBytes": 19,
                    "source": { "repo": "r", "branch": "main", "commit": null, "dir": "infra" },
                    "speculative": false }),
        );
        let apply = with(
            common("apply"),
            json!({ "planRunId": run_id(), "planDigest": "d", "planKind": "plan",
                    "source": { "repo": "r", "branch": "main", "commit": "c", "treeDigest": "t", "dir": "infra" },
                    "dependencySnapshot": null, "providerLockDigest": "l", "lockfile": null,
                    "stateGeneration": 3, "plan": "cGxhbg==" }),
        );
        let one_step = with(
            common("apply"),
            json!({ "oneStep": true, "stateGeneration": null,
                    "source": { "repo": "r", "branch": "main", "dir": "infra" } }),
        );
        for (v, kind) in [
            (&plan, RunKind::DriftCheck),
            (&apply, RunKind::Apply),
            (&one_step, RunKind::Apply),
        ] {
            let job: RelayJob = serde_json::from_value(v.clone()).unwrap();
            assert_eq!(job.work.kind(), kind);
            assert_eq!(&serde_json::to_value(&job).unwrap(), v);
        }
        let job: RelayJob = serde_json::from_value(one_step).unwrap();
        assert!(matches!(job.work, JobWork::OneStep(_)), "{job:?}");
    }

    /// A job missing what it needs does not decode, and the error names the field.
    #[test]
    fn a_job_missing_a_required_field_names_it() {
        let no_digest = with(
            common("apply"),
            json!({ "planRunId": run_id(), "planKind": "plan", "plan": "p",
                    "source": { "repo": "r", "branch": "main", "commit": "c", "treeDigest": "t", "dir": "d" } }),
        );
        let err = serde_json::from_value::<RelayJob>(no_digest.clone())
            .unwrap_err()
            .to_string();
        assert!(err.contains("planDigest"), "{err}");
        // Its name still reads, so the worker can fail the Run with that error.
        let named: NamedClaim = serde_json::from_value(json!({ "job": no_digest })).unwrap();
        assert_eq!(named.job.map(|j| j.run_id), Some(run_id()));
        let mut no_claim = common("plan");
        no_claim.as_object_mut().unwrap().remove("claim");
        let err = serde_json::from_value::<RelayJob>(no_claim)
            .unwrap_err()
            .to_string();
        assert!(err.contains("claim"), "{err}");
        let mut no_kind = common("plan");
        no_kind.as_object_mut().unwrap().remove("kind");
        let err = serde_json::from_value::<RelayJob>(no_kind)
            .unwrap_err()
            .to_string();
        assert!(err.contains("kind"), "{err}");
    }

    /// A claim with no job is `{"job": null}`.
    #[test]
    fn no_job_is_null() {
        let none: ClaimAnswer = serde_json::from_value(json!({ "job": null })).unwrap();
        assert_eq!(none.job, None);
        assert_eq!(serde_json::to_value(&none).unwrap(), json!({ "job": null }));
    }

    /// The secrets bundle's `Debug` names what it holds, never a value.
    #[test]
    fn secrets_debug_shows_no_value() {
        let s: RelaySecrets = serde_json::from_value(json!({
            "env": { "AWS_SECRET": "canary-1" },
            "sensitiveVars": { "pw": "canary-2" },
            "commands": [{ "what": "b", "command": ["echo", "canary-3"], "envName": "TOK" }],
        }))
        .unwrap();
        let shown = format!("{s:?}");
        assert!(
            shown.contains("AWS_SECRET") && shown.contains("TOK"),
            "{shown}"
        );
        assert!(!shown.contains("canary"), "{shown}");
    }
}

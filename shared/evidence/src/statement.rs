//! The evidence statement of one Run, and the JSON the API serves it in.
//!
//! The statement is an in-toto Statement v1: `subject` lists the artifacts the Run pinned
//! or produced (the saved plan file; for an apply, also the StateVersion it wrote), and the
//! predicate ([`RunEvidence`]) is what an auditor needs to know about the Run. Everything in
//! it is a digest, a name, an id, a version, a count, a time or a code: a free-text message,
//! a variable's value, a hold's details or a log line never is, so no secret can be in it.
//! A Run that pinned nothing (canceled before it planned) has an empty `subject`.

use serde::{Deserialize, Serialize};

use crate::canonical::{self, CanonicalError, sha256_hex};
use crate::envelope::Envelope;
use crate::keys::PublishedKey;

/// `_type` of an in-toto Statement v1.
pub const STATEMENT_TYPE: &str = "https://in-toto.io/Statement/v1";
/// `predicateType` of a Takosumi Run's evidence.
pub const PREDICATE_TYPE: &str = "https://takosumi.dev/evidence/run/v1";
/// `format` of an exported bundle.
pub const BUNDLE_FORMAT: &str = "takosumi-evidence-bundle/v1";

/// One Run's evidence statement.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Statement {
    /// [`STATEMENT_TYPE`].
    #[serde(rename = "_type")]
    pub statement_type: String,
    /// What the Run pinned or produced, by digest.
    pub subject: Vec<Subject>,
    /// [`PREDICATE_TYPE`].
    #[serde(rename = "predicateType")]
    pub predicate_type: String,
    /// The Run's evidence.
    pub predicate: RunEvidence,
}

/// An artifact named by its digest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Subject {
    /// `plan-file` or `state-version/<sv id>`.
    pub name: String,
    /// `{"sha256": hex}`.
    pub digest: std::collections::BTreeMap<String, String>,
}

impl Subject {
    fn sha256(name: String, hex: &str) -> Self {
        Self {
            name,
            digest: [("sha256".to_owned(), hex.to_owned())].into(),
        }
    }
}

/// The predicate: what an auditor needs to know about one Run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RunEvidence {
    /// Where the statement sits in its Workspace's chain.
    pub chain: ChainLink,
    /// The Run (`run_…`).
    pub run_id: String,
    /// `plan`, `destroy`, `apply` or `drift_check`.
    pub kind: String,
    /// Its Capsule (`cap_…`).
    pub capsule_id: String,
    /// Its RunGroup, if any.
    pub run_group_id: Option<String>,
    /// Who started it.
    pub actor: Actor,
    /// Whether it asked to continue from plan to apply.
    pub auto_apply_requested: bool,
    /// How it ended.
    pub result: RunResult,
    /// When it ended (RFC 3339, UTC).
    pub ended_at: String,
    /// SHA-256 of the saved plan file it made, or (an apply) carried out.
    pub plan_digest: Option<String>,
    /// The commit executed and the digest of its checked-out tree.
    pub source: Option<SourceRef>,
    /// The tool and its version.
    pub tool: ToolRef,
    /// The provider lockfile: its digest, or that there was none, or that it is unknown.
    pub provider_lock: ProviderLock,
    /// Digest of the module tree the dry-run scan read (the plan's modules).
    pub module_tree_digest: Option<String>,
    /// Digest over the module tree and the provider lock digest (the Run's pin).
    pub dependency_snapshot: Option<String>,
    /// The Capsule's state generation the plan saw / the apply produced.
    pub state_generation: Option<i64>,
    /// Resource changes counted from `show -json`.
    pub changes: Option<ChangeCounts>,
    /// A drift check's answer.
    pub drift: Option<bool>,
    /// The rule versions in force when the statement was written.
    pub rules_in_force: RuleVersions,
    /// The gate's decisions on the Run, in order (holds, releases), with the rule versions
    /// each used.
    pub gate: Vec<GateDecision>,
    /// The dry-run scan report of the plan this Run made or carried out.
    pub dry_run_scan: Option<ScanRef>,
    /// Every approval given to the Run.
    pub approvals: Vec<Approval>,
    /// The sandbox its processes ran in (`bubblewrap` | `none`).
    pub sandbox: Option<String>,
    /// For an apply: the plan Run it carried out and that Run's statement.
    pub plan_run: Option<PlanRunRef>,
    /// The StateVersion the Run wrote.
    pub state_version: Option<StateVersionRef>,
}

/// A statement's place in its Workspace's chain.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ChainLink {
    /// The Workspace (`ws_…`) whose chain this is.
    pub workspace_id: String,
    /// 1 for the Workspace's first statement, then one more each.
    pub sequence: u64,
    /// Digest of the Workspace's previous statement (`None` for the first).
    pub previous: Option<String>,
}

/// Who started a Run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Actor {
    /// `user`, `agent` or `system`.
    pub kind: String,
    /// The actor's id (a token id).
    pub id: String,
}

/// How a Run ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RunResult {
    /// `planned`, `applied`, `failed`, `canceled` or `unknown_outcome`.
    pub status: String,
    /// The machine-readable failure code (never the message).
    pub error_code: Option<String>,
    /// Who canceled it.
    pub canceled_by: Option<String>,
}

/// A commit and its tree digest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SourceRef {
    /// The commit executed.
    pub commit: String,
    /// Digest of the checked-out tree.
    pub tree_digest: Option<String>,
}

/// The tool that ran.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolRef {
    /// `tofu` or `terraform`.
    pub name: String,
    /// Its version (`version -json`), once it ran.
    pub version: Option<String>,
}

/// The provider lockfile pin.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProviderLock {
    /// `present` (digest given), `none` (a provider-free run: an explicit null) or
    /// `unknown` (not recorded: a legacy record, or the Run never planned).
    pub state: String,
    /// SHA-256 of the lockfile bytes, when present.
    pub digest: Option<String>,
}

/// Resource change counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChangeCounts {
    /// Created.
    pub add: i64,
    /// Updated in place.
    pub change: i64,
    /// Deleted.
    pub destroy: i64,
}

/// Rule set versions of a Workspace and of a Capsule (`None`: no rules set).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct RuleVersions {
    /// The Workspace's rules.
    pub workspace: Option<i64>,
    /// The Capsule's rules.
    pub capsule: Option<i64>,
}

/// One decision of the gate (or a release after approvals).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GateDecision {
    /// `held`, `released` or `refused`.
    pub decision: String,
    /// Why it was held (`approval_rule`, `max_destroy`, `dry_run_scan`, …).
    pub reason: Option<String>,
    /// The rule versions the decision used.
    pub rule_versions: Option<RuleVersions>,
    /// The rules checked.
    pub rules: Vec<String>,
    /// When.
    pub at: String,
}

/// A dry-run scan report, by digest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ScanRef {
    /// The Run the scan was made for.
    pub run_id: String,
    /// SHA-256 of the report's canonical JSON.
    pub report_digest: String,
    /// Whether the scan found nothing.
    pub clean: Option<bool>,
}

/// One approval.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Approval {
    /// Who (a token id).
    pub approver: String,
    /// Their role.
    pub role: String,
    /// When.
    pub at: String,
    /// The plan digest the approval is bound to.
    pub plan_digest: Option<String>,
}

/// The plan an apply carried out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PlanRunRef {
    /// The plan Run.
    pub run_id: String,
    /// Digest of the plan Run's statement.
    pub statement_digest: String,
}

/// The StateVersion a Run wrote.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateVersionRef {
    /// `sv_…`.
    pub id: String,
    /// SHA-256 of the state bytes.
    pub digest: String,
}

impl Statement {
    /// The statement of `predicate`, its subjects named from it.
    pub fn new(predicate: RunEvidence) -> Self {
        let mut subject = Vec::new();
        if let Some(d) = &predicate.plan_digest {
            subject.push(Subject::sha256("plan-file".to_owned(), d));
        }
        if let Some(sv) = &predicate.state_version {
            subject.push(Subject::sha256(
                format!("state-version/{}", sv.id),
                &sv.digest,
            ));
        }
        Self {
            statement_type: STATEMENT_TYPE.to_owned(),
            subject,
            predicate_type: PREDICATE_TYPE.to_owned(),
            predicate,
        }
    }

    /// The canonical bytes: what is signed and digested.
    pub fn to_canonical(&self) -> Result<Vec<u8>, CanonicalError> {
        canonical::to_canonical(self)
    }

    /// The statement's digest: SHA-256 hex of its canonical bytes.
    pub fn digest(&self) -> Result<String, CanonicalError> {
        Ok(sha256_hex(&self.to_canonical()?))
    }
}

/// A signed statement as the API serves it. Only `envelope` is evidence: a verifier reads
/// the statement from its payload and checks it there; the other fields are the server's
/// index, for people and for paging.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SignedStatement {
    /// The Run.
    pub run_id: String,
    /// Its Workspace.
    pub workspace_id: String,
    /// Its place in the chain, as stored.
    pub sequence: u64,
    /// SHA-256 of the payload, as stored.
    pub digest: String,
    /// The previous statement's digest, as stored.
    pub previous_digest: Option<String>,
    /// The signing key's id.
    pub key_id: String,
    /// The DSSE envelope: the statement and its signature.
    pub envelope: Envelope,
}

/// The head of a Workspace's chain: its last statement.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChainHead {
    /// The last statement's position.
    pub sequence: u64,
    /// Its digest.
    pub digest: Option<String>,
}

/// One page of a Workspace's chain (`GET /api/v1/workspaces/{ws}/evidence`), oldest first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StatementPage {
    /// The Workspace.
    pub workspace_id: String,
    /// The statements, in chain order.
    pub statements: Vec<SignedStatement>,
    /// Pass it back as `cursor` for the next page; `None` on the last page.
    pub next_cursor: Option<String>,
    /// The chain's head as the server has it.
    pub head: Option<ChainHead>,
}

/// An exported chain (`takosumi evidence export`): everything needed to verify a
/// Workspace's statements offline.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Bundle {
    /// [`BUNDLE_FORMAT`].
    pub format: String,
    /// The Workspace.
    pub workspace_id: String,
    /// The public keys the server published.
    pub keys: Vec<PublishedKey>,
    /// The envelopes, in chain order.
    pub statements: Vec<Envelope>,
    /// The chain's head as the server recorded it at export.
    #[serde(default)]
    pub head: Option<ChainHead>,
}

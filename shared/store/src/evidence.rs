//! The evidence chain's rows: which ended Runs still need a statement, the
//! statements themselves and each Workspace's chain head, and the one writer that turns
//! the first into the second ([`write_pending`]).
//!
//! A Run is queued for its statement by a trigger on `runs` (see the migration
//! `20261201000500_evidence.sql`) in the very transaction that ends it, so no code path
//! that ends a Run needs to remember evidence. The writer appends under a row lock on the
//! Workspace's head: many writers at once append each statement exactly once, in the order
//! the Runs ended, each naming the digest of the one before.

use std::collections::HashMap;

use chrono::{DateTime, SecondsFormat, Utc};
use serde_json::Value;
use takosumi_core::{RunId, RunKind, WorkspaceId};
use takosumi_evidence::{
    Actor, Approval, ChainHead, ChainLink, ChangeCounts, Envelope, EnvelopeSignature, GateDecision,
    PAYLOAD_TYPE, PlanRunRef, ProviderLock, RuleVersions, RunEvidence, RunResult, ScanRef,
    SignedStatement, Signer, SourceRef, StateVersionRef, Statement, ToolRef,
    canonical::canonical_value, sha256_hex,
};

use crate::{StoreError, Tx};

/// The channel the trigger notifies when a Run ends.
pub const CHANNEL: &str = "takosumi_evidence";
/// Statements one writer transaction appends to a Workspace's chain at most.
const BATCH: i64 = 100;

/// A stored statement.
#[derive(Debug, Clone)]
pub struct StoredStatement {
    /// The Run.
    pub run_id: RunId,
    /// Its Workspace.
    pub workspace_id: WorkspaceId,
    /// Its position in the chain.
    pub sequence: i64,
    /// SHA-256 of `statement`.
    pub digest: String,
    /// The previous statement's digest.
    pub previous_digest: Option<String>,
    /// The canonical JSON as signed.
    pub statement: String,
    /// The signing key's id.
    pub key_id: String,
    /// Base64 Ed25519 signature over the DSSE encoding.
    pub signature: String,
}

impl StoredStatement {
    /// As the API serves it: the DSSE envelope rebuilt from the stored bytes, so whatever
    /// the row holds is what a verifier checks.
    pub fn to_signed(&self) -> SignedStatement {
        use base64::Engine as _;
        SignedStatement {
            run_id: self.run_id.to_string(),
            workspace_id: self.workspace_id.to_string(),
            sequence: u64::try_from(self.sequence).unwrap_or_default(),
            digest: self.digest.clone(),
            previous_digest: self.previous_digest.clone(),
            key_id: self.key_id.clone(),
            envelope: Envelope {
                payload_type: PAYLOAD_TYPE.to_owned(),
                payload: base64::engine::general_purpose::STANDARD.encode(&self.statement),
                signatures: vec![EnvelopeSignature {
                    keyid: self.key_id.clone(),
                    sig: self.signature.clone(),
                }],
            },
        }
    }
}

/// The statement of a Run, if written.
pub async fn of_run<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    run_id: RunId,
) -> Result<Option<StoredStatement>, StoreError> {
    let row = sqlx::query_as!(
        StoredStatement,
        r#"SELECT run_id as "run_id: RunId", workspace_id as "workspace_id: WorkspaceId", sequence,
                  digest, previous_digest, statement, key_id, signature
             FROM evidence_statements WHERE run_id = $1"#,
        run_id.as_uuid()
    )
    .fetch_optional(executor)
    .await?;
    Ok(row)
}

/// Whether a Run is queued for its statement.
pub async fn is_pending<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    run_id: RunId,
) -> Result<bool, StoreError> {
    let row = sqlx::query_scalar!(
        r#"SELECT EXISTS (SELECT 1 FROM evidence_pending WHERE run_id = $1) as "pending!""#,
        run_id.as_uuid()
    )
    .fetch_one(executor)
    .await?;
    Ok(row)
}

/// Up to `limit` statements of a Workspace's chain after position `after`, in order, and
/// whether more follow.
pub async fn page<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    workspace_id: WorkspaceId,
    after: i64,
    limit: i64,
) -> Result<(Vec<StoredStatement>, bool), StoreError> {
    let mut rows = sqlx::query_as!(
        StoredStatement,
        r#"SELECT run_id as "run_id: RunId", workspace_id as "workspace_id: WorkspaceId", sequence,
                  digest, previous_digest, statement, key_id, signature
             FROM evidence_statements WHERE workspace_id = $1 AND sequence > $2
            ORDER BY sequence LIMIT $3"#,
        workspace_id.as_uuid(),
        after,
        limit + 1
    )
    .fetch_all(executor)
    .await?;
    let more = rows.len() as i64 > limit;
    rows.truncate(usize::try_from(limit).unwrap_or_default());
    Ok((rows, more))
}

/// A Workspace's chain head, once it has a statement.
pub async fn head<'e, E: sqlx::PgExecutor<'e>>(
    executor: E,
    workspace_id: WorkspaceId,
) -> Result<Option<ChainHead>, StoreError> {
    let row = sqlx::query!(
        "SELECT sequence, digest FROM evidence_heads WHERE workspace_id = $1 AND sequence > 0",
        workspace_id.as_uuid()
    )
    .fetch_optional(executor)
    .await?;
    Ok(row.map(|r| ChainHead {
        sequence: u64::try_from(r.sequence).unwrap_or_default(),
        digest: r.digest,
    }))
}

/// Writes the statement of every ended Run still waiting for one, Workspace by Workspace;
/// returns how many were written. Safe to run from many processes at once: a Workspace's
/// chain another writer holds is left to it.
pub async fn write_pending(pool: &crate::Pool, signer: &Signer) -> Result<usize, StoreError> {
    let workspaces = sqlx::query_scalar!(
        r#"SELECT DISTINCT workspace_id as "workspace_id: WorkspaceId" FROM evidence_pending"#
    )
    .fetch_all(pool)
    .await?;
    let mut written = 0;
    let mut first_error = None;
    for ws in workspaces {
        loop {
            match append(pool, ws, signer).await {
                Ok(n) => {
                    written += n;
                    if n < usize::try_from(BATCH).unwrap_or_default() {
                        break;
                    }
                }
                // One Workspace's trouble does not hold up the others' chains.
                Err(e) => {
                    tracing::warn!(workspace = %ws, error = %e, "evidence statements not written");
                    first_error.get_or_insert(e);
                    break;
                }
            }
        }
    }
    match first_error {
        Some(e) if written == 0 => Err(e),
        _ => Ok(written),
    }
}

/// One transaction: locks the Workspace's head, appends up to [`BATCH`] statements in the
/// order their Runs ended, advances the head. What the statements say is read for the whole
/// batch at once ([`Facts::read`]) and they are inserted in one statement, so a batch costs
/// the same few statements however many Runs it signs.
async fn append(
    pool: &crate::Pool,
    workspace_id: WorkspaceId,
    signer: &Signer,
) -> Result<usize, StoreError> {
    let mut tx = pool.begin().await?;
    let Some((mut sequence, mut previous)) = lock_head(&mut tx, workspace_id).await? else {
        // Another writer is appending to this chain right now.
        return Ok(0);
    };
    // Each pending Run with whether its statement is written already (a writer that died
    // after its commit's statement and before the pending row went: not written twice).
    let pending = sqlx::query!(
        r#"SELECT p.run_id as "run_id: RunId",
                  EXISTS (SELECT 1 FROM evidence_statements s WHERE s.run_id = p.run_id)
                      AS "written!"
             FROM evidence_pending p
            WHERE p.workspace_id = $1 ORDER BY p.id LIMIT $2"#,
        workspace_id.as_uuid(),
        BATCH
    )
    .fetch_all(tx.db())
    .await?;
    let todo: Vec<RunId> = pending
        .iter()
        .filter(|row| !row.written)
        .map(|row| row.run_id)
        .collect();
    let mut facts = Facts::read(&mut tx, &todo).await?;
    let mut rows = NewRows::default();
    for run_id in todo {
        let link = ChainLink {
            workspace_id: workspace_id.to_string(),
            sequence: u64::try_from(sequence + 1).unwrap_or_default(),
            previous: previous.clone(),
        };
        let statement = Statement::new(facts.predicate(run_id, link)?);
        let bytes = statement
            .to_canonical()
            .map_err(|e| StoreError::Evidence(e.to_string()))?;
        let digest = sha256_hex(&bytes);
        let envelope = signer.sign(&bytes);
        let text = String::from_utf8(bytes)
            .map_err(|_| StoreError::Evidence("canonical JSON is not UTF-8".into()))?;
        sequence += 1;
        // An apply later in the batch links to this statement.
        facts.signed.insert(run_id, digest.clone());
        rows.run_id.push(run_id.as_uuid());
        rows.sequence.push(sequence);
        rows.digest.push(digest.clone());
        // The first statement of a chain has none: '' stands for it in the array.
        rows.previous.push(previous.take().unwrap_or_default());
        rows.statement.push(text);
        rows.signature.push(envelope.signatures[0].sig.clone());
        previous = Some(digest);
    }
    let written = rows.run_id.len();
    if written > 0 {
        sqlx::query!(
            r#"INSERT INTO evidence_statements
                   (run_id, workspace_id, sequence, digest, previous_digest, statement, key_id, signature)
               SELECT r, $2, s, d, NULLIF(p, ''), t, $3, g
                 FROM UNNEST($1::uuid[], $4::int8[], $5::text[], $6::text[], $7::text[], $8::text[])
                      AS u(r, s, d, p, t, g)"#,
            &rows.run_id,
            workspace_id.as_uuid(),
            signer.key_id(),
            &rows.sequence,
            &rows.digest,
            &rows.previous,
            &rows.statement,
            &rows.signature
        )
        .execute(tx.db())
        .await?;
    }
    let done: Vec<uuid::Uuid> = pending.iter().map(|row| row.run_id.as_uuid()).collect();
    sqlx::query!("DELETE FROM evidence_pending WHERE run_id = ANY($1)", &done)
        .execute(tx.db())
        .await?;
    sqlx::query!(
        "UPDATE evidence_heads SET sequence = $2, digest = $3 WHERE workspace_id = $1",
        workspace_id.as_uuid(),
        sequence,
        previous
    )
    .execute(tx.db())
    .await?;
    tx.commit().await?;
    Ok(written)
}

/// A batch's statements as the columns of one `INSERT … SELECT FROM UNNEST`.
#[derive(Default)]
struct NewRows {
    run_id: Vec<uuid::Uuid>,
    sequence: Vec<i64>,
    digest: Vec<String>,
    previous: Vec<String>,
    statement: Vec<String>,
    signature: Vec<String>,
}

/// Locks the Workspace's chain head (creating it for the first statement) and returns its
/// sequence and digest; `None` while another writer holds it.
async fn lock_head(
    tx: &mut Tx,
    workspace_id: WorkspaceId,
) -> Result<Option<(i64, Option<String>)>, StoreError> {
    // Most heads exist: look first, create only when there is none to lock.
    for first in [true, false] {
        let head = sqlx::query!(
            "SELECT sequence, digest FROM evidence_heads WHERE workspace_id = $1 FOR UPDATE SKIP LOCKED",
            workspace_id.as_uuid()
        )
        .fetch_optional(tx.db())
        .await?;
        match head {
            Some(head) => return Ok(Some((head.sequence, head.digest))),
            None if first => {
                sqlx::query!(
                    "INSERT INTO evidence_heads (workspace_id) VALUES ($1) ON CONFLICT DO NOTHING",
                    workspace_id.as_uuid()
                )
                .execute(tx.db())
                .await?;
            }
            None => {}
        }
    }
    Ok(None)
}

fn rfc3339(at: DateTime<Utc>) -> String {
    at.to_rfc3339_opts(SecondsFormat::Micros, true)
}

/// SHA-256 of a JSON value's canonical form (the dry-run scan report).
fn json_digest(v: &Value) -> Result<String, StoreError> {
    canonical_value(v)
        .map(|b| sha256_hex(&b))
        .map_err(|e| StoreError::Evidence(e.to_string()))
}

/// What a statement takes from a gate's `gate_decision`, `held` or `released` event. The
/// events carry more (a hold's details, a cost, the approvals) and the gate's steps have
/// written them over many releases, so each field is read on its own: one of an unexpected
/// shape is left out, not the event.
#[derive(Debug, Default, PartialEq)]
struct DecisionFields {
    decision: Option<String>,
    reason: Option<String>,
    rule_versions: Option<RuleVersions>,
    rules: Vec<String>,
}

impl DecisionFields {
    fn of(data: &Value) -> Self {
        fn field<T: serde::de::DeserializeOwned>(data: &Value, key: &str) -> Option<T> {
            data.get(key).and_then(|v| T::deserialize(v).ok())
        }
        Self {
            decision: field(data, "decision"),
            reason: field(data, "reason"),
            rule_versions: field(data, "ruleVersions"),
            rules: field::<Vec<Option<String>>>(data, "rules")
                .map(|rules| rules.into_iter().flatten().collect())
                .unwrap_or_default(),
        }
    }
}

/// What the statements of a batch of ended Runs say, read in the writer's transaction in
/// four statements for the whole batch. Only digests, names, ids, versions, counts, times
/// and codes are read: never a message, a variable, a hold's details or a log.
#[derive(Default)]
struct Facts {
    runs: HashMap<RunId, crate::runs::Run>,
    extra: HashMap<RunId, Extra>,
    approvals: HashMap<RunId, Vec<crate::approvals::GivenApproval>>,
    gate: HashMap<RunId, Vec<GateDecision>>,
    /// The statements signed earlier in this batch, by Run: an apply's plan may be one.
    signed: HashMap<RunId, String>,
}

/// Everything else of one Run's row: the Capsule's tool; the plan an apply carried out (its
/// scan report is the dry-run evidence, its statement the link to it); the state version
/// the Run wrote; the versions of the rules in force now (each scope's latest, as the view
/// `rules_in_force` has them, read from `rule_sets` itself: the writer also runs on a
/// database the new migrations have not reached yet, `upgrade.rs`).
struct Extra {
    id: RunId,
    finished_at: Option<DateTime<Utc>>,
    scan_report: Option<Value>,
    tool: String,
    plan_scan_report: Option<Value>,
    plan_statement_digest: Option<String>,
    plan_pending: bool,
    state_version_digest: Option<String>,
    ws_rules: Option<i32>,
    cap_rules: Option<i32>,
}

impl Facts {
    async fn read(tx: &mut Tx, runs: &[RunId]) -> Result<Self, StoreError> {
        if runs.is_empty() {
            return Ok(Self::default());
        }
        let ids: Vec<uuid::Uuid> = runs.iter().map(RunId::as_uuid).collect();
        let rows = crate::runs::get_many(tx.db(), runs).await?;
        let extra = sqlx::query_as!(
            Extra,
            r#"SELECT r.id as "id: RunId", r.finished_at, r.scan_report, c.tool as "tool!",
                      p.scan_report as "plan_scan_report?",
                      ps.digest as "plan_statement_digest?",
                      EXISTS (SELECT 1 FROM evidence_pending ep WHERE ep.run_id = r.plan_run_id)
                          AS "plan_pending!",
                      sv.digest as "state_version_digest?",
                      (SELECT max(version) FROM rule_sets
                        WHERE workspace_id = r.workspace_id AND capsule_id IS NULL) AS ws_rules,
                      (SELECT max(version) FROM rule_sets
                        WHERE workspace_id = r.workspace_id AND capsule_id = r.capsule_id)
                          AS cap_rules
                 FROM runs r
                 JOIN capsules c ON c.id = r.capsule_id
                 LEFT JOIN runs p ON p.id = r.plan_run_id
                 LEFT JOIN evidence_statements ps ON ps.run_id = r.plan_run_id
                 LEFT JOIN state_versions sv ON sv.id = r.state_version_id
                WHERE r.id = ANY($1)"#,
            &ids
        )
        .fetch_all(tx.db())
        .await?;
        let approvals = crate::approvals::approvals_of(tx.db(), runs).await?;
        // The gate's holds and releases. A plan's own gate step only records that its apply
        // is gated ("recorded", possibly after the plan ended): not a decision on this Run.
        let events = sqlx::query!(
            r#"SELECT run_id as "run_id: RunId", kind, data, at FROM run_events
                WHERE run_id = ANY($1) AND kind IN ('gate_decision', 'held', 'released')
                ORDER BY id"#,
            &ids
        )
        .fetch_all(tx.db())
        .await?;
        let mut gate = HashMap::<RunId, Vec<GateDecision>>::new();
        for e in events {
            let named = DecisionFields::of(&e.data);
            let decision = match e.kind.as_str() {
                "gate_decision" => match named.decision {
                    Some(d) => d,
                    None => continue,
                },
                other => other.to_owned(),
            };
            if decision == "recorded" {
                continue;
            }
            gate.entry(e.run_id).or_default().push(GateDecision {
                decision,
                reason: named.reason,
                rule_versions: named.rule_versions,
                rules: named.rules,
                at: rfc3339(e.at),
            });
        }
        Ok(Self {
            runs: rows.into_iter().map(|r| (r.id, r)).collect(),
            extra: extra.into_iter().map(|x| (x.id, x)).collect(),
            approvals,
            gate,
            signed: HashMap::new(),
        })
    }

    /// What the statement of `run_id`, one of the batch, says.
    fn predicate(&mut self, run_id: RunId, chain: ChainLink) -> Result<RunEvidence, StoreError> {
        let run = self
            .runs
            .remove(&run_id)
            .ok_or(StoreError::NotFound("an ended Run"))?;
        let extra = self
            .extra
            .remove(&run_id)
            .ok_or(StoreError::NotFound("an ended Run"))?;
        // The plan this Run made or carried out: its scan report is the dry-run evidence.
        let plan_run = match (run.kind, run.plan_run_id) {
            (RunKind::Apply, Some(plan)) => Some(plan),
            _ => None,
        };
        let (scan_run, scan_report) = match plan_run {
            Some(plan) => (plan, extra.plan_scan_report),
            None => (run_id, extra.scan_report),
        };
        let dry_run_scan = match &scan_report {
            Some(report) => Some(ScanRef {
                run_id: scan_run.to_string(),
                report_digest: json_digest(report)?,
                clean: report["clean"].as_bool(),
            }),
            None => None,
        };
        let module_tree_digest = scan_report
            .as_ref()
            .and_then(|r| r["modulesDigest"].as_str())
            .map(str::to_owned);
        let plan_ref = match plan_run {
            Some(plan) => {
                let statement_digest = match extra
                    .plan_statement_digest
                    .or_else(|| self.signed.get(&plan).cloned())
                {
                    Some(digest) => digest,
                    // Not signed yet (the plan ended first, so this cannot last): try again.
                    None if extra.plan_pending => {
                        return Err(StoreError::Conflict(
                            "an apply's plan Run's statement is not written yet",
                        ));
                    }
                    // Gone from the database: the chain keeps growing, and verification names
                    // the missing plan statement at this apply.
                    None => String::new(),
                };
                Some(PlanRunRef {
                    run_id: plan.to_string(),
                    statement_digest,
                })
            }
            None => None,
        };
        let state_version = match (run.state_version_id, extra.state_version_digest) {
            (Some(sv), Some(digest)) => Some(StateVersionRef {
                id: sv.to_string(),
                digest,
            }),
            _ => None,
        };
        let approvals = self
            .approvals
            .remove(&run_id)
            .unwrap_or_default()
            .into_iter()
            .map(|a| Approval {
                approver: a.approver_id,
                role: a.approver_role,
                at: rfc3339(a.at),
                plan_digest: a.plan_digest,
            })
            .collect();
        let gate = self.gate.remove(&run_id).unwrap_or_default();
        let changes = run.changes().map(|c| ChangeCounts {
            add: c.add,
            change: c.change,
            destroy: c.destroy,
        });
        let enum_name = |v: Value| v.as_str().unwrap_or_default().to_owned();
        Ok(RunEvidence {
            chain,
            run_id: run.id.to_string(),
            kind: enum_name(serde_json::json!(run.kind)),
            capsule_id: run.capsule_id.to_string(),
            run_group_id: run.run_group_id.map(|g| g.to_string()),
            actor: Actor {
                kind: enum_name(serde_json::json!(run.actor_kind)),
                id: run.actor_id.clone(),
            },
            auto_apply_requested: run.auto_apply_requested,
            result: RunResult {
                status: run.status.as_str().to_owned(),
                error_code: run.error_code.clone(),
                canceled_by: run.canceled_by.clone(),
            },
            ended_at: rfc3339(extra.finished_at.unwrap_or(run.updated_at)),
            plan_digest: run.plan_digest.clone(),
            source: run.source_commit.as_ref().map(|commit| SourceRef {
                commit: commit.clone(),
                tree_digest: run.tree_digest.clone(),
            }),
            tool: ToolRef {
                name: extra.tool,
                version: run.tool_version.as_ref().and_then(|v| {
                    v["terraform_version"]
                        .as_str()
                        .or_else(|| v["version"].as_str())
                        .map(str::to_owned)
                }),
            },
            provider_lock: ProviderLock {
                state: run.provider_lock_state.as_str().to_owned(),
                digest: run.provider_lock_digest.clone(),
            },
            module_tree_digest,
            dependency_snapshot: run.dependency_snapshot.clone(),
            state_generation: run.state_generation,
            changes,
            drift: run.drift,
            rules_in_force: RuleVersions {
                workspace: extra.ws_rules.map(i64::from),
                capsule: extra.cap_rules.map(i64::from),
            },
            gate,
            dry_run_scan,
            approvals,
            sandbox: run.sandbox.map(|s| s.as_str().to_owned()),
            plan_run: plan_ref,
            state_version,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::{DecisionFields, RuleVersions};
    use serde_json::json;

    #[test]
    fn a_gate_events_fields_are_read_each_on_its_own() {
        let released = json!({ "decision": "released", "rules": ["maxDestroy", "planGate"],
            "ruleVersions": { "workspace": 3, "capsule": null }, "cost": { "delta": 1 } });
        assert_eq!(
            DecisionFields::of(&released),
            DecisionFields {
                decision: Some("released".into()),
                reason: None,
                rule_versions: Some(RuleVersions {
                    workspace: Some(3),
                    capsule: None
                }),
                rules: vec!["maxDestroy".into(), "planGate".into()],
            }
        );
        // A field of an unexpected shape is left out; the others still read.
        let odd = json!({ "decision": "held", "reason": { "nested": true }, "ruleVersions": 7 });
        assert_eq!(
            DecisionFields::of(&odd),
            DecisionFields {
                decision: Some("held".into()),
                ..DecisionFields::default()
            }
        );
    }
}

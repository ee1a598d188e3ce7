//! Verification of a Workspace's chain, given only the envelopes and public keys: what the
//! CLI runs offline and a dashboard can call. Every statement's signature, its place in the
//! chain (its Workspace, its position, the digest of the statement before it) and, for an
//! apply, that it carries out exactly the plan digest its plan Run's statement names.
//! The first broken link is the error, and it says which statement and which check.

use base64::Engine as _;
use serde_json::Value;

use crate::canonical::{canonical_value, sha256_hex};
use crate::envelope::{Envelope, PAYLOAD_TYPE, pae};
use crate::keys::KeyRing;
use crate::statement::{
    BUNDLE_FORMAT, Bundle, ChainHead, PREDICATE_TYPE, STATEMENT_TYPE, Statement,
};

/// One statement that verified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    /// Its position in the chain (1-based).
    pub position: u64,
    /// Its digest.
    pub digest: String,
    /// The key that signed it.
    pub key_id: String,
    /// The statement.
    pub statement: Statement,
}

impl Verified {
    /// The Run it is about.
    pub fn run_id(&self) -> &str {
        &self.statement.predicate.run_id
    }
}

/// A chain that verified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    /// The Workspace.
    pub workspace_id: String,
    /// Every statement, in chain order.
    pub statements: Vec<Verified>,
}

impl Report {
    /// The statement of `run_id`.
    pub fn find(&self, run_id: &str) -> Option<&Verified> {
        self.statements.iter().find(|s| s.run_id() == run_id)
    }

    /// The statement of `run_id`, or why there is none.
    pub fn require(&self, run_id: &str) -> Result<&Verified, VerifyError> {
        self.find(run_id).ok_or_else(|| VerifyError::RunMissing {
            run_id: run_id.to_owned(),
            workspace_id: self.workspace_id.clone(),
        })
    }

    /// The digest of the last statement.
    pub fn head(&self) -> Option<&str> {
        self.statements.last().map(|s| s.digest.as_str())
    }

    /// Checks the chain reaches `head`, the last statement the server recorded (read before
    /// the statements, so the chain may have grown past it). Only a
    /// consistency check: whoever can delete statements can rewrite the head too, so an
    /// auditor also keeps the head of the last chain they verified (the head's digest is
    /// printed on every verification) and compares.
    pub fn check_head(&self, head: Option<&ChainHead>) -> Result<(), VerifyError> {
        let Some(head) = head else { return Ok(()) };
        let found = self.statements.len() as u64;
        // The head may be older than the statements read after it, never newer.
        let at_head = usize::try_from(head.sequence)
            .ok()
            .and_then(|n| n.checked_sub(1))
            .and_then(|i| self.statements.get(i));
        if head.sequence == 0
            || at_head.map(|s| Some(s.digest.as_str())) == Some(head.digest.as_deref())
        {
            return Ok(());
        }
        Err(VerifyError::Truncated {
            found,
            found_digest: self.head().map(str::to_owned),
            head: head.sequence,
            head_digest: head.digest.clone(),
        })
    }

    /// The distinct key ids that signed the chain, in first use order.
    pub fn key_ids(&self) -> Vec<&str> {
        let mut ids: Vec<&str> = Vec::new();
        for s in &self.statements {
            if !ids.contains(&s.key_id.as_str()) {
                ids.push(&s.key_id);
            }
        }
        ids
    }
}

/// Where a chain broke. Each names the statement (its position and, once readable, its
/// Run) and the check that failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VerifyError {
    /// Nothing to verify.
    #[error("there is no statement to verify")]
    Empty,
    /// The public keys cannot be used.
    #[error("the public keys cannot be used: {0}")]
    Keys(String),
    /// A bundle of another format.
    #[error("not an evidence bundle of format {BUNDLE_FORMAT}: {0:?}")]
    BundleFormat(String),
    /// The envelope or statement cannot be read.
    #[error("statement #{position}: {problem}")]
    Malformed {
        /// Position in the chain.
        position: u64,
        /// What is wrong.
        problem: String,
    },
    /// Signed by a key the verifier does not have.
    #[error(
        "statement #{position} ({run_id}): signed with key {key_id:?}, which is not among the trusted public keys ({known}); fetch the server's published keys, or the statement was signed by someone else"
    )]
    UnknownKey {
        /// Position in the chain.
        position: u64,
        /// The Run.
        run_id: String,
        /// The key id it names.
        key_id: String,
        /// The key ids the verifier has.
        known: String,
    },
    /// The signature does not match.
    #[error(
        "statement #{position} ({run_id}): the signature by key {key_id:?} does not match the statement: it was altered after it was signed, or its signature was swapped"
    )]
    BadSignature {
        /// Position in the chain.
        position: u64,
        /// The Run.
        run_id: String,
        /// The key id it names.
        key_id: String,
    },
    /// The payload is not in canonical form.
    #[error(
        "statement #{position} ({run_id}): the payload is not canonical JSON, so it is not what Takosumi signs"
    )]
    NotCanonical {
        /// Position in the chain.
        position: u64,
        /// The Run.
        run_id: String,
    },
    /// A statement of another Workspace.
    #[error(
        "statement #{position} ({run_id}) belongs to Workspace {found}, not {expected}: it was spliced in from another Workspace's chain"
    )]
    WrongWorkspace {
        /// Position in the chain.
        position: u64,
        /// The Run.
        run_id: String,
        /// The Workspace it names.
        found: String,
        /// The chain's Workspace.
        expected: String,
    },
    /// The statement does not follow the one before it.
    #[error(
        "statement #{position} ({run_id}) follows {}, but the statement before it here is {}: a statement between them was deleted, or one was rewritten or moved",
        short(found.as_deref()),
        short(expected.as_deref())
    )]
    BrokenLink {
        /// Position in the chain.
        position: u64,
        /// The Run.
        run_id: String,
        /// The digest of the statement before it (`None`: it is the first).
        expected: Option<String>,
        /// The previous digest it names.
        found: Option<String>,
    },
    /// The statement's position is not where it is.
    #[error(
        "statement #{position} ({run_id}) says it is #{found} of its chain: statements were deleted or reordered"
    )]
    Sequence {
        /// Position in the chain.
        position: u64,
        /// The Run.
        run_id: String,
        /// The position it names.
        found: u64,
    },
    /// Two statements of one Run.
    #[error(
        "statement #{position} ({run_id}): the Run already has statement #{first}: a Run has exactly one"
    )]
    DuplicateRun {
        /// Position in the chain.
        position: u64,
        /// The Run.
        run_id: String,
        /// Its first statement's position.
        first: u64,
    },
    /// An apply whose plan Run's statement is not earlier in the chain.
    #[error(
        "statement #{position} (apply {run_id}) carries out plan Run {plan_run_id}, whose statement is not in the chain before it: it was deleted"
    )]
    PlanMissing {
        /// Position in the chain.
        position: u64,
        /// The apply.
        run_id: String,
        /// The plan Run it names.
        plan_run_id: String,
    },
    /// An apply naming another plan statement than its plan Run's.
    #[error(
        "statement #{position} (apply {run_id}) names plan statement {} of {plan_run_id}, but that Run's statement (#{plan_position}) is {}",
        short(Some(named)),
        short(Some(actual))
    )]
    PlanStatementMismatch {
        /// Position in the chain.
        position: u64,
        /// The apply.
        run_id: String,
        /// The plan Run.
        plan_run_id: String,
        /// The plan statement's position.
        plan_position: u64,
        /// The digest the apply names.
        named: String,
        /// The plan statement's digest.
        actual: String,
    },
    /// An apply that carried out another plan than the one its plan Run made.
    #[error(
        "statement #{position} (apply {run_id}) carries out plan digest {}, but its plan Run {plan_run_id}'s statement (#{plan_position}) names plan digest {}: the apply did not carry out the reviewed plan",
        short(apply_digest.as_deref()),
        short(plan_digest.as_deref())
    )]
    PlanDigestMismatch {
        /// Position in the chain.
        position: u64,
        /// The apply.
        run_id: String,
        /// The plan Run.
        plan_run_id: String,
        /// The plan statement's position.
        plan_position: u64,
        /// The plan digest the apply names.
        apply_digest: Option<String>,
        /// The plan digest the plan statement names.
        plan_digest: Option<String>,
    },
    /// The chain ends before the head the server recorded for it.
    #[error(
        "the chain ends at statement #{found} ({}), but the Workspace's recorded head is #{head} ({}): statements at its end were deleted",
        short(found_digest.as_deref()),
        short(head_digest.as_deref())
    )]
    Truncated {
        /// The last statement's position.
        found: u64,
        /// Its digest.
        found_digest: Option<String>,
        /// The head's position.
        head: u64,
        /// The head's digest.
        head_digest: Option<String>,
    },
    /// The Run has no statement in the chain.
    #[error(
        "{run_id} has no statement in the chain of Workspace {workspace_id}: it was never written, or it was deleted"
    )]
    RunMissing {
        /// The Run.
        run_id: String,
        /// The chain's Workspace.
        workspace_id: String,
    },
}

impl VerifyError {
    /// Which check failed: `signature`, `chain`, `workspace`, `plan_link`, `format`,
    /// `missing`.
    pub fn check(&self) -> &'static str {
        match self {
            Self::UnknownKey { .. } | Self::BadSignature { .. } => "signature",
            Self::BrokenLink { .. }
            | Self::Sequence { .. }
            | Self::DuplicateRun { .. }
            | Self::Truncated { .. } => "chain",
            Self::WrongWorkspace { .. } => "workspace",
            Self::PlanMissing { .. }
            | Self::PlanStatementMismatch { .. }
            | Self::PlanDigestMismatch { .. } => "plan_link",
            Self::Malformed { .. } | Self::NotCanonical { .. } => "format",
            Self::Empty | Self::RunMissing { .. } => "missing",
            Self::Keys(_) | Self::BundleFormat(_) => "input",
        }
    }

    /// The position of the statement that broke, if one did.
    pub fn position(&self) -> Option<u64> {
        match self {
            Self::Malformed { position, .. }
            | Self::UnknownKey { position, .. }
            | Self::BadSignature { position, .. }
            | Self::NotCanonical { position, .. }
            | Self::WrongWorkspace { position, .. }
            | Self::BrokenLink { position, .. }
            | Self::Sequence { position, .. }
            | Self::DuplicateRun { position, .. }
            | Self::PlanMissing { position, .. }
            | Self::PlanStatementMismatch { position, .. }
            | Self::PlanDigestMismatch { position, .. } => Some(*position),
            Self::Empty
            | Self::RunMissing { .. }
            | Self::Keys(_)
            | Self::BundleFormat(_)
            | Self::Truncated { .. } => None,
        }
    }
}

fn short(digest: Option<&str>) -> String {
    match digest {
        None => "nothing (the start of the chain)".to_owned(),
        Some(d) => format!("sha256:{}…", d.get(..16).unwrap_or(d)),
    }
}

/// Reads and checks one envelope on its own: its signature and canonical form.
fn open(position: u64, env: &Envelope, keys: &KeyRing) -> Result<Verified, VerifyError> {
    let malformed = |problem: String| VerifyError::Malformed { position, problem };
    if env.payload_type != PAYLOAD_TYPE {
        return Err(malformed(format!(
            "payload type {:?} is not {PAYLOAD_TYPE}",
            env.payload_type
        )));
    }
    let payload = env
        .payload_bytes()
        .ok_or_else(|| malformed("the payload is not base64".to_owned()))?;
    let value: Value = serde_json::from_slice(&payload)
        .map_err(|e| malformed(format!("the payload is not JSON: {e}")))?;
    // The Run is named as soon as it can be, so every later error says whose statement it is.
    let run_id = value["predicate"]["runId"]
        .as_str()
        .unwrap_or("an unnamed Run")
        .to_owned();
    let [signature] = env.signatures.as_slice() else {
        return Err(malformed(format!(
            "{run_id}: has {} signatures; Takosumi writes exactly one",
            env.signatures.len()
        )));
    };
    let key = keys
        .get(&signature.keyid)
        .ok_or_else(|| VerifyError::UnknownKey {
            position,
            run_id: run_id.clone(),
            key_id: signature.keyid.clone(),
            known: keys.key_ids().join(", "),
        })?;
    let sig = base64::engine::general_purpose::STANDARD
        .decode(signature.sig.as_bytes())
        .map_err(|_| VerifyError::BadSignature {
            position,
            run_id: run_id.clone(),
            key_id: signature.keyid.clone(),
        })?;
    if !key.verifies(&pae(&env.payload_type, &payload), &sig) {
        return Err(VerifyError::BadSignature {
            position,
            run_id,
            key_id: signature.keyid.clone(),
        });
    }
    if canonical_value(&value).ok().as_deref() != Some(payload.as_slice()) {
        return Err(VerifyError::NotCanonical { position, run_id });
    }
    let statement: Statement = serde_json::from_value(value)
        .map_err(|e| malformed(format!("{run_id}: not a Takosumi statement: {e}")))?;
    if statement.statement_type != STATEMENT_TYPE || statement.predicate_type != PREDICATE_TYPE {
        return Err(malformed(format!(
            "{run_id}: not a Takosumi Run statement ({} / {})",
            statement.statement_type, statement.predicate_type
        )));
    }
    Ok(Verified {
        position,
        digest: sha256_hex(&payload),
        key_id: signature.keyid.clone(),
        statement,
    })
}

/// Verifies a Workspace's whole chain (`statements`, as served, with the `head` the server
/// recorded) and, when `run` is named, that its statement is in the chain and is the one
/// the server `served` for the Run. The one check `takosumi verify` and the dashboard run.
pub fn verify_run_in_chain(
    workspace: &str,
    statements: &[Envelope],
    head: Option<&ChainHead>,
    keys: &KeyRing,
    run: Option<&str>,
    served: Option<&Envelope>,
) -> Result<(Report, Option<Verified>), VerifyError> {
    let report = verify_chain(Some(workspace), statements, keys)?;
    report.check_head(head)?;
    let verified = match run {
        Some(run) => Some(report.require(run)?.clone()),
        None => None,
    };
    if let (Some(s), Some(v)) = (served, verified.as_ref())
        && s.payload_bytes().map(|b| crate::sha256_hex(&b)) != Some(v.digest.clone())
    {
        return Err(VerifyError::Malformed {
            position: v.position,
            problem: format!(
                "{}: the API served another statement for the Run than the one in its Workspace's chain",
                v.run_id()
            ),
        });
    }
    Ok((report, verified))
}

/// Verifies a Workspace's chain: `statements` in chain order (the Workspace's whole chain,
/// from its first statement), checked against `keys`. `workspace`: the chain's Workspace
/// (`None`: the first statement's).
pub fn verify_chain(
    workspace: Option<&str>,
    statements: &[Envelope],
    keys: &KeyRing,
) -> Result<Report, VerifyError> {
    if statements.is_empty() {
        return Err(VerifyError::Empty);
    }
    let mut out: Vec<Verified> = Vec::with_capacity(statements.len());
    let mut expected_ws = workspace.map(str::to_owned);
    for (i, env) in statements.iter().enumerate() {
        let position = i as u64 + 1;
        let v = open(position, env, keys)?;
        let p = &v.statement.predicate;
        let run_id = p.run_id.clone();
        let ws = expected_ws.get_or_insert_with(|| p.chain.workspace_id.clone());
        if p.chain.workspace_id != *ws {
            return Err(VerifyError::WrongWorkspace {
                position,
                run_id,
                found: p.chain.workspace_id.clone(),
                expected: ws.clone(),
            });
        }
        let before = out.last().map(|b| b.digest.clone());
        if p.chain.previous != before {
            return Err(VerifyError::BrokenLink {
                position,
                run_id,
                expected: before,
                found: p.chain.previous.clone(),
            });
        }
        if p.chain.sequence != position {
            return Err(VerifyError::Sequence {
                position,
                run_id,
                found: p.chain.sequence,
            });
        }
        if let Some(first) = out.iter().find(|o| o.run_id() == run_id) {
            return Err(VerifyError::DuplicateRun {
                position,
                run_id,
                first: first.position,
            });
        }
        if let Some(plan_ref) = &p.plan_run {
            let plan = out
                .iter()
                .find(|o| o.run_id() == plan_ref.run_id)
                .ok_or_else(|| VerifyError::PlanMissing {
                    position,
                    run_id: run_id.clone(),
                    plan_run_id: plan_ref.run_id.clone(),
                })?;
            if plan.digest != plan_ref.statement_digest {
                return Err(VerifyError::PlanStatementMismatch {
                    position,
                    run_id,
                    plan_run_id: plan_ref.run_id.clone(),
                    plan_position: plan.position,
                    named: plan_ref.statement_digest.clone(),
                    actual: plan.digest.clone(),
                });
            }
            if plan.statement.predicate.plan_digest != p.plan_digest {
                return Err(VerifyError::PlanDigestMismatch {
                    position,
                    run_id,
                    plan_run_id: plan_ref.run_id.clone(),
                    plan_position: plan.position,
                    apply_digest: p.plan_digest.clone(),
                    plan_digest: plan.statement.predicate.plan_digest.clone(),
                });
            }
        }
        out.push(v);
    }
    Ok(Report {
        workspace_id: expected_ws.unwrap_or_default(),
        statements: out,
    })
}

impl Bundle {
    /// Verifies the bundle's chain offline, against `trusted` keys or, without them, the
    /// keys the bundle carries (which are only as trustworthy as where the bundle came from:
    /// pin the server's published keys with `trusted` when it matters).
    pub fn verify(&self, trusted: Option<&KeyRing>) -> Result<Report, VerifyError> {
        if self.format != BUNDLE_FORMAT {
            return Err(VerifyError::BundleFormat(self.format.clone()));
        }
        let own;
        let keys = match trusted {
            Some(k) => k,
            None => {
                own = crate::keys::PublishedKeys {
                    keys: self.keys.clone(),
                }
                .to_ring()
                .map_err(|e| VerifyError::Keys(e.to_string()))?;
                &own
            }
        };
        let report = verify_chain(Some(&self.workspace_id), &self.statements, keys)?;
        report.check_head(self.head.as_ref())?;
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::{PublicKey, Signer};
    use crate::statement::*;

    fn predicate(ws: &str, run: &str, kind: &str, seq: u64, prev: Option<String>) -> RunEvidence {
        RunEvidence {
            chain: ChainLink {
                workspace_id: ws.into(),
                sequence: seq,
                previous: prev,
            },
            run_id: run.into(),
            kind: kind.into(),
            capsule_id: "cap_1".into(),
            run_group_id: None,
            actor: Actor {
                kind: "user".into(),
                id: "tok_1".into(),
            },
            auto_apply_requested: false,
            result: RunResult {
                status: if kind == "apply" {
                    "applied"
                } else {
                    "planned"
                }
                .into(),
                error_code: None,
                canceled_by: None,
            },
            ended_at: "2026-12-01T10:00:00.000000Z".into(),
            plan_digest: Some("aa".repeat(32)),
            source: Some(SourceRef {
                commit: "c0ffee".into(),
                tree_digest: Some("bb".repeat(32)),
            }),
            tool: ToolRef {
                name: "terraform".into(),
                version: Some("1.0.3".into()),
            },
            provider_lock: ProviderLock {
                state: "none".into(),
                digest: None,
            },
            module_tree_digest: Some("cc".repeat(32)),
            dependency_snapshot: Some("dd".repeat(32)),
            state_generation: Some(0),
            changes: Some(ChangeCounts {
                add: 1,
                change: 0,
                destroy: 0,
            }),
            drift: None,
            rules_in_force: RuleVersions::default(),
            gate: vec![],
            dry_run_scan: None,
            approvals: vec![],
            sandbox: Some("bubblewrap".into()),
            plan_run: None,
            state_version: None,
        }
    }

    /// A Workspace's chain of `runs` (kind, run id, plan run for applies), signed by `signer`.
    fn chain(signer: &Signer, ws: &str, runs: &[(&str, &str, Option<&str>)]) -> Vec<Envelope> {
        let mut out: Vec<Envelope> = Vec::new();
        let mut digests: Vec<(String, String)> = Vec::new();
        for (i, (kind, run, plan)) in runs.iter().enumerate() {
            let mut p = predicate(
                ws,
                run,
                kind,
                i as u64 + 1,
                digests.last().map(|d| d.1.clone()),
            );
            p.plan_run = plan.map(|plan| PlanRunRef {
                run_id: plan.into(),
                statement_digest: digests.iter().find(|d| d.0 == plan).unwrap().1.clone(),
            });
            let s = Statement::new(p);
            let bytes = s.to_canonical().unwrap();
            digests.push(((*run).to_owned(), sha256_hex(&bytes)));
            out.push(signer.sign(&bytes));
        }
        out
    }

    fn ring(signers: &[&Signer]) -> KeyRing {
        KeyRing::new(signers.iter().map(|s| s.public_key()).collect()).unwrap()
    }

    fn resign(signer: &Signer, env: &Envelope, edit: impl FnOnce(&mut Statement)) -> Envelope {
        let mut s: Statement = serde_json::from_slice(&env.payload_bytes().unwrap()).unwrap();
        edit(&mut s);
        signer.sign(&s.to_canonical().unwrap())
    }

    #[test]
    fn a_plan_and_its_apply_verify_and_link() {
        let (k, _) = Signer::generate("e1").unwrap();
        let c = chain(
            &k,
            "ws_a",
            &[("plan", "run_p", None), ("apply", "run_a", Some("run_p"))],
        );
        let report = verify_chain(Some("ws_a"), &c, &ring(&[&k])).unwrap();
        assert_eq!(report.statements.len(), 2);
        let apply = report.require("run_a").unwrap();
        assert_eq!(apply.position, 2);
        assert_eq!(
            apply
                .statement
                .predicate
                .plan_run
                .as_ref()
                .unwrap()
                .statement_digest,
            report.require("run_p").unwrap().digest
        );
        assert_eq!(report.head(), Some(apply.digest.as_str()));
        assert_eq!(report.key_ids(), vec!["e1"]);
        assert!(matches!(
            report.require("run_x"),
            Err(VerifyError::RunMissing { .. })
        ));
    }

    #[test]
    fn an_altered_statement_fails_its_signature() {
        let (k, _) = Signer::generate("e1").unwrap();
        let mut c = chain(
            &k,
            "ws_a",
            &[("plan", "run_p", None), ("apply", "run_a", Some("run_p"))],
        );
        let text = String::from_utf8(c[0].payload_bytes().unwrap()).unwrap();
        let altered = text.replace("\"add\":1", "\"add\":2");
        assert_ne!(altered, text);
        c[0].payload = base64::engine::general_purpose::STANDARD.encode(altered);
        let err = verify_chain(None, &c, &ring(&[&k])).unwrap_err();
        assert!(
            matches!(err, VerifyError::BadSignature { position: 1, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("#1 (run_p)"), "{err}");
        assert_eq!(err.check(), "signature");
    }

    #[test]
    fn swapped_signatures_fail() {
        let (k, _) = Signer::generate("e1").unwrap();
        let mut c = chain(
            &k,
            "ws_a",
            &[("plan", "run_p", None), ("plan", "run_q", None)],
        );
        let s0 = c[0].signatures.clone();
        c[0].signatures = c[1].signatures.clone();
        c[1].signatures = s0;
        let err = verify_chain(None, &c, &ring(&[&k])).unwrap_err();
        assert!(
            matches!(err, VerifyError::BadSignature { position: 1, .. }),
            "{err}"
        );
    }

    #[test]
    fn a_deleted_statement_breaks_the_link_after_it() {
        let (k, _) = Signer::generate("e1").unwrap();
        let mut c = chain(
            &k,
            "ws_a",
            &[
                ("plan", "run_1", None),
                ("plan", "run_2", None),
                ("plan", "run_3", None),
            ],
        );
        c.remove(1);
        let err = verify_chain(None, &c, &ring(&[&k])).unwrap_err();
        assert!(
            matches!(&err, VerifyError::BrokenLink { position: 2, run_id, .. } if run_id == "run_3"),
            "{err}"
        );
        assert!(err.to_string().contains("deleted"), "{err}");
        // The first one deleted: the new first follows something.
        let mut c = chain(
            &k,
            "ws_a",
            &[("plan", "run_1", None), ("plan", "run_2", None)],
        );
        c.remove(0);
        let err = verify_chain(None, &c, &ring(&[&k])).unwrap_err();
        assert!(
            matches!(
                err,
                VerifyError::BrokenLink {
                    position: 1,
                    expected: None,
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn a_statement_of_another_workspace_is_named_spliced() {
        let (k, _) = Signer::generate("e1").unwrap();
        let mut a = chain(
            &k,
            "ws_a",
            &[("plan", "run_1", None), ("plan", "run_2", None)],
        );
        let b = chain(&k, "ws_b", &[("plan", "run_b", None)]);
        a.push(b[0].clone());
        let err = verify_chain(Some("ws_a"), &a, &ring(&[&k])).unwrap_err();
        assert!(
            matches!(&err, VerifyError::WrongWorkspace { position: 3, found, .. } if found == "ws_b"),
            "{err}"
        );
        assert!(err.to_string().contains("spliced"), "{err}");
        // …also when it takes the place of one of the Workspace's own.
        let mut a = chain(&k, "ws_a", &[("plan", "run_1", None)]);
        a[0] = b[0].clone();
        let err = verify_chain(Some("ws_a"), &a, &ring(&[&k])).unwrap_err();
        assert_eq!(err.check(), "workspace", "{err}");
    }

    #[test]
    fn an_apply_of_another_plan_digest_fails_the_plan_link() {
        let (k, _) = Signer::generate("e1").unwrap();
        let mut c = chain(
            &k,
            "ws_a",
            &[("plan", "run_p", None), ("apply", "run_a", Some("run_p"))],
        );
        c[1] = resign(&k, &c[1], |s| {
            s.predicate.plan_digest = Some("ee".repeat(32));
        });
        let err = verify_chain(None, &c, &ring(&[&k])).unwrap_err();
        assert!(
            matches!(&err, VerifyError::PlanDigestMismatch { position: 2, plan_run_id, .. } if plan_run_id == "run_p"),
            "{err}"
        );
        assert!(
            err.to_string()
                .contains("did not carry out the reviewed plan"),
            "{err}"
        );
        // Naming another statement of the plan Run, or a plan Run not in the chain.
        let mut c = chain(
            &k,
            "ws_a",
            &[("plan", "run_p", None), ("apply", "run_a", Some("run_p"))],
        );
        c[1] = resign(&k, &c[1], |s| {
            s.predicate.plan_run.as_mut().unwrap().statement_digest = "ff".repeat(32);
        });
        let err = verify_chain(None, &c, &ring(&[&k])).unwrap_err();
        assert!(
            matches!(err, VerifyError::PlanStatementMismatch { .. }),
            "{err}"
        );
        let mut c = chain(
            &k,
            "ws_a",
            &[("plan", "run_p", None), ("apply", "run_a", Some("run_p"))],
        );
        c[1] = resign(&k, &c[1], |s| {
            s.predicate.plan_run.as_mut().unwrap().run_id = "run_gone".into();
        });
        let err = verify_chain(None, &c, &ring(&[&k])).unwrap_err();
        assert!(matches!(err, VerifyError::PlanMissing { .. }), "{err}");
    }

    #[test]
    fn rotation_keeps_old_statements_verifiable_with_the_old_public_key() {
        let (old, _) = Signer::generate("e1").unwrap();
        let (new, _) = Signer::generate("e2").unwrap();
        let first = chain(&old, "ws_a", &[("plan", "run_1", None)]);
        let digest = sha256_hex(&first[0].payload_bytes().unwrap());
        let second = Statement::new(predicate("ws_a", "run_2", "plan", 2, Some(digest)));
        let c = vec![first[0].clone(), new.sign(&second.to_canonical().unwrap())];
        let both = KeyRing::new(vec![
            new.public_key(),
            PublicKey::from_base64("e1", &old.public_key().to_base64()).unwrap(),
        ])
        .unwrap();
        let report = verify_chain(None, &c, &both).unwrap();
        assert_eq!(report.key_ids(), vec!["e1", "e2"]);
        let err = verify_chain(None, &c, &ring(&[&new])).unwrap_err();
        assert!(
            matches!(&err, VerifyError::UnknownKey { position: 1, key_id, .. } if key_id == "e1"),
            "{err}"
        );
    }

    #[test]
    fn a_reordered_or_duplicated_chain_fails() {
        let (k, _) = Signer::generate("e1").unwrap();
        let c = chain(
            &k,
            "ws_a",
            &[("plan", "run_1", None), ("plan", "run_2", None)],
        );
        let swapped = vec![c[1].clone(), c[0].clone()];
        let err = verify_chain(None, &swapped, &ring(&[&k])).unwrap_err();
        assert_eq!(err.check(), "chain", "{err}");
        // A second statement for run_1, properly linked and signed.
        let digest = sha256_hex(&c[1].payload_bytes().unwrap());
        let dup = Statement::new(predicate("ws_a", "run_1", "plan", 3, Some(digest)));
        let mut c = c;
        c.push(k.sign(&dup.to_canonical().unwrap()));
        let err = verify_chain(None, &c, &ring(&[&k])).unwrap_err();
        assert!(
            matches!(
                err,
                VerifyError::DuplicateRun {
                    position: 3,
                    first: 1,
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn a_bundle_verifies_offline_with_its_keys_or_pinned_ones() {
        let (k, _) = Signer::generate("e1").unwrap();
        let (other, _) = Signer::generate("e9").unwrap();
        let c = chain(
            &k,
            "ws_a",
            &[("plan", "run_p", None), ("apply", "run_a", Some("run_p"))],
        );
        let bundle = Bundle {
            format: BUNDLE_FORMAT.into(),
            workspace_id: "ws_a".into(),
            keys: crate::keys::PublishedKeys::new(&k, &[]).keys,
            statements: c,
            head: None,
        };
        let text = serde_json::to_string(&bundle).unwrap();
        let back: Bundle = serde_json::from_str(&text).unwrap();
        assert_eq!(back.verify(None).unwrap().statements.len(), 2);
        let err = back.verify(Some(&ring(&[&other]))).unwrap_err();
        assert_eq!(err.check(), "signature", "{err}");
        let mut wrong_ws = back.clone();
        wrong_ws.workspace_id = "ws_b".into();
        assert_eq!(wrong_ws.verify(None).unwrap_err().check(), "workspace");
        let report = back.verify(None).unwrap();
        let mut truncated = back.clone();
        truncated.head = Some(ChainHead {
            sequence: 3,
            digest: Some("ab".repeat(32)),
        });
        let err = truncated.verify(None).unwrap_err();
        assert!(
            matches!(
                err,
                VerifyError::Truncated {
                    found: 2,
                    head: 3,
                    ..
                }
            ),
            "{err}"
        );
        truncated.head = Some(ChainHead {
            sequence: 2,
            digest: report.head().map(str::to_owned),
        });
        assert!(truncated.verify(None).is_ok());
        let mut wrong_format = back;
        wrong_format.format = "something/v0".into();
        assert!(matches!(
            wrong_format.verify(None),
            Err(VerifyError::BundleFormat(_))
        ));
    }

    #[test]
    fn a_non_canonical_payload_is_refused_even_when_signed() {
        let (k, _) = Signer::generate("e1").unwrap();
        let s = Statement::new(predicate("ws_a", "run_1", "plan", 1, None));
        let pretty = serde_json::to_vec_pretty(&s).unwrap();
        let err = verify_chain(None, &[k.sign(&pretty)], &ring(&[&k])).unwrap_err();
        assert!(matches!(err, VerifyError::NotCanonical { .. }), "{err}");
        assert!(matches!(
            verify_chain(None, &[], &ring(&[&k])),
            Err(VerifyError::Empty)
        ));
    }
}

//! A relay worker's progress report, stored whole or not at all: its events and log
//! chunks in one transaction, and a numbered report at most once per claim (see the
//! `report_claim`/`report_seq` migration).

use serde_json::Value;
use takosumi_core::{EventKind, RunId};

use crate::{Pool, StoreError};

/// What [`record`] did with a report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recorded {
    /// Stored: its events and log chunks, all of them.
    Stored,
    /// Not stored: a report of this claim with this number or a later one was stored
    /// already (this one was sent again after its answer was lost), or the claim is no
    /// longer the Run's.
    Repeat,
}

/// One report: its number within the claim (`None`: unnumbered, stored as it comes), its
/// events in order, and its log chunks (step, masked text) in order.
#[derive(Debug, Clone, Copy)]
pub struct Report<'a> {
    /// The report's number within its claim, from 1.
    pub seq: Option<u64>,
    /// Events, in order.
    pub events: &'a [(EventKind, &'a Value)],
    /// Log chunks (step, masked text), in order.
    pub logs: &'a [(&'a str, String)],
}

/// Stores `report` of `claim` on `run` in one transaction: all of it or nothing. A
/// numbered report is stored only when its number is above the last one stored for this
/// claim (the claim's `lease_owner` row lock orders two copies sent at once).
pub async fn record(
    pool: &Pool,
    run: RunId,
    claim: &str,
    actor: &str,
    report: Report<'_>,
) -> Result<Recorded, StoreError> {
    if report.events.is_empty() && report.logs.is_empty() {
        return Ok(Recorded::Stored);
    }
    let mut tx = pool.begin().await?;
    if let Some(seq) = report.seq {
        let seq = i64::try_from(seq).unwrap_or(i64::MAX);
        let taken = sqlx::query!(
            r#"UPDATE runs SET report_claim = $2, report_seq = $3
                WHERE id = $1 AND lease_owner = $2
                  AND (report_claim IS DISTINCT FROM $2 OR report_seq IS NULL OR report_seq < $3)"#,
            run.as_uuid(),
            claim,
            seq
        )
        .execute(tx.db())
        .await?;
        if taken.rows_affected() == 0 {
            return Ok(Recorded::Repeat);
        }
    }
    for (kind, data) in report.events {
        crate::events::append(tx.db(), run, *kind, actor, (*data).clone()).await?;
    }
    for (step, text) in report.logs {
        crate::logs::append(tx.db(), run, step, text).await?;
    }
    tx.commit().await?;
    Ok(Recorded::Stored)
}

//! Domain types every Takosumi crate shares: prefixed typed ids, the Run kinds, statuses
//! and lifecycle (which status may follow which), the wake-up message a queue carries,
//! machine-readable failure codes and the error type a step returns. It does no I/O. (Cost
//! estimates are `takosumi-cost`'s.)
#![deny(missing_docs)]

pub mod decisions;
pub mod digest;
pub mod error;
pub mod event;
pub mod ids;
pub mod kinds;
pub mod lock_state;
pub mod nul;
pub mod role;
pub mod run;
pub mod secret;
pub mod text_enum;
pub mod tool;

pub use decisions::{
    ApplyMode, CapsuleStatus, GateDecision, HoldReason, ResolutionAction, ShownToApprover,
};
pub use digest::sha256_hex;
pub use error::{FailureCode, Outcome, StepError};
pub use event::EventKind;
pub use ids::{
    CapsuleId, EventId, IdParseError, ProviderBindingId, RunGroupId, RunId, StateVersionId,
    TokenId, WorkspaceId,
};
pub use kinds::{ActivityKind, BindingKind, GroupKind, SandboxMode};
pub use lock_state::ProviderLockState;
pub use nul::{holds_nul, json_without_nul, without_nul};
pub use role::{Role, UnknownRole};
pub use run::{ActorKind, Changes, RunKind, RunMessage, RunStatus, Topic, stale_plan_advice};
pub use secret::{Secret, read_secret};
pub use tool::Tool;

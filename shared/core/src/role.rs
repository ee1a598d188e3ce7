//! The roles an API token carries: what each may do is decided in the API's access check
//! (`functions/api/src/auth.rs`), the set itself is closed here.

use serde::{Deserialize, Serialize};

/// An API token's role.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    utoipa::ToSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Reads.
    Viewer,
    /// Reads, submits Runs, cancels and operates.
    Operator,
    /// Reads and approves held Runs.
    Approver,
    /// Everything, including tokens, pools and rules.
    Admin,
    /// An AI agent: submits Runs, which are held for a person before anything acts.
    Agent,
}

/// A role name that is not one of [`Role::ALL`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown role {0:?}: one of viewer, operator, approver, admin, agent")]
pub struct UnknownRole(pub String);

impl Role {
    /// Every role.
    pub const ALL: [Role; 5] = [
        Role::Viewer,
        Role::Operator,
        Role::Approver,
        Role::Admin,
        Role::Agent,
    ];

    /// Its name as stored and shown (`viewer`, …).
    pub const fn as_str(self) -> &'static str {
        match self {
            Role::Viewer => "viewer",
            Role::Operator => "operator",
            Role::Approver => "approver",
            Role::Admin => "admin",
            Role::Agent => "agent",
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Role {
    type Err = UnknownRole;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Role::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| UnknownRole(s.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_match_serde() {
        for role in Role::ALL {
            assert_eq!(role.as_str().parse::<Role>(), Ok(role));
            assert_eq!(
                serde_json::to_value(role).unwrap(),
                serde_json::json!(role.as_str())
            );
        }
        assert!("root".parse::<Role>().is_err());
        assert!("Admin".parse::<Role>().is_err());
    }
}

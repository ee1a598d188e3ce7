//! What a plan recorded of its provider lockfile.

use serde::{Deserialize, Serialize};

/// What a plan recorded of its provider lockfile (`runs.provider_lock_state`, a text
/// column with a CHECK on these names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ProviderLockState {
    /// Not recorded: a legacy digest-only record, or not planned yet. Never regenerated;
    /// its apply is refused.
    Unknown,
    /// A provider-free plan: there is no lockfile.
    None,
    /// The lockfile's bytes are sealed and stored, with their digest.
    Present,
}

impl ProviderLockState {
    /// Every state.
    pub const ALL: [Self; 3] = [Self::Unknown, Self::None, Self::Present];

    /// The stored name.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Unknown => "unknown",
            Self::None => "none",
            Self::Present => "present",
        }
    }

    /// What a plan that read `digest` (the lockfile's, if it had one) records.
    pub const fn of_digest(digest: Option<&str>) -> Self {
        match digest {
            Some(_) => Self::Present,
            None => Self::None,
        }
    }
}

impl std::fmt::Display for ProviderLockState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for ProviderLockState {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|state| state.as_str() == s)
            .ok_or_else(|| format!("{s:?} is not a provider lock state (unknown, none, present)"))
    }
}

// Stored as text (the column predates the enum), so the database type is text's.
#[cfg(feature = "sqlx")]
mod pg {
    use super::ProviderLockState;

    impl sqlx::Type<sqlx::Postgres> for ProviderLockState {
        fn type_info() -> sqlx::postgres::PgTypeInfo {
            <String as sqlx::Type<sqlx::Postgres>>::type_info()
        }

        fn compatible(ty: &sqlx::postgres::PgTypeInfo) -> bool {
            <String as sqlx::Type<sqlx::Postgres>>::compatible(ty)
        }
    }

    impl sqlx::Encode<'_, sqlx::Postgres> for ProviderLockState {
        fn encode_by_ref(
            &self,
            buf: &mut sqlx::postgres::PgArgumentBuffer,
        ) -> Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
            <&str as sqlx::Encode<sqlx::Postgres>>::encode(self.as_str(), buf)
        }
    }

    impl sqlx::Decode<'_, sqlx::Postgres> for ProviderLockState {
        fn decode(value: sqlx::postgres::PgValueRef<'_>) -> Result<Self, sqlx::error::BoxDynError> {
            let text = <&str as sqlx::Decode<sqlx::Postgres>>::decode(value)?;
            Ok(text.parse()?)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_match_serde() {
        for state in ProviderLockState::ALL {
            assert_eq!(state.as_str().parse::<ProviderLockState>(), Ok(state));
            assert_eq!(
                serde_json::to_value(state).unwrap(),
                serde_json::json!(state.as_str())
            );
        }
        assert!("Present".parse::<ProviderLockState>().is_err());
        assert_eq!(
            ProviderLockState::of_digest(Some("ab")),
            ProviderLockState::Present
        );
        assert_eq!(ProviderLockState::of_digest(None), ProviderLockState::None);
    }
}

//! Closed sets stored as Postgres `text` (columns that predate an enum type, with a CHECK on
//! the names) and sent as JSON strings: one macro gives each the same shape — its list of
//! values, its name, `Display`/`FromStr`, serde and (with the `sqlx` feature) the sqlx text
//! encoding — so a name is written once, next to its variant.

/// A name that is not one of a closed set's values.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{value:?} is not a {what} (one of {names})")]
pub struct UnknownName {
    /// What was looked up.
    pub value: String,
    /// What kind of name it should have been (`gate decision`, …).
    pub what: &'static str,
    /// The names there are, comma-separated.
    pub names: String,
}

/// Declares a closed set stored as text: `text_enum! { /// doc
/// pub enum GateDecision("gate decision") { /// doc
/// Held = "held", … } }`. The serde names are snake_case and must equal the stored names (the
/// module's tests check each enum's round trip).
#[macro_export]
macro_rules! text_enum {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident ($what:literal) {
            $( $(#[$vmeta:meta])* $variant:ident = $text:literal ),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(
            Debug, Clone, Copy, PartialEq, Eq, Hash,
            ::serde::Serialize, ::serde::Deserialize, ::utoipa::ToSchema,
        )]
        #[serde(rename_all = "snake_case")]
        $vis enum $name {
            $( $(#[$vmeta])* $variant ),+
        }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [Self] = &[$(Self::$variant),+];

            /// The stored (and JSON) name.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $( Self::$variant => $text ),+
                }
            }
        }

        impl ::std::fmt::Display for $name {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl ::std::str::FromStr for $name {
            type Err = $crate::text_enum::UnknownName;

            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Self::ALL.iter().copied().find(|v| v.as_str() == s).ok_or_else(|| {
                    $crate::text_enum::UnknownName {
                        value: s.to_owned(),
                        what: $what,
                        names: Self::ALL.iter().map(|v| v.as_str()).collect::<Vec<_>>().join(", "),
                    }
                })
            }
        }

        // Compared with a name as it is stored or sent (`hold.reason == "max_destroy"`).
        impl PartialEq<str> for $name {
            fn eq(&self, other: &str) -> bool {
                self.as_str() == other
            }
        }

        impl PartialEq<&str> for $name {
            fn eq(&self, other: &&str) -> bool {
                self.as_str() == *other
            }
        }

        #[cfg(feature = "sqlx")]
        impl ::sqlx::Type<::sqlx::Postgres> for $name {
            fn type_info() -> ::sqlx::postgres::PgTypeInfo {
                <String as ::sqlx::Type<::sqlx::Postgres>>::type_info()
            }

            fn compatible(ty: &::sqlx::postgres::PgTypeInfo) -> bool {
                <String as ::sqlx::Type<::sqlx::Postgres>>::compatible(ty)
            }
        }

        #[cfg(feature = "sqlx")]
        impl ::sqlx::Encode<'_, ::sqlx::Postgres> for $name {
            fn encode_by_ref(
                &self,
                buf: &mut ::sqlx::postgres::PgArgumentBuffer,
            ) -> Result<::sqlx::encode::IsNull, ::sqlx::error::BoxDynError> {
                <&str as ::sqlx::Encode<::sqlx::Postgres>>::encode(self.as_str(), buf)
            }
        }

        #[cfg(feature = "sqlx")]
        impl ::sqlx::Decode<'_, ::sqlx::Postgres> for $name {
            fn decode(
                value: ::sqlx::postgres::PgValueRef<'_>,
            ) -> Result<Self, ::sqlx::error::BoxDynError> {
                let text = <&str as ::sqlx::Decode<::sqlx::Postgres>>::decode(value)?;
                Ok(text.parse()?)
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use crate::{ApplyMode, EventKind, GateDecision, HoldReason, ProviderLockState, Tool};

    fn round_trips<T>(all: &[T])
    where
        T: Copy + PartialEq + std::fmt::Debug + std::fmt::Display + serde::Serialize,
        T: std::str::FromStr<Err = super::UnknownName>,
    {
        for v in all {
            let name = v.to_string();
            assert_eq!(name.parse::<T>().ok(), Some(*v), "{name} parses back");
            assert_eq!(serde_json::to_value(v).unwrap(), serde_json::json!(name));
        }
        let err = "No Such Name".parse::<T>().unwrap_err();
        assert!(err.to_string().contains("is not a"), "{err}");
    }

    #[test]
    fn every_closed_set_round_trips_through_its_stored_and_json_names() {
        round_trips(GateDecision::ALL);
        round_trips(ApplyMode::ALL);
        round_trips(crate::ResolutionAction::ALL);
        round_trips(crate::SandboxMode::ALL);
        round_trips(crate::GroupKind::ALL);
        round_trips(crate::BindingKind::ALL);
        round_trips(crate::ActivityKind::ALL);
        round_trips(crate::CapsuleStatus::ALL);
        round_trips(ProviderLockState::ALL);
        round_trips(Tool::ALL);
        round_trips(HoldReason::ALL);
        round_trips(EventKind::ALL);
    }
}

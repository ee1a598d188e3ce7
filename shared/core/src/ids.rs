//! Prefixed typed ids. A `RunId` prints as `run_<32 hex>` and parses back; it is stored
//! as a plain `uuid` column, so the prefix never reaches the database.

use std::fmt;
use std::str::FromStr;

/// An id string that does not have the expected prefix or body.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{input}` is not a valid {kind} id (expected `{prefix}` followed by 32 hex digits)")]
pub struct IdParseError {
    /// What kind of id was expected.
    pub kind: &'static str,
    /// The prefix the id must start with.
    pub prefix: &'static str,
    /// The rejected input (ids are not secret).
    pub input: String,
}

/// Room for the longest id text: a prefix of up to 8 bytes and 32 hex digits.
const TEXT_MAX: usize = 40;

macro_rules! typed_id {
    ($(#[$doc:meta])* $name:ident, $prefix:literal, $kind:literal) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        #[cfg_attr(feature = "sqlx", derive(sqlx::Type), sqlx(transparent))]
        pub struct $name(uuid::Uuid);

        impl $name {
            /// The prefix this id carries in its text form.
            pub const PREFIX: &'static str = $prefix;

            /// A new time-ordered id.
            pub fn new() -> Self {
                Self(uuid::Uuid::now_v7())
            }

            /// Wraps a uuid read from storage.
            pub fn from_uuid(id: uuid::Uuid) -> Self {
                Self(id)
            }

            /// The uuid stored in the database.
            pub fn as_uuid(&self) -> uuid::Uuid {
                self.0
            }
        }

        impl Default for $name {
            fn default() -> Self {
                Self::new()
            }
        }

        const _: () = assert!($prefix.len() + 32 <= TEXT_MAX);

        impl $name {
            /// The text form (`PREFIX` and 32 hex digits) written into `buf`.
            fn text<'b>(&self, buf: &'b mut [u8; TEXT_MAX]) -> &'b str {
                let p = $prefix.len();
                buf[..p].copy_from_slice($prefix.as_bytes());
                self.0.simple().encode_lower(&mut buf[p..p + 32]);
                // ASCII prefix and hex digits: always UTF-8.
                std::str::from_utf8(&buf[..p + 32]).unwrap_or_default()
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.text(&mut [0; TEXT_MAX]))
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(self, f)
            }
        }

        impl FromStr for $name {
            type Err = IdParseError;

            fn from_str(s: &str) -> Result<Self, Self::Err> {
                let err = || IdParseError { kind: $kind, prefix: $prefix, input: s.chars().take(80).collect() };
                let body = s.strip_prefix($prefix).ok_or_else(err)?;
                if body.len() != 32 {
                    return Err(err());
                }
                uuid::Uuid::try_parse(body).map(Self).map_err(|_| err())
            }
        }

        impl serde::Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                // Whole, from the stack: `collect_str` would feed it to a JSON writer's
                // escaping piece by piece (a page of Runs serializes hundreds of ids).
                s.serialize_str(self.text(&mut [0; TEXT_MAX]))
            }
        }

        // Its OpenAPI schema: a prefixed string; the pattern is what `FromStr` accepts.
        impl utoipa::PartialSchema for $name {
            fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
                utoipa::openapi::schema::ObjectBuilder::new()
                    .schema_type(utoipa::openapi::schema::Type::String)
                    .pattern(Some(concat!("^", $prefix, "[0-9a-f]{32}$")))
                    .description(Some(concat!("A ", $kind, " id: `", $prefix, "` and 32 hex digits.")))
                    .into()
            }
        }

        impl utoipa::ToSchema for $name {}

        impl<'de> serde::Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                s.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}

typed_id!(
    /// A Workspace: a group of Capsules with shared rules and history.
    WorkspaceId, "ws_", "workspace"
);
typed_id!(
    /// A Capsule: a Git repo, a branch and a directory of configuration.
    CapsuleId, "cap_", "capsule"
);
typed_id!(
    /// A Run: one plan, destroy, apply or drift check.
    RunId, "run_", "run"
);
typed_id!(
    /// A RunGroup: Runs started together.
    RunGroupId, "rg_", "run group"
);
typed_id!(
    /// A StateVersion: one generation of a Capsule's state.
    StateVersionId, "sv_", "state version"
);
typed_id!(
    /// An API token (its secret part is never stored, only a hash).
    TokenId, "tok_", "token"
);
typed_id!(
    /// A Run event.
    EventId, "ev_", "event"
);
typed_id!(
    /// A ProviderBinding: a named credential set of a Workspace, attached to Capsules.
    ProviderBindingId, "pb_", "provider binding"
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_through_text() {
        let id = RunId::new();
        let text = id.to_string();
        assert!(text.starts_with("run_"));
        assert_eq!(text.len(), 4 + 32);
        assert_eq!(text.parse::<RunId>().unwrap(), id);
    }

    #[test]
    fn wrong_prefix_or_body_is_rejected() {
        let id = RunId::new().to_string();
        let as_cap = id.replacen("run_", "cap_", 1);
        assert!(as_cap.parse::<RunId>().is_err());
        assert!("run_xyz".parse::<RunId>().is_err());
        let err = "nope".parse::<CapsuleId>().unwrap_err();
        assert!(err.to_string().contains("cap_"));
    }

    #[test]
    fn text_is_the_prefix_and_the_uuids_lower_hex() {
        let u = uuid::Uuid::parse_str("0190F5B2-7C1D-7A2B-9E3F-00AABBCCDDEE").unwrap();
        assert_eq!(
            RunId::from_uuid(u).to_string(),
            "run_0190f5b27c1d7a2b9e3f00aabbccddee"
        );
        assert_eq!(
            ProviderBindingId::from_uuid(u).to_string(),
            "pb_0190f5b27c1d7a2b9e3f00aabbccddee"
        );
        assert_eq!(
            serde_json::to_string(&TokenId::from_uuid(u)).unwrap(),
            "\"tok_0190f5b27c1d7a2b9e3f00aabbccddee\""
        );
    }

    #[test]
    fn ids_serialize_as_prefixed_strings() {
        let id = WorkspaceId::new();
        let json = serde_json::to_string(&id).unwrap();
        assert_eq!(json, format!("\"{id}\""));
        let back: WorkspaceId = serde_json::from_str(&json).unwrap();
        assert_eq!(back, id);
    }
}

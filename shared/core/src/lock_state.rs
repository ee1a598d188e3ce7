//! What a plan recorded of its provider lockfile.

crate::text_enum! {
    /// What a plan recorded of its provider lockfile (`runs.provider_lock_state`, a text
    /// column with a CHECK on these names).
    pub enum ProviderLockState("provider lock state") {
        /// Not recorded: a legacy digest-only record, or not planned yet. Never regenerated;
        /// its apply is refused.
        Unknown = "unknown",
        /// A provider-free plan: there is no lockfile.
        None = "none",
        /// The lockfile's bytes are sealed and stored, with their digest.
        Present = "present",
    }
}

impl ProviderLockState {
    /// What a plan that read `digest` (the lockfile's, if it had one) records.
    pub const fn of_digest(digest: Option<&str>) -> Self {
        match digest {
            Some(_) => Self::Present,
            None => Self::None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_digest_decides_the_state_and_names_are_case_sensitive() {
        assert!("Present".parse::<ProviderLockState>().is_err());
        assert_eq!(
            ProviderLockState::of_digest(Some("ab")),
            ProviderLockState::Present
        );
        assert_eq!(ProviderLockState::of_digest(None), ProviderLockState::None);
    }
}

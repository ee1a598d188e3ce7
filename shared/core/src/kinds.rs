//! The names a record carries beside a Run's own: which sandbox ran a Run, what a RunGroup
//! started, how a ProviderBinding reaches the tool, what an activity entry records. Closed
//! sets, each written once here and stored as text (the columns' CHECKs list the same names).

crate::text_enum! {
    /// How a runner isolates the processes a Capsule's configuration starts (`runs.sandbox`,
    /// `TAKOSUMI_SANDBOX`, a relay worker's claim).
    #[derive(Default)]
    pub enum SandboxMode("sandbox") {
        /// bubblewrap (the default).
        #[default]
        Bubblewrap = "bubblewrap",
        /// No isolation: children run as the handler's user. Only by explicit setting.
        None = "none",
    }
}

crate::text_enum! {
    /// What a RunGroup started (`run_groups.kind`).
    pub enum GroupKind("run group kind") {
        /// A plan of every (or every stale) Capsule of a Workspace.
        PlanUpdate = "plan_update",
        /// A drift check of every applied Capsule of a Workspace.
        DriftCheck = "drift_check",
    }
}

crate::text_enum! {
    /// How a ProviderBinding's sealed credential reaches the tool (`provider_bindings.kind`).
    pub enum BindingKind("provider binding kind") {
        /// Environment variables.
        Env = "env",
        /// One token, as the variables it is named into.
        Token = "token",
        /// A command the step runs for short-lived credentials.
        Command = "command",
    }
}

crate::text_enum! {
    /// What one entry of a Workspace's (or the instance's) activity record is about
    /// (`activity.kind`).
    pub enum ActivityKind("activity kind") {
        /// A Workspace was created.
        WorkspaceCreated = "workspace_created",
        /// A Workspace's settings changed.
        WorkspaceSettings = "workspace_settings",
        /// A Capsule was registered.
        CapsuleRegistered = "capsule_registered",
        /// A Capsule's settings changed.
        CapsuleSettings = "capsule_settings",
        /// A Capsule was moved to (or off) a relay pool.
        CapsulePoolSet = "capsule_pool_set",
        /// A Run was started.
        RunStarted = "run_started",
        /// The gate held a Run for a person.
        RunHeld = "run_held",
        /// A Run was canceled.
        RunCanceled = "run_canceled",
        /// An operator resolved an `unknown_outcome` Run.
        RunResolved = "run_resolved",
        /// A person approved a held Run.
        Approval = "approval",
        /// A Workspace's rules were set.
        RulesSet = "rules_set",
        /// A new state version became a Capsule's state.
        StateVersionWritten = "state_version_written",
        /// A ProviderBinding was created.
        ProviderBindingCreated = "provider_binding_created",
        /// A ProviderBinding was attached to a Capsule.
        ProviderBindingAttached = "provider_binding_attached",
        /// A ProviderBinding was detached from a Capsule.
        ProviderBindingDetached = "provider_binding_detached",
        /// A relay pool was created.
        PoolCreated = "pool_created",
        /// A relay pool's delivery key was rotated.
        PoolDeliveryKeyRotated = "pool_delivery_key_rotated",
        /// A Workspace's webhook secret was set.
        WebhookSecretSet = "webhook_secret_set",
        /// A Git push was received.
        WebhookPush = "webhook_push",
        /// A pull request event was received.
        WebhookPullRequest = "webhook_pull_request",
        /// An API token was created.
        TokenCreated = "token_created",
        /// An API token was revoked.
        TokenRevoked = "token_revoked",
    }
}

//! What the gate decided about a Run, and which path an apply submission took: two closed
//! sets the store's conditional updates and the steps branch on.

crate::text_enum! {
    /// The gate's decision on a Run (`runs.gate_decision`; `NULL` until the gate decided).
    pub enum GateDecision("gate decision") {
        /// Held for a person (or a dry-run scan's review); the hold reason says why.
        Held = "held",
        /// Released: the Run goes on (an Apply Run to the apply queue).
        Released = "released",
    }
}

crate::text_enum! {
    /// How an apply submission runs (`runs.apply_mode`; `NULL` on the ordinary paths).
    pub enum ApplyMode("apply mode") {
        /// An Apply Run that runs `apply -auto-approve` with no saved plan (it has no plan Run).
        OneStep = "one_step",
        /// A plan Run an apply submission started: once planned, the gate proposes its Apply Run.
        ProposesApply = "proposes_apply",
        /// That plan Run once the gate proposed its Apply Run.
        ProposedApply = "proposed_apply",
    }
}

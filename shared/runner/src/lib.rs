//! The sandbox in which tofu/terraform runs.
//!
//! This crate owns, for one run at a time:
//! - a private 0700 run directory ([`Workdir`]) holding the git checkout, the state file
//!   (outside the checkout), the saved plan and an empty HOME — wiped and removed when the
//!   run ends;
//! - the checkout: the branch head or a pinned commit, fetched into a Git cache kept per
//!   repository URL ([`GitCache`]) and exported into the run directory, removal of every
//!   `.terraform` directory, and a deterministic tree digest ([`SourceSnapshot`]);
//! - a backend override that points the tool at the run's own local state file, whatever
//!   backend the repository declares;
//! - starting git and the tool with an environment built from nothing ([`ToolEnv`]), in
//!   their own process group, a step's tool commands in one sandbox through the launcher
//!   ([`launch`]), and reading what they report as JSON ([`count_changes`]) and
//!   the outputs in the state an apply wrote ([`state_outputs`], [`public_outputs`]);
//! - the provider lockfile's raw bytes (at most 1 MiB);
//! - downloading modules once (`get`) and digesting the installed module tree
//!   ([`module_tree_digest`]), so `init -get=false` and a later apply use exactly them.
//!
//! It must never: let a child inherit the server's environment; log or put into an error
//! message a variable value, a credential, plan JSON or tool output (tool output leaves
//! the runner masked with the run's [`Masker`], which [`ToolEnv`] carries and fills with
//! every secret entry, and is left out of `Display`/`Debug` all the same); leave a
//! plan file behind; let the tool read or write state anywhere but the run directory; or
//! talk to the database, the queue or object storage — sealing and storing what it returns
//! is the caller's job.
#![deny(missing_docs)]

mod checkout;
mod credential;
mod env;
mod error;
mod etc_view;
mod interrupt;
pub mod launch;
mod live;
pub mod mask;
mod modules;
mod plan_json;
mod process;
mod runner;
mod sandbox;
mod session;
mod source;
mod tree;
mod workdir;

pub use checkout::{DEFAULT_CACHE_TTL, GitCache};
pub use credential::CREDENTIAL_COMMAND_TIMEOUT;
pub use env::{Tool, ToolEnv, ToolOutput, check_env_name};
pub use error::RunnerError;
pub use live::LogTap;
pub use mask::{MASK, MaskStream, Masker};
pub use modules::{MODULES_DIR, declares_module_calls, module_tree_digest};
pub use plan_json::{
    MAX_DIFF_ATTRIBUTES, MAX_DIFF_RESOURCES, MAX_DIFF_VALUE_CHARS, MAX_OUTPUTS_BYTES,
    count_changes, is_stale_plan, plan_diff, public_outputs, state_outputs,
};
pub use runner::{
    BACKEND_OVERRIDE_FILE, LOCKFILE_NAME, Limits, MAX_LOCKFILE_BYTES, Runner, RunnerConfig,
    SourceSnapshot, TOOL_PATH,
};
pub use sandbox::{SANDBOX_UID, SandboxConfig, SandboxMode, parse_path_list};
pub use source::{RepoUrlRefused, check_repo_url, redact_repo_url, tree_digest};
pub use workdir::{Workdir, create_private_file};

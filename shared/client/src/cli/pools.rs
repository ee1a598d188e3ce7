//! `takosumi pool …` and `takosumi capsule set-pool`: worker pools from the command
//! line. A pool's token is printed once, at creation, because the API keeps only
//! its hash; every refusal prints the API's message and code and then what to do about it.

use clap::{Args, Subcommand};
use serde_json::json;
use takosumi_client::{CapsuleId, Client, ClientError, DeliveryKey, ErrorCode, WorkspaceId};

use super::Outcome;
use super::render::{format_pool, print_json, report_error, show};

/// `takosumi pool …`
#[derive(Subcommand)]
pub(crate) enum PoolCommand {
    /// Create a worker pool in a Workspace (admin tokens). Prints its token once: the API
    /// keeps only its hash.
    Create {
        /// The Workspace (`ws_…`) whose Capsules may run on it.
        #[arg(long, value_name = "WS")]
        workspace: WorkspaceId,
        /// Its unique name (1-48 letters, digits, `-`, `_`, `.`; it names the queues).
        name: String,
        /// The delivery key's id; without a key, applies from this pool fail until one is
        /// set with `takosumi pool rotate-key`.
        #[arg(long, value_name = "ID", requires = "public_key")]
        key_id: Option<String>,
        /// The delivery public key, base64 (`takosumi-relay keygen --key-id ID` prints it).
        #[arg(long, value_name = "B64", requires = "key_id")]
        public_key: Option<String>,
    },
    /// Make a new delivery key the pool's; the old one is still accepted for the grace
    /// period, so workers can be switched over.
    RotateKey {
        /// The pool's name.
        #[arg(value_name = "POOL")]
        pool: String,
        /// The new key's id (one the pool has not used).
        #[arg(long, value_name = "ID")]
        key_id: String,
        /// The new public key, base64 (`takosumi-relay keygen --key-id ID` prints it).
        #[arg(long, value_name = "B64")]
        public_key: String,
        /// How long the previous key stays accepted (0-2592000; default: the API's).
        #[arg(long, value_name = "N")]
        grace_secs: Option<i64>,
    },
}

/// `takosumi capsule set-pool CAP POOL | --none`
#[derive(Args)]
pub(crate) struct SetPoolArgs {
    /// The Capsule (`cap_…`).
    #[arg(value_name = "CAPSULE")]
    pub(crate) capsule: CapsuleId,
    /// The pool that runs its plans, drift checks and applies from now on.
    #[arg(
        value_name = "POOL",
        required_unless_present = "none",
        conflicts_with = "none"
    )]
    pub(crate) pool: Option<String>,
    /// Run it on the control node again.
    #[arg(long)]
    pub(crate) none: bool,
}

/// Runs a `takosumi pool` command; exit code 0, or 1 when the API refused it.
pub(crate) async fn run(client: &Client, command: PoolCommand, json: bool) -> Outcome {
    match command {
        PoolCommand::Create {
            workspace,
            name,
            key_id,
            public_key,
        } => {
            let key = key_id
                .zip(public_key)
                .map(|(key_id, public_key)| DeliveryKey { key_id, public_key });
            let created = match client.create_pool(workspace, &name, key.as_ref()).await {
                Ok(created) => created,
                Err(err) => return refused(err, hint_for),
            };
            if json {
                let mut body = json!(created.pool);
                // The one place the token is shown, on purpose: the caller asked for it.
                body["token"] = json!(created.token.expose());
                print_json(&body);
            } else {
                print!("{}", format_pool(&created.pool));
                println!("token:            {}", created.token.expose());
                eprintln!(
                    "note: the pool token is shown only now (the API keeps only its hash): give it to the pool's relay workers as TAKOSUMI_POOL_TOKEN"
                );
                if created.pool.delivery_key_id.is_none() {
                    eprintln!(
                        "note: the pool has no delivery key, so applies from it fail: set one with `takosumi pool rotate-key {} --key-id ID --public-key B64`",
                        created.pool.name
                    );
                }
            }
            Ok(0)
        }
        PoolCommand::RotateKey {
            pool,
            key_id,
            public_key,
            grace_secs,
        } => {
            let key = DeliveryKey { key_id, public_key };
            match client.rotate_pool_key(&pool, &key, grace_secs).await {
                Ok(p) => {
                    show(&p, json, format_pool);
                    Ok(0)
                }
                Err(err) => refused(err, hint_for),
            }
        }
    }
}

/// Runs `takosumi capsule set-pool`; exit code 0, or 1 when the API refused it.
pub(crate) async fn set_pool(client: &Client, args: SetPoolArgs, json: bool) -> Outcome {
    let pool = if args.none { None } else { args.pool };
    let capsule = match client.set_capsule_pool(args.capsule, pool.as_deref()).await {
        Ok(capsule) => capsule,
        Err(err) => return refused(err, hint_for),
    };
    if json {
        print_json(&capsule);
    } else {
        match &pool {
            Some(p) => println!("{} now runs on worker pool {p}", capsule.id),
            None => println!("{} now runs on the control node", capsule.id),
        }
    }
    Ok(0)
}

/// What to do about a pool refusal, by the API's code.
fn hint_for(code: ErrorCode) -> Option<&'static str> {
    Some(match code {
        ErrorCode::InvalidDeliveryKey => {
            "give the 32-byte X25519 public key in standard base64 that `takosumi-relay keygen --key-id ID` prints, and a key id of letters, digits, '.', '_' or '-'"
        }
        ErrorCode::InvalidName => "pick a name of 1-48 letters, digits, '-', '_' or '.'",
        ErrorCode::PoolExists => "pool names are unique across the API: pick another name",
        ErrorCode::DeliveryKeyIdUsed => "give the new key an id the pool has not used (--key-id)",
        ErrorCode::InvalidGrace => "give --grace-secs between 0 and 2592000 (30 days)",
        ErrorCode::NotFound => {
            "check the names: the pool must exist in the Capsule's Workspace (`takosumi pool create --workspace WS NAME`)"
        }
        _ => return None,
    })
}

/// Prints the API's refusal (message and code, as every command does) and then the hint
/// for its code; exit code 1. Other failures go back to the caller unchanged.
fn refused(err: ClientError, hint: fn(ErrorCode) -> Option<&'static str>) -> Outcome {
    if err.code().is_none() {
        return Err(err);
    }
    let hint = err.known_code().and_then(hint);
    let exit = report_error(&err);
    if let Some(h) = hint {
        eprintln!("hint: {h}");
    }
    Ok(exit)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_have_hints_by_code() {
        assert_eq!(hint_for(ErrorCode::Conflict), None);
        assert!(hint_for(ErrorCode::InvalidDeliveryKey).is_some());
    }
}

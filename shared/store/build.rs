//! Rebuilds the crate when a migration is added or changed: `sqlx::migrate!` embeds the
//! directory at compile time, and cargo does not otherwise know it reads it.

fn main() {
    println!("cargo:rerun-if-changed=../../infra/migrations");
}

//! A Capsule's states: [`versions`] (each generation, sealed in object storage) and
//! [`held`] (a state an apply wrote that object storage would not take, kept sealed in
//! Postgres until an operator restores it).
//!
//! Giving a Capsule a state is the Capsule's generation compare-and-set
//! ([`versions::record_applied`], with the StateVersion in the same statement, and
//! [`crate::capsules::advance_generation_unheld`] for an operator's resolution).

pub mod held;
pub mod versions;

//! A Capsule's states: [`versions`] (each generation, sealed in object storage) and
//! [`held`] (a state an apply wrote that object storage would not take, kept sealed in
//! Postgres until an operator restores it).
//!
//! Giving a Capsule a state is the Capsule's generation compare-and-set, with the
//! StateVersion, its event and its activity entry in the same statement
//! ([`versions::record_written`]: by the apply that holds the Capsule, or by an operator's
//! resolution while no apply does).

pub mod held;
pub mod versions;

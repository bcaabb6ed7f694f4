//! Subcommands of the `megainfer` binary.

pub mod bench;
pub mod run;
pub mod schedule;

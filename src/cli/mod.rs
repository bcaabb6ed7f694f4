//! Subcommands of the `megainfer` binary.

pub mod run;

//! Subcommands of the `megainfer` binary.

pub mod bench;
pub mod chat;
pub mod run;
pub mod schedule;
pub mod soak;

use std::path::Path;

use anyhow::{bail, Context, Result};

/// Checks, before any long run, that `path` (the value of `flag`) can be written: a report
/// that fails to save after minutes of measurement is lost work. An existing file is left
/// untouched; a new one is created and removed again.
pub fn check_output_path(path: &Path, flag: &str) -> Result<()> {
    let shown = path.display();
    if path.is_dir() {
        bail!("{flag} {shown}: is a directory, not a file");
    }
    if path.exists() {
        std::fs::OpenOptions::new()
            .append(true)
            .open(path)
            .with_context(|| format!("{flag} {shown}: cannot write to this file"))?;
        return Ok(());
    }
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
        .with_context(|| format!("{flag} {shown}: cannot create this file"))?;
    std::fs::remove_file(path).with_context(|| format!("{flag} {shown}: cannot remove the probe"))
}

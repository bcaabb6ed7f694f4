//! Run-time compilation of the CUDA sources with NVRTC, to a CUBIN for the device's own
//! architecture, cached on disk so later starts skip the compiler.

use std::ffi::{c_char, CStr, CString};
use std::path::PathBuf;

use anyhow::{anyhow, bail, Context, Result};
use cudarc::nvrtc::{result as nvrtc, sys};
use sha2::{Digest, Sha256};

/// Whether libnvrtc can be loaded (cudarc panics on first use when it cannot).
pub fn nvrtc_present() -> bool {
    // SAFETY: only probes for the shared library.
    unsafe { sys::is_culib_present() }
}

/// `$CUDA_HOME/include`, `$CUDA_PATH/include` or `/usr/local/cuda/include`, when present.
fn cuda_include_dir() -> Option<PathBuf> {
    ["CUDA_HOME", "CUDA_PATH"]
        .iter()
        .filter_map(|v| std::env::var_os(v).map(|d| PathBuf::from(d).join("include")))
        .chain(std::iter::once(PathBuf::from("/usr/local/cuda/include")))
        .find(|d| d.is_dir())
}

/// NVRTC's (major, minor) version.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: plain out-parameters.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| anyhow!("nvrtcVersion failed: {e:?}"))?;
    Ok((major, minor))
}

/// Compiles `source` for `arch` (e.g. `sm_90a`) and returns the CUBIN, from the disk cache
/// when the same source, architecture, options and NVRTC version were compiled before.
pub fn compile_cubin(
    name: &str,
    source: &str,
    arch: &str,
    extra_options: &[String],
) -> Result<Vec<u8>> {
    if !nvrtc_present() {
        bail!("NVRTC (libnvrtc.so) could not be loaded: install the CUDA toolkit or add its lib directory to LD_LIBRARY_PATH");
    }
    let mut options = vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
        "--use_fast_math".to_string(),
        "-default-device".to_string(),
    ];
    if let Some(inc) = cuda_include_dir() {
        options.push(format!("--include-path={}", inc.display()));
    }
    options.extend_from_slice(extra_options);
    let key = cache_key(source, arch, &options, nvrtc_version()?);
    let cache_path = crate::fetch::cache_dir()
        .ok()
        .map(|d| d.join("kernels").join(format!("{name}-{arch}-{key}.cubin")));
    if let Some(p) = &cache_path {
        if let Ok(bytes) = std::fs::read(p) {
            if !bytes.is_empty() {
                return Ok(bytes);
            }
        }
    }

    let cubin = compile_uncached(name, source, &options)?;
    if let Some(p) = &cache_path {
        // A cache that cannot be written only costs a recompile next time.
        if let Some(dir) = p.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        // A name no other write uses: other processes, and variants compiling on threads of
        // their own, may write the same entry at once.
        static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = p.with_extension(format!("tmp{}-{n}", std::process::id()));
        if std::fs::write(&tmp, &cubin).is_ok() {
            let _ = std::fs::rename(&tmp, p);
        }
    }
    Ok(cubin)
}

/// The disk cache's name for a compile: a hash of the source, architecture, options and NVRTC
/// (major, minor) version, less the `--include-path` option. That path names a folder of the
/// machine that compiles, and changes no CUBIN: no CUDA source includes a header (sources.rs
/// assembles each one whole). So a cache filled on one machine is found on another with the
/// same NVRTC version, e.g. kernels compiled ahead for a GPU machine (docs/gpu-machine.md).
fn cache_key(source: &str, arch: &str, options: &[String], version: (i32, i32)) -> String {
    let options: Vec<&String> = options
        .iter()
        .filter(|o| !o.starts_with("--include-path="))
        .collect();
    let mut h = Sha256::new();
    h.update(source.as_bytes());
    h.update(format!("{arch}|{options:?}|{version:?}").as_bytes());
    h.finalize()
        .iter()
        .take(16)
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// [`compile_cubin`] for each set of `option_sets`, on a thread each (NVRTC compiles one
/// program on one core; the megakernel's variants take 10-20 s each), in order.
pub fn compile_cubins(
    name: &str,
    source: &str,
    arch: &str,
    option_sets: &[Vec<String>],
) -> Result<Vec<Vec<u8>>> {
    std::thread::scope(|s| {
        let jobs: Vec<_> = option_sets
            .iter()
            .map(|o| s.spawn(move || compile_cubin(name, source, arch, o)))
            .collect();
        jobs.into_iter()
            .map(|j| {
                j.join()
                    .unwrap_or_else(|_| bail!("a thread compiling {name} panicked"))
            })
            .collect()
    })
}

fn compile_uncached(name: &str, source: &str, options: &[String]) -> Result<Vec<u8>> {
    let src = CString::new(source).context("CUDA source contains a NUL byte")?;
    let cname = CString::new(name).context("program name contains a NUL byte")?;
    let prog = nvrtc::create_program(&src, Some(&cname))
        .map_err(|e| anyhow!("nvrtcCreateProgram: {e:?}"))?;
    // SAFETY: `prog` is live until destroy_program below; src and cname outlive it.
    let result = unsafe {
        let compiled = nvrtc::compile_program(prog, options);
        let log = nvrtc::get_program_log(prog)
            .map(|l| CStr::from_ptr(l.as_ptr()).to_string_lossy().into_owned())
            .unwrap_or_default();
        match compiled {
            Err(e) => Err(anyhow!(
                "NVRTC failed to compile {name} ({e:?}) with {options:?}:\n{log}"
            )),
            Ok(()) => {
                if std::env::var_os("MEGAINFER_NVRTC_LOG").is_some() {
                    eprintln!("NVRTC log for {name}:\n{log}");
                }
                let mut size = 0usize;
                sys::nvrtcGetCUBINSize(prog, &mut size)
                    .result()
                    .map_err(|e| anyhow!("nvrtcGetCUBINSize: {e:?}"))?;
                let mut buf = vec![0u8; size];
                sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut c_char)
                    .result()
                    .map_err(|e| {
                        anyhow!("nvrtcGetCUBIN: {e:?} (architecture must be a real sm_XX)")
                    })?;
                Ok(buf)
            }
        }
    };
    // SAFETY: created above, destroyed once.
    let _ = unsafe { nvrtc::destroy_program(prog) };
    result
}

#[cfg(test)]
mod tests {
    use super::cache_key;

    #[test]
    fn cache_key_ignores_the_include_path_and_nothing_else() {
        let opts = |inc: Option<&str>, define: &str| -> Vec<String> {
            let mut o = vec![
                "--gpu-architecture=sm_90a".to_string(),
                "--std=c++17".to_string(),
            ];
            if let Some(i) = inc {
                o.push(format!("--include-path={i}"));
            }
            o.push(define.to_string());
            o
        };
        let key = |inc, define, version| cache_key("src", "sm_90a", &opts(inc, define), version);
        let base = key(Some("/a/include"), "-DX=1", (13, 0));
        assert_eq!(base.len(), 32);
        assert_eq!(base, key(Some("/b/include"), "-DX=1", (13, 0)));
        assert_eq!(base, key(None, "-DX=1", (13, 0)));
        assert_ne!(base, key(None, "-DX=2", (13, 0)));
        assert_ne!(base, key(None, "-DX=1", (13, 5)));
        assert_ne!(
            base,
            cache_key("src2", "sm_90a", &opts(None, "-DX=1"), (13, 0))
        );
        assert_ne!(
            base,
            cache_key("src", "sm_100a", &opts(None, "-DX=1"), (13, 0))
        );
    }
}

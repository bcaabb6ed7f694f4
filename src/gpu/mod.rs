//! Everything that touches CUDA, through cudarc with the driver loaded at run time.

use anyhow::{bail, Result};

/// Whether libcuda can be loaded at all; cudarc panics on first use when it cannot.
pub fn driver_present() -> bool {
    // SAFETY: only probes for the shared library; loads nothing else.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// True when a CUDA driver can be loaded and reports at least one device.
pub fn available() -> bool {
    driver_present()
        && cudarc::driver::CudaContext::device_count()
            .map(|n| n > 0)
            .unwrap_or(false)
}

/// Fails with a clear message unless a usable GPU is present.
pub fn require() -> Result<()> {
    if !driver_present() {
        bail!("no CUDA driver found (libcuda.so could not be loaded): no GPU on this machine? Use --device cpu");
    }
    match cudarc::driver::CudaContext::device_count() {
        Ok(n) if n > 0 => Ok(()),
        Ok(_) => bail!("the CUDA driver reports no GPU; use --device cpu"),
        Err(e) => bail!("the CUDA driver failed to initialise ({e}); use --device cpu"),
    }
}

pub mod baseline;
pub mod compile;
pub mod device;
pub mod launch;
pub mod lt_gemm;
pub mod megakernel;
pub mod model;
pub mod paths;
pub mod prefill;
pub mod sources;
pub mod stepping;
pub mod switches;

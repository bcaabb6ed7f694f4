//! Compiling the interpreter for a model and loading it.

use std::sync::Arc;

use anyhow::{Context, Result};
use cudarc::driver::CudaModule;
use cudarc::nvrtc::Ptx;

use crate::gpu::compile::compile_cubin;
use crate::gpu::device::Gpu;
use crate::gpu::launch::Kernel;
use crate::gpu::sources;

/// The megakernel compiled (or taken from the disk cache) for `config` on `gpu`.
pub(super) fn load(gpu: &Gpu, config: &crate::model::Config) -> Result<(Arc<CudaModule>, Kernel)> {
    // Extra NVRTC options (e.g. `-DMK_INFLIGHT_STREAM=3`), for measuring variants.
    let mut defines = sources::megakernel_defines(config);
    if let Ok(v) = std::env::var("MEGAINFER_MK_DEFINES") {
        defines.extend(v.split_whitespace().map(String::from));
    }
    let cubin = compile_cubin("megakernel", &sources::megakernel(), &gpu.arch(), &defines)?;
    let module = gpu
        .ctx
        .load_module(Ptx::from_binary(cubin))
        .context("loading the megakernel CUBIN")?;
    let kernel = Kernel::load(&module, "megakernel")?;
    Ok((module, kernel))
}

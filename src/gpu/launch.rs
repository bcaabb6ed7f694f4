//! Kernel launches through cuLaunchKernelEx, so the same call can ask for programmatic
//! dependent launch (PDL) or not.

use std::ffi::c_void;
use std::sync::Arc;

use anyhow::{anyhow, Result};
use cudarc::driver::sys::{self, CUfunction_attribute, CUlaunchAttributeID};
use cudarc::driver::{CudaFunction, CudaModule, CudaStream};

pub struct Kernel {
    pub name: &'static str,
    func: CudaFunction,
}

impl Kernel {
    pub fn load(module: &Arc<CudaModule>, name: &'static str) -> Result<Self> {
        let func = module
            .load_function(name)
            .map_err(|e| anyhow!("kernel {name} missing from the compiled module: {e}"))?;
        Ok(Self { name, func })
    }

    pub fn cu_function(&self) -> cudarc::driver::sys::CUfunction {
        self.func.cu_function()
    }

    /// Allows more than 48 KiB of dynamic shared memory.
    pub fn allow_smem(&self, bytes: usize) -> Result<()> {
        self.func
            .set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
            .map_err(|e| {
                anyhow!(
                    "{}: cannot allow {bytes} B of shared memory: {e}",
                    self.name
                )
            })
    }

    /// Shared memory the kernel declares statically, beside the dynamic part a launch asks for.
    pub fn static_smem(&self) -> Result<usize> {
        self.func
            .shared_size_bytes()
            .map(|b| b as usize)
            .map_err(|e| anyhow!("{}: shared memory size query failed: {e}", self.name))
    }

    pub fn occupancy(&self, block: u32, smem: usize) -> Result<u32> {
        self.func
            .occupancy_max_active_blocks_per_multiprocessor(block, smem, None)
            .map_err(|e| anyhow!("{}: occupancy query failed: {e}", self.name))
    }

    /// Launches with raw argument pointers (each points at the argument's value).
    ///
    /// # Safety
    /// `args` must hold exactly one pointer per kernel parameter, in order, each pointing at a
    /// live value of the parameter's type (e.g. built with [`kargs!`](crate::kargs) from
    /// references to locals of those types); every device pointer among those values must
    /// address memory of this context that stays allocated, and large enough for what the
    /// kernel reads and writes, until the launch completes. The driver cannot check any of
    /// this: a mismatch is undefined behaviour on the device.
    pub unsafe fn launch(
        &self,
        stream: &CudaStream,
        grid: u32,
        block: u32,
        smem: u32,
        pdl: bool,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        // SAFETY: CUlaunchAttribute is a plain C struct (an id and a union of integers and
        // structs of integers) for which all-zero bytes are a valid value.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let cfg = sys::CUlaunchConfig {
            gridDimX: grid,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: smem,
            hStream: stream.cu_stream(),
            attrs: if pdl { &mut attr } else { std::ptr::null_mut() },
            numAttrs: pdl as u32,
        };
        // SAFETY: the caller guarantees that args match the kernel's parameters (this
        // function's contract); the function belongs to the stream's context and `cfg` and
        // `attr` outlive the call.
        unsafe {
            sys::cuLaunchKernelEx(
                &cfg,
                self.func.cu_function(),
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(|e| {
            anyhow!(
                "launching {} (grid {grid}, block {block}, smem {smem}): {e}",
                self.name
            )
        })
    }
}

/// Builds the `void**` argument array from references to plain values.
#[macro_export]
macro_rules! kargs {
    ($($a:expr),* $(,)?) => {
        [$( $a as *const _ as *mut ::std::ffi::c_void ),*]
    };
}

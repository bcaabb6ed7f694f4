//! The GPU we run on: context, stream and the properties schedules depend on.

use std::sync::Arc;

use anyhow::{anyhow, bail, Result};
use cudarc::driver::sys::CUdevice_attribute as Attr;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};

pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub name: String,
    pub sm_count: usize,
    pub compute_capability: (i32, i32),
    /// Opt-in dynamic shared memory per block, bytes.
    pub max_smem_per_block: usize,
    pub total_memory: usize,
}

impl Gpu {
    pub fn new(ordinal: usize) -> Result<Self> {
        super::require()?;
        let ctx =
            CudaContext::new(ordinal).map_err(|e| anyhow!("cannot open GPU {ordinal}: {e}"))?;
        // Buffers are ordered by our single stream; cudarc's per-buffer events would also be
        // captured into graphs, which capture forbids.
        // SAFETY: every launch and copy goes through `stream`, which orders them.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        let attr = |a| {
            ctx.attribute(a)
                .map_err(|e| anyhow!("cuDeviceGetAttribute: {e}"))
        };
        let cc = (
            attr(Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            attr(Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        );
        if cc.0 < 8 {
            bail!(
                "GPU compute capability {}.{} is too old: megainfer needs 8.0 or newer",
                cc.0,
                cc.1
            );
        }
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let (_, total) =
            cudarc::driver::result::mem_get_info().map_err(|e| anyhow!("cuMemGetInfo: {e}"))?;
        Ok(Self {
            name,
            sm_count: attr(Attr::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as usize,
            compute_capability: cc,
            max_smem_per_block: attr(Attr::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?
                as usize,
            total_memory: total,
            ctx,
            stream,
        })
    }

    /// NVRTC target: the device's own architecture, with the `a` variant on Hopper so the
    /// sm_90-only instructions are available.
    pub fn arch(&self) -> String {
        let (ma, mi) = self.compute_capability;
        if ma == 9 && mi == 0 {
            "sm_90a".into()
        } else {
            format!("sm_{ma}{mi}")
        }
    }

    pub fn describe(&self) -> String {
        format!(
            "{} (sm_{}{}, {} SMs, {:.0} GiB)",
            self.name,
            self.compute_capability.0,
            self.compute_capability.1,
            self.sm_count,
            self.total_memory as f64 / (1u64 << 30) as f64
        )
    }

    pub fn alloc_zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        n: usize,
        what: &str,
    ) -> Result<CudaSlice<T>> {
        self.stream.alloc_zeros::<T>(n.max(1)).map_err(|e| {
            anyhow!(
                "out of GPU memory? allocating {what} ({:.1} MiB) failed: {e}",
                (n * std::mem::size_of::<T>()) as f64 / (1 << 20) as f64
            )
        })
    }

    pub fn upload<T: DeviceRepr>(&self, data: &[T], what: &str) -> Result<CudaSlice<T>> {
        self.stream.clone_htod(data).map_err(|e| {
            anyhow!(
                "out of GPU memory? uploading {what} ({:.1} MiB) failed: {e}",
                std::mem::size_of_val(data) as f64 / (1 << 20) as f64
            )
        })
    }
}

/// Raw device address of a buffer (event tracking is off, so no guard is needed).
pub fn ptr<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    use cudarc::driver::DevicePtr;
    s.device_ptr(stream).0
}

//! The GPU we run on: context, stream and the properties schedules depend on.

use std::sync::Arc;

use anyhow::{anyhow, bail, Result};
use cudarc::driver::sys::CUdevice_attribute as Attr;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};

pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    /// Reads single tokens back while `stream` runs the steps after them
    /// (`stepping::decode_stream`); it only reads what a step recorded on `stream` has written,
    /// after waiting for that step's event.
    pub copy_stream: Arc<CudaStream>,
    pub name: String,
    pub sm_count: usize,
    pub compute_capability: (i32, i32),
    /// Opt-in dynamic shared memory per block, bytes.
    pub max_smem_per_block: usize,
    pub total_memory: usize,
    /// The memory's peak bandwidth in bytes a second, from its clock and bus width (None where
    /// the driver reports neither): what sizes the megakernel's loads in flight
    /// ([`Gpu::fast_memory`]).
    pub peak_bandwidth: Option<f64>,
}

impl Gpu {
    pub fn new(ordinal: usize) -> Result<Self> {
        super::require()?;
        let ctx =
            CudaContext::new(ordinal).map_err(|e| anyhow!("cannot open GPU {ordinal}: {e}"))?;
        // Buffers are ordered by our streams' explicit order; cudarc's per-buffer events would
        // also be captured into graphs, which capture forbids.
        // SAFETY: every launch and write goes through `stream`, which orders them; the one
        // use of `copy_stream`, a read, waits for an event recorded on `stream` after the write.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        let copy_stream = ctx.new_stream()?;
        let attr = |a| {
            ctx.attribute(a)
                .map_err(|e| anyhow!("cuDeviceGetAttribute: {e}"))
        };
        let cc = (
            attr(Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            attr(Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        );
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        check_compute_capability(&name, cc)?;
        let (_, total) =
            cudarc::driver::result::mem_get_info().map_err(|e| anyhow!("cuMemGetInfo: {e}"))?;
        Ok(Self {
            name,
            sm_count: attr(Attr::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as usize,
            compute_capability: cc,
            max_smem_per_block: attr(Attr::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?
                as usize,
            total_memory: total,
            peak_bandwidth: peak_bandwidth(
                attr(Attr::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE).ok(),
                attr(Attr::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH).ok(),
            ),
            ctx,
            stream,
            copy_stream,
        })
    }

    /// Whether the memory streams fast enough that the megakernel's loader keeps its whole ring
    /// of pages in flight for the weights (`KernelSpec::whole_ring`): a peak of 4 TB/s or more
    /// (an H200's 4.9; an H100's 3.35 is under it).
    pub fn fast_memory(&self) -> bool {
        self.peak_bandwidth
            .is_some_and(|b| b >= FAST_MEMORY_BYTES_PER_S)
    }

    /// Device memory free now, in bytes.
    pub fn free_memory(&self) -> Result<usize> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| anyhow!("binding the CUDA context: {e}"))?;
        let (free, _) =
            cudarc::driver::result::mem_get_info().map_err(|e| anyhow!("cuMemGetInfo: {e}"))?;
        Ok(free)
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

    /// Name, architecture, SMs, memory and its peak bandwidth (which picks the megakernel's
    /// loader, [`Gpu::fast_memory`]).
    pub fn describe(&self) -> String {
        let peak = self
            .peak_bandwidth
            .map(|b| format!(", peak {:.2} TB/s", b / 1e12))
            .unwrap_or_default();
        format!(
            "{} (sm_{}{}, {} SMs, {:.0} GiB{peak})",
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

/// Page-locked host words the GPU reads and writes directly (mapped): a running kernel
/// publishes into them and the host polls them, with no copy or launch in between (the
/// megakernel's generation hands each token over this way, and the host's stop request back).
pub struct MappedWords {
    host: *mut u32,
    dev: u64,
    len: usize,
    ctx: Arc<CudaContext>,
}

impl MappedWords {
    pub fn new(gpu: &Gpu, len: usize, what: &str) -> Result<Self> {
        use cudarc::driver::{result, sys};
        gpu.ctx
            .bind_to_thread()
            .map_err(|e| anyhow!("binding the CUDA context: {e}"))?;
        let bytes = 4 * len.max(1);
        // SAFETY: a plain page-locked allocation; the pointer is freed once, in Drop. Not
        // write-combined: the host reads these words.
        let host = unsafe { result::malloc_host(bytes, sys::CU_MEMHOSTALLOC_DEVICEMAP) }
            .map_err(|e| anyhow!("allocating {what} ({bytes} B of mapped host memory): {e}"))?
            as *mut u32;
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: host was allocated just above with DEVICEMAP in the current context.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, host as *mut _, 0) };
        let words = Self {
            host,
            dev,
            len: len.max(1),
            ctx: gpu.ctx.clone(),
        };
        r.result()
            .map_err(|e| anyhow!("mapping {what} into the GPU's address space: {e}"))?;
        for i in 0..words.len {
            words.write(i, 0);
        }
        Ok(words)
    }

    /// The words' address for kernels.
    pub fn device_ptr(&self) -> u64 {
        self.dev
    }

    /// Word i as it is now (a kernel may be writing it).
    pub fn read(&self, i: usize) -> u32 {
        assert!(i < self.len, "mapped word {i} of {}", self.len);
        // SAFETY: in bounds; volatile, since the GPU writes the word behind the compiler.
        unsafe { std::ptr::read_volatile(self.host.add(i)) }
    }

    pub fn write(&self, i: usize, v: u32) {
        assert!(i < self.len, "mapped word {i} of {}", self.len);
        // SAFETY: in bounds; volatile, since the GPU reads the word behind the compiler.
        unsafe { std::ptr::write_volatile(self.host.add(i), v) }
    }
}

impl Drop for MappedWords {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by malloc_host in `new`, freed once; the owner makes sure no kernel
        // that uses it is still running (the megakernel path synchronises before it drops).
        let _ = unsafe { cudarc::driver::result::free_host(self.host as *mut _) };
    }
}

/// The kernels use Hopper instructions (`cp.async.bulk`, mbarrier `expect_tx`,
/// `griddepcontrol`): compute capability 9.0 or newer.
pub const MIN_COMPUTE_CAPABILITY: (i32, i32) = (9, 0);

/// Refuses a GPU older than [`MIN_COMPUTE_CAPABILITY`], naming it.
pub fn check_compute_capability(name: &str, cc: (i32, i32)) -> Result<()> {
    if cc < MIN_COMPUTE_CAPABILITY {
        bail!(
            "{name} has compute capability {}.{}; megainfer's GPU kernels need {}.{} or newer (Hopper: cp.async.bulk, mbarrier expect_tx, griddepcontrol). Use --device cpu",
            cc.0,
            cc.1,
            MIN_COMPUTE_CAPABILITY.0,
            MIN_COMPUTE_CAPABILITY.1
        );
    }
    Ok(())
}

/// Raw device address of a buffer (event tracking is off, so no guard is needed).
pub fn ptr<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    use cudarc::driver::DevicePtr;
    s.device_ptr(stream).0
}

/// See [`Gpu::fast_memory`].
pub const FAST_MEMORY_BYTES_PER_S: f64 = 4.0e12;

/// Peak bandwidth from the memory clock (kHz, as the driver reports it) and the bus width
/// (bits): two transfers a clock.
pub fn peak_bandwidth(clock_khz: Option<i32>, bus_bits: Option<i32>) -> Option<f64> {
    match (clock_khz, bus_bits) {
        (Some(k), Some(b)) if k > 0 && b > 0 => Some(k as f64 * 1e3 * 2.0 * b as f64 / 8.0),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::{check_compute_capability, peak_bandwidth, FAST_MEMORY_BYTES_PER_S};

    /// The clocks and bus widths the driver reports on an H100 SXM (2,619 MHz, 5,120 bits)
    /// and an H200 (3,201 MHz, 6,144 bits): only the H200 is fast memory.
    #[test]
    fn peak_bandwidth_separates_h100_and_h200() {
        let h100 = peak_bandwidth(Some(2_619_000), Some(5120)).unwrap();
        let h200 = peak_bandwidth(Some(3_201_000), Some(6144)).unwrap();
        assert!((h100 / 1e12 - 3.352).abs() < 1e-3, "{h100}");
        assert!((h200 / 1e12 - 4.917).abs() < 1e-3, "{h200}");
        assert!(h100 < FAST_MEMORY_BYTES_PER_S && h200 >= FAST_MEMORY_BYTES_PER_S);
        assert_eq!(peak_bandwidth(None, Some(6144)), None);
        assert_eq!(peak_bandwidth(Some(0), Some(6144)), None);
    }

    #[test]
    fn pre_hopper_gpus_are_refused_by_name() {
        let e = check_compute_capability("NVIDIA A100-SXM4-80GB", (8, 0))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("NVIDIA A100-SXM4-80GB") && e.contains("8.0"),
            "{e}"
        );
        assert!(check_compute_capability("NVIDIA GeForce RTX 4090", (8, 9)).is_err());
        assert!(check_compute_capability("NVIDIA H100", (9, 0)).is_ok());
        assert!(check_compute_capability("NVIDIA B200", (10, 0)).is_ok());
    }
}

//! Prefill's products through cuBLASLt, with everything one product needs made once per shape:
//! the operation and layout descriptors and the algorithm cuBLASLt's heuristic picks. A short
//! prompt's prefill is a few hundred launches, and `cublasGemmEx` repeats that setup on the
//! host at every call; with a plan cached per (rows, depth, tokens) a product is one
//! `cublasLtMatmul` call. `MEGAINFER_PREFILL_GEMM=lt` selects it (`src/gpu/prefill.rs`).

use std::collections::HashMap;
use std::ffi::c_void;
use std::mem::size_of;

use anyhow::{anyhow, Result};
use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};

use super::device::{ptr, Gpu};

/// Workspace the algorithms may use (cuBLAS's own default on Hopper is 32 MiB).
const WORKSPACE_BYTES: usize = 32 << 20;
/// Plans kept before the cache starts over (each prompt length makes its own).
const MAX_PLANS: usize = 512;
/// cublasOperation_t's CUBLAS_OP_T (cuBLASLt takes the transpose attribute as an int32).
const OP_T: i32 = 1;

/// `y[t, :] (+)= x[t, :] · W^T` for one shape: W `[n, k]` bf16 row-major, x `[t, k]` bf16, y
/// `[t, n]` f32; column-major as cuBLAS sees it, y^T [n, t] = W [n, k] · x^T [k, t].
struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    w: sys::cublasLtMatrixLayout_t,
    x: sys::cublasLtMatrixLayout_t,
    y: sys::cublasLtMatrixLayout_t,
    algo: sys::cublasLtMatmulAlgo_t,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each handle was created by this plan and is destroyed once.
        unsafe {
            let _ = lt::destroy_matrix_layout(self.y);
            let _ = lt::destroy_matrix_layout(self.x);
            let _ = lt::destroy_matrix_layout(self.w);
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

/// A cuBLASLt handle bound to one stream, as a `CudaBlas` is, with its plans.
pub struct LtGemm {
    handle: sys::cublasLtHandle_t,
    stream: Arc<CudaStream>,
    workspace: CudaSlice<u8>,
    /// By (n, k, t): whether a product accumulates is its beta, not part of its plan.
    plans: HashMap<(usize, usize, usize), Plan>,
}

impl Drop for LtGemm {
    fn drop(&mut self) {
        self.plans.clear();
        // SAFETY: the handle was created in `new` and is destroyed once, after its plans.
        unsafe {
            let _ = lt::destroy_handle(self.handle);
        }
    }
}

fn err(what: &str) -> impl Fn(cudarc::cublaslt::result::CublasError) -> anyhow::Error + '_ {
    move |e| anyhow!("cuBLASLt: {what} failed: {e:?}")
}

impl LtGemm {
    pub fn new(gpu: &Gpu) -> Result<Self> {
        // SAFETY: only probes for the shared library (cudarc panics on first use without it).
        if !unsafe { sys::is_culib_present() } {
            return Err(anyhow!(
                "cuBLASLt (libcublasLt.so) could not be loaded; add the CUDA library directory \
                 to LD_LIBRARY_PATH"
            ));
        }
        let handle = lt::create_handle().map_err(err("creating a handle"))?;
        let workspace = gpu.alloc_zeros(WORKSPACE_BYTES, "cuBLASLt workspace")?;
        Ok(Self {
            handle,
            stream: gpu.stream.clone(),
            workspace,
            plans: HashMap::new(),
        })
    }

    fn plan(n: usize, k: usize, t: usize, handle: sys::cublasLtHandle_t) -> Result<Plan> {
        use sys::cudaDataType::{CUDA_R_16BF, CUDA_R_32F};
        let desc = lt::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, CUDA_R_32F)
            .map_err(err("creating the operation"))?;
        let mut plan = Plan {
            desc,
            w: std::ptr::null_mut(),
            x: std::ptr::null_mut(),
            y: std::ptr::null_mut(),
            // SAFETY: plain data, overwritten by the heuristic's choice below.
            algo: unsafe { std::mem::zeroed() },
        };
        // SAFETY: desc is live; the attribute is an int32 read during the call.
        unsafe {
            lt::set_matmul_desc_attribute(
                plan.desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                &OP_T as *const i32 as *const c_void,
                size_of::<i32>(),
            )
        }
        .map_err(err("setting the transpose"))?;
        plan.w = lt::create_matrix_layout(CUDA_R_16BF, k as u64, n as u64, k as i64)
            .map_err(err("describing the weights"))?;
        plan.x = lt::create_matrix_layout(CUDA_R_16BF, k as u64, t as u64, k as i64)
            .map_err(err("describing the inputs"))?;
        plan.y = lt::create_matrix_layout(CUDA_R_32F, n as u64, t as u64, n as i64)
            .map_err(err("describing the outputs"))?;
        let pref = lt::create_matmul_pref().map_err(err("creating a preference"))?;
        let bytes = WORKSPACE_BYTES as u64;
        // SAFETY: pref is live; the attribute is a u64 read during the call; every descriptor
        // passed to the heuristic is live; pref is destroyed once, whatever the outcome.
        let chosen = unsafe {
            let set = lt::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &bytes as *const u64 as *const c_void,
                size_of::<u64>(),
            );
            let chosen = set.and_then(|()| {
                lt::get_matmul_algo_heuristic(
                    handle, plan.desc, plan.w, plan.x, plan.y, plan.y, pref,
                )
            });
            let _ = lt::destroy_matmul_pref(pref);
            chosen
        }
        .map_err(|e| anyhow!("cuBLASLt: no algorithm for {t} x {k} by {n} x {k}: {e:?}"))?;
        plan.algo = chosen.algo;
        Ok(plan)
    }

    /// `y (+)= x · W^T` as [`Plan`] describes (`accumulate` adds to y), on the handle's stream.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm(
        &mut self,
        w: u64,
        x: u64,
        y: u64,
        n: usize,
        k: usize,
        t: usize,
        accumulate: bool,
    ) -> Result<()> {
        let key = (n, k, t);
        if !self.plans.contains_key(&key) {
            if self.plans.len() >= MAX_PLANS {
                self.plans.clear();
            }
            let plan = Self::plan(n, k, t, self.handle)?;
            self.plans.insert(key, plan);
        }
        let plan = &self.plans[&key];
        let (alpha, beta) = (1f32, if accumulate { 1f32 } else { 0f32 });
        let stream = &self.stream;
        let ws = ptr(&self.workspace, stream);
        // SAFETY: the pointers are live device buffers of the sizes the plan describes (the
        // callers' allocations); alpha and beta are host values (default pointer mode); the
        // workspace is WORKSPACE_BYTES, the limit the algorithm was chosen under; y is both C
        // and D (in place, as cuBLASLt allows).
        unsafe {
            lt::matmul(
                self.handle,
                plan.desc,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                w as *const c_void,
                plan.w,
                x as *const c_void,
                plan.x,
                y as *const c_void,
                plan.y,
                y as *mut c_void,
                plan.y,
                &plan.algo,
                ws as *mut c_void,
                WORKSPACE_BYTES,
                stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(|e| anyhow!("cuBLASLt product ({t} x {k} by {n} x {k}) failed: {e:?}"))
    }
}

//! The graph paths' fused MLP, `bl_mlp` (kernels/baseline/mlp.cuh): a layer's gate/up
//! product, SiLU·up and down projection in one kernel, split over the intermediate rows, its
//! down-projection shares added into the residual by vector reductions.

use std::sync::Arc;

use anyhow::{bail, Context, Result};
use cudarc::driver::{CudaModule, CudaStream};

use crate::gpu::device::Gpu;
use crate::gpu::launch::Kernel;
use crate::kargs;

/// Parameters of `bl_mlp_j*` (`MlpParams` in kernels/baseline/mlp.cuh), field for field.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct MlpParams {
    pub w_gu: u64,
    pub w_down: u64,
    pub x: u64,
    pub norm: u64,
    pub y: u64,
    pub pf: u64,
    pub hidden: i32,
    pub inter: i32,
    pub eps: f32,
    pub evict_first: i32,
    pub pf_bytes: i32,
    pub tasks: i32,
}

/// Intermediate rows a CTA takes (J), by kernel: J = 8 × the 16-byte chunks of a down row's
/// share, which must divide a warp.
const VARIANTS: [(usize, &str); 4] = [
    (16, "bl_mlp_j16"),
    (32, "bl_mlp_j32"),
    (64, "bl_mlp_j64"),
    (128, "bl_mlp_j128"),
];
const THREADS: u32 = 256;

/// When the fused MLP runs (`MEGAINFER_BASELINE_FUSION`'s `mlp` step).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MlpFusion {
    /// The gate/up and down mat-vecs as separate kernels.
    Off,
    /// Without PDL, where its CTAs fill at least [`MIN_FILL`] of the SMs (the default). Under
    /// PDL the two mat-vecs' boundary is mostly hidden already (each kernel's first weights
    /// load before it waits), and the fused kernel measured slower there.
    Auto,
    /// Wherever the shapes allow (for tests on small models).
    On,
}

/// The share of the SMs the fused MLP's one round of CTAs must fill for `Auto` to take it: the
/// split's CTAs are a power-of-two share of the intermediate rows each, one CTA an SM, so a
/// shape whose count falls short of the SMs streams on fewer of them than the mat-vecs do.
/// Measured on the H100's graph path (BENCHMARKS.md, 2026-11-27): 128 and 112 CTAs of 132
/// (Llama-3.2-1B/3B, Llama-3.1-8B) faster; 96 and 76 faster where each CTA streams at most
/// [`SMALL_CTA_BYTES`] (SmolLM2, Qwen3-0.6B, Qwen3-1.7B, Qwen2.5-0.5B: latency, not bandwidth,
/// sets their time); 76 CTAs of 2 MB each (Qwen3-4B) 7% slower.
pub const MIN_FILL: f64 = 0.8;
pub const MIN_FILL_SMALL: f64 = 0.5;
pub const SMALL_CTA_BYTES: usize = 1 << 20;

/// The rows a CTA takes for this shape on `sms` SMs: the smallest J of [`VARIANTS`] that
/// divides `inter` and needs at most one CTA an SM. None where no J fits, or where the hidden
/// size is not a multiple of 16 (the vector reductions add four rows of a lane group's 16).
pub fn rows_per_cta(hidden: usize, inter: usize, sms: usize) -> Option<usize> {
    if hidden == 0 || !hidden.is_multiple_of(16) {
        return None;
    }
    VARIANTS
        .iter()
        .map(|&(j, _)| j)
        .find(|&j| inter.is_multiple_of(j) && inter / j <= sms)
}

/// Whether `fusion` runs the fused MLP for this shape on `sms` SMs (a path launched with PDL
/// or not), and with how many rows a CTA.
pub fn choose(
    fusion: MlpFusion,
    pdl: bool,
    hidden: usize,
    inter: usize,
    sms: usize,
) -> Option<usize> {
    let j = rows_per_cta(hidden, inter, sms)?;
    match fusion {
        MlpFusion::Off => None,
        MlpFusion::On => Some(j),
        MlpFusion::Auto => {
            let fill = (inter / j) as f64 / sms as f64;
            // Gate and up rows, then the down projection's columns, in bf16.
            let cta_bytes = j * hidden * 2 * 2 + hidden * j * 2;
            let fills =
                fill >= MIN_FILL || (fill >= MIN_FILL_SMALL && cta_bytes <= SMALL_CTA_BYTES);
            (!pdl && fills).then_some(j)
        }
    }
}

/// Bytes of the next layer's QKV weights (or the LM head's) the idle SMs prefetch by default:
/// on the H100, graph path, Llama-1B, 32-token prompt + 128 new (BENCHMARKS.md, 2026-11-27):
/// none 1.1145 ms, 4 MiB 1.1078, 16 MiB 1.1418, 64 MiB 1.1909.
pub const PREFETCH: usize = 4 << 20;

pub struct Mlp {
    kernels: Vec<Kernel>,
    max_smem: usize,
    sm_count: usize,
    /// Bytes of the next projection's weights the SMs the split leaves idle prefetch to L2
    /// (`MEGAINFER_BASELINE_MLP_PF`, default [`PREFETCH`]).
    pub prefetch: usize,
}

impl Mlp {
    pub fn load(module: &Arc<CudaModule>, gpu: &Gpu) -> Result<Self> {
        let mut kernels = Vec::new();
        let mut max_smem = gpu.max_smem_per_block;
        for (_, name) in VARIANTS {
            let k = Kernel::load(module, name)?;
            max_smem = max_smem.min(gpu.max_smem_per_block.saturating_sub(k.static_smem()?));
            kernels.push(k);
        }
        for k in &kernels {
            k.allow_smem(max_smem)?;
        }
        let prefetch = match std::env::var("MEGAINFER_BASELINE_MLP_PF") {
            Ok(v) => v
                .trim()
                .parse::<usize>()
                .ok()
                .filter(|&b| b <= i32::MAX as usize)
                .with_context(|| format!("MEGAINFER_BASELINE_MLP_PF: '{v}' is not a byte count"))?,
            Err(_) => PREFETCH,
        };
        Ok(Self {
            kernels,
            max_smem,
            sm_count: gpu.sm_count,
            prefetch,
        })
    }

    /// Enqueues y += W_down · (silu(gate · x̂) ⊙ (up · x̂)), x̂ the RMS-normed x, with `j` rows a
    /// CTA (from [`choose`]); `p`'s addresses set by the caller, y holding the residual, and
    /// `p.pf` the next projection's weights (`next_bytes` of them) or 0.
    #[allow(clippy::too_many_arguments)]
    pub fn launch(
        &self,
        stream: &CudaStream,
        mut p: MlpParams,
        hidden: usize,
        inter: usize,
        j: usize,
        next_bytes: usize,
        evict_first: bool,
        pdl: bool,
    ) -> Result<()> {
        let Some(v) = VARIANTS.iter().position(|&(vj, _)| vj == j) else {
            bail!("fused MLP: no kernel takes {j} rows a CTA");
        };
        let smem = (hidden + j) * 4;
        if !inter.is_multiple_of(j) || !hidden.is_multiple_of(16) || smem > self.max_smem {
            bail!("fused MLP: {hidden} x {inter} cannot be split in {j} rows a CTA");
        }
        p.hidden = hidden as i32;
        p.inter = inter as i32;
        p.evict_first = evict_first as i32;
        let tasks = inter / j;
        p.tasks = tasks as i32;
        let idle = self.sm_count.saturating_sub(tasks);
        p.pf_bytes = if p.pf == 0 || idle == 0 {
            0
        } else {
            self.prefetch.min(next_bytes) as i32
        };
        let grid = tasks + if p.pf_bytes > 0 { idle } else { 0 };
        let mut a = kargs![&p];
        // SAFETY: bl_mlp_j* takes one MlpParams by value, which `p` mirrors (#[repr(C)], field
        // for field); its addresses are the caller's device buffers (w_gu 2 inter x hidden
        // bf16, w_down hidden x inter bf16, x and y hidden floats, norm hidden bf16, pf at
        // least pf_bytes of weights), live until the launch completes.
        unsafe { self.kernels[v].launch(stream, grid as u32, THREADS, smem as u32, pdl, &mut a) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_per_cta_fill_the_sms_once() {
        // Llama-3.2-1B / 3B: 8192 rows in 128 CTAs of 64 on 132 SMs.
        assert_eq!(rows_per_cta(2048, 8192, 132), Some(64));
        assert_eq!(choose(MlpFusion::Auto, false, 3072, 8192, 132), Some(64));
        assert_eq!(choose(MlpFusion::Auto, true, 3072, 8192, 132), None);
        assert_eq!(choose(MlpFusion::On, true, 3072, 8192, 132), Some(64));
        // Llama-3.1-8B: 14336 = 112 x 128 (85% of the SMs).
        assert_eq!(rows_per_cta(4096, 14336, 132), Some(128));
        assert_eq!(choose(MlpFusion::Auto, false, 4096, 14336, 132), Some(128));
        assert_eq!(choose(MlpFusion::On, false, 4096, 14336, 132), Some(128));
        // SmolLM2: 1536 = 96 x 16 (73%, 55 KB a CTA); 1024 rows would be 64 CTAs of 16.
        assert_eq!(choose(MlpFusion::Auto, false, 576, 1536, 132), Some(16));
        assert_eq!(choose(MlpFusion::Auto, false, 576, 1024, 132), None);
        assert_eq!(choose(MlpFusion::On, false, 576, 1024, 132), Some(16));
        // Qwen3-1.7B: 96 CTAs of 64 rows, 768 KiB each; Qwen2.5-0.5B: 76 of 64, 336 KiB;
        // Qwen3-8B: 96 of 128, 3 MiB; Qwen3-4B: 76 of 128, 1.9 MiB.
        assert_eq!(choose(MlpFusion::Auto, false, 2048, 6144, 132), Some(64));
        assert_eq!(choose(MlpFusion::Auto, false, 896, 4864, 132), Some(64));
        assert_eq!(choose(MlpFusion::Auto, false, 4096, 12288, 132), None);
        assert_eq!(choose(MlpFusion::Auto, false, 2560, 9728, 132), None);
        assert_eq!(choose(MlpFusion::On, false, 576, 1536, 132), Some(16));
        // Too many rows for one round of the largest J, or a hidden size the reductions cannot
        // take, or off.
        assert_eq!(rows_per_cta(4096, 18944 * 2, 132), None);
        assert_eq!(rows_per_cta(40, 128, 132), None);
        assert_eq!(choose(MlpFusion::Off, false, 2048, 8192, 132), None);
    }
}

//! The graph paths' attention with the O projection, `bl_attn_o` (kernels/baseline/attn_o.cuh):
//! for short caches, a CTA per (query head, block of W_o rows) attends for its head and adds
//! its rows' share of the O projection into the residual by vector reductions.

use std::sync::Arc;

use anyhow::{bail, Result};
use cudarc::driver::{CudaModule, CudaStream};

use crate::gpu::launch::Kernel;
use crate::kargs;

/// Parameters of `bl_attn_o_d*` (`AttnOParams` in kernels/baseline/attn_o.cuh), field for field.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct AttnOParams {
    pub q: u64,
    pub k_cache: u64,
    pub v_cache: u64,
    pub meta: u64,
    pub w_o: u64,
    pub y: u64,
    pub y2: u64,
    pub n_heads: i32,
    pub n_kv: i32,
    pub hidden: i32,
    pub rows: i32,
    pub evict_first: i32,
    pub pad: i32,
}

const THREADS: u32 = 256;

/// When the fused attention + O projection runs (`MEGAINFER_BASELINE_FUSION`'s `attn` step).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnOFusion {
    Off,
    /// Where a CTA's W_o rows fit its registers, under PDL at head_dim 64 only (the default,
    /// [`choose`]).
    Auto,
    /// On every path (for tests and measuring).
    On,
}

/// W_o rows a CTA takes for this shape on `sms` SMs: the heads' CTAs fill the SMs once (as
/// many row blocks a head as fit), rows a multiple of 16. None where the hidden size is not a
/// multiple of 16 or head_dim is not 64 or 128.
pub fn rows_per_cta(hidden: usize, heads: usize, head_dim: usize, sms: usize) -> Option<usize> {
    if heads == 0 || !hidden.is_multiple_of(16) || !matches!(head_dim, 64 | 128) {
        return None;
    }
    let blocks = (sms / heads).max(1);
    Some(hidden.div_ceil(blocks).div_ceil(16) * 16)
}

/// W_o rows a CTA's warps hold in registers at once (one batch each, loaded before attention):
/// 8 warps x 16 rows per lane group x 32 / (head_dim / 8) groups.
pub fn rows_in_one_batch(head_dim: usize) -> usize {
    8 * 16 * (32 / (head_dim / 8))
}

/// Whether `fusion` runs the fused attention + O projection for this shape on `sms` SMs (a
/// path launched with PDL or not), and with how many W_o rows a CTA. `Auto` takes it where a
/// CTA's rows fit one batch a warp (Llama-3.2-1B, SmolLM2, Qwen3-0.6B, Qwen2.5-0.5B, Qwen3-1.7B
/// on 132 SMs): taller blocks load the rest after attention, and Llama-3.2-3B's (624 rows at
/// head_dim 128, three batches a warp) made its graph path 9% slower; under PDL only at
/// head_dim 64, where `bl_attention` reads its K/V rows after the wait (at 128
/// `bl_attention_preload` reads its first block before it, and the fused kernel measured
/// slower: BENCHMARKS.md, 2026-11-27).
pub fn choose(
    fusion: AttnOFusion,
    pdl: bool,
    hidden: usize,
    heads: usize,
    head_dim: usize,
    sms: usize,
) -> Option<usize> {
    let rows = rows_per_cta(hidden, heads, head_dim, sms)?;
    match fusion {
        AttnOFusion::Off => None,
        AttnOFusion::On => Some(rows),
        AttnOFusion::Auto => {
            ((!pdl || head_dim == 64) && rows <= rows_in_one_batch(head_dim)).then_some(rows)
        }
    }
}

pub struct AttnO {
    kernels: [Kernel; 2],
}

impl AttnO {
    pub fn load(module: &Arc<CudaModule>) -> Result<Self> {
        Ok(Self {
            kernels: [
                Kernel::load(module, "bl_attn_o_d2")?,
                Kernel::load(module, "bl_attn_o_d4")?,
            ],
        })
    }

    /// Enqueues y (and y2, when set) += W_o · attention(q, the caches) with `rows` W_o rows a
    /// CTA (from [`rows_per_cta`]); `p`'s addresses set by the caller.
    #[allow(clippy::too_many_arguments)]
    pub fn launch(
        &self,
        stream: &CudaStream,
        mut p: AttnOParams,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        hidden: usize,
        rows: usize,
        evict_first: bool,
        pdl: bool,
    ) -> Result<()> {
        let k = match head_dim {
            64 => &self.kernels[0],
            128 => &self.kernels[1],
            _ => bail!("fused attention + O: head_dim {head_dim} (64 or 128 only)"),
        };
        if rows == 0 || !rows.is_multiple_of(16) || !hidden.is_multiple_of(16) {
            bail!("fused attention + O: {hidden} rows in blocks of {rows}");
        }
        (p.n_heads, p.n_kv, p.hidden, p.rows) =
            (heads as i32, kv_heads as i32, hidden as i32, rows as i32);
        p.evict_first = evict_first as i32;
        let grid = heads * hidden.div_ceil(rows);
        let smem = ((THREADS as usize / 32) * (2 + head_dim) + 2 * head_dim) * 4;
        let mut a = kargs![&p];
        // SAFETY: bl_attn_o_d* takes one AttnOParams by value, which `p` mirrors (#[repr(C)],
        // field for field); its addresses are the caller's device buffers (q heads x head_dim
        // floats, the layer's caches, the token meta, W_o hidden x heads * head_dim bf16, y and
        // y2 hidden floats), live until the launch completes.
        unsafe { k.launch(stream, grid as u32, THREADS, smem as u32, pdl, &mut a) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_blocks_fill_the_sms_once() {
        // Llama-3.2-1B: 32 heads x 4 blocks of 512 rows on 132 SMs.
        assert_eq!(rows_per_cta(2048, 32, 64, 132), Some(512));
        // Llama-3.2-3B: 24 heads x 5 blocks of 624 (3072 / 5 rounded up to 16).
        assert_eq!(rows_per_cta(3072, 24, 128, 132), Some(624));
        // SmolLM2: 9 heads x 14 blocks of 48.
        assert_eq!(rows_per_cta(576, 9, 64, 132), Some(48));
        assert_eq!(rows_per_cta(40, 4, 64, 132), None);
        assert_eq!(rows_per_cta(2048, 32, 96, 132), None);
        let auto = |h, n, d| choose(AttnOFusion::Auto, false, h, n, d, 132);
        assert_eq!(auto(2048, 32, 64), Some(512));
        assert_eq!(auto(1024, 16, 128), Some(128));
        assert_eq!(auto(3072, 24, 128), None);
        assert_eq!(
            choose(AttnOFusion::On, false, 3072, 24, 128, 132),
            Some(624)
        );
        assert_eq!(
            choose(AttnOFusion::Auto, true, 2048, 32, 64, 132),
            Some(512)
        );
        assert_eq!(choose(AttnOFusion::Auto, true, 1024, 16, 128, 132), None);
        assert_eq!(choose(AttnOFusion::On, true, 2048, 32, 64, 132), Some(512));
    }
}

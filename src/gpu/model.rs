//! Model weights and the KV cache in GPU memory, in the layout both decode paths read.

use anyhow::{bail, Result};
use cudarc::driver::CudaSlice;
use half::bf16;

use super::device::{ptr, Gpu};
use crate::model::{Config, Weights};

fn raw(x: &[bf16]) -> &[u16] {
    bytemuck::cast_slice(x)
}

fn concat(parts: &[&[bf16]]) -> Vec<u16> {
    parts.iter().flat_map(|p| raw(p).iter().copied()).collect()
}

pub struct DeviceLayer {
    pub attn_norm: CudaSlice<u16>,
    /// `[q_dim + 2 * kv_dim, hidden]`: Q rows, then K, then V.
    pub w_qkv: CudaSlice<u16>,
    pub wo: CudaSlice<u16>,
    pub ffn_norm: CudaSlice<u16>,
    /// `[2 * intermediate, hidden]`: gate rows, then up rows.
    pub w_gu: CudaSlice<u16>,
    pub w_down: CudaSlice<u16>,
}

pub struct DeviceModel {
    pub config: Config,
    pub embed: CudaSlice<u16>,
    pub layers: Vec<DeviceLayer>,
    pub final_norm: CudaSlice<u16>,
    /// `None` when tied to `embed`.
    pub lm_head: Option<CudaSlice<u16>>,
    pub inv_freq: CudaSlice<f32>,
    /// Weight bytes one decode step reads (embedding row aside).
    pub bytes_per_token: usize,
}

impl DeviceModel {
    pub fn upload(gpu: &Gpu, config: &Config, w: &Weights) -> Result<Self> {
        if let Some(msg) = config.gpu_unsupported() {
            bail!("{msg}");
        }
        if !config.hidden_size.is_multiple_of(8)
            || !config.intermediate_size.is_multiple_of(8)
            || !config.q_dim().is_multiple_of(8)
        {
            bail!("GPU paths need hidden, intermediate and heads*head_dim to be multiples of 8 (16-byte rows)");
        }
        if config.head_dim != 64 && config.head_dim != 128 {
            bail!(
                "GPU paths support head_dim 64 or 128, not {}",
                config.head_dim
            );
        }
        let layers = w
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| {
                Ok(DeviceLayer {
                    attn_norm: gpu.upload(raw(&l.attn_norm), &format!("layer {i} attn_norm"))?,
                    w_qkv: gpu
                        .upload(&concat(&[&l.wq, &l.wk, &l.wv]), &format!("layer {i} qkv"))?,
                    wo: gpu.upload(raw(&l.wo), &format!("layer {i} o_proj"))?,
                    ffn_norm: gpu.upload(raw(&l.ffn_norm), &format!("layer {i} ffn_norm"))?,
                    w_gu: gpu.upload(
                        &concat(&[&l.w_gate, &l.w_up]),
                        &format!("layer {i} gate/up"),
                    )?,
                    w_down: gpu.upload(raw(&l.w_down), &format!("layer {i} down_proj"))?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            config: config.clone(),
            embed: gpu.upload(raw(&w.embed), "embedding")?,
            layers,
            final_norm: gpu.upload(raw(&w.final_norm), "final norm")?,
            lm_head: match &w.lm_head {
                Some(h) => Some(gpu.upload(raw(h), "lm_head")?),
                None => None,
            },
            inv_freq: gpu.upload(&config.rope_inv_freq(), "rope frequencies")?,
            bytes_per_token: w.bytes_per_token(),
        })
    }

    pub fn lm_head_ptr(&self, gpu: &Gpu) -> u64 {
        ptr(self.lm_head.as_ref().unwrap_or(&self.embed), &gpu.stream)
    }
}

/// K and V, bf16, `max_seq * kv_heads * head_dim` per layer. The order within a layer is the
/// path's: position-major (`[max_seq, kv_heads, head_dim]`) for the baseline kernels,
/// head-major (`[kv_heads, max_seq, head_dim]`) for the megakernel, whose loader copies a KV
/// head's consecutive positions into shared memory in one piece.
pub struct KvCache {
    pub k: CudaSlice<u16>,
    pub v: CudaSlice<u16>,
    pub max_seq: usize,
    pub layer_stride: usize,
}

impl KvCache {
    pub fn bytes(config: &Config, max_seq: usize) -> usize {
        2 * 2 * config.num_layers * max_seq * config.kv_dim()
    }

    pub fn new(gpu: &Gpu, config: &Config, max_seq: usize) -> Result<Self> {
        let layer_stride = max_seq * config.kv_dim();
        let n = config.num_layers * layer_stride;
        let what = format!(
            "KV cache for {max_seq} tokens ({:.1} MiB; lower --max-context to shrink it)",
            Self::bytes(config, max_seq) as f64 / (1 << 20) as f64
        );
        Ok(Self {
            k: gpu.alloc_zeros(n, &what)?,
            v: gpu.alloc_zeros(n, &what)?,
            max_seq,
            layer_stride,
        })
    }
}

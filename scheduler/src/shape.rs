//! The two shapes a schedule is built for: the model's dimensions and the GPU's.

use std::ops::RangeInclusive;

use serde::{Deserialize, Serialize};

use crate::ScheduleError;

/// Dimensions of a Llama-family decoder. Weights are bf16 (2 bytes), activations f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelShape {
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    /// An RMS norm over each q and k head before RoPE (Qwen3). Its sum of squares spans the
    /// head, so `RmsQkvRope` leaves q and k raw (neither normed nor rotated) and `Attention`,
    /// which reads whole heads, applies the norm and RoPE; any cut of the heads into
    /// instructions computes the same.
    #[serde(default)]
    pub qk_norm: bool,
}

/// Names accepted by [`ModelShape::preset`].
pub const PRESETS: &[&str] = &["llama-3.2-1b", "llama-3.2-3b", "smollm2-135m"];

impl ModelShape {
    /// A shape from `[hidden, intermediate, layers, heads, kv_heads, head_dim]`.
    pub fn of(dims: [usize; 6], vocab: usize, qk_norm: bool) -> ModelShape {
        let [hidden, intermediate, layers, heads, kv_heads, head_dim] = dims;
        ModelShape {
            hidden,
            intermediate,
            layers,
            heads,
            kv_heads,
            head_dim,
            vocab,
            qk_norm,
        }
    }

    pub fn preset(name: &str) -> Option<ModelShape> {
        let shape = |hidden, intermediate, layers, heads, kv_heads, head_dim, vocab| {
            ModelShape::of(
                [hidden, intermediate, layers, heads, kv_heads, head_dim],
                vocab,
                false,
            )
        };
        match name {
            "llama-3.2-1b" => Some(shape(2048, 8192, 16, 32, 8, 64, 128256)),
            "llama-3.2-3b" => Some(shape(3072, 8192, 28, 24, 8, 128, 128256)),
            "smollm2-135m" => Some(shape(576, 1536, 30, 9, 3, 64, 49152)),
            _ => None,
        }
    }

    /// Query heads that share one KV head.
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads
    }

    pub fn q_dim(&self) -> usize {
        self.heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Heads of the concatenated q|k|v projection, the index space of `RmsQkvRope::head`.
    pub fn qkv_heads(&self) -> usize {
        self.heads + 2 * self.kv_heads
    }

    /// Weight bytes one token streams: every matrix once (norm vectors included, the
    /// embedding row aside), the LM head counted once whether or not it is tied.
    pub fn weight_bytes(&self) -> u64 {
        let (h, i) = (self.hidden as u64, self.intermediate as u64);
        let layer = h * (self.q_dim() + 2 * self.kv_dim()) as u64
            + self.q_dim() as u64 * h
            + 3 * h * i
            + 2 * h;
        2 * (self.layers as u64 * layer + h + self.vocab as u64 * h)
    }

    /// KV-cache bytes (bf16) attention reads for a sequence of `len` positions.
    pub fn kv_bytes(&self, len: usize) -> u64 {
        2 * 2 * (self.layers * len * self.kv_dim()) as u64
    }

    pub(crate) fn check(&self) -> Result<(), ScheduleError> {
        let bad = |why: String| Err(ScheduleError::Shape(why));
        let dims = [
            ("hidden", self.hidden),
            ("intermediate", self.intermediate),
            ("layers", self.layers),
            ("heads", self.heads),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("vocab", self.vocab),
        ];
        for (name, v) in dims {
            // Every index must fit the u32 fields of the encoding with room for products.
            if v == 0 || v > 1 << 24 {
                return bad(format!("{name} = {v} is outside 1..=2^24"));
            }
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return bad(format!(
                "heads ({}) is not a multiple of kv_heads ({})",
                self.heads, self.kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad(format!(
                "head_dim ({}) must be even for RoPE",
                self.head_dim
            ));
        }
        Ok(())
    }
}

/// SMs a [`GpuShape`] may have: a schedule has a stream per SM, and no GPU has more than a few
/// hundred.
pub const SMS: RangeInclusive<usize> = 1..=4096;
/// Shared-memory pages per SM and bytes per page (a CTA has at most a few hundred KiB).
pub const SMEM_PAGES: RangeInclusive<usize> = 1..=256;
pub const PAGE_BYTES: RangeInclusive<usize> = 1024..=1 << 20;

/// What the scheduler needs to know of the GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuShape {
    /// One persistent CTA per SM, each with its own instruction stream.
    pub sm_count: usize,
    /// Shared memory per CTA is split into this many pages of `page_bytes`.
    pub smem_pages: usize,
    pub page_bytes: usize,
}

impl GpuShape {
    /// H100 SXM: 132 SMs, 12 weight pages of 16 KiB (what the megakernel leaves of the 227
    /// KiB a CTA may use, beside its other shared memory, for Llama-3.2-1B).
    pub fn h100() -> GpuShape {
        GpuShape::with_sms(132)
    }

    /// H100-like shared memory with another SM count (tests, other parts).
    pub fn with_sms(sm_count: usize) -> GpuShape {
        GpuShape {
            sm_count,
            smem_pages: 12,
            page_bytes: 16 << 10,
        }
    }

    pub fn smem_bytes(&self) -> usize {
        self.smem_pages * self.page_bytes
    }

    pub(crate) fn check(&self, model: &ModelShape) -> Result<(), ScheduleError> {
        let fields = [
            ("sm_count", self.sm_count, &SMS),
            ("smem_pages", self.smem_pages, &SMEM_PAGES),
            ("page_bytes", self.page_bytes, &PAGE_BYTES),
        ];
        for (name, v, range) in fields {
            if !range.contains(&v) {
                return Err(ScheduleError::Gpu(format!(
                    "{name} = {v} is outside {range:?}"
                )));
            }
        }
        // Normalising instructions keep the whole f32 input vector in shared memory.
        let vector = 4 * model.hidden.max(model.q_dim());
        if vector > self.smem_bytes() {
            return Err(ScheduleError::Gpu(format!(
                "an f32 vector of {vector} bytes does not fit {} pages of {} bytes",
                self.smem_pages, self.page_bytes
            )));
        }
        Ok(())
    }
}

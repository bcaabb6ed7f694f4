//! Model weights and the KV cache in GPU memory, in the layout both decode paths read.

use anyhow::{bail, Result};
use cudarc::driver::CudaSlice;
use half::bf16;

use super::device::{ptr, Gpu};
use crate::model::{Config, Matrix, WeightType, Weights};

fn raw(x: &[bf16]) -> &[u16] {
    bytemuck::cast_slice(x)
}

fn concat(parts: &[&[bf16]]) -> Vec<u16> {
    parts.iter().flat_map(|p| raw(p).iter().copied()).collect()
}

/// A weight matrix in GPU memory. bf16 matrices are their values, row-major. Quantised ones
/// are stored row by row, each row one 16-byte-aligned piece (kernels/quant/decode.cuh): its
/// blocks' quants (Q8_0 32 `i8` per block; Q4_0, Q4_1 and Q6_K the 16 bytes of nibbles as GGUF
/// stores Q4's, byte `j`: element `j` low, `j + 16` high), then its blocks' headers (f16 `d`, or
/// `d` then `m` for Q4_1; Q6_K's 12 bytes of scales and top bits), then zeros to a multiple of 16
/// bytes. The 34-, 18-, 20- and 28-byte blocks are not 16-byte aligned; this way a row's quants are, and the megakernel copies a whole row
/// into shared memory in one piece.
pub struct DeviceMatrix {
    pub ty: WeightType,
    pub rows: usize,
    pub cols: usize,
    pub data: CudaSlice<u16>,
}

/// Bytes of one row of a quantised matrix of `cols` columns in the device layout.
pub fn quantised_row_bytes(q: crate::model::quant::QuantType, cols: usize) -> usize {
    let blocks = cols / crate::model::quant::BLOCK;
    blocks * q.quant_bytes() + (blocks * q.header_bytes()).next_multiple_of(16)
}

impl DeviceMatrix {
    /// Uploads the rows of `parts` one after the other (Q|K|V, gate|up) as one matrix; they
    /// share the column count and storage type (the loaders make sure of it).
    fn upload(gpu: &Gpu, parts: &[&Matrix], what: &str) -> Result<Self> {
        let (ty, cols) = (parts[0].ty(), parts[0].cols());
        if parts.iter().any(|m| m.ty() != ty || m.cols() != cols) {
            bail!("{what}: the matrices uploaded together differ in storage type or width");
        }
        let rows = parts.iter().map(|m| m.rows()).sum();
        let Some(q) = ty.quant() else {
            let vals: Vec<&[bf16]> = parts
                .iter()
                .map(|m| m.as_bf16().expect("type checked above"))
                .collect();
            return Ok(Self {
                ty,
                rows,
                cols,
                data: gpu.upload(&concat(&vals), what)?,
            });
        };
        let (head, block) = (q.header_bytes(), q.block_bytes());
        let row_bytes = quantised_row_bytes(q, cols);
        let blocks_per_row = cols / crate::model::quant::BLOCK;
        let mut out = Vec::with_capacity(rows * row_bytes);
        for m in parts {
            let (_, bytes) = m.blocks().expect("type checked above");
            for row in bytes.chunks_exact(block * blocks_per_row) {
                let start = out.len();
                for b in row.chunks_exact(block) {
                    out.extend_from_slice(&b[head..]);
                }
                for b in row.chunks_exact(block) {
                    out.extend_from_slice(&b[..head]);
                }
                out.resize(start + row_bytes, 0);
            }
        }
        let words: Vec<u16> = out
            .chunks_exact(2)
            .map(|p| u16::from_le_bytes([p[0], p[1]]))
            .collect();
        Ok(Self {
            ty,
            rows,
            cols,
            data: gpu.upload(&words, what)?,
        })
    }

    /// The values (bf16) or the quants.
    pub fn ptr(&self, gpu: &Gpu) -> u64 {
        ptr(&self.data, &gpu.stream)
    }

    /// Bytes the matrix occupies, which a mat-vec over it streams.
    pub fn bytes(&self) -> usize {
        self.ty.bytes(self.rows * self.cols)
    }

    /// The `WEIGHT_*` code of its type (`WeightType::code`).
    pub fn type_code(&self) -> i32 {
        self.ty.code()
    }
}

pub struct DeviceLayer {
    pub attn_norm: CudaSlice<u16>,
    /// `[q_dim + 2 * kv_dim, hidden]`: Q rows, then K, then V.
    pub w_qkv: DeviceMatrix,
    pub wo: DeviceMatrix,
    pub ffn_norm: CudaSlice<u16>,
    /// `[2 * intermediate, hidden]`: gate rows, then up rows.
    pub w_gu: DeviceMatrix,
    pub w_down: DeviceMatrix,
    /// Qwen2's q/k/v biases, `[q_dim + 2 * kv_dim]` (Q, then K, then V).
    pub qkv_bias: Option<CudaSlice<u16>>,
    /// Qwen3's per-head RMS norms of q and k, `[head_dim]` each.
    pub q_norm: Option<CudaSlice<u16>>,
    pub k_norm: Option<CudaSlice<u16>>,
}

/// Enqueues `qkv_extras` (kernels/qkv_extras.cuh, loaded as `kernel`) on `rows` rows of the
/// f32 QKV product at `qkv` for layer `lw`; nothing for a layer without biases or q/k norms.
pub fn enqueue_qkv_extras(
    kernel: &super::launch::Kernel,
    gpu: &Gpu,
    config: &Config,
    lw: &DeviceLayer,
    qkv: u64,
    rows: usize,
    pdl: bool,
) -> Result<()> {
    let Some([bias, q_norm, k_norm]) = lw.qkv_extras(gpu) else {
        return Ok(());
    };
    let (nh, nkv, hd) = (
        config.num_heads as i32,
        config.num_kv_heads as i32,
        config.head_dim as i32,
    );
    let eps = config.rms_norm_eps;
    let blocks = rows * (config.num_heads + 2 * config.num_kv_heads);
    // SAFETY: the arguments are qkv_extras' parameters, in order; qkv holds `rows` rows of
    // (heads + 2 * kv_heads) * head_dim floats, and bias / q_norm / k_norm are this layer's
    // buffers of the widths the kernel reads, or 0 where the model has none.
    unsafe {
        kernel.launch(
            &gpu.stream,
            blocks as u32,
            config.head_dim as u32,
            0,
            pdl,
            &mut crate::kargs![&qkv, &nh, &nkv, &hd, &bias, &q_norm, &k_norm, &eps],
        )
    }
}

impl DeviceLayer {
    /// Device pointers (bias, q_norm, k_norm; 0 where absent) for `qkv_extras`
    /// (kernels/qkv_extras.cuh), or `None` when the layer has none of them (Llama).
    pub fn qkv_extras(&self, gpu: &Gpu) -> Option<[u64; 3]> {
        let p = |b: &Option<CudaSlice<u16>>| b.as_ref().map_or(0, |b| ptr(b, &gpu.stream));
        let ptrs = [p(&self.qkv_bias), p(&self.q_norm), p(&self.k_norm)];
        ptrs.iter().any(|&x| x != 0).then_some(ptrs)
    }
}

pub struct DeviceModel {
    pub config: Config,
    pub embed: DeviceMatrix,
    pub layers: Vec<DeviceLayer>,
    pub final_norm: CudaSlice<u16>,
    /// `None` when tied to `embed`.
    pub lm_head: Option<DeviceMatrix>,
    pub inv_freq: CudaSlice<f32>,
    /// Weight bytes one decode step reads (embedding row aside).
    pub bytes_per_token: usize,
}

impl DeviceModel {
    pub fn upload(gpu: &Gpu, config: &Config, w: &Weights) -> Result<Self> {
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
        // Asked before anything is uploaded, so that a model too large for the GPU fails with
        // the sizes, not at whichever tensor happens to run out.
        let need: usize = w.bytes_by_type().iter().map(|(_, b)| b).sum();
        let free = gpu.free_memory()?;
        if need > free {
            let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
            bail!(
                "the model's weights need {:.2} GiB of GPU memory, and {} has {:.2} GiB free of {:.2} GiB; use a smaller model or --device cpu",
                gib(need),
                gpu.name,
                gib(free),
                gib(gpu.total_memory)
            );
        }
        let layers = w
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| {
                Ok(DeviceLayer {
                    attn_norm: gpu.upload(raw(&l.attn_norm), &format!("layer {i} attn_norm"))?,
                    w_qkv: DeviceMatrix::upload(
                        gpu,
                        &[&l.wq, &l.wk, &l.wv],
                        &format!("layer {i} qkv"),
                    )?,
                    wo: DeviceMatrix::upload(gpu, &[&l.wo], &format!("layer {i} o_proj"))?,
                    ffn_norm: gpu.upload(raw(&l.ffn_norm), &format!("layer {i} ffn_norm"))?,
                    w_gu: DeviceMatrix::upload(
                        gpu,
                        &[&l.w_gate, &l.w_up],
                        &format!("layer {i} gate/up"),
                    )?,
                    w_down: DeviceMatrix::upload(
                        gpu,
                        &[&l.w_down],
                        &format!("layer {i} down_proj"),
                    )?,
                    qkv_bias: match &l.qkv_bias {
                        Some(b) => Some(gpu.upload(
                            &concat(&[&b.q, &b.k, &b.v]),
                            &format!("layer {i} qkv bias"),
                        )?),
                        None => None,
                    },
                    q_norm: match &l.q_norm {
                        Some(n) => Some(gpu.upload(raw(n), &format!("layer {i} q_norm"))?),
                        None => None,
                    },
                    k_norm: match &l.k_norm {
                        Some(n) => Some(gpu.upload(raw(n), &format!("layer {i} k_norm"))?),
                        None => None,
                    },
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            config: config.clone(),
            embed: DeviceMatrix::upload(gpu, &[&w.embed], "embedding")?,
            layers,
            final_norm: gpu.upload(raw(&w.final_norm), "final norm")?,
            lm_head: match &w.lm_head {
                Some(h) => Some(DeviceMatrix::upload(gpu, &[h], "lm_head")?),
                None => None,
            },
            inv_freq: gpu.upload(&config.rope_inv_freq(), "rope frequencies")?,
            bytes_per_token: w.bytes_per_token(),
        })
    }

    pub fn lm_head(&self) -> &DeviceMatrix {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// The LM head's values (bf16) or quants.
    pub fn lm_head_ptr(&self, gpu: &Gpu) -> u64 {
        self.lm_head().ptr(gpu)
    }

    /// The storage format of each kind of matrix, for the megakernel: layer 0's for the
    /// layers' kinds, and where a kind's format differs between layers, the mask of every
    /// layer matrix's format (`MatrixFormats::mixed`; the layer table then tags each pointer,
    /// see `MegakernelPath::new`).
    pub fn matrix_formats(&self) -> super::sources::MatrixFormats {
        let kinds = |l: &DeviceLayer| {
            [
                l.w_qkv.type_code(),
                l.wo.type_code(),
                l.w_gu.type_code(),
                l.w_down.type_code(),
            ]
        };
        // bf16 for a model without layers.
        let first = self.layers.first().map_or([0; 4], kinds);
        let mut mask = 0;
        for l in &self.layers {
            for c in kinds(l) {
                mask |= 1 << c;
            }
        }
        let uniform = self.layers.iter().all(|l| kinds(l) == first);
        super::sources::MatrixFormats {
            qkv: first[0],
            o: first[1],
            gate_up: first[2],
            down: first[3],
            mixed: if uniform { 0 } else { mask },
            lm_head: self.lm_head().type_code(),
            embed: self.embed.type_code(),
        }
    }

    /// True when any matrix is stored as blocks.
    pub fn is_quantized(&self) -> bool {
        self.embed.ty != WeightType::Bf16
            || self.lm_head().ty != WeightType::Bf16
            || self.layers.iter().any(|l| {
                [&l.w_qkv, &l.wo, &l.w_gu, &l.w_down]
                    .iter()
                    .any(|m| m.ty != WeightType::Bf16)
            })
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

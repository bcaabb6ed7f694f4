//! The conventional decode path: one kernel per operation, launched one by one (eager) or
//! replayed from a CUDA graph, optionally with programmatic dependent launch (PDL).

use std::sync::Arc;

use anyhow::{bail, Context, Result};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaModule, CudaSlice};
use cudarc::nvrtc::Ptx;

use super::compile::compile_cubin;
use super::device::{ptr, Gpu};
use super::launch::Kernel;
use super::model::{enqueue_qkv_extras, DeviceLayer, DeviceMatrix, DeviceModel, KvCache};
use super::sources;
use super::stepping::{self, Sequence, Steps};
use crate::kargs;
use crate::sampling::device::DeviceSampler;
use crate::sampling::SamplingParams;

pub mod attn_o;
pub mod mlp;
use attn_o::{AttnO, AttnOFusion, AttnOParams};
use mlp::{Mlp, MlpFusion, MlpParams};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Eager,
    Graph,
    GraphPdl,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Eager => "eager",
            Mode::Graph => "graph",
            Mode::GraphPdl => "graph-pdl",
        }
    }
}

struct Kernels {
    embed: Kernel,
    rmsnorm: Kernel,
    silu_mul: Kernel,
    mv: MatVec,
    rope_kv: Kernel,
    attention: Kernel,
    attention_kv: Kernel,
    qkv_extras: Kernel,
    argmax: Kernel,
    embed_q: Kernel,
    /// kernels/quant/quant.cu's mat-vecs, by storage: Q8_0, Q4_0, Q4_1, Q6_K.
    gemv_q: [Kernel; 4],
    mlp: Mlp,
    attn_o: AttnO,
}

/// Measured on the H100 (BENCHMARKS.md, 2026-11-27), graph + PDL, 32-token prompt + 128 new:
/// 256 threads (a warp per 32 positions up to 256) against 128, SmolLM2 0.5211 -> 0.5047 ms a
/// token, Qwen3-0.6B 0.8414 -> 0.8232, Llama-1B 1.0288 -> 1.0216, Llama-3.2-3B level.
const ATT_THREADS: u32 = 256;
/// Sequences expected to grow past this get split-KV attention (`bl_attention_kv`); shorter ones
/// a block per query head (`bl_attention`, whose blocks prefetch their rows to L2 before they
/// wait). On the H100, Llama-1B shape, graph + PDL: at 160 positions `bl_attention` 1.120 ms,
/// split-KV 1.140–1.150; at 256 positions 1.159 against 1.138 (BENCHMARKS.md, 2026-11-25).
const SPLIT_KV_FROM: usize = 192;
/// Threads of a short-cache attention block: [`ATT_THREADS`], or for measuring
/// `MEGAINFER_BASELINE_ATT_THREADS` (a multiple of 32 from 64 to 1024; each warp takes blocks of
/// 32 positions in turn, so more warps take fewer turns on longer caches and merge more states).
fn att_threads(v: Option<&str>) -> Result<u32, String> {
    let Some(v) = v.map(str::trim) else {
        return Ok(ATT_THREADS);
    };
    match v.parse::<u32>() {
        Ok(n) if (64..=1024).contains(&n) && n.is_multiple_of(32) => Ok(n),
        _ => Err(format!(
            "MEGAINFER_BASELINE_ATT_THREADS: '{v}' is not a multiple of 32 from 64 to 1024"
        )),
    }
}

/// The short-cache attention kernel for `head_dim`: `bl_attention_preload` (each warp's first
/// K/V block read before the wait for QKV) at head_dim 128, `bl_attention` at 64. On the H100,
/// graph + PDL, 32-token prompt + 128 new (BENCHMARKS.md, 2026-11-27), the preload took
/// 1.8–6.6% off the head_dim-128 presets (Qwen3-0.6B 0.901 → 0.841 ms, Qwen3-1.7B,
/// Llama-3.2-3B, Llama-3.1-8B; graph 0.5–1.8%) and made the head_dim-64 ones slower (Llama-1B,
/// SmolLM2, Qwen2.5-0.5B: graph + PDL 0.6–1.7%, graph 1.5–3.3%).
/// MEGAINFER_BASELINE_ATT_PRELOAD=0|1 picks one for every shape, for measuring.
fn attention_kernel(head_dim: usize) -> Result<&'static str> {
    let v = std::env::var("MEGAINFER_BASELINE_ATT_PRELOAD").ok();
    attention_kernel_for(head_dim, v.as_deref()).map_err(anyhow::Error::msg)
}

/// [`attention_kernel`] with the variable's value given.
fn attention_kernel_for(head_dim: usize, v: Option<&str>) -> Result<&'static str, String> {
    let preload =
        super::switches::parse_switch("MEGAINFER_BASELINE_ATT_PRELOAD", v, head_dim >= 128)?;
    Ok(if preload {
        "bl_attention_preload"
    } else {
        "bl_attention"
    })
}

/// Split-KV parts per head at most.
const MAX_ATT_PARTS: usize = 128;
/// Threads of `bl_attention_kv` (GQ_THREADS in kernels/baseline/attention.cuh), and (head, dim)
/// outputs a thread holds at most (GQ_MAX_O).
const GQ_THREADS: u32 = 256;
const GQ_MAX_O: usize = 4;

/// Dynamic shared memory of `bl_attention_kv` (the layout at the top of `gqa_part` in
/// kernels/baseline/attention.cuh: GQ_STAGES = 3 stages of GQ_T = 64-position K and V tiles,
/// rows padded by 8 elements, then the group's queries, scores and softmax state).
fn gqa_smem(head_dim: usize, group: usize) -> usize {
    const TILE: usize = 64;
    const STAGES: usize = 3;
    2 * STAGES * TILE * (head_dim + 8) * 2 + (group * head_dim + group * TILE + 3 * group) * 4
}

/// Split-KV parts: one per ATT_PART_MIN positions at the expected length (shorter parts leave
/// the blocks little to stream), but no more blocks than two per SM unless that makes parts
/// longer than ATT_PART_SPAN. Measured on the H100, graph + PDL (BENCHMARKS.md, 2026-11-25):
/// Llama-1B best at 8 parts a KV head for 256-384 positions, 16–33 for 640, 33 for 1,128 to
/// 8K (66 slower at 8K), 128 at 32K; SmolLM2 (3 KV heads) 33 at 640 and 2,128, 88 at 8K.
const ATT_PART_MIN: usize = 32;
const ATT_PART_SPAN: usize = 256;

/// Threads and rows per block of the quantised mat-vecs: 8 warps × QG_ROWS rows
/// (kernels/quant/quant.cu).
const QUANT_THREADS: u32 = 256;
const QUANT_ROWS_PER_BLOCK: u32 = 16;

/// Shared memory of a quantised mat-vec over rows of `cols`: the input vector, padded to
/// whole 256-element chunks (QG_CHUNK in kernels/quant/quant.cu).
fn quant_smem(cols: usize) -> u32 {
    (cols.div_ceil(256) * 256 * 4) as u32
}

/// Split-KV parts per KV head for sequences expected to reach `expected` positions on `sms`
/// SMs: 1 (no split: `bl_attention`) up to SPLIT_KV_FROM, then as ATT_PART_MIN says.
fn attention_parts(expected: usize, kv_heads: usize, sms: usize) -> usize {
    if expected <= SPLIT_KV_FROM {
        return 1;
    }
    expected
        .div_ceil(ATT_PART_MIN)
        .min((2 * sms).div_ceil(kv_heads.max(1)))
        .max(expected.div_ceil(ATT_PART_SPAN))
        .clamp(2, MAX_ATT_PARTS)
}

/// Which steps the projections (`bl_mv`) fold in instead of running them as kernels of their
/// own: the RMS norm into the input of QKV, gate/up and the LM head (each CTA computes rms(x)
/// itself: with a grid of one or two CTAs per SM that is a few KiB of L2 reads per CTA, while
/// the CTA's first weight loads are in flight), SiLU·up into the gate/up epilogue, RoPE and
/// the K/V cache write into the QKV epilogue (Llama-style layers only: Qwen's bias and q/k
/// norm come between the product and RoPE), and the greedy argmax into the LM head. The
/// residual adds are always in the O and down projections. All are folded by default. The MLP
/// (norm, gate/up, SiLU·up, down and the residual add) runs as one kernel (`bl_mlp`, see
/// [`mlp`]) where [`mlp::choose`] takes it: by default without PDL on shapes whose split fills
/// the SMs, with `mlp` named wherever the shapes allow. `MEGAINFER_BASELINE_FUSION` (a comma
/// list of `norm`, `silu`, `rope`, `argmax`, `mlp`, or `none`) picks by hand, for measuring
/// what each saves.
#[derive(Clone, Copy, Debug)]
struct Fusion {
    norm: bool,
    silu: bool,
    rope: bool,
    argmax: bool,
    mlp: MlpFusion,
    attn: AttnOFusion,
}

impl Fusion {
    fn choose() -> Result<Self> {
        let Ok(v) = std::env::var("MEGAINFER_BASELINE_FUSION") else {
            return Ok(Fusion {
                norm: true,
                silu: true,
                rope: true,
                argmax: true,
                mlp: MlpFusion::Auto,
                attn: AttnOFusion::Auto,
            });
        };
        Self::parse(&v).context("MEGAINFER_BASELINE_FUSION")
    }

    fn parse(v: &str) -> Result<Self> {
        let mut f = Fusion {
            norm: false,
            silu: false,
            rope: false,
            argmax: false,
            mlp: MlpFusion::Off,
            attn: AttnOFusion::Off,
        };
        for part in v.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            match part {
                "norm" => f.norm = true,
                "silu" => f.silu = true,
                "rope" => f.rope = true,
                "argmax" => f.argmax = true,
                "mlp" => f.mlp = MlpFusion::On,
                "attn" => f.attn = AttnOFusion::On,
                "none" => {}
                other => {
                    bail!("unknown step '{other}' (norm, silu, rope, argmax, mlp, attn or none)")
                }
            }
        }
        Ok(f)
    }
}

pub struct BaselinePath<'g> {
    gpu: &'g Gpu,
    model: &'g DeviceModel,
    mode: Mode,
    k: Kernels,
    _module: Arc<CudaModule>,
    kv: KvCache,
    x: CudaSlice<f32>,
    /// The residual's second buffer: a layer whose MLP is fused ends in the other buffer
    /// (its O projection copies the residual there, and the MLP adds into it).
    x_alt: CudaSlice<f32>,
    /// The third: with attention and O fused, QKV copies the residual to two buffers, which
    /// attention + O adds into and the fused MLP adds into one of.
    x_alt2: CudaSlice<f32>,
    /// Intermediate rows a CTA of the fused MLP takes, where it runs (bf16 layers).
    mlp_rows: Option<usize>,
    /// W_o rows a CTA of the fused attention + O projection takes, where it runs (bf16 QKV
    /// and O, the norm folded, short caches).
    attn_o_rows: Option<usize>,
    /// The normed hidden and the MLP activation (silu(gate) · up).
    xn: CudaSlice<f32>,
    act: CudaSlice<f32>,
    fusion: Fusion,
    /// Each projection's mat-vec geometry, in [`Proj::ALL`] order.
    mv_cfg: [MvConfig; 5],
    qkv: CudaSlice<f32>,
    attn: CudaSlice<f32>,
    gu: CudaSlice<f32>,
    /// Split-KV attention's per-part states, [heads][parts][2 + head_dim].
    att_parts_st: CudaSlice<f32>,
    att_parts: usize,
    /// Threads of a `bl_attention` block ([`ATT_THREADS`] unless set for measuring).
    att_threads: u32,
    /// `bl_attention_kv`'s arrival counter per KV head, 0 between launches.
    att_kv_done: CudaSlice<u32>,
    logits: CudaSlice<f32>,
    /// The fused LM-head argmax's per-CTA partials and arrival counter.
    argmax_part: CudaSlice<u32>,
    argmax_done: CudaSlice<u32>,
    /// TokenMeta {token, pos, next, pad}.
    meta: CudaSlice<u32>,
    /// history[p + 1] = greedy token chosen after position p.
    history: CudaSlice<u32>,
    graph: Option<CudaGraph>,
    /// Made on the first sampled step: the sampler's kernels and, for the graph modes, a
    /// second graph that ends in them instead of the argmax.
    sampler: Option<DeviceSampler>,
    sampled_graph: Option<CudaGraph>,
    seq: Sequence,
}

impl<'g> BaselinePath<'g> {
    /// A path whose KV cache holds `max_seq` positions, its attention chosen for sequences
    /// that may reach all of them.
    pub fn new(gpu: &'g Gpu, model: &'g DeviceModel, mode: Mode, max_seq: usize) -> Result<Self> {
        Self::new_for(gpu, model, mode, max_seq, max_seq)
    }

    /// As [`Self::new`], the attention chosen for sequences expected to reach `expected_len`
    /// positions: split-KV only when that is over SPLIT_KV_FROM, since at short lengths a block
    /// per query head is faster. Longer sequences still run, on one block per query head.
    pub fn new_for(
        gpu: &'g Gpu,
        model: &'g DeviceModel,
        mode: Mode,
        max_seq: usize,
        expected_len: usize,
    ) -> Result<Self> {
        Self::make(gpu, model, mode, max_seq, expected_len, Fusion::choose()?)
    }

    /// As [`Self::new`], folding only the steps `fusion` names (`MEGAINFER_BASELINE_FUSION`'s
    /// form: a comma list of norm, silu, rope, argmax, or none), whatever the environment says.
    pub fn with_fusion(
        gpu: &'g Gpu,
        model: &'g DeviceModel,
        mode: Mode,
        max_seq: usize,
        fusion: &str,
    ) -> Result<Self> {
        let f = Fusion::parse(fusion).with_context(|| format!("fusion '{fusion}'"))?;
        Self::make(gpu, model, mode, max_seq, max_seq, f)
    }

    fn make(
        gpu: &'g Gpu,
        model: &'g DeviceModel,
        mode: Mode,
        max_seq: usize,
        expected_len: usize,
        fusion: Fusion,
    ) -> Result<Self> {
        let c = &model.config;
        let module = load_module(gpu)?;
        let k = Kernels {
            embed: Kernel::load(&module, "bl_embed")?,
            rmsnorm: Kernel::load(&module, "bl_rmsnorm")?,
            silu_mul: Kernel::load(&module, "bl_silu_mul")?,
            mv: MatVec::load(&module, gpu)?,
            rope_kv: Kernel::load(&module, "bl_rope_kv")?,
            attention: Kernel::load(&module, attention_kernel(c.head_dim)?)?,
            attention_kv: Kernel::load(&module, "bl_attention_kv")?,
            qkv_extras: Kernel::load(&module, "qkv_extras")?,
            argmax: Kernel::load(&module, "bl_argmax")?,
            embed_q: Kernel::load(&module, "bl_embed_q")?,
            gemv_q: [
                Kernel::load(&module, "bl_gemv_q8_0")?,
                Kernel::load(&module, "bl_gemv_q4_0")?,
                Kernel::load(&module, "bl_gemv_q4_1")?,
                Kernel::load(&module, "bl_gemv_q6_k")?,
            ],
            mlp: Mlp::load(&module, gpu)?,
            attn_o: AttnO::load(&module)?,
        };
        let group = c.num_heads / c.num_kv_heads;
        if group * c.head_dim > GQ_THREADS as usize * GQ_MAX_O {
            bail!(
                "split-KV attention holds {} (query head, dim) outputs per KV head at most; this \
                 model has {group} query heads of {} dims per KV head",
                GQ_THREADS as usize * GQ_MAX_O,
                c.head_dim
            );
        }
        let mut att_parts =
            attention_parts(expected_len.min(max_seq), c.num_kv_heads, gpu.sm_count);
        // For measuring other splits at any length: 1 runs bl_attention (a block per query
        // head), 2 to MAX_ATT_PARTS split-KV with that many parts.
        if let Ok(v) = std::env::var("MEGAINFER_BASELINE_ATT_PARTS") {
            let n: usize = v
                .parse()
                .ok()
                .filter(|n| (1..=MAX_ATT_PARTS).contains(n))
                .with_context(|| {
                    format!("MEGAINFER_BASELINE_ATT_PARTS: '{v}' is not 1 to {MAX_ATT_PARTS}")
                })?;
            att_parts = n;
        }
        let att_threads = att_threads(
            std::env::var("MEGAINFER_BASELINE_ATT_THREADS")
                .ok()
                .as_deref(),
        )
        .map_err(anyhow::Error::msg)?;
        k.attention_kv.allow_smem(gqa_smem(c.head_dim, group))?;
        let max_cols = c.hidden_size.max(c.intermediate_size).max(c.q_dim());
        for g in &k.gemv_q {
            g.allow_smem(quant_smem(max_cols) as usize)?;
        }
        let qkv_rows = c.q_dim() + 2 * c.kv_dim();
        let mut p = Self {
            kv: KvCache::new(gpu, c, max_seq)?,
            x: gpu.alloc_zeros(c.hidden_size, "hidden")?,
            x_alt: gpu.alloc_zeros(c.hidden_size, "hidden")?,
            x_alt2: gpu.alloc_zeros(c.hidden_size, "hidden")?,
            attn_o_rows: if fusion.norm && att_parts == 1 {
                attn_o::choose(
                    fusion.attn,
                    mode == Mode::GraphPdl,
                    c.hidden_size,
                    c.num_heads,
                    c.head_dim,
                    gpu.sm_count,
                )
            } else {
                None
            },
            mlp_rows: mlp::choose(
                fusion.mlp,
                mode == Mode::GraphPdl,
                c.hidden_size,
                c.intermediate_size,
                gpu.sm_count,
            ),
            xn: gpu.alloc_zeros(c.hidden_size, "normed hidden")?,
            act: gpu.alloc_zeros(c.intermediate_size, "mlp activation")?,
            fusion,
            mv_cfg: mv_configs(c, gpu.sm_count)?,
            qkv: gpu.alloc_zeros(qkv_rows, "qkv")?,
            attn: gpu.alloc_zeros(c.q_dim(), "attention output")?,
            gu: gpu.alloc_zeros(2 * c.intermediate_size, "gate/up")?,
            att_parts_st: gpu.alloc_zeros(
                c.num_heads * att_parts * (2 + c.head_dim),
                "split-KV attention states",
            )?,
            att_parts,
            att_threads,
            att_kv_done: gpu.alloc_zeros(c.num_kv_heads, "split-KV arrival counters")?,
            logits: gpu.alloc_zeros(c.vocab_size, "logits")?,
            argmax_part: gpu
                .alloc_zeros(MatVec::argmax_part_words(gpu.sm_count), "argmax partials")?,
            argmax_done: gpu.alloc_zeros(1, "argmax counter")?,
            meta: gpu.alloc_zeros(4, "token meta")?,
            history: gpu.alloc_zeros(max_seq + 1, "token history")?,
            graph: None,
            sampler: None,
            sampled_graph: None,
            gpu,
            model,
            mode,
            k,
            _module: module,
            seq: Sequence::new(max_seq),
        };
        if mode != Mode::Eager {
            p.capture()?;
        }
        Ok(p)
    }

    /// The mat-vec geometry of each projection (`MEGAINFER_BASELINE_MV` form), for logs.
    pub fn mv_geometry(&self) -> String {
        Proj::ALL
            .iter()
            .zip(&self.mv_cfg)
            .map(|(p, c)| format!("{}={}", p.key(), c.name()))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// One projection of `w`: `bl_mv` with its epilogue for a bf16 matrix; for a quantised one
    /// the quantised mat-vecs (kernels/quant/quant.cu), which store or add only (the forward
    /// keeps RoPE, SiLU·up and the argmax as kernels of their own for such matrices).
    /// With `copy`, x is also copied to both of its buffers, a slice a CTA (bf16 matrices only).
    #[allow(clippy::too_many_arguments)]
    fn project(
        &self,
        proj: Proj,
        w: &DeviceMatrix,
        x: u64,
        y: u64,
        input: MvIn,
        out: MvOut,
        copy: Option<(u64, u64)>,
    ) -> Result<()> {
        let g = self.gpu;
        if w.type_code() == 0 {
            let (rows, cols) = proj.shape(&self.model.config);
            let (y2, y3) = copy.unwrap_or((0, 0));
            let p = MvParams {
                w: w.ptr(g),
                x,
                y,
                y2,
                y3,
                ..Default::default()
            };
            let cfg = self.mv_cfg[Proj::ALL.iter().position(|&q| q == proj).unwrap_or(0)];
            return self
                .k
                .mv
                .launch(&g.stream, cfg, p, rows, cols, input, out, self.pdl())
                .with_context(|| format!("the {} projection", proj.key()));
        }
        if copy.is_some() {
            bail!("the quantised mat-vec copies no residual");
        }
        let accumulate = match out {
            MvOut::Store => 0i32,
            MvOut::Add => 1,
            other => bail!("the quantised mat-vec has no {other:?} epilogue"),
        };
        let (mode, norm, eps) = match input {
            MvIn::Plain => (0i32, 0u64, 0f32),
            MvIn::Norm { norm, eps } => (1, norm, eps),
        };
        let (rows, cols) = (w.rows as i32, w.cols as i32);
        let wp = w.ptr(g);
        let kernel = &self.k.gemv_q[w.type_code() as usize - 1];
        let grid = (w.rows as u32).div_ceil(QUANT_ROWS_PER_BLOCK);
        let mut a = kargs![&wp, &x, &y, &rows, &cols, &accumulate, &mode, &norm, &eps];
        // SAFETY: the arguments are the values bl_gemv_q8_0/q4_0/q4_1/q6_k declare, in order (see
        // kernels/quant/quant.cu), each a live local; the pointers are device buffers of this
        // path or the model that outlive the launch (W holds `rows` rows of `cols` elements of
        // w's type; norm, cols weights).
        unsafe {
            kernel.launch(
                &g.stream,
                grid,
                QUANT_THREADS,
                quant_smem(w.cols),
                self.pdl(),
                &mut a,
            )
        }
    }

    /// The input of a mat-vec that reads the RMS norm of x: x itself with the norm folded in,
    /// or xn after a norm kernel.
    fn normed(&self, x: u64, norm: u64) -> Result<(u64, MvIn)> {
        let c = &self.model.config;
        if self.fusion.norm {
            let eps = c.rms_norm_eps;
            return Ok((x, MvIn::Norm { norm, eps }));
        }
        let (hidden, eps) = (c.hidden_size as i32, c.rms_norm_eps);
        let xn = ptr(&self.xn, &self.gpu.stream);
        // SAFETY: the arguments are the values bl_rmsnorm declares, in order (see
        // kernels/baseline/baseline.cu), each a live local; x, norm and xn hold hidden elements.
        unsafe {
            self.k.rmsnorm.launch(
                &self.gpu.stream,
                1,
                1024,
                0,
                self.pdl(),
                &mut kargs![&x, &norm, &xn, &hidden, &eps],
            )
        }?;
        Ok((xn, MvIn::Plain))
    }

    /// act = silu(gate) · up from gu = [gate; up], when not folded into the gate/up epilogue.
    fn silu_mul(&self, gu: u64, act: u64) -> Result<()> {
        let inter = self.model.config.intermediate_size as i32;
        // SAFETY: the arguments are the values bl_silu_mul declares, in order (see
        // kernels/baseline/baseline.cu), each a live local; gu holds 2 * inter floats, act inter.
        unsafe {
            self.k.silu_mul.launch(
                &self.gpu.stream,
                (inter as u32).div_ceil(256),
                256,
                0,
                self.pdl(),
                &mut kargs![&gu, &act, &inter],
            )
        }
    }

    /// The MLP as mat-vecs: x += down · (silu(gate · x̂) ⊙ (up · x̂)).
    fn mlp(&self, lw: &DeviceLayer, x: u64, gu: u64, act: u64) -> Result<()> {
        let s = &self.gpu.stream;
        let (input, how) = self.normed(x, ptr(&lw.ffn_norm, s))?;
        if self.fusion.silu && lw.w_gu.type_code() == 0 {
            self.project(Proj::GateUp, &lw.w_gu, input, act, how, MvOut::Silu, None)?;
        } else {
            self.project(Proj::GateUp, &lw.w_gu, input, gu, how, MvOut::Store, None)?;
            self.silu_mul(gu, act)?;
        }
        self.project(
            Proj::Down,
            &lw.w_down,
            act,
            x,
            MvIn::Plain,
            MvOut::Add,
            None,
        )
    }

    /// Layer l's MLP as one kernel (`bl_mlp`, `j` rows a CTA): reads x for its norm and adds
    /// into y, which holds the residual; its idle SMs prefetch the next layer's QKV weights
    /// (or the LM head's).
    fn fused_mlp(&self, l: usize, lw: &DeviceLayer, x: u64, y: u64, j: usize) -> Result<()> {
        let (g, c, s) = (self.gpu, &self.model.config, &self.gpu.stream);
        let next = match self.model.layers.get(l + 1) {
            Some(nl) => &nl.w_qkv,
            None => self.model.lm_head(),
        };
        let p = MlpParams {
            w_gu: lw.w_gu.ptr(g),
            w_down: lw.w_down.ptr(g),
            x,
            norm: ptr(&lw.ffn_norm, s),
            y,
            pf: next.ptr(g),
            eps: c.rms_norm_eps,
            ..Default::default()
        };
        let (h, i) = (c.hidden_size, c.intermediate_size);
        let ef = self.k.mv.evict_first;
        self.k
            .mlp
            .launch(s, p, h, i, j, next.bytes(), ef, self.pdl())
    }

    fn pdl(&self) -> bool {
        self.mode == Mode::GraphPdl
    }

    /// Enqueues one decode step for the token and position in `meta`, its token chosen by the
    /// greedy argmax or, when `sampled`, by the device sampler.
    fn enqueue_step(&self, sampled: bool) -> Result<()> {
        let (g, c, s) = (self.gpu, &self.model.config, &self.gpu.stream);
        let pdl = self.pdl();
        let (x, qkv, attn, gu, act, logits, meta, history) = (
            ptr(&self.x, s),
            ptr(&self.qkv, s),
            ptr(&self.attn, s),
            ptr(&self.gu, s),
            ptr(&self.act, s),
            ptr(&self.logits, s),
            ptr(&self.meta, s),
            ptr(&self.history, s),
        );
        let hidden = c.hidden_size as i32;
        let (nh, nkv, hd) = (c.num_heads as i32, c.num_kv_heads as i32, c.head_dim as i32);
        let em = &self.model.embed;
        let embed = em.ptr(g);
        let blocks = (hidden as u32).div_ceil(256);
        if em.type_code() == 0 {
            // SAFETY: the arguments are the values bl_embed declares, in order (see
            // kernels/baseline/baseline.cu), each a live local; the pointers are device buffers
            // of this path that outlive the launch.
            unsafe {
                self.k.embed.launch(
                    s,
                    blocks,
                    256,
                    0,
                    pdl,
                    &mut kargs![&embed, &meta, &x, &hidden],
                )
            }?;
        } else {
            let ty = em.type_code();
            // SAFETY: the arguments are the values bl_embed_q declares, in order (see
            // kernels/quant/quant.cu), each a live local; the pointers are device buffers of
            // this path or the model that outlive the launch.
            unsafe {
                self.k.embed_q.launch(
                    s,
                    blocks,
                    256,
                    0,
                    pdl,
                    &mut kargs![&ty, &embed, &meta, &x, &hidden],
                )
            }?;
        }
        let inv_freq = ptr(&self.model.inv_freq, s);
        // The residual's buffers, the layer's input first: a fused kernel adds into a buffer
        // another one, or the QKV product, filled with the residual beforehand.
        let mut bufs = [x, ptr(&self.x_alt, s), ptr(&self.x_alt2, s)];
        let bf16 = |m: &DeviceMatrix| m.type_code() == 0;
        for (l, lw) in self.model.layers.iter().enumerate() {
            let x = bufs[0];
            let off = (l * self.kv.layer_stride * 2) as u64;
            let (kc, vc) = (ptr(&self.kv.k, s) + off, ptr(&self.kv.v, s) + off);
            let attn_o = self.attn_o_rows.filter(|_| bf16(&lw.w_qkv) && bf16(&lw.wo));
            let mlp = self
                .mlp_rows
                .filter(|_| bf16(&lw.wo) && bf16(&lw.w_gu) && bf16(&lw.w_down));
            // With attention + O fused, QKV copies the residual to the two buffers that
            // attention + O and the fused MLP add into.
            let copy = attn_o.map(|_| (bufs[1], bufs[2]));
            let (input, how) = self.normed(x, ptr(&lw.attn_norm, s))?;
            if self.fusion.rope && lw.qkv_extras(g).is_none() && bf16(&lw.w_qkv) {
                let out = MvOut::RopeKv {
                    k_cache: kc,
                    v_cache: vc,
                    meta,
                    inv_freq,
                    n_heads: nh,
                    n_kv: nkv,
                    head_dim: hd,
                };
                self.project(Proj::Qkv, &lw.w_qkv, input, qkv, how, out, copy)?;
            } else {
                let out = MvOut::Store;
                self.project(Proj::Qkv, &lw.w_qkv, input, qkv, how, out, copy)?;
                enqueue_qkv_extras(&self.k.qkv_extras, g, c, lw, qkv, 1, pdl)?;
                // SAFETY: the arguments are the values bl_rope_kv declares, in order (see
                // kernels/baseline/baseline.cu), each a live local; the pointers are device
                // buffers of this path that outlive the launch.
                unsafe {
                    self.k.rope_kv.launch(
                        s,
                        (c.num_heads + 2 * c.num_kv_heads) as u32,
                        (c.head_dim / 2) as u32,
                        0,
                        pdl,
                        &mut kargs![&qkv, &kc, &vc, &meta, &inv_freq, &nh, &nkv, &hd],
                    )
                }?;
            }
            if let Some(rows) = attn_o {
                let p = AttnOParams {
                    q: qkv,
                    k_cache: kc,
                    v_cache: vc,
                    meta,
                    w_o: lw.wo.ptr(g),
                    y: bufs[1],
                    y2: bufs[2],
                    ..Default::default()
                };
                let (heads, kv_heads) = (c.num_heads, c.num_kv_heads);
                let ef = self.k.mv.evict_first;
                self.k.attn_o.launch(
                    s,
                    p,
                    heads,
                    kv_heads,
                    c.head_dim,
                    c.hidden_size,
                    rows,
                    ef,
                    pdl,
                )?;
                // bufs[1] and bufs[2] now hold the residual after attention.
                if let Some(j) = mlp {
                    self.fused_mlp(l, lw, bufs[1], bufs[2], j)?;
                    bufs = [bufs[2], bufs[0], bufs[1]];
                } else {
                    self.mlp(lw, bufs[1], gu, act)?;
                    bufs = [bufs[1], bufs[0], bufs[2]];
                }
                continue;
            }
            let att_smem =
                ((self.att_threads / 32) * (2 + c.head_dim as u32) + c.head_dim as u32) * 4;
            if self.att_parts > 1 {
                let (st, parts) = (ptr(&self.att_parts_st, s), self.att_parts as i32);
                let done = ptr(&self.att_kv_done, s);
                let smem = gqa_smem(c.head_dim, c.num_heads / c.num_kv_heads) as u32;
                // SAFETY: the arguments are the values bl_attention_kv declares, in order (see
                // kernels/baseline/baseline.cu), each a live local; the pointers are device
                // buffers of this path that outlive the launch, `st` sized heads * parts *
                // (2 + head_dim), `done` n_kv counters left at 0 by every launch.
                unsafe {
                    self.k.attention_kv.launch(
                        s,
                        (c.num_kv_heads * self.att_parts) as u32,
                        GQ_THREADS,
                        smem,
                        pdl,
                        &mut kargs![
                            &qkv, &kc, &vc, &st, &done, &attn, &meta, &nh, &nkv, &hd, &parts
                        ],
                    )
                }?;
            } else {
                // SAFETY: the arguments are the values bl_attention declares, in order (see
                // kernels/baseline/baseline.cu), each a live local; the pointers are device
                // buffers of this path that outlive the launch.
                unsafe {
                    self.k.attention.launch(
                        s,
                        c.num_heads as u32,
                        self.att_threads,
                        att_smem,
                        pdl,
                        &mut kargs![&qkv, &kc, &vc, &attn, &meta, &nh, &nkv, &hd],
                    )
                }?;
            }
            if let Some(j) = mlp {
                // O stores the residual in the next buffer as well, where the MLP's CTAs add
                // while every one of them reads x for its norm.
                let out = MvOut::AddCopy { y2: bufs[1] };
                self.project(Proj::O, &lw.wo, attn, x, MvIn::Plain, out, None)?;
                self.fused_mlp(l, lw, x, bufs[1], j)?;
                bufs = [bufs[1], bufs[0], bufs[2]];
            } else {
                self.project(Proj::O, &lw.wo, attn, x, MvIn::Plain, MvOut::Add, None)?;
                self.mlp(lw, x, gu, act)?;
            }
        }
        let x = bufs[0];
        let (input, how) = self.normed(x, ptr(&self.model.final_norm, s))?;
        let lm_head = self.model.lm_head();
        if !sampled && self.fusion.argmax && lm_head.type_code() == 0 {
            let out = MvOut::Argmax {
                meta,
                history,
                part: ptr(&self.argmax_part, s),
                done: ptr(&self.argmax_done, s),
            };
            return self.project(Proj::LmHead, lm_head, input, logits, how, out, None);
        }
        self.project(
            Proj::LmHead,
            lm_head,
            input,
            logits,
            how,
            MvOut::Store,
            None,
        )?;
        if sampled {
            let sampler = self.sampler.as_ref().context("device sampler not made")?;
            return sampler.enqueue(s, logits, meta, meta, history, pdl, None);
        }
        let vocab = c.vocab_size as i32;
        // SAFETY: the arguments are the values bl_argmax declares, in order (see
        // kernels/baseline/baseline.cu), each a live local; the pointers are device buffers of this
        // path that outlive the launch.
        unsafe {
            self.k.argmax.launch(
                s,
                1,
                1024,
                0,
                pdl,
                &mut kargs![&logits, &vocab, &meta, &history],
            )
        }
    }

    fn capture(&mut self) -> Result<()> {
        self.graph = Some(self.capture_step(false)?);
        Ok(())
    }

    fn capture_step(&self, sampled: bool) -> Result<CudaGraph> {
        let s = &self.gpu.stream;
        s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .context("beginning CUDA graph capture")?;
        let enqueued = self.enqueue_step(sampled);
        let graph = s
            .end_capture(CUgraphInstantiate_flags(0))
            .context("ending CUDA graph capture")?;
        enqueued?;
        graph.context("CUDA graph capture produced no graph")
    }

    /// Starts a new sequence (the KV cache is simply overwritten).
    pub fn reset(&mut self) {
        self.seq.reset();
    }

    /// `n` greedy steps back to back (see [`stepping::decode_greedy`]).
    pub fn decode_greedy(&mut self, token: u32, n: usize) -> Result<Vec<u32>> {
        stepping::decode_greedy(self, token, n)
    }

    /// `n` sampled steps back to back (see [`stepping::decode_sampled`]).
    pub fn decode_sampled(
        &mut self,
        sampler: &crate::sampling::Sampler,
        token: u32,
        n: usize,
    ) -> Result<Vec<u32>> {
        stepping::decode_sampled(self, sampler, token, n)
    }
}

impl Steps for BaselinePath<'_> {
    fn gpu(&self) -> &Gpu {
        self.gpu
    }

    fn vocab(&self) -> u32 {
        self.model.config.vocab_size as u32
    }

    fn seq(&mut self) -> &mut Sequence {
        &mut self.seq
    }

    fn write_meta(&mut self, token: u32, pos: usize) -> Result<()> {
        let v = [token, pos as u32, 0, 0];
        self.gpu.stream.memcpy_htod(&v, &mut self.meta)?;
        Ok(())
    }

    fn launch_step(&mut self) -> Result<()> {
        match &self.graph {
            Some(g) => g.launch().context("launching the decode graph"),
            None => self.enqueue_step(false),
        }
    }

    fn prepare_sampling(&mut self, p: &SamplingParams) -> Result<bool> {
        let vocab = self.model.config.vocab_size;
        DeviceSampler::prepared(&mut self.sampler, self.gpu, vocab, p)?;
        if self.mode != Mode::Eager && self.sampled_graph.is_none() {
            self.sampled_graph = Some(self.capture_step(true)?);
        }
        Ok(true)
    }

    fn launch_sampled_step(&mut self) -> Result<()> {
        match &self.sampled_graph {
            Some(g) => g.launch().context("launching the sampled decode graph"),
            None => self.enqueue_step(true),
        }
    }

    fn history_mut(&mut self) -> Option<&mut CudaSlice<u32>> {
        Some(&mut self.history)
    }

    fn check(&self) -> Result<()> {
        Ok(())
    }

    fn history(&self) -> &CudaSlice<u32> {
        &self.history
    }

    fn logits(&self) -> &CudaSlice<f32> {
        &self.logits
    }

    fn model(&self) -> &DeviceModel {
        self.model
    }

    fn kv_target(&self) -> super::prefill::KvTarget {
        super::prefill::KvTarget::position_major(self.gpu, &self.kv, &self.model.config)
    }
}

/// Streaming read bandwidth of the device in GB/s (1e9 B/s): a 4 GiB buffer of non-zero
/// bytes read once per repetition with 16-byte loads, median of several timed runs.
pub fn measure_read_bandwidth(gpu: &Gpu) -> Result<f64> {
    let module = load_module(gpu)?;
    let k = Kernel::load(&module, "bw_read")?;
    let bytes: usize = 4 << 30;
    let mut buf = gpu.alloc_zeros::<u8>(bytes, "bandwidth probe buffer")?;
    gpu.stream.memset_zeros(&mut buf)?;
    // Non-zero contents: some memory systems compress zeros.
    let pattern: Vec<u8> = (0..(64usize << 20))
        .map(|i| ((i * 2654435761usize) >> 13) as u8)
        .collect();
    for off in (0..bytes).step_by(pattern.len()) {
        let mut view = buf.slice_mut(off..off + pattern.len());
        gpu.stream.memcpy_htod(&pattern, &mut view)?;
    }
    let sink = gpu.alloc_zeros::<u32>(1, "bandwidth sink")?;
    let (p, sp) = (ptr(&buf, &gpu.stream), ptr(&sink, &gpu.stream));
    let n = (bytes / 16) as u64;
    let grid = (gpu.sm_count * 8) as u32;
    let start = gpu
        .ctx
        .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))?;
    let stop = gpu
        .ctx
        .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))?;
    let mut times = Vec::new();
    for rep in 0..6 {
        start.record(&gpu.stream)?;
        // SAFETY: the arguments are the values bw_read declares, in order (see
        // kernels/baseline/baseline.cu), each a live local; the pointers are device buffers of this
        // path that outlive the launch.
        unsafe { k.launch(&gpu.stream, grid, 512, 0, false, &mut kargs![&p, &n, &sp]) }?;
        stop.record(&gpu.stream)?;
        stop.synchronize()?;
        if rep > 0 {
            times.push(start.elapsed_ms(&stop)? as f64);
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(bytes as f64 / (times[times.len() / 2] * 1e-3) / 1e9)
}

/// Parameters of `bl_mv` (`MvParams` in kernels/baseline/baseline.cu), field for field: thirteen
/// device addresses (0 where the mode reads none), then the ints and the epsilon.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct MvParams {
    pub w: u64,
    pub x: u64,
    pub y: u64,
    pub norm: u64,
    pub k_cache: u64,
    pub v_cache: u64,
    pub meta: u64,
    pub inv_freq: u64,
    pub part: u64,
    pub done: u64,
    pub history: u64,
    pub y2: u64,
    pub y3: u64,
    pub rows: i32,
    pub cols: i32,
    pub ksplit: i32,
    pub in_mode: i32,
    pub out_mode: i32,
    pub n_heads: i32,
    pub n_kv: i32,
    pub head_dim: i32,
    pub eps: f32,
    /// Set by [`MatVec::launch`] from [`MatVec::evict_first`].
    pub evict_first: i32,
    /// Set by [`MatVec::launch`] from [`MatVec::prefetch`].
    pub prefetch: i32,
}

/// How `bl_mv` forms its input (MV_IN_* in kernels/baseline/baseline.cu).
#[derive(Clone, Copy, Debug)]
pub enum MvIn {
    Plain,
    /// x / rms(x) * norm, with these norm weights (bf16, cols of them) and epsilon.
    Norm {
        norm: u64,
        eps: f32,
    },
}

/// What `bl_mv` does with each row's sum (MV_OUT_* in kernels/baseline/baseline.cu).
#[derive(Clone, Copy, Debug)]
pub enum MvOut {
    Store,
    /// y += W · in: the residual add.
    Add,
    /// y += W · in, and the new y stored in y2 as well (where the fused MLP adds).
    AddCopy {
        y2: u64,
    },
    /// The QKV product of one layer: q rotated into y, k rotated and v into the caches at
    /// meta.pos.
    RopeKv {
        k_cache: u64,
        v_cache: u64,
        meta: u64,
        inv_freq: u64,
        n_heads: i32,
        n_kv: i32,
        head_dim: i32,
    },
    /// W = [gate; up] (rows = 2 × inter): y[p] = silu(gate p) · up p.
    Silu,
    /// Logits into y and the greedy token into meta (token, next, pos + 1) and
    /// history[pos + 1]. `part` holds 2 words per CTA ([`MatVec::ARGMAX_PART_WORDS`] in all),
    /// `done` one word that is 0 before the launch (the kernel leaves it 0).
    Argmax {
        meta: u64,
        history: u64,
        part: u64,
        done: u64,
    },
}

impl MvOut {
    fn code(&self) -> i32 {
        match self {
            MvOut::Store => 0,
            MvOut::Add => 1,
            MvOut::RopeKv { .. } => 2,
            MvOut::Silu => 3,
            MvOut::Argmax { .. } => 4,
            MvOut::AddCopy { .. } => 5,
        }
    }

    /// The pair modes combine logical rows 2p and 2p + 1 in one epilogue thread.
    fn pairs(&self) -> bool {
        matches!(self, MvOut::RopeKv { .. } | MvOut::Silu)
    }
}

/// One compiled `bl_mv` variant (MV_KERNEL in kernels/baseline/baseline.cu).
#[derive(Clone, Copy, Debug)]
pub struct MvVariant {
    pub name: &'static str,
    pub kernel: &'static str,
    /// Rows per warp (R).
    pub rows: u32,
    /// 16-byte loads per row per lane in one batch (U): R × U in flight per thread.
    pub loads: u32,
    /// The next batch is loaded before the current one's FMAs (twice the registers).
    pub double_buffered: bool,
    /// CTAs per SM its register budget allows (its `__launch_bounds__`).
    pub max_ctas_per_sm: u32,
    /// The same kernel with the weights' prefetch before the wait (double-buffered only).
    pub prefetching: Option<&'static str>,
}

const fn variant(
    name: &'static str,
    kernel: &'static str,
    r: u32,
    u: u32,
    db: bool,
    ctas: u32,
) -> MvVariant {
    MvVariant {
        name,
        kernel,
        rows: r,
        loads: u,
        double_buffered: db,
        max_ctas_per_sm: ctas,
        prefetching: None,
    }
}

const fn prefetching(v: MvVariant, kernel: &'static str) -> MvVariant {
    MvVariant {
        prefetching: Some(kernel),
        ..v
    }
}

pub const MV_VARIANTS: [MvVariant; 8] = [
    variant("r1u8", "bl_mv_r1u8", 1, 8, false, 2),
    variant("r1u16", "bl_mv_r1u16", 1, 16, false, 2),
    variant("r2u4", "bl_mv_r2u4", 2, 4, false, 2),
    variant("r2u8", "bl_mv_r2u8", 2, 8, false, 2),
    variant("r4u4", "bl_mv_r4u4", 4, 4, false, 2),
    prefetching(
        variant("r1u8d", "bl_mv_r1u8d", 1, 8, true, 2),
        "bl_mv_r1u8dp",
    ),
    prefetching(
        variant("r2u4d", "bl_mv_r2u4d", 2, 4, true, 2),
        "bl_mv_r2u4dp",
    ),
    prefetching(
        variant("r2u8d", "bl_mv_r2u8d", 2, 8, true, 1),
        "bl_mv_r2u8dp",
    ),
];
const MV_WARPS: u32 = 8;
const MV_THREADS: u32 = MV_WARPS * 32;
/// CTAs per SM a launch may ask for at most (the kernels are built for two resident).
pub const MV_MAX_CTAS_PER_SM: u32 = 2;

/// One launch geometry of `bl_mv`: which variant, how many warps of a CTA split each row's
/// columns (1, 2, 4 or 8), and how many CTAs per SM the grid holds (the CTAs loop over the
/// tasks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MvConfig {
    pub variant: usize,
    pub ksplit: u32,
    pub ctas_per_sm: u32,
}

impl MvConfig {
    /// `r2u8:2:1` style: variant, ksplit, CTAs per SM.
    pub fn parse(s: &str) -> Result<Self> {
        let parts: Vec<&str> = s.split(':').collect();
        let [v, k, c] = parts[..] else {
            bail!("mat-vec config '{s}': expected VARIANT:KSPLIT:CTAS_PER_SM, e.g. r2u8:2:1");
        };
        let variant = MV_VARIANTS
            .iter()
            .position(|x| x.name == v)
            .with_context(|| {
                let names: Vec<&str> = MV_VARIANTS.iter().map(|x| x.name).collect();
                format!("mat-vec config '{s}': unknown variant '{v}' (one of {names:?})")
            })?;
        let ksplit: u32 = k
            .parse()
            .with_context(|| format!("mat-vec config '{s}': ksplit '{k}' is not a number"))?;
        let ctas_per_sm: u32 = c
            .parse()
            .with_context(|| format!("mat-vec config '{s}': CTAs per SM '{c}' is not a number"))?;
        let cfg = MvConfig {
            variant,
            ksplit,
            ctas_per_sm,
        };
        cfg.validate(false)
            .with_context(|| format!("mat-vec config '{s}'"))?;
        Ok(cfg)
    }

    fn validate(&self, pairs: bool) -> Result<()> {
        if ![1, 2, 4, 8].contains(&self.ksplit) {
            bail!("ksplit must be 1, 2, 4 or 8, not {}", self.ksplit);
        }
        if self.ctas_per_sm == 0 || self.ctas_per_sm > MV_MAX_CTAS_PER_SM {
            bail!(
                "CTAs per SM must be 1 to {MV_MAX_CTAS_PER_SM}, not {}",
                self.ctas_per_sm
            );
        }
        let v = &MV_VARIANTS[self.variant];
        if self.ctas_per_sm > v.max_ctas_per_sm {
            bail!(
                "{} is built for at most {} CTA(s) per SM, not {}",
                v.name,
                v.max_ctas_per_sm,
                self.ctas_per_sm
            );
        }
        if pairs && !self.rows_per_task().is_multiple_of(2) {
            bail!(
                "{}: an epilogue that pairs rows needs an even number of rows per CTA task, not {}",
                self.name(),
                self.rows_per_task()
            );
        }
        Ok(())
    }

    pub fn rows_per_task(&self) -> u32 {
        MV_VARIANTS[self.variant].rows * (MV_WARPS / self.ksplit)
    }

    pub fn name(&self) -> String {
        format!(
            "{}:{}:{}",
            MV_VARIANTS[self.variant].name, self.ksplit, self.ctas_per_sm
        )
    }

    /// Every geometry, for sweeps.
    pub fn all() -> Vec<MvConfig> {
        let mut v = Vec::new();
        for (variant, mv) in MV_VARIANTS.iter().enumerate() {
            for ksplit in [1, 2, 4, 8] {
                for ctas_per_sm in 1..=mv.max_ctas_per_sm {
                    v.push(MvConfig {
                        variant,
                        ksplit,
                        ctas_per_sm,
                    });
                }
            }
        }
        v
    }

    /// Tasks and grid for a rows × cols product on `sms` SMs.
    pub fn grid(&self, rows: usize, sms: usize) -> (usize, usize) {
        let tasks = rows.div_ceil(self.rows_per_task() as usize);
        (tasks, tasks.min(sms * self.ctas_per_sm as usize))
    }

    /// A rough time estimate (seconds, at `bw` bytes/s): the bytes of the busiest SM at the
    /// rate its loads in flight sustain (at most its share of the bandwidth), or one memory
    /// latency per batch of loads in series, whichever is longer, plus its CTAs' epilogues; a
    /// product whose loads all go out at once takes its bytes at the whole bandwidth. Only
    /// ranks geometries; the harness (tests/gpu_gemv_bench.rs) measures each alone,
    /// `scripts/graph-timeline.sh` and `bench` (`MEGAINFER_BASELINE_MV`) in the step.
    fn estimate(&self, rows: usize, cols: usize, sms: usize, bw: f64) -> f64 {
        const LATENCY: f64 = 0.8e-6;
        const LOADED_LATENCY: f64 = 1.2e-6;
        let v = MV_VARIANTS[self.variant];
        let (r, u) = (v.rows, v.loads);
        let (tasks, grid) = self.grid(rows, sms);
        let rounds = tasks.div_ceil(grid);
        let busiest_ctas = grid.div_ceil(sms);
        let task_bytes = (self.rows_per_task() as usize * cols * 2) as f64;
        let busiest = (busiest_ctas * rounds) as f64 * task_bytes;
        let slice = (cols / 8).div_ceil(self.ksplit as usize);
        let batches = slice.div_ceil(32 * u as usize);
        // A product whose every load is one batch of one task issues all of them when its CTAs
        // start (before the wait under PDL): the busiest SM then pulls more than its share
        // while lighter SMs are done, and the product takes about its bytes at the whole
        // bandwidth. Measured in the step on the H100 (Llama-1B shape, BENCHMARKS.md): QKV at
        // r2u8:1:2 (192 CTAs, all loads at once) 3 µs a layer faster than r1u8d:1:1 (three
        // rounds of one batch). Among those, near-ties go to more CTAs (more SMs pulling),
        // short of two on most SMs (below).
        if rounds == 1 && batches == 1 {
            let whole = (rows * cols * 2) as f64 / bw;
            // The double-buffered kernels' batched input staging (`mv_body`'s SB) costs code
            // where the input is at most one float4 a thread. Two CTAs on an SM cost more than
            // the staging saves: measured in the step on the H100 (BENCHMARKS.md, 2026-11-27,
            // graph + PDL), the O projection one CTA an SM without double buffering, Llama-1B
            // at r2u8:1:1 0.9970 ms a token against 1.0213 at r1u8d:1:2, Qwen3-0.6B at
            // r1u8:1:1 0.8134 against 0.8231 at r1u8d:2:2.
            let staged = cols / 4 <= MV_THREADS as usize && v.double_buffered;
            let staged = if staged { 0.01 } else { 0.0 };
            // (Only where the grid fills most SMs twice: a product too small to fill them once
            // gains from a second CTA, as SmolLM2's O projection at r1u8:2:2 does. And only
            // where each CTA's staging of the whole input shows: inputs of more than one float4
            // a thread, or a product shorter than a memory latency. Measured in the step on the
            // H100, graph + PDL (BENCHMARKS.md, 2026-11-27): Qwen3-0.6B's QKV, 1024 wide and
            // 8 MB, 2.9% faster at r2u4:1:2 (two CTAs an SM) than at r4u4:1:1; SmolLM2's, 1 MB,
            // 0.6% slower at r1u8:2:2 than at r1u8:1:1.)
            let staged_twice = cols / 4 > MV_THREADS as usize || whole < LATENCY;
            let shared_sm = if staged_twice && 10 * grid >= 18 * sms {
                0.02
            } else {
                0.0
            };
            return whole.max(LATENCY)
                * (1.0 + staged + shared_sm - 0.001 * (grid as f64 / sms as f64));
        }
        // 16-byte loads in flight per warp, and per thread on average (idle lanes count).
        let warp_loads = r as usize * slice.min(32 * u as usize);
        let in_flight = warp_loads / 32;
        let sm_bytes_in_flight = (busiest_ctas * MV_WARPS as usize * warp_loads * 16) as f64;
        let sm_rate = (bw / sms as f64).min(sm_bytes_in_flight / LOADED_LATENCY);
        let streaming = busiest / sm_rate;
        let latency = (rounds * batches) as f64 * LATENCY / self.ctas_per_sm as f64;
        // Each task ends in a reduction, a barrier and the epilogue, during which its CTA
        // issues no loads; a second CTA on the SM streams meanwhile. Measured in the step on the
        // H100 (BENCHMARKS.md): gate/up at r2u4d:1:2 rather than r2u8d:1:1, graph + PDL
        // 2.3-2.8% faster on Llama-3.2-1B, Qwen3-1.7B and Llama-3.2-3B, graph 3.7-4.2%.
        const EPILOGUE: f64 = 0.25e-6;
        let epilogues = rounds as f64 * EPILOGUE / busiest_ctas as f64;
        // Without double buffering a warp has nothing in flight during its FMAs, when a task
        // takes more than one batch. Near-ties go to more loads in flight per thread, then to
        // one CTA per SM where CTAs loop over several tasks (in one round, `lone` below makes
        // two CTAs an SM the cheaper).
        let bubbles = !v.double_buffered && rounds * batches > 1;
        // Where every CTA has one task of several batches, one CTA an SM (8 warps, two a
        // scheduler) is slower than two CTAs of half the rows, although the estimate above
        // sees the same bytes a busiest SM: measured in the step on the H100 (BENCHMARKS.md,
        // 2026-11-27, two rounds), the down projection at r1u8d:1:2 rather than r2u8d:1:1,
        // graph + PDL 1.1% faster on Llama-3.2-1B and 0.7% on Qwen3-1.7B, graph 0.4% and
        // 0.5%. (Llama-3.2-3B's down, three rounds, was 1.5% slower at r1u8d:1:2.)
        let lone = rounds == 1 && self.ctas_per_sm == 1;
        let margin = 1.0
            + 0.01 * (16 - in_flight.min(16)) as f64 / 8.0
            + 0.005 * (self.ctas_per_sm - 1) as f64
            + if lone { 0.01 } else { 0.0 }
            + if bubbles { 0.03 } else { 0.0 };
        (streaming.max(latency) + epilogues) * margin
    }

    /// The geometry the estimate ranks first for a rows × cols product (`pairs`: the epilogue
    /// pairs rows).
    pub fn choose(rows: usize, cols: usize, pairs: bool, sms: usize) -> MvConfig {
        let mut best: Option<(f64, MvConfig)> = None;
        for c in Self::all() {
            if c.validate(pairs).is_err() {
                continue;
            }
            let t = c.estimate(rows, cols, sms, 3.0e12);
            if best.is_none_or(|(bt, _)| t < bt) {
                best = Some((t, c));
            }
        }
        best.expect("at least one mat-vec geometry is valid").1
    }
}

/// The projections of a decode step, each with its own geometry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Proj {
    Qkv,
    O,
    GateUp,
    Down,
    LmHead,
}

impl Proj {
    pub const ALL: [Proj; 5] = [Proj::Qkv, Proj::O, Proj::GateUp, Proj::Down, Proj::LmHead];

    /// The key in `MEGAINFER_BASELINE_MV`.
    pub fn key(self) -> &'static str {
        match self {
            Proj::Qkv => "qkv",
            Proj::O => "o",
            Proj::GateUp => "gu",
            Proj::Down => "down",
            Proj::LmHead => "lm",
        }
    }

    /// (rows, cols) of this projection for a model.
    pub fn shape(self, c: &crate::model::Config) -> (usize, usize) {
        match self {
            Proj::Qkv => (c.q_dim() + 2 * c.kv_dim(), c.hidden_size),
            Proj::O => (c.hidden_size, c.q_dim()),
            Proj::GateUp => (2 * c.intermediate_size, c.hidden_size),
            Proj::Down => (c.hidden_size, c.intermediate_size),
            Proj::LmHead => (c.vocab_size, c.hidden_size),
        }
    }

    /// Whether its fused epilogue pairs rows (RoPE, SiLU·up).
    fn pairs(self) -> bool {
        matches!(self, Proj::Qkv | Proj::GateUp)
    }
}

/// The geometry of each projection: [`MvConfig::choose`]'s, or as `MEGAINFER_BASELINE_MV`
/// says (`qkv=r2u8:1:1,down=r2u8:4:1`, keys qkv, o, gu, down, lm; the harness prints the
/// measured winners in this form).
pub fn mv_configs(c: &crate::model::Config, sms: usize) -> Result<[MvConfig; 5]> {
    let mut out = Proj::ALL.map(|p| {
        let (rows, cols) = p.shape(c);
        MvConfig::choose(rows, cols, p.pairs(), sms)
    });
    if let Ok(v) = std::env::var("MEGAINFER_BASELINE_MV") {
        for item in v.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (key, cfg) = item.split_once('=').with_context(|| {
                format!("MEGAINFER_BASELINE_MV: '{item}' is not KEY=VARIANT:KSPLIT:CTAS")
            })?;
            let i = Proj::ALL
                .iter()
                .position(|p| p.key() == key.trim())
                .with_context(|| {
                    format!("MEGAINFER_BASELINE_MV: unknown projection '{key}' (qkv, o, gu, down or lm)")
                })?;
            let cfg = MvConfig::parse(cfg.trim())
                .with_context(|| format!("MEGAINFER_BASELINE_MV: {key}"))?;
            cfg.validate(Proj::ALL[i].pairs())
                .with_context(|| format!("MEGAINFER_BASELINE_MV: {key}"))?;
            out[i] = cfg;
        }
    }
    Ok(out)
}

/// The `bl_mv` kernels of a loaded baseline module, and the launch rules they need.
pub struct MatVec {
    kernels: Vec<Kernel>,
    /// The double-buffered variants' kernels with the weights' prefetch (`bl_mv_…p`), by
    /// variant; None for the others.
    prefetching: Vec<Option<Kernel>>,
    sm_count: usize,
    max_cols: usize,
    /// Weights marked first to leave L2 (on unless `MEGAINFER_BASELINE_EVICT_FIRST=0`): a
    /// token's weights stream through the L2 many times over and would otherwise evict the
    /// activations, K/V rows and kernel code that are read again soon.
    pub evict_first: bool,
    /// The weights' prefetch before the wait (`MEGAINFER_BASELINE_PREFETCH`, else
    /// [`Prefetch::DEFAULT`]).
    pub prefetch: Prefetch,
}

/// How much of its weights each CTA of a mat-vec launched with PDL prefetches to L2 before its
/// `griddepcontrol.wait`: `bytes` where a CTA's share of the matrix is at least `min_share`
/// bytes, nothing elsewhere (nor without PDL, where nothing runs before the previous kernel
/// has finished).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Prefetch {
    pub bytes: usize,
    pub min_share: usize,
}

impl Prefetch {
    /// 32 KiB a CTA where its share is at least 128 KiB: on the H100, graph + PDL, 32-token
    /// prompt + 128 new (BENCHMARKS.md, 2026-11-27), Llama-1B 1.0384 → 1.0292 ms, Llama-3.2-3B
    /// 2.5259 → 2.4848, Llama-3.1-8B 5.3029 → 5.2344; the small shapes' projections are below
    /// the share and unchanged. 64 KiB was slower than 32 on all three; 32 KiB on every
    /// projection made Qwen3-0.6B 3.7% and SmolLM2 1.8% slower (same build, none).
    pub const DEFAULT: Prefetch = Prefetch {
        bytes: 32 << 10,
        min_share: 128 << 10,
    };

    /// `MEGAINFER_BASELINE_PREFETCH`'s value: `BYTES` (every launch under PDL) or
    /// `BYTES:MIN_SHARE`; 0 is off. Unset: [`Prefetch::DEFAULT`].
    pub fn parse(v: Option<&str>) -> Result<Prefetch> {
        let Some(v) = v.map(str::trim) else {
            return Ok(Prefetch::DEFAULT);
        };
        let bad = || format!("MEGAINFER_BASELINE_PREFETCH: '{v}' is not BYTES or BYTES:MIN_SHARE");
        let (b, m) = v.split_once(':').unwrap_or((v, "0"));
        let bytes: usize = b.trim().parse().with_context(bad)?;
        let min_share: usize = m.trim().parse().with_context(bad)?;
        if bytes > 1 << 24 {
            bail!("MEGAINFER_BASELINE_PREFETCH: {bytes} bytes a CTA is more than 16 MiB");
        }
        Ok(Prefetch { bytes, min_share })
    }

    /// Bytes a CTA prefetches, for a matrix of `weight_bytes` over `grid` CTAs.
    pub fn bytes_for(self, weight_bytes: usize, grid: usize, pdl: bool) -> usize {
        if !pdl || self.bytes == 0 || weight_bytes / grid.max(1) < self.min_share {
            return 0;
        }
        self.bytes
    }
}

impl MatVec {
    /// Words of the argmax mode's per-CTA partials for any geometry on this many SMs.
    pub fn argmax_part_words(sm_count: usize) -> usize {
        2 * sm_count * MV_MAX_CTAS_PER_SM as usize
    }

    pub fn load(module: &Arc<CudaModule>, gpu: &Gpu) -> Result<Self> {
        let mut kernels = Vec::new();
        let mut prefetching = Vec::new();
        let mut static_smem = 0;
        for v in MV_VARIANTS {
            let k = Kernel::load(module, v.kernel)?;
            static_smem = static_smem.max(k.static_smem()?);
            kernels.push(k);
            let pf = v
                .prefetching
                .map(|name| Kernel::load(module, name))
                .transpose()?;
            if let Some(k) = &pf {
                static_smem = static_smem.max(k.static_smem()?);
            }
            prefetching.push(pf);
        }
        let dynamic = gpu.max_smem_per_block.saturating_sub(static_smem);
        for k in kernels.iter().chain(prefetching.iter().flatten()) {
            k.allow_smem(dynamic)?;
        }
        let evict_first = super::switches::switch("MEGAINFER_BASELINE_EVICT_FIRST", true)?;
        let prefetch =
            Prefetch::parse(std::env::var("MEGAINFER_BASELINE_PREFETCH").ok().as_deref())?;
        Ok(Self {
            kernels,
            prefetching,
            sm_count: gpu.sm_count,
            max_cols: dynamic / 4,
            evict_first,
            prefetch,
        })
    }

    #[allow(clippy::too_many_arguments)]
    /// Enqueues y = W · in for a rows × cols W (`p.w`, bf16, row-major) on `stream`; `p`'s
    /// addresses set by the caller, the rest here from the arguments.
    pub fn launch(
        &self,
        stream: &cudarc::driver::CudaStream,
        cfg: MvConfig,
        mut p: MvParams,
        rows: usize,
        cols: usize,
        input: MvIn,
        out: MvOut,
        pdl: bool,
    ) -> Result<()> {
        cfg.validate(out.pairs())?;
        if rows == 0 || !cols.is_multiple_of(8) || cols > self.max_cols {
            bail!(
                "mat-vec of {rows} x {cols}: needs rows > 0 and cols a multiple of 8 of at most {}",
                self.max_cols
            );
        }
        if out.pairs() && !rows.is_multiple_of(2) {
            bail!("mat-vec of {rows} rows: a paired epilogue needs an even row count");
        }
        p.rows = rows as i32;
        p.cols = cols as i32;
        p.ksplit = cfg.ksplit as i32;
        p.evict_first = self.evict_first as i32;
        p.out_mode = out.code();
        match input {
            MvIn::Plain => p.in_mode = 0,
            MvIn::Norm { norm, eps } => {
                p.in_mode = 1;
                p.norm = norm;
                p.eps = eps;
            }
        }
        match out {
            MvOut::Store | MvOut::Add | MvOut::Silu => {}
            MvOut::AddCopy { y2 } => {
                if p.y3 != 0 {
                    bail!("mat-vec: a residual copy and the AddCopy epilogue both use y2");
                }
                p.y2 = y2
            }
            MvOut::RopeKv {
                k_cache,
                v_cache,
                meta,
                inv_freq,
                n_heads,
                n_kv,
                head_dim,
            } => {
                if rows != ((n_heads + 2 * n_kv) * head_dim) as usize {
                    bail!(
                        "mat-vec RoPE epilogue: {rows} rows is not (heads + 2 kv heads) x head_dim"
                    );
                }
                (p.k_cache, p.v_cache, p.meta, p.inv_freq) = (k_cache, v_cache, meta, inv_freq);
                (p.n_heads, p.n_kv, p.head_dim) = (n_heads, n_kv, head_dim);
            }
            MvOut::Argmax {
                meta,
                history,
                part,
                done,
            } => (p.meta, p.history, p.part, p.done) = (meta, history, part, done),
        }
        let (_, grid) = cfg.grid(rows, self.sm_count);
        let pf = self.prefetching[cfg.variant].as_ref();
        let bytes = self.prefetch.bytes_for(rows * cols * 2, grid, pdl);
        let kernel = match pf {
            Some(k) if bytes > 0 => {
                p.prefetch = bytes as i32;
                k
            }
            _ => &self.kernels[cfg.variant],
        };
        let mut a = kargs![&p];
        // SAFETY: bl_mv takes one MvParams by value, which `p` mirrors (#[repr(C)], field for
        // field); its addresses are the caller's device buffers of the sizes the modes read
        // and write (x cols floats, y rows — rows / 2 for Silu —, part
        // argmax_part_words(sm_count) words), live until the launch completes.
        unsafe {
            kernel.launch(
                stream,
                grid as u32,
                MV_THREADS,
                (cols * 4) as u32,
                pdl,
                &mut a,
            )
        }
    }
}

/// The baseline module's CUBIN for `arch` (from the kernel cache where it was compiled
/// before): one module for every model, with `MEGAINFER_BASELINE_DEFINES`' extra NVRTC options
/// (e.g. `-DQG_UNROLL=2`, for measuring variants).
pub fn compile_module(arch: &str) -> Result<Vec<u8>> {
    let extra = std::env::var("MEGAINFER_BASELINE_DEFINES").unwrap_or_default();
    let defines: Vec<String> = extra.split_whitespace().map(String::from).collect();
    compile_cubin("baseline", &sources::baseline(), arch, &defines)
}

/// The baseline module for this GPU (the harness loads its kernels from it).
pub fn load_module(gpu: &Gpu) -> Result<Arc<CudaModule>> {
    let cubin = compile_module(&gpu.arch())?;
    gpu.ctx
        .load_module(Ptx::from_binary(cubin))
        .context("loading the baseline CUBIN")
}

/// The first mat-vec kernel, `bl_gemv` (kernels/baseline/baseline.cu), kept as the harness's
/// reference point (tests/gpu_gemv_bench.rs): plain input, y = W · x, 16 rows per CTA.
pub struct OldGemv(Kernel);

impl OldGemv {
    pub fn load(module: &Arc<CudaModule>, max_cols: usize) -> Result<Self> {
        let k = Kernel::load(module, "bl_gemv")?;
        k.allow_smem(max_cols * 4)?;
        Ok(Self(k))
    }

    #[allow(clippy::too_many_arguments)]
    pub fn launch(
        &self,
        stream: &cudarc::driver::CudaStream,
        w: u64,
        x: u64,
        y: u64,
        rows: usize,
        cols: usize,
        pdl: bool,
    ) -> Result<()> {
        let (rows_i, cols_i) = (rows as i32, cols as i32);
        let (acc, mode, norm, eps) = (0i32, 0i32, 0u64, 0f32);
        let grid = (rows as u32).div_ceil(16);
        // SAFETY: the arguments are the values bl_gemv declares, in order, each a live local;
        // w, x and y are the caller's device buffers of rows × cols, cols and rows elements.
        unsafe {
            self.0.launch(
                stream,
                grid,
                256,
                (cols * 4) as u32,
                pdl,
                &mut kargs![&w, &x, &y, &rows_i, &cols_i, &acc, &mode, &norm, &eps],
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::presets;

    #[test]
    fn attention_threads_are_whole_warps() {
        assert_eq!(att_threads(None).unwrap(), ATT_THREADS);
        assert_eq!(att_threads(Some(" 256 ")).unwrap(), 256);
        for bad in ["32", "100", "2048", "x", ""] {
            assert!(
                att_threads(Some(bad)).unwrap_err().contains("ATT_THREADS"),
                "{bad}"
            );
        }
    }

    #[test]
    fn attention_preloads_at_head_dim_128_unless_told() {
        assert_eq!(attention_kernel_for(64, None).unwrap(), "bl_attention");
        assert_eq!(
            attention_kernel_for(128, None).unwrap(),
            "bl_attention_preload"
        );
        assert_eq!(
            attention_kernel_for(64, Some("1")).unwrap(),
            "bl_attention_preload"
        );
        assert_eq!(
            attention_kernel_for(128, Some("0")).unwrap(),
            "bl_attention"
        );
        let e = attention_kernel_for(128, Some("yes")).unwrap_err();
        assert!(e.contains("MEGAINFER_BASELINE_ATT_PRELOAD"), "{e}");
    }

    #[test]
    fn prefetch_settings_parse_and_apply_by_share() {
        assert_eq!(Prefetch::parse(None).unwrap(), Prefetch::DEFAULT);
        assert_eq!(Prefetch::parse(Some("0")).unwrap().bytes, 0);
        let p = Prefetch::parse(Some(" 32768:131072 ")).unwrap();
        assert_eq!((p.bytes, p.min_share), (32768, 131072));
        assert_eq!(Prefetch::parse(Some("8192")).unwrap().min_share, 0);
        for bad in ["", "x", "1:y", "1:2:3", "-5", "99999999"] {
            let e = Prefetch::parse(Some(bad)).unwrap_err();
            assert!(
                format!("{e:#}").contains("MEGAINFER_BASELINE_PREFETCH"),
                "{bad}: {e:#}"
            );
        }
        // A CTA's share decides; nothing without PDL or when off.
        assert_eq!(p.bytes_for(264 * 131072, 264, true), 32768);
        assert_eq!(p.bytes_for(264 * 131072 - 1, 264, true), 0);
        assert_eq!(p.bytes_for(1 << 30, 264, false), 0);
        let off = Prefetch::parse(Some("0")).unwrap();
        assert_eq!(off.bytes_for(1 << 30, 264, true), 0);
    }

    /// The split rule at the lengths it was chosen from (BENCHMARKS.md, 2026-11-25, 132 SMs):
    /// 8 KV heads (Llama-1B) and 3 (SmolLM2).
    #[test]
    fn attention_parts_follow_the_measured_rule() {
        // No split up to SPLIT_KV_FROM (a 32-token prompt + 128 new: bl_attention measured
        // faster), then one part per 32 positions.
        assert_eq!(attention_parts(160, 8, 132), 1);
        assert_eq!(attention_parts(SPLIT_KV_FROM, 8, 132), 1);
        assert_eq!(attention_parts(256, 8, 132), 8);
        assert_eq!(attention_parts(640, 8, 132), 20);
        // At most two blocks per SM: 33 parts for 8 KV heads, 88 for 3.
        assert_eq!(attention_parts(1128, 8, 132), 33);
        assert_eq!(attention_parts(8191, 8, 132), 33);
        assert_eq!(attention_parts(8191, 3, 132), 88);
        // Unless parts would pass ATT_PART_SPAN positions: 128 at 32K, the most there are.
        assert_eq!(attention_parts(32767, 8, 132), 128);
        assert_eq!(attention_parts(131072, 8, 132), MAX_ATT_PARTS);
        // Never fewer than two once split, whatever the GPU.
        assert_eq!(attention_parts(SPLIT_KV_FROM + 1, 64, 1), 2);
    }

    #[test]
    fn every_projection_gets_a_valid_geometry() {
        for &model in presets::NAMES {
            let c = presets::by_name(model).unwrap();
            for sms in [132, 114, 78] {
                for p in Proj::ALL {
                    let (rows, cols) = p.shape(&c);
                    let cfg = MvConfig::choose(rows, cols, p.pairs(), sms);
                    cfg.validate(p.pairs()).unwrap();
                    let (tasks, grid) = cfg.grid(rows, sms);
                    assert!(grid >= 1 && grid <= tasks && grid <= 2 * sms);
                    // The input row fits the shared memory bl_mv stages it in (H100: 227 KiB).
                    assert!(cols * 4 <= 227 * 1024 - 1024, "{model} {}", p.key());
                    if sms == 132 {
                        println!(
                            "{model} {} {rows}x{cols}: {} ({tasks} tasks, grid {grid})",
                            p.key(),
                            cfg.name()
                        );
                    }
                }
            }
        }
    }

    /// Every preset's geometries (qkv, o, gu, down, lm) as the estimate ranks them on an
    /// H100's 132 SMs, so a change to the estimate shows which products it moves. Llama-1B's
    /// are the ones measured fastest in the step (BENCHMARKS.md, 2026-11-27,
    /// `MEGAINFER_BASELINE_MV` sweeps, graph + PDL and graph): QKV with every load issued at
    /// once, O the same at one CTA an SM (as Qwen3-1.7B's and Qwen3-0.6B's, c5808c9), gate/up
    /// and the down projection as two double-buffered CTAs an SM.
    #[test]
    fn every_preset_gets_its_geometries() {
        let want = [
            (
                "llama-3.2-1b",
                "r2u8:1:2 r2u8:1:1 r2u4d:1:2 r1u8d:1:2 r2u4d:1:2",
            ),
            (
                "llama-3.2-3b",
                "r1u8d:2:2 r1u8d:2:2 r2u4d:1:2 r1u8d:2:2 r1u8d:1:2",
            ),
            (
                "llama-3.1-8b",
                "r1u8d:1:2 r2u4d:1:2 r2u4d:1:2 r2u8d:1:1 r1u8d:1:2",
            ),
            (
                "smollm2-135m",
                "r1u8:1:1 r1u8:2:2 r2u4:1:2 r1u8:2:2 r4u4:1:2",
            ),
            (
                "qwen3-0.6b",
                "r2u4:1:2 r1u8:1:1 r4u4:1:2 r1u16:1:1 r4u4:1:2",
            ),
            (
                "qwen3-1.7b",
                "r2u8:1:2 r2u8:1:1 r2u4d:1:2 r1u8d:1:2 r2u4d:1:2",
            ),
            (
                "qwen3-4b",
                "r1u8d:1:2 r1u8d:4:2 r2u4d:1:2 r1u8d:4:2 r2u4d:1:2",
            ),
            (
                "qwen3-8b",
                "r1u8d:1:2 r2u4d:1:2 r2u4d:1:2 r2u8d:1:1 r2u4d:1:2",
            ),
            (
                "qwen2.5-0.5b",
                "r1u8:1:2 r1u8:2:2 r1u8d:1:2 r1u16:2:2 r4u4:1:2",
            ),
            (
                "qwen2.5-7b",
                "r1u8d:4:2 r1u8d:4:2 r2u4d:1:2 r1u8d:4:2 r2u4d:1:2",
            ),
        ];
        assert_eq!(want.len(), presets::NAMES.len());
        for (name, geometries) in want {
            let c = presets::by_name(name).unwrap();
            let got: Vec<String> = Proj::ALL
                .iter()
                .map(|p| {
                    let (rows, cols) = p.shape(&c);
                    MvConfig::choose(rows, cols, p.pairs(), 132).name()
                })
                .collect();
            assert_eq!(got.join(" "), geometries, "{name}");
        }
    }

    #[test]
    fn fusion_steps_parse_and_unknown_ones_are_named() {
        let f = Fusion::parse("norm, rope,mlp,attn").unwrap();
        assert!(f.norm && f.rope && !f.silu && !f.argmax);
        assert_eq!((f.mlp, f.attn), (MlpFusion::On, AttnOFusion::On));
        let none = Fusion::parse("none").unwrap();
        assert!(!none.norm && !none.silu && !none.rope && !none.argmax);
        assert_eq!((none.mlp, none.attn), (MlpFusion::Off, AttnOFusion::Off));
        let err = Fusion::parse("norm,fuse-everything")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("fuse-everything") && err.contains("mlp") && err.contains("attn"),
            "{err}"
        );
    }

    #[test]
    fn geometry_strings_round_trip_and_bad_ones_are_named() {
        for cfg in MvConfig::all() {
            assert_eq!(MvConfig::parse(&cfg.name()).unwrap(), cfg);
        }
        for (bad, says) in [
            ("r3u8:1:1", "unknown variant 'r3u8'"),
            ("r2u8:3:1", "ksplit must be 1, 2, 4 or 8"),
            ("r2u8:1:9", "CTAs per SM must be 1 to 2"),
            ("r2u8:1", "expected VARIANT:KSPLIT:CTAS_PER_SM"),
            ("r2u8:x:1", "ksplit 'x' is not a number"),
            ("r2u8d:1:2", "r2u8d is built for at most 1 CTA(s) per SM"),
        ] {
            let e = format!("{:#}", MvConfig::parse(bad).unwrap_err());
            assert!(e.contains(says), "{bad}: {e}");
        }
        // One row per task cannot pair rows (RoPE, SiLU·up).
        let one = MvConfig::parse("r1u8:8:1").unwrap();
        assert!(one.validate(true).is_err() && one.validate(false).is_ok());
    }
}

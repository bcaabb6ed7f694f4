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
use super::model::{enqueue_qkv_extras, DeviceMatrix, DeviceModel, KvCache};
use super::sources;
use super::stepping::{self, Sequence, Steps};
use crate::kargs;
use crate::sampling::device::DeviceSampler;
use crate::sampling::SamplingParams;

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
    gemv: Kernel,
    rope_kv: Kernel,
    attention: Kernel,
    attention_part: Kernel,
    attention_merge: Kernel,
    qkv_extras: Kernel,
    argmax: Kernel,
    embed_q: Kernel,
    /// kernels/quant/quant.cu's mat-vecs, by storage: Q8_0, Q4_0, Q4_1.
    gemv_q: [Kernel; 3],
}

const GEMV_THREADS: u32 = 256;
const GEMV_ROWS_PER_BLOCK: u32 = 16; // 8 warps × GEMV_ROWS_PER_WARP
const ATT_THREADS: u32 = 128;
/// Caches longer than this get split-KV attention; shorter ones one block per head (the split
/// costs a merge kernel per layer, which short contexts do not earn back).
const SPLIT_KV_FROM: usize = 2048;
/// Split-KV parts per head at most.
const MAX_ATT_PARTS: usize = 64;

/// Threads and rows per block of the quantised mat-vecs: 8 warps × QG_ROWS rows
/// (kernels/quant/quant.cu).
const QUANT_THREADS: u32 = 256;
const QUANT_ROWS_PER_BLOCK: u32 = 16;

/// Shared memory of a quantised mat-vec over rows of `cols`: the input vector, padded to
/// whole 256-element chunks (QG_CHUNK in kernels/quant/quant.cu).
fn quant_smem(cols: usize) -> u32 {
    (cols.div_ceil(256) * 256 * 4) as u32
}

/// Which elementwise steps `bl_gemv` folds into its input staging instead of running them as
/// kernels of their own. Folding both saved 5% a token on the SmolLM2 shape (hidden 576, 30
/// layers) and cost 3% on the Llama-3.2-1B shape (hidden 2048; every one of the LM head's 8016
/// blocks then normalises the hidden state itself), measured on an H100 (BENCHMARKS.md), so by
/// default they are folded for hidden sizes under 1024 only. `MEGAINFER_BASELINE_FUSION`
/// (`norm,silu`, `norm`, `silu` or `none`) overrides, for measuring the variants.
#[derive(Clone, Copy, Debug)]
struct Fusion {
    norm: bool,
    silu: bool,
}

impl Fusion {
    fn choose(config: &crate::model::Config) -> Result<Self> {
        let Ok(v) = std::env::var("MEGAINFER_BASELINE_FUSION") else {
            let narrow = config.hidden_size < 1024;
            return Ok(Fusion {
                norm: narrow,
                silu: narrow,
            });
        };
        let mut f = Fusion {
            norm: false,
            silu: false,
        };
        for part in v.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            match part {
                "norm" => f.norm = true,
                "silu" => f.silu = true,
                "none" => {}
                other => {
                    bail!("MEGAINFER_BASELINE_FUSION: unknown step '{other}' (norm, silu or none)")
                }
            }
        }
        Ok(f)
    }
}

/// How `bl_gemv` forms its input vector (GEMV_IN_* in kernels/baseline/baseline.cu).
#[derive(Clone, Copy)]
enum GemvIn {
    Plain,
    /// The RMS norm of x with these weights.
    Norm(u64),
    /// silu(gate) · up of x = [gate; up].
    SiluUp,
}

pub struct BaselinePath<'g> {
    gpu: &'g Gpu,
    model: &'g DeviceModel,
    mode: Mode,
    k: Kernels,
    _module: Arc<CudaModule>,
    kv: KvCache,
    x: CudaSlice<f32>,
    /// The normed hidden and the MLP activation, for the steps not folded into bl_gemv.
    xn: CudaSlice<f32>,
    act: CudaSlice<f32>,
    fusion: Fusion,
    qkv: CudaSlice<f32>,
    attn: CudaSlice<f32>,
    gu: CudaSlice<f32>,
    /// Split-KV attention's per-part states, [heads][parts][2 + head_dim].
    att_parts_st: CudaSlice<f32>,
    att_parts: usize,
    logits: CudaSlice<f32>,
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
    /// positions: split-KV only when that is over SPLIT_KV_FROM, since at short lengths the
    /// merge kernel costs more than the split gains. Longer sequences still run, on one block
    /// per head.
    pub fn new_for(
        gpu: &'g Gpu,
        model: &'g DeviceModel,
        mode: Mode,
        max_seq: usize,
        expected_len: usize,
    ) -> Result<Self> {
        let c = &model.config;
        let cubin = compile_cubin("baseline", &sources::baseline(), &gpu.arch(), &[])?;
        let module = gpu
            .ctx
            .load_module(Ptx::from_binary(cubin))
            .context("loading the baseline CUBIN")?;
        let k = Kernels {
            embed: Kernel::load(&module, "bl_embed")?,
            rmsnorm: Kernel::load(&module, "bl_rmsnorm")?,
            silu_mul: Kernel::load(&module, "bl_silu_mul")?,
            gemv: Kernel::load(&module, "bl_gemv")?,
            rope_kv: Kernel::load(&module, "bl_rope_kv")?,
            attention: Kernel::load(&module, "bl_attention")?,
            attention_part: Kernel::load(&module, "bl_attention_part")?,
            attention_merge: Kernel::load(&module, "bl_attention_merge")?,
            qkv_extras: Kernel::load(&module, "qkv_extras")?,
            argmax: Kernel::load(&module, "bl_argmax")?,
            embed_q: Kernel::load(&module, "bl_embed_q")?,
            gemv_q: [
                Kernel::load(&module, "bl_gemv_q8_0")?,
                Kernel::load(&module, "bl_gemv_q4_0")?,
                Kernel::load(&module, "bl_gemv_q4_1")?,
            ],
        };
        // Enough blocks to cover every SM twice, at most one part per 32 positions.
        let att_parts = if expected_len.min(max_seq) > SPLIT_KV_FROM {
            (2 * gpu.sm_count)
                .div_ceil(c.num_heads)
                .clamp(2, MAX_ATT_PARTS)
                .min(max_seq.div_ceil(32))
        } else {
            1
        };
        let max_cols = c.hidden_size.max(c.intermediate_size).max(c.q_dim());
        k.gemv.allow_smem(max_cols * 4)?;
        for g in &k.gemv_q {
            g.allow_smem(quant_smem(max_cols) as usize)?;
        }
        let qkv_rows = c.q_dim() + 2 * c.kv_dim();
        let mut p = Self {
            kv: KvCache::new(gpu, c, max_seq)?,
            x: gpu.alloc_zeros(c.hidden_size, "hidden")?,
            xn: gpu.alloc_zeros(c.hidden_size, "normed hidden")?,
            act: gpu.alloc_zeros(c.intermediate_size, "mlp activation")?,
            fusion: Fusion::choose(c)?,
            qkv: gpu.alloc_zeros(qkv_rows, "qkv")?,
            attn: gpu.alloc_zeros(c.q_dim(), "attention output")?,
            gu: gpu.alloc_zeros(2 * c.intermediate_size, "gate/up")?,
            att_parts_st: gpu.alloc_zeros(
                c.num_heads * att_parts * (2 + c.head_dim),
                "split-KV attention states",
            )?,
            att_parts,
            logits: gpu.alloc_zeros(c.vocab_size, "logits")?,
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

    /// `y (+)= W · in` over `w`'s rows, `in` formed from x per `input`: bl_gemv for bf16
    /// weights, the quantised mat-vecs (kernels/quant/quant.cu) for blocks.
    fn gemv(
        &self,
        w: &DeviceMatrix,
        x: u64,
        y: u64,
        accumulate: bool,
        input: GemvIn,
    ) -> Result<()> {
        let (rows, cols) = (w.rows, w.cols);
        let (rows_i, cols_i, acc) = (rows as i32, cols as i32, accumulate as i32);
        let (mode, norm) = match input {
            GemvIn::Plain => (0i32, 0u64),
            GemvIn::Norm(n) => (1, n),
            GemvIn::SiluUp => (2, 0),
        };
        let eps = self.model.config.rms_norm_eps;
        let grid = (rows as u32).div_ceil(GEMV_ROWS_PER_BLOCK);
        let (wp, pdl, stream) = (w.ptr(self.gpu), self.pdl(), &self.gpu.stream);
        if w.type_code() == 0 {
            let mut a = kargs![&wp, &x, &y, &rows_i, &cols_i, &acc, &mode, &norm, &eps];
            // SAFETY: the arguments are the values bl_gemv declares, in order (see
            // kernels/baseline/baseline.cu), each a live local; the pointers are device buffers
            // of this path or the model that outlive the launch (x holds 2 * cols floats for
            // SiluUp; norm, cols weights).
            return unsafe {
                self.k
                    .gemv
                    .launch(stream, grid, GEMV_THREADS, (cols * 4) as u32, pdl, &mut a)
            };
        }
        let sp = w.scales_ptr(self.gpu);
        let kernel = &self.k.gemv_q[w.type_code() as usize - 1];
        let grid = (rows as u32).div_ceil(QUANT_ROWS_PER_BLOCK);
        let mut a = kargs![&wp, &sp, &x, &y, &rows_i, &cols_i, &acc, &mode, &norm, &eps];
        // SAFETY: the arguments are the values bl_gemv_q8_0/q4_0/q4_1 declare, in order (see
        // kernels/quant/quant.cu), each a live local; the pointers are device buffers of this
        // path or the model that outlive the launch (W and scales hold `rows` rows of `cols`
        // elements of w's type; x 2 * cols floats for SiluUp; norm, cols weights).
        unsafe { kernel.launch(stream, grid, QUANT_THREADS, quant_smem(cols), pdl, &mut a) }
    }

    /// The input of a mat-vec that reads the RMS norm of x: x itself with the norm folded in,
    /// or xn after a norm kernel.
    fn normed(&self, x: u64, norm: u64) -> Result<(u64, GemvIn)> {
        if self.fusion.norm {
            return Ok((x, GemvIn::Norm(norm)));
        }
        let c = &self.model.config;
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
        Ok((xn, GemvIn::Plain))
    }

    /// The input of the down projection: gu = [gate; up] with SiLU·up folded in, or act after
    /// a kernel of its own.
    fn silu_up(&self, gu: u64) -> Result<(u64, GemvIn)> {
        if self.fusion.silu {
            return Ok((gu, GemvIn::SiluUp));
        }
        let inter = self.model.config.intermediate_size as i32;
        let act = ptr(&self.act, &self.gpu.stream);
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
        }?;
        Ok((act, GemvIn::Plain))
    }

    fn pdl(&self) -> bool {
        self.mode == Mode::GraphPdl
    }

    /// Enqueues one decode step for the token and position in `meta`, its token chosen by the
    /// greedy argmax or, when `sampled`, by the device sampler.
    fn enqueue_step(&self, sampled: bool) -> Result<()> {
        let (g, c, s) = (self.gpu, &self.model.config, &self.gpu.stream);
        let pdl = self.pdl();
        let (x, qkv, attn, gu, logits, meta, history) = (
            ptr(&self.x, s),
            ptr(&self.qkv, s),
            ptr(&self.attn, s),
            ptr(&self.gu, s),
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
            let (ty, sc) = (em.type_code(), em.scales_ptr(g));
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
                    &mut kargs![&ty, &embed, &sc, &meta, &x, &hidden],
                )
            }?;
        }
        let inv_freq = ptr(&self.model.inv_freq, s);
        for (l, lw) in self.model.layers.iter().enumerate() {
            let (input, how) = self.normed(x, ptr(&lw.attn_norm, s))?;
            self.gemv(&lw.w_qkv, input, qkv, false, how)?;
            enqueue_qkv_extras(&self.k.qkv_extras, g, c, lw, qkv, 1, pdl)?;
            let off = (l * self.kv.layer_stride * 2) as u64;
            let (kc, vc) = (ptr(&self.kv.k, s) + off, ptr(&self.kv.v, s) + off);
            // SAFETY: the arguments are the values bl_rope_kv declares, in order (see
            // kernels/baseline/baseline.cu), each a live local; the pointers are device buffers of this
            // path that outlive the launch.
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
            let att_smem = ((ATT_THREADS / 32) * (2 + c.head_dim as u32) + c.head_dim as u32) * 4;
            if self.att_parts > 1 {
                let (st, parts) = (ptr(&self.att_parts_st, s), self.att_parts as i32);
                // SAFETY: the arguments are the values bl_attention_part and bl_attention_merge
                // declare, in order (see kernels/baseline/baseline.cu), each a live local; the
                // pointers are device buffers of this path that outlive the launches, `st`
                // sized heads * parts * (2 + head_dim).
                unsafe {
                    self.k.attention_part.launch(
                        s,
                        (c.num_heads * self.att_parts) as u32,
                        ATT_THREADS,
                        att_smem,
                        pdl,
                        &mut kargs![&qkv, &kc, &vc, &st, &meta, &nh, &nkv, &hd, &parts],
                    )?;
                    self.k.attention_merge.launch(
                        s,
                        c.num_heads as u32,
                        c.head_dim as u32,
                        0,
                        pdl,
                        &mut kargs![&st, &attn, &hd, &parts],
                    )?;
                }
            } else {
                // SAFETY: the arguments are the values bl_attention declares, in order (see
                // kernels/baseline/baseline.cu), each a live local; the pointers are device
                // buffers of this path that outlive the launch.
                unsafe {
                    self.k.attention.launch(
                        s,
                        c.num_heads as u32,
                        ATT_THREADS,
                        att_smem,
                        pdl,
                        &mut kargs![&qkv, &kc, &vc, &attn, &meta, &nh, &nkv, &hd],
                    )
                }?;
            }
            self.gemv(&lw.wo, attn, x, true, GemvIn::Plain)?;
            let (input, how) = self.normed(x, ptr(&lw.ffn_norm, s))?;
            self.gemv(&lw.w_gu, input, gu, false, how)?;
            let (input, how) = self.silu_up(gu)?;
            self.gemv(&lw.w_down, input, x, true, how)?;
        }
        let (input, how) = self.normed(x, ptr(&self.model.final_norm, s))?;
        self.gemv(self.model.lm_head(), input, logits, false, how)?;
        if sampled {
            let sampler = self.sampler.as_ref().context("device sampler not made")?;
            return sampler.enqueue(s, logits, meta, meta, history, pdl);
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
    let cubin = compile_cubin("baseline", &sources::baseline(), &gpu.arch(), &[])?;
    let module = gpu.ctx.load_module(Ptx::from_binary(cubin))?;
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

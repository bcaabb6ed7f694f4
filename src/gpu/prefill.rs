//! Batched prefill on the GPU, shared by every decode path: the prompt goes through the layers a
//! chunk of tokens at a time (memory bounded for any prompt length), every linear layer one
//! cuBLAS product on tensor cores (bf16 operands, f32 accumulation and output; the O and down
//! products add into the f32 residual stream directly with beta = 1), causal flash attention
//! over the chunk and the cache of earlier chunks (kernels/prefill/prefill.cu), RoPE and the
//! K/V rows written into the decode path's own cache layout. The last token's hidden state
//! goes through the final norm and the LM head; decoding then continues on the path unchanged.
//! Prompts of up to [`GRAPH_MAX_TOKENS`] run as a CUDA graph captured once per length bucket
//! (docs/prefill.md): at those lengths launching kernels one by one costs more than running them.
//!
//! cuBLAS, not our own kernels, does the products: these are large plain GEMMs, where cuBLAS
//! is close to the tensor cores' peak on every shape, and the engine's own work is in what
//! surrounds them (attention, RoPE into the cache).

use std::ffi::c_void;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use cudarc::cublas::sys as cb;
use cudarc::cublas::CudaBlas;
use cudarc::driver::{sys, CudaGraph, CudaModule, CudaSlice};
use cudarc::nvrtc::Ptx;

use super::compile::compile_cubin;
use super::device::{ptr, Gpu};
use super::launch::Kernel;
use super::lt_gemm::LtGemm;
use super::model::{enqueue_qkv_extras, DeviceMatrix, DeviceModel, KvCache};
use crate::kargs;
use crate::model::{Config, WeightType};

/// Tokens per chunk by default: large enough that every product runs near the tensor cores'
/// peak and an 8K prompt is one chunk (measured on the H100, Llama-1B shape, 8K prompt:
/// chunks of 2048 51.7 ms, 4096 50.3, 8192 48.4, 16384 48.6; 32K: 407, 403, 396, 389 ms),
/// small enough that a chunk's activations stay within about a GB for 8B-class models. The
/// buffers are sized for the prompt when it is shorter.
pub const DEFAULT_CHUNK: usize = 8192;

// Mirrors kernels/prefill/prefill.cu.
/// Key positions per attention tile (PF_BK in prefill.cu, BK in attention_wgmma.cuh).
const BK: usize = 64;
const NORM_THREADS: u32 = 256;
/// Blocks per token of pf_rope_kv.
const ROPE_PARTS: usize = 4;
/// pf_silu_mul's block: threads, four columns each.
const SILU_THREADS: u32 = 256;
const SILU_COLUMNS_PER_BLOCK: usize = 4 * SILU_THREADS as usize;
/// Rows of the LM head computed at once when every position's logits are wanted.
const LOGIT_ROWS: usize = 256;
/// Prompts of at most this many tokens (one chunk, last logits only) run as a CUDA graph
/// captured once per length bucket: a short prompt is hundreds of small launches, and
/// launching them one by one takes the host longer than the GPU takes to run them.
pub const GRAPH_MAX_TOKENS: usize = 128;
/// Graph buckets are this many tokens apart: a prompt runs padded to the next multiple.
const GRAPH_BUCKET: usize = 16;
/// Captured graphs kept at most (buckets times the caches they write to).
const MAX_GRAPHS: usize = 32;
/// Matrices one dequantising launch takes (Q_SET_MAX in kernels/quant/quant.cu).
const DEQUANT_SET_MAX: usize = 4;
const DEQUANT_THREADS: u32 = 256;

/// q_dequant_bf16_set's argument (QDequantSet in kernels/quant/quant.cu): `n` matrices.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct DequantSet {
    data: [u64; DEQUANT_SET_MAX],
    out: [u64; DEQUANT_SET_MAX],
    rows: [i64; DEQUANT_SET_MAX],
    ty: [i32; DEQUANT_SET_MAX],
    cols: [i32; DEQUANT_SET_MAX],
    n: i32,
}

/// Elements of `wide` a quantised matrix takes: rounded up to 128 (256 bytes), so that every
/// decoded matrix starts as aligned as cuBLAS likes its operands.
fn wide_span(m: &DeviceMatrix) -> usize {
    (m.rows * m.cols).next_multiple_of(128)
}

/// Elements of `wide` the quantised matrices among `ms` take together.
fn wide_elements(ms: &[&DeviceMatrix]) -> usize {
    ms.iter()
        .filter(|m| m.ty != WeightType::Bf16)
        .map(|m| wide_span(m))
        .sum()
}

/// Where a decode path keeps K and V: element `d` of the row of KV head `h` at position `p`
/// in layer `l` sits at `l * layer_stride + h * head_stride + p * pos_stride + d` (bf16
/// elements) from `k` (and `v`).
#[derive(Clone, Copy, Debug)]
pub struct KvTarget {
    pub k: u64,
    pub v: u64,
    pub max_seq: usize,
    pub layer_stride: usize,
    pub head_stride: usize,
    pub pos_stride: usize,
}

impl KvTarget {
    /// `[max_seq, kv_heads, head_dim]` per layer: the baseline kernels' layout.
    pub fn position_major(gpu: &Gpu, kv: &KvCache, cfg: &Config) -> Self {
        Self {
            k: ptr(&kv.k, &gpu.stream),
            v: ptr(&kv.v, &gpu.stream),
            max_seq: kv.max_seq,
            layer_stride: kv.layer_stride,
            head_stride: cfg.head_dim,
            pos_stride: cfg.kv_dim(),
        }
    }

    /// `[kv_heads, max_seq, head_dim]` per layer: the megakernel's layout.
    pub fn head_major(gpu: &Gpu, kv: &KvCache, cfg: &Config) -> Self {
        Self {
            k: ptr(&kv.k, &gpu.stream),
            v: ptr(&kv.v, &gpu.stream),
            max_seq: kv.max_seq,
            layer_stride: kv.layer_stride,
            head_stride: kv.max_seq * cfg.head_dim,
            pos_stride: cfg.head_dim,
        }
    }
}

/// Which logits a prefill returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// After the last token only (`vocab` floats).
    Last,
    /// After every token (`tokens * vocab` floats, position-major): for checking.
    All,
}

struct Kernels {
    embed: Kernel,
    rmsnorm: Kernel,
    rope_kv: Kernel,
    silu_mul: Kernel,
    attention: Kernel,
    qkv_extras: Kernel,
    /// kernels/quant/quant.cu: quantised matrices to bf16, embedding rows of quantised tables.
    dequant: Kernel,
    embed_q: Kernel,
}

/// A chunk's activations, `cap` tokens wide.
struct Buffers {
    cap: usize,
    tokens: CudaSlice<u32>,
    /// The chunk's first position, read by the kernels from here (not passed by value) so
    /// that a captured graph serves a prompt at any position.
    start: CudaSlice<i32>,
    x: CudaSlice<f32>,
    xn: CudaSlice<u16>,
    qkv: CudaSlice<f32>,
    q: CudaSlice<u16>,
    attn: CudaSlice<u16>,
    gu: CudaSlice<f32>,
    act: CudaSlice<u16>,
    logits: CudaSlice<f32>,
}

impl Buffers {
    fn new(gpu: &Gpu, c: &Config, cap: usize) -> Result<Self> {
        let what = |name: &str| format!("prefill {name} for a chunk of {cap} tokens");
        Ok(Self {
            cap,
            tokens: gpu.alloc_zeros(cap, &what("token ids"))?,
            start: gpu.alloc_zeros(1, "prefill start position")?,
            x: gpu.alloc_zeros(cap * c.hidden_size, &what("hidden states"))?,
            xn: gpu.alloc_zeros(
                cap.max(LOGIT_ROWS) * c.hidden_size,
                &what("normed hidden states"),
            )?,
            qkv: gpu.alloc_zeros(cap * (c.q_dim() + 2 * c.kv_dim()), &what("q/k/v"))?,
            q: gpu.alloc_zeros(cap * c.q_dim(), &what("rotated queries"))?,
            attn: gpu.alloc_zeros(cap * c.q_dim(), &what("attention output"))?,
            gu: gpu.alloc_zeros(cap * 2 * c.intermediate_size, &what("gate/up"))?,
            act: gpu.alloc_zeros(cap * c.intermediate_size, &what("MLP activation"))?,
            logits: gpu.alloc_zeros(c.vocab_size, "prefill logits")?,
        })
    }
}

/// What computes the products: cuBLASLt with a plan cached per shape (src/gpu/lt_gemm.rs),
/// or `cublasGemmEx` (`MEGAINFER_PREFILL_GEMM=gemm-ex`), which repeats its setup on the
/// host at every call.
enum Products {
    GemmEx(CudaBlas),
    Lt(std::cell::RefCell<LtGemm>),
}

/// The prefill engine of one sequence: the products' cuBLASLt (or cuBLAS) handle, kernels,
/// chunk buffers (allocated on first use, for the chunk size asked for) and the short prompts'
/// graphs.
pub struct Prefill {
    /// Short prompts' graphs, dropped before the module and buffers they name.
    graphs: Vec<(GraphKey, CudaGraph)>,
    products: Products,
    k: Kernels,
    _module: Arc<CudaModule>,
    attn: AttentionKernel,
    bufs: Option<Buffers>,
    /// The graphs' buffers, GRAPH_MAX_TOKENS wide, never reallocated (the graphs name them).
    graph_bufs: Option<Buffers>,
    /// Whether short prompts run as graphs (`MEGAINFER_PREFILL_GRAPH=0` turns them off).
    use_graphs: bool,
    /// A layer's quantised matrices (or the LM head) decoded to bf16 just before their products
    /// (prefill is compute-bound, so decoding a layer's weights once per chunk costs little);
    /// sized for the largest such set, absent for bf16 models.
    wide: Option<CudaSlice<u16>>,
    /// Where the host's time went in the last `run` (see [`PrefillTiming`]).
    last_timing: Option<PrefillTiming>,
    /// When the last chunk's logits began their copy to the host (set by `logits`).
    copy_started: std::cell::Cell<Option<Instant>>,
}

/// What a captured prefill graph is valid for: its padded length and the cache it writes (the
/// other buffers it names are the engine's own and fixed; a new `wide` drops every graph).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct GraphKey {
    tokens: usize,
    k: u64,
    v: u64,
    max_seq: usize,
    layer_stride: usize,
    head_stride: usize,
    pos_stride: usize,
}

/// The padded length a prompt of `tokens` at position `start` runs as a graph with, if it
/// runs as one: at most GRAPH_MAX_TOKENS in one chunk, and its padding (which writes K/V past
/// the prompt, harmless since every later step writes its position before reading it)
/// inside the cache of `max_seq` positions.
fn graph_bucket(tokens: usize, start: usize, chunk: usize, max_seq: usize) -> Option<usize> {
    if tokens == 0 || tokens > chunk.min(GRAPH_MAX_TOKENS) {
        return None;
    }
    let padded = tokens.next_multiple_of(GRAPH_BUCKET);
    (start + padded <= max_seq).then_some(padded)
}

/// Every padded length [`graph_bucket`] gives some prompt at the start of the cache, in order.
fn graph_buckets(chunk: usize, max_seq: usize) -> Vec<usize> {
    let mut out: Vec<usize> = (1..=chunk.min(GRAPH_MAX_TOKENS))
        .filter_map(|t| graph_bucket(t, 0, chunk, max_seq))
        .collect();
    out.dedup();
    out
}

/// How a graph prefill failed: in its capture (nothing ran; the prompt can go kernel by
/// kernel) or after (the error is the prompt's).
enum GraphError {
    Capture(anyhow::Error),
    Run(anyhow::Error),
}

/// The host's view of one prefill: `enqueued` is the time until every kernel of it was
/// queued (the logits' copy, which waits for the GPU, about to start), `total` the whole call.
/// Where `enqueued` is close to `total`, launching is what the prefill waits for, not the GPU.
#[derive(Clone, Copy, Debug)]
pub struct PrefillTiming {
    pub enqueued: Duration,
    pub total: Duration,
}

/// Whether libcublas can be loaded (cudarc panics on first use when it cannot).
pub fn cublas_present() -> bool {
    // SAFETY: only probes for the shared library.
    unsafe { cb::is_culib_present() }
}

/// The batched prefill's CUBIN for `arch` (from the kernel cache where it was compiled before):
/// one module for every model.
pub fn compile_module(arch: &str) -> Result<Vec<u8>> {
    compile_cubin("prefill", &super::sources::prefill(), arch, &[])
}

impl Prefill {
    pub fn new(gpu: &Gpu, c: &Config) -> Result<Self> {
        if c.head_dim != 64 && c.head_dim != 128 {
            bail!("prefill supports head_dim 64 or 128, not {}", c.head_dim);
        }
        if !cublas_present() {
            bail!(
                "prefill needs cuBLAS: libcublas.so (CUDA 13: libcublas.so.13 and libcublasLt.so.13) \
                 could not be loaded; add the CUDA library directory (e.g. /usr/local/cuda/lib64) \
                 to LD_LIBRARY_PATH"
            );
        }
        let products = match std::env::var("MEGAINFER_PREFILL_GEMM").as_deref() {
            Ok("lt") | Err(_) => Products::Lt(std::cell::RefCell::new(LtGemm::new(gpu)?)),
            Ok("gemm-ex") => Products::GemmEx(
                CudaBlas::new(gpu.stream.clone())
                    .map_err(|e| anyhow!("creating a cuBLAS handle failed: {e:?}"))?,
            ),
            Ok(other) => bail!("MEGAINFER_PREFILL_GEMM must be lt or gemm-ex, not {other:?}"),
        };
        let cubin = compile_module(&gpu.arch())?;
        let module = gpu
            .ctx
            .load_module(Ptx::from_binary(cubin))
            .context("loading the prefill CUBIN")?;
        let attn = AttentionKernel::choose(c.head_dim, &gpu.arch())?;
        let attention = Kernel::load(&module, attn.name)?;
        attention.allow_smem(attn.smem as usize)?;
        let use_graphs = super::switches::switch("MEGAINFER_PREFILL_GRAPH", true)?;
        Ok(Self {
            graphs: Vec::new(),
            products,
            k: Kernels {
                embed: Kernel::load(&module, "pf_embed")?,
                rmsnorm: Kernel::load(&module, "pf_rmsnorm")?,
                rope_kv: Kernel::load(&module, "pf_rope_kv")?,
                silu_mul: Kernel::load(&module, "pf_silu_mul")?,
                attention,
                qkv_extras: Kernel::load(&module, "qkv_extras")?,
                dequant: Kernel::load(&module, "q_dequant_bf16_set")?,
                embed_q: Kernel::load(&module, "q_embed_rows")?,
            },
            _module: module,
            attn,
            bufs: None,
            graph_bufs: None,
            use_graphs,
            wide: None,
            last_timing: None,
            copy_started: std::cell::Cell::new(None),
        })
    }

    /// Where the host's time went in the last prefill, once: a second call, or one after a
    /// feed that took no batched prefill, gets None rather than an older prefill's timing.
    pub fn take_timing(&mut self) -> Option<PrefillTiming> {
        self.last_timing.take()
    }

    /// Runs `tokens` at positions `start..` through the model in chunks of at most `chunk`
    /// tokens, writing their K/V into `kv`; returns the logits `which` asks for.
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &mut self,
        gpu: &Gpu,
        model: &DeviceModel,
        kv: &KvTarget,
        tokens: &[u32],
        start: usize,
        chunk: usize,
        which: Logits,
    ) -> Result<Vec<f32>> {
        let t0 = Instant::now();
        self.copy_started.set(None);
        let c = &model.config;
        if tokens.is_empty() {
            bail!("no tokens to prefill");
        }
        if chunk == 0 {
            bail!("prefill chunk size must be at least 1 token");
        }
        if start + tokens.len() > kv.max_seq {
            bail!(
                "sequence of {} tokens exceeds the context of {} tokens (--max-context)",
                start + tokens.len(),
                kv.max_seq
            );
        }
        crate::model::check_tokens(tokens, c.vocab_size)?;
        self.ensure_wide(gpu, model)?;
        if which == Logits::Last && self.use_graphs {
            if let Some(padded) = graph_bucket(tokens.len(), start, chunk, kv.max_seq) {
                match self.run_graph(gpu, model, kv, tokens, start, padded) {
                    Ok(out) => {
                        self.record_timing(t0);
                        return Ok(out);
                    }
                    // Nothing ran (the capture failed before its graph was launched): the
                    // prompt goes kernel by kernel, as every later one will.
                    Err(GraphError::Capture(e)) => self.give_up_graphs(&e),
                    Err(GraphError::Run(e)) => return Err(e),
                }
            }
        }
        let cap = chunk.min(tokens.len());
        if self.bufs.as_ref().is_none_or(|b| b.cap < cap) {
            self.bufs = None; // free the old chunk buffers before allocating larger ones
            self.bufs = Some(Buffers::new(gpu, c, cap)?);
        }
        // The cache's tensor maps serve every chunk (they name the cache, not a position).
        let maps = if self.attn.tma {
            Some(CacheMaps::new(kv, c, model.layers.len())?)
        } else {
            None
        };
        let mut out = Vec::new();
        let mut pos = start;
        for part in tokens.chunks(chunk) {
            let b = self.bufs.as_mut().expect("allocated above");
            gpu.stream
                .memcpy_htod(part, &mut b.tokens.slice_mut(0..part.len()))?;
            gpu.stream.memcpy_htod(&[pos as i32], &mut b.start)?;
            let b = self.bufs.as_ref().expect("allocated above");
            self.chunk(gpu, model, kv, maps.as_ref(), b, part.len())?;
            pos += part.len();
            match which {
                Logits::All => {
                    for r0 in (0..part.len()).step_by(LOGIT_ROWS) {
                        let n = LOGIT_ROWS.min(part.len() - r0);
                        out.extend(self.logits(gpu, model, b, r0, n)?);
                    }
                }
                Logits::Last if pos == start + tokens.len() => {
                    out = self.logits(gpu, model, b, part.len() - 1, 1)?;
                }
                Logits::Last => {}
            }
        }
        self.record_timing(t0);
        Ok(out)
    }

    /// The host's timing of the prefill call that began at `t0` (see [`PrefillTiming`]).
    fn record_timing(&mut self, t0: Instant) {
        let total = t0.elapsed();
        self.last_timing = Some(PrefillTiming {
            enqueued: self.copy_started.get().map_or(total, |t| t - t0),
            total,
        });
    }

    /// The bf16 scratch for a layer's quantised matrices, sized for the largest such set.
    fn ensure_wide(&mut self, gpu: &Gpu, model: &DeviceModel) -> Result<()> {
        let widest = model
            .layers
            .iter()
            .map(|l| wide_elements(&[&l.w_qkv, &l.wo, &l.w_gu, &l.w_down]))
            .chain([wide_elements(&[model.lm_head()])])
            .max()
            .filter(|&n| n > 0);
        if let Some(n) = widest {
            if self.wide.as_ref().is_none_or(|w| w.len() < n) {
                self.wide = None;
                self.graphs.clear(); // they name the old buffer
                self.wide =
                    Some(gpu.alloc_zeros(n, "prefill's bf16 copy of one quantised weight matrix")?);
            }
        }
        Ok(())
    }

    /// Captures the graph of every length bucket that prompts on `kv` can use (chunks of
    /// `chunk` tokens), so that no prompt pays for a capture. A failed capture turns graphs
    /// off, as in `run`.
    pub fn prepare(
        &mut self,
        gpu: &Gpu,
        model: &DeviceModel,
        kv: &KvTarget,
        chunk: usize,
    ) -> Result<()> {
        if !self.use_graphs {
            return Ok(());
        }
        self.ensure_wide(gpu, model)?;
        self.ensure_graph_bufs(gpu, &model.config)?;
        for padded in graph_buckets(chunk, kv.max_seq) {
            if let Err(e) = self.graph_for(gpu, model, kv, padded) {
                self.give_up_graphs(&e);
                break;
            }
        }
        // What a graph prompt runs after its graph (final norm, the LM head on one row, the
        // copy) is run once here, on the graph buffers' rows, so that the first prompt does not
        // pay for its first use: the one-row product's cuBLASLt plan and the kernels' modules,
        // which load on first launch.
        if self.use_graphs {
            let b = self.graph_bufs.as_ref().expect("allocated above");
            self.logits(gpu, model, b, 0, 1)?;
        }
        Ok(())
    }

    /// After a failed capture (nothing ran): every prompt goes kernel by kernel from now on.
    fn give_up_graphs(&mut self, e: &anyhow::Error) {
        eprintln!("megainfer: prefill graphs unavailable ({e:#}); launching kernel by kernel");
        self.use_graphs = false;
        self.graphs.clear();
    }

    /// The index in `graphs` of the graph for `padded` tokens on `kv`, captured now if there
    /// is none.
    fn graph_for(
        &mut self,
        gpu: &Gpu,
        model: &DeviceModel,
        kv: &KvTarget,
        padded: usize,
    ) -> Result<usize> {
        let key = Self::graph_key(kv, padded);
        if let Some(i) = self.graphs.iter().position(|(k, _)| *k == key) {
            return Ok(i);
        }
        let graph = self.capture(gpu, model, kv, padded)?;
        if self.graphs.len() >= MAX_GRAPHS {
            self.graphs.clear();
        }
        self.graphs.push((key, graph));
        Ok(self.graphs.len() - 1)
    }

    /// The graphs' buffers, made once.
    fn ensure_graph_bufs(&mut self, gpu: &Gpu, c: &Config) -> Result<()> {
        if self.graph_bufs.is_none() {
            self.graph_bufs = Some(Buffers::new(gpu, c, GRAPH_MAX_TOKENS)?);
        }
        Ok(())
    }

    fn graph_key(kv: &KvTarget, padded: usize) -> GraphKey {
        GraphKey {
            tokens: padded,
            k: kv.k,
            v: kv.v,
            max_seq: kv.max_seq,
            layer_stride: kv.layer_stride,
            head_stride: kv.head_stride,
            pos_stride: kv.pos_stride,
        }
    }

    /// A one-chunk prompt of `tokens.len() <= padded` tokens as the graph captured for
    /// `padded` tokens (captured now if this is the first such prompt): the rows past the
    /// prompt compute on stale token ids and are ignored. Returns the last token's logits.
    fn run_graph(
        &mut self,
        gpu: &Gpu,
        model: &DeviceModel,
        kv: &KvTarget,
        tokens: &[u32],
        start: usize,
        padded: usize,
    ) -> std::result::Result<Vec<f32>, GraphError> {
        let upload = |p: &mut Self| -> Result<()> {
            p.ensure_graph_bufs(gpu, &model.config)?;
            let b = p.graph_bufs.as_mut().expect("allocated above");
            gpu.stream
                .memcpy_htod(tokens, &mut b.tokens.slice_mut(0..tokens.len()))?;
            gpu.stream.memcpy_htod(&[start as i32], &mut b.start)?;
            Ok(())
        };
        upload(self).map_err(GraphError::Run)?;
        let i = self
            .graph_for(gpu, model, kv, padded)
            .map_err(GraphError::Capture)?;
        self.graphs[i].1.launch().map_err(|e| {
            GraphError::Run(anyhow!(
                "launching the prefill graph of {padded} tokens: {e}"
            ))
        })?;
        let b = self.graph_bufs.as_ref().expect("allocated above");
        self.logits(gpu, model, b, tokens.len() - 1, 1)
            .map_err(GraphError::Run)
    }

    /// Captures one chunk of `padded` tokens through every layer from the graph buffers.
    fn capture(
        &self,
        gpu: &Gpu,
        model: &DeviceModel,
        kv: &KvTarget,
        padded: usize,
    ) -> Result<CudaGraph> {
        let maps = if self.attn.tma {
            Some(CacheMaps::new(kv, &model.config, model.layers.len())?)
        } else {
            None
        };
        let b = self.graph_bufs.as_ref().expect("allocated by run_graph");
        let s = &gpu.stream;
        // Relaxed: cuBLAS may load a kernel's module on its first use, inside the capture.
        s.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(|e| anyhow!("starting the capture of a prefill graph: {e}"))?;
        let enqueued = self.chunk(gpu, model, kv, maps.as_ref(), b, padded);
        // The capture ends whatever happened, so the stream is usable again.
        let graph = s.end_capture(sys::CUgraphInstantiate_flags(0));
        enqueued.context("capturing the prefill graph")?;
        let graph = graph
            .map_err(|e| anyhow!("instantiating the prefill graph of {padded} tokens: {e}"))?
            .context("the prefill graph's capture was empty")?;
        graph
            .upload()
            .map_err(|e| anyhow!("uploading the prefill graph: {e}"))?;
        Ok(graph)
    }

    /// The matrices `ms` as bf16 operands: a bf16 matrix as it is, the quantised ones decoded
    /// into `wide` one after another by a single launch.
    fn bf16_weights<const N: usize>(&self, gpu: &Gpu, ms: [&DeviceMatrix; N]) -> Result<[u64; N]> {
        const { assert!(N <= DEQUANT_SET_MAX) };
        let mut out = ms.map(|m| m.ptr(gpu));
        let mut set = DequantSet::default();
        let mut offset = 0u64;
        for (i, m) in ms.iter().enumerate() {
            if m.ty == WeightType::Bf16 {
                continue;
            }
            if m.cols % 32 != 0 {
                bail!(
                    "prefill: a quantised matrix of {} columns (not whole 32-element blocks)",
                    m.cols
                );
            }
            let wide = self
                .wide
                .as_ref()
                .context("prefill: no buffer for quantised weights")?;
            out[i] = ptr(wide, &gpu.stream) + 2 * offset;
            let k = set.n as usize;
            set.data[k] = m.ptr(gpu);
            set.out[k] = out[i];
            set.rows[k] = m.rows as i64;
            set.ty[k] = m.type_code();
            set.cols[k] = m.cols as i32;
            set.n += 1;
            offset += wide_span(m) as u64;
        }
        if set.n > 0 {
            // A thread per 32-element block.
            let blocks: i64 = (0..set.n as usize)
                .map(|k| set.rows[k] * (set.cols[k] / 32) as i64)
                .sum();
            let grid = (blocks as u64)
                .div_ceil(DEQUANT_THREADS as u64)
                .min(1 << 20) as u32;
            // SAFETY: the argument is q_dequant_bf16_set's QDequantSet in kernels/quant/quant.cu
            // (same layout, repr(C)); each data pointer holds its matrix's rows x cols elements
            // and each output span lies in `wide`, sized in run for the largest set.
            unsafe {
                self.k.dequant.launch(
                    &gpu.stream,
                    grid,
                    DEQUANT_THREADS,
                    0,
                    false,
                    &mut kargs![&set],
                )
            }?;
        }
        Ok(out)
    }

    /// `y[t, :] (+)= x[t, :] · W^T` for `t` rows: W `[n, k]` bf16 row-major, x `[t, k]` bf16,
    /// y `[t, n]` f32 (`accumulate` adds to it).
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        w: u64,
        x: u64,
        y: u64,
        n: usize,
        k: usize,
        t: usize,
        accumulate: bool,
    ) -> Result<()> {
        let blas = match &self.products {
            Products::GemmEx(blas) => blas,
            Products::Lt(lt) => return lt.borrow_mut().gemm(w, x, y, n, k, t, accumulate),
        };
        let alpha = 1f32;
        let beta = if accumulate { 1f32 } else { 0f32 };
        // Column-major view: y^T [n, t] = W [n, k] (W^T read as k x n) * x^T [k, t].
        // SAFETY: the pointers are live device buffers of the sizes given (checked by the
        // callers' allocation); alpha and beta are host values (default pointer mode).
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *blas.handle(),
                cb::cublasOperation_t::CUBLAS_OP_T,
                cb::cublasOperation_t::CUBLAS_OP_N,
                n as i32,
                t as i32,
                k as i32,
                &alpha as *const f32 as *const c_void,
                w as *const c_void,
                cb::cudaDataType::CUDA_R_16BF,
                k as i32,
                x as *const c_void,
                cb::cudaDataType::CUDA_R_16BF,
                k as i32,
                &beta as *const f32 as *const c_void,
                y as *mut c_void,
                cb::cudaDataType::CUDA_R_32F,
                n as i32,
                cb::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cb::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| anyhow!("cuBLAS GEMM ({t} x {k} by {n} x {k}) failed: {e:?}"))
    }

    #[allow(clippy::too_many_arguments)]
    fn rmsnorm(
        &self,
        gpu: &Gpu,
        x: u64,
        w: u64,
        out: u64,
        n: usize,
        first: usize,
        rows: usize,
        eps: f32,
    ) -> Result<()> {
        let (n, first) = (n as i32, first as i32);
        // SAFETY: the arguments are pf_rmsnorm's parameters in kernels/prefill/prefill.cu, in
        // order, and every pointer is a live buffer of this engine or of the model, sized for the chunk.
        unsafe {
            self.k.rmsnorm.launch(
                &gpu.stream,
                rows as u32,
                NORM_THREADS,
                0,
                false,
                &mut kargs![&x, &w, &out, &n, &eps, &first],
            )
        }
    }

    /// One chunk through every layer; its final hidden states stay in `x`.
    fn chunk(
        &self,
        gpu: &Gpu,
        model: &DeviceModel,
        kv: &KvTarget,
        maps: Option<&CacheMaps>,
        b: &Buffers,
        t: usize,
    ) -> Result<()> {
        let c = &model.config;
        let s = &gpu.stream;
        let (h, qd, kvd, inter) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        let (tokens_p, x, xn, qkv, q, attn, gu, act) = (
            ptr(&b.tokens, s),
            ptr(&b.x, s),
            ptr(&b.xn, s),
            ptr(&b.qkv, s),
            ptr(&b.q, s),
            ptr(&b.attn, s),
            ptr(&b.gu, s),
            ptr(&b.act, s),
        );
        let (hid, eps) = (h as i32, c.rms_norm_eps);
        let em = &model.embed;
        if em.ty == WeightType::Bf16 {
            // SAFETY: the arguments are pf_embed's parameters in kernels/prefill/prefill.cu, in
            // order, and every pointer is a live buffer of this engine or of the model, sized for the chunk.
            unsafe {
                self.k.embed.launch(
                    s,
                    t as u32,
                    256,
                    0,
                    false,
                    &mut kargs![&em.ptr(gpu), &tokens_p, &x, &hid],
                )
            }?;
        } else {
            let (ty, data) = (em.type_code(), em.ptr(gpu));
            // SAFETY: the arguments are q_embed_rows's parameters in kernels/quant/quant.cu, in
            // order, and every pointer is a live buffer of this engine or of the model, sized
            // for the chunk.
            unsafe {
                self.k.embed_q.launch(
                    s,
                    t as u32,
                    256,
                    0,
                    false,
                    &mut kargs![&ty, &data, &tokens_p, &x, &hid],
                )
            }?;
        }
        let inv_freq = ptr(&model.inv_freq, s);
        let (nh, nkv, hd) = (c.num_heads as i32, c.num_kv_heads as i32, c.head_dim as i32);
        let (start_p, t_i) = (ptr(&b.start, s), t as i32);
        let (pos_stride, head_stride) = (kv.pos_stride as i64, kv.head_stride as i64);
        let scale_log2 = std::f32::consts::LOG2_E / (c.head_dim as f32).sqrt();
        let rope_parts = ROPE_PARTS as i32;
        let silu_parts = inter.div_ceil(SILU_COLUMNS_PER_BLOCK);
        let silu_parts_i = silu_parts as i32;
        let att_grid = (t.div_ceil(self.attn.rows() as usize) * c.num_heads) as u32;
        for (l, lw) in model.layers.iter().enumerate() {
            let off = (l * kv.layer_stride * 2) as u64;
            let (kc, vc) = (kv.k + off, kv.v + off);
            self.rmsnorm(gpu, x, ptr(&lw.attn_norm, s), xn, h, 0, t, eps)?;
            let [w_qkv, wo, w_gu, w_down] =
                self.bf16_weights(gpu, [&lw.w_qkv, &lw.wo, &lw.w_gu, &lw.w_down])?;
            self.gemm(w_qkv, xn, qkv, qd + 2 * kvd, h, t, false)?;
            enqueue_qkv_extras(&self.k.qkv_extras, gpu, c, lw, qkv, t, false)?;
            // SAFETY: the arguments are pf_rope_kv's parameters in kernels/prefill/prefill.cu, in
            // order, and every pointer is a live buffer of this engine or of the model, sized for the chunk.
            unsafe {
                self.k.rope_kv.launch(
                    s,
                    (t * ROPE_PARTS) as u32,
                    256,
                    0,
                    false,
                    &mut kargs![
                        &qkv,
                        &q,
                        &kc,
                        &vc,
                        &inv_freq,
                        &start_p,
                        &nh,
                        &nkv,
                        &hd,
                        &pos_stride,
                        &head_stride,
                        &rope_parts
                    ],
                )
            }?;
            let (layer, pos_dim) = (l as i32, maps.map_or(0, |m| m.pos_dim));
            let mut args = match maps {
                // pf_attention_tma_{64,128} (kernels/prefill/attention_wgmma.cuh): the tensor
                // maps by value (128 bytes each, as CUtensorMap), describing the live cache `kv`.
                Some(m) => kargs![
                    &q,
                    &m.k,
                    &m.v,
                    &layer,
                    &pos_dim,
                    &attn,
                    &t_i,
                    &start_p,
                    &nh,
                    &nkv,
                    &scale_log2
                ],
                // pf_attention_{64,128} (kernels/prefill/prefill.cu).
                None => kargs![
                    &q,
                    &kc,
                    &vc,
                    &attn,
                    &t_i,
                    &start_p,
                    &nh,
                    &nkv,
                    &pos_stride,
                    &head_stride,
                    &scale_log2
                ],
            };
            // SAFETY: `args` are the chosen kernel's parameters, in order, each a live local;
            // q, attn and the cache are live buffers of this engine or of the model, sized for
            // the chunk.
            unsafe {
                self.k.attention.launch(
                    s,
                    att_grid,
                    self.attn.threads(),
                    self.attn.smem,
                    false,
                    &mut args,
                )
            }?;
            self.gemm(wo, attn, x, h, qd, t, true)?;
            self.rmsnorm(gpu, x, ptr(&lw.ffn_norm, s), xn, h, 0, t, eps)?;
            self.gemm(w_gu, xn, gu, 2 * inter, h, t, false)?;
            let inter_i = inter as i32;
            // SAFETY: the arguments are pf_silu_mul's parameters in kernels/prefill/prefill.cu, in
            // order, and every pointer is a live buffer of this engine or of the model, sized for the chunk.
            unsafe {
                self.k.silu_mul.launch(
                    s,
                    (t * silu_parts) as u32,
                    SILU_THREADS,
                    0,
                    false,
                    &mut kargs![&gu, &act, &inter_i, &silu_parts_i],
                )
            }?;
            self.gemm(w_down, act, x, h, inter, t, true)?;
        }
        Ok(())
    }

    /// Logits after rows `first..first + n` of the last chunk (final norm, then the LM head).
    fn logits(
        &self,
        gpu: &Gpu,
        model: &DeviceModel,
        b: &Buffers,
        first: usize,
        n: usize,
    ) -> Result<Vec<f32>> {
        let c = &model.config;
        let s = &gpu.stream;
        let (x, xn) = (ptr(&b.x, s), ptr(&b.xn, s));
        self.rmsnorm(
            gpu,
            x,
            ptr(&model.final_norm, s),
            xn,
            c.hidden_size,
            first,
            n,
            c.rms_norm_eps,
        )?;
        if n == 1 {
            self.gemm(
                self.bf16_weights(gpu, [model.lm_head()])?[0],
                xn,
                ptr(&b.logits, s),
                c.vocab_size,
                c.hidden_size,
                1,
                false,
            )?;
            self.copy_started.set(Some(Instant::now()));
            return Ok(s.clone_dtoh(&b.logits)?);
        }
        let logits =
            gpu.alloc_zeros::<f32>(n * c.vocab_size, "prefill logits of every position")?;
        self.gemm(
            self.bf16_weights(gpu, [model.lm_head()])?[0],
            xn,
            ptr(&logits, s),
            c.vocab_size,
            c.hidden_size,
            n,
            false,
        )?;
        self.copy_started.set(Some(Instant::now()));
        Ok(s.clone_dtoh(&logits)?)
    }
}

/// The prefill's attention kernel: which one, its block and its shared memory (mirrors
/// kernels/prefill/prefill.cu and attention_wgmma.cuh).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionKernel {
    pub name: &'static str,
    /// Warps per block; every kernel gives each warp 16 query rows.
    pub warps: u32,
    pub smem: u32,
    /// Reads K and V through tensor maps of the cache (the bulk tensor copy engine).
    pub tma: bool,
}

impl AttentionKernel {
    /// The warpgroup (wgmma) kernel fed by the bulk tensor copy engine where the device has
    /// them (Hopper, `sm_90a`), the mma.sync kernel elsewhere; `MEGAINFER_PREFILL_ATTENTION`
    /// = `tma` or `mma` picks one, to compare them on one machine.
    pub fn choose(head_dim: usize, arch: &str) -> Result<Self> {
        let hopper = arch == "sm_90a";
        let tma = match std::env::var("MEGAINFER_PREFILL_ATTENTION")
            .unwrap_or_default()
            .as_str()
        {
            "" | "auto" => hopper,
            "tma" if hopper => true,
            "tma" => {
                bail!("MEGAINFER_PREFILL_ATTENTION=tma needs an sm_90a device (Hopper), not {arch}")
            }
            "mma" => false,
            other => bail!("MEGAINFER_PREFILL_ATTENTION must be auto, tma or mma, not {other:?}"),
        };
        Ok(Self::new(head_dim, tma))
    }

    /// The kernel for `head_dim` (64 or 128), as kernels/prefill instantiates them.
    pub fn new(head_dim: usize, tma: bool) -> Self {
        let wide = head_dim == 128;
        match (tma, wide) {
            // Two warpgroups of 64 rows; 4 stages of a K and a V tile, 1 KiB to align them
            // to the 128-byte swizzle's 1024-byte period, and the stages' mbarriers.
            (true, false) => Self::tma("pf_attention_tma_64", 64),
            (true, true) => Self::tma("pf_attention_tma_128", 128),
            // 16 query rows a warp; two buffers of a K and a V tile with padded rows.
            (false, false) => Self::mma("pf_attention_64", 8, 64),
            (false, true) => Self::mma("pf_attention_128", 4, 128),
        }
    }

    /// Query rows per block.
    pub fn rows(&self) -> u32 {
        16 * self.warps
    }

    pub fn threads(&self) -> u32 {
        32 * self.warps
    }

    fn mma(name: &'static str, warps: u32, head_dim: usize) -> Self {
        Self {
            name,
            warps,
            smem: (4 * BK * (head_dim + 8) * 2) as u32,
            tma: false,
        }
    }

    fn tma(name: &'static str, head_dim: usize) -> Self {
        const STAGES: usize = 4;
        Self {
            name,
            warps: 8,
            smem: (STAGES * 2 * BK * head_dim * 2 + 1024 + 8 * STAGES) as u32,
            tma: true,
        }
    }
}

/// Tensor maps of a K/V cache for the bulk tensor copy engine: 4-D (head_dim, then position and
/// KV head in the order of their strides, then layer), boxes of one 64-column half of `BK`
/// positions, 128-byte swizzled (the layout wgmma reads), positions past the cache zero-filled.
struct CacheMaps {
    k: sys::CUtensorMap,
    v: sys::CUtensorMap,
    /// Which coordinate (1 or 2) is the position.
    pos_dim: i32,
}

impl CacheMaps {
    /// `c.head_dim` is 64 or 128 (Prefill::new refuses others): whole 64-column boxes.
    fn new(kv: &KvTarget, c: &Config, layers: usize) -> Result<Self> {
        let (pos, head) = (
            (kv.max_seq as u64, kv.pos_stride as u64),
            (c.num_kv_heads as u64, kv.head_stride as u64),
        );
        let (pos_dim, (d1, d2)) = if kv.pos_stride <= kv.head_stride {
            (1, (pos, head))
        } else {
            (2, (head, pos))
        };
        let dims = [c.head_dim as u64, d1.0, d2.0, layers as u64];
        let strides = [d1.1 * 2, d2.1 * 2, kv.layer_stride as u64 * 2];
        let rows = BK as u32;
        let boxes = [
            64,
            if pos_dim == 1 { rows } else { 1 },
            if pos_dim == 2 { rows } else { 1 },
            1,
        ];
        Ok(Self {
            k: encode_map(kv.k, &dims, &strides, &boxes).context("tensor map of the K cache")?,
            v: encode_map(kv.v, &dims, &strides, &boxes).context("tensor map of the V cache")?,
            pos_dim,
        })
    }
}

fn encode_map(
    base: u64,
    dims: &[u64; 4],
    strides: &[u64; 3],
    boxes: &[u32; 4],
) -> Result<sys::CUtensorMap> {
    let mut map = sys::CUtensorMap { opaque: [0; 16] };
    let ones = [1u32; 4];
    // SAFETY: every pointer refers to a live local array of the length the rank (4) asks for;
    // the map is written by the driver and only read on the device while `base` (a cache
    // allocation of this engine) lives.
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            4,
            base as *mut c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            ones.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        bail!("cuTensorMapEncodeTiled failed ({r:?}): dims {dims:?}, byte strides {strides:?}, box {boxes:?}");
    }
    Ok(map)
}

#[cfg(test)]
mod tests {
    use super::{graph_bucket, graph_buckets, AttentionKernel, DequantSet};

    #[test]
    fn short_prompts_pad_to_their_bucket_inside_the_cache() {
        assert_eq!(graph_bucket(1, 0, 8192, 8192), Some(16));
        assert_eq!(graph_bucket(37, 0, 8192, 8192), Some(48));
        assert_eq!(graph_bucket(37, 500, 8192, 8192), Some(48));
        assert_eq!(graph_bucket(128, 0, 8192, 8192), Some(128));
        assert_eq!(
            graph_bucket(129, 0, 8192, 8192),
            None,
            "over GRAPH_MAX_TOKENS"
        );
        assert_eq!(graph_bucket(37, 0, 20, 8192), None, "more than one chunk");
        assert_eq!(graph_bucket(0, 0, 8192, 8192), None);
        // The padding must stay inside the cache: 9 tokens at 75 pad to 16, up to 91.
        assert_eq!(graph_bucket(9, 75, 8192, 90), None);
        assert_eq!(graph_bucket(9, 75, 8192, 91), Some(16));
    }

    #[test]
    fn every_bucket_a_prompt_can_use_is_listed() {
        let all: Vec<usize> = (1..=8).map(|i| 16 * i).collect();
        assert_eq!(graph_buckets(8192, 8192), all);
        assert_eq!(graph_buckets(20, 8192), vec![16, 32]);
        assert_eq!(graph_buckets(8192, 40), vec![16, 32]);
        assert_eq!(graph_buckets(8192, 8), Vec::<usize>::new());
    }
    use std::mem::{offset_of, size_of};

    /// The H100's shared memory per SM (228 KiB) less the 1 KiB each block reserves, and the
    /// opt-in limit of one block.
    const SM_SMEM: u32 = 228 * 1024;
    const BLOCK_SMEM: u32 = 232_448;

    #[test]
    fn attention_kernels_fit_their_blocks_per_sm() {
        // tma_64 is built for two blocks per SM (launch bounds), the others for one.
        for (head_dim, tma, blocks) in [
            (64, true, 2),
            (128, true, 1),
            (64, false, 2),
            (128, false, 1),
        ] {
            let k = AttentionKernel::new(head_dim, tma);
            assert!(k.smem <= BLOCK_SMEM, "{}: {} B", k.name, k.smem);
            assert!(
                blocks * (k.smem + 1024) <= SM_SMEM,
                "{}: {blocks} x {} B",
                k.name,
                k.smem
            );
            assert_eq!(k.rows() % 64, 0, "{}", k.name);
        }
    }

    /// DequantSet is passed by value as kernels/quant/quant.cu's QDequantSet: four pointers,
    /// four pointers, four long longs, four ints, four ints, an int, padded to 8 bytes.
    #[test]
    fn dequant_set_matches_the_kernels_struct() {
        assert_eq!(offset_of!(DequantSet, data), 0);
        assert_eq!(offset_of!(DequantSet, out), 32);
        assert_eq!(offset_of!(DequantSet, rows), 64);
        assert_eq!(offset_of!(DequantSet, ty), 96);
        assert_eq!(offset_of!(DequantSet, cols), 112);
        assert_eq!(offset_of!(DequantSet, n), 128);
        assert_eq!(size_of::<DequantSet>(), 136);
    }
}

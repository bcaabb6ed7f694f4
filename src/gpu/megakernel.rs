//! The megakernel path: a scheduler `Schedule` lowered to the interpreter's words, device
//! buffers for every activation, and one persistent launch per decode step.

use std::ffi::c_void;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use cudarc::driver::sys::{self, CUlaunchAttributeID};
use cudarc::driver::{CudaModule, CudaSlice};
use cudarc::nvrtc::Ptx;
use scheduler::{Op, Schedule};

use super::compile::compile_cubin;
use super::device::{ptr, Gpu};
use super::launch::Kernel;
use super::model::{DeviceModel, KvCache};
use super::sources;
use super::stepping::{self, Sequence, Steps};

// Mirrors megakernel/megakernel.cu.
const WORDS: usize = scheduler::WORDS_PER_INSTR;
const CONSUMER_WARPS: usize = 8;
const THREADS: u32 = (CONSUMER_WARPS as u32 + 1) * 32;
const RES_MAX: usize = 2048;
const TILE_GROUPS: usize = CONSUMER_WARPS / 2;
const PAGE_BYTES: usize = 16384;
/// Profile words per instruction (PROF_WORDS in runtime.cuh).
const PROF_WORDS: usize = 6;
/// A wait for an input longer than this is a scheduling bug: the kernel stops and reports it.
const DEFAULT_WAIT_TIMEOUT_MS: u64 = 2000;
/// Tags are epoch + 1 in 32 bits: before they would wrap, the tagged arena is cleared and the
/// epoch restarts.
const MAX_EPOCH: u32 = u32::MAX - 1;

#[repr(C)]
#[derive(Clone, Copy)]
struct MkParams {
    instrs: u64,
    sm_offsets: u64,
    error: u64,
    progress: u64,
    profile: u64,
    meta: u64,
    history: u64,
    layers: u64,
    embed: u64,
    final_norm: u64,
    lm_head: u64,
    inv_freq: u64,
    k_cache: u64,
    v_cache: u64,
    resid_attn: u64,
    mlp_part: u64,
    q: u64,
    kv_new: u64,
    attn_out: u64,
    attn_part: u64,
    act: u64,
    lm_best: u64,
    logits: u64,
    hidden: i32,
    inter: i32,
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
    vocab: i32,
    n_layers: i32,
    chunks: i32,
    max_seq: i32,
    n_lm: i32,
    xs_floats: i32,
    pages: i32,
    eps: f32,
    epoch: u32,
    timeout_ns: u64,
}

pub struct MegakernelPath<'g> {
    gpu: &'g Gpu,
    model: &'g DeviceModel,
    kernel: Kernel,
    _module: Arc<CudaModule>,
    params: MkParams,
    smem: u32,
    pub instructions: usize,
    words: CudaSlice<u32>,
    _sm_offsets: CudaSlice<u32>,
    error: CudaSlice<u32>,
    progress: CudaSlice<u32>,
    sm_offsets: Vec<u32>,
    meta: CudaSlice<u32>,
    history: CudaSlice<u32>,
    logits: CudaSlice<f32>,
    /// Every tagged activation buffer, one after the other (see `Arena`).
    arena: CudaSlice<u64>,
    arena_layout: Arena,
    _layers: CudaSlice<u64>,
    _kv: KvCache,
    seq: Sequence,
    /// Per encoded position: the instruction, for error messages.
    descs: Vec<String>,
    kinds: Vec<&'static str>,
}

/// Offsets (in 64-bit words) of the tagged buffers in one allocation, so that the kernel can
/// name a stuck element by its offset and one memset clears them all.
struct Arena {
    parts: Vec<(&'static str, usize)>,
    len: usize,
}

impl Arena {
    fn new(sizes: &[(&'static str, usize)]) -> Self {
        let mut len = 0;
        let parts = sizes
            .iter()
            .map(|&(name, n)| {
                let start = len;
                len += n;
                (name, start)
            })
            .collect();
        Arena { parts, len }
    }

    fn offset(&self, name: &str) -> usize {
        self.parts
            .iter()
            .find(|p| p.0 == name)
            .map(|p| p.1)
            .expect("arena part")
    }

    /// `buffer[element]` for an offset.
    fn element(&self, offset: usize) -> String {
        match self.parts.iter().rev().find(|p| p.1 <= offset) {
            Some((name, start)) => format!("{name}[{}]", offset - start),
            None => format!("arena[{offset}]"),
        }
    }
}

/// Where one decode step's time went, per instruction type (from `MegakernelPath::profile`).
pub struct Profile {
    /// Launch start (first instruction's start) to the last instruction's end, µs.
    pub step_us: f64,
    /// (type, count per step, mean µs [waiting for inputs and preparing, weight tiles (for
    /// Attention: its computation), storing], busy µs per SM: the type's instruction time
    /// summed / SM count)
    pub rows: Vec<(&'static str, usize, [f64; 3], f64)>,
    /// With `timeline`: every instruction of every profiled step as CSV (ns from the step's
    /// first start).
    pub timeline: Option<String>,
}

impl std::fmt::Display for Profile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "megakernel step: {:.1} µs from the first instruction's start to the last one's end",
            self.step_us
        )?;
        writeln!(
            f,
            "| instruction | count | inputs + prepare µs | tiles (attention: compute) µs | store µs | busy µs per SM |"
        )?;
        writeln!(f, "| --- | ---: | ---: | ---: | ---: | ---: |")?;
        for (k, n, [p, t, c], b) in &self.rows {
            writeln!(f, "| {k} | {n} | {p:.2} | {t:.2} | {c:.2} | {b:.1} |")?;
        }
        Ok(())
    }
}

/// Floats of shared memory the attention instruction uses (the layout at the top of
/// megakernel/ops/attention.cuh): scores for a round of 256 staged positions and this token's,
/// each consumer warp's partial output, the running output, the queries, this token's K and V
/// rows, and three numbers per head.
fn attention_scratch(group: usize, head_dim: usize) -> usize {
    const ROUND_STRIDE: usize = 256 + 4;
    group * ROUND_STRIDE + (CONSUMER_WARPS + 2) * group * head_dim + 2 * head_dim + 3 * group
}

impl<'g> MegakernelPath<'g> {
    pub fn new(
        gpu: &'g Gpu,
        model: &'g DeviceModel,
        schedule: &Schedule,
        max_seq: usize,
    ) -> Result<Self> {
        let c = &model.config;
        if schedule.streams.len() != gpu.sm_count {
            bail!(
                "schedule built for {} SMs, the GPU has {}",
                schedule.streams.len(),
                gpu.sm_count
            );
        }
        let attention_scratch = attention_scratch(c.num_heads / c.num_kv_heads, c.head_dim);
        if attention_scratch > 16384 {
            bail!(
                "megakernel: {} query heads per KV head at head_dim {} need {attention_scratch} floats of attention scratch; at most 16384 fit",
                c.num_heads / c.num_kv_heads,
                c.head_dim
            );
        }
        let enc = schedule.encode();
        let mut descs = Vec::new();
        let mut kinds = Vec::new();
        let mut max_cols = c.hidden_size.max(c.q_dim());
        for &k in schedule.streams.iter().flatten() {
            let i = &schedule.instrs[k as usize];
            descs.push(schedule.describe(k as usize));
            kinds.push(i.op.kind().name());
            let rows = match i.op {
                Op::RmsQkvRope { pair_count, .. } => 2 * pair_count as usize,
                Op::RmsUpGateSilu { row_count, .. } => 2 * row_count as usize,
                Op::OProjResidual { row_count, .. } | Op::RmsLmHead { row_count, .. } => {
                    row_count as usize
                }
                Op::DownProjResidual {
                    row_count,
                    col_count,
                    ..
                } => {
                    max_cols = max_cols.max(col_count as usize);
                    row_count as usize
                }
                _ => 0,
            };
            // O-proj keeps its residual rows in the second half of the row buffer.
            let limit = if matches!(i.op, Op::OProjResidual { .. }) {
                RES_MAX / 2
            } else {
                RES_MAX
            };
            if rows > limit {
                bail!(
                    "schedule: {:?} computes {rows} rows; the megakernel holds at most {limit}",
                    i.op
                );
            }
        }
        if max_cols * 2 > PAGE_BYTES {
            bail!("schedule: a weight row segment of {max_cols} columns does not fit a {PAGE_BYTES}-byte page");
        }
        let (words, offsets) = (enc.words, enc.sm_offsets);
        let (n_lm, parts, chunks) = (
            enc.lm_blocks as usize,
            enc.attn_parts as usize,
            enc.down_chunks as usize,
        );
        let instructions = words.len() / WORDS;
        let xs_floats = max_cols.max(attention_scratch).next_multiple_of(4);
        // Extra NVRTC options (e.g. `-DMK_INFLIGHT_STREAM=3`), for measuring variants.
        let mut defines = sources::megakernel_defines(c);
        if let Ok(v) = std::env::var("MEGAINFER_MK_DEFINES") {
            defines.extend(v.split_whitespace().map(String::from));
        }
        let cubin = compile_cubin("megakernel", &sources::megakernel(), &gpu.arch(), &defines)?;
        let module = gpu
            .ctx
            .load_module(Ptx::from_binary(cubin))
            .context("loading the megakernel CUBIN")?;
        let kernel = Kernel::load(&module, "megakernel")?;
        // Mirrors the shared-memory layout at the top of megakernel.cu: xs, res, red, the RMS
        // sums of squares, two instructions' words, the layer pointer table; then the kernel's
        // static flags.
        let fixed = (xs_floats + 2 * RES_MAX + 3 * CONSUMER_WARPS + 2 * WORDS) * 4
            + c.num_layers * std::mem::size_of::<[u64; 6]>();
        let static_smem = kernel.static_smem()?;
        // A multiple of TILE_GROUPS, so each page is always consumed by the same warp group
        // (see TILE_GROUPS in runtime.cuh).
        let pages = (gpu.max_smem_per_block.saturating_sub(fixed + static_smem))
            / (PAGE_BYTES + 16)
            / TILE_GROUPS
            * TILE_GROUPS;
        if pages < TILE_GROUPS {
            bail!(
                "megakernel: {} B of shared memory per block leaves {pages} pages; at least {TILE_GROUPS} are needed",
                gpu.max_smem_per_block
            );
        }
        let smem = (pages * PAGE_BYTES + fixed + pages * 16) as u32;
        kernel.allow_smem(smem as usize)?;
        let occ = kernel.occupancy(THREADS, smem as usize)?;
        if occ < 1 {
            bail!("megakernel: a CTA of {THREADS} threads and {smem} B shared memory does not fit on an SM");
        }

        let s = &gpu.stream;
        let (l, h, qd) = (c.num_layers, c.hidden_size, c.q_dim());
        // resid_attn first: the kernel reports a stuck element by its offset from there.
        let arena = Arena::new(&[
            ("resid_attn", l * h),
            ("mlp_part", l * chunks * h),
            ("q", l * qd),
            ("kv_new", l * 2 * c.kv_dim()),
            ("attn_out", l * qd),
            ("attn_part", l * c.num_heads * parts * (c.head_dim + 2)),
            ("act", l * c.intermediate_size),
            ("lm_best", 2 * n_lm.max(1)),
        ]);
        let arena_d = gpu.alloc_zeros::<u64>(arena.len, "tagged activations")?;
        let base = ptr(&arena_d, s);
        let at = |name: &str| base + 8 * arena.offset(name) as u64;
        let logits = gpu.alloc_zeros::<f32>(c.vocab_size, "logits")?;
        let layer_ptrs: Vec<u64> = model
            .layers
            .iter()
            .flat_map(|lw| {
                [
                    &lw.attn_norm,
                    &lw.w_qkv,
                    &lw.wo,
                    &lw.ffn_norm,
                    &lw.w_gu,
                    &lw.w_down,
                ]
                .map(|b| ptr(b, s))
            })
            .collect();
        let layers = gpu.upload(&layer_ptrs, "layer pointer table")?;
        let kv = KvCache::new(gpu, c, max_seq)?;
        let words_d = gpu.upload(&words, "instruction streams")?;
        let offsets_d = gpu.upload(&offsets, "stream offsets")?;
        let offsets_host = offsets.clone();
        let error = gpu.alloc_zeros::<u32>(8, "error word")?;
        let progress = gpu.alloc_zeros::<u32>(4 * gpu.sm_count, "progress words")?;
        let meta = gpu.alloc_zeros::<u32>(8, "token meta")?;
        let history = gpu.alloc_zeros::<u32>(max_seq + 1, "token history")?;
        let params = MkParams {
            instrs: ptr(&words_d, s),
            sm_offsets: ptr(&offsets_d, s),
            error: ptr(&error, s),
            progress: ptr(&progress, s),
            profile: 0,
            meta: ptr(&meta, s),
            history: ptr(&history, s),
            layers: ptr(&layers, s),
            embed: ptr(&model.embed, s),
            final_norm: ptr(&model.final_norm, s),
            lm_head: model.lm_head_ptr(gpu),
            inv_freq: ptr(&model.inv_freq, s),
            k_cache: ptr(&kv.k, s),
            v_cache: ptr(&kv.v, s),
            resid_attn: at("resid_attn"),
            mlp_part: at("mlp_part"),
            q: at("q"),
            kv_new: at("kv_new"),
            attn_out: at("attn_out"),
            attn_part: at("attn_part"),
            act: at("act"),
            lm_best: at("lm_best"),
            logits: ptr(&logits, s),
            hidden: h as i32,
            inter: c.intermediate_size as i32,
            heads: c.num_heads as i32,
            kv_heads: c.num_kv_heads as i32,
            head_dim: c.head_dim as i32,
            vocab: c.vocab_size as i32,
            n_layers: l as i32,
            chunks: chunks as i32,
            max_seq: max_seq as i32,
            n_lm: n_lm as i32,
            xs_floats: xs_floats as i32,
            pages: pages as i32,
            eps: c.rms_norm_eps,
            epoch: 0,
            timeout_ns: DEFAULT_WAIT_TIMEOUT_MS * 1_000_000,
        };
        Ok(Self {
            gpu,
            model,
            kernel,
            _module: module,
            params,
            smem,
            instructions,
            words: words_d,
            _sm_offsets: offsets_d,
            error,
            progress,
            sm_offsets: offsets_host,
            meta,
            history,
            logits,
            arena: arena_d,
            arena_layout: arena,
            _layers: layers,
            _kv: kv,
            seq: Sequence::new(max_seq),
            descs,
            kinds,
        })
    }

    /// Runs `steps` greedy steps from `token` with per-instruction timestamps (globaltimer)
    /// and returns the mean breakdown per instruction type (and, with `timeline`, every stamp).
    pub fn profile(&mut self, token: u32, steps: usize, timeline: bool) -> Result<Profile> {
        let n = self.instructions;
        let buf = self
            .gpu
            .alloc_zeros::<u64>(n * PROF_WORDS, "profile buffer")?;
        self.params.profile = ptr(&buf, &self.gpu.stream);
        let mut sums: std::collections::BTreeMap<&'static str, (usize, [f64; 4])> =
            Default::default();
        let mut step_us = 0.0;
        let mut result = Ok(());
        let mut t = token;
        let mut csv = timeline.then(|| {
            // extra1, extra2: a mat-vec's first page wait and last tile issued by the loader;
            // attention's scores and softmax done, and its weighted values done (last round).
            String::from("step,pos,sm,kind,desc,start,prepared,tiles,stored,extra1,extra2\n")
        });
        let sm_of: Vec<usize> = (0..n)
            .map(|pos| self.sm_offsets.partition_point(|&o| o as usize <= pos) - 1)
            .collect();
        for step in 0..steps {
            match self.decode_greedy(t, 1) {
                Ok(v) => t = v[0],
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
            let p = self.gpu.stream.clone_dtoh(&buf)?;
            let start = (0..n).map(|i| p[i * PROF_WORDS]).min().unwrap_or(0);
            let end = (0..n).map(|i| p[i * PROF_WORDS + 3]).max().unwrap_or(0);
            step_us += (end - start) as f64 / 1e3;
            for i in 0..n {
                let r = &p[i * PROF_WORDS..(i + 1) * PROF_WORDS];
                if let Some(csv) = &mut csv {
                    let times: Vec<String> = r
                        .iter()
                        .map(|&x| x.saturating_sub(start).to_string())
                        .collect();
                    *csv += &format!(
                        "{step},{i},{},{},\"{}\",{}\n",
                        sm_of[i],
                        self.kinds[i],
                        self.descs[i],
                        times.join(",")
                    );
                }
                let e = sums.entry(self.kinds[i]).or_default();
                e.0 += 1;
                for k in 0..3 {
                    e.1[k] += r[k + 1].saturating_sub(r[k]) as f64 / 1e3;
                }
                e.1[3] += r[3].saturating_sub(r[0]) as f64 / 1e3;
            }
        }
        self.params.profile = 0;
        result?;
        let sms = (self.sm_offsets.len() - 1) as f64;
        let rows = sums
            .into_iter()
            .map(|(k, (c, s))| {
                let m = |x: f64| x / c as f64;
                (
                    k,
                    c / steps,
                    [m(s[0]), m(s[1]), m(s[2])],
                    s[3] / steps as f64 / sms,
                )
            })
            .collect();
        Ok(Profile {
            step_us: step_us / steps as f64,
            rows,
            timeline: csv,
        })
    }

    pub fn set_wait_timeout_ms(&mut self, ms: u64) {
        self.params.timeout_ns = ms * 1_000_000;
    }

    /// Replaces one encoded word on the device: lets tests break a schedule on purpose.
    pub fn poke_word(&mut self, instruction: usize, word: usize, value: u32) -> Result<()> {
        let mut all = self.gpu.stream.clone_dtoh(&self.words)?;
        all[instruction * WORDS + word] = value;
        self.gpu.stream.memcpy_htod(&all, &mut self.words)?;
        Ok(())
    }

    fn launch(&mut self) -> Result<()> {
        if self.params.epoch >= MAX_EPOCH {
            // Old tags must not match the restarted ones.
            self.gpu.stream.memset_zeros(&mut self.arena)?;
            // The meta slot of the next step moves with the epoch's parity.
            if self.params.epoch % 2 == 1 {
                let m = self.gpu.stream.clone_dtoh(&self.meta)?;
                let swapped: Vec<u32> = m[4..8].iter().chain(&m[0..4]).copied().collect();
                self.gpu.stream.memcpy_htod(&swapped, &mut self.meta)?;
            }
            self.params.epoch = 0;
        }
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
        attr.value.cooperative = 1;
        let cfg = sys::CUlaunchConfig {
            gridDimX: self.gpu.sm_count as u32,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: THREADS,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: self.smem,
            hStream: self.gpu.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        let mut args = [&self.params as *const MkParams as *mut c_void];
        // SAFETY: one argument, the MkParams struct the kernel declares, by value.
        unsafe {
            sys::cuLaunchKernelEx(
                &cfg,
                self.kernel_fn(),
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .context("launching the megakernel (co-residency of one CTA per SM is required)")?;
        self.params.epoch += 1;
        Ok(())
    }

    fn kernel_fn(&self) -> sys::CUfunction {
        self.kernel.cu_function()
    }

    /// Reads the kernel's error word; a timed-out wait becomes an error naming what it waited
    /// for and where every unfinished SM stood.
    pub fn check_error(&self) -> Result<()> {
        let e = self
            .gpu
            .stream
            .clone_dtoh(&self.error)
            .context("megakernel failed")?;
        if e[0] == 0 {
            return Ok(());
        }
        let name = |v: &[String], i: u32| v.get(i as usize).cloned().unwrap_or_else(|| "?".into());
        let what = match e[6] {
            1 => format!(
                "waited too long for {} (tag {} expected, {} seen): nothing wrote it this step",
                self.arena_layout.element(e[3] as usize),
                e[4],
                e[5]
            ),
            2 => format!("waited too long for weight page of tile {} to arrive", e[3]),
            _ => format!(
                "(loader) waited too long for tile {}'s page to be released",
                e[3]
            ),
        };
        let progress = self.gpu.stream.clone_dtoh(&self.progress)?;
        let stages = ["start", "preparing", "tiles", "storing", "done"];
        let stuck: Vec<String> = (0..self.sm_offsets.len() - 1)
            .filter_map(|sm| {
                let pr = &progress[sm * 4..sm * 4 + 4];
                let last = self.sm_offsets[sm + 1];
                let finished = last == self.sm_offsets[sm] || (pr[0] + 1 == last && pr[1] == 5);
                (!finished).then(|| {
                    format!(
                        "SM {sm} at {} ({}), loader at {} tile {}",
                        pr[0],
                        stages.get(pr[1] as usize).unwrap_or(&"?"),
                        pr[2],
                        pr[3]
                    )
                })
            })
            .take(6)
            .collect();
        bail!(
            "megakernel: SM {} instruction {} ({}) {what}; the schedule cannot make progress. Unfinished: {}",
            e[1],
            e[2],
            name(&self.descs, e[2]),
            stuck.join("; ")
        );
    }

    /// Starts a new sequence (the KV cache is simply overwritten).
    pub fn reset(&mut self) {
        self.seq.reset();
    }

    /// `n` greedy steps back to back (see [`stepping::decode_greedy`]).
    pub fn decode_greedy(&mut self, token: u32, n: usize) -> Result<Vec<u32>> {
        stepping::decode_greedy(self, token, n)
    }
}

impl Steps for MegakernelPath<'_> {
    fn gpu(&self) -> &Gpu {
        self.gpu
    }

    fn vocab(&self) -> u32 {
        self.model.config.vocab_size as u32
    }

    fn seq(&mut self) -> &mut Sequence {
        &mut self.seq
    }

    /// The step of epoch `e` reads meta slot `e % 2` (its argmax writes the other one).
    fn write_meta(&mut self, token: u32, pos: usize) -> Result<()> {
        let slot = (self.params.epoch & 1) as usize;
        let mut dst = self.meta.slice_mut(slot * 4..slot * 4 + 4);
        self.gpu
            .stream
            .memcpy_htod(&[token, pos as u32, 0, 0], &mut dst)?;
        Ok(())
    }

    fn launch_step(&mut self) -> Result<()> {
        self.launch()
    }

    fn check(&self) -> Result<()> {
        self.check_error()
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
        super::prefill::KvTarget::head_major(self.gpu, &self._kv, &self.model.config)
    }
}

/// The schedule the megakernel runs for `config` on `gpu`: granularity from the cost model,
/// attention costed at `context` positions, `attn_parts` overriding the split-KV partitions.
pub fn schedule_for(
    config: &crate::model::Config,
    gpu: &Gpu,
    context: usize,
    attn_parts: Option<usize>,
) -> Result<Schedule> {
    let shape = crate::reference::sliced::shape_of(config);
    let gs = scheduler::GpuShape::with_sms(gpu.sm_count);
    // Measured hops (wait, prepare, compute, signal) cost microseconds, not the default 0.5:
    // a higher fixed cost keeps short contexts from paying an extra split-KV reduction hop.
    let cost = scheduler::CostModel {
        context,
        latency_us: 2.0,
        ..Default::default()
    };
    let mut opts = scheduler::Options::auto(&shape, &gs, &cost);
    if let Some(p) = attn_parts {
        opts.attn_parts = p;
    }
    scheduler::build(&shape, &gs, &opts).map_err(|e| anyhow::anyhow!("scheduler: {e}"))
}

//! The megakernel path: a scheduler `Schedule` lowered to the interpreter's words, device
//! buffers for every activation, and one persistent launch per decode step or per generation
//! (many greedy steps in one launch, see `launch`).

//!
//! One file per job: [`abi`] (the host/device interface, emitted into the CUDA compile),
//! [`layout`] (shared memory, scratch and arena planning), `compile`, `launch`, [`profile`]
//! (timings, CSV and Chrome trace), [`tiles`] (each mat-vec's rows a page, written into its
//! words) and `diagnostics` (error reports); this file builds a path from a schedule.

use std::sync::Arc;

use anyhow::{bail, Context, Result};
use cudarc::driver::{CudaModule, CudaSlice};
use scheduler::{ArenaLayout, Op, Schedule};

use super::device::{ptr, Gpu};
use super::launch::Kernel;
use super::model::{DeviceModel, KvCache};
use super::stepping::{self, GenerationRun, Sequence, Steps};
use crate::sampling::device::{DeviceSampler, LmMaxima};
use crate::sampling::SamplingParams;

pub mod abi;
mod compile;
mod diagnostics;
mod launch;
pub mod layout;
pub mod profile;
pub mod tiles;

use abi::{LayerW, MkParams, PAGE_BYTES, RES_MAX, THREADS, WORDS};
pub use compile::{defines as kernel_defines, freq_table_fits, ring_pages, KernelSpec};
pub use launch::{MAX_EPOCH, MAX_STOP_TOKENS};
use layout::{attention_scratch, xs_floats, SmemLayout};
pub use profile::{Profile, Timeline};

/// The most split-KV parts an `AttnReduce` merges: it keeps two floats per (query head, part)
/// in the attention scratch's score rows (see megakernel/ops/attn_reduce.cuh).
pub const MAX_REDUCE_PARTS: usize = abi::ATT_ROUND / 2;
const _: () = assert!(MAX_REDUCE_PARTS >= scheduler::options::MAX_ATTN_PARTS);

/// A wait for an input longer than this is a scheduling bug: the kernel stops and reports it.
const DEFAULT_WAIT_TIMEOUT_MS: u64 = 2000;

/// The wait limit a new path starts with: `MEGAINFER_WAIT_TIMEOUT_MS` where set (tools such as
/// compute-sanitizer slow the kernel by orders of magnitude, so under them the default limit
/// would report stalls that are not there), else DEFAULT_WAIT_TIMEOUT_MS. A value that is not
/// a number of milliseconds in the range `--wait-timeout-ms` takes is an error, not ignored.
fn initial_wait_timeout_ms() -> Result<u64> {
    parse_wait_timeout_ms(std::env::var("MEGAINFER_WAIT_TIMEOUT_MS").ok().as_deref())
}

fn parse_wait_timeout_ms(v: Option<&str>) -> Result<u64> {
    let Some(v) = v else {
        return Ok(DEFAULT_WAIT_TIMEOUT_MS);
    };
    v.trim()
        .parse::<u64>()
        .ok()
        .filter(|ms| (1..=600_000).contains(ms))
        .with_context(|| {
            format!(
                "MEGAINFER_WAIT_TIMEOUT_MS: '{v}' is not a number of milliseconds from 1 to 600000"
            )
        })
}

pub struct MegakernelPath<'g> {
    gpu: &'g Gpu,
    model: &'g DeviceModel,
    /// The interpreter's compiled variants (module kept alive beside each), as the buckets'
    /// `kernel` index them.
    kernels: Vec<(Arc<CudaModule>, Kernel)>,
    /// The same variants with the draw inside the launch, compiled by the first sampled step.
    sampled_kernels: Vec<Option<(Arc<CudaModule>, Kernel)>>,
    kernel_build: KernelBuild,
    params: MkParams,
    smem: u32,
    /// One set of streams per context bucket, shortest sequences first; `active` is the one
    /// the next launch runs (see `select_bucket`).
    buckets: Vec<Streams>,
    active: usize,
    /// The position the next launch decodes (its meta's `pos`): the host writes it with the
    /// meta and every launch advances it, so the bucket is chosen without a device read.
    next_pos: usize,
    error: CudaSlice<u32>,
    progress: CudaSlice<u32>,
    meta: CudaSlice<u32>,
    history: CudaSlice<u32>,
    logits: CudaSlice<f32>,
    /// Every tagged activation buffer, one after the other (see `scheduler::arena`), sized
    /// for the bucket with the most split-KV parts (the parts' slots come last).
    arena: CudaSlice<u64>,
    _layers: CudaSlice<LayerW>,
    _kv: KvCache,
    seq: Sequence,
    /// A generation's hand-over words (`MkParams::gen`): the last step's token, then each SM's
    /// last finished step. Cleared with the arena.
    gen: CudaSlice<u64>,
    /// The tokens a generation stops after (`MkParams::stop_ids`).
    stop_ids: CudaSlice<u32>,
    /// Word 0 the host's stop request, then each step's token. Allocated with the path: a
    /// page-locked allocation made by the first generation would count as its decoding time.
    gen_io: super::device::MappedWords,
    /// Whether sampled steps draw inside the launch (`MkParams::sampling`, megakernel/ops/
    /// sample.cuh), which lets them run as generations: where the schedule allows it
    /// ([`draws_in_launch`]), by default for vocabularies up to [`DRAW_IN_LAUNCH_MAX_VOCAB`]
    /// tokens ([`draw_in_launch_by_default`]), or as asked (`MEGAINFER_MK_DRAW_IN_LAUNCH`,
    /// [`MegakernelPath::set_draw_in_launch`]).
    draws_in_launch: bool,
    can_draw_in_launch: bool,
    /// The first step tag of the last launch that drew inside the launch (0: none since the
    /// arena was cleared): the in-launch draw's key slots carry short tags that repeat every
    /// `abi::SMP_SLOT_PERIOD` steps, so a launch that far from it clears them first.
    slots_first: u32,
    /// `MEGAINFER_MK_GREEDY_ON_SAMPLED=1` (for measuring): greedy steps run the sampled
    /// variant too, to tell its draw's cost from its code's.
    greedy_on_sampled: bool,
    /// Otherwise made on the first sampled step: the draw runs as one kernel after each launch
    /// (two for vocabularies too large for its last CTA, `Kernels::for_vocab`), reading the
    /// launch's logits and writing the token where the next launch reads it.
    sampler: Option<DeviceSampler>,
}

/// The sequence lengths whose split-KV kernel streams attention's K/V tiles with 2 in flight
/// (`KernelSpec::kv_two_in_flight`): buckets that start at 4K positions or later and end at 64K
/// or earlier. On the H100 (BENCHMARKS.md, 2026-11-28), against the weights' limit (4; none for
/// Llama-3.2-3B's bf16 kernel, `sources::stream_bound`): Llama-1B at 8K 1.2% faster on the mean
/// of two rounds (level, then 2.4%), at 32K 1.7%, Llama-3.2-3B at 8K 1.6%; Llama-1B at 128K
/// 1.3% slower (one round). Shorter split-KV buckets were not measured with it, so
/// they and the buckets past 64K keep the weights' limit, at the cost of one more kernel variant
/// to compile where the context passes 4K.
const KV_TWO_IN_FLIGHT_FROM: usize = 1 << 12;
const KV_TWO_IN_FLIGHT_UPTO: usize = 1 << 16;

/// How a kernel variant computes attention (`KernelSpec`'s `attn_by_warps`, `attn_spread`,
/// `attn_heads`, `kv_two_in_flight`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct AttnWay {
    by_warps: bool,
    spread: bool,
    kv_two_in_flight: bool,
    heads: usize,
}

/// What compiling the interpreter's variants took, for the sampled ones made later.
struct KernelBuild {
    /// The greedy kernels' specialisation (attention as in `ways`).
    spec: KernelSpec,
    /// Per variant: how it computes attention.
    ways: Vec<AttnWay>,
    /// The static shared memory the layout left room for.
    static_smem: usize,
}

/// One context bucket's instruction streams, uploaded once: sequences of at most `upto`
/// positions run them (see `scheduler::buckets`).
struct Streams {
    upto: usize,
    attn_parts: usize,
    /// Index into the path's kernels: the variant whose attention suits this bucket's parts.
    kernel: usize,
    instructions: usize,
    words: CudaSlice<u32>,
    offsets: CudaSlice<u32>,
    /// Per SM: its last instruction that writes K/V cache rows, or `u32::MAX` (see
    /// [`last_kv_writers`]).
    kv_last: CudaSlice<u32>,
    sm_offsets: Vec<u32>,
    /// Per encoded position: the instruction, for error messages.
    descs: Vec<String>,
    kinds: Vec<&'static str>,
    /// Names arena offsets as this bucket's schedule lays them out.
    arena: ArenaLayout,
}

impl<'g> MegakernelPath<'g> {
    /// A path running one schedule at every sequence length.
    pub fn new(
        gpu: &'g Gpu,
        model: &'g DeviceModel,
        schedule: &Schedule,
        max_seq: usize,
    ) -> Result<Self> {
        Self::with_buckets(gpu, model, &[(usize::MAX, schedule)], max_seq)
    }

    /// A path with one set of streams per context bucket: `(upto, schedule)`, `upto`
    /// increasing; a step at position `pos` runs the first bucket with `pos + 1 <= upto` (the
    /// last one beyond). Every schedule is uploaded here, so switching between them at run
    /// time only changes two pointers of the launch parameters. The schedules must differ in
    /// their split-KV partitioning only (as `scheduler::plan_buckets` makes them).
    pub fn with_buckets(
        gpu: &'g Gpu,
        model: &'g DeviceModel,
        buckets: &[(usize, &Schedule)],
        max_seq: usize,
    ) -> Result<Self> {
        let c = &model.config;
        // The schedule's shape carries the model's features the instructions depend on (with
        // q/k norms, QKV leaves q and k raw and attention norms and rotates them).
        let shape = crate::reference::sliced::shape_of(c);
        if let Some((_, s)) = buckets.iter().find(|(_, s)| s.model != shape) {
            bail!(
                "megakernel: schedule built for {:?}, the model is {shape:?}",
                s.model
            );
        }
        let formats = model.matrix_formats();
        let Some(&(_, first)) = buckets.first() else {
            bail!("megakernel: no schedule given");
        };
        for w in buckets.windows(2) {
            if w[0].0 >= w[1].0 {
                bail!(
                    "megakernel: context buckets must grow: up to {} before up to {}",
                    w[0].0,
                    w[1].0
                );
            }
        }
        for &(upto, schedule) in buckets {
            if schedule.streams.len() != gpu.sm_count {
                bail!(
                    "schedule built for {} SMs, the GPU has {}",
                    schedule.streams.len(),
                    gpu.sm_count
                );
            }
            let (a, b) = (&first.options, &schedule.options);
            let same = schedule.model == first.model
                && (
                    a.qkv_pairs,
                    a.qkv_pieces,
                    a.oproj_rows,
                    a.upgate_rows,
                    a.down_rows,
                    a.down_chunks,
                ) == (
                    b.qkv_pairs,
                    b.qkv_pieces,
                    b.oproj_rows,
                    b.upgate_rows,
                    b.down_rows,
                    b.down_chunks,
                )
                && a.lmhead_rows == b.lmhead_rows;
            if !same {
                bail!("megakernel: the schedule for sequences up to {upto} differs from the first in more than its attention's parts and heads an instruction");
            }
            let parts = schedule.options.attn_parts;
            if !part_range_fits(parts, max_seq) {
                bail!(
                    "megakernel: {parts} split-KV parts over a {max_seq}-position context exceed \
                     the attention's 32-bit range (parts × positions < 2^32); use fewer parts or \
                     a shorter --max-context"
                );
            }
        }
        let attention_scratch = attention_scratch(c.num_heads / c.num_kv_heads, c.head_dim);
        if attention_scratch > 16384 {
            bail!(
                "megakernel: {} query heads per KV head at head_dim {} need {attention_scratch} floats of attention scratch; at most 16384 fit",
                c.num_heads / c.num_kv_heads,
                c.head_dim
            );
        }
        let plan = host_kernel_variants(
            c,
            formats,
            buckets,
            gpu.max_smem_per_block,
            gpu.fast_memory(),
        )?;
        let mut encoded = Vec::new();
        let tile_formats = tiles::TileFormats {
            layers: model
                .layers
                .iter()
                .map(|l| [l.w_qkv.ty, l.wo.ty, l.w_gu.ty, l.w_down.ty])
                .collect(),
            lm_head: model.lm_head().ty,
        };
        let rule = tiles::TileRule {
            balance: super::switches::switch("MEGAINFER_MK_TILE_BALANCE", true)?,
            max_rows: super::switches::count("MEGAINFER_MK_TILE_ROWS")?.unwrap_or(usize::MAX),
        };
        for &(upto, schedule) in buckets {
            let mut enc = schedule.encode();
            tiles::write_tile_words(&mut enc.words, schedule, c, &tile_formats, rule)?;
            let mut descs = Vec::new();
            let mut kinds = Vec::new();
            for &k in schedule.streams.iter().flatten() {
                descs.push(schedule.describe(k as usize));
                kinds.push(schedule.instrs[k as usize].kind().name());
            }
            encoded.push((upto, schedule, enc, descs, kinds));
        }
        let (n_lm, chunks) = (
            encoded[0].2.lm_blocks as usize,
            encoded[0].2.down_chunks as usize,
        );
        let xs_floats = plan.xs_floats;
        // The variants differ only in attention's fields; the ring and the rest are shared.
        let spec = plan.specs[0];
        let mut kernels: Vec<(AttnWay, Arc<CudaModule>, Kernel)> = Vec::new();
        for (w, (module, kernel)) in
            plan.ways
                .iter()
                .copied()
                .zip(compile::load_all(gpu, c, &plan.specs)?)
        {
            kernels.push((w, module, kernel));
        }
        // The kernel's static shared memory (its two flags) sits beside the pages.
        let mut static_smem = 0;
        for (_, _, kernel) in &kernels {
            static_smem = static_smem.max(kernel.static_smem()?);
        }
        // The kernels are compiled for spec.pages pages, planned with a bound on their static
        // shared memory; the ring must fit beside what they actually have.
        let layout = SmemLayout::with_pages(spec.pages, xs_floats, c.num_layers);
        if layout.bytes + static_smem > gpu.max_smem_per_block {
            bail!(
                "megakernel: compiled for {} pages ({} B of shared memory), but with its {static_smem} B of static shared memory a block would need more than the {} B it may have",
                spec.pages,
                layout.bytes,
                gpu.max_smem_per_block
            );
        }
        let pages = layout.pages;
        let smem = layout.bytes as u32;
        for (_, _, kernel) in &kernels {
            kernel.allow_smem(smem as usize)?;
            if kernel.occupancy(THREADS, smem as usize)? < 1 {
                bail!("megakernel: a CTA of {THREADS} threads and {smem} B shared memory does not fit on an SM");
            }
        }

        let s = &gpu.stream;
        let (l, h) = (c.num_layers, c.hidden_size);
        // The layout the scheduler names elements by (resid_attn first: the kernel reports a
        // stuck element by its offset from there). The buckets' layouts agree but for the
        // length of attn_part, which comes last: the one with the most parts sizes the arena.
        let arena = buckets
            .iter()
            .map(|(_, s)| s.arena())
            .max_by_key(|a| a.len())
            .expect("at least one bucket");
        let arena_d = gpu.alloc_zeros::<u64>(arena.len(), "tagged activations")?;
        let base = ptr(&arena_d, s);
        let at = |name: &str| base + 8 * arena.offset(name) as u64;
        let logits = gpu.alloc_zeros::<f32>(c.vocab_size, "logits")?;
        // Where layers' formats differ (formats.mixed), each matrix pointer carries its format
        // in its low three bits (MK_WT_MIXED in runtime.cuh): device allocations are 256-byte
        // aligned.
        let mat = |m: &super::model::DeviceMatrix| -> Result<u64> {
            let p = ptr(&m.data, s);
            if formats.mixed == 0 {
                return Ok(p);
            }
            if p & 7 != 0 {
                bail!("megakernel: a weight matrix at {p:#x} is not 8-byte aligned");
            }
            Ok(p | m.type_code() as u64)
        };
        let layer_ptrs = model
            .layers
            .iter()
            .map(|lw| {
                Ok(LayerW {
                    attn_norm: ptr(&lw.attn_norm, s),
                    w_qkv: mat(&lw.w_qkv)?,
                    wo: mat(&lw.wo)?,
                    ffn_norm: ptr(&lw.ffn_norm, s),
                    w_gu: mat(&lw.w_gu)?,
                    w_down: mat(&lw.w_down)?,
                    qkv_bias: lw.qkv_bias.as_ref().map_or(0, |b| ptr(b, s)),
                    q_norm: lw.q_norm.as_ref().map_or(0, |b| ptr(b, s)),
                    k_norm: lw.k_norm.as_ref().map_or(0, |b| ptr(b, s)),
                })
            })
            .collect::<Result<Vec<LayerW>>>()?;
        let layers = gpu.upload(&layer_ptrs, "layer pointer table")?;
        let kv = KvCache::new(gpu, c, max_seq)?;
        let mut streams = Vec::new();
        let mut can_draw_in_launch = c.vocab_size <= abi::SAMPLE_MAX_VOCAB;
        let draw_requested = draw_in_launch_requested()?;
        for ((upto, schedule, enc, descs, kinds), kernel) in
            encoded.into_iter().zip(plan.bucket_kernel)
        {
            let kv_last = last_kv_writers(&enc.words, &enc.sm_offsets, c.qk_norm);
            can_draw_in_launch &= draws_in_launch(&enc.words, &enc.sm_offsets);
            streams.push(Streams {
                upto,
                attn_parts: schedule.options.attn_parts,
                kernel,
                instructions: enc.words.len() / WORDS,
                words: gpu.upload(&enc.words, "instruction streams")?,
                offsets: gpu.upload(&enc.sm_offsets, "stream offsets")?,
                kv_last: gpu.upload(&kv_last, "last K/V writers")?,
                sm_offsets: enc.sm_offsets,
                descs,
                kinds,
                arena: schedule.arena(),
            });
        }
        let error = gpu.alloc_zeros::<u32>(8, "error word")?;
        let progress = gpu.alloc_zeros::<u32>(4 * gpu.sm_count, "progress words")?;
        let meta = gpu.alloc_zeros::<u32>(8, "token meta")?;
        let history = gpu.alloc_zeros::<u32>(max_seq + 1, "token history")?;
        let gen = gpu.alloc_zeros::<u64>(1 + gpu.sm_count, "generation words")?;
        let stop_ids = gpu.alloc_zeros::<u32>(launch::MAX_STOP_TOKENS, "stop tokens")?;
        let params = MkParams {
            instrs: ptr(&streams[0].words, s),
            sm_offsets: ptr(&streams[0].offsets, s),
            kv_last: ptr(&streams[0].kv_last, s),
            error: ptr(&error, s),
            progress: ptr(&progress, s),
            profile: 0,
            meta: ptr(&meta, s),
            history: ptr(&history, s),
            layers: ptr(&layers, s),
            embed: ptr(&model.embed.data, s),
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
            timeout_ns: initial_wait_timeout_ms()?.saturating_mul(1_000_000),
            gen: ptr(&gen, s),
            gen_out: 0,
            gen_ctl: 0,
            stop_ids: ptr(&stop_ids, s),
            gen_prof: 0,
            steps: 1,
            n_stop: 0,
            lm_sample: at("lm_sample"),
            ..MkParams::default()
        };
        let mut path = Self {
            gpu,
            model,
            sampled_kernels: kernels.iter().map(|_| None).collect(),
            kernel_build: KernelBuild {
                spec,
                ways: kernels.iter().map(|k| k.0).collect(),
                static_smem,
            },
            kernels: kernels.into_iter().map(|(_, m, k)| (m, k)).collect(),
            params,
            smem,
            buckets: streams,
            active: 0,
            next_pos: 0,
            error,
            progress,
            meta,
            history,
            logits,
            arena: arena_d,
            _layers: layers,
            _kv: kv,
            seq: Sequence::new(max_seq),
            draws_in_launch: draw_in_launch_by_default(
                draw_requested,
                can_draw_in_launch,
                c.vocab_size,
            ),
            can_draw_in_launch,
            slots_first: 0,
            greedy_on_sampled: super::switches::switch("MEGAINFER_MK_GREEDY_ON_SAMPLED", false)?,
            sampler: None,
            gen,
            stop_ids,
            gen_io: super::device::MappedWords::new(gpu, 1 + max_seq.max(1), "generated tokens")?,
        };
        // The sampled variant is compiled now, with the model's load, where it was asked for,
        // rather than by the first sampled step (where its seconds would count as decoding
        // time); by default the first sampled step compiles it, as the draw after the launch
        // makes its sampler, so that greedy runs never wait for it.
        if (path.draws_in_launch && draw_requested == Some(true)) || path.greedy_on_sampled {
            path.compile_sampled()?;
        }
        Ok(path)
    }

    pub fn set_wait_timeout_ms(&mut self, ms: u64) {
        self.params.timeout_ns = ms * 1_000_000;
    }

    /// Test hook: replaces one encoded word on the device, to break a schedule on purpose
    /// (see [`Self::make_noop`]). Not for running models: the kernel trusts its words.
    #[doc(hidden)]
    pub fn poke_word(&mut self, instruction: usize, word: usize, value: u32) -> Result<()> {
        let b = &mut self.buckets[self.active];
        if instruction >= b.instructions || word >= WORDS {
            bail!(
                "poke_word: instruction {instruction} word {word} is outside the {} instructions of {WORDS} words",
                b.instructions
            );
        }
        let mut all = self.gpu.stream.clone_dtoh(&b.words)?;
        all[instruction * WORDS + word] = value;
        self.gpu.stream.memcpy_htod(&all, &mut b.words)?;
        Ok(())
    }

    /// Encoded instructions of the streams the next launch runs.
    pub fn instructions(&self) -> usize {
        self.streams().instructions
    }

    /// The streams the next launch runs.
    fn streams(&self) -> &Streams {
        &self.buckets[self.active]
    }

    /// `(upto, split-KV parts)` of every context bucket, and the index of the one the last
    /// launch ran (the first before any).
    pub fn buckets(&self) -> (Vec<(usize, usize)>, usize) {
        let b = self
            .buckets
            .iter()
            .map(|b| (b.upto, b.attn_parts))
            .collect();
        (b, self.active)
    }

    /// The bucket a step at position `pos` runs in.
    fn bucket_at(&self, pos: usize) -> usize {
        let len = pos.saturating_add(1);
        self.buckets
            .iter()
            .position(|b| b.upto >= len)
            .unwrap_or(self.buckets.len() - 1)
    }

    /// Points the launch at the streams of the bucket that a step at position `pos` runs in
    /// (its sequence is `pos + 1` long). Off the per-token path: a comparison per launch,
    /// and two pointers when the sequence crosses into the next bucket.
    fn select_bucket(&mut self, pos: usize) {
        let want = self.bucket_at(pos);
        if want != self.active {
            self.active = want;
            let s = &self.gpu.stream;
            self.params.instrs = ptr(&self.buckets[want].words, s);
            self.params.sm_offsets = ptr(&self.buckets[want].offsets, s);
            self.params.kv_last = ptr(&self.buckets[want].kv_last, s);
        }
    }

    /// Test hook: turns the instruction at encoded position `instruction` into a no-op
    /// (opcode 0), so that whatever reads its outputs waits in vain and the kernel reports it.
    #[doc(hidden)]
    pub fn make_noop(&mut self, instruction: usize) -> Result<()> {
        self.poke_word(instruction, 0, 0)
    }

    /// Starts a new sequence (the KV cache is simply overwritten).
    pub fn reset(&mut self) {
        self.seq.reset();
    }

    /// Greedy steps per launch: 1 launches once per step, `usize::MAX` (the default) runs a
    /// whole generation in one launch (see [`Self::generate`]).
    pub fn set_tokens_per_launch(&mut self, n: usize) {
        self.seq.tokens_per_launch = n.max(1);
    }

    /// The draws inside the launch so far, and how many of them searched the whole
    /// vocabulary, and why: the gate's statistics words in `lm_sample` (megakernel/ops/
    /// sample.cuh).
    pub fn in_launch_draws(&self) -> Result<InLaunchDraws> {
        let at = self.streams().arena.offset("lm_sample");
        let w = self
            .gpu
            .stream
            .clone_dtoh(&self.arena.slice(at..at + abi::SMP_GATE.len()))?;
        let word = |name| w[abi::smp_gate(name)];
        Ok(InLaunchDraws {
            draws: word("DRAWS"),
            searches: word("SEARCHES"),
            no_hint: word("NO_HINT"),
            slots: word("SLOTS"),
            short: word("SHORT"),
            top: word("TOP"),
        })
    }

    /// Sampled steps draw inside the launch (and run as generations) or after each launch.
    pub fn set_draw_in_launch(&mut self, on: bool) -> Result<()> {
        if on && !self.can_draw_in_launch {
            bail!(
                "this model's LM head has too many blocks (more than {}, or two on one SM), or its \
                 vocabulary too many tokens (more than {}), for the draw inside the launch",
                abi::SAMPLE_MAX_BLOCKS,
                abi::SAMPLE_MAX_VOCAB
            );
        }
        if on {
            self.compile_sampled()?;
        }
        self.draws_in_launch = on;
        Ok(())
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
        self.next_pos = pos;
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

    fn prepare_sampling(&mut self, p: &SamplingParams) -> Result<bool> {
        if self.draws_in_launch {
            self.compile_sampled()?;
            let w = crate::sampling::device::param_words(p);
            let f = f32::from_bits;
            let q = &mut self.params;
            (q.smp_temperature, q.smp_top_p, q.smp_min_p, q.smp_penalty) =
                (f(w[0]), f(w[1]), f(w[2]), f(w[3]));
            (q.smp_top_k, q.smp_last_n, q.smp_seed_lo, q.smp_seed_hi) = (w[4], w[5], w[6], w[7]);
            return Ok(true);
        }
        let vocab = self.model.config.vocab_size;
        DeviceSampler::prepared(&mut self.sampler, self.gpu, vocab, p)?;
        Ok(true)
    }

    /// The launch reads meta slot `epoch % 2`; its draw writes the other and
    /// `history[pos + 1]`. Without the draw in the launch, the sampler kernel writes both
    /// (stream order), so the launch's argmax merges no block (`n_lm` 0 for the launch): it
    /// leaves placeholder words at once instead of waiting for the last LM-head block and
    /// reading every block's maximum, and the sampler, which starts when the launch's last
    /// CTA exits, starts after the last LM-head block. The greedy kernel is unchanged.
    fn launch_sampled_step(&mut self) -> Result<()> {
        if self.draws_in_launch {
            self.params.sampling = 1;
            let r = self.launch();
            self.params.sampling = 0;
            return r;
        }
        // MAX_EPOCH is even, so a wrap inside `launch` keeps the slot's parity.
        let slot = (self.params.epoch & 1) as usize;
        let n_lm = self.params.n_lm;
        self.params.n_lm = 0;
        let launched = self.launch();
        self.params.n_lm = n_lm;
        launched?;
        let s = &self.gpu.stream;
        let sampler = self.sampler.as_ref().context("device sampler not made")?;
        let meta = ptr(&self.meta, s);
        // Four u32 words per TokenMeta.
        let (cur, next) = (meta + 16 * slot as u64, meta + 16 * (1 - slot) as u64);
        // Every LM-head block left its maximum in lm_best (the greedy kernel's store, which
        // the launch's argmax does not read): the sampler's first attempt starts from it.
        let maxima = LmMaxima {
            words: self.params.lm_best,
            blocks: n_lm as usize,
        };
        sampler.enqueue(
            s,
            ptr(&self.logits, s),
            cur,
            next,
            ptr(&self.history, s),
            sampler_pdl()?,
            Some(maxima),
        )
    }

    fn history_mut(&mut self) -> Option<&mut CudaSlice<u32>> {
        Some(&mut self.history)
    }

    fn runs_generations(&self) -> bool {
        self.seq.tokens_per_launch > 1
    }

    fn samples_in_launch(&self) -> bool {
        self.draws_in_launch
    }

    fn generate_in_launch(
        &mut self,
        n: usize,
        stop: &[u32],
        sampled: bool,
        on: &mut dyn FnMut(u32) -> Result<bool>,
    ) -> Result<GenerationRun> {
        let per_launch = self.seq.tokens_per_launch;
        if sampled && !self.draws_in_launch {
            bail!("this megakernel draws sampled tokens after each launch, not inside one");
        }
        self.params.sampling = u32::from(sampled);
        let r = self.generate(n, per_launch, stop, on);
        self.params.sampling = 0;
        r
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

/// Counts of the draws inside the launch ([`MegakernelPath::in_launch_draws`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InLaunchDraws {
    pub draws: u64,
    /// Draws that searched the whole vocabulary instead of taking the first attempt, for one
    /// of three reasons: a block had no hint (the first draw), a block's keys within the hint
    /// were past the slots the draw loads, or the keys within the hint did not decide the cuts.
    pub searches: u64,
    pub no_hint: u64,
    pub slots: u64,
    pub short: u64,
    /// Draws whose top token alone reached top-p (`smp_top_dominates`, select.cuh): decided
    /// without looking at any key, and without a search where the hint was missing.
    pub top: u64,
}

/// `MEGAINFER_MK_DRAW_IN_LAUNCH`: 1 draws sampled tokens inside the launch, 0 after it; unset,
/// the path chooses ([`draw_in_launch_by_default`]).
fn draw_in_launch_requested() -> Result<Option<bool>> {
    super::switches::optional_switch("MEGAINFER_MK_DRAW_IN_LAUNCH")
}

/// The largest vocabulary whose sampled steps draw inside the launch by default. Measured on
/// the H200 (BENCHMARKS.md, 2026-11-29): inside the launch is the faster draw on SmolLM2's
/// 49,152 tokens (random weights 0.349 against 0.354 ms at top-p 0.95; the default model,
/// trained, 0.4128 against 0.4142, and 0.4024 against 0.4039 at min-p 0.05) and the slower on
/// Llama 3's 128,256 (0.6729 against 0.6667): the one SM that draws loads every block's words
/// and merges their keys, and more blocks with more rows each cost it more than the kernel
/// after the launch, whose CTAs share that work.
pub const DRAW_IN_LAUNCH_MAX_VOCAB: usize = 65_536;

/// Whether sampled steps draw inside the launch: as `requested` where the schedule `can`,
/// else for vocabularies up to [`DRAW_IN_LAUNCH_MAX_VOCAB`].
fn draw_in_launch_by_default(requested: Option<bool>, can: bool, vocab: usize) -> bool {
    can && requested.unwrap_or(vocab <= DRAW_IN_LAUNCH_MAX_VOCAB)
}

/// Whether sampled steps can draw inside the launch (megakernel/ops/sample.cuh): the draw
/// merges at most `SAMPLE_MAX_BLOCKS` LM-head blocks, and each block waits for every other
/// block's maximum, so no SM may hold two (the second could not start until the first ended).
fn draws_in_launch(words: &[u32], sm_offsets: &[u32]) -> bool {
    let lm_blocks = |w: &[u32]| {
        (w[0]..w[1])
            .filter(|&i| words[i as usize * WORDS] == scheduler::encode::opcode::RMS_LM_HEAD)
            .count()
    };
    let per_sm: Vec<usize> = sm_offsets.windows(2).map(lm_blocks).collect();
    per_sm.iter().sum::<usize>() <= abi::SAMPLE_MAX_BLOCKS && per_sm.iter().all(|&n| n <= 1)
}

/// Per SM, the encoded position of its last instruction that writes K/V cache rows (QKV; with
/// q/k norms also attention, whose part at the current position writes the finished K row),
/// or `u32::MAX`. In a generation only the SMs that have one publish their steps
/// (megakernel.cu), and the loaders wait only for them before they stage rows of a step.
fn last_kv_writers(words: &[u32], sm_offsets: &[u32], qk_norm: bool) -> Vec<u32> {
    use scheduler::encode::opcode;
    sm_offsets
        .windows(2)
        .map(|w| {
            (w[0]..w[1])
                .rev()
                .find(|&i| {
                    let op = words[i as usize * WORDS];
                    op == opcode::RMS_QKV_ROPE || (qk_norm && op == opcode::ATTENTION)
                })
                .unwrap_or(u32::MAX)
        })
        .collect()
}

/// Whether the draw after a megakernel step is launched with programmatic dependent launch.
/// The sampler waits (griddepcontrol.wait) before it reads anything, and the megakernel never
/// signals early, so the draw still starts only once the step has finished: PDL only lets the
/// launch be processed while the step runs. The megakernel itself is never launched with PDL
/// (it has no wait of its own). Measured on the H100 (BENCHMARKS.md): 1.4 us less per sampled
/// Llama-1B step, 0.8 us SmolLM2. `MEGAINFER_SAMPLER_PDL=0` turns it off, to compare.
fn sampler_pdl() -> Result<bool> {
    static PDL: std::sync::OnceLock<Result<bool, String>> = std::sync::OnceLock::new();
    PDL.get_or_init(|| {
        super::switches::parse_switch(
            "MEGAINFER_SAMPLER_PDL",
            std::env::var("MEGAINFER_SAMPLER_PDL").ok().as_deref(),
            true,
        )
    })
    .clone()
    .map_err(anyhow::Error::msg)
}

// ---- the schedule the megakernel runs (shared with `megainfer schedule`) ----

/// Opt-in shared memory per block of an H100 (227 KiB) and its SMs: what `megainfer schedule`
/// assumes where no GPU is present.
pub const H100_SMS: usize = 132;
pub const H100_SMEM_PER_BLOCK: usize = 227 << 10;

/// The GPU as the megakernel uses it for `config`: `sm_count` streams and the weight pages it
/// leaves beside its other shared memory on a GPU with `max_smem_per_block` bytes per block.
/// The page count feeds the schedule's time estimate only; it is taken with the widest input
/// vector an auto-granularity schedule can have (a down-projection chunk is at most a page of
/// f32), so it is at most the kernel's own count (equal for the Llama-3.2-1B and SmolLM2
/// shapes on an H100: 12).
pub fn megakernel_gpu_shape(
    config: &crate::model::Config,
    sm_count: usize,
    max_smem_per_block: usize,
) -> scheduler::GpuShape {
    let xs = widest_xs_floats(config);
    scheduler::GpuShape {
        sm_count,
        // The kernel's static shared memory is not known before its compile; the ring's
        // planning bound stands for it.
        smem_pages: SmemLayout::plan(
            max_smem_per_block,
            compile::STATIC_SMEM_BOUND,
            xs,
            config.num_layers,
        )
        .map(|l| l.pages)
        .unwrap_or(0),
        page_bytes: PAGE_BYTES,
    }
}

/// The input vector's floats (`xs_floats`) for the widest input an auto-granularity schedule
/// of `config` can have (a down-projection chunk is at most a page of f32): what plans made
/// before a schedule exists take.
pub fn widest_xs_floats(config: &crate::model::Config) -> usize {
    let scratch = attention_scratch(config.num_heads / config.num_kv_heads, config.head_dim);
    xs_floats(
        config.hidden_size.max(config.q_dim()).max(PAGE_BYTES / 4),
        scratch,
    )
}

/// The down-projection chunk width the kernel is compiled for ([`kernel_defines`]): the first
/// `DownProjPartial`'s in the schedule's streams (the chunks are equal but for an intermediate
/// size the count does not divide); 0 without one.
pub fn down_chunk_cols(schedule: &Schedule) -> usize {
    schedule
        .streams
        .iter()
        .flatten()
        .find_map(|&k| match schedule.instrs[k as usize] {
            Op::DownProjPartial { col_count, .. } => Some(col_count as usize),
            _ => None,
        })
        .unwrap_or(0)
}

/// A schedule of the megakernel for `config` on a GPU of shape `gpu` with `cost`, granularity
/// overridden by `overrides` (`scheduler::plan`). `megainfer schedule` and [`schedule_for`]
/// build theirs here; `run` and `bench` build one per context bucket by the same plan and cost
/// model ([`buckets_for`]), which `megainfer schedule` lists at its end.
pub fn megakernel_schedule(
    config: &crate::model::Config,
    gpu: &scheduler::GpuShape,
    cost: &scheduler::CostModel,
    overrides: &scheduler::Overrides,
) -> Result<Schedule> {
    let shape = crate::reference::sliced::shape_of(config);
    scheduler::plan(&shape, gpu, cost, overrides).map_err(|e| anyhow::anyhow!("scheduler: {e}"))
}

/// One schedule for `config` on `gpu`, attention costed at `context` positions (tests and
/// tools; `run` and `bench` use [`buckets_for`]), `attn_parts` overriding the split-KV
/// partitions.
pub fn schedule_for(
    config: &crate::model::Config,
    gpu: &Gpu,
    context: usize,
    attn_parts: Option<usize>,
) -> Result<Schedule> {
    let shape = megakernel_gpu_shape(config, gpu.sm_count, gpu.max_smem_per_block);
    let overrides = scheduler::Overrides {
        attn_parts,
        ..Default::default()
    };
    let cost = cost_model(context)?;
    megakernel_schedule(config, &shape, &cost, &overrides)
}

/// The megakernel's cost model at `context` positions: `scheduler::CostModel::megakernel` (an
/// H100's 3,110 GB/s on every GPU), or, for measuring schedules costed for another memory, with
/// `MEGAINFER_MK_BANDWIDTH_GBPS` as its bandwidth (`megainfer schedule --bandwidth` prints
/// them). `run` and `bench` read it alike.
pub fn cost_model(context: usize) -> Result<scheduler::CostModel> {
    let v = std::env::var("MEGAINFER_MK_BANDWIDTH_GBPS").ok();
    parse_cost_bandwidth(v.as_deref(), context).map_err(anyhow::Error::msg)
}

fn parse_cost_bandwidth(v: Option<&str>, context: usize) -> Result<scheduler::CostModel, String> {
    let mut cost = scheduler::CostModel::megakernel(context);
    if let Some(s) = v {
        cost.bandwidth_gbps = s.trim().parse::<f64>().map_err(|_| {
            format!("MEGAINFER_MK_BANDWIDTH_GBPS: '{s}' is not a bandwidth in GB/s")
        })?;
        cost.check()
            .map_err(|e| format!("MEGAINFER_MK_BANDWIDTH_GBPS: {e}"))?;
    }
    Ok(cost)
}

/// The limits a schedule must keep to run on the megakernel as compiled (rows an instruction
/// holds, split-KV parts a merge takes, a quantised down projection's chunks on its 32-column
/// blocks, a weight row segment within a page); returns its widest down-projection chunk.
/// `MegakernelPath::new` checks every bucket's schedule with it and `megainfer schedule` the
/// one it prints (as bf16, the formats of a file unknown there).
pub fn check_limits(schedule: &Schedule, formats: &super::sources::MatrixFormats) -> Result<usize> {
    let mut max_cols = 0;
    for &k in schedule.streams.iter().flatten() {
        let op = &schedule.instrs[k as usize];
        let rows = match *op {
            Op::RmsQkvRope { pair_count, .. } => 2 * pair_count as usize,
            Op::RmsUpGateSilu { row_count, .. } => 2 * row_count as usize,
            Op::OProjResidual { row_count, .. } | Op::RmsLmHead { row_count, .. } => {
                row_count as usize
            }
            Op::DownProjPartial {
                row_count,
                col_start,
                col_count,
                ..
            } => {
                // A quantised row's chunk must start and end on its 32-column blocks
                // (any layer's: a mixed mask above 1 holds a block format).
                let quantised = formats.down != 0 || formats.mixed > 1;
                if quantised && (col_start % 32 != 0 || col_count % 32 != 0) {
                    bail!("schedule: {op:?} cuts the quantised down projection's 32-column blocks (choose down_chunks so that intermediate / down_chunks is a multiple of 32)");
                }
                max_cols = max_cols.max(col_count as usize);
                row_count as usize
            }
            _ => 0,
        };
        if let Op::AttnReduce { parts, .. } = *op {
            if parts as usize > MAX_REDUCE_PARTS {
                bail!("schedule: {op:?} merges {parts} split-KV parts; the megakernel merges at most {MAX_REDUCE_PARTS}");
            }
        }
        // O-proj and the down projection keep residual rows in the second half of the row
        // buffer (megakernel/ops/o_proj.cuh, down_proj.cuh).
        let limit = match op {
            Op::OProjResidual { .. } | Op::DownProjPartial { .. } => RES_MAX / 2,
            _ => RES_MAX,
        };
        if rows > limit {
            bail!("schedule: {op:?} computes {rows} rows; the megakernel holds at most {limit}");
        }
    }
    if max_cols * 2 > PAGE_BYTES {
        bail!("schedule: a weight row segment of {max_cols} columns does not fit a {PAGE_BYTES}-byte page");
    }
    Ok(max_cols)
}

/// One schedule per context bucket for sequences of up to `max_seq` positions on `gpu`
/// (`scheduler::plan_buckets` with the megakernel's cost model), `overrides` replacing the
/// cost model's choices (an override of the split-KV partitions makes one bucket).
pub fn buckets_for(
    config: &crate::model::Config,
    gpu: &Gpu,
    max_seq: usize,
    overrides: &scheduler::Overrides,
) -> Result<Vec<scheduler::Bucket>> {
    let shape = megakernel_gpu_shape(config, gpu.sm_count, gpu.max_smem_per_block);
    let model = crate::reference::sliced::shape_of(config);
    let cost = cost_model(max_seq.max(1))?;
    let bounds = bucket_bounds_for(max_seq)?;
    scheduler::plan_buckets_within(&model, &shape, &cost, overrides, &bounds)
        .map_err(|e| anyhow::anyhow!("scheduler: {e}"))
}

/// The bounds of the context buckets for sequences of up to `max_seq` positions:
/// `scheduler::bucket_bounds`, or, for measuring other cuts, `MEGAINFER_MK_BUCKETS`: the
/// lengths below `max_seq` that end a bucket, comma-separated and increasing (e.g.
/// `64,256,1024,4096`), `max_seq` ending the last. `run`, `bench` and `megainfer
/// schedule` read it alike.
pub fn bucket_bounds_for(max_seq: usize) -> Result<Vec<usize>> {
    let v = std::env::var("MEGAINFER_MK_BUCKETS").ok();
    parse_bucket_bounds(v.as_deref(), max_seq).map_err(anyhow::Error::msg)
}

fn parse_bucket_bounds(v: Option<&str>, max_seq: usize) -> Result<Vec<usize>, String> {
    let Some(list) = v else {
        return Ok(scheduler::bucket_bounds(max_seq));
    };
    let mut bounds = Vec::new();
    for item in list.split(',').map(str::trim) {
        match item.parse::<usize>() {
            Ok(n) if n >= 1 && bounds.last().is_none_or(|&l| n > l) => {
                if n < max_seq {
                    bounds.push(n);
                }
            }
            _ => {
                return Err(format!(
                    "MEGAINFER_MK_BUCKETS: '{item}' is not a length above the one before it \
                     (increasing positive lengths, comma-separated: '{list}')"
                ))
            }
        }
    }
    bounds.push(max_seq.max(1));
    Ok(bounds)
}

impl<'g> MegakernelPath<'g> {
    /// Compiles the variants with the draw inside the launch, once.
    fn compile_sampled(&mut self) -> Result<()> {
        let b = &self.kernel_build;
        let missing: Vec<usize> = (0..self.sampled_kernels.len())
            .filter(|&i| self.sampled_kernels[i].is_none())
            .collect();
        let specs: Vec<KernelSpec> = missing
            .iter()
            .map(|&i| KernelSpec {
                attn_by_warps: b.ways[i].by_warps,
                attn_spread: b.ways[i].spread,
                kv_two_in_flight: b.ways[i].kv_two_in_flight,
                attn_heads: b.ways[i].heads,
                sampled: true,
                ..b.spec
            })
            .collect();
        let loaded = compile::load_all(self.gpu, &self.model.config, &specs)?;
        for (i, (module, kernel)) in missing.into_iter().zip(loaded) {
            if kernel.static_smem()? > b.static_smem {
                bail!("megakernel: the sampled variant needs more static shared memory than was planned");
            }
            kernel.allow_smem(self.smem as usize)?;
            self.sampled_kernels[i] = Some((module, kernel));
        }
        Ok(())
    }

    /// A path for sequences of up to `max_seq` positions with a set of streams per context
    /// bucket ([`buckets_for`]).
    pub fn bucketed(
        gpu: &'g Gpu,
        model: &'g DeviceModel,
        max_seq: usize,
        overrides: &scheduler::Overrides,
    ) -> Result<Self> {
        let buckets = buckets_for(&model.config, gpu, max_seq, overrides)?;
        let list = split_at_kv_bound(buckets.iter().map(|b| (b.upto, &b.schedule)));
        Self::with_buckets(gpu, model, &list, max_seq)
    }
}

/// The interpreter variants a path over its context buckets compiles (greedy; the sampled ones
/// are the same with `sampled` set) and which one each bucket runs.
pub struct KernelVariants {
    /// The distinct variants, in the order they are compiled.
    pub specs: Vec<KernelSpec>,
    /// Per variant: how it computes attention.
    ways: Vec<AttnWay>,
    /// Per bucket: its variant's index in `specs`.
    pub bucket_kernel: Vec<usize>,
    /// The input vector's floats (`xs_floats` in layout.rs) the variants are planned with.
    pub xs_floats: usize,
}

/// Compiles, without a GPU, the megakernel variants `run` and `bench` would load for
/// `buckets` (bf16 weights, a Hopper block's shared memory; `fast_memory`: a GPU such as the
/// H200's, the weights' whole ring in flight) into the kernel cache, for `arch` (`sm_90a` on
/// both), with `MEGAINFER_MK_DEFINES` and `MEGAINFER_MK_ATT_BY_WARPS` as those read them; returns how
/// many. A cache filled so is found on a GPU machine whose NVRTC has this one's version
/// (`megainfer schedule --compile-kernels`, docs/gpu-machine.md).
pub fn compile_kernels_ahead(
    c: &crate::model::Config,
    buckets: &[(usize, &Schedule)],
    fast_memory: bool,
    arch: &str,
) -> Result<usize> {
    let plan = host_kernel_variants(
        c,
        Default::default(),
        buckets,
        H100_SMEM_PER_BLOCK,
        fast_memory,
    )?;
    // Each variant as greedy launches run it and as sampled ones do (the draw inside the launch).
    let specs: Vec<KernelSpec> = [false, true]
        .into_iter()
        .flat_map(|sampled| plan.specs.iter().map(move |s| KernelSpec { sampled, ..*s }))
        .collect();
    Ok(compile::compile_all(c, &specs, arch)?.len())
}

/// [`kernel_variants`] as the host takes them: attention by warps unless
/// `MEGAINFER_MK_ATT_BY_WARPS=0`, and with `MEGAINFER_MK_MAX_PAGES=N` (a multiple of the
/// consumer warp pairs) a ring of at most N pages: both for measuring, the second what the
/// ring's pages are worth to a shape.
fn host_kernel_variants(
    c: &crate::model::Config,
    formats: super::sources::MatrixFormats,
    buckets: &[(usize, &Schedule)],
    max_smem_per_block: usize,
    fast_memory: bool,
) -> Result<KernelVariants> {
    let by_warps_allowed = super::switches::switch("MEGAINFER_MK_ATT_BY_WARPS", true)?;
    let ring_by_buckets = super::switches::switch("MEGAINFER_MK_RING_BY_BUCKETS", true)?;
    let mut plan = kernel_variants(
        c,
        formats,
        buckets,
        max_smem_per_block,
        fast_memory,
        by_warps_allowed,
        ring_by_buckets,
    )?;
    if let Some(cap) = super::switches::count("MEGAINFER_MK_MAX_PAGES")? {
        cap_pages(&mut plan, cap)?;
    }
    Ok(plan)
}

/// At most `cap` ring pages in every variant (`MEGAINFER_MK_MAX_PAGES`): a multiple of
/// TILE_GROUPS, as a tile's page must always go to the same warp pair.
fn cap_pages(plan: &mut KernelVariants, cap: usize) -> Result<()> {
    use abi::TILE_GROUPS;
    if !cap.is_multiple_of(TILE_GROUPS) {
        bail!("MEGAINFER_MK_MAX_PAGES: {cap} is not a multiple of {TILE_GROUPS} (the consumer warp pairs)");
    }
    for s in &mut plan.specs {
        s.pages = s.pages.min(cap);
    }
    Ok(())
}

/// [`KernelVariants`] for `buckets` (as [`MegakernelPath::with_buckets`] takes them), from the
/// model, its matrix formats, the schedules and the GPU's shared memory and memory speed alone:
/// no GPU is needed to know them (tests/cuda_compile.rs compiles every preset's).
/// `by_warps_allowed`: `MEGAINFER_MK_ATT_BY_WARPS` (false: attention by rounds wherever the
/// choice is open, for measuring). `ring_by_buckets`: `MEGAINFER_MK_RING_BY_BUCKETS` (on by
/// default; `=0` for measuring): the shared-memory plan sizes attention's scratch for the most
/// query heads an attention instruction of these buckets computes rather than for a KV head's
/// whole group. Where a short bucket computes one head an instruction and no bucket computes
/// more, that can leave room for more pages; since a group of 7 heads of 128 keeps a partial
/// output a warp pair (`layout::attention_part_slots`), Qwen2.5-7B's whole group plans 12 pages
/// as one head does, and no preset's plan depends on the switch (unit test below).
pub fn kernel_variants(
    c: &crate::model::Config,
    formats: super::sources::MatrixFormats,
    buckets: &[(usize, &Schedule)],
    max_smem_per_block: usize,
    fast_memory: bool,
    by_warps_allowed: bool,
    ring_by_buckets: bool,
) -> Result<KernelVariants> {
    let Some(&(_, first)) = buckets.first() else {
        bail!("megakernel: no schedule given");
    };
    let mut max_cols = c.hidden_size.max(c.q_dim());
    for &(_, schedule) in buckets {
        max_cols = max_cols.max(check_limits(schedule, &formats)?);
    }
    if max_cols * 2 > PAGE_BYTES {
        bail!("schedule: a weight row segment of {max_cols} columns does not fit a {PAGE_BYTES}-byte page");
    }
    let group = c.num_heads / c.num_kv_heads;
    let scratch_heads = if ring_by_buckets {
        buckets
            .iter()
            .map(|&(_, s)| s.options.attn_heads_of(&s.model))
            .max()
            .unwrap_or(group)
    } else {
        group
    };
    let attention_scratch = attention_scratch(scratch_heads, c.head_dim);
    let xs_floats = xs_floats(max_cols, attention_scratch);
    // Attention by warps (where a lane's queries and output fit its registers for a KV
    // group's query heads or half of them, megakernel/ops/attention.cuh) streams long
    // parts faster than by rounds (4% a token at 8K on Llama-1B), and with its short parts
    // spread over every warp it is level with rounds at a 160-token context on SmolLM2 and
    // Llama-1B and faster on the head_dim-128 shapes (measured on the H100, BENCHMARKS.md).
    // So on those shapes the buckets of one part run a kernel by warps with the spread
    // (MEGAINFER_MK_ATT_BY_WARPS=0: by rounds, for measuring), and the buckets with
    // split-KV parts one by warps without it: compiled in, its code made the long parts
    // stream 1-4% slower at 8K. The other shapes compute by rounds either way, and compile
    // the split-KV buckets' merge (attn_reduce.cuh's by-warps form) only into the kernel
    // of the buckets that have parts.
    // As ATT_BY_WARPS in attention.cuh: a lane's queries and output for the heads an
    // instruction computes (the group, or the schedule's share of it), or at head_dim 128
    // for half of them, in 32 registers.
    let warps_fit = |heads: usize| {
        let lane_dims = c.head_dim / 8;
        let heads_a_warp = if heads * lane_dims <= 32 {
            heads
        } else {
            32 / lane_dims
        };
        let head_groups = heads.div_ceil(heads_a_warp.max(1));
        head_groups == 1 || (head_groups == 2 && c.head_dim == 128)
    };
    let ways: Vec<AttnWay> = buckets
        .iter()
        .zip(kv_two_in_flight(buckets))
        .map(|(&(_, schedule), kv_two_in_flight)| {
            let split = schedule.options.attn_parts > 1;
            let heads = schedule.options.attn_heads;
            let short_by_warps =
                by_warps_allowed && warps_fit(schedule.options.attn_heads_of(&schedule.model));
            AttnWay {
                by_warps: short_by_warps || split,
                spread: short_by_warps && !split,
                kv_two_in_flight,
                heads,
            }
        })
        .collect();
    let freq_in_smem = compile::freq_table_fits(c, max_smem_per_block, xs_floats);
    let spec = KernelSpec {
        formats,
        down_cols: down_chunk_cols(first),
        down_chunks: first.options.down_chunks,
        attn_by_warps: false,
        attn_spread: false,
        kv_two_in_flight: false,
        attn_heads: 0,
        sampled: false,
        freq_in_smem,
        pages: compile::ring_pages(c, max_smem_per_block, xs_floats, freq_in_smem)?,
        whole_ring: fast_memory,
    };
    let mut distinct: Vec<AttnWay> = Vec::new();
    for &w in &ways {
        if !distinct.contains(&w) {
            distinct.push(w);
        }
    }
    let specs = distinct
        .iter()
        .map(|w| KernelSpec {
            attn_by_warps: w.by_warps,
            attn_spread: w.spread,
            kv_two_in_flight: w.kv_two_in_flight,
            attn_heads: w.heads,
            ..spec
        })
        .collect();
    let bucket_kernel = ways
        .iter()
        .map(|w| {
            distinct
                .iter()
                .position(|d| d == w)
                .expect("every way is listed")
        })
        .collect();
    Ok(KernelVariants {
        specs,
        ways: distinct,
        bucket_kernel,
        xs_floats,
    })
}

/// For each bucket `(upto, schedule)` (in order, each starting where the one before ends):
/// whether it runs the split-KV kernel that streams its K/V with 2 tiles in flight (the others
/// take the weights' limit, `MK_INFLIGHT_STREAM`).
pub fn kv_two_in_flight(buckets: &[(usize, &Schedule)]) -> Vec<bool> {
    let mut from = 0;
    buckets
        .iter()
        .map(|&(upto, schedule)| {
            let two = schedule.options.attn_parts > 1
                && from >= KV_TWO_IN_FLIGHT_FROM
                && upto <= KV_TWO_IN_FLIGHT_UPTO;
            from = upto;
            two
        })
        .collect()
}

/// The buckets, a split-KV bucket that spans [`KV_TWO_IN_FLIGHT_FROM`] or
/// [`KV_TWO_IN_FLIGHT_UPTO`] cut there into pieces with the same schedule: the scheduler merges
/// neighbours with the same parts (Llama-1B's 4K to 128K are one bucket, Llama-3.2-3B's 1K to
/// 128K), but the sequences between the two bounds run a kernel of their own.
pub fn split_at_kv_bound<'s>(
    buckets: impl Iterator<Item = (usize, &'s Schedule)>,
) -> Vec<(usize, &'s Schedule)> {
    let mut out: Vec<(usize, &Schedule)> = Vec::new();
    for (upto, schedule) in buckets {
        let from = out.last().map_or(0, |b| b.0);
        if schedule.options.attn_parts > 1 {
            for cut in [KV_TWO_IN_FLIGHT_FROM, KV_TWO_IN_FLIGHT_UPTO] {
                if from < cut && cut < upto {
                    out.push((cut, schedule));
                }
            }
        }
        out.push((upto, schedule));
    }
    out
}

/// Whether attention's part ranges over `parts` split-KV parts stay exact up to `max_seq`
/// positions: `attn_range` (megakernel/ops/attention.cuh) computes part × length in 32 bits.
fn part_range_fits(parts: usize, max_seq: usize) -> bool {
    (parts as u64) * (max_seq as u64 + 1) < 1 << 32
}

#[cfg(test)]
mod tests {
    /// The context buckets of `c` up to `max_seq` positions on an H100's or H200's shape (132
    /// SMs, 232,448 bytes of shared memory a block), with the megakernel's cost model.
    fn preset_buckets(c: &crate::model::Config, max_seq: usize) -> Vec<scheduler::Bucket> {
        let shape = super::megakernel_gpu_shape(c, 132, 232_448);
        let model = crate::reference::sliced::shape_of(c);
        let cost = scheduler::CostModel::megakernel(max_seq);
        scheduler::plan_buckets(&model, &shape, &cost, &Default::default(), max_seq).unwrap()
    }

    use super::{draw_in_launch_by_default, last_kv_writers, part_range_fits, WORDS};

    /// Sampled steps draw inside the launch by default on SmolLM2's vocabulary, after it on
    /// Llama 3's and Qwen's; a request wins either way, but never where the schedule cannot.
    #[test]
    fn the_draw_goes_inside_the_launch_by_vocabulary_unless_asked() {
        assert!(draw_in_launch_by_default(None, true, 49_152));
        assert!(draw_in_launch_by_default(None, true, 65_536));
        assert!(!draw_in_launch_by_default(None, true, 65_537));
        assert!(!draw_in_launch_by_default(None, true, 128_256));
        assert!(!draw_in_launch_by_default(None, true, 151_936));
        assert!(draw_in_launch_by_default(Some(true), true, 128_256));
        assert!(!draw_in_launch_by_default(Some(false), true, 49_152));
        assert!(!draw_in_launch_by_default(Some(true), false, 49_152));
        assert!(!draw_in_launch_by_default(None, false, 49_152));
    }

    /// The largest split (MAX_ATTN_PARTS = 128) at a 128K context fits with room; 2^16 parts
    /// (what the options allow) only below 65,535 positions.
    #[test]
    fn attention_part_ranges_fit_32_bits() {
        assert!(part_range_fits(128, 131_072));
        assert!(part_range_fits(128, (1 << 25) - 2));
        assert!(!part_range_fits(128, (1 << 25) - 1));
        assert!(part_range_fits(1 << 16, 65_534));
        assert!(!part_range_fits(1 << 16, 65_535));
    }
    use scheduler::encode::opcode;

    #[test]
    fn bucket_bounds_come_from_the_environment_for_measuring() {
        use super::parse_bucket_bounds;
        assert_eq!(
            parse_bucket_bounds(None, 4096),
            Ok(scheduler::bucket_bounds(4096))
        );
        // Lengths at or past the longest sequence are dropped; it ends the last bucket.
        assert_eq!(
            parse_bucket_bounds(Some("64, 256,512,1024,4096,16384"), 4096),
            Ok(vec![64, 256, 512, 1024, 4096])
        );
        for bad in ["", "256,64", "64,64", "0,64", "64,x"] {
            let err = parse_bucket_bounds(Some(bad), 4096).unwrap_err();
            assert!(err.starts_with("MEGAINFER_MK_BUCKETS: '"), "{bad}: {err}");
        }
    }

    /// The cost model's bandwidth is the H100's unless the measuring variable gives another;
    /// one no GPU has is refused, naming the variable.
    #[test]
    fn cost_bandwidth_comes_from_the_environment_for_measuring() {
        use super::parse_cost_bandwidth;
        let h100 = scheduler::CostModel::megakernel(1024);
        assert_eq!(parse_cost_bandwidth(None, 1024), Ok(h100));
        let h200 = parse_cost_bandwidth(Some(" 4526"), 1024).unwrap();
        assert_eq!(h200.bandwidth_gbps, 4526.0);
        assert_eq!((h200.latency_us, h200.context), (h100.latency_us, 1024));
        for bad in ["", "fast", "0", "-5", "1e12"] {
            let err = parse_cost_bandwidth(Some(bad), 1024).unwrap_err();
            assert!(
                err.starts_with("MEGAINFER_MK_BANDWIDTH_GBPS: "),
                "{bad}: {err}"
            );
        }
    }

    /// The variants a Llama-1B path up to 128K compiles on an H200's shape, and which bucket
    /// runs which: the short parts spread by warps, then the split-KV kernel, with 2 K/V tiles
    /// in flight from 4K to 64K only; the host's choices reach the specs.
    #[test]
    fn kernel_variants_follow_the_buckets() {
        use super::{kernel_variants, split_at_kv_bound};
        let c = crate::model::presets::by_name("llama-3.2-1b").unwrap();
        let buckets = preset_buckets(&c, 131_072);
        let list = split_at_kv_bound(buckets.iter().map(|b| (b.upto, &b.schedule)));
        let plan =
            kernel_variants(&c, Default::default(), &list, 232_448, true, true, false).unwrap();
        let uptos: Vec<usize> = list.iter().map(|b| b.0).collect();
        assert_eq!(uptos, [512, 1024, 4096, 65_536, 131_072]);
        assert_eq!(plan.bucket_kernel, [0, 1, 1, 2, 1]);
        let ways: Vec<(bool, bool, bool)> = plan
            .specs
            .iter()
            .map(|s| (s.attn_by_warps, s.attn_spread, s.kv_two_in_flight))
            .collect();
        assert_eq!(
            ways,
            [
                (true, true, false),
                (true, false, false),
                (true, false, true)
            ]
        );
        assert!(plan.specs.iter().all(|s| s.whole_ring && !s.sampled));
        // Attention by rounds everywhere where by warps is switched off (the split-KV buckets
        // stay by warps: their merge takes the by-warps form).
        let rounds =
            kernel_variants(&c, Default::default(), &list, 232_448, false, false, false).unwrap();
        assert!(!rounds.specs[0].attn_by_warps && !rounds.specs[0].attn_spread);
        assert!(rounds.specs.iter().all(|s| !s.whole_ring));
    }

    /// The ring planned for the buckets' attention instructions (the default;
    /// `MEGAINFER_MK_RING_BY_BUCKETS=0` plans for whole groups) on an H100's or H200's shared
    /// memory: Qwen2.5-7B keeps 12 pages at a short context (one query head an instruction) and
    /// at a long one (split-KV buckets computing whole groups of 7 heads of 128, whose partial
    /// outputs take a slot a warp pair), either way; every other preset's plan is the same
    /// either way.
    #[test]
    fn the_ring_keeps_twelve_pages_for_qwen25_7b_at_every_context() {
        use super::{kernel_variants, split_at_kv_bound};
        for name in crate::model::presets::NAMES {
            let c = crate::model::presets::by_name(name).unwrap();
            for max_seq in [161, c.max_position_embeddings.min(32_768)] {
                let buckets = preset_buckets(&c, max_seq);
                let list = split_at_kv_bound(buckets.iter().map(|b| (b.upto, &b.schedule)));
                let plan = |by_buckets| {
                    let p = kernel_variants(
                        &c,
                        Default::default(),
                        &list,
                        232_448,
                        true,
                        true,
                        by_buckets,
                    )
                    .unwrap();
                    let pages: Vec<usize> = p.specs.iter().map(|s| s.pages).collect();
                    (p.xs_floats, pages)
                };
                let ((whole_xs, whole_pages), (xs, pages)) = (plan(false), plan(true));
                if *name == "qwen2.5-7b" {
                    assert!(
                        whole_pages.iter().chain(&pages).all(|&p| p == 12),
                        "{name} at {max_seq}: {whole_pages:?}, {pages:?}"
                    );
                } else {
                    assert_eq!((xs, pages), (whole_xs, whole_pages), "{name} at {max_seq}");
                }
            }
        }
    }

    /// `MEGAINFER_MK_MAX_PAGES`: a cap below the plan's pages shrinks every variant's ring, one
    /// above leaves it, and a count that is not a multiple of the warp pairs is an error that
    /// names the variable.
    #[test]
    fn the_page_cap_shrinks_the_ring_in_warp_pair_steps() {
        use super::{cap_pages, kernel_variants};
        let c = crate::model::presets::by_name("llama-3.2-3b").unwrap();
        let buckets = preset_buckets(&c, 161);
        let list: Vec<_> = buckets.iter().map(|b| (b.upto, &b.schedule)).collect();
        let plan =
            || kernel_variants(&c, Default::default(), &list, 232_448, true, true, true).unwrap();
        let pages = |p: &super::KernelVariants| p.specs.iter().map(|s| s.pages).collect::<Vec<_>>();
        let full = plan();
        assert!(pages(&full).iter().all(|&p| p == 12), "{:?}", pages(&full));
        let mut capped = plan();
        cap_pages(&mut capped, 8).unwrap();
        assert!(pages(&capped).iter().all(|&p| p == 8));
        let mut above = plan();
        cap_pages(&mut above, 16).unwrap();
        assert_eq!(pages(&above), pages(&full));
        let e = cap_pages(&mut plan(), 6).unwrap_err().to_string();
        assert!(
            e.contains("MEGAINFER_MK_MAX_PAGES") && e.contains('6'),
            "{e}"
        );
    }

    /// Llama-1B's buckets at 128K (4K to 128K one bucket of 16 parts) get a cut at 64K with the
    /// same schedule, and only the range from 4K to 64K takes two K/V tiles in flight; so is
    /// Llama-3.2-3B's 1K to 128K at 4K too. Buckets whose bounds are already 4K and 64K are
    /// left alone.
    #[test]
    fn a_split_kv_bucket_across_64k_is_cut_there() {
        use super::{split_at_kv_bound, KV_TWO_IN_FLIGHT_UPTO};
        let c = crate::model::presets::by_name("llama-3.2-1b").unwrap();
        let long = preset_buckets(&c, 131_072);
        let before: Vec<usize> = long.iter().map(|b| b.upto).collect();
        let after = split_at_kv_bound(long.iter().map(|b| (b.upto, &b.schedule)));
        let uptos: Vec<usize> = after.iter().map(|b| b.0).collect();
        assert_eq!(uptos.len(), before.len() + 1, "{before:?} -> {uptos:?}");
        let cut = uptos
            .iter()
            .position(|&u| u == KV_TWO_IN_FLIGHT_UPTO)
            .unwrap();
        assert_eq!(uptos[cut + 1], 131_072);
        assert!(std::ptr::eq(after[cut].1, after[cut + 1].1));
        assert!(after[cut].1.options.attn_parts > 1);
        // Only the split-KV range from 4K to 64K streams its K/V with 2 tiles in flight.
        let two = super::kv_two_in_flight(&after);
        assert_eq!(two.iter().filter(|&&t| t).count(), 1, "{uptos:?}: {two:?}");
        assert!(two[cut] && after[cut - 1].0 == 4096, "{uptos:?}: {two:?}");
        // Llama-3.2-3B's 1K to 128K (one bucket of 16 parts) is cut at 4K and at 64K.
        let c3 = crate::model::presets::by_name("llama-3.2-3b").unwrap();
        let b3 = preset_buckets(&c3, 131_072);
        let u3: Vec<usize> = split_at_kv_bound(b3.iter().map(|b| (b.upto, &b.schedule)))
            .iter()
            .map(|b| b.0)
            .collect();
        let tail: Vec<usize> = u3.iter().copied().filter(|&u| u > 1024).collect();
        assert_eq!(tail, [4096, 65_536, 131_072], "{u3:?}");
        assert!(
            b3.iter().all(|b| b.upto != 4096),
            "4K is not a scheduler bound here: {u3:?}"
        );
        for max_seq in [4096, 65_536] {
            let short = preset_buckets(&c, max_seq);
            let same: Vec<usize> = split_at_kv_bound(short.iter().map(|b| (b.upto, &b.schedule)))
                .iter()
                .map(|b| b.0)
                .collect();
            assert_eq!(same, short.iter().map(|b| b.upto).collect::<Vec<_>>());
        }
    }

    #[test]
    fn the_wait_timeout_is_parsed_strictly() {
        use super::{parse_wait_timeout_ms, DEFAULT_WAIT_TIMEOUT_MS};
        assert_eq!(
            parse_wait_timeout_ms(None).unwrap(),
            DEFAULT_WAIT_TIMEOUT_MS
        );
        assert_eq!(parse_wait_timeout_ms(Some("600000")).unwrap(), 600_000);
        assert_eq!(parse_wait_timeout_ms(Some(" 50 ")).unwrap(), 50);
        for bad in ["0", "-5", "2s", "", "600001"] {
            let e = parse_wait_timeout_ms(Some(bad)).unwrap_err().to_string();
            assert!(
                e.contains("MEGAINFER_WAIT_TIMEOUT_MS") && e.contains(&format!("'{bad}'")),
                "{e}"
            );
        }
    }

    #[test]
    fn the_last_kv_writer_of_each_sm_is_found() {
        // Three SMs: [QKV, attention, O-proj], [attention, down], [] (no instructions).
        let ops = [
            opcode::RMS_QKV_ROPE,
            opcode::ATTENTION,
            opcode::O_PROJ_RESIDUAL,
            opcode::ATTENTION,
            opcode::DOWN_PROJ_PARTIAL,
        ];
        let words: Vec<u32> = ops
            .iter()
            .flat_map(|&op| std::iter::once(op).chain(std::iter::repeat_n(0, WORDS - 1)))
            .collect();
        let offsets = [0, 3, 5, 5];
        // Without q/k norms only QKV writes K/V rows.
        assert_eq!(
            last_kv_writers(&words, &offsets, false),
            [0, u32::MAX, u32::MAX]
        );
        // With them attention writes the finished K row too.
        assert_eq!(last_kv_writers(&words, &offsets, true), [1, 3, u32::MAX]);
    }
}

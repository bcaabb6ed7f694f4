//! Granularity of the schedule and the cost model that picks it.
//!
//! The cost of an instruction, in bytes-equivalent, is the HBM bytes it streams (bf16 weights,
//! plus the bf16 KV cache for attention) plus a fixed cost standing for the per-instruction
//! latency (waiting, signalling, pipeline fill). Activation reads (f32 vectors of a few KiB,
//! shared by all SMs) hit L2 and are left out. Each granularity is chosen so that the most
//! loaded SM of its stage carries as little as possible: `rounds × (rows × bytes_per_row +
//! fixed)`, `rounds = ceil(instructions / sm_count)`.

use std::ops::RangeInclusive;

use serde::{Deserialize, Serialize};

use crate::{build, GpuShape, ModelShape, Schedule, ScheduleError};

/// Matrix-vector instructions cover whole 4-row steps (the megakernel's mat-vec loop takes
/// four rows at a time), except where the dimension itself is smaller. A coarser step left
/// small models' stages on a fraction of the SMs, each instruction then taking longer.
const ROW_GRANULE: usize = 4;
/// The most split-KV partitions the cost model picks per KV head; the megakernel's reduction
/// by rounds keeps two floats per (query head, part) of a KV head in its attention scratch,
/// which holds 128 parts (the form by warp shuffles has no such bound).
pub const MAX_ATTN_PARTS: usize = 128;
/// What each split-KV part adds to its KV head's reduction, µs: `AttnReduce` reads every
/// part's output, max and sum, the first 16 parts in one round trip to L2, then 8 per round
/// trip. Fitted to the megakernel's times per token with an earlier, slower merge
/// (shared-memory tables and two barriers) over the part counts measured on an H100 (SmolLM2
/// at 2K and 8K, Qwen2.5-0.5B, Llama-1B, Llama-3.2-3B and Qwen3-0.6B at 8K, Llama-1B at
/// 32K), together with the 2 µs per instruction of [`CostModel::megakernel`]; without it the
/// model filled every SM with parts, and few-KV-head shapes lost 6-16% to the extra reduction
/// (BENCHMARKS.md). With the current merge SmolLM2 at 8K is 2% faster at 32 parts than at the
/// 21 this picks, so a refit over the same cases may lower it.
pub const REDUCE_PART_US: f64 = 0.15;
/// What each query head beyond the first adds to an `Attention` instruction, µs: its scores,
/// softmax and weighted values, which the instruction's warps compute one after another.
/// Fitted to the H100 measurements of one query head an instruction against the whole group
/// (BENCHMARKS.md, 2026-11-27): a layer 0.3-0.6 µs shorter per head taken out of an
/// instruction (SmolLM2, Qwen2.5-0.5B, Llama-3.2-1B and Qwen3-0.6B at one part; the head_dim-128
/// shapes against their five parts and merge).
pub const ATTN_HEAD_US: f64 = 0.3;

/// Machine and workload figures the granularity and the time estimate are computed from.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CostModel {
    /// Streaming read bandwidth of the whole GPU, GB/s (1e9 bytes per second).
    pub bandwidth_gbps: f64,
    /// Time an instruction costs beyond streaming its bytes, µs.
    pub latency_us: f64,
    /// Sequence length attention is costed at (KV positions read per token).
    pub context: usize,
}

/// The values a [`CostModel`] may take; anything outside is refused by [`CostModel::check`].
pub const BANDWIDTH_GBPS: RangeInclusive<f64> = 1.0..=100_000.0;
pub const LATENCY_US: RangeInclusive<f64> = 0.001..=1000.0;
pub const CONTEXT: RangeInclusive<usize> = 1..=1 << 24;

impl Default for CostModel {
    /// The megakernel's model at a 1024-token context (see [`CostModel::megakernel`]).
    fn default() -> Self {
        CostModel::megakernel(1024)
    }
}

impl CostModel {
    /// What the megakernel's schedules are built with: an H100 SXM's measured streaming
    /// bandwidth (3110 GB/s) and 2 µs per instruction beyond its bytes (a hop between SMs,
    /// preparing, storing, as measured; a higher fixed cost also keeps short contexts from
    /// paying an extra split-KV reduction hop), attention costed at `context` positions.
    pub fn megakernel(context: usize) -> CostModel {
        CostModel {
            bandwidth_gbps: 3110.0,
            latency_us: 2.0,
            context,
        }
    }

    /// Refuses values no GPU or sequence has (zero, negative, NaN, absurdly large), naming
    /// the field and its allowed range.
    pub fn check(&self) -> Result<(), ScheduleError> {
        let bad = |what: &str, v: String, range: String| {
            Err(ScheduleError::Cost(format!(
                "{what} = {v} is outside {range}"
            )))
        };
        if !BANDWIDTH_GBPS.contains(&self.bandwidth_gbps) {
            return bad(
                "bandwidth_gbps",
                self.bandwidth_gbps.to_string(),
                format!("{BANDWIDTH_GBPS:?}"),
            );
        }
        if !LATENCY_US.contains(&self.latency_us) {
            return bad(
                "latency_us",
                self.latency_us.to_string(),
                format!("{LATENCY_US:?}"),
            );
        }
        if !CONTEXT.contains(&self.context) {
            return bad("context", self.context.to_string(), format!("{CONTEXT:?}"));
        }
        Ok(())
    }

    /// Bytes one SM streams per µs when all SMs stream at once.
    pub fn sm_bytes_per_us(&self, gpu: &GpuShape) -> f64 {
        self.bandwidth_gbps * 1e3 / gpu.sm_count as f64
    }

    /// The per-instruction latency expressed as bytes one SM could have streamed meanwhile.
    pub fn fixed_cost_bytes(&self, gpu: &GpuShape) -> u64 {
        (self.latency_us * self.sm_bytes_per_us(gpu)).round() as u64
    }

    /// [`REDUCE_PART_US`] as bytes one SM could have streamed meanwhile.
    pub fn reduce_part_bytes(&self, gpu: &GpuShape) -> u64 {
        (REDUCE_PART_US * self.sm_bytes_per_us(gpu)).round() as u64
    }

    /// [`ATTN_HEAD_US`] as bytes one SM could have streamed meanwhile.
    pub fn attn_head_bytes(&self, gpu: &GpuShape) -> u64 {
        (ATTN_HEAD_US * self.sm_bytes_per_us(gpu)).round() as u64
    }
}

/// How finely each stage is cut into instructions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Options {
    /// RoPE pairs per `RmsQkvRope` (it computes `2 × qkv_pairs` rows of one head).
    pub qkv_pairs: usize,
    /// 0: each head's pairs cut into pieces of `qkv_pairs`. Otherwise exactly this many
    /// `RmsQkvRope` a layer: head `h` of the `H` in the stage's order takes
    /// `⌊P(h+1)/H⌋ − ⌊Ph/H⌋` of them, its pairs split evenly between them in steps of two
    /// ([`qkv_cuts`]). With P a multiple of the SM count each SM gets instructions of about the
    /// same size, where `qkv_pairs` must cut every head alike (Qwen3-4B: 96 instructions of 32
    /// pairs on 132 SMs leave 36 without any).
    #[serde(default)]
    pub qkv_pieces: usize,
    pub oproj_rows: usize,
    /// Rows of gate and of up per `RmsUpGateSilu`; instructions never straddle a down chunk.
    pub upgate_rows: usize,
    pub down_rows: usize,
    /// The intermediate dimension is cut into this many k-chunks: chunk `c` covers
    /// `[c·w, min((c+1)·w, I))` with `w = ⌈I / chunks⌉` rounded up to a multiple of
    /// [`CHUNK_ALIGN`] columns ([`chunk_cols`]).
    pub down_chunks: usize,
    /// Split-KV partitions per KV head; 1 means attention writes its output directly.
    pub attn_parts: usize,
    /// Query heads per `Attention` instruction: 0 for the whole group of a KV head, else a
    /// divisor of the group (each share of the group then reads the KV head's rows itself),
    /// only with one part (`AttnReduce` merges whole groups).
    #[serde(default)]
    pub attn_heads: usize,
    pub lmhead_rows: usize,
    /// Fixed cost per instruction in bytes-equivalent, used to balance SMs.
    pub fixed_cost_bytes: u64,
    /// Sequence length attention is costed at.
    pub context: usize,
}

impl Options {
    /// Granularity chosen by the cost model (see the module documentation).
    pub fn auto(model: &ModelShape, gpu: &GpuShape, cost: &CostModel) -> Options {
        let sms = gpu.sm_count.max(1);
        let fixed = cost.fixed_cost_bytes(gpu);
        let (h, i, hd) = (model.hidden, model.intermediate, model.head_dim);
        let down_chunks = down_chunks(model, gpu);
        let chunk_len = i.div_ceil(down_chunks);
        let pick = |segments, len, bytes_per_row, granule| {
            best_rows(segments, len, bytes_per_row, fixed, sms, granule)
        };
        let qkv_pairs = pick(model.qkv_heads(), hd / 2, 2 * 2 * h as u64, ROW_GRANULE / 2);
        let (part, context) = (cost.reduce_part_bytes(gpu), cost.context.max(1));
        let (attn_parts, attn_heads) = attn_shares(
            model,
            sms,
            fixed,
            part,
            cost.attn_head_bytes(gpu),
            context,
            attn_parts(model, sms, fixed, part, context),
        );
        Options {
            qkv_pairs,
            qkv_pieces: qkv_pieces(model, sms, qkv_pairs),
            oproj_rows: pick(1, h, 2 * model.q_dim() as u64, ROW_GRANULE),
            upgate_rows: pick(down_chunks, chunk_len, 2 * 2 * h as u64, ROW_GRANULE),
            down_rows: pick(down_chunks, h, 2 * chunk_len as u64, ROW_GRANULE),
            down_chunks,
            attn_parts,
            attn_heads,
            lmhead_rows: pick(1, model.vocab, 2 * h as u64, ROW_GRANULE),
            fixed_cost_bytes: fixed,
            context: cost.context.max(1),
        }
    }

    pub(crate) fn check(&self, model: &ModelShape) -> Result<(), ScheduleError> {
        let bad = |why: String| Err(ScheduleError::Options(why));
        let counts = [
            ("qkv_pairs", self.qkv_pairs),
            ("oproj_rows", self.oproj_rows),
            ("upgate_rows", self.upgate_rows),
            ("down_rows", self.down_rows),
            ("down_chunks", self.down_chunks),
            ("attn_parts", self.attn_parts),
            ("lmhead_rows", self.lmhead_rows),
        ];
        for (name, v) in counts {
            if v == 0 {
                return bad(format!("{name} must be positive"));
            }
        }
        let range = qkv_pieces_range(model);
        if self.qkv_pieces != 0 && !range.contains(&self.qkv_pieces) {
            return bad(format!(
                "qkv_pieces = {} is outside {}..={} (every head at least one piece, \
                 a piece at least {} pairs)",
                self.qkv_pieces,
                range.start(),
                range.end(),
                qkv_step(model.head_dim / 2)
            ));
        }
        if self.qkv_pairs > model.head_dim / 2 {
            return bad(format!(
                "qkv_pairs = {} exceeds head_dim/2 = {}",
                self.qkv_pairs,
                model.head_dim / 2
            ));
        }
        if self.down_chunks > model.intermediate {
            return bad(format!(
                "down_chunks = {} exceeds intermediate = {}",
                self.down_chunks, model.intermediate
            ));
        }
        if self.attn_parts > 1 << 16 {
            return bad(format!("attn_parts = {} exceeds 65536", self.attn_parts));
        }
        let group = model.group();
        if self.attn_heads != 0 && !group.is_multiple_of(self.attn_heads) {
            return bad(format!(
                "attn_heads = {} does not divide the {group} query heads of a KV head",
                self.attn_heads
            ));
        }
        if self.attn_heads_of(model) < group && self.attn_parts > 1 {
            return bad(format!(
                "attn_heads = {} needs attn_parts = 1 (the split-KV merge takes whole groups), \
                 not {}",
                self.attn_heads, self.attn_parts
            ));
        }
        Ok(())
    }

    /// How a schedule's output names a share of a group: "" for whole groups, else " of N
    /// query head(s)".
    pub fn attn_heads_label(&self) -> String {
        match self.attn_heads {
            0 => String::new(),
            n => format!(" of {n} query head{}", if n == 1 { "" } else { "s" }),
        }
    }

    /// Query heads per `Attention` instruction ([`Options::attn_heads`], 0 read as the group).
    pub fn attn_heads_of(&self, model: &ModelShape) -> usize {
        if self.attn_heads == 0 {
            model.group()
        } else {
            self.attn_heads
        }
    }
}

/// `(start, count)` pieces of at most `rows` covering `range`.
pub(crate) fn pieces(
    range: std::ops::Range<usize>,
    rows: usize,
) -> impl Iterator<Item = (u32, u32)> {
    let end = range.end;
    range
        .step_by(rows)
        .map(move |s| (s as u32, (rows.min(end - s)) as u32))
}

/// The step `qkv_pieces` cuts a head's `half` pairs in: two pairs (a 4-row step of the
/// mat-vec, as [`ROW_GRANULE`]) where `half` is even.
pub fn qkv_step(half: usize) -> usize {
    if half.is_multiple_of(2) {
        2
    } else {
        1
    }
}

/// The `(pair_start, pair_count)` of each `RmsQkvRope` of head `h` (of `heads`, in the stage's
/// order) over its `half` pairs: as [`Options::qkv_pieces`] says, or pieces of `qkv_pairs`.
pub fn qkv_cuts(o: &Options, h: usize, heads: usize, half: usize) -> Vec<(u32, u32)> {
    if o.qkv_pieces == 0 {
        return pieces(0..half, o.qkv_pairs.max(1)).collect();
    }
    let n = o.qkv_pieces * (h + 1) / heads - o.qkv_pieces * h / heads;
    let step = qkv_step(half);
    let steps = half.div_ceil(step);
    let n = n.clamp(1, steps);
    (0..n)
        .map(|k| {
            let (a, b) = (
                (steps * k / n) * step,
                (steps * (k + 1) / n * step).min(half),
            );
            (a as u32, (b - a) as u32)
        })
        .collect()
}

/// Down chunks start on multiples of this many columns: a chunk of a row is one bulk copy,
/// which wants 16-byte-aligned addresses (8 bf16 columns), and a quantised row's chunk must
/// hold whole 32-column blocks (9,728 columns in 3 chunks cut at `c·I/chunks` start at
/// column 3,242: a misaligned copy).
pub const CHUNK_ALIGN: usize = 32;

/// Columns of down chunk `c` of `chunks` over `intermediate` columns: every chunk but the
/// last is `⌈intermediate / chunks⌉` rounded up to [`CHUNK_ALIGN`] columns wide (or to 8, the
/// 16 bytes of bf16 a bulk copy needs, where 32 would leave the last chunk empty). Tiny test
/// shapes where neither fits are cut at `c·I/chunks`.
pub fn chunk_cols(intermediate: usize, chunks: usize, c: usize) -> std::ops::Range<usize> {
    let (i, chunks) = (intermediate, chunks.max(1));
    for align in [CHUNK_ALIGN, 8] {
        let w = i.div_ceil(chunks).next_multiple_of(align);
        if (chunks - 1) * w < i {
            return (c * w).min(i)..((c + 1) * w).min(i);
        }
    }
    c * i / chunks..(c + 1) * i / chunks
}

/// The fewest chunks whose f32 slice of the intermediate activation fits one shared-memory
/// page: a down-proj instruction keeps its input slice in a single page.
fn down_chunks(model: &ModelShape, gpu: &GpuShape) -> usize {
    let per_page = (gpu.page_bytes / 4).max(1);
    model
        .intermediate
        .div_ceil(per_page)
        .clamp(1, model.intermediate)
}

/// `RmsQkvRope` instructions a layer ([`Options::qkv_pieces`]): one per SM where pieces of
/// `qkv_pairs` fill one round but leave more than a fifth of the SMs without any (Llama-3.2-1B:
/// 96 of 132 SMs with 16 pairs each; one piece per SM measured 0.9-1.2% faster a token in three
/// of four rounds), else 0 (pieces of `qkv_pairs`). Not with Qwen3's q/k norms: Qwen3-4B, 96
/// of 132 likewise, measured 1.5% slower with 132 pieces (264: level). Shapes that fill more
/// SMs (SmolLM2 120, Qwen2.5-0.5B 108 of 132) gained nothing (BENCHMARKS.md 2026-11-27).
fn qkv_pieces(model: &ModelShape, sms: usize, qkv_pairs: usize) -> usize {
    let n = model.qkv_heads() * (model.head_dim / 2).div_ceil(qkv_pairs.max(1));
    let idle_fifth = n < sms && 5 * (sms - n) > sms;
    if model.qk_norm || !idle_fifth || !qkv_pieces_range(model).contains(&sms) {
        return 0;
    }
    sms
}

/// The `qkv_pieces` a model allows: every head at least one piece, a piece at least
/// [`qkv_step`] pairs.
fn qkv_pieces_range(model: &ModelShape) -> RangeInclusive<usize> {
    let (heads, half) = (model.qkv_heads(), model.head_dim / 2);
    heads..=heads * half.div_ceil(qkv_step(half))
}

/// Rows per instruction minimising the stage's most loaded SM, for `segments` independent
/// runs of `len` rows (instructions never straddle segments). Ties go to bigger instructions.
fn best_rows(
    segments: usize,
    len: usize,
    bytes_per_row: u64,
    fixed: u64,
    sms: usize,
    granule: usize,
) -> usize {
    if len <= granule {
        return len.max(1);
    }
    let candidates = (granule..len).step_by(granule).chain([len]);
    let mut best = (u64::MAX, len);
    for rows in candidates {
        let n = segments * len.div_ceil(rows);
        let span = n.div_ceil(sms) as u64 * (rows as u64 * bytes_per_row + fixed);
        if span <= best.0 {
            best = (span, rows);
        }
    }
    best.1
}

/// Split-KV partitions per KV head minimising the attention stage plus the reduction it then
/// needs: `rounds × (part bytes + fixed) + reduction`, `rounds = ceil(kv_heads × parts / SMs)`,
/// the reduction a fixed cost plus `part` per part ([`REDUCE_PART_US`]). Every count up to
/// [`MAX_ATTN_PARTS`] is a candidate, not only powers of two; the two terms meet where a part's
/// share of the cache costs about what one more part costs the reduction (SmolLM2's 3 KV heads
/// take 24 parts at 8K: 72 SMs stream the cache, rather than 132 SMs in 44 parts whose
/// reduction costs more than the bytes saved). Ties go to fewer parts.
pub fn attn_parts(model: &ModelShape, sms: usize, fixed: u64, part: u64, context: usize) -> usize {
    let mut best = (u64::MAX, 1);
    for parts in 1..=MAX_ATTN_PARTS.min(context.max(1)) {
        let cost = attn_stage_cost(model, sms, fixed, part, context, parts);
        if cost < best.0 {
            best = (cost, parts);
        }
    }
    best.1
}

/// The cost model's figure for the attention stage (and its reduction) with `parts` per KV
/// head at `context` positions, in bytes-equivalent on the most loaded SM; `part` is what each
/// part adds to the reduction.
pub fn attn_stage_cost(
    model: &ModelShape,
    sms: usize,
    fixed: u64,
    part: u64,
    context: usize,
    parts: usize,
) -> u64 {
    let head_bytes = (2 * 2 * context * model.head_dim) as u64;
    let kv = model.kv_heads;
    let parts = parts.max(1);
    let attn =
        (kv * parts).div_ceil(sms.max(1)) as u64 * (head_bytes.div_ceil(parts as u64) + fixed);
    let reduce = if parts > 1 {
        kv.div_ceil(sms.max(1)) as u64 * (fixed + parts as u64 * part)
    } else {
        0
    };
    attn + reduce
}

/// The attention's cut at `context` positions: `parts` split-KV parts of whole groups (as
/// [`attn_parts`] chose them), or one part with each instruction a share of a KV head's query
/// heads, `(1, share)`, where that costs less. Each query head beyond an instruction's first
/// adds `head` ([`ATTN_HEAD_US`]); a share reads its KV head's rows itself. `(parts, 0)` for
/// whole groups, as [`Options::attn_heads`] has it. Ties go to whole groups.
pub fn attn_shares(
    model: &ModelShape,
    sms: usize,
    fixed: u64,
    part: u64,
    head: u64,
    context: usize,
    parts: usize,
) -> (usize, usize) {
    let (g, sms) = (model.group(), sms.max(1));
    let extra = |share: usize| (share.max(1) as u64 - 1) * head;
    let whole_rounds = (model.kv_heads * parts.max(1)).div_ceil(sms) as u64;
    let whole = attn_stage_cost(model, sms, fixed, part, context, parts) + whole_rounds * extra(g);
    let head_bytes = (2 * 2 * context * model.head_dim) as u64;
    let mut best = (whole, parts, 0);
    for share in (1..g).filter(|s| g.is_multiple_of(*s)) {
        let rounds = (model.kv_heads * g / share).div_ceil(sms) as u64;
        let cost = rounds * (head_bytes + fixed + extra(share));
        if cost < best.0 {
            best = (cost, 1, share);
        }
    }
    (best.1, best.2)
}

/// Granularity chosen by hand instead of by the cost model, field by field.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Overrides {
    pub qkv_pairs: Option<usize>,
    pub qkv_pieces: Option<usize>,
    pub oproj_rows: Option<usize>,
    pub upgate_rows: Option<usize>,
    pub down_rows: Option<usize>,
    pub down_chunks: Option<usize>,
    pub attn_parts: Option<usize>,
    pub attn_heads: Option<usize>,
    pub lmhead_rows: Option<usize>,
}

impl Overrides {
    pub fn apply(&self, auto: Options) -> Options {
        Options {
            qkv_pairs: self.qkv_pairs.unwrap_or(auto.qkv_pairs),
            // Pairs set alone cut the heads by those pairs, not the cost model's pieces.
            qkv_pieces: self.qkv_pieces.unwrap_or(if self.qkv_pairs.is_some() {
                0
            } else {
                auto.qkv_pieces
            }),
            oproj_rows: self.oproj_rows.unwrap_or(auto.oproj_rows),
            upgate_rows: self.upgate_rows.unwrap_or(auto.upgate_rows),
            down_rows: self.down_rows.unwrap_or(auto.down_rows),
            down_chunks: self.down_chunks.unwrap_or(auto.down_chunks),
            attn_parts: self.attn_parts.unwrap_or(auto.attn_parts),
            // Shares of a group only where attention writes its output directly: a heads
            // override leaves the buckets the cost model splits in parts whole, and one given
            // with parts of its own is kept, for `check` to refuse.
            attn_heads: if self.attn_parts.unwrap_or(auto.attn_parts) > 1 {
                self.attn_heads
                    .filter(|_| self.attn_parts.is_some())
                    .unwrap_or(0)
            } else {
                self.attn_heads.unwrap_or(auto.attn_heads)
            },
            lmhead_rows: self.lmhead_rows.unwrap_or(auto.lmhead_rows),
            ..auto
        }
    }
}

/// The schedule of `model` on `gpu`: the cost model's granularity with `overrides` applied,
/// built and validated. The one way the megakernel's schedules are made, so that what
/// `megainfer schedule` prints is what `run` and `bench` execute for the same inputs.
pub fn plan(
    model: &ModelShape,
    gpu: &GpuShape,
    cost: &CostModel,
    overrides: &Overrides,
) -> Result<Schedule, ScheduleError> {
    cost.check()?;
    model.check()?;
    gpu.check(model)?;
    build(
        model,
        gpu,
        &overrides.apply(Options::auto(model, gpu, cost)),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn down_chunks_start_on_aligned_columns_and_cover_the_row() {
        for (i, chunks) in [
            (9728, 3),
            (18944, 5),
            (14336, 4),
            (8192, 2),
            (1536, 1),
            (96, 3),
            (100, 3),
            (5, 4),
        ] {
            let mut next = 0;
            for c in 0..chunks {
                let r = chunk_cols(i, chunks, c);
                assert_eq!(r.start, next, "{i} / {chunks}: chunk {c}");
                let align = if i >= 1536 { CHUNK_ALIGN } else { 1 };
                assert!(
                    r.start.is_multiple_of(align) && !r.is_empty(),
                    "{i} / {chunks}: {r:?}"
                );
                assert!(r.len() <= 4096, "{i} / {chunks}: {r:?}");
                next = r.end;
            }
            assert_eq!(next, i, "{i} / {chunks}");
        }
        // Qwen3-4B: 3,264 + 3,264 + 3,200.
        assert_eq!(chunk_cols(9728, 3, 1), 3264..6528);
    }

    #[test]
    fn short_contexts_take_one_query_head_an_instruction_long_ones_whole_groups() {
        let h100 = GpuShape::h100();
        let shape = |dims, qk_norm| ModelShape::of(dims, 151936, qk_norm);
        for (name, m) in [
            ("llama-3.2-1b", ModelShape::preset("llama-3.2-1b").unwrap()),
            ("smollm2-135m", ModelShape::preset("smollm2-135m").unwrap()),
            ("llama-3.2-3b", ModelShape::preset("llama-3.2-3b").unwrap()),
            ("qwen3-4b", shape([2560, 9728, 36, 32, 8, 128], true)),
            ("qwen2.5-0.5b", shape([896, 4864, 24, 14, 2, 64], false)),
            ("qwen2.5-7b", shape([3584, 18944, 28, 28, 4, 128], false)),
        ] {
            // A chat's first bucket (costed at 161 positions): one part, a head an instruction.
            let o = Options::auto(&m, &h100, &CostModel::megakernel(161));
            o.check(&m).unwrap();
            assert_eq!((o.attn_parts, o.attn_heads), (1, 1), "{name}");
            // At 8K the cache is split into parts of whole groups.
            let o = Options::auto(&m, &h100, &CostModel::megakernel(8192));
            o.check(&m).unwrap();
            assert!(o.attn_parts > 1 && o.attn_heads == 0, "{name}: {o:?}");
        }
        // An override of the parts keeps whole groups where it splits; one of the heads applies
        // where there is one part, and given with parts is refused.
        let m = ModelShape::preset("llama-3.2-1b").unwrap();
        let auto = Options::auto(&m, &h100, &CostModel::megakernel(161));
        let split = Overrides {
            attn_parts: Some(3),
            ..Default::default()
        };
        assert_eq!(split.apply(auto).attn_heads, 0);
        let two = Overrides {
            attn_heads: Some(2),
            ..Default::default()
        };
        assert_eq!(two.apply(auto).attn_heads, 2);
        let long = Options::auto(&m, &h100, &CostModel::megakernel(8192));
        assert_eq!(two.apply(long).attn_heads, 0);
        let both = Overrides {
            attn_parts: Some(3),
            ..two
        };
        assert!(both.apply(auto).check(&m).is_err());
    }

    #[test]
    fn one_qkv_piece_per_sm_only_where_pairs_leave_a_fifth_of_the_sms_idle() {
        let h100 = GpuShape::h100();
        let cost = CostModel::megakernel(160);
        let auto = |m: ModelShape| {
            let o = Options::auto(&m, &h100, &cost);
            o.check(&m).unwrap();
            o.qkv_pieces
        };
        // The bench presets' shapes: [hidden, intermediate, layers, heads, kv heads, head_dim].
        let shape = |dims, qk_norm| ModelShape::of(dims, 151936, qk_norm);
        // 96 instructions of 16 pairs on 132 SMs: one piece each instead.
        assert_eq!(auto(ModelShape::preset("llama-3.2-1b").unwrap()), 132);
        // Qwen3's q/k norms (Qwen3-4B has 96 too), and shapes filling more of the SMs.
        for (name, m) in [
            ("qwen3-4b", shape([2560, 9728, 36, 32, 8, 128], true)),
            ("qwen3-0.6b", shape([1024, 3072, 28, 16, 8, 128], true)),
            ("qwen2.5-0.5b", shape([896, 4864, 24, 14, 2, 64], false)),
            ("qwen2.5-7b", shape([3584, 18944, 28, 28, 4, 128], false)),
            ("llama-3.1-8b", shape([4096, 14336, 32, 32, 8, 128], false)),
            ("smollm2-135m", ModelShape::preset("smollm2-135m").unwrap()),
            ("llama-3.2-3b", ModelShape::preset("llama-3.2-3b").unwrap()),
        ] {
            assert_eq!(auto(m), 0, "{name}");
        }
        // The pairs set alone cut heads by them; pieces set win.
        let m = ModelShape::preset("llama-3.2-1b").unwrap();
        let o = Options::auto(&m, &h100, &cost);
        let pairs = Overrides {
            qkv_pairs: Some(8),
            ..Default::default()
        };
        assert_eq!(
            (pairs.apply(o).qkv_pairs, pairs.apply(o).qkv_pieces),
            (8, 0)
        );
        let both = Overrides {
            qkv_pieces: Some(264),
            ..pairs
        };
        assert_eq!(both.apply(o).qkv_pieces, 264);
        // Fewer SMs than heads: no piece per SM is possible.
        let small = GpuShape {
            sm_count: 40,
            ..h100
        };
        assert_eq!(Options::auto(&m, &small, &cost).qkv_pieces, 0);
    }
}

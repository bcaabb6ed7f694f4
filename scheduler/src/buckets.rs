//! Context buckets: one schedule per range of sequence lengths.
//!
//! How finely attention is split (split-KV parts per KV head) depends on how many positions it
//! reads: a short sequence is best served whole (a split costs a reduction hop per layer for
//! nothing), a long one split so that every SM streams its share of the cache. A sequence
//! grows while it decodes, so the runtime keeps one set of streams per bucket of lengths and
//! switches to the next set when the sequence crosses into the next bucket. Only the
//! attention's partitioning differs between buckets (its split-KV parts, and with one part the
//! query heads an instruction computes); everything else (and so every buffer but the
//! split-KV parts' slots) is the same.
//!
//! The buckets end at `FIRST_BUCKET · 4^k` (64, 256, 1K, 4K, 16K, 64K, ...) and at
//! [`MID_BOUND`] (512), the last one at `max_seq`. Each is costed at the middle of its
//! lengths: the cost model's attention cost is linear in the length for a given part count,
//! so that minimises the mean over the bucket (costed at its end, the short sequences of a
//! bucket would pay a reduction they do not need: a 160-token answer split 16 ways on
//! Llama-1B). Neighbours with the same part count are merged.

use crate::{plan, CostModel, GpuShape, ModelShape, Overrides, Schedule, ScheduleError};

/// The longest sequence of the first bucket.
pub const FIRST_BUCKET: usize = 64;
/// Each bucket's longest sequence is this many times its predecessor's (but for [`MID_BOUND`]).
pub const BUCKET_GROWTH: usize = 4;
/// A bound between 256 and 1024: up to 512 positions one query head an attention instruction
/// (the cost model's cut for the bucket costed at 385) beats the split-KV parts of whole groups
/// that a bucket of 257–1024 takes (costed at 641). Measured on the H100 at a 400-token
/// context with `run`'s buckets for 8192 positions: SmolLM2 0.447 → 0.397 ms a token,
/// Llama-3.2-1B 0.917 → 0.864, Qwen2.5-0.5B 0.581 → 0.524; at 700 (the 513–1024 bucket,
/// costed at 769) level (BENCHMARKS.md).
pub const MID_BOUND: usize = 512;

/// The schedule for sequences of at most `upto` positions (and more than the previous
/// bucket's).
#[derive(Debug, Clone, PartialEq)]
pub struct Bucket {
    pub upto: usize,
    pub schedule: Schedule,
}

/// The longest length of each bucket for sequences of up to `max_seq` positions: 64, 256,
/// 512, 1024, 4096, ... while below `max_seq`, then `max_seq` itself (at least one bucket).
pub fn bucket_bounds(max_seq: usize) -> Vec<usize> {
    let max_seq = max_seq.max(1);
    let mut bounds: Vec<usize> =
        std::iter::successors(Some(FIRST_BUCKET), |b| b.checked_mul(BUCKET_GROWTH))
            .chain(std::iter::once(MID_BOUND))
            .filter(|&b| b < max_seq)
            .collect();
    bounds.sort_unstable();
    bounds.dedup();
    bounds.push(max_seq);
    bounds
}

/// The index of the bucket that a sequence of `len` positions runs in: the first whose bound
/// is at least `len` (the last one for anything longer, which the caller's `max_seq` check
/// refuses before it runs).
pub fn bucket_for(bounds: &[usize], len: usize) -> usize {
    bounds
        .iter()
        .position(|&b| b >= len)
        .unwrap_or(bounds.len().saturating_sub(1))
}

/// The length bucket `k` of `bounds` is costed at: the middle of `(bounds[k-1], bounds[k]]`.
pub fn bucket_context(bounds: &[usize], k: usize) -> usize {
    let lo = if k == 0 { 0 } else { bounds[k - 1] };
    (lo + 1 + bounds[k]).div_ceil(2)
}

/// One schedule per bucket of sequences up to `max_seq` positions: [`plan`] with `cost`'s
/// bandwidth and latency, attention costed at [`bucket_context`], `overrides` applied to
/// every bucket. Neighbouring buckets with the same part count and query heads an instruction
/// become one (the later one's schedule kept, for the longer sequences), so a fixed
/// `attn_parts` override gives a single bucket.
pub fn plan_buckets(
    model: &ModelShape,
    gpu: &GpuShape,
    cost: &CostModel,
    overrides: &Overrides,
    max_seq: usize,
) -> Result<Vec<Bucket>, ScheduleError> {
    plan_buckets_within(model, gpu, cost, overrides, &bucket_bounds(max_seq))
}

/// [`plan_buckets`] over other bounds than [`bucket_bounds`] (for measuring other cuts of the
/// lengths): strictly increasing and positive, the last one the longest sequence.
pub fn plan_buckets_within(
    model: &ModelShape,
    gpu: &GpuShape,
    cost: &CostModel,
    overrides: &Overrides,
    bounds: &[usize],
) -> Result<Vec<Bucket>, ScheduleError> {
    if bounds.is_empty() || bounds[0] == 0 || bounds.windows(2).any(|w| w[0] >= w[1]) {
        return Err(ScheduleError::Options(format!(
            "bucket bounds {bounds:?} are not positive and strictly increasing"
        )));
    }
    let mut out: Vec<Bucket> = Vec::new();
    for (k, &upto) in bounds.iter().enumerate() {
        let at = CostModel {
            context: bucket_context(bounds, k),
            ..*cost
        };
        let schedule = plan(model, gpu, &at, overrides)?;
        match out.last_mut() {
            Some(prev)
                if (
                    prev.schedule.options.attn_parts,
                    prev.schedule.options.attn_heads,
                ) == (schedule.options.attn_parts, schedule.options.attn_heads) =>
            {
                *prev = Bucket { upto, schedule };
            }
            _ => out.push(Bucket { upto, schedule }),
        }
    }
    Ok(out)
}

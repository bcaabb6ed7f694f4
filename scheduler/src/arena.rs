//! Where the tagged activations live on the GPU, and how an element of one is named.
//!
//! The megakernel keeps every buffer that one instruction hands to another in one allocation,
//! the arena, of 64-bit words (an f32 and the step's tag, see [`crate::exec`]). A stalled
//! reader reports the arena offset of an element that never got this step's tag; the host
//! names it `part[index]` with [`ArenaLayout::element`]. The CPU executor uses the same layout
//! and the same names, so a deadlock it finds reads exactly as the GPU's error would.
//!
//! | part | elements | holds |
//! | --- | --- | --- |
//! | `resid_attn` | `[layers][hidden]` | `resid_attn[l]` |
//! | `mlp_part` | `[layers][chunks][hidden]` | `mlp_part[l][c]` |
//! | `q` | `[layers][heads·d]` | `q[l]` |
//! | `kv_new` | `[layers][2][kv_heads·d]` | this step's row of `k_cache[l]` (0), `v_cache[l]` (1) |
//! | `attn_out` | `[layers][heads·d]` | `attn_out[l]` |
//! | `act` | `[layers][intermediate]` | `act[l]` |
//! | `lm_best` | `[max(blocks, 1)][2]` | `lm_best` |
//! | `lm_sample` | `SAMPLE_GATE_WORDS + [blocks][SAMPLE_BLOCK_WORDS] + ⌈vocab / 2⌉` | a sampled step's gate, block summaries and keys, and penalised logits (the GPU's draw only) |
//! | `attn_part` | `[layers][heads][parts][d + 2]` | per slot `attn_part[l]`'s `d` values, then `attn_stats[l]`'s 2 |
//!
//! `resid_attn` comes first: the kernel reports an element by its offset from there.
//! `attn_part` comes last: schedules of one model that differ only in their split-KV parts
//! (the context buckets, see [`crate::buckets`]) agree on every other offset, so one arena,
//! sized for the most parts, serves them all.

use std::ops::Range;

use crate::{Buffer, ModelShape, Span};

/// In a sampled megakernel step the LM-head blocks draw together (megakernel/ops/sample.cuh):
/// `lm_sample` starts with `SAMPLE_GATE_WORDS` words (the hint, statistics), then each block's
/// summary of `SAMPLE_SUMMARY_WORDS` words (nine used; ten keep a block's words even) and
/// `SAMPLE_KEY_SLOTS` keys (a word each), then the vocabulary's penalised logits (two f32 a
/// word). A block with more keys within the hint than its slots sends the draw to its
/// search: replayed on the default model's top-p draws (examples/draw_hints.rs), 256 slots
/// (one store a consumer thread) sent 5 of 640 there, 160 slots 14.
pub const SAMPLE_GATE_WORDS: usize = 8;
pub const SAMPLE_SUMMARY_WORDS: usize = 10;
pub const SAMPLE_KEY_SLOTS: usize = 256;
/// Words per LM-head block in `lm_sample`.
pub const SAMPLE_BLOCK_WORDS: usize = SAMPLE_SUMMARY_WORDS + SAMPLE_KEY_SLOTS;

/// The parts of the arena in order, each with its first offset (in 64-bit words).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArenaLayout {
    parts: Vec<(&'static str, usize)>,
    len: usize,
    hidden: usize,
    q_dim: usize,
    kv_dim: usize,
    heads: usize,
    head_dim: usize,
    intermediate: usize,
    chunks: usize,
    attn_parts: usize,
}

impl ArenaLayout {
    /// The layout for `model` with `chunks` down-projection k-chunks, `attn_parts` split-KV
    /// partitions and `lm_blocks` LM-head blocks.
    pub fn new(model: &ModelShape, chunks: usize, attn_parts: usize, lm_blocks: usize) -> Self {
        let (l, h, qd) = (model.layers, model.hidden, model.q_dim());
        let sizes = [
            ("resid_attn", l * h),
            ("mlp_part", l * chunks * h),
            ("q", l * qd),
            ("kv_new", l * 2 * model.kv_dim()),
            ("attn_out", l * qd),
            ("act", l * model.intermediate),
            ("lm_best", 2 * lm_blocks.max(1)),
            (
                "lm_sample",
                SAMPLE_GATE_WORDS + lm_blocks * SAMPLE_BLOCK_WORDS + model.vocab.div_ceil(2),
            ),
            (
                "attn_part",
                l * model.heads * attn_parts * (model.head_dim + 2),
            ),
        ];
        let mut len = 0;
        let parts = sizes
            .iter()
            .map(|&(name, n)| {
                // Every part starts at an even word: lm_sample's keys are 16-byte pairs.
                len += len % 2;
                let start = len;
                len += n;
                (name, start)
            })
            .collect();
        ArenaLayout {
            parts,
            len,
            hidden: h,
            q_dim: qd,
            kv_dim: model.kv_dim(),
            heads: model.heads,
            head_dim: model.head_dim,
            intermediate: model.intermediate,
            chunks,
            attn_parts,
        }
    }

    /// Total 64-bit words.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `(name, first offset)` of every part, in order.
    pub fn parts(&self) -> &[(&'static str, usize)] {
        &self.parts
    }

    /// First offset of part `name`; panics on a name not in the table above.
    pub fn offset(&self, name: &str) -> usize {
        self.parts
            .iter()
            .find(|p| p.0 == name)
            .map(|p| p.1)
            .unwrap_or_else(|| panic!("no arena part {name}"))
    }

    /// `part[index]` for an arena offset, as the megakernel's errors name it.
    pub fn element(&self, offset: usize) -> String {
        match self.parts.iter().rev().find(|p| p.1 <= offset) {
            Some((name, start)) if offset < self.len => format!("{name}[{}]", offset - start),
            _ => format!("arena[{offset}]"),
        }
    }

    /// The arena offsets of `span`'s elements as contiguous runs, in element order; `None`
    /// for buffers outside the arena (see [`Buffer::is_tagged`]).
    pub fn runs(&self, span: &Span) -> Option<Vec<Range<usize>>> {
        let e = span.elements.start as usize..span.elements.end as usize;
        let (hd, slot_words) = (self.head_dim, self.head_dim + 2);
        let linear = |part: &str, base: usize| {
            let o = self.offset(part) + base;
            Some(std::iter::once(o + e.start..o + e.end).collect())
        };
        match span.buffer {
            Buffer::TokenIn | Buffer::TokenOut | Buffer::Logits => None,
            Buffer::ResidAttn { layer } => linear("resid_attn", layer as usize * self.hidden),
            Buffer::MlpPart { layer, chunk } => linear(
                "mlp_part",
                (layer as usize * self.chunks + chunk as usize) * self.hidden,
            ),
            Buffer::Q { layer } => linear("q", layer as usize * self.q_dim),
            Buffer::KCache { layer } => linear("kv_new", 2 * layer as usize * self.kv_dim),
            Buffer::VCache { layer } => linear("kv_new", (2 * layer as usize + 1) * self.kv_dim),
            Buffer::AttnOut { layer } => linear("attn_out", layer as usize * self.q_dim),
            Buffer::Act { layer } => linear("act", layer as usize * self.intermediate),
            Buffer::LmBest => linear("lm_best", 0),
            // Slot s = head·parts + part: d values, then (max, sum).
            Buffer::AttnPart { layer } | Buffer::AttnStats { layer } => {
                let (per_slot, skip) = match span.buffer {
                    Buffer::AttnPart { .. } => (hd, 0),
                    _ => (2, hd),
                };
                let base = self.offset("attn_part")
                    + layer as usize * self.heads * self.attn_parts * slot_words;
                let mut runs = Vec::new();
                let mut i = e.start;
                while i < e.end {
                    let (slot, k) = (i / per_slot, i % per_slot);
                    let n = (per_slot - k).min(e.end - i);
                    let o = base + slot * slot_words + skip + k;
                    runs.push(o..o + n);
                    i += n;
                }
                Some(runs)
            }
        }
    }
}

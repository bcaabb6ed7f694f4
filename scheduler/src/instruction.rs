//! The instruction set, the buffers instructions touch and what each one reads and writes.
//!
//! # Buffers
//!
//! Every activation is f32 and is written exactly once per token by exactly one instruction,
//! so there are no atomics, no zeroing and no write-after-read hazards within a token. Sizes
//! are in elements; `H` = heads, `d` = head_dim, `parts` = attention partitions.
//!
//! | buffer | elements | written by |
//! | --- | --- | --- |
//! | `token_in` | 2 (`token`, `pos`) | the host or the previous launch (an input) |
//! | `token_out` | 2 (`next token`, `pos + 1`) | `Argmax` |
//! | `q[l]` | `H·d`, head-major | `RmsQkvRope` (Q heads) |
//! | `k_cache[l]`, `v_cache[l]` | bf16 `[max_seq, kv_heads·d]`; row `pos` this token | `RmsQkvRope` (K, V heads) |
//! | `attn_part[l]` | `[H, parts, d]` (only when parts > 1) | `Attention` |
//! | `attn_stats[l]` | `[H, parts, 2]`: running max, sum of exp (parts > 1) | `Attention` |
//! | `attn_out[l]` | `H·d` | `Attention` (parts = 1) or `AttnReduce` |
//! | `resid_attn[l]` | hidden | `OProjResidual`: layer input + O projection |
//! | `act[l]` | intermediate | `RmsUpGateSilu`: silu(gate)·up |
//! | `mlp_part[l][c]` | hidden | `DownProjPartial` of k-chunk `c` (partial dot products; chunk 0 adds `resid_attn[l]`) |
//! | `logits` | vocab | `RmsLmHead` |
//! | `lm_best` | `[blocks, 2]`: (max logit as f32 bits, its row) | `RmsLmHead` |
//!
//! The residual stream after layer `l` is never stored: it is the virtual sum
//! `mlp_part[l][0] + mlp_part[l][1] + …` (in order), which each consumer (the next layer's
//! `RmsQkvRope` and `OProjResidual`, and `RmsLmHead`) computes itself for the elements it
//! needs. Chunk 0's `DownProjPartial` adds the attention residual `resid_attn[l]` of its rows
//! into its partial sums, so those readers wait for `chunks` words an element, not one more
//! (a layer's first stage reads the whole residual at every SM). Layer 0's input is the embedding row
//! of `token_in.token`, read straight from the embedding table (no embedding instruction).
//!
//! `token_in` and `token_out` must be distinct memory, since `Argmax` writes the next token
//! while the launch may still read the current one: e.g. two slots, launch `e` reading slot
//! `e % 2` and writing slot `(e + 1) % 2`, so greedy decoding needs no host work between
//! launches and teacher forcing writes slot `e % 2` before launch `e`.
//!
//! The KV cache keeps earlier positions across launches; the validator only tracks row `pos`,
//! the one written this token. Past rows were written by earlier launches, which the kernel
//! boundary orders.
//!
//! # Dependencies
//!
//! [`access`] is the one statement of what an instruction reads and writes, element by
//! element. It is the whole dependency model: on the GPU an instruction proceeds once every
//! element it reads carries the step's tag (the buffers above but `token_in`, `token_out` and
//! `logits` are tagged activations, see [`crate::arena`]), and the scheduler derives its edges
//! ([`crate::deps`]), its validation and its CPU executor ([`crate::exec`]) from it.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::{ModelShape, Options};

/// One instruction's operation and operands. All fields are u32 as in the encoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "type")]
pub enum Op {
    /// RMS-norm of layer `layer`'s input, then rows `pair_start..pair_start+pair_count` and
    /// the matching rows `+ head_dim/2` of head `head` of the concatenated q|k|v projection
    /// (`head < heads`: Q; `< heads + kv_heads`: K head `head - heads`; else V head
    /// `head - heads - kv_heads`). RoPE at `pos` (rotate_half: row `i` pairs with
    /// `i + head_dim/2`) for Q and K, none for V. Q goes to `q[l]`, K/V to the cache row `pos`.
    /// With q/k norms ([`ModelShape::qk_norm`]) Q and K are stored raw, neither normed nor
    /// rotated: `Attention` does both on whole heads.
    RmsQkvRope {
        layer: u32,
        head: u32,
        pair_start: u32,
        pair_count: u32,
    },
    /// Softmax attention of the `G` query heads of `kv_head` over positions
    /// `[part·len/parts, (part+1)·len/parts)`, `len = pos + 1` (integer division, computed at
    /// run time). With `parts == 1` it writes `attn_out`; otherwise it writes, per head, the
    /// normalised partial output to `attn_part` and (max score, Σ exp(score − max)) to
    /// `attn_stats`. An empty range writes max = −∞, sum = 0 and a zero output. Only the
    /// last part reads row `pos` of the cache. With q/k norms it first norms and rotates its
    /// query heads, and the last part this token's K row, which it also stores in the bf16
    /// cache for later tokens (no instruction of this token reads that copy).
    /// `head_start..head_start + head_count` are the query heads it computes: all `G` of its
    /// KV head, or an equal share of them ([`Options::attn_heads`]); the share that starts the
    /// group is the one that caches the K row.
    Attention {
        layer: u32,
        kv_head: u32,
        part: u32,
        parts: u32,
        head_start: u32,
        head_count: u32,
    },
    /// Combines the parts of every head of `kv_head`: `M = max m_p`, `w_p = s_p·exp(m_p − M)`,
    /// `out = Σ w_p·o_p / Σ w_p`, into `attn_out`.
    AttnReduce {
        layer: u32,
        kv_head: u32,
        parts: u32,
    },
    /// `resid_attn[l][r] = input_l[r] + W_o[r, :]·attn_out[l]` for the rows.
    OProjResidual {
        layer: u32,
        row_start: u32,
        row_count: u32,
    },
    /// RMS-norm of `resid_attn[l]`, then `act[l][r] = silu(W_gate[r]·x)·(W_up[r]·x)`.
    RmsUpGateSilu {
        layer: u32,
        row_start: u32,
        row_count: u32,
    },
    /// `mlp_part[l][chunk][r] = W_down[r, cols]·act[l][cols]`, `cols = col_start..+col_count`,
    /// plus `resid_attn[l][r]` for chunk 0.
    DownProjPartial {
        layer: u32,
        row_start: u32,
        row_count: u32,
        chunk: u32,
        col_start: u32,
        col_count: u32,
    },
    /// Final RMS-norm of the last layer's output, f32 logits of the rows and their
    /// (max, first row reaching it) into `lm_best[block]`.
    RmsLmHead {
        row_start: u32,
        row_count: u32,
        block: u32,
    },
    /// First maximum over `lm_best[0..blocks]` (blocks in row order, so ties go to the lowest
    /// token id); writes `token_out = (row, pos + 1)`.
    Argmax { blocks: u32 },
}

/// The stage an instruction belongs to; the global order runs stage by stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum StageKind {
    Qkv,
    Attention,
    AttnReduce,
    OProj,
    UpGate,
    Down,
    LmHead,
    Argmax,
}

impl StageKind {
    pub const ALL: [StageKind; 8] = [
        StageKind::Qkv,
        StageKind::Attention,
        StageKind::AttnReduce,
        StageKind::OProj,
        StageKind::UpGate,
        StageKind::Down,
        StageKind::LmHead,
        StageKind::Argmax,
    ];

    /// The instruction's name.
    pub fn name(self) -> &'static str {
        match self {
            StageKind::Qkv => "RmsQkvRope",
            StageKind::Attention => "Attention",
            StageKind::AttnReduce => "AttnReduce",
            StageKind::OProj => "OProjResidual",
            StageKind::UpGate => "RmsUpGateSilu",
            StageKind::Down => "DownProjPartial",
            StageKind::LmHead => "RmsLmHead",
            StageKind::Argmax => "Argmax",
        }
    }
}

impl Op {
    pub fn kind(&self) -> StageKind {
        match self {
            Op::RmsQkvRope { .. } => StageKind::Qkv,
            Op::Attention { .. } => StageKind::Attention,
            Op::AttnReduce { .. } => StageKind::AttnReduce,
            Op::OProjResidual { .. } => StageKind::OProj,
            Op::RmsUpGateSilu { .. } => StageKind::UpGate,
            Op::DownProjPartial { .. } => StageKind::Down,
            Op::RmsLmHead { .. } => StageKind::LmHead,
            Op::Argmax { .. } => StageKind::Argmax,
        }
    }

    /// The decoder layer, `None` for the LM head and the argmax.
    pub fn layer(&self) -> Option<u32> {
        match *self {
            Op::RmsQkvRope { layer, .. }
            | Op::Attention { layer, .. }
            | Op::AttnReduce { layer, .. }
            | Op::OProjResidual { layer, .. }
            | Op::RmsUpGateSilu { layer, .. }
            | Op::DownProjPartial { layer, .. } => Some(layer),
            Op::RmsLmHead { .. } | Op::Argmax { .. } => None,
        }
    }

    /// HBM bytes the instruction streams: bf16 weights, and for attention the bf16 KV cache
    /// of its share of `context` positions.
    pub fn hbm_bytes(&self, m: &ModelShape, context: usize) -> u64 {
        let (h, hd) = (m.hidden as u64, m.head_dim as u64);
        match *self {
            Op::RmsQkvRope { pair_count, .. } => 2 * 2 * pair_count as u64 * h,
            Op::Attention { part, parts, .. } => {
                let (p, n, ctx) = (part as u64, parts as u64, context as u64);
                let positions = (p + 1) * ctx / n - p * ctx / n;
                2 * 2 * positions * hd
            }
            Op::AttnReduce { .. } | Op::Argmax { .. } => 0,
            Op::OProjResidual { row_count, .. } => 2 * row_count as u64 * m.q_dim() as u64,
            Op::RmsUpGateSilu { row_count, .. } => 2 * 2 * row_count as u64 * h,
            Op::DownProjPartial {
                row_count,
                col_count,
                ..
            } => 2 * row_count as u64 * col_count as u64,
            Op::RmsLmHead { row_count, .. } => 2 * row_count as u64 * h,
        }
    }
}

/// A buffer of the table in the module documentation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Buffer {
    TokenIn,
    TokenOut,
    Q { layer: u32 },
    KCache { layer: u32 },
    VCache { layer: u32 },
    AttnPart { layer: u32 },
    AttnStats { layer: u32 },
    AttnOut { layer: u32 },
    ResidAttn { layer: u32 },
    Act { layer: u32 },
    MlpPart { layer: u32, chunk: u32 },
    Logits,
    LmBest,
}

impl Buffer {
    /// Inputs of a launch: read, never written by an instruction.
    pub fn is_input(self) -> bool {
        self == Buffer::TokenIn
    }

    /// Whether the megakernel hands this buffer between instructions as tagged activations
    /// (see [`crate::arena`]). The others are the launch's input (`token_in`) and outputs
    /// only the host reads (`token_out`, `logits`).
    pub fn is_tagged(self) -> bool {
        !matches!(self, Buffer::TokenIn | Buffer::TokenOut | Buffer::Logits)
    }
}

impl Buffer {
    /// Elements of this buffer in a schedule of `model` with `opts` and `lm_blocks` LM-head
    /// blocks (for the KV cache: of one row); `None` for a layer or chunk the model does not
    /// have.
    pub fn len(self, model: &ModelShape, opts: &Options, lm_blocks: usize) -> Option<usize> {
        let layer_ok = |l: u32| (l as usize) < model.layers;
        let slots = model.heads * opts.attn_parts;
        let (ok, n) = match self {
            Buffer::TokenIn | Buffer::TokenOut => (true, 2),
            Buffer::Q { layer } | Buffer::AttnOut { layer } => (layer_ok(layer), model.q_dim()),
            Buffer::KCache { layer } | Buffer::VCache { layer } => {
                (layer_ok(layer), model.kv_dim())
            }
            Buffer::AttnPart { layer } => (layer_ok(layer), slots * model.head_dim),
            Buffer::AttnStats { layer } => (layer_ok(layer), slots * 2),
            Buffer::ResidAttn { layer } => (layer_ok(layer), model.hidden),
            Buffer::Act { layer } => (layer_ok(layer), model.intermediate),
            Buffer::MlpPart { layer, chunk } => (
                layer_ok(layer) && (chunk as usize) < opts.down_chunks,
                model.hidden,
            ),
            Buffer::Logits => (true, model.vocab),
            Buffer::LmBest => (true, 2 * lm_blocks),
        };
        ok.then_some(n)
    }
}

/// The name of the table above: `q[l]`, `mlp_part[l][c]`, `token_in`, ….
impl std::fmt::Display for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Buffer::TokenIn => write!(f, "token_in"),
            Buffer::TokenOut => write!(f, "token_out"),
            Buffer::Q { layer } => write!(f, "q[{layer}]"),
            Buffer::KCache { layer } => write!(f, "k_cache[{layer}]"),
            Buffer::VCache { layer } => write!(f, "v_cache[{layer}]"),
            Buffer::AttnPart { layer } => write!(f, "attn_part[{layer}]"),
            Buffer::AttnStats { layer } => write!(f, "attn_stats[{layer}]"),
            Buffer::AttnOut { layer } => write!(f, "attn_out[{layer}]"),
            Buffer::ResidAttn { layer } => write!(f, "resid_attn[{layer}]"),
            Buffer::Act { layer } => write!(f, "act[{layer}]"),
            Buffer::MlpPart { layer, chunk } => write!(f, "mlp_part[{layer}][{chunk}]"),
            Buffer::Logits => write!(f, "logits"),
            Buffer::LmBest => write!(f, "lm_best"),
        }
    }
}

/// `elements` of `buffer` (for the KV cache: of row `pos`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Span {
    pub buffer: Buffer,
    pub elements: Range<u32>,
}

/// What an instruction reads and writes (activations only; weights are read-only).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Access {
    pub reads: Vec<Span>,
    pub writes: Vec<Span>,
}

/// Elements of `token_in` / `token_out`.
const TOKEN: u32 = 0;
const POS: u32 = 1;

fn span(buffer: Buffer, start: u32, len: u32) -> Span {
    Span {
        buffer,
        elements: start..start + len,
    }
}

/// Elements `rows` of the input of `layer` (the output of `layer - 1`, or the embedding).
fn layer_input(layer: u32, rows: Range<u32>, chunks: u32, out: &mut Vec<Span>) {
    if layer == 0 {
        out.push(span(Buffer::TokenIn, TOKEN, 1));
        return;
    }
    let l = layer - 1;
    for chunk in 0..chunks {
        out.push(Span {
            buffer: Buffer::MlpPart { layer: l, chunk },
            elements: rows.clone(),
        });
    }
}

/// The reads and writes of `op` in a schedule of `model` with `opts`.
pub fn access(op: &Op, model: &ModelShape, opts: &Options) -> Access {
    let hd = model.head_dim as u32;
    let half = hd / 2;
    let group = model.group() as u32;
    let hidden = model.hidden as u32;
    let chunks = opts.down_chunks as u32;
    let mut a = Access::default();
    match *op {
        Op::RmsQkvRope {
            layer,
            head,
            pair_start,
            pair_count,
        } => {
            layer_input(layer, 0..hidden, chunks, &mut a.reads);
            a.reads.push(span(Buffer::TokenIn, POS, 1));
            let (heads, kv) = (model.heads as u32, model.kv_heads as u32);
            let (buffer, local) = if head < heads {
                (Buffer::Q { layer }, head)
            } else if head < heads + kv {
                (Buffer::KCache { layer }, head - heads)
            } else {
                (Buffer::VCache { layer }, head - heads - kv)
            };
            let base = local * hd + pair_start;
            a.writes.push(span(buffer, base, pair_count));
            a.writes.push(span(buffer, base + half, pair_count));
        }
        Op::Attention {
            layer,
            kv_head,
            part,
            parts,
            head_start,
            head_count,
        } => {
            a.reads
                .push(span(Buffer::Q { layer }, head_start * hd, head_count * hd));
            a.reads.push(span(Buffer::TokenIn, POS, 1));
            if part + 1 == parts {
                a.reads
                    .push(span(Buffer::KCache { layer }, kv_head * hd, hd));
                a.reads
                    .push(span(Buffer::VCache { layer }, kv_head * hd, hd));
            }
            if parts == 1 {
                a.writes.push(span(
                    Buffer::AttnOut { layer },
                    head_start * hd,
                    head_count * hd,
                ));
            } else {
                for h in head_start..head_start + head_count {
                    let slot = h * parts + part;
                    a.writes
                        .push(span(Buffer::AttnPart { layer }, slot * hd, hd));
                    a.writes
                        .push(span(Buffer::AttnStats { layer }, slot * 2, 2));
                }
            }
        }
        Op::AttnReduce {
            layer,
            kv_head,
            parts,
        } => {
            let slots = kv_head * group * parts..(kv_head + 1) * group * parts;
            a.reads.push(Span {
                buffer: Buffer::AttnPart { layer },
                elements: slots.start * hd..slots.end * hd,
            });
            a.reads.push(Span {
                buffer: Buffer::AttnStats { layer },
                elements: slots.start * 2..slots.end * 2,
            });
            a.writes.push(span(
                Buffer::AttnOut { layer },
                kv_head * group * hd,
                group * hd,
            ));
        }
        Op::OProjResidual {
            layer,
            row_start,
            row_count,
        } => {
            a.reads
                .push(span(Buffer::AttnOut { layer }, 0, model.q_dim() as u32));
            layer_input(
                layer,
                row_start..row_start + row_count,
                chunks,
                &mut a.reads,
            );
            a.writes
                .push(span(Buffer::ResidAttn { layer }, row_start, row_count));
        }
        Op::RmsUpGateSilu {
            layer,
            row_start,
            row_count,
        } => {
            a.reads.push(span(Buffer::ResidAttn { layer }, 0, hidden));
            a.writes
                .push(span(Buffer::Act { layer }, row_start, row_count));
        }
        Op::DownProjPartial {
            layer,
            row_start,
            row_count,
            chunk,
            col_start,
            col_count,
        } => {
            a.reads
                .push(span(Buffer::Act { layer }, col_start, col_count));
            if chunk == 0 {
                a.reads
                    .push(span(Buffer::ResidAttn { layer }, row_start, row_count));
            }
            a.writes
                .push(span(Buffer::MlpPart { layer, chunk }, row_start, row_count));
        }
        Op::RmsLmHead {
            row_start,
            row_count,
            block,
        } => {
            layer_input(model.layers as u32, 0..hidden, chunks, &mut a.reads);
            a.writes.push(span(Buffer::Logits, row_start, row_count));
            a.writes.push(span(Buffer::LmBest, 2 * block, 2));
        }
        Op::Argmax { blocks } => {
            a.reads.push(span(Buffer::LmBest, 0, 2 * blocks));
            a.reads.push(span(Buffer::TokenIn, POS, 1));
            a.writes.push(span(Buffer::TokenOut, 0, 2));
        }
    }
    a
}

//! The words the megakernel interprets.
//!
//! Every instruction is [`WORDS_PER_INSTR`] = 8 u32 words (32 bytes):
//!
//! | word | meaning |
//! | --- | --- |
//! | 0 | opcode (see [`opcode`]) |
//! | 1 | layer (0 for `RmsLmHead` and `Argmax`) |
//! | 2..=7 | six operands `a0..a5`, by opcode below; unused ones are 0 |
//!
//! Nothing else: an instruction's inputs are tagged activations the interpreter waits for
//! where it reads them (what each one reads is [`crate::access`]), so the words carry no
//! waits or signals. The mat-vec instructions leave `a5` 0 here; the megakernel's host writes
//! their tiles there (rows a page and pages, which depend on the weights' storage format:
//! `src/gpu/megakernel/tiles.rs`) before it uploads the words.
//!
//! | opcode | instruction | a0 | a1 | a2 | a3 | a4 |
//! | --- | --- | --- | --- | --- | --- | --- |
//! | 0 | no-op: the interpreter skips it (schedules never contain it; tests use it to remove an instruction) | | | | | |
//! | 1 | `RmsQkvRope` | head | pair_start | pair_count | | |
//! | 2 | `Attention` | kv_head | part | parts | head_start | head_count |
//! | 3 | `AttnReduce` | kv_head | parts | | | |
//! | 4 | `OProjResidual` | row_start | row_count | | | |
//! | 5 | `RmsUpGateSilu` | row_start | row_count | | | |
//! | 6 | `DownProjPartial` | row_start | row_count | chunk | col_start | col_count |
//! | 7 | `RmsLmHead` | row_start | row_count | block | | |
//! | 8 | `Argmax` | blocks | | | | |
//!
//! SM `s` runs instructions `sm_offsets[s] .. sm_offsets[s+1]` (instruction indices, not word
//! indices: instruction `i` is `words[8·i .. 8·i + 8]`) in order.

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::{Op, Schedule};

pub const WORDS_PER_INSTR: usize = 8;

/// Values of word 0.
pub mod opcode {
    pub const NOOP: u32 = 0;
    pub const RMS_QKV_ROPE: u32 = 1;
    pub const ATTENTION: u32 = 2;
    pub const ATTN_REDUCE: u32 = 3;
    pub const O_PROJ_RESIDUAL: u32 = 4;
    pub const RMS_UP_GATE_SILU: u32 = 5;
    pub const DOWN_PROJ_PARTIAL: u32 = 6;
    pub const RMS_LM_HEAD: u32 = 7;
    pub const ARGMAX: u32 = 8;
}

/// A schedule as the GPU receives it, with the constants the kernel is compiled with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Encoded {
    pub words: Vec<u32>,
    /// `sm_count + 1` instruction indices.
    pub sm_offsets: Vec<u32>,
    /// Down-proj k-chunks: the number of `mlp_part` buffers per layer.
    pub down_chunks: u32,
    /// Split-KV partitions per KV head (`attn_part` / `attn_stats` sizes).
    pub attn_parts: u32,
    /// `RmsLmHead` instructions: the number of `lm_best` pairs.
    pub lm_blocks: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum DecodeError {
    #[error("{0} words is not a whole number of {WORDS_PER_INSTR}-word instructions")]
    Length(usize),
    #[error("SM offsets {0:?} are not an increasing cover of the instructions")]
    Offsets(Vec<u32>),
    #[error("instruction {index}: unknown opcode {opcode}")]
    Opcode { index: usize, opcode: u32 },
    #[error("instruction {index}: word {word} should be 0 but is {value}")]
    Padding {
        index: usize,
        word: usize,
        value: u32,
    },
}

fn fields(op: &Op) -> (u32, u32, [u32; 6]) {
    match *op {
        Op::RmsQkvRope {
            layer,
            head,
            pair_start,
            pair_count,
        } => (
            opcode::RMS_QKV_ROPE,
            layer,
            [head, pair_start, pair_count, 0, 0, 0],
        ),
        Op::Attention {
            layer,
            kv_head,
            part,
            parts,
            head_start,
            head_count,
        } => (
            opcode::ATTENTION,
            layer,
            [kv_head, part, parts, head_start, head_count, 0],
        ),
        Op::AttnReduce {
            layer,
            kv_head,
            parts,
        } => (opcode::ATTN_REDUCE, layer, [kv_head, parts, 0, 0, 0, 0]),
        Op::OProjResidual {
            layer,
            row_start,
            row_count,
        } => (
            opcode::O_PROJ_RESIDUAL,
            layer,
            [row_start, row_count, 0, 0, 0, 0],
        ),
        Op::RmsUpGateSilu {
            layer,
            row_start,
            row_count,
        } => (
            opcode::RMS_UP_GATE_SILU,
            layer,
            [row_start, row_count, 0, 0, 0, 0],
        ),
        Op::DownProjPartial {
            layer,
            row_start,
            row_count,
            chunk,
            col_start,
            col_count,
        } => (
            opcode::DOWN_PROJ_PARTIAL,
            layer,
            [row_start, row_count, chunk, col_start, col_count, 0],
        ),
        Op::RmsLmHead {
            row_start,
            row_count,
            block,
        } => (
            opcode::RMS_LM_HEAD,
            0,
            [row_start, row_count, block, 0, 0, 0],
        ),
        Op::Argmax { blocks } => (opcode::ARGMAX, 0, [blocks, 0, 0, 0, 0, 0]),
    }
}

fn op_of(code: u32, layer: u32, a: [u32; 6]) -> Option<Op> {
    Some(match code {
        opcode::RMS_QKV_ROPE => Op::RmsQkvRope {
            layer,
            head: a[0],
            pair_start: a[1],
            pair_count: a[2],
        },
        opcode::ATTENTION => Op::Attention {
            layer,
            kv_head: a[0],
            part: a[1],
            parts: a[2],
            head_start: a[3],
            head_count: a[4],
        },
        opcode::ATTN_REDUCE => Op::AttnReduce {
            layer,
            kv_head: a[0],
            parts: a[1],
        },
        opcode::O_PROJ_RESIDUAL => Op::OProjResidual {
            layer,
            row_start: a[0],
            row_count: a[1],
        },
        opcode::RMS_UP_GATE_SILU => Op::RmsUpGateSilu {
            layer,
            row_start: a[0],
            row_count: a[1],
        },
        opcode::DOWN_PROJ_PARTIAL => Op::DownProjPartial {
            layer,
            row_start: a[0],
            row_count: a[1],
            chunk: a[2],
            col_start: a[3],
            col_count: a[4],
        },
        opcode::RMS_LM_HEAD => Op::RmsLmHead {
            row_start: a[0],
            row_count: a[1],
            block: a[2],
        },
        opcode::ARGMAX => Op::Argmax { blocks: a[0] },
        _ => return None,
    })
}

impl Schedule {
    /// The words and per-SM offsets of this schedule (see the module documentation).
    pub fn encode(&self) -> Encoded {
        let mut words = Vec::with_capacity(self.instrs.len() * WORDS_PER_INSTR);
        let mut sm_offsets = vec![0u32];
        for stream in &self.streams {
            for &i in stream {
                words.extend(encode_op(&self.instrs[i as usize]));
            }
            sm_offsets.push((words.len() / WORDS_PER_INSTR) as u32);
        }
        Encoded {
            words,
            sm_offsets,
            down_chunks: self.options.down_chunks as u32,
            attn_parts: self.options.attn_parts as u32,
            lm_blocks: self.lm_blocks() as u32,
        }
    }
}

pub fn encode_op(op: &Op) -> [u32; WORDS_PER_INSTR] {
    let (code, layer, args) = fields(op);
    let mut w = [0u32; WORDS_PER_INSTR];
    w[0] = code;
    w[1] = layer;
    w[2..8].copy_from_slice(&args);
    w
}

pub fn decode_op(index: usize, w: &[u32]) -> Result<Op, DecodeError> {
    let args: [u32; 6] = w[2..8].try_into().expect("six operand words");
    let op = op_of(w[0], w[1], args).ok_or(DecodeError::Opcode {
        index,
        opcode: w[0],
    })?;
    // Unused words must be 0: re-encoding shows any that are not.
    let again = encode_op(&op);
    match (0..WORDS_PER_INSTR).find(|&k| again[k] != w[k]) {
        Some(word) => Err(DecodeError::Padding {
            index,
            word,
            value: w[word],
        }),
        None => Ok(op),
    }
}

impl Encoded {
    /// Per SM, the instructions in stream order.
    pub fn decode(&self) -> Result<Vec<Vec<Op>>, DecodeError> {
        if !self.words.len().is_multiple_of(WORDS_PER_INSTR) {
            return Err(DecodeError::Length(self.words.len()));
        }
        let n = (self.words.len() / WORDS_PER_INSTR) as u32;
        let o = &self.sm_offsets;
        if o.first() != Some(&0) || o.last() != Some(&n) || o.windows(2).any(|p| p[0] > p[1]) {
            return Err(DecodeError::Offsets(o.clone()));
        }
        o.windows(2)
            .map(|p| {
                (p[0] as usize..p[1] as usize)
                    .map(|i| decode_op(i, &self.words[i * WORDS_PER_INSTR..][..WORDS_PER_INSTR]))
                    .collect()
            })
            .collect()
    }
}

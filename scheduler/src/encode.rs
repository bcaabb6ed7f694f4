//! The words the megakernel interprets.
//!
//! Every instruction is [`WORDS_PER_INSTR`] = 16 u32 words (64 bytes, one aligned load per
//! lane of half a warp):
//!
//! | word | meaning |
//! | --- | --- |
//! | 0 | opcode (see [`opcode`]; 0 is invalid, so zeroed memory never runs) |
//! | 1 | layer (0 for `RmsLmHead` and `Argmax`) |
//! | 2..=7 | six operands `a0..a5`, by opcode below; unused ones are 0 |
//! | 8 | counter to add 1 to on completion (release), [`NO_SIGNAL`] for none |
//! | 9 | number of waits `n` (at most [`MAX_WAITS`] = 3) |
//! | 10 + 2i, 11 + 2i | wait `i < n`: counter index, base target; unused pairs are 0 |
//!
//! A wait `(c, b)` in launch `e` (the epoch, 0 for the first launch, a kernel parameter)
//! blocks until `counters[c] >= b·(e + 1)` (acquire).
//!
//! Waits already implied by program order are left out (see [`crate::build`]): an
//! instruction may rely on the waits of earlier instructions of its SM, and on a signaller's
//! earlier instructions through that signaller. So the interpreter must keep, per SM:
//! - no instruction reads activations before the waits of every earlier instruction of its SM
//!   have completed;
//! - signals in stream order, each after the instruction's own stores (a CTA barrier, then
//!   one thread's release add), so a signal also publishes the stores of every earlier
//!   instruction of the SM.
//!
//! | opcode | instruction | a0 | a1 | a2 | a3 | a4 |
//! | --- | --- | --- | --- | --- | --- | --- |
//! | 1 | `RmsQkvRope` | head | pair_start | pair_count | | |
//! | 2 | `Attention` | kv_head | part | parts | | |
//! | 3 | `AttnReduce` | kv_head | parts | | | |
//! | 4 | `OProjResidual` | row_start | row_count | | | |
//! | 5 | `RmsUpGateSilu` | row_start | row_count | | | |
//! | 6 | `DownProjResidual` | row_start | row_count | chunk | col_start | col_count |
//! | 7 | `RmsLmHead` | row_start | row_count | block | | |
//! | 8 | `Argmax` | blocks | | | | |
//!
//! SM `s` runs instructions `sm_offsets[s] .. sm_offsets[s+1]` (instruction indices, not word
//! indices: instruction `i` is `words[16·i .. 16·i + 16]`) in order.

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::{Instr, Op, Schedule, Wait};

pub const WORDS_PER_INSTR: usize = 16;
pub const MAX_WAITS: usize = 3;
pub const NO_SIGNAL: u32 = u32::MAX;
const SIGNAL_WORD: usize = 8;
const WAIT_COUNT_WORD: usize = 9;
const FIRST_WAIT_WORD: usize = 10;

/// Values of word 0.
pub mod opcode {
    pub const RMS_QKV_ROPE: u32 = 1;
    pub const ATTENTION: u32 = 2;
    pub const ATTN_REDUCE: u32 = 3;
    pub const O_PROJ_RESIDUAL: u32 = 4;
    pub const RMS_UP_GATE_SILU: u32 = 5;
    pub const DOWN_PROJ_RESIDUAL: u32 = 6;
    pub const RMS_LM_HEAD: u32 = 7;
    pub const ARGMAX: u32 = 8;
}

/// A schedule as the GPU receives it, with the constants the kernel is compiled with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Encoded {
    pub words: Vec<u32>,
    /// `sm_count + 1` instruction indices.
    pub sm_offsets: Vec<u32>,
    /// Length of the u32 counter array (zeroed once, before epoch 0).
    pub counters: usize,
    /// Down-proj k-chunks: the number of `mlp_part` buffers per layer.
    pub down_chunks: u32,
    /// Split-KV partitions per KV head (`attn_part` / `attn_stats` sizes).
    pub attn_parts: u32,
    /// `RmsLmHead` instructions: the number of `lm_best` pairs.
    pub lm_blocks: u32,
    /// Launches before a counter could overflow (see [`Schedule::max_epochs`]).
    pub max_epochs: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum DecodeError {
    #[error("{0} words is not a whole number of {WORDS_PER_INSTR}-word instructions")]
    Length(usize),
    #[error("SM offsets {0:?} are not an increasing cover of the instructions")]
    Offsets(Vec<u32>),
    #[error("instruction {index}: unknown opcode {opcode}")]
    Opcode { index: usize, opcode: u32 },
    #[error("instruction {index}: {waits} waits, at most {MAX_WAITS}")]
    Waits { index: usize, waits: u32 },
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
        } => (opcode::ATTENTION, layer, [kv_head, part, parts, 0, 0, 0]),
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
        Op::DownProjResidual {
            layer,
            row_start,
            row_count,
            chunk,
            col_start,
            col_count,
        } => (
            opcode::DOWN_PROJ_RESIDUAL,
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
        opcode::DOWN_PROJ_RESIDUAL => Op::DownProjResidual {
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
                words.extend(encode_instr(&self.instrs[i as usize]));
            }
            sm_offsets.push((words.len() / WORDS_PER_INSTR) as u32);
        }
        Encoded {
            words,
            sm_offsets,
            counters: self.counters.count() as usize,
            down_chunks: self.options.down_chunks as u32,
            attn_parts: self.options.attn_parts as u32,
            lm_blocks: self.lm_blocks() as u32,
            max_epochs: self.max_epochs(),
        }
    }
}

/// Panics on more than [`MAX_WAITS`] waits, which [`crate::validate`] rejects.
pub fn encode_instr(instr: &Instr) -> [u32; WORDS_PER_INSTR] {
    assert!(instr.waits.len() <= MAX_WAITS, "too many waits to encode");
    let (code, layer, args) = fields(&instr.op);
    let mut w = [0u32; WORDS_PER_INSTR];
    w[0] = code;
    w[1] = layer;
    w[2..8].copy_from_slice(&args);
    w[SIGNAL_WORD] = instr.signal.unwrap_or(NO_SIGNAL);
    w[WAIT_COUNT_WORD] = instr.waits.len() as u32;
    for (i, wait) in instr.waits.iter().enumerate() {
        w[FIRST_WAIT_WORD + 2 * i] = wait.counter;
        w[FIRST_WAIT_WORD + 2 * i + 1] = wait.base;
    }
    w
}

pub fn decode_instr(index: usize, w: &[u32]) -> Result<Instr, DecodeError> {
    let args: [u32; 6] = w[2..8].try_into().expect("six operand words");
    let op = op_of(w[0], w[1], args).ok_or(DecodeError::Opcode {
        index,
        opcode: w[0],
    })?;
    let n = w[WAIT_COUNT_WORD];
    if n as usize > MAX_WAITS {
        return Err(DecodeError::Waits { index, waits: n });
    }
    let waits = (0..n as usize)
        .map(|i| Wait {
            counter: w[FIRST_WAIT_WORD + 2 * i],
            base: w[FIRST_WAIT_WORD + 2 * i + 1],
        })
        .collect();
    let signal = (w[SIGNAL_WORD] != NO_SIGNAL).then_some(w[SIGNAL_WORD]);
    let instr = Instr { op, waits, signal };
    // Unused words must be 0: re-encoding shows any that are not.
    let again = encode_instr(&instr);
    match (0..WORDS_PER_INSTR).find(|&k| again[k] != w[k]) {
        Some(word) => Err(DecodeError::Padding {
            index,
            word,
            value: w[word],
        }),
        None => Ok(instr),
    }
}

impl Encoded {
    /// Per SM, the instructions in stream order.
    pub fn decode(&self) -> Result<Vec<Vec<Instr>>, DecodeError> {
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
                    .map(|i| decode_instr(i, &self.words[i * WORDS_PER_INSTR..][..WORDS_PER_INSTR]))
                    .collect()
            })
            .collect()
    }
}

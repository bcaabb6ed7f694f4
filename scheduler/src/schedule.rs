use serde::{Deserialize, Serialize};

use crate::{access, Access, ArenaLayout, GpuShape, ModelShape, Op, Options, ScheduleError};

/// One decode step as per-SM instruction streams.
///
/// `instrs` is the global order (stage by stage; every element an instruction reads is
/// written by an earlier one, see [`crate::validate()`]); every stream is a strictly increasing
/// list of indices into it and every instruction is in exactly one stream. Streams never
/// change between tokens. Nothing else orders the instructions: an instruction runs once
/// every element it reads ([`crate::access`]) carries this step's tag.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Schedule {
    pub model: ModelShape,
    pub gpu: GpuShape,
    pub options: Options,
    pub instrs: Vec<Op>,
    /// Per SM, indices into `instrs` in execution order.
    pub streams: Vec<Vec<u32>>,
}

impl Schedule {
    pub fn access(&self, op: &Op) -> Access {
        access(op, &self.model, &self.options)
    }

    /// Number of `RmsLmHead` instructions, i.e. of `lm_best` pairs.
    pub fn lm_blocks(&self) -> usize {
        self.instrs
            .iter()
            .filter(|op| matches!(op, Op::RmsLmHead { .. }))
            .count()
    }

    /// Where the megakernel keeps this schedule's tagged activations.
    pub fn arena(&self) -> ArenaLayout {
        ArenaLayout::new(
            &self.model,
            self.options.down_chunks,
            self.options.attn_parts,
            self.lm_blocks(),
        )
    }

    /// The instructions in encoded order (SM 0's stream, then SM 1's, …): entry `p` is the
    /// global index of the instruction the GPU calls `instruction p`.
    pub fn encoded_order(&self) -> Vec<u32> {
        self.streams.iter().flatten().copied().collect()
    }

    /// "#index Op{..}", for messages.
    pub fn describe(&self, index: usize) -> String {
        match self.instrs.get(index) {
            Some(op) => format!("#{index} {op:?}"),
            None => format!("#{index} (out of range)"),
        }
    }

    /// Fails unless the streams partition the instructions into strictly increasing (global
    /// order) subsequences, one per SM.
    pub(crate) fn check_streams(&self) -> Result<(), ScheduleError> {
        let n = self.instrs.len();
        if self.streams.len() != self.gpu.sm_count {
            return Err(ScheduleError::Streams(format!(
                "{} streams for {} SMs",
                self.streams.len(),
                self.gpu.sm_count
            )));
        }
        let mut sm = vec![u32::MAX; n];
        for (s, stream) in self.streams.iter().enumerate() {
            for (p, &i) in stream.iter().enumerate() {
                let i = i as usize;
                if i >= n {
                    return Err(ScheduleError::Streams(format!(
                        "SM {s} runs instruction #{i} of {n}"
                    )));
                }
                if sm[i] != u32::MAX {
                    return Err(ScheduleError::Streams(format!(
                        "{} is on SM {} and on SM {s}",
                        self.describe(i),
                        sm[i]
                    )));
                }
                if p > 0 && stream[p - 1] as usize > i {
                    return Err(ScheduleError::Streams(format!(
                        "SM {s} runs {} before {}, against the global order",
                        self.describe(stream[p - 1] as usize),
                        self.describe(i)
                    )));
                }
                sm[i] = s as u32;
            }
        }
        if let Some(i) = sm.iter().position(|&s| s == u32::MAX) {
            return Err(ScheduleError::Streams(format!(
                "{} is on no SM",
                self.describe(i)
            )));
        }
        Ok(())
    }
}

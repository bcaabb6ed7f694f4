use serde::{Deserialize, Serialize};

use crate::{
    access, Access, CounterLayout, GpuShape, Instr, ModelShape, Op, Options, ScheduleError,
};

/// One decode step as per-SM instruction streams.
///
/// `instrs` is the global order (stage by stage, a topological order of the DAG); every
/// stream is a strictly increasing list of indices into it and every instruction is in exactly
/// one stream. Streams never change between tokens.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Schedule {
    pub model: ModelShape,
    pub gpu: GpuShape,
    pub options: Options,
    pub counters: CounterLayout,
    pub instrs: Vec<Instr>,
    /// Per SM, indices into `instrs` in execution order.
    pub streams: Vec<Vec<u32>>,
}

/// Where each instruction runs: SM and position in that SM's stream.
pub(crate) struct Placement {
    pub sm: Vec<u32>,
    pub pos: Vec<u32>,
}

impl Schedule {
    pub fn access(&self, op: &Op) -> Access {
        access(op, &self.model, &self.options)
    }

    /// Number of `RmsLmHead` instructions, i.e. of `lm_best` pairs.
    pub fn lm_blocks(&self) -> usize {
        self.instrs
            .iter()
            .filter(|i| matches!(i.op, Op::RmsLmHead { .. }))
            .count()
    }

    /// How many instructions signal each counter in one token.
    pub fn signallers(&self) -> Vec<u32> {
        let mut n = vec![0u32; self.counters.count() as usize];
        for s in self.instrs.iter().filter_map(|i| i.signal) {
            if let Some(c) = n.get_mut(s as usize) {
                *c += 1;
            }
        }
        n
    }

    /// Launches (epochs 0..max_epochs) that can run before a counter value would overflow
    /// u32; the host must zero the counters and restart at epoch 0 before that.
    pub fn max_epochs(&self) -> u64 {
        let most = self.signallers().into_iter().max().unwrap_or(1).max(1);
        u32::MAX as u64 / most as u64
    }

    /// "#index Op{..}", for messages.
    pub fn describe(&self, index: usize) -> String {
        match self.instrs.get(index) {
            Some(i) => format!("#{index} {:?}", i.op),
            None => format!("#{index} (out of range)"),
        }
    }

    /// SM and stream position of every instruction; fails unless the streams partition the
    /// instructions into strictly increasing (global order) subsequences.
    pub(crate) fn placement(&self) -> Result<Placement, ScheduleError> {
        let n = self.instrs.len();
        if self.streams.len() != self.gpu.sm_count {
            return Err(ScheduleError::Streams(format!(
                "{} streams for {} SMs",
                self.streams.len(),
                self.gpu.sm_count
            )));
        }
        let mut sm = vec![u32::MAX; n];
        let mut pos = vec![0; n];
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
                pos[i] = p as u32;
            }
        }
        if let Some(i) = sm.iter().position(|&s| s == u32::MAX) {
            return Err(ScheduleError::Streams(format!(
                "{} is on no SM",
                self.describe(i)
            )));
        }
        Ok(Placement { sm, pos })
    }
}

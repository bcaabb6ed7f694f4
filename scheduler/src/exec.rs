//! Runs a schedule on the CPU the way the GPU would: every SM walks its own stream, an
//! instruction runs once its waits are met and then signals; nothing else orders them. Which
//! ready SM goes next is picked by a seeded generator, so different seeds try different
//! interleavings, and a schedule that needs any ordering its counters do not enforce shows
//! up as a wrong result. Counters persist across tokens with growing targets exactly as on
//! the GPU.

use std::collections::VecDeque;

use thiserror::Error;

use crate::rng::SplitMix;
use crate::{Op, Schedule};

/// The math of the instructions. The machine owns all buffers, `token_in` included, and is
/// told nothing but the operation to run.
pub trait Machine {
    fn exec(&mut self, op: &Op);
}

/// How the next SM is picked among those whose next instruction is ready.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Interleaving {
    /// Uniformly at random.
    Random { seed: u64 },
    /// Adversarial for instruction `target` (a global index): first only the instructions
    /// `target` transitively waits for (its own SM's earlier ones and every signaller of a
    /// counter it, or one of those, waits for), at random, then `target`, then the rest at
    /// random. Anything `target` reads that its waits do not order is then still unwritten.
    Eager { target: u32, seed: u64 },
}

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ExecError {
    #[error("stuck in epoch {epoch} after {done} of {total} instructions; blocked: {blocked}")]
    Stuck {
        epoch: u32,
        done: usize,
        total: usize,
        blocked: String,
    },
    #[error("counter {counter} is outside the {count} counters")]
    Counter { counter: u32, count: u32 },
    #[error("stream entry {0} is not an instruction")]
    Stream(u32),
    #[error("eager target #{0} is on no SM")]
    Target(u32),
}

/// The counters of one running sequence of launches.
pub struct Executor<'a> {
    schedule: &'a Schedule,
    counters: Vec<u32>,
    epoch: u32,
}

impl<'a> Executor<'a> {
    /// Checks only what running needs (indices in range), so that broken schedules can be
    /// run to see them fail.
    pub fn new(schedule: &'a Schedule) -> Result<Executor<'a>, ExecError> {
        let count = schedule.counters.count();
        let n = schedule.instrs.len() as u32;
        if let Some(&i) = schedule.streams.iter().flatten().find(|&&i| i >= n) {
            return Err(ExecError::Stream(i));
        }
        for i in &schedule.instrs {
            let used = i
                .signal
                .into_iter()
                .chain(i.waits.iter().map(|w| w.counter));
            if let Some(counter) = used.into_iter().find(|&c| c >= count) {
                return Err(ExecError::Counter { counter, count });
            }
        }
        Ok(Executor {
            schedule,
            counters: vec![0; count as usize],
            epoch: 0,
        })
    }

    /// The epoch (launch index) the next [`Executor::run_token`] runs.
    pub fn epoch(&self) -> u32 {
        self.epoch
    }

    pub fn counters(&self) -> &[u32] {
        &self.counters
    }

    /// One launch: runs every stream to its end, then advances the epoch. Returns the global
    /// indices in the order they ran.
    pub fn run_token<M: Machine>(
        &mut self,
        machine: &mut M,
        how: Interleaving,
    ) -> Result<Vec<u32>, ExecError> {
        let s = self.schedule;
        let sms = s.streams.len();
        let (seed, mut eager) = match how {
            Interleaving::Random { seed } => (seed, None),
            Interleaving::Eager { target, seed } => (seed, Some(self.ancestors(target)?)),
        };
        let mut rng = SplitMix::new(seed);
        let mut pc = vec![0usize; sms];
        let total = s.instrs.len();
        let mut order = Vec::with_capacity(total);
        let mut ready = Vec::with_capacity(sms);
        while order.len() < total {
            ready.clear();
            ready.extend((0..sms).filter(|&sm| {
                let allowed = eager.as_ref().is_none_or(|e| pc[sm] < e.limit[sm]);
                allowed && self.head_ready(sm, pc[sm])
            }));
            let sm = if let Some(&sm) = ready.get(rng.below(ready.len().max(1))) {
                sm
            } else if let Some(e) = eager.take() {
                // Everything the target waits for has run: now the target itself.
                if pc[e.sm] != e.pos || !self.head_ready(e.sm, pc[e.sm]) {
                    return Err(self.stuck(&pc, order.len()));
                }
                e.sm
            } else {
                return Err(self.stuck(&pc, order.len()));
            };
            let index = s.streams[sm][pc[sm]];
            let instr = &s.instrs[index as usize];
            machine.exec(&instr.op);
            if let Some(c) = instr.signal {
                self.counters[c as usize] = self.counters[c as usize].wrapping_add(1);
            }
            pc[sm] += 1;
            order.push(index);
        }
        self.epoch += 1;
        Ok(order)
    }

    fn head_ready(&self, sm: usize, pc: usize) -> bool {
        let Some(&i) = self.schedule.streams[sm].get(pc) else {
            return false;
        };
        let need = self.epoch as u64 + 1;
        self.schedule.instrs[i as usize]
            .waits
            .iter()
            .all(|w| self.counters[w.counter as usize] as u64 >= w.base as u64 * need)
    }

    fn stuck(&self, pc: &[usize], done: usize) -> ExecError {
        let s = self.schedule;
        let blocked: Vec<String> = (0..pc.len())
            .filter_map(|sm| {
                let &i = s.streams[sm].get(pc[sm])?;
                let need = self.epoch as u64 + 1;
                let unmet: Vec<String> = s.instrs[i as usize]
                    .waits
                    .iter()
                    .filter(|w| (self.counters[w.counter as usize] as u64) < w.base as u64 * need)
                    .map(|w| {
                        format!(
                            "{} = {} < {}",
                            s.counters.name(w.counter),
                            self.counters[w.counter as usize],
                            w.base as u64 * need
                        )
                    })
                    .collect();
                Some(format!(
                    "SM {sm} at {} waiting for {}",
                    s.describe(i as usize),
                    unmet.join(", ")
                ))
            })
            .collect();
        ExecError::Stuck {
            epoch: self.epoch,
            done,
            total: s.instrs.len(),
            blocked: blocked.join("; "),
        }
    }

    /// Per SM, how many leading instructions `target` transitively waits for.
    fn ancestors(&self, target: u32) -> Result<Eager, ExecError> {
        let s = self.schedule;
        let mut at = vec![None; s.instrs.len()];
        for (sm, stream) in s.streams.iter().enumerate() {
            for (p, &i) in stream.iter().enumerate() {
                at[i as usize] = Some((sm, p));
            }
        }
        let (sm, pos) = at
            .get(target as usize)
            .copied()
            .flatten()
            .ok_or(ExecError::Target(target))?;
        let mut signallers = vec![Vec::new(); s.counters.count() as usize];
        for (i, instr) in s.instrs.iter().enumerate() {
            if let Some(c) = instr.signal {
                signallers[c as usize].push(i);
            }
        }
        let mut limit = vec![0usize; s.streams.len()];
        let mut seen = vec![false; s.instrs.len()];
        let mut todo = VecDeque::from([target as usize]);
        while let Some(x) = todo.pop_front() {
            let Some((xs, xp)) = at[x] else { continue };
            // Program order: everything before x on its SM.
            if x != target as usize {
                limit[xs] = limit[xs].max(xp + 1);
            }
            let before = xp.checked_sub(1).map(|p| s.streams[xs][p] as usize);
            let waited = s.instrs[x]
                .waits
                .iter()
                .flat_map(|w| signallers[w.counter as usize].iter().copied());
            for y in before.into_iter().chain(waited) {
                if !seen[y] {
                    seen[y] = true;
                    todo.push_back(y);
                }
            }
        }
        Ok(Eager { limit, sm, pos })
    }
}

struct Eager {
    limit: Vec<usize>,
    sm: usize,
    pos: usize,
}

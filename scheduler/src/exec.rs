//! Runs a schedule on the CPU by the rule the GPU follows, and nothing else: every element of
//! the tagged activations ([`crate::arena`]) carries a tag; in step `e` (the launch index, 0,
//! 1, 2, …) an instruction may run only when every element it reads ([`crate::access`])
//! carries the tag `e + 1`, and it then writes its outputs with that tag. Each SM runs its
//! stream in order. Which ready SM goes next is picked by a seeded generator, so different
//! seeds try different interleavings; a schedule that needs an ordering the tags do not give
//! computes a wrong result (the machine poisons what a step will write), and one that cannot
//! make progress stops with the error the megakernel would give, naming an element that
//! nothing wrote this step. Tags persist across steps exactly as on the GPU: last step's
//! values carry last step's tag.

use std::collections::{BTreeSet, VecDeque};
use std::fmt::Write as _;
use std::ops::Range;

use thiserror::Error;

use crate::deps::{producers, Writers};
use crate::rng::SplitMix;
use crate::{ArenaLayout, Op, Schedule, ScheduleError};

/// The math of the instructions. The machine owns all buffers, `token_in` included, and is
/// told nothing but the operation to run.
pub trait Machine {
    fn exec(&mut self, op: &Op);
    /// In a generation ([`Executor::run_generation`]), called before each instruction with
    /// the step (0-based, within the generation) it belongs to.
    fn enter_step(&mut self, _step: u32) {}
}

/// Runs nothing: for following tags alone.
pub struct Blind;

impl Machine for Blind {
    fn exec(&mut self, _: &Op) {}
}

/// How the next SM is picked among those whose next instruction is ready.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Interleaving {
    /// Uniformly at random.
    Random { seed: u64 },
    /// Adversarial for instruction `target` (a global index): first only what `target`
    /// depends on, transitively (its own SM's earlier instructions and the writers of every
    /// element it reads), at random; then `target`; then the rest at random. With `withhold`
    /// (a writer of something `target` reads) that writer is left out of `target`'s direct
    /// dependencies and `target` runs without waiting for its tags, as if it did not declare
    /// those reads: whatever it then reads of that writer's output is still unwritten.
    Eager {
        target: u32,
        seed: u64,
        withhold: Option<u32>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ExecError {
    #[error(
        "step {step}: SM {sm} instruction {position} ({instr}) waits for {element}: nothing \
         wrote it this step; the schedule cannot make progress ({done} of {total} \
         instructions ran). Blocked: {blocked}"
    )]
    Deadlock {
        step: u32,
        sm: usize,
        /// Position in the encoded order ([`Schedule::encoded_order`]), as the GPU counts.
        position: usize,
        /// The global index of the blocked instruction.
        reader: u32,
        instr: String,
        element: String,
        done: usize,
        total: usize,
        blocked: String,
    },
    #[error("stream entry {0} is not an instruction")]
    Stream(u32),
    #[error("{instr} writes {buffer}, outside the arena")]
    Outside { instr: String, buffer: String },
    #[error("eager target #{0} is on no SM")]
    Target(u32),
    #[error("{0}")]
    Schedule(#[from] ScheduleError),
    #[error(
        "generation step {step}: SM {sm} instruction {position} ({instr}) waits for {element} \
         (tag {want}, found {found}): no order of the steps lets it run"
    )]
    GenerationStall {
        step: u32,
        sm: usize,
        position: usize,
        instr: String,
        element: String,
        want: u32,
        found: u32,
    },
}

/// Where one SM stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Head {
    Done,
    /// Not checked since something it could wait for was written.
    Unknown,
    Ready,
    /// Its next instruction waits for this arena offset.
    Blocked(usize),
}

/// The tags of one running sequence of steps.
pub struct Executor<'a> {
    schedule: &'a Schedule,
    arena: ArenaLayout,
    /// Per instruction, the arena runs it reads and writes.
    reads: Vec<Vec<Range<usize>>>,
    writes: Vec<Vec<Range<usize>>>,
    tags: Vec<u32>,
    step: u32,
    noop: Vec<bool>,
    /// Encoded position of each SM's first instruction.
    first: Vec<usize>,
}

/// How a step ended: `pc` per SM (all at their stream's end unless stuck).
struct Ended {
    order: Vec<u32>,
    pc: Vec<usize>,
    stuck: bool,
}

impl<'a> Executor<'a> {
    /// Checks only what running needs (indices and writes in range), so that broken
    /// schedules can be run to see them fail.
    pub fn new(schedule: &'a Schedule) -> Result<Executor<'a>, ExecError> {
        let n = schedule.instrs.len() as u32;
        if let Some(&i) = schedule.streams.iter().flatten().find(|&&i| i >= n) {
            return Err(ExecError::Stream(i));
        }
        let arena = schedule.arena();
        let mut reads = Vec::with_capacity(schedule.instrs.len());
        let mut writes = Vec::with_capacity(schedule.instrs.len());
        for (x, op) in schedule.instrs.iter().enumerate() {
            let a = schedule.access(op);
            let runs = |spans: &[crate::Span]| -> Vec<Range<usize>> {
                spans
                    .iter()
                    .filter_map(|s| arena.runs(s))
                    .flatten()
                    .collect()
            };
            let w = runs(&a.writes);
            if let Some(bad) = a.writes.iter().find(|s| {
                arena
                    .runs(s)
                    .is_some_and(|r| r.iter().any(|r| r.end > arena.len()))
            }) {
                return Err(ExecError::Outside {
                    instr: schedule.describe(x),
                    buffer: format!("{}[{:?}]", bad.buffer, bad.elements),
                });
            }
            reads.push(runs(&a.reads));
            writes.push(w);
        }
        let mut first = vec![0];
        for st in &schedule.streams {
            first.push(first.last().unwrap() + st.len());
        }
        Ok(Executor {
            schedule,
            tags: vec![0; arena.len()],
            arena,
            reads,
            writes,
            step: 0,
            noop: vec![false; schedule.instrs.len()],
            first,
        })
    }

    /// The step (launch index) the next [`Executor::run_token`] runs.
    pub fn epoch(&self) -> u32 {
        self.step
    }

    /// Runs instruction `index` as a no-op from now on, as the megakernel runs opcode 0: it
    /// waits for nothing and writes nothing.
    pub fn drop_instruction(&mut self, index: u32) {
        if let Some(n) = self.noop.get_mut(index as usize) {
            *n = true;
        }
    }

    fn tag(&self) -> u32 {
        self.step.wrapping_add(1)
    }

    /// The first element instruction `x` reads that lacks this step's tag.
    fn stale(&self, x: usize) -> Option<usize> {
        self.stale_at(x, self.tag())
    }

    /// One launch: runs every stream to its end, then advances the step. Returns the global
    /// indices in the order they ran.
    pub fn run_token<M: Machine>(
        &mut self,
        machine: &mut M,
        how: Interleaving,
    ) -> Result<Vec<u32>, ExecError> {
        let ended = self.run(machine, how)?;
        if ended.stuck {
            return Err(self.deadlock(&ended.pc, ended.order.len()));
        }
        self.step += 1;
        Ok(ended.order)
    }

    fn run<M: Machine>(&mut self, machine: &mut M, how: Interleaving) -> Result<Ended, ExecError> {
        let s = self.schedule;
        let sms = s.streams.len();
        let (seed, mut eager) = match how {
            Interleaving::Random { seed } => (seed, None),
            Interleaving::Eager {
                target,
                seed,
                withhold,
            } => (seed, Some(self.ancestors(target, withhold)?)),
        };
        let mut rng = SplitMix::new(seed);
        let mut pc = vec![0usize; sms];
        let mut head: Vec<Head> = (0..sms)
            .map(|sm| {
                if s.streams[sm].is_empty() {
                    Head::Done
                } else {
                    Head::Unknown
                }
            })
            .collect();
        let tag = self.tag();
        let total = s.instrs.len();
        let mut order = Vec::with_capacity(total);
        let mut ready = Vec::with_capacity(sms);
        while order.len() < total {
            ready.clear();
            for sm in 0..sms {
                if let Head::Blocked(o) = head[sm] {
                    if self.tags.get(o) == Some(&tag) {
                        head[sm] = Head::Unknown;
                    }
                }
                if head[sm] == Head::Unknown {
                    let x = s.streams[sm][pc[sm]] as usize;
                    head[sm] = self.stale(x).map_or(Head::Ready, Head::Blocked);
                }
                let allowed = eager.as_ref().is_none_or(|e| pc[sm] < e.limit[sm]);
                if allowed && head[sm] == Head::Ready {
                    ready.push(sm);
                }
            }
            let sm = if !ready.is_empty() {
                ready[rng.below(ready.len())]
            } else if let Some(e) = eager.take() {
                // Everything the target depends on has run: now the target itself.
                let forced = e.withheld && pc[e.sm] == e.pos;
                if pc[e.sm] != e.pos || (head[e.sm] != Head::Ready && !forced) {
                    return Ok(Ended {
                        order,
                        pc,
                        stuck: true,
                    });
                }
                e.sm
            } else {
                return Ok(Ended {
                    order,
                    pc,
                    stuck: true,
                });
            };
            let x = s.streams[sm][pc[sm]];
            if !self.noop[x as usize] {
                machine.exec(&s.instrs[x as usize]);
                for r in &self.writes[x as usize] {
                    self.tags[r.clone()].fill(tag);
                }
            }
            pc[sm] += 1;
            head[sm] = if pc[sm] == s.streams[sm].len() {
                Head::Done
            } else {
                Head::Unknown
            };
            order.push(x);
        }
        Ok(Ended {
            order,
            pc,
            stuck: false,
        })
    }

    /// The writer of arena offset `o`, if any.
    fn writer(&self, o: usize) -> Option<usize> {
        self.writes
            .iter()
            .position(|w| w.iter().any(|r| r.contains(&o)))
    }

    /// Runs `steps` steps as one generation, as the megakernel does inside one launch: each
    /// SM runs its stream step after step, starting step `s > 0` only once step `s - 1`'s
    /// argmax has run (the SMs wait for that token between steps); an instruction of step `s`
    /// runs once everything it reads carries step `s`'s tag, and writes with it. Nothing is
    /// cleared between steps. While every instruction feeds the argmax (each step's sink), no
    /// SM starts a step before all have finished the one before; in a schedule where steps
    /// could overlap, a reader that found the next step's value already written would wait for
    /// ever (reported as [`ExecError::GenerationStall`]). Returns (step, instruction) in the
    /// order they ran; the next run starts after these steps.
    pub fn run_generation<M: Machine>(
        &mut self,
        machine: &mut M,
        steps: u32,
        seed: u64,
    ) -> Result<Vec<(u32, u32)>, ExecError> {
        let s = self.schedule;
        let sms = s.streams.len();
        let mut rng = SplitMix::new(seed);
        let (mut pc, mut step) = (vec![0usize; sms], vec![0u32; sms]);
        for (sm, st) in s.streams.iter().enumerate() {
            if st.is_empty() {
                step[sm] = steps;
            }
        }
        // Steps whose argmax has run: the tokens handed on.
        let mut tokens = 0u32;
        let base = self.step;
        let total = s.instrs.len() * steps as usize;
        let mut order = Vec::with_capacity(total);
        let mut ready = Vec::with_capacity(sms);
        while order.len() < total {
            ready.clear();
            for sm in 0..sms {
                if step[sm] >= steps || (pc[sm] == 0 && step[sm] > tokens) {
                    continue;
                }
                let x = s.streams[sm][pc[sm]] as usize;
                if self
                    .stale_at(x, base.wrapping_add(step[sm]).wrapping_add(1))
                    .is_none()
                {
                    ready.push(sm);
                }
            }
            if ready.is_empty() {
                return Err(self.generation_stall(&pc, &step, base, tokens, steps));
            }
            let sm = ready[rng.below(ready.len())];
            let x = s.streams[sm][pc[sm]];
            let op = &s.instrs[x as usize];
            if !self.noop[x as usize] {
                machine.enter_step(step[sm]);
                machine.exec(op);
                let tag = base.wrapping_add(step[sm]).wrapping_add(1);
                for r in &self.writes[x as usize] {
                    self.tags[r.clone()].fill(tag);
                }
                if matches!(op, Op::Argmax { .. }) {
                    tokens = step[sm] + 1;
                }
            }
            order.push((step[sm], x));
            pc[sm] += 1;
            if pc[sm] == s.streams[sm].len() {
                pc[sm] = 0;
                step[sm] += 1;
            }
        }
        self.step = base.wrapping_add(steps);
        Ok(order)
    }

    /// The first element instruction `x` reads that lacks `tag`.
    fn stale_at(&self, x: usize, tag: u32) -> Option<usize> {
        if self.noop[x] {
            return None;
        }
        self.reads[x].iter().find_map(|r| {
            r.clone()
                .find(|&o| self.tags.get(o).copied().unwrap_or(0) != tag)
        })
    }

    /// The error for a generation where no SM can go on: the first SM waiting for an element
    /// (an SM waiting for the token is stuck behind one of those).
    fn generation_stall(
        &self,
        pc: &[usize],
        step: &[u32],
        base: u32,
        tokens: u32,
        steps: u32,
    ) -> ExecError {
        let s = self.schedule;
        let waiting = (0..pc.len()).find_map(|sm| {
            let st = step[sm];
            if st >= steps || (pc[sm] == 0 && st > tokens) {
                return None;
            }
            let x = s.streams[sm][pc[sm]] as usize;
            let tag = base.wrapping_add(st).wrapping_add(1);
            self.stale_at(x, tag).map(|o| (sm, x, st, o, tag))
        });
        let (sm, x, st, o, tag) =
            waiting.expect("a stalled generation has an SM waiting for an element");
        ExecError::GenerationStall {
            step: st,
            sm,
            position: self.first[sm] + pc[sm],
            instr: s.describe(x),
            element: self.arena.element(o),
            want: tag,
            found: self.tags.get(o).copied().unwrap_or(0),
        }
    }

    /// The error for a step stuck with SMs at `pc`: names, where there is one, a blocked
    /// instruction waiting for an element that nothing will write (no writer, or one that
    /// was dropped or already ran); else the first blocked SM.
    fn deadlock(&self, pc: &[usize], done: usize) -> ExecError {
        let s = self.schedule;
        let ran = |w: usize| {
            let sm = s.streams.iter().position(|st| st.contains(&(w as u32)));
            sm.is_some_and(|sm| s.streams[sm][..pc[sm]].contains(&(w as u32)))
        };
        let mut blocked = Vec::new();
        for (sm, &p) in pc.iter().enumerate() {
            if p == s.streams[sm].len() {
                continue;
            }
            let x = s.streams[sm][p] as usize;
            if let Some(o) = self.stale(x) {
                let hopeless = self.writer(o).is_none_or(|w| self.noop[w] || ran(w));
                blocked.push((sm, p, x, o, hopeless));
            }
        }
        let mut list = String::new();
        for &(sm, p, x, o, _) in blocked.iter().take(6) {
            let _ = write!(
                list,
                "{}SM {sm} at instruction {} ({}) waiting for {}",
                if list.is_empty() { "" } else { "; " },
                self.first[sm] + p,
                s.describe(x),
                self.arena.element(o)
            );
        }
        if blocked.len() > 6 {
            let _ = write!(list, "; {} more", blocked.len() - 6);
        }
        let &(sm, p, x, o, _) = blocked
            .iter()
            .find(|b| b.4)
            .or(blocked.first())
            .expect("a stuck step has a blocked SM");
        ExecError::Deadlock {
            step: self.step,
            sm,
            position: self.first[sm] + p,
            reader: x as u32,
            instr: s.describe(x),
            element: self.arena.element(o),
            done,
            total: s.instrs.len(),
            blocked: list,
        }
    }

    /// Per SM, how many leading instructions `target` transitively depends on.
    fn ancestors(&self, target: u32, withhold: Option<u32>) -> Result<Eager, ExecError> {
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
        let deps = producers(s, &Writers::new(s)?);
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
            let direct = deps[x]
                .iter()
                .filter(|&&w| x != target as usize || Some(w) != withhold)
                .map(|&w| w as usize);
            for y in before.into_iter().chain(direct) {
                if !seen[y] {
                    seen[y] = true;
                    todo.push_back(y);
                }
            }
        }
        Ok(Eager {
            limit,
            sm,
            pos,
            withheld: withhold.is_some(),
        })
    }

    /// Whether `target` depends on `writer` other than through reading its output directly:
    /// through its SM's program order or through another dependency.
    pub fn depends_otherwise(&self, target: u32, writer: u32) -> Result<bool, ExecError> {
        let e = self.ancestors(target, Some(writer))?;
        let s = self.schedule;
        Ok(s.streams
            .iter()
            .zip(&e.limit)
            .any(|(st, &l)| st[..l].contains(&writer)))
    }
}

struct Eager {
    limit: Vec<usize>,
    sm: usize,
    pos: usize,
    withheld: bool,
}

/// What the megakernel may report when instruction `dropped` (a global index) is turned into
/// a no-op (opcode 0): every pair (reader, element) such that, once everything that still
/// can run has run, `reader` is the next instruction of its SM and reads `element` (named as
/// in [`ArenaLayout::element`]), which lacks the step's tag. A stalled GPU reports one such
/// pair: the first wait to time out wins, which may be a direct reader of the dropped
/// instruction's output or an instruction stuck behind one. Empty when nothing waits for the
/// dropped instruction (the argmax writes only untagged outputs).
pub fn unwritten_if_dropped(
    s: &Schedule,
    dropped: u32,
) -> Result<BTreeSet<(u32, String)>, ExecError> {
    let mut ex = Executor::new(s)?;
    ex.drop_instruction(dropped);
    let ended = ex.run(&mut Blind, Interleaving::Random { seed: 0 })?;
    let tag = ex.tag();
    let mut out = BTreeSet::new();
    for (sm, &p) in ended.pc.iter().enumerate() {
        let Some(&x) = s.streams[sm].get(p) else {
            continue;
        };
        for r in &ex.reads[x as usize] {
            for o in r.clone() {
                if ex.tags.get(o).copied().unwrap_or(0) != tag {
                    out.insert((x, ex.arena.element(o)));
                }
            }
        }
    }
    Ok(out)
}

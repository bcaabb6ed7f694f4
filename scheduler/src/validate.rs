//! The checks [`crate::build`] runs before returning a schedule, exported so that tests can run
//! them on hand-mutated schedules.
//!
//! 1. Structure: the streams partition the instructions, each stream follows the global
//!    order, counter indices are in range, at most [`crate::MAX_WAITS`] waits each.
//! 2. Deadlock freedom: every wait's base target equals the number of instructions that
//!    signal the counter (so it is reached exactly at the end of that token's signals), and
//!    all of them come earlier in the global order than the waiter. Then the earliest
//!    unfinished instruction in the global order can always run: everything before it in its
//!    own stream is earlier, hence finished, and so are the signallers it waits for.
//! 3. Races: from the declared reads and writes, no element is written twice per token, no
//!    launch input is written, every element read is written, and its writer happens before
//!    the reader (program order and waits, transitively).

use std::collections::BTreeMap;
use std::ops::Range;

use crate::hb::Clocks;
use crate::{Buffer, Schedule, ScheduleError, MAX_WAITS};

/// Runs every check; the first violation found is the error.
pub fn validate(s: &Schedule) -> Result<(), ScheduleError> {
    let place = s.placement()?;
    let signallers = check_counters(s)?;
    check_deadlock(s, &signallers)?;
    let writers = writers(s)?;
    let mut clocks = Clocks::new(s.gpu.sm_count, signallers.len());
    for (x, instr) in s.instrs.iter().enumerate() {
        let sm = place.sm[x];
        let mut clock = clocks.start(sm);
        for w in &instr.waits {
            clocks.join(&mut clock, w.counter);
        }
        for read in s.access(&instr.op).reads {
            if read.buffer.is_input() {
                continue;
            }
            let list = writers.get(&read.buffer).map_or(&[][..], Vec::as_slice);
            let mut next = read.elements.start;
            for (range, w) in covering(list, &read.elements) {
                if range.start > next {
                    break;
                }
                if place.pos[w] >= clock[place.sm[w] as usize] {
                    return Err(ScheduleError::Race {
                        reader: s.describe(x),
                        writer: s.describe(w),
                        buffer: read.buffer,
                        element: next,
                    });
                }
                next = range.end;
            }
            if next < read.elements.end {
                return Err(ScheduleError::Unwritten {
                    instr: s.describe(x),
                    buffer: read.buffer,
                    element: next,
                });
            }
        }
        clocks.finish(sm, place.pos[x], &mut clock, instr.signal);
    }
    Ok(())
}

/// Counter indices in range and wait lists short enough; returns the signaller counts.
fn check_counters(s: &Schedule) -> Result<Vec<u32>, ScheduleError> {
    let count = s.counters.count();
    for (x, i) in s.instrs.iter().enumerate() {
        let bad = i.signal.iter().chain(i.waits.iter().map(|w| &w.counter));
        if let Some(c) = bad.into_iter().find(|&&c| c >= count) {
            return Err(ScheduleError::Counters(format!(
                "{} uses counter {c} of {count}",
                s.describe(x)
            )));
        }
        if i.waits.len() > MAX_WAITS {
            return Err(ScheduleError::Counters(format!(
                "{} has {} waits, the encoding holds {MAX_WAITS}",
                s.describe(x),
                i.waits.len()
            )));
        }
    }
    Ok(s.signallers())
}

fn check_deadlock(s: &Schedule, signallers: &[u32]) -> Result<(), ScheduleError> {
    let mut last = vec![None; signallers.len()];
    for (x, i) in s.instrs.iter().enumerate() {
        if let Some(c) = i.signal {
            last[c as usize] = Some(x);
        }
    }
    for (x, i) in s.instrs.iter().enumerate() {
        for w in &i.waits {
            let n = signallers[w.counter as usize];
            if w.base != n || n == 0 {
                return Err(ScheduleError::Unreachable {
                    instr: s.describe(x),
                    counter: s.counters.name(w.counter),
                    base: w.base,
                    signallers: n,
                });
            }
            if let Some(l) = last[w.counter as usize].filter(|&l| l >= x) {
                return Err(ScheduleError::Deadlock {
                    instr: s.describe(x),
                    counter: s.counters.name(w.counter),
                    signaller: s.describe(l),
                });
            }
        }
    }
    Ok(())
}

type Writers = BTreeMap<Buffer, Vec<(Range<u32>, usize)>>;

/// Per buffer, the written ranges sorted by start, checked disjoint.
fn writers(s: &Schedule) -> Result<Writers, ScheduleError> {
    let mut map = Writers::new();
    for (x, i) in s.instrs.iter().enumerate() {
        for w in s.access(&i.op).writes {
            if w.buffer.is_input() {
                return Err(ScheduleError::WriteToInput {
                    instr: s.describe(x),
                    buffer: w.buffer,
                });
            }
            if !w.elements.is_empty() {
                map.entry(w.buffer).or_default().push((w.elements, x));
            }
        }
    }
    for (buffer, list) in map.iter_mut() {
        list.sort_by_key(|(r, _)| r.start);
        for pair in list.windows(2) {
            let ((a, first), (b, second)) = (&pair[0], &pair[1]);
            if b.start < a.end {
                return Err(ScheduleError::DoubleWrite {
                    buffer: *buffer,
                    element: b.start,
                    first: s.describe(*first),
                    second: s.describe(*second),
                });
            }
        }
    }
    Ok(map)
}

/// The written ranges overlapping `want`, in order.
fn covering<'a>(
    list: &'a [(Range<u32>, usize)],
    want: &Range<u32>,
) -> impl Iterator<Item = (Range<u32>, usize)> + 'a {
    let first = list.partition_point(|(r, _)| r.end <= want.start);
    let end = want.end;
    list[first..]
        .iter()
        .take_while(move |(r, _)| r.start < end)
        .cloned()
}

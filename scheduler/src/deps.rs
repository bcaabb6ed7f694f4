//! The dependencies of a schedule, derived from what each instruction reads and writes
//! ([`crate::access`]): instruction `x` depends on `w` when `x` reads an element `w` writes.
//! These are the only edges besides each SM's program order; the GPU enforces them with
//! tagged activations, element by element.

use std::collections::BTreeMap;
use std::ops::Range;

use crate::{Buffer, Schedule, ScheduleError};

/// Per buffer, the written element ranges sorted by start, each with its writer.
pub(crate) struct Writers(BTreeMap<Buffer, Vec<(Range<u32>, usize)>>);

impl Writers {
    /// Fails when an element is written twice or an input is written.
    pub fn new(s: &Schedule) -> Result<Writers, ScheduleError> {
        let mut map: BTreeMap<Buffer, Vec<(Range<u32>, usize)>> = BTreeMap::new();
        for (x, op) in s.instrs.iter().enumerate() {
            for w in s.access(op).writes {
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
        Ok(Writers(map))
    }

    /// Walks `want` of `buffer`: `f(elements, Some(writer))` for written pieces and
    /// `f(elements, None)` for gaps, in element order.
    pub fn cover(
        &self,
        buffer: Buffer,
        want: &Range<u32>,
        mut f: impl FnMut(Range<u32>, Option<usize>),
    ) {
        let list = self.0.get(&buffer).map_or(&[][..], Vec::as_slice);
        let first = list.partition_point(|(r, _)| r.end <= want.start);
        let mut next = want.start;
        for (r, w) in list[first..].iter().take_while(|(r, _)| r.start < want.end) {
            if r.start > next {
                f(next..r.start, None);
            }
            let lo = r.start.max(next);
            let hi = r.end.min(want.end);
            f(lo..hi, Some(*w));
            next = hi;
        }
        if next < want.end {
            f(next..want.end, None);
        }
    }
}

/// Per instruction, the instructions whose writes it reads (sorted, no duplicates). Reads of
/// launch inputs and of elements nobody writes add nothing.
pub(crate) fn producers(s: &Schedule, writers: &Writers) -> Vec<Vec<u32>> {
    s.instrs
        .iter()
        .map(|op| {
            let mut p = Vec::new();
            for r in s.access(op).reads {
                writers.cover(r.buffer, &r.elements, |_, w| p.extend(w.map(|w| w as u32)));
            }
            p.sort_unstable();
            p.dedup();
            p
        })
        .collect()
}

/// Per instruction, the global indices of the instructions it depends on directly (see the
/// module documentation). Fails like [`crate::validate()`] on elements written twice.
pub fn dependencies(s: &Schedule) -> Result<Vec<Vec<u32>>, ScheduleError> {
    Ok(producers(s, &Writers::new(s)?))
}

//! The checks [`crate::build`] runs before returning a schedule, exported so that tests can run
//! them on hand-mutated schedules. They are about the dependencies the GPU enforces: an
//! instruction runs once every element it reads carries this step's tag, and each SM runs its
//! stream in order.
//!
//! 1. Structure: the streams partition the instructions and each follows the global order.
//! 2. Bounds: every element read or written lies inside its buffer (on the GPU the buffers sit
//!    side by side in one arena, so a stray index would hit another buffer).
//! 3. One writer: no element is written twice per step and no launch input is written, so a
//!    tag names exactly one store.
//! 4. Every element read is written in the step: else its reader would wait forever.
//! 5. No cycle, no deadlock: every element an instruction reads is written by an instruction
//!    earlier in the global order. Then the earliest unfinished instruction in the global
//!    order can always run, whatever the interleaving: everything before it in its own stream
//!    is earlier, hence finished, and so is every writer of what it reads.

use crate::deps::Writers;
use crate::{Schedule, ScheduleError};

/// Runs every check; the first violation found is the error.
pub fn validate(s: &Schedule) -> Result<(), ScheduleError> {
    s.check_streams()?;
    let blocks = s.lm_blocks();
    for (x, op) in s.instrs.iter().enumerate() {
        let a = s.access(op);
        for span in a.reads.iter().chain(&a.writes) {
            let len = span.buffer.len(&s.model, &s.options, blocks);
            if len.is_none_or(|n| span.elements.end as usize > n) {
                return Err(ScheduleError::OutOfBounds {
                    instr: s.describe(x),
                    buffer: span.buffer,
                    start: span.elements.start,
                    end: span.elements.end,
                    len: len.unwrap_or(0),
                });
            }
        }
    }
    let writers = Writers::new(s)?;
    for (x, op) in s.instrs.iter().enumerate() {
        for read in s.access(op).reads {
            if read.buffer.is_input() {
                continue;
            }
            let mut bad = Ok(());
            writers.cover(read.buffer, &read.elements, |range, w| {
                if bad.is_err() {
                    return;
                }
                bad = match w {
                    None => Err(ScheduleError::Unwritten {
                        instr: s.describe(x),
                        buffer: read.buffer,
                        element: range.start,
                    }),
                    Some(w) if w >= x => Err(ScheduleError::Deadlock {
                        instr: s.describe(x),
                        buffer: read.buffer,
                        element: range.start,
                        writer: s.describe(w),
                    }),
                    Some(_) => Ok(()),
                };
            });
            bad?;
        }
    }
    Ok(())
}

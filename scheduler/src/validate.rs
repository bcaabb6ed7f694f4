//! The checks [`crate::build`] runs before returning a schedule, exported so that tests can run
//! them on hand-mutated schedules. They are about the dependencies the GPU enforces: an
//! instruction runs once every element it reads carries this step's tag, and each SM runs its
//! stream in order.
//!
//! 1. Structure: the streams partition the instructions and each follows the global order.
//! 2. One writer: no element is written twice per step and no launch input is written, so a
//!    tag names exactly one store.
//! 3. Every element read is written in the step: else its reader would wait forever.
//! 4. No cycle, no deadlock: every element an instruction reads is written by an instruction
//!    earlier in the global order. Then the earliest unfinished instruction in the global
//!    order can always run, whatever the interleaving: everything before it in its own stream
//!    is earlier, hence finished, and so is every writer of what it reads.

use crate::deps::Writers;
use crate::{Schedule, ScheduleError};

/// Runs every check; the first violation found is the error.
pub fn validate(s: &Schedule) -> Result<(), ScheduleError> {
    s.check_streams()?;
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

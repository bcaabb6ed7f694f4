//! Compiles one decode step of a Llama-family model into per-SM instruction streams for the
//! megakernel, checks them, encodes them to u32 words and runs them on the CPU.
//!
//! - [`build`] makes the DAG of one forward pass ([`instruction`] documents the instructions
//!   and buffers, [`counters`] the counter array), orders it stage by stage, balances each stage
//!   over the SMs by the [`options`] cost model, drops waits already implied by others and
//!   [`validate`]s the result.
//! - [`Schedule::encode`] gives the words the GPU interprets ([`encode`] documents the layout).
//! - [`dump`] prints a summary, estimates the time per token and exports JSON.
//! - [`exec`] runs a schedule on the CPU in seeded random interleavings over any [`Machine`].
//!
//! No CUDA and no pointers here: buffers are named, the runtime maps them to device memory.

mod assign;
mod build;
pub mod counters;
pub mod dump;
pub mod encode;
mod error;
pub mod exec;
mod hb;
pub mod instruction;
pub mod options;
mod rng;
mod schedule;
mod shape;
pub mod validate;

pub use build::build;
pub use counters::{Counter, CounterLayout};
pub use encode::{DecodeError, Encoded, MAX_WAITS, WORDS_PER_INSTR};
pub use error::ScheduleError;
pub use exec::{ExecError, Executor, Interleaving, Machine};
pub use instruction::{access, Access, Buffer, Instr, Op, Span, StageKind, Wait};
pub use options::{CostModel, Options};
pub use schedule::Schedule;
pub use shape::{GpuShape, ModelShape, PRESETS};
pub use validate::validate;

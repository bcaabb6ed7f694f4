//! Compiles one decode step of a Llama-family model into per-SM instruction streams for the
//! megakernel, checks them, encodes them to u32 words and runs them on the CPU.
//!
//! - [`plan`] (or [`build`] with explicit [`options`]) makes the instructions of one forward
//!   pass ([`instruction`] documents them, the buffers and what each reads and writes), orders
//!   them stage by stage, balances each stage over the SMs by the cost model and
//!   validates the result ([`validate()`]).
//! - Dependencies are what the GPU enforces and nothing more: an instruction runs once every
//!   element it reads carries this step's tag ([`arena`] says where the tagged activations
//!   live and how an element is named); [`deps`] derives the edges from [`access`].
//! - [`Schedule::encode`] gives the words the GPU interprets ([`encode`] documents the layout).
//! - [`dump`] prints a summary, estimates the time per token and exports JSON.
//! - [`buckets`] plans one schedule per range of sequence lengths (split-KV attention
//!   depends on how many positions it reads).
//! - [`exec`] runs a schedule on the CPU by the GPU's rule in seeded random interleavings over
//!   any [`Machine`], and predicts what the GPU reports when an instruction is removed.
//!
//! No CUDA and no pointers here: buffers are named, the runtime maps them to device memory.

pub mod arena;
mod assign;
pub mod buckets;
mod build;
pub mod deps;
pub mod dump;
pub mod encode;
mod error;
pub mod exec;
pub mod instruction;
pub mod options;
mod rng;
mod schedule;
pub mod shape;
pub mod validate;

pub use arena::ArenaLayout;
pub use buckets::{
    bucket_bounds, bucket_context, bucket_for, plan_buckets, plan_buckets_within, Bucket,
};
pub use build::build;
pub use deps::dependencies;
pub use encode::{DecodeError, Encoded, WORDS_PER_INSTR};
pub use error::ScheduleError;
pub use exec::{unwritten_if_dropped, Blind, ExecError, Executor, Interleaving, Machine};
pub use instruction::{access, Access, Buffer, Op, Span, StageKind};
pub use options::{plan, CostModel, Options, Overrides};
pub use schedule::Schedule;
pub use shape::{GpuShape, ModelShape, PRESETS};
pub use validate::validate;

//! The CPU reference forward: f32 arithmetic over the bf16 weights. Ground truth for every
//! GPU path.

pub mod forward;
pub mod ops;
pub mod prefill;
pub mod sliced;

pub use forward::CpuForward;

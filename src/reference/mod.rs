//! The CPU reference forward: f32 arithmetic over the bf16 weights. Ground truth for every
//! GPU path.

pub mod forward;
pub mod ops;
pub mod prefill;
pub mod sliced;

pub use forward::CpuForward;

/// Relative L2 error `‖got − want‖ / ‖want‖`, accumulated in f64: the measure every path's
/// logits are compared with the reference by (docs/testing.md).
pub fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    let (mut d, mut n) = (0f64, 0f64);
    for (g, w) in got.iter().zip(want) {
        d += (f64::from(*g) - f64::from(*w)).powi(2);
        n += f64::from(*w).powi(2);
    }
    (d / n).sqrt()
}

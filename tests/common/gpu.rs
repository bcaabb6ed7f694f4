//! Shared by the GPU tests: skip cleanly without a GPU, compare logits.

use megainfer::gpu::device::Gpu;
use megainfer::model::{presets, Config};

/// Written straight to stderr, past the test harness's capture, so a run without a GPU says
/// that these tests were skipped.
pub fn skip_notice(why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED: {why}");
}

pub fn gpu_or_skip() -> Option<Gpu> {
    if !megainfer::gpu::available() {
        skip_notice("no CUDA GPU/driver on this machine; GPU test not run");
        return None;
    }
    Some(Gpu::new(0).expect("GPU present but could not be opened"))
}

pub fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den).sqrt()
}

/// A 3-layer model of the given attention and MLP shape with a 1000-token vocabulary.
pub fn tiny(hidden: usize, heads: usize, kv: usize, head_dim: usize, inter: usize) -> Config {
    let mut c = presets::by_name("smollm2-135m").unwrap();
    c.hidden_size = hidden;
    c.num_heads = heads;
    c.num_kv_heads = kv;
    c.head_dim = head_dim;
    c.intermediate_size = inter;
    c.num_layers = 3;
    c.vocab_size = 1000;
    c
}

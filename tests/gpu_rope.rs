//! RoPE's rotation on the GPU (kernels/rope.cuh, which the megakernel, the baseline and prefill
//! all use) against f64 at positions up to 131,072, for the frequencies of real models. Needs
//! a GPU (scripts/gpu-check.sh runs it with --include-ignored).

#[path = "common/gpu.rs"]
#[allow(dead_code)]
mod gpu_common;

use cudarc::nvrtc::Ptx;
use gpu_common::gpu;
use megainfer::gpu::compile::compile_cubin;
use megainfer::gpu::device::ptr;
use megainfer::gpu::launch::Kernel;
use megainfer::kargs;
use megainfer::model::presets;

/// Largest |sin - f64| or |cos - f64| over every case: the f32 rounding of a value in [-1, 1]
/// is at most 6e-8, measured on an H100: see the test's output; ten times that.
const TOL: f64 = 6e-7;

const KERNEL: &str = r#"
extern "C" __global__ void rope_table(const unsigned* pos, const float* inv_freq, int n_freq, int n_pos,
                                      float* out) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_pos * n_freq) return;
    const int p = i / n_freq, f = i - p * n_freq;
    rope_sincos(pos[p], inv_freq[f], &out[2 * i], &out[2 * i + 1]);
}
"#;

#[test]
#[ignore = "needs a GPU"]
fn rope_matches_f64_at_every_position() {
    let gpu = gpu();
    let source = [megainfer::gpu::sources::ROPE, KERNEL].join("\n");
    // Compiled as the paths are: with --use_fast_math (compile_cubin's options).
    let cubin = compile_cubin("rope-test", &source, &gpu.arch(), &[]).unwrap();
    let module = gpu.ctx.load_module(Ptx::from_binary(cubin)).unwrap();
    let kernel = Kernel::load(&module, "rope_table").unwrap();
    let positions: Vec<u32> = vec![
        0, 1, 2, 7, 100, 1000, 4095, 4096, 8191, 16384, 32767, 32768, 65535, 65536, 100_000,
        131_071, 131_072,
    ];
    for preset in ["llama-3.2-1b", "smollm2-135m", "qwen3-0.6b"] {
        let cfg = presets::by_name(preset).unwrap();
        let inv = cfg.rope_inv_freq();
        let (n_pos, n_freq) = (positions.len(), inv.len());
        let pos_d = gpu.upload(&positions, "positions").unwrap();
        let inv_d = gpu.upload(&inv, "inv_freq").unwrap();
        let out_d = gpu
            .alloc_zeros::<f32>(2 * n_pos * n_freq, "rope table")
            .unwrap();
        let s = &gpu.stream;
        let (pp, ip, op) = (ptr(&pos_d, s), ptr(&inv_d, s), ptr(&out_d, s));
        let (nf, np) = (n_freq as i32, n_pos as i32);
        let grid = ((n_pos * n_freq) as u32).div_ceil(128);
        // SAFETY: (positions, inv_freq, n_freq, n_pos, out) as rope_table declares them; the
        // buffers hold n_pos, n_freq and 2 * n_pos * n_freq elements and outlive the copy below.
        unsafe {
            kernel
                .launch(s, grid, 128, 0, false, &mut kargs![&pp, &ip, &nf, &np, &op])
                .unwrap();
        }
        let got = s.clone_dtoh(&out_d).unwrap();
        let mut worst = (0f64, 0u32, 0usize);
        let mut worst_f32 = 0f64;
        for (pi, &p) in positions.iter().enumerate() {
            for (f, &w) in inv.iter().enumerate() {
                let angle = p as f64 * w as f64;
                let (ws, wc) = angle.sin_cos();
                let i = pi * n_freq + f;
                let err = (got[2 * i] as f64 - ws)
                    .abs()
                    .max((got[2 * i + 1] as f64 - wc).abs());
                if err > worst.0 {
                    worst = (err, p, f);
                }
                // What an all-f32 angle would give, for the log: the error this avoids.
                let a32 = (p as f32 * w) as f64;
                worst_f32 = worst_f32.max((a32.sin() - ws).abs());
            }
        }
        println!(
            "{preset}: worst |error| {:.2e} at position {} frequency {} (tolerance {TOL:.0e}); \
             an f32 angle would be off by up to {worst_f32:.2e}",
            worst.0, worst.1, worst.2
        );
        assert!(
            worst.0 <= TOL,
            "{preset}: RoPE error {:.2e} at position {} frequency {}",
            worst.0,
            worst.1,
            worst.2
        );
    }
}

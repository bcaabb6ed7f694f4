//! Shared by the GPU tests: open the GPU, compare logits.
//!
//! Every GPU test is `#[ignore = "needs a GPU"]`, so `cargo test` lists it as ignored rather
//! than passed; `scripts/gpu-check.sh` runs them with `--include-ignored`. Run without a GPU,
//! they fail: a GPU test that did not run must never count as passed.

use megainfer::gpu::device::Gpu;
use megainfer::gpu::model::DeviceModel;
use megainfer::gpu::paths::{GpuPath, PathKind};
use megainfer::model::{presets, Config};

/// The GPU, or a test failure saying why there is none.
pub fn gpu() -> Gpu {
    assert!(
        megainfer::gpu::available(),
        "no CUDA GPU/driver on this machine: this GPU test cannot run here"
    );
    Gpu::new(0).expect("GPU present but could not be opened")
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

/// The small models every GPU path is checked on: GQA ratios 1, 3 and 4, head_dim 64 and
/// 128, sizes that are not powers of two; each with its weights and a 9-token input.
pub fn small_cases() -> Vec<(String, Config, megainfer::model::Weights, Vec<u32>)> {
    [
        (192, 3, 3, 64, 520),
        (576, 9, 3, 64, 1536),
        (1024, 8, 2, 128, 2056),
    ]
    .into_iter()
    .enumerate()
    .map(|(i, (h, nh, nkv, hd, inter))| {
        let cfg = tiny(h, nh, nkv, hd, inter);
        let w = megainfer::model::random::random_weights(&cfg, 11 + i as u64);
        let tokens = (0..9).map(|k| (k * 97 + i * 13) as u32 % 1000).collect();
        (format!("tiny{i}"), cfg, w, tokens)
    })
    .collect()
}

/// Logits after `prompt` (one call: batched prefill on the GPU paths) and after each of
/// `steps` fed one at a time.
pub fn prompt_then_steps(
    path: &mut dyn megainfer::generate::Backend,
    prompt: &[u32],
    steps: &[u32],
) -> Vec<Vec<f32>> {
    let mut out = vec![path.feed(prompt).unwrap()];
    for &t in steps {
        out.push(path.feed(&[t]).unwrap());
    }
    out
}

/// Checks each of `got` against `want` (the logits at positions `first_pos`, `first_pos + 1`,
/// …) within `tol`, with equal argmax; returns the worst relative L2 error.
pub fn check_positions(
    label: &str,
    got: &[Vec<f32>],
    want: &[Vec<f32>],
    first_pos: usize,
    tol: f64,
) -> f64 {
    let mut worst = 0f64;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = megainfer::reference::rel_l2(g, w);
        worst = worst.max(err);
        assert!(
            err <= tol,
            "{label}: position {} rel L2 {err:.2e} > {tol:.0e}",
            first_pos + i
        );
        assert_eq!(
            megainfer::sampling::argmax(g),
            megainfer::sampling::argmax(w),
            "{label}: argmax differs at position {}",
            first_pos + i
        );
    }
    worst
}

/// A sampled-decoding path to test: each path as made, and the megakernel once more drawing
/// after each launch, since it draws inside the launch by default on small vocabularies.
pub struct SampledPath {
    pub kind: PathKind,
    /// `Some(false)`: the megakernel's draw set to after the launch.
    pub in_launch: Option<bool>,
}

impl SampledPath {
    /// Every path, then the megakernel drawing after the launch.
    pub fn all() -> Vec<SampledPath> {
        PathKind::ALL
            .into_iter()
            .map(|kind| SampledPath {
                kind,
                in_launch: None,
            })
            .chain([SampledPath {
                kind: PathKind::Megakernel,
                in_launch: Some(false),
            }])
            .collect()
    }

    /// The path's name, and how it draws where that was set.
    pub fn label(&self) -> String {
        let how = match self.in_launch {
            Some(false) => " (draw after the launch)",
            Some(true) => " (draw inside the launch)",
            None => "",
        };
        format!("{}{how}", self.kind.name())
    }

    /// The path, made for `dm` with `max_seq` positions, drawing as set.
    pub fn make<'a>(&self, gpu: &'a Gpu, dm: &'a DeviceModel, max_seq: usize) -> GpuPath<'a> {
        let mut path = GpuPath::new(self.kind, gpu, dm, max_seq, max_seq).unwrap();
        if let Some(on) = self.in_launch {
            path.set_draw_in_launch(on).unwrap();
        }
        path
    }
}

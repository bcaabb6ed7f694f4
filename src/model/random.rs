//! Deterministic random weights of any shape, for tests and `bench --preset` (never zeros).

use half::bf16;
use rayon::prelude::*;

use super::{Config, LayerWeights, Matrix, QkvBias, Weights};

/// SplitMix64: tiny, fast and good enough to fill weight tensors reproducibly. Its state is a
/// counter (each draw adds one constant, then mixes), so draw `i` after a state is computable
/// directly and large tensors fill in parallel with exactly the sequential draws.
struct SplitMix(u64);

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// The value the generator yields when its counter reaches `state`.
fn mix(state: u64) -> u64 {
    let mut z = state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Uniform in [-1, 1).
fn unit(bits: u64) -> f32 {
    (bits >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

impl SplitMix {
    /// The next `n` draws, each through `f`, in order (in parallel: draw `i` is
    /// `mix(state + (i + 1) * GOLDEN)`).
    fn draws<T: Send>(&mut self, n: usize, f: impl Fn(f32) -> T + Sync) -> Vec<T> {
        let base = self.0;
        self.0 = base.wrapping_add((n as u64).wrapping_mul(GOLDEN));
        (0..n as u64)
            .into_par_iter()
            .map(|i| f(unit(mix(base.wrapping_add((i + 1).wrapping_mul(GOLDEN))))))
            .collect()
    }
}

fn tensor(rng: &mut SplitMix, n: usize, scale: f32) -> Vec<bf16> {
    rng.draws(n, |u| bf16::from_f32(u * scale))
}

/// A `[rows, cols]` matrix of `tensor` values.
fn matrix(rng: &mut SplitMix, rows: usize, cols: usize, scale: f32) -> Matrix {
    Matrix::from_bf16(tensor(rng, rows * cols, scale), cols)
}

fn norm(rng: &mut SplitMix, n: usize) -> Vec<bf16> {
    rng.draws(n, |u| bf16::from_f32(1.0 + 0.1 * u))
}

/// Weights scaled like an initialised network (uniform with std ≈ 1/sqrt(fan_in)), so
/// activations stay O(1) through many layers and logits are not degenerate.
pub fn random_weights(cfg: &Config, seed: u64) -> Weights {
    let mut rng = SplitMix(seed);
    let h = cfg.hidden_size;
    let fan = |n: usize| 3f32.sqrt() / (n as f32).sqrt();
    let layers = (0..cfg.num_layers)
        .map(|_| LayerWeights {
            attn_norm: norm(&mut rng, h),
            wq: matrix(&mut rng, cfg.q_dim(), h, fan(h)),
            wk: matrix(&mut rng, cfg.kv_dim(), h, fan(h)),
            wv: matrix(&mut rng, cfg.kv_dim(), h, fan(h)),
            wo: matrix(&mut rng, h, cfg.q_dim(), fan(cfg.q_dim())),
            ffn_norm: norm(&mut rng, h),
            w_gate: matrix(&mut rng, cfg.intermediate_size, h, fan(h)),
            w_up: matrix(&mut rng, cfg.intermediate_size, h, fan(h)),
            w_down: matrix(
                &mut rng,
                h,
                cfg.intermediate_size,
                fan(cfg.intermediate_size),
            ),
            q_norm: cfg.qk_norm.then(|| norm(&mut rng, cfg.head_dim)),
            k_norm: cfg.qk_norm.then(|| norm(&mut rng, cfg.head_dim)),
            qkv_bias: cfg.qkv_bias.then(|| QkvBias {
                q: tensor(&mut rng, cfg.q_dim(), 0.5),
                k: tensor(&mut rng, cfg.kv_dim(), 0.5),
                v: tensor(&mut rng, cfg.kv_dim(), 0.5),
            }),
        })
        .collect();
    Weights {
        embed: matrix(&mut rng, cfg.vocab_size, h, 1.0),
        layers,
        final_norm: norm(&mut rng, h),
        lm_head: if cfg.tie_word_embeddings {
            None
        } else {
            Some(matrix(&mut rng, cfg.vocab_size, h, fan(h)))
        },
    }
}

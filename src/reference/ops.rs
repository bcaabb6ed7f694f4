//! f32 building blocks of the reference forward. Weights stay bf16 and are widened on the fly.

use half::bf16;
use rayon::prelude::*;

use crate::model::LayerWeights;

#[inline]
pub fn widen(x: bf16) -> f32 {
    f32::from_bits((x.to_bits() as u32) << 16)
}

/// f32 -> bf16 -> f32 with round-to-nearest-even, as the GPU stores the KV cache.
pub fn round_bf16(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

#[inline]
fn dot(w: &[f32], x: &[f32]) -> f32 {
    // Eight independent partial sums let the compiler vectorise without reassociation flags.
    let mut acc = [0f32; 8];
    let chunks = w.len() / 8;
    for c in 0..chunks {
        for j in 0..8 {
            acc[j] += w[c * 8 + j] * x[c * 8 + j];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in chunks * 8..w.len() {
        s += w[i] * x[i];
    }
    s
}

/// `out[t][r] = W[r, :] · xs[t]` for every input vector `t`: each weight row is read once per
/// call however many vectors there are (prefill reads the weights once, not once per token).
pub fn matmul(w: &[bf16], cols: usize, xs: &[Vec<f32>]) -> Vec<Vec<f32>> {
    assert_eq!(
        w.len() % cols,
        0,
        "weight length is not a multiple of its row length"
    );
    let rows = w.len() / cols;
    let t = xs.len();
    const BLOCK: usize = 16;
    let mut flat = vec![0f32; rows * t];
    flat.par_chunks_mut(BLOCK * t)
        .enumerate()
        .for_each(|(b, out)| {
            let mut row = vec![0f32; cols];
            for (i, r) in (b * BLOCK..rows.min((b + 1) * BLOCK)).enumerate() {
                for (d, s) in row.iter_mut().zip(&w[r * cols..(r + 1) * cols]) {
                    *d = widen(*s);
                }
                for (ti, x) in xs.iter().enumerate() {
                    out[i * t + ti] = dot(&row, x);
                }
            }
        });
    (0..t)
        .map(|ti| (0..rows).map(|r| flat[r * t + ti]).collect())
        .collect()
}

pub fn rmsnorm(x: &[f32], w: &[bf16], eps: f32) -> Vec<f32> {
    let ms = x.iter().map(|v| (*v as f64) * (*v as f64)).sum::<f64>() / x.len() as f64;
    let scale = (1.0 / (ms + eps as f64).sqrt()) as f32;
    x.iter()
        .zip(w)
        .map(|(v, g)| v * scale * widen(*g))
        .collect()
}

/// What Qwen models do to one token's projections before RoPE: add the q/k/v biases (Qwen2),
/// then RMS-normalise every q and k head over `head_dim` (Qwen3). A no-op for Llama.
pub fn qkv_extras(
    lw: &LayerWeights,
    head_dim: usize,
    eps: f32,
    q: &mut [f32],
    k: &mut [f32],
    v: &mut [f32],
) {
    if let Some(b) = &lw.qkv_bias {
        for (x, bias) in [(&mut *q, &b.q), (&mut *k, &b.k), (&mut *v, &b.v)] {
            x.iter_mut().zip(bias).for_each(|(a, b)| *a += widen(*b));
        }
    }
    for (x, w) in [(&mut *q, &lw.q_norm), (&mut *k, &lw.k_norm)] {
        if let Some(w) = w {
            for head in x.chunks_mut(head_dim) {
                let normed = rmsnorm(head, w, eps);
                head.copy_from_slice(&normed);
            }
        }
    }
}

/// Rotates one head in place, HF `rotate_half` convention: element `i` pairs with `i + d/2`.
pub fn rope(head: &mut [f32], pos: usize, inv_freq: &[f32]) {
    let half = head.len() / 2;
    for i in 0..half {
        let angle = pos as f64 * inv_freq[i] as f64;
        let (s, c) = angle.sin_cos();
        let (s, c) = (s as f32, c as f32);
        let (a, b) = (head[i], head[i + half]);
        head[i] = a * c - b * s;
        head[i + half] = b * c + a * s;
    }
}

pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Softmax attention of one query head over `len` cached positions.
/// `k`/`v` hold `[positions, kv_dim]`; this head reads columns `kv_off..kv_off + q.len()`.
pub fn attend(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    kv_dim: usize,
    kv_off: usize,
    len: usize,
) -> Vec<f32> {
    let d = q.len();
    let scale = 1.0 / (d as f32).sqrt();
    let scores: Vec<f32> = (0..len)
        .map(|p| dot(q, &k[p * kv_dim + kv_off..p * kv_dim + kv_off + d]) * scale)
        .collect();
    let max = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
    let sum: f32 = exps.iter().sum();
    let mut out = vec![0f32; d];
    for (p, e) in exps.iter().enumerate() {
        let w = e / sum;
        let row = &v[p * kv_dim + kv_off..p * kv_dim + kv_off + d];
        for (o, x) in out.iter_mut().zip(row) {
            *o += w * x;
        }
    }
    out
}

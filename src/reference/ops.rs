//! f32 building blocks of the reference forward. Weights stay bf16 and are widened on the fly.

use half::bf16;
use rayon::prelude::*;

use crate::model::{LayerWeights, MatRef};

#[inline]
pub fn widen(x: bf16) -> f32 {
    f32::from_bits((x.to_bits() as u32) << 16)
}

/// f32 -> bf16 -> f32 with round-to-nearest-even, as the GPU stores the KV cache.
pub fn round_bf16(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

#[inline]
fn dot_portable(w: &[f32], x: &[f32]) -> f32 {
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

/// AVX2 + FMA dot products, one over widened f32 rows and one straight from bf16, with the same
/// arithmetic (the widening is exact), so a row gives bit for bit the same sum either way:
/// decode reads bf16 rows directly, prefill-style calls widen a row once for many vectors.
#[cfg(target_arch = "x86_64")]
mod simd {
    use half::bf16;
    use std::arch::x86_64::*;

    use crate::model::quant::QuantType;

    /// Four 8-lane accumulators over 32 elements a step, then 8 at a time into the first; the
    /// lanes summed in a fixed order; the last `len % 8` elements added one by one.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn reduce(acc: [__m256; 4]) -> f32 {
        let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), s);
        lanes.iter().sum()
    }

    /// Defines `$name(w: &[$elem], x: &[f32]) -> f32`: w's lanes loaded by `$load8`, its
    /// tail elements converted by `$to_f32`. One body for both element types, so both sum in
    /// exactly the same order.
    macro_rules! avx2_dot {
        ($name:ident, $elem:ty, $load8:ident, $to_f32:expr) => {
            /// # Safety
            /// The CPU must have AVX2 and FMA; `w` and `x` have the same length.
            #[target_feature(enable = "avx2,fma")]
            pub unsafe fn $name(w: &[$elem], x: &[f32]) -> f32 {
                let n = w.len();
                debug_assert_eq!(n, x.len());
                let (wp, xp) = (w.as_ptr(), x.as_ptr());
                let mut acc = [_mm256_setzero_ps(); 4];
                let mut c = 0;
                // SAFETY (all loads): c + 32 <= n, then c + 8 <= n, within both slices.
                while c + 32 <= n {
                    for (k, a) in acc.iter_mut().enumerate() {
                        let o = c + 8 * k;
                        *a = _mm256_fmadd_ps($load8(wp.add(o)), _mm256_loadu_ps(xp.add(o)), *a);
                    }
                    c += 32;
                }
                while c + 8 <= n {
                    acc[0] = _mm256_fmadd_ps($load8(wp.add(c)), _mm256_loadu_ps(xp.add(c)), acc[0]);
                    c += 8;
                }
                let mut s = reduce(acc);
                let to_f32 = $to_f32;
                for i in c..n {
                    s += to_f32(w[i]) * x[i];
                }
                s
            }
        };
    }

    /// Eight f32 at `p`.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn load8(p: *const f32) -> __m256 {
        _mm256_loadu_ps(p)
    }

    /// Eight bf16 at `p` widened to f32 lanes (bf16 is the top half of an f32).
    #[target_feature(enable = "avx2,fma")]
    unsafe fn widen8(p: *const bf16) -> __m256 {
        let h = _mm_loadu_si128(p as *const __m128i);
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
    }

    avx2_dot!(dot_f32, f32, load8, |v: f32| v);
    avx2_dot!(dot_bf16, bf16, widen8, super::widen);

    /// A row of quantised blocks (`x.len() / 32` of them) dotted with `x`, each block decoded
    /// in registers: its four vectors of eight are exactly the decoded row's, and they meet
    /// `dot_f32`'s four accumulators in the same order, so the sum is bit for bit that of
    /// decoding the row and calling `dot_f32` (rows are whole blocks: no tail).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_blocks(ty: QuantType, data: &[u8], x: &[f32]) -> f32 {
        debug_assert_eq!(data.len(), x.len() / 32 * ty.block_bytes());
        let mut acc = [_mm256_setzero_ps(); 4];
        for (i, b) in data.chunks_exact(ty.block_bytes()).enumerate() {
            let w = crate::model::quant::avx2::block8s(ty, b);
            for (k, a) in acc.iter_mut().enumerate() {
                // SAFETY: 32 i + 8 k + 8 <= x.len() (one block per 32 elements of x).
                *a = _mm256_fmadd_ps(w[k], _mm256_loadu_ps(x.as_ptr().add(32 * i + 8 * k)), *a);
            }
        }
        reduce(acc)
    }

    /// `out += a * x`, eight lanes at a time with FMA, the tail one by one.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA; `out` and `x` have the same length.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn axpy(out: &mut [f32], a: f32, x: &[f32]) {
        let n = out.len();
        debug_assert_eq!(n, x.len());
        let (op, xp) = (out.as_mut_ptr(), x.as_ptr());
        let av = _mm256_set1_ps(a);
        let mut c = 0;
        // SAFETY: c + 8 <= n, within both slices.
        while c + 8 <= n {
            let o = _mm256_loadu_ps(op.add(c));
            _mm256_storeu_ps(
                op.add(c),
                _mm256_fmadd_ps(av, _mm256_loadu_ps(xp.add(c)), o),
            );
            c += 8;
        }
        for i in c..n {
            out[i] += a * x[i];
        }
    }
}

/// AVX2 and FMA for the sums, F16C for quantised blocks' scales (every AVX2 CPU has it).
pub(crate) fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[inline]
fn dot(w: &[f32], x: &[f32], avx: bool) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if avx {
        // SAFETY: `avx` is has_avx2_fma(); the slices have one length (a row and a vector).
        return unsafe { simd::dot_f32(w, x) };
    }
    let _ = avx;
    dot_portable(w, x)
}

/// `out[t][r] = W[r, :] · xs[t]` for every input vector `t`: each weight row is read once per
/// call however many vectors there are (prefill reads the weights once, not once per token).
/// Quantised rows are decoded exactly to f32 first, so the sums are over the exact values.
pub fn matmul(w: MatRef, xs: &[Vec<f32>]) -> Vec<Vec<f32>> {
    let (rows, cols) = (w.rows(), w.cols());
    assert!(
        xs.iter().all(|x| x.len() == cols),
        "input vector length differs from the weight row length"
    );
    let t = xs.len();
    let avx = has_avx2_fma();
    let bf16_rows = w.as_bf16();
    let blocks = w.as_blocks();
    const BLOCK: usize = 16;
    let mut flat = vec![0f32; rows * t];
    flat.par_chunks_mut(BLOCK * t)
        .enumerate()
        .for_each(|(b, out)| {
            let mut row = vec![0f32; cols];
            for (i, r) in (b * BLOCK..rows.min((b + 1) * BLOCK)).enumerate() {
                #[cfg(target_arch = "x86_64")]
                if let (true, 1, Some(v)) = (avx, t, bf16_rows) {
                    // One vector (decode): straight from bf16, the same sum as below.
                    // SAFETY: avx2 + fma detected; the row and xs[0] both hold `cols` elements.
                    out[i] = unsafe { simd::dot_bf16(&v[r * cols..(r + 1) * cols], &xs[0]) };
                    continue;
                }
                #[cfg(target_arch = "x86_64")]
                if let (true, 1, Some((ty, data))) = (avx, t, blocks) {
                    // One vector: blocks decoded in registers, the same sum as below.
                    let n = cols / 32 * ty.block_bytes();
                    // SAFETY: avx2 + fma detected; row r is n bytes of whole blocks for the
                    // `cols` elements of xs[0].
                    out[i] = unsafe { simd::dot_blocks(ty, &data[r * n..(r + 1) * n], &xs[0]) };
                    continue;
                }
                w.row_f32(r, &mut row);
                for (ti, x) in xs.iter().enumerate() {
                    out[i * t + ti] = dot(&row, x, avx);
                }
            }
        });
    let _ = (bf16_rows, blocks);
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
    let avx = has_avx2_fma();
    let scores: Vec<f32> = (0..len)
        .map(|p| dot(q, &k[p * kv_dim + kv_off..p * kv_dim + kv_off + d], avx) * scale)
        .collect();
    let max = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
    let sum: f32 = exps.iter().sum();
    let mut out = vec![0f32; d];
    for (p, e) in exps.iter().enumerate() {
        let w = e / sum;
        let row = &v[p * kv_dim + kv_off..p * kv_dim + kv_off + d];
        #[cfg(target_arch = "x86_64")]
        if avx {
            // SAFETY: avx2 + fma detected; out and row both hold d elements.
            unsafe { simd::axpy(&mut out, w, row) };
            continue;
        }
        for (o, x) in out.iter_mut().zip(row) {
            *o += w * x;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, salt: u32) -> (Vec<bf16>, Vec<f32>) {
        let f = |i: usize, k: u32| {
            ((i as u32).wrapping_mul(2654435761).wrapping_add(k) >> 8) as f32 / 16777216.0 - 0.5
        };
        let w = (0..n).map(|i| bf16::from_f32(f(i, salt))).collect();
        let x = (0..n).map(|i| f(i, salt ^ 0x9e37)).collect();
        (w, x)
    }

    /// Decode (one vector, straight from bf16) and many vectors (rows widened once) give the
    /// same sums bit for bit, at every length's tail; and they stay within rounding of an f64
    /// dot product.
    #[test]
    fn one_vector_and_many_give_the_same_bits() {
        for n in [1usize, 7, 8, 9, 31, 32, 33, 64, 576, 1000, 2051] {
            let rows = 5;
            let (w, _) = data(n * rows, n as u32);
            let (_, x) = data(n, 7 * n as u32);
            let m = MatRef::bf16(&w, n);
            let one = matmul(m, std::slice::from_ref(&x)).remove(0);
            let many = matmul(m, &[x.clone(), x.clone(), x.clone()]);
            for (t, m) in many.iter().enumerate() {
                let a: Vec<u32> = one.iter().map(|v| v.to_bits()).collect();
                let b: Vec<u32> = m.iter().map(|v| v.to_bits()).collect();
                assert_eq!(a, b, "n = {n}, vector {t}");
            }
            for (r, got) in one.iter().enumerate() {
                let exact: f64 = (0..n)
                    .map(|i| widen(w[r * n + i]) as f64 * x[i] as f64)
                    .sum();
                let scale: f64 = (0..n)
                    .map(|i| (widen(w[r * n + i]) as f64 * x[i] as f64).abs())
                    .sum();
                assert!(
                    (*got as f64 - exact).abs() <= 1e-6 * scale.max(1.0),
                    "n = {n} row {r}: {got} vs {exact}"
                );
            }
        }
    }

    /// Quantised rows: one vector (blocks decoded in registers) and many (rows decoded to f32
    /// once) give the same sums bit for bit, and both are the exact decoded values' dot product
    /// within f32 rounding.
    #[test]
    fn quantised_one_vector_and_many_give_the_same_bits() {
        use crate::model::quant::{dequantize_row, quantize_row, QuantType};
        for ty in QuantType::ALL {
            for n in [32usize, 64, 576, 2048] {
                let rows = 5;
                let (_, wf) = data(n * rows, 3 * n as u32);
                let (_, x) = data(n, 11 * n as u32);
                let blocks: Vec<u8> = wf.chunks(n).flat_map(|r| quantize_row(ty, r)).collect();
                let mat = crate::model::Matrix::from_blocks(ty, rows, n, blocks.clone()).unwrap();
                let m = mat.view();
                let one = matmul(m, std::slice::from_ref(&x)).remove(0);
                let many = matmul(m, &[x.clone(), x.clone()]);
                for (t, v) in many.iter().enumerate() {
                    let a: Vec<u32> = one.iter().map(|v| v.to_bits()).collect();
                    let b: Vec<u32> = v.iter().map(|v| v.to_bits()).collect();
                    assert_eq!(a, b, "{ty:?} n = {n}, vector {t}");
                }
                let per_row = n / 32 * ty.block_bytes();
                for (r, got) in one.iter().enumerate() {
                    let mut dec = vec![0f32; n];
                    dequantize_row(ty, &blocks[r * per_row..(r + 1) * per_row], &mut dec);
                    let exact: f64 = dec.iter().zip(&x).map(|(w, x)| *w as f64 * *x as f64).sum();
                    let scale: f64 = dec
                        .iter()
                        .zip(&x)
                        .map(|(w, x)| (*w as f64 * *x as f64).abs())
                        .sum();
                    assert!(
                        (*got as f64 - exact).abs() <= 1e-6 * scale.max(1.0),
                        "{ty:?} n = {n} row {r}: {got} vs {exact}"
                    );
                }
            }
        }
    }
}

//! Batched prefill on the CPU: the prompt goes through every layer a chunk of tokens at a time,
//! each linear layer one blocked matrix-matrix product (weights widened to f32 once per block
//! of rows and reused for every token of the chunk), attention causal over the chunk and the
//! cache of earlier chunks. K/V land in [`CpuForward`]'s cache exactly as token-by-token
//! feeding leaves them (bf16-rounded), so decoding continues unchanged afterwards.
//!
//! [`CpuForward::forward`] stays the reference: the same arithmetic in f32 on the same bf16
//! weights, only summed in another order here.

use anyhow::{bail, Result};
use half::bf16;
use rayon::prelude::*;

use super::ops::{attend, has_avx2_fma, qkv_extras, rope, round_bf16, silu, widen};
use super::CpuForward;
use crate::model::MatRef;

/// Default tokens per chunk: activations of a chunk stay a few MB for 1B-class models, and a
/// chunk amortises each widened weight block over enough tokens.
pub const DEFAULT_CHUNK: usize = 512;

/// Weight rows widened per parallel task.
const ROW_BLOCK: usize = 32;

/// Lanes of the partial sums: one SSE register, which the compiler vectorises over (baseline
/// x86-64; 26 GFLOP/s on one core of this machine's EPYC for the 2 x 4 tile).
const L: usize = 4;

/// `acc[r][t] = w[r] · x[t]` for `NR` weight rows and `NT` tokens: every loaded weight lane is
/// used `NT` times and every token lane `NR` times.
#[inline(always)]
fn micro<const NR: usize, const NT: usize>(w: [&[f32]; NR], x: [&[f32]; NT]) -> [[f32; NT]; NR] {
    let cols = w[0].len();
    let mut acc = [[[0f32; L]; NT]; NR];
    let full = cols / L * L;
    let mut c = 0;
    while c < full {
        for r in 0..NR {
            let wl = &w[r][c..c + L];
            for t in 0..NT {
                let xl = &x[t][c..c + L];
                for l in 0..L {
                    acc[r][t][l] += wl[l] * xl[l];
                }
            }
        }
        c += L;
    }
    let mut out = [[0f32; NT]; NR];
    for r in 0..NR {
        for t in 0..NT {
            let mut s: f32 = acc[r][t].iter().sum();
            for k in full..cols {
                s += w[r][k] * x[t][k];
            }
            out[r][t] = s;
        }
    }
    out
}

/// The 2 x 4 tile with AVX2 and FMA: 8 lanes per register, eight accumulators, two weight
/// loads and four token loads per 16 fused multiply-adds.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU must have AVX2 and FMA, and every slice must have the same length.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn micro_2x4(w: [&[f32]; 2], x: [&[f32]; 4]) -> [[f32; 4]; 2] {
        let cols = w[0].len();
        debug_assert!(w.iter().chain(&x).all(|v| v.len() == cols));
        let full = cols / 8 * 8;
        let mut acc = [[_mm256_setzero_ps(); 4]; 2];
        let mut c = 0;
        while c < full {
            // SAFETY: c + 8 <= full <= the length of every slice.
            let w0 = _mm256_loadu_ps(w[0].as_ptr().add(c));
            let w1 = _mm256_loadu_ps(w[1].as_ptr().add(c));
            for t in 0..4 {
                let xv = _mm256_loadu_ps(x[t].as_ptr().add(c));
                acc[0][t] = _mm256_fmadd_ps(w0, xv, acc[0][t]);
                acc[1][t] = _mm256_fmadd_ps(w1, xv, acc[1][t]);
            }
            c += 8;
        }
        let mut out = [[0f32; 4]; 2];
        for r in 0..2 {
            for t in 0..4 {
                let mut lanes = [0f32; 8];
                _mm256_storeu_ps(lanes.as_mut_ptr(), acc[r][t]);
                let mut s: f32 = lanes.iter().sum();
                for k in full..cols {
                    s += w[r][k] * x[t][k];
                }
                out[r][t] = s;
            }
        }
        out
    }
}

/// One block of `nr` widened weight rows against all `t` tokens: `[token][row]`.
fn block(wf: &[f32], x: &[f32], t: usize, cols: usize, avx: bool) -> Vec<f32> {
    let nr = wf.len() / cols;
    let wrow = |r: usize| &wf[r * cols..(r + 1) * cols];
    let xrow = |i: usize| &x[i * cols..(i + 1) * cols];
    let mut out = vec![0f32; t * nr];
    let mut ti = 0;
    while ti < t {
        let nt = (t - ti).min(4);
        let mut r = 0;
        while r < nr {
            if nr - r >= 2 && nt == 4 {
                let (w2, x4) = (
                    [wrow(r), wrow(r + 1)],
                    [xrow(ti), xrow(ti + 1), xrow(ti + 2), xrow(ti + 3)],
                );
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `avx` says the CPU has AVX2 and FMA; the rows are all `cols` long.
                let a = if avx {
                    unsafe { avx2::micro_2x4(w2, x4) }
                } else {
                    micro::<2, 4>(w2, x4)
                };
                #[cfg(not(target_arch = "x86_64"))]
                let a = {
                    let _ = avx;
                    micro::<2, 4>(w2, x4)
                };
                for (i, row) in a.iter().enumerate() {
                    for (j, v) in row.iter().enumerate() {
                        out[(ti + j) * nr + r + i] = *v;
                    }
                }
                r += 2;
            } else {
                for j in 0..nt {
                    out[(ti + j) * nr + r] = micro::<1, 1>([wrow(r)], [xrow(ti + j)])[0][0];
                }
                r += 1;
            }
        }
        ti += nt;
    }
    out
}

/// `y[t, r] = W[r, :] · x[t, :]` for `x` of `t` rows of `cols` (row-major): `y` is `t` rows of
/// `W`'s row count. Parallel over blocks of weight rows; each block is widened once.
pub fn gemm(w: MatRef, x: &[f32], t: usize) -> Vec<f32> {
    let (rows, cols) = (w.rows(), w.cols());
    assert_eq!(x.len(), t * cols, "input is not {t} rows of {cols}");
    let avx = has_avx2_fma();
    let blocks: Vec<Vec<f32>> = (0..rows.div_ceil(ROW_BLOCK))
        .into_par_iter()
        .map(|b| {
            let wf = w
                .row_range(b * ROW_BLOCK..rows.min((b + 1) * ROW_BLOCK))
                .to_f32();
            block(&wf, x, t, cols, avx)
        })
        .collect();
    let mut y = vec![0f32; t * rows];
    for (b, out) in blocks.iter().enumerate() {
        let r0 = b * ROW_BLOCK;
        let nr = out.len() / t.max(1);
        for ti in 0..t {
            y[ti * rows + r0..ti * rows + r0 + nr].copy_from_slice(&out[ti * nr..(ti + 1) * nr]);
        }
    }
    y
}

/// RMS norm of each `n`-wide row of `x`, scaled by `w`.
fn rmsnorm_rows(x: &[f32], n: usize, w: &[bf16], eps: f32) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    out.par_chunks_mut(n)
        .zip(x.par_chunks(n))
        .for_each(|(o, xi)| {
            let ms = xi.iter().map(|v| (*v as f64) * (*v as f64)).sum::<f64>() / n as f64;
            let scale = (1.0 / (ms + eps as f64).sqrt()) as f32;
            for ((o, v), g) in o.iter_mut().zip(xi).zip(w) {
                *o = v * scale * widen(*g);
            }
        });
    out
}

impl CpuForward<'_> {
    /// Feeds `tokens` as batched prefill in chunks of `chunk` tokens and returns the logits
    /// after the last one.
    pub fn prefill(&mut self, tokens: &[u32], chunk: usize) -> Result<Vec<f32>> {
        let (hidden, last) = self.prefill_hidden(tokens, chunk, false)?;
        debug_assert!(hidden.is_empty());
        Ok(self.logits_rows(&last, 1))
    }

    /// Like [`Self::prefill`], but returns the logits after every token (for checking).
    pub fn prefill_all(&mut self, tokens: &[u32], chunk: usize) -> Result<Vec<Vec<f32>>> {
        let (hidden, _) = self.prefill_hidden(tokens, chunk, true)?;
        let h = self.cfg.hidden_size;
        let v = self.cfg.vocab_size;
        let mut out = Vec::with_capacity(tokens.len());
        // The LM head over many positions at once is large: a few hundred rows per product.
        for rows in hidden.chunks(256 * h) {
            let n = rows.len() / h;
            let logits = self.logits_rows(rows, n);
            out.extend(logits.chunks(v).map(|l| l.to_vec()));
        }
        Ok(out)
    }

    fn logits_rows(&self, hidden: &[f32], n: usize) -> Vec<f32> {
        let c = self.cfg;
        let normed = rmsnorm_rows(hidden, c.hidden_size, &self.w.final_norm, c.rms_norm_eps);
        gemm(self.w.lm_head().view(), &normed, n)
    }

    /// Runs the layers over every chunk; returns every token's final hidden state when `keep`
    /// (else nothing) and the last token's.
    fn prefill_hidden(
        &mut self,
        tokens: &[u32],
        chunk: usize,
        keep: bool,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let c = self.cfg;
        if tokens.is_empty() {
            bail!("no tokens to feed");
        }
        if chunk == 0 {
            bail!("prefill chunk size must be at least 1 token");
        }
        if self.len() + tokens.len() > self.max_context {
            bail!(
                "sequence of {} tokens exceeds the context of {} tokens",
                self.len() + tokens.len(),
                self.max_context
            );
        }
        crate::model::check_tokens(tokens, c.vocab_size)?;
        let mut all = Vec::new();
        let mut last = Vec::new();
        for part in tokens.chunks(chunk) {
            let x = self.prefill_chunk(part);
            last = x[x.len() - c.hidden_size..].to_vec();
            if keep {
                all.extend_from_slice(&x);
            }
        }
        Ok((all, last))
    }

    /// One chunk through every layer at the next positions; returns its final hidden states
    /// (`[tokens, hidden]`). K/V of the chunk are appended to the cache.
    fn prefill_chunk(&mut self, tokens: &[u32]) -> Vec<f32> {
        let c = self.cfg;
        let (h, hd, t) = (c.hidden_size, c.head_dim, tokens.len());
        let (q_dim, kv_dim, group) = (c.q_dim(), c.kv_dim(), c.num_heads / c.num_kv_heads);
        let start = self.len();
        let mut x: Vec<f32> = tokens
            .iter()
            .flat_map(|&tok| {
                let mut row = vec![0f32; h];
                self.w.embed.view().row_f32(tok as usize, &mut row);
                row
            })
            .collect();
        for l in 0..c.num_layers {
            let lw = &self.w.layers[l];
            let normed = rmsnorm_rows(&x, h, &lw.attn_norm, c.rms_norm_eps);
            let mut q = gemm(lw.wq.view(), &normed, t);
            let mut k = gemm(lw.wk.view(), &normed, t);
            let mut v = gemm(lw.wv.view(), &normed, t);
            let inv_freq = &self.inv_freq;
            q.par_chunks_mut(q_dim)
                .zip(k.par_chunks_mut(kv_dim))
                .zip(v.par_chunks_mut(kv_dim))
                .enumerate()
                .for_each(|(i, ((qi, ki), vi))| {
                    let pos = start + i;
                    qkv_extras(lw, hd, c.rms_norm_eps, qi, ki, vi);
                    qi.chunks_mut(hd).for_each(|hh| rope(hh, pos, inv_freq));
                    ki.chunks_mut(hd).for_each(|hh| rope(hh, pos, inv_freq));
                });
            self.k_cache[l].extend(k.iter().map(|&v| round_bf16(v)));
            self.v_cache[l].extend(v.iter().map(|&v| round_bf16(v)));
            let (kc, vc) = (&self.k_cache[l], &self.v_cache[l]);
            let mut attn = vec![0f32; t * q_dim];
            attn.par_chunks_mut(hd).enumerate().for_each(|(j, out)| {
                let (i, head) = (j / c.num_heads, j % c.num_heads);
                let qh = &q[i * q_dim + head * hd..i * q_dim + (head + 1) * hd];
                let o = attend(qh, kc, vc, kv_dim, (head / group) * hd, start + i + 1);
                out.copy_from_slice(&o);
            });
            let o = gemm(lw.wo.view(), &attn, t);
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            let normed = rmsnorm_rows(&x, h, &lw.ffn_norm, c.rms_norm_eps);
            let gate = gemm(lw.w_gate.view(), &normed, t);
            let up = gemm(lw.w_up.view(), &normed, t);
            let act: Vec<f32> = gate.iter().zip(&up).map(|(g, u)| silu(*g) * u).collect();
            let down = gemm(lw.w_down.view(), &act, t);
            x.iter_mut().zip(&down).for_each(|(a, b)| *a += b);
        }
        x
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemm_matches_plain_dot_products() {
        // Shapes with remainders everywhere: rows not a multiple of the block or the pair,
        // tokens not a multiple of 4, columns not a multiple of the lanes.
        for (rows, cols, t) in [(67, 37, 7), (32, 64, 4), (1, 5, 1), (33, 8, 9)] {
            let w: Vec<bf16> = (0..rows * cols)
                .map(|i| bf16::from_f32(((i * 37 % 101) as f32 - 50.0) / 64.0))
                .collect();
            let x: Vec<f32> = (0..t * cols)
                .map(|i| ((i * 53 % 97) as f32 - 48.0) / 32.0)
                .collect();
            let y = gemm(MatRef::bf16(&w, cols), &x, t);
            for ti in 0..t {
                for r in 0..rows {
                    let want: f64 = (0..cols)
                        .map(|k| widen(w[r * cols + k]) as f64 * x[ti * cols + k] as f64)
                        .sum();
                    let got = y[ti * rows + r] as f64;
                    assert!(
                        (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                        "rows {rows} cols {cols} t {t}: y[{ti}, {r}] = {got}, want {want}"
                    );
                }
            }
        }
    }
}

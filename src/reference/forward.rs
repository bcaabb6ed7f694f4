use anyhow::{bail, Result};
use rayon::prelude::*;

use super::ops::{attend, matmul, qkv_extras, rmsnorm, rope, round_bf16, silu};
use crate::model::{Config, Weights};

/// A running sequence on the CPU: weights plus the KV cache of the tokens fed so far.
///
/// K and V are stored rounded to bf16, the cache format of every GPU path (and of HF
/// transformers in bf16): on SmolLM2 an f32 cache alone moves the logits by 1.7% (relative
/// L2), more than the 1e-2 the GPU paths are held to, so the reference models the format.
pub struct CpuForward<'a> {
    pub(super) cfg: &'a Config,
    pub(super) w: &'a Weights,
    pub(super) inv_freq: Vec<f32>,
    pub(super) max_context: usize,
    /// Per layer `[positions, kv_dim]`, grown as tokens arrive.
    pub(super) k_cache: Vec<Vec<f32>>,
    pub(super) v_cache: Vec<Vec<f32>>,
}

impl<'a> CpuForward<'a> {
    pub fn new(cfg: &'a Config, w: &'a Weights, max_context: usize) -> Self {
        Self {
            cfg,
            w,
            inv_freq: cfg.rope_inv_freq(),
            max_context,
            k_cache: vec![Vec::new(); cfg.num_layers],
            v_cache: vec![Vec::new(); cfg.num_layers],
        }
    }

    /// Number of tokens already in the cache (the position of the next token).
    pub fn len(&self) -> usize {
        self.k_cache[0].len() / self.cfg.kv_dim()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops the cached positions from `len` on, so the next token goes to position `len`.
    pub fn truncate(&mut self, len: usize) {
        let kv_dim = self.cfg.kv_dim();
        for cache in self.k_cache.iter_mut().chain(self.v_cache.iter_mut()) {
            cache.truncate(len * kv_dim);
        }
    }

    /// Feeds `tokens` at the next positions and returns the logits after each of them.
    pub fn forward_all(&mut self, tokens: &[u32]) -> Result<Vec<Vec<f32>>> {
        let hidden = self.run_layers(tokens)?;
        let normed: Vec<Vec<f32>> = hidden
            .iter()
            .map(|h| rmsnorm(h, &self.w.final_norm, self.cfg.rms_norm_eps))
            .collect();
        Ok(matmul(self.w.lm_head().view(), &normed))
    }

    /// Feeds `tokens` and returns the logits after the last one.
    pub fn forward(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        let hidden = self.run_layers(tokens)?;
        let last = hidden.last().expect("run_layers rejects empty input");
        let normed = rmsnorm(last, &self.w.final_norm, self.cfg.rms_norm_eps);
        Ok(matmul(self.w.lm_head().view(), &[normed]).remove(0))
    }

    fn run_layers(&mut self, tokens: &[u32]) -> Result<Vec<Vec<f32>>> {
        let c = self.cfg;
        if tokens.is_empty() {
            bail!("no tokens to feed");
        }
        let start = self.len();
        if start + tokens.len() > self.max_context {
            bail!(
                "sequence of {} tokens exceeds the context of {} tokens",
                start + tokens.len(),
                self.max_context
            );
        }
        crate::model::check_tokens(tokens, c.vocab_size)?;
        let (hd, kv_dim, group) = (c.head_dim, c.kv_dim(), c.num_heads / c.num_kv_heads);
        let mut xs: Vec<Vec<f32>> = tokens
            .iter()
            .map(|&t| {
                let mut row = vec![0f32; c.hidden_size];
                self.w.embed.view().row_f32(t as usize, &mut row);
                row
            })
            .collect();

        for (l, lw) in self.w.layers.iter().enumerate() {
            let normed: Vec<Vec<f32>> = xs
                .iter()
                .map(|x| rmsnorm(x, &lw.attn_norm, c.rms_norm_eps))
                .collect();
            let mut q = matmul(lw.wq.view(), &normed);
            let mut k = matmul(lw.wk.view(), &normed);
            let mut v = matmul(lw.wv.view(), &normed);
            for (i, ((qi, ki), vi)) in q.iter_mut().zip(k.iter_mut()).zip(&mut v).enumerate() {
                let pos = start + i;
                qkv_extras(lw, hd, c.rms_norm_eps, qi, ki, vi);
                qi.chunks_mut(hd).for_each(|h| rope(h, pos, &self.inv_freq));
                ki.chunks_mut(hd).for_each(|h| rope(h, pos, &self.inv_freq));
            }
            for (ki, vi) in k.iter().zip(&v) {
                self.k_cache[l].extend(ki.iter().map(|&x| round_bf16(x)));
                self.v_cache[l].extend(vi.iter().map(|&x| round_bf16(x)));
            }
            let (kc, vc) = (&self.k_cache[l], &self.v_cache[l]);
            let attn: Vec<Vec<f32>> = q
                .par_iter()
                .enumerate()
                .map(|(i, qi)| {
                    let len = start + i + 1;
                    (0..c.num_heads)
                        .flat_map(|h| {
                            let kv_off = (h / group) * hd;
                            attend(&qi[h * hd..(h + 1) * hd], kc, vc, kv_dim, kv_off, len)
                        })
                        .collect()
                })
                .collect();
            let o = matmul(lw.wo.view(), &attn);
            for (x, oi) in xs.iter_mut().zip(&o) {
                x.iter_mut().zip(oi).for_each(|(a, b)| *a += b);
            }
            let normed: Vec<Vec<f32>> = xs
                .iter()
                .map(|x| rmsnorm(x, &lw.ffn_norm, c.rms_norm_eps))
                .collect();
            let gate = matmul(lw.w_gate.view(), &normed);
            let up = matmul(lw.w_up.view(), &normed);
            let act: Vec<Vec<f32>> = gate
                .iter()
                .zip(&up)
                .map(|(g, u)| g.iter().zip(u).map(|(g, u)| silu(*g) * u).collect())
                .collect();
            let down = matmul(lw.w_down.view(), &act);
            for (x, di) in xs.iter_mut().zip(&down) {
                x.iter_mut().zip(di).for_each(|(a, b)| *a += b);
            }
        }
        Ok(xs)
    }
}

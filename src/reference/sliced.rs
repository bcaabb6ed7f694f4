//! The scheduler's instructions computed on the CPU, each on exactly the rows, heads and
//! positions it names, over f32 buffers laid out as the megakernel's (see
//! `scheduler::instruction`). Run by `scheduler::exec`, it must reproduce [`super::CpuForward`]:
//! same `ops` on the same slices, so Q/K/V, attention with one partition, O, gate/up and the
//! LM head match bit for bit given the same inputs; only the k-chunked down projection and
//! split-KV attention add in a different order.
//!
//! Every activation (and this token's KV-cache row) is set to NaN when a token begins, so
//! an instruction that runs before something it reads was written yields NaN (or, for the
//! argmax, the poison token `u32::MAX`) instead of a stale value that might pass.
//! The KV cache holds f32 values rounded to bf16, as `CpuForward` and the GPU store it.

use anyhow::{bail, Result};
use half::bf16;
use scheduler::{Machine, ModelShape, Op, Schedule};

use super::ops::{attend, matmul, rmsnorm, rope, round_bf16, silu, widen};
use crate::model::{Config, MatRef, Matrix, Weights};

/// `token_out` (and a block's argmax) when the value it depends on was never written.
pub const POISON_TOKEN: u32 = u32::MAX;

/// The scheduler's view of a model config.
pub fn shape_of(cfg: &Config) -> ModelShape {
    ModelShape {
        hidden: cfg.hidden_size,
        intermediate: cfg.intermediate_size,
        layers: cfg.num_layers,
        heads: cfg.num_heads,
        kv_heads: cfg.num_kv_heads,
        head_dim: cfg.head_dim,
        vocab: cfg.vocab_size,
        qk_norm: cfg.qk_norm,
    }
}

/// The device buffers of one sequence, on the CPU.
#[derive(Clone)]
pub struct SlicedMachine<'a> {
    cfg: &'a Config,
    w: &'a Weights,
    inv_freq: Vec<f32>,
    max_seq: usize,
    /// `token_in`: (token, pos).
    token: u32,
    pos: usize,
    token_out: [u32; 2],
    q: Vec<Vec<f32>>,
    /// Per layer `[max_seq, kv_dim]`, the layout of `CpuForward`'s cache.
    k_cache: Vec<Vec<f32>>,
    /// Per layer this token's K row as `RmsQkvRope` leaves it for a model with q/k norms
    /// (raw; `Attention` norms, rotates and caches it), as the megakernel's `kv_new`.
    k_new: Vec<Vec<f32>>,
    v_cache: Vec<Vec<f32>>,
    attn_part: Vec<Vec<f32>>,
    attn_stats: Vec<Vec<f32>>,
    attn_out: Vec<Vec<f32>>,
    resid_attn: Vec<Vec<f32>>,
    act: Vec<Vec<f32>>,
    /// `[layer][chunk][hidden]`.
    mlp_part: Vec<Vec<Vec<f32>>>,
    logits: Vec<f32>,
    lm_best: Vec<(f32, u32)>,
    /// In a generation: the first position and the token each step feeds (step 0's given,
    /// each later one the argmax of the step before).
    generation: Option<(usize, Vec<u32>)>,
}

impl<'a> SlicedMachine<'a> {
    pub fn new(
        cfg: &'a Config,
        w: &'a Weights,
        schedule: &Schedule,
        max_seq: usize,
    ) -> Result<Self> {
        if w.is_quantized() {
            bail!("sliced executor: the megakernel's instructions read bf16 weights only");
        }
        if schedule.model != shape_of(cfg) {
            bail!(
                "schedule is for {:?}, the model is {:?}",
                schedule.model,
                shape_of(cfg)
            );
        }
        if cfg.qk_norm
            && w.layers
                .iter()
                .any(|lw| lw.q_norm.is_none() || lw.k_norm.is_none())
        {
            bail!("sliced executor: the config has q/k norms, a layer's weights lack them");
        }
        let (l, h, q_dim) = (cfg.num_layers, cfg.hidden_size, cfg.q_dim());
        let chunks = schedule.options.down_chunks;
        let parts = schedule.options.attn_parts;
        let per_layer = |n: usize| vec![vec![f32::NAN; n]; l];
        Ok(SlicedMachine {
            cfg,
            w,
            inv_freq: cfg.rope_inv_freq(),
            max_seq,
            token: 0,
            pos: 0,
            token_out: [POISON_TOKEN; 2],
            q: per_layer(q_dim),
            k_cache: per_layer(max_seq * cfg.kv_dim()),
            k_new: per_layer(cfg.kv_dim()),
            v_cache: per_layer(max_seq * cfg.kv_dim()),
            attn_part: per_layer(if parts > 1 { q_dim * parts } else { 0 }),
            attn_stats: per_layer(if parts > 1 {
                cfg.num_heads * parts * 2
            } else {
                0
            }),
            attn_out: per_layer(q_dim),
            resid_attn: per_layer(h),
            act: per_layer(cfg.intermediate_size),
            mlp_part: vec![vec![vec![f32::NAN; h]; chunks]; l],
            logits: vec![f32::NAN; cfg.vocab_size],
            lm_best: vec![(f32::NAN, POISON_TOKEN); schedule.lm_blocks()],
            generation: None,
        })
    }

    /// Writes `token_in` and poisons everything this token will write.
    pub fn begin_token(&mut self, token: u32, pos: usize) -> Result<()> {
        if token as usize >= self.cfg.vocab_size || pos >= self.max_seq {
            bail!("token {token} at position {pos} is outside the model or the cache");
        }
        self.token = token;
        self.pos = pos;
        self.token_out = [POISON_TOKEN; 2];
        self.generation = None;
        let kv_dim = self.cfg.kv_dim();
        let nan = |v: &mut Vec<f32>| v.fill(f32::NAN);
        for l in 0..self.cfg.num_layers {
            nan(&mut self.q[l]);
            self.k_cache[l][pos * kv_dim..(pos + 1) * kv_dim].fill(f32::NAN);
            nan(&mut self.k_new[l]);
            self.v_cache[l][pos * kv_dim..(pos + 1) * kv_dim].fill(f32::NAN);
            nan(&mut self.attn_part[l]);
            nan(&mut self.attn_stats[l]);
            nan(&mut self.attn_out[l]);
            nan(&mut self.resid_attn[l]);
            nan(&mut self.act[l]);
            self.mlp_part[l].iter_mut().for_each(nan);
        }
        nan(&mut self.logits);
        self.lm_best.fill((f32::NAN, POISON_TOKEN));
        Ok(())
    }

    /// Starts a generation of `steps` greedy steps from `token` at `pos`, as the megakernel
    /// runs one inside a launch (`scheduler::Executor::run_generation`): like `begin_token`
    /// for the first step, with the K/V rows of every step poisoned; the buffers are not
    /// poisoned again between steps (the GPU's are not cleared either).
    pub fn begin_generation(&mut self, token: u32, pos: usize, steps: usize) -> Result<()> {
        if pos + steps > self.max_seq {
            bail!("a generation of {steps} steps from position {pos} passes the cache");
        }
        self.begin_token(token, pos)?;
        let kv_dim = self.cfg.kv_dim();
        for l in 0..self.cfg.num_layers {
            self.k_cache[l][pos * kv_dim..(pos + steps) * kv_dim].fill(f32::NAN);
            self.v_cache[l][pos * kv_dim..(pos + steps) * kv_dim].fill(f32::NAN);
        }
        self.generation = Some((pos, vec![token]));
        Ok(())
    }

    /// The tokens a generation fed and chose so far (the first one given).
    pub fn generated(&self) -> &[u32] {
        self.generation.as_ref().map_or(&[], |g| &g.1)
    }

    pub fn logits(&self) -> &[f32] {
        &self.logits
    }

    /// `token_out`: (next token, next position).
    pub fn token_out(&self) -> (u32, u32) {
        (self.token_out[0], self.token_out[1])
    }

    /// Element `r` of layer `layer`'s input: the embedding for layer 0, else the virtual sum
    /// `mlp_part[l-1][0] + mlp_part[l-1][1] + …` (chunk 0 holds `resid_attn[l-1]` too).
    fn input(&self, layer: usize, r: usize) -> f32 {
        if layer == 0 {
            return widen(bf(&self.w.embed)[self.token as usize * self.cfg.hidden_size + r]);
        }
        self.mlp_part[layer - 1].iter().map(|p| p[r]).sum()
    }

    fn input_all(&self, layer: usize) -> Vec<f32> {
        (0..self.cfg.hidden_size)
            .map(|r| self.input(layer, r))
            .collect()
    }

    fn qkv(&mut self, layer: usize, head: usize, pair_start: usize, pair_count: usize) {
        let c = self.cfg;
        let (h, hd) = (c.hidden_size, c.head_dim);
        let half = hd / 2;
        let lw = &self.w.layers[layer];
        let x = rmsnorm(&self.input_all(layer), &lw.attn_norm, c.rms_norm_eps);
        let (weights, local, rotate) = if head < c.num_heads {
            (bf(&lw.wq), head, true)
        } else if head < c.num_heads + c.num_kv_heads {
            (bf(&lw.wk), head - c.num_heads, true)
        } else {
            (bf(&lw.wv), head - c.num_heads - c.num_kv_heads, false)
        };
        let lo = local * hd + pair_start;
        let hi = lo + half;
        let rows = |r: usize| {
            matmul(
                MatRef::bf16(&weights[r * h..(r + pair_count) * h], h),
                std::slice::from_ref(&x),
            )
            .remove(0)
        };
        let mut out = rows(lo);
        out.extend(rows(hi));
        // Qwen2's biases on these rows. Qwen3's q/k norms span the head: q and k stay raw
        // here, and `attention` norms and rotates them.
        if let Some(b) = &lw.qkv_bias {
            let bias = if head < c.num_heads {
                &b.q
            } else if rotate {
                &b.k
            } else {
                &b.v
            };
            let at = |r: usize| widen(bias[r]);
            for (i, o) in out.iter_mut().enumerate() {
                *o += at(if i < pair_count {
                    lo + i
                } else {
                    hi + i - pair_count
                });
            }
        }
        let raw = rotate && c.qk_norm;
        if raw && head >= c.num_heads {
            let row = &mut self.k_new[layer][lo..hi + pair_count];
            row[..pair_count].copy_from_slice(&out[..pair_count]);
            row[half..].copy_from_slice(&out[pair_count..]);
            return;
        }
        if rotate && !raw {
            // A head of 2·pair_count elements pairs i with i + pair_count: exactly the pairs
            // pair_start + i of the full head, with their frequencies.
            rope(
                &mut out,
                self.pos,
                &self.inv_freq[pair_start..pair_start + pair_count],
            );
        }
        let (dest, base) = if head < c.num_heads {
            (&mut self.q[layer], 0)
        } else if rotate {
            (&mut self.k_cache[layer], self.pos * c.kv_dim())
        } else {
            (&mut self.v_cache[layer], self.pos * c.kv_dim())
        };
        let is_cache = head >= c.num_heads;
        let store = |x: f32| if is_cache { round_bf16(x) } else { x };
        for (d, o) in dest[base + lo..base + lo + pair_count]
            .iter_mut()
            .zip(&out[..pair_count])
        {
            *d = store(*o);
        }
        for (d, o) in dest[base + hi..base + hi + pair_count]
            .iter_mut()
            .zip(&out[pair_count..])
        {
            *d = store(*o);
        }
    }

    /// Qwen3's q or k head as the reference has it before attention: RMS-normed over the
    /// head with `weight`, then rotated.
    fn norm_rope(&self, raw: &[f32], weight: &[bf16]) -> Vec<f32> {
        let mut x = rmsnorm(raw, weight, self.cfg.rms_norm_eps);
        rope(&mut x, self.pos, &self.inv_freq);
        x
    }

    /// Query heads `heads` of `kv_head`'s group over part `part` of `parts`.
    fn attention(
        &mut self,
        layer: usize,
        kv_head: usize,
        part: usize,
        parts: usize,
        heads: std::ops::Range<usize>,
    ) {
        let c = self.cfg;
        let (hd, kv_dim) = (c.head_dim, c.kv_dim());
        let len = self.pos + 1;
        let lw = &self.w.layers[layer];
        let qk_norm = lw
            .q_norm
            .as_ref()
            .zip(lw.k_norm.as_ref())
            .filter(|_| c.qk_norm);
        if let (Some((_, kw)), true) = (qk_norm, part + 1 == parts) {
            // The part that reads this token's K row finishes it and caches it.
            let cols = kv_head * hd..(kv_head + 1) * hd;
            let k = self.norm_rope(&self.k_new[layer][cols.clone()], kw);
            let at = self.pos * kv_dim;
            for (d, x) in self.k_cache[layer][at + cols.start..at + cols.end]
                .iter_mut()
                .zip(k)
            {
                *d = round_bf16(x);
            }
        }
        let (k, v) = (&self.k_cache[layer], &self.v_cache[layer]);
        for head in heads {
            let raw = &self.q[layer][head * hd..(head + 1) * hd];
            let normed = qk_norm.map(|(qw, _)| self.norm_rope(raw, qw));
            let q = normed.as_deref().unwrap_or(raw);
            if parts == 1 {
                let out = attend(q, k, v, kv_dim, kv_head * hd, len);
                self.attn_out[layer][head * hd..(head + 1) * hd].copy_from_slice(&out);
                continue;
            }
            let range = part * len / parts..(part + 1) * len / parts;
            let (out, max, sum) = partial_attend(q, k, v, kv_dim, kv_head * hd, range);
            let slot = head * parts + part;
            self.attn_part[layer][slot * hd..(slot + 1) * hd].copy_from_slice(&out);
            self.attn_stats[layer][slot * 2..slot * 2 + 2].copy_from_slice(&[max, sum]);
        }
    }

    fn attn_reduce(&mut self, layer: usize, kv_head: usize, parts: usize) {
        let c = self.cfg;
        let (hd, group) = (c.head_dim, c.num_heads / c.num_kv_heads);
        for head in kv_head * group..(kv_head + 1) * group {
            let stats = &self.attn_stats[layer][head * parts * 2..(head + 1) * parts * 2];
            let max = stats
                .chunks(2)
                .map(|s| s[0])
                .fold(f32::NEG_INFINITY, f32::max);
            let weights: Vec<f32> = stats.chunks(2).map(|s| s[1] * (s[0] - max).exp()).collect();
            let total: f32 = weights.iter().sum();
            let mut out = vec![0f32; hd];
            for (p, w) in weights.iter().enumerate() {
                let slot = head * parts + p;
                let part = &self.attn_part[layer][slot * hd..(slot + 1) * hd];
                out.iter_mut()
                    .zip(part)
                    .for_each(|(o, x)| *o += w / total * x);
            }
            self.attn_out[layer][head * hd..(head + 1) * hd].copy_from_slice(&out);
        }
    }

    fn o_proj(&mut self, layer: usize, rows: std::ops::Range<usize>) {
        let q_dim = self.cfg.q_dim();
        let wo = &bf(&self.w.layers[layer].wo)[rows.start * q_dim..rows.end * q_dim];
        let o = matmul(MatRef::bf16(wo, q_dim), &[self.attn_out[layer].clone()]).remove(0);
        for (i, r) in rows.enumerate() {
            self.resid_attn[layer][r] = self.input(layer, r) + o[i];
        }
    }

    fn up_gate(&mut self, layer: usize, rows: std::ops::Range<usize>) {
        let c = self.cfg;
        let h = c.hidden_size;
        let lw = &self.w.layers[layer];
        let x = rmsnorm(&self.resid_attn[layer], &lw.ffn_norm, c.rms_norm_eps);
        let span = rows.start * h..rows.end * h;
        let gate = matmul(
            MatRef::bf16(&bf(&lw.w_gate)[span.clone()], h),
            std::slice::from_ref(&x),
        )
        .remove(0);
        let up = matmul(MatRef::bf16(&bf(&lw.w_up)[span], h), &[x]).remove(0);
        for (i, r) in rows.enumerate() {
            self.act[layer][r] = silu(gate[i]) * up[i];
        }
    }

    fn down(
        &mut self,
        layer: usize,
        rows: std::ops::Range<usize>,
        chunk: usize,
        cols: std::ops::Range<usize>,
    ) {
        let inter = self.cfg.intermediate_size;
        let wd = bf(&self.w.layers[layer].w_down);
        let block: Vec<bf16> = rows
            .clone()
            .flat_map(|r| {
                wd[r * inter + cols.start..r * inter + cols.end]
                    .iter()
                    .copied()
            })
            .collect();
        let x = self.act[layer][cols.clone()].to_vec();
        let mut out = matmul(MatRef::bf16(&block, cols.len()), &[x]).remove(0);
        if chunk == 0 {
            for (o, r) in out.iter_mut().zip(rows.clone()) {
                *o += self.resid_attn[layer][r];
            }
        }
        self.mlp_part[layer][chunk][rows].copy_from_slice(&out);
    }

    fn lm_head(&mut self, rows: std::ops::Range<usize>, block: usize) {
        let c = self.cfg;
        let h = c.hidden_size;
        let x = rmsnorm(
            &self.input_all(c.num_layers),
            &self.w.final_norm,
            c.rms_norm_eps,
        );
        let logits = matmul(
            MatRef::bf16(&bf(self.w.lm_head())[rows.start * h..rows.end * h], h),
            &[x],
        )
        .remove(0);
        let mut best = (f32::NEG_INFINITY, POISON_TOKEN);
        for (i, &v) in logits.iter().enumerate() {
            if v.is_nan() {
                best = (f32::NAN, POISON_TOKEN);
                break;
            }
            if best.1 == POISON_TOKEN || v > best.0 {
                best = (v, (rows.start + i) as u32);
            }
        }
        self.logits[rows].copy_from_slice(&logits);
        self.lm_best[block] = best;
    }

    fn argmax(&mut self, blocks: usize) {
        let mut best: Option<(f32, u32)> = None;
        for &(max, row) in &self.lm_best[..blocks] {
            if max.is_nan() || row == POISON_TOKEN {
                self.token_out = [POISON_TOKEN; 2];
                return;
            }
            if best.is_none_or(|(b, _)| max > b) {
                best = Some((max, row));
            }
        }
        let row = best.map_or(POISON_TOKEN, |(_, r)| r);
        self.token_out = [row, self.pos as u32 + 1];
        if let Some((pos0, tokens)) = &mut self.generation {
            // This step's token feeds the next one.
            debug_assert_eq!(tokens.len(), self.pos - *pos0 + 1);
            tokens.push(row);
        }
    }
}

/// Softmax attention of one head over positions `range` (the partition's share): the output
/// normalised by its own sum, the max score and the sum of `exp(score - max)`. An empty range
/// gives zeros, −∞ and 0, which the reduction weighs by 0.
fn partial_attend(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    kv_dim: usize,
    kv_off: usize,
    range: std::ops::Range<usize>,
) -> (Vec<f32>, f32, f32) {
    let d = q.len();
    let mut out = vec![0f32; d];
    if range.is_empty() {
        return (out, f32::NEG_INFINITY, 0.0);
    }
    let scale = 1.0 / (d as f32).sqrt();
    let row = |p: usize| p * kv_dim + kv_off..p * kv_dim + kv_off + d;
    let scores: Vec<f32> = range
        .clone()
        .map(|p| q.iter().zip(&k[row(p)]).map(|(a, b)| a * b).sum::<f32>() * scale)
        .collect();
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
    let sum: f32 = exps.iter().sum();
    for (p, e) in range.zip(&exps) {
        let w = e / sum;
        for (o, x) in out.iter_mut().zip(&v[row(p)]) {
            *o += w * x;
        }
    }
    (out, max, sum)
}

impl Machine for SlicedMachine<'_> {
    /// Step `step` of a generation feeds its token at its position.
    fn enter_step(&mut self, step: u32) {
        if let Some((pos0, tokens)) = &self.generation {
            self.pos = pos0 + step as usize;
            self.token = tokens.get(step as usize).copied().unwrap_or(POISON_TOKEN);
        }
    }

    fn exec(&mut self, op: &Op) {
        let u = |x: u32| x as usize;
        let rows = |s: u32, n: u32| u(s)..u(s) + u(n);
        match *op {
            Op::RmsQkvRope {
                layer,
                head,
                pair_start,
                pair_count,
            } => self.qkv(u(layer), u(head), u(pair_start), u(pair_count)),
            Op::Attention {
                layer,
                kv_head,
                part,
                parts,
                head_start,
                head_count,
            } => self.attention(
                u(layer),
                u(kv_head),
                u(part),
                u(parts),
                rows(head_start, head_count),
            ),
            Op::AttnReduce {
                layer,
                kv_head,
                parts,
            } => self.attn_reduce(u(layer), u(kv_head), u(parts)),
            Op::OProjResidual {
                layer,
                row_start,
                row_count,
            } => self.o_proj(u(layer), rows(row_start, row_count)),
            Op::RmsUpGateSilu {
                layer,
                row_start,
                row_count,
            } => self.up_gate(u(layer), rows(row_start, row_count)),
            Op::DownProjPartial {
                layer,
                row_start,
                row_count,
                chunk,
                col_start,
                col_count,
            } => self.down(
                u(layer),
                rows(row_start, row_count),
                u(chunk),
                rows(col_start, col_count),
            ),
            Op::RmsLmHead {
                row_start,
                row_count,
                block,
            } => self.lm_head(rows(row_start, row_count), u(block)),
            Op::Argmax { blocks } => self.argmax(u(blocks)),
        }
    }
}

/// A matrix's bf16 values: `SlicedMachine::new` refuses weights with any other storage.
fn bf(m: &Matrix) -> &[bf16] {
    m.as_bf16()
        .expect("SlicedMachine::new refuses quantised weights")
}

//! Choosing the next token from logits: greedy, or a draw from llama.cpp's default sampler
//! chain (repetition penalty, top-k, top-p, min-p, temperature) made with the Gumbel-max trick
//! and a counter-based RNG, so that the GPU kernels (`kernels/sampling/`) implement the very
//! same rule. docs/sampling.md describes the design.

pub mod device;
pub mod philox;

use anyhow::{bail, Result};
use rayon::prelude::*;

/// Most candidates a truncating sampler (top-k, top-p, min-p) keeps: the candidates are the
/// `K_MAX` largest logits, and top-k, top-p and min-p cut that list further. Per-block top
/// lists of this length, merged, hold the global top `K_MAX` exactly, which is what lets the
/// GPU find them in parallel. The same constant is `SMP_KMAX` in kernels/sampling/select.cuh.
pub const K_MAX: usize = 128;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy (the argmax of the penalised logits).
    pub temperature: f32,
    /// 0 means no top-k cut; at most [`K_MAX`].
    pub top_k: usize,
    /// 1 means no nucleus cut.
    pub top_p: f32,
    /// 0 means no min-p cut.
    pub min_p: f32,
    /// llama.cpp's `--repeat-penalty`: 1 means none.
    pub repeat_penalty: f32,
    /// llama.cpp's `--repeat-last-n`: how many of the latest tokens are penalised (0: none).
    pub repeat_last_n: usize,
    pub seed: u64,
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            seed: 0,
        }
    }

    pub fn validate(&self) -> Result<()> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            bail!(
                "--temperature must be a finite number >= 0 (got {})",
                self.temperature
            );
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            bail!("--top-p must be in (0, 1] (got {})", self.top_p);
        }
        if !(self.min_p >= 0.0 && self.min_p <= 1.0) {
            bail!("--min-p must be in [0, 1] (got {})", self.min_p);
        }
        if self.top_k > K_MAX {
            bail!(
                "--top-k {} exceeds the sampler's candidate limit of {K_MAX} (0 turns top-k off)",
                self.top_k
            );
        }
        if !self.repeat_penalty.is_finite() || self.repeat_penalty <= 0.0 {
            bail!(
                "--repeat-penalty must be a finite number > 0 (got {})",
                self.repeat_penalty
            );
        }
        Ok(())
    }

    /// Plain argmax of the raw logits: the path every backend chains on the device.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 && !self.penalises()
    }

    pub fn penalises(&self) -> bool {
        self.repeat_penalty != 1.0 && self.repeat_last_n > 0
    }

    /// Whether the candidates are cut to the top [`K_MAX`] and below.
    pub fn truncates(&self) -> bool {
        self.top_k > 0 || self.top_p < 1.0 || self.min_p > 0.0
    }
}

/// The sampling options of `run` and `bench` (the seed is each command's own `--seed`).
#[derive(clap::Args, Debug, Clone)]
pub struct SamplingArgs {
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Keep only the k most likely tokens (0 = off; at most 128).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Nucleus sampling mass (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Drop tokens less likely than this fraction of the most likely one (0 = off).
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    /// Divide positive logits of recent tokens by this, multiply negative ones (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// How many of the latest tokens (prompt included) the penalty covers; -1 = all.
    #[arg(long, default_value_t = 64, allow_negative_numbers = true)]
    pub repeat_last_n: i64,
}

impl SamplingArgs {
    pub fn params(&self, seed: u64) -> Result<SamplingParams> {
        let repeat_last_n = match self.repeat_last_n {
            -1 => usize::MAX,
            n if n >= 0 => n as usize,
            n => bail!("--repeat-last-n must be >= 0, or -1 for the whole context (got {n})"),
        };
        let p = SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            repeat_last_n,
            seed,
        };
        p.validate()?;
        Ok(p)
    }
}

/// Index of the largest logit; the lowest index wins a tie, as on the GPU.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Indices of the `k` largest logits, largest first; equal logits in index order.
pub fn top_k(logits: &[f32], k: usize) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    let k = k.min(idx.len());
    if k == 0 {
        return Vec::new();
    }
    let order = |a: &u32, b: &u32| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    };
    idx.select_nth_unstable_by(k - 1, order);
    idx.truncate(k);
    idx.sort_by(order);
    idx
}

/// The logits after the repetition penalty (llama.cpp's rule: each distinct token among the
/// last `repeat_last_n` of `context` has a positive logit divided by the penalty, a
/// non-positive one multiplied), with NaN read as −∞ so it can never be drawn.
pub fn penalised(p: &SamplingParams, logits: &[f32], context: &[u32]) -> Vec<f32> {
    let mut l: Vec<f32> = logits
        .iter()
        .map(|&x| if x.is_nan() { f32::NEG_INFINITY } else { x })
        .collect();
    if p.penalises() {
        let from = context.len().saturating_sub(p.repeat_last_n);
        let mut seen = std::collections::HashSet::new();
        for &t in &context[from..] {
            if (t as usize) < l.len() && seen.insert(t) {
                let x = &mut l[t as usize];
                *x = if *x <= 0.0 {
                    *x * p.repeat_penalty
                } else {
                    *x / p.repeat_penalty
                };
            }
        }
    }
    l
}

/// The truncated candidate list for penalised logits `l`: token ids, largest logit first
/// (ties in index order). Top-k, then top-p over the softmax (temperature 1) of what top-k
/// kept, then min-p relative to the largest logit, all within the top [`K_MAX`].
pub fn candidates(p: &SamplingParams, l: &[f32]) -> Vec<u32> {
    let mut cand = top_k(l, K_MAX);
    if cand.is_empty() {
        return cand;
    }
    let max = l[cand[0] as usize] as f64;
    if p.top_k > 0 {
        cand.truncate(p.top_k);
    }
    if p.top_p < 1.0 {
        let weight = |i: u32| (l[i as usize] as f64 - max).exp();
        let z: f64 = if p.top_k > 0 {
            cand.iter().map(|&i| weight(i)).sum()
        } else {
            (0..l.len() as u32).map(weight).sum()
        };
        // The running mass is compared as acc / z, as on the GPU.
        let mut acc = 0.0;
        for j in 0..cand.len() {
            acc += weight(cand[j]);
            if acc / z >= p.top_p as f64 {
                cand.truncate(j + 1);
                break;
            }
        }
    }
    if p.min_p > 0.0 {
        let floor = max + (p.min_p as f64).ln();
        let keep = cand
            .iter()
            .take_while(|&&i| l[i as usize] as f64 >= floor)
            .count();
        cand.truncate(keep.max(1));
    }
    cand
}

/// Gumbel-max perturbed score of token `i` with penalised logit `x`; the draw is the
/// candidate with the largest score, the lower index winning a tie.
pub fn score(p: &SamplingParams, pos: u64, i: u32, x: f32) -> f64 {
    x as f64 / p.temperature as f64 + philox::gumbel(p.seed, pos, i)
}

/// The token drawn at sequence position `pos` (the position of the last token of `context`)
/// from its `logits`: a pure function of its arguments, as on the GPU.
pub fn sample_at(p: &SamplingParams, logits: &[f32], pos: u64, context: &[u32]) -> u32 {
    if p.is_greedy() {
        return argmax(logits);
    }
    let l = penalised(p, logits, context);
    if p.temperature == 0.0 {
        return argmax(&l);
    }
    let better = |a: (f64, u32), b: (f64, u32)| {
        if b.0 > a.0 || (b.0 == a.0 && b.1 < a.1) {
            b
        } else {
            a
        }
    };
    let scored = |i: u32| {
        let x = l[i as usize];
        if x == f32::NEG_INFINITY {
            (f64::NEG_INFINITY, u32::MAX)
        } else {
            (score(p, pos, i, x), i)
        }
    };
    let none = (f64::NEG_INFINITY, u32::MAX);
    let best = if p.truncates() {
        candidates(p, &l).into_iter().map(scored).fold(none, better)
    } else {
        // Every token is a candidate: one Philox draw and two logarithms each, spread over
        // the threads (the reduction is a total order, so the result does not depend on it).
        (0..l.len() as u32)
            .into_par_iter()
            .map(scored)
            .reduce(|| none, better)
    };
    if best.1 == u32::MAX {
        // Every logit is −∞ or NaN: nothing to draw from, so fall back to the argmax.
        return argmax(&l);
    }
    best.1
}

/// The exact probability of each token under [`sample_at`]'s rule (softmax of the penalised
/// logits over temperature, over the candidates), for tests.
pub fn probabilities(p: &SamplingParams, logits: &[f32], context: &[u32]) -> Vec<f64> {
    let l = penalised(p, logits, context);
    let mut out = vec![0.0; l.len()];
    if p.temperature == 0.0 {
        out[argmax(&l) as usize] = 1.0;
        return out;
    }
    let cand: Vec<u32> = if p.truncates() {
        candidates(p, &l)
    } else {
        (0..l.len() as u32).collect()
    };
    let max = cand
        .iter()
        .map(|&i| l[i as usize] as f64)
        .fold(f64::NEG_INFINITY, f64::max);
    let mut z = 0.0;
    for &i in &cand {
        let w = ((l[i as usize] as f64 - max) / p.temperature as f64).exp();
        out[i as usize] = w;
        z += w;
    }
    out.iter_mut().for_each(|x| *x /= z);
    out
}

/// The host-side sampler of one sequence: its parameters and the tokens fed so far (the
/// repetition penalty's window, and the position each draw is keyed by).
pub struct Sampler {
    params: SamplingParams,
    context: Vec<u32>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        Self {
            params,
            context: Vec::new(),
        }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Records tokens fed to the model (prompt or generated).
    pub fn accept(&mut self, tokens: &[u32]) {
        self.context.extend_from_slice(tokens);
    }

    pub fn context(&self) -> &[u32] {
        &self.context
    }

    pub fn reset(&mut self) {
        self.context.clear();
    }

    /// The token after the last accepted one, from the logits the model gave for it.
    pub fn sample(&self, logits: &[f32]) -> u32 {
        let pos = self.context.len().saturating_sub(1) as u64;
        sample_at(&self.params, logits, pos, &self.context)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            ..SamplingParams::greedy()
        }
    }

    #[test]
    fn greedy_picks_first_maximum() {
        assert_eq!(argmax(&[0.0, 3.0, 3.0, -1.0]), 1);
        let s = Sampler::new(SamplingParams::greedy());
        assert_eq!(s.sample(&[0.5, -2.0, 7.0]), 2);
    }

    #[test]
    fn top_k_one_is_greedy_at_any_temperature() {
        let logits = [0.1, 2.0, 1.9, -3.0];
        let p = SamplingParams {
            top_k: 1,
            ..params(5.0)
        };
        for pos in 0..100 {
            assert_eq!(sample_at(&p, &logits, pos, &[]), 1);
        }
    }

    #[test]
    fn truncation_rules_keep_the_expected_candidates() {
        // softmax of [2, 1, 0, -10] = 0.665, 0.245, 0.090, 0.00001.
        let l = [2.0, 1.0, 0.0, -10.0];
        let cut = |p: SamplingParams| candidates(&p, &l);
        assert_eq!(cut(params(1.0)), vec![0, 1, 2, 3]);
        assert_eq!(
            cut(SamplingParams {
                top_p: 0.9,
                ..params(1.0)
            }),
            vec![0, 1]
        );
        assert_eq!(
            cut(SamplingParams {
                top_p: 0.6,
                ..params(1.0)
            }),
            vec![0]
        );
        // Top-p after top-k 2: 0.665 / 0.910 = 0.731 < 0.75, so both stay.
        let kp = SamplingParams {
            top_k: 2,
            top_p: 0.75,
            ..params(1.0)
        };
        assert_eq!(cut(kp), vec![0, 1]);
        // min-p 0.3: e^(l - 2) >= 0.3 keeps l >= 2 + ln 0.3 = 0.796.
        assert_eq!(
            cut(SamplingParams {
                min_p: 0.3,
                ..params(1.0)
            }),
            vec![0, 1]
        );
        assert_eq!(
            cut(SamplingParams {
                top_k: 3,
                ..params(1.0)
            }),
            vec![0, 1, 2]
        );
    }

    #[test]
    fn repetition_penalty_follows_llama_cpp() {
        let p = SamplingParams {
            repeat_penalty: 2.0,
            repeat_last_n: 3,
            ..params(1.0)
        };
        let l = [4.0, -1.0, 3.0, 0.0, 5.0];
        // Window = last 3 of the context: tokens 1, 0, 1 (token 4 is older): each distinct
        // token penalised once.
        let got = penalised(&p, &l, &[4, 1, 0, 1]);
        assert_eq!(got, vec![2.0, -2.0, 3.0, 0.0, 5.0]);
        let off = SamplingParams {
            repeat_last_n: 0,
            ..p
        };
        assert_eq!(penalised(&off, &l, &[4, 1, 0, 1]), l.to_vec());
    }

    #[test]
    fn nan_logits_are_never_drawn() {
        let l = [f32::NAN, 1.0, f32::NAN, 0.5];
        for pos in 0..200 {
            let t = sample_at(&params(2.0), &l, pos, &[]);
            assert!(t == 1 || t == 3, "drew {t}");
        }
    }

    #[test]
    fn bad_params_are_rejected() {
        let msg = |p: SamplingParams| p.validate().unwrap_err().to_string();
        assert!(msg(params(-1.0)).contains("--temperature"));
        assert!(msg(SamplingParams {
            top_p: 0.0,
            ..params(1.0)
        })
        .contains("--top-p"));
        assert!(msg(SamplingParams {
            min_p: 1.5,
            ..params(1.0)
        })
        .contains("--min-p"));
        assert!(msg(SamplingParams {
            top_k: K_MAX + 1,
            ..params(1.0)
        })
        .contains("--top-k"));
        assert!(msg(SamplingParams {
            repeat_penalty: 0.0,
            ..params(1.0)
        })
        .contains("--repeat-penalty"));
    }
}

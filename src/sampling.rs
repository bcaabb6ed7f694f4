//! Choosing the next token from logits: greedy, or temperature with top-k / top-p.

use anyhow::{bail, Result};

#[derive(Debug, Clone, Copy)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 means no top-k cut.
    pub top_k: usize,
    /// 1 means no nucleus cut.
    pub top_p: f32,
    pub seed: u64,
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
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
        Ok(())
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
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

/// Indices of the `k` largest logits, largest first.
pub fn top_k(logits: &[f32], k: usize) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    let k = k.min(idx.len());
    idx.select_nth_unstable_by(k.saturating_sub(1), |&a, &b| {
        logits[b as usize].total_cmp(&logits[a as usize])
    });
    idx.truncate(k);
    idx.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
    idx
}

pub struct Sampler {
    params: SamplingParams,
    state: u64,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        Self {
            params,
            state: params.seed ^ 0x2545_F491_4F6C_DD1D,
        }
    }

    fn next_f64(&mut self) -> f64 {
        // SplitMix64 step: reproducible for a given --seed on every platform.
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let p = self.params;
        if p.is_greedy() {
            return argmax(logits);
        }
        let k = if p.top_k == 0 { logits.len() } else { p.top_k };
        let cand = top_k(logits, k);
        let max = logits[cand[0] as usize] as f64;
        let mut probs: Vec<f64> = cand
            .iter()
            .map(|&i| ((logits[i as usize] as f64 - max) / p.temperature as f64).exp())
            .collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= total);
        // Nucleus: the smallest prefix (largest first) whose mass reaches top_p.
        let mut keep = probs.len();
        let mut acc = 0.0;
        for (i, &q) in probs.iter().enumerate() {
            acc += q;
            if acc >= p.top_p as f64 {
                keep = i + 1;
                break;
            }
        }
        let mass: f64 = probs[..keep].iter().sum();
        let mut r = self.next_f64() * mass;
        for (i, &q) in probs[..keep].iter().enumerate() {
            if r < q {
                return cand[i];
            }
            r -= q;
        }
        cand[keep - 1]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_first_maximum() {
        assert_eq!(argmax(&[0.0, 3.0, 3.0, -1.0]), 1);
        let mut s = Sampler::new(SamplingParams::greedy());
        assert_eq!(s.sample(&[0.5, -2.0, 7.0]), 2);
    }

    #[test]
    fn top_k_one_is_greedy_at_any_temperature() {
        let logits = [0.1, 2.0, 1.9, -3.0];
        let mut s = Sampler::new(SamplingParams {
            temperature: 5.0,
            top_k: 1,
            top_p: 1.0,
            seed: 9,
        });
        for _ in 0..100 {
            assert_eq!(s.sample(&logits), 1);
        }
    }

    #[test]
    fn top_p_excludes_the_tail_and_frequencies_follow_softmax() {
        // probs ∝ e^2, e^1, e^0, e^-10: top_p 0.9 keeps the first two (0.665 + 0.245 = 0.91).
        let logits = [2.0, 1.0, 0.0, -10.0];
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.9,
            seed: 1,
        });
        let mut counts = [0usize; 4];
        let n = 20000;
        for _ in 0..n {
            counts[s.sample(&logits) as usize] += 1;
        }
        assert_eq!(counts[2] + counts[3], 0, "{counts:?}");
        let frac = counts[0] as f64 / n as f64;
        let expect = 1.0 / (1.0 + (-1f64).exp());
        assert!((frac - expect).abs() < 0.02, "{frac} vs {expect}");
    }

    #[test]
    fn same_seed_same_samples() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let params = SamplingParams {
            temperature: 0.8,
            top_k: 20,
            top_p: 0.95,
            seed: 42,
        };
        let a: Vec<u32> = {
            let mut s = Sampler::new(params);
            (0..64).map(|_| s.sample(&logits)).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(params);
            (0..64).map(|_| s.sample(&logits)).collect()
        };
        assert_eq!(a, b);
        assert!(
            a.iter().any(|&t| t != a[0]),
            "sampling at T=0.8 never varied"
        );
    }

    #[test]
    fn bad_params_are_rejected() {
        let bad = SamplingParams {
            temperature: -1.0,
            ..SamplingParams::greedy()
        };
        assert!(bad
            .validate()
            .unwrap_err()
            .to_string()
            .contains("--temperature"));
        let bad = SamplingParams {
            top_p: 0.0,
            ..SamplingParams::greedy()
        };
        assert!(bad.validate().unwrap_err().to_string().contains("--top-p"));
    }
}

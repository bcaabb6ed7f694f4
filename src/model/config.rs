//! Model hyper-parameters, shared by every loader and every execution path.

use anyhow::{bail, Result};

/// Llama 3 style RoPE frequency rescaling (HF `rope_scaling.rope_type == "llama3"`).
#[derive(Debug, Clone, PartialEq)]
pub struct Llama3RopeScaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position_embeddings: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Architecture as named by the source (`LlamaForCausalLM`, GGUF `llama`).
    pub architecture: String,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rope_theta: f32,
    pub rope_scaling: Option<Llama3RopeScaling>,
    /// GGUF `rope_freqs.weight`: per-frequency divisors that replace `rope_scaling` when present.
    pub rope_freq_divisors: Option<Vec<f32>>,
    pub rms_norm_eps: f32,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: usize,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// Qwen3: RMS norm over `head_dim` of every q and k head before RoPE (`q_norm`, `k_norm`).
    pub qk_norm: bool,
    /// Qwen2: bias vectors added after the q, k and v projections.
    pub qkv_bias: bool,
}

impl Config {
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Checks the relations every execution path relies on.
    pub fn validate(&self) -> Result<()> {
        let fields = [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_layers),
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("vocab_size", self.vocab_size),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (name, v) in fields {
            if v == 0 {
                bail!("config: {name} must be positive");
            }
            if v > 1 << 24 {
                bail!("config: {name} = {v} is implausibly large");
            }
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            bail!(
                "config: num_attention_heads ({}) is not a multiple of num_key_value_heads ({})",
                self.num_heads,
                self.num_kv_heads
            );
        }
        if !self.head_dim.is_multiple_of(2) {
            bail!("config: head_dim ({}) must be even for RoPE", self.head_dim);
        }
        if let Some(d) = &self.rope_freq_divisors {
            if d.len() != self.head_dim / 2 {
                bail!(
                    "config: rope_freqs has {} entries, expected head_dim/2 = {}",
                    d.len(),
                    self.head_dim / 2
                );
            }
        }
        if self.rope_theta.is_nan()
            || self.rope_theta <= 0.0
            || self.rms_norm_eps.is_nan()
            || self.rms_norm_eps <= 0.0
        {
            bail!("config: rope_theta and rms_norm_eps must be positive");
        }
        Ok(())
    }

    /// RoPE inverse frequencies, one per rotated pair, with llama3 scaling applied.
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        let d = self.head_dim;
        (0..d / 2)
            .map(|i| {
                let base = (self.rope_theta as f64).powf(-((2 * i) as f64) / d as f64);
                let f = if let Some(div) = &self.rope_freq_divisors {
                    base / div[i] as f64
                } else if let Some(s) = &self.rope_scaling {
                    llama3_scale(base, s)
                } else {
                    base
                };
                f as f32
            })
            .collect()
    }
}

fn llama3_scale(inv_freq: f64, s: &Llama3RopeScaling) -> f64 {
    let orig = s.original_max_position_embeddings as f64;
    let (lf, hf) = (s.low_freq_factor as f64, s.high_freq_factor as f64);
    let low_freq_wavelen = orig / lf;
    let high_freq_wavelen = orig / hf;
    let wavelen = 2.0 * std::f64::consts::PI / inv_freq;
    if wavelen < high_freq_wavelen {
        inv_freq
    } else if wavelen > low_freq_wavelen {
        inv_freq / s.factor as f64
    } else {
        let smooth = (orig / wavelen - lf) / (hf - lf);
        (1.0 - smooth) * inv_freq / s.factor as f64 + smooth * inv_freq
    }
}

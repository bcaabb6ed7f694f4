//! Shapes of well-known models, for runs that need no weight files.

use anyhow::{bail, Result};

use super::{Config, Llama3RopeScaling};

pub const NAMES: &[&str] = &["llama-3.2-1b", "llama-3.2-3b", "smollm2-135m"];

pub fn by_name(name: &str) -> Result<Config> {
    let llama32 = |hidden, inter, layers, heads, head_dim| Config {
        architecture: "LlamaForCausalLM".into(),
        hidden_size: hidden,
        intermediate_size: inter,
        num_layers: layers,
        num_heads: heads,
        num_kv_heads: 8,
        head_dim,
        vocab_size: 128256,
        rope_theta: 500000.0,
        rope_scaling: Some(Llama3RopeScaling {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        }),
        rope_freq_divisors: None,
        rms_norm_eps: 1e-5,
        tie_word_embeddings: true,
        max_position_embeddings: 131072,
        bos_token_id: Some(128000),
        eos_token_ids: vec![128001, 128008, 128009],
    };
    Ok(match name {
        "llama-3.2-1b" => llama32(2048, 8192, 16, 32, 64),
        "llama-3.2-3b" => llama32(3072, 8192, 28, 24, 128),
        "smollm2-135m" => Config {
            architecture: "LlamaForCausalLM".into(),
            hidden_size: 576,
            intermediate_size: 1536,
            num_layers: 30,
            num_heads: 9,
            num_kv_heads: 3,
            head_dim: 64,
            vocab_size: 49152,
            rope_theta: 100000.0,
            rope_scaling: None,
            rope_freq_divisors: None,
            rms_norm_eps: 1e-5,
            tie_word_embeddings: true,
            max_position_embeddings: 8192,
            bos_token_id: Some(1),
            eos_token_ids: vec![2],
        },
        other => bail!("unknown preset '{other}' (known: {})", NAMES.join(", ")),
    })
}

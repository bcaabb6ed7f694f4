//! Shapes of well-known models, for runs that need no weight files. Values are those of the
//! models' published `config.json` (the instruct variants where base and instruct differ).

use anyhow::{bail, Result};

use super::{Config, Llama3RopeScaling};

pub const NAMES: &[&str] = &[
    "llama-3.2-1b",
    "llama-3.2-3b",
    "llama-3.1-8b",
    "smollm2-135m",
    "qwen3-0.6b",
    "qwen3-1.7b",
    "qwen3-4b",
    "qwen3-8b",
    "qwen2.5-0.5b",
    "qwen2.5-7b",
];

/// `[hidden, intermediate, layers, heads, kv heads, head_dim]`.
type Shape = [usize; 6];

fn llama3(shape: Shape, factor: f32, tie: bool) -> Config {
    let [hidden, inter, layers, heads, kv, head_dim] = shape;
    Config {
        architecture: "LlamaForCausalLM".into(),
        hidden_size: hidden,
        intermediate_size: inter,
        num_layers: layers,
        num_heads: heads,
        num_kv_heads: kv,
        head_dim,
        vocab_size: 128256,
        rope_theta: 500000.0,
        rope_scaling: Some(Llama3RopeScaling {
            factor,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        }),
        rope_freq_divisors: None,
        rms_norm_eps: 1e-5,
        tie_word_embeddings: tie,
        max_position_embeddings: 131072,
        bos_token_id: Some(128000),
        eos_token_ids: vec![128001, 128008, 128009],
        qk_norm: false,
        qkv_bias: false,
    }
}

/// Qwen3 (q/k norm, no bias) or Qwen2.5 (q/k/v bias): rope theta 1e6, rms eps 1e-6.
fn qwen(qwen3: bool, shape: Shape, vocab: usize, tie: bool, max_pos: usize) -> Config {
    let [hidden, inter, layers, heads, kv, head_dim] = shape;
    Config {
        architecture: if qwen3 {
            "Qwen3ForCausalLM"
        } else {
            "Qwen2ForCausalLM"
        }
        .into(),
        hidden_size: hidden,
        intermediate_size: inter,
        num_layers: layers,
        num_heads: heads,
        num_kv_heads: kv,
        head_dim,
        vocab_size: vocab,
        rope_theta: 1_000_000.0,
        rope_scaling: None,
        rope_freq_divisors: None,
        rms_norm_eps: 1e-6,
        tie_word_embeddings: tie,
        max_position_embeddings: max_pos,
        bos_token_id: Some(151643),
        // <|im_end|> ends a turn, <|endoftext|> a document.
        eos_token_ids: vec![151645, 151643],
        qk_norm: qwen3,
        qkv_bias: !qwen3,
    }
}

pub fn by_name(name: &str) -> Result<Config> {
    Ok(match name {
        "llama-3.2-1b" => llama3([2048, 8192, 16, 32, 8, 64], 32.0, true),
        "llama-3.2-3b" => llama3([3072, 8192, 28, 24, 8, 128], 32.0, true),
        "llama-3.1-8b" => llama3([4096, 14336, 32, 32, 8, 128], 8.0, false),
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
            qk_norm: false,
            qkv_bias: false,
        },
        "qwen3-0.6b" => qwen(true, [1024, 3072, 28, 16, 8, 128], 151936, true, 40960),
        "qwen3-1.7b" => qwen(true, [2048, 6144, 28, 16, 8, 128], 151936, true, 40960),
        "qwen3-4b" => qwen(true, [2560, 9728, 36, 32, 8, 128], 151936, true, 40960),
        "qwen3-8b" => qwen(true, [4096, 12288, 36, 32, 8, 128], 151936, false, 40960),
        "qwen2.5-0.5b" => qwen(false, [896, 4864, 24, 14, 2, 64], 151936, true, 32768),
        "qwen2.5-7b" => qwen(false, [3584, 18944, 28, 28, 4, 128], 152064, false, 32768),
        other => bail!("unknown preset '{other}' (known: {})", NAMES.join(", ")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_preset_is_self_consistent() {
        for name in NAMES {
            let c = by_name(name).unwrap();
            c.validate().unwrap_or_else(|e| panic!("{name}: {e:#}"));
            // Llama and Qwen2 derive head_dim from hidden/heads; Qwen3 states it (128 for all
            // sizes, which is hidden/heads only for 1.7B and 8B).
            if !c.qk_norm {
                assert_eq!(c.hidden_size, c.num_heads * c.head_dim, "{name}");
            }
            assert!(c.eos_token_ids.iter().all(|&e| (e as usize) < c.vocab_size));
            assert!(c.bos_token_id.is_some_and(|b| (b as usize) < c.vocab_size));
            assert_eq!(c.qk_norm, c.architecture == "Qwen3ForCausalLM", "{name}");
            assert_eq!(c.qkv_bias, c.architecture == "Qwen2ForCausalLM", "{name}");
        }
    }

    #[test]
    fn parameter_counts_match_the_published_sizes() {
        // Non-embedding plus embedding parameters, in billions, against the model names.
        let params = |c: &Config| {
            let (h, q, kv, f) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
            let layer = h * (2 * q + 2 * kv) + 3 * h * f;
            let head = if c.tie_word_embeddings { 1 } else { 2 };
            (c.num_layers * layer + head * c.vocab_size * h) as f64 / 1e9
        };
        for (name, lo, hi) in [
            ("llama-3.2-1b", 1.2, 1.3),
            ("llama-3.2-3b", 3.1, 3.3),
            ("llama-3.1-8b", 7.9, 8.1),
            ("qwen3-0.6b", 0.55, 0.65),
            ("qwen3-1.7b", 1.6, 2.1),
            ("qwen3-4b", 3.9, 4.1),
            ("qwen3-8b", 8.1, 8.3),
            ("qwen2.5-0.5b", 0.45, 0.52),
            ("qwen2.5-7b", 7.5, 7.7),
        ] {
            let p = params(&by_name(name).unwrap());
            assert!((lo..=hi).contains(&p), "{name}: {p:.3} B parameters");
        }
    }
}

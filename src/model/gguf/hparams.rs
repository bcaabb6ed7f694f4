//! `Config` from a GGUF file's `<arch>.*` (llama, qwen2, qwen3) and `tokenizer.ggml.*` metadata.

use anyhow::{anyhow, bail, Result};

use super::metadata::Metadata;
use super::reader::GgufFile;
use crate::model::Config;

/// `general.architecture` values we run; each names the prefix of its metadata keys.
const ARCHITECTURES: &[&str] = &["llama", "qwen2", "qwen3"];
/// llama.cpp's default when a file has no `rope.freq_base`.
const DEFAULT_ROPE_THETA: f32 = 10_000.0;

/// Builds the config; `rope_freq_divisors` is left empty (it lives in a tensor, filled in by the
/// weight loader).
pub fn config(file: &GgufFile) -> Result<Config> {
    let (src, m) = (file.source(), file.metadata());
    let architecture = m.req_str("general.architecture")?;
    if !ARCHITECTURES.contains(&architecture) {
        bail!(
            "{src}: architecture '{architecture}' is not supported (only {})",
            ARCHITECTURES.join(", ")
        );
    }
    let key = |k: &str| format!("{architecture}.{k}");

    let hidden_size = m.req_usize(&key("embedding_length"))?;
    let num_heads = m.req_usize(&key("attention.head_count"))?;
    let head_dim = match m.opt_usize(&key("attention.key_length"))? {
        Some(d) => d,
        None if num_heads > 0 && hidden_size.is_multiple_of(num_heads) => hidden_size / num_heads,
        None => bail!(
            "{src}: no {}, and {} ({hidden_size}) is not a multiple of {} ({num_heads})",
            key("attention.key_length"),
            key("embedding_length"),
            key("attention.head_count")
        ),
    };
    // Our weight layout has one head size for Q, K and V, and rotates whole heads.
    if let Some(v) = m.opt_usize(&key("attention.value_length"))? {
        if v != head_dim {
            bail!(
                "{src}: {} ({v}) differs from the key length ({head_dim}): not supported",
                key("attention.value_length")
            );
        }
    }
    if let Some(r) = m.opt_usize(&key("rope.dimension_count"))? {
        if r != head_dim {
            bail!(
                "{src}: {} ({r}) differs from the head size ({head_dim}): partial RoPE is not \
                 supported",
                key("rope.dimension_count")
            );
        }
    }
    // Scaled RoPE without `rope_freqs.weight` (linear, YaRN) would silently change the model.
    if let Some(kind) = m.opt_str(&key("rope.scaling.type"))? {
        if kind != "none" {
            bail!(
                "{src}: {} '{kind}' is not supported",
                key("rope.scaling.type")
            );
        }
    }

    let vocab_size = match m.opt_string_array("tokenizer.ggml.tokens")? {
        Some(tokens) => tokens.len(),
        None => m.opt_usize(&key("vocab_size"))?.ok_or_else(|| {
            anyhow!(
                "{src}: neither tokenizer.ggml.tokens nor {} gives the vocabulary size",
                key("vocab_size")
            )
        })?,
    };
    let (bos_token_id, eos_token_ids) = special_token_ids(src, m, vocab_size)?;

    let config = Config {
        architecture: architecture.to_string(),
        hidden_size,
        intermediate_size: m.req_usize(&key("feed_forward_length"))?,
        num_layers: m.req_usize(&key("block_count"))?,
        num_heads,
        num_kv_heads: m
            .opt_usize(&key("attention.head_count_kv"))?
            .unwrap_or(num_heads),
        head_dim,
        vocab_size,
        rope_theta: m
            .opt_f32(&key("rope.freq_base"))?
            .unwrap_or(DEFAULT_ROPE_THETA),
        rope_scaling: None,
        rope_freq_divisors: None,
        rms_norm_eps: m.req_f32(&key("attention.layer_norm_rms_epsilon"))?,
        tie_word_embeddings: file.tensor("output.weight").is_none(),
        max_position_embeddings: m.req_usize(&key("context_length"))?,
        bos_token_id,
        eos_token_ids,
        qk_norm: architecture == "qwen3",
        // llama.cpp's qwen2 always has the biases; a qwen3 file may carry them too.
        qkv_bias: architecture == "qwen2"
            || (architecture == "qwen3" && file.tensor("blk.0.attn_q.bias").is_some()),
    };
    config.validate().map_err(|e| anyhow!("{src}: {e}"))?;
    Ok(config)
}

/// BOS, and the ids that end generation: EOS plus end-of-turn / end-of-message tokens, which
/// instruct models emit instead of EOS.
pub fn special_token_ids(
    src: &str,
    m: &Metadata,
    vocab_size: usize,
) -> Result<(Option<u32>, Vec<u32>)> {
    let id = |k: &str| -> Result<Option<u32>> {
        let key = format!("tokenizer.ggml.{k}");
        match m.opt_u32(&key)? {
            Some(id) if id as usize >= vocab_size => bail!(
                "{src}: metadata key '{key}': token id {id} is outside the vocabulary of \
                 {vocab_size}"
            ),
            other => Ok(other),
        }
    };
    let bos = id("bos_token_id")?;
    let mut eos = Vec::new();
    for k in ["eos_token_id", "eot_token_id", "eom_token_id"] {
        if let Some(t) = id(k)? {
            if !eos.contains(&t) {
                eos.push(t);
            }
        }
    }
    Ok((bos, eos))
}

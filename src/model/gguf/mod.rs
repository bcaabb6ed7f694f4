//! Loading a llama model from a GGUF file: container, metadata, dequantization to bf16, and
//! the tokenizer stored in the metadata.

mod hparams;
mod metadata;
mod quant;
mod reader;
mod tensors;

use std::path::Path;

use anyhow::Result;

pub use metadata::{Array, Metadata, Value};
pub use quant::{dequantize, dequantize_f32, q4_k_as_q4_1, q5_0_as_q8_0, q6_k_as_blocks, GgmlType};
pub use reader::{GgufFile, TensorInfo};
pub use tensors::{unpermute_qk, unpermute_qk_rows};

use super::Model;
use crate::tokenizer::gguf_bpe;

/// Loads config, weights (as bf16, Q/K rows in HF order) and tokenizer from a GGUF file.
pub fn load(path: &Path) -> Result<Model> {
    let file = GgufFile::open(path)?;
    let mut config = hparams::config(&file)?;
    tensors::check(&config, &file)?;
    // The tokenizer is cheap and may fail, so it goes before the dequantization.
    let tokenizer = gguf_bpe::from_gguf(&file)?;
    let (weights, rope_freqs) = tensors::load(&config, &file)?;
    // `check` held rope_freqs to head_dim/2 entries, the length `Config::validate` wants.
    config.rope_freq_divisors = rope_freqs;
    Ok(Model {
        config,
        weights,
        tokenizer,
    })
}

/// BOS and the ids that end generation, as the file's tokenizer metadata gives them.
pub(crate) fn special_token_ids(
    file: &GgufFile,
    vocab_size: usize,
) -> Result<(Option<u32>, Vec<u32>)> {
    hparams::special_token_ids(file.source(), file.metadata(), vocab_size)
}

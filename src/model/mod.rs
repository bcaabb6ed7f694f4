//! Loading a model: config, weights and tokenizer from an HF directory or a GGUF file.

pub mod config;
pub mod gguf;
pub mod hf;
pub mod presets;
pub mod quant;
pub mod random;
pub mod weights;

use std::path::Path;

use anyhow::{bail, Result};

pub use config::{Config, Llama3RopeScaling};
pub use weights::{LayerWeights, MatRef, Matrix, QkvBias, WeightType, Weights};

use crate::tokenizer::Tokenizer;

pub struct Model {
    pub config: Config,
    pub weights: Weights,
    /// `None` for weight-only directories (e.g. random weights saved by transformers).
    pub tokenizer: Option<Tokenizer>,
}

/// Loads a model from `path`: a `.gguf` file or an HF directory holding `config.json`.
pub fn load(path: &Path) -> Result<Model> {
    if !path.exists() {
        bail!("model path {} does not exist", path.display());
    }
    let model = if path.is_dir() {
        hf::load(path)?
    } else if path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
    {
        gguf::load(path)?
    } else {
        bail!(
            "{}: not a model (expected a .gguf file or an HF directory with config.json)",
            path.display()
        );
    };
    model.config.validate()?;
    Ok(model)
}

/// Every id must index the embedding table: a GPU step reads its row without a bounds check,
/// so an id past the vocabulary would read past the table rather than fail; the CPU paths
/// give the same error.
pub fn check_tokens(tokens: &[u32], vocab: usize) -> Result<()> {
    if let Some(&t) = tokens.iter().find(|&&t| t as usize >= vocab) {
        bail!("token id {t} is outside the vocabulary of {vocab}");
    }
    Ok(())
}

#[cfg(test)]
mod token_tests {
    use super::check_tokens;

    #[test]
    fn token_ids_are_checked_against_the_vocabulary() {
        check_tokens(&[0, 5, 999], 1000).unwrap();
        check_tokens(&[], 1000).unwrap();
        let err = check_tokens(&[3, 1000, 7], 1000).unwrap_err().to_string();
        assert_eq!(err, "token id 1000 is outside the vocabulary of 1000");
    }
}

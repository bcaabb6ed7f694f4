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

//! HF-format model directories: `config.json`, safetensors weights (single file or sharded),
//! and optionally `tokenizer.json` with `tokenizer_config.json`.

mod config_json;
mod safetensors_loader;
mod tokenizer_files;

use std::path::Path;

use anyhow::{Context, Result};

pub use config_json::parse_config;

use super::Model;

pub fn load(dir: &Path) -> Result<Model> {
    let config_path = dir.join("config.json");
    let source = config_path.display().to_string();
    let text = std::fs::read_to_string(&config_path)
        .with_context(|| format!("{source}: cannot read the model config"))?;
    let mut config = parse_config(&text, &source)?;

    let generation_path = dir.join("generation_config.json");
    if generation_path.is_file() {
        let source = generation_path.display().to_string();
        let text = std::fs::read_to_string(&generation_path)
            .with_context(|| format!("{source}: cannot read"))?;
        config_json::add_generation_eos(&mut config, &text, &source)?;
    }

    // The tokenizer first: it is cheap, and a broken one should not cost a multi-GB read.
    let tokenizer = tokenizer_files::load_tokenizer(dir, &config)?;
    let weights = safetensors_loader::load_weights(dir, &config)?;
    Ok(Model {
        config,
        weights,
        tokenizer,
    })
}

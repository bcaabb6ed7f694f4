//! Text <-> token ids, and the chat template.

pub mod chat;
pub mod gguf_bpe;

use anyhow::{anyhow, Result};

pub struct Tokenizer {
    pub inner: tokenizers::Tokenizer,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// Whether encoding a prompt starts with BOS.
    pub add_bos: bool,
    /// Jinja chat template, when the model has one.
    pub chat_template: Option<String>,
}

impl Tokenizer {
    /// Encodes raw text (special-token strings such as `<|im_start|>` map to their ids),
    /// prefixed with BOS when the model asks for it.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_with(text, self.add_bos)
    }

    /// Encodes a rendered chat template: the template writes whatever special tokens it wants
    /// (BOS included), so none is added, as HF's `apply_chat_template` does.
    pub fn encode_chat(&self, rendered: &str) -> Result<Vec<u32>> {
        self.encode_with(rendered, false)
    }

    fn encode_with(&self, text: &str, add_bos: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| anyhow!("tokenizer: cannot encode prompt: {e}"))?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if add_bos {
            if let Some(b) = self.bos_token_id {
                ids.push(b);
            }
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, true)
            .map_err(|e| anyhow!("tokenizer: cannot decode: {e}"))
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}

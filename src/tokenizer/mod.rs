//! Text <-> token ids, and the chat template.

pub mod chat;
pub mod gguf_bpe;
mod guard;

use anyhow::{anyhow, bail, Result};

pub use guard::catch_panic;

/// Longest special (added) token accepted. The tokenizers crate matches added tokens with an
/// Aho-Corasick automaton whose construction time grows with the square of a token's length
/// (10K bytes: seconds; 1 MB: hours); real special tokens are under 100 bytes.
pub const MAX_SPECIAL_TOKEN_BYTES: usize = 512;

/// Refuses a special token longer than `MAX_SPECIAL_TOKEN_BYTES`; `what` says where it is.
pub fn check_special_token_len(source: &str, what: &str, content: &str) -> Result<()> {
    if content.len() > MAX_SPECIAL_TOKEN_BYTES {
        let start: String = content.chars().take(24).collect();
        bail!(
            "{source}: {what} ({start:?}...) is {} bytes, longer than the limit of \
             {MAX_SPECIAL_TOKEN_BYTES} bytes for a special token (MAX_SPECIAL_TOKEN_BYTES)",
            content.len()
        );
    }
    Ok(())
}

pub struct Tokenizer {
    pub inner: tokenizers::Tokenizer,
    /// The file the tokenizer came from, for messages.
    pub source: String,
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
        let enc = catch_panic(|| self.inner.encode(text, false))
            .map_err(|p| {
                anyhow!(
                    "{}: the tokenizer crashed while encoding the prompt ({p})",
                    self.source
                )
            })?
            .map_err(|e| anyhow!("{}: cannot encode the prompt: {e}", self.source))?;
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
        catch_panic(|| self.inner.decode(ids, true))
            .map_err(|p| {
                anyhow!(
                    "{}: the tokenizer crashed while decoding tokens {ids:?} ({p})",
                    self.source
                )
            })?
            .map_err(|e| anyhow!("{}: cannot decode tokens {ids:?}: {e}", self.source))
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}

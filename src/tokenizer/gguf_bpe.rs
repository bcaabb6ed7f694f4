//! A byte-level BPE tokenizer (`tokenizer.ggml.model = "gpt2"`) built in memory from GGUF
//! metadata.

use anyhow::{anyhow, bail, Result};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

use super::{catch_panic, check_special_token_len, Tokenizer};
use crate::model::gguf::{self, GgufFile};

/// `tokenizer.ggml.token_type` of control tokens (`<|im_start|>`, `<|eot_id|>`, ...).
const TOKEN_TYPE_CONTROL: i64 = 3;

/// Llama 3's pre-tokenizer regex, as its `tokenizer.json` gives it. GGUF files name it
/// (`llama-bpe`) but do not carry it.
const LLAMA3_PATTERN: &str = concat!(
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)",
    r"|[^\r\n\p{L}\p{N}]?\p{L}+",
    r"|\p{N}{1,3}",
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"|\s*[\r\n]+",
    r"|\s+(?!\S)",
    r"|\s+",
);

/// The file's tokenizer, or `None` when it has no tokenizer metadata.
pub fn from_gguf(file: &GgufFile) -> Result<Option<Tokenizer>> {
    let (src, m) = (file.source(), file.metadata());
    let Some(model) = m.opt_str("tokenizer.ggml.model")? else {
        return Ok(None);
    };
    if model != "gpt2" {
        bail!(
            "{src}: tokenizer.ggml.model is '{model}': only 'gpt2' (byte-level BPE) tokenizers \
             are supported"
        );
    }
    let pre = m.opt_str("tokenizer.ggml.pre")?.unwrap_or("default");
    let pre_tokenizer = pre_tokenizer(pre).map_err(|e| anyhow!("{src}: {e}"))?;

    let tokens = m.req_string_array("tokenizer.ggml.tokens")?;
    let vocab_size = u32::try_from(tokens.len())
        .map_err(|_| anyhow!("{src}: {} tokens do not fit u32 ids", tokens.len()))?;
    let mut vocab = Vocab::with_capacity(tokens.len());
    for (id, token) in (0..vocab_size).zip(tokens) {
        // The BPE model maps each string to one id; a repeated token (some converters pad the
        // vocabulary with copies) keeps its first id, the others stay decodable only by id.
        vocab.entry(token.clone()).or_insert(id);
    }
    let merges = m
        .req_string_array("tokenizer.ggml.merges")?
        .iter()
        .enumerate()
        .map(|(i, merge)| {
            merge
                .split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| {
                    anyhow!(
                        "{src}: tokenizer.ggml.merges[{i}] = {merge:?} is not two tokens \
                         separated by a space"
                    )
                })
        })
        .collect::<Result<Vec<_>>>()?;
    let specials = control_tokens(file, tokens)?;
    let inner = catch_panic(|| {
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            // Llama 3's tokenizer.json sets this: a pre-token found whole in the vocabulary is
            // emitted as is, even when merges would split it differently.
            .ignore_merges(pre == "llama-bpe")
            .build()
            .map_err(|e| anyhow!("{src}: cannot build the BPE tokenizer: {e}"))?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        inner
            .with_pre_tokenizer(Some(pre_tokenizer))
            .with_decoder(Some(ByteLevelDecoder::default()));
        inner.add_special_tokens(&specials);
        Ok::<_, anyhow::Error>(inner)
    })
    .map_err(|p| {
        anyhow!("{src}: the tokenizer crashed while being built from the metadata ({p})")
    })??;

    let (bos_token_id, eos_token_ids) = gguf::special_token_ids(file, tokens.len())?;
    Ok(Some(Tokenizer {
        inner,
        source: src.to_string(),
        bos_token_id,
        eos_token_ids,
        add_bos: m.opt_bool("tokenizer.ggml.add_bos_token")?.unwrap_or(false),
        chat_template: m.opt_str("tokenizer.chat_template")?.map(str::to_string),
    }))
}

/// Control tokens become special added tokens, so their text in a prompt maps to their id
/// instead of being split by BPE, and decoding can skip them.
fn control_tokens(file: &GgufFile, tokens: &[String]) -> Result<Vec<AddedToken>> {
    let key = "tokenizer.ggml.token_type";
    let Some(types) = file.metadata().opt_int_array(key)? else {
        return Ok(Vec::new());
    };
    if types.len() != tokens.len() {
        bail!(
            "{}: metadata key '{key}' has {} entries for {} tokens",
            file.source(),
            types.len(),
            tokens.len()
        );
    }
    tokens
        .iter()
        .zip(types)
        .enumerate()
        .filter(|&(_, (_, ty))| ty == TOKEN_TYPE_CONTROL)
        .map(|(id, (t, _))| {
            check_special_token_len(file.source(), &format!("control token {id}"), t)?;
            Ok(AddedToken::from(t.clone(), true))
        })
        .collect()
}

/// Qwen2's (and Qwen2.5's, Qwen3's): Llama 3's with every digit on its own (`\p{N}` where
/// Llama 3 has `\p{N}{1,3}`).
fn qwen2_pattern() -> String {
    LLAMA3_PATTERN.replace(r"|\p{N}{1,3}", r"|\p{N}")
}

/// A regex split (matches kept as pre-tokens) followed by byte-level mapping without its own
/// regex: how Llama 3's and Qwen2's `tokenizer.json` pre-tokenize.
fn regex_then_bytes(pattern: String, name: &str) -> Result<PreTokenizerWrapper> {
    let split = Split::new(
        SplitPattern::Regex(pattern),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map_err(|e| anyhow!("cannot compile the {name} pre-tokenizer regex: {e}"))?;
    Ok(Sequence::new(vec![
        split.into(),
        ByteLevel::new(false, true, false).into(),
    ])
    .into())
}

/// The pre-tokenizer `tokenizer.ggml.pre` names.
fn pre_tokenizer(pre: &str) -> Result<PreTokenizerWrapper> {
    let gpt2 = ByteLevel::new(false, true, true);
    Ok(match pre {
        "gpt2" | "default" => gpt2.into(),
        "smollm" => Sequence::new(vec![Digits::new(true).into(), gpt2.into()]).into(),
        "llama-bpe" => regex_then_bytes(LLAMA3_PATTERN.to_string(), "Llama 3")?,
        "qwen2" => regex_then_bytes(qwen2_pattern(), "Qwen2")?,
        other => bail!(
            "tokenizer.ggml.pre '{other}' is not supported (supported: smollm, llama-bpe, qwen2, \
             gpt2, default)"
        ),
    })
}

#[cfg(test)]
mod pattern_tests {
    /// The pattern Qwen2's `tokenizer.json` gives its Split pre-tokenizer, written out.
    #[test]
    fn qwen2_pattern_is_qwen2s_tokenizer_json_regex() {
        assert_eq!(
            super::qwen2_pattern(),
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
        );
    }
}

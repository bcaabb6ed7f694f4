//! `tokenizer.json` plus what `tokenizer_config.json` (or `chat_template.jinja`) says about
//! BOS, EOS and the chat template.

use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;

use crate::model::Config;
use crate::tokenizer::{catch_panic, check_special_token_len, Tokenizer};

/// `None` when the directory holds no `tokenizer.json` (weight-only checkpoints).
pub(super) fn load_tokenizer(dir: &Path, cfg: &Config) -> Result<Option<Tokenizer>> {
    let path = dir.join("tokenizer.json");
    if !path.is_file() {
        return Ok(None);
    }
    let source = path.display().to_string();
    let text = std::fs::read_to_string(&path).with_context(|| format!("{source}: cannot read"))?;
    check_added_tokens(&text, &source)?;
    let settings = TokenizerConfig::read(dir)?;
    // The tokenizers crate panics on some malformed files (while parsing, or only when the
    // tokenizer is first used): everything it does here runs under `catch_panic`.
    catch_panic(|| build(&text, &source, &settings, cfg)).map_err(|p| {
        anyhow!("{source}: the tokenizer crashed while loading ({p}); the file is malformed")
    })?
}

/// Parses `tokenizer.json` and reads the special-token settings.
fn build(
    text: &str,
    source: &str,
    settings: &TokenizerConfig,
    cfg: &Config,
) -> Result<Option<Tokenizer>> {
    let inner: tokenizers::Tokenizer = text
        .parse()
        .map_err(|e| anyhow!("{source}: cannot load tokenizer: {e}"))?;

    // tokenizer_config.json names the tokens the tokenizer itself adds, so its ids win over
    // config.json's; a name missing from the vocabulary falls back to config.json.
    let bos_token_id = settings
        .token("bos_token")
        .and_then(|t| inner.token_to_id(t))
        .or(cfg.bos_token_id);
    let mut eos_token_ids = cfg.eos_token_ids.clone();
    if let Some(id) = settings
        .token("eos_token")
        .and_then(|t| inner.token_to_id(t))
    {
        if !eos_token_ids.contains(&id) {
            eos_token_ids.push(id);
        }
    }
    let add_bos = match settings.add_bos_token()? {
        Some(flag) => flag,
        None => post_processor_adds(&inner, bos_token_id, source)?,
    };
    let chat_template = match settings.chat_template()? {
        Some(t) => Some(t),
        None => chat_template_file(&settings.dir)?,
    };

    let largest = inner
        .get_vocab(true)
        .into_values()
        .chain(bos_token_id)
        .chain(eos_token_ids.iter().copied())
        .max();
    if let Some(id) = largest.filter(|&id| id as usize >= cfg.vocab_size) {
        bail!(
            "{source}: token id {id} is outside the model's vocabulary of {} (config.json \
             vocab_size)",
            cfg.vocab_size
        );
    }
    probe_decoder(&inner);
    Ok(Some(Tokenizer {
        inner,
        source: source.to_string(),
        bos_token_id,
        eos_token_ids,
        add_bos,
        chat_template,
    }))
}

/// Whether encoding with special tokens starts with BOS where encoding without does not:
/// Llama 3's tokenizer.json adds BOS in its post-processor and has no add_bos_token flag.
fn post_processor_adds(
    inner: &tokenizers::Tokenizer,
    bos: Option<u32>,
    source: &str,
) -> Result<bool> {
    let Some(bos) = bos else { return Ok(false) };
    let first = |special: bool| -> Result<Option<u32>> {
        let enc = inner
            .encode("a", special)
            .map_err(|e| anyhow!("{source}: cannot encode a probe string: {e}"))?;
        Ok(enc.get_ids().first().copied())
    };
    Ok(first(true)? == Some(bos) && first(false)? != Some(bos))
}

/// Added tokens longer than `MAX_SPECIAL_TOKEN_BYTES` are refused before the tokenizers crate
/// sees them (it takes time quadratic in their length).
fn check_added_tokens(text: &str, source: &str) -> Result<()> {
    let root: Value =
        serde_json::from_str(text).with_context(|| format!("{source}: not valid JSON"))?;
    let Some(added) = root.get("added_tokens").and_then(Value::as_array) else {
        return Ok(());
    };
    for (i, t) in added.iter().enumerate() {
        if let Some(content) = t.get("content").and_then(Value::as_str) {
            check_special_token_len(source, &format!("added_tokens[{i}]"), content)?;
        }
    }
    Ok(())
}

/// Decodes one token, then the first 256 together, as generation will: some decoder chains
/// that load fine panic on their first use, which should happen now (under the guard) rather
/// than after the prompt has been processed.
fn probe_decoder(inner: &tokenizers::Tokenizer) {
    let n = inner.get_vocab_size(true).min(u32::MAX as usize) as u32;
    for ids in [vec![0], (0..n.min(256)).collect::<Vec<u32>>()] {
        if n == 0 {
            break;
        }
        // A decode *error* for some id sequence is legitimate (e.g. a byte fallback that is
        // not valid UTF-8 on its own); only a panic, caught by the caller, is fatal.
        let _ = inner.decode(&ids, true);
    }
}

struct TokenizerConfig {
    /// `None` when the file does not exist.
    json: Option<Value>,
    source: String,
    dir: std::path::PathBuf,
}

impl TokenizerConfig {
    fn read(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer_config.json");
        let source = path.display().to_string();
        if !path.is_file() {
            return Ok(Self {
                json: None,
                source,
                dir: dir.to_path_buf(),
            });
        }
        let text =
            std::fs::read_to_string(&path).with_context(|| format!("{source}: cannot read"))?;
        let json =
            serde_json::from_str(&text).with_context(|| format!("{source}: not valid JSON"))?;
        Ok(Self {
            json: Some(json),
            source,
            dir: dir.to_path_buf(),
        })
    }

    fn get(&self, key: &str) -> Option<&Value> {
        self.json.as_ref()?.get(key).filter(|v| !v.is_null())
    }

    /// A special token is a string, or (older files) an AddedToken object with `content`.
    fn token(&self, key: &str) -> Option<&str> {
        let v = self.get(key)?;
        v.as_str()
            .or_else(|| v.get("content").and_then(Value::as_str))
    }

    fn add_bos_token(&self) -> Result<Option<bool>> {
        self.get("add_bos_token")
            .map(|v| {
                v.as_bool()
                    .ok_or_else(|| anyhow!("{}: add_bos_token must be true or false", self.source))
            })
            .transpose()
    }

    /// A string, or a list of `{name, template}` of which the one named `default` is the chat
    /// template (the others are for tool use or RAG, which we do not render).
    fn chat_template(&self) -> Result<Option<String>> {
        match self.get("chat_template") {
            None => Ok(None),
            Some(Value::String(t)) => Ok(Some(t.clone())),
            Some(Value::Array(named)) => Ok(named
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .and_then(|t| t.get("template"))
                .and_then(Value::as_str)
                .map(str::to_string)),
            Some(_) => bail!(
                "{}: chat_template must be a string or a list of {{name, template}}",
                self.source
            ),
        }
    }
}

/// Newer transformers save the template beside tokenizer_config.json instead of inside it.
fn chat_template_file(dir: &Path) -> Result<Option<String>> {
    let jinja = dir.join("chat_template.jinja");
    if jinja.is_file() {
        let text = std::fs::read_to_string(&jinja)
            .with_context(|| format!("{}: cannot read", jinja.display()))?;
        return Ok(Some(text));
    }
    let json = dir.join("chat_template.json");
    if json.is_file() {
        let shown = json.display();
        let text =
            std::fs::read_to_string(&json).with_context(|| format!("{shown}: cannot read"))?;
        let v: Value =
            serde_json::from_str(&text).with_context(|| format!("{shown}: not valid JSON"))?;
        let t = v
            .get("chat_template")
            .and_then(Value::as_str)
            .ok_or_else(|| anyhow!("{shown}: no chat_template string"))?;
        return Ok(Some(t.to_string()));
    }
    Ok(None)
}

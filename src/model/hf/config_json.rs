//! `config.json` (and the eos ids of `generation_config.json`) of an HF Llama checkpoint.

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{Map, Value};

use crate::model::{Config, Llama3RopeScaling};

/// `(architectures entry, model_type)` of every supported family.
const SUPPORTED: &[(&str, &str)] = &[
    ("LlamaForCausalLM", "llama"),
    ("Qwen2ForCausalLM", "qwen2"),
    ("Qwen3ForCausalLM", "qwen3"),
];

fn supported_list() -> String {
    SUPPORTED
        .iter()
        .map(|(a, _)| *a)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Parses an HF `config.json`; `source` names the file in error messages.
pub fn parse_config(json: &str, source: &str) -> Result<Config> {
    let root: Value =
        serde_json::from_str(json).with_context(|| format!("{source}: not valid JSON"))?;
    let f = Fields::new(&root, source)?;
    let architecture = f.architecture()?;
    let qwen2 = architecture == "Qwen2ForCausalLM";
    let qwen3 = architecture == "Qwen3ForCausalLM";
    // Qwen2 always has q/k/v biases (its config has no switch); Qwen3 has them only when
    // `attention_bias` says so, as Llama.
    let qkv_bias = qwen2 || (qwen3 && f.opt_bool("attention_bias")?.unwrap_or(false));
    f.reject_unsupported_layers(qwen3)?;

    let hidden_size = f.req_usize("hidden_size")?;
    let num_heads = f.req_usize("num_attention_heads")?;
    let head_dim = match f.opt_usize("head_dim")? {
        Some(d) => d,
        None => {
            if num_heads == 0 || hidden_size % num_heads != 0 {
                bail!(
                    "{source}: no head_dim, and hidden_size ({hidden_size}) is not a multiple of \
                     num_attention_heads ({num_heads})"
                );
            }
            hidden_size / num_heads
        }
    };
    let (rope_theta, rope_scaling) = f.rope()?;
    let config = Config {
        architecture,
        hidden_size,
        intermediate_size: f.req_usize("intermediate_size")?,
        num_layers: f.req_usize("num_hidden_layers")?,
        num_heads,
        // Absent or null means plain multi-head attention, as in HF's LlamaConfig.
        num_kv_heads: f.opt_usize("num_key_value_heads")?.unwrap_or(num_heads),
        head_dim,
        vocab_size: f.req_usize("vocab_size")?,
        rope_theta,
        rope_scaling,
        rope_freq_divisors: None,
        // The remaining defaults are HF LlamaConfig's, so a terse config means what it means there.
        rms_norm_eps: f.opt_f64("rms_norm_eps")?.unwrap_or(1e-6) as f32,
        tie_word_embeddings: f.opt_bool("tie_word_embeddings")?.unwrap_or(false),
        max_position_embeddings: f.opt_usize("max_position_embeddings")?.unwrap_or(2048),
        bos_token_id: f.opt_token_id("bos_token_id")?,
        eos_token_ids: f.token_ids("eos_token_id")?,
        qk_norm: qwen3,
        qkv_bias,
    };
    config.validate().with_context(|| source.to_string())?;
    Ok(config)
}

/// Adds the eos ids of `generation_config.json`: HF generation stops on those, and instruct
/// models list their end-of-turn token there even when `config.json` names only one eos.
pub(super) fn add_generation_eos(config: &mut Config, json: &str, source: &str) -> Result<()> {
    let root: Value =
        serde_json::from_str(json).with_context(|| format!("{source}: not valid JSON"))?;
    for id in Fields::new(&root, source)?.token_ids("eos_token_id")? {
        if !config.eos_token_ids.contains(&id) {
            config.eos_token_ids.push(id);
        }
    }
    Ok(())
}

/// Typed access to the fields of one JSON object, with errors that name the file and field.
/// JSON `null` counts as absent, as it does for HF.
struct Fields<'a> {
    obj: &'a Map<String, Value>,
    /// Dotted prefix of nested objects (e.g. `rope_scaling.`), for messages.
    prefix: String,
    source: &'a str,
}

impl<'a> Fields<'a> {
    fn new(root: &'a Value, source: &'a str) -> Result<Self> {
        let obj = root
            .as_object()
            .ok_or_else(|| anyhow!("{source}: expected a JSON object at the top level"))?;
        Ok(Self {
            obj,
            prefix: String::new(),
            source,
        })
    }

    fn nested(&self, key: &str) -> Result<Option<Fields<'a>>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Object(obj)) => Ok(Some(Fields {
                obj,
                prefix: format!("{}{key}.", self.prefix),
                source: self.source,
            })),
            Some(_) => Err(self.type_error(key, "an object")),
        }
    }

    fn get(&self, key: &str) -> Option<&'a Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    fn type_error(&self, key: &str, expected: &str) -> anyhow::Error {
        anyhow!(
            "{}: field {}{key} must be {expected}, found {}",
            self.source,
            self.prefix,
            self.obj[key]
        )
    }

    fn missing(&self, key: &str) -> anyhow::Error {
        anyhow!(
            "{}: required field {}{key} is missing",
            self.source,
            self.prefix
        )
    }

    fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        self.get(key)
            .map(|v| {
                v.as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| self.type_error(key, "a non-negative integer"))
            })
            .transpose()
    }

    fn req_usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?.ok_or_else(|| self.missing(key))
    }

    fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        self.get(key)
            .map(|v| v.as_f64().ok_or_else(|| self.type_error(key, "a number")))
            .transpose()
    }

    fn req_f64(&self, key: &str) -> Result<f64> {
        self.opt_f64(key)?.ok_or_else(|| self.missing(key))
    }

    fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        self.get(key)
            .map(|v| {
                v.as_bool()
                    .ok_or_else(|| self.type_error(key, "true or false"))
            })
            .transpose()
    }

    fn opt_str(&self, key: &str) -> Result<Option<&'a str>> {
        self.get(key)
            .map(|v| v.as_str().ok_or_else(|| self.type_error(key, "a string")))
            .transpose()
    }

    fn token_id(&self, key: &str, v: &Value) -> Result<u32> {
        v.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| self.type_error(key, "a token id or a list of token ids"))
    }

    fn opt_token_id(&self, key: &str) -> Result<Option<u32>> {
        self.get(key).map(|v| self.token_id(key, v)).transpose()
    }

    /// A single id or a list of ids (Llama 3.1+ instruct models list several eos ids).
    fn token_ids(&self, key: &str) -> Result<Vec<u32>> {
        match self.get(key) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => items.iter().map(|v| self.token_id(key, v)).collect(),
            Some(v) => Ok(vec![self.token_id(key, v)?]),
        }
    }

    fn architecture(&self) -> Result<String> {
        let source = self.source;
        let archs: Vec<&str> = match self.get("architectures") {
            None => Vec::new(),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_str()
                        .ok_or_else(|| self.type_error("architectures", "a list of strings"))
                })
                .collect::<Result<_>>()?,
            Some(_) => return Err(self.type_error("architectures", "a list of strings")),
        };
        let mut family = None;
        for a in &archs {
            match SUPPORTED.iter().find(|(name, _)| name == a) {
                None => bail!(
                    "{source}: architecture {a} is not supported (megainfer runs {})",
                    supported_list()
                ),
                Some(f) if family.is_some_and(|g| g != f) => {
                    bail!("{source}: architectures lists two different families")
                }
                Some(f) => family = Some(f),
            }
        }
        match (self.opt_str("model_type")?, family) {
            (Some(t), Some((arch, mt))) if t != *mt => bail!(
                "{source}: model_type {t} does not match architecture {arch} (model_type {mt})"
            ),
            (Some(t), None) => match SUPPORTED.iter().find(|(_, mt)| *mt == t) {
                Some((arch, _)) => Ok(arch.to_string()),
                None => bail!(
                    "{source}: model_type {t} is not supported (megainfer runs {})",
                    supported_list()
                ),
            },
            (_, Some((arch, _))) => Ok(arch.to_string()),
            (None, None) => bail!(
                "{source}: neither architectures nor model_type is given, so the model type is \
                 unknown"
            ),
        }
    }

    /// Llama variants whose weights would load but whose forward pass differs from ours.
    /// `attention_bias` is Qwen3's switch for q/k/v biases, read by the caller; elsewhere
    /// (Llama) a bias is refused.
    fn reject_unsupported_layers(&self, qwen3: bool) -> Result<()> {
        let source = self.source;
        if let Some(act) = self.opt_str("hidden_act")? {
            if act != "silu" {
                bail!("{source}: hidden_act {act} is not supported (only silu)");
            }
        }
        for key in ["attention_bias", "mlp_bias"] {
            if key == "attention_bias" && qwen3 {
                continue;
            }
            if self.opt_bool(key)? == Some(true) {
                bail!("{source}: {key} = true is not supported (projections without bias only)");
            }
        }
        // Qwen2/Qwen3 configs carry this switch (false in the released models); sliding-window
        // attention would change which positions each layer attends to.
        if self.opt_bool("use_sliding_window")? == Some(true) {
            bail!("{source}: use_sliding_window = true is not supported (full attention only)");
        }
        Ok(())
    }

    /// `rope_theta` and `rope_scaling` (transformers 4.x), or `rope_parameters` holding both
    /// (transformers 5).
    fn rope(&self) -> Result<(f32, Option<Llama3RopeScaling>)> {
        let params = self.nested("rope_parameters")?;
        let theta = match params
            .as_ref()
            .map(|p| p.opt_f64("rope_theta"))
            .transpose()?
        {
            Some(Some(t)) => t,
            _ => self.opt_f64("rope_theta")?.unwrap_or(10000.0),
        };
        let scaling = match params {
            Some(p) => Some(p),
            None => self.nested("rope_scaling")?,
        };
        let scaling = match scaling {
            None => None,
            Some(s) => s.llama3_scaling()?,
        };
        Ok((theta as f32, scaling))
    }

    fn llama3_scaling(&self) -> Result<Option<Llama3RopeScaling>> {
        let source = self.source;
        // Older configs spell the key `type`.
        let kind = match self.opt_str("rope_type")? {
            Some(k) => Some(k),
            None => self.opt_str("type")?,
        };
        match kind {
            Some("default") => return Ok(None),
            // `rope_parameters` always exists in transformers 5 configs, scaled or not.
            None if self.prefix == "rope_parameters." => return Ok(None),
            Some("llama3") => {}
            None => bail!("{source}: {}rope_type is missing", self.prefix),
            Some(other) => bail!(
                "{source}: {}rope_type {other} is not supported (only llama3 scaling)",
                self.prefix
            ),
        }
        let s = Llama3RopeScaling {
            factor: self.req_f64("factor")? as f32,
            low_freq_factor: self.req_f64("low_freq_factor")? as f32,
            high_freq_factor: self.req_f64("high_freq_factor")? as f32,
            original_max_position_embeddings: self.req_usize("original_max_position_embeddings")?,
        };
        // The interpolation between the two wavelength bounds divides by their difference.
        if !(s.factor > 0.0 && s.low_freq_factor > 0.0 && s.high_freq_factor > s.low_freq_factor)
            || s.original_max_position_embeddings == 0
        {
            bail!(
                "{source}: {}llama3 scaling needs factor > 0, 0 < low_freq_factor < \
                 high_freq_factor and original_max_position_embeddings > 0 (got {s:?})",
                self.prefix
            );
        }
        Ok(Some(s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen(extra: &str) -> Result<Config> {
        let json = format!(
            r#"{{"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
                "rope_theta": 1000000.0, "rope_scaling": null {extra}}}"#
        );
        parse_config(&json, "config.json")
    }

    #[test]
    fn qwen_families_and_their_features() {
        let c = qwen(r#", "architectures": ["Qwen3ForCausalLM"], "head_dim": 32"#).unwrap();
        assert_eq!(c.architecture, "Qwen3ForCausalLM");
        assert!(c.qk_norm && !c.qkv_bias);
        assert_eq!((c.head_dim, c.rope_theta), (32, 1e6));
        let c = qwen(r#", "model_type": "qwen3", "attention_bias": true"#).unwrap();
        assert!(c.qk_norm && c.qkv_bias);
        let c = qwen(r#", "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2""#).unwrap();
        assert!(c.qkv_bias && !c.qk_norm);
        assert_eq!(c.head_dim, 16);
        let c = qwen(r#", "model_type": "llama""#).unwrap();
        assert!(!c.qkv_bias && !c.qk_norm);
    }

    #[test]
    fn qwen_mismatches_are_refused() {
        let e = qwen(r#", "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen2""#)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("model_type qwen2 does not match architecture Qwen3ForCausalLM"),
            "{e}"
        );
        let e = qwen(r#", "architectures": ["Qwen2ForCausalLM", "LlamaForCausalLM"]"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("two different families"), "{e}");
        let e = qwen(r#", "model_type": "qwen2", "use_sliding_window": true"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("use_sliding_window"), "{e}");
        // Llama has no bias switch of its own that we run.
        let e = qwen(r#", "model_type": "llama", "attention_bias": true"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("attention_bias"), "{e}");
    }
}

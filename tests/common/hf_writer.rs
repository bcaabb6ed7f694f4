//! Writes HF-format model directories for the loader tests: `config.json` from a [`Config`],
//! safetensors files (single or sharded, BF16/F16/F32 or any other dtype) from [`Weights`],
//! and a small word-level `tokenizer.json`.

// Each test crate that includes this file uses a different subset of it.
#![allow(dead_code)]

use std::path::Path;

use half::{bf16, f16};
use megainfer::model::{Config, Llama3RopeScaling, Weights};
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::{json, Value};

/// A 2-layer GQA model small enough to write, load and run in milliseconds.
pub fn tiny_config(tied: bool) -> Config {
    Config {
        architecture: "LlamaForCausalLM".into(),
        hidden_size: 64,
        intermediate_size: 96,
        num_layers: 2,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 16,
        vocab_size: 32,
        rope_theta: 10000.0,
        rope_scaling: Some(Llama3RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 64,
        }),
        rope_freq_divisors: None,
        rms_norm_eps: 1e-5,
        tie_word_embeddings: tied,
        max_position_embeddings: 256,
        bos_token_id: Some(1),
        eos_token_ids: vec![2],
        qk_norm: false,
        qkv_bias: false,
    }
}

/// The `config.json` transformers would write for `cfg`.
pub fn config_json(cfg: &Config) -> Value {
    let rope_scaling = match &cfg.rope_scaling {
        None => Value::Null,
        Some(s) => json!({
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
            "rope_type": "llama3",
        }),
    };
    json!({
        "architectures": [cfg.architecture],
        "model_type": "llama",
        "attention_bias": false,
        "hidden_act": "silu",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_scaling,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_ids,
        "torch_dtype": "bfloat16",
    })
}

/// One tensor as it goes into a safetensors file.
#[derive(Clone)]
pub struct Tensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: Dtype,
    pub data: Vec<u8>,
}

impl Tensor {
    pub fn new(name: &str, shape: Vec<usize>, dtype: Dtype, data: Vec<u8>) -> Self {
        Self {
            name: name.to_string(),
            shape,
            dtype,
            data,
        }
    }
}

/// Little-endian bytes of `values` stored as `dtype` (BF16, F16 or F32).
pub fn encode(values: &[bf16], dtype: Dtype) -> Vec<u8> {
    match dtype {
        Dtype::BF16 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        Dtype::F16 => values
            .iter()
            .flat_map(|v| f16::from_f32(v.to_f32()).to_le_bytes())
            .collect(),
        Dtype::F32 => values
            .iter()
            .flat_map(|v| v.to_f32().to_le_bytes())
            .collect(),
        other => panic!("encode: no float conversion to {other}"),
    }
}

/// What a loader should produce from `values` stored as `dtype`: F16 rounds bf16 values too
/// small for its exponent range, BF16 and F32 are exact.
pub fn expected_after(values: &[bf16], dtype: Dtype) -> Vec<bf16> {
    match dtype {
        Dtype::F16 => values
            .iter()
            .map(|v| bf16::from_f32(f16::from_f32(v.to_f32()).to_f32()))
            .collect(),
        _ => values.to_vec(),
    }
}

/// Every weight under its HF name and shape, in `dtype`.
pub fn hf_tensors(cfg: &Config, w: &Weights, dtype: Dtype) -> Vec<Tensor> {
    let (h, q, kv, ff) = (
        cfg.hidden_size,
        cfg.q_dim(),
        cfg.kv_dim(),
        cfg.intermediate_size,
    );
    let t = |name: String, shape: Vec<usize>, v: &[bf16]| Tensor {
        name,
        shape,
        dtype,
        data: encode(v, dtype),
    };
    let mut out = vec![t(
        "model.embed_tokens.weight".into(),
        vec![cfg.vocab_size, h],
        w.embed.as_bf16().expect("bf16 weights"),
    )];
    for (i, l) in w.layers.iter().enumerate() {
        let p = format!("model.layers.{i}");
        out.extend([
            t(format!("{p}.input_layernorm.weight"), vec![h], &l.attn_norm),
            t(
                format!("{p}.self_attn.q_proj.weight"),
                vec![q, h],
                l.wq.as_bf16().expect("bf16 weights"),
            ),
            t(
                format!("{p}.self_attn.k_proj.weight"),
                vec![kv, h],
                l.wk.as_bf16().expect("bf16 weights"),
            ),
            t(
                format!("{p}.self_attn.v_proj.weight"),
                vec![kv, h],
                l.wv.as_bf16().expect("bf16 weights"),
            ),
            t(
                format!("{p}.self_attn.o_proj.weight"),
                vec![h, q],
                l.wo.as_bf16().expect("bf16 weights"),
            ),
            t(
                format!("{p}.post_attention_layernorm.weight"),
                vec![h],
                &l.ffn_norm,
            ),
            t(
                format!("{p}.mlp.gate_proj.weight"),
                vec![ff, h],
                l.w_gate.as_bf16().expect("bf16 weights"),
            ),
            t(
                format!("{p}.mlp.up_proj.weight"),
                vec![ff, h],
                l.w_up.as_bf16().expect("bf16 weights"),
            ),
            t(
                format!("{p}.mlp.down_proj.weight"),
                vec![h, ff],
                l.w_down.as_bf16().expect("bf16 weights"),
            ),
        ]);
    }
    out.push(t("model.norm.weight".into(), vec![h], &w.final_norm));
    if let Some(head) = &w.lm_head {
        out.push(t(
            "lm_head.weight".into(),
            vec![cfg.vocab_size, h],
            head.as_bf16().expect("bf16 weights"),
        ));
    }
    out
}

/// The bytes of a safetensors file holding `tensors`.
pub fn safetensors_bytes(tensors: &[Tensor]) -> Vec<u8> {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|t| {
            let view = TensorView::new(t.dtype, t.shape.clone(), &t.data)
                .unwrap_or_else(|e| panic!("tensor {}: {e}", t.name));
            (t.name.clone(), view)
        })
        .collect();
    safetensors::serialize(views, None).expect("serialize safetensors")
}

pub fn write_safetensors(path: &Path, tensors: &[Tensor]) {
    std::fs::write(path, safetensors_bytes(tensors))
        .unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
}

/// HF's shard file name.
pub fn shard_name(i: usize, n: usize) -> String {
    format!("model-{:05}-of-{:05}.safetensors", i + 1, n)
}

/// Splits `tensors` round-robin into `n` shards plus `model.safetensors.index.json`.
pub fn write_sharded(dir: &Path, tensors: &[Tensor], n: usize) {
    let mut weight_map = serde_json::Map::new();
    let mut total = 0;
    for i in 0..n {
        let part: Vec<Tensor> = tensors.iter().skip(i).step_by(n).cloned().collect();
        for t in &part {
            weight_map.insert(t.name.clone(), json!(shard_name(i, n)));
            total += t.data.len();
        }
        write_safetensors(&dir.join(shard_name(i, n)), &part);
    }
    write_json(
        &dir.join("model.safetensors.index.json"),
        &json!({"metadata": {"total_size": total}, "weight_map": weight_map}),
    );
}

pub fn write_json(path: &Path, value: &Value) {
    let text = serde_json::to_string_pretty(value).expect("serialize JSON");
    std::fs::write(path, text).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
}

/// `config.json` plus a single `model.safetensors` in `dtype`.
pub fn write_model(dir: &Path, cfg: &Config, w: &Weights, dtype: Dtype) {
    write_json(&dir.join("config.json"), &config_json(cfg));
    write_safetensors(&dir.join("model.safetensors"), &hf_tensors(cfg, w, dtype));
}

/// Special tokens of [`tokenizer_json`], with their ids.
/// A model directory for `megainfer run` tests: `cfg` with random weights from `seed`, a
/// tokenizer in which every id of the vocabulary is a word (so any generated id decodes), and a
/// `tokenizer_config.json` naming `<s>` and `</s>`.
pub fn write_word_model_dir(dir: &Path, cfg: &Config, seed: u64) {
    write_model(
        dir,
        cfg,
        &megainfer::model::random::random_weights(cfg, seed),
        Dtype::BF16,
    );
    let mut words = vec!["hello".to_string(), "world".to_string()];
    words.extend((5..cfg.vocab_size).map(|i| format!("w{i}")));
    let words: Vec<&str> = words.iter().map(String::as_str).collect();
    write_json(&dir.join("tokenizer.json"), &tokenizer_json(&words, true));
    write_json(
        &dir.join("tokenizer_config.json"),
        &json!({"bos_token": "<s>", "eos_token": EOS.0}),
    );
}

pub const UNK: (&str, u32) = ("<unk>", 0);
pub const BOS: (&str, u32) = ("<s>", 1);
pub const EOS: (&str, u32) = ("</s>", 2);

/// A word-level tokenizer.json: the three specials, then `words` from id 3 on, split on
/// whitespace. With `bos_post_processor` its post-processor prepends `<s>`, as Llama 3's does.
pub fn tokenizer_json(words: &[&str], bos_post_processor: bool) -> Value {
    let specials = [UNK, BOS, EOS];
    let mut vocab = serde_json::Map::new();
    for (token, id) in specials {
        vocab.insert(token.into(), json!(id));
    }
    for (i, word) in words.iter().enumerate() {
        vocab.insert((*word).into(), json!(3 + i));
    }
    let added: Vec<Value> = specials
        .iter()
        .map(|(content, id)| {
            json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let post_processor = if bos_post_processor {
        json!({
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": BOS.0, "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": BOS.0, "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {BOS.0: {"id": BOS.0, "ids": [BOS.1], "tokens": [BOS.0]}}
        })
    } else {
        Value::Null
    };
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": post_processor,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": UNK.0}
    })
}

//! Broken HF checkpoints: each must give an error naming the file and the tensor or field at
//! fault, never a panic or a huge allocation.

#[path = "common/hf_writer.rs"]
mod hf_writer;

use std::path::Path;

use hf_writer::*;
use megainfer::model::hf::{self, parse_config};
use megainfer::model::random::random_weights;
use megainfer::model::Config;
use safetensors::Dtype;
use serde_json::json;

/// A tiny untied model's config.json and tensors, for a test to break before writing.
fn parts() -> (Config, Vec<Tensor>) {
    let cfg = tiny_config(false);
    let tensors = hf_tensors(&cfg, &random_weights(&cfg, 11), Dtype::BF16);
    (cfg, tensors)
}

fn load_err(dir: &Path) -> String {
    match hf::load(dir) {
        Ok(_) => panic!("{} loaded, but it is broken", dir.display()),
        Err(e) => format!("{e:#}"),
    }
}

/// Writes `tensors` as model.safetensors beside a valid config.json; returns the error.
fn single_file_err(cfg: &Config, tensors: &[Tensor]) -> String {
    let dir = tempfile::tempdir().unwrap();
    write_json(&dir.path().join("config.json"), &config_json(cfg));
    write_safetensors(&dir.path().join("model.safetensors"), tensors);
    load_err(dir.path())
}

fn assert_mentions(err: &str, parts: &[&str]) {
    for p in parts {
        assert!(err.contains(p), "error does not mention {p:?}:\n{err}");
    }
}

#[test]
fn missing_tensor() {
    let (cfg, mut tensors) = parts();
    tensors.retain(|t| t.name != "model.layers.1.mlp.up_proj.weight");
    let err = single_file_err(&cfg, &tensors);
    assert_mentions(
        &err,
        &[
            "model.safetensors",
            "model.layers.1.mlp.up_proj.weight",
            "missing",
        ],
    );
}

#[test]
fn untied_model_without_lm_head() {
    let (cfg, mut tensors) = parts();
    tensors.retain(|t| t.name != "lm_head.weight");
    let err = single_file_err(&cfg, &tensors);
    assert_mentions(&err, &["model.safetensors", "lm_head.weight", "missing"]);
}

#[test]
fn extra_tensor() {
    let (cfg, mut tensors) = parts();
    tensors.push(Tensor::new(
        "model.layers.0.self_attn.q_proj.bias",
        vec![cfg.q_dim()],
        Dtype::BF16,
        vec![0; 2 * cfg.q_dim()],
    ));
    let err = single_file_err(&cfg, &tensors);
    assert_mentions(
        &err,
        &[
            "model.safetensors",
            "model.layers.0.self_attn.q_proj.bias",
            "unexpected",
        ],
    );
}

#[test]
fn extra_layer_beyond_the_config() {
    let (cfg, tensors) = parts();
    let mut deeper = cfg.clone();
    deeper.num_layers = 3;
    let extra = hf_tensors(&deeper, &random_weights(&deeper, 1), Dtype::BF16);
    let mut all = tensors;
    all.extend(
        extra
            .into_iter()
            .filter(|t| t.name.starts_with("model.layers.2.")),
    );
    let err = single_file_err(&cfg, &all);
    assert_mentions(
        &err,
        &["model.layers.2.input_layernorm.weight", "9 problems"],
    );
}

#[test]
fn wrong_shape() {
    let (cfg, mut tensors) = parts();
    let t = tensors
        .iter_mut()
        .find(|t| t.name == "model.layers.0.self_attn.k_proj.weight")
        .unwrap();
    // Same bytes, rows and columns swapped: only the shape can tell.
    t.shape = vec![cfg.hidden_size, cfg.kv_dim()];
    let err = single_file_err(&cfg, &tensors);
    assert_mentions(
        &err,
        &[
            "model.safetensors",
            "model.layers.0.self_attn.k_proj.weight",
            "shape [64, 32], expected [32, 64]",
        ],
    );
}

#[test]
fn unsupported_dtype() {
    let (cfg, mut tensors) = parts();
    let t = tensors
        .iter_mut()
        .find(|t| t.name == "model.norm.weight")
        .unwrap();
    t.dtype = Dtype::I64;
    t.data = vec![0; 8 * cfg.hidden_size];
    let err = single_file_err(&cfg, &tensors);
    assert_mentions(
        &err,
        &["model.safetensors", "model.norm.weight", "dtype I64"],
    );
}

#[test]
fn truncated_file() {
    let (cfg, tensors) = parts();
    let dir = tempfile::tempdir().unwrap();
    write_json(&dir.path().join("config.json"), &config_json(&cfg));
    let bytes = safetensors_bytes(&tensors);
    let path = dir.path().join("model.safetensors");
    std::fs::write(&path, &bytes[..bytes.len() - 1000]).unwrap();
    let err = load_err(dir.path());
    // The last tensor in the data area is the one cut short.
    assert_mentions(&err, &["model.safetensors", "truncated", "tensor "]);

    // Cut inside the header, and inside the length prefix.
    for cut in [100, 5, 0] {
        std::fs::write(&path, &bytes[..cut]).unwrap();
        assert_mentions(&load_err(dir.path()), &["model.safetensors", "truncated"]);
    }
}

fn raw_file_err(header: &[u8], data: &[u8]) -> String {
    let (cfg, _) = parts();
    let dir = tempfile::tempdir().unwrap();
    write_json(&dir.path().join("config.json"), &config_json(&cfg));
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    bytes.extend_from_slice(data);
    std::fs::write(dir.path().join("model.safetensors"), bytes).unwrap();
    load_err(dir.path())
}

#[test]
fn garbage_header() {
    let err = raw_file_err(b"this is not JSON at all", &[0; 64]);
    assert_mentions(&err, &["model.safetensors", "not a valid safetensors"]);
}

#[test]
fn header_length_beyond_the_file() {
    let (cfg, _) = parts();
    let dir = tempfile::tempdir().unwrap();
    write_json(&dir.path().join("config.json"), &config_json(&cfg));
    let mut bytes = u64::MAX.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    std::fs::write(dir.path().join("model.safetensors"), bytes).unwrap();
    assert_mentions(&load_err(dir.path()), &["model.safetensors"]);
}

#[test]
fn hostile_shapes_and_offsets_do_not_allocate_or_panic() {
    // 2^40 x 2^40 elements: the element count overflows.
    let err = raw_file_err(
        br#"{"model.embed_tokens.weight":{"dtype":"BF16","shape":[1099511627776,1099511627776],"data_offsets":[0,8]}}"#,
        &[0; 8],
    );
    assert_mentions(&err, &["model.safetensors", "model.embed_tokens.weight"]);
    // A plausible shape whose data is not in the file.
    let err = raw_file_err(
        br#"{"model.embed_tokens.weight":{"dtype":"BF16","shape":[1000000,100000],"data_offsets":[0,200000000000]}}"#,
        &[0; 8],
    );
    assert_mentions(
        &err,
        &[
            "model.safetensors",
            "model.embed_tokens.weight",
            "truncated",
        ],
    );
    // Offsets that disagree with the shape.
    let err = raw_file_err(
        br#"{"model.norm.weight":{"dtype":"F32","shape":[64],"data_offsets":[0,8]}}"#,
        &[0; 8],
    );
    assert_mentions(
        &err,
        &["model.safetensors", "model.norm.weight", "data_offsets"],
    );
    // Two tensors sharing bytes.
    let err = raw_file_err(
        br#"{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},"b":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}}"#,
        &[0; 8],
    );
    assert_mentions(&err, &["model.safetensors", "overlap"]);
    // A dtype the format does not know.
    let err = raw_file_err(
        br#"{"model.norm.weight":{"dtype":"Q4_K","shape":[8],"data_offsets":[0,8]}}"#,
        &[0; 8],
    );
    assert_mentions(&err, &["model.safetensors", "model.norm.weight", "Q4_K"]);
}

/// Writes a 3-shard checkpoint and returns its directory.
fn sharded() -> tempfile::TempDir {
    let (cfg, tensors) = parts();
    let dir = tempfile::tempdir().unwrap();
    write_json(&dir.path().join("config.json"), &config_json(&cfg));
    write_sharded(dir.path(), &tensors, 3);
    dir
}

#[test]
fn missing_shard() {
    let dir = sharded();
    std::fs::remove_file(dir.path().join(shard_name(1, 3))).unwrap();
    let err = load_err(dir.path());
    assert_mentions(
        &err,
        &[
            "model.safetensors.index.json",
            &shard_name(1, 3),
            "does not exist",
            "tensor ",
        ],
    );
}

fn edit_index(dir: &Path, edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) {
    let path = dir.join("model.safetensors.index.json");
    let mut index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(index["weight_map"].as_object_mut().unwrap());
    write_json(&path, &index);
}

#[test]
fn index_lists_a_tensor_its_shard_lacks() {
    let dir = sharded();
    edit_index(dir.path(), |map| {
        map.insert(
            "model.layers.0.mlp.extra.weight".into(),
            json!(shard_name(0, 3)),
        );
    });
    let err = load_err(dir.path());
    assert_mentions(
        &err,
        &[&shard_name(0, 3), "model.layers.0.mlp.extra.weight"],
    );
}

#[test]
fn index_misses_a_tensor_that_a_shard_holds() {
    let dir = sharded();
    edit_index(dir.path(), |map| {
        map.remove("model.norm.weight");
    });
    let err = load_err(dir.path());
    assert_mentions(&err, &["model.norm.weight", "does not map it here"]);
}

#[test]
fn index_cannot_point_outside_the_model_directory() {
    let dir = sharded();
    edit_index(dir.path(), |map| {
        map.insert("model.norm.weight".into(), json!("../model.safetensors"));
    });
    let err = load_err(dir.path());
    assert_mentions(
        &err,
        &[
            "model.safetensors.index.json",
            "model.norm.weight",
            "../model.safetensors",
        ],
    );
}

#[test]
fn no_weights_at_all() {
    let (cfg, _) = parts();
    let dir = tempfile::tempdir().unwrap();
    write_json(&dir.path().join("config.json"), &config_json(&cfg));
    assert_mentions(&load_err(dir.path()), &["model.safetensors"]);
}

#[test]
fn no_config() {
    let dir = tempfile::tempdir().unwrap();
    assert_mentions(&load_err(dir.path()), &["config.json"]);
}

fn config_err(edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) -> String {
    let mut v = config_json(&tiny_config(true));
    edit(v.as_object_mut().unwrap());
    match parse_config(&v.to_string(), "some/dir/config.json") {
        Ok(c) => panic!("accepted {c:?}"),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn other_architectures_are_named() {
    for (arch, model_type) in [
        ("MistralForCausalLM", "mistral"),
        ("Phi3ForCausalLM", "phi3"),
        ("GPT2LMHeadModel", "gpt2"),
    ] {
        let err = config_err(|c| {
            c.insert("architectures".into(), json!([arch]));
            c.insert("model_type".into(), json!(model_type));
        });
        assert_mentions(&err, &["some/dir/config.json", arch, "not supported"]);
    }
    // A Llama class name on another model type is not a Llama either.
    let err = config_err(|c| {
        c.insert("model_type".into(), json!("mistral"));
    });
    assert_mentions(&err, &["config.json", "model_type mistral"]);
    let err = config_err(|c| {
        c.remove("architectures");
        c.remove("model_type");
    });
    assert_mentions(&err, &["config.json", "model_type"]);
}

#[test]
fn missing_and_mistyped_fields_are_named() {
    for field in [
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "vocab_size",
    ] {
        let err = config_err(|c| {
            c.remove(field);
        });
        assert_mentions(&err, &["some/dir/config.json", field, "missing"]);
    }
    let err = config_err(|c| {
        c.insert("hidden_size".into(), json!("576"));
    });
    assert_mentions(&err, &["config.json", "hidden_size", "integer"]);
    let err = config_err(|c| {
        c.insert("eos_token_id".into(), json!([2, -1]));
    });
    assert_mentions(&err, &["config.json", "eos_token_id"]);
    let err = config_err(|c| {
        c["rope_scaling"]
            .as_object_mut()
            .unwrap()
            .remove("low_freq_factor");
    });
    assert_mentions(
        &err,
        &["config.json", "rope_scaling.low_freq_factor", "missing"],
    );
    let err = config_err(|c| {
        c.insert("num_key_value_heads".into(), json!(3));
    });
    assert_mentions(&err, &["config.json", "num_key_value_heads"]);
    let err = parse_config("{\"hidden_size\": ", "broken.json").unwrap_err();
    assert_mentions(&format!("{err:#}"), &["broken.json", "JSON"]);
}

#[test]
fn unsupported_model_features_are_named() {
    for kind in ["yarn", "linear", "dynamic", "longrope"] {
        let err = config_err(|c| {
            c.insert(
                "rope_scaling".into(),
                json!({"rope_type": kind, "factor": 4.0}),
            );
        });
        assert_mentions(&err, &["config.json", kind, "not supported"]);
    }
    let err = config_err(|c| {
        c.insert("attention_bias".into(), json!(true));
    });
    assert_mentions(&err, &["config.json", "attention_bias"]);
    let err = config_err(|c| {
        c.insert("hidden_act".into(), json!("gelu"));
    });
    assert_mentions(&err, &["config.json", "gelu"]);
    let err = config_err(|c| {
        c.remove("head_dim");
        c.insert("hidden_size".into(), json!(66));
    });
    assert_mentions(&err, &["config.json", "head_dim"]);
}

#[test]
fn broken_tokenizer_files_are_named() {
    let (cfg, tensors) = parts();
    let dir = tempfile::tempdir().unwrap();
    write_json(&dir.path().join("config.json"), &config_json(&cfg));
    write_safetensors(&dir.path().join("model.safetensors"), &tensors);

    std::fs::write(dir.path().join("tokenizer.json"), "{\"model\": 5}").unwrap();
    assert_mentions(&load_err(dir.path()), &["tokenizer.json"]);

    // Ids beyond the embedding would index past it at run time.
    let words: Vec<String> = (0..40).map(|i| format!("w{i}")).collect();
    let words: Vec<&str> = words.iter().map(String::as_str).collect();
    write_json(
        &dir.path().join("tokenizer.json"),
        &tokenizer_json(&words, false),
    );
    assert_mentions(&load_err(dir.path()), &["tokenizer.json", "vocab_size"]);

    write_json(
        &dir.path().join("tokenizer.json"),
        &tokenizer_json(&["a"], false),
    );
    std::fs::write(dir.path().join("tokenizer_config.json"), "not json").unwrap();
    assert_mentions(&load_err(dir.path()), &["tokenizer_config.json"]);
    write_json(
        &dir.path().join("tokenizer_config.json"),
        &json!({"add_bos_token": "yes"}),
    );
    assert_mentions(
        &load_err(dir.path()),
        &["tokenizer_config.json", "add_bos_token"],
    );
}

//! Broken and hostile GGUF files: each must give an error naming the file (and the key or
//! tensor concerned), never a panic or a giant allocation.

mod common {
    pub mod gguf_writer;
}

use std::path::{Path, PathBuf};

use common::gguf_writer::{
    add_tiny_tokenizer, tiny_llama, Gguf, Val, FIRST_KEY_LENGTH_AT, METADATA_COUNT_AT,
    TENSOR_COUNT_AT, TINY_FFN, TINY_HIDDEN, TINY_KV_DIM,
};
use megainfer::model::gguf::GgufFile;
use megainfer::model::Model;

/// Writes `bytes` as `name` in a fresh directory and loads it.
fn load_bytes(name: &str, bytes: &[u8]) -> (anyhow::Result<Model>, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(name);
    std::fs::write(&path, bytes).unwrap();
    (megainfer::model::load(&path), dir)
}

/// The error loading `bytes` gives; it must name the file.
fn load_error(name: &str, bytes: &[u8]) -> String {
    match load_bytes(name, bytes).0 {
        Ok(_) => panic!("{name}: loaded without error"),
        Err(e) => {
            let msg = format!("{e:#}");
            assert!(msg.contains(name), "error does not name the file: {msg}");
            msg
        }
    }
}

fn assert_contains(msg: &str, parts: &[&str]) {
    for p in parts {
        assert!(msg.contains(p), "expected {p:?} in: {msg}");
    }
}

fn patch_u64(bytes: &mut [u8], at: usize, v: u64) {
    bytes[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

// ---- the tiny model itself loads: every failure below is caused by its one change ----

#[test]
fn tiny_model_loads() {
    let (model, _dir) = load_bytes("tiny.gguf", &tiny_llama().to_bytes());
    let m = model.unwrap();
    assert_eq!(m.config.num_layers, 2);
    assert_eq!(m.config.head_dim, 16);
    assert_eq!(m.config.vocab_size, 32);
    assert!(m.config.tie_word_embeddings);
    assert!(m.weights.lm_head.is_none());
    assert!(m.tokenizer.is_none());
}

/// GGUF files quantised with llama.cpp's K-quants (Q4_K_M mixes Q4_K and Q6_K) load: Q4_K
/// matrices as Q4_1 blocks (the same quants, each sub-block's step and minimum rounded to f16),
/// Q6_K ones as the engine's Q6_K blocks, each element exactly the block format's value. The tiny model with an
/// MLP of 256 (K-quant rows are whole 256-element super-blocks); layer 0's down projection as
/// Q4_K and layer 1's as Q6_K, then a forward pass on the CPU.
#[test]
fn tiny_model_with_k_quant_matrices_loads() {
    use megainfer::model::gguf::GgmlType;
    let ffn = 256u64;
    let mut g = tiny_llama();
    g.set("llama.feed_forward_length", Val::U32(ffn as u32));
    let f32_bytes = |n: u64, seed: u64| -> Vec<u8> {
        (0..n)
            .flat_map(|i| {
                ((((i * 7919 + seed * 31) % 1000) as f32 / 1000.0 - 0.5) * 0.2).to_le_bytes()
            })
            .collect()
    };
    // Blocks of pseudo-random bytes with their f16 scales set to 2^-6 (d) and 2^-8 (dmin).
    let k_blocks = |ty: GgmlType, rows: u64, seed: u64| -> Vec<u8> {
        let size = ty.type_size();
        let mut x = seed;
        let mut bytes: Vec<u8> = (0..rows as usize * size)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (x >> 40) as u8
            })
            .collect();
        for block in bytes.chunks_exact_mut(size) {
            let d_at = if ty == GgmlType::Q6_K { 208 } else { 0 };
            block[d_at..d_at + 2].copy_from_slice(&0x2400u16.to_le_bytes());
            if ty != GgmlType::Q6_K {
                block[2..4].copy_from_slice(&0x1c00u16.to_le_bytes());
            }
        }
        bytes
    };
    let mut downs = Vec::new();
    for (l, ty) in [GgmlType::Q4_K, GgmlType::Q6_K].into_iter().enumerate() {
        let l64 = l as u64;
        g.remove_tensor(&format!("blk.{l}.ffn_gate.weight"))
            .remove_tensor(&format!("blk.{l}.ffn_up.weight"))
            .remove_tensor(&format!("blk.{l}.ffn_down.weight"));
        g.add_tensor(
            &format!("blk.{l}.ffn_gate.weight"),
            &[TINY_HIDDEN, ffn],
            0,
            f32_bytes(TINY_HIDDEN * ffn, 1 + l64),
        )
        .add_tensor(
            &format!("blk.{l}.ffn_up.weight"),
            &[TINY_HIDDEN, ffn],
            0,
            f32_bytes(TINY_HIDDEN * ffn, 3 + l64),
        );
        let down = k_blocks(ty, TINY_HIDDEN, 5 + l64);
        g.add_tensor(
            &format!("blk.{l}.ffn_down.weight"),
            &[ffn, TINY_HIDDEN],
            ty.id(),
            down.clone(),
        );
        downs.push((ty, down));
    }
    let (model, _dir) = load_bytes("tiny_k_quants.gguf", &g.to_bytes());
    let m = model.unwrap();
    assert_eq!(m.config.intermediate_size, 256);
    let n = (ffn * TINY_HIDDEN) as usize;
    let (ty, bytes) = &downs[0];
    let w = &m.weights.layers[0].w_down;
    assert_eq!(
        w.ty(),
        megainfer::model::WeightType::Q4_1,
        "Q4_K kept as Q4_1"
    );
    let exact = megainfer::model::gguf::dequantize_f32(*ty, bytes, n).unwrap();
    let largest = exact.iter().fold(0f32, |m, x| m.max(x.abs()));
    assert!(largest > 0.0);
    for (k, e) in w.to_f32().iter().zip(&exact) {
        assert!(
            (k - e).abs() <= largest / 512.0,
            "Q4_K as Q4_1: {k} for {e}"
        );
    }
    let (ty, bytes) = &downs[1];
    let w = &m.weights.layers[1].w_down;
    assert_eq!(w.ty(), megainfer::model::WeightType::Q6_K, "Q6_K kept");
    let exact = megainfer::model::gguf::dequantize_f32(*ty, bytes, n).unwrap();
    assert_eq!(w.to_f32(), exact, "{ty} as stored");
    let logits = megainfer::reference::CpuForward::new(&m.config, &m.weights, 16)
        .forward(&[1, 2, 3])
        .unwrap();
    assert_eq!(logits.len(), 32);
    assert!(logits.iter().all(|x| x.is_finite()), "{logits:?}");
    // `--dtype q8_0`, which the load's message suggests, stores them as Q8_0 instead.
    let mut m = m;
    m.weights
        .convert_to(megainfer::model::WeightType::Q8_0)
        .unwrap();
    assert_eq!(
        m.weights.layers[0].w_down.ty(),
        megainfer::model::WeightType::Q8_0
    );
    let q8 = megainfer::reference::CpuForward::new(&m.config, &m.weights, 16)
        .forward(&[1, 2, 3])
        .unwrap();
    let e = megainfer::reference::rel_l2(&q8, &logits);
    println!("Q8_0 against the model as loaded: rel L2 {e:.2e}");
    assert!(e < 2e-2, "Q8_0 against the model as loaded: rel L2 {e:.2e}");
}

#[test]
fn tiny_model_with_output_rope_freqs_and_tokenizer_loads() {
    let mut g = tiny_llama();
    let lm_head: Vec<u8> = (0..TINY_HIDDEN * 32)
        .flat_map(|_| 0.5f32.to_le_bytes())
        .collect();
    g.add_tensor("output.weight", &[TINY_HIDDEN, 32], 0, lm_head);
    let divisors: Vec<u8> = (0..8)
        .flat_map(|i| (1.0f32 + i as f32).to_le_bytes())
        .collect();
    g.add_tensor("rope_freqs.weight", &[8], 0, divisors);
    add_tiny_tokenizer(&mut g);
    let (model, _dir) = load_bytes("tiny_full.gguf", &g.to_bytes());
    let m = model.unwrap();
    assert!(!m.config.tie_word_embeddings);
    assert_eq!(m.weights.lm_head.as_ref().unwrap().len(), 64 * 32);
    let divisors = m.config.rope_freq_divisors.as_ref().unwrap();
    assert_eq!(divisors, &(1..=8).map(|i| i as f32).collect::<Vec<_>>());
    assert_eq!(m.config.bos_token_id, Some(28));
    assert_eq!(m.config.eos_token_ids, vec![29, 31]);
    let t = m.tokenizer.as_ref().unwrap();
    assert!(t.add_bos);
    assert_eq!(t.encode("ab").unwrap(), vec![28, 26]);
    assert_eq!(t.encode("<|im_start|>abc").unwrap(), vec![28, 30, 26, 2]);
}

/// The tiny model with a tokenizer whose merges tell the pre-tokenizers apart.
fn tiny_with_pre(pre: &str) -> Model {
    let mut tokens: Vec<String> = ["!", "a", "!a", "1", "2", "3", "4", "12", "123", "Ġ"]
        .map(String::from)
        .to_vec();
    tokens.extend(('b'..='v').map(String::from));
    tokens.push("<|eot|>".into());
    let types = (0..tokens.len())
        .map(|i| if i == 31 { 3 } else { 1 })
        .collect();
    let mut g = tiny_llama();
    add_tiny_tokenizer(&mut g);
    g.set("tokenizer.ggml.pre", Val::Str(pre.into()))
        .set("tokenizer.ggml.tokens", Val::Strs(tokens))
        .set("tokenizer.ggml.token_type", Val::I32s(types))
        .set(
            "tokenizer.ggml.merges",
            Val::Strs(["1 2", "12 3", "! a"].map(String::from).to_vec()),
        );
    let name = format!("tiny_{pre}.gguf");
    load_bytes(&name, &g.to_bytes()).0.unwrap()
}

#[test]
fn pre_tokenizers_split_as_named() {
    let encode = |m: &Model, text: &str| {
        let t = m.tokenizer.as_ref().unwrap();
        // add_bos is set: drop the BOS.
        let ids = t.encode(text).unwrap()[1..].to_vec();
        assert_eq!(t.inner.decode(&ids, false).unwrap(), text);
        ids
    };
    // Llama 3: numbers in groups of up to three, punctuation joins the following letters.
    let llama = tiny_with_pre("llama-bpe");
    assert_eq!(encode(&llama, "1234"), vec![8, 6]);
    assert_eq!(encode(&llama, "!a"), vec![2]);
    assert_eq!(encode(&llama, "!a<|eot|>"), vec![2, 31]);
    // GPT-2: punctuation and letters are separate pre-tokens; digits merge freely.
    let gpt2 = tiny_with_pre("gpt2");
    assert_eq!(encode(&gpt2, "1234"), vec![8, 6]);
    assert_eq!(encode(&gpt2, "!a"), vec![0, 1]);
    // Qwen2: Llama 3's split with every digit on its own.
    let qwen2 = tiny_with_pre("qwen2");
    assert_eq!(encode(&qwen2, "1234"), vec![3, 4, 5, 6]);
    assert_eq!(encode(&qwen2, "!a"), vec![2]);
    assert_eq!(encode(&qwen2, "!a<|eot|>"), vec![2, 31]);
    // SmolLM: GPT-2 with every digit on its own.
    let smollm = tiny_with_pre("smollm");
    assert_eq!(encode(&smollm, "1234"), vec![3, 4, 5, 6]);
    assert_eq!(encode(&smollm, "!a"), vec![0, 1]);
}

// ---- not GGUF at all ----

#[test]
fn wrong_magic() {
    let mut bytes = tiny_llama().to_bytes();
    bytes[..4].copy_from_slice(b"GGML");
    let e = load_error("wrong_magic.gguf", &bytes);
    assert_contains(&e, &["not a GGUF file (bad magic"]);
}

#[test]
fn empty_and_tiny_files() {
    assert_contains(
        &load_error("empty.gguf", b""),
        &["not a GGUF file", "0 bytes"],
    );
    assert_contains(
        &load_error("three.gguf", b"GGU"),
        &["not a GGUF file", "3 bytes"],
    );
}

#[test]
fn unsupported_versions() {
    let mut bytes = tiny_llama().to_bytes();
    bytes[4..8].copy_from_slice(&1u32.to_le_bytes());
    assert_contains(
        &load_error("v1.gguf", &bytes),
        &["version 1 is not supported"],
    );
    bytes[4..8].copy_from_slice(&3u32.to_be_bytes());
    assert_contains(&load_error("be.gguf", &bytes), &["big-endian"]);
    bytes[4..8].copy_from_slice(&77u32.to_le_bytes());
    assert_contains(
        &load_error("v77.gguf", &bytes),
        &["unsupported GGUF version 77"],
    );
}

// ---- truncation of the real model ----

fn real_model() -> PathBuf {
    megainfer::fetch::default_model().expect("default model")
}

/// Truncates the real file at `len` bytes and returns the error.
fn truncated_error(bytes: &[u8], len: usize) -> String {
    let name = format!("smollm2_first_{len}_bytes.gguf");
    load_error(&name, &bytes[..len])
}

#[test]
fn truncated_header_and_metadata() {
    let bytes = std::fs::read(real_model()).unwrap();
    assert_contains(&truncated_error(&bytes, 0), &["not a GGUF file"]);
    assert_contains(&truncated_error(&bytes, 2), &["not a GGUF file"]);
    assert_contains(
        &truncated_error(&bytes, 6),
        &["header", "version", "truncated?"],
    );
    assert_contains(
        &truncated_error(&bytes, 20),
        &["header", "metadata count", "truncated?"],
    );
    for len in [23, 100, 1_000, 300_000, 1_000_000] {
        let e = truncated_error(&bytes, len);
        assert_contains(&e, &["metadata", "truncated?"]);
    }
    // Inside the token list: the message names the key and the element.
    let e = truncated_error(&bytes, 300_000);
    assert_contains(&e, &["'tokenizer.ggml.tokens'", "element"]);
}

#[test]
fn truncated_tensor_directory() {
    let bytes = std::fs::read(real_model()).unwrap();
    let data_start = GgufFile::open(&real_model()).unwrap().data_start();
    for len in [data_start - 1000, data_start - 40, data_start - 1] {
        let e = truncated_error(&bytes, len);
        assert_contains(&e, &["tensor", "truncated?"]);
    }
}

#[test]
fn truncated_tensor_data() {
    let bytes = std::fs::read(real_model()).unwrap();
    let file = GgufFile::open(&real_model()).unwrap();
    let data_start = file.data_start();
    for len in [
        data_start,
        data_start + 1000,
        bytes.len() / 2,
        bytes.len() - 1000,
        bytes.len() - 1,
    ] {
        // The first tensor in directory order whose data no longer fits.
        let cut = file
            .tensors()
            .iter()
            .find(|t| t.start + t.n_bytes > len)
            .unwrap();
        let e = truncated_error(&bytes, len);
        assert_contains(
            &e,
            &[
                &format!("tensor '{}'", cut.name),
                "data extends past end of file (",
                "truncated?)",
            ],
        );
    }
}

// ---- absurd counts and lengths ----

#[test]
fn absurd_tensor_count() {
    let mut bytes = tiny_llama().to_bytes();
    patch_u64(&mut bytes, TENSOR_COUNT_AT, u64::MAX);
    let e = load_error("many_tensors.gguf", &bytes);
    assert_contains(&e, &["header claims 18446744073709551615 tensors"]);
}

#[test]
fn absurd_metadata_count() {
    let mut bytes = tiny_llama().to_bytes();
    patch_u64(&mut bytes, METADATA_COUNT_AT, 1 << 40);
    let e = load_error("many_keys.gguf", &bytes);
    assert_contains(&e, &["header claims 1099511627776 metadata entries"]);
}

#[test]
fn absurd_key_length() {
    let mut bytes = tiny_llama().to_bytes();
    patch_u64(&mut bytes, FIRST_KEY_LENGTH_AT, u64::MAX - 3);
    let e = load_error("long_key.gguf", &bytes);
    assert_contains(
        &e,
        &[
            "metadata entry 0 of",
            "key",
            "runs past the end of the file",
        ],
    );
}

#[test]
fn absurd_string_value_length() {
    let mut g = tiny_llama();
    let mut raw = (1u64 << 62).to_le_bytes().to_vec();
    raw.extend(b"short");
    g.set("general.name", Val::Raw(8, raw));
    let e = load_error("long_string.gguf", &g.to_bytes());
    assert_contains(
        &e,
        &[
            "metadata key 'general.name'",
            "string",
            "4611686018427387904 bytes",
        ],
    );
}

#[test]
fn absurd_array_length() {
    let mut g = tiny_llama();
    let mut raw = 8u32.to_le_bytes().to_vec();
    raw.extend((1u64 << 61).to_le_bytes());
    g.set("tokenizer.ggml.tokens", Val::Raw(9, raw));
    let e = load_error("long_array.gguf", &g.to_bytes());
    assert_contains(
        &e,
        &[
            "metadata key 'tokenizer.ggml.tokens'",
            "array of 2305843009213693952 string elements",
            "cannot fit",
        ],
    );
}

#[test]
fn deeply_nested_arrays() {
    let mut raw = Vec::new();
    for _ in 0..100 {
        raw.extend(9u32.to_le_bytes());
        raw.extend(1u64.to_le_bytes());
    }
    raw.extend(4u32.to_le_bytes());
    raw.extend(0u64.to_le_bytes());
    let mut g = tiny_llama();
    g.set("general.nested", Val::Raw(9, raw));
    let e = load_error("nested.gguf", &g.to_bytes());
    assert_contains(&e, &["metadata key 'general.nested'", "nested more than"]);
}

#[test]
fn unknown_value_type() {
    let mut g = tiny_llama();
    g.set("general.odd", Val::Raw(13, vec![0; 8]));
    let e = load_error("odd_value.gguf", &g.to_bytes());
    assert_contains(&e, &["metadata key 'general.odd'", "unknown value type 13"]);
}

#[test]
fn duplicate_key() {
    let mut g = tiny_llama();
    g.kvs.push(("llama.block_count".into(), Val::U32(3)));
    let e = load_error("dup_key.gguf", &g.to_bytes());
    assert_contains(&e, &["'llama.block_count' appears twice"]);
}

// ---- tensor directory ----

#[test]
fn unknown_ggml_type() {
    let mut g = tiny_llama();
    g.tensor_mut("blk.1.attn_v.weight").ty = 99;
    let e = load_error("type99.gguf", &g.to_bytes());
    assert_contains(
        &e,
        &["tensor 'blk.1.attn_v.weight'", "unknown ggml type 99"],
    );
}

#[test]
fn too_many_dimensions() {
    let mut g = tiny_llama();
    g.tensor_mut("blk.0.ffn_norm.weight").dims = vec![64, 1, 1, 1, 1];
    let e = load_error("five_dims.gguf", &g.to_bytes());
    assert_contains(&e, &["tensor 'blk.0.ffn_norm.weight'", "5 dimensions"]);
}

#[test]
fn dimensions_overflow() {
    let mut g = tiny_llama();
    g.tensor_mut("blk.0.ffn_up.weight").dims = vec![1 << 40, 1 << 40];
    let e = load_error("overflow.gguf", &g.to_bytes());
    assert_contains(&e, &["tensor 'blk.0.ffn_up.weight'", "overflow"]);
}

#[test]
fn huge_tensor_past_end_of_file() {
    let mut g = tiny_llama();
    g.tensor_mut("blk.0.ffn_up.weight").dims = vec![1 << 30, 1 << 30];
    let e = load_error("huge.gguf", &g.to_bytes());
    assert_contains(
        &e,
        &[
            "tensor 'blk.0.ffn_up.weight'",
            "data extends past end of file",
        ],
    );
}

#[test]
fn offset_past_end_of_file() {
    let mut g = tiny_llama();
    g.tensor_mut("output_norm.weight").offset = Some(u64::MAX - 31);
    let e = load_error("far_offset.gguf", &g.to_bytes());
    assert_contains(
        &e,
        &[
            "tensor 'output_norm.weight'",
            "data extends past end of file",
        ],
    );
}

#[test]
fn misaligned_offset() {
    let mut g = tiny_llama();
    g.tensor_mut("blk.1.attn_q.weight").offset = Some(7);
    let e = load_error("misaligned.gguf", &g.to_bytes());
    assert_contains(
        &e,
        &[
            "tensor 'blk.1.attn_q.weight'",
            "not a multiple of the alignment 32",
        ],
    );
}

#[test]
fn bad_alignment() {
    let mut g = tiny_llama();
    g.set("general.alignment", Val::U32(24));
    let e = load_error("align24.gguf", &g.to_bytes());
    assert_contains(&e, &["'general.alignment'", "24 is not a power of two"]);
}

#[test]
fn duplicate_tensor() {
    let mut g = tiny_llama();
    let data = g.tensor_mut("output_norm.weight").data.clone();
    g.add_tensor("output_norm.weight", &[TINY_HIDDEN], 0, data);
    let e = load_error("dup_tensor.gguf", &g.to_bytes());
    assert_contains(&e, &["tensor 'output_norm.weight' appears twice"]);
}

#[test]
fn rows_not_a_whole_number_of_blocks() {
    let mut g = tiny_llama();
    let t = g.tensor_mut("blk.0.attn_k.weight");
    t.ty = 8; // Q8_0
    t.dims = vec![48, 2];
    t.data = vec![0; 2 * 34];
    let e = load_error("partial_block.gguf", &g.to_bytes());
    assert_contains(
        &e,
        &["tensor 'blk.0.attn_k.weight'", "48 elements", "Q8_0 blocks"],
    );
}

// ---- model-level checks ----

#[test]
fn unknown_architecture() {
    let mut g = tiny_llama();
    g.set("general.architecture", Val::Str("gpt2".into()));
    let e = load_error("gpt2_arch.gguf", &g.to_bytes());
    assert_contains(&e, &["architecture 'gpt2' is not supported"]);
}

#[test]
fn missing_metadata_key() {
    let mut g = tiny_llama();
    g.remove("llama.embedding_length");
    let e = load_error("no_hidden.gguf", &g.to_bytes());
    assert_contains(&e, &["'llama.embedding_length' is missing"]);
}

#[test]
fn metadata_of_the_wrong_type() {
    let mut g = tiny_llama();
    g.set("llama.block_count", Val::Str("two".into()));
    let e = load_error("string_layers.gguf", &g.to_bytes());
    assert_contains(
        &e,
        &[
            "'llama.block_count'",
            "expected a non-negative integer, found string",
        ],
    );
}

#[test]
fn missing_tensor() {
    let mut g = tiny_llama();
    g.remove_tensor("blk.1.ffn_up.weight");
    let e = load_error("missing.gguf", &g.to_bytes());
    assert_contains(&e, &["tensor 'blk.1.ffn_up.weight' is missing"]);
}

#[test]
fn extra_tensor() {
    let mut g = tiny_llama();
    let data = g.tensor_mut("blk.1.attn_q.weight").data.clone();
    g.add_tensor("blk.2.attn_q.weight", &[TINY_HIDDEN, TINY_HIDDEN], 0, data);
    let e = load_error("extra.gguf", &g.to_bytes());
    assert_contains(&e, &["unexpected tensor 'blk.2.attn_q.weight'"]);
}

#[test]
fn misshaped_tensor() {
    let mut g = tiny_llama();
    let t = g.tensor_mut("blk.0.attn_k.weight");
    t.dims = vec![TINY_HIDDEN, TINY_KV_DIM + 16];
    t.data = vec![0; (TINY_HIDDEN * (TINY_KV_DIM + 16) * 4) as usize];
    let e = load_error("misshaped.gguf", &g.to_bytes());
    assert_contains(
        &e,
        &["tensor 'blk.0.attn_k.weight' has shape [64, 48], expected [64, 32]"],
    );
}

#[test]
fn unsupported_quant_type() {
    let mut g = tiny_llama();
    let t = g.tensor_mut("blk.0.ffn_gate.weight");
    t.ty = 20; // IQ4_NL: 32 elements in 18 bytes
    t.data = vec![0; (TINY_HIDDEN * TINY_FFN / 32 * 18) as usize];
    let e = load_error("iq4_nl.gguf", &g.to_bytes());
    assert_contains(
        &e,
        &[
            "tensor 'blk.0.ffn_gate.weight'",
            "ggml type IQ4_NL is not supported",
            "Q4_K",
        ],
    );
}

#[test]
fn unsupported_tokenizers() {
    let mut g = tiny_llama();
    add_tiny_tokenizer(&mut g);
    g.set("tokenizer.ggml.model", Val::Str("llama".into()));
    let e = load_error("spm.gguf", &g.to_bytes());
    assert_contains(&e, &["tokenizer.ggml.model is 'llama'", "only 'gpt2'"]);

    let mut g = tiny_llama();
    add_tiny_tokenizer(&mut g);
    g.set("tokenizer.ggml.pre", Val::Str("tekken".into()));
    let e = load_error("tekken_pre.gguf", &g.to_bytes());
    assert_contains(
        &e,
        &["tokenizer.ggml.pre 'tekken' is not supported", "qwen2"],
    );

    let mut g = tiny_llama();
    add_tiny_tokenizer(&mut g);
    g.set("tokenizer.ggml.merges", Val::Strs(vec!["a x".into()]));
    let e = load_error("bad_merge.gguf", &g.to_bytes());
    assert_contains(&e, &["cannot build the BPE tokenizer"]);

    let mut g = tiny_llama();
    add_tiny_tokenizer(&mut g);
    g.set("tokenizer.ggml.eos_token_id", Val::U32(32));
    let e = load_error("bad_eos.gguf", &g.to_bytes());
    assert_contains(
        &e,
        &["'tokenizer.ggml.eos_token_id'", "outside the vocabulary"],
    );
}

#[test]
fn not_a_file() {
    let dir = tempfile::tempdir().unwrap();
    let missing: &Path = &dir.path().join("absent.gguf");
    let e = format!("{:#}", megainfer::model::gguf::load(missing).err().unwrap());
    assert_contains(&e, &["absent.gguf", "cannot open"]);
}

#[test]
fn reads_the_same_directory_the_writer_wrote() {
    // Guards the writer itself: a test of a broken file is only as good as the valid one.
    let g: Gguf = tiny_llama();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("roundtrip.gguf");
    std::fs::write(&path, g.to_bytes()).unwrap();
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.tensors().len(), g.tensors.len());
    for (ours, theirs) in f.tensors().iter().zip(&g.tensors) {
        assert_eq!(ours.name, theirs.name);
        assert_eq!(f.tensor_data(&ours.name).unwrap(), &theirs.data[..]);
    }
    assert_eq!(f.metadata().len(), g.kvs.len());
}

#[test]
fn absurd_block_count() {
    let mut g = tiny_llama();
    g.set("llama.block_count", Val::U32(10_000_000));
    let e = load_error("many_layers.gguf", &g.to_bytes());
    assert_contains(&e, &["llama.block_count is 10000000", "only 20 tensors"]);
}

#[test]
fn one_layer_more_than_the_file_has() {
    let mut g = tiny_llama();
    g.set("llama.block_count", Val::U32(3));
    let e = load_error("three_layers.gguf", &g.to_bytes());
    assert_contains(&e, &["tensor 'blk.2.", "is missing"]);
}

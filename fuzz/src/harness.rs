//! What each fuzz target does with one input: write it where the loader expects a model file
//! and load it. A loader may fail (that is the point of most inputs) but must not panic, hang or
//! allocate what a header claims. Shared by the cargo-fuzz targets and the short deterministic
//! mutation run in `cargo test` (tests/fuzz_mutations.rs), so both exercise the same code.

use std::cell::RefCell;
use std::path::{Path, PathBuf};

use megainfer::tokenizer::chat::{render, ChatMessage};

/// Separates the files of an `hf_dir` input: config.json, then model.safetensors; or
/// config.json, model.safetensors.index.json and shards `shard1.safetensors`, ....
pub const PART_SEPARATOR: &[u8] = b"\xff\xfe\xfd\xfc";

/// A scratch directory per thread, reused for every input (creating one per input would cost
/// more than most loads).
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

thread_local! {
    static SCRATCH: RefCell<Option<Scratch>> = const { RefCell::new(None) };
}

/// Runs `f` in this thread's scratch directory, emptied first.
fn in_scratch<T>(f: impl FnOnce(&Path) -> T) -> T {
    SCRATCH.with(|s| {
        let mut s = s.borrow_mut();
        let dir = &s
            .get_or_insert_with(|| {
                static NEXT: std::sync::atomic::AtomicUsize =
                    std::sync::atomic::AtomicUsize::new(0);
                let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let dir =
                    std::env::temp_dir().join(format!("megainfer-fuzz-{}-{n}", std::process::id()));
                Scratch(dir)
            })
            .0;
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir).expect("create the scratch directory");
        f(dir)
    })
}

fn write(path: &Path, bytes: &[u8]) {
    std::fs::write(path, bytes).expect("write a scratch file");
}

/// The GGUF reader, metadata, tensor checks, dequantization and the GGUF tokenizer. Matrices
/// stored as Q8_0, Q4_0, Q4_1 (and Q4_K, Q5_0, Q6_K, rewritten) load as blocks, so they are
/// then widened to bf16 as `--dtype bf16` does, decoding every block.
pub fn gguf(data: &[u8]) {
    in_scratch(|dir| {
        let path = dir.join("input.gguf");
        write(&path, data);
        if let Ok(mut model) = megainfer::model::load(&path) {
            use_tokenizer(&model);
            model.weights.widen_to_bf16();
        }
    })
}

/// An HF directory: config.json, safetensors headers and data, or a sharded index.
pub fn hf_dir(data: &[u8]) {
    in_scratch(|dir| {
        let parts = split(data);
        write(&dir.join("config.json"), parts[0]);
        match parts.len() {
            1 => {}
            2 => write(&dir.join("model.safetensors"), parts[1]),
            _ => {
                write(&dir.join("model.safetensors.index.json"), parts[1]);
                for (i, shard) in parts[2..].iter().enumerate() {
                    write(&dir.join(format!("shard{}.safetensors", i + 1)), shard);
                }
            }
        }
        let _ = megainfer::model::load(dir);
    })
}

/// `tokenizer.json` beside a fixed, valid tiny model (written by `write_tokenizer_host`),
/// then encoding and decoding with it.
pub fn tokenizer_json(data: &[u8]) {
    tokenizer_json_with(data, HOST_CONFIG, &HOST_WEIGHTS)
}

/// The tiny model `tokenizer_json` loads each tokenizer with: 1 layer, hidden 16, vocab 64,
/// bf16 zeros (the weights do not matter, only that the directory loads).
pub const HOST_CONFIG: &str = r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama",
"hidden_size":16,"intermediate_size":32,"num_hidden_layers":1,"num_attention_heads":2,
"num_key_value_heads":1,"vocab_size":64,"max_position_embeddings":64,"tie_word_embeddings":true}"#;
static HOST_WEIGHTS: std::sync::LazyLock<Vec<u8>> = std::sync::LazyLock::new(host_weights);

fn tokenizer_json_with(data: &[u8], config: &str, weights: &[u8]) {
    in_scratch(|dir| {
        write(&dir.join("config.json"), config.as_bytes());
        write(&dir.join("model.safetensors"), weights);
        write(&dir.join("tokenizer.json"), data);
        if let Ok(model) = megainfer::model::load(dir) {
            use_tokenizer(&model);
        }
    })
}

/// A chat template (the input as text) rendered with a short conversation.
pub fn chat_template(data: &[u8]) {
    let Ok(template) = std::str::from_utf8(data) else {
        return;
    };
    let messages = [
        ChatMessage::new("system", "Be brief."),
        ChatMessage::new("user", "Hi!"),
        ChatMessage::new("assistant", "Hello."),
        ChatMessage::new("user", "What is 2+2?"),
    ];
    let _ = render(template, &messages, "<s>", "</s>", true);
}

fn use_tokenizer(model: &megainfer::model::Model) {
    let Some(tok) = &model.tokenizer else { return };
    for text in [
        "Hello world",
        "<|im_start|>user\n2+2?<|im_end|>",
        " \u{e9}\u{1F600} 123",
        "",
    ] {
        if let Ok(ids) = tok.encode(text) {
            let _ = tok.decode(&ids);
            for id in ids.iter().take(4) {
                let _ = tok.decode(&[*id]);
            }
        }
    }
}

fn split(data: &[u8]) -> Vec<&[u8]> {
    let mut parts = Vec::new();
    let mut rest = data;
    while let Some(at) = rest
        .windows(PART_SEPARATOR.len())
        .position(|w| w == PART_SEPARATOR)
    {
        parts.push(&rest[..at]);
        rest = &rest[at + PART_SEPARATOR.len()..];
    }
    parts.push(rest);
    parts
}

/// model.safetensors for `HOST_CONFIG`, all zeros in bf16.
pub fn host_weights() -> Vec<u8> {
    let (h, ff, kv, v) = (16usize, 32usize, 8usize, 64usize);
    let shapes: Vec<(String, Vec<usize>)> = vec![
        ("model.embed_tokens.weight".into(), vec![v, h]),
        ("model.layers.0.input_layernorm.weight".into(), vec![h]),
        ("model.layers.0.self_attn.q_proj.weight".into(), vec![h, h]),
        ("model.layers.0.self_attn.k_proj.weight".into(), vec![kv, h]),
        ("model.layers.0.self_attn.v_proj.weight".into(), vec![kv, h]),
        ("model.layers.0.self_attn.o_proj.weight".into(), vec![h, h]),
        (
            "model.layers.0.post_attention_layernorm.weight".into(),
            vec![h],
        ),
        ("model.layers.0.mlp.gate_proj.weight".into(), vec![ff, h]),
        ("model.layers.0.mlp.up_proj.weight".into(), vec![ff, h]),
        ("model.layers.0.mlp.down_proj.weight".into(), vec![h, ff]),
        ("model.norm.weight".into(), vec![h]),
    ];
    let mut header = String::from("{");
    let mut at = 0usize;
    for (i, (name, shape)) in shapes.iter().enumerate() {
        let bytes = 2 * shape.iter().product::<usize>();
        if i > 0 {
            header.push(',');
        }
        header.push_str(&format!(
            r#""{name}":{{"dtype":"BF16","shape":{shape:?},"data_offsets":[{at},{}]}}"#,
            at + bytes
        ));
        at += bytes;
    }
    header.push('}');
    while header.len() % 8 != 0 {
        header.push(' ');
    }
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.resize(out.len() + at, 0);
    out
}

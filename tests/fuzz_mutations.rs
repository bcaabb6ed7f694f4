//! A short, deterministic mutation fuzz run over the same harness as the cargo-fuzz targets in
//! `fuzz/` (GGUF, HF directory, tokenizer.json, chat template): seeds built here, mutated by a
//! seeded generator (bit flips, byte sets, truncation, inflated length fields, chunk copies and
//! deletions, digit runs), each input loaded in-process. No input may panic, take over 5 s or
//! allocate more than max(2 x its size, 64 MB) at once. A few seconds in all, so CI exercises
//! the harness; `scripts/fuzz.sh` runs the real fuzzers for longer.

#[path = "common/alloc_track.rs"]
mod alloc_track;
#[allow(dead_code)]
#[path = "common/gguf_writer.rs"]
mod gguf_writer;
#[path = "../fuzz/src/harness.rs"]
mod harness;
#[path = "common/hf_writer.rs"]
mod hf_writer;

use std::path::Path;
use std::time::{Duration, Instant};

use alloc_track::{allocation_bound, largest_allocation};
use gguf_writer::{add_tiny_tokenizer, Gguf, Val};
use megainfer::model::quant::{quantize_row, QuantType};
use megainfer::model::random::random_weights;
use megainfer::model::{Config, WeightType};
use safetensors::Dtype;
use serde_json::json;

#[global_allocator]
static ALLOC: alloc_track::Tracking = alloc_track::Tracking;

/// xorshift64*: deterministic, so a failure reproduces from the test alone.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn mutate(rng: &mut Rng, seed: &[u8]) -> Vec<u8> {
    let mut d = seed.to_vec();
    for _ in 0..1 + rng.below(4) {
        let len = d.len();
        match rng.below(8) {
            0 if len > 0 => {
                let i = rng.below(len);
                d[i] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let i = rng.below(len);
                d[i] = [0, 0xff, 0x7f, 0x80, b'"', b'9', b'{', b'-'][rng.below(8)];
            }
            2 => d.truncate(rng.below(len + 1)),
            // A length or count field claiming far more than the file holds.
            3 if len >= 8 => {
                let i = rng.below(len - 7);
                let v: u64 = [u64::MAX, 1 << 40, 1 << 31, 0xffff_ffff, 1 << 24][rng.below(5)];
                d[i..i + 8].copy_from_slice(&v.to_le_bytes());
            }
            4 if len >= 4 => {
                let i = rng.below(len - 3);
                let v = [u32::MAX, 1 << 30, 65536, 0][rng.below(4)];
                d[i..i + 4].copy_from_slice(&v.to_le_bytes());
            }
            5 if len > 0 => {
                let (a, n) = (rng.below(len), 1 + rng.below(64));
                let chunk = d[a..(a + n).min(len)].to_vec();
                let at = rng.below(len + 1);
                d.splice(at..at, chunk);
            }
            6 if len > 0 => {
                let a = rng.below(len);
                let b = (a + 1 + rng.below(64)).min(len);
                d.drain(a..b);
            }
            7 => {
                let at = rng.below(len + 1);
                let digits = ["9999999999", "-1", "1e308", "18446744073709551615", "0"];
                d.splice(at..at, digits[rng.below(5)].bytes());
            }
            _ => {}
        }
    }
    d
}

/// Runs `target` on `iterations` mutations of the seeds; fails on a panic, a slow input or an
/// allocation over the bound, saving the input under target/ to reproduce.
/// `MEGAINFER_FUZZ_ITERATIONS` replaces each run's count, for a longer run without cargo-fuzz.
fn run(name: &str, target: fn(&[u8]), seeds: &[Vec<u8>], iterations: usize, seed: u64) {
    let iterations = std::env::var("MEGAINFER_FUZZ_ITERATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(iterations);
    let mut rng = Rng(seed);
    let start = Instant::now();
    let (mut slowest, mut largest_seen) = (Duration::ZERO, 0usize);
    for i in 0..iterations + seeds.len() {
        let input = match seeds.get(i) {
            Some(s) => s.clone(),
            None => {
                let pick = rng.below(seeds.len());
                mutate(&mut rng, &seeds[pick])
            }
        };
        let t = Instant::now();
        let (outcome, largest) = largest_allocation(|| std::panic::catch_unwind(|| target(&input)));
        let took = t.elapsed();
        let failure = if outcome.is_err() {
            Some("panicked".to_string())
        } else if took > Duration::from_secs(5) {
            Some(format!("took {took:?}"))
        } else if largest > allocation_bound(input.len()) {
            Some(format!("allocated {largest} bytes at once"))
        } else {
            None
        };
        if let Some(why) = failure {
            let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("fuzz-{name}-{i}.bin"));
            std::fs::write(&path, &input).unwrap();
            panic!("{name}: input {i} {why}; saved to {}", path.display());
        }
        slowest = slowest.max(took);
        largest_seen = largest_seen.max(largest);
    }
    println!(
        "{name}: {} inputs in {:?}, slowest {slowest:?}, largest allocation {largest_seen} bytes",
        iterations + seeds.len(),
        start.elapsed()
    );
}

// ---- seeds ----

/// 1 layer, hidden 16, 2 heads of 8, 1 kv head, ffn 32, vocab 32: a complete model in ~10 KB.
fn small_config() -> Config {
    let mut c = hf_writer::tiny_config(true);
    c.hidden_size = 16;
    c.intermediate_size = 32;
    c.num_layers = 1;
    c.num_heads = 2;
    c.num_kv_heads = 1;
    c.head_dim = 8;
    c
}

/// How a GGUF seed stores its matrices: F32 (1-D tensors always are), or per matrix name a
/// block format kept as stored by the loader.
type Storage = fn(&str) -> Option<QuantType>;

/// The seeds' llama metadata: one layer, 2 heads, 1 KV head, context 64.
fn seed_metadata(h: u64, f: u64, v: u64) -> Gguf {
    gguf_writer::llama_metadata(1, 64, h, f, 2, 1, v)
}

/// The GGUF type id of a block format.
fn ggml_type(q: QuantType) -> u32 {
    match q {
        QuantType::Q4_0 => 2,
        QuantType::Q4_1 => 3,
        QuantType::Q8_0 => 8,
        // GGUF's Q6_K is a 256-element super-block, not the engine's block: no seed uses it.
        QuantType::Q6_K => unreachable!("the seeds store no Q6_K"),
    }
}

/// A 1-layer llama GGUF, 2 heads, 1 kv head, ffn twice the hidden size, vocab 32. With F32
/// matrices hidden is 16 (~13 KB); quantised matrices need rows of whole 32-element blocks, so
/// there hidden is 32 (~7-12 KB).
fn gguf_seed(tokenizer: bool, tied: bool, storage: Storage) -> Vec<u8> {
    let quantised = ["token_embd", "blk.0.attn_q", "output"]
        .iter()
        .any(|n| storage(n).is_some());
    let h: u64 = if quantised { 32 } else { 16 };
    let (f, kv, v) = (2 * h, h / 2, 32u64);
    let mut g = seed_metadata(h, f, v);
    let mut add = |name: &str, dims: &[u64]| {
        let n = dims.iter().product::<u64>();
        let stem = name.strip_suffix(".weight").unwrap_or(name);
        match storage(stem).filter(|_| dims.len() == 2) {
            None => {
                let data = (0..n)
                    .flat_map(|i| (i as f32 * 0.01).to_le_bytes())
                    .collect();
                g.add_tensor(name, dims, 0, data);
            }
            Some(q) => {
                // Both signs and varied magnitudes, so blocks differ in scale and minimum.
                let x: Vec<f32> = (0..n)
                    .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.01 * (1 + i % 3) as f32)
                    .collect();
                g.add_tensor(name, dims, ggml_type(q), quantize_row(q, &x));
            }
        }
    };
    add("token_embd.weight", &[h, v]);
    for (n, dims) in [
        ("attn_norm", vec![h]),
        ("attn_q", vec![h, h]),
        ("attn_k", vec![h, kv]),
        ("attn_v", vec![h, kv]),
        ("attn_output", vec![h, h]),
        ("ffn_norm", vec![h]),
        ("ffn_gate", vec![h, f]),
        ("ffn_up", vec![h, f]),
        ("ffn_down", vec![f, h]),
    ] {
        add(&format!("blk.0.{n}.weight"), &dims);
    }
    add("output_norm.weight", &[h]);
    if !tied {
        add("output.weight", &[h, v]);
    }
    if tokenizer {
        add_tiny_tokenizer(&mut g);
        g.set(
            "tokenizer.chat_template",
            Val::Str("{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}".into()),
        );
    }
    g.to_bytes()
}

/// Seeds 0-2: F32. 3-5: every matrix Q8_0, Q4_0, Q4_1. 6: the types mixed, with Q/K/V and
/// gate/up each mixed too (the loader widens such a group to bf16). 7: Q5_0 and Q4_K, which
/// the loader rewrites as Q8_0 and Q4_1.
fn gguf_seeds() -> Vec<Vec<u8>> {
    use QuantType::{Q4_0, Q4_1, Q8_0};
    vec![
        gguf_seed(false, true, |_| None),
        gguf_seed(true, true, |_| None),
        gguf_seed(true, false, |_| None),
        gguf_seed(true, true, |_| Some(Q8_0)),
        gguf_seed(false, false, |_| Some(Q4_0)),
        gguf_seed(true, true, |_| Some(Q4_1)),
        gguf_seed(false, false, |name| match name {
            "token_embd" | "blk.0.attn_output" | "blk.0.ffn_up" => Some(Q8_0),
            "blk.0.attn_k" | "blk.0.ffn_down" => Some(Q4_0),
            _ => Some(Q4_1),
        }),
        gguf_rewritten_seed(),
    ]
}

/// Seed 7: formats the loader rewrites, a Q5_0 embedding (kept as Q8_0) and a Q4_K down
/// projection (kept as Q4_1; K-quant rows are whole 256-element super-blocks, so the MLP is
/// 256 wide); the other matrices Q8_0, tied embeddings (~40 KB).
fn gguf_rewritten_seed() -> Vec<u8> {
    let (h, f, kv, v) = (32u64, 256u64, 16u64, 32u64);
    let mut g = seed_metadata(h, f, v);
    let values = |n: u64| -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.01 * (1 + i % 3) as f32)
            .collect()
    };
    // Blocks of varied bytes with a moderate f16 scale (2^-6) and minimum (2^-8) where the
    // format has them at the block's start.
    let blocks = |n_blocks: u64, size: usize, scales: &[(usize, u16)], salt: u64| -> Vec<u8> {
        let mut out: Vec<u8> = (0..n_blocks * size as u64)
            .map(|i| ((i * 2654435761 + salt) >> 7) as u8)
            .collect();
        for b in out.chunks_exact_mut(size) {
            for &(at, bits) in scales {
                b[at..at + 2].copy_from_slice(&bits.to_le_bytes());
            }
        }
        out
    };
    g.add_tensor(
        "token_embd.weight",
        &[h, v],
        6,
        blocks(h * v / 32, 22, &[(0, 0x2400)], 1),
    );
    let q8 = |g: &mut Gguf, name: &str, dims: &[u64]| {
        let n = dims.iter().product();
        g.add_tensor(name, dims, 8, quantize_row(QuantType::Q8_0, &values(n)));
    };
    let f32s = |n: u64| -> Vec<u8> { values(n).iter().flat_map(|x| x.to_le_bytes()).collect() };
    g.add_tensor("blk.0.attn_norm.weight", &[h], 0, f32s(h));
    q8(&mut g, "blk.0.attn_q.weight", &[h, h]);
    q8(&mut g, "blk.0.attn_k.weight", &[h, kv]);
    q8(&mut g, "blk.0.attn_v.weight", &[h, kv]);
    q8(&mut g, "blk.0.attn_output.weight", &[h, h]);
    g.add_tensor("blk.0.ffn_norm.weight", &[h], 0, f32s(h));
    q8(&mut g, "blk.0.ffn_gate.weight", &[h, f]);
    q8(&mut g, "blk.0.ffn_up.weight", &[h, f]);
    g.add_tensor(
        "blk.0.ffn_down.weight",
        &[f, h],
        12,
        blocks(h, 144, &[(0, 0x2400), (2, 0x1c00)], 2),
    );
    g.add_tensor("output_norm.weight", &[h], 0, f32s(h));
    g.to_bytes()
}

/// What each GGUF seed's matrices load as: (embedding, wq, wk, w_gate, w_up, lm_head).
fn gguf_seed_types() -> Vec<[WeightType; 6]> {
    use WeightType::{Bf16, Q4_0, Q4_1, Q8_0};
    vec![
        [Bf16; 6],
        [Bf16; 6],
        [Bf16; 6],
        [Q8_0; 6],
        [Q4_0; 6],
        [Q4_1; 6],
        [Q8_0, Bf16, Bf16, Bf16, Bf16, Q4_1],
        [Q8_0; 6],
    ]
}

fn hf_seeds() -> Vec<Vec<u8>> {
    let cfg = small_config();
    let w = random_weights(&cfg, 3);
    let config = serde_json::to_vec(&hf_writer::config_json(&cfg)).unwrap();
    let single = hf_writer::safetensors_bytes(&hf_writer::hf_tensors(&cfg, &w, Dtype::BF16));
    let join = |parts: &[&[u8]]| parts.join(harness::PART_SEPARATOR);
    // Sharded: the writer's shard names renamed to the harness's shard1, shard2.
    let dir = tempfile::tempdir().unwrap();
    let tensors = hf_writer::hf_tensors(&cfg, &w, Dtype::F16);
    hf_writer::write_sharded(dir.path(), &tensors, 2);
    let index_path = dir.path().join("model.safetensors.index.json");
    let mut index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&index_path).unwrap()).unwrap();
    for v in index["weight_map"].as_object_mut().unwrap().values_mut() {
        let i = (0..2)
            .find(|&i| v.as_str() == Some(&hf_writer::shard_name(i, 2)))
            .expect("a shard name the writer uses");
        *v = json!(format!("shard{}.safetensors", i + 1));
    }
    let index = serde_json::to_vec(&index).unwrap();
    let shard = |i| std::fs::read(dir.path().join(hf_writer::shard_name(i, 2))).unwrap();
    let (s1, s2) = (shard(0), shard(1));
    vec![
        join(&[&config, &single]),
        join(&[&config, &index, &s1, &s2]),
    ]
}

const SMOLLM2_TEMPLATE: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

const TOOLS_TEMPLATE: &str = r#"{{- bos_token }}{%- set ns = namespace(sys="") %}{%- if messages[0]['role'] == 'system' %}{%- set ns.sys = messages[0]['content']|trim %}{%- set messages = messages[1:] %}{%- endif %}{{- "<|start_header_id|>system<|end_header_id|>\n\nToday: " + strftime_now("%d %b %Y") + "\n" + ns.sys + "<|eot_id|>" }}{%- for m in messages %}{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' }}{{ m | tojson(indent=2) }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}{% macro f(x) %}{{ x * 2 }}{% endmacro %}{{ f(21) }}{{ range(3)|join(",") }}{{ "a,b"|split(",")|length if false else "" }}"#;

fn chat_seeds() -> Vec<Vec<u8>> {
    vec![
        SMOLLM2_TEMPLATE.as_bytes().to_vec(),
        TOOLS_TEMPLATE.as_bytes().to_vec(),
    ]
}

const LLAMA_DECODER: &str = r#"{"type":"Sequence","decoders":[{"type":"Replace","pattern":{"String":"▁"},"content":" "},{"type":"ByteFallback"},{"type":"Fuse"},{"type":"Strip","content":" ","start":1,"stop":0}]}"#;

fn tokenizer_seeds() -> Vec<Vec<u8>> {
    let words = [
        "Hello",
        "world",
        "2+2?",
        "user",
        "<|im_start|>",
        "<|im_end|>",
    ];
    let plain = hf_writer::tokenizer_json(&words, false);
    let mut with_bos = hf_writer::tokenizer_json(&words, true);
    with_bos["decoder"] = serde_json::from_str(LLAMA_DECODER).unwrap();
    let mut bpe = hf_writer::tokenizer_json(&[], false);
    bpe["pre_tokenizer"] = json!({"type": "ByteLevel", "add_prefix_space": false,
        "trim_offsets": true, "use_regex": true});
    bpe["decoder"] = json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
        "use_regex": true});
    bpe["model"] = json!({"type": "BPE", "dropout": null, "unk_token": null,
        "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
        "byte_fallback": false, "ignore_merges": false,
        "vocab": {"<unk>": 0, "<s>": 1, "</s>": 2, "H": 3, "e": 4, "l": 5, "o": 6, "Ġ": 7,
                  "w": 8, "r": 9, "d": 10, "He": 11, "ll": 12, "Hell": 13, "Hello": 14},
        "merges": ["H e", "l l", "He ll", "Hell o"]});
    [plain, with_bos, bpe]
        .iter()
        .map(|v| serde_json::to_vec(v).unwrap())
        .collect()
}

// ---- the runs ----

#[test]
fn gguf_mutations() {
    run("gguf", harness::gguf, &gguf_seeds(), 600, 1);
}

#[test]
fn hf_dir_mutations() {
    run("hf_dir", harness::hf_dir, &hf_seeds(), 600, 2);
}

#[test]
fn tokenizer_json_mutations() {
    run(
        "tokenizer_json",
        harness::tokenizer_json,
        &tokenizer_seeds(),
        600,
        3,
    );
}

#[test]
fn chat_template_mutations() {
    run(
        "chat_template",
        harness::chat_template,
        &chat_seeds(),
        600,
        4,
    );
}

/// The seeds must load, or the mutations would only ever test the first error path.
#[test]
fn seeds_load() {
    let dir = tempfile::tempdir().unwrap();
    for (i, (seed, types)) in gguf_seeds().iter().zip(gguf_seed_types()).enumerate() {
        let path = dir.path().join(format!("seed{i}.gguf"));
        std::fs::write(&path, seed).unwrap();
        let mut m = megainfer::model::load(&path).unwrap();
        let (w, l) = (&m.weights, &m.weights.layers[0]);
        let got = [&w.embed, &l.wq, &l.wk, &l.w_gate, &l.w_up, w.lm_head()].map(|m| m.ty());
        assert_eq!(got, types, "gguf seed {i}");
        if i == 7 {
            assert_eq!(
                l.w_down.ty(),
                WeightType::Q4_1,
                "seed 7's Q4_K down projection"
            );
        }
        // What the harness does next: every block decoded.
        assert_eq!(m.weights.is_quantized(), i >= 3);
        m.weights.widen_to_bf16();
    }
    for (i, seed) in hf_seeds().iter().enumerate() {
        let d = dir.path().join(format!("hf{i}"));
        std::fs::create_dir(&d).unwrap();
        let parts: Vec<&[u8]> = split(seed);
        std::fs::write(d.join("config.json"), parts[0]).unwrap();
        if parts.len() == 2 {
            std::fs::write(d.join("model.safetensors"), parts[1]).unwrap();
        } else {
            std::fs::write(d.join("model.safetensors.index.json"), parts[1]).unwrap();
            for (j, s) in parts[2..].iter().enumerate() {
                std::fs::write(d.join(format!("shard{}.safetensors", j + 1)), s).unwrap();
            }
        }
        megainfer::model::load(&d).unwrap();
    }
    for (i, seed) in tokenizer_seeds().iter().enumerate() {
        let d = dir.path().join(format!("tok{i}"));
        std::fs::create_dir(&d).unwrap();
        std::fs::write(d.join("config.json"), harness::HOST_CONFIG).unwrap();
        std::fs::write(d.join("model.safetensors"), harness::host_weights()).unwrap();
        std::fs::write(d.join("tokenizer.json"), seed).unwrap();
        let m = megainfer::model::load(&d).unwrap();
        let tok = m.tokenizer.unwrap();
        assert!(!tok.encode("Hello world").unwrap().is_empty());
    }
    for seed in chat_seeds() {
        let t = std::str::from_utf8(&seed).unwrap();
        let out = megainfer::tokenizer::chat::render(
            t,
            &[megainfer::tokenizer::chat::ChatMessage::new("user", "Hi")],
            "<s>",
            "</s>",
            true,
        )
        .unwrap();
        assert!(out.contains("Hi"));
    }
}

fn split(data: &[u8]) -> Vec<&[u8]> {
    let sep = harness::PART_SEPARATOR;
    let mut parts = Vec::new();
    let mut rest = data;
    while let Some(at) = rest.windows(sep.len()).position(|w| w == sep) {
        parts.push(&rest[..at]);
        rest = &rest[at + sep.len()..];
    }
    parts.push(rest);
    parts
}

/// Writes the seeds as the cargo-fuzz corpora in fuzz/corpus/<target>/ (run with --ignored
/// after changing them).
#[test]
#[ignore = "writes fuzz/corpus/: run with --ignored to refresh the committed seeds"]
fn write_seed_corpora() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus");
    for (target, seeds) in [
        ("gguf", gguf_seeds()),
        ("hf_dir", hf_seeds()),
        ("tokenizer_json", tokenizer_seeds()),
        ("chat_template", chat_seeds()),
    ] {
        let dir = root.join(target);
        std::fs::create_dir_all(&dir).unwrap();
        for (i, s) in seeds.iter().enumerate() {
            let path = dir.join(format!("seed-{i}"));
            std::fs::write(&path, s).unwrap();
            assert_eq!(&std::fs::read(&path).unwrap(), s);
        }
    }
}

//! The CPU reference against HF transformers: tiny random Llama, Qwen3 and Qwen2 checkpoints
//! that transformers wrote, and the logits transformers computed from them with K/V kept in bf16 as megainfer
//! keeps them (tests/fixtures/hf-golden/make_goldens.py says how, and regenerates them).
//! This is the ground truth independent of megainfer that every GPU path's reference rests on.

#[allow(dead_code)]
#[path = "common/gguf_writer.rs"]
mod gguf_writer;

use std::path::{Path, PathBuf};
use std::process::Command;

use megainfer::reference::rel_l2;
use megainfer::reference::CpuForward;
use megainfer::tokenizer::chat::{self, ChatMessage};
use serde::Deserialize;

/// Per case, about ten times the worst relative L2 error of the logits over its 24 positions,
/// decode or prefill, as measured (docs/testing.md). What is left is f32 summation order, and the rare K/V
/// element that an f32 difference of an ulp rounds to the other bf16 neighbour.
fn tolerance(case: &str) -> f64 {
    match case {
        "llama3_tied_gqa2" => 6e-5,    // measured 6.09e-6
        "plain_untied_gqa3" => 3.5e-5, // measured 3.51e-6
        "plain_tied_hd64_mha" => 8e-6, // measured 7.85e-7
        "qwen3_tied_hd32" => 4.5e-6,   // measured 4.47e-7 (prefill)
        "qwen3_untied_gqa3" => 9.5e-6, // measured 9.47e-7
        "qwen2_bias_gqa2" => 5.2e-5,   // measured 5.17e-6
        other => panic!("{other}: no tolerance recorded for this case"),
    }
}

#[derive(Deserialize)]
struct Goldens {
    transformers: String,
    torch: String,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    dir: String,
    tokens: Vec<u32>,
    logits: Vec<Vec<f32>>,
    greedy: Option<Greedy>,
    chat: Option<Chat>,
}

/// transformers' greedy continuation of `prompt`, with each step's top-2 logit margin.
#[derive(Deserialize)]
struct Greedy {
    prompt: String,
    prompt_ids: Vec<u32>,
    generated_ids: Vec<u32>,
    margins: Vec<f32>,
}

/// `apply_chat_template(messages, add_generation_prompt=...)` as transformers rendered it.
#[derive(Deserialize)]
struct Chat {
    messages: Vec<Message>,
    add_generation_prompt: bool,
    rendered: String,
}

#[derive(Deserialize)]
struct Message {
    role: String,
    content: String,
}

fn goldens() -> Goldens {
    let text = std::fs::read_to_string(fixtures().join("goldens.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf-golden")
}

#[test]
fn cpu_reference_matches_transformers_goldens() {
    let goldens = goldens();
    println!(
        "goldens from transformers {}, torch {}",
        goldens.transformers, goldens.torch
    );
    assert_eq!(goldens.cases.len(), 6);
    let mut worst_all = 0f64;
    for case in &goldens.cases {
        let model = megainfer::model::load(&fixtures().join(&case.dir)).unwrap();
        let c = &model.config;
        assert_eq!(case.logits.len(), case.tokens.len(), "{}", case.dir);
        // Token by token (the decode reference) and as one batched prefill in chunks of 5
        // (the prefill reference): both must match transformers.
        let decode = CpuForward::new(c, &model.weights, case.tokens.len())
            .forward_all(&case.tokens)
            .unwrap();
        let prefill = CpuForward::new(c, &model.weights, case.tokens.len())
            .prefill_all(&case.tokens, 5)
            .unwrap();
        let tol = tolerance(&case.dir);
        for (what, got) in [("decode", &decode), ("prefill", &prefill)] {
            let mut worst = (0f64, 0usize);
            for (pos, (g, w)) in got.iter().zip(&case.logits).enumerate() {
                assert_eq!(g.len(), w.len(), "{}: vocabulary size", case.dir);
                let err = rel_l2(g, w);
                if err > worst.0 {
                    worst = (err, pos);
                }
            }
            println!(
                "{} ({}, {what}): {} layers, {} heads / {} kv, head_dim {}, q/k norm {}, qkv bias \
                 {}, {} positions: worst rel L2 {:.2e} at position {} (tolerance {tol:.1e})",
                case.dir,
                c.architecture,
                c.num_layers,
                c.num_heads,
                c.num_kv_heads,
                c.head_dim,
                c.qk_norm,
                c.qkv_bias,
                case.tokens.len(),
                worst.0,
                worst.1
            );
            assert!(
                worst.0 <= tol,
                "{} ({what}): logits at position {} differ from transformers by {:.2e} relative \
                 L2 (> {tol:.1e})",
                case.dir,
                worst.1,
                worst.0
            );
            worst_all = worst_all.max(worst.0);
        }
    }
    println!("all cases: worst rel L2 {worst_all:.2e}");
}

/// The goldens cover what they claim: both RoPE kinds as transformers 5 writes them, tied and
/// untied heads, several GQA groupings; a regenerated set that lost one fails here.
#[test]
fn goldens_cover_the_configurations_they_claim() {
    let goldens = goldens();
    let configs: Vec<_> = goldens
        .cases
        .iter()
        .map(|case| {
            megainfer::model::load(&fixtures().join(&case.dir))
                .unwrap()
                .config
        })
        .collect();
    assert!(configs.iter().any(|c| c.rope_scaling.is_some()));
    assert!(configs.iter().any(|c| c.rope_scaling.is_none()));
    assert!(configs.iter().any(|c| c.tie_word_embeddings));
    assert!(configs.iter().any(|c| !c.tie_word_embeddings));
    let mut groups: Vec<_> = configs
        .iter()
        .map(|c| c.num_heads / c.num_kv_heads)
        .collect();
    groups.sort();
    groups.dedup();
    assert_eq!(groups, vec![1, 2, 3]);
    let arch = |a: &str| configs.iter().filter(|c| c.architecture == a).count();
    assert_eq!(arch("LlamaForCausalLM"), 3);
    assert_eq!(arch("Qwen3ForCausalLM"), 2);
    assert_eq!(arch("Qwen2ForCausalLM"), 1);
    let qwen3: Vec<_> = configs.iter().filter(|c| c.qk_norm).collect();
    assert!(qwen3.iter().any(|c| c.tie_word_embeddings));
    assert!(qwen3.iter().any(|c| !c.tie_word_embeddings));
    // Qwen3's head_dim is its own setting, not hidden / heads.
    assert!(qwen3
        .iter()
        .all(|c| c.head_dim * c.num_heads != c.hidden_size));
    assert!(configs.iter().any(|c| c.qkv_bias && !c.qk_norm));
    // Both config spellings: transformers 5 (`rope_parameters`) and 4.x (`rope_theta`).
    let mut v4 = 0;
    for case in &goldens.cases {
        let raw = std::fs::read_to_string(fixtures().join(&case.dir).join("config.json")).unwrap();
        if !raw.contains("rope_parameters") {
            assert!(
                raw.contains("\"rope_theta\""),
                "{}: no RoPE settings",
                case.dir
            );
            v4 += 1;
        }
    }
    assert_eq!(v4, 1, "one case is written in the transformers 4.x form");
    assert_eq!(
        goldens.cases.iter().filter(|c| c.greedy.is_some()).count(),
        1
    );
    assert_eq!(goldens.cases.iter().filter(|c| c.chat.is_some()).count(), 1);
}

/// Steps whose top-2 margin in transformers' logits is below this are near-ties: f32
/// summation order may pick either token there, so the comparison stops at the first one.
/// The logits of these cases differ from transformers by ~1e-5 relative, ~1e-4 absolute.
const NEAR_TIE: f32 = 1e-2;

/// `megainfer run --json` on the CPU, greedy, continues the prompt exactly as transformers did.
#[test]
fn run_json_greedy_ids_match_transformers() {
    let goldens = goldens();
    let case = goldens.cases.iter().find(|c| c.greedy.is_some()).unwrap();
    let g = case.greedy.as_ref().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_megainfer"))
        .args([
            "run",
            "--device",
            "cpu",
            "--json",
            "--temperature",
            "0",
            "-p",
        ])
        .arg(&g.prompt)
        .arg("-n")
        .arg(g.generated_ids.len().to_string())
        .arg("-m")
        .arg(fixtures().join(&case.dir))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "megainfer run failed: {stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let ids = |key: &str| -> Vec<u32> { serde_json::from_value(v[key].clone()).unwrap() };
    assert_eq!(
        ids("prompt_ids"),
        g.prompt_ids,
        "{}: prompt tokens",
        case.dir
    );
    let ours = ids("generated_ids");
    let checked = g
        .margins
        .iter()
        .position(|&m| m < NEAR_TIE)
        .unwrap_or(g.margins.len());
    println!(
        "{}: transformers {:?}\n{}: megainfer    {:?}\ncompared the first {checked} of {} \
         (smallest margin there {:.3})",
        case.dir,
        g.generated_ids,
        case.dir,
        ours,
        g.generated_ids.len(),
        g.margins[..checked]
            .iter()
            .cloned()
            .fold(f32::INFINITY, f32::min)
    );
    assert!(checked >= 8, "too few steps before a near-tie to be a test");
    assert!(ours.len() >= checked, "run stopped early: {ours:?}");
    assert_eq!(ours[..checked], g.generated_ids[..checked], "{}", case.dir);
}

/// Our chat template rendering of a two-turn conversation equals `apply_chat_template`'s.
#[test]
fn chat_template_renders_as_transformers_does() {
    let goldens = goldens();
    let case = goldens.cases.iter().find(|c| c.chat.is_some()).unwrap();
    let chat = case.chat.as_ref().unwrap();
    let model = megainfer::model::load(&fixtures().join(&case.dir)).unwrap();
    let tok = model.tokenizer.as_ref().unwrap();
    let template = tok.chat_template.as_deref().unwrap();
    let name = |id: Option<u32>| {
        id.and_then(|i| tok.inner.id_to_token(i))
            .unwrap_or_default()
    };
    let messages: Vec<ChatMessage> = chat
        .messages
        .iter()
        .map(|m| ChatMessage::new(m.role.clone(), m.content.clone()))
        .collect();
    assert!(messages.iter().filter(|m| m.role == "assistant").count() >= 1);
    let ours = chat::render(
        template,
        &messages,
        &name(tok.bos_token_id),
        &name(tok.eos_token_ids.first().copied()),
        chat.add_generation_prompt,
    )
    .unwrap();
    println!("{ours}");
    assert_eq!(ours, chat.rendered);
}

/// A copy of a golden case's directory whose `config.json` is edited by `edit`.
fn with_config(
    case: &str,
    edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>),
) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixtures().join(case)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
    }
    let path = dir.path().join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(cfg.as_object_mut().unwrap());
    std::fs::write(&path, cfg.to_string()).unwrap();
    dir
}

/// Weights that do not fit the architecture are named tensor by tensor: Qwen2 weights under a
/// Qwen3 config lack the norms and carry biases; Qwen3 weights under a Llama config carry norms.
#[test]
fn qwen_weights_under_the_wrong_architecture_are_named() {
    let dir = with_config("qwen2_bias_gqa2", |c| {
        c.insert(
            "architectures".into(),
            serde_json::json!(["Qwen3ForCausalLM"]),
        );
        c.insert("model_type".into(), serde_json::json!("qwen3"));
    });
    let err = format!("{:#}", megainfer::model::load(dir.path()).err().unwrap());
    println!("{err}");
    for want in [
        "tensor model.layers.0.self_attn.q_norm.weight is missing",
        "tensor model.layers.1.self_attn.k_norm.weight is missing",
        "unexpected tensor model.layers.0.self_attn.q_proj.bias",
    ] {
        assert!(err.contains(want), "missing {want:?} in: {err}");
    }
    let dir = with_config("qwen3_tied_hd32", |c| {
        c.insert(
            "architectures".into(),
            serde_json::json!(["LlamaForCausalLM"]),
        );
        c.insert("model_type".into(), serde_json::json!("llama"));
    });
    let err = format!("{:#}", megainfer::model::load(dir.path()).err().unwrap());
    println!("{err}");
    assert!(
        err.contains("unexpected tensor model.layers.0.self_attn.k_norm.weight"),
        "{err}"
    );
}

fn run_cli(dir: &Path, device: &str) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_megainfer"))
        .args([
            "run",
            "--json",
            "-n",
            "2",
            "-p",
            "the river",
            "--device",
            device,
            "-m",
        ])
        .arg(dir)
        .output()
        .unwrap()
}

/// Without a GPU, `--device auto` runs a Qwen model on the CPU reference.
#[test]
fn qwen_models_run_on_the_cpu_without_a_gpu() {
    if !megainfer::gpu::available() {
        let out = run_cli(&fixtures().join("qwen3_untied_gqa3"), "auto");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stderr}");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["path"], serde_json::json!("cpu-reference"));
    }
}

/// A golden Qwen case written as llama.cpp lays out a `qwen2` / `qwen3` GGUF: `<arch>.*` keys,
/// `blk.N.attn_{q,k}_norm.weight` and `attn_{q,k,v}.bias`, Q/K rows in HF order (llama.cpp
/// rotates these architectures NEOX-style, so its converter does not permute them). Loaded
/// from the GGUF, the CPU reference must still match transformers.
#[test]
fn qwen_gguf_files_match_transformers_goldens() {
    use gguf_writer::{Gguf, Val};
    let goldens = goldens();
    for (case, arch) in [("qwen3_tied_hd32", "qwen3"), ("qwen2_bias_gqa2", "qwen2")] {
        let golden = goldens.cases.iter().find(|c| c.dir == case).unwrap();
        let hf = megainfer::model::load(&fixtures().join(case)).unwrap();
        let (c, w) = (&hf.config, &hf.weights);
        let mut g = Gguf::default();
        let key = |k: &str| format!("{arch}.{k}");
        g.set("general.architecture", Val::Str(arch.into()))
            .set("general.alignment", Val::U32(32))
            .set(&key("block_count"), Val::U32(c.num_layers as u32))
            .set(
                &key("context_length"),
                Val::U32(c.max_position_embeddings as u32),
            )
            .set(&key("embedding_length"), Val::U32(c.hidden_size as u32))
            .set(
                &key("feed_forward_length"),
                Val::U32(c.intermediate_size as u32),
            )
            .set(&key("attention.head_count"), Val::U32(c.num_heads as u32))
            .set(
                &key("attention.head_count_kv"),
                Val::U32(c.num_kv_heads as u32),
            )
            .set(&key("attention.key_length"), Val::U32(c.head_dim as u32))
            .set(&key("attention.value_length"), Val::U32(c.head_dim as u32))
            .set(&key("rope.freq_base"), Val::F32(c.rope_theta))
            .set(
                &key("attention.layer_norm_rms_epsilon"),
                Val::F32(c.rms_norm_eps),
            )
            .set(&key("vocab_size"), Val::U32(c.vocab_size as u32));
        // F32 (type 0) holds the bf16 weights exactly; GGUF dims are innermost first.
        let mut add = |name: String, t: &[half::bf16], rows: usize| {
            let cols = t.len() / rows;
            let dims: Vec<u64> = if rows == 1 {
                vec![cols as u64]
            } else {
                vec![cols as u64, rows as u64]
            };
            let data = t.iter().flat_map(|x| x.to_f32().to_le_bytes()).collect();
            g.add_tensor(&name, &dims, 0, data);
        };
        let (h, q, kv, f) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        add(
            "token_embd.weight".into(),
            w.embed.as_bf16().unwrap(),
            c.vocab_size,
        );
        add("output_norm.weight".into(), &w.final_norm, 1);
        if let Some(head) = &w.lm_head {
            add(
                "output.weight".into(),
                head.as_bf16().unwrap(),
                c.vocab_size,
            );
        }
        for (l, lw) in w.layers.iter().enumerate() {
            let n = |s: &str| format!("blk.{l}.{s}");
            add(n("attn_norm.weight"), &lw.attn_norm, 1);
            add(n("attn_q.weight"), lw.wq.as_bf16().unwrap(), q);
            add(n("attn_k.weight"), lw.wk.as_bf16().unwrap(), kv);
            add(n("attn_v.weight"), lw.wv.as_bf16().unwrap(), kv);
            add(n("attn_output.weight"), lw.wo.as_bf16().unwrap(), h);
            add(n("ffn_norm.weight"), &lw.ffn_norm, 1);
            add(n("ffn_gate.weight"), lw.w_gate.as_bf16().unwrap(), f);
            add(n("ffn_up.weight"), lw.w_up.as_bf16().unwrap(), f);
            add(n("ffn_down.weight"), lw.w_down.as_bf16().unwrap(), h);
            if let (Some(qn), Some(kn)) = (&lw.q_norm, &lw.k_norm) {
                add(n("attn_q_norm.weight"), qn, 1);
                add(n("attn_k_norm.weight"), kn, 1);
            }
            if let Some(b) = &lw.qkv_bias {
                add(n("attn_q.bias"), &b.q, 1);
                add(n("attn_k.bias"), &b.k, 1);
                add(n("attn_v.bias"), &b.v, 1);
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(format!("{case}.gguf"));
        std::fs::write(&path, g.to_bytes()).unwrap();
        let model = megainfer::model::load(&path).unwrap();
        let mc = &model.config;
        assert_eq!(
            (mc.qk_norm, mc.qkv_bias, mc.head_dim),
            (c.qk_norm, c.qkv_bias, c.head_dim),
            "{case}"
        );
        let got = CpuForward::new(mc, &model.weights, golden.tokens.len())
            .forward_all(&golden.tokens)
            .unwrap();
        let worst = got
            .iter()
            .zip(&golden.logits)
            .map(|(g, w)| rel_l2(g, w))
            .fold(0f64, f64::max);
        let tol = tolerance(case);
        println!("{case} from GGUF ({arch}): worst rel L2 {worst:.2e} (tolerance {tol:.1e})");
        assert!(worst <= tol, "{case} from GGUF: {worst:.2e} > {tol:.1e}");

        // The same file without one norm names the missing tensor.
        if arch == "qwen3" {
            g.remove_tensor("blk.1.attn_k_norm.weight");
            std::fs::write(&path, g.to_bytes()).unwrap();
            let err = format!("{:#}", megainfer::model::load(&path).err().unwrap());
            assert!(
                err.contains("'blk.1.attn_k_norm.weight' is missing"),
                "{err}"
            );
        }
    }
}

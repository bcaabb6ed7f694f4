//! The GGUF loader on the default model (SmolLM2-135M-Instruct Q4_1): metadata, tensor
//! directory, dequantization checked against a decoder written independently here, the Q/K
//! unpermute, the tokenizer, and greedy text from the CPU reference forward.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use half::bf16;
use megainfer::model::gguf::{self, dequantize, dequantize_f32, GgmlType, GgufFile};
use megainfer::model::{Matrix, Model};
use megainfer::reference::CpuForward;
use megainfer::tokenizer::Tokenizer;

fn path() -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| megainfer::fetch::default_model().expect("default model"))
}

fn file() -> &'static GgufFile {
    static FILE: OnceLock<GgufFile> = OnceLock::new();
    FILE.get_or_init(|| GgufFile::open(path()).expect("open the default model"))
}

fn model() -> &'static Model {
    static MODEL: OnceLock<Model> = OnceLock::new();
    MODEL.get_or_init(|| {
        let start = std::time::Instant::now();
        let m = megainfer::model::load(path()).expect("load the default model");
        eprintln!("loaded {} in {:.2?}", path().display(), start.elapsed());
        m
    })
}

fn tokenizer() -> &'static Tokenizer {
    model()
        .tokenizer
        .as_ref()
        .expect("the GGUF carries a tokenizer")
}

// ---- an independent decoder: per element, straight from the ggml block layouts, in f64 ----

fn half_bits_to_f64(bits: u16) -> f64 {
    let sign = if bits & 0x8000 != 0 { -1.0 } else { 1.0 };
    let exponent = i32::from((bits >> 10) & 0x1f);
    let mantissa = f64::from(bits & 0x3ff);
    match exponent {
        0 => sign * mantissa * 2f64.powi(-24),
        31 if mantissa == 0.0 => sign * f64::INFINITY,
        31 => f64::NAN,
        e => sign * (1.0 + mantissa / 1024.0) * 2f64.powi(e - 15),
    }
}

fn u16_at(bytes: &[u8], at: usize) -> u16 {
    u16::from(bytes[at]) | (u16::from(bytes[at + 1]) << 8)
}

/// Element `k` of a tensor: find its block, then its quant within the block.
fn reference_element(ty: GgmlType, bytes: &[u8], k: usize) -> f64 {
    let nibble = |qs: usize, pos: usize| -> u8 {
        if pos < 16 {
            bytes[qs + pos] & 0x0f
        } else {
            bytes[qs + pos - 16] >> 4
        }
    };
    let (block, pos) = (k / 32, k % 32);
    match ty {
        GgmlType::F32 => f64::from(f32::from_bits(u32::from_le_bytes(
            bytes[4 * k..4 * k + 4].try_into().unwrap(),
        ))),
        GgmlType::F16 => half_bits_to_f64(u16_at(bytes, 2 * k)),
        GgmlType::BF16 => f64::from(f32::from_bits(u32::from(u16_at(bytes, 2 * k)) << 16)),
        GgmlType::Q8_0 => {
            let b = block * 34;
            half_bits_to_f64(u16_at(bytes, b)) * f64::from(bytes[b + 2 + pos] as i8)
        }
        GgmlType::Q4_0 => {
            let b = block * 18;
            half_bits_to_f64(u16_at(bytes, b)) * (f64::from(nibble(b + 2, pos)) - 8.0)
        }
        GgmlType::Q4_1 => {
            let b = block * 20;
            let (d, m) = (
                half_bits_to_f64(u16_at(bytes, b)),
                half_bits_to_f64(u16_at(bytes, b + 2)),
            );
            d * f64::from(nibble(b + 4, pos)) + m
        }
        other => panic!("no reference decoder for {other}"),
    }
}

/// Our bf16 must be the reference value rounded to bf16 (one bf16 step of slack for the f32
/// arithmetic in between).
fn assert_matches_reference(what: &str, ty: GgmlType, bytes: &[u8], ours: &[bf16]) {
    for (k, &got) in ours.iter().enumerate() {
        let want = reference_element(ty, bytes, k);
        let got = f64::from(got.to_f32());
        let tol = want.abs() / 256.0 + 1e-7;
        assert!(
            (got - want).abs() <= tol,
            "{what}: element {k}: got {got}, reference {want}"
        );
    }
}

/// A matrix kept as the file's blocks: stored as `ty`, and decoded to exactly the reference
/// decoder's values (an f16 times a small integer is exact in f32; Q4_1's added minimum rounds
/// once).
fn assert_matrix_matches_reference(what: &str, ty: GgmlType, bytes: &[u8], ours: &Matrix) {
    assert_eq!(ours.ty().name(), ty.name(), "{what}: storage type");
    assert_eq!(
        ours.blocks().map(|(_, b)| b.len()),
        Some(bytes.len()),
        "{what}: bytes"
    );
    for (k, &got) in ours.to_f32().iter().enumerate() {
        let want = reference_element(ty, bytes, k);
        let tol = want.abs() * 1.2e-7 + 1e-12;
        assert!(
            (f64::from(got) - want).abs() <= tol,
            "{what}: element {k}: got {got}, reference {want}"
        );
    }
}

// ---- metadata and directory ----

#[test]
fn metadata_gives_the_smollm2_config() {
    let c = &model().config;
    assert_eq!(c.architecture, "llama");
    assert_eq!(c.num_layers, 30);
    assert_eq!(c.hidden_size, 576);
    assert_eq!(c.num_heads, 9);
    assert_eq!(c.num_kv_heads, 3);
    assert_eq!(c.head_dim, 64);
    assert_eq!(c.intermediate_size, 1536);
    assert_eq!(c.vocab_size, 49152);
    assert_eq!(c.rope_theta, 100_000.0);
    assert_eq!(c.max_position_embeddings, 8192);
    assert!((c.rms_norm_eps - 1e-5).abs() < 1e-9, "{}", c.rms_norm_eps);
    assert_eq!(c.bos_token_id, Some(1));
    assert_eq!(c.eos_token_ids, vec![2]);
    assert!(c.tie_word_embeddings);
    assert_eq!(c.rope_scaling, None);
    assert_eq!(c.rope_freq_divisors, None);

    let f = file();
    assert_eq!(f.version(), 3);
    assert_eq!(f.alignment(), 32);
    assert_eq!(f.data_start() % 32, 0);
    let m = f.metadata();
    assert_eq!(m.req_str("general.architecture").unwrap(), "llama");
    assert_eq!(m.opt_u64("general.quantization_version").unwrap(), Some(2));
    assert_eq!(m.req_str("tokenizer.ggml.pre").unwrap(), "smollm");
    assert_eq!(
        m.req_string_array("tokenizer.ggml.tokens").unwrap()[1],
        "<|im_start|>"
    );
    assert_eq!(
        m.req_string_array("tokenizer.ggml.merges").unwrap()[0],
        "Ġ t"
    );
    let types = m
        .opt_int_array("tokenizer.ggml.token_type")
        .unwrap()
        .unwrap();
    assert_eq!(types.iter().filter(|&&t| t == 3).count(), 17);
}

#[test]
fn tensor_directory_has_the_expected_shapes_and_types() {
    let f = file();
    assert_eq!(f.tensors().len(), 2 + 30 * 9);
    let check = |name: &str, dims: &[usize], ty: GgmlType| {
        let t = f.tensor(name).unwrap_or_else(|| panic!("{name} missing"));
        assert_eq!(t.dims, dims, "{name}");
        assert_eq!(t.ty, ty, "{name}");
        assert_eq!(t.n_elements, dims.iter().product::<usize>(), "{name}");
        assert_eq!(
            t.n_bytes,
            t.n_elements / ty.block_size() * ty.type_size(),
            "{name}"
        );
        assert_eq!((t.start - f.data_start()) % 32, 0, "{name}");
    };
    check("token_embd.weight", &[576, 49152], GgmlType::Q8_0);
    check("output_norm.weight", &[576], GgmlType::F32);
    for l in [0, 17, 29] {
        let n = |s: &str| format!("blk.{l}.{s}.weight");
        check(&n("attn_norm"), &[576], GgmlType::F32);
        check(&n("ffn_norm"), &[576], GgmlType::F32);
        check(&n("attn_q"), &[576, 576], GgmlType::Q4_1);
        check(&n("attn_k"), &[576, 192], GgmlType::Q4_1);
        check(&n("attn_v"), &[576, 192], GgmlType::Q4_1);
        check(&n("attn_output"), &[576, 576], GgmlType::Q4_1);
        check(&n("ffn_gate"), &[576, 1536], GgmlType::Q4_1);
        check(&n("ffn_up"), &[576, 1536], GgmlType::Q4_1);
        check(&n("ffn_down"), &[1536, 576], GgmlType::Q4_1);
    }
    assert!(f.tensor("output.weight").is_none());

    let w = &model().weights;
    assert!(w.lm_head.is_none());
    assert_eq!(w.embed.len(), 49152 * 576);
    assert_eq!(w.layers.len(), 30);
    assert_eq!(w.layers[3].wk.len(), 192 * 576);
    assert_eq!(w.layers[3].w_down.len(), 576 * 1536);
    assert_eq!(w.final_norm.len(), 576);
}

// ---- dequantization ----

#[test]
fn q4_1_layer_weights_match_the_reference_decoder() {
    let f = file();
    for l in [0, 15, 29] {
        let lw = &model().weights.layers[l];
        for (name, ours) in [
            ("attn_v", &lw.wv),
            ("attn_output", &lw.wo),
            ("ffn_gate", &lw.w_gate),
            ("ffn_up", &lw.w_up),
            ("ffn_down", &lw.w_down),
        ] {
            let name = format!("blk.{l}.{name}.weight");
            let bytes = f.tensor_data(&name).unwrap();
            assert_matrix_matches_reference(&name, GgmlType::Q4_1, bytes, ours);
        }
    }
}

#[test]
fn q8_0_embedding_matches_the_reference_decoder() {
    let bytes = file().tensor_data("token_embd.weight").unwrap();
    assert_matrix_matches_reference(
        "token_embd.weight",
        GgmlType::Q8_0,
        bytes,
        &model().weights.embed,
    );
}

#[test]
fn f32_norms_match_the_reference_decoder() {
    let f = file();
    let w = &model().weights;
    let bytes = f.tensor_data("output_norm.weight").unwrap();
    assert_matches_reference("output_norm", GgmlType::F32, bytes, &w.final_norm);
    for l in [0, 29] {
        let name = format!("blk.{l}.attn_norm.weight");
        let bytes = f.tensor_data(&name).unwrap();
        assert_matches_reference(&name, GgmlType::F32, bytes, &w.layers[l].attn_norm);
        let name = format!("blk.{l}.ffn_norm.weight");
        let bytes = f.tensor_data(&name).unwrap();
        assert_matches_reference(&name, GgmlType::F32, bytes, &w.layers[l].ffn_norm);
    }
    // The f32 path keeps full precision.
    let exact = dequantize_f32(GgmlType::F32, bytes, 576).unwrap();
    for (k, v) in exact.iter().enumerate() {
        assert_eq!(f64::from(*v), reference_element(GgmlType::F32, bytes, k));
    }
}

fn bf16s(xs: &[f32]) -> Vec<bf16> {
    xs.iter().map(|&x| bf16::from_f32(x)).collect()
}

#[test]
fn hand_built_q4_0_block() {
    // d = 0.5; low nibbles j, high nibbles 15 - j.
    let mut block = vec![0x00, 0x38];
    block.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    let got = dequantize(GgmlType::Q4_0, &block, 32).unwrap();
    let mut want: Vec<f32> = (0..16).map(|j| (j as f32 - 8.0) * 0.5).collect();
    want.extend((0..16).map(|j| (7.0 - j as f32) * 0.5));
    assert_eq!(got, bf16s(&want));
    assert_matches_reference("q4_0", GgmlType::Q4_0, &block, &got);
}

#[test]
fn hand_built_q4_1_block() {
    // d = 0.25, m = -1.0.
    let mut block = vec![0x00, 0x34, 0x00, 0xbc];
    block.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    let got = dequantize(GgmlType::Q4_1, &block, 32).unwrap();
    let mut want: Vec<f32> = (0..16).map(|j| j as f32 * 0.25 - 1.0).collect();
    want.extend((0..16).map(|j| (15 - j) as f32 * 0.25 - 1.0));
    assert_eq!(got, bf16s(&want));
}

#[test]
fn hand_built_q8_0_blocks() {
    // Two blocks: d = 0.125 then d = -2.0; quants -128, -119, ..., 151 wrapped to i8.
    let mut bytes = Vec::new();
    for d in [[0x00, 0x30], [0x00, 0xc0]] {
        bytes.extend(d);
        bytes.extend((0..32).map(|k: i32| ((k * 9 - 128) as i8) as u8));
    }
    let got = dequantize(GgmlType::Q8_0, &bytes, 64).unwrap();
    let want: Vec<f32> = (0..64)
        .map(|k| {
            let d = if k < 32 { 0.125 } else { -2.0 };
            f32::from(((k % 32) * 9 - 128) as i8) * d
        })
        .collect();
    assert_eq!(got, bf16s(&want));
    assert_matches_reference("q8_0", GgmlType::Q8_0, &bytes, &got);
}

#[test]
fn hand_built_f16_bf16_f32() {
    // 1, -2, 65504 (max f16), 2^-24 (smallest subnormal), 0x3555 (~1/3), -0.
    let f16_bits: [u16; 6] = [0x3c00, 0xc000, 0x7bff, 0x0001, 0x3555, 0x8000];
    let bytes: Vec<u8> = f16_bits.iter().flat_map(|b| b.to_le_bytes()).collect();
    let got = dequantize(GgmlType::F16, &bytes, 6).unwrap();
    let want = [1.0, -2.0, 65504.0, 2f32.powi(-24), 0.333_251_95, -0.0];
    assert_eq!(got, bf16s(&want));
    assert_matches_reference("f16", GgmlType::F16, &bytes, &got);

    let bf16_bits: [u16; 4] = [0x3f80, 0xc2f7, 0x0001, 0x7f80];
    let bytes: Vec<u8> = bf16_bits.iter().flat_map(|b| b.to_le_bytes()).collect();
    let got = dequantize(GgmlType::BF16, &bytes, 4).unwrap();
    assert_eq!(
        got.iter().map(|b| b.to_bits()).collect::<Vec<_>>(),
        bf16_bits
    );

    let values = [1.5f32, -3.25e-3, 1e10, 1.0 + 2f32.powi(-9)];
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    assert_eq!(
        dequantize(GgmlType::F32, &bytes, 4).unwrap(),
        bf16s(&values)
    );
    assert_eq!(dequantize_f32(GgmlType::F32, &bytes, 4).unwrap(), values);
}

#[test]
fn dequantize_rejects_unsupported_types_and_wrong_sizes() {
    let e = dequantize(GgmlType::Q4_K, &[0; 144], 256)
        .unwrap_err()
        .to_string();
    assert!(e.contains("Q4_K") && e.contains("not supported"), "{e}");
    let e = dequantize(GgmlType::Q8_0, &[0; 33], 32)
        .unwrap_err()
        .to_string();
    assert!(e.contains("33 bytes"), "{e}");
    let e = dequantize(GgmlType::Q4_1, &[0; 20], 31)
        .unwrap_err()
        .to_string();
    assert!(e.contains("31 elements"), "{e}");
}

// ---- Q/K unpermute ----

/// What llama.cpp's converter does to HF Q/K rows: `w.reshape(n_head, 2, hd/2, cols)
/// .swapaxes(1, 2)`, i.e. output row (h, i, j) is input row (h, j, i).
fn permute_like_the_converter(w: &[bf16], n_head: usize, hd: usize, cols: usize) -> Vec<bf16> {
    let mut out = Vec::with_capacity(w.len());
    for h in 0..n_head {
        for i in 0..hd / 2 {
            for j in 0..2 {
                let src = h * hd + j * (hd / 2) + i;
                out.extend_from_slice(&w[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

#[test]
fn q_and_k_rows_are_unpermuted_to_hf_order() {
    let (f, m) = (file(), model());
    let c = &m.config;
    for l in [0, 29] {
        let lw = &m.weights.layers[l];
        for (name, ours, heads) in [
            ("attn_q", &lw.wq, c.num_heads),
            ("attn_k", &lw.wk, c.num_kv_heads),
        ] {
            let name = format!("blk.{l}.{name}.weight");
            let t = f.tensor(&name).unwrap();
            let raw = dequantize(t.ty, f.tensor_data(&name).unwrap(), t.n_elements).unwrap();
            // Widened as `--dtype bf16` widens it: rounded once from the exact values, as the
            // file's dequantisation to bf16 rounds them.
            let ours = ours.to_bf16();
            let ours = ours.as_bf16().unwrap();
            assert_ne!(raw, ours, "{name}: rows were not reordered");
            let back = permute_like_the_converter(ours, heads, c.head_dim, c.hidden_size);
            assert!(
                back == raw,
                "{name}: permuting back does not give the file's rows"
            );
        }
        // V is not permuted by the converter.
        let name = format!("blk.{l}.attn_v.weight");
        let t = f.tensor(&name).unwrap();
        let raw = dequantize(t.ty, f.tensor_data(&name).unwrap(), t.n_elements).unwrap();
        assert!(raw == lw.wv.to_bf16().as_bf16().unwrap(), "{name}");
    }
}

#[test]
fn unpermute_on_a_labelled_matrix() {
    // Two heads of head_dim 4, one column: GGUF rows (i, j) = (0,0) (0,1) (1,0) (1,1) go to
    // HF rows 0, 2, 1, 3.
    let w = bf16s(&[0.0, 1.0, 2.0, 3.0, 10.0, 11.0, 12.0, 13.0]);
    let hf = gguf::unpermute_qk_rows(&w, 2, 4, 1);
    assert_eq!(hf, bf16s(&[0.0, 2.0, 1.0, 3.0, 10.0, 12.0, 11.0, 13.0]));
    assert_eq!(permute_like_the_converter(&hf, 2, 4, 1), w);
}

// ---- tokenizer ----

#[test]
fn tokenizer_settings_come_from_the_metadata() {
    let t = tokenizer();
    assert_eq!(t.bos_token_id, Some(1));
    assert_eq!(t.eos_token_ids, vec![2]);
    assert!(!t.add_bos);
    assert_eq!(t.vocab_size(), 49152);
    let template = t.chat_template.as_deref().unwrap();
    assert!(template.contains("<|im_start|>"), "{template}");
}

#[test]
fn encodes_the_reference_prompt() {
    let ids = tokenizer().encode("The capital of France is").unwrap();
    assert_eq!(ids, vec![504, 3575, 282, 4649, 314]);
}

#[test]
fn round_trips_real_text() {
    let t = tokenizer();
    for text in [
        "The capital of France is Paris.",
        "naïve café 日本語 🙂",
        "12345 and 3.14159",
        "line one\nline two\n\n\tindented  double  spaces ",
        "fn main() { println!(\"héllo\"); }",
        "",
    ] {
        let ids = t.encode(text).unwrap();
        assert_eq!(t.decode(&ids).unwrap(), text, "ids {ids:?}");
    }
    // smollm splits every digit on its own.
    let ids = t.encode("12345").unwrap();
    assert_eq!(ids.len(), 5, "{ids:?}");
    for (id, digit) in ids.iter().zip(["1", "2", "3", "4", "5"]) {
        assert_eq!(t.decode(&[*id]).unwrap(), digit);
    }
}

#[test]
fn control_tokens_encode_to_their_ids() {
    let t = tokenizer();
    let text = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n";
    let ids = t.encode(text).unwrap();
    assert_eq!(ids[0], 1);
    assert!(ids.contains(&2), "{ids:?}");
    assert_eq!(ids.iter().filter(|&&i| i <= 16).count(), 2, "{ids:?}");
    let user = t.encode("user\n").unwrap();
    assert_eq!(ids[1..1 + user.len()], user[..]);
    assert_eq!(t.inner.decode(&ids, false).unwrap(), text);
    // Decoding for display drops them.
    assert_eq!(t.decode(&ids).unwrap(), "user\nWhat is 2+2?\n");
}

// ---- end to end ----

#[test]
fn greedy_generation_says_paris() {
    let m = model();
    let t = tokenizer();
    let prompt = t.encode("The capital of France is").unwrap();
    let mut forward = CpuForward::new(&m.config, &m.weights, 64);
    let mut logits = forward.forward(&prompt).unwrap();
    let mut generated = Vec::new();
    for _ in 0..4 {
        let next = logits
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i as u32)
            .unwrap();
        generated.push(next);
        logits = forward.forward(&[next]).unwrap();
    }
    let text = t.decode(&generated).unwrap();
    assert!(
        text.starts_with(" Paris"),
        "greedy continuation {text:?} ({generated:?})"
    );
}

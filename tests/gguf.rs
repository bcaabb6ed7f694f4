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
        GgmlType::Q5_0 | GgmlType::Q5_1 => {
            let (size, scales) = if ty == GgmlType::Q5_0 {
                (22, 2)
            } else {
                (24, 4)
            };
            let b = block * size;
            let d = half_bits_to_f64(u16_at(bytes, b));
            let fifth = u32::from_le_bytes(bytes[b + scales..b + scales + 4].try_into().unwrap());
            let q = f64::from(nibble(b + scales + 4, pos)) + 16.0 * f64::from((fifth >> pos) & 1);
            if ty == GgmlType::Q5_0 {
                d * (q - 16.0)
            } else {
                d * q + half_bits_to_f64(u16_at(bytes, b + 2))
            }
        }
        GgmlType::Q4_K | GgmlType::Q5_K => {
            let size = if ty == GgmlType::Q4_K { 144 } else { 176 };
            let (b, pos) = ((k / 256) * size, k % 256);
            let sub = pos / 32;
            let (d, dmin) = (
                half_bits_to_f64(u16_at(bytes, b)),
                half_bits_to_f64(u16_at(bytes, b + 2)),
            );
            // Twelve bytes of 6-bit scales and minimums: sub-blocks 0-3 in the low six bits of
            // bytes 0-3 (scales) and 4-7 (minimums); sub-blocks 4-7 split four low bits in
            // bytes 8-11 (scale below, minimum above) and two high bits in the top of bytes
            // 0-3 (scales) and 4-7 (minimums).
            let p = |i: usize| u32::from(bytes[b + 4 + i]);
            let (scale, min) = if sub < 4 {
                (p(sub) % 64, p(sub + 4) % 64)
            } else {
                (
                    p(sub + 4) % 16 + 16 * (p(sub - 4) / 64),
                    p(sub + 4) / 16 + 16 * (p(sub) / 64),
                )
            };
            let byte = bytes[b + size - 128 + 32 * (pos / 64) + pos % 32];
            let mut q = f64::from(if pos % 64 < 32 { byte % 16 } else { byte / 16 });
            if ty == GgmlType::Q5_K {
                q += 16.0 * f64::from((bytes[b + 16 + pos % 32] >> sub) & 1);
            }
            d * f64::from(scale) * q - dmin * f64::from(min)
        }
        GgmlType::Q6_K => {
            let (b, pos) = ((k / 256) * 210, k % 256);
            let (half, r) = (pos / 128, pos % 128);
            let byte = bytes[b + 64 * half + r % 64];
            let low = if r < 64 { byte % 16 } else { byte / 16 };
            let top = (bytes[b + 128 + 32 * half + r % 32] >> (2 * (r / 32))) % 4;
            let scale = bytes[b + 192 + 8 * half + r / 16] as i8;
            let d = half_bits_to_f64(u16_at(bytes, b + 208));
            d * f64::from(scale) * (f64::from(low) + 16.0 * f64::from(top) - 32.0)
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

/// Pseudo-random bytes, with each block's f16 scales (`scales` at these offsets in blocks of
/// `size`) set to moderate values of either sign.
fn random_blocks(blocks: usize, size: usize, scales: &[usize], seed: u64) -> Vec<u8> {
    let mut x = seed;
    let mut next = move || {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (x >> 33) as u32
    };
    let mut bytes: Vec<u8> = (0..blocks * size).map(|_| next() as u8).collect();
    for block in 0..blocks {
        for &at in scales {
            // Exponent 5..=14 (2^-10 .. 2^-1), any mantissa, either sign.
            let bits = ((next() % 2) << 15) | ((5 + next() % 10) << 10) | (next() % 1024);
            bytes[block * size + at..][..2].copy_from_slice(&(bits as u16).to_le_bytes());
        }
    }
    bytes
}

/// `dequantize_f32` against the reference decoder (to 1e-6 of the tensor's largest value:
/// the f32 arithmetic's rounding, far below one quant step), and `dequantize` its values
/// rounded to bf16.
fn assert_decodes_like_reference(ty: GgmlType, bytes: &[u8], n: usize) {
    let want: Vec<f64> = (0..n).map(|k| reference_element(ty, bytes, k)).collect();
    let largest = want.iter().fold(0f64, |m, w| m.max(w.abs()));
    let got = dequantize_f32(ty, bytes, n).unwrap();
    for (k, (&g, &w)) in got.iter().zip(&want).enumerate() {
        assert!(
            (f64::from(g) - w).abs() <= 1e-6 * largest,
            "{ty}: element {k}: got {g}, reference {w}"
        );
    }
    let widened = dequantize(ty, bytes, n).unwrap();
    assert_eq!(widened, bf16s(&got), "{ty}: bf16 values");
}

#[test]
fn five_bit_and_k_quant_blocks_decode_like_the_reference() {
    for (ty, size, scales) in [
        (GgmlType::Q5_0, 22, &[0][..]),
        (GgmlType::Q5_1, 24, &[0, 2][..]),
        (GgmlType::Q4_K, 144, &[0, 2][..]),
        (GgmlType::Q5_K, 176, &[0, 2][..]),
        (GgmlType::Q6_K, 210, &[208][..]),
    ] {
        let per_block = ty.block_size();
        for seed in 0..4 {
            let blocks = 3;
            let bytes = random_blocks(blocks, size, scales, seed);
            assert_eq!(ty.type_size(), size);
            assert_decodes_like_reference(ty, &bytes, blocks * per_block);
        }
        // Not a whole number of blocks, or the wrong byte count: errors, not panics.
        let bytes = random_blocks(2, size, scales, 9);
        assert!(dequantize(ty, &bytes, 2 * per_block - 1).is_err());
        assert!(dequantize(ty, &bytes[..size + 1], 2 * per_block).is_err());
    }
}

/// Q4_K as Q4_1 (what the loader keeps): the same quants under each sub-block's step and
/// minimum rounded to f16, every element within 2^-9 of its sub-block's largest magnitude of
/// the exact value; a step past f16's range refuses. Q5_0 as Q8_0: exactly the same values.
#[test]
fn k_and_five_bit_blocks_rewritten_as_native_blocks() {
    use megainfer::model::gguf::{q4_k_as_q4_1, q5_0_as_q8_0};
    use megainfer::model::quant::{dequantize_row, QuantType};
    let mut worst = 0f32;
    for seed in 0..4 {
        let bytes = random_blocks(4, 144, &[0, 2], seed);
        let exact = dequantize_f32(GgmlType::Q4_K, &bytes, 4 * 256).unwrap();
        let q4_1 = q4_k_as_q4_1(&bytes).expect("moderate scales rewrite");
        assert_eq!(q4_1.len(), 4 * 8 * 20);
        let mut kept = vec![0f32; 4 * 256];
        dequantize_row(QuantType::Q4_1, &q4_1, &mut kept);
        for (s, (e, k)) in exact.chunks(32).zip(kept.chunks(32)).enumerate() {
            let largest = e.iter().fold(0f32, |m, x| m.max(x.abs()));
            for (j, (e, k)) in e.iter().zip(k).enumerate() {
                worst = worst.max((e - k).abs() / largest);
                assert!(
                    (e - k).abs() <= largest / 512.0,
                    "seed {seed} sub-block {s} element {j}: {k} kept for {e}"
                );
            }
        }
    }
    println!("Q4_K as Q4_1: worst move {worst:.2e} of a sub-block's largest value");
    let mut huge = random_blocks(1, 144, &[0, 2], 7);
    huge[..2].copy_from_slice(&0x7bffu16.to_le_bytes()); // d = 65504: d * scale overflows f16
    huge[4] |= 63; // sub-block 0's scale: 63 (its top bits are sub-block 4's)
    assert!(q4_k_as_q4_1(&huge).is_none());
    assert!(q4_k_as_q4_1(&huge[..143]).is_none());

    let bytes = random_blocks(5, 22, &[0], 3);
    let q8 = q5_0_as_q8_0(&bytes).unwrap();
    let mut kept = vec![0f32; 5 * 32];
    dequantize_row(QuantType::Q8_0, &q8, &mut kept);
    assert_eq!(
        kept,
        dequantize_f32(GgmlType::Q5_0, &bytes, 5 * 32).unwrap()
    );
}

/// A Q4_K block packed from chosen codes (the writer's side of the layout): every element's
/// value is d * scale * q - dmin * min of its sub-block.
#[test]
fn hand_built_q4_k_block() {
    let scales: [u8; 8] = [1, 2, 3, 63, 17, 40, 0, 33];
    let mins: [u8; 8] = [0, 5, 63, 1, 48, 9, 21, 62];
    let q: Vec<u8> = (0..256u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 20) as u8 % 16)
        .collect();
    let mut block = vec![0x00, 0x3c, 0x00, 0x38]; // d = 1, dmin = 0.5
    let mut packed = [0u8; 12];
    for j in 0..4 {
        packed[j] = scales[j] | ((scales[j + 4] >> 4) << 6);
        packed[j + 4] = mins[j] | ((mins[j + 4] >> 4) << 6);
        packed[j + 8] = (scales[j + 4] & 15) | ((mins[j + 4] & 15) << 4);
    }
    block.extend(packed);
    for g in 0..4 {
        block.extend((0..32).map(|l| q[64 * g + l] | (q[64 * g + 32 + l] << 4)));
    }
    assert_eq!(block.len(), 144);
    let want: Vec<f32> = (0..256)
        .map(|i| f32::from(scales[i / 32]) * f32::from(q[i]) - 0.5 * f32::from(mins[i / 32]))
        .collect();
    assert_eq!(dequantize_f32(GgmlType::Q4_K, &block, 256).unwrap(), want);
    assert_decodes_like_reference(GgmlType::Q4_K, &block, 256);
}

/// Q6_K super-blocks as the engine's 32-element Q6_K blocks (what the loader keeps): 8 blocks
/// of 28 bytes each, every element the same f32 as GGUF's own decoding, bit for bit, on
/// pseudo-random super-blocks (any quants and sub-block scales, finite f16 `d`).
#[test]
fn q6_k_super_blocks_rewritten_as_32_element_blocks_exactly() {
    use megainfer::model::gguf::q6_k_as_blocks;
    use megainfer::model::quant::{dequantize_row, QuantType};
    for seed in 0..6 {
        let bytes = random_blocks(5, 210, &[208], seed);
        let exact = dequantize_f32(GgmlType::Q6_K, &bytes, 5 * 256).unwrap();
        let blocks = q6_k_as_blocks(&bytes);
        assert_eq!(blocks.len(), 5 * 8 * QuantType::Q6_K.block_bytes());
        // Each block repeats its super-block's d.
        for (i, b) in blocks.chunks_exact(28).enumerate() {
            assert_eq!(
                b[..2],
                bytes[210 * (i / 8) + 208..][..2],
                "seed {seed} block {i}"
            );
        }
        let mut kept = vec![0f32; 5 * 256];
        dequantize_row(QuantType::Q6_K, &blocks, &mut kept);
        assert_eq!(
            kept.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            exact.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "seed {seed}"
        );
    }
    assert!(q6_k_as_blocks(&[]).is_empty());
}

/// A Q6_K block packed from chosen codes: element i is d * scale[i / 16] * (q - 32).
#[test]
fn hand_built_q6_k_block() {
    let q: Vec<u8> = (0..256u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 20) as u8 % 64)
        .collect();
    let scales: Vec<i8> = (0..16).map(|j| (j * 9 - 70) as i8).collect();
    let (mut low, mut high) = (vec![0u8; 128], vec![0u8; 64]);
    for (i, &v) in q.iter().enumerate() {
        let (half, r) = (i / 128, i % 128);
        let nib = v & 15;
        low[64 * half + r % 64] |= if r < 64 { nib } else { nib << 4 };
        high[32 * half + r % 32] |= (v >> 4) << (2 * (r / 32));
    }
    let mut block = low;
    block.extend(high);
    block.extend(scales.iter().map(|&s| s as u8));
    block.extend([0x00, 0x34]); // d = 0.25
    assert_eq!(block.len(), 210);
    let want: Vec<f32> = (0..256)
        .map(|i| 0.25 * f32::from(scales[i / 16]) * (f32::from(q[i]) - 32.0))
        .collect();
    assert_eq!(dequantize_f32(GgmlType::Q6_K, &block, 256).unwrap(), want);
    assert_decodes_like_reference(GgmlType::Q6_K, &block, 256);
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
    let e = dequantize(GgmlType::Q2_K, &[0; 84], 256)
        .unwrap_err()
        .to_string();
    assert!(e.contains("Q2_K") && e.contains("not supported"), "{e}");
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

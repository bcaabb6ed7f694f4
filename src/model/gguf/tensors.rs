//! GGUF tensors -> `Weights`: the expected set and shapes, dequantization, and undoing
//! llama.cpp's Q/K row permutation.

use std::collections::HashSet;
use std::io::IsTerminal;

use anyhow::{anyhow, bail, Result};
use half::bf16;
use indicatif::{ProgressBar, ProgressStyle};

use super::quant::{
    dequantize, dequantize_f32, ensure_supported, q4_k_as_q4_1, q5_0_as_q8_0, q6_k_as_blocks,
    GgmlType,
};
use super::reader::GgufFile;
use crate::model::quant::QuantType;
use crate::model::{Config, LayerWeights, Matrix, QkvBias, Weights};

const OUTPUT: &str = "output.weight";
const ROPE_FREQS: &str = "rope_freqs.weight";
/// Up to this many expected tensors for a file holding `present`, the per-tensor check runs
/// and names exactly what is missing; beyond it the claim is refused outright, so a header's
/// claim never costs more than a small multiple of the tensors the file really has.
fn plausible_tensor_count(present: usize) -> usize {
    present.saturating_mul(2).saturating_add(32)
}

/// Tensors every block of a llama model has.
const TENSORS_PER_LAYER: usize = 9;

/// Every tensor a llama model with `cfg`'s shape has in this file, with its GGUF dims
/// (innermost first: a `[rows, cols]` matrix is `[cols, rows]`).
fn expected(cfg: &Config, file: &GgufFile) -> Vec<(String, Vec<usize>)> {
    let (h, f, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
    let (q, kv) = (cfg.q_dim(), cfg.kv_dim());
    let mut out = vec![
        ("token_embd.weight".to_string(), vec![h, v]),
        ("output_norm.weight".to_string(), vec![h]),
    ];
    if !cfg.tie_word_embeddings {
        out.push((OUTPUT.to_string(), vec![h, v]));
    }
    if file.tensor(ROPE_FREQS).is_some() {
        out.push((ROPE_FREQS.to_string(), vec![cfg.head_dim / 2]));
    }
    for l in 0..cfg.num_layers {
        for (name, dims) in [
            ("attn_norm", vec![h]),
            ("attn_q", vec![h, q]),
            ("attn_k", vec![h, kv]),
            ("attn_v", vec![h, kv]),
            ("attn_output", vec![q, h]),
            ("ffn_norm", vec![h]),
            ("ffn_gate", vec![h, f]),
            ("ffn_up", vec![h, f]),
            ("ffn_down", vec![f, h]),
        ] {
            out.push((format!("blk.{l}.{name}.weight"), dims));
        }
        if cfg.qk_norm {
            for name in ["attn_q_norm", "attn_k_norm"] {
                out.push((format!("blk.{l}.{name}.weight"), vec![cfg.head_dim]));
            }
        }
        if cfg.qkv_bias {
            for (name, n) in [("attn_q", q), ("attn_k", kv), ("attn_v", kv)] {
                out.push((format!("blk.{l}.{name}.bias"), vec![n]));
            }
        }
    }
    out
}

/// ggml treats dimensions past `n_dims` as 1, so trailing 1s carry no meaning.
fn trimmed(dims: &[usize]) -> &[usize] {
    let keep = dims.iter().rposition(|&d| d != 1).map_or(0, |i| i + 1);
    &dims[..keep]
}

/// Checks, before any dequantization, that the file holds exactly the tensors `cfg` implies,
/// each with its shape and a type we decode.
pub fn check(cfg: &Config, file: &GgufFile) -> Result<()> {
    let src = file.source();
    // Every layer has nine tensors, so a block count far above a ninth of the tensor count
    // cannot be right; refusing it here keeps a crafted count from making us list many more
    // expected names than the file holds tensors.
    let needed = cfg
        .num_layers
        .checked_mul(TENSORS_PER_LAYER)
        .and_then(|n| n.checked_add(2));
    if needed.is_none_or(|n| n > plausible_tensor_count(file.tensors().len())) {
        bail!(
            "{src}: {}.block_count is {}, which needs at least {} tensors, but the file holds \
             only {} tensors",
            cfg.architecture,
            cfg.num_layers,
            needed.map_or_else(|| "more than usize::MAX".to_string(), |n| n.to_string()),
            file.tensors().len()
        );
    }
    let expected = expected(cfg, file);
    let names: HashSet<&str> = expected.iter().map(|(n, _)| n.as_str()).collect();
    for t in file.tensors() {
        if !names.contains(t.name.as_str()) {
            bail!(
                "{src}: unexpected tensor '{}' (not part of a {}-layer {} model)",
                t.name,
                cfg.num_layers,
                cfg.architecture
            );
        }
    }
    for (name, dims) in &expected {
        let t = file
            .tensor(name)
            .ok_or_else(|| anyhow!("{src}: tensor '{name}' is missing"))?;
        if trimmed(&t.dims) != trimmed(dims) {
            bail!(
                "{src}: tensor '{name}' has shape {:?}, expected {dims:?} (GGUF order, innermost \
                 first)",
                t.dims
            );
        }
        ensure_supported(t.ty).map_err(|e| anyhow!("{src}: tensor '{name}': {e}"))?;
    }
    Ok(())
}

/// Reads every weight into our layout: matrices stored as Q8_0, Q4_0 or Q4_1 keep their
/// blocks, Q4_K, Q5_0 and Q6_K ones are rewritten into 32-element blocks (`Rewritten`), other
/// matrices and every norm and bias become bf16. Also returns
/// `rope_freqs.weight` when the file has it. Call `check` first.
pub fn load(cfg: &Config, file: &GgufFile) -> Result<(Weights, Option<Vec<f32>>)> {
    let src = file.source();
    let progress = progress_bar(file);
    let raw = |name: &str| {
        let (t, data) = file
            .tensor(name)
            .zip(file.tensor_data(name))
            .ok_or_else(|| anyhow!("{src}: tensor '{name}' is missing"))?;
        progress.inc(t.n_bytes as u64);
        Ok::<_, anyhow::Error>((t, data))
    };
    let get = |name: &str| -> Result<Vec<bf16>> {
        let (t, data) = raw(name)?;
        dequantize(t.ty, data, t.n_elements).map_err(|e| anyhow!("{src}: tensor '{name}': {e}"))
    };
    // What became of the matrices whose block layout the engine does not keep.
    let rewritten = std::cell::RefCell::new(Rewritten::default());
    // `check` held every matrix to its expected shape, so its row length is the dims' first.
    let matrix = |name: &str| -> Result<Matrix> {
        let (t, data) = raw(name)?;
        let cols = t.dims.first().copied().unwrap_or(1).max(1);
        let err = |e: anyhow::Error| anyhow!("{src}: tensor '{name}': {e}");
        if let Some(q) = native(t.ty) {
            return Matrix::from_blocks(q, t.n_elements / cols, cols, data.to_vec()).map_err(err);
        }
        let as_blocks = match t.ty {
            GgmlType::Q4_K => q4_k_as_q4_1(data).map(|b| (QuantType::Q4_1, b)),
            GgmlType::Q5_0 => q5_0_as_q8_0(data).map(|b| (QuantType::Q8_0, b)),
            GgmlType::Q6_K => Some((QuantType::Q6_K, q6_k_as_blocks(data))),
            _ => None,
        };
        if let Some((q, blocks)) = as_blocks {
            rewritten.borrow_mut().note(t.ty, Some(q), blocks.len());
            return Matrix::from_blocks(q, t.n_elements / cols, cols, blocks).map_err(err);
        }
        if t.ty.block_size() > 1 {
            rewritten.borrow_mut().note(t.ty, None, 2 * t.n_elements);
        }
        Ok(Matrix::from_bf16(
            dequantize(t.ty, data, t.n_elements).map_err(err)?,
            cols,
        ))
    };
    let hd = cfg.head_dim;
    // llama.cpp's converter permutes Q/K rows only for the `llama` architecture, whose RoPE
    // rotates adjacent pairs; qwen2/qwen3 use NEOX RoPE (pairs `i`, `i + head_dim/2`, HF's
    // order), so their rows are stored as HF has them.
    let permuted = cfg.architecture == "llama";
    let qk = |m: Matrix, heads: usize| {
        if permuted {
            unpermute_qk(&m, heads, hd)
        } else {
            m
        }
    };

    let embed = matrix("token_embd.weight")?;
    let layers = (0..cfg.num_layers)
        .map(|l| {
            let name = |n: &str| format!("blk.{l}.{n}.weight");
            let mut lw = LayerWeights {
                attn_norm: get(&name("attn_norm"))?,
                wq: qk(matrix(&name("attn_q"))?, cfg.num_heads),
                wk: qk(matrix(&name("attn_k"))?, cfg.num_kv_heads),
                wv: matrix(&name("attn_v"))?,
                wo: matrix(&name("attn_output"))?,
                ffn_norm: get(&name("ffn_norm"))?,
                w_gate: matrix(&name("ffn_gate"))?,
                w_up: matrix(&name("ffn_up"))?,
                w_down: matrix(&name("ffn_down"))?,
                q_norm: cfg.qk_norm.then(|| get(&name("attn_q_norm"))).transpose()?,
                k_norm: cfg.qk_norm.then(|| get(&name("attn_k_norm"))).transpose()?,
                qkv_bias: cfg
                    .qkv_bias
                    .then(|| {
                        let bias = |n: &str| get(&format!("blk.{l}.{n}.bias"));
                        Ok::<_, anyhow::Error>(QkvBias {
                            q: bias("attn_q")?,
                            k: bias("attn_k")?,
                            v: bias("attn_v")?,
                        })
                    })
                    .transpose()?,
            };
            same_type_groups(&mut lw, src, l);
            Ok(lw)
        })
        .collect::<Result<Vec<_>>>()?;
    let final_norm = get("output_norm.weight")?;
    let lm_head = if cfg.tie_word_embeddings {
        None
    } else {
        Some(matrix(OUTPUT)?)
    };
    let rope_freqs = match file.tensor(ROPE_FREQS) {
        Some(t) => {
            let (_, data) = raw(ROPE_FREQS)?;
            Some(
                dequantize_f32(t.ty, data, t.n_elements)
                    .map_err(|e| anyhow!("{src}: tensor '{ROPE_FREQS}': {e}"))?,
            )
        }
        None => None,
    };
    progress.finish_and_clear();
    rewritten.into_inner().report(src);
    Ok((
        Weights {
            embed,
            layers,
            final_norm,
            lm_head,
        },
        rope_freqs,
    ))
}

/// Matrices stored in block layouts the engine does not keep, and what they became: Q4_K as
/// Q4_1 blocks (`q4_k_as_q4_1`), Q5_0 as Q8_0 and Q6_K as 32-element Q6_K blocks (both
/// exactly; Q6_K's take 224 bytes for a super-block's 210), the rest (and any Q4_K sub-block
/// the rewrite would move too far) widened to bf16, at 3-4x their blocks' memory.
#[derive(Default)]
struct Rewritten {
    /// (stored as, kept as or None for bf16) -> (matrices, bytes in memory).
    counts: std::collections::BTreeMap<(&'static str, Option<&'static str>), (usize, usize)>,
}

impl Rewritten {
    fn note(&mut self, from: GgmlType, to: Option<QuantType>, bytes: usize) {
        let c = self
            .counts
            .entry((from.name(), to.map(|q| q.name())))
            .or_default();
        c.0 += 1;
        c.1 += bytes;
    }

    /// One line on stderr when any matrix was rewritten: how many of each, into what, and the
    /// memory they take.
    fn report(&self, src: &str) {
        if self.counts.is_empty() {
            return;
        }
        let parts: Vec<String> = self
            .counts
            .iter()
            .map(|((from, to), (n, bytes))| {
                let mib = *bytes as f64 / (1u64 << 20) as f64;
                match to {
                    Some(to) if to == from => {
                        format!("{n} {from} as 32-element {to} blocks ({mib:.1} MiB)")
                    }
                    to => format!("{n} {from} as {} ({mib:.1} MiB)", to.unwrap_or("bf16")),
                }
            })
            .collect();
        let widened = self.counts.keys().any(|(_, to)| to.is_none());
        eprintln!(
            "megainfer: {src}: matrices not kept in the file's block layout: {}{}",
            parts.join(", "),
            if widened {
                " (`--dtype q8_0` stores every matrix as Q8_0 instead: half the memory of bf16)"
            } else {
                ""
            }
        );
    }
}

/// The block format a GGUF type is kept in, for the types every path computes from directly.
fn native(ty: GgmlType) -> Option<QuantType> {
    match ty {
        GgmlType::Q8_0 => Some(QuantType::Q8_0),
        GgmlType::Q4_0 => Some(QuantType::Q4_0),
        GgmlType::Q4_1 => Some(QuantType::Q4_1),
        _ => None,
    }
}

/// The GPU paths run Q, K and V as one matrix, and gate and up as another, so each group must
/// share one storage type; a group whose file types differ is widened to bf16 (said on stderr).
fn same_type_groups(lw: &mut LayerWeights, src: &str, layer: usize) {
    let mixed = |ms: &[&Matrix]| ms.iter().any(|m| m.ty() != ms[0].ty());
    if mixed(&[&lw.wq, &lw.wk, &lw.wv]) {
        eprintln!(
            "megainfer: {src}: layer {layer} stores Q, K and V as {}, {} and {}; widening them to bf16",
            lw.wq.ty(),
            lw.wk.ty(),
            lw.wv.ty()
        );
        for m in [&mut lw.wq, &mut lw.wk, &mut lw.wv] {
            *m = m.to_bf16();
        }
    }
    if mixed(&[&lw.w_gate, &lw.w_up]) {
        eprintln!(
            "megainfer: {src}: layer {layer} stores gate and up as {} and {}; widening them to bf16",
            lw.w_gate.ty(),
            lw.w_up.ty()
        );
        for m in [&mut lw.w_gate, &mut lw.w_up] {
            *m = m.to_bf16();
        }
    }
}

fn progress_bar(file: &GgufFile) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let total = file.tensors().iter().map(|t| t.n_bytes as u64).sum();
    let bar = ProgressBar::new(total).with_message("dequantizing");
    if let Ok(style) =
        ProgressStyle::with_template("{msg} [{bar:40}] {bytes}/{total_bytes} ({elapsed})")
    {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

/// [`unpermute_qk_rows`] on a matrix of any storage type (whole rows move, blocks and all).
pub fn unpermute_qk(m: &Matrix, n_heads: usize, head_dim: usize) -> Matrix {
    assert_eq!(
        m.rows(),
        n_heads * head_dim,
        "unpermute_qk: row count does not match the heads"
    );
    let half = head_dim / 2;
    // HF row `j * half + i` of a head is GGUF row `2i + j`.
    m.permute_rows(|hf| {
        let (head, r) = (hf / head_dim, hf % head_dim);
        let (j, i) = (r / half, r % half);
        head * head_dim + 2 * i + j
    })
}

/// Undoes the row permutation llama.cpp's converter applies to Q and K so that its RoPE can
/// rotate adjacent pairs: within each head, GGUF row `2i + j` holds HF row `j * head_dim/2 + i`.
/// The result is in HF order, where RoPE pairs element `i` with `i + head_dim/2`.
///
/// `w` is `[n_heads * head_dim, cols]` row-major.
pub fn unpermute_qk_rows(w: &[bf16], n_heads: usize, head_dim: usize, cols: usize) -> Vec<bf16> {
    assert_eq!(
        w.len(),
        n_heads * head_dim * cols,
        "unpermute_qk_rows: matrix size does not match its shape"
    );
    if w.is_empty() {
        return Vec::new();
    }
    let half = head_dim / 2;
    let mut out = vec![bf16::ZERO; w.len()];
    for (head_in, head_out) in w
        .chunks_exact(head_dim * cols)
        .zip(out.chunks_exact_mut(head_dim * cols))
    {
        for (gguf_row, row) in head_in.chunks_exact(cols).enumerate() {
            let (i, j) = (gguf_row / 2, gguf_row % 2);
            let hf_row = j * half + i;
            head_out[hf_row * cols..(hf_row + 1) * cols].copy_from_slice(row);
        }
    }
    out
}

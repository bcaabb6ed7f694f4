//! Model weights in the one layout every execution path uses: row-major `[out, in]` matrices
//! as HF stores them, Q/K rows in HF (`rotate_half`) order. A matrix holds bf16 values or GGUF
//! blocks (Q8_0, Q4_0, Q4_1, and Q6_K in 32-element blocks: `quant`) along its rows, as the file
//! stored them; norms and biases are bf16.

use std::fmt;
use std::ops::Range;

use anyhow::{bail, Result};
use half::bf16;
use rayon::prelude::*;

use super::quant::{self, QuantType, BLOCK};

/// How a matrix's elements are stored.
#[allow(non_camel_case_types)]
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightType {
    #[value(name = "bf16")]
    Bf16,
    #[value(name = "q8_0")]
    Q8_0,
    #[value(name = "q4_0")]
    Q4_0,
    #[value(name = "q4_1")]
    Q4_1,
    #[value(name = "q6_k")]
    Q6_K,
}

impl WeightType {
    pub fn quant(self) -> Option<QuantType> {
        match self {
            WeightType::Bf16 => None,
            WeightType::Q8_0 => Some(QuantType::Q8_0),
            WeightType::Q4_0 => Some(QuantType::Q4_0),
            WeightType::Q4_1 => Some(QuantType::Q4_1),
            WeightType::Q6_K => Some(QuantType::Q6_K),
        }
    }

    pub fn name(self) -> &'static str {
        match self.quant() {
            None => "bf16",
            Some(q) => q.name(),
        }
    }

    /// The `WEIGHT_*` code the GPU kernels name the type by (kernels/quant/decode.cuh).
    pub fn code(self) -> i32 {
        match self {
            WeightType::Bf16 => 0,
            WeightType::Q8_0 => 1,
            WeightType::Q4_0 => 2,
            WeightType::Q4_1 => 3,
            WeightType::Q6_K => 4,
        }
    }

    /// Bytes `n` elements (a whole number of blocks for the quantised types) occupy.
    pub fn bytes(self, n: usize) -> usize {
        match self.quant() {
            None => 2 * n,
            Some(q) => n / BLOCK * q.block_bytes(),
        }
    }
}

impl From<QuantType> for WeightType {
    fn from(q: QuantType) -> Self {
        match q {
            QuantType::Q8_0 => WeightType::Q8_0,
            QuantType::Q4_0 => WeightType::Q4_0,
            QuantType::Q4_1 => WeightType::Q4_1,
            QuantType::Q6_K => WeightType::Q6_K,
        }
    }
}

impl fmt::Display for WeightType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Storage {
    Bf16(Vec<bf16>),
    /// `rows * cols / 32` blocks, row-major (a row is `cols / 32` consecutive blocks).
    Blocks(QuantType, Vec<u8>),
}

/// A `[rows, cols]` weight matrix, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct Matrix {
    rows: usize,
    cols: usize,
    data: Storage,
}

/// A borrowed run of whole rows of a [`Matrix`].
#[derive(Debug, Clone, Copy)]
pub struct MatRef<'a> {
    rows: usize,
    cols: usize,
    data: RefData<'a>,
}

#[derive(Debug, Clone, Copy)]
enum RefData<'a> {
    Bf16(&'a [bf16]),
    Blocks(QuantType, &'a [u8]),
}

impl Matrix {
    /// `data` holds whole rows of `cols` elements.
    pub fn from_bf16(data: Vec<bf16>, cols: usize) -> Self {
        assert!(
            cols > 0 && data.len().is_multiple_of(cols),
            "a matrix of {} elements is not whole rows of {cols}",
            data.len()
        );
        Self {
            rows: data.len() / cols,
            cols,
            data: Storage::Bf16(data),
        }
    }

    /// `rows` rows of `cols` elements stored as blocks of `ty`.
    pub fn from_blocks(ty: QuantType, rows: usize, cols: usize, data: Vec<u8>) -> Result<Self> {
        if !cols.is_multiple_of(BLOCK) {
            bail!("rows of {cols} elements are not a whole number of {BLOCK}-element {ty} blocks");
        }
        let want = rows
            .checked_mul(cols / BLOCK)
            .and_then(|b| b.checked_mul(ty.block_bytes()));
        if want != Some(data.len()) {
            bail!(
                "{rows} x {cols} elements of {ty} need {} bytes, got {}",
                want.map_or_else(|| "more than usize::MAX".into(), |n| n.to_string()),
                data.len()
            );
        }
        Ok(Self {
            rows,
            cols,
            data: Storage::Blocks(ty, data),
        })
    }

    /// The bf16 values rounded from `x` (row-major, rows of `cols`) quantised to `ty`, or
    /// rounded to bf16 for `WeightType::Bf16`.
    pub fn quantize_f32(x: &[f32], cols: usize, ty: WeightType) -> Self {
        match ty.quant() {
            None => Self::from_bf16(x.iter().map(|&v| bf16::from_f32(v)).collect(), cols),
            Some(q) => {
                assert!(cols.is_multiple_of(BLOCK) && x.len().is_multiple_of(cols));
                let rows: Vec<Vec<u8>> = x
                    .par_chunks(cols)
                    .map(|r| quant::quantize_row(q, r))
                    .collect();
                Self::from_blocks(q, x.len() / cols, cols, rows.concat())
                    .expect("quantize_row writes whole rows of blocks")
            }
        }
    }

    pub fn view(&self) -> MatRef<'_> {
        MatRef {
            rows: self.rows,
            cols: self.cols,
            data: match &self.data {
                Storage::Bf16(v) => RefData::Bf16(v),
                Storage::Blocks(t, b) => RefData::Blocks(*t, b),
            },
        }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.rows * self.cols
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn ty(&self) -> WeightType {
        self.view().ty()
    }

    /// Bytes the matrix occupies (and a mat-vec over it streams).
    pub fn bytes(&self) -> usize {
        self.ty().bytes(self.len())
    }

    /// The bf16 values, for a bf16 matrix.
    pub fn as_bf16(&self) -> Option<&[bf16]> {
        match &self.data {
            Storage::Bf16(v) => Some(v),
            Storage::Blocks(..) => None,
        }
    }

    /// The bf16 values, mutable, for a bf16 matrix.
    pub fn as_bf16_mut(&mut self) -> Option<&mut [bf16]> {
        match &mut self.data {
            Storage::Bf16(v) => Some(v),
            Storage::Blocks(..) => None,
        }
    }

    /// The raw blocks (GGUF layout), for a quantised matrix.
    pub fn blocks(&self) -> Option<(QuantType, &[u8])> {
        match &self.data {
            Storage::Bf16(_) => None,
            Storage::Blocks(t, b) => Some((*t, b)),
        }
    }

    /// Every element, decoded exactly.
    pub fn to_f32(&self) -> Vec<f32> {
        self.view().to_f32()
    }

    /// The matrix as bf16 values: itself when it is bf16, else its exact values rounded to
    /// nearest bf16 (what loading a quantised file as bf16 always did).
    pub fn to_bf16(&self) -> Matrix {
        match &self.data {
            Storage::Bf16(_) => self.clone(),
            Storage::Blocks(..) => Self::from_bf16(
                self.to_f32().iter().map(|&v| bf16::from_f32(v)).collect(),
                self.cols,
            ),
        }
    }

    /// Reorders whole rows: row `i` of the result is row `from(i)` of `self`.
    pub fn permute_rows(&self, from: impl Fn(usize) -> usize) -> Matrix {
        let row_bytes = |v: MatRef| -> usize { v.ty().bytes(v.cols) };
        match &self.data {
            Storage::Bf16(v) => {
                let mut out = Vec::with_capacity(v.len());
                for i in 0..self.rows {
                    let r = from(i);
                    out.extend_from_slice(&v[r * self.cols..(r + 1) * self.cols]);
                }
                Self::from_bf16(out, self.cols)
            }
            Storage::Blocks(t, b) => {
                let n = row_bytes(self.view());
                let mut out = Vec::with_capacity(b.len());
                for i in 0..self.rows {
                    let r = from(i);
                    out.extend_from_slice(&b[r * n..(r + 1) * n]);
                }
                Self {
                    rows: self.rows,
                    cols: self.cols,
                    data: Storage::Blocks(*t, out),
                }
            }
        }
    }
}

impl<'a> MatRef<'a> {
    /// Rows of `cols` bf16 values.
    pub fn bf16(data: &'a [bf16], cols: usize) -> Self {
        assert!(cols > 0 && data.len().is_multiple_of(cols));
        Self {
            rows: data.len() / cols,
            cols,
            data: RefData::Bf16(data),
        }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    pub fn ty(&self) -> WeightType {
        match self.data {
            RefData::Bf16(_) => WeightType::Bf16,
            RefData::Blocks(t, _) => t.into(),
        }
    }

    pub fn as_bf16(&self) -> Option<&'a [bf16]> {
        match self.data {
            RefData::Bf16(v) => Some(v),
            RefData::Blocks(..) => None,
        }
    }

    /// Rows `range` of this matrix.
    /// The blocks of a quantised matrix (rows of `cols / 32` blocks each), with their type.
    pub fn as_blocks(&self) -> Option<(QuantType, &'a [u8])> {
        match self.data {
            RefData::Bf16(_) => None,
            RefData::Blocks(t, b) => Some((t, b)),
        }
    }

    pub fn row_range(&self, range: Range<usize>) -> MatRef<'a> {
        assert!(range.start <= range.end && range.end <= self.rows);
        let data = match self.data {
            RefData::Bf16(v) => RefData::Bf16(&v[range.start * self.cols..range.end * self.cols]),
            RefData::Blocks(t, b) => {
                let n = self.cols / BLOCK * t.block_bytes();
                RefData::Blocks(t, &b[range.start * n..range.end * n])
            }
        };
        MatRef {
            rows: range.len(),
            cols: self.cols,
            data,
        }
    }

    /// Row `r` decoded exactly into `out` (`cols` elements).
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        let c = self.cols;
        match self.data {
            RefData::Bf16(v) => {
                for (o, x) in out.iter_mut().zip(&v[r * c..(r + 1) * c]) {
                    *o = x.to_f32();
                }
            }
            RefData::Blocks(t, b) => {
                let n = c / BLOCK * t.block_bytes();
                quant::dequantize_row(t, &b[r * n..(r + 1) * n], out);
            }
        }
    }

    /// Every element, decoded exactly.
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        if self.cols > 0 {
            out.par_chunks_mut(self.cols)
                .enumerate()
                .for_each(|(r, o)| self.row_f32(r, o));
        }
        out
    }
}

#[derive(Debug, Clone)]
pub struct LayerWeights {
    /// `[hidden]`
    pub attn_norm: Vec<bf16>,
    /// `[num_heads * head_dim, hidden]`
    pub wq: Matrix,
    /// `[num_kv_heads * head_dim, hidden]`
    pub wk: Matrix,
    /// `[num_kv_heads * head_dim, hidden]`
    pub wv: Matrix,
    /// `[hidden, num_heads * head_dim]`
    pub wo: Matrix,
    /// `[hidden]`
    pub ffn_norm: Vec<bf16>,
    /// `[intermediate, hidden]`
    pub w_gate: Matrix,
    /// `[intermediate, hidden]`
    pub w_up: Matrix,
    /// `[hidden, intermediate]`
    pub w_down: Matrix,
    /// Qwen3 `[head_dim]` gains of the per-head RMS norm of q and k; `None` without q/k norm.
    pub q_norm: Option<Vec<bf16>>,
    pub k_norm: Option<Vec<bf16>>,
    /// Qwen2 biases `[q_dim]`, `[kv_dim]`, `[kv_dim]` of the q, k and v projections.
    pub qkv_bias: Option<QkvBias>,
}

impl LayerWeights {
    pub fn matrices(&self) -> [&Matrix; 7] {
        [
            &self.wq,
            &self.wk,
            &self.wv,
            &self.wo,
            &self.w_gate,
            &self.w_up,
            &self.w_down,
        ]
    }

    fn matrices_mut(&mut self) -> [&mut Matrix; 7] {
        [
            &mut self.wq,
            &mut self.wk,
            &mut self.wv,
            &mut self.wo,
            &mut self.w_gate,
            &mut self.w_up,
            &mut self.w_down,
        ]
    }

    fn vector_len(&self) -> usize {
        self.attn_norm.len()
            + self.ffn_norm.len()
            + self.q_norm.as_ref().map_or(0, Vec::len)
            + self.k_norm.as_ref().map_or(0, Vec::len)
            + self
                .qkv_bias
                .as_ref()
                .map_or(0, |b| b.q.len() + b.k.len() + b.v.len())
    }
}

#[derive(Debug, Clone)]
pub struct QkvBias {
    pub q: Vec<bf16>,
    pub k: Vec<bf16>,
    pub v: Vec<bf16>,
}

#[derive(Debug, Clone)]
pub struct Weights {
    /// `[vocab, hidden]`
    pub embed: Matrix,
    pub layers: Vec<LayerWeights>,
    /// `[hidden]`
    pub final_norm: Vec<bf16>,
    /// `[vocab, hidden]`; `None` when tied to `embed`.
    pub lm_head: Option<Matrix>,
}

/// The kinds of a layer's matrices, each a group that shares one storage type within a layer,
/// by the names errors and messages use; `LayerWeights::kind` gives each kind's group.
const LAYER_KINDS: [&str; 4] = ["q/k/v", "attention output", "gate/up", "down"];

impl LayerWeights {
    /// The matrices of kind `k` of `LAYER_KINDS`.
    fn kind(&self, k: usize) -> Vec<&Matrix> {
        match k {
            0 => vec![&self.wq, &self.wk, &self.wv],
            1 => vec![&self.wo],
            2 => vec![&self.w_gate, &self.w_up],
            _ => vec![&self.w_down],
        }
    }
}

/// The first kind of matrix whose layers' storage types differ, described ("the {kind}
/// matrices are {type} in layer 0 but {type} in layer {i}"): `kinds` gives each kind's name and
/// its type per layer.
pub fn first_mixed_kind<'a>(
    kinds: impl IntoIterator<Item = (&'a str, Vec<WeightType>)>,
) -> Option<String> {
    kinds.into_iter().find_map(|(name, types)| {
        let t0 = *types.first()?;
        let (i, t) = types.iter().enumerate().find(|(_, t)| **t != t0)?;
        Some(format!(
            "the {name} matrices are {t0} in layer 0 but {t} in layer {i}"
        ))
    })
}

impl Weights {
    pub fn lm_head(&self) -> &Matrix {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// Every matrix once (the embedding, and the LM head when untied).
    pub fn matrices(&self) -> Vec<&Matrix> {
        let mut out = vec![&self.embed];
        out.extend(self.lm_head.iter());
        out.extend(self.layers.iter().flat_map(|l| l.matrices()));
        out
    }

    /// Bytes one decode step streams: every matrix once (the embedding aside, of which one
    /// row is read, but the LM head counted even when tied), and the norms and biases (bf16).
    pub fn bytes_per_token(&self) -> usize {
        let layer: usize = self
            .layers
            .iter()
            .map(|l| l.matrices().iter().map(|m| m.bytes()).sum::<usize>() + 2 * l.vector_len())
            .sum();
        layer + 2 * self.final_norm.len() + self.lm_head().bytes()
    }

    /// Bytes the weights occupy, by storage type (the norms and biases under bf16), in the
    /// order bf16, Q8_0, Q4_0, Q4_1, Q6_K, types absent left out.
    pub fn bytes_by_type(&self) -> Vec<(WeightType, usize)> {
        let mut by = [0usize; 5];
        let slot = |t: WeightType| t as usize;
        for m in self.matrices() {
            by[slot(m.ty())] += m.bytes();
        }
        let vectors: usize = self
            .layers
            .iter()
            .map(LayerWeights::vector_len)
            .sum::<usize>()
            + self.final_norm.len();
        by[slot(WeightType::Bf16)] += 2 * vectors;
        [
            WeightType::Bf16,
            WeightType::Q8_0,
            WeightType::Q4_0,
            WeightType::Q4_1,
            WeightType::Q6_K,
        ]
        .into_iter()
        .zip(by)
        .filter(|(_, b)| *b > 0)
        .collect()
    }

    /// One line: total weight memory and its split by type.
    pub fn describe_memory(&self) -> String {
        let by = self.bytes_by_type();
        let total: usize = by.iter().map(|(_, b)| b).sum();
        let mib = |b: usize| b as f64 / (1 << 20) as f64;
        let parts: Vec<String> = by
            .iter()
            .map(|(t, b)| format!("{t} {:.1} MiB", mib(*b)))
            .collect();
        format!(
            "weights {:.1} MiB ({total} bytes: {})",
            mib(total),
            parts.join(", ")
        )
    }

    /// True when any matrix is stored as blocks.
    pub fn is_quantized(&self) -> bool {
        self.matrices().iter().any(|m| m.ty() != WeightType::Bf16)
    }

    /// Every matrix as bf16 (`--dtype bf16`): quantised ones decoded and rounded to nearest.
    pub fn widen_to_bf16(&mut self) {
        self.convert(|m| m.to_bf16());
    }

    /// The first kind of matrix (q/k/v, attention output, gate/up, down) whose storage type
    /// differs between layers, described; `None` when each kind has one type. The megakernel
    /// then reads each layer's matrices in their own format (`MatrixFormats::mixed`).
    pub fn mixed_storage(&self) -> Option<String> {
        first_mixed_kind(
            LAYER_KINDS
                .iter()
                .enumerate()
                .map(|(k, name)| (*name, self.kind_types(k))),
        )
    }

    /// Kind `k`'s storage type in each layer (its group shares one type: the loaders make
    /// sure of it).
    fn kind_types(&self, k: usize) -> Vec<WeightType> {
        self.layers.iter().map(|l| l.kind(k)[0].ty()).collect()
    }

    /// The formats a llama.cpp Q4_K_M file's matrices load with, on weights of one block format
    /// (its Q4_K loads as Q4_1): the layers whose V and down matrices it stores as Q6_K (its
    /// `use_more_bits`: the first and last eighth of the layers and every third one between)
    /// get their down matrix in Q6_K and their q/k/v in bf16 (the GGUF loader widens Q and K
    /// with V, since the three run as one matrix), and the LM head (the embedding when tied)
    /// is Q6_K, as in every K-quant mix. Returns the layers.
    pub fn mix_like_q4_k_m(&mut self) -> Vec<usize> {
        let n = self.layers.len();
        let more_bits = |i: usize| i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2;
        let layers: Vec<usize> = (0..n).filter(|&i| more_bits(i)).collect();
        let q6 = |m: &Matrix| Matrix::quantize_f32(&m.to_f32(), m.cols(), WeightType::Q6_K);
        for &i in &layers {
            let l = &mut self.layers[i];
            for m in [&mut l.wq, &mut l.wk, &mut l.wv] {
                *m = m.to_bf16();
            }
            l.w_down = q6(&l.w_down);
        }
        match &mut self.lm_head {
            Some(m) => *m = q6(m),
            None => self.embed = q6(&self.embed),
        }
        layers
    }

    /// The matrices stored as `ty` widened to bf16 (the rest as they are).
    pub fn widen_type(&mut self, ty: WeightType) {
        self.each_matrix_mut(|m| {
            if m.ty() == ty {
                *m = m.to_bf16();
            }
        });
    }

    /// Every matrix stored as `ty`: bf16 rounded from the exact values, or those values
    /// quantised with the project's quantiser (`bench --dtype`). Matrices already of `ty` stay
    /// as they are. Fails, changing nothing, when a matrix's rows are not whole blocks.
    pub fn convert_to(&mut self, ty: WeightType) -> Result<()> {
        if ty.quant().is_some() {
            let mut named = vec![("embedding", &self.embed)];
            named.extend(self.lm_head.iter().map(|m| ("lm_head", m)));
            for l in &self.layers {
                let names = [
                    "q_proj",
                    "k_proj",
                    "v_proj",
                    "o_proj",
                    "gate_proj",
                    "up_proj",
                    "down_proj",
                ];
                named.extend(names.into_iter().zip(l.matrices()));
            }
            if let Some((name, m)) = named.iter().find(|(_, m)| !m.cols().is_multiple_of(BLOCK)) {
                bail!(
                    "--dtype {ty}: {name} has rows of {} elements, not a whole number of \
                     {BLOCK}-element blocks",
                    m.cols()
                );
            }
        }
        self.convert(|m| {
            if m.ty() == ty {
                m.clone()
            } else {
                Matrix::quantize_f32(&m.to_f32(), m.cols(), ty)
            }
        });
        Ok(())
    }

    fn convert(&mut self, f: impl Fn(&Matrix) -> Matrix + Sync) {
        self.each_matrix_mut(|m| *m = f(m));
    }

    /// `f` on every matrix once: the embedding, the LM head when untied, the layers'.
    fn each_matrix_mut(&mut self, mut f: impl FnMut(&mut Matrix)) {
        f(&mut self.embed);
        if let Some(h) = &mut self.lm_head {
            f(h);
        }
        for l in &mut self.layers {
            for m in l.matrices_mut() {
                f(m);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn views_rows_and_permutations_agree_with_the_decoded_matrix() {
        let x: Vec<f32> = (0..6 * 64)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 64.0)
            .collect();
        for ty in [
            WeightType::Bf16,
            WeightType::Q8_0,
            WeightType::Q4_0,
            WeightType::Q4_1,
            WeightType::Q6_K,
        ] {
            let m = Matrix::quantize_f32(&x, 64, ty);
            assert_eq!((m.rows(), m.cols(), m.ty()), (6, 64, ty));
            assert_eq!(m.bytes(), ty.bytes(6 * 64));
            let all = m.to_f32();
            let sub = m.view().row_range(2..5).to_f32();
            assert_eq!(sub, all[2 * 64..5 * 64].to_vec(), "{ty}");
            let p = m.permute_rows(|i| 5 - i).to_f32();
            for r in 0..6 {
                assert_eq!(
                    p[r * 64..(r + 1) * 64],
                    all[(5 - r) * 64..(6 - r) * 64],
                    "{ty}"
                );
            }
            // Widening to bf16 rounds each exact value once.
            let wide = m.to_bf16();
            let want: Vec<f32> = all.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
            assert_eq!(wide.to_f32(), want, "{ty}");
        }
    }
}

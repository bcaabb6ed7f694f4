//! ggml tensor types and dequantization of the ones we read.

use std::fmt;

use anyhow::{bail, Result};
use half::{bf16, f16};
use rayon::prelude::*;

use crate::model::quant::{q6_block, QuantType};

/// Every ggml type a GGUF file may carry. Knowing the block geometry of types we cannot decode
/// still matters: it is what lets the reader bound-check their data and name them in errors.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ2_XXS,
    IQ2_XS,
    IQ3_XXS,
    IQ1_S,
    IQ4_NL,
    IQ3_S,
    IQ2_S,
    IQ4_XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1_M,
    BF16,
    TQ1_0,
    TQ2_0,
    MXFP4,
}

/// Types `dequantize` decodes. Q8_0, Q4_0 and Q4_1 matrices are also kept as stored, and Q4_K,
/// Q5_0 and Q6_K ones rewritten into the engine's 32-element blocks (`crate::model::quant`,
/// `tensors::load`); the others are widened to bf16 at load.
const SUPPORTED: [GgmlType; 11] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];

const ALL: [GgmlType; 32] = {
    use GgmlType::*;
    [
        F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K, IQ2_XXS,
        IQ2_XS, IQ3_XXS, IQ1_S, IQ4_NL, IQ3_S, IQ2_S, IQ4_XS, I8, I16, I32, I64, F64, IQ1_M, BF16,
        TQ1_0, TQ2_0, MXFP4,
    ]
};

struct Layout {
    id: u32,
    name: &'static str,
    /// Elements per block.
    block: usize,
    /// Bytes per block.
    bytes: usize,
}

impl GgmlType {
    fn layout(self) -> Layout {
        use GgmlType::*;
        let (id, name, block, bytes) = match self {
            F32 => (0, "F32", 1, 4),
            F16 => (1, "F16", 1, 2),
            Q4_0 => (2, "Q4_0", 32, 18),
            Q4_1 => (3, "Q4_1", 32, 20),
            // 4 and 5 were Q4_2 and Q4_3, removed from ggml before GGUF existed.
            Q5_0 => (6, "Q5_0", 32, 22),
            Q5_1 => (7, "Q5_1", 32, 24),
            Q8_0 => (8, "Q8_0", 32, 34),
            Q8_1 => (9, "Q8_1", 32, 36),
            Q2_K => (10, "Q2_K", 256, 84),
            Q3_K => (11, "Q3_K", 256, 110),
            Q4_K => (12, "Q4_K", 256, 144),
            Q5_K => (13, "Q5_K", 256, 176),
            Q6_K => (14, "Q6_K", 256, 210),
            Q8_K => (15, "Q8_K", 256, 292),
            IQ2_XXS => (16, "IQ2_XXS", 256, 66),
            IQ2_XS => (17, "IQ2_XS", 256, 74),
            IQ3_XXS => (18, "IQ3_XXS", 256, 98),
            IQ1_S => (19, "IQ1_S", 256, 50),
            IQ4_NL => (20, "IQ4_NL", 32, 18),
            IQ3_S => (21, "IQ3_S", 256, 110),
            IQ2_S => (22, "IQ2_S", 256, 82),
            IQ4_XS => (23, "IQ4_XS", 256, 136),
            I8 => (24, "I8", 1, 1),
            I16 => (25, "I16", 1, 2),
            I32 => (26, "I32", 1, 4),
            I64 => (27, "I64", 1, 8),
            F64 => (28, "F64", 1, 8),
            IQ1_M => (29, "IQ1_M", 256, 56),
            BF16 => (30, "BF16", 1, 2),
            // 31-33 and 36-38 were repacked Q4_0/IQ4_NL variants, no longer written to files.
            TQ1_0 => (34, "TQ1_0", 256, 54),
            TQ2_0 => (35, "TQ2_0", 256, 66),
            MXFP4 => (39, "MXFP4", 32, 17),
        };
        Layout {
            id,
            name,
            block,
            bytes,
        }
    }

    pub fn from_id(id: u32) -> Option<Self> {
        ALL.into_iter().find(|t| t.id() == id)
    }

    /// The number GGUF stores for this type.
    pub fn id(self) -> u32 {
        self.layout().id
    }

    /// ggml's name for the type (`Q4_1`, `BF16`, ...).
    pub fn name(self) -> &'static str {
        self.layout().name
    }

    /// Elements per block; rows must be a whole number of blocks.
    pub fn block_size(self) -> usize {
        self.layout().block
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        self.layout().bytes
    }

    pub fn is_supported(self) -> bool {
        SUPPORTED.contains(&self)
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Decodes `n` elements of type `ty` to bf16 (rounding each f32 value to nearest even).
pub fn dequantize(ty: GgmlType, data: &[u8], n: usize) -> Result<Vec<bf16>> {
    dequantize_with(ty, data, n, bf16::from_f32)
}

/// Decodes `n` elements of type `ty` to f32, for values that must not lose precision (RoPE
/// frequency divisors).
pub fn dequantize_f32(ty: GgmlType, data: &[u8], n: usize) -> Result<Vec<f32>> {
    dequantize_with(ty, data, n, |x| x)
}

/// Fails, naming the type and the ones we decode, unless `dequantize` handles `ty`.
pub fn ensure_supported(ty: GgmlType) -> Result<()> {
    if !ty.is_supported() {
        let names: Vec<&str> = SUPPORTED.iter().map(|t| t.name()).collect();
        bail!(
            "ggml type {ty} is not supported (supported: {})",
            names.join(", ")
        );
    }
    Ok(())
}

/// Elements handed to one rayon task: large enough to amortise scheduling, small enough to
/// spread one 1536×576 matrix over many cores.
const ELEMENTS_PER_TASK: usize = 1 << 15;

fn dequantize_with<T, F>(ty: GgmlType, data: &[u8], n: usize, convert: F) -> Result<Vec<T>>
where
    T: Copy + Default + Send,
    F: Fn(f32) -> T + Sync,
{
    ensure_supported(ty)?;
    let (block, bytes) = (ty.block_size(), ty.type_size());
    if !n.is_multiple_of(block) {
        bail!("{n} elements of {ty} are not a whole number of {block}-element blocks");
    }
    if (n / block).checked_mul(bytes) != Some(data.len()) {
        bail!(
            "{n} elements of {ty} need {} blocks of {bytes} bytes, got {} bytes",
            n / block,
            data.len()
        );
    }
    let mut out = vec![T::default(); n];
    let blocks_per_task = (ELEMENTS_PER_TASK / block).max(1);
    out.par_chunks_mut(blocks_per_task * block)
        .zip(data.par_chunks(blocks_per_task * bytes))
        .for_each(|(out, data)| decode_run(ty, data, out, &convert));
    Ok(out)
}

fn le_f16(b: &[u8]) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
}

/// Decodes whole blocks; `data` and `out` hold the same number of them.
fn decode_run<T>(ty: GgmlType, data: &[u8], out: &mut [T], convert: &impl Fn(f32) -> T) {
    match ty {
        GgmlType::F32 => {
            for (o, b) in out.iter_mut().zip(data.chunks_exact(4)) {
                *o = convert(f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
            }
        }
        GgmlType::F16 => {
            for (o, b) in out.iter_mut().zip(data.chunks_exact(2)) {
                *o = convert(le_f16(b));
            }
        }
        GgmlType::BF16 => {
            for (o, b) in out.iter_mut().zip(data.chunks_exact(2)) {
                *o = convert(bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32());
            }
        }
        GgmlType::Q8_0 => {
            for (o, b) in out.chunks_exact_mut(32).zip(data.chunks_exact(34)) {
                let d = le_f16(b);
                for (o, &q) in o.iter_mut().zip(&b[2..]) {
                    *o = convert(f32::from(q as i8) * d);
                }
            }
        }
        GgmlType::Q4_0 => {
            for (o, b) in out.chunks_exact_mut(32).zip(data.chunks_exact(18)) {
                let d = le_f16(b);
                let (lo, hi) = o.split_at_mut(16);
                for ((l, h), &q) in lo.iter_mut().zip(hi).zip(&b[2..]) {
                    *l = convert(f32::from(i16::from(q & 0x0f) - 8) * d);
                    *h = convert(f32::from(i16::from(q >> 4) - 8) * d);
                }
            }
        }
        GgmlType::Q4_1 => {
            for (o, b) in out.chunks_exact_mut(32).zip(data.chunks_exact(20)) {
                let (d, m) = (le_f16(b), le_f16(&b[2..]));
                let (lo, hi) = o.split_at_mut(16);
                for ((l, h), &q) in lo.iter_mut().zip(hi).zip(&b[4..]) {
                    *l = convert(f32::from(q & 0x0f) * d + m);
                    *h = convert(f32::from(q >> 4) * d + m);
                }
            }
        }
        // Five-bit blocks: the fifth bits of the 32 quants in one little-endian word after
        // the scale(s), bit j for quant j, then the low nibbles as in Q4_0 / Q4_1.
        GgmlType::Q5_0 => {
            for (o, b) in out.chunks_exact_mut(32).zip(data.chunks_exact(22)) {
                let d = le_f16(b);
                let fifth = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
                for (j, o) in o.iter_mut().enumerate() {
                    *o = convert(f32::from(i16::from(five_bit(&b[6..], fifth, j)) - 16) * d);
                }
            }
        }
        GgmlType::Q5_1 => {
            for (o, b) in out.chunks_exact_mut(32).zip(data.chunks_exact(24)) {
                let (d, m) = (le_f16(b), le_f16(&b[2..]));
                let fifth = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
                for (j, o) in o.iter_mut().enumerate() {
                    *o = convert(f32::from(five_bit(&b[8..], fifth, j)) * d + m);
                }
            }
        }
        // K-quants: 256-element super-blocks of 8 sub-blocks of 32, each with a 6-bit scale and
        // (Q4_K, Q5_K) a 6-bit minimum under the super-block's f16 scales.
        GgmlType::Q4_K | GgmlType::Q5_K => {
            let bytes = if ty == GgmlType::Q4_K { 144 } else { 176 };
            for (o, b) in out.chunks_exact_mut(256).zip(data.chunks_exact(bytes)) {
                for (s, o) in o.chunks_exact_mut(32).enumerate() {
                    let (step, offset, q) = k_sub_block(b, s);
                    for (o, &q) in o.iter_mut().zip(&q) {
                        *o = convert(step * f32::from(q) - offset);
                    }
                }
            }
        }
        // Q6_K: 16 sub-blocks of 16 with signed 8-bit scales, quants of 6 bits (low four in
        // `low`, top two in `high`) less 32, under one f16 scale at the end of the block.
        GgmlType::Q6_K => {
            for (o, b) in out.chunks_exact_mut(256).zip(data.chunks_exact(210)) {
                let (low, high, scales) = (&b[..128], &b[128..192], &b[192..208]);
                let d = le_f16(&b[208..]);
                // Each half of 128 elements takes 64 `low` bytes and 32 `high` bytes: element
                // r = 32k + l of the half has its low nibble in low[l + 32 (k % 2)] (the low
                // nibble for k < 2, the high one after) and its top bits at 2k in high[l].
                for (half, o) in o.chunks_exact_mut(128).enumerate() {
                    let (low, high) = (&low[64 * half..][..64], &high[32 * half..][..32]);
                    for (r, o) in o.iter_mut().enumerate() {
                        let (k, l) = (r / 32, r % 32);
                        let byte = low[l + 32 * (k % 2)];
                        let nib = if k < 2 { byte & 0x0f } else { byte >> 4 };
                        let q = i16::from(nib | (((high[l] >> (2 * k)) & 3) << 4)) - 32;
                        let scale = f32::from(scales[8 * half + r / 16] as i8);
                        *o = convert(d * scale * f32::from(q));
                    }
                }
            }
        }
        _ => unreachable!("dequantize_with rejects {ty} before decoding"),
    }
}

/// Q4_K super-blocks rewritten as Q4_1 blocks, one per 32-element sub-block: the same 4-bit
/// quants under the sub-block's own step f16(d * scale) and minimum f16(-dmin * min), so an
/// element moves only by those two roundings (2^-11 of the step and of the minimum: at most
/// 1.5 x 2^-10 of the sub-block's largest magnitude when the quantiser spanned the sub-block's
/// range). None if any element would move by more than 2^-9 of its sub-block's largest
/// magnitude, the most that widening to bf16 moves an element (a step or minimum outside f16's
/// normal range), or if `data` is not whole super-blocks.
pub fn q4_k_as_q4_1(data: &[u8]) -> Option<Vec<u8>> {
    if data.is_empty() || !data.len().is_multiple_of(144) {
        return None;
    }
    let mut out = Vec::with_capacity(data.len() / 144 * 8 * 20);
    for b in data.chunks_exact(144) {
        for s in 0..8 {
            let (step, offset, q) = k_sub_block(b, s);
            let (step16, min16) = (f16::from_f32(step), f16::from_f32(-offset));
            let (mut largest, mut moved) = (0f32, 0f32);
            for &q in &q {
                let exact = step * f32::from(q) - offset;
                let kept = f32::from(q) * step16.to_f32() + min16.to_f32();
                largest = largest.max(exact.abs());
                moved = moved.max((kept - exact).abs());
            }
            // NaN (a NaN or infinite scale) refuses too.
            match moved.partial_cmp(&(largest / 512.0)) {
                Some(std::cmp::Ordering::Greater) | None => return None,
                _ => {}
            }
            out.extend(step16.to_le_bytes());
            out.extend(min16.to_le_bytes());
            // Q4_1 keeps elements j and j + 16 in byte j's low and high nibbles.
            out.extend((0..16).map(|j| q[j] | (q[j + 16] << 4)));
        }
    }
    Some(out)
}

/// Q6_K super-blocks (210 bytes, 256 elements) as the engine's 32-element Q6_K blocks
/// (`crate::model::quant`), 8 of 28 bytes each, exactly: each repeats the super-block's f16
/// scale and takes the scales of its two 16-element sub-blocks and its 32 quants, so every
/// element decodes to the f32 that `dequantize_f32` gives for the original. `data` is whole
/// super-blocks (as the reader hands out a Q6_K tensor's bytes).
pub fn q6_k_as_blocks(data: &[u8]) -> Vec<u8> {
    assert!(
        data.len().is_multiple_of(210),
        "q6_k_as_blocks: {} bytes are not whole 210-byte super-blocks",
        data.len()
    );
    let mut out = Vec::with_capacity(data.len() / 210 * 8 * QuantType::Q6_K.block_bytes());
    for b in data.chunks_exact(210) {
        let (low, high, scales) = (&b[..128], &b[128..192], &b[192..208]);
        let d = f16::from_le_bytes([b[208], b[209]]);
        // As `decode_run` reads them: element r = 32k + l of a half of 128 has its low nibble
        // in low[64 half + l + 32 (k % 2)] (the low nibble for k < 2, the high one after) and
        // its top bits at 2k in high[32 half + l]; sub-block s of 16 has scale scales[s].
        let quant = |e: usize| {
            let (half, r) = (e / 128, e % 128);
            let (k, l) = (r / 32, r % 32);
            let byte = low[64 * half + l + 32 * (k % 2)];
            let nib = if k < 2 { byte & 0x0f } else { byte >> 4 };
            nib | (((high[32 * half + l] >> (2 * k)) & 3) << 4)
        };
        for s in 0..8 {
            let q: [u8; 32] = std::array::from_fn(|j| quant(32 * s + j));
            let sc = [scales[2 * s] as i8, scales[2 * s + 1] as i8];
            q6_block(d, sc, &q, &mut out);
        }
    }
    out
}

/// Q5_0 blocks rewritten as Q8_0, exactly: the same scale, quants q - 16 as i8.
pub fn q5_0_as_q8_0(data: &[u8]) -> Option<Vec<u8>> {
    if data.is_empty() || !data.len().is_multiple_of(22) {
        return None;
    }
    let mut out = Vec::with_capacity(data.len() / 22 * 34);
    for b in data.chunks_exact(22) {
        let fifth = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
        out.extend(&b[..2]);
        out.extend((0..32).map(|j| (i16::from(five_bit(&b[6..], fifth, j)) - 16) as i8 as u8));
    }
    Some(out)
}

/// Quant `j` of a five-bit block: its nibble (low nibbles are quants 0-15, high ones 16-31)
/// with bit j of `fifth` on top.
fn five_bit(nibbles: &[u8], fifth: u32, j: usize) -> u8 {
    let nib = if j < 16 {
        nibbles[j] & 0x0f
    } else {
        nibbles[j - 16] >> 4
    };
    nib | ((((fifth >> j) & 1) as u8) << 4)
}

/// Sub-block `s` (elements 32s..32s + 32) of a Q4_K (144-byte) or Q5_K (176-byte) super-block
/// `b`: its step d * scale, its offset dmin * min, and its quants. Sub-blocks 2g and 2g + 1
/// share the 32 bytes of nibbles at 32g (low nibbles, then high; the nibbles are the block's
/// last 128 bytes); Q5_K's fifth bits for sub-block s are bit s of each of the 32 bytes at 16.
fn k_sub_block(b: &[u8], s: usize) -> (f32, f32, [u8; 32]) {
    let (scale, min) = k_scale_min(&b[4..16], s);
    let (step, offset) = (
        le_f16(b) * f32::from(scale),
        le_f16(&b[2..]) * f32::from(min),
    );
    let quads = &b[b.len() - 128..][32 * (s / 2)..][..32];
    let mut q = [0u8; 32];
    for (l, q) in q.iter_mut().enumerate() {
        *q = if s.is_multiple_of(2) {
            quads[l] & 0x0f
        } else {
            quads[l] >> 4
        };
        if b.len() == 176 {
            *q |= ((b[16 + l] >> s) & 1) << 4;
        }
    }
    (step, offset, q)
}

/// Sub-block `s`'s 6-bit scale and minimum in a K-quant's 12 packed bytes: sub-blocks 0-3
/// have theirs in the low 6 bits of bytes s and s + 4; sub-blocks 4-7 have their low 4 bits
/// in byte s + 4 (scale below, minimum above) and their top 2 bits in the spare top bits of
/// bytes s - 4 (scale) and s (minimum).
fn k_scale_min(packed: &[u8], s: usize) -> (u8, u8) {
    if s < 4 {
        (packed[s] & 63, packed[s + 4] & 63)
    } else {
        (
            (packed[s + 4] & 0x0f) | ((packed[s - 4] >> 6) << 4),
            (packed[s + 4] >> 4) | ((packed[s] >> 6) << 4),
        )
    }
}

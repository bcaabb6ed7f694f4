//! The block formats weights may keep in memory (GGUF's Q8_0, Q4_0, Q4_1, and Q6_K in a
//! 32-element form): their exact decoding to f32 and the project's round-to-nearest quantiser.
//!
//! Every format stores 32 consecutive elements of a row in one block:
//! - Q8_0, 34 bytes: f16 `d`, then 32 `i8` quants; element `j` is `q[j] * d`.
//! - Q4_0, 18 bytes: f16 `d`, then 16 bytes; byte `j` holds element `j` in its low nibble and
//!   element `j + 16` in its high nibble; an element is `(q - 8) * d`.
//! - Q4_1, 20 bytes: f16 `d`, f16 `m`, then 16 bytes of nibbles as Q4_0; an element is
//!   `q * d + m`.
//! - Q6_K, 28 bytes: f16 `d`, the `i8` scales `sc0` (elements 0..15) and `sc1` (16..31), 8
//!   bytes of the quants' top two bits, then 16 bytes of their low four bits in Q4_0's order;
//!   quants are 0..63 and an element is `(d * sc) * (q - 32)`. Byte `4 + 4h + i` (h = 0, 1;
//!   i = 0..3) holds, from bit 0 up, the top bits of elements `4h + i`, `16 + 4h + i`,
//!   `8 + 4h + i` and `24 + 4h + i`, the order in which the GPU's lanes, each holding four of
//!   the nibble bytes, take them (`q6_top_bits` in kernels/quant/decode.cuh). The top bits
//!   count as the block's header, so its quants are laid out, moved and read as Q4's nibbles.
//!   GGUF's Q6_K stores 256 elements in 210 bytes under one `d`; a super-block becomes 8 of
//!   these blocks exactly, each repeating its `d` (`gguf::q6_k_as_blocks`), so the code that
//!   works on 32-element blocks (row slicing, the GPU's row layout, the CPU's dot products)
//!   needs no second block size.
//!
//! Multi-byte fields are little-endian, as in GGUF files.

use std::fmt;

use half::f16;

/// Elements per block in every format here.
pub const BLOCK: usize = 32;

#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuantType {
    Q8_0,
    Q4_0,
    Q4_1,
    Q6_K,
}

impl QuantType {
    pub const ALL: [QuantType; 4] = [
        QuantType::Q8_0,
        QuantType::Q4_0,
        QuantType::Q4_1,
        QuantType::Q6_K,
    ];

    /// Bytes of one 32-element block.
    pub fn block_bytes(self) -> usize {
        match self {
            QuantType::Q8_0 => 34,
            QuantType::Q4_0 => 18,
            QuantType::Q4_1 => 20,
            QuantType::Q6_K => 28,
        }
    }

    /// Bytes of the block's header before its quants: the scale `d`, then the minimum for
    /// Q4_1, or for Q6_K the two half-block scales and the quants' top bits.
    pub fn header_bytes(self) -> usize {
        match self {
            QuantType::Q8_0 | QuantType::Q4_0 => 2,
            QuantType::Q4_1 => 4,
            QuantType::Q6_K => 12,
        }
    }

    /// Bytes of the block's quants.
    pub fn quant_bytes(self) -> usize {
        self.block_bytes() - self.header_bytes()
    }

    pub fn name(self) -> &'static str {
        match self {
            QuantType::Q8_0 => "Q8_0",
            QuantType::Q4_0 => "Q4_0",
            QuantType::Q4_1 => "Q4_1",
            QuantType::Q6_K => "Q6_K",
        }
    }
}

impl fmt::Display for QuantType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

fn le_f16(b: &[u8]) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
}

/// Decodes one block exactly (every result is an f32 product of an f16 and a small integer,
/// plus an f16 for Q4_1, each computed once in f32 as ggml does).
pub fn dequantize_block(ty: QuantType, b: &[u8], out: &mut [f32]) {
    debug_assert_eq!(b.len(), ty.block_bytes());
    debug_assert_eq!(out.len(), BLOCK);
    match ty {
        QuantType::Q8_0 => {
            let d = le_f16(b);
            for (o, &q) in out.iter_mut().zip(&b[2..34]) {
                *o = f32::from(q as i8) * d;
            }
        }
        QuantType::Q4_0 => {
            let d = le_f16(b);
            let (lo, hi) = out.split_at_mut(16);
            for ((l, h), &q) in lo.iter_mut().zip(hi).zip(&b[2..18]) {
                *l = f32::from(i16::from(q & 0x0f) - 8) * d;
                *h = f32::from(i16::from(q >> 4) - 8) * d;
            }
        }
        QuantType::Q4_1 => {
            let (d, m) = (le_f16(b), le_f16(&b[2..]));
            let (lo, hi) = out.split_at_mut(16);
            for ((l, h), &q) in lo.iter_mut().zip(hi).zip(&b[4..20]) {
                *l = f32::from(q & 0x0f) * d + m;
                *h = f32::from(q >> 4) * d + m;
            }
        }
        QuantType::Q6_K => {
            // ggml's order: (d * sc) once per half, then times q - 32.
            let d = le_f16(b);
            let scale = [d * f32::from(b[2] as i8), d * f32::from(b[3] as i8)];
            for (j, (o, q)) in out.iter_mut().zip(q6_quants(b)).enumerate() {
                *o = scale[j / 16] * f32::from(i16::from(q) - 32);
            }
        }
    }
}

/// Where a Q6_K block's top two bits (8 bytes) and low four bits (16 bytes) of its quants
/// start.
const Q6_TOP: usize = 4;
const Q6_NIBBLES: usize = 12;

/// The byte of a Q6_K block (its offset in the block) that holds element `j`'s top two bits,
/// and their shift within it.
fn q6_top_bits_at(j: usize) -> (usize, u32) {
    let (half, r) = (j / 16, j % 16);
    (
        Q6_TOP + 4 * ((r >> 2) & 1) + (r & 3),
        (2 * half + 4 * (r >> 3)) as u32,
    )
}

/// The 32 quants (0..63) of a Q6_K block.
fn q6_quants(b: &[u8]) -> [u8; 32] {
    std::array::from_fn(|j| {
        let nib = (b[Q6_NIBBLES + j % 16] >> (4 * (j / 16))) & 0x0f;
        let (at, shift) = q6_top_bits_at(j);
        nib | (((b[at] >> shift) & 3) << 4)
    })
}

/// Appends the Q6_K block of scale `d`, half-block scales `sc` (elements 0..15, 16..31) and
/// quants `q` (each 0..63).
pub fn q6_block(d: f16, sc: [i8; 2], q: &[u8; 32], out: &mut Vec<u8>) {
    let mut b = [0u8; 28];
    b[..2].copy_from_slice(&d.to_bits().to_le_bytes());
    b[2..4].copy_from_slice(&[sc[0] as u8, sc[1] as u8]);
    for j in 0..16 {
        b[Q6_NIBBLES + j] = (q[j] & 0x0f) | ((q[j + 16] & 0x0f) << 4);
    }
    for (j, &qj) in q.iter().enumerate() {
        debug_assert!(qj < 64, "Q6_K quant {qj} is not 6 bits");
        let (at, shift) = q6_top_bits_at(j);
        b[at] |= ((qj >> 4) & 3) << shift;
    }
    out.extend_from_slice(&b);
}

/// Decodes whole blocks: `data` holds `out.len() / 32` of them. With AVX2 (and F16C for the scales) eight elements at a
/// time, to the same values bit for bit (the same f32 products and sums, never fused).
pub fn dequantize_row(ty: QuantType, data: &[u8], out: &mut [f32]) {
    assert_eq!(out.len() % BLOCK, 0, "dequantize_row: not whole blocks");
    assert_eq!(
        data.len(),
        out.len() / BLOCK * ty.block_bytes(),
        "dequantize_row: block bytes do not match the element count"
    );
    #[cfg(target_arch = "x86_64")]
    if has_avx2_f16c() {
        // SAFETY: AVX2 and F16C detected; data and out hold the same number of whole blocks (asserted).
        unsafe { avx2::dequantize_row(ty, data, out) };
        return;
    }
    dequantize_row_scalar(ty, data, out);
}

fn dequantize_row_scalar(ty: QuantType, data: &[u8], out: &mut [f32]) {
    for (o, b) in out
        .chunks_exact_mut(BLOCK)
        .zip(data.chunks_exact(ty.block_bytes()))
    {
        dequantize_block(ty, b, o);
    }
}

#[cfg(target_arch = "x86_64")]
fn has_avx2_f16c() -> bool {
    use std::sync::OnceLock;
    static AVX2: OnceLock<bool> = OnceLock::new();
    *AVX2.get_or_init(|| {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("f16c")
    })
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use std::arch::x86_64::*;

    use super::{QuantType, BLOCK};

    /// Eight i32 lanes as f32 (exact: |q| < 2^24), times `d`, plus `m` when given (never fused,
    /// as the scalar decode).
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn values8(q: __m256i, d: __m256, m: Option<__m256>) -> __m256 {
        let v = _mm256_mul_ps(_mm256_cvtepi32_ps(q), d);
        match m {
            Some(m) => _mm256_add_ps(v, m),
            None => v,
        }
    }

    /// The little-endian f16 at `b` in every lane (F16C: exact, as every f16 is an f32).
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn f16x8(b: &[u8]) -> __m256 {
        let h = _mm_set1_epi16(i16::from_le_bytes([b[0], b[1]]));
        _mm256_cvtph_ps(h)
    }

    /// One block's 32 values as four vectors of eight, in element order, bit for bit the
    /// scalar `dequantize_block`'s.
    ///
    /// # Safety
    /// The CPU must have AVX2 and F16C; `b` is one whole block of `ty`.
    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn block8s(ty: QuantType, b: &[u8]) -> [__m256; 4] {
        debug_assert_eq!(b.len(), ty.block_bytes());
        let d = f16x8(b);
        match ty {
            QuantType::Q8_0 => std::array::from_fn(|k| {
                // SAFETY: bytes 2 + 8k .. 10 + 8k lie in the 34-byte block.
                let q = _mm_loadl_epi64(b.as_ptr().add(2 + 8 * k) as *const __m128i);
                values8(_mm256_cvtepi8_epi32(q), d, None)
            }),
            // Out of line: inlined, it made this function too large to be inlined into the
            // dot products' loops, and the other formats' CPU decode ran at about half speed.
            QuantType::Q6_K => q6_k_block8s(b),
            QuantType::Q4_0 | QuantType::Q4_1 => {
                let (head, m) = if ty == QuantType::Q4_1 {
                    (4, Some(f16x8(&b[2..])))
                } else {
                    (2, None)
                };
                let mask = _mm_set1_epi8(0x0f);
                // SAFETY: the 16 bytes of nibbles end the block.
                let raw = _mm_loadu_si128(b.as_ptr().add(head) as *const __m128i);
                let lo = _mm_and_si128(raw, mask);
                let hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
                let bias = _mm256_set1_epi32(if m.is_some() { 0 } else { 8 });
                let v = |x: __m128i| values8(_mm256_sub_epi32(_mm256_cvtepu8_epi32(x), bias), d, m);
                [
                    v(lo),
                    v(_mm_srli_si128(lo, 8)),
                    v(hi),
                    v(_mm_srli_si128(hi, 8)),
                ]
            }
        }
    }

    /// `block8s` for a Q6_K block.
    #[target_feature(enable = "avx2,f16c")]
    #[inline(never)]
    unsafe fn q6_k_block8s(b: &[u8]) -> [__m256; 4] {
        // The two half-block scales as the scalar decode computes them.
        let d = super::le_f16(b);
        let s0 = _mm256_set1_ps(d * f32::from(b[2] as i8));
        let s1 = _mm256_set1_ps(d * f32::from(b[3] as i8));
        let (mask, three) = (_mm_set1_epi8(0x0f), _mm_set1_epi8(3));
        // SAFETY: the 16 bytes of nibbles and the 8 of top bits lie in the 28-byte block.
        let nib = _mm_loadu_si128(b.as_ptr().add(super::Q6_NIBBLES) as *const __m128i);
        let top = _mm_loadl_epi64(b.as_ptr().add(super::Q6_TOP) as *const __m128i);
        // Top byte i holds elements i and 8 + i of each half (the latter four bits up):
        // the bytes, then the bytes four bits down, give each element of a half its
        // byte in element order, the first half's bits at 0-1 and the second's at 2-3.
        let top = _mm_unpacklo_epi64(top, _mm_srli_epi16(top, 4));
        let join = |nib: __m128i, top: __m128i| {
            _mm_or_si128(
                _mm_and_si128(nib, mask),
                _mm_slli_epi16(_mm_and_si128(top, three), 4),
            )
        };
        let lo = join(nib, top);
        let hi = join(_mm_srli_epi16(nib, 4), _mm_srli_epi16(top, 2));
        let bias = _mm256_set1_epi32(32);
        let v = |x: __m128i, s: __m256| {
            values8(_mm256_sub_epi32(_mm256_cvtepu8_epi32(x), bias), s, None)
        };
        [
            v(lo, s0),
            v(_mm_srli_si128(lo, 8), s0),
            v(hi, s1),
            v(_mm_srli_si128(hi, 8), s1),
        ]
    }

    /// # Safety
    /// The CPU must have AVX2 and F16C; `data` holds `out.len() / 32` blocks of `ty`.
    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn dequantize_row(ty: QuantType, data: &[u8], out: &mut [f32]) {
        let bytes = ty.block_bytes();
        for (o, b) in out.chunks_exact_mut(BLOCK).zip(data.chunks_exact(bytes)) {
            for (k, v) in block8s(ty, b).into_iter().enumerate() {
                // SAFETY: 8k + 8 <= 32, within the block's output.
                _mm256_storeu_ps(o.as_mut_ptr().add(8 * k), v);
            }
        }
    }
}

/// Quantises one block of 32 values to nearest (the choice of scale is ggml's reference one,
/// so files we write and files ggml writes agree on what a value becomes), appending its
/// bytes to `out`.
pub fn quantize_block(ty: QuantType, x: &[f32], out: &mut Vec<u8>) {
    debug_assert_eq!(x.len(), BLOCK);
    match ty {
        QuantType::Q8_0 => {
            let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
            let d = amax / 127.0;
            let inv = if d == 0.0 { 0.0 } else { 1.0 / d };
            out.extend_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
            out.extend(x.iter().map(|v| (v * inv).round() as i8 as u8));
        }
        QuantType::Q4_0 => {
            // The value of largest magnitude, sign kept, maps to quant 0 (-8 after the
            // offset), so it is exact at the cost of one step on the other side.
            let extreme = x
                .iter()
                .fold(0f32, |a, &v| if v.abs() > a.abs() { v } else { a });
            let d = extreme / -8.0;
            let inv = if d == 0.0 { 0.0 } else { 1.0 / d };
            out.extend_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
            let q = |v: f32| ((v * inv + 8.5) as i32).clamp(0, 15) as u8;
            out.extend((0..16).map(|j| q(x[j]) | (q(x[j + 16]) << 4)));
        }
        QuantType::Q4_1 => {
            let min = x.iter().copied().fold(f32::INFINITY, f32::min);
            let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let d = (max - min) / 15.0;
            let inv = if d == 0.0 { 0.0 } else { 1.0 / d };
            out.extend_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
            out.extend_from_slice(&f16::from_f32(min).to_bits().to_le_bytes());
            let q = |v: f32| (((v - min) * inv + 0.5) as i32).clamp(0, 15) as u8;
            out.extend((0..16).map(|j| q(x[j]) | (q(x[j + 16]) << 4)));
        }
        QuantType::Q6_K => {
            // Round to nearest, as the other formats (not ggml's search for each sub-block's
            // best scale). Each half's step is its largest magnitude over 31 (quants 1..63
            // about 32), as an i8 multiple of d: d is the larger step over 127, so that step is
            // within half a part in 127 and the other as close as an i8 multiple allows.
            let amax = |h: &[f32]| h.iter().fold(0f32, |a, v| a.max(v.abs()));
            let step = [amax(&x[..16]) / 31.0, amax(&x[16..]) / 31.0];
            let d = f16::from_f32(step[0].max(step[1]) / 127.0);
            let df = d.to_f32();
            let sc = step.map(|s| {
                if df == 0.0 {
                    0
                } else {
                    (s / df).round().clamp(-127.0, 127.0) as i8
                }
            });
            let q: [u8; 32] = std::array::from_fn(|j| {
                let s = df * f32::from(sc[j / 16]);
                if s == 0.0 {
                    32
                } else {
                    ((x[j] / s).round() as i32 + 32).clamp(0, 63) as u8
                }
            });
            q6_block(d, sc, &q, out);
        }
    }
}

/// Quantises a whole number of blocks.
pub fn quantize_row(ty: QuantType, x: &[f32]) -> Vec<u8> {
    assert_eq!(
        x.len() % BLOCK,
        0,
        "quantize_row: not a whole number of blocks"
    );
    let mut out = Vec::with_capacity(x.len() / BLOCK * ty.block_bytes());
    for b in x.chunks_exact(BLOCK) {
        quantize_block(ty, b, &mut out);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(v: f32) -> [u8; 2] {
        f16::from_f32(v).to_bits().to_le_bytes()
    }

    /// Blocks written byte by byte from the format's definition, with the expected values
    /// worked out by hand.
    #[test]
    fn hand_made_blocks_decode_to_hand_computed_values() {
        // Q8_0: d = 0.5, quants 0, 1, -1, 2, -2, … , 127 at the end, -128 at 30.
        let mut b = h(0.5).to_vec();
        let mut want = Vec::new();
        for j in 0..32i32 {
            let q: i8 = match j {
                30 => -128,
                31 => 127,
                _ => {
                    let k = (j + 1) / 2;
                    if j % 2 == 1 {
                        k as i8
                    } else {
                        -(k as i8)
                    }
                }
            };
            b.push(q as u8);
            want.push(f32::from(q) * 0.5);
        }
        let mut out = [0f32; 32];
        dequantize_block(QuantType::Q8_0, &b, &mut out);
        assert_eq!(out.to_vec(), want);
        assert_eq!(out[30], -64.0);
        assert_eq!(out[31], 63.5);

        // Q4_0: d = 0.25; byte j = low nibble j, high nibble 15 - j. Element j (j < 16) is
        // (j - 8) * 0.25, element j + 16 is (7 - j) * 0.25.
        let mut b = h(0.25).to_vec();
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        dequantize_block(QuantType::Q4_0, &b, &mut out);
        for j in 0..16 {
            assert_eq!(out[j], (j as f32 - 8.0) * 0.25, "Q4_0 element {j}");
            assert_eq!(
                out[j + 16],
                (7.0 - j as f32) * 0.25,
                "Q4_0 element {}",
                j + 16
            );
        }
        assert_eq!(out[0], -2.0);
        assert_eq!(out[16], 1.75);

        // Q6_K: d = 0.5, sc0 = -3, sc1 = 2, quants q[j] = (37 j + 11) % 64 (every top-bit
        // pattern), packed here from the format's description: byte 4 + 4h + i the top bits of
        // elements 4h + i, 16 + 4h + i, 8 + 4h + i and 24 + 4h + i from bit 0 up, then bytes
        // 12..28 the low nibbles. Element j is (0.5 * sc) * (q[j] - 32).
        let q: [u8; 32] = std::array::from_fn(|j| ((37 * j + 11) % 64) as u8);
        let mut b = h(0.5).to_vec();
        b.extend([(-3i8) as u8, 2]);
        for hh in 0..2 {
            for i in 0..4 {
                let e = 4 * hh + i;
                b.push(
                    (q[e] >> 4)
                        | ((q[16 + e] >> 4) << 2)
                        | ((q[8 + e] >> 4) << 4)
                        | ((q[24 + e] >> 4) << 6),
                );
            }
        }
        b.extend((0..16).map(|j| (q[j] & 15) | ((q[16 + j] & 15) << 4)));
        assert_eq!(b.len(), QuantType::Q6_K.block_bytes());
        let mut packed = Vec::new();
        q6_block(f16::from_f32(0.5), [-3, 2], &q, &mut packed);
        assert_eq!(packed, b, "q6_block");
        dequantize_block(QuantType::Q6_K, &b, &mut out);
        for j in 0..32 {
            let sc = if j < 16 { -3.0 } else { 2.0 };
            let want = (0.5 * sc) * (f32::from(q[j]) - 32.0);
            assert_eq!(out[j], want, "Q6_K element {j} (q {})", q[j]);
        }
        // A few by hand: q[0] = 11, q[5] = 196 % 64 = 4, q[16] = 603 % 64 = 27, q[31] = 1158 %
        // 64 = 6.
        assert_eq!(
            [out[0], out[5], out[16], out[31]],
            [31.5, 42.0, -5.0, -26.0]
        );

        // Q4_1: d = 2, m = -3; byte j = low nibble (j % 4), high nibble 15.
        let mut b = h(2.0).to_vec();
        b.extend(h(-3.0));
        b.extend((0..16u8).map(|j| (j % 4) | 0xf0));
        dequantize_block(QuantType::Q4_1, &b, &mut out);
        for j in 0..16 {
            assert_eq!(out[j], (j % 4) as f32 * 2.0 - 3.0, "Q4_1 element {j}");
            assert_eq!(out[j + 16], 27.0, "Q4_1 element {}", j + 16);
        }
    }

    fn data(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let u = (i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8;
                let v = u as f32 / 16777216.0 - 0.5;
                // A few outliers per row, as real weights have.
                if i % 97 == 5 {
                    v * 9.0
                } else {
                    v
                }
            })
            .collect()
    }

    /// Quantise then decode: every element within the format's bound (half a step for
    /// round-to-nearest, one step for Q4_0's clamped side, plus the f16 rounding of the scale
    /// and minimum), and the known exact cases exact.
    #[test]
    fn quantise_round_trip_stays_within_the_bounds() {
        let x = data(32 * 64, 7);
        for ty in QuantType::ALL {
            let q = quantize_row(ty, &x);
            assert_eq!(q.len(), 64 * ty.block_bytes());
            let mut back = vec![0f32; x.len()];
            dequantize_row(ty, &q, &mut back);
            let mut worst = 0f32;
            for (blk, (xb, bb)) in x.chunks(32).zip(back.chunks(32)).enumerate() {
                let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
                let (min, max) = xb
                    .iter()
                    .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &v| {
                        (a.min(v), b.max(v))
                    });
                // f16 keeps 11 significant bits: a relative error of at most 2^-11 per field.
                let f16_rel = 1.0 / 2048.0;
                let bound = match ty {
                    QuantType::Q8_0 => 0.5 * amax / 127.0 + amax * f16_rel,
                    QuantType::Q4_0 => amax / 8.0 + amax * f16_rel,
                    QuantType::Q4_1 => {
                        let d = (max - min) / 15.0;
                        0.5 * d + min.abs() * f16_rel + (max - min) * f16_rel
                    }
                    // Half a step of at most amax / 62 (amax / 31, rounded to an i8 multiple
                    // of d = amax / 3937), the clamp at quant 63 when that rounding shrank
                    // the step (at most 31 d / 2 = amax / 254), and d's f16 rounding over
                    // quants of up to 32.
                    QuantType::Q6_K => amax / 62.0 + amax / 254.0 + 2.0 * amax * f16_rel,
                } * 1.0001;
                for (j, (a, b)) in xb.iter().zip(bb).enumerate() {
                    let err = (a - b).abs();
                    worst = worst.max(err / amax);
                    assert!(
                        err <= bound,
                        "{ty} block {blk} element {j}: {a} became {b} (error {err}, bound {bound})"
                    );
                }
            }
            println!("{ty}: worst round-trip error {worst:.3e} of the block's largest magnitude");
        }
        // An all-zero block is all zero in every format.
        for ty in QuantType::ALL {
            let q = quantize_row(ty, &[0f32; 32]);
            let mut back = vec![1f32; 32];
            dequantize_row(ty, &q, &mut back);
            assert!(back.iter().all(|&v| v == 0.0), "{ty}");
        }
    }

    /// The AVX2 decoder gives the scalar one's values bit for bit, for every byte pattern the
    /// quants can hold and scales of every sign and magnitude.
    #[test]
    fn vector_and_scalar_decoding_agree_bit_for_bit() {
        let mut s = 0x1234_5678_u64;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        for ty in QuantType::ALL {
            let blocks = 500;
            let mut data: Vec<u8> = (0..blocks * ty.block_bytes())
                .map(|_| next() as u8)
                .collect();
            // Finite scales (a random f16 may be NaN or infinite, which decode the same way but
            // do not compare equal). Q6_K's only f16 is `d`: its i8 scales and top bits stay
            // random.
            let f16s = match ty {
                QuantType::Q6_K => 1,
                _ => ty.header_bytes() / 2,
            };
            for b in data.chunks_exact_mut(ty.block_bytes()) {
                for f in 0..f16s {
                    let v = (next() % 2000) as f32 / 100.0 - 10.0;
                    b[2 * f..2 * f + 2].copy_from_slice(&h(v));
                }
            }
            let mut a = vec![0f32; blocks * 32];
            let mut b = vec![0f32; blocks * 32];
            dequantize_row(ty, &data, &mut a);
            dequantize_row_scalar(ty, &data, &mut b);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert!(bits(&a) == bits(&b), "{ty}");
        }
    }

    /// Quantising what a block decodes to gives back the same block (the quantiser is a
    /// fixed point on its own output): the scale and every quant land where they were.
    #[test]
    fn quantising_a_decoded_q8_block_reproduces_it() {
        let x = data(32 * 8, 3);
        let q = quantize_row(QuantType::Q8_0, &x);
        let mut back = vec![0f32; x.len()];
        dequantize_row(QuantType::Q8_0, &q, &mut back);
        // amax' = 127 d exactly, so the scale is found again and every quant with it.
        assert_eq!(quantize_row(QuantType::Q8_0, &back), q);
    }
}

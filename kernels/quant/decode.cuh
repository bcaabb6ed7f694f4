// The quantised formats' decoding (GGUF Q8_0, Q4_0, Q4_1, and Q6_K in 32-element blocks, as the
// host uploads them, see
// quant.cu and src/gpu/model.rs), shared by the graph path's kernels (quant.cu), prefill and the
// megakernel's mat-vec tiles. Self-contained: q_-prefixed, no CUDA header.

#define WEIGHT_BF16 0
#define WEIGHT_Q8_0 1
#define WEIGHT_Q4_0 2
#define WEIGHT_Q4_1 3
#define WEIGHT_Q6_K 4

typedef unsigned short q_u16;
typedef unsigned int q_u32;

__device__ __forceinline__ float q_f16(q_u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ float q_bf16(q_u16 x) { return __uint_as_float(((q_u32)x) << 16); }

// Device layout (src/gpu/model.rs, DeviceMatrix): row by row, a row's quants (Q8_0 one int8
// per element; Q4_0/Q4_1/Q6_K 16 bytes per block, byte j holding element j in its low nibble
// and element j + 16 in its high nibble, GGUF's order), then its blocks' headers (f16 d, or d
// then m for Q4_1; Q6_K 12 bytes: f16 d, the i8 scales of elements 0..15 and 16..31, then 8
// bytes of the elements' top two bits, see q6_top_bits), then zeros to a multiple of 16 bytes:
// every row starts 16-byte aligned and is one contiguous piece (the megakernel copies it whole
// into shared memory). Q6_K's top bits travel with the scales so that its quants are laid out
// as Q4's: every column range of whole blocks is 16-byte aligned, and the code that reads Q4
// nibbles reads Q6_K's low four bits unchanged.
__device__ __forceinline__ constexpr int q_quant_bytes(int ty, int cols) { return ty == WEIGHT_Q8_0 ? cols : cols / 2; }
// A unit compiled for formats that exclude Q6_K may say so (Q_HAS_Q6K 0, as the megakernel's
// host does), keeping Q6_K's case out of its runtime format arithmetic.
#ifndef Q_HAS_Q6K
#define Q_HAS_Q6K 1
#endif
__device__ __forceinline__ constexpr int q_header_bytes(int ty) {
    return Q_HAS_Q6K && ty == WEIGHT_Q6_K ? 12 : ty == WEIGHT_Q4_1 ? 4 : 2;
}
__device__ __forceinline__ constexpr int q_scale_bytes(int ty, int cols) { return (cols / 32) * q_header_bytes(ty); }
__device__ __forceinline__ constexpr int q_row_bytes(int ty, int cols) {
    return q_quant_bytes(ty, cols) + ((q_scale_bytes(ty, cols) + 15) & ~15);
}

// Q6_K's top bits: header byte 4 + 4h + i (h = 0, 1; i = 0..3) holds, from bit 0 up, those of
// elements 4h + i, 16 + 4h + i, 8 + 4h + i and 24 + 4h + i, so that one header word serves the
// quarter t = h (bits 0-3 of each byte) and the quarter t = h + 2 (bits 4-7) of the block, a
// quarter being the 4 nibble bytes that hold elements 4t..4t+3 and 16+4t..16+4t+3.
// nib: a quarter's nibble bytes; hw: header word 1 + (t & 1). Returns the quarter's 6-bit
// quants (0..63), elements 4t..4t+3 in .x and 16+4t.. in .y, a byte each.
__device__ __forceinline__ uint2 q6_top_bits(q_u32 nib, q_u32 hw, int t) {
    const q_u32 g = hw >> (4 * (t >> 1));
    return make_uint2((nib & 0x0F0F0F0Fu) | ((g << 4) & 0x30303030u), ((nib >> 4) & 0x0F0F0F0Fu) | ((g << 2) & 0x30303030u));
}

// Q6_K's element j of block b of a row whose headers start at h: (d * scale) * (q - 32),
// ggml's order.
__device__ __forceinline__ float q6_element(const unsigned char* row, const unsigned char* h, int b, int j) {
    const unsigned char byte = row[b * 16 + (j & 15)];
    const int half = j >> 4, r16 = j & 15;
    const int top = (h[4 + 4 * ((r16 >> 2) & 1) + (r16 & 3)] >> (2 * half + 4 * (r16 >> 3))) & 3;
    const int q = (half ? (byte >> 4) : (byte & 15)) | (top << 4);
    const float d = q_f16((q_u16)(h[0] | (h[1] << 8)));
    return __fmul_rn(__fmul_rn(d, (float)(signed char)h[2 + half]), (float)(q - 32));
}

// Element (r, c) of a matrix of `cols` columns, decoded exactly as the CPU reference decodes
// it: one f32 product (and for Q4_1 one f32 sum), never fused.
__device__ __forceinline__ float q_element(int ty, const void* data, size_t r, int c, int cols) {
    if (ty == WEIGHT_BF16) return q_bf16(((const q_u16*)data)[r * cols + c]);
    const unsigned char* row = (const unsigned char*)data + r * q_row_bytes(ty, cols);
    const q_u16* scales = (const q_u16*)(row + q_quant_bytes(ty, cols));
    const int b = c >> 5, j = c & 31;
    if (Q_HAS_Q6K && ty == WEIGHT_Q6_K) return q6_element(row, (const unsigned char*)scales + 12 * b, b, j);
    if (ty == WEIGHT_Q8_0) return __fmul_rn((float)((const signed char*)row)[c], q_f16(scales[b]));
    const unsigned char byte = row[b * 16 + (j & 15)];
    const int q = j < 16 ? (byte & 15) : (byte >> 4);
    if (ty == WEIGHT_Q4_0) return __fmul_rn((float)(q - 8), q_f16(scales[b]));
    return __fadd_rn(__fmul_rn((float)q, q_f16(scales[2 * b])), q_f16(scales[2 * b + 1]));
}

// Byte k of w as the f32 2^23 + byte: one byte permute (the exponent of 2^23 in the top byte)
// instead of an int-to-float conversion, which runs at a quarter of the FP32 rate and would
// bound the mat-vec below the memory bandwidth.
#define QG_BIASED(w, k) __uint_as_float(__byte_perm((w), 0x4B000000u, 0x7440u | (k)))
#define QG_2P23 8388608.f

// Dot of the 8 biased bytes of words a (with lo) and b (with hi), each less off.
__device__ __forceinline__ float qg_dot_biased(q_u32 a, q_u32 b, float off, float4 lo, float4 hi) {
    float s = (QG_BIASED(a, 0) - off) * lo.x;
    s = fmaf(QG_BIASED(a, 1) - off, lo.y, s);
    s = fmaf(QG_BIASED(a, 2) - off, lo.z, s);
    s = fmaf(QG_BIASED(a, 3) - off, lo.w, s);
    s = fmaf(QG_BIASED(b, 0) - off, hi.x, s);
    s = fmaf(QG_BIASED(b, 1) - off, hi.y, s);
    s = fmaf(QG_BIASED(b, 2) - off, hi.z, s);
    s = fmaf(QG_BIASED(b, 3) - off, hi.w, s);
    return s;
}

// Dot of one lane's 8 weights with its 8 inputs (lo = first float4, hi = second), before the
// block's scale, every weight an exact small integer: Q8_0 its int8, Q4_0 its nibble - 8,
// Q4_1 its nibble (whose minimum `m` the caller applies to the inputs' sum).
template <int TY>
__device__ __forceinline__ float qg_dot(uint2 w, float4 lo, float4 hi) {
    // Q8_0: int8 q as the unsigned byte q + 128, less the bias.
    if (TY == WEIGHT_Q8_0) return qg_dot_biased(w.x ^ 0x80808080u, w.y ^ 0x80808080u, QG_2P23 + 128.f, lo, hi);
    // Q4: bytes 0..3 hold elements 4t..4t+3 in their low nibbles, 16+4t.. in their high ones.
    return qg_dot_biased(w.x & 0x0F0F0F0Fu, (w.x >> 4) & 0x0F0F0F0Fu, TY == WEIGHT_Q4_0 ? QG_2P23 + 8.f : QG_2P23,
                         lo, hi);
}

// Q6_K: one lane's two 4-element dot products (elements 4t.. against lo, 16+4t.. against hi,
// the two halves' scales differ), each weight q - 32, before the scales.
__device__ __forceinline__ float2 qg_dot_q6(q_u32 nib, q_u32 hw, int t, float4 lo, float4 hi) {
    const uint2 q = q6_top_bits(nib, hw, t);
    const float off = QG_2P23 + 32.f;
    float a = (QG_BIASED(q.x, 0) - off) * lo.x;
    a = fmaf(QG_BIASED(q.x, 1) - off, lo.y, a);
    a = fmaf(QG_BIASED(q.x, 2) - off, lo.z, a);
    a = fmaf(QG_BIASED(q.x, 3) - off, lo.w, a);
    float b = (QG_BIASED(q.y, 0) - off) * hi.x;
    b = fmaf(QG_BIASED(q.y, 1) - off, hi.y, b);
    b = fmaf(QG_BIASED(q.y, 2) - off, hi.z, b);
    b = fmaf(QG_BIASED(q.y, 3) - off, hi.w, b);
    return make_float2(a, b);
}

// A Q6_K block header's (d * scale of elements 0..15, d * scale of 16..31). The i8 scales
// become floats as QG_BIASED bytes (scale + 128, the bias taken off), not by a conversion
// instruction, which runs at a quarter of the FP32 rate.
__device__ __forceinline__ float2 q6_scales(const unsigned char* h) {
    const q_u32 w = *(const q_u32*)h, u = w ^ 0x80800000u;
    const float d = q_f16((q_u16)w);
    return make_float2(d * (QG_BIASED(u, 2) - (QG_2P23 + 128.f)), d * (QG_BIASED(u, 3) - (QG_2P23 + 128.f)));
}

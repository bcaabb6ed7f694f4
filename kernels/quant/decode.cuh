// The quantised formats' decoding (GGUF Q8_0, Q4_0, Q4_1 as the host uploads them, see
// quant.cu and src/gpu/model.rs), shared by the graph path's kernels (quant.cu), prefill and the
// megakernel's mat-vec tiles. Self-contained: q_-prefixed, no CUDA header.

#define WEIGHT_BF16 0
#define WEIGHT_Q8_0 1
#define WEIGHT_Q4_0 2
#define WEIGHT_Q4_1 3

typedef unsigned short q_u16;
typedef unsigned int q_u32;

__device__ __forceinline__ float q_f16(q_u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ float q_bf16(q_u16 x) { return __uint_as_float(((q_u32)x) << 16); }

// Device layout (src/gpu/model.rs, DeviceMatrix): row by row, a row's quants (Q8_0 one int8
// per element; Q4_0/Q4_1 16 bytes per block, byte j holding element j in its low nibble and
// element j + 16 in its high nibble, GGUF's order), then its blocks' scales (f16 d, or d then
// m for Q4_1), then zeros to a multiple of 16 bytes: every row starts 16-byte aligned and is
// one contiguous piece (the megakernel copies it whole into shared memory).
__device__ __forceinline__ constexpr int q_quant_bytes(int ty, int cols) { return ty == WEIGHT_Q8_0 ? cols : cols / 2; }
__device__ __forceinline__ constexpr int q_scale_bytes(int ty, int cols) {
    return (cols / 32) * (ty == WEIGHT_Q4_1 ? 4 : 2);
}
__device__ __forceinline__ constexpr int q_row_bytes(int ty, int cols) {
    return q_quant_bytes(ty, cols) + ((q_scale_bytes(ty, cols) + 15) & ~15);
}

// Element (r, c) of a matrix of `cols` columns, decoded exactly as the CPU reference decodes
// it: one f32 product (and for Q4_1 one f32 sum), never fused.
__device__ __forceinline__ float q_element(int ty, const void* data, size_t r, int c, int cols) {
    if (ty == WEIGHT_BF16) return q_bf16(((const q_u16*)data)[r * cols + c]);
    const unsigned char* row = (const unsigned char*)data + r * q_row_bytes(ty, cols);
    const q_u16* scales = (const q_u16*)(row + q_quant_bytes(ty, cols));
    const int b = c >> 5, j = c & 31;
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


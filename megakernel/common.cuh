// Shared device helpers for the megakernel and the baseline kernels.
// bf16 is handled as raw 16-bit words so no CUDA header is needed at run-time compile.
typedef unsigned short bf16_t;
typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ float bf16_to_f32(bf16_t x) { return __uint_as_float(((u32)x) << 16); }

// Round to nearest even, NaN kept quiet.
__device__ __forceinline__ bf16_t f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

// Widens the 8 bf16 packed in a 16-byte word.
__device__ __forceinline__ void widen8(uint4 w, float* f) {
    f[0] = __uint_as_float(w.x << 16); f[1] = __uint_as_float(w.x & 0xffff0000u);
    f[2] = __uint_as_float(w.y << 16); f[3] = __uint_as_float(w.y & 0xffff0000u);
    f[4] = __uint_as_float(w.z << 16); f[5] = __uint_as_float(w.z & 0xffff0000u);
    f[6] = __uint_as_float(w.w << 16); f[7] = __uint_as_float(w.w & 0xffff0000u);
}

// MK_DOT8_CHAINS=2 (for measuring): the 8 products summed in two chains of four (even and odd
// columns) instead of one of eight.
#ifndef MK_DOT8_CHAINS
#define MK_DOT8_CHAINS 1
#endif
__device__ __forceinline__ float dot8(uint4 w, const float* x) {
    float f[8];
    widen8(w, f);
#if MK_DOT8_CHAINS == 2
    float s0 = 0.f, s1 = 0.f;
#pragma unroll
    for (int i = 0; i < 8; i += 2) {
        s0 = fmaf(f[i], x[i], s0);
        s1 = fmaf(f[i + 1], x[i + 1], s1);
    }
    return s0 + s1;
#else
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 8; i++) s = fmaf(f[i], x[i], s);
    return s;
#endif
}

// Weights are read once per token: stream them past L1.
__device__ __forceinline__ uint4 ld_stream(const void* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(p)); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ float silu(float x) { return x / (1.f + __expf(-x)); }

// Larger value wins; on a tie the lower index wins (matches the CPU argmax).
__device__ __forceinline__ void argmax_merge(float& v, u32& i, float v2, u32 i2) {
    if (v2 > v || (v2 == v && i2 < i)) { v = v2; i = i2; }
}

__device__ __forceinline__ void warp_argmax(float& v, u32& i) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float v2 = __shfl_xor_sync(0xffffffffu, v, o);
        u32 i2 = __shfl_xor_sync(0xffffffffu, i, o);
        argmax_merge(v, i, v2, i2);
    }
}

// Per-token values every kernel reads through a device pointer.
struct TokenMeta {
    u32 token;   // token fed at this step
    u32 pos;     // its position; the sequence length is pos + 1
    u32 next;    // greedy next token, written by the baseline's argmax (the megakernel leaves it 0)
    u32 pad;
};

#define NEG_INF __int_as_float(0xff800000u)

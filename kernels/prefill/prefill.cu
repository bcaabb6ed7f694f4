// Batched prefill: the kernels around the cuBLAS products (src/gpu/prefill.rs drives them).
// A chunk of T prompt tokens is processed as [T, width] row-major activations: the residual
// stream in f32, the inputs of every product in bf16 (tensor-core operands). Self-contained:
// bf16 is handled as raw 16-bit words, so no CUDA header is needed at run-time compile.

typedef unsigned short pf_bf16;
typedef unsigned int pf_u32;

__device__ __forceinline__ float pf_widen(pf_bf16 x) { return __uint_as_float(((pf_u32)x) << 16); }

// Round to nearest even, NaN kept quiet (the rounding the decode paths use for the cache).
__device__ __forceinline__ pf_bf16 pf_narrow(float f) {
    pf_u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (pf_bf16)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (pf_bf16)(u >> 16);
}

// Two bf16 in one register, the lower column in the low half (mma operand order).
__device__ __forceinline__ pf_u32 pf_pack(float lo, float hi) {
    return (pf_u32)pf_narrow(lo) | ((pf_u32)pf_narrow(hi) << 16);
}

__device__ __forceinline__ float pf_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

#define PF_NEG_INF __int_as_float(0xff800000u)

// x[t, :] = embed[tokens[t], :] (f32). Grid: T blocks.
extern "C" __global__ void pf_embed(const pf_bf16* embed, const pf_u32* tokens, float* x, int hidden) {
    const pf_bf16* row = embed + (size_t)tokens[blockIdx.x] * hidden;
    float* dst = x + (size_t)blockIdx.x * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = pf_widen(row[i]);
}

// out[r, :] = bf16(x[r, :] / rms(x[r, :]) * w) for rows `first`.. of x. Grid: one block per
// row, PF_NORM_THREADS threads.
#define PF_NORM_THREADS 256
extern "C" __global__ void pf_rmsnorm(const float* x, const pf_bf16* w, pf_bf16* out, int n, float eps, int first) {
    __shared__ float partial[PF_NORM_THREADS / 32];
    const float* xr = x + (size_t)(first + blockIdx.x) * n;
    pf_bf16* orow = out + (size_t)blockIdx.x * n;
    float ss = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += xr[i] * xr[i];
    ss = pf_warp_sum(ss);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = ss;
    __syncthreads();
    float tot = 0.f;
#pragma unroll
    for (int i = 0; i < PF_NORM_THREADS / 32; i++) tot += partial[i];
    const float scale = rsqrtf(tot / n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) orow[i] = pf_narrow(xr[i] * scale * pf_widen(w[i]));
}

// The QKV product's rows [T, q | k | v] (f32): RoPE (rotate_half: pairs i, i + head_dim/2)
// on q and k at positions start + t; q to q_out ([T, heads * head_dim], bf16), K and V into
// the layer's cache at (kv head, position): element d of a row at
// kvh * head_stride + pos * pos_stride + d, the decode path's own layout.
// The angle is rope.cuh's (formed in double). Grid: T blocks.
extern "C" __global__ void pf_rope_kv(const float* qkv, pf_bf16* q_out, pf_bf16* k_cache, pf_bf16* v_cache,
                                      const float* inv_freq, int start, int n_heads, int n_kv, int head_dim,
                                      long long pos_stride, long long head_stride) {
    const int t = blockIdx.x, pos = start + t, half = head_dim >> 1;
    const int width = (n_heads + 2 * n_kv) * head_dim;
    const float* row = qkv + (size_t)t * width;
    for (int idx = threadIdx.x; idx < (n_heads + 2 * n_kv) * half; idx += blockDim.x) {
        const int h = idx / half, i = idx - h * half;
        float a = row[h * head_dim + i], b = row[h * head_dim + i + half];
        if (h < n_heads + n_kv) {
            float fs, fc;
            rope_sincos(pos, inv_freq[i], &fs, &fc);
            const float ra = a * fc - b * fs, rb = b * fc + a * fs;
            a = ra;
            b = rb;
        }
        pf_bf16* dst;
        if (h < n_heads) {
            dst = q_out + (size_t)t * n_heads * head_dim + h * head_dim;
        } else {
            const bool is_k = h < n_heads + n_kv;
            const int kvh = h - n_heads - (is_k ? 0 : n_kv);
            dst = (is_k ? k_cache : v_cache) + kvh * head_stride + (long long)pos * pos_stride;
        }
        dst[i] = pf_narrow(a);
        dst[i + half] = pf_narrow(b);
    }
}

// act[t, j] = bf16(silu(gate) * up) from the gate/up product's rows [T, gate | up] (f32).
extern "C" __global__ void pf_silu_mul(const float* gu, pf_bf16* act, int inter, long long total) {
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        const long long t = idx / inter, j = idx - t * inter;
        const float g = gu[t * 2 * inter + j], u = gu[t * 2 * inter + inter + j];
        act[idx] = pf_narrow(g / (1.f + expf(-g)) * u);
    }
}

// ---------------------------------------------------------------------------------------
// Causal flash attention over the chunk and everything cached before it.
//
// Block (query tile of PF_BQ rows, head): 4 warps of 16 query rows each. For each tile of
// PF_BK keys: K and V from the cache into shared memory (V transposed, so both products read
// their operands as 32-bit pairs), S = Q K^T on tensor cores (mma.sync m16n8k16 bf16 -> f32),
// online softmax in registers, O += P V with P re-used from S's accumulators as the A operand.
// Row strides carry 8 elements of padding so that a fragment's 32 lanes hit 32 banks.

#define PF_BQ 64
#define PF_BK 64
#define PF_ATT_THREADS 128

__device__ __forceinline__ void pf_mma(float* c, const pf_u32* a, pf_u32 b0, pf_u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// q, out: [T, heads * D] bf16 (chunk rows); k_cache, v_cache: the layer's cache, positions
// [0, start + T) valid; query row t sits at position start + t and sees keys 0..=start + t.
template <int D>
__device__ __forceinline__ void pf_attention(const pf_bf16* q, const pf_bf16* k_cache, const pf_bf16* v_cache,
                                             pf_bf16* out, int T, int start, int n_heads, int n_kv,
                                             long long pos_stride, long long head_stride, float scale_log2) {
    constexpr int QS = D + 8;      // row stride (elements) of the Q and K tiles
    constexpr int VS = PF_BK + 8;  // row stride of the transposed V tile
    constexpr int C8 = D / 8;      // 16-byte pieces per row
    extern __shared__ __align__(16) unsigned char pf_smem[];
    pf_bf16* qs = (pf_bf16*)pf_smem;  // [PF_BQ][QS]
    pf_bf16* ks = qs + PF_BQ * QS;    // [PF_BK][QS]
    pf_bf16* vt = ks + PF_BK * QS;    // [D][VS]

    // Blocks in a 1-D grid, heads fastest; the last query tiles (the most keys) start first,
    // so the short ones fill the tail.
    const int n_tiles = (T + PF_BQ - 1) / PF_BQ;
    const int h = blockIdx.x % n_heads, kvh = h / (n_heads / n_kv);
    const int q0 = (n_tiles - 1 - (int)(blockIdx.x / n_heads)) * PF_BQ;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    const int q_dim = n_heads * D;
    const pf_bf16* kbase = k_cache + kvh * head_stride;
    const pf_bf16* vbase = v_cache + kvh * head_stride;

    for (int idx = threadIdx.x; idx < PF_BQ * C8; idx += PF_ATT_THREADS) {
        const int r = idx / C8, c = (idx - r * C8) * 8;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (q0 + r < T) v = *(const uint4*)(q + (size_t)(q0 + r) * q_dim + h * D + c);
        *(uint4*)(qs + r * QS + c) = v;
    }
    __syncthreads();
    const int wr = warp * 16;
    pf_u32 qf[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
        const pf_bf16* p = qs + (wr + g) * QS + kk * 16 + tq * 2;
        qf[kk][0] = *(const pf_u32*)p;
        qf[kk][1] = *(const pf_u32*)(p + 8 * QS);
        qf[kk][2] = *(const pf_u32*)(p + 8);
        qf[kk][3] = *(const pf_u32*)(p + 8 * QS + 8);
    }

    float o[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m_a = PF_NEG_INF, m_b = PF_NEG_INF, l_a = 0.f, l_b = 0.f;
    // Absolute positions of this thread's two query rows (rows past T are padding: computed,
    // never stored).
    const int pa = start + q0 + wr + g, pb = pa + 8;
    const int kv_end = start + min(q0 + PF_BQ, T);

    for (int k0 = 0; k0 < kv_end; k0 += PF_BK) {
        __syncthreads();  // the previous tile is consumed
        for (int idx = threadIdx.x; idx < PF_BK * C8; idx += PF_ATT_THREADS) {
            const int r = idx / C8, c = (idx - r * C8) * 8, pos = k0 + r;
            uint4 kv = make_uint4(0u, 0u, 0u, 0u), vv = kv;
            if (pos < kv_end) {
                kv = *(const uint4*)(kbase + (long long)pos * pos_stride + c);
                vv = *(const uint4*)(vbase + (long long)pos * pos_stride + c);
            }
            *(uint4*)(ks + r * QS + c) = kv;
            const pf_bf16* ve = (const pf_bf16*)&vv;
#pragma unroll
            for (int j = 0; j < 8; j++) vt[(c + j) * VS + r] = ve[j];
        }
        __syncthreads();

        float s[PF_BK / 8][4];
#pragma unroll
        for (int n = 0; n < PF_BK / 8; n++) {
            s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < D / 16; kk++) {
                const pf_bf16* p = ks + (n * 8 + g) * QS + kk * 16 + tq * 2;
                pf_mma(s[n], qf[kk], *(const pf_u32*)p, *(const pf_u32*)(p + 8));
            }
        }
        // Scale into log2 units and mask: key kp is visible to a row at position pr when
        // kp <= pr and kp < kv_end.
        float mx_a = PF_NEG_INF, mx_b = PF_NEG_INF;
#pragma unroll
        for (int n = 0; n < PF_BK / 8; n++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int kp = k0 + n * 8 + tq * 2 + e;
                const bool ok = kp < kv_end;
                s[n][e] = (ok && kp <= pa) ? s[n][e] * scale_log2 : PF_NEG_INF;
                s[n][2 + e] = (ok && kp <= pb) ? s[n][2 + e] * scale_log2 : PF_NEG_INF;
                mx_a = fmaxf(mx_a, s[n][e]);
                mx_b = fmaxf(mx_b, s[n][2 + e]);
            }
        }
        mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 1));
        mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 2));
        mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 1));
        mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 2));
        // Key 0 is visible to every row and sits in the first tile, so the running maxima
        // are finite from the first tile on.
        const float new_a = fmaxf(m_a, mx_a), new_b = fmaxf(m_b, mx_b);
        const float alpha_a = exp2f(m_a - new_a), alpha_b = exp2f(m_b - new_b);
        m_a = new_a;
        m_b = new_b;
        float sum_a = 0.f, sum_b = 0.f;
#pragma unroll
        for (int n = 0; n < PF_BK / 8; n++) {
            s[n][0] = exp2f(s[n][0] - m_a);
            s[n][1] = exp2f(s[n][1] - m_a);
            s[n][2] = exp2f(s[n][2] - m_b);
            s[n][3] = exp2f(s[n][3] - m_b);
            sum_a += s[n][0] + s[n][1];
            sum_b += s[n][2] + s[n][3];
        }
        l_a = l_a * alpha_a + sum_a;
        l_b = l_b * alpha_b + sum_b;
#pragma unroll
        for (int n = 0; n < D / 8; n++) {
            o[n][0] *= alpha_a;
            o[n][1] *= alpha_a;
            o[n][2] *= alpha_b;
            o[n][3] *= alpha_b;
        }
#pragma unroll
        for (int kk = 0; kk < PF_BK / 16; kk++) {
            const pf_u32 a[4] = {pf_pack(s[2 * kk][0], s[2 * kk][1]), pf_pack(s[2 * kk][2], s[2 * kk][3]),
                                 pf_pack(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                 pf_pack(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int n = 0; n < D / 8; n++) {
                const pf_bf16* p = vt + (n * 8 + g) * VS + kk * 16 + tq * 2;
                pf_mma(o[n], a, *(const pf_u32*)p, *(const pf_u32*)(p + 8));
            }
        }
    }

    l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
    const float ia = 1.f / l_a, ib = 1.f / l_b;
    const int ra = q0 + wr + g, rb = ra + 8;
#pragma unroll
    for (int n = 0; n < D / 8; n++) {
        const int d = h * D + n * 8 + tq * 2;
        if (ra < T) *(pf_u32*)(out + (size_t)ra * q_dim + d) = pf_pack(o[n][0] * ia, o[n][1] * ia);
        if (rb < T) *(pf_u32*)(out + (size_t)rb * q_dim + d) = pf_pack(o[n][2] * ib, o[n][3] * ib);
    }
}

// Grid: ceil(T / PF_BQ) * heads blocks; PF_ATT_THREADS threads; shared memory
// (2 * PF_BQ * (D + 8) + D * (PF_BK + 8)) * 2 bytes (PF_BQ == PF_BK).
extern "C" __global__ void __launch_bounds__(PF_ATT_THREADS)
    pf_attention_64(const pf_bf16* q, const pf_bf16* k_cache, const pf_bf16* v_cache, pf_bf16* out, int T,
                    int start, int n_heads, int n_kv, long long pos_stride, long long head_stride, float scale_log2) {
    pf_attention<64>(q, k_cache, v_cache, out, T, start, n_heads, n_kv, pos_stride, head_stride, scale_log2);
}

extern "C" __global__ void __launch_bounds__(PF_ATT_THREADS)
    pf_attention_128(const pf_bf16* q, const pf_bf16* k_cache, const pf_bf16* v_cache, pf_bf16* out, int T,
                     int start, int n_heads, int n_kv, long long pos_stride, long long head_stride, float scale_log2) {
    pf_attention<128>(q, k_cache, v_cache, out, T, start, n_heads, n_kv, pos_stride, head_stride, scale_log2);
}

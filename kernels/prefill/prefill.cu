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
// row, PF_NORM_THREADS threads. Rows whose width is a multiple of 4 (every real model's) go
// four elements per load, the loop unrolled so that a thread's loads are all in flight at
// once: one element per load, a load's latency each, made this kernel 6.4 us for a 32 x 2048
// chunk (H100), longer than the QKV product's share of the weights' streaming.
#define PF_NORM_THREADS 256
__device__ __forceinline__ float pf_sq4(float4 v) { return v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w; }

extern "C" __global__ void pf_rmsnorm(const float* x, const pf_bf16* w, pf_bf16* out, int n, float eps, int first) {
    __shared__ float partial[PF_NORM_THREADS / 32];
    const float* xr = x + (size_t)(first + blockIdx.x) * n;
    pf_bf16* orow = out + (size_t)blockIdx.x * n;
    const bool vec = (n & 3) == 0;
    float ss = 0.f;
    if (vec) {
        const float4* x4 = (const float4*)xr;
#pragma unroll 4
        for (int i = threadIdx.x; i < n / 4; i += PF_NORM_THREADS) ss += pf_sq4(x4[i]);
    } else {
        for (int i = threadIdx.x; i < n; i += PF_NORM_THREADS) ss += xr[i] * xr[i];
    }
    ss = pf_warp_sum(ss);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = ss;
    __syncthreads();
    float tot = 0.f;
#pragma unroll
    for (int i = 0; i < PF_NORM_THREADS / 32; i++) tot += partial[i];
    const float scale = rsqrtf(tot / n + eps);
    if (vec) {
        const float4* x4 = (const float4*)xr;
        const uint2* w4 = (const uint2*)w;
        uint2* o4 = (uint2*)orow;
#pragma unroll 4
        for (int i = threadIdx.x; i < n / 4; i += PF_NORM_THREADS) {
            const float4 v = x4[i];
            const uint2 wv = w4[i];
            o4[i] = make_uint2(pf_pack(v.x * scale * pf_widen((pf_bf16)wv.x), v.y * scale * pf_widen((pf_bf16)(wv.x >> 16))),
                               pf_pack(v.z * scale * pf_widen((pf_bf16)wv.y), v.w * scale * pf_widen((pf_bf16)(wv.y >> 16))));
        }
    } else {
        for (int i = threadIdx.x; i < n; i += PF_NORM_THREADS) orow[i] = pf_narrow(xr[i] * scale * pf_widen(w[i]));
    }
}

// The QKV product's rows [T, q | k | v] (f32): RoPE (rotate_half: pairs i, i + head_dim/2)
// on q and k at positions start + t (start read from *start_p, as in the attention kernels,
// so that a captured prefill graph serves any position); q to q_out ([T, heads * head_dim], bf16), K and V into
// the layer's cache at (kv head, position): element d of a row at
// kvh * head_stride + pos * pos_stride + d, the decode path's own layout.
// The angle is rope.cuh's (formed in double). Grid: T x `parts` blocks, a token's pairs
// spread over its `parts` blocks (one block per token left most SMs idle on short chunks).
extern "C" __global__ void pf_rope_kv(const float* qkv, pf_bf16* q_out, pf_bf16* k_cache, pf_bf16* v_cache,
                                      const float* inv_freq, const int* start_p, int n_heads, int n_kv, int head_dim,
                                      long long pos_stride, long long head_stride, int parts) {
    const int t = blockIdx.x / parts, part = blockIdx.x - t * parts, pos = *start_p + t, half = head_dim >> 1;
    const int width = (n_heads + 2 * n_kv) * head_dim;
    const float* row = qkv + (size_t)t * width;
    for (int idx = part * blockDim.x + threadIdx.x; idx < (n_heads + 2 * n_kv) * half; idx += parts * blockDim.x) {
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
// Grid: T x (blocks per row) blocks; a thread takes four columns (a 64-bit division per
// element made this kernel ALU-bound).
extern "C" __global__ void pf_silu_mul(const float* gu, pf_bf16* act, int inter, int blocks_per_row) {
    const int t = blockIdx.x / blocks_per_row, part = blockIdx.x - t * blocks_per_row;
    const float* g = gu + (size_t)t * 2 * inter;
    const float* u = g + inter;
    pf_bf16* a = act + (size_t)t * inter;
    for (int j = (part * blockDim.x + threadIdx.x) * 4; j < inter; j += blocks_per_row * blockDim.x * 4) {
#pragma unroll
        for (int k = 0; k < 4; k++)
            if (j + k < inter) a[j + k] = pf_narrow(g[j + k] / (1.f + expf(-g[j + k])) * u[j + k]);
    }
}

// ---------------------------------------------------------------------------------------
// Causal flash attention over the chunk and everything cached before it.
//
// Block (query tile of BQ = 16 x WARPS rows, head): WARPS warps of 16 query rows each, the queries' mma
// fragments in registers (read once from global memory). Tiles of PF_BK keys stream through
// two shared-memory buffers with cp.async, the next tile's copy in flight while the current
// one is computed. K and V tiles are stored as the cache holds them (row = position); ldmatrix
// gives S = Q K^T its B fragments, ldmatrix.trans gives O += P V its (V^T) fragments, so no
// thread transposes anything. mma.sync m16n8k16 bf16 -> f32; online softmax in registers, P
// re-used from S's accumulators as the A operand. Row strides carry 8 elements of padding so
// that the eight 16-byte rows one ldmatrix phase reads fall in distinct banks. Only tiles that
// cross a warp's diagonal (or the end of the keys) are masked.

#define PF_BK 64

__device__ __forceinline__ void pf_mma(float* c, const pf_u32* a, pf_u32 b0, pf_u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two finite floats to bf16 (round to nearest even, as pf_pack) in one instruction: the
// probabilities of P are never NaN, and the attention loop is bound by its ALU work.
__device__ __forceinline__ pf_u32 pf_pack_rn(float lo, float hi) {
    pf_u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ pf_u32 pf_smem_addr(const void* p) { return (pf_u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void pf_ldmatrix_x4(pf_u32* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(pf_smem_addr(p)));
}

__device__ __forceinline__ void pf_ldmatrix_x4_trans(pf_u32* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(pf_smem_addr(p)));
}

// Helpers of both attention kernels (this file's and attention_wgmma.cuh's), whose
// accumulators share mma.sync's C layout: thread (g, tq) of a warp holds rows g and g + 8 of
// the warp's 16, columns 8n + 2tq and 8n + 2tq + 1 of each n8 block.

// The A fragments of query rows ra and rb = ra + 8 of head h (rows past T read as zeros:
// computed, never stored).
template <int D>
__device__ __forceinline__ void pf_load_q(const pf_bf16* q, int T, int q_dim, int h, int ra, int rb, int tq,
                                          pf_u32 (&qf)[D / 16][4]) {
    const pf_bf16* pa_row = q + (size_t)min(ra, T - 1) * q_dim + h * D + tq * 2;
    const pf_bf16* pb_row = q + (size_t)min(rb, T - 1) * q_dim + h * D + tq * 2;
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
        qf[kk][0] = ra < T ? *(const pf_u32*)(pa_row + kk * 16) : 0u;
        qf[kk][1] = rb < T ? *(const pf_u32*)(pb_row + kk * 16) : 0u;
        qf[kk][2] = ra < T ? *(const pf_u32*)(pa_row + kk * 16 + 8) : 0u;
        qf[kk][3] = rb < T ? *(const pf_u32*)(pb_row + kk * 16 + 8) : 0u;
    }
}

// Scores of keys k0.. a row may not see to -inf: key kp is visible to a row at position pr
// when kp <= pr and kp < kv_end (pa, pb: the positions of this thread's two rows).
template <int BK>
__device__ __forceinline__ void pf_mask(float (&s)[BK / 8][4], int k0, int kv_end, int pa, int pb, int tq) {
#pragma unroll
    for (int n = 0; n < BK / 8; n++) {
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int kp = k0 + n * 8 + tq * 2 + e;
            if (kp >= kv_end || kp > pa) s[n][e] = PF_NEG_INF;
            if (kp >= kv_end || kp > pb) s[n][2 + e] = PF_NEG_INF;
        }
    }
}

// The maxima of this thread's two rows over a tile (the four threads of a row combined).
template <int BK>
__device__ __forceinline__ void pf_tile_max(const float (&s)[BK / 8][4], float& mx_a, float& mx_b) {
    mx_a = PF_NEG_INF;
    mx_b = PF_NEG_INF;
#pragma unroll
    for (int n = 0; n < BK / 8; n++) {
        mx_a = fmaxf(mx_a, fmaxf(s[n][0], s[n][1]));
        mx_b = fmaxf(mx_b, fmaxf(s[n][2], s[n][3]));
    }
    mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 1));
    mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 2));
    mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 1));
    mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 2));
}

// Scores to probabilities in place, relative to the rows' maxima (log2 units, the scale
// folded into exp2's argument); adds this thread's part of each row's sum to sum_a, sum_b.
template <int BK>
__device__ __forceinline__ void pf_exp_tile(float (&s)[BK / 8][4], float scale_log2, float m_a, float m_b, float& sum_a,
                                            float& sum_b) {
#pragma unroll
    for (int n = 0; n < BK / 8; n++) {
        s[n][0] = exp2f(fmaf(s[n][0], scale_log2, -m_a));
        s[n][1] = exp2f(fmaf(s[n][1], scale_log2, -m_a));
        s[n][2] = exp2f(fmaf(s[n][2], scale_log2, -m_b));
        s[n][3] = exp2f(fmaf(s[n][3], scale_log2, -m_b));
        sum_a += s[n][0] + s[n][1];
        sum_b += s[n][2] + s[n][3];
    }
}

// Probabilities of keys 16kk..16kk+15 as the bf16 A fragment of P V (two n8 blocks of the
// accumulator layout are the A layout of one k16 step).
template <int BK>
__device__ __forceinline__ void pf_pack_k16(const float (&s)[BK / 8][4], int kk, pf_u32 (&a)[4]) {
    a[0] = pf_pack_rn(s[2 * kk][0], s[2 * kk][1]);
    a[1] = pf_pack_rn(s[2 * kk][2], s[2 * kk][3]);
    a[2] = pf_pack_rn(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    a[3] = pf_pack_rn(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}

// A row's sum over its four threads.
__device__ __forceinline__ float pf_quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    v += __shfl_xor_sync(0xffffffffu, v, 2);
    return v;
}

// Output rows ra and rb (those below T) of head h, scaled by ia and ib.
template <int D>
__device__ __forceinline__ void pf_store_rows(pf_bf16* out, const float (&o)[D / 8][4], float ia, float ib, int T,
                                              int q_dim, int h, int ra, int rb, int tq) {
#pragma unroll
    for (int n = 0; n < D / 8; n++) {
        const int d = h * D + n * 8 + tq * 2;
        if (ra < T) *(pf_u32*)(out + (size_t)ra * q_dim + d) = pf_pack(o[n][0] * ia, o[n][1] * ia);
        if (rb < T) *(pf_u32*)(out + (size_t)rb * q_dim + d) = pf_pack(o[n][2] * ib, o[n][3] * ib);
    }
}

// q, out: [T, heads * D] bf16 (chunk rows); k_cache, v_cache: the layer's cache, positions
// [0, start + T) valid; query row t sits at position start + t and sees keys 0..=start + t.
template <int D, int WARPS>
__device__ __forceinline__ void pf_attention(const pf_bf16* q, const pf_bf16* k_cache, const pf_bf16* v_cache,
                                             pf_bf16* out, int T, int start, int n_heads, int n_kv,
                                             long long pos_stride, long long head_stride, float scale_log2) {
    constexpr int S = D + 8;   // row stride (elements) of the K and V tiles
    constexpr int C8 = D / 8;  // 16-byte pieces per row
    constexpr int TILE = PF_BK * S;
    constexpr int PF_BQ = 16 * WARPS, PF_ATT_THREADS = 32 * WARPS;
    extern __shared__ __align__(16) unsigned char pf_smem[];
    pf_bf16* ks = (pf_bf16*)pf_smem;  // [2][PF_BK][S]
    pf_bf16* vs = ks + 2 * TILE;      // [2][PF_BK][S]

    // Blocks in a 1-D grid, heads fastest; the last query tiles (the most keys) start first,
    // so the short ones fill the tail.
    const int n_tiles = (T + PF_BQ - 1) / PF_BQ;
    const int h = blockIdx.x % n_heads, kvh = h / (n_heads / n_kv);
    const int q0 = (n_tiles - 1 - (int)(blockIdx.x / n_heads)) * PF_BQ;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    const int q_dim = n_heads * D;
    const pf_bf16* kbase = k_cache + kvh * head_stride;
    const pf_bf16* vbase = v_cache + kvh * head_stride;
    const int kv_end = start + min(q0 + PF_BQ, T);
    const int n_kt = (kv_end + PF_BK - 1) / PF_BK;

    auto load_tile = [&](int kt, int buf) {
        pf_bf16* kd = ks + buf * TILE;
        pf_bf16* vd = vs + buf * TILE;
        for (int idx = threadIdx.x; idx < PF_BK * C8; idx += PF_ATT_THREADS) {
            const int r = idx / C8, c = (idx - r * C8) * 8, pos = kt * PF_BK + r;
            const bool ok = pos < kv_end;
            const long long off = (long long)(ok ? pos : 0) * pos_stride + c;
            cp_async16(kd + r * S + c, kbase + off, ok);
            cp_async16(vd + r * S + c, vbase + off, ok);
        }
        cp_async_commit();
    };
    load_tile(0, 0);

    // This warp's 16 query rows as A fragments (rows past T read as zeros: computed, never
    // stored).
    const int wr = warp * 16;
    const int ra = q0 + wr + g, rb = ra + 8;
    pf_u32 qf[D / 16][4];
    pf_load_q<D>(q, T, q_dim, h, ra, rb, tq, qf);

    float o[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m_a = PF_NEG_INF, m_b = PF_NEG_INF, l_a = 0.f, l_b = 0.f;
    // Absolute positions of this thread's two query rows, and of the warp's first row.
    const int pa = start + ra, pb = pa + 8, p_first = start + q0 + wr;
    // ldmatrix row addresses: lane l supplies row (l & 7) of matrix l >> 3.
    const int lrow = lane & 7, lmat = lane >> 3;

    for (int kt = 0; kt < n_kt; kt++) {
        const int buf = kt & 1, k0 = kt * PF_BK;
        if (kt + 1 < n_kt) {
            load_tile(kt + 1, buf ^ 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();  // tile kt has landed for every thread
        const pf_bf16* kt_s = ks + buf * TILE;
        const pf_bf16* vt_s = vs + buf * TILE;
        // Keys past every row of the warp: nothing to do on this tile (its barrier is kept).
        if (k0 <= p_first + 15) {
            float s[PF_BK / 8][4];
#pragma unroll
            for (int n = 0; n < PF_BK / 8; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
            // S = Q K^T: matrices (keys n*8.., dims kk*16 + {0, 8, 16, 24}..) give b0, b1 of
            // two k-steps.
#pragma unroll
            for (int n = 0; n < PF_BK / 8; n++) {
#pragma unroll
                for (int kk = 0; kk < D / 16; kk += 2) {
                    pf_u32 b[4];
                    pf_ldmatrix_x4(b, kt_s + (n * 8 + lrow) * S + kk * 16 + lmat * 8);
                    pf_mma(s[n], qf[kk], b[0], b[1]);
                    pf_mma(s[n], qf[kk + 1], b[2], b[3]);
                }
            }
            // Mask only a tile that reaches past the warp's first row's position or the end of
            // the keys: key kp is visible to a row at position pr when kp <= pr and kp < kv_end.
            if (k0 + PF_BK - 1 > p_first || k0 + PF_BK > kv_end) pf_mask<PF_BK>(s, k0, kv_end, pa, pb, tq);
            float mx_a, mx_b;
            pf_tile_max<PF_BK>(s, mx_a, mx_b);
            // The running maxima in log2 units (the scale is positive, so the raw maximum scales
            // to the scaled one). Key 0 is visible to every row and sits in the first tile, so
            // they are finite from the first tile on; a masked score (-inf) weighs exp2(-inf) = 0.
            const float new_a = fmaxf(m_a, mx_a * scale_log2), new_b = fmaxf(m_b, mx_b * scale_log2);
            const float alpha_a = exp2f(m_a - new_a), alpha_b = exp2f(m_b - new_b);
            m_a = new_a;
            m_b = new_b;
            float sum_a = 0.f, sum_b = 0.f;
            pf_exp_tile<PF_BK>(s, scale_log2, m_a, m_b, sum_a, sum_b);
            l_a = l_a * alpha_a + sum_a;
            l_b = l_b * alpha_b + sum_b;
#pragma unroll
            for (int n = 0; n < D / 8; n++) {
                o[n][0] *= alpha_a;
                o[n][1] *= alpha_a;
                o[n][2] *= alpha_b;
                o[n][3] *= alpha_b;
            }
            // O += P V: matrices (keys kk*16 + {0, 8}.., dims n*8 + {0, 8}..) transposed give
            // b0, b1 of two n-blocks.
#pragma unroll
            for (int kk = 0; kk < PF_BK / 16; kk++) {
                pf_u32 a[4];
                pf_pack_k16<PF_BK>(s, kk, a);
#pragma unroll
                for (int n = 0; n < D / 8; n += 2) {
                    pf_u32 b[4];
                    pf_ldmatrix_x4_trans(b, vt_s + (kk * 16 + (lmat & 1) * 8 + lrow) * S + n * 8 + (lmat >> 1) * 8);
                    pf_mma(o[n], a, b[0], b[1]);
                    pf_mma(o[n + 1], a, b[2], b[3]);
                }
            }
        }
        __syncthreads();  // buffer buf is free for tile kt + 2
    }

    pf_store_rows<D>(out, o, 1.f / pf_quad_sum(l_a), 1.f / pf_quad_sum(l_b), T, q_dim, h, ra, rb, tq);
}

// Grid: ceil(T / BQ) * heads blocks; 32 x WARPS threads; shared memory 4 * PF_BK * (D + 8) * 2
// bytes (two buffers of a K and a V tile). head_dim 64: 8 warps, two blocks per SM (128
// registers, no spills); head_dim 128: 4 warps (178 registers; 8 warps would spill).
extern "C" __global__ void __launch_bounds__(256, 2)
    pf_attention_64(const pf_bf16* q, const pf_bf16* k_cache, const pf_bf16* v_cache, pf_bf16* out, int T,
                    const int* start_p, int n_heads, int n_kv, long long pos_stride, long long head_stride, float scale_log2) {
    pf_attention<64, 8>(q, k_cache, v_cache, out, T, *start_p, n_heads, n_kv, pos_stride, head_stride, scale_log2);
}

extern "C" __global__ void __launch_bounds__(128)
    pf_attention_128(const pf_bf16* q, const pf_bf16* k_cache, const pf_bf16* v_cache, pf_bf16* out, int T,
                     const int* start_p, int n_heads, int n_kv, long long pos_stride, long long head_stride, float scale_log2) {
    pf_attention<128, 4>(q, k_cache, v_cache, out, T, *start_p, n_heads, n_kv, pos_stride, head_stride, scale_log2);
}

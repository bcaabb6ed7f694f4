// Quantised weights (GGUF Q8_0, Q4_0, Q4_1, Q6_K) read as stored and decoded in registers: the graph
// path's mat-vecs and embedding, and prefill's dequantisation. Needs decode.cuh (the formats'
// decoding, shared with the megakernel) before it; self-contained otherwise (q_-prefixed
// helpers, no CUDA header), so both the baseline unit and the prefill unit include it.
//
// Device layout: decode.cuh (row by row, a row's quants, its scales, zeros to 16 bytes).
// Values: Q8_0 q * d; Q4_0 (q - 8) * d; Q4_1 q * d + m; Q6_K (d * scale) * (q - 32).

// Round to nearest even, NaN kept quiet.
__device__ __forceinline__ q_u16 q_to_bf16(float f) {
    q_u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (q_u16)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (q_u16)(u >> 16);
}

// Prefill: up to Q_SET_MAX quantised matrices to bf16 (cuBLAS's operands), row-major, in one
// launch: a launch per matrix cost SmolLM2 121 launches per prefill chunk. A thread decodes
// one 32-element block (its quants in one or two 16-byte loads: rows are whole multiples of
// 16 bytes) into four 16-byte stores, with q_element's arithmetic, so the values are the CPU
// reference's. Threads take the matrices' blocks in turn: matrix 0's, then matrix 1's, ...
#define Q_SET_MAX 4
struct QDequantSet {
    const void* data[Q_SET_MAX];
    q_u16* out[Q_SET_MAX];
    long long rows[Q_SET_MAX];
    int ty[Q_SET_MAX];
    int cols[Q_SET_MAX];
    int n;
};

__device__ __forceinline__ q_u32 q_pack_bf16(float lo, float hi) {
    return (q_u32)q_to_bf16(lo) | ((q_u32)q_to_bf16(hi) << 16);
}

extern "C" __global__ void q_dequant_bf16_set(const __grid_constant__ QDequantSet s) {
    long long total = 0;
    for (int m = 0; m < s.n; m++) total += s.rows[m] * (s.cols[m] >> 5);
    for (long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x; g < total;
         g += (long long)gridDim.x * blockDim.x) {
        int m = 0;
        long long i = g;
        while (i >= s.rows[m] * (s.cols[m] >> 5)) i -= s.rows[m] * (s.cols[m] >> 5), m++;
        const int ty = s.ty[m], cols = s.cols[m], per_row = cols >> 5;
        const long long r = i / per_row;
        const int b = (int)(i - r * per_row);
        const unsigned char* row = (const unsigned char*)s.data[m] + r * q_row_bytes(ty, cols);
        const q_u16* scales = (const q_u16*)(row + q_quant_bytes(ty, cols));
        float v[32];
        if (ty == WEIGHT_Q8_0) {
            const float d = q_f16(scales[b]);
            const uint4* q = (const uint4*)(row + b * 32);
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const uint4 w = q[h];
                const q_u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
                for (int k = 0; k < 16; k++)
                    v[16 * h + k] = __fmul_rn((float)(signed char)(words[k >> 2] >> (8 * (k & 3))), d);
            }
        } else if (ty == WEIGHT_Q6_K) {
            const unsigned char* h = (const unsigned char*)scales + 12 * b;
            const float d = q_f16((q_u16)(h[0] | (h[1] << 8)));
            const float s0 = __fmul_rn(d, (float)(signed char)h[2]), s1 = __fmul_rn(d, (float)(signed char)h[3]);
            const uint4 w = *(const uint4*)(row + b * 16);
            const q_u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int t = 0; t < 4; t++) {
                const uint2 q = q6_top_bits(words[t], *(const q_u32*)(h + 4 + 4 * (t & 1)), t);
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    v[4 * t + k] = __fmul_rn(s0, (float)((int)((q.x >> (8 * k)) & 255u) - 32));
                    v[16 + 4 * t + k] = __fmul_rn(s1, (float)((int)((q.y >> (8 * k)) & 255u) - 32));
                }
            }
        } else {
            const bool q41 = ty == WEIGHT_Q4_1;
            const float d = q_f16(scales[q41 ? 2 * b : b]), mn = q41 ? q_f16(scales[2 * b + 1]) : 0.f;
            const uint4 w = *(const uint4*)(row + b * 16);
            const q_u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int k = 0; k < 16; k++) {
                const q_u32 byte = (words[k >> 2] >> (8 * (k & 3))) & 255u;
                const int lo = (int)(byte & 15u), hi = (int)(byte >> 4);
                v[k] = q41 ? __fadd_rn(__fmul_rn((float)lo, d), mn) : __fmul_rn((float)(lo - 8), d);
                v[k + 16] = q41 ? __fadd_rn(__fmul_rn((float)hi, d), mn) : __fmul_rn((float)(hi - 8), d);
            }
        }
        uint4* out = (uint4*)(s.out[m] + r * cols + b * 32);
#pragma unroll
        for (int k = 0; k < 4; k++)
            out[k] = make_uint4(q_pack_bf16(v[8 * k], v[8 * k + 1]), q_pack_bf16(v[8 * k + 2], v[8 * k + 3]),
                                q_pack_bf16(v[8 * k + 4], v[8 * k + 5]), q_pack_bf16(v[8 * k + 6], v[8 * k + 7]));
    }
}

// Prefill: x[t, :] = row tokens[t] of the embedding. One block per token.
extern "C" __global__ void q_embed_rows(int ty, const void* data, const q_u32* tokens, float* x, int hidden) {
    const q_u32 tok = tokens[blockIdx.x];
    float* dst = x + (size_t)blockIdx.x * hidden;
    for (int c = threadIdx.x; c < hidden; c += blockDim.x) dst[c] = q_element(ty, data, tok, c, hidden);
}

__device__ __forceinline__ void q_pdl_launch_next() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ void q_pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

__device__ __forceinline__ float q_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float q_silu(float x) { return x / (1.f + __expf(-x)); }

// Decode: x = row meta[0] (the step's token; TokenMeta starts with it) of the embedding.
extern "C" __global__ void bl_embed_q(int ty, const void* data, const q_u32* meta, float* x, int hidden) {
    q_pdl_launch_next();
    q_pdl_wait();
    const q_u32 tok = meta[0];
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < hidden; c += gridDim.x * blockDim.x)
        x[c] = q_element(ty, data, tok, c, hidden);
}

// ---- mat-vec ---------------------------------------------------------------------------------
//
// A warp computes QG_ROWS rows. It walks a row in chunks of 256 elements (8 blocks): each lane
// takes 8 elements of one block (Q8_0: 8 consecutive int8, an 8-byte load; Q4: 4 bytes of
// nibbles = elements 4t..4t+3 and 16+4t..16+4t+3 of the block, t = lane % 4, a 4-byte load),
// so a warp's loads of one row are 256 (Q8_0) or 128 (Q4) contiguous bytes. The input vector
// is staged in shared memory permuted so that lane L's two float4 of chunk c sit at float4
// slots (2c + p) * 32 + L: every shared load is conflict-free, and a lane's inputs are loaded
// once and used for all of its rows. Rows per block: 8 warps * QG_ROWS (QUANT_ROWS_PER_BLOCK in
// src/gpu/baseline.rs). A lane's loads are small (4 or 8 bytes), so QG_UNROLL chunks of every
// row are loaded before any is used. 4 rather than 8 (which keeps as many bytes in flight per
// lane as bl_gemv's 16-byte loads do for Q8_0): on the H100, Llama-1B's graph + PDL step was
// 9% shorter on Q8_0 and 1% on Q4_1 and Q6_K (BENCHMARKS.md), the wider batch's registers and
// longer first wait costing more than its extra loads in flight gain. The products are added
// in the same order either way.

#define QG_ROWS 2
#ifndef QG_UNROLL
#define QG_UNROLL 4
#endif
#define QG_CHUNK 256
#ifndef QG_STAGE
#define QG_STAGE 4  // float4s a thread stages per batch (see qg_gemv)
#endif

#define QG_IN_PLAIN 0  // x
#define QG_IN_NORM 1   // x / rms(x) * norm
#define QG_IN_SILU 2   // silu(x[i]) * x[cols + i]

// Where element i of the input vector goes in the staged layout (floats).
template <int TY>
__device__ __forceinline__ int qg_slot(int i) {
    const int c = i / QG_CHUNK, r = i % QG_CHUNK;
    int lane, p, k;
    if (TY == WEIGHT_Q8_0) {
        lane = r >> 3;
        p = (r >> 2) & 1;
        k = r & 3;
    } else {
        const int j = r & 31;
        lane = 4 * (r >> 5) + ((j & 15) >> 2);
        p = j >> 4;
        k = j & 3;
    }
    return (((2 * c + p) * 32 + lane) << 2) + k;
}

template <int TY>
__device__ __forceinline__ uint2 qg_load(const unsigned char* row, int chunk, int lane) {
    uint2 r;
    if (TY == WEIGHT_Q8_0) {
        const unsigned char* p = row + chunk * QG_CHUNK + lane * 8;
        asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
    } else {
        const unsigned char* p = row + chunk * (QG_CHUNK / 2) + lane * 4;
        asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(r.x) : "l"(p));
        r.y = 0;
    }
    return r;
}

// y[r] (+)= W[r, :] . in, W quantised as TY, `in` formed from x per `mode` (QG_IN_*).
// cols is a multiple of 32; shared memory: ceil(cols / 256) * 256 floats.
template <int TY>
__device__ __forceinline__ void qg_gemv(const unsigned char* W, const float* x, float* y, int rows,
                                        int cols, int accumulate, int mode, const q_u16* norm, float eps) {
    extern __shared__ float4 qg_xs4[];
    __shared__ float partial[32];
    q_pdl_launch_next();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row0 = (blockIdx.x * (blockDim.x >> 5) + warp) * QG_ROWS;
    const int row_bytes = q_row_bytes(TY, cols), quant_bytes = q_quant_bytes(TY, cols);
    const int nblocks = cols / 32;
    // Weights do not depend on the previous kernel: pull them towards L2 before waiting.
    for (int r = 0; r < QG_ROWS; r++)
        if (row0 + r < rows) {
            const unsigned char* wr = W + (size_t)(row0 + r) * row_bytes;
            for (int off = lane * 128; off < row_bytes; off += 32 * 128)
                asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(wr + off));
        }
    // The input is staged QG_STAGE float4s a thread at a time, every load of a batch issued
    // before the first store (a plain loop compiles to a load and its store in turn: one L2
    // round trip per element a thread, 32 for an 8192-wide down projection); four consecutive
    // elements land in one float4 slot of the staged layout. The norm's weights do not depend
    // on the previous kernel: read before the wait when one batch holds the whole input.
    const int n4 = cols >> 2, nt = blockDim.x;
    const bool one_batch = n4 <= QG_STAGE * nt;
    const float4* x4 = (const float4*)x;
    uint2 g[QG_STAGE];
    if (mode == QG_IN_NORM && one_batch) {
#pragma unroll
        for (int k = 0; k < QG_STAGE; k++) {
            const int j = k * nt + threadIdx.x;
            g[k] = j < n4 ? *(const uint2*)(norm + 4 * j) : make_uint2(0u, 0u);
        }
    }
    q_pdl_wait();
    float ss = 0.f;
    for (int base = 0; base < n4; base += QG_STAGE * nt) {
        float4 a[QG_STAGE], b[QG_STAGE];
#pragma unroll
        for (int k = 0; k < QG_STAGE; k++) {
            const int j = base + k * nt + threadIdx.x;
            if (j < n4) {
                a[k] = x4[j];
                if (mode == QG_IN_SILU) b[k] = x4[n4 + j];
            }
        }
#pragma unroll
        for (int k = 0; k < QG_STAGE; k++) {
            const int j = base + k * nt + threadIdx.x;
            if (j >= n4) continue;
            float4 v = a[k];
            if (mode == QG_IN_SILU) {
                v.x = q_silu(v.x) * b[k].x;
                v.y = q_silu(v.y) * b[k].y;
                v.z = q_silu(v.z) * b[k].z;
                v.w = q_silu(v.w) * b[k].w;
            }
            ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
            if (mode == QG_IN_NORM && one_batch) a[k] = v;  // stored once scaled, below
            else qg_xs4[qg_slot<TY>(4 * j) >> 2] = v;
        }
        if (mode == QG_IN_NORM && one_batch) {
            const float scale = block_inv_rms(ss, cols, eps, partial);
#pragma unroll
            for (int k = 0; k < QG_STAGE; k++) {
                const int j = k * nt + threadIdx.x;
                if (j < n4) qg_xs4[qg_slot<TY>(4 * j) >> 2] = norm4(a[k], g[k], scale);
            }
        }
    }
    if (mode == QG_IN_NORM && !one_batch) {
        const float scale = block_inv_rms(ss, cols, eps, partial);
        // Each thread rescales the float4s it wrote itself (the reduction's barriers are after
        // every store anyway).
        for (int j = threadIdx.x; j < n4; j += nt) {
            float4* slot = &qg_xs4[qg_slot<TY>(4 * j) >> 2];
            *slot = norm4(*slot, *(const uint2*)(norm + 4 * j), scale);
        }
    }
    __syncthreads();

    const unsigned char* wr[QG_ROWS];
    const q_u16* sr[QG_ROWS];
    for (int r = 0; r < QG_ROWS; r++) {
        const int rr = min(row0 + r, rows - 1);
        wr[r] = W + (size_t)rr * row_bytes;
        sr[r] = (const q_u16*)(wr[r] + quant_bytes);
    }
    float acc[QG_ROWS];
    for (int r = 0; r < QG_ROWS; r++) acc[r] = 0.f;
    const int chunks = (cols + QG_CHUNK - 1) / QG_CHUNK;
    const int lane_block = lane >> 2;  // block within the chunk
    for (int c0 = 0; c0 < chunks; c0 += QG_UNROLL) {
        uint2 w[QG_UNROLL][QG_ROWS];
        bool live[QG_UNROLL];
#pragma unroll
        for (int u = 0; u < QG_UNROLL; u++) {
            const int c = c0 + u;
            live[u] = c < chunks && c * 8 + lane_block < nblocks;
#pragma unroll
            for (int r = 0; r < QG_ROWS; r++) w[u][r] = live[u] ? qg_load<TY>(wr[r], c, lane) : make_uint2(0, 0);
        }
#pragma unroll
        for (int u = 0; u < QG_UNROLL; u++) {
            if (!live[u]) continue;
            const int c = c0 + u;
            const float4 lo = qg_xs4[(2 * c) * 32 + lane];
            const float4 hi = qg_xs4[(2 * c + 1) * 32 + lane];
            // Q4_1's minimum multiplies the sum of the inputs, once per block.
            const float sx = TY == WEIGHT_Q4_1 ? (lo.x + lo.y) + (lo.z + lo.w) + ((hi.x + hi.y) + (hi.z + hi.w)) : 0.f;
            const int b = c * 8 + lane_block;
            if constexpr (TY == WEIGHT_Q6_K) {
#pragma unroll
                for (int r = 0; r < QG_ROWS; r++) {
                    const unsigned char* h = (const unsigned char*)sr[r] + 12 * b;
                    const float2 s = qg_dot_q6(w[u][r].x, *(const q_u32*)(h + 4 + 4 * (lane & 1)), lane & 3, lo, hi);
                    const float2 dsc = q6_scales(h);
                    acc[r] = fmaf(dsc.x, s.x, fmaf(dsc.y, s.y, acc[r]));
                }
                continue;
            }
#pragma unroll
            for (int r = 0; r < QG_ROWS; r++) {
                const float s = qg_dot<TY>(w[u][r], lo, hi);
                if (TY != WEIGHT_Q4_1) {
                    acc[r] = fmaf(q_f16(sr[r][b]), s, acc[r]);
                } else {
                    acc[r] = fmaf(q_f16(sr[r][2 * b]), s, fmaf(q_f16(sr[r][2 * b + 1]), sx, acc[r]));
                }
            }
        }
    }
    for (int r = 0; r < QG_ROWS; r++) {
        const float s = q_warp_sum(acc[r]);
        if (lane == 0 && row0 + r < rows) y[row0 + r] = accumulate ? y[row0 + r] + s : s;
    }
}

extern "C" __global__ void bl_gemv_q8_0(const unsigned char* W, const float* x, float* y, int rows,
                                        int cols, int accumulate, int mode, const q_u16* norm, float eps) {
    qg_gemv<WEIGHT_Q8_0>(W, x, y, rows, cols, accumulate, mode, norm, eps);
}

extern "C" __global__ void bl_gemv_q4_0(const unsigned char* W, const float* x, float* y, int rows,
                                        int cols, int accumulate, int mode, const q_u16* norm, float eps) {
    qg_gemv<WEIGHT_Q4_0>(W, x, y, rows, cols, accumulate, mode, norm, eps);
}

extern "C" __global__ void bl_gemv_q4_1(const unsigned char* W, const float* x, float* y, int rows,
                                        int cols, int accumulate, int mode, const q_u16* norm, float eps) {
    qg_gemv<WEIGHT_Q4_1>(W, x, y, rows, cols, accumulate, mode, norm, eps);
}

extern "C" __global__ void bl_gemv_q6_k(const unsigned char* W, const float* x, float* y, int rows,
                                        int cols, int accumulate, int mode, const q_u16* norm, float eps) {
    qg_gemv<WEIGHT_Q6_K>(W, x, y, rows, cols, accumulate, mode, norm, eps);
}

// The conventional decode path: one kernel per operation, captured in a CUDA graph.
// Every kernel starts with launch_dependents and waits (griddepcontrol.wait) just before it
// first reads its predecessor's output, so under programmatic dependent launch its weight
// prefetch overlaps the previous kernel; without PDL both instructions are no-ops.

__device__ __forceinline__ void pdl_launch_next() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }


extern "C" __global__ void bl_embed(const bf16_t* embed, const TokenMeta* meta, float* x, int hidden) {
    pdl_launch_next();
    pdl_wait();
    const bf16_t* row = embed + (size_t)meta->token * hidden;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < hidden; i += gridDim.x * blockDim.x)
        x[i] = bf16_to_f32(row[i]);
}

// 1 / sqrt(mean of squares + eps) over n elements, from each thread's partial sum of squares
// `ss`: warp sums, then the first warp over them; every thread gets the result. `partial`: 32
// floats of shared memory.
__device__ __forceinline__ float block_inv_rms(float ss, int n, float eps, float* partial) {
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = ss;
    __syncthreads();
    if (threadIdx.x < 32) {
        float v = threadIdx.x < (blockDim.x >> 5) ? partial[threadIdx.x] : 0.f;
        v = warp_sum(v);
        if (threadIdx.x == 0) partial[0] = rsqrtf(v / n + eps);
    }
    __syncthreads();
    return partial[0];
}

// One block: out = x / rms(x) * w (when the norm is not folded into bl_gemv).
extern "C" __global__ void bl_rmsnorm(const float* x, const bf16_t* w, float* out, int n, float eps) {
    __shared__ float partial[32];
    pdl_launch_next();
    pdl_wait();
    float ss = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += x[i] * x[i];
    const float scale = block_inv_rms(ss, n, eps, partial);
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = x[i] * scale * bf16_to_f32(w[i]);
}

// act = silu(gate) * up, with gu = [gate; up] (when not folded into bl_gemv).
extern "C" __global__ void bl_silu_mul(const float* gu, float* act, int inter) {
    pdl_launch_next();
    pdl_wait();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < inter; i += gridDim.x * blockDim.x)
        act[i] = silu(gu[i]) * gu[inter + i];
}

#define GEMV_ROWS_PER_WARP 2
#define GEMV_UNROLL 4

// How bl_gemv forms its input vector while staging it in shared memory, so that the RMS norm
// and SiLU·up need no kernels (and no trips through global memory) of their own.
#define GEMV_IN_PLAIN 0  // x
#define GEMV_IN_NORM 1   // x / rms(x) * norm (the RMS norm of the layer's input)
#define GEMV_IN_SILU 2   // silu(x[i]) * x[cols + i] (x = [gate; up], 2 * cols floats)

// y[r] (+)= W[r,:] . in for GEMV_ROWS_PER_WARP rows per warp; `in` formed from x per `mode` and
// staged in shared memory (every block forms all of it: cols floats, read from L2).
// cols must be a multiple of 8.
extern "C" __global__ void bl_gemv(const bf16_t* W, const float* x, float* y, int rows, int cols, int accumulate,
                                   int mode, const bf16_t* norm, float eps) {
    extern __shared__ float xs[];
    __shared__ float partial[32];
    pdl_launch_next();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row0 = (blockIdx.x * (blockDim.x >> 5) + warp) * GEMV_ROWS_PER_WARP;
    // Weights do not depend on the previous kernel: pull them towards L2 before waiting.
    for (int r = 0; r < GEMV_ROWS_PER_WARP; r++)
        if (row0 + r < rows)
            for (int off = lane * 64; off < cols; off += 32 * 64) prefetch_l2(W + (size_t)(row0 + r) * cols + off);
    pdl_wait();
    if (mode == GEMV_IN_SILU) {
        for (int i = threadIdx.x; i < cols; i += blockDim.x) xs[i] = silu(x[i]) * x[cols + i];
    } else {
        float ss = 0.f;
        for (int i = threadIdx.x; i < cols; i += blockDim.x) {
            const float v = x[i];
            xs[i] = v;
            ss += v * v;
        }
        if (mode == GEMV_IN_NORM) {
            const float scale = block_inv_rms(ss, cols, eps, partial);
            for (int i = threadIdx.x; i < cols; i += blockDim.x) xs[i] = xs[i] * scale * bf16_to_f32(norm[i]);
        }
    }
    __syncthreads();
    float acc[GEMV_ROWS_PER_WARP];
    for (int r = 0; r < GEMV_ROWS_PER_WARP; r++) acc[r] = 0.f;
    const bf16_t* wr[GEMV_ROWS_PER_WARP];
    for (int r = 0; r < GEMV_ROWS_PER_WARP; r++) wr[r] = W + (size_t)min(row0 + r, rows - 1) * cols;
    int c = lane * 8;
    for (; c + (GEMV_UNROLL - 1) * 256 < cols; c += GEMV_UNROLL * 256) {
        uint4 w[GEMV_ROWS_PER_WARP][GEMV_UNROLL];
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++)
#pragma unroll
            for (int r = 0; r < GEMV_ROWS_PER_WARP; r++) w[r][u] = ld_stream(wr[r] + c + u * 256);
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++)
#pragma unroll
            for (int r = 0; r < GEMV_ROWS_PER_WARP; r++) acc[r] += dot8(w[r][u], xs + c + u * 256);
    }
    for (; c < cols; c += 256)
#pragma unroll
        for (int r = 0; r < GEMV_ROWS_PER_WARP; r++) acc[r] += dot8(ld_stream(wr[r] + c), xs + c);
    for (int r = 0; r < GEMV_ROWS_PER_WARP; r++) {
        float s = warp_sum(acc[r]);
        if (lane == 0 && row0 + r < rows) y[row0 + r] = accumulate ? y[row0 + r] + s : s;
    }
}

// RoPE (rotate_half pairs i, i + head_dim/2) on q and k in place, then K and V into the cache
// at meta->pos. One block per head of the q|k|v concatenation, head_dim/2 threads.
extern "C" __global__ void bl_rope_kv(float* qkv, bf16_t* k_cache, bf16_t* v_cache, const TokenMeta* meta,
                                      const float* inv_freq, int n_heads, int n_kv, int head_dim) {
    pdl_launch_next();
    pdl_wait();
    const int h = blockIdx.x, i = threadIdx.x, half = head_dim >> 1;
    const u32 pos = meta->pos;
    float* v = qkv + h * head_dim;
    const size_t slot = (size_t)pos * n_kv * head_dim;
    if (h < n_heads + n_kv) {
        float s, c;
        rope_sincos(pos, inv_freq[i], &s, &c);
        float a = v[i], b = v[i + half];
        float ra = a * c - b * s, rb = b * c + a * s;
        if (h < n_heads) {
            v[i] = ra; v[i + half] = rb;
        } else {
            bf16_t* k = k_cache + slot + (h - n_heads) * head_dim;
            k[i] = f32_to_bf16(ra); k[i + half] = f32_to_bf16(rb);
        }
    } else {
        bf16_t* dst = v_cache + slot + (h - n_heads - n_kv) * head_dim;
        dst[i] = f32_to_bf16(v[i]); dst[i + half] = f32_to_bf16(v[i + half]);
    }
}

// One block per query head over positions [0, pos]; warps take blocks of 32 positions in
// turn, then merge. Shared memory: the query, then per warp (m, l, acc[head_dim]).
extern "C" __global__ void bl_attention(const float* q, const bf16_t* k_cache, const bf16_t* v_cache, float* out,
                                        const TokenMeta* meta, int n_heads, int n_kv, int head_dim) {
    extern __shared__ float st[];
    pdl_launch_next();
    pdl_wait();
    const int h = blockIdx.x, kvh = h / (n_heads / n_kv), lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nwarps = blockDim.x >> 5, D = head_dim >> 5, kv_stride = n_kv * head_dim;
    const int len = meta->pos + 1;
    float* qs = st + nwarps * (2 + head_dim);
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) qs[i] = q[h * head_dim + i];
    __syncthreads();
    float acc[ATT_MAX_D];
    for (int j = 0; j < D; j++) acc[j] = 0.f;
    float m = NEG_INF, l = 0.f;
    attend_warp(qs, k_cache + kvh * head_dim, v_cache + kvh * head_dim, kv_stride, head_dim, rsqrtf((float)head_dim),
                0, len, warp, nwarps, m, l, acc);
    float* mine = st + warp * (2 + head_dim);
    if (lane == 0) { mine[0] = m; mine[1] = l; }
    for (int j = 0; j < D; j++) mine[2 + lane * D + j] = acc[j];
    __syncthreads();
    merge_warp_states(st, nwarps, head_dim, out + h * head_dim);
}

// Split-KV attention (flash-decoding), for long contexts: block (head h, part p) of
// gridDim.x = n_heads * parts covers positions [p * span, min(len, (p + 1) * span)) with
// span = ceil(len / parts) (len = pos + 1 read on the device, so one captured graph serves
// every position) and writes its unnormalised state (m, l, acc[head_dim]) to
// part_st[(h * parts + p) * (2 + head_dim)]; bl_attention_merge combines the parts.
// Shared memory as bl_attention's.
extern "C" __global__ void bl_attention_part(const float* q, const bf16_t* k_cache, const bf16_t* v_cache,
                                             float* part_st, const TokenMeta* meta, int n_heads, int n_kv,
                                             int head_dim, int parts) {
    extern __shared__ float st[];
    pdl_launch_next();
    pdl_wait();
    const int h = blockIdx.x / parts, p = blockIdx.x - h * parts;
    const int kvh = h / (n_heads / n_kv), lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nwarps = blockDim.x >> 5, D = head_dim >> 5, kv_stride = n_kv * head_dim;
    const int len = meta->pos + 1, span = (len + parts - 1) / parts;
    const int p_begin = min(len, p * span), p_end = min(len, p_begin + span);
    float* qs = st + nwarps * (2 + head_dim);
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) qs[i] = q[h * head_dim + i];
    __syncthreads();
    float acc[ATT_MAX_D];
    for (int j = 0; j < D; j++) acc[j] = 0.f;
    float m = NEG_INF, l = 0.f;
    attend_warp(qs, k_cache + kvh * head_dim, v_cache + kvh * head_dim, kv_stride, head_dim, rsqrtf((float)head_dim),
                p_begin, p_end, warp, nwarps, m, l, acc);
    float* mine = st + warp * (2 + head_dim);
    if (lane == 0) { mine[0] = m; mine[1] = l; }
    for (int j = 0; j < D; j++) mine[2 + lane * D + j] = acc[j];
    __syncthreads();
    // The block's warps into one unnormalised state (an empty part: m = -inf, l = 0).
    float* out = part_st + (size_t)blockIdx.x * (2 + head_dim);
    float mb = NEG_INF;
    for (int w = 0; w < nwarps; w++)
        if (st[w * (2 + head_dim) + 1] != 0.f) mb = fmaxf(mb, st[w * (2 + head_dim)]);
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float lb = 0.f, a = 0.f;
        for (int w = 0; w < nwarps; w++) {
            const float* s = st + w * (2 + head_dim);
            if (s[1] == 0.f) continue;  // a warp that saw no position
            const float c = __expf(s[0] - mb);
            lb += s[1] * c;
            a += s[2 + d] * c;
        }
        out[2 + d] = a;
        if (d == 0) { out[0] = mb; out[1] = lb; }
    }
}

// One block per head: the parts' states into the normalised output (merge_warp_states skips
// the empty ones).
extern "C" __global__ void bl_attention_merge(const float* part_st, float* out, int head_dim, int parts) {
    pdl_launch_next();
    pdl_wait();
    const int h = blockIdx.x;
    merge_warp_states(part_st + (size_t)h * parts * (2 + head_dim), parts, head_dim, out + h * head_dim);
}

// One block: greedy next token into meta->next and meta->token, position advanced, so the
// next replay of the graph decodes it without the host.
extern "C" __global__ void bl_argmax(const float* logits, int n, TokenMeta* meta, u32* history) {
    __shared__ float sv[32];
    __shared__ u32 si[32];
    pdl_launch_next();
    pdl_wait();
    float v = NEG_INF;
    u32 idx = 0xffffffffu;
    for (int i = threadIdx.x; i < n; i += blockDim.x) argmax_merge(v, idx, logits[i], (u32)i);
    warp_argmax(v, idx);
    if ((threadIdx.x & 31) == 0) { sv[threadIdx.x >> 5] = v; si[threadIdx.x >> 5] = idx; }
    __syncthreads();
    if (threadIdx.x < 32) {
        int nw = blockDim.x >> 5;
        v = threadIdx.x < nw ? sv[threadIdx.x] : NEG_INF;
        idx = threadIdx.x < nw ? si[threadIdx.x] : 0xffffffffu;
        warp_argmax(v, idx);
        if (threadIdx.x == 0) {
            history[meta->pos + 1] = idx;
            meta->next = idx; meta->token = idx; meta->pos += 1;
        }
    }
}

// Streaming-read probe for `megainfer bench`: every 16-byte word read once, 8 loads in flight
// per thread; the xor keeps the loads alive.
extern "C" __global__ void bw_read(const uint4* p, unsigned long long n, u32* sink) {
    u32 acc = 0;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 7 * stride < n; i += 8 * stride) {
        uint4 v[8];
#pragma unroll
        for (int u = 0; u < 8; u++) v[u] = ld_stream(p + i + u * stride);
#pragma unroll
        for (int u = 0; u < 8; u++) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    for (; i < n; i += stride) { uint4 v = ld_stream(p + i); acc ^= v.x ^ v.y ^ v.z ^ v.w; }
    if (acc == 0x9e3779b9u) sink[0] = acc;
}

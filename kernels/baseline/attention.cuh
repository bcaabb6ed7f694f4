// Attention math of the baseline kernel (the megakernel's is in megakernel/ops/attention.cuh:
// its K and V rows are staged in shared memory).
//
// One warp works through blocks of 32 positions: lane j scores position base + j on its own
// (the whole q·k dot product, 16-byte loads of its K row, so a block's 32 rows are in flight
// at once), the block's softmax weights are combined across lanes, then every lane
// accumulates its own D = head_dim / 32 output dims over the block's V rows (loaded with the K
// rows).
// A running max m, sum l and weighted V sum acc carry the online softmax across blocks.

#define ATT_MAX_D 4

__device__ __forceinline__ uint4 ld_cg16(const void* p) {
    uint4 r;
    asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

template <int D> struct VDims;
template <> struct VDims<2> {
    u32 w;
    __device__ __forceinline__ void load(const bf16_t* p) { w = __ldcg((const unsigned int*)p); }
    __device__ __forceinline__ void fma_into(float pi, float* acc) const {
        acc[0] = fmaf(pi, __uint_as_float(w << 16), acc[0]);
        acc[1] = fmaf(pi, __uint_as_float(w & 0xffff0000u), acc[1]);
    }
};
template <> struct VDims<4> {
    uint2 w;
    __device__ __forceinline__ void load(const bf16_t* p) { w = __ldcg((const uint2*)p); }
    __device__ __forceinline__ void fma_into(float pi, float* acc) const {
        acc[0] = fmaf(pi, __uint_as_float(w.x << 16), acc[0]);
        acc[1] = fmaf(pi, __uint_as_float(w.x & 0xffff0000u), acc[1]);
        acc[2] = fmaf(pi, __uint_as_float(w.y << 16), acc[2]);
        acc[3] = fmaf(pi, __uint_as_float(w.y & 0xffff0000u), acc[3]);
    }
};

// One block of 32 positions from `base` in a warp's registers: lane j's K row (position
// base + j, as 16-byte words) and every V row (D = head_dim / 32 dims of each, the lane's own).
template <int D>
struct KvBlock {
    VDims<D> v[32];
    uint4 k[4 * D];
};

// Loads the rows of positions [from, to) of the block at `base` (the others are left as they
// are, so a block can be loaded in two parts: rows that are final before griddepcontrol.wait,
// then the rest after it). K and V together: a block costs one round trip, not three.
template <int D>
__device__ __forceinline__ void load_kv_block(KvBlock<D>& b, const bf16_t* k_head, const bf16_t* v_head,
                                              int kv_stride, int base, int from, int to) {
    const int lane = threadIdx.x & 31, pj = base + lane, i0 = from - base, n = min(32, to - base);
#pragma unroll
    for (int i = 0; i < 32; i++)
        if (i >= i0 && i < n) b.v[i].load(v_head + (size_t)(base + i) * kv_stride + lane * D);
    if (pj >= from && pj < to) {
        const bf16_t* kr = k_head + (size_t)pj * kv_stride;
#pragma unroll
        for (int u = 0; u < 4 * D; u++) b.k[u] = ld_cg16(kr + 8 * u);
    }
}

// Folds the block at `base` (positions below p_end) into the warp's online softmax state.
template <int D>
__device__ __forceinline__ void attend_kv_block(const KvBlock<D>& b, const float* q, float scale, int base, int p_end,
                                                float& m, float& l, float* acc) {
    const int lane = threadIdx.x & 31, pj = base + lane, n = min(32, p_end - base);
    float s = NEG_INF;
    if (pj < p_end) {
        float dot = 0.f;
#pragma unroll
        for (int u = 0; u < 4 * D; u++) dot += dot8(b.k[u], q + 8 * u);
        s = dot * scale;
    }
    const float m_new = fmaxf(m, warp_max(s));
    const float e = pj < p_end ? __expf(s - m_new) : 0.f;
    const float corr = __expf(m - m_new);  // m = -inf on the first block: corr = 0
    l = l * corr + warp_sum(e);
#pragma unroll
    for (int j = 0; j < D; j++) acc[j] *= corr;
#pragma unroll
    for (int i = 0; i < 32; i++)
        if (i < n) b.v[i].fma_into(__shfl_sync(0xffffffffu, e, i), acc);
    m = m_new;
}

// q: the head's query in shared memory (all lanes read it). Blocks of 32 positions starting
// at p_begin, this warp taking blocks first_block, first_block + block_step, ...
// D = head_dim / 32.
template <int D>
__device__ __forceinline__ void attend_warp(const float* q, const bf16_t* k_head, const bf16_t* v_head,
                                            int kv_stride, float scale, int p_begin, int p_end,
                                            int first_block, int block_step, float& m, float& l, float* acc) {
    for (int base = p_begin + first_block * 32; base < p_end; base += block_step * 32) {
        KvBlock<D> b;
        load_kv_block<D>(b, k_head, v_head, kv_stride, base, base, p_end);
        attend_kv_block<D>(b, q, scale, base, p_end, m, l, acc);
    }
}

// Merges per-warp (m, l, acc) states held in shared memory into one normalised output.
// st: [nwarps][2 + head_dim] floats. Called by all threads; writes out[0..head_dim).
__device__ __forceinline__ void merge_warp_states(const float* st, int nwarps, int head_dim, float* out) {
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float m = NEG_INF;
        for (int w = 0; w < nwarps; w++) m = fmaxf(m, st[w * (2 + head_dim)]);
        float l = 0.f, a = 0.f;
        for (int w = 0; w < nwarps; w++) {
            const float* s = st + w * (2 + head_dim);
            if (s[1] == 0.f) continue;  // a warp that saw no position
            float c = __expf(s[0] - m);
            l += s[1] * c;
            a += s[2 + d] * c;
        }
        out[d] = a / l;
    }
}

// ---------------------------------------------------------------------------------------------
// Split-KV attention by KV head (flash-decoding over grouped queries), for all but the
// shortest caches (SPLIT_KV_FROM in src/gpu/baseline.rs): block (kv head kvh, part p) streams
// its part's K and V rows once, for all G = n_heads / n_kv query heads that share them,
// instead of once per query head. Rows arrive by cp.async in tiles of GQ_T positions,
// GQ_STAGES tiles in flight, so a block keeps tens of KiB of loads outstanding whatever its
// compute does. Per tile: thread (g, j) scores position j for head g against K in shared
// memory; warp g turns head g's scores into weights (online softmax: running max m, sum l,
// and the factor corr that rescales the accumulators); thread (g, d) accumulates output dim d
// of head g over the tile's V rows. The part's unnormalised state goes to part_st
// ([head][part][2 + head_dim]: m, l, acc), and the last block of the KV head to finish (an
// arrival counter, which it resets) merges the parts of its G heads into `out`: no merge
// kernel, so no extra kernel boundary per layer. Called after griddepcontrol.wait: the rows
// (the newest among them) and q are the previous kernel's output.
#define GQ_THREADS 256
#define GQ_T 64       // positions a tile (a multiple of 32: GQ_T / 32 scores a lane in the softmax)
#define GQ_STAGES 3   // tiles in shared memory
#define GQ_MAX_O 4    // (head, dim) outputs per thread: G * head_dim <= GQ_THREADS * GQ_MAX_O

template <int HD>
__device__ __forceinline__ void gqa_part(const float* q, const bf16_t* k_cache, const bf16_t* v_cache,
                                         float* part_st, u32* done, float* out, int len, int n_heads, int n_kv,
                                         int parts) {
    // Dynamic shared memory as laid out below, sized by the host (gqa_smem, src/gpu/baseline.rs).
    extern __shared__ __align__(16) unsigned char gq_smem[];
    __shared__ int is_last;
    constexpr int RS = HD + 8;  // bf16 a row: 16 bytes of padding put 8 rows' chunks in distinct banks
    constexpr int CH = HD / 8;  // 16-byte chunks a row
    const int G = n_heads / n_kv, kvh = blockIdx.x / parts, p = blockIdx.x - kvh * parts;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int kv_stride = n_kv * HD, span = (len + parts - 1) / parts;
    const int p_begin = min(len, p * span), p_end = min(len, p_begin + span);
    const int ntiles = (p_end - p_begin + GQ_T - 1) / GQ_T;
    bf16_t* ks = (bf16_t*)gq_smem;                     // [GQ_STAGES][GQ_T][RS]
    bf16_t* vs = ks + GQ_STAGES * GQ_T * RS;           // [GQ_STAGES][GQ_T][RS]
    float* qs = (float*)(vs + GQ_STAGES * GQ_T * RS);  // [G][HD], pre-scaled
    float* sc = qs + G * HD;                           // [G][GQ_T]: scores, then weights
    float* ml = sc + G * GQ_T;                         // [G][3]: m, l, corr
    const bf16_t* kb = k_cache + kvh * HD;
    const bf16_t* vb = v_cache + kvh * HD;
    const auto issue = [&](int t) {
        const int stage = t % GQ_STAGES, base = p_begin + t * GQ_T;
        for (int i = tid; i < 2 * GQ_T * CH; i += GQ_THREADS) {
            const int is_v = i >= GQ_T * CH, r = (i / CH) % GQ_T, c = i % CH, pos = base + r;
            const bool ok = pos < p_end;
            const bf16_t* src = (is_v ? vb : kb) + (size_t)(ok ? pos : p_begin) * kv_stride + 8 * c;
            cp_async16((is_v ? vs : ks) + (stage * GQ_T + r) * RS + 8 * c, src, ok);
        }
    };
    for (int t = 0; t < GQ_STAGES - 1; t++) {
        if (t < ntiles) issue(t);
        cp_async_commit();  // empty groups too: the wait below counts groups
    }
    const float scale = rsqrtf((float)HD);
    for (int i = tid; i < G * HD; i += GQ_THREADS) qs[i] = q[(size_t)kvh * G * HD + i] * scale;
    for (int g = tid; g < G; g += GQ_THREADS) {
        ml[3 * g] = NEG_INF;
        ml[3 * g + 1] = 0.f;
    }
    // A part with no positions (ntiles = 0) goes straight to its state, which other threads
    // read from ml: the loop's barriers cannot be what orders that.
    __syncthreads();
    float acc[GQ_MAX_O];
#pragma unroll
    for (int i = 0; i < GQ_MAX_O; i++) acc[i] = 0.f;
    for (int t = 0; t < ntiles; t++) {
        cp_async_wait<GQ_STAGES - 2>();  // tile t is in
        // Everyone's copies of tile t are visible, and everyone is done with tile t - 1, whose
        // stage the next issue refills.
        __syncthreads();
        if (t + GQ_STAGES - 1 < ntiles) issue(t + GQ_STAGES - 1);
        cp_async_commit();
        const int stage = t % GQ_STAGES, base = p_begin + t * GQ_T;
        const bf16_t* kt = ks + stage * GQ_T * RS;
        const bf16_t* vt = vs + stage * GQ_T * RS;
        for (int i = tid; i < G * GQ_T; i += GQ_THREADS) {
            const int g = i / GQ_T, j = i - g * GQ_T;
            float s = NEG_INF;
            if (base + j < p_end) {
                s = 0.f;
#pragma unroll
                for (int c = 0; c < CH; c++) s += dot8(*(const uint4*)(kt + j * RS + 8 * c), qs + g * HD + 8 * c);
            }
            sc[i] = s;
        }
        __syncthreads();
        for (int g = warp; g < G; g += GQ_THREADS / 32) {
            constexpr int PL = GQ_T / 32;  // scores a lane
            float sl[PL], mt = NEG_INF;
#pragma unroll
            for (int r = 0; r < PL; r++) {
                sl[r] = sc[g * GQ_T + lane + 32 * r];
                mt = fmaxf(mt, sl[r]);
            }
            const float m_old = ml[3 * g], m_new = fmaxf(m_old, warp_max(mt));  // finite: a tile holds >= 1 position
            float sum = 0.f;
#pragma unroll
            for (int r = 0; r < PL; r++) {
                const float e = __expf(sl[r] - m_new);  // 0 for a masked position
                sc[g * GQ_T + lane + 32 * r] = e;
                sum += e;
            }
            sum = warp_sum(sum);
            __syncwarp();
            if (lane == 0) {
                const float corr = __expf(m_old - m_new);  // 0 on the first tile (m_old = -inf)
                ml[3 * g] = m_new;
                ml[3 * g + 1] = ml[3 * g + 1] * corr + sum;
                ml[3 * g + 2] = corr;
            }
        }
        __syncthreads();
#pragma unroll
        for (int i = 0; i < GQ_MAX_O; i++) {
            const int o = tid + i * GQ_THREADS;
            if (o < G * HD) {
                const int g = o / HD, d = o - g * HD;
                const float* e = sc + g * GQ_T;
                float a = acc[i] * ml[3 * g + 2];
#pragma unroll 8
                for (int j = 0; j < GQ_T; j++) a = fmaf(e[j], bf16_to_f32(vt[j * RS + d]), a);
                acc[i] = a;
            }
        }
    }
    cp_async_wait<0>();
    // This part's state per query head (an empty part: m = -inf, l = 0, acc = 0).
#pragma unroll
    for (int i = 0; i < GQ_MAX_O; i++) {
        const int o = tid + i * GQ_THREADS;
        if (o < G * HD) {
            const int g = o / HD, d = o - g * HD;
            float* st = part_st + ((size_t)(kvh * G + g) * parts + p) * (2 + HD);
            st[2 + d] = acc[i];
            if (d == 0) {
                st[0] = ml[3 * g];
                st[1] = ml[3 * g + 1];
            }
        }
    }
    __threadfence();
    __syncthreads();
    if (tid == 0) is_last = atomicAdd(done + kvh, 1u) == (u32)parts - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    // The merge, every step spread over the block so that its L2 reads overlap: each part's
    // (m, l) into shared memory (the tiles' space, free now), then per head (warp g) the
    // maximum, each part's factor exp(m_k - m) (0 for a part that saw no position) and the
    // normaliser, then per (head, dim) the factored sum of the parts' accumulators.
    float* pm = (float*)gq_smem;  // [G][parts]: m_k, then the factor
    float* pl = pm + G * parts;   // [G][parts]: l_k
    float* inv_l = pl + G * parts;
    for (int i = tid; i < G * parts; i += GQ_THREADS) {
        const float* st = part_st + ((size_t)kvh * G * parts + i) * (2 + HD);
        pm[i] = __ldcg(st);
        pl[i] = __ldcg(st + 1);
    }
    __syncthreads();
    for (int g = warp; g < G; g += GQ_THREADS / 32) {
        float m = NEG_INF;
        for (int k = lane; k < parts; k += 32)
            if (pl[g * parts + k] != 0.f) m = fmaxf(m, pm[g * parts + k]);
        m = warp_max(m);
        float l = 0.f;
        for (int k = lane; k < parts; k += 32) {
            const float lk = pl[g * parts + k], c = lk != 0.f ? __expf(pm[g * parts + k] - m) : 0.f;
            pm[g * parts + k] = c;
            l += lk * c;
        }
        l = warp_sum(l);
        if (lane == 0) inv_l[g] = 1.f / l;
    }
    __syncthreads();
    for (int o = tid; o < G * HD; o += GQ_THREADS) {
        const int g = o / HD, d = o - g * HD;
        const float* st = part_st + ((size_t)kvh * G + g) * parts * (2 + HD) + 2 + d;
        const float* c = pm + g * parts;
        float a = 0.f;
#pragma unroll 8
        for (int k = 0; k < parts; k++) a = fmaf(c[k], __ldcg(st + (size_t)k * (2 + HD)), a);
        out[((size_t)kvh * G + g) * HD + d] = a * inv_l[g];
    }
    if (tid == 0) done[kvh] = 0;
}

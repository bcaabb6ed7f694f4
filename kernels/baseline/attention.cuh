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

// q: the head's query in shared memory (all lanes read it). Blocks of 32 positions starting
// at p_begin, this warp taking blocks first_block, first_block + block_step, ...
// D = head_dim / 32. A block's V rows are loaded together with its K rows (they do not depend
// on the scores), so a block costs one round trip to memory, not three.
template <int D>
__device__ __forceinline__ void attend_warp(const float* q, const bf16_t* k_head, const bf16_t* v_head,
                                            int kv_stride, float scale, int p_begin, int p_end,
                                            int first_block, int block_step, float& m, float& l, float* acc) {
    constexpr int HD = 32 * D, KW = HD / 8;  // 16-byte words per K row
    const int lane = threadIdx.x & 31;
    for (int base = p_begin + first_block * 32; base < p_end; base += block_step * 32) {
        const int pj = base + lane, n = min(32, p_end - base);
        VDims<D> vr[32];
#pragma unroll
        for (int i = 0; i < 32; i++)
            if (i < n) vr[i].load(v_head + (size_t)(base + i) * kv_stride + lane * D);
        float s = NEG_INF;
        if (pj < p_end) {
            const bf16_t* kr = k_head + (size_t)pj * kv_stride;
            uint4 kv[KW];
#pragma unroll
            for (int u = 0; u < KW; u++) kv[u] = ld_cg16(kr + 8 * u);
            float dot = 0.f;
#pragma unroll
            for (int u = 0; u < KW; u++) dot += dot8(kv[u], q + 8 * u);
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
            if (i < n) vr[i].fma_into(__shfl_sync(0xffffffffu, e, i), acc);
        m = m_new;
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

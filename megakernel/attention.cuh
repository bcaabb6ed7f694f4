// Attention math shared by the baseline kernel and the megakernel's Attention instruction.
// One warp streams positions [p_begin, p_end) with stride p_step of one kv head, keeping an
// online softmax (running max m, running sum l, weighted V sum acc); lane j owns dims
// j*D .. j*D+D-1 of the head (D = head_dim / 32, at most 4).

#define ATT_MAX_D 4

__device__ __forceinline__ void load_head_dims(const bf16_t* p, int D, float* out) {
    if (D == 2) {
        u32 w = *(const u32*)p;
        out[0] = __uint_as_float(w << 16); out[1] = __uint_as_float(w & 0xffff0000u);
    } else {
        uint2 w = *(const uint2*)p;
        out[0] = __uint_as_float(w.x << 16); out[1] = __uint_as_float(w.x & 0xffff0000u);
        out[2] = __uint_as_float(w.y << 16); out[3] = __uint_as_float(w.y & 0xffff0000u);
    }
}

__device__ __forceinline__ void attend_warp(const float* qd, const bf16_t* k_head, const bf16_t* v_head,
                                            int kv_stride, int D, float scale, int p_begin, int p_end,
                                            int p_step, float& m, float& l, float* acc) {
    const int lane = threadIdx.x & 31;
    for (int p = p_begin; p < p_end; p += p_step) {
        float kd[ATT_MAX_D], vd[ATT_MAX_D];
        load_head_dims(k_head + (size_t)p * kv_stride + lane * D, D, kd);
        load_head_dims(v_head + (size_t)p * kv_stride + lane * D, D, vd);
        float s = 0.f;
        for (int j = 0; j < D; j++) s = fmaf(qd[j], kd[j], s);
        s = warp_sum(s) * scale;
        float m_new = fmaxf(m, s);
        float corr = __expf(m - m_new);
        float e = __expf(s - m_new);
        l = l * corr + e;
        for (int j = 0; j < D; j++) acc[j] = acc[j] * corr + e * vd[j];
        m = m_new;
    }
}

// Merges per-warp (m, l, acc) states held in shared memory into one normalised output.
// st: [nwarps][2 + head_dim] floats. Called by all threads; writes out[0..head_dim).
__device__ __forceinline__ void merge_warp_states(float* st, int nwarps, int head_dim, float* out) {
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float m = NEG_INF;
        for (int w = 0; w < nwarps; w++) m = fmaxf(m, st[w * (2 + head_dim)]);
        float l = 0.f, a = 0.f;
        for (int w = 0; w < nwarps; w++) {
            const float* s = st + w * (2 + head_dim);
            float c = s[0] == NEG_INF ? 0.f : __expf(s[0] - m);
            l += s[1] * c;
            a += s[2 + d] * c;
        }
        out[d] = a / l;
    }
}

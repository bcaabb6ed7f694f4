// RmsQkvRope(layer, head, pair_start, pairs): RMS norm of the residual entering the layer, the
// rows of a Q, K or V head that make up its rotation pairs, then RoPE and the stores: Q into
// q[l], or K/V into the cache at pos and into kv_new. Consumer thread j < pairs rotates pair j
// (pairs <= head_dim / 2 < CONSUMERS). With q/k norms (Qwen3, MK_QK_NORM) q and k are stored
// raw, f32, in q[l] and kv_new only: attention norms, rotates and caches them (attention.cuh).

// Weight rows: the pairs' first halves (rows pair_start + j), then their second halves (rows
// head_dim / 2 + pair_start + j) of the head's rows of w_qkv.
__device__ __forceinline__ int qkv_rows(const u32* w) { return 2 * (int)w[W_C]; }
__device__ __forceinline__ int qkv_cols(const MkParams& p) { return p.hidden; }
__device__ __forceinline__ WRow qkv_row(const u32* w, const MkParams& p, const LayerW& L, int j) {
    int pc = w[W_C], half = p.head_dim / 2;
    int row = w[W_A] * p.head_dim + (j < pc ? (int)w[W_B] + j : half + (int)w[W_B] + j - pc);
    return wrow(layer_wt(L.w_qkv, MK_WT_QKV), layer_mat(L.w_qkv), row, p.hidden, 0);
}

__device__ __forceinline__ void prepare_qkv(const MkParams& p, const u32* w, const TokenMeta& m, const Smem& sm) {
    prepare_normed(p, w[W_LAYER], false, m.token, sm.lw[w[W_LAYER]].attn_norm, sm.xs, sm.ss);
}

#ifndef MK_QK_NORM
#define MK_QK_NORM 1
#endif

// Thread j's rotation, worked out when the instruction starts (it depends only on the
// position), so that the sine and cosine are off the critical path wherever the instruction
// starts before its inputs arrive (the frequency from shared memory where it fits, MK_FREQ).
struct Rope {
    float s, c;
};

__device__ __forceinline__ Rope rope_of(const MkParams& p, const u32* w, u32 pos) {
    const int ct = threadIdx.x - 32;
    Rope r = {0.f, 1.f};
    if (!MK_QK_NORM && ct < (int)w[W_C] && (int)w[W_A] < p.heads + p.kv_heads)
        rope_sincos(pos, MK_FREQ(p, w[W_B] + ct), &r.s, &r.c);
    return r;
}

// Qwen2's q/k/v biases, compiled in by MK_QKV_BIAS (from the host: 0 unless the model has them).
#ifndef MK_QKV_BIAS
#define MK_QKV_BIAS 1
#endif
__device__ __forceinline__ float qkv_bias_at(const LayerW& L, int head, int row, int hd) {
    if constexpr (!MK_QKV_BIAS) return 0.f;
    return L.qkv_bias ? bf16_to_f32(L.qkv_bias[head * hd + row]) : 0.f;
}

__device__ void post_qkv(const MkParams& p, const u32* w, const TokenMeta& m, const LayerW& L, const float* res,
                         float scale, Rope rope) {
    const int ct = threadIdx.x - 32, layer = w[W_LAYER], head = w[W_A], ps = w[W_B], pc = w[W_C];
    const int hd = p.head_dim, half = hd / 2;
    if (ct < pc) {
        const int j = ct, i = ps + j;
        const float x = scale * res_at(res, j) + qkv_bias_at(L, head, i, hd);
        const float y = scale * res_at(res, pc + j) + qkv_bias_at(L, head, half + i, hd);
        const float a = x * rope.c - y * rope.s, b = y * rope.c + x * rope.s;
        const u32 tag = step_tag();
        if (MK_QK_NORM && head >= p.heads && head < p.heads + p.kv_heads) {
            // Raw K: attention finishes it and writes the cache row.
            u64* row = p.kv_new + ((size_t)layer * 2 * p.kv_heads + head - p.heads) * hd;
            st_tagged(row + i, a, tag);
            st_tagged(row + i + half, b, tag);
        } else if (head < p.heads) {
            u64* q = p.q + (size_t)layer * p.heads * hd + head * hd;
            st_tagged(q + i, a, tag);
            st_tagged(q + i + half, b, tag);
        } else {
            // The cache row is for later launches; this launch's attention reads the row from
            // kv_new, where it carries its tag (the same bf16 values, widened).
            bool is_k = head < p.heads + p.kv_heads;
            int kvh = head - p.heads - (is_k ? 0 : p.kv_heads);
            bf16_t* cache = (bf16_t*)kv_row(p, is_k ? p.k_cache : p.v_cache, layer, kvh, m.pos);
            const bf16_t ha = f32_to_bf16(a), hb = f32_to_bf16(b);
            cache[i] = ha; cache[i + half] = hb;
            u64* row = p.kv_new + (((size_t)layer * 2 + (is_k ? 0 : 1)) * p.kv_heads + kvh) * hd;
            st_tagged(row + i, bf16_to_f32(ha), tag);
            st_tagged(row + i + half, bf16_to_f32(hb), tag);
        }
    }
}

// RmsQkvRope(layer, head, pair_start, pairs): RMS norm of the residual entering the layer, the
// rows of a Q, K or V head that make up its rotation pairs, then RoPE and the stores: Q into
// q[l], or K/V into the cache at pos and into kv_new. Consumer thread j < pairs rotates pair j
// (pairs <= head_dim / 2 < CONSUMERS).

// Weight rows: the pairs' first halves (rows pair_start + j), then their second halves (rows
// head_dim / 2 + pair_start + j) of the head's rows of w_qkv.
__device__ __forceinline__ int qkv_rows(const u32* w) { return 2 * (int)w[W_C]; }
__device__ __forceinline__ int qkv_cols(const MkParams& p) { return p.hidden; }
__device__ __forceinline__ WRow qkv_row(const u32* w, const MkParams& p, const LayerW& L, int j) {
    int pc = w[W_C], half = p.head_dim / 2;
    int row = w[W_A] * p.head_dim + (j < pc ? (int)w[W_B] + j : half + (int)w[W_B] + j - pc);
    return wrow(MK_WT_QKV, L.w_qkv, row, p.hidden, 0);
}

__device__ __forceinline__ void prepare_qkv(const MkParams& p, const u32* w, const TokenMeta& m, const Smem& sm) {
    prepare_normed(p, w[W_LAYER], false, m.token, sm.lw[w[W_LAYER]].attn_norm, sm.xs, sm.ss);
}

// Thread j's rotation, worked out when the instruction starts (it depends only on the
// position), so that the sine, cosine and inv_freq load are off the critical path.
struct Rope {
    float s, c;
};

__device__ __forceinline__ Rope rope_of(const MkParams& p, const u32* w, u32 pos) {
    const int ct = threadIdx.x - 32;
    Rope r = {0.f, 1.f};
    if (ct < (int)w[W_C] && (int)w[W_A] < p.heads + p.kv_heads) rope_sincos(pos, p.inv_freq[w[W_B] + ct], &r.s, &r.c);
    return r;
}

// Qwen's steps before RoPE: the q/k/v biases (Qwen2), then a q or k head's RMS norm over
// head_dim (Qwen3). The host gives models with q/k norms whole heads per instruction
// (pair_start 0, pairs head_dim / 2), so the sum of squares is over this instruction's rows.
// Every consumer warp sums the squares itself from res, which needs no barrier between warps.
// MK_QKV_BIAS and MK_QK_NORM (from the host: 0 unless the model has them) compile the steps in.
#ifndef MK_QKV_BIAS
#define MK_QKV_BIAS 1
#endif
#ifndef MK_QK_NORM
#define MK_QK_NORM 1
#endif
__device__ __forceinline__ float qkv_bias_at(const LayerW& L, int head, int row, int hd) {
    if constexpr (!MK_QKV_BIAS) return 0.f;
    return L.qkv_bias ? bf16_to_f32(L.qkv_bias[head * hd + row]) : 0.f;
}

__device__ void post_qkv(const MkParams& p, const u32* w, const TokenMeta& m, const LayerW& L, const float* res,
                         float scale, Rope rope) {
    const int ct = threadIdx.x - 32, layer = w[W_LAYER], head = w[W_A], ps = w[W_B], pc = w[W_C];
    const int hd = p.head_dim, half = hd / 2;
    const bf16_t* norm = !MK_QK_NORM         ? nullptr
                         : head < p.heads              ? L.q_norm
                         : head < p.heads + p.kv_heads ? L.k_norm
                                                       : nullptr;
    float inv_rms = 1.f;
    if (norm) {
        float ss = 0.f;
        for (int r = threadIdx.x & 31; r < 2 * pc; r += 32) {
            const int row = r < pc ? ps + r : half + ps + r - pc;
            const float v = scale * res_at(res, r) + qkv_bias_at(L, head, row, hd);
            ss += v * v;
        }
        inv_rms = rsqrtf(warp_sum(ss) / hd + p.eps);
    }
    if (ct < pc) {
        const int j = ct, i = ps + j;
        float x = scale * res_at(res, j) + qkv_bias_at(L, head, i, hd);
        float y = scale * res_at(res, pc + j) + qkv_bias_at(L, head, half + i, hd);
        if (norm) {
            x *= inv_rms * bf16_to_f32(norm[i]);
            y *= inv_rms * bf16_to_f32(norm[half + i]);
        }
        const float a = x * rope.c - y * rope.s, b = y * rope.c + x * rope.s;
        const u32 tag = launch_tag(p);
        if (head < p.heads) {
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

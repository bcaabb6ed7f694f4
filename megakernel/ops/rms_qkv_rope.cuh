// RmsQkvRope(layer, head, pairs): the post step after the shared RMS-norm and mat-vec: RoPE,
// then Q into q[l] or K/V into the cache at pos.

__device__ void post_qkv(const MkParams& p, const u32* w, const TokenMeta& m, const float* res) {
    const int ct = threadIdx.x - 32, layer = w[W_LAYER], head = w[W_A], ps = w[W_B], pc = w[W_C];
    const int hd = p.head_dim, half = hd / 2;
    for (int j = ct; j < pc; j += CONSUMERS) {
        float a = res_at(res, j), b = res_at(res, pc + j);
        const int i = ps + j;
        if (head < p.heads + p.kv_heads) {
            float s, c;
            sincosf((float)m.pos * p.inv_freq[i], &s, &c);
            float ra = a * c - b * s, rb = b * c + a * s;
            a = ra; b = rb;
        }
        if (head < p.heads) {
            float* q = p.q + (size_t)layer * p.heads * hd + head * hd;
            q[i] = a; q[i + half] = b;
        } else {
            bool is_k = head < p.heads + p.kv_heads;
            int kvh = head - p.heads - (is_k ? 0 : p.kv_heads);
            bf16_t* cache = (is_k ? p.k_cache : p.v_cache) +
                            (((size_t)layer * p.max_seq + m.pos) * p.kv_heads + kvh) * hd;
            cache[i] = f32_to_bf16(a); cache[i + half] = f32_to_bf16(b);
        }
    }
}

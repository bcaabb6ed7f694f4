// AttnReduce(layer, kv_head, parts): merges the split-KV parts of a KV head's query heads.

__device__ void op_attn_reduce(const MkParams& p, const u32* w) {
    const int ct = threadIdx.x - 32, layer = w[W_LAYER], kvh = w[W_A], parts = w[W_B];
    const int hd = p.head_dim, group = p.heads / p.kv_heads;
    for (int idx = ct; idx < group * hd; idx += CONSUMERS) {
        const int head = kvh * group + idx / hd, d = idx % hd;
        const u64* src = p.attn_part + ((size_t)layer * p.heads + head) * parts * (hd + 2);
        float M = NEG_INF;
        for (int k = 0; k < parts; k++) M = fmaxf(M, ld_value(p, src + k * (hd + 2) + hd));
        float L = 0.f, A = 0.f;
        for (int k = 0; k < parts; k++) {
            const u64* s = src + k * (hd + 2);
            float l = ld_value(p, s + hd + 1);
            if (l == 0.f) continue;
            float c = l * __expf(ld_value(p, s + hd) - M);
            L += c;
            A += ld_value(p, s + d) * c;
        }
        st_tagged(p.attn_out + (size_t)layer * p.heads * hd + head * hd + d, A / L, launch_tag(p));
    }
}

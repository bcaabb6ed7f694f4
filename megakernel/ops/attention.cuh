// Attention(layer, kv_head, part, parts): softmax attention of a KV head's query heads.

#define ATT_IN_MAX 4

// Scratch: per warp and head (m, l, acc[head_dim]), then the G queries, then this token's K
// and V rows. Rows before pos come from the cache (written by earlier launches); the part that
// ends at pos takes row pos from kv_new (written this launch, tagged) as a last step of warp 0.
__device__ void op_attention(const MkParams& p, const u32* w, const TokenMeta& m, float* scratch, u64* prof) {
    const int ct = threadIdx.x - 32, cw = ct >> 5, lane = ct & 31;
    const int layer = w[W_LAYER], kvh = w[W_A], part = w[W_B], parts = w[W_C];
    const int hd = p.head_dim, G = p.heads / p.kv_heads;
    const int len = m.pos + 1, p0 = (int)((long long)part * len / parts), p1 = (int)((long long)(part + 1) * len / parts);
    const bool has_new = p1 == len;
    const size_t layer_off = (size_t)layer * p.max_seq * p.kv_heads * hd;
    const int kv_stride = p.kv_heads * hd, stride = 2 + hd;
    float* qs = scratch + CONSUMER_WARPS * G * stride;
    float* kn = qs + G * hd;
    float* vn = kn + hd;
    {
        // The queries and (for the last part) this token's K and V rows, read as one batch:
        // element i < G·hd is a query value, then hd of K, then hd of V.
        const u64* qsrc = p.q + (size_t)layer * p.heads * hd + kvh * G * hd;
        const u64* ksrc = p.kv_new + ((size_t)layer * 2 * p.kv_heads + kvh) * hd;
        const u64* vsrc = ksrc + (size_t)p.kv_heads * hd;
        const int nq = G * hd, n = nq + (has_new ? 2 * hd : 0);
        auto src = [&](int i) { return i < nq ? qsrc + i : i < nq + hd ? ksrc + (i - nq) : vsrc + (i - nq - hd); };
        warp_gate(p, src(min(n - 1, ct & ~31)));
        for (int i0 = ct; i0 < n; i0 += ATT_IN_MAX * CONSUMERS) {
            const int mine = min(ATT_IN_MAX, (n - i0 + CONSUMERS - 1) / CONSUMERS);
            u64 raw[ATT_IN_MAX];
#pragma unroll
            for (int k = 0; k < ATT_IN_MAX; k++) raw[k] = k < mine ? ld_tagged(src(i0 + k * CONSUMERS)) : 0;
            settle<ATT_IN_MAX>(p, raw, [&](int k) { return src(i0 + k * CONSUMERS); }, mine);
#pragma unroll
            for (int k = 0; k < ATT_IN_MAX; k++)
                if (k < mine) qs[i0 + k * CONSUMERS] = tagged_float(raw[k]);
        }
    }
    consumers_sync();
    if (ct == 0 && prof) prof[1] = global_ns();
    const int p_end = has_new ? len - 1 : p1;
    const bf16_t* kh = p.k_cache + layer_off + kvh * hd;
    const bf16_t* vh = p.v_cache + layer_off + kvh * hd;
    const float scale = rsqrtf((float)hd);
    const int chunks = hd / 8;
    for (int g0 = 0; g0 < G; g0 += ATT_HEADS_PER_PASS) {
        const int gn = min(ATT_HEADS_PER_PASS, G - g0);
        float mx[ATT_HEADS_PER_PASS], l[ATT_HEADS_PER_PASS], acc[ATT_HEADS_PER_PASS][8];
#pragma unroll
        for (int g = 0; g < ATT_HEADS_PER_PASS; g++) {
            mx[g] = NEG_INF; l[g] = 0.f;
#pragma unroll
            for (int d = 0; d < 8; d++) acc[g][d] = 0.f;
        }
        if (hd == 64) attend_group_warp<8>(qs + g0 * hd, gn, kh, vh, kv_stride, scale, p0, p_end, cw, CONSUMER_WARPS, mx, l, acc);
        else attend_group_warp<16>(qs + g0 * hd, gn, kh, vh, kv_stride, scale, p0, p_end, cw, CONSUMER_WARPS, mx, l, acc);
        if (has_new && cw == 0) {
            // Lanes c, c + CH, ... hold dims [8c, 8c + 8) of acc (after attend_group_warp).
            const int c = lane % (hd / 8);
#pragma unroll
            for (int g = 0; g < ATT_HEADS_PER_PASS; g++) {
                if (g >= gn) break;
                float dot = 0.f;
                for (int d = lane; d < hd; d += 32) dot = fmaf(qs[(g0 + g) * hd + d], kn[d], dot);
                const float s = warp_sum(dot) * scale;
                const float m_new = fmaxf(mx[g], s), corr = __expf(mx[g] - m_new), e = __expf(s - m_new);
                l[g] = l[g] * corr + e;
#pragma unroll
                for (int d = 0; d < 8; d++) acc[g][d] = fmaf(e, vn[8 * c + d], acc[g][d] * corr);
                mx[g] = m_new;
            }
        }
        // Constant indices only (unrolled, guarded), so the arrays stay in registers.
#pragma unroll
        for (int g = 0; g < ATT_HEADS_PER_PASS; g++) {
            if (g >= gn) break;
            float* st = scratch + (cw * G + g0 + g) * stride;
            if (lane == 0) { st[0] = mx[g]; st[1] = l[g]; }
            if (lane < chunks) {
#pragma unroll
                for (int d = 0; d < 8; d++) st[2 + lane * 8 + d] = acc[g][d];
            }
        }
    }
    // Profile words 4 and 5 (the loader's for a mat-vec): warp 0's blocks done, every warp's.
    if (ct == 0 && prof) prof[4] = global_ns();
    consumers_sync();
    if (ct == 0 && prof) prof[5] = global_ns();
    for (int idx = ct; idx < G * hd; idx += CONSUMERS) {
        const int g = idx / hd, d = idx % hd, head = kvh * G + g;
        float M = NEG_INF;
        for (int k = 0; k < CONSUMER_WARPS; k++) M = fmaxf(M, scratch[(k * G + g) * stride]);
        float L = 0.f, A = 0.f;
        for (int k = 0; k < CONSUMER_WARPS; k++) {
            const float* s = scratch + (k * G + g) * stride;
            if (s[1] == 0.f) continue;  // a warp that saw no position
            float c = __expf(s[0] - M);
            L += s[1] * c;
            A += s[2 + d] * c;
        }
        float o = L > 0.f ? A / L : 0.f;
        const u32 tag = launch_tag(p);
        if (parts == 1) {
            st_tagged(p.attn_out + (size_t)layer * p.heads * hd + head * hd + d, o, tag);
        } else {
            u64* dst = p.attn_part + (((size_t)layer * p.heads + head) * parts + part) * (hd + 2);
            st_tagged(dst + d, o, tag);
            if (d == 0) { st_tagged(dst + hd, M, tag); st_tagged(dst + hd + 1, L, tag); }
        }
    }
}

// The model's activations as several instructions read them: the residual stream entering a
// layer (RMS-normed for QKV, up-gate and the LM head) and rows of the KV cache.

// The RMS norm's scale from the sums of squares prepare_normed left in ss.
__device__ __forceinline__ float rms_scale(const MkParams& p, const float* ss) {
    float t = 0.f;
#pragma unroll
    for (int i = 0; i < CONSUMER_WARPS; i++) t += ss[i];
    return rsqrtf(t / p.hidden + p.eps);
}

// Residual stream entering `layer`: the embedding row for layer 0, else the previous layer's
// attention residual plus its down-projection partial sums (each written once per token).
// Its parts are read at once (one round trip, not one each) when there are few enough.
#define PREP_CHUNKS 2
__device__ __forceinline__ float resid_in(const MkParams& p, int layer, u32 token, int i) {
    if (layer == 0) return bf16_to_f32(p.embed[(size_t)token * p.hidden + i]);
    const int l = layer - 1;
    const u64* base = p.resid_attn + (size_t)l * p.hidden + i;
    const u64* parts = p.mlp_part + (size_t)l * p.chunks * p.hidden + i;
    if (p.chunks <= PREP_CHUNKS) {
        auto addr = [&](int k) { return k == 0 ? base : parts + (size_t)(k - 1) * p.hidden; };
        u64 raw[1 + PREP_CHUNKS];
#pragma unroll
        for (int k = 0; k <= PREP_CHUNKS; k++) raw[k] = k <= p.chunks ? ld_tagged(addr(k)) : 0;
        settle<1 + PREP_CHUNKS>(p, raw, addr, 1 + p.chunks);
        float v = tagged_float(raw[0]);
#pragma unroll
        for (int k = 1; k <= PREP_CHUNKS; k++)
            if (k <= p.chunks) v += tagged_float(raw[k]);
        return v;
    }
    float v = ld_value(p, base);
    for (int c = 0; c < p.chunks; c++) v += ld_value(p, parts + (size_t)c * p.hidden);
    return v;
}

// xs = src * g, src given by resid_in(layer) or resid_attn[l] (after_attn), and the sums of
// squares in ss: the norm's scale is one number, applied to the mat-vec's results (W(x·s·g) =
// s·W(x·g)), so the tiles need not wait for the sum to be reduced.
// Each thread first issues every L2 load it needs (PREP_MAX elements of each source and of g),
// then sums: one round trip in all, where a round trip per source or per element would add up
// on the critical path of every layer.
#define PREP_MAX 8
__device__ void prepare_normed(const MkParams& p, int layer, bool after_attn, u32 token, const bf16_t* g,
                               float* xs, float* ss) {
    const int ct = threadIdx.x - 32;
    const int nparts = after_attn || layer == 0 ? 0 : p.chunks;
    if (p.hidden <= PREP_MAX * CONSUMERS && nparts <= PREP_CHUNKS) {
        u64 raw[PREP_MAX], rawp[PREP_CHUNKS][PREP_MAX];
        float gw[PREP_MAX], v[PREP_MAX];
        const u64* base = after_attn ? p.resid_attn + (size_t)layer * p.hidden
                          : layer == 0 ? nullptr : p.resid_attn + (size_t)(layer - 1) * p.hidden;
        const u64* parts = p.mlp_part + (size_t)(layer > 0 ? layer - 1 : 0) * p.chunks * p.hidden;
        // The norm's weights (and layer 0's embedding row) do not depend on this step: they
        // are issued first, so they are in flight while the inputs are waited for.
#pragma unroll
        for (int k = 0; k < PREP_MAX; k++) {
            const int i = ct + k * CONSUMERS;
            const bool in = i < p.hidden;
            v[k] = in && !base ? bf16_to_f32(p.embed[(size_t)token * p.hidden + i]) : 0.f;
            gw[k] = in ? bf16_to_f32(g[i]) : 0.f;
        }
#pragma unroll
        for (int k = 0; k < PREP_MAX; k++) {
            const int i = ct + k * CONSUMERS;
            const bool in = i < p.hidden;
            raw[k] = in && base ? ld_tagged(base + i) : 0;
#pragma unroll
            for (int c = 0; c < PREP_CHUNKS; c++)
                rawp[c][k] = in && c < nparts ? ld_tagged(parts + (size_t)c * p.hidden + i) : 0;
        }
        const int mine = p.hidden > ct ? (p.hidden - ct + CONSUMERS - 1) / CONSUMERS : 0;
        if (base) settle<PREP_MAX>(p, raw, [&](int k) { return base + ct + k * CONSUMERS; }, mine);
#pragma unroll
        for (int c = 0; c < PREP_CHUNKS; c++)
            if (c < nparts)
                settle<PREP_MAX>(p, rawp[c], [&](int k) { return parts + (size_t)c * p.hidden + ct + k * CONSUMERS; }, mine);
        float sq = 0.f;
#pragma unroll
        for (int k = 0; k < PREP_MAX; k++) {
            if (k < mine) {
                if (base) v[k] = tagged_float(raw[k]);
#pragma unroll
                for (int c = 0; c < PREP_CHUNKS; c++)
                    if (c < nparts) v[k] += tagged_float(rawp[c][k]);
            }
            sq += v[k] * v[k];
        }
        consumers_partial_sum(sq, ss);
#pragma unroll
        for (int k = 0; k < PREP_MAX; k++) {
            const int i = ct + k * CONSUMERS;
            if (i < p.hidden) xs[i] = v[k] * gw[k];
        }
        return;
    }
    float sq = 0.f;
    for (int i = ct; i < p.hidden; i += CONSUMERS) {
        float v = after_attn ? ld_value(p, p.resid_attn + (size_t)layer * p.hidden + i) : resid_in(p, layer, token, i);
        xs[i] = v * bf16_to_f32(g[i]);
        sq += v * v;
    }
    consumers_partial_sum(sq, ss);
}

__device__ __forceinline__ const bf16_t* kv_row(const MkParams& p, const bf16_t* cache, int layer, int kvh, int row) {
    return cache + (((size_t)layer * p.kv_heads + kvh) * p.max_seq + row) * p.head_dim;
}

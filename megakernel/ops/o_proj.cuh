// OProjResidual(layer, row_start, rows): rows of the attention output projection, added to the
// residual stream entering the layer, into resid_attn[l].

__device__ __forceinline__ int oproj_rows(const u32* w) { return (int)w[W_B]; }
__device__ __forceinline__ int oproj_cols(const MkParams& p) { return p.heads * p.head_dim; }
__device__ __forceinline__ WRow oproj_row(const u32* w, const MkParams& p, const LayerW& L, int j) {
    return wrow(layer_wt(L.wo, MK_WT_O), layer_mat(L.wo), w[W_A] + j, p.heads * p.head_dim, 0);
}

// The residual rows it adds wait in the second half of res (the host keeps O-proj's rows
// within RES_MAX / 2). Read by resid_in, they are waited for before the input's copy starts:
// two round trips where O starts after attention has stored. MK_OPROJ_ONE_TRIP=1 (for
// measuring) issues the rows' loads (one a thread, every chunk), copies the input and then
// settles the rows, one round trip for both.
#ifndef MK_OPROJ_ONE_TRIP
#define MK_OPROJ_ONE_TRIP 0
#endif
__device__ __forceinline__ void prepare_oproj(const MkParams& p, const u32* w, const TokenMeta& m, const Smem& sm) {
    const int ct = threadIdx.x - 32;
#if MK_OPROJ_ONE_TRIP
    const int layer = w[W_LAYER], rows = w[W_B];
    if (layer > 0 && rows <= CONSUMERS && p.chunks <= 1 + PREP_CHUNKS) {
        const int n = ct < rows ? p.chunks : 0;
        const u64* base = p.mlp_part + (size_t)(layer - 1) * p.chunks * p.hidden + w[W_A] + ct;
        auto addr = [&](int k) { return base + (size_t)k * p.hidden; };
        u64 raw[1 + PREP_CHUNKS];
#pragma unroll
        for (int k = 0; k <= PREP_CHUNKS; k++) raw[k] = k < n ? ld_tagged(addr(k)) : 0;
        copy_in(p, sm.xs, p.attn_out + (size_t)layer * p.heads * p.head_dim, p.heads * p.head_dim);
        settle<1 + PREP_CHUNKS>(p, raw, addr, n);
        if (n > 0) sm.res[RES_MAX + ct] = sum_settled(raw, n);
        return;
    }
#endif
    for (int j = ct; j < (int)w[W_B]; j += CONSUMERS)
        sm.res[RES_MAX + j] = resid_in(p, w[W_LAYER], m.token, w[W_A] + j);
    copy_in(p, sm.xs, p.attn_out + (size_t)w[W_LAYER] * p.heads * p.head_dim, p.heads * p.head_dim);
}

__device__ __forceinline__ void post_oproj(const MkParams& p, const u32* w, const float* res) {
    const int ct = threadIdx.x - 32, layer = w[W_LAYER], rs = w[W_A], rc = w[W_B];
    const u32 tag = step_tag();
    for (int j = ct; j < rc; j += CONSUMERS)
        st_tagged(p.resid_attn + (size_t)layer * p.hidden + rs + j, res[RES_MAX + j] + res_at(res, j), tag);
}

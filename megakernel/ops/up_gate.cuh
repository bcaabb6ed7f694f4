// RmsUpGateSilu(layer, row_start, rows): RMS norm of resid_attn[l], the up and gate rows
// (gate rows inter + row_start + j of w_gu follow the up rows), SiLU(gate) * up into act[l].

__device__ __forceinline__ int upgate_rows(const u32* w) { return 2 * (int)w[W_B]; }
__device__ __forceinline__ int upgate_cols(const MkParams& p) { return p.hidden; }
__device__ __forceinline__ WRow upgate_row(const u32* w, const MkParams& p, const LayerW& L, int j) {
    int rc = w[W_B];
    int row = j < rc ? (int)w[W_A] + j : p.inter + (int)w[W_A] + j - rc;
    return wrow(layer_wt(L.w_gu, MK_WT_GU), layer_mat(L.w_gu), row, p.hidden, 0);
}

__device__ __forceinline__ void prepare_upgate(const MkParams& p, const u32* w, const TokenMeta& m, const Smem& sm) {
    prepare_normed(p, w[W_LAYER], true, m.token, sm.lw[w[W_LAYER]].ffn_norm, sm.xs, sm.ss);
}

__device__ __forceinline__ void post_upgate(const MkParams& p, const u32* w, const float* res, float scale) {
    const int ct = threadIdx.x - 32, layer = w[W_LAYER], rs = w[W_A], rc = w[W_B];
    const u32 tag = step_tag();
    for (int j = ct; j < rc; j += CONSUMERS)
        st_tagged(p.act + (size_t)layer * p.inter + rs + j, silu(scale * res_at(res, j)) * (scale * res_at(res, rc + j)),
                  tag);
}

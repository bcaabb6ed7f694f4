// DownProjPartial(layer, row_start, rows, chunk, col_start, cols): rows of the down
// projection over one chunk of act[l]'s columns; the partial sums go to mlp_part[l][chunk],
// which the next layer's readers add to the residual (see resid_in).

__device__ __forceinline__ int down_rows(const u32* w) { return (int)w[W_B]; }
__device__ __forceinline__ int down_cols(const u32* w) { return (int)w[W_E]; }
__device__ __forceinline__ WRow down_row(const u32* w, const MkParams& p, const LayerW& L, int j) {
    return wrow(layer_wt(L.w_down, MK_WT_DOWN), layer_mat(L.w_down), w[W_A] + j, p.inter, w[W_D]);
}

__device__ __forceinline__ void prepare_down(const MkParams& p, const u32* w, const Smem& sm) {
    copy_in(p, sm.xs, p.act + (size_t)w[W_LAYER] * p.inter + w[W_D], w[W_E]);
}

__device__ __forceinline__ void post_down(const MkParams& p, const u32* w, const float* res) {
    const int ct = threadIdx.x - 32, layer = w[W_LAYER], rs = w[W_A], rc = w[W_B];
    const u32 tag = step_tag();
    for (int j = ct; j < rc; j += CONSUMERS)
        st_tagged(p.mlp_part + ((size_t)layer * p.chunks + w[W_C]) * p.hidden + rs + j, res_at(res, j), tag);
}

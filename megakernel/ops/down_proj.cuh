// DownProjPartial(layer, row_start, rows, chunk, col_start, cols): rows of the down
// projection over one chunk of act[l]'s columns; the partial sums go to mlp_part[l][chunk],
// which the next layer's readers add up into the residual (see resid_in). Chunk 0 adds the
// attention residual resid_attn[l] of its rows, so those readers need not read it.

__device__ __forceinline__ int down_rows(const u32* w) { return (int)w[W_B]; }
__device__ __forceinline__ int down_cols(const u32* w) { return (int)w[W_E]; }
__device__ __forceinline__ WRow down_row(const u32* w, const MkParams& p, const LayerW& L, int j) {
    return wrow(layer_wt(L.w_down, MK_WT_DOWN), layer_mat(L.w_down), w[W_A] + j, p.inter, w[W_D]);
}

// Chunk 0's attention residual rows wait in res[RES_MAX + j], beside the rows' results (the
// host keeps the down projection's rows within RES_MAX / 2, check_limits). Their loads are
// issued before the input's copy and settled after it, so both share a round trip (the rows
// were written before up-gate ran, so they are there by then).
#define DOWN_RESID_MAX (RES_MAX / 2 / CONSUMERS)
__device__ __forceinline__ void prepare_down(const MkParams& p, const u32* w, const Smem& sm) {
    const int ct = threadIdx.x - 32, rows = w[W_C] == 0 ? (int)w[W_B] : 0;
    const u64* resid = p.resid_attn + (size_t)w[W_LAYER] * p.hidden + w[W_A];
    u64 raw[DOWN_RESID_MAX];
#pragma unroll
    for (int k = 0; k < DOWN_RESID_MAX; k++) raw[k] = ct + k * CONSUMERS < rows ? ld_tagged(resid + ct + k * CONSUMERS) : 0;
    copy_in(p, sm.xs, p.act + (size_t)w[W_LAYER] * p.inter + w[W_D], w[W_E]);
    const int mine = rows > ct ? (rows - ct + CONSUMERS - 1) / CONSUMERS : 0;
    settle<DOWN_RESID_MAX>(p, raw, [&](int k) { return resid + ct + k * CONSUMERS; }, mine);
#pragma unroll
    for (int k = 0; k < DOWN_RESID_MAX; k++)
        if (k < mine) sm.res[RES_MAX + ct + k * CONSUMERS] = tagged_float(raw[k]);
}

__device__ __forceinline__ void post_down(const MkParams& p, const u32* w, const float* res) {
    const int ct = threadIdx.x - 32, layer = w[W_LAYER], rs = w[W_A], rc = w[W_B];
    const bool first = w[W_C] == 0;
    const u32 tag = step_tag();
    for (int j = ct; j < rc; j += CONSUMERS)
        st_tagged(p.mlp_part + ((size_t)layer * p.chunks + w[W_C]) * p.hidden + rs + j,
                  first ? res_at(res, j) + res[RES_MAX + j] : res_at(res, j), tag);
}

// RmsLmHead(row_start, rows, block): RMS norm of the last layer's output, f32 logits of the
// rows and the block's (max, first row reaching it); in a sampled launch the block then takes
// part in the draw (ops/sample.cuh).

__device__ __forceinline__ int lmhead_rows(const u32* w) { return (int)w[W_B]; }
__device__ __forceinline__ int lmhead_cols(const MkParams& p) { return p.hidden; }
__device__ __forceinline__ WRow lmhead_row(const u32* w, const MkParams& p, int j) {
    return wrow(MK_WT_LM, p.lm_head, w[W_A] + j, p.hidden, 0);
}

__device__ __forceinline__ void prepare_lmhead(const MkParams& p, const TokenMeta& m, const Smem& sm) {
    prepare_normed(p, p.n_layers, false, m.token, p.final_norm, sm.xs, sm.ss);
}

__device__ void post_lmhead(const MkParams& p, const u32* w, const TokenMeta& m, float* res, float* red, float scale) {
    if (MK_SAMPLING && p.sampling) {
        mk_sample_block(p, w, m, res, scale);
        return;
    }
    const int ct = threadIdx.x - 32, rs = w[W_A], rc = w[W_B];
    float v = NEG_INF;
    u32 idx = 0xffffffffu;
    for (int j = ct; j < rc; j += CONSUMERS) {
        float x = scale * res_at(res, j);
        p.logits[rs + j] = x;
        argmax_merge(v, idx, x, (u32)(rs + j));
    }
    consumers_argmax(v, idx, red);
    if (ct == 0) {
        st_tagged(p.lm_best + 2 * w[W_C], v, step_tag());
        st_tagged(p.lm_best + 2 * w[W_C] + 1, __uint_as_float(idx), step_tag());
    }
}

// RmsLmHead(rows, block): f32 logits of the rows and the block's (max, first row reaching it).

__device__ void post_lmhead(const MkParams& p, const u32* w, const float* res, float* red, float scale) {
    const int ct = threadIdx.x - 32, cw = ct >> 5, rs = w[W_A], rc = w[W_B];
    float v = NEG_INF;
    u32 idx = 0xffffffffu;
    for (int j = ct; j < rc; j += CONSUMERS) {
        float x = scale * res_at(res, j);
        p.logits[rs + j] = x;
        argmax_merge(v, idx, x, (u32)(rs + j));
    }
    warp_argmax(v, idx);
    u32* redi = (u32*)(red + CONSUMER_WARPS);
    if ((ct & 31) == 0) { red[cw] = v; redi[cw] = idx; }
    consumers_sync();
    if (ct == 0) {
        for (int k = 1; k < CONSUMER_WARPS; k++) argmax_merge(v, idx, red[k], redi[k]);
        st_tagged(p.lm_best + 2 * w[W_C], v, launch_tag(p));
        st_tagged(p.lm_best + 2 * w[W_C] + 1, __uint_as_float(idx), launch_tag(p));
    }
}

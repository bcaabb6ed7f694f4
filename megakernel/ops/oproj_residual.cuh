// OProjResidual(layer, rows): resid_attn[l] = layer input + W_o · attn_out, for the rows.

__device__ void post_oproj(const MkParams& p, const u32* w, const TokenMeta& m, const float* res) {
    const int ct = threadIdx.x - 32, layer = w[W_LAYER], rs = w[W_A], rc = w[W_B];
    for (int j = ct; j < rc; j += CONSUMERS)
        p.resid_attn[(size_t)layer * p.hidden + rs + j] = resid_in(p, layer, m.token, rs + j) + res_at(res, j);
}

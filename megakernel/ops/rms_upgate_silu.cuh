// RmsUpGateSilu(layer, rows): act[l] = silu(W_gate · x) * (W_up · x), x = rmsnorm(resid_attn[l]).

__device__ void post_upgate(const MkParams& p, const u32* w, const float* res) {
    const int ct = threadIdx.x - 32, layer = w[W_LAYER], rs = w[W_A], rc = w[W_B];
    for (int j = ct; j < rc; j += CONSUMERS)
        p.act[(size_t)layer * p.inter + rs + j] = silu(res_at(res, j)) * res_at(res, rc + j);
}

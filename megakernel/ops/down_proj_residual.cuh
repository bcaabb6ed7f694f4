// DownProjResidual(layer, rows, chunk, cols): mlp_part[l][chunk] = W_down[rows, cols] · act[l][cols].

__device__ void post_down(const MkParams& p, const u32* w, const float* res) {
    const int ct = threadIdx.x - 32, layer = w[W_LAYER], rs = w[W_A], rc = w[W_B];
    for (int j = ct; j < rc; j += CONSUMERS)
        p.mlp_part[((size_t)layer * p.chunks + w[W_C]) * p.hidden + rs + j] = res_at(res, j);
}

// Argmax(blocks): the greedy token over the blocks, written for the host and the next step.

__device__ void op_argmax(const MkParams& p, const TokenMeta& m) {
    const int ct = threadIdx.x - 32;
    if (ct != 0) return;
    float v = NEG_INF;
    u32 idx = 0xffffffffu;
    for (int k = 0; k < p.n_lm; k++) argmax_merge(v, idx, __ldcg(p.lm_best + 2 * k), __float_as_uint(__ldcg(p.lm_best + 2 * k + 1)));
    p.history[m.pos + 1] = idx;
    TokenMeta* cur = p.meta + (p.epoch & 1);
    TokenMeta* nxt = p.meta + ((p.epoch + 1) & 1);
    cur->next = idx;
    nxt->token = idx;
    nxt->pos = m.pos + 1;
    nxt->next = 0;
}

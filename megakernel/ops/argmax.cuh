// Argmax(blocks): the greedy token over the blocks, written for the host and the next step.

__device__ void op_argmax(const MkParams& p, const TokenMeta& m, float* red) {
    const int ct = threadIdx.x - 32;
    float v = NEG_INF;
    u32 idx = 0xffffffffu;
    for (int k = ct; k < p.n_lm; k += CONSUMERS)
        argmax_merge(v, idx, ld_value(p, p.lm_best + 2 * k), __float_as_uint(ld_value(p, p.lm_best + 2 * k + 1)));
    consumers_argmax(v, idx, red);
    if (ct != 0) return;
    p.history[m.pos + 1] = idx;
    // Only the next step's slot is written: other CTAs read this step's slot whole during the
    // launch.
    TokenMeta* nxt = p.meta + ((p.epoch + 1) & 1);
    nxt->token = idx;
    nxt->pos = m.pos + 1;
    nxt->next = 0;
}

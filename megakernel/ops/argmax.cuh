// Argmax(blocks): the greedy token over the blocks, written for the host and the next step.
// mk_finish_token (also Sample's, ops/sample.cuh) hands a step's token on.

// Bits of the next token for the tagged tok_next word, and stop decisions: by consumer thread
// 0 of the CTA that ends the step (Argmax or Sample), once the step's token t is known. `bad`:
// t is no token (NaN logits); the host sees it in history and refuses it, and the next step, if
// any, reads the embedding row of token 0. host_stop was read (early) by the caller.
__device__ void mk_finish_token(const MkParams& p, const TokenMeta& m, u32 t, bool bad, bool write_fed,
                                u32 host_stop) {
    const u32 tag = launch_tag(p), step = tag - 1 - p.epoch;
    const u32 next = bad ? 0u : t;
    bool stop = step + 1 >= p.steps || bad || host_stop != 0;
#pragma unroll
    for (int i = 0; i < MK_MAX_STOP_IDS; i++) stop |= i < p.n_stop && p.stop_ids[i] == t;
    // The next step's CTAs wait for this word: it goes first.
    if (step + 1 < p.steps) st_tagged(p.tok_next, __uint_as_float(next | (stop ? MK_TOKEN_STOP : 0u)), tag);
    // Relaxed stores: in a launch of several steps other CTAs store the same values (see
    // megakernel.cu) and the sampler reads them.
    if (write_fed) st_relaxed_u32(p.history + m.pos, m.token);
    st_relaxed_u32(p.history + m.pos + 1, t);
    if (stop) {
        // Only when the launch ends: other CTAs read the launch's slot at their start.
        TokenMeta* nxt = p.meta + ((p.epoch + step + 1) & 1);
        nxt->token = next;
        nxt->pos = m.pos + 1;
        nxt->next = 0;
        p.run_info[0] = step + 1;
    }
    if (p.host_tokens) st_sys_u32(p.host_tokens + step, t | MK_TOKEN_READY);
}

__device__ void op_argmax(const MkParams& p, const TokenMeta& m, float* red) {
    const int ct = threadIdx.x - 32;
    const u32 host_stop = ct == 0 ? ld_host_flag(p.host_stop) : 0u;
    float v = NEG_INF;
    u32 idx = 0xffffffffu;
    for (int k = ct; k < p.n_lm; k += CONSUMERS)
        argmax_merge(v, idx, ld_value(p, p.lm_best + 2 * k), __float_as_uint(ld_value(p, p.lm_best + 2 * k + 1)));
    consumers_argmax(v, idx, red);
    if (ct == 0) mk_finish_token(p, m, idx, idx >= (u32)p.vocab, false, host_stop);
}

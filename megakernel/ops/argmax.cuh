// Argmax(blocks): the greedy token over the blocks, written for the host and the next step.
// In a generation (p.steps > 1) it also hands the token to the next step, tagged, with
// GEN_STOP set when the generation ends after it: at a stop token, at the host's request or
// at the launch's last step.

__device__ __forceinline__ bool is_stop_token(const MkParams& p, u32 t) {
    for (u32 k = 0; k < p.n_stop; k++)
        if (p.stop_ids[k] == t) return true;
    return false;
}

__device__ void op_argmax(const MkParams& p, const TokenMeta& m, float* red) {
    const int ct = threadIdx.x - 32;
    // The host's request (mapped host memory, a PCIe round trip) is read before the blocks are
    // waited for, so its latency is hidden behind theirs.
    const u32 ctl = p.gen_ctl && ct == 0 ? *(const volatile u32*)p.gen_ctl : 0;
    float v = NEG_INF;
    u32 idx = 0xffffffffu;
    for (int k = ct; k < p.n_lm; k += CONSUMERS)
        argmax_merge(v, idx, ld_value(p, p.lm_best + 2 * k), __float_as_uint(ld_value(p, p.lm_best + 2 * k + 1)));
    consumers_argmax(v, idx, red);
    if (ct != 0) return;
    p.history[m.pos + 1] = idx;
    // Only the next step's slot is written: other CTAs read this step's slot whole during the
    // launch (a generation's CTAs read it when the launch starts, before any argmax).
    const u32 epoch = step_tag() - 1;
    TokenMeta* nxt = p.meta + ((epoch + 1) & 1);
    nxt->token = idx;
    nxt->pos = m.pos + 1;
    nxt->next = 0;
    if (p.steps > 1) {
        // No logit was a number (idx is ~0): the generation ends, and the host reports the
        // token as outside the vocabulary rather than the next step reading past the table.
        const u32 tok = idx < (u32)p.vocab ? idx : (u32)p.vocab;
        const u32 step = epoch - p.epoch;
        const bool stop = step + 1 >= p.steps || ctl != 0 || tok == (u32)p.vocab || is_stop_token(p, tok);
        st_tagged_bits(p.gen, tok | (stop ? GEN_STOP : 0u), step_tag());
        if (p.gen_out) *(volatile u32*)(p.gen_out + step) = tok;
    }
    if (p.gen_prof) p.gen_prof[2 * (epoch - p.epoch)] = global_ns();
}

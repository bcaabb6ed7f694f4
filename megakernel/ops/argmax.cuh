// Argmax(blocks): the greedy token over the blocks, or in a sampled launch the drawn one
// (ops/sample.cuh), written for the host and the next step.
// In a generation (p.steps > 1) it also hands the token to the next step, tagged, with
// GEN_STOP set when the generation ends after it: at a stop token, at the host's request or
// at the launch's last step.

__device__ __forceinline__ bool is_stop_token(const MkParams& p, u32 t) {
    for (u32 k = 0; k < p.n_stop; k++)
        if (p.stop_ids[k] == t) return true;
    return false;
}

// The token's way out, by consumer thread 0: history[pos + 1], the next step's meta slot and,
// in a generation, the tagged hand-over (ctl: the host's stop request, read earlier).
__device__ __forceinline__ void finish_token(const MkParams& p, const TokenMeta& m, u32 idx, u32 ctl) {
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
        // The next steps' penalty reads the history words written above (mk_sample_block).
        if (p.sampling && p.smp_penalty != 1.f && p.smp_last_n > 0) __threadfence();
        st_tagged_bits(p.gen, tok | (stop ? GEN_STOP : 0u), step_tag());
        if (p.gen_out) *(volatile u32*)(p.gen_out + step) = tok;
    }
    if (p.gen_prof) p.gen_prof[2 * (epoch - p.epoch)] = global_ns();
}

// The host's request (mapped host memory, a PCIe round trip), in consumer thread 0; read
// before the blocks are waited for, so its latency is hidden behind theirs.
__device__ __forceinline__ u32 host_stop_request(const MkParams& p) {
    return p.gen_ctl && threadIdx.x == 32 ? *(const volatile u32*)p.gen_ctl : 0;
}

__device__ void op_argmax(const MkParams& p, const TokenMeta& m, float* red) {
    // A sampled launch draws after the instruction loop of its drawing SM instead
    // (op_draw).
    if (MK_SAMPLING && p.sampling) return;
    const int ct = threadIdx.x - 32;
    const u32 ctl = host_stop_request(p);
    float v = NEG_INF;
    u32 idx = 0xffffffffu;
    for (int k = ct; k < p.n_lm; k += CONSUMERS)
        argmax_merge(v, idx, ld_value(p, p.lm_best + 2 * k), __float_as_uint(ld_value(p, p.lm_best + 2 * k + 1)));
    consumers_argmax(v, idx, red);
    // Inputs taken unwaited may hold no number: a token all the same, so the generation runs on.
    if ((MK_NO_DEPS || MK_NO_DEPS_OPS) && idx >= (u32)p.vocab) idx = 0;
    if (ct == 0) finish_token(p, m, idx, ctl);
}

// In a sampled launch, the draw, by every consumer of the SM of LM-head block MK_SMP_DRAWER
// (ops/sample.cuh), once its instruction loop is over, then the token's way out; the fed token
// goes into history[pos] for the repetition penalty's window, as the sampler kernels do.
// Called outside the instruction loop, and out of line: called inside it, the draw's
// registers cost the whole loop spills.
__device__ __noinline__ void op_draw(const MkParams& p, const TokenMeta& m, float* res) {
    const u32 ctl = host_stop_request(p);
    // By consumer thread 0, as soon as the token is drawn.
    const auto publish = [&](u32 idx) {
        smp_stamp(PROF_EXTRA2);
        p.history[m.pos] = m.token;
        finish_token(p, m, idx, ctl);
        atomicAdd(smp_gate(p) + MK_SMP_GATE_DRAWS, 1ull);
    };
#if MK_SMP_WARM
    // Measuring: the draw once with nothing kept, so that the real one runs on fetched code.
    mk_sample_merge(p, m, res, publish, false);
    consumers_sync();
    smp_stamp(PROF_EXTRA1);
#endif
    mk_sample_merge(p, m, res, publish, true);
}

// The megakernel's entry: one persistent CTA per SM interprets its instruction stream for
// p.steps decode steps (see runtime.cuh for the machinery, ops.cuh for the instruction table and
// ops/ for each instruction). Instructions need no waits of their own: every input they read is
// tagged and waited for where it is read.
//
// Several steps per launch: step s of the launch runs the same stream with the tag
// p.epoch + s + 1. The step's Argmax or Sample stores the next token in the tagged word
// tok_next (bit 31: the launch ends after this step: eos, a stop token, the host's flag); every
// CTA waits for it before its next step, so no CTA starts step s + 1 before step s's last
// instruction ran, and that one depends on every other instruction of step s, so all of step
// s's reads are done before anything of step s + 1 overwrites them (scheduler::exec's
// run_steps checks this on the schedule). Earlier positions' K/V rows are the one input that
// is not tagged: the loader stages them with bulk copies, and rows written by the previous
// step of this launch are staged only after every CTA has published (release) that it finished
// that step (step_done, see loader.cuh).

// Between steps, by consumer thread 0: publishes that this CTA finished the step of tag `tag`
// (after a release fence when it wrote K/V rows, with plain stores, this step: the fence waits
// for the SM's outstanding memory operations, the loader's copies included, so CTAs that wrote
// none skip it), then waits for the next token. Returns it, MK_TOKEN_STOP set when the launch
// ends here.
__device__ u32 step_boundary(const MkParams& p, u32 tag, bool wrote_kv) {
    if (wrote_kv) asm volatile("fence.acq_rel.gpu;" ::: "memory");
    st_tagged(p.step_done + blockIdx.x, 0.f, tag);
    return __float_as_uint(ld_value(p, p.tok_next));
}

extern "C" __global__ void __launch_bounds__(MK_THREADS, 1) megakernel(const __grid_constant__ MkParams p) {
    extern __shared__ __align__(128) unsigned char smem[];
    // After a failure every later launch stops at once, leaving the progress words as the
    // failing launch left them.
    if (aborted(p)) return;
    // The carve-up is the host's plan (MK_SMEM_*: byte offsets, see src/gpu/megakernel/layout.rs).
    const Smem sm{(bf16_t*)smem,
                  (float*)(smem + MK_SMEM_XS(p)),
                  (float*)(smem + MK_SMEM_RES(p)),
                  (float*)(smem + MK_SMEM_RED(p)),
                  (float*)(smem + MK_SMEM_SS(p)),
                  (u32*)(smem + MK_SMEM_IWS(p)),
                  (LayerW*)(smem + MK_SMEM_LW(p)),
                  (u64*)(smem + MK_SMEM_FULL(p)),
                  (u64*)(smem + MK_SMEM_EMPTY(p))};

    const u32* begin = p.instrs + (size_t)p.sm_offsets[blockIdx.x] * MK_WORDS;
    const u32* end = p.instrs + (size_t)p.sm_offsets[blockIdx.x + 1] * MK_WORDS;
    if (threadIdx.x == 0) {
        for (int i = 0; i < p.pages; i++) { mbar_init(&sm.full[i], 1); mbar_init(&sm.empty[i], 2); }
        mbar_fence_init();
        set_failed(0);
        mk_tag = p.epoch + 1;
        mk_stop = 0;
        mk_cseq = 0;
    }
    for (int i = threadIdx.x; i < p.n_layers * (int)(sizeof(LayerW) / 8); i += MK_THREADS)
        ((u64*)sm.lw)[i] = ((const u64*)p.layers)[i];
    if (threadIdx.x < MK_WORDS && begin < end) sm.iws[threadIdx.x] = begin[threadIdx.x];
    __syncthreads();

    if (threadIdx.x < 32) {
        loader(p, sm.lw, begin, end, sm.pages, sm.full, sm.empty);
        return;
    }
    const int ct = threadIdx.x - 32;
    TokenMeta m = p.meta[p.epoch & 1];
    u32 seq = 0, buf = 0;
    // A launch of several sampled steps: every CTA stores the fed token's history entry itself
    // (see below), the first one included.
    if (ct == 0 && p.steps > 1 && p.sample) st_relaxed_u32(p.history + m.pos, m.token);
    // Whether this CTA has K/V rows among its instructions (RmsQkvRope of a K or V head).
    bool wrote_kv = false;
    if (ct == 0 && p.steps > 1)
        for (const u32* wg = begin; wg < end; wg += MK_WORDS) wrote_kv |= wg[W_OP] == OP_QKV && wg[W_A] >= (u32)p.heads;
    for (u32 step = 0;; step++) {
        for (const u32* wg = begin; wg < end; wg += MK_WORDS, buf ^= 1) {
            // The instruction's words sit in shared memory, fetched during the one before (the
            // last one fetches the first, for the next step).
            const u32* w = sm.iws + buf * MK_WORDS;
            const u32 op = w[W_OP], instr = (u32)((wg - p.instrs) / MK_WORDS);
            const u32* nw = wg + MK_WORDS < end ? wg + MK_WORDS : begin;
            const u32 next = ct < MK_WORDS ? __ldg(nw + ct) : 0;
            u64* prof = p.profile ? p.profile + (size_t)instr * PROF_WORDS : nullptr;
            const TileGeom g = tile_geom(w, p);
            const OpEarly early = op_early(op, p, w, m.pos);
            if (ct == 0) {
                if (prof) prof[PROF_START] = global_ns();
                set_current_instr(instr);
                note(p, 0, instr);
                note(p, 1, ST_PREPARE);
            }
            seq += op_prepare(op, p, w, m, instr, seq, sm, prof);
            if (consumers_failed()) return;
            if (ct == 0 && prof) prof[op_stamps_inputs(op) ? PROF_TILES : PROF_PREPARED] = global_ns();
            if (g.tiles > 0) {
                const float scale = op_scale(op, p, sm.ss);
                if (ct == 0) note(p, 1, ST_TILES);
                if (!consume_tiles(p, g, instr, seq, sm.pages, sm.full, sm.empty, sm.xs, sm.res)) set_failed(1);
                seq += g.tiles;
                if (consumers_failed()) return;
                if (ct == 0 && prof) prof[PROF_TILES] = global_ns();
                if (ct == 0) note(p, 1, ST_POST);
                op_post(op, p, w, m, sm, scale, early);
            } else if (ct == 0 && prof && !op_stamps_inputs(op)) {
                prof[PROF_TILES] = prof[PROF_PREPARED];
            }
            if (ct < MK_WORDS) sm.iws[(buf ^ 1) * MK_WORDS + ct] = next;
            consumers_sync();
            if (ct == 0) {
                if (prof) prof[PROF_STORED] = global_ns();
                note(p, 1, ST_DONE);
            }
        }
        if (step + 1 >= p.steps) return;
        // The next step's token (and whether there is one), handed to every consumer thread
        // through shared memory by the barrier that also says whether the wait failed.
        __shared__ u32 mk_next_token;
        if (ct == 0) mk_next_token = step_boundary(p, launch_tag(p), wrote_kv);
        if (consumers_failed()) return;
        const u32 t = *(volatile u32*)&mk_next_token;
        if (t & MK_TOKEN_STOP) {
            // The loader may have run ahead into the next step: it stops once its copies landed.
            if (ct == 0) {
                *(volatile u32*)&mk_cseq = seq;
                __threadfence_block();  // mk_cseq before mk_stop, as the loader reads them
                *(volatile u32*)&mk_stop = 1;
            }
            return;
        }
        m.token = t;
        m.pos += 1;
        // Every CTA keeps the history the sampler's penalty reads current for itself (relaxed
        // stores of the value op_sample also stores), so no CTA's read of it waits on another's
        // plain store.
        consumers_sync();
        if (ct == 0) {
            st_relaxed_u32(p.history + m.pos, t);
            *(volatile u32*)&mk_tag = launch_tag(p) + 1;
        }
        consumers_sync();
    }
}

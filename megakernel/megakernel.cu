// The megakernel's entry: one persistent CTA per SM interprets its instruction stream for one
// decode step, or for several in a row (a generation); see runtime.cuh for the machinery,
// ops.cuh for the instruction table and ops/ for each instruction. Instructions need no waits
// of their own: every input they read is tagged and waited for where it is read.

// Between two steps of a generation (in every consumer): fetches the first instruction's words
// again; consumer thread 0 publishes the step's K/V rows, waits for the step's token and hands
// it, or the end of the generation, to the other consumers. False when the generation ends
// (or failed).
__device__ __forceinline__ bool next_step(const MkParams& p, const Smem& sm, u32 buf, TokenMeta& m) {
    const int ct = threadIdx.x - 32;
    if (ct < MK_WORDS) sm.iws[buf * MK_WORDS + ct] = p.instrs[(size_t)p.sm_offsets[blockIdx.x] * MK_WORDS + ct];
    if (ct == 0) {
        const u32 tag = step_tag();
        // An SM that writes K/V rows publishes the step for the loaders (rows_of_step_ready)
        // behind a release fence; the barrier that ended the step's last instruction orders
        // every consumer's stores before it. (Published right after the SM's last K/V
        // instruction instead, the fence there cost more than the earlier flag saved:
        // BENCHMARKS.md.)
        if (mk_kv_last != ~0u) {
            __threadfence();
            st_tagged_bits(p.gen + 1 + blockIdx.x, 0, tag);
        }
        // The token is tagged data: a relaxed read that sees the tag sees the token.
        u64 raw = 0, t0 = 0;
        for (int spins = 0;; spins++) {
            raw = ld_tagged(p.gen);
            if (gen_tag_ok(raw, tag, 0)) break;
            if (gen_wait_over(p, t0, spins, GEN_WHAT_TOKEN, tag, raw)) {
                set_failed(1);
                break;
            }
        }
        if (p.gen_prof) atomicMin(p.gen_prof + 2 * (tag - p.epoch) + 1, global_ns());
        mk_tag = tag + 1;
        if ((u32)raw & GEN_STOP) set_stopping();
        sm.red[0] = __uint_as_float((u32)raw & ~GEN_STOP);
    }
    if (consumers_failed() || stopping()) return false;
    m.token = __float_as_uint(sm.red[0]);
    m.pos += 1;
    return true;
}

// What a step's instruction loop leaves: the ring's page sequence, the instruction-word buffer
// and failure.
struct StepEnd {
    u32 seq, buf;
    bool failed;
};

// The consumers' progress stages within an instruction (tiles, post), named in a stall's
// report with MK_STAGE_NOTES=1. Left out by default: the two stores an instruction cost
// SmolLM2 1.7% a token (BENCHMARKS.md 2026-11-27); the instruction's start and end stay, and
// tell a finished SM from a stuck one, which is "under way" from its prepare to its end.
#ifndef MK_STAGE_NOTES
#define MK_STAGE_NOTES 0
#endif

// One step of this SM's stream: every instruction in order (the interpreter's loop).
__device__ __forceinline__ StepEnd run_instructions(const MkParams& p, const Smem sm, const u32* end, const TokenMeta m,
                                                    u32 seq, u32 buf) {
    const int ct = threadIdx.x - 32;
    // The (op, layer) whose normed input xs and ss hold, or ~0u: an SM's consecutive QKV (or
    // up-gate) instructions of one layer share their input, so only the first waits for it and
    // normalises it. On hidden sizes over one round of prepare_normed that input is the
    // previous layer's residual and every down-projection chunk, read from L2 (5 x 4096 words
    // on Llama-3.1-8B) by each of the two to three QKV instructions an SM runs a layer:
    // sharing it took Llama-3.1-8B from 5.69 to 5.30 ms. Models read in one round compile it
    // out: there it cost 0.3-1.6% (Llama-3.2-1B, SmolLM2) and 0.4% on Qwen3-4B (Llama-3.2-3B:
    // 0.15% faster with it). MK_SHARE_NORMED=0|1 forces the choice, for measuring.
#ifdef MK_SHARE_NORMED
    constexpr bool share_normed = MK_SHARE_NORMED;
#else
    constexpr bool share_normed = MK_HIDDEN > PREP_MAX * CONSUMERS;
#endif
    u32 normed = ~0u;
    for (const u32* wg = p.instrs + (size_t)p.sm_offsets[blockIdx.x] * MK_WORDS; wg < end; wg += MK_WORDS, buf ^= 1) {
        // The instruction's words sit in shared memory, fetched during the one before (the
        // next step's first one between the steps).
        const u32* w = sm.iws + buf * MK_WORDS;
        const u32 op = w[W_OP], instr = (u32)((wg - p.instrs) / MK_WORDS);
        const u32 next = ct < MK_WORDS && wg + MK_WORDS < end ? __ldg(wg + MK_WORDS + ct) : 0;
        u64* prof = p.profile ? p.profile + (size_t)instr * PROF_WORDS : nullptr;
        const TileGeom g = tile_geom(w, p, sm.lw);
        const OpEarly early = op_early(op, p, w, m.pos);
        if (ct == 0) PREP_SET_PROF(prof);
        prep_stamp(PROF_EXTRA1);
#if MK_TRACK_OP
        set_current_op(op);
#endif
        if (ct == 0) {
            if (prof) prof[PROF_START] = global_ns();
            set_current_instr(instr);
            note(p, 0, instr);
            note(p, 1, ST_PREPARE);
        }
        const bool shares_input = op == OP_QKV || op == OP_UPGATE;
        const u32 key = op << 16 | w[W_LAYER];
        const bool fresh = !(share_normed && shares_input && key == normed);
        if (fresh) seq += op_prepare(op, p, w, m, instr, seq, sm, prof);
        if (share_normed) normed = shares_input ? key : ~0u;
        if (consumers_failed()) return {seq, buf, true};
        if (ct == 0 && prof) prof[op_stamps_inputs(op) ? PROF_TILES : PROF_PREPARED] = global_ns();
        if (g.tiles > 0) {
            const float scale = op_scale(op, p, sm.ss);
            if (MK_STAGE_NOTES && ct == 0) note(p, 1, ST_TILES);
            if (!consume_tiles(p, g, instr, seq, sm.pages, sm.full, sm.empty, sm.xs, fresh, sm.res)) set_failed(1);
            seq += g.tiles;
            if (consumers_failed()) return {seq, buf, true};
            if (ct == 0 && prof) prof[PROF_TILES] = global_ns();
            if (MK_STAGE_NOTES && ct == 0) note(p, 1, ST_POST);
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
    return {seq, buf, false};
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
    // Read before the first barrier: in a generation, the second step's argmax writes the slot
    // this step reads, and no SM's argmax can run before every SM is past this barrier.
    const TokenMeta m0 = p.meta[p.epoch & 1];
#ifdef MK_PAGES
    // Compiled for a ring of MK_PAGES pages (the host checks its plan against it): another
    // count would put tiles in the wrong pages.
    if (p.pages != MK_PAGES) __trap();
#endif
    if (threadIdx.x == 0) {
        for (int i = 0; i < p.pages; i++) { mbar_init(&sm.full[i], 1); mbar_init(&sm.empty[i], MK_EMPTY_ARRIVALS); }
        mbar_fence_init();
        set_failed(0);
#if MK_TRACK_OP
        for (int i = 0; i < MK_THREADS / 32; i++) mk_op[i] = ~0u;
#endif
        mk_tag = p.epoch + 1;
        mk_stop = 0;
        mk_kv_last = p.kv_last[blockIdx.x];
        mk_merges = 0;
    }
    for (int i = threadIdx.x; i < p.n_layers * (int)(sizeof(LayerW) / 8); i += MK_THREADS)
        ((u64*)sm.lw)[i] = ((const u64*)p.layers)[i];
#if MK_FREQ_SMEM
    for (int i = threadIdx.x; i < MK_HEAD_DIM / 2; i += MK_THREADS) mk_inv_freq[i] = p.inv_freq[i];
#endif
    if (threadIdx.x < MK_WORDS && begin < end) sm.iws[threadIdx.x] = begin[threadIdx.x];
    __syncthreads();
    // An SM without instructions takes no part in any step (a generation's SMs wait only for
    // those with instructions).
    if (begin == end) return;

    if (threadIdx.x < 32) {
        loader(p, sm.lw, begin, end, m0.pos, sm.pages, sm.full, sm.empty);
        return;
    }
    const int ct = threadIdx.x - 32;
    TokenMeta m = m0;
    u32 seq = 0, buf = 0;
    // A launch runs p.steps decode steps (a generation; 1 for one step per launch): the same
    // stream each step, with the tags advancing. Step s feeds the token step s - 1 chose
    // (handed over tagged, see op_argmax) at the next position. Only what the instruction loop
    // uses stays in registers across it (the step is the tag's distance from the epoch, and the
    // stream's start is read again): the loop has every register the SM allows.
    if (ct == 0 && p.gen_prof) atomicMin(p.gen_prof + 1, global_ns());
    for (;;) {
        // Read where every consumer sees the same tag (thread 0 changes it in next_step).
        const bool last = step_tag() - p.epoch >= p.steps;
        const StepEnd e = run_instructions(p, sm, end, m, seq, buf);
        if (e.failed) return;
        seq = e.seq;
        buf = e.buf;
        if (MK_SAMPLING && p.sampling && *(volatile u32*)&mk_merges) {
            op_draw(p, m, sm.res);
            if (consumers_failed()) return;
        }
        if (last || !next_step(p, sm, buf, m)) return;
    }
}

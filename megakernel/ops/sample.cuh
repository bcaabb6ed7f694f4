// Sampling as the megakernel's last stage (kernels/sampling/select.cuh holds the rule; the
// host's twin is src/sampling/mod.rs). In a sampled step (p.sample) each RmsLmHead
// instruction, once its logits are stored, summarises its rows and lists its top candidates
// (mk_sample_block); the Sample instruction, which ends the sampled streams where greedy ones
// end with Argmax, draws from all blocks' results (op_sample) and hands the token on as
// op_argmax does (mk_finish_token). Everything the blocks hand over is tagged, so op_sample
// waits element by element as op_argmax does for lm_best.
//
// Needs philox.cuh and select.cuh (kernels/sampling/) in the compilation unit before this file.
// Tagged arena (both cleared with the rest of the arena):
//   smp_block: [n_lm][SMP_MK_BLOCK_WORDS]  max, sumexp hi/lo, best score hi/lo, best index bits
//   smp_cand:  [n_lm][SMP_KMAX][2]         candidate logit, token index bits (the first
//                                          smp_cands_per_block slots of each block)

#define SMP_MK_BLOCK_WORDS 6

// The sampler's scratch lives in xs: both parts run when the instruction's input vector is no
// longer needed (after the LM head's tiles; Sample has no tiles), and static shared memory
// would cost the page ring a page.
static_assert(sizeof(SmpShared) <= MK_SAMPLER_SCRATCH_FLOATS * sizeof(float),
              "the sampler's scratch must fit in xs (SAMPLER_SCRATCH_FLOATS, src/gpu/megakernel/layout.rs)");
__device__ __forceinline__ SmpShared& mk_smp(const Smem& sm) { return *(SmpShared*)sm.xs; }

__device__ __forceinline__ float smp_hi(double d) { return __int_as_float(__double2hiint(d)); }
__device__ __forceinline__ float smp_lo(double d) { return __int_as_float(__double2loint(d)); }
__device__ __forceinline__ double smp_join(float hi, float lo) {
    return __hiloint2double(__float_as_int(hi), __float_as_int(lo));
}

// In RmsLmHead's post step, after post_lmhead, by every consumer thread: the block of rows
// w[W_A] .. + w[W_B] (at most SMP_MAX_ROWS) whose logits this CTA just stored in p.logits.
__device__ void mk_sample_block(const MkParams& p, const u32* w, const TokenMeta& m, const Smem& sm) {
    const int ct = threadIdx.x - 32;
    const u32 rs = w[W_A], rc = w[W_B], blk = w[W_C];
    const u32 tag = launch_tag(p);
    // The logits other consumer threads stored are read back below, and xs becomes scratch.
    consumers_sync();
    u64* bout = p.smp_block + (size_t)blk * SMP_MK_BLOCK_WORDS;
    u64* cout = p.smp_cand + (size_t)blk * SMP_KMAX * 2;
    smp_block_part(
        [&](int j) { return p.logits[rs + j]; }, rs, (int)rc, p.smp, m.pos, m.token, p.history,
        [&](const SmpBlock& b) {
            st_tagged(bout + 0, b.max, tag);
            st_tagged(bout + 1, smp_hi(b.sumexp), tag);
            st_tagged(bout + 2, smp_lo(b.sumexp), tag);
            st_tagged(bout + 3, smp_hi(b.best), tag);
            st_tagged(bout + 4, smp_lo(b.best), tag);
            st_tagged(bout + 5, __uint_as_float(b.best_idx), tag);
        },
        [&](smp_u32 slot, float v, smp_u32 i) {
            st_tagged(cout + 2 * slot, v, tag);
            st_tagged(cout + 2 * slot + 1, __uint_as_float(i), tag);
        },
        mk_smp(sm), ct, CONSUMERS, [] { consumers_sync(); });
}

// Waits until the n words at a(i) (i < n) carry this step's tag, each consumer thread
// SETTLE_BATCH of them at a time (all in flight together), without keeping them: once every
// word is current, the merge reads them as plain values (mk_current), many times over.
#define SETTLE_BATCH 16
template <typename Addr>
__device__ __noinline__ void settle_all(const MkParams& p, Addr a, int n) {
    const int ct = threadIdx.x - 32;
    for (int i0 = 0; i0 < n; i0 += SETTLE_BATCH * CONSUMERS) {
        u64 raw[SETTLE_BATCH];
        const int first = i0 + ct;
        const int mine = n > first ? min(SETTLE_BATCH, (n - first + CONSUMERS - 1) / CONSUMERS) : 0;
#pragma unroll
        for (int k = 0; k < SETTLE_BATCH; k++) raw[k] = k < mine ? ld_tagged(a(first + k * CONSUMERS)) : 0;
        settle<SETTLE_BATCH>(p, raw, [&](int k) { return a(first + k * CONSUMERS); }, mine);
    }
}

// A tagged word known to carry this step's tag (settle_all passed): read again as the writer
// stored it (relaxed, past L1, which may still hold the word from an earlier step of this
// launch), without a wait.
__device__ __forceinline__ float mk_current(const u64* a) { return tagged_float(ld_tagged(a)); }

// In place of op_argmax when sampling, by every consumer thread: the drawn token into
// history[pos + 1] and on to the next step (the fed token into history[pos], for the penalty).
__device__ void op_sample(const MkParams& p, const TokenMeta& m, const Smem& sm) {
    const int ct = threadIdx.x - 32;
    const u32 host_stop = ct == 0 ? ld_host_flag(p.host_stop) : 0u;
    const SmpParams& smp = p.smp;
    const bool draw_all = smp.temperature == 0.f || !smp_truncates(smp);
    // Everything the merge reads, current first (one batch of waits instead of one per read).
    settle_all(p, [&](int i) { return p.smp_block + i; }, p.n_lm * SMP_MK_BLOCK_WORDS);
    const int kc = (int)smp_cands_per_block(smp);
    if (!draw_all)
        settle_all(p, [&](int i) { return p.smp_cand + (size_t)(i / (2 * kc)) * SMP_KMAX * 2 + i % (2 * kc); },
                   p.n_lm * 2 * kc);
    if (consumers_failed()) return;
    auto get_block = [&](int b) {
        const u64* a = p.smp_block + (size_t)b * SMP_MK_BLOCK_WORDS;
        SmpBlock r;
        r.max = mk_current(a);
        r.sumexp = smp_join(mk_current(a + 1), mk_current(a + 2));
        r.best = smp_join(mk_current(a + 3), mk_current(a + 4));
        r.best_idx = __float_as_uint(mk_current(a + 5));
        r.pad[0] = r.pad[1] = 0;
        return r;
    };
    auto cand_val = [&](int i) { return mk_current(p.smp_cand + 2 * (size_t)i); };
    auto cand_idx = [&](int i) { return __float_as_uint(mk_current(p.smp_cand + 2 * (size_t)i + 1)); };
    const smp_u32 t = smp_final_part(get_block, p.n_lm, cand_val, cand_idx, smp, m.pos, mk_smp(sm), ct, CONSUMERS,
                                     [] { consumers_sync(); });
    if (ct == 0) mk_finish_token(p, m, t, t >= (u32)p.vocab, true, host_stop);
}

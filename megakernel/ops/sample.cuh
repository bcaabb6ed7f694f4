// Sampling as the megakernel's last stage (kernels/sampling/select.cuh holds the rule; the
// host's twin is src/sampling/mod.rs). Each RmsLmHead instruction, once its logits are
// stored, summarises its rows and lists its top SMP_KMAX (mk_sample_block); the Argmax
// instruction, when sampling, draws from all blocks' results instead of taking the greedy
// maximum (op_sample), and writes the token where the next step reads it, as op_argmax does.
// Everything the blocks hand over is tagged, so op_sample waits element by element as
// op_argmax does for lm_best.
//
// Needs philox.cuh and select.cuh (kernels/sampling/) in the compilation unit before this file.
// Tagged arena the caller provides (both cleared with the rest of the arena):
//   blocks: [n_lm][SMP_MK_BLOCK_WORDS]  max, sumexp hi/lo, best score hi/lo, best index bits
//   cands:  [n_lm][SMP_KMAX][2]         candidate logit, token index bits

#define SMP_MK_BLOCK_WORDS 6

// Consumer-thread scratch of both parts (static: the host's page count already leaves room
// for static shared memory).
__shared__ SmpShared mk_smp;

__device__ __forceinline__ float smp_hi(double d) { return __int_as_float(__double2hiint(d)); }
__device__ __forceinline__ float smp_lo(double d) { return __int_as_float(__double2loint(d)); }
__device__ __forceinline__ double smp_join(float hi, float lo) {
    return __hiloint2double(__float_as_int(hi), __float_as_int(lo));
}

// In RmsLmHead's post step, after post_lmhead, by every consumer thread: the block of rows
// w[W_A] .. + w[W_B] (at most SMP_MAX_ROWS) whose logits this CTA just stored in p.logits.
__device__ void mk_sample_block(const MkParams& p, const u32* w, const TokenMeta& m, const SmpParams& smp,
                                u64* blocks, u64* cands) {
    const int ct = threadIdx.x - 32;
    const u32 rs = w[W_A], rc = w[W_B], blk = w[W_C];
    const u32 tag = launch_tag(p);
    // The logits other consumer threads stored are read back below.
    consumers_sync();
    u64* bout = blocks + (size_t)blk * SMP_MK_BLOCK_WORDS;
    u64* cout = cands + (size_t)blk * SMP_KMAX * 2;
    smp_block_part(
        [&](int j) { return p.logits[rs + j]; }, rs, (int)rc, smp, m.pos, m.token, p.history,
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
        mk_smp, ct, CONSUMERS, [] { consumers_sync(); });
}

// In place of op_argmax when sampling, by every consumer thread: the drawn token into
// history[pos + 1] and the meta slots (the fed token into history[pos], for the penalty).
__device__ void op_sample(const MkParams& p, const TokenMeta& m, const SmpParams& smp, const u64* blocks,
                          const u64* cands) {
    const int ct = threadIdx.x - 32;
    auto get_block = [&](int b) {
        const u64* a = blocks + (size_t)b * SMP_MK_BLOCK_WORDS;
        SmpBlock r;
        r.max = ld_value(p, a);
        r.sumexp = smp_join(ld_value(p, a + 1), ld_value(p, a + 2));
        r.best = smp_join(ld_value(p, a + 3), ld_value(p, a + 4));
        r.best_idx = __float_as_uint(ld_value(p, a + 5));
        r.pad[0] = r.pad[1] = 0;
        return r;
    };
    auto cand_val = [&](int i) { return ld_value(p, cands + 2 * (size_t)i); };
    auto cand_idx = [&](int i) { return __float_as_uint(ld_value(p, cands + 2 * (size_t)i + 1)); };
    const smp_u32 t = smp_final_part(get_block, p.n_lm, cand_val, cand_idx, smp, m.pos, mk_smp, ct, CONSUMERS,
                                     [] { consumers_sync(); });
    if (ct != 0) return;
    // Nothing to draw from (NaN logits): the host sees the bad token in history; the next
    // step must still read a real embedding row.
    const u32 next = t == SMP_NONE ? 0u : t;
    p.history[m.pos] = m.token;
    p.history[m.pos + 1] = t;
    TokenMeta* cur = p.meta + (p.epoch & 1);
    TokenMeta* nxt = p.meta + ((p.epoch + 1) & 1);
    cur->next = next;
    nxt->token = next;
    nxt->pos = m.pos + 1;
    nxt->next = 0;
}

// Sampling as the megakernel's last stage, so a sampled token chains on the device like a
// greedy one, inside a generation too. The rule is kernels/sampling/select.cuh's (the host's
// twin: src/sampling/mod.rs, sample_at; docs/sampling.md), drawn the way the fused sampler
// (kernels/sampling/fused.cu) draws it, with the LM head's blocks as its CTAs:
//
// - each RmsLmHead instruction, once its logits are stored (mk_sample_block), takes its rows'
//   penalised maximum and, for top-p, their softmax sum; it hands its maximum to the other blocks
//   (its summary's first word, tagged) and waits for theirs; then it writes its keys within the
//   hint (the distance below the maximum the previous draw left) to its key slots and its
//   summary, every word tagged with the step, then releases its logits (a last tagged word, for
//   a search). Pure temperature needs no keys: the block's best Gumbel-perturbed row is its
//   summary.
// - the SM of block 0 draws, after its instruction loop (op_draw, ops/argmax.cuh;
//   mk_sample_merge): it polls every summary and the first slots of every block until they
//   carry the step's tag (one round trip after the last block's stores), compacts the union
//   within each warp, runs the binned merge (smp_merge_binned_counted) and the check that those
//   keys decided the cuts (smp_attempt_complete), after which the token goes out at once.
//   Where they did not (the first draw, which has no hint; logits whose spread grew past the
//   hint; a block with more keys than its slots), that SM acquires every block's release and
//   searches the whole vocabulary itself, reading the logits from L2. Either way it leaves the
//   next hint, and hands the token over as the greedy argmax does. The other SMs go on to the
//   next step at once; its first instructions wait for the token.
//
// lm_sample (scheduler/src/arena.rs) holds the gate's words, a summary and MK_SMP_CAP key
// slots per block, and the penalised logits (written only with a penalty, for the search).
// Keys are select.cuh's 64-bit keys (the logit's key above, the inverted token below), carried
// in the slots with a short tag (smp_slot_word).
// Compiled only into the kernel variant sampled launches run (MK_SAMPLING): its calls cost
// the greedy kernel's loop spilled registers.

#ifndef MK_SAMPLING
#define MK_SAMPLING 0  // 1 in the variant sampled launches run (src/gpu/megakernel/compile.rs)
#endif
// 1 (for tests, through MEGAINFER_MK_DEFINES): no attempt, every draw searches.
#ifndef MK_SMP_NO_ATTEMPT
#define MK_SMP_NO_ATTEMPT 0
#endif
// Key slots per thread the draw loads with the summaries: every block's first
// MK_SMP_FIRST_PER * CONSUMERS / n_lm slots (15 for 132 blocks).
#ifndef MK_SMP_FIRST_PER
#define MK_SMP_FIRST_PER 8
#endif
// Keys a lane in the binned merge after compacting the union within its warp (where a warp
// has more, the merge takes every thread's slots as loaded).
#ifndef MK_SMP_MERGE_PER
#define MK_SMP_MERGE_PER 2
#endif
// 1: top-p draws test first whether the top token alone decides them (smp_top_dominates); 0
// (for measuring its cost): no test, no top token found.
#ifndef MK_SMP_TOP
#define MK_SMP_TOP 1
#endif
static_assert(MK_SMP_MAX_BLOCKS <= CONSUMERS, "the draw reads a block's summary per consumer thread");

// The gate's words (zero at first; MK_SMP_GATE_*, from the host's SMP_GATE in abi.rs): the
// hint (a float's bits, tagged), and statistics: draws that searched, draws, and the searches'
// reasons: no attempt (a block had no hint), keys past the slots (more than a block's slots, or
// than the two loads take), keys that did not decide the cuts.
// A block's summary words, each tagged with its step (the draw polls them; no arrival orders
// them): the attempt's words first, so that the draw polls one run of them.
#define MK_SMP_S_MAX 0      // its largest penalised logit (a float's bits)
#define MK_SMP_S_Z_HI 1     // the softmax sum behind top-p, relative to it: a double's high bits
#define MK_SMP_S_Z_LO 2     // and its low bits
#define MK_SMP_S_COUNT 3    // its keys in the slots (or MK_SMP_COUNT_OVER) and top token (smp_count_word)
#define MK_SMP_S_HINT 4     // the hint it cut at (0: it made no attempt)
#define MK_SMP_S_BEST_HI 5  // pure temperature: its best perturbed score, a double's high bits
#define MK_SMP_S_BEST_LO 6  // and its low bits
#define MK_SMP_S_BEST_IDX 7 // and its token
#define MK_SMP_S_ARRIVED 8  // stored last, with release semantics: its logits are visible
#define MK_SMP_ATTEMPT_WORDS 5
#define MK_SMP_OVER 0xffffffffu
// The count word: the block's keys in the low 14 bits (MK_SMP_COUNT_OVER where it had more than
// its slots), its top token (its lowest row at its maximum; top-p without top-k only) in the
// 18 above (the draw inside the launch is for vocabularies up to 2^18), so the draw polls no
// word more for it.
#define MK_SMP_COUNT_OVER 0x3fffu
static_assert(MK_SMP_CAP < MK_SMP_COUNT_OVER, "a block's key count fits the count word's 14 bits");
__device__ __forceinline__ u32 smp_count_word(u32 count, u32 top) {
    return (count == MK_SMP_OVER ? MK_SMP_COUNT_OVER : count) | (top << 14);
}
__device__ __forceinline__ u32 smp_word_count(u32 w) { return (w & MK_SMP_COUNT_OVER) == MK_SMP_COUNT_OVER ? MK_SMP_OVER : w & MK_SMP_COUNT_OVER; }
__device__ __forceinline__ u32 smp_word_top(u32 w) { return w >> 14; }
static_assert(MK_SMP_S_ARRIVED < MK_SMP_BLK_WORDS, "the summary's words fit its room in lm_sample");

// A key slot is a key with the step's tag in the 14 bits of the inverted token that every
// token below 2^18 leaves set (the host draws inside the launch only for such vocabularies):
// the draw polls each slot for its step rather than waiting for an arrival. Tags repeat every
// MK_SMP_SLOT_PERIOD steps (the host's abi.rs) and are never 0, so a cleared slot never
// passes; every block writes all its slots every step (the empty ones as 0 keys), and the host
// clears the slots before a sampled launch whose first step is that far from the last sampled
// launch's (src/gpu/megakernel/launch.rs).
#define MK_SMP_SLOT_TAG_MASK 0xfffc0000u
__device__ __forceinline__ u32 smp_slot_tag(u32 tag) { return tag % (u32)MK_SMP_SLOT_PERIOD + 1u; }
__device__ __forceinline__ u64 smp_slot_word(smp_u64 key, u32 t14) {
    return key == 0 ? (u64)t14 << 18 : ((u64)key & ~(u64)MK_SMP_SLOT_TAG_MASK) | (u64)t14 << 18;
}
__device__ __forceinline__ bool smp_slot_fresh(u64 w, u32 t14) { return ((u32)w >> 18) == t14; }
__device__ __forceinline__ smp_u64 smp_slot_key(u64 w) { return (w >> 32) == 0 ? 0ull : (smp_u64)(w | MK_SMP_SLOT_TAG_MASK); }
__device__ __forceinline__ void st_release_tagged(u64* a, u32 v, u32 tag) {
    asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(a), "l"(((u64)tag << 32) | v) : "memory");
}
__device__ __forceinline__ u64 smp_join(u64 hi, u64 lo) { return (u64)(u32)hi << 32 | (u32)lo; }

// The SM that draws: the one with LM-head block 0 (blocks finish together; any would do).
#define MK_SMP_DRAWER 0

__device__ __forceinline__ SmpParams mk_smp_params(const MkParams& p) {
    return {p.smp_temperature, p.smp_top_p, p.smp_min_p, p.smp_penalty,
            p.smp_top_k,       p.smp_last_n, p.smp_seed_lo, p.smp_seed_hi};
}
__device__ __forceinline__ u64* smp_gate(const MkParams& p) { return p.lm_sample; }
__device__ __forceinline__ u64* smp_summary(const MkParams& p, int b) {
    return p.lm_sample + MK_SMP_GATE_WORDS + (size_t)b * MK_SMP_BLOCK_WORDS;
}
__device__ __forceinline__ u64* smp_slots(const MkParams& p, int b) { return smp_summary(p, b) + MK_SMP_BLK_WORDS; }
__device__ __forceinline__ float* smp_penalised(const MkParams& p) {
    return (float*)(p.lm_sample + MK_SMP_GATE_WORDS + (size_t)p.n_lm * MK_SMP_BLOCK_WORDS);
}
// The slots of each block the draw loads with the summaries.
__device__ __forceinline__ int smp_first_slots(int nb) { return min(MK_SMP_CAP, MK_SMP_FIRST_PER * CONSUMERS / nb); }

#define MK_SMP_ROWS_PER (RES_MAX / CONSUMERS)  // rows a consumer holds in RmsLmHead

// Whether this SM draws (set by consumer thread 0 in its RmsLmHead of a sampled launch: the SM
// of block MK_SMP_DRAWER; an SM has at most one block, the host's condition).
__shared__ u32 mk_merges;
// The drawing SM's block's view of the vocabulary's maximum, where it attempted (else -inf):
// the maximum of the same summary words the draw polls, so the draw scales the blocks' softmax
// sums to it before its first barrier (for smp_top_dominates) instead of after.
__shared__ float mk_smp_gm;

struct MkSmpBlockShared {
    SmpShared base;
    SmpSel sel;
    smp_u32 fcount;
    smp_u32 top;  // the block's top token (an atomic minimum over the warps)
};
static_assert(sizeof(MkSmpBlockShared) <= RES_MAX * sizeof(float), "the block's scratch is res's second half");

// RmsLmHead's store in a sampled launch, by every consumer: rows w[W_A] .. + w[W_B] of the
// logits (their dot products in res, times scale) to p.logits, then the block's part of the
// draw (see the top of this file). Out of line, with its rows in shared memory rather than
// registers: every register a function called from the interpreter loop takes costs the
// loop spilled registers. (Called after the loop instead, from the rows RmsLmHead left in res,
// it cost SmolLM2 2 us a token and Llama-1B 5: BENCHMARKS.md.)
__device__ __noinline__ void mk_sample_block(const MkParams& p, const u32* w, const TokenMeta& m, float* res,
                                             float scale) {
    const int ct = threadIdx.x - 32;
    const int rs = (int)w[W_A], rc = (int)w[W_B], blk = (int)w[W_C], nb = p.n_lm;
    const u32 tag = step_tag();
    const SmpParams s = mk_smp_params(p);
    const float ninf = __int_as_float(0xff800000u);
    const auto sync = [] { consumers_sync(); };
    // The hint the previous draw left (read now, so its latency hides behind the rows').
    // A block that reads an older one is still exact: the draw cuts at the smallest
    // hint any block cut at.
    const float h = MK_SMP_NO_ATTEMPT ? 0.f : __uint_as_float((u32)ld_tagged(smp_gate(p) + MK_SMP_GATE_HINT));
    // res: the rows' (penalised) logits first, then the scratch.
    float* xv = res;
    MkSmpBlockShared& sh = *(MkSmpBlockShared*)(res + RES_MAX);
    {
        float x[MK_SMP_ROWS_PER];
#pragma unroll
        for (int r = 0; r < MK_SMP_ROWS_PER; r++) {
            const int j = ct + r * CONSUMERS;
            x[r] = j < rc ? scale * res_at(res, j) : ninf;
        }
        consumers_sync();
#pragma unroll
        for (int r = 0; r < MK_SMP_ROWS_PER; r++) {
            const int j = ct + r * CONSUMERS;
            if (j < rc) {
                p.logits[rs + j] = x[r];
                xv[j] = smp_clean(x[r]);
            }
        }
    }
    const bool pen = smp_penalises(s);
    if (pen) {
        for (int i = ct; i < (rc + 31) / 32; i += CONSUMERS) sh.base.bitmap[i] = 0;
        consumers_sync();
        // The window's tokens; history[pos] is not written yet (the draw writes it), the fed
        // token is m.token. In a generation the draws of earlier steps wrote the others, each
        // behind a fence before its token went out (finish_token); this fence orders the reads
        // after that token, and they go past L1, which may hold the words from an earlier step.
        if (p.steps > 1) __threadfence();
        const u32 first = m.pos + 1 > s.last_n ? m.pos + 1 - s.last_n : 0;
        for (u32 q = first + ct; q <= m.pos; q += CONSUMERS) {
            const u32 j = (q == m.pos ? m.token : __ldcg(p.history + q)) - (u32)rs;
            if (j < (u32)rc) atomicOr(&sh.base.bitmap[j >> 5], 1u << (j & 31));
        }
        consumers_sync();
        float* pv = smp_penalised(p) + rs;
        for (int j = ct; j < rc; j += CONSUMERS) {
            if ((sh.base.bitmap[j >> 5] >> (j & 31)) & 1u) xv[j] = smp_penalise(xv[j], s.penalty);
            pv[j] = xv[j];
        }
    }
    if (ct == 0) { sh.sel.fill = 0; sh.fcount = 0; sh.top = SMP_NONE; }
    consumers_sync();
    const bool draw_all = s.temperature == 0.f || !smp_truncates(s);
    float mx = ninf;
    for (int j = ct; j < rc; j += CONSUMERS) mx = fmaxf(mx, xv[j]);
    mx = smp_block_max(mx, sh.base, ct, CONSUMERS, sync);
    double best = -__longlong_as_double(0x7ff0000000000000ll), z = 0.0;
    smp_u32 best_idx = SMP_NONE, count = 0;
    float gm_seen = ninf;
    const bool attempt = !draw_all && h > 0.f;
    const u32 t14 = smp_slot_tag(tag);
    u64* const out = smp_slots(p, blk);
    if (draw_all) {
        for (int j = ct; j < rc; j += CONSUMERS) {
            const float x = xv[j];
            if (x != ninf) {
                const double sc = s.temperature == 0.f
                                      ? (double)x
                                      : (double)x / (double)s.temperature + smp_gumbel(s.seed_lo, s.seed_hi, m.pos, rs + j);
                smp_best_merge(best, best_idx, sc, rs + j);
            }
        }
        smp_block_best(best, best_idx, sh.base, ct, CONSUMERS, sync);
        smp_stamp(PROF_EXTRA1);
    } else {
        // Every block's maximum, handed over tagged (in its summary's first word): the blocks
        // cut at the same logit below the vocabulary's maximum, so that their keys together
        // are exactly those above it. Handed over by every block, whether or not it attempts:
        // one that read an older hint (0 before the first draw) may not, and the others wait
        // for it. (A cut below a block's own maximum needs no exchange, but on random logits a
        // block's maximum lies well below the vocabulary's, and the block then holds more keys
        // within the hint than the draw loads: BENCHMARKS.md, 2026-11-29.)
        if (ct == 0) st_tagged(smp_summary(p, blk) + MK_SMP_S_MAX, mx, tag);
        // The other blocks' maxima asked for first, then the softmax sum while they come; the
        // sum and the maxima's maximum reduced across the warps behind one barrier (the sum
        // in smp_block_sum's order).
        const bool need_z = s.top_p < 1.f && s.top_k == 0;
        const int mine = attempt && ct < nb ? 1 : 0;
        u64 raw = mine ? ld_tagged(smp_summary(p, ct) + MK_SMP_S_MAX) : 0ull;
        if (need_z) {
            // With the sum, the block's top token (its lowest row at the maximum), for the
            // draw's smp_top_dominates.
            smp_u32 t = SMP_NONE;
            for (int j = ct; j < rc; j += CONSUMERS) {
                const float x = xv[j];
                z += exp((double)x - (double)mx);
                if (MK_SMP_TOP && x == mx) t = min(t, (smp_u32)(rs + j));
            }
            if (MK_SMP_TOP) {
                t = __reduce_min_sync(0xffffffffu, t);
                if ((ct & 31) == 0 && t != SMP_NONE) atomicMin(&sh.top, t);
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) z += __shfl_xor_sync(0xffffffffu, z, o);
        }
        if (attempt) settle<1>(p, &raw, [&](int) { return smp_summary(p, ct) + MK_SMP_S_MAX; }, mine);
        float gm = mine ? tagged_float(raw) : ninf;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) gm = fmaxf(gm, __shfl_xor_sync(0xffffffffu, gm, o));
        if ((ct & 31) == 0) { sh.base.redd[ct >> 5] = z; sh.base.redf[ct >> 5] = gm; }
        consumers_sync();
        z = 0.0;
        gm = sh.base.redf[0];
        for (int w = 0; w < CONSUMER_WARPS; w++) {
            z += sh.base.redd[w];
            gm = fmaxf(gm, sh.base.redf[w]);
        }
        gm_seen = gm;
        if (attempt) {
            smp_stamp(PROF_EXTRA1);
            const smp_u64 tk = (smp_u64)smp_key(gm - h) << 32;
            // Each thread's rows as keys, the same number of calls in every thread.
            const int nr = (rc + CONSUMERS - 1) / CONSUMERS;
            auto for_keys = [&](auto f) {
#pragma unroll 1
                for (int r = 0; r < nr; r++) {
                    const int j = ct + r * CONSUMERS;
                    f(j < rc ? (smp_u64)smp_key(xv[j]) << 32 | (smp_u32)~(u32)(rs + j) : 0ull);
                }
            };
            smp_u32 n = 0;
            for_keys([&](smp_u64 key) { n += key >= tk; });
            n = __reduce_add_sync(0xffffffffu, n);
            if ((ct & 31) == 0 && n != 0) atomicAdd(&sh.fcount, n);
            consumers_sync();
            count = sh.fcount;
            if (count <= MK_SMP_CAP) {
                smp_emit_by(for_keys, [&](smp_u64 key) { return key >= tk; },
                            [&](smp_u32 slot, smp_u64 key) { __stcg(out + slot, smp_slot_word(key, t14)); }, sh.sel,
                            ct);
            } else {
                count = MK_SMP_OVER;
            }
        }
    }
    {
        // Every other slot written empty with this step's tag, whatever the rule: the draw
        // polls each slot it loads, and a slot's tag is never older than the last sampled
        // launch (the host's condition for the short tags).
        const smp_u32 filled = count <= MK_SMP_CAP ? count : 0u;
        for (int j = ct; j < MK_SMP_CAP; j += CONSUMERS)
            if (j >= (int)filled) __stcg(out + j, smp_slot_word(0, t14));
    }
    if (ct == 0) {
        u64* o = smp_summary(p, blk);
        const u64 zb = (u64)__double_as_longlong(z), bb = (u64)__double_as_longlong(best);
        // (A truncating rule's maximum went out before its keys; pure temperature's draw reads
        // only its best words.)
        if (!draw_all) {
            st_tagged_bits(o + MK_SMP_S_Z_HI, (u32)(zb >> 32), tag);
            st_tagged_bits(o + MK_SMP_S_Z_LO, (u32)zb, tag);
            st_tagged_bits(o + MK_SMP_S_COUNT, smp_count_word(count, sh.top), tag);
            st_tagged(o + MK_SMP_S_HINT, attempt ? h : 0.f, tag);
        } else {
            st_tagged_bits(o + MK_SMP_S_BEST_HI, (u32)(bb >> 32), tag);
            st_tagged_bits(o + MK_SMP_S_BEST_LO, (u32)bb, tag);
            st_tagged_bits(o + MK_SMP_S_BEST_IDX, best_idx, tag);
        }
    }
    // Every thread's stores (the logits, the penalised logits, the slots), then, except on the
    // drawing SM, the release that the draw acquires before it searches the logits (thread 0
    // waits for it here, off the token's way: this SM's next instructions wait for the token).
    consumers_sync();
    if (ct == 0) {
        *(volatile u32*)&mk_merges = blk == MK_SMP_DRAWER;
        if (blk == MK_SMP_DRAWER) *(volatile float*)&mk_smp_gm = gm_seen;
        if (blk != MK_SMP_DRAWER) st_release_tagged(smp_summary(p, blk) + MK_SMP_S_ARRIVED, 1u, tag);
    }
}

// MK_SMP_STAMPS=2 (measuring): the draw's phases, stamped by consumer thread 0 into the extra
// words of the drawing SM's first instructions (phase k: instruction k / 2, word k % 2), which
// no other stamp uses in such a build.
__device__ __forceinline__ void smp_phase(const MkParams& p, int k) {
    if (MK_SMP_STAMPS >= 2 && threadIdx.x == 32 && p.profile)
        p.profile[((size_t)p.sm_offsets[blockIdx.x] + k / 2) * PROF_WORDS + PROF_EXTRA1 + k % 2] = global_ns();
}

struct MkSmpMergeShared {
    SmpShared base;
    SmpSel sel;
    SmpBinned<CONSUMERS> bn;
    smp_u32 xbase[MK_SMP_MAX_BLOCKS];   // the second load's first index of each block
    float wmax[CONSUMER_WARPS], whint[CONSUMER_WARPS];
    float wz[CONSUMER_WARPS];
    smp_u32 wused[CONSUMER_WARPS], wkeys[CONSUMER_WARPS], wbad[CONSUMER_WARPS], wtop[CONSUMER_WARPS];
    smp_u32 nextra, drawn;
    smp_u64 list[MK_SMP_MERGE_PER * CONSUMERS];  // the union, compacted
};
static_assert(sizeof(MkSmpMergeShared) <= 2 * RES_MAX * sizeof(float), "the draw's scratch is res");

// The draw, by every consumer of the SM of block MK_SMP_DRAWER (see the top of this file):
// consumer thread 0 hands the token to publish as soon as it has it (SMP_NONE when there is
// nothing to draw from), then leaves the next hint in the gate; with commit false (measuring)
// nothing is handed over or left. res is scratch (the block's rows are no longer needed).
template <typename Publish>
__device__ __forceinline__ void mk_sample_merge(const MkParams& p, const TokenMeta& m, float* res, Publish publish,
                                                bool commit) {
    const int ct = threadIdx.x - 32, nb = p.n_lm;
    const SmpParams s = mk_smp_params(p);
    const bool draw_all = s.temperature == 0.f || !smp_truncates(s);
    const float ninf = __int_as_float(0xff800000u);
    const auto sync = [] { consumers_sync(); };
    MkSmpMergeShared& sh = *(MkSmpMergeShared*)res;
    smp_phase(p, 5);
    const u32 tag = step_tag();
    if (draw_all) {
        // Every block's best perturbed score, polled until it carries this step's tag.
        u64 bw[3] = {0, 0, 0};
        const auto baddr = [&](int k) { return smp_summary(p, ct) + MK_SMP_S_BEST_HI + k; };
        if (ct < nb) {
#pragma unroll
            for (int k = 0; k < 3; k++) bw[k] = ld_tagged(baddr(k));
        }
        settle<3>(p, bw, baddr, ct < nb ? 3 : 0);
        double best = -__longlong_as_double(0x7ff0000000000000ll);
        smp_u32 idx = SMP_NONE;
        if (ct < nb && (u32)bw[2] != SMP_NONE)
            smp_best_merge(best, idx, __longlong_as_double((long long)smp_join(bw[0], bw[1])), (u32)bw[2]);
        smp_block_best(best, idx, sh.base, ct, CONSUMERS, sync);
        if (ct == 0 && commit) publish(idx);
        return;
    }
    // One round trip once the last block's words are out: every summary's attempt words, and
    // the first u slots of every block, each polled until it carries this step's tag. Thread ct
    // loads first slot i = ct + r * CONSUMERS, slot i % u of block i / u, stepped without
    // dividing: the draw's code runs once a step on one SM, so every instruction on its way is
    // latency (a step's draw ran at about 3 cycles an instruction).
    u64 sw[MK_SMP_ATTEMPT_WORDS];
    const auto saddr = [&](int k) { return smp_summary(p, ct) + k; };
#pragma unroll
    for (int k = 0; k < MK_SMP_ATTEMPT_WORDS; k++) sw[k] = ct < nb ? ld_tagged(saddr(k)) : 0ull;
    const int u = smp_first_slots(nb), db = CONSUMERS / u, ds = CONSUMERS % u, b0 = ct / u, s0 = ct % u;
    const auto step_slot = [&](int& b, int& sl) {
        sl += ds;
        b += db;
        if (sl >= u) { sl -= u; b++; }
    };
    const u32 t14 = smp_slot_tag(tag);
    u64* const slot0 = smp_slots(p, 0);
    smp_u64 cf[MK_SMP_FIRST_PER];
    int fo[MK_SMP_FIRST_PER];  // the slot's word after block 0's first slot, or -1
    {
        int b = b0, sl = s0;
#pragma unroll
        for (int r = 0; r < MK_SMP_FIRST_PER; r++) {
            fo[r] = b < nb ? b * MK_SMP_BLOCK_WORDS + sl : -1;
            cf[r] = fo[r] >= 0 ? ld_tagged(slot0 + fo[r]) : smp_slot_word(0, t14);
            step_slot(b, sl);
        }
    }
    // One poll over both (each retry re-reads every stale word together: one round trip).
    constexpr int NS = MK_SMP_ATTEMPT_WORDS;
    const int nsum = ct < nb ? NS : 0;
    settle_with<NS + MK_SMP_FIRST_PER>(
        p,
        [&](int k) {
            return k < NS ? (k < nsum ? (u32)(sw[k] >> 32) : tag) : (smp_slot_fresh(cf[k - NS], t14) ? tag : ~tag);
        },
        [&](int k) {
            if (k < NS) sw[k] = ld_tagged(saddr(k));
            else cf[k - NS] = ld_tagged(slot0 + fo[k - NS]);
        },
        [&](int k) { return k < NS ? saddr(k) : slot0 + max(fo[k - NS], 0); }, NS + MK_SMP_FIRST_PER);
#pragma unroll
    for (int r = 0; r < MK_SMP_FIRST_PER; r++) cf[r] = smp_slot_key(cf[r]);
    for (int i = ct; i < SMP_BINS; i += CONSUMERS) { sh.sel.hist[0][i] = 0; sh.sel.hist[1][i] = 0; }
    if (ct == 0) { sh.bn.nsel = ~0u; sh.sel.fill = 0; }
    // The summaries' maximum, smallest hint and most keys in a block: one barrier. With top-p
    // alone, also the vocabulary's top token and, where this SM's block saw the maximum (it
    // attempted), the softmax sum in single precision: enough to tell whether that token alone
    // decides the draw (smp_top_dominates) before any key is looked at, wherever the sum is
    // not within 2e-4 of 1 / P (its error is below 2e-5: 132 terms, each an __expf and two
    // roundings). The exact test (in double, the merge's sum) then waits for the merge's
    // barrier below: a draw decided here costs the others a float exponential, not a double one.
    const bool need_z = s.top_p < 1.f && s.top_k == 0;
    const float bmax = ct < nb ? __uint_as_float((u32)sw[MK_SMP_S_MAX]) : ninf;
    const smp_u32 bcount = ct < nb ? smp_word_count((u32)sw[MK_SMP_S_COUNT]) : 0u;
    const float bh = ct < nb ? __uint_as_float((u32)sw[MK_SMP_S_HINT]) : __int_as_float(0x7f800000);
    const double bz = ct < nb ? __longlong_as_double((long long)smp_join(sw[MK_SMP_S_Z_HI], sw[MK_SMP_S_Z_LO])) : 0.0;
    const float gm_seen = *(volatile float*)&mk_smp_gm;
    const bool early = need_z && MK_SMP_TOP == 1 && !MK_SMP_NO_ATTEMPT && gm_seen > ninf && gm_seen < __int_as_float(0x7f800000);
    {
        float wm = bmax, wh = bh;
        float wz = early && ct < nb && bmax != ninf ? (float)bz * __expf(bmax - gm_seen) : 0.f;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            wm = fmaxf(wm, __shfl_xor_sync(0xffffffffu, wm, o));
            wh = fminf(wh, __shfl_xor_sync(0xffffffffu, wh, o));
            if (early) wz += __shfl_xor_sync(0xffffffffu, wz, o);
        }
        const smp_u32 wu = __reduce_max_sync(0xffffffffu, bcount == MK_SMP_OVER ? 0u : bcount);
        const smp_u32 wt = __reduce_min_sync(
            0xffffffffu, MK_SMP_TOP && ct < nb && bmax == wm ? smp_word_top((u32)sw[MK_SMP_S_COUNT]) : SMP_NONE);
        if ((ct & 31) == 0) {
            sh.wmax[ct >> 5] = wm; sh.whint[ct >> 5] = wh; sh.wused[ct >> 5] = wu;
            sh.wz[ct >> 5] = wz; sh.wtop[ct >> 5] = wt;
        }
    }
    consumers_sync();
    smp_phase(p, 0);
    float gmax = ninf, hmin = __int_as_float(0x7f800000);
    smp_u32 used = 0;
    for (int q = 0; q < CONSUMER_WARPS; q++) {
        gmax = fmaxf(gmax, sh.wmax[q]);
        hmin = fminf(hmin, sh.whint[q]);
        used = max(used, sh.wused[q]);
    }
    // Every thread decides alike, from the same shared words; the hint stays as it was.
    const auto take_top = [&] {
        if (ct == 0 && commit) {
            publish(smp_top_of_warps(sh.wmax, sh.wtop, CONSUMER_WARPS, gmax));
            atomicAdd(smp_gate(p) + MK_SMP_GATE_TOP, 1ull);
        }
    };
    // 1: the top token alone decides the draw; 0: it does not; -1: the exact test below.
    int alone = -1;
    if (early && gm_seen == gmax) {
        float zf = 0.f;
        for (int q = 0; q < CONSUMER_WARPS; q++) zf += sh.wz[q];
        const float r = zf * s.top_p;
        alone = r <= 0.9998f ? 1 : r >= 1.0002f ? 0 : -1;
        if (alone == 1 && smp_top_test_applies(s, gmax)) {
            take_top();
            return;
        }
    }
    const float tau = gmax - hmin;
    const smp_u64 tk = (smp_u64)smp_key(tau) << 32;
    // Blocks with more keys than the first load took: their other slots, in a second round
    // trip (trained logits put several of the top tokens in one block), packed one block
    // after another, as many as the first load's slots.
    smp_u64 c[2 * MK_SMP_FIRST_PER];
#pragma unroll
    for (int r = MK_SMP_FIRST_PER; r < 2 * MK_SMP_FIRST_PER; r++) c[r] = 0;
    smp_u32 extra = 0;
    if (used > (smp_u32)u) {
        const smp_u32 mine = ct < nb && bcount != MK_SMP_OVER && bcount > (smp_u32)u ? bcount - u : 0u;
        const smp_u32 at = (smp_u32)smp_block_scan(mine, sh.base, ct, CONSUMERS, sync);
        if (ct < nb) sh.xbase[ct] = at;
        if (ct == nb - 1) sh.nextra = at + mine;
        consumers_sync();
        extra = sh.nextra;
        u64 cx[MK_SMP_FIRST_PER];
        int xo[MK_SMP_FIRST_PER];
#pragma unroll
        for (int r = 0; r < MK_SMP_FIRST_PER; r++) {
            const int i = ct + r * CONSUMERS;
            xo[r] = -1;
            cx[r] = smp_slot_word(0, t14);
            if (i < (int)extra) {
                int b = 0;
                for (int step = MK_SMP_MAX_BLOCKS / 2; step > 0; step >>= 1)
                    if (b + step < nb && (int)sh.xbase[b + step] <= i) b += step;
                xo[r] = b * MK_SMP_BLOCK_WORDS + u + (i - (int)sh.xbase[b]);
                cx[r] = ld_tagged(slot0 + xo[r]);
            }
        }
        settle_with<MK_SMP_FIRST_PER>(
            p, [&](int k) { return smp_slot_fresh(cx[k], t14) ? tag : ~tag; },
            [&](int k) { cx[k] = ld_tagged(slot0 + xo[k]); }, [&](int k) { return slot0 + max(xo[k], 0); },
            MK_SMP_FIRST_PER);
#pragma unroll
        for (int r = 0; r < MK_SMP_FIRST_PER; r++) c[MK_SMP_FIRST_PER + r] = smp_slot_key(cx[r]);
    }
    smp_phase(p, 1);
    // The union: keys at or above tau (a block that read a larger hint sent more), and whether
    // a block that may hold some sent none (more than its slots).
    // (Slots past a block's count hold empty keys, 0, below every cut.)
    smp_u32 n = 0;
#pragma unroll
    for (int r = 0; r < MK_SMP_FIRST_PER; r++) {
        c[r] = cf[r] < tk ? 0ull : cf[r];
        n += c[r] != 0;
    }
#pragma unroll
    for (int r = MK_SMP_FIRST_PER; r < 2 * MK_SMP_FIRST_PER; r++) {
        if (c[r] < tk) c[r] = 0;
        n += c[r] != 0;
    }
    // The union compacted within each warp to MK_SMP_MERGE_PER keys a lane: most threads hold
    // none of their 2 * MK_SMP_FIRST_PER slots' keys, and the merge's loops over a thread's keys
    // wait on a shared atomic each. Where a warp holds more, the merge takes the slots as loaded.
    const int lane = ct & 31;
    const smp_u32 nincl = smp_warp_scan(n, lane), wtot = __shfl_sync(0xffffffffu, nincl, 31);
    const bool fits = wtot <= MK_SMP_MERGE_PER * 32;
    smp_u64 k2[MK_SMP_MERGE_PER];
#pragma unroll
    for (int r = 0; r < MK_SMP_MERGE_PER; r++) k2[r] = 0;
    if (fits) {
        smp_u64* mine = sh.list + (ct >> 5) * MK_SMP_MERGE_PER * 32;
        smp_u32 at = nincl - n;
#pragma unroll
        for (int r = 0; r < 2 * MK_SMP_FIRST_PER; r++)
            if (c[r] != 0) mine[at++] = c[r];
        __syncwarp();
#pragma unroll
        for (int r = 0; r < MK_SMP_MERGE_PER; r++) {
            const int j = lane + 32 * r;
            if (j < (int)wtot) k2[r] = mine[j];
        }
    }
    const bool bad = ct < nb && bcount == MK_SMP_OVER && bmax >= tau;
    // The binned merge's first part here, behind the union's barrier: each key counted in its
    // bin, the softmax sum's warp parts (smp_block_sum's order).
    const SmpBins bins = smp_bins(gmax, tau);
    if (bins.valid) {
        if (fits) smp_bins_count(k2, bins, sh.sel.hist[0]);
        else smp_bins_count(c, bins, sh.sel.hist[0]);
    }
    const double zt = ct < nb && bmax != ninf ? bz * exp((double)bmax - (double)gmax) : 0.0;
    {
        double zw = zt;
        if (need_z) {
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) zw += __shfl_xor_sync(0xffffffffu, zw, o);
        }
        const smp_u32 wb = __reduce_or_sync(0xffffffffu, bad ? 1u : 0u) | (fits ? 0u : 2u);
        if (lane == 0) { sh.wkeys[ct >> 5] = wtot; sh.wbad[ct >> 5] = wb; sh.base.redd[ct >> 5] = zw; }
    }
    consumers_sync();
    smp_phase(p, 2);
    smp_u32 nkeys = 0, any_bad = 0;
    double z_all = 0.0;
    for (int q = 0; q < CONSUMER_WARPS; q++) {
        nkeys += sh.wkeys[q];
        any_bad |= sh.wbad[q];
        z_all += sh.base.redd[q];
    }
    if (!need_z) z_all = 0.0;
    // Where the first barrier left it open (this SM's block made no attempt, or the float sum
    // lay too near 1 / P): the exact test now, which also spares the search a draw without a
    // hint would make.
    if (need_z && MK_SMP_TOP == 1 && !MK_SMP_NO_ATTEMPT && alone < 0 && smp_top_dominates(s, gmax, z_all)) {
        take_top();
        return;
    }
    smp_u32 token = SMP_NONE;
    const int why = !(hmin > 0.f && hmin < 1e30f)                                            ? MK_SMP_GATE_NO_HINT
                    : extra > MK_SMP_FIRST_PER * CONSUMERS || (any_bad & 1u) != 0 ? MK_SMP_GATE_SLOTS
                                                                               : MK_SMP_GATE_SHORT;
    const auto mark = [&](int k) { smp_phase(p, 6 + k); };
    if (why == MK_SMP_GATE_SHORT && bins.valid &&
        ((any_bad & 2u) == 0
             ? smp_merge_binned_counted<CONSUMERS>(s, m.pos, k2, nkeys, bins, z_all, sh.base, sh.sel, sh.bn, ct, sync,
                                                   token, mark)
             : smp_merge_binned_counted<CONSUMERS>(s, m.pos, c, nkeys, bins, z_all, sh.base, sh.sel, sh.bn, ct, sync,
                                                   token, mark))) {
        smp_phase(p, 3);
        // Thread 0 holds the token: it goes out at once where the keys decided the cuts, before
        // the barrier that tells the other threads whether to search.
        if (ct == 0) {
            const bool drawn = smp_attempt_complete(s, sh.base, tau);
            sh.drawn = drawn;
            if (drawn && commit) {
                publish(token);
                const float hint = smp_next_hint(s, sh.base, gmax, hmin);
                if (hint >= 0.f) st_tagged(smp_gate(p) + MK_SMP_GATE_HINT, hint, step_tag());
            }
        }
        consumers_sync();
        smp_phase(p, 4);
        if (sh.drawn) return;
    }
    // The search: the whole vocabulary's keys, read from L2 (the penalised logits where a
    // penalty changed some), first down to at most CONSUMERS keys that hold the top k, then,
    // among those in shared memory, exactly the top k. First every other block's release
    // (its summary's last word), acquired: their logits are visible after it.
    {
        const int mine = ct < nb && ct != MK_SMP_DRAWER ? 1 : 0;
        const auto aaddr = [&](int) { return smp_summary(p, ct) + MK_SMP_S_ARRIVED; };
        u64 raw = mine ? ld_tagged(aaddr(0)) : 0ull;
        settle<1>(p, &raw, aaddr, mine);
        __threadfence();
    }
    consumers_sync();
    const float* vals = smp_penalises(s) ? smp_penalised(p) : p.logits;
    const int vocab = p.vocab;
    auto for_vocab = [&](auto f) {
        // 16 loads in flight a thread: the passes are bound by L2's latency.
        constexpr int B = 16;
#pragma unroll 1
        for (int j0 = 0; j0 < vocab; j0 += B * CONSUMERS) {
            float v[B];
#pragma unroll
            for (int q = 0; q < B; q++) {
                const int j = j0 + q * CONSUMERS + ct;
                v[q] = j < vocab ? __ldcg(vals + j) : 0.f;
            }
#pragma unroll
            for (int q = 0; q < B; q++) {
                const int j = j0 + q * CONSUMERS + ct;
                f(j < vocab ? (smp_u64)smp_key(smp_clean(v[q])) << 32 | (smp_u32)~(u32)j : 0ull);
            }
        }
    };
    const smp_u32 k = s.top_k > 0 ? s.top_k : SMP_KMAX;
    smp_u32 c1, kk;
    const smp_u64 t1 = smp_threshold_by<CONSUMERS>(for_vocab, (smp_u32)vocab, k, CONSUMERS, sh.sel, ct, sync, c1);
    if (ct == 0) sh.sel.fill = 0;
    consumers_sync();
    smp_emit_by(for_vocab, [&](smp_u64 key) { return key >= t1; }, [&](smp_u32 slot, smp_u64 key) { sh.bn.ks[slot] = key; },
                sh.sel, ct);
    consumers_sync();
    const smp_u64 c2[1] = {ct < (int)c1 ? sh.bn.ks[ct] : 0ull};
    const smp_u64 t2 = smp_threshold<CONSUMERS>(c2, c1, k, 0, sh.sel, ct, sync, kk);
    if (ct == 0) sh.sel.fill = 0;
    consumers_sync();
    smp_emit(c2, [&](smp_u64 key) { return key >= t2; },
             [&](smp_u32 slot, smp_u64 key) {
                 sh.base.cv[slot] = smp_unkey((smp_u32)(key >> 32));
                 sh.base.ci[slot] = ~(smp_u32)key;
             },
             sh.sel, ct);
    consumers_sync();
    smp_rank<CONSUMERS>(kk, sh.base, ct, sync);
    token = smp_cut_and_draw(s, m.pos, z_all, sh.base, ct, CONSUMERS, sync);
    if (ct == 0 && commit) {
        publish(token);
        const float hint = smp_next_hint(s, sh.base, gmax, hmin);
        if (hint >= 0.f) st_tagged(smp_gate(p) + MK_SMP_GATE_HINT, hint, step_tag());
        atomicAdd(smp_gate(p) + MK_SMP_GATE_SEARCHES, 1ull);
        atomicAdd(smp_gate(p) + why, 1ull);
    }
}

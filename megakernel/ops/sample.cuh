// Sampling as the megakernel's last stage, so a sampled token chains on the device like a
// greedy one, inside a generation too. The rule is kernels/sampling/select.cuh's (the host's
// twin: src/sampling/mod.rs, sample_at; docs/sampling.md). In a sampled launch (p.sampling):
//
// - each RmsLmHead instruction, once its logits are stored, summarises its rows for the draw
//   (mk_sample_block): the penalised maximum, the softmax sum behind top-p, the best
//   Gumbel-perturbed row (pure temperature), and, when truncating, two sets of its keys: its
//   top MK_SMP_PFX to MK_SMP_PFX_LIMIT (the prefix) and the rest of its top k (the extras);
// - the SM with the Argmax instruction draws instead, after its instruction loop (op_draw,
//   mk_sample_draw). It reads every block's summary and prefix only, finds the k-th largest
//   key T among them and checks that no block can hold more of the global top k than it
//   sent: a block's unsent keys are below its smallest sent key, so the top k is exact unless
//   some block's prefix lies wholly above T. Such a block (at most k / MK_SMP_PFX of them;
//   with real logits almost never) has its extras read too, and the search runs again. So
//   the draw on one SM reads about n_lm x 12 keys, not the n_lm x k the blocks hold.
//
// Everything a block hands over is tagged (lm_sample in the arena: MK_SMP_BLK_WORDS summary
// words, then MK_SMP_PFX_SLOTS + MK_SMP_CAP key slots of two words); keys are select.cuh's
// 64-bit keys, the logit's key in the first word and the inverted token in the second. The
// scratch is shared memory no instruction needs by then: the block's res, the draw's xs and
// res. Compiled only into the kernel variant sampled launches run (MK_SAMPLING).

#ifndef MK_SAMPLING
#define MK_SAMPLING 0  // 1 in the variant sampled launches run (src/gpu/megakernel/compile.rs)
#endif
#ifndef MK_SMP_PFX
#define MK_SMP_PFX 6  // the prefix holds at least the block's top min(k, MK_SMP_PFX)
#endif
#ifndef MK_SMP_PFX_LIMIT
#define MK_SMP_PFX_LIMIT MK_SMP_PFX_SLOTS  // and at most this many keys
#endif
static_assert(MK_SMP_PFX <= MK_SMP_PFX_LIMIT && MK_SMP_PFX_LIMIT <= MK_SMP_PFX_SLOTS, "prefix sizes");
static_assert(MK_SMP_MAX_BLOCKS <= CONSUMERS, "the draw reads a block's summary per consumer thread");
static_assert((MK_SMP_BLK_WORDS & 1) == 0, "key slots are 16-byte pairs");


#define MK_SMP_ROWS_PER (RES_MAX / CONSUMERS)  // rows a consumer holds in RmsLmHead

struct MkSmpShared {
    SmpShared base;
    SmpSel sel;
    smp_u32 flagged[SMP_KMAX + 1];           // blocks whose extras the draw reads
    smp_u32 extra_at[SMP_KMAX + 2];          // their extras' first linear index
    smp_u32 n_flagged;
};
static_assert(sizeof(MkSmpShared) <= MK_SMP_SCRATCH_BYTES && MK_SMP_SCRATCH_BYTES <= RES_MAX * sizeof(float),
              "the sampler's scratch (the host plans MK_SMP_SCRATCH_BYTES) must fit in res's second half");

__device__ __forceinline__ SmpParams mk_smp_params(const MkParams& p) {
    return {p.smp_temperature, p.smp_top_p, p.smp_min_p, p.smp_penalty,
            p.smp_top_k,       p.smp_last_n, p.smp_seed_lo, p.smp_seed_hi};
}

__device__ __forceinline__ u64* smp_summary(const MkParams& p, int b) {
    return p.lm_sample + (size_t)b * MK_SMP_BLOCK_WORDS;
}
__device__ __forceinline__ u64* smp_slot(const MkParams& p, int b, int s) {
    return smp_summary(p, b) + MK_SMP_BLK_WORDS + 2 * s;
}

// A key as two tagged words, one 16-byte store (each 8-byte half single-copy atomic with its
// own tag, which is all a reader relies on).
__device__ __forceinline__ void st_tagged_key(u64* a, smp_u64 key, u32 tag) {
    const u64 hi = ((u64)tag << 32) | (u32)(key >> 32), lo = ((u64)tag << 32) | (u32)key;
    asm volatile("st.relaxed.gpu.global.v2.u64 [%0], {%1, %2};" ::"l"(a), "l"(hi), "l"(lo) : "memory");
}
__device__ __forceinline__ void ld_tagged_key(const u64* a, u64& hi, u64& lo) {
    asm volatile("ld.relaxed.gpu.global.v2.u64 {%0, %1}, [%2];" : "=l"(hi), "=l"(lo) : "l"(a));
}

// Waits until both words of the n keys at addr(k) (k < n) carry this step's tag, re-reading
// the stale ones together (settle_with; a key is stale while either word is).
template <int N, typename Addr>
__device__ __forceinline__ void settle_keys(const MkParams& p, u64 (&hi)[N], u64 (&lo)[N], Addr addr, int n) {
    const u32 tag = step_tag();
    settle_with<N>(
        p,
        [&](int k) {
            const u32 h = (u32)(hi[k] >> 32);
            return h != tag ? h : (u32)(lo[k] >> 32);
        },
        [&](int k) { ld_tagged_key(addr(k), hi[k], lo[k]); }, addr, n);
}

__device__ __forceinline__ smp_u64 key_of(u64 hi, u64 lo) { return (smp_u64)(u32)hi << 32 | (u32)lo; }
__device__ __forceinline__ float smp_hi(double d) { return __int_as_float(__double2hiint(d)); }
__device__ __forceinline__ float smp_lo(double d) { return __int_as_float(__double2loint(d)); }
__device__ __forceinline__ double smp_join(u64 hi, u64 lo) { return __hiloint2double((int)(u32)hi, (int)(u32)lo); }

// RmsLmHead's store in a sampled launch, by every consumer: rows w[W_A] .. + w[W_B] of the
// logits (their dot products in res, times scale) to p.logits, and the block's summary and
// keys to lm_sample (see the top of this file). Out of line, and with its rows in shared
// memory rather than registers: every register a function called from the interpreter loop
// takes costs the loop spilled registers.
__device__ __noinline__ void mk_sample_block(const MkParams& p, const u32* w, const TokenMeta& m, float* res,
                                             float scale) {
    const int ct = threadIdx.x - 32;
    const int rs = (int)w[W_A], rc = (int)w[W_B], blk = (int)w[W_C];
    const u32 tag = step_tag();
    const SmpParams s = mk_smp_params(p);
    const float ninf = __int_as_float(0xff800000u);
    const auto sync = [] { consumers_sync(); };
    // res: the rows' (penalised) logits first, then the scratch.
    float* xv = res;
    MkSmpShared& sh = *(MkSmpShared*)(res + RES_MAX);
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
    if (smp_penalises(s)) {
        for (int i = ct; i < (rc + 31) / 32; i += CONSUMERS) sh.base.bitmap[i] = 0;
        consumers_sync();
        // The window's tokens; history[pos] is not written yet (the draw writes it), the fed
        // token is m.token. In a generation the draws of earlier steps wrote the others, each
        // behind a fence before its token went out (op_draw); this fence orders the reads
        // after that token, and they go past L1, which may hold the words from an earlier step.
        if (p.steps > 1) __threadfence();
        const u32 first = m.pos + 1 > s.last_n ? m.pos + 1 - s.last_n : 0;
        for (u32 q = first + ct; q <= m.pos; q += CONSUMERS) {
            const u32 j = (q == m.pos ? m.token : __ldcg(p.history + q)) - (u32)rs;
            if (j < (u32)rc) atomicOr(&sh.base.bitmap[j >> 5], 1u << (j & 31));
        }
        consumers_sync();
        for (int j = ct; j < rc; j += CONSUMERS)
            if ((sh.base.bitmap[j >> 5] >> (j & 31)) & 1u) xv[j] = smp_penalise(xv[j], s.penalty);
    }
    consumers_sync();
    const bool draw_all = s.temperature == 0.f || !smp_truncates(s);
    float mx = ninf;
    for (int j = ct; j < rc; j += CONSUMERS) mx = fmaxf(mx, xv[j]);
    mx = smp_block_max(mx, sh.base, ct, CONSUMERS, sync);
    double best = -__longlong_as_double(0x7ff0000000000000ll), z = 0.0;
    smp_u32 best_idx = SMP_NONE, c1 = 0, extras = 0;
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
    } else {
        if (s.top_p < 1.f && s.top_k == 0) {
            for (int j = ct; j < rc; j += CONSUMERS) z += exp((double)xv[j] - (double)mx);
            z = smp_block_sum(z, sh.base, ct, CONSUMERS, sync);
        }
        // Each thread's rows as keys, the same number of calls in every thread.
        auto for_keys = [&](auto f) {
#pragma unroll 1
            for (int r = 0; r < MK_SMP_ROWS_PER; r++) {
                const int j = ct + r * CONSUMERS;
                f(j < rc ? (smp_u64)smp_key(xv[j]) << 32 | (smp_u32)~(u32)(rs + j) : 0ull);
            }
        };
        const smp_u32 k = s.top_k > 0 ? s.top_k : SMP_KMAX;
        smp_u32 c2;
        const smp_u64 t1 = smp_threshold_by<CONSUMERS>(for_keys, rc, min(k, (smp_u32)MK_SMP_PFX), MK_SMP_PFX_LIMIT,
                                                       sh.sel, ct, sync, c1);
        const smp_u64 t2 = smp_threshold_by<CONSUMERS>(for_keys, rc, k, MK_SMP_CAP, sh.sel, ct, sync, c2);
        extras = t2 < t1 ? c2 - c1 : 0;
        if (ct == 0) sh.sel.fill = 0;
        consumers_sync();
        smp_emit_by(for_keys, [&](smp_u64 key) { return key >= t1; },
                    [&](smp_u32 slot, smp_u64 key) { st_tagged_key(smp_slot(p, blk, slot), key, tag); }, sh.sel, ct);
        for (int i = c1 + ct; i < MK_SMP_PFX_SLOTS; i += CONSUMERS) st_tagged_key(smp_slot(p, blk, i), 0ull, tag);
        if (extras > 0) {
            consumers_sync();
            if (ct == 0) sh.sel.fill = 0;
            consumers_sync();
            smp_emit_by(for_keys, [&](smp_u64 key) { return key >= t2 && key < t1; },
                        [&](smp_u32 slot, smp_u64 key) { st_tagged_key(smp_slot(p, blk, MK_SMP_PFX_SLOTS + slot), key, tag); },
                        sh.sel, ct);
        }
    }
    if (ct == 0) {
        u64* o = smp_summary(p, blk);
        st_tagged(o + 0, mx, tag);
        st_tagged(o + 1, smp_hi(z), tag);
        st_tagged(o + 2, smp_lo(z), tag);
        st_tagged(o + 3, smp_hi(best), tag);
        st_tagged(o + 4, smp_lo(best), tag);
        st_tagged_bits(o + 5, best_idx, tag);
        st_tagged_bits(o + 6, c1, tag);
        st_tagged_bits(o + 7, extras, tag);
    }
    consumers_sync();  // the scratch is res again for the next instruction
}

// A key both of whose words carry this step's tag (already waited for), read again.
__device__ __forceinline__ smp_u64 ld_key(const u64* a) {
    u64 hi, lo;
    ld_tagged_key(a, hi, lo);
    return key_of(hi, lo);
}

// Waits until the keys at addr(i), i = ct, ct + CONSUMERS, ... < n, carry this step's tag,
// KEY_BATCH of them a thread at a time (in flight together), and hands each to sink(i, key).
#define KEY_BATCH 4
template <typename Addr, typename Sink>
__device__ __forceinline__ void settle_all_keys(const MkParams& p, Addr addr, int n, Sink sink) {
    const int ct = threadIdx.x - 32;
    for (int i0 = ct; i0 < n; i0 += KEY_BATCH * CONSUMERS) {
        u64 hi[KEY_BATCH], lo[KEY_BATCH];
        const int mine = min(KEY_BATCH, (n - i0 + CONSUMERS - 1) / CONSUMERS);
#pragma unroll
        for (int k = 0; k < KEY_BATCH; k++)
            if (k < mine) ld_tagged_key(addr(i0 + k * CONSUMERS), hi[k], lo[k]);
        settle_keys<KEY_BATCH>(p, hi, lo, [&](int k) { return addr(i0 + k * CONSUMERS); }, mine);
#pragma unroll
        for (int k = 0; k < KEY_BATCH; k++)
            if (k < mine) sink(i0 + k * CONSUMERS, key_of(hi[k], lo[k]));
    }
}

// f(key) for the keys at addr(i), i = ct, ct + CONSUMERS, ... < n (already waited for), and 0
// for slots past n, the same number of calls in every thread; KEY_BATCH loads in flight.
template <typename Addr, typename F>
__device__ __forceinline__ void for_keys_at(Addr addr, int n, F f) {
    const int ct = threadIdx.x - 32;
    for (int i0 = 0; i0 < n; i0 += KEY_BATCH * CONSUMERS) {
        smp_u64 kb[KEY_BATCH];
#pragma unroll
        for (int q = 0; q < KEY_BATCH; q++) {
            const int i = i0 + q * CONSUMERS + ct;
            kb[q] = i < n ? ld_key(addr(i)) : 0ull;
        }
#pragma unroll
        for (int q = 0; q < KEY_BATCH; q++) f(kb[q]);
    }
}

// The draw of a sampled launch, by every consumer (op_draw, ops/argmax.cuh): the token (in
// consumer thread 0; SMP_NONE when there is nothing to draw from), from every RmsLmHead
// block's summary and keys. No register arrays (every register a function called from the
// interpreter's step loop takes costs the loop spilled registers): the prefixes are copied
// into shared memory once they are current (xs and res, one region, with the scratch at its
// end; the host draws in the launch only where they fit), and the extras of the rare second
// round are read from L2 each time they are visited.
__device__ __forceinline__ u32 mk_sample_draw(const MkParams& p, const TokenMeta& m, float* xs, float* res) {
    const int ct = threadIdx.x - 32;
    const SmpParams s = mk_smp_params(p);
    const bool draw_all = s.temperature == 0.f || !smp_truncates(s);
    const int nb = p.n_lm;
    const float ninf = __int_as_float(0xff800000u);
    const auto sync = [] { consumers_sync(); };
    MkSmpShared& sh = *(MkSmpShared*)(res + 2 * RES_MAX - MK_SMP_SCRATCH_BYTES / sizeof(float));
    // Every block's prefix: slot i = b * MK_SMP_PFX_SLOTS + s.
    const int slots = draw_all ? 0 : nb * MK_SMP_PFX_SLOTS;
    smp_u64* staged = (smp_u64*)xs;
    auto prefix_at = [&](int i) { return smp_slot(p, i / MK_SMP_PFX_SLOTS, i % MK_SMP_PFX_SLOTS); };
    u64 bw[MK_SMP_BLK_WORDS];
    const int nbw = ct < nb ? MK_SMP_BLK_WORDS : 0;
#pragma unroll
    for (int k = 0; k < MK_SMP_BLK_WORDS; k++)
        if (k < nbw) bw[k] = ld_tagged(smp_summary(p, ct) + k);
    settle_all_keys(p, prefix_at, slots, [&](int i, smp_u64 key) { staged[i] = key; });
    settle<MK_SMP_BLK_WORDS>(p, bw, [&](int k) { return smp_summary(p, ct) + k; }, nbw);
    // The barrier inside also makes the staged keys visible to every thread.
    if (consumers_failed()) return SMP_NONE;
    if (draw_all) {
        double best = -__longlong_as_double(0x7ff0000000000000ll);
        smp_u32 idx = SMP_NONE;
        if (ct < nb && (u32)bw[5] != SMP_NONE) smp_best_merge(best, idx, smp_join(bw[3], bw[4]), (u32)bw[5]);
        smp_block_best(best, idx, sh.base, ct, CONSUMERS, sync);
        return idx;
    }
    if (ct == 0) { sh.sel.fill = 0; sh.n_flagged = 0; }
    // The maximum, and the softmax denominator for top-p without top-k, as smp_final_part.
    const float bmax = ct < nb ? tagged_float(bw[0]) : ninf;
    const float gmax = smp_block_max(bmax, sh.base, ct, CONSUMERS, sync);
    double z_all = 0.0;
    if (s.top_p < 1.f && s.top_k == 0) {
        if (ct < nb && bmax != ninf) z_all = smp_join(bw[1], bw[2]) * exp((double)bmax - (double)gmax);
        z_all = smp_block_sum(z_all, sh.base, ct, CONSUMERS, sync);
    }
    const smp_u32 n_prefix = (smp_u32)smp_block_sum(ct < nb ? (double)(u32)bw[6] : 0.0, sh.base, ct, CONSUMERS, sync);
    auto for_prefix = [&](auto f) {
        for (int i0 = 0; i0 < slots; i0 += CONSUMERS) {
            const int i = i0 + ct;
            f(i < slots ? staged[i] : 0ull);
        }
    };
    const smp_u32 k = s.top_k > 0 ? s.top_k : SMP_KMAX;
    smp_u32 kk;
    smp_u64 t = smp_threshold_by<CONSUMERS>(for_prefix, n_prefix, k, 0, sh.sel, ct, sync, kk);
    // A block with extras whose whole prefix is above t may hold more of the top k.
    if (ct < nb && (u32)bw[7] > 0) {
        bool more = n_prefix < k;
        if (!more) {
            smp_u64 lo = ~0ull;
#pragma unroll
            for (int i = 0; i < MK_SMP_PFX_SLOTS; i++) {
                const smp_u64 key = staged[ct * MK_SMP_PFX_SLOTS + i];
                if (key != 0) lo = min(lo, key);
            }
            more = lo > t;
        }
        if (more) {
            const smp_u32 f = atomicAdd(&sh.n_flagged, 1u);
            if (f <= SMP_KMAX) sh.flagged[f] = ct;
        }
    }
    consumers_sync();
    const int nf = (int)sh.n_flagged;
    int total = 0;
    auto extra_at = [&](int i) {
        int g = 0;
        while (g + 1 < nf && (int)sh.extra_at[g + 1] <= i) g++;
        return smp_slot(p, sh.flagged[g], MK_SMP_PFX_SLOTS + i - (int)sh.extra_at[g]);
    };
    if (nf > 0) {
        if (ct == 0) {
            // Their extras one after the other (the order does not matter).
            smp_u32 at = 0;
            for (int f = 0; f < nf; f++) {
                sh.extra_at[f] = at;
                at += (u32)ld_tagged(smp_summary(p, sh.flagged[f]) + 7);
            }
            sh.extra_at[nf] = at;
        }
        consumers_sync();
        total = (int)sh.extra_at[nf];
        settle_all_keys(p, extra_at, total, [](int, smp_u64) {});
        if (consumers_failed()) return SMP_NONE;
    }
    auto for_all = [&](auto f) {
        for_prefix(f);
        for_keys_at(extra_at, total, f);
    };
    if (nf > 0) t = smp_threshold_by<CONSUMERS>(for_all, n_prefix + (smp_u32)total, k, 0, sh.sel, ct, sync, kk);
    // The global top kk, ranked, then the cuts and the draw.
    smp_emit_by(for_all, [&](smp_u64 key) { return key >= t; },
                [&](smp_u32 slot, smp_u64 key) {
                    sh.base.cv[slot] = smp_unkey((smp_u32)(key >> 32));
                    sh.base.ci[slot] = ~(smp_u32)key;
                },
                sh.sel, ct);
    consumers_sync();
    smp_rank<CONSUMERS>(kk, sh.base, ct, sync);
    const smp_u32 token = smp_cut_and_draw(s, m.pos, z_all, sh.base, ct, CONSUMERS, sync);
    consumers_sync();  // the scratch is xs and res again for the next instruction
    return token;
}

// The sampler as one kernel, smp_sample: the graph paths' and the megakernel's draw after
// each step. It draws the same token as smp_blocks + smp_final (the same rule, the same
// per-block sums), at a fraction of their cost; docs/sampling.md explains the design.
//
// One 512-thread CTA per SMP_CHUNK logits reads its logits once into registers (2 to 8 a thread),
// penalised, as order-preserving 64-bit keys (logit key above, inverted token id below: every
// key is distinct, and a larger key is a larger logit or an equal logit at a lower token, the
// rule's own order). When truncating, it writes every key at or above a threshold it finds by
// as few 8-bit radix passes as it takes to bring the count down to SMP1_CAP; those include its
// top k. The CTA that finishes last (an atomic counter, which it resets) merges: the union of
// the blocks' keys holds the global top k, which the same threshold search, now exact, finds;
// it sorts them and applies the cuts and the draw (smp_cut_and_draw, as smp_final does).
//
// With `fast` set (the host sets it where every CTA is resident at once: no more CTAs than
// SMs), a truncating draw without top-k first tries without the blocks' threshold searches:
// the CTAs share their maxima (a grid-wide wait), then each writes its keys within `hint` (a
// logit distance the previous draw left) of the global maximum; the last CTA merges and draws
// as above and checks that those keys decided the cuts (smp_attempt_complete). If they did,
// the token is the one the searches would have given; if not (or a CTA had more than SMP1_CAP
// such keys), it tells the waiting CTAs so, and all of them search and merge as above. The
// attempt's merge takes a short way where it can (smp_merge_binned_counted, select.cuh: the union
// sorted by counting, in about five barriers). Either way the last merge leaves `hint` for
// the next draw.

#define SMP1_THREADS 512
#define SMP1_PER (SMP_CHUNK / SMP1_THREADS)  // rows a thread holds
#define SMP1_CAP 160                          // key slots per block (>= SMP_KMAX)
#define SMP1_FINAL_PER 24                     // slots a thread of the last CTA holds: nb * SMP1_CAP <= 12288
#define SMP1_FIRST_PER 3                      // slots a thread of the last CTA loads with the summaries

// SMP_PROF=1 (for measuring, through MEGAINFER_SAMPLER_DEFINES): the CTA that draws prints
// where one draw in 40 spent its time (globaltimer, ns from the earliest CTA's start after
// griddepcontrol.wait): its own start, its logits read and maximum, the maxima's exchange,
// its keys written, its arrival as the last CTA, the merge and draw, the token stored.
#ifndef SMP_PROF
#define SMP_PROF 0
#endif
#if SMP_PROF
__device__ unsigned long long smp_prof_first = ~0ull;
__device__ __forceinline__ unsigned long long smp_now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
#define SMP_STAMP(i) \
    if (tid == 0) pt[i] = smp_now()
__device__ unsigned long long smp_prof_merge[5];
#define SMP_MSTAMP(i) \
    if (tid == 0) smp_prof_merge[i] = smp_now()
#else
#define SMP_MSTAMP(i)
#define SMP_STAMP(i)
#endif

struct Smp1Shared {
    SmpShared base;
    SmpSel sel;
    smp_u32 last;
    smp_u32 verdict;  // the fast attempt's, for the whole CTA
    smp_u32 fcount;   // this CTA's keys within the hint
    smp_u32 top;      // the attempt with top-p alone: this CTA's top token (its lowest at the maximum)
    // The last CTA's summaries, a warp each: maximum, keys, most keys in a block, overflow, the
    // top token of the blocks at the warp's maximum.
    float wmax[SMP1_THREADS / 32];
    smp_u32 wkeys[SMP1_THREADS / 32], wused[SMP1_THREADS / 32], wover[SMP1_THREADS / 32], wtop[SMP1_THREADS / 32];
    SmpBinned<SMP1_THREADS> bn;  // the binned merge's (smp_merge_binned_counted)
};

__device__ __forceinline__ SmpBlock smp1_load_block(const SmpBlock* p) {
    SmpBlock b;
    b.sumexp = __ldcg(&p->sumexp);
    b.best = __ldcg(&p->best);
    b.max = __ldcg(&p->max);
    b.best_idx = __ldcg(&p->best_idx);
    b.pad[0] = __ldcg(&p->pad[0]);
    b.pad[1] = 0;
    return b;
}

// The gate's words (zero at first; the host allocates SMP1_GATE_MAXIMA + 2 * nb): the fast
// attempt's arrival counter for its keys (0 between launches), the attempts made so far (an
// attempt's tag is that count + 1: its words below carry it, so no reader takes an older
// attempt's), draws that fell back and merges that took the long way (statistics), the
// attempt's verdict (a 64-bit word: the tag above the verdict), and from SMP1_GATE_MAXIMA each
// CTA's maximum (a 64-bit word: the tag above the float's bits). A word that carries its tag
// needs no fence and no counter: one relaxed 64-bit store, single-copy atomic, hands over the
// value and its readiness together.
#define SMP1_GATE_ARRIVE 0
#define SMP1_GATE_ATTEMPTS 1
#define SMP1_GATE_FALLBACKS 2
#define SMP1_GATE_LONG_MERGES 3  // merges the binned way did not take (a statistic)
#define SMP1_GATE_VERDICT 4  // words 4 and 5
#define SMP1_GATE_MAXIMA 8   // words 8 .. 8 + 2 * nb

__device__ __forceinline__ void smp1_st_tagged(smp_u32* word, smp_u32 tag, smp_u32 v) {
    const smp_u64 t = (smp_u64)tag << 32 | v;
    asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(word), "l"(t) : "memory");
}
// The value of the 64-bit word at `word` once it carries `tag`. Every CTA is resident (the
// host's condition for the fast attempt), so the CTA that writes it runs; a launch that never
// sees it is stopped, not left hanging.
__device__ __forceinline__ smp_u32 smp1_wait_tagged(const smp_u32* word, smp_u32 tag) {
    for (unsigned long long spins = 0;; spins++) {
        smp_u64 v;
        asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(word));
        if ((smp_u32)(v >> 32) == tag) return (smp_u32)v;
        if (spins > (1ull << 26)) __trap();
    }
}
// The arrival of this CTA at a counter, by thread 0 between two barriers: an acquire-release
// add, so that every write the CTA made before the first barrier is visible to the CTA that
// arrives last, and that CTA, after the second barrier, sees every other CTA's (as a grid
// barrier's arrival and wait are built: a barrier, then one thread's release or acquire).
__device__ __forceinline__ smp_u32 smp1_arrive(smp_u32* counter) {
    smp_u32 old;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(counter) : "memory");
    return old;
}

// Two block-wide maxima with one barrier (the block reductions take two), for a caller that
// writes neither sm.redf nor sm1.wmax again before its next barrier.
__device__ __forceinline__ void smp1_max2(float& a, float& b, SmpShared& sm, float* wmax, int tid) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
        b = fmaxf(b, __shfl_xor_sync(0xffffffffu, b, o));
    }
    if ((tid & 31) == 0) { sm.redf[tid >> 5] = a; wmax[tid >> 5] = b; }
    __syncthreads();
    a = sm.redf[0];
    b = wmax[0];
    for (int w = 1; w < SMP1_THREADS / 32; w++) { a = fmaxf(a, sm.redf[w]); b = fmaxf(b, wmax[w]); }
}

#define SMP1_VERDICT_DRAWN 1u
#define SMP1_VERDICT_SEARCH 2u    // the attempt's keys fell short of the cuts
#define SMP1_VERDICT_OVERFLOW 3u  // a CTA had more than SMP1_CAP keys within the hint
#define SMP1_OVER 0xffffffffu  // a block's fast count when it had more than SMP1_CAP keys

// The last CTA's merge (the union of the blocks' keys, nb * SMP1_CAP slots, zero past each
// block's count in blk.pad[0]) and draw: the token in thread 0; the sorted candidates stay in
// sm, their number in sm.count, how many the cuts kept in sm.sh[3], the global maximum in gmax.
__device__ smp_u32 smp1_merge_and_draw(const SmpParams& s, const SmpMeta& m, const SmpBlock* blocks, const smp_u64* keys,
                                       int nb, int used, Smp1Shared& sm1, int tid, float& gmax) {
    SmpShared& sm = sm1.base;
    const auto sync = [] { __syncthreads(); };
    const int nthreads = SMP1_THREADS;
    const float ninf = __int_as_float(0xff800000u);
    // The union, loaded first so that its latency overlaps the reductions below
    // (nb * SMP1_CAP <= SMP1_THREADS * SMP1_FINAL_PER: the host's check).
    smp_u64 c[SMP1_FINAL_PER];
    const int slots = nb * SMP1_CAP;
#pragma unroll
    for (int r = 0; r < SMP1_FINAL_PER; r++) {
        const int i = tid + r * SMP1_THREADS;
        c[r] = i < slots && i % SMP1_CAP < used ? __ldcg(keys + i) : 0ull;
    }
    // As smp_final_part (one block a thread, nb <= SMP1_THREADS): the maximum, the number of
    // keys, and the softmax denominator for top-p without top-k.
    SmpBlock blk;
    blk.max = ninf;
    blk.sumexp = 0.0;
    blk.pad[0] = 0;
    SMP_MSTAMP(0);
    if (tid < nb) blk = smp1_load_block(blocks + tid);
    gmax = smp_block_max(blk.max, sm, tid, nthreads, sync);
    const smp_u32 n = (smp_u32)smp_block_sum((double)blk.pad[0], sm, tid, nthreads, sync);
    double z_all = 0.0;
    if (s.top_p < 1.f && s.top_k == 0) {
        if (tid < nb && blk.max != ninf) z_all += blk.sumexp * exp((double)blk.max - (double)gmax);
        z_all = smp_block_sum(z_all, sm, tid, nthreads, sync);
    }
    // The top k of the union: exactly k keys, then ranked (largest logit first, equal logits
    // lowest token first, as smp_final_part's sort).
    const smp_u32 k = s.top_k > 0 ? s.top_k : SMP_KMAX;
    smp_u32 kk;
    SMP_MSTAMP(1);
    const smp_u64 t = smp_threshold<SMP1_THREADS>(c, n, k, 0, sm1.sel, tid, sync, kk);
    smp_emit(c, [&](smp_u64 key) { return key >= t; },
             [&](smp_u32 slot, smp_u64 key) {
                 sm.cv[slot] = smp_unkey((smp_u32)(key >> 32));
                 sm.ci[slot] = ~(smp_u32)key;
             },
             sm1.sel, tid);
    __syncthreads();
    SMP_MSTAMP(2);
    smp_rank<SMP1_THREADS>(kk, sm, tid, sync);
    SMP_MSTAMP(3);
    const smp_u32 tok = smp_cut_and_draw(s, m.pos, z_all, sm, tid, nthreads, sync);
    SMP_MSTAMP(4);
    return tok;
}

#if SMP_PROF
__device__ __noinline__ void smp_prof_print(const unsigned long long* pt, smp_u32 pos, int attempt, smp_u32 verdict,
                                            bool binned) {
    const unsigned long long f = smp_prof_first;
    smp_prof_first = ~0ull;
    // After a failed attempt the searches' draw finds the start already taken by its print.
    if (pos % 40 != 0 || f == ~0ull) return;
    long long d[7], e[5];
    for (int i = 0; i < 7; i++) d[i] = pt[i] ? (long long)(pt[i] - f) : -1;
    for (int i = 0; i < 5; i++) e[i] = smp_prof_merge[i] > f ? (long long)(smp_prof_merge[i] - f) : -1;
    printf("smp-prof nb %d pos %u attempt %d verdict %u merge %s: start %lld loaded+max %lld exchanged %lld emitted %lld last %lld drawn %lld stored %lld merge %lld %lld %lld %lld %lld\n",
           (int)gridDim.x, pos, attempt, verdict, binned ? "binned" : "long", d[0], d[1], d[2], d[3], d[4], d[5], d[6], e[0], e[1], e[2], e[3], e[4]);
}
#endif

// Grid: ceil(vocab / SMP_CHUNK) CTAs of SMP1_THREADS, at most 12288 / SMP1_CAP of them.
// blocks: a summary per CTA (pad[0]: its number of keys); keys: SMP1_CAP slots per CTA;
// done: a counter, 0 between launches. meta, history and meta_out as smp_final's. hint: the
// fast attempt's distance below the maximum; gate: its words (SMP1_GATE_*); fast: 1 to
// attempt it (every CTA resident at once), 2 to attempt it at a distance of 0 (for tests: the
// searches then run after nearly every attempt), else 0. lm_max: null, or n_lm_max (at most
// SMP1_THREADS) tagged words two apart (a float's bits in the low half), whose largest is the
// largest logit: the megakernel's LM-head blocks' maxima (lm_best), written before this grid
// started. Without a penalty the attempt cuts below that maximum and skips the exchange.
extern "C" __global__ void __launch_bounds__(SMP1_THREADS, 1)
    smp_sample(const float* logits, int vocab, const SmpMeta* meta, smp_u32* history, const SmpParams* sp,
               SmpBlock* blocks, smp_u64* keys, smp_u32* done, SmpMeta* meta_out, float* hint, smp_u32* gate,
               int fast, const smp_u64* lm_max, int n_lm_max) {
    __shared__ Smp1Shared sm1;
    SmpShared& sm = sm1.base;
    smp_pdl_launch_next();
    smp_pdl_wait();
    const int tid = threadIdx.x, nb = gridDim.x, nthreads = SMP1_THREADS;
#if SMP_PROF
    unsigned long long pt[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    SMP_STAMP(0);
    if (tid == 0) atomicMin(&smp_prof_first, pt[0]);
#endif
    const auto sync = [] { __syncthreads(); };
    const smp_u32 base = blockIdx.x * SMP_CHUNK;
    const int rows = min(SMP_CHUNK, vocab - (int)base);
    // The logits are loaded first: they do not depend on the parameters or the meta, so all
    // of them are in flight together, one round trip, not one after the other.
    float raw[SMP1_PER];
#pragma unroll
    for (int r = 0; r < SMP1_PER; r++) {
        const int j = tid + r * SMP1_THREADS;
        raw[r] = j < rows ? logits[base + j] : 0.f;
    }
    // The LM head's maxima are read with the logits, in the same round trip (only the first
    // attempt uses them).
    const smp_u64 lm_word = fast != 0 && lm_max != nullptr && tid < n_lm_max ? __ldcg(lm_max + 2 * tid) : 0ull;
    // So are the fast attempt's hint and tag (the attempts made before it, plus one): the draw
    // before this one, which wrote them, has completed (this grid waited for it), and this
    // draw's last CTA writes them only once every CTA has arrived.
    const float h = fast ? *hint : 0.f;
    const smp_u32 tag = fast ? *(volatile smp_u32*)(gate + SMP1_GATE_ATTEMPTS) + 1 : 0u;
    const SmpParams s = *sp;
    const SmpMeta m = *meta;
    const float ninf = __int_as_float(0xff800000u);
    const bool draw_all = s.temperature == 0.f || !smp_truncates(s);
    if (tid == 0) { sm1.sel.fill = 0; sm1.fcount = 0; sm1.top = SMP_NONE; }
    // The next draw's hint (every draw leaves one, held attempt or search alike).
    const auto leave_hint = [&](float gmax) {
        const float v = smp_next_hint(s, sm, gmax, h);
        if (v >= 0.f) *hint = v;
    };

    // ---- this CTA's rows: as smp_block_part, from registers ----
    const bool pen = smp_penalises(s);
    if (pen) {
        for (int w = tid; w < (rows + 31) / 32; w += nthreads) sm.bitmap[w] = 0;
        __syncthreads();
        const smp_u32 first = m.pos + 1 > s.last_n ? m.pos + 1 - s.last_n : 0;
        for (smp_u32 q = first + tid; q <= m.pos; q += nthreads) {
            const smp_u32 j = (q == m.pos ? m.token : history[q]) - base;
            if (j < (smp_u32)rows) atomicOr(&sm.bitmap[j >> 5], 1u << (j & 31));
        }
        __syncthreads();
    }
    float x[SMP1_PER];
    float mx = ninf;
#pragma unroll
    for (int r = 0; r < SMP1_PER; r++) {
        const int j = tid + r * SMP1_THREADS;
        x[r] = ninf;
        if (j < rows) {
            const float v = smp_clean(raw[r]);
            x[r] = pen && (sm.bitmap[j >> 5] >> (j & 31)) & 1u ? smp_penalise(v, s.penalty) : v;
            mx = fmaxf(mx, x[r]);
        }
    }
    // The fast attempt (below) is decided here, so that where it cuts below the LM head's
    // maximum, that maximum and this CTA's are found together.
    const bool attempt = !draw_all && (fast == 2 || (fast == 1 && h > 0.f && s.top_k == 0));
    const bool lm_cut = attempt && n_lm_max > 0 && !pen;
    float gm = ninf;
    if (lm_cut) {
        gm = tid < n_lm_max ? smp_clean(__uint_as_float((smp_u32)lm_word)) : ninf;
        smp1_max2(mx, gm, sm, sm1.wmax, tid);
    } else {
        mx = smp_block_max(mx, sm, tid, nthreads, sync);
    }
    SMP_STAMP(1);
    double best = -__longlong_as_double(0x7ff0000000000000ll);
    smp_u32 best_idx = SMP_NONE;
    if (draw_all) {
#pragma unroll
        for (int r = 0; r < SMP1_PER; r++) {
            const int j = tid + r * SMP1_THREADS;
            if (j < rows && x[r] != ninf) {
                const double sc = s.temperature == 0.f ? (double)x[r]
                                                       : (double)x[r] / (double)s.temperature +
                                                             smp_gumbel(s.seed_lo, s.seed_hi, m.pos, base + j);
                smp_best_merge(best, best_idx, sc, base + j);
            }
        }
        smp_block_best(best, best_idx, sm, tid, nthreads, sync);
    }
    // The softmax sum in smp_block_part's order, so the two kernels' sums are bit-identical.
    double z = 0.0;
    if (!draw_all && s.top_p < 1.f && s.top_k == 0) {
#pragma unroll
        for (int r = 0; r < SMP1_PER; r++)
            if (tid + r * SMP1_THREADS < rows) z += exp((double)x[r] - (double)mx);
        z = smp_block_sum(z, sm, tid, nthreads, sync);
    }
    smp_u32 count = 0;
    smp_u64 c[SMP1_PER];
    if (!draw_all) {
#pragma unroll
        for (int r = 0; r < SMP1_PER; r++) {
            const int j = tid + r * SMP1_THREADS;
            c[r] = j < rows ? (smp_u64)smp_key(x[r]) << 32 | (smp_u32)~(base + j) : 0ull;
        }
    }
    smp_u64* out = keys + (size_t)blockIdx.x * SMP1_CAP;
    const smp_u32 k = s.top_k > 0 ? s.top_k : SMP_KMAX;

    // ---- the fast attempt: this CTA's keys within the hint of the global maximum ----
    // Not with top-k: its searches stop early (k keys, not 128), so the grid-wide wait costs
    // more than they do (on the H100, SmolLM2's vocabulary with top-k 40 drew 3 µs slower
    // alone with the attempt, and decoding the default model was level).
    smp_u32 verdict = 0;  // the attempt's (SMP1_VERDICT_*), where one is made
    if (attempt) {
        const float delta = fast == 2 ? 0.f : h;
        // Every CTA cuts at the same logit, below the vocabulary's maximum, so that their keys
        // together are exactly those at or above it. That maximum is the LM head's (lm_max)
        // where it is given and no penalty lowers a logit; else every CTA's own maximum is
        // shared first (a grid-wide wait): each CTA writes its own, tagged with this attempt's
        // tag, and thread b waits for CTA b's.
        if (!lm_cut) {
            smp_u32* maxima = gate + SMP1_GATE_MAXIMA;
            if (tid == 0) smp1_st_tagged(maxima + 2 * blockIdx.x, tag, __float_as_uint(mx));
            gm = smp_block_max(tid < nb ? __uint_as_float(smp1_wait_tagged(maxima + 2 * tid, tag)) : ninf, sm, tid,
                               nthreads, sync);
        }
        SMP_STAMP(2);
        const smp_u64 tk = (smp_u64)smp_key(gm - delta) << 32;
        smp_u32 mine = 0;
#pragma unroll
        for (int r = 0; r < SMP1_PER; r++) mine += c[r] >= tk;
        mine = __reduce_add_sync(0xffffffffu, mine);
        if ((tid & 31) == 0 && mine != 0) atomicAdd(&sm1.fcount, mine);
        // With top-p alone, the CTA's top token goes in its summary (best_idx) for the last
        // CTA's smp_top_dominates.
        const bool need_z = s.top_p < 1.f && s.top_k == 0;
        if (need_z) {
            smp_u32 t = SMP_NONE;
#pragma unroll
            for (int r = 0; r < SMP1_PER; r++) {
                const int j = tid + r * SMP1_THREADS;
                if (j < rows && x[r] == mx) t = min(t, base + j);
            }
            t = __reduce_min_sync(0xffffffffu, t);
            if ((tid & 31) == 0 && t != SMP_NONE) atomicMin(&sm1.top, t);
        }
        __syncthreads();
        const smp_u32 fcount = sm1.fcount;
        // The summary and the keys, then the arrival (smp1_arrive).
        if (tid == 0) {
            SmpBlock b;
            b.sumexp = z; b.best = best; b.max = mx; b.best_idx = need_z ? sm1.top : best_idx;
            b.pad[0] = fcount <= SMP1_CAP ? fcount : 0; b.pad[1] = fcount <= SMP1_CAP ? 0 : SMP1_OVER;
            blocks[blockIdx.x] = b;
        }
        if (fcount <= SMP1_CAP) {
            smp_emit(c, [&](smp_u64 key) { return key >= tk; }, [&](smp_u32 slot, smp_u64 key) { out[slot] = key; },
                     sm1.sel, tid);
            for (int i = fcount + tid; i < SMP1_CAP; i += nthreads) out[i] = 0;
        }
        __syncthreads();
        SMP_STAMP(3);
        if (tid == 0) sm1.last = smp1_arrive(gate + SMP1_GATE_ARRIVE) == (smp_u32)nb - 1;
        __syncthreads();
        SMP_STAMP(4);
        if (sm1.last) {
            if (tid == 0) { gate[SMP1_GATE_ARRIVE] = 0; sm1.sel.fill = 0; }
            // One round trip: every block's summary, and the first u key slots of every block
            // (slots past a block's count hold 0), which hold every key unless a block has more.
            const int u = min(SMP1_CAP, SMP1_FIRST_PER * SMP1_THREADS / nb);
            SmpBlock blk;
            blk.max = ninf;
            blk.sumexp = 0.0;
            blk.pad[0] = 0;
            smp_u32 over = 0;
            if (tid < nb) {
                blk = smp1_load_block(blocks + tid);
                over = __ldcg(&blocks[tid].pad[1]);
            }
            smp_u64 cf[SMP1_FIRST_PER];
#pragma unroll
            for (int r = 0; r < SMP1_FIRST_PER; r++) {
                const int i = tid + r * SMP1_THREADS, b = i / u;
                cf[r] = b < nb ? __ldcg(keys + (size_t)b * SMP1_CAP + i % u) : 0ull;
            }
            for (int i = tid; i < SMP_BINS; i += SMP1_THREADS) { sm1.sel.hist[0][i] = 0; sm1.sel.hist[1][i] = 0; }
            if (tid == 0) sm1.bn.nsel = ~0u;
            SMP_MSTAMP(0);
            // The summaries' maximum, number of keys, most keys in a block, overflow flags and
            // top token: one barrier.
            {
                float wm = blk.max;
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) wm = fmaxf(wm, __shfl_xor_sync(0xffffffffu, wm, o));
                const smp_u32 wk = __reduce_add_sync(0xffffffffu, blk.pad[0]);
                const smp_u32 wu = __reduce_max_sync(0xffffffffu, blk.pad[0]);
                const smp_u32 wo = __reduce_or_sync(0xffffffffu, over);
                const smp_u32 wt = __reduce_min_sync(0xffffffffu, tid < nb && blk.max == wm ? blk.best_idx : SMP_NONE);
                if ((tid & 31) == 0) {
                    sm1.wmax[tid >> 5] = wm; sm1.wkeys[tid >> 5] = wk; sm1.wused[tid >> 5] = wu; sm1.wover[tid >> 5] = wo;
                    sm1.wtop[tid >> 5] = wt;
                }
            }
            __syncthreads();
            float gmax = ninf;
            smp_u32 nkeys = 0, used = 0, any_over = 0;
            for (int w = 0; w < SMP1_THREADS / 32; w++) {
                gmax = fmaxf(gmax, sm1.wmax[w]);
                nkeys += sm1.wkeys[w];
                used = max(used, sm1.wused[w]);
                any_over |= sm1.wover[w];
            }
            SMP_MSTAMP(1);
            smp_u32 token = SMP_NONE;
            bool merged = any_over != 0, binned = false, top_only = false;
            // The binned merge's first part (left to its caller: each key counted in its bin,
            // the softmax sum's warp parts) behind one barrier, then the test whether the top
            // token alone decides the draw (smp_top_dominates: then no merge at all, whatever
            // the keys), then the rest of the binned merge, or the long one.
            const SmpBins bins = smp_bins(gmax, gm - delta);
            const bool binnable = any_over == 0 && used <= (smp_u32)u && bins.valid;
            if (binnable) smp_bins_count(cf, bins, sm1.sel.hist[0]);
            if (need_z) {
                double zt = tid < nb && blk.max != ninf ? blk.sumexp * exp((double)blk.max - (double)gmax) : 0.0;
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) zt += __shfl_xor_sync(0xffffffffu, zt, o);
                if ((tid & 31) == 0) sm.redd[tid >> 5] = zt;
            }
            __syncthreads();
            double z_all = 0.0;
            if (need_z)
                for (int w = 0; w < SMP1_THREADS / 32; w++) z_all += sm.redd[w];
            // (Where a block was past its slots and the top token does not decide, no merge
            // either: the searches below.)
            if (smp_top_dominates(s, gmax, z_all)) {
                token = smp_top_of_warps(sm1.wmax, sm1.wtop, SMP1_THREADS / 32, gmax);
                merged = top_only = true;
            } else if (binnable) {
                merged = binned = smp_merge_binned_counted<SMP1_THREADS>(s, m.pos, cf, nkeys, bins, z_all, sm, sm1.sel,
                                                                         sm1.bn, tid, sync, token);
            }
            (void)binned;
            if (!merged) {
                token = smp1_merge_and_draw(s, m, blocks, keys, nb, (int)used, sm1, tid, gmax);
                if (tid == 0) gate[SMP1_GATE_LONG_MERGES] += 1;
            }
            SMP_MSTAMP(4);
            SMP_STAMP(5);
            if (tid == 0) {
                // A draw by the top token alone leaves the hint as it was.
                const bool drawn = top_only || (!any_over && smp_attempt_complete(s, sm, gm - delta));
                if (drawn) {
                    smp_store_token(m, token, history, meta_out);
                    if (!top_only) leave_hint(gmax);
                } else {
                    gate[SMP1_GATE_FALLBACKS] += 1;  // the merge after the searches leaves the hint
                }
                sm1.verdict = drawn ? SMP1_VERDICT_DRAWN : any_over ? SMP1_VERDICT_OVERFLOW : SMP1_VERDICT_SEARCH;
                smp1_st_tagged(gate + SMP1_GATE_VERDICT, tag, sm1.verdict);
                *(volatile smp_u32*)(gate + SMP1_GATE_ATTEMPTS) = tag;
            }
            SMP_STAMP(6);
#if SMP_PROF
            if (tid == 0) smp_prof_print(pt, m.pos, 1, sm1.verdict, binned);
#endif
            __syncthreads();
            verdict = sm1.verdict;
        } else {
            if (tid == 0) sm1.verdict = smp1_wait_tagged(gate + SMP1_GATE_VERDICT, tag);
            __syncthreads();
            verdict = sm1.verdict;
        }
        if (verdict == SMP1_VERDICT_DRAWN) return;
        if (tid == 0) sm1.sel.fill = 0;
        __syncthreads();
    }

    // ---- the searches: this CTA's top k and more, by radix passes ----
    if (!draw_all) {
        const smp_u64 t = smp_threshold<SMP1_THREADS>(c, rows, k, SMP1_CAP, sm1.sel, tid, sync, count);
        smp_emit(c, [&](smp_u64 key) { return key >= t; }, [&](smp_u32 slot, smp_u64 key) { out[slot] = key; }, sm1.sel, tid);
        for (int i = count + tid; i < SMP1_CAP; i += nthreads) out[i] = 0;
    }
    if (tid == 0) {
        SmpBlock b;
        b.sumexp = z; b.best = best; b.max = mx; b.best_idx = best_idx; b.pad[0] = count; b.pad[1] = 0;
        blocks[blockIdx.x] = b;
    }

    // ---- the last CTA to finish draws ----
    __threadfence();
    __syncthreads();
    SMP_STAMP(3);
    if (tid == 0) sm1.last = atomicAdd(done, 1u) == (smp_u32)nb - 1;
    __syncthreads();
    SMP_STAMP(4);
    if (!sm1.last) return;
    __threadfence();
    if (tid == 0) { *done = 0; sm1.sel.fill = 0; }

    smp_u32 token;
    if (draw_all) {
        best = -__longlong_as_double(0x7ff0000000000000ll);
        best_idx = SMP_NONE;
        for (int b = tid; b < nb; b += nthreads) {
            const SmpBlock blk = smp1_load_block(blocks + b);
            if (blk.best_idx != SMP_NONE) smp_best_merge(best, best_idx, blk.best, blk.best_idx);
        }
        smp_block_best(best, best_idx, sm, tid, nthreads, sync);
        token = best_idx;
    } else {
        float gmax;
        token = smp1_merge_and_draw(s, m, blocks, keys, nb, SMP1_CAP, sm1, tid, gmax);
        if (tid == 0 && fast) leave_hint(gmax);
    }
    SMP_STAMP(5);
    if (tid == 0) smp_store_token(m, token, history, meta_out);
#if SMP_PROF
    SMP_STAMP(6);
    if (tid == 0) smp_prof_print(pt, m.pos, 0, 0, false);
#endif
}

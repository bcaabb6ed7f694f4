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

#define SMP1_THREADS 512
#define SMP1_PER (SMP_CHUNK / SMP1_THREADS)  // rows a thread holds
#define SMP1_CAP 160                          // key slots per block (>= SMP_KMAX)
#define SMP1_FINAL_PER 24                     // slots a thread of the last CTA holds: nb * SMP1_CAP <= 12288

struct Smp1Shared {
    SmpShared base;
    SmpSel sel;
    smp_u32 last;
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

// Grid: ceil(vocab / SMP_CHUNK) CTAs of SMP1_THREADS, at most 12288 / SMP1_CAP of them.
// blocks: a summary per CTA (pad[0]: its number of keys); keys: SMP1_CAP slots per CTA;
// done: a counter, 0 between launches. meta, history and meta_out as smp_final's.
extern "C" __global__ void __launch_bounds__(SMP1_THREADS, 1)
    smp_sample(const float* logits, int vocab, const SmpMeta* meta, smp_u32* history, const SmpParams* sp,
               SmpBlock* blocks, smp_u64* keys, smp_u32* done, SmpMeta* meta_out) {
    __shared__ Smp1Shared sm1;
    SmpShared& sm = sm1.base;
    smp_pdl_launch_next();
    smp_pdl_wait();
    const int tid = threadIdx.x, nb = gridDim.x, nthreads = SMP1_THREADS;
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
    const SmpParams s = *sp;
    const SmpMeta m = *meta;
    const float ninf = __int_as_float(0xff800000u);
    const bool draw_all = s.temperature == 0.f || !smp_truncates(s);
    if (tid == 0) sm1.sel.fill = 0;

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
    mx = smp_block_max(mx, sm, tid, nthreads, sync);
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
    if (!draw_all) {
        smp_u64 c[SMP1_PER];
#pragma unroll
        for (int r = 0; r < SMP1_PER; r++) {
            const int j = tid + r * SMP1_THREADS;
            c[r] = j < rows ? (smp_u64)smp_key(x[r]) << 32 | (smp_u32)~(base + j) : 0ull;
        }
        const smp_u32 k = s.top_k > 0 ? s.top_k : SMP_KMAX;
        const smp_u64 t = smp_threshold<SMP1_THREADS>(c, rows, k, SMP1_CAP, sm1.sel, tid, sync, count);
        smp_u64* out = keys + (size_t)blockIdx.x * SMP1_CAP;
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
    if (tid == 0) sm1.last = atomicAdd(done, 1u) == (smp_u32)nb - 1;
    __syncthreads();
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
        // The union of the blocks' keys, loaded first so that its latency overlaps the
        // reductions below (nb * SMP1_CAP <= SMP1_THREADS * SMP1_FINAL_PER: the host's check).
        smp_u64 c[SMP1_FINAL_PER];
        const int slots = nb * SMP1_CAP;
#pragma unroll
        for (int r = 0; r < SMP1_FINAL_PER; r++) {
            const int i = tid + r * SMP1_THREADS;
            c[r] = i < slots ? __ldcg(keys + i) : 0ull;
        }
        // As smp_final_part (one block a thread, nb <= SMP1_THREADS): the maximum, the number
        // of keys, and the softmax denominator for top-p without top-k.
        SmpBlock blk;
        blk.max = ninf;
        blk.sumexp = 0.0;
        blk.pad[0] = 0;
        if (tid < nb) blk = smp1_load_block(blocks + tid);
        const float gmax = smp_block_max(blk.max, sm, tid, nthreads, sync);
        const smp_u32 n = (smp_u32)smp_block_sum((double)blk.pad[0], sm, tid, nthreads, sync);
        double z_all = 0.0;
        if (s.top_p < 1.f && s.top_k == 0) {
            if (tid < nb && blk.max != ninf) z_all += blk.sumexp * exp((double)blk.max - (double)gmax);
            z_all = smp_block_sum(z_all, sm, tid, nthreads, sync);
        }
        // The global top k: exactly k keys of the union, then ranked (largest logit first,
        // equal logits lowest token first, as smp_final_part's sort).
        const smp_u32 k = s.top_k > 0 ? s.top_k : SMP_KMAX;
        smp_u32 kk;
        const smp_u64 t = smp_threshold<SMP1_THREADS>(c, n, k, 0, sm1.sel, tid, sync, kk);
        smp_emit(c, [&](smp_u64 key) { return key >= t; },
                  [&](smp_u32 slot, smp_u64 key) {
                      sm.cv[slot] = smp_unkey((smp_u32)(key >> 32));
                      sm.ci[slot] = ~(smp_u32)key;
                  },
                  sm1.sel, tid);
        __syncthreads();
        smp_rank<SMP1_THREADS>(kk, sm, tid, sync);
        token = smp_cut_and_draw(s, m.pos, z_all, sm, tid, nthreads, sync);
    }
    if (tid == 0) smp_store_token(m, token, history, meta_out);
}

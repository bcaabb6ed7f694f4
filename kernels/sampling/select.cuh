// The sampler's device functions, shared by its kernels (sample.cu, fused.cu). The rule is
// src/sampling/mod.rs's `sample_at`; see docs/sampling.md. Every function is run by `nthreads`
// threads (a multiple of 32, warp aligned) numbered `tid`, which `sync` makes wait for each
// other (__syncthreads in these kernels).
//
// Two parts:
// - smp_block_part: over one block of consecutive vocabulary rows, the penalised logits'
//   maximum, their softmax denominator relative to it, the block's best Gumbel-perturbed
//   score, and (when truncating) the block's top SMP_KMAX rows.
// - smp_final_part: over all blocks, the drawn token: the argmax of the blocks' best scores,
//   or, when truncating, the global top SMP_KMAX (exact: it is contained in the union of the
//   per-block top lists) cut by top-k, top-p and min-p, then the Gumbel-max among them.
// Both serve smp_blocks / smp_final (sample.cu); the fused kernel (fused.cu) uses the block
// reductions and smp_cut_and_draw, the cuts and the draw over the sorted candidates.

#define SMP_KMAX 128            // K_MAX in src/sampling/mod.rs
#define SMP_NONE 0xffffffffu    // index of an empty candidate slot
#define SMP_MAX_ROWS 4096       // rows one smp_block_part call may cover (its penalty bitmap)

typedef unsigned int smp_u32;
typedef unsigned long long smp_u64;

// As written by DeviceSampler::set_params (src/sampling/device.rs).
struct SmpParams {
    float temperature;  // 0: argmax of the penalised logits
    float top_p;        // 1: off
    float min_p;        // 0: off
    float penalty;      // repetition penalty; 1: off
    smp_u32 top_k;      // 0: off
    smp_u32 last_n;     // tokens the penalty looks back over (0: off)
    smp_u32 seed_lo, seed_hi;
};

// One block's summary.
struct SmpBlock {
    double sumexp;      // sum of exp(l - max) over the block (temperature 1, for top-p)
    double best;        // largest perturbed score l/T + g (or l when T = 0)
    float max;          // largest penalised logit
    smp_u32 best_idx;   // its token (the lower on a tie); SMP_NONE when every logit is -inf; in
                        // the fused sampler's first attempt with top-p alone, its top token
    smp_u32 pad[2];
};

// Shared-memory scratch of either part. Members never live at the same time share space, so
// that the megakernel's copy fits its MK_SMP_SCRATCH_BYTES.
struct SmpShared {
    union {
        smp_u32 hist[256];      // smp_radix_select's
        double ss[SMP_KMAX];    // after the sort: candidate j's draw score (smp_cut_and_draw)
    };
    smp_u32 sh[4];
    smp_u64 wt[32];
    double redd[32];
    smp_u32 redi[32];
    float redf[32];
    smp_u32 bitmap[SMP_MAX_ROWS / 32];
    union {
        struct {                // the candidates before the sort, in any order
            float cv[SMP_KMAX];
            smp_u32 ci[SMP_KMAX];
        };
        double sw[SMP_KMAX];    // after it: candidate j's top-p weight (smp_cut_and_draw)
    };
    float sv[SMP_KMAX];         // the sorted candidates
    smp_u32 si[SMP_KMAX];
    smp_u32 count;
};

__device__ __forceinline__ bool smp_truncates(const SmpParams& s) {
    return s.top_k > 0 || s.top_p < 1.f || s.min_p > 0.f;
}
__device__ __forceinline__ bool smp_penalises(const SmpParams& s) { return s.penalty != 1.f && s.last_n > 0; }

// NaN reads as -inf: it can never be drawn (the host does the same).
__device__ __forceinline__ float smp_clean(float x) {
    return (__float_as_uint(x) & 0x7fffffffu) > 0x7f800000u ? __int_as_float(0xff800000u) : x;
}

// llama.cpp's repetition penalty; the division correctly rounded despite fast math.
__device__ __forceinline__ float smp_penalise(float x, float r) { return x <= 0.f ? x * r : __fdiv_rn(x, r); }

// Unsigned key ordered like the float (no NaN): a larger logit has a larger key, and every
// real logit's key is above 0, the key of an empty slot.
__device__ __forceinline__ smp_u32 smp_key(float f) {
    const smp_u32 u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Larger score wins; on a tie the lower index (as on the host).
__device__ __forceinline__ void smp_best_merge(double& v, smp_u32& i, double v2, smp_u32 i2) {
    if (v2 > v || (v2 == v && i2 < i)) { v = v2; i = i2; }
}

// Inclusive prefix sum of v over a warp's lanes in lane order (lane: this thread's).
template <typename T>
__device__ __forceinline__ T smp_warp_scan(T v, int lane) {
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const T y = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += y;
    }
    return v;
}

// ---- block-wide reductions and scans (result in every thread) ----

template <typename Sync>
__device__ float smp_block_max(float v, SmpShared& sm, int tid, int nthreads, Sync sync) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if ((tid & 31) == 0) sm.redf[tid >> 5] = v;
    sync();
    v = sm.redf[0];
    for (int w = 1; w < (nthreads >> 5); w++) v = fmaxf(v, sm.redf[w]);
    sync();
    return v;
}

template <typename Sync>
__device__ double smp_block_sum(double v, SmpShared& sm, int tid, int nthreads, Sync sync) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if ((tid & 31) == 0) sm.redd[tid >> 5] = v;
    sync();
    v = 0.0;
    for (int w = 0; w < (nthreads >> 5); w++) v += sm.redd[w];
    sync();
    return v;
}

template <typename Sync>
__device__ void smp_block_best(double& v, smp_u32& idx, SmpShared& sm, int tid, int nthreads, Sync sync) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const double v2 = __shfl_xor_sync(0xffffffffu, v, o);
        const smp_u32 i2 = __shfl_xor_sync(0xffffffffu, idx, o);
        smp_best_merge(v, idx, v2, i2);
    }
    if ((tid & 31) == 0) { sm.redd[tid >> 5] = v; sm.redi[tid >> 5] = idx; }
    sync();
    v = sm.redd[0]; idx = sm.redi[0];
    for (int w = 1; w < (nthreads >> 5); w++) smp_best_merge(v, idx, sm.redd[w], sm.redi[w]);
    sync();
}

// Exclusive prefix sum of v over the threads in tid order.
template <typename Sync>
__device__ smp_u64 smp_block_scan(smp_u64 v, SmpShared& sm, int tid, int nthreads, Sync sync) {
    const int lane = tid & 31, w = tid >> 5;
    const smp_u64 x = smp_warp_scan(v, lane);
    if (lane == 31) sm.wt[w] = x;
    sync();
    smp_u64 base = 0;
    for (int k = 0; k < w; k++) base += sm.wt[k];
    sync();
    return base + x - v;
}

// The k-th largest of n keys (1 <= k <= n), by four 8-bit radix passes; `take_eq` is how many
// keys equal to it belong to the top k (the others of the top k are strictly larger).
template <typename KeyAt, typename Sync>
__device__ void smp_radix_select(KeyAt key_at, int n, smp_u32 k, SmpShared& sm, int tid, int nthreads, Sync sync,
                                 smp_u32& kth, smp_u32& take_eq) {
    smp_u32 prefix = 0, mask = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = tid; i < 256; i += nthreads) sm.hist[i] = 0;
        sync();
        for (int i = tid; i < n; i += nthreads) {
            const smp_u32 key = key_at(i);
            if ((key & mask) == prefix) atomicAdd(&sm.hist[(key >> shift) & 255u], 1u);
        }
        sync();
        if (tid < 32) {
            // Lane l owns bins 255 - 8l down to 248 - 8l: lanes in order walk the keys downwards.
            const int lane = tid;
            smp_u32 c[8], s = 0;
#pragma unroll
            for (int j = 0; j < 8; j++) { c[j] = sm.hist[255 - 8 * lane - j]; s += c[j]; }
            const smp_u32 incl = smp_warp_scan(s, lane);
            smp_u32 above = incl - s;
            if (above < k && k <= incl) {
                for (int j = 0; j < 8; j++) {
                    if (k <= above + c[j]) {
                        sm.sh[0] = 255 - 8 * lane - j;
                        sm.sh[1] = k - above;
                        break;
                    }
                    above += c[j];
                }
            }
        }
        sync();
        prefix |= sm.sh[0] << shift;
        mask |= 0xffu << shift;
        k = sm.sh[1];
    }
    kth = prefix;
    take_eq = k;
}

// Emits the top k of n keys (as found by smp_radix_select) in index order: emit(slot, i) for
// slots 0..k-1. Equal keys at the boundary are taken lowest index first. Each thread takes a
// contiguous run of the keys, so one scan gives every thread its first slot.
template <typename KeyAt, typename Emit, typename Sync>
__device__ void smp_compact_top(KeyAt key_at, int n, smp_u32 kth, smp_u32 take_eq, Emit emit, SmpShared& sm, int tid,
                                int nthreads, Sync sync) {
    const int per = (n + nthreads - 1) / nthreads, lo = min(n, tid * per), hi = min(n, lo + per);
    smp_u32 gt = 0, eq = 0;
    for (int i = lo; i < hi; i++) {
        const smp_u32 key = key_at(i);
        gt += key > kth;
        eq += key == kth;
    }
    const smp_u64 pre = smp_block_scan(((smp_u64)eq << 32) | gt, sm, tid, nthreads, sync);
    smp_u32 eq_seen = (smp_u32)(pre >> 32);
    smp_u32 slot = (smp_u32)pre + min(eq_seen, take_eq);
    for (int i = lo; i < hi; i++) {
        const smp_u32 key = key_at(i);
        if (key > kth) {
            emit(slot++, i);
        } else if (key == kth) {
            if (eq_seen < take_eq) emit(slot++, i);
            eq_seen++;
        }
    }
}

// ---- a threshold over 64-bit keys held in registers ----
// Keys: the order-preserving key of the (penalised) logit above, the inverted token id below.
// They are distinct, and a larger key is a larger logit or an equal logit at a lower token:
// the rule's own order, so ties need no special case. 0 is an empty slot.

// The logit a key's upper half stands for (smp_key inverted).
__device__ __forceinline__ float smp_unkey(smp_u32 k) {
    return __uint_as_float((k & 0x80000000u) ? (k ^ 0x80000000u) : ~k);
}

struct SmpSel {
    smp_u32 hist[2][256];
    smp_u64 key;
    smp_u32 above, stop, count;
    smp_u32 fill;  // emit's slot counter: 0 before smp_emit
};

// A threshold t over the nonzero keys a thread visits with for_keys(f) (f(key) for each, 0 for
// none; every lane of a warp makes the same number of calls), n nonzero keys over the NT
// threads: with kk = min(k, n), at least kk and at most max(limit, kk) keys are >= t. Each
// 8-bit pass counts the digits of the keys still in question (warp-aggregated: one shared
// atomic per distinct digit in a warp, since keys share their leading bits) and stops as soon
// as the keys at or above the digit holding the kk-th key are few enough; keys are distinct,
// so the last pass leaves exactly kk. Returns t, and that count in `count` (in every thread).
template <int NT, typename ForKeys, typename Sync>
__device__ smp_u64 smp_threshold_by(ForKeys for_keys, smp_u32 n, smp_u32 k, smp_u32 limit, SmpSel& sm, int tid,
                                    Sync sync, smp_u32& count) {
    const smp_u32 kk = min(n, k), lim = max(limit, kk);
    if (n <= lim) {
        count = n;
        return 1;
    }
    const int lane = tid & 31;
    for (int i = tid; i < 256; i += NT) { sm.hist[0][i] = 0; sm.hist[1][i] = 0; }
    sync();
    smp_u64 prefix = 0;
    smp_u32 above = 0;
    for (int pass = 0, shift = 56; shift >= 0; pass++, shift -= 8) {
        smp_u32* h = sm.hist[pass & 1];
        const smp_u64 hi = shift == 56 ? 0ull : ~0ull << (shift + 8);
        for_keys([&](smp_u64 key) {
            const bool in = key != 0 && (key & hi) == prefix;
            if (__any_sync(0xffffffffu, in)) {
                const smp_u32 d = in ? (smp_u32)(key >> shift) & 255u : 256u;
                const smp_u32 peers = __match_any_sync(0xffffffffu, d);
                if (in && __ffs(peers) - 1 == lane) atomicAdd(&h[d], __popc(peers));
            }
        });
        // The other histogram, read by the previous pass, is cleared for the next.
        for (int i = tid; i < 256; i += NT) sm.hist[(pass + 1) & 1][i] = 0;
        sync();
        if (tid < 32) {
            // Lane l owns digits 255 - 8l down to 248 - 8l: lanes in order walk the keys downwards.
            smp_u32 cnt[8], sum = 0;
#pragma unroll
            for (int j = 0; j < 8; j++) { cnt[j] = h[255 - 8 * lane - j]; sum += cnt[j]; }
            const smp_u32 incl = smp_warp_scan(sum, lane);
            smp_u32 ge = above + incl - sum;  // keys above this lane's digits
            if (ge < kk && kk <= above + incl) {
                for (int j = 0; j < 8; j++) {
                    ge += cnt[j];
                    if (kk <= ge) {
                        sm.key = prefix | ((smp_u64)(255 - 8 * lane - j) << shift);
                        sm.stop = ge <= lim;
                        sm.count = ge;
                        sm.above = ge - cnt[j];
                        break;
                    }
                }
            }
        }
        sync();
        prefix = sm.key;
        above = sm.above;
        if (sm.stop) break;
    }
    count = sm.count;
    return prefix;
}

// The same over keys c[] held in registers, R a thread.
template <int NT, int R, typename Sync>
__device__ smp_u64 smp_threshold(const smp_u64 (&c)[R], smp_u32 n, smp_u32 k, smp_u32 limit, SmpSel& sm, int tid,
                                 Sync sync, smp_u32& count) {
    return smp_threshold_by<NT>(
        [&](auto f) {
#pragma unroll
            for (int r = 0; r < R; r++) f(c[r]);
        },
        n, k, limit, sm, tid, sync, count);
}

// The nonzero keys a thread visits with for_keys (as smp_threshold_by's, visited twice) that
// pass `take` go out through put(slot, key), slots 0, 1, ... from sm.fill on, in some order.
// Whole warps call it (slots are taken a warp at a time).
template <typename ForKeys, typename Take, typename Put>
__device__ void smp_emit_by(ForKeys for_keys, Take take, Put put, SmpSel& sm, int tid) {
    const int lane = tid & 31;
    smp_u32 e = 0;
    for_keys([&](smp_u64 key) { e += key != 0 && take(key); });
    const smp_u32 incl = smp_warp_scan(e, lane);
    smp_u32 base = 0;
    if (lane == 31 && incl > 0) base = atomicAdd(&sm.fill, incl);
    smp_u32 slot = __shfl_sync(0xffffffffu, base, 31) + incl - e;
    for_keys([&](smp_u64 key) {
        if (key != 0 && take(key)) put(slot++, key);
    });
}

// The same over keys c[] held in registers.
template <int R, typename Take, typename Put>
__device__ void smp_emit(const smp_u64 (&c)[R], Take take, Put put, SmpSel& sm, int tid) {
    smp_emit_by(
        [&](auto f) {
#pragma unroll
            for (int r = 0; r < R; r++) f(c[r]);
        },
        take, put, sm, tid);
}

// The kk candidates in sm.cv / sm.ci (any order) sorted into sm.sv / sm.si (largest logit
// first, equal logits lowest token first, as smp_final_part's sort), four threads ranking
// each; sm.count = kk. NT >= 4 * kk.
template <int NT, typename Sync>
__device__ void smp_rank(smp_u32 kk, SmpShared& sm, int tid, Sync sync) {
    for (int item0 = 0; item0 < (int)kk; item0 += NT / 4) {
        const int item = item0 + (tid >> 2), part = tid & 3;
        float v = 0.f;
        smp_u32 vi = 0;
        int rank = 0;
        if (item < (int)kk) {
            v = sm.cv[item];
            vi = sm.ci[item];
            for (int q = part; q < (int)kk; q += 4) rank += sm.cv[q] > v || (sm.cv[q] == v && sm.ci[q] < vi);
        }
        rank += __shfl_xor_sync(0xffffffffu, rank, 1);
        rank += __shfl_xor_sync(0xffffffffu, rank, 2);
        if (item < (int)kk && part == 0) { sm.sv[rank] = v; sm.si[rank] = vi; }
    }
    if (tid == 0) sm.count = kk;
    sync();
}

// ---- the per-block part ----
// Rows base .. base + rows - 1 (rows <= SMP_MAX_ROWS) with raw logits raw_at(j), j < rows.
// The step fed `token` at `pos`; history[q] is the token at position q < pos. Writes the
// block's summary through put_block (called by thread 0) and, when truncating at T > 0, its
// top min(rows, SMP_KMAX) rows through put_cand(slot, value, index) for every slot < SMP_KMAX
// (empty slots get index SMP_NONE).
template <typename RawAt, typename PutBlock, typename PutCand, typename Sync>
__device__ void smp_block_part(RawAt raw_at, smp_u32 base, int rows, const SmpParams& s, smp_u32 pos, smp_u32 token,
                               const smp_u32* history, PutBlock put_block, PutCand put_cand, SmpShared& sm, int tid,
                               int nthreads, Sync sync) {
    const bool pen = smp_penalises(s);
    if (pen) {
        for (int w = tid; w < (rows + 31) / 32; w += nthreads) sm.bitmap[w] = 0;
        sync();
        const smp_u32 first = pos + 1 > s.last_n ? pos + 1 - s.last_n : 0;
        for (smp_u32 q = first + tid; q <= pos; q += nthreads) {
            const smp_u32 j = (q == pos ? token : history[q]) - base;
            if (j < (smp_u32)rows) atomicOr(&sm.bitmap[j >> 5], 1u << (j & 31));
        }
        sync();
    }
    auto val = [&](int j) {
        const float x = smp_clean(raw_at(j));
        return pen && (sm.bitmap[j >> 5] >> (j & 31)) & 1u ? smp_penalise(x, s.penalty) : x;
    };
    const bool draw_all = s.temperature == 0.f || !smp_truncates(s);
    float mx = __int_as_float(0xff800000u);
    double best = -__longlong_as_double(0x7ff0000000000000ll);
    smp_u32 best_idx = SMP_NONE;
    for (int j = tid; j < rows; j += nthreads) {
        const float x = val(j);
        mx = fmaxf(mx, x);
        if (draw_all && x != __int_as_float(0xff800000u)) {
            const double sc = s.temperature == 0.f
                                  ? (double)x
                                  : (double)x / (double)s.temperature + smp_gumbel(s.seed_lo, s.seed_hi, pos, base + j);
            smp_best_merge(best, best_idx, sc, base + j);
        }
    }
    mx = smp_block_max(mx, sm, tid, nthreads, sync);
    if (draw_all) smp_block_best(best, best_idx, sm, tid, nthreads, sync);
    double z = 0.0;
    if (!draw_all && s.top_p < 1.f && s.top_k == 0) {
        for (int j = tid; j < rows; j += nthreads) z += exp((double)val(j) - (double)mx);
        z = smp_block_sum(z, sm, tid, nthreads, sync);
    }
    if (tid == 0) {
        SmpBlock b;
        b.sumexp = z; b.best = best; b.max = mx; b.best_idx = best_idx; b.pad[0] = b.pad[1] = 0;
        put_block(b);
    }
    if (draw_all) return;
    const smp_u32 k = min(rows, SMP_KMAX);
    auto key_at = [&](int j) { return smp_key(val(j)); };
    smp_u32 kth, take_eq;
    smp_radix_select(key_at, rows, k, sm, tid, nthreads, sync, kth, take_eq);
    smp_compact_top(key_at, rows, kth, take_eq, [&](smp_u32 slot, int j) { put_cand(slot, val(j), base + j); }, sm, tid,
                    nthreads, sync);
    for (int slot = k + tid; slot < SMP_KMAX; slot += nthreads) put_cand(slot, __uint_as_float(0xffffffffu), SMP_NONE);
}

// ---- the cuts and the draw ----
// Candidate j's top-p weight exp(sv[j] - sv[0]) and its Gumbel-perturbed score.
__device__ __forceinline__ double smp_topp_weight(const SmpShared& sm, int j, double top) {
    return exp((double)sm.sv[j] - top);
}
__device__ __forceinline__ double smp_draw_score(const SmpParams& s, smp_u32 pos, const SmpShared& sm, int j, smp_u32 i) {
    return (double)sm.sv[j] / (double)s.temperature + smp_gumbel(s.seed_lo, s.seed_hi, pos, i);
}
// The warp part of smp_cut_and_draw: the cuts and the Gumbel-max over the sorted candidates
// (sm.sv / sm.si, sm.count of them), whose scores (sm.ss, a candidate's smp_draw_score) and,
// with top-p, weights (sm.sw, smp_topp_weight against sm.sv[0]) are in place for every
// candidate top-k keeps. By warp 0 (other threads return SMP_NONE); the token in its lanes.
__device__ smp_u32 smp_cut_warp(const SmpParams& s, double z_all, SmpShared& sm, int tid) {
    if (tid >= 32) return SMP_NONE;
    const int count = sm.count;
    int keep = count;
    if (s.top_k > 0) keep = min(keep, (int)s.top_k);
    const double top = count > 0 ? (double)sm.sv[0] : 0.0;
    // The cuts, each a prefix of the sorted list; lane l holds entries 4l .. 4l + 3, whose
    // scores it reads before the cuts, so that the draw after them waits for no read.
    const int lane = tid;
    double sc[SMP_KMAX / 32];
    smp_u32 ix[SMP_KMAX / 32];
#pragma unroll
    for (int q = 0; q < SMP_KMAX / 32; q++) {
        const int j = lane * (SMP_KMAX / 32) + q;
        sc[q] = j < keep ? sm.ss[j] : 0.0;
        ix[q] = j < keep ? sm.si[j] : SMP_NONE;
    }
    if (s.top_p < 1.f && count > 0) {
        double w[SMP_KMAX / 32], local = 0.0;
#pragma unroll
        for (int q = 0; q < SMP_KMAX / 32; q++) {
            const int j = lane * (SMP_KMAX / 32) + q;
            w[q] = j < keep ? sm.sw[j] : 0.0;
            local += w[q];
        }
        const double incl = smp_warp_scan(local, lane);
        const double z = s.top_k > 0 ? __shfl_sync(0xffffffffu, incl, 31) : z_all;
        // The cumulative masses' quotients, each computed (they do not depend on each other),
        // then the first that reaches top-p.
        double acc = incl - local;
        bool reached[SMP_KMAX / 32];
#pragma unroll
        for (int q = 0; q < SMP_KMAX / 32; q++) {
            acc += w[q];
            reached[q] = acc / z >= (double)s.top_p;
        }
        int cut = SMP_KMAX + 1;
#pragma unroll
        for (int q = 0; q < SMP_KMAX / 32; q++) {
            const int j = lane * (SMP_KMAX / 32) + q;
            if (j < keep && cut > SMP_KMAX && reached[q]) cut = j + 1;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) cut = min(cut, __shfl_xor_sync(0xffffffffu, cut, o));
        keep = min(keep, cut);
        if (lane == 0) sm.sh[2] = cut <= SMP_KMAX;
    } else if (lane == 0) {
        sm.sh[2] = 0;
    }
    if (lane == 0) sm.sh[1] = keep;
    if (s.min_p > 0.f && count > 0) {
        const double floor = top + log((double)s.min_p);
        int below = SMP_KMAX + 1;
#pragma unroll
        for (int q = 0; q < SMP_KMAX / 32; q++) {
            const int j = lane * (SMP_KMAX / 32) + q;
            if (j < keep && (double)sm.sv[j] < floor) below = min(below, j);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) below = min(below, __shfl_xor_sync(0xffffffffu, below, o));
        keep = max(1, min(keep, below));
    }
    if (lane == 0) sm.sh[3] = keep;
    double best = -__longlong_as_double(0x7ff0000000000000ll);
    smp_u32 idx = SMP_NONE;
#pragma unroll
    for (int q = 0; q < SMP_KMAX / 32; q++)
        if (lane * (SMP_KMAX / 32) + q < keep) smp_best_merge(best, idx, sc[q], ix[q]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const double v2 = __shfl_xor_sync(0xffffffffu, best, o);
        const smp_u32 i2 = __shfl_xor_sync(0xffffffffu, idx, o);
        smp_best_merge(best, idx, v2, i2);
    }
    return idx;
}

// Over the sorted candidates sm.sv / sm.si (sm.count of them, largest first, equal values
// lowest index first), at T != 0: top-k, top-p (against z_all, the softmax denominator over
// the whole vocabulary relative to sm.sv[0], when top-k is off) and min-p, each a prefix of
// the list, then the Gumbel-max among what is left. Run by all nthreads threads (any number,
// a multiple of 32) after the barrier that ends the sort; returns the token in threads
// 0 .. 31. Its sm.ss and sm.sw take the place of sm.hist and sm.cv / sm.ci.
//
// Every candidate top-k keeps first gets its score (and, with top-p, its weight) in sm.ss
// (sm.sw), a thread each: a score is a Philox draw and two double-precision logs, which the
// one warp that makes the cuts would otherwise compute four a lane, one after the other. That
// warp reads them back and adds them in its own fixed order, so the token does not depend on
// which thread computed which term. Lane 0 leaves how the cuts ended, for the fused sampler's
// check that the candidates it was given decided them: in sm.sh[1] the candidates top-k and
// top-p kept, in sm.sh[2] whether the top-p cut fell inside the list, in sm.sh[3] the
// candidates kept in the end (after min-p).
template <typename Sync>
__device__ smp_u32 smp_cut_and_draw(const SmpParams& s, smp_u32 pos, double z_all, SmpShared& sm, int tid,
                                    int nthreads, Sync sync) {
    const int count = sm.count;
    int keep = count;
    if (s.top_k > 0) keep = min(keep, (int)s.top_k);
    const double top = count > 0 ? (double)sm.sv[0] : 0.0;
    // Scores by threads 0 .. SMP_KMAX - 1, weights by the next SMP_KMAX (fewer threads loop).
    for (int t = tid; t < (s.top_p < 1.f ? 2 * SMP_KMAX : SMP_KMAX); t += nthreads) {
        const int j = t % SMP_KMAX;
        if (j >= keep) continue;
        if (t < SMP_KMAX) sm.ss[j] = smp_draw_score(s, pos, sm, j, sm.si[j]);
        else sm.sw[j] = smp_topp_weight(sm, j, top);
    }
    sync();
    return smp_cut_warp(s, z_all, sm, tid);
}

// ---- the final part ----
// Over nb blocks: block b's summary get_block(b); when truncating, candidate i (of
// nb * SMP_KMAX, block after block) as cand_val(i), cand_idx(i). Returns the drawn token in
// thread 0 (SMP_NONE when there is nothing to draw from: every logit -inf or NaN).
template <typename GetBlock, typename CandVal, typename CandIdx, typename Sync>
__device__ smp_u32 smp_final_part(GetBlock get_block, int nb, CandVal cand_val, CandIdx cand_idx, const SmpParams& s,
                                  smp_u32 pos, SmpShared& sm, int tid, int nthreads, Sync sync) {
    const bool draw_all = s.temperature == 0.f || !smp_truncates(s);
    if (draw_all) {
        double best = -__longlong_as_double(0x7ff0000000000000ll);
        smp_u32 idx = SMP_NONE;
        for (int b = tid; b < nb; b += nthreads) {
            const SmpBlock blk = get_block(b);
            if (blk.best_idx != SMP_NONE) smp_best_merge(best, idx, blk.best, blk.best_idx);
        }
        smp_block_best(best, idx, sm, tid, nthreads, sync);
        return idx;
    }
    // The softmax denominator over the whole vocabulary, for top-p without top-k.
    const bool need_z = s.top_p < 1.f && s.top_k == 0;
    float gmax = __int_as_float(0xff800000u);
    for (int b = tid; b < nb; b += nthreads) gmax = fmaxf(gmax, get_block(b).max);
    gmax = smp_block_max(gmax, sm, tid, nthreads, sync);
    double z_all = 0.0;
    if (need_z) {
        for (int b = tid; b < nb; b += nthreads) {
            const SmpBlock blk = get_block(b);
            if (blk.max != __int_as_float(0xff800000u)) z_all += blk.sumexp * exp((double)blk.max - (double)gmax);
        }
        z_all = smp_block_sum(z_all, sm, tid, nthreads, sync);
    }
    // The global top SMP_KMAX among the blocks' lists, in index order, then sorted.
    const int n = nb * SMP_KMAX;
    const smp_u32 k = min(n, SMP_KMAX);
    auto key_at = [&](int i) { return cand_idx(i) == SMP_NONE ? 0u : smp_key(cand_val(i)); };
    smp_u32 kth, take_eq;
    smp_radix_select(key_at, n, k, sm, tid, nthreads, sync, kth, take_eq);
    if (tid == 0) sm.count = 0;
    smp_compact_top(key_at, n, kth, take_eq, [&](smp_u32 slot, int i) { sm.cv[slot] = cand_val(i); sm.ci[slot] = cand_idx(i); },
                    sm, tid, nthreads, sync);
    sync();
    for (int j = tid; j < (int)k; j += nthreads) {
        if (sm.ci[j] == SMP_NONE) continue;
        const float v = sm.cv[j];
        const smp_u32 i = sm.ci[j];
        int rank = 0;
        for (int m = 0; m < (int)k; m++)
            if (sm.ci[m] != SMP_NONE && (sm.cv[m] > v || (sm.cv[m] == v && sm.ci[m] < i))) rank++;
        sm.sv[rank] = v;
        sm.si[rank] = i;
        atomicAdd(&sm.count, 1u);
    }
    sync();
    const smp_u32 token = smp_cut_and_draw(s, pos, z_all, sm, tid, nthreads, sync);
    sync();
    return token;
}

// ---- the fast attempt's merge (fused.cu, and the megakernel's draw inside its launch) ----
// A draw that first tries with the keys within a hint of the maximum (the attempt: every
// block sends its keys at or above tau = maximum - hint) merges them the short way below, checks
// that they decided the cuts (smp_attempt_complete) and leaves the next draw's hint
// (smp_next_hint).
#define SMP_BINS 256

// The binned merge's scratch, for NT threads: the first bin holding the k-th key, the keys
// placed, each bin's first place, the keys by bin (one a thread at most).
template <int NT>
struct SmpBinned {
    smp_u32 bsel, nsel;
    smp_u32 binbase[SMP_BINS];
    smp_u64 ks[NT];
};

// The bins of the binned merge: a key's bin by its distance below gmax, SMP_BINS of them down
// to tau. Not valid where there is no room between tau and gmax (the merge does not apply).
struct SmpBins {
    float gmax, scale;
    bool valid;
    __device__ int of(smp_u64 key) const {
        const float d = (gmax - smp_unkey((smp_u32)(key >> 32))) * scale;
        return d < (float)(SMP_BINS - 1) ? max((int)d, 0) : SMP_BINS - 1;
    }
};
__device__ __forceinline__ SmpBins smp_bins(float gmax, float tau) {
    const float width = gmax - tau;
    return {gmax, (float)SMP_BINS / width, width > 0.f && width < 1e30f && gmax < 1e30f};
}
// Each nonzero key of c counted in its bin (count: SMP_BINS words).
template <int R>
__device__ __forceinline__ void smp_bins_count(const smp_u64 (&c)[R], const SmpBins& bins, smp_u32* count) {
#pragma unroll
    for (int r = 0; r < R; r++)
        if (c[r] != 0) atomicAdd(&count[bins.of(c[r])], 1u);
}

struct SmpNoMark {
    __device__ void operator()(int) const {}
};

// The fast attempt's merge the short way, from the keys the drawing CTA loaded with the
// summaries (c: every nonzero key of the union, n of them, all within [tau, gmax]): a counting
// sort instead of the merge's threshold search, ranking and scoring, which take a barrier
// each. Each key falls in one of SMP_BINS bins by its distance below gmax (bin 0 nearest);
// the bin is a non-decreasing function of that distance, so a key in a lower bin is larger
// than every key in a higher one, and a key's rank is the keys of the bins before its own plus
// the larger keys of its own bin (a few). Keys down to the bin holding the k-th go to their
// bin's places; the thread of each place ranks its key, and the top kk (min(n, k)) write their
// candidate, score and top-p weight where smp_cut_and_draw's sort and scoring would (the same
// values: smp_draw_score's and smp_topp_weight's expressions, gmax being sv[0]), so the cuts
// and the draw (smp_cut_warp) are the same.
//
// Its first part is the caller's, behind a barrier of the caller's own: every key of c
// counted in its bin (smp_bins_count into sel.hist[0]; sel.hist[1] zero) and z_all, the
// softmax sum (each thread's term added in smp_block_sum's order). Returns false, before
// anything the long way uses is touched, where it does not apply (more than NT keys to
// place); else the token in thread 0. mark(k) after each of its barriers (for measuring; by
// default nothing).
template <int NT, int R, typename Sync, typename Mark = SmpNoMark>
__device__ bool smp_merge_binned_counted(const SmpParams& s, smp_u32 pos, const smp_u64 (&c)[R], smp_u32 n,
                                         const SmpBins& bins, double z_all, SmpShared& sm, SmpSel& sel,
                                         SmpBinned<NT>& bn, int tid, Sync sync, smp_u32& token, Mark mark = Mark()) {
    const float gmax = bins.gmax;
    const auto bin_of = [&](smp_u64 key) { return bins.of(key); };
    smp_u32* count = sel.hist[0];
    smp_u32* cursor = sel.hist[1];
    const smp_u32 k = s.top_k > 0 ? s.top_k : SMP_KMAX, kk = min(n, k);
    if (tid < 32) {
        // Lane l owns bins 8l .. 8l + 7, nearest the maximum first: lanes in order walk the keys
        // downwards.
        constexpr int PER = SMP_BINS / 32;
        smp_u32 cnt[PER], sum = 0;
#pragma unroll
        for (int j = 0; j < PER; j++) { cnt[j] = count[PER * tid + j]; sum += cnt[j]; }
        smp_u32 at = smp_warp_scan(sum, tid) - sum;
#pragma unroll
        for (int j = 0; j < PER; j++) {
            bn.binbase[PER * tid + j] = at;
            if (at < kk && kk <= at + cnt[j]) { bn.bsel = PER * tid + j; bn.nsel = at + cnt[j]; }
            at += cnt[j];
        }
    }
    sync();
    mark(1);
    const int bsel = (int)bn.bsel;
    const smp_u32 nsel = bn.nsel;  // ~0 where no bin held the kk-th key (kk = 0)
    if (nsel > NT) return false;
#pragma unroll
    for (int r = 0; r < R; r++) {
        if (c[r] == 0) continue;
        const int b = bin_of(c[r]);
        if (b <= bsel) bn.ks[bn.binbase[b] + atomicAdd(&cursor[b], 1u)] = c[r];
    }
    sync();
    mark(2);
    if (tid < (int)nsel) {
        const smp_u64 key = bn.ks[tid];
        const int b = bin_of(key);
        const int lo = (int)bn.binbase[b], hi = lo + (int)count[b];
        smp_u32 rank = (smp_u32)lo;
        for (int q = lo; q < hi; q++) rank += bn.ks[q] > key;
        if (rank < kk) {
            const float v = smp_unkey((smp_u32)(key >> 32));
            const smp_u32 i = ~(smp_u32)key;
            sm.sv[rank] = v;
            sm.si[rank] = i;
            sm.ss[rank] = (double)v / (double)s.temperature + smp_gumbel(s.seed_lo, s.seed_hi, pos, i);
            if (s.top_p < 1.f) sm.sw[rank] = exp((double)v - (double)gmax);
        }
    }
    if (tid == 0) sm.count = kk;
    sync();
    mark(3);
    token = smp_cut_warp(s, z_all, sm, tid);
    return true;
}

// Whether the vocabulary's top token alone reaches top-p (top-k off): then the cuts keep it
// alone (top-p's cut falls after it, and min-p keeps at least one candidate), so the draw is
// that token whatever the other keys are, and no merge, score or search is needed. The test
// is smp_cut_warp's on candidate 0, whose weight exp(sv[0] - gmax) is exactly 1, against the
// same z_all (the softmax sum over the whole vocabulary relative to gmax, in smp_block_sum's
// order), so a draw takes this way exactly where the merge would have kept one candidate.
// On random weights nearly every top-p draw is such a draw; on the default model's chats a
// minority (BENCHMARKS.md, 2026-11-29).
// smp_top_test_applies: the rule and the maximum admit the test (top-p on, top-k off, a finite
// maximum).
__device__ __forceinline__ bool smp_top_test_applies(const SmpParams& s, float gmax) {
    return s.temperature != 0.f && s.top_k == 0 && s.top_p < 1.f && gmax > __int_as_float(0xff800000u) &&
           gmax < __int_as_float(0x7f800000u);
}
__device__ __forceinline__ bool smp_top_dominates(const SmpParams& s, float gmax, double z_all) {
    return smp_top_test_applies(s, gmax) && 1.0 / z_all >= (double)s.top_p;
}

// The vocabulary's top token (the lowest at its maximum gmax), from each warp's maximum over
// the blocks it read and the lowest top token of those blocks at that maximum: what the fused
// sampler's last CTA and the megakernel's drawing SM take when the top token decides alone.
__device__ __forceinline__ smp_u32 smp_top_of_warps(const float* wmax, const smp_u32* wtop, int warps, float gmax) {
    smp_u32 t = SMP_NONE;
    for (int w = 0; w < warps; w++)
        if (wmax[w] == gmax) t = min(t, wtop[w]);
    return t;
}

// Whether the sorted candidates the fast attempt merged (sm.count of them) decided the cuts:
// every key at or above tau (the logit every CTA cut at) was among them, so they are
// the exact list down to tau. The draw is exact if that part holds all k candidates the rule
// can take; else (top-p over top-k needs the whole top-k list for its denominator) if top-p's
// cut fell inside it, or min-p's first excluded candidate is in it. By thread 0, after
// the merge (smp_cut_and_draw's sm.sh words).
__device__ bool smp_attempt_complete(const SmpParams& s, const SmpShared& sm, float tau) {
    const int kk = sm.count;
    const int k = s.top_k > 0 ? (int)s.top_k : SMP_KMAX;
    // Candidates at or above tau: a prefix of the sorted list, found by bisection.
    int lo = 0, hi = kk;
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (smp_key(sm.sv[mid]) >= smp_key(tau)) lo = mid + 1;
        else hi = mid;
    }
    if (kk == k && lo == k) return true;
    if (s.top_k > 0 && s.top_p < 1.f) return false;
    // Every key at or above min-p's floor is among them (tau below it): whatever cut the
    // list, min-p's or top-p's inside it, is the whole vocabulary's.
    if (s.min_p > 0.f && kk > 0 && (double)tau < (double)sm.sv[0] + log((double)s.min_p)) return true;
    const int keep_p = sm.sh[1], keep = sm.sh[3];
    if (keep < keep_p) return keep < lo;  // min-p cut: the first excluded candidate decided it
    return sm.sh[2] != 0 && keep <= lo;     // top-p cut at keep - 1
}

// The hint for the next draw, by thread 0 of the CTA that drew: 1.25 times the distance below
// the maximum of the candidate that decided the cuts (the first one excluded, or the last
// kept; with top-k and top-p both, the k-th, since top-p's sum is over the top k), plus 1/16,
// and with top-p no less than 0.95 times the hint this draw was given (`prev`, where it had
// one): what this draw needed, with room, and for top-p a memory of the wider draws before
// it. On a trained model's logits the depth a top-p cut needs jumps from step to step;
// replayed on the default model's chats, forgetting a wide draw at once sent 117 of 640
// top-p draws to the search for want of keys, the decay 13 (examples/draw_hints.rs;
// BENCHMARKS.md, 2026-11-29). With min-p, an attempt that reaches below its floor decides the
// cuts (smp_attempt_complete), so the floor's depth plus 1/16 is as much as a hint needs, and
// it is the hint where the draw's list ended above the floor (its last candidate says nothing
// of the next cut: after a peaked draw the hint would shrink to 1/16, short of the floor).
// Every draw leaves one, so the next attempts follow the logits. Negative where the draw
// gives none (no candidate, or no finite distance).
__device__ float smp_next_hint(const SmpParams& s, const SmpShared& sm, float gmax, float prev) {
    const int kk = sm.count, keep = sm.sh[3], j = s.top_k > 0 && s.top_p < 1.f ? kk - 1 : min(keep, kk - 1);
    if (j < 0) return -1.f;
    const float depth = gmax - sm.sv[j];
    if (!(depth >= 0.f && depth < 1e30f)) return -1.f;
    float h = 1.25f * depth + 0.0625f;
    if (s.top_p < 1.f && prev > 0.f && prev < 1e30f) h = fmaxf(h, 0.95f * prev);
    if (s.min_p > 0.f) {
        const int k = s.top_k > 0 ? (int)s.top_k : SMP_KMAX;
        const float hf = -logf(s.min_p) + 0.0625f;
        h = keep >= kk && kk < k ? hf : fminf(h, hf);
    }
    return h;
}

// AttnReduce(layer, kv_head, parts): merges the split-KV parts of a KV head's query heads.
//
// Part k of head g left its normalised output o_k, its max m_k and its sum l_k (see
// attn_store). The merged output is sum_k w_k o_k / sum_k w_k with w_k = l_k exp(m_k - M),
// M = max_k m_k. Thread (head, dim) makes one output; a warp's threads share their head, so
// the parts are taken 32 at a time, lane k reading part k's max and sum, and the warp works
// out their weights by shuffles: no shared memory and no barrier. Past 32 parts the running
// max, sum and output are rescaled as in an online softmax. A chunk's stats and the thread's
// first values are read together and waited for together (one round trip to L2 after the last
// part landed); each further batch of values takes one more.
// Measured on the H100 (BENCHMARKS.md): the earlier form (tables of maxes, sums and weights in
// shared memory behind two consumer barriers, the stats one uncoalesced word per thread) took
// 2.9 µs from start to store with every input already in L2, on every layer's critical path
// at long contexts. Registers: each value in flight takes two, and this code is inlined into
// the interpreter's loop, so more of them in flight spill the loop's registers.
#if MK_ATT_BY_WARPS
// Values a thread has in flight (MK_RED_BATCH, through MEGAINFER_MK_DEFINES, for measuring).
// 8 rather than 16, though 16 parts then take two round trips: Llama-1B 1.2837 -> 1.2552 ms
// a token at 32K, 1.0018 -> 0.9946 at 8K (H100, BENCHMARKS.md). The kernel with 16 streamed
// the attention parts themselves 13% slower at 32K (25.7 against 22.7 µs a part) than the one
// with the earlier merge: the merge's code changes how the whole loop compiles.
#ifndef MK_RED_BATCH
#define MK_RED_BATCH 8
#endif
constexpr int ATT_RED_BATCH = MK_RED_BATCH;
static_assert(32 % ATT_RED_BATCH == 0, "a chunk of 32 parts is whole batches");
// MK_RED_HOIST (1 by default; 0 for measuring): the first chunk's stats and first
// MK_RED_HOIST_VALUES values read outside the batches' loop, in one round trip. Against the
// loop alone on the H100 (BENCHMARKS.md, 2026-11-27): SmolLM2 at 8K (21 parts) 3% faster a
// token in three runs, Llama-1B at 32K 1.1%, Llama-1B at 8K (16 parts) unchanged.
#ifndef MK_RED_HOIST
#define MK_RED_HOIST 1
#endif
#ifndef MK_RED_HOIST_VALUES
#define MK_RED_HOIST_VALUES 16
#endif
// MK_RED_NO_WAIT=1 (for measuring only: the merged values are garbage): the hoisted read takes
// whatever its loads return, without waiting for the parts' tags, so the merge costs no hop:
// the bound on any faster merge.
#ifndef MK_RED_NO_WAIT
#define MK_RED_NO_WAIT 0
#endif
static_assert(!MK_RED_HOIST || (MK_RED_HOIST_VALUES % ATT_RED_BATCH == 0 && MK_RED_HOIST_VALUES <= 32),
              "the batches after the hoisted values stay within and aligned to 32-part chunks");
static_assert(ATT_HD % 32 == 0, "a warp's threads must share their head");

__device__ void op_attn_reduce(const MkParams& p, const u32* w, float*) {
    constexpr int hd = ATT_HD, G = ATT_G, stride = hd + 2;
    const int ct = threadIdx.x - 32, lane = ct & 31;
    const int layer = w[W_LAYER], kvh = w[W_A], parts = w[W_B];
    // Slots [g * parts + k] of the group's heads are contiguous: [head][part][hd + 2].
    const u64* base = p.attn_part + ((size_t)layer * p.heads + (size_t)kvh * G) * parts * stride;
    const u32 tag = step_tag();
    // Outputs ct, ct + CONSUMERS, ...: a trip count known at compile time (one on most shapes)
    // keeps the loop, and the state it carries, out of the compiled code where one suffices.
    constexpr int ROUNDS = (G * hd + CONSUMERS - 1) / CONSUMERS;
#pragma unroll 1
    for (int r = 0; r < ROUNDS; r++) {
        const int idx = ct + r * CONSUMERS;
        if (idx >= G * hd) break;
        const int g = idx / hd, d = idx % hd;
        const u64* head = base + (size_t)g * parts * stride;
        float M = NEG_INF, S = 0.f, acc = 0.f, wl = 0.f;
        int first = 0;
#if MK_RED_HOIST
        // Where one round covers the outputs: the first chunk's stats and its first
        // MK_RED_HOIST_VALUES values read at the top level, outside any loop, and waited for
        // together (one round trip up to that many parts); the batches after them as below.
        // (16 values a batch inside the loop instead slowed the attention parts themselves:
        // see MK_RED_BATCH. This read and the loop's are written out twice on purpose: one
        // helper for both changed the kernel's code generation, two more spill instructions
        // on Llama-1B's, in a form not measured on a GPU.)
        if (ROUNDS == 1) {
            constexpr int NH = MK_RED_HOIST_VALUES;
            const bool has = lane < parts;
            const int nv = min(NH, parts);
            auto addr = [&](int e) {
                return e < 2 ? head + (size_t)lane * stride + hd + e : head + (size_t)(e - 2) * stride + d;
            };
            u64 st[2], v[NH];
#pragma unroll
            for (int e = 0; e < 2; e++) st[e] = has ? ld_tagged(addr(e)) : 0;
#pragma unroll
            for (int k = 0; k < NH; k++) v[k] = k < nv ? ld_tagged(addr(k + 2)) : 0;
            if (!MK_RED_NO_WAIT)
                settle_with<2 + NH>(
                    p,
                    [&](int e) {
                        return e < 2 ? (has ? (u32)(st[e] >> 32) : tag) : (e - 2 < nv ? (u32)(v[e - 2] >> 32) : tag);
                    },
                    [&](int e) {
                        if (e < 2) st[e] = ld_tagged(addr(e));
                        else v[e - 2] = ld_tagged(addr(e));
                    },
                    addr, 2 + NH);
            prep_stamp(PROF_EXTRA2);
            if (__any_sync(0xffffffffu, any_failed())) return;
            const float l = has ? tagged_float(st[1]) : 0.f, m = tagged_float(st[0]);
            M = warp_max(l > 0.f ? m : NEG_INF);
            wl = l > 0.f ? l * __expf(m - M) : 0.f;
            S = warp_sum(wl);
#pragma unroll
            for (int k = 0; k < NH; k++) {
                const float wk = __shfl_sync(0xffffffffu, wl, k);
                if (k < nv) acc = fmaf(wk, tagged_float(v[k]), acc);
            }
            first = NH;
        }
#endif
        // Batches of ATT_RED_BATCH parts; the first of each 32 also reads their stats. One wait
        // site for both kinds: a second one, inlined, spilled the interpreter loop's registers.
#pragma unroll 1
        for (int b0 = first; b0 < parts; b0 += ATT_RED_BATCH) {
            // Element e: part c0 + lane's max (e 0) and sum (e 1), then value b0 + e - 2.
            const int c0 = b0 & ~31, nv = min(ATT_RED_BATCH, parts - b0);
            const bool has = b0 == c0 && c0 + lane < parts;
            auto addr = [&](int e) {
                return e < 2 ? head + (size_t)(c0 + lane) * stride + hd + e : head + (size_t)(b0 + e - 2) * stride + d;
            };
            u64 st[2], v[ATT_RED_BATCH];
#pragma unroll
            for (int e = 0; e < 2; e++) st[e] = has ? ld_tagged(addr(e)) : 0;
#pragma unroll
            for (int k = 0; k < ATT_RED_BATCH; k++) v[k] = k < nv ? ld_tagged(addr(k + 2)) : 0;
            settle_with<2 + ATT_RED_BATCH>(
                p,
                [&](int e) {
                    return e < 2 ? (has ? (u32)(st[e] >> 32) : tag) : (e - 2 < nv ? (u32)(v[e - 2] >> 32) : tag);
                },
                [&](int e) {
                    if (e < 2) st[e] = ld_tagged(addr(e));
                    else v[e - 2] = ld_tagged(addr(e));
                },
                addr, 2 + ATT_RED_BATCH);
            if (b0 == 0) prep_stamp(PROF_EXTRA2);  // MK_PREP_STAMPS: thread 0's first inputs in
            // Warp-uniform, for the shuffles below (a wait that failed has set the flag).
            if (__any_sync(0xffffffffu, any_failed())) return;
            if (b0 == c0) {
                // An empty part (more parts than positions: sum 0, max -inf) weighs 0. The last
                // part always holds this token's position, so M is finite once every chunk is
                // in; until then a chunk of empty parts leaves it -inf and the sums 0.
                const float l = has ? tagged_float(st[1]) : 0.f, m = tagged_float(st[0]);
                const float Mn = fmaxf(M, warp_max(l > 0.f ? m : NEG_INF));
                const float rescale = M == NEG_INF ? 0.f : __expf(M - Mn);
                wl = l > 0.f ? l * __expf(m - Mn) : 0.f;
                S = S * rescale + warp_sum(wl);
                acc *= rescale;
                M = Mn;
            }
#pragma unroll
            for (int k = 0; k < ATT_RED_BATCH; k++) {
                const float wk = __shfl_sync(0xffffffffu, wl, (b0 & 31) + k);
                if (k < nv) acc = fmaf(wk, tagged_float(v[k]), acc);
            }
        }
        st_tagged(p.attn_out + (size_t)layer * p.heads * hd + (size_t)(kvh * G + g) * hd + d, S > 0.f ? acc / S : 0.f,
                  tag);
    }
}
#else
static_assert(ATT_ROUND / 2 * 2 <= ATT_S_STRIDE, "AttnReduce's tables must fit S");
constexpr int ATT_RED_BATCH = 16;
constexpr int ATT_RED_STATS = 4;  // (max, sum) pairs a thread reads per batch

// The kernel by rounds runs only unsplit attention (the host compiles split-KV buckets by
// warps, so this never runs there but in measuring variants) and keeps the earlier form, two
// floats per (head, part) in shared memory and the parts' values read after the weights: any
// other code in its place moved the kernel's layout and cost SmolLM2 1.3% a token at short
// contexts (BENCHMARKS.md), where this code never runs.
__device__ void op_attn_reduce(const MkParams& p, const u32* w, float* scratch) {
    constexpr int hd = ATT_HD, G = ATT_G, stride = hd + 2;
    const int ct = threadIdx.x - 32, cw = ct >> 5, lane = ct & 31;
    const int layer = w[W_LAYER], kvh = w[W_A], parts = w[W_B];
    const u64* base = p.attn_part + ((size_t)layer * p.heads + (size_t)kvh * G) * parts * stride;
    float* mx = scratch;              // [G * parts]: each part's max, then its weight
    float* sm = scratch + G * parts;  // [G * parts]: each part's sum
    const int slots = G * parts;
    for (int s0 = 0; s0 < slots; s0 += ATT_RED_STATS * CONSUMERS) {
        const int first = s0 + ct, mine = slots > first ? min(ATT_RED_STATS, (slots - first + CONSUMERS - 1) / CONSUMERS) : 0;
        // Element e = 2k + {0: max, 1: sum} of slot first + k * CONSUMERS.
        auto addr = [&](int e) { return base + (size_t)(first + (e >> 1) * CONSUMERS) * stride + hd + (e & 1); };
        u64 raw[2 * ATT_RED_STATS];
#pragma unroll
        for (int e = 0; e < 2 * ATT_RED_STATS; e++) raw[e] = e < 2 * mine ? ld_tagged(addr(e)) : 0;
        settle<2 * ATT_RED_STATS>(p, raw, addr, 2 * mine);
#pragma unroll
        for (int k = 0; k < ATT_RED_STATS; k++)
            if (k < mine) {
                mx[first + k * CONSUMERS] = tagged_float(raw[2 * k]);
                sm[first + k * CONSUMERS] = tagged_float(raw[2 * k + 1]);
            }
    }
    if (consumers_failed()) return;
    for (int g = cw; g < G; g += CONSUMER_WARPS) {
        float m = NEG_INF;
        for (int k = lane; k < parts; k += 32) m = fmaxf(m, mx[g * parts + k]);
        m = warp_max(m);
        float total = 0.f;
        for (int k = lane; k < parts; k += 32) {
            const float l = sm[g * parts + k];
            total += l > 0.f ? l * __expf(mx[g * parts + k] - m) : 0.f;
        }
        total = warp_sum(total);
        __syncwarp();
        for (int k = lane; k < parts; k += 32) {
            const float l = sm[g * parts + k];
            mx[g * parts + k] = l > 0.f && total > 0.f ? l * __expf(mx[g * parts + k] - m) / total : 0.f;
        }
    }
    consumers_sync();
    const u32 tag = step_tag();
    for (int idx = ct; idx < G * hd; idx += CONSUMERS) {
        const int g = idx / hd, d = idx % hd;
        const u64* src = base + (size_t)g * parts * stride + d;
        float acc = 0.f;
        for (int k0 = 0; k0 < parts; k0 += ATT_RED_BATCH) {
            const int mine = min(ATT_RED_BATCH, parts - k0);
            auto addr = [&](int k) { return src + (size_t)(k0 + k) * stride; };
            u64 raw[ATT_RED_BATCH];
#pragma unroll
            for (int k = 0; k < ATT_RED_BATCH; k++) raw[k] = k < mine ? ld_tagged(addr(k)) : 0;
            settle<ATT_RED_BATCH>(p, raw, addr, mine);
#pragma unroll
            for (int k = 0; k < ATT_RED_BATCH; k++)
                if (k < mine) acc = fmaf(mx[g * parts + k0 + k], tagged_float(raw[k]), acc);
        }
        st_tagged(p.attn_out + (size_t)layer * p.heads * hd + (size_t)(kvh * G + g) * hd + d, acc, tag);
    }
}
#endif

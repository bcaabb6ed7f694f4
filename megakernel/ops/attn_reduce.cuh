// AttnReduce(layer, kv_head, parts): merges the split-KV parts of a KV head's query heads.
//
// Part k of head g left its normalised output o_k, its max m_k and its sum l_k (see
// attn_store). The merged output is sum_k w_k o_k with w_k = l_k exp(m_k - M) / sum_j l_j
// exp(m_j - M), M = max_k m_k. Every read is issued in batches and waited for together: a
// chain of one tagged read per part (each a round trip to L2, ~0.25 µs) made this instruction
// the longest wait of a layer once the parts were many (32 parts: 128 dependent reads).
//   1. every (head, part)'s max and sum into shared memory, all threads at once;
//   2. a warp per head turns them into the weights w_k;
//   3. thread (head, dim) reads its parts' values, ATT_RED_BATCH at a time, and sums.
// A thread's first batch of values is read with its maxes and sums and waited for with them
// (MK_RED_EARLY): the values do not depend on the weights, and waited for after them they were
// a second round trip after the last part landed, on every layer's critical path (SmolLM2 at
// 8K: 4% a token). Only the kernel that split-KV schedules run (compiled by warps) has it: in
// the other, which never runs AttnReduce, its code alone cost 0.5-2.5% a token on the small
// shapes at short contexts (code layout; BENCHMARKS.md).
// The two tables of step 1 take the S region of the attention scratch (G * ATT_S_STRIDE
// floats): the host keeps parts <= MK_ATT_ROUND / 2 (MAX_REDUCE_PARTS in megakernel.rs).

static_assert(ATT_ROUND / 2 * 2 <= ATT_S_STRIDE, "AttnReduce's tables must fit S");
constexpr int ATT_RED_BATCH = 16;
constexpr int ATT_RED_STATS = 4;  // (max, sum) pairs a thread reads per batch
#ifndef MK_RED_EARLY
#define MK_RED_EARLY MK_ATT_BY_WARPS
#endif

__device__ void op_attn_reduce(const MkParams& p, const u32* w, float* scratch) {
    constexpr int hd = ATT_HD, G = ATT_G, stride = hd + 2;
    const int ct = threadIdx.x - 32, cw = ct >> 5, lane = ct & 31;
    const int layer = w[W_LAYER], kvh = w[W_A], parts = w[W_B];
    // Slots [g * parts + k] of the group's heads are contiguous: [head][part][hd + 2].
    const u64* base = p.attn_part + ((size_t)layer * p.heads + (size_t)kvh * G) * parts * stride;
    float* mx = scratch;              // [G * parts]: each part's max, then its weight
    float* sm = scratch + G * parts;  // [G * parts]: each part's sum
    const int slots = G * parts;
    // This thread's first output (head g0, dim d0) and its first batch of values.
    const int g0 = ct / hd, d0 = ct % hd;
    const u64* src0 = base + (size_t)g0 * parts * stride + d0;
    auto vaddr = [&](int k) { return src0 + (size_t)k * stride; };  // part k's value
    const int mine0 = MK_RED_EARLY && ct < G * hd ? min(ATT_RED_BATCH, parts) : 0;
    u64 val0[ATT_RED_BATCH];
#pragma unroll
    for (int k = 0; k < ATT_RED_BATCH; k++) val0[k] = k < mine0 ? ld_tagged(vaddr(k)) : 0;
    for (int s0 = 0; s0 < slots; s0 += ATT_RED_STATS * CONSUMERS) {
        const int first = s0 + ct, mine = slots > first ? min(ATT_RED_STATS, (slots - first + CONSUMERS - 1) / CONSUMERS) : 0;
        // Element e = 2k + {0: max, 1: sum} of slot first + k * CONSUMERS.
        auto addr = [&](int e) { return base + (size_t)(first + (e >> 1) * CONSUMERS) * stride + hd + (e & 1); };
        u64 raw[2 * ATT_RED_STATS];
#pragma unroll
        for (int e = 0; e < 2 * ATT_RED_STATS; e++) raw[e] = e < 2 * mine ? ld_tagged(addr(e)) : 0;
        if (s0 == 0 && mine0 > 0) {
            // Elements [0, 2 * ATT_RED_STATS) are raw's, the rest val0's; unused ones count as
            // seen.
            constexpr int NS = 2 * ATT_RED_STATS;
            const u32 tag = step_tag();
            settle_with<NS + ATT_RED_BATCH>(
                p,
                [&](int e) {
                    return e < NS ? (e < 2 * mine ? (u32)(raw[e] >> 32) : tag)
                                  : (e - NS < mine0 ? (u32)(val0[e - NS] >> 32) : tag);
                },
                [&](int e) {
                    if (e < NS) raw[e] = ld_tagged(addr(e));
                    else val0[e - NS] = ld_tagged(vaddr(e - NS));
                },
                [&](int e) { return e < NS ? addr(e) : vaddr(e - NS); }, NS + ATT_RED_BATCH);
        } else {
            settle<2 * ATT_RED_STATS>(p, raw, addr, 2 * mine);
        }
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
            // An empty part (sum 0, max -inf) weighs 0; M is finite, since the last part
            // always holds this token's position.
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
        int k0 = 0;
        if (idx == ct && mine0 > 0) {
#pragma unroll
            for (int k = 0; k < ATT_RED_BATCH; k++)
                if (k < mine0) acc = fmaf(mx[g * parts + k], tagged_float(val0[k]), acc);
            k0 = ATT_RED_BATCH;
        }
        for (; k0 < parts; k0 += ATT_RED_BATCH) {
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

// The model's activations as several instructions read them: the residual stream entering a
// layer (RMS-normed for QKV, up-gate and the LM head) and rows of the KV cache.

// Element i of the embedding's row `token`, decoded as the CPU reference decodes it.
__device__ __forceinline__ float embed_at(const MkParams& p, u32 token, int i) {
    if constexpr (MK_WT_EMB == WEIGHT_BF16) return bf16_to_f32(p.embed[(size_t)token * p.hidden + i]);
    else return q_element(MK_WT_EMB, p.embed, token, i, p.hidden);
}

// RoPE's frequencies (head_dim / 2), copied into shared memory when the kernel starts, where
// the host finds room for them beside the ring (MK_FREQ_SMEM, freq_table_fits in
// src/gpu/megakernel/compile.rs). QKV (rope_of) and Qwen3's attention (qk_rope_of) work out
// their rotations when they start, and an instruction that starts after its inputs have
// arrived has that on its critical path: read from L2 there, the frequency was one more round
// trip before the sine and cosine.
#ifndef MK_FREQ_SMEM
#define MK_FREQ_SMEM 0
#endif
#if MK_FREQ_SMEM
__shared__ float mk_inv_freq[MK_HEAD_DIM / 2];
#define MK_FREQ(p, i) mk_inv_freq[i]
#else
#define MK_FREQ(p, i) (p).inv_freq[i]
#endif

// The RMS norm's scale from the sums of squares prepare_normed left in ss.
__device__ __forceinline__ float rms_scale(const MkParams& p, const float* ss) {
    float t = 0.f;
#pragma unroll
    for (int i = 0; i < CONSUMER_WARPS; i++) t += ss[i];
    return rsqrtf(t / p.hidden + p.eps);
}

// How the residual entering a layer is read (resid_in, prepare_normed): its sources are the
// down projection's MK_DOWN_CHUNKS k-chunks (the schedule's; 0 if not given), the first of
// which holds the attention residual too (DownProjPartial adds it), and every group of loads a
// thread waits for is a dependent L2 round trip, about 1 µs while every SM streams (measured
// on the H100: BENCHMARKS.md, c1f090b and after).
// - One round: a thread holds PREP_MAX elements of every source in flight at once: its whole
//   share (ceil(hidden / 256)) for hidden sizes up to 2048, and besides the first chunk
//   PREP_CHUNKS more (up to two there). The loops are unrolled to those counts and no further: this
//   code runs once per instruction, and on the small shapes fetching it is much of an
//   instruction's time once its inputs are there (8 elements and 2 chunks for every shape
//   made it 2.7x as long on SmolLM2, whose QKV instructions took 1.22 µs from their start to
//   their inputs where they found them waiting; 0.61 µs sized to the shape: BENCHMARKS.md,
//   7cfe179). Larger sizes take their whole share
//   when that is at most 40 loads with every source (Llama-3.2-3B 12 x 3, Qwen3-4B 10 x 4:
//   2.478 -> 2.436 and 3.236 -> 3.141 ms against two rounds, when the attention residual was
//   a source of its own); more spills (Qwen3-8B's 16 x 4: local stores / loads 37 / 73 -> 207
//   / 334 SASS instructions).
// - Otherwise rounds of 8 elements, PREP_SRC sources a group: all four where there are
//   four (Qwen3-8B: 5.371 -> 5.304 ms against 3 + 1), else three. Five at once spill, and five
//   or six sources take two groups at three or at four (Qwen2.5-7B: 0.4% slower at four).
#ifndef MK_DOWN_CHUNKS
#define MK_DOWN_CHUNKS 0
#endif
// The k-chunks read besides the first.
#define PREP_LATER (MK_DOWN_CHUNKS > 1 ? MK_DOWN_CHUNKS - 1 : 0)
#ifndef PREP_SRC
#define PREP_SRC (MK_DOWN_CHUNKS == 4 ? 4 : 3)
#endif
#define PREP_SHARE ((MK_HIDDEN + CONSUMERS - 1) / CONSUMERS)
#define PREP_WHOLE (MK_HIDDEN > 8 * CONSUMERS && MK_DOWN_CHUNKS > 0 && PREP_SHARE * MK_DOWN_CHUNKS <= 40)
#ifndef PREP_MAX
#define PREP_MAX (PREP_WHOLE || MK_HIDDEN <= 8 * CONSUMERS ? PREP_SHARE : 8)
#endif
// - In rounds, a single source (up-gate's attention residual; layer 0's QKV reads only the
//   embedding) is still read in one trip, a thread's whole share at once: Qwen2.5-7B 5.440 ->
//   5.369 ms, Llama-3.1-8B 5.242 -> 5.217 against a trip a round. Not where the groups are of
//   four (Qwen3-8B, whose groups already hold 32 loads: 5.302 -> 5.319, local loads and
//   stores 19 / 23 -> 21 / 27).
#ifndef PREP_ONE_SOURCE
#define PREP_ONE_SOURCE (PREP_SHARE <= 16 && PREP_SRC == 3)
#endif

// Residual stream entering `layer`: the embedding row for layer 0, else the previous layer's
// down-projection partial sums (each written once per token; the first with the attention
// residual in it). Its chunks are read at once (one round trip, not one each) when there are
// at most 1 + PREP_CHUNKS, else PREP_SRC at a time; summed in order either way.
#ifndef PREP_CHUNKS
#define PREP_CHUNKS (MK_DOWN_CHUNKS > 0 && (PREP_WHOLE || MK_DOWN_CHUNKS <= 3) ? PREP_LATER : 2)
#endif
// Arrays of the later chunks' words hold at least one (C++ has no arrays of none).
#define PREP_CHUNKS_ARR (PREP_CHUNKS > 0 ? PREP_CHUNKS : 1)
// The first n (at least one) of a round's settled words, summed in order: an element of the
// residual from its chunks.
template <int N>
__device__ __forceinline__ float sum_settled(const u64 (&raw)[N], int n) {
    float v = tagged_float(raw[0]);
#pragma unroll
    for (int k = 1; k < N; k++)
        if (k < n) v += tagged_float(raw[k]);
    return v;
}
__device__ __forceinline__ float resid_in(const MkParams& p, int layer, u32 token, int i) {
    if (layer == 0) return embed_at(p, token, i);
    const int l = layer - 1;
    const int later = p.chunks - 1;
    const u64* base = p.mlp_part + (size_t)l * p.chunks * p.hidden + i;
    auto addr = [&](int k) { return base + (size_t)k * p.hidden; };
    if (later <= PREP_CHUNKS) {
        u64 raw[1 + PREP_CHUNKS];
#pragma unroll
        for (int k = 0; k <= PREP_CHUNKS; k++) raw[k] = k <= later ? ld_tagged(addr(k)) : 0;
        settle<1 + PREP_CHUNKS>(p, raw, addr, 1 + later);
        return sum_settled(raw, 1 + later);
    }
    float v = 0.f;
    for (int k0 = 0; k0 < p.chunks; k0 += PREP_SRC) {
        const int n = min(PREP_SRC, p.chunks - k0);
        u64 raw[PREP_SRC];
#pragma unroll
        for (int k = 0; k < PREP_SRC; k++) raw[k] = k < n ? ld_tagged(addr(k0 + k)) : 0;
        settle<PREP_SRC>(p, raw, [&](int k) { return addr(k0 + k); }, n);
#pragma unroll
        for (int k = 0; k < PREP_SRC; k++)
            if (k < n) v += tagged_float(raw[k]);
    }
    return v;
}

// xs = src * g, src given by resid_in(layer) or resid_attn[l] (after_attn), and the sums of
// squares in ss: the norm's scale is one number, applied to the mat-vec's results (W(x·s·g) =
// s·W(x·g)), so the tiles need not wait for the sum to be reduced.
// The sources are the down projection's k-chunk partial sums of the layer before (the first
// holding the attention residual too), or the attention residual alone (after_attn). A
// thread takes PREP_MAX elements at a time (a round: PREP_MAX * CONSUMERS elements of the
// vector) and PREP_SRC sources at a time (a group), and issues every L2 load of a group before
// it waits for any (see MK_DOWN_CHUNKS above for the sizes).
// For hidden sizes of one round: every load of the first chunk (or the attention residual), up
// to PREP_CHUNKS later chunks and g issued at once, a round trip per element past that (more
// k-chunks).
__device__ __forceinline__ void prepare_normed_small(const MkParams& p, int layer, bool after_attn, u32 token, const bf16_t* g,
                               float* xs, float* ss) {
    const int ct = threadIdx.x - 32;
    const int nparts = after_attn || layer == 0 ? 0 : p.chunks - 1;
    if (p.hidden <= PREP_MAX * CONSUMERS && nparts <= PREP_CHUNKS) {
        u64 raw[PREP_MAX], rawp[PREP_CHUNKS_ARR][PREP_MAX];
        float gw[PREP_MAX], v[PREP_MAX];
        const u64* base = after_attn ? p.resid_attn + (size_t)layer * p.hidden
                          : layer == 0 ? nullptr : p.mlp_part + (size_t)(layer - 1) * p.chunks * p.hidden;
        const u64* parts = base ? base + p.hidden : nullptr;
        // The norm's weights (and layer 0's embedding row) do not depend on this step: they
        // are issued first, so they are in flight while the inputs are waited for.
#pragma unroll
        for (int k = 0; k < PREP_MAX; k++) {
            const int i = ct + k * CONSUMERS;
            const bool in = i < p.hidden;
            v[k] = in && !base ? embed_at(p, token, i) : 0.f;
            gw[k] = in ? bf16_to_f32(g[i]) : 0.f;
        }
#pragma unroll
        for (int k = 0; k < PREP_MAX; k++) {
            const int i = ct + k * CONSUMERS;
            const bool in = i < p.hidden;
            raw[k] = in && base ? ld_tagged(base + i) : 0;
#pragma unroll
            for (int c = 0; c < PREP_CHUNKS; c++)
                rawp[c][k] = in && c < nparts ? ld_tagged(parts + (size_t)c * p.hidden + i) : 0;
        }
        const int mine = p.hidden > ct ? (p.hidden - ct + CONSUMERS - 1) / CONSUMERS : 0;
        if (base) settle<PREP_MAX>(p, raw, [&](int k) { return base + ct + k * CONSUMERS; }, mine);
#pragma unroll
        for (int c = 0; c < PREP_CHUNKS; c++)
            if (c < nparts)
                settle<PREP_MAX>(p, rawp[c], [&](int k) { return parts + (size_t)c * p.hidden + ct + k * CONSUMERS; }, mine);
        prep_stamp(PROF_EXTRA2);
        float sq = 0.f;
#pragma unroll
        for (int k = 0; k < PREP_MAX; k++) {
            if (k < mine) {
                if (base) v[k] = tagged_float(raw[k]);
#pragma unroll
                for (int c = 0; c < PREP_CHUNKS; c++)
                    if (c < nparts) v[k] += tagged_float(rawp[c][k]);
            }
            sq += v[k] * v[k];
        }
        consumers_partial_sum(sq, ss);
#pragma unroll
        for (int k = 0; k < PREP_MAX; k++) {
            const int i = ct + k * CONSUMERS;
            if (i < p.hidden) xs[i] = v[k] * gw[k];
        }
        return;
    }
    float sq = 0.f;
    for (int i = ct; i < p.hidden; i += CONSUMERS) {
        float v = after_attn ? ld_value(p, p.resid_attn + (size_t)layer * p.hidden + i) : resid_in(p, layer, token, i);
        xs[i] = v * bf16_to_f32(g[i]);
        sq += v * v;
    }
    consumers_partial_sum(sq, ss);
}

__device__ __forceinline__ void prepare_normed_rounds(const MkParams& p, int layer, bool after_attn, u32 token, const bf16_t* g,
                               float* xs, float* ss) {
    const int ct = threadIdx.x - 32;
    const int nparts = after_attn || layer == 0 ? 0 : p.chunks - 1;
    const u64* base = after_attn ? p.resid_attn + (size_t)layer * p.hidden
                      : layer == 0 ? nullptr : p.mlp_part + (size_t)(layer - 1) * p.chunks * p.hidden;
    const u64* parts = base ? base + p.hidden : nullptr;
    const int nsrc = (base ? 1 : 0) + nparts;
    auto src = [&](int s) -> const u64* {
        return base ? (s == 0 ? base : parts + (size_t)(s - 1) * p.hidden) : parts + (size_t)s * p.hidden;
    };
    float sq = 0.f;
#if PREP_ONE_SOURCE
    if (nsrc <= 1) {
        u64 raw[PREP_SHARE];
        float gw[PREP_SHARE], v[PREP_SHARE];
        const int mine = p.hidden > ct ? (p.hidden - ct + CONSUMERS - 1) / CONSUMERS : 0;
#pragma unroll
        for (int k = 0; k < PREP_SHARE; k++) {
            const int i = ct + k * CONSUMERS;
            v[k] = k < mine && !base ? embed_at(p, token, i) : 0.f;
            gw[k] = k < mine ? bf16_to_f32(g[i]) : 0.f;
        }
#pragma unroll
        for (int k = 0; k < PREP_SHARE; k++) raw[k] = k < mine && base ? ld_tagged(base + ct + k * CONSUMERS) : 0;
        if (base) settle<PREP_SHARE>(p, raw, [&](int k) { return base + ct + k * CONSUMERS; }, mine);
#pragma unroll
        for (int k = 0; k < PREP_SHARE; k++) {
            if (k < mine && base) v[k] = tagged_float(raw[k]);
            sq += v[k] * v[k];
            if (k < mine) xs[ct + k * CONSUMERS] = v[k] * gw[k];
        }
        consumers_partial_sum(sq, ss);
        return;
    }
#endif
    for (int first = ct; first - ct < p.hidden; first += PREP_MAX * CONSUMERS) {
        const int mine = p.hidden > first ? min(PREP_MAX, (p.hidden - first + CONSUMERS - 1) / CONSUMERS) : 0;
        float gw[PREP_MAX], v[PREP_MAX];
        // The norm's weights (and layer 0's embedding row) do not depend on this step: they
        // are issued first, so they are in flight while the inputs are waited for.
#pragma unroll
        for (int k = 0; k < PREP_MAX; k++) {
            const int i = first + k * CONSUMERS;
            v[k] = k < mine && !base ? embed_at(p, token, i) : 0.f;
            gw[k] = k < mine ? bf16_to_f32(g[i]) : 0.f;
        }
        for (int s0 = 0; s0 < nsrc; s0 += PREP_SRC) {
            u64 raw[PREP_SRC][PREP_MAX];
#pragma unroll
            for (int s = 0; s < PREP_SRC; s++)
#pragma unroll
                for (int k = 0; k < PREP_MAX; k++)
                    raw[s][k] = s0 + s < nsrc && k < mine ? ld_tagged(src(s0 + s) + first + k * CONSUMERS) : 0;
#pragma unroll
            for (int s = 0; s < PREP_SRC; s++)
                if (s0 + s < nsrc)
                    settle<PREP_MAX>(p, raw[s], [&](int k) { return src(s0 + s) + first + k * CONSUMERS; }, mine);
#pragma unroll
            for (int s = 0; s < PREP_SRC; s++)
#pragma unroll
                for (int k = 0; k < PREP_MAX; k++)
                    if (s0 + s < nsrc && k < mine) v[k] += tagged_float(raw[s][k]);
        }
#pragma unroll
        for (int k = 0; k < PREP_MAX; k++) {
            sq += v[k] * v[k];
            if (k < mine) xs[first + k * CONSUMERS] = v[k] * gw[k];
        }
    }
    consumers_partial_sum(sq, ss);
}

// Models whose hidden size fits one round compile only the one-round code: the general
// rounds' extra addresses cost registers (152 -> 168 with spills, measured with ptxas -v).
__device__ void prepare_normed(const MkParams& p, int layer, bool after_attn, u32 token, const bf16_t* g,
                               float* xs, float* ss) {
    if constexpr (MK_HIDDEN <= PREP_MAX * CONSUMERS) prepare_normed_small(p, layer, after_attn, token, g, xs, ss);
    else prepare_normed_rounds(p, layer, after_attn, token, g, xs, ss);
}

__device__ __forceinline__ const bf16_t* kv_row(const MkParams& p, const bf16_t* cache, int layer, int kvh, int row) {
    return cache + (((size_t)layer * p.kv_heads + kvh) * p.max_seq + row) * p.head_dim;
}

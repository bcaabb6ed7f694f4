// Attention(layer, kv_head, part, parts): softmax attention of a KV head's query heads over
// positions [p0, p1) of the sequence.
//
// The K and V rows before pos sit in shared memory: the loader staged them in pages (see
// load_attention below). Row pos (this token's) comes tagged from kv_new. All eight
// consumer warps work on every step, each step ending at a barrier:
//   scores   S[g][j] = q_g · k_j * scale: 8 lanes per position, each a slice of the dims;
//   softmax  one warp per head: the round's max and sum, S turned into exp(S - max);
//   values   thread (4 dims, position group) sums P · V over its positions for every head;
//   combine  thread (head, dim) adds the warps' partial sums into the running output.
// A round is at most ATT_ROUND staged positions (and this token's, in the first round); longer
// parts take several, carried by an online softmax (running max, sum and output per head).

// ---- the loader's side: K/V tiles ----
// Attention(layer, kv_head, part, parts) covers positions [p0, p1) of the len = pos + 1 long
// sequence. Its K and V rows before pos were written by earlier launches, so they do not
// depend on this step: the loader stages them in pages like weight tiles, long before the
// instruction runs, and attention reads them from shared memory. Row pos (this token's) comes
// tagged from kv_new. A tile holds ATT_TR rows of K, then the same rows of V; the cache is
// head-major ([layer][kv_head][position][head_dim]) so each is one bulk copy.
// The kernel is compiled for the model's head_dim and query heads per KV head (the host passes
// -DMK_HEAD_DIM and -DMK_GROUP), so attention's loops have constant trip counts.

constexpr int ATT_HD = MK_HEAD_DIM, ATT_G = MK_GROUP;
static_assert(ATT_HD == 64 || ATT_HD == 128, "head_dim 64 or 128");
constexpr int ATT_TR = PAGE_BYTES / (4 * ATT_HD);

struct AttnRange {
    int p0, cached_end;  // the rows staged in tiles: [p0, cached_end)
    bool has_new;        // the part ends at pos: row pos is folded in from kv_new
};

__device__ __forceinline__ AttnRange attn_range(const u32* w, u32 pos) {
    const int part = w[W_B], parts = w[W_C], len = pos + 1;
    const int p0 = (int)((long long)part * len / parts), p1 = (int)((long long)(part + 1) * len / parts);
    return {p0, p1 == len ? len - 1 : p1, p1 == len};
}

// Stages an attention instruction's K/V tiles; false when a page wait failed.
__device__ bool load_attention(const MkParams& p, const u32* w, u32 pos, u32 instr, u32& seq, bf16_t* pages,
                               u64* full, u64* empty, u64 policy) {
    const int lane = threadIdx.x & 31, layer = w[W_LAYER], kvh = w[W_A];
    const AttnRange a = attn_range(w, pos);
    for (int r0 = a.p0; r0 < a.cached_end; r0 += ATT_TR, seq++) {
        const u32 slot = seq % p.pages, round = seq / p.pages;
        if (lane == 0) note(p, 3, seq);
        const u32 bytes = (u32)min(ATT_TR, a.cached_end - r0) * ATT_HD * 2;
        if (!page_wait(p, &empty[slot], (round & 1) ^ 1, ERR_PAGE_LOADER, instr, seq)) return false;
        if (!inflight_wait(p, full, seq, instr)) return false;
        if (lane == 0) mbar_expect_tx(&full[slot], 2 * bytes);
        __syncwarp();
        bf16_t* page = pages + (size_t)slot * (PAGE_BYTES / 2);
        if (lane < 2)
            bulk_load(page + lane * ATT_TR * ATT_HD, kv_row(p, lane ? p.v_cache : p.k_cache, layer, kvh, r0), bytes,
                      &full[slot], policy);
    }
    return true;
}

// ---- the consumers' side ----

// Staged positions per round (MK_ATT_ROUND, from the host, which sizes the scratch with it); S
// rows have room for this token's position too (padded to 16 bytes).
constexpr int ATT_ROUND = MK_ATT_ROUND, ATT_S_STRIDE = ATT_ROUND + 4;
// Scores: 8 lanes per position, ATT_LANE_DIMS dims each, heads taken 4 at a time.
constexpr int ATT_LANE_DIMS = ATT_HD / 8, ATT_HEADS_PER_PASS = 4;
// Values: a thread takes 4 dims of every head; the position groups share the consumer threads
// (16 groups at head_dim 64, two to a warp; 8 at 128).
constexpr int ATT_ITEMS = ATT_HD / 4, ATT_GROUPS = CONSUMERS / ATT_ITEMS;
// The scratch layout in floats (its size checked against the host's attention_scratch below):
// S, each warp's partial output, the running output, the queries, this token's K and V, and
// per head the running max, sum and the round's correction factor.
constexpr int ATT_OFF_PART = ATT_G * ATT_S_STRIDE;
constexpr int ATT_OFF_OUT = ATT_OFF_PART + CONSUMER_WARPS * ATT_G * ATT_HD;
constexpr int ATT_OFF_Q = ATT_OFF_OUT + ATT_G * ATT_HD;
constexpr int ATT_OFF_KN = ATT_OFF_Q + ATT_G * ATT_HD;
constexpr int ATT_OFF_VN = ATT_OFF_KN + ATT_HD;
constexpr int ATT_OFF_STATS = ATT_OFF_VN + ATT_HD;
static_assert(ATT_OFF_STATS + 3 * ATT_G == MK_ATT_SCRATCH_FLOATS,
              "attention scratch: the host (attention_scratch in src/gpu/megakernel/layout.rs) sizes it differently");

#define ATT_IN_MAX 4

// The positions of one round: j < nr are staged rows (tile j / ATT_TR of the round, row
// j % ATT_TR), and, when has_new, j == nr is this token's.
struct AttnRound {
    const bf16_t* pages;
    int first_slot, npages, nr;  // the round's tiles take consecutive slots of the ring
    bool has_new;
    __device__ __forceinline__ const bf16_t* k_row(int j) const {
        int slot = first_slot + j / ATT_TR;
        if (slot >= npages) slot -= npages;
        return pages + (size_t)slot * (PAGE_BYTES / 2) + (j % ATT_TR) * ATT_HD;
    }
    __device__ __forceinline__ const bf16_t* v_row(int j) const { return k_row(j) + ATT_TR * ATT_HD; }
};

// Heads [G0, G0 + GN): each octet of lanes scores positions octet, octet + 32, ...; the loop
// runs alike for the warp's four octets (a position past the end is computed on a valid row
// and not stored) so the shuffles see the whole warp.
template <int G0>
__device__ __forceinline__ void attn_scores(const AttnRound& r, const float* qs, const float* kn, float* S, float scale) {
    constexpr int GN = ATT_G - G0 < ATT_HEADS_PER_PASS ? ATT_G - G0 : ATT_HEADS_PER_PASS;
    constexpr int LD = ATT_LANE_DIMS;
    const int ct = threadIdx.x - 32, octet = ct >> 3, q8 = ct & 7, n = r.nr + (r.has_new ? 1 : 0);
    float q[GN][LD];
#pragma unroll
    for (int g = 0; g < GN; g++)
#pragma unroll
        for (int i = 0; i < LD; i += 4) *(float4*)&q[g][i] = *(const float4*)(qs + (G0 + g) * ATT_HD + q8 * LD + i);
#pragma unroll 2
    for (int j0 = octet & ~3; j0 < n; j0 += CONSUMERS / 8) {
        const int j = min(j0 + (octet & 3), n - 1);
        float k[LD];
        if (j < r.nr) {
            const bf16_t* row = r.k_row(j) + q8 * LD;
#pragma unroll
            for (int i = 0; i < LD; i += 8) widen8(*(const uint4*)(row + i), k + i);
        } else {
#pragma unroll
            for (int i = 0; i < LD; i += 4) *(float4*)&k[i] = *(const float4*)(kn + q8 * LD + i);
        }
        float dot[GN];
#pragma unroll
        for (int g = 0; g < GN; g++) {
            dot[g] = 0.f;
#pragma unroll
            for (int i = 0; i < LD; i++) dot[g] = fmaf(q[g][i], k[i], dot[g]);
        }
#pragma unroll
        for (int o = 4; o > 0; o >>= 1)
#pragma unroll
            for (int g = 0; g < GN; g++) dot[g] += __shfl_xor_sync(0xffffffffu, dot[g], o);
        if (q8 == 0 && j0 + (octet & 3) < n)
#pragma unroll
            for (int g = 0; g < GN; g++) S[(G0 + g) * ATT_S_STRIDE + j] = dot[g] * scale;
    }
    if constexpr (G0 + GN < ATT_G) attn_scores<G0 + GN>(r, qs, kn, S, scale);
}

// One warp per head: the round's max; S becomes exp(S - new max); the running max and sum
// move on, and corr keeps the factor that rescales the running output.
__device__ __forceinline__ void attn_softmax(int n, float* S, float* stats) {
    const int ct = threadIdx.x - 32, cw = ct >> 5, lane = ct & 31;
    for (int g = cw; g < ATT_G; g += CONSUMER_WARPS) {
        float* s = S + g * ATT_S_STRIDE;
        float mx = NEG_INF;
        for (int j = lane; j < n; j += 32) mx = fmaxf(mx, s[j]);
        const float m_old = stats[g], m_new = fmaxf(m_old, warp_max(mx));
        float sum = 0.f;
        for (int j = lane; j < n; j += 32) {
            const float e = __expf(s[j] - m_new);
            s[j] = e;
            sum += e;
        }
        sum = warp_sum(sum);
        if (lane == 0) {
            const float corr = __expf(m_old - m_new);  // m_old = -inf in the first round: 0
            stats[g] = m_new;
            stats[ATT_G + g] = stats[ATT_G + g] * corr + sum;
            stats[2 * ATT_G + g] = corr;
        }
    }
}

// Thread (group, item) sums P · V over staged positions group, group + ATT_GROUPS, ... for 4
// dims of every head, so each V row is read once for all of them (unrolled, so several rows'
// loads are in flight); the group that this token's position falls to adds it. The groups
// sharing a warp are added by shuffles, and each warp leaves one partial output.
__device__ __forceinline__ void attn_values(const AttnRound& r, const float* S, const float* vn, float* part) {
    const int ct = threadIdx.x - 32, item = ct % ATT_ITEMS, grp = ct / ATT_ITEMS, d0 = item * 4;
    float acc[ATT_G][4];
#pragma unroll
    for (int g = 0; g < ATT_G; g++)
#pragma unroll
        for (int i = 0; i < 4; i++) acc[g][i] = 0.f;
    auto add = [&](int j, const float* v) {
#pragma unroll
        for (int g = 0; g < ATT_G; g++) {
            const float pj = S[g * ATT_S_STRIDE + j];
#pragma unroll
            for (int i = 0; i < 4; i++) acc[g][i] = fmaf(pj, v[i], acc[g][i]);
        }
    };
#pragma unroll 2
    for (int j = grp; j < r.nr; j += ATT_GROUPS) {
        const uint2 w = *(const uint2*)(r.v_row(j) + d0);
        const float v[4] = {__uint_as_float(w.x << 16), __uint_as_float(w.x & 0xffff0000u),
                            __uint_as_float(w.y << 16), __uint_as_float(w.y & 0xffff0000u)};
        add(j, v);
    }
    if (r.has_new && grp == r.nr % ATT_GROUPS) add(r.nr, vn + d0);
#pragma unroll
    for (int o = ATT_ITEMS; o < 32; o <<= 1)
#pragma unroll
        for (int g = 0; g < ATT_G; g++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[g][i] += __shfl_xor_sync(0xffffffffu, acc[g][i], o);
    if ((ct & 31) < ATT_ITEMS)
#pragma unroll
        for (int g = 0; g < ATT_G; g++)
            *(float4*)(part + ((ct >> 5) * ATT_G + g) * ATT_HD + d0) = make_float4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
}

// Output element i (head i / head_dim of the group, dim i % head_dim): the whole attention
// output, or with split KV this part's normalised output and, once per head, its max and sum.
__device__ __forceinline__ void attn_store(const MkParams& p, const u32* w, int i, float o, float M, float L) {
    const int layer = w[W_LAYER], kvh = w[W_A], part = w[W_B], parts = w[W_C];
    const int d = i % ATT_HD, head = kvh * ATT_G + i / ATT_HD;
    const u32 tag = launch_tag(p);
    if (parts == 1) {
        st_tagged(p.attn_out + ((size_t)layer * p.heads + head) * ATT_HD + d, o, tag);
    } else {
        u64* dst = p.attn_part + (((size_t)layer * p.heads + head) * parts + part) * (ATT_HD + 2);
        st_tagged(dst + d, o, tag);
        if (d == 0) { st_tagged(dst + ATT_HD, M, tag); st_tagged(dst + ATT_HD + 1, L, tag); }
    }
}

// Waits for tiles [t0, t1) of the instruction's staged K/V; false when a page wait failed.
__device__ __forceinline__ bool attn_pages(const MkParams& p, u32 instr, u32 seq, u64* full, int t0, int t1) {
    for (int t = t0; t < t1; t++) {
        const u32 s = seq + t;
        if (!page_wait(p, &full[s % p.pages], (s / p.pages) & 1, ERR_PAGE_CONSUMER, instr, s)) return false;
    }
    return true;
}

// Returns how many of the ring's tiles (staged K/V) it consumed.
__device__ u32 op_attention(const MkParams& p, const u32* w, const TokenMeta& m, u32 instr, u32 seq,
                            const bf16_t* pages, u64* full, u64* empty, float* scratch, u64* prof) {
    constexpr int hd = ATT_HD, G = ATT_G;
    const int ct = threadIdx.x - 32;
    const int layer = w[W_LAYER], kvh = w[W_A];
    const AttnRange a = attn_range(w, m.pos);
    float* S = scratch;
    float* partial = scratch + ATT_OFF_PART;
    float* out = scratch + ATT_OFF_OUT;
    float* qs = scratch + ATT_OFF_Q;
    float* kn = scratch + ATT_OFF_KN;
    float* vn = scratch + ATT_OFF_VN;
    float* stats = scratch + ATT_OFF_STATS;  // [max][sum][corr] per head
    const int n = a.cached_end - a.p0;
    const int round_tiles = min(p.pages, ATT_ROUND / ATT_TR), ntiles = (n + ATT_TR - 1) / ATT_TR;
    // The first round's K/V rows do not depend on this step: they are waited for before the
    // inputs, so that the wait is off the critical path.
    if (!attn_pages(p, instr, seq, full, 0, min(ntiles, round_tiles))) set_failed(1);
    for (int i = ct; i < G * hd; i += CONSUMERS) out[i] = 0.f;
    if (ct < G) { stats[ct] = NEG_INF; stats[G + ct] = 0.f; }
    {
        // The queries and (for the last part) this token's K and V rows, read as one batch:
        // element i < G·hd is a query value, then hd of K, then hd of V (contiguous in scratch).
        const u64* qsrc = p.q + (size_t)layer * p.heads * hd + kvh * G * hd;
        const u64* ksrc = p.kv_new + ((size_t)layer * 2 * p.kv_heads + kvh) * hd;
        const u64* vsrc = ksrc + (size_t)p.kv_heads * hd;
        const int nq = G * hd, nin = nq + (a.has_new ? 2 * hd : 0);
        auto src = [&](int i) { return i < nq ? qsrc + i : i < nq + hd ? ksrc + (i - nq) : vsrc + (i - nq - hd); };
        for (int i0 = ct; i0 < nin; i0 += ATT_IN_MAX * CONSUMERS) {
            const int mine = min(ATT_IN_MAX, (nin - i0 + CONSUMERS - 1) / CONSUMERS);
            u64 raw[ATT_IN_MAX];
#pragma unroll
            for (int k = 0; k < ATT_IN_MAX; k++) raw[k] = k < mine ? ld_tagged(src(i0 + k * CONSUMERS)) : 0;
            settle<ATT_IN_MAX>(p, raw, [&](int k) { return src(i0 + k * CONSUMERS); }, mine);
#pragma unroll
            for (int k = 0; k < ATT_IN_MAX; k++)
                if (k < mine) qs[i0 + k * CONSUMERS] = tagged_float(raw[k]);
        }
    }
    if (consumers_failed()) return ntiles;
    if (ct == 0 && prof) prof[PROF_PREPARED] = global_ns();
    if (n == 0 && !a.has_new) {
        // A part with no position (more parts than positions): an empty softmax.
        for (int i = ct; i < G * hd; i += CONSUMERS) attn_store(p, w, i, 0.f, NEG_INF, 0.f);
        return 0;
    }
    const float scale = rsqrtf((float)hd);
    for (int t0 = 0; t0 == 0 || t0 < ntiles; t0 += round_tiles) {
        const int t1 = min(ntiles, t0 + round_tiles);
        const AttnRound r{pages, (int)((seq + t0) % p.pages), p.pages, min(n, t1 * ATT_TR) - t0 * ATT_TR,
                          a.has_new && t0 == 0};
        if (t0 > 0) {
            if (!attn_pages(p, instr, seq, full, t0, t1)) set_failed(1);
            if (consumers_failed()) return ntiles;
        }
        attn_scores<0>(r, qs, kn, S, scale);
        consumers_sync();
        attn_softmax(r.nr + (r.has_new ? 1 : 0), S, stats);
        consumers_sync();
        // Profile words 4 and 5 (the loader's for a mat-vec): scores and softmax done, and the
        // weighted values (the last round's).
        if (ct == 0 && prof) prof[PROF_EXTRA1] = global_ns();
        attn_values(r, S, vn, partial);
        consumers_sync();
        if (ct == 0 && prof) prof[PROF_EXTRA2] = global_ns();
        // The round's pages go back to the loader (each "empty" barrier counts two arrivals).
        if (ct < t1 - t0) {
            u64* bar = &empty[(seq + t0 + ct) % p.pages];
            mbar_arrive(bar);
            mbar_arrive(bar);
        }
        // The running output takes this round's values; after the last round it is divided by
        // the sum and stored.
        const bool last = t1 >= ntiles;
        for (int i = ct; i < G * hd; i += CONSUMERS) {
            const int g = i / hd;
            float v = out[i] * stats[2 * G + g];
#pragma unroll
            for (int k = 0; k < CONSUMER_WARPS; k++) v += partial[k * G * hd + i];
            if (last) attn_store(p, w, i, v / stats[G + g], stats[g], stats[G + g]);
            else out[i] = v;
        }
        if (!last) consumers_sync();
    }
    return ntiles;
}

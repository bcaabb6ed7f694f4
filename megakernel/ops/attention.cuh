// Attention(layer, kv_head, part, parts): softmax attention of a KV head's query heads over
// positions [p0, p1) of the sequence.
//
// The K and V rows before pos sit in shared memory: the loader staged them in pages (see
// load_attention below). Row pos (this token's) comes tagged from kv_new.
//
// Two ways to compute it, chosen at compile time by the shape (ATT_BY_WARPS):
// - by warps (when a lane's queries and output fit its registers for the whole group, group x
//   head_dim / 8 <= 32, e.g. Llama-1B and SmolLM2, or at head_dim 128 for half of it, ATT_HG):
//   tile t goes to warp pair t % TILE_GROUPS and each warp of the pair takes half its rows
//   (with two head groups, all its rows for its half of the heads), with its own online
//   softmax in registers; a warp frees each page as soon as it is done with it, no barrier
//   until the warps' results are merged once at the end (see attn_by_warps). A long part
//   streams at the rate the pages arrive; a short one is spread over every warp.
// - by rounds (the other shapes): all eight consumer warps work on every step of a round,
//   each step ending at a barrier:
//   scores   S[g][j] = q_g · k_j * scale: 8 lanes per position, each a slice of the dims;
//   softmax  one warp per head: the round's max and sum, S turned into exp(S - max);
//   values   thread (4 dims, position group) sums P · V over its positions for every head;
//   combine  thread (head, dim) adds the warps' partial sums into the running output.
// A round is at most ATT_ROUND staged positions (and this token's, in the first round); longer
// parts take several, carried by an online softmax (running max, sum and output per head).

// ---- the loader's side: K/V tiles ----
// Attention(layer, kv_head, part, parts) covers positions [p0, p1) of the len = pos + 1 long
// sequence. Its K and V rows before pos were written by earlier steps, so they do not depend
// on this step: the loader stages them in pages like weight tiles, long before the
// instruction runs, and attention reads them from shared memory. Row pos (this token's) comes
// tagged from kv_new. A tile holds ATT_TR rows of K, then the same rows of V; the cache is
// head-major ([layer][kv_head][position][head_dim]) so each is one bulk copy.
// The kernel is compiled for the model's head_dim and the query heads an instruction computes
// (the host passes -DMK_HEAD_DIM and -DMK_GROUP: a KV head's whole group, MK_KV_GROUP, or the
// schedule's share of it), so attention's loops have constant trip counts. An instruction's
// first query head is its word W_D (head_start); with a share of a group, each share reads
// the KV head's rows itself.

#ifndef MK_KV_GROUP
#define MK_KV_GROUP MK_GROUP
#endif
constexpr int ATT_HD = MK_HEAD_DIM, ATT_G = MK_GROUP, ATT_KV_G = MK_KV_GROUP;
static_assert(ATT_KV_G % ATT_G == 0, "an instruction's heads are a share of a KV head's group");
static_assert(ATT_HD == 64 || ATT_HD == 128, "head_dim 64 or 128");
// K/V positions a tile: its K rows, then its V rows, at the start of a page (MK_ATT_TILE_BYTES
// from the host, at most a page).
constexpr int ATT_TR = MK_ATT_TILE_BYTES / (4 * ATT_HD);
static_assert(MK_ATT_TILE_BYTES <= PAGE_BYTES, "a K/V tile fits a page");

struct AttnRange {
    int p0, cached_end;  // the rows staged in tiles: [p0, cached_end)
    bool has_new;        // the part ends at pos: row pos is folded in from kv_new
};

// The part's range in 32-bit arithmetic (a 64-bit division is a call into a slow path): exact
// while parts x (len + 1) stays below 2^32, which the host checks for the context it allocates
// (Megakernel::with_buckets). MK_ATT_RANGE32=0 gives the 64-bit form, for measuring.
#ifndef MK_ATT_RANGE32
#define MK_ATT_RANGE32 1
#endif
__device__ __forceinline__ AttnRange attn_range(const u32* w, u32 pos) {
    const int part = w[W_B], parts = w[W_C], len = pos + 1;
#if MK_ATT_RANGE32
    const int p0 = (int)((u32)part * (u32)len / (u32)parts), p1 = (int)((u32)(part + 1) * (u32)len / (u32)parts);
#else
    const int p0 = (int)((long long)part * len / parts), p1 = (int)((long long)(part + 1) * len / parts);
#endif
    return {p0, p1 == len ? len - 1 : p1, p1 == len};
}

// MK_ATT_LOADER_STAMPS=1 (for measuring, through MEGAINFER_MK_DEFINES): profile words 4 and 5
// of an attention instruction are the loader's, when it reached the instruction and when it
// issued its last K/V tile (scripts/loader-rate.py), instead of the consumers' steps.
#ifndef MK_ATT_LOADER_STAMPS
#define MK_ATT_LOADER_STAMPS 0
#endif
// MK_ATT_PAGE_STAMPS=1 (for measuring): word 5 of a part computed by warps is when consumer warp
// 0's last page wait returned (scripts/timeline.py --att-pages), instead of the merge's end: how
// much of the part's time goes to waiting for its K/V tiles rather than computing on them.
// =2: word 4 is then when the loader issued that tile (warp pair 0's last), instead of the
// tiles done (scripts/timeline.py --att-issue): whether a late page was issued late (the ring,
// the loader's limits) or took long to land. =3: word 4 is when warp 0 began that wait (with
// =2, whether the page was late or warp 0 came to it late).
#ifndef MK_ATT_PAGE_STAMPS
#define MK_ATT_PAGE_STAMPS 0
#endif
static_assert(!(MK_ATT_LOADER_STAMPS && MK_ATT_PAGE_STAMPS), "words 4 and 5 take one kind of stamp");
// MK_ATT_SKIP_BLOCKS=1 (for measuring only: the output is wrong): a warp computes the blocks of
// its first tile only, the later tiles' page waits and releases kept, so a profile shows how
// much of a part's time is its arithmetic and how much its pages (the first tile's blocks keep
// every part's sums finite).
#ifndef MK_ATT_SKIP_BLOCKS
#define MK_ATT_SKIP_BLOCKS 0
#endif
// MK_ATT_TWICE=1 (for measuring only: the output is wrong): a warp computes its first tile's
// blocks twice, the second time on code and data just used, so a profile shows what the first
// pass costs beyond the arithmetic.
#ifndef MK_ATT_TWICE
#define MK_ATT_TWICE 0
#endif
// MK_ATT_V_SPREAD=1 (for measuring only: the output is wrong): AttnMma's lanes read their V rows
// at 16-byte pieces (r + 2 qd) % 8 instead of r, so a quarter warp's loads fall in distinct
// banks (the four rows a quarter warp reads at piece r lie 128 bytes apart: the same banks,
// a 4-way conflict), to show what the conflicts cost.
#ifndef MK_ATT_V_SPREAD
#define MK_ATT_V_SPREAD 0
#endif

// Bytes in flight: an SM's share of the read bandwidth is ~3.1 TB/s / 132 = 23.5 GB/s, and a
// copy takes ~1 µs from issue to landing under load, so by Little's law each SM needs about
// 23.5 GB/s x 1 µs = ~24 KB in flight to stream at its share. A tile is 16 KB (K and V rows);
// the loader keeps up to MK_INFLIGHT_STREAM = 4 tiles (64 KB) in flight while the consumers
// work on this instruction and MK_INFLIGHT = 2 (32 KB) while they are still on earlier ones:
// both above 24 KB, so the copies keep up as long as the consumers free the pages as fast,
// i.e. each of the four warp pairs finishes a tile within ~4 x 0.7 µs.
// Stages an attention instruction's K/V tiles; false when a page wait failed.
// In a generation (pos0: the launch's first position) rows from pos0 on were written by this
// launch's steps: a tile holding one waits until the loader has acquired that step's rows
// (rows_of_step_ready in runtime.cuh; `verified` counts the steps acquired).
__device__ bool load_attention(const MkParams& p, const u32* w, u32 pos, u32 pos0, u32& verified, u32 instr, u32& seq,
                               bf16_t* pages, u64* full, u64* empty, u64 policy) {
    const int lane = threadIdx.x & 31, layer = w[W_LAYER], kvh = w[W_A];
    const AttnRange a = attn_range(w, pos);
    u64* prof = MK_ATT_LOADER_STAMPS && p.profile ? p.profile + (size_t)instr * PROF_WORDS : nullptr;
    if (prof && lane == 0) prof[PROF_EXTRA1] = global_ns();
    // MK_ATT_PAGE_STAMPS=2: the tile consumer warp 0 waits for last (pair 0's last).
    const int last_of_pair0 = ((a.cached_end - a.p0 + ATT_TR - 1) / ATT_TR - 1) / TILE_GROUPS * TILE_GROUPS;
    for (int r0 = a.p0; r0 < a.cached_end; r0 += ATT_TR, seq++) {
        const u32 slot = seq % MK_RING(p), round = seq / MK_RING(p);
        if (MK_TILE_NOTES && lane == 0) note(p, 3, seq);
        const int rows = min(ATT_TR, a.cached_end - r0);
        const int last = r0 + rows - 1;
        if (last >= (int)pos0 && (u32)(last - pos0) >= verified) {
            if (!rows_of_step_ready(p, last - pos0)) return false;
            verified = last - pos0 + 1;
        }
        const u32 bytes = (u32)rows * ATT_HD * 2;
        if (!page_wait(p, &empty[slot], (round & 1) ^ 1, ERR_PAGE_LOADER, instr, seq)) return false;
        if (!inflight_wait<MK_INFLIGHT_ATT, MK_INFLIGHT_ATT_STREAM>(p, full, seq, instr)) return false;
        if (lane == 0) mbar_expect_tx(&full[slot], 2 * bytes);
        __syncwarp();
        bf16_t* page = pages + (size_t)slot * (PAGE_BYTES / 2);
        if (MK_ATT_PAGE_STAMPS == 2 && p.profile && lane == 0 && (r0 - a.p0) / ATT_TR == last_of_pair0)
            p.profile[(size_t)instr * PROF_WORDS + PROF_EXTRA1] = global_ns();
        if (lane < 2)
            bulk_load(page + lane * ATT_TR * ATT_HD, kv_row(p, lane ? p.v_cache : p.k_cache, layer, kvh, r0), bytes,
                      &full[slot], policy);
    }
    if (prof && lane == 0) prof[PROF_EXTRA2] = global_ns();
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
// The rounds' partial outputs (MK_ATT_PART_SLOTS, from the host's attention_part_slots in
// src/gpu/megakernel/layout.rs): one a consumer warp, or where the heads' outputs are more
// than 512 floats (Qwen2.5-7B's whole groups of 7 heads of 128, which its split-KV buckets
// compute) one a warp pair, so that the scratch leaves the weight ring 12 pages instead of 8.
// Attention by warps (never on those shapes) keeps one a warp.
constexpr int ATT_PART_SLOTS = MK_ATT_PART_SLOTS;
constexpr bool ATT_PART_PAIRS = ATT_PART_SLOTS < CONSUMER_WARPS;
static_assert(ATT_PART_SLOTS == CONSUMER_WARPS || ATT_PART_SLOTS == CONSUMER_WARPS / 2,
              "a partial output a consumer warp or a warp pair");
// The scratch layout in floats (its size checked against the host's attention_scratch below):
// S, the partial outputs, the running output, the queries, this token's K and V, and per head
// the running max, sum and the round's correction factor.
constexpr int ATT_OFF_PART = ATT_G * ATT_S_STRIDE;
constexpr int ATT_OFF_OUT = ATT_OFF_PART + ATT_PART_SLOTS * ATT_G * ATT_HD;
constexpr int ATT_OFF_Q = ATT_OFF_OUT + ATT_G * ATT_HD;
constexpr int ATT_OFF_KN = ATT_OFF_Q + ATT_G * ATT_HD;
constexpr int ATT_OFF_VN = ATT_OFF_KN + ATT_HD;
constexpr int ATT_OFF_STATS = ATT_OFF_VN + ATT_HD;
static_assert(ATT_OFF_STATS + 3 * ATT_G == MK_ATT_SCRATCH_FLOATS,
              "attention scratch: the host (attention_scratch in src/gpu/megakernel/layout.rs) sizes it differently");

// Tagged inputs a consumer thread reads per batch: the queries of the group and this token's K
// and V in one batch (one round trip) on every shape, at least 4 (Qwen2.5-7B's 7 query heads of
// 128 need 5).
#ifndef ATT_IN_MAX
#define ATT_IN_MAX ((ATT_G + 2) * ATT_HD > 4 * CONSUMERS ? ((ATT_G + 2) * ATT_HD + CONSUMERS - 1) / CONSUMERS : 4)
#endif

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
        // Shuffles order no memory: every lane read stats[g] above, and lane 0 rewrites it.
        __syncwarp();
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
// sharing a warp are added by shuffles, and each warp leaves one partial output (with
// ATT_PART_PAIRS each pair one: the odd warp stores its own, then after a barrier the even
// warp adds its own to it).
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
    if constexpr (ATT_PART_PAIRS) {
        const int cw = ct >> 5;
        float* slot = part + (cw >> 1) * ATT_G * ATT_HD + d0;
        if ((cw & 1) && (ct & 31) < ATT_ITEMS)
#pragma unroll
            for (int g = 0; g < ATT_G; g++)
                *(float4*)(slot + g * ATT_HD) = make_float4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
        consumers_sync();
        if (!(cw & 1) && (ct & 31) < ATT_ITEMS)
#pragma unroll
            for (int g = 0; g < ATT_G; g++) {
                const float4 o = *(const float4*)(slot + g * ATT_HD);
                *(float4*)(slot + g * ATT_HD) = make_float4(o.x + acc[g][0], o.y + acc[g][1], o.z + acc[g][2], o.w + acc[g][3]);
            }
    } else if ((ct & 31) < ATT_ITEMS) {
#pragma unroll
        for (int g = 0; g < ATT_G; g++)
            *(float4*)(part + ((ct >> 5) * ATT_G + g) * ATT_HD + d0) = make_float4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
    }
}

// Output element i (head i / head_dim of the group, dim i % head_dim): the whole attention
// output, or with split KV this part's normalised output and, once per head, its max and sum.
__device__ __forceinline__ void attn_store(const MkParams& p, const u32* w, int i, float o, float M, float L) {
    const int layer = w[W_LAYER], part = w[W_B], parts = w[W_C];
    const int d = i % ATT_HD, head = (int)w[W_D] + i / ATT_HD;
    const u32 tag = step_tag();
    if (parts == 1) {
        st_tagged(p.attn_out + ((size_t)layer * p.heads + head) * ATT_HD + d, o, tag);
    } else {
        u64* dst = p.attn_part + (((size_t)layer * p.heads + head) * parts + part) * (ATT_HD + 2);
        st_tagged(dst + d, o, tag);
        if (d == 0) { st_tagged(dst + ATT_HD, M, tag); st_tagged(dst + ATT_HD + 1, L, tag); }
    }
}

// Tiles [t0, t1) of the instruction's staged K/V back to the loader, by consumers that are all
// past a barrier after their last read of them: one thread a page (racecheck's build: every
// consumer on every page, for its own reads).
__device__ __forceinline__ void attn_release_pages(const MkParams& p, u64* empty, u32 seq, int t0, int t1) {
#if defined(MK_LANE_ARRIVALS) && MK_LANE_ARRIVALS
    for (int i = 0; i < t1 - t0; i++) mbar_arrive(&empty[(seq + t0 + i) % MK_RING(p)]);
#else
    const int ct = threadIdx.x - 32;
    if (ct < t1 - t0) release_page_for_both(&empty[(seq + t0 + ct) % MK_RING(p)]);
#endif
}

// Waits for tiles [t0, t1) of the instruction's staged K/V; false when a page wait failed.
__device__ __forceinline__ bool attn_pages(const MkParams& p, u32 instr, u32 seq, u64* full, int t0, int t1) {
    for (int t = t0; t < t1; t++) {
        const u32 s = seq + t;
        if (!page_wait(p, &full[s % MK_RING(p)], (s / MK_RING(p)) & 1, ERR_PAGE_CONSUMER, instr, s)) return false;
    }
    return true;
}

// ---- by warps ----
// Tile t (ATT_TR positions) goes to warp pair t % TILE_GROUPS (the page count is a multiple of
// TILE_GROUPS, so a page is always consumed by the same pair, as for weight tiles); each warp
// of the pair takes ATT_WROWS of its rows, in blocks of ATT_WSTEPS steps of 4 positions, one
// per octet of lanes (8 lanes splitting the dims: lane q8 holds dims 64 j + 8 q8 + e, so that an octet
// reads a row's 16-byte pieces side by side). Each "empty" barrier counts two arrivals: the
// pair's two warps.
// A warp's rows are taken ATT_BROWS at a time, one online-softmax step each (16 rows: the
// scores of a longer block held in registers beside the queries and the output made
// Llama-1B's kernel spill).
// A lane holds its queries and output for ATT_WG heads (ATT_WG x head_dim / 8 floats each, at
// most 32 registers): all the group's where they fit, else the group's heads are split into
// ATT_HG = 2 head groups, warp cw taking group cw % 2 (Llama-3.2-3B, Qwen3-4B, Qwen3-8B,
// Llama-3.1-8B), and both warps of a pair then take a tile's every row, each for its heads
// (the same work a warp, the same two arrivals a page). Measured on the H100 against
// rounds (BENCHMARKS.md): Llama-3.2-3B and Qwen3-8B 0.5% and 1.3% faster at short contexts,
// Qwen3-4B level, Llama-3.2-3B and Qwen3-4B 3.3% and 5.5% faster at 8K; Qwen2.5-0.5B's
// (head_dim 64, 7 heads: 4 and 3) 3.1% slower at short contexts, so two head groups are taken
// at head_dim 128 only. Groups of more heads (Qwen2.5-7B's 7 of 128) compute by rounds.
#ifndef MK_ATT_MMA
#define MK_ATT_MMA 0
#endif
// With the values transposed on the tensor cores (MK_ATT_MMA=2, below) a warp takes a group of
// up to 4 heads whole, at head_dim 128 too.
constexpr int ATT_WG = MK_ATT_MMA == 2 && ATT_G <= 4 ? ATT_G : ATT_G * ATT_LANE_DIMS <= 32 ? ATT_G : 32 / ATT_LANE_DIMS;
constexpr int ATT_HG = (ATT_G + ATT_WG - 1) / ATT_WG;
// (8-row blocks where a warp has fewer than 16 rows of a tile: K/V tiles of 8 KiB at head_dim
// 128, in the measuring builds with pages smaller than 16 KiB.)
constexpr int ATT_WROWS = ATT_TR * ATT_HG / 2, ATT_BROWS = ATT_WROWS < 16 ? ATT_WROWS : 16,
              ATT_WSTEPS = ATT_BROWS / 4;
// MK_ATT_BY_WARPS=0 (through MEGAINFER_MK_DEFINES) keeps the round-based way for every
// shape, for measuring one against the other.
#ifndef MK_ATT_BY_WARPS
#define MK_ATT_BY_WARPS 1
#endif
constexpr bool ATT_BY_WARPS = MK_ATT_BY_WARPS && (ATT_HG == 1 || (ATT_HG == 2 && ATT_HD == 128));
// Short parts spread over every warp (attn_by_warps): rows a block (4, 8 or 16: a divisor of a
// tile's rows, so no block straddles two pages) and the longest part spread (0: none, the code
// compiled out, as the host compiles the split-KV buckets' kernel: compiled in, it made their
// long parts stream 1-4% slower at 8K on the H100).
#ifndef MK_ATT_SPREAD_ROWS
#define MK_ATT_SPREAD_ROWS 8
#endif
#ifndef MK_ATT_SPREAD_MAX
#define MK_ATT_SPREAD_MAX 192
#endif
constexpr int ATT_SPREAD_ROWS = MK_ATT_SPREAD_ROWS, ATT_SPREAD_MAX = MK_ATT_SPREAD_MAX;
static_assert(ATT_SPREAD_ROWS % 4 == 0 && ATT_TR % ATT_SPREAD_ROWS == 0, "spread blocks lie within a tile");

__device__ __forceinline__ int attn_lane_dim(int q8, int k) { return (k >> 3) * 64 + q8 * 8 + (k & 7); }

// Rows [0, rows) of a block of the warp's (1 <= rows <= 4 ST: ST steps of 4 positions):
// scores, the online softmax step (running max m, sum l, output acc; per lane a slice of the
// dims, summed over its octet's positions) and the weighted values, for the warp's ATT_WG
// heads. Positions past rows are computed on the last valid row and weigh 0.
template <int ST>
__device__ __forceinline__ void attn_warp_block(const bf16_t* kp, const bf16_t* vp, int rows,
                                               const float (&q)[ATT_WG][ATT_LANE_DIMS], float (&m)[ATT_WG],
                                               float (&l)[ATT_WG], float (&acc)[ATT_WG][ATT_LANE_DIMS], float scale) {
    constexpr int G = ATT_WG, LD = ATT_LANE_DIMS, HD = ATT_HD;
    const int lane = threadIdx.x & 31, octet = lane >> 3, q8 = lane & 7;
    float s[G][ST];
#pragma unroll
    for (int st = 0; st < ST; st++) {
        const bf16_t* kr = kp + min(st * 4 + octet, rows - 1) * HD + q8 * 8;
        float k[LD];
#pragma unroll
        for (int j = 0; j < LD / 8; j++) widen8(*(const uint4*)(kr + 64 * j), k + 8 * j);
#pragma unroll
        for (int g = 0; g < G; g++) {
            float d = 0.f;
#pragma unroll
            for (int i = 0; i < LD; i++) d = fmaf(q[g][i], k[i], d);
            s[g][st] = d;
        }
    }
#pragma unroll
    for (int o = 4; o > 0; o >>= 1)
#pragma unroll
        for (int g = 0; g < G; g++)
#pragma unroll
            for (int st = 0; st < ST; st++) s[g][st] += __shfl_xor_sync(0xffffffffu, s[g][st], o);
#pragma unroll
    for (int g = 0; g < G; g++) {
        float mx = NEG_INF;
#pragma unroll
        for (int st = 0; st < ST; st++) {
            s[g][st] = st * 4 + octet < rows ? s[g][st] * scale : NEG_INF;
            mx = fmaxf(mx, s[g][st]);
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
        // Finite (row 0 is valid); the factor is 0 on the warp's first tile (m = -inf).
        const float mn = fmaxf(m[g], mx), corr = __expf(m[g] - mn);
        float ps = 0.f;
#pragma unroll
        for (int st = 0; st < ST; st++) {
            s[g][st] = __expf(s[g][st] - mn);
            ps += s[g][st];
        }
        ps += __shfl_xor_sync(0xffffffffu, ps, 8);
        ps += __shfl_xor_sync(0xffffffffu, ps, 16);
        l[g] = l[g] * corr + ps;
        m[g] = mn;
#pragma unroll
        for (int i = 0; i < LD; i++) acc[g][i] *= corr;
    }
#pragma unroll
    for (int st = 0; st < ST; st++) {
        const bf16_t* vr = vp + min(st * 4 + octet, rows - 1) * HD + q8 * 8;
        float v[LD];
#pragma unroll
        for (int j = 0; j < LD / 8; j++) widen8(*(const uint4*)(vr + 64 * j), v + 8 * j);
#pragma unroll
        for (int g = 0; g < G; g++)
#pragma unroll
            for (int i = 0; i < LD; i++) acc[g][i] = fmaf(s[g][st], v[i], acc[g][i]);
    }
}

// MK_ATT_MMA=1 (the host compiles it into the split-KV kernels at head_dim 64: compile::defines,
// with the measurements): the by-warps blocks on the tensor cores (mma.sync m16n8k16, bf16 in,
// f32 out) where head_dim is 64 and one head group covers the KV head's query heads (SmolLM2,
// Llama-3.2-1B). A warp's block of 16 positions is then 8 mmas of scores and 8 of values
// instead of ~490 CUDA-core instructions: Llama-1B's long contexts 5-14% faster on the H200;
// SmolLM2's 8K parts took as long as with the CUDA cores (3.4 us, steady from part to part).
// That time is the warps' own work, not their pages (MK_ATT_PAGE_STAMPS=3: warp 0's wait for
// its last page returns within 0.06 us, the page landed long before): a tile's two blocks take
// a warp ~1 us when repeated (MK_ATT_TWICE) and the first tile ~0.9 us more than that, which
// is not instruction fetch (BENCHMARKS.md, 2026-11-28). Taking 32 positions a step instead of
// 16 (four score chains side by side, one softmax step) was not faster.
// Layout (r = lane / 4, qd = lane % 4): an mma's A rows 0-7 are the heads' bf16 high parts, rows
// 8-15 their low parts (x = hi + lo to 2^-17), so each sum comes out in two halves that the
// same lane adds (c0 + c2, c1 + c3). Scores: A = q, B = K (n = position r of an 8-position
// n-tile); at head_dim 64 k-chunk c's index k = 2 qd + e is dim 16 qd + 4c + e and k = 2 qd +
// 8 + e is dim 16 qd + 4c + 2 + e, so a lane reads its K row's dims 16 qd..16 qd + 15 as two
// 16-byte words (odd rows the second word first: no bank conflict) and uses them as they are
// (mma_piece and mma_chunk_base: the general form).
// Values: A = the probabilities (the scores' accumulators are laid out as the A fragment of
// the next mma: positions 2 qd + e and 8 + 2 qd + e), B = V with n-tile t's column r being dim
// 8 r + t, so a lane reads 16 bytes of each of its four rows and pairs their halves with byte
// permutes; O's column 2 qd + e of n-tile t is then dim 16 qd + 8 e + t. Those V reads are a
// 4-way bank conflict (a quarter warp's lanes of one r read piece r of rows 128 bytes apart),
// inherent to a plain row-major page: every k-row mapping keeps a lane's piece tied to r. Read
// without it (MK_ATT_V_SPREAD, wrong output) SmolLM2 at 8K was 2.2% faster, Llama-1B level;
// removing it needs a swizzled page (a tensor copy's 128-byte swizzle) on every reader.
// A function, not a constexpr variable: NVRTC gives such a variable a byte of global memory,
// which moves the other globals' addresses in every kernel.
__device__ __forceinline__ constexpr bool att_mma() {
    return MK_ATT_MMA == 1 ? ATT_BY_WARPS && ATT_HD == 64 && ATT_HG == 1
                           : MK_ATT_MMA == 2 && ATT_BY_WARPS && ATT_HG == 1 && ATT_G <= 4;
}

// Lane quarter qd's 16-byte piece i of a K row (its dims 8 piece .. + 7): head_dim 64 two side
// by side, 128 four a quarter of the row apart (either way rows of the other parity read them
// in swapped pairs, so a warp's loads are conflict-free); k-chunk c's index k = 2 qd + e is dim
// mma_chunk_base + e and k = 2 qd + 8 + e is dim mma_chunk_base + 2 + e.
template <int HD>
__device__ __forceinline__ int mma_piece(int qd, int i) { return HD == 64 ? 2 * qd + i : qd + 4 * i; }
template <int HD>
__device__ __forceinline__ int mma_chunk_base(int qd, int c) { return 8 * mma_piece<HD>(qd, c >> 1) + 4 * (c & 1); }

// q's A fragments per k-chunk: rows 0-7 the heads' high parts, 8-15 their low parts.
template <int HD>
__device__ __forceinline__ void mma_q_frags(const float* qs, u32 (&qa)[HD / 16][4]) {
    const int lane = threadIdx.x & 31, r = lane >> 2, qd = lane & 3;
#pragma unroll
    for (int c = 0; c < HD / 16; c++) {
        float x[4];
#pragma unroll
        for (int e = 0; e < 4; e++)
            x[e] = r < ATT_G ? qs[r * HD + (HD == 64 ? 16 * qd + 4 * c : mma_chunk_base<HD>(qd, c)) + e] : 0.f;
        split_bf16x2(x[0], x[1], qa[c][0], qa[c][1]);
        split_bf16x2(x[2], x[3], qa[c][2], qa[c][3]);
    }
}

// An output's accumulators zeroed, its running max -inf and sum 0 (a warp's first block).
template <int N>
__device__ __forceinline__ void mma_state_zero(float (&o)[N][4], float& m, float& l) {
#pragma unroll
    for (int t = 0; t < N; t++)
#pragma unroll
        for (int e = 0; e < 4; e++) o[t][e] = 0.f;
    m = NEG_INF;
    l = 0.f;
}

// A block's scores for head r at positions 8 j + 2 qd + e (-inf from rows on), then the online
// softmax step on them: m and l move on, s becomes the probabilities (relative to the new max),
// and the factor that rescales the output so far is returned.
template <int HD>
__device__ __forceinline__ float mma_scores_softmax(const bf16_t* kp, int rows, const u32 (&qa)[HD / 16][4],
                                                    float scale, float& m, float& l, float (&s)[2][2]) {
    constexpr int PC = HD / 32;
    const int lane = threadIdx.x & 31, r = lane >> 2, qd = lane & 3;
#pragma unroll
    for (int j = 0; j < 2; j++) {
        float d[4] = {0.f, 0.f, 0.f, 0.f};
        if (j == 0 || rows > 8) {
            const int row = min(8 * j + r, rows - 1), odd = row & 1;
            if constexpr (HD == 64) {
                // The same pieces as below, written out (the form the kernels were measured with).
                const char* kr = (const char*)(kp + row * HD) + 32 * qd;
                const uint4 a = *(const uint4*)(kr + 16 * odd), b = *(const uint4*)(kr + 16 - 16 * odd);
                const uint4 u = odd ? b : a, v = odd ? a : b;
                mma_bf16(d, qa[0], u.x, u.y);
                mma_bf16(d, qa[1], u.z, u.w);
                mma_bf16(d, qa[2], v.x, v.y);
                mma_bf16(d, qa[3], v.z, v.w);
            } else {
                const bf16_t* kr = kp + row * HD;
                uint4 w[PC], u[PC];
#pragma unroll
                for (int i = 0; i < PC; i++) w[i] = *(const uint4*)(kr + 8 * mma_piece<HD>(qd, i ^ odd));
#pragma unroll
                for (int i = 0; i < PC; i++) u[i] = odd ? w[i ^ 1] : w[i];
#pragma unroll
                for (int c = 0; c < HD / 16; c++)
                    mma_bf16(d, qa[c], c & 1 ? u[c >> 1].z : u[c >> 1].x, c & 1 ? u[c >> 1].w : u[c >> 1].y);
            }
        }
        s[j][0] = d[0] + d[2];
        s[j][1] = d[1] + d[3];
    }
    float mx = NEG_INF;
#pragma unroll
    for (int j = 0; j < 2; j++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            s[j][e] = 8 * j + 2 * qd + e < rows ? s[j][e] * scale : NEG_INF;
            mx = fmaxf(mx, s[j][e]);
        }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    // Finite (position 0 is valid); the factor is 0 on the warp's first block (m = -inf).
    const float mn = fmaxf(m, mx), corr = __expf(m - mn);
    float ps = 0.f;
#pragma unroll
    for (int j = 0; j < 2; j++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            s[j][e] = __expf(s[j][e] - mn);
            ps += s[j][e];
        }
    l = l * corr + ps;
    m = mn;
    return corr;
}

struct AttnMma {
    u32 qa[4][4];   // q's A fragments per k-chunk (mma_q_frags)
    float o[8][4];  // the output's accumulators per n-tile of 8 dims (c0, c1 high; c2, c3 low)
    float m, l;     // head r's running max (the same over the quad), this lane's share of the sum

    __device__ __forceinline__ void init(const float* qs) {
        mma_q_frags<64>(qs, qa);
        mma_state_zero(o, m, l);
    }

    // Positions [0, rows) of a block (1 <= rows <= 16): K rows at kp, V rows at vp.
    __device__ __forceinline__ void block(const bf16_t* kp, const bf16_t* vp, int rows, float scale) {
        const int lane = threadIdx.x & 31, r = lane >> 2, qd = lane & 3;
        float s[2][2];
        const float corr = mma_scores_softmax<64>(kp, rows, qa, scale, m, l, s);
        u32 pa[4];
        split_bf16x2(s[0][0], s[0][1], pa[0], pa[1]);
        split_bf16x2(s[1][0], s[1][1], pa[2], pa[3]);
        // Rows past the block's end weigh 0 and are read on its last row (finite values).
        const int last = rows - 1, vc = 8 * (MK_ATT_V_SPREAD ? (r + 2 * qd) & 7 : r);
        const uint4 v0 = *(const uint4*)(vp + min(2 * qd, last) * ATT_HD + vc);
        const uint4 v1 = *(const uint4*)(vp + min(2 * qd + 1, last) * ATT_HD + vc);
        const uint4 v8 = *(const uint4*)(vp + min(2 * qd + 8, last) * ATT_HD + vc);
        const uint4 v9 = *(const uint4*)(vp + min(2 * qd + 9, last) * ATT_HD + vc);
        const u32 w0[4] = {v0.x, v0.y, v0.z, v0.w}, w1[4] = {v1.x, v1.y, v1.z, v1.w};
        const u32 w8[4] = {v8.x, v8.y, v8.z, v8.w}, w9[4] = {v9.x, v9.y, v9.z, v9.w};
#pragma unroll
        for (int t = 0; t < 8; t++) {
            const u32 sel = t & 1 ? 0x7632u : 0x5410u;
#pragma unroll
            for (int e = 0; e < 4; e++) o[t][e] *= corr;
            mma_bf16(o[t], pa, __byte_perm(w0[t >> 1], w1[t >> 1], sel), __byte_perm(w8[t >> 1], w9[t >> 1], sel));
        }
    }
    // The warp's results as attn_by_warps' CUDA-core blocks leave them: head r's output, max
    // and sum in the warp's slots.
    __device__ __forceinline__ void finish(float* partial, float* wstat, int cw) {
        const int lane = threadIdx.x & 31, r = lane >> 2, qd = lane & 3;
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        if (r < ATT_G) {
            float out[16];
#pragma unroll
            for (int t = 0; t < 8; t++) {
                out[t] = o[t][0] + o[t][2];
                out[8 + t] = o[t][1] + o[t][3];
            }
            float* dst = partial + (cw * ATT_G + r) * ATT_HD + 16 * qd;
#pragma unroll
            for (int k = 0; k < 4; k++)
                *(float4*)(dst + 4 * k) = make_float4(out[4 * k], out[4 * k + 1], out[4 * k + 2], out[4 * k + 3]);
            if (qd == 0) {
                wstat[cw * 2 * ATT_G + r] = m;
                wstat[cw * 2 * ATT_G + ATT_G + r] = l;
            }
        }
    }
};

// MK_ATT_MMA=2 (the host compiles it into the split-KV kernels at head_dim 128 with groups of 3
// or 4 heads: compile::defines, with the measurements): the values as O^T = V^T P^T, for groups of
// up to 4 heads at head_dim 64 or 128. An mma's B columns 0-3 are the heads' probabilities'
// high parts and 4-7 their low parts (the scores' accumulators, as AttnMma has them, hand over
// the high parts where they are and the low parts from the lane 16 away), and its A is 16 dims
// of V^T (m-tile t's row m is dim 8 (m % 8) + t + (m / 8) (4 at head_dim 64, 64 at 128), so a
// lane reads 16 bytes of each of its four rows per 64 dims, and pairs their halves with byte
// permutes; the same 4-way bank conflict as AttnMma's V reads). Against AttnMma: half the
// values' mmas (head_dim / 16, not / 8) and half the output's registers (head_dim / 4 a lane),
// which lets head_dim 128 keep its accumulators in registers (AttnMma's layout there needs 64
// of them beside 32 of q's).
struct AttnMmaT {
    // m-tiles; 16-byte pieces of a V row a lane reads (an enum: NVRTC gives static constexpr
    // members storage, which moves every kernel's globals).
    enum : int { MT = ATT_HD / 16, PH = ATT_HD / 64 };
    u32 qa[ATT_HD / 16][4];  // q's A fragments per k-chunk (mma_q_frags)
    float o[MT][4];          // O^T's accumulators per m-tile: rows r, r + 8; columns 2 qd + e
    float m, l;              // head r's running max (the same over the quad), this lane's share of the sum

    __device__ __forceinline__ void init(const float* qs) {
        mma_q_frags<ATT_HD>(qs, qa);
        mma_state_zero(o, m, l);
    }

    // Positions [0, rows) of a block (1 <= rows <= 16): K rows at kp, V rows at vp.
    __device__ __forceinline__ void block(const bf16_t* kp, const bf16_t* vp, int rows, float scale) {
        const int lane = threadIdx.x & 31, r = lane >> 2, qd = lane & 3;
        float s[2][2];
        const float corr = mma_scores_softmax<ATT_HD>(kp, rows, qa, scale, m, l, s);
        // B = P^T: column r is head r's high parts (r < 4) or head r - 4's low parts.
        u32 hi0, lo0, hi1, lo1;
        split_bf16x2(s[0][0], s[0][1], hi0, lo0);
        split_bf16x2(s[1][0], s[1][1], hi1, lo1);
        lo0 = __shfl_xor_sync(0xffffffffu, lo0, 16);
        lo1 = __shfl_xor_sync(0xffffffffu, lo1, 16);
        const u32 b0 = r < 4 ? hi0 : lo0, b1 = r < 4 ? hi1 : lo1;
        // Column 2 qd + e holds head (2 qd + e) % 4, whose factor its quad (lanes 4 h..) has.
        const float c0 = __shfl_sync(0xffffffffu, corr, 4 * ((2 * qd) & 3));
        const float c1 = __shfl_sync(0xffffffffu, corr, 4 * ((2 * qd + 1) & 3));
        // A = V^T: positions 2 qd, 2 qd + 1 (k) and 8 more; rows past the block's end weigh 0
        // and are read on its last row (finite values).
        const int last = rows - 1;
        u32 w[4][4 * PH];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const bf16_t* vr = vp + min(2 * qd + (k & 1) + 8 * (k >> 1), last) * ATT_HD + 8 * r;
#pragma unroll
            for (int h = 0; h < PH; h++) {
                const uint4 v = *(const uint4*)(vr + 64 * h);
                w[k][4 * h] = v.x;
                w[k][4 * h + 1] = v.y;
                w[k][4 * h + 2] = v.z;
                w[k][4 * h + 3] = v.w;
            }
        }
#pragma unroll
        for (int t = 0; t < MT; t++) {
            // Row r's element in the lane's words, and row r + 8's.
            constexpr int HALF = ATT_HD == 64 ? 4 : 8;
            const int e0 = t, e1 = HALF + t;
            const u32 s0 = e0 & 1 ? 0x7632u : 0x5410u, s1 = e1 & 1 ? 0x7632u : 0x5410u;
            const u32 a[4] = {__byte_perm(w[0][e0 >> 1], w[1][e0 >> 1], s0), __byte_perm(w[0][e1 >> 1], w[1][e1 >> 1], s1),
                              __byte_perm(w[2][e0 >> 1], w[3][e0 >> 1], s0), __byte_perm(w[2][e1 >> 1], w[3][e1 >> 1], s1)};
            o[t][0] *= c0;
            o[t][1] *= c1;
            o[t][2] *= c0;
            o[t][3] *= c1;
            mma_bf16(o[t], a, b0, b1);
        }
    }

    // The warp's results as attn_by_warps' CUDA-core blocks leave them: each head's output
    // (columns h and h + 4 added: lanes qd and qd ^ 2), max and sum in the warp's slots.
    __device__ __forceinline__ void finish(float* partial, float* wstat, int cw) {
        const int lane = threadIdx.x & 31, r = lane >> 2, qd = lane & 3;
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
#pragma unroll
        for (int t = 0; t < MT; t++)
#pragma unroll
            for (int e = 0; e < 4; e++) o[t][e] += __shfl_xor_sync(0xffffffffu, o[t][e], 2);
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int h = 2 * qd + e;
            if (qd < 2 && h < ATT_G) {
                float* dst = partial + (cw * ATT_G + h) * ATT_HD + 8 * r;
                float lo[8], hi[8];
#pragma unroll
                for (int t = 0; t < 8; t++) {
                    lo[t] = t < MT ? o[t][e] : 0.f;
                    hi[t] = t < MT ? o[t][2 + e] : 0.f;
                }
                if constexpr (ATT_HD == 64) {
                    // dims 8 r + t (row r, t < 4) and 8 r + 4 + t (row r + 8)
                    *(float4*)dst = make_float4(lo[0], lo[1], lo[2], lo[3]);
                    *(float4*)(dst + 4) = make_float4(hi[0], hi[1], hi[2], hi[3]);
                } else {
                    // dims 8 r + t and 64 + 8 r + t
                    *(float4*)dst = make_float4(lo[0], lo[1], lo[2], lo[3]);
                    *(float4*)(dst + 4) = make_float4(lo[4], lo[5], lo[6], lo[7]);
                    *(float4*)(dst + 64) = make_float4(hi[0], hi[1], hi[2], hi[3]);
                    *(float4*)(dst + 68) = make_float4(hi[4], hi[5], hi[6], hi[7]);
                }
            }
        }
        if (r < ATT_G && qd == 0) {
            wstat[cw * 2 * ATT_G + r] = m;
            wstat[cw * 2 * ATT_G + ATT_G + r] = l;
        }
    }
};

// The whole part by warps (see the top of the file): each warp streams its tiles, then the
// warps' (max, sum, output) and this token's position are merged by thread (head, dim).
// Scratch: the S region holds each warp's max and sum per head, then this token's scores;
// each warp's output goes to its partial region.
__device__ u32 attn_by_warps(const MkParams& p, const u32* w, const AttnRange& a, u32 instr, u32 seq,
                             const bf16_t* pages, u64* full, u64* empty, float* scratch, u64* prof, int n,
                             int ntiles) {
    constexpr int G = ATT_G, WG = ATT_WG, HG = ATT_HG, LD = ATT_LANE_DIMS, HD = ATT_HD, CW = CONSUMER_WARPS;
    static_assert(ATT_WROWS % ATT_BROWS == 0 && LD % 8 == 0, "a warp's rows are whole blocks");
    static_assert((2 * CW + 1) * G <= ATT_OFF_PART, "the warps' statistics fit the score rows");
    static_assert(!(ATT_PART_PAIRS && ATT_BY_WARPS), "attention by warps keeps a partial output a warp");
    const int ct = threadIdx.x - 32, cw = ct >> 5, lane = ct & 31, q8 = lane & 7, octet = lane >> 3;
    // The warp's heads: g0 + g for g < WG (a head past the group's last, where WG does not
    // divide it, is computed on the last head and not kept); its rows: with one head group
    // half of each tile of its pair's, with two the whole tile.
    const int pair = cw >> 1, half = HG == 1 ? cw & 1 : 0, g0 = (cw % HG) * WG;
    const float* qs = scratch + ATT_OFF_Q;
    const float* kn = scratch + ATT_OFF_KN;
    const float* vn = scratch + ATT_OFF_VN;
    float* partial = scratch + ATT_OFF_PART;
    float* wstat = scratch;  // [CW][max[G], sum[G]], then this token's score per head
    const float scale = rsqrtf((float)HD);
    float q[WG][LD], m[WG], l[WG], acc[WG][LD];
#if MK_ATT_MMA == 2
    AttnMmaT mm;
#else
    AttnMma mm;
#endif
    if constexpr (att_mma()) mm.init(qs);
    else
#pragma unroll
    for (int g = 0; g < WG; g++) {
        m[g] = NEG_INF;
        l[g] = 0.f;
#pragma unroll
        for (int i = 0; i < LD; i++) {
            q[g][i] = qs[min(g0 + g, G - 1) * HD + attn_lane_dim(q8, i)];
            acc[g][i] = 0.f;
        }
    }
    // A short part whose tiles all landed before the inputs were read (op_attention) is spread
    // over every warp, ATT_SPREAD_ROWS rows a block, block b to warp b % 8 (with two head
    // groups, to both warps of b % 4), instead of a tile to a pair: at the short contexts of a
    // chat the pairs left most warps idle (one tile of up to 64 positions: two warps, the first
    // taking 32 rows in two blocks). Its pages go back after the barrier below, when every warp
    // is done with them.
    const bool spread = ATT_SPREAD_MAX > 0 && n <= ATT_SPREAD_MAX && ntiles <= min(MK_RING(p), ATT_ROUND / ATT_TR);
    if (spread) {
        for (int r0 = cw / HG * ATT_SPREAD_ROWS; r0 < n; r0 += CW / HG * ATT_SPREAD_ROWS) {
            const u32 slot = (seq + r0 / ATT_TR) % MK_RING(p);
            const bf16_t* kp = pages + (size_t)slot * (PAGE_BYTES / 2) + (r0 % ATT_TR) * HD;
            if constexpr (att_mma()) mm.block(kp, kp + ATT_TR * HD, min(n - r0, ATT_SPREAD_ROWS), scale);
            else
            attn_warp_block<ATT_SPREAD_ROWS / 4>(kp, kp + ATT_TR * HD, min(n - r0, ATT_SPREAD_ROWS), q, m, l, acc,
                                                  scale);
        }
    }
    for (int t = spread ? ntiles : pair; t < ntiles; t += TILE_GROUPS) {
        const u32 sq = seq + t, slot = sq % MK_RING(p);
        if (MK_ATT_PAGE_STAMPS == 3 && ct == 0 && prof && t + TILE_GROUPS >= ntiles) prof[PROF_EXTRA1] = global_ns();
        const bool landed = page_wait(p, &full[slot], (sq / MK_RING(p)) & 1, ERR_PAGE_CONSUMER, instr, sq);
        if (MK_ATT_PAGE_STAMPS && ct == 0 && prof) prof[PROF_EXTRA2] = global_ns();
        // The whole warp goes on or stops together (the tile's shuffles need every lane).
        if (!__all_sync(0xffffffffu, landed)) {
            set_failed(1);
            break;
        }
        const int rows = min(ATT_TR, n - t * ATT_TR) - half * ATT_WROWS;
        const bf16_t* kp = pages + (size_t)slot * (PAGE_BYTES / 2) + half * ATT_WROWS * HD;
        for (int rep = 0; rep < (MK_ATT_TWICE && t == pair ? 2 : 1); rep++)
#pragma unroll
        for (int b = 0; b < ATT_WROWS / ATT_BROWS; b++)
            if ((!MK_ATT_SKIP_BLOCKS || t == pair) && rows > b * ATT_BROWS) {
                if constexpr (att_mma())
                    mm.block(kp + b * ATT_BROWS * HD, kp + (ATT_TR + b * ATT_BROWS) * HD,
                             min(rows - b * ATT_BROWS, ATT_BROWS), scale);
                else
                attn_warp_block<ATT_WSTEPS>(kp + b * ATT_BROWS * HD, kp + (ATT_TR + b * ATT_BROWS) * HD,
                                min(rows - b * ATT_BROWS, ATT_BROWS), q, m, l, acc, scale);
            }
        release_page(&empty[slot], lane);
    }
    // The warp's output: its four octets' sums (stored at the heads' places in the group).
    if constexpr (att_mma()) mm.finish(partial, wstat, cw);
    else {
#pragma unroll
    for (int g = 0; g < WG; g++)
#pragma unroll
        for (int i = 0; i < LD; i++) {
            acc[g][i] += __shfl_xor_sync(0xffffffffu, acc[g][i], 8);
            acc[g][i] += __shfl_xor_sync(0xffffffffu, acc[g][i], 16);
        }
    if (octet == 0)
#pragma unroll
        for (int g = 0; g < WG; g++)
            if (g0 + g < G)
#pragma unroll
            for (int j = 0; j < LD / 8; j++) {
                float* dst = partial + (cw * G + g0 + g) * HD + 64 * j + 8 * q8;
                *(float4*)dst = make_float4(acc[g][8 * j], acc[g][8 * j + 1], acc[g][8 * j + 2], acc[g][8 * j + 3]);
                *(float4*)(dst + 4) = make_float4(acc[g][8 * j + 4], acc[g][8 * j + 5], acc[g][8 * j + 6], acc[g][8 * j + 7]);
            }
    if (lane == 0)
#pragma unroll
        for (int g = 0; g < WG; g++)
            if (g0 + g < G) {
                wstat[cw * 2 * G + g0 + g] = m[g];
                wstat[cw * 2 * G + G + g0 + g] = l[g];
            }
    }
    // This token's score (the last part only), a warp per head.
    if (a.has_new)
        for (int g = cw; g < G; g += CW) {
            float d = 0.f;
            for (int k = lane; k < HD; k += 32) d = fmaf(qs[g * HD + k], kn[k], d);
            d = warp_sum(d);
            if (lane == 0) wstat[2 * CW * G + g] = d * scale;
        }
    if (consumers_failed()) return ntiles;
    if (spread) attn_release_pages(p, empty, seq, 0, ntiles);
    // Profile words 4 and 5 (the loader's for a mat-vec): the tiles streamed, and the merge.
    if (!MK_ATT_LOADER_STAMPS && MK_ATT_PAGE_STAMPS < 2 && ct == 0 && prof) prof[PROF_EXTRA1] = global_ns();
    for (int i = ct; i < G * HD; i += CONSUMERS) {
        // The warps k0, k0 + HG, ... took head g (every warp with one head group: the loops'
        // bounds stay constants there, as the merge sits on the critical path of every part).
        const int g = i / HD, d = i % HD, k0 = HG == 1 ? 0 : g / WG;
        const float sn = a.has_new ? wstat[2 * CW * G + g] : NEG_INF;
        float M = sn;
#pragma unroll
        for (int j = 0; j < CW / HG; j++) M = fmaxf(M, wstat[(k0 + j * HG) * 2 * G + g]);
        // M is finite: the part has a position (an empty part never gets here). A warp
        // without one has max -inf and sum 0, and weighs 0.
        float L = 0.f, o = 0.f;
#pragma unroll
        for (int j = 0; j < CW / HG; j++) {
            const int k = k0 + j * HG;
            const float c = __expf(wstat[k * 2 * G + g] - M);
            L = fmaf(wstat[k * 2 * G + G + g], c, L);
            o = fmaf(partial[(k * G + g) * HD + d], c, o);
        }
        if (a.has_new) {
            const float c = __expf(sn - M);
            L += c;
            o = fmaf(c, vn[d], o);
        }
        attn_store(p, w, i, o / L, M, L);
    }
    if (!MK_ATT_LOADER_STAMPS && !MK_ATT_PAGE_STAMPS && ct == 0 && prof) prof[PROF_EXTRA2] = global_ns();
    return ntiles;
}

// Qwen3's q/k norms (MK_QK_NORM, from the host: 0 unless the model has them). A head's RMS
// norm spans all its rows, which QKV instructions may split, so RmsQkvRope leaves q and k raw
// and attention, which reads whole heads, norms and rotates them here: warp g takes head g
// (the last part also this token's K row, as head G), each lane the rotation pairs lane + 32k.
// It writes the finished K row (bf16) into the cache at pos for later launches; nothing in
// this launch reads that copy (this step's attention has it in kn).
#if MK_QK_NORM
constexpr int ATT_NORM_PAIRS = ATT_HD / 64;  // rotation pairs per lane
// What a lane needs besides the inputs, worked out before they arrive: the rotation angles of
// its pairs, and the norm weights of the head its warp takes first (its q head, or this
// token's K as head G). Read after the inputs, the weights were two dependent global reads
// (LayerW's pointer, then the weights) on every layer's critical path.
struct QkRope {
    float s[ATT_NORM_PAIRS], c[ATT_NORM_PAIRS];
    float wx[ATT_NORM_PAIRS], wy[ATT_NORM_PAIRS];  // weights of rows lane + 32k, half + lane + 32k
};

__device__ __forceinline__ QkRope qk_rope_of(const MkParams& p, const LayerW& L, u32 pos) {
    QkRope r;
    const int lane = threadIdx.x & 31, cw = (threadIdx.x - 32) >> 5;
    const bf16_t* weight = cw < ATT_G ? L.q_norm : L.k_norm;
#pragma unroll
    for (int k = 0; k < ATT_NORM_PAIRS; k++) {
        r.wx[k] = bf16_to_f32(weight[lane + 32 * k]);
        r.wy[k] = bf16_to_f32(weight[ATT_HD / 2 + lane + 32 * k]);
    }
#pragma unroll
    for (int k = 0; k < ATT_NORM_PAIRS; k++) rope_sincos(pos, MK_FREQ(p, lane + 32 * k), &r.s[k], &r.c[k]);
    return r;
}

// The share of the group that starts it (head_start a multiple of the group) writes the K row.
__device__ __forceinline__ void attn_qk_norm(const MkParams& p, const LayerW& L, const QkRope& r, int layer, int kvh, u32 pos,
                             float* qs, float* kn, bool has_new, bool caches_k) {
    constexpr int hd = ATT_HD, G = ATT_G, half = hd / 2;
    const int cw = (threadIdx.x - 32) >> 5, lane = threadIdx.x & 31;
    for (int g = cw; g < G + (has_new ? 1 : 0); g += CONSUMER_WARPS) {
        const bool is_k = g == G;
        float* v = is_k ? kn : qs + g * hd;
        const bf16_t* weight = is_k ? L.k_norm : L.q_norm;
        float x[ATT_NORM_PAIRS], y[ATT_NORM_PAIRS], ss = 0.f;
#pragma unroll
        for (int k = 0; k < ATT_NORM_PAIRS; k++) {
            x[k] = v[lane + 32 * k];
            y[k] = v[half + lane + 32 * k];
            ss += x[k] * x[k] + y[k] * y[k];
        }
        const float inv_rms = rsqrtf(warp_sum(ss) / hd + p.eps);
        bf16_t* cache = is_k && caches_k ? (bf16_t*)kv_row(p, p.k_cache, layer, kvh, pos) : nullptr;
#pragma unroll
        for (int k = 0; k < ATT_NORM_PAIRS; k++) {
            const int i = lane + 32 * k;
            // The warp's first head (g == cw) has its weights in r; heads past the eighth read them.
            const float xn = x[k] * inv_rms * (g == cw ? r.wx[k] : bf16_to_f32(weight[i]));
            const float yn = y[k] * inv_rms * (g == cw ? r.wy[k] : bf16_to_f32(weight[half + i]));
            float a = xn * r.c[k] - yn * r.s[k], b = yn * r.c[k] + xn * r.s[k];
            if (is_k) {
                // The cache keeps bf16; this step uses the same rounded values.
                const bf16_t ha = f32_to_bf16(a), hb = f32_to_bf16(b);
                if (cache) {
                    cache[i] = ha;
                    cache[half + i] = hb;
                }
                a = bf16_to_f32(ha);
                b = bf16_to_f32(hb);
            }
            v[i] = a;
            v[half + i] = b;
        }
    }
}

#endif

// Returns how many of the ring's tiles (staged K/V) it consumed.
__device__ u32 op_attention(const MkParams& p, const u32* w, const TokenMeta& m, u32 instr, u32 seq,
                            const bf16_t* pages, u64* full, u64* empty, float* scratch, u64* prof) {
    constexpr int hd = ATT_HD, G = ATT_G;
    const int ct = threadIdx.x - 32;
    const int layer = w[W_LAYER], kvh = w[W_A];
    const AttnRange a = attn_range(w, m.pos);
#if MK_QK_NORM
    const QkRope qk_rope = qk_rope_of(p, p.layers[layer], m.pos);
#endif
    float* S = scratch;
    float* partial = scratch + ATT_OFF_PART;
    float* out = scratch + ATT_OFF_OUT;
    float* qs = scratch + ATT_OFF_Q;
    float* kn = scratch + ATT_OFF_KN;
    float* vn = scratch + ATT_OFF_VN;
    float* stats = scratch + ATT_OFF_STATS;  // [max][sum][corr] per head
    const int n = a.cached_end - a.p0;
    const int round_tiles = min(MK_RING(p), ATT_ROUND / ATT_TR), ntiles = (n + ATT_TR - 1) / ATT_TR;
    // The first round's K/V rows do not depend on this step: they are waited for before the
    // inputs, so that the wait is off the critical path.
    if (!attn_pages(p, instr, seq, full, 0, min(ntiles, round_tiles))) set_failed(1);
    for (int i = ct; i < G * hd; i += CONSUMERS) out[i] = 0.f;
    if (ct < G) { stats[ct] = NEG_INF; stats[G + ct] = 0.f; }
    {
        // The queries and (for the last part) this token's K and V rows, read as one batch:
        // element i < G·hd is a query value, then hd of K, then hd of V (contiguous in scratch).
        const u64* qsrc = p.q + ((size_t)layer * p.heads + w[W_D]) * hd;
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
#if MK_QK_NORM
    if (n > 0 || a.has_new) {
        attn_qk_norm(p, p.layers[layer], qk_rope, layer, kvh, m.pos, qs, kn, a.has_new, w[W_D] % ATT_KV_G == 0);
        consumers_sync();
    }
#endif
    if (ct == 0 && prof) prof[PROF_PREPARED] = global_ns();
    if (n == 0 && !a.has_new) {
        // A part with no position (more parts than positions): an empty softmax.
        for (int i = ct; i < G * hd; i += CONSUMERS) attn_store(p, w, i, 0.f, NEG_INF, 0.f);
        return 0;
    }
    if constexpr (ATT_BY_WARPS) {
        return attn_by_warps(p, w, a, instr, seq, pages, full, empty, scratch, prof, n, ntiles);
    }
    const float scale = rsqrtf((float)hd);
    for (int t0 = 0; t0 == 0 || t0 < ntiles; t0 += round_tiles) {
        const int t1 = min(ntiles, t0 + round_tiles);
        const AttnRound r{pages, (int)((seq + t0) % MK_RING(p)), MK_RING(p), min(n, t1 * ATT_TR) - t0 * ATT_TR,
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
        if (!MK_ATT_LOADER_STAMPS && ct == 0 && prof) prof[PROF_EXTRA1] = global_ns();
        attn_values(r, S, vn, partial);
        consumers_sync();
        if (!MK_ATT_LOADER_STAMPS && ct == 0 && prof) prof[PROF_EXTRA2] = global_ns();
        // The round's pages go back to the loader, every consumer past the barrier above.
        attn_release_pages(p, empty, seq, t0, t1);
        // The running output takes this round's values; after the last round it is divided by
        // the sum and stored.
        const bool last = t1 >= ntiles;
        for (int i = ct; i < G * hd; i += CONSUMERS) {
            const int g = i / hd;
            float v = out[i] * stats[2 * G + g];
#pragma unroll
            for (int k = 0; k < ATT_PART_SLOTS; k++) v += partial[k * G * hd + i];
            if (last) attn_store(p, w, i, v / stats[G + g], stats[g], stats[G + g]);
            else out[i] = v;
        }
        if (!last) consumers_sync();
    }
    return ntiles;
}

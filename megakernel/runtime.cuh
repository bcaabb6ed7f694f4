// The megakernel: one persistent CTA per SM interprets its instruction stream for one decode
// step. Warp 0 is the loader (weights -> paged shared memory, running ahead of the consumers);
// warps 1..CONSUMER_WARPS compute. Activations passed between instructions carry the launch's
// tag (epoch + 1) and are waited for where they are read, so the same streams run token after
// token without host work. What each instruction reads is scheduler::access (the scheduler's
// CPU executor follows the same rule, and a GPU test checks that the two agree).

// Words per instruction: scheduler::WORDS_PER_INSTR (scheduler/src/encode.rs).
#define MK_WORDS 8
// 8 consumer warps + the loader = 9 warps: at most 3 per SM sub-partition, which lets each
// thread have 168 registers. With 13 warps (128 registers) the interpreter loop spilled, and
// the reloads went to L2.
#define CONSUMER_WARPS 8
#define CONSUMERS (CONSUMER_WARPS * 32)
#define MK_THREADS (CONSUMERS + 32)
#define RES_MAX 2048
// Each tile is consumed by a pair of warps splitting its columns; tile t goes to group
// t % TILE_GROUPS and the host makes the page count a multiple of TILE_GROUPS, so a page is
// always consumed by the same group. A warp then waits on a page's "full" barrier only after
// it consumed the page's previous tile itself, so that phase is complete: the parity test
// cannot pass for a phase two ahead. (Bulk copies complete out of order, so "issued earlier"
// is not enough: with 12 pages shared round-robin by 8 groups the LM head hung.)
#define TILE_GROUPS (CONSUMER_WARPS / 2)
#define ABORT_CHECK_SPINS 1024
#define PROF_WORDS 6

enum Op : u32 {
    OP_NOOP = 0, OP_QKV = 1, OP_ATTN = 2, OP_ATTN_REDUCE = 3, OP_OPROJ = 4,
    OP_UPGATE = 5, OP_DOWN = 6, OP_LMHEAD = 7, OP_ARGMAX = 8,
};

// Word layout of one instruction: scheduler/src/encode.rs (operands a0..a4 = W_A..W_E).
#define W_OP 0
#define W_LAYER 1
#define W_A 2
#define W_B 3
#define W_C 4
#define W_D 5
#define W_E 6

struct LayerW {
    const bf16_t* attn_norm;
    const bf16_t* w_qkv;
    const bf16_t* wo;
    const bf16_t* ffn_norm;
    const bf16_t* w_gu;
    const bf16_t* w_down;
};

struct MkParams {
    const u32* instrs;
    const u32* sm_offsets;
    u32* error;          // [flag, sm, instruction, tile or arena element, expected, seen, kind]
    u32* progress;       // per SM: [consumer instruction, consumer stage, loader instruction, loader tile]
    // null, or per instruction (PROF_WORDS): globaltimer at start, inputs arrived and prepared,
    // tiles done, stored; then the loader's first page wait and its last tile issued (for
    // attention: scores and softmax done, weighted values done).
    u64* profile;
    TokenMeta* meta;     // two slots, by epoch parity
    u32* history;
    const LayerW* layers;
    const bf16_t* embed;
    const bf16_t* final_norm;
    const bf16_t* lm_head;
    const float* inv_freq;
    bf16_t* k_cache;
    bf16_t* v_cache;
    // Tagged activations (see st_tagged), all in one arena that starts at resid_attn.
    u64* resid_attn;     // [layers][hidden]
    u64* mlp_part;       // [layers][chunks][hidden]
    u64* q;              // [layers][heads*head_dim]
    u64* kv_new;         // [layers][2][kv_heads][head_dim]: this token's K and V rows (bf16 values)
    u64* attn_out;       // [layers][heads*head_dim]
    u64* attn_part;      // [layers][heads][parts_max][head_dim + 2]
    u64* act;            // [layers][inter]
    u64* lm_best;        // [n_lm][2]: value, index bits
    float* logits;       // [vocab], read by the host
    int hidden, inter, heads, kv_heads, head_dim, vocab, n_layers, chunks, max_seq, n_lm;
    int xs_floats, pages;
    float eps;
    u32 epoch;
    u64 timeout_ns;
};

__device__ __forceinline__ bool aborted(const MkParams& p) { return *(volatile u32*)p.error != 0; }

enum ErrorKind : u32 { ERR_DATA = 1, ERR_PAGE_CONSUMER = 2, ERR_PAGE_LOADER = 3 };
enum Stage : u32 { ST_PREPARE = 1, ST_TILES = 2, ST_POST = 3, ST_DONE = 4 };

__device__ __noinline__ void raise_error(const MkParams& p, u32 kind, u32 instr, u32 what, u32 expected, u32 seen) {
    if (atomicCAS(p.error, 0u, 1u) == 0u) {
        p.error[1] = blockIdx.x; p.error[2] = instr; p.error[3] = what; p.error[4] = expected; p.error[5] = seen;
        p.error[6] = kind;
        __threadfence();
    }
}

// ---- tagged activations ----
// Every value one instruction hands to another is a 64-bit word: the f32 in the low half and
// the launch's tag (epoch + 1) in the high half, written by one relaxed 64-bit store, which is
// single-copy atomic. A reader takes the value once its tag is this launch's: the data carries
// its own readiness, so no counter, fence or barrier sits between producer and consumer. (A
// release fence waits for the SM's in-flight weight copies: ~8 us while HBM streams.)

// Set by a consumer thread whose wait timed out; the interpreter stops at its next barrier.
__shared__ u32 mk_failed;
// The instruction the consumers are on, for error reports.
__shared__ u32 mk_instr;

__device__ __forceinline__ u32 launch_tag(const MkParams& p) { return p.epoch + 1; }

__device__ __forceinline__ void st_tagged(u64* a, float v, u32 tag) {
    asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(a), "l"(((u64)tag << 32) | __float_as_uint(v)) : "memory");
}

__device__ __forceinline__ u64 ld_tagged(const u64* a) {
    u64 v;
    asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(a));
    return v;
}

// Waits until the n elements addr(k) (k < n) read into raw carry this launch's tag,
// re-reading all the stale ones together, so stragglers cost one round trip per retry rather
// than one each. Every consumer thread polls its own elements: a gate in front (lane 0 of each
// warp waiting for one element before the others read theirs) added a round trip to every
// hop (H100: Llama-1B 0.882 -> 0.878 ms/token without it, SmolLM2 0.479 -> 0.453). Past the
// time limit (or once another SM failed) it reports a stale element (the first error raised
// wins) and marks the CTA failed.
template <int N, typename Addr>
__device__ __forceinline__ void settle(const MkParams& p, u64* raw, Addr addr, int n) {
    const u32 tag = launch_tag(p);
    u64 t0 = 0;
    for (int spins = 0;; spins++) {
        bool stale = false;
#pragma unroll
        for (int k = 0; k < N; k++) stale |= k < n && (u32)(raw[k] >> 32) != tag;
        if (!stale) return;
        if (spins == 0) {
            t0 = global_ns();
        } else if (spins % 64 == 0 && (aborted(p) || global_ns() - t0 > p.timeout_ns)) {
            // One report, out of line: an unrolled report per element bloats every inlined wait.
            int bad = 0;
            u32 seen = 0;
#pragma unroll
            for (int k = N - 1; k >= 0; k--)
                if (k < n && (u32)(raw[k] >> 32) != tag) { bad = k; seen = (u32)(raw[k] >> 32); }
            raise_error(p, ERR_DATA, mk_instr, (u32)(addr(bad) - p.resid_attn), tag, seen);
            mk_failed = 1;
            return;
        }
#pragma unroll
        for (int k = 0; k < N; k++)
            if (k < n && (u32)(raw[k] >> 32) != tag) raw[k] = ld_tagged(addr(k));
    }
}

__device__ __forceinline__ float tagged_float(u64 raw) { return __uint_as_float((u32)raw); }

__device__ __forceinline__ float ld_value(const MkParams& p, const u64* a) {
    u64 raw = ld_tagged(a);
    settle<1>(p, &raw, [&](int) { return a; }, 1);
    return tagged_float(raw);
}

__device__ __forceinline__ void note(const MkParams& p, int slot, u32 v) {
    *(volatile u32*)(p.progress + blockIdx.x * 4 + slot) = v;
}

// Waits for an mbarrier phase; past the time limit (or once another SM failed) it reports
// and gives up, so a pipeline bug is an error, never a hung GPU.
__device__ bool page_wait(const MkParams& p, u64* bar, u32 parity, u32 kind, u32 instr, u32 tile) {
    if (mbar_try_wait(bar, parity)) return true;
    const u64 t0 = global_ns();
    for (int spins = 1;; spins++) {
        if (mbar_try_wait(bar, parity)) return true;
        if (spins % ABORT_CHECK_SPINS == 0) {
            if (aborted(p)) return false;
            if (global_ns() - t0 > p.timeout_ns) {
                raise_error(p, kind, instr, tile, parity, 0);
                return false;
            }
        }
    }
}

// ---- geometry of an instruction's weight rows (shared by loader and consumers) ----

__device__ __forceinline__ int seg_cols(const u32* w, const MkParams& p) {
    switch (w[W_OP]) {
        case OP_OPROJ: return p.heads * p.head_dim;
        case OP_DOWN: return (int)w[W_E];
        case OP_QKV: case OP_UPGATE: case OP_LMHEAD: return p.hidden;
        default: return 0;
    }
}

__device__ __forceinline__ int seg_count(const u32* w) {
    switch (w[W_OP]) {
        case OP_QKV: return 2 * (int)w[W_C];
        case OP_UPGATE: return 2 * (int)w[W_B];
        case OP_OPROJ: case OP_DOWN: case OP_LMHEAD: return (int)w[W_B];
        default: return 0;
    }
}

// lw: the layer pointer table, copied to shared memory at the start (reads of it must not
// become L2 round trips on the critical path).
__device__ __forceinline__ const bf16_t* seg_ptr(const u32* w, const MkParams& p, const LayerW* lw, int j) {
    const LayerW& L = lw[w[W_LAYER] < (u32)p.n_layers ? w[W_LAYER] : 0];
    switch (w[W_OP]) {
        case OP_QKV: {
            int pc = w[W_C], half = p.head_dim / 2;
            int row = w[W_A] * p.head_dim + (j < pc ? (int)w[W_B] + j : half + (int)w[W_B] + j - pc);
            return L.w_qkv + (size_t)row * p.hidden;
        }
        case OP_UPGATE: {
            int rc = w[W_B];
            int row = j < rc ? (int)w[W_A] + j : p.inter + (int)w[W_A] + j - rc;
            return L.w_gu + (size_t)row * p.hidden;
        }
        case OP_OPROJ: return L.wo + (size_t)(w[W_A] + j) * (p.heads * p.head_dim);
        case OP_DOWN: return L.w_down + (size_t)(w[W_A] + j) * p.inter + w[W_D];
        case OP_LMHEAD: return p.lm_head + (size_t)(w[W_A] + j) * p.hidden;
        default: return nullptr;
    }
}

// Rows of n rows of cols columns per tile: a page's worth, but no more than an even share for
// the warp pairs, so that a small instruction's rows are worked on by all of them at once.
__device__ __forceinline__ int rows_per_tile(int cols, int n) {
    return max(1, min(PAGE_BYTES / (cols * 2), (n + TILE_GROUPS - 1) / TILE_GROUPS));
}

// A mat-vec instruction's weight rows, their length, rows per tile and tiles (all 0 for the
// others). The consumers work it out when an instruction starts, before they wait for its
// inputs: worked out between the inputs and the tiles (two switches, two divisions) it cost
// ~0.6 us on the critical path of every instruction (H100, Llama-1B).
struct TileGeom {
    int n, cols, rpt, tiles;
};

__device__ __forceinline__ TileGeom tile_geom(const u32* w, const MkParams& p) {
    const int n = seg_count(w);
    if (n == 0) return {0, 0, 0, 0};
    const int cols = seg_cols(w, p), rpt = rows_per_tile(cols, n);
    return {n, cols, rpt, (n + rpt - 1) / rpt};
}

// ---- attention tiles ----
// Attention(layer, kv_head, part, parts) covers positions [p0, p1) of the len = pos + 1 long
// sequence. Its K and V rows before pos were written by earlier launches, so they do not
// depend on this step: the loader stages them in pages like weight tiles, long before the
// instruction runs, and attention reads them from shared memory. Row pos (this token's) comes
// tagged from kv_new. A tile holds ATT_TR rows of K, then the same rows of V; the cache is
// head-major ([layer][kv_head][position][head_dim]) so each is one bulk copy.
// The kernel is compiled for the model's head_dim and query heads per KV head (the host passes
// -DMK_HEAD_DIM and -DMK_GROUP), so attention's loops have constant trip counts.

#if !defined(MK_HEAD_DIM) || !defined(MK_GROUP) || !defined(MK_HIDDEN) || !defined(MK_Q_DIM)
#error "the megakernel is compiled for a model: define MK_HEAD_DIM, MK_GROUP, MK_HIDDEN and MK_Q_DIM"
#endif
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

__device__ __forceinline__ const bf16_t* kv_row(const MkParams& p, const bf16_t* cache, int layer, int kvh, int row) {
    return cache + (((size_t)layer * p.kv_heads + kvh) * p.max_seq + row) * p.head_dim;
}

// ---- loader warp ----

// Before issuing tile seq the loader waits for tile seq - MK_INFLIGHT to land, bounding the
// bytes each SM has queued in the memory system. A whole ring in flight on every SM (25 MB on
// an H100) kept HBM no busier but queued the activations on the critical path behind it: on
// the H100, Llama-1B took 1.140 ms/token with the whole ring in flight, 1.069 with 2 tiles.
// While the consumers work on the very instruction being loaded, they wait for its tiles
// and nothing else of this SM is on the critical path: up to MK_INFLIGHT_STREAM then (Llama-1B
// on the H100: 1.061 ms/token with 2, 1.050 with 3, 1.049 with 4, 1.057 with 6, 1.085 with 12).
#ifndef MK_INFLIGHT
#define MK_INFLIGHT 2
#endif
#ifndef MK_INFLIGHT_STREAM
#define MK_INFLIGHT_STREAM 4
#endif
__device__ __forceinline__ bool inflight_wait(const MkParams& p, u64* full, u32 seq, u32 instr) {
    const u32 limit = *(volatile u32*)&mk_instr == instr ? MK_INFLIGHT_STREAM : MK_INFLIGHT;
    if (limit >= (u32)p.pages || seq < limit) return true;
    const u32 s = seq - limit;
    return page_wait(p, &full[s % p.pages], (s / p.pages) & 1, ERR_PAGE_LOADER, instr, s);
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

__device__ void loader(const MkParams& p, const LayerW* lw, const u32* begin, const u32* end, bf16_t* pages, u64* full,
                       u64* empty) {
    const int lane = threadIdx.x & 31;
    const u32 pos = p.meta[p.epoch & 1].pos;
    const u64 policy = l2_evict_first();
    u32 seq = 0;
    for (const u32* wg = begin; wg < end; wg += MK_WORDS) {
        // The operands, read once into registers rather than once per weight row.
        u32 w[W_E + 1];
#pragma unroll
        for (int k = 0; k <= W_E; k++) w[k] = wg[k];
        const u32 instr = (u32)((wg - p.instrs) / MK_WORDS);
        if (w[W_OP] == OP_ATTN) {
            if (lane == 0) note(p, 2, instr);
            if (!load_attention(p, w, pos, instr, seq, pages, full, empty, policy)) return;
            continue;
        }
        int n = seg_count(w);
        if (n == 0) continue;
        if (lane == 0) note(p, 2, instr);
        int cols = seg_cols(w, p), rpt = rows_per_tile(cols, n);
        u32 bytes_per_row = cols * 2;
        u64* prof = p.profile ? p.profile + (size_t)instr * PROF_WORDS : nullptr;
        if (lane == 0 && prof) prof[4] = global_ns();
        for (int t = 0; t * rpt < n; t++, seq++) {
            u32 slot = seq % p.pages, round = seq / p.pages;
            if (lane == 0) note(p, 3, seq);
            int rows = min(rpt, n - t * rpt);
            if (!page_wait(p, &empty[slot], (round & 1) ^ 1, ERR_PAGE_LOADER, instr, seq)) return;
            if (!inflight_wait(p, full, seq, instr)) return;
            if (lane == 0) mbar_expect_tx(&full[slot], rows * bytes_per_row);
            __syncwarp();
            char* page = (char*)pages + (size_t)slot * PAGE_BYTES;
            for (int r = lane; r < rows; r += 32)
                bulk_load(page + r * bytes_per_row, seg_ptr(w, p, lw, t * rpt + r), bytes_per_row, &full[slot], policy);
        }
        if (lane == 0 && prof) prof[5] = global_ns();
    }
}

// ---- consumer helpers (ct = consumer thread index, cw = consumer warp index) ----

__device__ __forceinline__ void consumers_sync() { named_sync(1, CONSUMERS); }
// A consumer barrier that tells every consumer whether any consumer's wait failed.
__device__ __forceinline__ bool consumers_failed() { return named_sync_or(1, CONSUMERS, mk_failed != 0); }

// The (value, index) that wins over all consumer threads (argmax_merge), in consumer thread 0;
// red holds 2 * CONSUMER_WARPS words.
__device__ __forceinline__ void consumers_argmax(float& v, u32& idx, float* red) {
    const int ct = threadIdx.x - 32, cw = ct >> 5;
    warp_argmax(v, idx);
    u32* redi = (u32*)(red + CONSUMER_WARPS);
    if ((ct & 31) == 0) { red[cw] = v; redi[cw] = idx; }
    consumers_sync();
    if (ct == 0)
        for (int k = 1; k < CONSUMER_WARPS; k++) argmax_merge(v, idx, red[k], redi[k]);
}

// Each consumer warp's share of a sum, for rms_scale to add up after a later barrier.
__device__ __forceinline__ void consumers_partial_sum(float v, float* ss) {
    v = warp_sum(v);
    if ((threadIdx.x & 31) == 0) ss[(threadIdx.x - 32) >> 5] = v;
}

// The RMS norm's scale from the sums of squares prepare_normed left in ss.
__device__ __forceinline__ float rms_scale(const MkParams& p, const float* ss) {
    float t = 0.f;
#pragma unroll
    for (int i = 0; i < CONSUMER_WARPS; i++) t += ss[i];
    return rsqrtf(t / p.hidden + p.eps);
}

// Residual stream entering `layer`: the embedding row for layer 0, else the previous layer's
// attention residual plus its down-projection partial sums (each written once per token).
// Its parts are read at once (one round trip, not one each) when there are few enough.
#define PREP_CHUNKS 2
__device__ __forceinline__ float resid_in(const MkParams& p, int layer, u32 token, int i) {
    if (layer == 0) return bf16_to_f32(p.embed[(size_t)token * p.hidden + i]);
    const int l = layer - 1;
    const u64* base = p.resid_attn + (size_t)l * p.hidden + i;
    const u64* parts = p.mlp_part + (size_t)l * p.chunks * p.hidden + i;
    if (p.chunks <= PREP_CHUNKS) {
        auto addr = [&](int k) { return k == 0 ? base : parts + (size_t)(k - 1) * p.hidden; };
        u64 raw[1 + PREP_CHUNKS];
#pragma unroll
        for (int k = 0; k <= PREP_CHUNKS; k++) raw[k] = k <= p.chunks ? ld_tagged(addr(k)) : 0;
        settle<1 + PREP_CHUNKS>(p, raw, addr, 1 + p.chunks);
        float v = tagged_float(raw[0]);
#pragma unroll
        for (int k = 1; k <= PREP_CHUNKS; k++)
            if (k <= p.chunks) v += tagged_float(raw[k]);
        return v;
    }
    float v = ld_value(p, base);
    for (int c = 0; c < p.chunks; c++) v += ld_value(p, parts + (size_t)c * p.hidden);
    return v;
}

// xs = src * g, src given by resid_in(layer) or resid_attn[l] (after_attn), and the sums of
// squares in ss: the norm's scale is one number, applied to the mat-vec's results (W(x·s·g) =
// s·W(x·g)), so the tiles need not wait for the sum to be reduced.
// Each thread first issues every L2 load it needs (PREP_MAX elements of each source and of g),
// then sums: one round trip in all, where a round trip per source or per element would add up
// on the critical path of every layer.
#define PREP_MAX 8
__device__ void prepare_normed(const MkParams& p, int layer, bool after_attn, u32 token, const bf16_t* g,
                               float* xs, float* ss) {
    const int ct = threadIdx.x - 32;
    const int nparts = after_attn || layer == 0 ? 0 : p.chunks;
    if (p.hidden <= PREP_MAX * CONSUMERS && nparts <= PREP_CHUNKS) {
        u64 raw[PREP_MAX], rawp[PREP_CHUNKS][PREP_MAX];
        float gw[PREP_MAX], v[PREP_MAX];
        const u64* base = after_attn ? p.resid_attn + (size_t)layer * p.hidden
                          : layer == 0 ? nullptr : p.resid_attn + (size_t)(layer - 1) * p.hidden;
        const u64* parts = p.mlp_part + (size_t)(layer > 0 ? layer - 1 : 0) * p.chunks * p.hidden;
        // The norm's weights (and layer 0's embedding row) do not depend on this step: they
        // are issued first, so they are in flight while the inputs are waited for.
#pragma unroll
        for (int k = 0; k < PREP_MAX; k++) {
            const int i = ct + k * CONSUMERS;
            const bool in = i < p.hidden;
            v[k] = in && !base ? bf16_to_f32(p.embed[(size_t)token * p.hidden + i]) : 0.f;
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

// Copies n tagged values into shared memory as floats, every read of a thread's batch issued
// before it waits on any of them.
#define COPY_MAX 8
__device__ void copy_in(const MkParams& p, float* dst, const u64* src, int n) {
    const int ct = threadIdx.x - 32;
    for (int i0 = 0; i0 < n; i0 += COPY_MAX * CONSUMERS) {
        u64 raw[COPY_MAX];
#pragma unroll
        for (int k = 0; k < COPY_MAX; k++) {
            const int i = i0 + ct + k * CONSUMERS;
            raw[k] = i < n ? ld_tagged(src + i) : 0;
        }
        const int first = i0 + ct, mine = n > first ? (n - first + CONSUMERS - 1) / CONSUMERS : 0;
        settle<COPY_MAX>(p, raw, [&](int k) { return src + first + k * CONSUMERS; }, mine);
#pragma unroll
        for (int k = 0; k < COPY_MAX; k++)
            if (k < mine) dst[first + k * CONSUMERS] = tagged_float(raw[k]);
    }
}

// A warp covers columns c0 + 512 i of every row (c0: its lane's 8 columns within its half of a
// 512-column step). With rows of at most 4 steps, x stays in registers for all the tiles of an
// instruction and the tiles' loop reads only weights from shared memory: with x read there as
// well (twice the traffic) and one chain at a time, a tile already in the ring took ~1.4 us on
// the critical path (QKV, O-proj).

// acc[k] += row k . x over this lane's S steps, x in registers (zero past the row's end, where
// the weights are read at column 0 instead: every load is unconditional, so all of them can be
// in flight at once).
template <int R, int S>
__device__ __forceinline__ void dot_rows(const bf16_t* rows, int cols, int c0, const float (&x)[S][8], float* acc) {
#pragma unroll
    for (int i = 0; i < S; i++) {
        const int c = c0 + 512 * i < cols ? c0 + 512 * i : 0;
        uint4 wv[R];
#pragma unroll
        for (int k = 0; k < R; k++) wv[k] = *(const uint4*)(rows + k * cols + c);
#pragma unroll
        for (int k = 0; k < R; k++) acc[k] += dot8(wv[k], x[i]);
    }
}

// The same with x read from shared memory, for longer rows.
template <int R>
__device__ __forceinline__ void dot_rows(const bf16_t* rows, int cols, int c0, const float* xs, float* acc) {
#pragma unroll 2
    for (int c = c0; c < cols; c += 512) {
        float x[8];
        *(float4*)x = *(const float4*)(xs + c);
        *(float4*)(x + 4) = *(const float4*)(xs + c + 4);
        uint4 wv[R];
#pragma unroll
        for (int k = 0; k < R; k++) wv[k] = *(const uint4*)(rows + k * cols + c);
#pragma unroll
        for (int k = 0; k < R; k++) acc[k] += dot8(wv[k], x);
    }
}

// Rows [row0, row0 + R) of a page: this warp's sums, reduced over its lanes, into res (see
// consume_tiles).
template <int R, typename X>
__device__ __forceinline__ void rows_to_res(const bf16_t* rows, int cols, int c0, const X& x, float* res, int row0,
                                            int half) {
    float acc[R];
#pragma unroll
    for (int k = 0; k < R; k++) acc[k] = 0.f;
    dot_rows<R>(rows, cols, c0, x, acc);
#pragma unroll
    for (int k = 0; k < R; k++) acc[k] = warp_sum(acc[k]);
    if ((threadIdx.x & 31) == 0)
#pragma unroll
        for (int k = 0; k < R; k++) res[2 * (row0 + k) + half] = acc[k];
}

// Each tile of the warp's group: its rows four at a time (four independent chains), then the
// last two and one.
template <typename X>
__device__ __forceinline__ bool tiles_to_res(const MkParams& p, u32 instr, u32 seq, int n, int cols, int rpt,
                                             const bf16_t* pages, u64* full, u64* empty, const X& x, float* res) {
    const int ct = threadIdx.x - 32, cw = ct >> 5, lane = ct & 31, grp = cw >> 1, half = cw & 1;
    const int c0 = (half * 32 + lane) * 8, ntiles = (n + rpt - 1) / rpt;
    for (int t = grp; t < ntiles; t += TILE_GROUPS) {
        u32 s = seq + t, slot = s % p.pages;
        if (!page_wait(p, &full[slot], (s / p.pages) & 1, ERR_PAGE_CONSUMER, instr, s)) return false;
        const bf16_t* page = pages + (size_t)slot * (PAGE_BYTES / 2);
        int rows = min(rpt, n - t * rpt), r = 0;
        for (; r + 4 <= rows; r += 4) rows_to_res<4>(page + r * cols, cols, c0, x, res, t * rpt + r, half);
        if (r + 2 <= rows) {
            rows_to_res<2>(page + r * cols, cols, c0, x, res, t * rpt + r, half);
            r += 2;
        }
        if (r < rows) rows_to_res<1>(page + r * cols, cols, c0, x, res, t * rpt + r, half);
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[slot]);
    }
    return true;
}

// The tiles with this lane's S steps of xs held in registers.
template <int S>
__device__ __forceinline__ bool tiles_x_in_registers(const MkParams& p, u32 instr, u32 seq, const TileGeom& g,
                                                     const bf16_t* pages, u64* full, u64* empty, const float* xs,
                                                     float* res) {
    const int ct = threadIdx.x - 32, c0 = (((ct >> 5) & 1) * 32 + (ct & 31)) * 8;
    float x[S][8];
#pragma unroll
    for (int i = 0; i < S; i++) {
        const bool in = c0 + 512 * i < g.cols;
        const float* src = xs + (in ? c0 + 512 * i : 0);
        *(float4*)x[i] = *(const float4*)src;
        *(float4*)(x[i] + 4) = *(const float4*)(src + 4);
#pragma unroll
        for (int j = 0; j < 8; j++) x[i][j] = in ? x[i][j] : 0.f;
    }
    return tiles_to_res(p, instr, seq, g.n, g.cols, g.rpt, pages, full, empty, x, res);
}

// Rows of `cols` columns, a model dimension the kernel is compiled with: x in registers when
// they are at most 4 steps long, else read from shared memory.
template <int COLS>
__device__ __forceinline__ bool tiles_of_width(const MkParams& p, u32 instr, u32 seq, const TileGeom& g,
                                               const bf16_t* pages, u64* full, u64* empty, const float* xs,
                                               float* res) {
    constexpr int S = (COLS + 511) / 512;
    if constexpr (S <= 4) return tiles_x_in_registers<S>(p, instr, seq, g, pages, full, empty, xs, res);
    else return tiles_to_res(p, instr, seq, g.n, g.cols, g.rpt, pages, full, empty, xs, res);
}

// Dot products of the instruction's weight rows (from the paged ring) with xs: the two
// column halves of row j land in res[2j] and res[2j + 1] (summed in that order by res_at).
// The row length is one of the model's dimensions or a down-projection chunk: compile-time
// branches, not a jump table (each indirect branch here cost a few hundred ns). False when a
// page wait failed (the error is raised).
__device__ bool consume_tiles(const MkParams& p, const TileGeom& g, u32 instr, u32 seq, const bf16_t* pages, u64* full,
                              u64* empty, const float* xs, float* res) {
    if (g.cols == MK_HIDDEN) return tiles_of_width<MK_HIDDEN>(p, instr, seq, g, pages, full, empty, xs, res);
    if (g.cols == MK_Q_DIM) return tiles_of_width<MK_Q_DIM>(p, instr, seq, g, pages, full, empty, xs, res);
    return tiles_to_res(p, instr, seq, g.n, g.cols, g.rpt, pages, full, empty, xs, res);
}

__device__ __forceinline__ float res_at(const float* res, int j) { return res[2 * j] + res[2 * j + 1]; }

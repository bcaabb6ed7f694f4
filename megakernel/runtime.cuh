// The megakernel: one persistent CTA per SM interprets its instruction stream for one decode
// step. Warp 0 is the loader (weights -> paged shared memory, running ahead of the consumers);
// warps 1..CONSUMER_WARPS compute. Instructions wait on global counters (acquire) and signal
// them (release); targets are base * (epoch + 1), so streams and counters are reused for every
// token without host work.

#define MK_WORDS 16
#define MAX_WAITS 3
// 12 consumer warps + the loader = 13 warps: at most 4 per SM sub-partition, which lets each
// thread have 128 registers (17 warps would cap it at 96 and spill the attention).
#define CONSUMER_WARPS 12
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
#define NO_COUNTER 0xffffffffu
#define ABORT_CHECK_SPINS 1024

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
#define W_SIGNAL 8
#define W_NWAIT 9
#define W_WAITS 10

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
    u32* counters;
    u32* error;          // [flag, sm, instruction, counter or tile, expected, seen, kind]
    u32* progress;       // per SM: [consumer instruction, consumer stage, loader instruction, loader tile]
    u64* profile;        // null, or per instruction: globaltimer at start, waited, prepared, tiles done, stored, signalled
    TokenMeta* meta;     // two slots, by epoch parity
    u32* history;
    const LayerW* layers;
    const bf16_t* embed;
    const bf16_t* final_norm;
    const bf16_t* lm_head;
    const float* inv_freq;
    bf16_t* k_cache;
    bf16_t* v_cache;
    float* resid_attn;   // [layers][hidden]
    float* mlp_part;     // [layers][chunks][hidden]
    float* q;            // [layers][heads*head_dim]
    float* attn_out;     // [layers][heads*head_dim]
    float* attn_part;    // [layers][heads][parts_max][head_dim + 2]
    float* act;          // [layers][inter]
    float* logits;       // [vocab]
    float* lm_best;      // [n_lm][2]: value, index bits
    int hidden, inter, heads, kv_heads, head_dim, vocab, n_layers, chunks, max_seq, n_lm;
    int xs_floats, pages;
    float eps;
    u32 epoch;
    u64 timeout_ns;
};

__device__ __forceinline__ bool aborted(const MkParams& p) { return *(volatile u32*)p.error != 0; }

enum ErrorKind : u32 { ERR_COUNTER = 1, ERR_PAGE_CONSUMER = 2, ERR_PAGE_LOADER = 3 };
enum Stage : u32 { ST_WAIT = 1, ST_PREPARE = 2, ST_TILES = 3, ST_POST = 4, ST_DONE = 5 };

__device__ void raise_error(const MkParams& p, u32 kind, u32 instr, u32 counter, u32 expected, u32 seen) {
    if (atomicCAS(p.error, 0u, 1u) == 0u) {
        p.error[1] = blockIdx.x; p.error[2] = instr; p.error[3] = counter; p.error[4] = expected; p.error[5] = seen;
        p.error[6] = kind;
        __threadfence();
    }
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

__device__ __forceinline__ const bf16_t* seg_ptr(const u32* w, const MkParams& p, int j) {
    const LayerW& L = p.layers[w[W_LAYER] < (u32)p.n_layers ? w[W_LAYER] : 0];
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

__device__ __forceinline__ int rows_per_tile(int cols) { return PAGE_BYTES / (cols * 2); }

__device__ __forceinline__ int tile_count(const u32* w, const MkParams& p) {
    int n = seg_count(w);
    if (n == 0) return 0;
    int rpt = rows_per_tile(seg_cols(w, p));
    return (n + rpt - 1) / rpt;
}

// ---- loader warp ----

__device__ void loader(const MkParams& p, const u32* begin, const u32* end, bf16_t* pages, u64* full, u64* empty) {
    const int lane = threadIdx.x & 31;
    u32 seq = 0;
    for (const u32* w = begin; w < end; w += MK_WORDS) {
        int n = seg_count(w);
        if (n == 0) continue;
        const u32 instr = (u32)((w - p.instrs) / MK_WORDS);
        if (lane == 0) note(p, 2, instr);
        int cols = seg_cols(w, p), rpt = rows_per_tile(cols);
        u32 bytes_per_row = cols * 2;
        for (int t = 0; t * rpt < n; t++, seq++) {
            u32 slot = seq % p.pages, round = seq / p.pages;
            if (lane == 0) note(p, 3, seq);
            if (!page_wait(p, &empty[slot], (round & 1) ^ 1, ERR_PAGE_LOADER, instr, seq)) return;
            int rows = min(rpt, n - t * rpt);
            if (lane == 0) mbar_expect_tx(&full[slot], rows * bytes_per_row);
            __syncwarp();
            char* page = (char*)pages + (size_t)slot * PAGE_BYTES;
            for (int r = lane; r < rows; r += 32)
                bulk_load(page + r * bytes_per_row, seg_ptr(w, p, t * rpt + r), bytes_per_row, &full[slot]);
        }
    }
}

// ---- consumer helpers (ct = consumer thread index, cw = consumer warp index) ----

__device__ __forceinline__ void consumers_sync() { named_sync(1, CONSUMERS); }

// Sum over all consumer threads; every caller gets the total.
__device__ float consumers_sum(float v, float* red) {
    const int ct = threadIdx.x - 32, cw = ct >> 5;
    v = warp_sum(v);
    if ((ct & 31) == 0) red[cw] = v;
    consumers_sync();
    float t = 0.f;
    for (int i = 0; i < CONSUMER_WARPS; i++) t += red[i];
    consumers_sync();
    return t;
}

// Residual stream entering `layer`: the embedding row for layer 0, else the previous layer's
// attention residual plus its down-projection partial sums (each written once per token).
__device__ __forceinline__ float resid_in(const MkParams& p, int layer, u32 token, int i) {
    if (layer == 0) return bf16_to_f32(p.embed[(size_t)token * p.hidden + i]);
    int l = layer - 1;
    float v = __ldcg(p.resid_attn + (size_t)l * p.hidden + i);
    for (int c = 0; c < p.chunks; c++) v += __ldcg(p.mlp_part + ((size_t)l * p.chunks + c) * p.hidden + i);
    return v;
}

// xs = rmsnorm(src) * g, src given by resid_in(layer) or resid_attn[l] (after_attn).
// Each thread first issues all its L2 loads (PREP_MAX per source), then sums: the activations
// come from L2 while the weights stream, and one round trip per source beats one per element.
#define PREP_MAX 8
__device__ void prepare_normed(const MkParams& p, int layer, bool after_attn, u32 token, const bf16_t* g,
                               float* xs, float* red) {
    const int ct = threadIdx.x - 32;
    float ss = 0.f;
    if (p.hidden <= PREP_MAX * CONSUMERS) {
        float v[PREP_MAX];
        const float* base = after_attn ? p.resid_attn + (size_t)layer * p.hidden
                            : layer == 0 ? nullptr : p.resid_attn + (size_t)(layer - 1) * p.hidden;
#pragma unroll
        for (int k = 0; k < PREP_MAX; k++) {
            const int i = ct + k * CONSUMERS;
            v[k] = i >= p.hidden ? 0.f
                   : base ? __ldcg(base + i)
                          : bf16_to_f32(p.embed[(size_t)token * p.hidden + i]);
        }
        if (!after_attn && layer > 0) {
            for (int c = 0; c < p.chunks; c++) {
                const float* part = p.mlp_part + ((size_t)(layer - 1) * p.chunks + c) * p.hidden;
                float w[PREP_MAX];
#pragma unroll
                for (int k = 0; k < PREP_MAX; k++) {
                    const int i = ct + k * CONSUMERS;
                    w[k] = i < p.hidden ? __ldcg(part + i) : 0.f;
                }
#pragma unroll
                for (int k = 0; k < PREP_MAX; k++) v[k] += w[k];
            }
        }
#pragma unroll
        for (int k = 0; k < PREP_MAX; k++) {
            const int i = ct + k * CONSUMERS;
            if (i < p.hidden) xs[i] = v[k];
            ss += v[k] * v[k];
        }
    } else {
        for (int i = ct; i < p.hidden; i += CONSUMERS) {
            float v = after_attn ? __ldcg(p.resid_attn + (size_t)layer * p.hidden + i) : resid_in(p, layer, token, i);
            xs[i] = v;
            ss += v * v;
        }
    }
    float total = consumers_sum(ss, red);
    float scale = rsqrtf(total / p.hidden + p.eps);
    for (int i = ct; i < p.hidden; i += CONSUMERS) xs[i] = xs[i] * scale * bf16_to_f32(g[i]);
}

// Dot products of the instruction's weight rows (from the paged ring) with xs: the two
// column halves of row j land in res[2j] and res[2j + 1] (summed in that order by res_at).
__device__ void consume_tiles(const MkParams& p, const u32* w, u32 seq, const bf16_t* pages, u64* full, u64* empty,
                              const float* xs, float* res) {
    const int ct = threadIdx.x - 32, cw = ct >> 5, lane = ct & 31, grp = cw >> 1, half = cw & 1;
    int n = seg_count(w), cols = seg_cols(w, p), rpt = rows_per_tile(cols);
    int ntiles = (n + rpt - 1) / rpt;
    for (int t = grp; t < ntiles; t += TILE_GROUPS) {
        u32 s = seq + t, slot = s % p.pages;
        if (!page_wait(p, &full[slot], (s / p.pages) & 1, ERR_PAGE_CONSUMER, (u32)((w - p.instrs) / MK_WORDS), s)) return;
        const bf16_t* page = pages + (size_t)slot * (PAGE_BYTES / 2);
        int rows = min(rpt, n - t * rpt);
        // Four rows at a time: the x slice is read once for all four, and the four sums and
        // their shuffle reductions are independent chains the warp can overlap.
        for (int r0 = 0; r0 < rows; r0 += 4) {
            float acc[4] = {0.f, 0.f, 0.f, 0.f};
            for (int c = (half * 32 + lane) * 8; c < cols; c += 512) {
                float x[8];
                *(float4*)x = *(const float4*)(xs + c);
                *(float4*)(x + 4) = *(const float4*)(xs + c + 4);
#pragma unroll
                for (int k = 0; k < 4; k++)
                    if (r0 + k < rows) acc[k] += dot8(*(const uint4*)(page + (r0 + k) * cols + c), x);
            }
#pragma unroll
            for (int k = 0; k < 4; k++) acc[k] = warp_sum(acc[k]);
            if (lane == 0)
#pragma unroll
                for (int k = 0; k < 4; k++)
                    if (r0 + k < rows) res[2 * (t * rpt + r0 + k) + half] = acc[k];
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[slot]);
    }
}

__device__ __forceinline__ float res_at(const float* res, int j) { return res[2 * j] + res[2 * j + 1]; }

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

// The K/V rows an Attention instruction reads from earlier tokens do not depend on this step:
// pulling them into L2 while its counter wait runs takes them off the critical path.
__device__ void prefetch_attention_kv(const MkParams& p, const u32* w, const TokenMeta& m) {
    const int ct = threadIdx.x - 32;
    const int layer = w[W_LAYER], kvh = w[W_A], part = w[W_B], parts = w[W_C], hd = p.head_dim;
    const int len = m.pos + 1, p0 = (int)((long long)part * len / parts);
    const int p1 = min((int)((long long)(part + 1) * len / parts), (int)m.pos);  // row pos is new
    const int lines = hd * 2 / 128;  // 128-byte lines per head row
    const size_t base = (size_t)layer * p.max_seq * p.kv_heads * hd + kvh * hd;
    for (int idx = ct; idx < (p1 - p0) * lines * 2; idx += CONSUMERS) {
        const int row = p0 + idx / (2 * lines), line = idx % lines;
        const bf16_t* cache = (idx / lines) % 2 ? p.v_cache : p.k_cache;
        prefetch_l2(cache + base + (size_t)row * p.kv_heads * hd + line * 64);
    }
}

// Scratch: per warp and head (m, l, acc[head_dim]), then the G queries.
__device__ void op_attention(const MkParams& p, const u32* w, const TokenMeta& m, float* scratch) {
    const int ct = threadIdx.x - 32, cw = ct >> 5, lane = ct & 31;
    const int layer = w[W_LAYER], kvh = w[W_A], part = w[W_B], parts = w[W_C];
    const int hd = p.head_dim, G = p.heads / p.kv_heads;
    const int len = m.pos + 1, p0 = (int)((long long)part * len / parts), p1 = (int)((long long)(part + 1) * len / parts);
    const size_t layer_off = (size_t)layer * p.max_seq * p.kv_heads * hd;
    const int kv_stride = p.kv_heads * hd, stride = 2 + hd;
    float* qs = scratch + CONSUMER_WARPS * G * stride;
    for (int i = ct; i < G * hd; i += CONSUMERS)
        qs[i] = __ldcg(p.q + (size_t)layer * p.heads * hd + kvh * G * hd + i);
    consumers_sync();
    const bf16_t* kh = p.k_cache + layer_off + kvh * hd;
    const bf16_t* vh = p.v_cache + layer_off + kvh * hd;
    const float scale = rsqrtf((float)hd);
    const int chunks = hd / 8;
    for (int g0 = 0; g0 < G; g0 += ATT_HEADS_PER_PASS) {
        const int gn = min(ATT_HEADS_PER_PASS, G - g0);
        float mx[ATT_HEADS_PER_PASS], l[ATT_HEADS_PER_PASS], acc[ATT_HEADS_PER_PASS][8];
#pragma unroll
        for (int g = 0; g < ATT_HEADS_PER_PASS; g++) {
            mx[g] = NEG_INF; l[g] = 0.f;
#pragma unroll
            for (int d = 0; d < 8; d++) acc[g][d] = 0.f;
        }
        if (hd == 64) attend_group_warp<8>(qs + g0 * hd, gn, kh, vh, kv_stride, scale, p0, p1, cw, CONSUMER_WARPS, mx, l, acc);
        else attend_group_warp<16>(qs + g0 * hd, gn, kh, vh, kv_stride, scale, p0, p1, cw, CONSUMER_WARPS, mx, l, acc);
        // Constant indices only (unrolled, guarded), so the arrays stay in registers.
#pragma unroll
        for (int g = 0; g < ATT_HEADS_PER_PASS; g++) {
            if (g >= gn) break;
            float* st = scratch + (cw * G + g0 + g) * stride;
            if (lane == 0) { st[0] = mx[g]; st[1] = l[g]; }
            if (lane < chunks) {
#pragma unroll
                for (int d = 0; d < 8; d++) st[2 + lane * 8 + d] = acc[g][d];
            }
        }
    }
    consumers_sync();
    for (int idx = ct; idx < G * hd; idx += CONSUMERS) {
        const int g = idx / hd, d = idx % hd, head = kvh * G + g;
        float M = NEG_INF;
        for (int k = 0; k < CONSUMER_WARPS; k++) M = fmaxf(M, scratch[(k * G + g) * stride]);
        float L = 0.f, A = 0.f;
        for (int k = 0; k < CONSUMER_WARPS; k++) {
            const float* s = scratch + (k * G + g) * stride;
            if (s[1] == 0.f) continue;  // a warp that saw no position
            float c = __expf(s[0] - M);
            L += s[1] * c;
            A += s[2 + d] * c;
        }
        float o = L > 0.f ? A / L : 0.f;
        if (parts == 1) {
            p.attn_out[(size_t)layer * p.heads * hd + head * hd + d] = o;
        } else {
            float* dst = p.attn_part + (((size_t)layer * p.heads + head) * parts + part) * (hd + 2);
            dst[d] = o;
            if (d == 0) { dst[hd] = M; dst[hd + 1] = L; }
        }
    }
}

__device__ void op_attn_reduce(const MkParams& p, const u32* w) {
    const int ct = threadIdx.x - 32, layer = w[W_LAYER], kvh = w[W_A], parts = w[W_B];
    const int hd = p.head_dim, group = p.heads / p.kv_heads;
    for (int idx = ct; idx < group * hd; idx += CONSUMERS) {
        const int head = kvh * group + idx / hd, d = idx % hd;
        const float* src = p.attn_part + ((size_t)layer * p.heads + head) * parts * (hd + 2);
        float M = NEG_INF;
        for (int k = 0; k < parts; k++) M = fmaxf(M, __ldcg(src + k * (hd + 2) + hd));
        float L = 0.f, A = 0.f;
        for (int k = 0; k < parts; k++) {
            const float* s = src + k * (hd + 2);
            float l = __ldcg(s + hd + 1);
            if (l == 0.f) continue;
            float c = l * __expf(__ldcg(s + hd) - M);
            L += c;
            A += __ldcg(s + d) * c;
        }
        p.attn_out[(size_t)layer * p.heads * hd + head * hd + d] = A / L;
    }
}

__device__ void post_qkv(const MkParams& p, const u32* w, const TokenMeta& m, const float* res) {
    const int ct = threadIdx.x - 32, layer = w[W_LAYER], head = w[W_A], ps = w[W_B], pc = w[W_C];
    const int hd = p.head_dim, half = hd / 2;
    for (int j = ct; j < pc; j += CONSUMERS) {
        float a = res_at(res, j), b = res_at(res, pc + j);
        const int i = ps + j;
        if (head < p.heads + p.kv_heads) {
            float s, c;
            sincosf((float)m.pos * p.inv_freq[i], &s, &c);
            float ra = a * c - b * s, rb = b * c + a * s;
            a = ra; b = rb;
        }
        if (head < p.heads) {
            float* q = p.q + (size_t)layer * p.heads * hd + head * hd;
            q[i] = a; q[i + half] = b;
        } else {
            bool is_k = head < p.heads + p.kv_heads;
            int kvh = head - p.heads - (is_k ? 0 : p.kv_heads);
            bf16_t* cache = (is_k ? p.k_cache : p.v_cache) +
                            (((size_t)layer * p.max_seq + m.pos) * p.kv_heads + kvh) * hd;
            cache[i] = f32_to_bf16(a); cache[i + half] = f32_to_bf16(b);
        }
    }
}

__device__ void post_lmhead(const MkParams& p, const u32* w, const float* res, float* red) {
    const int ct = threadIdx.x - 32, cw = ct >> 5, rs = w[W_A], rc = w[W_B];
    float v = NEG_INF;
    u32 idx = 0xffffffffu;
    for (int j = ct; j < rc; j += CONSUMERS) {
        float x = res_at(res, j);
        p.logits[rs + j] = x;
        argmax_merge(v, idx, x, (u32)(rs + j));
    }
    warp_argmax(v, idx);
    u32* redi = (u32*)(red + CONSUMER_WARPS);
    if ((ct & 31) == 0) { red[cw] = v; redi[cw] = idx; }
    consumers_sync();
    if (ct == 0) {
        for (int k = 1; k < CONSUMER_WARPS; k++) argmax_merge(v, idx, red[k], redi[k]);
        p.lm_best[2 * w[W_C]] = v;
        p.lm_best[2 * w[W_C] + 1] = __uint_as_float(idx);
    }
}

__device__ void op_argmax(const MkParams& p, const TokenMeta& m) {
    const int ct = threadIdx.x - 32;
    if (ct != 0) return;
    float v = NEG_INF;
    u32 idx = 0xffffffffu;
    for (int k = 0; k < p.n_lm; k++) argmax_merge(v, idx, __ldcg(p.lm_best + 2 * k), __float_as_uint(__ldcg(p.lm_best + 2 * k + 1)));
    p.history[m.pos + 1] = idx;
    TokenMeta* cur = p.meta + (p.epoch & 1);
    TokenMeta* nxt = p.meta + ((p.epoch + 1) & 1);
    cur->next = idx;
    nxt->token = idx;
    nxt->pos = m.pos + 1;
    nxt->next = 0;
}

extern "C" __global__ void __launch_bounds__(MK_THREADS, 1) megakernel(const __grid_constant__ MkParams p) {
    extern __shared__ __align__(128) unsigned char smem[];
    // After a failure every later launch stops at once, leaving the progress words as the
    // failing launch left them.
    if (aborted(p)) return;
    bf16_t* pages = (bf16_t*)smem;
    float* xs = (float*)(smem + (size_t)p.pages * PAGE_BYTES);
    float* res = xs + p.xs_floats;
    float* red = res + 2 * RES_MAX;             // 2 * CONSUMER_WARPS words
    u64* full = (u64*)(red + 2 * CONSUMER_WARPS);
    u64* empty = full + p.pages;

    if (threadIdx.x == 0) {
        for (int i = 0; i < p.pages; i++) { mbar_init(&full[i], 1); mbar_init(&empty[i], 2); }
        mbar_fence_init();
    }
    __syncthreads();

    const u32* begin = p.instrs + (size_t)p.sm_offsets[blockIdx.x] * MK_WORDS;
    const u32* end = p.instrs + (size_t)p.sm_offsets[blockIdx.x + 1] * MK_WORDS;
    if (threadIdx.x < 32) {
        loader(p, begin, end, pages, full, empty);
        return;
    }
    const int ct = threadIdx.x - 32;
    const TokenMeta m = p.meta[p.epoch & 1];
    const u32 mult = p.epoch + 1;
    u32 seq = 0;
    for (const u32* w = begin; w < end; w += MK_WORDS) {
        const u32 op = w[W_OP];
        u64* prof = p.profile ? p.profile + (size_t)((w - p.instrs) / MK_WORDS) * 6 : nullptr;
        if (ct == 0 && prof) prof[0] = global_ns();
        if (op == OP_ATTN) prefetch_attention_kv(p, w, m);
        if (ct == 0) {
            note(p, 0, (u32)((w - p.instrs) / MK_WORDS));
            note(p, 1, ST_WAIT);
            for (u32 k = 0; k < w[W_NWAIT]; k++) {
                const u32 ctr = w[W_WAITS + 2 * k], target = w[W_WAITS + 2 * k + 1] * mult;
                const u64 t0 = global_ns();
                u32 seen;
                int spins = 0;
                while ((int)((seen = ld_acquire(p.counters + ctr)) - target) < 0) {
                    if (++spins % 64 == 0 && (aborted(p) || global_ns() - t0 > p.timeout_ns)) {
                        raise_error(p, ERR_COUNTER, (u32)((w - p.instrs) / MK_WORDS), ctr, target, seen);
                        break;
                    }
                }
            }
        }
        consumers_sync();
        if (aborted(p)) return;
        if (ct == 0) note(p, 1, ST_PREPARE);
        if (ct == 0 && prof) prof[1] = global_ns();
        switch (op) {
            case OP_QKV:
                prepare_normed(p, w[W_LAYER], false, m.token, p.layers[w[W_LAYER]].attn_norm, xs, red);
                break;
            case OP_UPGATE:
                prepare_normed(p, w[W_LAYER], true, m.token, p.layers[w[W_LAYER]].ffn_norm, xs, red);
                break;
            case OP_LMHEAD:
                prepare_normed(p, p.n_layers, false, m.token, p.final_norm, xs, red);
                break;
            case OP_OPROJ: {
                const float* src = p.attn_out + (size_t)w[W_LAYER] * p.heads * p.head_dim;
                for (int i = ct; i < p.heads * p.head_dim; i += CONSUMERS) xs[i] = __ldcg(src + i);
                break;
            }
            case OP_DOWN: {
                const float* src = p.act + (size_t)w[W_LAYER] * p.inter + w[W_D];
                for (int i = ct; i < (int)w[W_E]; i += CONSUMERS) xs[i] = __ldcg(src + i);
                break;
            }
            case OP_ATTN: op_attention(p, w, m, xs); break;
            case OP_ATTN_REDUCE: op_attn_reduce(p, w); break;
            case OP_ARGMAX: op_argmax(p, m); break;
            default: break;
        }
        const int ntiles = tile_count(w, p);
        if (ntiles > 0) {
            consumers_sync();
            if (ct == 0 && prof) prof[2] = global_ns();
            if (ct == 0) note(p, 1, ST_TILES);
            consume_tiles(p, w, seq, pages, full, empty, xs, res);
            seq += ntiles;
            consumers_sync();
            if (ct == 0 && prof) prof[3] = global_ns();
            if (aborted(p)) return;
            if (ct == 0) note(p, 1, ST_POST);
            const int layer = w[W_LAYER], rs = w[W_A], rc = w[W_B];
            switch (op) {
                case OP_QKV: post_qkv(p, w, m, res); break;
                case OP_OPROJ:
                    for (int j = ct; j < rc; j += CONSUMERS)
                        p.resid_attn[(size_t)layer * p.hidden + rs + j] = resid_in(p, layer, m.token, rs + j) + res_at(res, j);
                    break;
                case OP_UPGATE:
                    for (int j = ct; j < rc; j += CONSUMERS)
                        p.act[(size_t)layer * p.inter + rs + j] = silu(res_at(res, j)) * res_at(res, rc + j);
                    break;
                case OP_DOWN:
                    for (int j = ct; j < rc; j += CONSUMERS)
                        p.mlp_part[((size_t)layer * p.chunks + w[W_C]) * p.hidden + rs + j] = res_at(res, j);
                    break;
                case OP_LMHEAD: post_lmhead(p, w, res, red); break;
                default: break;
            }
        }
        consumers_sync();
        // The barrier orders every consumer's stores before thread 0's release add, which
        // publishes them (release is cumulative): no separate fence is needed.
        if (ct == 0 && prof) {
            if (ntiles == 0) prof[2] = prof[3] = prof[1];
            prof[4] = global_ns();
        }
        if (ct == 0 && w[W_SIGNAL] != NO_COUNTER) red_release_add(p.counters + w[W_SIGNAL], 1);
        if (ct == 0 && prof) prof[5] = global_ns();
        if (ct == 0) note(p, 1, ST_DONE);
    }
}

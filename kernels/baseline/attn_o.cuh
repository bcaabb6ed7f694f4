// The graph paths' attention with the O projection (host side: src/gpu/baseline/attn_o.rs).
// Included after baseline.cu and attention.cuh, whose helpers it uses.

// bl_attn_o: a layer's attention and O projection in one kernel, for short caches (where
// bl_attention runs: one block per query head, no split over positions), split over the heads
// instead of run as two kernels with a boundary between them.
//
// CTA (head h, row block b) loads its rows of W_o's head-h columns (head_dim of them: a
// 128-byte line a row at head_dim 64) into registers first, attends for head h as bl_attention
// does (warps over blocks of 32 positions, then the warps' states merged), then multiplies: a
// lane group of CS = head_dim / 8 lanes a row, AO_U consecutive rows a group and batch, the
// row sums added into y (and y2) with vector reductions (red.global.add.v4.f32). Every head's
// CTAs add to every row, so y must hold the residual before the launch (the QKV product copies
// it there: MvParams::y3) and the order of the additions, hence y's last bits, depends on
// timing. Each head's attention runs once per row block (K and V rows from L2; short caches
// only).
struct AttnOParams {
    const float* q;          // the rotated queries, n_heads x head_dim
    const bf16_t* k_cache;   // this layer's caches, position-major ([pos][n_kv][head_dim])
    const bf16_t* v_cache;
    const TokenMeta* meta;
    const bf16_t* w_o;       // hidden rows of n_heads x head_dim
    float* y;                // the residual: the layer's input on entry, + W_o · attention on exit
    float* y2;               // the same sums added (the residual the fused MLP adds into), or null
    int n_heads, n_kv, hidden, rows;  // rows: W_o rows a CTA takes (a multiple of 16)
    int evict_first, pad;
};

#ifndef AO_U
#define AO_U 16
#endif
static_assert(AO_U % 4 == 0, "rows are added four at a time");

template <int D>
__device__ __forceinline__ void attn_o_body(const AttnOParams& p) {
    constexpr int HD = 32 * D, CS = HD / 8, RW = 32 / CS, ROWS = RW * AO_U;  // W_o rows a warp batch
    extern __shared__ float ao_st[];  // per warp (m, l, acc[HD]), then q (HD), then the output (HD)
    pdl_launch_next();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
    const int nb = gridDim.x / p.n_heads, h = blockIdx.x / nb, b = blockIdx.x - h * nb;
    const int r0 = b * p.rows, r1 = min(r0 + p.rows, p.hidden), qd = p.n_heads * HD;
    const int grp = lane / CS, ch = lane - grp * CS;
    const int nbatch = (r1 - r0 + ROWS - 1) / ROWS;
    const int mine = nbatch > warp ? (nbatch - warp + nwarps - 1) / nwarps : 0;
    u64 policy = 0;
    if (p.evict_first) asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    const bool ef = p.evict_first != 0;
    // The warp's batch i of W_o rows: rb + q for q < AO_U, rb = r0 + (warp + nwarps i) ROWS + grp AO_U.
    auto load = [&](uint4 (&w)[AO_U], int i) {
        const int rb = r0 + (warp + nwarps * i) * ROWS + grp * AO_U;
#pragma unroll
        for (int q = 0; q < AO_U; q++) {
            const int r = rb + q;
            w[q] = r < r1 ? mv_ld(p.w_o + (size_t)r * qd + h * HD + 8 * ch, policy, ef) : make_uint4(0u, 0u, 0u, 0u);
        }
    };
    uint4 w[AO_U];
    if (mine > 0) load(w, 0);
    pdl_wait();

    const int kvh = h / (p.n_heads / p.n_kv), kv_stride = p.n_kv * HD;
    const int len = p.meta->pos + 1;
    float* qs = ao_st + nwarps * (2 + HD);
    float* os = qs + HD;
    for (int i = threadIdx.x; i < HD; i += blockDim.x) qs[i] = p.q[h * HD + i];
    __syncthreads();
    float acc[D];
#pragma unroll
    for (int j = 0; j < D; j++) acc[j] = 0.f;
    float m = NEG_INF, l = 0.f;
    attend_warp<D>(qs, p.k_cache + kvh * HD, p.v_cache + kvh * HD, kv_stride, rsqrtf((float)HD), 0, len, warp,
                   nwarps, m, l, acc);
    float* st = ao_st + warp * (2 + HD);
    if (lane == 0) { st[0] = m; st[1] = l; }
#pragma unroll
    for (int j = 0; j < D; j++) st[2 + lane * D + j] = acc[j];
    __syncthreads();
    merge_warp_states(ao_st, nwarps, HD, os);
    __syncthreads();

    float o[8];
#pragma unroll
    for (int e = 0; e < 8; e++) o[e] = os[8 * ch + e];
    for (int i = 0; i < mine; i++) {
        if (i > 0) load(w, i);  // row blocks taller than one batch a warp: the rest after attention
        float v[AO_U];
        group_row_sums<AO_U, CS>(w, o, v);
        const int rb = r0 + (warp + nwarps * i) * ROWS + grp * AO_U;
        add_row_sums<AO_U, CS>(v, ch, p.y, p.y2, rb, r1);
    }
}

extern "C" __global__ void __launch_bounds__(256, 1) bl_attn_o_d2(const __grid_constant__ AttnOParams p) {
    attn_o_body<2>(p);
}
extern "C" __global__ void __launch_bounds__(256, 1) bl_attn_o_d4(const __grid_constant__ AttnOParams p) {
    attn_o_body<4>(p);
}

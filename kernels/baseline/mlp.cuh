// The graph paths' fused MLP (host side: src/gpu/baseline/mlp.rs). Included after baseline.cu,
// whose load helper (mv_ld), warp count and PDL helpers it uses.

// bl_mlp: a layer's whole MLP in one kernel, y += W_down · (silu(W_gate · x̂) ⊙ (W_up · x̂)),
// x̂ = the RMS-normed x, split over the intermediate rows instead of run as two mat-vecs with
// a kernel boundary between them (2 µs a layer without PDL: the drain, the launch and the
// next kernel's first loads' latency, while HBM idles).
//
// CTA t takes intermediate rows [t J, t J + J) (J = 8 CS, one CTA an SM, the host sizes J so
// that the CTAs fill the SMs once). Phase 1: warp w takes the rows' gate/up pairs w, w + 8, ...,
// both rows of a pair MLP_U / 2 16-byte loads a lane per batch (2048 columns at 16), and
// h_j = silu(gate) · up goes to shared memory. Phase 2: the CTA's share of the down
// projection, W_down[:, its J columns] · h: each row's J columns are CS 16-byte chunks side by
// side (a 128-byte line at J = 64), a lane group of CS lanes per row, MLP_U consecutive rows
// per group and batch; the row sums are added into y with vector reductions
// (red.global.add.v4.f32) — every CTA adds to every row, so the order of the additions (and
// the last bits of y) depends on timing.
// y must hold the residual before the launch (the O projection stores it there too,
// MV_OUT_ADD_COPY; or the QKV product copied it there and bl_attn_o added to it), so x, which
// every CTA reads for its norm, is never written here.
// Both phases are one stream of batches per warp, double-buffered across the phase boundary:
// the first down rows are in flight while the last gate/up pair is multiplied.
struct MlpParams {
    const bf16_t* w_gu;    // [gate; up]: 2 inter rows of hidden
    const bf16_t* w_down;  // hidden rows of inter
    const float* x;        // the residual the norm reads (hidden)
    const bf16_t* norm;    // the MLP's RMS-norm weights (hidden)
    float* y;              // hidden: the residual on entry, the layer's output on exit
    const char* pf;        // the next projection's weights: CTAs past `tasks` prefetch them to L2
    int hidden, inter;
    float eps;
    int evict_first;
    int pf_bytes;          // how many bytes of them (0: no such CTAs)
    int tasks;             // CTAs that compute (inter / J)
};

// 16-byte loads a lane per batch, in both phases.
#ifndef MLP_U
#define MLP_U 16
#endif
static_assert(MLP_U % 8 == 0, "a batch holds both rows of a gate/up pair and whole groups of four down rows");

// The sums of U weight rows (a lane's 8 columns each, w) with x over a group of CS lanes, in
// every lane of the group (the fused kernels' column slices: this file's down projection,
// attn_o.cuh's O projection).
template <int U, int CS>
__device__ __forceinline__ void group_row_sums(const uint4 (&w)[U], const float* x, float (&v)[U]) {
#pragma unroll
    for (int q = 0; q < U; q++) v[q] = dot8(w[q], x);
#pragma unroll
    for (int s = 1; s < CS; s <<= 1)
#pragma unroll
        for (int q = 0; q < U; q++) v[q] += __shfl_xor_sync(0xffffffffu, v[q], s);
}

// The column-slice epilogue of the fused kernels (this file's down projection, attn_o.cuh's
// O projection): every lane of a group of CS holds the sums of U rows (v), and lane ch adds
// rows r0 + 4 q4.. (q4 % CS == ch, below r_end) into y, and into y2 unless it is null, four at
// a time.
template <int U, int CS>
__device__ __forceinline__ void add_row_sums(const float (&v)[U], int ch, float* y, float* y2, int r0, int r_end) {
#pragma unroll
    for (int q4 = 0; q4 < U / 4; q4++) {
        if (q4 % CS == ch && r0 + 4 * q4 < r_end) {
            asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(y + r0 + 4 * q4), "f"(v[4 * q4]),
                         "f"(v[4 * q4 + 1]), "f"(v[4 * q4 + 2]), "f"(v[4 * q4 + 3])
                         : "memory");
            if (y2)
                asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(y2 + r0 + 4 * q4),
                             "f"(v[4 * q4]), "f"(v[4 * q4 + 1]), "f"(v[4 * q4 + 2]), "f"(v[4 * q4 + 3])
                             : "memory");
        }
    }
}

template <int CS>
__device__ __forceinline__ void mlp_body(const MlpParams& p) {
    constexpr int J = 8 * CS, RW = 32 / CS, ROWS2 = RW * MLP_U;  // down rows per warp batch
    extern __shared__ float4 mlp_xs4[];  // x̂ (hidden floats), then h (J floats)
    __shared__ float partial[32];
    pdl_launch_next();
    if ((int)blockIdx.x >= p.tasks) {
        // The SMs the split leaves idle pull the next projection's first weights into L2 (normal
        // priority: this kernel's own weights are marked evict-first), where that kernel, which
        // cannot start before this one ends without PDL, finds them.
        const int lines = p.pf_bytes >> 7, stride = (gridDim.x - p.tasks) * blockDim.x;
        for (int i = (blockIdx.x - p.tasks) * blockDim.x + threadIdx.x; i < lines; i += stride)
            asm volatile("prefetch.global.L2 [%0];" ::"l"(p.pf + ((size_t)i << 7)));
        return;
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int H8 = p.hidden >> 3, j0 = blockIdx.x * J;
    const int nb1 = (H8 + 16 * MLP_U - 1) / (16 * MLP_U);  // column batches per gate/up row
    const int n1 = (J / MV_WARPS) * nb1;      // the warp's phase-1 batches
    const int nrb = (p.hidden + ROWS2 - 1) / ROWS2;
    const int n2 = nrb > warp ? (nrb - warp + MV_WARPS - 1) / MV_WARPS : 0;  // its phase-2 batches
    const int grp = lane / CS, ch = lane - grp * CS;
    u64 policy = 0;
    if (p.evict_first) asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    const bool ef = p.evict_first != 0;

    // Batch i of the warp's stream into w.
    auto load = [&](uint4 (&w)[MLP_U], int i) {
        if (i < n1) {
            const int k = warp + MV_WARPS * (i / nb1), cb = i - (i / nb1) * nb1;
            const bf16_t* g = p.w_gu + (size_t)(j0 + k) * p.hidden;
            const bf16_t* u = p.w_gu + (size_t)(p.inter + j0 + k) * p.hidden;
#pragma unroll
            for (int q = 0; q < MLP_U / 2; q++) {
                const int c = cb * 16 * MLP_U + lane + 32 * q;
                w[q] = c < H8 ? mv_ld(g + 8 * c, policy, ef) : make_uint4(0u, 0u, 0u, 0u);
                w[MLP_U / 2 + q] = c < H8 ? mv_ld(u + 8 * c, policy, ef) : make_uint4(0u, 0u, 0u, 0u);
            }
        } else {
            const int r0 = (warp + MV_WARPS * (i - n1)) * ROWS2 + grp * MLP_U;
#pragma unroll
            for (int q = 0; q < MLP_U; q++) {
                const int r = r0 + q;
                w[q] = r < p.hidden ? mv_ld(p.w_down + (size_t)r * p.inter + j0 + 8 * ch, policy, ef)
                                    : make_uint4(0u, 0u, 0u, 0u);
            }
        }
    };

    uint4 w[MLP_U], wn[MLP_U];
    load(w, 0);
    pdl_wait();
    float* xs = (float*)mlp_xs4;
    float* hs = xs + p.hidden;
    {
        const float4* x4 = (const float4*)p.x;
        const int n4 = p.hidden >> 2;
        float ss = 0.f;
        for (int i = threadIdx.x; i < n4; i += blockDim.x) {
            const float4 v = x4[i];
            mlp_xs4[i] = v;
            ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
        const float scale = block_inv_rms(ss, p.hidden, p.eps, partial);
        for (int i = threadIdx.x; i < n4; i += blockDim.x)
            mlp_xs4[i] = norm4(mlp_xs4[i], *(const uint2*)(p.norm + 4 * i), scale);
        __syncthreads();
    }

    // Phase 1: the warp's gate/up pairs.
    float sg = 0.f, su = 0.f;
    for (int i = 0; i < n1; i++) {
        if (i + 1 < n1 + n2) load(wn, i + 1);
        const int cb = i % nb1;
#pragma unroll
        for (int q = 0; q < MLP_U / 2; q++) {
            const int c = cb * 16 * MLP_U + lane + 32 * q;
            if (c < H8) {
                sg += dot8(w[q], xs + 8 * c);
                su += dot8(w[MLP_U / 2 + q], xs + 8 * c);
            }
        }
        if (cb == nb1 - 1) {
            sg = warp_sum(sg);
            su = warp_sum(su);
            if (lane == 0) hs[warp + MV_WARPS * (i / nb1)] = silu(sg) * su;
            sg = su = 0.f;
        }
#pragma unroll
        for (int q = 0; q < MLP_U; q++) w[q] = wn[q];
    }
    __syncthreads();  // h complete

    // Phase 2: the CTA's columns of the down projection.
    float h[8];
#pragma unroll
    for (int e = 0; e < 8; e++) h[e] = hs[8 * ch + e];
    for (int i = 0; i < n2; i++) {
        if (i + 1 < n2) load(wn, n1 + i + 1);
        float v[MLP_U];
        group_row_sums<MLP_U, CS>(w, h, v);
        const int r0 = (warp + MV_WARPS * i) * ROWS2 + grp * MLP_U;
        add_row_sums<MLP_U, CS>(v, ch, p.y, nullptr, r0, p.hidden);
#pragma unroll
        for (int q = 0; q < MLP_U; q++) w[q] = wn[q];
    }
}

// One kernel per J = 8 CS the host may pick (MLP_VARIANTS in src/gpu/baseline.rs).
#define MLP_KERNEL(NAME, CS)                                                                       \
    extern "C" __global__ void __launch_bounds__(MV_THREADS, 1) NAME(const __grid_constant__ MlpParams p) { \
        mlp_body<CS>(p);                                                                           \
    }
MLP_KERNEL(bl_mlp_j16, 2)
MLP_KERNEL(bl_mlp_j32, 4)
MLP_KERNEL(bl_mlp_j64, 8)
MLP_KERNEL(bl_mlp_j128, 16)


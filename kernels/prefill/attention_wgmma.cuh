// Causal flash attention on Hopper's warpgroup tensor-core instructions (wgmma) and bulk
// tensor copies, for the batched prefill; included after prefill.cu (it uses its pf_ helpers).
// Same result as pf_attention there, which remains for other GPUs and for comparison.
//
// Why (BENCHMARKS.md has the steps): the mma.sync kernel runs at about 230 TFLOP/s on the
// H100, and a 32K prompt spends most of its time in attention. The loop is bound by issue
// slots, not by the tensor cores, so everything here removes instructions from it:
// - wgmma issues a 64-row product per warpgroup asynchronously, at twice mma.sync's rate,
//   reading K and V from shared memory itself (no ldmatrix);
// - one thread fetches a tile with the bulk tensor copy engine (no per-thread copies, no
//   address arithmetic), which also writes the swizzled layout wgmma reads;
// - the output is rescaled only when a row's maximum grows by more than 2^8.
//
// Block: two warpgroups of 64 query rows each (one head, 128 rows), sharing K/V tiles of 64
// positions, 4 stages deep.
// - S = Q K^T: wgmma m64 n64 k16, Q as register fragments (read once), K from shared memory
//   as a K-major operand.
// - online softmax in registers, as the mma.sync kernel (the accumulator layout of wgmma is
//   mma.sync's C layout repeated over the n8 blocks), P packed to bf16 in registers;
// - O += P V: wgmma m64 n(D) k16, P as the register A operand, V from shared memory as an
//   MN-major operand (the transpose bit), so V is stored as the cache holds it.
// - software-pipelined: tile kt's scores are computed while tile kt - 1's P V is in flight,
//   and tile kt's softmax overlaps that P V.
// Tiles are stored in the 128-byte swizzled layout: a 64-column half-row of 128 bytes per
// position, 16-byte chunk c of row r at chunk c ^ (r & 7), each half-tile 1024-byte aligned.

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define PF_HAS_WGMMA 1
#endif

#ifdef PF_HAS_WGMMA

// Shared-memory matrix descriptor (PTX ISA, "matrix descriptor"): start address, leading and
// stride byte offsets (each >> 4), 128-byte swizzle (layout type 1 in bits 62-63).
__device__ __forceinline__ unsigned long long pf_wg_desc(pf_u32 smem_addr, pf_u32 lbo, pf_u32 sbo) {
    return (unsigned long long)((smem_addr & 0x3FFFFu) >> 4) | ((unsigned long long)((lbo >> 4) & 0x3FFFu) << 16) |
           ((unsigned long long)((sbo >> 4) & 0x3FFFu) << 32) | (1ull << 62);
}

__device__ __forceinline__ void pf_wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void pf_wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void pf_wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Keeps the compiler from moving accesses of an accumulator across the asynchronous product.
template <int N>
__device__ __forceinline__ void pf_wg_pin(float* r) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(r[i])::"memory");
}

#define PF_WG_R8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])

// d[0..32) += a (m64 x k16, registers) * B (k16 x n64, descriptor); TB: B is MN-major.
template <int TB>
__device__ __forceinline__ void pf_wgmma_n64(float* d, const pf_u32* a, unsigned long long b) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, 1, 1, 1, %37;\n"
        : PF_WG_R8(0), PF_WG_R8(8), PF_WG_R8(16), PF_WG_R8(24)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(TB));
}

// d[0..64) += a (m64 x k16, registers) * B (k16 x n128, descriptor).
template <int TB>
__device__ __forceinline__ void pf_wgmma_n128(float* d, const pf_u32* a, unsigned long long b) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "{%64, %65, %66, %67}, %68, 1, 1, 1, %69;\n"
        : PF_WG_R8(0), PF_WG_R8(8), PF_WG_R8(16), PF_WG_R8(24), PF_WG_R8(32), PF_WG_R8(40), PF_WG_R8(48),
          PF_WG_R8(56)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(TB));
}

#define PF_WG_W8(i) "=f"(d[i]), "=f"(d[i + 1]), "=f"(d[i + 2]), "=f"(d[i + 3]), "=f"(d[i + 4]), "=f"(d[i + 5]), "=f"(d[i + 6]), "=f"(d[i + 7])

// d[0..N/2) = a * B (K-major B): the first product of a sum, whose accumulator is written,
// not read (scale-d 0), so the registers' earlier values are no operand of it.
template <int N>
__device__ __forceinline__ void pf_wgmma_first(float* d, const pf_u32* a, unsigned long long b) {
    if constexpr (N == 64) {
        asm volatile(
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
            "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
            "{%32, %33, %34, %35}, %36, 0, 1, 1, 0;\n"
            : PF_WG_W8(0), PF_WG_W8(8), PF_WG_W8(16), PF_WG_W8(24)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
    } else {
        static_assert(N == 128, "wgmma tiles are 64 or 128 columns wide here");
        asm volatile(
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
            "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
            "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
            "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
            "{%64, %65, %66, %67}, %68, 0, 1, 1, 0;\n"
            : PF_WG_W8(0), PF_WG_W8(8), PF_WG_W8(16), PF_WG_W8(24), PF_WG_W8(32), PF_WG_W8(40), PF_WG_W8(48),
              PF_WG_W8(56)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
    }
}

// d += a * B over an N-column accumulator (the first product of a sum: pf_wgmma_first).
template <int N, int TB>
__device__ __forceinline__ void pf_wgmma(float* d, const pf_u32* a, unsigned long long b) {
    if constexpr (N == 64) {
        pf_wgmma_n64<TB>(d, a, b);
    } else {
        static_assert(N == 128, "wgmma tiles are 64 or 128 columns wide here");
        pf_wgmma_n128<TB>(d, a, b);
    }
}

// A CUtensorMap (driver API; 128 bytes, 64-byte aligned), passed by value as a
// __grid_constant__ parameter so the bulk tensor copy can name its address.
struct __align__(64) PfTensorMap {
    unsigned long long opaque[16];
};

__device__ __forceinline__ void pf_mbar_init(pf_u32 bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void pf_mbar_expect(pf_u32 bar, unsigned bytes) {
    asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}" ::"r"(bar), "r"(bytes)
                 : "memory");
}
// Waits for the phase `parity` of an mbarrier to complete. A copy that never lands (a bad
// tensor map) traps the kernel, an error the host reports, after about a million polls
// instead of hanging the GPU.
__device__ __forceinline__ void pf_mbar_wait(pf_u32 bar, unsigned parity) {
    for (unsigned tries = 0;; tries++) {
        pf_u32 done;
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
        if (done) return;
        if (tries > (1u << 20)) __trap();
    }
}
// A box of the tensor map at coordinates (c0, c1, c2, c3) into shared memory at dst,
// completing on the mbarrier bar.
__device__ __forceinline__ void pf_tma_load(pf_u32 dst, const PfTensorMap* map, int c0, int c1, int c2, int c3,
                                            pf_u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
        "[%6];" ::"r"(dst),
        "l"((unsigned long long)map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
        : "memory");
}

// The wgmma kernel with K and V tiles fetched by the bulk tensor copy engine: one thread
// asks for a tile (a box per 64-column half of K and of V) and every thread waits on the
// stage's mbarrier, so the copies take no issue slots from the softmax; the engine writes
// the 128-byte swizzled layout itself. k_map and v_map are 4-D maps of the cache (head_dim,
// then its other three dimensions in order of stride: position and KV head in the
// layout's order, then layer); pos_dim (1 or 2) says which coordinate is the position.
// The output is rescaled only when a row's running maximum has grown by more than 2^8
// since it was last applied: the probabilities then stay below 256, within f32's and bf16's
// range at their usual relative precision, and the factor cancels in the final division.
template <int D, int STAGES>
__device__ __forceinline__ void pf_attention_tma_body(const pf_bf16* q, const PfTensorMap* k_map, const PfTensorMap* v_map,
                                                      int layer, int pos_dim, pf_bf16* out, int T, int start,
                                                      int n_heads, int n_kv, float scale_log2) {
    constexpr int BK = 64, BQ = 128;
    constexpr int HALVES = D / 64;
    constexpr int HALF = BK * 128;       // bytes of one half-tile
    constexpr int TILE = HALVES * HALF;  // bytes of a K (or V) tile
    extern __shared__ __align__(1024) unsigned char pf_tma_smem[];
    const pf_u32 smem0 = (pf_smem_addr(pf_tma_smem) + 1023u) & ~1023u;
    const pf_u32 bars = smem0 + STAGES * 2 * TILE;  // STAGES mbarriers, 8 bytes each

    const int n_tiles = (T + BQ - 1) / BQ;
    const int h = blockIdx.x % n_heads, kvh = h / (n_heads / n_kv);
    const int q0 = (n_tiles - 1 - (int)(blockIdx.x / n_heads)) * BQ;
    const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    const int g = lane >> 2, tq = lane & 3;
    const int q_dim = n_heads * D;
    const int kv_end = start + min(q0 + BQ, T);
    const int n_kt = (kv_end + BK - 1) / BK;

    if (threadIdx.x == 0) {
#pragma unroll
        for (int st = 0; st < STAGES; st++) pf_mbar_init(bars + 8 * st, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    // Tile kt into its stage (thread 0). Positions past the cache's end read as zeros;
    // positions past kv_end hold finite cache contents (zeroed at allocation) and are masked.
    auto fetch = [&](int kt) {
        if (threadIdx.x == 0 && kt < n_kt) {
            const pf_u32 dst = smem0 + (kt % STAGES) * 2 * TILE, bar = bars + 8 * (kt % STAGES);
            pf_mbar_expect(bar, 2 * TILE);
            const int c1 = pos_dim == 1 ? kt * BK : kvh, c2 = pos_dim == 1 ? kvh : kt * BK;
#pragma unroll
            for (int hf = 0; hf < HALVES; hf++) {
                pf_tma_load(dst + hf * HALF, k_map, hf * 64, c1, c2, layer, bar);
                pf_tma_load(dst + TILE + hf * HALF, v_map, hf * 64, c1, c2, layer, bar);
            }
        }
    };
#pragma unroll
    for (int st = 0; st < STAGES - 2; st++) fetch(st);

    const int wr = wg * 64 + warp * 16;
    const int ra = q0 + wr + g, rb = ra + 8;
    pf_u32 qf[D / 16][4];
    pf_load_q<D>(q, T, q_dim, h, ra, rb, tq, qf);

    float o[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m_a = PF_NEG_INF, m_b = PF_NEG_INF, l_a = 0.f, l_b = 0.f;
    const int pa = start + ra, pb = pa + 8;
    const int g_first = start + q0 + wg * 64, g_last = g_first + 63;
    // Descriptors of stage 0's K tile (K-major) and V tile (MN-major); a stage, a 64-column
    // half and a k-step are offsets added to the address field (bits 0-13, in 16 bytes).
    const unsigned long long kdesc0 = pf_wg_desc(smem0, 16, 1024), vdesc0 = pf_wg_desc(smem0 + TILE, HALF, 1024);

    // Scores -> probabilities in place; returns (warp-uniform) whether the output must be
    // rescaled by alpha before the next P V.
    auto softmax = [&](float (&s)[BK / 8][4], int k0, float& alpha_a, float& alpha_b) {
        if (k0 + BK - 1 > g_first || k0 + BK > kv_end) pf_mask<BK>(s, k0, kv_end, pa, pb, tq);
        float mx_a, mx_b;
        pf_tile_max<BK>(s, mx_a, mx_b);
        // Key 0 is visible to every row and sits in the first tile, so the maxima are finite
        // from the first tile on (and the first tile always moves them off -inf).
        mx_a *= scale_log2;
        mx_b *= scale_log2;
        const bool grow_a = mx_a > m_a + 8.f, grow_b = mx_b > m_b + 8.f;
        alpha_a = grow_a ? exp2f(m_a - mx_a) : 1.f;
        alpha_b = grow_b ? exp2f(m_b - mx_b) : 1.f;
        m_a = grow_a ? mx_a : m_a;
        m_b = grow_b ? mx_b : m_b;
        float sum_a = 0.f, sum_b = 0.f;
        pf_exp_tile<BK>(s, scale_log2, m_a, m_b, sum_a, sum_b);
        l_a = l_a * alpha_a + sum_a;
        l_b = l_b * alpha_b + sum_b;
        return __any_sync(0xffffffffu, grow_a || grow_b);
    };
    auto pack = [&](const float (&s)[BK / 8][4], pf_u32 (&p)[BK / 16][4]) {
#pragma unroll
        for (int kk = 0; kk < BK / 16; kk++) pf_pack_k16<BK>(s, kk, p[kk]);
    };
    auto rescale = [&](float alpha_a, float alpha_b) {
#pragma unroll
        for (int n = 0; n < D / 8; n++) {
            o[n][0] *= alpha_a;
            o[n][1] *= alpha_a;
            o[n][2] *= alpha_b;
            o[n][3] *= alpha_b;
        }
    };
    auto issue_s = [&](float (&s)[BK / 8][4], int kt) {
        const unsigned long long d = kdesc0 + (((kt % STAGES) * 2 * TILE) >> 4);
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            const unsigned long long kd = d + (((kk >> 2) * HALF + (kk & 3) * 32) >> 4);
            if (kk == 0) {
                pf_wgmma_first<BK>(&s[0][0], qf[kk], kd);
            } else {
                pf_wgmma<BK, 0>(&s[0][0], qf[kk], kd);
            }
        }
        pf_wg_commit();
    };
    auto issue_pv = [&](const pf_u32 (&p)[BK / 16][4], int kt) {
        const unsigned long long d = vdesc0 + (((kt % STAGES) * 2 * TILE) >> 4);
#pragma unroll
        for (int kk = 0; kk < BK / 16; kk++) pf_wgmma<D, 1>(&o[0][0], p[kk], d + ((kk * 16 * 128) >> 4));
        pf_wg_commit();
    };
    // Round kt: every thread passes the block's barrier (so tile kt - 2's stage is free
    // everywhere) before thread 0 refills it, then waits for tile kt.
    auto next_tile = [&](int kt) {
        __syncthreads();
        fetch(kt + STAGES - 2);
        pf_mbar_wait(bars + 8 * (kt % STAGES), (kt / STAGES) & 1);
    };

    const int n_w = min(n_kt, g_last / BK + 1);  // tiles with a key this warpgroup sees
    pf_u32 p[BK / 16][4];
    float alpha_a, alpha_b;
    bool resc;
    {
        next_tile(0);
        float s[BK / 8][4];
        pf_wg_fence();
        issue_s(s, 0);
        pf_wg_wait<0>();
        pf_wg_pin<BK / 2>(&s[0][0]);
        softmax(s, 0, alpha_a, alpha_b);
        resc = false;  // the output is still zero
        pack(s, p);
    }
    for (int kt = 1; kt < n_w; kt++) {
        next_tile(kt);
        float s[BK / 8][4];
        pf_wg_fence();
        issue_s(s, kt);
        if (resc) rescale(alpha_a, alpha_b);
        pf_wg_fence();
        issue_pv(p, kt - 1);
        pf_wg_wait<1>();
        pf_wg_pin<BK / 2>(&s[0][0]);
        resc = softmax(s, kt * BK, alpha_a, alpha_b);
        pf_wg_wait<0>();
        pf_wg_pin<D / 2>(&o[0][0]);
        pack(s, p);
    }
    if (resc) rescale(alpha_a, alpha_b);
    pf_wg_fence();
    issue_pv(p, n_w - 1);
    pf_wg_wait<0>();
    pf_wg_pin<D / 2>(&o[0][0]);
    for (int kt = n_w; kt < n_kt; kt++) next_tile(kt);

    pf_store_rows<D>(out, o, 1.f / pf_quad_sum(l_a), 1.f / pf_quad_sum(l_b), T, q_dim, h, ra, rb, tq);
}
#endif  // PF_HAS_WGMMA

// Grid: ceil(T / 128) * heads blocks of 256 threads; shared memory STAGES * 2 * 64 * D * 2
// + 1024 (alignment) + 8 * STAGES (mbarriers) bytes, mirrored by src/gpu/prefill.rs
// (AttentionKernel).
#ifdef PF_HAS_WGMMA
#define PF_TMA_BODY(D, STAGES) \
    pf_attention_tma_body<D, STAGES>(q, &k_map, &v_map, layer, pos_dim, out, T, *start_p, n_heads, n_kv, scale_log2);
#else
#define PF_TMA_BODY(D, STAGES) __trap();
#endif
#define PF_TMA_KERNEL(NAME, D, STAGES, MINB)                                                                         \
    extern "C" __global__ void __launch_bounds__(256, MINB)                                                          \
        NAME(const pf_bf16* q, const __grid_constant__ PfTensorMap k_map, const __grid_constant__ PfTensorMap v_map, \
             int layer, int pos_dim, pf_bf16* out, int T, const int* start_p, int n_heads, int n_kv, float scale_log2) { \
        PF_TMA_BODY(D, STAGES)                                                                                       \
    }
PF_TMA_KERNEL(pf_attention_tma_64, 64, 4, 2)
PF_TMA_KERNEL(pf_attention_tma_128, 128, 4, 1)

// The conventional decode path: one kernel per operation, captured in a CUDA graph.
// Every kernel starts with launch_dependents and waits (griddepcontrol.wait) just before it
// first reads its predecessor's output, so under programmatic dependent launch its weight
// prefetch overlaps the previous kernel; without PDL both instructions are no-ops.

__device__ __forceinline__ void pdl_launch_next() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }


extern "C" __global__ void bl_embed(const bf16_t* embed, const TokenMeta* meta, float* x, int hidden) {
    pdl_launch_next();
    pdl_wait();
    const bf16_t* row = embed + (size_t)meta->token * hidden;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < hidden; i += gridDim.x * blockDim.x)
        x[i] = bf16_to_f32(row[i]);
}

// One block: out = x / rms(x) * w (when the norm is not folded into bl_gemv).
extern "C" __global__ void bl_rmsnorm(const float* x, const bf16_t* w, float* out, int n, float eps) {
    __shared__ float partial[32];
    pdl_launch_next();
    pdl_wait();
    float ss = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += x[i] * x[i];
    const float scale = block_inv_rms(ss, n, eps, partial);
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = x[i] * scale * bf16_to_f32(w[i]);
}

// act = silu(gate) * up, with gu = [gate; up] (when not folded into bl_gemv).
extern "C" __global__ void bl_silu_mul(const float* gu, float* act, int inter) {
    pdl_launch_next();
    pdl_wait();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < inter; i += gridDim.x * blockDim.x)
        act[i] = silu(gu[i]) * gu[inter + i];
}

#define GEMV_ROWS_PER_WARP 2
#define GEMV_UNROLL 4

// How bl_gemv forms its input vector while staging it in shared memory, so that the RMS norm
// and SiLU·up need no kernels (and no trips through global memory) of their own.
#define GEMV_IN_PLAIN 0  // x
#define GEMV_IN_NORM 1   // x / rms(x) * norm (the RMS norm of the layer's input)
#define GEMV_IN_SILU 2   // silu(x[i]) * x[cols + i] (x = [gate; up], 2 * cols floats)

// The first mat-vec, no longer on the decode path (bl_mv below is): kept as the reference point
// the kernel harness times the others against (tests/gpu_gemv_bench.rs, OldGemv).
// y[r] (+)= W[r,:] . in for GEMV_ROWS_PER_WARP rows per warp; `in` formed from x per `mode` and
// staged in shared memory (every block forms all of it: cols floats, read from L2).
// cols must be a multiple of 8.
extern "C" __global__ void bl_gemv(const bf16_t* W, const float* x, float* y, int rows, int cols, int accumulate,
                                   int mode, const bf16_t* norm, float eps) {
    extern __shared__ float xs[];
    __shared__ float partial[32];
    pdl_launch_next();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row0 = (blockIdx.x * (blockDim.x >> 5) + warp) * GEMV_ROWS_PER_WARP;
    // Weights do not depend on the previous kernel: pull them towards L2 before waiting.
    for (int r = 0; r < GEMV_ROWS_PER_WARP; r++)
        if (row0 + r < rows)
            for (int off = lane * 64; off < cols; off += 32 * 64) prefetch_l2(W + (size_t)(row0 + r) * cols + off);
    pdl_wait();
    if (mode == GEMV_IN_SILU) {
        for (int i = threadIdx.x; i < cols; i += blockDim.x) xs[i] = silu(x[i]) * x[cols + i];
    } else {
        float ss = 0.f;
        for (int i = threadIdx.x; i < cols; i += blockDim.x) {
            const float v = x[i];
            xs[i] = v;
            ss += v * v;
        }
        if (mode == GEMV_IN_NORM) {
            const float scale = block_inv_rms(ss, cols, eps, partial);
            for (int i = threadIdx.x; i < cols; i += blockDim.x) xs[i] = xs[i] * scale * bf16_to_f32(norm[i]);
        }
    }
    __syncthreads();
    float acc[GEMV_ROWS_PER_WARP];
    for (int r = 0; r < GEMV_ROWS_PER_WARP; r++) acc[r] = 0.f;
    const bf16_t* wr[GEMV_ROWS_PER_WARP];
    for (int r = 0; r < GEMV_ROWS_PER_WARP; r++) wr[r] = W + (size_t)min(row0 + r, rows - 1) * cols;
    int c = lane * 8;
    for (; c + (GEMV_UNROLL - 1) * 256 < cols; c += GEMV_UNROLL * 256) {
        uint4 w[GEMV_ROWS_PER_WARP][GEMV_UNROLL];
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++)
#pragma unroll
            for (int r = 0; r < GEMV_ROWS_PER_WARP; r++) w[r][u] = ld_stream(wr[r] + c + u * 256);
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++)
#pragma unroll
            for (int r = 0; r < GEMV_ROWS_PER_WARP; r++) acc[r] += dot8(w[r][u], xs + c + u * 256);
    }
    for (; c < cols; c += 256)
#pragma unroll
        for (int r = 0; r < GEMV_ROWS_PER_WARP; r++) acc[r] += dot8(ld_stream(wr[r] + c), xs + c);
    for (int r = 0; r < GEMV_ROWS_PER_WARP; r++) {
        float s = warp_sum(acc[r]);
        if (lane == 0 && row0 + r < rows) y[row0 + r] = accumulate ? y[row0 + r] + s : s;
    }
}

// ---------------------------------------------------------------------------------------------
// bl_mv: the mat-vec every projection of the graph paths runs, y = W · in with W [rows, cols]
// bf16 row-major, its input formed and its output finished in the same kernel.
//
// A CTA of MV_WARPS warps takes tasks of RB = R * MV_WARPS / ksplit consecutive (logical)
// rows: warp w takes R rows and the w % ksplit-th of ksplit column slices (split-K inside the
// CTA, so that a 2048-row projection still spreads over every SM; the slices' sums meet in
// shared memory in a fixed order, so results do not depend on timing). Each lane issues R * U
// 16-byte loads before the first FMA that uses them, and the grid (a few CTAs per SM, sized by
// the host from the SM count) loops over the tasks: the next task's first loads are issued
// before the current task's reduction and epilogue.
//
// Under PDL the first task's loads are issued before griddepcontrol.wait: the weights do not
// depend on the previous kernel, so they stream while it finishes. Only then the input (the
// previous kernel's output) is read and staged in shared memory (cols floats, dynamic).
#define MV_WARPS 8
#define MV_THREADS (MV_WARPS * 32)

// How the input vector is formed.
#define MV_IN_PLAIN 0  // x
#define MV_IN_NORM 1   // x / rms(x) * norm (the layer's RMS norm, each CTA computing rms(x))

// What happens to each row's sum s. The pair modes see logical rows in pairs (2p, 2p + 1),
// mapped to the two physical rows the epilogue combines; RB is even for them (host-checked).
#define MV_OUT_STORE 0    // y[r] = s
#define MV_OUT_ADD 1      // y[r] += s (the residual add: one writer per row)
#define MV_OUT_ROPE_KV 2  // pairs (i, i + head_dim/2) of a head: q rotated into y (f32), k rotated
                          // and v into the caches at meta->pos (bf16)
#define MV_OUT_SILU 3     // pairs (gate p, up p) of W = [gate; up]: y[p] = silu(gate) * up
#define MV_OUT_ARGMAX 4   // y[r] = s, and the greedy token (argmax, lowest index on ties) into
                          // meta / history via per-CTA partials and the last CTA to finish
#define MV_OUT_ADD_COPY 5 // y[r] += s and y2[r] = the new y[r] (the residual bl_mlp adds into)

struct MvParams {
    const bf16_t* w;
    const float* x;
    float* y;
    const bf16_t* norm;
    bf16_t* k_cache;       // ROPE_KV: this layer's K and V caches, position-major
    bf16_t* v_cache;
    TokenMeta* meta;       // ROPE_KV (pos), ARGMAX (advanced)
    const float* inv_freq; // ROPE_KV
    u32* part;             // ARGMAX: 2 words (value bits, index) per CTA
    u32* done;             // ARGMAX: arrival counter, 0 between launches
    u32* history;          // ARGMAX: history[pos + 1] = the token
    float* y2;             // ADD_COPY: each row's new value is also stored here
    float* y3;             // when set, x (the residual) is copied to y2 and y3, a slice a CTA: the
                           // buffers bl_attn_o and bl_mlp add into
    int rows, cols, ksplit, in_mode, out_mode, n_heads, n_kv, head_dim;
    float eps;
    int evict_first;       // weights marked first to leave L2 (see mv_ld)
    int prefetch;          // bytes of its weights a CTA prefetches to L2 before the wait
};

// A weight load: streamed past L1 and, with `policy` from createpolicy (evict_first set), marked
// first to leave L2. A token streams its weights through the 50 MB L2 fifty times over; with the
// default policy they evict what is read again soon: the activations, the K/V rows, the norm
// weights and the kernels' own code.
__device__ __forceinline__ uint4 mv_ld(const void* p, u64 policy, bool evict_first) {
    if (!evict_first) return ld_stream(p);
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p), "l"(policy));
    return r;
}

// The physical row of logical row lr.
__device__ __forceinline__ int mv_row(const MvParams& p, int lr) {
    if (p.out_mode == MV_OUT_ROPE_KV) {
        const int pr = lr >> 1, half = p.head_dim >> 1, head = pr / half;
        return head * p.head_dim + (pr - head * half) + (lr & 1) * half;
    }
    if (p.out_mode == MV_OUT_SILU) return (lr >> 1) + (lr & 1) * (p.rows >> 1);
    return lr;
}

// One batch: chunk c = c_lane + 32 * u (8 columns each) of the warp's R rows of task `task`,
// zero where outside the slice or the matrix.
template <int R, int U>
__device__ __forceinline__ void mv_load(uint4 (&w)[R][U], const MvParams& p, int first_row, int c_lane, int c1,
                                        u64 policy) {
#pragma unroll
    for (int r = 0; r < R; r++) {
        const int lr = first_row + r;
        const bf16_t* row = p.w + (size_t)mv_row(p, min(lr, p.rows - 1)) * p.cols;
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int c = c_lane + 32 * u;
            w[r][u] = (lr < p.rows && c < c1) ? mv_ld(row + 8 * c, policy, p.evict_first != 0) : make_uint4(0u, 0u, 0u, 0u);
        }
    }
}

template <int R, int U>
__device__ __forceinline__ void mv_fma(const uint4 (&w)[R][U], const float4* xs4, int c_lane, int c1, float (&acc)[R]) {
#pragma unroll
    for (int u = 0; u < U; u++) {
        const int c = c_lane + 32 * u;
        if (c < c1) {
            const float4 a = xs4[2 * c], b = xs4[2 * c + 1];
#pragma unroll
            for (int r = 0; r < R; r++) {
                float f[8];
                widen8(w[r][u], f);
                float s = acc[r];
                s = fmaf(f[0], a.x, s); s = fmaf(f[1], a.y, s); s = fmaf(f[2], a.z, s); s = fmaf(f[3], a.w, s);
                s = fmaf(f[4], b.x, s); s = fmaf(f[5], b.y, s); s = fmaf(f[6], b.z, s); s = fmaf(f[7], b.w, s);
                acc[r] = s;
            }
        }
    }
}

// The sum of logical row t of the task (0 <= t < RB) from the warps' partial sums.
__device__ __forceinline__ float mv_total(const float* red, int t, int R, int ksplit) {
    const int rw = t / R, r = t - rw * R;
    float s = 0.f;
    for (int k = 0; k < ksplit; k++) s += red[(rw * ksplit + k) * R + r];
    return s;
}

template <int R, int U, bool DB, int SB, bool PF>
__device__ __forceinline__ void mv_body(const MvParams& p) {
    extern __shared__ float4 mv_xs4[];
    __shared__ float red[2][MV_WARPS * R];
    __shared__ float partial[32];
    __shared__ u32 sidx[MV_WARPS];
    __shared__ int is_last;
    pdl_launch_next();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int ks = p.ksplit, kid = warp % ks, rw = warp / ks, RB = R * (MV_WARPS / ks);
    const int C = p.cols >> 3, c0 = kid * C / ks, c1 = (kid + 1) * C / ks;
    const int ntasks = (p.rows + RB - 1) / RB;
    u64 policy = 0;
    if (p.evict_first) asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    uint4 w[R][U];
    int task = blockIdx.x;
    mv_load<R, U>(w, p, task * RB + rw * R, c0 + lane, c1, policy);

    // How the input is staged after the wait (SB, per kernel):
    // - SB > 0 (the double-buffered kernels, picked for products whose tasks take several
    //   batches: 8 with one CTA an SM, 4 with two, where 8 spills): SB float4s a thread at a
    //   time, every load of a batch issued before the first is used, so one L2 round trip per
    //   batch is on the critical path (a plain loop compiles to a load and its store in turn:
    //   8 round trips for 8192 columns). The norm's weights do not depend on the previous
    //   kernel: read before the wait and kept in registers with the batch when it is the only
    //   one.
    // - SB = 0 (the others, which the small shapes pick): a plain loop. Those kernels are a few
    //   microseconds of latency, where every extra instruction-cache line shows: the batched
    //   staging in every kernel made SmolLM2's graph + PDL step 7% slower (BENCHMARKS.md,
    //   2026-11-26).
    const int n4 = p.cols >> 2;
    const bool norm = p.in_mode == MV_IN_NORM, one_batch = n4 <= SB * MV_THREADS;
    uint2 g[SB > 0 ? SB : 1];
    if constexpr (SB > 0) {
        if (norm && one_batch) {
#pragma unroll
            for (int k = 0; k < SB; k++) {
                const int i = k * MV_THREADS + threadIdx.x;
                g[k] = i < n4 ? *(const uint2*)(p.norm + 4 * i) : make_uint2(0u, 0u);
            }
        }
    }

    // PF (the kernels named ...p): the CTA's first p.prefetch bytes of weight rows (the first
    // batch among them), in the order its tasks take them, prefetched to L2 before the wait
    // (the host asks for it on the larger projections under PDL): HBM streams them while the
    // previous kernel drains. Kernels of their own, so that the others carry none of its code:
    // the same loop in every kernel, never taken, made SmolLM2's graph + PDL step 3.5% slower.
    if (PF && p.prefetch > 0) {
        const int lines_per_row = (p.cols * 2 + 127) >> 7;
        for (int i = threadIdx.x; i < p.prefetch >> 7; i += blockDim.x) {
            const int k = i / lines_per_row, line = i - k * lines_per_row, tk = k / RB;
            const int t = blockIdx.x + tk * (int)gridDim.x, lr = t * RB + (k - tk * RB);
            if (t >= ntasks || lr >= p.rows) break;
            asm volatile("prefetch.global.L2 [%0];" ::"l"(p.w + (size_t)mv_row(p, lr) * p.cols + line * 64));
        }
    }
    pdl_wait();
    const float4* x4 = (const float4*)p.x;
    float ss = 0.f;
    if constexpr (SB == 0) {
        // blockDim.x, not MV_THREADS: a constant stride would have the loop unrolled (code).
        for (int i = threadIdx.x; i < n4; i += blockDim.x) {
            const float4 v = x4[i];
            mv_xs4[i] = v;
            ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
    } else {
        float4 v[SB];
        for (int base = 0; base < n4; base += SB * MV_THREADS) {
#pragma unroll
            for (int k = 0; k < SB; k++) {
                const int i = base + k * MV_THREADS + threadIdx.x;
                if (i < n4) v[k] = x4[i];
            }
#pragma unroll
            for (int k = 0; k < SB; k++) {
                const int i = base + k * MV_THREADS + threadIdx.x;
                if (i < n4) {
                    if (!(norm && one_batch)) mv_xs4[i] = v[k];
                    ss += v[k].x * v[k].x + v[k].y * v[k].y + v[k].z * v[k].z + v[k].w * v[k].w;
                }
            }
        }
        if (norm && one_batch) {
            const float scale = block_inv_rms(ss, p.cols, p.eps, partial);
#pragma unroll
            for (int k = 0; k < SB; k++) {
                const int i = k * MV_THREADS + threadIdx.x;
                if (i < n4) mv_xs4[i] = norm4(v[k], g[k], scale);
            }
        }
    }
    if (norm && !(SB > 0 && one_batch)) {
        const float scale = block_inv_rms(ss, p.cols, p.eps, partial);
        for (int i = threadIdx.x; i < n4; i += blockDim.x)
            mv_xs4[i] = norm4(mv_xs4[i], *(const uint2*)(p.norm + 4 * i), scale);
    }
    if (p.y3 != nullptr) {
        for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += gridDim.x * blockDim.x) {
            const float4 v = x4[i];
            ((float4*)p.y2)[i] = v;
            ((float4*)p.y3)[i] = v;
        }
    }
    u32 pos = 0;
    if (p.out_mode == MV_OUT_ROPE_KV) pos = p.meta->pos;
    __syncthreads();

    float best_v = NEG_INF;
    u32 best_i = 0xffffffffu;
    int buf = 0;
    uint4 wn[R][U];  // DB: the batch after the one in w
    for (; task < ntasks; task += gridDim.x, buf ^= 1) {
        float acc[R];
#pragma unroll
        for (int r = 0; r < R; r++) acc[r] = 0.f;
        const int first_row = task * RB + rw * R;
        const bool more_tasks = task + (int)gridDim.x < ntasks;
        for (int j = c0 + lane;; j += 32 * U) {
            const bool last = j - lane + 32 * U >= c1;
            if (DB) {
                // Double buffering: the next batch (of this task or the next) goes out before
                // this one's FMAs.
                if (!last) mv_load<R, U>(wn, p, first_row, j + 32 * U, c1, policy);
                else if (more_tasks) mv_load<R, U>(wn, p, first_row + gridDim.x * RB, c0 + lane, c1, policy);
            }
            mv_fma<R, U>(w, mv_xs4, j, c1, acc);
            if (DB) {
#pragma unroll
                for (int r = 0; r < R; r++)
#pragma unroll
                    for (int u = 0; u < U; u++) w[r][u] = wn[r][u];
            } else if (!last) {
                mv_load<R, U>(w, p, first_row, j + 32 * U, c1, policy);
            }
            if (last) break;
        }
        // The next task's first batch streams during this one's reduction and epilogue.
        if (!DB && more_tasks) mv_load<R, U>(w, p, first_row + gridDim.x * RB, c0 + lane, c1, policy);
#pragma unroll
        for (int r = 0; r < R; r++) {
            const float s = warp_sum(acc[r]);
            if (lane == 0) red[buf][warp * R + r] = s;
        }
        __syncthreads();
        const int t = threadIdx.x, base = task * RB;
        if (p.out_mode == MV_OUT_STORE || p.out_mode == MV_OUT_ADD || p.out_mode == MV_OUT_ARGMAX ||
            p.out_mode == MV_OUT_ADD_COPY) {
            if (t < RB && base + t < p.rows) {
                const float s = mv_total(red[buf], t, R, ks);
                const int r = base + t;
                if (p.out_mode == MV_OUT_ADD) {
                    p.y[r] += s;
                } else if (p.out_mode == MV_OUT_ADD_COPY) {
                    const float v = p.y[r] + s;
                    p.y[r] = v;
                    p.y2[r] = v;
                } else {
                    p.y[r] = s;
                }
                if (p.out_mode == MV_OUT_ARGMAX) argmax_merge(best_v, best_i, s, (u32)r);
            }
        } else if (2 * t < RB && base + 2 * t < p.rows) {
            const float a = mv_total(red[buf], 2 * t, R, ks), b = mv_total(red[buf], 2 * t + 1, R, ks);
            const int pr = (base >> 1) + t;
            if (p.out_mode == MV_OUT_SILU) {
                p.y[pr] = silu(a) * b;
            } else {  // MV_OUT_ROPE_KV
                const int half = p.head_dim >> 1, head = pr / half, i = pr - head * half;
                const size_t slot = (size_t)pos * p.n_kv * p.head_dim;
                if (head < p.n_heads + p.n_kv) {
                    float sn, cs;
                    rope_sincos(pos, p.inv_freq[i], &sn, &cs);
                    const float ra = a * cs - b * sn, rb = b * cs + a * sn;
                    if (head < p.n_heads) {
                        p.y[head * p.head_dim + i] = ra;
                        p.y[head * p.head_dim + i + half] = rb;
                    } else {
                        bf16_t* k = p.k_cache + slot + (head - p.n_heads) * p.head_dim;
                        k[i] = f32_to_bf16(ra);
                        k[i + half] = f32_to_bf16(rb);
                    }
                } else {
                    bf16_t* v = p.v_cache + slot + (head - p.n_heads - p.n_kv) * p.head_dim;
                    v[i] = f32_to_bf16(a);
                    v[i + half] = f32_to_bf16(b);
                }
            }
        }
    }
    if (p.out_mode != MV_OUT_ARGMAX) return;

    // The CTA's best into part[], then the last CTA to arrive merges every CTA's (the merge
    // is order-independent: larger value, then lower index).
    warp_argmax(best_v, best_i);
    if (lane == 0) { partial[warp] = best_v; sidx[warp] = best_i; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int k = 1; k < MV_WARPS; k++) argmax_merge(best_v, best_i, partial[k], sidx[k]);
        p.part[2 * blockIdx.x] = __float_as_uint(best_v);
        p.part[2 * blockIdx.x + 1] = best_i;
        __threadfence();
        is_last = atomicAdd(p.done, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    best_v = NEG_INF;
    best_i = 0xffffffffu;
    for (int b = threadIdx.x; b < (int)gridDim.x; b += blockDim.x)
        argmax_merge(best_v, best_i, __uint_as_float(__ldcg(p.part + 2 * b)), __ldcg(p.part + 2 * b + 1));
    warp_argmax(best_v, best_i);
    __syncthreads();  // partial / sidx are reused
    if (lane == 0) { partial[warp] = best_v; sidx[warp] = best_i; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int k = 1; k < MV_WARPS; k++) argmax_merge(best_v, best_i, partial[k], sidx[k]);
        TokenMeta* m = p.meta;
        p.history[m->pos + 1] = best_i;
        m->next = best_i;
        m->token = best_i;
        m->pos += 1;
        *p.done = 0;
    }
}

// The variants the host picks from (MV_VARIANTS in src/gpu/baseline.rs): R rows per warp, U
// 16-byte loads per row per lane in one batch, D double-buffered (R * U loads in flight while
// the previous batch's FMAs run; one CTA of those per SM for the larger ones).
#define MV_KERNEL(NAME, R, U, DB, MIN_CTAS, PF)                                                           \
    extern "C" __global__ void __launch_bounds__(MV_THREADS, MIN_CTAS) NAME(const __grid_constant__ MvParams p) { \
        mv_body<R, U, DB, !(DB) ? 0 : (MIN_CTAS) == 1 ? 8 : 4, PF>(p);                                    \
    }
MV_KERNEL(bl_mv_r1u8, 1, 8, false, 2, false)
MV_KERNEL(bl_mv_r1u16, 1, 16, false, 2, false)
MV_KERNEL(bl_mv_r2u4, 2, 4, false, 2, false)
MV_KERNEL(bl_mv_r2u8, 2, 8, false, 2, false)
MV_KERNEL(bl_mv_r4u4, 4, 4, false, 2, false)
MV_KERNEL(bl_mv_r1u8d, 1, 8, true, 2, false)
MV_KERNEL(bl_mv_r2u4d, 2, 4, true, 2, false)
MV_KERNEL(bl_mv_r2u8d, 2, 8, true, 1, false)
// The double-buffered ones (which the larger projections take) with the weights' prefetch.
MV_KERNEL(bl_mv_r1u8dp, 1, 8, true, 2, true)
MV_KERNEL(bl_mv_r2u4dp, 2, 4, true, 2, true)
MV_KERNEL(bl_mv_r2u8dp, 2, 8, true, 1, true)

// RoPE (rotate_half pairs i, i + head_dim/2) on q and k in place, then K and V into the cache
// at meta->pos. One block per head of the q|k|v concatenation, head_dim/2 threads.
extern "C" __global__ void bl_rope_kv(float* qkv, bf16_t* k_cache, bf16_t* v_cache, const TokenMeta* meta,
                                      const float* inv_freq, int n_heads, int n_kv, int head_dim) {
    pdl_launch_next();
    pdl_wait();
    const int h = blockIdx.x, i = threadIdx.x, half = head_dim >> 1;
    const u32 pos = meta->pos;
    float* v = qkv + h * head_dim;
    const size_t slot = (size_t)pos * n_kv * head_dim;
    if (h < n_heads + n_kv) {
        float s, c;
        rope_sincos(pos, inv_freq[i], &s, &c);
        float a = v[i], b = v[i + half];
        float ra = a * c - b * s, rb = b * c + a * s;
        if (h < n_heads) {
            v[i] = ra; v[i + half] = rb;
        } else {
            bf16_t* k = k_cache + slot + (h - n_heads) * head_dim;
            k[i] = f32_to_bf16(ra); k[i + half] = f32_to_bf16(rb);
        }
    } else {
        bf16_t* dst = v_cache + slot + (h - n_heads - n_kv) * head_dim;
        dst[i] = f32_to_bf16(v[i]); dst[i + half] = f32_to_bf16(v[i + half]);
    }
}

// K and V rows [begin, end) of one KV head into L2 (128-byte lines), for an attention kernel
// to issue before griddepcontrol.wait: rows before the current position do not depend on the
// QKV kernel it waits for, and the L2 is where that kernel's new row lands, so nothing stale
// can be read (the attention reads K and V through L2, ld.global.cg).
// Short caches only (bl_attention): the split-KV parts of a long one run faster without it
// (BENCHMARKS.md, 2026-11-25: their prefetch competes with the QKV product's weight stream).
__device__ __forceinline__ void prefetch_kv(const bf16_t* k_head, const bf16_t* v_head, int kv_stride, int head_dim,
                                            int begin, int end) {
    const int lines = head_dim >> 6;  // 128-byte lines per row (64 bf16 each)
    for (int i = begin * lines + threadIdx.x; i < end * lines; i += blockDim.x) {
        const int p = i / lines, l = i - p * lines;
        // Normal L2 priority (common.cuh's prefetch_l2 marks lines evict_last, which would pin
        // every layer's K/V).
        asm volatile("prefetch.global.L2 [%0];" ::"l"(k_head + (size_t)p * kv_stride + l * 64));
        asm volatile("prefetch.global.L2 [%0];" ::"l"(v_head + (size_t)p * kv_stride + l * 64));
    }
}

// bl_attention_preload: bl_attention with each warp's first block of earlier positions loaded
// into registers before griddepcontrol.wait: after the wait only q and the new row remain, one
// L2 round trip instead of two. The host runs it at head_dim 128, where it measured faster; at
// head_dim 64 the plain kernel did (BENCHMARKS.md, 2026-11-27). Rows below the position read
// before the wait are final then: a graph path replays one step per graph launch, launches in a stream run in
// order, and only the step's QKV kernel (which this one waits for) writes a row, the one at
// meta->pos; rows from that position on are loaded after the wait, whatever it read.
template <int D>
__device__ __forceinline__ void attention_preloaded(const float* q, const bf16_t* k_head, const bf16_t* v_head,
                                                    float* out, const TokenMeta* meta, int head_dim, int kv_stride,
                                                    float* st) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5, base = warp * 32;
    const int pre = meta->pos;
    KvBlock<D> first;
    load_kv_block<D>(first, k_head, v_head, kv_stride, base, 0, pre);
    prefetch_kv(k_head, v_head, kv_stride, head_dim, nwarps * 32, pre);
    pdl_wait();
    const int len = meta->pos + 1;
    float* qs = st + nwarps * (2 + head_dim);
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) qs[i] = q[i];
    load_kv_block<D>(first, k_head, v_head, kv_stride, base, pre, len);
    __syncthreads();
    float acc[D];
    for (int j = 0; j < D; j++) acc[j] = 0.f;
    float m = NEG_INF, l = 0.f;
    const float scale = rsqrtf((float)head_dim);
    if (base < len) attend_kv_block<D>(first, qs, scale, base, len, m, l, acc);
    attend_warp<D>(qs, k_head, v_head, kv_stride, scale, 0, len, warp + nwarps, nwarps, m, l, acc);
    float* mine = st + warp * (2 + head_dim);
    if (lane == 0) { mine[0] = m; mine[1] = l; }
    for (int j = 0; j < D; j++) mine[2 + lane * D + j] = acc[j];
    __syncthreads();
    merge_warp_states(st, nwarps, head_dim, out);
}

// bl_attention's launch and arguments, by bl_attention_preload.
extern "C" __global__ void bl_attention_preload(const float* q, const bf16_t* k_cache, const bf16_t* v_cache,
                                                float* out, const TokenMeta* meta, int n_heads, int n_kv,
                                                int head_dim) {
    extern __shared__ float st[];
    pdl_launch_next();
    const int h = blockIdx.x, kvh = h / (n_heads / n_kv), kv_stride = n_kv * head_dim;
    const bf16_t *kh = k_cache + kvh * head_dim, *vh = v_cache + kvh * head_dim;
    if (head_dim == 64) attention_preloaded<2>(q + h * head_dim, kh, vh, out + h * head_dim, meta, 64, kv_stride, st);
    else attention_preloaded<4>(q + h * head_dim, kh, vh, out + h * head_dim, meta, 128, kv_stride, st);
}

// One block per query head over positions [0, pos]; warps take blocks of 32 positions in
// turn, then merge. Shared memory: the query, then per warp (m, l, acc[head_dim]).
extern "C" __global__ void bl_attention(const float* q, const bf16_t* k_cache, const bf16_t* v_cache, float* out,
                                        const TokenMeta* meta, int n_heads, int n_kv, int head_dim) {
    extern __shared__ float st[];
    pdl_launch_next();
    const int h = blockIdx.x, kvh = h / (n_heads / n_kv), lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nwarps = blockDim.x >> 5, D = head_dim >> 5, kv_stride = n_kv * head_dim;
    // Before the wait, the position only sizes the prefetch: with PDL the previous step's argmax
    // may still be running (this grid can start once the QKV grid has started), so it may be a
    // step behind. The length attended over is read after the wait, beside q.
    prefetch_kv(k_cache + kvh * head_dim, v_cache + kvh * head_dim, kv_stride, head_dim, 0,
                meta->pos);
    pdl_wait();
    const int len = meta->pos + 1;
    float* qs = st + nwarps * (2 + head_dim);
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) qs[i] = q[h * head_dim + i];
    __syncthreads();
    float acc[ATT_MAX_D];
    for (int j = 0; j < D; j++) acc[j] = 0.f;
    float m = NEG_INF, l = 0.f;
    if (head_dim == 64)
        attend_warp<2>(qs, k_cache + kvh * head_dim, v_cache + kvh * head_dim, kv_stride, rsqrtf(64.f), 0, len, warp,
                       nwarps, m, l, acc);
    else
        attend_warp<4>(qs, k_cache + kvh * head_dim, v_cache + kvh * head_dim, kv_stride, rsqrtf(128.f), 0, len, warp,
                       nwarps, m, l, acc);
    float* mine = st + warp * (2 + head_dim);
    if (lane == 0) { mine[0] = m; mine[1] = l; }
    for (int j = 0; j < D; j++) mine[2 + lane * D + j] = acc[j];
    __syncthreads();
    merge_warp_states(st, nwarps, head_dim, out + h * head_dim);
}

// Split-KV attention by KV head (gqa_part in attention.cuh): gridDim.x = n_kv * parts blocks of
// GQ_THREADS, gqa_smem(head_dim, n_heads / n_kv) bytes of dynamic shared memory (host side);
// done holds n_kv arrival counters, 0 between launches.
extern "C" __global__ void __launch_bounds__(GQ_THREADS)
    bl_attention_kv(const float* q, const bf16_t* k_cache, const bf16_t* v_cache, float* part_st, u32* done,
                    float* out, const TokenMeta* meta, int n_heads, int n_kv, int head_dim, int parts) {
    pdl_launch_next();
    // After the wait: with PDL the previous step's argmax may still be running before it.
    pdl_wait();
    const int len = meta->pos + 1;
    if (head_dim == 64) gqa_part<64>(q, k_cache, v_cache, part_st, done, out, len, n_heads, n_kv, parts);
    else gqa_part<128>(q, k_cache, v_cache, part_st, done, out, len, n_heads, n_kv, parts);
}

// One block: greedy next token into meta->next and meta->token, position advanced, so the
// next replay of the graph decodes it without the host.
extern "C" __global__ void bl_argmax(const float* logits, int n, TokenMeta* meta, u32* history) {
    __shared__ float sv[32];
    __shared__ u32 si[32];
    pdl_launch_next();
    pdl_wait();
    float v = NEG_INF;
    u32 idx = 0xffffffffu;
    for (int i = threadIdx.x; i < n; i += blockDim.x) argmax_merge(v, idx, logits[i], (u32)i);
    warp_argmax(v, idx);
    if ((threadIdx.x & 31) == 0) { sv[threadIdx.x >> 5] = v; si[threadIdx.x >> 5] = idx; }
    __syncthreads();
    if (threadIdx.x < 32) {
        int nw = blockDim.x >> 5;
        v = threadIdx.x < nw ? sv[threadIdx.x] : NEG_INF;
        idx = threadIdx.x < nw ? si[threadIdx.x] : 0xffffffffu;
        warp_argmax(v, idx);
        if (threadIdx.x == 0) {
            history[meta->pos + 1] = idx;
            meta->next = idx; meta->token = idx; meta->pos += 1;
        }
    }
}

// Streaming-read probe for `megainfer bench`: every 16-byte word read once, 8 loads in flight
// per thread; the xor keeps the loads alive.
extern "C" __global__ void bw_read(const uint4* p, unsigned long long n, u32* sink) {
    u32 acc = 0;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 7 * stride < n; i += 8 * stride) {
        uint4 v[8];
#pragma unroll
        for (int u = 0; u < 8; u++) v[u] = ld_stream(p + i + u * stride);
#pragma unroll
        for (int u = 0; u < 8; u++) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    for (; i < n; i += stride) { uint4 v = ld_stream(p + i); acc ^= v.x ^ v.y ^ v.z ^ v.w; }
    if (acc == 0x9e3779b9u) sink[0] = acc;
}

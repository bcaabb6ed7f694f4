// Paged shared memory: a ring of p.pages pages of PAGE_BYTES (both from the host), each with a
// "full" mbarrier (the loader warp's bulk copies completed) and an "empty" mbarrier (the
// consumer warp released it).
// The loader walks the instruction stream ahead of the consumers and never waits for data:
// weights do not depend on activations, so the next instructions' weights stream in while the
// current instruction waits, computes and stores.

__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(u64* bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}

__device__ __forceinline__ void mbar_fence_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

__device__ __forceinline__ void mbar_arrive(u64* bar) {
    asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.shared::cta.b64 st, [%0];\n}" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void mbar_arrive_n(u64* bar, u32 n) {
    asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.shared::cta.b64 st, [%0], %1;\n}" ::"r"(smem_addr(bar)), "r"(n)
                 : "memory");
}

// A page goes back to the loader when its two consumer warps are done with it. Normally one
// lane of each arrives on its "empty" barrier after a __syncwarp (MK_EMPTY_ARRIVALS = 2).
// MK_LANE_ARRIVALS=1, for compute-sanitizer's racecheck only, has every thread that read the
// page arrive for its own reads: racecheck does not carry a warp or named barrier's ordering
// over to the loader's copy into the page, and reports each earlier read of it as a hazard. A
// page is read by its warp pair (a tile: 64 lanes, 4 arrivals each) or by every consumer (an
// attention round's pages: 256 threads, one each), so the barrier counts 256.
#if defined(MK_LANE_ARRIVALS) && MK_LANE_ARRIVALS
#define MK_EMPTY_ARRIVALS 256
#else
#define MK_EMPTY_ARRIVALS 2
#endif

// One consumer warp done with the page `empty` guards (every lane calls it).
__device__ __forceinline__ void release_page(u64* empty, int lane) {
#if defined(MK_LANE_ARRIVALS) && MK_LANE_ARRIVALS
    (void)lane;
    mbar_arrive_n(empty, MK_EMPTY_ARRIVALS / 64);
#else
    __syncwarp();
    if (lane == 0) mbar_arrive(empty);
#endif
}

// Both consumer warps done with the page `empty` guards, ordered by a barrier of theirs before
// the one thread that calls this (racecheck's build arrives from every reader instead: see the
// attention rounds).
__device__ __forceinline__ void release_page_for_both(u64* empty) {
    mbar_arrive(empty);
    mbar_arrive(empty);
}

__device__ __forceinline__ void mbar_expect_tx(u64* bar, u32 bytes) {
    asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}"
                 ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ bool mbar_try_wait(u64* bar, u32 parity) {
    u32 ok;
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                 : "=r"(ok) : "r"(smem_addr(bar)), "r"(parity) : "memory");
    return ok != 0;
}

// Whether the phase of `parity` has completed, without waiting (try_wait may suspend the thread
// for a while before it answers).
__device__ __forceinline__ bool mbar_test_wait(u64* bar, u32 parity) {
    u32 ok;
    asm volatile("{\n .reg .pred p;\n mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                 : "=r"(ok) : "r"(smem_addr(bar)), "r"(parity) : "memory");
    return ok != 0;
}

// Streamed data is marked first to go from L2 (MK_EVICT_FIRST, on unless defined 0): a token's
// weights pass through the 50 MB L2 fifty times over, and with the default policy they evicted
// the lines that are read again soon, the kernel's own code above all, which then came from
// HBM at every instruction type (BENCHMARKS.md, design decisions).
#ifndef MK_EVICT_FIRST
#define MK_EVICT_FIRST 1
#endif
__device__ __forceinline__ u64 l2_evict_first() {
    u64 policy = 0;
#if MK_EVICT_FIRST
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
#endif
    return policy;
}

// Bulk copy global -> shared, completion counted in bytes on `bar`. Sizes and addresses are
// multiples of 16 bytes; `policy` comes from l2_evict_first.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, u32 bytes, u64* bar, u64 policy) {
#if MK_EVICT_FIRST
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
                 ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)), "l"(policy) : "memory");
#else
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
#endif
}

// Asks L2 for `bytes` at src (a multiple of 16 bytes at a 16-byte address), copying nothing
// further: the loader's MK_L2_PF_NEXT variant (loader.cuh).
__device__ __forceinline__ void bulk_prefetch_l2(const void* src, u32 bytes) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
}

__device__ __forceinline__ u64 global_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ void named_sync(u32 id, u32 threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// A barrier that also returns whether any participant passed true.
__device__ __forceinline__ bool named_sync_or(u32 id, u32 threads, bool v) {
    u32 r;
    asm volatile("{\n .reg .pred a, b;\n setp.ne.u32 a, %1, 0;\n bar.red.or.pred b, %2, %3, a;\n selp.u32 %0, 1, 0, b;\n}"
                 : "=r"(r) : "r"((u32)v), "r"(id), "r"(threads) : "memory");
    return r != 0;
}

// The megakernel's shared-memory pipeline in miniature, for finding what makes
// compute-sanitizer's racecheck crash on the megakernel (docs/reliability.md):
//   nvcc -arch=sm_90a -o racecheck-repro racecheck-repro.cu
//   compute-sanitizer --tool racecheck ./racecheck-repro MODE ROUNDS BLOCKS FEATURES
// e.g. `bulk 64 132 127` (defaults: plain 64 1 0).
// MODE: plain | ldgsts | bulk | bulk_hint: how warp 0 fills a ring of 4 shared-memory pages
// (plain stores, cp.async, or cp.async.bulk with complete_tx, with or without an L2 hint)
// while 8 consumer warps sum them, the pages handed over by full/empty mbarriers as the
// megakernel's loader does. FEATURES adds what else the megakernel does (bits below). The sum
// is checked exactly. racecheck 2025.3.1 on the H100 completes every mode with every feature
// (BENCHMARKS.md, 2026-11-26).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cuda_runtime.h>

__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(unsigned long long* bar, unsigned bytes) {
    asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}" ::"r"(smem_addr(bar)),
                 "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
    asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.shared::cta.b64 st, [%0];\n}" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(unsigned long long* bar, unsigned parity) {
    unsigned ok;
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                 : "=r"(ok) : "r"(smem_addr(bar)), "r"(parity) : "memory");
    return ok != 0;
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, unsigned long long* bar, bool hint) {
    if (hint) {
        unsigned long long pol;
        asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
                     ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)), "l"(pol) : "memory");
    } else {
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
    }
}

#define PAGE 4096  // bytes a page
#define PAGES 4

// Extra features (bit mask, argv[4]) the megakernel also has.
#define F_DYN 1       // pages in ~200 KB of dynamic shared memory
#define F_NAMED 2     // the consumers meet at a named barrier (bar.sync 1, consumers) each round
#define F_FLAGS 4     // block b waits (ld.acquire.gpu) for block b-1's flag, then sets its own
#define F_PDL 8       // griddepcontrol.launch_dependents / wait
#define F_TIMER 16    // %globaltimer read in every wait loop
#define F_NANOSLEEP 32  // a nanosleep in the flag wait
#define F_MAPPED 64     // the flags in mapped, pinned host memory (the megakernel's token feed)

__device__ __forceinline__ unsigned long long gtimer() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// One block: warp 0 loads pages, the other warps sum them. `rounds` pages in all.
__global__ void k(const float* in, unsigned long long* out, int mode, int rounds, int feat, unsigned long long* flags) {
    extern __shared__ __align__(128) float dyn[];
    __shared__ __align__(128) float spage[(PAGES * PAGE / 4)];
    __shared__ __align__(8) unsigned long long full[PAGES], empty[PAGES];
    float (*page)[PAGE / 4] = (float (*)[PAGE / 4])((feat & F_DYN) ? dyn + 1024 : spage);
    if (feat & F_PDL) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    if (feat & F_PDL) asm volatile("griddepcontrol.wait;" ::: "memory");
    if ((feat & F_FLAGS) && threadIdx.x == 0 && blockIdx.x > 0) {
        unsigned long long v = 0;
        while (v == 0) {
            asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(flags + blockIdx.x - 1) : "memory");
            if (feat & F_NANOSLEEP) __nanosleep(100);
            if (feat & F_TIMER) (void)gtimer();
        }
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, consumers = blockDim.x - 32;
    if (threadIdx.x == 0)
        for (int p = 0; p < PAGES; p++) { mbar_init(&full[p], 1); mbar_init(&empty[p], consumers); }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    __syncthreads();
    float acc = 0.f;
    if (warp == 0) {
        for (int r = 0; r < rounds; r++) {
            const int p = r % PAGES;
            if (r >= PAGES)
                while (!mbar_try_wait(&empty[p], ((r / PAGES) - 1) & 1)) {
                    if (feat & F_TIMER) (void)gtimer();
                }
            const float* src = in + (size_t)r * (PAGE / 4);
            if (mode == 1) {  // LDGSTS, every lane 16 bytes at a time, then arrive
                for (int i = lane * 4; i < PAGE / 4; i += 32 * 4) {
                    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(&page[p][i])), "l"(src + i), "r"(16) : "memory");
                }
                asm volatile("cp.async.commit_group;" ::: "memory");
                asm volatile("cp.async.wait_group 0;" ::: "memory");
                __syncwarp();
                if (lane == 0) mbar_arrive(&full[p]);
            } else if (mode == 2 || mode == 3) {  // bulk copy, complete_tx
                if (lane == 0) { mbar_expect_tx(&full[p], PAGE); bulk_copy(page[p], src, PAGE, &full[p], mode == 3); }
            } else {  // plain loads and stores
                for (int i = lane; i < PAGE / 4; i += 32) page[p][i] = src[i];
                __syncwarp();
                if (lane == 0) mbar_arrive(&full[p]);
            }
        }
    } else {
        for (int r = 0; r < rounds; r++) {
            const int p = r % PAGES;
            while (!mbar_try_wait(&full[p], (r / PAGES) & 1)) {
                if (feat & F_TIMER) (void)gtimer();
            }
            for (int i = threadIdx.x - 32; i < PAGE / 4; i += consumers) acc += page[p][i];
            if (feat & F_NAMED) asm volatile("bar.sync 1, %0;" ::"r"(consumers) : "memory");
            mbar_arrive(&empty[p]);
        }
    }
    atomicAdd(out, (unsigned long long)acc);  // acc: a sum of small integers, exact
    __syncthreads();
    if ((feat & F_FLAGS) && threadIdx.x == 0)
        asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(flags + blockIdx.x), "l"(1ull) : "memory");
}

int main(int argc, char** argv) {
    const char* m = argc > 1 ? argv[1] : "plain";
    int mode = !strcmp(m, "ldgsts") ? 1 : !strcmp(m, "bulk") ? 2 : !strcmp(m, "bulk_hint") ? 3 : 0;
    int rounds = argc > 2 ? atoi(argv[2]) : 64, blocks = argc > 3 ? atoi(argv[3]) : 1;
    int feat = argc > 4 ? atoi(argv[4]) : 0;
    unsigned long long* flags;
    if (feat & F_MAPPED) {
        unsigned long long* hflags;
        cudaHostAlloc(&hflags, 8 * blocks, cudaHostAllocMapped);
        memset(hflags, 0, 8 * blocks);
        cudaHostGetDevicePointer(&flags, hflags, 0);
    } else {
        cudaMalloc(&flags, 8 * blocks);
        cudaMemset(flags, 0, 8 * blocks);
    }
    int dyn = (feat & F_DYN) ? 200 * 1024 : 0;
    if (dyn) cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, dyn);
    size_t n = (size_t)rounds * PAGE / 4;
    float* in;
    unsigned long long* out;
    cudaMalloc(&in, n * 4);
    cudaMalloc(&out, 8);
    float* h = (float*)malloc(n * 4);
    unsigned long long want = 0;
    for (size_t i = 0; i < n; i++) { h[i] = (float)(i % 7); want += i % 7; }
    cudaMemcpy(in, h, n * 4, cudaMemcpyHostToDevice);
    cudaMemset(out, 0, 8);
    k<<<blocks, 288, dyn>>>(in, out, mode, rounds, feat, flags);
    cudaError_t e = cudaDeviceSynchronize();
    unsigned long long got = 0;
    cudaMemcpy(&got, out, 8, cudaMemcpyDeviceToHost);
    printf("mode %s rounds %d blocks %d features %d: %s, sum %llu (want %llu)\n", m, rounds, blocks, feat,
           cudaGetErrorString(e), got, want * blocks);
    return e != cudaSuccess || got != want * blocks;
}

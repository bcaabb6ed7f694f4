// What one dependency hop of the megakernel costs on this GPU, with HBM idle and with every
// SM's loader warp streaming weights (as during the megakernel's large stages):
//   ping-pong  SM 0 and SM 1 bump each other's counter (red.release / ld.acquire polling);
//              half a round trip is one hop
//   + stores   the same, SM 0 storing 32 floats per lane before each release
//   L2 load    one ld.acquire.gpu of a word in L2, dependent chain
//   fence      fence.acq_rel.gpu right after a store
// On the GPU machine:
//   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o /tmp/hop scripts/hop-latency.cu && /tmp/hop
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

typedef unsigned int u32;
typedef unsigned long long u64;

#define PAGES 8
#define PAGE 16384
#define ITERS 2000

__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ u64 now_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ u32 ld_acquire(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void red_release(u32* p, u32 v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(u64* bar, u32 parity) {
    u32 ok;
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                 : "=r"(ok) : "r"(smem_addr(bar)), "r"(parity) : "memory");
    return ok != 0;
}

struct Args {
    u32* flags;        // [0], [32]: ping-pong counters; [64]: stop; [96]: L2 word
    float* data;       // stores before a release
    const char* big;   // streamed by the loader warps
    size_t big_bytes;
    int stream;
    u64* out;          // [4] ns totals, then the SM clock in MHz
};

__global__ void probe(Args a) {
    extern __shared__ __align__(128) unsigned char smem[];
    u64* full = (u64*)(smem + PAGES * PAGE);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (threadIdx.x == 0) {
        for (int i = 0; i < PAGES; i++)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&full[i])));
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (warp == 0) {
        if (!a.stream || lane != 0) return;
        size_t off = ((size_t)blockIdx.x * (a.big_bytes / gridDim.x)) & ~(size_t)(PAGE - 1);
        u32 k = 0;
        for (;; k++) {
            const u32 slot = k % PAGES;
            if (k >= PAGES)
                while (!mbar_try_wait(&full[slot], ((k / PAGES) - 1) & 1)) {}
            if (*(volatile u32*)(a.flags + 64)) break;
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(&full[slot])), "r"(PAGE) : "memory");
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                         ::"r"(smem_addr(smem + slot * PAGE)), "l"(a.big + off), "r"(PAGE), "r"(smem_addr(&full[slot])) : "memory");
            off += PAGE;
            if (off + PAGE > a.big_bytes) off = 0;
        }
        // Drain the copies in flight before the CTA may exit.
        for (u32 j = k >= PAGES ? k - PAGES + 1 : 0; j < k; j++)
            while (!mbar_try_wait(&full[j % PAGES], (j / PAGES) & 1)) {}
        return;
    }
    if (warp != 1 || blockIdx.x > 1) return;
    u32* f0 = a.flags;
    u32* f1 = a.flags + 32;
    const bool sm0 = blockIdx.x == 0;
    // Let the streaming reach its steady state.
    const u64 settle = now_ns();
    while (now_ns() - settle < 200000) {}
    for (int test = 0; test < 2; test++) {
        const u64 t0 = now_ns(), c0 = clock64();
        for (u32 i = 1; i <= ITERS; i++) {
            if (sm0) {
                if (test == 1) {
                    for (int j = 0; j < 32; j++) a.data[j * 32 + lane] = (float)(i + j);
                    __syncwarp();
                }
                if (lane == 0) {
                    red_release(f0, 1);
                    while (ld_acquire(f1) < (test * ITERS + i)) {}
                }
            } else if (lane == 0) {
                while (ld_acquire(f0) < (test * ITERS + i)) {}
                red_release(f1, 1);
            }
            __syncwarp();
        }
        if (sm0 && lane == 0) {
            a.out[test] = now_ns() - t0;
            if (test == 0) a.out[4] = (clock64() - c0) * 1000 / a.out[0];
        }
    }
    if (sm0 && lane == 0) {
        u32 v = 0;
        u64 t0 = now_ns();
        for (int i = 0; i < ITERS; i++) v += ld_acquire(a.flags + 96 + (v & 0x10000));
        a.out[2] = now_ns() - t0;
        t0 = now_ns();
        for (int i = 0; i < ITERS; i++) {
            a.data[4096 + (i & 255)] = (float)i + v;
            asm volatile("fence.acq_rel.gpu;" ::: "memory");
        }
        a.out[3] = now_ns() - t0;
        *(volatile u32*)(a.flags + 64) = 1;
    }
}

#define CHECK(x)                                                                            \
    do {                                                                                    \
        cudaError_t e = (x);                                                                \
        if (e != cudaSuccess) { fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e)); exit(1); } \
    } while (0)

int main() {
    int sms;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const size_t big_bytes = (size_t)4 << 30;
    Args a;
    CHECK(cudaMalloc(&a.flags, 4096));
    CHECK(cudaMalloc(&a.data, 1 << 20));
    char* big;
    CHECK(cudaMalloc(&big, big_bytes));
    CHECK(cudaMemset(big, 1, big_bytes));
    a.big = big;
    a.big_bytes = big_bytes;
    u64* out;
    CHECK(cudaMalloc(&out, 5 * sizeof(u64)));
    a.out = out;
    const int smem = PAGES * PAGE + PAGES * 8;
    CHECK(cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    printf("| HBM | hop (ping-pong / 2) ns | hop after 32 stores/lane ns | L2 ld.acquire ns | fence after store ns | SM MHz |\n");
    printf("| --- | ---: | ---: | ---: | ---: | ---: |\n");
    for (int rep = 0; rep < 2; rep++) {
        for (int stream = 0; stream < 2; stream++) {
            CHECK(cudaMemset(a.flags, 0, 4096));
            a.stream = stream;
            probe<<<sms, 64, smem>>>(a);
            CHECK(cudaGetLastError());
            CHECK(cudaDeviceSynchronize());
            u64 h[5];
            CHECK(cudaMemcpy(h, out, sizeof h, cudaMemcpyDeviceToHost));
            printf("| %s | %.0f | %.0f | %.0f | %.0f | %llu |\n", stream ? "streaming" : "idle", h[0] / 2.0 / ITERS,
                   h[1] / 2.0 / ITERS, (double)h[2] / ITERS, (double)h[3] / ITERS, h[4]);
        }
    }
    return 0;
}

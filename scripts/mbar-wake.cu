// How late a thread waiting in mbarrier.try_wait (which may suspend it) wakes after a bulk
// copy completes the barrier's phase, against one polling mbarrier.test_wait (which never
// suspends). The megakernel's page waits use try_wait (runtime.cuh, `page_wait`;
// `-DMK_PAGE_SPIN=1` polls instead): if a suspended waiter wakes late, every wait for a page
// still landing pays it, the loader's bounded wait for a copy `n` tiles back included.
// One CTA per SM: warp 0 issues one copy of TILE bytes (fresh from HBM every time) completing
// an mbarrier; warps 1 and 2 each wait for it, one with try_wait, the other with test_wait
// (the roles swap every repetition, so neither warp's place in the scheduler favours a mode),
// and each reads clock64 as it returns; then all threads meet at a barrier. Printed: the
// copy's latency (issue to the polling waiter's return) and how much later the try_wait waiter
// returned than the polling one (SM cycles; negative: earlier), medians and deciles over every
// SM and repetition; first with nothing else running, then with warp 3 of every CTA streaming
// other copies the whole time (8 tiles in flight into a ring of its own), so that the copies
// are timed with HBM busy, as in a decode step.
// On the GPU machine:
//   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o /tmp/mw scripts/mbar-wake.cu && /tmp/mw
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda_runtime.h>

typedef unsigned int u32;
typedef unsigned long long u64;

#define TILE 16384
#define BG_PAGES 8
#define REPS 64

// The megakernel's own mbarrier and bulk-copy wrappers (plain copies: no L2 cache hint).
#define MK_EVICT_FIRST 0
#include "../megakernel/pipeline.cuh"

// One copy of `bytes` into dst, completing bar's phase.
__device__ __forceinline__ void copy(void* dst, const void* src, u32 bytes, u64* bar) {
    mbar_expect_tx(bar, bytes);
    bulk_load(dst, src, bytes, bar, 0);
}

// out[(blockIdx.x * REPS + r) * 4 + k]: k = 0 the copy's issue and 1 the polling waiter's
// return (%globaltimer, ns); 2 the try_wait waiter's and 3 the polling waiter's return
// (clock64, this SM's cycles). bg: the background stream's region (the loaded run), or null;
// stop: CTAs done, so that the background streams run until every CTA has measured.
__global__ void wake(const unsigned char* src, const unsigned char* bg, size_t bg_bytes, long long* out,
                     volatile u32* stop) {
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned char* page = smem;
    unsigned char* bg_ring = smem + TILE;
    u64* bar = (u64*)(smem + TILE + (bg ? BG_PAGES * TILE : 0));
    u64* bg_bars = bar + 1;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (threadIdx.x == 0) {
        mbar_init(bar, 1);
        for (int i = 0; i < BG_PAGES; i++) mbar_init(&bg_bars[i], 1);
        mbar_fence_init();
    }
    __syncthreads();
    if (warp == 3) {
        // Background: copies through this CTA's share of bg, 8 in flight, until the others stop.
        if (!bg || lane != 0) return;
        const size_t share = bg_bytes / gridDim.x / TILE * TILE;
        const unsigned char* base = bg + blockIdx.x * share;
        u32 t = 0;
        for (;; t++) {
            if (t >= BG_PAGES) {
                const u32 b = t - BG_PAGES;
                while (!mbar_test_wait(&bg_bars[b % BG_PAGES], (b / BG_PAGES) & 1)) {
                }
                if (*stop >= gridDim.x) break;
            }
            copy(bg_ring + (t % BG_PAGES) * TILE, base + ((size_t)t * TILE) % share, TILE, &bg_bars[t % BG_PAGES]);
        }
        // The copies still in flight land before the CTA exits.
        for (u32 b = t - BG_PAGES + 1; b < t; b++)
            while (!mbar_test_wait(&bg_bars[b % BG_PAGES], (b / BG_PAGES) & 1)) {
            }
        return;
    }
    for (int r = 0; r < REPS; r++) {
        long long* o = out + ((size_t)blockIdx.x * REPS + r) * 4;
        const u32 parity = r & 1;
        // Warps 1 and 2 swap roles every repetition.
        const bool tries = (warp == 1) == (r % 2 == 0);
        if (warp == 0 && lane == 0) {
            o[0] = (long long)global_ns();
            copy(page, src + ((size_t)r * gridDim.x + blockIdx.x) * TILE, TILE, bar);
        } else if ((warp == 1 || warp == 2) && lane == 0) {
            if (tries) {
                while (!mbar_try_wait(bar, parity)) {
                }
                o[2] = clock64();
            } else {
                while (!mbar_test_wait(bar, parity)) {
                }
                o[3] = clock64();
                o[1] = (long long)global_ns();
            }
        }
        asm volatile("bar.sync 1, 96;" ::: "memory");
    }
    if (threadIdx.x == 0) atomicAdd((u32*)stop, 1u);
}

static void report(const char* what, const std::vector<long long>& h, int sms) {
    std::vector<double> lat, late;
    for (int i = 0; i < sms * REPS; i++) {
        if (i % REPS < 4) continue;  // the first copies pay for cold TLB entries
        lat.push_back((h[4 * i + 1] - h[4 * i]) / 1e3);
        late.push_back((double)(h[4 * i + 2] - h[4 * i + 3]));
    }
    std::sort(lat.begin(), lat.end());
    std::sort(late.begin(), late.end());
    auto q = [](const std::vector<double>& v, double f) { return v[(size_t)(f * (v.size() - 1))]; };
    printf("%s: copy of %d bytes lands after %.2f µs (deciles %.2f .. %.2f); try_wait returns %+.0f cycles after "
           "test_wait (deciles %+.0f .. %+.0f, max %+.0f)\n",
           what, TILE, q(lat, 0.5), q(lat, 0.1), q(lat, 0.9), q(late, 0.5), q(late, 0.1), q(late, 0.9), late.back());
}

int main() {
    int sms = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    const size_t src_bytes = (size_t)sms * REPS * TILE, bg_bytes = (size_t)4 << 30;
    unsigned char *src, *bg;
    long long* out;
    u32* stop;
    if (cudaMalloc(&src, src_bytes) || cudaMalloc(&bg, bg_bytes) || cudaMalloc(&out, sizeof(long long) * 4 * sms * REPS) ||
        cudaMalloc(&stop, 4))
        return 1;
    cudaMemset(src, 1, src_bytes);
    cudaMemset(bg, 1, bg_bytes);
    const int smem = TILE + BG_PAGES * TILE + (1 + BG_PAGES) * 8;
    cudaFuncSetAttribute(wake, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    std::vector<long long> h(4 * sms * REPS);
    for (int load = 0; load < 2; load++) {
        // A pass over other data first, so src's lines are not in L2.
        cudaMemset(bg, 2, (size_t)1 << 30);
        cudaMemset(stop, 0, 4);
        wake<<<sms, 128, smem>>>(src, load ? bg : nullptr, bg_bytes, out, stop);
        if (cudaDeviceSynchronize() != cudaSuccess) {
            printf("wake: %s\n", cudaGetErrorString(cudaGetLastError()));
            return 1;
        }
        cudaMemcpy(h.data(), out, sizeof(long long) * h.size(), cudaMemcpyDeviceToHost);
        report(load ? "HBM busy (8 other copies in flight an SM)" : "HBM idle", h, sms);
    }
    return 0;
}

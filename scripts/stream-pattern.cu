// How fast every SM can stream weights with the megakernel loader's pattern, with nothing else
// running: one CTA per SM, one thread issuing bulk copies (cp.async.bulk, global -> shared) of
// `tile` bytes into a ring of `pages` 16 KB-or-larger slots, at most `inflight` copies not yet
// landed, through a region of `rows` rows of `row` bytes per CTA (the CTAs' regions follow each
// other, as an instruction's rows do), a tile being `tile / row` whole rows; every launch moves
// to fresh regions so nothing comes from L2 (a launch streams about 1 GB). Prints GB/s over all
// SMs and per SM.
// On the GPU machine:
//   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o /tmp/sp scripts/stream-pattern.cu && /tmp/sp [GIB [WHAT]]
// GIB: the buffer the launches move through (default 6; a model's footprint, e.g. 16 for
// Llama-3.1-8B, shows what translating a larger footprint costs); WHAT: only the cases whose
// name contains it.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <cuda_runtime.h>

typedef unsigned int u32;
typedef unsigned long long u64;

#define RING_BYTES (192 * 1024)
#define MAX_PAGES 24

// The megakernel's own mbarrier and bulk-copy wrappers (plain copies: no L2 cache hint).
#define MK_EVICT_FIRST 0
#include "../megakernel/pipeline.cuh"

// Grid: one CTA per SM. base: this launch's first byte; rows of `row` bytes, `per_cta` rows a CTA
// in each of `regions` consecutive instructions (as over a model's layers). times: null, or
// each CTA's (SM id, start, last landing) in ns.
__global__ void stream(const unsigned char* base, int row, int rows_per_tile, int per_cta, int regions, int pages,
                       int inflight, u64* times) {
    extern __shared__ __align__(128) unsigned char smem[];
    u64* full = (u64*)(smem + RING_BYTES);
    if (threadIdx.x != 0) return;
    const u64 t0 = global_ns();
    for (int i = 0; i < pages; i++) mbar_init(&full[i], 1);
    mbar_fence_init();
    const int page = RING_BYTES / pages, tile = row * rows_per_tile;
    const int per_region = per_cta / rows_per_tile, tiles = per_region * regions;
    for (int t = 0; t < tiles; t++) {
        const int r = t / per_region;
        const unsigned char* src = base + ((size_t)r * gridDim.x + blockIdx.x) * per_cta * row;
        // The copy `inflight` tiles back has landed (and the ring slot t reuses is free).
        const int back = t - (inflight < pages ? inflight : pages);
        if (back >= 0)
            while (!mbar_try_wait(&full[back % pages], (back / pages) & 1)) {
            }
        u64* bar = &full[t % pages];
        mbar_expect_tx(bar, tile);
        bulk_load(smem + (t % pages) * page, src + (size_t)(t - r * per_region) * tile, tile, bar, 0);
    }
    for (int b = tiles - pages > 0 ? tiles - pages : 0; b < tiles; b++)
        while (!mbar_try_wait(&full[b % pages], (b / pages) & 1)) {
        }
    if (times) {
        u32 smid;
        asm volatile("mov.u32 %0, %smid;" : "=r"(smid));
        times[3 * blockIdx.x] = smid;
        times[3 * blockIdx.x + 1] = t0;
        times[3 * blockIdx.x + 2] = global_ns();
    }
}

// Ranks of v (0 = smallest).
static void ranks(const double* v, int n, double* r) {
    for (int i = 0; i < n; i++) {
        int k = 0;
        for (int j = 0; j < n; j++) k += v[j] < v[i] || (v[j] == v[i] && j < i);
        r[i] = k;
    }
}
static double pearson(const double* a, const double* b, int n) {
    double ma = 0, mb = 0, sab = 0, saa = 0, sbb = 0;
    for (int i = 0; i < n; i++) ma += a[i] / n, mb += b[i] / n;
    for (int i = 0; i < n; i++) sab += (a[i] - ma) * (b[i] - mb), saa += (a[i] - ma) * (a[i] - ma), sbb += (b[i] - mb) * (b[i] - mb);
    return sab / sqrt(saa * sbb);
}

// Per SM: each launch's time from its first copy to its last landing, by SM id; prints each
// launch's spread (max / mean, and the slowest SM) and the rank correlation of the SMs' times
// between consecutive launches (near 1: the same SMs are slow every time). Launches of
// `regions` regions: 1 is one instruction's share (a stage of a layer), more a longer stream.
static void per_sm_times(const char* what, const unsigned char* buf, size_t per_launch, int launches, int sms, int row,
                         int rpt, int per_cta, int regions, int pages, int inflight, u64* times) {
    const int reps = 8;
    printf("  per SM, launches of %d region(s) of %d rows of %d bytes a CTA:\n", regions, per_cta, row);
    double* d = (double*)calloc((size_t)reps * sms, sizeof(double));
    double* mean_by_sm = (double*)calloc(sms, sizeof(double));
    u64* h = (u64*)malloc(3 * sizeof(u64) * sms);
    for (int l = 0; l < reps; l++) {
        stream<<<sms, 32, RING_BYTES + MAX_PAGES * 8>>>(buf + (l % launches) * per_launch, row, rpt, per_cta, regions,
                                                        pages, inflight, times);
        cudaMemcpy(h, times, 3 * sizeof(u64) * sms, cudaMemcpyDeviceToHost);
        u64 first = ~0ull;
        for (int i = 0; i < sms; i++) first = h[3 * i + 1] < first ? h[3 * i + 1] : first;
        double mean = 0, mx = 0;
        int slow = -1;
        for (int i = 0; i < sms; i++) {
            const int sm = (int)h[3 * i];
            const double t = (double)(h[3 * i + 2] - first) / 1e3;
            d[(size_t)l * sms + sm] = t;
            mean_by_sm[sm] += t / reps;
            mean += t / sms;
            if (t > mx) mx = t, slow = sm;
        }
        double mn = 1e30;
        for (int i = 0; i < sms; i++) mn = d[(size_t)l * sms + i] < mn ? d[(size_t)l * sms + i] : mn;
        printf("  launch %d: SMs done after %.1f (first) / %.1f (mean) / %.1f µs (last, SM %d): last/mean %.3f\n", l,
               mn, mean, mx, slow, mx / mean);
    }
    double* ra = (double*)malloc(sizeof(double) * sms);
    double* rb = (double*)malloc(sizeof(double) * sms);
    for (int l = 1; l < reps; l++) {
        ranks(d + (size_t)(l - 1) * sms, sms, ra);
        ranks(d + (size_t)l * sms, sms, rb);
        printf("  rank correlation of the SMs' times, launch %d against %d: %.2f\n", l, l - 1, pearson(ra, rb, sms));
    }
    printf("  %s: mean time by SM id (µs):", what);
    for (int i = 0; i < sms; i++) printf("%s%.1f", i % 16 ? " " : "\n   ", mean_by_sm[i]);
    printf("\n");
    free(d), free(mean_by_sm), free(h), free(ra), free(rb);
}

int main(int argc, char** argv) {
    int sms = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    const size_t bytes = (size_t)(argc > 1 ? atoi(argv[1]) : 6) << 30;
    const char* only = argc > 2 ? argv[2] : "";
    const bool per_sm = argc > 3 && strcmp(argv[3], "sms") == 0;
    u64* times = nullptr;
    if (per_sm && cudaMalloc(&times, 3 * sizeof(u64) * sms) != cudaSuccess) return 1;
    unsigned char* buf;
    if (cudaMalloc(&buf, bytes) != cudaSuccess) return 1;
    cudaMemset(buf, 1, bytes);
    const int smem = RING_BYTES + MAX_PAGES * 8;
    cudaFuncSetAttribute(stream, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    struct Case {
        const char* what;
        int row, rows_per_tile, per_cta, pages, inflight;
    } cases[] = {
        {"Llama-1B up-gate: 4 KB rows, 4 a tile (16 KB)", 4096, 4, 128, 12, 4},
        {"Llama-1B up-gate, 2 in flight", 4096, 4, 128, 12, 2},
        {"Llama-1B up-gate, 3 in flight", 4096, 4, 128, 12, 3},
        {"Llama-1B up-gate, 6 in flight", 4096, 4, 128, 12, 6},
        {"Llama-1B up-gate, 8 in flight", 4096, 4, 128, 12, 8},
        {"Llama-3B up-gate: 6 KB rows, 2 a tile (12 KB)", 6144, 2, 128, 12, 4},
        {"Llama-3B up-gate, 8 in flight", 6144, 2, 128, 12, 8},
        {"Llama-8B up-gate: 8 KB rows, 2 a tile (16 KB)", 8192, 2, 224, 12, 4},
        {"Qwen3-4B up-gate: 5 KB rows, 3 a tile (15 KB)", 5120, 3, 152, 12, 4},
        {"6 KB rows, 1 a tile (6 KB)", 6144, 1, 128, 24, 8},
        {"12 KB rows, 1 a tile (12 KB)", 12288, 1, 64, 12, 4},
        {"16 KB rows, 1 a tile", 16384, 1, 64, 12, 4},
        {"16 KB rows, 1 a tile, 8 in flight", 16384, 1, 64, 12, 8},
    };
    for (const Case& c : cases) {
        if (!strstr(c.what, only)) continue;
        const size_t per_region = (size_t)sms * c.per_cta * c.row;
        const int regions = (int)(((size_t)1 << 30) / per_region);
        const size_t per_launch = per_region * regions;
        const int launches = (int)(bytes / per_launch);
        cudaEvent_t a, b;
        cudaEventCreate(&a);
        cudaEventCreate(&b);
        stream<<<sms, 32, smem>>>(buf, c.row, c.rows_per_tile, c.per_cta, regions, c.pages, c.inflight, nullptr);
        cudaEventRecord(a);
        for (int l = 0; l < launches; l++)
            stream<<<sms, 32, smem>>>(buf + l * per_launch, c.row, c.rows_per_tile, c.per_cta, regions, c.pages,
                                      c.inflight, nullptr);
        cudaEventRecord(b);
        if (cudaEventSynchronize(b) != cudaSuccess) {
            printf("%s: %s\n", c.what, cudaGetErrorString(cudaGetLastError()));
            return 1;
        }
        float ms = 0;
        cudaEventElapsedTime(&ms, a, b);
        const double gbs = (double)per_launch * launches / (ms * 1e-3) / 1e9;
        printf("%-50s %2d in flight: %7.0f GB/s, %5.1f GB/s per SM (%d launches of %.0f MB, %zu GiB)\n", c.what,
               c.inflight, gbs, gbs / sms, launches, per_launch / 1e6, bytes >> 30);
        if (per_sm)
            for (int rg : {1, regions})
                per_sm_times(c.what, buf, per_launch, launches, sms, c.row, c.rows_per_tile, c.per_cta, rg, c.pages,
                             c.inflight, times);
    }
    return 0;
}

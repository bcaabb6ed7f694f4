// Just enough of CUDA for kernels/quant/quant.cu to compile and run as C++ (run.sh).
#include <cstdint>
#include <cstring>
#include <cmath>
#include <barrier>
#include <thread>
#include <vector>
#include <functional>
#define __device__
#define __forceinline__ inline
#define __global__
#define __shared__ static
struct uint2 { unsigned x, y; };
struct uint4 { unsigned x, y, z, w; };
struct float4 { float x, y, z, w; };
inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
struct Dim { unsigned x = 0, y = 0, z = 0; };
thread_local Dim threadIdx, blockIdx;
Dim blockDim, gridDim;
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    uint8_t b[8]; memcpy(b, &x, 4); memcpy(b + 4, &y, 4);
    unsigned r = 0;
    for (int i = 0; i < 4; i++) r |= (unsigned)b[(s >> (4 * i)) & 7] << (8 * i);
    return r;
}
inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
inline float rsqrtf(float x) { return 1.f / sqrtf(x); }
inline float __expf(float x) { return expf(x); }
using std::min;
std::barrier<>* g_block_bar;
std::barrier<>* g_warp_bar[32];
float g_shfl[32][32];
inline void __syncthreads() { g_block_bar->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int o) {
    int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    g_shfl[w][l] = v;
    g_warp_bar[w]->arrive_and_wait();
    float r = g_shfl[w][l ^ o];
    g_warp_bar[w]->arrive_and_wait();
    return r;
}
float4* g_dyn;

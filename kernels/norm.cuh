// The folded RMS norm's two steps, shared by the graph path's mat-vecs (baseline.cu) and the
// quantised ones (quant.cu). Both compilation units that hold quant.cu include it, one of them
// after baseline.cu as well: the guard keeps one copy.
#ifndef MEGAINFER_NORM_CUH
#define MEGAINFER_NORM_CUH

// 1 / sqrt(mean of squares + eps) over n elements, from each thread's partial sum of squares
// `ss`: warp sums, then the first warp over them; every thread gets the result. `partial`: 32
// floats of shared memory; every thread of the block calls it.
__device__ __forceinline__ float block_inv_rms(float ss, int n, float eps, float* partial) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = ss;
    __syncthreads();
    if (threadIdx.x < 32) {
        float v = threadIdx.x < (blockDim.x >> 5) ? partial[threadIdx.x] : 0.f;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (threadIdx.x == 0) partial[0] = rsqrtf(v / n + eps);
    }
    __syncthreads();
    return partial[0];
}

// Four normalised inputs: v scaled by the norm's scale and its four bf16 weights g.
__device__ __forceinline__ float4 norm4(float4 v, uint2 g, float scale) {
    v.x *= scale * __uint_as_float(g.x << 16);
    v.y *= scale * __uint_as_float(g.x & 0xffff0000u);
    v.z *= scale * __uint_as_float(g.y << 16);
    v.w *= scale * __uint_as_float(g.y & 0xffff0000u);
    return v;
}

#endif

// Qwen's steps between the QKV product and RoPE, shared by the graph baseline and batched
// prefill (src/reference/ops.rs `qkv_extras` is the reference): on f32 rows
// [rows][(n_heads + 2 * n_kv) * head_dim], in place, the q/k/v biases (Qwen2), then the RMS
// norm of every q and k head over head_dim (Qwen3). Llama models never launch it.
// Grid rows * (n_heads + 2 * n_kv) (block b: row b / (n_heads + 2 * n_kv), that head of it), head_dim threads (64 or 128). bias ([q | k | v] widths),
// q_norm and k_norm (head_dim each) are bf16 as raw 16-bit words, null when the model has none.
// Waits for its predecessor like every baseline kernel (a no-op without PDL).
extern "C" __global__ void qkv_extras(float* qkv, int n_heads, int n_kv, int head_dim, const unsigned short* bias,
                                      const unsigned short* q_norm, const unsigned short* k_norm, float eps) {
    __shared__ float part[4];
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
    const int all = n_heads + 2 * n_kv, row = blockIdx.x / all, h = blockIdx.x - row * all, i = threadIdx.x;
    float* x = qkv + ((size_t)row * all + h) * head_dim;
    float v = x[i];
    if (bias) v += __uint_as_float((unsigned)bias[h * head_dim + i] << 16);
    const unsigned short* w = h < n_heads ? q_norm : (h < n_heads + n_kv ? k_norm : nullptr);
    if (w) {  // the same for the whole block
        float ss = v * v;
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        if ((i & 31) == 0) part[i >> 5] = ss;
        __syncthreads();
        float total = 0.f;
        for (int k = 0; k < (head_dim >> 5); k++) total += part[k];
        v = v * rsqrtf(total / head_dim + eps) * __uint_as_float((unsigned)w[i] << 16);
    }
    x[i] = v;
}

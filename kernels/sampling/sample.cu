// The sampler as two kernels of its own, for the graph, graph + PDL and eager paths: one CTA
// per SMP_CHUNK logits (smp_blocks), then one CTA for the draw (smp_final), which writes the
// token where the next step reads it, as the greedy argmax does, so sampled steps chain on the
// device. Both start with launch_dependents and wait just before reading their inputs
// (no-ops without programmatic dependent launch).

// Rows per CTA: 4096 unless the host compiles with -DSMP_CHUNK=1024 or 2048
// (sampling::device::DeviceSampler::with_chunk, for comparisons).
#ifndef SMP_CHUNK
#define SMP_CHUNK 4096
#endif
#define SMP_BLOCK_THREADS 512
#define SMP_FINAL_THREADS 1024

// The decode paths' TokenMeta: {token fed at this step, its position, next token, pad}.
struct SmpMeta {
    smp_u32 token, pos, next, pad;
};

// The end of every draw (smp_final, smp_sample), by one thread: the drawn token t into
// history[pos + 1] and meta_out (token, next; position advanced), and the fed token into
// history[pos], so the repetition penalty's window stays on the device. The graph paths pass
// meta_out == meta (one slot); the megakernel, whose CTAs read a step's slot for the whole
// launch, passes the other of its two slots.
__device__ __forceinline__ void smp_store_token(const SmpMeta& m, smp_u32 t, smp_u32* history, SmpMeta* meta_out) {
    history[m.pos] = m.token;
    history[m.pos + 1] = t;
    // Nothing to draw from (NaN logits): the host sees the bad token in history and stops;
    // the next step must still read a real embedding row.
    const smp_u32 next = t == SMP_NONE ? 0u : t;
    meta_out->next = next;
    meta_out->token = next;
    meta_out->pos = m.pos + 1;
}

__device__ __forceinline__ void smp_pdl_launch_next() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ void smp_pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

extern "C" __global__ void __launch_bounds__(SMP_BLOCK_THREADS)
    smp_blocks(const float* logits, int vocab, const SmpMeta* meta, const smp_u32* history, const SmpParams* sp,
               SmpBlock* blocks, float* cand_v, smp_u32* cand_i) {
    __shared__ SmpShared sm;
    smp_pdl_launch_next();
    smp_pdl_wait();
    const SmpParams s = *sp;
    const SmpMeta m = *meta;
    const smp_u32 base = blockIdx.x * SMP_CHUNK;
    const int rows = min(SMP_CHUNK, vocab - (int)base);
    float* cv = cand_v + (size_t)blockIdx.x * SMP_KMAX;
    smp_u32* ci = cand_i + (size_t)blockIdx.x * SMP_KMAX;
    smp_block_part([&](int j) { return logits[base + j]; }, base, rows, s, m.pos, m.token, history,
                   [&](const SmpBlock& b) { blocks[blockIdx.x] = b; },
                   [&](smp_u32 slot, float v, smp_u32 i) { cv[slot] = v; ci[slot] = i; }, sm, threadIdx.x, blockDim.x,
                   [] { __syncthreads(); });
}

// One CTA merges the blocks' results and draws; the token goes out as smp_store_token says.
extern "C" __global__ void __launch_bounds__(SMP_FINAL_THREADS)
    smp_final(const SmpBlock* blocks, int nb, const float* cand_v, const smp_u32* cand_i, const SmpParams* sp,
              const SmpMeta* meta, smp_u32* history, SmpMeta* meta_out) {
    __shared__ SmpShared sm;
    smp_pdl_launch_next();
    smp_pdl_wait();
    const SmpParams s = *sp;
    const SmpMeta m = *meta;
    const smp_u32 t = smp_final_part([&](int b) { return blocks[b]; }, nb, [&](int i) { return cand_v[i]; },
                                     [&](int i) { return cand_i[i]; }, s, m.pos, sm, threadIdx.x, blockDim.x,
                                     [] { __syncthreads(); });
    if (threadIdx.x == 0) smp_store_token(m, t, history, meta_out);
}

// Philox4x32-10 of counters ctr[i] under key (key_lo, key_hi), for the test that the device
// draws the host's bits.
extern "C" __global__ void smp_philox_words(const uint4* ctr, smp_u32 key_lo, smp_u32 key_hi, uint4* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = smp_philox4x32_10(ctr[i], key_lo, key_hi);
}

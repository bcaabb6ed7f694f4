// The megakernel's attention: one instruction owns a KV head and the query heads sharing it,
// taken ATT_HEADS_PER_PASS at a time. Warps take blocks of 32 positions; K and V are read once
// per block for all heads of the pass.
// Scores: lane j scores position base + j against the queries (its K row in 16-byte loads).
// Values: each V row is split in CH = head_dim / 8 chunks of 16 bytes, so the 32 lanes cover
// R = 32 / CH rows at once and a block's V rows arrive in 32 / R independent loads per lane.
// Loads go in batches of 4 per lane to stay within the interpreter's register budget.

#define ATT_HEADS_PER_PASS 4

template <int CH>
__device__ __forceinline__ void attend_group_warp(const float* qs, int G, const bf16_t* k_head, const bf16_t* v_head,
                                                  int kv_stride, float scale, int p_begin, int p_end,
                                                  int first_block, int block_step, float* m, float* l,
                                                  float (*acc)[8]) {
    constexpr int HD = CH * 8, R = 32 / CH, PASSES = 32 / R, BATCH = 4;
    const int lane = threadIdx.x & 31, r = lane / CH, c = lane % CH;
    for (int base = p_begin + first_block * 32; base < p_end; base += block_step * 32) {
        const int pj = base + lane;
        const bool valid = pj < p_end;
        float dot[ATT_HEADS_PER_PASS] = {0.f, 0.f, 0.f, 0.f};
        if (valid) {
            const bf16_t* kr = k_head + (size_t)pj * kv_stride;
#pragma unroll
            for (int b = 0; b < CH; b += BATCH) {
                uint4 kv[BATCH];
#pragma unroll
                for (int u = 0; u < BATCH; u++) kv[u] = ld_cg16(kr + 8 * (b + u));
#pragma unroll
                for (int g = 0; g < ATT_HEADS_PER_PASS; g++) {
                    if (g >= G) break;
#pragma unroll
                    for (int u = 0; u < BATCH; u++) dot[g] += dot8(kv[u], qs + g * HD + 8 * (b + u));
                }
            }
        }
        float e[ATT_HEADS_PER_PASS];
#pragma unroll
        for (int g = 0; g < ATT_HEADS_PER_PASS; g++) {
            if (g >= G) break;
            const float s = valid ? dot[g] * scale : NEG_INF;
            const float m_new = fmaxf(m[g], warp_max(s));
            e[g] = valid ? __expf(s - m_new) : 0.f;
            const float corr = __expf(m[g] - m_new);
            l[g] = l[g] * corr + warp_sum(e[g]);
#pragma unroll
            for (int d = 0; d < 8; d++) acc[g][d] *= corr;
            m[g] = m_new;
        }
#pragma unroll
        for (int t0 = 0; t0 < PASSES; t0 += BATCH) {
            uint4 vv[BATCH];
#pragma unroll
            for (int u = 0; u < BATCH; u++) {
                const int row = base + (t0 + u) * R + r;
                vv[u] = row < p_end ? ld_cg16(v_head + (size_t)row * kv_stride + 8 * c) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int u = 0; u < BATCH; u++) {
                float v[8];
                widen8(vv[u], v);
#pragma unroll
                for (int g = 0; g < ATT_HEADS_PER_PASS; g++) {
                    if (g >= G) break;
                    const float pr = __shfl_sync(0xffffffffu, e[g], (t0 + u) * R + r);
#pragma unroll
                    for (int d = 0; d < 8; d++) acc[g][d] = fmaf(pr, v[d], acc[g][d]);
                }
            }
        }
    }
    // Rows were spread over the R lane groups: sum them so lanes r == 0 hold whole dims.
#pragma unroll
    for (int g = 0; g < ATT_HEADS_PER_PASS; g++) {
        if (g >= G) break;
#pragma unroll
        for (int d = 0; d < 8; d++)
#pragma unroll
            for (int o = CH; o < 32; o <<= 1) acc[g][d] += __shfl_xor_sync(0xffffffffu, acc[g][d], o);
    }
}

// The megakernel's entry: one persistent CTA per SM interprets its instruction stream for one
// decode step (see runtime.cuh for the machinery and ops/ for each instruction).

extern "C" __global__ void __launch_bounds__(MK_THREADS, 1) megakernel(const __grid_constant__ MkParams p) {
    extern __shared__ __align__(128) unsigned char smem[];
    // After a failure every later launch stops at once, leaving the progress words as the
    // failing launch left them.
    if (aborted(p)) return;
    bf16_t* pages = (bf16_t*)smem;
    float* xs = (float*)(smem + (size_t)p.pages * PAGE_BYTES);
    float* res = xs + p.xs_floats;
    float* red = res + 2 * RES_MAX;             // 2 * CONSUMER_WARPS words
    u64* full = (u64*)(red + 2 * CONSUMER_WARPS);
    u64* empty = full + p.pages;

    if (threadIdx.x == 0) {
        for (int i = 0; i < p.pages; i++) { mbar_init(&full[i], 1); mbar_init(&empty[i], 2); }
        mbar_fence_init();
    }
    __syncthreads();

    const u32* begin = p.instrs + (size_t)p.sm_offsets[blockIdx.x] * MK_WORDS;
    const u32* end = p.instrs + (size_t)p.sm_offsets[blockIdx.x + 1] * MK_WORDS;
    if (threadIdx.x < 32) {
        loader(p, begin, end, pages, full, empty);
        return;
    }
    const int ct = threadIdx.x - 32;
    const TokenMeta m = p.meta[p.epoch & 1];
    const u32 mult = p.epoch + 1;
    u32 seq = 0;
    for (const u32* w = begin; w < end; w += MK_WORDS) {
        const u32 op = w[W_OP];
        u64* prof = p.profile ? p.profile + (size_t)((w - p.instrs) / MK_WORDS) * 6 : nullptr;
        if (ct == 0 && prof) prof[0] = global_ns();
        if (op == OP_ATTN) prefetch_attention_kv(p, w, m);
        if (ct == 0) {
            note(p, 0, (u32)((w - p.instrs) / MK_WORDS));
            note(p, 1, ST_WAIT);
            for (u32 k = 0; k < w[W_NWAIT]; k++) {
                const u32 ctr = w[W_WAITS + 2 * k], target = w[W_WAITS + 2 * k + 1] * mult;
                const u64 t0 = global_ns();
                u32 seen;
                int spins = 0;
                while ((int)((seen = ld_acquire(p.counters + ctr)) - target) < 0) {
                    if (++spins % 64 == 0 && (aborted(p) || global_ns() - t0 > p.timeout_ns)) {
                        raise_error(p, ERR_COUNTER, (u32)((w - p.instrs) / MK_WORDS), ctr, target, seen);
                        break;
                    }
                }
            }
        }
        consumers_sync();
        if (aborted(p)) return;
        if (ct == 0) note(p, 1, ST_PREPARE);
        if (ct == 0 && prof) prof[1] = global_ns();
        switch (op) {
            case OP_QKV:
                prepare_normed(p, w[W_LAYER], false, m.token, p.layers[w[W_LAYER]].attn_norm, xs, red);
                break;
            case OP_UPGATE:
                prepare_normed(p, w[W_LAYER], true, m.token, p.layers[w[W_LAYER]].ffn_norm, xs, red);
                break;
            case OP_LMHEAD:
                prepare_normed(p, p.n_layers, false, m.token, p.final_norm, xs, red);
                break;
            case OP_OPROJ: {
                const float* src = p.attn_out + (size_t)w[W_LAYER] * p.heads * p.head_dim;
                for (int i = ct; i < p.heads * p.head_dim; i += CONSUMERS) xs[i] = __ldcg(src + i);
                break;
            }
            case OP_DOWN: {
                const float* src = p.act + (size_t)w[W_LAYER] * p.inter + w[W_D];
                for (int i = ct; i < (int)w[W_E]; i += CONSUMERS) xs[i] = __ldcg(src + i);
                break;
            }
            case OP_ATTN: op_attention(p, w, m, xs); break;
            case OP_ATTN_REDUCE: op_attn_reduce(p, w); break;
            case OP_ARGMAX: op_argmax(p, m); break;
            default: break;
        }
        const int ntiles = tile_count(w, p);
        if (ntiles > 0) {
            consumers_sync();
            if (ct == 0 && prof) prof[2] = global_ns();
            if (ct == 0) note(p, 1, ST_TILES);
            consume_tiles(p, w, seq, pages, full, empty, xs, res);
            seq += ntiles;
            consumers_sync();
            if (ct == 0 && prof) prof[3] = global_ns();
            if (aborted(p)) return;
            if (ct == 0) note(p, 1, ST_POST);
            // The residual, SiLU and down-proj stores are one loop each: written out here.
            const int layer = w[W_LAYER], rs = w[W_A], rc = w[W_B];
            switch (op) {
                case OP_QKV: post_qkv(p, w, m, res); break;
                case OP_OPROJ:
                    for (int j = ct; j < rc; j += CONSUMERS)
                        p.resid_attn[(size_t)layer * p.hidden + rs + j] = resid_in(p, layer, m.token, rs + j) + res_at(res, j);
                    break;
                case OP_UPGATE:
                    for (int j = ct; j < rc; j += CONSUMERS)
                        p.act[(size_t)layer * p.inter + rs + j] = silu(res_at(res, j)) * res_at(res, rc + j);
                    break;
                case OP_DOWN:
                    for (int j = ct; j < rc; j += CONSUMERS)
                        p.mlp_part[((size_t)layer * p.chunks + w[W_C]) * p.hidden + rs + j] = res_at(res, j);
                    break;
                case OP_LMHEAD: post_lmhead(p, w, res, red); break;
                default: break;
            }
        }
        consumers_sync();
        // The barrier orders every consumer's stores before thread 0's release add, which
        // publishes them (release is cumulative): no separate fence is needed.
        if (ct == 0 && prof) {
            if (ntiles == 0) prof[2] = prof[3] = prof[1];
            prof[4] = global_ns();
        }
        if (ct == 0 && w[W_SIGNAL] != NO_COUNTER) red_release_add(p.counters + w[W_SIGNAL], 1);
        if (ct == 0 && prof) prof[5] = global_ns();
        if (ct == 0) note(p, 1, ST_DONE);
    }
}

// The megakernel's entry: one persistent CTA per SM interprets its instruction stream for one
// decode step (see runtime.cuh for the machinery and ops/ for each instruction). Instructions
// need no waits of their own: every input they read is tagged and waited for where it is read.

extern "C" __global__ void __launch_bounds__(MK_THREADS, 1) megakernel(const __grid_constant__ MkParams p) {
    extern __shared__ __align__(128) unsigned char smem[];
    // After a failure every later launch stops at once, leaving the progress words as the
    // failing launch left them.
    if (aborted(p)) return;
    bf16_t* pages = (bf16_t*)smem;
    float* xs = (float*)(smem + (size_t)p.pages * PAGE_BYTES);
    float* res = xs + p.xs_floats;
    float* red = res + 2 * RES_MAX;               // 2 * CONSUMER_WARPS words
    float* ss = red + 2 * CONSUMER_WARPS;         // per warp: the RMS norm's sum of squares
    u32* iws = (u32*)(ss + CONSUMER_WARPS);       // this and the next instruction's words
    LayerW* lw = (LayerW*)(iws + 2 * MK_WORDS);
    u64* full = (u64*)(lw + p.n_layers);
    u64* empty = full + p.pages;

    const u32* begin = p.instrs + (size_t)p.sm_offsets[blockIdx.x] * MK_WORDS;
    const u32* end = p.instrs + (size_t)p.sm_offsets[blockIdx.x + 1] * MK_WORDS;
    if (threadIdx.x == 0) {
        for (int i = 0; i < p.pages; i++) { mbar_init(&full[i], 1); mbar_init(&empty[i], 2); }
        mbar_fence_init();
        mk_failed = 0;
    }
    for (int i = threadIdx.x; i < p.n_layers * (int)(sizeof(LayerW) / 8); i += MK_THREADS)
        ((u64*)lw)[i] = ((const u64*)p.layers)[i];
    if (threadIdx.x < MK_WORDS && begin < end) iws[threadIdx.x] = begin[threadIdx.x];
    __syncthreads();

    if (threadIdx.x < 32) {
        loader(p, lw, begin, end, pages, full, empty);
        return;
    }
    const int ct = threadIdx.x - 32;
    const TokenMeta m = p.meta[p.epoch & 1];
    const u32 tag = launch_tag(p);
    u32 seq = 0, buf = 0;
    for (const u32* wg = begin; wg < end; wg += MK_WORDS, buf ^= 1) {
        // The instruction's words sit in shared memory, fetched during the one before.
        const u32* w = iws + buf * MK_WORDS;
        const u32 op = w[W_OP], instr = (u32)((wg - p.instrs) / MK_WORDS);
        const u32 next = ct < MK_WORDS && wg + MK_WORDS < end ? __ldg(wg + MK_WORDS + ct) : 0;
        u64* prof = p.profile ? p.profile + (size_t)instr * PROF_WORDS : nullptr;
        const TileGeom g = tile_geom(w, p);
        const Rope rope = op == OP_QKV ? rope_of(p, w, m.pos) : Rope{0.f, 1.f};
        if (ct == 0) {
            if (prof) prof[0] = global_ns();
            mk_instr = instr;
            note(p, 0, instr);
            note(p, 1, ST_PREPARE);
        }
        switch (op) {
            case OP_QKV:
                prepare_normed(p, w[W_LAYER], false, m.token, lw[w[W_LAYER]].attn_norm, xs, ss);
                break;
            case OP_UPGATE:
                prepare_normed(p, w[W_LAYER], true, m.token, lw[w[W_LAYER]].ffn_norm, xs, ss);
                break;
            case OP_LMHEAD:
                prepare_normed(p, p.n_layers, false, m.token, p.final_norm, xs, ss);
                break;
            case OP_OPROJ: {
                // The residual rows it adds to travel in the same round trip as its input.
                for (int j = ct; j < (int)w[W_B]; j += CONSUMERS)
                    res[RES_MAX + j] = resid_in(p, w[W_LAYER], m.token, w[W_A] + j);
                copy_in(p, xs, p.attn_out + (size_t)w[W_LAYER] * p.heads * p.head_dim, p.heads * p.head_dim);
                break;
            }
            case OP_DOWN: copy_in(p, xs, p.act + (size_t)w[W_LAYER] * p.inter + w[W_D], w[W_E]); break;
            case OP_ATTN: seq += op_attention(p, w, m, instr, seq, pages, full, empty, xs, prof); break;
            case OP_ATTN_REDUCE: op_attn_reduce(p, w); break;
            case OP_ARGMAX: op_argmax(p, m, red); break;
            default: break;
        }
        if (consumers_failed()) return;
        // Attention stamps when its inputs arrived itself; its compute counts as its tiles.
        if (ct == 0 && prof) prof[op == OP_ATTN ? 2 : 1] = global_ns();
        if (g.tiles > 0) {
            // The RMS norm's scale (see prepare_normed), for the three instructions with one.
            const float scale = op == OP_QKV || op == OP_UPGATE || op == OP_LMHEAD ? rms_scale(p, ss) : 1.f;
            if (ct == 0) note(p, 1, ST_TILES);
            if (!consume_tiles(p, g, instr, seq, pages, full, empty, xs, res)) mk_failed = 1;
            seq += g.tiles;
            if (consumers_failed()) return;
            if (ct == 0 && prof) prof[2] = global_ns();
            if (ct == 0) note(p, 1, ST_POST);
            // The residual, SiLU and down-proj stores are one loop each: written out here.
            const int layer = w[W_LAYER], rs = w[W_A], rc = w[W_B];
            switch (op) {
                case OP_QKV: post_qkv(p, w, m, res, scale, rope); break;
                case OP_OPROJ:
                    for (int j = ct; j < rc; j += CONSUMERS)
                        st_tagged(p.resid_attn + (size_t)layer * p.hidden + rs + j, res[RES_MAX + j] + res_at(res, j), tag);
                    break;
                case OP_UPGATE:
                    for (int j = ct; j < rc; j += CONSUMERS)
                        st_tagged(p.act + (size_t)layer * p.inter + rs + j,
                                  silu(scale * res_at(res, j)) * (scale * res_at(res, rc + j)), tag);
                    break;
                case OP_DOWN:
                    for (int j = ct; j < rc; j += CONSUMERS)
                        st_tagged(p.mlp_part + ((size_t)layer * p.chunks + w[W_C]) * p.hidden + rs + j, res_at(res, j), tag);
                    break;
                case OP_LMHEAD: post_lmhead(p, w, res, red, scale); break;
                default: break;
            }
        } else if (ct == 0 && prof && op != OP_ATTN) {
            prof[2] = prof[1];
        }
        if (ct < MK_WORDS) iws[(buf ^ 1) * MK_WORDS + ct] = next;
        consumers_sync();
        if (ct == 0) {
            if (prof) prof[3] = global_ns();
            note(p, 1, ST_DONE);
        }
    }
}

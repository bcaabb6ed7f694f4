// The instruction table: every question the interpreter (megakernel.cu, loader.cuh) asks about
// an instruction is a switch here that calls that instruction's functions in ops/. A new
// instruction adds a case to each switch that concerns it (docs/megakernel.md, "Adding an
// instruction"). Everything is inlined: each switch compiles to the branches it replaces.

// ---- weight rows (loader and consumers) ----

__device__ __forceinline__ int seg_cols(const u32* w, const MkParams& p) {
    switch (w[W_OP]) {
        case OP_OPROJ: return oproj_cols(p);
        case OP_DOWN: return down_cols(w);
        case OP_QKV: return qkv_cols(p);
        case OP_UPGATE: return upgate_cols(p);
        case OP_LMHEAD: return lmhead_cols(p);
        default: return 0;
    }
}

__device__ __forceinline__ int seg_count(const u32* w) {
    switch (w[W_OP]) {
        case OP_QKV: return qkv_rows(w);
        case OP_UPGATE: return upgate_rows(w);
        case OP_OPROJ: return oproj_rows(w);
        case OP_DOWN: return down_rows(w);
        case OP_LMHEAD: return lmhead_rows(w);
        default: return 0;
    }
}

// Row j of the instruction's weight rows in global memory. lw: the layer pointer table, copied
// to shared memory at the start (reads of it must not become L2 round trips on the critical
// path).
// The instruction's layer's entry in the table (the LM head's layer word is 0; a word past
// the last layer, which a valid stream never holds, reads layer 0's).
__device__ __forceinline__ const LayerW& op_layer(const u32* w, const MkParams& p, const LayerW* lw) {
    return lw[w[W_LAYER] < (u32)p.n_layers ? w[W_LAYER] : 0];
}

__device__ __forceinline__ WRow seg_row(const u32* w, const MkParams& p, const LayerW* lw, int j) {
    const LayerW& L = op_layer(w, p, lw);
    switch (w[W_OP]) {
        case OP_QKV: return qkv_row(w, p, L, j);
        case OP_UPGATE: return upgate_row(w, p, L, j);
        case OP_OPROJ: return oproj_row(w, p, L, j);
        case OP_DOWN: return down_row(w, p, L, j);
        case OP_LMHEAD: return lmhead_row(w, p, j);
        default: return {nullptr, nullptr};
    }
}

// The storage format of the instruction's matrix (see "weight formats" in runtime.cuh): its
// kind's, or with MK_WT_MIXED its layer's, from the layer table.
__device__ __forceinline__ int op_format(const u32* w, const MkParams& p, const LayerW* lw) {
#if MK_WT_MIXED
    const LayerW& L = op_layer(w, p, lw);
    switch (w[W_OP]) {
        case OP_QKV: return layer_wt(L.w_qkv, MK_WT_QKV);
        case OP_UPGATE: return layer_wt(L.w_gu, MK_WT_GU);
        case OP_OPROJ: return layer_wt(L.wo, MK_WT_O);
        case OP_DOWN: return layer_wt(L.w_down, MK_WT_DOWN);
        case OP_LMHEAD: return MK_WT_LM;
        default: return WEIGHT_BF16;
    }
#else
    switch (w[W_OP]) {
        case OP_QKV: return MK_WT_QKV;
        case OP_UPGATE: return MK_WT_GU;
        case OP_OPROJ: return MK_WT_O;
        case OP_DOWN: return MK_WT_DOWN;
        case OP_LMHEAD: return MK_WT_LM;
        default: return WEIGHT_BF16;
    }
#endif
}

// Columns of the whole matrix the instruction's rows come from.
__device__ __forceinline__ int op_matrix_cols(u32 op, const MkParams& p) {
    return op == OP_DOWN ? p.inter : op == OP_OPROJ ? p.heads * p.head_dim : p.hidden;
}

__device__ __forceinline__ TileGeom tile_geom(const u32* w, const MkParams& p, const LayerW* lw) {
    const int n = seg_count(w);
    if (n == 0) return {0, 0, 0, 0, 0, 0, 0, 0, 0};
    const int cols = seg_cols(w, p), wt = op_format(w, p, lw);
    const bool whole = cols == op_matrix_cols(w[W_OP], p);
    const int slot = whole ? wt_row(wt, cols) : wt_chunk_slot(wt, cols);
    // Rows a tile and tiles: chosen by the host for the rows' format and written into the
    // instruction (src/gpu/megakernel/tiles.rs), so no division here.
    const int rpt = (int)(w[W_F] & 0xffffu), tiles = (int)(w[W_F] >> 16);
    int soff = 0;
    if (MK_ANY_QUANT && wt != WEIGHT_BF16 && !whole) soff = (int)((size_t)seg_row(w, p, lw, 0).s & 15);
    return {n, cols, rpt, tiles, wt, wt_qbytes(wt, cols), slot, whole, soff};
}

// The instruction's tiles (runtime.cuh, tiles_of_format), in its matrix's format: only the
// formats the kernel is compiled for are instantiated.
__device__ bool consume_tiles(const MkParams& p, const TileGeom& g, u32 instr, u32 seq, const bf16_t* pages, u64* full,
                              u64* empty, float* xs, bool fresh, float* res) {
#define MK_TILES_OF(t)                                                                              \
    if constexpr (MK_WT_USED(t))                                                                    \
        if (g.wt == (t)) return tiles_of_format<t>(p, g, instr, seq, pages, full, empty, xs, fresh, res);
    MK_TILES_OF(WEIGHT_BF16)
    MK_TILES_OF(WEIGHT_Q8_0)
    MK_TILES_OF(WEIGHT_Q4_0)
    MK_TILES_OF(WEIGHT_Q4_1)
    MK_TILES_OF(WEIGHT_Q6_K)
#undef MK_TILES_OF
    return false;
}

// ---- the loader ----

// Instructions whose pages the loader fills with something other than weight rows.
__device__ __forceinline__ bool op_has_own_loader(u32 op) { return op == OP_ATTN; }

// Their loader step; false when a page wait failed.
__device__ __forceinline__ bool op_load(const MkParams& p, const u32* w, u32 pos, u32 pos0, u32& verified, u32 instr,
                                        u32& seq, bf16_t* pages, u64* full, u64* empty, u64 policy) {
    switch (w[W_OP]) {
        case OP_ATTN: return load_attention(p, w, pos, pos0, verified, instr, seq, pages, full, empty, policy);
        default: return true;
    }
}

// ---- the consumers ----

// What an instruction works out when it starts, before it waits for its inputs (it depends
// only on the position and the words).
struct OpEarly {
    Rope rope;
};

__device__ __forceinline__ OpEarly op_early(u32 op, const MkParams& p, const u32* w, u32 pos) {
    return {op == OP_QKV ? rope_of(p, w, pos) : Rope{0.f, 1.f}};
}

// Waits for the inputs and prepares xs (or, for instructions without weight tiles, does all
// the work). Returns how many of the ring's tiles it consumed itself (attention's K/V).
__device__ __forceinline__ u32 op_prepare(u32 op, const MkParams& p, const u32* w, const TokenMeta& m, u32 instr,
                                          u32 seq, const Smem& sm, u64* prof) {
    switch (op) {
        case OP_QKV: prepare_qkv(p, w, m, sm); return 0;
        case OP_UPGATE: prepare_upgate(p, w, m, sm); return 0;
        case OP_LMHEAD: prepare_lmhead(p, m, sm); return 0;
        case OP_OPROJ: prepare_oproj(p, w, m, sm); return 0;
        case OP_DOWN: prepare_down(p, w, sm); return 0;
        case OP_ATTN: return op_attention(p, w, m, instr, seq, sm.pages, sm.full, sm.empty, sm.xs, prof);
        case OP_ATTN_REDUCE: op_attn_reduce(p, w, sm.xs); return 0;
        case OP_ARGMAX: op_argmax(p, m, sm.red); return 0;
        default: return 0;
    }
}

// Instructions that stamp "inputs arrived" (profile word 1) themselves; their compute counts
// as their tiles (word 2).
__device__ __forceinline__ bool op_stamps_inputs(u32 op) { return op == OP_ATTN; }

// The factor the tiles' results take: the RMS norm's scale (see prepare_normed) for the
// instructions that normalise their input.
__device__ __forceinline__ float op_scale(u32 op, const MkParams& p, const float* ss) {
    return op == OP_QKV || op == OP_UPGATE || op == OP_LMHEAD ? rms_scale(p, ss) : 1.f;
}

// The store after the tiles (res holds the rows' dot products, see tiles_of_format).
__device__ __forceinline__ void op_post(u32 op, const MkParams& p, const u32* w, const TokenMeta& m, const Smem& sm,
                                        float scale, const OpEarly& early) {
    switch (op) {
        case OP_QKV: post_qkv(p, w, m, sm.lw[w[W_LAYER]], sm.res, scale, early.rope); break;
        case OP_OPROJ: post_oproj(p, w, sm.res); break;
        case OP_UPGATE: post_upgate(p, w, sm.res, scale); break;
        case OP_DOWN: post_down(p, w, sm.res); break;
        case OP_LMHEAD: post_lmhead(p, w, m, sm.res, sm.red, scale); break;
        default: break;
    }
}

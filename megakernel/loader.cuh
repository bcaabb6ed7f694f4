// The loader warp: walks its SM's stream ahead of the consumers and fills the page ring with
// each instruction's weight rows (or, for attention, its staged K/V rows), never waiting for
// activations. Weights do not depend on them, so the next instructions' weights stream in while
// the current instruction waits, computes and stores.

// After the generation stopped (or a wait failed): waits for the copies still in flight, so
// none lands in shared memory after the CTA has exited. seq: the tiles issued.
__device__ void loader_drain(const MkParams& p, u64* full, u32 seq) {
    const u32 first = seq > (u32)MK_RING(p) ? seq - MK_RING(p) : 0;
    for (u32 s = first; s < seq; s++) {
        const u64 t0 = global_ns();
        while (!mbar_try_wait(&full[s % MK_RING(p)], (s / MK_RING(p)) & 1))
            if (global_ns() - t0 > p.timeout_ns) return;
    }
}

// MK_L2_PF_NEXT=N: when the loader reaches an instruction's first tile with the ring still full
// (the consumers streaming the instruction before, as at the down projection's end before the
// next layer's QKV), it asks L2 for the rows of the instruction's first N tiles, so that their
// copies, once pages are free, come from L2 rather than wait a memory latency on the critical
// path. The host compiles N = 8 with the weights' whole ring on bf16 models 1024 to 2048 wide
// (src/gpu/megakernel/compile.rs, `defines`: measured there); MEGAINFER_MK_DEFINES may set it.
#ifndef MK_L2_PF_NEXT
#define MK_L2_PF_NEXT 0
#endif

// MK_HOLD_NEXT=K: in a generation, until the token a step feeds is out, the loader keeps at
// most K of that step's tiles in flight (reading the token word before each), so that the
// round trips that hand the token over (and a draw's inside the launch) do not queue behind a
// whole ring of the next step's weights, and SMs done with the LM head leave the bandwidth to
// those still streaming it. The host compiles K = 2 with the weights' whole ring where it was
// measured faster (src/gpu/megakernel/compile.rs, `defines`); MEGAINFER_MK_DEFINES may set it.
#ifndef MK_HOLD_NEXT
#define MK_HOLD_NEXT 0
#endif

// One step's loads; false when the generation stopped or a wait failed. pos0: the launch's
// first position (rows before it were written by earlier launches); verified: the steps of
// the launch whose K/V rows the loader has acquired (see rows_of_step_ready in runtime.cuh).
__device__ bool load_step(const MkParams& p, const LayerW* lw, const u32* begin, const u32* end, u32 pos, u32 pos0,
                          u32& verified, u64 policy, u32& seq, bf16_t* pages, u64* full, u64* empty) {
    const int lane = threadIdx.x & 31;
#if MK_HOLD_NEXT
    // The tag of the token this step feeds.
    bool held = p.steps > 1 && pos > pos0;
    const u32 want = p.epoch + (pos - pos0);
#endif
    for (const u32* wg = begin; wg < end; wg += MK_WORDS) {
        // The operands (all the words: the tile word is the last), read once into registers
        // rather than once per weight row.
        u32 w[MK_WORDS];
#pragma unroll
        for (int k = 0; k < MK_WORDS; k++) w[k] = wg[k];
        const u32 instr = (u32)((wg - p.instrs) / MK_WORDS);
        if (op_has_own_loader(w[W_OP])) {
            if (lane == 0) note(p, 2, instr);
            if (!op_load(p, w, pos, pos0, verified, instr, seq, pages, full, empty, policy)) return false;
            continue;
        }
        const TileGeom g = tile_geom(w, p, lw);
        if (g.n == 0) continue;
        if (lane == 0) note(p, 2, instr);
        const int sbytes = wt_sbytes(g.wt, g.cols);
        u64* prof = p.profile ? p.profile + (size_t)instr * PROF_WORDS : nullptr;
        if (!MK_PREP_STAMPS && !MK_TILE_STAMPS && !MK_SMP_STAMPS && lane == 0 && prof) prof[PROF_EXTRA1] = global_ns();
        for (int t = 0; t < g.tiles; t++, seq++) {
            u32 slot = seq % MK_RING(p), round = seq / MK_RING(p);
            if (MK_TILE_NOTES && lane == 0) note(p, 3, seq);
            int rows = min(g.rpt, g.n - t * g.rpt);
#if MK_L2_PF_NEXT
            // The ring is full at an instruction's first tile: ask L2 for its first tiles' rows.
            if (t == 0 && !mbar_test_wait(&empty[slot], (round & 1) ^ 1))
                for (int r = lane; r < min(g.n, MK_L2_PF_NEXT * g.rpt); r += 32) {
                    const WRow a = seg_row(w, p, lw, r);
                    bulk_prefetch_l2(a.q, g.whole ? g.slot : g.qbytes);
                    if (MK_ANY_QUANT && g.wt != WEIGHT_BF16 && !g.whole)
                        bulk_prefetch_l2(scales_from(a.s), scales_span(a.s, sbytes));
                }
#endif
            if (!page_wait(p, &empty[slot], (round & 1) ^ 1, ERR_PAGE_LOADER, instr, seq)) return false;
            if (!inflight_wait(p, full, seq, instr)) return false;
#if MK_HOLD_NEXT
            if (held) {
                if (gen_tag_ok(ld_tagged(p.gen), want, 1)) held = false;
                else if (!inflight_wait<MK_HOLD_NEXT, MK_HOLD_NEXT>(p, full, seq, instr)) return false;
            }
#endif
            // The tile's bytes: whole rows, or the chunks' quants and each one's scales span
            // (see "weight formats" in runtime.cuh).
            u32 bytes = rows * (g.whole ? g.slot : g.qbytes);
            if (MK_ANY_QUANT && g.wt != WEIGHT_BF16 && !g.whole)
                bytes += rows * scales_span(seg_row(w, p, lw, t * g.rpt).s, sbytes);
            if (lane == 0) mbar_expect_tx(&full[slot], bytes);
            __syncwarp();
            char* page = (char*)pages + (size_t)slot * PAGE_BYTES;
            // Whole rows that follow each other in memory go in one copy (a run): each copy has
            // a cost of its own, which small rows would pay many times over. The runs are found
            // among 32 rows at a time: a lane whose row does not follow the one before starts
            // one, up to the next lane that starts one.
            for (int r0 = 0; r0 < rows; r0 += 32) {
                const int r = r0 + lane;
                const bool live = r < rows;
                const WRow a = seg_row(w, p, lw, t * g.rpt + (live ? r : 0));
                if (g.whole) {
                    const unsigned char* prev = (const unsigned char*)__shfl_up_sync(0xffffffffu, (size_t)a.q, 1);
                    const bool starts = live && (lane == 0 || a.q != prev + g.slot);
                    const u32 later = __ballot_sync(0xffffffffu, starts) & ~((2u << lane) - 1u);
                    const int end = min(rows, r0 + (later ? __ffs(later) - 1 : 32));
                    if (starts) bulk_load(page + r * g.slot, a.q, (end - r) * g.slot, &full[slot], policy);
                } else if (live) {
                    bulk_load(page + r * g.slot, a.q, g.qbytes, &full[slot], policy);
                    if (MK_ANY_QUANT && g.wt != WEIGHT_BF16)
                        bulk_load(page + r * g.slot + g.qbytes, scales_from(a.s), scales_span(a.s, sbytes), &full[slot],
                                  policy);
                }
            }
        }
        if (!MK_PREP_STAMPS && !MK_TILE_STAMPS && !MK_SMP_STAMPS && lane == 0 && prof) prof[PROF_EXTRA2] = global_ns();
    }
    return true;
}

__device__ void loader(const MkParams& p, const LayerW* lw, const u32* begin, const u32* end, u32 pos0, bf16_t* pages,
                       u64* full, u64* empty) {
    const u64 policy = l2_evict_first();
    u32 seq = 0, verified = 0;
    for (u32 step = 0; step < p.steps; step++)
        if (!load_step(p, lw, begin, end, pos0 + step, pos0, verified, policy, seq, pages, full, empty)) {
            loader_drain(p, full, seq);
            return;
        }
}

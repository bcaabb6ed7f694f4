// The loader warp: walks its SM's stream ahead of the consumers and fills the page ring with
// each instruction's weight rows (or, for attention, its staged K/V rows), never waiting for
// activations. Weights do not depend on them, so the next instructions' weights stream in while
// the current instruction waits, computes and stores.

__device__ void loader(const MkParams& p, const LayerW* lw, const u32* begin, const u32* end, bf16_t* pages, u64* full,
                       u64* empty) {
    const int lane = threadIdx.x & 31;
    const u32 pos = p.meta[p.epoch & 1].pos;
    const u64 policy = l2_evict_first();
    u32 seq = 0;
    for (const u32* wg = begin; wg < end; wg += MK_WORDS) {
        // The operands, read once into registers rather than once per weight row.
        u32 w[W_E + 1];
#pragma unroll
        for (int k = 0; k <= W_E; k++) w[k] = wg[k];
        const u32 instr = (u32)((wg - p.instrs) / MK_WORDS);
        if (op_has_own_loader(w[W_OP])) {
            if (lane == 0) note(p, 2, instr);
            if (!op_load(p, w, pos, instr, seq, pages, full, empty, policy)) return;
            continue;
        }
        const TileGeom g = tile_geom(w, p, lw);
        if (g.n == 0) continue;
        if (lane == 0) note(p, 2, instr);
        const int sbytes = wt_sbytes(g.wt, g.cols);
        u64* prof = p.profile ? p.profile + (size_t)instr * PROF_WORDS : nullptr;
        if (lane == 0 && prof) prof[PROF_EXTRA1] = global_ns();
        for (int t = 0; t < g.tiles; t++, seq++) {
            u32 slot = seq % p.pages, round = seq / p.pages;
            if (lane == 0) note(p, 3, seq);
            int rows = min(g.rpt, g.n - t * g.rpt);
            if (!page_wait(p, &empty[slot], (round & 1) ^ 1, ERR_PAGE_LOADER, instr, seq)) return;
            if (!inflight_wait(p, full, seq, instr)) return;
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
        if (lane == 0 && prof) prof[PROF_EXTRA2] = global_ns();
    }
}

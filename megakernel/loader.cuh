// The loader warp: walks its SM's stream ahead of the consumers and fills the page ring with
// each instruction's weight rows (or, for attention, its staged K/V rows), never waiting for
// activations. Weights do not depend on them, so the next instructions' weights stream in while
// the current instruction waits, computes and stores; in a launch of several steps it runs on
// into the next step's stream the same way.

// Before staging K/V rows in step `step` (> 0) of a launch: rows the previous step wrote must
// be in memory. Waits until every CTA published that it finished that step (step_done carries
// the previous step's tag, stored after the writer's release fence), then an acquire fence, and
// a proxy fence for the bulk copies that read them. False on a timeout (the error is raised),
// or when the consumers stopped the launch.
__device__ bool loader_step_gate(const MkParams& p, u32 step, u32 instr) {
    const u32 tag = p.epoch + step;  // the previous step's tag
    const int lane = threadIdx.x & 31;
    bool ok = true;
    for (int i = lane; i < (int)gridDim.x && ok; i += 32) {
        u64 t0 = 0;
        for (int spins = 0;; spins++) {
            const u64 raw = ld_tagged(p.step_done + i);
            if ((u32)(raw >> 32) == tag) break;
            if (spins == 0) {
                t0 = global_ns();
            } else if (spins % 64 == 0) {
                if (aborted(p) || stop_requested()) { ok = false; break; }
                if (global_ns() - t0 > p.timeout_ns) {
                    raise_error(p, ERR_DATA, instr, (u32)(p.step_done + i - p.resid_attn), tag, (u32)(raw >> 32));
                    ok = false;
                    break;
                }
            }
        }
    }
    // Each lane acquires what it saw; the warp goes on as one (its sync orders the lanes), and
    // the bulk copies, in the async proxy, come after a proxy fence.
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
    if (!__all_sync(0xffffffffu, ok)) return false;
    asm volatile("fence.proxy.async.global;" ::: "memory");
    return true;
}

// When the consumers stopped the launch before its last step: waits for the copies issued but
// not consumed (tiles mk_cseq .. issued - 1) to land, so none writes shared memory after the CTA
// exits.
__device__ void loader_drain(const MkParams& p, u32 issued, u64* full) {
    __threadfence_block();  // mk_stop was seen: mk_cseq, stored before it, is current
    const u64 t0 = global_ns();
    for (u32 s = *(volatile u32*)&mk_cseq; s < issued; s++) {
        while (!mbar_try_wait(&full[s % p.pages], (s / p.pages) & 1)) {
            if (global_ns() - t0 > p.timeout_ns) {
                raise_error(p, ERR_PAGE_LOADER, current_instr(), s, (s / p.pages) & 1, 0);
                return;
            }
        }
    }
}

__device__ void loader(const MkParams& p, const LayerW* lw, const u32* begin, const u32* end, bf16_t* pages, u64* full,
                       u64* empty) {
    const int lane = threadIdx.x & 31;
    const u32 pos0 = p.meta[p.epoch & 1].pos;
    const u64 policy = l2_evict_first();
    u32 seq = 0;
    for (u32 step = 0; step < p.steps; step++) {
        const u32 pos = pos0 + step;
        bool gated = step == 0;
        for (const u32* wg = begin; wg < end; wg += MK_WORDS) {
            if (stop_requested()) {
                loader_drain(p, seq, full);
                return;
            }
            // The operands, read once into registers rather than once per weight row.
            u32 w[W_E + 1];
#pragma unroll
            for (int k = 0; k <= W_E; k++) w[k] = wg[k];
            const u32 instr = (u32)((wg - p.instrs) / MK_WORDS);
            if (op_has_own_loader(w[W_OP])) {
                if (lane == 0) note(p, 2, instr);
                bool ok = gated || loader_step_gate(p, step, instr);
                gated = true;
                ok = ok && op_load(p, w, pos, instr, seq, pages, full, empty, policy);
                if (!ok) {
                    if (stop_requested()) loader_drain(p, seq, full);
                    return;
                }
                continue;
            }
            int n = seg_count(w);
            if (n == 0) continue;
            if (lane == 0) note(p, 2, instr);
            int cols = seg_cols(w, p), rpt = rows_per_tile(cols, n);
            u32 bytes_per_row = cols * 2;
            u64* prof = p.profile ? p.profile + (size_t)instr * PROF_WORDS : nullptr;
            if (lane == 0 && prof) prof[PROF_EXTRA1] = global_ns();
            for (int t = 0; t * rpt < n; t++, seq++) {
                u32 slot = seq % p.pages, round = seq / p.pages;
                if (lane == 0) note(p, 3, seq);
                int rows = min(rpt, n - t * rpt);
                if (!page_wait(p, &empty[slot], (round & 1) ^ 1, ERR_PAGE_LOADER, instr, seq) ||
                    !inflight_wait(p, full, seq, instr)) {
                    if (stop_requested()) loader_drain(p, seq, full);
                    return;
                }
                if (lane == 0) mbar_expect_tx(&full[slot], rows * bytes_per_row);
                __syncwarp();
                char* page = (char*)pages + (size_t)slot * PAGE_BYTES;
                for (int r = lane; r < rows; r += 32)
                    bulk_load(page + r * bytes_per_row, seg_ptr(w, p, lw, t * rpt + r), bytes_per_row, &full[slot], policy);
            }
            if (lane == 0 && prof) prof[PROF_EXTRA2] = global_ns();
        }
    }
}

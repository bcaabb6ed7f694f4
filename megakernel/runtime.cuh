// The megakernel's interpreter core: one persistent CTA per SM interprets its instruction
// stream for one decode step. Warp 0 is the loader (weights -> paged shared memory, running
// ahead of the consumers); warps 1..CONSUMER_WARPS compute. Activations passed between
// instructions carry the launch's tag (epoch + 1) and are waited for where they are read, so
// the same streams run token after token without host work.
//
// This file holds what every instruction shares: the parameter block, errors and progress,
// tagged activations, the page ring's waits and the mat-vec tiles' loop. What an instruction
// does lives in ops/ (one header per instruction), reached through the table in ops.cuh.
// MK_WORDS, CONSUMER_WARPS, RES_MAX, PAGE_BYTES, PROF_WORDS, TILE_GROUPS, the opcodes, the
// error kinds, the progress stages and the shared-memory carve-up come from the host
// (src/gpu/megakernel/abi.rs), which also checks MkParams' layout against its own.

// 8 consumer warps + the loader = 9 warps: at most 3 per SM sub-partition, which lets each
// thread have 168 registers; with more warps (fewer registers each) the interpreter loop
// spills, and the reloads go to L2.
#define CONSUMERS (CONSUMER_WARPS * 32)
#if defined(MK_LANE_ARRIVALS) && MK_LANE_ARRIVALS
static_assert(MK_EMPTY_ARRIVALS == CONSUMERS && MK_EMPTY_ARRIVALS % 64 == 0,
              "racecheck's build: a page's arrivals are every consumer's, or 64 lanes' equal shares");
#endif
#define MK_THREADS (CONSUMERS + 32)
// Each tile is consumed by a pair of warps splitting its columns; tile t goes to group
// t % TILE_GROUPS and the host makes the page count a multiple of TILE_GROUPS, so within an
// instruction a page is always consumed by the same group, and every instruction ends with a
// consumers' barrier (megakernel.cu), so an earlier instruction's pages were all filled and
// consumed whichever groups took them. A warp then waits on a page's "full" barrier only after
// that page's previous tile was consumed, so that phase is complete: the parity test cannot
// pass for a phase two ahead. (Bulk copies complete out of order, so "issued earlier" is not
// enough: pages shared round-robin by more groups than divide their count can hang.)
static_assert(TILE_GROUPS * 2 == CONSUMER_WARPS, "a tile group is a pair of consumer warps");
#define ABORT_CHECK_SPINS 1024
// The ring's page count: a constant where the host compiled one in (MK_PAGES, checked at the
// kernel's start), so that a tile's page and phase (seq % pages, seq / pages, by the loader and
// every consumer, once per tile) are a multiply and shifts instead of a division.
#ifdef MK_PAGES
#define MK_RING(p) (MK_PAGES)
#else
#define MK_RING(p) ((p).pages)
#endif

#if !defined(MK_HEAD_DIM) || !defined(MK_GROUP) || !defined(MK_HIDDEN) || !defined(MK_Q_DIM)
#error "the megakernel is compiled for a model: define MK_HEAD_DIM, MK_GROUP, MK_HIDDEN and MK_Q_DIM"
#endif

// Word layout of one instruction: scheduler/src/encode.rs (operands a0..a5 = W_A..W_F); a
// mat-vec's W_F holds its tiles, which the host writes (src/gpu/megakernel/tiles.rs).
#define W_OP 0
#define W_LAYER 1
#define W_A 2
#define W_B 3
#define W_C 4
#define W_D 5
#define W_E 6
#define W_F 7
static_assert(W_F < MK_WORDS, "an instruction's words hold its tile word");

struct LayerW {
    const bf16_t* attn_norm;
    const bf16_t* w_qkv;
    const bf16_t* wo;
    const bf16_t* ffn_norm;
    const bf16_t* w_gu;
    const bf16_t* w_down;
    const bf16_t* qkv_bias;  // Qwen2: [q | k | v] widths; null for other models
    const bf16_t* q_norm;    // Qwen3: head_dim each; null for other models
    const bf16_t* k_norm;
};

struct MkParams {
    const u32* instrs;
    const u32* sm_offsets;
    const u32* kv_last;  // per SM: its last instruction writing K/V cache rows, or ~0u

    u32* error;          // [flag, sm, instruction, tile or arena element, expected, seen, kind]
    u32* progress;       // per SM: [consumer instruction, consumer stage, loader instruction, loader tile]
    // null, or per instruction (PROF_WORDS): globaltimer at start, inputs arrived and prepared,
    // tiles done, stored; then the loader's first page wait and its last tile issued (for
    // attention: scores and softmax done, weighted values done).
    u64* profile;
    TokenMeta* meta;     // two slots, by epoch parity
    u32* history;
    const LayerW* layers;
    const bf16_t* embed;
    const bf16_t* final_norm;
    const bf16_t* lm_head;
    const float* inv_freq;
    bf16_t* k_cache;
    bf16_t* v_cache;
    // Tagged activations (see st_tagged), all in one arena that starts at resid_attn.
    u64* resid_attn;     // [layers][hidden]
    u64* mlp_part;       // [layers][chunks][hidden]
    u64* q;              // [layers][heads*head_dim]
    u64* kv_new;         // [layers][2][kv_heads][head_dim]: this token's K and V rows (bf16 values; K raw f32 with q/k norms)
    u64* attn_out;       // [layers][heads*head_dim]
    u64* attn_part;      // [layers][heads][parts_max][head_dim + 2]
    u64* act;            // [layers][inter]
    u64* lm_best;        // [n_lm][2]: value, index bits
    float* logits;       // [vocab], read by the host
    int hidden, inter, heads, kv_heads, head_dim, vocab, n_layers, chunks, max_seq, n_lm;
    int xs_floats, pages;
    float eps;
    u32 epoch;
    u64 timeout_ns;
    // A generation inside one launch (see megakernel.cu): the steps run at most, the last
    // finished step's token (tagged; GEN_STOP set when the generation ends there) then, for
    // each SM that writes K/V rows, its last finished step (its tag, written after a release
    // fence; see rows_of_step_ready), the tokens for the
    // host (null, or mapped host memory), the host's stop request (null, or mapped host
    // memory, nonzero to stop) and the tokens the generation stops after.
    u64* gen;            // [1 + SMs]
    u32* gen_out;        // [steps]
    const u32* gen_ctl;
    const u32* stop_ids;  // [n_stop]
    // null, or per step of the launch: when the argmax published its token, and the earliest
    // start of an SM's first instruction (globaltimer, ns; the host measures the gap between
    // tokens with them).
    u64* gen_prof;        // [steps][2]
    u32 steps, n_stop;
    // A sampled launch (sampling != 0) draws each token by the smp_* rule (SmpParams,
    // kernels/sampling/select.cuh) instead of taking the argmax: the LM head's blocks hand
    // their summaries and keys to the draw through lm_sample (ops/sample.cuh).
    u64* lm_sample;       // [n_lm][MK_SMP_BLOCK_WORDS], tagged, in the arena
    float smp_temperature, smp_top_p, smp_min_p, smp_penalty;
    u32 smp_top_k, smp_last_n, smp_seed_lo, smp_seed_hi;
    u32 sampling, smp_pad;
};

// Shared memory as the interpreter uses it; carved by MK_SMEM_* (from the host's plan, see
// megakernel.cu).
struct Smem {
    bf16_t* pages;  // the page ring: p.pages pages of PAGE_BYTES
    float* xs;      // the input vector of the instruction (attention: its scratch)
    float* res;     // per weight row, the two column halves' dot products (2 * RES_MAX)
    float* red;     // 2 * CONSUMER_WARPS words for block reductions
    float* ss;      // per consumer warp: the RMS norm's sum of squares
    u32* iws;       // this and the next instruction's words
    LayerW* lw;     // the layer pointer table
    u64* full;      // per page: the loader's copies landed
    u64* empty;     // per page: the consumers released it
};

// MK_PREP_STAMPS=1 (for measuring, through MEGAINFER_MK_DEFINES; scripts/timeline.py --prep
// reads it): in a profiled step, consumer thread 0 stamps the profile's two extra words of a
// mat-vec instruction (the loader's otherwise) when its prepare starts and when its own inputs
// have settled (prepare_normed_small, copy_in; AttnReduce: its maxes, sums and first values),
// splitting an instruction's wait for its inputs from the work around it.
#ifndef MK_PREP_STAMPS
#define MK_PREP_STAMPS 0
#endif
// MK_TILE_STAMPS=1 (for measuring, the same way): consumer thread 0 stamps the two extra words
// of a mat-vec instruction when its first page wait returned and when its own warp finished
// its tiles, splitting the tiles' time (prepared to tiles) into the wait for the first page,
// the warp's own work and the wait for the other warps. MK_TILE_SKIP_DOT=1 (with it, for
// measuring only: the results are garbage) leaves the dot products out of the tiles;
// MK_TILE_SKIP_DOT=2 out of the O projection's tiles only (current_op, below).
#ifndef MK_TILE_STAMPS
#define MK_TILE_STAMPS 0
#endif
#ifndef MK_TILE_SKIP_DOT
#define MK_TILE_SKIP_DOT 0
#endif
#if MK_TILE_SKIP_DOT == 2
#define TILE_SKIP_DOT (current_op() == OP_OPROJ)
#else
#define TILE_SKIP_DOT (MK_TILE_SKIP_DOT != 0)
#endif
// MK_SMP_STAMPS=1 (for measuring, the same way): in a launch that draws inside it, each
// LM-head block's consumer thread 0 stamps extra word 1 when it has the vocabulary's maximum
// (pure temperature: its best score), and the drawing SM stamps its last instruction's extra
// word 2 when the token is drawn (ops/sample.cuh).
#ifndef MK_SMP_STAMPS
#define MK_SMP_STAMPS 0
#endif
// MK_SMP_WARM=1 (measuring, with MK_SMP_STAMPS): the drawing SM draws twice, keeping only the
// second, and stamps extra word 1 between them.
#ifndef MK_SMP_WARM
#define MK_SMP_WARM 0
#endif
#if MK_PREP_STAMPS || MK_TILE_STAMPS || MK_SMP_STAMPS
__shared__ u64* mk_prof;  // the current instruction's profile words
#define PREP_SET_PROF(prof) (mk_prof = (prof))
__device__ __forceinline__ void thread0_stamp(int w) {
    if (threadIdx.x == 32 && mk_prof) mk_prof[w] = global_ns();
}
#else
#define PREP_SET_PROF(prof) ((void)0)
__device__ __forceinline__ void thread0_stamp(int) {}
#endif
__device__ __forceinline__ void prep_stamp(int w) {
    if (MK_PREP_STAMPS) thread0_stamp(w);
}
__device__ __forceinline__ void tile_stamp(int w) {
    if (MK_TILE_STAMPS) thread0_stamp(w);
}
__device__ __forceinline__ void smp_stamp(int w) {
    if (MK_SMP_STAMPS) thread0_stamp(w);
}

__device__ __forceinline__ bool aborted(const MkParams& p) { return *(volatile u32*)p.error != 0; }

__device__ __noinline__ void raise_error(const MkParams& p, u32 kind, u32 instr, u32 what, u32 expected, u32 seen) {
    if (atomicCAS(p.error, 0u, 1u) == 0u) {
        p.error[1] = blockIdx.x; p.error[2] = instr; p.error[3] = what; p.error[4] = expected; p.error[5] = seen;
        p.error[6] = kind;
        __threadfence();
    }
}

// ---- tagged activations ----
// Every value one instruction hands to another is a 64-bit word: the f32 in the low half and
// the launch's tag (epoch + 1) in the high half, written by one relaxed 64-bit store, which is
// single-copy atomic. A reader takes the value once its tag is this launch's: the data carries
// its own readiness, so no counter, fence or barrier sits between producer and consumer. (A
// release fence would wait for the SM's in-flight weight copies.)

// Set by a consumer thread whose wait timed out; the interpreter stops at its next barrier.
__shared__ u32 mk_failed;
// The instruction the consumers are on, for error reports and the loader's in-flight limit.
__shared__ u32 mk_instr;
// Both are written by one thread while others read them, so every access is volatile (PTX
// treats a volatile load or store as relaxed at system scope: no data race, no stale value
// kept in a register). Only their last value matters, so no ordering beyond that is needed.
__device__ __forceinline__ void set_failed(u32 v) { *(volatile u32*)&mk_failed = v; }
__device__ __forceinline__ bool any_failed() { return *(volatile u32*)&mk_failed != 0; }
// MK_INSTR_ATOMIC=1 makes mk_instr's accesses shared-memory atomics, for compute-sanitizer's
// racecheck, which reports volatile accesses from two warps with no barrier between them as
// hazards; the atomics cost 0.4% a token (BENCHMARKS.md), so runs keep the volatile word.
#if defined(MK_INSTR_ATOMIC) && MK_INSTR_ATOMIC
__device__ __forceinline__ void set_current_instr(u32 v) { atomicExch(&mk_instr, v); }
__device__ __forceinline__ u32 current_instr() { return atomicAdd(&mk_instr, 0u); }
#else
__device__ __forceinline__ void set_current_instr(u32 v) { *(volatile u32*)&mk_instr = v; }
__device__ __forceinline__ u32 current_instr() { return *(volatile u32*)&mk_instr; }
#endif

// The consumers' step: its tag (epoch + step + 1), set by consumer thread 0 between steps,
// behind a barrier. The loader, which may run into the next step, keeps its own count.
__shared__ u32 mk_tag;
__device__ __forceinline__ u32 step_tag() { return mk_tag; }
// Set by consumer thread 0 when the generation ends before the launch's last step: the loader
// stops issuing copies, waits for those in flight and returns.
__shared__ u32 mk_stop;
__device__ __forceinline__ void set_stopping() { *(volatile u32*)&mk_stop = 1; }
__device__ __forceinline__ bool stopping() { return *(volatile u32*)&mk_stop != 0; }
// This SM's last instruction that writes K/V cache rows (~0u: none): SMs that have one publish
// each step of a generation (next_step in megakernel.cu). Read by consumer thread 0 only.
__shared__ u32 mk_kv_last;
// The tagged token word's flag: the generation ends after this token.
#define GEN_STOP 0x80000000u

__device__ __forceinline__ void st_tagged_bits(u64* a, u32 v, u32 tag) {
    asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(a), "l"(((u64)tag << 32) | v) : "memory");
}
__device__ __forceinline__ void st_tagged(u64* a, float v, u32 tag) { st_tagged_bits(a, __float_as_uint(v), tag); }

__device__ __forceinline__ u64 ld_tagged(const u64* a) {
    u64 v;
    asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(a));
    return v;
}

// Waits until the n elements k < n carry this launch's tag (seen(k): the tag element k was
// read with; reload(k) reads it again), re-reading all the stale ones together, so stragglers
// cost one round trip per retry rather than one each. Every consumer thread polls its own
// elements: a gate in front (lane 0 of each warp waiting for one element before the others
// read theirs) would add a round trip to every hop (BENCHMARKS.md, design decisions). Past the
// time limit (or once another SM failed) it reports a stale element, at addr(k) (the first
// error raised wins), and marks the CTA failed.
//
// MK_NO_DEPS=1 (measuring only, garbage results): no wait at all, every instruction takes
// whatever its inputs hold, so a step runs at what the weights' ring and the consumers' own
// work allow without the chain of hops between SMs: the bound the hops are measured against.
// MK_NO_DEPS_OPS=MASK: only the instructions whose op's bit is set (1 << OP_QKV: the hop into
// QKV) skip their waits, to tell the hops' costs apart (the op: `current_op`, below).
#ifndef MK_NO_DEPS
#define MK_NO_DEPS 0
#endif
#ifndef MK_NO_DEPS_OPS
#define MK_NO_DEPS_OPS 0
#endif
// The op of the instruction the consumers are on, for the measuring switches that act on one
// kind (MK_TILE_SKIP_DOT=2, MK_NO_DEPS_OPS): a word per warp, which every thread of the warp
// writes as the instruction starts, so each thread reads its own instruction's op (a single
// word written by one thread can still hold the previous op for warps that are ahead of it).
#if MK_TILE_SKIP_DOT == 2 || MK_NO_DEPS_OPS
#define MK_TRACK_OP 1
__shared__ u32 mk_op[MK_THREADS / 32];
__device__ __forceinline__ void set_current_op(u32 v) {
    mk_op[threadIdx.x >> 5] = v;
    __syncwarp();
}
__device__ __forceinline__ u32 current_op() { return mk_op[threadIdx.x >> 5]; }
#else
#define MK_TRACK_OP 0
#endif
template <int N, typename Seen, typename Reload, typename Addr>
__device__ __forceinline__ void settle_with(const MkParams& p, Seen seen, Reload reload, Addr addr, int n) {
    if constexpr (MK_NO_DEPS) return;
#if MK_NO_DEPS_OPS
    if (const u32 op = current_op(); op < 32 && ((MK_NO_DEPS_OPS) >> op & 1)) return;
#endif
    const u32 tag = step_tag();
    u64 t0 = 0;
    for (int spins = 0;; spins++) {
        bool stale = false;
#pragma unroll
        for (int k = 0; k < N; k++) stale |= k < n && seen(k) != tag;
        if (!stale) return;
        if (spins == 0) {
            t0 = global_ns();
        } else if (spins % 64 == 0 && (aborted(p) || global_ns() - t0 > p.timeout_ns)) {
            // One report, out of line: an unrolled report per element bloats every inlined wait.
            int bad = 0;
            u32 old = 0;
#pragma unroll
            for (int k = N - 1; k >= 0; k--)
                if (k < n && seen(k) != tag) { bad = k; old = seen(k); }
            raise_error(p, ERR_DATA, current_instr(), (u32)(addr(bad) - p.resid_attn), tag, old);
            set_failed(1);
            return;
        }
#pragma unroll
        for (int k = 0; k < N; k++)
            if (k < n && seen(k) != tag) reload(k);
    }
}

// settle_with for the n words addr(k) read into raw.
template <int N, typename Addr>
__device__ __forceinline__ void settle(const MkParams& p, u64* raw, Addr addr, int n) {
    settle_with<N>(
        p, [&](int k) { return (u32)(raw[k] >> 32); }, [&](int k) { raw[k] = ld_tagged(addr(k)); }, addr, n);
}

// A generation's hand-over words (p.gen). Tags are compared by distance, never by order: a
// cleared word (tag 0) must not pass for a tag near the wrap. The token word holds exactly the
// awaited step's tag until every SM has read it (the next token needs every SM's next step);
// an SM's step word may already be one step further (`later` 1).
__device__ __forceinline__ bool gen_tag_ok(u64 v, u32 tag, u32 later) { return (u32)(v >> 32) - tag <= later; }

// Past the time limit, or once the generation stops or another SM failed: reports a stall
// (ERR_STEP, naming `what`: an SM whose step is awaited, or GEN_WHAT_TOKEN) and returns true.
__device__ bool gen_wait_over(const MkParams& p, u64& t0, int spins, u32 what, u32 tag, u64 v) {
    if (spins == 0) {
        t0 = global_ns();
        return false;
    }
    if (spins % 64 != 0) return false;
    if (aborted(p) || stopping()) return true;
    if (global_ns() - t0 > p.timeout_ns) {
        raise_error(p, ERR_STEP, current_instr(), what, tag, (u32)(v >> 32));
        return true;
    }
    return false;
}

// In a generation, a step's attention reads K/V rows that earlier steps of the launch wrote,
// through bulk copies that do not wait for tags. Each SM that writes K/V rows publishes a step
// when it has finished it, behind a release fence (gen[1 + sm], see next_step in
// megakernel.cu); before the loader stages a tile holding a row step j wrote, it waits until
// every such SM has published step j, acquires that, and orders the async proxy's reads after
// it. Only the newest row (the step before this one) can make it wait: the SMs publish about
// when that step's token appears; older rows were checked a step earlier. This wait is what
// is left of the gap between tokens in a generation (BENCHMARKS.md). Out of line: it runs once a step at most, and inlined into the loader's loop it
// cost every step ~4 µs on SmolLM2 even where it never ran (BENCHMARKS.md). False once the
// generation stops or a wait fails.
__device__ __noinline__ bool rows_of_step_ready(const MkParams& p, u32 step) {
    if constexpr (MK_NO_DEPS) return true;
    const int lane = threadIdx.x & 31;
    constexpr int PER_LANE = 8;  // up to 256 SMs
    u32 mine = 0;                // this lane's SMs that write K/V rows (bit k: SM lane + 32 k)
#pragma unroll
    for (int k = 0; k < PER_LANE; k++) {
        const int sm = lane + 32 * k;
        if (sm < (int)gridDim.x && p.kv_last[sm] != ~0u) mine |= 1u << k;
    }
    // A word holds step j's tag, epoch + j + 1, once the SM finished step j of this launch.
    // Compared by distance from the epoch, so a cleared word or an earlier launch's tag never
    // passes (the host keeps epoch + steps below the tag's wrap).
    auto done = [&](u64 v) {
        const u32 d = (u32)(v >> 32) - p.epoch;
        return d >= step + 1 && d <= p.steps;
    };
    // Polled relaxed, every word at once; then read once more with acquire semantics.
    u64 t0 = 0;
    for (int spins = 0;; spins++) {
        u64 v[PER_LANE], seen = 0;
        u32 stale_sm = ~0u;
#pragma unroll
        for (int k = 0; k < PER_LANE; k++)
            if (mine >> k & 1) v[k] = ld_tagged(p.gen + 1 + lane + 32 * k);
#pragma unroll
        for (int k = 0; k < PER_LANE; k++)
            if ((mine >> k & 1) && !done(v[k])) { stale_sm = lane + 32 * k; seen = v[k]; }
        if (!__any_sync(0xffffffffu, stale_sm != ~0u)) break;
        if (gen_wait_over(p, t0, spins, stale_sm, p.epoch + step + 1, seen)) return false;
    }
#pragma unroll
    for (int k = 0; k < PER_LANE; k++)
        if (mine >> k & 1) {
            u64 v;
            asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p.gen + 1 + lane + 32 * k) : "memory");
        }
    __syncwarp();
    asm volatile("fence.proxy.async.global;" ::: "memory");
    return true;
}

__device__ __forceinline__ float tagged_float(u64 raw) { return __uint_as_float((u32)raw); }

__device__ __forceinline__ float ld_value(const MkParams& p, const u64* a) {
    u64 raw = ld_tagged(a);
    settle<1>(p, &raw, [&](int) { return a; }, 1);
    return tagged_float(raw);
}

// The loader's per-tile progress word (slot 3, named in a stall's report): off by default,
// since a store per tile lengthens the loader's loop, which bounds streaming when tiles are
// small; MK_TILE_NOTES=1 adds it back when a stall's report should name the loader's tile.
#ifndef MK_TILE_NOTES
#define MK_TILE_NOTES 0
#endif
__device__ __forceinline__ void note(const MkParams& p, int slot, u32 v) {
    *(volatile u32*)(p.progress + blockIdx.x * 4 + slot) = v;
}

// MK_PAGE_SPIN (measuring): page waits poll with mbarrier.test_wait, which never suspends
// the thread, instead of try_wait, which may: 1 every page wait, 2 the loader's, 3 the
// consumers'. Any bound on the loader's tiles in flight below the ring (a wait for a copy to
// land) cost Llama-3.2-3B 8.5% whatever the bound, 6 as 11 (BENCHMARKS.md, 2026-11-29), which a
// late wake-up from a suspended wait on a barrier the copies complete would explain;
// `scripts/mbar-wake.cu` times the two waits alone.
#ifndef MK_PAGE_SPIN
#define MK_PAGE_SPIN 0
#endif
__device__ __forceinline__ bool page_ready(u64* bar, u32 parity, u32 kind) {
    const bool spin = MK_PAGE_SPIN == 1 || (MK_PAGE_SPIN == 2 && kind == ERR_PAGE_LOADER) ||
                      (MK_PAGE_SPIN == 3 && kind == ERR_PAGE_CONSUMER);
    return spin ? mbar_test_wait(bar, parity) : mbar_try_wait(bar, parity);
}

// Waits for an mbarrier phase; past the time limit (or once another SM failed) it reports
// and gives up, so a pipeline bug is an error, never a hung GPU.
__device__ bool page_wait(const MkParams& p, u64* bar, u32 parity, u32 kind, u32 instr, u32 tile) {
    if (page_ready(bar, parity, kind)) return true;
    const u64 t0 = global_ns();
    for (int spins = 1;; spins++) {
        if (page_ready(bar, parity, kind)) return true;
        // Checked at every spin (a shared-memory word): a try_wait may suspend the thread for
        // microseconds, and when a generation stops early the loader is waiting for pages of
        // a step no consumer will run, so the launch ends only once it sees the stop.
        if (stopping()) return false;
        if (spins % ABORT_CHECK_SPINS == 0) {
            if (aborted(p)) return false;
            if (global_ns() - t0 > p.timeout_ns) {
                raise_error(p, kind, instr, tile, parity, 0);
                return false;
            }
        }
    }
}

// ---- weight formats ----
// Each kind of matrix has one storage format, fixed when the kernel is compiled (MK_WT_*, from
// the host's MatrixFormats in src/gpu/sources.rs; quant/decode.cuh's WEIGHT_* codes), so the
// tiles' loop compiles to the formats the model has. A quantised matrix is stored row by row
// (decode.cuh): a row's quants, its blocks' scales, zeros to 16 bytes. A whole row is copied
// into its slot of a page in one piece; a down-projection chunk (part of a row) as its quants
// and then its scales, copied from the 16-byte boundary at or below them (bulk copies move
// 16-byte units), so the consumers find them at the same offset within 16 bytes (the same for
// every row: rows are multiples of 16 bytes long).
#ifndef MK_WT_QKV
#define MK_WT_QKV WEIGHT_BF16
#endif
#ifndef MK_WT_O
#define MK_WT_O WEIGHT_BF16
#endif
#ifndef MK_WT_GU
#define MK_WT_GU WEIGHT_BF16
#endif
#ifndef MK_WT_DOWN
#define MK_WT_DOWN WEIGHT_BF16
#endif
#ifndef MK_WT_LM
#define MK_WT_LM WEIGHT_BF16
#endif
#ifndef MK_WT_EMB
#define MK_WT_EMB WEIGHT_BF16
#endif
// A kind's format may also differ between layers (a GGUF file's K-quant mix): MK_WT_MIXED is
// then the mask (bit = format code) of the formats its layers' q/k/v, output, gate/up and down
// matrices have, and the host tags each of those pointers in the layer table with its
// matrix's format in the low three bits, two in a kernel without Q6_K (Q_HAS_Q6K; device
// allocations are 256-byte aligned, so they are otherwise zero): layer_wt and layer_mat read
// the tag and the pointer. Without mixed layers the kernel is compiled with the kinds' formats
// as constants, as before.
#ifndef MK_WT_MIXED
#define MK_WT_MIXED 0
#endif
#define MK_WT_USED(t)                                                                                       \
    (MK_WT_QKV == (t) || MK_WT_O == (t) || MK_WT_GU == (t) || MK_WT_DOWN == (t) || MK_WT_LM == (t) || \
     ((MK_WT_MIXED >> (t)) & 1))
#define MK_ANY_QUANT \
    (MK_WT_USED(WEIGHT_Q8_0) || MK_WT_USED(WEIGHT_Q4_0) || MK_WT_USED(WEIGHT_Q4_1) || MK_WT_USED(WEIGHT_Q6_K))

// The format of a layer's matrix `m` (a layer table pointer) whose kind was compiled as
// `kind` (see MK_WT_MIXED), and the pointer itself.
__device__ __forceinline__ int layer_wt(const bf16_t* m, int kind) {
#if MK_WT_MIXED
    return (int)((size_t)m & (Q_HAS_Q6K ? 7 : 3));
#else
    return kind;
#endif
}
__device__ __forceinline__ const bf16_t* layer_mat(const bf16_t* m) {
#if MK_WT_MIXED
    return (const bf16_t*)((size_t)m & ~(size_t)(Q_HAS_Q6K ? 7 : 3));
#else
    return m;
#endif
}

// Bytes of `cols` columns' values (bf16) or quants, and of their block scales.
__device__ __forceinline__ constexpr int wt_qbytes(int wt, int cols) {
    return wt == WEIGHT_BF16 ? 2 * cols : q_quant_bytes(wt, cols);
}
__device__ __forceinline__ constexpr int wt_sbytes(int wt, int cols) {
    return wt == WEIGHT_BF16 ? 0 : q_scale_bytes(wt, cols);
}
// A stored row of `cols` columns (decode.cuh's layout; bf16 rows are their values).
__device__ __forceinline__ constexpr int wt_row(int wt, int cols) {
    return wt == WEIGHT_BF16 ? 2 * cols : q_row_bytes(wt, cols);
}
// A chunk's slot in a page: its quants, then room for its scales at any offset within 16 bytes.
__device__ __forceinline__ constexpr int wt_chunk_slot(int wt, int cols) {
    return wt == WEIGHT_BF16 ? 2 * cols : q_row_bytes(wt, cols) + 16;
}

// Where a weight row segment is in global memory: its values or quants, and its scales (null
// for bf16).
struct WRow {
    const unsigned char* q;
    const unsigned char* s;
};

// Row `row` of a matrix of `cols` columns, from column col0 (a multiple of 32 when quantised).
__device__ __forceinline__ WRow wrow(int wt, const void* mat, size_t row, int cols, int col0) {
    const unsigned char* r = (const unsigned char*)mat + row * wt_row(wt, cols);
    if (wt == WEIGHT_BF16) return {r + 2 * col0, nullptr};
    return {r + wt_qbytes(wt, col0), r + wt_qbytes(wt, cols) + wt_sbytes(wt, col0)};
}

// The 16-byte-aligned span the loader copies for a chunk's scales at s of `bytes` bytes.
__device__ __forceinline__ const unsigned char* scales_from(const unsigned char* s) {
    return (const unsigned char*)((size_t)s & ~(size_t)15);
}
__device__ __forceinline__ u32 scales_span(const unsigned char* s, int bytes) {
    return (u32)((((size_t)s + bytes + 15) & ~(size_t)15) - ((size_t)s & ~(size_t)15));
}

// A mat-vec instruction's weight rows, their length, rows per tile and tiles (all 0 for the
// others), its matrix's format, the bytes of a row's quants and of its slot in a page, whether
// its rows are whole (copied in one piece) and where their scales sit in the slot. The
// consumers work it out when an instruction starts, before they wait for its inputs: between
// the inputs and the tiles (its switches) it would sit on the critical path of every
// instruction. The rows a tile and the tiles are the host's, read from the instruction.
// soff: the scales' offset from the quants' end in a row's slot (see "weight formats").
struct TileGeom {
    int n, cols, rpt, tiles, wt, qbytes, slot, whole, soff;
};

// ---- loader warp ----

// Before issuing tile seq the loader waits for tile seq - MK_INFLIGHT to land, bounding the
// bytes each SM has queued in the memory system. A whole ring in flight on every SM keeps HBM
// no busier but queues the activations on the critical path behind it. While the consumers
// work on the very instruction being loaded, they wait for its tiles and nothing else of this
// SM is on the critical path: up to MK_INFLIGHT_STREAM then. (The limits were chosen by
// measurement: BENCHMARKS.md, design decisions.)
#ifndef MK_INFLIGHT
#define MK_INFLIGHT 2
#endif
#ifndef MK_INFLIGHT_STREAM
#define MK_INFLIGHT_STREAM 4
#endif
// Attention's K/V tiles may take their own limits (for measuring; the defaults are the weights').
#ifndef MK_INFLIGHT_ATT
#define MK_INFLIGHT_ATT MK_INFLIGHT
#endif
#ifndef MK_INFLIGHT_ATT_STREAM
#define MK_INFLIGHT_ATT_STREAM MK_INFLIGHT_STREAM
#endif
// MK_WEIGHTS_WHOLE_RING=1 (the host's choice on fast memory, KernelSpec::whole_ring): the
// weights' tiles are issued as soon as their page is free, ahead or streaming; attention's K/V
// tiles keep the limits above. With 2 tiles ahead the ring refills during a layer's chain of
// waits at about 2 tiles a memory latency, by estimate near an SM's share of an H100's
// bandwidth (where the whole ring was slower: the activations queued behind it) and half of an
// H200's (where it was faster on most shapes: BENCHMARKS.md).
#ifndef MK_WEIGHTS_WHOLE_RING
#define MK_WEIGHTS_WHOLE_RING 0
#endif
#if MK_WEIGHTS_WHOLE_RING
#define MK_W_AHEAD 0xffffffffu
#define MK_W_STREAM 0xffffffffu
#else
#define MK_W_AHEAD MK_INFLIGHT
#define MK_W_STREAM MK_INFLIGHT_STREAM
#endif
template <u32 AHEAD = MK_W_AHEAD, u32 STREAM = MK_W_STREAM>
__device__ __forceinline__ bool inflight_wait(const MkParams& p, u64* full, u32 seq, u32 instr) {
    const u32 limit = current_instr() == instr ? STREAM : AHEAD;
    if (limit >= (u32)MK_RING(p) || seq < limit) return true;
    const u32 s = seq - limit;
    return page_wait(p, &full[s % MK_RING(p)], (s / MK_RING(p)) & 1, ERR_PAGE_LOADER, instr, s);
}

// ---- consumer helpers (ct = consumer thread index, cw = consumer warp index) ----

__device__ __forceinline__ void consumers_sync() { named_sync(1, CONSUMERS); }
// A consumer barrier that tells every consumer whether any consumer's wait failed.
__device__ __forceinline__ bool consumers_failed() { return named_sync_or(1, CONSUMERS, any_failed()); }

// The (value, index) that wins over all consumer threads (argmax_merge), in consumer thread 0;
// red holds 2 * CONSUMER_WARPS words.
__device__ __forceinline__ void consumers_argmax(float& v, u32& idx, float* red) {
    const int ct = threadIdx.x - 32, cw = ct >> 5;
    warp_argmax(v, idx);
    u32* redi = (u32*)(red + CONSUMER_WARPS);
    if ((ct & 31) == 0) { red[cw] = v; redi[cw] = idx; }
    consumers_sync();
    if (ct == 0)
        for (int k = 1; k < CONSUMER_WARPS; k++) argmax_merge(v, idx, red[k], redi[k]);
}

// Each consumer warp's share of a sum, for rms_scale to add up after a later barrier.
__device__ __forceinline__ void consumers_partial_sum(float v, float* ss) {
    v = warp_sum(v);
    if ((threadIdx.x & 31) == 0) ss[(threadIdx.x - 32) >> 5] = v;
}

// Copies n tagged values into shared memory as floats, every read of a thread's batch issued
// before it waits on any of them. A batch is at most 8 a thread, and no more than the longest
// input the kernel copies (O-proj's q_dim, a down-projection chunk) needs: this code runs once
// per instruction, and unrolled further than used it is only longer to fetch (SmolLM2, 6
// instead of 8: 1.1% a token, BENCHMARKS.md).
#ifdef MK_DOWN_COLS
#define COPY_LONGEST (MK_DOWN_COLS > MK_Q_DIM ? MK_DOWN_COLS : MK_Q_DIM)
#else
#define COPY_LONGEST (MK_HIDDEN > MK_Q_DIM ? MK_HIDDEN : MK_Q_DIM)
#endif
#ifndef COPY_MAX
#define COPY_MAX ((COPY_LONGEST + CONSUMERS - 1) / CONSUMERS < 8 ? (COPY_LONGEST + CONSUMERS - 1) / CONSUMERS : 8)
#endif
__device__ void copy_in(const MkParams& p, float* dst, const u64* src, int n) {
    const int ct = threadIdx.x - 32;
    for (int i0 = 0; i0 < n; i0 += COPY_MAX * CONSUMERS) {
        u64 raw[COPY_MAX];
#pragma unroll
        for (int k = 0; k < COPY_MAX; k++) {
            const int i = i0 + ct + k * CONSUMERS;
            raw[k] = i < n ? ld_tagged(src + i) : 0;
        }
        const int first = i0 + ct, mine = n > first ? (n - first + CONSUMERS - 1) / CONSUMERS : 0;
        settle<COPY_MAX>(p, raw, [&](int k) { return src + first + k * CONSUMERS; }, mine);
        if (i0 == 0) prep_stamp(PROF_EXTRA2);
#pragma unroll
        for (int k = 0; k < COPY_MAX; k++)
            if (k < mine) dst[first + k * CONSUMERS] = tagged_float(raw[k]);
    }
}

// A warp covers columns c0 + 512 i of every row (c0: its lane's 8 columns within its half of a
// 512-column step). With rows of at most MK_X_REG_STEPS steps (defined below), x stays in
// registers for all the tiles of an instruction and the tiles' loop reads only weights from
// shared memory: x read there as well doubles the shared-memory traffic, which the short
// instructions of the small models feel.
//
// Quantised rows, two ways (MK_XQ selects per format):
// - Decoded to f32 (the 8-column lanes above): a lane's 8 columns are a quarter of a 32-column
//   block (one scale). Q8_0's are its 8 bytes at the columns' offset; Q4_0's and Q4_1's the 4
//   bytes at half the offset, which hold (GGUF's nibble order, decode.cuh) the block's elements
//   4t..4t+3 in their low nibbles and 16+4t..16+4t+3 in their high ones (t the quarter): that
//   lane's x is those 8. Three instructions per weight (byte permute, bias, FMA) and a row's
//   overhead (its warp reduction) for a quarter of a bf16 row's bytes bound the tiles by
//   instruction issue, far below the memory bandwidth.
// - Integer products over digits (block lanes): a lane takes whole 32-column blocks (a warp
//   1024 columns a step, a pair 2048), its quants in one or two 16-byte loads and its scale in
//   one, and the products are dp4a (four int8 products and their sum in one instruction) over
//   two int8 digits of the inputs: x = s (256 h + l), h = round(x 127 / max|x|) over the block
//   and l the rounded remainder in 256ths. The digits hold x to 1/65,000 of the block's largest
//   input (bf16 would round each to 1/256 of itself) and Σ q x = s Σ q (256 h + l) is exact in
//   int32.

// Which rows take block lanes (MK_XQ: 0 none; 2 every quantised row; 1, unless set, quantised
// rows of a known length that is a multiple of 2048 columns (a step of a warp pair: every lane
// busy), or longer than 2048 in a model at least 2048 wide); the others decode every weight to
// f32 and keep the inputs exact. Measured on the H100 (BENCHMARKS.md), with the digits made
// once per instruction: block lanes on the longer rows make Llama-3.2-3B Q4_0 (3072 columns)
// 13%, Qwen3-4B (2560) 13% and Qwen2.5-7B (3584) 15% faster than f32 decode; on the small
// models, whose instructions have few rows to spread the digits over, they made Qwen3-0.6B's
// down projection (3072 columns, 8 rows an instruction) 2% slower, and rows shorter than 2048
// keep lanes idle (SmolLM2's 576: 18 busy lanes of 64, 3% slower). The digits' error is that
// of the inputs to 1/65,000 of their block's largest, amplified like any other rounding: the
// tiny random models' logits move by ~1e-3 (2.5e-5 with exact inputs).
#ifndef MK_XQ
#define MK_XQ 1
#endif
// COLS: the rows' length, 0 when not known at compile time.
template <int WT, int COLS>
__device__ __forceinline__ constexpr bool block_lanes() {
    return WT != WEIGHT_BF16 &&
           (MK_XQ == 2 || (MK_XQ == 1 && COLS > 0 && (COLS % 2048 == 0 || (COLS > 2048 && MK_HIDDEN >= 2048))));
}
// Columns per lane per step, and per step of a warp pair.
template <bool BL>
__device__ __forceinline__ constexpr int lane_cols() {
    return BL ? 32 : 8;
}

// Where the lane's x for weight column c (a multiple of 8) lies in xs (8-column lanes): its
// first four at lo, the other four at lo + hi_off.
template <int WT>
__device__ __forceinline__ int x_lo(int c) {
    return WT == WEIGHT_Q4_0 || WT == WEIGHT_Q4_1 || WT == WEIGHT_Q6_K ? (c & ~31) + ((c >> 1) & 12) : c;
}
template <int WT>
__device__ __forceinline__ constexpr int x_hi_off() {
    return WT == WEIGHT_Q4_0 || WT == WEIGHT_Q4_1 || WT == WEIGHT_Q6_K ? 16 : 4;
}

// A block's 32 inputs as digits (see above): h[m] and l[m] the digits of inputs 4m..4m+3, four
// int8 to a word; s the block's scale over 256; sum the term the format adds per row (Q4_0:
// -8 Σ (256 h + l), for its quants' offset of 8; Q4_1: s Σ (256 h + l), for its minimum).
// Q6_K, whose halves have their own scales and whose quants are offset by 32: the integers
// Σ (256 h + l) over inputs 0..15 in sum's bits and over 16..31 in sh.
struct XB {
    int h[8], l[8];
    float s, sum;
    int sh;
};

// 1.5 * 2^23: a float below 2^22 in magnitude plus this is rounded to an integer, which its low
// mantissa bits then hold in two's complement.
#define Q_MAGIC 12582912.f

__device__ __forceinline__ int pack_low_bytes(u32 a, u32 b, u32 c, u32 d) {
    return (int)__byte_perm(__byte_perm(a, b, 0x0040), __byte_perm(c, d, 0x0040), 0x5410);
}

// Block lanes read their inputs as digits, made once per instruction (digitize_xs) in place of
// the floats: block b's 72 bytes (h[0..3], h[4..7], l[0..3], l[4..7], then s and sum) take five
// of the eight 16-byte slots of the block's own 128 bytes of xs, slot j at (j + b) % 8, so the
// eight lanes of a quarter warp, which read consecutive blocks, read different banks. Each
// lane digitising its own blocks at every step, as before, cost a few hundred instructions
// per block on the critical path of every instruction (BENCHMARKS.md).
template <int WT>
__device__ __forceinline__ XB xb_at(const float* xs, int b) {
    const uint4* r = (const uint4*)(xs + 32 * b);
    const int sw = b & 7;
    const uint4 h0 = r[sw], h1 = r[(sw + 1) & 7], l0 = r[(sw + 2) & 7], l1 = r[(sw + 3) & 7];
    float2 ss;
    int sh = 0;
    if constexpr (WT == WEIGHT_Q6_K) {
        const float4 s4 = *(const float4*)&r[(sw + 4) & 7];
        ss = make_float2(s4.x, s4.y);
        sh = __float_as_int(s4.z);
    } else {
        ss = *(const float2*)&r[(sw + 4) & 7];
    }
    return {{(int)h0.x, (int)h0.y, (int)h0.z, (int)h0.w, (int)h1.x, (int)h1.y, (int)h1.z, (int)h1.w},
            {(int)l0.x, (int)l0.y, (int)l0.z, (int)l0.w, (int)l1.x, (int)l1.y, (int)l1.z, (int)l1.w},
            ss.x,
            ss.y,
            sh};
}

// The digits of block b of xs for a lane whose block may lie past the row's end (zeros there).
template <int WT>
__device__ __forceinline__ XB xb_or_zero(const float* xs, int b, bool in) {
    return in ? xb_at<WT>(xs, b) : XB{{0, 0, 0, 0, 0, 0, 0, 0}, {0, 0, 0, 0, 0, 0, 0, 0}, 0.f, 0.f, 0};
}

// xs[0, cols) (cols a multiple of 32) to digits, in place, by every consumer thread: four
// threads a block, 8 inputs each, the block's maximum and sum over the four by shuffles. A
// block's floats are read only by its own four lanes before they overwrite them, so a warp
// barrier suffices between the two; the caller's consumers_sync publishes the digits.
template <int WT>
__device__ __forceinline__ void digitize_xs(float* xs, int cols) {
    const int ct = threadIdx.x - 32, j = ct & 3, nb = cols >> 5;
    // The loop runs the same number of times on every lane of a warp (the shuffles need them
    // all): a warp takes 8 blocks a pass.
    for (int b0 = (ct >> 5) * 8; b0 < nb; b0 += CONSUMERS / 4) {
        const int b = b0 + ((ct & 31) >> 2);
        const bool in = b < nb;
        // A lane past the row's end reads nothing: another warp may be writing the digits of
        // any block it could read.
        const float4* src = (const float4*)(xs + 32 * b + 8 * j);
        const float4 z4 = make_float4(0.f, 0.f, 0.f, 0.f), v0 = in ? src[0] : z4, v1 = in ? src[1] : z4;
        const float x[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
        float m = 0.f;
#pragma unroll
        for (int k = 0; k < 8; k++) m = fmaxf(m, fabsf(x[k]));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
        const float inv = m > 0.f ? 127.f / m : 0.f;
        u32 hw[2], lw[2];
        float sum = 0.f;
        // The _rn intrinsics keep the compiler (fast math) from folding (v + M) - M into v,
        // which would make every remainder 0.
#pragma unroll
        for (int w = 0; w < 2; w++) {
            u32 hb[4], lb[4];
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const float v = __fmul_rn(x[4 * w + k], inv);
                const float th = __fadd_rn(v, Q_MAGIC), h = __fsub_rn(th, Q_MAGIC);
                // The remainder in 256ths, at most 127 (an int8): 128 would need v - h = 0.5.
                const float tl = __fadd_rn(fminf(__fmul_rn(__fsub_rn(v, h), 256.f), 127.f), Q_MAGIC);
                hb[k] = __float_as_uint(th);
                lb[k] = __float_as_uint(tl);
                sum += fmaf(h, 256.f, tl - Q_MAGIC);
            }
            hw[w] = (u32)pack_low_bytes(hb[0], hb[1], hb[2], hb[3]);
            lw[w] = (u32)pack_low_bytes(lb[0], lb[1], lb[2], lb[3]);
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        // Q6_K: inputs 0..15's sum (lanes j = 0, 1 now) and 16..31's (j = 2, 3), as integers.
        const float half_sum = sum;
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const float other_half = sum - half_sum;
        __syncwarp();
        if (in) {
            // This thread's words are h[2j], h[2j + 1] (and l's): slot j / 2, its half j % 2.
            uint4* r = (uint4*)(xs + 32 * b);
            const int sw = b & 7;
            ((uint2*)&r[((j >> 1) + sw) & 7])[j & 1] = make_uint2(hw[0], hw[1]);
            ((uint2*)&r[((j >> 1) + 2 + sw) & 7])[j & 1] = make_uint2(lw[0], lw[1]);
            const float s = m * (1.f / (127.f * 256.f));
            if constexpr (WT == WEIGHT_Q6_K) {
                if (j == 0)
                    *(float4*)&r[(4 + sw) & 7] =
                        make_float4(s, __int_as_float((int)half_sum), __int_as_float((int)other_half), 0.f);
            } else if (j == 0) {
                *(float2*)&r[(4 + sw) & 7] = make_float2(s, WT == WEIGHT_Q4_0 ? -8.f * sum : s * sum);
            }
        }
    }
}

__device__ __forceinline__ int dp4a(int a, int b, int c) {
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// A block lane's quants of row k (of a page's rows `slot` bytes apart) at column c: Q8_0 32
// bytes, Q4 16 (lo).
struct BlockQ {
    uint4 lo, hi;
};
template <int WT>
__device__ __forceinline__ BlockQ block_quants(const unsigned char* rows, int slot, int k, int c) {
    const unsigned char* r = rows + k * slot;
    if (WT == WEIGHT_Q8_0) return {*(const uint4*)(r + c), *(const uint4*)(r + c + 16)};
    return {*(const uint4*)(r + c / 2), make_uint4(0, 0, 0, 0)};
}

// acc += a block's 32 quantised weights (at column c of a row whose scales are at sc) dot its
// inputs' digits.
template <int WT>
__device__ __forceinline__ float block_dot(const BlockQ& w, const XB& x, const unsigned char* sc, int c, float acc) {
    const u32 qw[8] = {w.lo.x, w.lo.y, w.lo.z, w.lo.w, w.hi.x, w.hi.y, w.hi.z, w.hi.w};
    if constexpr (WT == WEIGHT_Q6_K) {
        // The two halves of the block have their own scales: a sum each.
        const unsigned char* h = sc + 12 * (c >> 5);
        const u32 hw[2] = {*(const u32*)(h + 4), *(const u32*)(h + 8)};
        int ah = 0, al = 0, bh = 0, bl = 0;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            // Quants 0..63 are the same bytes signed or not; their offset of 32 is applied
            // once, through the halves' digit sums.
            const uint2 q = q6_top_bits(qw[k], hw[k & 1], k);
            ah = dp4a((int)q.x, x.h[k], ah);
            al = dp4a((int)q.x, x.l[k], al);
            bh = dp4a((int)q.y, x.h[4 + k], bh);
            bl = dp4a((int)q.y, x.l[4 + k], bl);
        }
        const float2 dsc = q6_scales(h);
        const int t0 = ah * 256 + al - 32 * __float_as_int(x.sum), t1 = bh * 256 + bl - 32 * x.sh;
        return fmaf(x.s, fmaf(dsc.x, (float)t0, dsc.y * (float)t1), acc);
    }
    int th = 0, tl = 0;
    if (WT == WEIGHT_Q8_0) {
#pragma unroll
        for (int m = 0; m < 8; m++) {
            th = dp4a((int)qw[m], x.h[m], th);
            tl = dp4a((int)qw[m], x.l[m], tl);
        }
    } else {
        // Word k of the 16 bytes: elements 4k..4k+3 in the low nibbles, 16+4k.. in the high.
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const int lo = (int)(qw[k] & 0x0F0F0F0Fu), hi = (int)((qw[k] >> 4) & 0x0F0F0F0Fu);
            th = dp4a(hi, x.h[4 + k], dp4a(lo, x.h[k], th));
            tl = dp4a(hi, x.l[4 + k], dp4a(lo, x.l[k], tl));
        }
    }
    // |256 th + tl| < 2^24 for Q4 (exact in f32); Q8_0's may round, by 2^-24 of itself.
    const float t = (float)(th * 256 + tl);
    const int b = c >> 5;
    if (WT == WEIGHT_Q8_0) return fmaf(q_f16(*(const q_u16*)(sc + 2 * b)) * x.s, t, acc);
    if (WT == WEIGHT_Q4_0) return fmaf(q_f16(*(const q_u16*)(sc + 2 * b)) * x.s, t + x.sum, acc);
    const u32 dm = *(const u32*)(sc + 4 * b);
    return fmaf(q_f16((q_u16)dm) * x.s, t, fmaf(q_f16((q_u16)(dm >> 16)), x.sum, acc));
}

// One lane's 8 weights of row k (of a page's rows `slot` bytes apart) at column c (8-column
// lanes).
template <int WT>
__device__ __forceinline__ uint4 lane_weights(const unsigned char* rows, int slot, int k, int c) {
    const unsigned char* r = rows + k * slot;
    if (WT == WEIGHT_BF16) return *(const uint4*)(r + 2 * c);
    if (WT == WEIGHT_Q8_0) {
        const uint2 v = *(const uint2*)(r + c);
        return make_uint4(v.x, v.y, 0, 0);
    }
    return make_uint4(*(const u32*)(r + c / 2), 0, 0, 0);
}

// acc += the lane's 8 quantised weights (wv, at column c of a row whose scales are at sc) dot
// its f32 inputs, each weight decoded (formats without digits, see MK_XQ).
template <int WT>
__device__ __forceinline__ float lane_dot_f32(uint4 wv, const float* x, const unsigned char* sc, int c, float acc) {
    const float4 lo = make_float4(x[0], x[1], x[2], x[3]), hi = make_float4(x[4], x[5], x[6], x[7]);
    const int b = c >> 5;
    if constexpr (WT == WEIGHT_Q6_K) {
        const int t = (c >> 3) & 3;
        const unsigned char* h = sc + 12 * b;
        const float2 s = qg_dot_q6(wv.x, *(const u32*)(h + 4 + 4 * (t & 1)), t, lo, hi);
        const float2 dsc = q6_scales(h);
        return fmaf(dsc.x, s.x, fmaf(dsc.y, s.y, acc));
    }
    const float s = qg_dot<WT>(make_uint2(wv.x, wv.y), lo, hi);
    if (WT == WEIGHT_Q4_1) {
        const u32 dm = *(const u32*)(sc + 4 * b);
        const float sx = ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]));
        return fmaf(q_f16((q_u16)dm), s, fmaf(q_f16((q_u16)(dm >> 16)), sx, acc));
    }
    return fmaf(q_f16(*(const q_u16*)(sc + 2 * b)), s, acc);
}

// acc[k] += row k . x over this lane's S steps, x in registers (zero past the row's end, where
// the weights are read at column 0 instead: every load is unconditional, so all of them can be
// in flight at once). sc[k]: row k's scales (unused for bf16).
template <int WT, int R, int S>
__device__ __forceinline__ void dot_rows(const unsigned char* rows, int slot, const unsigned char* const (&sc)[R],
                                         int cols, int c0, const float (&x)[S][8], float* acc) {
#pragma unroll
    for (int i = 0; i < S; i++) {
        const int c = c0 + 512 * i < cols ? c0 + 512 * i : 0;
        uint4 wv[R];
#pragma unroll
        for (int k = 0; k < R; k++) wv[k] = lane_weights<WT>(rows, slot, k, c);
#pragma unroll
        for (int k = 0; k < R; k++) {
            if constexpr (WT == WEIGHT_BF16) acc[k] += dot8(wv[k], x[i]);
            else acc[k] = lane_dot_f32<WT>(wv[k], x[i], sc[k], c, acc[k]);
        }
    }
}

// The same for block lanes, the inputs' digits in registers.
template <int WT, int R, int S>
__device__ __forceinline__ void dot_rows(const unsigned char* rows, int slot, const unsigned char* const (&sc)[R],
                                         int cols, int c0, const XB (&x)[S], float* acc) {
#pragma unroll
    for (int i = 0; i < S; i++) {
        const int c = c0 + 2048 * i < cols ? c0 + 2048 * i : 0;
        BlockQ wv[R];
#pragma unroll
        for (int k = 0; k < R; k++) wv[k] = block_quants<WT>(rows, slot, k, c);
#pragma unroll
        for (int k = 0; k < R; k++) acc[k] = block_dot<WT>(wv[k], x[i], sc[k], c, acc[k]);
    }
}

// The lane's 8 inputs at column c (zero past the row's end; 8-column lanes).
template <int WT>
__device__ __forceinline__ void lane_x(const float* xs, int c, bool in, float (&x)[8]) {
    const int lo = in ? x_lo<WT>(c) : 0;
    *(float4*)x = *(const float4*)(xs + lo);
    *(float4*)(x + 4) = *(const float4*)(xs + lo + x_hi_off<WT>());
#pragma unroll
    for (int j = 0; j < 8; j++) x[j] = in ? x[j] : 0.f;
}

// The same with x read from shared memory, for longer rows (block lanes digitise it at every
// step). MK_XS_UNROLL (for measuring): the bf16 loop's steps unrolled (4 was 1.5-2.6% slower
// than 2 on the H200; 1 tells whether the loop's code size matters, BENCHMARKS.md).
#ifndef MK_XS_UNROLL
#define MK_XS_UNROLL 2
#endif
template <int WT, bool BL, int R>
__device__ __forceinline__ void dot_rows_xs(const unsigned char* rows, int slot, const unsigned char* const (&sc)[R],
                                            int cols, int c0, const float* xs, float* acc) {
    if constexpr (WT == WEIGHT_BF16) {
#pragma unroll MK_XS_UNROLL
        for (int c = c0; c < cols; c += 512) {
            float x[8];
            *(float4*)x = *(const float4*)(xs + c);
            *(float4*)(x + 4) = *(const float4*)(xs + c + 4);
            uint4 wv[R];
#pragma unroll
            for (int k = 0; k < R; k++) wv[k] = lane_weights<WT>(rows, slot, k, c);
#pragma unroll
            for (int k = 0; k < R; k++) acc[k] += dot8(wv[k], x);
        }
    } else if constexpr (!BL) {
#pragma unroll 2
        for (int c = c0; c < cols; c += 512) {
            float x[8];
            lane_x<WT>(xs, c, true, x);
            uint4 wv[R];
#pragma unroll
            for (int k = 0; k < R; k++) wv[k] = lane_weights<WT>(rows, slot, k, c);
#pragma unroll
            for (int k = 0; k < R; k++) acc[k] = lane_dot_f32<WT>(wv[k], x, sc[k], c, acc[k]);
        }
    } else {
        for (int c = c0; c < cols; c += 2048) {
            const XB q = xb_at<WT>(xs, c >> 5);
            BlockQ wv[R];
#pragma unroll
            for (int k = 0; k < R; k++) wv[k] = block_quants<WT>(rows, slot, k, c);
#pragma unroll
            for (int k = 0; k < R; k++) acc[k] = block_dot<WT>(wv[k], q, sc[k], c, acc[k]);
        }
    }
}

// x as a pointer (shared memory) or as registers.
template <typename T>
struct is_ptr {
    static constexpr bool value = false;
};
template <typename T>
struct is_ptr<T*> {
    static constexpr bool value = true;
};

// The warp's sums of R rows (R = 2 or 4) into out[2k] for row k, the rows reduced together:
// the first exchanges split the rows between the lanes (each lane sends the rows its partner
// keeps), so four rows take 6 shuffles and 6 adds instead of 20 and 20, and lane k < R ends
// with a row's total. It pays where a lane's products for a row are few next to the
// reductions: Q4 block lanes (16 bytes of quants a lane and row: Qwen3-4B Q4_0 −1.2%, Llama-1B
// Q4_0 −1.8%) and the small models' bf16 rows (Qwen2.5-0.5B −2.4%, SmolLM2 −2.2%). Q8_0's
// blocks (twice the products) and the small models' f32-decoded rows were 0.3–0.5% slower
// with it, Llama-1B's bf16 rows 0.7% (BENCHMARKS.md). MK_ROW_SCATTER: 0 never, 2 always.
#ifndef MK_ROW_SCATTER
#define MK_ROW_SCATTER 1
#endif
template <int WT, bool BL>
__device__ __forceinline__ constexpr bool row_scatter() {
    return MK_ROW_SCATTER == 2 ||
           (MK_ROW_SCATTER == 1 && ((BL && WT != WEIGHT_Q8_0) || (WT == WEIGHT_BF16 && MK_HIDDEN < 2048)));
}
template <int R>
__device__ __forceinline__ void rows_scatter_to_res(const float (&acc)[R], float* out) {
    static_assert(R == 2 || R == 4, "rows_scatter_to_res: 2 or 4 rows");
    const int lane = threadIdx.x & 31;
    const bool b0 = lane & 1;
    float v;
    int row;
    if constexpr (R == 2) {
        // Even lanes keep row 0, odd lanes row 1.
        v = (b0 ? acc[1] : acc[0]) + __shfl_xor_sync(0xffffffffu, b0 ? acc[0] : acc[1], 1);
        row = lane & 1;
    } else {
        // Even lanes keep rows 0 and 1, odd lanes 2 and 3; then lanes with bit 1 clear keep the
        // first of their two, the others the second.
        const float k0 = (b0 ? acc[2] : acc[0]) + __shfl_xor_sync(0xffffffffu, b0 ? acc[0] : acc[2], 1);
        const float k1 = (b0 ? acc[3] : acc[1]) + __shfl_xor_sync(0xffffffffu, b0 ? acc[1] : acc[3], 1);
        const bool b1 = lane & 2;
        v = (b1 ? k1 : k0) + __shfl_xor_sync(0xffffffffu, b1 ? k0 : k1, 2);
        row = 2 * (lane & 1) + ((lane >> 1) & 1);
    }
#pragma unroll
    for (int o = R; o < 32; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane < R) out[2 * row] = v;
}

// Rows [row0, row0 + R) of a page (the first at `rows`): this warp's sums, reduced over its
// lanes, into res (see tiles_of_format).
template <int WT, bool BL, int R, typename X>
__device__ __forceinline__ void rows_to_res(const unsigned char* rows, const TileGeom& g, int c0, const X& x, float* res,
                                            int row0, int half) {
    const unsigned char* sc[R];
#pragma unroll
    for (int k = 0; k < R; k++) sc[k] = rows + k * g.slot + g.qbytes + g.soff;
    float acc[R];
#pragma unroll
    for (int k = 0; k < R; k++) acc[k] = 0.f;
    if constexpr (is_ptr<X>::value) dot_rows_xs<WT, BL, R>(rows, g.slot, sc, g.cols, c0, x, acc);
    else dot_rows<WT, R>(rows, g.slot, sc, g.cols, c0, x, acc);
    if constexpr (R > 1 && row_scatter<WT, BL>()) {
        rows_scatter_to_res<R>(acc, res + 2 * row0 + half);
    } else {
#pragma unroll
        for (int k = 0; k < R; k++) acc[k] = warp_sum(acc[k]);
        if ((threadIdx.x & 31) == 0)
#pragma unroll
            for (int k = 0; k < R; k++) res[2 * (row0 + k) + half] = acc[k];
    }
}

// Each tile of the warp's group (warp pair), page by page: waits for it, calls rows(page, tile,
// its row count: 0 with MK_TILE_SKIP_DOT), releases it. Released before the rows' reductions
// instead, so that the loader refills it sooner, it gained at most 0.6% and cost SmolLM2 3.8%
// (BENCHMARKS.md, 2026-11-29).
template <typename Rows>
__device__ __forceinline__ bool group_tiles(const MkParams& p, u32 instr, u32 seq, const TileGeom& g,
                                            const bf16_t* pages, u64* full, u64* empty, const Rows& rows) {
    const int ct = threadIdx.x - 32, cw = ct >> 5, lane = ct & 31, grp = cw >> 1;
    for (int t = grp; t < g.tiles; t += TILE_GROUPS) {
        u32 s = seq + t, slot = s % MK_RING(p);
        if (!page_wait(p, &full[slot], (s / MK_RING(p)) & 1, ERR_PAGE_CONSUMER, instr, s)) return false;
        if (t == grp) tile_stamp(PROF_EXTRA1);
        const unsigned char* page = (const unsigned char*)pages + (size_t)slot * PAGE_BYTES;
        rows(page, t, TILE_SKIP_DOT ? 0 : min(g.rpt, g.n - t * g.rpt));
        release_page(&empty[slot], lane);
    }
    tile_stamp(PROF_EXTRA2);
    return true;
}

// Each tile of the warp's group: its rows four at a time (four independent chains), then the
// last two and one. A last three as one chain instead was 3.3% faster on Llama-1B cut to 3
// rows a page (`MEGAINFER_MK_TILE_ROWS=3`) but 0.15% slower on Qwen3-4B, whose 5 KiB rows make
// pages of three (BENCHMARKS.md, 2026-11-29).
template <int WT, bool BL, typename X>
__device__ __forceinline__ bool tiles_to_res(const MkParams& p, u32 instr, u32 seq, const TileGeom& g,
                                             const bf16_t* pages, u64* full, u64* empty, const X& x, float* res) {
    const int ct = threadIdx.x - 32, cw = ct >> 5, lane = ct & 31, half = cw & 1;
    const int c0 = (half * 32 + lane) * lane_cols<BL>();
    return group_tiles(p, instr, seq, g, pages, full, empty, [&](const unsigned char* page, int t, int rows) {
        int r = 0;
        for (; r + 4 <= rows; r += 4) rows_to_res<WT, BL, 4>(page + r * g.slot, g, c0, x, res, t * g.rpt + r, half);
        if (r + 2 <= rows) {
            rows_to_res<WT, BL, 2>(page + r * g.slot, g, c0, x, res, t * g.rpt + r, half);
            r += 2;
        }
        if (r < rows) rows_to_res<WT, BL, 1>(page + r * g.slot, g, c0, x, res, t * g.rpt + r, half);
    });
}

// The tiles with this lane's S steps of xs held in registers (block lanes: their digits).
template <int WT, bool BL, int S>
__device__ __forceinline__ bool tiles_x_in_registers(const MkParams& p, u32 instr, u32 seq, const TileGeom& g,
                                                     const bf16_t* pages, u64* full, u64* empty, const float* xs,
                                                     float* res) {
    const int ct = threadIdx.x - 32, c0 = (((ct >> 5) & 1) * 32 + (ct & 31)) * lane_cols<BL>();
    if constexpr (!BL) {
        float x[S][8];
#pragma unroll
        for (int i = 0; i < S; i++) lane_x<WT>(xs, c0 + 512 * i, c0 + 512 * i < g.cols, x[i]);
        return tiles_to_res<WT, BL>(p, instr, seq, g, pages, full, empty, x, res);
    } else {
        XB q[S];
#pragma unroll
        for (int i = 0; i < S; i++) q[i] = xb_or_zero<WT>(xs, (c0 >> 5) + 64 * i, c0 + 2048 * i < g.cols);
        return tiles_to_res<WT, BL>(p, instr, seq, g, pages, full, empty, q, res);
    }
}

// ---- bf16 rows on the tensor cores (MK_MMA) ----
//
// A batch-1 mat-vec wastes most of an mma, but one mma.sync m16n8k16 takes 256 weights from a
// single ldmatrix, where the CUDA-core path (dot_rows) spends a shared-memory load, eight
// widenings and eight FMAs per lane and 8 weights. That arithmetic is 9-11% of a step on the
// H200 (MK_TILE_SKIP_DOT): the consumers drain a full ring slower than HBM refills it after
// each wait for inputs.
//
// Layout: an mma's A is two weight rows r0, r0 + 1 of the page, each cut into 8 chunks of 16
// columns: A-row m = 8 (row) + j holds chunk j, and B's column n holds x's chunk n, so
// D[m][m % 8] is row (m / 8)'s sum over chunk j and the other 56 entries of each row of D are
// waste. A step covers 128 columns: chunk j's first 8 columns are the step's columns 8j..8j+7,
// its last 8 are 64 + 8j..64 + 8j + 7, so each of ldmatrix's four 8x8 matrices is 128
// contiguous bytes of one row (conflict-free) and B's fragments are x's step in lane order.
// x is split into bf16 high and low parts (x = hi + lo to 2^-17), two mmas per A, so the sums
// keep f32 inputs' precision (the CUDA-core path's); products are exact and accumulate in f32.
// A warp takes its pair's half of the columns, as the CUDA-core path does.
// Off by default, for measuring: on the H200 it was slower than the CUDA-core path (Llama-1B
// 1.4-2.0%, Llama-3.2-3B 3.5%, Llama-3.1-8B 3.3-3.5%, Qwen3-0.6B 12-14%; BENCHMARKS.md,
// 2026-11-28): each tile's sums are a chain of dependent mmas, and turning xs costs the
// instruction a consumer barrier on its critical path.
#ifndef MK_MMA
#define MK_MMA 0
#endif
#ifndef MK_MMA_UNROLL
#define MK_MMA_UNROLL 2
#endif
template <int WT, int COLS>
__device__ __forceinline__ constexpr bool mma_rows() {
    return MK_MMA && WT == WEIGHT_BF16 && COLS % 256 == 0 && COLS <= 4096;
}

// bf16x2 of (a, b), a in the low half, rounded to nearest even (one instruction).
__device__ __forceinline__ u32 bf16x2_rn(float a, float b) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));
    return r;
}
// (a, b) as bf16x2 high parts and the bf16x2 of what they leave (a = hi + lo to 2^-17): the
// operands of an mma that keeps f32 inputs.
__device__ __forceinline__ void split_bf16x2(float a, float b, u32& hi, u32& lo) {
    hi = bf16x2_rn(a, b);
    lo = bf16x2_rn(a - __uint_as_float(hi << 16), b - __uint_as_float(hi & 0xffff0000u));
}

__device__ __forceinline__ void ldsm_x4(const void* p, u32 (&a)[4]) {
    // volatile: the page it reads is only valid after the page wait before it.
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
                 : "r"(smem_addr(p)));
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// xs's floats turned in place into their bf16 high and low parts, a pair of columns' two
// high parts then their two low parts (B fragments, one 8-byte load each), once per
// instruction: unless `fresh` is false, when the previous instruction (same kind and layer)
// turned them (the normed input shared, see megakernel.cu). Held in registers instead, a
// 4096-column row's fragments took 64 of them and the kernel spilled.
__device__ __forceinline__ void mma_ready(float* xs, int cols, bool fresh) {
    if (!fresh) return;
    for (int e = 2 * (threadIdx.x - 32); e < cols; e += 2 * CONSUMERS) {
        const float2 v = *(const float2*)(xs + e);
        uint2 w;
        split_bf16x2(v.x, v.y, w.x, w.y);
        *(uint2*)(xs + e) = w;
    }
    consumers_sync();
}

// This lane's share of rows r0 .. r0 + 2 NG - 1 (rows at `rows`, `slot` bytes apart; ONE: a
// single row, read twice, whose second result is dropped) dotted with its half of x (xw: the
// lane's first B fragments in mma_ready's words): sums over all lanes of acc[k] give row k.
// a_off: the lane's ldmatrix address in a row's step.
template <int S, int NG, bool ONE>
__device__ __forceinline__ void mma_dot_rows(const unsigned char* rows, int slot, int a_row, int a_off,
                                             const uint2* xw, float (&acc)[2 * NG]) {
    const int lane = threadIdx.x & 31, g8 = lane >> 2;
    float dh[NG][4], dl[NG][4];
#pragma unroll
    for (int j = 0; j < NG; j++)
#pragma unroll
        for (int k = 0; k < 4; k++) dh[j][k] = dl[j][k] = 0.f;
    const unsigned char* a0 = rows + (ONE ? 0 : a_row * slot) + a_off;
#pragma unroll MK_MMA_UNROLL
    for (int s = 0; s < S; s++) {
        const uint2 x0 = xw[64 * s], x1 = xw[64 * s + 32];
#pragma unroll
        for (int j = 0; j < NG; j++) {
            u32 a[4];
            ldsm_x4(a0 + 2 * j * slot + 256 * s, a);
            mma_bf16(dh[j], a, x0.x, x1.x);
            mma_bf16(dl[j], a, x0.y, x1.y);
        }
    }
    // D[m][n] sits in lane 4 (m % 8) + n / 2, element (m >= 8 ? 2 : 0) + n % 2: the useful
    // n = m % 8 in lane 4 g + g / 2.
    // (Selects, not dh[j][e]: an array indexed at run time would live in local memory.)
    const bool mine = (lane & 3) == (g8 >> 1), odd = g8 & 1;
#pragma unroll
    for (int j = 0; j < NG; j++) {
        const float r0 = odd ? dh[j][1] + dl[j][1] : dh[j][0] + dl[j][0];
        const float r1 = odd ? dh[j][3] + dl[j][3] : dh[j][2] + dl[j][2];
        acc[2 * j] = mine ? r0 : 0.f;
        acc[2 * j + 1] = mine ? r1 : 0.f;
    }
}

// tiles_to_res on the tensor cores, for rows of COLS columns (mma_rows).
template <int COLS>
__device__ __forceinline__ bool tiles_mma(const MkParams& p, u32 instr, u32 seq, const TileGeom& g,
                                          const bf16_t* pages, u64* full, u64* empty, float* xs, bool fresh,
                                          float* res) {
    constexpr int S = COLS / 256;
    mma_ready(xs, COLS, fresh);
    const int ct = threadIdx.x - 32, cw = ct >> 5, lane = ct & 31, half = cw & 1;
    const int base = half * (COLS / 2);
    const uint2* xw = (const uint2*)(xs + base + 8 * (lane >> 2) + 2 * (lane & 3));
    // ldmatrix: lane L gives row L % 8 of matrix L / 8; matrices 0 and 2 are the first row's
    // step columns 0-7 and 8-15 of each chunk, 1 and 3 the second row's.
    const int q = lane >> 3, a_row = q & 1, a_off = 2 * (base + 64 * (q >> 1) + 8 * (lane & 7));
    return group_tiles(p, instr, seq, g, pages, full, empty, [&](const unsigned char* page, int t, int rows) {
        int r = 0;
        for (; r + 4 <= rows; r += 4) {
            float acc[4];
            mma_dot_rows<S, 2, false>(page + r * g.slot, g.slot, a_row, a_off, xw, acc);
            rows_scatter_to_res<4>(acc, res + 2 * (t * g.rpt + r) + half);
        }
        if (r + 2 <= rows) {
            float acc[2];
            mma_dot_rows<S, 1, false>(page + r * g.slot, g.slot, a_row, a_off, xw, acc);
            rows_scatter_to_res<2>(acc, res + 2 * (t * g.rpt + r) + half);
            r += 2;
        }
        if (r < rows) {
            float acc[2];
            mma_dot_rows<S, 1, true>(page + r * g.slot, g.slot, a_row, a_off, xw, acc);
            const float v = warp_sum(acc[0]);
            if (lane == 0) res[2 * (t * g.rpt + r) + half] = v;
        }
    });
}

// Rows of `cols` columns, a model dimension the kernel is compiled with: x in registers when
// they are at most MK_X_REG_STEPS steps long (block lanes: MK_XQ_REG_STEPS steps of 2048
// columns, 18 registers of digits each), else read from shared memory. Four steps in
// registers suit the small models, whose 2048-column rows are short latency-bound
// instructions (Qwen3-0.6B's O projection: 1.7% slower from shared memory); in models at
// least 2048 wide, whose 2048-column rows include the long LM head and up-gate instructions,
// Llama-1B is 1.1% faster with them read from shared memory (BENCHMARKS.md). The same holds
// for Q4 block lanes' digits there: with one step in registers, so that 2048-column rows (QKV,
// up-gate, O, LM head) read theirs from shared memory, Llama-3.2-3B Q4_0 was 2.0% faster,
// Qwen3-4B and Llama-3.1-8B 0.9%; Llama-1B Q8_0, twice the quants a digit, 1.5% slower.
// bf16 rows of models wider than 2048 and at most 3584 wide keep x in registers up to 8 steps
// (4096 columns: every row those models have, the down projection's chunks too). On the H200,
// Qwen3-4B (2560 wide: 5 steps, which the shared-memory loop's two-step unroll leaves one over)
// decodes 3.2% faster with them, Qwen2.5-7B (3584: 7 steps) 1.2% and Llama-3.2-3B 0.2%; at 2048
// wide Llama-1B was 0.8% faster and Qwen3-1.7B 0.9% slower, so 2048 keeps shared memory, and
// at 4096 Qwen3-8B was level (BENCHMARKS.md, 2026-11-29). MK_X_REG_STEPS_BF16 sets it.
#ifndef MK_X_REG_STEPS
#define MK_X_REG_STEPS (MK_HIDDEN >= 2048 ? 3 : 4)
#endif
#ifndef MK_X_REG_STEPS_BF16
#define MK_X_REG_STEPS_BF16 (MK_HIDDEN > 2048 && MK_HIDDEN <= 3584 ? 8 : MK_X_REG_STEPS)
#endif
template <int WT>
__device__ __forceinline__ constexpr int xq_reg_steps() {
#ifdef MK_XQ_REG_STEPS
    return MK_XQ_REG_STEPS;
#else
    return WT != WEIGHT_Q8_0 && MK_HIDDEN >= 2048 ? 1 : 2;
#endif
}
template <int WT, bool BL>
__device__ __forceinline__ void digits_ready(float* xs, int cols, bool fresh) {
    if constexpr (BL) {
        if (fresh) {
            digitize_xs<WT>(xs, cols);
            consumers_sync();
        }
    }
}

template <int WT, int COLS>
__device__ __forceinline__ bool tiles_of_width(const MkParams& p, u32 instr, u32 seq, const TileGeom& g,
                                               const bf16_t* pages, u64* full, u64* empty, float* xs, bool fresh,
                                               float* res) {
    if constexpr (mma_rows<WT, COLS>()) return tiles_mma<COLS>(p, instr, seq, g, pages, full, empty, xs, fresh, res);
    constexpr bool BL = block_lanes<WT, COLS>();
    constexpr int STEP = 64 * lane_cols<BL>(), S = (COLS + STEP - 1) / STEP;
    digits_ready<WT, BL>(xs, g.cols, fresh);
    if constexpr (S <= (BL ? xq_reg_steps<WT>() : WT == WEIGHT_BF16 ? MK_X_REG_STEPS_BF16 : MK_X_REG_STEPS))
        return tiles_x_in_registers<WT, BL, S>(p, instr, seq, g, pages, full, empty, xs, res);
    else return tiles_to_res<WT, BL>(p, instr, seq, g, pages, full, empty, (const float*)xs, res);
}

// Dot products of the instruction's weight rows (from the paged ring) with xs, for a matrix
// of format WT: the two column halves of row j land in res[2j] and res[2j + 1] (summed in that
// order by res_at). The row length is one of the model's dimensions or a down-projection
// chunk: compile-time branches, not a jump table (an indirect branch here is on the critical
// path). Block lanes turn xs into digits first, unless `fresh` is false: xs is then the one a
// previous instruction of the same kind turned (the normed input shared, see megakernel.cu).
// False when a page wait failed (the error is raised).
template <int WT>
__device__ bool tiles_of_format(const MkParams& p, const TileGeom& g, u32 instr, u32 seq, const bf16_t* pages,
                                u64* full, u64* empty, float* xs, bool fresh, float* res) {
    if (g.cols == MK_HIDDEN)
        return tiles_of_width<WT, MK_HIDDEN>(p, instr, seq, g, pages, full, empty, xs, fresh, res);
    if (g.cols == MK_Q_DIM) return tiles_of_width<WT, MK_Q_DIM>(p, instr, seq, g, pages, full, empty, xs, fresh, res);
#ifdef MK_DOWN_COLS
    if (g.cols == MK_DOWN_COLS)
        return tiles_of_width<WT, MK_DOWN_COLS>(p, instr, seq, g, pages, full, empty, xs, fresh, res);
#endif
    constexpr bool BL = block_lanes<WT, 0>();
    digits_ready<WT, BL>(xs, g.cols, fresh);
    return tiles_to_res<WT, BL>(p, instr, seq, g, pages, full, empty, (const float*)xs, res);
}

__device__ __forceinline__ float res_at(const float* res, int j) { return res[2 * j] + res[2 * j + 1]; }

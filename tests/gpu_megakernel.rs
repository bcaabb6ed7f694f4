//! The megakernel against the CPU reference and the graph baseline. Ignored by a
//! plain `cargo test`; they fail when run without a GPU (tests/common/gpu.rs).

#[path = "common/gpu.rs"]
#[allow(dead_code)]
mod gpu_common;
use gpu_common::{gpu, small_cases, tiny};
use megainfer::reference::rel_l2;

use megainfer::generate::Backend;
use megainfer::gpu::baseline::{BaselinePath, Mode};
use megainfer::gpu::device::Gpu;
use megainfer::gpu::megakernel::{schedule_for, MegakernelPath};
use megainfer::gpu::model::DeviceModel;
use megainfer::gpu::stepping::feed_steps;
use megainfer::model::{presets, random::random_weights, Config, Weights};
use megainfer::reference::CpuForward;
use megainfer::sampling::argmax;
use scheduler::{Op, Schedule};

/// Tolerances: about ten times the teacher-forced relative L2 error of the logits measured on
/// an H100 (docs/testing.md). Each test prints its errors, so a change shows in the log.
///
/// Small random models: measured up to 4.88e-4 (tiny2 at step 2; eager, graph and graph + PDL
/// give the same 4.88e-4 there: bf16 weights and K/V against the f32 reference).
const TOL_SMALL: f64 = 5e-3;
/// Llama-3.2-1B shape, 5 teacher-forced steps: measured 9.38e-4 at step 4 (the worst).
const TOL_LLAMA_1B: f64 = 1e-2;
/// Llama-3.2-1B shape after a 505-position greedy run, every position a megakernel step:
/// measured 1.54e-4.
const TOL_LLAMA_1B_LONG: f64 = 1.5e-3;
/// Attention over 900 positions: measured 3.77e-5 / 3.73e-5 at head_dim 64 (one part / three),
/// 4.18e-5 / 4.25e-5 at head_dim 128.
const TOL_LONG_ATTENTION: f64 = 4e-4;
/// Hidden sizes 2560 and 3584, 3 layers, 5 teacher-forced steps: measured 1.27e-4 and 1.13e-4
/// (the same at every k-chunk count).
const TOL_OVER_ONE_ROUND: f64 = 1.5e-3;

/// The megakernel on `sched` against the CPU reference, token by token: every step within
/// `tol` and with the reference's argmax.
fn teacher_forced(
    gpu: &Gpu,
    cfg: &Config,
    w: &Weights,
    tokens: &[u32],
    sched: &Schedule,
    label: &str,
    tol: f64,
) {
    let dm = DeviceModel::upload(gpu, cfg, w).unwrap();
    let want = CpuForward::new(cfg, w, 64).forward_all(tokens).unwrap();
    let mut mk = MegakernelPath::new(gpu, &dm, sched, 64).unwrap();
    let mut worst = 0f64;
    for (i, t) in tokens.iter().enumerate() {
        let got = mk.feed(&[*t]).unwrap();
        let err = rel_l2(&got, &want[i]);
        worst = worst.max(err);
        println!("{label} megakernel step {i}: rel L2 {err:.2e}");
        assert!(err <= tol, "{label}: step {i} rel L2 {err:.2e} > {tol:.1e}");
        assert_eq!(
            argmax(&got),
            argmax(&want[i]),
            "{label}: step {i} argmax differs"
        );
    }
    println!("{label} megakernel: worst rel L2 {worst:.2e} (tolerance {tol:.1e})");
}

/// The megakernel's schedule of `cfg` on `gpu` at a 64-position context with `overrides`.
fn schedule_with(gpu: &Gpu, cfg: &Config, overrides: scheduler::Overrides) -> Schedule {
    use megainfer::gpu::megakernel::{megakernel_gpu_shape, megakernel_schedule};
    let shape = megakernel_gpu_shape(cfg, gpu.sm_count, gpu.max_smem_per_block);
    let cost = scheduler::CostModel::megakernel(64);
    megakernel_schedule(cfg, &shape, &cost, &overrides).unwrap()
}

#[test]
#[ignore = "needs a GPU"]
fn megakernel_matches_reference_on_small_random_models() {
    let gpu = gpu();
    for (label, cfg, w, tokens) in small_cases() {
        let sched = schedule_for(&cfg, &gpu, 64, None).unwrap();
        teacher_forced(&gpu, &cfg, &w, &tokens, &sched, &label, TOL_SMALL);
        let split = schedule_for(&cfg, &gpu, 64, Some(3)).unwrap();
        let label = format!("{label}-split (3 parts)");
        teacher_forced(&gpu, &cfg, &w, &tokens, &split, &label, TOL_SMALL);
    }
}

#[test]
#[ignore = "needs a GPU"]
fn megakernel_matches_reference_on_llama_1b_shape() {
    let gpu = gpu();
    let cfg = presets::by_name("llama-3.2-1b").unwrap();
    let w = random_weights(&cfg, 7);
    let sched = schedule_for(&cfg, &gpu, 64, None).unwrap();
    let tokens = [128000, 791, 6864, 315, 9822];
    teacher_forced(&gpu, &cfg, &w, &tokens, &sched, "llama-1b", TOL_LLAMA_1B);
}

/// The tokens the wide models' teacher-forced tests feed.
const WIDE_TOKENS: [u32; 5] = [5, 900, 33, 12, 640];

/// Hidden sizes over 2048 (ops/model.cuh, MK_DOWN_CHUNKS): the residual entering a layer read
/// in one round (2560 wide at 3 down-projection k-chunks: 4 sources; 3584 at 1) and in rounds,
/// up-gate's one source in one trip (2560 at 5 k-chunks, 3584 at 2), q/k norms as Qwen3 has
/// them: the Qwen3-4B and Qwen2.5-7B widths, 3 layers, teacher-forced against the CPU
/// reference.
#[test]
#[ignore = "needs a GPU"]
fn megakernel_matches_reference_over_one_round_of_inputs() {
    let gpu = gpu();
    for (hidden, heads, kv, inter, chunks) in
        [(2560, 32, 8, 3072, [3, 5]), (3584, 28, 4, 2560, [1, 2])]
    {
        let mut cfg = tiny(hidden, heads, kv, 128, inter);
        cfg.qk_norm = true;
        let w = random_weights(&cfg, 23);
        // Each k-chunk count, then one RmsQkvRope per SM, heads cut in two to four pieces
        // each, whose raw q and k attention then norms by whole heads
        // (MEGAINFER_MK_QKV_PIECES; the cost model chooses it only without q/k norms).
        let cases = chunks
            .map(|down_chunks| {
                let overrides = scheduler::Overrides {
                    down_chunks: Some(down_chunks),
                    ..Default::default()
                };
                (
                    overrides,
                    format!("hidden {hidden}, {down_chunks} k-chunks"),
                )
            })
            .into_iter()
            .chain(std::iter::once((
                scheduler::Overrides {
                    qkv_pieces: Some(gpu.sm_count),
                    ..Default::default()
                },
                format!("hidden {hidden}, one QKV piece per SM"),
            )));
        for (overrides, label) in cases {
            let sched = schedule_with(&gpu, &cfg, overrides);
            if let Some(down_chunks) = overrides.down_chunks {
                assert_eq!(sched.options.down_chunks, down_chunks);
            }
            if let Some(pieces) = overrides.qkv_pieces {
                assert_eq!(sched.options.qkv_pieces, pieces);
            }
            teacher_forced(
                &gpu,
                &cfg,
                &w,
                &WIDE_TOKENS,
                &sched,
                &label,
                TOL_OVER_ONE_ROUND,
            );
        }
    }
}

/// A model 4096 wide (Llama-3.1-8B's and Qwen3-8B's width), whose kernel with the whole ring
/// (fast memory) also asks L2 for an instruction's first tiles (`MK_L2_PF_NEXT`,
/// src/gpu/megakernel/compile.rs), teacher-forced against the CPU reference.
#[test]
#[ignore = "needs a GPU"]
fn megakernel_matches_reference_at_4096_wide() {
    let gpu = gpu();
    let cfg = tiny(4096, 32, 8, 128, 2048);
    let w = random_weights(&cfg, 29);
    let sched = schedule_with(&gpu, &cfg, scheduler::Overrides::default());
    teacher_forced(
        &gpu,
        &cfg,
        &w,
        &WIDE_TOKENS,
        &sched,
        "hidden 4096",
        TOL_OVER_ONE_ROUND,
    );
}

/// Attention instructions computing a share of a KV head's query heads (`attn_heads`: one
/// head of SmolLM2's three, one and seven of a Qwen2.5-0.5B-like group of seven with QKV
/// biases, one head of two with Qwen3's q/k norms at head_dim 128, whose first share caches
/// the K row), teacher-forced against the CPU reference.
#[test]
#[ignore = "needs a GPU"]
fn megakernel_attention_head_shares_match_reference() {
    let gpu = gpu();
    let mut qwen2 = tiny(896, 14, 2, 64, 1024);
    qwen2.qkv_bias = true;
    let mut qwen3 = tiny(1024, 16, 8, 128, 1024);
    qwen3.qk_norm = true;
    let cases = [
        ("smollm2-shape", tiny(576, 9, 3, 64, 1536), vec![1, 3]),
        ("qwen2-shape", qwen2, vec![1, 7]),
        ("qwen3-shape", qwen3, vec![1]),
    ];
    for (name, cfg, shares) in cases {
        let w = random_weights(&cfg, 31);
        for heads in shares {
            let overrides = scheduler::Overrides {
                attn_heads: Some(heads),
                ..Default::default()
            };
            let sched = schedule_with(&gpu, &cfg, overrides);
            assert_eq!(sched.options.attn_heads, heads);
            let label = format!("{name}, {heads} query heads an instruction");
            let tokens = [5, 900, 33, 12, 640, 7, 81];
            teacher_forced(&gpu, &cfg, &w, &tokens, &sched, &label, TOL_SMALL);
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn megakernel_long_greedy_run_on_llama_1b_shape() {
    let gpu = gpu();
    let cfg = presets::by_name("llama-3.2-1b").unwrap();
    let w = random_weights(&cfg, 9);
    let dm = DeviceModel::upload(&gpu, &cfg, &w).unwrap();
    let sched = schedule_for(&cfg, &gpu, 512, None).unwrap();
    let mut mk = MegakernelPath::new(&gpu, &dm, &sched, 512).unwrap();
    // 500 launches back to back: every page of the pipeline is reused thousands of times. The
    // prompt too goes one megakernel step per token (`feed` would prefill it in a batch).
    let first = argmax(&feed_steps(&mut mk, &[1, 2, 3, 4]).unwrap());
    let toks = mk.decode_greedy(first, 500).unwrap();
    assert_eq!(toks.len(), 500);
    // Teacher-forced check at the end of the long run: position 505.
    let mut cpu = CpuForward::new(&cfg, &w, 512);
    let mut fed = vec![1, 2, 3, 4, first];
    fed.extend_from_slice(&toks[..toks.len() - 1]);
    cpu.forward(&fed).unwrap();
    let got = mk.feed(&[*toks.last().unwrap()]).unwrap();
    let want = cpu.forward(&[*toks.last().unwrap()]).unwrap();
    let err = rel_l2(&got, &want);
    println!("llama-1b after 505 positions: rel L2 {err:.2e} (tolerance {TOL_LLAMA_1B_LONG:.1e})");
    assert!(
        err <= TOL_LLAMA_1B_LONG,
        "rel L2 {err:.2e} > {TOL_LLAMA_1B_LONG:.1e} after a long run"
    );
}

/// Attention stages earlier K/V rows in the page ring: 900 positions are more tiles than the
/// ring holds (64 positions a page at head_dim 64, 32 at 128; 12 pages on an H100), so they are
/// taken a ring's worth at a time, in one part and split in three. In one part the first 192
/// positions are spread over every warp (attention by warps), the rest stream; at head_dim 128
/// three and four query heads a KV head take two head groups (with three, the second holds a
/// head past the group's last, computed and not kept); seven (Qwen2.5-7B's groups) compute by
/// rounds, split in three with a partial output a warp pair.
#[test]
#[ignore = "needs a GPU"]
fn megakernel_attention_longer_than_the_page_ring() {
    let gpu = gpu();
    const LEN: usize = 900;
    for (label, cfg) in [
        ("hd64", tiny(192, 3, 1, 64, 520)),
        ("hd128", tiny(256, 4, 2, 128, 520)),
        ("hd128-g3", tiny(384, 6, 2, 128, 520)),
        ("hd128-g4", tiny(512, 8, 2, 128, 520)),
        ("hd128-g7", tiny(896, 7, 1, 128, 520)),
    ] {
        let w = random_weights(&cfg, 21);
        let dm = DeviceModel::upload(&gpu, &cfg, &w).unwrap();
        let tokens: Vec<u32> = (0..LEN as u32).map(|k| (k * 37 + 5) % 1000).collect();
        let want = CpuForward::new(&cfg, &w, LEN).forward(&tokens).unwrap();
        for parts in [1, 3] {
            let sched = schedule_for(&cfg, &gpu, LEN, Some(parts)).unwrap();
            let mut mk = MegakernelPath::new(&gpu, &dm, &sched, LEN).unwrap();
            // One megakernel step per position: `feed` would prefill them in a batch.
            let got = feed_steps(&mut mk, &tokens).unwrap();
            let err = rel_l2(&got, &want);
            println!(
                "{label} parts={parts} at position {}: rel L2 {err:.2e} (tolerance {TOL_LONG_ATTENTION:.0e})",
                LEN - 1
            );
            assert!(
                err <= TOL_LONG_ATTENTION,
                "{label} parts={parts}: rel L2 {err:.2e} > {TOL_LONG_ATTENTION:.0e}"
            );
        }
    }
}

/// Split-KV with many parts, merged by AttnReduce in batches: 44 parts (one part per SM for 3
/// KV heads), 128 (the most the reduction takes) and 17 (not a multiple
/// of its batch of 16). Every position is a megakernel step from position 0, so early steps
/// have more parts than positions (empty parts: max -inf, sum 0). Logits are compared with the
/// CPU reference at several positions, the last past the page ring.
#[test]
#[ignore = "needs a GPU"]
fn megakernel_split_kv_with_many_parts_matches_reference() {
    let gpu = gpu();
    const LEN: usize = 700;
    let checks = [3usize, 60, 200, LEN - 1];
    for (label, cfg) in [
        ("hd64-g3", tiny(192, 9, 3, 64, 520)),
        ("hd128-g2", tiny(256, 4, 2, 128, 520)),
    ] {
        let w = random_weights(&cfg, 33);
        let dm = DeviceModel::upload(&gpu, &cfg, &w).unwrap();
        let tokens: Vec<u32> = (0..LEN as u32).map(|k| (k * 53 + 11) % 1000).collect();
        let mut cpu = CpuForward::new(&cfg, &w, LEN);
        let mut want = Vec::new();
        let mut fed = 0;
        for &c in &checks {
            want.push(cpu.forward(&tokens[fed..=c]).unwrap());
            fed = c + 1;
        }
        for parts in [17, 44, 128] {
            let sched = schedule_for(&cfg, &gpu, LEN, Some(parts)).unwrap();
            let mut mk = MegakernelPath::new(&gpu, &dm, &sched, LEN).unwrap();
            let mut fed = 0;
            let mut worst = 0f64;
            for (&c, want) in checks.iter().zip(&want) {
                let got = feed_steps(&mut mk, &tokens[fed..=c]).unwrap();
                fed = c + 1;
                let err = rel_l2(&got, want);
                worst = worst.max(err);
                println!("{label} parts={parts} at position {c}: rel L2 {err:.2e}");
                assert!(
                    err <= TOL_LONG_ATTENTION,
                    "{label} parts={parts} at position {c}: rel L2 {err:.2e} > {TOL_LONG_ATTENTION:.0e}"
                );
            }
            println!(
                "{label} parts={parts}: worst rel L2 {worst:.2e} (tolerance {TOL_LONG_ATTENTION:.0e})"
            );
        }
    }
}

/// A path with three context buckets (up to 40 positions whole, up to 150 in 5 parts, then
/// 44 parts) switches streams as the sequence grows, between host-fed steps and inside a run
/// of greedy steps chained on the device. Logits on both sides of each switch match the CPU
/// reference; the greedy tokens are the reference's argmax (or within a near-tie of it).
#[test]
#[ignore = "needs a GPU"]
fn megakernel_switches_context_buckets_mid_generation() {
    let gpu = gpu();
    const LEN: usize = 400;
    let cfg = tiny(192, 9, 3, 64, 520);
    let w = random_weights(&cfg, 45);
    let dm = DeviceModel::upload(&gpu, &cfg, &w).unwrap();
    let plan = [(40usize, 1usize), (150, 5), (LEN, 44)];
    let scheds: Vec<Schedule> = plan
        .iter()
        .map(|&(upto, parts)| schedule_for(&cfg, &gpu, upto, Some(parts)).unwrap())
        .collect();
    let list: Vec<(usize, &Schedule)> = plan.iter().zip(&scheds).map(|(b, s)| (b.0, s)).collect();
    let mut mk = MegakernelPath::with_buckets(&gpu, &dm, &list, LEN).unwrap();
    assert_eq!(
        mk.buckets().0,
        plan.to_vec(),
        "buckets as given (up to, parts)"
    );
    let mut cpu = CpuForward::new(&cfg, &w, LEN);
    let tokens: Vec<u32> = (0..LEN as u32).map(|k| (k * 71 + 3) % 1000).collect();
    let mut worst = 0f64;
    let mut compare = |what: String, got: &[f32], want: &[f32]| {
        let err = rel_l2(got, want);
        worst = worst.max(err);
        println!("buckets: {what}: rel L2 {err:.2e}");
        assert!(
            err <= TOL_LONG_ATTENTION,
            "{what}: rel L2 {err:.2e} > {TOL_LONG_ATTENTION:.0e}"
        );
    };

    // Positions 0..=35 in bucket 0, one step each.
    let got = feed_steps(&mut mk, &tokens[..36]).unwrap();
    compare(
        "position 35 (bucket 0)".into(),
        &got,
        &cpu.forward(&tokens[..36]).unwrap(),
    );
    assert_eq!(mk.buckets().1, 0);

    // Greedy steps chained on the device through positions 36..=59: the switch to bucket 1
    // (at position 40) happens between launches the host queues back to back.
    let first = argmax(&got) as u32;
    let chosen = mk.decode_greedy(first, 24).unwrap();
    assert_eq!(mk.buckets().1, 1, "positions past 40 run bucket 1");
    let mut fed = first;
    for (i, &t) in chosen.iter().enumerate() {
        let want = cpu.forward(&[fed]).unwrap();
        let best = argmax(&want);
        let gap = want[best as usize] - want[t as usize];
        println!(
            "buckets: greedy position {}: token {t}, reference {best} (gap {gap:.2e})",
            36 + i
        );
        assert!(
            best == t || gap <= 1e-3 * want[best as usize].abs().max(1.0),
            "greedy position {}: token {t}, reference argmax {best} ahead by {gap}",
            36 + i
        );
        fed = t;
    }
    // The last chosen token is fed at position 60; then teacher-forced steps across the
    // switch to bucket 2 at position 150, compared on both sides of it.
    let got = feed_steps(&mut mk, &[fed]).unwrap();
    compare(
        "position 60 (bucket 1)".into(),
        &got,
        &cpu.forward(&[fed]).unwrap(),
    );
    let mut pos = 61;
    for end in [148, 149, 150, 151, 260, LEN - 1] {
        let seg = &tokens[pos..=end];
        let got = feed_steps(&mut mk, seg).unwrap();
        let (_, active) = mk.buckets();
        compare(
            format!("position {end} (bucket {active})"),
            &got,
            &cpu.forward(seg).unwrap(),
        );
        assert_eq!(active, if end < 150 { 1 } else { 2 }, "bucket at {end}");
        pos = end + 1;
    }
    println!("buckets: worst rel L2 {worst:.2e} (tolerance {TOL_LONG_ATTENTION:.0e})");
}

#[test]
#[ignore = "needs a GPU"]
fn megakernel_and_graph_agree_on_greedy_tokens() {
    let gpu = gpu();
    let cfg = tiny(576, 9, 3, 64, 1536);
    let w = random_weights(&cfg, 5);
    let dm = DeviceModel::upload(&gpu, &cfg, &w).unwrap();
    let sched = schedule_for(&cfg, &gpu, 128, None).unwrap();
    let mut mk = MegakernelPath::new(&gpu, &dm, &sched, 128).unwrap();
    let mut graph = BaselinePath::new(&gpu, &dm, Mode::Graph, 128).unwrap();
    let a = argmax(&mk.feed(&[1, 2, 3]).unwrap());
    let b = argmax(&graph.feed(&[1, 2, 3]).unwrap());
    assert_eq!(a, b);
    let ma = mk.decode_greedy(a, 60).unwrap();
    let gb = graph.decode_greedy(b, 60).unwrap();
    assert_eq!(ma, gb, "megakernel and graph greedy tokens differ");
}

#[test]
#[ignore = "needs a GPU"]
fn broken_schedule_is_an_error_not_a_hang() {
    let gpu = gpu();
    let cfg = tiny(192, 3, 3, 64, 520);
    let w = random_weights(&cfg, 3);
    let dm = DeviceModel::upload(&gpu, &cfg, &w).unwrap();
    let sched = schedule_for(&cfg, &gpu, 16, None).unwrap();
    // The first RmsQkvRope in stream order becomes a no-op: the rows it should write this step
    // never arrive, and whatever reads them must give up with an error naming them.
    let flat: Vec<u32> = sched.streams.iter().flatten().copied().collect();
    let (pos, _) = flat
        .iter()
        .enumerate()
        .find(|(_, &k)| matches!(sched.instrs[k as usize], Op::RmsQkvRope { .. }))
        .expect("a QKV instruction");
    let mut mk = MegakernelPath::new(&gpu, &dm, &sched, 16).unwrap();
    mk.set_wait_timeout_ms(200);
    mk.poke_word(pos, 0, 0).unwrap();
    let start = std::time::Instant::now();
    let err = mk.feed(&[1]).unwrap_err().to_string();
    println!("broken schedule: {err} after {:?}", start.elapsed());
    assert!(err.contains("waited too long for"), "{err}");
    assert!(err.contains("nothing wrote it this step"), "{err}");
    assert!(err.contains("cannot make progress"), "{err}");
    assert!(start.elapsed().as_secs() < 20);
}

/// The instructions to turn into no-ops: for every type that hands data on (the argmax writes
/// only untagged outputs), the first and the last of its kind; for QKV the first of a Q, a K
/// and a V head; for split-KV attention the first part and the last (the one reading this
/// token's K/V row).
fn producers_to_drop(sched: &scheduler::Schedule) -> Vec<u32> {
    let cfg = &sched.model;
    let mut picks = Vec::new();
    for kind in scheduler::StageKind::ALL {
        let of_kind: Vec<u32> = (0..sched.instrs.len() as u32)
            .filter(|&i| sched.instrs[i as usize].kind() == kind)
            .collect();
        if kind == scheduler::StageKind::Argmax || of_kind.is_empty() {
            continue;
        }
        picks.push(of_kind[0]);
        picks.push(*of_kind.last().unwrap());
        let role = |head: u32| {
            (head >= cfg.heads as u32) as u32 + (head >= (cfg.heads + cfg.kv_heads) as u32) as u32
        };
        for want in 0..3 {
            picks.extend(
                of_kind
                    .iter()
                    .copied()
                    .find(|&i| match sched.instrs[i as usize] {
                        Op::RmsQkvRope { head, .. } => role(head) == want,
                        Op::Attention { part, parts, .. } => (part + 1 == parts) == (want == 1),
                        _ => false,
                    }),
            );
        }
    }
    picks.sort_unstable();
    picks.dedup();
    picks
}

/// `what` in `text` between `before` and `after`.
fn between<'t>(text: &'t str, before: &str, after: &str) -> Option<&'t str> {
    let start = text.find(before)? + before.len();
    let len = text[start..].find(after)?;
    Some(&text[start..start + len])
}

/// One source for what an instruction reads: the GPU's hand-written tagged reads against
/// `scheduler::access`. For every type of instruction that hands data on, on small random
/// models with and without split-KV attention, one producer becomes a no-op (opcode 0) after
/// a few clean steps. The kernel must stop with an error naming an element and an
/// instruction that `scheduler::unwritten_if_dropped` predicts: an element the scheduler
/// says is never written this step, read by an instruction the scheduler says waits for it.
/// A GPU read the scheduler does not declare, or a declared read the GPU does not wait for,
/// shows up as a name outside the prediction (or as no error at all).
#[test]
#[ignore = "needs a GPU"]
fn dropped_producer_is_named_as_the_scheduler_predicts() {
    let gpu = Gpu::new(0).expect("a GPU");
    let mut checked = 0;
    for (label, cfg) in [
        ("gqa1-hd64", tiny(192, 3, 3, 64, 520)),
        ("gqa2-hd128", tiny(256, 4, 2, 128, 520)),
    ] {
        let w = random_weights(&cfg, 3);
        let dm = DeviceModel::upload(&gpu, &cfg, &w).unwrap();
        for parts in [1, 3] {
            let sched = schedule_for(&cfg, &gpu, 16, Some(parts)).unwrap();
            let order = sched.encoded_order();
            for dropped in producers_to_drop(&sched) {
                let what = format!(
                    "{label} parts={parts}: {} dropped",
                    sched.describe(dropped as usize)
                );
                let predicted = scheduler::unwritten_if_dropped(&sched, dropped).unwrap();
                assert!(!predicted.is_empty(), "{what}: nothing predicted");
                let mut mk = MegakernelPath::new(&gpu, &dm, &sched, 16).unwrap();
                mk.set_wait_timeout_ms(200);
                // Clean steps first, so the stale values carry the previous step's tag.
                mk.feed(&[1, 2, 3, 4]).unwrap();
                let pos = order.iter().position(|&k| k == dropped).unwrap();
                mk.poke_word(pos, 0, 0).unwrap();
                let start = std::time::Instant::now();
                let err = mk.feed(&[5]).unwrap_err().to_string();
                println!("{what}: {err} after {:?}", start.elapsed());
                assert!(err.contains("nothing wrote it this step"), "{what}: {err}");
                let element = between(&err, "waited too long for ", " (tag").expect("element");
                let reader: usize = between(&err, " instruction ", " (")
                    .and_then(|p| p.parse().ok())
                    .expect("instruction position");
                let global = order[reader];
                // Whether the kernel named the dropped instruction's own output or an element
                // of an instruction stuck behind it (whichever wait timed out first).
                let arena = sched.arena();
                let own = sched
                    .access(&sched.instrs[dropped as usize])
                    .writes
                    .iter()
                    .filter_map(|s| arena.runs(s))
                    .flatten()
                    .any(|r| r.map(|o| arena.element(o)).any(|e| e == element));
                println!(
                    "  named {}",
                    if own {
                        "its own output"
                    } else {
                        "an output stuck behind it"
                    }
                );
                assert!(
                    predicted.contains(&(global, element.to_string())),
                    "{what}: the kernel names #{global} waiting for {element}; the scheduler predicts {predicted:?}"
                );
                checked += 1;
            }
        }
    }
    println!("{checked} dropped producers named as predicted");
    assert!(checked >= 4 * 8, "only {checked} cases");
}

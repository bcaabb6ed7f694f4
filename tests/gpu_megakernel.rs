//! The megakernel against the CPU reference and the graph baseline. Skipped (with a message)
//! where no GPU or driver is present, as on CI.

#[path = "common/gpu.rs"]
#[allow(dead_code)]
mod gpu_common;
use gpu_common::{gpu_or_skip, rel_l2, small_cases, tiny};

use megainfer::generate::Backend;
use megainfer::gpu::baseline::{BaselinePath, Mode};
use megainfer::gpu::device::Gpu;
use megainfer::gpu::megakernel::{schedule_for, MegakernelPath};
use megainfer::gpu::model::DeviceModel;
use megainfer::model::{presets, random::random_weights, Config, Weights};
use megainfer::reference::CpuForward;
use megainfer::sampling::argmax;
use scheduler::Op;

fn teacher_forced(
    gpu: &Gpu,
    cfg: &Config,
    w: &Weights,
    tokens: &[u32],
    parts: Option<usize>,
    label: &str,
) {
    let dm = DeviceModel::upload(gpu, cfg, w).unwrap();
    let want = CpuForward::new(cfg, w, 64).forward_all(tokens).unwrap();
    let sched = schedule_for(cfg, gpu, 64, parts).unwrap();
    let mut mk = MegakernelPath::new(gpu, &dm, &sched, 64).unwrap();
    for (i, t) in tokens.iter().enumerate() {
        let got = mk.feed(&[*t]).unwrap();
        let err = rel_l2(&got, &want[i]);
        println!("{label} megakernel parts={parts:?} step {i}: rel L2 {err:.2e}");
        assert!(err <= 1e-2, "{label}: step {i} rel L2 {err} > 1e-2");
        assert_eq!(
            argmax(&got),
            argmax(&want[i]),
            "{label}: step {i} argmax differs"
        );
    }
}

#[test]
fn megakernel_matches_reference_on_small_random_models() {
    let Some(gpu) = gpu_or_skip() else { return };
    for (label, cfg, w, tokens) in small_cases() {
        teacher_forced(&gpu, &cfg, &w, &tokens, None, &label);
        teacher_forced(&gpu, &cfg, &w, &tokens, Some(3), &format!("{label}-split"));
    }
}

#[test]
fn megakernel_matches_reference_on_llama_1b_shape() {
    let Some(gpu) = gpu_or_skip() else { return };
    let cfg = presets::by_name("llama-3.2-1b").unwrap();
    let w = random_weights(&cfg, 7);
    teacher_forced(
        &gpu,
        &cfg,
        &w,
        &[128000, 791, 6864, 315, 9822],
        None,
        "llama-1b",
    );
}

#[test]
fn megakernel_long_greedy_run_on_llama_1b_shape() {
    let Some(gpu) = gpu_or_skip() else { return };
    let cfg = presets::by_name("llama-3.2-1b").unwrap();
    let w = random_weights(&cfg, 9);
    let dm = DeviceModel::upload(&gpu, &cfg, &w).unwrap();
    let sched = schedule_for(&cfg, &gpu, 512, None).unwrap();
    let mut mk = MegakernelPath::new(&gpu, &dm, &sched, 512).unwrap();
    // 500 launches back to back: every page of the pipeline is reused thousands of times.
    let first = argmax(&mk.feed(&[1, 2, 3, 4]).unwrap());
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
    println!("llama-1b after 505 positions: rel L2 {err:.2e}");
    assert!(err <= 1e-2, "rel L2 {err} after a long run");
}

/// Attention stages earlier K/V rows in the page ring: 900 positions are more tiles than the
/// ring holds (64 positions a page at head_dim 64, 32 at 128; 12 pages on an H100), so they are
/// taken a ring's worth at a time, in one part and split in three.
#[test]
fn megakernel_attention_longer_than_the_page_ring() {
    let Some(gpu) = gpu_or_skip() else { return };
    const LEN: usize = 900;
    for (label, cfg) in [
        ("hd64", tiny(192, 3, 1, 64, 520)),
        ("hd128", tiny(256, 4, 2, 128, 520)),
    ] {
        let w = random_weights(&cfg, 21);
        let dm = DeviceModel::upload(&gpu, &cfg, &w).unwrap();
        let tokens: Vec<u32> = (0..LEN as u32).map(|k| (k * 37 + 5) % 1000).collect();
        let want = CpuForward::new(&cfg, &w, LEN).forward(&tokens).unwrap();
        for parts in [1, 3] {
            let sched = schedule_for(&cfg, &gpu, LEN, Some(parts)).unwrap();
            let mut mk = MegakernelPath::new(&gpu, &dm, &sched, LEN).unwrap();
            let got = mk.feed(&tokens).unwrap();
            let err = rel_l2(&got, &want);
            println!(
                "{label} parts={parts} at position {}: rel L2 {err:.2e}",
                LEN - 1
            );
            assert!(err <= 1e-2, "{label} parts={parts}: rel L2 {err} > 1e-2");
        }
    }
}

#[test]
fn megakernel_and_graph_agree_on_greedy_tokens() {
    let Some(gpu) = gpu_or_skip() else { return };
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
fn broken_schedule_is_an_error_not_a_hang() {
    let Some(gpu) = gpu_or_skip() else { return };
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

//! Every GPU decode path against the CPU reference forward. Skipped (with a message) where no
//! GPU or driver is present, as on CI.

#[path = "common/gpu.rs"]
#[allow(dead_code)]
mod gpu_common;
use gpu_common::{gpu_or_skip, rel_l2, small_cases, tiny};

use megainfer::generate::Backend;
use megainfer::gpu::baseline::{BaselinePath, Mode};
use megainfer::gpu::device::Gpu;
use megainfer::gpu::model::DeviceModel;
use megainfer::model::{presets, random::random_weights, Config, Weights};
use megainfer::reference::CpuForward;
use megainfer::sampling::argmax;

const MODES: [Mode; 3] = [Mode::Eager, Mode::Graph, Mode::GraphPdl];

/// Teacher-forced: both sides get the same tokens; logits compared at every step.
fn check_teacher_forced(gpu: &Gpu, cfg: &Config, w: &Weights, tokens: &[u32], label: &str) {
    let dm = DeviceModel::upload(gpu, cfg, w).unwrap();
    let mut cpu = CpuForward::new(cfg, w, 64);
    let want: Vec<Vec<f32>> = cpu.forward_all(tokens).unwrap();
    for mode in MODES {
        let mut path = BaselinePath::new(gpu, &dm, mode, 64).unwrap();
        for (i, t) in tokens.iter().enumerate() {
            let got = path.feed(&[*t]).unwrap();
            let err = rel_l2(&got, &want[i]);
            println!("{label} {} step {i}: rel L2 {err:.2e}", mode.name());
            assert!(
                err <= 1e-2,
                "{label} {}: step {i} rel L2 {err} > 1e-2",
                mode.name()
            );
        }
    }
}

#[test]
fn baseline_matches_reference_on_small_random_models() {
    let Some(gpu) = gpu_or_skip() else { return };
    for (label, cfg, w, tokens) in small_cases() {
        check_teacher_forced(&gpu, &cfg, &w, &tokens, &label);
    }
}

#[test]
fn baseline_matches_reference_on_llama_1b_shape() {
    let Some(gpu) = gpu_or_skip() else { return };
    let cfg = presets::by_name("llama-3.2-1b").unwrap();
    let w = random_weights(&cfg, 7);
    check_teacher_forced(&gpu, &cfg, &w, &[128000, 791, 6864, 315, 9822], "llama-1b");
}

#[test]
fn baseline_modes_agree_on_greedy_tokens() {
    let Some(gpu) = gpu_or_skip() else { return };
    let cfg = tiny(576, 9, 3, 64, 1536);
    let w = random_weights(&cfg, 5);
    let dm = DeviceModel::upload(&gpu, &cfg, &w).unwrap();
    let mut runs = Vec::new();
    for mode in MODES {
        let mut path = BaselinePath::new(&gpu, &dm, mode, 128).unwrap();
        let first = argmax(&path.feed(&[1, 2, 3]).unwrap());
        let mut toks = vec![first];
        toks.extend(path.decode_greedy(first, 40).unwrap());
        runs.push(toks);
    }
    assert_eq!(runs[0], runs[1], "eager vs graph");
    assert_eq!(runs[0], runs[2], "eager vs graph-pdl");
}

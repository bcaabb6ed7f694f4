//! The megakernel's draw inside the launch (megakernel/ops/sample.cuh; off by default, turned
//! on here with `set_draw_in_launch`): every sampled token
//! equals the host's draw (`sample_at`, the rule the χ² test in gpu_sampling.rs checks against
//! the reference distribution) from the same logits, teacher-forced; a generation inside one
//! launch draws the same tokens as one launch per token; and the draw's rare second round
//! (a block holding more of the top k than its first keys) is exact too, forced here by a
//! build whose blocks send only 4 keys first. Needs a GPU (scripts/gpu-check.sh runs it with
//! --include-ignored).

#[path = "common/gpu.rs"]
#[allow(dead_code)]
mod gpu_common;

use gpu_common::{gpu, tiny};
use megainfer::generate::Backend;
use megainfer::gpu::device::Gpu;
use megainfer::gpu::model::DeviceModel;
use megainfer::gpu::paths::{GpuPath, PathKind};
use megainfer::gpu::stepping::Steps;
use megainfer::sampling::{Sampler, SamplingParams};

fn variants() -> Vec<SamplingParams> {
    let g = SamplingParams::greedy();
    vec![
        // Pure temperature: every token a candidate (the blocks' best perturbed rows).
        SamplingParams {
            temperature: 1.0,
            seed: 7,
            ..g
        },
        // Top-p alone: the 128-candidate cap, the whole-vocabulary softmax sum.
        SamplingParams {
            temperature: 0.8,
            top_p: 0.95,
            seed: 1,
            ..g
        },
        // Flat logits (high temperature, wide nucleus) reach deep into the candidates.
        SamplingParams {
            temperature: 2.0,
            top_p: 0.999,
            seed: 5,
            ..g
        },
        SamplingParams {
            temperature: 0.9,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.3,
            repeat_last_n: 8,
            seed: 3,
        },
        SamplingParams {
            temperature: 0.7,
            top_k: 3,
            seed: 9,
            ..g
        },
        SamplingParams {
            temperature: 1.5,
            min_p: 0.02,
            repeat_penalty: 1.5,
            repeat_last_n: 64,
            seed: 11,
            ..g
        },
        // Temperature 0 with a penalty: the argmax of the penalised logits.
        SamplingParams {
            temperature: 0.0,
            repeat_penalty: 1.2,
            repeat_last_n: 16,
            ..g
        },
    ]
}

/// `n` tokens sampled after `prompt` (the first drawn on the host from the prompt's logits,
/// the rest on the device).
fn sample_run(path: &mut GpuPath, p: SamplingParams, prompt: &[u32], n: usize) -> Vec<u32> {
    path.reset();
    let mut sampler = Sampler::new(p);
    sampler.accept(prompt);
    let first = sampler.sample(&path.feed(prompt).unwrap());
    sampler.accept(&[first]);
    let rest = path.decode_sampled(&sampler, first, n).unwrap();
    std::iter::once(first).chain(rest).collect()
}

/// Teacher-forced: how many of `tokens` differ from the host's draw from the path's logits.
fn host_differences(
    path: &mut GpuPath,
    p: SamplingParams,
    prompt: &[u32],
    tokens: &[u32],
) -> usize {
    path.reset();
    let mut host = Sampler::new(p);
    host.accept(prompt);
    let mut logits = path.feed(prompt).unwrap();
    let mut differ = 0;
    for &t in tokens {
        if host.sample(&logits) != t {
            differ += 1;
        }
        host.accept(&[t]);
        logits = path.feed(&[t]).unwrap();
    }
    differ
}

fn check_model(gpu: &Gpu, label: &str, vocab: usize, seed: u64, n: usize) {
    // SmolLM2's widths: the draw copies the blocks' first keys into the shared memory the
    // mat-vec inputs take, which these leave room for.
    let mut cfg = tiny(576, 9, 3, 64, 1536);
    cfg.vocab_size = vocab;
    let w = megainfer::model::random::random_weights(&cfg, seed);
    let dm = DeviceModel::upload(gpu, &cfg, &w).unwrap();
    let prompt = [5u32, 17, 400, 17, 800, 5];
    let mut one = GpuPath::new(PathKind::Megakernel, gpu, &dm, 128, 128).unwrap();
    one.set_tokens_per_launch(1);
    let mut many = GpuPath::new(PathKind::Megakernel, gpu, &dm, 128, 128).unwrap();
    for path in [&mut one, &mut many] {
        path.set_draw_in_launch(true).unwrap();
        let mk = path.as_megakernel().expect("a megakernel path");
        assert!(
            mk.samples_in_launch(),
            "{label}: the megakernel would draw after its launches"
        );
    }
    for p in variants() {
        let a = sample_run(&mut one, p, &prompt, n);
        let b = sample_run(&mut many, p, &prompt, n);
        assert_eq!(
            a, b,
            "{label} {p:?}: one launch per token and one generation drew differently"
        );
        let again = sample_run(&mut many, p, &prompt, n);
        assert_eq!(b, again, "{label} {p:?}: the same seed drew differently");
        let differ = host_differences(&mut one, p, &prompt, &a);
        let distinct: std::collections::HashSet<_> = a.iter().collect();
        println!(
            "{label} {p:?}: {} tokens ({} distinct), {differ} differ from the host's draws",
            a.len(),
            distinct.len()
        );
        // Host and device differ only where two perturbed scores or a cumulative mass and P
        // lie within rounding (about 1e-15) of each other: none expected.
        assert!(
            differ <= 1,
            "{label} {p:?}: {differ} of {} tokens differ from the host's draws",
            a.len()
        );
    }
}

#[test]
#[ignore = "needs a GPU"]
fn in_launch_draws_match_the_host_and_one_launch_per_token() {
    let gpu = gpu();
    // 9,000 tokens: LM-head blocks of a few dozen rows; 49,152 (SmolLM2's vocabulary):
    // blocks of a few hundred, as on the real model.
    check_model(&gpu, "vocab 9000", 9000, 21, 40);
    check_model(&gpu, "vocab 49152", 49152, 22, 40);
    // The draw's second round, forced: blocks send 4 keys first, so a block holding more
    // than 4 of the top k is common. Compiled in through the variable the kernels read when
    // a path is made; no other test in this binary runs beside it.
    std::env::set_var(
        "MEGAINFER_MK_DEFINES",
        "-DMK_SMP_PFX=4 -DMK_SMP_PFX_LIMIT=4",
    );
    check_model(&gpu, "vocab 49152, 4 keys first", 49152, 23, 40);
    std::env::remove_var("MEGAINFER_MK_DEFINES");
}

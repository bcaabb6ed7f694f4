//! The megakernel's draw inside the launch (megakernel/ops/sample.cuh, turned on here with
//! `set_draw_in_launch`): every sampled token equals the host's draw (`sample_at`, the rule the
//! χ² test in gpu_sampling.rs checks against the reference distribution) from the same logits,
//! teacher-forced; a generation inside one launch draws the same tokens as one launch per
//! token; most truncating draws take the first attempt (the keys within the hint), some top-p
//! draws are decided by the top token alone (`smp_top_dominates`), and the search over the
//! whole vocabulary, forced on every draw by a build without the attempt, is exact too. Needs a GPU (scripts/gpu-check.sh runs it with --include-ignored).

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
        // Narrow nuclei: the top token alone reaches them in some draws (decided before any
        // key is looked at: smp_top_dominates) and not in others.
        SamplingParams {
            temperature: 0.8,
            top_p: 0.3,
            seed: 13,
            ..g
        },
        SamplingParams {
            temperature: 0.8,
            top_p: 0.05,
            seed: 15,
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

/// Teacher-forced: how many of `tokens` differ from the host's draw from the path's logits,
/// and in how many of the draws after the first (those the device made) the top token alone
/// reaches top-p (top-k off, no penalty: `smp_top_dominates`' test, 1 / z >= P, z the softmax
/// sum relative to the maximum).
fn host_differences(
    path: &mut GpuPath,
    p: SamplingParams,
    prompt: &[u32],
    tokens: &[u32],
) -> (usize, u64) {
    path.reset();
    let mut host = Sampler::new(p);
    host.accept(prompt);
    let mut logits = path.feed(prompt).unwrap();
    let (mut differ, mut alone) = (0, 0);
    let top_test = p.temperature > 0.0 && p.top_k == 0 && p.top_p < 1.0 && p.repeat_penalty == 1.0;
    for (i, &t) in tokens.iter().enumerate() {
        if i > 0 && top_test {
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let z: f64 = logits.iter().map(|&x| (x as f64 - max).exp()).sum();
            alone += u64::from(1.0 / z >= p.top_p as f64);
        }
        if host.sample(&logits) != t {
            differ += 1;
        }
        host.accept(&[t]);
        logits = path.feed(&[t]).unwrap();
    }
    (differ, alone)
}

/// Checks the draws of `variants()` on a random model of SmolLM2's widths with `vocab` tokens.
/// `attempts`: whether the build makes first attempts (then most truncating draws after the
/// first take them) or searches on every draw.
fn check_model(gpu: &Gpu, label: &str, vocab: usize, seed: u64, n: usize, attempts: bool) {
    let mut cfg = tiny(576, 9, 3, 64, 1536);
    cfg.vocab_size = vocab;
    let mut w = megainfer::model::random::random_weights(&cfg, seed);
    // The final norm's weights scaled down, so that the logits spread as a trained model's do
    // (at full scale the fed token's own row, tied to its embedding, outweighs every other by
    // e^50 and every draw repeats it; scaled, the top token has p 0.15-0.5 at T 0.8).
    for g in w.final_norm.iter_mut() {
        *g = half::bf16::from_f32(g.to_f32() * 0.07);
    }
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
    let (mut sampled, mut varied) = (0, 0);
    let (mut trunc_draws, mut trunc_searches, mut tops) = (0, 0, 0);
    for p in variants() {
        let before = many.as_megakernel().unwrap().in_launch_draws().unwrap();
        let a = sample_run(&mut one, p, &prompt, n);
        let b = sample_run(&mut many, p, &prompt, n);
        let after = many.as_megakernel().unwrap().in_launch_draws().unwrap();
        let (draws, searches) = (after.draws - before.draws, after.searches - before.searches);
        let top = after.top - before.top;
        tops += top;
        assert_eq!(
            a, b,
            "{label} {p:?}: one launch per token and one generation drew differently"
        );
        let again = sample_run(&mut many, p, &prompt, n);
        assert_eq!(b, again, "{label} {p:?}: the same seed drew differently");
        let (differ, alone) = host_differences(&mut one, p, &prompt, &a);
        let distinct: std::collections::HashSet<_> = a.iter().collect();
        println!(
            "{label} {p:?}: {} tokens ({} distinct), {differ} differ from the host's draws; \
             {searches} of {draws} draws searched, {top} decided by the top token alone \
             (the host's test: {alone})",
            a.len(),
            distinct.len()
        );
        // The generation drew its n tokens after the host's first on the device.
        assert_eq!(draws, n as u64, "{label} {p:?}: draws counted");
        let truncates = p.top_k > 0 || p.top_p < 1.0 || p.min_p > 0.0;
        if !truncates || p.temperature == 0.0 {
            assert_eq!(searches, 0, "{label} {p:?}: a draw without cuts searched");
        } else if attempts {
            // How often the attempt holds is the logits' affair (from every draw but the
            // first to a few, on these flat ones); it is asserted over all variants below.
            trunc_draws += draws;
            trunc_searches += searches;
        } else {
            assert_eq!(searches, draws, "{label} {p:?}: a draw took an attempt");
        }
        if p.temperature > 0.0 {
            sampled += 1;
            varied += usize::from(distinct.len() > 1);
        }
        // The device decides by the top token alone exactly where the rule's test says so
        // (up to a sum within rounding of 1 / P, as below), and never in a build without
        // attempts (which searches on every draw).
        let want = if attempts { alone } else { 0 };
        assert!(
            top.abs_diff(want) <= 1,
            "{label} {p:?}: {top} draws decided by the top token alone, the host's test says {want}"
        );
        // Host and device differ only where two perturbed scores or a cumulative mass and P
        // lie within rounding (about 1e-15) of each other: none expected.
        assert!(
            differ <= 1,
            "{label} {p:?}: {differ} of {} tokens differ from the host's draws",
            a.len()
        );
    }
    if attempts {
        assert!(
            trunc_searches < trunc_draws,
            "{label}: every truncating draw searched ({trunc_searches} of {trunc_draws})"
        );
        // Both ways of a top-p draw were taken: by the top token alone, and by the keys.
        assert!(
            tops > 0 && tops < trunc_draws - trunc_searches,
            "{label}: {tops} of {trunc_draws} truncating draws decided by the top token alone, \
             {trunc_searches} searched"
        );
    }
    // Draws that differ from one step to the next, not the same token every time.
    assert!(
        varied * 2 >= sampled,
        "{label}: only {varied} of {sampled} sampled variants drew more than one token"
    );
}

#[test]
#[ignore = "needs a GPU"]
fn in_launch_draws_match_the_host_and_one_launch_per_token() {
    let gpu = gpu();
    // 9,000 tokens: LM-head blocks of a few dozen rows; 49,152 (SmolLM2's vocabulary):
    // blocks of a few hundred, as on the real model.
    check_model(&gpu, "vocab 9000", 9000, 21, 40, true);
    check_model(&gpu, "vocab 49152", 49152, 22, 40, true);
    // Through the variable the kernels read when a path is made (no other test in this binary
    // runs beside it): the draw's first load takes 3 slots of each block instead of 15, so
    // that its second load (a block's other keys) is common; then the search on every draw.
    std::env::set_var("MEGAINFER_MK_DEFINES", "-DMK_SMP_FIRST_PER=2");
    check_model(&gpu, "vocab 49152, 3 slots first", 49152, 24, 40, true);
    std::env::set_var("MEGAINFER_MK_DEFINES", "-DMK_SMP_NO_ATTEMPT=1");
    check_model(&gpu, "vocab 49152, no attempt", 49152, 23, 40, false);
    std::env::remove_var("MEGAINFER_MK_DEFINES");
}

//! The device sampler against the host's rule: the same Philox bits, the same tokens for the
//! same logits and position, draws that follow the reference distribution (χ²), and sampled
//! decoding on every path that reproduces itself and matches the host's draws from the
//! same logits. Needs a GPU (scripts/gpu-check.sh runs these with --include-ignored).

#[path = "common/gpu.rs"]
#[allow(dead_code)]
mod gpu_common;
#[path = "common/sampling_stats.rs"]
#[allow(dead_code)]
mod stats;

use gpu_common::{gpu, tiny};
use megainfer::generate::Backend;
use megainfer::gpu::device::ptr;
use megainfer::gpu::model::DeviceModel;
use megainfer::gpu::paths::GpuPath;
use megainfer::sampling::device::{DeviceSampler, Kernels};
use megainfer::sampling::{philox, sample_at, Sampler, SamplingParams};
use stats::{cases, chi2_test, reference_probs, test_logits};

const DRAWS: usize = 10_000;

#[test]
#[ignore = "needs a GPU"]
fn device_philox_is_bit_identical_to_the_host() {
    let gpu = gpu();
    let sampler = DeviceSampler::new(&gpu, 1000).unwrap();
    let counters: Vec<[u32; 4]> = (0..4096u32)
        .map(|i| [i.wrapping_mul(2_654_435_761), i, !i, i.rotate_left(7)])
        .chain([[0; 4], [u32::MAX; 4]])
        .collect();
    for key in [[0, 0], [u32::MAX, u32::MAX], [0xa409_3822, 0x299f_31d0]] {
        let got = sampler.philox_on_device(&gpu, &counters, key).unwrap();
        let bad = counters
            .iter()
            .zip(&got)
            .filter(|(c, g)| philox::philox4x32_10(**c, key) != **g)
            .count();
        println!("key {key:08x?}: {bad} of {} words differ", counters.len());
        assert_eq!(bad, 0);
    }
}

/// The device's draws for every option combination, one per position, against the host's
/// draw at the same position and the reference distribution; with the fused kernel and with
/// the two-kernel sampler.
#[test]
#[ignore = "needs a GPU"]
fn device_draws_match_the_host_and_the_distribution() {
    let gpu = gpu();
    let s = &gpu.stream;
    // One block, and three with a last block shorter than the candidate lists.
    for (vocab, kernels) in [1000usize, 2 * 4096 + 50]
        .into_iter()
        .flat_map(|v| [(v, Kernels::Fused), (v, Kernels::TwoPass)])
    {
        let logits = test_logits(vocab);
        let d_logits = gpu.upload(&logits, "logits").unwrap();
        let mut meta = gpu.alloc_zeros::<u32>(4, "meta").unwrap();
        let first = 100usize;
        let mut sampler = DeviceSampler::with_kernels(&gpu, vocab, kernels).unwrap();
        for (name, p, ctx) in cases() {
            // The penalty looks at the set of tokens in the window: a history repeating the
            // window's tokens with its period gives every position the host's window.
            let window: Vec<u32> = if p.penalises() && !ctx.is_empty() {
                ctx[ctx.len().saturating_sub(p.repeat_last_n)..].to_vec()
            } else {
                vec![0]
            };
            let hist: Vec<u32> = (0..first + DRAWS + 2)
                .map(|q| window[q % window.len()])
                .collect();
            let history = gpu.upload(&hist, "history").unwrap();
            sampler.set_params(s, &p).unwrap();
            let (lp, mp, hp) = (ptr(&d_logits, s), ptr(&meta, s), ptr(&history, s));
            let mut counts = vec![0u64; vocab];
            let mut differ = 0;
            for pos in first..first + DRAWS {
                let m = [window[pos % window.len()], pos as u32, 0, 0];
                s.memcpy_htod(&m, &mut meta).unwrap();
                sampler.enqueue(s, lp, mp, mp, hp, false, None).unwrap();
                let out = s.clone_dtoh(&meta).unwrap();
                assert_eq!(out[1], pos as u32 + 1, "{name}: position not advanced");
                let t = out[2];
                assert!((t as usize) < vocab, "{name}: token {t} out of range");
                counts[t as usize] += 1;
                if t != sample_at(&p, &logits, pos as u64, &ctx) {
                    differ += 1;
                }
            }
            let want = reference_probs(&p, &logits, &ctx);
            let (stat, df, pv) = chi2_test(&counts, &want);
            println!(
                "{kernels:?}, vocab {vocab}, {name}: χ² {stat:.1} on {df} df, p = {pv:.4}; {differ} of {DRAWS} tokens differ from the host's"
            );
            assert!(pv >= 0.001, "{kernels:?}, vocab {vocab}, {name}: p = {pv}");
            // Only rounding (the f64 log, the softmax sums' order) can separate the two.
            assert!(
                differ <= DRAWS / 1000,
                "{kernels:?}, vocab {vocab}, {name}: {differ} draws differ from the host's"
            );
        }
    }
}

/// Sampled decoding on the megakernel (drawing inside the launch, its default for this
/// vocabulary, and after it), eager, graph and graph + PDL: tokens chained on the device
/// reproduce themselves with the same seed, and each is the token the host draws from the same
/// path's logits (teacher-forced), the repetition penalty's window kept on the device
/// included, and the fused sampler's first attempt with and without the LM head's maxima.
#[test]
#[ignore = "needs a GPU"]
fn sampled_decoding_on_every_path_matches_host_draws() {
    let gpu = gpu();
    let mut cfg = tiny(192, 3, 3, 64, 520);
    cfg.vocab_size = 9000;
    let mut w = megainfer::model::random::random_weights(&cfg, 21);
    // The final norm scaled down so that the draws spread over several tokens (at full scale
    // the fed token's tied row outweighs the others and nearly every draw repeats one token),
    // as in gpu_sample_in_launch.rs.
    for g in w.final_norm.iter_mut() {
        *g = half::bf16::from_f32(g.to_f32() * 0.07);
    }
    let dm = DeviceModel::upload(&gpu, &cfg, &w).unwrap();
    let prompt = [5u32, 17, 400, 17, 8000, 5];
    let n = 40;
    let variants = [
        SamplingParams {
            temperature: 1.0,
            ..SamplingParams::greedy()
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
            temperature: 1.5,
            top_p: 0.9,
            repeat_penalty: 1.5,
            repeat_last_n: 64,
            seed: 11,
            ..SamplingParams::greedy()
        },
        // Without a penalty the fused sampler's first attempt after a megakernel step cuts
        // below the LM head's maxima instead of sharing its CTAs' own.
        SamplingParams {
            temperature: 0.8,
            top_p: 0.95,
            seed: 5,
            ..SamplingParams::greedy()
        },
        SamplingParams {
            temperature: 1.2,
            min_p: 0.02,
            seed: 9,
            ..SamplingParams::greedy()
        },
    ];
    for sp in gpu_common::SampledPath::all() {
        let mut path = sp.make(&gpu, &dm, 64);
        let name = sp.label();
        let mut varied = 0;
        for p in variants {
            let run = |path: &mut GpuPath| {
                path.reset();
                let mut sampler = Sampler::new(p);
                sampler.accept(&prompt);
                let first = sampler.sample(&path.feed(&prompt).unwrap());
                sampler.accept(&[first]);
                let rest = path.decode_sampled(&sampler, first, n).unwrap();
                std::iter::once(first).chain(rest).collect::<Vec<u32>>()
            };
            let a = run(&mut path);
            let b = run(&mut path);
            assert_eq!(a, b, "{name}: the same seed drew different tokens");
            path.reset();
            let mut host = Sampler::new(p);
            host.accept(&prompt);
            let mut logits = path.feed(&prompt).unwrap();
            let mut differ = 0;
            for &t in &a {
                if host.sample(&logits) != t {
                    differ += 1;
                }
                host.accept(&[t]);
                logits = path.feed(&[t]).unwrap();
            }
            let distinct: std::collections::HashSet<_> = a.iter().collect();
            println!(
                "{name} {p:?}: {} tokens ({} distinct), {differ} differ from the host's draws",
                a.len(),
                distinct.len()
            );
            assert!(differ <= 1, "{name}: {differ} tokens differ");
            varied += usize::from(distinct.len() > 1);
        }
        // Draws that differ from one step to the next, not one token every time.
        assert!(
            varied * 2 >= variants.len(),
            "{name}: only {varied} of {} rules drew more than one token",
            variants.len()
        );
    }
}

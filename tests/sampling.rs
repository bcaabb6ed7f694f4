//! The host sampler against an independent reference of its distribution (χ², ≥ 10,000
//! draws per option combination), and its reproducibility.

#[path = "common/gpu.rs"]
#[allow(dead_code)]
mod gpu_common;
#[path = "common/sampling_stats.rs"]
#[allow(dead_code)]
mod stats;

use megainfer::generate::generate;
use megainfer::reference::CpuForward;
use megainfer::sampling::{probabilities, sample_at, Sampler, SamplingParams, K_MAX};
use stats::{cases, chi2_test, params, reference_probs, test_logits};

const DRAWS: u64 = 20_000;

#[test]
fn host_draws_follow_the_reference_distribution() {
    let logits = test_logits(1000);
    for (name, p, ctx) in cases() {
        let want = reference_probs(&p, &logits, &ctx);
        let mine = probabilities(&p, &logits, &ctx);
        let gap = want
            .iter()
            .zip(&mine)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        assert!(
            gap < 1e-9,
            "{name}: probabilities differ from the reference by {gap}"
        );
        let mut counts = vec![0u64; logits.len()];
        for pos in 0..DRAWS {
            counts[sample_at(&p, &logits, pos, &ctx) as usize] += 1;
        }
        let (stat, df, pv) = chi2_test(&counts, &want);
        let support = want.iter().filter(|&&q| q > 0.0).count();
        println!("{name}: {support} tokens possible, χ² {stat:.1} on {df} df, p = {pv:.4}");
        assert!(pv >= 0.001, "{name}: χ² {stat} on {df} df, p = {pv}");
    }
}

#[test]
fn the_nucleus_is_capped_at_k_max_candidates() {
    // 1000 nearly flat logits: the 0.99 nucleus would hold ~990 tokens; the sampler keeps the
    // top K_MAX, and the draws follow that.
    let logits: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.37).sin() * 0.01).collect();
    let p = SamplingParams {
        top_p: 0.99,
        ..params(1.0)
    };
    let want = reference_probs(&p, &logits, &[]);
    assert_eq!(want.iter().filter(|&&q| q > 0.0).count(), K_MAX);
    let mut counts = vec![0u64; logits.len()];
    for pos in 0..DRAWS {
        counts[sample_at(&p, &logits, pos, &[]) as usize] += 1;
    }
    let (stat, df, pv) = chi2_test(&counts, &want);
    println!("capped nucleus: χ² {stat:.1} on {df} df, p = {pv:.4}");
    assert!(pv >= 0.001, "χ² {stat} on {df} df, p = {pv}");
}

#[test]
fn greedy_and_zero_temperature_are_argmax() {
    let logits = test_logits(1000);
    let best = megainfer::sampling::argmax(&logits);
    for pos in 0..50 {
        assert_eq!(
            sample_at(&SamplingParams::greedy(), &logits, pos, &[]),
            best
        );
    }
    // At T = 0 the repetition penalty still applies: penalising the argmax moves it.
    let p = SamplingParams {
        repeat_penalty: 100.0,
        repeat_last_n: 4,
        ..params(0.0)
    };
    let moved = sample_at(&p, &logits, 0, &[best]);
    assert_ne!(moved, best);
    let mut l2 = logits.clone();
    l2[best as usize] = f32::NEG_INFINITY;
    assert_eq!(moved, megainfer::sampling::argmax(&l2));
}

#[test]
fn same_seed_same_tokens_and_another_seed_other_tokens() {
    let cfg = gpu_common::tiny(64, 2, 1, 32, 96);
    let w = megainfer::model::random::random_weights(&cfg, 5);
    let prompt = [1u32, 2, 3, 4];
    let run = |seed: u64| {
        let p = SamplingParams {
            top_k: 50,
            top_p: 0.95,
            repeat_penalty: 1.2,
            seed,
            ..params(1.0)
        };
        let mut cpu = CpuForward::new(&cfg, &w, 64);
        let mut sampler = Sampler::new(p);
        let mut out = Vec::new();
        generate(&mut cpu, &prompt, 40, &[], &mut sampler, &mut |t| {
            out.push(t);
            Ok(())
        })
        .unwrap();
        out
    };
    let (a, b, c) = (run(7), run(7), run(8));
    assert_eq!(a.len(), 40);
    assert_eq!(a, b, "the same seed drew different tokens");
    assert_ne!(a, c, "seeds 7 and 8 drew the same 40 tokens");
    let distinct: std::collections::HashSet<_> = a.iter().collect();
    assert!(distinct.len() >= 3, "sampling at T=1 barely varied: {a:?}");
}

#[test]
fn the_chi2_test_rejects_a_wrong_distribution() {
    // Draws at T = 0.8 against the distribution at T = 0.9, and top-k 40 draws against
    // top-k 45: a check that the tests above can fail.
    let logits = test_logits(1000);
    let pairs = [
        (params(0.8), params(0.9)),
        (
            SamplingParams {
                top_k: 40,
                ..params(1.0)
            },
            SamplingParams {
                top_k: 45,
                ..params(1.0)
            },
        ),
    ];
    for (drawn, claimed) in pairs {
        let mut counts = vec![0u64; logits.len()];
        for pos in 0..DRAWS {
            counts[sample_at(&drawn, &logits, pos, &[]) as usize] += 1;
        }
        let (stat, df, pv) = chi2_test(&counts, &reference_probs(&claimed, &logits, &[]));
        println!("{drawn:?} vs {claimed:?}: χ² {stat:.1} on {df} df, p = {pv:.2e}");
        assert!(pv < 0.001, "p = {pv}");
    }
}

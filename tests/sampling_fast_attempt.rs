//! The fused sampler's fast attempt (kernels/sampling/fused.cu: the candidates at or above the
//! global maximum less a hint, accepted where `smp_attempt_complete` (select.cuh) says they decided the cuts),
//! modelled on the host with the host's own arithmetic: wherever the model accepts, its
//! candidates must be exactly those of `sampling::candidates` over the whole vocabulary. And the
//! test both draws make before any key (`smp_top_dominates`): where the top token alone reaches
//! top-p, the rule keeps that token alone.

use megainfer::sampling::{candidates, sample_at, SamplingParams, K_MAX};

/// Order-preserving key of a logit (the kernels' `smp_key`): -0.0 sorts below +0.0.
fn key(f: f32) -> u32 {
    let u = f.to_bits();
    if u & 0x8000_0000 != 0 {
        !u
    } else {
        u | 0x8000_0000
    }
}

/// What the fast attempt keeps for logits `l` and hint `delta`, or None where the kernel's
/// check sends the draw to the searches. With `loose`, the list also holds some keys below
/// the cut, down to twice the hint, as where some blocks read a wider hint than others.
fn attempt(p: &SamplingParams, l: &[f32], delta: f32, loose: bool) -> Option<Vec<u32>> {
    let gmax = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let tau = gmax - delta;
    let wide = gmax - 2.0 * delta;
    let mut list: Vec<u32> = (0..l.len() as u32)
        .filter(|&i| {
            let x = key(l[i as usize]);
            x >= key(tau) || (loose && i % 3 == 0 && x >= key(wide))
        })
        .collect();
    list.sort_by(|&a, &b| l[b as usize].total_cmp(&l[a as usize]).then(a.cmp(&b)));
    let k = if p.top_k > 0 { p.top_k } else { K_MAX };
    list.truncate(k);
    let kk = list.len();
    let top = l[list[0] as usize] as f64;
    // smp_cut_and_draw's cuts, in `candidates`' arithmetic.
    let mut keep = kk;
    if p.top_k > 0 {
        keep = keep.min(p.top_k);
    }
    let mut p_cut = false;
    if p.top_p < 1.0 {
        let w = |i: u32| (l[i as usize] as f64 - top).exp();
        let z: f64 = if p.top_k > 0 {
            list[..keep].iter().map(|&i| w(i)).sum()
        } else {
            (0..l.len() as u32).map(w).sum()
        };
        let mut acc = 0.0;
        for (j, &i) in list[..keep].iter().enumerate() {
            acc += w(i);
            if acc / z >= p.top_p as f64 {
                keep = j + 1;
                p_cut = true;
                break;
            }
        }
    }
    let keep_p = keep;
    if p.min_p > 0.0 {
        let floor = top + (p.min_p as f64).ln();
        let below = list[..keep]
            .iter()
            .take_while(|&&i| l[i as usize] as f64 >= floor)
            .count();
        keep = keep.min(below).max(1);
    }
    // smp_attempt_complete.
    let lo = list
        .iter()
        .take_while(|&&i| key(l[i as usize]) >= key(tau))
        .count();
    let below_floor = p.min_p > 0.0 && (tau as f64) < top + (p.min_p as f64).ln();
    let complete = (kk == k && lo == k)
        || (!(p.top_k > 0 && p.top_p < 1.0)
            && (below_floor
                || if keep < keep_p {
                    keep < lo
                } else {
                    p_cut && keep <= lo
                }));
    complete.then(|| list[..keep].to_vec())
}

struct Rng(u64);
impl Rng {
    fn unit(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 + 0.5) / (1u64 << 24) as f32
    }
}

#[test]
fn accepted_attempts_keep_exactly_the_rules_candidates() {
    let mut rng = Rng(11);
    let rules = [
        (0.8, 0, 0.95, 0.0),
        (0.8, 40, 1.0, 0.0),
        (0.7, 0, 1.0, 0.05),
        (0.9, 40, 0.95, 0.05),
        (1.0, 0, 0.5, 0.0),
        (1.0, 5, 0.9, 0.0),
        (1.0, 0, 0.99, 0.2),
    ];
    let (mut accepted, mut refused) = (0, 0);
    for case in 0..300 {
        let vocab = 200 + (rng.unit() * 3000.0) as usize;
        // Flat, peaked (a few tokens far above a Gaussian-like bulk) and coarse (ties).
        let spread = [0.05, 1.0, 4.0][case % 3];
        let peaks = case % 5;
        let mut l: Vec<f32> = (0..vocab)
            .map(|_| (rng.unit() + rng.unit() + rng.unit() - 1.5) * spread)
            .collect();
        for _ in 0..peaks {
            let i = (rng.unit() * vocab as f32) as usize % vocab;
            l[i] += 6.0 + 10.0 * rng.unit();
        }
        if case % 7 == 0 {
            l.iter_mut().for_each(|x| *x = (*x * 4.0).round() / 4.0);
        }
        for &(t, top_k, top_p, min_p) in &rules {
            let p = SamplingParams {
                temperature: t,
                top_k,
                top_p,
                min_p,
                ..SamplingParams::greedy()
            };
            let want = candidates(&p, &l);
            for (delta, loose) in [0.0, 0.05, 0.25, 1.0, 3.0, 10.0, 100.0]
                .into_iter()
                .flat_map(|d| [(d, false), (d, true)])
            {
                match attempt(&p, &l, delta, loose) {
                    Some(got) => {
                        assert_eq!(
                            got, want,
                            "case {case}, {p:?}, delta {delta}, loose {loose}: the attempt kept other candidates"
                        );
                        accepted += 1;
                    }
                    None => refused += 1,
                }
            }
        }
    }
    println!("{accepted} attempts accepted, {refused} sent to the searches");
    assert!(accepted > 1000 && refused > 1000, "{accepted} / {refused}");
}

/// `smp_top_dominates` (select.cuh): with top-p and no top-k, where 1 / z (z the softmax sum
/// relative to the maximum: the top token's share) reaches top-p, the draw is the top token
/// (the lowest at the maximum) for every seed, min-p or not, and `candidates` keeps it alone.
#[test]
fn a_top_token_alone_reaching_top_p_is_the_draw() {
    let mut rng = Rng(5);
    let rules = [
        (0.8, 0.95, 0.0),
        (1.0, 0.5, 0.0),
        (0.7, 0.9, 0.05),
        (1.5, 0.3, 0.0),
    ];
    let (mut alone, mut not) = (0, 0);
    for case in 0..400 {
        let vocab = 100 + (rng.unit() * 2000.0) as usize;
        let spread = [0.5, 2.0, 6.0, 12.0][case % 4];
        let mut l: Vec<f32> = (0..vocab)
            .map(|_| (rng.unit() + rng.unit() - 1.0) * spread)
            .collect();
        let peak = (rng.unit() * vocab as f32) as usize % vocab;
        l[peak] += 4.0 + 16.0 * rng.unit();
        if case % 9 == 0 {
            // A tie at the maximum: the lower token is the top.
            let other = (peak + 1 + case) % vocab;
            l[other] = l[peak];
        }
        let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let top = l.iter().position(|&x| x == max).unwrap() as u32;
        let z: f64 = l.iter().map(|&x| (x as f64 - max as f64).exp()).sum();
        for &(t, top_p, min_p) in &rules {
            let p = SamplingParams {
                temperature: t,
                top_p,
                min_p,
                ..SamplingParams::greedy()
            };
            if 1.0 / z >= top_p as f64 {
                alone += 1;
                assert_eq!(candidates(&p, &l), vec![top], "case {case}, {p:?}");
                for seed in 0..8u64 {
                    let p = SamplingParams { seed, ..p };
                    assert_eq!(
                        sample_at(&p, &l, case as u64, &[]),
                        top,
                        "case {case}, {p:?}"
                    );
                }
            } else {
                not += 1;
                // (min-p may still keep one token: the test only covers top-p's cut.)
                if min_p == 0.0 {
                    assert!(candidates(&p, &l).len() > 1, "case {case}, {p:?}");
                }
            }
        }
    }
    println!("{alone} draws decided by the top token alone, {not} not");
    assert!(alone > 200 && not > 200, "{alone} / {not}");
}

//! Shared by the sampling tests: an independent reference of the sampler's distribution
//! (llama.cpp's chain written out step by step) and a χ² goodness-of-fit test.

use megainfer::sampling::{SamplingParams, K_MAX};

/// The probability of every token: penalties, top-k, top-p (its softmax over what top-k
/// kept), the list cut to K_MAX, min-p, then softmax(l / T).
pub fn reference_probs(p: &SamplingParams, logits: &[f32], context: &[u32]) -> Vec<f64> {
    let mut l: Vec<f64> = logits.iter().map(|&x| x as f64).collect();
    if p.repeat_penalty != 1.0 && p.repeat_last_n > 0 {
        let window = &context[context.len().saturating_sub(p.repeat_last_n)..];
        let mut done = vec![false; l.len()];
        for &t in window {
            let t = t as usize;
            if !done[t] {
                done[t] = true;
                let x = logits[t];
                l[t] = if x <= 0.0 {
                    (x * p.repeat_penalty) as f64
                } else {
                    (x / p.repeat_penalty) as f64
                };
            }
        }
    }
    let mut list: Vec<(f64, usize)> = l.iter().copied().zip(0..).collect();
    list.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    let truncating = p.top_k > 0 || p.top_p < 1.0 || p.min_p > 0.0;
    if p.top_k > 0 {
        list.truncate(p.top_k);
    }
    if p.top_p < 1.0 {
        let max = list[0].0;
        let z: f64 = list.iter().map(|x| (x.0 - max).exp()).sum();
        let mut cum = 0.0;
        let mut keep = list.len().min(K_MAX);
        for (j, x) in list.iter().take(K_MAX).enumerate() {
            cum += (x.0 - max).exp() / z;
            if cum >= p.top_p as f64 {
                keep = j + 1;
                break;
            }
        }
        list.truncate(keep);
    }
    if truncating {
        list.truncate(K_MAX);
    }
    if p.min_p > 0.0 {
        let floor = list[0].0 + (p.min_p as f64).ln();
        list.retain(|x| x.0 >= floor);
    }
    let max = list[0].0;
    let mut out = vec![0.0; l.len()];
    let mut z = 0.0;
    for &(x, i) in &list {
        out[i] = ((x - max) / p.temperature as f64).exp();
        z += out[i];
    }
    out.iter_mut().for_each(|x| *x /= z);
    out
}

fn ln_gamma(x: f64) -> f64 {
    // Lanczos approximation (g = 7, 9 terms), accurate to ~1e-15 for x > 0.5.
    const C: [f64; 9] = [
        0.999_999_999_999_809_9,
        676.520_368_121_885_1,
        -1_259.139_216_722_402_8,
        771.323_428_777_653_1,
        -176.615_029_162_140_6,
        12.507_343_278_686_905,
        -0.138_571_095_265_720_12,
        9.984_369_578_019_572e-6,
        1.505_632_735_149_311_6e-7,
    ];
    let x = x - 1.0;
    let mut a = C[0];
    let t = x + 7.5;
    for (i, c) in C.iter().enumerate().skip(1) {
        a += c / (x + i as f64);
    }
    0.5 * (2.0 * std::f64::consts::PI).ln() + (x + 0.5) * t.ln() - t + a.ln()
}

/// Upper regularised incomplete gamma Q(a, x): series below a + 1, continued fraction above.
fn gamma_q(a: f64, x: f64) -> f64 {
    if x <= 0.0 {
        return 1.0;
    }
    let front = (-x + a * x.ln() - ln_gamma(a)).exp();
    if x < a + 1.0 {
        let (mut term, mut sum, mut n) = (1.0 / a, 1.0 / a, a);
        for _ in 0..10_000 {
            n += 1.0;
            term *= x / n;
            sum += term;
            if term.abs() < sum.abs() * 1e-15 {
                break;
            }
        }
        return 1.0 - sum * front;
    }
    let tiny = 1e-300;
    let mut b = x + 1.0 - a;
    let mut c = 1.0 / tiny;
    let mut d = 1.0 / b;
    let mut h = d;
    for i in 1..10_000 {
        let an = -(i as f64) * (i as f64 - a);
        b += 2.0;
        d = an * d + b;
        if d.abs() < tiny {
            d = tiny;
        }
        c = b + an / c;
        if c.abs() < tiny {
            c = tiny;
        }
        d = 1.0 / d;
        let del = d * c;
        h *= del;
        if (del - 1.0).abs() < 1e-15 {
            break;
        }
    }
    front * h
}

/// P(χ²_df ≥ stat).
pub fn chi2_sf(stat: f64, df: f64) -> f64 {
    gamma_q(df / 2.0, stat / 2.0)
}

/// Pearson's χ² of observed token counts against probabilities: tokens expected at least 5
/// times are a bin each, the rest one pooled bin (joined to the smallest bin when even the
/// pool is expected fewer than 5 times). Returns (statistic, degrees of freedom, p-value).
/// Panics if a token of probability 0 was drawn.
pub fn chi2_test(counts: &[u64], probs: &[f64]) -> (f64, usize, f64) {
    let n: u64 = counts.iter().sum();
    let mut bins: Vec<(f64, u64)> = Vec::new();
    let mut pool = (0.0, 0u64);
    for (i, (&c, &q)) in counts.iter().zip(probs).enumerate() {
        if q == 0.0 {
            assert_eq!(c, 0, "token {i} has probability 0 but was drawn {c} times");
            continue;
        }
        let e = q * n as f64;
        if e >= 5.0 {
            bins.push((e, c));
        } else {
            pool.0 += e;
            pool.1 += c;
        }
    }
    if pool.0 >= 5.0 || bins.is_empty() {
        bins.push(pool);
    } else if pool.0 > 0.0 {
        let smallest = bins.iter_mut().min_by(|a, b| a.0.total_cmp(&b.0)).unwrap();
        smallest.0 += pool.0;
        smallest.1 += pool.1;
    }
    let stat: f64 = bins.iter().map(|&(e, c)| (c as f64 - e).powi(2) / e).sum();
    let df = bins.len().saturating_sub(1).max(1);
    (stat, df, chi2_sf(stat, df as f64))
}

#[test]
fn chi2_survival_function_matches_tables() {
    // 95th percentiles of χ² for 1, 10 and 100 degrees of freedom.
    for (x, df) in [(3.841_459, 1.0), (18.307_038, 10.0), (124.342_113, 100.0)] {
        let p = chi2_sf(x, df);
        assert!((p - 0.05).abs() < 1e-5, "df {df}: {p}");
    }
    assert!((chi2_sf(2.0, 2.0) - (-1f64).exp()).abs() < 1e-12);
}

/// Fixed logits for the distribution tests: a few dozen plausible tokens over a tail of
/// unlikely ones, all distinct.
pub fn test_logits(vocab: usize) -> Vec<f32> {
    (0..vocab)
        .map(|i| {
            let x = i as f32;
            let head = if i % 37 < 3 && i < 40 * 37 { 6.0 } else { 0.0 };
            head + 2.5 * (x * 0.731).sin() + 0.8 * (x * 0.0173).cos() - 4.0
        })
        .collect()
}

pub fn params(temperature: f32) -> SamplingParams {
    SamplingParams {
        temperature,
        ..SamplingParams::greedy()
    }
}

/// Every option combination the sampler has, each with its context (for the penalty).
pub fn cases() -> Vec<(&'static str, SamplingParams, Vec<u32>)> {
    let hot: Vec<u32> = vec![0, 1, 37, 38, 74, 5, 500, 0, 1];
    vec![
        ("temperature 0.8", params(0.8), vec![]),
        (
            "top-k 40",
            SamplingParams {
                top_k: 40,
                ..params(1.0)
            },
            vec![],
        ),
        (
            "top-p 0.9",
            SamplingParams {
                top_p: 0.9,
                ..params(0.7)
            },
            vec![],
        ),
        (
            "min-p 0.05",
            SamplingParams {
                min_p: 0.05,
                ..params(1.2)
            },
            vec![],
        ),
        (
            "repeat penalty 1.5 over 6",
            SamplingParams {
                repeat_penalty: 1.5,
                repeat_last_n: 6,
                ..params(1.0)
            },
            hot.clone(),
        ),
        (
            "llama.cpp defaults",
            SamplingParams {
                top_k: 40,
                top_p: 0.95,
                min_p: 0.05,
                repeat_penalty: 1.1,
                repeat_last_n: 64,
                ..params(0.8)
            },
            hot,
        ),
    ]
}

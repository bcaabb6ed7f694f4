//! Batched CPU prefill against the token-by-token reference forward: logits at every prompt
//! position, the next step's logits after the prompt, and the KV cache it leaves, for lengths
//! around and across chunk boundaries.

use std::time::Instant;

use megainfer::generate::Backend;
use megainfer::model::{presets, random::random_weights, Config, Weights};
use megainfer::reference::rel_l2;
use megainfer::reference::CpuForward;
use megainfer::sampling::argmax;

fn tiny(hidden: usize, heads: usize, kv: usize, head_dim: usize, inter: usize) -> Config {
    let mut c = presets::by_name("smollm2-135m").unwrap();
    c.hidden_size = hidden;
    c.num_heads = heads;
    c.num_kv_heads = kv;
    c.head_dim = head_dim;
    c.intermediate_size = inter;
    c.num_layers = 2;
    c.vocab_size = 500;
    c
}

fn prompt(n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 7919 + 13) % vocab) as u32).collect()
}

/// Worst relative L2 difference seen over these tests: 2.2e-4 (f32 sums in another order,
/// which now and then round a K/V element to the neighbouring bf16 value); 2e-3 is 10x that.
/// A prefill bug (a wrong position, mask or cache row) moves logits by 1e-1 and more.
const TOL: f64 = 2e-3;

/// Prefill of `n` tokens in chunks of `chunk` against feeding them one by one: logits at
/// every position, then one more token fed the plain way on both sides.
fn check(cfg: &Config, w: &Weights, n: usize, chunk: usize, label: &str) -> f64 {
    let tokens = prompt(n + 1, cfg.vocab_size);
    let (input, next) = (&tokens[..n], tokens[n]);
    let mut by_token = CpuForward::new(cfg, w, n + 1);
    let want: Vec<Vec<f32>> = input
        .iter()
        .map(|&t| by_token.forward(&[t]).unwrap())
        .collect();
    let want_next = by_token.forward(&[next]).unwrap();

    let mut batched = CpuForward::new(cfg, w, n + 1);
    let got = batched.prefill_all(input, chunk).unwrap();
    assert_eq!(got.len(), n);
    let mut worst = 0f64;
    for (i, (g, wv)) in got.iter().zip(&want).enumerate() {
        let e = rel_l2(g, wv);
        worst = worst.max(e);
        assert!(
            e <= TOL,
            "{label} n={n} chunk={chunk}: position {i} rel L2 {e:.2e} > {TOL:.0e}"
        );
    }
    assert_eq!(batched.len(), n);
    let got_next = batched.forward(&[next]).unwrap();
    let e = rel_l2(&got_next, &want_next);
    assert!(
        e <= TOL,
        "{label} n={n} chunk={chunk}: next-step rel L2 {e:.2e} > {TOL:.0e}"
    );
    assert_eq!(
        argmax(&got_next),
        argmax(&want_next),
        "{label} n={n}: next greedy token"
    );

    // `prefill` (last logits only) gives the last row of `prefill_all` (the LM head of one
    // row sums in another order than that of a tile of four: f32 rounding only).
    let mut last_only = CpuForward::new(cfg, w, n + 1);
    let last = last_only.prefill(input, chunk).unwrap();
    let e_last = rel_l2(&last, got.last().unwrap());
    assert!(
        e_last <= 1e-5,
        "{label} n={n}: prefill vs prefill_all rel L2 {e_last:.2e}"
    );
    worst = worst.max(e);
    println!("{label} n={n} chunk={chunk}: worst rel L2 {worst:.2e} (next step {e:.2e})");
    worst
}

#[test]
fn prefill_matches_token_by_token_at_every_position() {
    // GQA groups 1, 3 and 4; head_dim 64 and 128 (CPU code is shape-generic, but the cache
    // offsets of each KV head are what a prefill bug would get wrong).
    let shapes = [
        ("gqa1-hd64", tiny(128, 2, 2, 64, 200)),
        ("gqa3-hd64", tiny(192, 3, 1, 64, 256)),
        ("gqa4-hd128", tiny(256, 8, 2, 128, 300)),
    ];
    for (label, cfg) in &shapes {
        let w = random_weights(cfg, 3);
        for n in [1, 2, 63, 64, 65] {
            for chunk in [16, 64, 256] {
                check(cfg, &w, n, chunk, label);
            }
        }
    }
}

#[test]
fn prefill_of_1000_tokens_across_chunks() {
    let cfg = tiny(64, 4, 2, 16, 96);
    let w = random_weights(&cfg, 9);
    for chunk in [1000, 333, 256, 7] {
        check(&cfg, &w, 1000, chunk, "tiny");
    }
}

#[test]
fn prefill_continues_a_sequence() {
    // A second prefill after a first one attends to the cache the first left.
    let cfg = tiny(128, 4, 2, 32, 200);
    let w = random_weights(&cfg, 5);
    let tokens = prompt(150, cfg.vocab_size);
    let mut by_token = CpuForward::new(&cfg, &w, 150);
    let want = by_token.forward_all(&tokens).unwrap();
    let mut batched = CpuForward::new(&cfg, &w, 150);
    batched.prefill(&tokens[..70], 32).unwrap();
    let got = batched.prefill_all(&tokens[70..], 32).unwrap();
    for (i, g) in got.iter().enumerate() {
        let e = rel_l2(g, &want[70 + i]);
        assert!(e <= TOL, "position {}: rel L2 {e:.2e}", 70 + i);
    }
}

#[test]
fn prefill_rejects_bad_input() {
    let cfg = tiny(64, 2, 1, 32, 96);
    let w = random_weights(&cfg, 1);
    let mut f = CpuForward::new(&cfg, &w, 8);
    let e = f.prefill(&[], 4).unwrap_err().to_string();
    assert!(e.contains("no tokens"), "{e}");
    let e = f.prefill(&[1, 2], 0).unwrap_err().to_string();
    assert!(e.contains("chunk size"), "{e}");
    let e = f.prefill(&[1, 9999], 4).unwrap_err().to_string();
    assert!(e.contains("9999") && e.contains("vocabulary"), "{e}");
    let e = f.prefill(&[1; 9], 4).unwrap_err().to_string();
    assert!(e.contains("exceeds the context"), "{e}");
    assert_eq!(f.len(), 0, "a rejected prefill leaves the cache empty");
}

/// Time to first token of a 300-token prompt on the SmolLM2-135M shape, batched prefill vs
/// feeding one token per step. Timing only: run with
/// `cargo test --release --test cpu_prefill -- --ignored --nocapture`.
/// CPU seconds this process has used (user + system), from /proc: on a machine shared with
/// other work, wall time alone says little.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap_or("")
        .split_whitespace()
        .collect();
    let tick = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (tick(11) + tick(12)) / 100.0
}

#[test]
#[ignore = "timing measurement (about a minute on 2 cores)"]
fn smollm2_300_token_ttft() {
    let cfg = presets::by_name("smollm2-135m").unwrap();
    let w = random_weights(&cfg, 0);
    let tokens = prompt(300, cfg.vocab_size);
    let mut batched = CpuForward::new(&cfg, &w, 301);
    let (t0, c0) = (Instant::now(), cpu_seconds());
    let a = batched.feed(&tokens).unwrap();
    let (prefill_s, prefill_cpu) = (t0.elapsed().as_secs_f64(), cpu_seconds() - c0);
    let mut by_token = CpuForward::new(&cfg, &w, 301);
    let (t0, c0) = (Instant::now(), cpu_seconds());
    let mut b = Vec::new();
    for &t in &tokens {
        b = by_token.forward(&[t]).unwrap();
    }
    let (token_s, token_cpu) = (t0.elapsed().as_secs_f64(), cpu_seconds() - c0);
    println!(
        "SmolLM2-135M shape, 300-token prompt, {} threads: batched prefill {prefill_s:.2} s wall \
         ({:.0} tok/s), {prefill_cpu:.2} CPU s; token by token {token_s:.2} s wall, {token_cpu:.2} CPU s; \
         {:.1}x faster (wall), {:.1}x less CPU time; rel L2 of the last logits {:.2e}",
        rayon::current_num_threads(),
        300.0 / prefill_s,
        token_s / prefill_s,
        token_cpu / prefill_cpu,
        rel_l2(&a, &b)
    );
}

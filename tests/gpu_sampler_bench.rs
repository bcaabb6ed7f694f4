//! The device sampler alone: microseconds per draw of the fused kernel (`smp_sample`) and of
//! the two-kernel sampler (`smp_blocks` + `smp_final`), on SmolLM2-135M's and Llama-3.2-1B's
//! vocabularies, for the option sets decoding uses; and a check that both draw the same token
//! at every step.
//!
//! Run on the GPU machine (built here, no build step there):
//!     target/release/deps/gpu_sampler_bench-* --include-ignored --nocapture --test-threads=1
//! or `cargo test --release --test gpu_sampler_bench -- --include-ignored --nocapture`.
//!
//! Each case first draws `DRAWS` tokens with each sampler from the same start (the tokens chain
//! on the device, as in decoding: each draw advances the position and enters the penalty's
//! window) and compares them; then it replays a CUDA graph of `DRAWS` back-to-back draws, with
//! and without programmatic dependent launch, and prints the time per draw (launch gaps
//! included, host launch cost excluded, as in the graph paths).

#[path = "common/gpu.rs"]
#[allow(dead_code)]
mod gpu_common;
use gpu_common::gpu;

use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaSlice;
use megainfer::gpu::device::{ptr, Gpu};
use megainfer::sampling::device::{DeviceSampler, Kernels};
use megainfer::sampling::SamplingParams;

const DRAWS: usize = 200;
/// The position of the first draw; the history before it is random tokens.
const FIRST: usize = 100;
/// Positions the history holds: the checked draws, then the graph's warm-up and timed replays.
const HISTORY: usize = FIRST + DRAWS * 12;
const REPLAYS: usize = 7;

/// Deterministic pseudo-random numbers (SplitMix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1).
    fn uniform(&mut self) -> f64 {
        ((self.next() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    fn normal(&mut self) -> f64 {
        let (u, v) = (self.uniform(), self.uniform());
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    }
}

/// Logits like a language model's: normal(0, 3), and eight tokens well above the rest.
fn logits(vocab: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng(seed);
    let mut l: Vec<f32> = (0..vocab).map(|_| (3.0 * rng.normal()) as f32).collect();
    for _ in 0..8 {
        let i = (rng.next() % vocab as u64) as usize;
        l[i] = 12.0 + 8.0 * rng.uniform() as f32;
    }
    l
}

fn configs() -> Vec<(&'static str, SamplingParams)> {
    let base = SamplingParams {
        seed: 1234,
        ..SamplingParams::greedy()
    };
    vec![
        (
            "T 0.8, top-p 0.95",
            SamplingParams {
                temperature: 0.8,
                top_p: 0.95,
                ..base
            },
        ),
        (
            "T 0.8, top-k 40",
            SamplingParams {
                temperature: 0.8,
                top_k: 40,
                ..base
            },
        ),
        (
            "T 0.7, min-p 0.05, penalty 1.1 over 64",
            SamplingParams {
                temperature: 0.7,
                min_p: 0.05,
                repeat_penalty: 1.1,
                repeat_last_n: 64,
                ..base
            },
        ),
        (
            "T 1, no truncation",
            SamplingParams {
                temperature: 1.0,
                ..base
            },
        ),
    ]
}

/// The buffers one sampler draws with: the logits, the token meta and the history.
struct Buffers {
    logits: CudaSlice<f32>,
    meta: CudaSlice<u32>,
    history: CudaSlice<u32>,
    start_history: Vec<u32>,
}

impl Buffers {
    /// Back to the first position and the initial history.
    fn reset(&mut self, g: &Gpu) {
        let s = &g.stream;
        s.memcpy_htod(
            &[self.start_history[FIRST], FIRST as u32, 0, 0],
            &mut self.meta,
        )
        .unwrap();
        s.memcpy_htod(&self.start_history, &mut self.history)
            .unwrap();
    }

    fn enqueue(&self, g: &Gpu, sampler: &DeviceSampler, pdl: bool) -> anyhow::Result<()> {
        let s = &g.stream;
        let (lp, mp, hp) = (
            ptr(&self.logits, s),
            ptr(&self.meta, s),
            ptr(&self.history, s),
        );
        sampler.enqueue(s, lp, mp, mp, hp, pdl, None)
    }
}

/// `DRAWS` chained draws from the first position: the tokens.
fn draws(g: &Gpu, b: &mut Buffers, sampler: &DeviceSampler) -> Vec<u32> {
    b.reset(g);
    for _ in 0..DRAWS {
        b.enqueue(g, sampler, false).unwrap();
    }
    let h = g.stream.clone_dtoh(&b.history).unwrap();
    h[FIRST + 1..FIRST + 1 + DRAWS].to_vec()
}

/// Microseconds per draw over a graph of `DRAWS` draws (median of `REPLAYS` replays after
/// two warm-up replays).
fn time_draws(g: &Gpu, b: &mut Buffers, sampler: &DeviceSampler, pdl: bool) -> f64 {
    b.reset(g);
    let s = &g.stream;
    s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap();
    let mut res = Ok(());
    for _ in 0..DRAWS {
        res = res.and_then(|_| b.enqueue(g, sampler, pdl));
    }
    let graph = s.end_capture(CUgraphInstantiate_flags(0)).unwrap();
    res.unwrap();
    let graph = graph.expect("capture made a graph");
    let event = || {
        g.ctx
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .unwrap()
    };
    let (start, stop) = (event(), event());
    let mut times = Vec::new();
    for rep in 0..REPLAYS {
        start.record(s).unwrap();
        graph.launch().unwrap();
        stop.record(s).unwrap();
        stop.synchronize().unwrap();
        if rep >= 2 {
            times.push(start.elapsed_ms(&stop).unwrap() as f64 * 1e3);
        }
    }
    times.sort_by(f64::total_cmp);
    times[times.len() / 2] / DRAWS as f64
}

#[test]
#[ignore = "needs a GPU"]
fn sampler_bench() {
    let g = gpu();
    println!("{}", g.name);
    for (model, vocab) in [("SmolLM2-135M", 49_152usize), ("Llama-3.2-1B", 128_256)] {
        let host = logits(vocab, vocab as u64);
        let mut rng = Rng(7);
        let start_history: Vec<u32> = (0..HISTORY)
            .map(|q| {
                if q <= FIRST {
                    (rng.next() % vocab as u64) as u32
                } else {
                    0
                }
            })
            .collect();
        let mut b = Buffers {
            logits: g.upload(&host, "logits").unwrap(),
            meta: g.alloc_zeros(4, "meta").unwrap(),
            history: g.alloc_zeros(HISTORY, "history").unwrap(),
            start_history,
        };
        let mut two = DeviceSampler::with_kernels(&g, vocab, Kernels::TwoPass).unwrap();
        // The fused kernel at every chunk its last CTA can merge; 4096 is the two kernels' own
        // chunk, so its sums (and draws) are bit-identical to theirs.
        let mut fused: Vec<(usize, DeviceSampler)> = [4096, 2048, 1024]
            .into_iter()
            .filter_map(|c| {
                DeviceSampler::with_chunk(&g, vocab, Kernels::Fused, c)
                    .ok()
                    .map(|s| (c, s))
            })
            .collect();
        println!(
            "\n{model} (vocabulary {vocab}): µs per draw, graph of {DRAWS} draws \
             (fused/N: N logits per CTA; 4096 is the two kernels', {} the paths')",
            megainfer::sampling::device::chunk_for_vocab(vocab)
        );
        for (name, p) in configs() {
            two.set_params(&g.stream, &p).unwrap();
            let old = draws(&g, &mut b, &two);
            assert!(
                old.iter().all(|&t| (t as usize) < vocab),
                "{model}, {name}: the two-kernel sampler drew a token out of range"
            );
            let distinct: std::collections::HashSet<_> = old.iter().collect();
            let t_two = time_draws(&g, &mut b, &two, false);
            let t_two_pdl = time_draws(&g, &mut b, &two, true);
            let mut line = format!(
                "  {name:<40} two-kernel {t_two:6.2} (PDL {t_two_pdl:6.2}), {} distinct tokens",
                distinct.len()
            );
            for (chunk, sampler) in &mut fused {
                sampler.set_params(&g.stream, &p).unwrap();
                let fell_back = sampler.fallbacks(&g).unwrap();
                let long = sampler.long_merges(&g).unwrap();
                let new = draws(&g, &mut b, sampler);
                let fell_back = sampler.fallbacks(&g).unwrap() - fell_back;
                let long = sampler.long_merges(&g).unwrap() - long;
                let differ = (0..DRAWS).filter(|&i| old[i] != new[i]).count();
                // The searches after a failed first attempt draw the same tokens too.
                sampler.force_searches(true);
                let searched = draws(&g, &mut b, sampler);
                sampler.force_searches(false);
                let differ_searched = (0..DRAWS).filter(|&i| new[i] != searched[i]).count();
                assert_eq!(
                    differ_searched, 0,
                    "{model}, {name}, chunk {chunk}: the draws after failed first attempts differ"
                );
                if *chunk == 4096 {
                    if let Some(i) = (0..DRAWS).find(|&i| old[i] != new[i]) {
                        panic!(
                            "{model}, {name}: draw {i} (position {}) differs: two-kernel {}, fused {}",
                            FIRST + i,
                            old[i],
                            new[i]
                        );
                    }
                } else {
                    // Other chunks sum the softmax in another order: only a draw at a
                    // rounding-level tie of the top-p cut may differ.
                    assert!(
                        differ <= 1,
                        "{model}, {name}, chunk {chunk}: {differ} of {DRAWS} draws differ from the two kernels'"
                    );
                }
                let t = time_draws(&g, &mut b, sampler, false);
                let t_pdl = time_draws(&g, &mut b, sampler, true);
                let fast = if sampler.fast() {
                    format!(", {fell_back} first attempts failed, {long} merged the long way")
                } else {
                    String::new()
                };
                line += &format!(
                    "   fused/{chunk} {t:6.2} (PDL {t_pdl:6.2}, {differ} of {DRAWS} differ{fast})"
                );
            }
            println!("{line}");
        }
    }
}

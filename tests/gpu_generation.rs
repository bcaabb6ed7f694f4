//! The megakernel's generations: many greedy steps inside one launch, against one launch per
//! step (the same kernel's arithmetic, so the tokens and the final logits must be identical),
//! stopping on the device at a stop token, at the host's request, at each launch's budget,
//! and across context buckets. Ignored by a plain `cargo test`; they fail without a GPU.

#[path = "common/gpu.rs"]
#[allow(dead_code)]
mod gpu_common;
use gpu_common::{gpu, small_cases, tiny};

use megainfer::generate::Backend;
use megainfer::gpu::device::Gpu;
use megainfer::gpu::megakernel::MegakernelPath;
use megainfer::gpu::model::DeviceModel;
use megainfer::gpu::stepping::Steps;
use megainfer::model::{random::random_weights, Config, Weights};
use megainfer::sampling::{argmax, Sampler, SamplingParams};

const N: usize = 40;

/// A megakernel path on `cfg` (context buckets as `run` makes them) after `prompt`; the first
/// greedy token.
fn path_after<'g>(
    gpu: &'g Gpu,
    dm: &'g DeviceModel,
    max_seq: usize,
    prompt: &[u32],
) -> (MegakernelPath<'g>, u32) {
    let mut mk = MegakernelPath::bucketed(gpu, dm, max_seq, &Default::default()).unwrap();
    let first = argmax(&mk.feed(prompt).unwrap());
    (mk, first)
}

/// `n` greedy tokens after `prompt` with `per_launch` steps per launch, and the logits the
/// last step left (the device's, read directly: no further step runs).
fn greedy(
    gpu: &Gpu,
    dm: &DeviceModel,
    max_seq: usize,
    prompt: &[u32],
    n: usize,
    per_launch: usize,
) -> (Vec<u32>, Vec<f32>) {
    let (mut mk, first) = path_after(gpu, dm, max_seq, prompt);
    mk.set_tokens_per_launch(per_launch);
    let toks = mk.decode_greedy(first, n).unwrap();
    let logits = gpu.stream.clone_dtoh(mk.logits()).unwrap();
    (toks, logits)
}

fn qwen3_tiny() -> (Config, Weights) {
    let mut cfg = tiny(256, 4, 2, 128, 640);
    cfg.qk_norm = true;
    let w = random_weights(&cfg, 5);
    (cfg, w)
}

#[test]
#[ignore = "needs a GPU"]
fn generations_equal_one_launch_per_step() {
    let gpu = gpu();
    let mut cases: Vec<(String, Config, Weights, Vec<u32>)> = small_cases();
    let (qc, qw) = qwen3_tiny();
    cases.push(("qwen3-tiny".into(), qc, qw, vec![3, 141, 59, 26, 535]));
    for (label, cfg, w, prompt) in cases {
        let dm = DeviceModel::upload(&gpu, &cfg, &w).unwrap();
        let (want, want_logits) = greedy(&gpu, &dm, 64, &prompt, N, 1);
        for per_launch in [usize::MAX, 7, 2] {
            let (got, logits) = greedy(&gpu, &dm, 64, &prompt, N, per_launch);
            assert_eq!(got, want, "{label}: {per_launch} steps per launch");
            // The same kernel on the same inputs in the same order.
            assert!(
                logits == want_logits,
                "{label}: the last step's logits differ ({per_launch} steps per launch)"
            );
        }
        println!("{label}: {N} tokens in one launch, in launches of 7 and of 2 equal one launch per step");
    }
}

/// Runs a generation from `prompt` that stops after a token of `stop`, checks it ran exactly
/// through `want[at]` and then resumes to `want`'s end.
fn stop_and_resume(
    gpu: &Gpu,
    dm: &DeviceModel,
    prompt: &[u32],
    want: &[u32],
    at: usize,
    label: &str,
) {
    let stop = want[at];
    let (mut mk, first) = path_after(gpu, dm, 64, prompt);
    let pos = mk.seq().pos;
    mk.write_meta(first, pos).unwrap();
    let mut got = Vec::new();
    let run = mk
        .generate(want.len(), usize::MAX, &[stop], &mut |t| {
            got.push(t);
            Ok(true)
        })
        .unwrap();
    println!("{label}: stop token {stop} at step {at}: the generation ran {run:?}");
    assert_eq!(got, want[..=at], "{label}: tokens up to the stop token");
    assert_eq!((run.ran, run.handled), (at + 1, at + 1), "{label}");
    // Resumes from the token the device left in its meta, as decode_stream would.
    mk.seq().pos = pos + run.handled;
    mk.seq().meta_current = run.last;
    got.extend(mk.decode_greedy(stop, want.len() - at - 1).unwrap());
    assert_eq!(got, want, "{label}: after resuming");
}

#[test]
#[ignore = "needs a GPU"]
fn a_generation_stops_after_a_stop_token_and_resumes() {
    let gpu = gpu();
    // Random models often repeat one token: look for a greedy run in which a token first
    // appears a few steps in, to stop there (and stop at the first token too).
    let mut cases = small_cases();
    let (qc, qw) = qwen3_tiny();
    cases.push(("qwen3-tiny".into(), qc, qw, vec![]));
    let mut found = false;
    'search: for (label, cfg, w, _) in &cases {
        let dm = DeviceModel::upload(&gpu, cfg, w).unwrap();
        for seed in 0..8u32 {
            let prompt: Vec<u32> = (0..9).map(|k| (k * 131 + seed * 17 + 7) % 1000).collect();
            let (want, _) = greedy(&gpu, &dm, 64, &prompt, N, 1);
            let Some(at) = (3..N).find(|&i| !want[..i].contains(&want[i])) else {
                continue;
            };
            stop_and_resume(
                &gpu,
                &dm,
                &prompt,
                &want,
                at,
                &format!("{label} prompt {seed}"),
            );
            stop_and_resume(
                &gpu,
                &dm,
                &prompt,
                &want,
                0,
                &format!("{label} prompt {seed}"),
            );
            found = true;
            break 'search;
        }
    }
    assert!(
        found,
        "no greedy run with a token new after step 3 among the cases tried"
    );
}

#[test]
#[ignore = "needs a GPU"]
fn a_generation_stops_at_the_hosts_request_and_resumes() {
    let gpu = gpu();
    let (label, cfg, w, prompt) = small_cases().swap_remove(2);
    let dm = DeviceModel::upload(&gpu, &cfg, &w).unwrap();
    let (want, _) = greedy(&gpu, &dm, 64, &prompt, N, 1);
    const STOP: usize = 5;
    let (mut mk, first) = path_after(&gpu, &dm, 64, &prompt);
    let mut sampler = Sampler::new(SamplingParams::greedy());
    sampler.accept(&prompt);
    sampler.accept(&[first]);
    let mut got = Vec::new();
    mk.decode_stream(first, N, &[], &mut sampler, &mut |t| {
        got.push(t);
        Ok(got.len() < STOP)
    })
    .unwrap();
    assert_eq!(got, want[..STOP], "{label}: tokens before the host's stop");
    let last = *got.last().unwrap();
    sampler.accept(&[last]);
    mk.decode_stream(last, N - STOP, &[], &mut sampler, &mut |t| {
        got.push(t);
        Ok(true)
    })
    .unwrap();
    assert_eq!(got, want, "{label}: after resuming");
    println!("{label}: stopped by the host after {STOP} tokens, resumed, {N} tokens equal");
}

#[test]
#[ignore = "needs a GPU"]
fn a_generation_crosses_context_buckets() {
    let gpu = gpu();
    // SmolLM2's attention shape at a context the cost model splits into buckets.
    let mut cfg = tiny(576, 9, 3, 64, 1536);
    cfg.num_layers = 2;
    let w = random_weights(&cfg, 3);
    let dm = DeviceModel::upload(&gpu, &cfg, &w).unwrap();
    const MAX_SEQ: usize = 1024;
    const GEN: usize = 300;
    // Positions 380..680: across the bounds at 512 (one head an instruction, then parts).
    let prompt: Vec<u32> = (0..380).map(|k| (k * 37 % 1000) as u32).collect();
    let (mk, _) = path_after(&gpu, &dm, MAX_SEQ, &prompt);
    let (buckets, _) = mk.buckets();
    drop(mk);
    println!("buckets (upto, parts): {buckets:?}");
    assert!(buckets.len() > 1, "the test needs several buckets");
    let (want, want_logits) = greedy(&gpu, &dm, MAX_SEQ, &prompt, GEN, 1);
    let (got, logits) = greedy(&gpu, &dm, MAX_SEQ, &prompt, GEN, usize::MAX);
    assert_eq!(got, want, "tokens across the buckets");
    assert!(logits == want_logits, "the last step's logits differ");
}

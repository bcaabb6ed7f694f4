//! GPU paths on real weights (SmolLM2-135M-Instruct, the default model) against the CPU
//! reference. Ignored by a plain `cargo test`; they fail when run without a GPU.

#[path = "common/gpu.rs"]
#[allow(dead_code)]
mod gpu_common;
use gpu_common::gpu;
use megainfer::reference::rel_l2;

use megainfer::generate::Backend;
use megainfer::gpu::baseline::{BaselinePath, Mode};
use megainfer::gpu::device::Gpu;
use megainfer::gpu::megakernel::{schedule_for, MegakernelPath};
use megainfer::gpu::model::DeviceModel;
use megainfer::reference::CpuForward;
use megainfer::sampling::{argmax, top_k};

struct Setup {
    gpu: Gpu,
    model: megainfer::model::Model,
    prompt: Vec<u32>,
}

/// Tolerances: about ten times the worst teacher-forced relative L2 error of the logits over
/// 32 steps measured on an H100 (docs/testing.md): 3.35e-3 for the megakernel, 4.21e-3 for the
/// baselines. Real weights have larger activations than the random models, so the bf16
/// rounding of activations on the GPU shows more here than on small random shapes.
const TOL_MEGAKERNEL: f64 = 3.5e-2;
const TOL_BASELINE: f64 = 4e-2;

fn setup() -> Setup {
    let gpu = gpu();
    let path = megainfer::fetch::default_model().expect("default model");
    let mut model = megainfer::model::load(&path).expect("loading the default model");
    // As `--dtype bf16`: the megakernel reads bf16 weights (tests/gpu_quant.rs runs the file's
    // Q4_1/Q8_0 matrices as stored on the graph paths).
    model.weights.widen_to_bf16();
    let prompt = model
        .tokenizer
        .as_ref()
        .unwrap()
        .encode("The capital of France is")
        .unwrap();
    Setup { gpu, model, prompt }
}

/// Greedy continuation on the CPU reference, and its logits at every step.
fn cpu_greedy(s: &Setup, n: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut cpu = CpuForward::new(&s.model.config, &s.model.weights, 512);
    let mut logits = vec![cpu.forward(&s.prompt).unwrap()];
    let mut toks = vec![argmax(&logits[0])];
    while toks.len() < n {
        logits.push(cpu.forward(&[*toks.last().unwrap()]).unwrap());
        toks.push(argmax(logits.last().unwrap()));
    }
    (toks, logits)
}

/// Feeds prompt + reference tokens (teacher forcing), checking logits at every step; returns
/// the path's logits at every step.
fn check_path(
    s: &Setup,
    path: &mut dyn Backend,
    label: &str,
    want_toks: &[u32],
    want_logits: &[Vec<f32>],
    tol: f64,
) -> Vec<Vec<f32>> {
    let mut worst = 0f64;
    let mut all = Vec::new();
    for (i, want) in want_logits.iter().enumerate() {
        let got = if i == 0 {
            path.feed(&s.prompt).unwrap()
        } else {
            path.feed(&[want_toks[i - 1]]).unwrap()
        };
        let err = rel_l2(&got, want);
        worst = worst.max(err);
        assert!(
            err <= tol,
            "{label}: teacher-forced step {i}: rel L2 {err:.2e} > {tol:.0e}"
        );
        all.push(got);
    }
    println!(
        "{label}: teacher-forced {} steps, worst rel L2 {worst:.2e} (tolerance {tol:.0e})",
        want_logits.len()
    );
    all
}

fn free_run(path: &mut dyn Backend, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut toks = vec![argmax(&path.feed(prompt).unwrap())];
    while toks.len() < n {
        toks.push(path.feed_greedy(*toks.last().unwrap()).unwrap());
    }
    toks
}

/// Free-running greedy tokens must equal the reference's, or part only at a near-tie: at the
/// first difference each side's token must be in the other side's top 5 (the check vLLM uses
/// against HF); after that the runs are not compared (docs/testing.md). Until the first
/// difference both sides saw the same tokens, so the teacher-forced logits at that step are
/// what each free run chose from.
fn assert_greedy_agrees(
    label: &str,
    got: &[u32],
    want: &[u32],
    got_logits: &[Vec<f32>],
    want_logits: &[Vec<f32>],
) {
    match got.iter().zip(want).position(|(a, b)| a != b) {
        None => println!(
            "{label}: {} greedy tokens identical to the CPU reference",
            got.len()
        ),
        Some(i) => {
            let want_top5 = top_k(&want_logits[i], 5);
            let got_top5 = top_k(&got_logits[i], 5);
            println!(
                "{label}: greedy run parts from the reference at token {i}: {} (reference top 5 \
                 {want_top5:?}) vs reference {} (this path's top 5 {got_top5:?})",
                got[i], want[i]
            );
            assert!(
                want_top5.contains(&got[i]),
                "{label}: greedy token {i} = {} not in the reference's top 5 {want_top5:?}",
                got[i]
            );
            assert!(
                got_top5.contains(&want[i]),
                "{label}: reference token {i} = {} not in this path's top 5 {got_top5:?}",
                want[i]
            );
            println!(
                "{label}: a near-tie (each token in the other's top 5); not compared after it"
            );
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn smollm2_gpu_paths_match_reference() {
    let s = setup();
    let (want_toks, want_logits) = cpu_greedy(&s, 32);
    let text = s
        .model
        .tokenizer
        .as_ref()
        .unwrap()
        .decode(&want_toks)
        .unwrap();
    println!("CPU reference greedy: {text:?}");
    let dm = DeviceModel::upload(&s.gpu, &s.model.config, &s.model.weights).unwrap();
    let sched = schedule_for(&s.model.config, &s.gpu, 512, None).unwrap();
    {
        let mut mk = MegakernelPath::new(&s.gpu, &dm, &sched, 512).unwrap();
        let got_logits = check_path(
            &s,
            &mut mk,
            "megakernel",
            &want_toks,
            &want_logits,
            TOL_MEGAKERNEL,
        );
        let mut mk = MegakernelPath::new(&s.gpu, &dm, &sched, 512).unwrap();
        let got = free_run(&mut mk, &s.prompt, 32);
        assert_greedy_agrees("megakernel", &got, &want_toks, &got_logits, &want_logits);
    }
    for mode in [Mode::Graph, Mode::GraphPdl, Mode::Eager] {
        let mut g = BaselinePath::new(&s.gpu, &dm, mode, 512).unwrap();
        let got_logits = check_path(
            &s,
            &mut g,
            mode.name(),
            &want_toks,
            &want_logits,
            TOL_BASELINE,
        );
        let mut g = BaselinePath::new(&s.gpu, &dm, mode, 512).unwrap();
        let got = free_run(&mut g, &s.prompt, 32);
        assert_greedy_agrees(mode.name(), &got, &want_toks, &got_logits, &want_logits);
    }
}

#[test]
#[ignore = "needs a GPU"]
fn smollm2_megakernel_and_graph_agree_for_256_tokens() {
    let s = setup();
    let dm = DeviceModel::upload(&s.gpu, &s.model.config, &s.model.weights).unwrap();
    let sched = schedule_for(&s.model.config, &s.gpu, 512, None).unwrap();
    let mut mk = MegakernelPath::new(&s.gpu, &dm, &sched, 512).unwrap();
    let mut g = BaselinePath::new(&s.gpu, &dm, Mode::Graph, 512).unwrap();
    let first_mk = argmax(&mk.feed(&s.prompt).unwrap());
    let first_g = argmax(&g.feed(&s.prompt).unwrap());
    assert_eq!(first_mk, first_g);
    let a = mk.decode_greedy(first_mk, 255).unwrap();
    let b = g.decode_greedy(first_g, 255).unwrap();
    match a.iter().zip(&b).position(|(x, y)| x != y) {
        None => println!("megakernel and graph: 256 identical greedy tokens"),
        Some(i) => panic!(
            "megakernel and graph part at token {}: {} vs {}",
            i + 1,
            a[i],
            b[i]
        ),
    }
}

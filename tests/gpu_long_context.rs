//! Long contexts on the GPU: teacher-forced logits at positions past 16K on a small random
//! model, and a passkey hidden in about 7,000 tokens of the default model's filler. Ignored by
//! a plain `cargo test`; they fail when run without a GPU (scripts/gpu-check.sh runs them).

#[path = "common/gpu.rs"]
#[allow(dead_code)]
mod gpu_common;
use gpu_common::{check_positions, gpu, prompt_then_steps, tiny};

use megainfer::generate::Backend;
use megainfer::gpu::model::DeviceModel;
use megainfer::gpu::paths::{GpuPath, PathKind};
use megainfer::model::random::random_weights;
use megainfer::reference::CpuForward;
use megainfer::sampling::argmax;

/// The prompt goes through batched prefill (its K/V rounded as prefill computes them), as in
/// tests/gpu_prefill.rs, whose tolerance this takes.
const TOL_LONG: f64 = 1e-2;

/// Positions 16,400.. on every path: a 16,400-token prompt through batched prefill, then four
/// decode steps, each step's logits against the CPU reference's.
#[test]
#[ignore = "needs a GPU"]
fn teacher_forced_past_16k_positions() {
    let gpu = gpu();
    const LEN: usize = 16_400;
    const MAX_SEQ: usize = 16_512;
    let mut cfg = tiny(192, 3, 1, 64, 520);
    cfg.max_position_embeddings = MAX_SEQ;
    let w = random_weights(&cfg, 41);
    let dm = DeviceModel::upload(&gpu, &cfg, &w).unwrap();
    let prompt: Vec<u32> = (0..LEN as u32).map(|k| (k * 131 + 17) % 1000).collect();
    let steps = [5u32, 600, 999, 1];
    let mut cpu = CpuForward::new(&cfg, &w, MAX_SEQ);
    let want = prompt_then_steps(&mut cpu, &prompt, &steps);
    for kind in PathKind::ALL {
        let mut path = GpuPath::new(kind, &gpu, &dm, MAX_SEQ, MAX_SEQ).unwrap();
        let got = prompt_then_steps(&mut path, &prompt, &steps);
        let worst = check_positions(kind.name(), &got, &want, LEN - 1, TOL_LONG);
        println!(
            "{} positions {}..{}: worst rel L2 {worst:.2e} (tolerance {TOL_LONG:.0e})",
            kind.name(),
            LEN - 1,
            LEN - 1 + steps.len()
        );
    }
}

/// The megakernel as `run` makes it (one set of streams per context bucket up to max_seq): a
/// 506-token prompt through batched prefill, then twelve decode steps across the switch at 512
/// positions (up to 512 one part, a query head an instruction; then split in parts of whole
/// groups, costed at 769 positions; SmolLM2's attention shape: 3 KV heads of 3 query heads),
/// each step's logits against the CPU reference's.
#[test]
#[ignore = "needs a GPU"]
fn megakernel_switches_buckets_after_prefill() {
    let gpu = gpu();
    const PROMPT: usize = 506;
    const MAX_SEQ: usize = 1024;
    let cfg = tiny(192, 9, 3, 64, 520);
    let w = random_weights(&cfg, 43);
    let dm = DeviceModel::upload(&gpu, &cfg, &w).unwrap();
    let prompt: Vec<u32> = (0..PROMPT as u32).map(|k| (k * 89 + 7) % 1000).collect();
    let steps: Vec<u32> = (0..12u32).map(|k| (k * 13 + 1) % 1000).collect();
    let mut cpu = CpuForward::new(&cfg, &w, MAX_SEQ);
    let want = prompt_then_steps(&mut cpu, &prompt, &steps);
    let mut path = GpuPath::new(PathKind::Megakernel, &gpu, &dm, MAX_SEQ, MAX_SEQ).unwrap();
    let buckets = path.as_megakernel().unwrap().buckets().0;
    println!("megakernel buckets (up to, parts): {buckets:?}");
    assert!(
        buckets.len() >= 2 && buckets[0].0 == 512,
        "expected a bucket up to 512 positions and another after it: {buckets:?}"
    );
    let got = prompt_then_steps(&mut path, &prompt, &steps);
    let worst = check_positions("megakernel", &got, &want, PROMPT - 1, TOL_LONG);
    let (_, last) = path.as_megakernel().unwrap().buckets();
    assert_eq!(
        last,
        buckets.len() - 1,
        "the last steps run the last bucket"
    );
    println!(
        "megakernel positions {}..{}: worst rel L2 {worst:.2e} (tolerance {TOL_LONG:.0e})",
        PROMPT - 1,
        PROMPT - 1 + steps.len()
    );
}

/// A five-digit number in about 7,000 tokens of filler, asked for at the end: the CPU reference
/// finds it, and every GPU path answers with the CPU reference's greedy tokens.
#[test]
#[ignore = "needs a GPU"]
fn passkey_in_7000_tokens_gets_the_reference_answer_on_every_path() {
    let path = megainfer::fetch::default_model().expect("default model");
    let mut model = megainfer::model::load(&path).expect("loading the default model");
    // Every path, the megakernel included, on the same weights: the megakernel reads bf16.
    model.weights.widen_to_bf16();
    let tok = model.tokenizer.as_ref().unwrap();
    let filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ";
    let text = format!(
        "There is an important number hidden inside a lot of irrelevant text. Find it and remember it.\n{}The pass key is 68217. Remember it. 68217 is the pass key.\n{}What is the pass key? The pass key is",
        filler.repeat(160),
        filler.repeat(150)
    );
    let prompt = tok.encode(&text).unwrap();
    assert!(
        (6500..7800).contains(&prompt.len()),
        "{} prompt tokens",
        prompt.len()
    );
    const ANSWER: usize = 6;
    let max_seq = prompt.len() + ANSWER + 1;
    let mut cpu = CpuForward::new(&model.config, &model.weights, max_seq);
    // Batched prefill, as `run` on the CPU feeds a prompt.
    let mut want = vec![argmax(&cpu.feed(&prompt).unwrap())];
    while want.len() < ANSWER {
        want.push(argmax(&cpu.forward(&[*want.last().unwrap()]).unwrap()));
    }
    let answer = tok.decode(&want).unwrap_or_default();
    println!(
        "{} prompt tokens; the CPU reference answers {answer:?} ({want:?})",
        prompt.len()
    );
    // The reference itself finds the number (measured: " 68217" after 7,496 tokens).
    assert!(
        answer.contains("68217"),
        "the CPU reference answered {answer:?}"
    );
    let gpu = gpu();
    let dm = DeviceModel::upload(&gpu, &model.config, &model.weights).unwrap();
    for kind in PathKind::ALL {
        let mut p = GpuPath::new(kind, &gpu, &dm, max_seq, max_seq).unwrap();
        let first = argmax(&p.feed(&prompt).unwrap());
        let mut got = vec![first];
        got.extend(p.decode_greedy(first, ANSWER - 1).unwrap());
        println!(
            "{}: {:?}",
            kind.name(),
            tok.decode(&got).unwrap_or_default()
        );
        assert_eq!(
            got,
            want,
            "{}: the answer differs from the CPU reference's",
            kind.name()
        );
    }
}

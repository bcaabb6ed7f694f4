//! `megainfer soak`: a long greedy run on two GPU paths at once, token by token compared. Both
//! paths compute the same forward pass, so over many thousands of tokens a divergence can point
//! at a synchronisation or memory bug that short tests miss. The paths sum in different orders,
//! so at a near-tie (two logits closer than their rounding) they may also pick different
//! tokens legitimately: each divergence is judged against the CPU reference's logits at that
//! position. It is a near-tie when the reference's two logits are within the tolerance the GPU
//! paths are tested to (`TIE`) and both paths' logits there match the reference within it;
//! anything else is a mismatch, and the command fails.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};

use crate::generate::Backend;
use crate::gpu::device::Gpu;
use crate::gpu::model::DeviceModel;
use crate::gpu::paths::{GpuPath, PathKind};
use crate::model;
use crate::reference::{rel_l2, CpuForward};
use crate::sampling::argmax;

/// Relative L2 error of GPU logits against the CPU reference that the GPU tests accept on the
/// default model (tests/gpu_smollm2.rs: measured 1.1e-2); a near-tie's two logits must differ
/// by less than this times the logits' RMS.
const TIE: f64 = 4e-2;

#[derive(clap::Args, Debug)]
pub struct SoakArgs {
    /// HF model directory or .gguf file (default: SmolLM2-135M-Instruct Q4_1).
    #[arg(short = 'm', long)]
    pub model: Option<PathBuf>,
    /// Greedy tokens to generate on each path (and compare).
    #[arg(long, default_value_t = 100_000)]
    pub tokens: usize,
    /// Context per episode; when it fills, both paths restart from the next prompt.
    #[arg(long, default_value_t = 2048)]
    pub context: usize,
    /// The path compared with the megakernel.
    #[arg(long, value_enum, default_value_t = PathKind::Graph)]
    pub against: PathKind,
    /// Tokens decoded per call (the megakernel runs this many steps per launch).
    #[arg(long, default_value_t = 256)]
    pub chunk: usize,
}

/// Fresh prompts, cycled through: one per episode.
const PROMPTS: [&str; 6] = [
    "The capital of France is",
    "Write a short story about a lighthouse keeper.",
    "def fibonacci(n):",
    "List the planets of the solar system in order.",
    "Once upon a time, in a village by the sea,",
    "Explain how a transistor works.",
];

pub fn run(args: &SoakArgs) -> Result<()> {
    if args.against == PathKind::Megakernel {
        bail!("--against: pick a path other than the megakernel (graph, graph-pdl or eager)");
    }
    if args.tokens == 0 || args.chunk == 0 {
        bail!("--tokens and --chunk must be at least 1");
    }
    let path = crate::cli::run::resolve_model_path(&args.model)?;
    let mut model = model::load(&path)?;
    // The megakernel reads bf16 only: both sides of the comparison run the widened weights.
    model.weights.widen_to_bf16();
    let tok = model
        .tokenizer
        .as_ref()
        .context("soak needs a model with a tokenizer (for its prompts)")?;
    let context = args.context.min(model.config.max_position_embeddings);
    let prompts = PROMPTS
        .iter()
        .map(|p| tok.encode(p))
        .collect::<Result<Vec<_>>>()?;
    if let Some(p) = prompts
        .iter()
        .find(|p| p.is_empty() || p.len() + 2 > context)
    {
        bail!(
            "--context {context}: too small for a {}-token prompt and a generated token",
            p.len()
        );
    }
    let gpu = Gpu::new(0)?;
    let dm = DeviceModel::upload(&gpu, &model.config, &model.weights)?;
    let mut mk = GpuPath::new(PathKind::Megakernel, &gpu, &dm, context, context)?;
    let mut other = GpuPath::new(args.against, &gpu, &dm, context, context)?;
    eprintln!(
        "soak: {} | {} | {} greedy tokens, megakernel vs {}, context {context}",
        gpu.describe(),
        path.display(),
        args.tokens,
        args.against.name()
    );

    let start = Instant::now();
    let (mut compared, mut mismatches, mut episodes) = (0usize, 0usize, 0usize);
    let mut near_ties = 0usize;
    while compared < args.tokens {
        let prompt = &prompts[episodes % prompts.len()];
        episodes += 1;
        mk.reset();
        other.reset();
        let (a, b) = (argmax(&mk.feed(prompt)?), argmax(&other.feed(prompt)?));
        compared += 1;
        if a != b {
            mismatches += 1;
            eprintln!("soak: episode {episodes}: first token differs ({a} vs {b})");
            continue;
        }
        // Both sequences now hold the prompt; `last` is the next token to feed.
        let (mut last, mut len) = (a, prompt.len());
        let mut fed = prompt.clone();
        while compared < args.tokens && len + 1 < context {
            let n = args
                .chunk
                .min(context - 1 - len)
                .min(args.tokens - compared);
            let (xs, ys) = (mk.decode_greedy(last, n)?, other.decode_greedy(last, n)?);
            len += n;
            match xs.iter().zip(&ys).position(|(x, y)| x != y) {
                Some(i) => {
                    compared += i + 1;
                    // The tokens fed up to the step that chose differently.
                    fed.push(last);
                    fed.extend_from_slice(&xs[..i]);
                    let verdict = judge(&model, &mut mk, &mut other, &fed, xs[i], ys[i])?;
                    if verdict.near_tie {
                        near_ties += 1;
                    } else {
                        mismatches += 1;
                    }
                    eprintln!(
                        "soak: episode {episodes}: tokens differ at position {} ({} vs {}): {}; \
                         restarting from the next prompt",
                        fed.len(),
                        xs[i],
                        ys[i],
                        verdict.text
                    );
                    break;
                }
                None => compared += n,
            }
            fed.push(last);
            fed.extend_from_slice(&xs[..n - 1]);
            last = xs[n - 1];
        }
        if episodes % 10 == 0 {
            eprintln!(
                "soak: {compared} tokens, {mismatches} mismatches, {near_ties} near-ties, {:.0} s",
                start.elapsed().as_secs_f64()
            );
        }
    }
    println!(
        "soak: {compared} greedy tokens compared over {episodes} episodes (megakernel vs {}): \
         {mismatches} mismatches, {near_ties} near-ties ({:.0} s)",
        args.against.name(),
        start.elapsed().as_secs_f64()
    );
    if mismatches > 0 {
        bail!(
            "soak: {mismatches} mismatches between the megakernel and the {} path",
            args.against.name()
        );
    }
    Ok(())
}

struct Verdict {
    near_tie: bool,
    text: String,
}

/// Judges a divergence after `fed` (the megakernel chose `x`, the other path `y`): the CPU
/// reference's logits at that position against both paths' (each path is rewound and fed the
/// last token again).
fn judge<'g>(
    model: &model::Model,
    mk: &mut GpuPath<'g>,
    other: &mut GpuPath<'g>,
    fed: &[u32],
    x: u32,
    y: u32,
) -> Result<Verdict> {
    // Batched prefill: the token-by-token forward took most of a soak's time.
    let want = CpuForward::new(&model.config, &model.weights, fed.len())
        .prefill(fed, crate::reference::prefill::DEFAULT_CHUNK)
        .context("soak: the CPU reference at the divergence")?;
    let last = fed[fed.len() - 1];
    let mut errs = [0f64; 2];
    for (err, path) in errs.iter_mut().zip([mk, other]) {
        path.rewind(fed.len() - 1)?;
        *err = rel_l2(&path.feed(&[last])?, &want);
    }
    let rms = (want.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / want.len() as f64).sqrt();
    let (lx, ly) = (want[x as usize] as f64, want[y as usize] as f64);
    let top = want[argmax(&want) as usize] as f64;
    let (gap, behind) = ((lx - ly).abs(), top - lx.max(ly));
    let limit = TIE * rms;
    let near_tie = gap <= limit && behind <= limit && errs.iter().all(|e| *e <= TIE);
    Ok(Verdict {
        near_tie,
        text: format!(
            "{} (reference logits {lx:.3} vs {ly:.3}, {behind:.3} below its top; limit {limit:.3}; \
             rel L2 against the reference: megakernel {:.1e}, other {:.1e})",
            if near_tie { "a near-tie" } else { "MISMATCH" },
            errs[0],
            errs[1]
        ),
    })
}

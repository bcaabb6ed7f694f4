//! `megainfer soak`: a long greedy run on two GPU paths at once, token by token compared. Both
//! paths compute the same forward pass, so over many thousands of tokens any divergence points
//! at a synchronisation or memory bug that short tests miss.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};

use crate::generate::Backend;
use crate::gpu::device::Gpu;
use crate::gpu::model::DeviceModel;
use crate::gpu::paths::{GpuPath, PathKind};
use crate::model;
use crate::sampling::argmax;

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
    let model = model::load(&path)?;
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
                    mismatches += 1;
                    eprintln!(
                        "soak: episode {episodes}: tokens differ at position {} ({} vs {}); \
                         restarting from the next prompt",
                        len - n + i + 1,
                        xs[i],
                        ys[i]
                    );
                    break;
                }
                None => compared += n,
            }
            last = xs[n - 1];
        }
        if episodes % 10 == 0 {
            eprintln!(
                "soak: {compared} tokens, {mismatches} mismatches, {:.0} s",
                start.elapsed().as_secs_f64()
            );
        }
    }
    println!(
        "soak: {compared} greedy tokens compared over {episodes} episodes (megakernel vs {}): \
         {mismatches} mismatches ({:.0} s)",
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

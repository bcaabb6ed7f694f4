//! `megainfer run`: load a model, stream a continuation or a chat reply.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};

use crate::generate::generate;
use crate::gpu::device::Gpu;
use crate::gpu::model::{DeviceModel, KvCache};
use crate::gpu::paths::{GpuPath, PathKind};
use crate::model::{self, Model, WeightType};
use crate::reference::CpuForward;
use crate::sampling::{Sampler, SamplingArgs, SamplingParams};
use crate::tokenizer::chat::{self, ChatMessage};

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceChoice {
    /// CUDA when a GPU and driver are present, else the CPU.
    Auto,
    Cpu,
    Cuda,
}

/// What `run` and `chat` share: the model, where it runs and how tokens are drawn.
#[derive(clap::Args, Debug)]
pub struct ModelArgs {
    /// HF model directory or .gguf file (default: SmolLM2-135M-Instruct Q4_1, fetched on first use).
    #[arg(short = 'm', long)]
    pub model: Option<PathBuf>,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Seed of the sampler's random draws.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
    pub device: DeviceChoice,
    /// Context length to allocate (prompt and new tokens, or the whole conversation); default:
    /// the model's, bounded by free GPU memory (on the CPU: capped at 4096).
    #[arg(long)]
    pub max_context: Option<usize>,
    /// GPU decode path.
    #[arg(long, value_enum, default_value_t = PathKind::Megakernel)]
    pub path: PathKind,
    /// Storage of the weight matrices. Default: as the file stores them (GGUF Q8_0, Q4_0 and
    /// Q4_1 stay quantised, Q6_K as 32-element Q6_K blocks and Q5_0 as Q8_0, both exactly, Q4_K
    /// as Q4_1; everything else is bf16). `bf16` widens them; a quantised type quantises every
    /// matrix with the project's quantiser.
    #[arg(long, value_enum)]
    pub dtype: Option<WeightType>,
    /// Megakernel, greedy or drawing inside the launch (sampled, by default on vocabularies up
    /// to 65,536 tokens): decode steps per launch. 0 (the default) runs the whole generation
    /// in one launch, stopping on the GPU at an end token or the token budget, each token
    /// handed to the host as soon as it exists; 1 launches once per token; N in launches of N.
    #[arg(long, default_value_t = 0)]
    pub tokens_per_launch: usize,
}

impl ModelArgs {
    /// `--tokens-per-launch` as the paths take it (0: the whole generation).
    pub fn steps_per_launch(&self) -> usize {
        if self.tokens_per_launch == 0 {
            usize::MAX
        } else {
            self.tokens_per_launch
        }
    }

    /// Loads the model, converts its matrices per `--dtype` and says how much memory they use.
    pub fn load_model(&self) -> Result<Model> {
        let path = resolve_model_path(&self.model)?;
        let mut model = model::load(&path)?;
        if let Some(ty) = self.dtype {
            model.weights.convert_to(ty)?;
        }
        eprintln!("megainfer: {}", model.weights.describe_memory());
        Ok(model)
    }
}

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub common: ModelArgs,
    /// Prompt text.
    #[arg(short = 'p', long, default_value = "The capital of France is")]
    pub prompt: String,
    /// Maximum number of new tokens.
    #[arg(short = 'n', long, default_value_t = 64)]
    pub max_tokens: usize,
    /// Wrap the prompt in the model's chat template as a user message.
    #[arg(long)]
    pub chat: bool,
    /// Print one JSON object on stdout at the end instead of streaming the text: prompt_ids,
    /// generated_ids (an eos that stopped the run included), text (without it), stop_reason
    /// ("eos" or "max_tokens"), ttft_ms, decode_tok_s, device, path.
    #[arg(long)]
    pub json: bool,
    /// Megakernel only: how long an instruction may wait for its inputs before the run stops
    /// with an error naming what never arrived (a scheduling bug, not slowness). Default 2000.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=600_000))]
    pub wait_timeout_ms: Option<u64>,
}

/// Where a run executed, for `--json`.
struct RunPlace {
    device: String,
    path: &'static str,
}

pub fn resolve_model_path(model: &Option<PathBuf>) -> Result<PathBuf> {
    match model {
        Some(p) => Ok(p.clone()),
        None => crate::fetch::default_model(),
    }
}

/// Context the CPU allocates by default (its KV cache is f32 and attention runs on the CPU).
const CPU_DEFAULT_CONTEXT: usize = 4096;
/// GPU memory left aside when sizing the default context: prefill's activations, cuBLAS's
/// workspace, the kernels' modules and whatever else shares the GPU, plus a tenth of what is free.
const GPU_RESERVE_BYTES: usize = 2 << 30;

/// The context to allocate: `--max-context`, or by default the model's positions, bounded on a
/// GPU by the memory its KV cache can have beside the weights (said on stderr), and on the CPU
/// capped at [`CPU_DEFAULT_CONTEXT`]. Never more than the model has.
pub(crate) fn context_limit(
    asked: Option<usize>,
    model: &crate::model::Model,
    gpu: Option<&Gpu>,
) -> Result<usize> {
    let config = &model.config;
    let most = config.max_position_embeddings;
    if let Some(n) = asked {
        if n == 0 {
            bail!("--max-context must be at least 1 (got 0)");
        }
        if n > most {
            bail!("--max-context {n} exceeds the model's {most} positions");
        }
        return Ok(n);
    }
    let Some(gpu) = gpu else {
        let n = most.min(CPU_DEFAULT_CONTEXT);
        if n < most {
            eprintln!(
                "megainfer: context {n} tokens on the CPU (the model has {most}; --max-context raises it)"
            );
        }
        return Ok(n);
    };
    let free = gpu.free_memory()?;
    let weights: usize = model.weights.bytes_by_type().iter().map(|(_, b)| b).sum();
    let budget = free
        .saturating_sub(weights)
        .saturating_sub(GPU_RESERVE_BYTES + free / 10);
    let per_token = crate::gpu::model::KvCache::bytes(config, 1);
    let fits = budget / per_token.max(1);
    if fits >= most {
        eprintln!(
            "megainfer: context {most} tokens (the model's maximum; --max-context lowers it)"
        );
        return Ok(most);
    }
    if fits < 2 {
        bail!(
            "{}: {:.1} GiB free leaves no room for a KV cache beside {:.1} GiB of weights",
            gpu.describe(),
            free as f64 / (1u64 << 30) as f64,
            weights as f64 / (1u64 << 30) as f64
        );
    }
    eprintln!(
        "megainfer: context {fits} tokens, what {:.1} GiB of free GPU memory holds beside the weights (the model has {most}; --max-context to choose)",
        free as f64 / (1u64 << 30) as f64
    );
    Ok(fits)
}

/// The GPU to run on, or None for the CPU: `--device cuda` insists (an error says why it
/// cannot), `auto` takes a usable GPU and otherwise falls back to the CPU, saying why.
pub(crate) fn choose_gpu(device: DeviceChoice) -> Result<Option<Gpu>> {
    Ok(match device {
        DeviceChoice::Cpu => None,
        DeviceChoice::Cuda => Some(Gpu::new(0)?),
        // A GPU the kernels cannot run on (e.g. older than Hopper) leaves the CPU.
        DeviceChoice::Auto if crate::gpu::available() => match Gpu::new(0) {
            Ok(g) => Some(g),
            Err(e) => {
                eprintln!("megainfer: {e:#}; falling back to the CPU");
                None
            }
        },
        DeviceChoice::Auto => None,
    })
}

/// The path `common` asks for and the weights uploaded; `doing` begins the line that names the
/// GPU, the path and the KV cache.
pub(crate) fn upload_for_path(
    gpu: &Gpu,
    config: &model::Config,
    weights: &model::Weights,
    common: &ModelArgs,
    max_context: usize,
    doing: &str,
) -> Result<(PathKind, DeviceModel)> {
    let path = common.path;
    // The megakernel is compiled for every format the layers have and reads each layer's from
    // the layer table (`MatrixFormats::mixed`); the line names a kind that mixes, for anyone
    // comparing the speed with a file of one format.
    if let (PathKind::Megakernel, Some(mixed)) = (path, weights.mixed_storage()) {
        eprintln!("megainfer: {mixed}: the megakernel reads every layer in its own format");
    }
    eprintln!(
        "megainfer: {doing} on {} with the {} path; KV cache for {max_context} tokens: {:.1} MiB",
        gpu.describe(),
        path.name(),
        KvCache::bytes(config, max_context) as f64 / (1 << 20) as f64
    );
    let dm = DeviceModel::upload(gpu, config, weights)?;
    Ok((path, dm))
}

pub fn render_prompt(model: &Model, prompt: &str, chat_mode: bool) -> Result<Vec<u32>> {
    let tok = model
        .tokenizer
        .as_ref()
        .context("this model has no tokenizer (no tokenizer.json / GGUF tokenizer metadata)")?;
    if !chat_mode {
        return tok.encode(prompt);
    }
    let template = tok
        .chat_template
        .as_deref()
        .context("--chat: this model has no chat template")?;
    let name = |id: Option<u32>| {
        id.and_then(|i| tok.inner.id_to_token(i))
            .unwrap_or_default()
    };
    let text = chat::render(
        template,
        &[ChatMessage {
            role: "user".into(),
            content: prompt.into(),
        }],
        &name(tok.bos_token_id),
        &name(tok.eos_token_ids.first().copied()),
        true,
    )?;
    tok.encode_chat(&text)
}

pub fn run(args: &RunArgs) -> Result<()> {
    let params = args.common.sampling.params(args.common.seed)?;
    let model = args.common.load_model()?;
    let ids = render_prompt(&model, &args.prompt, args.chat)?;
    if ids.is_empty() {
        bail!("--prompt: the prompt encodes to no tokens");
    }
    let gpu = choose_gpu(args.common.device)?;
    let max_context = context_limit(args.common.max_context, &model, gpu.as_ref())?;
    if ids.len() >= max_context {
        bail!(
            "the prompt is {} tokens, longer than the context of {max_context} tokens (--max-context)",
            ids.len()
        );
    }
    let max_tokens = args.max_tokens.min(max_context - ids.len());
    if max_tokens < args.max_tokens {
        eprintln!(
            "megainfer: the context of {max_context} tokens leaves room for {max_tokens} new tokens after the {}-token prompt (--max-context)",
            ids.len()
        );
    }
    if let Some(gpu) = gpu {
        let (path, dm) = upload_for_path(
            &gpu,
            &model.config,
            &model.weights,
            &args.common,
            max_context,
            "running",
        )?;
        let mut backend = GpuPath::new(path, &gpu, &dm, max_context, ids.len() + max_tokens)?;
        backend.set_tokens_per_launch(args.common.steps_per_launch());
        if let Some(ms) = args.wait_timeout_ms {
            backend.set_wait_timeout_ms(ms)?;
        }
        backend.prepare_prefill()?;
        backend.prepare_sampling(&params)?;
        let place = RunPlace {
            device: gpu.describe(),
            path: path.name(),
        };
        return finish(args, &model, &mut backend, &ids, max_tokens, params, place);
    }
    eprintln!(
        "megainfer: running on the CPU ({} threads)",
        rayon::current_num_threads()
    );
    // The CPU keeps the file's quantised matrices as stored: its decode dots their blocks in
    // registers (ops::simd::dot_blocks), faster than bf16 rows (fewer bytes).
    let mut backend = CpuForward::new(&model.config, &model.weights, max_context);
    let place = RunPlace {
        device: format!("cpu ({} threads)", rayon::current_num_threads()),
        path: "cpu-reference",
    };
    finish(args, &model, &mut backend, &ids, max_tokens, params, place)
}

fn finish(
    args: &RunArgs,
    model: &Model,
    backend: &mut dyn crate::generate::Backend,
    ids: &[u32],
    max_tokens: usize,
    params: SamplingParams,
    place: RunPlace,
) -> Result<()> {
    if !args.json {
        return stream(model, backend, ids, max_tokens, params);
    }
    let tok = model.tokenizer.as_ref().context("model has no tokenizer")?;
    let mut sampler = Sampler::new(params);
    let mut generated: Vec<u32> = Vec::new();
    let stats = generate(
        backend,
        ids,
        max_tokens,
        &tok.eos_token_ids,
        &mut sampler,
        &mut |t| {
            generated.push(t);
            Ok(())
        },
    )?;
    let text_ids: Vec<u32> = generated
        .iter()
        .copied()
        .filter(|t| !tok.eos_token_ids.contains(t))
        .collect();
    let out = serde_json::json!({
        "prompt_ids": ids,
        "generated_ids": generated,
        "text": tok.decode(&text_ids)?,
        "stop_reason": stats.stop_reason(),
        "ttft_ms": stats.time_to_first_token.as_secs_f64() * 1e3,
        "decode_tok_s": stats.decode_tokens_per_s(),
        "device": place.device,
        "path": place.path,
    });
    println!("{out}");
    Ok(())
}

pub fn stream(
    model: &Model,
    backend: &mut dyn crate::generate::Backend,
    ids: &[u32],
    max_tokens: usize,
    params: SamplingParams,
) -> Result<()> {
    let tok = model.tokenizer.as_ref().context("model has no tokenizer")?;
    let mut sampler = Sampler::new(params);
    let mut out_ids: Vec<u32> = Vec::new();
    // Decoding only the tokens since the last printed boundary keeps each step O(1) instead of
    // re-decoding the whole output; `prefix` is kept as context because byte-level tokens
    // decode correctly only together with their neighbours.
    let (mut prefix, mut printed) = (0usize, 0usize);
    let mut stdout = std::io::stdout().lock();
    let eos = &tok.eos_token_ids;
    let stats = generate(backend, ids, max_tokens, eos, &mut sampler, &mut |t| {
        if eos.contains(&t) {
            return Ok(());
        }
        out_ids.push(t);
        let before = tok.decode(&out_ids[prefix..printed])?;
        let text = tok.decode(&out_ids[prefix..])?;
        // A token may end inside a multi-byte character: wait for the rest of it.
        if !text.ends_with('\u{FFFD}')
            && text.len() > before.len()
            && text.is_char_boundary(before.len())
        {
            stdout.write_all(&text.as_bytes()[before.len()..])?;
            stdout.flush()?;
            prefix = printed;
            printed = out_ids.len();
        }
        Ok(())
    })?;
    writeln!(stdout)?;
    if max_tokens == 0 {
        // Nothing ran: no time to first token or rates to report.
        eprintln!(
            "prompt tokens: {} | generated: 0 (--max-tokens 0)",
            stats.prompt_tokens
        );
        return Ok(());
    }
    eprintln!(
        "prompt tokens: {} | time to first token: {:.1} ms (prefill {:.0} tok/s) | generated: {} | decode: {:.1} tok/s{}",
        stats.prompt_tokens,
        stats.time_to_first_token.as_secs_f64() * 1e3,
        stats.prefill_tokens_per_s(),
        stats.generated,
        stats.decode_tokens_per_s(),
        match stats.stop_reason() {
            "eos" => " | stopped at eos",
            "interrupted" => " | interrupted (Ctrl-C)",
            _ => "",
        }
    );
    Ok(())
}

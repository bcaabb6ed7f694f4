//! `megainfer schedule`: the megakernel's schedule for a model, exactly as `run` and `bench`
//! build it (same function, same cost model), with its summary and time estimate; optionally
//! the whole schedule as JSON (docs/schedule-json.md).

use std::io::Write;
use std::ops::RangeInclusive;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use scheduler::{dump, options, shape, CostModel, GpuShape, Overrides};

use crate::gpu::megakernel::{
    check_limits, megakernel_gpu_shape, megakernel_schedule, H100_SMEM_PER_BLOCK, H100_SMS,
};
use crate::model::{self, presets, Config};

#[derive(clap::Args, Debug)]
pub struct ScheduleArgs {
    /// HF model directory or .gguf file to take the shape from (default: SmolLM2-135M-Instruct,
    /// fetched on first use).
    #[arg(short = 'm', long, conflicts_with = "preset")]
    pub model: Option<PathBuf>,
    /// A known shape instead of a model.
    #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(presets::NAMES))]
    pub preset: Option<String>,
    /// Sequence length attention is costed at; also the longest sequence of the context
    /// buckets listed at the end (`run` and `bench` keep one schedule per bucket up to their
    /// context and switch as the sequence grows).
    #[arg(long, default_value_t = 1024)]
    pub context: usize,
    /// Streaming multiprocessors, one instruction stream each (default: the GPU's, or an
    /// H100's 132 where no GPU is present).
    #[arg(long)]
    pub sms: Option<usize>,
    /// Shared-memory weight pages per SM, for the estimate (default: what the megakernel
    /// leaves on the GPU, or on an H100 where no GPU is present).
    #[arg(long)]
    pub pages: Option<usize>,
    /// What-if: memory bandwidth for the cost model and the estimate, GB/s (default: the
    /// megakernel's).
    #[arg(long)]
    pub bandwidth: Option<f64>,
    /// What-if: per-instruction overhead for the cost model and the estimate, µs (default:
    /// the megakernel's).
    #[arg(long)]
    pub latency_us: Option<f64>,
    /// Write the whole schedule as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// RoPE pairs per RmsQkvRope (default: chosen by the cost model, as for all below).
    #[arg(long)]
    pub qkv_pairs: Option<usize>,
    /// RmsQkvRope instructions a layer, every head's pairs split evenly among its share
    /// (instead of pieces of --qkv-pairs; the cost model takes one per SM where pieces of the
    /// pairs would leave a fifth of the SMs idle; --qkv-pairs alone turns that off).
    #[arg(long)]
    pub qkv_pieces: Option<usize>,
    #[arg(long)]
    pub oproj_rows: Option<usize>,
    #[arg(long)]
    pub upgate_rows: Option<usize>,
    #[arg(long)]
    pub down_rows: Option<usize>,
    #[arg(long)]
    pub down_chunks: Option<usize>,
    /// Split-KV attention partitions per KV head.
    #[arg(long)]
    pub attn_parts: Option<usize>,
    /// Query heads per Attention instruction: a divisor of a KV head's query heads (buckets
    /// of one part only; the others compute whole groups).
    #[arg(long)]
    pub attn_heads: Option<usize>,
    #[arg(long)]
    pub lmhead_rows: Option<usize>,
    /// Also compile, without a GPU, the kernels `run` and `bench` would load for these buckets
    /// (bf16 weights) on that GPU into the kernel cache (MEGAINFER_CACHE): the megakernel
    /// variants, the batched prefill's and the graph paths' modules, and the sampler's for the
    /// model's vocabulary; e.g. to carry to a GPU machine whose NVRTC has this one's version
    /// (docs/gpu-machine.md). Give --context as `bench`'s prompt length + new tokens + 1.
    #[arg(long, value_parser = ["h100", "h200"])]
    pub compile_kernels: Option<String>,
}

fn config(args: &ScheduleArgs) -> Result<Config> {
    if let Some(name) = &args.preset {
        return presets::by_name(name);
    }
    let path = super::run::resolve_model_path(&args.model)?;
    let model = model::load(&path).with_context(|| format!("loading {}", path.display()))?;
    Ok(model.config)
}

/// Fails unless `value` of option `name` lies in `range` (NaN never does).
fn in_range<T: PartialOrd + std::fmt::Debug>(
    name: &str,
    value: T,
    range: &RangeInclusive<T>,
) -> Result<()> {
    if !range.contains(&value) {
        bail!("{name} {value:?} is outside the allowed range {range:?}");
    }
    Ok(())
}

/// The GPU to schedule for and a line saying where its figures came from.
fn gpu_shape(args: &ScheduleArgs, cfg: &Config) -> Result<(GpuShape, String)> {
    let device = if crate::gpu::available() {
        match crate::gpu::device::Gpu::new(0) {
            Ok(g) => Some((g.name.clone(), g.sm_count, g.max_smem_per_block)),
            Err(e) => {
                eprintln!("GPU 0 could not be opened ({e}); assuming an H100");
                None
            }
        }
    } else {
        None
    };
    let (mut shape, mut source) = match device {
        Some((name, sms, smem)) => (
            megakernel_gpu_shape(cfg, sms, smem),
            format!("GPU: {name}"),
        ),
        None => (
            megakernel_gpu_shape(cfg, H100_SMS, H100_SMEM_PER_BLOCK),
            format!(
                "GPU: none found; assuming an H100 ({H100_SMS} SMs, {} KiB of shared memory per block)",
                H100_SMEM_PER_BLOCK >> 10
            ),
        ),
    };
    if let Some(sms) = args.sms {
        shape.sm_count = sms;
        source += &format!("; --sms {sms}");
    }
    if let Some(pages) = args.pages {
        shape.smem_pages = pages;
        source += &format!("; --pages {pages}");
    }
    Ok((shape, source))
}

/// The cost model `run` uses at this context, with the what-if options applied; checks every
/// numeric option first.
fn cost_model(args: &ScheduleArgs) -> Result<CostModel> {
    if let Some(sms) = args.sms {
        in_range("--sms", sms, &shape::SMS)?;
    }
    if let Some(pages) = args.pages {
        in_range("--pages", pages, &shape::SMEM_PAGES)?;
    }
    in_range("--context", args.context, &options::CONTEXT)?;
    let mut cost = CostModel::megakernel(args.context);
    if let Some(b) = args.bandwidth {
        in_range("--bandwidth", b, &options::BANDWIDTH_GBPS)?;
        cost.bandwidth_gbps = b;
    }
    if let Some(l) = args.latency_us {
        in_range("--latency-us", l, &options::LATENCY_US)?;
        cost.latency_us = l;
    }
    Ok(cost)
}

pub fn run(args: &ScheduleArgs) -> Result<()> {
    // Options first: a bad one is reported before any model is fetched or loaded.
    let cost = cost_model(args)?;
    let cfg = config(args)?;
    let (gpu, source) = gpu_shape(args, &cfg)?;
    // The options over the MEGAINFER_MK_* variables `run` and `bench` read, so that the
    // streams shown are the ones they would build in the same environment.
    let (env, set) = crate::gpu::paths::env_overrides()?;
    let overrides = Overrides {
        qkv_pairs: args.qkv_pairs.or(env.qkv_pairs),
        qkv_pieces: args.qkv_pieces.or(env.qkv_pieces),
        oproj_rows: args.oproj_rows.or(env.oproj_rows),
        upgate_rows: args.upgate_rows.or(env.upgate_rows),
        down_rows: args.down_rows.or(env.down_rows),
        down_chunks: args.down_chunks.or(env.down_chunks),
        attn_parts: args.attn_parts.or(env.attn_parts),
        attn_heads: args.attn_heads.or(env.attn_heads),
        lmhead_rows: args.lmhead_rows.or(env.lmhead_rows),
    };
    let schedule = megakernel_schedule(&cfg, &gpu, &cost, &overrides).with_context(|| {
        if set.is_empty() {
            "building the schedule".to_string()
        } else {
            format!("building the schedule, with {} set", set.join(", "))
        }
    })?;
    // What `run` and `bench` would refuse (as bf16 weights) is said on stderr; the schedule is
    // still shown, as what-if shapes (--sms, --pages) may well be past the compiled limits.
    let mut warned = Vec::new();
    let mut limits = |schedule: &scheduler::Schedule| {
        if let Err(e) = check_limits(schedule, &Default::default()) {
            let e = e.to_string();
            if !warned.contains(&e) {
                eprintln!(
                    "warning: the megakernel cannot run this schedule ({e}); `run` and `bench` would refuse it"
                );
                warned.push(e);
            }
        }
    };
    limits(&schedule);
    // Written, not printed, so that a closed pipe (`| head`) is an error rather than a panic.
    let mut out = std::io::stdout().lock();
    writeln!(out, "{source}")?;
    if !set.is_empty() {
        writeln!(
            out,
            "from the environment (under the options given): {}",
            set.join(", ")
        )?;
    }
    write!(out, "{}", dump::summarize(&schedule, &cost))?;
    // The buckets `run` and `bench` switch between for sequences up to --context, with the
    // K/V each SM streams per layer at a bucket's longest sequence.
    let shape = crate::reference::sliced::shape_of(&cfg);
    let bounds = crate::gpu::megakernel::bucket_bounds_for(args.context)?;
    let buckets = scheduler::plan_buckets_within(&shape, &gpu, &cost, &overrides, &bounds)
        .map_err(|e| anyhow::anyhow!("scheduler: {e}"))?;
    for b in &buckets {
        limits(&b.schedule);
    }
    writeln!(
        out,
        "
context buckets for sequences up to {} positions{}:",
        args.context,
        if std::env::var_os("MEGAINFER_MK_BUCKETS").is_some() {
            " (bounds from MEGAINFER_MK_BUCKETS)"
        } else {
            ""
        }
    )?;
    // As the megakernel runs them: a bucket with parts that spans 4K or 64K positions cut
    // there, the split-KV buckets from 4K to 64K streaming their K/V with fewer tiles in flight.
    let runs =
        crate::gpu::megakernel::split_at_kv_bound(buckets.iter().map(|b| (b.upto, &b.schedule)));
    let two_in_flight = crate::gpu::megakernel::kv_two_in_flight(&runs);
    // The scheduler's bucket each run comes from (a cut bucket's pieces share its schedule,
    // costed for the whole bucket): its first and last positions.
    let mut spans = Vec::with_capacity(buckets.len());
    let mut from = 0;
    for b in &buckets {
        spans.push((from + 1, b.upto, &b.schedule));
        from = b.upto;
    }
    let mut run_from = 0;
    for (&(upto, schedule), two) in runs.iter().zip(two_in_flight) {
        let costed = match spans.iter().find(|s| std::ptr::eq(s.2, schedule)) {
            Some(&(first, last, _)) if (first, last) != (run_from + 1, upto) => format!(
                "a piece of the bucket of {first} to {last} positions, costed at {}",
                schedule.options.context
            ),
            _ => format!("costed at {}", schedule.options.context),
        };
        run_from = upto;
        let at_end = CostModel {
            context: upto,
            ..cost
        };
        let kv_max = dump::summarize(schedule, &at_end)
            .stages
            .iter()
            .find(|st| st.kind == scheduler::StageKind::Attention)
            .map_or(0, |st| st.max);
        let heads = schedule.options.attn_heads_label();
        let in_flight = if two {
            ", K/V streamed 2 tiles in flight"
        } else {
            ""
        };
        writeln!(
            out,
            "  up to {:>7}: {:>3} split-KV parts{heads} ({costed}), K/V per SM and layer at {} positions: max {:.1} KiB{in_flight}",
            upto,
            schedule.options.attn_parts,
            upto,
            kv_max as f64 / 1024.0
        )?;
    }
    if let Some(gpu_name) = &args.compile_kernels {
        // The modules every model shares compile on threads of their own beside the
        // megakernel's variants (NVRTC compiles one program on one core).
        let arch = "sm_90a";
        let (variants, modules) = std::thread::scope(|scope| {
            let modules = [
                scope.spawn(|| {
                    crate::gpu::prefill::compile_module(arch)
                        .context("compiling the prefill module")
                }),
                scope.spawn(|| {
                    crate::gpu::baseline::compile_module(arch)
                        .context("compiling the graph paths' module")
                }),
                scope.spawn(|| {
                    let (_, chunk) = crate::sampling::device::kernels_and_chunk(cfg.vocab_size)?;
                    crate::sampling::device::compile_module(chunk, arch)
                        .context("compiling the sampler's module")
                }),
            ];
            let variants = crate::gpu::megakernel::compile_kernels_ahead(
                &cfg,
                &runs,
                gpu_name == "h200",
                arch,
            )
            .context("compiling the megakernel variants");
            let modules: Vec<Result<Vec<u8>>> = modules
                .into_iter()
                .map(|h| h.join().expect("a compile thread panicked"))
                .collect();
            (variants, modules)
        });
        let n = variants?;
        for m in modules {
            m?;
        }
        writeln!(
            out,
            "\n{n} megakernel variants (greedy and sampled) and the prefill, graph-path and \
             sampler modules for an {} compiled ({arch}) into the kernel cache",
            gpu_name.to_uppercase()
        )?;
    }
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&dump::to_json(&schedule))?;
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
        writeln!(out, "\nJSON written to {}", path.display())?;
    }
    Ok(())
}

//! `megainfer schedule`: build the megakernel's schedule for a model shape, print its summary
//! and time estimate, optionally export it as JSON (docs/schedule-json.md).

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};
use scheduler::{build, dump, CostModel, GpuShape, ModelShape, Options};

use crate::model::{self, presets};
use crate::reference::sliced::shape_of;

#[derive(clap::Args, Debug)]
pub struct ScheduleArgs {
    /// HF model directory or .gguf file to take the shape from (default: SmolLM2-135M-Instruct,
    /// fetched on first use).
    #[arg(short = 'm', long, conflicts_with = "preset")]
    pub model: Option<PathBuf>,
    /// A known shape instead of a model: llama-3.2-1b, llama-3.2-3b, smollm2-135m.
    #[arg(long)]
    pub preset: Option<String>,
    /// Streaming multiprocessors, one instruction stream each.
    #[arg(long, default_value_t = 132)]
    pub sms: usize,
    /// Shared-memory pages per SM.
    #[arg(long, default_value_t = 13)]
    pub smem_pages: usize,
    #[arg(long, default_value_t = 16384)]
    pub page_bytes: usize,
    /// Memory bandwidth for the cost model and the estimate, GB/s.
    #[arg(long, default_value_t = 3110.0)]
    pub bandwidth: f64,
    /// Per-instruction overhead for the cost model and the estimate, µs.
    #[arg(long, default_value_t = 0.5)]
    pub latency_us: f64,
    /// Sequence length attention is costed at.
    #[arg(long, default_value_t = 1024)]
    pub context: usize,
    /// Write the whole schedule as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// RoPE pairs per RmsQkvRope (default: chosen by the cost model, as for all below).
    #[arg(long)]
    pub qkv_pairs: Option<usize>,
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
    #[arg(long)]
    pub lmhead_rows: Option<usize>,
}

fn model_shape(args: &ScheduleArgs) -> Result<ModelShape> {
    if let Some(name) = &args.preset {
        return Ok(shape_of(&presets::by_name(name)?));
    }
    let path = super::run::resolve_model_path(&args.model)?;
    let model = model::load(&path).with_context(|| format!("loading {}", path.display()))?;
    Ok(shape_of(&model.config))
}

fn options(args: &ScheduleArgs, model: &ModelShape, gpu: &GpuShape, cost: &CostModel) -> Options {
    let auto = Options::auto(model, gpu, cost);
    Options {
        qkv_pairs: args.qkv_pairs.unwrap_or(auto.qkv_pairs),
        oproj_rows: args.oproj_rows.unwrap_or(auto.oproj_rows),
        upgate_rows: args.upgate_rows.unwrap_or(auto.upgate_rows),
        down_rows: args.down_rows.unwrap_or(auto.down_rows),
        down_chunks: args.down_chunks.unwrap_or(auto.down_chunks),
        attn_parts: args.attn_parts.unwrap_or(auto.attn_parts),
        lmhead_rows: args.lmhead_rows.unwrap_or(auto.lmhead_rows),
        ..auto
    }
}

pub fn run(args: &ScheduleArgs) -> Result<()> {
    let model = model_shape(args)?;
    let gpu = GpuShape {
        sm_count: args.sms,
        smem_pages: args.smem_pages,
        page_bytes: args.page_bytes,
    };
    let cost = CostModel {
        bandwidth_gbps: args.bandwidth,
        latency_us: args.latency_us,
        context: args.context,
    };
    let opts = options(args, &model, &gpu, &cost);
    let schedule = build(&model, &gpu, &opts).context("building the schedule")?;
    // Written, not printed, so that a closed pipe (`| head`) is an error rather than a panic.
    let mut out = std::io::stdout().lock();
    write!(out, "{}", dump::summarize(&schedule, &cost))?;
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&dump::to_json(&schedule))?;
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
        writeln!(out, "\nJSON written to {}", path.display())?;
    }
    Ok(())
}

//! `megainfer bench`: every decode path on the same model, in one process, side by side.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde::Serialize;

use crate::generate::Backend;
use crate::gpu::baseline::measure_read_bandwidth;
use crate::gpu::device::Gpu;
use crate::gpu::model::DeviceModel;
use crate::gpu::paths::{GpuPath, PathKind};
use crate::model::{self, presets, random::random_weights, WeightType};
use crate::sampling::{argmax, Sampler, SamplingArgs, SamplingParams};

#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// HF directory or .gguf file.
    #[arg(short = 'm', long, conflicts_with = "preset")]
    pub model: Option<PathBuf>,
    /// Model shape with random bf16 weights (no file needed).
    #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(crate::model::presets::NAMES))]
    pub preset: Option<String>,
    #[arg(long, default_value_t = 32)]
    pub prompt_len: usize,
    /// New tokens per run.
    #[arg(long, default_value_t = 128)]
    pub gen: usize,
    /// Positions the paths are set up for (KV cache, and the megakernel's context buckets,
    /// which `run` cuts for its context: e.g. 8192 to time a run's buckets at mid lengths);
    /// default --prompt-len + --gen + 1, the least that holds the run.
    #[arg(long)]
    pub max_context: Option<usize>,
    /// Comma-separated: megakernel, graph-pdl, graph, eager; or all.
    #[arg(long, default_value = "all")]
    pub paths: String,
    #[arg(long, default_value_t = 5)]
    pub reps: usize,
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Also time every megakernel instruction (globaltimer) and print where a step's time goes.
    #[arg(long)]
    pub profile: bool,
    /// With --profile: write every profiled instruction's timestamps (CSV) to this file.
    #[arg(long, requires = "profile")]
    pub timeline: Option<PathBuf>,
    /// With --profile: write the profiled steps as a Chrome trace (JSON; open it in Perfetto or
    /// chrome://tracing): a track per SM, a slice per instruction with its phases.
    #[arg(long, requires = "profile")]
    pub trace: Option<PathBuf>,
    /// Storage of the weight matrices: with --preset, the random bf16 weights quantised with
    /// the project's quantiser (or left bf16); with a model file, as --dtype of `run` (default:
    /// as the file stores them).
    #[arg(long, value_enum)]
    pub dtype: Option<WeightType>,
    /// With --preset and a quantised --dtype: the formats of a llama.cpp Q4_K_M file as it
    /// loads: in the layers it gives Q6_K V and down matrices, down in Q6_K and q/k/v widened to
    /// bf16 (as the GGUF loader widens Q and K with V); the LM head in Q6_K
    /// (`Weights::mix_like_q4_k_m`).
    #[arg(long, requires = "preset")]
    pub q4_k_m_mix: bool,
    /// With --q4-k-m-mix: its Q6_K matrices widened to bf16, as the GGUF loader widened them
    /// before it kept Q6_K as stored (for measuring the difference).
    #[arg(long, requires = "q4_k_m_mix")]
    pub q6_k_widened: bool,
    /// Seed of the random weights, the prompt and the sampler.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Megakernel only: how long an instruction may wait for its inputs before the run stops
    /// with an error naming what never arrived (a scheduling bug, not slowness). Default 2000.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=600_000))]
    pub wait_timeout_ms: Option<u64>,
    /// Prompt tokens per batched-prefill chunk on the GPU.
    #[arg(long, default_value_t = crate::gpu::prefill::DEFAULT_CHUNK, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1_048_576))]
    pub prefill_chunk: usize,
    /// Megakernel, greedy: steps per launch, comma-separated, each run as its own row: 0 (the
    /// default) runs the whole generation in one launch, 1 launches once per token, N in
    /// launches of N steps (e.g. `1,0` compares one launch per token with one per generation).
    #[arg(long, default_value = "0", value_parser = parse_per_launch)]
    pub tokens_per_launch: PerLaunch,
    /// Sampled decoding instead of greedy (--temperature > 0 or a repetition penalty).
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

/// `--tokens-per-launch` values (0: the whole generation).
#[derive(Clone, Debug)]
pub struct PerLaunch(pub Vec<usize>);

fn parse_per_launch(s: &str) -> Result<PerLaunch, String> {
    let v: Result<Vec<usize>, _> = s.split(',').map(|x| x.trim().parse::<usize>()).collect();
    match v {
        Ok(v) if !v.is_empty() => Ok(PerLaunch(v)),
        _ => Err(format!(
            "'{s}': expected comma-separated step counts (0 = the whole generation)"
        )),
    }
}

/// A megakernel row's name: steps per launch 0 (the whole generation) is the plain path.
fn per_launch_label(kind: PathKind, per_launch: usize) -> String {
    match (kind, per_launch) {
        (PathKind::Megakernel, 0) => kind.name().to_string(),
        (PathKind::Megakernel, n) => format!("megakernel ({n}/launch)"),
        _ => kind.name().to_string(),
    }
}

/// The first token from the prompt's logits and the remaining `gen - 1` chained on the
/// device: greedy, or drawn by `params` (on the device where the path has a device sampler).
fn decode(
    path: &mut GpuPath,
    prompt: &[u32],
    gen: usize,
    params: &SamplingParams,
) -> Result<(u32, std::time::Duration, Vec<u32>)> {
    let t0 = Instant::now();
    let logits = path.feed(prompt)?;
    let mut sampler = Sampler::new(*params);
    sampler.accept(prompt);
    let first = if params.is_greedy() {
        argmax(&logits)
    } else {
        sampler.sample(&logits)
    };
    let ttft = t0.elapsed();
    let rest = if params.is_greedy() {
        path.decode_greedy(first, gen - 1)?
    } else {
        sampler.accept(&[first]);
        path.decode_sampled(&sampler, first, gen - 1)?
    };
    Ok((first, ttft, rest))
}

#[derive(Serialize)]
struct PathResult {
    path: String,
    tpot_ms_median: f64,
    tpot_ms_min: f64,
    tpot_ms_max: f64,
    tokens_per_s: f64,
    gb_per_s: f64,
    percent_of_bandwidth: f64,
    ttft_ms_median: f64,
    ttft_ms_min: f64,
    /// Host time until every kernel of the prefill was queued (median over the reps).
    prefill_enqueued_ms_median: Option<f64>,
    /// Host time of the whole prefill call, the logits' copy included (median).
    prefill_call_ms_median: Option<f64>,
    prefill_tokens_per_s: f64,
    tokens: Vec<u32>,
}

#[derive(Serialize)]
struct Report {
    device: String,
    model: String,
    prompt_len: usize,
    gen: usize,
    reps: usize,
    /// "greedy", or the sampling parameters.
    sampling: String,
    weight_bytes_per_token: usize,
    /// The weights' memory by storage type (bf16, Q8_0, Q4_0, Q4_1, Q6_K).
    weight_memory: String,
    /// K and V bytes a timed step reads, at the mean context of the timed steps.
    kv_bytes_per_token: usize,
    /// (weights + KV) / read bandwidth: the step time no path can beat.
    floor_ms: f64,
    read_bandwidth_gbps: f64,
    commit: String,
    results: Vec<PathResult>,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub fn run(args: &BenchArgs) -> Result<()> {
    if args.gen < 2 || args.prompt_len == 0 || args.reps == 0 {
        bail!("--gen must be >= 2, --prompt-len and --reps >= 1");
    }
    let needed = args.prompt_len + args.gen + 1;
    let max_seq = args.max_context.unwrap_or(needed);
    if max_seq < needed {
        bail!("--max-context {max_seq} is less than --prompt-len + --gen + 1 = {needed}");
    }
    let paths = PathKind::parse_list(&args.paths)?;
    let params = args.sampling.params(args.seed)?;
    let sampling = if params.is_greedy() {
        "greedy".to_string()
    } else {
        format!("{params:?}")
    };
    for (path, flag) in [
        (&args.json, "--json"),
        (&args.timeline, "--timeline"),
        (&args.trace, "--trace"),
    ] {
        if let Some(path) = path {
            crate::cli::check_output_path(path, flag)?;
        }
    }
    let gpu = Gpu::new(0)?;
    let (config, weights, model_name) = match (&args.model, &args.preset) {
        (_, Some(p)) => {
            let c = presets::by_name(p)?;
            eprintln!(
                "bench: generating random weights of the {p} shape (seed {})",
                args.seed
            );
            let ty = args.dtype.unwrap_or(WeightType::Bf16);
            if args.q4_k_m_mix && ty.quant().is_none() {
                bail!("--q4-k-m-mix: needs a quantised --dtype (q8_0, q4_0, q4_1 or q6_k)");
            }
            let mut w = random_weights(&c, args.seed);
            w.convert_to(ty)?;
            if !args.q4_k_m_mix {
                (c, w, format!("{p} (random {ty} weights)"))
            } else {
                let layers = w.mix_like_q4_k_m();
                eprintln!(
                    "bench: layers {layers:?}: q/k/v widened to bf16, down Q6_K; LM head Q6_K (--q4-k-m-mix)"
                );
                if args.q6_k_widened {
                    w.widen_type(WeightType::Q6_K);
                    eprintln!("bench: the Q6_K matrices widened to bf16 (--q6-k-widened)");
                }
                (
                    c,
                    w,
                    format!("{p} (random {ty} weights, Q4_K_M's mix of formats)"),
                )
            }
        }
        (Some(m), None) => {
            let mut m2 = model::load(m)?;
            if let Some(ty) = args.dtype {
                m2.weights.convert_to(ty)?;
            }
            (m2.config, m2.weights, m.display().to_string())
        }
        (None, None) => {
            let path = crate::fetch::default_model()?;
            let mut m2 = model::load(&path)?;
            if let Some(ty) = args.dtype {
                m2.weights.convert_to(ty)?;
            }
            let name = format!(
                "SmolLM2-135M-Instruct Q4_1 (default, {})",
                args.dtype
                    .map_or("as stored".to_string(), |t| format!("as {t}"))
            );
            (m2.config, m2.weights, name)
        }
    };
    if max_seq > config.max_position_embeddings {
        bail!(
            "{} exceed the model's {} positions",
            if args.max_context.is_some() {
                "--max-context"
            } else {
                "--prompt-len + --gen"
            },
            config.max_position_embeddings
        );
    }
    let weight_memory = weights.describe_memory();
    eprintln!("bench: {weight_memory}");
    let dm = DeviceModel::upload(&gpu, &config, &weights)?;
    drop(weights);
    let bw = measure_read_bandwidth(&gpu).context("measuring the read bandwidth")?;
    let prompt: Vec<u32> = (0..args.prompt_len)
        .map(|i| ((i as u64 * 7919 + args.seed * 31 + 13) % config.vocab_size as u64) as u32)
        .collect();
    eprintln!(
        "bench: {} | {model_name} | streaming read {bw:.0} GB/s",
        gpu.describe()
    );

    // The timed steps feed positions prompt_len .. prompt_len + gen - 2 and each reads the K/V
    // of every position up to its own: on average this many.
    let mean_ctx = args.prompt_len + args.gen / 2;
    let kv_bytes = crate::gpu::model::KvCache::bytes(&config, mean_ctx);
    let step_bytes = dm.bytes_per_token + kv_bytes;
    let floor_ms = step_bytes as f64 / (bw * 1e9) * 1e3;
    let mut results = Vec::new();
    let mut profile = None;
    let mut gaps = Vec::new();
    let runs: Vec<(PathKind, usize)> = paths
        .iter()
        .flat_map(|&kind| {
            let per: Vec<usize> = if kind == PathKind::Megakernel {
                args.tokens_per_launch.0.clone()
            } else {
                vec![0]
            };
            per.into_iter().map(move |n| (kind, n))
        })
        .collect();
    let profiled = runs.iter().position(|r| r.0 == PathKind::Megakernel);
    for (run_index, &(kind, per_launch)) in runs.iter().enumerate() {
        let mut path = GpuPath::new(kind, &gpu, &dm, max_seq, max_seq)
            .with_context(|| format!("setting up {}", kind.name()))?;
        path.set_tokens_per_launch(if per_launch == 0 {
            usize::MAX
        } else {
            per_launch
        });
        if let Some(ms) = args.wait_timeout_ms {
            path.set_wait_timeout_ms(ms)?;
        }
        path.set_prefill_chunk(args.prefill_chunk)?;
        path.prepare_prefill()?;
        if let Some(mk) = path.as_megakernel() {
            eprintln!(
                "bench: megakernel context buckets (up to, split-KV parts): {:?}",
                mk.buckets().0
            );
        }
        // Warm-up: compilation, module load, first-touch of every buffer.
        decode(&mut path, &prompt, args.gen, &params)?;
        path.take_prefill_timing();
        let (mut tpot, mut ttft) = (Vec::new(), Vec::new());
        let (mut enqueued, mut in_prefill) = (Vec::new(), Vec::new());
        let mut tokens = Vec::new();
        for _ in 0..args.reps {
            path.reset();
            let t0 = Instant::now();
            let (first, first_time, rest) = decode(&mut path, &prompt, args.gen, &params)?;
            let total = t0.elapsed();
            ttft.push(first_time.as_secs_f64() * 1e3);
            tpot.push((total - first_time).as_secs_f64() * 1e3 / (args.gen - 1) as f64);
            tokens = std::iter::once(first).chain(rest).collect();
            // None where the prompt took decode steps (one token), not the batched prefill.
            if let Some(t) = path.take_prefill_timing() {
                enqueued.push(t.enqueued.as_secs_f64() * 1e3);
                in_prefill.push(t.total.as_secs_f64() * 1e3);
            }
        }
        if args.profile && profiled == Some(run_index) {
            if let Some(mk) = path.as_megakernel() {
                mk.reset();
                let first = argmax(&mk.feed(&prompt)?);
                let keep = args.timeline.is_some() || args.trace.is_some();
                profile = Some(mk.profile(first, 16, keep, Some(&params))?);
                // The gap between tokens, one launch per token and one per generation.
                for per in [1, usize::MAX] {
                    mk.reset();
                    let first = argmax(&mk.feed(&prompt)?);
                    let mut g = mk.token_gaps(first, 16, per)?;
                    let max = g.iter().copied().fold(0.0, f64::max);
                    gaps.push((per, median(&mut g), max));
                }
            }
        }
        if let Some(mk) = path.as_megakernel() {
            if !params.is_greedy() && crate::gpu::stepping::Steps::samples_in_launch(mk) {
                let d = mk.in_launch_draws()?;
                eprintln!(
                    "bench: {}: {} of {} draws inside the launch searched the whole vocabulary \
                     (no hint {}, keys past the slots {}, keys short of the cuts {}); the others \
                     took the first attempt, {} of them decided by the top token alone",
                    kind.name(),
                    d.searches,
                    d.draws,
                    d.no_hint,
                    d.slots,
                    d.short,
                    d.top
                );
            }
        }
        let (lo, hi) = (
            tpot.iter().cloned().fold(f64::INFINITY, f64::min),
            tpot.iter().cloned().fold(0.0, f64::max),
        );
        let med = median(&mut tpot);
        let ttft_min = ttft.iter().cloned().fold(f64::INFINITY, f64::min);
        let ttft_med = median(&mut ttft);
        let gbps = step_bytes as f64 / (med * 1e-3) / 1e9;
        results.push(PathResult {
            path: per_launch_label(kind, per_launch),
            tpot_ms_median: med,
            tpot_ms_min: lo,
            tpot_ms_max: hi,
            tokens_per_s: 1e3 / med,
            gb_per_s: gbps,
            percent_of_bandwidth: 100.0 * gbps / bw,
            ttft_ms_median: ttft_med,
            ttft_ms_min: ttft_min,
            prefill_tokens_per_s: args.prompt_len as f64 / (ttft_med * 1e-3),
            prefill_enqueued_ms_median: (!enqueued.is_empty()).then(|| median(&mut enqueued)),
            prefill_call_ms_median: (!in_prefill.is_empty()).then(|| median(&mut in_prefill)),
            tokens,
        });
    }

    println!(
        "device: {} | commit {} | model: {model_name} | prompt {} | gen {} | reps {} | weights/token {:.3} GB | KV/token {:.3} GB (mean context {mean_ctx}) | read bandwidth {bw:.0} GB/s (measured) | floor {floor_ms:.4} ms/token | {sampling}",
        gpu.describe(),
        env!("MEGAINFER_COMMIT"),
        args.prompt_len,
        args.gen,
        args.reps,
        dm.bytes_per_token as f64 / 1e9,
        kv_bytes as f64 / 1e9
    );
    println!("| path | TPOT median ms | TPOT min–max ms | tok/s | GB/s | % of BW | TTFT median (min) ms | prefill tok/s |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for r in &results {
        println!(
            "| {} | {:.4} | {:.4}–{:.4} | {:.1} | {:.0} | {:.1}% | {:.2} ({:.2}) | {:.0} |",
            r.path,
            r.tpot_ms_median,
            r.tpot_ms_min,
            r.tpot_ms_max,
            r.tokens_per_s,
            r.gb_per_s,
            r.percent_of_bandwidth,
            r.ttft_ms_median,
            r.ttft_ms_min,
            r.prefill_tokens_per_s
        );
    }
    if let Some(base) = results.iter().find(|r| r.path == "megakernel") {
        for r in results.iter().filter(|r| r.path != "megakernel") {
            let agree = r
                .tokens
                .iter()
                .zip(&base.tokens)
                .take_while(|(a, b)| a == b)
                .count();
            println!(
                "megakernel vs {}: {:.2}x faster; {} tokens identical for {agree}/{}",
                r.path,
                r.tpot_ms_median / base.tpot_ms_median,
                if params.is_greedy() {
                    "greedy"
                } else {
                    "sampled"
                },
                base.tokens.len()
            );
        }
    }
    if let Some(Some(tl)) = profile.as_ref().map(|p| &p.timeline) {
        if let Some(file) = &args.timeline {
            std::fs::write(file, tl.to_csv())
                .with_context(|| format!("writing {}", file.display()))?;
        }
        if let Some(file) = &args.trace {
            std::fs::write(file, tl.to_chrome_trace())
                .with_context(|| format!("writing {}", file.display()))?;
        }
    }
    if let Some(p) = &profile {
        println!("\nmegakernel profile (mean of 16 steps after the prompt; globaltimer, instruction-level):\n{p}");
    }
    for (per, med, max) in &gaps {
        println!(
            "megakernel gap between tokens ({}): median {med:.2} µs, max {max:.2} µs over 15 (from the argmax's token to the next step's first instruction starting, GPU clock)",
            if *per == 1 { "one launch per token" } else { "one launch per generation" }
        );
    }
    println!("GB/s and % of BW: (weights + the K/V a step reads) / TPOT, against the measured read bandwidth; 100% is the floor.");
    for r in &results {
        if let (Some(q), Some(c)) = (r.prefill_enqueued_ms_median, r.prefill_call_ms_median) {
            println!(
                "{}: the prefill's kernels were all queued {q:.2} ms into its {c:.2} ms (medians); the rest waited for the GPU{}",
                r.path,
                if q > 0.8 * c { " (launch-bound: the host sets the pace)" } else { "" }
            );
        }
    }
    println!("TPOT: wall time of {} back-to-back {} steps / {} (the megakernel's steps: one launch for the whole generation unless a row says otherwise), host launch overhead included; TTFT: wall time of the batched prefill of the {}-token prompt (chunks of {} tokens), the LM head and the logits' copy to the host; prefill tok/s = prompt tokens / median TTFT.", args.gen - 1, if params.is_greedy() { "greedy" } else { "sampled" }, args.gen - 1, args.prompt_len, args.prefill_chunk);
    if !params.is_greedy() && results.iter().any(|r| r.path == "megakernel") {
        println!("Sampled steps draw on the device on every path: the graph paths with one kernel after each step, the megakernel inside the launch (as generations) for vocabularies up to {} tokens, else with one kernel after each launch (MEGAINFER_MK_DRAW_IN_LAUNCH=1 or 0 chooses).", crate::gpu::megakernel::DRAW_IN_LAUNCH_MAX_VOCAB);
    }
    if let Some(path) = &args.json {
        let report = Report {
            device: gpu.describe(),
            model: model_name,
            prompt_len: args.prompt_len,
            gen: args.gen,
            reps: args.reps,
            sampling,
            weight_bytes_per_token: dm.bytes_per_token,
            weight_memory,
            kv_bytes_per_token: kv_bytes,
            floor_ms,
            read_bandwidth_gbps: bw,
            commit: env!("MEGAINFER_COMMIT").to_string(),
            results,
        };
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{parse_per_launch, per_launch_label};
    use crate::gpu::paths::PathKind;

    #[test]
    fn tokens_per_launch_lists_parse_and_name_their_rows() {
        assert_eq!(parse_per_launch("1,0").unwrap().0, [1, 0]);
        assert_eq!(parse_per_launch(" 8 ").unwrap().0, [8]);
        for bad in ["", "1,", "x", "-1", "1;0"] {
            let e = parse_per_launch(bad).unwrap_err();
            assert!(
                e.contains(bad) && e.contains("0 = the whole generation"),
                "{e}"
            );
        }
        assert_eq!(per_launch_label(PathKind::Megakernel, 0), "megakernel");
        assert_eq!(
            per_launch_label(PathKind::Megakernel, 1),
            "megakernel (1/launch)"
        );
        assert_eq!(per_launch_label(PathKind::GraphPdl, 0), "graph-pdl");
    }
}

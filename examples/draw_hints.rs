//! How often the megakernel's draw inside the launch would fall back to its whole-vocabulary
//! search on a trained model's logits, under different rules for the next draw's hint.
//!
//! The draw tries the keys within the hint (a distance below the vocabulary's maximum, left by
//! the previous draw) first and searches the whole vocabulary where those keys did not decide
//! the cuts (megakernel/ops/sample.cuh). Whether an attempt holds depends only on the logits
//! and the hint, not on the GPU, so this replays the rule on the CPU reference's logits of a
//! sampled chat (the tokens drawn by `sample_at`, the same on every path) with each candidate
//! hint rule. Usage:
//!
//!   cargo run --release --example draw_hints -- MODEL.gguf|preset:NAME [TOKENS]
//!
//! The blocks' geometry is the default model's schedule on a 132-SM GPU (131 LM-head blocks of
//! 376 rows, 256 key slots a block, 15 of them loaded first, 2,048 keys in the second load);
//! `ROWS`, `CAP` and `SECOND` in the environment change it (`Geometry`).
//! The draws replayed are four chats and then `bench -m MODEL --prompt-len 37`'s prompt
//! (`BENCH_ONLY=1`: that prompt alone). The tables are in BENCHMARKS.md (2026-11-29).

use anyhow::{Context, Result};
use megainfer::model;
use megainfer::reference::CpuForward;
use megainfer::sampling::{sample_at, SamplingParams, K_MAX};

/// The blocks' geometry: rows a block, key slots a block, slots of each block in the first
/// load, keys in the second. The megakernel's for the default model on 132 SMs by default;
/// `ROWS=N`, `CAP=N` and `SECOND=N` in the environment replay another (the fused sampler after
/// the launch: `ROWS=1024 CAP=160 SECOND=0`, its 48 CTAs on SmolLM2's vocabulary, whose merge
/// takes any number of keys; 0 means no limit).
struct Geometry {
    rows: usize,
    cap: usize,
    first: usize,
    second: usize,
}

impl Geometry {
    fn from_env() -> Result<Geometry> {
        let var = |name: &str, default: usize| -> Result<usize> {
            match std::env::var(name) {
                Ok(v) => v
                    .trim()
                    .parse()
                    .with_context(|| format!("{name}: '{v}' is not a count")),
                Err(_) => Ok(default),
            }
        };
        let g = Geometry {
            rows: var("ROWS", 376)?,
            cap: var("CAP", 256)?,
            first: 15,
            second: var("SECOND", 2048)?,
        };
        anyhow::ensure!(g.rows > 0, "ROWS must be at least 1");
        Ok(g)
    }
}

/// One draw's logits reduced to what the attempt's outcome depends on.
struct Step {
    gmax: f32,
    /// The top K_MAX logits, largest first.
    top: Vec<f32>,
    /// Kept candidates under the rule, and whether top-p's cut fired (else min-p's decided).
    keep: usize,
    topp_fired: bool,
    keep_p: usize,
    /// min-p's floor (every logit at or above it is kept); -inf without min-p.
    floor: f64,
    /// Every logit, to count keys within a hint per block.
    logits: Vec<f32>,
    /// The top token alone reaches top-p (top-k off): the draw needs no key and leaves the
    /// hint as it was (select.cuh's smp_top_dominates).
    top_alone: bool,
}

fn reduce(p: &SamplingParams, l: &[f32]) -> Step {
    let mut idx: Vec<u32> = (0..l.len() as u32).collect();
    idx.sort_by(|&a, &b| l[b as usize].total_cmp(&l[a as usize]).then(a.cmp(&b)));
    let top: Vec<f32> = idx[..K_MAX].iter().map(|&i| l[i as usize]).collect();
    let gmax = top[0];
    let z: f64 = l.iter().map(|&x| (x as f64 - gmax as f64).exp()).sum();
    let (mut keep_p, mut fired) = (top.len(), false);
    if p.top_p < 1.0 {
        let mut acc = 0.0;
        for (j, &x) in top.iter().enumerate() {
            acc += (x as f64 - gmax as f64).exp();
            if acc / z >= p.top_p as f64 {
                keep_p = j + 1;
                fired = true;
                break;
            }
        }
    }
    let mut keep = keep_p;
    let mut floor = f64::NEG_INFINITY;
    if p.min_p > 0.0 {
        floor = gmax as f64 + (p.min_p as f64).ln();
        keep = top[..keep_p]
            .iter()
            .take_while(|&&x| x as f64 >= floor)
            .count()
            .max(1);
    }
    let top_alone = p.top_p < 1.0 && p.top_k == 0 && 1.0 / z >= p.top_p as f64;
    Step {
        top_alone,
        gmax,
        top,
        keep,
        topp_fired: fired,
        keep_p,
        floor,
        logits: l.to_vec(),
    }
}

/// A rule for the next hint. Before: 1.25 d + 1/16, d the depth below the maximum of the
/// candidate that decided the cuts (in the draw's own list: the attempt's keys within the
/// hint, or the search's top K_MAX). `decay`: with top-p, no less than decay times the hint
/// the draw was given. `floor`: with min-p, an attempt whose keys reach below min-p's floor
/// decided the cuts, and the hint is the floor's depth plus 1/16 (no more than that is needed,
/// and no less where the draw's list ended above the floor).
#[derive(Clone, Copy)]
struct Rule {
    decay: f32,
    floor: bool,
}

#[derive(Default)]
struct Tally {
    draws: usize,
    no_hint: usize,
    slots: usize,
    short: usize,
    second_load: usize,
    keys: usize,
    /// Draws decided by the top token alone.
    top_alone: usize,
}

fn replay(steps: &[Step], p: &SamplingParams, rule: Rule, g: &Geometry) -> Tally {
    let mut t = Tally::default();
    let mut hint = -1.0f32;
    for s in steps {
        t.draws += 1;
        if s.top_alone {
            t.top_alone += 1;
            continue;
        }
        // The draw's sorted list: the attempt's keys within the hint where it decided the
        // cuts, else the search's top K_MAX.
        let mut kk = s.top.len();
        if hint <= 0.0 {
            t.no_hint += 1;
        } else {
            let tau = s.gmax - hint;
            let mut extra = 0usize;
            let mut over = false;
            let mut total = 0usize;
            for block in s.logits.chunks(g.rows) {
                let n = block.iter().filter(|&&x| x >= tau).count();
                total += n;
                extra += n.saturating_sub(g.first);
                over |= n > g.cap;
            }
            t.keys += total;
            if extra > 0 {
                t.second_load += 1;
            }
            if over || (g.second > 0 && extra > g.second) {
                t.slots += 1;
            } else {
                let lo = s.top.iter().take_while(|&&x| x >= tau).count();
                let complete = if (s.top.len() == K_MAX && lo == K_MAX)
                    || (rule.floor && (tau as f64) < s.floor)
                {
                    true
                } else if s.keep < s.keep_p {
                    s.keep < lo
                } else {
                    s.topp_fired && s.keep <= lo
                };
                if complete {
                    kk = total.min(K_MAX);
                } else {
                    t.short += 1;
                }
            }
        }
        // The next hint (smp_next_hint).
        let j = s.keep.min(kk - 1);
        let fresh = 1.25 * (s.gmax - s.top[j]) + 0.0625;
        let prev = hint;
        hint = if p.top_p < 1.0 && prev > 0.0 {
            fresh.max(rule.decay * prev)
        } else {
            fresh
        };
        if rule.floor && p.min_p > 0.0 {
            let hf = -p.min_p.ln() + 0.0625;
            hint = if s.keep >= kk && kk < K_MAX {
                hf
            } else {
                hint.min(hf)
            };
        }
    }
    t
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let path = args
        .get(1)
        .context("usage: draw_hints MODEL.gguf|preset:NAME [TOKENS]")?;
    let n: usize = args.get(2).map(|s| s.parse()).transpose()?.unwrap_or(128);
    let g = Geometry::from_env()?;
    // A preset's random weights (as `bench --preset NAME` makes them, seed 0) replay the
    // bench's prompt only.
    let preset = path.strip_prefix("preset:");
    let m = match preset {
        Some(name) => {
            let config = model::presets::by_name(name)?;
            let weights = model::random::random_weights(&config, 0);
            model::Model {
                config,
                weights,
                tokenizer: None,
            }
        }
        None => model::load(std::path::Path::new(path))?,
    };
    let prompts = [
        "Write a short story about a dragon who learns to bake bread.",
        "Explain how a refrigerator works to a ten-year-old.",
        "What are three good habits for staying healthy? Answer in a list.",
        "Translate into French: The weather is lovely today and we are going to the beach.",
    ];
    let rules_sampling = [
        (
            "T 0.8 top-p 0.95",
            SamplingParams {
                temperature: 0.8,
                top_p: 0.95,
                ..SamplingParams::greedy()
            },
        ),
        (
            "T 0.8 min-p 0.05",
            SamplingParams {
                temperature: 0.8,
                min_p: 0.05,
                ..SamplingParams::greedy()
            },
        ),
    ];
    // The rule before, the committed one (select.cuh's smp_next_hint and
    // smp_attempt_complete: the floor and a decay of 0.95), and its neighbours.
    let hint_rules = [
        Rule {
            decay: 0.0,
            floor: false,
        },
        Rule {
            decay: 0.0,
            floor: true,
        },
        Rule {
            decay: 0.85,
            floor: true,
        },
        Rule {
            decay: 0.9,
            floor: true,
        },
        Rule {
            decay: 0.93,
            floor: true,
        },
        Rule {
            decay: 0.95,
            floor: true,
        },
    ];
    for (name, p) in rules_sampling {
        let mut steps = Vec::new();
        // Four chats, then `bench -m MODEL --prompt-len 37`'s prompt (seed 0).
        let mut inputs = Vec::new();
        let chats = preset.is_none() && std::env::var_os("BENCH_ONLY").is_none();
        for text in prompts.iter().filter(|_| chats) {
            let tok = m.tokenizer.as_ref().context("the model has no tokenizer")?;
            let rendered = format!("<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n");
            inputs.push(tok.encode_chat(&rendered)?);
        }
        let vocab = m.config.vocab_size as u64;
        inputs.push(
            (0..37u64)
                .map(|i| ((i * 7919 + 13) % vocab) as u32)
                .collect(),
        );
        for (k, ids) in inputs.iter().enumerate() {
            let ids = ids.clone();
            let mut fwd = CpuForward::new(&m.config, &m.weights, ids.len() + n + 1);
            let params = SamplingParams {
                seed: if k + 1 == inputs.len() {
                    0
                } else {
                    k as u64 + 1
                },
                ..p
            };
            let mut ctx = ids.clone();
            let mut logits = fwd.forward(&ids)?;
            for _ in 0..n {
                let pos = (ctx.len() - 1) as u64;
                let t = sample_at(&params, &logits, pos, &ctx);
                steps.push(reduce(&params, &logits));
                ctx.push(t);
                logits = fwd.forward(&[t])?;
            }
        }
        println!(
            "{name}: {} draws over {} prompts",
            steps.len(),
            inputs.len()
        );
        // Whether draws by the top token alone come in runs: how often one follows another,
        // and how often it follows a draw that was not one (prompts run one after another).
        let (mut after_top, mut top_after_top, mut after_other, mut top_after_other) = (0, 0, 0, 0);
        for w in steps.windows(2) {
            if w[0].top_alone {
                after_top += 1;
                top_after_top += usize::from(w[1].top_alone);
            } else {
                after_other += 1;
                top_after_other += usize::from(w[1].top_alone);
            }
        }
        println!(
            "top token alone: {} of {} draws; after such a draw {top_after_top} of {after_top}, \
             after another {top_after_other} of {after_other}",
            steps.iter().filter(|s| s.top_alone).count(),
            steps.len()
        );
        println!("| hint rule | searched | no hint | past the slots | short of the cuts | second load | keys a draw | top token alone |");
        println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
        for &r in &hint_rules {
            let t = replay(&steps, &p, r, &g);
            println!(
                "| decay {}{} | {} | {} | {} | {} | {} | {:.0} | {} |",
                r.decay,
                if r.floor { ", floor" } else { "" },
                t.no_hint + t.slots + t.short,
                t.no_hint,
                t.slots,
                t.short,
                t.second_load,
                t.keys as f64 / (t.draws - t.no_hint - t.top_alone).max(1) as f64,
                t.top_alone
            );
        }
    }
    Ok(())
}

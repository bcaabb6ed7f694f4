//! Readable summary, time estimate and JSON export of a schedule.
//!
//! The estimate walks the global order with each SM streaming at `bandwidth / sm_count`. An
//! instruction starts when its SM is free and every instruction whose output it reads has
//! ended, and takes
//! `latency + bytes / per-SM bandwidth`, except that while an SM idles on its inputs its loader
//! already fetches the instruction's weights (weights never depend on activations), up to
//! the shared memory it has. The critical path is when the last instruction ends. It ignores
//! L2 traffic and bandwidth left over by idle SMs, so it is a model, not a measurement.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::deps::{dependencies, Writers};
use crate::{CostModel, GpuShape, ModelShape, Op, Options, Schedule, StageKind};

/// Per-SM HBM bytes of one kind of stage, over all its layers and SMs.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StageStats {
    pub kind: StageKind,
    pub instrs: usize,
    /// Smallest per-SM bytes of any one stage of this kind (layer).
    pub min: u64,
    pub mean: f64,
    pub max: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Estimate {
    pub bandwidth_gbps: f64,
    pub latency_us: f64,
    pub context: usize,
    pub weight_bytes: u64,
    pub kv_bytes: u64,
    /// Weights alone at full bandwidth.
    pub floor_weights_us: f64,
    /// Weights and KV cache at full bandwidth.
    pub floor_us: f64,
    pub critical_path_us: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    pub model: ModelShape,
    pub gpu: GpuShape,
    pub options: Options,
    pub instrs: usize,
    pub per_kind: Vec<(StageKind, usize)>,
    /// Instructions per SM: min, mean, max.
    pub per_sm: (usize, f64, usize),
    pub stages: Vec<StageStats>,
    pub estimate: Estimate,
}

pub fn summarize(s: &Schedule, cost: &CostModel) -> Summary {
    let sms = s.gpu.sm_count;
    let lens: Vec<usize> = s.streams.iter().map(Vec::len).collect();
    let mut sm_of = vec![0usize; s.instrs.len()];
    for (sm, stream) in s.streams.iter().enumerate() {
        for &i in stream {
            sm_of[i as usize] = sm;
        }
    }
    let mut stages = Vec::new();
    let mut per_kind = Vec::new();
    for kind in StageKind::ALL {
        // One stage per layer (or one for the LM head and the argmax).
        let mut bytes: Vec<Vec<u64>> = Vec::new();
        let mut n = 0;
        for (i, op) in s
            .instrs
            .iter()
            .enumerate()
            .filter(|(_, op)| op.kind() == kind)
        {
            let layer = op.layer().unwrap_or(0) as usize;
            if bytes.len() <= layer {
                bytes.resize(layer + 1, vec![0; sms]);
            }
            bytes[layer][sm_of[i]] += op.hbm_bytes(&s.model, cost.context);
            n += 1;
        }
        if n == 0 {
            continue;
        }
        per_kind.push((kind, n));
        let all = bytes.iter().flatten();
        stages.push(StageStats {
            kind,
            instrs: n,
            min: all.clone().copied().min().unwrap_or(0),
            mean: all.clone().sum::<u64>() as f64 / (bytes.len() * sms) as f64,
            max: all.copied().max().unwrap_or(0),
        });
    }
    Summary {
        model: s.model,
        gpu: s.gpu,
        options: s.options,
        instrs: s.instrs.len(),
        per_kind,
        per_sm: (
            lens.iter().copied().min().unwrap_or(0),
            s.instrs.len() as f64 / sms as f64,
            lens.iter().copied().max().unwrap_or(0),
        ),
        stages,
        estimate: estimate(s, cost),
    }
}

/// See the module documentation for the model.
pub fn estimate(s: &Schedule, cost: &CostModel) -> Estimate {
    let bw = cost.sm_bytes_per_us(&s.gpu);
    let capacity = s.gpu.smem_bytes() as f64;
    let mut sm_free = vec![0f64; s.gpu.sm_count];
    // A schedule that validated has one writer per element; one that does not is estimated
    // with program order alone. The producers are looked up per instruction, not stored: a
    // fine schedule on many SMs has tens of millions of edges.
    let writers = Writers::new(s).ok();
    let mut end = vec![0f64; s.instrs.len()];
    let mut sm_of = vec![0usize; s.instrs.len()];
    for (sm, stream) in s.streams.iter().enumerate() {
        for &i in stream {
            sm_of[i as usize] = sm;
        }
    }
    let mut end_all = 0f64;
    for (i, op) in s.instrs.iter().enumerate() {
        let sm = sm_of[i];
        let mut inputs = 0f64;
        if let Some(writers) = &writers {
            for r in s.access(op).reads {
                writers.cover(r.buffer, &r.elements, |_, w| {
                    if let Some(w) = w {
                        inputs = inputs.max(end[w]);
                    }
                });
            }
        }
        let bytes = op.hbm_bytes(&s.model, cost.context) as f64;
        let idle = (inputs - sm_free[sm]).max(0.0);
        let prefetched = bytes.min(capacity).min(idle * bw);
        end[i] = sm_free[sm].max(inputs) + cost.latency_us + (bytes - prefetched) / bw;
        sm_free[sm] = end[i];
        end_all = end_all.max(end[i]);
    }
    let weight_bytes = s.model.weight_bytes();
    let kv_bytes = s.model.kv_bytes(cost.context);
    let full = cost.bandwidth_gbps * 1e3;
    Estimate {
        bandwidth_gbps: cost.bandwidth_gbps,
        latency_us: cost.latency_us,
        context: cost.context,
        weight_bytes,
        kv_bytes,
        floor_weights_us: weight_bytes as f64 / full,
        floor_us: (weight_bytes + kv_bytes) as f64 / full,
        critical_path_us: end_all,
    }
}

fn kib(b: f64) -> String {
    format!("{:.1} KiB", b / 1024.0)
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (m, g, o) = (&self.model, &self.gpu, &self.options);
        writeln!(
            f,
            "model: hidden {} intermediate {} layers {} heads {}/{} kv head_dim {} vocab {}",
            m.hidden, m.intermediate, m.layers, m.heads, m.kv_heads, m.head_dim, m.vocab
        )?;
        writeln!(
            f,
            "gpu: {} SMs, {} smem pages of {} bytes",
            g.sm_count, g.smem_pages, g.page_bytes
        )?;
        let qkv = match o.qkv_pieces {
            0 => format!("{} pairs ({} rows)", o.qkv_pairs, 2 * o.qkv_pairs),
            n => format!("{n} pieces a layer"),
        };
        let attn = format!("{} parts{}", o.attn_parts, o.attn_heads_label());
        writeln!(
            f,
            "granularity: qkv {qkv}, o-proj {} rows, up-gate {} rows, down {} rows × {} \
             k-chunks, attention {attn}, lm-head {} rows; fixed cost {} bytes, context {}",
            o.oproj_rows,
            o.upgate_rows,
            o.down_rows,
            o.down_chunks,
            o.lmhead_rows,
            o.fixed_cost_bytes,
            o.context
        )?;
        writeln!(f, "\ninstructions: {}", self.instrs)?;
        for (kind, n) in &self.per_kind {
            writeln!(f, "  {:<18} {n}", kind.name())?;
        }
        let (lo, mean, hi) = self.per_sm;
        writeln!(f, "per SM: min {lo}, mean {mean:.1}, max {hi}")?;
        writeln!(
            f,
            "\nHBM bytes per SM per stage (one layer's stage; over all layers and SMs):"
        )?;
        writeln!(
            f,
            "  {:<18} {:>7} {:>12} {:>12} {:>12} {:>9}",
            "stage", "instrs", "min", "mean", "max", "max/mean"
        )?;
        for st in &self.stages {
            let ratio = if st.mean > 0.0 {
                format!("{:.3}", st.max as f64 / st.mean)
            } else {
                "-".into()
            };
            writeln!(
                f,
                "  {:<18} {:>7} {:>12} {:>12} {:>12} {:>9}",
                st.kind.name(),
                st.instrs,
                kib(st.min as f64),
                kib(st.mean),
                kib(st.max as f64),
                ratio
            )?;
        }
        // What one SM streams per layer: its share of the K/V cache beside its share of the
        // weights (the split-KV parts are sized so that every SM takes a share of both).
        let stage = |k: StageKind| self.stages.iter().find(|st| st.kind == k);
        let weights: f64 = [
            StageKind::Qkv,
            StageKind::OProj,
            StageKind::UpGate,
            StageKind::Down,
        ]
        .into_iter()
        .filter_map(stage)
        .map(|st| st.mean)
        .sum();
        if let Some(kv) = stage(StageKind::Attention) {
            writeln!(
                f,
                "per SM and layer: K/V mean {} (max {}), weights mean {}: K/V/weights {:.2}",
                kib(kv.mean),
                kib(kv.max as f64),
                kib(weights),
                if weights > 0.0 {
                    kv.mean / weights
                } else {
                    0.0
                }
            )?;
        }
        let e = &self.estimate;
        writeln!(
            f,
            "\nestimate at {} GB/s, {} µs per instruction, context {}:",
            e.bandwidth_gbps, e.latency_us, e.context
        )?;
        writeln!(
            f,
            "  floor (weights {:.3} GB): {:.1} µs; with KV cache ({:.1} MB): {:.1} µs",
            e.weight_bytes as f64 / 1e9,
            e.floor_weights_us,
            e.kv_bytes as f64 / 1e6,
            e.floor_us
        )?;
        writeln!(
            f,
            "  critical path: {:.1} µs ({:.1}% of the floor with KV, {:.0} tokens/s)",
            e.critical_path_us,
            100.0 * e.critical_path_us / e.floor_us,
            1e6 / e.critical_path_us
        )
    }
}

/// The JSON form of a schedule; docs/schedule-json.md documents every field.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JsonSchedule {
    pub format: u32,
    pub model: ModelShape,
    pub gpu: GpuShape,
    pub options: Options,
    pub words_per_instr: usize,
    pub instructions: usize,
    /// The tagged activations: `(part, first offset)` in arena order, and the total.
    pub arena: Vec<(String, usize)>,
    pub arena_len: usize,
    pub sms: Vec<JsonSm>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JsonSm {
    pub sm: usize,
    pub instructions: Vec<JsonInstr>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JsonInstr {
    /// Position in the global order.
    pub index: u32,
    /// Position in the encoded order (what the megakernel's errors and profile call it).
    pub position: usize,
    pub op: Op,
    pub hbm_bytes: u64,
    /// What it reads and writes, as `buffer[start..end]` (e.g. `q[3][64..96]`: elements
    /// 64..96 of layer 3's `q`; see the rustdoc of `scheduler::instruction`).
    pub reads: Vec<String>,
    pub writes: Vec<String>,
    /// Global indices of the instructions whose output it reads.
    pub after: Vec<u32>,
}

fn span_name(span: &crate::Span) -> String {
    format!(
        "{}[{}..{}]",
        span.buffer, span.elements.start, span.elements.end
    )
}

pub fn to_json(s: &Schedule) -> JsonSchedule {
    let deps = dependencies(s).unwrap_or_else(|_| vec![Vec::new(); s.instrs.len()]);
    let arena = s.arena();
    let mut position = 0;
    JsonSchedule {
        format: 2,
        model: s.model,
        gpu: s.gpu,
        options: s.options,
        words_per_instr: crate::WORDS_PER_INSTR,
        instructions: s.instrs.len(),
        arena: arena
            .parts()
            .iter()
            .map(|&(n, o)| (n.to_string(), o))
            .collect(),
        arena_len: arena.len(),
        sms: s
            .streams
            .iter()
            .enumerate()
            .map(|(sm, stream)| JsonSm {
                sm,
                instructions: stream
                    .iter()
                    .map(|&i| {
                        let op = s.instrs[i as usize];
                        let a = s.access(&op);
                        position += 1;
                        JsonInstr {
                            index: i,
                            position: position - 1,
                            op,
                            hbm_bytes: op.hbm_bytes(&s.model, s.options.context),
                            reads: a.reads.iter().map(span_name).collect(),
                            writes: a.writes.iter().map(span_name).collect(),
                            after: deps[i as usize].clone(),
                        }
                    })
                    .collect(),
            })
            .collect(),
    }
}

//! Readable summary, time estimate and JSON export of a schedule.
//!
//! The estimate walks the global order with each SM streaming at `bandwidth / sm_count`. An
//! instruction starts when its SM is free and its waits are met and takes
//! `latency + bytes / per-SM bandwidth`, except that while an SM idles on a wait its loader
//! already fetches the instruction's weights (weights never depend on activations), up to
//! the shared memory it has. The critical path is when the last instruction ends. It ignores
//! L2 traffic and bandwidth left over by idle SMs, so it is a model, not a measurement.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::{CostModel, CounterLayout, GpuShape, ModelShape, Op, Options, Schedule, StageKind};

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
    pub counters: u32,
    pub max_epochs: u64,
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
        for (i, instr) in s
            .instrs
            .iter()
            .enumerate()
            .filter(|(_, i)| i.op.kind() == kind)
        {
            let layer = instr.op.layer().unwrap_or(0) as usize;
            if bytes.len() <= layer {
                bytes.resize(layer + 1, vec![0; sms]);
            }
            bytes[layer][sm_of[i]] += instr.op.hbm_bytes(&s.model, cost.context);
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
        counters: s.counters.count(),
        max_epochs: s.max_epochs(),
        estimate: estimate(s, cost),
    }
}

/// See the module documentation for the model.
pub fn estimate(s: &Schedule, cost: &CostModel) -> Estimate {
    let bw = cost.sm_bytes_per_us(&s.gpu);
    let capacity = s.gpu.smem_bytes() as f64;
    let mut sm_free = vec![0f64; s.gpu.sm_count];
    let mut counter_done = vec![0f64; s.counters.count() as usize];
    let mut sm_of = vec![0usize; s.instrs.len()];
    for (sm, stream) in s.streams.iter().enumerate() {
        for &i in stream {
            sm_of[i as usize] = sm;
        }
    }
    let mut end_all = 0f64;
    for (i, instr) in s.instrs.iter().enumerate() {
        let sm = sm_of[i];
        let deps = instr
            .waits
            .iter()
            .map(|w| counter_done[w.counter as usize])
            .fold(0f64, f64::max);
        let bytes = instr.op.hbm_bytes(&s.model, cost.context) as f64;
        let idle = (deps - sm_free[sm]).max(0.0);
        let prefetched = bytes.min(capacity).min(idle * bw);
        let end = sm_free[sm].max(deps) + cost.latency_us + (bytes - prefetched) / bw;
        sm_free[sm] = end;
        if let Some(c) = instr.signal {
            let d = &mut counter_done[c as usize];
            *d = d.max(end);
        }
        end_all = end_all.max(end);
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
        writeln!(
            f,
            "granularity: qkv {} pairs ({} rows), o-proj {} rows, up-gate {} rows, down {} rows × {} \
             k-chunks, attention {} parts, lm-head {} rows; fixed cost {} bytes, context {}",
            o.qkv_pairs,
            2 * o.qkv_pairs,
            o.oproj_rows,
            o.upgate_rows,
            o.down_rows,
            o.down_chunks,
            o.attn_parts,
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
        writeln!(
            f,
            "\ncounters: {} u32; wraps after {} launches (then zero them and restart epochs)",
            self.counters, self.max_epochs
        )?;
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
    pub counters: JsonCounters,
    pub instructions: usize,
    pub sms: Vec<JsonSm>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JsonCounters {
    pub count: u32,
    pub layout: CounterLayout,
    pub per_layer: u32,
    pub max_epochs: u64,
    /// Name of every counter, by index.
    pub names: Vec<String>,
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
    pub op: Op,
    pub hbm_bytes: u64,
    pub waits: Vec<JsonCounterRef>,
    pub signal: Option<JsonCounterRef>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JsonCounterRef {
    pub counter: u32,
    pub name: String,
    /// For waits: the base target (the counter's signallers per token).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub base: Option<u32>,
}

pub fn to_json(s: &Schedule) -> JsonSchedule {
    let c = &s.counters;
    let named = |counter: u32, base: Option<u32>| JsonCounterRef {
        counter,
        name: c.name(counter),
        base,
    };
    JsonSchedule {
        format: 1,
        model: s.model,
        gpu: s.gpu,
        options: s.options,
        words_per_instr: crate::WORDS_PER_INSTR,
        counters: JsonCounters {
            count: c.count(),
            layout: *c,
            per_layer: c.per_layer(),
            max_epochs: s.max_epochs(),
            names: (0..c.count()).map(|i| c.name(i)).collect(),
        },
        instructions: s.instrs.len(),
        sms: s
            .streams
            .iter()
            .enumerate()
            .map(|(sm, stream)| JsonSm {
                sm,
                instructions: stream
                    .iter()
                    .map(|&i| {
                        let instr = &s.instrs[i as usize];
                        JsonInstr {
                            index: i,
                            op: instr.op,
                            hbm_bytes: instr.op.hbm_bytes(&s.model, s.options.context),
                            waits: instr
                                .waits
                                .iter()
                                .map(|w| named(w.counter, Some(w.base)))
                                .collect(),
                            signal: instr.signal.map(|sig| named(sig, None)),
                        }
                    })
                    .collect(),
            })
            .collect(),
    }
}

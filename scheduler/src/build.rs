//! The DAG of one decode step, laid out stage by stage, assigned to SMs and checked.
//!
//! The instructions are listed stage by stage (QKV, attention, reduction, O-proj, up-gate,
//! down of each layer, then the LM head and the argmax), which is a topological order of what
//! they read and write ([`crate::access`]); each stage is balanced over the SMs by the cost
//! model. There are no explicit waits: on the GPU an instruction reads its inputs as tagged
//! activations and proceeds once they carry this step's tag.

use std::ops::Range;

use crate::options::{chunk_cols, pieces, qkv_cuts};
use crate::{assign, validate, GpuShape, ModelShape, Op, Options, Schedule, ScheduleError};

/// Builds and validates the schedule of one decode step.
pub fn build(
    model: &ModelShape,
    gpu: &GpuShape,
    opts: &Options,
) -> Result<Schedule, ScheduleError> {
    model.check()?;
    gpu.check(model)?;
    opts.check(model)?;
    let (instrs, stages) = dag(model, opts);
    let cost: Vec<u64> = instrs
        .iter()
        .map(|op| op.hbm_bytes(model, opts.context) + opts.fixed_cost_bytes)
        .collect();
    let sm_of = assign::balance(&stages, &cost, gpu.sm_count);
    let mut streams = vec![Vec::new(); gpu.sm_count];
    for (i, &s) in sm_of.iter().enumerate() {
        streams[s as usize].push(i as u32);
    }
    let schedule = Schedule {
        model: *model,
        gpu: *gpu,
        options: *opts,
        instrs,
        streams,
    };
    validate(&schedule)?;
    Ok(schedule)
}

/// The nodes in the global order and the range of each stage in it.
fn dag(m: &ModelShape, o: &Options) -> (Vec<Op>, Vec<Range<usize>>) {
    let mut nodes = Vec::new();
    let mut stages = Vec::new();
    let mut stage = |nodes: &mut Vec<Op>, add: &mut dyn FnMut(&mut Vec<Op>)| {
        let start = nodes.len();
        add(nodes);
        if nodes.len() > start {
            stages.push(start..nodes.len());
        }
    };
    let (kv, group, half) = (m.kv_heads as u32, m.group() as u32, m.head_dim / 2);
    let parts = o.attn_parts as u32;
    for l in 0..m.layers as u32 {
        // Group-major, so that the attention of group 0 can start while later groups project.
        stage(&mut nodes, &mut |nodes| {
            for g in 0..kv {
                let q_heads = g * group..(g + 1) * group;
                let kv_heads = [m.heads as u32 + g, m.heads as u32 + kv + g];
                for (k, head) in q_heads.chain(kv_heads).enumerate() {
                    let h = g as usize * (group as usize + 2) + k;
                    for (pair_start, pair_count) in qkv_cuts(o, h, m.qkv_heads(), half) {
                        nodes.push(Op::RmsQkvRope {
                            layer: l,
                            head,
                            pair_start,
                            pair_count,
                        });
                    }
                }
            }
        });
        stage(&mut nodes, &mut |nodes| {
            let share = o.attn_heads_of(m) as u32;
            for g in 0..kv {
                for part in 0..parts {
                    for s in 0..group / share {
                        nodes.push(Op::Attention {
                            layer: l,
                            kv_head: g,
                            part,
                            parts,
                            head_start: g * group + s * share,
                            head_count: share,
                        });
                    }
                }
            }
        });
        if parts > 1 {
            stage(&mut nodes, &mut |nodes| {
                for g in 0..kv {
                    nodes.push(Op::AttnReduce {
                        layer: l,
                        kv_head: g,
                        parts,
                    });
                }
            });
        }
        stage(&mut nodes, &mut |nodes| {
            for (row_start, row_count) in pieces(0..m.hidden, o.oproj_rows) {
                nodes.push(Op::OProjResidual {
                    layer: l,
                    row_start,
                    row_count,
                });
            }
        });
        // Chunk-major, so that chunk 0's down projection can start first.
        stage(&mut nodes, &mut |nodes| {
            for c in 0..o.down_chunks {
                let cols = chunk_cols(m.intermediate, o.down_chunks, c);
                for (row_start, row_count) in pieces(cols, o.upgate_rows) {
                    nodes.push(Op::RmsUpGateSilu {
                        layer: l,
                        row_start,
                        row_count,
                    });
                }
            }
        });
        stage(&mut nodes, &mut |nodes| {
            for c in 0..o.down_chunks {
                let cols = chunk_cols(m.intermediate, o.down_chunks, c);
                for (row_start, row_count) in pieces(0..m.hidden, o.down_rows) {
                    nodes.push(Op::DownProjPartial {
                        layer: l,
                        row_start,
                        row_count,
                        chunk: c as u32,
                        col_start: cols.start as u32,
                        col_count: cols.len() as u32,
                    });
                }
            }
        });
    }
    stage(&mut nodes, &mut |nodes| {
        for (block, (row_start, row_count)) in pieces(0..m.vocab, o.lmhead_rows).enumerate() {
            nodes.push(Op::RmsLmHead {
                row_start,
                row_count,
                block: block as u32,
            });
        }
    });
    let blocks = m.vocab.div_ceil(o.lmhead_rows) as u32;
    stage(&mut nodes, &mut |nodes| nodes.push(Op::Argmax { blocks }));
    (nodes, stages)
}

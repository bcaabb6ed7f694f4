//! The DAG of one decode step, laid out stage by stage, assigned to SMs and checked.
//!
//! Dependencies (each instruction signals one counter, see [`crate::counters`]):
//! - `RmsQkvRope` of layer `l > 0` waits for `Down[l-1]` (the whole residual stream).
//! - `Attention(g, p)` waits for `QkvQ[l][g]`; the last part also for `QkvKv[l][g]` (only it
//!   reads the cache row of this token).
//! - `AttnReduce(g)` waits for `AttnPart[l][g]`.
//! - `OProjResidual` waits for `AttnDone[l]`; `RmsUpGateSilu` for `OProj[l]`;
//!   `DownProjResidual` of chunk `c` only for `UpGate[l][c]`.
//! - `RmsLmHead` waits for `Down[L-1]`, `Argmax` for `LmHead`.
//!
//! Waits implied by others are then dropped: if everything that signals a counter already
//! happens before an instruction through its own SM's earlier instructions and its other
//! waits, it does not wait for it (typically the second instruction of a stage on one SM).
//! Every remaining wait is then needed: without it some value it orders would race. The
//! interpreter must honour program order for this to hold (see [`crate::encode`]).

use std::ops::Range;

use crate::hb::Clocks;
use crate::{
    assign, validate, Counter, CounterLayout, GpuShape, Instr, ModelShape, Op, Options, Schedule,
    ScheduleError, Wait,
};

struct Node {
    op: Op,
    signal: Counter,
    waits: Vec<Counter>,
}

/// Builds and validates the schedule of one decode step.
pub fn build(
    model: &ModelShape,
    gpu: &GpuShape,
    opts: &Options,
) -> Result<Schedule, ScheduleError> {
    model.check()?;
    gpu.check(model)?;
    opts.check(model)?;
    let counters = CounterLayout {
        layers: model.layers as u32,
        kv_heads: model.kv_heads as u32,
        chunks: opts.down_chunks as u32,
        partitioned: opts.attn_parts > 1,
    };
    let (nodes, stages) = dag(model, opts);
    let mut signallers = vec![0u32; counters.count() as usize];
    for n in &nodes {
        signallers[counters.index(n.signal) as usize] += 1;
    }
    let instrs: Vec<Instr> = nodes
        .iter()
        .map(|n| Instr {
            op: n.op,
            waits: n
                .waits
                .iter()
                .map(|&c| {
                    let counter = counters.index(c);
                    Wait {
                        counter,
                        base: signallers[counter as usize],
                    }
                })
                .collect(),
            signal: Some(counters.index(n.signal)),
        })
        .collect();
    let cost: Vec<u64> = instrs
        .iter()
        .map(|i| i.op.hbm_bytes(model, opts.context) + opts.fixed_cost_bytes)
        .collect();
    let sm_of = assign::balance(&stages, &cost, gpu.sm_count);
    let mut streams = vec![Vec::new(); gpu.sm_count];
    for (i, &s) in sm_of.iter().enumerate() {
        streams[s as usize].push(i as u32);
    }
    let mut schedule = Schedule {
        model: *model,
        gpu: *gpu,
        options: *opts,
        counters,
        instrs,
        streams,
    };
    drop_implied_waits(&mut schedule)?;
    validate(&schedule)?;
    Ok(schedule)
}

/// `(start, count)` pieces of at most `rows` covering `range`.
fn pieces(range: Range<usize>, rows: usize) -> impl Iterator<Item = (u32, u32)> {
    let end = range.end;
    range
        .step_by(rows)
        .map(move |s| (s as u32, (rows.min(end - s)) as u32))
}

/// Columns of down chunk `c`: `[c·I/chunks, (c+1)·I/chunks)`.
fn chunk_cols(intermediate: usize, chunks: usize, c: usize) -> Range<usize> {
    c * intermediate / chunks..(c + 1) * intermediate / chunks
}

/// The nodes in the global order and the range of each stage in it.
fn dag(m: &ModelShape, o: &Options) -> (Vec<Node>, Vec<Range<usize>>) {
    let mut nodes = Vec::new();
    let mut stages = Vec::new();
    let mut stage = |nodes: &mut Vec<Node>, add: &mut dyn FnMut(&mut Vec<Node>)| {
        let start = nodes.len();
        add(nodes);
        if nodes.len() > start {
            stages.push(start..nodes.len());
        }
    };
    let (kv, group, half) = (m.kv_heads as u32, m.group() as u32, m.head_dim / 2);
    let parts = o.attn_parts as u32;
    for l in 0..m.layers as u32 {
        let prev_down: Vec<Counter> = if l == 0 {
            vec![]
        } else {
            vec![Counter::Down { layer: l - 1 }]
        };
        // Group-major, so that the attention of group 0 can start while later groups project.
        stage(&mut nodes, &mut |nodes| {
            for g in 0..kv {
                let q_heads =
                    (g * group..(g + 1) * group).map(|h| (h, Counter::QkvQ { layer: l, group: g }));
                let kv_heads = [m.heads as u32 + g, m.heads as u32 + kv + g]
                    .map(|h| (h, Counter::QkvKv { layer: l, group: g }));
                for (head, signal) in q_heads.chain(kv_heads) {
                    for (pair_start, pair_count) in pieces(0..half, o.qkv_pairs) {
                        nodes.push(Node {
                            op: Op::RmsQkvRope {
                                layer: l,
                                head,
                                pair_start,
                                pair_count,
                            },
                            signal,
                            waits: prev_down.clone(),
                        });
                    }
                }
            }
        });
        stage(&mut nodes, &mut |nodes| {
            for g in 0..kv {
                for part in 0..parts {
                    let mut waits = vec![Counter::QkvQ { layer: l, group: g }];
                    if part + 1 == parts {
                        waits.push(Counter::QkvKv { layer: l, group: g });
                    }
                    let signal = if parts > 1 {
                        Counter::AttnPart { layer: l, group: g }
                    } else {
                        Counter::AttnDone { layer: l }
                    };
                    nodes.push(Node {
                        op: Op::Attention {
                            layer: l,
                            kv_head: g,
                            part,
                            parts,
                        },
                        signal,
                        waits,
                    });
                }
            }
        });
        if parts > 1 {
            stage(&mut nodes, &mut |nodes| {
                for g in 0..kv {
                    nodes.push(Node {
                        op: Op::AttnReduce {
                            layer: l,
                            kv_head: g,
                            parts,
                        },
                        signal: Counter::AttnDone { layer: l },
                        waits: vec![Counter::AttnPart { layer: l, group: g }],
                    });
                }
            });
        }
        stage(&mut nodes, &mut |nodes| {
            for (row_start, row_count) in pieces(0..m.hidden, o.oproj_rows) {
                nodes.push(Node {
                    op: Op::OProjResidual {
                        layer: l,
                        row_start,
                        row_count,
                    },
                    signal: Counter::OProj { layer: l },
                    waits: vec![Counter::AttnDone { layer: l }],
                });
            }
        });
        // Chunk-major, so that chunk 0's down projection can start first.
        stage(&mut nodes, &mut |nodes| {
            for c in 0..o.down_chunks {
                let cols = chunk_cols(m.intermediate, o.down_chunks, c);
                for (row_start, row_count) in pieces(cols, o.upgate_rows) {
                    nodes.push(Node {
                        op: Op::RmsUpGateSilu {
                            layer: l,
                            row_start,
                            row_count,
                        },
                        signal: Counter::UpGate {
                            layer: l,
                            chunk: c as u32,
                        },
                        waits: vec![Counter::OProj { layer: l }],
                    });
                }
            }
        });
        stage(&mut nodes, &mut |nodes| {
            for c in 0..o.down_chunks {
                let cols = chunk_cols(m.intermediate, o.down_chunks, c);
                for (row_start, row_count) in pieces(0..m.hidden, o.down_rows) {
                    nodes.push(Node {
                        op: Op::DownProjResidual {
                            layer: l,
                            row_start,
                            row_count,
                            chunk: c as u32,
                            col_start: cols.start as u32,
                            col_count: cols.len() as u32,
                        },
                        signal: Counter::Down { layer: l },
                        waits: vec![Counter::UpGate {
                            layer: l,
                            chunk: c as u32,
                        }],
                    });
                }
            }
        });
    }
    let last = Counter::Down {
        layer: m.layers as u32 - 1,
    };
    stage(&mut nodes, &mut |nodes| {
        for (block, (row_start, row_count)) in pieces(0..m.vocab, o.lmhead_rows).enumerate() {
            nodes.push(Node {
                op: Op::RmsLmHead {
                    row_start,
                    row_count,
                    block: block as u32,
                },
                signal: Counter::LmHead,
                waits: vec![last],
            });
        }
    });
    let blocks = m.vocab.div_ceil(o.lmhead_rows) as u32;
    stage(&mut nodes, &mut |nodes| {
        nodes.push(Node {
            op: Op::Argmax { blocks },
            signal: Counter::Done,
            waits: vec![Counter::LmHead],
        });
    });
    (nodes, stages)
}

/// Drops every wait whose signallers all happen before the instruction anyway, through
/// program order and its other waits (e.g. waiting for the K/V rows of a group can cover the
/// Q rows when they ran earlier on the same SMs). No remaining wait is implied by the others.
fn drop_implied_waits(s: &mut Schedule) -> Result<(), ScheduleError> {
    let place = s.placement()?;
    let mut clocks = Clocks::new(s.gpu.sm_count, s.counters.count() as usize);
    for (x, instr) in s.instrs.iter_mut().enumerate() {
        let sm = place.sm[x];
        let start = clocks.start(sm);
        let mut k = 0;
        while k < instr.waits.len() {
            let mut others = start.clone();
            for (j, w) in instr.waits.iter().enumerate() {
                if j != k {
                    clocks.join(&mut others, w.counter);
                }
            }
            if clocks.implied(&others, instr.waits[k].counter) {
                instr.waits.remove(k);
            } else {
                k += 1;
            }
        }
        let mut clock = start;
        for w in &instr.waits {
            clocks.join(&mut clock, w.counter);
        }
        clocks.finish(sm, place.pos[x], &mut clock, instr.signal);
    }
    Ok(())
}

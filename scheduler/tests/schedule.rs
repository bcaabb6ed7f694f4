//! The scheduler on its own: encoding, validation, tags, balance, execution.

use std::collections::HashMap;

use scheduler::dump::{estimate, summarize, to_json, JsonSchedule};
use scheduler::exec::ExecError;
use scheduler::{
    build, plan, unwritten_if_dropped, validate, Blind, Buffer, CostModel, DecodeError, Executor,
    GpuShape, Interleaving, Machine, ModelShape, Op, Options, Overrides, Schedule, ScheduleError,
    StageKind, PRESETS, WORDS_PER_INSTR,
};

fn preset(name: &str, sms: usize) -> Schedule {
    let m = ModelShape::preset(name).unwrap();
    let g = GpuShape::with_sms(sms);
    build(&m, &g, &Options::auto(&m, &g, &CostModel::default())).unwrap()
}

fn tiny_shape() -> ModelShape {
    ModelShape {
        hidden: 40,
        intermediate: 56,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
        vocab: 50,
        qk_norm: false,
    }
}

fn tiny_options() -> Options {
    Options {
        qkv_pairs: 3,
        qkv_pieces: 0,
        oproj_rows: 16,
        upgate_rows: 16,
        down_rows: 16,
        down_chunks: 2,
        attn_parts: 2,
        attn_heads: 0,
        lmhead_rows: 20,
        fixed_cost_bytes: 0,
        context: 8,
    }
}

fn tiny(sms: usize) -> Schedule {
    build(&tiny_shape(), &GpuShape::with_sms(sms), &tiny_options()).unwrap()
}

/// Counts executions and checks, element by element, that every read was written earlier in
/// this token and nothing is written twice: the declared accesses honoured dynamically.
struct Shadow<'a> {
    s: &'a Schedule,
    written: HashMap<Buffer, Vec<bool>>,
    runs: usize,
}

impl<'a> Shadow<'a> {
    fn new(s: &'a Schedule) -> Self {
        Shadow {
            s,
            written: HashMap::new(),
            runs: 0,
        }
    }

    fn begin_token(&mut self) {
        self.written.clear();
    }
}

impl Machine for Shadow<'_> {
    fn exec(&mut self, op: &Op) {
        let a = self.s.access(op);
        for r in a.reads.iter().filter(|r| !r.buffer.is_input()) {
            let w = self.written.get(&r.buffer);
            for e in r.elements.clone() {
                let done = w.and_then(|w| w.get(e as usize)).copied().unwrap_or(false);
                assert!(
                    done,
                    "{op:?} reads {:?}[{e}] before it is written",
                    r.buffer
                );
            }
        }
        for wr in a.writes {
            let w = self.written.entry(wr.buffer).or_default();
            if w.len() < wr.elements.end as usize {
                w.resize(wr.elements.end as usize, false);
            }
            for e in wr.elements {
                assert!(!w[e as usize], "{op:?} writes {:?}[{e}] twice", wr.buffer);
                w[e as usize] = true;
            }
        }
        self.runs += 1;
    }
}

#[test]
fn encode_decode_round_trip() {
    let mut schedules: Vec<Schedule> = PRESETS.iter().map(|p| preset(p, 132)).collect();
    schedules.extend([1, 3, 7].map(tiny));
    for s in &schedules {
        let e = s.encode();
        assert_eq!(e.words.len(), s.instrs.len() * WORDS_PER_INSTR);
        assert_eq!(e.sm_offsets.len(), s.gpu.sm_count + 1);
        let decoded = e.decode().unwrap();
        let want: Vec<Vec<_>> = s
            .streams
            .iter()
            .map(|st| st.iter().map(|&i| s.instrs[i as usize]).collect())
            .collect();
        assert_eq!(decoded, want);
    }
    let e = tiny(3).encode();
    let mut bad = e.clone();
    bad.words[0] = 99;
    assert!(matches!(
        bad.decode(),
        Err(DecodeError::Opcode { opcode: 99, .. })
    ));
    let mut bad = e.clone();
    bad.words[WORDS_PER_INSTR - 1] = 5;
    assert!(matches!(bad.decode(), Err(DecodeError::Padding { .. })));
    let mut bad = e.clone();
    bad.words[0] = 0;
    assert!(matches!(
        bad.decode(),
        Err(DecodeError::Opcode { opcode: 0, .. })
    ));
    let mut bad = e.clone();
    bad.sm_offsets[1] = bad.sm_offsets[3] + 1;
    assert!(matches!(bad.decode(), Err(DecodeError::Offsets(_))));
    let mut bad = e;
    bad.words.pop();
    assert!(matches!(bad.decode(), Err(DecodeError::Length(_))));
}

/// Some instruction, and one instruction whose output it reads, on different SMs.
fn reader_and_writer(s: &Schedule) -> (usize, usize) {
    let deps = scheduler::dependencies(s).unwrap();
    let sm_of = |i: usize| {
        s.streams
            .iter()
            .position(|st| st.contains(&(i as u32)))
            .unwrap()
    };
    for (x, d) in deps.iter().enumerate() {
        if let Some(&w) = d.iter().find(|&&w| sm_of(w as usize) != sm_of(x)) {
            return (x, w as usize);
        }
    }
    panic!("no instruction reads another SM's output");
}

#[test]
fn validator_and_executor_catch_a_deadlocking_order() {
    let s = tiny(3);
    let (x, w) = reader_and_writer(&s);
    // The writer moves onto the reader's SM, right after the reader.
    let mut broken = s.clone();
    for st in broken.streams.iter_mut() {
        st.retain(|&i| i as usize != w);
    }
    let st = broken
        .streams
        .iter_mut()
        .find(|st| st.contains(&(x as u32)))
        .unwrap();
    let at = st.iter().position(|&i| i as usize == x).unwrap();
    st.insert(at + 1, w as u32);
    assert!(matches!(validate(&broken), Err(ScheduleError::Streams(_))));
    let err = Executor::new(&broken)
        .unwrap()
        .run_token(&mut Blind, Interleaving::Random { seed: 3 })
        .unwrap_err();
    // A cycle: the reader waits for the writer behind it; whoever is named, the reader is
    // among the blocked.
    assert!(matches!(err, ExecError::Deadlock { .. }), "{err}");
    assert!(err.to_string().contains(&s.describe(x)), "{err}");

    // Same streams, but the global order says the writer comes after the reader.
    let mut reordered = s.clone();
    reordered.instrs.swap(x, w);
    for st in reordered.streams.iter_mut() {
        for i in st.iter_mut() {
            if *i as usize == x {
                *i = w as u32;
            } else if *i as usize == w {
                *i = x as u32;
            }
        }
    }
    let err = validate(&reordered).unwrap_err();
    assert!(
        matches!(
            err,
            ScheduleError::Deadlock { .. } | ScheduleError::Streams(_)
        ),
        "{err}"
    );
}

/// The names of the tagged elements `x` writes, as the GPU would print them.
fn written_names(s: &Schedule, x: usize) -> Vec<String> {
    let arena = s.arena();
    s.access(&s.instrs[x])
        .writes
        .iter()
        .filter_map(|w| arena.runs(w))
        .flatten()
        .flat_map(|r| r.map(|o| arena.element(o)))
        .collect()
}

/// Turning any one instruction into a no-op stops the step with an error naming an element it
/// should have written and an instruction waiting for it, one of the pairs
/// `unwritten_if_dropped` predicts; the argmax alone writes nothing that is waited for.
#[test]
fn a_dropped_instruction_is_named_by_what_it_did_not_write() {
    for sms in [1, 3, 7] {
        for parts in [1, 3] {
            let opts = Options {
                attn_parts: parts,
                ..tiny_options()
            };
            let s = build(&tiny_shape(), &GpuShape::with_sms(sms), &opts).unwrap();
            for x in 0..s.instrs.len() {
                let predicted = unwritten_if_dropped(&s, x as u32).unwrap();
                let mine = written_names(&s, x);
                let mut ex = Executor::new(&s).unwrap();
                // A clean step first: last step's tags must not satisfy this step's reads.
                ex.run_token(&mut Blind, Interleaving::Random { seed: 1 })
                    .unwrap();
                ex.drop_instruction(x as u32);
                let got = ex.run_token(&mut Blind, Interleaving::Random { seed: x as u64 });
                let what = format!("{sms} SMs, {parts} parts, {} dropped", s.describe(x));
                if matches!(s.instrs[x], Op::Argmax { .. }) {
                    assert!(got.is_ok(), "{what}: {got:?}");
                    assert!(predicted.is_empty(), "{what}: {predicted:?}");
                    continue;
                }
                let err = got.unwrap_err();
                let ExecError::Deadlock {
                    reader, element, ..
                } = &err
                else {
                    panic!("{what}: {err}")
                };
                assert!(mine.contains(element), "{what}: {err}");
                assert!(
                    predicted.contains(&(*reader, element.clone())),
                    "{what}: {err} not among {predicted:?}"
                );
                assert!(
                    err.to_string().contains("nothing wrote it this step"),
                    "{err}"
                );
                // Every predicted pair is a real wait: the reader reads the element.
                for (r, e) in &predicted {
                    let arena = s.arena();
                    let reads: Vec<String> = s
                        .access(&s.instrs[*r as usize])
                        .reads
                        .iter()
                        .filter_map(|sp| arena.runs(sp))
                        .flatten()
                        .flat_map(|r| r.map(|o| arena.element(o)))
                        .collect();
                    assert!(reads.contains(e), "{what}: #{r} does not read {e}");
                }
            }
        }
    }
}

/// Element names are offsets within the arena part, counted across layers, as the GPU's
/// `ArenaLayout::element` gives them.
#[test]
fn arena_names_elements_as_the_gpu_does() {
    let s = tiny(3);
    let m = tiny_shape();
    let arena = s.arena();
    let name = |buffer, e: u32| {
        let runs = arena
            .runs(&scheduler::Span {
                buffer,
                elements: e..e + 1,
            })
            .unwrap();
        arena.element(runs[0].start)
    };
    let qd = m.q_dim() as u32;
    assert_eq!(
        name(Buffer::AttnOut { layer: 1 }, 5),
        format!("attn_out[{}]", qd + 5)
    );
    assert_eq!(name(Buffer::ResidAttn { layer: 0 }, 0), "resid_attn[0]");
    let h = m.hidden as u32;
    // mlp_part is [layer][chunk][hidden].
    assert_eq!(
        name(Buffer::MlpPart { layer: 1, chunk: 1 }, 3),
        format!("mlp_part[{}]", 3 * h + 3)
    );
    // V rows follow the K rows of their layer in kv_new.
    let kv = m.kv_dim() as u32;
    assert_eq!(
        name(Buffer::VCache { layer: 1 }, 2),
        format!("kv_new[{}]", 3 * kv + 2)
    );
    // attn_part slots are head_dim values, then the (max, sum) of attn_stats.
    let d = m.head_dim as u32;
    let parts = s.options.attn_parts as u32;
    let slots_per_layer = m.heads as u32 * parts;
    assert_eq!(
        name(Buffer::AttnPart { layer: 1 }, d + 1),
        format!("attn_part[{}]", (slots_per_layer + 1) * (d + 2) + 1)
    );
    assert_eq!(
        name(Buffer::AttnStats { layer: 0 }, 3),
        format!("attn_part[{}]", (d + 2) + d + 1)
    );
    assert!(arena
        .runs(&scheduler::Span {
            buffer: Buffer::Logits,
            elements: 0..1
        })
        .is_none());
}

#[test]
fn llama_1b_is_balanced_on_132_sms() {
    let s = preset("llama-3.2-1b", 132);
    let cost = CostModel::default();
    let sum = summarize(&s, &cost);
    for st in &sum.stages {
        let biggest = s
            .instrs
            .iter()
            .filter(|op| op.kind() == st.kind)
            .map(|op| op.hbm_bytes(&s.model, cost.context) + s.options.fixed_cost_bytes)
            .max()
            .unwrap();
        // The greedy bound: no SM exceeds the mean by more than one instruction.
        assert!(st.max as f64 <= st.mean + biggest as f64, "{st:?}");
        // The stages that move 95% of the bytes are within 5% of perfect balance.
        if matches!(
            st.kind,
            StageKind::OProj | StageKind::UpGate | StageKind::Down | StageKind::LmHead
        ) {
            assert!(st.max as f64 <= 1.05 * st.mean, "{st:?}");
        }
    }
    let e = estimate(&s, &cost);
    assert!((e.floor_weights_us - 794.7).abs() < 1.0, "{e:?}");
    // 2 µs per instruction on the critical path (about 60 hops a layer) on top of the bytes.
    assert!(
        e.critical_path_us > e.floor_us && e.critical_path_us < 1.4 * e.floor_us,
        "{e:?}"
    );
}

#[test]
fn random_interleavings_honour_declared_accesses() {
    let mut schedules: Vec<Schedule> = [1, 2, 5, 132].map(tiny).into();
    schedules.push(preset("smollm2-135m", 132));
    schedules.push(preset("llama-3.2-1b", 132));
    for s in &schedules {
        let mut shadow = Shadow::new(s);
        let mut ex = Executor::new(s).unwrap();
        for token in 0..3u64 {
            shadow.begin_token();
            let order = ex
                .run_token(&mut shadow, Interleaving::Random { seed: token })
                .unwrap();
            let mut sorted = order.clone();
            sorted.sort_unstable();
            assert!(sorted.iter().enumerate().all(|(i, &x)| i as u32 == x));
        }
        assert_eq!(shadow.runs, 3 * s.instrs.len());
        assert_eq!(ex.epoch(), 3);
    }
}

#[test]
fn validator_catches_bad_accesses() {
    let s = tiny(3);
    let find = |kind: StageKind| s.instrs.iter().position(|op| op.kind() == kind).unwrap();
    // Two o-proj instructions writing row 0.
    let mut twice = s.clone();
    let x = twice
        .instrs
        .iter()
        .rposition(|op| op.kind() == StageKind::OProj)
        .unwrap();
    if let Op::OProjResidual {
        row_start,
        row_count,
        ..
    } = &mut twice.instrs[x]
    {
        *row_count += *row_start;
        *row_start = 0;
    }
    assert!(matches!(
        validate(&twice),
        Err(ScheduleError::DoubleWrite { .. })
    ));
    // A down-proj instruction that leaves its last row unwritten.
    let mut short = s.clone();
    let x = find(StageKind::Down);
    if let Op::DownProjPartial { row_count, .. } = &mut short.instrs[x] {
        *row_count -= 1;
    }
    assert!(matches!(
        validate(&short),
        Err(ScheduleError::Unwritten { .. })
    ));
    // An o-proj instruction reaching past the hidden size.
    let mut long = s.clone();
    let x = long
        .instrs
        .iter()
        .rposition(|op| op.kind() == StageKind::OProj)
        .unwrap();
    if let Op::OProjResidual { row_count, .. } = &mut long.instrs[x] {
        *row_count += 1;
    }
    assert!(matches!(
        validate(&long),
        Err(ScheduleError::OutOfBounds { .. })
    ));
    // An instruction of a layer the model does not have.
    let mut deep = s.clone();
    if let Op::RmsUpGateSilu { layer, .. } = &mut deep.instrs[find(StageKind::UpGate)] {
        *layer = 7;
    }
    assert!(matches!(
        validate(&deep),
        Err(ScheduleError::OutOfBounds { .. })
    ));
    // An instruction on a second SM.
    let mut dup = s.clone();
    let extra = dup.streams[0][0];
    dup.streams[1].insert(0, extra);
    assert!(matches!(validate(&dup), Err(ScheduleError::Streams(_))));
}

#[test]
fn build_rejects_bad_inputs() {
    let g = GpuShape::with_sms(4);
    let bad_gqa = ModelShape {
        kv_heads: 3,
        ..tiny_shape()
    };
    assert!(matches!(
        build(&bad_gqa, &g, &tiny_options()),
        Err(ScheduleError::Shape(_))
    ));
    let zero = Options {
        down_rows: 0,
        ..tiny_options()
    };
    assert!(matches!(
        build(&tiny_shape(), &g, &zero),
        Err(ScheduleError::Options(_))
    ));
    let wide = Options {
        qkv_pairs: 9,
        ..tiny_options()
    };
    assert!(matches!(
        build(&tiny_shape(), &g, &wide),
        Err(ScheduleError::Options(_))
    ));
    let no_sms = GpuShape::with_sms(0);
    assert!(matches!(
        build(&tiny_shape(), &no_sms, &tiny_options()),
        Err(ScheduleError::Gpu(_))
    ));
}

#[test]
fn json_lists_every_instruction() {
    let s = tiny(3);
    let text = serde_json::to_string_pretty(&to_json(&s)).unwrap();
    let back: JsonSchedule = serde_json::from_str(&text).unwrap();
    assert_eq!(back, to_json(&s));
    assert_eq!(back.sms.len(), 3);
    let listed: usize = back.sms.iter().map(|sm| sm.instructions.len()).sum();
    assert_eq!(listed, s.instrs.len());
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let first = &v["sms"][0]["instructions"][0];
    assert!(first["op"]["type"].is_string(), "{first}");
    assert!(
        first["reads"].is_array() && first["writes"].is_array(),
        "{first}"
    );
    assert!(v.get("counters").is_none());
}

#[test]
fn builds_are_deterministic() {
    assert_eq!(preset("smollm2-135m", 132), preset("smollm2-135m", 132));
}

/// Cost options no GPU or sequence has are refused, naming the option and its range.
#[test]
fn impossible_cost_options_are_refused() {
    let m = tiny_shape();
    let g = GpuShape::with_sms(4);
    let ok = CostModel::megakernel(64);
    let cases = [
        (
            CostModel {
                latency_us: 0.0,
                ..ok
            },
            "latency_us",
        ),
        (
            CostModel {
                latency_us: -1.0,
                ..ok
            },
            "latency_us",
        ),
        (
            CostModel {
                latency_us: f64::NAN,
                ..ok
            },
            "latency_us",
        ),
        (
            CostModel {
                latency_us: 1e30,
                ..ok
            },
            "latency_us",
        ),
        (
            CostModel {
                bandwidth_gbps: 0.0,
                ..ok
            },
            "bandwidth_gbps",
        ),
        (
            CostModel {
                bandwidth_gbps: f64::INFINITY,
                ..ok
            },
            "bandwidth_gbps",
        ),
        (CostModel { context: 0, ..ok }, "context"),
        (
            CostModel {
                context: usize::MAX,
                ..ok
            },
            "context",
        ),
    ];
    for (cost, field) in cases {
        let err = plan(&m, &g, &cost, &Overrides::default()).unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, ScheduleError::Cost(_)), "{text}");
        assert!(text.contains(field) && text.contains("outside"), "{text}");
    }
    let gpus = [
        (GpuShape::with_sms(65536), "sm_count"),
        (GpuShape::with_sms(0), "sm_count"),
        (
            GpuShape {
                page_bytes: usize::MAX,
                ..g
            },
            "page_bytes",
        ),
        (GpuShape { page_bytes: 0, ..g }, "page_bytes"),
        (GpuShape { smem_pages: 0, ..g }, "smem_pages"),
    ];
    for (gpu, field) in gpus {
        let text = plan(&m, &gpu, &ok, &Overrides::default())
            .unwrap_err()
            .to_string();
        assert!(text.contains(field) && text.contains("outside"), "{text}");
    }
    assert!(plan(&m, &g, &ok, &Overrides::default()).is_ok());
}

/// The largest GPU accepted builds in time and memory linear in the SMs: nothing keeps a
/// table per pair of SMs.
#[test]
fn many_sms_build_quickly() {
    let m = ModelShape::preset("llama-3.2-1b").unwrap();
    let g = GpuShape::with_sms(*scheduler::shape::SMS.end());
    let start = std::time::Instant::now();
    let s = plan(&m, &g, &CostModel::default(), &Overrides::default()).unwrap();
    let sum = summarize(&s, &CostModel::default());
    let took = start.elapsed();
    println!(
        "{} SMs: {} instructions, built and estimated in {took:?}",
        g.sm_count, sum.instrs
    );
    assert!(took.as_secs() < 60, "{took:?}");
}

/// `qkv_pieces`: exactly that many QKV instructions a layer, every head's pairs covered once,
/// a head's pieces within one step of each other; out-of-range counts refused by name. At
/// twice the SM count Qwen3-4B's QKV bytes are even over the SMs (the cost model's 32 pairs
/// leave 36 of 132 SMs without any and the others 320 KiB: max/mean 1.375).
#[test]
fn qkv_pieces_cut_heads_evenly_and_balance_the_sms() {
    // Qwen3-4B's shape (the crate's presets are the Llamas').
    let m = ModelShape {
        hidden: 2560,
        intermediate: 9728,
        layers: 36,
        heads: 32,
        kv_heads: 8,
        head_dim: 128,
        vocab: 151_936,
        qk_norm: true,
    };
    let g = GpuShape::with_sms(132);
    let auto = Options::auto(&m, &g, &CostModel::default());
    assert_eq!(auto.qkv_pairs, 32);
    let half = m.head_dim / 2;
    for pieces in [m.qkv_heads(), 132, 264, 396, m.qkv_heads() * half / 2] {
        let s = build(
            &m,
            &g,
            &Options {
                qkv_pieces: pieces,
                ..auto
            },
        )
        .unwrap();
        let mut cover: HashMap<u32, Vec<(u32, u32)>> = HashMap::new();
        for op in &s.instrs {
            if let Op::RmsQkvRope {
                layer: 0,
                head,
                pair_start,
                pair_count,
            } = *op
            {
                cover
                    .entry(head)
                    .or_default()
                    .push((pair_start, pair_count));
            }
        }
        assert_eq!(cover.values().map(Vec::len).sum::<usize>(), pieces);
        for (head, cuts) in &cover {
            let mut next = 0;
            for &(start, count) in cuts {
                assert_eq!(start, next, "{pieces} pieces, head {head}: {cuts:?}");
                assert!(count > 0 && count.is_multiple_of(2), "{cuts:?}");
                next = start + count;
            }
            assert_eq!(next as usize, half, "{pieces} pieces, head {head}");
            let (lo, hi) = (
                cuts.iter().map(|c| c.1).min(),
                cuts.iter().map(|c| c.1).max(),
            );
            assert!(hi.unwrap() - lo.unwrap() <= 2, "head {head}: {cuts:?}");
        }
        let per = cover.values().map(Vec::len);
        assert!(per.clone().max().unwrap() - per.min().unwrap() <= 1);
    }
    // The bytes each SM streams in layer 0's QKV stage.
    let qkv_load = |opts: Options| {
        let s = build(&m, &g, &opts).unwrap();
        let mut load = vec![0u64; 132];
        for (sm, stream) in s.streams.iter().enumerate() {
            for &i in stream {
                if let Op::RmsQkvRope { layer: 0, .. } = s.instrs[i as usize] {
                    load[sm] += s.instrs[i as usize].hbm_bytes(&m, 1);
                }
            }
        }
        let mean = load.iter().sum::<u64>() as f64 / 132.0;
        *load.iter().max().unwrap() as f64 / mean
    };
    assert!(qkv_load(auto) > 1.3, "{}", qkv_load(auto));
    let even = qkv_load(Options {
        qkv_pieces: 264,
        ..auto
    });
    assert!(even < 1.06, "{even}");
    for bad in [m.qkv_heads() - 1, m.qkv_heads() * half / 2 + 1] {
        let e = build(
            &m,
            &g,
            &Options {
                qkv_pieces: bad,
                ..auto
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("qkv_pieces"), "{e}");
    }
}

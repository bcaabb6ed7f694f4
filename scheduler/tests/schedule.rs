//! The scheduler on its own: encoding, validation, counters, balance, execution.

use std::collections::HashMap;

use scheduler::dump::{estimate, summarize, to_json, JsonSchedule};
use scheduler::exec::ExecError;
use scheduler::{
    build, validate, Buffer, CostModel, DecodeError, Executor, GpuShape, Interleaving, Machine,
    ModelShape, Op, Options, Schedule, ScheduleError, StageKind, PRESETS, WORDS_PER_INSTR,
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
    }
}

fn tiny_options() -> Options {
    Options {
        qkv_pairs: 3,
        oproj_rows: 16,
        upgate_rows: 16,
        down_rows: 16,
        down_chunks: 2,
        attn_parts: 2,
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

/// Runs anything: for schedules too broken for the shadow's checks.
struct Blind;

impl Machine for Blind {
    fn exec(&mut self, _: &Op) {}
}

#[test]
fn encode_decode_round_trip() {
    let mut schedules: Vec<Schedule> = PRESETS.iter().map(|p| preset(p, 132)).collect();
    schedules.extend([1, 3, 7].map(tiny));
    for s in &schedules {
        let e = s.encode();
        assert_eq!(e.words.len(), s.instrs.len() * WORDS_PER_INSTR);
        assert_eq!(e.sm_offsets.len(), s.gpu.sm_count + 1);
        assert_eq!(e.counters, s.counters.count() as usize);
        let decoded = e.decode().unwrap();
        let want: Vec<Vec<_>> = s
            .streams
            .iter()
            .map(|st| st.iter().map(|&i| s.instrs[i as usize].clone()).collect())
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
    bad.words[9] = 4;
    assert!(matches!(
        bad.decode(),
        Err(DecodeError::Waits { waits: 4, .. })
    ));
    let mut bad = e.clone();
    bad.sm_offsets[1] = bad.sm_offsets[3] + 1;
    assert!(matches!(bad.decode(), Err(DecodeError::Offsets(_))));
    let mut bad = e;
    bad.words.pop();
    assert!(matches!(bad.decode(), Err(DecodeError::Length(_))));
}

/// Some instruction that waits, the counter of its first wait and one signaller of it.
fn waiter_and_signaller(s: &Schedule, sm_differs: bool) -> (usize, usize) {
    let sm_of = |i: usize| {
        s.streams
            .iter()
            .position(|st| st.contains(&(i as u32)))
            .unwrap()
    };
    for (x, instr) in s.instrs.iter().enumerate() {
        if let Some(w) = instr.waits.first() {
            let signaller = s
                .instrs
                .iter()
                .position(|i| i.signal == Some(w.counter))
                .unwrap();
            if !sm_differs || sm_of(signaller) != sm_of(x) {
                return (x, signaller);
            }
        }
    }
    panic!("no waiting instruction");
}

#[test]
fn validator_and_executor_catch_a_deadlocking_order() {
    let s = tiny(3);
    let (x, w) = waiter_and_signaller(&s, true);
    // The signaller moves onto the waiter's SM, right after the waiter.
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
    assert!(matches!(err, ExecError::Stuck { .. }), "{err}");

    // Same streams, but the global order says the signaller comes after the waiter.
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

#[test]
fn counter_targets_are_reachable() {
    let mut schedules: Vec<Schedule> = PRESETS.iter().map(|p| preset(p, 132)).collect();
    schedules.push(tiny(4));
    for s in &schedules {
        let n = s.signallers();
        for i in &s.instrs {
            for w in &i.waits {
                assert_eq!(w.base, n[w.counter as usize]);
                assert!(w.base > 0);
            }
        }
        // One signal per instruction, every counter used, Done once per token.
        assert!(s.instrs.iter().all(|i| i.signal.is_some()));
        assert!(n.iter().all(|&k| k > 0), "unused counters");
        assert_eq!(n[s.counters.index(scheduler::Counter::Done) as usize], 1);
        for idx in 0..s.counters.count() {
            let c = s.counters.counter(idx).unwrap();
            assert_eq!(s.counters.index(c), idx);
        }
        assert!(s.max_epochs() >= 1 << 24, "{}", s.max_epochs());
    }
    // A target one too high is unreachable: the validator says so and execution gets stuck.
    let mut s = tiny(4);
    let x = s.instrs.iter().position(|i| !i.waits.is_empty()).unwrap();
    s.instrs[x].waits[0].base += 1;
    assert!(matches!(
        validate(&s),
        Err(ScheduleError::Unreachable { .. })
    ));
    let err = Executor::new(&s)
        .unwrap()
        .run_token(&mut Blind, Interleaving::Random { seed: 1 })
        .unwrap_err();
    assert!(matches!(err, ExecError::Stuck { .. }));
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
            .filter(|i| i.op.kind() == st.kind)
            .map(|i| i.op.hbm_bytes(&s.model, cost.context) + s.options.fixed_cost_bytes)
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
    assert!(
        e.critical_path_us > e.floor_us && e.critical_path_us < 1.2 * e.floor_us,
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
    let find = |kind: StageKind| s.instrs.iter().position(|i| i.op.kind() == kind).unwrap();
    // Two o-proj instructions writing row 0.
    let mut twice = s.clone();
    let x = twice
        .instrs
        .iter()
        .rposition(|i| i.op.kind() == StageKind::OProj)
        .unwrap();
    if let Op::OProjResidual {
        row_start,
        row_count,
        ..
    } = &mut twice.instrs[x].op
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
    if let Op::DownProjResidual { row_count, .. } = &mut short.instrs[x].op {
        *row_count -= 1;
    }
    assert!(matches!(
        validate(&short),
        Err(ScheduleError::Unwritten { .. })
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
    assert_eq!(
        v["counters"]["names"].as_array().unwrap().len(),
        s.counters.count() as usize
    );
}

#[test]
fn builds_are_deterministic() {
    assert_eq!(preset("smollm2-135m", 132), preset("smollm2-135m", 132));
}

/// No wait is redundant: removing any one of them lets some read race with its writer.
#[test]
fn every_wait_is_needed() {
    for sms in [2, 3, 5, 8, 13] {
        for parts in [1, 3] {
            let opts = Options {
                attn_parts: parts,
                ..tiny_options()
            };
            let s = build(&tiny_shape(), &GpuShape::with_sms(sms), &opts).unwrap();
            for x in 0..s.instrs.len() {
                for k in 0..s.instrs[x].waits.len() {
                    let mut broken = s.clone();
                    broken.instrs[x].waits.remove(k);
                    let r = validate(&broken);
                    assert!(
                        matches!(r, Err(ScheduleError::Race { .. })),
                        "{sms} SMs, {parts} parts, {} wait {k}: {r:?}",
                        s.describe(x)
                    );
                }
            }
        }
    }
}

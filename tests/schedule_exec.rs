//! Schedules run by the CPU executor over `SlicedMachine` must reproduce `CpuForward`, token
//! after token, in random interleavings; and every dependency a schedule declares must be
//! needed: without it the validator objects and an adversarial interleaving computes garbage.

use megainfer::model::random::random_weights;
use megainfer::model::{Config, Llama3RopeScaling, Weights};
use megainfer::reference::sliced::{shape_of, SlicedMachine};
use megainfer::reference::CpuForward;
use scheduler::{build, validate, CostModel, Executor, GpuShape, Interleaving, Options, Schedule};

const MAX_SEQ: usize = 16;
/// Sliced and whole-matrix sums differ only by f32 reassociation (~1e-7), but the K/V cache
/// is rounded to bf16, and a 1-ulp f32 difference can flip a bf16 rounding (2^-8 relative):
/// a few such flips move the logits by up to ~1e-4. A missing dependency gives NaN or O(1).
const TOLERANCE: f64 = 5e-4;

fn tiny(
    hidden: usize,
    inter: usize,
    heads: usize,
    kv: usize,
    head_dim: usize,
    llama3: bool,
) -> Config {
    Config {
        architecture: "LlamaForCausalLM".into(),
        hidden_size: hidden,
        intermediate_size: inter,
        num_layers: 2,
        num_heads: heads,
        num_kv_heads: kv,
        head_dim,
        vocab_size: 97,
        rope_theta: 10000.0,
        rope_scaling: llama3.then_some(Llama3RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8,
        }),
        rope_freq_divisors: None,
        rms_norm_eps: 1e-5,
        tie_word_embeddings: !llama3,
        max_position_embeddings: MAX_SEQ,
        bos_token_id: None,
        eos_token_ids: vec![],
    }
}

/// Odd sizes, GQA ratios 1, 3 and 4, head_dim 64 and 128, tied and untied LM heads.
fn configs() -> Vec<Config> {
    vec![
        tiny(72, 100, 2, 2, 64, false),
        tiny(88, 130, 3, 1, 64, true),
        tiny(136, 90, 8, 2, 128, false),
        tiny(40, 60, 4, 1, 128, true),
    ]
}

fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    let (mut d, mut n) = (0f64, 0f64);
    for (g, w) in got.iter().zip(want) {
        d += (*g as f64 - *w as f64).powi(2);
        n += (*w as f64).powi(2);
    }
    (d / n).sqrt()
}

fn first_max(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best as u32
}

struct Case {
    cfg: Config,
    w: Weights,
    tokens: Vec<u32>,
    /// Reference logits after each token.
    want: Vec<Vec<f32>>,
}

fn case(cfg: Config, seed: u64, n: usize) -> Case {
    let w = random_weights(&cfg, seed);
    let tokens: Vec<u32> = (0..n as u64)
        .map(|i| ((seed * 31 + i * 17 + 5) % cfg.vocab_size as u64) as u32)
        .collect();
    let mut fwd = CpuForward::new(&cfg, &w, MAX_SEQ);
    let want = tokens.iter().map(|&t| fwd.forward(&[t]).unwrap()).collect();
    Case {
        cfg,
        w,
        tokens,
        want,
    }
}

/// Fine and uneven cuts: remainders everywhere, 3 k-chunks, 3 attention parts (empty ones
/// for the first tokens).
fn fine(schedule_for: &Config) -> Options {
    Options {
        qkv_pairs: 7.min(schedule_for.head_dim / 2),
        oproj_rows: 7,
        upgate_rows: 9,
        down_rows: 5,
        down_chunks: 3,
        attn_parts: 3,
        lmhead_rows: 10,
        fixed_cost_bytes: 0,
        context: MAX_SEQ,
    }
}

fn auto(cfg: &Config, gpu: &GpuShape) -> Options {
    Options::auto(&shape_of(cfg), gpu, &CostModel::default())
}

/// Runs every token of `c` teacher-forced through `s` and checks logits and `token_out`.
fn run_case(c: &Case, s: &Schedule, seed: u64) {
    let mut m = SlicedMachine::new(&c.cfg, &c.w, s, MAX_SEQ).unwrap();
    let mut ex = Executor::new(s).unwrap();
    for (pos, (&t, want)) in c.tokens.iter().zip(&c.want).enumerate() {
        m.begin_token(t, pos).unwrap();
        let how = Interleaving::Random {
            seed: seed * 1000 + pos as u64,
        };
        ex.run_token(&mut m, how).unwrap();
        let err = rel_l2(m.logits(), want);
        assert!(
            err <= TOLERANCE,
            "pos {pos}, {} SMs, {:?}: rel L2 {err:e}",
            s.gpu.sm_count,
            s.options
        );
        assert_eq!(
            m.token_out(),
            (first_max(want), pos as u32 + 1),
            "pos {pos}"
        );
    }
    // Counters grew by one full token's signals per launch, never reset.
    let n = c.tokens.len() as u32;
    let want: Vec<u32> = s.signallers().iter().map(|k| k * n).collect();
    assert_eq!(ex.counters(), &want[..]);
}

#[test]
fn random_models_match_reference_over_tokens() {
    for (ci, cfg) in configs().into_iter().enumerate() {
        let c = case(cfg, 7 + ci as u64, 6);
        for sms in [1, 7, 132] {
            let gpu = GpuShape::with_sms(sms);
            for opts in [fine(&c.cfg), auto(&c.cfg, &gpu)] {
                let s = build(&shape_of(&c.cfg), &gpu, &opts).unwrap();
                for seed in 0..8 {
                    run_case(&c, &s, seed);
                }
            }
        }
    }
}

/// Every attention partition count from 1 to past the sequence length.
#[test]
fn attention_partitions_match_reference() {
    let c = case(tiny(72, 100, 4, 2, 64, false), 3, 6);
    for parts in 1..=8 {
        let opts = Options {
            attn_parts: parts,
            ..fine(&c.cfg)
        };
        let s = build(&shape_of(&c.cfg), &GpuShape::with_sms(5), &opts).unwrap();
        run_case(&c, &s, parts as u64);
    }
}

/// For every wait of small multi-SM schedules (split-KV attention or not): removing it makes
/// the validator report a race, and running first only what the waiter still waits for, then
/// the waiter, gives NaN or a wrong token. The unmutated schedule under the same interleaving
/// stays exact, so the failure is the missing edge's.
#[test]
fn every_dependency_edge_is_needed() {
    let c = case(tiny(40, 56, 4, 2, 16, false), 11, 4);
    for (parts, sms) in [(2, 5), (1, 3)] {
        let opts = Options {
            qkv_pairs: 4,
            oproj_rows: 16,
            upgate_rows: 16,
            down_rows: 16,
            down_chunks: 2,
            attn_parts: parts,
            lmhead_rows: 20,
            fixed_cost_bytes: 0,
            context: MAX_SEQ,
        };
        let s = build(&shape_of(&c.cfg), &GpuShape::with_sms(sms), &opts).unwrap();
        let edges = check_every_edge(&c, &s);
        let kinds: std::collections::BTreeSet<_> = s
            .instrs
            .iter()
            .filter(|i| !i.waits.is_empty())
            .map(|i| i.op.kind())
            .collect();
        // Every kind but the reduction, which exists only with parts > 1, has a needed wait.
        assert_eq!(kinds.len(), 6 + parts.min(2), "{kinds:?}");
        assert!(edges >= 30, "only {edges} edges");
    }
}

/// Removes each wait of `s` in turn; returns how many there were.
fn check_every_edge(c: &Case, s: &Schedule) -> usize {
    // Fill the cache for the first positions so that at the last one every attention part
    // has positions to read.
    let last = c.tokens.len() - 1;
    let mut prefix = SlicedMachine::new(&c.cfg, &c.w, s, MAX_SEQ).unwrap();
    let mut ex = Executor::new(s).unwrap();
    for (pos, &t) in c.tokens[..last].iter().enumerate() {
        prefix.begin_token(t, pos).unwrap();
        ex.run_token(&mut prefix, Interleaving::Random { seed: 1 })
            .unwrap();
    }
    let want = &c.want[last];
    let run = |sched: &Schedule, target: usize| {
        let mut m = prefix.clone();
        m.begin_token(c.tokens[last], last).unwrap();
        let how = Interleaving::Eager {
            target: target as u32,
            seed: target as u64,
        };
        Executor::new(sched)
            .unwrap()
            .run_token(&mut m, how)
            .unwrap();
        rel_l2(m.logits(), want) <= TOLERANCE && m.token_out() == (first_max(want), last as u32 + 1)
    };
    let mut edges = 0;
    for x in 0..s.instrs.len() {
        assert!(run(s, x), "control run for {} is wrong", s.describe(x));
        for k in 0..s.instrs[x].waits.len() {
            let mut broken = s.clone();
            let gone = broken.instrs[x].waits.remove(k);
            let what = format!(
                "{} without its wait on {}",
                s.describe(x),
                s.counters.name(gone.counter)
            );
            match validate(&broken) {
                Err(scheduler::ScheduleError::Race { .. }) => {}
                other => panic!("{what}: validator says {other:?}"),
            }
            assert!(!run(&broken, x), "{what}: adversarial run still right");
            edges += 1;
        }
    }
    edges
}

/// SmolLM2-135M-Instruct (Q4_1 GGUF, the default model) against the reference.
#[test]
fn smollm2_real_weights_match_reference() {
    let path = megainfer::fetch::default_model().expect("default model");
    let model = megainfer::model::load(&path).expect("load the default model");
    let (cfg, w) = (&model.config, &model.weights);
    let tokens = [1u32, 504, 3458, 314];
    let mut fwd = CpuForward::new(cfg, w, MAX_SEQ);
    let want: Vec<Vec<f32>> = tokens.iter().map(|&t| fwd.forward(&[t]).unwrap()).collect();
    for sms in [7, 132] {
        let gpu = GpuShape::with_sms(sms);
        let s = build(&shape_of(cfg), &gpu, &auto(cfg, &gpu)).unwrap();
        let mut m = SlicedMachine::new(cfg, w, &s, MAX_SEQ).unwrap();
        let mut ex = Executor::new(&s).unwrap();
        for (pos, (&t, want)) in tokens.iter().zip(&want).enumerate() {
            m.begin_token(t, pos).unwrap();
            ex.run_token(&mut m, Interleaving::Random { seed: pos as u64 })
                .unwrap();
            let err = rel_l2(m.logits(), want);
            assert!(err <= TOLERANCE, "{sms} SMs, pos {pos}: rel L2 {err:e}");
            assert_eq!(m.token_out(), (first_max(want), pos as u32 + 1));
        }
    }
}

//! Schedules run by the CPU executor over `SlicedMachine`, by the GPU's rule (an instruction
//! runs once every element it reads carries the step's tag), must give bit for bit what the
//! same sliced instructions give run one after the other in the global order, token after
//! token, in any interleaving, and match `CpuForward`. And every read an instruction declares
//! must be what it needs: run as early as its declared inputs allow it computes the right
//! result, and run without waiting for any one of its producers it computes garbage.

use megainfer::model::random::random_weights;
use megainfer::model::{Config, Llama3RopeScaling, Weights};
use megainfer::reference::rel_l2;
use megainfer::reference::sliced::{shape_of, SlicedMachine};
use megainfer::reference::CpuForward;
use scheduler::{
    build, dependencies, CostModel, Executor, GpuShape, Interleaving, Machine, Options, Schedule,
};

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
        qk_norm: false,
        qkv_bias: false,
    }
}

/// Qwen3's per-head q/k norms on a tiny shape (4 query heads, 2 KV heads, head_dim 64).
fn tiny_qwen3() -> Config {
    Config {
        architecture: "Qwen3ForCausalLM".into(),
        qk_norm: true,
        ..tiny(72, 100, 4, 2, 64, false)
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
        qkv_pieces: 0,
        oproj_rows: 7,
        upgate_rows: 9,
        down_rows: 5,
        down_chunks: 3,
        attn_parts: 3,
        attn_heads: 0,
        lmhead_rows: 10,
        fixed_cost_bytes: 0,
        context: MAX_SEQ,
    }
}

fn auto(cfg: &Config, gpu: &GpuShape) -> Options {
    Options::auto(&shape_of(cfg), gpu, &CostModel::default())
}

/// The logits of every token of `c`, the sliced instructions run one after the other in the
/// global order (no executor): what every interleaving must reproduce bit for bit.
fn in_global_order(c: &Case, s: &Schedule) -> Vec<Vec<u32>> {
    let mut m = SlicedMachine::new(&c.cfg, &c.w, s, MAX_SEQ).unwrap();
    let mut out = Vec::new();
    for (pos, &t) in c.tokens.iter().enumerate() {
        m.begin_token(t, pos).unwrap();
        for op in &s.instrs {
            m.exec(op);
        }
        out.push(m.logits().iter().map(|x| x.to_bits()).collect());
    }
    out
}

/// Runs every token of `c` teacher-forced through `s` in the executor, and checks the logits
/// bit for bit against `exact` and within `TOLERANCE` of the reference, and `token_out`.
fn run_case(c: &Case, s: &Schedule, exact: &[Vec<u32>], seed: u64) {
    let mut m = SlicedMachine::new(&c.cfg, &c.w, s, MAX_SEQ).unwrap();
    let mut ex = Executor::new(s).unwrap();
    for (pos, (&t, want)) in c.tokens.iter().zip(&c.want).enumerate() {
        m.begin_token(t, pos).unwrap();
        let how = Interleaving::Random {
            seed: seed * 1000 + pos as u64,
        };
        ex.run_token(&mut m, how).unwrap();
        let bits: Vec<u32> = m.logits().iter().map(|x| x.to_bits()).collect();
        assert!(
            bits == exact[pos],
            "pos {pos}, {} SMs, seed {seed}, {:?}: logits differ from the global order's",
            s.gpu.sm_count,
            s.options
        );
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
    assert_eq!(ex.epoch() as usize, c.tokens.len());
}

#[test]
fn random_models_match_reference_over_tokens() {
    for (ci, cfg) in configs().into_iter().enumerate() {
        let c = case(cfg, 7 + ci as u64, 6);
        for sms in [1, 7, 132] {
            let gpu = GpuShape::with_sms(sms);
            for opts in [fine(&c.cfg), auto(&c.cfg, &gpu)] {
                let s = build(&shape_of(&c.cfg), &gpu, &opts).unwrap();
                let exact = in_global_order(&c, &s);
                for seed in 0..8 {
                    run_case(&c, &s, &exact, seed);
                }
            }
        }
    }
}

/// QKV cut into a given number of instructions a layer (`qkv_pieces`: heads split evenly,
/// neighbouring heads into different counts), with and without Qwen3's q/k norms: from one
/// instruction a head to one per two pairs.
#[test]
fn qkv_pieces_match_reference_over_tokens() {
    let qwen3 = tiny_qwen3();
    for (ci, cfg) in [configs()[2].clone(), qwen3].into_iter().enumerate() {
        let c = case(cfg, 60 + ci as u64, 5);
        let heads = c.cfg.num_heads + 2 * c.cfg.num_kv_heads;
        let most = heads * c.cfg.head_dim / 4;
        for (sms, pieces) in [(1, heads), (5, heads + 1), (7, 2 * heads + 3), (132, most)] {
            let gpu = GpuShape::with_sms(sms);
            let opts = Options {
                qkv_pieces: pieces,
                ..fine(&c.cfg)
            };
            let s = build(&shape_of(&c.cfg), &gpu, &opts).unwrap();
            let qkv = s
                .instrs
                .iter()
                .filter(|op| matches!(op, scheduler::Op::RmsQkvRope { .. }))
                .count();
            assert_eq!(qkv, pieces * c.cfg.num_layers, "{pieces} pieces");
            let exact = in_global_order(&c, &s);
            for seed in 0..3 {
                run_case(&c, &s, &exact, seed);
            }
        }
    }
}

/// Attention instructions that compute a share of a KV head's query heads (`attn_heads`),
/// with and without Qwen3's q/k norms (whose K row the share starting the group caches): every
/// divisor of the group, one part, in any interleaving.
#[test]
fn attention_head_shares_match_reference_over_tokens() {
    let qwen3 = tiny_qwen3();
    let wide = tiny(96, 100, 6, 1, 64, false);
    for (ci, cfg) in [wide, qwen3].into_iter().enumerate() {
        let c = case(cfg, 80 + ci as u64, 5);
        let group = c.cfg.num_heads / c.cfg.num_kv_heads;
        for heads in (1..=group).filter(|h| group.is_multiple_of(*h)) {
            for sms in [1, 7, 132] {
                let opts = Options {
                    attn_parts: 1,
                    attn_heads: heads,
                    ..fine(&c.cfg)
                };
                let s = build(&shape_of(&c.cfg), &GpuShape::with_sms(sms), &opts).unwrap();
                let attention = s
                    .instrs
                    .iter()
                    .filter(|op| matches!(op, scheduler::Op::Attention { .. }))
                    .count();
                let per_layer = c.cfg.num_kv_heads * group / heads;
                assert_eq!(attention, per_layer * c.cfg.num_layers, "{heads} heads");
                let exact = in_global_order(&c, &s);
                for seed in 0..3 {
                    run_case(&c, &s, &exact, seed);
                }
            }
        }
    }
    // A share that does not divide the group, or one with split-KV parts, is refused.
    let c = case(tiny(96, 100, 6, 1, 64, false), 1, 1);
    for (heads, parts) in [(4, 1), (2, 3)] {
        let opts = Options {
            attn_parts: parts,
            attn_heads: heads,
            ..fine(&c.cfg)
        };
        let err = build(&shape_of(&c.cfg), &GpuShape::with_sms(3), &opts).unwrap_err();
        assert!(err.to_string().contains("attn_heads"), "{err}");
    }
}

/// Greedy steps from the last token of `c`'s prompt (fed first, in the global order): the
/// tokens chosen and the last step's logits (bits), the steps run one after the other in the
/// global order.
fn greedy_in_global_order(c: &Case, s: &Schedule, steps: usize) -> (Vec<u32>, Vec<u32>) {
    let mut m = SlicedMachine::new(&c.cfg, &c.w, s, MAX_SEQ).unwrap();
    for (pos, &t) in c.tokens.iter().enumerate() {
        m.begin_token(t, pos).unwrap();
        s.instrs.iter().for_each(|op| m.exec(op));
    }
    let mut tokens = vec![m.token_out().0];
    for k in 0..steps {
        m.begin_token(tokens[k], c.tokens.len() + k).unwrap();
        s.instrs.iter().for_each(|op| m.exec(op));
        tokens.push(m.token_out().0);
    }
    (tokens, m.logits().iter().map(|x| x.to_bits()).collect())
}

/// A generation (the megakernel's steps inside one launch): the SMs run step after step with
/// nothing cleared in between, each starting a step once the step before has chosen its token.
/// In any interleaving the tokens and the last logits must be those of the steps run one at a
/// time, bit for bit, and the steps must not overlap (the argmax is every step's sink).
#[test]
fn generations_match_steps_run_one_at_a_time() {
    const STEPS: usize = 6;
    let qwen3 = tiny_qwen3();
    let mut cfgs = configs();
    cfgs.push(qwen3);
    for (ci, cfg) in cfgs.into_iter().enumerate() {
        let c = case(cfg, 60 + ci as u64, 4);
        for sms in [1, 7, 132] {
            let gpu = GpuShape::with_sms(sms);
            for opts in [fine(&c.cfg), auto(&c.cfg, &gpu)] {
                let s = build(&shape_of(&c.cfg), &gpu, &opts).unwrap();
                let (want, want_logits) = greedy_in_global_order(&c, &s, STEPS);
                for seed in 0..4 {
                    let mut m = SlicedMachine::new(&c.cfg, &c.w, &s, MAX_SEQ).unwrap();
                    for (pos, &t) in c.tokens.iter().enumerate() {
                        m.begin_token(t, pos).unwrap();
                        s.instrs.iter().for_each(|op| m.exec(op));
                    }
                    m.begin_generation(want[0], c.tokens.len(), STEPS).unwrap();
                    let mut ex = Executor::new(&s).unwrap();
                    let order = ex.run_generation(&mut m, STEPS as u32, seed).unwrap();
                    let label = format!("{} SMs, seed {seed}, {:?}", sms, s.options);
                    assert_eq!(m.generated(), want, "{label}: tokens");
                    let bits: Vec<u32> = m.logits().iter().map(|x| x.to_bits()).collect();
                    assert!(
                        bits == want_logits,
                        "{label}: the last step's logits differ"
                    );
                    assert_eq!(order.len(), STEPS * s.instrs.len());
                    assert_eq!(ex.epoch(), STEPS as u32);
                    // Every instruction feeds the argmax, so no SM's consumers start a step
                    // before every SM has finished the step before: nothing of one step can
                    // overwrite what another still reads (on the GPU only the loaders run
                    // ahead, with weights and, after rows_of_step_ready, K/V rows). An
                    // instruction that fed nothing would break this.
                    assert!(
                        order.windows(2).all(|w| w[0].0 <= w[1].0),
                        "{label}: an instruction of a step ran before one of the step before"
                    );
                }
            }
        }
    }
}

/// Qwen's steps: Qwen2's q/k/v biases in the QKV instruction, Qwen3's per-head q/k norms and
/// RoPE in attention (q_dim twice hidden as in Qwen3-0.6B), for any cut of the heads into QKV
/// instructions: one pair, the cost model's, whole heads.
#[test]
fn qwen_models_match_reference_over_tokens() {
    let qwen3 = tiny_qwen3();
    let qwen2 = Config {
        architecture: "Qwen2ForCausalLM".into(),
        qkv_bias: true,
        ..tiny(88, 130, 3, 1, 64, false)
    };
    for (ci, cfg) in [qwen3, qwen2].into_iter().enumerate() {
        let c = case(cfg, 40 + ci as u64, 6);
        for sms in [1, 7, 132] {
            let gpu = GpuShape::with_sms(sms);
            let whole = Options {
                qkv_pairs: c.cfg.head_dim / 2,
                ..fine(&c.cfg)
            };
            for opts in [fine(&c.cfg), auto(&c.cfg, &gpu), whole] {
                let s = build(&shape_of(&c.cfg), &gpu, &opts).unwrap();
                let exact = in_global_order(&c, &s);
                for seed in 0..4 {
                    run_case(&c, &s, &exact, seed);
                }
            }
        }
    }
    // A schedule built for the shape without q/k norms does not run the model with them.
    let cfg = Config {
        qk_norm: true,
        ..tiny(72, 100, 4, 2, 64, false)
    };
    let gpu = GpuShape::with_sms(3);
    let c = case(cfg, 3, 1);
    let plain = scheduler::ModelShape {
        qk_norm: false,
        ..shape_of(&c.cfg)
    };
    let s = build(&plain, &gpu, &fine(&c.cfg)).unwrap();
    assert!(SlicedMachine::new(&c.cfg, &c.w, &s, MAX_SEQ).is_err());
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
        run_case(&c, &s, &in_global_order(&c, &s), parts as u64);
    }
}

/// For every instruction of small multi-SM schedules (split-KV attention or not): run as soon
/// as what it declares it reads is written, it is right (it reads nothing undeclared); run
/// without waiting for any one producer it does not otherwise depend on, the result is NaN or
/// a wrong token (the declared read is needed).
#[test]
fn every_declared_dependency_is_needed_and_enough() {
    let c = case(tiny(40, 56, 4, 2, 16, false), 11, 4);
    for (parts, sms, heads) in [(2, 5, 0), (1, 3, 0), (1, 3, 1)] {
        let opts = Options {
            qkv_pairs: 4,
            qkv_pieces: 0,
            oproj_rows: 16,
            upgate_rows: 16,
            down_rows: 16,
            down_chunks: 2,
            attn_parts: parts,
            attn_heads: heads,
            lmhead_rows: 20,
            fixed_cost_bytes: 0,
            context: MAX_SEQ,
        };
        let s = build(&shape_of(&c.cfg), &GpuShape::with_sms(sms), &opts).unwrap();
        let (edges, kinds) = check_every_edge(&c, &s);
        // Every kind has an edge that is needed (QKV through layer 1, whose input is layer 0's
        // output); the reduction exists only with parts > 1.
        assert_eq!(kinds.len(), 6 + parts.min(2), "{kinds:?}");
        assert!(edges >= 30, "only {edges} edges");
    }
}

/// Withholds each producer of each instruction in turn; returns how many edges were needed
/// and the kinds of the instructions that had one.
fn check_every_edge(
    c: &Case,
    s: &Schedule,
) -> (usize, std::collections::BTreeSet<scheduler::StageKind>) {
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
    let run = |target: usize, withhold: Option<u32>| {
        let mut m = prefix.clone();
        m.begin_token(c.tokens[last], last).unwrap();
        let how = Interleaving::Eager {
            target: target as u32,
            seed: target as u64,
            withhold,
        };
        let mut ex = Executor::new(s).unwrap();
        // The executor's tags must be at this step too: run the earlier steps blind.
        for _ in 0..last {
            ex.run_token(&mut scheduler::Blind, Interleaving::Random { seed: 0 })
                .unwrap();
        }
        ex.run_token(&mut m, how).unwrap();
        rel_l2(m.logits(), want) <= TOLERANCE && m.token_out() == (first_max(want), last as u32 + 1)
    };
    let deps = dependencies(s).unwrap();
    let probe = Executor::new(s).unwrap();
    let mut edges = 0;
    let mut kinds = std::collections::BTreeSet::new();
    for (x, producers) in deps.iter().enumerate() {
        assert!(run(x, None), "control run for {} is wrong", s.describe(x));
        for &w in producers {
            if probe.depends_otherwise(x as u32, w).unwrap() {
                continue;
            }
            assert!(
                !run(x, Some(w)),
                "{} run without waiting for {}: still right",
                s.describe(x),
                s.describe(w as usize)
            );
            edges += 1;
            kinds.insert(s.instrs[x].kind());
        }
    }
    (edges, kinds)
}

/// SmolLM2-135M-Instruct (Q4_1 GGUF, the default model) against the reference.
#[test]
fn smollm2_real_weights_match_reference() {
    let path = megainfer::fetch::default_model().expect("default model");
    let mut model = megainfer::model::load(&path).expect("load the default model");
    // The schedule's instructions read bf16 weights: widen the file's Q4_1/Q8_0 matrices.
    model.weights.widen_to_bf16();
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

//! The graph paths' mat-vec kernel (`bl_mv`, kernels/baseline/baseline.cu) alone, the way
//! llm.c's dev/cuda measures its kernels: a CPU reference, a check of every geometry against
//! it, then a timing sweep over the projection shapes of Llama-3.2-1B and SmolLM2-135M.
//!
//! Run on the GPU machine (built here, no build step there):
//!     target/release/deps/gpu_gemv_bench-* --include-ignored --nocapture --test-threads=1
//! or `cargo test --release --test gpu_gemv_bench -- --include-ignored --nocapture`. `gemv_bench`
//! takes a few minutes; add `gemv_bench` after the flags to run only the sweep.
//!
//! Every kernel's output is checked before it is timed; a wrong result fails the test. The
//! timing replays a CUDA graph of back-to-back launches (with and without PDL), each launch
//! reading a different copy of the weights so that the 50 MB L2 holds none of them, and
//! prints GB/s against the streaming read bandwidth measured in the same run. Per shape it
//! prints the fastest geometry, the one the path's estimate picks (`MvConfig::choose`), the
//! winner again with the epilogue the path fuses into that projection, and at the end the
//! winners as a `MEGAINFER_BASELINE_MV` setting per model and the sum of one decode step's
//! mat-vecs against the bandwidth floor.

#[path = "common/gpu.rs"]
#[allow(dead_code)]
mod gpu_common;
use gpu_common::gpu;

use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaSlice;
use half::bf16;
use megainfer::gpu::baseline::{
    load_module, measure_read_bandwidth, MatVec, MvConfig, MvIn, MvOut, MvParams, OldGemv, Proj,
};
use megainfer::gpu::device::{ptr, Gpu};
use megainfer::model::presets;

/// Deterministic values in [-1, 1).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

fn bf16_bits(v: &[f32]) -> Vec<u16> {
    v.iter().map(|&f| bf16::from_f32(f).to_bits()).collect()
}

fn widen(b: u16) -> f64 {
    f32::from_bits((b as u32) << 16) as f64
}

/// y = W · x in f64, W as bf16 bits.
fn cpu_matvec(w: &[u16], x: &[f64], rows: usize, cols: usize) -> Vec<f64> {
    (0..rows)
        .map(|r| {
            w[r * cols..(r + 1) * cols]
                .iter()
                .zip(x)
                .map(|(&a, &b)| widen(a) * b)
                .sum()
        })
        .collect()
}

/// Worst |got - want| over the largest |want|, the error measure of every check here.
fn rel_max(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
    got.iter()
        .zip(want)
        .map(|(&g, &w)| (g as f64 - w).abs())
        .fold(0f64, f64::max)
        / scale
}

/// f32 accumulation of up to 8192 products of bf16 weights and f32 inputs: the measured
/// errors are around 1e-6 of the largest output; a wrong row, column or split is off by O(1).
const TOL: f64 = 1e-4;

fn zeros_f32(g: &Gpu, n: usize) -> CudaSlice<f32> {
    g.alloc_zeros(n, "test buffer").unwrap()
}

struct Shape {
    label: String,
    model: &'static str,
    config: megainfer::model::Config,
    proj: Proj,
    rows: usize,
    cols: usize,
}

fn shapes() -> Vec<Shape> {
    let mut v = Vec::new();
    for model in ["llama-3.2-1b", "smollm2-135m"] {
        let c = presets::by_name(model).unwrap();
        for p in Proj::ALL {
            let (rows, cols) = p.shape(&c);
            v.push(Shape {
                label: format!("{model} {} {cols}->{rows}", p.key()),
                model,
                config: c.clone(),
                proj: p,
                rows,
                cols,
            });
        }
    }
    v
}

/// Seconds per launch of `launch(copy)` over `n` launches captured in one graph (median of
/// five replays after two warm-up replays).
fn time_graph(g: &Gpu, n: usize, launch: &dyn Fn(usize) -> anyhow::Result<()>) -> f64 {
    let s = &g.stream;
    s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap();
    let mut res = Ok(());
    for i in 0..n {
        res = res.and_then(|_| launch(i));
    }
    let graph = s.end_capture(CUgraphInstantiate_flags(0)).unwrap();
    res.unwrap();
    let graph = graph.expect("capture made a graph");
    let start = g
        .ctx
        .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .unwrap();
    let stop = g
        .ctx
        .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .unwrap();
    let mut times = Vec::new();
    for rep in 0..7 {
        start.record(s).unwrap();
        graph.launch().unwrap();
        stop.record(s).unwrap();
        stop.synchronize().unwrap();
        if rep >= 2 {
            times.push(start.elapsed_ms(&stop).unwrap() as f64 * 1e-3);
        }
    }
    times.sort_by(f64::total_cmp);
    times[times.len() / 2] / n as f64
}

/// Seconds per launch of the projection `sh` with the epilogue the graph path gives it, at
/// geometry `cfg`, PDL on (as `time_graph`); `wp(i)` the i-th weight copy, x at `xp`. With
/// `norm_only`, the norm-folded input (where the path folds it) and a plain store instead.
#[allow(clippy::too_many_arguments)]
fn time_fused(
    g: &Gpu,
    mv: &MatVec,
    sh: &Shape,
    cfg: MvConfig,
    n: usize,
    wp: &dyn Fn(usize) -> u64,
    xp: u64,
    norm_only: bool,
) -> f64 {
    let s = &g.stream;
    let c = &sh.config;
    let (rows, cols) = (sh.rows, sh.cols);
    let norm_host = bf16_bits(&vec![1.0f32; cols]);
    let norm = g.upload(&norm_host, "norm").unwrap();
    let y = zeros_f32(g, rows);
    let meta = g.upload(&[1u32, 5, 0, 0], "meta").unwrap();
    let history = g.alloc_zeros::<u32>(8 * n + 16, "history").unwrap();
    let part = g
        .alloc_zeros::<u32>(MatVec::argmax_part_words(g.sm_count), "part")
        .unwrap();
    let done = g.alloc_zeros::<u32>(1, "done").unwrap();
    let kv = g.alloc_zeros::<u16>(16 * c.kv_dim(), "kv").unwrap();
    let inv_freq = g.upload(&c.rope_inv_freq(), "inv_freq").unwrap();
    let norm_in = MvIn::Norm {
        norm: ptr(&norm, s),
        eps: 1e-5,
    };
    let (input, out) = match sh.proj {
        Proj::O | Proj::Down if norm_only => (MvIn::Plain, MvOut::Store),
        _ if norm_only => (norm_in, MvOut::Store),
        Proj::Qkv => (
            norm_in,
            MvOut::RopeKv {
                k_cache: ptr(&kv, s),
                v_cache: ptr(&kv, s),
                meta: ptr(&meta, s),
                inv_freq: ptr(&inv_freq, s),
                n_heads: c.num_heads as i32,
                n_kv: c.num_kv_heads as i32,
                head_dim: c.head_dim as i32,
            },
        ),
        Proj::O | Proj::Down => (MvIn::Plain, MvOut::Add),
        Proj::GateUp => (norm_in, MvOut::Silu),
        Proj::LmHead => (
            norm_in,
            MvOut::Argmax {
                meta: ptr(&meta, s),
                history: ptr(&history, s),
                part: ptr(&part, s),
                done: ptr(&done, s),
            },
        ),
    };
    let yp = ptr(&y, s);
    // The argmax advances meta.pos once a launch: 7 replays of n launches stay inside history.
    time_graph(g, n, &|i| {
        let p = MvParams {
            w: wp(i),
            x: xp,
            y: yp,
            ..Default::default()
        };
        mv.launch(s, cfg, p, rows, cols, input, out, true)
    })
}

/// The tests of this file one at a time: the timings must not share the GPU.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
#[ignore = "needs a GPU"]
fn gemv_bench() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let g = gpu();
    let bw = measure_read_bandwidth(&g).unwrap();
    println!("{} | streaming read {bw:.0} GB/s", g.describe());
    let module = load_module(&g).unwrap();
    let mut mv = MatVec::load(&module, &g).unwrap();
    let old = OldGemv::load(&module, 16384).unwrap();
    let s = &g.stream;
    // (label, projection, fastest with PDL, fastest without)
    let mut winners: Vec<(String, Proj, MvConfig, MvConfig)> = Vec::new();
    let mut step_time = std::collections::BTreeMap::<&str, (f64, f64)>::new();
    let mut worst_err = 0f64;
    for sh in shapes() {
        let (rows, cols) = (sh.rows, sh.cols);
        let bytes = rows * cols * 2;
        let mut rng = Lcg(rows as u64 * 31 + cols as u64);
        let w_host = bf16_bits(&(0..rows * cols).map(|_| rng.next()).collect::<Vec<_>>());
        let x_host: Vec<f32> = (0..cols).map(|_| rng.next()).collect();
        let x64: Vec<f64> = x_host.iter().map(|&v| v as f64).collect();
        let want = cpu_matvec(&w_host, &x64, rows, cols);
        // Enough copies that a run of launches streams at least 400 MB (8 L2s) between two
        // reads of the same copy.
        let copies = (400usize << 20).div_ceil(bytes).max(2);
        let mut w_dev = g
            .alloc_zeros::<u16>(copies * rows * cols, "weights")
            .unwrap();
        for c in 0..copies {
            s.memcpy_htod(
                &w_host,
                &mut w_dev.slice_mut(c * rows * cols..(c + 1) * rows * cols),
            )
            .unwrap();
        }
        let x_dev = g.upload(&x_host, "x").unwrap();
        let mut y_dev = zeros_f32(&g, rows);
        let (w0, xp, yp) = (ptr(&w_dev, s), ptr(&x_dev, s), ptr(&y_dev, s));
        let wp = |i: usize| w0 + ((i % copies) * bytes) as u64;
        // Launches per timed graph: about 2 GB of reads, at least 20.
        let n = (2usize << 30).div_ceil(bytes).clamp(20, 2000);
        println!(
            "\n{}: {:.2} MB, {copies} copies, {n} launches a graph",
            sh.label,
            bytes as f64 / 1e6
        );
        println!(
            "{:<12} {:>9} {:>8} {:>6} | {:>9} {:>8} {:>6} | {:>9}",
            "kernel", "us", "GB/s", "%BW", "us (PDL)", "GB/s", "%BW", "max err"
        );
        let report = |name: &str, t: f64, tp: f64, err: f64| {
            let (gb, gbp) = (bytes as f64 / t / 1e9, bytes as f64 / tp / 1e9);
            println!(
                "{name:<12} {:>9.2} {gb:>8.0} {:>5.1}% | {:>9.2} {gbp:>8.0} {:>5.1}% | {err:>9.1e}",
                t * 1e6,
                100.0 * gb / bw,
                tp * 1e6,
                100.0 * gbp / bw
            );
        };
        // The first kernel, for reference.
        s.memset_zeros(&mut y_dev).unwrap();
        old.launch(s, w0, xp, yp, rows, cols, false).unwrap();
        let err = rel_max(&s.clone_dtoh(&y_dev).unwrap(), &want);
        assert!(err <= TOL, "{} bl_gemv: max error {err:.2e}", sh.label);
        let t = time_graph(&g, n, &|i| old.launch(s, wp(i), xp, yp, rows, cols, false));
        let tp = time_graph(&g, n, &|i| old.launch(s, wp(i), xp, yp, rows, cols, true));
        report("bl_gemv(old)", t, tp, err);
        let pick = MvConfig::choose(
            rows,
            cols,
            matches!(sh.proj, Proj::Qkv | Proj::GateUp),
            g.sm_count,
        );
        let mut best: Option<(f64, MvConfig)> = None;
        let mut best_plain: Option<(f64, MvConfig)> = None;
        let mut pick_time = f64::NAN;
        for cfg in MvConfig::all() {
            let launch = |w: u64, pdl: bool| {
                let p = MvParams {
                    w,
                    x: xp,
                    y: yp,
                    ..Default::default()
                };
                mv.launch(s, cfg, p, rows, cols, MvIn::Plain, MvOut::Store, pdl)
            };
            s.memset_zeros(&mut y_dev).unwrap();
            launch(w0, false).unwrap();
            let err = rel_max(&s.clone_dtoh(&y_dev).unwrap(), &want);
            worst_err = worst_err.max(err);
            assert!(
                err <= TOL,
                "{} {}: max error {err:.2e}",
                sh.label,
                cfg.name()
            );
            let t = time_graph(&g, n, &|i| launch(wp(i), false));
            let tp = time_graph(&g, n, &|i| launch(wp(i), true));
            let mark = if cfg == pick { " (heuristic)" } else { "" };
            report(&format!("{}{mark}", cfg.name()), t, tp, err);
            if cfg == pick {
                pick_time = tp;
            }
            let pairs_ok = !matches!(sh.proj, Proj::Qkv | Proj::GateUp)
                || cfg.rows_per_task().is_multiple_of(2);
            if pairs_ok && best.is_none_or(|(bt, _)| tp < bt) {
                best = Some((tp, cfg));
            }
            if pairs_ok && best_plain.is_none_or(|(bt, _)| t < bt) {
                best_plain = Some((t, cfg));
            }
        }
        let (bt, bc) = best.unwrap();
        let (bpt, bpc) = best_plain.unwrap();
        println!(
            "{}: best {} {:.2} us ({:.1}% of BW, PDL), without PDL {} {:.2} us ({:.1}%); heuristic {} {:.2} us ({:.1}%, PDL)",
            sh.label,
            bc.name(),
            bt * 1e6,
            100.0 * bytes as f64 / bt / 1e9 / bw,
            bpc.name(),
            bpt * 1e6,
            100.0 * bytes as f64 / bpt / 1e9 / bw,
            pick.name(),
            pick_time * 1e6,
            100.0 * bytes as f64 / pick_time / 1e9 / bw
        );
        // The winner again with the epilogue the graph path gives this projection (norm
        // folded into QKV, gate/up and the LM head; RoPE + K/V, residual add, SiLU·up,
        // argmax): what the folded steps cost inside the kernel.
        let tf = time_fused(&g, &mv, &sh, bc, n, &wp, xp, false);
        // The RMS norm alone (each CTA computing rms(x) itself), plain store.
        let tn = time_fused(&g, &mv, &sh, bc, n, &wp, xp, true);
        // The same without the L2 evict-first hint on the weights.
        mv.evict_first = !mv.evict_first;
        let tf_other = time_fused(&g, &mv, &sh, bc, n, &wp, xp, false);
        mv.evict_first = !mv.evict_first;
        println!(
            "{}: {} with the path's fused epilogue: {:.2} us ({:.1}% of BW, PDL); plain store {:.2} us, norm-folded input + store {:.2} us; L2 evict-first {}: {:.2} us",
            sh.label,
            bc.name(),
            tf * 1e6,
            100.0 * bytes as f64 / tf / 1e9 / bw,
            bt * 1e6,
            tn * 1e6,
            if mv.evict_first { "off" } else { "on" },
            tf_other * 1e6
        );
        winners.push((sh.label.clone(), sh.proj, bc, bpc));
        step_time.entry(sh.model).or_insert((0.0, 0.0)).0 += tf
            * if sh.proj == Proj::LmHead {
                1.0
            } else {
                sh.config.num_layers as f64
            };
        step_time.get_mut(sh.model).unwrap().1 += bytes as f64
            * if sh.proj == Proj::LmHead {
                1.0
            } else {
                sh.config.num_layers as f64
            };
    }
    for (model, (t, b)) in &step_time {
        println!(
            "{model}: the mat-vecs of one decode step, each alone back to back with its fused epilogue: {:.3} ms for {:.3} GB ({:.1}% of BW); the bandwidth floor is {:.3} ms",
            t * 1e3,
            b / 1e9,
            100.0 * b / t / 1e9 / bw,
            b / bw / 1e6
        );
    }
    println!(
        "\nworst max error over every geometry and shape: {worst_err:.2e} (tolerance {TOL:.0e})"
    );
    for model in ["llama-3.2-1b", "smollm2-135m"] {
        let env = |pdl: bool| {
            winners
                .iter()
                .filter(|w| w.0.starts_with(model))
                .map(|w| format!("{}={}", w.1.key(), if pdl { w.2 } else { w.3 }.name()))
                .collect::<Vec<_>>()
                .join(",")
        };
        println!("{model}, graph-pdl: MEGAINFER_BASELINE_MV={}", env(true));
        println!("{model}, graph: MEGAINFER_BASELINE_MV={}", env(false));
    }
}

/// Every geometry of every fused epilogue against the CPU: the norm folded into the input,
/// the residual add, SiLU·up, and RoPE with the K/V cache write, on shapes that are not
/// powers of two.
#[test]
#[ignore = "needs a GPU"]
fn fused_epilogues_match_cpu() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let g = gpu();
    let module = load_module(&g).unwrap();
    let mv = MatVec::load(&module, &g).unwrap();
    let s = &g.stream;
    let mut rng = Lcg(99);
    let mut worst = [0f64; 4];
    // (heads, kv heads, head_dim, hidden, inter)
    for (nh, nkv, hd, hidden, inter) in [(9, 3, 64, 576, 1536), (4, 2, 128, 520, 1000)] {
        let eps = 1e-5f32;
        let x_host: Vec<f32> = (0..hidden.max(inter)).map(|_| rng.next() * 3.0).collect();
        let norm_host = bf16_bits(
            &(0..hidden)
                .map(|_| 1.0 + 0.5 * rng.next())
                .collect::<Vec<_>>(),
        );
        let x_dev = g.upload(&x_host, "x").unwrap();
        let norm_dev = g.upload(&norm_host, "norm").unwrap();
        let xh = &x_host[..hidden];
        let ms = xh.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / hidden as f64;
        let inv = 1.0 / (ms + eps as f64).sqrt();
        let xn: Vec<f64> = xh
            .iter()
            .zip(&norm_host)
            .map(|(&v, &n)| v as f64 * inv * widen(n))
            .collect();
        let xp = ptr(&x_dev, s);
        let norm_in = MvIn::Norm {
            norm: ptr(&norm_dev, s),
            eps,
        };
        // Norm in, store out.
        let rows = 777;
        let w = bf16_bits(&(0..rows * hidden).map(|_| rng.next()).collect::<Vec<_>>());
        let w_dev = g.upload(&w, "w").unwrap();
        let want = cpu_matvec(&w, &xn, rows, hidden);
        // Residual add: y0 + W · x (x plain, inter columns).
        let wa = bf16_bits(&(0..hidden * inter).map(|_| rng.next()).collect::<Vec<_>>());
        let wa_dev = g.upload(&wa, "w add").unwrap();
        let x64: Vec<f64> = x_host[..inter].iter().map(|&v| v as f64).collect();
        let y0: Vec<f32> = (0..hidden).map(|_| rng.next()).collect();
        let want_add: Vec<f64> = cpu_matvec(&wa, &x64, hidden, inter)
            .iter()
            .zip(&y0)
            .map(|(a, &b)| a + b as f64)
            .collect();
        // SiLU·up: W = [gate; up], 2 * inter rows, normed input.
        let wg = bf16_bits(
            &(0..2 * inter * hidden)
                .map(|_| rng.next())
                .collect::<Vec<_>>(),
        );
        let wg_dev = g.upload(&wg, "w gate/up").unwrap();
        let gu = cpu_matvec(&wg, &xn, 2 * inter, hidden);
        let want_silu: Vec<f64> = (0..inter)
            .map(|i| gu[i] / (1.0 + (-gu[i]).exp()) * gu[inter + i])
            .collect();
        // RoPE + KV at position `pos` of a 16-position cache.
        let (pos, max_seq) = (11u32, 16usize);
        let qkv_rows = (nh + 2 * nkv) * hd;
        let wq = bf16_bits(
            &(0..qkv_rows * hidden)
                .map(|_| rng.next())
                .collect::<Vec<_>>(),
        );
        let wq_dev = g.upload(&wq, "w qkv").unwrap();
        let q = cpu_matvec(&wq, &xn, qkv_rows, hidden);
        let inv_freq: Vec<f32> = (0..hd / 2)
            .map(|i| 500000f64.powf(-((2 * i) as f64) / hd as f64) as f32)
            .collect();
        let inv_freq_dev = g.upload(&inv_freq, "inv_freq").unwrap();
        let mut rot = q.clone();
        for h in 0..nh + nkv {
            for i in 0..hd / 2 {
                let (sn, cs) = (pos as f64 * inv_freq[i] as f64).sin_cos();
                let (a, b) = (q[h * hd + i], q[h * hd + i + hd / 2]);
                rot[h * hd + i] = a * cs - b * sn;
                rot[h * hd + i + hd / 2] = b * cs + a * sn;
            }
        }
        let meta_dev = g.upload(&[5u32, pos, 0, 0], "meta").unwrap();
        for cfg in MvConfig::all() {
            let name = format!("{nh}x{hd} h{hidden} {}", cfg.name());
            let pairs = cfg.rows_per_task().is_multiple_of(2);
            let run = |w: u64, y: u64, rows: usize, cols: usize, i: MvIn, o: MvOut| {
                let p = MvParams {
                    w,
                    x: xp,
                    y,
                    ..Default::default()
                };
                mv.launch(s, cfg, p, rows, cols, i, o, false).unwrap();
            };
            let y = zeros_f32(&g, rows);
            run(
                ptr(&w_dev, s),
                ptr(&y, s),
                rows,
                hidden,
                norm_in,
                MvOut::Store,
            );
            let e = rel_max(&s.clone_dtoh(&y).unwrap(), &want);
            worst[0] = worst[0].max(e);
            assert!(e <= TOL, "{name} norm: {e:.2e}");
            let ya = g.upload(&y0, "y0").unwrap();
            run(
                ptr(&wa_dev, s),
                ptr(&ya, s),
                hidden,
                inter,
                MvIn::Plain,
                MvOut::Add,
            );
            let e = rel_max(&s.clone_dtoh(&ya).unwrap(), &want_add);
            worst[1] = worst[1].max(e);
            assert!(e <= TOL, "{name} add: {e:.2e}");
            if !pairs {
                continue;
            }
            let ys = zeros_f32(&g, inter);
            run(
                ptr(&wg_dev, s),
                ptr(&ys, s),
                2 * inter,
                hidden,
                norm_in,
                MvOut::Silu,
            );
            let e = rel_max(&s.clone_dtoh(&ys).unwrap(), &want_silu);
            worst[2] = worst[2].max(e);
            assert!(e <= TOL, "{name} silu: {e:.2e}");
            let yq = zeros_f32(&g, qkv_rows);
            let kc = g.alloc_zeros::<u16>(max_seq * nkv * hd, "k").unwrap();
            let vc = g.alloc_zeros::<u16>(max_seq * nkv * hd, "v").unwrap();
            let out = MvOut::RopeKv {
                k_cache: ptr(&kc, s),
                v_cache: ptr(&vc, s),
                meta: ptr(&meta_dev, s),
                inv_freq: ptr(&inv_freq_dev, s),
                n_heads: nh as i32,
                n_kv: nkv as i32,
                head_dim: hd as i32,
            };
            run(ptr(&wq_dev, s), ptr(&yq, s), qkv_rows, hidden, norm_in, out);
            let got_q = s.clone_dtoh(&yq).unwrap();
            let e_q = rel_max(&got_q[..nh * hd], &rot[..nh * hd]);
            let (kh, vh) = (s.clone_dtoh(&kc).unwrap(), s.clone_dtoh(&vc).unwrap());
            let slot = pos as usize * nkv * hd;
            // Every other position of the caches stays untouched.
            assert!(
                kh[..slot]
                    .iter()
                    .chain(&kh[slot + nkv * hd..])
                    .all(|&v| v == 0)
                    && vh[..slot]
                        .iter()
                        .chain(&vh[slot + nkv * hd..])
                        .all(|&v| v == 0),
                "{name} rope: K/V written outside position {pos}"
            );
            let widen_all = |v: &[u16]| v.iter().map(|&b| widen(b) as f32).collect::<Vec<_>>();
            let e_k = rel_max(
                &widen_all(&kh[slot..slot + nkv * hd]),
                &rot[nh * hd..(nh + nkv) * hd],
            );
            let e_v = rel_max(
                &widen_all(&vh[slot..slot + nkv * hd]),
                &q[(nh + nkv) * hd..],
            );
            // K and V are stored as bf16: 2^-8 relative rounding.
            let e = e_q.max(e_k / 40.0).max(e_v / 40.0);
            worst[3] = worst[3].max(e_q).max(e_k).max(e_v);
            assert!(
                e <= TOL,
                "{name} rope: q {e_q:.2e}, k {e_k:.2e}, v {e_v:.2e}"
            );
        }
    }
    println!(
        "worst max error: norm {:.2e}, add {:.2e}, silu {:.2e}, rope/kv {:.2e} (bf16 K/V included; tolerance {TOL:.0e}, K/V 40x)",
        worst[0], worst[1], worst[2], worst[3]
    );
}

/// The LM head with the argmax fused (the Llama-3.2-1B head, 128256 x 2048) against the CPU
/// argmax of the same logits, with ties: the largest logit repeated at rows far apart (other
/// CTAs) and next to each other (the same CTA task), where the lowest index must win, as in
/// `sampling::argmax`. Also checks the token bookkeeping (meta, history) and that the arrival
/// counter is left at 0, by running twice.
#[test]
#[ignore = "needs a GPU"]
fn lm_head_argmax_matches_cpu_argmax_with_ties() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let g = gpu();
    let module = load_module(&g).unwrap();
    let mv = MatVec::load(&module, &g).unwrap();
    let s = &g.stream;
    let (rows, cols) = (128256usize, 2048usize);
    let mut rng = Lcg(7);
    let x: Vec<f32> = (0..cols).map(|_| rng.next()).collect();
    let base: Vec<f32> = (0..rows * cols).map(|_| rng.next() * 0.05).collect();
    let w = bf16_bits(&base);
    // A row that wins clearly: its weights follow the sign of x.
    let winner: Vec<u16> = bf16_bits(&x.iter().map(|&v| v.signum() * 0.5).collect::<Vec<_>>());
    let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    let part = g
        .alloc_zeros::<u32>(MatVec::argmax_part_words(g.sm_count), "part")
        .unwrap();
    let done = g.alloc_zeros::<u32>(1, "done").unwrap();
    let history = g.alloc_zeros::<u32>(64, "history").unwrap();
    let cases: [&[usize]; 4] = [&[90001], &[120000, 77, 5000], &[4001, 4000], &[128255, 3]];
    for rows_at in cases {
        let mut wc = w.clone();
        for &r in rows_at {
            wc[r * cols..(r + 1) * cols].copy_from_slice(&winner);
        }
        let expect = *rows_at.iter().min().unwrap() as u32;
        let want = cpu_matvec(&wc, &x64, rows, cols);
        let w_dev = g.upload(&wc, "lm head").unwrap();
        let x_dev = g.upload(&x, "x").unwrap();
        let y = zeros_f32(&g, rows);
        for cfg in MvConfig::all() {
            let meta = g.upload(&[1u32, 9, 0, 0], "meta").unwrap();
            for step in 0..2u32 {
                let p = MvParams {
                    w: ptr(&w_dev, s),
                    x: ptr(&x_dev, s),
                    y: ptr(&y, s),
                    ..Default::default()
                };
                let out = MvOut::Argmax {
                    meta: ptr(&meta, s),
                    history: ptr(&history, s),
                    part: ptr(&part, s),
                    done: ptr(&done, s),
                };
                mv.launch(s, cfg, p, rows, cols, MvIn::Plain, out, step == 1)
                    .unwrap();
                let logits = s.clone_dtoh(&y).unwrap();
                let err = rel_max(&logits, &want);
                let cpu = megainfer::sampling::argmax(&logits);
                let m = s.clone_dtoh(&meta).unwrap();
                let h = s.clone_dtoh(&history).unwrap();
                let d = s.clone_dtoh(&done).unwrap();
                let what = format!("winner rows {rows_at:?}, {} step {step}", cfg.name());
                assert!(err <= TOL, "{what}: logits error {err:.2e}");
                // The tied rows are bit-identical products, so the logits tie exactly.
                assert!(
                    rows_at
                        .iter()
                        .all(|&r| logits[r] == logits[expect as usize]),
                    "{what}: tied rows differ"
                );
                assert_eq!(cpu, expect, "{what}: CPU argmax of the GPU logits");
                assert_eq!(m[0], expect, "{what}: meta.token");
                assert_eq!(m[2], expect, "{what}: meta.next");
                assert_eq!(m[1], 10 + step, "{what}: meta.pos");
                assert_eq!(h[10 + step as usize], expect, "{what}: history");
                assert_eq!(d[0], 0, "{what}: arrival counter not reset");
            }
        }
        println!("winner rows {rows_at:?}: every geometry chose {expect} (CPU argmax agrees)");
    }
}

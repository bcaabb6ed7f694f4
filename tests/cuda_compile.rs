//! The CUDA sources compile with NVRTC for Hopper. Needs only libnvrtc and the CUDA headers,
//! not a GPU. Without NVRTC these tests fail, saying so: `scripts/test.sh` (the project's test
//! command, run by CI) installs NVRTC from the `nvidia-cuda-nvrtc` wheel and points
//! `LD_LIBRARY_PATH` and `CUDA_HOME` at it.

use megainfer::gpu::{compile, sources};
use megainfer::model::presets;

fn require_nvrtc() {
    assert!(
        compile::nvrtc_present(),
        "libnvrtc could not be loaded, so the CUDA sources were not compiled: run the tests with \
         scripts/test.sh, which installs NVRTC from the nvidia-cuda-nvrtc wheel, or put a CUDA 13 \
         toolkit's lib directory on LD_LIBRARY_PATH and set CUDA_HOME"
    );
}

/// Compiles `src` with NVRTC for sm_90a and checks that the result is a CUBIN (an ELF image).
fn assert_compiles(name: &str, src: &str, defines: &[String], what: &str) {
    let cubin = compile::compile_cubin(name, src, "sm_90a", defines).unwrap();
    assert_eq!(
        &cubin[..4],
        b"\x7fELF",
        "NVRTC output is not a CUBIN (ELF) image{what}"
    );
}

#[test]
fn baseline_kernels_compile_for_sm90a() {
    require_nvrtc();
    assert_compiles("baseline", &sources::baseline(), &[], "");
}

/// kernels/quant/quant.cu alone: the prefill unit includes it without the baseline's helpers,
/// so it must need none of them.
#[test]
fn quant_kernels_compile_alone_for_sm90a() {
    require_nvrtc();
    assert_compiles("quant", &sources::quant(), &[], "");
}

#[test]
fn sampling_kernels_compile_for_sm90a() {
    require_nvrtc();
    assert_compiles("sampling", &megainfer::sampling::device::source(), &[], "");
}

#[test]
fn megakernel_compiles_for_sm90a() {
    require_nvrtc();
    // Each attention shape the GPU paths support: head_dim 64 and 128, 1 to 9 query heads
    // per KV head (more than one pass of four); attention by warps (at head_dim 128 with 3 or
    // 4 query heads a KV head: two head groups, one with a head past the group's last) and by
    // rounds.
    for (hd, group) in [
        (64, 4),
        (64, 3),
        (128, 2),
        (64, 9),
        (128, 1),
        (128, 3),
        (128, 4),
        (128, 7),
    ] {
        let mut cfg = presets::by_name("smollm2-135m").unwrap();
        cfg.head_dim = hd;
        cfg.num_kv_heads = 1;
        cfg.num_heads = group;
        for by_warps in [1, 0] {
            let mut defines = sources::megakernel_defines(&cfg, 0);
            defines.push(format!("-DMK_ATT_BY_WARPS={by_warps}"));
            let what = format!(" (head_dim {hd}, group {group}, MK_ATT_BY_WARPS={by_warps})");
            assert_compiles("megakernel", &sources::megakernel(), &defines, &what);
        }
    }
    // Attention instructions computing a share of a group: one query head of SmolLM2's three
    // (by warps), and Qwen3's q/k norms with one head of two at head_dim 128.
    for (name, share) in [("smollm2-135m", 1), ("qwen3-0.6b", 1)] {
        let cfg = presets::by_name(name).unwrap();
        let defines = sources::megakernel_defines(&cfg, share);
        let what = format!(" ({name}, {share} query head an instruction)");
        assert_compiles("megakernel", &sources::megakernel(), &defines, &what);
    }
}

/// The megakernel as `run` and `bench` compile it (`kernel_defines`) for the presets of hidden
/// size over 2048, on an H100's schedule: the residual entering a layer read in one round
/// (Llama-3.2-3B, Qwen3-4B), in rounds with groups of four sources (Qwen3-8B) and of three
/// with up-gate's input in one trip (Qwen2.5-7B, Llama-3.1-8B). Only a GPU with these shapes
/// would compile them otherwise.
#[test]
fn megakernel_compiles_for_the_wider_presets() {
    require_nvrtc();
    for name in [
        "llama-3.2-3b",
        "qwen3-4b",
        "qwen3-8b",
        "qwen2.5-7b",
        "llama-3.1-8b",
    ] {
        let (defines, chunks) = preset_kernel_defines(name, false);
        let what = format!(" ({name}, {chunks} k-chunks)");
        assert_compiles("megakernel", &sources::megakernel(), &defines, &what);
    }
}

/// The kernel variant sampled launches run with the draw inside the launch (`MK_SAMPLING=1`,
/// ops/sample.cuh), which only a sampled GPU run would compile otherwise: the default model's
/// shape, Llama-1B's vocabulary and a wider preset.
#[test]
fn megakernel_sampled_variant_compiles() {
    require_nvrtc();
    for name in ["smollm2-135m", "llama-3.2-1b", "qwen3-4b"] {
        let (defines, _) = preset_kernel_defines(name, true);
        let what = format!(" ({name}, MK_SAMPLING=1)");
        assert_compiles("megakernel", &sources::megakernel(), &defines, &what);
    }
    // With the draw's stamps and phases, drawing twice (for measuring).
    let (mut defines, _) = preset_kernel_defines("smollm2-135m", true);
    defines.push("-DMK_SMP_STAMPS=2".to_string());
    defines.push("-DMK_SMP_WARM=1".to_string());
    assert_compiles(
        "megakernel",
        &sources::megakernel(),
        &defines,
        " (smollm2-135m, MK_SAMPLING=1 MK_SMP_STAMPS=2 MK_SMP_WARM=1)",
    );
}

/// Compiles the megakernel for each preset of `names` with `extra` added to the options `run`
/// and `bench` use (`preset_kernel_defines`).
fn assert_preset_variants_compile(names: &[&str], extra: &[&str]) {
    for name in names {
        let (mut defines, _) = preset_kernel_defines(name, false);
        defines.extend(extra.iter().map(|d| d.to_string()));
        let what = format!(" ({name}, {})", extra.join(" "));
        assert_compiles("megakernel", &sources::megakernel(), &defines, &what);
    }
}

/// Every preset's kernels as `run` and `bench` compile them (`kernel_variants`, the host's own
/// choice per context bucket: attention by rounds or warps, the short parts spread, the
/// split-KV kernels with their tensor-core blocks and K/V limits) for sequences up to the
/// model's context or 128K, on an H200's shape (132 SMs, 227 KiB a block, fast memory: the
/// weights' whole ring). The other tests take variants by hand; this one compiles what the
/// GPU would run.
#[test]
fn every_presets_kernels_compile_as_the_host_chooses_them() {
    use megainfer::gpu::megakernel::{
        kernel_defines, kernel_variants, megakernel_gpu_shape, split_at_kv_bound,
    };
    require_nvrtc();
    let mut options = Vec::new();
    let mut what = Vec::new();
    for name in presets::NAMES {
        let cfg = presets::by_name(name).unwrap();
        let max_seq = cfg.max_position_embeddings.min(131_072);
        let shape = megakernel_gpu_shape(&cfg, 132, 232_448);
        let model = megainfer::reference::sliced::shape_of(&cfg);
        let cost = scheduler::CostModel::megakernel(max_seq);
        let buckets =
            scheduler::plan_buckets(&model, &shape, &cost, &Default::default(), max_seq).unwrap();
        let list = split_at_kv_bound(buckets.iter().map(|b| (b.upto, &b.schedule)));
        let plan =
            kernel_variants(&cfg, Default::default(), &list, 232_448, true, true, false).unwrap();
        assert_eq!(plan.bucket_kernel.len(), list.len(), "{name}");
        // Every preset's context reaches split-KV buckets, which run a kernel by warps without
        // the short parts' spread.
        assert!(
            plan.specs.iter().any(|s| s.attn_by_warps && !s.attn_spread),
            "{name}: no split-KV kernel by warps among {:?}",
            plan.specs
        );
        for (i, spec) in plan.specs.iter().enumerate() {
            options.push(kernel_defines(&cfg, spec, ""));
            what.push(format!("{name} variant {i}: {spec:?}"));
        }
    }
    // Two at a time: NVRTC takes 10-20 s and several hundred MB a kernel, CI has 2 cores.
    let src = sources::megakernel();
    for (options, what) in options.chunks(2).zip(what.chunks(2)) {
        let cubins = compile::compile_cubins("megakernel", &src, "sm_90a", options);
        for (cubin, what) in cubins.unwrap().iter().zip(what) {
            assert_eq!(
                &cubin[..4],
                b"\x7fELF",
                "NVRTC output is not a CUBIN ({what})"
            );
        }
    }
    println!("{} kernels compiled", what.len());
}

/// The kernels fast memory (an H200) runs, the weights' whole ring in flight
/// (`MK_WEIGHTS_WHOLE_RING=1`, `KernelSpec::whole_ring`), which only such a GPU would compile
/// otherwise: a model with a streaming bound and one without (Llama-3.2-3B); Llama-1B's with
/// the L2 prefetch of first tiles the host adds there (`MK_L2_PF_NEXT=8`).
#[test]
fn megakernel_whole_ring_variant_compiles() {
    require_nvrtc();
    assert_preset_variants_compile(&["llama-3.2-3b"], &["-DMK_WEIGHTS_WHOLE_RING=1"]);
    assert_preset_variants_compile(
        &["llama-3.2-1b"],
        &["-DMK_WEIGHTS_WHOLE_RING=1", "-DMK_L2_PF_NEXT=8"],
    );
}

/// bf16 rows on the tensor cores (`MK_MMA=1`): the shapes whose rows take it (Llama-1B's
/// 2048- and 4096-column rows, the 3B's 3072, the 8B's 4096 and 3584, Qwen3-0.6B's 1024 and
/// 3072) and one whose hidden size does not (SmolLM2's 576: only its 1536-column rows).
#[test]
fn megakernel_mma_variant_compiles() {
    require_nvrtc();
    assert_preset_variants_compile(
        &[
            "llama-3.2-1b",
            "llama-3.2-3b",
            "llama-3.1-8b",
            "qwen3-0.6b",
            "smollm2-135m",
        ],
        &["-DMK_MMA=1"],
    );
}

/// Attention's by-warps blocks on the tensor cores (`MK_ATT_MMA=1`): SmolLM2's and Llama-1B's
/// kernels as the split-KV buckets get them (by warps, no short parts spread); and the values
/// transposed (`MK_ATT_MMA=2`), which the head_dim-128 split-KV kernels with groups of 3 or 4
/// heads get (the 3B, the 8B), at head_dim 64 and with groups of 2 (Qwen3-0.6B) for measuring.
#[test]
fn megakernel_attention_mma_variant_compiles() {
    require_nvrtc();
    for (mma, presets) in [
        ("-DMK_ATT_MMA=1", &["smollm2-135m", "llama-3.2-1b"][..]),
        (
            "-DMK_ATT_MMA=2",
            &[
                "smollm2-135m",
                "llama-3.2-1b",
                "llama-3.2-3b",
                "llama-3.1-8b",
                "qwen3-0.6b",
            ][..],
        ),
    ] {
        assert_preset_variants_compile(
            presets,
            &["-DMK_ATT_BY_WARPS=1", "-DMK_ATT_SPREAD_MAX=0", mma],
        );
    }
}

/// The megakernel variants kept for measuring (`MEGAINFER_MK_DEFINES`, gpu-check.sh's
/// BENCH=defines): with the loader's per-tile progress word, attention's part range divided
/// in 64 bits, with the consumers' tiles and post stage notes, the split-KV merge's first
/// values read in its loop with 16 values in flight, the O projection's one round trip, the
/// tiles' own stamps with the dot products left out, attention's loader stamps; with attention
/// by rounds and by warps;
/// and the prepare's stamps with only the O projection's dot products left out and the
/// split-KV merge not waiting for its parts and the loader's own limit while the consumers
/// are in attention; the loader's L2 prefetch of an instruction's first tiles; attention's
/// page stamps with the blocks after each warp's first tile left out, and with the loader's
/// issue of the last page, and with warp 0's start of that page's wait, its first tile computed
/// twice and the V rows read at spread pieces.
#[test]
fn megakernel_measuring_variants_compile() {
    require_nvrtc();
    let (mut defines, _) = preset_kernel_defines("smollm2-135m", false);
    defines.extend(
        [
            "-DMK_TILE_NOTES=1",
            "-DMK_ATT_RANGE32=0",
            "-DMK_STAGE_NOTES=1",
            "-DMK_RED_HOIST=0",
            "-DMK_RED_BATCH=16",
            "-DMK_OPROJ_ONE_TRIP=1",
            "-DMK_TILE_STAMPS=1",
            "-DMK_TILE_SKIP_DOT=1",
            "-DMK_ATT_LOADER_STAMPS=1",
            "-DMK_HOLD_NEXT=2",
        ]
        .map(String::from),
    );
    for by_warps in ["-DMK_ATT_BY_WARPS=0", "-DMK_ATT_BY_WARPS=1"] {
        let mut d = defines.clone();
        d.push(by_warps.to_string());
        let what = format!(
            " (MK_TILE_NOTES=1 MK_ATT_RANGE32=0 MK_STAGE_NOTES=1 MK_RED_HOIST=0 MK_RED_BATCH=16 MK_OPROJ_ONE_TRIP=1 MK_TILE_STAMPS=1 MK_TILE_SKIP_DOT=1 MK_ATT_LOADER_STAMPS=1 {by_warps})"
        );
        assert_compiles("megakernel", &sources::megakernel(), &d, &what);
    }
    // The prepare's stamps share the profile words with the tiles' stamps: one or the other;
    // here with the O projection's dot products left out and the merge not waiting.
    let (mut d, _) = preset_kernel_defines("smollm2-135m", false);
    d.push("-DMK_PREP_STAMPS=1".to_string());
    d.push("-DMK_TILE_SKIP_DOT=2".to_string());
    d.push("-DMK_RED_NO_WAIT=1".to_string());
    assert_compiles(
        "megakernel",
        &sources::megakernel(),
        &d,
        " (MK_PREP_STAMPS=1 MK_TILE_SKIP_DOT=2 MK_RED_NO_WAIT=1)",
    );
    // The loader asking L2 for an instruction's first tiles while the ring is full, on bf16
    // rows (copied whole) and on Q8_0 rows (their quants and scales copied apart); no waits for
    // inputs, or none in one op's instructions; page waits that poll instead of suspending.
    let bf16 = |name| preset_kernel_defines(name, false).0;
    for (mut d, what, define) in [
        (bf16("llama-3.2-1b"), "llama-3.2-1b", "MK_L2_PF_NEXT=8"),
        (
            quantised_kernel_defines("llama-3.2-1b", all_formats(1)),
            "llama-3.2-1b Q8_0",
            "MK_L2_PF_NEXT=8",
        ),
        (bf16("llama-3.2-1b"), "llama-3.2-1b", "MK_NO_DEPS=1"),
        (
            bf16("llama-3.2-1b"),
            "llama-3.2-1b",
            "MK_NO_DEPS_OPS=(1<<OP_QKV)",
        ),
        (bf16("llama-3.2-1b"), "llama-3.2-1b", "MK_PAGE_SPIN=1"),
        (bf16("llama-3.2-1b"), "llama-3.2-1b", "MK_PAGE_SPIN=3"),
    ] {
        d.push(format!("-D{define}"));
        let what = format!(" ({what}, {define})");
        assert_compiles("megakernel", &sources::megakernel(), &d, &what);
    }
    // Attention's page stamps, in the kernel the split-KV buckets get, with the blocks after
    // each warp's first tile left out; and with the loader's issue of the last page waited for.
    assert_preset_variants_compile(
        &["smollm2-135m"],
        &[
            "-DMK_ATT_BY_WARPS=1",
            "-DMK_ATT_SPREAD_MAX=0",
            "-DMK_ATT_MMA=1",
            "-DMK_ATT_PAGE_STAMPS=1",
            "-DMK_ATT_SKIP_BLOCKS=1",
        ],
    );
    assert_preset_variants_compile(
        &["smollm2-135m"],
        &[
            "-DMK_ATT_BY_WARPS=1",
            "-DMK_ATT_SPREAD_MAX=0",
            "-DMK_ATT_MMA=1",
            "-DMK_ATT_PAGE_STAMPS=2",
        ],
    );
    assert_preset_variants_compile(
        &["smollm2-135m"],
        &[
            "-DMK_ATT_BY_WARPS=1",
            "-DMK_ATT_SPREAD_MAX=0",
            "-DMK_ATT_MMA=1",
            "-DMK_ATT_PAGE_STAMPS=3",
            "-DMK_ATT_TWICE=1",
            "-DMK_ATT_V_SPREAD=1",
        ],
    );
}

/// Every kind of matrix in format `t` (quant.cu's `WEIGHT_*` code).
fn all_formats(t: i32) -> sources::MatrixFormats {
    sources::MatrixFormats {
        qkv: t,
        o: t,
        gate_up: t,
        down: t,
        lm_head: t,
        embed: t,
        mixed: 0,
    }
}

/// The megakernel's options for preset `preset` with its matrices in `formats`, attention by
/// warps.
fn quantised_kernel_defines(preset: &str, formats: sources::MatrixFormats) -> Vec<String> {
    let cfg = presets::by_name(preset).unwrap();
    let mut defines = sources::megakernel_defines(&cfg, 0);
    defines.extend(formats.defines());
    defines.push("-DMK_ATT_BY_WARPS=1".into());
    defines
}

/// The options `run` and `bench` compile the megakernel with for preset `name` (bf16) on an
/// H100's schedule (a 64-position context: one query head an attention instruction), attention
/// by rounds (`kernel_variants` with by-warps switched off, as `MEGAINFER_MK_ATT_BY_WARPS=0`
/// has it; the ring planned for the bucket's attention instructions, as by default), and the
/// schedule's k-chunk count.
fn preset_kernel_defines(name: &str, sampled: bool) -> (Vec<String>, usize) {
    use megainfer::gpu::megakernel::{
        kernel_defines, kernel_variants, megakernel_gpu_shape, megakernel_schedule, KernelSpec,
    };
    let cfg = presets::by_name(name).unwrap();
    let shape = megakernel_gpu_shape(&cfg, 132, 232_448);
    let cost = scheduler::CostModel::megakernel(64);
    let sched = megakernel_schedule(&cfg, &shape, &cost, &Default::default()).unwrap();
    let plan = kernel_variants(
        &cfg,
        Default::default(),
        &[(usize::MAX, &sched)],
        232_448,
        false,
        false,
        true,
    )
    .unwrap();
    let spec = KernelSpec {
        sampled,
        ..plan.specs[0]
    };
    (kernel_defines(&cfg, &spec, ""), sched.options.down_chunks)
}

/// The megakernel as compute-sanitizer's racecheck runs it (scripts/gpu-check.sh, SANITIZE=1):
/// the current-instruction word as atomics, every reader's own page release, line numbers.
#[test]
fn megakernel_compiles_for_racecheck() {
    require_nvrtc();
    for (hd, group, by_warps) in [(64, 3, 1), (64, 3, 0), (128, 2, 1), (128, 3, 1)] {
        let mut cfg = presets::by_name("smollm2-135m").unwrap();
        cfg.head_dim = hd;
        cfg.num_kv_heads = 1;
        cfg.num_heads = group;
        let mut defines = sources::megakernel_defines(&cfg, 0);
        defines.push(format!("-DMK_ATT_BY_WARPS={by_warps}"));
        defines
            .extend(["-lineinfo", "-DMK_INSTR_ATOMIC=1", "-DMK_LANE_ARRIVALS=1"].map(String::from));
        let what = format!(" (racecheck build, head_dim {hd}, MK_ATT_BY_WARPS={by_warps})");
        assert_compiles("megakernel", &sources::megakernel(), &defines, &what);
    }
}

/// The megakernel for quantised matrices: each format everywhere, and the default model's mix
/// (Q4_1 layers, a Q8_0 embedding tied to the LM head), for both hidden sizes that keep x in
/// registers and a down projection whose rows are read with x from shared memory.
#[test]
fn megakernel_compiles_for_quantised_formats() {
    require_nvrtc();
    let all = all_formats;
    let default_model = sources::MatrixFormats {
        lm_head: 1,
        embed: 1,
        ..all(3)
    };
    for (preset, formats) in [
        ("smollm2-135m", all(1)),
        ("smollm2-135m", all(2)),
        ("smollm2-135m", default_model),
        ("llama-3.2-1b", all(1)),
        ("llama-3.2-1b", all(3)),
        // A K-quant mix as the megakernel gets it: q/k/v and down widened, the rest Q4_1.
        (
            "llama-3.2-1b",
            sources::MatrixFormats {
                qkv: 0,
                down: 0,
                ..all(3)
            },
        ),
        // The same read as stored: bf16, Q8_0 and Q4_1 layers within the kinds.
        (
            "llama-3.2-1b",
            sources::MatrixFormats {
                mixed: 0b1011,
                ..all(3)
            },
        ),
        (
            "smollm2-135m",
            sources::MatrixFormats {
                mixed: 0b0101,
                ..all(2)
            },
        ),
        // Q6_K everywhere, on rows decoded to f32 (SmolLM2) and on block lanes (the 3B's).
        ("smollm2-135m", all(4)),
        ("llama-3.2-1b", all(4)),
        ("llama-3.2-3b", all(4)),
        // A Q4_K_M file as the megakernel gets it: Q4_K as Q4_1, some layers' V and down in
        // Q6_K, the LM head (tied to the embedding) Q6_K.
        (
            "llama-3.2-1b",
            sources::MatrixFormats {
                mixed: 0b11000,
                lm_head: 4,
                embed: 4,
                ..all(3)
            },
        ),
    ] {
        let defines = quantised_kernel_defines(preset, formats);
        let what = format!(" ({preset}, {formats:?})");
        assert_compiles("megakernel", &sources::megakernel(), &defines, &what);
    }
}

/// Kernels compiled on several threads at once (the megakernel's variants are) are the ones
/// compiled one at a time: the quant unit with two sets of options, each with a define of a
/// value no earlier compile used (so none comes from the disk cache) and that the code does
/// not read (so it changes nothing).
#[test]
fn compiles_on_several_threads_match_one_at_a_time() {
    require_nvrtc();
    let nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let sets = |k: u32| {
        vec![
            vec![format!("-DMEGAINFER_TEST_NONCE={nonce}{k}")],
            vec![
                format!("-DMEGAINFER_TEST_NONCE={nonce}{}", k + 1),
                "-DQ_HAS_Q6K=0".to_string(),
            ],
        ]
    };
    let together = compile::compile_cubins("quant", &sources::quant(), "sm_90a", &sets(0)).unwrap();
    assert_ne!(
        together[0], together[1],
        "the two option sets make different code"
    );
    for (i, options) in sets(2).iter().enumerate() {
        let alone = compile::compile_cubin("quant", &sources::quant(), "sm_90a", options).unwrap();
        assert_eq!(alone, together[i], "option set {i}");
    }
}

#[test]
fn nvrtc_errors_carry_the_compiler_log() {
    require_nvrtc();
    let err = compile::compile_cubin(
        "broken",
        "extern \"C\" __global__ void k() { int x = ; }",
        "sm_90a",
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("NVRTC failed to compile broken"), "{err}");
    assert!(err.contains("expected an expression"), "{err}");
}

/// The host's layout checks are compiled in: a CUDA `MkParams` that differs from the host's
/// (two fields swapped) or an attention scratch the host sizes differently fails to compile,
/// naming what differs.
#[test]
fn abi_mismatches_are_compile_errors() {
    require_nvrtc();
    let cfg = presets::by_name("smollm2-135m").unwrap();
    let defines = sources::megakernel_defines(&cfg, 0);
    let src = sources::megakernel();
    let fields = "    float eps;\n    u32 epoch;\n";
    assert!(
        src.contains(fields),
        "MkParams' eps and epoch moved; update this test"
    );
    // A field the host lacks changes the struct's size: caught by every NVRTC.
    let grown = src.replace(
        fields,
        "    float eps;\n    u32 epoch;\n    u32 extra[2];\n",
    );
    let err = compile::compile_cubin("mk_grown", &grown, "sm_90a", &defines)
        .unwrap_err()
        .to_string();
    assert!(err.contains("MkParams: the host's struct is"), "{err}");
    // Two fields swapped keep the size; the offsets need a constant __builtin_offsetof, which
    // NVRTC has from 13.5 on (the test command's version; see abi::checks).
    let version = compile::nvrtc_version().unwrap();
    if version >= (13, 5) {
        let swapped = src.replace(fields, "    u32 epoch;\n    float eps;\n");
        let err = compile::compile_cubin("mk_swapped", &swapped, "sm_90a", &defines)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("MkParams.eps: the host has it at byte"),
            "{err}"
        );
    } else {
        println!("NVRTC {version:?}: field offsets are not checked by this compiler (sizes are)");
    }

    let wrong: Vec<String> = defines
        .iter()
        .map(|d| {
            if d.starts_with("-DMK_ATT_SCRATCH_FLOATS=") {
                "-DMK_ATT_SCRATCH_FLOATS=1".to_string()
            } else {
                d.clone()
            }
        })
        .collect();
    let err = compile::compile_cubin("mk_scratch", &src, "sm_90a", &wrong)
        .unwrap_err()
        .to_string();
    assert!(err.contains("attention scratch"), "{err}");
}

#[test]
fn prefill_kernels_compile_for_sm90a() {
    require_nvrtc();
    assert_compiles("prefill", &megainfer::gpu::sources::prefill(), &[], "");
}

/// `megainfer schedule --compile-kernels h200` compiles, without a GPU, the kernels `run` and
/// `bench` would load into the cache MEGAINFER_CACHE names: for SmolLM2 at 8,192 positions
/// three megakernel variants (the short buckets' kernel, the 4K bucket's split-KV kernel and
/// the 4K-64K one with two K/V tiles in flight), each greedy and sampled (the draw inside the
/// launch), and the prefill, graph-path and sampler modules.
#[test]
fn schedule_compiles_the_kernels_ahead() {
    require_nvrtc();
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_megainfer"))
        .args(["schedule", "--preset", "smollm2-135m", "--context", "8192"])
        .args(["--compile-kernels", "h200"])
        .env("MEGAINFER_CACHE", dir.path())
        .env_remove("MEGAINFER_MK_DEFINES")
        .env_remove("MEGAINFER_MK_ATT_BY_WARPS")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains(
            "6 megakernel variants (greedy and sampled) and the prefill, graph-path and \
             sampler modules for an H200 compiled (sm_90a)"
        ),
        "{stdout}"
    );
    let mut cubins: Vec<String> = std::fs::read_dir(dir.path().join("kernels"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".cubin"))
        .map(|n| n.split('-').next().unwrap().to_string())
        .collect();
    cubins.sort();
    assert_eq!(
        cubins,
        [
            "baseline",
            "megakernel",
            "megakernel",
            "megakernel",
            "megakernel",
            "megakernel",
            "megakernel",
            "prefill",
            "sampling"
        ]
    );
}

//! Compiling the interpreter for a model and loading it.

use std::sync::Arc;

use anyhow::{bail, Context, Result};
use cudarc::driver::CudaModule;
use cudarc::nvrtc::Ptx;

use crate::gpu::compile::compile_cubins;
use crate::gpu::device::Gpu;
use crate::gpu::launch::Kernel;
use crate::gpu::sources;

/// What one megakernel binary is specialised on besides the model's dimensions: its matrices'
/// `formats`, the schedule's down-projection chunk width (`down_cols`, whose rows then get the
/// tiles' loop for a known length, as the model's dimensions do) and k-chunk count
/// (`down_chunks`), attention by warps (`attn_by_warps`) or by rounds, the draw inside the
/// launch (`sampled`) or the greedy argmax only, and RoPE's frequencies in shared memory
/// (`freq_in_smem`, where they cost no page of the ring: [`freq_table_fits`]), and the ring's
/// page count (`pages`: [`ring_pages`]).
#[derive(Clone, Copy, Debug)]
pub struct KernelSpec {
    pub formats: sources::MatrixFormats,
    pub down_cols: usize,
    pub down_chunks: usize,
    pub attn_by_warps: bool,
    /// Short attention parts spread over every warp (attention by warps only; off, the code is
    /// compiled out: MK_ATT_SPREAD_MAX=0).
    pub attn_spread: bool,
    /// The split-KV kernel of the buckets from 4K to 64K positions: its attention streams K/V
    /// tiles with 2 in flight, not the weights' limit (`MK_INFLIGHT_ATT_STREAM`, see `defines`
    /// and `kv_two_in_flight` in megakernel.rs).
    pub kv_two_in_flight: bool,
    /// Query heads an Attention instruction computes (the schedule's `attn_heads`; 0: the
    /// whole group of a KV head).
    pub attn_heads: usize,
    pub sampled: bool,
    pub freq_in_smem: bool,
    pub pages: usize,
    /// The loader keeps the whole ring in flight for the weights' tiles (`MK_WEIGHTS_WHOLE_RING`,
    /// megakernel/runtime.cuh), not 2 ahead and 4 while the consumers stream: chosen on fast
    /// memory (`Gpu::fast_memory`), where 2 ahead would fill the ring during a layer's chain
    /// of waits at about 2 tiles a memory latency, an estimate of half an SM's share of the
    /// bandwidth. Attention's K/V tiles keep their limits.
    pub whole_ring: bool,
}

/// Whether a bf16 model `hidden` wide gets, with the whole ring, the L2 prefetch of an
/// instruction's first tiles (`MK_L2_PF_NEXT`, see [`defines`]): 1024 to 2048 wide, and 4096.
/// Measured, not derived: the widths between (2560, 3072, 3584) were slower with it.
fn prefetches_first_tiles(hidden: usize) -> bool {
    (1024..=2048).contains(&hidden) || hidden == 4096
}
/// How many tiles it asks for.
const L2_PF_NEXT_TILES: usize = 8;

/// The bf16 models' widths whose whole-ring kernel holds a generation's next step to
/// `HOLD_NEXT_TILES` of its tiles in flight until the token it feeds is out (`MK_HOLD_NEXT`,
/// see [`defines`]).
fn holds_next_step(hidden: usize) -> bool {
    !(1024..4096).contains(&hidden)
}
const HOLD_NEXT_TILES: usize = 2;

/// Bytes of the kernel's static shared memory besides the frequency table: its flags and
/// words take 128 bytes once NVRTC has laid them out (every greedy and sampled kernel of the
/// presets on sm_90a, `cuobjdump --dump-resource-usage`), and a ring planned to its last byte
/// needs the true figure. The host checks the bound once the kernel is loaded.
pub(crate) const STATIC_SMEM_BOUND: usize = 128;

/// Whether RoPE's head_dim / 2 frequencies fit in shared memory beside a ring of as many pages
/// as without them (`xs_floats`: the plan's input vector). Qwen3-4B and Qwen3-8B have 112
/// bytes to spare on an H100: the 256-byte table took them from 12 pages to 8 (3.1608 ->
/// 3.3236 and 5.3530 -> 5.5206 ms a token, BENCHMARKS.md).
pub fn freq_table_fits(
    config: &crate::model::Config,
    max_smem_per_block: usize,
    xs_floats: usize,
) -> bool {
    let pages = |table| ring_pages(config, max_smem_per_block, xs_floats, table).ok();
    pages(true) == pages(false)
}

/// The ring's page count for a kernel compiled with (`freq_in_smem`) or without RoPE's
/// frequency table in shared memory: as many pages as fit beside the plan's regions and the
/// kernel's static shared memory, bounded by STATIC_SMEM_BOUND (the host checks the bound
/// once the kernel is loaded). The kernel is compiled for this count (`MK_PAGES`), so that a
/// tile's page and phase are a multiply and shifts rather than a division.
pub fn ring_pages(
    config: &crate::model::Config,
    max_smem_per_block: usize,
    xs_floats: usize,
    freq_in_smem: bool,
) -> Result<usize> {
    let table = if freq_in_smem {
        4 * config.head_dim / 2
    } else {
        0
    };
    let plan = super::layout::SmemLayout::plan(
        max_smem_per_block,
        STATIC_SMEM_BOUND + table,
        xs_floats,
        config.num_layers,
    )?;
    Ok(plan.pages)
}

/// The NVRTC options the megakernel is compiled with for `config` and `spec`. `extra`: further
/// options for measuring variants (`MEGAINFER_MK_DEFINES`, e.g. `-DMK_INFLIGHT_STREAM=3`),
/// added last; an MK_ATT_BY_WARPS or MK_INFLIGHT_STREAM among them replaces the choice, as does
/// an MK_INFLIGHT or MK_WEIGHTS_WHOLE_RING that of the whole ring (and
/// `-UMK_PAGES` compiles the ring's size as a parameter read at run time).
pub fn defines(config: &crate::model::Config, spec: &KernelSpec, extra: &str) -> Vec<String> {
    let mut defines = sources::megakernel_defines(config, spec.attn_heads);
    defines.extend(spec.formats.defines());
    // The draw inside the launch (ops/sample.cuh) is compiled only into the kernel that
    // sampled launches run: its calls cost the greedy kernel's loop spilled registers.
    defines.push(format!("-DMK_SAMPLING={}", u8::from(spec.sampled)));
    defines.push(format!("-DMK_FREQ_SMEM={}", u8::from(spec.freq_in_smem)));
    defines.push(format!("-DMK_PAGES={}", spec.pages));
    if spec.down_cols != config.hidden_size && spec.down_cols != config.q_dim() {
        defines.push(format!("-DMK_DOWN_COLS={}", spec.down_cols));
    }
    // The residual entering a layer is read from as many partial sums (ops/model.cuh sizes its
    // loads in flight by them).
    defines.push(format!("-DMK_DOWN_CHUNKS={}", spec.down_chunks));
    if !extra.contains("MK_ATT_BY_WARPS") {
        defines.push(format!(
            "-DMK_ATT_BY_WARPS={}",
            u8::from(spec.attn_by_warps)
        ));
    }
    if !spec.attn_spread && !extra.contains("MK_ATT_SPREAD_MAX") {
        defines.push("-DMK_ATT_SPREAD_MAX=0".to_string());
    }
    // The split-KV kernels (no short parts spread) compute attention's blocks on the tensor
    // cores (megakernel/ops/attention.cuh): at head_dim 64 `AttnMma` (=1), where one head group
    // covers an instruction's query heads (`att_mma`, so Qwen2.5-0.5B's groups of 7, computed
    // by rounds, compile as before); at head_dim 128 `AttnMmaT` (=2, the values transposed),
    // for groups of 3 or 4 heads. Measured on the H200 against the CUDA-core blocks
    // (BENCHMARKS.md, 2026-11-28): =1 Llama-3.2-1B 5.4% faster at 1,900 positions, 6.6% at 8K,
    // 8.5% at 32K, 14.3% at 128K, SmolLM2 2.0% at 8K; =2 Llama-3.2-3B (groups of 3) 2.6% faster
    // at 8K and 2.2% at 32K, Qwen3-4B (4) 0.8% and Qwen3-8B (4) 1.0% at 8K, but Qwen3-0.6B (2)
    // 6.8% and Qwen3-1.7B (2) 1.6% slower at 8K (likely because an mma does the same work for 2
    // heads as for 4 while the CUDA cores' work halves; not profiled), so groups of 2 keep the
    // CUDA cores, as do Qwen2.5-7B's 7. At head_dim 64 =2 was within 0.8% of =1 either way
    // (0.7% faster at 8K and 128K on Llama-1B, 0.6% slower at 32K, SmolLM2 0.8% slower), so =1
    // stays there. In the short contexts' kernel, whose short parts are spread over every warp,
    // =1 made SmolLM2 4.1% and Llama-1B 1.9% slower, so that kernel keeps the CUDA cores.
    let group = sources::instruction_heads(config, spec.attn_heads);
    let mma = match config.head_dim {
        64 => Some(1),
        128 if (3..=4).contains(&group) => Some(2),
        _ => None,
    };
    if let Some(mma) =
        mma.filter(|_| spec.attn_by_warps && !spec.attn_spread && !extra.contains("MK_ATT_MMA"))
    {
        defines.push(format!("-DMK_ATT_MMA={mma}"));
    }
    if !extra.contains("MK_INFLIGHT_STREAM") {
        defines.extend(sources::stream_bound(config, &spec.formats));
    }
    // Measured on the H200 against the bounded loader (BENCHMARKS.md, 2026-11-28): Llama-3.2-3B
    // 4.8% faster, Qwen3-4B 6.3%, Llama-1B Q8_0 5.9% (Q4_0 2.5%), Llama-3.1-8B 1.8%; Llama-1B
    // bf16 and Qwen3-0.6B 0.6% slower, SmolLM2 level. On the H100 it was 4-11% slower on
    // Llama-1B, Qwen3-1.7B and Qwen3-4B (faster on the 3B alone), hence fast memory only.
    let weights_limit = extra.split_whitespace().any(|d| {
        [
            "-DMK_INFLIGHT=",
            "-DMK_INFLIGHT_STREAM=",
            "-DMK_WEIGHTS_WHOLE_RING",
        ]
        .iter()
        .any(|n| d.starts_with(n))
    });
    if spec.whole_ring && !weights_limit {
        defines.push("-DMK_WEIGHTS_WHOLE_RING=1".to_string());
        // With the whole ring, the loader asks L2 for an instruction's first 8 tiles when it
        // reaches them with the ring full (megakernel/loader.cuh), on bf16 models 1024 to 2048
        // and 4096 wide. Measured on the H200 (BENCHMARKS.md, 2026-11-28 and -29): Llama-3.2-1B
        // 3.0-3.8% faster (three rounds), Qwen3-1.7B 0.9-1.5%, Qwen3-0.6B 0.2-0.7%, Qwen3-8B
        // 1.0% and Llama-3.1-8B 0.7% (two rounds each); narrower, SmolLM2 level and
        // Qwen2.5-0.5B 0.6% slower (one round); between, Qwen3-4B 1.2%, Llama-3.2-3B 2.7% and
        // Qwen2.5-7B 2.5% slower; Llama-1B Q8_0 1.1% slower.
        if prefetches_first_tiles(config.hidden_size)
            && spec.formats == sources::MatrixFormats::default()
            && !extra.contains("MK_L2_PF_NEXT")
        {
            defines.push(format!("-DMK_L2_PF_NEXT={L2_PF_NEXT_TILES}"));
        }
        // In a generation, the next step's tiles held to 2 in flight until the token it feeds
        // is out (megakernel/loader.cuh), so that the round trips that hand the token over (and
        // a draw's inside the launch) do not queue behind a whole ring of the next step's
        // weights on every SM, and the SMs that finished the LM head first leave the bandwidth
        // to those still streaming it. Measured on the H200 (BENCHMARKS.md, 2026-11-29), greedy
        // generations: SmolLM2 0.1-0.5% faster (top-p drawn inside the launch 0.9-1.1%),
        // Qwen2.5-0.5B level, Llama-3.1-8B 0.8-1.3% and Qwen3-8B 0.3% faster; between them the
        // next step's first instruction needs more of its tiles at hand: Qwen3-0.6B 0.5%
        // slower, Llama-3.2-1B level, Qwen3-4B 0.9% and Llama-3.2-3B 2.0% slower. Quantised
        // weights keep the whole ring: the default model (SmolLM2 Q4_1 from its GGUF) was 1.3%
        // slower with it, though SmolLM2's shape quantised to Q4_1 by `bench` was 1.0% faster
        // (not profiled), and Llama-1B Q4_0 0.9% slower.
        if holds_next_step(config.hidden_size)
            && spec.formats == sources::MatrixFormats::default()
            && !extra.contains("MK_HOLD_NEXT")
        {
            defines.push(format!("-DMK_HOLD_NEXT={HOLD_NEXT_TILES}"));
        }
    }
    // Split-KV parts from 4K to 64K positions stream their K/V tiles with 2 in flight instead of
    // the weights' limit (measured on the H100: BENCHMARKS.md, 2026-11-28; 1 was 7% slower at
    // 32K, 3 gained at 32K only).
    if spec.kv_two_in_flight && !extra.contains("MK_INFLIGHT_ATT_STREAM") {
        defines.push("-DMK_INFLIGHT_ATT_STREAM=2".to_string());
    }
    defines.extend(extra.split_whitespace().map(String::from));
    defines
}

/// The megakernel for each of `specs`, compiled (or taken from the disk cache) for `arch`
/// with [`defines`] and `MEGAINFER_MK_DEFINES` as the extra options, in order. The compiles
/// run in parallel: NVRTC takes 10-20 s for each variant on one core, and a path with split-KV
/// buckets needs two or three.
pub(super) fn compile_all(
    config: &crate::model::Config,
    specs: &[KernelSpec],
    arch: &str,
) -> Result<Vec<Vec<u8>>> {
    let extra = std::env::var("MEGAINFER_MK_DEFINES").unwrap_or_default();
    if extra.contains("-DMK_PAGES") {
        bail!(
            "MEGAINFER_MK_DEFINES sets MK_PAGES, which the host derives from its shared-memory plan ({} pages here); -UMK_PAGES compiles the page count as a launch parameter instead",
            specs.first().map_or(0, |s| s.pages)
        );
    }
    let options: Vec<Vec<String>> = specs.iter().map(|s| defines(config, s, &extra)).collect();
    compile_cubins("megakernel", &sources::megakernel(), arch, &options)
}

/// [`compile_all`] for `gpu`'s architecture, each CUBIN then loaded on it.
pub(super) fn load_all(
    gpu: &Gpu,
    config: &crate::model::Config,
    specs: &[KernelSpec],
) -> Result<Vec<(Arc<CudaModule>, Kernel)>> {
    compile_all(config, specs, &gpu.arch())?
        .into_iter()
        .map(|cubin| {
            let module = gpu
                .ctx
                .load_module(Ptx::from_binary(cubin))
                .context("loading the megakernel CUBIN")?;
            let kernel = Kernel::load(&module, "megakernel")?;
            Ok((module, kernel))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::{defines, KernelSpec};

    /// On an H100 the frequency table fits beside the ring of every preset but Qwen3-4B and
    /// Qwen3-8B, whose 12 pages leave 112 bytes (the Llama-3.2-1B plan measured 1,552).
    #[test]
    fn frequency_table_only_where_it_costs_no_page() {
        use crate::model::presets;
        for name in presets::NAMES {
            let c = presets::by_name(name).unwrap();
            let xs = crate::gpu::megakernel::widest_xs_floats(&c);
            let fits = super::freq_table_fits(&c, 232_448, xs);
            assert_eq!(fits, !matches!(*name, "qwen3-4b" | "qwen3-8b"), "{name}");
        }
    }

    /// The ring each preset's kernel is compiled for on an H100 is the one its schedule was
    /// planned with.
    #[test]
    fn the_compiled_ring_is_the_scheduled_one() {
        use crate::model::presets;
        for name in presets::NAMES {
            let c = presets::by_name(name).unwrap();
            let xs = crate::gpu::megakernel::widest_xs_floats(&c);
            let fits = super::freq_table_fits(&c, 232_448, xs);
            let pages = super::ring_pages(&c, 232_448, xs, fits).unwrap();
            let shape = crate::gpu::megakernel::megakernel_gpu_shape(&c, 132, 232_448);
            assert_eq!(pages, shape.smem_pages, "{name}");
            assert!(pages >= 8 && pages.is_multiple_of(4), "{name}: {pages}");
        }
    }

    /// Every matrix kind in the format of `code` (1 Q8_0, 3 Q4_1, …).
    fn uniform_formats(code: i32) -> crate::gpu::sources::MatrixFormats {
        crate::gpu::sources::MatrixFormats {
            qkv: code,
            o: code,
            gate_up: code,
            down: code,
            lm_head: code,
            embed: code,
            mixed: 0,
        }
    }

    /// The options of `d` that start with `name`.
    fn options_named(d: &[String], name: &str) -> Vec<String> {
        d.iter().filter(|x| x.starts_with(name)).cloned().collect()
    }

    /// A greedy kernel with the weights' whole ring in flight.
    fn whole_ring_spec() -> KernelSpec {
        KernelSpec {
            whole_ring: true,
            ..spec(false)
        }
    }

    fn spec(sampled: bool) -> KernelSpec {
        KernelSpec {
            formats: Default::default(),
            down_cols: 1536,
            down_chunks: 1,
            attn_by_warps: true,
            attn_spread: true,
            kv_two_in_flight: false,
            attn_heads: 0,
            sampled,
            freq_in_smem: true,
            pages: 12,
            whole_ring: false,
        }
    }

    #[test]
    fn the_spec_reaches_the_options_and_extras_replace_the_choices() {
        let cfg = crate::model::presets::by_name("smollm2-135m").unwrap();
        let d = defines(&cfg, &spec(false), "");
        for want in [
            "-DMK_SAMPLING=0",
            "-DMK_DOWN_CHUNKS=1",
            "-DMK_ATT_BY_WARPS=1",
            "-DMK_PAGES=12",
        ] {
            assert!(d.iter().any(|x| x == want), "{want} missing from {d:?}");
        }
        // A chunk width the model's dimensions do not already give is passed; hidden (576) is not.
        assert!(d.iter().any(|x| x == "-DMK_DOWN_COLS=1536"));
        let hidden_wide = KernelSpec {
            down_cols: 576,
            ..spec(false)
        };
        let d = defines(&cfg, &hidden_wide, "");
        assert!(!d.iter().any(|x| x.starts_with("-DMK_DOWN_COLS")));
        // SmolLM2's 3 query heads a KV head, computed whole or one an instruction.
        assert!(d.iter().any(|x| x == "-DMK_GROUP=3"));
        let one_head = KernelSpec {
            attn_heads: 1,
            ..spec(false)
        };
        let d = defines(&cfg, &one_head, "");
        for want in ["-DMK_GROUP=1", "-DMK_KV_GROUP=3"] {
            assert!(d.iter().any(|x| x == want), "{want} missing from {d:?}");
        }
        let d = defines(
            &cfg,
            &spec(true),
            "-DMK_ATT_BY_WARPS=0 -DMK_INFLIGHT_STREAM=3",
        );
        assert!(d.iter().any(|x| x == "-DMK_SAMPLING=1"));
        assert_eq!(
            d.iter()
                .filter(|x| x.starts_with("-DMK_ATT_BY_WARPS"))
                .count(),
            1
        );
        assert_eq!(d.last().map(String::as_str), Some("-DMK_INFLIGHT_STREAM=3"));
        assert_eq!(
            d.iter()
                .filter(|x| x.starts_with("-DMK_INFLIGHT_STREAM"))
                .count(),
            1
        );
    }

    /// Fast memory compiles the weights' whole ring in flight; an extra naming an in-flight
    /// limit replaces the choice (so the bounded kernel stays measurable there).
    #[test]
    fn the_whole_ring_on_fast_memory_unless_an_extra_sets_a_limit() {
        let cfg = crate::model::presets::by_name("llama-3.2-1b").unwrap();
        let ring = |d: &[String]| d.iter().any(|x| x == "-DMK_WEIGHTS_WHOLE_RING=1");
        assert!(!ring(&defines(&cfg, &spec(false), "")));
        let fast = whole_ring_spec();
        assert!(ring(&defines(&cfg, &fast, "")));
        assert!(ring(&defines(&cfg, &fast, "-DMK_TILE_STAMPS=1")));
        assert!(!ring(&defines(&cfg, &fast, "-DMK_INFLIGHT=2")));
        assert!(!ring(&defines(&cfg, &fast, "-DMK_INFLIGHT_STREAM=4")));
        // Attention's own limits leave the weights' choice alone.
        assert!(ring(&defines(&cfg, &fast, "-DMK_INFLIGHT_ATT_STREAM=3")));
    }

    /// The next step held until its token (`MK_HOLD_NEXT`): with the whole ring, bf16 models
    /// below 1024 and from 4096 wide, not quantised ones; an extra replaces it.
    #[test]
    fn the_next_step_held_on_the_narrowest_and_widest_models_with_the_whole_ring() {
        let hold = |d: &[String]| options_named(d, "-DMK_HOLD_NEXT");
        let fast = whole_ring_spec();
        for (name, held) in [
            ("smollm2-135m", true),
            ("qwen2.5-0.5b", true),
            ("qwen3-0.6b", false),
            ("llama-3.2-1b", false),
            ("llama-3.2-3b", false),
            ("qwen3-4b", false),
            ("qwen2.5-7b", false),
            ("llama-3.1-8b", true),
            ("qwen3-8b", true),
        ] {
            let cfg = crate::model::presets::by_name(name).unwrap();
            let want: &[&str] = if held { &["-DMK_HOLD_NEXT=2"] } else { &[] };
            assert_eq!(hold(&defines(&cfg, &fast, "")), want, "{name}");
            assert!(hold(&defines(&cfg, &spec(false), "")).is_empty(), "{name}");
        }
        let cfg = crate::model::presets::by_name("smollm2-135m").unwrap();
        assert_eq!(
            hold(&defines(&cfg, &fast, "-DMK_HOLD_NEXT=0")),
            ["-DMK_HOLD_NEXT=0"]
        );
        assert!(hold(&defines(&cfg, &fast, "-DMK_INFLIGHT=2")).is_empty());
        let q4 = KernelSpec {
            formats: uniform_formats(3),
            ..fast
        };
        assert!(hold(&defines(&cfg, &q4, "")).is_empty());
    }

    /// The whole ring's L2 prefetch of an instruction's first tiles: bf16 models 1024 to 2048
    /// and 4096 wide, not the bounded loader, not quantised weights, not the widths between or
    /// SmolLM2; an extra replaces it.
    #[test]
    fn the_l2_prefetch_of_first_tiles_on_bf16_models_of_measured_widths_with_the_whole_ring() {
        let pf = |d: &[String]| options_named(d, "-DMK_L2_PF_NEXT");
        let fast = whole_ring_spec();
        for name in [
            "llama-3.2-1b",
            "qwen3-1.7b",
            "qwen3-0.6b",
            "llama-3.1-8b",
            "qwen3-8b",
        ] {
            let cfg = crate::model::presets::by_name(name).unwrap();
            assert_eq!(
                pf(&defines(&cfg, &fast, "")),
                ["-DMK_L2_PF_NEXT=8"],
                "{name}"
            );
            assert!(pf(&defines(&cfg, &spec(false), "")).is_empty(), "{name}");
        }
        let cfg = crate::model::presets::by_name("llama-3.2-1b").unwrap();
        assert!(pf(&defines(&cfg, &fast, "-DMK_INFLIGHT=2")).is_empty());
        assert_eq!(
            pf(&defines(&cfg, &fast, "-DMK_L2_PF_NEXT=4")),
            ["-DMK_L2_PF_NEXT=4"]
        );
        let q8 = KernelSpec {
            formats: uniform_formats(1),
            ..fast
        };
        assert!(pf(&defines(&cfg, &q8, "")).is_empty());
        for name in [
            "llama-3.2-3b",
            "qwen3-4b",
            "qwen2.5-7b",
            "smollm2-135m",
            "qwen2.5-0.5b",
        ] {
            let cfg = crate::model::presets::by_name(name).unwrap();
            assert!(pf(&defines(&cfg, &fast, "")).is_empty(), "{name}");
        }
    }

    /// Attention's blocks go to the tensor cores in the split-KV kernels computed by warps: at
    /// head_dim 64 as `AttnMma` (=1), at head_dim 128 with groups of 3 or 4 heads as `AttnMmaT`
    /// (=2); not in the short contexts' kernel, nor for Qwen3-0.6B's groups of 2 or Qwen2.5-7B's
    /// of 7; an extra replaces the choice.
    #[test]
    fn split_kv_kernels_take_the_tensor_cores() {
        let mma = |d: &[String]| options_named(d, "-DMK_ATT_MMA");
        let split = KernelSpec {
            attn_spread: false,
            ..spec(false)
        };
        for (name, chosen) in [
            ("llama-3.2-1b", "-DMK_ATT_MMA=1"),
            ("smollm2-135m", "-DMK_ATT_MMA=1"),
            ("llama-3.2-3b", "-DMK_ATT_MMA=2"),
            ("qwen3-4b", "-DMK_ATT_MMA=2"),
            ("qwen3-8b", "-DMK_ATT_MMA=2"),
            ("llama-3.1-8b", "-DMK_ATT_MMA=2"),
        ] {
            let cfg = crate::model::presets::by_name(name).unwrap();
            assert_eq!(mma(&defines(&cfg, &split, "")), [chosen], "{name}");
            assert!(mma(&defines(&cfg, &spec(false), "")).is_empty(), "{name}");
            assert_eq!(
                mma(&defines(&cfg, &split, "-DMK_ATT_MMA=0")),
                ["-DMK_ATT_MMA=0"],
                "{name}"
            );
        }
        let by_rounds = KernelSpec {
            attn_by_warps: false,
            ..split
        };
        for name in ["qwen2.5-0.5b", "llama-3.2-3b"] {
            let cfg = crate::model::presets::by_name(name).unwrap();
            assert!(mma(&defines(&cfg, &by_rounds, "")).is_empty(), "{name}");
        }
        for name in ["qwen3-0.6b", "qwen3-1.7b", "qwen2.5-7b"] {
            let cfg = crate::model::presets::by_name(name).unwrap();
            assert!(mma(&defines(&cfg, &split, "")).is_empty(), "{name}");
        }
    }

    /// The split-KV kernels of buckets up to 64K get attention's own in-flight limit; the others
    /// keep the default, and a measuring extra replaces the choice.
    #[test]
    fn split_kv_kernels_stream_their_kv_with_two_in_flight() {
        let cfg = crate::model::presets::by_name("llama-3.2-1b").unwrap();
        let att = |d: &[String]| options_named(d, "-DMK_INFLIGHT_ATT_STREAM");
        assert!(att(&defines(&cfg, &spec(false), "")).is_empty());
        let split = KernelSpec {
            kv_two_in_flight: true,
            attn_spread: false,
            ..spec(false)
        };
        assert_eq!(
            att(&defines(&cfg, &split, "")),
            ["-DMK_INFLIGHT_ATT_STREAM=2"]
        );
        assert_eq!(
            att(&defines(&cfg, &split, "-DMK_INFLIGHT_ATT_STREAM=3")),
            ["-DMK_INFLIGHT_ATT_STREAM=3"]
        );
    }
}

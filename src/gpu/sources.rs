//! The CUDA sources, embedded in the binary and assembled into compilation units.

use super::megakernel::{abi, layout};

const COMMON: &str = include_str!("../../megakernel/common.cuh");
/// RoPE's angle, shared by every path (and tested alone against f64: tests/gpu_rope.rs).
pub const ROPE: &str = include_str!("../../kernels/rope.cuh");
/// Qwen's q/k/v bias and q/k norm, shared by the graph baseline and prefill.
const QKV_EXTRAS: &str = include_str!("../../kernels/qkv_extras.cuh");
/// cp.async helpers, shared by prefill attention and the baseline's split-KV attention.
const CP_ASYNC: &str = include_str!("../../kernels/cp_async.cuh");
const PREFILL: &str = include_str!("../../kernels/prefill/prefill.cu");
const PREFILL_WGMMA: &str = include_str!("../../kernels/prefill/attention_wgmma.cuh");
const BASELINE_ATTENTION: &str = include_str!("../../kernels/baseline/attention.cuh");
const BASELINE: &str = include_str!("../../kernels/baseline/baseline.cu");
/// The graph paths' fused MLP and fused attention + O projection (after baseline.cu, whose
/// helpers they use).
const BASELINE_MLP: &str = include_str!("../../kernels/baseline/mlp.cuh");
const BASELINE_ATTN_O: &str = include_str!("../../kernels/baseline/attn_o.cuh");
/// The folded RMS norm's block reduction and scaling, shared by baseline.cu and quant.cu.
const NORM: &str = include_str!("../../kernels/norm.cuh");
/// The quantised formats' decoding, shared by quant.cu and the megakernel's tiles.
const QUANT_DECODE: &str = include_str!("../../kernels/quant/decode.cuh");
const QUANT_KERNELS: &str = include_str!("../../kernels/quant/quant.cu");
const PIPELINE: &str = include_str!("../../megakernel/pipeline.cuh");
const RUNTIME: &str = include_str!("../../megakernel/runtime.cuh");
/// One header per instruction (model.cuh: what several of them read), in dependency order.
const OPS: [&str; 10] = [
    include_str!("../../megakernel/ops/model.cuh"),
    include_str!("../../megakernel/ops/rms_qkv_rope.cuh"),
    include_str!("../../megakernel/ops/attention.cuh"),
    include_str!("../../megakernel/ops/attn_reduce.cuh"),
    include_str!("../../megakernel/ops/o_proj.cuh"),
    include_str!("../../megakernel/ops/up_gate.cuh"),
    include_str!("../../megakernel/ops/down_proj.cuh"),
    include_str!("../../megakernel/ops/sample.cuh"),
    include_str!("../../megakernel/ops/rms_lm_head.cuh"),
    include_str!("../../megakernel/ops/argmax.cuh"),
];
/// The instruction table: the interpreter's only view of the instructions.
const TABLE: &str = include_str!("../../megakernel/ops.cuh");
const LOADER: &str = include_str!("../../megakernel/loader.cuh");
const MEGAKERNEL: &str = include_str!("../../megakernel/megakernel.cu");

/// The one-kernel-per-operation path (graph, graph + PDL, eager).
pub fn baseline() -> String {
    [
        COMMON,
        ROPE,
        QKV_EXTRAS,
        CP_ASYNC,
        BASELINE_ATTENTION,
        NORM,
        BASELINE,
        BASELINE_MLP,
        BASELINE_ATTN_O,
        &quant(),
    ]
    .join("\n")
}

/// Quantised weights' mat-vec, embedding and dequantisation (self-contained: both the
/// baseline and the prefill units include it).
pub fn quant() -> String {
    [NORM, QUANT_DECODE, QUANT_KERNELS].join("\n")
}

/// Batched prefill's kernels (src/gpu/prefill.rs).
pub fn prefill() -> String {
    [ROPE, QKV_EXTRAS, CP_ASYNC, PREFILL, PREFILL_WGMMA, &quant()].join("\n")
}

/// The query heads an Attention instruction computes (`MK_GROUP`): `attn_heads`, or a KV head's
/// whole group where it is 0.
pub fn instruction_heads(config: &crate::model::Config, attn_heads: usize) -> usize {
    if attn_heads == 0 {
        config.num_heads / config.num_kv_heads
    } else {
        attn_heads
    }
}

/// The preprocessor definitions the interpreter is compiled with for a model: its attention
/// shape and the lengths of its mat-vec rows, so that loops have constant trip counts, and the
/// attention scratch the host plans for it (checked by the kernel) with its partial outputs. `attn_heads`: the query
/// heads an Attention instruction computes (`MK_GROUP`; 0 for a KV head's whole group,
/// `MK_KV_GROUP`).
pub fn megakernel_defines(config: &crate::model::Config, attn_heads: usize) -> Vec<String> {
    let kv_group = config.num_heads / config.num_kv_heads;
    let group = instruction_heads(config, attn_heads);
    vec![
        format!(
            "-DMK_ATT_SCRATCH_FLOATS={}",
            layout::attention_scratch(group, config.head_dim)
        ),
        format!(
            "-DMK_ATT_PART_SLOTS={}",
            layout::attention_part_slots(group, config.head_dim)
        ),
        format!("-DMK_HEAD_DIM={}", config.head_dim),
        format!("-DMK_GROUP={group}"),
        format!("-DMK_KV_GROUP={kv_group}"),
        format!("-DMK_HIDDEN={}", config.hidden_size),
        format!("-DMK_Q_DIM={}", config.q_dim()),
        // Qwen's extra steps in QKV's store compile out for the models without them: the
        // checks alone cost 0.15 us per QKV store, on the critical path of every layer.
        format!("-DMK_QKV_BIAS={}", u8::from(config.qkv_bias)),
        format!("-DMK_QK_NORM={}", u8::from(config.qk_norm)),
    ]
}

/// The loader's bound on copies in flight while the consumers work on the instruction being
/// loaded (`MK_INFLIGHT_STREAM`, runtime.cuh), when a shape needs another than the kernel's
/// default of 4 tiles: none but the ring's (any value of at least the page count) where a
/// bf16 up-gate tile fills at most three quarters of its page. Measured on the H100
/// (BENCHMARKS.md, 2026-11-26, "the bigger shapes' streaming"): Llama-3.2-3B's 6 KiB rows fill
/// 12 of 16 KiB and decode 6.0% faster without the bound (2.636 -> 2.478 ms); the shapes whose
/// tiles fill 87.5% or more were as fast or slower without it (Qwen2.5-7B +1.0%, Llama-3.1-8B
/// +3.5%, Llama-3.2-1B +1.3%, Qwen3-4B -0.3%, Qwen3-1.7B 0%, SmolLM2 -0.3%).
pub fn stream_bound(config: &crate::model::Config, formats: &MatrixFormats) -> Option<String> {
    let row = 2 * config.hidden_size;
    let page = abi::PAGE_BYTES;
    let fill = (page / row) * row;
    (formats.gate_up == 0 && row <= page && 4 * fill <= 3 * page)
        .then(|| "-DMK_INFLIGHT_STREAM=1024".to_string())
}

/// The storage format of each kind of matrix the megakernel reads, as quant.cu's `WEIGHT_*`
/// codes (bf16 0, Q8_0 1, Q4_0 2, Q4_1 3, Q6_K 4): one per kind (layer 0's for the layers' kinds), so
/// the tiles' decoding compiles to the formats the model has and nothing else.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct MatrixFormats {
    pub qkv: i32,
    pub o: i32,
    pub gate_up: i32,
    pub down: i32,
    pub lm_head: i32,
    pub embed: i32,
    /// 0 when each kind has one format in every layer; else the mask (bit = code) of the
    /// formats the layers' q/k/v, output, gate/up and down matrices have, and the layer table
    /// carries each matrix's format (`MK_WT_MIXED` in megakernel/runtime.cuh).
    pub mixed: i32,
}

impl MatrixFormats {
    /// The definitions the megakernel is compiled with for these formats.
    ///
    /// Without a Q6_K matrix, `Q_HAS_Q6K=0` leaves Q6_K's case out of the formats' shared
    /// arithmetic (its header size in decode.cuh), so that the kernels of the other formats are
    /// the code they were before Q6_K existed: the small shapes' kernels move with any change of
    /// their code (BENCHMARKS.md).
    pub fn defines(&self) -> Vec<String> {
        let kinds = [
            ("QKV", self.qkv),
            ("O", self.o),
            ("GU", self.gate_up),
            ("DOWN", self.down),
            ("LM", self.lm_head),
            ("EMB", self.embed),
        ];
        let q6 = crate::model::WeightType::Q6_K.code();
        let has_q6 = kinds.iter().any(|&(_, v)| v == q6) || (self.mixed >> q6) & 1 != 0;
        kinds
            .iter()
            .map(|(k, v)| format!("-DMK_WT_{k}={v}"))
            .chain((self.mixed != 0).then(|| format!("-DMK_WT_MIXED={}", self.mixed)))
            .chain(std::iter::once(format!("-DQ_HAS_Q6K={}", has_q6 as i32)))
            .collect()
    }
}

/// The persistent interpreter (compile it with `megakernel_defines`): the host's definitions
/// (abi::prelude) first, its layout checks (abi::checks) last.
pub fn megakernel() -> String {
    let (prelude, checks) = (abi::prelude(), abi::checks());
    use crate::sampling::device::{PHILOX, SELECT};
    let mut parts = vec![
        COMMON,
        ROPE,
        QUANT_DECODE,
        &prelude,
        PIPELINE,
        RUNTIME,
        PHILOX,
        SELECT,
    ];
    parts.extend(OPS);
    parts.extend([TABLE, LOADER, MEGAKERNEL, &checks]);
    parts.join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::presets;

    /// Of the presets, only Llama-3.2-3B's bf16 up-gate tiles (two 6 KiB rows in a 16 KiB
    /// page) fill three quarters of a page or less; quantised up-gate rows keep the default.
    #[test]
    fn only_underfilled_bf16_tiles_stream_without_the_bound() {
        let bf16 = MatrixFormats::default();
        for name in presets::NAMES {
            let cfg = presets::by_name(name).unwrap();
            let bound = stream_bound(&cfg, &bf16);
            assert_eq!(
                bound.is_some(),
                *name == "llama-3.2-3b",
                "{name}: {bound:?}"
            );
        }
        let cfg = presets::by_name("llama-3.2-3b").unwrap();
        assert_eq!(
            stream_bound(&cfg, &bf16).as_deref(),
            Some("-DMK_INFLIGHT_STREAM=1024")
        );
        let q8 = MatrixFormats { gate_up: 1, ..bf16 };
        assert_eq!(stream_bound(&cfg, &q8), None);
    }
}

//! The CUDA sources, embedded in the binary and assembled into compilation units.

const COMMON: &str = include_str!("../../megakernel/common.cuh");
const ATTENTION: &str = include_str!("../../megakernel/attention.cuh");
const BASELINE: &str = include_str!("../../megakernel/baseline.cu");
const PIPELINE: &str = include_str!("../../megakernel/pipeline.cuh");
const RUNTIME: &str = include_str!("../../megakernel/runtime.cuh");
/// The instructions with code of their own; the three whose post step is one store loop
/// (OProjResidual, RmsUpGateSilu, DownProjPartial) are written out in the interpreter's switch.
const OPS: [&str; 5] = [
    include_str!("../../megakernel/ops/attention.cuh"),
    include_str!("../../megakernel/ops/attn_reduce.cuh"),
    include_str!("../../megakernel/ops/rms_qkv_rope.cuh"),
    include_str!("../../megakernel/ops/rms_lm_head.cuh"),
    include_str!("../../megakernel/ops/argmax.cuh"),
];
const MEGAKERNEL: &str = include_str!("../../megakernel/megakernel.cu");

/// The one-kernel-per-operation path (graph, graph + PDL, eager).
pub fn baseline() -> String {
    [COMMON, ATTENTION, BASELINE].join("\n")
}

/// The preprocessor definitions the interpreter is compiled with for a model: its attention
/// shape and the lengths of its mat-vec rows, so that loops have constant trip counts.
pub fn megakernel_defines(config: &crate::model::Config) -> Vec<String> {
    vec![
        format!("-DMK_HEAD_DIM={}", config.head_dim),
        format!("-DMK_GROUP={}", config.num_heads / config.num_kv_heads),
        format!("-DMK_HIDDEN={}", config.hidden_size),
        format!("-DMK_Q_DIM={}", config.q_dim()),
    ]
}

/// The persistent interpreter (compile it with `megakernel_defines`).
pub fn megakernel() -> String {
    let mut parts = vec![COMMON, PIPELINE, RUNTIME];
    parts.extend(OPS);
    parts.push(MEGAKERNEL);
    parts.join("\n")
}

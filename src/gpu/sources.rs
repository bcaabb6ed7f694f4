//! The CUDA sources, embedded in the binary and assembled into compilation units.

const COMMON: &str = include_str!("../../megakernel/common.cuh");
const ATTENTION: &str = include_str!("../../megakernel/attention.cuh");
const BASELINE: &str = include_str!("../../megakernel/baseline.cu");
const PIPELINE: &str = include_str!("../../megakernel/pipeline.cuh");
const GROUP_ATTENTION: &str = include_str!("../../megakernel/group_attention.cuh");
const MEGAKERNEL: &str = include_str!("../../megakernel/megakernel.cu");

/// The one-kernel-per-operation path (graph, graph + PDL, eager).
pub fn baseline() -> String {
    [COMMON, ATTENTION, BASELINE].join("\n")
}

/// The persistent interpreter.
pub fn megakernel() -> String {
    [COMMON, ATTENTION, GROUP_ATTENTION, PIPELINE, MEGAKERNEL].join("\n")
}
